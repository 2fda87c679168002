"""FP8 (E4M3) linear layers with one scale per row: the quantizer, the scaled GEMM and its epilogue.

The math (sd_kernels.reference, same names): a row v of an activation is stored as
``q = e4m3(v · 448 / max|v|)`` with ``scale = max|v| / 448`` (E4M3's largest finite value is 448),
a weight the same way per output channel, once. Then

    y = (a_q · w_qᵀ) · s_a[:, None] · s_w[None, :]  (+ bias) (GELU) (· gate) (+ residual)

accumulated on the tensor cores (Hopper's QGMMA: fp32, its FP8 products added in fewer mantissa bits) and
stored in the caller's dtype. The epilogue runs on the accumulator tile while it sits in registers: the
bias, a tanh (or erf) GELU, a DiT block's per-sample gate and its residual add never cost a pass over
memory of their own (except where torch's GEMM serves a gated call: below). Two kernels share it: on
Hopper the operands come in through the Tensor Memory Accelerator, in persistent programs where that is
faster (the shipped tables choose per shape); elsewhere, for rows TMA cannot read, and for the shapes
where the tables time the pointer kernel faster, through pointers. Where the active profile sets
``fp8_torch_gemm`` (``hopper``), bf16 GEMMs of at least 64 rows whose epilogue is a bias (or a bias, gate
and residual, added after it by one ``torch.addcmul``) go to torch's row-wise ``torch._scaled_mm`` with
fast accumulation, which measured faster in a step (``_torch_gemm_ready``; docs/fp8.md, "The GEMM").

``quantize_rows`` is one pass over its input: each program owns whole rows, finds their absolute
maximum and writes codes and scales; it may apply a GELU (or a GEGLU's ``a · gelu(g)``) first, so
the feed-forward's activation and the quantization of the second GEMM's input are one kernel.
ops/layer_norm.py's modulated LayerNorm has an FP8 output of the same form (``row_quantize`` below).

A quantized tensor can travel with the tensor it came from (``attach_quantized``): a producer
that writes both (the modulated LayerNorm) or the first projection that quantized an input leaves
the codes on it, and the next projections of the same input (attention's q, k, v) read them instead
of quantizing again; an in-place change of the input (its version counter) drops them. Tensors made
under torch.inference_mode have no version counter and carry none (each projection quantizes).

FP8 tensor cores need sm_89 or later; the interpreter runs the same kernels on the CPU. Elsewhere
(and for inputs autograd tracks) the ops run the reference's fp32 math of the same quantization.
"""

from __future__ import annotations

import contextlib
import math

import torch
import triton
import triton.language as tl

from sd_kernels import profiles, reference
from sd_kernels.ops.gelu import _act
from sd_kernels.ops.layout import vectors
from sd_kernels.ops.tiles import grouped_tile
from sd_kernels.runtime.dispatch import interpreting, tensor_reason, use_kernel
from sd_kernels.runtime.launch import Launcher, cdiv, device_properties, next_pow2

E4M3 = torch.float8_e4m3fn
E4M3_MAX = reference.E4M3_MAX
_E4M3_MAX = tl.constexpr(448.0)
FP8_CAPABILITY = (8, 9)  # Ada and Hopper have FP8 tensor cores
_ELEMS = 16384  # the widest row the quantizer holds in one program (FLUX's widest, 15,360); wider: two passes
_ROW_ELEMS = 2048  # narrower rows are batched up to this many (padded) elements a program


@triton.jit
def _activate(x, ACT: tl.constexpr):
    """``x`` (fp32) through the activation: "" none, "tanh" / "none" the GELUs of ops/gelu.py."""
    if ACT == "":
        return x
    else:
        return _act(x, ACT)


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
def _codes(v, inv, GRID: tl.constexpr):
    """e4m3(v · inv). On the GPU the cast saturates (cvt.rn.satfinite: |v · inv| ≤ 448 up to the
    product's rounding, which the cast rounds back to 448), so it needs no clamp; the interpreter's
    cast does not, so there the value is clamped and rounded first (GRID)."""
    if GRID:
        return _e4m3(tl.minimum(tl.maximum(v * inv[:, None], -_E4M3_MAX), _E4M3_MAX), GRID)
    return (v * inv[:, None]).to(tl.float8e4nv)


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


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
def _inverse(amax):
    # IEEE division (div_rn), as torch divides: Triton's ``/`` on fp32 is the approximate one, whose
    # last-bit differences move a code across a rounding boundary now and then
    safe = tl.where(amax > 0, amax, 1.0)
    return tl.where(amax > 0, tl.math.div_rn(tl.full(safe.shape, _E4M3_MAX, tl.float32), safe), 0.0)


