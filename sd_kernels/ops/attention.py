"""FlashAttention in Triton, and ``attention``: the one function that picks an attention path per call.

``flash_attention(q, k, v, attn_mask, scale)`` has the contract of ``F.scaled_dot_product_attention``
(no dropout, not causal) and computes it exactly with the online softmax: one program owns BLOCK_M
query rows of one (batch, head), streams K and V through in BLOCK_N-row tiles and keeps a running row
max m, row sum l and an fp32 [BLOCK_M, D] accumulator; the Sq×Sk scores never reach memory.

Layout: q, k, v are [B, H, S, D] with any strides (diffusers hands over transposed views of
[B, S, H, D]; nothing is copied), batch dims broadcast through stride 0. The output is allocated in
q's layout, so diffusers' ``transpose(1, 2).reshape(B, S, H·D)`` after it is a free view.

Head dims: D is covered by a power-of-two block D_LO plus, when needed, a power-of-two remainder
block D_HI (each ≥ 16, tl.dot's minimum): SD's 40, 80, 160 run Q·Kᵀ as 32+16, 64+16, 128+32 (48,
80, 160 deep instead of 64, 128, 256 for one block padded to a power of two); P·V, where D is the
dot's width, takes one padded block up to D = 64 (``flash_blocks``). Columns past D are masked
loads (zeros) and masked stores. Any D ≤ 256 works; larger head dims do not fit the
accumulator on chip and go to ``partial_softmax_attention`` (ops/softmax_matmul.py).

Masks: additive float masks (any float dtype, added in fp32) or boolean (True = attend), broadcast
over batch, heads and query rows through stride 0. Rows with every key masked give zeros (as the
reference's do; any other NaN stays NaN). fp16/bf16: dots on tensor cores with fp32 accumulation, softmax in fp32,
P cast to the input dtype for the P·V dot (as in FlashAttention). fp32: tl.dot in IEEE fp32 unless
``torch.backends.cuda.matmul.allow_tf32`` is set (then TF32, as torch's matmuls do).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sd_kernels import reference
from sd_kernels.ops.layout import misaligned, realigned
from sd_kernels.runtime.dispatch import (
    MAX_PLANS,
    declined,
    device_reason,
    interpreting,
    keep_plan,
    plan_context,
    use_kernel,
)
from sd_kernels.runtime.launch import Launcher, cdiv, next_pow2

from . import attention_common as _common
from . import attention_fp8 as _fp8
from . import attention_wgmma as _wgmma
from . import softmax_matmul as _partial
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

MAX_HEAD_DIM = 256  # flash keeps a [BLOCK_M, D] fp32 accumulator in registers: beyond this it spills
_LOG2E = tl.constexpr(LOG2E)
# Shared memory the pruner lets a config plan for: Hopper's 227 KiB per block less headroom. On GPUs
# with less, configs that do not fit fail to compile and the autotuner skips them (OutOfResources).
SMEM_BUDGET = 200 * 1024


def head_dim_blocks(d: int) -> tuple[int, int]:
    """(D_LO, D_HI): a power-of-two block and a power-of-two remainder block (0: none) covering d.

    >>> [head_dim_blocks(d) for d in (8, 40, 64, 80, 160, 200)]
    [(16, 0), (32, 16), (64, 0), (64, 16), (128, 32), (256, 0)]
    """
    lo = max(16, 1 << (max(d, 1).bit_length() - 1))
    rest = d - lo
    hi = 0 if rest <= 0 else max(16, next_pow2(rest))
    if lo + hi >= next_pow2(d):  # two blocks would do the work of one: take one
        return max(16, next_pow2(d)), 0
    return lo, hi


def flash_blocks(d: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The head-dim blocks of flash's two products: (D_LO, D_HI) for Q·Kᵀ, (DV_LO, DV_HI) for P·V.

    Q·Kᵀ takes the two-block split (its head dim is the dot's K: 32 + 16 is three 16-deep MMA steps
    instead of four). P·V's head dim is the dot's N: up to 64 one padded block beats two narrow dots
    (measured on the H100 at d = 40: 0.158 against 0.175 ms, docs/kernels/attention.md).

    >>> flash_blocks(40), flash_blocks(80)
    (((32, 16), (64, 0)), ((64, 16), (64, 16)))
    """
    return head_dim_blocks(d), (max(16, next_pow2(d)), 0) if d <= 64 else head_dim_blocks(d)


# ---------------------------------------------------------------------------------------------
# Kernel


