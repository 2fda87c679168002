"""Run the per-op microbenchmarks on the GPU and write one CSV: ``python -m bench.run --out DIR``.

Each ``bench/ops_<family>.py`` module exposes ``cases(quick: bool) -> Iterator[Case]`` and may list
in ``EXTRAS`` the names of zero-argument functions returning JSON-able tables (printed as ``EXTRA``
lines). This runs them all (or ``--only``), stamps every row with device, versions and date, writes
``ops.csv`` and prints a short table.
"""

from __future__ import annotations

import argparse
import csv
import importlib
import json
import pathlib
import pkgutil
import sys

import torch

from bench import common

SUMMARY_COLUMNS = ["op", "shape", "dtype", "variant", "impl", "ms", "speedup_vs_stock", "GB/s",
                   "pct_copy_bw", "TFLOP/s", "eager_ms", "eager_speedup", "rel_err"]


def families() -> list[str]:
    import bench

    return sorted(m.name.removeprefix("ops_") for m in pkgutil.iter_modules(bench.__path__)
                  if m.name.startswith("ops_"))


def _write_csv(path: pathlib.Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
        w.writeheader()
        w.writerows(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=pathlib.Path, required=True, help="folder for ops.csv and env.json")
    ap.add_argument("--only", default="", help=f"comma-separated families of {families()}")
    ap.add_argument("--quick", action="store_true", help="fewer shapes and repetitions")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.run needs a CUDA GPU", file=sys.stderr)
        return 2
    chosen = [f for f in args.only.split(",") if f] or families()
    unknown = set(chosen) - set(families())
    if unknown:
        print(f"unknown families {sorted(unknown)}; known: {families()}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    env = common.environment()
    env["copy_GBps"] = round(common.copy_ceiling_gbps(), 1)
    env["matmul_fp16_TFLOPs"] = round(common.matmul_ceiling_tflops(), 1)
    (args.out / "env.json").write_text(json.dumps(env, indent=2))
    print(json.dumps(env))
    rows = []
    rep = 30 if args.quick else 100
    for fam in chosen:
        mod = importlib.import_module(f"bench.ops_{fam}")
        for name in getattr(mod, "EXTRAS", ()):  # tables beside the timings, e.g. the paper's figures
            try:
                print(f"EXTRA {fam}.{name} " + json.dumps(getattr(mod, name)(), default=str))
            except Exception as exc:
                print(f"FAILED extra {fam}.{name}: {type(exc).__name__}: {exc}", file=sys.stderr)
        for case in mod.cases(args.quick):
            try:
                new = list(common.measure(case, rep=rep))
            except Exception as exc:  # one broken case must not hide the others' numbers
                print(f"FAILED {case.name}: {type(exc).__name__}: {exc}", file=sys.stderr)
                continue
            rows += [{**r, **env} for r in new]
            print(common.format_table(new, SUMMARY_COLUMNS[4:]).replace("\n", "\n  "), "<-", case.name)
            _write_csv(args.out / "ops.csv", rows)  # after every case: a run cut short keeps its numbers
            del case
            torch.cuda.empty_cache()
    if rows:
        print()
        print(common.format_table(rows, SUMMARY_COLUMNS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