@triton.jit
def row_quantize(v, amax, q_ptrs, s_ptrs, mask, row_mask, GRID: tl.constexpr):
    """Store e4m3(v · 448 / amax) to ``q_ptrs`` and amax / 448 to ``s_ptrs``: v [ROWS, C] fp32 and its
    rows' absolute maxima amax [ROWS]; a zero row gets codes 0 and scale 0."""
    tl.store(q_ptrs, _codes(v, _inverse(amax), GRID), mask=mask)
    tl.store(s_ptrs, amax / _E4M3_MAX, mask=row_mask)


@triton.jit
def _act_values(x_ptrs, mask, gate_step, ACT: tl.constexpr, GATED: tl.constexpr):
    """act(x) at ``x_ptrs`` (gated: a · act(g), g ``gate_step`` elements after a), fp32, 0 where masked."""
    if GATED:
        a = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
        return a * _activate(tl.load(x_ptrs + gate_step, mask=mask, other=0.0).to(tl.float32), ACT)
    return _activate(tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32), ACT)


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
def _piece(x_rows, p_rows, row_mask, n_x, n_prefix, stride_xc, stride_pc, START: tl.constexpr,
           WIDTH: tl.constexpr, PREFIX: tl.constexpr, ACT: tl.constexpr, GATED: tl.constexpr):
    """Columns [START, START + WIDTH) of one part of the row (the prefix, as it is, or act(x)):
    (values [ROWS, WIDTH] fp32, 0 past the part's end; their mask; their columns in the output)."""
    cols = START + tl.arange(0, WIDTH)[None, :]
    if PREFIX:
        mask = row_mask[:, None] & (cols < n_prefix)
        return tl.load(p_rows + cols * stride_pc, mask=mask, other=0.0).to(tl.float32), mask, cols
    mask = row_mask[:, None] & (cols < n_x)
    return _act_values(x_rows + cols * stride_xc, mask, n_x * stride_xc, ACT, GATED), mask, n_prefix + cols


@triton.jit
def _store_piece(v, mask, cols, inv, q_rows, GRID: tl.constexpr):
    tl.store(q_rows + cols, _codes(v, inv, GRID), mask=mask)


