"""The streamed VAE decode (patches/stream_decode.py) against the untiled one, on the GPU.

    python -m bench.stream_decode --out DIR [--model sd15] [--profiles s23-ultra,iphone-14-pro-max,mobile-small]

Rows, one process, fp16, batch 1 at the model's resolution: stock diffusers' decode, the patched
untiled decode (``patch(vae, cuda_graph=False)`` under the GPU's own profile: the time the target
"≤ 3× untiled" refers to; with ``--graph`` also replayed from a CUDA graph, the fair reference for
the streamed replays), then per mobile profile the streamed decode its patch installs (a profile that
may keep activations in 8 bits, ``stream_pack8``, also without: its exact decode). Per row:
median ms over ``--repeats`` calls (CUDA events, eager), peak intermediate MiB (peak allocated during
the call above what was allocated before it: weights and the latent excluded), PSNR of the image
against the patched untiled one (images in [0, 1]), the plan. ``--graph`` also times each streamed
decode replayed from a CUDA graph (the host's launches taken out; the graph's memory pool, what it
keeps reserved, is reported as ``pool_mb``). Then each upsampler of the decoder on its whole input,
as diffusers runs it (nearest-2× + 3×3 conv: ``reference.upsample_conv2d``, also under a patch that
made the module polyphase) and as the streamed decode does (``_polyphase``, one band), with the
largest difference between the two (``upsampler-ops.csv``). Writes
DIR/stream-decode.csv and prints the tables.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import functools
import json
import pathlib
import re
import statistics
import sys
import time

import torch

from bench import common
from sd_kernels import reference

MOBILE = ("s23-ultra", "iphone-14-pro-max", "mobile-small")
COLUMNS = ["variant", "ms", "vs_untiled", "peak_intermediate_mb", "pool_mb", "psnr_db", "plan"]


def _time(fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _peak(fn) -> tuple[torch.Tensor, float]:
    """fn's output and its peak allocated MiB above what was allocated before it, on a second call
    (the first compiles and tunes kernels, whose own allocations are not the decode's)."""
    from sd_kernels.runtime import memory

    fn()
    peak, out = memory.peak_intermediate_bytes(fn, memory.CudaMemory())
    return out, peak / 2**20


def _graphed(fn, repeats: int) -> tuple[float, float]:
    """(median ms of a replay, MiB the graph's pool reserves)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    reserved = torch.cuda.memory_reserved()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    pool = (torch.cuda.memory_reserved() - reserved) / 2**20
    ms = _time(graph.replay, repeats)
    del graph
    return ms, pool


def _profile(vae, z: torch.Tensor, path: pathlib.Path) -> None:
    """Each segment's peak allocated (above the decode's start) beside the plan's model, then the
    profiler's table of one decode by the plan, the budget guard left out."""
    from sd_kernels.patches.stream_decode import plans_of, stream_decode, units

    from sd_kernels.runtime import memory

    us = units(vae.decoder)
    (plan,) = plans_of(vae.decoder).values()
    lines = []
    latent = vae.post_quant_conv(z)
    stats = memory.CudaMemory()
    stats.reset_peak()
    base = stats.allocated()

    def segment(seg) -> None:
        lines.append(f"{us[seg.start].name}..{us[seg.stop - 1].name} in {seg.bands} bands: peak "
                     f"{(stats.peak() - base) / 2**20:.1f} MiB")
        stats.reset_peak()  # synchronizes first

    stream_decode(vae.decoder, us, plan, latent, segment)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        stream_decode(vae.decoder, us, plan, latent)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    cuda = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(plan.format(us) + "\n" + "\n".join(lines) + "\n\n" + table + "\n\n" + cuda + "\n")
    print("\n".join(lines), flush=True)


def _upsamplers(vae, z: torch.Tensor, repeats: int) -> list[dict]:
    """Each upsampler on its whole input (taken from one decode): diffusers' module against the
    streamed decode's polyphase band, ms each and the largest absolute difference."""
    from sd_kernels.patches import stream_decode as sd

    inputs = {}
    us = [u for u in sd.units(vae.decoder) if u.kind == "upsample"]
    hooks = [u.module.register_forward_pre_hook(lambda m, a, name=u.name: inputs.setdefault(name, a[0]))
             for u in us]
    try:
        vae.decode(z)
    finally:
        for h in hooks:
            h.remove()
    out = []
    for u in us:
        x = inputs[u.name]
        h = x.shape[2]
        conv = u.module.conv  # diffusers' ops, whatever class the upsampler has now (the upsample family's)
        stock = functools.partial(reference.upsample_conv2d, x, conv.weight, conv.bias)
        poly = functools.partial(sd._upsample_band, u, x, 0, h, 0, 2 * h, h, None)
        a, b = stock(), poly()
        out.append({"upsampler": u.name, "input": "x".join(map(str, x.shape)),
                    "interpolate_conv_ms": _time(stock, repeats), "polyphase_ms": _time(poly, repeats),
                    "max_abs_diff": (a.float() - b.float()).abs().max().item(),
                    "max_abs_out": a.float().abs().max().item()})
    return out


