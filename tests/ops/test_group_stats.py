"""group_stats / merge_group_stats / group_norm_given (GroupNorm in two steps, for a streamed decode)
against float64: a band's statistics, bands merged, and bands normalized with the whole's statistics
must give the whole tensor's GroupNorm. CPU: tiny shapes through the interpreter; GPU (-m gpu): the
SD1.5 VAE decoder's band shapes."""

import importlib

import pytest
import torch
import torch.nn.functional as F
from sweeps import one, sweep

from sd_kernels import reference
from sd_kernels.ops import group_norm_given, group_stats, mean_rstd, merge_group_stats
from sd_kernels.testing import channels_last, non_contiguous, poison_

gs = importlib.import_module("sd_kernels.ops.group_stats")
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp2:RuntimeWarning")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    alloc = gs._alloc
    monkeypatch.setattr(gs, "_alloc", lambda *args: poison_(alloc(*args)))


def _layout(x, kind):
    return {"nchw": lambda t: t, "nhwc": channels_last, "strided": non_contiguous}[kind](x)


def _banded(x, g, weight, bias, activation, cuts):
    """GroupNorm of x as a streamed decode computes it: statistics per band, merged, then each band
    normalized with them; the bands concatenated."""
    bands = list(zip(cuts, cuts[1:]))
    st = merge_group_stats(torch.stack([group_stats(x[:, :, a:b], g) for a, b in bands], -1))
    mr = mean_rstd(st, 1e-6)
    return torch.cat([group_norm_given(x[:, :, a:b], mr, weight, bias, activation) for a, b in bands], 2), st


# The activation is the normalize launch's epilogue, in fp32 before the store: without it once (fp32);
# with it in every dtype (the dtype changes only the loads and the store).
@pytest.mark.parametrize("shape, g, cuts, kind, dtype, activation", sweep(
    [((2, 32, 9, 7), 8, (0, 4, 9)), ((1, 48, 5, 13), 16, (0, 1, 3, 5)), ((1, 12, 20, 3), 3, (0, 20))],
    one(["nchw", "nhwc", "strided"]), [(torch.float32, None), *((d, "silu") for d in DTYPES)]))
def test_bands_normalized_with_the_whole_statistics_are_group_norm(shape, g, cuts, kind, dtype, activation, device):
    x = _layout((torch.randn(shape) * 2 + 3).to(device, dtype), kind)  # a mean off zero: no cancellation
    w, b = torch.randn(shape[1], device=device), torch.randn(shape[1], device=device)
    out, st = _banded(x, g, w, b, activation, cuts)
    want = F.group_norm(x.double(), g, w.double(), b.double(), 1e-6)
    want = F.silu(want) if activation else want
    stock = reference.group_norm(x, g, w.to(dtype), b.to(dtype), 1e-6, activation)
    stock_err = (stock.double() - want).abs().max().item()
    err = (out.double() - want).abs().max().item()
    assert err <= max(4 * stock_err, 1e-5), (err, stock_err)
    ref_st = reference.group_stats(x, g)
    torch.testing.assert_close(st.cpu(), ref_st.cpu(), rtol=1e-5, atol=1e-3)
    assert st.dtype == torch.float64 and st.shape == (3, shape[0], g)


def test_merge_has_no_cancellation():
    """Two parts with a mean of 1e4 and a spread of 1: Chan's merge keeps M2 exact where Σx² − n·mean²
    in fp32 would lose it all."""
    a, b = torch.randn(1, 1, 1000).double() + 1e4, torch.randn(1, 1, 1000).double() + 1e4
    parts = torch.stack([reference.group_stats(t.view(1, 1, -1, 1), 1) for t in (a, b)], -1)
    whole = reference.group_stats(torch.cat([a, b], -1).view(1, 1, -1, 1), 1)
    torch.testing.assert_close(merge_group_stats(parts), whole, rtol=1e-12, atol=1e-6)