@triton.jit(do_not_specialize=["n_rows"])
def _quantize_kernel(x_ptr, p_ptr, q_ptr, s_ptr, n_rows, n_cols, n_prefix, stride_xr, stride_xc, stride_pr,
                     stride_pc, ACT: tl.constexpr, GATED: tl.constexpr, HAS_PREFIX: tl.constexpr, GRID: tl.constexpr,
                     ROWS: tl.constexpr, BLOCK_C: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr,
                     W2: tl.constexpr, W3: tl.constexpr, NP: tl.constexpr):
    """Rows [pid·ROWS, (pid + 1)·ROWS) of q [n_rows, n_cols] (contiguous) and s [n_rows]; with a prefix,
    q's first n_prefix columns come from it.

    A row that fits one program (W0 > 0) is held in registers as up to four power-of-two pieces,
    each part's (the prefix's, then act(x)'s) columns split as the largest power of two below its width
    and the rest (12,288 = 8,192 + 4,096): no lanes padded to the next power of two compute a GELU for
    nothing. Pieces [0, NP) are the prefix's, the others x's. A wider row (W0 = 0) is read twice in
    chunks of BLOCK_C: its maximum first, then the codes (from L2: a row is at most 64 KB)."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < n_rows
    x_rows = x_ptr + rows[:, None] * stride_xr
    p_rows = p_ptr + rows[:, None] * stride_pr
    q_rows = q_ptr + rows[:, None] * n_cols
    if W0 > 0:
        n_x = n_cols - n_prefix
        v0, m0, c0 = _piece(x_rows, p_rows, row_mask, n_x, n_prefix, stride_xc, stride_pc, 0, W0, NP > 0, ACT, GATED)
        amax = row_amax(v0, m0, GRID)
        if W1 > 0:
            v1, m1, c1 = _piece(x_rows, p_rows, row_mask, n_x, n_prefix, stride_xc, stride_pc, W0 if NP != 1 else 0,
                                W1, NP > 1, ACT, GATED)
            amax = _max_nan(amax, row_amax(v1, m1, GRID))
        if W2 > 0:
            v2, m2, c2 = _piece(x_rows, p_rows, row_mask, n_x, n_prefix, stride_xc, stride_pc,
                                0 if NP == 2 else (W1 if NP == 1 else W0 + W1), W2, NP > 2, ACT, GATED)
            amax = _max_nan(amax, row_amax(v2, m2, GRID))
        if W3 > 0:
            v3, m3, c3 = _piece(x_rows, p_rows, row_mask, n_x, n_prefix, stride_xc, stride_pc,
                                W2 if NP == 2 else 0, W3, False, ACT, GATED)
            amax = _max_nan(amax, row_amax(v3, m3, GRID))
        inv = _inverse(amax)
        _store_piece(v0, m0, c0, inv, q_rows, GRID)
        if W1 > 0:
            _store_piece(v1, m1, c1, inv, q_rows, GRID)
        if W2 > 0:
            _store_piece(v2, m2, c2, inv, q_rows, GRID)
        if W3 > 0:
            _store_piece(v3, m3, c3, inv, q_rows, GRID)
        tl.store(s_ptr + rows, amax / _E4M3_MAX, mask=row_mask)
    else:
        cols = tl.arange(0, BLOCK_C)
        amax = tl.zeros((ROWS,), dtype=tl.float32)
        for c in range(0, n_cols, BLOCK_C):
            mask = row_mask[:, None] & (c + cols[None, :] < n_cols)
            v = _row_values(x_rows, p_rows, c + cols[None, :], mask, stride_xc, stride_pc, n_cols, n_prefix, ACT,
                            GATED, HAS_PREFIX)
            amax = _max_nan(amax, row_amax(v, mask, GRID))
        inv = _inverse(amax)
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


def quantize_blocks(n_rows: int, n_cols: int, elems: int = _ELEMS) -> tuple[int, int, int]:
    """(ROWS, BLOCK_C, num_warps). A row that fits ``elems`` (padded to a power of two) is one program's
    (BLOCK_C = 0: held as row_pieces), rows under _ROW_ELEMS batched up to it; a wider row is read in
    chunks of ``elems``. A warp per 2,048 (padded) elements of the program, 2 to 8: small programs, several
    resident on an SM, so that one's loads run under another's reduction and stores (measured:
    docs/kernels/fp8_linear.md)."""
    width = next_pow2(n_cols)
    if width > elems:
        return 1, elems, min(8, max(2, elems // 2048))
    rows = max(1, min(_ROW_ELEMS // width, next_pow2(n_rows)))
    return rows, 0, min(8, max(2, rows * width // 2048))


def _rows_view(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, last] with any row and column stride; a copy only where no view exists. The rows
    counted, not -1: a last dimension of 0 (an empty prefix) leaves -1 undetermined."""
    shape = (math.prod(x.shape[:-1]), x.shape[-1])
    try:
        return x.view(shape)
    except RuntimeError:
        return x.reshape(shape)


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
    x2 = _rows_view(x)
    p2 = x2 if prefix is None else _rows_view(prefix)
    n_prefix = 0 if prefix is None else p2.shape[1]
    n_rows, n = x2.shape[0], x2.shape[1] // (2 if gated else 1) + n_prefix
    q = torch.empty((*x.shape[:-1], n), dtype=E4M3, device=x.device)
    s = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    if q.numel() == 0:
        return q, s.zero_()
    rows, block_c, warps = quantize_blocks(n_rows, n)
    (w0, w1, w2, w3), n_p = row_pieces(n_prefix, n - n_prefix) if block_c == 0 else ((0, 0, 0, 0), 0)
    grid, has_prefix = interpreting(), prefix is not None
    _QUANTIZE((act, gated, has_prefix, grid, rows, block_c, w0, w1, w2, w3, n_p, warps), (cdiv(n_rows, rows),), x2,
              p2, q, s, n_rows, n, n_prefix, x2.stride(0), x2.stride(1), p2.stride(0), p2.stride(1), ACT=act,
              GATED=gated, HAS_PREFIX=has_prefix, GRID=grid, ROWS=rows, BLOCK_C=block_c, W0=w0, W1=w1, W2=w2, W3=w3,
              NP=n_p, num_warps=warps)
    return q, s


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [N, K] as (e4m3 codes [N, K] contiguous, one fp32 scale per output channel [N]): the
    reference's math, run once at patch time (torch ops: exact on any device)."""
    if weight.dim() != 2:
        raise ValueError(f"quantize_weight needs a 2-D weight [N, K], got shape {tuple(weight.shape)}")
    q, s = reference.fp8_quantize_rows(weight.detach())
    return q.contiguous(), s.contiguous()


# ---------------------------------------------------------------------------------------------
# The scaled GEMM with its epilogue


def _config(m: int, n: int, k: int, warps: int, stages: int, **extra) -> triton.Config:
    return triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 8, **extra}, num_warps=warps,
                         num_stages=stages)


