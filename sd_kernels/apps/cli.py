"""The ``sd-kernels`` command: ``info``, ``demo``, ``generate``, ``bench`` and ``fidelity``.

Parsing imports neither torch, Triton nor diffusers (``sd-kernels --help`` answers at once); each
command imports what it runs. The command configures a handler on the ``sd_kernels`` logger, so its
warnings show (the library itself adds none: see docs/generate.md, "Logging").
"""

from __future__ import annotations

import argparse
import logging
import os
import pathlib
import platform
import sys
import time
from collections.abc import Sequence

from sd_kernels.apps import generate_command, metadata
from sd_kernels.apps.generate_command import positive_int
from sd_kernels.apps.options import DTYPES, device_and_dtype

DEFAULT_PROMPT = "a photograph of an astronaut riding a horse"


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

    from sd_kernels import profiles
    from sd_kernels.runtime import dispatch

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
    print(f"{'precision fp8':>14}: {_fp8_here()}")
    prof = profiles.get_profile(args.profile)
    print(f"{'profile':>14}: {prof.name} — {prof.description}")
    print(f"{'profiles':>14}: {', '.join(profiles.list_profiles())}")
    print(f"{'autotune cache':>14}: {_autotune_cache(prof)}")
    print(f"{'untabled keys':>14}: {_untabled(prof)}")
    print()
    for key, value in prof.describe().items():
        if key not in ("name", "description"):
            print(f"{key:>24}: {value}")
    from sd_kernels.analysis.selection import format_table, selection_table, tuning_sources

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    print(f"\nLaunch configurations under {prof.name!r} on this device:")
    for kernel, source in tuning_sources(prof, device):
        print(f"  {kernel}: {source}")
    print(f"\nKernel selection under {prof.name!r} (fp16, SD1.5 shapes; on a device the kernels run on):\n")
    print(format_table(selection_table(prof)))
    if prof.memory_budget_mb is not None:
        print(f"\nThe shipped SD configs' fp16 weights under {prof.name!r}'s budget (checked before any work):\n")
        for line in _budget_lines(prof):
            print(line)
    return 0


def _fp8_here() -> str:
    """Whether ``patch(pipe, precision="fp8")`` can run on this machine's first device, and if not why."""
    import torch

    from sd_kernels.patches.fp8 import check_device

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        check_device(device, "model")
    except RuntimeError as exc:
        return f"no: {exc}"
    return "yes (the FP8 tier, docs/fp8.md)" + (" through Triton's interpreter" if device.type == "cpu" else "")


def _budget_lines(prof) -> list[str]:
    """One plan per shipped SD config, its weights counted on the meta device (no memory used)."""
    import torch

    from sd_kernels.apps.generate import check_budget
    from sd_kernels.runtime.memory import MemoryBudgetExceeded

    lines = []
    for name in ("sd15", "sd21", "sdxl"):
        try:
            lines.append(f"{name}: " + check_budget(name, torch.float16, prof).format())
        except MemoryBudgetExceeded as exc:
            lines.append(f"{name}: does not fit: {exc}")
    return lines


def _autotune_cache(prof) -> str:
    """Where the kernels' tuned choices persist on this machine's device under ``prof``; a path that
    cannot be a folder (a regular file on its way) is flagged."""
    import torch

    from sd_kernels.runtime import autotune_cache

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    directory, why = autotune_cache.cache_dir(device, prof), autotune_cache.cache_root(prof)[1]
    if directory is None:
        return why
    blocked = next((p for p in (pathlib.Path(directory), *pathlib.Path(directory).parents) if p.is_file()), None)
    if blocked is not None:
        return f"{directory} ({why}) -- unusable: {blocked} is a file, so nothing tuned is kept"
    return f"{directory} ({why})"


