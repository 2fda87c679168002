"""Winograd F(m×m, 3×3) against a float64 direct conv, with stock PyTorch's conv error as the yardstick.

Winograd rounds differently from a direct conv: V = BᵀdB and U = GgGᵀ are rounded to the storage
dtype and Aᵀ·A amplifies that rounding, more for bigger tiles. So the tolerance factor over stock's
error is per tile, and documented (docs/kernels/winograd.md, "fp16 error"): ERROR_FACTOR below. They
are ~2× above what the float64 emulation and these tests measure; a wrong index or a missed tile
gives errors of order 1.

CPU: tiny odd shapes through the Triton interpreter, fp32 and fp16 (bf16 tl.dot is garbage there).
GPU (-m gpu): SD1.5's UNet and VAE conv shapes, fp16 (bf16, fp32 on one shape), tiles 2/4/6, NCHW and
channels_last.
"""

import functools
import importlib

import pytest
import torch
import torch.nn.functional as F
from sweeps import one, sweep

from sd_kernels import reference
from sd_kernels.runtime import dispatch
from sd_kernels.testing import assert_close_to_reference, channels_last, non_contiguous, poison_, rel_err

wg = importlib.import_module("sd_kernels.ops.winograd")
winograd_conv2d, winograd_weight = wg.winograd_conv2d, wg.winograd_weight

# Allowed error / stock error, per dtype and tile. fp32 allows ~4× more: on the GPU the GEMM and the
# transforms run fp32 as "tf32x3" (operands kept to ~22 bits, not 24) where cuDNN (TF32 off) is fp32.
ERROR_FACTOR = {
    torch.float16: {2: 4, 4: 12, 6: 48, 8: 600},
    torch.bfloat16: {2: 4, 4: 12, 6: 48, 8: 600},
    torch.float32: {2: 12, 4: 40, 6: 160, 8: 3000},
}


@pytest.fixture(autouse=True)
def poisoned_buffers(monkeypatch):
    """Every buffer the op writes (V, M, y) starts as NaN: an element left unwritten shows in y."""
    alloc = wg._alloc
    monkeypatch.setattr(wg, "_alloc", lambda *args, **kw: poison_(alloc(*args, **kw)))


def _conv_inputs(N, C, H, W, K, dtype, device, bias=True):
    x = torch.randn(N, C, H, W, device=device).to(dtype)
    w = (torch.randn(K, C, 3, 3, device=device) / (3 * C**0.5)).to(dtype)
    b = torch.randn(K, device=device).to(dtype) if bias else None
    return x, w, b


def _check(ours, x, w, b, tile):
    ref64 = reference.conv2d_3x3(*reference.upcast(x, w, b))
    with wg._tf32_off():
        stock = reference.conv2d_3x3(x, w, b)
    return assert_close_to_reference(ours, stock, ref64, factor=ERROR_FACTOR[x.dtype][tile])


