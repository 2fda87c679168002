"""Patch the adaLN glue of PixArt's DiT blocks onto sd_kernels' fused LayerNorm ops (ops/layer_norm.py).

diffusers' ``BasicTransformerBlock`` with ``norm_type="ada_norm_single"`` (every block of
PixArtTransformer2DModel) modulates its LayerNorms with six per-sample vectors [B, 1, D], chunks of
``scale_shift_table[None] + timestep.reshape(B, 6, D)``:

| stock (diffusers 0.42.1 ``BasicTransformerBlock.forward``)          | here                                  |
|----------------------------------------------------------------------|---------------------------------------|
| ``norm1(x) * (1 + scale_msa) + shift_msa``                           | ``layer_norm_modulated``: one pass    |
| ``x = gate_msa * attn1(...) + x``                                    | as stock (attn2 follows, no norm)     |
| ``x = attn2(x, ...) + x``; ``norm2(x) * (1 + scale_mlp) + shift_mlp`` | ``gated_residual_layer_norm``, gate None |
| ``x = gate_mlp * ff(...) + x``                                       | as stock (the next norm1 follows)     |

A block without cross-attention (``attn2`` None) fuses its self-attention's gated residual with norm2
instead (``gated_residual_layer_norm`` with ``gate_msa``). Everything else (the attention and
feed-forward modules, ``ff``'s chunking, the 4-D squeeze) runs as in diffusers' forward, so the
other patchers' replacements inside the block (attention processors, GELU) still apply.

A patched block gets an instance ``forward`` (``AdaNormSingleForward``, counted as
``layer_norm.BasicTransformerBlock``) that calls the original forward instead for a call it does not
serve: ``cross_attention_kwargs`` with anything in it (GLIGEN, a LoRA ``scale``), hidden states not
[B, T, D], no timestep (diffusers' own error). Blocks are left alone (``record.skip``) where
diffusers' forward is not the verified source this re-states (patches/verified.py), where a norm is
not a plain ``nn.LayerNorm`` over the last dim, or where a ``pos_embed`` sits between norm1 and the
attention; blocks of another ``norm_type`` (the UNet's "layer_norm" blocks) and subclasses are not
this patcher's to touch.
"""

from __future__ import annotations

import logging

import torch
import torch.nn as nn

from sd_kernels.library import gated_residual_layer_norm, layer_norm_modulated
from sd_kernels.profiles import scoped

from .record import PatchRecord
from .registry import register
from .verified import VERIFIED_WITH, is_verified

log = logging.getLogger("sd_kernels")
_LOGGED: set[str] = set()


def _plain_layer_norm(norm: nn.Module | None) -> bool:
    return type(norm) is nn.LayerNorm and len(norm.normalized_shape) == 1