@triton.jit
def _load_tile(ptr, rows, cols, stride_r, stride_c, n_cols, MASK_COLS: tl.constexpr, n_rows=0,
               MASK_ROWS: tl.constexpr = False):
    """A [len(rows), len(cols)] tile, zeros past ``n_cols`` columns (MASK_COLS) / ``n_rows`` rows (MASK_ROWS)."""
    ptrs = ptr + rows[:, None] * stride_r + cols[None, :] * stride_c
    if MASK_COLS and MASK_ROWS:
        return tl.load(ptrs, mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols), other=0.0)
    if MASK_COLS:
        return tl.load(ptrs, mask=cols[None, :] < n_cols, other=0.0)
    if MASK_ROWS:
        return tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
    return tl.load(ptrs)


@triton.jit
def _attend_tile(
    acc_lo, acc_hi, l_i, m_i, q_lo, q_hi, K, V, Mask, start_n, rows, offs_n, offs_lo, offs_hi,
    offs_vlo, offs_vhi, Sk, stride_kn, stride_kd, stride_vn, stride_vd, stride_mm, stride_mn, qk_scale,
    HEAD_DIM: tl.constexpr, D_LO: tl.constexpr, D_HI: tl.constexpr, DV_LO: tl.constexpr,
    DV_HI: tl.constexpr, MASK: tl.constexpr, NEG_SCALE: tl.constexpr, BOUNDARY: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Fold keys [start_n, start_n + BLOCK_N) into the running (acc, l, m) of the query rows.

    Scores live in base 2: s = q·k·scale·log2(e) (+ mask·log2(e)), so that exp(x) = exp2(x·log2 e)
    costs one exp2. ``BOUNDARY``: the block may run past Sk; keys past it load as zeros (masked loads)
    and their scores are set to -inf. Q·Kᵀ runs over head-dim blocks (D_LO, D_HI), P·V over
    (DV_LO, DV_HI): the two products may split D differently.
    """
    kv = start_n + offs_n
    k_lo = _load_tile(K, kv, offs_lo, stride_kn, stride_kd, HEAD_DIM, D_LO > HEAD_DIM, Sk, BOUNDARY)
    qk = tl.dot(q_lo, tl.trans(k_lo), input_precision=PRECISION)
    if D_HI > 0:
        k_hi = _load_tile(K, kv, offs_hi, stride_kn, stride_kd, HEAD_DIM, D_LO + D_HI > HEAD_DIM, Sk, BOUNDARY)
        qk = tl.dot(q_hi, tl.trans(k_hi), qk, input_precision=PRECISION)

    if MASK == 0 and not BOUNDARY:
        # The hot loop: max before scaling, then one FMA per score (scale·qk − m).
        if NEG_SCALE:
            m_new = tl.maximum(m_i, tl.min(qk, 1) * qk_scale)
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
    else:
        s = qk * qk_scale
        if MASK == 1:
            s += _load_tile(Mask, rows, kv, stride_mm, stride_mn, Sk, BOUNDARY).to(tl.float32) * _LOG2E
        if MASK == 2:
            keep = _load_tile(Mask, rows, kv, stride_mm, stride_mn, Sk, BOUNDARY)
            s = tl.where(keep != 0, s, float("-inf"))
        if BOUNDARY:
            s = tl.where(kv[None, :] < Sk, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_sub = m_new
        if MASK != 0:  # every score of a row masked so far: subtract 0, not -inf (-inf − -inf = NaN)
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_sub[:, None])
        alpha = tl.math.exp2(m_i - m_sub)

    l_i = l_i * alpha + tl.sum(p, 1)
    p = p.to(q_lo.dtype)
    v_lo = _load_tile(V, kv, offs_vlo, stride_vn, stride_vd, HEAD_DIM, DV_LO > HEAD_DIM, Sk, BOUNDARY)
    acc_lo = tl.dot(p, v_lo, acc_lo * alpha[:, None], input_precision=PRECISION)
    if DV_HI > 0:
        v_hi = _load_tile(V, kv, offs_vhi, stride_vn, stride_vd, HEAD_DIM, DV_LO + DV_HI > HEAD_DIM, Sk,
                          BOUNDARY)
        acc_hi = tl.dot(p, v_hi, acc_hi * alpha[:, None], input_precision=PRECISION)
    return acc_lo, acc_hi, l_i, m_new


def _config(m: int, n: int, warps: int, stages: int, maxnreg: int | None = None) -> triton.Config:
    return triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=warps, num_stages=stages, maxnreg=maxnreg)


# Hopper-first starting points: BLOCK_M 128 over 8 warps (16 query rows per warp, as wgmma likes),
# BLOCK_N 64-128 with 2-3 stages for D ≤ 128; narrower key tiles for D > 128, where the [128, D]
# accumulator already takes 80-128 registers per thread. Masked calls also hold a [BLOCK_M, BLOCK_N]
# mask tile: they take the BLOCK_N = 32 configs (64 spills at D = 40 and 160). All compile for sm_90
# to wgmma loops without spills but masked D = 256 (checked offline: triton.compile, cuobjdump).
_HALF_CONFIGS = {
    64: [_config(128, 128, 8, 3, 128), _config(128, 64, 8, 3), _config(128, 64, 4, 3), _config(64, 64, 4, 3),
         _config(128, 32, 8, 3)],
    128: [_config(128, 64, 8, 3), _config(64, 64, 4, 3), _config(128, 32, 8, 3)],
    256: [_config(64, 64, 4, 2), _config(128, 64, 8, 2), _config(128, 32, 8, 2), _config(64, 32, 4, 2)],
}
# fp32 dots in IEEE precision run on the FMA units and hold whole operand tiles in registers: they
# spill at any tile size worth having. Correct, not fast (fp32 is not an SD inference dtype).
_FP32_CONFIGS = [_config(32, 32, 8, 1), _config(64, 32, 4, 2)]
_ALL_CONFIGS = [c for cs in _HALF_CONFIGS.values() for c in cs] + _FP32_CONFIGS


def _smem_bytes(cfg: triton.Config, d_pad: int, elem: int) -> int:
    """Shared memory a config plans for: the Q tile plus ``num_stages`` K and V tiles."""
    return elem * d_pad * (cfg.kwargs["BLOCK_M"] + 2 * cfg.num_stages * cfg.kwargs["BLOCK_N"])


def flash_configs(dtype: torch.dtype, head_dim: int, masked: bool, sq: int = 1 << 30, sk: int = 1 << 30):
    """The configs worth timing for one call: by dtype and padded head dim, within SMEM_BUDGET, narrow
    key tiles with a mask, none much larger than the problem (tiny Sq or Sk)."""
    d_pad = sum(head_dim_blocks(head_dim))
    if dtype == torch.float32:
        wanted = _FP32_CONFIGS
    else:
        wanted = next(cs for bound, cs in sorted(_HALF_CONFIGS.items()) if d_pad <= bound)
    elem = torch.empty((), dtype=dtype).element_size()
    fits = [c for c in wanted if _smem_bytes(c, d_pad, elem) <= SMEM_BUDGET
            and (not masked or c.kwargs["BLOCK_N"] <= 32)]
    small = [c for c in fits if c.kwargs["BLOCK_M"] <= max(64, sq) and c.kwargs["BLOCK_N"] <= max(32, sk)]
    return small or fits or wanted[-1:]


def _prune_configs(configs, named_args, **kwargs):
    chosen = flash_configs(named_args["Q"].dtype, kwargs["HEAD_DIM"], kwargs["MASK"] != 0,
                           named_args["SQ_KEY"], named_args["SK_KEY"])
    chosen = [c for c in configs if any(c is w for w in chosen)]
    return chosen if _common.AUTOTUNE else chosen[:1]


def _autotune():
    key = ["SQ_KEY", "SK_KEY", "HEAD_DIM", "MASK"]  # the dtype of every tensor is keyed too
    if interpreting():  # the interpreter would run every config: one small one
        return triton.autotune([_config(32, 32, 4, 1)], key=key)
    return triton.autotune(_ALL_CONFIGS, key=key, prune_configs_by={"early_config_prune": _prune_configs})


@_autotune()
@triton.heuristics({"EVEN_N": lambda args: args["Sk"] % args["BLOCK_N"] == 0})
@triton.jit(do_not_specialize=["Sq", "Sk"])
def _flash_attention_kernel(
    Q, K, V, Mask, Out, qk_scale,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_ob, stride_oh, stride_om, stride_od,
    H, Sq, Sk, SQ_KEY, SK_KEY,
    HEAD_DIM: tl.constexpr, D_LO: tl.constexpr, D_HI: tl.constexpr,
    MASK: tl.constexpr,  # 0: none, 1: additive (float), 2: boolean (nonzero = attend)
    DV_LO: tl.constexpr, DV_HI: tl.constexpr,
    NEG_SCALE: tl.constexpr, PRECISION: tl.constexpr, ALIGN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr,
):
    """Out[b, h, rows] for one block of BLOCK_M query rows of one (b, h); a 1-D grid, query blocks
    fastest, so the programs of one head run together and share its K and V in L2."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(Sq, BLOCK_M)
    bh = pid // num_m
    start_m = (pid % num_m) * BLOCK_M
    # int64 (b, h) offsets: B·H·S·D passes 2^31 on big batches; offsets inside one head stay int32
    # (the launcher checks that they fit).
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    Q += b * _aligned(stride_qb, ALIGN) + h * _aligned(stride_qh, ALIGN)
    K += b * _aligned(stride_kb, ALIGN) + h * _aligned(stride_kh, ALIGN)
    V += b * _aligned(stride_vb, ALIGN) + h * _aligned(stride_vh, ALIGN)
    Out += b * _aligned(stride_ob, ALIGN) + h * _aligned(stride_oh, ALIGN)
    stride_qm = _aligned(stride_qm, ALIGN)
    stride_kn = _aligned(stride_kn, ALIGN)
    stride_vn = _aligned(stride_vn, ALIGN)
    stride_om = _aligned(stride_om, ALIGN)
    if MASK != 0:
        Mask += b * stride_mb + h * stride_mh

    offs_m = start_m + tl.arange(0, BLOCK_M)
    rows = offs_m % Sq  # rows past Sq repeat real ones (finite, never stored): q loads need no mask
    offs_n = tl.arange(0, BLOCK_N)
    offs_lo = tl.arange(0, D_LO)
    offs_hi = D_LO + tl.arange(0, D_HI if D_HI > 0 else 16)  # unused when D_HI = 0
    offs_vlo = tl.arange(0, DV_LO)
    offs_vhi = DV_LO + tl.arange(0, DV_HI if DV_HI > 0 else 16)  # unused when DV_HI = 0
    q_lo = _load_tile(Q, rows, offs_lo, stride_qm, stride_qd, HEAD_DIM, D_LO > HEAD_DIM)
    if D_HI > 0:
        q_hi = _load_tile(Q, rows, offs_hi, stride_qm, stride_qd, HEAD_DIM, D_LO + D_HI > HEAD_DIM)
    else:  # a placeholder threaded through the loop untouched (and removed by the compiler)
        q_hi = q_lo
    acc_lo = tl.zeros([BLOCK_M, DV_LO], dtype=tl.float32)
    acc_hi = tl.zeros([BLOCK_M, DV_HI if DV_HI > 0 else 16], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)

    # One loop over every key block. When Sk is not a multiple of BLOCK_N (EVEN_N false) every
    # iteration masks its loads and scores, not just the last: a loop over the full blocks followed by
    # a peeled, masked last block miscompiled under Triton 3.6's Hopper pipeliner (wrong results or
    # illegal addresses, measured 2026-11-22). SD's self-attention lengths are multiples of 64 (even);
    # its cross-attention has 77 keys, one or two blocks, where masking every block costs nothing.
    for start_n in range(0, Sk, BLOCK_N):
        acc_lo, acc_hi, l_i, m_i = _attend_tile(
            acc_lo, acc_hi, l_i, m_i, q_lo, q_hi, K, V, Mask, start_n, rows, offs_n, offs_lo, offs_hi,
            offs_vlo, offs_vhi, Sk, stride_kn, stride_kd, stride_vn, stride_vd, stride_mm, stride_mn, qk_scale,
            HEAD_DIM, D_LO, D_HI, DV_LO, DV_HI, MASK, NEG_SCALE, not EVEN_N, PRECISION,
        )

    # l = 0 only for rows whose every key was masked: their accumulator is 0, and so is their output.
    inv_l = 1.0 / tl.where(l_i == 0.0, 1.0, l_i)
    row_ok = offs_m[:, None] < Sq
    out_ptrs = Out + offs_m[:, None] * stride_om
    out_lo = (acc_lo * inv_l[:, None]).to(Out.dtype.element_ty)
    if DV_LO > HEAD_DIM:
        tl.store(out_ptrs + offs_vlo[None, :] * stride_od, out_lo, mask=row_ok & (offs_vlo[None, :] < HEAD_DIM))
    else:
        tl.store(out_ptrs + offs_vlo[None, :] * stride_od, out_lo, mask=row_ok)
    if DV_HI > 0:
        out_hi = (acc_hi * inv_l[:, None]).to(Out.dtype.element_ty)
        tl.store(out_ptrs + offs_vhi[None, :] * stride_od, out_hi, mask=row_ok & (offs_vhi[None, :] < HEAD_DIM))


# ---------------------------------------------------------------------------------------------
# Host side


def _mask_kind(mask: torch.Tensor | None) -> int:
    return 0 if mask is None else 2 if mask.dtype == torch.bool else 1


RELAX_MAX_KEYS = 256


def _relax(named: dict) -> dict:
    """EVEN_N=False (every key block masked) is right at any Sk: a new size whose EVEN_N kernel is not
    compiled yet takes the masked one where it is (SD1.5's 16×16 and 8×8 self-attention: 256 and 64 keys
    at 512², 560 and 140 at 896×640). Only up to RELAX_MAX_KEYS keys, four 64-key blocks, where the masks
    cost was within the spread (SD1.5 512² after 896×640: 156.7 against 155.9 ms warm); a longer
    attention compiles its unmasked kernel."""
    return {"EVEN_N": False} if named["Sk"] <= RELAX_MAX_KEYS else {}


_FLASH = Launcher(_flash_attention_kernel, relax=_relax)


class _FlashPlan:
    """Everything a flash launch derives from its inputs' metadata: the launcher's key, the grid, the
    head-dim blocks, the 4-d strides, the alignment, the output's shape and layout.

    ``launch`` takes the tensors themselves: the 4-d views, or (a cached plan) the caller's tensors,
    which start at the same addresses (``as_4d`` only expands and adds leading dims); Triton reads
    nothing of a tensor argument but its address and dtype.
    """

    __slots__ = ("out_shape", "heads_inner", "out_stride", "bool_mask", "key", "grid", "qk_scale", "strides",
                 "sizes", "meta", "final_shape", "profile")

    def __init__(self, q4, k4, v4, mask4, out, scale: float, batch: tuple[int, ...] = (),
                 blocks: tuple[tuple[int, int], tuple[int, int]] | None = None) -> None:
        B, H, Sq, D = q4.shape
        Sk = k4.shape[2]
        kind = _mask_kind(mask4)
        self.out_shape, self.heads_inner, self.out_stride = (B, H, Sq, D), q4.stride(1) < q4.stride(2), out.stride()
        self.bool_mask = kind == 2  # bool storage is one byte; Triton loads it as uint8
        m_dtype = q4.dtype if mask4 is None else torch.uint8 if kind == 2 else mask4.dtype
        m_strides = mask4.stride() if mask4 is not None else (0, 0, 0, 0)
        (d_lo, d_hi), (dv_lo, dv_hi) = blocks or flash_blocks(D)
        align, precision = alignment(q4, k4, v4, out), dot_precision(q4.dtype)
        # The key holds what the autotuner keys on (Sq, Sk, D, mask kind, the dtypes) and what the
        # EVEN_N heuristic reads (Sk); everything else the kernel sees is an argument.
        self.key = (Sq, Sk, D, kind, q4.dtype, m_dtype, scale < 0, precision, align)
        self.grid = lambda meta: (cdiv(Sq, meta["BLOCK_M"]) * B * H,)
        self.qk_scale = scale * LOG2E
        self.strides = (*q4.stride(), *k4.stride(), *v4.stride(), *m_strides)
        self.sizes = (H, Sq, Sk, next_pow2(Sq), next_pow2(Sk))
        self.meta = dict(HEAD_DIM=D, D_LO=d_lo, D_HI=d_hi, DV_LO=dv_lo, DV_HI=dv_hi, MASK=kind, NEG_SCALE=scale < 0,
                         PRECISION=precision, ALIGN=align)
        self.final_shape = (*batch, Sq, D) if len(batch) < 2 else None  # from_4d's reshape
        self.profile = None  # a cached plan holds the profile its key names by id (so the id stays its)

    def launch(self, q, k, v, mask, out, config: triton.Config | None = None) -> None:
        m = q if mask is None else mask.view(torch.uint8) if self.bool_mask else mask  # q: a placeholder
        args = (q, k, v, m, out, self.qk_scale, *self.strides, *out.stride(), *self.sizes)
        if config is None:
            _FLASH(self.key, self.grid, *args, **self.meta)
        else:  # the tests' way to run one given config
            _flash_attention_kernel.fn[self.grid](*args, **self.meta, **config.all_kwargs())

    def __call__(self, q, k, v, mask) -> torch.Tensor | None:
        """The cached path: allocate, launch, shape the output as ``from_4d`` does (None: the output
        came in another layout than the plan's, or an input is misaligned, so plan afresh)."""
        if misaligned(q, k, v, mask):
            return None
        out = _common.alloc_output(self.out_shape, q, self.heads_inner)
        if out.stride() != self.out_stride:
            return None
        self.launch(q, k, v, mask, out)
        return out if self.final_shape is None else out.reshape(self.final_shape)


def _flash(q4, k4, v4, mask4, scale: float, config: triton.Config | None = None,
           blocks: tuple[tuple[int, int], tuple[int, int]] | None = None) -> torch.Tensor:
    """The launch; ``config`` bypasses the autotuner (the tests run every config); ``blocks``,
    ((D_LO, D_HI), (DV_LO, DV_HI)), overrides ``flash_blocks`` (the tuning sweep compares splits)."""
    return _flash_with_plan(q4, k4, v4, mask4, scale, config=config, blocks=blocks)[0]


def _flash_with_plan(q4, k4, v4, mask4, scale: float, batch: tuple[int, ...] = (), config=None, blocks=None):
    """(out [B, H, Sq, D], the plan it was launched with; None for an empty output).

    Inputs whose data starts off a 16-byte boundary are copied first: the kernel compiled for such
    pointers by Triton 3.6 computed wrong results on the H100 (rel. err 0.64 at 2×8×64×77×160 with
    every input one element off, measured 2026-11-22); aligned inputs are never copied."""
    if misaligned(q4, k4, v4, mask4):
        q4, k4, v4, mask4 = (realigned(t) for t in (q4, k4, v4, mask4))
    B, H, Sq, D = q4.shape
    out = _common.alloc_output((B, H, Sq, D), q4, heads_inner=q4.stride(1) < q4.stride(2))
    if out.numel() == 0:
        return out, None
    plan = _FlashPlan(q4, k4, v4, mask4, out, scale, batch, blocks)
    plan.launch(q4, k4, v4, mask4, out, config)
    return out, plan


# ---------------------------------------------------------------------------------------------
# Plans per call signature: an eager UNet step makes ~32 attention calls of a handful of signatures,
# and deriving a launch from scratch (argument checks, the path, views, alignment, blocks, key) costs
# more host time than the launch itself. ``attention`` and ``flash_attention`` remember, for a call
# that took the flash kernel, the plan it launched with, under a key of everything that decision and
# plan read: the inputs' shapes, strides, dtypes and devices, the mask's (or None), scale, upcast,
# whether autograd would track an input, the active profile (by identity: set_profile, patch(profile=)
# and a test's monkeypatch all install another object), SD_KERNELS_BACKEND, TRITON_INTERPRET for CPU
# tensors, FLASH_MAX_HEAD_DIM and, for fp32, torch's TF32 switch. Not in the key: the data pointers
# (Triton specializes on their alignment itself). Calls that fall back (partial softmax, sdpa, the
# reference) are never cached: they go through use_kernel each time, logged and counted as before.

_PLANS: dict[tuple, _FlashPlan] = {}


def clear_plans() -> None:
    """Forget every cached attention plan (the next call of each signature decides from scratch)."""
    _PLANS.clear()


def _plan_key(op: str, q, k, v, attn_mask, scale, upcast) -> tuple:
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                        or (attn_mask is not None and attn_mask.requires_grad))
    mask = None if attn_mask is None else (attn_mask.dtype, attn_mask.shape, attn_mask.stride(), attn_mask.device)
    return (op, q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype,
            q.device, k.device, v.device, mask, scale, upcast, grad, *plan_context(q), FLASH_MAX_HEAD_DIM,
            q.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32)


