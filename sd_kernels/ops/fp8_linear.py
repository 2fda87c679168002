"""FP8 (E4M3) linear layers with one scale per row: the scaled GEMM and its epilogue.

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
``fp8_torch_gemm`` (``hopper``), bf16 and fp16 GEMMs of at least 64 rows whose epilogue is a bias (or a bias, gate
and residual, added after it in one pass: ops/residual.py's ``gated_add_into``) go to torch's row-wise
``torch._scaled_mm`` with fast accumulation, which measured faster in a step (``_torch_gemm_ready``;
docs/fp8.md, "The GEMM").

The activations' quantizer (``quantize_rows``, with a GELU or a prefix fused) is ops/fp8_quant.py's; its
public names are re-exported here.

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

import torch
import triton
import triton.language as tl

from sd_kernels import profiles, reference
from sd_kernels.ops import fp8_rows
from sd_kernels.ops.fp8_quant import (  # noqa: F401 (the quantizer's public names, re-exported)
    E4M3,
    E4M3_MAX,
    FP8_CAPABILITY,
    Segments,
    _activate,
    _rows_view,
    fp8_reason,
    quantize_rows,
    quantize_weight,
    segments,
)
from sd_kernels.ops.fp8_rows import RowTable
from sd_kernels.ops.layout import vectors
from sd_kernels.ops.residual import gated_add_into, gated_reason
from sd_kernels.ops.tiles import grouped_tile
from sd_kernels.runtime import blas
from sd_kernels.runtime.dispatch import interpreting, use_kernel
from sd_kernels.runtime.launch import Launcher, cdiv, device_properties

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
def _epilogue(acc, offs_m, offs_n, M, N, T, T_y, sa_ptr, sw_ptr, b_ptr, g_ptr, r_ptr, y_ptr, stride_gb, stride_gn,
              stride_rm, stride_rn, stride_yb, stride_ym, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
              HAS_GATE: tl.constexpr, HAS_RES: tl.constexpr, SEGMENTED: tl.constexpr):
    """Store the tile (offs_m, offs_n) of y from its fp32 accumulator: the scales, then bias, act, gate
    (sample of row m: m // T) and residual. ``SEGMENTED``: y's rows are in segments of T_y, stride_yb apart (a
    token slice of a batch: ``fp8_gemm``'s ``out``), else one stride_ym apart: the row division is compiled
    only where it is needed (in every tile's epilogue it cost the 128 × 256 tiles a fifth of their speed, H200).
    Edge rows and columns read wrapped (% M, % N) and are not stored."""
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
    if SEGMENTED:  # int32 division: M < 2³¹
        y_rows = (offs_m // T_y).to(tl.int64) * stride_yb + (offs_m % T_y).to(tl.int64) * stride_ym
    else:
        y_rows = offs_m.to(tl.int64) * stride_ym
    y_ptrs = y_ptr + y_rows[:, None] + offs_n[None, :]
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@_gemm_autotune(CONFIGS, _config(64, 64, 32, 4, 1))
@triton.jit
def _fp8_gemm_kernel(
    a_ptr, w_ptr, sa_ptr, sw_ptr, b_ptr, g_ptr, r_ptr, y_ptr, skip_ptr, M, N, K, T, T_y,
    stride_am, stride_ak, stride_wn, stride_wk, stride_gb, stride_gn, stride_rm, stride_rn, stride_yb, stride_ym,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, HAS_GATE: tl.constexpr, HAS_RES: tl.constexpr,
    SEGMENTED: tl.constexpr, HAS_SKIP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile of y [M, N] from a_q [M, K] and w_q [N, K] (e4m3, nn.Linear layout:
    each operand K-major, as FP8 wgmma reads both), loaded through pointers: any strides, any GPU with
    FP8 tensor cores. ``HAS_SKIP``: nothing at all where the int32 at skip_ptr is nonzero (y was served
    from a table of known rows: ops/fp8_rows.py)."""
    if HAS_SKIP:
        if tl.load(skip_ptr) != 0:
            return
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
    _epilogue(acc, offs_m, offs_n, M, N, T, T_y, sa_ptr, sw_ptr, b_ptr, g_ptr, r_ptr, y_ptr, stride_gb, stride_gn,
              stride_rm, stride_rn, stride_yb, stride_ym, HAS_BIAS, ACT, HAS_GATE, HAS_RES, SEGMENTED)


@_gemm_autotune(TMA_CONFIGS, _config(64, 64, 32, 4, 1, PERSISTENT=True, FLATTEN=True))
@triton.jit
def _fp8_gemm_tma_kernel(
    a_ptr, w_ptr, sa_ptr, sw_ptr, b_ptr, g_ptr, r_ptr, y_ptr, skip_ptr, M, N, K, T, T_y,
    stride_am, stride_wn, stride_gb, stride_gn, stride_rm, stride_rn, stride_yb, stride_ym,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, HAS_GATE: tl.constexpr, HAS_RES: tl.constexpr,
    SEGMENTED: tl.constexpr, HAS_SKIP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PERSISTENT: tl.constexpr, FLATTEN: tl.constexpr,
):
    """The same tiles with both operands read by the Tensor Memory Accelerator (Hopper and later; rows
    16-byte aligned, unit column stride): the TMA unit fills the pipeline's shared-memory stages,
    zero-filling past M, N and K, so no thread computes an address or a mask in the K loop. Persistent
    programs (``PERSISTENT``: the grid is one program per SM) each take every grid-th tile;
    ``FLATTEN`` lets the software pipeliner run across tile boundaries, so the next tile's first loads
    are in flight during this tile's epilogue. The descriptors are made in the kernel (Triton's
    allocator gives each program the global memory they live in). ``HAS_SKIP`` as in the pointer kernel."""
    if HAS_SKIP:
        if tl.load(skip_ptr) != 0:
            return
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
        _epilogue(acc, offs_m, offs_n, M, N, T, T_y, sa_ptr, sw_ptr, b_ptr, g_ptr, r_ptr, y_ptr, stride_gb,
                  stride_gn, stride_rm, stride_rn, stride_yb, stride_ym, HAS_BIAS, ACT, HAS_GATE, HAS_RES,
                  SEGMENTED)


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
# also a DiT block's gate and residual, added in one pass after the GEMM: 0.7-0.9 ms less GEMM time a FLUX step
# than our fused epilogue, the image 0.5-0.8% faster (within the runs' spread; measured with torch.addcmul as
# that pass), its error per GEMM 2.7e-3 against 2.4e-3 (bf16)
TORCH_GEMM_GATED = True
# fp16 too: SDXL's FP8 image 604.5 against 634.8 ms on our kernels (H200, 2026-11-30,
# bench/results/2026-11-30-h200-unet-fp8-geglu-scaled-mm); SD3's step measured even (32.4 against 32.3 ms, 2026-11-29)
TORCH_GEMM_DTYPES = (torch.bfloat16, torch.float16)
# cuBLASLt without a workspace for the GEMMs a CUDA graph captures (runtime/blas.py: no memset before each)
NO_CUBLASLT_WORKSPACE = True
# An ``out`` our kernels can write where it lies (a token slice of a batch: SD3's joined q, k and v), where torch's
# GEMM serves the shape: "samples" runs torch's GEMM once a segment of out's rows (a sample's, one contiguous
# block) into it, where each has at least TORCH_GEMM_SEGMENT_ROWS rows (else as "ours"); "ours": our kernel writes
# it; "copy": one torch GEMM into a new tensor, copied in (2.6 ms of copies an SD3-medium FP8 step, 1024² with
# guidance: the image 636.2 ms, against 604.6 with "samples" and 611.6 with "ours"; H200, 2026-11-30,
# bench/results/2026-11-30-h200-fp8-gemm-into).
TORCH_GEMM_INTO = "samples"
# Shorter samples (SD3's 333 text tokens) are written by our kernel, all samples in one launch, as
# joint_attention.PER_SAMPLE_ROWS keeps them from a GEMM a sample in the lossless patch; one torch GEMM and a copy
# for them was not measured.
TORCH_GEMM_SEGMENT_ROWS = 1024


def torch_gemm_shape_reason(rows: int, k: int, n: int, out_dtype: torch.dtype, act: str = "",
                            gated: bool = False) -> str | None:
    """Why ``torch._scaled_mm`` does not serve a GEMM of this shape and epilogue (None: it may, on a device and
    profile ``_torch_gemm_device`` accepts, with operands it can read): the rule's shape part, which the
    selection table of ``sd-kernels info`` shows too."""
    if not TORCH_GEMM:
        return "fp8_linear.TORCH_GEMM is off"
    if act:
        return f"a fused {act} GELU (our kernel's epilogue)"
    if gated and not TORCH_GEMM_GATED:
        return "a gate and residual (fp8_linear.TORCH_GEMM_GATED is off)"
    if out_dtype not in TORCH_GEMM_DTYPES:
        return f"{str(out_dtype).removeprefix('torch.')} output (TORCH_GEMM_DTYPES: bf16 and fp16)"
    if rows < TORCH_GEMM_ROWS:
        return f"{rows} rows < TORCH_GEMM_ROWS {TORCH_GEMM_ROWS}"
    if k % 16 or n % 16:
        return f"K {k} or N {n} not a multiple of 16"
    return None


def _torch_gemm_ready(a2: torch.Tensor, sa: torch.Tensor, w_q: torch.Tensor, s_w: torch.Tensor, bias, act: str,
                      gated: bool, out_dtype) -> bool:
    """Whether ``torch._scaled_mm`` serves this GEMM: where ``_torch_gemm_device`` says (a profile that sets
    ``fp8_torch_gemm``, a GPU of ``TORCH_GEMM_CAPABILITY`` or later, not the interpreter), a shape and epilogue
    ``torch_gemm_shape_reason`` accepts (at least ``TORCH_GEMM_ROWS`` rows, an output dtype of
    ``TORCH_GEMM_DTYPES``, no activation, dimensions that are multiples of 16), a bias of the output's dtype or
    none, both operands contiguous, fp32 scales, operands, scales and bias at 16-byte aligned addresses (what
    cuBLASLt requires: a scale vector 4 bytes off raised CUBLAS_STATUS_NOT_SUPPORTED on an H200), and an output
    dtype this torch's ``_scaled_mm`` writes (``_torch_gemm_takes``)."""
    if (torch_gemm_shape_reason(a2.shape[0], a2.shape[1], w_q.shape[0], out_dtype, act, gated) is not None
            or (bias is not None and bias.dtype != out_dtype) or not _torch_gemm_device(a2.device)):
        return False
    return (a2.is_contiguous() and w_q.is_contiguous() and s_w.dtype == torch.float32  # sa: fp32 (fp8_gemm's)
            and all(t.data_ptr() % 16 == 0 for t in (a2, sa, w_q, s_w, bias) if t is not None)
            and _torch_gemm_takes(a2.device, out_dtype))


_TORCH_GEMM_TAKES: dict[tuple, bool] = {}  # (device, dtype) -> whether this torch's _scaled_mm writes it (below)


def _torch_gemm_takes(device: torch.device, out_dtype: torch.dtype) -> bool:
    """Whether this torch's row-wise ``_scaled_mm`` writes ``out_dtype`` with a bias on ``device``: bf16 always;
    fp16 only in the releases that added it (earlier ones raise "Only bf16 high precision output types are
    supported for row-wise scaling"), so it is tried once per device on a 16 × 16 GEMM, outside a CUDA graph
    capture (during one, our kernels serve the call and nothing is tried)."""
    if out_dtype == torch.bfloat16:
        return True
    key = (device, out_dtype)
    if key not in _TORCH_GEMM_TAKES:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return False
        one = torch.ones(16, 1, device=device)
        codes = torch.zeros(16, 16, device=device).to(E4M3)
        try:
            torch._scaled_mm(codes, codes.t(), scale_a=one, scale_b=one.t(), out_dtype=out_dtype,
                             bias=torch.zeros(16, dtype=out_dtype, device=device), use_fast_accum=True)
            _TORCH_GEMM_TAKES[key] = True
        except RuntimeError:
            _TORCH_GEMM_TAKES[key] = False
    return _TORCH_GEMM_TAKES[key]


def _torch_gemm_device(device: torch.device) -> bool:
    """A CUDA device of ``TORCH_GEMM_CAPABILITY`` or later, outside the interpreter (which runs our kernels),
    where the active profile sets ``fp8_torch_gemm`` (``hopper``: measured there; a profile decides it as
    ``gelu_epilogue`` decides cuBLASLt's GELU epilogue)."""
    return (device.type == "cuda" and not interpreting() and profiles.active_profile().fp8_torch_gemm
            and _capability_at_least(device, TORCH_GEMM_CAPABILITY))


def _torch_gemm(a2, sa, w_q, s_w, bias, g2, tokens: int, residual, out_shape, out_dtype) -> torch.Tensor:
    """The GEMM on ``torch._scaled_mm`` with fast accumulation (the tensor cores' FP8 accumulation, as ours
    runs it), the bias in its epilogue; a gate and residual after it in one pass (ops/residual.py's
    ``gated_add_into``; torch's ``addcmul``, ``mul`` or ``add`` for inputs its kernel does not take), computed
    in fp32 and written into a new contiguous ``out_dtype`` tensor as the kernels' output is, whatever the
    gate's and residual's dtypes and strides (the GEMM's output is rounded once more than in our fused
    epilogue)."""
    with _workspace():
        y = _scaled_mm(a2, sa, w_q, s_w, bias, out_dtype)
    if g2 is None and residual is None:
        return y.view(out_shape)
    n = y.shape[1]
    out = torch.empty(out_shape, dtype=out_dtype, device=y.device)
    tokens = tokens if g2 is not None else max(y.shape[0], 1)  # no gate: the rows as one sample's tokens
    o3, y3 = out.view(-1, tokens, n), y.view(-1, tokens, n)
    r3 = None if residual is None else residual.reshape(-1, tokens, n)
    g3 = None if g2 is None else g2.reshape(-1, 1, n)
    if use_kernel("gated_add", r3, g3, y3, unsupported=gated_reason(r3, g3, y3)):
        gated_add_into(r3, g3, y3, o3)
    elif g3 is None:
        torch.add(r3, y3, out=o3)
    elif r3 is None:
        torch.mul(g3, y3, out=o3)
    else:
        torch.addcmul(r3, g3, y3, out=o3)
    return out


def _workspace():
    """The block torch's GEMMs run in: cuBLASLt without a workspace where ``NO_CUBLASLT_WORKSPACE``
    (runtime/blas.py)."""
    return blas.no_workspace() if NO_CUBLASLT_WORKSPACE else contextlib.nullcontext()


def _scaled_mm(a2, sa, w_q, s_w, bias, out_dtype, **out) -> torch.Tensor:
    """torch's row-wise scaled GEMM of the codes a2 [M, K] and w_q [N, K] with fast accumulation (the tensor cores'
    FP8 accumulation, as our kernels run it), the bias in its epilogue; into ``out=`` where given."""
    return torch._scaled_mm(a2, w_q.t(), scale_a=sa.view(-1, 1), scale_b=s_w.view(1, -1), bias=bias,
                            out_dtype=out_dtype, use_fast_accum=True, **out)


def _torch_gemm_into(a2, sa, w_q, s_w, bias, y_rows: Segments, out_dtype) -> bool:
    """torch's GEMM a segment of ``y_rows`` (``fp8_gemm``'s ``out``, which our kernels could write in place)
    into it, with the bias in its epilogue, where each segment is one contiguous block of at least
    ``TORCH_GEMM_SEGMENT_ROWS`` rows (any length where there is one segment) and every segment's output, input
    rows and row scales are 16-byte aligned (cuBLASLt's requirement); returns whether it ran. No gate or
    residual (the caller checks)."""
    seg = y_rows.seg
    outs = list(y_rows.base) if y_rows.base.dim() == 3 else [y_rows.base]  # ``segments``: [samples, seg, cols]
    if (y_rows.stride_c != 1 or y_rows.stride_r != y_rows.cols
            or (len(outs) > 1 and seg < TORCH_GEMM_SEGMENT_ROWS)):
        return False
    pieces = [(a2[i * seg:(i + 1) * seg], sa[i * seg:(i + 1) * seg], o) for i, o in enumerate(outs)]
    if not all(t.data_ptr() % 16 == 0 for piece in pieces for t in piece):
        return False
    with _workspace():
        for a, scale, o in pieces:
            _scaled_mm(a, scale, w_q, s_w, bias, out_dtype, out=o)
    return True


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


def _out_rows(out: torch.Tensor | None, out_shape: tuple, out_dtype: torch.dtype, device: torch.device,
              inputs: tuple) -> Segments | None:
    """``fp8_gemm``'s ``out`` checked against the output it takes (a ValueError otherwise, a RuntimeError for an
    ``out`` autograd would have to track), and its rows as the epilogue writes them (``segments``): None where
    the kernels cannot write it in place, so that the result is made apart and copied in (no out; rows no
    two-level stride reaches; rows ``_disjoint`` cannot show apart, columns not unit-strided among them; elements
    torch finds overlapping, a zero stride, which ``copy_`` then refuses as it refuses them anywhere; memory
    shared with an input, unless it is the residual itself, each element of which the tile that writes it has
    read)."""
    if out is None:
        return None
    if tuple(out.shape) != tuple(out_shape) or out.dtype != out_dtype or out.device != device:
        raise ValueError(f"fp8_gemm: out must be {tuple(out_shape)} {out_dtype} on {device}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    if out.requires_grad and torch.is_grad_enabled():
        raise RuntimeError("fp8_gemm: out= takes no tensor that requires grad (the op has no backward)")
    if not out.numel() or torch._debug_has_internal_overlap(out) == 1:  # 1: overlaps (2: torch cannot tell)
        return None
    storage = out.untyped_storage().data_ptr()
    residual, others = inputs[0], inputs[1:]
    same_as_residual = residual is not None and (residual.data_ptr(), residual.shape, residual.stride()) == (
        out.data_ptr(), out.shape, out.stride())
    for t in (residual, *others):
        if t is not None and t.untyped_storage().data_ptr() == storage and not (t is residual and same_as_residual):
            return None
    rows = segments(out)
    return rows if rows.base.data_ptr() == out.data_ptr() and _disjoint(rows) else None


def _disjoint(rows: Segments) -> bool:
    """Whether the epilogue writes each element of these rows at an address of its own: unit-strided columns,
    a row's start past the previous row's end within a segment, a segment's past the previous segment's end.
    (torch's own overlap check gives up on most slices of a batch, ``buffer[:, :n]`` among them.)"""
    within = rows.seg <= 1 or rows.stride_r >= rows.cols
    across = rows.rows <= rows.seg or rows.stride_s >= (rows.seg - 1) * rows.stride_r + rows.cols
    return rows.stride_c == 1 and within and across


def _written(out: torch.Tensor) -> torch.Tensor:
    """``out`` after a kernel wrote it: its version counter moved, as an in-place op moves it (a quantization
    attached to it, ``attach_quantized``, is stale from then on)."""
    if not out.is_inference():
        torch.autograd.graph.increment_version(out)
    return out


def fp8_gemm(a_q: torch.Tensor, s_a: torch.Tensor, w_q: torch.Tensor, s_w: torch.Tensor,
             bias: torch.Tensor | None = None, act: str = "", gate: torch.Tensor | None = None,
             residual: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
             out: torch.Tensor | None = None, skip: torch.Tensor | None = None) -> torch.Tensor:
    """``reference.fp8_gemm``: a_q [..., K] (any strides), w_q [N, K] → [..., N] in ``out_dtype``: a new
    contiguous tensor, or ``out`` (that shape and dtype, any strides; returned), which our kernels write where
    it lies, a token slice of a batch (``buffer[:, :n]``) included: SD3's joined q, k and v are written by
    their projections (patches/joint_attention.py). On our kernels the epilogue (bias, act, gate, residual)
    is applied on the accumulator; where torch's ``_scaled_mm`` serves the call (``_torch_gemm_ready``), the
    bias in its epilogue and a gate and residual in one pass after it; an ``out`` our kernels can write in place
    goes as ``TORCH_GEMM_INTO`` says (torch's GEMM a sample into it, or our kernel). ``skip`` (int32 [1] on the
    device, with ``out``): where it holds a nonzero value, ``out`` is left as it is (its rows were served from a
    table of known rows, ops/fp8_rows.py); our kernels read it on the device (a captured graph decides each
    replay)."""
    reference.check_fp8_activation(act)
    if skip is not None and out is None:
        raise ValueError("fp8_gemm: skip= needs out= (the output it leaves as it is)")
    out_shape = (*a_q.shape[:-1], w_q.shape[0]) if a_q.dim() else ()
    _check_gemm(a_q, s_a, w_q, s_w, bias, residual, out_shape, out_dtype)
    y_rows = _out_rows(out, out_shape, out_dtype, a_q.device, (residual, a_q, s_a, w_q, s_w, bias, gate))
    m, n, k = s_a.numel(), w_q.shape[0], w_q.shape[1]
    g2, tokens = _gate_2d(gate, m, n)
    reason = fp8_reason(a_q, s_a, w_q, s_w, bias, gate, residual) or ("no input features (K = 0)" if k == 0 else None)
    copied_in = lambda y: y if out is None else out.copy_(y)  # noqa: E731
    if not use_kernel("fp8_linear", a_q, w_q, bias, gate, residual, unsupported=reason):
        y = reference.fp8_gemm(a_q, s_a, w_q, s_w, bias, act, gate, residual, out_dtype)
        return copied_in(y if skip is None else torch.where(skip.to(out.device) != 0, out, y))
    a2 = _rows_view(a_q)
    sa, s_w, bias = vectors(s_a.reshape(-1).float(), s_w, bias)
    gated = gate is not None or residual is not None
    if n and skip is None and _torch_gemm_ready(a2, sa, w_q, s_w, bias, act, gated, out_dtype):
        if y_rows is None or TORCH_GEMM_INTO == "copy":
            return copied_in(_torch_gemm(a2, sa, w_q, s_w, bias, g2, tokens, residual, out_shape, out_dtype))
        into = not gated and TORCH_GEMM_INTO == "samples"
        if into and _torch_gemm_into(a2, sa, w_q, s_w, bias, y_rows, out_dtype):
            return _written(out)
    in_place = y_rows is not None  # else a new tensor, copied into out if there is one
    y = out if in_place else torch.empty(out_shape, dtype=out_dtype, device=a_q.device)
    if y.numel() == 0:
        return copied_in(y)
    y_rows = y_rows or segments(y)
    segmented = y_rows.seg < m  # not in the tables' key: a segmented call takes its shape's config
    r2 = None if residual is None else _rows_view(residual)
    flags = dict(HAS_BIAS=bias is not None, ACT=act, HAS_GATE=gate is not None, HAS_RES=residual is not None)
    tiles = lambda meta: cdiv(m, meta["BLOCK_M"]) * cdiv(n, meta["BLOCK_N"])  # noqa: E731
    key = (m, n, k, *flags.values(), out_dtype)
    tma = _tma_ready(a2, w_q) and _tma_chosen(key, y.device)
    launcher = _GEMM_TMA if tma else _GEMM
    skip = skip if in_place else None  # a result made apart: every row computed, then copied in
    # A key's first launch may time its configs, which a skip would void: it computes every row; then the skipping
    # kernel is compiled by a launch that skips (a CUDA graph capturing the next call must not compile it).
    first = skip is not None and not launcher.knows(key)
    y_ptr = y_rows.base
    epilogue_strides = (*(g2.stride() if g2 is not None else (0, 0)), *(r2.stride() if r2 is not None else (0, 0)),
                        y_rows.stride_s, y_rows.stride_r)
    programs = _programs(y.device)
    grid = lambda meta: (min(programs, tiles(meta)) if meta["PERSISTENT"] else tiles(meta),)  # noqa: E731
    for skip_t in ((None, torch.ones(1, dtype=torch.int32, device=y.device)) if first else (skip,)):
        extras = (y_ptr if bias is None else bias, y_ptr if g2 is None else g2, y_ptr if r2 is None else r2, y_ptr,
                  y_ptr if skip_t is None else skip_t, m, n, k, tokens, y_rows.seg)
        flags["HAS_SKIP"] = skip_t is not None
        if tma:
            with _scratch_allocator(y.device):
                _GEMM_TMA(key, grid, a2, w_q, sa, s_w, *extras, a2.stride(0), w_q.stride(0), *epilogue_strides,
                          SEGMENTED=segmented, **flags)
        else:
            _GEMM(key, lambda meta: (tiles(meta),), a2, w_q, sa, s_w, *extras, a2.stride(0), a2.stride(1),
                  w_q.stride(0), w_q.stride(1), *epilogue_strides, SEGMENTED=segmented, **flags)
    return _written(out) if in_place else copied_in(y)


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
               reuse: bool = True, out: torch.Tensor | None = None, table: RowTable | None = None) -> torch.Tensor:
    """``act(x · Wᵀ + bias) · gate + residual`` with x quantized per row (or its attached quantization,
    ``reuse``) and W given as ``quantize_weight``'s codes and scales; output in x's dtype (into ``out``, as
    ``fp8_gemm`` takes it). ``table`` (a ``RowTable`` of this layer's products, for a call with no ``out``):
    where it holds every row of x bit for bit, they are copied from it and the GEMM does nothing (decided on
    the device: ops/fp8_rows.py)."""
    if x.dim() == 0 or x.shape[-1] != w_q.shape[1]:
        raise RuntimeError(f"fp8_linear: x [..., {w_q.shape[1]}] expected, got shape {tuple(x.shape)}")
    if x.dtype not in OUT_DTYPES:
        raise TypeError(f"fp8_linear takes float16, bfloat16 or float32 input, got {x.dtype}")
    skip = None
    if table is not None and out is None and table.fits(x):
        if table.values.shape[1] != w_q.shape[0]:
            raise ValueError(f"fp8_linear: the table's products are {table.values.shape[1]} wide, the layer's "
                             f"{w_q.shape[0]}")
        out = torch.empty(x.shape[0], w_q.shape[0], dtype=x.dtype, device=x.device)
        skip = fp8_rows.serve(x, table, out)
    held = input_codes(x, reuse)
    return fp8_gemm(held[0], held[1], w_q, s_w, bias, act, gate, residual, out_dtype=x.dtype, out=out, skip=skip)


def input_codes(x: torch.Tensor, reuse: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """x's row quantization for a GEMM that reads it: the one x carries (``reuse``), else made now and, with
    ``reuse`` in eager, attached for the next projection of the same input."""
    held = attached_quantization(x) if reuse else None
    if held is None:
        held = quantize_rows(x)
        if reuse and not torch.compiler.is_compiling():
            attach_quantized(x, *held)
    return held
