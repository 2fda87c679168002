"""Microbench variants of the FP8 step's memory-bound kernels at FLUX 1024² shapes (H200)."""
import json, sys, pathlib, itertools
import torch, triton
from bench import common
import importlib
af, ln, rope = (importlib.import_module("sd_kernels.ops." + m) for m in ("attention_fp8", "layer_norm", "rope"))
from sd_kernels.runtime.launch import cdiv, next_pow2

out = pathlib.Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
dev, bf = "cuda", torch.bfloat16
res = {"env": common.environment(), "copy_gbps": common.copy_ceiling_gbps()}
print(res, flush=True)
S, H, D = 4608, 24, 128
SETS = 3

def timed(fn):
    return common.time_graph_ms(fn, calls=30, replays=9)

# ---- K/V statistics
def kv_sets():
    sets = []
    for _ in range(SETS):
        k = torch.randn(1, S, H, D, device=dev, dtype=bf).transpose(1, 2)          # qk_norm_rope's key
        big = torch.randn(S, 21504, device=dev, dtype=bf)                           # single block's GEMM out
        v = big[:, 6144:9216].view(1, S, H, D).transpose(1, 2)
        sets.append((k, v, big))
    return sets
kvs = kv_sets()
rows_stats = []
for chunk, step, warps in [(128, 64, 4), (128, 128, 4), (128, 128, 8), (128, 32, 4), (256, 64, 4), (256, 128, 8),
                           (256, 64, 8), (512, 128, 8), (64, 64, 4), (64, 64, 2), (128, 64, 8), (128, 32, 2)]:
    n_chunks = cdiv(S, chunk)
    ks = torch.empty(H, n_chunks, D, device=dev); vm = torch.empty_like(ks)
    def fn(chunk=chunk, step=step, warps=warps, ks=ks, vm=vm, n_chunks=n_chunks):
        for k4, v4, _ in kvs:
            af._kv_stats_kernel[(H, n_chunks)](k4, v4, ks, vm, *k4.stride(), *v4.stride(), H, S, D=D, ROWS=step,
                                               CHUNK=chunk, V_MAX=True, num_warps=warps)
    ms = timed(fn) / SETS
    r = {"chunk": chunk, "step": step, "warps": warps, "us": round(ms * 1e3, 2),
         "gbps": round(2 * S * H * D * 2 / ms / 1e6)}
    print("stats", r, flush=True); rows_stats.append(r)
res["stats"] = rows_stats
# whole pre-pass as shipped
def prepass():
    for k4, v4, _ in kvs:
        af.quantize_kv(k4, v4, "fp8", "fp8", permute_v=True)
r = {"us": round(timed(prepass) / SETS * 1e3, 2)}; print("prepass", r, flush=True); res["prepass"] = r
del kvs

# ---- modulated LayerNorm + FP8 codes, FLUX single block (4608 rows) and double img (4096)
lrows = []
for T in (4608, 4096):
    xs = [torch.randn(1, T, 3072, device=dev, dtype=bf) for _ in range(SETS)]
    sc = torch.randn(1, 3072, device=dev, dtype=bf) * 0.1; sh = torch.randn(1, 3072, device=dev, dtype=bf) * 0.1
    orig = ln.blocks
    for rows_, warps in [(None, None), (1, 8), (1, 2), (2, 8), (2, 16), (4, 16), (1, 16)]:
        if rows_ is not None:
            ln.blocks = lambda n, d, elems=0, r=rows_, w=warps: (r, next_pow2(d), w)
        fn = lambda: [ln.layer_norm_modulated_fp8(x, None, None, 1e-6, sc, sh) for x in xs]
        try:
            ms = timed(fn) / SETS
            r = {"T": T, "rows": rows_, "warps": warps, "us": round(ms * 1e3, 2),
                 "gbps_with_y": round(T * 3072 * 5 / ms / 1e6), "gbps_no_y": round(T * 3072 * 3 / ms / 1e6)}
        except Exception as e:
            r = {"T": T, "rows": rows_, "warps": warps, "error": str(e)[:200]}
        ln.blocks = orig
        print("ln", r, flush=True); lrows.append(r)
    # gated residual + LN + fp8 (norm2 of the double blocks)
    br = [torch.randn(1, T, 3072, device=dev, dtype=bf) for _ in range(SETS)]
    g = torch.randn(1, 3072, device=dev, dtype=bf)
    fn = lambda: [ln.gated_residual_layer_norm_fp8(x, b, g, None, None, 1e-6, sc, sh) for x, b in zip(xs, br)]
    ms = timed(fn) / SETS
    r = {"T": T, "gated": True, "us": round(ms * 1e3, 2), "gbps": round(T * 3072 * 9 / ms / 1e6)}
    print("ln", r, flush=True); lrows.append(r)
    del xs, br
res["ln"] = lrows

# ---- q/k norm + rope, single block
rr = []
big = [torch.randn(1, S, 21504, device=dev, dtype=bf) for _ in range(SETS)]
wq = torch.rand(D, device=dev, dtype=bf) + 0.5; wk = torch.rand(D, device=dev, dtype=bf) + 0.5
cos = torch.randn(S, D, device=dev); sin = torch.randn(S, D, device=dev)
orig = rope.blocks
for elems, warps in [(None, None), (2048, 4), (2048, 8), (512, 2), (1024, 4), (4096, 8), (1024, 1)]:
    if elems is not None:
        rope.blocks = lambda hd, e=0, el=elems, w=warps: (el // next_pow2(hd), next_pow2(hd), w)
    fn = lambda: [rope.qk_norm_rope(b[..., :3072], b[..., 3072:6144], b[..., 6144:9216], D, wq, wk, 1e-6, cos, sin)
                  for b in big]
    ms = timed(fn) / SETS
    rope.blocks = orig
    r = {"elems": elems, "warps": warps, "us": round(ms * 1e3, 2), "gbps": round(S * 3072 * 2 * 4 / ms / 1e6)}
    print("rope", r, flush=True); rr.append(r)
res["rope"] = rr
(out / "micro.json").write_text(json.dumps(res, indent=1))
