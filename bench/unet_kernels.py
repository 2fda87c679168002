"""Where one UNet step's device time goes, kernel by kernel: ``python -m bench.unet_kernels --out DIR``.

    python -m bench.unet_kernels --out DIR [--model sd15@512] [--setups stock,patched,patched-no-winograd]

For each setup the UNet (random weights, fp16, batch 2 = one prompt with CFG) is built, set up
(``stock``: diffusers' own modules, channels_last like the recipe; ``peer``: the compile recipe of
bench.e2e, diffusers' speed recipe — channels_last, ``fuse_qkv_projections()``, ``torch.compile(fullgraph=True)`` —
whose CUDA graph the bench captures itself (the kernels mode="reduce-overhead" runs, without its
cudagraph trees' input copies: captured alike, the two sides compare kernel for kernel);
``peer-max-autotune``: the same compiled with mode="max-autotune-no-cudagraphs" (the recipe's
autotuned kernels, graphed the same way); ``patched``: ``patch(unet, cuda_graph="unet")``;
``patched-no-winograd``: the same without the winograd family; ``patched-compile``: with
``compile=True``; ``patched-compile-max-autotune``: ``compile="max-autotune"``; a patched setup ending
in ``-fused-qkv`` fuses the QKV projections before the patch, like the recipe; one with ``-fp8`` in its name
patches with ``precision="fp8"``, the opt-in FP8 tier), one call is captured in a
CUDA graph (the patch's own graph for patched setups), and one replay is profiled. ``warmup_s`` is
the time from the set-up to a replayable graph (compilation, autotuning, capture).
Kernels are grouped by what they compute (name patterns, ``CATEGORIES``); ``DIR/unet_kernels.json``
holds per setup the call's time and the bare graph replay's, per-category and per-kernel totals (every kernel),
the idle time between kernels by the category of the kernel after it, by the pair of categories and of
kernel names on either side (and the largest gaps), and
for patched setups how many conv calls were routed to Winograd in which layout.
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import re
import sys
import time

import torch

# First match wins; names are CUDA kernel names (cuDNN, cuBLAS/CUTLASS, Triton, ATen).
CATEGORIES = (
    # inductor's kernels first: their names list the ops they fuse ("native_group_norm", "convolution")
    ("gemm/conv (inductor template)", r"^triton_tem"),
    ("inductor fused", r"^triton_(poi|red|per)"),
    # ours: Triton kernels named after the function (a leading underscore), before the stock patterns
    # their names would match ("norm", "attention", "conv"); tests/test_bench.py checks every kernel
    ("winograd", r"^_(input_transform|batched_gemm|output_transform|fused_gemm_output)"),
    ("attention (ours)", r"^_(flash|attn|attention_fp8|softmax_matmul|row_stats|partial|merge)"),
    ("group_norm (ours)", r"^_(group_norm|group_stats|given_norm|pixel_(stats|merge|norm))"),
    ("layer_norm (ours)", r"^_layer_norm_kernel"),
    ("rope (ours)", r"^_qk_norm_rope_(stats_)?kernel"),
    ("fp8 gemm (ours)", r"^_fp8_gemm_(tma_)?kernel|^_fp8_geglu_tma_kernel|^_(match|serve)_kernel"),
    ("fp8 quantize (ours)", r"^_(quantize|kv_stats|kv_quant|sample_amax|sample_quantize)_kernel"),
    ("fp8 conv (ours)", r"^_conv3x3_fp8_kernel"),
    ("conv (ours)", r"^_conv_kernel"),
    ("residual / layout (ours)", r"^_(bias_residual|gated_add|pack8|unpack8)_kernel"),
    ("geglu/gelu (ours)", r"^_(linear_geglu|elementwise)_kernel"),
    ("collectives (NCCL)", r"^nccl"),
    # the ring exchange on the copy engines (patches/peer_gather.py): peer copies and the symmetric-memory
    # barriers that order them
    ("exchange (copy engine)", r"^Memcpy PtoP|barrier_kernel"),
    ("attention (stock)", r"fmha|flash|attention|sdpa"),
    ("conv (cuDNN)", r"conv|implicit|cudnn|xmma|fprop|dgrad|wgrad"),
    ("gemm", r"gemm|cutlass|sm90_|ampere_|sm80_|cublas|nvjet"),
    ("norm (stock)", r"norm"),
    ("layout copies", r"copy|transpose|permute|contiguous|nchwToNhwc|nhwcToNchw"),
    ("elementwise", r"elementwise|vectorized|unrolled|reduce|triton_"),
)


# Setups that graph diffusers' own UNet: the torch.compile mode (None: not compiled).
STOCK_SETUPS = {"stock": None, "peer": None, "peer-max-autotune": "max-autotune-no-cudagraphs"}


# The categories that move data between GPUs (bench/parallel.py's exposed time: these with nothing beside them).
EXCHANGE = ("collectives (NCCL)", "exchange (copy engine)")


def category(name: str) -> str:
    return next((c for c, pat in CATEGORIES if re.search(pat, name, re.I)), "other")


def kernel_times(prof) -> tuple[collections.Counter, collections.Counter, list[tuple[float, float, str]]]:
    """(device µs per kernel name, calls per kernel name, (start, end, name) spans) of a profile."""
    kernels: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    spans = []
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time > 0:
            kernels[ev.name] += ev.device_time
            calls[ev.name] += 1
            spans.append((ev.time_range.start, ev.time_range.end, ev.name))
    return kernels, calls, spans


def categories_us(kernels: collections.Counter) -> collections.Counter:
    cats: collections.Counter = collections.Counter()
    for name, us in kernels.items():
        cats[category(name)] += us
    return cats


def _inputs(cfg: dict, size: int, device="cuda", dtype=torch.float16):
    from bench.e2e import unet_inputs

    g = torch.Generator(device=device).manual_seed(0)
    x, ctx, kwargs = unet_inputs(cfg, 2, size // 8, device, dtype, g, size)
    return x, torch.tensor([500, 500], device=device), ctx, kwargs


def measure(model: str, size: int, setup: str) -> dict:
    from sd_kernels.patches import PATCHERS
    from sd_kernels.patches import winograd as wg_patch

    import sd_kernels
    from bench.e2e import steady_ms
    from sd_kernels.models import build_model, load_config

    unet = build_model(model, "unet", device="cuda", dtype=torch.float16)
    x, t, ctx, kwargs = _inputs(load_config(model)["unet"], size)
    routes: collections.Counter = collections.Counter()
    route = wg_patch._route

    def recording(n, c, h, w, k, dtype, layout):
        tile = route(n, c, h, w, k, dtype, layout)
        routes[f"{layout} " + (f"F({tile},3)" if tile else "stock")] += 1
        return tile

    wg_patch._route = recording
    start = time.perf_counter()
    try:
        with torch.no_grad():
            if setup in STOCK_SETUPS:
                unet.to(memory_format=torch.channels_last)
                fn = unet
                if setup != "stock":  # the recipe: fused QKV, compiled whole (bench.setups.compiled)
                    unet.fuse_qkv_projections()
                    fn = torch.compile(unet, fullgraph=True, mode=STOCK_SETUPS[setup])
                call = lambda: fn(x, t, ctx, **kwargs).sample  # noqa: E731
                for _ in range(3):
                    call()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    call()
                replay = graph.replay
            else:
                compiled = "max-autotune" if "-compile-max-autotune" in setup else "-compile" in setup
                ops = sorted(set(PATCHERS) - ({"winograd"} if "-no-winograd" in setup else set()))
                if setup.endswith("-fused-qkv"):
                    unet.fuse_qkv_projections()
                sd_kernels.patch(unet, ops=ops, cuda_graph="unet", compile=compiled,
                                 precision="fp8" if "-fp8" in setup else None)
                # conv_in runs once per executed forward (warm-up, capture), not on replays; compiled,
                # the routing is decided once, when the forward is traced (no hook: it would be traced)
                forwards = [1 if compiled else 0]
                hook = (None if compiled else
                        unet.conv_in.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1)))
                unet(x, t, ctx, **kwargs)
                if hook is not None:
                    hook.remove()
                routes = collections.Counter({k: v // max(forwards[0], 1) for k, v in routes.items()})
                replay = lambda: unet(x, t, ctx, **kwargs)  # noqa: E731  (the patch's graph replays)
                replay()
                graph = next(iter(unet.forward.graphs.values())).graph
            torch.cuda.synchronize()
            warmup_s = time.perf_counter() - start
            # The call as the setup makes it (ours: the graph wrapper's input copies, output clone and
            # per-call checks), and the bare replay of its graph: their difference is the wrapper's cost.
            step_ms, graph_ms = steady_ms(replay, calls=20), steady_ms(graph.replay, calls=20)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                replay()
                torch.cuda.synchronize()
    finally:
        wg_patch._route = route
    from bench.timeline import gaps

    kernels, calls, spans = kernel_times(prof)
    cats = categories_us(kernels)
    # Where the replay's idle time sits: the gaps between kernels, by the category of the kernel after.
    _, idle = gaps(spans)
    idle_before: collections.Counter = collections.Counter()
    transitions: collections.Counter = collections.Counter()  # (category after, category before): idle µs
    pairs: collections.Counter = collections.Counter()  # the same by kernel names
    for g in idle:
        idle_before[category(g["before"])] += g["us"]
        transitions[f"{category(g['after'])} -> {category(g['before'])}"] += g["us"]
        pairs[f"{g['after'][:60]} -> {g['before'][:60]}"] += g["us"]
    return {
        "setup": setup, "warmup_s": round(warmup_s, 1), "step_ms": round(step_ms, 4),
        "graph_replay_ms": round(graph_ms, 4),
        "kernel_ms": round(sum(kernels.values()) / 1e3, 4), "kernels": sum(calls.values()),
        "categories_ms": {c: round(us / 1e3, 4) for c, us in cats.most_common()},
        "top_kernels": [{"name": n[:160], "ms": round(us / 1e3, 4), "calls": calls[n], "category": category(n)}
                        for n, us in kernels.most_common()],
        "idle_ms_before": {c: round(us / 1e3, 4) for c, us in idle_before.most_common()},
        "largest_gaps": [{**g, "after": g["after"][:80], "before": g["before"][:80]} for g in idle[:12]],
        "idle_ms_by_transition": {k: round(us / 1e3, 4) for k, us in transitions.most_common()},
        "idle_ms_by_kernel_pair": {k: round(us / 1e3, 4) for k, us in pairs.most_common(40)},
        "winograd_routing_per_call": dict(routes),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=pathlib.Path, required=True)
    ap.add_argument("--model", default="sd15@512")
    ap.add_argument("--setups", default="peer,patched,patched-compile")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.unet_kernels needs a CUDA GPU", file=sys.stderr)
        return 2
    name, _, size = args.model.partition("@")
    results = []
    for setup in args.setups.split(","):
        r = measure(name, int(size or 512), setup)
        results.append(r)
        print(f"== {setup}: warm-up {r['warmup_s']} s, step {r['step_ms']} ms, "
              f"bare graph replay {r['graph_replay_ms']} ms ({r['kernels']} "
              f"kernels, {r['kernel_ms']} ms of them), winograd routing "
              f"{r['winograd_routing_per_call']}")
        for c, ms in r["categories_ms"].items():
            print(f"   {c:<30} {ms:8.3f} ms, idle before its kernels {r['idle_ms_before'].get(c, 0):.3f} ms")
        torch.cuda.empty_cache()
        torch._dynamo.reset()
        args.out.mkdir(parents=True, exist_ok=True)  # after every setup: a run cut short keeps its numbers
        (args.out / "unet_kernels.json").write_text(json.dumps({"model": args.model, "setups": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
