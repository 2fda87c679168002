"""GPU probe: (1) torch._scaled_mm at FLUX's shapes, the single blocks' q/k/v and proj_mlp apart and as one
21,504-column GEMM; (2) where FLUX's FP8 image spends the time outside the denoiser's steps."""
import json, sys, time, pathlib, statistics
import torch
from bench import common
from sd_kernels.runtime import blas

out = pathlib.Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
res = {"env": common.environment()}
dev = "cuda"

def gemm(m, k, n, ws):
    a = (torch.randn(m, k, device=dev) * 0.1).to(torch.float8_e4m3fn)
    w = (torch.randn(n, k, device=dev) * 0.1).to(torch.float8_e4m3fn)
    sa = torch.rand(m, 1, device=dev) + 0.5
    sw = torch.rand(1, n, device=dev) + 0.5
    bias = torch.randn(n, device=dev, dtype=torch.bfloat16)
    def fn():
        with (blas.no_workspace() if not ws else __import__("contextlib").nullcontext()):
            return torch._scaled_mm(a, w.t(), scale_a=sa, scale_b=sw, bias=bias, out_dtype=torch.bfloat16,
                                    use_fast_accum=True)
    ms = common.time_graph_ms(fn, calls=50, replays=15)
    return {"m": m, "k": k, "n": n, "workspace": ws, "ms": round(ms, 5), "tflops": round(2 * m * n * k / ms / 1e9, 1)}

rows = []
for ws in (False, True):
    for (m, k, n) in [(4608, 3072, 9216), (4608, 3072, 12288), (4608, 3072, 21504), (4608, 15360, 3072),
                      (4096, 3072, 9216), (4096, 3072, 12288), (4096, 12288, 3072), (4096, 3072, 3072),
                      (512, 3072, 9216), (512, 3072, 12288), (512, 12288, 3072), (512, 3072, 3072)]:
        r = gemm(m, k, n, ws); rows.append(r); print(r, flush=True)
res["gemm"] = rows

# (2) FLUX FP8 image parts
from sd_kernels.models import build_pipeline
from bench.fp8 import _setup
from bench.dit import PROMPT, _extra_kwargs, _kernel_categories
pipe = build_pipeline("flux-dev", dev, torch.bfloat16)
pipe.set_progress_bar_config(disable=True)
label, ctx = _setup("fp8", "regional")

def ev(fn, n=3):
    ts = []
    for _ in range(n):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(); t0 = time.perf_counter(); s.record(); fn(); e.record(); torch.cuda.synchronize()
        ts.append((s.elapsed_time(e), (time.perf_counter() - t0) * 1e3))
    return {"gpu_ms": round(statistics.median(t[0] for t in ts), 2), "wall_ms": round(statistics.median(t[1] for t in ts), 2)}

with torch.no_grad(), ctx(pipe):
    extra = _extra_kwargs(pipe.__call__)
    def call(steps, ot="pt"):
        g = torch.Generator(device=dev).manual_seed(0)
        return pipe(PROMPT, num_inference_steps=steps, height=1024, width=1024, generator=g, output_type=ot,
                    return_dict=False, **extra)[0]
    call(20); torch.cuda.synchronize()
    parts = {"image_20": ev(lambda: call(20)), "latent_20": ev(lambda: call(20, "latent")),
             "latent_1": ev(lambda: call(1, "latent")), "latent_2": ev(lambda: call(2, "latent")),
             "encode_prompt": ev(lambda: pipe.encode_prompt(PROMPT, prompt_2=None, device=dev))}
    lat = torch.randn(1, 16, 128, 128, device=dev, dtype=torch.bfloat16)
    parts["vae_decode"] = ev(lambda: pipe.vae.decode(lat, return_dict=False))
    print(parts, flush=True)
    res["parts"] = parts
    print("encode_prompt kernels:", flush=True)
    res["encode_kernels"] = _kernel_categories(lambda: pipe.encode_prompt(PROMPT, prompt_2=None, device=dev))
    print(res["encode_kernels"], flush=True)
    print("vae decode kernels:", flush=True)
    res["decode_kernels"] = _kernel_categories(lambda: pipe.vae.decode(lat, return_dict=False))
    print(res["decode_kernels"], flush=True)
(out / "probe.json").write_text(json.dumps(res, indent=1))
