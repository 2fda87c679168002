"""Session 19: the VAE decode replayed from a CUDA graph (post_quant_conv + decoder, batch 1, fp16) for SD1.5 at
512² and SDXL at 1024²: stock; patched under hopper; patched under hopper with upsample_conv2d disabled; one process.
(The peer's VAE decode, compiled channels_last, is bench.e2e's ``vae_device_ms``.)"""
import json
import os
import statistics
import sys

sys.path.insert(0, os.getcwd())
import torch  # noqa: E402

from sd_kernels import models, profiles  # noqa: E402
from sd_kernels.patches import patch, unpatch  # noqa: E402
from sd_kernels.testing import psnr  # noqa: E402


def replay_ms(fn, n=20):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    times = []
    for _ in range(n):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times), out.clone()


noup = profiles.from_dict({**json.load(open("sd_kernels/profiles/hopper.json")), "name": "hopper-noup",
                           "disabled_ops": ["upsample_conv2d"]})
rows = []
for name in ("sd15", "sdxl"):
    vae = models.build_model(name, "vae", device="cuda", dtype=torch.float16)
    side = 64 if name == "sd15" else 128
    z = torch.randn(1, 4, side, side, device="cuda", dtype=torch.float16)
    with torch.inference_mode():
        dec = lambda: vae.decoder(vae.post_quant_conv(z))  # noqa: E731
        ms, ref = replay_ms(dec)
        rows.append({"model": name, "variant": "stock", "ms": ms})
        for label, prof in (("patched hopper", "hopper"), ("patched hopper, upsample off", noup)):
            rec = patch(vae, profile=prof, cuda_graph=False)
            ms, out = replay_ms(dec)
            img = lambda t: (t.float().clamp(-1, 1) + 1) / 2  # noqa: E731
            rows.append({"model": name, "variant": label, "ms": ms, "psnr_vs_stock": psnr(img(out), img(ref)),
                         "polyphase": rec.counts.get("upsample.polyphase", 0)})
            unpatch(vae)
    for r in rows[-3:]:
        print(json.dumps(r), flush=True)
    del vae
    torch.cuda.empty_cache()
json.dump(rows, open(os.path.join(sys.argv[1], "vae_ab.json"), "w"), indent=1)
