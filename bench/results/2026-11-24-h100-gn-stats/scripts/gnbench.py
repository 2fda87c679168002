"""Session 14: GroupNorm pixel path, the statistics kernel of df955a3 (scratch/gn_old.py, from
`git show df955a3:sd_kernels/ops/group_norm.py`) vs the tree's, at SD shapes (fp16, channels_last, SiLU)."""

import importlib.util
import json
import os
import sys

import torch
import torch.nn.functional as F

from bench.common import time_graph_ms

sys.path.insert(0, "scratch")
import importlib

new = importlib.import_module("sd_kernels.ops.group_norm")
spec = importlib.util.spec_from_file_location("gn_old", "scratch/gn_old.py")
old = importlib.util.module_from_spec(spec)
sys.modules["gn_old"] = old
spec.loader.exec_module(old)


def graph_time(fn, inputs):
    """µs per call: one CUDA graph of a call per input, replayed (bench.common.time_graph_ms)."""
    it = iter(inputs * 1000)
    return time_graph_ms(lambda: fn(next(it)), calls=len(inputs), replays=20) * 1000


SHAPES = (
    [(2, c, 64, 64) for c in (320, 640, 960)]
    + [(2, c, 32, 32) for c in (320, 640, 960, 1280, 1920)]
    + [(2, c, 96, 96) for c in (320, 640, 960)]
    + [(2, c, 128, 128) for c in (320, 640, 960)]
    + [(2, 1280, 64, 64), (2, 1920, 64, 64)]
    + [(1, 512, 128, 128), (1, 256, 256, 256)]
)
rows = []
for shape in SHAPES:
    g = 32
    x0 = torch.randn(shape, device="cuda", dtype=torch.float16).to(memory_format=torch.channels_last) * 2 + 0.5
    w = torch.randn(shape[1], device="cuda", dtype=torch.float16)
    b = torch.randn(shape[1], device="cuda", dtype=torch.float16)
    ref = F.silu(F.group_norm(x0.double(), g, w.double(), b.double(), 1e-5))
    row = {"shape": shape}
    nbytes = x0.numel() * 2
    for name, mod in (("old", old), ("new", new)):
        y = mod.group_norm(x0, g, w, b, 1e-5, "silu")
        torch.cuda.synchronize()
        row[name + "_err"] = (y.double() - ref).abs().max().item()
        p = mod.plan(shape[0], g, shape[1] // g, shape[2] * shape[3], True, sms=132)
        row[name + "_path"] = p.name
        fn = lambda x, mod=mod: mod.group_norm(x, g, w, b, 1e-5, "silu")  # noqa: B023 (called in the loop)
        row[name + "_warm_us"] = graph_time(fn, [x0] * 10)
        ring = [x0.clone() for _ in range(max(2, int(200e6 // nbytes)))][:16]
        row[name + "_cold_us"] = graph_time(fn, ring)
    fs = lambda x: F.silu(F.group_norm(x, g, w, b, 1e-5))  # noqa: B023 (called in the loop)
    row["stock_err"] = (fs(x0).double() - ref).abs().max().item()
    row["stock_warm_us"] = graph_time(fs, [x0] * 10)
    row["copy_warm_us"] = graph_time(lambda x: x.clone(), [x0] * 10)
    row["GBps_new_warm"] = 2 * nbytes / row["new_warm_us"] / 1e3
    rows.append(row)
    print(json.dumps(row), flush=True)
# kernel-level split: profile new and old at SD1.5 64² 320 and 32² 1920
from torch.profiler import ProfilerActivity, profile  # noqa: E402

for shape in [(2, 320, 64, 64), (2, 960, 64, 64), (2, 1920, 32, 32)]:
    x0 = torch.randn(shape, device="cuda", dtype=torch.float16).to(memory_format=torch.channels_last)
    w = torch.randn(shape[1], device="cuda", dtype=torch.float16)
    b = torch.randn(shape[1], device="cuda", dtype=torch.float16)
    for name, mod in (("old", old), ("new", new)):
        for _ in range(3):
            mod.group_norm(x0, 32, w, b, 1e-5, "silu")
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                mod.group_norm(x0, 32, w, b, 1e-5, "silu")
            torch.cuda.synchronize()
        ev = {}
        for e in prof.events():
            if e.device_type.name == "CUDA":
                ev.setdefault(e.name, []).append(e.device_time)
        print(shape, name, {k[:30]: round(sum(v) / len(v), 2) for k, v in ev.items()}, flush=True)
json.dump(rows, open(os.environ["OUT"] + "/r/gnbench.json", "w"), indent=1)
