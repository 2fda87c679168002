"""End-to-end timings on the GPU: one UNet step and one VAE decode, stock vs patched.

    python -m bench.e2e --out DIR [--model sd15] [--compile]

Variants per component: stock eager, stock in a CUDA graph, patched eager, patched in a CUDA graph,
and the patch restricted to one op family at a time in a CUDA graph (the ablation), optionally
torch.compile of the stock model. Times are steady-state: ms per call over back-to-back calls.
Every row carries that time, peak memory over the weights, and the relative error of the output
against stock in the same dtype. Random weights from the shipped configs.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from bench import common


def cuda_graphed(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """Capture ``fn`` (static inputs) in a CUDA graph after a warm-up on a side stream."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return lambda: (graph.replay(), out)[1]


def steady_ms(fn: Callable[[], Any], calls: int = 20, repeats: int = 3) -> float:
    """Milliseconds per call of ``calls`` back-to-back calls (as a denoising loop issues them), CUDA
    events around the whole run, median of ``repeats`` runs, after 3 warm-up calls. Unlike timing
    one call at a time, the host may run ahead of the GPU here: an eager model bound by Python costs
    its host time, one bound by the GPU its GPU time."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return sorted(times)[len(times) // 2]


def peak_mb(fn: Callable[[], Any]) -> float:
    """Peak memory allocated during one call of ``fn`` above what was allocated before it, in MB."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def unet_call(pipe, batch: int, dtype: torch.dtype) -> Callable[[], torch.Tensor]:
    unet = pipe.unet
    side = unet.config.sample_size
    g = torch.Generator(device="cuda").manual_seed(0)
    latent = torch.randn(batch, unet.config.in_channels, side, side, device="cuda", dtype=dtype, generator=g)
    ctx_dim = unet.config.cross_attention_dim
    ctx = torch.randn(batch, 77, ctx_dim, device="cuda", dtype=dtype, generator=g)
    t = torch.tensor(500, device="cuda")
    kwargs: dict[str, Any] = {}
    if unet.config.addition_embed_type == "text_time":
        pooled = unet.config.projection_class_embeddings_input_dim - 6 * unet.config.addition_time_embed_dim
        kwargs["added_cond_kwargs"] = {
            "text_embeds": torch.randn(batch, pooled, device="cuda", dtype=dtype, generator=g),
            "time_ids": torch.tensor([[side * 8, side * 8, 0, 0, side * 8, side * 8]] * batch, device="cuda",
                                     dtype=dtype),
        }
    return lambda: unet(latent, t, encoder_hidden_states=ctx, return_dict=False, **kwargs)[0]


def vae_call(pipe, dtype: torch.dtype) -> Callable[[], torch.Tensor]:
    side = pipe.unet.config.sample_size
    g = torch.Generator(device="cuda").manual_seed(1)
    latent = torch.randn(1, pipe.vae.config.latent_channels, side, side, device="cuda", dtype=dtype, generator=g)
    return lambda: pipe.vae.decode(latent / pipe.vae.config.scaling_factor, return_dict=False)[0]


def measure_variants(pipe, component: str, call: Callable[[], torch.Tensor], families: list[str],
                     compile_stock: bool) -> list[dict[str, Any]]:
    import sd_kernels

    rows = []
    stock_out = call().float()

    def row(variant: str, fn: Callable[[], torch.Tensor], warmup_s: float) -> None:
        out = fn().float()
        err = ((out - stock_out).norm() / stock_out.norm()).item()
        ms = steady_ms(fn)
        rows.append({"component": component, "variant": variant, "ms": round(ms, 3),
                     "peak_MB": round(peak_mb(fn), 1), "rel_err_vs_stock": f"{err:.3e}",
                     "warmup_s": round(warmup_s, 1)})
        print(f"  {component:<5} {variant:<26} {ms:8.3f} ms  peak {rows[-1]['peak_MB']:8.1f} MB  "
              f"err {err:.2e}  warm-up {warmup_s:.1f} s", flush=True)

    def timed_build(build: Callable[[], Callable[[], torch.Tensor]]) -> tuple[Callable, float]:
        t = time.perf_counter()
        fn = build()
        fn()
        torch.cuda.synchronize()
        return fn, time.perf_counter() - t

    row("stock eager", call, 0.0)
    row("stock cuda-graph", *timed_build(lambda: cuda_graphed(call)))
    if compile_stock:
        model = pipe.unet if component == "unet" else pipe.vae
        original_forward = model.forward
        model.forward = torch.compile(original_forward)
        try:
            row("stock torch.compile", *timed_build(lambda: call))
        finally:
            model.forward = original_forward
    ignore = ("vae",) if component == "unet" else ("unet",)
    with sd_kernels.patched(pipe, ignore=ignore) as record:
        print("  " + record.summary())
        row("patched eager", *timed_build(lambda: call))
        row("patched cuda-graph", *timed_build(lambda: cuda_graphed(call)))
    for fam in families:  # in a graph: eager timings of a host-bound model would hide the kernels
        with sd_kernels.patched(pipe, ops=[fam], ignore=ignore):
            row(f"graph, {fam} only", *timed_build(lambda: cuda_graphed(call)))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=pathlib.Path, required=True)
    ap.add_argument("--model", default="sd15")
    ap.add_argument("--batch", type=int, default=2, help="UNet batch (2 = one prompt with guidance)")
    ap.add_argument("--compile", action="store_true", help="also torch.compile the stock models (slow)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.e2e needs a CUDA GPU", file=sys.stderr)
        return 2
    from sd_kernels.patches import PATCHERS

    from sd_kernels.models import build_pipeline

    dtype = torch.float16
    pipe = build_pipeline(args.model, device="cuda", dtype=dtype)
    weights_mb = {p: sum(t.numel() * t.element_size() for t in getattr(pipe, p).parameters()) / 2**20
                  for p in ("unet", "vae")}
    families = sorted(PATCHERS)
    env = {**common.environment(), "model": args.model, "batch": args.batch, "dtype": "float16",
           "weights_MB": json.dumps({k: round(v, 1) for k, v in weights_mb.items()})}
    print(json.dumps(env))
    rows = []
    with torch.inference_mode(), contextlib.suppress(KeyboardInterrupt):
        rows += measure_variants(pipe, "unet", unet_call(pipe, args.batch, dtype), families, args.compile)
        rows += measure_variants(pipe, "vae", vae_call(pipe, dtype), families, args.compile)
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "e2e.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[*rows[0], *env])
        w.writeheader()
        w.writerows({**r, **env} for r in rows)
    print(common.format_table(rows, list(rows[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
