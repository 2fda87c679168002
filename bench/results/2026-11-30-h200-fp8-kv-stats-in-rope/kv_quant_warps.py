"""The FP8 attention's K/V quantization pass (after qk_norm_rope_fp8's statistics) at FLUX.1-dev 1024² shapes:
its warps a program, and qk_norm_rope_fp8 at 1 and 2 warps (H200)."""
import importlib, json, pathlib, sys
import torch
from bench import common

af, rope = (importlib.import_module("sd_kernels.ops." + m) for m in ("attention_fp8", "rope"))
out = pathlib.Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
dev, bf = "cuda", torch.bfloat16
res = {"env": common.environment(), "copy_gbps": common.copy_ceiling_gbps()}
print(res, flush=True)
H, D, S, SETS = 24, 128, 4608, 3
wq, wk = (torch.rand(D, device=dev, dtype=bf) + 0.5 for _ in range(2))
cos, sin = torch.randn(S, D, device=dev), torch.randn(S, D, device=dev)
big = [torch.randn(1, S, 21504, device=dev, dtype=bf) for _ in range(SETS)]
args = [((x[..., :3072], x[..., 3072:6144], x[..., 6144:9216], D), dict(q_weight=wq, k_weight=wk, eps=1e-6, cos=cos,
                                                                         sin=sin)) for x in big]
outs = [rope.qk_norm_rope_fp8(*a, **kw) for a, kw in args]


def timed(fn):
    return round(common.time_graph_ms(fn, calls=30, replays=9) / SETS * 1e3, 2)


rows = []
orig = af.QUANT_WARPS
for warps in (4, 2, 8, 16):
    af.QUANT_WARPS = warps
    t = timed(lambda: [af.quantize_kv(k.transpose(1, 2), v.transpose(1, 2), "fp8", "fp8", permute_v=True, stats=st)
                       for _, k, v, st in outs])
    r = {"quant_warps": warps, "us": t, "gbps": round(S * H * D * 2 * 3 / t / 1e3)}
    print(r, flush=True); rows.append(r)
af.QUANT_WARPS = orig
ob = rope.blocks
for elems, warps, stages in ((1024, 2, 3), (1024, 1, 3), (512, 1, 3), (1024, 1, 2), (2048, 2, 3)):
    rope.STATS_ELEMS, rope.STATS_STAGES = elems, stages
    rope.blocks = lambda hd, e=0, w=warps: (ob(hd, e)[0], ob(hd, e)[1], w)
    t = timed(lambda: [rope.qk_norm_rope_fp8(*a, **kw) for a, kw in args])
    r = {"rope_elems": elems, "warps": warps, "stages": stages, "us": t}
    print(r, flush=True); rows.append(r)
    rope.blocks = ob
res["rows"] = rows
(out / "kv-quant-warps.json").write_text(json.dumps(res, indent=1))
