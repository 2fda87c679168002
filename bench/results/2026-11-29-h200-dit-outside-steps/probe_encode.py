"""Why SD3-medium's ``encode_prompt`` took twice stock's time in the compile recipe's row of
probe_outside_steps.py: the text encoders (eager in the recipe) timed alone, before the recipe is
applied, inside it before and after its first calls, and after it is undone, with the host's load
average and the number of child processes (inductor's compile workers) beside each.

    python bench/results/2026-11-29-h200-dit-outside-steps/probe_encode.py
"""

import os
import statistics
import time

import torch

from bench.dit import PROMPT, _extra_kwargs
from bench.setups import PEER, VARIANTS, applied
from sd_kernels.models import build_pipeline, image_side


def children() -> int:
    me = str(os.getpid())
    n = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    n += f.read().split(") ", 1)[1].split()[1] == me
            except OSError:
                pass
    return n


def main():
    pipe = build_pipeline("sd3-medium", "cuda", torch.float16)
    pipe.set_progress_bar_config(disable=True)
    side = image_side("sd3-medium", None)
    extra = _extra_kwargs(pipe.encode_prompt)

    def encode_ms() -> float:
        times = []
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            pipe.encode_prompt(PROMPT, device="cuda", do_classifier_free_guidance=True, **extra)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    def call():
        gen = torch.Generator(device="cuda").manual_seed(0)
        pipe(PROMPT, num_inference_steps=20, height=side, width=side, generator=gen, output_type="pt",
             return_dict=False, **_extra_kwargs(pipe.__call__))

    def report(stage):
        print(f"{stage}: encode_prompt {encode_ms():.1f} ms, load {os.getloadavg()[0]:.1f}, "
              f"child processes {children()}", flush=True)

    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    with torch.no_grad():
        report("stock, before any compile")
        with applied(pipe, VARIANTS[PEER]):
            report("recipe applied, before its first call")
            call()
            call()
            report("recipe, after two calls")
            time.sleep(20)
            report("recipe, 20 s later")
        report("recipe undone")


if __name__ == "__main__":
    main()
