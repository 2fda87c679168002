"""SDXL's VAE decode at 1024² alone, patched and replayed from a CUDA graph, with the convolutions' biases added by
ops.bias_residual (patches/conv_bias.py) and by torch (``serves`` false): fp32 (the lossless pipeline's upcast), bf16
(the FP8 tier's copy), fp16. Same random weights; the images compared bit for bit."""
import json, sys
from unittest import mock
import torch
import sd_kernels
from sd_kernels.models import build_model
from sd_kernels.patches import conv_bias
from sd_kernels.patches import cuda_graph as cg
from sd_kernels.patches.record import PatchRecord
from bench.unet_kernels import kernel_times, categories_us

z0 = torch.randn(1, 4, 128, 128, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
out = {}
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    imgs = {}
    for ours in (True, False):
        torch.manual_seed(0)
        vae = build_model("sdxl", "vae", "cuda", torch.float32).to(dtype)
        ctx = mock.patch.object(conv_bias, "serves", lambda *a: False) if not ours else mock.patch.object(conv_bias, "KIND", conv_bias.KIND)
        with ctx:
            rec = sd_kernels.patch(vae)
            cg.install(vae, PatchRecord((), "x", ["vae"]), "decode", ("generator",))
            z = z0.to(dtype)
            with torch.no_grad():
                for _ in range(3):
                    img = vae.decode(z).sample
                torch.cuda.synchronize()
                ts = []
                for _ in range(9):
                    s = torch.cuda.Event(enable_timing=True); e = torch.cuda.Event(enable_timing=True)
                    s.record(); vae.decode(z); e.record(); torch.cuda.synchronize(); ts.append(s.elapsed_time(e))
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    vae.decode(z); torch.cuda.synchronize()
        kernels, calls, _ = kernel_times(prof)
        key = f"{str(dtype).split('.')[-1]} {'bias by ops.bias_residual' if ours else 'bias by torch'}"
        imgs[ours] = img.clone()
        out[key] = dict(ms=sorted(ts)[4], convs_with_our_bias=rec.counts.get(conv_bias.KIND, 0),
                        cats={k: round(v / 1e3, 3) for k, v in categories_us(kernels).most_common()})
        print(key, json.dumps(out[key]), flush=True)
        del vae
    same = torch.equal(imgs[True], imgs[False])
    out[f"{dtype} images equal"] = same
    print(dtype, "images bit-equal:", same, flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
