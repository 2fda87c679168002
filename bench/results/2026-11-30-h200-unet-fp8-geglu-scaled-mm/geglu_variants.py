"""GEGLU epilogue variants at SDXL's shapes: two dots (shipped draft), one dot over a 3-D descriptor
of both halves, one dot over row-interleaved weights; against the plain GEMM and the two-kernel path."""
import importlib, itertools, sys
import torch, triton, triton.language as tl
from bench import common
from sd_kernels import reference
from sd_kernels.ops.tiles import grouped_tile
from sd_kernels.ops.fp8_quant import _activate
f = importlib.import_module("sd_kernels.ops.fp8_linear")
fg = importlib.import_module("sd_kernels.ops.fp8_geglu")
from triton.runtime import _allocation

@triton.jit
def k_two(a_ptr, w_ptr, sa_ptr, sw_ptr, b_ptr, y_ptr, M, F, K, stride_am, stride_wn, stride_ym,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
          PERSISTENT: tl.constexpr, FLATTEN: tl.constexpr, MODE: tl.constexpr):
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[stride_am, 1], block_shape=[BLOCK_M, BLOCK_K])
    if MODE == 0:
        wa_desc = tl.make_tensor_descriptor(w_ptr, shape=[F, K], strides=[stride_wn, 1], block_shape=[BLOCK_N, BLOCK_K])
        wg_desc = tl.make_tensor_descriptor(w_ptr + F * stride_wn, shape=[F, K], strides=[stride_wn, 1], block_shape=[BLOCK_N, BLOCK_K])
    elif MODE == 1:
        w3 = tl.make_tensor_descriptor(w_ptr, shape=[2, F, K], strides=[F * stride_wn, stride_wn, 1], block_shape=[2, BLOCK_N, BLOCK_K])
    else:
        wi = tl.make_tensor_descriptor(w_ptr, shape=[2 * F, K], strides=[stride_wn, 1], block_shape=[2 * BLOCK_N, BLOCK_K])
    tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(F, BLOCK_N)
    k_steps = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), tiles, tl.num_programs(0), flatten=FLATTEN):
        pid_m, pid_n = grouped_tile(tile, M, F, BLOCK_M, BLOCK_N, GROUP_M)
        if MODE == 0:
            acc_a = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k in range(k_steps):
                a = a_desc.load([pid_m * BLOCK_M, k * BLOCK_K])
                wa = wa_desc.load([pid_n * BLOCK_N, k * BLOCK_K])
                wg = wg_desc.load([pid_n * BLOCK_N, k * BLOCK_K])
                acc_a = tl.dot(a, wa.T, acc_a)
                acc_g = tl.dot(a, wg.T, acc_g)
        else:
            acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
            for k in range(k_steps):
                a = a_desc.load([pid_m * BLOCK_M, k * BLOCK_K])
                if MODE == 1:
                    w = w3.load([0, pid_n * BLOCK_N, k * BLOCK_K]).reshape(2 * BLOCK_N, BLOCK_K)
                else:
                    w = wi.load([pid_n * 2 * BLOCK_N, k * BLOCK_K])
                acc = tl.dot(a, w.T, acc)
            acc_a, acc_g = tl.split(acc.reshape(BLOCK_M, 2, BLOCK_N).permute(0, 2, 1))
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = (offs_m % M).to(tl.int64)
        cols = (offs_n % F).to(tl.int64)
        s_a = tl.load(sa_ptr + rows)[:, None]
        ya = acc_a * s_a * tl.load(sw_ptr + cols)[None, :] + tl.load(b_ptr + cols).to(tl.float32)[None, :]
        yg = acc_g * s_a * tl.load(sw_ptr + F + cols)[None, :] + tl.load(b_ptr + F + cols).to(tl.float32)[None, :]
        h = ya * _activate(yg, "none")
        y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
        tl.store(y_ptrs, h.to(y_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < F))

def interleave(w, bn):
    f2, k = w.shape; F = f2 // 2
    return torch.stack([w[:F].view(F // bn, bn, k), w[F:].view(F // bn, bn, k)], 1).reshape(f2, k)


def main():
    _allocation.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    SM = torch.cuda.get_device_properties(0).multi_processor_count
    for m, k, n in [(8192, 640, 5120), (2048, 1280, 10240), (8192, 320, 2560), (2048, 640, 5120)]:
        F = n // 2
        x = torch.randn(m, k, device="cuda", dtype=torch.float16)
        w = torch.randn(n, k, device="cuda", dtype=torch.float16) / k**0.5
        b = torch.randn(n, device="cuda", dtype=torch.float16)
        a_q, s_a = f.quantize_rows(x)
        w_q, s_w = f.quantize_weight(w)
        ref = reference.fp8_gemm_geglu(a_q, s_a, w_q, s_w, b, "none", torch.float32)
        t = lambda fn: common.time_graph_ms(fn) * 1e3
        res = {"plain_gemm": t(lambda: f.fp8_gemm(a_q, s_a, w_q, s_w, b, out_dtype=torch.float16)),
               "geglu_quant_2F": t(lambda: f.quantize_rows(torch.empty(m, n, device="cuda", dtype=torch.float16), "none", gated=True)),
               "quant_F": t(lambda: f.quantize_rows(torch.empty(m, F, device="cuda", dtype=torch.float16))),
               "shipped_geglu": t(lambda: fg.fp8_gemm_geglu(a_q, s_a, w_q, s_w, b, "none", torch.float16))}
        print(f"M {m} K {k} 2F {n}:", {kk: round(v, 1) for kk, v in res.items()}, flush=True)
        best = {}
        for mode, (bm, bn, warps, stages, pers) in itertools.product((0, 1, 2), [(128, 64, 8, 4, True), (128, 64, 8, 4, False), (128, 128, 8, 3, True), (128, 128, 8, 3, False), (64, 128, 4, 4, False), (128, 64, 4, 4, False)]):
            if F % bn:
                continue
            wm, sm_, bm_ = (w_q, s_w, b)
            sw_i, b_i = s_w, b
            if mode == 2:  # rows interleaved in blocks of bn; scales and bias read at the original indices
                wm = interleave(w_q.view(torch.uint8), bn).view(torch.float8_e4m3fn)
            y = torch.empty(m, F, device="cuda", dtype=torch.float16)
            tiles = triton.cdiv(m, bm) * triton.cdiv(F, bn)
            grid = (min(SM, tiles) if pers else tiles,)
            run = lambda: k_two[grid](a_q, wm, s_a, s_w, b, y, m, F, k, a_q.stride(0), wm.stride(0), F, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, GROUP_M=8, PERSISTENT=pers, FLATTEN=pers, MODE=mode, num_warps=warps, num_stages=stages)
            try:
                run(); torch.cuda.synchronize()
                err = ((y.float() - ref).norm() / ref.norm()).item()
                us = t(run)
            except Exception as e:
                print("  mode", mode, (bm, bn, warps, stages, pers), "failed:", str(e)[:200], flush=True)
                continue
            print(f"  mode {mode} {(bm, bn, warps, stages, pers)}: {us:.1f} us err {err:.1e}", flush=True)


if __name__ == '__main__':
    main()
