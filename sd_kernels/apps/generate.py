"""Batch generation: a list of prompts to images, in one process or in one process per GPU.

    sd-kernels generate --prompts prompts.txt --out images/                       # one process
    accelerate launch --multi_gpu --num_processes 2 -m sd_kernels generate --prompts prompts.txt --out images/

``generate_images(prompts, out)`` is the same from Python. Each process builds (or loads) its
pipeline on its device, patches it with the recommended set-up there (``patch(pipe)``: the kernels,
and on a GPU every model call from CUDA graphs; ``compile=True`` adds torch.compile), takes its share
of the prompts (accelerate's ``PartialState.split_between_processes``, the recipe of diffusers'
distributed-inference docs) and writes each image as soon as it is made.

- **Seeds per prompt.** Prompt ``i`` gets seed ``seed + i`` and its own generator, one image per
  pipeline call: its image does not depend on how many processes ran or which one took it, given the
  same kernels and numerics in each (on a GPU: the same tuned configs, which the shipped tables give
  for SD's shapes; on the CPU: the same thread count, as torchrun's OMP_NUM_THREADS=1).
- **Nothing lost, nothing redone.** An image goes to a temporary file renamed into place, then a line
  in ``manifest.jsonl`` (one JSON object per image: index, file, prompt, seed, model, steps, size,
  status, error, process, device, set-up, seconds). A rerun skips every image the manifest lists as
  written with the same prompt, seed, model, steps and size whose file is there, so a crash costs
  only the image in flight. A failing prompt (out of memory, …) is a manifest line with its error;
  the run goes on, and the exit code says that something failed.
- **Errors before work.** An empty prompt list, an output folder that cannot be written, more
  processes than GPUs: a ``ValueError`` before any model is built; under a profile with a memory
  budget, weights of a shipped config that cannot fit it: ``MemoryBudgetExceeded`` (its weights are
  counted on the meta device first).
- **The memory table.** Under a profile with a memory budget, on a GPU, the second image's call (the
  first's only when it is the only one: a first call also holds the autotuner's one-time buffers) is
  measured
  (``sd_kernels.analysis.memory_report.PipelineMemory``): weights and peak intermediates per component and the call's
  total peak against the budget, printed with the summary.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import pathlib
import tempfile
import time
import uuid
from collections.abc import Sequence
from typing import Any

log = logging.getLogger(__name__)

MANIFEST = "manifest.jsonl"
# The dtype names the commands and generate_images take (torch attribute names as values: the CLI's
# option parsing reads this table without importing torch).
DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def dtype_name(name: str | None, on_gpu: bool) -> str:
    """``name``, or the default: fp16 on a GPU, fp32 on the CPU."""
    return name or ("fp16" if on_gpu else "fp32")
# What must match for a manifest entry to stand for an image this run would make.
_SAME = ("prompt", "seed", "model", "steps", "size")


@dataclasses.dataclass(frozen=True)
class Job:
    """One image: the prompt at ``index`` of the list, with its own seed."""

    index: int
    prompt: str
    seed: int

    @property
    def file(self) -> str:
        return f"{self.index:05d}.png"


@dataclasses.dataclass
class ProcessStats:
    """What one process did: images written and failed, seconds from the start to its pipeline ready
    (build and patch), the first image (capture, tuning, compile) and the rest (steady state)."""

    process: int
    device: str
    images: int = 0
    failed: int = 0
    setup_s: float = 0.0
    first_s: float = 0.0
    steady_s: float = 0.0
    memory: str = ""  # under a profile with a memory budget, on CUDA: one image's memory table

    @property
    def steady_images_per_s(self) -> float | None:
        """Images per second after the first (None with fewer than two)."""
        n = self.images + self.failed - 1
        return n / self.steady_s if n > 0 and self.steady_s > 0 else None


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

    @property
    def exit_code(self) -> int:
        return 1 if self.failed else 0

    def format(self) -> str:
        lines = [f"{self.written} images written, {self.failed} failed, {self.skipped} already there, "
                 f"in {self.seconds:.1f} s ({self.written / self.seconds if self.seconds else 0:.2f} images/s); "
                 f"manifest: {self.out / MANIFEST}"]
        for p in self.processes:
            rate = p.steady_images_per_s
            lines.append(f"  process {p.process} ({p.device}): {p.images} images, {p.failed} failed; set-up "
                         f"{p.setup_s:.1f} s, first image {p.first_s:.1f} s, then "
                         + (f"{rate:.2f} images/s" if rate else "-"))
            if p.memory:
                lines.append(p.memory)
        return "\n".join(lines)


def read_prompts(path: str | os.PathLike) -> list[str]:
    """The prompts of a text file, one per non-empty line; a clear error for an unreadable or empty file."""
    try:
        text = pathlib.Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--prompts {path}: cannot read it ({type(exc).__name__}: {exc})") from None
    prompts = [line.strip() for line in text.splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"--prompts {path}: no prompts in it (one per line)")
    return prompts


def plan(prompts: Sequence[str], seed: int) -> list[Job]:
    return [Job(i, p, seed + i) for i, p in enumerate(prompts)]


def read_manifest(out: pathlib.Path) -> list[dict[str, Any]]:
    """The manifest's entries (a line cut short by a crash is skipped)."""
    path = out / MANIFEST
    if not path.is_file():
        return []
    entries = []
    for line in path.read_text(encoding="utf-8").splitlines():
        with contextlib.suppress(ValueError):
            entry = json.loads(line)
            if isinstance(entry, dict):
                entries.append(entry)
    return entries


