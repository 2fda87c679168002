"""The pipeline of a generation run: what the model is, read from its configs and checked against the
run's settings before any work (``inspect``); then built, given its scheduler and LoRAs and made the
task's pipeline, text-to-image, img2img or inpaint (``load``); then called on a batch of images that
share a shape (``render``)."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import inspect as pyinspect
import pathlib
from collections.abc import Sequence
from typing import Any

from sd_kernels import models
from sd_kernels.apps import metadata
from sd_kernels.apps.options import SCHEDULERS, Job, Settings, scheduler_name


@dataclasses.dataclass
class Model:
    """A run's model before it is built: everything the images' settings and records need from it."""

    name: str  # as given: a shipped config, a .safetensors file, a folder or a hub id
    shipped: bool  # random weights from a shipped config
    config: str | None  # a single file's architecture (a shipped config or a diffusers folder)
    pipeline: str  # the diffusers class that makes the run's images (the task's)
    size: tuple[int, int]  # (width, height) without --width/--height: the model's own, or the --image's
    guidance: float  # the task pipeline's default guidance scale
    scheduler: str  # a familiar name (options.SCHEDULERS) or the class name of the model's own
    strength: float | None  # img2img / inpaint: --strength, or the task pipeline's default
    takes_size: bool  # whether the task pipeline's call takes height and width
    loras: list[dict[str, Any]]  # path, scale, sha256
    image: dict[str, Any] | None  # path, sha256
    mask: dict[str, Any] | None  # path, sha256
    # whether guidance above 1 runs the denoiser on [unconditional; conditional] (classifier-free guidance);
    # not in guidance-distilled pipelines (FLUX: its scale is an input of one call; true CFG is two calls)
    guidance_batch: bool = True
    # whether the denoiser has a context-parallel plan: diffusers' own (FLUX) or sd_kernels' (SD3, PixArt-Σ)
    context_parallel: bool = False
    ring: bool = False  # whether that plan is diffusers' own (the ring exchange runs under it)

    @property
    def weights(self) -> str:
        return f"random weights from the shipped config {self.name!r}" if self.shipped else f"loaded from {self.name}"


def _task_class(pipeline: str, task: str) -> type:
    import diffusers
    from diffusers.pipelines import auto_pipeline

    if task == "text2img":
        return getattr(diffusers, pipeline)
    mapping = {"img2img": auto_pipeline.AUTO_IMAGE2IMAGE_PIPELINES_MAPPING,
               "inpaint": auto_pipeline.AUTO_INPAINT_PIPELINES_MAPPING}[task]
    cls = auto_pipeline._get_task_class(mapping, pipeline, False)
    if cls is None:
        option = "--mask" if task == "inpaint" else "--image"
        raise ValueError(f"{option}: diffusers has no {task} pipeline for a {pipeline}")
    return cls


def _sha256_of(path: str) -> str:
    """A file's SHA-256; a folder's: of its safetensors files' hashes in name order."""
    p = pathlib.Path(path)
    if p.is_file():
        return metadata.file_sha256(p)
    digest = hashlib.sha256()
    for f in sorted(p.glob("*.safetensors")):
        digest.update(metadata.file_sha256(f).encode())
    return digest.hexdigest()


