"""SD3's joint (MMDiT) attention on sd_kernels: ``SDKernelsJointAttnProcessor``.

It is diffusers' ``JointAttnProcessor2_0.__call__`` (diffusers 0.42.1, models/attention_processor.py)
line for line: the image stream's q/k/v projections viewed as [B, heads, S, D], ``norm_q`` /
``norm_k`` where the module has them (SD3.5's RMSNorm), the context stream's ``add_q_proj`` /
``add_k_proj`` / ``add_v_proj`` with ``norm_added_q`` / ``norm_added_k``, the two streams concatenated
along the sequence (the same values, laid out with the heads inner in memory: ``_joined``), then split
back after the attention, ``to_add_out`` on the context's part unless
the module is ``context_pre_only``, ``to_out`` on the image's. Where they can (``JOIN_IN_PLACE`` on, no q/k
norm between, not compiling; plain Linears without autograd) the six projections write their outputs into the
concatenation where it lies, the same values without the copies: the FP8 tier's GEMMs (patches/fp8.py) through their
epilogue, plain ``nn.Linear`` ones one GEMM a sample (``_linear_into``; a stream of a few hundred tokens, SD3's
text, one GEMM copied in), or, where patches/qkv_fusion.py laid a stream's three weights out as one (the
patch does, as for FLUX), one GEMM a stream writing q, k and v side by side; and a plain output projection of
the image stream adds its bias in the GEMMs that read its token slice of the attention output
(``_out_projected``). The one
``F.scaled_dot_product_attention`` call (no mask, the default 1/√D scale, no dropout) goes to
``sd_kernels.ops.custom_ops.attention``, which picks FlashAttention, the partially fused softmax or stock
SDPA per call as the profile says. Like diffusers' processor it ignores ``attention_mask`` and any
other argument. Called without ``encoder_hidden_states`` (SD3.5's second, image-only attention) it
is plain self-attention and returns the image stream alone, as diffusers' does.

``fused=True`` re-states ``FusedJointAttnProcessor2_0.__call__`` instead (what
``pipe.fuse_qkv_projections()`` installs): one ``to_qkv`` GEMM for the image stream, one
``to_added_qkv`` for the context, concatenated before the heads are split, no norm_q / norm_k (diffusers'
fused processor applies none), the same attention call and output projections. It takes 4-D
streams ([B, C, H, W]) as diffusers' code means to and returns each in its own shape; diffusers' splits
the image stream off by ``residual.shape[1]``, the channel count there, and fails.

patches/attention.py installs it on every ``Attention`` whose processor is exactly
``JointAttnProcessor2_0`` or ``FusedJointAttnProcessor2_0`` while that ``__call__`` is the verified
source (patches/diffusers_sources.py).
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from sd_kernels.ops.custom_ops import attention
from sd_kernels.profiles import scoped

from .context_parallel_plans import ulysses_of
from .hooks import called_beside
from .qkv_fusion import plain_parameters


class SDKernelsJointAttnProcessor:
    """diffusers' JointAttnProcessor2_0 with sd_kernels' attention in place of SDPA."""

    profile_scoped = True
    precision = "exact"  # the attention op's; patch(precision="fp8") sets "fp8" on the instance (patches/fp8.py)
    exchanges_tokens = True  # under sd_kernels' context-parallel plan (patches/context_parallel_plans.py)
    # set by diffusers' enable_parallelism: a split that enable_context_parallel did not mark is refused (ulysses_of)
    _parallel_config = None
    # Each stream's q, k, v as one GEMM on the buffer the three weights share (patches/qkv_fusion.py), written
    # into the join (``_projected_in_place``); None: three GEMMs
    qkv = added_qkv = None

    def __init__(self, fused: bool = False) -> None:
        self.fused = fused  # FusedJointAttnProcessor2_0 (after pipe.fuse_qkv_projections())

    def __repr__(self) -> str:
        return f"{type(self).__name__}(fused={self.fused})"

    @scoped
    def __call__(
        self,
        attn,
        hidden_states: torch.FloatTensor,
        encoder_hidden_states: torch.FloatTensor = None,
        attention_mask: torch.FloatTensor | None = None,
        *args,
        **kwargs,
    ) -> torch.FloatTensor:
        if self.fused:
            return self._fused(attn, hidden_states, encoder_hidden_states)
        residual = hidden_states

        batch_size = hidden_states.shape[0]
        joined = _projected_in_place(attn, hidden_states, encoder_hidden_states, (self.qkv, self.added_qkv))
        if joined is not None:  # the projections wrote both streams into the join
            query, key, value = joined
            head_dim = query.shape[-1]
        else:
            query, key, value, head_dim = self._projected(attn, hidden_states, encoder_hidden_states)

        hidden_states, context = _attend(attn, query, key, value, batch_size, head_dim, residual.shape[1],
                                         encoder_hidden_states is not None, self.precision)
        if encoder_hidden_states is not None:
            return hidden_states, context
        return hidden_states

    @staticmethod
    def _projected(attn, hidden_states, encoder_hidden_states):
        """diffusers' q, k, v ([B, heads, S, D] views; both streams joined, ``_joined``) and the head dim."""
        batch_size = hidden_states.shape[0]

        # `sample` projections.
        query = attn.to_q(hidden_states)
        key = attn.to_k(hidden_states)
        value = attn.to_v(hidden_states)

        inner_dim = key.shape[-1]
        head_dim = inner_dim // attn.heads

        query = query.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        key = key.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        value = value.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)

        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)

        # `context` projections.
        if encoder_hidden_states is not None:
            context_query = attn.add_q_proj(encoder_hidden_states)
            context_key = attn.add_k_proj(encoder_hidden_states)
            context_value = attn.add_v_proj(encoder_hidden_states)

            context_query = context_query.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
            context_key = context_key.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
            context_value = context_value.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)

            if attn.norm_added_q is not None:
                context_query = attn.norm_added_q(context_query)
            if attn.norm_added_k is not None:
                context_key = attn.norm_added_k(context_key)

            query, key, value = (_joined(a, b) for a, b in ((query, context_query), (key, context_key),
                                                             (value, context_value)))
        return query, key, value, head_dim

    def _fused(self, attn, hidden_states, encoder_hidden_states):
        """diffusers' FusedJointAttnProcessor2_0.__call__: one to_qkv GEMM per stream (to_added_qkv for
        the context), no norm_q / norm_k (diffusers' fused processor applies none), a context always."""
        if encoder_hidden_states is None:  # diffusers' fails on None.ndim
            raise ValueError("the fused joint attention (after fuse_qkv_projections()) needs encoder_hidden_states; "
                             "an image-only attention (SD3.5's second) takes JointAttnProcessor2_0")
        shapes = [t.shape if t.ndim == 4 else None for t in (hidden_states, encoder_hidden_states)]
        hidden_states, encoder_hidden_states = (
            t if shape is None else t.view(shape[0], shape[1], shape[2] * shape[3]).transpose(1, 2)
            for t, shape in zip((hidden_states, encoder_hidden_states), shapes))
        batch_size = encoder_hidden_states.shape[0]
        image_len = hidden_states.shape[1]

        qkv = attn.to_qkv(hidden_states)
        query, key, value = torch.split(qkv, qkv.shape[-1] // 3, dim=-1)
        encoder_qkv = attn.to_added_qkv(encoder_hidden_states)
        context_query, context_key, context_value = torch.split(encoder_qkv, encoder_qkv.shape[-1] // 3, dim=-1)
        query = torch.cat([query, context_query], dim=1)
        key = torch.cat([key, context_key], dim=1)
        value = torch.cat([value, context_value], dim=1)

        head_dim = key.shape[-1] // attn.heads
        query, key, value = (t.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2) for t in (query, key, value))
        outputs = _attend(attn, query, key, value, batch_size, head_dim, image_len, True, self.precision)
        return tuple(t if shape is None else t.transpose(-1, -2).reshape(shape) for t, shape in zip(outputs, shapes))


def _joined(image: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
    """diffusers' ``torch.cat([image, context], dim=2)`` of two [B, heads, S, D] streams: the same values,
    laid out as [B, S, heads, D] memory (heads inner), the projections' own layout and the one the fused
    processor's join gives. The concatenation then reads contiguous inputs, and the attention writes its
    output heads inner, so the ``transpose(1, 2).reshape`` after it is a view, not a copy of the whole
    output (at SD3-medium 1024², 27 MB per block). The attention kernels read any strides: the same
    kernels, the same bits (tests/patches/test_sd3_patch.py compares them)."""
    return torch.cat([image.transpose(1, 2), context.transpose(1, 2)], dim=1).transpose(1, 2)


# The projections write the join in place and the output projections add their bias in the GEMM on their token
# slice (``_projected_in_place``, ``_out_projected``); False: diffusers' data flow, the projections' own outputs
# joined by torch.cat, F.linear on the slices (the same bits at batch 1: tests/patches/test_sd3_patch.py)
JOIN_IN_PLACE = True
_IMAGE, _CONTEXT = ("to_q", "to_k", "to_v"), ("add_q_proj", "add_k_proj", "add_v_proj")
_NORMS = ("norm_q", "norm_k", "norm_added_q", "norm_added_k")


def _plain_linears(layers, x: torch.Tensor) -> bool:
    """Whether ``_linear_into`` computes what calling these layers on ``x`` computes: each exactly an unhooked
    ``nn.Linear`` whose weight (and bias) are plain tensors (not a subclass, e.g. a quantized weight whose own
    ``F.linear`` would be passed by) in ``x``'s dtype and on its device, and no autograd or autocast (the
    ``out=`` GEMMs take neither)."""
    return (not torch.is_grad_enabled() and not torch.is_autocast_enabled(x.device.type)
            and all(type(m) is nn.Linear and not called_beside(m) and plain_parameters(m)
                    and m.weight.dtype == x.dtype and m.weight.device == x.device for m in layers))


def fusion_serves(attn) -> bool:
    """Whether a joint attention's q, k, v laid out as one GEMM a stream (patches/qkv_fusion.py) would ever
    serve it: only ``_projected_in_place`` calls the fused GEMMs, which needs a context stream and no q/k norm
    (SD3.5's attentions have norms; its second, image-only attention no context projections)."""
    return (getattr(attn, "add_q_proj", None) is not None
            and all(getattr(attn, n, None) is None for n in _NORMS))


# Samples of fewer rows than this (SD3's 333 text tokens) take one GEMM over the batch: a GEMM a sample costs
# them more than the copy it saves (H200, fp16, 1,536 features: two GEMMs of 333 rows 15.8 µs, one of 666 rows
# 8.0 µs). Longer ones gain at every batch measured: SD3-medium's fused q, k, v, a GEMM a sample into the join
# against one GEMM copied in, 193 / 266 µs at batch 2 × 4,096 tokens, 204 / 267 at 8 × 1,024, 395 / 521 at 16 ×
# 1,024 (bench/results/2026-11-29-h200-sd3-lossless-join-in-place)
PER_SAMPLE_ROWS = 1024


def _linear_into(weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for x [B, S, K] written into ``out`` [B, S, N]: where it lies, one GEMM a
    sample (a sample's rows of a token slice are one contiguous block even where the batch's are not), the bias
    added in the GEMM's epilogue; samples of fewer than ``PER_SAMPLE_ROWS`` rows in one GEMM, then copied in.
    For a contiguous x at batch 1 it is the GEMM ``F.linear`` runs; otherwise the GEMMs have other heights
    than ``F.linear``'s (half the rows at batch 2), which the library may tile differently: the same values up
    to the dtype's rounding."""
    if x.shape[0] > 1 and x.shape[1] < PER_SAMPLE_ROWS:
        return out.copy_(F.linear(x, weight, bias))
    for b in range(x.shape[0]):
        if bias is None:
            torch.mm(x[b], weight.t(), out=out[b])
        else:
            torch.addmm(bias, x[b], weight.t(), out=out[b])
    return out


def _out_projected(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)`` for a token slice ``x`` of the attention output, whose samples are not one block: a plain
    Linear's bias is added in its GEMMs' epilogue, a GEMM a sample (``_linear_into``), where ``F.linear`` runs a
    batched matmul over the slice, then adds the bias in a pass of its own (H200, SD3-medium 1024² with
    guidance: 77.7 against 100.3 µs a block for both slices). Samples of fewer than ``PER_SAMPLE_ROWS`` rows,
    and anything but a plain Linear, are called as diffusers calls them (the FP8 tier's GEMMs read the slice in
    place themselves)."""
    if (not JOIN_IN_PLACE or x.dim() != 3 or x.is_contiguous() or x.shape[1] < PER_SAMPLE_ROWS
            or torch.compiler.is_compiling() or not _plain_linears([layer], x)
            or not all(x[b].is_contiguous() for b in range(x.shape[0]))):
        return layer(x)
    return _linear_into(layer.weight, layer.bias, x, x.new_empty(*x.shape[:2], layer.out_features))


def _fused_writers(streams: tuple, attn, fp8: bool) -> list | None:
    """For the image and the text stream, a ``write(x, out)`` of its q, k and v as one GEMM into ``out``
    [B, S, 3·N] (the three weights laid out as one by patches/qkv_fusion.py; under the FP8 tier their codes,
    ``Fp8Projections``); None unless both streams' fusions serve the call, checked before anything is written."""
    from .fp8 import Fp8Projections

    writers = []
    for fused, names in zip(streams, (_IMAGE, _CONTEXT)):
        quantized = getattr(fused, "quantized", None)
        if fused is None or fp8 != isinstance(quantized, Fp8Projections):
            return None
        operands = quantized.operands(attn, names) if fp8 else fused.operands(attn, names)
        if operands is None:
            return None
        writers.append(functools.partial(Fp8Projections.into, operands) if fp8
                       else functools.partial(_linear_into, *operands))
    return writers


def _projected_in_place(attn, hidden_states, encoder_hidden_states, streams: tuple = (None, None)):
    """q, k and v of both streams, joined as ``_joined`` lays them out, each projection writing its rows of
    the join where they lie, so no concatenation copies them (at SD3-medium 1024² with guidance, 27 MB read
    and written three times in each of 24 blocks): the FP8 tier's GEMMs through their epilogue
    (``Fp8Linear.into``: the token slice of the batch), plain Linears one GEMM a sample (``_linear_into``).
    Where patches/qkv_fusion.py laid each stream's three weights out as one (``streams``: the processor's
    ``qkv`` and ``added_qkv``), one GEMM a stream writes a join of q, k and v side by side ([B, S, 3·N]), which
    the attention reads as three strided views. None where that path does not serve the call: no context, a
    norm between the projections and the join (SD3.5's), projections that are neither all unhooked
    ``Fp8Linear`` nor all plain Linears (``_plain_linears``), streams of different batch or dtype, or a
    compiled graph (which runs the ops as diffusers' code calls them)."""
    from .fp8 import Fp8Linear  # patches/fp8.py imports the attention patches

    if (not JOIN_IN_PLACE or encoder_hidden_states is None or torch.compiler.is_compiling()
            or hidden_states.dim() != 3 or encoder_hidden_states.dim() != 3
            or hidden_states.shape[0] != encoder_hidden_states.shape[0]
            or hidden_states.dtype != encoder_hidden_states.dtype or not fusion_serves(attn)):
        return None
    layers = [attn._modules.get(n) for n in _IMAGE + _CONTEXT]
    if all(type(m) is Fp8Linear and not called_beside(m) for m in layers):
        fp8, writer = True, lambda layer: layer.into
    elif _plain_linears(layers, hidden_states):
        fp8, writer = False, lambda layer: functools.partial(_linear_into, layer.weight, layer.bias)
    else:
        return None
    width = layers[0].out_features
    if any(m.out_features != width for m in layers) or width % attn.heads:
        return None
    batch, n_image, n_text = hidden_states.shape[0], hidden_states.shape[1], encoder_hidden_states.shape[1]
    tokens = n_image + n_text
    fused = _fused_writers(streams, attn, fp8)
    if fused is not None:
        buffer = hidden_states.new_empty(batch, tokens, 3 * width)
        fused[0](hidden_states, buffer[:, :n_image])
        fused[1](encoder_hidden_states, buffer[:, n_image:])
        parts = buffer.view(batch, tokens, 3, attn.heads, -1)
        return [parts[:, :, i].transpose(1, 2) for i in range(3)]
    joined = []
    for image, context in zip(layers[:3], layers[3:]):
        buffer = hidden_states.new_empty(batch, tokens, width)
        writer(image)(hidden_states, buffer[:, :n_image])
        writer(context)(encoder_hidden_states, buffer[:, n_image:])
        joined.append(buffer.view(batch, tokens, attn.heads, -1).transpose(1, 2))
    return joined


def _attend(attn, query, key, value, batch_size: int, head_dim: int, image_len: int, joint: bool, precision: str):
    """The attention of both streams' concatenation and the output projections: (the image stream,
    the context stream or None)."""
    # diffusers: F.scaled_dot_product_attention(query, key, value, dropout_p=0.0, is_causal=False)
    ulysses = ulysses_of(attn)
    if ulysses is None:
        hidden_states = attention(query, key, value, precision=precision)
    else:  # this process's image tokens, the text whole: exchanged (exact, as FLUX's Ulysses attention)
        hidden_states = ulysses.attention(query, key, value, image_len)
    hidden_states = hidden_states.transpose(1, 2).reshape(batch_size, -1, attn.heads * head_dim)
    hidden_states = hidden_states.to(query.dtype)

    context = None
    if joint:
        # Split the attention outputs.
        hidden_states, context = hidden_states[:, :image_len], hidden_states[:, image_len:]
        if not attn.context_pre_only:
            context = _out_projected(attn.to_add_out, context)

    # linear proj
    hidden_states = _out_projected(attn.to_out[0], hidden_states)
    # dropout
    hidden_states = attn.to_out[1](hidden_states)
    return hidden_states, context
