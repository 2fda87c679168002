"""cuBLASLt with no workspace for the FP8 GEMMs our CUDA graphs capture.

On Hopper, torch's row-wise ``torch._scaled_mm`` (cuBLASLt's FP8 GEMMs, which the FP8 tier runs for its bf16
and fp16 GEMMs: ops/fp8_linear.py) chooses kernels that use a workspace and clears that workspace before every GEMM:
each GEMM of a FLUX step came after a ``Memset``, 229 of them, about 0.9 ms a step between memset and GEMM.
With no workspace allowed, cuBLASLt chooses kernels that need none: no memset, and the call no slower (H200,
torch 2.11: 0.0546 against 0.0554 ms at FLUX's 4,096 × 3,072 × 3,072; docs/fp8.md, "The GEMM").

The size is one setting of the whole process, read by torch at every cuBLASLt call (torch 2.11: its
``CUBLASLT_WORKSPACE_SIZE`` environment variable, in KiB; later torch: the setter
``torch.backends.cuda.cublaslt_workspace_size``). ``no_workspace()`` sets it to 0 for the GEMMs inside the
block and puts it back after them, and only

- inside ``capture_scope()``, which our CUDA graph captures open (patches/graph_capture.py): the graph keeps the
  kernels chosen then; an eager call, and a graph anyone else captures (torch.compile's), leave it alone;
- on a cuBLAS handle and stream that already ran such a GEMM in this scope, unheld: torch 2.11 allocates a
  (handle, stream)'s workspace at its first cuBLASLt GEMM, at the size set then, and keeps it (until its
  workspaces are cleared), so a workspace allocated at 0 bytes would later be handed to cuBLASLt with the
  default size. The first GEMM of each handle and stream in a scope runs with the workspace torch gives it;
- where the user has not set ``CUBLASLT_WORKSPACE_SIZE``: theirs decides.

One lock covers the setting, its restoring and the priming GEMMs, so two of our threads capturing at once
neither take each other's 0 for the user's setting nor prime a stream while the other holds it. cuBLASLt GEMMs
that other code runs on other threads during a held call share the setting for that moment (and, on torch
2.11, the environment variable's writes with their reads): ``ops.fp8_linear.NO_CUBLASLT_WORKSPACE`` turns this
off.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator

import torch

ENV = "CUBLASLT_WORKSPACE_SIZE"
_lock = threading.RLock()
_scope = threading.local()  # .primed: the (handle, stream) keys of this thread's open capture scope


def _setter() -> Callable[[int | None], int] | None:
    """torch's setter of the cuBLASLt workspace size, where this build has one (a CUDA build later than 2.11)."""
    if not hasattr(torch._C, "_cuda_setCublasLtWorkspaceSize"):
        return None
    return getattr(torch.backends.cuda, "cublaslt_workspace_size", None)


@contextlib.contextmanager
def capture_scope() -> Iterator[None]:
    """The calls a CUDA graph captures here may run their FP8 GEMMs without a workspace (``no_workspace``);
    each handle and stream primed anew."""
    before = getattr(_scope, "primed", None)
    _scope.primed = set()
    try:
        yield
    finally:
        _scope.primed = before


def _key() -> tuple | None:
    """(cuBLAS handle, stream) of the current stream where it is capturing inside ``capture_scope``, else None."""
    if getattr(_scope, "primed", None) is None or not torch.cuda.is_current_stream_capturing():
        return None
    return torch.cuda.current_blas_handle(), torch.cuda.current_stream().cuda_stream


@contextlib.contextmanager
def no_workspace() -> Iterator[bool]:
    """cuBLASLt with a 0-byte workspace for the GEMMs inside the block (yields whether it is), under the
    conditions of the module docstring."""
    key = _key()
    if key is None:
        yield False
        return
    with _lock:  # no other thread of ours holds the setting: what is set is the user's
        if ENV in os.environ:
            yield False
            return
        if key not in _scope.primed:  # this GEMM makes the workspace where torch has none, at its default size
            yield False
            _scope.primed.add(key)  # once it ran
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
