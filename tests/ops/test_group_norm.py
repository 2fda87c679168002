"""group_norm (+ fused SiLU) against float64, with stock PyTorch's error as the yardstick.

CPU: tiny shapes through the Triton interpreter, each on the code paths (one register tile; the
looped single launch; the split statistics + normalize launches; for channels-fast inputs the
pixel path's statistics + merge + normalize launches), forced by shrinking the tiles, the split
threshold and the programs aimed at. The interpreter rounds fp32 → bf16 by truncation (the GPU
rounds to nearest), which the 4× stock tolerance absorbs. GPU (-m gpu): SD1.5's UNet and VAE shapes.
"""

import dataclasses
import importlib
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from sweeps import one, sweep

from sd_kernels import profiles, reference
from sd_kernels.ops import group_norm
from sd_kernels.runtime import dispatch
from sd_kernels.testing import assert_close_to_reference, channels_last, non_contiguous, poison_, rel_err

gn = importlib.import_module("sd_kernels.ops.group_norm")  # `group_norm` in sd_kernels.ops is the function

# SiLU of a large negative y overflows exp2 to inf (y/inf = -0, as intended); the interpreter warns.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp2:RuntimeWarning")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
PATHS = ["one_tile", "looped", "split"]
NO_SPLIT = 1 << 62
_ALLOC = gn._alloc  # unpoisoned, for counting launches


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    """Every output starts as NaN, so an element the kernel does not write fails the comparison."""
    alloc = gn._alloc
    monkeypatch.setattr(gn, "_alloc", lambda *args: poison_(alloc(*args)))


@pytest.fixture
def force_path(monkeypatch):
    """Return a function that makes the next calls take ``path`` and gives the keyword arguments
    (split_threshold, pixels) to pass to group_norm.

    Tiles shrink to 32 elements so that tiny shapes still loop over several tiles and chunks; the
    pixel path also aims at 4 normalize and 8 statistics programs in all, so that its chunks hold
    several tiles and the two launches chunk differently."""

    def force(path: str) -> dict:
        if path == "one_tile":
            return {"split_threshold": NO_SPLIT, "pixels": False}
        monkeypatch.setattr(gn, "_ONE_TILE_ELEMS", 0)
        monkeypatch.setattr(gn, "_TILE_ELEMS", 32)
        if path == "pixels":
            monkeypatch.setattr(gn, "_PIXEL_PROGRAMS", 4)
            monkeypatch.setattr(gn, "_PIXEL_STAT_PROGRAMS", 8)  # chunks of their own, unlike the normalize's
            return {"pixels": True}
        return {"split_threshold": NO_SPLIT if path == "looped" else 0, "pixels": False}

    return force


@pytest.fixture
def plans(monkeypatch):
    """The plans group_norm takes, in call order."""
    taken = []
    plan = gn.plan
    monkeypatch.setattr(gn, "plan", lambda *a, **kw: taken.append(plan(*a, **kw)) or taken[-1])
    return taken


def layout(x: torch.Tensor, kind: str) -> torch.Tensor:
    """The same values as x in another memory layout."""
    if kind == "contiguous":
        return x
    if kind == "channels_last":  # 4-D NHWC, or channels innermost at any rank ([B, HW, C] as [B, C, HW])
        return channels_last(x) if x.dim() == 4 else x.movedim(1, -1).contiguous().movedim(-1, 1)
    if kind == "strided":  # every other element of a doubled last dim: spatial stride 2, no copy
        return non_contiguous(x)
    if kind == "swapped":  # H and W transposed in memory: no single spatial stride, the one-copy path
        return x.transpose(-1, -2).contiguous().transpose(-1, -2)
    if kind == "cl_strided":  # channels_last, every other pixel of a doubled last dim: spatial stride 2C
        wide = layout(torch.cat([x, x], dim=-1), "channels_last")[..., ::2]
        wide.copy_(x)
        return wide
    if kind == "cl_channels":  # the first C channels of a channels_last tensor of 2C: spatial stride 2C
        wide = layout(torch.cat([x, x], dim=1), "channels_last")[:, : x.shape[1]]
        wide.copy_(x)
        return wide
    raise ValueError(kind)


