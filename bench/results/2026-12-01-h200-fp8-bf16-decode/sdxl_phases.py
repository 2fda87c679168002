"""Where SDXL's FP8 image goes outside its steps: CUDA events around each model call of one warm pipeline call."""
import collections, json, sys, time
import torch
from bench.e2e import Bench, parse_targets, pipeline_call
from bench.setups import VARIANTS, applied

out = {}
(target,) = parse_targets("sdxl@1024")
with torch.inference_mode():
    bench = Bench(target, 20, repeats=1)
    pipe = bench.pipe
    for variant in ("patched+graph+fp8",):
        with applied(pipe, VARIANTS[variant]):
            call = pipeline_call(pipe, target.size, 20)
            call(); call()
            spans = collections.defaultdict(list)
            def wrap(obj, name, label):
                inner = getattr(obj, name)
                def f(*a, **k):
                    s = torch.cuda.Event(enable_timing=True); e = torch.cuda.Event(enable_timing=True)
                    s.record(); r = inner(*a, **k); e.record(); spans[label].append((s, e)); return r
                object.__setattr__(obj, name, f)
                return inner
            saved = [(pipe.text_encoder, "forward", wrap(pipe.text_encoder, "forward", "text_encoder")),
                     (pipe.text_encoder_2, "forward", wrap(pipe.text_encoder_2, "forward", "text_encoder_2")),
                     (pipe.unet, "forward", wrap(pipe.unet, "forward", "unet")),
                     (pipe.vae, "decode", wrap(pipe.vae, "decode", "vae.decode"))]
            res = []
            for rep in range(3):
                spans.clear()
                torch.cuda.synchronize()
                s0 = torch.cuda.Event(enable_timing=True); e0 = torch.cuda.Event(enable_timing=True)
                t0 = time.perf_counter(); s0.record(); call(); e0.record(); torch.cuda.synchronize()
                wall = (time.perf_counter() - t0) * 1e3
                row = {"wall_ms": wall, "gpu_ms": s0.elapsed_time(e0)}
                for k, v in spans.items():
                    row[k] = sum(a.elapsed_time(b) for a, b in v); row[k + "_calls"] = len(v)
                firsts = {k: s0.elapsed_time(v[0][0]) for k, v in spans.items()}
                row["start_of"] = firsts
                u = spans["unet"]; row["between_unet_calls_ms"] = sum(u[i][1].elapsed_time(u[i + 1][0]) for i in range(len(u) - 1))
                row["after_last_unet_ms"] = u[-1][1].elapsed_time(e0)
                row["before_first_unet_ms"] = s0.elapsed_time(u[0][0])
                res.append(row); print(variant, json.dumps(row), flush=True)
            for obj, name, inner in saved:
                object.__setattr__(obj, name, inner)
            out[variant] = res
json.dump(out, open(sys.argv[1], "w"), indent=1)
