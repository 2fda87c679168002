"""SDXL's fp32 (force_upcast) decode at 1024²: time stock vs patched, kernel categories; the VAE's
fp32 attention alone on each path and precision."""
import collections, json, statistics, sys, time, warnings
import torch
import torch.nn.functional as F
warnings.filterwarnings("ignore")
out = sys.argv[1]
import sd_kernels
from sd_kernels.models import build_pipeline
from bench.unet_kernels import category

def timed(fn, n=5, warm=2):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter(); fn(); torch.cuda.synchronize(); ts.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(ts), 2)

def profile(fn):
    from torch.profiler import ProfilerActivity, profile as prof
    fn(); torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CUDA]) as p:
        fn(); torch.cuda.synchronize()
    cat, top, calls = collections.Counter(), collections.Counter(), collections.Counter()
    for e in p.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            us = e.time_range.end - e.time_range.start
            cat[category(e.name)] += us; top[e.name[:140]] += us; calls[e.name[:140]] += 1
    return ({k: round(v / 1e3, 3) for k, v in cat.most_common()},
            [(k, round(v / 1e3, 3), calls[k]) for k, v in top.most_common(25)])

res = {}
with torch.no_grad():
    pipe = build_pipeline("sdxl", "cuda", torch.float16)
    lat = torch.randn(1, 4, 128, 128, device="cuda", dtype=torch.float16)
    def decode():
        vae = pipe.vae
        up = vae.dtype == torch.float16 and vae.config.force_upcast
        if up:
            vae.to(dtype=torch.float32)
        img = vae.decode(lat.to(vae.dtype) / vae.config.scaling_factor, return_dict=False)[0]
        if up:
            vae.to(dtype=torch.float16)
        return img
    ref_img = decode().double()
    res["stock_ms"] = timed(decode)
    res["stock_profile"] = profile(decode)
    print("stock", res["stock_ms"], res["stock_profile"][0], flush=True)
    sd_kernels.patch(pipe)
    img = decode().double()
    res["patched_vs_stock_rel_err"] = float((img - ref_img).norm() / ref_img.norm())
    res["patched_ms"] = timed(decode)
    res["patched_profile"] = profile(decode)
    print("patched", res["patched_ms"], res["patched_profile"][0], "rel err vs stock",
          res["patched_vs_stock_rel_err"], flush=True)
    print(json.dumps(res["patched_profile"][1], indent=0), flush=True)
    # the VAE's attention alone: 1 head, 16384 tokens, 512 dims, fp32
    import sd_kernels.ops.attention as A
    import importlib
    ac = importlib.import_module("sd_kernels.ops.attention_common")
    q, k, v = (torch.randn(1, 1, 16384, 512, device="cuda") for _ in range(3))
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    def err(o):
        return float((o.double() - ref).norm() / ref.norm())
    rows = {}
    rows["sdpa"] = (timed(lambda: F.scaled_dot_product_attention(q, k, v)), err(F.scaled_dot_product_attention(q, k, v)))
    rows["ours_path"] = A.attention_path(q, k, v)
    rows["ours"] = (timed(lambda: A.attention(q, k, v)), err(A.attention(q, k, v)))
    for prec in ():
        orig = A.dot_precision
        A.dot_precision = lambda dtype, p=prec: p if dtype == torch.float32 else orig(dtype)
        sm = importlib.import_module("sd_kernels.ops.softmax_matmul")
        orig_sm = sm.dot_precision
        sm.dot_precision = A.dot_precision
        A.clear_plans()
        try:
            rows[f"ours_{prec}"] = (timed(lambda: A.attention(q, k, v)), err(A.attention(q, k, v)))
        except Exception as exc:
            rows[f"ours_{prec}"] = repr(exc)[:300]
        A.dot_precision = orig; sm.dot_precision = orig_sm; A.clear_plans()
    torch.backends.cuda.matmul.allow_tf32 = True
    rows["sdpa_allow_tf32"] = (timed(lambda: F.scaled_dot_product_attention(q, k, v)), err(F.scaled_dot_product_attention(q, k, v)))
    torch.backends.cuda.matmul.allow_tf32 = False
    rows["cudnn_allow_tf32"] = torch.backends.cudnn.allow_tf32
    res["attention_fp32"] = rows
    print(rows, flush=True)
json.dump(res, open(f"{out}/decode_probe.json", "w"), indent=1)
