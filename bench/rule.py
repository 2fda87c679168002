"""How far the nearest-key rule (sd_kernels/runtime/tuning_rule.py) is from timing every config, at
shapes no shipped table holds.

    python -m bench.rule --out DIR --runs "sd15@640x448x3+768x512x2;sdxl@1216x832x2" [--steps 20]

Per run (a model and its shapes, as bench.cold's ``--runs``), three fresh processes with empty caches:
1. ``rule``: ``patch(pipe)``'s defaults; bench.cold's rows (first image, what it spent, warm ms);
2. ``tune``: the patched pipeline eagerly for two steps at each shape under ``SD_KERNELS_AUTOTUNE=1``
   with the shipped tables on, so that exactly the keys the rule served in (1) are timed, every config
   the kernel keeps for the call; for each, the rule's choice from the shipped tables alone (what a
   fresh machine sees: the shapes are held out of the tables by construction) beside the timed best,
   and the kernel's launches of that key (counted over the two steps);
3. ``tuned``: as (1), with the autotune cache (2) wrote: every such key takes its timed best.

``DIR/rule-keys.csv``: one row per timed key: kernel, key, the tuned key whose choice the rule took,
the rule's config and the best, their times (Triton's autotuner: the median of its do_bench) and
launches. ``DIR/rule.csv``: per run and shape, warm ms of (1) and (3) and their ratio, and per kernel
the rule's share of best choices, its median and worst slowdown per key, and its slowdown summed over
launches. bench.cold's rows of (1) and (3) go to ``DIR/cold.csv``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

from bench import cold


def tune_child(model: str, shapes: list[tuple[int, int, int]]) -> list[dict]:
    """In a fresh process under SD_KERNELS_AUTOTUNE=1: every key no shipped table holds is timed; its row."""
    import torch

    import sd_kernels
    from bench.e2e import PROMPT
    from sd_kernels import models
    from sd_kernels.runtime import launch, tuning_rule

    rows: dict[tuple[str, str], dict] = {}
    launches: collections.Counter = collections.Counter()
    first, call = launch.Launcher._first, launch.Launcher.__call__

    def timed_first(self, key, grid, args, kwargs):
        cache = self._cache_file(args) if self.tunable else None
        if cache is None or cache.get(key) is not None or launch.dry():
            return first(self, key, grid, args, kwargs)
        allowed = self.allowed(args, kwargs)
        found = tuning_rule.nearest(repr(key), cache.neighbours(mine=False), allowed)
        rule, near = found if found is not None else (allowed[0], "")
        first(self, key, grid, args, kwargs)  # times every config the kernel keeps for the call (Launcher._timings)
        timings = {json.dumps(entry, sort_keys=True): ms for entry, ms in self._timings()}
        if not timings:  # one config kept for the call: nothing was timed
            return
        best = min(timings, key=timings.get)
        rows[(self.name, repr(key))] = {
            "kernel": self.name.removeprefix("sd_kernels.ops."), "key": repr(key), "near": near,
            "rule": json.dumps(rule, sort_keys=True), "best": best, "configs": len(timings),
            "rule_ms": timings.get(json.dumps(rule, sort_keys=True), float("nan")), "best_ms": timings[best]}

    def counted(self, key, grid, *args, **kwargs):
        launches[(self.name, repr(key))] += 1
        return call(self, key, grid, *args, **kwargs)

    launch.Launcher._first, launch.Launcher.__call__ = timed_first, counted
    pipe = models.load_pipeline(model, device="cuda", dtype=torch.float16)
    pipe.set_progress_bar_config(disable=True)
    with sd_kernels.patched(pipe, cuda_graph=False), torch.inference_mode():
        for width, height, batch in shapes:
            pipe(PROMPT, num_inference_steps=2, height=height, width=width, num_images_per_prompt=batch,
                 output_type="pt")
    return [{**row, "launches": launches[k]} for k, row in rows.items()]


def summary(keys: list[dict]) -> list[dict]:
    """Per kernel: keys timed, the rule's best picks, median and worst slowdown per key, and the
    slowdown summed over launches (Σ launches·rule_ms / Σ launches·best_ms − 1)."""
    by_kernel = collections.defaultdict(list)
    for row in keys:
        by_kernel[row["kernel"]].append(row)
    out = []
    for kernel, rows in sorted(by_kernel.items()):
        slow = [r["rule_ms"] / r["best_ms"] - 1 for r in rows]
        total = sum(r["launches"] * r["rule_ms"] for r in rows) / max(1e-12, sum(r["launches"] * r["best_ms"]
                                                                              for r in rows)) - 1
        out.append({"kernel": kernel, "keys": len(rows), "rule_is_best": sum(r["rule"] == r["best"] for r in rows),
                    "median_slowdown": statistics.median(slow), "worst_slowdown": max(slow),
                    "launch_weighted_slowdown": total,
                    "launch_ms_rule": sum(r["launches"] * r["rule_ms"] for r in rows),
                    "launch_ms_best": sum(r["launches"] * r["best_ms"] for r in rows)})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=pathlib.Path, help="folder for rule.csv, rule-keys.csv, cold.csv")
    ap.add_argument("--runs", default="sd15@640x448x3+768x512x2;sdxl@1216x832x2")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        model, shapes = cold.parse_runs(args.child)[0]
        print(json.dumps(tune_child(model, shapes)))
        return 0
    if args.out is None:
        ap.error("--out is required")
    try:
        runs = cold.parse_runs(args.runs)
    except ValueError as exc:
        ap.error(str(exc))
    from bench import common

    env = common.environment()
    args.out.mkdir(parents=True, exist_ok=True)
    status = 0
    for model, shapes in runs:
        spec = f"{model}@{'+'.join(map(cold.label, shapes))}"
        ruled = cold.measure(model, shapes, args.steps)
        with tempfile.TemporaryDirectory(prefix="sd-kernels-rule-") as tmp:
            proc = subprocess.run([sys.executable, "-m", "bench.rule", "--child", spec],
                                  env={**os.environ, "SD_KERNELS_AUTOTUNE": "1", "SD_KERNELS_AUTOTUNE_CACHE": tmp,
                                       "TRITON_CACHE_DIR": f"{tmp}/triton"}, capture_output=True, text=True)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("[")]
            keys = json.loads(lines[-1]) if proc.returncode == 0 and lines else []
            tuned = cold.measure(model, shapes, args.steps, cache=tmp)
        if not keys:
            status = 1
            print(f"  {spec}: the tuning run failed: {(proc.stderr.strip().splitlines() or ['no output'])[-1][:300]}")
        for row in ruled + [{**r, "autotune": "tuned"} for r in tuned]:
            status |= row["status"] != "ok"
            print(cold.say(row), flush=True)
        common.append_csv(args.out / "cold.csv", [{**r, **{k: env.get(k, "") for k in cold.FIELDS if k in env}}
                                       for r in ruled + [{**r, "autotune": "tuned"} for r in tuned]])
        common.append_csv(args.out / "rule-keys.csv", [{"run": spec, **k} for k in keys])
        warm = [{"run": spec, "shape": a["shape"], "rule_warm_ms": a.get("warm_ms"), "tuned_warm_ms": b.get("warm_ms"),
                 "ratio": (a["warm_ms"] / b["warm_ms"]) if a["status"] == b["status"] == "ok" else ""}
                for a, b in zip(ruled, tuned)]
        kernels = summary(keys)
        stamp = {k: env.get(k, "") for k in ("device", "torch", "triton", "date")}
        common.append_csv(args.out / "rule.csv", [{**w, **stamp} for w in warm])
        common.append_csv(args.out / "rule-kernels.csv", [{"run": spec, **k} for k in kernels])
        for w in warm:
            ratio = "n/a" if w["ratio"] == "" else f"{w['ratio']:.3f}x"
            print(f"  {spec} {w['shape']}: warm {w['rule_warm_ms']} ms by rule, {w['tuned_warm_ms']} ms tuned "
                  f"({ratio})")
        for k in kernels:
            print(f"    {k['kernel']:<42} {k['keys']:>3} keys, rule best {k['rule_is_best']:>3}, median "
                  f"{k['median_slowdown']:+.1%}, worst {k['worst_slowdown']:+.1%}, over launches "
                  f"{k['launch_weighted_slowdown']:+.2%} ({k['launch_ms_rule']:.2f} vs {k['launch_ms_best']:.2f} ms)")
    return status


if __name__ == "__main__":
    sys.exit(main())
