"""The FP8 3×3 convolution (ops/fp8_conv.py): the input's quantization a sample against the reference's codes
and scales; the implicit GEMM against a float64 convolution of the same codes (the only difference allowed: fp32
accumulation and the output's rounding), and against the exact convolution (the quantization's own error,
reported and bounded). Tiny shapes: the CPU runs them through the interpreter."""

import importlib
import math

import pytest
import torch
import torch.nn.functional as F

from sd_kernels.testing import channels_last, non_contiguous, rel_err

fc = importlib.import_module("sd_kernels.ops.fp8_conv")
E4M3 = torch.float8_e4m3fn
ULP = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}


def _inputs(nb, c, h, w, co, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(nb, c, h, w, generator=g).to(device, dtype)
    if nb > 1:
        x[1] *= 8  # samples of different ranges: each gets its own scale
    weight = (torch.randn(co, c, 3, 3, generator=g) / math.sqrt(9 * c)).to(device, dtype)
    bias = torch.randn(co, generator=g).to(device, dtype)
    return x, weight, bias


def _check(x, weight, bias, accumulation: float = 0.0):
    """Ours against the float64 convolution of the same codes and against the exact one; returns (ours, the
    codes' reference) against the exact one. On the CPU every element within 2 ulps of the output's dtype of the
    largest, plus fp32's worst-case accumulation over the K = 9·C products (K ulps of fp32: the reference's own,
    where a GPU host runs the reference for CPU tensors). On a GPU (``accumulation`` > 0), where the FP8 tensor
    cores add the products into fewer mantissa bits than fp32 has (tests/ops/test_fp8_linear.py
    ``_accumulation_floor``), within the output's rounding plus that, relative to the whole output (its norm)."""
    w_q, s_w = fc.quantize_conv_weight(weight)
    y = fc.conv3x3_fp8(x, w_q, s_w, bias)
    assert y.shape == (x.shape[0], weight.shape[0], *x.shape[2:]) and y.dtype == x.dtype
    assert y.is_contiguous(memory_format=torch.channels_last)
    ref = fc.reference_conv3x3_fp8(x, w_q, s_w, bias, compute=torch.float64).double()
    if accumulation:
        assert rel_err(y, ref) <= ULP[x.dtype] + accumulation, rel_err(y, ref)
    else:
        scale, k = ref.abs().amax(), 9 * x.shape[1]
        bound = (2 * ULP[x.dtype] + k * ULP[torch.float32]) * scale
        assert (y.double() - ref).abs().max() <= bound, float((y.double() - ref).abs().max() / scale)
    exact = F.conv2d(x.double(), weight.double(), None if bias is None else bias.double(), padding=1)
    return rel_err(y, exact), rel_err(ref, exact)


# Each case on the CPU (through the interpreter) and on a GPU's compiled kernels: on a GPU host the CPU tensors run
# the reference, so the "cuda" cases are what checks the compiled kernel there.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _device(device: str) -> float:
    """The FP8 tensor cores' accumulation bound for ``_check`` (0 on the CPU); skips without FP8 tensor cores."""
    if device == "cuda" and (not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9)):
        pytest.skip("needs a GPU with FP8 tensor cores (sm_89 or later)")
    return 0.0


def _accumulation(device: str, c: int) -> float:
    return 2.0**-12 * math.sqrt(9 * c / 64) if device == "cuda" else 0.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("nb,c,h,w,co", [(2, 64, 5, 7, 48), (1, 32, 3, 9, 40), (3, 96, 4, 4, 16)])
def test_conv_against_the_quantized_reference_and_the_exact_conv(nb, c, h, w, co, dtype, device):
    """Odd sizes (output channels not a multiple of the tile, an image edge in every tile, 96 input channels:
    BLOCK_K 32), channels_last input, several samples of different ranges."""
    _device(device)
    x, weight, bias = _inputs(nb, c, h, w, co, dtype, device)
    ours, quantized = _check(channels_last(x), weight, bias, _accumulation(device, c))
    assert ours < 0.06 and ours <= quantized * 1.05 + 2 * ULP[dtype], (ours, quantized)  # e4m3's 2⁻⁴ a code


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_any_input_strides_and_no_bias(layout, device):
    _device(device)
    x, weight, _ = _inputs(2, 32, 4, 6, 24, torch.float16, device)
    x = non_contiguous(x) if layout == "strided" else x.contiguous()
    _check(x, weight, None, _accumulation(device, 32))


