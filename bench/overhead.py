"""Host cost per call of each patched op, against its stock counterpart: ``python -m bench.overhead --out DIR``.

An eager diffusers UNet step issues ~1,000 calls; at SD shapes many of them take less GPU time than
Python takes to launch them, so a kernel's wrapper costs as much as the kernel. This times the host
side alone: ``calls`` back-to-back calls on small inputs with one synchronize at the end (the GPU
never holds the host back: each call's kernels are shorter than its launch), and writes a cProfile of
our calls to ``overhead-profile.txt`` so that the expensive lines are named. The row ``ours, run`` is
ours with the launcher's direct path off (``sd_kernels.runtime.launch.FAST_LAUNCH``, as
SD_KERNELS_FAST_LAUNCH=0): every launch through Triton's ``JITFunction.run``.

``--pipeline NAME[,NAME]`` also times, per shipped config, the pipeline's ``_execution_device`` (the
first thing every pipeline call does, while the GPU waits): diffusers' property against the one
``patch(pipe)``'s pipeline mode installs (patches/execution_device.py), interleaved in rounds; and the
host time of a whole call up to its first model call (the text encoder), unpatched and patched
(the fastest of five rounds' medians), with a cProfile of the patched one's in the profile file.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pathlib
import pstats
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bench import common


def host_us(fn: Callable[[], object], calls: int = 2000) -> float:
    """Microseconds of wall time per call over ``calls`` calls with one synchronize at the end."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / calls * 1e6


def pairs() -> dict[str, dict[str, Callable[[], object]]]:
    """op -> {"stock": fn, "ours": fn} on SD1.5's smallest shapes (host-bound ones)."""
    from sd_kernels import ops
    from sd_kernels.ops.attention import attention

    dev, dt = "cuda", torch.float16
    x = torch.randn(2, 1280, 8, 8, device=dev, dtype=dt)
    w = torch.randn(1280, device=dev, dtype=dt)
    q = torch.randn(2, 64, 8, 160, device=dev, dtype=dt).transpose(1, 2)  # diffusers' [B, H, S, D] view
    kv = torch.randn(2, 77, 8, 160, device=dev, dtype=dt).transpose(1, 2)
    h = torch.randn(2, 64, 10240, device=dev, dtype=dt)
    return {
        "group_norm_silu 2x1280x8x8": {
            "stock": lambda: F.silu(F.group_norm(x, 32, w, w, 1e-5)),
            "ours": lambda: ops.group_norm(x, 32, w, w, 1e-5, activation="silu"),
        },
        "attention 2x8x64x77x160": {
            "stock": lambda: F.scaled_dot_product_attention(q, kv, kv),
            "ours": lambda: attention(q, kv, kv),
        },
        "geglu 2x64x10240": {
            "stock": lambda: (lambda a, g: a * F.gelu(g))(*h.chunk(2, dim=-1)),
            "ours": lambda: ops.geglu(h),
        },
        "empty triton-free reference: torch.empty": {"stock": lambda: torch.empty(1, device=dev)},
    }


def _profile_model(name: str, rows: list[dict]) -> str:
    """Host time of one eager UNet step (batch 2), stock and patched, and a cProfile of the patched one."""
    import sd_kernels
    from bench.e2e import unet_call
    from sd_kernels.models import build_pipeline
    from sd_kernels.runtime import launch

    pipe = build_pipeline(name, device="cuda", dtype=torch.float16)
    call = unet_call(pipe, 2, torch.float16)
    texts = []

    def profile(label: str) -> None:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(5):
            call()
        prof.disable()
        torch.cuda.synchronize()
        for key in ("tottime", "cumtime"):
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats(key).print_stats(30)
            texts.append(f"==== {name} {label} unet step, 5 calls, by {key}\n{text.getvalue()}")

    with torch.inference_mode():
        rows.append({"op": f"{name} unet step", "impl": "stock", "host_us_per_call": round(host_us(call, 20), 1)})
        profile("stock")
        with sd_kernels.patched(pipe, ignore=("vae",), cuda_graph=False):  # the eager host time per call
            call()
            rows.append({"op": f"{name} unet step", "impl": "ours", "host_us_per_call": round(host_us(call, 20), 1)})
            profile("patched")
            fast, launch.FAST_LAUNCH = launch.FAST_LAUNCH, False
            try:
                rows.append({"op": f"{name} unet step", "impl": "ours, run",
                             "host_us_per_call": round(host_us(call, 20), 1)})
            finally:
                launch.FAST_LAUNCH = fast
    for r in rows:
        print(f"  {r['op']:<40} {r['impl']:<9} {r['host_us_per_call']:10.1f} us/call", flush=True)
    return "\n".join(texts)


