"""GroupNorm + SiLU benchmarks (fp16) at every GroupNorm shape of SD1.5 at 512².

Implementations: ``stock`` = ``F.silu(F.group_norm(x))`` as diffusers runs it, ``compiled`` =
torch.compile of the same (a subset of shapes: each compile takes seconds), ``ours`` =
``sd_kernels.ops.group_norm(..., activation="silu")``; each in NCHW and channels_last (variant).
In channels_last, where ``ours`` takes the pixel path, ``ours_groups`` is the same op kept on the
group paths (``pixels=False``, what channels_last ran before the pixel path), to compare the two in
one run. Bytes are the ideal traffic: x read once, y written once, weight and bias read once. The
split and pixel paths (VAE shapes; the pixel path also at most channels_last UNet shapes) read x
twice, so their GB/s against that ideal is at most 2/3 of what they move when the second read
misses L2. Columns ``path`` and ``launches`` name the plan ``ours`` takes (``Plan.name``: one_tile,
looped, split xS, pixels xS), ``groups_path`` the one ``ours_groups`` takes.
"""

from __future__ import annotations

import importlib
import json
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
VAE_SHAPES = [(1, 512, 64, 64), (1, 512, 128, 128), (1, 512, 256, 256), (1, 256, 256, 256), (1, 256, 512, 512),
              (1, 128, 512, 512)]
QUICK_SHAPES = [(2, 320, 64, 64), (2, 1280, 8, 8), (1, 512, 128, 128), (1, 128, 512, 512)]
COMPILED_SHAPES = {(2, 320, 64, 64), (2, 1280, 8, 8), (1, 512, 128, 128), (1, 128, 512, 512)}
LAYOUTS = {"nchw": torch.contiguous_format, "channels_last": torch.channels_last}


def stock(x, w, b):
    return F.silu(F.group_norm(x, GROUPS, w, b, EPS))


def ours(x, w, b):
    return group_norm(x, GROUPS, w, b, EPS, "silu")


def ours_groups(x, w, b):
    return group_norm(x, GROUPS, w, b, EPS, "silu", pixels=False)


def _plan(shape, channels_last: bool, pixels: bool | None = None):
    from sd_kernels.ops.group_norm import plan, sm_count
    from sd_kernels.profiles import active_profile

    n, c = shape[:2]
    return plan(n, GROUPS, c // GROUPS, math.prod(shape[2:]), channels_last, sms=sm_count(torch.cuda.current_device()),
                register_file_kb=active_profile().register_file_kb, pixels=pixels)  # as group_norm plans on this GPU


def _path(shape, channels_last: bool) -> dict[str, object]:
    p, groups = _plan(shape, channels_last), _plan(shape, channels_last, pixels=False)
    return {"path": p.name, "launches": p.launches, "groups_path": groups.name}


def _make(shape, fmt) -> Callable[[], tuple[torch.Tensor, ...]]:
    def make():
        x = (torch.randn(shape, device="cuda", dtype=DTYPE) + 0.5).contiguous(memory_format=fmt)
        w = 1.0 + 0.1 * torch.randn(shape[1], device="cuda", dtype=DTYPE)
        return x, w, 0.1 * torch.randn(shape[1], device="cuda", dtype=DTYPE)

    return make


def _case(shape, variant: str, quick: bool) -> Case:
    make = _make(shape, LAYOUTS[variant])
    impls = {"stock": stock, "ours": ours}
    if variant == "channels_last" and _plan(shape, True).pixels:
        impls["ours_groups"] = ours_groups
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


SWEEP_PROGRAMS = (128, 264, 512, 1024)  # _PIXEL_PROGRAMS values (at 132 SMs) the sweep tries


def sweep_pixel_programs(programs=SWEEP_PROGRAMS, shapes=None) -> list[dict[str, object]]:
    """Device ms (CUDA graph) of ``ours`` in channels_last per _PIXEL_PROGRAMS value, beside the
    group paths (``pixels=False``), at every shape that takes the pixel path: the data for tuning
    that constant. ``python -m bench.ops_group_norm`` prints it as JSON lines."""
    from bench.common import time_graph_ms

    gn_mod = importlib.import_module("sd_kernels.ops.group_norm")  # `group_norm` above is the function
    saved, rows = gn_mod._PIXEL_PROGRAMS, []
    try:
        for shape in shapes or UNET_SHAPES + VAE_SHAPES:
            if not _plan(shape, True).pixels:
                continue
            make = _make(shape, torch.channels_last)
            nxt = rotating(make, math.prod(shape) * 2)
            row: dict[str, object] = {"shape": "x".join(map(str, shape)),
                                      "groups_ms": round(time_graph_ms(lambda nxt=nxt: ours_groups(*nxt())), 5)}
            for value in programs:
                gn_mod._PIXEL_PROGRAMS = value
                row[f"chunks@{value}"] = _plan(shape, True).chunks
                row[f"ms@{value}"] = round(time_graph_ms(lambda nxt=nxt: ours(*nxt())), 5)
            rows.append(row)
            print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()
    finally:
        gn_mod._PIXEL_PROGRAMS = saved
    return rows


if __name__ == "__main__":
    sweep_pixel_programs()
