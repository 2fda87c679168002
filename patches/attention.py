"""Patch diffusers' attention onto sd_kernels: an attention processor, installed per Attention module.

``SDKernelsAttnProcessor`` is diffusers' ``AttnProcessor2_0`` (diffusers 0.42.1,
models/attention_processor.py) step for step (spatial_norm, group_norm, 3-D and 4-D hidden states,
self and cross attention with norm_cross, attention masks through ``attn.prepare_attention_mask``,
norm_q / norm_k, residual connection, rescale_output_factor) with the one
``F.scaled_dot_product_attention`` call replaced by ``sd_kernels.ops.attention.attention``, which
picks FlashAttention, the partially fused softmax or stock SDPA per call.

Only modules whose processor is exactly ``AttnProcessor2_0``, ``AttnProcessor``,
``FusedAttnProcessor2_0``, ``IPAdapterAttnProcessor2_0``, ``JointAttnProcessor2_0`` or
``FusedJointAttnProcessor2_0`` (SD3's joint text + image attention, unfused or after
``fuse_qkv_projections()``: ``SDKernelsJointAttnProcessor``, patches/joint_attention.py) are touched, and
only while their source is the one mirrored (patches/diffusers_sources.py); other custom processors are left
alone. FLUX's attention modules are diffusers' ``FluxAttention`` (not an ``Attention``): one whose
processor is exactly ``FluxAttnProcessor`` gets ``SDKernelsFluxAttnProcessor`` (patches/flux_attention.py)
on the same terms. An IP-Adapter
processor keeps its object (its weights and scales): it becomes ``SDKernelsIPAdapterProcessor``
(patches/ip_adapter.py) by a change of class that unpatch reverts. For
``AttnProcessor`` (diffusers' choice when ``scale_qk=False``) the replacement keeps its differences:
the scale is ``attn.scale`` and norm_q / norm_k are not applied. ``FusedAttnProcessor2_0`` (what
``pipe.fuse_qkv_projections()`` installs, before ``patch``) differs only in its projections: one
``to_qkv`` GEMM for self-attention, ``to_q`` + ``to_kv`` for cross-attention; the q, k, v split
views go to the kernels as they are. Upcasting: both kernels compute scores and softmax in fp32
(``upcast_softmax`` is always honoured); the partial softmax stores fp32 scores for fp16 inputs and
for ``upcast_attention``. The processor is installed with ``record.set_attr``, never ``set_attn_processor``,
so that ``unpatch`` puts the very same processor objects back.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from sd_kernels.profiles import scoped

from . import attention_processor_steps as steps
from . import flux_attention, qkv_fusion, text_projections
from .context_parallel_plans import ulysses_of
from .diffusers_sources import VERIFIED_WITH, is_verified
from .group_norm import SCALE_DEPRECATION
from .joint_attention import SDKernelsJointAttnProcessor, fusion_serves
from .record import PatchRecord

# The record's count name of each processor we install (others: "attention_processor").
_KINDS = {SDKernelsJointAttnProcessor: "joint_attention_processor",
          flux_attention.SDKernelsFluxAttnProcessor: flux_attention.KIND}
SERVED = ("AttnProcessor2_0, AttnProcessor, FusedAttnProcessor2_0, IPAdapterAttnProcessor2_0, JointAttnProcessor2_0 "
          "and FusedJointAttnProcessor2_0")


class SDKernelsAttnProcessor:
    """diffusers' AttnProcessor2_0 with sd_kernels' attention; ``legacy`` mirrors AttnProcessor."""

    profile_scoped = True
    precision = "exact"  # the attention op's; patch(precision="fp8") sets "fp8" on the instance (patches/fp8.py)
    exchanges_tokens = True  # under sd_kernels' context-parallel plan (patches/context_parallel_plans.py)
    # set by diffusers' enable_parallelism: a split that enable_context_parallel did not mark is refused (ulysses_of)
    _parallel_config = None
    # A self-attention's q, k, v as one GEMM on the buffer the three weights share (patches/qkv_fusion.py),
    # installed by patch_attention on modules that are not cross-attentions; None: three GEMMs
    qkv = added_qkv = None
    # A cross-attention's keys and values of the text from one batched GEMM a projection width for all the model's
    # cross-attentions (patches/text_projections.py), installed by patch_attention; None: two GEMMs
    text_kv = None

    def __init__(self, legacy: bool = False, fused: bool = False) -> None:
        self.legacy = legacy
        self.fused = fused  # FusedAttnProcessor2_0: q, k, v from attn.to_qkv (self) or to_q + to_kv (cross)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(legacy={self.legacy}, fused={self.fused})"

    @scoped
    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        temb: torch.Tensor | None = None,
        *args,
        **kwargs,
    ) -> torch.Tensor:
        if len(args) > 0 or kwargs.get("scale", None) is not None:
            from diffusers.utils import deprecate

            deprecate("scale", "1.0.0", SCALE_DEPRECATION)

        hidden_states, attention_mask, residual, shape, batch = steps.prepare(
            attn, hidden_states, encoder_hidden_states, attention_mask, temb)
        if self.fused and encoder_hidden_states is None:  # one GEMM for q, k and v
            qkv = attn.to_qkv(hidden_states)
            query, key, value = torch.split(qkv, qkv.shape[-1] // 3, dim=-1)
        elif encoder_hidden_states is None and self.qkv is not None and not torch.compiler.is_compiling():
            query, key, value = qkv_fusion.stream(self.qkv, attn, 0, hidden_states)  # one GEMM where it serves
        else:
            query = attn.to_q(hidden_states)
            source = steps.context(attn, hidden_states, encoder_hidden_states)
            if self.fused:  # one GEMM for k and v
                kv = attn.to_kv(source)
                key, value = torch.split(kv, kv.shape[-1] // 2, dim=-1)
            else:
                kv = None if self.text_kv is None or encoder_hidden_states is None else self.text_kv.keys_values(
                    attn, source)
                key, value = (attn.to_k(source), attn.to_v(source)) if kv is None else kv
        head_dim = key.shape[-1] // attn.heads
        query, key, value = (steps.heads(t, batch, attn.heads, head_dim) for t in (query, key, value))
        if not self.legacy:
            if attn.norm_q is not None:
                query = attn.norm_q(query)
            if attn.norm_k is not None:
                key = attn.norm_k(key)
        # a cross-attention's queries are this process's, its keys the whole text: nothing to exchange
        ulysses = ulysses_of(attn) if encoder_hidden_states is None else None
        hidden_states = steps.attend(attn, query, key, value, attention_mask, self.legacy, self.precision, ulysses)
        return steps.finish(attn, hidden_states, residual, shape)


# Ours with a ``precision`` for the attention op, which patch(precision="fp8") sets (patches/fp8.py). The
# IP-Adapter's keeps "exact": its calls attend over the text and a few image tokens, which the FP8 op
# declines anyway.
PRECISION_PROCESSORS = (SDKernelsAttnProcessor, SDKernelsJointAttnProcessor, flux_attention.SDKernelsFluxAttnProcessor)


def _replacement(processor) -> SDKernelsAttnProcessor | SDKernelsJointAttnProcessor | type | str | None:
    """Our processor for a stock one, the class a stock IP-Adapter processor becomes, a reason (str)
    where the stock one is not the code ours mirrors, or None for a custom processor."""
    from diffusers.models.attention_processor import (
        AttnProcessor,
        AttnProcessor2_0,
        FusedAttnProcessor2_0,
        FusedJointAttnProcessor2_0,
        IPAdapterAttnProcessor2_0,
        JointAttnProcessor2_0,
    )

    for cls, fused in ((JointAttnProcessor2_0, False), (FusedJointAttnProcessor2_0, True)):
        if type(processor) is cls:
            if not is_verified(cls.__call__):
                return (f"{cls.__name__}.__call__ is not the diffusers {VERIFIED_WITH} code that "
                        "sd_kernels' joint processor mirrors: left as it is")
            return SDKernelsJointAttnProcessor(fused=fused)
    for cls, kind in ((AttnProcessor2_0, {}), (AttnProcessor, {"legacy": True}),
                      (FusedAttnProcessor2_0, {"fused": True}), (IPAdapterAttnProcessor2_0, None)):
        if type(processor) is cls:
            if not is_verified(cls.__call__):
                return (f"{cls.__name__}.__call__ is not the diffusers {VERIFIED_WITH} code that "
                        "sd_kernels' processors mirror: left as it is")
            if kind is None:  # it keeps its adapters' weights and scales: it becomes our subclass
                from .ip_adapter import SDKernelsIPAdapterProcessor

                return SDKernelsIPAdapterProcessor
            return SDKernelsAttnProcessor(**kind)
    return None


def _fusable(module: nn.Module, processor) -> bool:
    """Whether ``processor`` on ``module`` takes q, k and v as one GEMM laid out by patches/qkv_fusion.py: FLUX's
    unless diffusers fused the module itself (its processor then reads ``to_qkv``), SD3's joint and the UNets'
    and PixArt's self-attention where the processor is not diffusers' fused one (whose ``to_qkv`` serves).
    ``fused_projections`` is read for FLUX only: diffusers' ``unfuse_qkv_projections()`` of a UNet puts the
    processors back but leaves that flag set (diffusers 0.42.1)."""
    if isinstance(processor, flux_attention.SDKernelsFluxAttnProcessor):
        return not getattr(module, "fused_projections", False)
    if isinstance(processor, SDKernelsJointAttnProcessor):
        return not processor.fused and fusion_serves(module)
    return type(processor) is SDKernelsAttnProcessor and not processor.fused and not module.is_cross_attention


def patch_attention(model: nn.Module, record: PatchRecord) -> None:
    """Give every diffusers ``Attention`` in ``model`` whose processor is stock (AttnProcessor2_0,
    AttnProcessor, FusedAttnProcessor2_0, exact types) an ``SDKernelsAttnProcessor``, one whose
    processor is JointAttnProcessor2_0 or FusedJointAttnProcessor2_0 an ``SDKernelsJointAttnProcessor``; turn each
    IPAdapterAttnProcessor2_0 into an ``SDKernelsIPAdapterProcessor``; give every ``FluxAttention``
    whose processor is FluxAttnProcessor an ``SDKernelsFluxAttnProcessor``."""
    from diffusers.models.attention_processor import Attention

    flux = flux_attention.flux_attention_class()
    replaced: dict[int, tuple] = {}  # id of each processor installed -> (it, the one it replaced)
    ours: list[tuple[str, nn.Module, SDKernelsAttnProcessor]] = []
    record.on_undo(lambda: _give_back_originals(model, replaced), "attention_processor", 0)
    for path, module in model.named_modules():
        processor = getattr(module, "processor", None)
        if flux is not None and isinstance(module, flux):
            new = flux_attention.replacement(processor, module)
        elif isinstance(module, Attention):
            new = _replacement(processor)
        else:
            continue
        if isinstance(new, str):
            record.skip(path, type(processor).__name__, new)
        elif isinstance(new, type):
            record.set_class(processor, new, "ip_adapter_processor")
        elif new is not None:
            replaced[id(new)] = (new, processor)
            record.set_attr(module, "processor", new, _KINDS.get(type(new), "attention_processor"))
            if _fusable(module, new):
                qkv_fusion.install(module, new, path, record)
            if type(new) is SDKernelsAttnProcessor:
                ours.append((path, module, new))
        else:
            record.skip(path, type(processor).__name__, f"custom attention processor (only {SERVED} are served)")
    text_projections.install(ours, record)


def _give_back_originals(model: nn.Module, replaced: dict[int, tuple]) -> None:
    """diffusers' ``fuse_qkv_projections()`` keeps the processors it found in ``original_attn_processors``
    for ``unfuse_qkv_projections()`` to put back; fused while patched, those are ours: on unpatch they
    become the stock ones they replaced, so that unfusing after unpatch restores stock processors."""
    for module in model.modules():
        kept = vars(module).get("original_attn_processors")
        if isinstance(kept, dict):
            for name, processor in kept.items():
                ours, stock = replaced.get(id(processor), (None, None))
                if ours is processor:
                    kept[name] = stock
