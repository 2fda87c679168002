"""The memory patcher: fit a model into the patch's profile's budgets (mobile emulation).

Desktop profiles set no budgets and this patcher changes nothing. A profile with
``intermediate_budget_mb`` gets its feed-forwards chunked over tokens so that the GEGLU's 2n-wide
projection (at 4096 tokens the largest intermediate in a UNet step once flash attention stores no
scores) never exceeds ``profile.chunk_bytes()``, and its VAE decoder streamed in row bands within
the whole intermediate budget (stream_decode.py: the whole image's GroupNorm statistics, exact). A profile with
``memory_budget_mb`` gets the model's entry points run under ``memory.BudgetGuard``: past the budget
the call fails with ``MemoryBudgetExceeded`` naming the module, the bytes and the budget.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from sd_kernels.runtime.memory import MB, guarded, plan_budget

from .families import family_of
from .record import PatchRecord
from .stream_decode import streaming_forward


class ChunkedFeedForward(nn.Module):
    """A diffusers FeedForward run over slices of the tokens, each within ``max_bytes``.

    Tokens are independent in a feed-forward, so the slices' outputs are the unchunked output (the
    same kernels on fewer rows; bit-identical where the matmul does not pick another algorithm for
    another row count). Holds the original's ``net`` (same modules, same state_dict keys) and calls
    the original module itself, hooks and all.
    """

    def __init__(self, ff: nn.Module, max_bytes: int) -> None:
        super().__init__()
        self.net = ff.net
        object.__setattr__(self, "_original", ff)  # not a submodule: its parameters are net's
        self.max_bytes = max_bytes
        self.widest = max(m.out_features for m in ff.modules() if isinstance(m, nn.Linear))

    def chunk_tokens(self, batch: int, element_size: int) -> int:
        # The widest projection's output and as much again alive beside it (GEGLU's halves, its output).
        return max(1, self.max_bytes // (2 * batch * self.widest * element_size))

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        x = hidden_states
        if x.dim() < 2:
            return self._original(x)
        tokens = x.shape[-2]
        step = self.chunk_tokens(x.numel() // max(1, tokens * x.shape[-1]), x.element_size())
        if step >= tokens:
            return self._original(x)
        first = self._original(x[..., :step, :])
        out = first.new_empty(*x.shape[:-1], first.shape[-1])
        out[..., :step, :] = first
        del first
        for t0 in range(step, tokens, step):
            out[..., t0:t0 + step, :] = self._original(x[..., t0:t0 + step, :])
        return out

    def extra_repr(self) -> str:
        return f"max_bytes={self.max_bytes}"


def _feed_forwards(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    from diffusers.models.attention import FeedForward

    return [(parent, name, child) for parent in model.modules() for name, child in parent._modules.items()
            if type(child) is FeedForward]


def patch_memory(model: nn.Module, record: PatchRecord) -> None:
    prof, fam = record.profile_spec, family_of(model)
    if prof.intermediate_budget_mb is not None:
        for parent, name, ff in _feed_forwards(model):
            record.set_attr(parent, name, ChunkedFeedForward(ff, prof.chunk_bytes()), "memory.ChunkedFeedForward")
        decoder = getattr(model, "decoder", None)
        if fam is not None and fam.stream_decode and decoder is not None:
            budget_bytes = prof.intermediate_budget_mb * 2**20
            record.set_attr(decoder, "forward", streaming_forward(decoder, budget_bytes, prof.stream_pack8),
                            "memory.streaming_vae_decode")
    budget = prof.memory_budget_bytes()
    if budget is not None:
        kind = type(model).__name__
        device = next(model.parameters()).device
        if device.type != "cuda":
            record.skip("", kind, f"memory budget {prof.memory_budget_mb} MB not enforced: the model is on "
                        f"{device} and the guard measures CUDA memory (each unguarded call is logged once)")
        for path in fam.guarded if fam else ():
            module = model.get_submodule(path)
            label = f"{kind}.{path}" if path else kind
            record.set_attr(module, "forward", guarded(module.forward, budget, module, label),
                            f"memory.budget({prof.memory_budget_mb} MB)")


def memory_plan(obj: object, prof: Any):
    """Under a profile with a memory budget: the weights of every model the pipeline holds (or of the
    bare model), checked against the budget with the profile's intermediate allowance
    (``sd_kernels.runtime.memory.plan_budget``); None without a budget."""
    budget = prof.memory_budget_bytes()
    if budget is None:
        return None
    if isinstance(obj, nn.Module):
        held = {type(obj).__name__: obj}
    else:
        held = {k: m for k, m in (getattr(obj, "components", None) or {}).items() if isinstance(m, nn.Module)}
    chain = None if isinstance(obj, nn.Module) else offload_chain(obj)
    return plan_budget(held, budget, (prof.intermediate_budget_mb or 0) * MB, chain)


# ---------------------------------------------------------------------------------------------
# Weights moved in and out under a budget they do not fit at once (memory.BudgetPlan.swapped)


def offload_chain(pipe: object) -> list[str] | None:
    """The models ``pipe`` can move to the device one at a time for their calls (diffusers' model CPU
    offload follows its ``model_cpu_offload_seq``; one it excludes stays on the device), or None where
    it cannot (no sequence, no ``enable_model_cpu_offload``, accelerate not installed)."""
    from diffusers.utils import is_accelerate_available

    seq = getattr(pipe, "model_cpu_offload_seq", None)
    if not seq or not callable(getattr(pipe, "enable_model_cpu_offload", None)) or not is_accelerate_available():
        return None
    excluded = set(getattr(pipe, "_exclude_from_cpu_offload", ()) or ())
    return [name for name in seq.split("->") if name not in excluded]


_OFFLOAD_ATTRS = ("_offload_gpu_id", "_offload_device", "_all_hooks")  # what enable_model_cpu_offload sets on the pipe


def install_swap(pipe: Any, record: PatchRecord) -> None:
    """Each model of ``pipe`` kept on the CPU and moved to its device for its call (the previous one
    moved back: diffusers' ``enable_model_cpu_offload``, one model on the device at a time), undone
    exactly: the hooks removed, each model back on the device it was on, every attribute the offload
    added (on the pipeline and the models) dropped. A pipeline not on a CUDA device is left as it is
    (the budget is not enforced there either) and the record says so."""
    comps = {k: m for k, m in pipe.components.items() if isinstance(m, nn.Module)}
    where = {k: next(iter(m.parameters()), torch.empty(0)).device for k, m in comps.items()}
    device = next((d for d in where.values() if d.type == "cuda"), None)
    record.scope = ""
    if device is None:
        record.skip("", "weights", f"not moved in and out under the budget: the pipeline is on "
                    f"{', '.join(sorted({str(d) for d in where.values()}))} (the budget is enforced on CUDA)")
        return
    own_forward = {k for k, m in comps.items() if "forward" in vars(m)}  # ours (the budget guard's) or a user's
    added = [a for a in _OFFLOAD_ATTRS if a not in vars(pipe)]

    def restore() -> None:
        pipe.remove_all_hooks()  # each hooked model's forward set back from the hook's _old_forward
        for k, m in comps.items():
            m.to(where[k])
            if k not in own_forward:  # the bound method the hook removal leaves as an attribute
                vars(m).pop("forward", None)
        for a in added:
            vars(pipe).pop(a, None)

    record.on_undo(restore, "memory.weights_moved_in_and_out", len(comps))  # first: a failure part way is undone
    pipe.enable_model_cpu_offload(device=device)
