"""Graphed tiny pipelines on the GPU called under inference mode, outside it, then under it again: each call's
latents against the same patch without graphs (under no_grad), and the graphs' count."""
import torch, sd_kernels
from sd_kernels import models
def run(pipe):
    g = torch.Generator("cuda").manual_seed(0)
    return pipe("a cat", num_inference_steps=2, height=64, width=64, generator=g, output_type="latent", return_dict=False)[0]
bad = 0
for name, precision, dtype in [("tiny", None, torch.float16), ("tiny-xl", "fp8", torch.float16), ("tiny-flux", "fp8", torch.bfloat16), ("tiny-flux", None, torch.bfloat16)]:
    for mode in (True, "step"):
        try:
            kw = {} if precision is None else {"precision": precision}
            ref_pipe = models.build_pipeline(name, device="cuda", dtype=dtype); ref_pipe.set_progress_bar_config(disable=True)
            sd_kernels.patch(ref_pipe, cuda_graph=False, **kw)
            with torch.no_grad():
                want = run(ref_pipe).float()
            pipe = models.build_pipeline(name, device="cuda", dtype=dtype); pipe.set_progress_bar_config(disable=True)
            rec = sd_kernels.patch(pipe, cuda_graph=mode, **kw)
            for inf in (True, False, True, False):
                with torch.inference_mode(inf):
                    got = run(pipe).float()
                d = float((got - want).abs().max()) / max(float(want.abs().max()), 1e-9)
                ok = d < 5e-2
                bad += not ok
                print(f"{name} precision={precision} cuda_graph={mode!r} inference_mode={inf}: max|diff|/max|ref| {d:.2e} {'ok' if ok else 'FAIL'}", flush=True)
            den = next((m for m in (pipe.transformer if hasattr(pipe, "transformer") else pipe.unet,)), None)
            print("  graphs:", len(getattr(den.forward, "graphs", {}) or {}), "counts:", dict(rec.counts), flush=True)
        except Exception as exc:
            bad += 1
            import traceback; traceback.print_exc()
            print(f"{name} precision={precision} cuda_graph={mode!r}: RAISED {type(exc).__name__}: {exc}", flush=True)
print("failures:", bad)
