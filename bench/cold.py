"""The first image on a fresh machine, and the first image at each new size or batch after it: from
``patch(pipe)`` to the first image in a new process with empty caches (sd-kernels' autotune cache,
Triton's and inductor's kernel caches), then, in the same process, each further shape's first call.

    python -m bench.cold --out DIR [--models sd15@512,sd21@768,sdxl@1024] [--steps 20] [--first-only]
    python -m bench.cold --out DIR --runs "sd15@640x448x3+768x512x2+640x640;sdxl@1216x832x2" [--autotune 1]

``--models``: one process per model at its square size; the first model is also measured with the
shipped tables off and with the parallel precompile off. ``--runs``: one process per run (``;``), each
run a model and its shapes (``+``): ``WxH`` or ``WxHxB`` (B images per prompt) or a square side; the
first shape is the process's cold start, each later one a new shape in a warm process; a model
``NAME+controlnet`` is the shipped config's ControlNet pipeline (a random conditioning image).

One row per (run, shape) in ``DIR/cold.csv``: ``build_s`` (the random-weight pipeline), ``first_s`` (the
first shape: ``patch(pipe)`` with its defaults and one image; a later shape: its first image;
synchronized, everything included), ``warm_ms`` (the median of 3 more images at that shape), and what
the first image spent: ``compiles`` / ``compile_s`` (Triton kernels compiled and the seconds spent,
summed over the threads that compiled them, sd-kernels' and inductor's kernels alike), ``precompiled`` /
``precompile_s`` (compiled ahead by the parallel precompile, and the wall seconds of its dry runs and
thread pools; ``dry_s``: the dry runs alone; ``processes``: compiler processes that took kernels, summed
over the precompiles, under ``SD_KERNELS_COMPILE_PROCESSES``), ``capture_s`` (CUDA-graph capture with
its warm-up calls, less the compilations inside them), ``tunings`` / ``tuning_s`` (configs timed by
Triton's autotuner and the seconds, compilations left out: keys no table holds under
``SD_KERNELS_AUTOTUNE=1``), ``ruled`` (keys that took the nearest tuned key's choice:
sd_kernels/runtime/tuning_rule.py), ``tied`` (keys that took a kernel compiled already instead of
their choice's: a config within 10% + 2 µs of it at tuning, or a relaxed heuristic;
``Launcher._compiled_choice``), ``late_compiles`` (kernels compiled outside the precompile pool, by
name), ``compiled`` (every kernel compiled, by name), and the environment. ``--specs`` also writes
``DIR/specs.jsonl``: each compilation's kernel, constants, attributes and options, per shape (what a
new size compiled, and why). FLUX runs in bf16, the others in fp16.
"shipped off" (``--models``' first model) sets SD_KERNELS_SHIPPED_TUNING=0: what a GPU of another
architecture than the tables' pays; "precompile off" sets SD_KERNELS_PRECOMPILE=0.
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
import threading
import time

FIELDS = ["model", "shape", "order", "shipped", "precompile", "autotune", "status", "build_s", "first_s", "compiles",
          "compile_s", "precompiled", "precompile_s", "capture_s", "tunings", "tuning_s", "ruled", "late_compiles",
          "compiled", "warm_ms", "cuda_graph", "device", "torch", "triton", "diffusers", "date",
          "dry_s", "processes", "tied"]  # columns added since: last, so rows appended to an older cold.csv stay aligned


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
        name = getattr(getattr(src, "fn", None), "__name__", "?")
        ALL[name] += 1
        options = kwargs.get("options") or (args[1] if len(args) > 1 else None) or {}
        SPECS.append({"kernel": name, "signature": repr(getattr(src, "signature", None)),
                      "constants": repr(getattr(src, "constants", None)),
                      "attrs": repr(getattr(src, "attrs", None)),
                      "options": {k: options.get(k) for k in ("num_warps", "num_stages", "num_ctas", "maxnreg")
                                  if isinstance(options, dict)}})
        if not threading.current_thread().name.startswith("sd-kernels-compile"):
            late[name] += 1
        return inner(src, *args, **kwargs)

    triton.compiler.compile = named
    return Stopwatch(triton.compiler, "compile"), late


ALL: collections.Counter = collections.Counter()  # every compilation by kernel name (compile_watch)
SPECS: list[dict] = []  # every compilation's specialization (constexprs, attributes, options), in order
SPECS_ENV = "SD_KERNELS_COLD_SPECS"  # a file the child appends SPECS to, one JSON line per compilation
# what tells one run's spec lines from another's in the same file (the settings measure() varies)
RUN = {k: os.environ.get(k, "") for k in ("SD_KERNELS_SHIPPED_TUNING", "SD_KERNELS_PRECOMPILE", "SD_KERNELS_AUTOTUNE",
                                          "SD_KERNELS_COMPILE_PROCESSES")}


def parse_shape(text: str) -> tuple[int, int, int]:
    """``"640x448x3"`` → (640, 448, 3); ``"768x512"`` → (768, 512, 1); ``"512"`` → (512, 512, 1)."""
    try:
        parts = [int(p) for p in text.lower().split("x")]
    except ValueError:
        parts = []
    if len(parts) == 1:
        parts = [parts[0], parts[0], 1]
    elif len(parts) == 2:
        parts.append(1)
    if len(parts) != 3 or min(parts) < 1 or parts[0] % 8 or parts[1] % 8:
        raise ValueError(f"shape {text!r}: expected WxH or WxHxB (multiples of 8 pixels), or a square side")
    return parts[0], parts[1], parts[2]


def parse_runs(text: str) -> list[tuple[str, list[tuple[int, int, int]]]]:
    """``"sd15@640x448x3+768x512;sdxl@1216x832x2"`` → [(model, shapes), ...]."""
    runs = []
    for item in filter(None, (t.strip() for t in text.split(";"))):
        model, _, shapes = item.partition("@")
        if not model or not shapes:
            raise ValueError(f"--runs: {item!r}: expected MODEL@SHAPE[+SHAPE...]")
        runs.append((model, [parse_shape(s) for s in shapes.split("+")]))
    if not runs:
        raise ValueError("--runs: no run given")
    return runs


def label(shape: tuple[int, int, int]) -> str:
    return "x".join(map(str, shape))


def child(model: str, shapes: list[tuple[int, int, int]], steps: int) -> list[dict]:
    """Runs in the fresh process: build, patch, each shape's first image and warm images."""
    compiles, late = compile_watch()  # before the kernels are defined
    import torch
    from sd_kernels.patches import cuda_graph  # the installed module the patch uses (not the source tree's)
    from triton.runtime import autotuner

    import sd_kernels
    from bench.e2e import CONTROLNET, PROMPT
    from sd_kernels import models
    from sd_kernels.analysis.selection import launchers
    from sd_kernels.runtime import precompile

    captures = Stopwatch(cuda_graph, "capture", exclude=compiles)  # its warm-up call compiles
    tunings = Stopwatch(autotuner.Autotuner, "_bench", exclude=compiles)  # one call per config timed
    reports = []
    dry_run = precompile.precompile
    precompile.precompile = lambda *a, **k: reports.append(dry_run(*a, **k)) or reports[-1]  # what cuda_graph calls
    kernels = launchers()

    def counters() -> dict:
        done = [r for r in reports if r is not None]
        return {"compiles": compiles.calls, "compile_s": compiles.seconds, "capture_s": captures.seconds,
                "tunings": tunings.calls, "tuning_s": tunings.seconds,
                "precompiled": sum(r.compiled for r in done),
                "precompile_s": sum(r.dry_s + r.compile_s for r in done),
                "dry_s": sum(r.dry_s for r in done),
                "processes": sum(getattr(r, "processes", 0) for r in done),
                "ruled": sum(len(k.ruled) for k in kernels.values()),
                "tied": sum(len(k.tied) for k in kernels.values())}

    t = time.perf_counter()
    base = model.removesuffix(CONTROLNET)
    dtype = torch.bfloat16 if base.startswith("flux") else torch.float16  # FLUX's own dtype (fp16 overflows)
    pipe = (models.build_controlnet_pipeline(base, device="cuda", dtype=dtype) if base != model else
            models.load_pipeline(model, device="cuda", dtype=dtype))
    pipe.set_progress_bar_config(disable=True)
    torch.cuda.synchronize()
    build = time.perf_counter() - t

    def image(shape) -> float:
        width, height, batch = shape
        extra = {} if base == model else {  # the ControlNet's conditioning image, at the image's size
            "image": torch.rand(1, 3, height, width, device="cuda", dtype=torch.float16,
                                generator=torch.Generator("cuda").manual_seed(1))}
        torch.cuda.synchronize()
        start = time.perf_counter()
        pipe(PROMPT, num_inference_steps=steps, height=height, width=width, num_images_per_prompt=batch,
             output_type="pt", generator=torch.Generator("cuda").manual_seed(0), **extra)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    rows = []
    with torch.inference_mode():
        record = None
        for order, shape in enumerate(shapes, 1):
            before, names, every, specs = counters(), collections.Counter(late), collections.Counter(ALL), len(SPECS)
            t = time.perf_counter()
            if record is None:
                record = sd_kernels.patch(pipe)
            image(shape)
            first = time.perf_counter() - t
            spent = {k: round(v - before[k], 1) if isinstance(v, float) else v - before[k]
                     for k, v in counters().items()}
            warm = statistics.median(image(shape) for _ in range(3))
            if os.environ.get(SPECS_ENV):
                with open(os.environ[SPECS_ENV], "a") as f:
                    f.writelines(json.dumps({"model": model, "shape": label(shape), "order": order, **RUN, **spec})
                                 + "\n" for spec in SPECS[specs:])
            rows.append({"shape": label(shape), "order": order, "build_s": round(build, 1) if order == 1 else "",
                         "first_s": round(first, 1), **spent, "warm_ms": round(warm * 1e3, 1),
                         "cuda_graph": record.cuda_graph,
                         "late_compiles": " ".join(f"{n}:{c}" for n, c in (late - names).most_common()),
                         "compiled": " ".join(f"{n}:{c}" for n, c in (ALL - every).most_common())})
    return rows


