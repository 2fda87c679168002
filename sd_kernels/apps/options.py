"""What a generation run is asked for, read and checked before any work: the settings every image
shares, prompt files (text or JSONL), LoRA specs, scheduler names, seeds, and the plan of images.

Nothing here imports torch or diffusers: the command line parses and checks with this module alone.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import secrets
from collections.abc import Iterable, Sequence
from typing import Any

# The dtype names the commands and generate_images take (torch attribute names as values: the CLI's
# option parsing reads this table without importing torch).
DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
# patch(precision=...): "fp16" the lossless default (the model's own half precision, or --dtype's), "fp8" the
# transformer blocks' linear layers as FP8 GEMMs, FLUX's attention too (lossy; docs/fp8.md). patches.fp8.PRECISIONS,
# kept apart so that parsing the options imports no torch (tests/apps/test_generate_precision.py checks they agree)
PRECISIONS = ("fp16", "fp8")
RANDOM_SEED = -1  # --seed -1: a seed drawn for the run, printed and recorded in every image
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes [0, 2**64)
_RANDOM_SEED_BOUND = 2**32  # a drawn seed is easy to type back


@dataclasses.dataclass(frozen=True)
class Scheduler:
    """A scheduler by a familiar name: its diffusers class, the config changes it makes, and the
    sampler name AUTOMATIC1111's ``parameters`` text uses for it."""

    cls: str
    overrides: tuple[tuple[str, Any], ...]
    a1111: str


def _karras(cls: str, a1111: str, karras: bool, **extra: Any) -> Scheduler:
    return Scheduler(cls, (("use_karras_sigmas", karras), *extra.items()), a1111 + (" Karras" if karras else ""))


# Karras sigmas are set explicitly both ways: a model whose scheduler config has them on keeps them
# only under a "-karras" name.
SCHEDULERS: dict[str, Scheduler] = {
    "ddim": Scheduler("DDIMScheduler", (), "DDIM"),
    "ddpm": Scheduler("DDPMScheduler", (), "DDPM"),
    "pndm": Scheduler("PNDMScheduler", (), "PLMS"),
    "lms": _karras("LMSDiscreteScheduler", "LMS", False),
    "lms-karras": _karras("LMSDiscreteScheduler", "LMS", True),
    "euler": _karras("EulerDiscreteScheduler", "Euler", False),
    "euler-karras": _karras("EulerDiscreteScheduler", "Euler", True),
    "euler-a": Scheduler("EulerAncestralDiscreteScheduler", (), "Euler a"),
    "heun": _karras("HeunDiscreteScheduler", "Heun", False),
    "heun-karras": _karras("HeunDiscreteScheduler", "Heun", True),
    "dpm2": _karras("KDPM2DiscreteScheduler", "DPM2", False),
    "dpm2-karras": _karras("KDPM2DiscreteScheduler", "DPM2", True),
    "dpm2-a": _karras("KDPM2AncestralDiscreteScheduler", "DPM2 a", False),
    "dpm2-a-karras": _karras("KDPM2AncestralDiscreteScheduler", "DPM2 a", True),
    "dpm++2m": _karras("DPMSolverMultistepScheduler", "DPM++ 2M", False, algorithm_type="dpmsolver++"),
    "dpm++2m-karras": _karras("DPMSolverMultistepScheduler", "DPM++ 2M", True, algorithm_type="dpmsolver++"),
    "dpm++2m-sde": _karras("DPMSolverMultistepScheduler", "DPM++ 2M SDE", False, algorithm_type="sde-dpmsolver++"),
    "dpm++2m-sde-karras": _karras("DPMSolverMultistepScheduler", "DPM++ 2M SDE", True,
                                  algorithm_type="sde-dpmsolver++"),
    "dpm++2s": _karras("DPMSolverSinglestepScheduler", "DPM++ 2S", False),
    "dpm++2s-karras": _karras("DPMSolverSinglestepScheduler", "DPM++ 2S", True),
    "unipc": _karras("UniPCMultistepScheduler", "UniPC", False),
    "deis": _karras("DEISMultistepScheduler", "DEIS", False),
}


