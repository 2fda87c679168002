"""One image on several GPUs: ours against diffusers' own context parallelism + torch.compile, W GPUs against one.

    torchrun --standalone --nproc_per_node W -m bench.parallel --out DIR [--models flux-dev,sd3-medium,...]
             [--size 1024] [--steps 28] [--calls 3] [--variants ...]

Run it with W = 1 first, on the same machine as the W > 1 runs: the one-GPU runs write the reference
(``DIR/reference-<model>-<size>-<steps>.pt``: stock eager's latents and image, every one-GPU variant's
time, kept across runs that measure some variants each), which the runs on W GPUs compare with.
Random weights from the shipped configs (every process builds the same ones from the same seed), one
prompt, the same seed on every process; fp16, FLUX bf16 (its own dtype).
Variants (``plan`` says which apply to a model at W):

- one GPU: ``stock`` (diffusers eager: the reference), ``peer`` (bench/setups.py's stock+compile-graphs,
  diffusers' speed recipe), ``ours`` (``patch(pipe)``: CUDA graphs), ``ours+compile``
  (``patch(pipe, compile=True)``).
- ``ulysses-peer`` (transformers diffusers has a context-parallel plan for: FLUX): diffusers' documented
  way, ``transformer.set_attention_backend("_native_cudnn")`` and
  ``enable_parallelism(config=ContextParallelConfig(ulysses_degree=W))``, with the transformer's forward
  torch.compiled (mode "default": the collectives stay out of inductor's CUDA graphs, as they stay out
  of ours) and the VAE's decode (the same mode, channels_last), which the one-GPU recipe compiles too.
- ``ulysses-ours``: ``sd_kernels.enable_context_parallel(pipe)`` (Ulysses degree W: for FLUX diffusers'
  ``enable_parallelism`` with its plan, no backend set; for SD3 and PixArt-Σ with sd_kernels' plans) and
  ``patch(pipe)``: the local attention is sd_kernels' (FLUX: inside diffusers' Ulysses template,
  patches/context_parallel.py; SD3, PixArt-Σ: sd_kernels' exchange, patches/context_parallel_plans.py);
  the transformer runs eagerly (its collectives are not captured), the VAE and text encoders too. SD3
  and PixArt-Σ have no ``ulysses-peer``: diffusers' processors for them call SDPA on the tokens a
  process holds and have no context-parallel path, so diffusers' own attention backends cannot run
  under any plan there.
- ``ulysses-ours+compile``: the same with the patched transformer's forward torch.compiled (mode "default").
- ``ulysses-ours+graphs``: ``ulysses-ours`` with ``SD_KERNELS_GRAPH_COLLECTIVES=1``: the transformer's
  calls captured in CUDA graphs with their collectives inside (experimental, patches/cuda_graph.py).
- ``ring-peer``, ``ring-ours``, ``ring-ours+graphs`` (FLUX): the same three with
  ``ContextParallelConfig(ring_degree=W)`` (``enable_context_parallel(pipe, exchange="ring")``): diffusers'
  ring template over its cuDNN backend; ours, one all-gather of the keys and values and one attention
  call (patches/context_parallel.py). diffusers' ``enable_parallelism`` cannot be undone, so a launch runs
  one exchange's variants: the ring ones only when ``--variants`` names them (bench/multi_gpu.sh runs
  them in a launch of their own), and rows of a second exchange in one launch say they were skipped.
- ``cfg-ours`` (W = 2, pipelines with guidance: SDXL, SD3, PixArt-Σ): ``patch(pipe, parallel="cfg")``,
  the guidance batch's halves on the two GPUs, CUDA graphs; ``cfg-ours+compile``: with ``compile=True``.
- ``cfg-ours+split-decode``, ``ulysses-ours+graphs+split-decode``, ``ring-ours+graphs+split-decode``: the
  same with ``sd_kernels.enable_split_decode(pipe)`` after the patch: each process decodes 1/W of the
  image's rows (patches/split_decode.py) instead of the whole image.
- ``ring-ours+graphs+split-modulation`` (FLUX), and with ``+split-decode`` too: FLUX's adaLN modulations
  split over the processes for the row (``enable_split_modulation``, undone after it;
  patches/modulation_split.py).

One row of ``DIR/parallel.csv`` per (model, W, variant), appended by the first process after each
model: ``warmup_s`` (set-up and the first call), ``e2e_ms`` (median of ``--calls`` pipeline calls, each
from a barrier to the last process's end), ``vs_one_gpu`` (over ``ours`` on one GPU), ``vs_peer`` (over
the one-GPU ``peer``, or at W > 1 over ``ulysses-peer`` where it ran), ``latent_rel_err`` and ``psnr_db``
against stock on one GPU (the targets: PSNR ≥ 40 dB, latents within 1e-2), ``patched`` (the patch record's
counts, and ``ring_exchange=copy-engine`` where the ring's keys went over the copy engines rather than
NCCL: patches/peer_gather.py; ``split_modulation`` where the row's calls took FLUX's split modulations:
patches/modulation_split.py),
``status`` (ok, or why the row did not run), device and versions.

``--profile``: after a variant's timed calls, one more call under torch.profiler on the first process:
``DIR/profile-<model>-W<W>-<variant>.json`` holds its device time per kernel category
(bench/unet_kernels.py's categories; the collectives are NCCL's kernels, their time including the wait
for the other processes; the ring's copy-engine exchange is its peer copies and barriers), the GPU's
busy time (the union of kernel and copy intervals), the exchanges' time with no other kernel running
beside them (``collectives_exposed_ms``), the idle time by the gaps' size, the largest gaps and the
largest kernels.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import statistics
import sys
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

from bench import common

PROMPT = "a photograph of an astronaut riding a horse"
MODELS = ("flux-dev", "sd3-medium", "pixart-sigma", "sdxl")
ONE_GPU = ("stock", "peer", "ours", "ours+compile")
ULYSSES = ("ulysses-peer", "ulysses-ours", "ulysses-ours+compile", "ulysses-ours+graphs")
RING = ("ring-peer", "ring-ours", "ring-ours+graphs")  # under diffusers' plans only (FLUX)
CFG = ("cfg-ours", "cfg-ours+compile")
# Modifiers a variant's name may end with, in this order: FLUX's modulations split over the processes
# (enable_split_modulation, undone after the row), the VAE decode split (enable_split_decode after the patch)
SPLIT_MODULATION, SPLIT_DECODE = "+split-modulation", "+split-decode"
SPLIT = ("cfg-ours", "ulysses-ours+graphs", "ring-ours+graphs")  # the variants measured with the split decode too
CP_PLANS = ("flux-dev",)  # diffusers 0.42.1 ships a context-parallel plan for these transformers
OUR_CP_PLANS = ("sd3-medium", "pixart-sigma")  # sd_kernels' plans (patches/context_parallel_plans.py): no peer
NO_GUIDANCE = ("flux-dev",)  # guidance-distilled: a batch of one image, nothing for CFG to split
COLUMNS = ["model", "size", "steps", "dtype", "world", "variant", "status", "warmup_s", "e2e_ms", "vs_one_gpu",
           "vs_peer", "latent_rel_err", "psnr_db", "patched", "device", "torch", "triton", "diffusers", "date"]


def plan(model: str, world: int) -> tuple[str, ...]:
    """The variants that apply to ``model`` on ``world`` GPUs."""
    if world == 1:
        return ONE_GPU
    out = ULYSSES + RING if model in CP_PLANS else ULYSSES[1:] if model in OUR_CP_PLANS else ()
    if model not in NO_GUIDANCE and 2 % world == 0:  # one image: a guidance batch of 2
        out += CFG
    out += tuple(v + SPLIT_DECODE for v in out if v in SPLIT)
    if model in CP_PLANS:  # FLUX: its ring rows with the modulations split, with and without the split decode
        out += tuple("ring-ours+graphs" + SPLIT_MODULATION + tail for tail in ("", SPLIT_DECODE))
    return out


def modifiers(variant: str) -> tuple[str, set[str]]:
    """(the variant without its modifiers, the modifiers it ends with)."""
    found = set()
    for mod in (SPLIT_DECODE, SPLIT_MODULATION):
        if variant.endswith(mod):
            variant, _ = variant.removesuffix(mod), found.add(mod)
    return variant, found


def _dtype(model: str) -> torch.dtype:
    return torch.bfloat16 if model.startswith("flux") else torch.float16


def _extra(pipe) -> dict:
    from bench.dit import _extra_kwargs

    return _extra_kwargs(pipe.__call__)


@contextlib.contextmanager
def _compiled_forward(model: torch.nn.Module) -> Iterator[None]:
    """``model.forward`` (as it stands: diffusers' hooks, our patch) torch.compiled in mode "default", graph
    breaks allowed, its layout kept."""
    from bench.setups import compiled_methods

    try:
        with compiled_methods([(model, "forward")], "default", fullgraph=False, channels_last=False):
            yield
    finally:
        torch._dynamo.reset()


@contextlib.contextmanager
def set_up(pipe, variant: str, world: int) -> Iterator[str]:
    """``pipe`` set up as ``variant``; yields what the patch replaced (for the row)."""
    import sd_kernels
    from bench.setups import PEER, VARIANTS, applied

    variant, mods = modifiers(variant)
    if variant in ("stock", "peer"):
        with applied(pipe, VARIANTS["stock" if variant == "stock" else PEER]) as info:
            yield info["patched"]
        return
    exchange = variant.split("-")[0]
    with contextlib.ExitStack() as stack:
        transformer = getattr(pipe, "transformer", None)
        if variant.endswith("-peer"):
            from diffusers import ContextParallelConfig
            from diffusers.models.attention_dispatch import _AttentionBackendRegistry as registry

            # set_attention_backend also makes the backend the process's (our processors then step
            # aside): both are put back after the row
            active = registry._active_backend
            transformer.set_attention_backend("_native_cudnn")
            stack.callback(registry.set_active_backend, active)
            stack.callback(transformer.reset_attention_backend)
            if transformer._parallel_config is None:
                transformer.enable_parallelism(config=ContextParallelConfig(**{f"{exchange}_degree": world}))
        elif exchange in ("ulysses", "ring"):
            if transformer._parallel_config is None:  # FLUX: diffusers' plan; SD3, PixArt-Σ: ours
                sd_kernels.enable_context_parallel(pipe, world, exchange=exchange)
            if SPLIT_MODULATION in mods:
                from sd_kernels.patches import modulation_split
                from sd_kernels.patches.context_parallel_plans import enable_split_modulation

                stack.callback(modulation_split.disable, enable_split_modulation(transformer))
        if variant.endswith("+graphs"):
            from sd_kernels.patches import cuda_graph

            os.environ[cuda_graph.COLLECTIVES_ENV] = "1"
            stack.callback(os.environ.pop, cuda_graph.COLLECTIVES_ENV)
        record = None
        if not variant.endswith("-peer"):
            parallel = "cfg" if variant.startswith("cfg") else None
            compile = variant == "ours+compile" or variant == "cfg-ours+compile"
            record = sd_kernels.patch(pipe, parallel=parallel, compile=compile,
                                      cuda_graph=True if compile else "auto")
            stack.callback(sd_kernels.unpatch, pipe)
            if SPLIT_DECODE in mods:
                sd_kernels.enable_split_decode(pipe)
        if variant.endswith("-peer") or variant == "ulysses-ours+compile":
            stack.enter_context(_compiled_forward(transformer))
        if variant.endswith("-peer"):  # its VAE decode compiled too, as the one-GPU recipe (PEER) compiles it
            from bench.setups import compiled_methods

            stack.enter_context(compiled_methods([(pipe.vae, "decode")], "default"))
        yield "" if record is None else " ".join(f"{k}={n}" for k, n in sorted(record.counts.items()))


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed_ms(call) -> float:
    """One call from a barrier to the end of the slowest process (the maximum over processes: gloo's)."""
    dist.barrier()
    _sync()
    t = time.perf_counter()
    call()
    _sync()
    dist.barrier()
    ms = torch.tensor((time.perf_counter() - t) * 1e3)
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    return ms.item()


def profiled(call, path: pathlib.Path) -> None:
    """One ``call()`` under torch.profiler; on the first process, its device time per kernel category and
    its largest kernels written to ``path``."""
    from torch.profiler import ProfilerActivity, profile

    from bench.timeline import gaps
    from bench.unet_kernels import EXCHANGE, categories_us, category, kernel_times

    _sync()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        call()
        _sync()
        wall = time.perf_counter() - start
    if dist.get_rank() != 0:
        return
    kernels, counts, spans = kernel_times(prof)
    busy, idle = gaps(spans)
    compute_busy, _ = gaps([s for s in spans if category(s[2]) not in EXCHANGE])
    report = {"wall_ms": round(wall * 1e3, 2), "device_ms": round(sum(kernels.values()) / 1e3, 2),
              # the union of kernel intervals: with collectives beside compute, less than device_ms
              "busy_ms": round(busy / 1e3, 2),
              "collectives_exposed_ms": round((busy - compute_busy) / 1e3, 2),
              # where the GPU sat idle: the gaps' total by size (launch gaps inside the graphs are the small
              # ones; the pipeline's host work between its calls the large)
              "idle_ms_by_gap": {f"{lo}-{hi} us" if hi else f">{lo} us": round(sum(
                  g["us"] for g in idle if lo <= g["us"] < (hi or float("inf"))) / 1e3, 2)
                  for lo, hi in ((0, 10), (10, 100), (100, 1000), (1000, None))},
              "largest_gaps": idle[:12],
              "categories_ms": {c: round(us / 1e3, 2) for c, us in categories_us(kernels).most_common()},
              "top_kernels": [{"name": n[:160], "ms": round(us / 1e3, 2), "calls": counts[n]}
                              for n, us in kernels.most_common(25)]}
    path.write_text(json.dumps(report, indent=1))


def measure(pipe, variant: str, size: int, steps: int, calls: int, world: int,
            profile_to: pathlib.Path | None = None) -> dict:
    extra = _extra(pipe)

    def call(output_type: str):
        gen = torch.Generator().manual_seed(0)
        return pipe(PROMPT, num_inference_steps=steps, height=size, width=size, generator=gen,
                    output_type=output_type, return_dict=False, **extra)[0]

    from sd_kernels.patches import modulation_split, peer_gather

    splits_before = modulation_split.computed()
    start = time.perf_counter()
    with torch.no_grad(), set_up(pipe, variant, world) as patched:
        image = call("pt")
        _sync()
        warmup = time.perf_counter() - start
        e2e = statistics.median(_timed_ms(lambda: call("pt")) for _ in range(calls))
        latent = call("latent")
        if profile_to is not None:
            profiled(lambda: call("pt"), profile_to)
    if peer_gather.in_use():  # the ring's keys and values went over the copy engines, not NCCL
        patched = f"{patched} ring_exchange=copy-engine".strip()
    if modulation_split.computed() > splits_before:  # this row's calls took the split modulations
        patched = f"{patched} split_modulation".strip()
    return {"status": "ok", "warmup_s": round(warmup, 1), "e2e_ms": round(e2e, 2), "patched": patched,
            "image": image.float().cpu(), "latent": latent.float().cpu()}


def _fidelity(row: dict, ref: dict | None) -> None:
    from sd_kernels.testing import psnr

    image, latent = row.pop("image", None), row.pop("latent", None)
    if ref is None or image is None:
        return
    row["latent_rel_err"] = f"{((latent - ref['latent']).norm() / ref['latent'].norm()).item():.2e}"
    row["psnr_db"] = round(psnr(image, ref["image"]), 2)


def _ratios(rows: list[dict], one_gpu: dict) -> None:
    """vs_one_gpu over ``ours`` on one GPU; vs_peer over the row's exchange's peer where it ran (ulysses-peer,
    ring-peer), else over the one-GPU peer."""
    peers = {r["variant"].split("-")[0]: r["e2e_ms"] for r in rows if r["variant"].endswith("-peer")
             and r["status"] == "ok"}
    for r in rows:
        if r["status"] != "ok":
            continue
        if one_gpu.get("ours"):
            r["vs_one_gpu"] = round(r["e2e_ms"] / one_gpu["ours"], 3)
        peer = peers.get(r["variant"].split("-")[0]) or one_gpu.get("peer")
        if peer:
            r["vs_peer"] = round(r["e2e_ms"] / peer, 3)


def reference_path(out: pathlib.Path, model: str, size: int, steps: int) -> pathlib.Path:
    return out / f"reference-{model}-{size}-{steps}.pt"


def one_gpu_times(ref: dict, rows: list[dict]) -> dict[str, float]:
    """The one-GPU times after a run on one GPU: this run's measured rows over those of earlier runs
    (one run may measure some variants, the next the others)."""
    return {**ref.get("one_gpu", {}), **{r["variant"]: r["e2e_ms"] for r in rows if r["status"] == "ok"}}


def run_model(args, model: str, world: int, rank: int, stamp: dict, log) -> list[dict]:
    from sd_kernels.models import build_pipeline

    dtype = _dtype(model)
    ref_path = reference_path(args.out, model, args.size, args.steps)
    ref = torch.load(ref_path) if ref_path.exists() else {}
    if "image" not in ref:
        log(f"{model}: no one-GPU stock image in {ref_path.name} yet (run with --nproc_per_node 1 and the stock "
            "variant first): no fidelity columns")
    pipe = build_pipeline(model, f"cuda:{torch.cuda.current_device()}", dtype)
    pipe.set_progress_bar_config(disable=True)
    base = {"model": model, "size": args.size, "steps": args.steps, "dtype": str(dtype).removeprefix("torch."),
            "world": world, **stamp}
    rows = []
    wanted = [v for v in plan(model, world) if (v in args.variants if args.variants else not v.startswith("ring-"))]
    # The context-parallel variants turn it on for good: after every other variant, the peer first; a
    # process runs one exchange's (Ulysses' before ring's: rows of the second say they were skipped).
    def order(v: str) -> tuple:
        exchange = v.split("-")[0]
        return exchange in ("ulysses", "ring"), exchange == "ring", not v.endswith("-peer")

    first_exchange = None
    for variant in sorted(wanted, key=order):
        row = {**base, "variant": variant}
        exchange = variant.split("-")[0]
        if exchange in ("ulysses", "ring"):
            first_exchange = first_exchange or exchange
            if exchange != first_exchange:
                row["status"] = (f"skipped: this launch put the transformer under {first_exchange} (enable_parallelism "
                                 f"cannot be undone); run --variants {variant} in a launch of its own")
                rows.append(row)
                log(f"{model} W={world} {variant}: {row['status']}")
                continue
        try:
            path = args.out / f"profile-{model}-W{world}-{variant}.json" if args.profile else None
            row.update(measure(pipe, variant, args.size, args.steps, args.calls, world, path))
        except Exception as exc:  # a variant that cannot run here is a row that says why
            row["status"] = f"failed: {type(exc).__name__}: {str(exc)[:300]}"
        if world == 1 and variant == "stock" and "image" in row:
            ref.update(image=row["image"], latent=row["latent"])
        _fidelity(row, ref if "image" in ref else None)
        rows.append(row)
        log(f"{model} W={world} {variant}: {row['status']} e2e {row.get('e2e_ms')} ms, "
            f"PSNR {row.get('psnr_db')} dB, latents {row.get('latent_rel_err')}")
        torch.cuda.empty_cache()
    if world == 1:
        ref["one_gpu"] = one_gpu_times(ref, rows)
        if rank == 0:
            torch.save(ref, ref_path)
    _ratios(rows, ref.get("one_gpu", {}))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=pathlib.Path, required=True)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=28)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--variants", default="", help="a comma-separated subset of the planned variants (default: all)")
    ap.add_argument("--profile", action="store_true", help="profile one more call of each variant (module docstring)")
    args = ap.parse_args(argv)
    args.variants = tuple(v for v in args.variants.split(",") if v)
    if not torch.cuda.is_available() or "RANK" not in os.environ:
        print("bench.parallel runs on CUDA GPUs under torchrun (torchrun --nproc_per_node W -m bench.parallel ...)",
              file=sys.stderr)
        return 2
    from bench.common import environment

    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("cpu:gloo,cuda:nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    env = environment()
    stamp = {k: env.get(k, "") for k in ("device", "torch", "triton", "diffusers", "date")}
    t0 = time.perf_counter()

    def log(text: str) -> None:
        if rank == 0:
            print(f"[{time.perf_counter() - t0:7.1f} s] {text}", flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "parallel.csv"
    for model in args.models.split(","):
        rows = run_model(args, model, world, rank, stamp, log)
        if rank == 0:
            common.append_csv(path, rows, COLUMNS)
    from sd_kernels.patches import peer_gather

    peer_gather.release_all()  # symmetric buffers made over the process group, dropped before it ends
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