def _modulated(norm: nn.LayerNorm, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    return layer_norm_modulated(x, norm.weight, norm.bias, norm.eps, scale, shift)


def _gated_norm(norm: nn.LayerNorm, residual: torch.Tensor, branch: torch.Tensor, gate: torch.Tensor | None,
                scale: torch.Tensor, shift: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(h = (gate ·) branch + residual, norm(h) · (1 + scale) + shift): one kernel where branch has the
    [B, T, D] residual's shape; else stock's ops (a branch that broadcasts), with the squeeze of a
    4-D sum that diffusers applies after the gated (self-attention) residual."""
    if residual.dim() == 3 and branch.shape == residual.shape:
        return gated_residual_layer_norm(residual, branch, gate, norm.weight, norm.bias, norm.eps, scale, shift)
    h = (branch if gate is None else gate * branch) + residual
    if gate is not None and h.ndim == 4:
        h = h.squeeze(1)
    return h, norm(h) * (1 + scale) + shift


class AdaNormSingleForward:
    """The instance ``forward`` of one ada_norm_single ``BasicTransformerBlock``: diffusers 0.42.1's
    forward for that norm type, with its modulated LayerNorms (and the gated residual before norm2) in
    sd_kernels' fused ops; any call it does not serve goes to the class's forward."""

    profile_scoped = True

    def __init__(self, block: nn.Module) -> None:
        self.block = block

    def __repr__(self) -> str:
        return f"{type(self).__name__}({type(self.block).__name__})"

    def _unserved(self, hidden_states, timestep, cross_attention_kwargs) -> str | None:
        if cross_attention_kwargs:
            return f"cross_attention_kwargs {sorted(cross_attention_kwargs)}"
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 3:
            return "hidden states that are not [B, T, D]"
        if timestep is None:
            return "no timestep"
        return None

    @scoped
    def __call__(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        timestep: torch.LongTensor | None = None,
        cross_attention_kwargs: dict | None = None,
        class_labels: torch.LongTensor | None = None,
        added_cond_kwargs: dict | None = None,
    ) -> torch.Tensor:
        block = self.block
        reason = self._unserved(hidden_states, timestep, cross_attention_kwargs)
        if reason is not None:
            if reason not in _LOGGED:
                _LOGGED.add(reason)
                log.info("sd_kernels: layer_norm: a BasicTransformerBlock call runs diffusers' forward: %s", reason)
            return type(block).forward(block, hidden_states, attention_mask, encoder_hidden_states,
                                       encoder_attention_mask, timestep, cross_attention_kwargs, class_labels,
                                       added_cond_kwargs)

        batch_size = hidden_states.shape[0]
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = (
            block.scale_shift_table[None] + timestep.reshape(batch_size, 6, -1)
        ).chunk(6, dim=1)
        norm_hidden_states = _modulated(block.norm1, hidden_states, scale_msa, shift_msa)

        attn_output = block.attn1(
            norm_hidden_states,
            encoder_hidden_states=encoder_hidden_states if block.only_cross_attention else None,
            attention_mask=attention_mask,
        )
        if block.attn2 is None:  # the self-attention's gated residual goes straight into norm2
            residual, branch, gate = hidden_states, attn_output, gate_msa
        else:
            attn_output = gate_msa * attn_output
            hidden_states = attn_output + hidden_states
            if hidden_states.ndim == 4:
                hidden_states = hidden_states.squeeze(1)
            # PixArt applies no norm before its cross-attention (diffusers' forward says why).
            attn_output = block.attn2(
                hidden_states,
                encoder_hidden_states=encoder_hidden_states,
                attention_mask=encoder_attention_mask,
            )
            residual, branch, gate = hidden_states, attn_output, None
        hidden_states, norm_hidden_states = _gated_norm(block.norm2, residual, branch, gate, scale_mlp, shift_mlp)

        if block._chunk_size is not None:
            from diffusers.models.attention import _chunked_feed_forward

            ff_output = _chunked_feed_forward(block.ff, norm_hidden_states, block._chunk_dim, block._chunk_size)
        else:
            ff_output = block.ff(norm_hidden_states)
        ff_output = gate_mlp * ff_output
        hidden_states = ff_output + hidden_states
        if hidden_states.ndim == 4:
            hidden_states = hidden_states.squeeze(1)
        return hidden_states


def _unfit(block: nn.Module) -> str | None:
    """Why an ada_norm_single block's structure is not the one ``AdaNormSingleForward`` serves."""
    if not (_plain_layer_norm(block.norm1) and _plain_layer_norm(block.norm2)):
        return (f"norm1 {type(block.norm1).__name__} / norm2 {type(block.norm2).__name__}: "
                "not plain LayerNorms over the last dim")
    if block.pos_embed is not None:
        return "a pos_embed between norm1 and the attention"
    return None


@register("layer_norm")
def patch_layer_norm(model: nn.Module, record: PatchRecord) -> None:
    """Give every ``BasicTransformerBlock`` (exact type) of ``model`` with ``norm_type="ada_norm_single"``
    an ``AdaNormSingleForward``, while diffusers' forward is the verified one."""
    from diffusers.models.attention import BasicTransformerBlock

    blocks = [(path, m) for path, m in model.named_modules()
              if type(m) is BasicTransformerBlock and m.norm_type == "ada_norm_single"]
    if blocks and not is_verified(BasicTransformerBlock.forward):
        for path, _ in blocks:
            record.skip(path, "BasicTransformerBlock.forward", f"not the diffusers {VERIFIED_WITH} forward that "
                        "the fused adaLN forward re-states: left as it is")
        return
    for path, block in blocks:
        reason = _unfit(block)
        if reason is not None:
            record.skip(path, "BasicTransformerBlock", f"ada_norm_single block left as it is: {reason}")
            continue
        record.set_attr(block, "forward", AdaNormSingleForward(block), "layer_norm.BasicTransformerBlock")
