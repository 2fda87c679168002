"""FLUX's VAE decode at 1024²: stock eager, torch.compile (default, channels_last, fullgraph) and patched
(graphed as the pipeline replays it), with the patched decode's top kernels."""
import torch
from bench import common
from bench.setups import compiled_methods
from bench.unet_kernels import kernel_times
from sd_kernels.models import build_model
from sd_kernels.patches import patch, unpatch
vae = build_model("flux-dev", "vae", "cuda", torch.bfloat16).eval()
lat = torch.randn(1, 16, 128, 128, device="cuda", dtype=torch.bfloat16)
def top(call, label):
    call(); torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        call(); torch.cuda.synchronize()
    k, c, _ = kernel_times(prof)
    print(label, "total kernel ms", round(sum(k.values()) / 1e3, 3))
    for name, us in k.most_common(16):
        print(f"{us:9.1f} us {c[name]:4d}x  {name[:140]}")
with torch.no_grad():
    dec = lambda: vae.decode(lat, return_dict=False)[0]  # noqa: E731
    print("stock graphed ms", common.time_graph_ms(dec, calls=2, replays=5), flush=True)
    with compiled_methods([(vae, "decode")], "default"):
        dec(); dec()
        print("compiled graphed ms", common.time_graph_ms(dec, calls=2, replays=5), flush=True)
        top(common.graphed(dec), "compiled")
    torch._dynamo.reset()
    patch(vae, cuda_graph=False)
    print("patched graphed ms", common.time_graph_ms(dec, calls=2, replays=5), flush=True)
    top(common.graphed(dec), "patched")
