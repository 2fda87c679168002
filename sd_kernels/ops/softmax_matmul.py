"""The paper's partially fused softmax: Y = softmax(X)·W without writing softmax(X).

For X [..., a, b] and W [..., b, c], Y = softmax(X, -1)·W takes two kernels:

1. ``_row_stats_kernel`` reads X once and keeps, per row, the running max m and the sum s of
   exp(x − m) (the paper's passes 1 and 2, merged into one read by rescaling s whenever m grows). It
   writes two a-vectors in fp32: m·log2(e) and 1/s.
2. ``_softmax_matmul_kernel`` is a matmul that turns each [BLOCK_M, BLOCK_K] tile of X into
   exp(x − m) as it loads it (one FMA and one exp2 per element) and multiplies it with W's tile on the
   tensor cores; the 1/s scaling is applied once to the fp32 accumulator at the end.

The a×b tensor T = softmax(X) never exists; the extra memory is the two row vectors. Rows of X up
to ``ONE_TILE_MAX_K`` long (SD's cross-attention: 77 keys) take one kernel instead,
``_softmax_matmul_one_tile_kernel``: the whole row is one tile, so its max and sum come from
registers and X is read once.

``partial_softmax_attention`` builds attention on it: X = q·kᵀ·scale (+ mask) is written by cuBLAS
(``baddbmm``, the paper's design), then the kernels above with W = v. X takes B·H·Sq·Sk elements
in q's dtype, fp32 for fp16 inputs (fp16 scores overflow where SDPA's fp32 ones do not), or
``scores_dtype``; rows padded to 16 bytes for vector loads;
``max_chunk_bytes`` bounds it by running the query rows in chunks that reuse one X buffer. Because
nothing is kept on chip per query row but the accumulator's [BLOCK_M, BLOCK_N] tile of Y, any head
dim works (the VAE's d = 512), which FlashAttention's [BLOCK_M, D] accumulator cannot hold.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sd_kernels import reference
from sd_kernels.runtime.dispatch import KERNEL_DTYPES, interpreting, use_kernel
from sd_kernels.runtime.launch import Launcher, cdiv, next_pow2

from . import attention_common as _common
from .attention_common import (
    LOG2E,
    _aligned,
    alignment,
    as_4d,
    check_attention_args,
    default_scale,
    dot_precision,
    from_4d,
    kernel_reason,
)

_LOG2E = tl.constexpr(LOG2E)
_STATS_ELEMS = 8192  # elements of X per stats program and step: 16 KiB of fp16 in flight
# Rows of X up to this long (SD's cross-attention: 77 keys) take one fused kernel: the row stats from
# the tile in registers, X read once. Longer rows take the stats kernel, then the fused matmul.
ONE_TILE_MAX_K = 128


# A masks rows (X's strided axis) and, with stride_s, places a row's two stats: no vector access depends on them.
@triton.jit(do_not_specialize=["A", "stride_s"])
def _row_stats_kernel(
    X, Stats, H, A, Bk, stride_xb, stride_xh, stride_xa, stride_xk, stride_s,
    ZERO_EMPTY: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Stats[0, row] = max(x)·log2(e) and Stats[1, row] = 1/Σ exp(x − max) for BLOCK_R rows of X.

    Rows whose every x is -inf: with ZERO_EMPTY, (0, 0), so that kernel 2 gives zeros (attention's
    fully masked rows); else (-inf, inf), so that it gives NaN as torch.softmax does.
    """
    pid = tl.program_id(0)
    num_r = tl.cdiv(A, BLOCK_R)
    bh = pid // num_r
    rows = (pid % num_r) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_C)
    X += (bh // H).to(tl.int64) * stride_xb + (bh % H).to(tl.int64) * stride_xh
    row_ok = rows < A
    m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    s = tl.zeros([BLOCK_R], dtype=tl.float32)
    for start in range(0, Bk, BLOCK_C):
        ptrs = X + rows[:, None] * stride_xa + (start + cols)[None, :] * stride_xk
        ok = row_ok[:, None] & ((start + cols)[None, :] < Bk)
        x = tl.load(ptrs, mask=ok, other=float("-inf")).to(tl.float32) * _LOG2E
        m_new = tl.maximum(m, tl.max(x, 1))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)  # all -inf so far: no -inf − -inf
        s = s * tl.math.exp2(m - m_sub) + tl.sum(tl.math.exp2(x - m_sub[:, None]), 1)
        m = m_new
    if ZERO_EMPTY:
        inv_s = 1.0 / tl.where(s == 0.0, float("inf"), s)
        m = tl.where(m == float("-inf"), 0.0, m)
    else:  # (rows past A are never stored: keep them off the division)
        inv_s = 1.0 / tl.where(row_ok, s, 1.0)
    out = bh.to(tl.int64) * A + rows
    tl.store(Stats + out, m, mask=row_ok)
    tl.store(Stats + stride_s + out, inv_s, mask=row_ok)