def measure(model: str, shapes: list[tuple[int, int, int]], steps: int, shipped: bool = True,
            precompile: bool = True, autotune: str = "rule", cache: str | None = None,
            specs: pathlib.Path | None = None) -> list[dict]:
    """``child`` in a new process with empty caches (``cache``: this autotune cache instead); its rows.
    ``specs``: a file the child appends each compilation's specialization to (``--specs``)."""
    with tempfile.TemporaryDirectory(prefix="sd-kernels-cold-") as tmp:
        env = {**os.environ, "SD_KERNELS_AUTOTUNE_CACHE": cache or f"{tmp}/autotune",
               "TRITON_CACHE_DIR": f"{tmp}/triton", "TORCHINDUCTOR_CACHE_DIR": f"{tmp}/inductor",
               "SD_KERNELS_SHIPPED_TUNING": "1" if shipped else "0",
               "SD_KERNELS_PRECOMPILE": "1" if precompile else "0",
               "SD_KERNELS_AUTOTUNE": autotune, SPECS_ENV: str(specs or "")}
        proc = subprocess.run([sys.executable, "-m", "bench.cold", "--child", f"{model}@{'+'.join(map(label, shapes))}",
                               "--steps", str(steps)], env=env, capture_output=True, text=True)
    row = {"model": model, "shipped": "on" if shipped else "off", "precompile": "on" if precompile else "off",
           "autotune": autotune}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("[")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1][:200]
        return [{**row, "shape": label(shapes[0]), "order": 1, "status": f"error: {tail}"}]
    return [{**row, **r, "status": "ok"} for r in json.loads(lines[-1])]


