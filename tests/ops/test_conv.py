"""conv2d (implicit GEMM) against a float64 conv, with stock PyTorch's error at the same dtype as the
yardstick (a direct conv: the same sums in another order, so a small factor over stock).

CPU: tiny odd shapes through the Triton interpreter (one 16×16×16 tile config, so that channels,
pixels and output channels all span several tiles and a partial last one), fp32 and fp16 (the
interpreter's bf16 tl.dot is wrong). GPU (-m gpu): SD1.5's UNet and VAE conv shapes, fp16 and bf16,
channels_last as the patch would run them, NCHW once.
"""

import importlib

import pytest
import torch

from sd_kernels import reference
from sd_kernels.runtime import dispatch
from sd_kernels.testing import assert_close_to_reference, channels_last, non_contiguous, poison_

cv = importlib.import_module("sd_kernels.ops.conv")
conv2d = cv.conv2d

FACTOR = 4  # allowed error / stock error (fp32 on the GPU: both at TF32, cuDNN's default)


@pytest.fixture(autouse=True)
def poisoned_output(monkeypatch):
    alloc = cv._alloc
    monkeypatch.setattr(cv, "_alloc", lambda *args: poison_(alloc(*args)))


def _inputs(N, C, H, W, K, R, dtype, device, bias=True):
    g = torch.Generator().manual_seed(N * 1000 + C * 10 + K)
    x = torch.randn(N, C, H, W, generator=g).to(device, dtype)
    w = (torch.randn(K, C, R, R, generator=g) / (R * C**0.5)).to(device, dtype)
    b = torch.randn(K, generator=g).to(device, dtype) if bias else None
    return x, w, b


def _check(ours, x, w, b, stride, padding):
    ref64 = reference.conv2d(*reference.upcast(x, w, b), stride=stride, padding=padding)
    stock = reference.conv2d(x, w, b, stride=stride, padding=padding)
    return assert_close_to_reference(ours, stock, ref64, factor=FACTOR)


# (N, C, H, W, K, R, stride, padding): 3×3 as the ResNet blocks, 3×3 stride 2 as the downsamplers
# (odd and even maps), 1×1 as the shortcuts and attention projections; C and K not multiples of the
# 16-wide tiles, M = N·P·Q not a multiple of 16.
CASES = [
    (2, 20, 5, 7, 24, 3, 1, 1),
    (1, 16, 6, 6, 16, 3, 1, 1),
    (2, 24, 7, 5, 8, 3, 2, 1),
    (1, 32, 8, 8, 40, 3, 2, 1),
    (2, 36, 5, 6, 20, 1, 1, 0),
    (1, 8, 4, 4, 12, 3, 1, 0),  # no padding: a smaller output
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("case", CASES)
def test_conv2d(case, layout, dtype, device):
    N, C, H, W, K, R, stride, padding = case
    x, w, b = _inputs(N, C, H, W, K, R, dtype, device)
    if layout == "channels_last":
        x, w = channels_last(x), channels_last(w)
    ours = conv2d(x, w, b, stride=stride, padding=padding)
    _check(ours, x, w, b, stride, padding)
    # channels_last in, channels_last out (as cuDNN); NCHW in, NCHW out
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    assert ours.is_contiguous(memory_format=fmt)


@pytest.mark.parametrize("split", [2, 3])
@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[4]])
def test_split_depth(case, split, device, monkeypatch):
    """The depth split for small maps (fp32 partials, summed after): slices of unequal length (3),
    1×1 and stride 2, the bias added once."""
    monkeypatch.setattr(cv, "_split_k", lambda *args: split)
    N, C, H, W, K, R, stride, padding = case
    x, w, b = _inputs(N, C, H, W, K, R, torch.float16, device)
    x, w = channels_last(x), channels_last(w)
    y = conv2d(x, w, b, stride=stride, padding=padding)
    assert y.is_contiguous(memory_format=torch.channels_last)
    _check(y, x, w, b, stride, padding)


def test_split_choice(monkeypatch):
    """Slices doubled until the 128×128 tiles times slices fill half the SMs, ≥ 4 depth steps each."""
    monkeypatch.setattr(cv, "_multiprocessors", lambda device: 132)
    pick = lambda M, K, steps: cv._split_k(M, K, steps, torch.device("cuda"))  # noqa: E731
    assert pick(128, 1280, 9 * 20) == 8  # 8² map at batch 2, 3×3 1280 → 1280: 10 tiles → 80 programs
    assert pick(512, 1280, 9 * 20) == 2  # 16²: 40 tiles → 80
    assert pick(8192, 320, 9 * 5) == 1  # 64²: 192 tiles fill the GPU
    assert pick(128, 128, 8) == 2  # a shallow depth: 4 steps per slice at least
    assert pick(128, 128, 36) == 4  # 8 slices of cdiv(36, 8) = 5 steps would leave the last one 1
    assert pick(1, 1, 33) == 4  # 8 slices of 5 would leave the last none
    assert pick(128, 1280, 1000) == 8 and pick(1, 1, 1000) == 16  # at most 16


