"""The FP8 (E4M3) tier's activation quantizer: one scale per row, in one pass over the rows.

The math (sd_kernels.reference, same names): a row v of an activation is stored as
``q = e4m3(v · 448 / max|v|)`` with ``scale = max|v| / 448`` (E4M3's largest finite value is 448); a zero
row gets codes 0 and scale 0, a row holding a NaN a NaN scale.

``quantize_rows`` is one pass over its input: each program owns whole rows (held as up to four power-of-two
pieces, ``row_pieces``), finds their absolute maximum and writes codes and scales; it may apply a GELU (or a
GEGLU's ``a · gelu(g)``) first, so the feed-forward's activation and the quantization of the second GEMM's
input are one kernel, and put a prefix in front of it (FLUX's single blocks' join: the concatenation never
written). The programs are small, several resident on an SM, so that one's loads run under another's
reduction and stores (docs/fp8.md, "The quantizer"). ops/layer_norm.py's modulated LayerNorm has an FP8
output of the same form (``row_amax``, ``row_quantize``). The GEMMs that read the codes: ops/fp8_linear.py.

FP8 tensor cores need sm_89 or later; the interpreter runs the same kernel on the CPU. Elsewhere (and for
inputs autograd tracks) the op runs the reference's fp32 math of the same quantization.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from sd_kernels import reference
from sd_kernels.ops.gelu import _act
from sd_kernels.runtime.dispatch import interpreting, tensor_reason, use_kernel
from sd_kernels.runtime.launch import Launcher, cdiv, next_pow2

E4M3 = torch.float8_e4m3fn
E4M3_MAX = reference.E4M3_MAX
_E4M3_MAX = tl.constexpr(448.0)
_SCALE_TINY = tl.constexpr(reference.SCALE_TINY)  # a row no larger is quantized as zeros (reference.py says why)
FP8_CAPABILITY = (8, 9)  # Ada and Hopper have FP8 tensor cores
# The quantizer's erf GELU (act "none": SD's and SDXL's GEGLU) from a polynomial and one exp2 (``_gelu_erf_poly``)
# instead of libdevice's erff; False: erff, as ops/gelu.py computes it
GELU_ERF_POLY = True
_ELEMS = 16384  # the widest row the quantizer holds in one program (FLUX's widest, 15,360); wider: two passes
_ROW_ELEMS = 2048  # narrower rows are batched up to this many (padded) elements a program
# Under the interpreter, whose cost is per program and not per SM, narrow rows are batched as far as a wide
# row goes: the same kernel, fewer programs (4x fewer at the tiny pipelines' rows).
_INTERPRETED_ROW_ELEMS = _ELEMS


@triton.jit
def _gelu_erf_poly(x):
    """The erf GELU, 0.5·x·(1 + erf(x/√2)), with 1 + erf from Abramowitz & Stegun's formula 7.1.26 (Handbook of
    Mathematical Functions, 1964: |error| ≤ 1.5·10⁻⁷ on erf; in fp32 at most 7·10⁻⁷ on 1 + erf, measured over
    ±12): a reciprocal, five multiply-adds and one exp2, without libdevice erff's branches. For x < 0 it takes
    1 + erf(u) = erfc(|u|) from the formula itself, no cancellation. FP8 codes cannot resolve the difference
    (an e4m3 step is 2⁻³ relative): the quantizer's GELU (``GELU_ERF_POLY``)."""
    u = tl.abs(x) * 0.7071067811865476
    t = 1.0 / (1.0 + 0.3275911 * u)
    poly = ((((1.061405429 * t - 1.453152027) * t + 1.421413741) * t - 0.284496736) * t + 0.254829592) * t
    erfc = poly * tl.exp2(u * u * -1.4426950408889634)
    return 0.5 * x * tl.where(x < 0, erfc, 2.0 - erfc)


@triton.jit
def _activate(x, ACT: tl.constexpr):
    """``x`` (fp32) through the activation: "" none, "tanh" / "none" the GELUs of ops/gelu.py."""
    if ACT == "":
        return x
    else:
        return _act(x, ACT)


