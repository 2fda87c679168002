"""FLUX.1-dev's GEMM kernels in one transformer call (one denoising step), ours lossless
(``patch(pipe)``, CUDA graph) against the regional compile peer, in one process: each GEMM kernel's
name, calls and device time, to find why our step spends more in GEMMs than the peer's.

    python bench/results/2026-11-29-h200-flux-peer-vae-compiled/probe_gemms.py
"""

import torch

from bench import fp8 as bench_fp8
from bench.dit import PROMPT, _extra_kwargs, _first_call
from bench.unet_kernels import category, kernel_times
from sd_kernels.models import build_pipeline


def main():
    pipe = build_pipeline("flux-dev", "cuda", torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    extra = _extra_kwargs(pipe.__call__)
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    for row in ("patched", "compile"):
        label, context = bench_fp8._setup(row, "regional")
        with torch.no_grad(), context(pipe):
            den = pipe.transformer
            seen, hook = _first_call(den)
            pipe(PROMPT, num_inference_steps=2, height=1024, width=1024, output_type="latent", **extra)
            hook.remove()

            def step(den=den, seen=seen):
                return den(*seen["args"], **seen["kwargs"])

            for _ in range(3):
                step()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                step()
                torch.cuda.synchronize()
        kernels, calls, _ = kernel_times(prof)
        gemms = sorted(((us, n) for n, us in kernels.items() if category(n) == "gemm"), reverse=True)
        print(f"== {label}: GEMM {sum(us for us, _ in gemms) / 1e3:.3f} ms in {len(gemms)} kernel names", flush=True)
        for us, name in gemms[:25]:
            per = us / calls[name]
            print(f"{us / 1e3:8.3f} ms {calls[name]:5d} calls {per:8.1f} us/call  {name[:150]}", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
