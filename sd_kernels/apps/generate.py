"""Batch generation: a list of prompts to images, in one process or in one process per GPU.

    sd-kernels generate --prompts prompts.txt --out images/                       # one process
    accelerate launch --multi_gpu --num_processes 2 -m sd_kernels generate --prompts prompts.txt --out images/

``generate_images(prompts, out)`` is the same from Python. Each process builds (or loads) its
pipeline on its device, patches it with the recommended set-up there (``patch(pipe)``: the kernels,
and on a GPU every model call from CUDA graphs; ``compile=True`` adds torch.compile), takes its share
of the images (accelerate's ``PartialState.split_between_processes``, the recipe of diffusers'
distributed-inference docs), makes them in pipeline calls of up to ``batch_size`` images that share a
size, steps and guidance, and hands each to a writer thread (sd_kernels/apps/writer.py) while the
next call runs.

- **Seeds per image.** Image ``k`` of prompt ``i`` (``images_per_prompt`` N) is number ``i * N + k``
  and gets seed ``seed + i * N + k`` (a JSONL line's own seed ``s``: ``s + k``) and its own generator,
  also inside a batch: its initial noise does not depend on how many processes ran, which one took
  it, or what it was batched with. At batch size 1 each image is the one a single ``generate
  --prompt`` makes; batched, the same up to the kernels' rounding at another batch size (same kernels
  and numerics: on a GPU the same tuned configs, which the shipped tables give for SD's shapes; on
  the CPU the same thread count, as torchrun's OMP_NUM_THREADS=1). ``seed=-1`` draws the run's seed,
  printed in the summary and recorded in every image.
- **Nothing lost, nothing redone.** An image goes to a temporary file renamed into place, then a line
  in ``manifest.jsonl`` (sd_kernels/apps/manifest.py: one JSON object per image with its settings,
  status, error, process, device, set-up, seconds). A rerun skips every image the manifest lists as
  written with the same settings (prompt, negative prompt, seed, size, steps, guidance, model,
  scheduler, LoRAs, initial image and mask, strength, dtype, precision, profile) whose file is there, so a crash
  costs only the images in flight. A failing call (out of memory, ...) is a manifest line per image
  with its error; the run goes on, and the exit code says that something failed. One run at a time
  per folder (a lock; a second run stops with an error before any work).
- **Errors before work.** An empty prompt list, a bad value of any setting (named), an output folder
  that cannot be written, a forced backend that cannot run here, a seed that would pass 2**64 - 1,
  more processes than GPUs: a ``ValueError`` before any model is built; under a profile with a memory
  budget, weights of a shipped config that cannot fit it: ``MemoryBudgetExceeded`` (its weights are
  counted on the meta device first).
- **The memory table.** Under a profile with a memory budget, on a GPU, the second pipeline call (the
  first's only when it is the only one: a first call also holds the autotuner's one-time buffers) is
  measured (``sd_kernels.analysis.memory_report.PipelineMemory``): weights and peak intermediates per
  component and the call's total peak against the budget, printed with the summary.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pathlib
import re
import time
import uuid
from collections.abc import Sequence
from typing import Any

from sd_kernels.apps import manifest, options, pipeline, writer
from sd_kernels.apps.manifest import MANIFEST  # noqa: F401  (the folder's manifest name, for callers)
from sd_kernels.apps.options import DTYPES, Job, PromptSpec, Settings, dtype_name

log = logging.getLogger(__name__)

# What must match for a manifest entry to stand for an image this run would make.
SAME = ("prompt", "negative", "seed", "width", "height", "steps", "guidance", "model", "config", "scheduler",
        "loras", "image", "mask", "strength", "dtype", "precision", "profile")


@dataclasses.dataclass
class ProcessStats:
    """What one process did: images written and failed, seconds from the start to its pipeline ready
    (build and patch), the first pipeline call (capture, tuning, compile) and the rest (steady state)."""

    process: int
    device: str
    images: int = 0
    failed: int = 0
    setup_s: float = 0.0
    first_s: float = 0.0
    steady_s: float = 0.0
    steady_images: int = 0  # images made by the calls after the first
    writer_s: float = 0.0  # seconds the writer thread spent encoding and writing (beside the calls)
    memory: str = ""  # under a profile with a memory budget, on CUDA: one call's memory table

    @property
    def steady_images_per_s(self) -> float | None:
        """Images per second after the first call (None where none came after it)."""
        return self.steady_images / self.steady_s if self.steady_images and self.steady_s > 0 else None


@dataclasses.dataclass
class Summary:
    """The run: images written, failed, skipped (already in the folder), wall seconds, per process."""

    out: pathlib.Path
    written: int
    failed: int
    skipped: int
    seconds: float
    processes: list[ProcessStats]
    main: bool = True  # whether this process is the main one (the one to print the summary)
    seed: int = 0
    seed_drawn: bool = False

    @property
    def exit_code(self) -> int:
        return 1 if self.failed else 0

    def format(self) -> str:
        lines = [f"{self.written} images written, {self.failed} failed, {self.skipped} already there, "
                 f"in {self.seconds:.1f} s ({self.written / self.seconds if self.seconds else 0:.2f} images/s); "
                 f"manifest: {self.out / MANIFEST}"]
        if self.seed_drawn:
            lines.append(f"seed {self.seed} (drawn at random; --seed {self.seed} makes these images again)")
        for p in self.processes:
            rate = p.steady_images_per_s
            lines.append(f"  process {p.process} ({p.device}): {p.images} images, {p.failed} failed; set-up "
                         f"{p.setup_s:.1f} s, first call {p.first_s:.1f} s, then "
                         + (f"{rate:.2f} images/s" if rate else "-"))
            if p.memory:
                lines.append(p.memory)
        return "\n".join(lines)


def check_backend(device: Any) -> None:
    """SD_KERNELS_BACKEND, read and checked against ``device`` before any work: a value it cannot take,
    or ``triton`` (kernels forced) where they cannot run."""
    from sd_kernels.runtime import dispatch

    if dispatch.backend() == "triton" and (why := dispatch.device_reason(device)) is not None:
        raise ValueError(f"SD_KERNELS_BACKEND=triton forces the kernels, and they cannot run on {device}: {why}")


def check_precision(precision: str, device: Any) -> None:
    """``--precision fp8`` on ``device``, before any work: refused with the patch's own reason where
    ``patch(pipe, precision="fp8")`` would refuse (a GPU without FP8 tensor cores, the CPU without
    Triton's interpreter)."""
    if precision != "fp8":
        return
    import torch

    from sd_kernels.patches import fp8

    try:
        fp8.check_device(torch.device(device), "pipeline")
    except RuntimeError as exc:
        raise ValueError(f"--precision fp8: {exc}") from None


def _state(device: str | None):
    """accelerate's PartialState for ``device`` (None: the GPU when there is one), checked before work."""
    import torch
    from accelerate import PartialState

    cpu = device == "cpu" or not torch.cuda.is_available()
    if device == "cuda" and cpu:
        raise ValueError("device cuda asked for, but torch sees no CUDA GPU")
    state = PartialState(cpu=cpu)
    if not cpu and state.num_processes > torch.cuda.device_count():
        raise ValueError(f"{state.num_processes} processes, but this host has {torch.cuda.device_count()} GPU(s): "
                         "one process per GPU")
    return state


def generate_images(
    prompts: Sequence[str | PromptSpec],
    out: str | os.PathLike,
    *,
    model: str | None = None,
    steps: int = 20,
    size: int | None = None,
    width: int | None = None,
    height: int | None = None,
    seed: int = 0,
    guidance_scale: float | None = None,
    negative_prompt: str | None = None,
    scheduler: str | None = None,
    images_per_prompt: int = 1,
    batch_size: int = 1,
    loras: Sequence[str | options.Lora] = (),
    image: str | None = None,
    mask: str | None = None,
    strength: float | None = None,
    config: str | None = None,
    device: str | None = None,
    dtype: str | None = None,
    profile: str | None = None,
    compile: bool | str = False,
    precision: str = "fp16",
    progress: bool = True,
) -> Summary:
    """Generate ``images_per_prompt`` images per prompt into the folder ``out`` (see the module
    docstring): in this process, or, under ``accelerate launch``, spread over its processes. ``model``:
    a shipped config (random weights), a single-file ``.safetensors`` checkpoint (``config``: its
    architecture, see ``sd_kernels.models.checkpoint_config``), a local pipeline folder or a hub id
    (default: sd15 on a GPU, tiny on the CPU); ``size`` or ``width``/``height``: default the model's
    own; ``guidance_scale``, ``scheduler`` (a name of ``options.SCHEDULERS``): default the model's;
    ``loras``: "PATH[:SCALE]" or ``options.Lora``; ``image`` (img2img), with ``mask`` (inpaint),
    ``strength``; ``dtype``: "fp16", "bf16" or "fp32" (default fp16 on a GPU); ``precision``: "fp16" (the
    lossless default) or "fp8" (``patch(pipe, precision="fp8")``, docs/fp8.md); ``seed``: see the module
    docstring (the random weights of a shipped config are seed 0's, whatever ``seed``). ``prompts``: strings, or
    ``PromptSpec`` (a JSONL line's settings, ``options.read_prompts``). Returns the run's Summary (the
    same in every process)."""
    width, height = options.square(size, width, height)
    settings = Settings(
        model=model, config=config, steps=steps, width=width, height=height, guidance=guidance_scale,
        negative=negative_prompt, scheduler=scheduler, seed=seed, images_per_prompt=images_per_prompt,
        batch_size=batch_size, loras=tuple(x if isinstance(x, options.Lora) else options.parse_lora(x) for x in loras),
        image=image, mask=mask, strength=strength, dtype=dtype, device=device, profile=profile, compile=compile,
        precision=precision)
    specs = [p if isinstance(p, PromptSpec) else PromptSpec(str(p), where=f"prompt {i}") for i, p in enumerate(prompts)]
    return run(specs, pathlib.Path(out), settings, progress)


def run(specs: Sequence[PromptSpec], out: pathlib.Path, settings: Settings, progress: bool = True) -> Summary:
    """``generate_images`` with its prompts and settings read (``options``)."""
    import torch
    from accelerate.utils import broadcast_object_list, gather_object

    from sd_kernels import models
    from sd_kernels.profiles import get_profile

    if not specs:
        raise ValueError("no prompts")
    settings.check()
    state = _state(settings.device)
    check_backend(state.device)
    check_precision(settings.precision, state.device)
    on_gpu = state.device.type == "cuda"
    name = settings.model or models.default_model(on_gpu)
    model = pipeline.inspect(settings, name)
    dtype = dtype_name(settings.dtype, on_gpu)
    torch_dtype = getattr(torch, DTYPES[dtype])
    profile = get_profile(settings.profile)
    if model.shipped and settings.profile is not None:
        check_budget(name, torch_dtype, settings.profile)
    size = (settings.width or model.size[0], settings.height or model.size[1])
    manifest.check(out)  # after the checks above, so that a refused run leaves no folder behind
    identity = {"model": name, "config": model.config, "scheduler": model.scheduler, "loras": model.loras,
                "image": model.image, "mask": model.mask, "strength": model.strength, "dtype": dtype,
                "precision": settings.precision, "profile": profile.name}

    with contextlib.ExitStack() as held:
        # The main process holds the folder for the run and decides what is left to do; every process
        # gets its decision (or its error, so that all of them stop before any work).
        decided: dict[str, Any] | None = None
        if state.is_main_process:
            try:
                held.enter_context(manifest.Lock(out))
                manifest.end_last_line(out)
                _remove_partial_files(out)
                seed, drawn = options.resolve_seed(settings.seed)
                jobs = options.plan(specs, settings, seed, size, model.guidance)
                entries = manifest.read(out)
                done = manifest.done(out, jobs, identity, SAME, entries)
                if stale := manifest.beyond(out, jobs, entries):
                    shown = ", ".join(map(str, stale[:5])) + (f" and {len(stale) - 5} more" if len(stale) > 5 else "")
                    log.warning("sd_kernels: generate: %s holds %d image(s) of an earlier run that this one does not "
                                "make (index %s): left as they are, listed in its manifest with their settings",
                                out, len(stale), shown)
                decided = {"seed": seed, "drawn": drawn, "done": sorted(done), "run": uuid.uuid4().hex[:12]}
            except ValueError as exc:
                decided = {"error": str(exc)}
        decided = broadcast_object_list([decided])[0]
        if "error" in decided:
            raise ValueError(decided["error"])
        jobs = options.plan(specs, settings, decided["seed"], size, model.guidance)
        done = set(decided["done"])
        todo = [j for j in jobs if j.index not in done]

        t0 = time.perf_counter()
        label = torch.cuda.get_device_name(state.device) if on_gpu else "cpu"
        stats = ProcessStats(state.process_index, f"{state.device} ({label})" if on_gpu else "cpu")
        with state.split_between_processes(todo) as mine:
            if mine:
                share = _Share(out, model, settings, torch_dtype, dtype, state, stats, decided["run"], identity)
                share.run(mine, progress and state.is_main_process, t0)
        every = gather_object([dataclasses.asdict(stats)])
        state.wait_for_everyone()
    processes = [ProcessStats(**s) for s in every]
    return Summary(out, sum(p.images for p in processes), sum(p.failed for p in processes), len(done),
                   time.perf_counter() - t0, processes, state.is_main_process, decided["seed"], decided["drawn"])


_PARTIAL = re.compile(r"\.\d{5,}\.png\.\d+\.tmp")  # metadata.encode's temporary name for NNNNN.png


def _remove_partial_files(out: pathlib.Path) -> None:
    """Temporary image files a killed run left; the lock says that no run is writing them."""
    for path in out.glob(".*.tmp"):
        if _PARTIAL.fullmatch(path.name):
            with contextlib.suppress(OSError):
                path.unlink()


def check_budget(name: str, torch_dtype, profile):
    """A shipped config's weights against the memory budget of ``profile`` (a name or a Profile), read
    off the model built on the meta device (no memory, no weights): MemoryBudgetExceeded before any
    work where they cannot fit (``sd_kernels.runtime.memory.plan_budget``); the plan, or None without a budget."""
    from sd_kernels import models
    from sd_kernels.patches import memory_plan
    from sd_kernels.profiles import get_profile

    return memory_plan(models.build_pipeline(name, device="meta", dtype=torch_dtype), get_profile(profile))


@contextlib.contextmanager
def _measured(pipe, record, measure: bool, title: str, stats: ProcessStats):
    """Under a profile with a memory budget, on CUDA, where ``measure`` (the call to measure): its memory
    table (weights, peak intermediates per component, the call's total peak against the budget) into
    ``stats.memory``."""
    budget = record.profile_spec.memory_budget_bytes() if measure else None
    device = pipe.device if budget is not None else None
    if device is None or device.type != "cuda":
        yield
        return
    from sd_kernels.analysis.memory_report import PipelineMemory
    from sd_kernels.runtime.memory import CudaMemory

    with PipelineMemory(pipe, budget, CudaMemory(device)) as table:
        yield
    stats.memory = table.format(title)


@dataclasses.dataclass
class _Share:
    """This process's images: build and patch its pipeline, then one pipeline call per batch."""

    out: pathlib.Path
    model: pipeline.Model
    settings: Settings
    torch_dtype: Any
    dtype: str
    state: Any
    stats: ProcessStats
    run_id: str
    identity: dict[str, Any]

    def entry(self, job: Job, **more: Any) -> dict[str, Any]:
        """One image's manifest line."""
        return {**manifest.job_fields(job), **self.identity, "process": self.state.process_index,
                "device": self.stats.device, "run": self.run_id, **more}

    def fail(self, jobs: Sequence[Job], error: str, **more: Any) -> None:
        for job in jobs:
            manifest.append(self.out, self.entry(job, status="error", error=error, **more))
        self.stats.failed += len(jobs)

    def run(self, mine: Sequence[Job], progress: bool, t0: float) -> None:
        import torch
        from tqdm.auto import tqdm

        import sd_kernels

        stats = self.stats
        try:
            pipe = pipeline.load(self.model, self.state.device, self.torch_dtype)
            record = sd_kernels.patch(pipe, profile=self.settings.profile, compile=self.settings.compile,
                                      precision=self.settings.precision)
        except Exception as exc:  # every image of this share fails with the reason; the other processes go on
            error = f"pipeline set-up failed: {type(exc).__name__}: {exc}"
            log.warning("sd_kernels: generate: process %d: %s", self.state.process_index, error)
            self.fail(mine, error)
            return
        setup = pipeline.setup_text(record)
        stats.setup_s = time.perf_counter() - t0
        run_fields = pipeline.run_fields(self.dtype, record, stats.device)
        init = pipeline.InitImages(self.model)
        calls = options.batches(mine, self.settings.batch_size)
        with writer.Writer(self.out) as images_out, tqdm(total=len(mine), desc="images", disable=not progress) as bar:
            for i, batch in enumerate(calls):
                t = time.perf_counter()
                first = batch[0]
                title = (f"{record.profile}, {first.width}x{first.height}, {first.steps} steps, call {i + 1}"
                         + (", the first: with one-time autotuning" if i == 0 else ""))
                try:
                    # the second call: the first also autotunes (one-time memory)
                    with _measured(pipe, record, i == min(1, len(calls) - 1), title, stats):
                        made = pipeline.render(pipe, batch, self.model, init)
                except Exception as exc:  # the run goes on; the manifest says what failed and why
                    error = f"{type(exc).__name__}: {exc}"
                    self.fail(batch, error, setup=setup, seconds=round(time.perf_counter() - t, 4))
                    log.warning("sd_kernels: generate: image(s) %s failed: %s", ", ".join(str(j.index) for j in batch),
                                error)
                    if isinstance(exc, torch.cuda.OutOfMemoryError):
                        torch.cuda.empty_cache()
                    made = None
                seconds = round(time.perf_counter() - t, 4)
                for job, image in zip(batch, made or ()):
                    images_out.put(image, self.out / job.file, pipeline.fields(job, self.model, run_fields),
                                   self.entry(job, setup=setup, seconds=seconds, batch=len(batch)))
                # the call and any wait for the writer (a disk slower than the GPU is the run's speed)
                if i == 0:
                    stats.first_s = time.perf_counter() - t
                else:
                    stats.steady_s += time.perf_counter() - t
                    stats.steady_images += len(made or ())
                bar.update(len(batch))
        stats.images += images_out.written
        stats.failed += images_out.failed
        stats.writer_s = images_out.busy_s
