"""Text encoders, fp16, replayed from a CUDA graph: eager vs torch.compile(fullgraph=True) inside the graph.
T5-XXL at PixArt's cut 64 tokens (masked) and 300 (whole); SD3's CLIP-L and CLIP-G at 77 tokens (why
COMPILED_TEXT_ENCODERS names T5 only). Outputs compared against eager fp16."""
import os, sys, json, time
sys.path.insert(0, os.getcwd())
import torch
from bench.common import time_graph_ms
from sd_kernels.models import build_model

out = sys.argv[1]
rows = []
cases = [("pixart-sigma", "text_encoder", "T5-XXL", 64, 17), ("pixart-sigma", "text_encoder", "T5-XXL", 300, 17),
         ("sd3-medium", "text_encoder", "CLIP-L", 77, None), ("sd3-medium", "text_encoder_2", "CLIP-G", 77, None)]
with torch.no_grad():
    for config, part, name, L, n in cases:
        te = build_model(config, part, "cuda", torch.float16)
        ids = torch.randint(0, 30000, (1, L), device="cuda")
        kw = {}
        if n is not None:
            mask = torch.zeros(1, L, dtype=torch.int64, device="cuda"); mask[:, :n] = 1
            kw["attention_mask"] = mask
        eager = lambda: te(ids, **kw)[0]
        ref = eager().float()
        ms_eager = time_graph_ms(eager)
        comp_fn = torch.compile(te.forward, fullgraph=True)
        t0 = time.perf_counter()
        got = comp_fn(ids, **kw)[0].float()
        ctime = time.perf_counter() - t0
        row = {"encoder": name, "tokens": L, "eager_graph_ms": round(ms_eager, 3), "compile_s": round(ctime, 1),
               "compiled_graph_ms": round(time_graph_ms(lambda: comp_fn(ids, **kw)[0]), 3),
               "rel_diff_vs_eager": f"{((got - ref).norm() / ref.norm()).item():.2e}"}
        print(json.dumps(row), flush=True); rows.append(row)
        torch._dynamo.reset()
        del te
        torch.cuda.empty_cache()
json.dump(rows, open(f"{out}/textenc.json", "w"), indent=1)
