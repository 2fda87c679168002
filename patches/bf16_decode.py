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

- the pipeline's ``upcast_vae`` becomes: "the next ``vae.decode`` on this thread runs the bf16 copy"
  (the VAE stays fp16, so the pipeline's cast back after the decode changes nothing);
- ``vae.decode`` then casts the latents to bf16, decodes on the copy, and returns fp32, the dtype the
  upcast VAE returns. Every other call of ``vae.decode`` and ``vae.encode`` is the VAE's own.

Where it applies: a pipeline whose source calls ``self.upcast_vae()`` once, in its ``__call__``, which
decodes once (``_verified``; instruct-pix2pix and LEdits++ also upcast to encode: they keep the fp32
decode), with an fp16 ``AutoencoderKL`` on a CUDA device whose config says ``force_upcast``, and no
memory budget (the copy costs the decoder's bytes again, half the fp32 upcast's). Each decode checks
first that the VAE still qualifies (fp16, same device, no offloading hooks, not split over processes)
and that its decoder's weights are the ones copied; changed values are copied again, a changed module
tree falls back to the fp32 upcast (logged). The copy's memory is in the record's ``fp8:`` line.
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections.abc import Callable

import torch
import torch.nn as nn

from sd_kernels.ops.weight_cache import weight_version
from sd_kernels.runtime.dispatch import interpreting

from . import call_gate
from . import cuda_graph as cuda_graph_mod
from .record import PatchRecord

log = logging.getLogger(__name__)

KIND = "fp8.bf16_decode"
BF16_DECODE = True  # False: the FP8 tier decodes in fp32 where the pipeline upcasts (bench.fp8's fp32-decode row)
_PARTS = ("decoder.", "post_quant_conv.")  # what AutoencoderKL.decode reads
_FLAGS = ("use_tiling", "use_slicing", "tile_sample_min_size", "tile_latent_min_size", "tile_overlap_factor")
_VERIFIED: dict[type, bool] = {}


def _verified(cls: type) -> bool:
    """Whether ``cls``'s source upcasts its VAE once, in ``__call__``, which decodes once."""
    if cls not in _VERIFIED:
        try:
            whole, call = inspect.getsource(inspect.getmodule(cls)), inspect.getsource(cls.__call__)
        except (OSError, TypeError):
            whole = call = ""
        _VERIFIED[cls] = (whole.count("self.upcast_vae()") == 1 and call.count("self.upcast_vae()") == 1
                          and call.count("self.vae.decode(") == 1)
    return _VERIFIED[cls]


def _decoder_params(vae: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors of ``vae``'s state that its decode reads, by name."""
    return {name: p for name, p in vae.state_dict(keep_vars=True).items() if name.startswith(_PARTS)}


def _reason(vae: nn.Module) -> str | None:
    """Why a decode of ``vae`` upcast by its pipeline stays fp32, or None where the bf16 copy serves it."""
    if type(vae).__name__ != "AutoencoderKL":
        return f"the copy is made for AutoencoderKL, not {type(vae).__name__}"
    param = next(vae.parameters(), None)
    if param is None or param.dtype != torch.float16 or not (
            param.device.type == "cuda" or param.device.type == "cpu" and interpreting()):
        return f"its VAE is {getattr(param, 'dtype', None)} on {getattr(param, 'device', None)}, not fp16 on CUDA"
    if hasattr(vae, "_hf_hook") or cuda_graph_mod.runs_collectives(vae):
        return "its VAE is offloaded or split over processes"
    return None


class Bf16Decode:
    """The bf16 copy of one VAE's decoder, and the two hooks that route the pipeline's upcast decode to it."""

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
            raise RuntimeError("the VAE's decoder is not the one its config builds")
        copy.load_state_dict({n: held[n].detach().to(torch.bfloat16) for n in self.names}, assign=True)
        copy.eval().requires_grad_(False)
        self.copy = copy
        self.held = sorted(held)  # what the decoder holds now: another module tree falls back
        self.versions = [weight_version(held[n]) for n in self.names]
        self.bytes = sum(p.numel() * p.element_size() for p in copy.parameters())
        self.local = threading.local()
        # the copy is patched like the VAE, under a record of its own (undone with the patch's)
        self.record = PatchRecord(record.ops, record.profile, ["vae"], profile_spec=record.profile_spec,
                                  models=[copy])
        self.record.scope = "vae.bf16_copy"
        patch_model(copy, self.record)
        if record.cuda_graph in cuda_graph_mod.PIPELINE_MODES:
            cuda_graph_mod.install(copy, self.record, "decode", ("generator",), compile=record.compile)

    def usable(self) -> bool:
        """The VAE still qualifies and the copy holds its decoder's weights (copied again where values
        changed); False, logged, where the copy cannot serve it."""
        if (why := _reason(self.vae)) is not None:
            log.info("sd_kernels: the VAE decodes in fp32 as the pipeline asks: %s", why)
            return False
        held = _decoder_params(self.vae)
        copied = self.copy.state_dict(keep_vars=True)
        if sorted(held) != self.held or any(copied[n].shape != held[n].shape for n in self.names):
            log.warning("sd_kernels: the VAE's decoder changed its modules since the patch: it decodes in fp32 as "
                        "the pipeline asks (patch again for the bf16 copy)")
            return False
        with torch.no_grad():
            for i, name in enumerate(self.names):
                if (version := weight_version(held[name])) != self.versions[i]:
                    copied[name].copy_(held[name])
                    self.versions[i] = version
        return True

    def upcast_vae(self, original: Callable[[], None]) -> Callable[[], None]:
        """The pipeline's ``upcast_vae``: arms the next decode on this thread, or upcasts (``original``)."""
        def upcast_vae() -> None:
            if self.usable():
                self.local.armed = True
            else:
                original()
        return upcast_vae

    def decode(self, inner: Callable) -> Callable:
        """``vae.decode``: an armed call (after ``upcast_vae``) on the copy, returning fp32; others ``inner``."""
        def decode(z: torch.Tensor, *args, **kwargs):
            if not getattr(self.local, "armed", False):
                return inner(z, *args, **kwargs)
            self.local.armed = False
            for flag in _FLAGS:
                if hasattr(self.vae, flag):
                    setattr(self.copy, flag, getattr(self.vae, flag))
            out = self.copy.decode(z.to(torch.bfloat16), *args, **kwargs)
            if isinstance(out, tuple):
                return (out[0].float(), *out[1:])
            out.sample = out.sample.float()
            return out
        decode.route = self  # what a test inspects
        return decode


def install(pipe: object, patch_model: Callable[[nn.Module, PatchRecord], None], record: PatchRecord) -> None:
    """Route ``pipe``'s upcast decode to a bf16 copy of its VAE's decoder (FP8 tier, ``_reason``); a note in
    the record where the pipeline upcasts and this cannot serve it."""
    vae = getattr(pipe, "components", {}).get("vae")
    if not BF16_DECODE or record.precision != "fp8" or not isinstance(vae, nn.Module) or "vae" in record.ignore \
            or not hasattr(type(pipe), "upcast_vae") or not getattr(vae.config, "force_upcast", False):
        return
    reason = _reason(vae)
    if reason is None and record.memory_plan is not None:
        reason = "a memory budget is set (the copy would add the decoder's bytes)"
    if reason is None and not _verified(call_gate.class_of(pipe)):
        reason = "its source upcasts the VAE other than once, before its one decode"
    if reason is not None:
        record.skip("vae", type(vae).__name__, f"decodes in fp32 as the pipeline asks: {reason}")
        return
    route = Bf16Decode(vae, patch_model, record)
    record.on_undo(route.record.undo, KIND, count=0)
    record.set_attr(pipe, "upcast_vae", route.upcast_vae(pipe.upcast_vae), kind=None)
    record.set_attr(vae, "decode", route.decode(vae.decode), kind=KIND)
    if record.quantized is not None:
        record.quantized.decode_copy_bytes = route.bytes