def _untabled(prof) -> str:
    """How a kernel gets its configuration for a key no table holds (SD_KERNELS_AUTOTUNE)."""
    from sd_kernels.runtime import autotune_cache

    return {"rule": "the nearest tuned key's choice, untimed (SD_KERNELS_AUTOTUNE=1: timed and cached)",
            "time": "timed by the autotuner, kept in the autotune cache (SD_KERNELS_AUTOTUNE=1)",
            "first": "each kernel's first config (SD_KERNELS_AUTOTUNE=0)"}[autotune_cache.MODE]


def _load(args: argparse.Namespace) -> tuple[object, str, str, int]:
    """The pipeline ``args`` ask for, on its device: (pipe, model name, device, image side)."""
    import torch

    from sd_kernels import models
    from sd_kernels.apps.generate import check_backend

    device, dtype_name = device_and_dtype(args.device, args.dtype)
    if getattr(args, "out", None):
        metadata.check_output(args.out, records=False)
    check_backend(device)
    name = args.model or models.default_model(device == "cuda")
    size = models.image_side(name, args.size, "--size")
    weights = "random weights" if name in models.list_configs() else "loaded"
    print(f"sd-kernels {args.command}: {name} ({weights}), {size}x{size}, {args.steps} steps, {dtype_name} on {device}")
    t0 = time.perf_counter()
    pipe = models.load_pipeline(name, device=device, dtype=getattr(torch, DTYPES[dtype_name]), seed=args.seed)
    print(f"built the pipeline in {time.perf_counter() - t0:.1f} s")
    return pipe, name, device, size


