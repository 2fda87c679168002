"""Old (HEAD) vs new (loads first) memory-bound kernels of the FP8 step at FLUX 1024² shapes, one process."""
import json, sys, pathlib, importlib, importlib.util
import torch
from bench import common
from sd_kernels.runtime.launch import cdiv

out = pathlib.Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
new = {m: importlib.import_module("sd_kernels.ops." + m) for m in ("fp8_quant", "layer_norm", "rope", "attention_fp8")}
old = {}
for m in new:
    spec = importlib.util.spec_from_file_location("sd_kernels.ops.old_" + m, f".probe/old/old_{m}.py")
    mod = importlib.util.module_from_spec(spec); sys.modules[spec.name] = mod; spec.loader.exec_module(mod); old[m] = mod
dev, bf = "cuda", torch.bfloat16
res = {"env": common.environment(), "copy_gbps": common.copy_ceiling_gbps()}
print(res, flush=True)
S, H, D, SETS = 4608, 24, 128, 3
timed = lambda fn: common.time_graph_ms(fn, calls=30, replays=9) / SETS

def pair(name, f_old, f_new, nbytes, same):
    a, b = f_old(), f_new()
    ok = same(a, b)
    t_old, t_new = timed(f_old), timed(f_new)
    t_old2 = timed(f_old)
    r = {"case": name, "old_us": round(min(t_old, t_old2) * 1e3, 2), "new_us": round(t_new * 1e3, 2),
         "new_vs_old": round(t_new / min(t_old, t_old2), 3), "new_gbps": round(nbytes / t_new / 1e6),
         "same": ok}
    print(r, flush=True); res.setdefault("pairs", []).append(r)

def eq_all(a, b):
    return all(torch.equal(x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x,
                           y.view(torch.uint8) if y.dtype == torch.float8_e4m3fn else y)
               for xs, ys in zip(a, b) for x, y in zip(xs, ys))

# quantizers
big = [torch.randn(1, S, 21504, device=dev, dtype=bf) for _ in range(SETS)]
att = [torch.randn(1, S, 3072, device=dev, dtype=bf) for _ in range(SETS)]
for name, mk, nb in [
    ("quant single join 4608x(3072+12288)", lambda m: (lambda: [m.quantize_rows(b[..., 9216:], "tanh", prefix=a) for b, a in zip(big, att)]), S * 15360 * 3),
    ("quant ff gelu 4096x12288", lambda m: (lambda: [m.quantize_rows(b[:, :4096, 9216:], "tanh") for b in big]), 4096 * 12288 * 3),
    ("quant txt gelu 512x12288", lambda m: (lambda: [m.quantize_rows(b[:, :512, 9216:], "tanh") for b in big]), 512 * 12288 * 3),
    ("quant to_out 4096x3072", lambda m: (lambda: [m.quantize_rows(a[:, 512:]) for a in att]), 4096 * 3072 * 3),
]:
    pair(name, mk(old["fp8_quant"]), mk(new["fp8_quant"]), nb, eq_all)
del big
# layer norms
sc = torch.randn(1, 3072, device=dev, dtype=bf) * 0.1; sh = torch.randn(1, 3072, device=dev, dtype=bf) * 0.1
g = torch.randn(1, 3072, device=dev, dtype=bf)
for T in (4608, 4096, 512):
    xs = [torch.randn(1, T, 3072, device=dev, dtype=bf) for _ in range(SETS)]
    br = [torch.randn(1, T, 3072, device=dev, dtype=bf) for _ in range(SETS)]
    pair(f"ln fp8 {T}", (lambda m=old["layer_norm"]: [m.layer_norm_modulated_fp8(x, None, None, 1e-6, sc, sh) for x in xs]),
         (lambda m=new["layer_norm"]: [m.layer_norm_modulated_fp8(x, None, None, 1e-6, sc, sh) for x in xs]), T * 3072 * 5, eq_all)
    pair(f"gated ln fp8 {T}", (lambda m=old["layer_norm"]: [m.gated_residual_layer_norm_fp8(x, b, g, None, None, 1e-6, sc, sh) for x, b in zip(xs, br)]),
         (lambda m=new["layer_norm"]: [m.gated_residual_layer_norm_fp8(x, b, g, None, None, 1e-6, sc, sh) for x, b in zip(xs, br)]), T * 3072 * 9, eq_all)