CASES = [  # (shape, num_groups, layout)
    ((2, 8, 5, 7), 4, "contiguous"),
    ((2, 8, 5, 7), 4, "channels_last"),
    ((3, 6, 9, 11), 3, "contiguous"),  # batch 3, odd spatial
    ((3, 6, 9, 11), 3, "channels_last"),
    ((1, 12, 6, 6), 1, "contiguous"),  # one group
    ((2, 6, 4, 5), 6, "channels_last"),  # groups = channels
    ((2, 10, 24), 5, "channels_last"),  # the VAE attention's [B, C, HW] view of [B, HW, C]
    ((2, 8, 5, 6), 2, "strided"),
    ((2, 8, 5, 6), 2, "swapped"),
    ((1, 4, 3, 4, 5), 2, "contiguous"),  # 3 spatial dims
]


def _inputs(shape, dtype, device, mean=0.0, affine=True):
    c = shape[1]
    x = (mean + 2.0 * torch.randn(shape, dtype=torch.float64, device=device)).to(dtype)
    w = (1.0 + 0.5 * torch.randn(c, dtype=torch.float64, device=device)).to(dtype) if affine else None
    b = (0.5 * torch.randn(c, dtype=torch.float64, device=device)).to(dtype) if affine else None
    return x, w, b


def _check(x, g, w, b, activation, ours, eps=1e-5, factor=4.0, floor_ulps=2.0):
    stock = reference.group_norm(x, g, w, b, eps, activation)
    x64, w64, b64 = reference.upcast(x, w, b)
    ref64 = reference.group_norm(x64, g, w64, b64, eps, activation)
    return assert_close_to_reference(ours, stock, ref64, factor=factor, floor_ulps=floor_ulps)


@pytest.mark.parametrize("shape, g, kind, dtype, path", sweep(CASES, one(DTYPES), one(PATHS)))
def test_group_norm_silu(shape, g, kind, dtype, path, force_path, device):
    kw = force_path(path)
    x, w, b = _inputs(shape, dtype, device)
    x = layout(x, kind)
    ours = group_norm(x, g, w, b, 1e-5, "silu", **kw)
    _check(x, g, w, b, "silu", ours)
    if kind in ("contiguous", "channels_last"):  # dense: the output keeps the input's memory format
        assert ours.stride() == x.stride()
    else:
        assert ours.is_contiguous()


PIXEL_CASES = [  # (shape, num_groups, layout): channels-fast inputs, odd sizes
    ((3, 40, 7, 5), 8, "channels_last"),  # CPG 5, N 3, 35 pixels
    ((2, 96, 7, 5), 32, "channels_last"),  # 32 groups of 3 channels
    ((2, 96, 3, 3), 32, "channels_last"),
    ((3, 40, 1, 1), 8, "channels_last"),  # one pixel
    ((2, 6, 4, 5), 6, "channels_last"),  # groups = channels
    ((1, 12, 6, 6), 1, "channels_last"),  # one group
    ((2, 10, 24), 5, "channels_last"),  # the VAE attention's [B, C, HW] view of [B, HW, C]
    ((2, 24, 3, 4, 5), 6, "channels_last"),  # 3 spatial dims (channels_last_3d)
    ((2, 40, 5, 6), 8, "cl_strided"),  # channels-fast, not dense: spatial stride 2C, contiguous output
    ((2, 40, 5, 6), 8, "cl_channels"),  # channels-fast, not dense: a channel slice
]


# The activation is the normalize launch's epilogue, in fp32 before the store: without it once (fp32);
# with it in every dtype (the dtype changes only the loads and the store).
@pytest.mark.parametrize("shape, g, kind, dtype, activation",
                         sweep(PIXEL_CASES, [(torch.float32, None), *((d, "silu") for d in DTYPES)]))
def test_pixel_path(shape, g, kind, dtype, activation, force_path, plans, device):
    kw = force_path("pixels")
    x, w, b = _inputs(shape, dtype, device)
    x = layout(x, kind)
    ours = group_norm(x, g, w, b, 1e-5, activation, **kw)
    _check(x, g, w, b, activation, ours)
    assert ours.stride() == (x.stride() if kind == "channels_last" else gn.contiguous_strides(x.shape))
    (p,) = plans
    assert p.pixels and p.launches == 3


