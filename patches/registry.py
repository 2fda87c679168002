"""The op families the patch knows (``patch(ops=...)``) and the function that patches each, in the
order they run: one table, ``PATCHERS``.

A patcher has the signature ``patcher(model: nn.Module, record: PatchRecord) -> None``, reads the
patch's profile from ``record.profile_spec`` and makes every change through the record
(``set_attr``, ``set_class``, ``on_undo``), so that ``unpatch`` undoes it. Adding an op family is one
entry here (docs/contributing.md).
"""

from __future__ import annotations

from collections.abc import Callable

import torch.nn as nn

from . import (
    attention,
    channels_last,
    conv_bias,
    gelu,
    group_norm,
    layer_norm,
    memory_budget,
    unet_blocks,
    upsample,
    winograd,
)
from .record import PatchRecord

Patcher = Callable[[nn.Module, PatchRecord], None]

# In the order they run. No patcher reads another's changes today: winograd asks whether the model
# will run channels_last from the record's ops and the profile (patches/channels_last.py
# makes_channels_last), not from the re-laid weights; memory's chunked feed-forward calls the
# original FeedForward, whose GELU modules gelu swaps before or after; the streamed decode finds
# GroupNorms by isinstance, fused ones included; layer_norm's block forwards call the blocks' attention
# and feed-forward modules (attn1 / attn2 / ff, SD3's attn / ff / ff_context) as they are when they
# run (attention's processors, gelu's modules, memory's chunked feed-forward, whichever ran before
# or after); upsample changes the Upsample2D modules' class in place and reads their conv's weight,
# whatever winograd makes of the conv module (a WinogradConv2d holds the same weight); the winograd family then
# gives the convs left on cuDNN (exact nn.Conv2d, a WinogradConv2d is not) their bias add (patches/conv_bias.py),
# which the group_norm family's ResNet forward calls through ``_conv_forward``. The order is
# fixed (alphabetical, as it happens) so that a record undoes in the same order whatever ``ops=``
# says, and a new dependency goes here, with its reason.
PATCHERS: dict[str, Patcher] = {
    "attention": attention.patch_attention,
    "channels_last": channels_last.patch_layout,
    "gelu": gelu.patch_gelu,
    "group_norm": group_norm.patch_group_norm,
    "layer_norm": lambda model, record: (layer_norm.patch_layer_norm(model, record),
                                         unet_blocks.patch_unet_blocks(model, record)),
    "memory": memory_budget.patch_memory,
    "upsample": upsample.patch_upsample,
    "winograd": lambda model, record: (winograd.patch_winograd(model, record),
                                       conv_bias.patch_conv_bias(model, record)),
}
ORDER = tuple(PATCHERS)


def patch_order(ops) -> tuple[str, ...]:
    """``ops`` in the order their patchers run: ``ORDER``'s first, then any other entry of
    ``PATCHERS`` (a test's stand-in) by name."""
    return (*(op for op in ORDER if op in ops), *sorted(set(ops) - set(ORDER)))
