"""The join of SD3-medium's q, k, v (fused: [B, S, 3·1536], fp16) at larger batches: a GEMM a sample written in
place, against one GEMM over the batch copied into the join, against diffusers' (three GEMMs + torch.cat). Device
time from CUDA graphs (bench/common.py).

    PYTHONPATH=. python bench/results/2026-11-29-h200-sd3-lossless-join-in-place/probe_batches.py
"""
import torch, torch.nn.functional as F
from bench.common import time_graph_ms

torch.manual_seed(0)
dev, dt, D = "cuda", torch.float16, 1536
W3 = torch.randn(3 * D, D, device=dev, dtype=dt) * 0.02
b3 = torch.randn(3 * D, device=dev, dtype=dt)
for B, SI in ((2, 4096), (4, 4096), (8, 1024), (8, 4096), (16, 1024)):
    x = torch.randn(B, SI, D, device=dev, dtype=dt)
    buf = torch.empty(B, SI + 333, 3 * D, device=dev, dtype=dt)
    def per_sample():
        for s in range(B):
            torch.addmm(b3, x[s], W3.t(), out=buf[s, :SI])
    def batched_copy():
        buf[:, :SI].copy_(F.linear(x, W3, b3))
    def three_and_cat():
        for i in range(3):
            torch.cat([F.linear(x, W3[i * D:(i + 1) * D], b3[i * D:(i + 1) * D]), buf[:, SI:, :D]], dim=1)
    row = [f"B={B:2d} S={SI}"]
    for name, fn in (("per sample", per_sample), ("one GEMM + copy", batched_copy), ("3 GEMMs + cat", three_and_cat)):
        row.append(f"{name} {time_graph_ms(fn) * 1000:8.1f} us")
    print("  ".join(row), flush=True)