def test_pixel_path_loops_over_tiles_and_chunks(force_path, plans, device):
    """The forced tiny tiles really give several statistics tiles per chunk, several chunks per
    sample, a masked last tile and several normalize tiles per chunk."""
    kw = force_path("pixels")
    x, w, b = _inputs((3, 40, 7, 5), torch.float16, device)
    _check(x, 8, w, b, "silu", group_norm(layout(x, "channels_last"), 8, w, b, 1e-5, "silu", **kw))
    (p,) = plans
    assert p.chunks > 1 and p.chunk > p.block_s and 35 % p.chunk and p.chunk % p.block_s == 0
    assert p.chunk > p.norm_block_s and p.chunk % p.norm_block_s == 0 and p.norm_block_c == 64
    assert p.stat_chunks > 1 and p.stat_chunk > p.block_s and p.stat_chunk != p.chunk and 35 % p.stat_chunk


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_pixel_path_pivot_is_an_outlier(dtype, force_path, plans, device):
    """The pixel path's statistics sum deviations from each chunk's first pixel (its pivot). A pivot
    5,000 σ from the rest of its channel is that shift's worst case: a chunk's M2 = Σd² − (Σd)²/n is
    then a difference of sums n times larger than itself, so its rounding is bounded by the chunk's
    pixel count n (unit roundoffs of M2), not by the outlier's size, and rstd = M2^(-1/2) carries half
    of it into every output: in fp32 the bound is n/2 unit roundoffs (stock's error here is far below
    one; within 4x of it was a matter of summation order). In fp16 the output's rounding dominates.
    (Large means, the case the shift exists for, are test_large_mean's.)"""
    kw = force_path("pixels")
    x, w, b = _inputs((3, 40, 7, 5), dtype, device)
    x[:, :, 0, 0] = 1e4  # every sample's first chunk starts at the outlier
    x[:, :, 2, 2] = -1e4  # and the second (pixel 12: the statistics chunks are 12 pixels here)
    x = layout(x, "channels_last")
    y = group_norm(x, 8, w, b, 1e-5, None, **kw)
    (p,) = plans
    assert p.stat_chunk == 12  # the second outlier starts the second chunk
    _check(x, 8, w, b, None, y, floor_ulps=p.stat_chunk / 2 if dtype == torch.float32 else 2.0)


@pytest.mark.parametrize("shape, g", [((1, 32, 48, 48), 4), ((1, 40, 48, 48), 8)])
def test_pixel_path_default_plan(shape, g, plans, device):
    """Unforced: a channels_last input whose groups exceed one tile takes the pixel path with the
    module's own tiles."""
    x, w, b = _inputs(shape, torch.float16, device)
    x = layout(x, "channels_last")
    _check(x, g, w, b, "silu", group_norm(x, g, w, b, 1e-5, "silu"))
    (p,) = plans
    assert p.pixels and p.block_c * p.block_s <= gn._TILE_ELEMS


def test_pixel_path_needs_channels_fast():
    with pytest.raises(ValueError, match="channels-fast"):
        gn.plan(2, 4, 2, 16, False, pixels=True)


@pytest.mark.parametrize("path", [*PATHS, "pixels"])
@pytest.mark.parametrize("affine", ["weight+bias", "weight", "bias", "none"])
def test_group_norm_affine_variants(affine, path, force_path, device):
    kw = force_path(path)
    x, w, b = _inputs((2, 6, 5, 5), torch.float32, device)
    x = layout(x, "channels_last") if path == "pixels" else x
    w = w if "weight" in affine else None
    b = b if "bias" in affine else None
    ours = group_norm(x, 3, w, b, 1e-6, None, **kw)
    _check(x, 3, w, b, None, ours, eps=1e-6)


@pytest.mark.parametrize("path", [*PATHS, "pixels"])
@pytest.mark.parametrize("kind", ["contiguous", "channels_last"])
@pytest.mark.parametrize("dtype, mean",
                         [(torch.float32, 1000.0), (torch.float16, 1000.0), (torch.bfloat16, 100.0)])
