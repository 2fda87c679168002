"""3×3 convolutions on FP8 tensor cores: the FP8 tier's UNet ResNet convolutions (patches/fp8_conv.py).

``conv3x3_fp8(x, w_q, s_w, bias)`` is ``F.conv2d(x, W, bias, padding=1)`` (stride 1, dilation 1, one group) as
one implicit GEMM: M = N·H·W output pixels, N = C_out channels, K = 9·C_in, ordered (kh, kw, c). A program
owns a [BLOCK_M, BLOCK_N] tile of the output; its K loop walks the nine taps and, in each, C_in in BLOCK_K
steps, loading the input pixels the tap shifts its rows to (zeros past the image's edges: the padding) and
the weight's [BLOCK_K, BLOCK_N] slice, and accumulates e4m3 × e4m3 products in fp32 (``tl.dot``: wgmma on
Hopper). The input is read as NHWC codes, so a tap's rows are C_in contiguous bytes each.

Scales. The weight is quantized once (``quantize_conv_weight``: e4m3 with one scale an output channel, laid
out [C_out, 9·C_in]); the input at every call with one scale a sample (``quantize_samples``): the sample's
max |x| over all its pixels and channels maps to 448. One a sample rather than one a pixel: an output
pixel's K runs over nine source pixels, so a scale a pixel would have to be applied tap by tap inside the K
loop, while a sample's comes out of the sum and is applied once in the epilogue with the weight's (tiles
never straddle two samples' scales: the epilogue reads each row's). E4M3 is a floating-point format (3
mantissa bits over 18 binades), so a scale set by the sample's largest value keeps every smaller value's
relative precision down to about 2⁻¹⁵ of the maximum (448 maps to it; 2⁻⁶ is the smallest normal code), then
the subnormals'.

The quantization is two kernels: each program finds the max |x| of a block of one sample's pixels
(``_sample_amax_kernel``), then each program reduces its sample's partial maxima and writes its block's codes
(``_sample_quantize_kernel``): x read twice, the codes written once, no atomics (the same bits every run).
Non-finite inputs: a NaN or an infinity makes its sample's scale non-finite, so the whole sample's output is NaN
(torch's convolution spreads it only as far as the kernel reaches).

Numerics against the exact convolution: the codes' rounding (2⁻⁴ relative at most, each) makes a relative
error of about 3% of the output (H200, SDXL's shapes, 2026-11-30: docs/kernels/fp8_conv.md), the FP8 tier's
GEMMs' order. The tile shape is ``blocks``' rule, measured at SDXL's shapes (not autotuned).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from sd_kernels import reference
from sd_kernels.ops.fp8_quant import E4M3, fp8_reason, row_amax, row_quantize
from sd_kernels.runtime.dispatch import interpreting, use_kernel
from sd_kernels.runtime.launch import Launcher, cdiv, next_pow2

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_PARTIALS = 1024  # at most this many partial maxima a sample: a quantize program reduces them all
_MIN_PIXELS = 32  # pixels a quantization program at least


@triton.jit
def _tile(x_ptr, n, pix, c, HW, W, C, stride_n, stride_h, stride_w, stride_c):
    """x[n, c, pix // W, pix % W] for a [PIX] vector of pixels and a [BLOCK_C] one of channels, as fp32 (0 outside)."""
    mask = (pix < HW)[:, None] & (c < C)[None, :]
    ptrs = (x_ptr + n * stride_n + ((pix // W) * stride_h + (pix % W) * stride_w)[:, None]
            + c[None, :].to(tl.int64) * stride_c)
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32), mask


@triton.jit
def _sample_amax_kernel(x_ptr, part_ptr, HW, W, C, P, stride_n, stride_h, stride_w, stride_c,
                        PIX: tl.constexpr, BLOCK_C: tl.constexpr, GRID: tl.constexpr):
    """part[n, p] = max |x| over sample n's pixels [p·PIX, (p + 1)·PIX) and all channels (NaN if one is)."""
    p, n = tl.program_id(0), tl.program_id(1).to(tl.int64)
    pix = (p * PIX + tl.arange(0, PIX)).to(tl.int64)
    amax = tl.zeros([PIX], dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        v, mask = _tile(x_ptr, n, pix, c0 + tl.arange(0, BLOCK_C), HW, W, C, stride_n, stride_h, stride_w, stride_c)
        amax = tl.maximum(amax, row_amax(v, mask, GRID), propagate_nan=tl.PropagateNan.ALL)
    total = row_amax(amax[None, :], (pix < HW)[None, :], GRID)
    tl.store(part_ptr + n * P + p + tl.arange(0, 1), total)


@triton.jit
def _sample_quantize_kernel(x_ptr, part_ptr, q_ptr, s_ptr, HW, W, C, P, stride_n, stride_h, stride_w, stride_c,
                            PIX: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr, GRID: tl.constexpr):
    """Codes of sample n's pixels [p·PIX, (p + 1)·PIX), q [N, H·W, C] (NHWC) = e4m3(x · 448 / amax), amax the
    max of the sample's P partials; s[n] = amax / 448."""
    p, n = tl.program_id(0), tl.program_id(1).to(tl.int64)
    parts = tl.arange(0, BLOCK_P)
    part = tl.load(part_ptr + n * P + parts, mask=parts < P, other=0.0)
    amax = row_amax(part[None, :], (parts < P)[None, :], GRID)  # [1]
    pix = (p * PIX + tl.arange(0, PIX)).to(tl.int64)
    rows = tl.zeros([PIX], dtype=tl.float32) + amax  # the sample's maximum for every pixel (row)
    for c0 in range(0, C, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        v, mask = _tile(x_ptr, n, pix, c, HW, W, C, stride_n, stride_h, stride_w, stride_c)
        q_ptrs = q_ptr + (n * HW + pix)[:, None] * C + c[None, :]
        # every row's scale is the sample's: pixel 0's row stores it, no other row stores anything there
        row_quantize(v, rows, q_ptrs, s_ptr + n + 0 * pix, mask, pix == 0, GRID)


@triton.jit
def _conv3x3_fp8_kernel(x_ptr, w_ptr, sx_ptr, sw_ptr, b_ptr, y_ptr, NB, H, W, C, CO,
                        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        GROUP_M: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] tile of y [N·H·W, C_out] (NHWC) from x's codes [N·H·W, C] (NHWC), the weight's
    [C_out, 9·C] and their scales [N], [C_out]; C a multiple of BLOCK_K (a step never straddles two taps)."""
    M = NB * H * W
    pid = tl.program_id(0)
    grid_n = tl.cdiv(CO, BLOCK_N)
    width = GROUP_M * grid_n  # GROUP_M row tiles share their weight columns in L2
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(tl.cdiv(M, BLOCK_M) - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n, h, w = offs_m // (H * W), (offs_m % (H * W)) // W, offs_m % W
    in_m = offs_m < M
    cols = (offs_n % CO).to(tl.int64)  # edge tiles wrap; only the store is masked
    k_total = 9 * C
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, k_total, BLOCK_K):
        tap = k // C
        hs, ws = h + tap // 3 - 1, w + tap % 3 - 1
        inside = in_m & (hs >= 0) & (hs < H) & (ws >= 0) & (ws < W)
        src = ((n * H + hs) * W + ws).to(tl.int64)
        a = tl.load(x_ptr + src[:, None] * C + (k - tap * C + offs_k)[None, :], mask=inside[:, None], other=0.0)
        b = tl.load(w_ptr + cols[None, :] * k_total + (k + offs_k)[:, None])  # [BLOCK_K, BLOCK_N] of the weightᵀ
        acc = tl.dot(a, b, acc)
    y = acc * tl.load(sx_ptr + n, mask=in_m, other=0.0)[:, None] * tl.load(sw_ptr + cols)[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + cols).to(tl.float32)[None, :]
    out = y_ptr + offs_m[:, None].to(tl.int64) * CO + offs_n[None, :]
    tl.store(out, y.to(y_ptr.dtype.element_ty), mask=in_m[:, None] & (offs_n < CO)[None, :])


# Not autotuned: the Launchers are here for their direct launch path, keyed by the blocks (``blocks``).
_AMAX = Launcher(_sample_amax_kernel)
_QUANTIZE = Launcher(_sample_quantize_kernel)
_CONV = Launcher(_conv3x3_fp8_kernel)


def blocks(c: int, co: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for C → C_out channels: BLOCK_K 128 where it divides C,
    else 64 or 32; 256 output channels a tile from 1,280 on, else 128. Of eight tiles timed at eight SDXL ResNet
    shapes, the fastest at seven; at 640 → 640 at 64² 2% behind the fastest (H200, 2026-11-30:
    docs/kernels/fp8_conv.md). Under the interpreter, small tiles."""
    if interpreting():
        return 32, 32, 64 if c % 64 == 0 else 32, 4, 1
    wide_k = c % 128 == 0
    return (128, 256 if co >= 1280 else 128, 128 if wide_k else 64 if c % 64 == 0 else 32, 8 if wide_k else 4,
            3 if wide_k else 4)


def conv_reason(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why ``conv3x3_fp8`` cannot take input x [N, C, H, W] for a weight [C_out, C, 3, 3] (or its codes
    [C_out, 9·C]), or None."""
    if x.dim() != 4 or x.dtype not in DTYPES:
        return f"input {x.dim()}-D {x.dtype} (a 4-D fp16, bf16 or fp32 one is served)"
    if x.shape[1] % 32:
        return f"{x.shape[1]} input channels, not a multiple of 32"
    if weight.dim() == 2 and weight.shape[1] != 9 * x.shape[1]:
        return f"weight codes {tuple(weight.shape)} for {x.shape[1]} input channels"
    if x.numel() >= 2**31 or x.shape[0] * x.shape[2] * x.shape[3] * weight.shape[0] >= 2**31:
        return "2^31 elements or more"
    return fp8_reason(x)


def quantize_conv_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A 3×3 conv's weight [C_out, C, 3, 3] as (e4m3 codes [C_out, 9·C] in (kh, kw, c) order, one fp32 scale an
    output channel [C_out]): ``reference.fp8_quantize_rows`` of its rows, once at patch time (torch ops)."""
    if weight.dim() != 4 or tuple(weight.shape[2:]) != (3, 3):
        raise ValueError(f"quantize_conv_weight needs a [C_out, C, 3, 3] weight, got {tuple(weight.shape)}")
    q, s = reference.fp8_quantize_rows(weight.detach().permute(0, 2, 3, 1).reshape(weight.shape[0], -1))
    return q.contiguous(), s.contiguous()


def reference_quantize_samples(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_samples`` in torch ops: (codes [N, H, W, C] e4m3, scales [N] fp32)."""
    q, s = reference.fp8_quantize_rows(x.permute(0, 2, 3, 1).reshape(x.shape[0], -1))
    return q.reshape(x.shape[0], x.shape[2], x.shape[3], x.shape[1]), s


def quantize_samples(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, C, H, W] (any strides) as (e4m3 codes [N, H, W, C] contiguous, one fp32 scale a sample [N]):
    e4m3(x · 448 / max|x over the sample|), the scale max / 448 (a zero sample: codes and scale 0)."""
    if not use_kernel("fp8_conv", x, unsupported=fp8_reason(x)):
        return reference_quantize_samples(x)
    return _quantize_samples(x)


def _quantize_samples(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_samples`` on the kernels (the dispatch already asked)."""
    nb, c, h, w = x.shape
    hw = h * w
    pix = max(_MIN_PIXELS, next_pow2(cdiv(hw, _PARTIALS)))
    parts, block_c = cdiv(hw, pix), min(next_pow2(c), max(16, 4096 // pix))
    part = torch.empty((nb, parts), device=x.device, dtype=torch.float32)
    q = torch.empty((nb, h, w, c), device=x.device, dtype=E4M3)
    s = torch.zeros(nb, device=x.device, dtype=torch.float32)
    if x.numel() == 0:
        return q, s
    grid, strides = interpreting(), (x.stride(0), x.stride(2), x.stride(3), x.stride(1))
    _AMAX((pix, block_c, grid), (parts, nb), x, part, hw, w, c, parts, *strides, PIX=pix, BLOCK_C=block_c,
          GRID=grid, num_warps=4)
    _QUANTIZE((pix, block_c, next_pow2(parts), grid), (parts, nb), x, part, q, s, hw, w, c, parts, *strides,
              PIX=pix, BLOCK_C=block_c, BLOCK_P=next_pow2(parts), GRID=grid, num_warps=4)
    return q, s


def reference_conv3x3_fp8(x: torch.Tensor, w_q: torch.Tensor, s_w: torch.Tensor,
                          bias: torch.Tensor | None = None, compute: torch.dtype = torch.float32) -> torch.Tensor:
    """What ``conv3x3_fp8`` computes, in torch ops: x quantized a sample (``reference_quantize_samples``), the
    codes times their scales convolved in ``compute``, + bias, in x's dtype, channels_last."""
    q, s = reference_quantize_samples(x)
    xs = (q.to(compute) * s.to(compute)[:, None, None, None]).permute(0, 3, 1, 2)
    co, c = w_q.shape[0], x.shape[1]
    wt = (w_q.to(compute) * s_w.to(compute)[:, None]).reshape(co, 3, 3, c).permute(0, 3, 1, 2)
    y = F.conv2d(xs, wt, None if bias is None else bias.to(compute), padding=1)
    return y.to(x.dtype).contiguous(memory_format=torch.channels_last)


def conv3x3_fp8(x: torch.Tensor, w_q: torch.Tensor, s_w: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.conv2d(x, W, bias, padding=1)`` for a 3×3 weight W given as ``quantize_conv_weight``'s codes w_q
    [C_out, 9·C] and scales s_w [C_out], x [N, C, H, W] fp16, bf16 or fp32 (any strides; NHWC reads best) quantized
    a sample at the call (``quantize_samples``); the output [N, C_out, H, W] in x's dtype, channels_last."""
    if x.dim() != 4:
        raise ValueError(f"conv3x3_fp8: input {x.dim()}-D, not [N, C, H, W]")
    if w_q.dim() != 2 or w_q.shape[1] != 9 * x.shape[1]:
        raise ValueError(f"conv3x3_fp8: weight codes {tuple(w_q.shape)} for {x.shape[1]} input channels")
    if bias is not None and tuple(bias.shape) != (w_q.shape[0],):
        raise ValueError(f"conv3x3_fp8: bias must have shape ({w_q.shape[0]},), got {tuple(bias.shape)}")
    if not use_kernel("fp8_conv", x, w_q, s_w, bias, unsupported=conv_reason(x, w_q)):
        return reference_conv3x3_fp8(x, w_q, s_w, bias)
    nb, c, h, w = x.shape
    co = w_q.shape[0]
    w_q, s_w = w_q.contiguous(), s_w.contiguous()  # the kernel reads them densely (quantize_conv_weight's are)
    bias = None if bias is None else bias.contiguous()
    x_q, s_x = _quantize_samples(x)
    y = torch.empty((nb, h, w, co), device=x.device, dtype=x.dtype)
    if y.numel():
        bm, bn, bk, warps, stages = blocks(c, co)
        _CONV((bias is not None, bm, bn, bk, warps, stages), (cdiv(nb * h * w, bm) * cdiv(co, bn),),
              x_q, w_q, s_x, s_w, y if bias is None else bias, y, nb, h, w, c, co, HAS_BIAS=bias is not None,
              BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages)
    return y.permute(0, 3, 1, 2)