def _run_plan(key: tuple, q, k, v, attn_mask) -> torch.Tensor | None:
    """The output of the plan kept under ``key``, or None (no plan, or it declined this call)."""
    plan = _PLANS.get(key)
    return None if plan is None else plan(q, k, v, attn_mask)


def _flash_planned(key: tuple, q, k, v, attn_mask, batch: tuple[int, ...], scale) -> torch.Tensor:
    """Flash on a call that was decided from scratch; its plan is kept under ``key`` for the next one."""
    views = _views(q, k, v, attn_mask, batch)
    out, plan = _flash_with_plan(*views, default_scale(q, scale), batch)
    if (plan is not None and (scale is None or type(scale) in (float, int))  # not a tensor: it may change
            and not misaligned(*views)  # a plan made on realigned copies may hold the copies' strides
            and all(t is None or t.data_ptr() == t4.data_ptr() for t, t4 in zip((q, k, v, attn_mask), views))):
        keep_plan(_PLANS, key, plan, MAX_PLANS)
    return from_4d(out, batch)


def _views(q, k, v, attn_mask, batch):
    q4 = as_4d(q, batch, q.shape[-2], q.shape[-1])
    k4 = as_4d(k, batch, k.shape[-2], k.shape[-1])
    v4 = as_4d(v, batch, v.shape[-2], v.shape[-1])
    mask4 = None if attn_mask is None else as_4d(attn_mask, batch, q.shape[-2], k.shape[-2])
    return q4, k4, v4, mask4