@triton.jit
def _exp_dot(acc, x_ptrs, w_ptrs, m2, offs_k, k_left, PRECISION: tl.constexpr, TAIL: tl.constexpr):
    """acc + exp(x − m)·w for one K block; ``TAIL``: only the first ``k_left`` of its columns exist
    (the rest read as x = -inf, w = 0, so they add exactly 0)."""
    if TAIL:
        x = tl.load(x_ptrs, mask=offs_k[None, :] < k_left, other=float("-inf"))
        w = tl.load(w_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
    else:
        x = tl.load(x_ptrs)
        w = tl.load(w_ptrs)
    p = tl.math.exp2(x.to(tl.float32) * _LOG2E - m2[:, None])  # exp(x − m) ∈ [0, 1]
    return tl.dot(p.to(w.dtype), w, acc, input_precision=PRECISION)


@triton.jit
def _program_tile(H, A, C, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's (b·H + h, b, h, rows, columns) of Y: a 1-D grid, column blocks fastest, so the
    programs that read the same rows of X run side by side and share them in L2."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(C, BLOCK_N)
    num_m = tl.cdiv(A, BLOCK_M)
    bh = pid // (num_m * num_n)
    offs_m = (pid // num_n) % num_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid % num_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return bh, (bh // H).to(tl.int64), (bh % H).to(tl.int64), offs_m, offs_n


@triton.jit
def _store_y(Y, y, offs_m, offs_n, A, C, stride_ya, stride_yc):
    y_ptrs = Y + offs_m[:, None] * stride_ya + offs_n[None, :] * stride_yc
    tl.store(y_ptrs, y.to(Y.dtype.element_ty), mask=(offs_m[:, None] < A) & (offs_n[None, :] < C))


def _config(m: int, n: int, k: int, warps: int, stages: int) -> triton.Config:
    return triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k}, num_warps=warps, num_stages=stages)


# BLOCK_N spans W's columns (c = the head dim in attention): the exp of an X tile is recomputed for
# every column block, so wide column tiles (256 for the VAE's c = 512) halve that work; narrow ones
# serve small c. All compile for sm_90 to pipelined (cp.async) wgmma loops without spills (checked
# offline with triton.compile and cuobjdump; 128×256 tiles spill). fp32 dots (IEEE) need small tiles.
_HALF_CONFIGS = [_config(128, 128, 32, 8, 3), _config(128, 128, 64, 8, 3), _config(64, 256, 32, 8, 3),
                 _config(128, 64, 32, 4, 4), _config(64, 128, 32, 4, 3), _config(64, 64, 32, 4, 4)]
_FP32_CONFIGS = [_config(32, 32, 32, 4, 1), _config(64, 32, 32, 4, 2)]


def _prune_configs(configs, named_args, **kwargs):
    fp32 = named_args["W"].dtype == torch.float32 or named_args["X"].dtype == torch.float32
    wanted = _FP32_CONFIGS if fp32 else _HALF_CONFIGS
    # No column tile wider than W (beyond the 16-wide minimum of a dot); keep the narrowest otherwise.
    fit = [c for c in wanted if c.kwargs["BLOCK_N"] <= max(16, named_args["C_KEY"])]
    fit = fit or [min(wanted, key=lambda c: c.kwargs["BLOCK_N"])]
    chosen = [c for c in configs if any(c is w for w in fit)]
    return chosen if _common.AUTOTUNE else chosen[:1]


def _autotune():
    key = ["A_KEY", "K_KEY", "C_KEY"]
    if interpreting():
        return triton.autotune([_config(32, 32, 32, 4, 1)], key=key)
    return triton.autotune(_HALF_CONFIGS + _FP32_CONFIGS, key=key,
                           prune_configs_by={"early_config_prune": _prune_configs})


# stride_s only offsets a gather of the row stats (rows wrap modulo A): its divisibility buys nothing.
@_autotune()
@triton.jit(do_not_specialize=["A", "Kd", "stride_s"])
def _softmax_matmul_kernel(
    X, W, Stats, Y, H, A, Kd, C, A_KEY, K_KEY, C_KEY, stride_s,
    stride_xb, stride_xh, stride_xa, stride_xk,
    stride_wb, stride_wh, stride_wk, stride_wc,
    stride_yb, stride_yh, stride_ya, stride_yc,
    PRECISION: tl.constexpr, ALIGN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Y[b, h] tile = (exp(X − m)·W) / s for BLOCK_M rows of X and BLOCK_N columns of W.

    1-D grid, column blocks fastest: the programs that read the same rows of X run side by side and
    share them in L2; W of one (b, h) (Sk × c) is read by every row block and stays in L2 too.
    """
    bh, b, h, offs_m, offs_n = _program_tile(H, A, C, BLOCK_M, BLOCK_N)
    X += b * stride_xb + h * stride_xh
    W += b * _aligned(stride_wb, ALIGN) + h * _aligned(stride_wh, ALIGN)
    Y += b * stride_yb + h * stride_yh
    stride_wk = _aligned(stride_wk, ALIGN)

    offs_k = tl.arange(0, BLOCK_K)
    rows = offs_m % A  # edge tiles wrap (finite, in bounds); only the store is masked
    cols = offs_n % C
    stats = Stats + bh.to(tl.int64) * A + rows
    m2 = tl.load(stats)
    inv_s = tl.load(stats + stride_s)

    x_ptrs = X + rows[:, None] * stride_xa + offs_k[None, :] * stride_xk
    w_ptrs = W + offs_k[:, None] * stride_wk + cols[None, :] * stride_wc
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # Full K blocks unmasked (masked loads here would keep Triton from pipelining them), then the tail.
    for _ in range(0, Kd // BLOCK_K):
        acc = _exp_dot(acc, x_ptrs, w_ptrs, m2, offs_k, BLOCK_K, PRECISION, False)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    if Kd % BLOCK_K:
        acc = _exp_dot(acc, x_ptrs, w_ptrs, m2, offs_k, Kd % BLOCK_K, PRECISION, True)
    _store_y(Y, acc * inv_s[:, None], offs_m, offs_n, A, C, stride_ya, stride_yc)


def _one_tile_autotune():
    rows = [(64, 4), (128, 8)] if not interpreting() else [(32, 4)]
    configs = [triton.Config({"BLOCK_M": m}, num_warps=w, num_stages=1) for m, w in rows]
    return triton.autotune(configs, key=["A_KEY", "BLOCK_N", "BLOCK_K"], prune_configs_by={
        "early_config_prune": lambda cs, named_args, **kw: cs if _common.AUTOTUNE else cs[:1]})


@_one_tile_autotune()
@triton.jit(do_not_specialize=["A"])
def _softmax_matmul_one_tile_kernel(
    X, W, Y, H, A, Kd, C, A_KEY,
    stride_xb, stride_xh, stride_xa, stride_xk,
    stride_wb, stride_wh, stride_wk, stride_wc,
    stride_yb, stride_yh, stride_ya, stride_yc,
    ZERO_EMPTY: tl.constexpr, PRECISION: tl.constexpr, ALIGN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Y tile = softmax(X)·W when a whole row of X fits one BLOCK_K tile (b ≤ BLOCK_K): the row
    stats come from the tile in registers, so X is read once and there is one launch, not two.

    Rows of X that are all -inf: zeros with ZERO_EMPTY, else NaN (0 · 1/0), as the two-kernel path.
    """
    bh, b, h, offs_m, offs_n = _program_tile(H, A, C, BLOCK_M, BLOCK_N)
    X += b * stride_xb + h * stride_xh
    W += b * _aligned(stride_wb, ALIGN) + h * _aligned(stride_wh, ALIGN)
    Y += b * stride_yb + h * stride_yh
    offs_k = tl.arange(0, BLOCK_K)
    rows = offs_m % A
    x = tl.load(X + rows[:, None] * stride_xa + offs_k[None, :] * stride_xk, mask=offs_k[None, :] < Kd,
                other=float("-inf")).to(tl.float32) * _LOG2E
    w = tl.load(W + offs_k[:, None] * _aligned(stride_wk, ALIGN) + offs_n[None, :] * stride_wc,
                mask=(offs_k[:, None] < Kd) & (offs_n[None, :] < C), other=0.0)
    m = tl.max(x, 1)
    p = tl.math.exp2(x - tl.where(m == float("-inf"), 0.0, m)[:, None])
    s = tl.sum(p, 1)
    if ZERO_EMPTY:
        s = tl.where(s == 0.0, float("inf"), s)
    acc = tl.dot(p.to(w.dtype), w, input_precision=PRECISION)
    _store_y(Y, acc / s[:, None], offs_m, offs_n, A, C, stride_ya, stride_yc)


# Launchers: the autotuned kernels' choices persist (autotune cache, shipped tables), and a precompile
# dry run leaves a key not tuned yet to the real call instead of timing launches it skips.
_ONE_TILE, _TILED = Launcher(_softmax_matmul_one_tile_kernel), Launcher(_softmax_matmul_kernel)


def _launch(x4: torch.Tensor, w4: torch.Tensor, y4: torch.Tensor, stats: torch.Tensor, zero_empty: bool):
    """Y4 = softmax(X4)·W4 for 4-D [B, H, ·, ·] views; ``stats`` is a [2, B·H·a] fp32 scratch."""
    B, H, a, kd = x4.shape
    c = w4.shape[-1]
    if y4.numel() == 0:
        return
    precision, align = dot_precision(w4.dtype), alignment(w4)
    if kd <= ONE_TILE_MAX_K:
        block_n, block_k = min(max(16, next_pow2(c)), 128), max(16, next_pow2(kd))
        grid = lambda meta: (cdiv(a, meta["BLOCK_M"]) * cdiv(c, block_n) * B * H,)
        key = (next_pow2(a), block_n, block_k, x4.dtype, w4.dtype, y4.dtype, zero_empty, precision, align)
        _ONE_TILE(
            key, grid, x4, w4, y4, H, a, kd, c, next_pow2(a), *x4.stride(), *w4.stride(), *y4.stride(),
            ZERO_EMPTY=zero_empty, PRECISION=precision, ALIGN=align, BLOCK_N=block_n, BLOCK_K=block_k,
        )
        return
    block_c = min(next_pow2(max(kd, 1)), 1024)
    block_r = max(1, min(_STATS_ELEMS // block_c, next_pow2(a)))
    _row_stats_kernel[(cdiv(a, block_r) * B * H,)](
        x4, stats, H, a, kd, *x4.stride(), stats.stride(0), ZERO_EMPTY=zero_empty,
        BLOCK_R=block_r, BLOCK_C=block_c, num_warps=8 if block_r * block_c > 2048 else 4,
    )
    grid = lambda meta: (cdiv(a, meta["BLOCK_M"]) * cdiv(c, meta["BLOCK_N"]) * B * H,)
    keys = (next_pow2(a), next_pow2(kd), next_pow2(c))
    _TILED(
        (*keys, x4.dtype, w4.dtype, y4.dtype, precision, align), grid, x4, w4, stats, y4, H, a, kd, c,
        *keys, stats.stride(0), *x4.stride(), *w4.stride(), *y4.stride(), PRECISION=precision, ALIGN=align,
    )


def _check_softmax_matmul(x: torch.Tensor, w: torch.Tensor) -> tuple[int, ...]:
    if x.dim() < 2 or w.dim() < 2:
        raise RuntimeError(f"softmax_matmul needs x [..., a, b] and w [..., b, c], got shapes "
                           f"{tuple(x.shape)} and {tuple(w.shape)}")
    if x.shape[-1] != w.shape[-2]:
        raise RuntimeError(f"softmax_matmul: x [..., a, b] and w [..., b, c] disagree on b: "
                           f"{tuple(x.shape)} and {tuple(w.shape)}")
    if x.dtype != w.dtype:
        raise RuntimeError(f"softmax_matmul: expected x and w of the same dtype, got {x.dtype} and {w.dtype}")
    try:
        return tuple(torch.broadcast_shapes(x.shape[:-2], w.shape[:-2]))
    except RuntimeError as exc:
        raise RuntimeError(f"softmax_matmul: batch dims of x {tuple(x.shape[:-2])} and w "
                           f"{tuple(w.shape[:-2])} do not broadcast") from exc


def softmax_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``softmax(x, -1) @ w`` for x [..., a, b], w [..., b, c] (batch dims broadcast), softmax(x)
    never written. Rows of x that are all -inf give NaN, as in torch."""
    batch = _check_softmax_matmul(x, w)
    if not use_kernel("softmax_matmul", x, w, unsupported=kernel_reason(x, w, batch=batch)):
        return reference.softmax_matmul(x, w)
    a, kd, c = x.shape[-2], x.shape[-1], w.shape[-1]
    x4, w4 = as_4d(x, batch, a, kd), as_4d(w, batch, kd, c)
    B, H = x4.shape[:2]
    y4 = _common.alloc_output((B, H, a, c), x, heads_inner=False)
    stats = torch.empty(2, B * H * a, dtype=torch.float32, device=x.device)
    _launch(x4, w4, y4, stats, zero_empty=False)
    return from_4d(y4, batch)


def _scores(x3: torch.Tensor, q4: torch.Tensor, k4: torch.Tensor, q0: int, scale: float) -> None:
    """x3 [B·H, n, Sk] = scale · q4[:, :, q0:q0+n] · k4ᵀ by cuBLAS, with no copy of q or k where
    (B, H) fold into one batch dim, else one batched GEMM per b. fp32 scores of fp16/bf16 inputs come
    from the half-precision GEMM with an fp32 output where torch has one (CUDA), else from fp32
    copies of q and k."""
    B, H = q4.shape[:2]
    n = x3.shape[1]
    q, k = q4[:, :, q0:q0 + n], k4
    if x3.dtype != q.dtype and not _mixed_gemm(q):
        q, k = q.to(x3.dtype), k.to(x3.dtype)
    try:
        q3, k3 = q.view(B * H, n, -1), k.view(B * H, k.shape[2], -1)
        pairs = [(x3, q3, k3)]
    except RuntimeError:  # e.g. diffusers' [B, S, H, D] views with B > 1
        x4 = x3.view(B, H, n, -1)
        pairs = [(x4[b], q[b], k[b]) for b in range(B)]
    for x, a, b in pairs:  # beta = 0: x's contents ignored
        if x.dtype == a.dtype:
            x.baddbmm_(a, b.transpose(1, 2), beta=0.0, alpha=scale)
            continue
        try:
            torch.ops.aten.baddbmm.dtype_out(x, a, b.transpose(1, 2), x.dtype, beta=0.0, alpha=scale, out=x)
        except RuntimeError as exc:  # this torch build has no such GEMM here: fp32 copies from now on
            _MIXED_GEMM_FAILED.append(f"{type(exc).__name__}: {exc}")
            x.baddbmm_(a.to(x.dtype), b.to(x.dtype).transpose(1, 2), beta=0.0, alpha=scale)


_MIXED_GEMM_FAILED: list[str] = []  # why aten.baddbmm.dtype_out failed, if it did (then never tried again)


def _mixed_gemm(q: torch.Tensor) -> bool:
    """Whether torch computes a half-precision batched GEMM into fp32 on q's device (CUDA's cuBLAS)."""
    return q.is_cuda and not _MIXED_GEMM_FAILED and hasattr(torch.ops.aten.baddbmm, "dtype_out")


def partial_softmax_reason(q, k, v, attn_mask, batch) -> str | None:
    return kernel_reason(q, k, v, attn_mask, batch=batch)


def partial_softmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
    max_chunk_bytes: int | None = None,
    scores_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Attention with the contract of ``flash_attention`` (any head dims, v's may differ from q's) by
    the partially fused softmax: X = q·kᵀ·scale (+ mask) written by cuBLAS, then row stats, then
    softmax(X)·v fused.

    Extra memory: X (B·H·Sq·Sk elements of ``scores_dtype``, default q's dtype, fp32 for fp16) and two fp32
    vectors of B·H·Sq; with ``max_chunk_bytes`` X covers as many query rows at a time as fit.
    """
    batch = check_attention_args("partial_softmax_attention", q, k, v, attn_mask)
    reason = partial_softmax_reason(q, k, v, attn_mask, batch)
    if not use_kernel("partial_softmax_attention", q, k, v, attn_mask, unsupported=reason):
        return reference.attention(q, k, v, attn_mask, scale)
    # fp16 scores overflow beyond 65504 (|q|·|k| of a VAE's 512-dim heads can), where SDPA, which
    # keeps them in fp32, stays finite: fp16 inputs get fp32 scores unless asked otherwise.
    xdtype = scores_dtype or (torch.float32 if q.dtype == torch.float16 else q.dtype)
    if xdtype not in KERNEL_DTYPES:
        raise ValueError(f"scores_dtype must be one of {KERNEL_DTYPES}, got {xdtype}")
    scale = default_scale(q, scale)
    Sq, Sk, Dv = q.shape[-2], k.shape[-2], v.shape[-1]
    q4, k4, v4 = as_4d(q, batch, Sq, q.shape[-1]), as_4d(k, batch, Sk, k.shape[-1]), as_4d(v, batch, Sk, Dv)
    B, H = q4.shape[:2]
    out = _common.alloc_output((B, H, Sq, Dv), q, heads_inner=q4.stride(1) < q4.stride(2))
    if out.numel() == 0:
        return from_4d(out, batch)
    mask4 = None
    if attn_mask is not None:  # bool: its complement, the places masked_fill sets to -inf; float: added
        mask4 = as_4d(attn_mask.logical_not() if attn_mask.dtype == torch.bool else attn_mask, batch, Sq, Sk)

    elem = torch.empty((), dtype=xdtype).element_size()
    sk_pad = cdiv(max(Sk, 1), 16 // elem) * (16 // elem)  # rows of X start on 16 bytes: vector loads
    chunk = Sq if max_chunk_bytes is None else max(1, min(Sq, max_chunk_bytes // (B * H * sk_pad * elem)))
    x3 = torch.empty(B * H, chunk, sk_pad, dtype=xdtype, device=q.device)[:, :, :Sk]
    stats = torch.empty(2, B * H * chunk, dtype=torch.float32, device=q.device)
    for q0 in range(0, Sq, chunk):
        n = min(chunk, Sq - q0)
        xn = x3[:, :n]
        _scores(xn, q4, k4, q0, scale)
        x4 = xn.view(B, H, n, Sk)
        if mask4 is not None:
            m = mask4[:, :, q0:q0 + n]
            if m.dtype == torch.bool:
                x4.masked_fill_(m, float("-inf"))
            else:
                x4.add_(m)
        _launch(x4, v4, out[:, :, q0:q0 + n], stats[:, : B * H * n], zero_empty=True)
    return from_4d(out, batch)