# Hopper: one warpgroup pair (8 warps) on a 128-row tile, K in steps of 128 (128 bytes of e4m3: one
# swizzled shared-memory row), 3-4 stages of A and B in flight (128×128 + 256×128 bytes a stage).
# Smaller tiles serve the few-row GEMMs (adaLN modulation: one row per sample).
CONFIGS = [_config(128, 256, 128, 8, 3), _config(128, 128, 128, 8, 4), _config(128, 128, 128, 4, 4),
           _config(64, 128, 128, 4, 4), _config(64, 64, 128, 4, 4)]
# The TMA kernel's, best first at the DiTs' shapes (H200, bench/results/2026-11-29-h200-fp8-gemm-tma):
# persistent programs (one per SM) walking the tiles with the next tile's loads issued under this one's
# epilogue (FLATTEN), then one tile per program.
TMA_CONFIGS = [_config(128, 256, 128, 8, 3, PERSISTENT=True, FLATTEN=True),
               _config(128, 256, 128, 8, 3, PERSISTENT=True, FLATTEN=False),
               _config(128, 256, 128, 8, 3, PERSISTENT=False, FLATTEN=False),
               _config(128, 128, 128, 8, 4, PERSISTENT=False, FLATTEN=False),
               _config(128, 128, 128, 8, 4, PERSISTENT=True, FLATTEN=True),
               _config(64, 128, 128, 4, 4, PERSISTENT=False, FLATTEN=False),
               _config(64, 64, 128, 4, 4, PERSISTENT=False, FLATTEN=False)]


def _by_rows(configs, named_args, **kwargs):
    """Few rows first try the small tiles (an untimed key takes the first config kept)."""
    if named_args["M"] <= 64:
        return [c for c in configs if c.kwargs["BLOCK_M"] == 64]
    return configs


_GEMM_KEY = ["M", "N", "K", "HAS_BIAS", "ACT", "HAS_GATE", "HAS_RES"]


def _gemm_autotune(configs, interpreted):
    if interpreting():  # every config would run through the interpreter: one, small enough that the tests'
        # odd shapes (77 × 50 × 37) take two row tiles and two K steps, large enough that the tiny
        # pipelines' GEMMs are few programs (32 × 32 tiles made the FP8 pipeline tests 3x slower)
        return triton.autotune([interpreted], key=_GEMM_KEY)
    return triton.autotune(configs, key=_GEMM_KEY, prune_configs_by={"early_config_prune": _by_rows})


@triton.jit
def _epilogue(acc, offs_m, offs_n, M, N, T, sa_ptr, sw_ptr, b_ptr, g_ptr, r_ptr, y_ptr, stride_gb, stride_gn,
              stride_rm, stride_rn, stride_ym, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, HAS_GATE: tl.constexpr,
              HAS_RES: tl.constexpr):
    """Store the tile (offs_m, offs_n) of y from its fp32 accumulator: the scales, then bias, act, gate
    (sample of row m: m // T) and residual. Edge rows and columns read wrapped (% M, % N) and are not
    stored."""
    rows = (offs_m % M).to(tl.int64)
    cols = (offs_n % N).to(tl.int64)
    y = acc * tl.load(sa_ptr + rows)[:, None] * tl.load(sw_ptr + cols)[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + cols).to(tl.float32)[None, :]
    y = _activate(y, ACT)
    if HAS_GATE:
        y *= tl.load(g_ptr + (rows // T)[:, None] * stride_gb + cols[None, :] * stride_gn).to(tl.float32)
    if HAS_RES:
        y += tl.load(r_ptr + rows[:, None] * stride_rm + cols[None, :] * stride_rn).to(tl.float32)
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@_gemm_autotune(CONFIGS, _config(64, 64, 32, 4, 1))
@triton.jit
def _fp8_gemm_kernel(
    a_ptr, w_ptr, sa_ptr, sw_ptr, b_ptr, g_ptr, r_ptr, y_ptr, M, N, K, T,
    stride_am, stride_ak, stride_wn, stride_wk, stride_gb, stride_gn, stride_rm, stride_rn, stride_ym,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, HAS_GATE: tl.constexpr, HAS_RES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile of y [M, N] from a_q [M, K] and w_q [N, K] (e4m3, nn.Linear layout:
    each operand K-major, as FP8 wgmma reads both), loaded through pointers: any strides, any GPU with
    FP8 tensor cores."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Edge tiles wrap (% M, % N) instead of masking the loads; only the store is masked.
    rows = (offs_m % M).to(tl.int64)
    cols = (offs_n % N).to(tl.int64)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    w_ptrs = w_ptr + cols[None, :] * stride_wn + offs_k[:, None] * stride_wk  # [BLOCK_K, BLOCK_N] of w_qᵀ
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        w = tl.load(w_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        acc = tl.dot(a, w, acc)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk
    _epilogue(acc, offs_m, offs_n, M, N, T, sa_ptr, sw_ptr, b_ptr, g_ptr, r_ptr, y_ptr, stride_gb, stride_gn,
              stride_rm, stride_rn, stride_ym, HAS_BIAS, ACT, HAS_GATE, HAS_RES)


@_gemm_autotune(TMA_CONFIGS, _config(64, 64, 32, 4, 1, PERSISTENT=True, FLATTEN=True))
@triton.jit
def _fp8_gemm_tma_kernel(
    a_ptr, w_ptr, sa_ptr, sw_ptr, b_ptr, g_ptr, r_ptr, y_ptr, M, N, K, T,
    stride_am, stride_wn, stride_gb, stride_gn, stride_rm, stride_rn, stride_ym,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, HAS_GATE: tl.constexpr, HAS_RES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PERSISTENT: tl.constexpr, FLATTEN: tl.constexpr,
):
    """The same tiles with both operands read by the Tensor Memory Accelerator (Hopper and later; rows
    16-byte aligned, unit column stride): the TMA unit fills the pipeline's shared-memory stages,
    zero-filling past M, N and K, so no thread computes an address or a mask in the K loop. Persistent
    programs (``PERSISTENT``: the grid is one program per SM) each take every grid-th tile;
    ``FLATTEN`` lets the software pipeliner run across tile boundaries, so the next tile's first loads
    are in flight during this tile's epilogue. The descriptors are made in the kernel (Triton's
    allocator gives each program the global memory they live in)."""
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[stride_am, 1], block_shape=[BLOCK_M, BLOCK_K])
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[stride_wn, 1], block_shape=[BLOCK_N, BLOCK_K])
    tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    k_steps = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), tiles, tl.num_programs(0), flatten=FLATTEN):
        pid_m, pid_n = grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(k_steps):
            a = a_desc.load([pid_m * BLOCK_M, k * BLOCK_K])
            w = w_desc.load([pid_n * BLOCK_N, k * BLOCK_K])
            acc = tl.dot(a, w.T, acc)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        _epilogue(acc, offs_m, offs_n, M, N, T, sa_ptr, sw_ptr, b_ptr, g_ptr, r_ptr, y_ptr, stride_gb, stride_gn,
                  stride_rm, stride_rn, stride_ym, HAS_BIAS, ACT, HAS_GATE, HAS_RES)


