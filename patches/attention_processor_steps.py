"""diffusers' AttnProcessor2_0 (0.42.1, models/attention_processor.py) in steps, around its projections
and its one ``F.scaled_dot_product_attention`` call, which ``attend`` makes on sd_kernels' attention
(``sd_kernels.ops.custom_ops.attention``: FlashAttention, the partially fused softmax or stock SDPA per
call). The processors of patches/attention.py and patches/ip_adapter.py are made of them; each checks
the diffusers source it mirrors (patches/diffusers_sources.py) before it is installed.
"""

from __future__ import annotations

import torch

from sd_kernels.ops.custom_ops import attention

from .context_parallel_plans import Ulysses


def prepare(attn, hidden_states, encoder_hidden_states, attention_mask, temb):
    """Before the projections: spatial_norm, 4-D hidden states as [B, H·W, C], the attention mask
    prepared as [B, heads, 1 or Sq, Sk] (the kernels broadcast the size-1 dim), group_norm. Returns
    (hidden_states, attention_mask, residual, the 4-D input's shape or None, batch size)."""
    residual = hidden_states
    if attn.spatial_norm is not None:
        hidden_states = attn.spatial_norm(hidden_states, temb)
    shape = None
    if hidden_states.ndim == 4:
        shape = hidden_states.shape
        hidden_states = hidden_states.view(shape[0], shape[1], shape[2] * shape[3]).transpose(1, 2)
    batch, sequence_length, _ = (hidden_states.shape if encoder_hidden_states is None
                                 else encoder_hidden_states.shape)
    if attention_mask is not None:
        attention_mask = attn.prepare_attention_mask(attention_mask, sequence_length, batch)
        attention_mask = attention_mask.view(batch, attn.heads, -1, attention_mask.shape[-1])
    if attn.group_norm is not None:
        hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)
    return hidden_states, attention_mask, residual, shape, batch


def context(attn, hidden_states, encoder_hidden_states):
    """What keys and values are projected from: the hidden states (self-attention) or the encoder's,
    normalised where the module asks for it."""
    if encoder_hidden_states is None:
        return hidden_states
    return attn.norm_encoder_hidden_states(encoder_hidden_states) if attn.norm_cross else encoder_hidden_states


def heads(t: torch.Tensor, batch: int, heads: int, head_dim: int) -> torch.Tensor:
    """[B, S, heads·D] viewed as [B, heads, S, D]: a strided view, which the kernels take as it is."""
    return t.view(batch, -1, heads, head_dim).transpose(1, 2)


def attend(attn, query, key, value, attention_mask, legacy: bool, precision: str = "exact",
           ulysses: Ulysses | None = None) -> torch.Tensor:
    """The SDPA call, on sd_kernels' attention, back as [B, S, heads·D] in query's dtype (the output
    comes in query's [B, S, heads, D] memory layout: the reshape is a view). ``precision="fp8"``: the
    op runs the calls its FP8 kernel takes there (docs/kernels/attention_fp8.md). ``ulysses``: a
    self-attention whose tokens are split over processes, exchanged (patches/context_parallel_plans.py)."""
    options = dict(scale=attn.scale if legacy else None,  # AttnProcessor2_0 leaves SDPA's default 1/√D
                   upcast=attn.upcast_attention)
    if ulysses is None:
        out = attention(query, key, value, attention_mask, precision=precision, **options)
    elif attention_mask is not None:
        raise ValueError(f"{type(attn).__name__}: a self-attention mask under context parallelism is not served (its "
                         "keys are split over the processes)")
    else:
        out = ulysses.attention(query, key, value, query.shape[2], **options)
    batch, heads, _, head_dim = out.shape
    return out.transpose(1, 2).reshape(batch, -1, heads * head_dim).to(query.dtype)


def finish(attn, hidden_states, residual, shape) -> torch.Tensor:
    """After the attention: the output projection and dropout, the 4-D shape back, the residual
    connection, rescale_output_factor (a division by 1, every UNet's and PixArt's, is skipped: x / 1 is x, bit for
    bit, and the kernel cost SDXL's FP8 UNet step 0.46 ms of 27 on an H200)."""
    hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
    if shape is not None:
        hidden_states = hidden_states.transpose(-1, -2).reshape(shape)
    if attn.residual_connection:
        hidden_states = hidden_states + residual
    if attn.rescale_output_factor == 1:
        return hidden_states
    return hidden_states / attn.rescale_output_factor
