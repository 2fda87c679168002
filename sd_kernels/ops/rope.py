"""FLUX's attention inputs in one pass: q/k RMSNorm, the rotary embedding, the text + image join.

Between its q/k/v projections and the attention core, diffusers' FLUX attention processor runs, per
stream (the image tokens, and in the double-stream blocks the text tokens too):

    q, k, v = (t.unflatten(-1, (H, D)) for t in projections)         # [B, S, H, D] views
    q, k = norm_q(q), norm_k(k)                                        # torch.nn.RMSNorm over D
    q, k, v = (cat([text, image], dim=1) for each)                     # double-stream blocks
    q, k = apply_rotary_emb(q, (cos, sin)), apply_rotary_emb(k, ...)  # cos, sin [S_text + S_image, D]

with the rotation on the pairs (x[2i], x[2i+1]): y[2i] = x[2i]·cos[2i] − x[2i+1]·sin[2i],
y[2i+1] = x[2i+1]·cos[2i+1] + x[2i]·sin[2i+1]. Stock PyTorch runs that as a dozen kernels, each
reading and writing a [B, S, H, D] tensor (the norm's upcast, square, mean, scale, weight; the
concatenations; the rotation's reshape, stack, two products and sum). Here one launch per stream
reads the projections' outputs as they are (any batch and token strides: slices of one fused
``to_qkv`` output too), normalizes and rotates q and k in registers, and writes q, k and v once,
straight into [B, S_text + S_image, H, D] buffers at the stream's token offset: the join costs
nothing. docs/kernels/rope.md counts the bytes.

Numerics: fp32 inside, one rounding to the input's dtype at the store. Stock rounds once more (the
weighted, normalized value, before the rotation upcasts it again), so the kernel is at least as
close to a float64 evaluation of the formula as stock. The norm's rsqrt is an
IEEE square root and division (``/`` and ``sqrt`` are approximate on the GPU).

A program owns ROWS rows of D elements, a row being one (token, head) of q, of k and of v, loaded
whole (vector loads) and split into the rotation's pairs in registers, without a second load.
``qk_norm_rope_fp8`` runs the same rows as chunks of tokens of one head, a program looping over its chunk,
and also returns the FP8 attention's K/V statistics (per-chunk sums of k and max |v| per channel), so that the
attention's pre-pass need not read K and V for them (docs/kernels/rope.md, "The FP8 attention's K/V statistics").
Calls the kernel does not take (float64, autograd, inputs of several dtypes, D past ``_MAX_D``) run
``sd_kernels.reference.qk_norm_rope``, stock's ops in stock's order; an odd head dim with the rotation
is a ValueError (``reference.check_qk_norm_rope_args``).
"""

from __future__ import annotations

import importlib

import torch
import triton
import triton.language as tl

from sd_kernels import reference
from sd_kernels.ops.layout import vectors
from sd_kernels.runtime.dispatch import interpreting, tensor_reason, use_kernel
from sd_kernels.runtime.launch import Launcher, cdiv, next_pow2

# the module (sd_kernels.ops re-exports a function of its name)
_fp8 = importlib.import_module("sd_kernels.ops.attention_fp8")

_ELEMS = 1024  # elements per program and tensor: 8 rows of FLUX's D = 128
_INTERPRETED_ELEMS = 4096  # ... under the interpreter, whose cost is per program: fewer, larger programs
_MAX_D = 1024  # a head dim wider than any model's; one program's row tile
STATS_ELEMS = 1024  # qk_norm_rope_fp8: elements per step and tensor (8 tokens of one head at D = 128)
STATS_CHUNK = 128  # ...and tokens per program, at least
STATS_STAGES = 3  # ...and its loop's stages: each step's loads issued two steps ahead