def _generate(pipe, args: argparse.Namespace, size: int, device: str) -> tuple[object, float]:
    """One ``pipe(args.prompt)`` call, seeded: (the image as an HxWx3 array in [0, 1], seconds)."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    out = pipe(args.prompt, num_inference_steps=args.steps, height=size, width=size, generator=gen, output_type="np")
    if device == "cuda":
        torch.cuda.synchronize()
    return out.images[0], time.perf_counter() - t


def cmd_demo(args: argparse.Namespace) -> int:

    import sd_kernels
    from sd_kernels.testing import psnr

    if args.no_patch and (args.compile or args.profile):
        raise ValueError(f"{'--compile' if args.compile else '--profile'} sets up the patch: it cannot go with "
                         "--no-patch")
    if args.profile:
        from sd_kernels.profiles import get_profile

        get_profile(args.profile)  # an unknown name: refused before any work
    pipe, name, device, size = _load(args)
    run = lambda: _generate(pipe, args, size, device)

    if device == "cuda":
        run()  # warm-up: cuDNN autotuning and Triton compilation stay out of the timings
    stock_img, stock_s = run()
    print(f"stock:   {stock_s * 1e3:9.1f} ms")
    result_img, result_s = stock_img, stock_s
    if not args.no_patch:
        # The recommended set-up: patch()'s defaults (on a GPU, every model call replayed from CUDA graphs).
        t0 = time.perf_counter()
        record = sd_kernels.patch(pipe, compile=args.compile, profile=args.profile)
        print(record.summary())
        if device == "cuda":
            _, first_s = run()
            print(f"patched, first call: {(time.perf_counter() - t0) * 1e3:9.1f} ms from patch() to the image "
                  f"(the call {first_s * 1e3:.1f} ms: kernel tuning{', compilation' if args.compile else ''} and "
                  "graph capture)")
        result_img, result_s = run()
        print(f"patched: {result_s * 1e3:9.1f} ms  ({stock_s / result_s:.2f}x), "
              f"PSNR vs stock {psnr(result_img, stock_img):.1f} dB")
        sd_kernels.unpatch(pipe)
        if device != "cuda":
            print("note: on a CPU these timings say nothing of sd-kernels' speed: its kernels run on CUDA GPUs, and "
                  "here both runs take PyTorch's CPU path (or Triton's interpreter, slower still); the CPU demo "
                  "shows the patch working and the images agreeing (PSNR), not a speed-up")
        if device == "cuda":  # stock eager is not the strongest thing to compare with: say what is
            print("note: stock here is diffusers' eager pipeline. Against torch.compile with CUDA graphs (diffusers' "
                  "own speed recipe) compare with `--compile` (patch(pipe, compile=True)) or run "
                  "`sd-kernels bench --variants stock+compile-graphs,patched+graph+compile`; measured tables: "
                  "README, Results")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    from diffusers.utils import numpy_to_pil

    numpy_to_pil(result_img[None])[0].save(out)
    print(f"wrote {out}")
    return 0


def _bench_harness():
    """``bench.e2e`` and ``bench.plot`` from the source tree (bench/ is not part of the installed package)."""
    try:
        from bench import e2e, plot
    except ModuleNotFoundError:
        root = pathlib.Path(__file__).resolve().parents[2]
        if not (root / "bench" / "e2e.py").is_file():
            raise SystemExit("sd-kernels bench: the benchmark harness lives in the repository's bench/ folder; "
                             "run it from a source checkout installed with `pip install -e .`") from None
        sys.path.insert(0, str(root))
        from bench import e2e, plot
    return e2e, plot


def cmd_bench(args: argparse.Namespace) -> int:
    import datetime

    from sd_kernels import profiles

    if args.profile:
        profiles.get_profile(args.profile)  # an unknown name fails here
        os.environ["SD_KERNELS_PROFILE"] = args.profile  # what patch() and the ablation's profile read
    e2e, plot = _bench_harness()
    device, dtype_name = device_and_dtype(args.device, args.dtype)
    if args.model is None and device != "cuda":
        args.model = "tiny"
    args.models = args.model
    items = e2e.items_from(args)
    out = pathlib.Path(args.out or f"bench-results/{datetime.date.today().isoformat()}-{device}")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: is a file; bench writes its CSVs and plots into a folder")
    large = sorted({t.model for t, _, _ in items if not t.model.startswith("tiny")})
    if device == "cpu" and large:
        print(f"sd-kernels bench: note: {', '.join(large)} on the CPU: each call takes minutes (the tiny models "
              "are the CPU's; the time cap applies between measurements)", file=sys.stderr)
    import torch

    rows = e2e.run(items, out, args.steps, args.max_minutes, device=device,
                   dtype=getattr(torch, DTYPES[dtype_name]))
    e2e.print_summary(rows)
    for png in plot.plot_folder(out):
        print(f"wrote {png}")
    print(f"wrote {', '.join(sorted({str(out / r['csv']) for r in rows}))}")
    return 0 if all(not str(r.get("status")).startswith("error") for r in rows) else 1


def cmd_fidelity(args: argparse.Namespace) -> int:
    import torch

    from sd_kernels import models
    from sd_kernels.analysis.fidelity import check_fidelity

    device, dtype_name = device_and_dtype(args.device, args.dtype)
    name = args.model or models.default_model(device == "cuda")
    if args.size is not None:
        models.image_side(name, args.size, "--size")  # off the VAE's grid: refused before the pipeline is built
    dtype = getattr(torch, DTYPES[dtype_name])
    pipe = models.load_pipeline(name, device=device, dtype=dtype, seed=args.seed)
    pipe.set_progress_bar_config(disable=True)
    result = check_fidelity(pipe, steps=args.steps, seed=args.seed, prompt=args.prompt, size=args.size,
                            ops=args.ops, per_op=not args.no_per_op, cuda_graph=args.cuda_graph,
                            profile=args.profile)
    print(result.format(args.max_latent_err, args.min_psnr))
    return 0 if result.ok(args.max_latent_err, args.min_psnr) else 1


def build_parser(bench_options: bool = True) -> argparse.ArgumentParser:
    """The command line. ``bench_options``: add ``bench``'s own options, read from the benchmark harness
    (which imports torch: ``main`` asks for them only when the command is ``bench``)."""
    ap = argparse.ArgumentParser(prog="sd-kernels", description="Triton kernels for Stable Diffusion in diffusers")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    info = sub.add_parser("info", help="versions, device, the active profile and its kernel selection table")
    info.add_argument("--profile", help="show this profile (a name or a .json path) instead of the detected one")
    info.set_defaults(fn=cmd_info)
    demo = sub.add_parser("demo", help="run a random-weight SD pipeline stock and patched, write a PNG")
    _pipeline_options(demo, "shipped config (tiny, sd15, sd21, sdxl, ...) or a local pipeline directory; "
                      "default: sd15 on a GPU, tiny on CPU")
    demo.add_argument("--prompt", default=DEFAULT_PROMPT, help="the prompt (default: an astronaut riding a horse)")
    demo.add_argument("--out", default="demo.png", help="PNG to write (default demo.png)")
    demo.add_argument("--no-patch", action="store_true", help="run stock only")
    demo.add_argument("--profile", help="device profile for the patch (default: detected; see `sd-kernels info`)")
    _compile_option(demo, "the fastest set-up, after a minute or two of compilation")
    demo.set_defaults(fn=cmd_demo)
    generate_command.add_parser(sub, _pipeline_options, _compile_option)
    bench = sub.add_parser("bench", help="end-to-end benchmarks and the paper's ablation: table, CSV and PNG",
                           description="Runs bench/e2e.py (a source checkout is needed): every variant of "
                           "every model, appending rows to OUT/e2e.csv and OUT/ablation.csv as they finish, "
                           "then prints the table and writes PNG plots.")
    bench.add_argument("--model", help="NAME[@SIZE] or a local pipeline directory, comma-separated for several: "
                       "UNet pipelines (SD1.x/2.x, SDXL; the transformers: python -m bench.dit); default: the "
                       "selection's models (tiny on CPU)")
    bench.add_argument("--profile", help="device profile (default: detected)")
    bench.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda if available (CPU: tiny models, "
                       "eager variants only)")
    bench.add_argument("--dtype", choices=sorted(DTYPES), help="default: fp16 on a GPU, fp32 on CPU")
    bench.add_argument("--out", help="results folder (default bench-results/DATE-DEVICE)")
    if bench_options:
        _bench_options(bench)
    bench.set_defaults(fn=cmd_bench)
    fid = sub.add_parser("fidelity", help="stock vs patched with the same weights and seed: latent error, "
                         "image PSNR, per op family; exit status 1 past the limits")
    _pipeline_options(fid, "shipped config or a local pipeline directory (default: sd15 on a GPU, tiny on CPU)")
    fid.add_argument("--ops", nargs="+", help="op families to patch (default: all)")
    fid.add_argument("--profile", help="profile name (default: detected)")
    fid.add_argument("--cuda-graph", action="store_true", help="patch with cuda_graph=True")
    fid.add_argument("--no-per-op", action="store_true", help="skip the one-family-at-a-time runs")
    fid.add_argument("--prompt", default=DEFAULT_PROMPT, help="the prompt both runs take (default: an astronaut)")
    fid.add_argument("--max-latent-err", type=float, default=1e-2, help="limit on the latent rel. error (1e-2)")
    fid.add_argument("--min-psnr", type=float, default=40.0, help="limit on the image PSNR in dB (40)")
    fid.set_defaults(fn=cmd_fidelity)
    return ap


def _fixed_seed(text: str) -> int:
    """demo's and fidelity's --seed: the one seed both the stock and the patched run take."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not 0 <= value < 2**64:
        raise argparse.ArgumentTypeError(f"{value}: a seed is in [0, 2**64 - 1] (a random one, -1, is generate's)")
    return value


