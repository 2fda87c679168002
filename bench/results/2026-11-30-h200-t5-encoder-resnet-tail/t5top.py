"""Top kernels of the patched FLUX T5 call (what the remaining elementwise time is)."""
import torch
from bench import common
from bench.text_encoder import _patched
from bench.unet_kernels import kernel_times
from sd_kernels.models import build_model
enc = build_model("flux-dev", "text_encoder_2", "cuda", torch.bfloat16).eval()
ids = torch.randint(2, 32128, (1, 512), device="cuda")
with torch.no_grad():
    _patched(enc)
    call = common.graphed(lambda: enc(ids)[0])
    call(); torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        call(); torch.cuda.synchronize()
    k, c, _ = kernel_times(prof)
    for name, us in k.most_common(14):
        print(f"{us:9.1f} us {c[name]:4d}x  {name[:150]}")
