"""The ``hopper`` profile's Winograd routes, derived from measured rows (bench.ops_winograd_unet).

    python -m bench.winograd_routes OPS_CSV [--write sd_kernels/profiles/hopper.json]

Rule, per measured (shape, layout): the fastest of our tiles (``ours_f2``, ``ours_f4``) is routed where
its device time is below cuDNN's on the same input layout (``stock``, cuDNN channels_last, for
channels_last inputs; ``cudnn_nchw`` for NCHW ones) by at least ``MARGIN`` (5%: a smaller gap is
within run-to-run noise, and every route costs 1.78x its conv's weights in memory); elsewhere the
stock conv stands. Shapes not measured are not routed. ``--write`` replaces the profile's ``winograd`` list with these routes.
"""

from __future__ import annotations

import argparse
import csv
import json
import pathlib
import re
import sys

OURS = {"ours_f2": 2, "ours_f4": 4}
BASELINE = {"channels_last": "stock", "nchw": "cudnn_nchw"}
MARGIN = 1.05  # cuDNN's time / ours at least this


def measured(paths) -> dict[tuple, dict[str, float]]:
    """((N, C, H, W, K), dtype, layout) → {impl: device ms} from ops.csv files (later files win)."""
    out: dict[tuple, dict[str, float]] = {}
    for path in paths:
        with open(path) as f:
            for r in csv.DictReader(f):
                if r["op"] == "conv3x3_winograd" and r["variant"] in BASELINE:
                    shape = tuple(int(v) for v in re.split(r"x|->", r["shape"]))
                    out.setdefault((shape, r["dtype"], r["variant"]), {})[r["impl"]] = float(r["ms"])
    return out


def routes(table: dict[tuple, dict[str, float]]) -> list[dict]:
    rules = []
    for (shape, dtype, layout), ms in sorted(table.items(), key=lambda kv: (kv[0][2], kv[0][0])):
        base = ms.get(BASELINE[layout])
        ours = {tile: ms[impl] for impl, tile in OURS.items() if impl in ms}
        if base is None or not ours:
            continue
        tile = min(ours, key=ours.get)
        if base >= MARGIN * ours[tile]:
            n, c, h, w, k = shape
            rules.append({"n": n, "c": c, "h": h, "w": w, "k": k, "dtype": dtype, "tile": tile, "layout": layout})
    return rules


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", nargs="+", type=pathlib.Path, help="ops.csv files with conv3x3_winograd rows")
    ap.add_argument("--write", type=pathlib.Path, help="a profile JSON whose winograd list to replace")
    args = ap.parse_args(argv)
    rules = routes(measured(args.csv))
    for r in rules:
        print(json.dumps(r))
    if args.write:
        profile = json.loads(args.write.read_text())
        profile["winograd"] = rules
        args.write.write_text(json.dumps(profile, indent=2))
        print(f"wrote {len(rules)} routes to {args.write}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