def say(row: dict) -> str:
    where = "cold" if row["order"] == 1 else "new shape, warm process"
    head = (f"  {row['model']:<12} {row['shape']:<11} shipped {row['shipped']:<3} precompile {row['precompile']:<3} "
            f"autotune {row['autotune']:<5} {where}: ")
    if row["status"] != "ok":
        return head + row["status"]
    build = f"build {row['build_s']} s, " if row["order"] == 1 else ""
    return head + (f"{build}first image {row['first_s']} s ({row['compiles']} Triton compiles, {row['compile_s']} s; "
                   f"{row['precompiled']} ahead in {row['precompile_s']} s (dry run {row.get('dry_s', '?')} s); "
                   f"capture {row['capture_s']} s; "
                   f"{row['tunings']} configs timed, {row['tuning_s']} s; {row['ruled']} keys by rule, "
                   f"{row.get('tied', 0)} by a compiled tie), "
                   f"warm {row['warm_ms']} ms; compiled {row.get('compiled') or 'nothing'}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=pathlib.Path, help="folder for cold.csv")
    ap.add_argument("--models", default="sd15@512,sd21@768,sdxl@1024")
    ap.add_argument("--runs", help="MODEL@SHAPE[+SHAPE...];...: shapes in one process each run (see above)")
    ap.add_argument("--autotune", default="rule", help="SD_KERNELS_AUTOTUNE for --runs (rule, 1 or 0)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--first-only", action="store_true", help="the first model only")
    ap.add_argument("--specs", action="store_true",
                    help="also write specs.jsonl: each compilation's kernel, constexprs, attributes and options, "
                         "per shape (what made a new size compile)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        model, shapes = parse_runs(args.child)[0]
        print(json.dumps(child(model, shapes, args.steps)))
        return 0
    if args.out is None:
        ap.error("--out is required")
    from bench import common
    from bench.e2e import parse_targets

    if args.runs:
        try:
            plan = [(model, shapes, True, True) for model, shapes in parse_runs(args.runs)]
        except ValueError as exc:
            ap.error(str(exc))
    else:
        targets = parse_targets(args.models)
        plan = []
        for i, t in enumerate(targets[:1] if args.first_only else targets):
            for shipped, precompile in ((True, True), (True, False), (False, True)) if i == 0 else ((True, True),):
                plan.append((t.model, [(t.size, t.size, 1)], shipped, precompile))
    env = common.environment()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "cold.csv"
    status = 0
    for model, shapes, shipped, precompile in plan:
        for row in measure(model, shapes, args.steps, shipped, precompile, args.autotune if args.runs else "rule",
                           specs=args.out / "specs.jsonl" if args.specs else None):
            status |= row["status"] != "ok"
            print(say(row), flush=True)
            common.append_csv(path, [{**row, **{k: env.get(k, "") for k in FIELDS if k in env}}], FIELDS)
    return status


if __name__ == "__main__":
    sys.exit(main())
