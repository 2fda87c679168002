"""The first image on a fresh machine: from ``patch(pipe)`` to the first image, in a new process with
empty caches (sd-kernels' autotune cache, Triton's and inductor's kernel caches), then the warm image.

    python -m bench.cold --out DIR [--models sd15@512,sd21@768,sdxl@1024] [--steps 20] [--first-only]

One row per (model, shipped tables on/off, parallel precompile on/off) in ``DIR/cold.csv``:
``build_s`` (the random-weight pipeline), ``cold_s`` (``patch(pipe)`` with its defaults, then one
20-step image, synchronized: kernel tuning or the shipped choices, Triton compilation, cuDNN set-up
and graph capture included), ``warm_ms`` (the median of 3 more images), ``compiles`` / ``compile_s``
(Triton kernels compiled during the cold part and the seconds spent compiling them, summed over the
threads that compiled them, in sd-kernels' and inductor's kernels alike; empty where Triton's JIT
cannot be hooked), ``capture_s`` (CUDA-graph capture with its warm-up calls, less the compilations
inside them), ``precompiled`` / ``precompile_s`` (kernels the parallel precompile compiled ahead of
the captures, and the wall seconds of its dry runs and thread pools), ``late_compiles`` (the kernels
compiled outside that pool, by name: autotuning, or what a dry run could not record), and the
environment.
"shipped off" sets SD_KERNELS_SHIPPED_TUNING=0: what a GPU without shipped tables (or another
Triton) pays; "precompile off" sets SD_KERNELS_PRECOMPILE=0
(kernels compile one by one at their first launch, as before sd_kernels.runtime.precompile). The first model
is measured with the defaults, then with each switched off; the others with the defaults only
(``--first-only``: the first model alone).
"""

from __future__ import annotations

import argparse
import collections
import csv
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import threading
import time

FIELDS = ["model", "size", "shipped", "precompile", "status", "build_s", "cold_s", "compiles", "compile_s", "capture_s",
          "precompiled", "precompile_s", "late_compiles", "warm_ms", "cuda_graph", "device", "torch", "triton",
          "diffusers", "date"]


class Stopwatch:
    """Seconds and calls of a module function, wrapped in place (``Stopwatch(module, "name")``); the
    seconds another stopwatch (``exclude``) counts meanwhile are left out."""

    def __init__(self, module, name: str, exclude: Stopwatch | None = None) -> None:
        self.calls, self.seconds = 0, 0.0
        inner = getattr(module, name, None)
        self.hooked = inner is not None
        if not self.hooked:
            return

        def timed(*args, **kwargs):
            t, inside = time.perf_counter(), exclude.seconds if exclude else 0.0
            try:
                return inner(*args, **kwargs)
            finally:
                self.calls += 1
                self.seconds += time.perf_counter() - t - ((exclude.seconds if exclude else 0.0) - inside)

        setattr(module, name, timed)


def compile_watch() -> tuple[Stopwatch, collections.Counter]:
    """Triton's JIT looks up ``triton.compiler.compile`` when a kernel is first launched: wrapped
    before any kernel runs, it times every compilation (a hit in Triton's disk cache included), and
    counts by kernel name those made outside the precompile pool's threads (the second value)."""
    import triton.compiler

    late: collections.Counter = collections.Counter()
    inner = triton.compiler.compile

    def named(src, *args, **kwargs):
        if not threading.current_thread().name.startswith("sd-kernels-compile"):
            late[getattr(getattr(src, "fn", None), "__name__", "?")] += 1
        return inner(src, *args, **kwargs)

    triton.compiler.compile = named
    return Stopwatch(triton.compiler, "compile"), late


