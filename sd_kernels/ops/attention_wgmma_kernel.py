"""The Hopper attention kernel, written in Gluon (Triton 3.6's explicit-layout dialect).

Imported only by ``ops.attention_wgmma`` once it has checked the Triton version: Gluon is
experimental and its API changed after 3.6 (e.g. TMA copies were renamed), so this file is tied
to the version it was measured on. The math and the schedule: docs/kernels/attention.md, "The
Hopper kernel".

One program takes NC × BLOCK_M query rows of one (batch, head) in NC + 1 partitions:
- NC (2 or 3) consumer warpgroups of 4 warps, BLOCK_M = 64 rows each, with all of Q·Kᵀ, the online
  softmax and P·V in registers and wgmma; they take turns to issue their wgmmas (a token passed
  round a ring of mbarriers: FA3's ping-pong for two), so one's softmax runs while the tensor cores
  work for the others;
- one loader warp that streams K and V blocks through an NS-stage shared-memory ring by TMA.
The head dim is D_LO + D_HI columns (72 → 64 + 16); TMA reads the columns past D and the rows past
the sequence as zeros, so neither needs a mask; only a ragged last key block masks its scores.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)


@gluon.jit
def _loader(kd_lo, kd_hi, vd_lo, vd_hi, ring, b, h, n_blocks, BLOCK_N: gl.constexpr, HAS_HI: gl.constexpr):
    """Fill ring stage j % NS with key/value block j once every consumer released its last use."""
    k_lo, k_hi, v_lo, v_hi, ready, empty, _ = ring
    NS: gl.constexpr = k_lo.shape[0]
    D_LO: gl.constexpr = kd_lo.block_type.shape[3]
    nbytes: gl.constexpr = 2 * kd_lo.block_type.nbytes + 2 * kd_hi.block_type.nbytes * HAS_HI
    for j in range(n_blocks):
        s = j % NS
        mbarrier.wait(empty.index(s), ((j // NS) & 1) ^ 1)  # a fresh barrier passes phase 1
        bar = ready.index(s)
        mbarrier.expect(bar, nbytes)
        n0 = j * BLOCK_N
        tma.async_copy_global_to_shared(kd_lo, [b, n0, h, 0], bar, k_lo.index(s))
        tma.async_copy_global_to_shared(vd_lo, [b, n0, h, 0], bar, v_lo.index(s))
        if HAS_HI:
            tma.async_copy_global_to_shared(kd_hi, [b, n0, h, D_LO], bar, k_hi.index(s))
            tma.async_copy_global_to_shared(vd_hi, [b, n0, h, D_LO], bar, v_hi.index(s))


@gluon.jit
def _scores(q_lo, q_hi, k_lo, k_hi, s_acc, HAS_HI: gl.constexpr):
    """S = Q·Kᵀ over the D_LO (+ D_HI) columns, issued asynchronously."""
    BN: gl.constexpr = k_lo.shape[1]
    DL: gl.constexpr = k_lo.shape[3]
    s_acc = warpgroup_mma(q_lo, k_lo.reshape([BN, DL]).permute((1, 0)), s_acc, use_acc=False, is_async=True)
    if HAS_HI:
        DH: gl.constexpr = k_hi.shape[3]
        s_acc = warpgroup_mma(q_hi, k_hi.reshape([BN, DH]).permute((1, 0)), s_acc, is_async=True)
    return s_acc


@gluon.jit
def _pv(p_lo, p_hi, v_lo, v_hi, o_lo, o_hi, HAS_HI: gl.constexpr):
    """O += P·V into the D_LO (and D_HI) accumulators, issued asynchronously."""
    BN: gl.constexpr = v_lo.shape[1]
    DL: gl.constexpr = v_lo.shape[3]
    o_lo = warpgroup_mma(p_lo, v_lo.reshape([BN, DL]), o_lo, is_async=True)
    if HAS_HI:
        DH: gl.constexpr = v_hi.shape[3]
        o_hi = warpgroup_mma(p_hi, v_hi.reshape([BN, DH]), o_hi, is_async=True)
    else:
        o_hi = warpgroup_mma_init(o_hi)
    return o_lo, o_hi


@gluon.jit
def _masked(s, n0, Sk, s_layout: gl.constexpr, BLOCK_N: gl.constexpr, EVEN_K: gl.constexpr):
    """Scores of keys past Sk to -inf (only the ragged last block has any)."""
    if not EVEN_K:
        if n0 + BLOCK_N > Sk:
            cols = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            s = gl.where(gl.expand_dims(cols < Sk, 0), s, float("-inf"))
    return s


@gluon.jit
def _rescaled(o, factor, layout: gl.constexpr):
    return o * gl.expand_dims(gl.convert_layout(factor, gl.SliceLayout(1, layout)), 1)


@gluon.jit
def _consumer(qo, ring, b, h, m0, n_blocks, Sk, qk_scale, HAS_HI: gl.constexpr, EVEN_K: gl.constexpr,
              WG: gl.constexpr, NC: gl.constexpr):
    """Rows m0 .. m0 + BLOCK_M: Q·Kᵀ of block j and P·V of block j-1 go out together, the softmax of
    block j runs under the P·V, then O is rescaled (FA3's intra-warpgroup overlap)."""
    qd_lo, qd_hi, od_lo, od_hi = qo
    k_lo, k_hi, v_lo, v_hi, ready, empty, turn = ring
    num_warps: gl.constexpr = gl.num_warps()
    NS: gl.constexpr = k_lo.shape[0]
    BLOCK_N: gl.constexpr = k_lo.shape[2]
    BLOCK_M: gl.constexpr = qd_lo.block_type.shape[1]
    DL: gl.constexpr = qd_lo.block_type.shape[3]
    DH: gl.constexpr = qd_hi.block_type.shape[3]
    dtype: gl.constexpr = qd_lo.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    lo_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                        instr_shape=[16, DL, 16])
    hi_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                        instr_shape=[16, DH, 16])
    plo_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=lo_layout, k_width=2)
    phi_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=hi_layout, k_width=2)

    # Q: one TMA load into shared memory, the A operand of every Q·Kᵀ; later O's staging buffer.
    q_lo_s = gl.allocate_shared_memory(dtype, qd_lo.block_type.shape, qd_lo.layout)
    q_hi_s = gl.allocate_shared_memory(dtype, qd_hi.block_type.shape, qd_hi.layout)
    qbar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(qbar, count=1)
    mbarrier.expect(qbar, qd_lo.block_type.nbytes + qd_hi.block_type.nbytes * HAS_HI)
    tma.async_copy_global_to_shared(qd_lo, [b, m0, h, 0], qbar, q_lo_s)
    if HAS_HI:
        tma.async_copy_global_to_shared(qd_hi, [b, m0, h, DL], qbar, q_hi_s)
    mbarrier.wait(qbar, 0)
    q_lo = q_lo_s.reshape([BLOCK_M, DL])
    q_hi = q_hi_s.reshape([BLOCK_M, DH])

    # key block 0: scores and softmax; its P·V goes out with the next block's scores
    s_acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    mbarrier.wait(ready.index(0), 0)
    s_acc = _scores(q_lo, q_hi, k_lo.index(0), k_hi.index(0), s_acc, HAS_HI)
    s_acc = warpgroup_mma_wait(0, deps=(s_acc, ))
    # the row max on the raw scores (qk_scale > 0), so that scale and shift are one FFMA per score
    s = _masked(s_acc, 0, Sk, s_layout, BLOCK_N, EVEN_K)
    m_i = gl.max(s, axis=1) * qk_scale
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_i, 1))
    l_i = gl.sum(p, axis=1)
    p_lo = gl.convert_layout(p.to(dtype), plo_layout)
    p_hi = gl.convert_layout(p.to(dtype), phi_layout)
    o_lo = gl.zeros([BLOCK_M, DL], gl.float32, lo_layout)
    o_hi = gl.zeros([BLOCK_M, DH], gl.float32, hi_layout)

    for j in range(1, n_blocks):
        st = j % NS
        sp = (j - 1) % NS
        mbarrier.wait(ready.index(st), (j // NS) & 1)
        # the token ring: warpgroup WG issues after WG - 1 did in this round (WG 0 after the last
        # one's previous round; its first wait passes on the fresh barrier's phase 1)
        mbarrier.wait(turn.index(WG), ((j - 1) & 1) ^ (1 if WG == 0 else 0))
        s_acc = _scores(q_lo, q_hi, k_lo.index(st), k_hi.index(st), s_acc, HAS_HI)
        o_lo, o_hi = _pv(p_lo, p_hi, v_lo.index(sp), v_hi.index(sp), o_lo, o_hi, HAS_HI)
        mbarrier.arrive(turn.index((WG + 1) % NC), count=1)
        s_acc = warpgroup_mma_wait(1 + HAS_HI, deps=(s_acc, ))  # the scores; P·V may still run
        s = _masked(s_acc, j * BLOCK_N, Sk, s_layout, BLOCK_N, EVEN_K)
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m_new
        p16 = p.to(dtype)
        o_lo, o_hi = warpgroup_mma_wait(0, deps=(o_lo, o_hi))
        mbarrier.arrive(empty.index(sp), count=1)  # block j-1's K and V are no longer read
        o_lo = _rescaled(o_lo, alpha, lo_layout)
        o_hi = _rescaled(o_hi, alpha, hi_layout)
        p_lo = gl.convert_layout(p16, plo_layout)
        p_hi = gl.convert_layout(p16, phi_layout)

    sl = (n_blocks - 1) % NS
    o_lo, o_hi = _pv(p_lo, p_hi, v_lo.index(sl), v_hi.index(sl), o_lo, o_hi, HAS_HI)
    o_lo, o_hi = warpgroup_mma_wait(0, deps=(o_lo, o_hi))
    mbarrier.arrive(empty.index(sl), count=1)

    inv = 1.0 / l_i
    q_lo.store(_rescaled(o_lo, inv, lo_layout).to(dtype))
    if HAS_HI:
        q_hi.store(_rescaled(o_hi, inv, hi_layout).to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(od_lo, [b, m0, h, 0], q_lo_s)
    if HAS_HI:
        tma.async_copy_shared_to_global(od_hi, [b, m0, h, DL], q_hi_s)
    tma.store_wait(0)


@gluon.jit
def ring_barriers(NS: gl.constexpr, NC: gl.constexpr):
    """The ring's mbarriers: ready[NS] (the loader's TMA landed a stage), empty[NS] (all NC consumers
    released it) and the consumers' token ring turn[NC]."""
    ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NS):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=NC)  # every consumer releases a stage
    turn = gl.allocate_shared_memory(gl.int64, [NC, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NC):
        mbarrier.init(turn.index(i), count=1)
    return ready, empty, turn


@gluon.jit(do_not_specialize=["Sk"])  # Sk only bounds the loop and masks: one compilation for every length
def _attn_wgmma_fwd(qd_lo, qd_hi, kd_lo, kd_hi, vd_lo, vd_hi, od_lo, od_hi, H, Sk, qk_scale,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NS: gl.constexpr, HAS_HI: gl.constexpr,
                    EVEN_K: gl.constexpr, NC: gl.constexpr, CONSUMER_REGS: gl.constexpr):
    """Grid (cdiv(Sq, NC·BLOCK_M), B·H); descriptors over [B, S, H, D] with blocks [1, rows, 1, D_*].
    qk_scale = scale·log2(e) > 0. CONSUMER_REGS: registers per thread of each consumer that runs as
    a worker partition (the first consumer is the default partition). EVEN_K: Sk is a multiple of
    BLOCK_N, the ragged-block test compiled out (benchmarks; the launcher passes False)."""
    m0 = gl.program_id(0) * (NC * BLOCK_M)
    bh = gl.program_id(1)
    b = bh // H
    h = bh % H
    n_blocks = gl.cdiv(Sk, BLOCK_N)
    k_lo = gl.allocate_shared_memory(kd_lo.dtype, [NS] + kd_lo.block_type.shape, kd_lo.layout)
    v_lo = gl.allocate_shared_memory(vd_lo.dtype, [NS] + vd_lo.block_type.shape, vd_lo.layout)
    k_hi = gl.allocate_shared_memory(kd_hi.dtype, [NS] + kd_hi.block_type.shape, kd_hi.layout)
    v_hi = gl.allocate_shared_memory(vd_hi.dtype, [NS] + vd_hi.block_type.shape, vd_hi.layout)
    ready, empty, turn = ring_barriers(NS, NC)
    qo = (qd_lo, qd_hi, od_lo, od_hi)
    ring = (k_lo, k_hi, v_lo, v_hi, ready, empty, turn)
    if NC == 2:
        gl.warp_specialize([
            (_consumer, (qo, ring, b, h, m0, n_blocks, Sk, qk_scale, HAS_HI, EVEN_K, 0, NC)),
            (_consumer, (qo, ring, b, h, m0 + BLOCK_M, n_blocks, Sk, qk_scale, HAS_HI, EVEN_K, 1, NC)),
            (_loader, (kd_lo, kd_hi, vd_lo, vd_hi, ring, b, h, n_blocks, BLOCK_N, HAS_HI)),
        ], [4, 1], [CONSUMER_REGS, 24])
    else:
        gl.warp_specialize([
            (_consumer, (qo, ring, b, h, m0, n_blocks, Sk, qk_scale, HAS_HI, EVEN_K, 0, NC)),
            (_consumer, (qo, ring, b, h, m0 + BLOCK_M, n_blocks, Sk, qk_scale, HAS_HI, EVEN_K, 1, NC)),
            (_consumer, (qo, ring, b, h, m0 + 2 * BLOCK_M, n_blocks, Sk, qk_scale, HAS_HI, EVEN_K, 2, NC)),
            (_loader, (kd_lo, kd_hi, vd_lo, vd_hi, ring, b, h, n_blocks, BLOCK_N, HAS_HI)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, 24])
