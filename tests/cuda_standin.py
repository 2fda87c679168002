"""A stand-in CUDA driver for the tests that need Triton's JIT as it runs on a GPU, on a machine without
one: under it, in a process without the interpreter, a launch binds and specializes its arguments as
on a Hopper GPU, and reaches ``knobs.runtime.jit_cache_hook`` with the specialization data Triton
serializes (Triton compiles for CUDA targets without a driver). Such a process is started by ``run``,
whose script imports this module: ``import cuda_standin; cuda_standin.install()``."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent


def install() -> None:
    """Make the stand-in Triton's active driver: device 0, stream 0, an sm_90 target, torch's CPU."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    class Driver:
        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

    driver.set_active(Driver())


@contextlib.contextmanager
def recording() -> Iterator[list[str]]:
    """Within it, a launch that would compile records its specialization data (Triton's JSON) in the
    list it yields, and neither compiles nor launches."""
    from triton import knobs

    recorded: list[str] = []
    before = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = lambda *, compile=None, **_: recorded.append(compile["specialization_data"]) or True
    try:
        yield recorded
    finally:
        knobs.runtime.jit_cache_hook = before


def run(script: str, *args: str, env: dict[str, str] | None = None, timeout: float = 600) -> Any:
    """Run ``script`` in a new process without the interpreter, this folder importable; the JSON of
    the last line it prints."""
    path = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": path, **(env or {})}
    proc = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
