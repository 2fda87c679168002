"""FP8 attention: softmax(q·kᵀ·scale)·v on 8-bit tensor-core dots, the opt-in lossy tier's attention.

The algorithm (``reference.attention_fp8`` computes it step by step; docs/kernels/attention_fp8.md
gives the error figures and the trade-offs):

- Q·Kᵀ in int8 (``qk="int8"``, default: SageAttention's choice; measured 1.4-3.5x more accurate
  than e4m3 at the same tensor-core rate on Hopper) or e4m3 (``qk="fp8"``). Below, "8-bit" is
  either: x·127/max or x·448/max, rounded.
- Q: per query row, 8-bit in the kernel's prologue (each program loads its Q tile once, so the
  quantization costs nothing in the loop); the row's scale max|row|/127 (448) goes into the score
  scale.
- K: smoothed, then per block of ``KEY_BLOCK`` keys. Smoothing subtracts K's per-channel mean over
  the keys: q·(k − k̄) = q·k − q·k̄ shifts every score of a query row by the same amount, which
  softmax ignores, and takes the channels' common offset out of the range the 8 bits must cover.
  The block's scale multiplies the block's scores (one scalar per key block). A pre-pass (two small
  kernels: per-channel sums, then the quantization) writes K in 8 bits, padded to whole key blocks
  with zeros; the sums come from the caller where it computed them as it wrote K (``KvStats``:
  FLUX's q/k norm + RoPE, ops/rope.py's ``qk_norm_rope_fp8``), and the first kernel does not run.
- Scores: the 8-bit dot (int32 or fp32 accumulation), times q_scale·k_scale·scale·log2(e); the
  online softmax in fp32 as ops/attention.py's flash kernel runs it (running max and sum, exp2).
- P·V, ``pv="fp8"`` (default): P = exp2(s − running max) ∈ [0, 1] times 448 rounded to e4m3, V per
  head-dim channel scaled to ±448 (max over the keys) and rounded to e4m3 by the pre-pass, written
  transposed ([D, S]: Hopper's e4m3 wgmma reads its B operand K-major); the output is
  acc·v_scale[d]/(448·l). ``pv="input"``: P in the input dtype and V as given (no V pre-pass), as
  the flash kernel does. The row sum l adds the unrounded probabilities.

Head dims 64 and 128 only (``HEAD_DIMS``: the DiTs' and SDXL's; PixArt's 72 and SD1.5's 40/80/160
are refused, not padded: the exact kernels take them). fp16/bf16 [..., S, D] inputs with any
strides, batch dims broadcast as ``flash_attention`` takes them; the output is in q's layout. No
attention mask, no autograd, no log-sum-exp output. Kernels run on GPUs with e4m3 tensor cores
(sm_89 and later) or in the interpreter; elsewhere the reference runs (``dispatch.use_kernel``).

Two kernels compute it: the Triton kernel below, everywhere, and on Hopper (sm_90, Triton 3.6) a Gluon
kernel on the exact Hopper kernel's schedule (ops/attention_fp8_wgmma.py) for ``pv="fp8"``;
``kernel_choice`` says which runs a call.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from sd_kernels import reference
from sd_kernels.runtime.dispatch import declined, interpreting, use_kernel
from sd_kernels.runtime.launch import Launcher, cdiv, next_pow2

from . import attention_common as _common
from . import attention_fp8_wgmma as _hopper
from . import attention_wgmma as _wgmma
from .attention_common import LOG2E, as_4d, check_attention_args, default_scale, from_4d, kernel_reason
from .fp8_quant import inv_scale
from .weight_cache import weight_version

HEAD_DIMS = (64, 128)
QK_MODES = ("int8", "fp8")
PV_MODES = ("fp8", "input")
KEY_BLOCK = reference.FP8_KEY_BLOCK  # keys per K scale, and the kernel's key block
E4M3_MAX = tl.constexpr(reference.E4M3_MAX)
INT8_MAX = tl.constexpr(127.0)
STATS_ROWS = 128  # keys per program of the per-channel statistics pass, at least (a power of two)
MAX_CHUNKS = 64  # ...and at most this many programs a head: each quantizing program loads all their partials
STATS_WARPS, STATS_STEP, QUANT_WARPS = 2, 32, 4  # the pre-pass's warps per program; keys per statistics step
HOPPER = True  # pv="fp8" on the Hopper kernel where it can run (False: the Triton kernel everywhere)
_LOG2E = tl.constexpr(LOG2E)


# ---------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _e4m3(x, SOFT: tl.constexpr):
    """x (fp32, |x| ≤ 448) rounded to nearest-even e4m3. SOFT: round in fp32 first, so that the cast
    is exact; Triton's interpreter rounds fp32 → e4m3 wrongly where rounding carries into the exponent
    (31.6 → 16), the GPU's cvt.rn is right and SOFT is off there."""
    if SOFT:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # 3 mantissa bits, ties to even
        normal = bits.to(tl.float32, bitcast=True)
        subnormal = (x + 24576.0) - 24576.0  # multiples of 2^-9 (fp32's spacing at 1.5·2^14)
        x = tl.where(tl.abs(x) < 0.015625, subnormal, normal)
    return x.to(tl.float8e4nv)


