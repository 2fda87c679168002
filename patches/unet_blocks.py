"""The UNets' transformer blocks' residual adds and LayerNorms as one kernel each (ops/layer_norm.py).

diffusers' ``BasicTransformerBlock`` (``norm_type="layer_norm"``: SD 1.x/2.x's and SDXL's) has three plain
LayerNorms, each after a residual add but the first: ``x = attn1(norm1(x)) + x`` then ``norm2(x)``, and
``x = attn2(...) + x`` then ``norm3(x)``. Each of those adds and the LayerNorm after it are one
``gated_residual_layer_norm`` (gate None): x and the attention's output read once, the sum and the normed output
written once, instead of an add kernel (two reads, a write) and a LayerNorm (a read, a write). In the FP8 tier,
where the norms are patches/fp8.py's ``Fp8LayerNorm``, the same kernel writes the FP8 codes the next projection
reads. Where a transformer model has several blocks (SDXL's: 2 or 10), the feed-forward residual that ends a block
and the next block's norm1 are one kernel as well, the sum carrying the normed output to the next block (not under
``torch.inference_mode()``, autograd or compilation: ``fp8.codes_travel``); the first
block's norm1 runs on the same kernel alone (``layer_norm_modulated``, where the norm is a plain LayerNorm) instead
of torch's. ``LayerNormBlockForward`` (counted as ``layer_norm.LayerNormBlock``) calls the original forward for
``cross_attention_kwargs`` with anything in it (GLIGEN, a LoRA ``scale``) and hidden states not [B, T, D]; a
block with a ``pos_embed`` is left alone.

Installed by the ``layer_norm`` op family (patches/registry.py) beside patches/layer_norm.py's DiT block forwards,
while diffusers' ``BasicTransformerBlock.forward`` is the verified source this re-states
(patches/diffusers_sources.py); exactly reversible with the rest of the record.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .codes_readers import codes_only
from .fp8 import codes_travel
from .hooks import called_beside
from .layer_norm import _BasicBlockForward, _feed_forward, _gated_norm, _install, _modulated, _plain_layer_norm
from .record import PatchRecord


def _writes_codes(norm: nn.Module) -> bool:
    """Whether ``norm`` is the FP8 tier's UNet LayerNorm (patches/fp8.py ``Fp8LayerNorm``), which writes its
    output's FP8 codes in the same pass."""
    return getattr(type(norm), "writes_codes", False)


def _fusable_norm(norm: nn.Module) -> bool:
    """Whether a UNet block's ``norm`` runs inside the fused kernels: a plain LayerNorm over the last dim or the FP8
    tier's, called as nothing but its forward (no hooks: ``called_beside``)."""
    return (_plain_layer_norm(norm) or _writes_codes(norm)) and not called_beside(norm)


