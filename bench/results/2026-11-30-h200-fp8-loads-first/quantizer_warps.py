"""The loads-first quantizer's warps at FLUX's shapes (H200)."""
import json, sys, pathlib, importlib
import torch
from bench import common
q = importlib.import_module("sd_kernels.ops.fp8_quant")
out = pathlib.Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
dev, bf, S, SETS = "cuda", torch.bfloat16, 4608, 3
timed = lambda fn: common.time_graph_ms(fn, calls=30, replays=9) / SETS
big = [torch.randn(1, S, 21504, device=dev, dtype=bf) for _ in range(SETS)]
ff = [torch.randn(4096, 12288, device=dev, dtype=bf) for _ in range(SETS)]
att = [torch.randn(1, S, 3072, device=dev, dtype=bf) for _ in range(SETS)]
cases = {"single join": (lambda: [q.quantize_rows(b[..., 9216:], "tanh", prefix=a) for b, a in zip(big, att)], S * 15360 * 3),
         "ff gelu": (lambda: [q.quantize_rows(x, "tanh") for x in ff], 4096 * 12288 * 3),
         "to_out": (lambda: [q.quantize_rows(a[:, 512:]) for a in att], 4096 * 3072 * 3)}
orig = q.quantize_blocks
res = []
for name, (fn, nb) in cases.items():
    ref = fn()
    for warps in (None, 4, 8, 16, 32):
        if warps is not None:
            q.quantize_blocks = lambda n, c, elems=q._ELEMS, batch=q._ROW_ELEMS, w=warps: (*orig(n, c, elems, batch)[:2], w)
        got = fn()
        same = all(torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1], b[1]) for a, b in zip(ref, got))
        t = timed(fn)
        q.quantize_blocks = orig
        r = {"case": name, "warps": warps or orig(4096, 15360 if name == "single join" else (12288 if name == "ff gelu" else 3072))[2],
             "shipped": warps is None, "us": round(t * 1e3, 2), "gbps": round(nb / t / 1e6), "same": same}
        print(r, flush=True); res.append(r)
(out / "micro3.json").write_text(json.dumps(res, indent=1))
