"""The drop-in patch for diffusers pipelines: ``patch``, ``unpatch``, ``patched``.

``patch(obj)`` takes a diffusers pipeline or a bare model of a family it knows (patches/families.py:
UNet2DConditionModel, AutoencoderKL, ControlNet, PixArtTransformer2DModel, SD3Transformer2DModel,
FluxTransformer2DModel) and routes the parts it knows (PARTS) through sd_kernels' ops. It is idempotent
and exactly reversible: the record of every change hangs on the patched object, and ``unpatch``
restores the original modules and processors, so outputs are bit-identical to a never-patched model.
Parameters are never copied (the channels_last family re-lays the data of the very same Parameters,
and lays it back). ``cuda_graph=True`` also replays the denoiser (UNet, PixArt, SD3 or FLUX
transformer), the VAE decode and the text encoders from CUDA graphs and keeps the scheduler's
timesteps on the host where the family allows it (cuda_graph.py, scheduler.py), and finds the
pipeline's execution device without diffusers' walk over every module (execution_device.py). ``report``
gives what a patch would replace and leave alone, for ``sd-kernels info``. docs/patch.md has the whole
story.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Iterable, Iterator

import torch.nn as nn

from sd_kernels.profiles import Profile, get_profile, using_profile

from . import (  # noqa: F401  (each registers its patcher)
    attention,
    call_gate,
    channels_last,
    execution_device,
    families,
    gelu,
    group_norm,
    layer_norm,
    memory_budget,
    text_padding,
    upsample,
    whole_step,
    winograd,
)
from . import cuda_graph as cuda_graph_mod
from .record import PatchRecord
from .registry import PATCHERS
from .scheduler import host_timesteps

log = logging.getLogger(__name__)

# The pipeline parts the patch touches, in order (``ignore=`` skips some) and their model classes:
# patches/families.py, the one table of model families.
PARTS, SUPPORTED_MODELS = families.PARTS, families.SUPPORTED_MODELS
# Pipeline parts that cuda_graph="pipeline" replays from graphs without patching their ops.
GRAPH_PARTS = ("text_encoder", "text_encoder_2", "text_encoder_3")  # SD3: its T5 is the third; FLUX: the second
# The text encoders compile=True compiles as well (beside the patched families' calls): T5-XXL (PixArt,
# SD3, FLUX), replayed 15.7 -> 9.4 ms at 300 tokens, 8.3 -> 4.9 at 64, for ~50 s of compilation (H100,
# session 21). CLIP's stay eager in their graphs: 0.84 -> 0.63 ms (CLIP-L) and 2.43 -> 2.04 ms (CLIP-G)
# are not worth 10 and 33 s (docs/patch.md, compile=).
COMPILED_TEXT_ENCODERS = ("T5EncoderModel",)
# Components that hold a pipeline's denoiser: left unpatched, they are warned about, not only recorded.
DENOISER_PARTS = ("unet", "transformer", "transformer_2", "prior")
_ATTR = "_sd_kernels_patch"  # on the patched object: its record
_OWNER = "_sd_kernels_owner"  # on each patched model: the record that patched it


def _models_of(obj: object, ignore: Iterable[str]) -> tuple[list[tuple[str, nn.Module]], list[tuple[str, str]]]:
    """(the (part, model)s to patch, the (part, class name)s of parts that hold another model)."""
    ignore = set(ignore)
    unknown = ignore - set(PARTS) - set(GRAPH_PARTS)
    if unknown:
        raise ValueError(f"ignore= names unknown parts {sorted(unknown)}; parts are {PARTS + GRAPH_PARTS}")
    if isinstance(obj, nn.Module):
        if type(obj).__name__ not in SUPPORTED_MODELS:
            raise TypeError(
                f"cannot patch a {type(obj).__name__}; supported models: {', '.join(SUPPORTED_MODELS)}, "
                "or a diffusers pipeline built on them"
            )
        return [(type(obj).__name__, obj)], []
    components = getattr(obj, "components", None)
    if not isinstance(components, dict):
        raise TypeError(
            f"cannot patch a {type(obj).__name__}: expected a diffusers pipeline or one of "
            f"{', '.join(SUPPORTED_MODELS)}"
        )
    present = [(part, components[part]) for part in PARTS
               if part not in ignore and isinstance(components.get(part), nn.Module)]
    models = [(part, m) for part, m in present if type(m).__name__ in SUPPORTED_MODELS]
    others = [(part, type(m).__name__) for part, m in present if type(m).__name__ not in SUPPORTED_MODELS]
    # Models in components no family names (a transformer pipeline's denoiser, a third text encoder):
    # reported too, never left alone in silence.
    others += [(part, type(m).__name__) for part, m in components.items()
               if isinstance(m, nn.Module) and part not in PARTS and part not in GRAPH_PARTS and part not in ignore]
    if not models and not ignore:
        found = f" (it has {', '.join(f'{p}: {name}' for p, name in others)})" if others else ""
        raise TypeError(
            f"{type(obj).__name__} has none of the parts sd_kernels patches{found}; supported: "
            f"{', '.join(PARTS)} as {', '.join(SUPPORTED_MODELS)} "
            "(SD1.x, SD2.x, SDXL pipelines, with ControlNet or without; PixArt-α/Σ; SD3; FLUX.1)"
        )
    return models, others


def patch(
    obj: object,
    profile: str | Profile | None = None,
    ops: Iterable[str] | None = None,
    ignore: Iterable[str] = (),
    cuda_graph: bool | str = cuda_graph_mod.AUTO,
    compile: bool | str = False,
) -> PatchRecord:
    """Route ``obj``'s supported parts through sd_kernels; returns the record (``.format()``).

    ``profile``: a profile name or Profile (default: detected); ``ops`` picks op families (default:
    all of ``PATCHERS``); ``ignore`` skips pipeline parts; ``cuda_graph`` replays model calls from
    CUDA graphs captured per call signature: True or "pipeline" the denoiser (the UNet, or PixArt's,
    SD3's or FLUX's transformer), the VAE decode and the
    text encoders, with the scheduler's timesteps on the host and a faster ``_execution_device``
    (execution_device.py); "step" all that, and each denoising step of an SD/SDXL text-to-image pipeline
    (guidance batch, UNet, guidance combine, ``scheduler.step``) replayed from one graph
    (patches/whole_step.py); "unet" the denoiser alone
    (patches/cuda_graph.py; needs the denoiser on CUDA); "auto" (the default) "pipeline" where the denoiser
    can be captured and the profile sets no memory budget, else none; False: eager. ``compile``:
    the graphs capture ``torch.compile(fullgraph=True)`` of the denoiser's forward, the VAE's decode
    and a T5 text encoder's forward (``COMPILED_TEXT_ENCODERS``; a minute or two of compilation on the
    first call of each shape); True or "default" in inductor's default mode, "max-autotune" with its
    GEMM/convolution autotuning (minutes more; inductor's own CUDA graphs stay off either way: ours
    capture the compiled call).
    Patching an already patched object with the same arguments does nothing; with other arguments
    it is unpatched first. Nothing is half-patched: if a patcher raises, what was done is undone.
    """
    for name, value in (("ops", ops), ("ignore", ignore)):
        if isinstance(value, str):
            raise TypeError(f"{name}= takes a list of names, got the string {value!r} "
                            f"(did you mean {name}=[{value!r}]?)")
    ignore = tuple(ignore)
    mode = cuda_graph_mod.mode_of(cuda_graph)
    asked, compile = compile, cuda_graph_mod.compile_of(compile)
    if compile and mode is None:
        raise ValueError(f"compile={asked!r} compiles what the CUDA graphs capture: pass cuda_graph=True too "
                         "(or torch.compile the patched model yourself)")
    ops = tuple(sorted(PATCHERS)) if ops is None else tuple(sorted(set(ops)))
    unknown = set(ops) - set(PATCHERS)
    if unknown:
        raise ValueError(f"unknown ops {sorted(unknown)}; available: {', '.join(sorted(PATCHERS))}")
    models, others = _models_of(obj, ignore)
    graphed = [model for _, model in models if families.is_denoiser(model)]
    prof = get_profile(profile)  # the patched model's own: its modules run under it, not the process default
    plan = memory_plan(obj, prof)  # a budget the weights cannot meet raises here, before any change
    if plan is not None and plan.swapped and cuda_graph_mod.mode_of(cuda_graph) not in (None, cuda_graph_mod.AUTO):
        raise ValueError(f"cuda_graph={cuda_graph!r}: under profile {prof.name!r} the pipeline's weights are moved in "
                         "and out for each component's call (they do not fit the budget at once), and a CUDA graph "
                         "reads weights where they were at capture")
    if mode == cuda_graph_mod.AUTO:
        mode, why = cuda_graph_mod.auto_mode(graphed, prof)
        if compile and mode is None:
            raise ValueError(f"compile={asked!r} compiles what the CUDA graphs capture, and cuda_graph='auto' "
                             f"captures nothing here ({why})")
        log.info("sd_kernels: cuda_graph='auto' -> %s (%s)", mode, why)
    if mode:
        if not graphed:
            denoisers = " or ".join(families.DENOISERS)
            raise ValueError(f"cuda_graph=True captures the denoiser, but there is no {denoisers} to patch in "
                             f"{type(obj).__name__} (ignore={ignore})")
        for model in graphed:
            cuda_graph_mod.check_graphable(model)
    held = getattr(obj, _ATTR, None)
    with call_gate.exclusive(obj, [m for _, m in models] + (held.models if held else [])):
        return _apply(obj, models, others, ops, prof, plan, ignore, mode, compile)


def _apply(obj, models, others, ops, prof, plan, ignore, mode, compile) -> PatchRecord:
    old: PatchRecord | None = getattr(obj, _ATTR, None)
    for part, model in models:  # pipelines may share models: one patch per model at a time
        owner = getattr(model, _OWNER, None)
        if owner is not None and owner is not old:
            raise ValueError(f"the {part} of this {type(obj).__name__} is already patched through another object "
                             "(a pipeline sharing it, or the bare model): unpatch that one first")
    parts = [p for p, _ in models]
    scheduler = getattr(obj, "scheduler", None) if mode in cuda_graph_mod.PIPELINE_MODES else None
    if old is not None:
        # The whole profile, not its name: dataclasses.replace(profile, attention=...) keeps the name.
        # And the models themselves: a component replaced since (``pipe.unet = other``) is patched anew.
        if (old.ops, old.profile_spec, old.parts, old.ignore, old.cuda_graph, old.compile, old.scheduler) == (
                ops, prof, parts, ignore, mode, compile, scheduler) and _same(old.models, [m for _, m in models]):
            return old
        unpatch(obj)
    record = PatchRecord(ops, prof.name, parts, mode, compile)
    record.profile_spec = prof
    record.memory_plan = plan
    record.scheduler = scheduler
    record.ignore = ignore
    record.models = [m for _, m in models]
    record.target = weakref.ref(obj)
    for part, name in others:
        record.skip(part, name, f"left as diffusers ships it: not a supported model ({', '.join(SUPPORTED_MODELS)})")
        if part in DENOISER_PARTS:
            log.warning("sd_kernels: patch: the %s of this %s (%s) runs as diffusers ships it: sd_kernels has no "
                        "family for it yet (only the parts %s are patched)", part, type(obj).__name__, name,
                        ", ".join(p for p, _ in models) or "none")
    try:
        with using_profile(prof):  # the patchers read it (routes, budgets, layouts)
            for part, model in models:
                record.scope = part  # skipped modules' paths start with it
                record.set_attr(model, _OWNER, record, kind=None)
                for op in families.patch_order(ops):
                    PATCHERS[op](model, record)
            _install_text_padding(obj, models, record, ops)
            if mode:
                _install_graphs(obj, models, record, mode, compile, ignore)
            if plan is not None and plan.swapped:
                memory_budget.install_swap(obj, record)
    except BaseException:
        record.undo()
        raise
    object.__setattr__(obj, _ATTR, record)
    return record


def memory_plan(obj: object, prof: Profile):
    """Under a profile with a memory budget: the weights of every model the pipeline holds (or of the
    bare model), checked against the budget with the profile's intermediate allowance
    (``sd_kernels.runtime.memory.plan_budget``); None without a budget."""
    budget = prof.memory_budget_bytes()
    if budget is None:
        return None
    from sd_kernels.runtime.memory import MB, plan_budget

    if isinstance(obj, nn.Module):
        held = {type(obj).__name__: obj}
    else:
        held = {k: m for k, m in (getattr(obj, "components", None) or {}).items() if isinstance(m, nn.Module)}
    chain = None if isinstance(obj, nn.Module) else memory_budget.offload_chain(obj)
    return plan_budget(held, budget, (prof.intermediate_budget_mb or 0) * MB, chain)


def _install_text_padding(obj: object, models: list[tuple[str, nn.Module]], record: PatchRecord, ops) -> None:
    """A pipeline whose denoiser's cross-attention masks the prompt's padding: its ``encode_prompt``
    cuts the padding no row attends to (part of the "attention" family; patches/text_padding.py)."""
    if "attention" not in ops or isinstance(obj, nn.Module):
        return
    record.scope = ""
    for _, model in models:
        fam = families.family_of(model)
        if fam is not None and fam.denoiser and fam.text_padding:
            text_padding.install(obj, model, record)


def _install_graphs(obj: object, models: list[tuple[str, nn.Module]], record: PatchRecord, mode: str,
                    compile: str | None, ignore: Iterable[str]) -> None:
    """The CUDA graphs of ``cuda_graph=mode`` (the denoiser's were checked graphable before any change)."""
    for _, model in models:
        if families.is_denoiser(model):
            fam = families.family_of(model)
            cuda_graph_mod.install(model, record, fam.graphed, fam.graph_drop, compile=compile)
    if mode not in cuda_graph_mod.PIPELINE_MODES:
        return
    record.scope = ""
    components = getattr(obj, "components", None) or {}
    calls = [(part, model, fam.graphed, fam.graph_drop) for part, model in models
             if not families.is_denoiser(model) and (fam := families.family_of(model)) is not None]
    calls += [(part, components[part], "forward", ()) for part in GRAPH_PARTS
              if part not in ignore and isinstance(components.get(part), nn.Module)]
    for part, model, method, drop in calls:
        reason = cuda_graph_mod.graphable_reason(model)
        if reason is not None:
            record.skip(part, type(model).__name__, f"not replayed from CUDA graphs: {reason}")
            continue
        compiled = part in PARTS or type(model).__name__ in COMPILED_TEXT_ENCODERS
        cuda_graph_mod.install(model, record, method, drop, compile=compile if compiled else None)
    device_steps = [f.device_timesteps for _, m in models if (f := families.family_of(m)) is not None
                    and f.denoiser and not f.host_timesteps]
    if record.scheduler is not None and device_steps:
        record.skip("scheduler", type(record.scheduler).__name__, f"timesteps stay on the device: {device_steps[0]}")
    elif record.scheduler is not None:
        host_timesteps(record.scheduler, record)
    execution_device.fast_execution_device(obj, record)
    unet = getattr(obj, "unet", None)
    if mode == "step" and not isinstance(getattr(unet, "__dict__", {}).get("forward"), cuda_graph_mod.GraphedCall):
        record.skip("", type(obj).__name__, "cuda_graph='step' needs the pipeline's UNet graphed: the pipeline mode's "
                    "graphs run instead")
    elif mode == "step":
        whole_step.install(obj, vars(unet)["forward"], record)


def _same(models: list, others: list) -> bool:
    return len(models) == len(others) and all(a is b for a, b in zip(models, others))


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