def _residual_norm(norm: nn.Module, residual: torch.Tensor, branch: torch.Tensor, squeeze: bool,
                   reader: nn.Module | None = None, part: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A UNet block's ``h = branch + residual`` and ``norm(h)``: one kernel where ``_fusable_norm``, the FP8 tier's
    norm then writing its codes in the same kernel, in the calls where its own forward would
    (``Fp8LayerNorm.codes_travel``); another norm (one swapped in after the patch, a hooked one) is called as itself
    after stock's add. ``squeeze``: a 4-D sum squeezed, as diffusers does after the self-attention.
    ``reader`` (with ``part``: the module that reads the output next, None where that is not one module called on
    it whole; ``"cross"`` or ``"self"`` for an attention, as ``codes_readers.codes_only`` takes them): with codes,
    where ``codes_only((reader, part))``, the kernel writes no values (asked only then)."""
    fused = _fusable_norm(norm)
    codes = fused and _writes_codes(norm) and norm.codes_travel(residual)
    values = not (codes and reader is not None and codes_only((reader, part)))
    return _gated_norm(norm, residual, branch, None, None, None, codes=codes, squeeze=squeeze, fused=fused,
                       values=values)


class LayerNormBlockForward(_BasicBlockForward):
    """The instance ``forward`` of one UNet ``BasicTransformerBlock`` (``norm_type="layer_norm"``: SD's, SDXL's):
    diffusers 0.42.1's forward for that norm type with the residual add after each attention and the LayerNorm
    after it (norm2 after the self-attention, norm3 after the cross-attention) in one kernel
    (``gated_residual_layer_norm``; in the FP8 tier also writing the codes the next projection reads). The
    feed-forward's residual and the next block's norm1 are one kernel too where ``link_blocks`` named the block the
    model calls next: the sum carries that norm's output to it (``_hand_norm``), which takes it if the sum reaches
    it unchanged and normalizes it itself otherwise. Else norm1, a plain LayerNorm, runs on the same kernel
    (``layer_norm_modulated``) and the feed-forward residual is diffusers' add. A call it does not serve goes to the
    class's forward: ``cross_attention_kwargs`` with anything in it (GLIGEN, a LoRA ``scale``, IP-Adapter masks),
    hidden states not [B, T, D]."""

    following: LayerNormBlockForward | None = None  # the next block's, set by link_blocks

    def _fused(self, block, hidden_states, attention_mask, encoder_hidden_states, encoder_attention_mask, timestep):
        norm1 = block.norm1
        normed = _handed_norm(hidden_states, norm1)  # made by the block before, with the residual add
        if normed is None:  # a plain LayerNorm on our kernel; the FP8 tier's (which writes codes) as itself
            plain = _plain_layer_norm(norm1) and not called_beside(norm1)
            normed = _modulated(norm1, hidden_states, None, None) if plain else norm1(hidden_states)
        attn_output = block.attn1(
            normed,
            encoder_hidden_states=encoder_hidden_states if block.only_cross_attention else None,
            attention_mask=attention_mask,
        )
        if block.attn2 is not None:
            part = "self" if encoder_hidden_states is None else "cross"
            hidden_states, norm_hidden_states = _residual_norm(block.norm2, hidden_states, attn_output, squeeze=True,
                                                               reader=block.attn2, part=part)
            attn_output = block.attn2(norm_hidden_states, encoder_hidden_states=encoder_hidden_states,
                                      attention_mask=encoder_attention_mask)
        # the self-attention's residual when there is no cross-attention: squeezed as diffusers squeezes it
        chunked = getattr(block, "_chunk_size", None) is not None  # the chunks, slices of the output, carry no codes
        hidden_states, norm_hidden_states = _residual_norm(block.norm3, hidden_states, attn_output,
                                                           squeeze=block.attn2 is None,
                                                           reader=None if chunked else block.ff)
        ff_output = _feed_forward(block, block.ff, norm_hidden_states)
        after = self.next_norm()
        if after is not None and ff_output.shape == hidden_states.shape and codes_travel(hidden_states):
            following = self.following.block  # its attn1 a self-attention: it reads the normed output alone
            hidden_states, normed = _residual_norm(after, hidden_states, ff_output, squeeze=True,
                                                   reader=None if following.only_cross_attention else following.attn1,
                                                   part="self")
            return _hand_norm(hidden_states, after, normed)
        hidden_states = ff_output + hidden_states
        if hidden_states.ndim == 4:
            hidden_states = hidden_states.squeeze(1)
        return hidden_states

    def next_norm(self) -> nn.Module | None:
        """The norm1 of the block the model calls next (``link_blocks``) while that block is still served by a
        ``LayerNormBlockForward`` and its norm1 runs in the fused kernels (``_fusable_norm``); else None."""
        following = self.following
        if following is None or vars(following.block).get("forward") is not following:
            return None
        norm = following.block.norm1
        return norm if _fusable_norm(norm) else None


_HANDED = "_sd_kernels_handed_norm"


def _hand_norm(h: torch.Tensor, norm: nn.Module, normed: torch.Tensor) -> torch.Tensor:
    """Let the residual stream ``h`` carry ``norm(h)`` (``normed``) to the next block, whose norm1 ``norm`` is; returns
    h. Only where ``fp8.codes_travel``: h's version counter then shows a change of h in place between the blocks, and
    the next block normalizes h itself."""
    setattr(h, _HANDED, (normed, norm, h._version))
    return h


def _handed_norm(h: torch.Tensor, norm: nn.Module) -> torch.Tensor | None:
    """``norm(h)`` as the block before handed it on h (``_hand_norm``), taken off h, unless it was made by another
    norm or h changed in place since; else None."""
    handed = None if torch.compiler.is_compiling() else getattr(h, _HANDED, None)
    if handed is None:
        return None
    delattr(h, _HANDED)
    normed, by, version = handed
    return normed if by is norm and version == h._version else None


def link_blocks(blocks: list[nn.Module]) -> None:
    """Tell each ``LayerNormBlockForward`` among ``blocks`` (a model's ``transformer_blocks``, in the order its forward
    calls them) which one follows it, so that its feed-forward residual and that block's norm1 are one kernel."""
    forwards = [vars(b).get("forward") for b in blocks]
    for this, following in zip(forwards, forwards[1:]):
        if isinstance(this, LayerNormBlockForward) and isinstance(following, LayerNormBlockForward):
            this.following = following


def _unfit_layer_norm_block(block: nn.Module) -> str | None:
    """Why a UNet ("layer_norm") block's structure is not the one ``LayerNormBlockForward`` serves."""
    if block.pos_embed is not None:
        return "a pos_embed between a norm and its attention"
    if block.norm3 is None or (block.attn2 is not None and block.norm2 is None):
        return "a norm missing"
    return None


def patch_unet_blocks(model: nn.Module, record: PatchRecord) -> None:
    """Every ``BasicTransformerBlock`` (exact type) of ``model`` with ``norm_type="layer_norm"`` (SD's, SDXL's UNets)
    gets a ``LayerNormBlockForward`` while diffusers' block forward is the verified one; the blocks of each
    ``Transformer2DModel`` are linked in the order its forward calls them (``link_blocks``)."""
    from diffusers.models.attention import BasicTransformerBlock

    modules = list(model.named_modules())
    blocks = [(path, m) for path, m in modules if type(m) is BasicTransformerBlock and m.norm_type == "layer_norm"]
    _install(record, blocks, (BasicTransformerBlock.forward,), _unfit_layer_norm_block, LayerNormBlockForward,
             "LayerNormBlock")
    for _, m in modules:  # diffusers' Transformer2DModel calls its blocks in this order, nothing between them
        blocks = getattr(m, "transformer_blocks", None)
        if type(m).__name__ == "Transformer2DModel" and isinstance(blocks, nn.ModuleList):
            link_blocks(list(blocks))