def scheduler_name(cls: str, config: dict[str, Any]) -> str:
    """The familiar name of a scheduler class with ``config`` (the model's own scheduler), or the
    class name where none of ``SCHEDULERS`` is it."""
    for name, s in SCHEDULERS.items():
        if s.cls == cls and all(config.get(k, False if k == "use_karras_sigmas" else v) == v for k, v in s.overrides):
            return name
    return cls


@dataclasses.dataclass(frozen=True)
class Lora:
    """``--lora PATH[:SCALE]``: a LoRA file (or diffusers LoRA folder) and its weight (default 1)."""

    path: str
    scale: float = 1.0

    def __str__(self) -> str:
        return f"{self.path}:{self.scale:g}"


def parse_lora(text: str) -> Lora:
    """``PATH`` or ``PATH:SCALE``; a part after the last colon that is not a number belongs to the path
    (``C:\\loras\\x.safetensors``). A clear ValueError naming --lora for a missing file or a bad scale."""
    path, sep, tail = text.rpartition(":")
    scale = 1.0
    if sep:
        try:
            scale = float(tail)
        except ValueError:
            path = text
        else:
            if not math.isfinite(scale):
                raise ValueError(f"--lora {text}: the scale must be a finite number, got {tail!r}")
    else:
        path = text
    if not path:
        raise ValueError(f"--lora {text!r}: no path (PATH or PATH:SCALE)")
    if not os.path.exists(path):
        raise ValueError(f"--lora {text}: no such file or folder {path!r}")
    return Lora(path, scale)


@dataclasses.dataclass(frozen=True)
class PromptSpec:
    """One prompt of a run and what its line of a JSONL file sets for it (None: the run's setting)."""

    prompt: str
    negative: str | None = None
    seed: int | None = None
    width: int | None = None
    height: int | None = None
    steps: int | None = None
    guidance: float | None = None
    where: str = ""  # "--prompt", or "FILE line N": what an error names


@dataclasses.dataclass
class Settings:
    """What every image of a run shares unless a prompt's JSONL line sets it (the command line's
    options; ``generate_images``'s keywords). None: the model's own value (its native size, its
    pipeline's guidance scale, its scheduler)."""

    model: str | None = None
    config: str | None = None  # a single-file checkpoint's architecture: a shipped config or a diffusers folder
    steps: int = 20
    width: int | None = None
    height: int | None = None
    guidance: float | None = None
    negative: str | None = None
    scheduler: str | None = None
    seed: int = 0  # RANDOM_SEED: drawn once per run
    images_per_prompt: int = 1
    batch_size: int = 1
    loras: tuple[Lora, ...] = ()
    image: str | None = None  # img2img / inpaint: the initial image
    mask: str | None = None  # inpaint: white where the image is repainted
    strength: float | None = None  # img2img / inpaint: how much of the initial image is noised away
    dtype: str | None = None
    device: str | None = None
    profile: str | None = None
    compile: bool | str = False
    precision: str = "fp16"

    @property
    def task(self) -> str:
        return "inpaint" if self.mask else "img2img" if self.image else "text2img"

    def check(self) -> None:
        """Every value on its own ground, each error naming its option (before any work)."""
        for name, value in (("--steps", self.steps), ("--images-per-prompt", self.images_per_prompt),
                            ("--batch-size", self.batch_size)):
            _positive(name, value)
        for name, value in (("--width", self.width), ("--height", self.height)):
            if value is not None:
                side(name, value)
        if self.guidance is not None:
            guidance("--guidance-scale", self.guidance)
        if self.scheduler is not None and self.scheduler not in SCHEDULERS:
            raise ValueError(f"--scheduler {self.scheduler!r}: unknown; one of {', '.join(SCHEDULERS)}")
        if self.seed != RANDOM_SEED and not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"--seed {self.seed}: a seed is in [0, 2**64 - 1], or -1 for a random one")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"--dtype {self.dtype!r}: one of {', '.join(DTYPES)}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"--precision {self.precision!r}: one of {', '.join(PRECISIONS)}")
        if self.mask and not self.image:
            raise ValueError("--mask repaints part of an --image: give the image too")
        if self.strength is not None:
            if not self.image:
                raise ValueError("--strength is how much of an --image to change: give the image too")
            if not (isinstance(self.strength, int | float) and 0 < self.strength <= 1):
                raise ValueError(f"--strength {self.strength}: a number in (0, 1]")
        for name, path in (("--image", self.image), ("--mask", self.mask)):
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"{name} {path}: no such file")


