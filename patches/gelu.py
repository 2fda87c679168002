"""Patch diffusers' GELU-family modules (models/activations.py) onto sd_kernels' GELU kernels.

| diffusers module  | computes                              | replacement runs                          |
|-------------------|---------------------------------------|-------------------------------------------|
| GEGLU             | a, g = proj(x).chunk(2); a·gelu(g)    | ``geglu(proj(x))`` or ``linear_geglu``      |
| GELU              | gelu(proj(x), approximate)            | ``linear_gelu(x, proj.weight, proj.bias)`` |
| ApproximateGELU   | y = proj(x); y·sigmoid(1.702·y)       | ``quick_gelu(proj(x))``                   |

SD's transformer blocks hold these as ``FeedForward.net[0]`` (``net`` is a ModuleList; its child
slots are the string keys "0", "1", ... of ``_modules``, which is what ``record.set_attr`` swaps).
Each replacement holds the original ``proj`` module itself, so parameters (and their state_dict
keys) stay the very same objects, and a LoRA-wrapped ``proj`` keeps working.

Whether GEGLU runs its projection through cuBLAS + our geglu (two kernels, the 2n-wide projection
written once and read once) or our fused ``linear_geglu`` (one kernel, no intermediate, but a Triton
matmul instead of cuBLAS) is decided per shape by ``fuse_linear_geglu``; see docs/kernels/gelu.md.
GELU's ``linear_gelu`` is cuBLASLt's matmul with its bias + tanh-GELU epilogue where the profile sets
``gelu_epilogue`` (the DiTs' feed-forward), else ``gelu(proj(x))``; a ``proj`` that is not exactly an
``nn.Linear`` (LoRA-wrapped) always runs as itself, then ``gelu``.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from sd_kernels.ops.custom_ops import geglu, gelu, linear_geglu, linear_gelu, quick_gelu
from sd_kernels.profiles import active_profile, scoped

from .record import PatchRecord


@torch.compiler.assume_constant_result
def fuse_linear_geglu(rows: int, k: int, n: int) -> bool:
    """Run GEGLU's projection as the fused ``linear_geglu`` for x [rows, k] → [rows, n]? The fused
    matmul+GEGLU saves the 2n-wide intermediate (4·M·n bytes per element size written and read)
    against 4·M·n·K flops of matmul, so its edge shrinks as K grows: the active profile decides
    (``Profile.fuses_linear_geglu``; never in the shipped profiles: the GPU measurements of
    bench/ops_gelu.py have not found a K where it wins). A constant for torch.compile, decided
    when it traces (the profile cannot be read from traced code)."""
    return active_profile().fuses_linear_geglu(k)


class _Replacement(nn.Module):
    """Holds the original's ``proj`` (same module, same Parameters) and its training flag."""

    profile_scoped = True

    def __init__(self, original: nn.Module) -> None:
        super().__init__()
        self.proj = original.proj
        self.train(original.training)


class FusedGEGLU(_Replacement):
    @scoped
    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        # diffusers ignores the deprecated positional ``scale`` (and only warns): so do we.
        proj = self.proj
        if type(proj) is nn.Linear:
            k, n = proj.in_features, proj.out_features // 2
            if fuse_linear_geglu(hidden_states.numel() // max(k, 1), k, n):
                return linear_geglu(hidden_states, proj.weight, proj.bias)
        return geglu(proj(hidden_states))


class FusedGELU(_Replacement):
    def __init__(self, original: nn.Module) -> None:
        super().__init__(original)
        self.approximate = original.approximate

    @scoped
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        proj = self.proj
        if type(proj) is nn.Linear:
            return linear_gelu(hidden_states, proj.weight, proj.bias, self.approximate)
        return gelu(proj(hidden_states), self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


class FusedApproximateGELU(_Replacement):
    @scoped
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quick_gelu(self.proj(x))


def _replacements() -> dict[type, type]:
    from diffusers.models import activations

    return {
        activations.GEGLU: FusedGEGLU,
        activations.GELU: FusedGELU,
        activations.ApproximateGELU: FusedApproximateGELU,
    }


def patch_gelu(model: nn.Module, record: PatchRecord) -> None:
    """Swap every diffusers GEGLU / GELU / ApproximateGELU in ``model`` (exact types, not subclasses,
    whose forward we cannot vouch for) for its sd_kernels counterpart."""
    table = _replacements()
    slots = []
    for path, parent in model.named_modules():  # collected first: no swapping while walking the tree
        for name, child in parent._modules.items():
            if type(child) in table:
                slots.append((parent, name, child))
            elif isinstance(child, tuple(table)):
                record.skip(f"{path}.{name}".lstrip("."), type(child).__name__,
                            "subclass of a diffusers GELU module (its forward may differ)")
    for parent, name, child in slots:
        record.set_attr(parent, name, table[type(child)](child), f"gelu.{type(child).__name__}")