_GEMM = Launcher(_fp8_gemm_kernel)
_GEMM_TMA = Launcher(_fp8_gemm_tma_kernel)
TMA_CAPABILITY = (9, 0)  # the Tensor Memory Accelerator: Hopper and later
TMA_GEMM = True  # False: every GEMM on the pointer-load kernel (bench.fp8's fp8+pointer-gemm row compares the two)
try:  # the allocator the TMA kernel's descriptors need (Triton 3.6-3.9); a Triton without it: the pointer kernel
    from triton.runtime import _allocation
except ImportError:
    _allocation = None
OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _gate_2d(gate: torch.Tensor | None, m: int, n: int) -> tuple[torch.Tensor | None, int]:
    """A per-sample gate [B, N] or [B, 1, N] as [B, N], and the rows per sample (m // B)."""
    if gate is None:
        return None, 1
    ok = (gate.dim() == 2 or (gate.dim() == 3 and gate.shape[1] == 1)) and gate.shape[-1] == n
    if not ok or gate.shape[0] == 0 or m % gate.shape[0]:
        raise ValueError(f"gate must be [B, N] or [B, 1, N] with N = {n} and B dividing the {m} rows, "
                         f"got shape {tuple(gate.shape)}")
    g2 = gate if gate.dim() == 2 else gate.select(1, 0)
    return g2, m // gate.shape[0]


def _check_gemm(a_q, s_a, w_q, s_w, bias, residual, out_shape, out_dtype) -> None:
    if a_q.dtype != E4M3 or w_q.dtype != E4M3:
        raise TypeError(f"fp8_gemm takes float8_e4m3fn operands, got {a_q.dtype} and {w_q.dtype}")
    if w_q.dim() != 2 or a_q.dim() == 0 or a_q.shape[-1] != w_q.shape[1]:
        raise ValueError(f"fp8_gemm: a_q [..., K] and w_q [N, K] do not match: {tuple(a_q.shape)} and "
                         f"{tuple(w_q.shape)}")
    if tuple(s_a.shape) != tuple(a_q.shape[:-1]) or tuple(s_w.shape) != (w_q.shape[0],):
        raise ValueError(f"fp8_gemm: scales must be [...] per row of a_q and [N] per row of w_q, got "
                         f"{tuple(s_a.shape)} and {tuple(s_w.shape)}")
    if bias is not None and tuple(bias.shape) != (w_q.shape[0],):
        raise ValueError(f"fp8_gemm: bias must have shape ({w_q.shape[0]},), got {tuple(bias.shape)}")
    if residual is not None and tuple(residual.shape) != tuple(out_shape):
        raise ValueError(f"fp8_gemm: residual must have the output's shape {tuple(out_shape)}, "
                         f"got {tuple(residual.shape)}")
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"fp8_gemm: out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")


