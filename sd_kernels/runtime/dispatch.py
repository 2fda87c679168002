"""The one place that decides, per call, whether an op runs its Triton kernel or the reference.

Every public op in ``sd_kernels.ops`` asks ``use_kernel`` once per call and then runs either its
Triton launcher or the function of the same name in ``sd_kernels.reference``. A fallback is never
silent: ``fallbacks()`` counts every (op, reason) pair, and each reason is logged once per process as a
warning, when the first op meets it (the pairs after it at DEBUG level). Where the reference path is
the active profile's design (the ``cpu`` profile on a device the kernels do not run on), the line is
DEBUG too: nothing there is amiss.

``SD_KERNELS_BACKEND`` overrides the choice: ``auto`` (default), ``triton`` (a kernel that cannot
run raises instead of falling back) or ``reference`` (never run a kernel).
"""

from __future__ import annotations

import collections
import functools
import logging
import os

import torch

from sd_kernels import profiles

log = logging.getLogger(__name__)

BACKENDS = ("auto", "triton", "reference")
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what every kernel takes
_fallbacks: collections.Counter = collections.Counter()
_warned: set[str] = set()  # the reasons logged as a warning in this process
NO_KERNEL_DEVICE = "Triton kernels need a CUDA device (or TRITON_INTERPRET=1 on CPU)"


class KernelUnavailable(RuntimeError):
    """A kernel was explicitly requested (SD_KERNELS_BACKEND=triton) but cannot run this call."""


def interpreting() -> bool:
    """True when Triton kernels run on the CPU through the interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def _triton_missing() -> str | None:
    try:
        import triton  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install
        return f"triton is not importable ({exc})"
    return None


def backend() -> str:
    mode = os.environ.get("SD_KERNELS_BACKEND", "auto")
    if mode not in BACKENDS:
        raise ValueError(f"SD_KERNELS_BACKEND must be one of {BACKENDS}, got {mode!r}")
    return mode


@torch.compiler.assume_constant_result
def reference_backend() -> bool:
    """SD_KERNELS_BACKEND=reference: its promise is stock's arithmetic, bit for bit, so the patches' rewrites that
    round differently (folds, joined GEMMs, fused tails) step aside too. A constant for torch.compile, read when
    tracing."""
    return backend() == "reference"


def _device_reason(tensors: tuple[torch.Tensor | None, ...]) -> str | None:
    devices = {t.device for t in tensors if t is not None}
    if len(devices) > 1:
        return f"inputs on several devices {sorted(map(str, devices))}"
    (device,) = devices
    return device_reason(device)


def device_reason(device: torch.device | str) -> str | None:
    """Why the kernels cannot run on ``device`` at all (None: they can), for checks before any work."""
    kind = torch.device(device).type
    if kind == "cuda" or (kind == "cpu" and interpreting()):
        return _triton_missing()
    return f"{NO_KERNEL_DEVICE}; got {kind}"


def tensor_reason(*tensors: torch.Tensor | None, also: tuple[torch.dtype, ...] = ()) -> str | None:
    """The reason every kernel shares for refusing inputs, or None: a dtype outside KERNEL_DTYPES
    (and ``also``), or an input that autograd would need to track (the kernels are inference-only)."""
    for t in tensors:
        if t is None:
            continue
        if t.dtype not in KERNEL_DTYPES and t.dtype not in also:
            return f"dtype {t.dtype} (the kernels take float16, bfloat16, float32)"
        if t.requires_grad and torch.is_grad_enabled():
            return "input requires grad (the kernels are inference-only)"
    return None


def use_kernel(op: str, *tensors: torch.Tensor | None, unsupported: str | None = None,
               any_device: bool = False) -> bool:
    """Decide whether ``op`` runs its Triton kernel on these inputs.

    ``unsupported`` is the op's own reason why its kernel cannot take this call (a shape or dtype
    off its ground), or None. ``any_device``: the op is made of torch calls (a rewrite, no Triton
    kernel), so no device is refused. Returns False (run the reference) or True (run the kernel).
    """
    mode = backend()
    if mode == "reference":
        return False
    reason = unsupported or (None if any_device else _device_reason(tensors))
    if reason is None:
        reason = profiles.active_profile().disabled_reason(op)
    if reason is None:
        return True
    if mode == "triton":
        raise KernelUnavailable(f"{op}: {reason}")
    _count(op, reason, "runs the PyTorch reference")
    return False


def declined(op: str, reason: str) -> None:
    """A kernel the profile chose declined this call and another path runs it: logged the first time
    per (op, reason) and counted in ``fallbacks()``, like a fallback (it never raises)."""
    _count(op, reason, "declined, the profile's other path runs")


def _count(op: str, reason: str, what: str) -> None:
    """Count one fallback of ``op`` for ``reason``; the first of each pair is logged (see the module
    docstring for which are warnings)."""
    if _fallbacks[(op, reason)] == 0:
        by_design = reason.startswith(NO_KERNEL_DEVICE) and profiles.active_profile().name == "cpu"
        quiet = by_design or reason in _warned
        log.log(logging.DEBUG if quiet else logging.WARNING, "sd_kernels: %s %s: %s", op, what, reason)
        if not quiet:
            _warned.add(reason)
    _fallbacks[(op, reason)] += 1


def fallbacks() -> dict[tuple[str, str], int]:
    """How often each (op, reason) fell back to the reference since start (or the last reset)."""
    return dict(_fallbacks)


def reset_fallbacks() -> None:
    _fallbacks.clear()
    _warned.clear()


# ---------------------------------------------------------------------------------------------
# Plans per call signature (ops/attention.py, ops/gelu.py): an op that decided a call from scratch may
# keep what it derived under a key of everything the decision read, and launch from it when the same
# signature comes again. Calls that fall back are never kept: use_kernel sees, logs and counts each.

MAX_PLANS = 1024  # a bound on one op's kept plans: past it, they start over (each signature plans again once)


def plan_context(t: torch.Tensor) -> tuple:
    """The part of a plan's key that is not the call's own tensors and arguments: the active profile
    (by identity: set_profile, patch(profile=) and a test's monkeypatch all install another object),
    SD_KERNELS_BACKEND, and whether a kernel can run on ``t``'s device at all (CUDA, or the interpreter)."""
    return id(profiles.active_profile()), os.environ.get("SD_KERNELS_BACKEND"), t.is_cuda or interpreting()


def keep_plan(plans: dict, key: tuple, plan: object, bound: int = MAX_PLANS) -> None:
    """``plans[key] = plan``, at most ``bound`` of them; the plan holds the active profile, so that the
    profile's id in its key cannot be reused by another object while the plan is kept."""
    if len(plans) >= bound:
        plans.clear()
    plan.profile = profiles.active_profile()
    plans[key] = plan
