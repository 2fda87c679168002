"""SD3-medium's joint attention at 1024² with guidance (fp16, batch 2, 4,096 image + 333 text tokens, 1,536
features): device time (CUDA graphs, bench/common.py) of the q/k/v join and the output projections in the lossless
variants, and the GEMMs alone; then every copy, clone and concatenation one transformer call makes, with the FP8 tier
and without, fresh and after diffusers' fuse/unfuse_qkv_projections() (random weights from the shipped config).

    PYTHONPATH=. python bench/results/2026-11-29-h200-sd3-lossless-join-in-place/probe.py
"""
import collections, sys, traceback
import torch, torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from bench.common import time_graph_ms
import sd_kernels
from sd_kernels import models

torch.manual_seed(0)
dev, dt = "cuda", torch.float16
B, SI, ST, D = 2, 4096, 333, 1536
x = torch.randn(B, SI, D, device=dev, dtype=dt)
c = torch.randn(B, ST, D, device=dev, dtype=dt)
W = [torch.randn(D, D, device=dev, dtype=dt) * 0.02 for _ in range(6)]
b = [torch.randn(D, device=dev, dtype=dt) for _ in range(6)]
att = torch.randn(B, SI + ST, D, device=dev, dtype=dt)
Wo, bo = W[0], b[0]

def cat_join():
    for i in range(3):
        torch.cat([F.linear(x, W[i], b[i]), F.linear(c, W[3 + i], b[3 + i])], dim=1)

def per_sample_join():
    for i in range(3):
        buf = x.new_empty(B, SI + ST, D)
        for s in range(B):
            torch.addmm(b[i], x[s], W[i].t(), out=buf[s, :SI])
            torch.addmm(b[3 + i], c[s], W[3 + i].t(), out=buf[s, SI:])

def token_major_join():
    xt = x.transpose(0, 1).contiguous().view(SI * B, D)
    ct = c.transpose(0, 1).contiguous().view(ST * B, D)
    for i in range(3):
        buf = x.new_empty(SI + ST, B, D)
        torch.addmm(b[i], xt, W[i].t(), out=buf[:SI].view(SI * B, D))
        torch.addmm(b[3 + i], ct, W[3 + i].t(), out=buf[SI:].view(ST * B, D))

def out_stock():
    F.linear(att[:, :SI], Wo, bo); F.linear(att[:, SI:], Wo, bo)

def out_per_sample():
    for lo, hi in ((0, SI), (SI, SI + ST)):
        o = x.new_empty(B, hi - lo, D)
        for s in range(B):
            torch.addmm(bo, att[s, lo:hi], Wo.t(), out=o[s])

def img_one(): F.linear(x, W[0], b[0])
def img_two():
    o = x.new_empty(B, SI, D)
    for s in range(B): torch.addmm(b[0], x[s], W[0].t(), out=o[s])
def txt_one(): F.linear(c, W[3], b[3])
def txt_two():
    o = c.new_empty(B, ST, D)
    for s in range(B): torch.addmm(b[3], c[s], W[3].t(), out=o[s])
def x_transpose(): x.transpose(0, 1).contiguous()
def cats3():
    q = torch.empty(B, SI, D, device=dev, dtype=dt); k = torch.empty(B, ST, D, device=dev, dtype=dt)
    for _ in range(3): torch.cat([q, k], 1)

for name, fn in [("join cat (6 GEMMs + 3 cats)", cat_join), ("join per sample (12 GEMMs)", per_sample_join),
                 ("join token-major (2 transposes + 6 GEMMs)", token_major_join),
                 ("out stock (bmm + bias add)", out_stock), ("out per sample (4 addmm)", out_per_sample),
                 ("image GEMM M=8192", img_one), ("image GEMM 2 x M=4096", img_two),
                 ("text GEMM M=666", txt_one), ("text GEMM 2 x M=333", txt_two),
                 ("x transpose copy", x_transpose), ("3 cats alone", cats3)]:
    print(f"{name:45s} {time_graph_ms(fn) * 1000:8.1f} us", flush=True)

# --- the FP8 tier's copies
class Log(TorchDispatchMode):
    def __init__(self):
        super().__init__(); self.seen = collections.Counter()
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.copy_.default, torch.ops.aten.clone.default, torch.ops.aten.cat.default,
                    torch.ops.aten._to_copy.default):
            where = [f"{f.filename.split('/')[-1]}:{f.lineno}:{f.name}" for f in traceback.extract_stack()[:-1]
                     if "sd_kernels" in f.filename or "patches" in f.filename or "diffusers" in f.filename][-3:]
            shape = tuple(out.shape) if isinstance(out, torch.Tensor) else None
            self.seen[(str(func), shape, " < ".join(where))] += 1
        return out

model = models.build_model("sd3-medium", "transformer", device=dev, dtype=dt).eval()
g = torch.Generator(device=dev).manual_seed(0)
inp = dict(hidden_states=torch.randn(B, 16, 128, 128, device=dev, dtype=dt, generator=g),
           encoder_hidden_states=torch.randn(B, ST, 4096, device=dev, dtype=dt, generator=g),
           pooled_projections=torch.randn(B, 2048, device=dev, dtype=dt, generator=g),
           timestep=torch.full((B,), 500.0, device=dev), return_dict=False)
for label in ("fresh", "after fuse/unfuse_qkv_projections"):
    if label != "fresh":
        model.fuse_qkv_projections(); model.unfuse_qkv_projections()
    for precision in ("fp8", None):
        with sd_kernels.patched(model, cuda_graph=False, precision=precision) as rec, torch.no_grad():
            model(**inp)
            with Log() as log:
                model(**inp)
        print(f"--- {label}, precision={precision}: {dict(rec.counts)}")
        for (f, shape, where), n in sorted(log.seen.items(), key=lambda kv: -kv[1]):
            print(f"  {n:4d} x {f} {shape} at {where}")
