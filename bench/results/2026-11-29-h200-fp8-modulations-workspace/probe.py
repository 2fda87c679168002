"""Probes: cuBLASLt workspace control on this torch; the quantizer's warps at FLUX's shapes."""
import os, sys, json, torch, triton
from torch.profiler import profile, ProfilerActivity
import triton.testing as tt
out = sys.argv[1]
res = {"torch": torch.__version__, "triton": triton.__version__,
       "has_setter": hasattr(torch._C, "_cuda_setCublasLtWorkspaceSize"),
       "has_backend_fn": hasattr(torch.backends.cuda, "cublaslt_workspace_size")}
dev = "cuda"
a = torch.randn(4096, 3072, device=dev).to(torch.float8_e4m3fn)
b = torch.randn(3072, 3072, device=dev).to(torch.float8_e4m3fn)
sa = torch.rand(4096, 1, device=dev) + 0.5
sb = torch.rand(1, 3072, device=dev) + 0.5
def mm():
    return torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=True)
def memsets(tag):
    mm(); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(3):
            mm()
        torch.cuda.synchronize()
    names = [e.name for e in p.events() if e.device_type.name == "CUDA"]
    t = tt.do_bench(mm, rep=200)
    res[tag] = {"memsets": sum("emset" in n for n in names), "kernels": sorted(set(n[:90] for n in names)), "ms": t}
memsets("default")
os.environ["CUBLASLT_WORKSPACE_SIZE"] = "0"
memsets("env0_midprocess")
del os.environ["CUBLASLT_WORKSPACE_SIZE"]
memsets("env_unset_again")
if res["has_setter"]:
    old = torch._C._cuda_getCublasLtWorkspaceSize()
    res["setter_default_size"] = old
    torch._C._cuda_setCublasLtWorkspaceSize(0)
    memsets("setter0")
    torch._C._cuda_setCublasLtWorkspaceSize(old)
    memsets("setter_back")
# the quantizer's warps
from sd_kernels.ops import fp8_quant as fq
orig = fq.quantize_blocks
shapes = {"attn_out": ((4608, 3072), "", None), "ff_gelu": ((4096, 12288), "tanh", None),
          "single_join": ((4608, 12288), "tanh", (4608, 3072))}
sweep = {}
for name, (shape, act, pshape) in shapes.items():
    xs = [torch.randn(shape, device=dev, dtype=torch.bfloat16) for _ in range(4)]
    ps = [None if pshape is None else torch.randn(pshape, device=dev, dtype=torch.bfloat16) for _ in range(4)]
    nbytes = xs[0].numel() * 2 + (0 if pshape is None else ps[0].numel() * 2)
    nbytes += (shape[0] * (shape[1] + (0 if pshape is None else pshape[1])))
    cp_src = torch.empty(nbytes // 2, device=dev, dtype=torch.bfloat16); cp_dst = torch.empty_like(cp_src)
    copy_ms = tt.do_bench(lambda: cp_dst.copy_(cp_src), rep=200)
    row = {"bytes": nbytes, "copy_ms": copy_ms}
    for warps in (4, 8, 16, 32):
        fq.quantize_blocks = lambda r, c, elems=fq._ELEMS, batch=fq._ROW_ELEMS, w=warps: (*orig(r, c, elems, batch)[:2], w)
        i = [0]
        def f():
            i[0] = (i[0] + 1) % 4
            return fq.quantize_rows(xs[i[0]], act, prefix=ps[i[0]])
        try:
            row[f"w{warps}"] = tt.do_bench(f, rep=200)
        except Exception as e:
            row[f"w{warps}"] = repr(e)[:200]
    fq.quantize_blocks = orig
    row["default_cfg"] = orig(shape[0], shape[1] + (0 if pshape is None else pshape[1]))
    sweep[name] = row
res["quantizer_sweep"] = sweep
json.dump(res, open(f"{out}/probe.json", "w"), indent=1, default=str)
print(json.dumps(res, indent=1, default=str))