def already_done(out: pathlib.Path, jobs: Sequence[Job], identity: dict[str, Any]) -> set[int]:
    """Indices of ``jobs`` whose image the manifest lists as written, for the same prompt, seed, model,
    steps and size, with the file still there."""
    ok = {e.get("index"): e for e in read_manifest(out) if e.get("status") == "ok"}
    done = set()
    for job in jobs:
        entry = ok.get(job.index)
        want = {**identity, "prompt": job.prompt, "seed": job.seed}
        if entry and all(entry.get(k) == want[k] for k in _SAME) and (out / job.file).is_file():
            done.add(job.index)
    return done


def check_out(out: pathlib.Path) -> None:
    """Create ``out`` if needed and make sure files can be written there (before any model is built)."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: is a file; batch generation writes into a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".write-test-"):
            pass
    except OSError as exc:
        raise ValueError(f"--out {out}: cannot write there ({type(exc).__name__}: {exc})") from None


def _append(out: pathlib.Path, entry: dict[str, Any]) -> None:
    """One manifest line, in one write to a file opened for appending (processes share the file)."""
    data = (json.dumps(entry, ensure_ascii=False) + "\n").encode()
    fd = os.open(out / MANIFEST, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def _save_png(image, path: pathlib.Path, meta: dict[str, str]) -> None:
    from diffusers.utils import numpy_to_pil
    from PIL.PngImagePlugin import PngInfo

    info = PngInfo()
    for key, value in meta.items():
        info.add_text(key, value)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    numpy_to_pil(image[None])[0].save(tmp, format="PNG", pnginfo=info)
    os.replace(tmp, path)


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
    prompts: Sequence[str],
    out: str | os.PathLike,
    *,
    model: str | None = None,
    steps: int = 20,
    size: int | None = None,
    seed: int = 0,
    device: str | None = None,
    dtype: str | None = None,
    profile: str | None = None,
    compile: bool | str = False,
    progress: bool = True,
) -> Summary:
    """Generate one image per prompt into the folder ``out`` (see the module docstring): in this
    process, or, under ``accelerate launch``, spread over its processes. ``model``: a shipped config
    (random weights) or a local pipeline folder (default: sd15 on a GPU, tiny on the CPU); ``dtype``:
    "fp16", "bf16" or "fp32" (default fp16 on a GPU); ``seed``: prompt i gets ``seed + i`` (the random
    weights of a shipped config get ``seed``). Returns the run's Summary (the same in every process)."""
    import torch
    from accelerate.utils import broadcast_object_list, gather_object

    from sd_kernels import models

    if not prompts:
        raise ValueError("no prompts")
    out = pathlib.Path(out)
    check_out(out)
    state = _state(device)
    on_gpu = state.device.type == "cuda"
    name = model or models.default_model(on_gpu)
    shipped = name in models.list_configs()
    side = models.image_side(name, size)
    torch_dtype = getattr(torch, DTYPES[dtype_name(dtype, on_gpu)])
    if shipped and profile is not None:
        check_budget(name, torch_dtype, profile)
    identity = {"model": name, "steps": steps, "size": side}
    jobs = plan(prompts, seed)
    done = already_done(out, jobs, identity)
    todo = [j for j in jobs if j.index not in done]
    run = broadcast_object_list([uuid.uuid4().hex[:12]])[0]  # one id for every process's entries

    t0 = time.perf_counter()
    label = torch.cuda.get_device_name(state.device) if on_gpu else "cpu"
    stats = ProcessStats(state.process_index, f"{state.device} ({label})" if on_gpu else "cpu")
    with state.split_between_processes(todo) as mine:
        if mine:
            stats = _run_share(mine, out, name, shipped, steps, side, seed, torch_dtype, profile, compile, state,
                               stats, run, identity, progress and state.is_main_process, t0)
    every = gather_object([dataclasses.asdict(stats)])
    state.wait_for_everyone()
    processes = [ProcessStats(**s) for s in every]
    return Summary(out, sum(p.images for p in processes), sum(p.failed for p in processes), len(done),
                   time.perf_counter() - t0, processes, state.is_main_process)


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


