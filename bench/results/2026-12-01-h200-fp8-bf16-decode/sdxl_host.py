"""Host time of one warm SDXL FP8 pipeline call before its first UNet step: the pipeline's methods timed, then cProfile."""
import cProfile, io, json, pstats, sys, time
import torch
from bench.e2e import Bench, parse_targets, pipeline_call
from bench.setups import VARIANTS, applied

(target,) = parse_targets("sdxl@1024")
with torch.inference_mode():
    bench = Bench(target, 20, repeats=1)
    pipe = bench.pipe
    with applied(pipe, VARIANTS["patched+graph+fp8"]):
        call = pipeline_call(pipe, target.size, 20)
        call(); call(); torch.cuda.synchronize()
        marks = []
        t0 = [0.0]
        def wrap(obj, name, label):
            inner = getattr(obj, name)
            def f(*a, **k):
                s = time.perf_counter(); r = inner(*a, **k); marks.append((label, (s - t0[0]) * 1e3, (time.perf_counter() - s) * 1e3)); return r
            object.__setattr__(obj, name, f)
            return (obj, name, inner)
        saved = [wrap(pipe, "encode_prompt", "encode_prompt"), wrap(pipe, "check_inputs", "check_inputs"),
                 wrap(pipe, "prepare_latents", "prepare_latents"), wrap(pipe, "_get_add_time_ids", "_get_add_time_ids"),
                 wrap(pipe.tokenizer, "__call__", "tokenizer"), wrap(pipe.tokenizer_2, "__call__", "tokenizer_2"),
                 wrap(pipe.text_encoder, "forward", "text_encoder"), wrap(pipe.text_encoder_2, "forward", "text_encoder_2"),
                 wrap(pipe.unet, "forward", "unet"), wrap(pipe.scheduler, "set_timesteps", "set_timesteps"),
                 wrap(pipe, "progress_bar", "progress_bar")]
        for rep in range(2):
            marks.clear(); torch.cuda.synchronize(); t0[0] = time.perf_counter(); call(); torch.cuda.synchronize()
            print(json.dumps([m for m in marks if m[0] != "unet"][:30] + [m for m in marks if m[0] == "unet"][:2]), flush=True)
        for obj, name, inner in saved:
            object.__setattr__(obj, name, inner)
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable(); call(); torch.cuda.synchronize(); prof.disable()
        s = io.StringIO(); pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(60); print(s.getvalue()[:14000])
