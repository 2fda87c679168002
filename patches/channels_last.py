"""Channels-last (NHWC) weights for the pipeline parts the patch's profile names.

On the H100, cuDNN's convolutions run fastest on NHWC activations, and PyTorch keeps a conv's output
in the memory format of its input or weight: with channels_last conv weights, a whole UNet runs NHWC
from its first conv on (the NCHW latents are read once, in conv_in), and so do the GroupNorm kernel
(ops/group_norm.py reads either layout through one spatial stride) and the attention processor
(diffusers' ``view(B, C, H·W).transpose(1, 2)`` of an NHWC map is already [B, H·W, C] in memory).
Measured on the H100, SD1.5 UNet step, batch 2, from CUDA graphs: stock 12.26 → 10.60 ms; patched
10.68 → 7.69 ms (bench/results/2026-11-22-h100-layout/).

One place in diffusers breaks the chain: Transformer2DModel's ``_get_output_for_continuous_inputs``
ends its ``reshape → permute(0, 3, 1, 2)`` with ``.contiguous()``, an NCHW copy, before (1×1 conv
``proj_out``: SD1.5, SD2.x's conv variants) or after (linear ``proj_out``: SD2.1, SDXL) the output
projection; the residual add and everything after it then ran NCHW. On the H100, 21 of SD1.5's 29
deep 3×3 conv calls per step saw NCHW inputs (bench.unet_kernels); in SD2.1 768² and SDXL 1024², 29
of 61 and 19 of 46 GroupNorm inputs. Where the installed diffusers has the very method we checked
(patches/diffusers_sources.py), the patch gives each such block the same method without that copy: the
permuted view is already NHWC in memory, so one copy fewer and the UNet stays NHWC from ``conv_in``
to ``conv_out``. Under another diffusers version a forward pre-hook on each 1×1 conv ``proj_out``
re-lays its input NHWC (one copy more), and blocks with a linear ``proj_out`` are left as they are
(reported in the record's skips).

The profile's ``channels_last`` lists the parts ("unet", "vae"). The patch converts every 4-D
parameter of such a model that is not channels_last yet, in place (``param.data``: the Parameter
objects stay, their storage is re-laid, no extra copy is kept), and unpatch converts exactly those
back to contiguous NCHW: the values never change, so outputs are bit-identical after unpatch. A weight whose
data a ``.to()`` re-made while patched (the layout carries over) is laid back too, also after a round trip to
its own dtype (SDXL's pipeline upcasts its VAE for every decode: until 2026-11-30 52-58 of the pipeline's weights
stayed NHWC after unpatch); a few values compared at unpatch tell that data from new values assigned since, which
stay as given.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from sd_kernels.ops.layout import is_channels_last

from .diffusers_sources import VERIFIED_WITH, is_verified
from .families import family_of
from .hooks import replay_safe
from .record import PatchRecord


def part_of(model: nn.Module) -> str | None:
    """The pipeline part a model plays ("unet", "vae"), from its family; None for others."""
    fam = family_of(model)
    return fam.part if fam else None


def makes_channels_last(model: nn.Module, record: PatchRecord) -> bool:
    """Whether this patch runs ``model`` channels_last (the op family is on and the profile names it)."""
    return "channels_last" in record.ops and part_of(model) in record.profile_spec.channels_last


def patch_layout(model: nn.Module, record: PatchRecord) -> None:
    if not makes_channels_last(model, record):
        return
    params = [p for p in model.parameters() if p.dim() == 4 and not p.is_contiguous(memory_format=torch.channels_last)]
    for p in params:
        p.data = p.data.contiguous(memory_format=torch.channels_last)
    # (``p.data`` is a new alias on every access: the storage pointer and strides identify ours)
    converted = [(p, p.data_ptr(), p.stride(), p.dtype, p.device, _probe(p)) for p in params]

    def restore() -> None:
        for p, ptr, stride, dtype, device, probe in converted:
            ours = (p.data_ptr(), p.stride()) == (ptr, stride)
            # ``.to(dtype or device)`` while patched re-allocates the data but keeps its layout: still ours to
            # lay back, also after a round trip back to the dtype it had (SDXL's pipeline casts its VAE to fp32
            # for each decode and back to fp16): the same values where the probe looks. Other data assigned
            # after the patch stays as it was given.
            moved = is_channels_last(p) and ((p.dtype, p.device) != (dtype, device) or _same_probe(p, probe))
            if ours or moved:
                p.data = p.data.contiguous()

    record.on_undo(restore, "channels_last_weight", len(converted))
    _keep_transformer_outputs_nhwc(model, record)


_PROBES = 8  # elements of a weight compared at unpatch, spread over it


def _probe(p: torch.Tensor) -> tuple[torch.Size, tuple[torch.Tensor, ...], torch.Tensor]:
    """(``p``'s shape, the indices of ``_PROBES`` elements spread over it, their values): what ``_same_probe``
    compares."""
    n = p.numel()
    k = min(_PROBES, n)
    flat = torch.arange(k, device=p.device) * (n - 1) // max(k - 1, 1)  # integer steps: the last is element n - 1
    index = torch.unravel_index(flat, p.shape)
    return p.shape, index, p.detach()[index].clone()


def _same_probe(p: torch.Tensor, probe: tuple[torch.Size, tuple[torch.Tensor, ...], torch.Tensor]) -> bool:
    """Whether ``p``'s data has the shape the patch saw and holds the probed values at the probed elements, bit
    for bit (a NaN included), once cast to p's dtype and device now."""
    shape, index, values = probe
    if p.shape != shape:  # compared before indexing: an index out of range on a GPU is not an error to catch
        return False
    if p.is_meta or values.is_meta:  # no values to compare (a model built on the meta device): left as it is
        return False
    here = p.detach()[tuple(i.to(p.device) for i in index)]
    then = values.to(p.device, p.dtype)
    if here.is_floating_point() and here.element_size() in _BITS:
        here, then = here.view(_BITS[here.element_size()]), then.view(_BITS[then.element_size()])
    return torch.equal(here, then)


_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}  # a float's bits as an integer of its width