def _execution_device_rows(name: str, rounds: int = 10, calls: int = 10) -> list[dict]:
    """Host time of ``pipe._execution_device``: diffusers' own, and the patched pipeline's."""
    import statistics

    from diffusers import DiffusionPipeline

    import sd_kernels
    from sd_kernels.models import build_pipeline

    pipe = build_pipeline(name, device="cuda", dtype=torch.float16)
    stock = DiffusionPipeline._execution_device.fget
    times: dict[str, list[float]] = {"stock": [], "ours": []}
    with sd_kernels.patched(pipe, cuda_graph=True) as record:
        assert record.counts["fast_execution_device"] == 1, record.format()
        for _ in range(rounds):
            for impl, fn in (("stock", lambda: stock(pipe)), ("ours", lambda: pipe._execution_device)):
                t = time.perf_counter()
                for _ in range(calls):
                    fn()
                times[impl].append((time.perf_counter() - t) / calls * 1e6)
    modules = sum(1 for c in pipe.components.values() if isinstance(c, torch.nn.Module) for _ in c.modules())
    return [{"op": f"{name} pipe._execution_device ({modules} modules)", "impl": impl,
             "host_us_per_call": round(statistics.median(ts), 1)} for impl, ts in times.items()]


class _Reached(Exception):
    """Raised by the first text-encoder call: the pipeline call ends there."""


def _lead_us(pipe, calls: int, prof: cProfile.Profile | None = None) -> float:
    """Median host µs from the start of a pipeline call to its first text-encoder call (the host work
    before any GPU work); ``prof`` profiles that part of each call."""
    import statistics

    from sd_kernels.patches.record import set_instance_attr

    from bench.e2e import PROMPT

    times, reached = [], []

    def stop(*args, **kwargs):
        reached.append(time.perf_counter())
        if prof is not None:
            prof.disable()
        raise _Reached

    restore = set_instance_attr(pipe.text_encoder, "forward", stop, "bench.overhead", "it stopped the call there")
    gen = torch.Generator(pipe.device)
    try:
        for _ in range(calls):
            start = time.perf_counter()
            if prof is not None:
                prof.enable()
            try:
                pipe(PROMPT, num_inference_steps=20, generator=gen.manual_seed(0), output_type="pt")
            except _Reached:
                times.append((reached[-1] - start) * 1e6)
    finally:
        restore()
    return statistics.median(times)


def _lead_rows(name: str, calls: int = 30) -> tuple[list[dict], str]:
    """Host time before a pipeline call's first model call, diffusers' pipeline and ``patch(pipe)``'s
    (rounds interleaved), and a cProfile of the patched one's."""
    import sd_kernels
    from sd_kernels.models import build_pipeline

    pipe = build_pipeline(name, device="cuda", dtype=torch.float16)
    pipe.set_progress_bar_config(disable=True)
    times: dict[str, list[float]] = {"stock": [], "ours": []}
    prof = cProfile.Profile()
    with torch.no_grad():
        for _ in range(5):
            times["stock"].append(_lead_us(pipe, calls // 5))
            with sd_kernels.patched(pipe):
                times["ours"].append(_lead_us(pipe, calls // 5))
        with sd_kernels.patched(pipe):
            _lead_us(pipe, calls, prof)
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    rows = [{"op": f"{name} pipeline call, host before its first model call", "impl": impl,
             "host_us_per_call": round(min(ts), 1)} for impl, ts in times.items()]
    title = f"==== {name} patch(pipe): a pipeline call up to its first model call, {calls} calls"
    return rows, f"{title}\n{text.getvalue()}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=pathlib.Path, required=True)
    ap.add_argument("--model", default="", help="also profile one eager UNet step of this shipped config")
    ap.add_argument("--pipeline", default="", help="also time _execution_device of these shipped configs' pipelines")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.overhead needs a CUDA GPU", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    rows, profiles = [], []
    if args.model:
        profiles.append(_profile_model(args.model, rows))
    for name in filter(None, args.pipeline.split(",")):
        lead, text = _lead_rows(name)
        rows += _execution_device_rows(name) + lead
        profiles.append(text)
        for r in rows[-4:]:
            print(f"  {r['op']:<40} {r['impl']:<9} {r['host_us_per_call']:10.1f} us/call", flush=True)
    from sd_kernels.runtime import launch

    with torch.inference_mode():
        for op, impls in pairs().items():
            if "ours" in impls:
                impls["ours, run"] = impls["ours"]
            for impl, fn in impls.items():
                fast = launch.FAST_LAUNCH
                launch.FAST_LAUNCH = fast and impl != "ours, run"
                try:
                    rows.append({"op": op, "impl": impl, "host_us_per_call": round(host_us(fn), 2)})
                finally:
                    launch.FAST_LAUNCH = fast
                print(f"  {op:<40} {impl:<9} {rows[-1]['host_us_per_call']:8.2f} us/call", flush=True)
            if "ours" in impls:
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(500):
                    impls["ours"]()
                prof.disable()
                torch.cuda.synchronize()
                text = io.StringIO()
                pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
                profiles.append(f"==== {op} (500 calls)\n{text.getvalue()}")
    env = common.environment()
    (args.out / "overhead.json").write_text(json.dumps({"env": env, "rows": rows}, indent=2))
    (args.out / "overhead-profile.txt").write_text("\n".join(profiles))
    return 0


if __name__ == "__main__":
    sys.exit(main())
