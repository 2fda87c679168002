"""Transformer (DiT) pipelines end to end: stock, diffusers' compile recipe and ours in one process, with fidelity.

    python -m bench.dit --out DIR [--model pixart-sigma|sd3-medium] [--size 1024] [--steps 20] [--calls 3]
                        [--variants stock,patched+graph,...]

The variants are bench/setups.py's, applied to the pipeline's transformer where SD pipelines have a
UNet: ``stock`` (diffusers eager, SDPA), ``patched+graph`` (``patch(pipe)``'s default: the transformer,
the VAE decode and the text encoders replayed from CUDA graphs), the recipe ``stock+compile-graphs``
(diffusers' speed recipe: the transformer's QKV projections fused, ``torch.compile(mode="reduce-overhead",
fullgraph=True)`` of its forward and of the VAE's decode, the VAE channels_last) and the same without
the fused projections (``stock+compile-graphs-unfused-qkv``), ``patched+graph+compile``
(``patch(pipe, compile=True)``) and ``patched+graph+compile+fused-qkv`` (the fusion first). Random
weights from the shipped config, fp16 (``--dtype``), one prompt with classifier-free guidance (transformer
batch 2; FLUX.1-dev embeds its guidance: batch 1).
``vs_peer`` divides by the faster of the two recipe rows: the recipe at its best.

Per variant, one row of ``DIR/dit.csv``, written as soon as it is measured: ``warmup_s`` (set-up and
the first call: compilation, tuning, capture), ``e2e_ms`` (median of ``--calls`` pipeline calls,
output a tensor), ``step_ms`` (one transformer call at batch 2 on the first step's inputs, back to
back as the loop issues them, steady: the device time for graphed or compiled variants),
``latent_rel_err`` (the final latents against stock eager's, relative L2), ``psnr_db`` (the decoded
image against stock eager's, pixels in [0, 1]) and ``kernels_ms`` (that transformer call's device time
by kernel category, bench.unet_kernels.CATEGORIES, from a profile of one call).
"""

from __future__ import annotations

import argparse
import csv
import inspect
import pathlib
import statistics
import sys
import time

import torch

from bench.common import environment
from bench.e2e import PROMPT, steady_ms, wall_ms
from bench.setups import PEER, PEER_UNFUSED, VARIANTS, applied, denoiser_of
from sd_kernels.testing import psnr, rel_err

DEFAULT = ("stock", "patched+graph", PEER, PEER_UNFUSED, "patched+graph+compile", "patched+graph+compile+fused-qkv")
COLUMNS = ["model", "size", "steps", "dtype", "variant", "warmup_s", "e2e_ms", "vs_peer", "step_ms", "latent_rel_err",
           "psnr_db", "gpu_gib", "peak_gib", "kernels_ms", "patched", "device", "torch", "triton", "diffusers", "date"]


def _first_call(model: torch.nn.Module) -> tuple[dict, object]:
    """(a dict that gets the first call's args and kwargs, cloned; the hook's handle)."""
    seen: dict = {}

    def clone(v):
        return v.clone() if isinstance(v, torch.Tensor) else v

    def hook(_module, args, kwargs):
        if not seen:
            seen["args"] = tuple(clone(a) for a in args)
            seen["kwargs"] = {k: clone(v) for k, v in kwargs.items()}

    return seen, model.register_forward_pre_hook(hook, with_kwargs=True)


def _extra_kwargs(fn) -> dict:
    """What a pipeline's ``__call__`` / ``encode_prompt`` takes beyond the prompt: PixArt's caption
    cleaning off (it needs packages the benchmark does not), SD3's second and third prompts (required
    positionally by its ``encode_prompt``) as the first, and SD1.x/2.x's required image count and guidance
    flag (one image, with guidance)."""
    params = inspect.signature(fn).parameters
    extra = {"clean_caption": False} if "clean_caption" in params else {}
    required = {"prompt_2": None, "prompt_3": None, "num_images_per_prompt": 1, "do_classifier_free_guidance": True}
    return extra | {p: v for p, v in required.items() if p in params and params[p].default is params[p].empty}


