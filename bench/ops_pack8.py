"""``ops.pack8`` / ``ops.unpack8`` (an activation kept as int8 codes and a float32 scale per pixel and
32 channels) at the activations the streamed VAE decode keeps packed under ``mobile-small`` (SD1.5,
512² image, fp16, channels_last): whole tensors and one 24-row band of the largest.

``stock`` = the PyTorch reference (``sd_kernels.reference.pack8`` / ``unpack8``: a few elementwise
kernels and a reduction), ``compiled`` = torch.compile of the same (what the compile recipe runs), ``ours`` = the Triton
kernels. ``bytes`` = the fp16 tensor and its packed form (1.125 bytes an element), each moved once.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from bench.common import Case, rotating
from sd_kernels import reference
from sd_kernels.ops import pack8, unpack8
from sd_kernels.testing import channels_last, rel_err

# (C, H, W): up_blocks.1's upsampler output (512×256²), the 512² ResNet outputs (128×512²), a band of them
SHAPES = [(512, 256, 256), (128, 512, 512), (128, 24, 512)]
QUICK = SHAPES[1:]


def _packed(c: int, h: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty(1, h, w, c, dtype=torch.int8, device="cuda"),
            torch.empty(1, h, w, c // 32, dtype=torch.float32, device="cuda"))


def _cases(c: int, h: int, w: int) -> Iterator[Case]:
    n = c * h * w
    moved = 2 * n + n + 4 * (n // 32)
    make = lambda: channels_last(torch.randn(1, c, h, w, device="cuda").half() * 3)
    torch._dynamo.reset()  # one code object compiled per shape: past 8, dynamo would give up on it
    packs = {"stock": reference.pack8, "compiled": torch.compile(reference.pack8, dynamic=False), "ours": pack8}
    x = make()
    errors = {}
    for name, fn in packs.items():  # compiles first; the error of the round trip against the fp16 input
        v, s = _packed(c, h, w)
        fn(x, v, s)
        errors[name] = rel_err(reference.unpack8(v, s, torch.empty_like(x, dtype=torch.float64)), x.double())
    nxt = rotating(make, moved)
    out_v, out_s = _packed(c, h, w)
    shape = f"1x{c}x{h}x{w}"
    yield Case(op="pack8", shape=shape, dtype=torch.float16, variant="pack",
               impls={name: (lambda fn=fn: fn(nxt(), out_v, out_s)) for name, fn in packs.items()},
               bytes=moved, errors=errors)
    unpacks = {"stock": reference.unpack8, "compiled": torch.compile(reference.unpack8, dynamic=False),
               "ours": unpack8}

    def make_packed():
        v, s = _packed(c, h, w)
        pack8(make(), v, s)
        return v, s

    out = torch.empty_like(x)
    nxt_packed = rotating(make_packed, moved)
    yield Case(op="pack8", shape=shape, dtype=torch.float16, variant="unpack",
               impls={name: (lambda fn=fn: fn(*nxt_packed(), out)) for name, fn in unpacks.items()},
               bytes=moved, errors={})


def cases(quick: bool) -> Iterator[Case]:
    for shape in QUICK if quick else SHAPES:
        yield from _cases(*shape)
