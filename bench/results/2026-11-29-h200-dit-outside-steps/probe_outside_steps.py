"""Where a DiT pipeline call's time goes besides its denoising steps: each stage of one warm call
timed alone (CUDA synchronized around it), for stock, the lossless patch, the FP8 tier and the
compile peer, one process per model.

    python bench/results/2026-11-29-h200-dit-outside-steps/probe_outside_steps.py MODEL ROWS...

Stages: ``encode_prompt`` (every text encoder, prompt and negative) and ``vae.decode``; the rest of
the call (``loop_and_host``) is the denoising loop (its steps and the scheduler) and host work
(latents, image post-processing). Synchronizing around each stage adds a little to the call; the unsynchronized call
is timed too (``call_ms``, median of 3).
"""

import statistics
import sys
import time

import torch

from bench import fp8 as bench_fp8
from bench.dit import PROMPT, _extra_kwargs
from sd_kernels.models import build_pipeline, image_side


def timed(obj, name, store):
    fn = getattr(obj, name)

    def wrapper(*args, **kwargs):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        torch.cuda.synchronize()
        store[name] = store.get(name, 0.0) + (time.perf_counter() - t0) * 1e3
        return out

    had = name in vars(obj)  # an instance attribute already (a patch's or a compile's): put it back
    setattr(obj, name, wrapper)
    return lambda: setattr(obj, name, fn) if had else delattr(obj, name)


def main():
    model, rows = sys.argv[1], sys.argv[2:]
    dtype = bench_fp8._dtype(model)
    pipe = build_pipeline(model, "cuda", dtype)
    pipe.set_progress_bar_config(disable=True)
    side = image_side(model, None)
    extra = _extra_kwargs(pipe.__call__)

    def call():
        gen = torch.Generator(device="cuda").manual_seed(0)
        return pipe(PROMPT, num_inference_steps=20, height=side, width=side, generator=gen, output_type="pt",
                    return_dict=False, **extra)[0]

    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    for row in rows:
        label, context = bench_fp8._setup(row, "regional" if model.startswith("flux") else "recipe")
        with torch.no_grad(), context(pipe):
            call()
            call()
            torch.cuda.synchronize()
            times = []
            for _ in range(3):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                call()
                torch.cuda.synchronize()
                times.append((time.perf_counter() - t0) * 1e3)
            store: dict = {}
            undo = [timed(pipe, "encode_prompt", store), timed(pipe.vae, "decode", store)]
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            call()
            torch.cuda.synchronize()
            total = (time.perf_counter() - t0) * 1e3
            for u in undo:
                u()
        loop = total - sum(store.values())
        print(f"{model} {label}: call_ms={statistics.median(times):.1f} timed_call_ms={total:.1f} "
              + " ".join(f"{k}={v:.1f}" for k, v in store.items()) + f" loop_and_host={loop:.1f}", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
