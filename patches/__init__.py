"""The drop-in patch for diffusers pipelines: ``patch``, ``unpatch``, ``patched``, ``report``.

``patch(obj)`` takes a diffusers pipeline or a bare model of a family it knows (patches/families.py)
and routes the parts it knows through sd_kernels' ops, one op family at a time (patches/registry.py).
It is idempotent and exactly reversible: every change goes through the record that hangs on the
patched object (patches/record.py), and ``unpatch`` replays it backwards, so outputs are
bit-identical to a never-patched model. ``cuda_graph=`` also replays the model calls from CUDA graphs
(patches/cuda_graph.py); ``parallel="cfg"`` splits one image's guidance batch over processes
(patches/cfg_parallel.py); ``enable_context_parallel`` splits one image's tokens (Ulysses), with plans
for SD3 and PixArt-Σ (patches/context_parallel_plans.py); ``enable_split_decode`` splits the VAE decode's
rows over them (patches/split_decode.py). Patch and unpatch wait for calls in flight on
other threads and hold new ones off (patches/call_gate.py). docs/patch.md has the whole story.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator

import torch.nn as nn

from sd_kernels.profiles import Profile, get_profile

from . import (
    bf16_decode,
    call_gate,
    cfg_parallel,
    context_parallel,
    families,
    fp8,
    fp8_conv,
    memory_budget,
    split_decode,
    t5_encoder,
    text_padding,
)
from . import cuda_graph as cuda_graph_mod
from .context_parallel_plans import check_split, enable_context_parallel
from .families import GRAPH_PARTS, PARTS, SUPPORTED_MODELS
from .memory_budget import memory_plan
from .record import PatchRecord
from .registry import PATCHERS, patch_order

__all__ = ["GRAPH_PARTS", "PARTS", "PATCHERS", "SUPPORTED_MODELS", "enable_context_parallel", "enable_split_decode",
           "memory_plan", "offload_originals", "patch", "patch_record", "patched", "report", "unpatch"]
log = logging.getLogger(__name__)

# Components that hold a pipeline's denoiser: left unpatched, they are warned about, not only recorded.
DENOISER_PARTS = ("unet", "transformer", "transformer_2", "prior")
_ATTR = "_sd_kernels_patch"  # on the patched object: its record
_OWNER = "_sd_kernels_owner"  # on each patched model: the record that patched it


def patch(obj: object, profile: str | Profile | None = None, ops: Iterable[str] | None = None,
          ignore: Iterable[str] = (), cuda_graph: bool | str = cuda_graph_mod.AUTO,
          compile: bool | str = False, parallel: str | None = None, precision: str | None = None) -> PatchRecord:
    """Route ``obj``'s supported parts through sd_kernels; returns the record (``.format()``).

    ``profile``: a name, a JSON path or a Profile (default: detected); ``ops``: op families of
    ``PATCHERS`` (default: all); ``ignore``: pipeline parts to leave alone; ``cuda_graph``: which
    model calls are replayed from CUDA graphs ("auto", True = "pipeline", "step", "unet", False);
    ``compile``: the graphs capture ``torch.compile`` of what they replay (True = "default",
    "max-autotune"); ``parallel``: "cfg" splits the denoiser's guidance batch over the processes of
    torch.distributed's default group (every process patches alike; docs/parallel.md); ``precision``:
    "fp8" also runs the transformer blocks' linear layers as FP8 GEMMs, attention staying exact, and the
    decode a pipeline upcasts to fp32 (SDXL's) in bf16 (lossy, opt-in: docs/fp8.md; None or "fp16", the
    default: lossless). docs/patch.md describes each.
    The same patch asked again changes nothing; another one unpatches first. Nothing is half-patched:
    if a patcher raises, what was done is undone.
    """
    for name, value in (("ops", ops), ("ignore", ignore)):
        if isinstance(value, str):
            raise TypeError(f"{name}= takes a list of names, got the string {value!r} "
                            f"(did you mean {name}=[{value!r}]?)")
    cuda_graph_mod.check_request(cuda_graph, compile)
    parallel = cfg_parallel.mode_of(parallel)
    precision = fp8.check_precision(precision)
    ops, ignore = tuple(sorted(PATCHERS if ops is None else set(ops))), tuple(ignore)
    if unknown := set(ops) - set(PATCHERS):
        raise ValueError(f"unknown ops {sorted(unknown)}; available: {', '.join(sorted(PATCHERS))}")
    models, others = families.models_of(obj, ignore)
    if precision == "fp8":
        fp8.check_models(models)
    prof = get_profile(profile)  # the patched model's own: its modules run under it, not the process default
    plan = memory_plan(obj, prof)  # a budget the weights cannot meet raises here, before any change
    denoisers = [model for _, model in models if families.is_denoiser(model)]
    mode, compile = cuda_graph_mod.resolve(cuda_graph, compile, denoisers, prof, plan, type(obj).__name__, ignore)
    held = patch_record(obj)
    with call_gate.exclusive(obj, [m for _, m in models] + (held.models if held else [])):
        old = patch_record(obj)
        for part, model in models:  # pipelines may share models: one patch per model at a time
            if getattr(model, _OWNER, old) is not old:
                raise ValueError(f"the {part} of this {type(obj).__name__} is already patched through another "
                                 "object (a pipeline sharing it, or the bare model): unpatch that one first")
        # collectives (every process patches): after the checks a single process could fail alone
        group = cfg_parallel.check_setup(models, prof, ops, mode, compile) if parallel else None
        check_split(models)
        context_parallel.check_setup(models, prof, ops, mode, compile)
        scheduler = getattr(obj, "scheduler", None) if mode in cuda_graph_mod.PIPELINE_MODES else None
        record = PatchRecord(ops, prof.name, [p for p, _ in models], mode, compile, profile_spec=prof,
                             models=[m for _, m in models], ignore=ignore, scheduler=scheduler, memory_plan=plan,
                             target=obj, parallel=parallel, precision=precision)
        if old is not None and old.request == record.request:
            return old
        if old is not None:
            unpatch(obj)
        _note_others(obj, models, others, record)
        try:
            _apply(obj, models, record)
            if parallel:  # last: it wraps the denoiser's forward as the patch left it (graphed or not)
                cfg_parallel.install(obj, models, record, group)
        except BaseException:
            record.undo()
            raise
        object.__setattr__(obj, _ATTR, record)
        return record


def _apply(obj: object, models: list[tuple[str, nn.Module]], record: PatchRecord) -> None:
    """Every change of the patch, through ``record``: each model's op families, in their order, then
    the pipeline's T5 encoder, prompt trimming, CUDA graphs and weights moved in and out under a budget."""
    for part, model in models:
        record.scope = part  # skipped modules' paths start with it
        record.set_attr(model, _OWNER, record, kind=None)
        _patch_model(model, record)
        if record.precision == "fp8":  # last: it quantizes the Linears the op families left (theirs too)
            fp8.patch_fp8(model, record)
            if families.is_denoiser(model):  # the ResNet blocks' 3×3 convolutions, the denoiser's only
                fp8_conv.patch_convs(model, record)
    t5_encoder.install_all(obj, record)
    text_padding.install_all(obj, models, record)
    cuda_graph_mod.install_mode(obj, models, record)
    bf16_decode.install(obj, _patch_model, record)  # the FP8 tier's decode where the pipeline upcasts to fp32
    if record.memory_plan is not None and record.memory_plan.swapped:
        memory_budget.install_swap(obj, record)


