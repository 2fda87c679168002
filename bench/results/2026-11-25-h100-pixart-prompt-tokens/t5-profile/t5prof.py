"""PixArt-Σ's T5-XXL encoder, fp16, one prompt: device time by kernel category and the top kernels,
at 300 tokens (as the pipeline pads) and at 64; eager and replayed from a CUDA graph."""
import os, sys, json
sys.path.insert(0, os.getcwd())
import torch
from bench.common import time_graph_ms
from sd_kernels.models import build_model

out = sys.argv[1]
te = build_model("pixart-sigma", "text_encoder", "cuda", torch.float16)
print({n: p.dtype for n, p in list(te.named_parameters())[:3]}, te.config._attn_implementation, flush=True)
rows = []
for L in (300, 64):
    ids = torch.randint(0, 32000, (1, L), device="cuda")
    mask = torch.zeros(1, L, dtype=torch.int64, device="cuda"); mask[:, :37] = 1
    fn = lambda: te(ids, attention_mask=mask)[0]
    with torch.no_grad():
        fn(); torch.cuda.synchronize()
        ms_graph = time_graph_ms(fn)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn(); torch.cuda.synchronize()
    ka = prof.key_averages()
    top = sorted([(k.key, k.device_time_total / 1e3, k.count) for k in ka if k.device_time_total > 0],
                 key=lambda r: -r[1])[:15]
    total = sum(k.device_time_total for k in ka if k.device_time_total > 0) / 1e3
    r = {"L": L, "graph_ms": round(ms_graph, 3), "kernel_ms": round(total, 3),
         "top": [(n[:90], round(t, 3), c) for n, t, c in top]}
    print(json.dumps(r, indent=0), flush=True); rows.append(r)
json.dump(rows, open(f"{out}/t5.json", "w"), indent=1)
