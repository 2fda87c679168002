"""Which aten ops launch the strided elementwise kernels in the patched channels_last UNet step / VAE?"""
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
out = {}
with torch.inference_mode():
    sd_kernels.patch(pipe)
    vae.to(memory_format=torch.channels_last)
    for label, fn in (("unet", lambda: unet(x, t, encoder_hidden_states=ehs)), ("vae", lambda: vae.decode(z))):
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
        acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
        with profile(activities=acts, record_shapes=True, with_stack=True) as prof:
            fn()
            torch.cuda.synchronize()
        # CPU ops whose own CUDA kernels include the slow strided elementwise kernel
        agg = collections.Counter()
        for e in prof.events():
            kern = [k for k in e.kernels if "gpu_kernel_impl_nocast" in k.name or "elementwise_kernel<128" in k.name]
            if not kern or e.device_type != torch.autograd.DeviceType.CPU:
                continue
            stack = [s for s in (e.stack or []) if "site-packages/torch" not in s][:3]
            key = f"{e.name} {e.input_shapes} | {' <- '.join(stack)}"
            agg[key] += sum(k.duration for k in kern)
        rows = [(k[:400], round(v / 1e3, 4)) for k, v in agg.most_common(25)]
        out[label] = rows
        print("==", label)
        for r in rows:
            print(r)
(OUT / "prof2.json").write_text(json.dumps(out, indent=1))