def _patch_model(model: nn.Module, record: PatchRecord) -> None:
    """The record's op families on ``model``, in their order."""
    for op in patch_order(record.ops):
        PATCHERS[op](model, record)


def _note_others(obj: object, models: list, others: list[tuple[str, str]], record: PatchRecord) -> None:
    """The models no family names, in the record; a denoiser among them is also a logged warning."""
    for part, name in others:
        record.skip(part, name, f"left as diffusers ships it: not a supported model ({', '.join(SUPPORTED_MODELS)})")
        if part in DENOISER_PARTS:
            log.warning("sd_kernels: patch: the %s of this %s (%s) runs as diffusers ships it: sd_kernels has no "
                        "family for it yet (only the parts %s are patched)", part, type(obj).__name__, name,
                        ", ".join(p for p, _ in models) or "none")


def unpatch(obj: object) -> bool:
    """Undo ``patch(obj)`` exactly; returns False if ``obj`` was not patched. A model patched as part of
    a pipeline that has replaced it since: that pipeline's patch is undone (``_unpatch_replaced``)."""
    record: PatchRecord | None = getattr(obj, _ATTR, None)
    if record is None:
        return _unpatch_replaced(obj)
    with call_gate.exclusive(obj, record.models, "unpatch"):
        if getattr(obj, _ATTR, None) is not record:  # unpatched (or patched anew) by another thread meanwhile
            return unpatch(obj)
        record.undo()
        object.__delattr__(obj, _ATTR)
    return True


