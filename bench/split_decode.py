"""The VAE decode split by rows over W GPUs (patches/split_decode.py) against the whole decode on each.

    torchrun --nproc_per_node W -m bench.split_decode --out DIR [--models sdxl,flux-dev] [--size 1024]

Per model's VAE (random weights from the shipped config, ``patch(vae)``), batch 1 at ``--size``, in
the dtypes its pipelines decode in (SDXL's fp32 too: its pipeline upcasts the VAE, ``force_upcast``):
``whole`` (every process decodes the whole image, eagerly: as the SDXL pipeline decodes, its weights
moved every call), ``whole+graph`` (the same replayed from a CUDA graph: as the patched SD3, PixArt-Σ and
FLUX pipelines decode), ``split`` (``enable_split_decode``: each process its 1/W of the rows, the image
all-gathered; eager, as under ``parallel="cfg"``) and ``split+graph`` (the split decode captured with
its collectives, as under ``SD_KERNELS_GRAPH_COLLECTIVES=1``). ``ms``: the median of ``--calls`` calls,
each from a barrier to the slowest process's end; ``vs_whole``: over ``whole+graph`` (for SDXL's
pipeline compare ``split`` with ``whole``); ``max_abs_diff`` and ``psnr_db`` of the split image against
the whole one (images in [-1, 1]). Appends DIR/split-decode.csv (first process); ``--profile`` also
writes each eager variant's device time per kernel category (bench.parallel's ``profiled``).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys

import torch
import torch.distributed as dist

from bench import common

COLUMNS = ["model", "size", "dtype", "world", "variant", "ms", "vs_whole", "max_abs_diff", "psnr_db", "device",
           "torch", "triton", "diffusers", "date"]
DTYPES = {"sd15": ("float16",), "sdxl": ("float16", "float32"), "flux-dev": ("bfloat16",),
          "sd3-medium": ("float16",), "pixart-sigma": ("float16",)}


def rows_of(model: str, dtypes: tuple[str, ...], size: int, calls: int, world: int, stamp: dict,
            device: str = "cuda", profile_dir: pathlib.Path | None = None) -> list[dict]:
    """The rows of ``model``'s VAE in each of ``dtypes`` (module docstring; off CUDA no ``whole+graph``).
    ``profile_dir``: each eager variant profiled once more (bench.parallel's ``profiled``)."""
    rows = []
    for name in dtypes:
        base = {"model": model, "size": size, "dtype": name, "world": world, **stamp}
        prefix = None if profile_dir is None else profile_dir / f"profile-split-decode-{model}-{name}-W{world}"
        rows += _rows(model, getattr(torch, name), size, calls, base, device, prefix)
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def _rows(model: str, dtype: torch.dtype, size: int, calls: int, base: dict, device: str,
          profile_prefix: pathlib.Path | None = None) -> list[dict]:
    import sd_kernels
    from bench.parallel import _timed_ms, profiled
    from sd_kernels import models
    from sd_kernels.testing import psnr

    torch.manual_seed(0)  # the same random weights on every process
    vae = models.build_model(model, "vae", device, dtype).eval()
    sd_kernels.patch(vae, cuda_graph=False)
    factor = 2 ** (len(vae.config.block_out_channels) - 1)
    z = torch.randn(1, vae.config.latent_channels, size // factor, size // factor,
                    generator=torch.Generator().manual_seed(0)).to(device, dtype)  # alike on every process

    def decode():
        return vae.decode(z, return_dict=False)[0]

    def timed(variant: str, fn) -> float:
        ms = statistics.median(_timed_ms(fn) for _ in range(calls))
        if profile_prefix is not None and not variant.endswith("+graph"):
            profiled(fn, profile_prefix.with_name(f"{profile_prefix.name}-{variant}.json"))
        return ms

    with torch.no_grad():
        whole = decode().float()
        times = {"whole": timed("whole", decode)}
        if device == "cuda":
            replay = common.graphed(decode)
            times["whole+graph"] = timed("whole+graph", replay)
            del replay
        sd_kernels.enable_split_decode(vae)
        split = decode().float()
        times["split"] = timed("split", decode)
        if device == "cuda":  # its warm-up calls agree on the split's form; the replays run its collectives
            replay = common.graphed(decode)
            times["split+graph"] = timed("split+graph", replay)
            del replay
            torch.cuda.synchronize()
    sd_kernels.unpatch(vae)
    reference = times.get("whole+graph", times["whole"])
    rows = []
    for variant, ms in times.items():
        row = {**base, "variant": variant, "ms": round(ms, 2), "vs_whole": round(ms / reference, 3)}
        if variant == "split":  # the replayed split runs the same kernels
            row.update(max_abs_diff=f"{float((split - whole).abs().max()):.2e}",
                       psnr_db=round(float(psnr(split.clamp(-1, 1) / 2 + 0.5, whole.clamp(-1, 1) / 2 + 0.5)), 2))
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=pathlib.Path, required=True)
    ap.add_argument("--models", default="sdxl,flux-dev")
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--profile", action="store_true", help="profile the eager variants once more each "
                    "(DIR/profile-split-decode-<model>-<dtype>-W<W>-<variant>.json: device time per kernel category)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or "RANK" not in os.environ:
        print("bench.split_decode runs on CUDA GPUs under torchrun (torchrun --nproc_per_node W -m bench.split_decode "
              "...)", file=sys.stderr)
        return 2
    if unknown := [m for m in args.models.split(",") if m not in DTYPES]:
        ap.error(f"--models: no VAE decode dtypes known for {unknown}; choose from {', '.join(DTYPES)}")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("cpu:gloo,cuda:nccl")
    env = common.environment()
    stamp = {k: env.get(k, "") for k in ("device", "torch", "triton", "diffusers", "date")}
    args.out.mkdir(parents=True, exist_ok=True)
    for model in args.models.split(","):
        rows = rows_of(model, DTYPES[model], args.size, args.calls, dist.get_world_size(), stamp,
                       profile_dir=args.out if args.profile else None)
        if dist.get_rank() == 0:
            common.append_csv(args.out / "split-decode.csv", rows, COLUMNS)
            print(common.format_table(rows, COLUMNS[:9]), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
