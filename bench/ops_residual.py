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

``gated_add`` (a DiT block's gated residual x + gate · y, the gate one vector a sample) at FLUX's and
SD3-medium's 1024² shapes: ``stock`` = diffusers' two ops, ``addcmul`` = one ``torch.addcmul`` (what the patch
ran before the kernel; its broadcast gate takes torch's strided elementwise path), ``compiled`` = torch.compile
of the two ops, ``ours`` = ``gated_add`` (and ``ours-<elements>x<warps>``: other tiles of its kernel).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from bench.common import Case, rotating
from sd_kernels import reference
from sd_kernels.ops import bias_residual, gated_add
from sd_kernels.ops import residual as residual_ops
from sd_kernels.testing import channels_last, rel_err

# (C, H, W, shortcut conv): the decoder's ResnetBlock2D outputs at 512² (mid block and each up block)
SHAPES = [(512, 64, 64, False), (512, 128, 128, False), (512, 256, 256, False), (256, 256, 256, True),
          (256, 512, 512, False), (128, 512, 512, True), (128, 24, 512, False)]
QUICK = SHAPES[2:5]
# (B, T, D, dtype): FLUX.1-dev's single-block stream (4,096 image + 512 text tokens), its double blocks' image and
# text streams (bf16, batch 1); SD3-medium's image and text streams with guidance (fp16, batch 2)
GATED_SHAPES = [(1, 4608, 3072, torch.bfloat16), (1, 4096, 3072, torch.bfloat16), (1, 512, 3072, torch.bfloat16),
                (2, 4096, 1536, torch.float16), (2, 333, 1536, torch.float16)]
GATED_TILES = [(4096, 4), (8192, 8), (8192, 4)]  # (elements a program, warps) beside the shipped tile


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


def _tiled(elems: int, warps: int):
    """``gated_add`` with its kernel's tile set to ``elems`` elements and ``warps`` warps for the call."""
    def run(x, gate, y):
        saved = residual_ops._GATED_ELEMS, residual_ops._GATED_WARPS
        residual_ops._GATED_ELEMS, residual_ops._GATED_WARPS = elems, warps
        try:
            return gated_add(x, gate, y)
        finally:
            residual_ops._GATED_ELEMS, residual_ops._GATED_WARPS = saved
    return run


def _gated_case(b: int, t: int, d: int, dtype: torch.dtype) -> Case:
    make = lambda: (torch.randn(b, t, d, device="cuda", dtype=dtype), torch.randn(b, t, d, device="cuda", dtype=dtype))
    gate = torch.randn(b, 1, d, device="cuda", dtype=dtype)
    torch._dynamo.reset()
    impls = {"stock": reference.gated_add, "addcmul": torch.addcmul,
             "compiled": torch.compile(reference.gated_add, dynamic=False), "ours": gated_add,
             **{f"ours-{e}x{w}": _tiled(e, w) for e, w in GATED_TILES}}
    x, y = make()
    want = x.double() + gate.double() * y.double()
    errors = {name: rel_err(fn(x, gate, y), want) for name, fn in impls.items()}
    del x, y, want
    n = b * t * d * torch.finfo(dtype).bits // 8
    nxt = rotating(make, 2 * n)
    return Case(
        op="gated_add", shape=f"{b}x{t}x{d}", dtype=dtype, variant="per-sample-gate",
        impls={name: (lambda fn=fn: _gated_call(fn, nxt(), gate)) for name, fn in impls.items()},
        bytes=3 * n, errors=errors, extra={"stock_bytes": 5 * n},
    )


def _gated_call(fn, pair, gate):
    x, y = pair
    return fn(x, gate, y)


def cases(quick: bool) -> Iterator[Case]:
    for shape in QUICK if quick else SHAPES:
        yield _case(*shape)
    for shape in GATED_SHAPES[:2] + GATED_SHAPES[3:4] if quick else GATED_SHAPES:
        yield _gated_case(*shape)
