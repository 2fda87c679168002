"""The row kernels at FLUX's and SD3's shapes against a copy ceiling: the FP8 quantizer (as dispatched, and its
kernel at other rows and warps a program), the modulated LayerNorm + FP8 output and q/k-norm + RoPE at other
blocks. Each call timed in one CUDA graph over inputs rotated past L2.

    python probe.py --out DIR [quant] [ln] [rope]     (writes DIR/quant_probe.json)
"""
import importlib
import json
import os
import sys

import torch
import triton

f = importlib.import_module("sd_kernels.ops.fp8_quant")
ln = importlib.import_module("sd_kernels.ops.layer_norm")

dev = "cuda"
results = []


def graph_ms(fns, reps=20):
    """ms per call of one graph running every fn once (inputs rotated past L2)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for fn in fns:
            fn()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) / len(fns))
    ts.sort()
    return ts[len(ts) // 2]


def record(name, shape, variant, ms, nbytes, ok=None):
    r = {"name": name, "shape": shape, "variant": variant, "ms": round(ms, 5), "GB/s": round(nbytes / ms / 1e6, 1),
         "ok": ok}
    results.append(r)
    print(json.dumps(r), flush=True)


def same(a, b):
    return bool(torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1], b[1]))


def ceiling():
    src = torch.randn(256 * 2**20 // 2, device=dev, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = graph_ms([lambda: dst.copy_(src)])
    record("copy", "256MiB", "torch copy_", ms, 2 * src.numel() * 2)


def quant_new(x, prefix, act, rows, warps):
    n_rows = x.shape[0]
    n_pre = 0 if prefix is None else prefix.shape[1]
    n = x.shape[1] + n_pre
    q = torch.empty((n_rows, n), dtype=f.E4M3, device=dev)
    s = torch.empty((n_rows,), dtype=torch.float32, device=dev)
    p = x if prefix is None else prefix
    (w0, w1, w2, w3), n_p = f.row_pieces(n_pre, n - n_pre)
    f._quantize_kernel[(triton.cdiv(n_rows, rows),)](x, p, q, s, n_rows, n, n_pre, x.stride(0), 1, p.stride(0), 1,
                                                     ACT=act, GATED=False, HAS_PREFIX=prefix is not None,
                                                     GRID=f.interpreting(), ROWS=rows, BLOCK_C=0, W0=w0, W1=w1, W2=w2, W3=w3, NP=n_p,
                                                     num_warps=warps)
    return q, s


def quant_cases():
    cases = [("plain", 4608, 0, 3072, ""), ("gelu", 4096, 0, 12288, "tanh"), ("join", 4608, 3072, 12288, "tanh"),
             ("sd3-plain", 8858, 0, 1536, ""), ("sd3-gelu", 8192, 0, 6144, "tanh"), ("text-plain", 512, 0, 3072, ""),
             ("text-gelu", 512, 0, 12288, "tanh")]
    for name, m, npre, nx, act in cases:
        per = m * (nx + npre) * 2
        sets = max(2, -(-300 * 2**20 // per))
        xs = [torch.randn(m, nx, device=dev, dtype=torch.bfloat16) * 3 for _ in range(sets)]
        ps = [torch.randn(m, npre, device=dev, dtype=torch.bfloat16) for _ in range(sets)] if npre else [None] * sets
        nbytes = m * (nx + npre) * 3
        got = f.quantize_rows(xs[0], act, prefix=ps[0])
        ref = f.reference.fp8_quantize_rows(xs[0], act, prefix=ps[0])
        exact = same(got, ref)
        close = float((got[0].float() == ref[0].float()).float().mean())
        shape = f"{m}x{npre}+{nx}" if npre else f"{m}x{nx}"
        ms = graph_ms([lambda x=x, p=p: f.quantize_rows(x, act, prefix=p) for x, p in zip(xs, ps)])
        record(name, shape, "shipped " + str(f.quantize_blocks(m, nx + npre)) + f" codes equal to reference {close:.5f}",
               ms, nbytes, exact if not act else close > 0.99)
        for rows, warps in ((1, 2), (1, 4), (1, 8), (1, 16), (1, 32), (2, 4), (2, 8)):
            try:
                g2 = quant_new(xs[0], ps[0], act, rows, warps)
                ms = graph_ms([lambda x=x, p=p: quant_new(x, p, act, rows, warps) for x, p in zip(xs, ps)])
                record(name, shape, f"pieces rows={rows} warps={warps}", ms, nbytes, same(g2, got))
            except Exception as e:  # noqa: BLE001
                print(name, rows, warps, "failed", repr(e)[:300], flush=True)
        del xs, ps
        torch.cuda.empty_cache()


def rope_cases():
    rope = importlib.import_module("sd_kernels.ops.rope")
    for name, s_img, s_txt in (("rope-double", 4096, 512), ("rope-single", 4608, 0)):
        h, d = 24, 128
        sets = 3
        mk = lambda n: torch.randn(1, n, h * d, device=dev, dtype=torch.bfloat16)  # noqa: E731
        ins = [(mk(s_img), mk(s_img), mk(s_img), mk(s_txt) if s_txt else None, mk(s_txt) if s_txt else None,
                mk(s_txt) if s_txt else None) for _ in range(sets)]
        w = torch.rand(d, device=dev, dtype=torch.bfloat16) + 0.5
        cos = torch.randn(s_img + s_txt, d, device=dev, dtype=torch.float32)
        sin = torch.randn(s_img + s_txt, d, device=dev, dtype=torch.float32)
        def call(a):
            q, k, v, eq, ek, ev = a
            return rope.qk_norm_rope(q, k, v, d, w, w, 1e-6, cos, sin, eq, ek, ev, w if s_txt else None,
                                     w if s_txt else None)
        nbytes = (s_img + s_txt) * h * d * 2 * (4 if not s_txt else 6)
        ref = call(ins[0])
        orig = rope.blocks
        ms = graph_ms([lambda a=a: call(a) for a in ins])
        record(name, f"{s_img}+{s_txt}", f"shipped {orig(d)}", ms, nbytes, True)
        for rows, warps in ((8, 4), (16, 4), (32, 4), (32, 8), (64, 8), (16, 2), (8, 2)):
            rope.blocks = lambda hd, rows=rows, warps=warps: (rows, triton.next_power_of_2(hd), warps)
            try:
                got = call(ins[0])
                ok = all(torch.equal(a, b) for a, b in zip(got, ref))
                ms = graph_ms([lambda a=a: call(a) for a in ins])
                record(name, f"{s_img}+{s_txt}", f"config rows={rows} warps={warps}", ms, nbytes, ok)
            except Exception as e:  # noqa: BLE001
                print(name, rows, warps, "failed", repr(e)[:300], flush=True)
            finally:
                rope.blocks = orig
        del ins
        torch.cuda.empty_cache()


def ln_cases():
    for name, b, t, d in (("ln-flux", 1, 4608, 3072), ("ln-sd3", 2, 4429, 1536)):
        per = b * t * d * 2
        sets = max(2, -(-300 * 2**20 // per))
        xs = [torch.randn(b, t, d, device=dev, dtype=torch.bfloat16) for _ in range(sets)]
        sc = torch.randn(b, d, device=dev, dtype=torch.bfloat16)
        sh = torch.randn(b, d, device=dev, dtype=torch.bfloat16)
        nbytes = b * t * d * 5
        shipped = ln.blocks(b * t, d)
        ms = graph_ms([lambda x=x: ln.layer_norm_modulated_fp8(x, None, None, 1e-6, sc, sh) for x in xs])
        record(name, f"{b}x{t}x{d}", f"shipped {shipped}", ms, nbytes, True)
        ref = ln.layer_norm_modulated_fp8(xs[0], None, None, 1e-6, sc, sh)
        orig = ln.blocks
        for rows, warps in ((1, 2), (1, 4), (1, 8), (2, 4), (2, 8)):
            ln.blocks = lambda n_rows, dd, rows=rows, warps=warps: (rows, triton.next_power_of_2(dd), warps)
            try:
                got = ln.layer_norm_modulated_fp8(xs[0], None, None, 1e-6, sc, sh)
                ok = bool(torch.equal(got[0], ref[0]) and same(got[1:], ref[1:]))
                ms = graph_ms([lambda x=x: ln.layer_norm_modulated_fp8(x, None, None, 1e-6, sc, sh) for x in xs])
                record(name, f"{b}x{t}x{d}", f"config rows={rows} warps={warps}", ms, nbytes, ok)
            except Exception as e:  # noqa: BLE001
                print(name, rows, warps, "failed", repr(e)[:300], flush=True)
            finally:
                ln.blocks = orig
        del xs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    print(torch.__version__, triton.__version__, torch.cuda.get_device_name(0), flush=True)
    ceiling()
    args = sys.argv[1:]
    out = args[args.index("--out") + 1] if "--out" in args else "."
    which = [a for a in args if a in ("quant", "ln", "rope")] or ["quant", "ln", "rope"]
    if "quant" in which:
        quant_cases()
    if "ln" in which:
        ln_cases()
    if "rope" in which:
        rope_cases()
    ceiling()
    with open(os.path.join(out, "quant_probe.json"), "w") as fh:
        json.dump(results, fh, indent=1)