@triton.jit
def _quantize(x, INT8: tl.constexpr, SOFT: tl.constexpr):
    """x (fp32, |x| ≤ the format's max) as int8 (rounded to nearest even: 1.5·2^23 added and taken
    away leaves fp32's integers) or e4m3."""
    # one return: Triton types a function by all of its returns, even under a constexpr branch
    if INT8:
        out = ((x + 12582912.0) - 12582912.0).to(tl.int8)
    else:
        out = _e4m3(x, SOFT)
    return out


@triton.jit
def wgmma_key_order(n):
    """Where key n goes in the Hopper kernel's Vᵀ: n = 16a + 8b + 2t + e (its bits above 4 kept) moves to
    16a + 4t + 2b + e, the order in which each thread's probabilities already sit in the P·V operand
    (ops/attention_fp8_wgmma_kernel.py, ``_operand``). A permutation of each 16 keys."""
    return (n & -16) | (((n >> 1) & 3) << 2) | (((n >> 3) & 1) << 1) | (n & 1)


@triton.jit
def _kv_stats_kernel(K, V, KSum, VMax, stride_kb, stride_kh, stride_kn, stride_kd, stride_vb, stride_vh,
                     stride_vn, stride_vd, H, S, D: tl.constexpr, ROWS: tl.constexpr, CHUNK: tl.constexpr,
                     V_MAX: tl.constexpr):
    """Per (b·h, chunk of CHUNK keys): the chunk's per-channel sums of K and (V_MAX) max |V|."""
    bh, chunk = tl.program_id(0), tl.program_id(1)
    b, h = (bh // H).to(tl.int64), (bh % H).to(tl.int64)
    K += b * stride_kb + h * stride_kh
    V += b * stride_vb + h * stride_vh
    cols = tl.arange(0, D)
    # summed and maxed element by element over the steps, reduced over the rows once at the end: no
    # reduction between one step's loads and the next's
    ksum = tl.zeros([ROWS, D], tl.float32)
    vmax = tl.zeros([ROWS, D], tl.float32)
    for r0 in tl.static_range(0, CHUNK, ROWS):
        rows = chunk * CHUNK + r0 + tl.arange(0, ROWS)
        ok = rows[:, None] < S
        ksum += tl.load(K + rows[:, None] * stride_kn + cols[None, :] * stride_kd, mask=ok, other=0.0).to(tl.float32)
        if V_MAX:
            v = tl.load(V + rows[:, None] * stride_vn + cols[None, :] * stride_vd, mask=ok, other=0.0)
            vmax = tl.maximum(vmax, tl.abs(v.to(tl.float32)))
    ksum = tl.sum(ksum, 0)
    vmax = tl.max(vmax, 0)
    out = (bh * tl.num_programs(1) + chunk) * D + cols
    tl.store(KSum + out, ksum)
    if V_MAX:
        tl.store(VMax + out, vmax)


@triton.jit
def wgmma_key_source(m):
    """The inverse of ``wgmma_key_order``: the key that lands at position m (16a + 4t + 2b + e) of the
    Hopper kernel's Vᵀ is 16a + 8b + 2t + e."""
    return (m & -16) | (((m >> 1) & 1) << 3) | (((m >> 2) & 3) << 1) | (m & 1)


@triton.jit
def _kv_quant_kernel(K, V, KSum, VMax, K8, KScale, V8, VScale, stride_kb, stride_kh, stride_kn, stride_kd,
                     stride_vb, stride_vh, stride_vn, stride_vd, H, S, S_PAD, N_CHUNKS,
                     D: tl.constexpr, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr, K_INT8: tl.constexpr,
                     V_FP8: tl.constexpr, SOFT: tl.constexpr, PERMUTE_V: tl.constexpr):
    """Per (b·h, key block, part): part 0, K − mean → int8 or e4m3 [S_PAD, D] and the block's scale;
    part 1 (V_FP8), V·448/max|V| per channel → e4m3, transposed [D, S_PAD] (PERMUTE_V: its keys in
    ``wgmma_key_order``), and (block 0) the channel scales. The parts are programs of their own: each
    holds one [BLOCK_N, D] tile. Vᵀ's keys are written in order, each position loading the key that
    belongs there, so that the transposed store runs along whole rows of Vᵀ."""
    bh, blk = tl.program_id(0), tl.program_id(1)
    b, h = (bh // H).to(tl.int64), (bh % H).to(tl.int64)
    cols = tl.arange(0, D)
    parts = tl.arange(0, CHUNKS)
    part_ptrs = bh * N_CHUNKS * D + parts[:, None] * D + cols[None, :]
    part_ok = parts[:, None] < N_CHUNKS
    rows = blk * BLOCK_N + tl.arange(0, BLOCK_N)
    base = bh.to(tl.int64) * S_PAD * D
    if tl.program_id(2) == 0:
        mean = tl.sum(tl.load(KSum + part_ptrs, mask=part_ok, other=0.0), 0) / S
        ok = rows[:, None] < S
        k = tl.load(K + b * stride_kb + h * stride_kh + rows[:, None] * stride_kn + cols[None, :] * stride_kd,
                    mask=ok, other=0.0)
        kc = tl.where(ok, k.to(tl.float32) - mean[None, :], 0.0)  # padded keys: zeros, outside the block's max
        amax = tl.max(tl.max(tl.abs(kc), 1), 0)
        k_max: tl.constexpr = INT8_MAX if K_INT8 else E4M3_MAX
        k8 = _quantize(kc * inv_scale(amax, k_max), K_INT8, SOFT)
        tl.store(K8 + base + rows[:, None] * D + cols[None, :], k8)
        tl.store(KScale + bh * tl.num_programs(1) + blk, amax / k_max)
    elif V_FP8:  # (compiled only then: without it V8 is K8's buffer, int8 with int8 Q·Kᵀ)
        vmax = tl.max(tl.load(VMax + part_ptrs, mask=part_ok, other=0.0), 0)
        src = wgmma_key_source(rows) if PERMUTE_V else rows  # a permutation of each 16 keys
        ok = src[:, None] < S
        v = tl.load(V + b * stride_vb + h * stride_vh + src[:, None] * stride_vn + cols[None, :] * stride_vd,
                    mask=ok, other=0.0)
        v8 = _e4m3(v.to(tl.float32) * inv_scale(vmax, E4M3_MAX)[None, :], SOFT)
        tl.store(V8 + base + cols[None, :] * S_PAD + rows[:, None], v8)
        if blk == 0:
            tl.store(VScale + bh * D + cols, vmax / E4M3_MAX)


def _config(m: int, warps: int, stages: int) -> triton.Config:
    return triton.Config({"BLOCK_M": m}, num_warps=warps, num_stages=stages)


# Hopper starting points: 128 query rows over 8 warps (wgmma's 64-row tiles, two per program), e4m3
# K and V tiles of 128 keys (16 KiB each at D = 128, half flash's bf16 tiles), 2-4 stages.
_CONFIGS = {
    64: [_config(128, 8, 3), _config(128, 8, 4), _config(128, 4, 3), _config(64, 4, 3)],
    128: [_config(128, 8, 3), _config(128, 8, 2), _config(64, 4, 3)],
}


def _prune_configs(configs, named_args, **kwargs):
    chosen = _CONFIGS[kwargs["HEAD_DIM"]]
    small = [c for c in chosen if c.kwargs["BLOCK_M"] <= max(64, named_args["SQ_KEY"])] or chosen
    chosen = [c for c in configs if any(c is w for w in small)]
    return chosen if _common.AUTOTUNE else chosen[:1]


def _autotune():
    key = ["SQ_KEY", "SK_KEY", "HEAD_DIM", "QK_INT8", "PV_FP8", "BLOCK_N"]
    if interpreting():  # the interpreter would run every config: one small one
        return triton.autotune([_config(16, 4, 1)], key=key)
    return triton.autotune([c for cs in _CONFIGS.values() for c in cs], key=key,
                           prune_configs_by={"early_config_prune": _prune_configs})


@_autotune()
@triton.heuristics({"EVEN_N": lambda args: args["Sk"] % args["BLOCK_N"] == 0})
@triton.jit(do_not_specialize=["Sq", "Sk"])
def _attention_fp8_kernel(
    Q, K8, KScale, V, VScale, Out, qk_scale,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    H, Sq, Sk, S_PAD, N_BLOCKS, SQ_KEY, SK_KEY,
    HEAD_DIM: tl.constexpr, QK_INT8: tl.constexpr, PV_FP8: tl.constexpr, SOFT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr,
):
    """Out[b, h, rows] for BLOCK_M query rows of one (b, h); a 1-D grid, query blocks fastest (the
    programs of one head share its K and V in L2). PV_FP8: V is the pre-pass's e4m3 [D, S_PAD] (V's
    strides unused), else V as given."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(Sq, BLOCK_M)
    bh = pid // num_m
    start_m = (pid % num_m) * BLOCK_M
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    Q += b * stride_qb + h * stride_qh
    Out += b * stride_ob + h * stride_oh
    K8 += bh.to(tl.int64) * S_PAD * HEAD_DIM
    KScale += bh * N_BLOCKS
    if PV_FP8:
        V += bh.to(tl.int64) * S_PAD * HEAD_DIM
    else:
        V += b * stride_vb + h * stride_vh

    offs_m = start_m + tl.arange(0, BLOCK_M)
    rows = offs_m % Sq  # rows past Sq repeat real ones (finite, never stored)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + rows[:, None] * stride_qm + offs_d[None, :] * stride_qd).to(tl.float32)
    q_amax = tl.max(tl.abs(q), 1)
    q_max: tl.constexpr = INT8_MAX if QK_INT8 else E4M3_MAX
    q8 = _quantize(q * inv_scale(q_amax, q_max)[:, None], QK_INT8, SOFT)
    row_scale = q_amax / q_max * qk_scale  # with the key block's scale: the scores' factor, base 2

    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    # Every key block masks its scores when Sk is ragged (not only the last): as ops/attention.py's
    # flash kernel does, for the same reason (a peeled last block miscompiled under Hopper's pipeliner).
    for start_n in range(0, Sk, BLOCK_N):
        kv = start_n + offs_n
        k8 = tl.load(K8 + kv[:, None] * HEAD_DIM + offs_d[None, :])  # padded to whole blocks: no mask
        qk = tl.dot(q8, tl.trans(k8))
        if QK_INT8:  # int32 → fp32 without cvt (a quarter-rate instruction): |qk| ≤ 127²·128 < 2^22
            qk = (qk + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0
        c = row_scale * tl.load(KScale + start_n // BLOCK_N)  # ≥ 0, so max(qk)·c = max(qk·c)
        if EVEN_N:
            m_new = tl.maximum(m_i, tl.max(qk, 1) * c)
            p = tl.math.exp2(qk * c[:, None] - m_new[:, None])
        else:
            s = tl.where(kv[None, :] < Sk, qk * c[:, None], float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
        if PV_FP8:
            v8 = tl.load(V + offs_d[None, :] * S_PAD + kv[:, None])  # [BLOCK_N, D] of the [D, S_PAD] copy
            acc = tl.dot(_e4m3(p * E4M3_MAX, SOFT), v8, acc * alpha[:, None])
        else:
            v_ptrs = V + kv[:, None] * stride_vn + offs_d[None, :] * stride_vd
            v = tl.load(v_ptrs) if EVEN_N else tl.load(v_ptrs, mask=kv[:, None] < Sk, other=0.0)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])

    out = acc / l_i[:, None]  # l ≥ 1: the row's max contributes exp2(0)
    if PV_FP8:
        out = out * (tl.load(VScale + bh * HEAD_DIM + offs_d) / E4M3_MAX)[None, :]
    out_ptrs = Out + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od
    tl.store(out_ptrs, out.to(Out.dtype.element_ty), mask=offs_m[:, None] < Sq)


# ---------------------------------------------------------------------------------------------
# Host side

_STATS = Launcher(_kv_stats_kernel)
_QUANT = Launcher(_kv_quant_kernel)
_ATTN = Launcher(_attention_fp8_kernel)


def _fp8_device_reason(t: torch.Tensor) -> str | None:
    if t.is_cuda and torch.version.hip is None and torch.cuda.get_device_capability(t.device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(t.device)
        return f"sm_{major}{minor}: e4m3 tensor-core dots need sm_89 (Ada) or later"
    return None


def input_reason(q, k, v, attn_mask, scale, qk: str = "int8", pv: str = "fp8") -> str | None:
    """Why ``attention_fp8`` refuses these arguments (a ValueError), or None: what no device changes."""
    if attn_mask is not None:
        return "an attention mask (the FP8 kernel takes none)"
    if qk not in QK_MODES:
        return f"qk={qk!r}: one of {QK_MODES}"
    if pv not in PV_MODES:
        return f"pv={pv!r}: one of {PV_MODES}"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {q.dtype}: float16 or bfloat16"
    if q.shape[-1] not in HEAD_DIMS or v.shape[-1] != q.shape[-1]:
        return (f"head dims {q.shape[-1]} (q, k) and {v.shape[-1]} (v): the FP8 kernel takes "
                f"{' or '.join(map(str, HEAD_DIMS))}, the same for all three")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not 0 < scale < math.inf):
        return f"scale {scale!r}: a finite number > 0 (the kernel takes the row max of the unscaled scores)"
    return None


def run_reason(q, k, v, batch) -> str | None:
    """Why the kernel cannot run valid arguments here (the reference runs instead), or None."""
    return kernel_reason(q, k, v, batch=batch) or _fp8_device_reason(q)


class KvStats(NamedTuple):
    """The statistics pass's partials of one key and value, computed elsewhere (ops/rope.py's ``qk_norm_rope_fp8``,
    as it writes them): ``quantize_kv`` takes them in place of its own pass where ``serves`` says they are of the
    keys and values it was given, as they are now."""

    k_sum: torch.Tensor  # [B·H, n_chunks, D] fp32: per chunk of keys, the per-channel sums of k
    v_max: torch.Tensor  # [B·H, n_chunks, D] fp32: ... and max |v|
    source: tuple  # (k's, v's) (data pointer, version counter, shape, strides) as [B, H, S, D] when computed
    tensors: tuple  # (key, value): held, so that their memory is not another tensor's while these are kept

    @staticmethod
    def of(key: torch.Tensor, value: torch.Tensor, k_sum: torch.Tensor, v_max: torch.Tensor) -> KvStats:
        """The partials ``k_sum``, ``v_max`` of ``key`` and ``value`` [B, S, H, D], just computed."""
        return KvStats(k_sum, v_max, tuple(_identity(t.transpose(1, 2)) for t in (key, value)), (key, value))

    def serves(self, k4: torch.Tensor, v4: torch.Tensor) -> bool:
        """Whether these are the partials of [B, H, S, D] views k4, v4: the same memory, layout and versions. Never
        for inference tensors, whose changes no version counter records."""
        return None not in (self.source[0][1], self.source[1][1]) and self.source == (_identity(k4), _identity(v4))


def _identity(t: torch.Tensor) -> tuple:
    """(data pointer, version counter or None for an inference tensor, shape, strides, dtype)."""
    return *weight_version(t), tuple(t.shape), t.stride(), t.dtype


def quantize_kv(k4: torch.Tensor, v4: torch.Tensor, qk: str = "int8", pv: str = "fp8", key_block: int = KEY_BLOCK,
                permute_v: bool = False, stats: KvStats | None = None):
    """The pre-pass: (k8 [B·H, S_PAD, D] int8 or e4m3, k_scale [B·H, S_PAD / key_block] fp32, v8 [B·H, D,
    S_PAD] e4m3 or None, v_scale [B·H, D] fp32 or None) from [B, H, S, D] views; S_PAD: S in whole key
    blocks. ``permute_v``: v8's keys in ``wgmma_key_order`` (the Hopper kernel's), else in order. ``stats``:
    the statistics pass's partials computed beside the code that wrote k4 and v4 (``KvStats``), used where they
    serve these views (``pv="fp8"``), else the pass runs."""
    B, H, S, D = k4.shape
    n_blocks = cdiv(S, key_block)
    s_pad = n_blocks * key_block
    dev, f32, e4m3 = k4.device, torch.float32, torch.float8_e4m3fn
    v_fp8 = pv == "fp8"
    strides = (*k4.stride(), *v4.stride())
    if stats is not None and not (v_fp8 and stats.serves(k4, v4)):
        declined("attention_fp8", "K/V statistics of other tensors, or of these before a change: the statistics pass "
                             "runs" if v_fp8 else f"pv={pv!r} takes no V statistics")
        stats = None
    if stats is not None:
        k_sum, v_max = stats.k_sum, stats.v_max
        n_chunks = k_sum.shape[1]
    else:
        chunk = max(STATS_ROWS, next_pow2(cdiv(S, MAX_CHUNKS)))  # 128 up to 8,192 keys
        n_chunks = cdiv(S, chunk)
        k_sum = torch.empty(B * H, n_chunks, D, dtype=f32, device=dev)
        v_max = torch.empty(B * H, n_chunks, D, dtype=f32, device=dev) if v_fp8 else k_sum
        rows = 16 if interpreting() else STATS_STEP
        _STATS((D, v_fp8, k4.dtype, rows, chunk), (B * H, n_chunks), k4, v4, k_sum, v_max, *strides, H, S,
               D=D, ROWS=rows, CHUNK=chunk, V_MAX=v_fp8, num_warps=STATS_WARPS)
    k8 = torch.empty(B * H, s_pad, D, dtype=torch.int8 if qk == "int8" else e4m3, device=dev)
    k_scale = torch.empty(B * H, n_blocks, dtype=f32, device=dev)
    v8 = torch.empty(B * H, D, s_pad, dtype=e4m3, device=dev) if v_fp8 else None
    v_scale = torch.empty(B * H, D, dtype=f32, device=dev) if v_fp8 else None
    soft = interpreting()
    _QUANT((D, key_block, next_pow2(n_chunks), qk, v_fp8, k4.dtype, soft, permute_v), (B * H, n_blocks, 1 + v_fp8),
           k4, v4, k_sum, v_max, k8, k_scale, v8 if v_fp8 else k8, v_scale if v_fp8 else k_scale, *strides, H, S,
           s_pad, n_chunks,
           D=D, BLOCK_N=key_block, CHUNKS=next_pow2(n_chunks), K_INT8=qk == "int8", V_FP8=v_fp8, SOFT=soft,
           PERMUTE_V=permute_v, num_warps=QUANT_WARPS)
    return k8, k_scale, v8, v_scale


def _hopper_reason(q4: torch.Tensor, pv: str, key_block: int) -> str | None:
    """Why the Hopper kernel (ops/attention_fp8_wgmma.py) cannot run this call, or None."""
    if not HOPPER:
        return "attention_fp8.HOPPER is off"
    if pv != "fp8":
        return f"pv={pv!r}: the Hopper kernel's P·V is e4m3"
    if interpreting():
        return "the interpreter cannot run Gluon"
    return _hopper.reason(q4, key_block)


def kernel_choice(q4: torch.Tensor, qk: str = "int8", pv: str = "fp8", key_block: int = KEY_BLOCK) -> str:
    """Which kernel runs a call ``_attention_fp8`` takes on q4 [B, H, Sq, D]: "wgmma" (the Hopper kernel: ``pv="fp8"``
    on sm_90 with Triton 3.6, where ``HOPPER`` is on) or "triton". One rule per head dim, by the larger measured
    gain (H200, docs/kernels/attention_fp8.md): int8 Q·Kᵀ at head dim 128 stays on the Triton kernel (FLUX 0.447
    against 0.449 ms, the Hopper kernel without its token ring); at 64 the Hopper kernel takes both modes (SD3
    18-21% faster, SDXL's 4,096-token self-attention 5-8% slower). Where it is wanted on an sm_90 GPU and cannot
    take the call, the reason is logged once and counted (``dispatch.fallbacks()``)."""
    if qk == "int8" and q4.shape[-1] > 64:
        return "triton"
    why = _hopper_reason(q4, pv, key_block)
    if why is not None and HOPPER and pv == "fp8" and _on_hopper(q4):
        declined("attention_fp8_wgmma", why)
    return "triton" if why is not None else "wgmma"


def _on_hopper(t: torch.Tensor) -> bool:
    return _wgmma.hopper_reason(t) is None


def _attention_fp8(q4, k4, v4, scale: float, qk: str = "int8", pv: str = "fp8", key_block: int = KEY_BLOCK,
                   config: triton.Config | None = None, n_consumers: int | None = None,
                   kv_stats: KvStats | None = None) -> torch.Tensor:
    """The pre-pass (given ``kv_stats``, its statistics where they serve: ``quantize_kv``) and the kernel on
    [B, H, S, D] views; ``key_block``, ``config`` (the Triton kernel's, bypassing its autotuner) and
    ``n_consumers`` (the Hopper kernel's, which it then runs whatever ``kernel_choice`` says, or raises ValueError
    where it cannot) are the tests' and benchmarks' overrides."""
    B, H, Sq, D = q4.shape
    Sk = k4.shape[2]
    if n_consumers is not None:  # the Hopper kernel, asked for by name
        why = "a Triton config was given too" if config is not None else _hopper_reason(q4, pv, key_block)
        if why is not None:
            raise ValueError(f"n_consumers={n_consumers!r} asks for the Hopper kernel, which cannot run this "
                             f"call: {why}")
        hopper = True
    else:
        hopper = config is None and kernel_choice(q4, qk, pv, key_block) == "wgmma"
    k8, k_scale, v8, v_scale = quantize_kv(k4, v4, qk, pv, key_block, permute_v=hopper, stats=kv_stats)
    out = _common.alloc_output((B, H, Sq, D), q4, heads_inner=q4.stride(1) < q4.stride(2))
    if hopper:
        return _hopper.attention(q4, k8, k_scale, v8, v_scale, out, Sk, scale * LOG2E, qk, n_consumers)
    v_arg, vs_arg = (v8, v_scale) if pv == "fp8" else (v4, k_scale)
    soft = interpreting()
    args = (q4, k8, k_scale, v_arg, vs_arg, out, scale * LOG2E, *q4.stride(), *v4.stride(), *out.stride(),
            H, Sq, Sk, k8.shape[1], k_scale.shape[1], next_pow2(Sq), next_pow2(Sk))
    meta = dict(HEAD_DIM=D, QK_INT8=qk == "int8", PV_FP8=pv == "fp8", SOFT=soft, BLOCK_N=key_block)
    grid = lambda m: (cdiv(Sq, m["BLOCK_M"]) * B * H,)  # noqa: E731
    if config is None:
        _ATTN((Sq, Sk, D, qk, pv, key_block, q4.dtype, v4.dtype, soft), grid, *args, **meta)
    else:
        _attention_fp8_kernel.fn.fn[grid](*args, **meta, **config.all_kwargs(), EVEN_N=Sk % key_block == 0)
    return out


def attention_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
                  scale: float | None = None, qk: str = "int8", pv: str = "fp8",
                  kv_stats: KvStats | None = None) -> torch.Tensor:
    """``F.scaled_dot_product_attention(q, k, v, scale=scale)`` on 8-bit tensor-core dots: Q·Kᵀ in
    int8 (``qk="int8"``, default) or e4m3 (``qk="fp8"``), P·V in e4m3 (``pv="fp8"``, default) or in
    the input dtype (``pv="input"``). The module docstring gives the algorithm,
    docs/kernels/attention_fp8.md its error and speed. ``kv_stats``: k's and v's statistics from the op that
    wrote them (``KvStats``; ops/rope.py's ``qk_norm_rope_fp8``), which spare the pre-pass its first kernel.

    q [..., Sq, D], k and v [..., Sk, D], fp16 or bf16, D 64 or 128, batch dims broadcast (up to two
    in the kernel); ``attn_mask`` must be None (the argument is there for the flash signature).
    Arguments it cannot take raise ValueError; where its kernel cannot run, ``reference.attention_fp8``
    computes the same quantized algorithm.
    """
    batch = check_attention_args("attention_fp8", q, k, v, attn_mask)
    why = input_reason(q, k, v, attn_mask, scale, qk, pv)
    if why is not None:
        raise ValueError(f"attention_fp8: {why}")
    if not use_kernel("attention_fp8", q, k, v, unsupported=run_reason(q, k, v, batch)):
        return reference.attention_fp8(q, k, v, scale, qk, pv)
    views = [as_4d(t, batch, t.shape[-2], t.shape[-1]) for t in (q, k, v)]
    return from_4d(_attention_fp8(*views, default_scale(q, scale), qk, pv, kv_stats=kv_stats), batch)
