"""Session 14 scratch: the pixel path's statistics launch alone, three kernels x warps x programs, SD shapes."""

import importlib
import importlib.util
import json
import os
import sys

import torch
import triton
import triton.language as tl

from bench.common import time_graph_ms

new = importlib.import_module("sd_kernels.ops.group_norm")
spec = importlib.util.spec_from_file_location("gn_old", "scratch/gn_old.py")
old = importlib.util.module_from_spec(spec)
sys.modules["gn_old"] = old
spec.loader.exec_module(old)


@triton.jit
def pivot_stats(
    x_ptr,
    part_ptr,
    C,
    G,
    HW,
    S,
    stride_xn,
    stride_xc,
    stride_xs,
    CHUNK,
    CPG: tl.constexpr,
    C_P: tl.constexpr,
    G_P: tl.constexpr,
    CPG_P: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PER_TILE: tl.constexpr,
):
    pid_n, pid_s = tl.program_id(0), tl.program_id(1)
    s_lo = pid_s * CHUNK
    n_s = tl.minimum(CHUNK, HW - s_lo)
    x_blk = x_ptr + pid_n.to(tl.int64) * stride_xn + s_lo.to(tl.int64) * stride_xs
    s = tl.arange(0, BLOCK_S)[:, None]
    chv = tl.arange(0, C_P)
    ch = chv[None, :]
    c_ok = ch < C
    piv = tl.load(x_blk + ch * stride_xc, mask=c_ok, other=0.0).to(tl.float32)
    if PER_TILE:
        s1 = tl.zeros((C_P,), dtype=tl.float32)
        s2 = tl.zeros((C_P,), dtype=tl.float32)
    else:
        s1 = tl.zeros((BLOCK_S, C_P), dtype=tl.float32)
        s2 = tl.zeros((BLOCK_S, C_P), dtype=tl.float32)
    for s0 in range(0, n_s, BLOCK_S):
        mask = c_ok & (s0 + s < n_s)
        x = tl.load(x_blk + ch * stride_xc + (s0 + s) * stride_xs, mask=mask, other=0.0).to(tl.float32)
        d = tl.where(mask, x - piv, 0.0)
        if PER_TILE:
            s1 += tl.sum(d, axis=0)
            s2 += tl.sum(d * d, axis=0)
        else:
            s1 += d
            s2 += d * d
    if not PER_TILE:
        s1 = tl.sum(s1, axis=0)
        s2 = tl.sum(s2, axis=0)
    n = n_s.to(tl.float32)
    mu_c = tl.reshape(piv, (C_P,)) + s1 / n
    m2_c = tl.maximum(s2 - s1 * s1 / n, 0.0)
    g = tl.arange(0, G_P)[:, None]
    c = tl.arange(0, CPG_P)[None, :]
    lane = (g < G) & (c < CPG)
    at = tl.reshape(tl.minimum(g * CPG + c, C_P - 1), (G_P * CPG_P,))
    mu_l = tl.reshape(tl.gather(mu_c, at, 0), (G_P, CPG_P))
    m2_l = tl.where(lane, tl.reshape(tl.gather(m2_c, at, 0), (G_P, CPG_P)), 0.0)
    mu = tl.sum(tl.where(lane, mu_l, 0.0), axis=1) / CPG
    dg = tl.where(lane, mu_l - mu[:, None], 0.0)
    m2_g = tl.sum(m2_l + n * dg * dg, axis=1)
    gs = tl.arange(0, G_P)
    plane = tl.num_programs(0) * G * S
    idx = (pid_n * G + gs) * S + pid_s
    tl.store(part_ptr + idx, n * CPG + 0.0 * mu, mask=gs < G)
    tl.store(part_ptr + plane + idx, mu, mask=gs < G)
    tl.store(part_ptr + 2 * plane + idx, m2_g, mask=gs < G)


def graph_us(fn, calls=10, reps=15):
    return time_graph_ms(fn, calls=calls, replays=reps) * 1000


def ref_parts(x, G, S, chunk):
    n, C, H, W = x.shape
    xv = x.permute(0, 2, 3, 1).reshape(n, H * W, G, C // G).double()
    out = torch.zeros(3, n, G, S, dtype=torch.float64, device=x.device)
    for j in range(S):
        blk = xv[:, j * chunk : (j + 1) * chunk]
        out[0, :, :, j] = blk.shape[1] * (C // G)
        out[1, :, :, j] = blk.mean(dim=(1, 3))
        out[2, :, :, j] = ((blk - blk.mean(dim=(1, 3), keepdim=True)) ** 2).sum(dim=(1, 3))
    return out


SHAPES = [
    (2, 320, 64, 64),
    (2, 640, 64, 64),
    (2, 960, 64, 64),
    (2, 640, 32, 32),
    (2, 1920, 32, 32),
    (2, 320, 128, 128),
    (2, 960, 128, 128),
]
res = []
for shape in SHAPES:
    n, C, H, W = shape
    G = 32
    cpg = C // G
    hw = H * W
    x = (torch.randn(shape, device="cuda", dtype=torch.float16) * 2 + 3).to(memory_format=torch.channels_last)
    C_P = triton.next_power_of_2(C)
    G_P = 32
    CPG_P = triton.next_power_of_2(cpg)
    for programs in (128, 256, 512, 1024):
        block_s = max(1, min(triton.next_power_of_2(hw), 8192 // C_P))
        tiles = -(-hw // block_s)
        per = min(tiles, -(-programs // n))
        chunk = -(-tiles // per) * block_s
        S = -(-hw // chunk)
        parts = torch.empty(3 * n * G * S + 2 * n * G, device="cuda", dtype=torch.float32)
        ref = ref_parts(x, G, S, chunk)
        args = (x, parts, C, G, hw, S, x.stride(0), x.stride(1), x.stride(3), chunk)
        kernels = {
            "old": (
                old._pixel_stats_kernel.fn,
                (x, parts, G, hw, S, x.stride(0), x.stride(1), x.stride(3), chunk),
                dict(CPG=cpg, G_P=G_P, CPG_P=CPG_P, BLOCK_S=block_s),
            ),
            "welford": (
                new._pixel_stats_kernel.fn,
                args,
                dict(CPG=cpg, C_P=C_P, G_P=G_P, CPG_P=CPG_P, BLOCK_S=block_s),
            ),
            "pivot": (pivot_stats, args, dict(CPG=cpg, C_P=C_P, G_P=G_P, CPG_P=CPG_P, BLOCK_S=block_s, PER_TILE=False)),
            "pivot_tile": (
                pivot_stats,
                args,
                dict(CPG=cpg, C_P=C_P, G_P=G_P, CPG_P=CPG_P, BLOCK_S=block_s, PER_TILE=True),
            ),
        }
        for name, (k, a, kw) in kernels.items():
            for w in (4, 8, 16):
                if 8192 // (32 * w) > 64:
                    continue
                try:
                    fn = lambda: k[(n, S)](*a, **kw, num_warps=w)  # noqa: B023 (called in the loop)
                    fn()
                    torch.cuda.synchronize()
                    got = parts[: 3 * n * G * S].view(3, n, G, S).double()
                    err = ((got - ref).abs() / (ref.abs() + 1e-3)).max().item()
                    us = graph_us(fn)
                except Exception as e:
                    us, err = float("nan"), repr(e)[:80]
                r = dict(
                    shape=shape, programs=n * S, chunk=chunk, block_s=block_s, kernel=name, warps=w, us=us, err=err
                )
                res.append(r)
                print(json.dumps(r), flush=True)
json.dump(res, open(os.environ["OUT"] + "/r/gnstats.json", "w"))
