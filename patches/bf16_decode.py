"""The FP8 tier's decode for pipelines that upcast their VAE to fp32: a bf16 copy of the decoder.

SDXL's VAE overflows in fp16, so its config says ``force_upcast`` and its pipelines (SDXL's text-to-image,
image-to-image and inpainting ones, their ControlNet, adapter and PAG variants, Kolors …) call
``self.upcast_vae()`` before their one decode: the whole VAE is cast to fp32, decodes, and is cast back
to fp16. At 1024² that decode takes about twice as long as a half-precision one (TF32 convolutions,
fp32 activations; docs/fp8.md measures both), and in the FP8 tier it was the tenth of SDXL's image that
the denoiser's FP8 GEMMs do not touch.

bf16 has fp32's exponent range, so it does not overflow where fp16 does; it keeps 8 significant bits
where fp32 keeps 24. ``patch(pipe, precision="fp8")`` (lossy, opt-in) therefore decodes such pipelines
on a bf16 copy of the VAE's ``decoder`` and ``post_quant_conv``, patched like the VAE and, in the
pipeline graph modes, replayed from its own CUDA graphs:

- inside a call of the pipeline (its class gets a same-name subclass whose ``__call__`` marks the call
  on this thread), ``upcast_vae`` casts nothing: it arms ``vae.decode`` for the rest of the call (the VAE
  stays fp16, so the pipeline's cast back after the decode changes nothing);
- an armed ``vae.decode`` casts the latents to bf16, decodes on the copy, and returns fp32, the dtype the
  upcast VAE returns; an armed ``vae.encode`` upcasts the VAE as stock would and disarms. The call's end
  disarms, whatever happened in it. ``upcast_vae`` outside a call, and every unarmed call, are stock's.

Where it applies: a pipeline whose source calls ``self.upcast_vae()`` once, in its ``__call__``, which
decodes there (``_verified``: SDXL's pipelines, the SD x4 upscaler's; instruct-pix2pix and LEdits++ also
upcast to encode: they keep the fp32 decode), with an fp16 ``AutoencoderKL`` on a CUDA device whose config
says ``force_upcast`` (a VAE in another dtype is never upcast), and no memory budget (the copy costs the
decoder's bytes again, half the fp32 upcast's). ``upcast_vae`` checks first that the pipeline still holds
that VAE, that it still qualifies (fp16, on the copy's device, no offloading hooks, not split over
processes) and that its decoder's weights are the ones copied; changed values are copied again, a changed
module tree (a LoRA added) falls back to the fp32 upcast (logged). A VAE whose decoder is not the one its
config builds (a LoRA before the patch) keeps the fp32 decode, noted in the record. The copy's weights are
in the record's ``fp8:`` line; its CUDA graph's pool is held, as the VAE's own would be, until unpatch.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
import types
from collections.abc import Callable

import torch
import torch.nn as nn

from sd_kernels.ops.weight_cache import weight_version
from sd_kernels.runtime.dispatch import interpreting

from . import call_gate
from . import cuda_graph as cuda_graph_mod
from .modes import outside_inference_mode
from .record import PatchRecord, same_name_subclass

log = logging.getLogger(__name__)

KIND = "fp8.bf16_decode"
BF16_DECODE = True  # False: the FP8 tier decodes in fp32 where the pipeline upcasts (bench.fp8's fp32-decode row)
_ATTR = "_sd_kernels_bf16_decode"  # on the pipeline: its Bf16Decode
_PARTS = ("decoder.", "post_quant_conv.")  # what AutoencoderKL.decode reads
_FLAGS = ("use_tiling", "use_slicing", "tile_sample_min_size", "tile_latent_min_size", "tile_overlap_factor")
_LOCAL = threading.local()  # this thread's pipeline calls in flight (depth) and the Bf16Decode armed in them


class Unserved(Exception):
    """Why a VAE's decode cannot run on a bf16 copy."""


@functools.cache
def _verified(cls: type) -> bool:
    """Whether ``cls``'s source upcasts its VAE once, in ``__call__``, which decodes there."""
    try:
        whole, call = inspect.getsource(inspect.getmodule(cls)), inspect.getsource(cls.__call__)
    except (OSError, TypeError):
        return False
    return whole.count("self.upcast_vae()") == 1 and call.count("self.upcast_vae()") == 1 and "self.vae.decode(" in call


