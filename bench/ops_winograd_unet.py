"""Winograd F(2,3), F(4,3) vs cuDNN at every deep 3×3 conv shape of the SD UNets, both layouts.

The shapes are read off the models themselves: each shipped UNet config (SD1.5 at 512², SD2.1 at
768², SDXL at 1024², batch 2 = one prompt with classifier-free guidance) is built on the meta device
and one forward records the input of every conv that Winograd can compute (patches/winograd.py
``qualifies``). Kept: the shapes where Winograd has a chance (docs/kernels/winograd.md: many channels,
small maps; at most 32×32 pixels and at least 640 input channels), each with how many times one UNet
call runs it. These rows are the data behind the ``hopper`` profile's Winograd routes
(tests/test_profiles.py checks the table against them).
"""

from __future__ import annotations

import collections
from collections.abc import Iterator

import torch

from bench.e2e import unet_inputs
from bench.ops_winograd import _case

MODELS = (("sd15", 512), ("sd21", 768), ("sdxl", 1024))
MAX_PIXELS, MIN_CHANNELS = 32 * 32, 640


def unet_conv_shapes(name: str, size: int, batch: int = 2) -> collections.Counter:
    """(N, C, H, W, K) → calls per UNet forward, for the Winograd-qualifying convs of ``name``'s UNet."""
    from sd_kernels.patches.winograd import qualifies

    from sd_kernels.models import build_model, load_config

    unet = build_model(name, "unet", device="meta")
    cfg = load_config(name)["unet"]
    seen: collections.Counter = collections.Counter()
    for m in unet.modules():
        if qualifies(m):
            m.register_forward_pre_hook(lambda m, a: seen.update([(*a[0].shape, m.out_channels)]))
    x, ctx, kwargs = unet_inputs(cfg, batch, size // 8, "meta", pixels=size)
    unet(x, torch.zeros(batch, device="meta"), ctx, **kwargs)
    return seen


def deep_shapes() -> dict[tuple[int, ...], int]:
    """Every model's candidate shapes with their calls per UNet forward (summed where models share one)."""
    out: collections.Counter = collections.Counter()
    for name, size in MODELS:
        out.update({s: n for s, n in unet_conv_shapes(name, size).items()
                    if s[2] * s[3] <= MAX_PIXELS and s[1] >= MIN_CHANNELS})
    return dict(sorted(out.items(), key=lambda kv: (kv[0][2], kv[0][1], kv[0][4])))


def cases(quick: bool) -> Iterator:
    for shape in deep_shapes():
        for layout in ("channels_last", "nchw"):
            yield _case(shape, layout, tiles=(2, 4), variants_f4=False)
