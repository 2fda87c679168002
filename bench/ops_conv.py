"""Our implicit-GEMM conv2d against cuDNN at every conv shape of the SD1.5 UNet and VAE decoder (fp16).

The first step towards a fused ResNet block: it needs a convolution whose loads and stores we write, and
is only worth building if that convolution alone comes within 0.8x of cuDNN. The shapes are read off
the models themselves (built on the meta device, one forward with a hook on every ``nn.Conv2d``):
the UNet at batch 2 (one prompt with classifier-free guidance) on 64² latents, the VAE decoder at
batch 1 on a 64² latent (a 512² image). Each shape is one case, channels_last as the patch runs
them: "stock" is cuDNN (``F.conv2d`` on channels_last input and weight), "ours" is
``sd_kernels.ops.conv2d`` on the same tensors. flops = 2·N·K·C·R·S·P·Q (TFLOP/s against the measured
matmul ceiling), bytes = x, the weight and y once. ``calls`` (a column) is how often one forward runs
the shape: weight the ratios by it to read them as a share of the model's conv time.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from bench.common import Case, rotating
from sd_kernels import reference
from sd_kernels.ops import conv2d
from sd_kernels.testing import channels_last, rel_err

MODEL = "sd15"
QUICK = [(2, 320, 64, 64, 320, 3, 1, 1), (2, 1280, 16, 16, 1280, 3, 1, 1), (1, 512, 128, 128, 512, 3, 1, 1)]


def conv_shapes(name: str = MODEL) -> dict[tuple[int, ...], int]:
    """(N, C, H, W, K, R, stride, padding) → calls per forward, for every conv of the UNet (batch 2)
    and of the VAE decoder (batch 1) of config ``name`` at its resolution."""
    from bench.e2e import unet_inputs
    from sd_kernels.models import build_model, load_config

    seen: collections.Counter = collections.Counter()

    def watch(model):
        for m in model.modules():
            if isinstance(m, nn.Conv2d) and m.groups == 1 and m.dilation == (1, 1):
                m.register_forward_pre_hook(lambda m, a: seen.update(
                    [(*a[0].shape, m.out_channels, m.kernel_size[0], m.stride[0], m.padding[0])]))

    cfg = load_config(name)
    side = cfg.get("resolution", 512) // 8
    with torch.no_grad():
        unet = build_model(name, "unet", device="meta")
        watch(unet)
        x, ctx, kwargs = unet_inputs(cfg["unet"], 2, side, "meta", pixels=side * 8)
        unet(x, torch.zeros(2, device="meta"), ctx, **kwargs)
        vae = build_model(name, "vae", device="meta")
        watch(vae.decoder)
        vae.decode(torch.zeros(1, vae.config.latent_channels, side, side, device="meta"))
    return dict(sorted(seen.items(), key=lambda kv: (kv[0][0], -kv[0][2], kv[0][1], kv[0][4])))


def _case(shape, calls: int) -> Case:
    N, C, H, W, K, R, stride, padding = shape
    w = channels_last((torch.randn(K, C, R, R, device="cuda") / (R * C**0.5)).half())
    b = torch.randn(K, device="cuda").half()
    nxt = rotating(lambda: channels_last(torch.randn(N, C, H, W, device="cuda").half()),
                   N * C * H * W * 2)
    x = nxt()
    y_stock = F.conv2d(x, w, b, stride=stride, padding=padding)
    ref64 = reference.conv2d(*reference.upcast(x, w, b), stride=stride, padding=padding)
    errors = {"stock": rel_err(y_stock, ref64), "ours": rel_err(conv2d(x, w, b, stride, padding), ref64)}
    P, Q = y_stock.shape[-2:]
    del ref64, y_stock
    return Case(
        op=f"conv{R}x{R}" + (f"_s{stride}" if stride > 1 else ""),
        shape=f"{N}x{C}x{H}x{W}->{K}",
        dtype=torch.float16,
        variant="channels_last",
        impls={"stock": lambda: F.conv2d(nxt(), w, b, stride=stride, padding=padding),
               "ours": lambda: conv2d(nxt(), w, b, stride, padding)},
        bytes=(N * C * H * W + w.numel() + N * K * P * Q) * 2,
        flops=2 * N * K * C * R * R * P * Q,
        errors=errors,
        extra={"calls": calls},
    )


def cases(quick: bool) -> Iterator[Case]:
    shapes = conv_shapes()
    for shape, calls in shapes.items():
        if quick and shape not in QUICK:
            continue
        if shape[1] < 16 or shape[4] < 16:  # conv_in / conv_out (4 channels): memory-bound, not the question
            continue
        yield _case(shape, calls)