def _pipeline_options(ap: argparse.ArgumentParser, model_help: str, seed_help: str = "seed (default 0)",
                      fixed_seed: bool = True) -> None:
    """The options every command that builds and runs a pipeline takes (demo, generate, fidelity; generate,
    ``fixed_seed=False``, checks its own --seed, where -1 draws one)."""
    ap.add_argument("--model", help=model_help)
    ap.add_argument("--steps", type=positive_int, default=20, help="denoising steps (default 20)")
    ap.add_argument("--size", type=positive_int, help="image side in pixels (default: the model's)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), help="default: fp16 on a GPU, fp32 on CPU")
    ap.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda if available")
    ap.add_argument("--seed", type=_fixed_seed if fixed_seed else int, default=0, help=seed_help)


def _bench_options(ap: argparse.ArgumentParser) -> None:
    """bench/e2e.py's own options (selection, variants, steps, ablation, time cap), where it can be found."""
    try:
        e2e, _ = _bench_harness()
    except SystemExit:
        return  # an installed wheel: `sd-kernels bench` explains when run
    e2e.add_arguments(ap, models=False)


def _compile_mode(value: str) -> str:
    from sd_kernels.patches.cuda_graph import COMPILE_MODES

    if value not in COMPILE_MODES:
        raise argparse.ArgumentTypeError(f"{value!r}: MODE is one of {', '.join(COMPILE_MODES)}")
    return value


def _compile_option(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--compile", nargs="?", const="default", default=False, type=_compile_mode, metavar="MODE",
                        help=f"patch(compile=MODE): {what}; MODE 'default' (when omitted) or 'max-autotune' "
                        "(inductor's GEMM/convolution autotuning: minutes more)")


class _ProgressSafeHandler(logging.StreamHandler):
    """Warnings to stderr through tqdm, so that a line does not break a progress bar that is drawing."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:
            self.handleError(record)


# transformers warns, when diffusers is imported, that its image processors fall back from torchvision to
# PIL: they serve safety checkers and image encoders, which no command here runs, so the lines are noise.
_IMPORT_NOISE = ("transformers.utils.import_utils", "requires torchvision (not installed); falling back")


def _drop_import_noise(record: logging.LogRecord) -> bool:
    return _IMPORT_NOISE[1] not in record.getMessage()


def _log_to_stderr() -> logging.Handler:
    """What the command shows of the library's logging: its warnings, one line each."""
    handler = _ProgressSafeHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler.setLevel(logging.WARNING)
    logging.getLogger("sd_kernels").addHandler(handler)
    logging.getLogger(_IMPORT_NOISE[0]).addFilter(_drop_import_noise)
    return handler


def _what_was_kept(args: argparse.Namespace) -> str:
    """After Ctrl-C in a batch: how many images the folder's manifest lists as made (each written whole)."""
    if args.command != "generate" or not getattr(args, "prompts", None):
        return ""
    from sd_kernels.apps import manifest

    out = pathlib.Path(args.out or "images")
    made = len(manifest.finished(out, manifest.read(out)))
    return (f": {out} holds {made} finished image(s), listed in {manifest.MANIFEST}; the same command again makes "
            "the rest")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(bench_options=command == "bench").parse_args(argv)
    handler = _log_to_stderr()
    try:
        from sd_kernels.runtime.dispatch import KernelUnavailable
        from sd_kernels.runtime.memory import MemoryBudgetExceeded

        try:
            return args.fn(args)
        # OSError: a hub id with no hub, a full disk; MemoryBudgetExceeded: weights over a profile's budget
        except (ValueError, TypeError, OSError, KernelUnavailable, MemoryBudgetExceeded) as exc:
            print(f"sd-kernels {args.command}: error: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:  # what was made is written and listed; a rerun of generate makes the rest
            print(f"sd-kernels {args.command}: interrupted{_what_was_kept(args)}", file=sys.stderr)
            return 130
    finally:
        logging.getLogger("sd_kernels").removeHandler(handler)
        logging.getLogger(_IMPORT_NOISE[0]).removeFilter(_drop_import_noise)


if __name__ == "__main__":
    sys.exit(main())