def _capability_at_least(device: torch.device, capability: tuple[int, int]) -> bool:
    """Whether the CUDA ``device`` has compute capability ``capability`` or later (its properties cached:
    this runs at every GEMM call)."""
    props = device_properties(device.index)
    return (props.major, props.minor) >= capability


def _tma_ready(a2: torch.Tensor, w_q: torch.Tensor) -> bool:
    """Whether the TMA kernel can read both operands: Hopper or later (or the interpreter), unit column
    strides, rows and bases 16-byte aligned (e4m3: a row stride that is a multiple of 16), and rows that
    do not overlap (an expanded operand's row stride 0 is left to the pointer kernel)."""
    if not TMA_GEMM or _allocation is None or not (interpreting() or _capability_at_least(a2.device, TMA_CAPABILITY)):
        return False
    return all(t.stride(1) == 1 and t.stride(0) % 16 == 0 and t.data_ptr() % 16 == 0
               and (t.shape[0] == 1 or t.stride(0) >= t.shape[1]) for t in (a2, w_q))


_CHOICE: dict[tuple, bool] = {}  # (key, device) -> whether the TMA kernel serves it (_tma_chosen)


TIMED_ROWS = 64  # GEMMs of fewer rows (less than one tile) take the TMA kernel whatever the tables time


def _tma_chosen(key: tuple, device: torch.device) -> bool:
    """Whether a GEMM the TMA kernel can read launches it: yes, unless both kernels' tables hold timings
    for this key on this device and the pointer kernel's best config was the faster there (it wins most
    gated down-projections and the text streams' GEMMs of a few hundred rows:
    bench/results/2026-11-29-h200-fp8-gemm-tma). Below ``TIMED_ROWS`` rows (adaLN modulation) the TMA
    kernel serves whatever the tables say: their timings, of one weight in a flushed L2, had the two even
    or the pointer kernel faster, but timed over distinct weights read from HBM, as a step reads them, the
    TMA kernel streamed 2.46 and 1.90 TB/s at FLUX's two one-row shapes and the pointer kernel 1.39 and
    1.15 (bench/results/2026-11-29-h200-fp8-fused-qkv). Decided once a key and device; a key tuned in this
    process (SD_KERNELS_AUTOTUNE=1) has only the TMA kernel's timing, so it stays on the TMA kernel."""
    chosen = _CHOICE.get((key, device))
    if chosen is None:
        tma, pointer = _GEMM_TMA.tuned_ms(key, device), _GEMM.tuned_ms(key, device)
        chosen = key[0] < TIMED_ROWS or tma is None or pointer is None or tma <= pointer
        _CHOICE[(key, device)] = chosen
    return chosen


# torch's row-wise scaled GEMM (``torch._scaled_mm``) serves the GEMMs whose epilogue it can make, where it
# measured faster than ours in a step: bench/results/2026-11-29-h200-fp8-torch-gemm, docs/fp8.md "The GEMM".
TORCH_GEMM = True  # False: every GEMM on our Triton kernels (bench.fp8's fp8+triton-gemm row compares the two),
# whatever the profile's fp8_torch_gemm says
TORCH_GEMM_CAPABILITY = (9, 0)  # row-wise scaling in torch._scaled_mm needs Hopper or later (and the profile)
TORCH_GEMM_ROWS = 64  # fewer rows (adaLN modulation) stay on the TMA kernel (_tma_chosen)
# also a DiT block's gate and residual, added by one torch.addcmul after the GEMM: 0.7-0.9 ms less GEMM time
# a FLUX step than our fused epilogue, the image 0.5-0.8% faster (within the runs' spread), its error per
# GEMM 2.7e-3 against 2.4e-3 (bf16)
TORCH_GEMM_GATED = True
# bf16 only: in fp16 (SD3) it made no measurable difference to the step (32.4 against 32.3 ms)
TORCH_GEMM_DTYPES = (torch.bfloat16,)


