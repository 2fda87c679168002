"""cuBLASLt with no workspace for the GEMMs a CUDA graph captures from the FP8 tier.

On Hopper, torch's row-wise ``torch._scaled_mm`` (cuBLASLt's FP8 GEMMs, which the FP8 tier runs for its bf16
GEMMs: ops/fp8_linear.py) chooses kernels that use a workspace and clears that workspace before every GEMM:
each GEMM of a FLUX step came after a ``Memset``, 229 of them, about 0.9 ms a step between memset and GEMM.
With no workspace allowed, cuBLASLt chooses kernels that need none: no memset, and the call no slower (H200,
torch 2.11: 0.0546 against 0.0554 ms at FLUX's 4,096 × 3,072 × 3,072; docs/fp8.md, "The GEMM").

The size is one setting of the whole process, read by torch at every cuBLASLt call (torch 2.11: its
``CUBLASLT_WORKSPACE_SIZE`` environment variable, in KiB; later torch: the setter
``torch.backends.cuda.cublaslt_workspace_size``). ``no_workspace()`` sets it to 0 for the GEMMs inside the
block and puts it back after them, and only

- while the current stream is capturing a CUDA graph: the graph keeps the kernels chosen then, and the
  process's setting changes only during the capture (an eager call leaves it alone);
- on a (thread, device, stream) whose cuBLASLt workspace exists already: torch allocates a stream's workspace
  at its first cuBLASLt GEMM, at the size set then, and keeps it; a workspace allocated at 0 bytes would later be
  handed to cuBLASLt with the default size. So the first GEMM of each stream runs with the workspace torch
  gives it (and allocates it at the default size), the next ones without;
- where the user has not set ``CUBLASLT_WORKSPACE_SIZE``: theirs decides.

A program that runs cuBLASLt GEMMs on other threads during the capture shares the setting for that time (and,
on torch 2.11, the environment variable's writes with their reads): ``ops.fp8_linear.NO_CUBLASLT_WORKSPACE``
turns this off.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator

import torch

ENV = "CUBLASLT_WORKSPACE_SIZE"
_primed: set[tuple] = set()  # (thread, device, stream) whose cuBLASLt workspace a GEMM has allocated


def _setter() -> Callable[[int | None], int] | None:
    """torch's setter of the cuBLASLt workspace size, where this build has one (a CUDA build later than 2.11)."""
    if not hasattr(torch._C, "_cuda_setCublasLtWorkspaceSize"):
        return None
    return getattr(torch.backends.cuda, "cublaslt_workspace_size", None)


def _capturing_stream() -> tuple | None:
    """(thread, device, stream) of the current stream where it is capturing a CUDA graph, else None."""
    if not torch.cuda.is_available() or not torch.cuda.is_current_stream_capturing():
        return None
    stream = torch.cuda.current_stream()
    return threading.get_ident(), stream.device_index, stream.cuda_stream


@contextlib.contextmanager
def no_workspace() -> Iterator[bool]:
    """cuBLASLt with a 0-byte workspace for the GEMMs inside the block (yields whether it is), under the
    conditions of the module docstring."""
    key = _capturing_stream()
    if key is None or ENV in os.environ:
        yield False
        return
    if key not in _primed:  # this GEMM allocates the stream's workspace, at the size torch sets
        _primed.add(key)
        yield False
        return
    setter = _setter()
    if setter is not None:
        before = setter(None)
        setter(0)
        try:
            yield True
        finally:
            setter(before)
        return
    os.environ[ENV] = "0"
    try:
        yield True
    finally:
        os.environ.pop(ENV, None)
