"""``sd-kernels generate``: its options, and one image (``--prompt``) or a folder of them (``--prompts``).

Every option's value is checked before any model is built, each error naming its option. Full
documentation: docs/generate.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import time

from sd_kernels.apps import metadata, options, parallel

RANDOM_WEIGHTS_NOTE = ("random weights from the shipped config {name!r}: the image is structured noise, "
                       "not a picture of the prompt (pass --model PATH for a real checkpoint)")

DESCRIPTION = """\
One image: --prompt TEXT --out FILE (.png, .jpg or .webp; the settings are written into it). Many:
--prompts FILE --out DIR: one image per non-empty line of a text file, or per JSON object of a .jsonl
file (keys: prompt, negative, seed, size or width/height, steps, guidance), --images-per-prompt each,
written as DIR/NNNNN.png with DIR/manifest.jsonl; a rerun skips what is done. Several GPUs: accelerate
launch --multi_gpu --num_processes N -m sd_kernels generate --prompts FILE --out DIR. One image on several
processes: torchrun --nproc_per_node 2 -m sd_kernels generate --prompt TEXT --parallel cfg (or --parallel
ulysses for FLUX, SD3 and PixArt-Σ, or ring for FLUX, N processes). Documentation: docs/generate.md,
docs/parallel.md."""


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def add_parser(sub, pipeline_options, compile_option) -> argparse.ArgumentParser:
    """The ``generate`` subcommand on ``sub``; ``pipeline_options`` and ``compile_option`` add the
    options it shares with the other commands."""
    gen = sub.add_parser("generate", help="generate an image, or one per line of a prompts file (under "
                         "`accelerate launch`: spread over the GPUs), with the patched pipeline",
                         description=DESCRIPTION)
    which = gen.add_mutually_exclusive_group(required=True)
    which.add_argument("--prompt", help="one prompt: one image")
    which.add_argument("--prompts", help="a text file (one prompt per line) or a .jsonl file (one JSON object per "
                       "line): images into the --out folder")
    pipeline_options(gen, "shipped config (random weights: the image is noise-like), a single-file .safetensors "
                     "checkpoint, a local pipeline directory or a hub id; default: sd15 on a GPU, tiny on CPU",
                     seed_help="seed of the first image (image i gets SEED+i); -1: a random one, printed and "
                     "recorded (default 0)", fixed_seed=False)
    gen.add_argument("--config", help="a .safetensors checkpoint's architecture: a shipped config (sd15, sd21, sdxl, "
                     "tiny, ...) or a diffusers folder of the same model (its configs and tokenizers); default: "
                     "inferred from the checkpoint")
    gen.add_argument("--width", type=positive_int, help="image width in pixels (default: the model's)")
    gen.add_argument("--height", type=positive_int, help="image height in pixels (default: the model's)")
    gen.add_argument("--guidance-scale", type=_number, help="classifier-free guidance scale (default: the pipeline's, "
                     "7.5 for SD1.x/2.x, 5 for SDXL, 7.5 for SDXL inpaint)")
    gen.add_argument("--negative-prompt", help="what the image should not show")
    gen.add_argument("--scheduler", metavar="NAME", help=f"one of {', '.join(options.SCHEDULERS)} (default: the "
                     "model's own)")
    gen.add_argument("--images-per-prompt", type=positive_int, default=1, help="with --prompts: images per prompt, "
                     "each with the next seed (default 1)")
    gen.add_argument("--batch-size", type=positive_int, default=1, help="with --prompts: images per pipeline call, "
                     "among those that share size, steps and guidance (default 1)")
    gen.add_argument("--lora", action="append", default=[], metavar="PATH[:SCALE]", help="a LoRA (file or diffusers "
                     "LoRA folder) and its weight (default 1); repeatable")
    gen.add_argument("--image", help="img2img: the initial image (default size: its own, rounded down to a multiple "
                     "of 8)")
    gen.add_argument("--mask", help="inpaint: white where the --image is repainted")
    gen.add_argument("--strength", type=_number, help="with --image: how much of it is noised away, in (0, 1] "
                     "(default: the pipeline's: 0.8 for img2img, 1 for inpaint; SDXL 0.3 and 0.9999)")
    gen.add_argument("--profile", help="device profile (default: detected; see `sd-kernels info`)")
    gen.add_argument("--cuda-graph", choices=["auto", "pipeline", "step", "unet", "off"], default="auto",
                     help="patch(cuda_graph=...): auto (default) replays every model call from CUDA graphs on a GPU")
    compile_option(gen, "torch.compile inside the graphs")
    gen.add_argument("--precision", choices=options.PRECISIONS, default="fp16", help="patch(precision=...): fp16 "
                     "(default) is the lossless patch, in the weights' own --dtype (fp32 too); fp8 runs the "
                     "transformer blocks' linear layers as FP8 GEMMs, and FLUX's "
                     "attention in FP8 (lossy; GPUs with FP8 tensor cores: Ada, Hopper; docs/fp8.md)")
    gen.add_argument("--parallel", choices=parallel.MODES, help="with --prompt, under torchrun: one image on all the "
                     "launch's processes; cfg: the guidance batch over 2 (SD1.x/2.x, SDXL, PixArt-Σ, SD3); ulysses: "
                     "diffusers' context parallelism with our attention (FLUX, SD3, PixArt-Σ); ring: the same with "
                     "the keys and values gathered (FLUX, faster there); docs/parallel.md")
    gen.add_argument("--out", help="the image to write (default image.png); with --prompts, the folder (default "
                     "images)")
    gen.set_defaults(fn=cmd_generate)
    return gen


def settings_from(args: argparse.Namespace) -> options.Settings:
    """The run's settings from the command line, each value checked (errors name the option)."""
    width, height = options.square(args.size, args.width, args.height)
    settings = options.Settings(
        model=args.model, config=args.config, steps=args.steps, width=width, height=height,
        guidance=args.guidance_scale, negative=args.negative_prompt, scheduler=args.scheduler, seed=args.seed,
        images_per_prompt=args.images_per_prompt, batch_size=args.batch_size,
        loras=tuple(options.parse_lora(x) for x in args.lora), image=args.image, mask=args.mask,
        strength=args.strength, dtype=args.dtype, device=args.device, profile=args.profile, compile=args.compile,
        precision=args.precision)
    settings.check()
    return settings