def _torch_gemm_ready(a2: torch.Tensor, sa: torch.Tensor, w_q: torch.Tensor, s_w: torch.Tensor, bias, act: str,
                      gated: bool, out_dtype) -> bool:
    """Whether ``torch._scaled_mm`` serves this GEMM: where ``_torch_gemm_device`` says (a profile that sets
    ``fp8_torch_gemm``, a GPU of ``TORCH_GEMM_CAPABILITY`` or later, not the interpreter), at least
    ``TORCH_GEMM_ROWS`` rows, an output dtype of ``TORCH_GEMM_DTYPES`` with a bias of that dtype or none,
    no activation (a gate and residual with ``TORCH_GEMM_GATED``), both operands contiguous with dimensions
    that are multiples of 16, fp32 scales, and operands, scales and bias at 16-byte aligned addresses (what
    cuBLASLt requires: a scale vector 4 bytes off raised CUBLAS_STATUS_NOT_SUPPORTED on an H200)."""
    if (not TORCH_GEMM or act or (gated and not TORCH_GEMM_GATED) or out_dtype not in TORCH_GEMM_DTYPES
            or a2.shape[0] < TORCH_GEMM_ROWS or (bias is not None and bias.dtype != out_dtype)
            or not _torch_gemm_device(a2.device)):
        return False
    return (a2.shape[1] % 16 == 0 and w_q.shape[0] % 16 == 0 and a2.is_contiguous() and w_q.is_contiguous()
            and s_w.dtype == torch.float32  # sa: always fp32 (fp8_gemm makes it so)
            and all(t.data_ptr() % 16 == 0 for t in (a2, sa, w_q, s_w, bias) if t is not None))


def _torch_gemm_device(device: torch.device) -> bool:
    """A CUDA device of ``TORCH_GEMM_CAPABILITY`` or later, outside the interpreter (which runs our kernels),
    where the active profile sets ``fp8_torch_gemm`` (``hopper``: measured there; a profile decides it as
    ``gelu_epilogue`` decides cuBLASLt's GELU epilogue)."""
    return (device.type == "cuda" and not interpreting() and profiles.active_profile().fp8_torch_gemm
            and _capability_at_least(device, TORCH_GEMM_CAPABILITY))


def _torch_gemm(a2, sa, w_q, s_w, bias, g2, tokens: int, residual, out_shape, out_dtype) -> torch.Tensor:
    """The GEMM on ``torch._scaled_mm`` with fast accumulation (the tensor cores' FP8 accumulation, as ours
    runs it), the bias in its epilogue; a gate and residual after it in one pass (``addcmul``, or ``mul`` /
    ``add`` with only one of them), computed in fp32 and written into a new contiguous ``out_dtype`` tensor
    as the kernels' output is, whatever the gate's and residual's dtypes and strides (the GEMM's output is
    rounded once more than in our fused epilogue)."""
    y = torch._scaled_mm(a2, w_q.t(), scale_a=sa.view(-1, 1), scale_b=s_w.view(1, -1), bias=bias,
                         out_dtype=out_dtype, use_fast_accum=True)
    if g2 is None and residual is None:
        return y.view(out_shape)
    n = y.shape[1]
    out = torch.empty(out_shape, dtype=out_dtype, device=y.device)
    o3, y3 = out.view(-1, tokens, n), y.view(-1, tokens, n)
    if g2 is None:
        torch.add(residual.reshape(-1, tokens, n), y3, out=o3)
    elif residual is None:
        torch.mul(g2.reshape(-1, 1, n), y3, out=o3)
    else:
        torch.addcmul(residual.reshape(-1, tokens, n), g2.reshape(-1, 1, n), y3, out=o3)
    return out


def _programs(device: torch.device) -> int:
    """The persistent grid: one program per SM (one program under the interpreter, so that its tests walk
    every tile in the persistent loop)."""
    return device_properties(device.index).multi_processor_count if device.type == "cuda" else 1


@contextlib.contextmanager
def _scratch_allocator(device: torch.device):
    """Triton's allocator, around a launch of the TMA kernel: global memory for its descriptors (128
    bytes each, two a program) from torch's caching allocator on ``device`` (inside a CUDA graph
    capture: the graph's pool). A caller's own allocator is left in place; the caller's context is
    left as it was."""
    if not isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        yield
        return
    token = _allocation._allocator.set(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8,
                                                                                    device=device))
    try:
        yield
    finally:
        _allocation._allocator.reset(token)