@triton.jit
def _quantizer_activate(x, ACT: tl.constexpr):
    """The quantizer's activation: ``_activate``'s, and "erf-poly", the erf GELU of ``_gelu_erf_poly``."""
    if ACT == "erf-poly":
        return _gelu_erf_poly(x)
    else:
        return _activate(x, ACT)


@triton.jit
def _e4m3(v, GRID: tl.constexpr):
    """fp32 ``v`` (|v| ≤ 448) as e4m3, rounded to nearest, ties to even. GRID: round in fp32 first,
    to the e4m3 value itself, so that the cast is exact: the interpreter's own cast rounds ties up and
    loses the carry into the exponent (124.7 became 64). The GPU's cast (cvt.rn.satfinite) is exact."""
    if GRID:
        bits = v.to(tl.int32, bitcast=True)
        ulp_exp = tl.maximum(((bits >> 23) & 0xFF) - 3, 127 - 9)  # 3 mantissa bits; subnormals below 2⁻⁶
        big = (ulp_exp << 23).to(tl.float32, bitcast=True) * 12582912.0  # 1.5·2²³ ulps: fp32 rounds to ulps
        v = (v + big) - big
    return v.to(tl.float8e4nv)


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _codes(v, inv, GRID: tl.constexpr):
    """e4m3(v · inv). On the GPU the cast saturates (cvt.rn.satfinite: |v · inv| ≤ 448 up to the
    product's rounding, which the cast rounds back to 448; a NaN stays NaN, as in the reference), so it
    needs no clamp; the interpreter's cast does not, so there the value is clamped and rounded first
    (GRID). The interpreter's cast makes no NaN code (a NaN element gets a finite one there; its row's scale
    is NaN either way)."""
    if GRID:
        return _e4m3(tl.minimum(tl.maximum(v * inv[:, None], -_E4M3_MAX), _E4M3_MAX), GRID)
    return (v * inv[:, None]).to(tl.float8e4nv)


@triton.jit
def row_amax(v, mask, GRID: tl.constexpr):
    """max |v| of each row of v [ROWS, C] (fp32) where ``mask``; NaN for a row holding a NaN, so that
    its scale, and so its output row, is NaN as torch's would be (``tl.max`` skips NaN: the clamp
    would then make the NaN a finite ±448 code). Compiled, one reduction whose combine propagates NaN;
    in the interpreter (GRID), which runs a custom combine element by element, two plain ones."""
    a = tl.where(mask, v, 0.0)
    if GRID:
        nans = tl.sum(tl.where(a != a, a, 0.0), axis=1)  # NaN where the row holds one, else 0
        return tl.max(tl.abs(a), axis=1) + nans
    return tl.reduce(tl.abs(a), 1, _max_nan)


@triton.jit
def inv_scale(amax, QMAX: tl.constexpr):
    """QMAX / amax, 0 for amax at most reference.SCALE_TINY (0 included): ``reference.inverse_scale``. An IEEE
    division (div_rn), as torch divides: Triton's ``/`` on fp32 is the approximate one, whose last-bit
    differences move a code across a rounding boundary now and then."""
    big = amax > _SCALE_TINY
    return tl.where(big, tl.math.div_rn(tl.full(amax.shape, QMAX, tl.float32), tl.where(big, amax, 1.0)), 0.0)


@triton.jit
def row_quantize(v, amax, q_ptrs, s_ptrs, mask, row_mask, GRID: tl.constexpr):
    """Store e4m3(v · 448 / amax) to ``q_ptrs`` and amax / 448 to ``s_ptrs``: v [ROWS, C] fp32 and its
    rows' absolute maxima amax [ROWS]; a zero row gets codes 0 and scale 0."""
    tl.store(q_ptrs, _codes(v, inv_scale(amax, _E4M3_MAX), GRID), mask=mask)
    tl.store(s_ptrs, amax / _E4M3_MAX, mask=row_mask)


