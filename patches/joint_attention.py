"""SD3's joint (MMDiT) attention on sd_kernels: ``SDKernelsJointAttnProcessor``.

It is diffusers' ``JointAttnProcessor2_0.__call__`` (diffusers 0.42.1, models/attention_processor.py)
line for line: the image stream's q/k/v projections viewed as [B, heads, S, D], ``norm_q`` /
``norm_k`` where the module has them (SD3.5's RMSNorm), the context stream's ``add_q_proj`` /
``add_k_proj`` / ``add_v_proj`` with ``norm_added_q`` / ``norm_added_k``, the two streams concatenated
along the sequence, then split back after the attention, ``to_add_out`` on the context's part unless
the module is ``context_pre_only``, ``to_out`` on the image's. The one
``F.scaled_dot_product_attention`` call (no mask, the default 1/√D scale, no dropout) goes to
``sd_kernels.library.attention``, which picks FlashAttention, the partially fused softmax or stock
SDPA per call as the profile says. Like diffusers' processor it ignores ``attention_mask`` and any
other argument. Called without ``encoder_hidden_states`` (SD3.5's second, image-only attention) it
is plain self-attention and returns the image stream alone, as diffusers' does.

patches/attention.py installs it on every ``Attention`` whose processor is exactly
``JointAttnProcessor2_0`` while that ``__call__`` is the verified source (patches/verified.py).
"""

from __future__ import annotations

import torch

from sd_kernels.library import attention
from sd_kernels.profiles import scoped


class SDKernelsJointAttnProcessor:
    """diffusers' JointAttnProcessor2_0 with sd_kernels' attention in place of SDPA."""

    profile_scoped = True

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

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
        residual = hidden_states

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

            query = torch.cat([query, context_query], dim=2)
            key = torch.cat([key, context_key], dim=2)
            value = torch.cat([value, context_value], dim=2)

        # diffusers: F.scaled_dot_product_attention(query, key, value, dropout_p=0.0, is_causal=False)
        hidden_states = attention(query, key, value)
        hidden_states = hidden_states.transpose(1, 2).reshape(batch_size, -1, attn.heads * head_dim)
        hidden_states = hidden_states.to(query.dtype)

        if encoder_hidden_states is not None:
            # Split the attention outputs.
            hidden_states, encoder_hidden_states = (
                hidden_states[:, : residual.shape[1]],
                hidden_states[:, residual.shape[1] :],
            )
            if not attn.context_pre_only:
                encoder_hidden_states = attn.to_add_out(encoder_hidden_states)

        # linear proj
        hidden_states = attn.to_out[0](hidden_states)
        # dropout
        hidden_states = attn.to_out[1](hidden_states)

        if encoder_hidden_states is not None:
            return hidden_states, encoder_hidden_states
        return hidden_states