def test_large_mean(dtype, mean, kind, path, force_path, device):
    """x = mean + noise: a variance taken as E[x²] − E[x]² in fp32 would lose most of its digits."""
    if path == "pixels" and kind == "contiguous":
        pytest.skip("the pixel path is for channels-fast inputs")
    kw = force_path(path)
    x, w, b = _inputs((2, 8, 6, 6), dtype, device, mean=mean)
    x = layout(x, kind)
    ours = group_norm(x, 4, w, b, 1e-5, "silu", **kw)
    _check(x, 4, w, b, "silu", ours)
    # And in absolute terms: fp32 inputs normalized to within a few fp32 roundings of |mean|/σ.
    if dtype == torch.float32:
        x64, w64, b64 = reference.upcast(x, w, b)
        ref64 = reference.group_norm(x64, 4, w64, b64, 1e-5, "silu")
        assert rel_err(ours, ref64) < 16 * 2.0**-24 * mean / 2.0


def _shift(n, c, dtype, device, offset=0.0):
    return (offset + torch.randn(n, c, dtype=torch.float64, device=device)).to(dtype)


def _check_shifted(x, g, w, b, shift, activation, ours):
    """Against x + shift normalized: stock sums in the wider dtype (reference.group_norm(shift=)),
    float64 in float64."""
    stock = reference.group_norm(x, g, w, b, 1e-5, activation, shift=shift)
    x64, w64, b64, s64 = reference.upcast(x, w, b, shift)
    ref64 = reference.group_norm(x64, g, w64, b64, 1e-5, activation, shift=s64)
    return assert_close_to_reference(ours, stock, ref64, factor=4.0)


@pytest.mark.parametrize("path", [*PATHS, "pixels"])
@pytest.mark.parametrize("dtype, shift_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float32),
                                                (torch.float16, "x"), (torch.bfloat16, torch.float32),
                                                (torch.bfloat16, "x")],  # "x": the shift in x's dtype
                         ids=["fp32", "fp16-shift_fp32", "fp16", "bf16-shift_fp32", "bf16"])
def test_shift_is_added_before_the_statistics(path, dtype, shift_dtype, force_path, plans, device):
    """group_norm(x, shift=s) normalizes x + s[:, :, None, None] (ResnetBlock2D's conv1 bias + time
    embedding): on the pixel path folded into the pivots and means (its chunked shape, as in
    test_pixel_path_loops_over_tiles_and_chunks), in a one-tile group added in registers, on the
    streaming group paths added to x first (groups of five 32-element tiles, the last one masked)."""
    kw = force_path(path)
    (n, c, h, wd), g = ((3, 40, 7, 5), 8) if path == "pixels" else ((2, 12, 5, 7), 3)
    x, w, b = _inputs((n, c, h, wd), dtype, device)
    x = layout(x, "channels_last")
    shift = _shift(n, c, dtype if shift_dtype == "x" else shift_dtype, device)
    ours = group_norm(x, g, w, b, 1e-5, "silu", shift=shift, **kw)
    _check_shifted(x, g, w, b, shift, "silu", ours)
    assert ours.stride() == x.stride()
    assert plans[-1].pixels == (path == "pixels")


@pytest.mark.parametrize("path", ["looped", "pixels"])
def test_shift_that_is_the_mean(path, force_path, device):
    """A shift of 1,000 (the groups' mean then comes from it): the pixel path's pivot carries it, so
    the statistics stay as exact as for a large mean in x; and a [1, C] shift expanded over the batch
    (stride 0) reads the same row for every sample."""
    kw = force_path(path)
    x, w, b = _inputs((2, 40, 6, 6), torch.float32, device)
    x = layout(x, "channels_last")
    shift = _shift(1, 40, torch.float32, device, offset=1000.0).expand(2, 40)
    ours = group_norm(x, 8, w, b, 1e-5, None, shift=shift, **kw)
    _check_shifted(x, 8, w, b, shift, None, ours)


@pytest.mark.parametrize("shape, dtype", [((2, 5), torch.float32), ((2, 6, 1, 1), torch.float32),
                                          ((1, 6), torch.float32), ((2, 6), torch.int32)])
