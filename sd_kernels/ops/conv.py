"""Implicit-GEMM 2-D convolution (measured against cuDNN before anything is fused into it).

``conv2d(x, weight, bias, stride, padding)`` computes ``F.conv2d`` (groups 1, dilation 1, zero
padding) as one matrix product that is never written out: the rows are the output pixels
(M = N·P·Q), the columns the output channels (K), the depth the filter taps times the input channels
(R·S·C). A program owns a [BLOCK_M pixels, BLOCK_N channels] tile of the output and walks the depth
in BLOCK_K-channel steps of one tap at a time: for tap (r, s) its A tile holds, for each of its
pixels (n, p, q), the BLOCK_K channels of x at (n, p·stride + r − pad, q·stride + s − pad) — zeros
where that falls in the padding — and its B tile the same channels of w[k, :, r, s] for its K columns.
Channels-last x makes each A row one contiguous run of channels (16-byte vector loads); a
channels-last weight ([K, R, S, C] in memory) does the same for B. Other layouts run through the
same strides, slower. fp32 accumulation; the bias is added in the epilogue, which is where a fused
ResNet block would fold GroupNorm statistics, the time embedding and the residual.

Why it exists: a fused ResNet block (GroupNorm applied as the conv loads its input, statistics of
the next GroupNorm gathered as it stores its output) needs a convolution whose loads and stores we
write. It is only worth fusing if the convolution alone comes near cuDNN's; ``bench/ops_conv.py``
measures that at every conv shape of the SD1.5 UNet and VAE. Nothing patches it in.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from sd_kernels import reference
from sd_kernels.ops.attention_common import _aligned, alignment
from sd_kernels.ops.layout import vectors
from sd_kernels.runtime.dispatch import interpreting, tensor_reason, use_kernel
from sd_kernels.runtime.launch import Launcher, cdiv


def _config(m: int, n: int, k: int, warps: int, stages: int, group: int = 8) -> triton.Config:
    return triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": group},
                         num_warps=warps, num_stages=stages)


# Tiles in the range Triton's Hopper matmuls use (wgmma needs BLOCK_M a multiple of 64 per warpgroup);
# BLOCK_K 64 divides every SD channel count (320…2560, 128…512): no masked channel lanes there.
_HALF_CONFIGS = [_config(128, 128, 64, 8, 3), _config(128, 256, 64, 8, 3), _config(64, 128, 64, 4, 4),
                 _config(128, 64, 64, 4, 4), _config(256, 128, 64, 8, 3), _config(128, 128, 32, 4, 4),
                 # small tiles for the deep 16² and 8² maps (M = 512 and 128 at batch 2), and a
                 # deeper BLOCK_K for the 1×1 convs (fewer, longer steps)
                 _config(64, 64, 64, 4, 4), _config(64, 64, 128, 4, 3), _config(128, 64, 128, 4, 3),
                 _config(128, 128, 128, 8, 3)]
_FP32_CONFIGS = [_config(64, 64, 32, 4, 3), _config(128, 64, 32, 8, 3)]


def _prune(configs, named_args, **kwargs):
    fp32 = named_args["X"].dtype == torch.float32
    wanted = _FP32_CONFIGS if fp32 else _HALF_CONFIGS
    return [c for c in configs if any(c is w for w in wanted)]


def _autotune():
    key = ["M", "K", "C", "R", "S", "STRIDE", "SPLIT"]
    if interpreting():  # the interpreter would run every config; one small tile covers the logic
        return triton.autotune([_config(16, 16, 16, 4, 1, 2)], key=key)
    return triton.autotune(_HALF_CONFIGS + _FP32_CONFIGS, key=key, prune_configs_by={"early_config_prune": _prune})


@_autotune()
@triton.jit
def _conv_kernel(
    X, Wt, B, Y, M, C, H, W, K, P, Q, PAD,
    stride_xn, stride_xc, stride_xh, stride_xw,
    stride_wk, stride_wc, stride_wr, stride_ws,
    stride_yn, stride_yk, stride_yp, stride_yq,
    stride_ys,
    R: tl.constexpr, S: tl.constexpr, STRIDE: tl.constexpr, HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr, ALIGN: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """One [BLOCK_M output pixels, BLOCK_N output channels] tile of y = conv(x, w) + b; with SPLIT > 1,
    program (tile, j) sums the j-th of SPLIT slices of the depth into the j-th fp32 partial of Y."""
    # Grouped order: GROUP_M row blocks share each column block's weights in L2.
    pid = tl.program_id(0)
    n_m, n_n = tl.cdiv(M, BLOCK_M), tl.cdiv(K, BLOCK_N)
    width = GROUP_M * n_n
    first_m = pid // width * GROUP_M
    rows = tl.minimum(n_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % rows
    pid_n = (pid % width) // rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < K
    pm = offs_m % M  # rows past M read a valid pixel (finite, in bounds); only the store is masked
    n_img = pm // (P * Q)
    p = (pm // Q) % P
    q = pm % Q
    h0 = p * STRIDE - PAD
    w0 = q * STRIDE - PAD
    stride_xh = _aligned(stride_xh, ALIGN)
    stride_xw = _aligned(stride_xw, ALIGN)
    stride_wk = _aligned(stride_wk, ALIGN)
    x_rows = X + n_img.to(tl.int64) * stride_xn  # [BLOCK_M] pointers to each pixel's image
    # [BLOCK_N] pointers to each output channel's filter; columns past K read a valid one (store masked)
    w_cols = Wt + (offs_n % K).to(tl.int64) * stride_wk

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    c_steps = tl.cdiv(C, BLOCK_K)
    steps = R * S * c_steps
    chunk = tl.cdiv(steps, SPLIT)
    first = tl.program_id(1) * chunk
    for t in range(first, tl.minimum(first + chunk, steps)):
        tap = t // c_steps
        c = (t - tap * c_steps) * BLOCK_K + offs_k
        r = tap // S
        s = tap - r * S
        h = h0 + r
        w = w0 + s
        inside = (h >= 0) & (h < H) & (w >= 0) & (w < W)
        c_ok = c < C
        a = tl.load(x_rows[:, None] + (h * stride_xh + w * stride_xw)[:, None] + c[None, :] * stride_xc,
                    mask=inside[:, None] & c_ok[None, :], other=0.0)
        b = tl.load(w_cols[None, :] + c[:, None] * stride_wc + r * stride_wr + s * stride_ws,
                    mask=c_ok[:, None], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)

    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y_rows = Y + tl.program_id(1) * stride_ys + n_img.to(tl.int64) * stride_yn + p * stride_yp + q * stride_yq
    tl.store(y_rows[:, None] + offs_n[None, :] * stride_yk, acc.to(Y.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


_CONV = Launcher(_conv_kernel)


def _pair(v, name: str) -> tuple[int, int]:
    if isinstance(v, bool) or not isinstance(v, (int, tuple, list)):
        raise TypeError(f"conv2d: {name} must be an int or a pair of ints, got {v!r}")
    pair = (v, v) if isinstance(v, int) else tuple(v)
    if len(pair) != 2 or not all(isinstance(i, int) and not isinstance(i, bool) for i in pair):
        raise TypeError(f"conv2d: {name} must be an int or a pair of ints, got {v!r}")
    return pair


def check_operands(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """A convolution's operands agree: x's channels are the weight's input channels, the bias is [K]
    (the checks every conv op here shares; the callers check dims and kernel sizes)."""
    if weight.shape[1] != x.shape[1]:
        raise ValueError(f"weight {tuple(weight.shape)} expects {weight.shape[1]} input channels, x has {x.shape[1]}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")


def _check(x: torch.Tensor, weight: torch.Tensor, bias, stride: tuple, padding: tuple) -> None:
    if x.dim() != 4 or weight.dim() != 4:
        raise ValueError(f"conv2d needs 4-D x [N, C, H, W] and weight [K, C, R, S], got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    check_operands(x, weight, bias)
    if min(stride) < 1 or min(padding) < 0:
        raise ValueError(f"conv2d: stride {stride} must be ≥ 1 and padding {padding} ≥ 0")
    for dim in (0, 1):
        if x.shape[2 + dim] + 2 * padding[dim] < weight.shape[2 + dim]:
            raise ValueError(f"conv2d: input {tuple(x.shape[2:])} padded by {padding} is smaller than the "
                             f"kernel {tuple(weight.shape[2:])}")


def _kernel_reason(x, weight, bias, stride, padding) -> str | None:
    reason = tensor_reason(x, weight, bias)
    if reason is None and len({t.dtype for t in (x, weight, bias) if t is not None}) > 1:
        reason = f"mixed dtypes {sorted({str(t.dtype) for t in (x, weight, bias) if t is not None})}"
    if reason is None and (stride[0] != stride[1] or padding[0] != padding[1]):
        reason = f"stride {stride} / padding {padding}: the kernel takes the same value on both axes"
    if reason is None and x.numel() == 0:
        reason = "empty input"
    return reason


def _alloc(shape, like: torch.Tensor, channels_last: bool) -> torch.Tensor:
    """Every output of this module comes from here (tests poison it to catch unwritten elements)."""
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    return torch.empty(shape, dtype=like.dtype, device=like.device, memory_format=fmt)


def conv2d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, stride=1,
           padding=0) -> torch.Tensor:
    """``F.conv2d(x, weight, bias, stride, padding)`` (groups 1, dilation 1, zero padding) as one
    implicit-GEMM Triton kernel. The output is channels_last when x is (as cuDNN's), else NCHW."""
    stride, padding = _pair(stride, "stride"), _pair(padding, "padding")
    _check(x, weight, bias, stride, padding)
    if not use_kernel("conv2d", x, weight, bias, unsupported=_kernel_reason(x, weight, bias, stride, padding)):
        return reference.conv2d(x, weight, bias, stride, padding)
    (bias,) = vectors(bias)
    N, C, H, W = x.shape
    K, _, R, S = weight.shape
    P = (H + 2 * padding[0] - R) // stride[0] + 1
    Q = (W + 2 * padding[1] - S) // stride[1] + 1
    channels_last = x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
    y = _alloc((N, K, P, Q), x, channels_last)
    M = N * P * Q
    precision = "ieee" if x.dtype == torch.float32 and not torch.backends.cudnn.allow_tf32 else "tf32"
    align = alignment(x.permute(0, 2, 3, 1), weight.permute(0, 2, 3, 1))  # the H, W, K strides it scales
    split = _split_k(M, K, R * S * cdiv(C, 64), x.device)  # depth steps at the common BLOCK_K
    # split depth: fp32 partials [SPLIT, N, P, Q, K], summed in a fixed order after (deterministic)
    out = y if split == 1 else torch.empty((split, N, P, Q, K), dtype=torch.float32, device=x.device)
    y_strides = y.stride() if split == 1 else (out.stride(1), out.stride(4), out.stride(2), out.stride(3))
    grid = lambda meta: (cdiv(M, meta["BLOCK_M"]) * cdiv(K, meta["BLOCK_N"]), split)
    has_bias = bias is not None and split == 1
    key = (M, K, C, R, S, stride[0], padding[0], x.dtype, precision, align, has_bias,
           channels_last, weight.is_contiguous(), split)
    _CONV(
        key, grid, x, weight, bias if has_bias else x, out, M, C, H, W, K, P, Q, padding[0],
        *x.stride(), *weight.stride(), *y_strides, out.stride(0) if split > 1 else 0,
        R=R, S=S, STRIDE=stride[0], HAS_BIAS=has_bias, PRECISION=precision, ALIGN=align, SPLIT=split,
    )
    if split > 1:
        total = out.sum(0)
        if bias is not None:
            total += bias.float()
        y.copy_(total.permute(0, 3, 1, 2))
    return y


def _split_k(M: int, K: int, steps: int, device: torch.device) -> int:
    """How many slices the depth is split into: doubled while the output tiles (counted at 128×128,
    the largest common tile) times the slices fill less than half the GPU's SMs, keeping at least 4
    depth steps (counted at BLOCK_K 64; a BLOCK_K 128 tile takes half as many) in every slice, at
    most 16. The SD UNet's 8² and 16² maps (M = 128, 512 at batch 2) leave most SMs idle otherwise."""
    sms = _multiprocessors(device)
    tiles, split = cdiv(M, 128) * cdiv(K, 128), 1
    while split < 16 and tiles * split < sms // 2 and _slices_fit(steps, split * 2):
        split *= 2
    return split


def _slices_fit(steps: int, split: int) -> bool:
    """The kernel gives each slice cdiv(steps, split) steps, the last one the rest: at least 4 each."""
    chunk = cdiv(steps, split)
    return chunk >= 4 and steps - (split - 1) * chunk >= 4


def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":  # the interpreter: no split unless a test asks for one
        return 0
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
