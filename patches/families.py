"""The model families the patch knows, as data: one entry per diffusers model class.

Everything that differs between the models a pipeline holds lives here, so that supporting a new
family is one entry plus whatever patchers it needs: which pipeline component it is, what it is
called in logs, which of its entry points the CUDA graphs replay (and how), which of its submodules
run under a memory budget, whether Winograd may route its convs, whether it is the denoiser. The
op patchers run in the order of patches/registry.py's table (their dependencies written down there),
whatever order ``ops=`` names them in. The diffusers code the patchers re-state is checked by source
hash in ``diffusers_sources.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch.nn as nn


@dataclasses.dataclass(frozen=True)
class Family:
    model_class: str  # the diffusers class, by name (exact type: subclasses may change forward)
    part: str  # the pipeline component that holds it; what ``ignore=`` and profiles' channels_last name
    label: str  # in logs and graph labels
    graphed: str  # the method cuda_graph="pipeline" replays from graphs ("unet" mode: the UNet's only)
    graph_drop: tuple[str, ...] = ()  # keyword arguments that method ignores (not part of a signature)
    timestep: bool = False  # the graphed method's second argument is a timestep (a number is made a tensor)
    guarded: tuple[str, ...] = ()  # submodules whose forward runs under a memory budget ("": the model)
    winograd: bool = False  # Winograd may route its 3×3 convs (when replayed from graphs: host cost)
    stream_decode: bool = False  # its ``decoder`` may decode in row bands under an intermediate budget
    denoiser: bool = False  # the denoising loop's model: every graph mode captures it ("unet" mode: it alone)
    # "pipeline" mode keeps the scheduler's timesteps on the host for this denoiser's pipelines; False
    # where host timesteps would cost a wait or break a call, and ``device_timesteps`` says why (the record's note)
    host_timesteps: bool = True
    device_timesteps: str = ""
    # its pipelines pad the prompt and mask the padding out of the cross-attention only: the patch cuts
    # the padding no row attends to (patches/text_padding.py)
    text_padding: bool = False


FAMILIES = (
    Family("UNet2DConditionModel", "unet", "UNet", graphed="forward", timestep=True, guarded=("",), winograd=True,
           denoiser=True),
    Family("AutoencoderKL", "vae", "VAE", graphed="decode", graph_drop=("generator",),
           guarded=("encoder", "decoder"), stream_decode=True),
    # The ControlNet pipelines' "controlnet": half a UNet (its down and mid blocks) called every step
    # beside it; several ControlNets are one MultiControlNetModel, whose forward calls each in turn.
    Family("ControlNetModel", "controlnet", "ControlNet", graphed="forward", timestep=True, guarded=("",)),
    Family("MultiControlNetModel", "controlnet", "ControlNets", graphed="forward", timestep=True, guarded=("",)),
    # PixArt-α/Σ's DiT. PixArtSigmaPipeline always passes the timestep as a tensor expanded to the batch
    # (a number is refused by the model's own timestep embedding), so no timestep conversion; its
    # encoder_attention_mask and added_cond_kwargs={"resolution": None, "aspect_ratio": None} are
    # ordinary graph inputs (a tensor, hashable Nones). No 3×3 convs (its patch embedding is a 2×2 one).
    # PixArtSigmaPipeline runs ``t[None].to(latents.device)`` on each step's timestep: a host one would be
    # a blocking copy every step, so its timesteps stay where diffusers puts them (DPM-Solver then reads
    # its step index once, on the first step).
    Family("PixArtTransformer2DModel", "transformer", "PixArt", graphed="forward", guarded=("",), denoiser=True,
           text_padding=True, host_timesteps=False,
           device_timesteps="the PixArt pipeline copies each step's timestep to the device itself (a host one would "
           "make it wait)"),
    # Stable Diffusion 3's MMDiT. StableDiffusion3Pipeline passes the timestep as a tensor expanded to the
    # batch (t.expand(B); float sigmas × 1000), so no timestep conversion; pooled_projections is a
    # tensor and joint_attention_kwargs the pipeline's (None unless set: a hashable leaf), so every
    # keyword is an ordinary graph input and none is dropped. No 3×3 convs (a 2×2 patch embedding).
    Family("SD3Transformer2DModel", "transformer", "SD3", graphed="forward", guarded=("",), denoiser=True),
    # FLUX.1's MMDiT (double-stream and single-stream blocks). FluxPipeline passes the timestep as a tensor
    # (``t.expand(B).to(latents.dtype) / 1000``; the model multiplies by 1000 again), the guidance as one
    # (``torch.full([1], scale, device=...).expand(B)``, None for a model without guidance_embeds),
    # txt_ids / img_ids as tensors and joint_attention_kwargs as a dict ({} unless set), so no timestep
    # conversion and no keyword dropped. No 3×3 convs (linear patch embedding).
    # Its timesteps stay on the device (host_timesteps=False), the choice with no host sync: the
    # transformer uses the timestep where it arrives (no ``.to(device)`` of its own, unlike the UNet's
    # 0-d case) and the pipeline never moves it, so a host timestep would reach the model only through a
    # graph's copy-in and would break every eager call (a GraphedCall's fallback, a new signature whose
    # capture fails: a CPU tensor into CUDA weights); on the device nothing in the loop reads one back:
    # the pipeline calls ``scheduler.set_begin_index(0)`` (no timestep lookup) and FlowMatchEuler's step
    # indexes its device sigmas by a Python step index (FlowMatchEuler is not among the host-timestep
    # schedulers either way).
    Family("FluxTransformer2DModel", "transformer", "FLUX", graphed="forward", guarded=("",), denoiser=True,
           host_timesteps=False, device_timesteps="the FLUX transformer takes the pipeline's timestep where it is "
           "(a host one would fail every eager call) and its pipeline sets the scheduler's begin index (no "
           "timestep lookup, no sync)"),
)
BY_CLASS = {f.model_class: f for f in FAMILIES}
# Pipeline parts that the pipeline modes replay from graphs without patching their ops (SD3: its T5 is
# the third text encoder; FLUX: the second).
GRAPH_PARTS = ("text_encoder", "text_encoder_2", "text_encoder_3")
PARTS = tuple(dict.fromkeys(f.part for f in FAMILIES))  # in patch order; ``ignore=`` skips some
SUPPORTED_MODELS = tuple(BY_CLASS)
# The models that every graph mode captures (the denoising loop's): "unet" mode graphs them alone.
DENOISERS = tuple(f.model_class for f in FAMILIES if f.denoiser)


def family_of(model: nn.Module) -> Family | None:
    """The family of ``model``'s exact class, or None."""
    return BY_CLASS.get(type(model).__name__)


def is_denoiser(model: nn.Module) -> bool:
    return type(model).__name__ in DENOISERS


def models_of(obj: object, ignore: Iterable[str]) -> tuple[list[tuple[str, nn.Module]], list[tuple[str, str]]]:
    """(the (part, model)s ``patch(obj, ignore=ignore)`` patches, the (part, class name)s of the parts
    that hold a model no family names); a clear error for anything else."""
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
