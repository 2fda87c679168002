"""SD3-medium 1024², 20 steps: the transformer step timed inside the pipeline (CUDA events around each
call) against the same step called alone back to back (bench.dit's step_ms), ours and the peer, with the
SM clock and power sampled around each (why did our isolated step measure above our end-to-end time?)."""
import os, sys, json, statistics
sys.path.insert(0, os.getcwd())
import torch
from bench.e2e import PROMPT, Spans, wall_ms, _sync, steady_ms
from bench.dit import _extra_kwargs, _first_call
from bench.setups import VARIANTS, applied
from sd_kernels import models

out = sys.argv[1]
variants = sys.argv[2].split(",")
pipe = models.build_pipeline("sd3-medium", device="cuda", dtype=torch.float16)
pipe.set_progress_bar_config(disable=True)
extra = _extra_kwargs(pipe.__call__)


def call():
    gen = torch.Generator(device="cuda").manual_seed(0)
    return pipe(PROMPT, num_inference_steps=20, height=1024, width=1024, generator=gen, output_type="pt",
                return_dict=False, **extra)[0]


def gpu_state():
    try:
        return {"sm_mhz": torch.cuda.clock_rate(), "power_mw": torch.cuda.power_draw(),
                "temp_c": torch.cuda.temperature()}
    except Exception as e:  # NVML missing
        return {"error": str(e)[:100]}


rows = []
for name in variants:
    with torch.no_grad(), applied(pipe, VARIANTS[name]):
        seen, hook = _first_call(pipe.transformer)
        call(); _sync()
        hook.remove()
        e2e = statistics.median(wall_ms(call) for _ in range(3))
        with Spans([(pipe.transformer, "forward", "transformer")]) as spans:
            _sync(); before = gpu_state(); call(); _sync(); after = gpu_state()
        steps = [s.elapsed_time(e) for s, e in spans.events["transformer"]]
        step_call = lambda: pipe.transformer(*seen["args"], **seen["kwargs"])  # noqa: E731
        iso_before = gpu_state()
        iso = steady_ms(step_call)
        iso_after = gpu_state()
        # the same isolated call with a 5 ms pause between calls (a clock that drops under a sustained load?)
        def paused():
            step_call(); torch.cuda._sleep(int(5e-3 * 1.7e9))
        paused_ms = steady_ms(paused)
        fwd = type(vars(pipe.transformer).get("forward")).__name__
        row = {"variant": name, "e2e_ms": round(e2e, 2), "in_pipeline_step_ms": [round(x, 3) for x in steps],
               "in_pipeline_median_ms": round(statistics.median(steps), 3), "isolated_step_ms": round(iso, 3),
               "isolated_with_5ms_pause_ms": round(paused_ms, 3), "forward": fwd,
               "gpu_in_pipeline": [before, after], "gpu_isolated": [iso_before, iso_after],
               "seen_kwargs": {k: (tuple(v.shape), str(v.dtype), v.device.type) if isinstance(v, torch.Tensor) else repr(v)[:40]
                               for k, v in seen["kwargs"].items()}}
        print(json.dumps(row), flush=True)
        rows.append(row)
    torch._dynamo.reset()
json.dump(rows, open(f"{out}/sd3_step.json", "w"), indent=1)
