"""A joined modulation GEMM of FLUX.1-dev's width (K 3,072; N 700,416, two thirds of FLUX's 1,050,624 columns; one row) computed against served from a table
of 20 rows made by one GEMM, each replayed from a CUDA graph; the fill's GEMM; the served rows against each row's
own GEMM, bit for bit."""
import importlib, sys, torch, triton
fp8 = importlib.import_module("sd_kernels.ops.fp8_linear")
rows = importlib.import_module("sd_kernels.ops.fp8_rows")
torch.manual_seed(0)
K, N = 3072, 19 * 18432 + 38 * 9216
w_q, s_w = fp8.quantize_weight(torch.randn(N, K, device="cuda", dtype=torch.bfloat16))
bias = torch.randn(N, device="cuda", dtype=torch.bfloat16)
keys = torch.nn.functional.silu(torch.randn(20, K, device="cuda", dtype=torch.bfloat16))
table = rows.RowTable(64, K, N, torch.bfloat16, torch.device("cuda"))
def fill():
    table.store(keys, fp8.fp8_linear(keys, w_q, s_w, bias, reuse=False))
fill()
own = torch.cat([fp8.fp8_linear(keys[i:i + 1].clone(), w_q, s_w, bias, reuse=False) for i in range(20)])
print("table rows == each row's own GEMM, bit for bit:", torch.equal(table.values[:20], own))
x = keys[:1].clone()
def timed(fn, label, reps=50):
    for _ in range(3): fn()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay(); torch.cuda.synchronize()
    ms = triton.testing.do_bench(g.replay, warmup=10, rep=200, return_mode="median")
    print(f"{label}: {ms * 1000:.1f} us")
    return g
computed = timed(lambda: fp8.fp8_linear(x, w_q, s_w, bias, reuse=False), "joined GEMM, computed (no table)")
served = timed(lambda: fp8.fp8_linear(x, w_q, s_w, bias, reuse=False, table=table), "joined GEMM, served from the table")
x.copy_(torch.randn(1, K, device="cuda", dtype=torch.bfloat16))
timed(lambda: fp8.fp8_linear(x, w_q, s_w, bias, reuse=False, table=table), "joined GEMM with the table, a row not in it")
ms = triton.testing.do_bench(fill, warmup=3, rep=100, return_mode="median")
print(f"the fill (one GEMM of 20 rows and the table writes): {ms * 1000:.1f} us")
print("bytes of codes:", w_q.numel() / 1e9, "GB; table:", table.nbytes / 1e6, "MB")
