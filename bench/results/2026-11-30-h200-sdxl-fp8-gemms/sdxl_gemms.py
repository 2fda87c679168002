"""SDXL under precision="fp8": every FP8 GEMM and quantizer call of one UNet forward (batch 2, 1024²),
grouped by signature, each timed alone (CUDA-graph replays) against fp16 F.linear of the same shape."""
import collections, importlib
import torch, torch.nn.functional as F
from triton.testing import do_bench_cudagraph
import sd_kernels
from sd_kernels.models import build_pipeline

f = importlib.import_module("sd_kernels.ops.fp8_linear")
qm = importlib.import_module("sd_kernels.ops.fp8_quant")
pipe = build_pipeline("sdxl", "cuda", torch.float16)
pipe.set_progress_bar_config(disable=True)
rec = sd_kernels.patch(pipe, precision="fp8", cuda_graph=False)
print(rec.quantized.format() if rec.quantized else "", flush=True)

def clone(t):
    if not isinstance(t, torch.Tensor):
        return t
    c = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    c.copy_(t)
    return c

gemms, quants = collections.OrderedDict(), collections.OrderedDict()
orig_gemm, orig_q = f.fp8_gemm, f.quantize_rows
def sig(t):
    return None if t is None else (tuple(t.shape), tuple(t.stride()), str(t.dtype).removeprefix("torch."))
def gemm(a_q, s_a, w_q, s_w, bias=None, act="", gate=None, residual=None, out_dtype=torch.bfloat16, out=None, skip=None):
    key = (sig(a_q), sig(w_q), bias is not None, act, sig(gate), sig(residual), str(out_dtype), sig(out))
    if key not in gemms:
        gemms[key] = [0, [clone(t) for t in (a_q, s_a, w_q, s_w, bias)], act, clone(gate), clone(residual), out_dtype, clone(out)]
    gemms[key][0] += 1
    return orig_gemm(a_q, s_a, w_q, s_w, bias, act, gate, residual, out_dtype, out, skip)
def quant(x, act="", gated=False, prefix=None):
    key = (sig(x), act, gated, sig(prefix))
    if key not in quants:
        quants[key] = [0, clone(x), act, gated, clone(prefix)]
    quants[key][0] += 1
    return orig_q(x, act, gated, prefix)
f.fp8_gemm = gemm
f.quantize_rows = quant
qm.quantize_rows = quant
unet = pipe.unet
with torch.no_grad():
    pipe("a photograph", num_inference_steps=1, height=1024, width=1024, output_type="latent",
         generator=torch.Generator("cuda").manual_seed(0))
f.fp8_gemm, f.quantize_rows, qm.quantize_rows = orig_gemm, orig_q, orig_q

tot_ours = tot_fp16 = 0.0
print(f"{'n':>4} {'M':>6} {'K':>5} {'N':>6} {'a contig':>8} ep  out  ours_us  fp16_us  smm_us  ours*n  fp16*n", flush=True)
for key, (n, (a_q, s_a, w_q, s_w, bias), act, gate, res, dt, out) in gemms.items():
    M, K, N = s_a.numel(), w_q.shape[1], w_q.shape[0]
    x16 = torch.randn(M, K, device="cuda", dtype=dt)
    w16 = torch.randn(N, K, device="cuda", dtype=dt)
    ours = do_bench_cudagraph(lambda: orig_gemm(a_q, s_a, w_q, s_w, bias, act, gate, res, dt, out), rep=30) * 1e3
    fp16 = do_bench_cudagraph(lambda: F.linear(x16, w16, bias), rep=30) * 1e3
    a2 = a_q.reshape(-1, K).contiguous()
    try:
        smm = do_bench_cudagraph(lambda: torch._scaled_mm(a2, w_q.t(), scale_a=s_a.reshape(-1, 1).float(), scale_b=s_w.view(1, -1),
                                                         bias=bias, out_dtype=dt, use_fast_accum=True), rep=30) * 1e3
    except Exception as e:
        smm = float("nan")
    ep = ("b" if bias is not None else "") + (act or "") + ("g" if gate is not None else "") + ("r" if res is not None else "")
    tot_ours += n * ours; tot_fp16 += n * fp16
    print(f"{n:4d} {M:6d} {K:5d} {N:6d} {str(a_q.is_contiguous()):>8} {ep:3s} {'y' if out is not None else '-'}  {ours:7.1f}  {fp16:7.1f}  {smm:6.1f}  {n*ours/1e3:6.3f}  {n*fp16/1e3:6.3f}", flush=True)
print(f"GEMMs of one UNet call: ours {tot_ours/1e3:.3f} ms, fp16 F.linear {tot_fp16/1e3:.3f} ms", flush=True)
tot = 0.0
for key, (n, x, act, gated, prefix) in quants.items():
    t = do_bench_cudagraph(lambda: orig_q(x, act, gated, prefix), rep=30) * 1e3
    tot += n * t
    print(f"quant {n:4d} {key[0]} act={act!r} gated={gated} prefix={prefix is not None}  {t:6.1f} us  total {n*t/1e3:.3f} ms", flush=True)
print(f"quantizers of one UNet call: {tot/1e3:.3f} ms", flush=True)
# the eager profile's kernels
from torch.profiler import profile, ProfilerActivity
x = torch.randn(2, 4, 128, 128, device="cuda", dtype=torch.float16)
t = torch.tensor(500.0, device="cuda")
enc = torch.randn(2, 77, 2048, device="cuda", dtype=torch.float16)
added = {"text_embeds": torch.randn(2, 1280, device="cuda", dtype=torch.float16), "time_ids": torch.randn(2, 6, device="cuda", dtype=torch.float16)}
with torch.no_grad():
    for _ in range(2):
        unet(x, t, enc, added_cond_kwargs=added)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        unet(x, t, enc, added_cond_kwargs=added)
        torch.cuda.synchronize()
print(p.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70), flush=True)