def resolve_seed(seed: int) -> tuple[int, bool]:
    """(the run's seed, whether it was drawn): ``RANDOM_SEED`` draws one."""
    if seed == RANDOM_SEED:
        return secrets.randbelow(_RANDOM_SEED_BOUND), True
    return seed, False


def dtype_name(name: str | None, on_gpu: bool) -> str:
    """``name``, or the default: fp16 on a GPU, fp32 on the CPU."""
    return name or ("fp16" if on_gpu else "fp32")


def device_and_dtype(device: str | None, dtype: str | None) -> tuple[str, str]:
    """``--device`` and ``--dtype`` with their defaults (the GPU and fp16 when there is one)."""
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda asked for, but torch sees no CUDA GPU")
    return device, dtype_name(dtype, device == "cuda")


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} {value!r}: a positive integer")
    return value


def side(name: str, value: Any) -> int:
    """An image side: a positive integer, a multiple of 8 (the VAE's scale factor)."""
    _positive(name, value)
    if value % 8:
        raise ValueError(f"{name} {value}: the image side must be a multiple of 8 (the VAE's scale factor)")
    return value


def guidance(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} {value!r}: a finite number >= 0")
    return float(value)


def square(size: int | None, width: int | None, height: int | None) -> tuple[int | None, int | None]:
    """``--size`` (the square shorthand) or ``--width``/``--height``, not both."""
    if size is None:
        return width, height
    if width is not None or height is not None:
        raise ValueError("--size is the square shorthand for --width and --height: give one or the others")
    side("--size", size)  # named as the user typed it (the checks after see --width)
    return size, size


# ---------------------------------------------------------------------------------------------------------
# Prompt files

_FIELDS = {"prompt", "negative", "seed", "size", "width", "height", "steps", "guidance"}


