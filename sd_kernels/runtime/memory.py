"""Device memory: budgets, their guard, and the weights' bytes.

Budget. A profile's ``memory_budget_mb`` is what the whole process may hold on the device (weights
and intermediates). ``BudgetGuard`` enforces it around a call, the way a phone would: it caps the
CUDA caching allocator at the budget (``torch.cuda.set_per_process_memory_fraction``), so no
allocation past it ever succeeds, and it tracks which module is running (global forward hooks), so
that the failure is a ``MemoryBudgetExceeded`` naming the module, the bytes it asked for and the
budget, instead of the allocator's anonymous OOM. Every module's return is also checked against the
budget (peak in use since the guard started), which catches the case the cap cannot: a budget above
what the device has left free, or a stats source other than CUDA (the tests' fakes). Autotuning a
kernel for a shape no tuning table holds (``tuning()``, around the timed launch) runs outside the cap
and the peak: it is a one-time cost whose choice is cached (a phone would tune ahead of time), and
Triton's timing alone allocates a 256 MiB buffer to flush the L2.

"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from sd_kernels.runtime import launch
from sd_kernels.runtime.graph_hooks import replay_safe

log = logging.getLogger(__name__)

MB = 2**20
_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


class MemoryBudgetExceeded(MemoryError):
    """A call needed more device memory than the active profile's budget."""

    def __init__(self, op: str, asked: int, budget: int, detail: str = "") -> None:
        self.op, self.asked, self.budget = op, asked, budget
        super().__init__(f"{op} needs {asked / MB:.1f} MB ({asked} bytes) of device memory in use, over the "
                         f"budget of {budget / MB:.1f} MB ({budget} bytes){detail}")


class CudaMemory:
    """What BudgetGuard reads and sets, for one CUDA device (tests pass a fake with these methods)."""

    def __init__(self, device: torch.device | int | None = None) -> None:
        if not isinstance(device, torch.device):
            device = torch.device("cuda", torch.cuda.current_device() if device is None else device)
        self.device = device

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def cap(self, budget: int | None) -> None:
        """Make the allocator refuse to hold more than ``budget`` bytes (None: the whole device)."""
        total = torch.cuda.get_device_properties(self.device).total_memory
        torch.cuda.set_per_process_memory_fraction(1.0 if budget is None else min(1.0, budget / total),
                                                   self.device)


def requested_bytes(oom: BaseException) -> int | None:
    """The allocation size an allocator OOM message reports ("Tried to allocate 2.00 GiB"), or None."""
    m = re.search(r"Tried to allocate ([\d.]+) (B|KiB|MiB|GiB|TiB)", str(oom))
    return None if m is None else int(float(m.group(1)) * _UNITS[m.group(2)])


class BudgetGuard:
    """``with BudgetGuard(budget, model): model(...)``: raise MemoryBudgetExceeded, naming the module,
    as soon as the call needs more than ``budget`` bytes in use (see the module docstring)."""

    def __init__(self, budget: int, model: nn.Module | None = None, label: str = "", stats: Any = None) -> None:
        self.budget, self.label = budget, label
        self.stats = CudaMemory() if stats is None else stats
        self.names = {id(m): n for n, m in model.named_modules()} if model is not None else {}
        self._stack: list[nn.Module] = []
        self._handles: list[Any] = []
        self._floor = 0  # the peak in use before the last ``tuning()``, which reset the counter

    def _name(self, module: nn.Module) -> str:
        name = self.names.get(id(module))
        where = f"{self.label}.{name}" if self.label and name else self.label or name
        return f"{where} ({type(module).__name__})" if where else type(module).__name__

    def _pre(self, module: nn.Module, args: Any) -> None:
        self._stack.append(module)

    def _post(self, module: nn.Module, args: Any, out: Any) -> None:
        self._stack.pop()
        peak = max(self._floor, self.stats.peak())
        if peak > self.budget:
            raise MemoryBudgetExceeded(self._name(module), peak, self.budget, " (peak in use when it returned)")

    def __enter__(self) -> BudgetGuard:
        self._stack.clear()
        self._floor = 0
        self.stats.reset_peak()
        self.stats.cap(self.budget)
        hooks = torch.nn.modules.module
        # replay-safe: a graphed call captured under the guard passed its checks, and a replay allocates nothing
        self._handles = [hooks.register_module_forward_pre_hook(replay_safe(self._pre)),
                         hooks.register_module_forward_hook(replay_safe(self._post))]
        _GUARDS.append(self)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        _GUARDS.remove(self)
        for h in self._handles:
            h.remove()
        self._handles = []
        self.stats.cap(None)
        if isinstance(exc, torch.OutOfMemoryError):
            asked = requested_bytes(exc)
            op = self._name(self._stack[-1]) if self._stack else self.label or "the call"
            in_use = self.stats.allocated()
            total = in_use + asked if asked is not None else in_use
            detail = f" (in use {in_use} bytes + asked {asked} bytes)" if asked is not None else ""
            raise MemoryBudgetExceeded(op, total, self.budget, detail) from exc


