"""The precompile's compiler processes (sd_kernels/runtime/compile_worker.py, opt-in with
SD_KERNELS_COMPILE_PROCESSES=1): a package kernel's specialization, as Triton's jit_cache_hook records
it at a launch, compiles in a worker for a Hopper target into the disk cache, and Triton's own
``JITFunction.preload`` of the same data then finds that entry instead of compiling; what a worker
cannot do comes back as an error for the caller's threads to redo. Runs on CPU: Triton compiles for
CUDA targets without a driver, and a stand-in driver lets a launch reach the hook."""

import json
import os
import pathlib
import subprocess
import sys
import textwrap

from sd_kernels.runtime import precompile

HOPPER = ("cuda", 90, 32)
GELU = "sd_kernels.ops.gelu"

# In a process without the interpreter: a launch of the elementwise GELU kernel under a stand-in CUDA
# driver, recorded by the hook (as a dry run records it), compiled by a worker, then preloaded.
SCRIPT = textwrap.dedent("""
    import importlib, json, pathlib, sys
    import torch
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from sd_kernels.runtime import precompile

    class Driver:
        def get_current_device(self): return 0
        def get_current_stream(self, device=None): return 0
        def get_current_target(self): return GPUTarget("cuda", 90, 32)
        def get_active_torch_device(self): return torch.device("cpu")

    driver.set_active(Driver())
    jit = importlib.import_module("sd_kernels.ops.gelu")._ELEMENTWISE.jit
    recorded = []
    knobs.runtime.jit_cache_hook = lambda *, compile=None, **_: recorded.append(compile["specialization_data"]) or True
    x = torch.randn(64, 256).half()
    jit[(4,)](x, torch.empty_like(x), 64, 256, 256, 1, 256, GATED=False, ACT="tanh", BLOCK_R=16, BLOCK_C=256,
              num_warps=4)
    knobs.runtime.jit_cache_hook = None
    cache = pathlib.Path(sys.argv[1])
    cubins = lambda: sorted(str(p) for p in cache.rglob("*.cubin"))
    errors = precompile.compile_in_processes([(jit.fn.__module__, jit.fn.__qualname__, recorded[0])],
                                             ("cuda", 90, 32), 1, str(cache))
    after_worker = cubins()
    jit.preload(recorded[0])
    print(json.dumps({"errors": errors, "worker": after_worker, "preload": cubins()}))
""")


def _cubins(folder: pathlib.Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*.cubin")}


def test_a_workers_compilation_is_the_entry_tritons_preload_finds(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["errors"] == []
    assert len(result["worker"]) == 1  # compiled by the worker...
    assert result["preload"] == result["worker"]  # ...and found there by Triton's preload: nothing new


def test_what_a_worker_cannot_do_comes_back_as_errors(tmp_path):
    data = json.dumps({"name": f"{GELU}._other_kernel", "signature": {}, "constant_keys": [], "constant_vals": [],
                       "attrs_keys": [], "attrs_vals": [], "options": {}, "key": "k"})
    jobs = [("sd_kernels.ops.no_such_module", "_kernel", data),
            (GELU, "_elementwise_kernel", data),  # the data names another kernel
            (GELU, "_activation", data)]  # a Python function, not a kernel
    errors = precompile.compile_in_processes(jobs, HOPPER, 1, tmp_path)
    assert [e.split(":")[0] for e in errors] == [
        "sd_kernels.ops.no_such_module._kernel", f"{GELU}._elementwise_kernel", f"{GELU}._activation"]
    assert "ModuleNotFoundError" in errors[0] and "_other_kernel" in errors[1] and "not a Triton kernel" in errors[2]
    broken = precompile.compile_in_processes([(GELU, "_elementwise_kernel", "{not json")], HOPPER, 1, tmp_path)
    assert len(broken) == 1 and "JSONDecodeError" in broken[0]
    assert _cubins(tmp_path) == set()