def test_the_weight_codes_are_laid_out_tap_by_tap():
    """codes[o, (kh·3 + kw)·C + c] is weight[o, c, kh, kw]'s code: the kernel's K order."""
    _, weight, _ = _inputs(1, 32, 3, 3, 8, torch.float16)
    w_q, s_w = fc.quantize_conv_weight(weight)
    assert w_q.shape == (8, 9 * 32) and w_q.dtype == E4M3 and s_w.shape == (8,)
    back = (w_q.float() * s_w[:, None]).reshape(8, 3, 3, 32).permute(0, 3, 1, 2)
    assert rel_err(back, weight.float()) < 0.04
    amax = weight.float().abs().amax(dim=(1, 2, 3))
    assert torch.equal(s_w, amax / 448)
    for kh, kw, c in ((1, 2, 5), (0, 0, 31), (2, 1, 0)):
        code = (weight[:, c, kh, kw].float() * (torch.full_like(amax, 448) / amax)).to(E4M3)
        assert torch.equal(w_q[:, (kh * 3 + kw) * 32 + c].float(), code.float())
    with pytest.raises(ValueError, match=r"\[C_out, C, 3, 3\]"):
        fc.quantize_conv_weight(weight[:, :, :1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["channels_last", "contiguous"])
def test_quantize_samples_matches_the_reference(layout, device):
    """One scale a sample (its max |x| / 448), the codes NHWC; more pixels than one program's (partial maxima)."""
    _device(device)
    x, _, _ = _inputs(3, 32, 9, 17, 8, torch.bfloat16, device)
    x = channels_last(x) if layout == "channels_last" else x
    q, s = fc.quantize_samples(x)
    rq, rs = fc.reference_quantize_samples(x)
    assert q.shape == (3, 9, 17, 32) and q.is_contiguous() and s.shape == (3,)
    assert torch.equal(s, rs) and torch.equal(s, x.float().abs().amax(dim=(1, 2, 3)) / 448)
    assert torch.equal(q.float(), rq.float())


@pytest.mark.parametrize("device", DEVICES)
def test_a_zero_sample_and_a_nan_sample(device):
    """A zero sample: codes and scale 0, so its output is the bias. A NaN: that sample's output is NaN, the
    others' are not."""
    _device(device)
    x, weight, bias = _inputs(3, 32, 3, 4, 16, torch.float16, device)
    x[0] = 0
    x[2, 5, 1, 1] = float("nan")
    q, s = fc.quantize_samples(x)
    assert s[0] == 0 and not q[0].float().any() and torch.isnan(s[2])
    y = fc.conv3x3_fp8(x, *fc.quantize_conv_weight(weight), bias)
    assert torch.equal(y[0], bias[:, None, None].expand(16, 3, 4))
    assert torch.isnan(y[2]).all() and torch.isfinite(y[1]).all()


def test_refusals():
    x, weight, _ = _inputs(1, 32, 3, 3, 8, torch.float16)
    w_q, s_w = fc.quantize_conv_weight(weight)
    assert fc.conv_reason(x, w_q) is None
    assert "multiple of 32" in fc.conv_reason(x[:, :24], w_q)
    assert "fp16, bf16 or fp32" in fc.conv_reason(x.double(), w_q)
    assert "weight codes" in fc.conv_reason(torch.cat([x, x], 1), w_q)
    with pytest.raises(ValueError, match="weight codes"):
        fc.conv3x3_fp8(torch.cat([x, x], 1), w_q, s_w)
    with pytest.raises(ValueError, match="bias must have shape"):
        fc.conv3x3_fp8(x, w_q, s_w, torch.zeros(3, dtype=x.dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("nb,c,h,w,co", [(2, 320, 64, 64, 320), (2, 960, 32, 32, 320), (2, 1280, 16, 16, 1280),
                                         (2, 2560, 8, 8, 1280), (1, 640, 24, 40, 640)])
def test_gpu_conv_at_unet_shapes(nb, c, h, w, co, dtype):
    """SDXL's ResNet shapes (channels, smaller images), each of ``blocks``' tiles: within the output's rounding
    and the FP8 tensor cores' accumulation (2⁻¹² at 64 products, growing as √K) of the float64 convolution of
    the same codes, and no further from the exact convolution than that reference is."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a GPU with FP8 tensor cores (sm_89 or later)")
    x, weight, bias = _inputs(nb, c, h, w, co, dtype, device="cuda")
    ours, quantized = _check(channels_last(x), weight, bias, accumulation=2.0**-12 * math.sqrt(9 * c / 64))
    assert ours < 0.06 and ours <= quantized * 1.05 + 2 * ULP[dtype], (ours, quantized)
