"""Where the GPU waits in one pipeline call: a torch.profiler timeline of one warm ``pipe(prompt)``.

    python -m bench.timeline --out DIR [--model sd15@512] [--variant patched+graph] [--steps 20]

Sets the pipeline up as one of bench/setups.py's variants, runs two warm-up calls, then profiles one
call with CUDA activity and writes ``DIR/timeline-<variant>.json``: the call's wall time, the span
from its first kernel to its last, the GPU's busy time inside that span (the union of kernel
intervals), the idle time before the first kernel (host work before any GPU work), inside the span
and after the last kernel, the idle time summed by the kernel categories on each side of a gap, and the
largest idle gaps with the kernels on each side.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import torch


def gaps(intervals: list[tuple[float, float, str]]) -> tuple[float, list[dict]]:
    """(busy µs, idle gaps between merged intervals, largest first) of (start µs, end µs, name)s."""
    busy, out = 0.0, []
    cur_start, cur_end, cur_name = None, None, ""
    for start, end, name in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                busy += cur_end - cur_start
                out.append({"us": round(start - cur_end, 1), "after": cur_name, "before": name})
            cur_start, cur_end, cur_name = start, end, name
        elif end > cur_end:
            cur_end, cur_name = end, name
    if cur_end is not None:
        busy += cur_end - cur_start
    return busy, sorted(out, key=lambda g: -g["us"])


def idle_by_boundary(idle: list[dict], top: int = 20) -> list[dict]:
    """The idle gaps summed by the kernel categories on each side (bench/unet_kernels.py's ``category``):
    which boundaries the GPU waits at, most idle time first, each with the kernel names of its first gap."""
    from bench.unet_kernels import category

    sums: dict[tuple[str, str], list] = {}
    for g in idle:
        pair = (category(g["after"]), category(g["before"]))
        total = sums.setdefault(pair, [0.0, 0, f"{g['after'][:60]} -> {g['before'][:60]}"])
        total[0] += g["us"]
        total[1] += 1
    rows = [{"after": a, "before": b, "us": round(t, 1), "gaps": n, "mean_us": round(t / n, 2), "example": e}
            for (a, b), (t, n, e) in sums.items()]
    return sorted(rows, key=lambda r: -r["us"])[:top]


def profile(model: str, variant: str, steps: int) -> dict:
    from torch.profiler import ProfilerActivity

    from bench.e2e import Bench, parse_targets, pipeline_call
    from bench.setups import VARIANTS, applied

    (target,) = parse_targets(model)
    with torch.inference_mode():
        bench = Bench(target, steps)
        with applied(bench.pipe, VARIANTS[variant]):
            call = pipeline_call(bench.pipe, target.size, steps)
            for _ in range(2):
                call()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                t0 = time.perf_counter()
                with torch.profiler.record_function("pipeline_call"):
                    call()
                torch.cuda.synchronize()
                wall_ms = (time.perf_counter() - t0) * 1e3
    events = prof.events()
    kernels = [(e.time_range.start, e.time_range.end, e.name) for e in events
               if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start]
    marker = next(e for e in events if e.name == "pipeline_call" and e.device_type != torch.autograd.DeviceType.CUDA)
    busy, idle = gaps(kernels)
    first, last = min(k[0] for k in kernels), max(k[1] for k in kernels)
    return {"model": model, "variant": variant, "steps": steps, "wall_ms": round(wall_ms, 2),
            "host_call_ms": round((marker.time_range.end - marker.time_range.start) / 1e3, 2),
            "before_first_kernel_ms": round((first - marker.time_range.start) / 1e3, 2),
            "kernel_span_ms": round((last - first) / 1e3, 2), "gpu_busy_ms": round(busy / 1e3, 2),
            "idle_in_span_ms": round((last - first - busy) / 1e3, 2), "kernels": len(kernels),
            "gaps_over_50us": sum(g["us"] > 50 for g in idle), "idle_by_boundary": idle_by_boundary(idle),
            "largest_gaps": idle[:25],
            "device": torch.cuda.get_device_name(), "torch": torch.__version__}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=pathlib.Path, required=True)
    ap.add_argument("--model", default="sd15@512")
    ap.add_argument("--variant", default="patched+graph")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.timeline needs a CUDA GPU", file=sys.stderr)
        return 2
    result = profile(args.model, args.variant, args.steps)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"timeline-{args.variant.replace('+', '_')}.json"  # names the device tool copies back
    path.write_text(json.dumps(result, indent=1) + "\n")
    brief = {k: v for k, v in result.items() if k not in ("largest_gaps", "idle_by_boundary")}
    print(json.dumps(brief), "\nidle by boundary:", *result["idle_by_boundary"][:12], "\nlargest gaps:",
          *result["largest_gaps"][:8], sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