@triton.jit
def _rows(ptr, off, d, mask, stride_d):
    """The [ROWS, BLOCK_D] elements of the rows starting at ``off``, as fp32."""
    return tl.load(ptr + off[:, None] + d[None, :] * stride_d, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _pairs(x, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """x [ROWS, BLOCK_D] as its even and odd elements, [ROWS, BLOCK_D / 2] each (a thread's contiguous
    elements split in registers)."""
    return tl.split(tl.reshape(x, (ROWS, BLOCK_D // 2, 2)))


@triton.jit
def _norm_rope(src, off, stride_d, w_ptr, dst, out_off, d, mask, D, eps, ce, co, se, so,
               NORM: tl.constexpr, HAS_W: tl.constexpr, ROPE: tl.constexpr, ROWS: tl.constexpr,
               BLOCK_D: tl.constexpr):
    """One of q, k: its rows RMS-normalized over D (times the weight), rotated, stored; returned as stored
    (rounded to the output's dtype), in fp32."""
    x = _rows(src, off, d, mask, stride_d)
    if NORM:
        ms = tl.math.div_rn(tl.sum(x * x, axis=1), D * 1.0)
        x = x * tl.math.div_rn(1.0, tl.sqrt_rn(ms + eps))[:, None]
        if HAS_W:
            x = x * tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)[None, :]
    if ROPE:
        xe, xo = _pairs(x, ROWS, BLOCK_D)
        x = tl.reshape(tl.join(xe * ce - xo * se, xo * co + xe * so), (ROWS, BLOCK_D))
    x = x.to(dst.dtype.element_ty)
    tl.store(dst + out_off[:, None] + d[None, :], x, mask=mask)
    return x.to(tl.float32)


@triton.jit
def _tile(q_ptr, k_ptr, v_ptr, wq_ptr, wk_ptr, cos_ptr, sin_ptr, oq_ptr, ok_ptr, ov_ptr, sample, token, head, mask, d,
          S, H, D, offset, s_total, kv_row, eps,
          stride_qb, stride_qs, stride_qd, stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd,
          stride_cs, stride_cd, stride_ss, stride_sd,
          NORM: tl.constexpr, HAS_WQ: tl.constexpr, HAS_WK: tl.constexpr, ROPE: tl.constexpr, HAS_V: tl.constexpr,
          LOAD_V: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """The rows (sample, token, head) of one stream (ROWS of them; each index a vector or a scalar): q and k
    normalized (NORM) and rotated (ROPE), v copied (HAS_V), into [B, s_total, H, D] outputs at token ``offset``:
    q's contiguous, k's and v's ``kv_row`` elements a token apart (H·D: contiguous; 2·H·D: the two halves of one
    [B, s_total, 2, H, D] buffer). Returns k as stored and (LOAD_V) v, in fp32 (masked elements 0)."""
    out_off = ((sample * s_total + offset + token) * H + head) * D
    kv_off = (sample * s_total + offset + token) * kv_row + head * D
    col = head * D  # the head's first element in the H·D projection row

    ce, co, se, so = 0.0, 0.0, 0.0, 0.0
    if ROPE:
        ce, co = _pairs(_rows(cos_ptr, (offset + token) * stride_cs, d, mask, stride_cd), ROWS, BLOCK_D)
        se, so = _pairs(_rows(sin_ptr, (offset + token) * stride_ss, d, mask, stride_sd), ROWS, BLOCK_D)
    _norm_rope(q_ptr, sample * stride_qb + token * stride_qs + col * stride_qd, stride_qd, wq_ptr, oq_ptr, out_off,
               d, mask, D, eps, ce, co, se, so, NORM, HAS_WQ, ROPE, ROWS, BLOCK_D)
    k = _norm_rope(k_ptr, sample * stride_kb + token * stride_ks + col * stride_kd, stride_kd, wk_ptr, ok_ptr,
                   kv_off, d, mask, D, eps, ce, co, se, so, NORM, HAS_WK, ROPE, ROWS, BLOCK_D)
    v = k
    if LOAD_V:
        off = sample * stride_vb + token * stride_vs + col * stride_vd
        v = tl.load(v_ptr + off[:, None] + d[None, :] * stride_vd, mask=mask, other=0.0)
        if HAS_V:
            tl.store(ov_ptr + kv_off[:, None] + d[None, :], v, mask=mask)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr, k_ptr, v_ptr, wq_ptr, wk_ptr, cos_ptr, sin_ptr, oq_ptr, ok_ptr, ov_ptr,
    n_rows, S, H, D, offset, s_total, kv_row, eps,
    stride_qb, stride_qs, stride_qd, stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd,
    stride_cs, stride_cd, stride_ss, stride_sd,
    NORM: tl.constexpr, HAS_WQ: tl.constexpr, HAS_WK: tl.constexpr, ROPE: tl.constexpr, HAS_V: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Rows [pid·ROWS, (pid + 1)·ROWS) of one stream's B·S·H (token, head) rows (``_tile``). Rows are loaded
    whole (contiguous, vector loads) and split into the rotation's pairs in registers."""
    # int64: (sample·s_total + token)·H·D passes 2³¹ on large batches
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    d = tl.arange(0, BLOCK_D)
    mask = (rows < n_rows)[:, None] & (d < D)[None, :]
    _tile(q_ptr, k_ptr, v_ptr, wq_ptr, wk_ptr, cos_ptr, sin_ptr, oq_ptr, ok_ptr, ov_ptr, rows // (H * S),
          (rows // H) % S, rows % H, mask, d, S, H, D, offset, s_total, kv_row, eps,
          stride_qb, stride_qs, stride_qd, stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd,
          stride_cs, stride_cd, stride_ss, stride_sd, NORM, HAS_WQ, HAS_WK, ROPE, HAS_V, HAS_V, ROWS, BLOCK_D)


@triton.jit
def _qk_norm_rope_stats_kernel(
    q_ptr, k_ptr, v_ptr, wq_ptr, wk_ptr, cos_ptr, sin_ptr, oq_ptr, ok_ptr, ov_ptr, ksum_ptr, vmax_ptr,
    S, H, D, offset, s_total, kv_row, eps, first_chunk, n_chunks,
    stride_qb, stride_qs, stride_qd, stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd,
    stride_cs, stride_cd, stride_ss, stride_sd,
    NORM: tl.constexpr, HAS_WQ: tl.constexpr, HAS_WK: tl.constexpr, ROPE: tl.constexpr, HAS_V: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK: tl.constexpr, STAGES: tl.constexpr,
):
    """``_qk_norm_rope_kernel``'s work on CHUNK tokens of one (sample, head), ROWS tokens a step, with the
    FP8 attention's K/V statistics of those tokens (ops.attention_fp8's ``_kv_stats_kernel`` on the keys and
    values as stored): their per-channel sums of k and max |v|, into chunk ``first_chunk`` + this program's of
    the [B·H, n_chunks, D] partials. Programs of one chunk's heads run side by side (heads fastest), so
    that together they read whole token rows."""
    bh, chunk = tl.program_id(0), tl.program_id(1)
    sample, head = (bh // H).to(tl.int64), (bh % H).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    ksum = tl.zeros([ROWS, BLOCK_D], tl.float32)
    vmax = tl.zeros([ROWS, BLOCK_D], tl.float32)
    for t0 in tl.range(0, CHUNK, ROWS, num_stages=STAGES):
        token = chunk.to(tl.int64) * CHUNK + t0 + tl.arange(0, ROWS)
        mask = (token < S)[:, None] & (d < D)[None, :]
        k, v = _tile(q_ptr, k_ptr, v_ptr, wq_ptr, wk_ptr, cos_ptr, sin_ptr, oq_ptr, ok_ptr, ov_ptr, sample, token,
                     head, mask, d, S, H, D, offset, s_total, kv_row, eps,
                     stride_qb, stride_qs, stride_qd, stride_kb, stride_ks, stride_kd, stride_vb, stride_vs,
                     stride_vd, stride_cs, stride_cd, stride_ss, stride_sd, NORM, HAS_WQ, HAS_WK, ROPE, HAS_V,
                     True, ROWS, BLOCK_D)
        ksum += k
        vmax = tl.maximum(vmax, tl.abs(v))
    out = (bh * n_chunks + first_chunk + chunk) * D + d
    tl.store(ksum_ptr + out, tl.sum(ksum, 0), mask=d < D)
    tl.store(vmax_ptr + out, tl.max(vmax, 0), mask=d < D)


_LAUNCH = Launcher(_qk_norm_rope_kernel)
_LAUNCH_STATS = Launcher(_qk_norm_rope_stats_kernel)


def _kernel_reason(activations: tuple, weights: tuple, rotary: tuple, head_dim: int) -> str | None:
    reason = tensor_reason(*activations, *weights, *rotary)
    if reason is not None:
        return reason
    dtypes = sorted({str(t.dtype) for t in (*activations, *weights) if t is not None})
    if len(dtypes) > 1:
        return f"activations and norm weights of several dtypes {dtypes} (the kernel takes one)"
    if head_dim > _MAX_D:
        return f"head dim {head_dim} is wider than one program's row tile ({_MAX_D})"
    return None


def blocks(head_dim: int, elems: int = _ELEMS) -> tuple[int, int, int]:
    """(ROWS, BLOCK_D, num_warps): the head dim padded to a power of two (at least one pair), rows up to
    ``elems`` elements a program (``_ELEMS`` on a GPU), a warp per 512 elements, 2 to 8: small programs,
    several resident on an SM, so that one's loads run under another's arithmetic (docs/kernels/rope.md,
    "Benchmark")."""
    block_d = max(2, next_pow2(head_dim))
    rows = max(1, elems // block_d)
    return rows, block_d, min(8, max(2, rows * block_d // 512))


def _launch_stream(q, k, v, q_weight, k_weight, eps, cos, sin, out: tuple, offset: int, head_dim: int,
                   stats: tuple | None = None) -> None:
    """One stream's rows into ``out`` = (query, key, value or None) at token ``offset``: query contiguous,
    key and value contiguous or the halves of one [B, S, 2, H, D] buffer (``qk_norm_rope_kv``). ``stats`` =
    (k_sum, v_max, first chunk, chunk): also the FP8 attention's K/V partials, a chunk of tokens a program."""
    bsz, s, n = q.shape
    heads = n // head_dim
    n_rows = bsz * s * heads
    if n_rows == 0:
        return
    q_weight, k_weight = vectors(q_weight, k_weight)
    oq, ok, ov = out
    flags = dict(NORM=eps is not None, HAS_WQ=q_weight is not None, HAS_WK=k_weight is not None,
                 ROPE=cos is not None, HAS_V=ov is not None)
    c, sn = (q, q) if cos is None else (cos, sin)
    vv = q if ov is None and stats is None else v
    args = (q, k, vv, q if q_weight is None else q_weight, q if k_weight is None else k_weight, c, sn,
            oq, ok, oq if ov is None else ov)
    geometry = (s, heads, head_dim, offset, oq.shape[1], ok.stride(1), 0.0 if eps is None else float(eps))
    strides = (*q.stride(), *k.stride(), *vv.stride(), *c.stride()[-2:], *sn.stride()[-2:])
    if stats is None:
        rows, block_d, num_warps = blocks(head_dim, _INTERPRETED_ELEMS if interpreting() else _ELEMS)
        _LAUNCH((*flags.values(), rows, block_d, num_warps), (cdiv(n_rows, rows),), *args, n_rows, *geometry,
                *strides, **flags, ROWS=rows, BLOCK_D=block_d, num_warps=num_warps)
        return
    k_sum, v_max, first, chunk = stats
    rows, block_d, num_warps = blocks(head_dim, _INTERPRETED_ELEMS if interpreting() else STATS_ELEMS)
    _LAUNCH_STATS((*flags.values(), rows, block_d, num_warps, chunk, STATS_STAGES), (bsz * heads, cdiv(s, chunk)),
                  *args, k_sum, v_max, *geometry, first, k_sum.shape[1], *strides, **flags, ROWS=rows,
                  BLOCK_D=block_d, CHUNK=chunk, STAGES=STATS_STAGES, num_warps=num_warps)


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    head_dim: int,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float | None = None,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    eq: torch.Tensor | None = None,
    ek: torch.Tensor | None = None,
    ev: torch.Tensor | None = None,
    eq_weight: torch.Tensor | None = None,
    ek_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FLUX's attention inputs (``sd_kernels.reference.qk_norm_rope``'s contract) in one launch per
    stream: (query, key, value) [B, S_text + S, H, D], query and key contiguous new tensors in q's
    dtype; value the text and image values joined (a new tensor), or without a text stream the view
    ``v.unflatten(-1, (-1, head_dim))`` (no copy, as stock)."""
    args = (q, k, v, head_dim, q_weight, k_weight, eps, cos, sin, eq, ek, ev, eq_weight, ek_weight)
    return _outputs(args, stats=False)[:3]


def qk_norm_rope_fp8(q, k, v, head_dim, q_weight=None, k_weight=None, eps=None, cos=None, sin=None, eq=None, ek=None,
                     ev=None, eq_weight=None, ek_weight=None):
    """``qk_norm_rope``'s (query, key, value) and the FP8 attention's K/V statistics of that key and value
    (``attention_fp8.KvStats``; None where the kernel does not run), computed by the same launches as they
    write the key and read the value: ``attention(..., precision="fp8", kv_stats=...)`` then skips its own
    statistics pass over them (ops/attention_fp8.py, ``quantize_kv``)."""
    args = (q, k, v, head_dim, q_weight, k_weight, eps, cos, sin, eq, ek, ev, eq_weight, ek_weight)
    return _outputs(args, stats=True)


def _outputs(args: tuple, stats: bool) -> tuple:
    """(query, key, value, the K/V statistics or None) for ``qk_norm_rope``'s arguments: the kernel's launches
    (``stats``: the statistics kernel's, which also write the partials), or the reference and no statistics.
    Inference tensors (the key written under ``torch.inference_mode()``, or an inference value read in place) get
    no statistics: they keep no version counter, by which the attention would tell a change made to them since."""
    if not _kernel_runs(*args):
        return (*reference.qk_norm_rope(*args), None)
    q, v, head_dim, eq = args[0], args[2], args[3], args[9]
    shape = _heads_shape(q, eq, head_dim)
    query, key = _alloc(shape, q), _alloc(shape, q)
    value = None if eq is None else _alloc(shape, q)
    partials = None
    if stats and not (key.is_inference() or (v if value is None else value).is_inference()):
        s_text = 0 if eq is None else eq.shape[1]
        chunk = stats_chunk(q.shape[1], s_text)
        n_chunks = cdiv(q.shape[1], chunk) + cdiv(s_text, chunk)
        partials = (*(torch.empty(shape[0] * shape[2], n_chunks, head_dim, dtype=torch.float32, device=q.device)
                      for _ in range(2)), chunk)
    _launch_streams(*args, out=(query, key, value), stats=partials)
    value = v.unflatten(-1, (-1, head_dim)) if value is None else value
    return query, key, value, None if partials is None else _fp8.KvStats.of(key, value, *partials[:2])


def stats_chunk(s_image: int, s_text: int) -> int:
    """Tokens a program of ``qk_norm_rope_fp8`` takes: ``STATS_CHUNK`` at least, a power of two, and as many as
    keep each stream within half of the FP8 attention's ``MAX_CHUNKS`` partials a head. At FLUX 1024² that is 256
    for the single blocks' 4,608 tokens and 128 for the double blocks' streams; each measured faster than the
    other (H200: 49.4 against 57.7 µs, 64.4 against 82.8; docs/kernels/rope.md)."""
    return max(STATS_CHUNK, next_pow2(cdiv(max(s_image, s_text), _fp8.MAX_CHUNKS // 2)))


def qk_norm_rope_kv(q, k, v, head_dim, q_weight=None, k_weight=None, eps=None, cos=None, sin=None, eq=None, ek=None,
                    ev=None, eq_weight=None, ek_weight=None, kv_out=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``qk_norm_rope`` with the key and value side by side: (query [B, S_text + S, H, D], kv [B, S_text + S,
    2, H, D]), ``kv[:, :, 0]`` the key and ``kv[:, :, 1]`` the value (copied in, also without a text
    stream): one buffer for a collective to send whole (patches/context_parallel.py), written by the
    same launches; into ``kv_out`` (contiguous, of that shape and q's dtype) where given, which is then
    the ``kv`` returned."""
    args = (q, k, v, head_dim, q_weight, k_weight, eps, cos, sin, eq, ek, ev, eq_weight, ek_weight)
    shape, kv_shape = _heads_shape(q, eq, head_dim), kv_shape_of(q, eq, head_dim)
    if kv_out is not None and (tuple(kv_out.shape) != kv_shape or kv_out.dtype != q.dtype
                               or kv_out.device != q.device or not kv_out.is_contiguous()):
        raise ValueError(f"qk_norm_rope_kv: kv_out must be a contiguous {list(kv_shape)} {q.dtype} tensor on "
                         f"{q.device}, not {list(kv_out.shape)} {kv_out.dtype} on {kv_out.device}")
    if not _kernel_runs(*args):
        query, key, value = reference.qk_norm_rope(*args)
        kv = kv_layout(key, value)
        return query, kv if kv_out is None else kv_out.copy_(kv)
    query, kv = _alloc(shape, q), (_alloc(kv_shape, q) if kv_out is None else kv_out)
    _launch_streams(*args, out=(query, kv[:, :, 0], kv[:, :, 1]))
    return query, kv


def kv_shape_of(q: torch.Tensor, eq: torch.Tensor | None, head_dim: int) -> tuple[int, ...]:
    """The [B, S_text + S, 2, H, D] shape of ``qk_norm_rope_kv``'s kv for projections q [B, S, H·D] and eq
    [B, S_text, H·D] (or None): what a caller allocates to pass as ``kv_out``."""
    bsz, tokens, heads, _ = _heads_shape(q, eq, head_dim)
    return bsz, tokens, 2, heads, head_dim


def kv_layout(key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Keys and values [B, S, H, D] side by side, [B, S, 2, H, D] (one copy): ``qk_norm_rope_kv``'s layout.
    Gathered over W processes along dim 0 ([W·B, S, 2, H, D]), a batch of one is [1, W·S, 2, H, D] as it
    lies, so the whole sequence's keys are the view ``[..., 0, :, :]`` with one token stride (2·H·D), the
    values likewise."""
    return torch.stack((key, value), dim=2)


def _kernel_runs(q, k, v, head_dim, q_weight, k_weight, eps, cos, sin, eq, ek, ev, eq_weight, ek_weight) -> bool:
    """The arguments checked (a ValueError for bad ones); whether the kernel takes the call."""
    reference.check_qk_norm_rope_args(q, k, v, head_dim, q_weight, k_weight, eps, cos, sin, eq, ek, ev,
                                      eq_weight, ek_weight)
    activations, weights = (q, k, v, eq, ek, ev), (q_weight, k_weight, eq_weight, ek_weight)
    reason = _kernel_reason(activations, weights, (cos, sin), head_dim)
    return use_kernel("qk_norm_rope", *activations, *weights, cos, sin, unsupported=reason)


def _heads_shape(q: torch.Tensor, eq: torch.Tensor | None, head_dim: int) -> tuple[int, int, int, int]:
    bsz, s, n = q.shape
    return bsz, s + (0 if eq is None else eq.shape[1]), n // head_dim, head_dim


def _launch_streams(q, k, v, head_dim, q_weight, k_weight, eps, cos, sin, eq, ek, ev, eq_weight, ek_weight, *,
                    out: tuple, stats: tuple | None = None) -> None:
    """The text stream's launch (if any) at token 0, the image stream's after it; ``stats`` = (k_sum, v_max,
    chunk): each stream's K/V partials too, the text stream's chunks first."""
    s_text = 0 if eq is None else eq.shape[1]
    text_stats = image_stats = None
    if stats is not None:
        k_sum, v_max, chunk = stats
        text_stats, image_stats = (k_sum, v_max, 0, chunk), (k_sum, v_max, cdiv(s_text, chunk), chunk)
    if eq is not None:
        _launch_stream(eq, ek, ev, eq_weight, ek_weight, eps, cos, sin, out, 0, head_dim, text_stats)
    _launch_stream(q, k, v, q_weight, k_weight, eps, cos, sin, out, s_text, head_dim, image_stats)


def _alloc(shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """Every output of this module comes from here (tests poison it to catch unwritten elements)."""
    return torch.empty(shape, dtype=like.dtype, device=like.device)