def cmd_generate(args: argparse.Namespace) -> int:
    from sd_kernels import profiles

    settings = settings_from(args)
    profiles.get_profile(args.profile)  # an unknown name fails here, before the pipeline is built
    if args.prompts:
        if args.parallel:
            raise ValueError("--parallel makes one image on several processes (--prompt); for --prompts, prompt-level "
                             "sharding is the batch mode: accelerate launch --multi_gpu --num_processes N -m "
                             "sd_kernels generate --prompts FILE --out DIR")
        return _generate_batch(args, settings)
    return _generate_one(args, settings)


def _generate_one(args: argparse.Namespace, settings: options.Settings) -> int:
    """``generate --prompt``: one image, written with its records to --out; with --parallel, made by
    every process of the launch and written by the first (sd_kernels/apps/parallel.py)."""
    from sd_kernels import models
    from sd_kernels.apps import pipeline
    from sd_kernels.apps.generate import check_backend, check_precision

    for option, value in (("--images-per-prompt", settings.images_per_prompt), ("--batch-size", settings.batch_size)):
        if value != 1:
            raise ValueError(f"{option} goes with --prompts (--prompt makes one image)")
    launch = parallel.launch(args.parallel, cuda_graph=args.cuda_graph, compile=args.compile) if args.parallel else None
    out = pathlib.Path(args.out or "image.png")
    metadata.check_output(out)
    device, dtype = options.device_and_dtype(args.device, args.dtype)
    if args.cuda_graph not in ("auto", "off") and device != "cuda":
        raise ValueError(f"--cuda-graph {args.cuda_graph} replays CUDA graphs: it needs --device cuda (on the "
                         f"{device}: auto or off)")
    check_backend(device)
    check_precision(settings.precision, device)
    name = settings.model or models.default_model(device == "cuda")
    model = pipeline.inspect(settings, name)
    if launch is not None:
        parallel.check_model(launch, model, settings.guidance if settings.guidance is not None else model.guidance)
    seed, drawn = options.resolve_seed(settings.seed)
    size = (settings.width or model.size[0], settings.height or model.size[1])
    [job] = options.plan([options.PromptSpec(args.prompt, where="--prompt")], settings, seed, size, model.guidance)
    if launch is None:
        return _make_one(args, settings, job, drawn, model, device, dtype, out, None)
    try:
        device = parallel.start(launch, device)
        seed, drawn = parallel.shared((seed, drawn))
        return _make_one(args, settings, dataclasses.replace(job, seed=seed), drawn, model, device, dtype, out, launch)
    finally:
        _end_process_group()


