"""The paper's memory table on the GPU, per profile: weights and peak intermediates per component.

    python -m bench.memory --out DIR [--model sd15] [--profiles s23-ultra,iphone-14-pro-max,mobile-small]

Rows: stock diffusers (SDPA) at UNet batch 1 and 2 for reference, then the pipeline patched under
each mobile emulation (its budget enforced, its attention policy and chunking applied) at batch 1.
Per row: text encoder, one UNet step and the VAE decode, each with weights MB, peak intermediate MB
(peak allocated during the call above what was allocated before it) and median latency (ms, eager:
the emulation is about memory, not speed). Prints a line per component as it finishes (flushed:
the run takes minutes per profile) and rewrites DIR/memory.csv after every variant, with what a
variant measured before it failed; prints the table at the end. ``--steps N`` (default 20) adds,
per variant at batch 1, one whole pipeline call measured by ``sd_kernels.analysis.memory_report.PipelineMemory``
(each component's largest call, the call's total peak with the weights, against the budget), also
written as tables to DIR/memory-e2e.txt.
The paper (arXiv 2304.11267): 84 MB of intermediates for SD1.5's UNet on its phones; stock diffusers
needs 340 MB over the weights at batch 2 with SDPA (measured on the H100).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import pathlib
import sys
import time

import torch

from bench import common
from sd_kernels import profiles
from sd_kernels.analysis import memory_report
from sd_kernels.runtime import memory

MOBILE = ("s23-ultra", "iphone-14-pro-max", "mobile-small")
COLUMNS = ["variant", "component", "weights_mb", "peak_intermediate_mb", "ms", "peak_at", "error"]


def measure(pipe, variant: str, batch: int, rows: list[dict], started: float) -> None:
    """memory_report's rows for ``variant``, appended to ``rows`` one component at a time (so that a
    variant that fails part way keeps what it measured), each printed as it finishes."""

    def finished(c: memory_report.ComponentMemory) -> None:
        rows.append({"variant": variant, **dataclasses.asdict(c)})
        _say(started, f"{variant}: {c.component}: weights {c.weights_mb:.1f} MB, peak intermediates "
                      f"{c.peak_intermediate_mb:.1f} MB, {c.ms:.2f} ms, peak at {c.peak_at or '-'}")

    memory_report.memory_report(pipe, batch=batch, progress=finished)


def end_to_end(pipe, variant: str, budget: int | None, steps: int, started: float) -> tuple[list[dict], str]:
    """One whole pipeline call (512² for SD1.5, ``steps`` steps, batch 1 with guidance), after a
    one-step warm-up call, measured by
    ``memory_report.PipelineMemory``: rows per component (its largest call's peak intermediates, its calls)
    and a ``total peak`` row (the whole call's peak in use, weights included), and the printed table."""
    from bench.e2e import PROMPT

    side = pipe.unet.config.sample_size * pipe.vae_scale_factor
    pipe.set_progress_bar_config(disable=True)

    def call(n: int) -> None:
        pipe(PROMPT, num_inference_steps=n, height=side, width=side,
             generator=torch.Generator("cuda").manual_seed(0), output_type="pt")

    call(1)  # a warm-up: first calls autotune the UNet's kernels at batch 2 (Triton's timing allocates 256 MB)
    torch.cuda.synchronize()
    t = time.perf_counter()
    with memory_report.PipelineMemory(pipe, budget) as table:
        call(steps)
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t) * 1e3
    rows = [{"variant": variant, "component": f"e2e {r.part} ({r.calls} calls)", "weights_mb": r.weights / memory.MB,
             "peak_intermediate_mb": r.peak_intermediate / memory.MB, "ms": float("nan"), "peak_at": ""}
            for r in table.parts.values()]
    rows.append({"variant": variant, "component": f"e2e total peak, {steps} steps"
                 + ("" if budget is None else f" (budget {budget / memory.MB:.0f} MB)"),
                 "weights_mb": table.weights / memory.MB,
                 "peak_intermediate_mb": (table.total_peak - table.weights) / memory.MB, "ms": ms, "peak_at": ""})
    text = table.format(f"{variant}, {side}x{side}, {steps} steps, {ms / 1e3:.1f} s")
    _say(started, text)
    return rows, text


def _say(started: float, line: str) -> None:
    print(f"[{time.perf_counter() - started:7.1f} s] {line}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=pathlib.Path, required=True)
    ap.add_argument("--model", default="sd15")
    ap.add_argument("--profiles", default=",".join(MOBILE), help="comma-separated profile names")
    ap.add_argument("--steps", type=int, default=20,
                    help="also one whole pipeline call of this many steps per variant (0: none)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.memory needs a CUDA GPU", file=sys.stderr)
        return 2
    from sd_kernels.patches import patch, unpatch

    from sd_kernels.models import build_pipeline

    names = [n for n in args.profiles.split(",") if n]
    for n in names:
        profiles.get_profile(n)  # an unknown name fails before the model is built
    started = time.perf_counter()
    pipe = build_pipeline(args.model, device="cuda", dtype=torch.float16)
    env = {**common.environment(), "model": args.model, "dtype": "float16"}
    print(json.dumps(env))
    rows = []
    args.out.mkdir(parents=True, exist_ok=True)

    def save(new: list[dict]) -> None:  # after every variant: a run cut short keeps what it measured
        for r in new:
            r.setdefault("error", "")
            for k in ("weights_mb", "peak_intermediate_mb", "ms"):
                r[k] = round(r[k], 2)
        rows.extend(new)
        if not rows:
            return
        with open(args.out / "memory.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=[*rows[0], *env])
            w.writeheader()
            w.writerows({**r, **env} for r in rows)

    variants = [(f"stock b{batch}", None, batch) for batch in (1, 2)] + [(name, name, 1) for name in names]
    tables: list[str] = []
    with torch.inference_mode():
        for i, (variant, profile, batch) in enumerate(variants, 1):
            how = f" (patched under {profile})" if profile else ""
            _say(started, f"variant {i}/{len(variants)}: {variant}{how}")
            done: list[dict] = []
            if profile is not None:
                patch(pipe, profile=profile)
            try:
                measure(pipe, variant, batch, done, started)
                if args.steps and batch == 1:
                    budget = profiles.get_profile(profile).memory_budget_bytes() if profile else None
                    e2e_rows, text = end_to_end(pipe, variant, budget, args.steps, started)
                    done += e2e_rows
                    tables.append(text)
            except memory.MemoryBudgetExceeded as exc:
                _say(started, f"{variant}: budget exceeded: {exc}")
                done.append({"variant": variant, "component": "budget exceeded", "weights_mb": float("nan"),
                             "peak_intermediate_mb": float("nan"), "ms": float("nan"), "peak_at": "",
                             "error": str(exc)})
            finally:
                save(done)
                if profile is not None:
                    unpatch(pipe)
                    profiles.set_profile(None)
    if tables:
        (args.out / "memory-e2e.txt").write_text("\n\n".join(tables) + "\n")
    _say(started, f"done: wrote {args.out / 'memory.csv'}" + (" and memory-e2e.txt" if tables else ""))
    print(common.format_table(rows, COLUMNS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