def _unpatch_replaced(model: object) -> bool:
    """A model patched through a pipeline: refused while that pipeline holds it (only the pipeline's
    patch undoes it); once the pipeline holds another model in its place, that stale patch is undone
    (the pipeline's other parts with it: its next ``patch`` patches the new model), so the replaced
    model can always be had back unpatched."""
    owner: PatchRecord | None = vars(model).get(_OWNER) if isinstance(model, nn.Module) else None
    if owner is None:
        return False
    target = owner.target()
    held = getattr(target, "components", None) or {}
    part = next((p for p, m in held.items() if m is model), None)
    if part is not None:
        raise ValueError(f"this {type(model).__name__} was patched as the {part} of a {type(target).__name__}: "
                         f"unpatch that pipeline (or patch it with ignore=[{part!r}])")
    log.warning("sd_kernels: unpatch: this %s was patched as part of a %s that holds another model in its place "
                "now: that patch is undone (patch the pipeline again for its new model)", type(model).__name__,
                type(target).__name__ if target is not None else "pipeline")
    if target is not None and getattr(target, _ATTR, None) is owner:
        return unpatch(target)
    with call_gate.exclusive(model, owner.models, "unpatch"):  # the pipeline is gone: the record alone
        owner.undo()
    return True


def offload_originals(obj: object) -> PatchRecord:
    """After ``patch(obj, precision="fp8")``: the original weights its FP8 layers keep for an exact unpatch
    move to the CPU's memory, so that on the GPU the tier holds its FP8 codes (about half the weights' bytes)
    in their place rather than beside them (docs/fp8.md). ``unpatch`` brings them back bit for bit. The
    record's ``fp8:`` line says how much moved. Returns the patch's record."""
    record = patch_record(obj)
    if record is None or record.precision != "fp8":
        raise ValueError(f"offload_originals: patch this {type(obj).__name__} with precision='fp8' first (the "
                         "weights it moves are the ones the FP8 layers keep for an exact unpatch)")
    with call_gate.exclusive(obj, record.models, "offload_originals"):
        fp8.offload_originals(record)
    return record


def enable_split_decode(obj: object) -> PatchRecord:
    """Split the VAE decode of the patched pipeline ``obj`` over the processes of torch.distributed's
    default group: each decodes 1/W of the image's rows and every process ends with the whole image
    (patches/split_decode.py). For one image over several processes (``patch(pipe, parallel="cfg")``,
    ``enable_context_parallel``), where every process holds the same latents; called alike on every
    process, after ``patch``; ``unpatch`` undoes it (a later ``patch`` with other arguments too). Returns
    the patch's record."""
    record = patch_record(obj)
    if record is None:
        raise ValueError(f"enable_split_decode: patch this {type(obj).__name__} first (the split is part of the "
                         "patch, and unpatch undoes it)")
    with call_gate.exclusive(obj, record.models, "enable_split_decode"):
        split_decode.enable(obj, record)
    return record


def patch_record(obj: object) -> PatchRecord | None:
    return getattr(obj, _ATTR, None)


def report(obj: object, **kwargs) -> str:
    """What ``patch(obj, **kwargs)`` replaces and leaves alone (``PatchRecord.format``), for
    ``sd-kernels info``; ``obj`` is left as it was. An already patched ``obj`` reports its record."""
    record = patch_record(obj)
    if record is not None:
        return record.format()
    with patched(obj, **kwargs) as record:
        return record.format()


@contextlib.contextmanager
def patched(obj: object, **kwargs) -> Iterator[PatchRecord]:
    """``with patched(pipe): ...`` runs the block patched and restores ``pipe`` afterwards: unpatched,
    or patched as it was if it was (a block that asks for the same patch changes nothing)."""
    old = patch_record(obj)
    record = patch(obj, **kwargs)
    try:
        yield record
    finally:
        if record is not old:  # the block's own patch: undo it, and put back the one the block found
            unpatch(obj)
            if old is not None:
                patch(obj, **old.arguments)
