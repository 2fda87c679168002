"""Channels-last (NHWC) weights for the pipeline parts the active profile names.

On the H100, cuDNN's convolutions run fastest on NHWC activations, and PyTorch keeps a conv's output
in the memory format of its input or weight: with channels_last conv weights, a whole UNet runs NHWC
from its first conv on (the NCHW latents are read once, in conv_in), and so do the GroupNorm kernel
(ops/group_norm.py reads either layout through one spatial stride) and the attention processor
(diffusers' ``view(B, C, H·W).transpose(1, 2)`` of an NHWC map is already [B, H·W, C] in memory).
Measured on the H100, SD1.5 UNet step, batch 2, from CUDA graphs: stock 12.26 → 10.60 ms; patched
10.68 → 7.69 ms (bench/results/2026-11-22-h100-layout/).

One place in diffusers breaks the chain: a Transformer2DModel with a 1×1 conv ``proj_out`` (SD1.5,
SD2.x's conv variants) hands it ``permute(0, 3, 1, 2).contiguous()``, an NCHW map, and a 1×1 weight
is NCHW and NHWC at once, so the conv, the residual add and everything after it ran NCHW: on the
H100, 21 of SD1.5's 29 deep 3×3 conv calls per step then saw NCHW inputs (bench.unet_kernels). A
forward pre-hook on each such ``proj_out`` lays its input NHWC (one copy of the attention output,
a few µs at SD1.5's largest map) and the UNet stays NHWC from ``conv_in`` to ``conv_out``.

The profile's ``channels_last`` lists the parts ("unet", "vae"). The patch converts every 4-D
parameter of such a model that is not channels_last yet, in place (``param.data``: the Parameter
objects stay, their storage is re-laid, no extra copy is kept), and unpatch converts exactly those
back to contiguous NCHW: the values never change, so outputs are bit-identical after unpatch.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from sd_kernels.ops.layout import is_channels_last
from sd_kernels.profiles import active_profile

from .families import family_of
from .record import PatchRecord
from .registry import register


def part_of(model: nn.Module) -> str | None:
    """The pipeline part a model plays ("unet", "vae"), from its family; None for others."""
    fam = family_of(model)
    return fam.part if fam else None


def makes_channels_last(model: nn.Module, record: PatchRecord) -> bool:
    """Whether this patch runs ``model`` channels_last (the op family is on and the profile names it)."""
    return "channels_last" in record.ops and part_of(model) in active_profile().channels_last


@register("channels_last")
def patch_layout(model: nn.Module, record: PatchRecord) -> None:
    if not makes_channels_last(model, record):
        return
    params = [p for p in model.parameters() if p.dim() == 4 and not p.is_contiguous(memory_format=torch.channels_last)]
    for p in params:
        p.data = p.data.contiguous(memory_format=torch.channels_last)
    # (``p.data`` is a new alias on every access: the storage pointer and strides identify ours)
    converted = [(p, p.data_ptr(), p.stride(), p.dtype, p.device) for p in params]

    def restore() -> None:
        for p, ptr, stride, dtype, device in converted:
            ours = (p.data_ptr(), p.stride()) == (ptr, stride)
            # ``.to(dtype or device)`` while patched re-allocates the data but keeps its layout: still
            # ours to lay back. Data of the same dtype and device assigned after the patch stays.
            moved = (p.dtype, p.device) != (dtype, device) and is_channels_last(p)
            if ours or moved:
                p.data = p.data.contiguous()

    record.on_undo(restore, "channels_last_weight", len(converted))
    hooks = [m.proj_out.register_forward_pre_hook(_nhwc_input) for m in model.modules()
             if type(getattr(m, "proj_out", None)) is nn.Conv2d]
    record.on_undo(lambda: [h.remove() for h in hooks], "channels_last_input", len(hooks))


def _nhwc_input(module: nn.Module, args: tuple) -> tuple | None:
    x = args[0]
    if isinstance(x, torch.Tensor) and x.dim() == 4 and not is_channels_last(x):
        return (x.contiguous(memory_format=torch.channels_last), *args[1:])
    return None
