"""The ``hopper`` profile's Winograd routes, derived from measured rows (bench.ops_winograd_unet).

    python -m bench.winograd_routes OPS_CSV [--write sd_kernels/profiles/hopper.json]

Rule, per measured (shape, layout): the fastest of our tiles (``ours_f2``, ``ours_f4``) is routed where
its device time is below cuDNN's on the same input layout (``stock``, cuDNN channels_last, for
channels_last inputs; ``cudnn_nchw`` for NCHW ones) by at least ``MARGIN`` (5%: a smaller gap is
within run-to-run noise, and every route costs 1.78x its conv's weights in memory); elsewhere the
stock conv stands. Shapes not measured are not routed.

Only NCHW inputs are routed (``LAYOUTS``). The channels_last rows win in isolation (1.2-2.7x), but in
the UNet they lose: SD1.5's step replayed from a graph, all 29 deep conv calls routed channels_last,
took 8.01 ms against 7.57 ms without Winograd, and 6.50 against 6.24 ms compiled
(bench/results/2026-11-23-h100-unet-nhwc-winograd/: ``unet_kernels-cl-routes.json``, ``e2e-sd15-cl-routes.csv``,
``e2e-sd15-nchw-routes.csv``).
The likely cause (not yet measured on its own): the isolated benchmark rotates its inputs but not
its weights, which stay in the 50 MB L2 across replays; in a UNet step each conv's weights come
from HBM once, the deep convs (8²-32² maps, 1280 channels, 29 MB of weights each) are bound by that
read, and F(2,3)'s transformed weights are 16/9 as large. In the step's profile the 29 routed calls
took 1.3 ms of Winograd kernels where cuDNN's took about 1.05 ms. NCHW routes beat cuDNN's NCHW kernels in
the UNet too (the ablation in docs/results.md, 2026-11-22: 10.73 → 8.51 ms per step). Until the
isolated benchmark models cold weights, a channels_last win there is not a reason to route.

``--write`` replaces the profile's ``winograd`` list with these routes.
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
LAYOUTS = ("nchw",)  # see the module docstring: channels_last routes lose inside the UNet


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
        if base is None or not ours or layout not in LAYOUTS:
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
