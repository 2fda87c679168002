"""The polyphase upsampler (``ops.upsample_conv2d``) against diffusers' nearest-2× + 3×3 conv, at every
upsampler shape of the SD1.5 and SDXL UNets (batch 2) and VAE decoders (batch 1), fp16 channels_last
as the patch runs them.

The shapes are read off the models (built on the meta device, a hook on every ``Upsample2D``).
Implementations: ``stock`` = ``conv2d(interpolate(x, 2, "nearest"), w, b, padding=1)`` (what
Upsample2D runs), ``compiled`` = torch.compile of the same (the compile recipe's code for it: inductor keeps
cuDNN for the conv), ``ours`` = the phases' 2×2 conv + the interleave, the phases cached as the patch
caches them. ``flops`` is the stock algorithm's (2·N·K·C·9·4HW), so TFLOP/s reads as stock-equivalent
throughput (ours does 16/36 of it); ``bytes`` x read, the weight and the output written once.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator

import torch

from bench.common import Case, rotating
from sd_kernels import reference
from sd_kernels.ops import upsample as up
from sd_kernels.testing import channels_last, rel_err

MODELS = ("sd15", "sdxl")
QUICK = ("sd15",)


def upsampler_shapes(name: str) -> dict[tuple[str, tuple[int, int, int, int], int], int]:
    """(part, input [N, C, H, W], K) → calls per forward for every Upsample2D of the UNet (batch 2)
    and the VAE decoder (batch 1) of config ``name`` at its resolution."""
    from diffusers.models.upsampling import Upsample2D

    from bench.e2e import unet_inputs
    from sd_kernels.models import build_model, load_config

    seen: collections.Counter = collections.Counter()

    def watch(model, part):
        for m in model.modules():
            if isinstance(m, Upsample2D):
                m.register_forward_pre_hook(lambda m, a, part=part: seen.update(
                    [(part, tuple(a[0].shape), m.out_channels)]))

    cfg = load_config(name)
    side = cfg.get("resolution", 512) // 8
    with torch.no_grad():
        unet = build_model(name, "unet", device="meta")
        watch(unet, "unet")
        x, ctx, kwargs = unet_inputs(cfg["unet"], 2, side, "meta", pixels=side * 8)
        unet(x, torch.zeros(2, device="meta"), ctx, **kwargs)
        vae = build_model(name, "vae", device="meta")
        watch(vae.decoder, "vae")
        vae.decode(torch.zeros(1, vae.config.latent_channels, side, side, device="meta"))
    return dict(seen)


def _stock(x, w, b):
    return reference.upsample_conv2d(x, w, b)


def _case(model: str, part: str, shape: tuple[int, int, int, int], k: int, calls: int) -> Case:
    n, c, h, w_ = shape
    w = channels_last((torch.randn(k, c, 3, 3, device="cuda") / (3 * c**0.5)).half())
    b = torch.randn(k, device="cuda").half()
    owner = up.PhaseCache(w)  # what a patched upsampler holds
    nxt = rotating(lambda: channels_last(torch.randn(shape, device="cuda").half()), n * c * h * w_ * 2)
    x = nxt()
    torch._dynamo.reset()  # one code object compiled per shape: past 8, dynamo would give up on it
    compiled = torch.compile(_stock, dynamic=False)
    impls = {"stock": _stock, "compiled": compiled,
             "ours": lambda x, w, b, owner=owner: up.upsample_conv2d(x, w, b, cached=True)}  # owner: kept alive
    ref64 = reference.upsample_conv2d(*reference.upcast(x, w, b))
    errors = {name: rel_err(fn(x, w, b), ref64) for name, fn in impls.items()}  # compiles before timing
    del ref64
    out = n * k * 4 * h * w_
    return Case(
        op="upsample_conv3x3", shape=f"{n}x{c}x{h}x{w_}->{k}", dtype=torch.float16, variant=f"{model}_{part}",
        impls={name: (lambda fn=fn: fn(nxt(), w, b)) for name, fn in impls.items()},
        bytes=(n * c * h * w_ + w.numel() + out) * 2, flops=2 * out * c * 9, errors=errors,
        extra={"calls": calls, "phases_mb": round(owner.nbytes() / 2**20, 2)},
    )


def cases(quick: bool) -> Iterator[Case]:
    for model in MODELS:
        if quick and model not in QUICK:
            continue
        for (part, shape, k), calls in upsampler_shapes(model).items():
            yield _case(model, part, shape, k, calls)