def _flash_shape_reason(q, v) -> str | None:
    if q.shape[-1] > MAX_HEAD_DIM:
        return (f"head dim {q.shape[-1]} > {MAX_HEAD_DIM}: the accumulator does not fit on chip "
                "(partial_softmax_attention takes these)")
    if v.shape[-1] != q.shape[-1]:
        return f"value head dim {v.shape[-1]} differs from query's {q.shape[-1]}"
    return None


def flash_reason(q, k, v, attn_mask, batch) -> str | None:
    """Why the flash kernel cannot take this call, or None."""
    return _flash_shape_reason(q, v) or kernel_reason(q, k, v, attn_mask, batch=batch)


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention(q, k, v, attn_mask, scale=scale)`` by FlashAttention.

    q [..., Sq, D], k [..., Sk, D], v [..., Sk, D] (batch dims broadcast; up to two of them in the
    kernel), D ≤ 256; attn_mask bool (True = attend) or float (added), broadcastable to
    [..., Sq, Sk]. Fully masked query rows give zeros.
    """
    key = _plan_key("flash_attention", q, k, v, attn_mask, scale, False)
    out = _run_plan(key, q, k, v, attn_mask)
    if out is not None:
        return out
    batch = check_attention_args("flash_attention", q, k, v, attn_mask)
    reason = flash_reason(q, k, v, attn_mask, batch)
    if not use_kernel("flash_attention", q, k, v, attn_mask, unsupported=reason):
        return reference.attention(q, k, v, attn_mask, scale)
    return _flash_planned(key, q, k, v, attn_mask, batch, scale)


# ---------------------------------------------------------------------------------------------
# The path choice


# The kernel's own head-dim bound; the active profile's on-chip memory may lower it further.
FLASH_MAX_HEAD_DIM = MAX_HEAD_DIM
# The partial softmax writes the scores X = q·kᵀ: at most this many bytes of them at a time (the
# query rows are split into chunks); None: the active profile's ``chunk_bytes()`` (256 MiB unless it
# sets an intermediate budget). SD's 4096-token self-attention would need 512 MiB at once.
PARTIAL_SOFTMAX_MAX_CHUNK_BYTES: int | None = None
PATHS = ("flash_wgmma", "flash", "partial_softmax", "sdpa")


def partial_softmax_chunk_bytes() -> int:
    from sd_kernels.profiles import active_profile

    return PARTIAL_SOFTMAX_MAX_CHUNK_BYTES or active_profile().chunk_bytes()


def _choose_path(q, k, v, attn_mask, batch, scale=None) -> str:
    """The active profile's policy (``Profile.attention_path``), then what the kernels can take."""
    from sd_kernels.profiles import active_profile

    profile, dtype = active_profile(), str(q.dtype).removeprefix("torch.")
    want = profile.attention_path(q.shape[-2], k.shape[-2], q.shape[-1], dtype)
    if want == "flash_wgmma":
        why = _wgmma.reason(q, k, v, attn_mask, scale)
        if why is None and use_kernel("flash_attention", q, k, v, attn_mask):
            return "flash_wgmma"
        if why is not None:
            declined("flash_wgmma", why)
        want = profile.attention_choice(q.shape[-2], k.shape[-2], q.shape[-1], dtype, wgmma=False)[0]
    reason = kernel_reason(q, k, v, attn_mask, batch=batch)
    flash_ok = (want == "flash" and reason is None and q.shape[-1] <= FLASH_MAX_HEAD_DIM
                and _flash_shape_reason(q, v) is None)
    if flash_ok and use_kernel("flash_attention", q, k, v, attn_mask):
        return "flash"
    if want != "sdpa" and use_kernel("partial_softmax_attention", q, k, v, attn_mask, unsupported=reason):
        return "partial_softmax"
    return "sdpa"


