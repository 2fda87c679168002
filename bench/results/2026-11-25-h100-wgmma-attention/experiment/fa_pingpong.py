"""Experiment: Hopper attention in Gluon (Triton 3.6), with explicit wgmma pipelining.

One program = 2 x BLOCK_M (64) query rows of one (batch, head): two consumer warpgroups, each its own partition.
A 1-warp loader partition streams K and V blocks through an NS-stage ring with TMA.
The consumer overlaps the softmax of key block j with the P.V wgmma of block j-1
(issued asynchronously), so the exponentials run under the tensor cores.
Head dim D = D_LO + D_HI (64 + 16 for PixArt's 72: columns past D read as zeros by TMA).
Tensors are [B, S, H, D] views (diffusers' layout), 4-D descriptors.
"""
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.experimental.gluon.language.nvidia.hopper import (
    tma, mbarrier, fence_async_shared, warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma_init


@gluon.jit
def _loader(kd_lo, kd_hi, vd_lo, vd_hi, k_lo, k_hi, v_lo, v_hi, ready, empty, b, h, n_blocks,
            BLOCK_N: gl.constexpr, HAS_HI: gl.constexpr):
    NS: gl.constexpr = k_lo.shape[0]
    nbytes: gl.constexpr = 2 * kd_lo.block_type.nbytes + 2 * kd_hi.block_type.nbytes * HAS_HI
    for j in range(n_blocks):
        s = j % NS
        mbarrier.wait(empty.index(s), ((j // NS) & 1) ^ 1)
        bar = ready.index(s)
        mbarrier.expect(bar, nbytes)
        n0 = j * BLOCK_N
        tma.async_copy_global_to_shared(kd_lo, [b, n0, h, 0], bar, k_lo.index(s))
        tma.async_copy_global_to_shared(vd_lo, [b, n0, h, 0], bar, v_lo.index(s))
        if HAS_HI:
            D_LO: gl.constexpr = kd_lo.block_type.shape[3]
            tma.async_copy_global_to_shared(kd_hi, [b, n0, h, D_LO], bar, k_hi.index(s))
            tma.async_copy_global_to_shared(vd_hi, [b, n0, h, D_LO], bar, v_hi.index(s))


@gluon.jit
def _scores(q_lo, q_hi, k_lo, k_hi, s_acc, HAS_HI: gl.constexpr):
    BN: gl.constexpr = k_lo.shape[1]
    DL: gl.constexpr = k_lo.shape[3]
    kl = k_lo.reshape([BN, DL]).permute((1, 0))
    s_acc = warpgroup_mma(q_lo, kl, s_acc, use_acc=False, is_async=True)
    if HAS_HI:
        DH: gl.constexpr = k_hi.shape[3]
        kh = k_hi.reshape([BN, DH]).permute((1, 0))
        s_acc = warpgroup_mma(q_hi, kh, s_acc, is_async=True)
    return s_acc


@gluon.jit
def _pv(p_lo, p_hi, v_lo, v_hi, o_lo, o_hi, HAS_HI: gl.constexpr):
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
    if not EVEN_K:
        if n0 + BLOCK_N > Sk:
            cols = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            s = gl.where(gl.expand_dims(cols < Sk, 0), s, float("-inf"))
    return s


@gluon.jit
def _compute(qd_lo, qd_hi, od_lo, od_hi, k_lo, k_hi, v_lo, v_hi, ready, empty, turn, b, h, m0, n_blocks, Sk,
             qk_scale, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HAS_HI: gl.constexpr,
             EVEN_K: gl.constexpr, WG: gl.constexpr, PINGPONG: gl.constexpr):
    num_warps: gl.constexpr = gl.num_warps()
    NS: gl.constexpr = k_lo.shape[0]
    DL: gl.constexpr = qd_lo.block_type.shape[3]
    DH: gl.constexpr = qd_hi.block_type.shape[3]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    lo_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                        instr_shape=[16, DL, 16])
    hi_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                        instr_shape=[16, DH, 16])
    plo_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=lo_layout, k_width=2)
    phi_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=hi_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)

    # Q: one TMA load, kept in shared memory for every Q.K^T wgmma.
    q_lo_s = gl.allocate_shared_memory(qd_lo.dtype, qd_lo.block_type.shape, qd_lo.layout)
    q_hi_s = gl.allocate_shared_memory(qd_hi.dtype, qd_hi.block_type.shape, qd_hi.layout)
    qbar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(qbar, count=1)
    mbarrier.expect(qbar, qd_lo.block_type.nbytes + qd_hi.block_type.nbytes * HAS_HI)
    tma.async_copy_global_to_shared(qd_lo, [b, m0, h, 0], qbar, q_lo_s)
    if HAS_HI:
        tma.async_copy_global_to_shared(qd_hi, [b, m0, h, DL], qbar, q_hi_s)
    mbarrier.wait(qbar, 0)
    q_lo = q_lo_s.reshape([BLOCK_M, DL])
    q_hi = q_hi_s.reshape([BLOCK_M, DH])

    # Key block 0: scores, then its softmax; its P.V is issued in the loop.
    s_acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    mbarrier.wait(ready.index(0), 0)
    s_acc = _scores(q_lo, q_hi, k_lo.index(0), k_hi.index(0), s_acc, HAS_HI)
    s_acc = warpgroup_mma_wait(0, deps=(s_acc, ))
    s = _masked(s_acc, 0, Sk, s_layout, BLOCK_N, EVEN_K) * qk_scale
    m_i = gl.max(s, axis=1)
    p = gl.exp2(s - gl.expand_dims(m_i, 1))
    l_i = gl.sum(p, axis=1)
    p16 = p.to(gl.float16)
    p_lo = gl.convert_layout(p16, plo_layout)
    p_hi = gl.convert_layout(p16, phi_layout)
    o_lo = gl.zeros([BLOCK_M, DL], gl.float32, lo_layout)
    o_hi = gl.zeros([BLOCK_M, DH], gl.float32, hi_layout)

    for j in range(1, n_blocks):
        st = j % NS
        sp = (j - 1) % NS
        mbarrier.wait(ready.index(st), (j // NS) & 1)
        if PINGPONG:  # the warpgroups take turns to issue their wgmmas (FA3's ping-pong)
            mbarrier.wait(turn.index(WG), ((j - 1) & 1) ^ (1 - WG))
        s_acc = _scores(q_lo, q_hi, k_lo.index(st), k_hi.index(st), s_acc, HAS_HI)
        o_lo, o_hi = _pv(p_lo, p_hi, v_lo.index(sp), v_hi.index(sp), o_lo, o_hi, HAS_HI)
        if PINGPONG:
            mbarrier.arrive(turn.index(1 - WG), count=1)
        # the scores are ready once at most the P.V wgmmas are in flight
        s_acc = warpgroup_mma_wait(1 + HAS_HI, deps=(s_acc, ))
        s = _masked(s_acc, j * BLOCK_N, Sk, s_layout, BLOCK_N, EVEN_K) * qk_scale
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - gl.expand_dims(m_new, 1))
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m_new
        p16 = p.to(gl.float16)
        o_lo, o_hi = warpgroup_mma_wait(0, deps=(o_lo, o_hi))
        mbarrier.arrive(empty.index(sp), count=1)
        o_lo = o_lo * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, lo_layout)), 1)
        o_hi = o_hi * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, hi_layout)), 1)
        p_lo = gl.convert_layout(p16, plo_layout)
        p_hi = gl.convert_layout(p16, phi_layout)

    sl = (n_blocks - 1) % NS
    o_lo, o_hi = _pv(p_lo, p_hi, v_lo.index(sl), v_hi.index(sl), o_lo, o_hi, HAS_HI)
    o_lo, o_hi = warpgroup_mma_wait(0, deps=(o_lo, o_hi))
    mbarrier.arrive(empty.index(sl), count=1)

    inv = 1.0 / l_i
    o_lo = o_lo * gl.expand_dims(gl.convert_layout(inv, gl.SliceLayout(1, lo_layout)), 1)
    q_lo.store(o_lo.to(od_lo.dtype))
    if HAS_HI:
        o_hi = o_hi * gl.expand_dims(gl.convert_layout(inv, gl.SliceLayout(1, hi_layout)), 1)
        q_hi.store(o_hi.to(od_hi.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(od_lo, [b, m0, h, 0], q_lo_s)
    if HAS_HI:
        tma.async_copy_shared_to_global(od_hi, [b, m0, h, DL], q_hi_s)
    tma.store_wait(0)


@gluon.jit
def attn_fwd(qd_lo, qd_hi, kd_lo, kd_hi, vd_lo, vd_hi, od_lo, od_hi, H, Sk, qk_scale,
             BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NS: gl.constexpr, HAS_HI: gl.constexpr,
             EVEN_K: gl.constexpr, SCHED: gl.constexpr, num_warps: gl.constexpr):
    m0 = gl.program_id(0) * (2 * BLOCK_M)
    bh = gl.program_id(1)
    b = bh // H
    h = bh % H
    n_blocks = gl.cdiv(Sk, BLOCK_N)
    k_lo = gl.allocate_shared_memory(kd_lo.dtype, [NS] + kd_lo.block_type.shape, kd_lo.layout)
    v_lo = gl.allocate_shared_memory(vd_lo.dtype, [NS] + vd_lo.block_type.shape, vd_lo.layout)
    k_hi = gl.allocate_shared_memory(kd_hi.dtype, [NS] + kd_hi.block_type.shape, kd_hi.layout)
    v_hi = gl.allocate_shared_memory(vd_hi.dtype, [NS] + vd_hi.block_type.shape, vd_hi.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NS):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    # two consumer warpgroups, each its own partition (64 query rows each) so that they drift apart
    # and one's softmax runs under the other's wgmmas; one loader warp.
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(turn.index(0), count=1)
    mbarrier.init(turn.index(1), count=1)
    PINGPONG: gl.constexpr = SCHED == 3
    gl.warp_specialize([
        (_compute, (qd_lo, qd_hi, od_lo, od_hi, k_lo, k_hi, v_lo, v_hi, ready, empty, turn, b, h, m0, n_blocks, Sk,
                    qk_scale, BLOCK_M, BLOCK_N, HAS_HI, EVEN_K, 0, PINGPONG)),
        (_compute, (qd_lo, qd_hi, od_lo, od_hi, k_lo, k_hi, v_lo, v_hi, ready, empty, turn, b, h, m0 + BLOCK_M,
                    n_blocks, Sk, qk_scale, BLOCK_M, BLOCK_N, HAS_HI, EVEN_K, 1, PINGPONG)),
        (_loader, (kd_lo, kd_hi, vd_lo, vd_hi, k_lo, k_hi, v_lo, v_hi, ready, empty, b, h, n_blocks, BLOCK_N,
                   HAS_HI)),
    ], [4, 1], [240, 24])


def descriptors(x, rows, d_lo, d_hi):
    """4-D [B, S, H, D] descriptors of x (a [B, H, S, D] view of [B, S, H, D] storage)."""
    B, H, S, D = x.shape
    shape = [B, S, H, D]
    strides = [x.stride(0), x.stride(2), x.stride(1), 1]
    out = []
    for w in (d_lo, d_hi):
        block = [1, rows, 1, w]
        lay = gl.NVMMASharedLayout.get_default_for(block, gl.float16)
        out.append(TensorDescriptor(x, shape, strides, block, lay))
    return out


def split_dim(D):
    if D <= 64:
        return 64, 16, False  # hi unused
    if D <= 80:
        return 64, 16, True
    if D <= 128:
        return 128, 16, False
    raise ValueError(D)


def attention(q, k, v, BLOCK_M=64, BLOCK_N=128, NS=3, SCHED=1, num_warps=4, maxnreg=168, out=None,
              launch=True):
    B, H, Sq, D = q.shape
    Sk = k.shape[2]
    d_lo, d_hi, has_hi = split_dim(D)
    o = out if out is not None else torch.empty(B, Sq, H, D, dtype=q.dtype, device=q.device).transpose(1, 2)
    qd = descriptors(q, BLOCK_M, d_lo, d_hi)
    kd = descriptors(k, BLOCK_N, d_lo, d_hi)
    vd = descriptors(v, BLOCK_N, d_lo, d_hi)
    od = descriptors(o, BLOCK_M, d_lo, d_hi)
    qk_scale = D ** -0.5 * 1.4426950408889634
    args = dict(qd_lo=qd[0], qd_hi=qd[1], kd_lo=kd[0], kd_hi=kd[1], vd_lo=vd[0], vd_hi=vd[1],
                od_lo=od[0], od_hi=od[1], H=H, Sk=Sk, qk_scale=qk_scale, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                NS=NS, HAS_HI=has_hi, EVEN_K=Sk % BLOCK_N == 0, SCHED=SCHED, num_warps=num_warps)
    if not launch:
        return args
    grid = (triton.cdiv(Sq, 2 * BLOCK_M), B * H)
    attn_fwd[grid](**args, maxnreg=maxnreg)
    return o
