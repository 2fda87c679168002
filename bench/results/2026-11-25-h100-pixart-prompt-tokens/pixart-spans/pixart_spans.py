"""Where a PixArt-Σ 1024² call's time goes, the peer's and ours: CUDA events around the text encoder,
the transformer, scheduler.step and the VAE decode (bench.e2e.Spans), the rest split into before the
first model call, between calls and after the last; host syncs counted."""
import os, sys, json, time, statistics, warnings
sys.path.insert(0, os.getcwd())
import torch
from bench.e2e import PROMPT, Spans, wall_ms, _sync
from bench.dit import _extra_kwargs
from bench.setups import VARIANTS, applied
from sd_kernels import models

out = sys.argv[1]
variants = sys.argv[2].split(",")
pipe = models.build_pipeline("pixart-sigma", device="cuda", dtype=torch.float16)
pipe.set_progress_bar_config(disable=True)
extra = _extra_kwargs(pipe.__call__)


def call():
    gen = torch.Generator(device="cuda").manual_seed(0)
    return pipe(PROMPT, num_inference_steps=20, height=1024, width=1024, generator=gen, output_type="pt",
                return_dict=False, **extra)[0]


rows = []
for name in variants:
    with torch.no_grad(), applied(pipe, VARIANTS[name]):
        t0 = time.perf_counter(); call(); _sync(); warm = time.perf_counter() - t0
        e2e = statistics.median(wall_ms(call) for _ in range(3))
        calls = [(pipe.text_encoder, "forward", "text_ms"), (pipe.transformer, "forward", "transformer_ms"),
                 (pipe.scheduler, "step", "scheduler_ms"), (pipe.vae, "decode", "decode_ms"),
                 (pipe, "encode_prompt", "encode_prompt_ms")]
        with Spans(calls) as spans:
            _sync()
            cs = torch.cuda.Event(enable_timing=True)
            start = time.perf_counter(); cs.record()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    call()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            _sync()
            total = (time.perf_counter() - start) * 1e3
            parts = spans.totals_ms()
            first, last = spans.bounds()
        row = {"variant": name, "warmup_s": round(warm, 1), "e2e_ms": round(e2e, 2), "spanned_call_ms": round(total, 2),
               **{k: round(v, 2) for k, v in parts.items()},
               "lead_ms": round(cs.elapsed_time(first), 2),
               "syncs": sum("synchronizing" in str(w.message) for w in caught),
               "sync_sites": sorted({str(w.filename).split("/")[-1] + ":" + str(w.lineno) for w in caught
                                     if "synchronizing" in str(w.message)})[:10],
               "steps": len(spans.events["transformer_ms"])}
        print(json.dumps(row), flush=True)
        rows.append(row)
    torch._dynamo.reset()
json.dump(rows, open(f"{out}/spans.json", "w"), indent=1)