def _keep_transformer_outputs_nhwc(model: nn.Module, record: PatchRecord) -> None:
    from diffusers.models.transformers.transformer_2d import Transformer2DModel

    # Blocks that take a continuous (image) input are the ones whose output goes through the method;
    # proj_out may be a Conv2d, a Linear or a wrapper of one (a LoRA layer): the copy calls whatever it is.
    blocks = [(n, m) for n, m in model.named_modules()
              if isinstance(m, Transformer2DModel) and getattr(m, "is_input_continuous", False)]
    method = Transformer2DModel._get_output_for_continuous_inputs
    verified = is_verified(method)
    hooks = []
    for path, m in blocks:
        if verified and type(m)._get_output_for_continuous_inputs is method:
            # a partial, not a bound method: a pickled block then loads (a bound method pickles by name)
            record.set_attr(m, "_get_output_for_continuous_inputs", functools.partial(_nhwc_output, m),
                            "channels_last_output")
        elif type(m.proj_out) is nn.Conv2d:
            hooks.append(m.proj_out.register_forward_pre_hook(replay_safe(_nhwc_input)))
        else:
            record.skip(path, "Transformer2DModel", f"its output stays NCHW after its {type(m.proj_out).__name__} "
                        f"proj_out: not the diffusers {VERIFIED_WITH} _get_output_for_continuous_inputs the NHWC "
                        "copy mirrors")
    if hooks:
        record.on_undo(lambda: [h.remove() for h in hooks], "channels_last_input", len(hooks))


def _nhwc_output(self, hidden_states, residual, batch_size, height, width, inner_dim):
    """Transformer2DModel._get_output_for_continuous_inputs (diffusers 0.42.1) without the
    ``.contiguous()`` after the permute: [B, H·W, C] rows viewed as [B, C, H, W] are NHWC already."""
    if not self.use_linear_projection:
        hidden_states = hidden_states.reshape(batch_size, height, width, inner_dim).permute(0, 3, 1, 2)
        hidden_states = self.proj_out(hidden_states)
    else:
        hidden_states = self.proj_out(hidden_states)
        hidden_states = hidden_states.reshape(batch_size, height, width, inner_dim).permute(0, 3, 1, 2)
    return hidden_states + residual


def _nhwc_input(module: nn.Module, args: tuple) -> tuple | None:
    x = args[0]
    if isinstance(x, torch.Tensor) and x.dim() == 4 and not is_channels_last(x):
        return (x.contiguous(memory_format=torch.channels_last), *args[1:])
    return None