def attention_path(q, k, v, attn_mask=None, scale=None) -> str:
    """The path ``attention`` takes for these inputs: one of ``PATHS`` ("sdpa": stock)."""
    return _choose_path(q, k, v, attn_mask, check_attention_args("attention", q, k, v, attn_mask), scale)


# ``attention(..., precision="fp8")``: the opt-in lossy tier. Calls the FP8 kernel takes (head dim 64 or
# 128, no mask, at least FP8_MIN_KEYS keys) run there; every other call takes the exact path below, logged
# once per reason as declined. FP8_MIN_KEYS is where the FP8 kernel, its K/V pre-pass included, overtakes
# our exact attention at head dim 128 (H200, 2026-11-29, bench/results/2026-11-29-h200-fp8-tier-sizes:
# FLUX's 2,816 keys at 768² 0.986x, 4,608 at 1024² 1.09x, 9,728 at 1536² 1.27x, 16,896 at 2048² 1.32x): below
# it the pre-pass costs more than the 8-bit dots save, and FP8's error would buy nothing. (At head dim 64 the
# kernel measured slower at each size measured: 1,024, 4,096 and 4,429 keys.)
PRECISIONS = ("exact", "fp8")
FP8_MIN_KEYS = 3072
# The Q·Kᵀ mode (ops.attention_fp8's ``qk``) of the calls precision="fp8" routes, per head dim: int8 at 64
# (SageAttention's choice, the more accurate); e4m3 at 128, where the Hopper kernel runs it 10% faster than
# int8 on the Triton kernel and FLUX's image measured the same (H200, 2026-11-29: PSNR 47.12 dB against stock
# either way; bench/results/2026-11-29-h200-fp8-attention-in-tier)
FP8_QK = {64: "int8", 128: "fp8"}