def _make_one(args: argparse.Namespace, settings: options.Settings, job: options.Job, drawn: bool, model, device: str,
              dtype: str, out: pathlib.Path, launch: parallel.Launch | None) -> int:
    """Build, patch and call the pipeline for ``job``; write the image (under a launch: the first process)."""
    import torch

    import sd_kernels
    from sd_kernels.apps import pipeline

    main = launch is None or launch.main
    say = print if main else (lambda *_: None)
    on_gpu = device.startswith("cuda")
    weights = "random weights" if model.shipped else "loaded"
    split = f", --parallel {launch.mode} over {launch.world} processes" if launch else ""
    say(f"sd-kernels generate: {model.name} ({weights}), {job.width}x{job.height}, {job.steps} steps, {dtype} on "
        f"{device}{split}, seed {job.seed}" + (" (drawn at random)" if drawn else ""))
    t0 = time.perf_counter()
    pipe = pipeline.load(model, device, getattr(torch, options.DTYPES[dtype]))
    say(f"built the pipeline in {time.perf_counter() - t0:.1f} s")
    split_arguments = parallel.prepare(pipe, launch, settings.precision) if launch else {}
    graph = {"off": False}.get(args.cuda_graph, args.cuda_graph)
    record = sd_kernels.patch(pipe, profile=args.profile, cuda_graph=graph, compile=args.compile,
                              precision=settings.precision, **split_arguments)
    say(record.summary())
    # the denoising steps' progress, in a terminal: the first image of a process also tunes and captures
    pipe.set_progress_bar_config(disable=not (main and sys.stderr.isatty()), desc="steps", leave=False)
    if launch is not None and (note := parallel.eager_note(launch, on_gpu)):
        say(note)
    try:
        if launch is not None and (note := parallel.finish(pipe, launch, job.width * job.height)):
            say(note)
        if on_gpu:
            torch.cuda.synchronize()
        t = time.perf_counter()
        [image] = pipeline.render(pipe, [job], model, pipeline.InitImages(model))
        if on_gpu:
            torch.cuda.synchronize()
    finally:
        if launch is not None:
            # the patch's CUDA graphs released before the caller ends the process group: graphs that hold
            # captured collectives (SD_KERNELS_GRAPH_COLLECTIVES=1) keep its communicators from shutting down;
            # the ring exchange's symmetric buffers, made over it, with them
            from sd_kernels.patches import peer_gather

            sd_kernels.unpatch(pipe)
            peer_gather.release_all()
            if on_gpu:
                torch.cuda.empty_cache()
    say(f"generated in {(time.perf_counter() - t) * 1e3:.1f} ms (patched"
        + ("; the first call includes kernel tuning and compilation)" if on_gpu else ")"))
    if not main:
        return 0
    if model.shipped:
        print(f"note: {RANDOM_WEIGHTS_NOTE.format(name=model.name)}")
    out.parent.mkdir(parents=True, exist_ok=True)
    label = f"cuda ({torch.cuda.get_device_name()})" if on_gpu else "cpu"
    run = pipeline.run_fields(dtype, record, label, launch.mode if launch else None, launch.world if launch else 1)
    metadata.encode(image, out, pipeline.fields(job, model, run))
    print(f"wrote {out}")
    return 0


def _generate_batch(args: argparse.Namespace, settings: options.Settings) -> int:
    """``generate --prompts FILE --out DIR``: sd_kernels.apps.generate, in this process or under accelerate."""
    from sd_kernels.apps import generate

    if args.cuda_graph != "auto":
        raise ValueError("--cuda-graph with --prompts: batch generation uses patch()'s recommended set-up")
    specs = options.read_prompts(args.prompts)
    try:
        summary = generate.run(specs, pathlib.Path(args.out or "images"), settings)
    finally:
        _end_process_group()
    if summary.main:
        print(summary.format())
    return summary.exit_code


def _end_process_group() -> None:
    """The process group accelerate started under torchrun / ``accelerate launch``, ended before the
    command returns: left to the interpreter's exit, gloo's threads are sometimes destroyed while
    running, and the process aborts ("terminate called without an active exception") after its images."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
