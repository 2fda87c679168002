"""How many programs the GroupNorm pixel path should aim at: ``python -m bench.pixel_programs --out DIR``.

The pixel path (channels_last GroupNorm, ``sd_kernels/ops/group_norm.py``) splits each sample's
pixels into chunks so that ``_PIXEL_PROGRAMS`` programs (at 132 SMs) share the statistics launch:
more programs fill the GPU sooner, fewer leave each program more tiles to stream and the merge launch
fewer partials to merge. This sweeps the knob over SD's channels_last GroupNorm+SiLU shapes (fp16,
device time from a CUDA graph of many calls over inputs rotated past L2) with the stock op timed in the same run, and
writes ``DIR/pixel_programs.csv`` (one row per knob value and shape: ms, GB/s of the ideal traffic,
chunks per sample).
"""

from __future__ import annotations

import argparse
import csv
import importlib
import pathlib
import sys

import torch
import torch.nn.functional as F

SHAPES = [(2, 320, 64, 64), (2, 640, 64, 64), (2, 960, 64, 64), (2, 640, 32, 32), (2, 1280, 32, 32),
          (2, 1920, 32, 32), (2, 2560, 16, 16), (1, 512, 128, 128), (1, 256, 256, 256), (1, 128, 512, 512)]
KNOB = (128, 256, 512, 1024)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=pathlib.Path, required=True)
    ap.add_argument("--programs", default=",".join(map(str, KNOB)))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.pixel_programs needs a CUDA GPU", file=sys.stderr)
        return 2
    from bench.common import rotating, time_graph_ms

    gn = importlib.import_module("sd_kernels.ops.group_norm")
    default = gn._PIXEL_PROGRAMS
    rows = []
    for shape in SHAPES:
        def make(shape=shape):
            x = (torch.randn(shape, device="cuda", dtype=torch.float16) + 0.5).contiguous(
                memory_format=torch.channels_last)
            return x, 1 + 0.1 * torch.randn(shape[1], device="cuda", dtype=torch.float16), 0.1 * torch.randn(
                shape[1], device="cuda", dtype=torch.float16)

        nbytes = 2 * 2 * torch.Size(shape).numel()
        inputs = rotating(make, nbytes)
        stock = time_graph_ms(lambda inputs=inputs: F.silu(F.group_norm(*_args(inputs()))))
        for programs in map(int, args.programs.split(",")):
            gn._PIXEL_PROGRAMS = programs
            try:
                ms = time_graph_ms(lambda inputs=inputs: gn.group_norm(*_args(inputs()), activation="silu"))
                p = gn.plan(shape[0], 32, shape[1] // 32, shape[2] * shape[3], True,
                            sms=gn.sm_count(torch.cuda.current_device()))
            finally:
                gn._PIXEL_PROGRAMS = default
            rows.append({"shape": "x".join(map(str, shape)), "programs": programs, "path": p.name, "ms": round(ms, 5),
                         "GB/s": round(nbytes / ms / 1e6, 1), "stock_ms": round(stock, 5),
                         "speedup_vs_stock": round(stock / ms, 3), "default": programs == default})
            print(f"{rows[-1]['shape']:<16} programs {programs:<5} {p.name:<12} {ms * 1e3:8.2f} us "
                  f"{rows[-1]['GB/s']:7.1f} GB/s  stock {stock * 1e3:8.2f} us", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "pixel_programs.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return 0


def _args(xwb):
    x, w, b = xwb
    return x, 32, w, b, 1e-5


if __name__ == "__main__":
    sys.exit(main())
