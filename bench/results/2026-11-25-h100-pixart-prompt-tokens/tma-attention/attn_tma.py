"""Experiment: flash attention forward with tensor-descriptor (TMA) loads and optional warp
specialization, at the DiTs' shapes. Not product code (yet)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _inner(acc_lo, acc_hi, l_i, m_i, q_lo, q_hi, k_lo_d, k_hi_d, v_lo_d, v_hi_d, lo, hi, Sk, qk_scale,
           D_LO: tl.constexpr, D_HI: tl.constexpr, DV_LO: tl.constexpr, DV_HI: tl.constexpr,
           BLOCK_N: tl.constexpr, WS: tl.constexpr, BOUNDARY: tl.constexpr):
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WS):
        qk = tl.dot(q_lo, k_lo_d.load([start_n, 0]).T)
        if D_HI > 0:
            qk = tl.dot(q_hi, k_hi_d.load([start_n, D_LO]).T, qk)
        if BOUNDARY:
            kv = start_n + tl.arange(0, BLOCK_N)
            qk = tl.where(kv[None, :] < Sk, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        p = p.to(q_lo.dtype)
        acc_lo = tl.dot(p, v_lo_d.load([start_n, 0]), acc_lo * alpha[:, None])
        if DV_HI > 0:
            acc_hi = tl.dot(p, v_hi_d.load([start_n, DV_LO]), acc_hi * alpha[:, None])
        m_i = m_new
    return acc_lo, acc_hi, l_i, m_i


@triton.jit
def _fwd(Q, K, V, O, qk_scale, sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sob, soh, som, H, Sq, Sk,
         HEAD_DIM: tl.constexpr, D_LO: tl.constexpr, D_HI: tl.constexpr, DV_LO: tl.constexpr,
         DV_HI: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WS: tl.constexpr,
         TAIL_SPLIT: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(Sq, BLOCK_M)
    bh = pid // num_m
    start_m = (pid % num_m) * BLOCK_M
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    Q += b * sqb + h * sqh
    K += b * skb + h * skh
    V += b * svb + h * svh
    O += b * sob + h * soh
    DH: tl.constexpr = D_HI if D_HI > 0 else 16
    DVH: tl.constexpr = DV_HI if DV_HI > 0 else 16
    q_lo_d = tl.make_tensor_descriptor(Q, shape=[Sq, HEAD_DIM], strides=[sqm, 1], block_shape=[BLOCK_M, D_LO])
    q_hi_d = tl.make_tensor_descriptor(Q, shape=[Sq, HEAD_DIM], strides=[sqm, 1], block_shape=[BLOCK_M, DH])
    k_lo_d = tl.make_tensor_descriptor(K, shape=[Sk, HEAD_DIM], strides=[skn, 1], block_shape=[BLOCK_N, D_LO])
    k_hi_d = tl.make_tensor_descriptor(K, shape=[Sk, HEAD_DIM], strides=[skn, 1], block_shape=[BLOCK_N, DH])
    v_lo_d = tl.make_tensor_descriptor(V, shape=[Sk, HEAD_DIM], strides=[svn, 1], block_shape=[BLOCK_N, DV_LO])
    v_hi_d = tl.make_tensor_descriptor(V, shape=[Sk, HEAD_DIM], strides=[svn, 1], block_shape=[BLOCK_N, DVH])
    o_lo_d = tl.make_tensor_descriptor(O, shape=[Sq, HEAD_DIM], strides=[som, 1], block_shape=[BLOCK_M, DV_LO])
    o_hi_d = tl.make_tensor_descriptor(O, shape=[Sq, HEAD_DIM], strides=[som, 1], block_shape=[BLOCK_M, DVH])

    q_lo = q_lo_d.load([start_m, 0])
    if D_HI > 0:
        q_hi = q_hi_d.load([start_m, D_LO])
    else:
        q_hi = q_lo
    acc_lo = tl.zeros([BLOCK_M, DV_LO], dtype=tl.float32)
    acc_hi = tl.zeros([BLOCK_M, DVH], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if TAIL_SPLIT:
        n_full = (Sk // BLOCK_N) * BLOCK_N
        acc_lo, acc_hi, l_i, m_i = _inner(acc_lo, acc_hi, l_i, m_i, q_lo, q_hi, k_lo_d, k_hi_d, v_lo_d, v_hi_d,
                                          0, n_full, Sk, qk_scale, D_LO, D_HI, DV_LO, DV_HI, BLOCK_N, WS, False)
        if n_full < Sk:
            acc_lo, acc_hi, l_i, m_i = _inner(acc_lo, acc_hi, l_i, m_i, q_lo, q_hi, k_lo_d, k_hi_d, v_lo_d,
                                              v_hi_d, n_full, Sk, Sk, qk_scale, D_LO, D_HI, DV_LO, DV_HI,
                                              BLOCK_N, False, True)
    else:
        acc_lo, acc_hi, l_i, m_i = _inner(acc_lo, acc_hi, l_i, m_i, q_lo, q_hi, k_lo_d, k_hi_d, v_lo_d, v_hi_d,
                                          0, Sk, Sk, qk_scale, D_LO, D_HI, DV_LO, DV_HI, BLOCK_N, WS,
                                          Sk % BLOCK_N != 0)
    inv_l = 1.0 / l_i
    o_lo_d.store([start_m, 0], (acc_lo * inv_l[:, None]).to(O.dtype.element_ty))
    if DV_HI > 0:
        o_hi_d.store([start_m, DV_LO], (acc_hi * inv_l[:, None]).to(O.dtype.element_ty))


_ALLOC = []


def _alloc(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def tma_flash(q, k, v, scale=None, *, bm=128, bn=64, warps=8, stages=3, ws=False, tail_split=True,
              blocks=None, maxnreg=None):
    """q, k, v [B, H, S, D] views with a contiguous last dim; out in q's layout."""
    if not _ALLOC:
        triton.set_allocator(_alloc)
        _ALLOC.append(1)
    B, H, Sq, D = q.shape
    Sk = k.shape[2]
    scale = D ** -0.5 if scale is None else scale
    from sd_kernels.ops.attention import flash_blocks
    (d_lo, d_hi), (dv_lo, dv_hi) = blocks or flash_blocks(D)
    heads_inner = q.stride(1) < q.stride(2)
    if heads_inner:
        out = torch.empty(B, Sq, H, D, dtype=q.dtype, device=q.device).transpose(1, 2)
    else:
        out = torch.empty(B, H, Sq, D, dtype=q.dtype, device=q.device)
    grid = (triton.cdiv(Sq, bm) * B * H,)
    kw = {} if maxnreg is None else {"maxnreg": maxnreg}
    _fwd[grid](q, k, v, out, scale * LOG2E, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
               k.stride(2), v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
               H, Sq, Sk, HEAD_DIM=D, D_LO=d_lo, D_HI=d_hi, DV_LO=dv_lo, DV_HI=dv_hi, BLOCK_M=bm, BLOCK_N=bn,
               WS=ws, TAIL_SPLIT=tail_split, num_warps=warps, num_stages=stages, **kw)
    return out
