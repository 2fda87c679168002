"""diffusers' ``Upsample2D`` (nearest 2× then a 3×3 conv: the UNet's and the VAE decoder's upsamplers)
onto ``ops.upsample_conv2d``: one 2×2 convolution of the four output phases at the input's
resolution, interleaved with the bias into the output (docs/kernels/upsample.md). 2.25x fewer
multiply-adds than the conv on the upsampled copy, and no upsampled copy.

Each exact-type ``Upsample2D`` whose conv it can compute becomes, in place, a
``PolyphaseUpsample2D`` (``record.set_class``: the same object, parameters and state_dict; a
subclass that adds a forward). That forward runs the polyphase op on the calls it covers (an input
of at least the profile's ``polyphase_min_pixels``, no ``output_size`` other than 2×, no deprecated
``scale``, the conv still a plain 3×3 ``nn.Conv2d`` or our ``WinogradConv2d``) and diffusers' own
``Upsample2D.forward`` on the rest (a small map, a LoRA-wrapped conv). Its phases (16/9 of the
conv's weight bytes) are cached on the module, recomputed when the weight changes in place (a fused
LoRA), and freed by ``unpatch``.

The shipped mobile profiles disable it (``disabled_ops``): the phases are weights that a memory
budget's plan does not count (118 MB for SD1.5's UNet in fp16), and their streamed decode already
runs its upsamplers this way. A profile of one's own with a memory budget should list it too.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from diffusers.models.upsampling import Upsample2D

from sd_kernels.ops import custom_ops
from sd_kernels.ops.upsample import PhaseCache
from sd_kernels.ops.weight_cache import weight_version
from sd_kernels.ops.winograd import unsupported_conv
from sd_kernels.profiles import active_profile, scoped

from .diffusers_sources import is_verified
from .record import PatchRecord
from .winograd import WinogradConv2d

OP = "upsample_conv2d"
_CONV_TYPES = (nn.Conv2d, WinogradConv2d)  # exact types whose forward is the plain 3×3 conv


def conv_of(m: nn.Module) -> nn.Module | None:
    return m.conv if m.name == "conv" else getattr(m, "Conv2d_0", None)


def unsupported(m: nn.Module) -> str | None:
    """Why this Upsample2D is not nearest-2× + a 3×3 same-size conv we can fold, or None."""
    if not m.use_conv or m.use_conv_transpose or not m.interpolate:
        return "not nearest-2x followed by a conv"
    if m.norm is not None:
        return "a norm before the upsampling"
    conv = conv_of(m)
    if type(conv) not in _CONV_TYPES:
        return f"its conv is a {type(conv).__name__}"
    return unsupported_conv(conv.weight, conv.stride, conv.padding, conv.dilation, conv.groups, conv.padding_mode)


class PolyphaseUpsample2D(Upsample2D):
    """Upsample2D whose covered calls run ``ops.upsample_conv2d`` (see the module docstring); set as an
    Upsample2D's class by the patch, never constructed."""

    profile_scoped = True

    @scoped
    def forward(self, hidden_states: torch.Tensor, output_size=None, *args, **kwargs) -> torch.Tensor:
        conv = conv_of(self)
        x = hidden_states
        if (args or kwargs or type(conv) not in _CONV_TYPES or x.dim() != 4
                or (output_size is not None and tuple(output_size) != (2 * x.shape[2], 2 * x.shape[3]))
                or x.shape[2] * x.shape[3] < _min_pixels()):
            return super().forward(hidden_states, output_size, *args, **kwargs)
        assert x.shape[1] == self.channels
        if self._phases.weight is not conv.weight:  # the parameter was replaced
            self._phases = PhaseCache(conv.weight)
        return custom_ops.upsample_conv2d(x, conv.weight, conv.bias)

    def transformed_bytes(self) -> int:
        """Bytes held by the cached phases (the memory this module adds)."""
        return self._phases.nbytes()

    def graph_state(self) -> tuple:
        """What a CUDA graph replaying this upsampler bakes in: the phases of the weight as it was. A
        captured graph is stale once this changes; its re-capture derives them anew."""
        w = conv_of(self).weight
        return id(w), *weight_version(w)


@torch.compiler.assume_constant_result
def _min_pixels() -> int:
    """The active profile's ``polyphase_min_pixels`` (a constant for torch.compile: shapes are static there)."""
    return active_profile().polyphase_min_pixels


def patch_upsample(model: nn.Module, record: PatchRecord) -> None:
    """Swap each exact-type ``Upsample2D`` of ``model`` that ``unsupported`` passes for a
    ``PolyphaseUpsample2D``; none where the profile disables the op or diffusers' forward is not the
    one ours was written against."""
    found = [(path, m) for path, m in model.named_modules() if type(m) is Upsample2D]  # each module once
    if not found:
        return
    reason = record.profile_spec.disabled_reason(OP)
    if reason is None and not is_verified(Upsample2D.forward):
        reason = "Upsample2D.forward is not the source sd_kernels verified (another diffusers version)"
    for path, child in found:
        why = reason or unsupported(child)
        if why is not None:
            record.skip(path, "Upsample2D", f"left as it is: {why}")
            continue
        record.set_attr(child, "_phases", PhaseCache(conv_of(child).weight), None)
        record.set_class(child, PolyphaseUpsample2D, "upsample.polyphase")