def _decoder_params(vae: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors of ``vae``'s state that its decode reads, by name."""
    return {name: p for name, p in vae.state_dict(keep_vars=True).items() if name.startswith(_PARTS)}


def _reason(vae: nn.Module, device: torch.device | None = None) -> str | None:
    """Why a decode of ``vae`` upcast by its pipeline stays fp32 (``device``: the copy's), or None where
    the bf16 copy serves it."""
    if type(vae).__name__ != "AutoencoderKL":
        return f"the copy is made for AutoencoderKL, not {type(vae).__name__}"
    param = next(vae.parameters(), None)
    if param is None or param.dtype != torch.float16 or not (
            param.device.type == "cuda" or param.device.type == "cpu" and interpreting()):
        return f"its VAE is {getattr(param, 'dtype', None)} on {getattr(param, 'device', None)}, not fp16 on CUDA"
    if device is not None and param.device != device:
        return f"its VAE moved to {param.device}; the copy is on {device}"
    if hasattr(vae, "_hf_hook") or cuda_graph_mod.runs_collectives(vae):
        return "its VAE is offloaded or split over processes"
    return None


class Bf16Decode:
    """The bf16 copy of one VAE's decoder, and the hooks that route its pipeline's upcast decode to it."""

    def __init__(self, vae: nn.Module, patch_model: Callable[[nn.Module, PatchRecord], None],
                 record: PatchRecord) -> None:
        self.vae = vae
        with torch.device("meta"):
            copy = type(vae).from_config(vae.config)
        copy.encoder = copy.quant_conv = None  # decode reads neither: they stay unallocated
        # the copy's own names (the VAE's patch may have added tensors of its own, a fused to_qkv)
        self.names = list(copy.state_dict())
        held = _decoder_params(vae)
        if not set(self.names) <= held.keys():
            raise Unserved("its decoder is not the one its config builds (a LoRA, another module)")
        with outside_inference_mode():  # a patch made under inference mode: ``serves`` copies into them in place
            copy.load_state_dict({n: held[n].detach().to(torch.bfloat16) for n in self.names}, assign=True)
        copy.eval().requires_grad_(False)
        self.copy, self.device = copy, next(copy.parameters()).device
        self.held = sorted(held)  # what the decoder holds now: another module tree falls back
        self.versions = [weight_version(held[n]) for n in self.names]
        self.bytes = sum(p.numel() * p.element_size() for p in copy.parameters())
        # the copy is patched and graphed like the VAE, under a record of its own (undone with the patch's)
        self.record = PatchRecord(record.ops, record.profile, ["vae"], record.cuda_graph, record.compile,
                                  profile_spec=record.profile_spec, models=[copy], precision=None)
        self.record.scope = "vae.bf16_copy"
        patch_model(copy, self.record)
        if record.cuda_graph in cuda_graph_mod.PIPELINE_MODES:
            cuda_graph_mod.install(copy, self.record, "decode", ("generator",), compile=record.compile)
        self.copied = copy.state_dict(keep_vars=True)  # its Parameters by name, patched (only this patch changes it)
        self.hooks: dict[str, object] = {}

    def serves(self, pipe: object) -> bool:
        """``pipe`` still holds the VAE, whose hooks are ours, which still qualifies, and the copy holds its
        decoder's weights (copied again where values changed); False, logged, where the copy cannot serve."""
        vae = self.vae
        if getattr(pipe, "vae", None) is not vae or any(vars(vae).get(k) is not h for k, h in self.hooks.items()):
            return False
        if (why := _reason(vae, self.device)) is not None:
            log.info("sd_kernels: the VAE decodes in fp32 as the pipeline asks: %s", why)
            return False
        held, copied = _decoder_params(vae), self.copied
        if sorted(held) != self.held or any(copied[n].shape != held[n].shape for n in self.names):
            log.warning("sd_kernels: the VAE's decoder changed its modules since the patch: it decodes in fp32 as "
                        "the pipeline asks (patch again for the bf16 copy)")
            return False
        versions = [weight_version(held[name]) for name in self.names]
        stale = [name for name, now, then in zip(self.names, versions, self.versions) if now != then]
        if stale:  # one launch for all (an img2img call's fp32 round trip of the VAE moves every storage)
            with torch.no_grad():
                torch._foreach_copy_([copied[n] for n in stale], [held[n] for n in stale])
            self.versions = versions
        return True

    def install(self, record: PatchRecord) -> None:
        """``vae.decode`` and ``vae.encode`` as methods of the VAE (a call in flight is the VAE's, for the
        call gate) that serve armed calls."""
        route = self

        def decode(vae, z: torch.Tensor, *args, **kwargs):
            if getattr(_LOCAL, "armed", None) is not route:
                return inner_decode(z, *args, **kwargs)
            for flag in _FLAGS:
                if hasattr(vae, flag):
                    setattr(route.copy, flag, getattr(vae, flag))
            out = route.copy.decode(z.to(torch.bfloat16), *args, **kwargs)
            if isinstance(out, tuple):
                return (out[0].float(), *out[1:])
            out.sample = out.sample.float()
            return out

        def encode(vae, x: torch.Tensor, *args, **kwargs):
            if getattr(_LOCAL, "armed", None) is route:  # not a path this serves: stock's upcast, disarmed
                _LOCAL.armed = None
                vae.to(dtype=torch.float32)
                x = x.float()
            return inner_encode(x, *args, **kwargs)

        decode.route = self  # what a test inspects
        inner_decode, inner_encode = self.vae.decode, self.vae.encode
        for name, fn in (("decode", decode), ("encode", encode)):
            self.hooks[name] = types.MethodType(fn, self.vae)
            record.set_attr(self.vae, name, self.hooks[name], kind=None)


@functools.cache
def _routed_class(cls: type) -> type:
    """``cls`` whose ``__call__`` marks this thread's call (and disarms at its end) and whose ``upcast_vae``
    arms the pipeline's Bf16Decode inside a call."""
    base_call, base_upcast = cls.__call__, cls.upcast_vae

    @functools.wraps(base_call)
    def __call__(self, *args, **kwargs):
        _LOCAL.depth = getattr(_LOCAL, "depth", 0) + 1
        try:
            return base_call(self, *args, **kwargs)
        finally:
            _LOCAL.depth -= 1
            if not _LOCAL.depth:
                _LOCAL.armed = None

    @functools.wraps(base_upcast)
    def upcast_vae(self):
        route = vars(self).get(_ATTR)
        if route is not None and getattr(_LOCAL, "depth", 0) and route.serves(self):
            _LOCAL.armed = route
        else:
            base_upcast(self)

    return same_name_subclass(cls, {"__call__": __call__, "upcast_vae": upcast_vae, "_sd_kernels_bf16_route": True})


def install(pipe: object, patch_model: Callable[[nn.Module, PatchRecord], None], record: PatchRecord) -> None:
    """Route ``pipe``'s upcast decode to a bf16 copy of its VAE's decoder (FP8 tier, ``_reason``); a note in
    the record where the pipeline would upcast and this cannot serve it."""
    vae = getattr(pipe, "components", {}).get("vae")
    if not BF16_DECODE or record.precision != "fp8" or not isinstance(vae, nn.Module) or "vae" in record.ignore \
            or not hasattr(type(pipe), "upcast_vae") or not getattr(vae.config, "force_upcast", False) \
            or getattr(next(vae.parameters(), None), "dtype", None) != torch.float16:  # only fp16 is upcast
        return
    record.scope = ""
    cls = call_gate.class_of(pipe)
    reason = _reason(vae)
    if reason is None and record.memory_plan is not None:
        reason = "a memory budget is set (the copy would add the decoder's bytes)"
    if reason is None and not _verified(cls):
        reason = "its source upcasts the VAE other than once, in its __call__ before a decode"
    try:
        route = Bf16Decode(vae, patch_model, record) if reason is None else None
    except Unserved as exc:
        reason, route = str(exc), None
    if route is None:
        record.skip("vae", type(vae).__name__, f"decodes in fp32 as the pipeline asks: {reason}")
        return
    record.on_undo(route.record.undo, KIND, count=0)
    route.install(record)
    record.set_attr(pipe, _ATTR, route, kind=None)
    record.set_class(pipe, _routed_class(cls), KIND)
    if record.quantized is not None:
        record.quantized.decode_copy_bytes = route.bytes
