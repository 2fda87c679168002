"""T5's encoder (PixArt-α/Σ, SD3 and FLUX.1 read the prompt through it) on sd_kernels' kernels.

transformers writes T5's blocks as many small ops: its LayerNorm (an RMSNorm: fp32 cast, square, mean,
rsqrt, product, cast, weight) takes seven kernels, the gated feed-forward two GEMMs, a tanh GELU of
seven elementwise kernels and their product, and the self-attention three projections and an attention
over a [1, H, S, S] relative position bias (SDPA with the bias as its mask, made contiguous again in
every block). At FLUX's 512 tokens these cost more than the encoder's GEMMs. The patch changes the class
of three kinds of module in the pipeline's ``T5EncoderModel`` (``record.set_class``: subclasses that add
behaviour, no state; unpatch gives each its class back):

- ``T5LayerNorm`` (op family ``layer_norm``): ``rms_norm``, one kernel in fp32, one rounding;
- ``T5DenseGatedActDense`` with a tanh GELU (``gelu_new``; op family ``gelu``): one GEMM over ``wi_1`` and
  ``wi_0`` laid out in one buffer, then ``geglu(h, "tanh")`` (wi_1(x)·gelu(wi_0(x)) in one pass), then ``wo``;
- ``T5Attention``, the encoder's self-attention (op family ``attention``): one GEMM over ``q``, ``k`` and ``v``
  laid out alike, then ``ops.attention`` with the position bias (and the mask, combined as transformers' SDPA
  path combines them) as an additive float mask, at T5's scale 1.

The joined weights are the lossless patch's layout (``qkv_fusion.FusedProjections``): the Parameters
become views of one buffer, nothing is held twice, and a call whose layout no longer holds (a weight
assigned anew, a hook, a LoRA wrapper) takes the separate projections. The position bias the first
block computes is returned contiguous (one copy, which every later block reads tile by tile).

Each patched forward serves the calls it was written for and hands the others to transformers' own:
training (dropout), autograd, a decoder, cross-attention, a cache, an attention asked for its weights, and
every call under SD_KERNELS_BACKEND=reference (stock's arithmetic, bit for bit); also flex attention and any
attention implementation but SDPA and eager. One difference from stock: a sample whose every token is masked
(a mask of zeros, which no diffusers pipeline makes: the prompt's end token always counts) gets zeros where
SDPA averages the values uniformly.
Left alone, and recorded: a T5 in ``ignore=``, a module whose transformers forward is not the source this
mirrors (``diffusers_sources.TRANSFORMERS_VERIFIED``), a feed-forward of another activation, and the
joins under ``compile=`` or a memory budget (``qkv_fusion.wanted``). Numbers: docs/patch.md, "T5's encoder".
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from sd_kernels.ops import custom_ops
from sd_kernels.profiles import scoped
from sd_kernels.runtime.dispatch import reference_backend

from . import qkv_fusion
from .diffusers_sources import TRANSFORMERS_VERIFIED_WITH, is_verified
from .families import GRAPH_PARTS
from .record import PatchRecord, same_name_subclass

ENCODER = "T5EncoderModel"
# transformers' names of the tanh GELU (ACT2FN["gelu_new"], ["gelu_pytorch_tanh"]): what geglu(h, "tanh") computes
TANH_GELUS = ("NewGELUActivation", "PytorchGELUTanh", "GELUTanh")
IMPLEMENTATIONS = ("sdpa", "eager")  # the attention implementations whose masks the patched attention takes
_JOINED = "_sd_kernels_joined"  # on a patched feed-forward or attention: its FusedProjections (or None)
_MASKED = "_sd_kernels_masked"  # on a call's position bias: (mask, versions, the bias and mask combined)


def _joined(module: nn.Module, names: tuple[str, ...], x: torch.Tensor) -> torch.Tensor | None:
    """The projections ``names`` of ``x`` as one GEMM while their layout holds, else None; None in a call
    torch.compile traces (the layout's guard reads data pointers), as ``qkv_fusion.projections``."""
    fused = module.__dict__.get(_JOINED)
    if fused is None or torch.compiler.is_compiling():
        return None
    return fused.project(module, names, x)


class _Norm:
    profile_scoped = True

    @scoped
    def forward(self, hidden_states):
        if reference_backend():
            return super().forward(hidden_states)
        return custom_ops.rms_norm(hidden_states, self.weight, self.variance_epsilon)


class _FeedForward:
    """wi_1(x)·gelu_tanh(wi_0(x)) → wo, the two GEMMs in one (``wi_1`` rows first: geglu's a, then its gate)."""

    profile_scoped = True
    NAMES = ("wi_1", "wi_0")

    @scoped
    def forward(self, hidden_states):
        h = None if self.training or reference_backend() else _joined(self, self.NAMES, hidden_states)
        if h is None:
            return super().forward(hidden_states)
        y = custom_ops.geglu(h, "tanh")
        wo = self.wo.weight
        if isinstance(wo, torch.Tensor) and y.dtype != wo.dtype and wo.dtype != torch.int8:  # T5's own cast
            y = y.to(wo.dtype)
        return self.wo(y)


def _with_mask(position_bias: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The bias and the mask as one additive mask, as transformers' SDPA path combines them: a boolean mask
    keeps the bias where True and puts the dtype's minimum elsewhere, a float one is added."""
    if mask.dtype == torch.bool:
        return torch.where(mask, position_bias, torch.finfo(position_bias.dtype).min)
    return position_bias + mask


def _masked_bias(position_bias: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``_with_mask``, made once a call: every block gets the first block's bias and the same mask (transformers
    makes a boolean one even where nothing is masked: 1.2 ms of FLUX's 24 blocks at 512 tokens), so the sum is
    kept on the bias tensor for the next blocks, against the mask and both version counters. Not kept for
    inference tensors (no version counter) or in traced code."""
    if torch.compiler.is_compiling() or position_bias.is_inference() or mask.is_inference():
        return _with_mask(position_bias, mask)
    key = (mask, mask._version, position_bias._version)
    held = getattr(position_bias, _MASKED, None)
    if held is not None and held[0] is key[0] and held[1:3] == key[1:]:
        return held[-1]
    combined = _with_mask(position_bias, mask)
    setattr(position_bias, _MASKED, (*key, combined))
    return combined


class _Attention:
    """The encoder's self-attention: one GEMM for q, k, v, our attention with the position bias as its mask."""

    profile_scoped = True
    NAMES = ("q", "k", "v")

    def _serves(self, mask, key_value_states, args, kwargs) -> bool:
        """The encoder's self-attention under the SDPA or eager implementation (whose masks ``_with_mask``
        combines as they do; flex attention's ``BlockMask`` and implementations registered by others go to
        transformers), without a cache, weights asked for (by argument or the config) or autograd."""
        config = self.config
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        return not (self.training or self.is_decoder or key_value_states is not None or args or cache is not None
                    or kwargs.get("output_attentions") or getattr(config, "output_attentions", False)
                    or getattr(config, "_attn_implementation", None) not in IMPLEMENTATIONS
                    or not (mask is None or isinstance(mask, torch.Tensor)) or torch.is_grad_enabled()
                    or reference_backend())

    @scoped
    def forward(self, hidden_states, mask=None, key_value_states=None, position_bias=None, *args, **kwargs):
        if not self._serves(mask, key_value_states, args, kwargs):
            return super().forward(hidden_states, mask, key_value_states, position_bias, *args, **kwargs)
        b, s = hidden_states.shape[:2]
        qkv = _joined(self, self.NAMES, hidden_states)
        parts = qkv.chunk(3, dim=-1) if qkv is not None else [getattr(self, n)(hidden_states) for n in self.NAMES]
        q, k, v = (t.view(b, s, -1, self.key_value_proj_dim).transpose(1, 2) for t in parts)
        if position_bias is None:
            if self.has_relative_attention_bias:
                position_bias = self.compute_bias(s, s, device=q.device).contiguous()
            else:
                position_bias = torch.zeros((1, self.n_heads, s, s), device=q.device, dtype=q.dtype)
        bias = position_bias if mask is None else _masked_bias(position_bias, mask)
        out = custom_ops.attention(q, k, v, bias, float(self.scaling))
        return self.o(out.transpose(1, 2).reshape(b, s, -1)), position_bias, None


_BEHAVIOUR = {"T5LayerNorm": (_Norm, "layer_norm", "t5.rms_norm"),
              "T5DenseGatedActDense": (_FeedForward, "gelu", "t5.feed_forward"),
              "T5Attention": (_Attention, "attention", "t5.attention")}


@functools.cache
def _patched_class(cls: type) -> type:
    """``cls`` with our forward: same name, module and qualified name; refuses pickling."""
    return same_name_subclass(cls, {"_sd_kernels_t5": True}, mixins=(_BEHAVIOUR[cls.__name__][0],))


def _unfit(module: nn.Module, op: str) -> str | None:
    """Why ``module`` keeps transformers' forward, or None."""
    cls = type(module)
    if not is_verified(cls.forward):
        return (f"{cls.__name__}.forward is not the transformers source this patch mirrors "
                f"({' or '.join(TRANSFORMERS_VERIFIED_WITH)})")
    if op == "gelu" and type(module.act).__name__ not in TANH_GELUS:
        return f"its activation is {type(module.act).__name__}, not the tanh GELU geglu computes"
    return None


def _join(module: nn.Module, names: tuple[str, ...], path: str, record: PatchRecord) -> bool:
    """Lay the Linears ``names`` of ``module`` out as one (recorded for unpatch); False where they cannot be."""
    linears = [module._modules.get(n) for n in names]
    why = qkv_fusion.wanted(record) or qkv_fusion.unfit(linears)
    if why is not None:
        record.skip(f"{path}.{names[0]}", type(linears[0]).__name__, f"{', '.join(names)} not joined: {why}")
        return False
    fused = qkv_fusion.FusedProjections(linears)
    record.set_attr(module, _JOINED, fused, None)
    record.on_undo(fused.release, qkv_fusion.KIND, count=0)
    return True


def patch_t5(encoder: nn.Module, record: PatchRecord) -> None:
    """Give ``encoder``'s norms, gated feed-forwards and self-attentions our forwards (those whose op family
    ``record.ops`` names)."""
    if any(vars(type(m)).get("_sd_kernels_t5") for m in encoder.modules()):
        record.skip("", type(encoder).__name__, "left as it is: already patched through another pipeline that shares "
                    "it (unpatching that one takes its kernels away here too)")
        return
    for path, module in list(encoder.named_modules()):
        entry = _BEHAVIOUR.get(type(module).__name__)
        if entry is None:
            continue
        _, op, kind = entry
        if op not in record.ops:
            continue
        if type(module).__module__ != "transformers.models.t5.modeling_t5":
            continue
        why = _unfit(module, op)
        if why is not None:
            record.skip(path, type(module).__name__, why)
            continue
        if op == "gelu" and not _join(module, _FeedForward.NAMES, path, record):
            continue  # without the join the feed-forward is as stock runs it
        if op == "attention" and not module.is_decoder:
            _join(module, _Attention.NAMES, path, record)
        record.set_class(module, _patched_class(type(module)), kind)


def install_all(obj: object, record: PatchRecord) -> None:
    """Patch the T5 encoders among ``obj``'s components (``GRAPH_PARTS``, not in ``ignore=``)."""
    components = getattr(obj, "components", None)
    if not isinstance(components, dict):
        return
    for part in GRAPH_PARTS:
        encoder = components.get(part)
        if part in record.ignore or type(encoder).__name__ != ENCODER:
            continue
        record.scope = part
        patch_t5(encoder, record)


__all__ = ["ENCODER", "install_all", "patch_t5"]