def test_bad_shift_raises(shape, dtype, device):
    x = torch.randn(2, 6, 4, 4, device=device)
    with pytest.raises(ValueError, match="shift must be a floating-point"):
        group_norm(x, 3, shift=torch.zeros(shape, dtype=dtype, device=device))


def test_eps_and_constant_groups(device):
    """A constant group has variance 0: the output is exactly the bias (through eps), never NaN."""
    x = torch.full((2, 4, 3, 3), 7.0, device=device)
    w, b = torch.randn(4, device=device), torch.randn(4, device=device)
    ours = group_norm(x, 2, w, b, 1e-5)
    torch.testing.assert_close(ours, b[None, :, None, None].expand_as(x), rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "shape, g, weight, bias",
    [
        ((2, 5, 4), 2, None, None),  # channels not divisible by groups
        ((5,), 1, None, None),  # fewer than 2 dims
        ((2, 4, 3), 2, (3,), None),  # weight of the wrong size
        ((2, 4, 3), 2, None, (0,)),  # bias of the wrong size
    ],
)
def test_bad_arguments_raise_like_torch(shape, g, weight, bias, device):
    x = torch.randn(shape, device=device)
    w = None if weight is None else torch.randn(weight, device=device)
    b = None if bias is None else torch.randn(bias, device=device)
    with pytest.raises(RuntimeError) as stock:
        F.group_norm(x, g, w, b)
    with pytest.raises(RuntimeError) as ours:
        group_norm(x, g, w, b)
    assert str(ours.value) == str(stock.value)


@pytest.mark.parametrize("g", [4.0, "4", True])
def test_a_group_count_that_is_not_an_int_raises_like_torch(g, device):
    x = torch.randn(2, 4, 3, device=device)
    with pytest.raises(TypeError) as stock:
        F.group_norm(x, g)
    with pytest.raises(TypeError, match=r"group_norm\(\): argument 'num_groups' must be int, not "):
        group_norm(x, g)
    assert type(g).__name__ in str(stock.value)


def test_bad_activation(device):
    with pytest.raises(ValueError, match="activation must be one of"):
        group_norm(torch.randn(2, 4, 3, device=device), 2, activation="relu")


def test_off_ground_inputs_take_the_reference(device):
    dispatch.reset_fallbacks()
    x = torch.randn(2, 4, 3, 3, dtype=torch.float64, device=device)
    assert torch.equal(group_norm(x, 2, activation="silu"), reference.group_norm(x, 2, activation="silu"))
    assert any(op == "group_norm" for op, _ in dispatch.fallbacks())


# ---------------------------------------------------------------------------------------------
# The size heuristic, at SD1.5's shapes (pure Python: the plan, not the kernel)

UNET_SHAPES = [(2, 320, 64, 64), (2, 640, 32, 32), (2, 1280, 16, 16), (2, 1280, 8, 8), (2, 960, 64, 64),
               (2, 1920, 32, 32), (2, 2560, 16, 16), (2, 640, 64, 64)]
VAE_SHAPES = [(1, 512, 128, 128), (1, 512, 256, 256), (1, 256, 512, 512), (1, 128, 512, 512)]


