"""The FP8 attention's K/V statistics computed by q/k norm + RoPE as it writes the keys (ops.rope.qk_norm_rope_fp8)
against the separate statistics pass, at FLUX.1-dev 1024² shapes (H200): each path's kernels alone and together
with the quantization pass, launch variants of the fused kernel, and the attention's output both ways."""
import importlib, json, pathlib, sys
import torch
from bench import common

af, rope, attn = (importlib.import_module("sd_kernels.ops." + m) for m in ("attention_fp8", "rope", "attention"))
from sd_kernels.runtime.launch import next_pow2

out = pathlib.Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
dev, bf = "cuda", torch.bfloat16
res = {"env": common.environment(), "copy_gbps": common.copy_ceiling_gbps()}
print(res, flush=True)
H, D, ST, SI = 24, 128, 512, 4096
S = ST + SI
SETS = 3
wq, wk, ewq, ewk = (torch.rand(D, device=dev, dtype=bf) + 0.5 for _ in range(4))
cos, sin = torch.randn(S, D, device=dev), torch.randn(S, D, device=dev)


def timed(fn):
    return round(common.time_graph_ms(fn, calls=30, replays=9) / SETS * 1e3, 2)


def single_sets():
    return [torch.randn(1, S, 21504, device=dev, dtype=bf) for _ in range(SETS)]


def double_sets():
    return [(torch.randn(1, SI, 9216, device=dev, dtype=bf), torch.randn(1, ST, 9216, device=dev, dtype=bf))
            for _ in range(SETS)]


def args_of(kind, x):
    if kind == "single":
        return (x[..., :3072], x[..., 3072:6144], x[..., 6144:9216], D), dict(q_weight=wq, k_weight=wk, eps=1e-6,
                                                                             cos=cos, sin=sin)
    img, txt = x
    return ((img[..., :3072], img[..., 3072:6144], img[..., 6144:9216], D),
            dict(q_weight=wq, k_weight=wk, eps=1e-6, cos=cos, sin=sin, eq=txt[..., :3072], ek=txt[..., 3072:6144],
                 ev=txt[..., 6144:9216], eq_weight=ewq, ek_weight=ewk))


VARIANTS = [(1024, None, 128, 3), (1024, None, 128, 4), (1024, None, 256, 3), (1024, None, 256, 4), (512, None, 128, 4),
            (512, None, 256, 4), (1024, 4, 128, 3), (2048, None, 128, 3), (2048, None, 256, 3), (1024, None, 128, 5)]
if sys.argv[2:] == ["default"]:  # the shipped launch only
    VARIANTS = []
if sys.argv[2:] == ["chunks"]:  # the shipped launch, and 256 tokens a program at least
    VARIANTS = [(1024, None, 256, 3)]
