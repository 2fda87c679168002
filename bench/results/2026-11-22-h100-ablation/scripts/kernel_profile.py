"""(Session-4 provenance script, run from the repo root.) Kernel-time breakdown (torch.profiler)
of one SD1.5 UNet step (batch 2) and one VAE decode, patched
channels_last and stock+compile-free stock cl, to see where device time goes."""
import collections
import json
import os
import pathlib

import torch
from torch.profiler import ProfilerActivity, profile

import sd_kernels
from sd_kernels.models import build_pipeline

OUT = pathlib.Path(os.environ.get("OUT", "/tmp/out"))
OUT.mkdir(parents=True, exist_ok=True)
pipe = build_pipeline("sd15", device="cuda", dtype=torch.float16)
unet, vae = pipe.unet, pipe.vae
g = torch.Generator(device="cuda").manual_seed(0)
x = torch.randn(2, 4, 64, 64, device="cuda", dtype=torch.float16, generator=g)
t = torch.tensor(500, device="cuda")
ehs = torch.randn(2, 77, 768, device="cuda", dtype=torch.float16, generator=g)
z = x[:1] / vae.config.scaling_factor
report = {}

def breakdown(label, fn, n=3):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    agg, cnt = collections.Counter(), collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            agg[e.name[:90]] += e.device_time / n
            cnt[e.name[:90]] += 1 / n
    total = sum(agg.values())
    rows = [(k, round(v / 1e3, 4), round(cnt[k], 1)) for k, v in agg.most_common(30)]
    report[label] = {"total_ms": round(total / 1e3, 3), "top": rows}
    print(label, "total", round(total / 1e3, 3), "ms")
    for r in rows[:18]:
        print("   ", r)

with torch.inference_mode():
    unet.to(memory_format=torch.channels_last)
    breakdown("unet stock cl", lambda: unet(x, t, encoder_hidden_states=ehs))
    sd_kernels.patch(pipe)
    breakdown("unet patched cl", lambda: unet(x, t, encoder_hidden_states=ehs))
    breakdown("vae patched nchw", lambda: vae.decode(z))
    sd_kernels.unpatch(pipe)
    breakdown("vae stock nchw", lambda: vae.decode(z))
    vae.to(memory_format=torch.channels_last)
    breakdown("vae stock cl", lambda: vae.decode(z))
    sd_kernels.patch(pipe)
    breakdown("vae patched cl", lambda: vae.decode(z))
(OUT / "prof.json").write_text(json.dumps(report, indent=1))
