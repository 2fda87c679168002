"""The ``sd-kernels`` command: ``info``, ``demo`` and ``fidelity``."""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import sys
import time
from collections.abc import Sequence

DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("sd-kernels", "torch", "triton", "diffusers", "transformers", "accelerate"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def cmd_info(args: argparse.Namespace) -> int:
    import torch

    from sd_kernels import dispatch, profiles

    for k, v in _versions().items():
        print(f"{k:>14}: {v}")
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        print(f"{'device':>14}: {p.name} (sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, "
              f"{p.total_memory / 2**30:.1f} GiB)")
    else:
        print(f"{'device':>14}: CPU only ({os.cpu_count()} cores)")
    print(f"{'interpreter':>14}: {'on' if dispatch.interpreting() else 'off'} (TRITON_INTERPRET)")
    print(f"{'backend':>14}: {dispatch.backend()} (SD_KERNELS_BACKEND)")
    prof = profiles.get_profile(args.profile)
    print(f"{'profile':>14}: {prof.name} — {prof.description}")
    print(f"{'profiles':>14}: {', '.join(profiles.list_profiles())}")
    return 0


def _default_model(device: str) -> str:
    return "sd15" if device == "cuda" else "tiny"


def cmd_demo(args: argparse.Namespace) -> int:
    import torch

    import sd_kernels
    from sd_kernels import models
    from sd_kernels.testing import psnr

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("sd-kernels demo: --device cuda asked for, but torch sees no CUDA GPU")
    name = args.model or _default_model(device)
    dtype_name = args.dtype or ("fp16" if device == "cuda" else "fp32")
    dtype = getattr(torch, DTYPES[dtype_name])
    cfg = models.load_config(name) if name in models.list_configs() else {"resolution": args.size or 512}
    size = args.size or cfg["resolution"]
    print(f"sd-kernels demo: {name} ({'random weights' if name in models.list_configs() else 'loaded'}), "
          f"{size}x{size}, {args.steps} steps, {dtype_name} on {device}")
    t0 = time.perf_counter()
    pipe = models.load_pipeline(name, device=device, dtype=dtype, seed=args.seed)
    print(f"built the pipeline in {time.perf_counter() - t0:.1f} s")

    def run() -> tuple[object, float]:
        gen = torch.Generator(device="cpu").manual_seed(args.seed)
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = pipe(args.prompt, num_inference_steps=args.steps, height=size, width=size, generator=gen,
                   output_type="np")
        if device == "cuda":
            torch.cuda.synchronize()
        return out.images[0], time.perf_counter() - t

    if device == "cuda":
        run()  # warm-up: cuDNN autotuning and Triton compilation stay out of the timings
    stock_img, stock_s = run()
    print(f"stock:   {stock_s * 1e3:9.1f} ms")
    result_img, result_s = stock_img, stock_s
    if not args.no_patch:
        record = sd_kernels.patch(pipe)
        print(record.summary())
        if device == "cuda":
            run()
        result_img, result_s = run()
        print(f"patched: {result_s * 1e3:9.1f} ms  ({stock_s / result_s:.2f}x), "
              f"PSNR vs stock {psnr(result_img, stock_img):.1f} dB")
        sd_kernels.unpatch(pipe)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    from diffusers.utils import numpy_to_pil

    numpy_to_pil(result_img[None])[0].save(out)
    print(f"wrote {out}")
    return 0


def cmd_fidelity(args: argparse.Namespace) -> int:
    import torch

    from sd_kernels import models
    from sd_kernels.fidelity import check_fidelity

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    name = args.model or _default_model(device)
    dtype = getattr(torch, DTYPES[args.dtype or ("fp16" if device == "cuda" else "fp32")])
    pipe = models.load_pipeline(name, device=device, dtype=dtype, seed=args.seed)
    pipe.set_progress_bar_config(disable=True)
    result = check_fidelity(pipe, steps=args.steps, seed=args.seed, prompt=args.prompt, size=args.size,
                            ops=args.ops, per_op=not args.no_per_op, cuda_graph=args.cuda_graph,
                            profile=args.profile)
    print(result.format())
    return 0 if result.ok(args.max_latent_err, args.min_psnr) else 1


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="sd-kernels", description="Triton kernels for Stable Diffusion in diffusers")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    info = sub.add_parser("info", help="versions, device and the active profile")
    info.add_argument("--profile", help="show this profile instead of the detected one")
    info.set_defaults(fn=cmd_info)
    demo = sub.add_parser("demo", help="run a random-weight SD pipeline stock and patched, write a PNG")
    demo.add_argument("--model", help="shipped config (tiny, sd15, sd21, sdxl, ...) or a local pipeline "
                      "directory; default: sd15 on a GPU, tiny on CPU")
    demo.add_argument("--steps", type=_positive_int, default=20, help="denoising steps (default 20)")
    demo.add_argument("--size", type=_positive_int, help="image side in pixels (default: the model's)")
    demo.add_argument("--dtype", choices=sorted(DTYPES), help="default: fp16 on a GPU, fp32 on CPU")
    demo.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda if available")
    demo.add_argument("--prompt", default="a photograph of an astronaut riding a horse")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--out", default="demo.png", help="PNG to write (default demo.png)")
    demo.add_argument("--no-patch", action="store_true", help="run stock only")
    demo.set_defaults(fn=cmd_demo)
    fid = sub.add_parser("fidelity", help="stock vs patched with the same weights and seed: latent error, "
                         "image PSNR, per op family; exit status 1 past the limits")
    fid.add_argument("--model", help="shipped config or a local pipeline directory (default: sd15 on a GPU, "
                     "tiny on CPU)")
    fid.add_argument("--steps", type=_positive_int, default=20, help="denoising steps (default 20)")
    fid.add_argument("--size", type=_positive_int, help="image side in pixels (default: the model's)")
    fid.add_argument("--dtype", choices=sorted(DTYPES), help="default: fp16 on a GPU, fp32 on CPU")
    fid.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda if available")
    fid.add_argument("--ops", nargs="+", help="op families to patch (default: all)")
    fid.add_argument("--profile", help="profile name (default: detected)")
    fid.add_argument("--cuda-graph", action="store_true", help="patch with cuda_graph=True")
    fid.add_argument("--no-per-op", action="store_true", help="skip the one-family-at-a-time runs")
    fid.add_argument("--prompt", default="a photograph of an astronaut riding a horse")
    fid.add_argument("--seed", type=int, default=0)
    fid.add_argument("--max-latent-err", type=float, default=1e-2, help="limit on the latent rel. error (1e-2)")
    fid.add_argument("--min-psnr", type=float, default=40.0, help="limit on the image PSNR in dB (40)")
    fid.set_defaults(fn=cmd_fidelity)
    return ap


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"sd-kernels {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