def _run_share(mine, out, name, shipped, steps, side, seed, torch_dtype, profile, compile, state, stats, run,
               identity, progress, t0) -> ProcessStats:
    """This process's images: build and patch its pipeline, then one pipeline call per job."""
    import torch
    from tqdm.auto import tqdm

    import sd_kernels
    from sd_kernels import models

    def entry(job: Job, **fields) -> dict[str, Any]:  # one manifest line
        return {"index": job.index, "file": job.file, **identity, "prompt": job.prompt, "seed": job.seed,
                "process": state.process_index, "device": stats.device, "run": run, **fields}

    try:
        pipe = models.load_pipeline(name, device=state.device, dtype=torch_dtype, seed=seed)
        pipe.set_progress_bar_config(disable=True)
        record = sd_kernels.patch(pipe, profile=profile, compile=compile)
    except Exception as exc:  # every job of this share fails with the reason; the other processes go on
        error = f"pipeline set-up failed: {type(exc).__name__}: {exc}"
        log.warning("sd_kernels: generate: process %d: %s", state.process_index, error)
        for job in mine:
            _append(out, entry(job, status="error", error=error))
        stats.failed = len(mine)
        return stats
    args = record.arguments
    setup = f"patch(profile={record.profile!r}, cuda_graph={record.cuda_graph!r}, compile={args['compile']!r})"
    stats.setup_s = time.perf_counter() - t0
    weights = f"random weights from the shipped config {name!r}" if shipped else f"loaded from {name}"
    for i, job in enumerate(tqdm(mine, desc="images", disable=not progress)):
        t = time.perf_counter()
        line = entry(job, setup=setup)
        try:
            generator = torch.Generator(device="cpu").manual_seed(job.seed)
            measured = i == min(1, len(mine) - 1)  # the second image: the first also autotunes (one-time memory)
            with _measured(pipe, record, measured, f"{record.profile}, {side}x{side}, {steps} steps, image {i + 1}"
                           + (", the first: with one-time autotuning" if i == 0 else ""), stats):
                image = pipe(job.prompt, num_inference_steps=steps, height=side, width=side, generator=generator,
                             output_type="np").images[0]
            _save_png(image, out / job.file, {
                "Software": f"sd-kernels {sd_kernels.__version__}", "Prompt": job.prompt, "Seed": str(job.seed),
                "Model": name, "Weights": weights, "Steps": str(steps), "Size": f"{side}x{side}",
                "Setup": setup, "Device": stats.device})
            line.update(status="ok", seconds=round(time.perf_counter() - t, 4))
            stats.images += 1
        except Exception as exc:  # the run goes on; the manifest says what failed and why
            line.update(status="error", error=f"{type(exc).__name__}: {exc}",
                        seconds=round(time.perf_counter() - t, 4))
            stats.failed += 1
            log.warning("sd_kernels: generate: prompt %d failed: %s", job.index, line["error"])
            if isinstance(exc, torch.cuda.OutOfMemoryError):
                torch.cuda.empty_cache()
        _append(out, line)
        if i == 0:
            stats.first_s = time.perf_counter() - t
        else:
            stats.steady_s += time.perf_counter() - t
    return stats
