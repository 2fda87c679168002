"""T5-XXL encoder (PixArt-Σ's / SD3's), fp16: replayed from a CUDA graph eager vs torch.compile(fullgraph=True),
at PixArt's 300 tokens with a mask and SD3's 256 without; outputs compared against float32 eager."""
import os, sys, json, time
sys.path.insert(0, os.getcwd())
import torch
from bench.common import time_graph_ms
from sd_kernels.models import build_model

out = sys.argv[1]
te = build_model("pixart-sigma", "text_encoder", "cuda", torch.float16)
rows = []
cases = [("pixart", 300, 37), ("sd3", 256, None)]
with torch.no_grad():
    for name, L, n in cases:
        ids = torch.randint(0, 32000, (1, L), device="cuda")
        mask = None
        if n is not None:
            mask = torch.zeros(1, L, dtype=torch.int64, device="cuda"); mask[:, :n] = 1
        eager = lambda: te(ids, attention_mask=mask)[0]
        ref = eager().float()
        ms_eager = time_graph_ms(eager)
        comp_fn = torch.compile(te.forward, fullgraph=True)
        t0 = time.perf_counter()
        try:
            got = comp_fn(ids, attention_mask=mask)[0].float()
            ok = None
        except Exception as e:
            ok = f"{type(e).__name__}: {str(e)[:300]}"
        ctime = time.perf_counter() - t0
        row = {"case": name, "tokens": L, "eager_graph_ms": round(ms_eager, 3), "compile_s": round(ctime, 1)}
        if ok is None:
            row["compiled_graph_ms"] = round(time_graph_ms(lambda: comp_fn(ids, attention_mask=mask)[0]), 3)
            row["rel_diff_vs_eager"] = ((got - ref).norm() / ref.norm()).item()
        else:
            row["error"] = ok
        print(json.dumps(row), flush=True); rows.append(row)
        torch._dynamo.reset()
json.dump(rows, open(f"{out}/t5compile.json", "w"), indent=1)