# ---------------------------------------------------------------------------------------------
# The algebra (no kernels)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tile", wg.TILES)
def test_transforms_compute_a_3x3_correlation_exactly(tile):
    """Aᵀ[(G g Gᵀ) ⊙ (Bᵀ d B)]A is the 2-D correlation of d with g, to float64 rounding."""
    tr = wg.winograd_transforms(tile)
    d = torch.randn(tr.alpha, tr.alpha, dtype=torch.float64)
    g = torch.randn(3, 3, dtype=torch.float64)
    y = tr.AT @ ((tr.G @ g @ tr.G.T) * (tr.BT @ d @ tr.BT.T)) @ tr.AT.T
    direct = F.conv2d(d[None, None], g[None, None])[0, 0]
    torch.testing.assert_close(y, direct, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("tile", wg.TILES)
def test_transforms_are_range_balanced(tile):
    """Rows of Bᵀ and G sum (in absolute value) to at most 1: V and U never exceed max|x|, max|g|."""
    tr = wg.winograd_transforms(tile)
    assert len(tr.points) == tile + 1
    for mat in (tr.BT, tr.G):
        sums = mat.abs().sum(1)
        assert ((sums > 0.5) & (sums <= 1)).all(), sums


# ---------------------------------------------------------------------------------------------
# Kernels on CPU (interpreter) and GPU: odd tiny shapes
# ---------------------------------------------------------------------------------------------

SHAPES = [  # N, C, H, W, K: H, W not multiples of any tile; 1×1 spatial; odd channel counts
    (2, 3, 7, 9, 5),
    (1, 5, 1, 1, 3),
    (1, 4, 6, 13, 2),
]


@pytest.mark.parametrize("shape, tile, dtype, layout",
                         sweep(one(SHAPES), one(wg.TILES), one([torch.float32, torch.float16]),
                               one(["nchw", "channels_last"])))
def test_matches_float64(shape, tile, dtype, layout, device):
    x, w, b = _conv_inputs(*shape, dtype, device)
    if layout == "channels_last":
        x = channels_last(x)
    ours = winograd_conv2d(x, w, b, tile)
    _check(ours, x, w, b, tile)
    assert ours.is_contiguous(memory_format=torch.channels_last if layout == "channels_last"
                              else torch.contiguous_format)


def test_strided_input_and_no_bias(device):
    x, w, _ = _conv_inputs(1, 3, 5, 6, 4, torch.float32, device, bias=False)
    xs = non_contiguous(x)
    _check(winograd_conv2d(xs, w, None, 4), xs, w, None, 4)


@pytest.mark.parametrize("tile", [2, 6])
def test_cached_weight_gives_the_same_result(tile, device):
    x, w, b = _conv_inputs(1, 3, 6, 7, 4, torch.float32, device)
    cached = winograd_weight(w, tile)
    assert cached.weight is w and cached.u.shape == ((tile + 2) ** 2, 3, 4)
    torch.testing.assert_close(winograd_conv2d(x, cached, b), winograd_conv2d(x, w, b, tile), rtol=0, atol=0)
    with pytest.raises(ValueError, match="tile 4 != the transformed weight's tile"):
        winograd_conv2d(x, cached, b, tile=4 if tile != 4 else 2)


def test_bmm_gemm_path(device):
    """The torch.bmm variant (M in x's dtype) that the benchmark compares against."""
    x, w, b = _conv_inputs(2, 3, 5, 7, 4, torch.float32, device)
    _check(wg._winograd(x, winograd_weight(w, 4).u, b, 4, gemm="bmm"), x, w, b, 4)


@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tile", wg.FUSED_TILES)
def test_fused_gemm_output_transform(tile, dtype, layout, device):
    """The experimental kernel that folds Aᵀ·A into the GEMM (no M buffer)."""
    x, w, b = _conv_inputs(2, 5, 7, 9, 3, dtype, device)
    x = channels_last(x) if layout == "channels_last" else x
    _check(wg._winograd(x, winograd_weight(w, tile).u, b, tile, gemm="fused"), x, w, b, tile)


def test_fused_refuses_big_tiles():
    x, w, b = _conv_inputs(1, 3, 6, 6, 2, torch.float32, "cpu")
    with pytest.raises(ValueError, match="fused GEMM"):
        wg._winograd(x, winograd_weight(w, 6).u, b, 6, gemm="fused")


def test_allocates_exactly_the_planned_buffers(monkeypatch, device):
    """winograd_table's byte ratios come from intermediate_shapes: it must be what the op allocates."""
    seen = []
    alloc = wg._alloc

    def recording(shape, dtype, *args, **kw):
        seen.append((tuple(shape), dtype))
        return alloc(shape, dtype, *args, **kw)

    monkeypatch.setattr(wg, "_alloc", recording)
    N, C, H, W, K = 2, 3, 7, 9, 5
    for layout in ("nchw", "channels_last"):
        seen.clear()
        x, w, b = _conv_inputs(N, C, H, W, K, torch.float16, device)
        x = channels_last(x) if layout == "channels_last" else x
        winograd_conv2d(x, winograd_weight(w, 4), b)
        plan = wg.intermediate_shapes(N, C, H, W, K, 4)
        a2, T = plan["V"][:2]
        v_shape, m_shape = (plan["V"], plan["M"]) if layout == "channels_last" else ((a2, C, T), (a2, K, T))
        assert sorted(seen, key=str) == sorted([(v_shape, torch.float16), (m_shape, wg.M_DTYPE),
                                                ((N, K, H, W), torch.float16)], key=str)


PAPER_TABLE = {  # tile: (multiply savings, intermediate tensors, weights), as printed in the paper
    2: (2.25, 4.00, 1.77), 4: (4.00, 2.25, 4.00), 6: (5.06, 1.80, 7.12), 8: (5.76, 1.56, 11.1),
}


def test_winograd_table_reproduces_the_paper(device):
    x, w, b = _conv_inputs(1, 4, 8, 8, 4, torch.float16, device)
    rows = wg.winograd_table(x, w, b)
    assert [r["tile"] for r in rows] == ["2x2", "4x4", "6x6", "8x8"]
    for r, (tile, paper) in zip(rows, PAPER_TABLE.items()):
        ours = (r["mult_savings"], r["intermediate_algebraic"], r["weights_algebraic"])
        assert all(abs(a - p) <= 0.03 for a, p in zip(ours, paper)), (tile, ours, paper)
        # Actual buffers: at least the algebra (edge tiles overhang 8×8 for m = 6), M in fp32 (2×).
        assert r["V_vs_input"] >= r["intermediate_algebraic"]
        assert r["M_vs_output"] >= 2 * r["intermediate_algebraic"]
        assert r["U_vs_weight"] == r["weights_algebraic"]
        assert r["rel_err_ours"] <= ERROR_FACTOR[torch.float16][tile] * r["rel_err_stock"]


# ---------------------------------------------------------------------------------------------
# What does not qualify
# ---------------------------------------------------------------------------------------------

BAD = [  # (weight shape, kwargs, message)
    ((4, 3, 3, 3), {"stride": 2}, "stride 2"),
    ((4, 3, 5, 5), {}, "kernel 5x5"),
    ((4, 3, 1, 1), {}, "kernel 1x1"),
    ((4, 3, 3, 3), {"padding": 0}, "padding 0"),
    ((4, 3, 3, 3), {"padding": "valid"}, "padding 0"),
    ((4, 3, 3, 3), {"dilation": 2}, "dilation 2"),
    ((4, 1, 3, 3), {"groups": 3}, "groups 3"),
    ((4, 3, 3, 3), {"tile": 3}, "tile must be one of"),
    ((4, 5, 3, 3), {}, "expects 5 input channels"),
]


@pytest.mark.parametrize("wshape, kwargs, message", BAD)
def test_bad_input_raises(wshape, kwargs, message):
    x = torch.randn(1, 3, 6, 6)
    with pytest.raises(ValueError, match=message):
        winograd_conv2d(x, torch.randn(wshape), **kwargs)


def test_unsupported_conv_reads_module_attributes():
    conv = torch.nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect")
    assert "padding_mode" in wg.unsupported_conv(conv.weight, conv.stride, conv.padding, conv.dilation,
                                                 conv.groups, conv.padding_mode)
    ok = torch.nn.Conv2d(3, 4, 3, padding=1)
    assert wg.unsupported_conv(ok.weight, ok.stride, ok.padding, ok.dilation, ok.groups, "zeros") is None


def test_float64_falls_back_to_the_reference(device):
    dispatch.reset_fallbacks()
    x, w, b = _conv_inputs(1, 3, 5, 5, 2, torch.float64, device)
    torch.testing.assert_close(winograd_conv2d(x, w, b), reference.conv2d_3x3(x, w, b), rtol=0, atol=0)
    assert any(op == "winograd_conv2d" and "float64" in why for op, why in dispatch.fallbacks())


# ---------------------------------------------------------------------------------------------
# GPU: SD1.5 shapes
# ---------------------------------------------------------------------------------------------

UNET = [(2, 4, 64, 64, 320), (2, 320, 64, 64, 320), (2, 640, 32, 32, 640), (2, 1280, 16, 16, 1280)]
VAE = [(1, 512, 64, 64, 512), (1, 256, 128, 128, 256), (1, 128, 256, 256, 128)]
GPU_CASES = (  # every SD shape × tile in channels_last; NCHW on one UNet and one VAE shape
    [(s, t, "channels_last") for s in UNET + VAE for t in (2, 4, 6)]
    + [(s, t, "nchw") for s in (UNET[1], VAE[1]) for t in (2, 4, 6)]
)


@functools.lru_cache(maxsize=2)
def _sd_case(shape, dtype):
    """Inputs, float64 reference and stock (cuDNN channels_last) output, shared by tiles and layouts."""
    torch.manual_seed(0)
    x, w, b = _conv_inputs(*shape, dtype, "cuda")
    ref64 = reference.conv2d_3x3(*reference.upcast(x, w, b))
    with wg._tf32_off():
        stock = reference.conv2d_3x3(channels_last(x), w, b)
    return x, w, b, ref64, stock


@pytest.mark.gpu
@pytest.mark.parametrize("shape, tile, layout", GPU_CASES, ids=str)
def test_sd_shapes_fp16(shape, tile, layout):
    x, w, b, ref64, stock = _sd_case(shape, torch.float16)
    x = channels_last(x) if layout == "channels_last" else x
    ours = winograd_conv2d(x, winograd_weight(w, tile), b)
    assert_close_to_reference(ours, stock, ref64, factor=ERROR_FACTOR[torch.float16][tile])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tiles", [(torch.bfloat16, (2, 4, 6)), (torch.float32, (2, 4, 6, 8))],
                         ids=["bf16", "fp32"])
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_sd_shape_other_dtypes(dtype, tiles, layout):
    x, w, b = _conv_inputs(2, 320, 32, 32, 320, dtype, "cuda")
    x = channels_last(x) if layout == "channels_last" else x
    for tile in tiles:
        _check(winograd_conv2d(x, w, b, tile), x, w, b, tile)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