_UNGUARDED: set[tuple[str, str]] = set()  # (label, device) already logged as running without the guard
_GUARDS: list[BudgetGuard] = []  # the guards whose call is running, innermost last


@contextlib.contextmanager
def tuning():
    """Around a kernel's autotuning launch (``launch.Launcher``): the innermost running BudgetGuard's
    cap is lifted, and what the tuning holds (its timing buffer, the configs' launches) does not count
    toward the guard's peak; the peak in use before it still does. No guard running: nothing."""
    if not _GUARDS:
        yield
        return
    guard = _GUARDS[-1]
    guard._floor = max(guard._floor, guard.stats.peak())
    guard.stats.cap(None)
    try:
        yield
    finally:
        if isinstance(guard.stats, CudaMemory):
            torch.cuda.empty_cache()  # the freed timing buffer would stay reserved, over the cap
        guard.stats.reset_peak()
        guard.stats.cap(guard.budget)


launch.TUNING = tuning  # the launcher enters it around each tuning launch (it imports nothing above it)


def guarded(fn: Callable[..., Any], budget: int, model: nn.Module, label: str) -> Callable[..., Any]:
    """``fn`` run under ``BudgetGuard(budget, model, label)`` when its inputs are on CUDA."""

    def call(*args: Any, **kwargs: Any) -> Any:
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        if not tensors or tensors[0].device.type != "cuda":
            where = tensors[0].device.type if tensors else "no tensor"
            if (label, where) not in _UNGUARDED:
                _UNGUARDED.add((label, where))
                log.warning("sd_kernels: the %d MB memory budget is not enforced for %s: its inputs are on %s "
                            "(the guard measures CUDA memory)", budget >> 20, label, where)
            return fn(*args, **kwargs)
        with BudgetGuard(budget, model, label, CudaMemory(tensors[0].device)):
            return fn(*args, **kwargs)

    return call


def weights_mb(module: nn.Module) -> float:
    """Parameters and buffers, MB (shared tensors counted once)."""
    return weight_bytes(module) / MB


def weight_bytes(module: nn.Module) -> int:
    """Bytes of ``module``'s parameters and buffers, each tensor once (also on the meta device, where
    every tensor's address is 0: there tensors are told apart by identity)."""
    seen, total = set(), 0
    for t in (*module.parameters(), *module.buffers()):
        key = id(t) if t.device.type == "meta" else (t.data_ptr(), t.numel(), t.dtype)
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


