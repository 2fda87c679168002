import os, sys, json, functools, itertools
sys.path.insert(0, os.getcwd())
import torch
import torch.nn.functional as F
from bench.ops_attention import _qkv, _sweep_row, _sdpa_with, SDPA_BACKENDS
from bench.common import rotating
from sd_kernels import reference
from sd_kernels.ops import flash_attention
from scratch.attn_tma import tma_flash

out = sys.argv[1]
SHAPES = [(2, 16, 4096, 4096, 72), (2, 24, 4429, 4429, 64), (1, 24, 4608, 4608, 128),
          (2, 8, 4096, 4096, 40), (2, 8, 1024, 1024, 80)]
CFG = {  # (bm, bn, warps, stages)
    "small": [(128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2), (128, 128, 8, 3), (64, 64, 4, 3), (128, 32, 8, 3)],
    "big": [(128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 8, 3)],
}
only = sys.argv[2].split(",") if len(sys.argv) > 2 else None
rows = []
for shape in SHAPES:
    if only and "x".join(map(str, shape)) not in only:
        continue
    inputs = _qkv(*shape)
    ref = reference.attention(*(t.double() for t in inputs))
    nxt = rotating(functools.partial(_qkv, *shape), sum(t.numel() * t.element_size() for t in inputs))
    run = functools.partial(_sweep_row, shape, inputs=inputs, ref=ref, nxt=nxt)
    d = shape[4]
    rows.append(run("stock", F.scaled_dot_product_attention))
    rows.append(run("sdpa_cudnn", _sdpa_with(SDPA_BACKENDS["sdpa_cudnn"])))
    rows.append(run("sdpa_flash", _sdpa_with(SDPA_BACKENDS["sdpa_flash"])))
    rows.append(run("ours_autotuned", flash_attention))
    for (bm, bn, w, s), ws in itertools.product(CFG["big" if d > 80 else "small"], (False, True)):
        fn = functools.partial(tma_flash, bm=bm, bn=bn, warps=w, stages=s, ws=ws)
        rows.append(run("tma", fn, config=f"{bm}x{bn} w{w} s{s}", ws=ws))
    if shape[3] % 64:
        for ws in (False, True):
            fn = functools.partial(tma_flash, bm=128, bn=64, warps=8, stages=3, ws=ws, tail_split=False)
            rows.append(run("tma_mask_all", fn, config="128x64 w8 s3", ws=ws))
    del inputs, ref, nxt, run
    torch.cuda.empty_cache()
    json.dump(rows, open(f"{out}/sweep.json", "w"), indent=1)

# summary: best per shape per impl
best = {}
for r in rows:
    if "ms" not in r:
        continue
    k = (r["shape"], r["impl"] + ("_ws" if r.get("ws") else ""))
    if k not in best or r["ms"] < best[k]["ms"]:
        best[k] = r
for (s, i), r in sorted(best.items()):
    print(f"{s:24s} {i:16s} {r['ms']:.4f} ms {r['TFLOP/s']:7.1f} TF/s err {r['rel_err']} {r.get('config','')}")