@pytest.mark.parametrize("shape", [UNET[1], VAE[2]], ids=str)
def test_sd_shapes_fused_tile4(shape, layout):
    x, w, b, ref64, stock = _sd_case(shape, torch.float16)
    x = channels_last(x) if layout == "channels_last" else x
    ours = wg._winograd(x, winograd_weight(w, 4).u, b, 4, gemm="fused")
    assert_close_to_reference(ours, stock, ref64, factor=ERROR_FACTOR[torch.float16][4])


@pytest.mark.gpu
def test_bmm_path_and_tile8_fp16_bound():
    """torch.bmm variant at an SD shape; F(8,3) in fp16 stays within its (large) documented bound."""
    x, w, b, ref64, stock = _sd_case(VAE[0], torch.float16)
    x = channels_last(x)
    ours = wg._winograd(x, winograd_weight(w, 4).u, b, 4, gemm="bmm")
    assert_close_to_reference(ours, stock, ref64, factor=ERROR_FACTOR[torch.float16][4])
    bound = ERROR_FACTOR[torch.float16][8] * rel_err(stock, ref64)
    assert rel_err(winograd_conv2d(x, w, b, 8), ref64) <= bound


@pytest.mark.gpu
def test_large_offsets():
    """V holds 36 · 65,536 tiles · 1,024 channels = 2.4e9 elements > 2^31: int64 offsets. Checked on the
    bottom-right corner, the far end of every buffer (a 10×10 input window gives 9×9 exact outputs)."""
    x, w, b = _conv_inputs(1, 1024, 1024, 1024, 8, torch.float16, "cuda")
    x = channels_last(x)
    ours = winograd_conv2d(x, w, b, 4)[..., -9:, -9:]
    window = x[..., -10:, -10:]
    ref64 = reference.conv2d_3x3(*reference.upcast(window, w, b))[..., 1:, 1:]
    with wg._tf32_off():
        stock = reference.conv2d_3x3(window, w, b)[..., 1:, 1:]
    assert_close_to_reference(ours, stock, ref64, factor=ERROR_FACTOR[torch.float16][4])


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("tile", [2, 4])
def test_a_non_finite_input_spreads_over_whole_tiles(tile, value, device):
    """The documented difference from direct convolution (docs/kernels/winograd.md, "Non-finite
    inputs"): one NaN or ±inf makes every output of each tile whose (m+2)² input window holds it NaN,
    in every output channel; direct convolution only its 3×3 neighbourhood, NaN for a NaN and ±inf for
    an inf. Everything else matches."""
    N, C, H, W, K = 1, 2, 9, 8, 3
    x, w, b = _conv_inputs(N, C, H, W, K, torch.float32, device)
    r, c = 3, 4
    x[0, 1, r, c] = value
    ours = winograd_conv2d(x, w, b, tile).cpu()
    direct = F.conv2d(x.double().cpu(), w.double().cpu(), b.double().cpu(), padding=1)
    expected = torch.zeros(H, W, dtype=torch.bool)
    for ti in range(-(-H // tile)):
        for tj in range(-(-W // tile)):  # the tile's input window starts one pixel before its outputs
            if ti * tile - 1 <= r <= ti * tile + tile and tj * tile - 1 <= c <= tj * tile + tile:
                expected[ti * tile:(ti + 1) * tile, tj * tile:(tj + 1) * tile] = True
    bad = ~torch.isfinite(ours[0])  # [K, H, W]
    assert torch.equal(bad, expected.expand(K, H, W))
    assert torch.isnan(ours[0][bad]).all()  # NaN, also for an inf
    direct_bad = ~torch.isfinite(direct[0])
    assert direct_bad.sum() == K * 9 and not (direct_bad & ~bad).any()  # a 3×3 neighbourhood, inside ours
    assert (torch.isnan(direct[0][direct_bad]).all() if value != value else torch.isinf(direct[0][direct_bad]).all())
    torch.testing.assert_close(ours[0][~bad].double(), direct[0][~bad], rtol=1e-4, atol=1e-4)


def test_no_profile_routes_a_vae_conv():
    """Where Winograd may meet non-finite inputs, the profiles keep the stock conv: fp16 VAEs are the
    part known to overflow, and no profile routes any of the shipped VAEs' 3×3 convs."""
    from sd_kernels.patches.winograd import qualifies

    from sd_kernels import profiles
    from sd_kernels.models import build_model, list_configs

    pairs = {(m.in_channels, m.out_channels) for name in list_configs()
             for m in build_model(name, "vae", device="meta").modules() if qualifies(m)}
    assert pairs
    for name in profiles.list_profiles():
        p = profiles.get_profile(name)
        assert not any(p.routes_winograd(cin, cout, layout) for cin, cout in pairs
                       for layout in ("nchw", "channels_last")), name