rows = []
for kind, make in (("single", single_sets), ("double", double_sets)):
    sets = [args_of(kind, x) for x in make()]
    outs = [rope.qk_norm_rope(*a, **kw) for a, kw in sets]
    views = [(k.transpose(1, 2), v.transpose(1, 2)) for _, k, v in outs]

    def old_rope():
        for a, kw in sets:
            rope.qk_norm_rope(*a, **kw)

    def old_stats():
        for k4, v4 in views:
            B, Hh, Sk, Dd = k4.shape
            chunk = max(af.STATS_ROWS, next_pow2(-(-Sk // af.MAX_CHUNKS)))
            n = -(-Sk // chunk)
            ks = torch.empty(B * Hh, n, Dd, device=dev); vm = torch.empty_like(ks)
            af._STATS((Dd, True, k4.dtype, af.STATS_STEP, chunk), (B * Hh, n), k4, v4, ks, vm, *k4.stride(),
                      *v4.stride(), Hh, Sk, D=Dd, ROWS=af.STATS_STEP, CHUNK=chunk, V_MAX=True,
                      num_warps=af.STATS_WARPS)

    def old_path():
        for a, kw in sets:
            _, k, v = rope.qk_norm_rope(*a, **kw)
            af.quantize_kv(k.transpose(1, 2), v.transpose(1, 2), "fp8", "fp8", permute_v=True)

    def new_rope():
        for a, kw in sets:
            rope.qk_norm_rope_fp8(*a, **kw)

    def new_path():
        for a, kw in sets:
            _, k, v, st = rope.qk_norm_rope_fp8(*a, **kw)
            af.quantize_kv(k.transpose(1, 2), v.transpose(1, 2), "fp8", "fp8", permute_v=True, stats=st)

    r = {"kind": kind, "old_rope_us": timed(old_rope), "old_stats_us": timed(old_stats), "old_path_us": timed(old_path),
         "new_rope_us": timed(new_rope), "new_path_us": timed(new_path)}
    print(r, flush=True); rows.append(r)
    # launch variants of the fused kernel: elements a step (warps by blocks()'s rule, or given), tokens a program
    orig_blocks, orig_chunk, orig_elems, orig_stages = rope.blocks, rope.STATS_CHUNK, rope.STATS_ELEMS, rope.STATS_STAGES
    for elems, warps, chunk, stages in VARIANTS:
        rope.STATS_ELEMS, rope.STATS_CHUNK, rope.STATS_STAGES = elems, chunk, stages
        if warps is not None:
            rope.blocks = lambda hd, e=0, w=warps: (orig_blocks(hd, e)[0], orig_blocks(hd, e)[1], w)
        try:
            v = {"kind": kind, "elems": elems, "warps": warps or orig_blocks(D, elems)[2], "chunk": chunk,
                 "stages": stages, "rope_us": timed(new_rope), "path_us": timed(new_path)}
            try:
                v["regs_spills"] = sorted({(c.n_regs, c.n_spills) for c in rope._LAUNCH_STATS.jit.device_caches[0][0].values()})
            except Exception as e:  # noqa: BLE001
                v["regs_spills"] = str(e)[:100]
        except Exception as e:  # noqa: BLE001
            v = {"kind": kind, "elems": elems, "warps": warps, "chunk": chunk, "error": str(e)[:300]}
        rope.blocks, rope.STATS_CHUNK, rope.STATS_ELEMS, rope.STATS_STAGES = orig_blocks, orig_chunk, orig_elems, orig_stages
        print("variant", v, flush=True); rows.append(v)
    # the outputs both ways: K8 codes, scales, and the attention
    a, kw = sets[0]
    q, k, v, st = rope.qk_norm_rope_fp8(*a, **kw)
    k4, v4 = k.transpose(1, 2), v.transpose(1, 2)
    own = af.quantize_kv(k4, v4, "fp8", "fp8", permute_v=True)
    given = af.quantize_kv(k4, v4, "fp8", "fp8", permute_v=True, stats=st)
    q4 = q.transpose(1, 2)
    o_own = attn.attention(q4, k4, v4, precision="fp8")
    o_given = attn.attention(q4, k4, v4, precision="fp8", kv_stats=st)
    ref = torch.nn.functional.scaled_dot_product_attention(q4.float(), k4.float(), v4.float())
    c = {"kind": kind, "k8_codes_moved": int((own[0].float() != given[0].float()).sum()),
         "k8_max_move": float((own[0].float() - given[0].float()).abs().max()),
         "k_scale_same": bool(torch.equal(own[1], given[1])), "v8_same": bool(torch.equal(own[2], given[2])),
         "v_scale_same": bool(torch.equal(own[3], given[3])),
         "out_max_diff": float((o_own.float() - o_given.float()).abs().max()),
         "err_own": float((o_own.float() - ref).norm() / ref.norm()),
         "err_given": float((o_given.float() - ref).norm() / ref.norm())}
    print("compare", c, flush=True); rows.append(c)
    del sets, outs, views
res["rows"] = rows
(out / "kv-stats-fused.json").write_text(json.dumps(res, indent=1))
