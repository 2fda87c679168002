"""SDXL's VAE decode at 1024² alone: fp32 as the pipeline upcasts it, bf16 (the FP8 tier's copy), fp16; ours
patched and replayed from a CUDA graph; with cuDNN's heuristics and with cudnn.benchmark; kernels by name."""
import json, sys, time, collections
import torch
import sd_kernels
from sd_kernels.models import build_model
from sd_kernels.patches import cuda_graph as cg
from sd_kernels.patches.record import PatchRecord
from bench.unet_kernels import kernel_times, categories_us

out = {}
z0 = torch.randn(1, 4, 128, 128, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
ref = None
def run(dtype, bench_mode):
    torch.backends.cudnn.benchmark = bench_mode
    torch.manual_seed(0)  # the same random weights in every dtype
    vae = build_model("sdxl", "vae", "cuda", torch.float32).to(dtype)
    rec = sd_kernels.patch(vae)
    graphed = cg.install(vae, PatchRecord((), "x", ["vae"]), "decode", ("generator",))
    z = z0.to(dtype)
    with torch.no_grad():
        for _ in range(3):
            img = vae.decode(z).sample
        torch.cuda.synchronize()
        ts = []
        for _ in range(7):
            s = torch.cuda.Event(enable_timing=True); e = torch.cuda.Event(enable_timing=True)
            s.record(); vae.decode(z); e.record(); torch.cuda.synchronize(); ts.append(s.elapsed_time(e))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            vae.decode(z); torch.cuda.synchronize()
    kernels, calls, _ = kernel_times(prof)
    ms = sorted(ts)[3]
    cats = {k: round(v / 1e3, 3) for k, v in categories_us(kernels).most_common()}
    top = [(n[:110], round(us / 1e3, 3), calls[n]) for n, us in kernels.most_common(14)]
    return ms, cats, top, img.double()

for dtype, mode in ((torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True), (torch.float16, False), (torch.float16, True)):
    ms, cats, top, img = run(dtype, mode)
    if ref is None: ref = img
    err = ((img - ref).norm() / ref.norm()).item()
    mse = ((img.clamp(-1, 1) - ref.clamp(-1, 1)) / 2).pow(2).mean().item()
    psnr = 10 * __import__("math").log10(1 / mse) if mse > 0 else float("inf")
    key = f"{str(dtype).split('.')[-1]}{'+cudnn.benchmark' if mode else ''}"
    out[key] = dict(ms=ms, cats=cats, top=top, rel_err_vs_fp32=err, psnr_vs_fp32=psnr)
    print(key, f"{ms:.2f} ms", f"err {err:.2e} psnr {psnr:.1f}", cats, flush=True)
    for t in top: print("   ", t)
json.dump(out, open(sys.argv[1], "w"), indent=1)
