"""cuBLASLt with no workspace, held while an FP8 tier on torch's ``_scaled_mm`` is patched.

On Hopper, torch's row-wise ``torch._scaled_mm`` (cuBLASLt's FP8 GEMMs, which the FP8 tier runs for its bf16
GEMMs: ops/fp8_linear.py) chooses kernels that use a workspace and clears that workspace before every GEMM:
each GEMM of a FLUX step came after a ``Memset``, 229 of them, about 0.9 ms a step between memset and GEMM.
With no workspace allowed, cuBLASLt chooses kernels that need none: no memset, and the GEMM itself no slower
(H200, torch 2.11: 0.0546 against 0.0554 ms at FLUX's 4,096 × 3,072 × 3,072; docs/fp8.md, "The GEMM").

The size is one setting of the whole process, so ``hold`` sets it and returns the step that sets it back, and
the FP8 patch holds it from ``patch`` to ``unpatch`` (its record's undo). Holds nest: the setting goes back
when the last one is released. Two ways, by torch version:

- torch with ``torch.backends.cuda.cublaslt_workspace_size`` and its setter (later than 2.11): that setter;
- older torch, which reads the ``CUBLASLT_WORKSPACE_SIZE`` environment variable at every cuBLASLt call (torch
  2.11 on the H200: a variable set in the running process removed the memsets, unset they came back): the
  variable, set to 0 and removed again.

A ``CUBLASLT_WORKSPACE_SIZE`` the user set is left as it is (``hold`` returns None): theirs decides.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

ENV = "CUBLASLT_WORKSPACE_SIZE"
_holds = 0
_set_back: Callable[[], None] | None = None  # undoes the first hold's change


def _setter() -> Callable[[int | None], int] | None:
    """torch's setter of the cuBLASLt workspace size, where this build has one (a CUDA build later than 2.11)."""
    if not hasattr(torch._C, "_cuda_setCublasLtWorkspaceSize"):
        return None
    return getattr(torch.backends.cuda, "cublaslt_workspace_size", None)


def held() -> int:
    """How many holds are in force."""
    return _holds


def hold() -> Callable[[], None] | None:
    """cuBLASLt's workspace set to 0 bytes until the returned release is called (once; later calls do nothing);
    None where the user set ``CUBLASLT_WORKSPACE_SIZE`` themselves."""
    global _holds, _set_back
    if _holds == 0:
        if ENV in os.environ:
            return None
        setter = _setter()
        if setter is not None:
            before = setter(None)
            setter(0)
            _set_back = lambda: setter(before)  # noqa: E731
        else:
            os.environ[ENV] = "0"
            _set_back = lambda: os.environ.pop(ENV, None)  # noqa: E731
    _holds += 1
    released = False

    def release() -> None:
        global _holds, _set_back
        nonlocal released
        if released:
            return
        released = True
        _holds -= 1
        if _holds == 0 and _set_back is not None:
            set_back, _set_back = _set_back, None
            set_back()

    return release