def _plan(shape, channels_fast=False, g=32, **kw):
    n, c, h, w = shape
    return gn.plan(n, g, c // g, h * w, channels_fast, **kw)


@pytest.mark.parametrize("shape", UNET_SHAPES)
def test_unet_shapes_take_one_launch_in_nchw(shape):
    p = _plan(shape)
    assert p.launches == 1 and p.chunks == 1 and not p.pixels
    assert p.block_c * p.block_s <= max(gn._TILE_ELEMS, gn._ONE_TILE_ELEMS)


@pytest.mark.parametrize("shape", VAE_SHAPES)
def test_vae_shapes_split_over_the_whole_gpu_in_nchw(shape):
    p = _plan(shape)
    assert p.split and p.launches == 2 and not p.pixels
    assert shape[0] * 32 * p.chunks >= 132  # at least one program per SM of an H100
    assert p.chunk % p.block_s == 0 and (p.chunks - 1) * p.chunk < shape[2] * shape[3] <= p.chunks * p.chunk


def _assert_sound_pixel_plan(p, n, c, hw, g=32):
    assert p.pixels and p.split and p.launches == 3 and not p.one_tile
    assert p.block_c == gn.next_pow2(c) and p.block_c * p.block_s <= gn._TILE_ELEMS
    assert p.norm_block_c == gn.next_pow2(c) and p.norm_block_c * p.norm_block_s <= gn._TILE_ELEMS
    assert p.chunk % p.block_s == 0 and p.chunk % p.norm_block_s == 0  # only a sample's last tile is masked
    assert (p.chunks - 1) * p.chunk < hw <= p.chunks * p.chunk
    assert n * p.chunks >= 132 and p.chunks <= 1024  # every SM busy
    assert p.stat_chunk % p.block_s == 0 and (p.stat_chunks - 1) * p.stat_chunk < hw <= p.stat_chunks * p.stat_chunk
    assert n * p.stat_chunks >= 132 and p.stat_chunks <= 1024  # the merge loads ≤ 1024 partials at once


@pytest.mark.parametrize("shape", UNET_SHAPES)
def test_unet_shapes_in_channels_last(shape):
    """A group that is one register tile keeps the one-launch group path (1 read + 1 write); every
    other UNet shape takes the pixel path."""
    p, nchw = _plan(shape, True), _plan(shape)
    if nchw.one_tile:
        assert p == nchw
    else:
        _assert_sound_pixel_plan(p, shape[0], shape[1], shape[2] * shape[3])


@pytest.mark.parametrize("shape", [*VAE_SHAPES, (1, 512, 64, 64), (1, 256, 256, 256), (1, 512, 64 * 64, 1)])
def test_vae_shapes_take_the_pixel_path_in_channels_last(shape):
    _assert_sound_pixel_plan(_plan(shape, True), shape[0], shape[1], shape[2] * shape[3])


@pytest.mark.parametrize("shape", UNET_SHAPES + VAE_SHAPES)
def test_nchw_plans_ignore_the_pixel_path(shape):
    assert _plan(shape) == _plan(shape, pixels=False) and not _plan(shape).pixels
    assert not _plan(shape, True, pixels=False).pixels  # channels_last on the group paths, as before


def test_pixel_path_needs_its_tile():
    """A pixel whose padded groups exceed _TILE_ELEMS keeps the group paths (unless forced)."""
    assert not gn.plan(1, 32, 512, 64 * 64, True).pixels  # 32 × 512 = 16384 padded channels
    assert gn.plan(1, 32, 256, 64 * 64, True).pixels
    assert gn.plan(1, 32, 512, 64 * 64, True, pixels=True).block_s == 1


@pytest.mark.parametrize("sms", [16, 66, 132, 264])
def test_pixel_programs_scale_with_the_sm_count(sms):
    p = _plan((1, 128, 512, 512), True, sms=sms)
    assert p.pixels and p.chunks == 512 * sms // 132


def test_tiles_have_no_masked_channel_lanes_in_nchw():
    for shape in UNET_SHAPES + VAE_SHAPES:
        p = _plan(shape)
        if not p.one_tile:
            assert (shape[1] // 32) % p.block_c == 0, (shape, p)


def test_split_threshold_forces_either_path():
    assert _plan((2, 320, 64, 64), split_threshold=0).split
    assert not _plan((1, 128, 512, 512), split_threshold=1 << 40).split


# ---------------------------------------------------------------------------------------------
# The plan on other devices: the SM count scales the split path, the profile's registers the one tile


def test_the_cpu_plans_as_an_h100():
    assert gn.sm_count(-1) == 132
    for shape in UNET_SHAPES + VAE_SHAPES:
        assert _plan(shape, sms=gn.sm_count(-1), register_file_kb=256) == _plan(shape)


@pytest.mark.parametrize("sms, chunks", [(132, 16), (66, 8), (264, 32), (16, 2)])
def test_split_programs_scale_with_the_sm_count(sms, chunks):
    # 1×512×128² NCHW: 32 groups of 16 channels × 128², 512-pixel tiles, 32 tiles a group; the split
    # aims at ≈ 512 programs at 132 SMs, so 16 chunks a group; half as many SMs, half as many chunks.
    p = _plan((1, 512, 128, 128), sms=sms)
    assert p.split and (p.block_c, p.block_s) == (16, 512)
    assert p.chunks == chunks and p.chunk == 16384 // chunks


@pytest.mark.parametrize("sms, split", [(132, True), (66, False), (40, False), (264, True)])
def test_few_groups_scale_with_the_sm_count(sms, split):
    # 1×512×64²: 32 (sample, group) pairs of 64 K elements. Fewer pairs than ≈ half the SMs (64 at
    # 132 SMs) split above 32 K elements; with ≤ 66 SMs, 32 pairs are enough to fill the GPU.
    assert _plan((1, 512, 64, 64), sms=sms).split is split


@pytest.mark.parametrize("kb, elems", [(None, 16384), (256, 16384), (1024, 16384), (128, 8192), (64, 4096),
                                       (32, 2048), (4, 2048)])
def test_one_tile_bound_scales_with_the_profiles_registers(kb, elems):
    assert gn.one_tile_elems(kb) == elems
    # 2×1280×16² pads to 64 channels × 256 pixels = 16384 elements a group, 2×1280×8² to 4096
    assert _plan((2, 1280, 16, 16), register_file_kb=kb).one_tile is (elems >= 16384)
    assert _plan((2, 1280, 8, 8), register_file_kb=kb).one_tile is (elems >= 4096)


def test_sm_count_is_queried_once_per_device(monkeypatch):
    calls = []

    def props(index):
        calls.append(index)
        return SimpleNamespace(multi_processor_count=108 if index == 0 else 58)

    monkeypatch.setattr(gn, "_SMS", {})
    monkeypatch.setattr(gn, "interpreting", lambda: False)
    monkeypatch.setattr(gn, "device_properties", props)
    assert [gn.sm_count(i) for i in (0, 1, 0, 1, -1)] == [108, 58, 108, 58, 132]
    assert calls == [0, 1]


def test_group_norm_plans_with_the_device_and_the_profile(monkeypatch, device):
    plans = []
    plan = gn.plan
    monkeypatch.setattr(gn, "plan", lambda *a, **kw: plans.append((kw, plan(*a, **kw))) or plans[-1][1])
    x, w, b = _inputs((1, 128, 32, 32), torch.float32, device)  # 4 channels × 1024 pixels: 4096 a group
    monkeypatch.setattr(gn, "_SMS", {x.get_device(): 8})  # the tensors' device as if an 8-SM GPU
    few = dataclasses.replace(profiles.get_profile("cpu"), name="few-registers", register_file_kb=32)
    monkeypatch.setattr(profiles, "_active", few)
    _check(x, 32, w, b, "silu", group_norm(x, 32, w, b, activation="silu"))
    ((kw, p),) = plans
    assert kw == {"sms": 8, "register_file_kb": 32, "pixels": None}
    assert not p.one_tile and not p.split  # one tile under 256 KB; 2048 elements under 32 KB


# ---------------------------------------------------------------------------------------------
# GPU: SD1.5's shapes (UNet at 64² latents, batch 2; VAE decoder to 512²)

GPU_CASES = [  # (shape, dtype, layout)
    *[(s, torch.float16, k) for s in [(2, 320, 64, 64), (2, 1280, 8, 8), (2, 1920, 32, 32), (2, 960, 64, 64),
                                      (1, 512, 64, 64), (1, 512, 256, 256), (1, 128, 512, 512)]
      for k in ("contiguous", "channels_last")],
    ((2, 640, 32, 32), torch.bfloat16, "contiguous"),
    ((2, 640, 32, 32), torch.bfloat16, "channels_last"),
    ((1, 256, 512, 512), torch.bfloat16, "channels_last"),
    ((2, 1280, 16, 16), torch.float32, "contiguous"),
    ((1, 512, 128, 128), torch.float32, "channels_last"),
    ((1, 512, 4096), torch.float16, "channels_last"),  # VAE mid-block attention's group_norm
]


@pytest.mark.gpu
@pytest.mark.parametrize("shape, dtype, kind", GPU_CASES)
def test_gpu_sd_shapes(shape, dtype, kind):
    x, w, b = _inputs(shape, dtype, "cuda")
    x = layout(x, kind)
    ours = group_norm(x, 32, w, b, 1e-6, "silu")
    _check(x, 32, w, b, "silu", ours, eps=1e-6)
    assert ours.stride() == x.stride()


SD_CHANNELS_LAST = [  # every GroupNorm shape of SD1.5 at 512² (32 groups), as the hopper profile runs them
    (2, 320, 64, 64), (2, 640, 64, 64), (2, 640, 32, 32), (2, 960, 64, 64), (2, 1280, 32, 32), (2, 1920, 32, 32),
    (2, 1280, 16, 16), (2, 2560, 16, 16), (2, 1920, 16, 16), (2, 2560, 8, 8), (2, 1280, 8, 8),  # UNet
    (1, 512, 64, 64), (1, 512, 128, 128), (1, 512, 256, 256), (1, 256, 256, 256), (1, 256, 512, 512),
    (1, 128, 512, 512),  # VAE decoder
    (1, 512, 4096),  # the VAE mid-block attention's [B, C, HW] view of [B, HW, C]
]


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", SD_CHANNELS_LAST)
def test_gpu_sd_shapes_channels_last(shape, dtype, activation, plans):
    """The pixel path (or the one tile, where a group fits one) at SD's shapes, against float64."""
    x, w, b = _inputs(shape, dtype, "cuda")
    x = layout(x, "channels_last")
    ours = group_norm(x, 32, w, b, 1e-6, activation)
    _check(x, 32, w, b, activation, ours, eps=1e-6)
    assert ours.stride() == x.stride()
    (p,) = plans
    assert p.pixels or p.one_tile


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 320, 64, 64), (2, 640, 32, 32), (2, 1280, 16, 16), (2, 1280, 8, 8)])
def test_gpu_shift_at_resnet_norm2_shapes(shape, dtype, plans, monkeypatch):
    """norm2 of SD1.5's ResnetBlock2Ds with conv1's bias + temb as the shift: as exact as stock's
    x + shift then GroupNorm, in the launches of the unshifted call (the pixel path's three, a
    one-tile group's one)."""
    monkeypatch.setattr(gn, "_alloc", _ALLOC)
    x, w, b = _inputs(shape, dtype, "cuda")
    x = layout(x, "channels_last")
    shift = _shift(shape[0], shape[1], torch.float32, "cuda", offset=0.5)
    ours = group_norm(x, 32, w, b, 1e-5, "silu", shift=shift)
    _check_shifted(x, 32, w, b, shift, "silu", ours)
    launches = _kernel_launches(lambda: group_norm(x, 32, w, b, 1e-5, "silu", shift=shift))
    assert plans[-1].pixels or plans[-1].one_tile
    assert launches == plans[-1].launches


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["contiguous", "channels_last"])
@pytest.mark.parametrize("shape", [(2, 320, 64, 64), (1, 128, 512, 512)])
def test_gpu_large_mean(shape, kind):
    x, w, b = _inputs(shape, torch.float32, "cuda", mean=1000.0)
    x = layout(x, kind)
    _check(x, 32, w, b, None, group_norm(x, 32, w, b))


def _kernel_launches(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


@pytest.mark.gpu
@pytest.mark.parametrize("shape, kind, launches",
                         [((2, 320, 64, 64), "contiguous", 1), ((2, 1280, 8, 8), "contiguous", 1),
                          ((1, 128, 512, 512), "contiguous", 2), ((2, 320, 64, 64), "channels_last", 3),
                          ((2, 1280, 8, 8), "channels_last", 1), ((1, 128, 512, 512), "channels_last", 3)])
def test_gpu_launch_count(shape, kind, launches, monkeypatch):
    monkeypatch.setattr(gn, "_alloc", _ALLOC)  # poisoning is a launch of its own
    x, w, b = _inputs(shape, torch.float16, "cuda")
    x = layout(x, kind)
    assert _kernel_launches(lambda: group_norm(x, 32, w, b, 1e-6, "silu")) == launches
    channels_last = kind == "channels_last"
    assert gn.plan(shape[0], 32, shape[1] // 32, math.prod(shape[2:]), channels_last).launches == launches