@triton.jit
def _x_loads(x_ptrs, mask, gate_step, GATED: tl.constexpr):
    """x's values at ``x_ptrs`` as loaded, 0 where masked, and (gated) the gate's, ``gate_step`` elements after
    them; without a gate, the values again (``_activated``'s two operands)."""
    a = tl.load(x_ptrs, mask=mask, other=0.0)
    g = a
    if GATED:
        g = tl.load(x_ptrs + gate_step, mask=mask, other=0.0)
    return a, g


@triton.jit
def _activated(a, g, ACT: tl.constexpr, GATED: tl.constexpr):
    """act(a) (gated: a · act(g)) in fp32 from ``_x_loads``' values; 0 where they were masked (act(0) = 0)."""
    if GATED:
        return a.to(tl.float32) * _quantizer_activate(g.to(tl.float32), ACT)
    return _quantizer_activate(a.to(tl.float32), ACT)


@triton.jit
def _act_values(x_ptrs, mask, gate_step, ACT: tl.constexpr, GATED: tl.constexpr):
    """act(x) at ``x_ptrs`` (gated: a · act(g), g ``gate_step`` elements after a), fp32, 0 where masked."""
    a, g = _x_loads(x_ptrs, mask, gate_step, GATED)
    return _activated(a, g, ACT, GATED)


@triton.jit
def _row_values(x_rows, p_rows, cols, mask, stride_xc, stride_pc, n_cols, n_prefix, ACT: tl.constexpr,
                GATED: tl.constexpr, HAS_PREFIX: tl.constexpr):
    """Output columns ``cols`` [1, C] of the rows at x_rows (p_rows) [R, 1], fp32: the prefix's columns
    as they are, then act(x) (gated: a · act(g), g n_cols - n_prefix columns after a)."""
    if HAS_PREFIX:
        in_prefix = cols < n_prefix
        p = tl.load(p_rows + cols * stride_pc, mask=mask & in_prefix, other=0.0).to(tl.float32)
        v = _act_values(x_rows + (cols - n_prefix) * stride_xc, mask & (cols >= n_prefix),  # masked where negative
                        (n_cols - n_prefix) * stride_xc, ACT, GATED)
        return tl.where(in_prefix, p, v)
    return _act_values(x_rows + cols * stride_xc, mask, (n_cols - n_prefix) * stride_xc, ACT, GATED)


@triton.jit
def _piece_loads(x_rows, p_rows, row_mask, n_x, n_prefix, stride_xc, stride_pc, START: tl.constexpr,
                 WIDTH: tl.constexpr, PREFIX: tl.constexpr, GATED: tl.constexpr):
    """Columns [START, START + WIDTH) of one part of the row (the prefix, or x) as loaded, not yet
    activated: (values [ROWS, WIDTH], the gate's half (gated x; else the values again), their mask, their
    columns in the output). Apart from ``_piece_values`` so that a program issues every piece's loads
    before its first reduction: a load written after a reduction waits for it."""
    cols = START + tl.arange(0, WIDTH)[None, :]
    if PREFIX:
        mask = row_mask[:, None] & (cols < n_prefix)
        a = tl.load(p_rows + cols * stride_pc, mask=mask, other=0.0)
        return a, a, mask, cols
    mask = row_mask[:, None] & (cols < n_x)
    a, g = _x_loads(x_rows + cols * stride_xc, mask, n_x * stride_xc, GATED)
    return a, g, mask, n_prefix + cols


@triton.jit
def _piece_values(a, g, PREFIX: tl.constexpr, ACT: tl.constexpr, GATED: tl.constexpr):
    """A piece's fp32 values from its loads: the prefix as it is, else act(x) (gated: a · act(g)); 0 where
    masked (act(0) = 0)."""
    if PREFIX:
        return a.to(tl.float32)
    return _activated(a, g, ACT, GATED)


