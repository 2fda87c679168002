"""Per-kernel profile of one FLUX FP8 step (1024², bf16): name, calls, µs/step, mean µs, grid."""
import json, sys, pathlib, collections, tempfile
import torch
from bench.fp8 import _setup
from bench.dit import _extra_kwargs, _first_call, PROMPT
from bench.setups import denoiser_of
from sd_kernels.models import build_pipeline

out = pathlib.Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
rows = sys.argv[2].split(",") if len(sys.argv) > 2 else ["fp8"]
pipe = build_pipeline("flux-dev", "cuda", torch.bfloat16)
pipe.set_progress_bar_config(disable=True)
res = {}
for row in rows:
    label, ctx = _setup(row, "regional")
    with torch.no_grad(), ctx(pipe):
        den = denoiser_of(pipe)
        seen, hook = _first_call(den)
        g = torch.Generator(device="cuda").manual_seed(0)
        pipe(PROMPT, num_inference_steps=3, height=1024, width=1024, generator=g, output_type="latent",
             **_extra_kwargs(pipe.__call__))
        hook.remove()
        step = lambda: den(*seen["args"], **seen["kwargs"])
        for _ in range(3): step()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(10): step()
        e.record(); torch.cuda.synchronize()
        step_ms = s.elapsed_time(e) / 10
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            step(); torch.cuda.synchronize()
        tf = tempfile.mktemp(suffix=".json"); prof.export_chrome_trace(tf)
        tr = json.load(open(tf))
        agg = collections.defaultdict(lambda: [0, 0.0, set()])
        for ev in tr["traceEvents"]:
            if ev.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy"):
                a = agg[ev["name"][:90]]
                a[0] += 1; a[1] += ev["dur"]
                a[2].add(str(ev.get("args", {}).get("grid", "")) + " blk" + str(ev.get("args", {}).get("block", "")))
        lines = sorted(((v[1], k, v[0], sorted(v[2])[:6]) for k, v in agg.items()), reverse=True)
        print(f"== {label}: step {step_ms:.3f} ms, kernels {sum(l[0] for l in lines)/1e3:.3f} ms", flush=True)
        for us, k, n, grids in lines:
            print(f"{us/1e3:8.3f} ms {n:4d} x {us/n:8.2f} us  {k}  {grids}", flush=True)
        res[label] = {"step_ms": step_ms, "kernels": [(k, n, us, grids) for us, k, n, grids in lines]}
    torch.cuda.empty_cache()
(out / "kernels.json").write_text(json.dumps(res, indent=1))