@dataclasses.dataclass
class BudgetPlan:
    """How a pipeline's weights sit under a memory budget, checked before any work: ``weights``
    (bytes per component), ``allowance`` (bytes of intermediates counted per component: the
    profile's ``intermediate_budget_mb``), and whether all of it fits at once (``resident``)."""

    budget: int
    weights: dict[str, int]
    allowance: int
    # not resident, but each component fits alone: its weights are moved to the device for its call
    # and back after (the patch installs diffusers' model CPU offload: patches/memory_budget.py)
    swapped: bool = False

    @property
    def total(self) -> int:
        return sum(self.weights.values()) + self.allowance

    @property
    def resident(self) -> bool:
        return self.total <= self.budget

    def format(self) -> str:
        rows = [f"  {name:<16} {w / MB:9.1f} MB" for name, w in self.weights.items()]
        return "\n".join([f"memory plan: budget {self.budget / MB:.0f} MB", *rows,
                          f"  {'intermediates':<16} {self.allowance / MB:9.1f} MB (the profile's allowance)",
                          f"  {'total':<16} {self.total / MB:9.1f} MB: "
                          + ("fits, every component resident" if self.resident else
                             "over the budget at once: each component is moved to the device for its call and "
                             "back after (the largest of the offload's chain, with any model it keeps on the "
                             "device, fits with the intermediates)" if self.swapped else "over the budget")])


def plan_budget(components: dict[str, nn.Module], budget: int, allowance: int,
                chain: list[str] | None = None) -> BudgetPlan:
    """The BudgetPlan of ``components``; raises MemoryBudgetExceeded, naming the component and the
    bytes, when their weights and ``allowance`` bytes of intermediates cannot be held within
    ``budget``: first where one component alone cannot (no way of moving weights helps), then where
    all of them at once cannot and the weights cannot be moved in and out. ``chain``: the models a
    diffusers pipeline moves in and out one at a time (its ``model_cpu_offload_seq``; None: it cannot);
    the others stay on the device for the call (diffusers' offload keeps them there), so the plan is
    ``swapped`` where the largest of the chain, those and the allowance fit."""
    plan = BudgetPlan(budget, {name: weight_bytes(m) for name, m in components.items()}, allowance)
    for name, w in plan.weights.items():
        if w + allowance > budget:
            raise MemoryBudgetExceeded(name, w + allowance, budget, f" ({w} bytes of weights + {allowance} bytes "
                                       "of intermediates allowed by the profile), before any work")
    if not plan.resident and chain is not None:
        moved = [n for n in plan.weights if n in chain]
        stay = [n for n in plan.weights if n not in chain]
        largest = max(moved, key=plan.weights.get, default=None)
        held = [*([largest] if largest else []), *stay]
        need = sum(plan.weights[n] for n in held) + allowance
        if need > budget:
            parts = " + ".join(f"{n} {plan.weights[n] / MB:.1f} MB" for n in held)
            raise MemoryBudgetExceeded(f"the pipeline's weights moved in one model at a time ({parts} on the device "
                                       "at once)", need, budget, f" (with {allowance} bytes of intermediates allowed "
                                       "by the profile), before any work")
        plan.swapped = True
    elif not plan.resident:
        parts = " + ".join(f"{name} {w / MB:.1f} MB" for name, w in plan.weights.items())
        raise MemoryBudgetExceeded(f"the pipeline's weights held at once ({parts})", plan.total, budget,
                                   f" (with {allowance} bytes of intermediates allowed by the profile), before any "
                                   "work; each component alone would fit, but only a diffusers pipeline with a "
                                   "model_cpu_offload_seq can have its weights moved in and out")
    return plan


def peak_intermediate_bytes(fn: Callable[[], Any], stats: Any) -> tuple[int, Any]:
    """(peak allocated during ``fn()`` above what was allocated before it, its result)."""
    stats.reset_peak()
    base = stats.allocated()
    out = fn()
    if isinstance(stats, CudaMemory):
        torch.cuda.synchronize(stats.device)
    return stats.peak() - base, out


def weight_bytes_of(models: dict[str, nn.Module]) -> int:
    """Bytes of the parameters and buffers of ``models`` together, a tensor shared between them once."""
    return weight_bytes(nn.ModuleList(models.values())) if models else 0
