"""GroupNorm + SiLU benchmarks (fp16) at every GroupNorm shape of SD1.5 at 512².

Implementations: ``stock`` = ``F.silu(F.group_norm(x))`` as diffusers runs it, ``compiled`` =
torch.compile of the same (a subset of shapes: each compile takes seconds), ``ours`` =
``sd_kernels.ops.group_norm(..., activation="silu")``; each in NCHW and channels_last (variant).
Bytes are the ideal traffic: x read once, y written once, weight and bias read once. The split path
(VAE shapes) reads x twice, so its GB/s against that ideal is at most 2/3 of what it moves when the
second read misses L2; ``extra`` records the path and launches per case.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from bench.common import Case, rotating
from sd_kernels import reference
from sd_kernels.ops import group_norm
from sd_kernels.testing import rel_err

DTYPE = torch.float16
GROUPS = 32
EPS = 1e-5
UNET_SHAPES = [(2, 320, 64, 64), (2, 640, 32, 32), (2, 1280, 16, 16), (2, 1280, 8, 8), (2, 960, 64, 64),
               (2, 1920, 32, 32)]
VAE_SHAPES = [(1, 512, 64, 64), (1, 512, 128, 128), (1, 512, 256, 256), (1, 256, 512, 512),
              (1, 128, 512, 512)]
QUICK_SHAPES = [(2, 320, 64, 64), (2, 1280, 8, 8), (1, 512, 128, 128), (1, 128, 512, 512)]
COMPILED_SHAPES = {(2, 320, 64, 64), (2, 1280, 8, 8), (1, 512, 128, 128), (1, 128, 512, 512)}
LAYOUTS = {"nchw": torch.contiguous_format, "channels_last": torch.channels_last}


def stock(x, w, b):
    return F.silu(F.group_norm(x, GROUPS, w, b, EPS))


def ours(x, w, b):
    return group_norm(x, GROUPS, w, b, EPS, "silu")


def _path(shape, channels_last: bool) -> dict[str, object]:
    from sd_kernels.ops.group_norm import plan, sm_count
    from sd_kernels.profiles import active_profile

    n, c = shape[:2]
    p = plan(n, GROUPS, c // GROUPS, math.prod(shape[2:]), channels_last, sms=sm_count(torch.cuda.current_device()),
             register_file_kb=active_profile().register_file_kb)  # the plan group_norm takes on this GPU
    name = "one_tile" if p.one_tile else f"split x{p.chunks}" if p.split else "looped"
    return {"path": name, "launches": p.launches}


def _make(shape, fmt) -> Callable[[], tuple[torch.Tensor, ...]]:
    def make():
        x = (torch.randn(shape, device="cuda", dtype=DTYPE) + 0.5).contiguous(memory_format=fmt)
        w = 1.0 + 0.1 * torch.randn(shape[1], device="cuda", dtype=DTYPE)
        return x, w, 0.1 * torch.randn(shape[1], device="cuda", dtype=DTYPE)

    return make


def _case(shape, variant: str, quick: bool) -> Case:
    make = _make(shape, LAYOUTS[variant])
    impls = {"stock": stock, "ours": ours}
    if shape in COMPILED_SHAPES:
        impls["compiled"] = torch.compile(stock, dynamic=False)  # compiles at the first (error) call
    inputs = make()
    x64, w64, b64 = reference.upcast(*inputs)
    ref = reference.group_norm(x64, GROUPS, w64, b64, EPS, "silu")
    errors = {name: rel_err(fn(*inputs), ref) for name, fn in impls.items()}
    x_bytes = inputs[0].numel() * inputs[0].element_size()
    del inputs, ref
    nxt = rotating(make, x_bytes)
    timed = {name: (lambda fn=fn: fn(*nxt())) for name, fn in impls.items()}
    nbytes = 2 * x_bytes + 2 * shape[1] * 2
    return Case("group_norm_silu", "x".join(map(str, shape)), DTYPE, variant, timed, bytes=nbytes,
                errors=errors, extra=_path(shape, variant == "channels_last"))


def cases(quick: bool) -> Iterator[Case]:
    for shape in QUICK_SHAPES if quick else UNET_SHAPES + VAE_SHAPES:
        for variant in LAYOUTS:
            yield _case(shape, variant, quick)