@triton.jit(do_not_specialize=["n_rows", "seg_rows"])
def _quantize_kernel(x_ptr, p_ptr, q_ptr, s_ptr, n_rows, n_cols, n_prefix, seg_rows, stride_xs, stride_xr, stride_xc,
                     stride_pr, stride_pc, ACT: tl.constexpr, GATED: tl.constexpr, HAS_PREFIX: tl.constexpr,
                     GRID: tl.constexpr, ROWS: tl.constexpr, BLOCK_C: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr,
                     W2: tl.constexpr, W3: tl.constexpr, NP: tl.constexpr):
    """Rows [pid·ROWS, (pid + 1)·ROWS) of q [n_rows, n_cols] (contiguous) and s [n_rows]; with a prefix,
    q's first n_prefix columns come from it. x's rows are in segments of seg_rows, stride_xs apart
    (``segments``: a token slice of a batch, x[:, :n], read where it lies).

    A row that fits one program (W0 > 0) is held in registers as up to four power-of-two pieces,
    each part's (the prefix's, then act(x)'s) columns split as the largest power of two below its width
    and the rest (12,288 = 8,192 + 4,096): no lanes padded to the next power of two compute a GELU for
    nothing. Pieces [0, NP) are the prefix's, the others x's. A wider row (W0 = 0) is read twice in
    chunks of BLOCK_C: its maximum first, then the codes (from L2: a row is at most 64 KB)."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < n_rows
    x_rows = x_ptr + ((rows // seg_rows) * stride_xs + (rows % seg_rows) * stride_xr)[:, None]
    p_rows = p_ptr + rows[:, None] * stride_pr
    q_rows = q_ptr + rows[:, None] * n_cols
    if W0 > 0:
        n_x = n_cols - n_prefix
        a0, g0, m0, c0 = _piece_loads(x_rows, p_rows, row_mask, n_x, n_prefix, stride_xc, stride_pc, 0, W0, NP > 0,
                                      GATED)
        if W1 > 0:
            a1, g1, m1, c1 = _piece_loads(x_rows, p_rows, row_mask, n_x, n_prefix, stride_xc, stride_pc,
                                          W0 if NP != 1 else 0, W1, NP > 1, GATED)
        if W2 > 0:
            a2, g2, m2, c2 = _piece_loads(x_rows, p_rows, row_mask, n_x, n_prefix, stride_xc, stride_pc,
                                          0 if NP == 2 else (W1 if NP == 1 else W0 + W1), W2, NP > 2, GATED)
        if W3 > 0:
            a3, g3, m3, c3 = _piece_loads(x_rows, p_rows, row_mask, n_x, n_prefix, stride_xc, stride_pc,
                                          W2 if NP == 2 else 0, W3, False, GATED)
        v0 = _piece_values(a0, g0, NP > 0, ACT, GATED)
        amax = row_amax(v0, m0, GRID)
        if W1 > 0:
            v1 = _piece_values(a1, g1, NP > 1, ACT, GATED)
            amax = _max_nan(amax, row_amax(v1, m1, GRID))
        if W2 > 0:
            v2 = _piece_values(a2, g2, NP > 2, ACT, GATED)
            amax = _max_nan(amax, row_amax(v2, m2, GRID))
        if W3 > 0:
            v3 = _piece_values(a3, g3, False, ACT, GATED)
            amax = _max_nan(amax, row_amax(v3, m3, GRID))
        inv = inv_scale(amax, _E4M3_MAX)
        tl.store(q_rows + c0, _codes(v0, inv, GRID), mask=m0)
        if W1 > 0:
            tl.store(q_rows + c1, _codes(v1, inv, GRID), mask=m1)
        if W2 > 0:
            tl.store(q_rows + c2, _codes(v2, inv, GRID), mask=m2)
        if W3 > 0:
            tl.store(q_rows + c3, _codes(v3, inv, GRID), mask=m3)
        tl.store(s_ptr + rows, amax / _E4M3_MAX, mask=row_mask)
    else:
        cols = tl.arange(0, BLOCK_C)
        amax = tl.zeros((ROWS,), dtype=tl.float32)
        for c in range(0, n_cols, BLOCK_C):
            mask = row_mask[:, None] & (c + cols[None, :] < n_cols)
            v = _row_values(x_rows, p_rows, c + cols[None, :], mask, stride_xc, stride_pc, n_cols, n_prefix, ACT,
                            GATED, HAS_PREFIX)
            amax = _max_nan(amax, row_amax(v, mask, GRID))
        inv = inv_scale(amax, _E4M3_MAX)
        for c in range(0, n_cols, BLOCK_C):
            mask = row_mask[:, None] & (c + cols[None, :] < n_cols)
            v = _row_values(x_rows, p_rows, c + cols[None, :], mask, stride_xc, stride_pc, n_cols, n_prefix, ACT,
                            GATED, HAS_PREFIX)
            tl.store(q_rows + c + cols[None, :], _codes(v, inv, GRID), mask=mask)
        tl.store(s_ptr + rows, amax / _E4M3_MAX, mask=row_mask)


_QUANTIZE = Launcher(_quantize_kernel)


def _part_pieces(n: int) -> list[int]:
    """A part of n columns as its largest power of two and the rest, padded to a power of two."""
    if not n:
        return []
    head = 1 << (n.bit_length() - 1)
    return [head] + ([next_pow2(n - head)] if n > head else [])


def row_pieces(n_prefix: int, n_x: int) -> tuple[tuple[int, int, int, int], int]:
    """((W0, W1, W2, W3), NP): the power-of-two pieces a row of ``n_prefix`` + ``n_x`` columns is held
    in, 0 for none: each part split as its largest power of two and the rest (15,360 columns of one part
    = 8,192 + 8,192 with 1,024 lanes masked; 3,072 + 12,288 = 2,048 + 1,024 + 8,192 + 4,096, none); the
    first NP of them hold the prefix."""
    prefix, x = _part_pieces(n_prefix), _part_pieces(n_x)
    return (*prefix, *x, *(0,) * (4 - len(prefix) - len(x))), len(prefix)


def quantize_blocks(n_rows: int, n_cols: int, elems: int = _ELEMS, batch: int = _ROW_ELEMS) -> tuple[int, int, int]:
    """(ROWS, BLOCK_C, num_warps). A row that fits ``elems`` (padded to a power of two) is one program's
    (BLOCK_C = 0: held as row_pieces), narrower rows batched up to ``batch`` elements; a wider row is read in
    chunks of ``elems``. A warp per 2,048 (padded) elements of the program, 2 to 4 for a whole row (8 for a
    chunk): small programs, several resident on an SM, so that one's loads run under another's reduction and
    stores (measured: docs/fp8.md, "The quantizer")."""
    width = next_pow2(n_cols)
    if width > elems:
        return 1, elems, min(8, max(2, elems // 2048))
    rows = max(1, min(batch // width, next_pow2(n_rows)))
    return rows, 0, min(4, max(2, rows * width // 2048))


def _rows_view(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, last] with any row and column stride; a copy only where no view exists. The rows
    counted, not -1: a last dimension of 0 (an empty prefix) leaves -1 undetermined."""
    shape = (math.prod(x.shape[:-1]), x.shape[-1])
    try:
        return x.view(shape)
    except RuntimeError:
        return x.reshape(shape)


