"""Which readers of a normed output take its FP8 codes alone, so that the norm need not write its values.

In the FP8 tier a block's LayerNorm writes its output's FP8 codes in the same pass (patches/fp8.py's
``Fp8LayerNorm``, ``Fp8AdaLayerNormZero``; the gated norm2 of patches/layer_norm.py), and they travel on the output
to the projections that read it (``attach_quantized``). Where every reader of that output is one of ours that takes
the codes and nothing else of it, the kernel writes no values: the output is a NaN stand-in that carries the codes
(``ops.layer_norm.unwritten``), so that a reader of values gets NaN, never stale memory. Where one reader might take
values (a hook, a LoRA-wrapped projection, another processor, diffusers' own fused projections), they are written.
"""

from __future__ import annotations

import torch.nn as nn

from .attention import SDKernelsAttnProcessor
from .flux_attention import SDKernelsFluxAttnProcessor, flux_attention_class
from .fp8 import Fp8FeedForward, Fp8Linear
from .hooks import called_beside
from .joint_attention import SDKernelsJointAttnProcessor

# A norm whose every reader takes its FP8 codes alone writes no values: SDXL's norms 2.04 → 1.88 ms a step
# (bench/results/2026-12-01-h200-conv-bias-and-norm-codes/), FLUX.1-dev's 2.86 → 2.78 ms, its step even
# (bench/results/2026-12-02-h200-dit-norm-codes-and-handoff/), SD3-medium's 1.87 → 1.78 ms, its step 26.92 → 26.68 ms
# (bench/results/2026-12-02-h200-sd3-norm-handoff/). False: every normed output written (bench.fp8's
# ``fp8+norm-values`` row).
CODES_ONLY = True

IMAGE = ("to_q", "to_k", "to_v")  # a DiT attention's projections of the image stream (or FLUX's single stream)
TEXT = ("add_q_proj", "add_k_proj", "add_v_proj")  # of the text stream


def codes_only(*readers: tuple[nn.Module, str | tuple[str, ...] | None]) -> bool:
    """Whether a normed output whose readers are ``readers`` may go without its values (``CODES_ONLY`` on, each
    reader's ``reads_codes_only``). A reader is (module, what of it reads the output): a projection or a
    feed-forward with None, an attention with ``"cross"`` (a UNet's cross-attention: its query alone), ``"self"``
    (a UNet's self-attention) or the names of the stream's projections (``IMAGE``, ``TEXT``)."""
    return CODES_ONLY and all(reads_codes_only(module, part) for module, part in readers)


def reads_codes_only(module: nn.Module | None, part: str | tuple[str, ...] | None = None) -> bool:
    """Whether ``module``, called by a block forward on a normed output that carries its FP8 codes, reads nothing of
    that output but the codes and its shape (``codes_only``'s ``part`` says which of it reads). A projection: an
    unhooked ``Fp8Linear`` (which takes the carried codes). A feed-forward: ``Fp8FeedForward`` on its fused path
    (``reads_codes``), unhooked, its first GEMM unhooked. An attention: its class's own forward calling sd_kernels'
    processor (the UNets', SD3's, FLUX's), with nothing before its projections that reads the values (no spatial
    or group norm, no residual connection; not the processors of diffusers' own fused projections), no hook on the
    module, each projection that reads the output an unhooked ``Fp8Linear``."""
    if module is None:
        return False
    if isinstance(module, Fp8FeedForward):  # a hooked first GEMM is called as a module, its hooks given the output
        return module.reads_codes() and not called_beside(module) and not called_beside(module.net[0].proj)
    if part is None:
        return type(module) is Fp8Linear and not called_beside(module)
    names = _projections(module, part)
    return names is not None and all(type(p := module._modules.get(n)) is Fp8Linear and not called_beside(p)
                                     for n in names)


def _projections(attn: nn.Module, part: str | tuple[str, ...]) -> tuple[str, ...] | None:
    """The names of the projections of ``attn`` that read the normed output, where ``attn`` reads nothing else of it
    (``reads_codes_only``); else None."""
    from diffusers.models.attention_processor import Attention

    processor = getattr(attn, "processor", None)
    kind = type(processor)
    if called_beside(attn):
        return None
    if kind is SDKernelsFluxAttnProcessor:  # diffusers' own fused projections (``fused_projections``) read values
        own = flux_attention_class()
        serves = own is not None and type(attn).forward is own.forward and not attn.fused_projections
        return part if isinstance(part, tuple) and serves else None
    if type(attn).forward is not Attention.forward or attn.residual_connection or attn.spatial_norm is not None:
        return None
    if kind is SDKernelsJointAttnProcessor:  # fused: diffusers' to_qkv, a Linear of its own
        return part if isinstance(part, tuple) and not processor.fused else None
    if kind is not SDKernelsAttnProcessor or attn.group_norm is not None or isinstance(part, tuple):
        return None
    return ("to_q",) if part == "cross" else ("to_qkv",) if processor.fused else IMAGE
