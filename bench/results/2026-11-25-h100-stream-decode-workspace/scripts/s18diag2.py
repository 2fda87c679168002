"""Session 18 diagnostic 2: the patched decode plans with the workspace of its convolutions measured
(patches/stream_decode._plan_measured) and _SLACK held back; at 3/2/1 MiB of slack per profile: planning
time, model and measured peak, eager and replayed time, PSNR vs untiled."""
import functools, json, os, sys, statistics, time
sys.path.insert(0, os.getcwd())
import torch
from sd_kernels import models, profiles
from sd_kernels.patches import patch, unpatch
from sd_kernels.patches import stream_decode as sd
from sd_kernels.testing import psnr

out_dir = sys.argv[1]
os.makedirs(out_dir, exist_ok=True)
vae = models.build_model("sd15", "vae", device="cuda", dtype=torch.float16)
z = torch.randn(1, 4, 64, 64, device="cuda", dtype=torch.float16, generator=torch.Generator("cuda").manual_seed(0))
img = lambda x: (x.float() / 2 + 0.5).clamp(0, 1)

def timed(fn, n=7):
    fn(); torch.cuda.synchronize(); ts = []
    for _ in range(n):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True); a.record(); fn(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b))
    return statistics.median(ts)

def graphed(fn):
    torch.cuda.synchronize(); g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    ms = timed(g.replay); del g; return ms

rows = []
with torch.inference_mode():
    patch(vae, cuda_graph=False)
    latent = vae.post_quant_conv(z)
    untiled = vae.decoder(latent)
    ref_graph = graphed(functools.partial(vae.decoder, latent))
    unpatch(vae)
    for name in ("s23-ultra", "iphone-14-pro-max", "mobile-small"):
        patch(vae, profile=name, cuda_graph=False)
        try:
            us = sd.units(vae.decoder)
            for slack in (3, 2, 1):
                sd._SLACK = int(slack * 2**20)
                sd.plans_of(vae.decoder).clear()
                torch.cuda.synchronize(); t0 = time.perf_counter()
                vae.decoder(latent); torch.cuda.synchronize()
                first_s = time.perf_counter() - t0
                (p,) = sd.plans_of(vae.decoder).values()
                run = functools.partial(sd.stream_decode, vae.decoder, us, p, latent)
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated(); torch.cuda.reset_peak_memory_stats()
                y = run(); torch.cuda.synchronize()
                peak = (torch.cuda.max_memory_allocated() - base) / 2**20
                row = {"profile": name, "slack_mib": slack, "plan": p.format(us), "model_peak_mib": p.peak / 2**20,
                       "peak_mib": peak, "budget_mib": p.budget / 2**20, "first_call_s": first_s,
                       "eager_ms": timed(run, 3), "graph_ms": graphed(run), "psnr": psnr(img(y), img(untiled))}
                row["vs_untiled_graph"] = row["graph_ms"] / ref_graph
                rows.append(row); print(json.dumps(row), flush=True)
        finally:
            sd._SLACK = 3 * 2**20
            unpatch(vae); profiles.set_profile(None)
json.dump({"untiled_graph_ms": ref_graph, "rows": rows}, open(f"{out_dir}/diag2.json", "w"), indent=1)
print("untiled graph ms", ref_graph)
