"""``ops.bias_residual`` (a ResNet block's tail in one pass) against the ops diffusers' ResnetBlock2D runs
after its convolutions, at the SD1.5 VAE decoder's ResNet output shapes (batch 1, 512² image, fp16,
channels_last as the mobile profiles run the VAE).

The tail: conv2's bias (cuDNN adds it in a kernel of its own), the shortcut's conv bias where the
block has a 1×1 shortcut, the residual add and ``/ output_scale_factor``. ``stock`` = those torch
ops one by one (3 kernels without a shortcut conv, 4 with), ``compiled`` = torch.compile of the same
(one fused kernel: what the compile recipe runs), ``ours`` = ``bias_residual``. ``bytes`` = y and the skip read and the
output written once (the biases are noise); stock eager moves 7 (9) such passes. Shapes are the
whole tensors (the streamed decode runs the same op on row bands of them) and one 24-row band of the
largest.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from bench.common import Case, rotating
from sd_kernels import reference
from sd_kernels.ops import bias_residual
from sd_kernels.testing import channels_last, rel_err

# (C, H, W, shortcut conv): the decoder's ResnetBlock2D outputs at 512² (mid block and each up block)
SHAPES = [(512, 64, 64, False), (512, 128, 128, False), (512, 256, 256, False), (256, 256, 256, True),
          (256, 512, 512, False), (128, 512, 512, True), (128, 24, 512, False)]
QUICK = SHAPES[2:5]


def stock(y, bias, skip, bias2):
    h = y + bias.view(1, -1, 1, 1)  # cuDNN's own bias kernel
    if bias2 is not None:
        skip = skip + bias2.view(1, -1, 1, 1)  # the 1×1 shortcut's bias
    return (skip + h) / 1.0  # diffusers divides by output_scale_factor even when it is 1


def ours(y, bias, skip, bias2):
    return bias_residual(y, bias, skip, bias2, 1.0)


def _case(c: int, h: int, w: int, shortcut: bool) -> Case:
    shape = (1, c, h, w)
    make = lambda: (channels_last(torch.randn(shape, device="cuda").half()),
                    channels_last(torch.randn(shape, device="cuda").half()))
    bias = torch.randn(c, device="cuda").half()
    bias2 = torch.randn(c, device="cuda").half() if shortcut else None
    torch._dynamo.reset()  # one code object compiled per shape: past 8, dynamo would give up on it
    impls = {"stock": stock, "compiled": torch.compile(stock, dynamic=False), "ours": ours}
    y, skip = make()
    ref = reference.bias_residual(y.double(), bias.double(), skip.double(),
                                  None if bias2 is None else bias2.double(), 1.0)
    errors = {name: rel_err(fn(y, bias, skip, bias2), ref) for name, fn in impls.items()}  # compiles first
    del y, skip, ref
    nxt = rotating(make, 2 * c * h * w * 2)
    n = c * h * w * 2
    return Case(
        op="bias_residual", shape=f"1x{c}x{h}x{w}", dtype=torch.float16, variant="shortcut" if shortcut else "identity",
        impls={name: (lambda fn=fn: _call(fn, nxt(), bias, bias2)) for name, fn in impls.items()},
        bytes=3 * n, errors=errors, extra={"stock_bytes": (9 if shortcut else 7) * n},
    )


def _call(fn, pair, bias, bias2):
    y, skip = pair
    return fn(y, bias, skip, bias2)


def cases(quick: bool) -> Iterator[Case]:
    for shape in QUICK if quick else SHAPES:
        yield _case(*shape)
