"""pack8 / unpack8 (an activation kept as int8 codes with a float32 scale per pixel and group of
channels) against float64: each element within half its group's step, the codes the reference's, every
layout and dtype, into rows of a byte buffer as the streamed VAE decode keeps them, non-finite groups
NaN. CPU: the interpreter; GPU (-m gpu): the SD1.5 VAE decoder's band shapes."""

import pytest
import torch

from sd_kernels import reference
from sd_kernels.ops import pack8, unpack8
from sd_kernels.ops.pack8 import pack_group
from sd_kernels.testing import UNIT_ROUNDOFF, channels_last, non_contiguous, poison_

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _layout(x, kind):
    return {"nchw": lambda t: t, "nhwc": channels_last, "strided": non_contiguous}[kind](x)


def _buffers(x):
    n, c, h, w = x.shape
    return (torch.empty(n, h, w, c, dtype=torch.int8, device=x.device),
            torch.empty(n, h, w, c // pack_group(c), device=x.device))


def _round_trip(x, kind="nhwc"):
    values, scales = _buffers(x)
    pack8(x, values, scales)
    out = poison_(_layout(torch.empty(x.shape, dtype=x.dtype), kind).to(x.device))
    return values, scales, unpack8(values, scales, out)


def _steps(x):
    """Each element's group step max|x| / 127 (float64), broadcast to x's shape."""
    g = pack_group(x.shape[1])
    v = x.double().unflatten(1, (-1, g))
    return (v.abs().amax(2, keepdim=True) / 127).expand_as(v).flatten(1, 2)


@pytest.mark.parametrize("shape", [(1, 64, 5, 7), (2, 96, 3, 9), (1, 16, 4, 4), (1, 24, 3, 5)])
@pytest.mark.parametrize("kind", ["nchw", "nhwc", "strided"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_is_within_half_a_step(shape, kind, dtype, device):
    """96 channels: three groups in a padded tile of 128; 24: one group of 24, not a power of two
    (the reference runs)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g) * torch.rand(1, shape[1], 1, 1, generator=g) * 8
    x = _layout(x, kind).to(device, dtype)
    values, scales, y = _round_trip(x, kind)
    assert y.dtype == dtype and y.shape == x.shape
    err = (y.double() - x.double()).abs()
    # + two units of q·s's rounding (the interpreter truncates to bf16)
    bound = _steps(x) / 2 * (1 + 2**-20) + 2 * UNIT_ROUNDOFF[dtype] * x.double().abs()
    assert (err <= bound).all(), (err - bound).max().item()
    want_v, want_s = _buffers(x)
    reference.pack8(x, want_v, want_s)
    assert (values.int() - want_v.int()).abs().max().item() <= 1  # a division rounded differently at a tie
    assert (values != want_v).float().mean().item() < 0.01
    torch.testing.assert_close(scales, want_s, rtol=2**-22, atol=0)


def test_into_rows_of_a_byte_buffer(device):
    """The decode's layout: each row of [W, C] codes followed by its [W, C / G] scales, rows of a
    larger uint8 buffer; nothing else of the buffer is written."""
    n, c, h, w = 1, 64, 6, 5
    x = channels_last(torch.randn(n, c, h, w)).to(device, torch.float16)
    row = w * c + w * (c // 32) * 4
    buf = torch.full((3 * row + (h + 3) * row,), 7, dtype=torch.uint8, device=device)
    rows = buf[3 * row:3 * row + h * row].view(h, row)
    values = rows[:, :w * c].view(torch.int8).view(1, h, w, c)
    scales = rows[:, w * c:].view(torch.float32).view(1, h, w, c // 32)
    pack8(x, values, scales)
    assert (buf[:3 * row] == 7).all() and (buf[3 * row + h * row:] == 7).all()
    y = unpack8(values, scales, torch.empty_like(x))
    assert ((y.double() - x.double()).abs() <= _steps(x) / 2 * (1 + 2**-20) + 2**-11 * x.double().abs()).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_value_makes_its_group_nan(bad, device):
    x = torch.randn(1, 64, 3, 4)
    x[0, 40, 1, 2] = bad  # group 1 of pixel (1, 2)
    x = channels_last(x).to(device, torch.float16)
    _, scales, y = _round_trip(x)
    assert y[0, 32:, 1, 2].isnan().all() and scales[0, 1, 2, 1].isnan()
    finite = torch.ones_like(y, dtype=torch.bool)
    finite[0, 32:, 1, 2] = False
    assert y[finite].isfinite().all()


def test_zeros_pack_to_zero(device):
    x = torch.zeros(1, 32, 2, 3, device=device)
    x[0, :, 1, 1] = 1e-3
    values, scales, y = _round_trip(x)
    assert (scales[0, 0, 0] == 0).all() and (values[0, 0] == 0).all() and (y[0, :, 0] == 0).all()
    assert scales[0, 1, 1, 0] > 0 and ((y[0, :, 1, 1] - 1e-3).abs() <= 1e-3 * 2**-11).all()


def test_a_group_too_small_to_scale_packs_to_zero(device):
    """127 / max|x| overflows fp32 below 3.7e-37: a group no larger than reference.SCALE_TINY gets codes 0 (and its
    scale), in the kernel as in the reference, not the 0 · inf of before (NaN codes, and the two apart)."""
    x = torch.zeros(1, 32, 1, 2, device=device)
    x[0, :3, 0, 0] = torch.tensor([1e-37, 5e-38, -2e-38])
    x[0, :3, 0, 1] = torch.tensor([2.0**-118, 1.0e-36, 0.0])  # just above: quantized as any group
    values, scales = _buffers(x)
    pack8(x, values, scales)
    want_v, want_s = _buffers(x)
    reference.pack8(x, want_v, want_s)
    # such groups' scales are subnormal: the GPU's division may flush them to 0 (codes 0 either way)
    assert torch.equal(values, want_v) and torch.allclose(scales, want_s, rtol=1e-6, atol=2.0**-126)
    assert not values[0, 0, 0].any() and values[0, 0, 1, 0] == 127


@pytest.mark.parametrize("what", ["values_dtype", "values_shape", "scales_shape", "scales_dtype", "dims"])
def test_bad_operands_are_refused(what):
    x = torch.randn(1, 64, 2, 3)
    values, scales = _buffers(x)
    bad = {"values_dtype": lambda: pack8(x, values.to(torch.uint8), scales),
           "values_shape": lambda: pack8(x, values[:, :1], scales),
           "scales_shape": lambda: pack8(x, values, torch.empty(1, 2, 3, 1)),
           "scales_dtype": lambda: unpack8(values, scales.half(), x),
           "dims": lambda: pack8(x[0], values, scales)}[what]
    with pytest.raises(ValueError):
        bad()


@pytest.mark.gpu
@pytest.mark.parametrize("c, h", [(128, 512), (256, 512), (256, 256), (512, 128)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_decoder_band_shapes(c, h, dtype):
    """A 12-row band of each of the SD1.5 VAE decoder's kept activations, channels_last."""
    x = channels_last(torch.randn(1, c, 12, h, device="cuda") * 4).to(dtype)
    values, scales, y = _round_trip(x)
    bound = _steps(x) / 2 * (1 + 2**-20) + UNIT_ROUNDOFF[dtype] * x.double().abs()
    assert ((y.double() - x.double()).abs() <= bound).all()