def fp8_gemm(a_q: torch.Tensor, s_a: torch.Tensor, w_q: torch.Tensor, s_w: torch.Tensor,
             bias: torch.Tensor | None = None, act: str = "", gate: torch.Tensor | None = None,
             residual: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``reference.fp8_gemm``: a_q [..., K] (any strides), w_q [N, K] → [..., N], a new contiguous tensor
    in ``out_dtype``. On our kernels the epilogue (bias, act, gate, residual) is applied on the
    accumulator; where torch's ``_scaled_mm`` serves the call (``_torch_gemm_ready``), the bias in its
    epilogue and a gate and residual in one pass after it."""
    reference.check_fp8_activation(act)
    out_shape = (*a_q.shape[:-1], w_q.shape[0]) if a_q.dim() else ()
    _check_gemm(a_q, s_a, w_q, s_w, bias, residual, out_shape, out_dtype)
    m, n, k = s_a.numel(), w_q.shape[0], w_q.shape[1]
    g2, tokens = _gate_2d(gate, m, n)
    reason = fp8_reason(a_q, s_a, w_q, s_w, bias, gate, residual) or ("no input features (K = 0)" if k == 0 else None)
    if not use_kernel("fp8_linear", a_q, w_q, bias, gate, residual, unsupported=reason):
        return reference.fp8_gemm(a_q, s_a, w_q, s_w, bias, act, gate, residual, out_dtype)
    a2 = _rows_view(a_q)
    sa, s_w, bias = vectors(s_a.reshape(-1).float(), s_w, bias)
    if n and _torch_gemm_ready(a2, sa, w_q, s_w, bias, act, gate is not None or residual is not None, out_dtype):
        return _torch_gemm(a2, sa, w_q, s_w, bias, g2, tokens, residual, out_shape, out_dtype)
    y = torch.empty(out_shape, dtype=out_dtype, device=a_q.device)
    if y.numel() == 0:
        return y
    r2 = None if residual is None else _rows_view(residual)
    flags = dict(HAS_BIAS=bias is not None, ACT=act, HAS_GATE=gate is not None, HAS_RES=residual is not None)
    tiles = lambda meta: cdiv(m, meta["BLOCK_M"]) * cdiv(n, meta["BLOCK_N"])  # noqa: E731
    key = (m, n, k, *flags.values(), out_dtype)
    extras = (y if bias is None else bias, y if g2 is None else g2, y if r2 is None else r2, y, m, n, k, tokens)
    epilogue_strides = (*(g2.stride() if g2 is not None else (0, 0)), *(r2.stride() if r2 is not None else (0, 0)), n)
    if _tma_ready(a2, w_q) and _tma_chosen(key, y.device):
        programs = _programs(y.device)
        grid = lambda meta: (min(programs, tiles(meta)) if meta["PERSISTENT"] else tiles(meta),)  # noqa: E731
        with _scratch_allocator(y.device):
            _GEMM_TMA(key, grid, a2, w_q, sa, s_w, *extras, a2.stride(0), w_q.stride(0), *epilogue_strides, **flags)
    else:
        _GEMM(key, lambda meta: (tiles(meta),), a2, w_q, sa, s_w, *extras, a2.stride(0), a2.stride(1), w_q.stride(0),
              w_q.stride(1), *epilogue_strides, **flags)
    return y


# ---------------------------------------------------------------------------------------------
# A quantized input carried by the tensor it came from

_ATTACHED = "_sd_kernels_fp8"


def attach_quantized(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Let ``x`` carry its row quantization (q, s) for the projections that read it next; returns x.
    Not an inference tensor (made under torch.inference_mode): it has no version counter, so an
    in-place change of it could not be seen."""
    if not x.is_inference():
        setattr(x, _ATTACHED, (q, s, x._version))
    return x


def attached_quantization(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The (q, s) ``attach_quantized`` left on ``x``, unless x was changed in place since."""
    held = getattr(x, _ATTACHED, None)
    if held is None or held[2] != x._version:
        return None
    return held[0], held[1]


def fp8_linear(x: torch.Tensor, w_q: torch.Tensor, s_w: torch.Tensor, bias: torch.Tensor | None = None,
               act: str = "", gate: torch.Tensor | None = None, residual: torch.Tensor | None = None,
               reuse: bool = True) -> torch.Tensor:
    """``act(x · Wᵀ + bias) · gate + residual`` with x quantized per row (or its attached quantization,
    ``reuse``) and W given as ``quantize_weight``'s codes and scales; output in x's dtype."""
    if x.dim() == 0 or x.shape[-1] != w_q.shape[1]:
        raise RuntimeError(f"fp8_linear: x [..., {w_q.shape[1]}] expected, got shape {tuple(x.shape)}")
    if x.dtype not in OUT_DTYPES:
        raise TypeError(f"fp8_linear takes float16, bfloat16 or float32 input, got {x.dtype}")
    held = attached_quantization(x) if reuse else None
    if held is None:
        held = quantize_rows(x)
        if reuse and not torch.compiler.is_compiling():
            attach_quantized(x, *held)
    return fp8_gemm(held[0], held[1], w_q, s_w, bias, act, gate, residual, out_dtype=x.dtype)
