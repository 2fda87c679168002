"""Experiment (session 4, removed after measuring): flash forward with in-kernel TMA descriptors and Triton's automatic warp specialisation
(tl.range(..., warp_specialize=True)) on Hopper, against our kernel and cuDNN. Unmasked, Sk % BLOCK_N == 0."""
import functools
import json
import os
import pathlib

import torch
import triton
import triton.language as tl

import sd_kernels.ops.attention as attn
from bench.common import rotating
from bench.ops_attention import SDPA_BACKENDS, _qkv, _sdpa_with, _sweep_row
from sd_kernels import reference

OUT = pathlib.Path(os.environ.get("OUT", "/tmp/out")); OUT.mkdir(parents=True, exist_ok=True)
triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))


@triton.jit
def _ws_kernel(Q, K, V, Out, qk_scale, H, Sq, Sk, stride_qb, stride_qm, stride_kb, stride_kn, stride_vb, stride_vn,
               stride_ob, stride_om, D: tl.constexpr, DP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               WS: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(Sq, BLOCK_M)
    bh = pid // num_m
    start_m = (pid % num_m) * BLOCK_M
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    dq = tl.make_tensor_descriptor(Q + b * stride_qb + h * D, shape=[Sq, D], strides=[stride_qm, 1], block_shape=[BLOCK_M, DP])
    dk = tl.make_tensor_descriptor(K + b * stride_kb + h * D, shape=[Sk, D], strides=[stride_kn, 1], block_shape=[BLOCK_N, DP])
    dv = tl.make_tensor_descriptor(V + b * stride_vb + h * D, shape=[Sk, D], strides=[stride_vn, 1], block_shape=[BLOCK_N, DP])
    q = dq.load([start_m, 0])
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DP], dtype=tl.float32)
    for start_n in tl.range(0, Sk, BLOCK_N, warp_specialize=WS, num_stages=STAGES):
        k = dk.load([start_n, 0])
        qk = tl.dot(q, k.T)
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = dv.load([start_n, 0])
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    acc = acc / l_i[:, None]
    rows = start_m + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, DP)
    optr = Out + b * stride_ob + h * D + rows[:, None] * stride_om + cols[None, :]
    tl.store(optr, acc.to(Out.dtype.element_ty), mask=(rows[:, None] < Sq) & (cols[None, :] < D))


def ws_flash(q, k, v, bm, bn, warps, stages, ws, maxnreg=None):
    B, H, Sq, D = q.shape
    Sk = k.shape[2]
    out = torch.empty(B, Sq, H, D, dtype=q.dtype, device=q.device).transpose(1, 2)
    dp = max(16, triton.next_power_of_2(D))
    grid = (triton.cdiv(Sq, bm) * B * H,)
    kw = dict(num_warps=warps)
    if maxnreg:
        kw["maxnreg"] = maxnreg
    _ws_kernel[grid](q, k, v, out, D**-0.5 * 1.4426950408889634, H, Sq, Sk, q.stride(0), q.stride(2), k.stride(0),
                     k.stride(2), v.stride(0), v.stride(2), out.stride(0), out.stride(2), D=D, DP=dp, BLOCK_M=bm,
                     BLOCK_N=bn, WS=ws, STAGES=stages, **kw)
    return out


rows = []
CFGS = {40: [(128, 128, 8, 3, None), (128, 128, 8, 2, None), (128, 64, 8, 3, None), (128, 128, 4, 3, None), (128, 64, 4, 3, None), (128, 128, 8, 3, 128)],
        80: [(128, 64, 8, 3, None), (128, 128, 8, 3, None), (128, 64, 4, 3, None), (64, 64, 4, 3, None), (128, 64, 8, 2, None)]}
for shape in [(2, 8, 4096, 4096, 40), (2, 8, 1024, 1024, 80)]:
    inputs = _qkv(*shape)
    ref = reference.attention(*(t.double() for t in inputs))
    nxt = rotating(functools.partial(_qkv, *shape), sum(t.numel() * t.element_size() for t in inputs))
    run = functools.partial(_sweep_row, shape, inputs=inputs, ref=ref, nxt=nxt)
    d = shape[4]
    rows.append(run("sdpa_cudnn", _sdpa_with(SDPA_BACKENDS["sdpa_cudnn"])))
    rows.append(run("ours_autotuned", attn.flash_attention))
    for bm, bn, w, st, r in CFGS[d]:
        for ws in (False, True):
            rows.append(run("tma_ws" if ws else "tma", functools.partial(ws_flash, bm=bm, bn=bn, warps=w, stages=st, ws=ws, maxnreg=r),
                            config=f"{bm}x{bn} w{w} s{st} r{r}"))
            (OUT / "ws.json").write_text(json.dumps(rows, indent=1))
    rows.append(run("sdpa_cudnn_again", _sdpa_with(SDPA_BACKENDS["sdpa_cudnn"])))
    (OUT / "ws.json").write_text(json.dumps(rows, indent=1))
    del inputs, ref, nxt
    torch.cuda.empty_cache()
for r in rows:
    print(r["shape"], r["impl"], r.get("config", ""), r.get("ms"), r.get("TFLOP/s"), r.get("rel_err"), r.get("error", "")[:100])
