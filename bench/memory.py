"""The paper's memory table on the GPU, per profile: weights and peak intermediates per component.

    python -m bench.memory --out DIR [--model sd15] [--profiles s23-ultra,iphone-14-pro-max,mobile-small]

Rows: stock diffusers (SDPA) at UNet batch 1 and 2 for reference, then the pipeline patched under
each mobile emulation (its budget enforced, its attention policy and chunking applied) at batch 1.
Per row: text encoder, one UNet step and the VAE decode, each with weights MB, peak intermediate MB
(peak allocated during the call above what was allocated before it) and median latency (ms, eager:
the emulation is about memory, not speed). Writes DIR/memory.csv; prints the table.
The paper (arXiv 2304.11267): 84 MB of intermediates for SD1.5's UNet on its phones; stock diffusers
needs 340 MB over the weights at batch 2 with SDPA (REFERENCE.md).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import pathlib
import sys

import torch

from bench import common
from sd_kernels import memory, profiles

MOBILE = ("s23-ultra", "iphone-14-pro-max", "mobile-small")
COLUMNS = ["variant", "component", "weights_mb", "peak_intermediate_mb", "ms", "peak_at", "error"]


def rows_for(pipe, variant: str, batch: int) -> list[dict]:
    return [{"variant": variant, **dataclasses.asdict(c)} for c in memory.memory_report(pipe, batch=batch)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=pathlib.Path, required=True)
    ap.add_argument("--model", default="sd15")
    ap.add_argument("--profiles", default=",".join(MOBILE), help="comma-separated profile names")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.memory needs a CUDA GPU", file=sys.stderr)
        return 2
    from sd_kernels.patches import patch, unpatch

    from sd_kernels.models import build_pipeline

    names = [n for n in args.profiles.split(",") if n]
    for n in names:
        profiles.get_profile(n)  # an unknown name fails before the model is built
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
        with open(args.out / "memory.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=[*rows[0], *env])
            w.writeheader()
            w.writerows({**r, **env} for r in rows)

    with torch.inference_mode():
        for batch in (1, 2):
            save(rows_for(pipe, f"stock b{batch}", batch))
        for name in names:
            patch(pipe, profile=name)
            try:
                save(rows_for(pipe, name, 1))
            except memory.MemoryBudgetExceeded as exc:
                save([{"variant": name, "component": "budget exceeded", "weights_mb": float("nan"),
                       "peak_intermediate_mb": float("nan"), "ms": float("nan"), "peak_at": "",
                       "error": str(exc)}])
            finally:
                unpatch(pipe)
                profiles.set_profile(None)
    print(common.format_table(rows, COLUMNS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
