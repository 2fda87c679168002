"""LayerNorm with adaLN modulation, and the gated residual before it: a DiT block's glue in one pass.

A DiT block (PixArt-Σ, SD3) normalizes its token stream x [B, T, D] over D without an affine of
its own (elementwise_affine=False, eps 1e-6) and modulates it per sample with vectors the timestep
embedding gives, scale and shift [B, D] (SD3's AdaLayerNormZero) or [B, 1, D] (PixArt's chunks of
its [B, 6, D] table):

    layer_norm_modulated:       y = LayerNorm(x)·(1 + scale) + shift
    gated_residual_layer_norm:  h = residual + gate·branch;  y = LayerNorm(h)·(1 + scale) + shift

where branch is the attention's (or the feed-forward's) output and gate its per-sample gate. Stock
PyTorch runs these as separate kernels, each reading and writing a [B, T, D] tensor: 3 passes for
the first (norm, ·(1 + scale), + shift), 5 for the second (gate·branch, + residual, then the three).
Here one program owns ROWS whole rows of D elements in registers: it reads x (or residual and
branch) once, writes y (and h) once. docs/kernels/layer_norm.md counts the bytes.

Numerics: everything in fp32, stored in the input's dtype. The statistics are two-pass over the
registers, mean then Σ(x − mean)², so a large mean against the spread costs nothing (no
E[x²] − E[x]²). The gated form rounds h to the dtype first and normalizes the rounded value: the
``normed`` it returns is exactly ``layer_norm_modulated(new_residual)``, what the stock block
normalizes, and the residual stream it carries on.

Layouts: x, residual and branch are read through their three strides (slices, a strided last dim);
modulation tensors through a batch and a feature stride (a chunk of [B, 6·D] or [B, 6, D], or a
batch of 1 broadcast with stride 0). Outputs are contiguous [B, T, D]. D is the whole row in one
register tile: up to ``_MAX_D``; wider rows, inputs of several dtypes, float64 and autograd inputs
take the reference (sd_kernels.reference, same names). patches/layer_norm.py routes PixArt's
ada_norm_single blocks through both.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from sd_kernels import reference
from sd_kernels.ops.fp8_quant import E4M3, fp8_reason, row_amax, row_quantize
from sd_kernels.ops.layout import vectors
from sd_kernels.runtime.dispatch import interpreting, tensor_reason, use_kernel
from sd_kernels.runtime.launch import Launcher, cdiv, next_pow2

_ELEMS = 2048  # elements per program: rows of small D (up to 1,024) are batched up to this
_INTERPRETED_ELEMS = 4096  # ... under the interpreter, whose cost is per program: fewer, larger programs
_MAX_D = 8192  # the widest row one program holds: 32 fp32 registers a thread per tensor at 8 warps
_ONE_WARP_MAX_D = 1280  # rows up to this wide: a warp per 2,048 elements of a program (``blocks``)
# The FP8 launches' program shapes (``blocks``' elems, warp_elems, min_warps) for rows up to ``_ONE_WARP_MAX_D`` wide
# ("narrow") and wider ("wide"). The row maximum and the codes make a program's chain longer than the values-only
# kernel's: narrow rows take two rows and two warps a program at SDXL's 1,280 (9.27 → 8.13 µs at 2×1024×1280, 14.0 →
# 14.9 at 2×4096×640; SDXL's FP8 norms 1.87 → 1.72 ms a step, its step 25.29 → 25.10 ms, H200, 2026-12-02,
# bench/results/2026-12-02-h200-fp8-norm-program-shapes/). Wide rows as the values-only launches: SD3's 1,536 was
# faster on one warp (29.7 → 28.2 µs), FLUX's 3,072 slower (30.0 → 31.0).
QUANT_BLOCKS = {"narrow": (2 * _ELEMS, 2048, 1), "wide": (_ELEMS, 1024, 4)}
_VALUES_BLOCKS = {"narrow": (_ELEMS, 2048, 1), "wide": (_ELEMS, 1024, 4)}  # the launches without codes (``blocks``)


@triton.jit
def _per_sample(ptr, sample, d, mask, stride_b, stride_d):
    """A modulation tensor's values [ROWS, BLOCK_D] for the rows' samples, as fp32."""
    return tl.load(ptr + sample[:, None] * stride_b + d[None, :] * stride_d, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _layer_norm_kernel(
    x_ptr, branch_ptr, gate_ptr, h_ptr, y_ptr, w_ptr, b_ptr, scale_ptr, shift_ptr, q_ptr, qs_ptr,
    n_rows, T, D, eps,
    stride_xb, stride_xt, stride_xd, stride_rb, stride_rt, stride_rd,
    stride_gb, stride_gd, stride_sb, stride_sd, stride_tb, stride_td,
    GATED: tl.constexpr, HAS_GATE: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_SCALE: tl.constexpr, HAS_SHIFT: tl.constexpr, QUANT: tl.constexpr, GRID: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_D: tl.constexpr, RMS: tl.constexpr = False, VALUES: tl.constexpr = True,
):
    """Rows [pid·ROWS, (pid + 1)·ROWS) of the [B·T, D] outputs.

    GATED: x is the residual; h = x + gate·branch is stored to h_ptr and normalized. Otherwise x
    is normalized. y = ((x − mean)·rstd·w + b)·(1 + scale) + shift; RMS: the mean is taken as 0 (T5's
    RMSNorm: y = x·w/√(mean(x²) + eps)). Outputs are contiguous. QUANT:
    y's fp32 rows are also stored as e4m3 codes (q_ptr) with one scale per row (qs_ptr), the input of
    an FP8 projection (ops/fp8_quant.py; GRID as there); VALUES False: y itself is not stored (its codes are
    all its reader takes).
    """
    # int64: row·D and sample·stride pass 2³¹ on large activations.
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < D
    mask = (rows < n_rows)[:, None] & d_mask[None, :]
    sample, token = rows // T, rows % T
    x_ptrs = x_ptr + (sample * stride_xb + token * stride_xt)[:, None] + d[None, :] * stride_xd
    x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    out = rows[:, None] * D + d[None, :]
    if GATED:
        r_ptrs = branch_ptr + (sample * stride_rb + token * stride_rt)[:, None] + d[None, :] * stride_rd
        branch = tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32)
        if HAS_GATE:
            branch = branch * _per_sample(gate_ptr, sample, d, mask, stride_gb, stride_gd)
        h = (x + branch).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + out, h, mask=mask)
        x = h.to(tl.float32)  # normalize what the residual stream carries on

    # IEEE divisions (``/`` is an approximate one on the GPU): a constant row's mean is then exact,
    # and so its normalized values are 0, not an ulp of the mean amplified by 1/√eps.
    if RMS:
        xc = x  # masked lanes loaded as 0
    else:
        mean = tl.math.div_rn(tl.sum(x, axis=1), D * 1.0)
        xc = tl.where(mask, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.math.div_rn(tl.sum(xc * xc, axis=1), D * 1.0) + eps)
    y = xc * rstd[:, None]
    if HAS_WEIGHT:
        y = y * tl.load(w_ptr + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        y = y + tl.load(b_ptr + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_SCALE:
        y = y * (1.0 + _per_sample(scale_ptr, sample, d, mask, stride_sb, stride_sd))
    if HAS_SHIFT:
        y = y + _per_sample(shift_ptr, sample, d, mask, stride_tb, stride_td)
    if VALUES:
        tl.store(y_ptr + out, y.to(y_ptr.dtype.element_ty), mask=mask)
    if QUANT:
        row_quantize(y, row_amax(y, mask, GRID), q_ptr + out, qs_ptr + rows, mask, rows < n_rows, GRID)


# Not autotuned: the Launcher is here for its direct launch path (sd_kernels.runtime.launch), keyed by
# the flags and blocks.
_LAYER_NORM = Launcher(_layer_norm_kernel)


def blocks(n_rows: int, d: int, elems: int | None = None, quant: bool = False) -> tuple[int, int, int]:
    """(ROWS, BLOCK_D, num_warps): the whole row padded to a power of two, rows up to ``elems``
    (``_ELEMS`` on a GPU) elements a program, and a warp per 1,024 of them (32 fp32 a thread, per tensor
    in flight), 4 to 16: small programs, many of them resident on an SM, so that one's loads run under
    another's reductions (docs/kernels/layer_norm.md, "Benchmark"). Rows of at most ``_ONE_WARP_MAX_D``
    features take a warp per 2,048 elements, down to one: measured faster at SD's 320 and 640, SDXL's and
    PixArt-Σ's widths (SD1.5's 256 rows of 1,280 0.2 µs slower), slower at SD3's 1,536 and FLUX's 3,072
    (docs/kernels/layer_norm.md, "The kernel"). ``quant``: a launch that writes FP8 codes, whose figures are
    ``QUANT_BLOCKS``'; ``elems`` given (the interpreter's) replaces the elements a program."""
    shapes = QUANT_BLOCKS if quant else _VALUES_BLOCKS
    own_elems, warp_elems, min_warps = shapes["narrow" if d <= _ONE_WARP_MAX_D else "wide"]
    block_d = next_pow2(d)
    rows = max(1, min((elems or own_elems) // block_d, next_pow2(n_rows)))
    return rows, block_d, min(16, max(min_warps, rows * block_d // warp_elems))


def _modulation(m: torch.Tensor | None) -> tuple[torch.Tensor | None, int, int]:
    """(tensor, batch stride, feature stride) of a [B, D] or [B, 1, D] modulation; stride 0 for a
    batch of 1 (broadcast) and for a missing one."""
    if m is None:
        return None, 0, 0
    m2 = m if m.dim() == 2 else m.select(1, 0)
    return m2, (m2.stride(0) if m2.shape[0] > 1 else 0), m2.stride(1)


def _kernel_reason(tensors: tuple[torch.Tensor | None, ...], d: int, one_dtype: bool = True) -> str | None:
    """Why the kernel cannot take these inputs, or None; ``one_dtype``: inputs of several dtypes refused
    (``rms_norm`` takes them: its output's dtype is T5's, not the inputs' promotion)."""
    reason = tensor_reason(*tensors)
    if reason is not None:
        return reason
    dtypes = sorted({str(t.dtype) for t in tensors if t is not None})
    if one_dtype and len(dtypes) > 1:
        return f"inputs of several dtypes {dtypes} (the kernel takes one)"
    if d > _MAX_D:
        return f"D = {d} is wider than one program's row tile ({_MAX_D})"
    return None


def _alloc(like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Every output of this module comes from here (tests poison it to catch unwritten elements)."""
    return torch.empty(like.shape, dtype=dtype or like.dtype, device=like.device)


def _launch(x, branch, gate, weight, bias, eps, scale, shift, quant: tuple | None = None, rms: bool = False,
            out_dtype: torch.dtype | None = None, values: bool = True):
    """y (and h when ``branch`` is given) for inputs that passed the checks and dispatch; with
    ``quant`` = (codes, row scales), y's FP8 quantization is written there too, and with ``values`` False
    only that: y is then ``unwritten``'s stand-in; ``rms``: no mean taken; y in ``out_dtype`` (default: x's)."""
    weight, bias = vectors(weight, bias)
    bsz, t, d = x.shape
    y = None if values or quant is None else unwritten(x, out_dtype or x.dtype)
    values = y is None
    y = _alloc(x, out_dtype) if values else y
    h = None if branch is None else _alloc(x)
    n_rows = bsz * t
    if y.numel() == 0:
        return y, h
    (g, sgb, sgd), (sc, ssb, ssd), (sh, stb, std) = map(_modulation, (gate, scale, shift))
    rows, block_d, num_warps = blocks(n_rows, d, _INTERPRETED_ELEMS if interpreting() else None, quant is not None)
    flags = dict(GATED=branch is not None, HAS_GATE=g is not None, HAS_WEIGHT=weight is not None,
                 HAS_BIAS=bias is not None, HAS_SCALE=sc is not None, HAS_SHIFT=sh is not None,
                 QUANT=quant is not None, GRID=quant is not None and interpreting(), RMS=rms, VALUES=values)
    key = (*flags.values(), rows, block_d, num_warps)
    r = x if branch is None else branch
    _LAYER_NORM(
        key, (cdiv(n_rows, rows),),
        x, r, x if g is None else g, y if h is None else h, y,
        x if weight is None else weight, x if bias is None else bias, x if sc is None else sc, x if sh is None else sh,
        *(quant or (y, y)), n_rows, t, d, float(eps),
        *x.stride(), *r.stride(), sgb, sgd, ssb, ssd, stb, std,
        **flags, ROWS=rows, BLOCK_D=block_d, num_warps=num_warps,
    )
    return y, h


def layer_norm_modulated(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-6,
    scale: torch.Tensor | None = None,
    shift: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.layer_norm(x, [D], weight, bias, eps) * (1 + scale) + shift`` in one kernel.

    x [B, T, D] with any strides; weight, bias [D] or None; scale, shift [B, D] or [B, 1, D] or None.
    Returns a contiguous [B, T, D] tensor in x's dtype.
    """
    reference.check_layer_norm_args("layer_norm_modulated", x, weight, bias, scale=scale, shift=shift)
    reason = _kernel_reason((x, weight, bias, scale, shift), x.shape[-1])
    if not use_kernel("layer_norm", x, weight, bias, scale, shift, unsupported=reason):
        return reference.layer_norm_modulated(x, weight, bias, eps, scale, shift)
    return _launch(x, None, None, weight, bias, eps, scale, shift)[0]


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """T5's LayerNorm, an RMSNorm: ``x·weight/√(mean(x²) + eps)`` over the last dim, in one kernel.

    x [B, T, D] with any strides; weight [D] or None, of x's dtype or another (a real T5 checkpoint in
    fp16 keeps its residual stream in fp32). Returns a contiguous [B, T, D] tensor in the dtype T5's
    own returns (``reference.rms_norm_dtype``: a half weight's), computed in fp32 and rounded once where
    T5's rounds the normalized x to the weight's dtype, then the product.
    """
    reference.check_layer_norm_args("rms_norm", x, weight, None)
    reason = _kernel_reason((x, weight), x.shape[-1], one_dtype=False)
    if not use_kernel("layer_norm", x, weight, unsupported=reason):  # the layer norm's kernel, in its RMS mode
        return reference.rms_norm(x, weight, eps)
    return _launch(x, None, None, weight, None, eps, None, None, rms=True,
                   out_dtype=reference.rms_norm_dtype(x, weight))[0]


def gated_residual_layer_norm(
    residual: torch.Tensor,
    branch: torch.Tensor,
    gate: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-6,
    scale: torch.Tensor | None = None,
    shift: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = residual + gate * branch`` (gate None: 1) and ``layer_norm_modulated(h, weight, bias, eps,
    scale, shift)``, in one kernel: residual and branch read once, (h, normed) written once each.

    residual, branch [B, T, D] with any strides; gate, scale, shift [B, D] or [B, 1, D] or None.
    Returns contiguous (new_residual, normed) in residual's dtype.
    """
    reference.check_gated_residual_args(residual, branch, gate, weight, bias, scale, shift)
    tensors = (residual, branch, gate, weight, bias, scale, shift)
    if not use_kernel("layer_norm", *tensors, unsupported=_kernel_reason(tensors, residual.shape[-1])):
        return reference.gated_residual_layer_norm(residual, branch, gate, weight, bias, eps, scale, shift)
    y, h = _launch(residual, branch, gate, weight, bias, eps, scale, shift)
    return h, y


def gated_residual_layer_norm_fp8(residual: torch.Tensor, branch: torch.Tensor, gate: torch.Tensor | None = None,
                                  weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                                  eps: float = 1e-6, scale: torch.Tensor | None = None,
                                  shift: torch.Tensor | None = None, values: bool = True) -> tuple[torch.Tensor, ...]:
    """``gated_residual_layer_norm`` that also quantizes the normed output for an FP8 projection, in the same
    kernel: (h, y, codes [B, T, D] e4m3, row scales [B, T] fp32), the codes those of
    ``reference.fp8_quantize_rows`` of y's fp32 values (a DiT block's norm2 before the FP8 tier's feed-forward).
    ``values`` False (the caller's reader takes the codes alone): the kernel does not write y, which is ``unwritten``'s
    NaN stand-in; the reference path (no kernel for the call) returns y as ever."""
    reference.check_gated_residual_args(residual, branch, gate, weight, bias, scale, shift)
    tensors = (residual, branch, gate, weight, bias, scale, shift)
    reason = _kernel_reason(tensors, residual.shape[-1]) or fp8_reason(*tensors)
    if not use_kernel("layer_norm", *tensors, unsupported=reason):
        h = reference.gated_residual(residual, branch, gate)
        return (h, *_modulated_fp8_reference(h, weight, bias, eps, scale, shift, tensors))
    y, h, q, s = _launch_fp8(residual, branch, gate, weight, bias, eps, scale, shift, values)
    return h, y, q, s


_NAN: dict[tuple, torch.Tensor] = {}


def unwritten(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """The stand-in for a normed output whose values were not written (``values=False``: its reader takes its FP8
    codes alone): x's shape, one NaN broadcast (kept per dtype and device), so that a reader of the values gets NaN,
    never stale memory, and a write into it fails (its elements share one address). None where it would be made
    inside a CUDA graph's capture (its fill would not have run): the values are written then."""
    key = (dtype, x.device)
    nan = _NAN.get(key)
    if nan is None and x.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    if nan is None:
        with torch.inference_mode(False):  # codes travel on a tensor with a version counter (attach_quantized)
            nan = _NAN[key] = torch.full((1,) * x.dim(), float("nan"), dtype=dtype, device=x.device)
    return nan.expand(x.shape)


def _launch_fp8(x, branch, gate, weight, bias, eps, scale, shift, values: bool = True) -> tuple:
    """``_launch`` with the FP8 output: (y, h or None, e4m3 codes of y, row scales; zero scales for no rows)."""
    q = torch.empty(x.shape, dtype=E4M3, device=x.device)
    s = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    y, h = _launch(x, branch, gate, weight, bias, eps, scale, shift, quant=(q, s), values=values)
    return y, h, q, s if y.numel() else s.zero_()


def _modulated_fp8_reference(x, weight, bias, eps, scale, shift, tensors) -> tuple[torch.Tensor, ...]:
    """(y, codes, row scales) of the modulated LayerNorm of x in fp32, as the kernels' FP8 outputs are made."""
    y32 = reference.layer_norm_modulated(*reference.upcast(x, weight, bias, dtype=torch.float32), eps,
                                         *reference.upcast(scale, shift, dtype=torch.float32))
    # the dtype torch's promotion gives, as the lossless op's reference (and the custom op's fake)
    dtype = functools.reduce(torch.promote_types, [t.dtype for t in tensors if t is not None])
    return (y32.to(dtype), *reference.fp8_quantize_rows(y32))


def layer_norm_modulated_fp8(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-6,
    scale: torch.Tensor | None = None,
    shift: torch.Tensor | None = None,
    values: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``layer_norm_modulated`` that also quantizes its output for an FP8 projection, in the same
    kernel: (y [B, T, D] in x's dtype, codes [B, T, D] e4m3, row scales [B, T] fp32), the codes those
    of ``reference.fp8_quantize_rows`` of y's fp32 values (before y's rounding to x's dtype). ``values`` False
    (the caller's readers take the codes alone): y is ``unwritten``'s NaN stand-in; the reference path (no
    kernel for the call) returns y as ever."""
    reference.check_layer_norm_args("layer_norm_modulated", x, weight, bias, scale=scale, shift=shift)
    tensors = (x, weight, bias, scale, shift)
    reason = _kernel_reason(tensors, x.shape[-1]) or fp8_reason(*tensors)
    if not use_kernel("layer_norm", *tensors, unsupported=reason):
        return _modulated_fp8_reference(x, weight, bias, eps, scale, shift, tensors)
    y, _, q, s = _launch_fp8(x, None, None, weight, bias, eps, scale, shift, values)
    return y, q, s