def inspect(settings: Settings, name: str) -> Model:
    """The model ``name`` for ``settings``, read from its configs (nothing built, no weights read); a
    ValueError naming the option for a setting the model cannot take."""
    config = models.check_single_file(name, settings.config) if models.is_single_file(name) else None
    if config is None and settings.config is not None:
        raise ValueError(f"--config {settings.config}: names a single-file checkpoint's architecture; --model "
                         f"{name} is not a .safetensors file")
    facts = models.model_facts(config or name)
    cls = _task_class(facts["pipeline"], settings.task)
    params = pyinspect.signature(cls.__call__).parameters
    if "guidance_scale" not in params:
        raise ValueError(f"a {cls.__name__} takes no guidance scale")  # every pipeline sd-kernels patches does
    guidance_batch = "true_cfg_scale" not in params
    if settings.negative is not None and ("negative_prompt" not in params or not guidance_batch):
        raise ValueError(f"--negative-prompt: a {cls.__name__} takes no negative prompt with its guidance")
    strength = None
    if settings.image:
        strength = settings.strength if settings.strength is not None else params["strength"].default
    if settings.loras and importlib.util.find_spec("peft") is None:
        raise ValueError("--lora: diffusers loads LoRAs through peft, which is not installed (pip install peft)")
    size = facts["size"]
    if settings.image:
        from PIL import Image

        try:
            with Image.open(settings.image) as im:
                size = (im.width // 8 * 8, im.height // 8 * 8)  # diffusers' own rounding of an initial image
            if settings.mask:
                Image.open(settings.mask).close()
        except OSError as exc:
            raise ValueError(f"--image/--mask: cannot read it as an image ({exc})") from None
        if min(size) < 8:
            raise ValueError(f"--image {settings.image}: smaller than 8 pixels on a side")
    return Model(
        name=name, shipped=name in models.list_configs(), config=config, pipeline=cls.__name__, size=size,
        guidance=float(params["guidance_scale"].default), scheduler=_scheduler(facts, settings.scheduler),
        strength=strength, takes_size="height" in params,
        loras=[{"path": x.path, "scale": x.scale, "sha256": _sha256_of(x.path)} for x in settings.loras],
        image={"path": settings.image, "sha256": _sha256_of(settings.image)} if settings.image else None,
        mask={"path": settings.mask, "sha256": _sha256_of(settings.mask)} if settings.mask else None,
        guidance_batch=guidance_batch, context_parallel=_has_cp_plan(cls), ring=_has_cp_plan(cls, own=False))


def _has_cp_plan(cls: type, own: bool = True) -> bool:
    """Whether the denoiser class a pipeline class is built with (its ``__init__``'s annotation) has a
    context-parallel plan: diffusers' own (FLUX) or (``own``) sd_kernels' (SD3, PixArt-Σ)."""
    from sd_kernels.patches.context_parallel_plans import PLANNED

    params = pyinspect.signature(cls.__init__).parameters
    denoiser = params.get("transformer") or params.get("unet")
    if denoiser is None:
        return False
    return getattr(denoiser.annotation, "_cp_plan", None) is not None or (
        own and getattr(denoiser.annotation, "__name__", None) in PLANNED)


def _scheduler(facts: dict[str, Any], name: str | None) -> str:
    """The scheduler the run records: ``name`` if the model's scheduler can be swapped for it (a
    ValueError naming --scheduler otherwise), else the model's own."""
    if name is None:
        return scheduler_name(facts["scheduler"], facts["scheduler_config"])
    import diffusers

    spec = SCHEDULERS[name]
    own = getattr(diffusers, facts["scheduler"], None)
    fits = {facts["scheduler"], *getattr(own, "_compatibles", ())}
    if spec.cls not in fits:
        raise ValueError(f"--scheduler {name}: a {spec.cls} cannot replace this model's {facts['scheduler']}")
    cls = getattr(diffusers, spec.cls)
    if type(cls).__name__ == "DummyObject":  # diffusers' stand-in for a class whose extra package is missing
        missing = [b for b in cls._backends if importlib.util.find_spec(b) is None]
        raise ValueError(f"--scheduler {name}: {spec.cls} needs {', '.join(missing)} (pip install {' '.join(missing)})")
    return name


# A shipped config's random weights are always these (not the run's seed): an image's records (model
# name and seed) make it again, from a batch run or a single one.
WEIGHTS_SEED = 0


def load(model: Model, device: Any, torch_dtype: Any):
    """The pipeline that makes the run's images: built or loaded on ``device`` in ``torch_dtype``, with
    the run's scheduler and LoRAs, as the task's pipeline; its progress bar off."""
    import diffusers

    pipe = models.load_pipeline(model.name, device=device, dtype=torch_dtype, seed=WEIGHTS_SEED,
                                config=model.config)
    if model.scheduler in SCHEDULERS:
        spec = SCHEDULERS[model.scheduler]
        pipe.scheduler = getattr(diffusers, spec.cls).from_config(pipe.scheduler.config, **dict(spec.overrides))
    if model.loras:
        names = [f"lora{i}" for i in range(len(model.loras))]
        for lora, adapter in zip(model.loras, names):
            pipe.load_lora_weights(lora["path"], adapter_name=adapter)
        pipe.set_adapters(names, adapter_weights=[lora["scale"] for lora in model.loras])
    if type(pipe).__name__ != model.pipeline:
        pipe = getattr(diffusers, model.pipeline).from_pipe(pipe)
    pipe.set_progress_bar_config(disable=True)
    return pipe


class InitImages:
    """The --image (and --mask) resized to each image size a run asks for, made once per size."""

    def __init__(self, model: Model) -> None:
        self.model = model
        self._made: dict[tuple[int, int], dict[str, Any]] = {}

    def call_arguments(self, width: int, height: int) -> dict[str, Any]:
        if self.model.image is None:
            return {}
        if (width, height) not in self._made:
            from PIL import Image

            def fit(path: str, mode: str) -> Image.Image:
                with Image.open(path) as im:
                    im = im.convert(mode)
                    return im if im.size == (width, height) else im.resize((width, height), Image.LANCZOS)

            made = {"image": fit(self.model.image["path"], "RGB"), "strength": self.model.strength}
            if self.model.mask is not None:
                made["mask_image"] = fit(self.model.mask["path"], "L")
            self._made[(width, height)] = made
        return self._made[(width, height)]


def render(pipe, jobs: Sequence[Job], model: Model, init: InitImages) -> list[Any]:
    """One pipeline call for ``jobs`` (a batch that shares a shape: ``options.batches``), each image with
    its own generator, so that its initial noise does not depend on the batch; HxWx3 float arrays."""
    import torch

    one, first = len(jobs) == 1, jobs[0]

    def each(values: list[Any]) -> Any:  # a batch of one is called as a single image always was
        return values[0] if one else values

    kwargs: dict[str, Any] = {
        "prompt": each([j.prompt for j in jobs]), "num_inference_steps": first.steps, "guidance_scale": first.guidance,
        "generator": each([torch.Generator(device="cpu").manual_seed(j.seed) for j in jobs]), "output_type": "np"}
    if first.negative is not None:
        kwargs["negative_prompt"] = each([j.negative for j in jobs])
    if model.takes_size:
        kwargs.update(height=first.height, width=first.width)
    for key, value in init.call_arguments(first.width, first.height).items():
        kwargs[key] = value if key == "strength" else each([value] * len(jobs))
    if "clean_caption" in pyinspect.signature(type(pipe).__call__).parameters and not _caption_cleaning():
        kwargs["clean_caption"] = False  # what PixArt's pipelines fall back to, less a warning per prompt
    return list(pipe(**kwargs).images)


def _caption_cleaning() -> bool:
    """Whether PixArt's ``clean_caption=True`` (its default) can run: it needs Beautiful Soup and ftfy."""
    from diffusers.utils import is_bs4_available, is_ftfy_available

    return is_bs4_available() and is_ftfy_available()


def fields(job: Job, model: Model, run: dict[str, Any]) -> dict[str, Any]:
    """Everything an image's records hold (metadata.records): the job's own settings, the model's, and
    the run's (``run``: dtype, precision, profile, setup, parallel, processes, device, version)."""
    return {"prompt": job.prompt, "negative": job.negative, "seed": job.seed, "steps": job.steps,
            "guidance": job.guidance, "width": job.width, "height": job.height, "scheduler": model.scheduler,
            "sampler": SCHEDULERS[model.scheduler].a1111 if model.scheduler in SCHEDULERS else model.scheduler,
            "model": model.name, "config": model.config, "weights": model.weights, "pipeline": model.pipeline,
            "loras": model.loras, "image": model.image, "mask": model.mask, "strength": model.strength, **run}


def setup_text(record: Any) -> str:
    """The patch's set-up as an image records it (``precision`` and ``parallel`` where set)."""
    more = "".join(f", {k}={v!r}" for k, v in (("precision", record.precision), ("parallel", record.parallel)) if v)
    return (f"patch(profile={record.profile!r}, cuda_graph={record.cuda_graph!r}, "
            f"compile={record.arguments['compile']!r}{more})")


def run_fields(dtype: str, record: Any, device: str, parallel: str | None = None, processes: int = 1) -> dict[str, Any]:
    """What every image of a run records of how it was made (see ``fields``): ``parallel``, the
    one-image split over ``processes`` processes that made it (``generate --parallel``), or None."""
    import sd_kernels

    return {"dtype": dtype, "precision": record.precision or "fp16", "profile": record.profile,
            "setup": setup_text(record), "parallel": parallel, "processes": processes, "device": device,
            "version": sd_kernels.__version__}