@pytest.mark.parametrize("kind", ["nchw", "nhwc"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_given_statistics_in_place_and_into_out(kind, dtype, device):
    """``out=x`` normalizes in place (a band of a larger tensor, as the streamed decode's norm2 does)
    and ``out=`` another tensor receives the same values as a fresh output."""
    whole = _layout(torch.randn(1, 16, 12, 5) * 2 + 1, kind).to(device, dtype)
    w, b = torch.randn(16, device=device), torch.randn(16, device=device)
    mr = mean_rstd(group_stats(whole, 4), 1e-6)
    want = group_norm_given(whole[:, :, 2:9], mr, w, b, "silu")
    into = poison_(torch.empty_like(want))
    assert group_norm_given(whole[:, :, 2:9], mr, w, b, "silu", out=into) is into
    band = whole[:, :, 2:9]
    assert group_norm_given(band, mr, w, b, "silu", out=band) is band
    torch.testing.assert_close(into, want, rtol=0, atol=0)
    torch.testing.assert_close(whole[:, :, 2:9], want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="out must have x's shape"):
        group_norm_given(whole, mr, w, b, out=whole[:, :, 1:])


@pytest.mark.parametrize("kind", ["nchw", "nhwc", "strided"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_given_statistics_of_x_plus_a_shift(kind, dtype, device):
    """``shift=`` (a conv's bias not yet added, as the streamed decode's norm2 takes conv1's):
    GroupNorm of x + shift[c] with that sum's statistics, against float64; in place too."""
    x = _layout(torch.randn(1, 24, 7, 6) * 2 + 1, kind).to(device, dtype)
    shift = (torch.randn(24) * 3).to(device, dtype)
    w, b = torch.randn(24, device=device), torch.randn(24, device=device)
    xs = x.double() + shift.double().view(1, -1, 1, 1)
    mr = mean_rstd(reference.group_stats(xs, 6), 1e-6)
    want = F.silu(F.group_norm(xs, 6, w.double(), b.double(), 1e-6))
    stock = reference.group_norm((x + shift.view(1, -1, 1, 1)), 6, w.to(dtype), b.to(dtype), 1e-6, "silu")
    stock_err = (stock.double() - want).abs().max().item()
    got = group_norm_given(x, mr, w, b, "silu", shift=shift.view(1, -1))
    assert (got.double() - want).abs().max().item() <= max(4 * stock_err, 1e-5)
    assert group_norm_given(x, mr, w, b, "silu", out=x, shift=shift.view(1, -1)) is x
    torch.testing.assert_close(x, got, rtol=0, atol=0)
    with pytest.raises(ValueError, match="shift must be"):
        group_norm_given(x, mr, w, b, shift=shift)


def test_bad_stats_shape_raises(device):
    x = torch.randn(2, 8, 3, 3, device=device)
    with pytest.raises(ValueError, match=r"stats must be \[2, N, G\]"):
        group_norm_given(x, torch.zeros(2, 1, 4, device=device))
    with pytest.raises(RuntimeError, match="divisible by num_groups"):
        group_norm_given(x, torch.zeros(2, 2, 3, device=device))


@pytest.mark.gpu
@pytest.mark.parametrize("shape, g, rows", [((1, 512, 256, 256), 32, 24), ((1, 256, 512, 512), 32, 20),
                                            ((1, 128, 512, 512), 32, 36)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gpu_vae_band_shapes(shape, g, rows, dtype):
    x = torch.randn(shape, device="cuda", dtype=dtype) + 1
    w, b = torch.randn(shape[1], device="cuda"), torch.randn(shape[1], device="cuda")
    cuts = tuple(range(0, shape[2], rows)) + (shape[2],)
    out, _ = _banded(x, g, w, b, "silu", cuts)
    want = F.silu(F.group_norm(x.double(), g, w.double(), b.double(), 1e-6))
    stock_err = (reference.group_norm(x, g, w.to(dtype), b.to(dtype), 1e-6, "silu").double() - want).abs().max().item()
    assert (out.double() - want).abs().max().item() <= max(4 * stock_err, 1e-5)


def test_the_bare_statistics_launch_passes_the_autotuned_launches_options():
    """Triton keys its in-memory kernel cache on the options' string: the band statistics (the autotuned
    kernel run bare) pass the whole config, in its order, as the launcher does (launch.py)."""
    from sd_kernels.runtime.launch import Launcher

    order = Launcher(importlib.import_module("sd_kernels.ops.group_norm")._group_stats_kernel).config_order
    for tile in (512, 8192, 16384):
        options = gs._options(tile)
        assert options["num_warps"] == gs._warps(tile)
        if gs._warps(tile) in gs._OPTIONS:  # the interpreter's autotuner keeps one config
            assert list(options) == [k for k in order if k in options] and len(options) > 1
