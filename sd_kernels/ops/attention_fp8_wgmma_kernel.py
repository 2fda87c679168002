"""FP8 attention's Hopper kernel, written in Gluon (Triton 3.6's explicit-layout dialect).

Imported only by ``ops.attention_fp8_wgmma`` once it has checked the Triton version (Gluon's API
changed after 3.6). It computes ``reference.attention_fp8``'s algorithm with ``pv="fp8"`` on the
schedule of the exact Hopper kernel (ops/attention_wgmma_kernel.py), with 8-bit operands:

- one loader warp streams the pre-pass's 8-bit K [B·H, S_PAD, D] and e4m3 Vᵀ [B·H, D, S_PAD] blocks
  through an NS-stage shared-memory ring by TMA (both K-major, as Hopper's 8-bit wgmma reads B);
- NC consumer warpgroups of 64 query rows each load their Q tile once, quantize it per row in
  registers (int8 or e4m3) into shared memory, and (PINGPONG) take turns on the tensor cores (a token
  ring);
- per key block: S = Q8·K8ᵀ (int32 or fp32), the block's scale and the row's scale in one factor,
  the online softmax with P scaled by 448 inside the exponent (exp2(s − (m − log2 448)) = 448·p, so the
  e4m3 conversion needs no multiply and the row sum is 448·l), P·V on e4m3 into fp32.
The math and the measurements: docs/kernels/attention_fp8.md.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .attention_fp8_wgmma import P_KEY_PERM, P_KEY_SPLIT
from .attention_wgmma_kernel import ring_barriers

_SPLIT = gl.constexpr(P_KEY_SPLIT)
_PERM = gl.constexpr(P_KEY_PERM)
LOG2_448 = gl.constexpr(8.807354922057604)  # log2(448), e4m3's largest finite value
SCALE_TINY = gl.constexpr(2.0**-119)  # reference.SCALE_TINY: amax at most this quantizes to zeros
# four fp32 → four e4m3 in one register, $1 lowest: round to nearest even, saturating (448·p may pass 448
# by the rounding of the int8 path's folded bias, a factor 2^(1.5·c) of the row's largest p)
_E4M3X4 = gl.constexpr("{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; "
                       "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; mov.b32 $0, {lo, hi}; }")


@gluon.jit
def _loader(kd, vd, k_s, v_s, ready, empty, bh, n_blocks):
    """Fill ring stage j % NS with key block j (K8 rows, Vᵀ columns) once every consumer released it."""
    NS: gl.constexpr = k_s.shape[0]
    BLOCK_N: gl.constexpr = kd.block_type.shape[1]
    nbytes: gl.constexpr = kd.block_type.nbytes + vd.block_type.nbytes
    for j in range(n_blocks):
        s = j % NS
        mbarrier.wait(empty.index(s), ((j // NS) & 1) ^ 1)  # a fresh barrier passes phase 1
        bar = ready.index(s)
        mbarrier.expect(bar, nbytes)
        tma.async_copy_global_to_shared(kd, [bh, j * BLOCK_N, 0], bar, k_s.index(s))
        tma.async_copy_global_to_shared(vd, [bh, 0, j * BLOCK_N], bar, v_s.index(s))


@gluon.jit
def _quantized_q(qd, b, h, m0, QK_INT8: gl.constexpr):
    """Q's tile by TMA, then per row q8 = round(q·QMAX/max|q|) into shared memory (the A operand of
    every Q·Kᵀ); returns (the fp16/bf16 tile's buffer, later O's staging buffer; q8's buffer; the rows'
    scales max|q|/QMAX)."""
    num_warps: gl.constexpr = gl.num_warps()
    BLOCK_M: gl.constexpr = qd.block_type.shape[1]
    D: gl.constexpr = qd.block_type.shape[3]
    q_s = gl.allocate_shared_memory(qd.dtype, qd.block_type.shape, qd.layout)
    qbar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(qbar, count=1)
    mbarrier.expect(qbar, qd.block_type.nbytes)
    tma.async_copy_global_to_shared(qd, [b, m0, h, 0], qbar, q_s)
    mbarrier.wait(qbar, 0)
    rows: gl.constexpr = gl.BlockedLayout([1, 8], [256 // D, D // 8], [num_warps, 1], [1, 0])
    q = q_s.reshape([BLOCK_M, D]).load(rows).to(gl.float32)
    amax = gl.max(gl.abs(q), axis=1)
    QMAX: gl.constexpr = 127.0 if QK_INT8 else 448.0
    big = amax > SCALE_TINY
    inv = gl.where(big, gl.div_rn(gl.full([BLOCK_M], QMAX, gl.float32, amax.type.layout), gl.where(big, amax, 1.0)),
                   0.0)
    x = q * gl.expand_dims(inv, 1)
    if QK_INT8:  # 1.5·2^23 added and taken away rounds to the nearest integer, ties to even
        q8 = ((x + 12582912.0) - 12582912.0).to(gl.int8)
        kind: gl.constexpr = gl.int8
    else:
        q8 = x.to(gl.float8e4nv)
        kind: gl.constexpr = gl.float8e4nv
    q8_s = gl.allocate_shared_memory(kind, [BLOCK_M, D], gl.NVMMASharedLayout.get_default_for([BLOCK_M, D], kind))
    q8_s.store(q8)
    fence_async_shared()
    return q_s, q8_s, amax / QMAX


@gluon.jit
def _probabilities(s_acc, m_i, c, n0, Sk, QK_INT8: gl.constexpr):
    """448·exp2(S·c − m_new) for one key block and the new running max m_new; c ≥ 0 per row. Keys
    past Sk (only in a ragged last block) get 0."""
    s_layout: gl.constexpr = s_acc.type.layout
    BLOCK_N: gl.constexpr = s_acc.shape[1]
    BIAS: gl.constexpr = 12582912.0  # 1.5·2^23: int32 scores (|s| < 2^22) + its bits are s + BIAS in fp32
    if n0 + BLOCK_N > Sk:  # scale before masking: 0·(−inf) would be NaN
        if QK_INT8:
            s = (s_acc + 0x4B400000).to(gl.float32, bitcast=True) - BIAS
        else:
            s = s_acc
        cols = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        t = gl.where(gl.expand_dims(cols < Sk, 0), s * gl.expand_dims(c, 1), float("-inf"))
        m_new = gl.maximum(m_i, gl.max(t, axis=1))
        x = t - gl.expand_dims(m_new - LOG2_448, 1)
    elif QK_INT8:  # int32 → fp32 without cvt (quarter rate) and the bias in the FFMA's addend
        sb = (s_acc + 0x4B400000).to(gl.float32, bitcast=True)
        m_new = gl.maximum(m_i, (gl.max(sb, axis=1) - BIAS) * c)
        x = sb * gl.expand_dims(c, 1) - gl.expand_dims(m_new - LOG2_448 + BIAS * c, 1)
    else:  # c ≥ 0, so max(s)·c = max(s·c), and scale and shift are one FFMA per score
        m_new = gl.maximum(m_i, gl.max(s_acc, axis=1) * c)
        x = s_acc * gl.expand_dims(c, 1) - gl.expand_dims(m_new - LOG2_448, 1)
    return gl.exp2(x), m_new


@gluon.jit
def _operand(p, p_layout: gl.constexpr):
    """P (fp32, the scores' accumulator layout) as the e4m3 A operand of P·V, without moving a value
    between threads: the accumulator holds keys 32c + 16a + 8b + 2t + e of each 32-key chunk c in thread
    t of a quad, the operand wants 32c + 16a + 4t + 2b + e there, so swapping b and t relabels the keys
    (a register renaming) and the pre-pass wrote Vᵀ's keys in that order (ops.attention_fp8's
    ``wgmma_key_order``; the sum over keys does not care about their order). Then four e4m3 per
    register, as the wgmma reads them."""
    BLOCK_M: gl.constexpr = p.shape[0]
    BLOCK_N: gl.constexpr = p.shape[1]
    p = p.reshape([BLOCK_M, BLOCK_N // 32, _SPLIT[0], _SPLIT[1], _SPLIT[2], _SPLIT[3]]).permute(_PERM.value)
    p = p.reshape([BLOCK_M, BLOCK_N])
    return gl.inline_asm_elementwise(_E4M3X4, "=r,r,r,r,r", [gl.convert_layout(p, p_layout)], dtype=gl.float8e4nv,
                                     is_pure=True, pack=4)


@gluon.jit
def _consumer(qd, od, ring, k_scale, v_scale, b, h, m0, n_blocks, Sk, qk_scale, QK_INT8: gl.constexpr,
              WG: gl.constexpr, NC: gl.constexpr, PINGPONG: gl.constexpr):
    """Rows m0 .. m0 + 64: Q·Kᵀ of block j and P·V of block j-1 go out together, the softmax of block
    j runs under the P·V, then O is rescaled (as the exact kernel's consumer). PINGPONG: the consumers
    issue their wgmmas in turn (the token ring); else each as soon as its stage is ready."""
    k_s, v_s, ready, empty, turn = ring
    num_warps: gl.constexpr = gl.num_warps()
    NS: gl.constexpr = k_s.shape[0]
    BLOCK_N: gl.constexpr = k_s.shape[2]
    D: gl.constexpr = k_s.shape[3]
    BLOCK_M: gl.constexpr = qd.block_type.shape[1]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 32])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, D, 32])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

    q_s, q8_s, q_scale = _quantized_q(qd, b, h, m0, QK_INT8)
    row_scale = gl.convert_layout(q_scale * qk_scale, row_layout)  # × the block's scale: the scores' factor

    acc_type: gl.constexpr = gl.int32 if QK_INT8 else gl.float32
    s_acc = gl.zeros([BLOCK_M, BLOCK_N], acc_type, s_layout)
    mbarrier.wait(ready.index(0), 0)
    s_acc = warpgroup_mma(q8_s, k_s.index(0).reshape([BLOCK_N, D]).permute((1, 0)), s_acc, use_acc=False,
                          is_async=True)
    ks = gl.load(k_scale)
    s_acc = warpgroup_mma_wait(0, deps=(s_acc, ))
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_layout)
    p, m_i = _probabilities(s_acc, m_i, row_scale * ks, 0, Sk, QK_INT8)
    l_i = gl.sum(p, axis=1)
    o = gl.zeros([BLOCK_M, D], gl.float32, o_layout)

    for j in range(1, n_blocks):
        # block j-1's P as the P·V operand, converted in the iteration that issues its wgmma: 8-bit
        # values carried across the loop would cross it one to a register and be packed again here
        p8 = _operand(p, p_layout)
        st = j % NS
        sp = (j - 1) % NS
        ks = gl.load(k_scale + j)  # its latency hides under the waits and the scores' wgmma
        mbarrier.wait(ready.index(st), (j // NS) & 1)
        if PINGPONG:
            mbarrier.wait(turn.index(WG), ((j - 1) & 1) ^ (1 if WG == 0 else 0))
        s_acc = warpgroup_mma(q8_s, k_s.index(st).reshape([BLOCK_N, D]).permute((1, 0)), s_acc, use_acc=False,
                              is_async=True)
        o = warpgroup_mma(p8, v_s.index(sp).reshape([D, BLOCK_N]).permute((1, 0)), o, is_async=True)
        if PINGPONG:
            mbarrier.arrive(turn.index((WG + 1) % NC), count=1)
        s_acc = warpgroup_mma_wait(1, deps=(s_acc, ))  # the scores; P·V may still run
        p, m_new = _probabilities(s_acc, m_i, row_scale * ks, j * BLOCK_N, Sk, QK_INT8)
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m_new
        o = warpgroup_mma_wait(0, deps=(o, ))
        mbarrier.arrive(empty.index(sp), count=1)  # block j-1's K and V are no longer read
        o = o * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)

    sl = (n_blocks - 1) % NS
    p8 = _operand(p, p_layout)
    o = warpgroup_mma(p8, v_s.index(sl).reshape([D, BLOCK_N]).permute((1, 0)), o, is_async=True)
    o = warpgroup_mma_wait(0, deps=(o, ))
    mbarrier.arrive(empty.index(sl), count=1)

    _store(o, l_i, v_scale, q_s, od, b, m0, h)


@gluon.jit
def _store(o, l_i, v_scale, q_s, od, b, m0, h):
    """out = acc·s_v[d]/(448·l) (l_i holds 448·l), staged in Q's buffer and stored by TMA."""
    o_layout: gl.constexpr = o.type.layout
    BLOCK_M: gl.constexpr = o.shape[0]
    D: gl.constexpr = o.shape[1]
    vs = gl.load(v_scale + gl.arange(0, D, layout=gl.SliceLayout(0, o_layout)))
    inv = gl.convert_layout(1.0 / l_i, gl.SliceLayout(1, o_layout))
    out = o * gl.expand_dims(vs, 0) * gl.expand_dims(inv, 1)
    q_s.reshape([BLOCK_M, D]).store(out.to(od.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(od, [b, m0, h, 0], q_s)
    tma.store_wait(0)


@gluon.jit(do_not_specialize=["Sk", "N_BLOCKS"])  # one compilation for every sequence length
def _attn_fp8_wgmma_fwd(qd, kd, vd, od, KScale, VScale, H, Sk, N_BLOCKS, qk_scale, NS: gl.constexpr,
                        QK_INT8: gl.constexpr, NC: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                        PINGPONG: gl.constexpr):
    """Grid (cdiv(Sq, NC·64), B·H). qd, od: [B, S, H, D] descriptors, blocks [1, 64, 1, D] (fp16/bf16);
    kd: the pre-pass's K8 [B·H, S_PAD, D], blocks [1, BLOCK_N, D]; vd: its Vᵀ [B·H, D, S_PAD], blocks
    [1, D, BLOCK_N]; KScale [B·H, N_BLOCKS] and VScale [B·H, D] fp32. qk_scale = scale·log2(e) > 0.
    CONSUMER_REGS: registers per thread of each consumer that runs as a worker partition; PINGPONG: the
    consumers take turns on the tensor cores."""
    BLOCK_M: gl.constexpr = qd.block_type.shape[1]
    D: gl.constexpr = qd.block_type.shape[3]
    m0 = gl.program_id(0) * (NC * BLOCK_M)
    bh = gl.program_id(1)
    b = bh // H
    h = bh % H
    k_s = gl.allocate_shared_memory(kd.dtype, [NS] + kd.block_type.shape, kd.layout)
    v_s = gl.allocate_shared_memory(vd.dtype, [NS] + vd.block_type.shape, vd.layout)
    ready, empty, turn = ring_barriers(NS, NC)
    ring = (k_s, v_s, ready, empty, turn)
    ksc = KScale + bh * N_BLOCKS
    vsc = VScale + bh * D
    if NC == 2:
        gl.warp_specialize([
            (_consumer, (qd, od, ring, ksc, vsc, b, h, m0, N_BLOCKS, Sk, qk_scale, QK_INT8, 0, NC, PINGPONG)),
            (_consumer, (qd, od, ring, ksc, vsc, b, h, m0 + BLOCK_M, N_BLOCKS, Sk, qk_scale, QK_INT8, 1, NC,
                         PINGPONG)),
            (_loader, (kd, vd, k_s, v_s, ready, empty, bh, N_BLOCKS)),
        ], [4, 1], [CONSUMER_REGS, 24])
    else:
        gl.warp_specialize([
            (_consumer, (qd, od, ring, ksc, vsc, b, h, m0, N_BLOCKS, Sk, qk_scale, QK_INT8, 0, NC, PINGPONG)),
            (_consumer, (qd, od, ring, ksc, vsc, b, h, m0 + BLOCK_M, N_BLOCKS, Sk, qk_scale, QK_INT8, 1, NC,
                         PINGPONG)),
            (_consumer, (qd, od, ring, ksc, vsc, b, h, m0 + 2 * BLOCK_M, N_BLOCKS, Sk, qk_scale, QK_INT8, 2,
                         NC, PINGPONG)),
            (_loader, (kd, vd, k_s, v_s, ready, empty, bh, N_BLOCKS)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, 24])
