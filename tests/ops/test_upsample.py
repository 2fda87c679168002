"""upsample_conv2d (nearest-2× + 3×3 conv as one 2×2 conv of four phases) against float64: odd
shapes, every layout and dtype, with and without bias; the phase weights' algebra; the cache a
patched upsampler keeps; the dispatch (reference backend, a profile that disables it). It is made of
torch calls, so it runs on the CPU as it does on the GPU; GPU (-m gpu): the SD UNet's and VAE
decoder's upsampler shapes in fp16 and bf16."""

import gc

import pytest
import torch
import torch.nn.functional as F

from sd_kernels import reference
from sd_kernels.ops import upsample as up
from sd_kernels.ops import upsample_conv2d
from sd_kernels.ops.weight_cache import find
from sd_kernels.testing import assert_close_to_reference, channels_last, non_contiguous

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _layout(x, kind):
    return {"nchw": lambda t: t, "nhwc": channels_last, "strided": non_contiguous}[kind](x)


def _inputs(shape, k, dtype, device, kind="nchw", bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = _layout(torch.randn(shape, generator=g), kind).to(device, dtype)
    w = (torch.randn(k, shape[1], 3, 3, generator=g) / (3 * shape[1] ** 0.5)).to(device, dtype)
    b = torch.randn(k, generator=g).to(device, dtype) if bias else None
    return x, w, b


def _check(x, w, b, factor=4.0):
    ours = upsample_conv2d(x, w, b)
    stock = reference.upsample_conv2d(x, w, b)
    want = reference.upsample_conv2d(x.double(), w.double(), None if b is None else b.double())
    report = assert_close_to_reference(ours, stock, want, factor=factor)
    assert ours.shape == (x.shape[0], w.shape[0], 2 * x.shape[2], 2 * x.shape[3])
    assert ours.is_contiguous(memory_format=torch.channels_last if up.is_channels_last(x) else torch.contiguous_format)
    return report


@pytest.mark.parametrize("shape, k", [((1, 5, 7, 9), 6), ((2, 8, 4, 3), 8), ((1, 3, 1, 1), 4), ((1, 16, 6, 5), 12)])
@pytest.mark.parametrize("kind", ["nchw", "nhwc", "strided"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
def test_upsample_conv2d_is_nearest_then_conv(shape, k, kind, dtype, bias, device):
    _check(*_inputs(shape, k, dtype, device, kind, bias))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_non_finite_inputs_give_non_finite_outputs_where_stock_does(value, device):
    """docs/kernels/upsample.md, "Non-finite inputs": the same outputs are non-finite as stock's; a NaN
    gives NaN there, as stock; an inf gives ±inf (the folded tap's sign times the input's) at every one,
    where stock gives NaN wherever the taps it sums for it differ in sign."""
    x, w, b = _inputs((1, 2, 5, 6), 3, torch.float32, device)
    x[0, 1, 2, 3] = value
    ours = upsample_conv2d(x, w, b).cpu()
    stock = reference.upsample_conv2d(x, w, b).cpu()
    bad = ~torch.isfinite(ours)
    assert torch.equal(bad, ~torch.isfinite(stock)) and bad.sum() == 3 * 4 * 4  # 4×4 outputs per channel
    if value != value:
        assert torch.isnan(ours[bad]).all() and torch.isnan(stock[bad]).all()
        return
    assert torch.isinf(ours[bad]).all()
    one = torch.zeros_like(x)
    one[0, 1, 2, 3] = 1.0
    taps = reference.upsample_conv2d(one, w).cpu()  # per output: the sum of the taps that read the inf
    assert torch.equal(torch.sign(ours[bad]), torch.sign(value * taps[bad]))
    mixed = torch.isnan(stock[bad])
    assert 0 < mixed.sum() < bad.sum()  # stock: NaN where the taps differ in sign, ±inf elsewhere


def test_polyphase_weight_folds_the_kernel():
    """Each phase's four taps sum the nine taps (every 3×3 tap lands in exactly one 2×2 tap), and
    phase (0, 0)'s corner tap is the kernel's top-left alone (rows {0}, columns {0})."""
    w = torch.randn(3, 2, 3, 3, dtype=torch.float64)
    w4 = up.polyphase_weight(w)
    assert w4.shape == (12, 2, 2, 2)
    for phase in range(4):
        torch.testing.assert_close(w4[3 * phase:3 * phase + 3].sum((2, 3)), w.sum((2, 3)))
    torch.testing.assert_close(w4[:3, :, 0, 0], w[:, :, 0, 0])
    torch.testing.assert_close(w4[9:, :, 1, 1], w[:, :, 2, 2])  # phase (1, 1): rows and columns {2}
    assert up.polyphase_weight(w.float(), channels_last=True).is_contiguous(memory_format=torch.channels_last)


def test_interleave_places_each_phase():
    """out[2i + a, 2j + b] = p[phase (a, b), i + a, j + b] + bias, into a view of a larger buffer."""
    n, c, h, w = 1, 2, 3, 4
    p = torch.arange(n * 4 * c * (h + 1) * (w + 1), dtype=torch.float32).view(n, 4 * c, h + 1, w + 1)
    bias = torch.tensor([0.5, -0.25])
    buf = torch.full((n, c, 2 * h + 2, 2 * w), float("nan"))
    out = up.interleave_phases(p, bias, buf[:, :, 1:1 + 2 * h])
    for a in (0, 1):
        for b in (0, 1):
            phase = p[:, (2 * a + b) * c:(2 * a + b + 1) * c, a:a + h, b:b + w] + bias.view(1, c, 1, 1)
            torch.testing.assert_close(out[:, :, a::2, b::2], phase, rtol=0, atol=0)
    assert buf[:, :, 0].isnan().all() and buf[:, :, -1].isnan().all()


def test_upsample_conv2d_checks_its_arguments(device):
    x = torch.randn(1, 4, 3, 3, device=device)
    with pytest.raises(ValueError, match="3, 3"):
        upsample_conv2d(x, torch.randn(5, 4, 1, 1, device=device))
    with pytest.raises(ValueError, match="input channels"):
        upsample_conv2d(x, torch.randn(5, 3, 3, 3, device=device))
    with pytest.raises(ValueError, match="bias must have"):
        upsample_conv2d(x, torch.randn(5, 4, 3, 3, device=device), torch.randn(4, device=device))


def test_reference_backend_and_disabled_op_run_stock(monkeypatch, device):
    """SD_KERNELS_BACKEND=reference and a profile's ``disabled_ops`` give stock's very bits."""
    from sd_kernels import profiles

    x, w, b = _inputs((1, 6, 5, 4), 6, torch.float32, device)
    stock = F.conv2d(F.interpolate(x, scale_factor=2.0, mode="nearest"), w, b, padding=1)
    assert not torch.equal(upsample_conv2d(x, w, b), stock)  # the phases round differently
    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    assert torch.equal(upsample_conv2d(x, w, b), stock)
    monkeypatch.delenv("SD_KERNELS_BACKEND")
    with profiles.using_profile(profiles.get_profile("mobile-small")):
        assert torch.equal(upsample_conv2d(x, w, b), stock)


def test_mixed_dtypes_raise_as_stock_does():
    x, w, b = _inputs((1, 4, 3, 3), 4, torch.float32, "cpu")
    with pytest.raises(RuntimeError):
        upsample_conv2d(x.double(), w, b)


def test_phase_cache_follows_the_weight_and_dies_with_its_owner():
    w = torch.nn.Parameter(torch.randn(4, 3, 3, 3), requires_grad=False)
    cache = up.PhaseCache(w)
    assert find(w, up.KIND) is cache and up.cached_phases(w, False) is up.cached_phases(w, False)
    first = up.cached_phases(w, False)
    with torch.no_grad():
        w.mul_(2)  # in place: a fused LoRA, load_state_dict
    again = up.cached_phases(w, False)
    assert again is not first
    torch.testing.assert_close(again, 2 * first)
    assert cache.nbytes() == again.nbytes
    del cache
    gc.collect()
    assert find(w, up.KIND) is None
    torch.testing.assert_close(up.cached_phases(w, False), again)  # computed for the call


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 512, 64, 64), (1, 512, 128, 128), (1, 256, 256, 256),  # VAE decoder
                                   (2, 1280, 8, 8), (2, 1280, 16, 16), (2, 640, 32, 32)])  # SD1.5 UNet
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_sd_upsampler_shapes(shape, dtype):
    for kind in ("nhwc", "nchw"):
        _check(*_inputs(shape, shape[1], dtype, "cuda", kind))