del xs, br
# rope
wq = torch.rand(D, device=dev, dtype=bf) + 0.5; wk = torch.rand(D, device=dev, dtype=bf) + 0.5
cos = torch.randn(S, D, device=dev); sin = torch.randn(S, D, device=dev)
big = [torch.randn(1, S, 21504, device=dev, dtype=bf) for _ in range(SETS)]
pair("rope single", (lambda m=old["rope"]: [m.qk_norm_rope(b[..., :3072], b[..., 3072:6144], b[..., 6144:9216], D, wq, wk, 1e-6, cos, sin) for b in big]),
     (lambda m=new["rope"]: [m.qk_norm_rope(b[..., :3072], b[..., 3072:6144], b[..., 6144:9216], D, wq, wk, 1e-6, cos, sin) for b in big]),
     S * 3072 * 2 * 4, eq_all)
img = [b[:, 512:, :9216] for b in big]; txt = [torch.randn(1, 512, 9216, device=dev, dtype=bf) for _ in range(SETS)]
def dbl(m):
    return lambda: [m.qk_norm_rope(i[..., :3072], i[..., 3072:6144], i[..., 6144:], D, wq, wk, 1e-6, cos, sin,
                                   t[..., :3072], t[..., 3072:6144], t[..., 6144:], wq, wk) for i, t in zip(img, txt)]
pair("rope double (txt+img, v joined)", dbl(old["rope"]), dbl(new["rope"]), S * 3072 * 2 * 6, eq_all)
del big, img, txt
# K/V pre-pass
kvs = []
for _ in range(SETS):
    k = torch.randn(1, S, H, D, device=dev, dtype=bf).transpose(1, 2) + torch.randn(D, device=dev, dtype=bf)
    bigv = torch.randn(S, 21504, device=dev, dtype=bf)
    kvs.append((k, bigv[:, 6144:9216].view(1, S, H, D).transpose(1, 2), bigv))
def within_one(a, b):
    return all((x[0].view(torch.int8).int() - y[0].view(torch.int8).int()).abs().max().item() <= 1 and
               torch.equal(x[2].view(torch.uint8), y[2].view(torch.uint8)) and torch.equal(x[3], y[3]) for x, y in zip(a, b))
rows_stats = []
af = new["attention_fp8"]
for rows_, chunk, warps in [(32, 128, 4), (16, 128, 4), (32, 128, 2), (64, 128, 8), (16, 128, 2), (32, 64, 2), (16, 64, 2), (32, 256, 4), (16, 256, 4)]:
    n_chunks = cdiv(S, chunk)
    ks = torch.empty(H, n_chunks, D, device=dev); vm = torch.empty_like(ks)
    def fn(chunk=chunk, rows_=rows_, warps=warps, ks=ks, vm=vm, n_chunks=n_chunks):
        for k4, v4, _ in kvs:
            af._kv_stats_kernel[(H, n_chunks)](k4, v4, ks, vm, *k4.stride(), *v4.stride(), H, S, D=D, ROWS=rows_,
                                               CHUNK=chunk, V_MAX=True, num_warps=warps)
    r = {"rows": rows_, "chunk": chunk, "warps": warps, "us": round(timed(fn) * 1e3, 2)}
    r["gbps"] = round(2 * S * H * D * 2 / r["us"] / 1e3)
    print("stats new", r, flush=True); rows_stats.append(r)
res["stats_new"] = rows_stats
best = min(rows_stats, key=lambda r: r["us"])
for (rows_, chunk, warps) in {(best["rows"], best["chunk"], best["warps"]), (32, 128, 4)}:
    af.STATS_STEP, af.STATS_WARPS = rows_, warps
    af.STATS_ROWS, af.MAX_CHUNKS = chunk, max(64, cdiv(S, chunk))
    pair(f"prepass rows{rows_} chunk{chunk} w{warps}", lambda: [old["attention_fp8"].quantize_kv(k, v, "fp8", "fp8", permute_v=True) for k, v, _ in kvs],
         lambda: [af.quantize_kv(k, v, "fp8", "fp8", permute_v=True) for k, v, _ in kvs], S * H * D * 2 * 3, within_one)
(out / "micro2.json").write_text(json.dumps(res, indent=1))