class Segments(NamedTuple):
    """Rows of x [..., C] as a kernel reads them: row r at (r // seg) · stride_s + (r % seg) · stride_r from
    ``base``'s first element, column c at c · stride_c."""

    base: torch.Tensor
    rows: int
    cols: int
    seg: int
    stride_s: int
    stride_r: int
    stride_c: int


def segments(x: torch.Tensor) -> Segments:
    """x [..., C]'s rows, read where they lie: in one segment where they are one stride apart, or in segments
    of x.shape[-2] rows where only the dimensions before the last two merge (x[:, :n] of a batch of token
    rows: a segment a sample). A copy only where neither is so."""
    rows, cols = math.prod(x.shape[:-1]), x.shape[-1]
    try:
        flat = x.view(rows, cols)
    except RuntimeError:
        flat = None
    if flat is None and x.dim() >= 3 and rows:
        try:
            seg = x.view(-1, x.shape[-2], cols)
            return Segments(seg, rows, cols, x.shape[-2], seg.stride(0), seg.stride(1), seg.stride(2))
        except RuntimeError:
            pass
    flat = x.reshape(rows, cols) if flat is None else flat  # no view of the rows: a copy
    one = max(rows, 1)  # one segment; its stride keeps the row stride's divisibility (a kernel specializes on it)
    return Segments(flat, rows, cols, one, flat.stride(0) * one, flat.stride(0), flat.stride(1))