def fp8_reason(q, k, v, attn_mask, scale) -> str | None:
    """Why a ``precision="fp8"`` call takes the exact path (arguments already checked), or None."""
    if k.shape[-2] < FP8_MIN_KEYS:
        return f"{k.shape[-2]} keys < FP8_MIN_KEYS {FP8_MIN_KEYS}"
    return _fp8.input_reason(q, k, v, attn_mask, scale)


def _fp8_or_none(q, k, v, attn_mask, scale, precision: str, kv_stats=None) -> torch.Tensor | None:
    """The FP8 kernel's output for a call ``precision`` routes to it, else None (the exact path)."""
    if precision not in PRECISIONS:
        raise ValueError(f"attention: precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "exact":
        return None
    batch = check_attention_args("attention", q, k, v, attn_mask)
    why = fp8_reason(q, k, v, attn_mask, scale) or _fp8.run_reason(q, k, v, batch) or device_reason(q.device)
    if why is not None:
        declined("attention_fp8", why)
        return None
    qk = FP8_QK[q.shape[-1]]  # fp8_reason took only the FP8 kernel's head dims
    if not use_kernel("attention_fp8", q, k, v):
        return None
    return _fp8.attention_fp8(q, k, v, None, scale, qk, kv_stats=kv_stats)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
    upcast: bool = False,
    precision: str = "exact",
    kv_stats: _fp8.KvStats | None = None,
) -> torch.Tensor:
    """Attention by the path ``attention_path`` picks: FlashAttention where it fits (the Hopper wgmma
    kernel at the head dims the profile lists for it), else the paper's partially fused softmax, else
    (no kernel can run, or the profile measured stock faster) ``F.scaled_dot_product_attention``.

    ``upcast`` (diffusers' ``upcast_attention``) asks for the scores in fp32: flash always keeps them
    in fp32 on chip; the partial softmax then writes its X in fp32 instead of the input dtype.

    A call like an earlier flash call (see ``_plan_key``) launches that call's plan directly.

    ``precision="fp8"`` (opt-in, lossy): calls ``fp8_reason`` accepts run ``ops.attention_fp8`` with the
    Q·Kᵀ mode ``FP8_QK`` gives their head dim (docs/kernels/attention_fp8.md); the rest as with "exact".
    ``kv_stats``: k's and v's statistics for the FP8 kernel's pre-pass (``ops.attention_fp8.KvStats``), from the
    op that wrote them; the exact paths ignore them.
    """
    if precision != "exact" and (out := _fp8_or_none(q, k, v, attn_mask, scale, precision, kv_stats)) is not None:
        return out
    key = _plan_key("attention", q, k, v, attn_mask, scale, upcast)
    out = _run_plan(key, q, k, v, attn_mask)
    if out is not None:
        return out
    batch = check_attention_args("attention", q, k, v, attn_mask)
    path = _choose_path(q, k, v, attn_mask, batch, scale)
    if path == "flash_wgmma":
        return _wgmma.attention_wgmma(q, k, v, scale)
    if path == "flash":
        return _flash_planned(key, q, k, v, attn_mask, batch, scale)
    if path == "partial_softmax":
        return _partial.partial_softmax_attention(
            q, k, v, attn_mask, scale, max_chunk_bytes=partial_softmax_chunk_bytes(),
            scores_dtype=torch.float32 if upcast else None,
        )
    return reference.sdpa(q, k, v, attn_mask, scale)
