"""The probes behind quantize-probe.log and geglu-quantize-probe.log: the FP8 quantizer at SDXL's shapes, each time
the mean of 50 calls replayed from one CUDA graph. ``python quantize_probes.py plain`` wrote quantize-probe.log
(the quantizer then used libdevice's erff: run it with GELU_ERF_POLY False to repeat it), ``python
quantize_probes.py gelu`` geglu-quantize-probe.log."""
import importlib
import sys

import torch

f = importlib.import_module("sd_kernels.ops.fp8_linear")
fq = importlib.import_module("sd_kernels.ops.fp8_quant")
gelu = importlib.import_module("sd_kernels.ops.gelu")


def t(fn, n=50):
    """µs a call, from one graph of n calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            fn()
    g.replay()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    s.record()
    g.replay()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / n * 1000


def plain():
    for rows, cols, gated in [(8192, 640, False), (2048, 1280, False), (8192, 5120, True), (2048, 10240, True)]:
        x = torch.randn(rows, cols, device="cuda", dtype=torch.float16)
        us = t(lambda: f.quantize_rows(x, "none" if gated else "", gated))
        nbytes = rows * cols * 2 + rows * (cols // 2 if gated else cols) + rows * 4
        y = torch.empty_like(x)
        cu = t(lambda: y.copy_(x))
        print(f"quantize rows={rows} cols={cols} gated={gated}: {us:.1f} us, {nbytes / us / 1e3:.0f} GB/s; "
              f"copy of x {cu:.1f} us, {2 * x.numel() * 2 / cu / 1e3:.0f} GB/s")


def gelus():
    shapes = [(8192, 5120), (2048, 10240)]
    for rows, cols in shapes:
        x = torch.randn(rows, cols, device="cuda", dtype=torch.float16) * 3
        nbytes = rows * cols * 2 + rows * cols // 2 + rows * 4
        res = {}
        for label, poly, act in [("erf-poly", True, "none"), ("erff", False, "none"), ("tanh", True, "tanh")]:
            fq.GELU_ERF_POLY = poly
            res[label] = t(lambda: f.quantize_rows(x, act, True))
        fq.GELU_ERF_POLY = True
        q1, s1 = f.quantize_rows(x, "none", True)
        fq.GELU_ERF_POLY = False
        q2, s2 = f.quantize_rows(x, "none", True)
        fq.GELU_ERF_POLY = True
        same = (q1.view(torch.uint8) == q2.view(torch.uint8)).float().mean().item()
        srel = ((s1 - s2).abs() / s2.abs().clamp_min(1e-30)).max().item()
        print(f"GEGLU quantize rows={rows} cols={cols}: "
              + ", ".join(f"{k} {v:.1f} us ({nbytes / v / 1e3:.0f} GB/s)" for k, v in res.items())
              + f"; codes equal {same:.6f}, scales max rel diff {srel:.2e}")
    blocks = fq.quantize_blocks
    for rows, cols in shapes:
        x = torch.randn(rows, cols, device="cuda", dtype=torch.float16) * 3
        out = []
        for w in (2, 4, 8, 16):
            fq.quantize_blocks = lambda r, c, w=w, **kw: (*blocks(r, c, **kw)[:2], w)
            out.append(f"{w} warps {t(lambda: f.quantize_rows(x, 'none', True)):.1f} us")
        fq.quantize_blocks = blocks
        lossless = t(lambda: gelu.geglu(x, "none"))
        print(f"GEGLU quantize rows={rows} cols={cols}, erf-poly: " + ", ".join(out)
              + f"; lossless geglu kernel (fp16 out) {lossless:.1f} us ({(rows * cols * 2 + rows * cols) / lossless / 1e3:.0f} GB/s)")


if __name__ == "__main__":
    {"plain": plain, "gelu": gelus}[sys.argv[1] if len(sys.argv) > 1 else "gelu"]()