def fp8_reason(*tensors: torch.Tensor | None) -> str | None:
    """Why the FP8 kernels cannot take these tensors (None: they can): besides the shared reasons,
    a CUDA device without FP8 tensor cores."""
    reason = tensor_reason(*tensors, also=(E4M3,))
    if reason is not None:
        return reason
    device = next((t.device for t in tensors if t is not None), None)
    if device is not None and device.type == "cuda" and torch.cuda.get_device_capability(device) < FP8_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        return f"{name} has no FP8 tensor cores (sm_89 or later: Ada, Hopper)"
    return None


def _check_quantize(x: torch.Tensor, act: str, gated: bool, prefix: torch.Tensor | None) -> None:
    reference.check_fp8_activation(act)
    if x.dim() == 0:
        raise ValueError("quantize_rows needs a tensor of at least one dimension (rows of the last one)")
    if gated:
        reference.check_geglu_input(x)
    if prefix is not None and (prefix.dim() != x.dim() or prefix.shape[:-1] != x.shape[:-1] or prefix.dtype != x.dtype
                               or prefix.device != x.device):
        raise ValueError(f"quantize_rows: the prefix [..., P] must have x's rows, dtype and device: got "
                         f"{tuple(prefix.shape)} {prefix.dtype} {prefix.device} for x {tuple(x.shape)} {x.dtype} "
                         f"{x.device}")


def quantize_rows(x: torch.Tensor, act: str = "", gated: bool = False,
                  prefix: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.fp8_quantize_rows`` in one kernel: x [..., N] (any strides) → (q [..., P + n] e4m3,
    contiguous; scales [...] fp32), n = N (N/2 with ``gated``). ``prefix`` [..., P]: columns put in
    front of act(x) as they are (``torch.cat([prefix, act(x)], -1)`` quantized, the concatenation never
    written)."""
    _check_quantize(x, act, gated, prefix)
    if not use_kernel("fp8_quant", x, prefix, unsupported=fp8_reason(x, prefix)):
        return reference.fp8_quantize_rows(x, act, gated, prefix)
    xs = segments(x)
    p2 = xs.base if prefix is None else _rows_view(prefix)
    n_prefix = 0 if prefix is None else p2.shape[1]
    n_rows, n = xs.rows, xs.cols // (2 if gated else 1) + n_prefix
    q = torch.empty((*x.shape[:-1], n), dtype=E4M3, device=x.device)
    s = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    if q.numel() == 0:
        return q, s.zero_()
    grid, has_prefix = interpreting(), prefix is not None
    act = "erf-poly" if act == "none" and GELU_ERF_POLY else act
    rows, block_c, warps = quantize_blocks(n_rows, n, batch=_INTERPRETED_ROW_ELEMS if grid else _ROW_ELEMS)
    (w0, w1, w2, w3), n_p = row_pieces(n_prefix, n - n_prefix) if block_c == 0 else ((0, 0, 0, 0), 0)
    _QUANTIZE((act, gated, has_prefix, grid, rows, block_c, w0, w1, w2, w3, n_p, warps), (cdiv(n_rows, rows),),
              xs.base, p2, q, s, n_rows, n, n_prefix, xs.seg, xs.stride_s, xs.stride_r, xs.stride_c, p2.stride(0),
              p2.stride(1), ACT=act, GATED=gated, HAS_PREFIX=has_prefix, GRID=grid, ROWS=rows, BLOCK_C=block_c,
              W0=w0, W1=w1, W2=w2, W3=w3, NP=n_p, num_warps=warps)
    return q, s


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [N, K] as (e4m3 codes [N, K] contiguous, one fp32 scale per output channel [N]): the
    reference's math, run once at patch time (torch ops: exact on any device)."""
    if weight.dim() != 2:
        raise ValueError(f"quantize_weight needs a 2-D weight [N, K], got shape {tuple(weight.shape)}")
    q, s = reference.fp8_quantize_rows(weight.detach())
    return q.contiguous(), s.contiguous()