@pytest.mark.parametrize("bias", [True, False])
def test_strided_input_and_mixed_layouts(bias, device):
    """A view that is neither NCHW nor NHWC dense, with an NCHW weight for an NHWC-ish input: the
    kernel reads every operand through its own strides."""
    x, w, b = _inputs(2, 20, 6, 5, 24, 3, torch.float32, device, bias=bias)
    xs = non_contiguous(x)
    ours = conv2d(xs, channels_last(w), b, stride=1, padding=1)
    _check(ours, xs, w, b, 1, 1)


def test_zero_padding_is_zeros_not_neighbours(device):
    """Every output pixel on the border reads padding: a constant input makes each border pixel's
    sum count exactly the taps inside the image."""
    x = torch.ones(1, 16, 4, 4, device=device)
    w = torch.ones(16, 16, 3, 3, device=device)
    y = conv2d(x, w, None, stride=1, padding=1)
    inside = torch.nn.functional.conv2d(torch.ones(1, 1, 4, 4), torch.ones(1, 1, 3, 3), padding=1)[0, 0]
    torch.testing.assert_close(y[0, 0].cpu(), 16 * inside)


@pytest.mark.parametrize("args, error, match", [
    (((2, 4, 5, 5), (8, 3, 3, 3)), ValueError, "expects 3 input channels"),
    (((2, 4, 5), (8, 4, 3, 3)), ValueError, "4-D"),
    (((2, 4, 1, 1), (8, 4, 3, 3)), ValueError, "smaller than the kernel"),
])
def test_bad_shapes_are_clear_errors(args, error, match, device):
    xs, ws = args
    with pytest.raises(error, match=match):
        conv2d(torch.randn(xs, device=device), torch.randn(ws, device=device))


def test_bad_arguments_are_clear_errors(device):
    x, w, b = _inputs(1, 4, 5, 5, 8, 3, torch.float32, device)
    with pytest.raises(ValueError, match="bias must have shape"):
        conv2d(x, w, b[:4])
    with pytest.raises(TypeError, match="stride must be an int"):
        conv2d(x, w, b, stride=True)
    with pytest.raises(ValueError, match="stride"):
        conv2d(x, w, b, stride=0)


def test_what_the_kernel_does_not_take_runs_the_reference(device):
    """Different strides per axis and float64 are off the kernel's ground: the reference runs,
    logged, and gives F.conv2d's result; mixed dtypes get F.conv2d's own error."""
    dispatch.reset_fallbacks()
    x, w, b = _inputs(1, 16, 6, 6, 8, 3, torch.float32, device)
    y = conv2d(x, w, b, stride=(1, 2), padding=1)
    torch.testing.assert_close(y, reference.conv2d(x, w, b, stride=(1, 2), padding=1))
    y = conv2d(x.double(), w.double(), None, padding=1)
    torch.testing.assert_close(y, reference.conv2d(x.double(), w.double(), None, padding=1))
    reasons = [reason for (op, reason) in dispatch.fallbacks() if op == "conv2d"]
    assert any("same value on both axes" in r for r in reasons) and any("float64" in r for r in reasons)
    with pytest.raises(RuntimeError) as stock:
        reference.conv2d(x, w.half(), None, padding=1)
    with pytest.raises(RuntimeError, match=str(stock.value).splitlines()[0]):
        conv2d(x, w.half(), None, padding=1)


# ---------------------------------------------------------------------------------------------
# GPU: SD1.5's conv shapes (the UNet at batch 2, the VAE decoder at batch 1), compiled and tuned


SD_SHAPES = [  # (N, C, H, W, K, R, stride, padding)
    (2, 320, 64, 64, 320, 3, 1, 1), (2, 640, 32, 32, 640, 3, 1, 1), (2, 1280, 16, 16, 1280, 3, 1, 1),
    (2, 1280, 8, 8, 1280, 3, 1, 1), (2, 320, 64, 64, 320, 3, 2, 1), (2, 960, 64, 64, 320, 1, 1, 0),
    (2, 2560, 16, 16, 1280, 1, 1, 0), (1, 512, 128, 128, 512, 3, 1, 1), (1, 256, 256, 256, 256, 3, 1, 1),
    (1, 128, 512, 512, 128, 3, 1, 1),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", SD_SHAPES)
def test_gpu_sd_shapes(case, dtype):
    N, C, H, W, K, R, stride, padding = case
    x, w, b = _inputs(N, C, H, W, K, R, dtype, "cuda")
    x, w = channels_last(x), channels_last(w)
    _check(conv2d(x, w, b, stride=stride, padding=padding), x, w, b, stride, padding)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_gpu_other_layouts_and_fp32(layout):
    x, w, b = _inputs(2, 320, 32, 32, 320, 3, torch.float32, "cuda")
    x = non_contiguous(x) if layout == "strided" else x
    _check(conv2d(x, w, b, stride=1, padding=1), x, w, b, 1, 1)