def prompt_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) for each line of ``text``: split on "\\n" and "\\r\\n" only (a form feed,
    NEL or U+2028 inside a line is part of the prompt), a UTF-8 byte-order mark dropped."""
    text = text.removeprefix("\ufeff")
    return [(n, line.removesuffix("\r")) for n, line in enumerate(text.split("\n"), 1)]


def read_prompts(path: str | os.PathLike) -> list[PromptSpec]:
    """The prompts of a file: a text file has one per non-empty line; a ``.jsonl`` file one JSON object
    per non-empty line with ``prompt`` and, optionally, ``negative``, ``seed``, ``size`` or
    ``width``/``height``, ``steps`` and ``guidance``. A clear error naming the file and line for an
    unreadable or empty file or a bad line."""
    path = pathlib.Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--prompts {path}: cannot read it ({type(exc).__name__}: {exc})") from None
    jsonl = path.suffix.lower() == ".jsonl"
    specs = []
    for n, line in prompt_lines(text):
        if not line.strip():
            continue
        where = f"--prompts {path} line {n}"
        specs.append(_json_spec(line, where) if jsonl else PromptSpec(line.strip(), where=where))
    if not specs:
        raise ValueError(f"--prompts {path}: no prompts in it ({'one JSON object' if jsonl else 'one'} per line)")
    return specs


def _json_spec(line: str, where: str) -> PromptSpec:
    try:
        obj = json.loads(line)
    except ValueError as exc:
        raise ValueError(f"{where}: not JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: a JSON object is expected, got {type(obj).__name__}")
    unknown = sorted(set(obj) - _FIELDS)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; keys: {', '.join(sorted(_FIELDS))}")
    prompt = obj.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f"{where}: 'prompt' must be a non-empty string")
    negative = obj.get("negative")
    if negative is not None and not isinstance(negative, str):
        raise ValueError(f"{where}: 'negative' must be a string")
    seed = obj.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED):
        raise ValueError(f"{where}: 'seed' must be an integer in [0, 2**64 - 1], got {seed!r}")
    size = obj.get("size")
    if size is not None and ("width" in obj or "height" in obj):
        raise ValueError(f"{where}: 'size' is the square shorthand for 'width' and 'height': give one or the others")
    width = obj.get("width", size)
    height = obj.get("height", size)
    for key, value in (("width" if size is None else "size", width), ("height" if size is None else "size", height)):
        if value is not None:
            side(f"{where}: '{key}'", value)
    steps = obj.get("steps")
    if steps is not None:
        _positive(f"{where}: 'steps'", steps)
    scale = obj.get("guidance")
    if scale is not None:
        scale = guidance(f"{where}: 'guidance'", scale)
    return PromptSpec(prompt.strip(), negative, seed, width, height, steps, scale, where)


# ---------------------------------------------------------------------------------------------------------
# The plan: one Job per image


@dataclasses.dataclass(frozen=True)
class Job:
    """One image: number ``index`` of the run (its file name), from a prompt with everything set."""

    index: int
    prompt: str
    negative: str | None
    seed: int
    width: int
    height: int
    steps: int
    guidance: float

    @property
    def file(self) -> str:
        return f"{self.index:05d}.png"

    @property
    def shape(self) -> tuple:
        """What images batched into one pipeline call must share. A missing negative prompt is not an
        empty one (SDXL zeroes the negative embedding for None), so it is part of the shape."""
        return self.width, self.height, self.steps, self.guidance, self.negative is None


def plan(specs: Sequence[PromptSpec], settings: Settings, seed: int, size: tuple[int, int],
         default_guidance: float) -> list[Job]:
    """Every image of the run: image ``k`` of prompt ``i`` is number ``i * N + k`` (N images per prompt)
    with seed ``seed + i * N + k``, or ``s + k`` for a prompt whose line sets seed ``s``; ``size`` is the
    run's (the model's where not set), the guidance scale ``settings``' or ``default_guidance``. A
    ValueError naming --seed (or the line) where a seed would pass 2**64 - 1, before any work."""
    n = settings.images_per_prompt
    guidance_scale = settings.guidance if settings.guidance is not None else default_guidance
    jobs = []
    for i, spec in enumerate(specs):
        first = seed + i * n if spec.seed is None else spec.seed
        if first + n - 1 > MAX_SEED:
            what = "--seed" if spec.seed is None else f"{spec.where}: 'seed'"
            raise ValueError(f"{what}: image {i * n + n - 1} would get seed {first + n - 1}, past 2**64 - 1 "
                             f"(each image takes the next seed); give a smaller seed")
        negative = spec.negative if spec.negative is not None else settings.negative
        scale = spec.guidance if spec.guidance is not None else guidance_scale
        if negative and scale <= 1:  # diffusers drops the negative prompt without guidance
            what = spec.where if spec.negative is not None or spec.guidance is not None else "--negative-prompt"
            raise ValueError(f"{what}: a negative prompt works only with a guidance scale above 1 (here {scale:g})")
        for k in range(n):
            jobs.append(Job(i * n + k, spec.prompt, negative, first + k, spec.width or size[0],
                            spec.height or size[1], spec.steps or settings.steps, scale))
    return jobs


def batches(jobs: Iterable[Job], batch_size: int) -> list[list[Job]]:
    """``jobs`` in pipeline calls of at most ``batch_size`` images that share a shape, in order of
    their first image."""
    groups: dict[tuple, list[Job]] = {}
    for job in jobs:
        groups.setdefault(job.shape, []).append(job)
    out = [group[i:i + batch_size] for group in groups.values() for i in range(0, len(group), batch_size)]
    return sorted(out, key=lambda b: b[0].index)
