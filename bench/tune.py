"""Regenerate the shipped autotune tables (``sd_kernels/tuning/``) on the GPU at hand.

    python -m bench.tune [--models sd15@512,sd21@768,sdxl@1024] [--batches 1] [--precision fp8] [--out DIR]

Runs each model's patched pipeline eagerly for two steps at each batch size (the UNet at twice the
batch: classifier-free guidance; the VAE decode at the batch), so that every kernel is launched at
every shape the pipeline gives it, with an empty autotune cache and the shipped tables ignored:
every choice is tuned anew on this GPU. ``--precision fp8`` patches with the FP8 tier (models in
bench.fp8's dtypes: FLUX in bf16) and runs each pipeline twice, once per FP8 GEMM kernel (the TMA
kernel, then the pointer kernel: ``fp8_linear.TMA_GEMM``), so that both kernels' tables get every
shape; for example ``--models flux-dev@1024,sd3-medium@1024 --precision fp8``. Then it merges the tuned
files into ``DIR/<profile>/<device slug>/triton-<version>/`` (default DIR: the source tree's
sd_kernels/tuning), replacing entries of the same key and dropping files made for another version of
a kernel. Each key also keeps the time of every config timed for it, from which a later size takes a
tie (a config within 10% + 2 µs of the choice: ``autotune_cache.TIE``) where that is compiled already and
the choice is not. Commit what it writes; tests/test_launch.py checks that the tables parse and match the
kernels' sources.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import sys
import tempfile
import time
from unittest import mock

import torch

DEFAULT_MODELS = "sd15@512,sd21@768,sdxl@1024"
ROOT = pathlib.Path(__file__).resolve().parents[1]


def fp8_gemm_kernels(precision: str | None) -> list[bool | None]:
    """The values of ``fp8_linear.TMA_GEMM`` to tune under: both FP8 GEMM kernels for the FP8 tier, the
    switch left as it is (None) otherwise."""
    return [True, False] if precision == "fp8" else [None]


def _tma_gemm(value: bool | None):
    """``fp8_linear.TMA_GEMM`` set to ``value`` for a block (None: left alone)."""
    import importlib

    fp8_linear = importlib.import_module("sd_kernels.ops.fp8_linear")  # the package's fp8_linear is the op
    return contextlib.nullcontext() if value is None else mock.patch.object(fp8_linear, "TMA_GEMM", value)


def tune(models: str, batches: list[int], out: pathlib.Path, precision: str | None = None) -> list[pathlib.Path]:
    """Tune every kernel at the shapes of ``models`` × ``batches`` (patched at ``precision``); merge into
    ``out``; the files written."""
    import sd_kernels
    from bench.e2e import PROMPT, parse_targets
    from bench.fp8 import DTYPES
    from sd_kernels import models as shipped_models
    from sd_kernels import profiles
    from sd_kernels.runtime import autotune_cache

    cache = pathlib.Path(tempfile.mkdtemp(prefix="sd-kernels-tune-"))
    os.environ[autotune_cache.CACHE_ENV] = str(cache)
    os.environ[autotune_cache.SHIPPED_ENV] = "0"
    autotune_cache.MODE = "time"  # every key is timed (no table read, no nearest-key rule)
    for target in parse_targets(models):
        start = time.perf_counter()
        dtype = DTYPES.get(target.model, torch.float16) if precision == "fp8" else torch.float16
        pipe = shipped_models.load_pipeline(target.model, device="cuda", dtype=dtype)
        pipe.set_progress_bar_config(disable=True)
        for tma in fp8_gemm_kernels(precision):
            with _tma_gemm(tma), sd_kernels.patched(pipe, cuda_graph=False, precision=precision), \
                    torch.inference_mode():
                for batch in batches:
                    pipe(PROMPT, num_inference_steps=2, height=target.size, width=target.size,
                         num_images_per_prompt=batch, output_type="pt")
        print(f"bench.tune: {target.label} batches {batches}: {time.perf_counter() - start:.1f} s", flush=True)
        del pipe
        torch.cuda.empty_cache()
    device = torch.device("cuda")
    where = pathlib.Path(autotune_cache.device_slug(device), f"triton-{autotune_cache.TRITON_VERSION}")
    tuned, dest = cache / where, out / profiles.active_profile().name / where
    return [merge(path, dest / path.name) for path in sorted(tuned.glob("*.json"))]


def merge(new: pathlib.Path, dest: pathlib.Path) -> pathlib.Path:
    """``new``'s entries over ``dest``'s, where both were made for the same kernel source."""
    data = json.loads(new.read_text())
    if dest.exists():
        old = json.loads(dest.read_text())
        if old.get("fingerprint") == data["fingerprint"] and old.get("format") == data["format"]:
            kept = {k: v for k, v in old.get("timings", {}).items() if k not in data["entries"]}  # retuned: its own
            data["entries"] = {**old["entries"], **data["entries"]}
            data["timings"] = {**kept, **data.get("timings", {})}
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return dest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=DEFAULT_MODELS, help=f"NAME@SIZE, comma-separated (default {DEFAULT_MODELS})")
    ap.add_argument("--batches", default="1", help="images per prompt, comma-separated (default 1)")
    ap.add_argument("--precision", choices=("fp16", "fp8"), default=None,
                    help="patch at this precision (default: the patch's own, lossless); fp8: both FP8 GEMM kernels")
    ap.add_argument("--out", type=pathlib.Path, default=ROOT / "sd_kernels" / "tuning",
                    help="tables root (default: the source tree's sd_kernels/tuning)")
    args = ap.parse_args(argv)
    try:
        batches = [int(b) for b in args.batches.split(",") if b.strip()]
    except ValueError:
        ap.error(f"--batches: expected whole numbers, got {args.batches!r}")
    if not batches or min(batches) < 1:
        ap.error("--batches: give at least one positive batch size")
    if not torch.cuda.is_available():
        print("bench.tune tunes kernels on a CUDA GPU; none here", file=sys.stderr)
        return 2
    for path in tune(args.models, batches, args.out, args.precision):
        print(f"wrote {path} ({len(json.loads(path.read_text())['entries'])} entries)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