def child(model: str, size: int, steps: int) -> dict:
    """Runs in the fresh process: build, patch, first image, warm images."""
    compiles, late = compile_watch()  # before the kernels are defined
    import torch
    from sd_kernels.patches import cuda_graph  # the installed module the patch uses (not the source tree's)

    import sd_kernels
    from bench.e2e import PROMPT
    from sd_kernels import models
    from sd_kernels.runtime import precompile

    captures = Stopwatch(cuda_graph, "capture", exclude=compiles)  # its warm-up call compiles
    reports = []
    dry_run = precompile.precompile
    precompile.precompile = lambda *a, **k: reports.append(dry_run(*a, **k)) or reports[-1]  # what cuda_graph calls

    t = time.perf_counter()
    pipe = models.load_pipeline(model, device="cuda", dtype=torch.float16)
    pipe.set_progress_bar_config(disable=True)
    torch.cuda.synchronize()
    build = time.perf_counter() - t

    def image() -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        pipe(PROMPT, num_inference_steps=steps, height=size, width=size, output_type="pt",
             generator=torch.Generator("cuda").manual_seed(0))
        torch.cuda.synchronize()
        return time.perf_counter() - start

    with torch.inference_mode():
        t = time.perf_counter()
        record = sd_kernels.patch(pipe)
        image()
        cold = time.perf_counter() - t
        compiled = (compiles.calls, round(compiles.seconds, 1)) if compiles.hooked else ("", "")
        warm = statistics.median(image() for _ in range(3))
    done = [r for r in reports if r is not None]
    return {"build_s": round(build, 1), "cold_s": round(cold, 1), "compiles": compiled[0], "compile_s": compiled[1],
            "capture_s": round(captures.seconds, 1), "warm_ms": round(warm * 1e3, 1), "cuda_graph": record.cuda_graph,
            "precompiled": sum(r.compiled for r in done),
            "precompile_s": round(sum(r.dry_s + r.compile_s for r in done), 1),
            "late_compiles": " ".join(f"{name}:{n}" for name, n in late.most_common())}


def measure(model: str, size: int, steps: int, shipped: bool = True, precompile: bool = True) -> dict:
    """``child`` in a new process with empty caches; its row."""
    with tempfile.TemporaryDirectory(prefix="sd-kernels-cold-") as tmp:
        env = {**os.environ, "SD_KERNELS_AUTOTUNE_CACHE": f"{tmp}/autotune", "TRITON_CACHE_DIR": f"{tmp}/triton",
               "TORCHINDUCTOR_CACHE_DIR": f"{tmp}/inductor", "SD_KERNELS_SHIPPED_TUNING": "1" if shipped else "0",
               "SD_KERNELS_PRECOMPILE": "1" if precompile else "0"}
        proc = subprocess.run([sys.executable, "-m", "bench.cold", "--child", f"{model}@{size}", "--steps",
                               str(steps)], env=env, capture_output=True, text=True)
    row = {"model": model, "size": size, "shipped": "on" if shipped else "off",
           "precompile": "on" if precompile else "off"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1][:200]
        return {**row, "status": f"error: {tail}"}
    return {**row, **json.loads(lines[-1]), "status": "ok"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=pathlib.Path, help="folder for cold.csv")
    ap.add_argument("--models", default="sd15@512,sd21@768,sdxl@1024")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--first-only", action="store_true", help="the first model only")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        model, _, size = args.child.partition("@")
        print(json.dumps(child(model, int(size), args.steps)))
        return 0
    if args.out is None:
        ap.error("--out is required")
    from bench import common
    from bench.e2e import parse_targets

    env = common.environment()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "cold.csv"
    new = not path.exists()
    status = 0
    targets = parse_targets(args.models)
    for i, target in enumerate(targets[:1] if args.first_only else targets):
        for shipped, precompile in ((True, True), (True, False), (False, True)) if i == 0 else ((True, True),):
            row = measure(target.model, target.size, args.steps, shipped, precompile)
            status |= row["status"] != "ok"
            print(f"  {target.label:<10} shipped {row['shipped']:<3} precompile {row['precompile']:<3} " + (
                f"build {row['build_s']} s, patch to first image {row['cold_s']} s ({row['compiles']} Triton "
                f"compiles, {row['compile_s']} s; {row['precompiled']} ahead in {row['precompile_s']} s; graph capture "
                f"{row['capture_s']} s), warm {row['warm_ms']} ms"
                if row["status"] == "ok" else row["status"]), flush=True)
            with open(path, "a", newline="") as f:
                w = csv.DictWriter(f, fieldnames=FIELDS, restval="", extrasaction="ignore")
                if new:
                    w.writeheader()
                    new = False
                w.writerow({**row, **{k: env.get(k, "") for k in FIELDS if k in env}})
    return status


if __name__ == "__main__":
    sys.exit(main())