def _variants(names: list[str]) -> list[tuple[str, object]]:
    """(row name, profile) per profile; one that may keep activations in 8 bits (``stream_pack8``)
    also runs without, so that its exact decode is measured beside it."""
    from sd_kernels import profiles

    out = []
    for name in names:
        prof = profiles.get_profile(name)
        out.append((name + (" (8-bit kept activations allowed)" if prof.stream_pack8 else ""), prof))
        if prof.stream_pack8:
            out.append((f"{name} (dtype only)", dataclasses.replace(prof, stream_pack8=False)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=pathlib.Path, required=True)
    ap.add_argument("--model", default="sd15")
    ap.add_argument("--profiles", default=",".join(MOBILE))
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--graph", action="store_true", help="also replay each streamed decode from a CUDA graph")
    ap.add_argument("--profile", action="store_true",
                    help="per profile: each segment's measured peak beside the plan's model, and the "
                         "torch.profiler table of one streamed decode (DIR/profile-NAME.txt)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.stream_decode needs a CUDA GPU", file=sys.stderr)
        return 2
    from sd_kernels.patches import patch, patch_record, unpatch
    from sd_kernels.patches.stream_decode import plans_of, stream_decode, units

    from sd_kernels import models, profiles
    from sd_kernels.testing import psnr

    started = time.perf_counter()
    vae = models.build_model(args.model, "vae", device="cuda", dtype=torch.float16)
    side = models.image_side(args.model) // 2 ** (len(vae.config.block_out_channels) - 1)
    z = torch.randn(1, vae.config.latent_channels, side, side, device="cuda", dtype=torch.float16,
                    generator=torch.Generator("cuda").manual_seed(0))
    env = {**common.environment(), "model": args.model, "dtype": "float16", "latent": f"{side}x{side}"}
    print(json.dumps(env), flush=True)
    rows: list[dict] = []

    def decode():
        return vae.decode(z, return_dict=False)[0]

    def img(x):
        return (x.float() / 2 + 0.5).clamp(0, 1)

    refs: dict[str, float] = {}  # the untiled decode's ms, eager and replayed: what each row is set against

    def row(variant: str, out: torch.Tensor, peak: float, ms: float, plan: str = "", pool: float = float("nan")):
        ref = refs.get("graph" if "CUDA graph" in variant else "eager")
        rows.append({"variant": variant, "ms": ms, "vs_untiled": ms / ref if ref else float("nan"),
                     "peak_intermediate_mb": peak, "pool_mb": pool,
                     "psnr_db": psnr(img(out), img(untiled)) if untiled is not None else float("nan"), "plan": plan})
        print(f"[{time.perf_counter() - started:6.1f} s] {variant}: {ms:.2f} ms, peak {peak:.1f} MiB, "
              f"{rows[-1]['psnr_db']:.1f} dB {plan}", flush=True)

    untiled = None
    with torch.inference_mode():
        stock, peak = _peak(decode)
        row("stock eager", stock, peak, _time(decode, args.repeats))
        patch(vae, cuda_graph=False)
        untiled, peak = _peak(decode)
        row(f"patched untiled ({patch_record(vae).profile_spec.name} profile)", untiled, peak,
            _time(decode, args.repeats))
        refs["eager"] = rows[-1]["ms"]
        if args.graph:  # the decoder alone, as the streamed rows below
            ms, pool = _graphed(functools.partial(vae.decoder, vae.post_quant_conv(z)), args.repeats)
            row("patched untiled, CUDA graph", untiled, peak, ms, "", pool)
            refs["graph"] = ms
        upsamplers = _upsamplers(vae, z, args.repeats)
        unpatch(vae)
        for name, prof in _variants([n for n in args.profiles.split(",") if n]):
            patch(vae, profile=prof, cuda_graph=False)
            try:
                out, peak = _peak(decode)
                plan = "; ".join(p.format(units(vae.decoder)) for p in plans_of(vae.decoder).values())
                row(f"streamed under {name}", out, peak, _time(decode, args.repeats), plan)
                if args.profile:
                    _profile(vae, z, args.out / f"profile-{re.sub(r'[^A-Za-z0-9]+', '-', name).strip('-')}.txt")
                if args.graph:  # the decoder alone (the budget guard reads memory statistics: not capturable)
                    (p,) = plans_of(vae.decoder).values()
                    latent = vae.post_quant_conv(z)
                    run = functools.partial(stream_decode, vae.decoder, units(vae.decoder), p, latent)
                    ms, pool = _graphed(run, args.repeats)
                    row(f"streamed under {name}, CUDA graph", out, peak, ms, "", pool)
            finally:
                unpatch(vae)
                profiles.set_profile(None)
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "stream-decode.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[*COLUMNS, *env])
        w.writeheader()
        w.writerows({**r, **env} for r in rows)
    with open(args.out / "upsampler-ops.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[*upsamplers[0], *env])
        w.writeheader()
        w.writerows({**r, **env} for r in upsamplers)
    print(common.format_table(rows, COLUMNS))
    print(common.format_table(upsamplers, list(upsamplers[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