def measure(pipe, name: str, size: int, steps: int, calls: int, ref: dict, context=None,
            images: dict | None = None) -> dict:
    """One row: ``pipe`` set up as variant ``name`` (or by ``context(pipe)``, a context manager that
    yields the row's facts, as ``applied`` does) and timed; ``images`` (if given) gets its image."""
    device = pipe._execution_device
    extra = _extra_kwargs(pipe.__call__)

    def call(output_type: str) -> torch.Tensor:
        gen = torch.Generator(device=device).manual_seed(0)
        return pipe(PROMPT, num_inference_steps=steps, height=size, width=size, generator=gen,
                    output_type=output_type, return_dict=False, **extra)[0]

    start = time.perf_counter()
    setup = context(pipe) if context is not None else applied(pipe, VARIANTS[name])
    with torch.no_grad(), setup as info:  # as the pipeline runs: graphs capture only so
        denoiser = denoiser_of(pipe)  # after the set-up: its forward may be compiled or graphed
        seen, hook = _first_call(denoiser)
        image = call("pt")
        torch.cuda.synchronize()
        warmup = time.perf_counter() - start
        hook.remove()
        # the row's weights, codes, caches and its graphs' outputs, warm: a CUDA graph's private pool holds the
        # intermediates of its replays as reserved memory, which neither figure counts
        held = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        e2e = statistics.median(wall_ms(lambda: call("pt")) for _ in range(calls))
        peak = torch.cuda.max_memory_allocated(device)
        latent = call("latent")
        step_call = lambda: denoiser(*seen["args"], **seen["kwargs"])  # noqa: E731
        step = steady_ms(step_call)
        kernels = _kernel_categories(step_call)
    if not ref:
        ref.update(latent=latent, image=image)
    if images is not None:
        images[name] = image
    return {"variant": name, "warmup_s": round(warmup, 1), "e2e_ms": round(e2e, 2), "step_ms": round(step, 3),
            "latent_rel_err": f"{rel_err(latent, ref['latent']):.2e}", "psnr_db": round(psnr(image, ref["image"]), 2),
            "gpu_gib": round(held / 2**30, 2), "peak_gib": round(peak / 2**30, 2),
            "kernels_ms": " ".join(f"{c}={ms}" for c, ms in kernels.items()), "patched": info["patched"]}


def _kernel_categories(call) -> dict[str, float]:
    """Device ms per kernel category (bench.unet_kernels.CATEGORIES) of one call, after a warm one, and the
    GPU's idle time between its first kernel and its last ("idle"), whose largest parts by the kernels on each
    side of a gap (bench.timeline's ``idle_by_boundary``) are printed."""
    from bench.timeline import gaps, idle_by_boundary
    from bench.unet_kernels import categories_us, kernel_times

    call()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    kernels, _, spans = kernel_times(prof)
    cats = {c: round(us / 1e3, 3) for c, us in categories_us(kernels).most_common()}
    _, idle = gaps(spans)
    cats["idle"] = round(sum(g["us"] for g in idle) / 1e3, 3)
    print(f"  idle {cats['idle']} ms in {len(idle)} gaps; by boundary:",
          *(f"    {r}" for r in idle_by_boundary(idle, top=10)), sep="\n", flush=True)
    return cats


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=pathlib.Path, required=True)
    ap.add_argument("--model", default="pixart-sigma")
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16",
                    help="bfloat16: FLUX's own dtype (its random-weight activations may overflow fp16)")
    ap.add_argument("--variants", default=",".join(DEFAULT))
    args = ap.parse_args(argv)
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or variants[0] != "stock":
        print(f"bench.dit: --variants must start with stock (the reference) and name bench/setups.py variants; "
              f"unknown: {unknown}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench.dit needs a CUDA GPU", file=sys.stderr)
        return 2
    from sd_kernels.models import build_pipeline

    env = environment()
    stamp = {k: env.get(k, "") for k in ("device", "torch", "triton", "diffusers", "date")}
    t0 = time.perf_counter()
    pipe = build_pipeline(args.model, "cuda", getattr(torch, args.dtype))
    pipe.set_progress_bar_config(disable=True)
    embeds = pipe.encode_prompt(PROMPT, device="cuda", **_extra_kwargs(pipe.encode_prompt))[0]
    if not torch.isfinite(embeds).all():
        print(f"bench.dit: the random-weight text encoder's {args.dtype} output is not finite", file=sys.stderr)
        return 1
    print(f"[{time.perf_counter() - t0:6.1f} s] built {args.model} ({stamp})", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    ref: dict = {}
    for name in variants:
        row = {"model": args.model, "size": args.size, "steps": args.steps, "dtype": args.dtype,
               **measure(pipe, name, args.size, args.steps, args.calls, ref), **stamp}
        rows.append(row)
        peer = min((r["e2e_ms"] for r in rows if r["variant"] in (PEER, PEER_UNFUSED)), default=None)
        for r in rows:
            r["vs_peer"] = round(r["e2e_ms"] / peer, 3) if peer else ""
        print(f"[{time.perf_counter() - t0:6.1f} s] {name}: warm-up {row['warmup_s']} s, e2e {row['e2e_ms']} ms, "
              f"step {row['step_ms']} ms, latent err {row['latent_rel_err']}, {row['psnr_db']} dB; "
              f"kernels {row['kernels_ms']}; {row['patched']}", flush=True)
        with open(args.out / "dit.csv", "w", newline="") as f:  # after every variant: a cut run keeps its rows
            writer = csv.DictWriter(f, COLUMNS)
            writer.writeheader()
            writer.writerows(rows)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
