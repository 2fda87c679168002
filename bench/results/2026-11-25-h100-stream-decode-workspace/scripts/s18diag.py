"""Session 18 diagnostic: cuDNN workspace per band conv shape (by the peak and by the cumulative allocated
bytes, to check the second as a probe), and plans made with 10/6/4/2 MiB held back: peak, eager and
replayed time, PSNR vs untiled."""
import collections, functools, json, os, sys, statistics
sys.path.insert(0, os.getcwd())
import torch
import torch.nn.functional as F
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

records = collections.OrderedDict()
real = F.conv2d
def spy(x, w, b=None, stride=1, padding=0, dilation=1, groups=1):
    before = torch.cuda.memory_allocated(); torch.cuda.reset_peak_memory_stats()
    cum = torch.cuda.memory_stats()["allocated_bytes.all.allocated"]
    y = real(x, w, b, stride, padding, dilation, groups)
    ws = torch.cuda.max_memory_allocated() - before - y.numel() * y.element_size()
    ws2 = torch.cuda.memory_stats()["allocated_bytes.all.allocated"] - cum - y.numel() * y.element_size()
    k = (tuple(x.shape), tuple(w.shape), str(padding), x.stride(1) == 1)
    r = records.setdefault(k, [0, 0, y.numel() * y.element_size(), 0]); r[0] += 1; r[1] = max(r[1], ws); r[3] = max(r[3], ws2)
    return y

with torch.inference_mode():
    patch(vae, cuda_graph=False)
    latent = vae.post_quant_conv(z)
    untiled = vae.decoder(latent)
    ref_graph = graphed(functools.partial(vae.decoder, latent))
    unpatch(vae)
    result = {"untiled_graph_ms": ref_graph, "plans": []}
    for name in ("s23-ultra", "mobile-small"):
        patch(vae, profile=name, cuda_graph=False)
        try:
            us = sd.units(vae.decoder)
            budget = profiles.get_profile(name).intermediate_budget_mb * 2**20
            # workspace per conv shape, for the profile's own plan
            p0 = sd.plan(us, 1, 64, 64, 2, budget, 512 * 64 * 64 * 2)
            sd.stream_decode(vae.decoder, us, p0, latent)
            records.clear(); F.conv2d = spy  # noqa
            try:
                sd.stream_decode(vae.decoder, us, p0, latent)
            finally:
                F.conv2d = real
            with open(f"{out_dir}/workspace-{name}.txt", "w") as f:
                for (xs, ws_, pad, cl), (n, w, ob, w2) in records.items():
                    print(f"x={list(xs)} w={list(ws_)} pad={pad} cl={cl} calls={n} out={ob/2**20:.2f}MiB workspace={w/2**20:.2f}MiB cumulative={w2/2**20:.2f}MiB", file=f)
            for share in (10, 6, 4, 2):
                old = sd._UNSEEN; sd._UNSEEN = int(share * 2**20)
                try:
                    p = sd.plan(us, 1, 64, 64, 2, budget, 512 * 64 * 64 * 2)
                finally:
                    sd._UNSEEN = old
                run = functools.partial(sd.stream_decode, vae.decoder, us, p, latent)
                y = run(); torch.cuda.synchronize()
                base = torch.cuda.memory_allocated(); torch.cuda.reset_peak_memory_stats()
                y = run(); torch.cuda.synchronize()
                peak = (torch.cuda.max_memory_allocated() - base) / 2**20
                row = {"profile": name, "unseen_mib": share, "plan": p.format(us), "peak_mib": peak,
                       "eager_ms": timed(run, 3), "graph_ms": graphed(run), "psnr": psnr(img(y), img(untiled))}
                row["vs_untiled_graph"] = row["graph_ms"] / ref_graph
                result["plans"].append(row); print(json.dumps(row), flush=True)
        finally:
            unpatch(vae); profiles.set_profile(None)
json.dump(result, open(f"{out_dir}/diag.json", "w"), indent=1)
print("untiled graph ms", ref_graph)
