"""The LayerNorm kernel's launch rule: shipped vs candidates at every shipped model's shapes; and
attention at head dim 512 (the VAEs' mid-block) on each path."""
import importlib, json, statistics, sys
import torch
import torch.nn.functional as F
out = sys.argv[1]
ln = importlib.import_module("sd_kernels.ops.layer_norm")
from sd_kernels.runtime.launch import next_pow2

def replay_us(fn, n=20, reps=7):
    fn(); torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            fn()
    g.replay(); torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record(); g.replay(); e1.record(); torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3 / n)
    return statistics.median(ts)

shipped = ln.blocks
def rule(per_prog, per_warp, lo=1):
    def blocks(n_rows, d, elems=0):
        bd = next_pow2(d)
        rows = max(1, min(per_prog // bd, next_pow2(n_rows)))
        return rows, bd, min(16, max(lo, rows * bd // per_warp))
    return blocks
RULES = {"shipped": shipped, "A:2048/2048": rule(2048, 2048), "B:4096/4096": rule(4096, 4096),
         "C:2048/1024,min2": rule(2048, 1024, 2), "D:4096/2048": rule(4096, 2048)}
SHAPES = [("sd15", 2, 4096, 320), ("sd15", 2, 1024, 640), ("sd15", 2, 256, 1280), ("sdxl", 2, 4096, 640),
          ("sdxl", 2, 1024, 1280), ("pixart", 2, 4096, 1152), ("sd3", 2, 4096, 1536), ("sd3", 2, 333, 1536),
          ("flux", 1, 4096, 3072), ("flux", 1, 512, 3072)]
res = []
for model, b, t, d in SHAPES:
    dt = torch.bfloat16 if model == "flux" else torch.float16
    x, br = (torch.randn(b, t, d, device="cuda", dtype=dt) for _ in range(2))
    w, bias = (torch.randn(d, device="cuda", dtype=dt) for _ in range(2))
    mod = model in ("pixart", "sd3", "flux")
    sc = torch.randn(b, d, device="cuda", dtype=dt) if mod else None
    sh = torch.randn(b, d, device="cuda", dtype=dt) if mod else None
    wt, bs = (None, None) if mod else (w, bias)
    ops = {"plain": lambda: ln.layer_norm_modulated(x, wt, bs, 1e-6, sc, sh),
           "gated": lambda: ln.gated_residual_layer_norm(x, br, sc, wt, bs, 1e-6, sc, sh),
           "plain_fp8": lambda: ln.layer_norm_modulated_fp8(x, wt, bs, 1e-6, sc, sh),
           "gated_fp8": lambda: ln.gated_residual_layer_norm_fp8(x, br, sc, wt, bs, 1e-6, sc, sh)}
    for op, fn in ops.items():
        row = {"model": model, "shape": [b, t, d], "op": op}
        for name, r in RULES.items():
            ln.blocks = r
            try:
                row[name] = round(replay_us(fn), 2)
            except Exception as exc:
                row[name] = repr(exc)[:120]
            finally:
                ln.blocks = shipped
        res.append(row); print(row, flush=True)
A = importlib.import_module("sd_kernels.ops.attention")
att = []
for dt in (torch.float32, torch.float16, torch.bfloat16):
    for t in (4096, 16384):
        q, k, v = (torch.randn(1, 1, t, 512, device="cuda", dtype=dt) for _ in range(3))
        r = {"dtype": str(dt), "tokens": t, "path": A.attention_path(q, k, v),
             "ours_ms": round(replay_us(lambda: A.attention(q, k, v), n=3, reps=3) / 1e3, 3),
             "sdpa_ms": round(replay_us(lambda: F.scaled_dot_product_attention(q, k, v), n=3, reps=3) / 1e3, 3)}
        att.append(r); print(r, flush=True)
json.dump({"layer_norm": res, "attention_512": att}, open(f"{out}/norm_rules.json", "w"), indent=1)
