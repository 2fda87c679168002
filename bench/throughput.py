"""Batch generation throughput: ``sd-kernels generate --prompts`` as a user runs it, images/s at batch
size 1 and batched.

    python -m bench.throughput --out DIR                 # CUDA: SD1.5 512², 20 steps, 64 prompts, batch 1 and 8
    python -m bench.throughput --out DIR --quick         # anywhere: the tiny model, 2 steps, 6 prompts, batch 1 and 2
    accelerate launch --multi_gpu --num_processes 2 -m bench.throughput --out DIR    # the same over two GPUs

Each batch size is one ``sd_kernels.generate_images`` run (``patch(pipe)``'s defaults: on a GPU every
model call from CUDA graphs) into an empty temporary folder beside the CSV, removed afterwards: the
pipeline built and patched, each image encoded as PNG and written by the writer thread while the
next call runs, the manifest appended. One row per batch size in ``DIR/throughput.csv``:

- ``setup_s``: building and patching the pipeline (random weights from the shipped config);
- ``first_call_s``: the first pipeline call (kernel tuning or the shipped choices, graph capture);
- ``steady_images_per_s``: images after the first call per second of the calls and of waiting for the
  writer (the slowest process's, under accelerate);
- ``images_per_s``: all images over the whole run's wall time (``wall_s``: set-up, first call and the
  checks before them included; the first row's also the imports of diffusers' pipelines);
- ``writer_s``: seconds the writer thread spent encoding and writing (off the GPU's path);
- the images, the device and the versions.

Prints the rows as a table. On an H100 the default run takes about two minutes, most of it set-up.
"""

from __future__ import annotations

import argparse
import datetime
import pathlib
import shutil
import sys
import tempfile
import time

FIELDS = ["model", "size", "steps", "prompts", "batch_size", "processes", "status", "images", "failed", "setup_s",
          "first_call_s", "steady_images_per_s", "images_per_s", "wall_s", "writer_s", "device", "torch", "triton",
          "diffusers", "sd_kernels", "date"]
SUBJECTS = ("an astronaut riding a horse", "a lighthouse at dusk", "a bowl of ramen", "a red fox in snow",
            "a city street in the rain", "a watercolor of a mountain lake", "a robot reading a book",
            "a field of sunflowers")


def prompts(n: int) -> list[str]:
    """``n`` different prompts."""
    return [f"{SUBJECTS[i % len(SUBJECTS)]}, study {i // len(SUBJECTS) + 1}" for i in range(n)]


def measure(model: str, size: int, steps: int, n: int, batch_size: int, work: pathlib.Path,
            device: str | None) -> dict:
    """One generate run at ``batch_size`` into a new folder under ``work``."""
    import sd_kernels

    t = time.perf_counter()
    summary = sd_kernels.generate_images(prompts(n), work / f"batch-{batch_size}", model=model, size=size,
                                         steps=steps, batch_size=batch_size, device=device, progress=False)
    wall = time.perf_counter() - t
    steady = [p.steady_images_per_s for p in summary.processes if p.steady_images_per_s]
    procs = summary.processes
    return {"model": model, "size": size, "steps": steps, "prompts": n, "batch_size": batch_size,
            "processes": len(procs), "status": "ok" if not summary.failed else "failed",
            "images": summary.written, "failed": summary.failed,
            "setup_s": round(max(p.setup_s for p in procs), 2), "first_call_s": round(max(p.first_s for p in procs), 2),
            # every process makes its share at its own rate: the run's is their sum
            "steady_images_per_s": round(sum(steady), 2) if len(steady) == len(procs) else "",
            "images_per_s": round(summary.written / wall, 2), "wall_s": round(wall, 1),
            "writer_s": round(sum(p.writer_s for p in procs), 2), "_summary": summary}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=pathlib.Path, help="folder for throughput.csv (default "
                    "bench-results/DATE-throughput)")
    ap.add_argument("--quick", action="store_true", help="the tiny model, 2 steps, 6 prompts, batch 1 and 2 (CPU)")
    ap.add_argument("--model", help="shipped config or model path (default sd15; tiny with --quick)")
    ap.add_argument("--size", type=int, help="image side (default: the model's)")
    ap.add_argument("--steps", type=int, help="denoising steps (default 20; 2 with --quick)")
    ap.add_argument("--prompts", type=int, help="prompts (default 64; 6 with --quick)")
    ap.add_argument("--batch-sizes", help="comma-separated (default 1,8; 1,2 with --quick)")
    ap.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda if available")
    args = ap.parse_args(argv)
    quick = args.quick
    model = args.model or ("tiny" if quick else "sd15")
    steps = args.steps or (2 if quick else 20)
    n = args.prompts or (6 if quick else 64)
    sizes = [int(b) for b in (args.batch_sizes or ("1,2" if quick else "1,8")).split(",")]
    import torch

    if not quick and args.device != "cpu" and not torch.cuda.is_available():
        print("bench.throughput measures a CUDA GPU; --quick runs the tiny model anywhere", file=sys.stderr)
        return 2
    from bench import common
    from sd_kernels import __version__, models

    size = args.size or models.image_side(model)
    out = args.out or pathlib.Path(f"bench-results/{datetime.date.today().isoformat()}-throughput")
    out.mkdir(parents=True, exist_ok=True)
    env = {**common.environment(), "sd_kernels": __version__}
    rows = []
    work = pathlib.Path(tempfile.mkdtemp(prefix="throughput-", dir=out))
    try:
        for batch_size in sizes:
            row = {**measure(model, size, steps, n, batch_size, work, args.device), **env}
            summary = row.pop("_summary")
            if not summary.main:
                continue
            rows.append(row)
            common.append_csv(out / "throughput.csv", [row], FIELDS)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if rows:
        print(common.format_table(rows, ["model", "size", "steps", "batch_size", "processes", "images", "setup_s",
                                         "first_call_s", "steady_images_per_s", "images_per_s", "writer_s"]))
        print(f"{rows[0]['device']}, torch {rows[0]['torch']}, triton {rows[0]['triton']}, diffusers "
              f"{rows[0]['diffusers']}, {rows[0]['date']}; wrote {out / 'throughput.csv'}")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
