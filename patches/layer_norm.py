"""Patch the adaLN glue of the DiT blocks (PixArt's, SD3's, FLUX's) onto sd_kernels' fused LayerNorm ops
(ops/layer_norm.py); the UNets' blocks: patches/unet_blocks.py, which the same op family installs.

diffusers' ``BasicTransformerBlock`` with ``norm_type="ada_norm_single"`` (every block of
PixArtTransformer2DModel) modulates its LayerNorms with six per-sample vectors [B, 1, D], chunks of
``scale_shift_table[None] + timestep.reshape(B, 6, D)``:

| stock (diffusers 0.42.1 ``BasicTransformerBlock.forward``)          | here                                  |
|----------------------------------------------------------------------|---------------------------------------|
| ``norm1(x) * (1 + scale_msa) + shift_msa``                           | ``layer_norm_modulated``: one pass    |
| ``x = gate_msa * attn1(...) + x``                                    | as stock (attn2 follows, no norm)     |
| ``x = attn2(x, ...) + x``; ``norm2(x) * (1 + scale_mlp) + shift_mlp`` | ``gated_residual_layer_norm``, gate None |
| ``x = gate_mlp * ff(...) + x``                                       | ``gated_add``: one pass               |

A block without cross-attention (``attn2`` None) fuses its self-attention's gated residual with norm2
instead (``gated_residual_layer_norm`` with ``gate_msa``). Everything else (the attention and
feed-forward modules, ``ff``'s chunking, the 4-D squeeze) runs as in diffusers' forward, so the
other patchers' replacements inside the block (attention processors, GELU) still apply.

A patched block gets an instance ``forward`` (``AdaNormSingleForward``, counted as
``layer_norm.BasicTransformerBlock``) that calls the original forward instead for a call it does not
serve: ``cross_attention_kwargs`` with anything in it (GLIGEN, a LoRA ``scale``), hidden states not
[B, T, D], no timestep (diffusers' own error). Blocks are left alone (``record.skip``) where
diffusers' forward is not the verified source this re-states (patches/diffusers_sources.py), where a norm is
not a plain ``nn.LayerNorm`` over the last dim, or where a ``pos_embed`` sits between norm1 and the
attention; subclasses are not this patcher's to touch, and the UNets' "layer_norm" blocks are
patches/unet_blocks.py's.

SD3's ``JointTransformerBlock`` (every block of SD3Transformer2DModel) runs two streams, the image
tokens and the text context, through one joint attention (``attn``). Each stream has an
``AdaLayerNormZero`` (``norm1``, ``norm1_context``: ``linear(silu(temb))`` chunked into six [B, D]
vectors, then LayerNorm modulated with two of them) and a plain ``norm2`` / ``norm2_context``:

per stream, stock (diffusers 0.42.1 ``JointTransformerBlock.forward``, ``AdaLayerNormZero.forward``)
and here:

- ``norm1.norm(x) * (1 + scale_msa[:, None]) + shift_msa[:, None]``: ``layer_norm_modulated``;
- ``x = x + gate_msa.unsqueeze(1) * attn_output`` then
  ``norm2(x) * (1 + scale_mlp[:, None]) + shift_mlp[:, None]``: ``gated_residual_layer_norm``;
- ``x = x + gate_mlp.unsqueeze(1) * ff(...)``: ``gated_add``, one pass (our kernel) instead of two; in the FP8
  tier the feed-forward's second GEMM makes it, and where the next block's adaLN-Zero norm follows, that residual
  and the next block's norm run as one kernel (patches/dit_handoff.py).

The last block of an SD3 transformer is ``context_pre_only``: its context goes through an
``AdaLayerNormContinuous`` into the attention and no further; that norm runs as diffusers' module,
the image stream is fused as in every other block. ``JointBlockForward`` (counted as
``layer_norm.JointTransformerBlock``) calls the original forward for a call it does not serve:
``joint_attention_kwargs`` with anything in it (an IP-Adapter's ``ip_hidden_states``, other processor
arguments; a LoRA ``scale`` never reaches the blocks), hidden states not [B, T, D], no context.
Blocks are left alone (``record.skip``) where ``JointTransformerBlock.forward`` or
``AdaLayerNormZero.forward`` is not the verified source, for SD3.5's dual-attention blocks
(``use_dual_attention``: an ``SD35AdaLayerNormZeroX`` norm1 and a second attention), and where a
norm is not the plain module the fused forward assumes (an ``fp32_layer_norm`` adaLN, a class
embedding inside ``AdaLayerNormZero``).

FLUX's double-stream ``FluxTransformerBlock`` has the joint block's structure per stream (an
``AdaLayerNormZero`` ``norm1`` / ``norm1_context``, a plain ``norm2`` / ``norm2_context``) and gets the
same two fusions per stream (``FluxBlockForward``, counted as ``layer_norm.FluxTransformerBlock``); its
rotary embedding goes to the attention as diffusers passes it, a third attention output (an IP-Adapter
processor's image residual) is added after the feed-forward residual and the text stream is clipped in
fp16, as in diffusers' forward. The single-stream ``FluxSingleTransformerBlock`` (text and image tokens
concatenated) has one ``AdaLayerNormZeroSingle`` (``linear(silu(temb))`` in three chunks):
``norm(x) * (1 + scale) + shift`` is ``layer_norm_modulated`` (``FluxSingleBlockForward``, counted as
``layer_norm.FluxSingleTransformerBlock``); its gated ``proj_out`` residual, followed by the next block's
norm, is one ``gated_add`` pass, as every feed-forward residual here (the
FP8 tier puts it, with the join, in
``proj_out``'s GEMM: ``_fp8_joined``; and every stream's feed-forward residual in the feed-forward's
second GEMM: ``_after_attention``; and where the next block of the same kind follows, it runs that residual with the
next block's norm in one kernel instead and hands the normed output on: patches/dit_handoff.py). Both call the
original forward for ``joint_attention_kwargs`` with anything in it (an IP-Adapter's ``ip_hidden_states``, a mask)
and for streams not [B, T, D]; blocks are left alone where the block's forward or its adaLN's is not the
verified source or a norm is not the plain module assumed. A norm module swapped in after the patch
(the FP8 tier's ``Fp8AdaLayerNormZero``, which quantizes in the same pass) runs as itself, in every
block forward here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn as nn

from sd_kernels.ops.custom_ops import gated_residual_layer_norm, layer_norm_modulated
from sd_kernels.ops.fp8_linear import attach_quantized
from sd_kernels.ops.gelu import gelu_into
from sd_kernels.ops.layer_norm import gated_residual_layer_norm_fp8
from sd_kernels.ops.residual import gated_add
from sd_kernels.profiles import scoped

from . import dit_handoff, modulation_split
from .codes_readers import IMAGE, TEXT, codes_only
from .diffusers_sources import VERIFIED_WITH, is_verified
from .flux_attention import flux_module
from .fp8 import Fp8AdaLayerNormZero
from .hooks import called_beside
from .record import PatchRecord

log = logging.getLogger(__name__)
_LOGGED: set[str] = set()


def _note_fallback(block: str, reason: str) -> None:
    """Log, once a process per reason, that a block call runs diffusers' forward."""
    if reason not in _LOGGED:
        _LOGGED.add(reason)
        log.info("sd_kernels: layer_norm: a %s call runs diffusers' forward: %s", block, reason)


def _plain_layer_norm(norm: nn.Module | None) -> bool:
    return type(norm) is nn.LayerNorm and len(norm.normalized_shape) == 1


def _modulated(norm: nn.LayerNorm, x: torch.Tensor, scale: torch.Tensor | None,
              shift: torch.Tensor | None) -> torch.Tensor:
    return layer_norm_modulated(x, norm.weight, norm.bias, norm.eps, scale, shift)


def _gated_norm(norm: nn.LayerNorm, residual: torch.Tensor, branch: torch.Tensor, gate: torch.Tensor | None,
                scale: torch.Tensor | None, shift: torch.Tensor | None, codes: bool = False,
                squeeze: bool | None = None, fused: bool = True,
                values: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(h = (gate ·) branch + residual, norm(h) · (1 + scale) + shift; scale and shift None: norm(h)): one kernel
    where branch has the [B, T, D] residual's shape; else stock's ops (a branch that broadcasts), with the squeeze
    of a 4-D sum that diffusers applies after the gated (self-attention) residual (``squeeze``; default: with a
    gate). ``codes`` (an FP8 projection reads the normed output next; the caller asks for them in eager calls
    only): the kernel also writes its FP8 codes, which travel on it (``attach_quantized``) to that GEMM. ``fused``
    False: stock's ops whatever the shapes, ``norm`` called as itself (a module the kernel does not serve).
    ``values`` False, with ``codes``: the reader takes the codes alone, and the kernel does not write the normed
    values (``gated_residual_layer_norm_fp8``: a NaN stand-in carries the codes)."""
    if fused and residual.dim() == 3 and branch.shape == residual.shape:
        if codes:
            h, y, q, s = gated_residual_layer_norm_fp8(residual, branch, gate, norm.weight, norm.bias, norm.eps,
                                                       scale, shift, values=values)
            return h, attach_quantized(y, q, s)
        return gated_residual_layer_norm(residual, branch, gate, norm.weight, norm.bias, norm.eps, scale, shift)
    h = (branch if gate is None else gate * branch) + residual
    if (gate is not None if squeeze is None else squeeze) and h.ndim == 4:
        h = h.squeeze(1)
    return h, norm(h) if scale is None else norm(h) * (1 + scale) + shift


def _feed_forward(block: nn.Module, ff: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``ff(x)``, chunked as diffusers' block does when ``set_chunk_feed_forward`` asked for it (FLUX's
    blocks have no chunking: whole)."""
    if getattr(block, "_chunk_size", None) is not None:
        from diffusers.models.attention import _chunked_feed_forward

        return _chunked_feed_forward(ff, x, block._chunk_dim, block._chunk_size)
    return ff(x)


class _BlockForward:
    """An instance ``forward`` installed on one diffusers block (it keeps the block, runs under the
    patch's profile)."""

    profile_scoped = True

    def __init__(self, block: nn.Module) -> None:
        self.block = block

    def __repr__(self) -> str:
        return f"{type(self).__name__}({type(self.block).__name__})"

    def _fallback(self, reason: str, *args):
        """The class's forward on ``args``, for a call this forward does not serve (``reason``)."""
        block = self.block
        _note_fallback(type(block).__name__, reason)
        return type(block).forward(block, *args)


class _BasicBlockForward(_BlockForward):
    """The instance ``forward`` of one diffusers ``BasicTransformerBlock``, in its signature: ``_fused`` serves the
    calls ``_unserved`` lets through, the class's forward the others (``cross_attention_kwargs`` with anything in it:
    GLIGEN, a LoRA ``scale``, IP-Adapter masks; hidden states not [B, T, D])."""

    def _unserved(self, hidden_states, timestep, cross_attention_kwargs) -> str | None:
        if cross_attention_kwargs:
            return f"cross_attention_kwargs {sorted(cross_attention_kwargs)}"
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 3:
            return "hidden states that are not [B, T, D]"
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
        reason = self._unserved(hidden_states, timestep, cross_attention_kwargs)
        if reason is not None:
            return self._fallback(reason, hidden_states, attention_mask, encoder_hidden_states, encoder_attention_mask,
                                  timestep, cross_attention_kwargs, class_labels, added_cond_kwargs)
        return self._fused(self.block, hidden_states, attention_mask, encoder_hidden_states, encoder_attention_mask,
                           timestep)


class AdaNormSingleForward(_BasicBlockForward):
    """The instance ``forward`` of one ada_norm_single ``BasicTransformerBlock``: diffusers 0.42.1's
    forward for that norm type, with its modulated LayerNorms (and the gated residual before norm2) in
    sd_kernels' fused ops; any call it does not serve goes to the class's forward."""

    def _unserved(self, hidden_states, timestep, cross_attention_kwargs) -> str | None:
        reason = super()._unserved(hidden_states, timestep, cross_attention_kwargs)
        return reason or ("no timestep" if timestep is None else None)

    @staticmethod
    def _fused(block, hidden_states, attention_mask, encoder_hidden_states, encoder_attention_mask, timestep):
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

        hidden_states = gated_add(hidden_states, gate_mlp, _feed_forward(block, block.ff, norm_hidden_states))
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


def _ada_norm_zero(norm: nn.Module, x: torch.Tensor, emb: torch.Tensor,
                   *readers: tuple[nn.Module, tuple[str, ...] | None]) -> tuple[torch.Tensor, ...]:
    """diffusers' ``AdaLayerNormZero.forward`` (no class embedding: ``norm.emb`` is None; 6 chunks) or
    ``AdaLayerNormZeroSingle.forward`` (3) with its modulated LayerNorm in one kernel: (normed x, the
    chunks after shift_msa and scale_msa: gate_msa, shift_mlp, scale_mlp, gate_mlp, or gate). A module
    that replaced the norm after the patch (the FP8 tier's, whose LayerNorm also quantizes) runs as itself,
    writing no values where it is ``Fp8AdaLayerNormZero``, unhooked, and ``readers`` (what reads the normed x:
    ``codes_readers.codes_only``) take the codes alone."""
    from diffusers.models.normalization import AdaLayerNormZero, AdaLayerNormZeroSingle

    chunks = {AdaLayerNormZero: 6, AdaLayerNormZeroSingle: 3}.get(type(norm))
    if chunks is None:
        if (readers and isinstance(norm, Fp8AdaLayerNormZero) and not torch.compiler.is_compiling()
                and not called_beside(norm) and codes_only(*readers)):
            return norm(x, emb=emb, values=False)
        return norm(x, emb=emb)
    modulation = modulation_split.product(norm, emb)  # 1/W of it a process under context parallelism, if enabled
    if modulation is None:
        modulation = norm.linear(modulation_split.silu(norm, emb))
    shift_msa, scale_msa, *rest = modulation.chunk(chunks, dim=1)
    return _modulated(norm.norm, x, scale_msa[:, None], shift_msa[:, None]), *rest


def _after_attention(block: nn.Module, norm2: nn.LayerNorm, ff: nn.Module, x: torch.Tensor, attn_output: torch.Tensor,
                     gate_msa: torch.Tensor, shift_mlp: torch.Tensor, scale_mlp: torch.Tensor,
                     gate_mlp: torch.Tensor, hand: tuple | None = None) -> torch.Tensor:
    """One stream of an adaLN-Zero block after its attention: ``x + gate_msa.unsqueeze(1) * attn_output``
    and ``norm2`` of it modulated with scale/shift_mlp in one kernel, then ``x + gate_mlp.unsqueeze(1) *
    ff(normed)``: one ``gated_add`` pass, or by the second GEMM of the FP8 tier's feed-forward (``fp8_gemm``: its
    epilogue, or one pass after torch's GEMM) where ``ff`` is one, unchunked and called as nothing but its forward;
    there, with ``hand`` (the next block's norm, the step embedding, that norm's readers: patches/dit_handoff.py),
    the add and that norm in one kernel, the normed output handed on the sum."""
    gated = getattr(ff, "gated_residual", None)  # the FP8 tier's feed-forward (patches/fp8.py)
    fp8 = gated is not None and getattr(block, "_chunk_size", None) is None and not called_beside(ff)
    # eager calls; codes travel only on tensors with a version counter (not made under inference mode:
    # attach_quantized)
    codes = (fp8 and not torch.compiler.is_compiling() and ff.reads_codes()
             and not torch.is_inference_mode_enabled())
    x, normed = _gated_norm(norm2, x, attn_output, gate_msa.unsqueeze(1), scale_mlp[:, None], shift_mlp[:, None],
                            codes=codes, values=not (codes and codes_only((ff, None))))
    if fp8 and hand:
        h, handed = dit_handoff.gated_norm(hand[0], x, gated(normed), gate_mlp.unsqueeze(1), *hand[1:])
        return dit_handoff.hand_on(h, hand[0], hand[1], handed)
    if fp8:
        return gated(normed, gate_mlp, x)  # the gate and the add made by its second GEMM
    return gated_add(x, gate_mlp.unsqueeze(1), _feed_forward(block, ff, normed))


def _unserved_joint(hidden_states, encoder_hidden_states, joint_attention_kwargs) -> str | None:
    """Why a call of a two-stream block (SD3's, FLUX's) is not one its fused forward serves."""
    if joint_attention_kwargs:
        return f"joint_attention_kwargs {sorted(joint_attention_kwargs)}"
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 3:
        return "hidden states that are not [B, T, D]"
    if not isinstance(encoder_hidden_states, torch.Tensor) or encoder_hidden_states.dim() != 3:
        return "no [B, T, D] context"
    return None


class _HandingForward(_BlockForward):
    """A DiT block forward that may make the next block's adaLN-Zero norm with its last residual and take the one
    the block before made (patches/dit_handoff.py)."""

    following: _HandingForward | None = None  # the next block's, set by dit_handoff.link
    clips_fp16 = False  # diffusers' forward clips the block's output in fp16 (a new tensor): nothing handed on there

    def __init__(self, block: nn.Module) -> None:
        super().__init__(block)
        self.skips: dict[str, int] = {}  # calls left without a handed norm, by its name (dit_handoff.taken)
        self.expected: dict[str, bool] = {}  # norms the block before handed on, by name (dit_handoff.hand_on)

    def _stream_norm(self, name: str, x: torch.Tensor, temb: torch.Tensor, readers: tuple) -> tuple:
        """The block's ``name`` adaLN-Zero norm (norm1, norm1_context) of the stream x, with its chunks: as the block
        before handed it on (``dit_handoff.taken``), else made here (``_ada_norm_zero``; ``readers``: the names of
        the block's attention's projections that read it)."""
        block = self.block
        return (dit_handoff.taken(self, name, x, temb)
                or _ada_norm_zero(getattr(block, name), x, temb, (block.attn, readers)))

    def _hand(self, name: str, h: torch.Tensor, temb: torch.Tensor, readers: tuple) -> tuple | None:
        """What ``_after_attention`` needs to make the next block's ``name`` norm with this stream's last residual
        ``h`` (``dit_handoff.next_norm``; ``readers``: the names of the projections of the next block's attention
        that read it), or None."""
        hand = dit_handoff.next_norm(self, name, h)
        return hand and (hand, temb, ((self.following.block.attn, readers),))


class JointBlockForward(_HandingForward):
    """The instance ``forward`` of one SD3 ``JointTransformerBlock``: diffusers 0.42.1's forward with
    each stream's adaLN-Zero LayerNorm in ``layer_norm_modulated`` and each stream's gated attention
    residual + norm2 in ``gated_residual_layer_norm``; in the FP8 tier each stream's last residual makes the next
    block's norm1 / norm1_context (patches/dit_handoff.py); any call it does not serve goes to the class's
    forward."""

    @scoped
    def __call__(
        self,
        hidden_states: torch.FloatTensor,
        encoder_hidden_states: torch.FloatTensor,
        temb: torch.FloatTensor,
        joint_attention_kwargs: dict | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        block = self.block
        reason = _unserved_joint(hidden_states, encoder_hidden_states, joint_attention_kwargs)
        if reason is not None:
            return self._fallback(reason, hidden_states, encoder_hidden_states, temb, joint_attention_kwargs)

        norm_hidden_states, gate_msa, shift_mlp, scale_mlp, gate_mlp = self._stream_norm(
            "norm1", hidden_states, temb, IMAGE)
        if block.context_pre_only:
            norm_encoder_hidden_states = block.norm1_context(encoder_hidden_states, temb)
        else:
            norm_encoder_hidden_states, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = self._stream_norm(
                "norm1_context", encoder_hidden_states, temb, TEXT)

        attn_output, context_attn_output = block.attn(
            hidden_states=norm_hidden_states, encoder_hidden_states=norm_encoder_hidden_states)

        hand = self._hand("norm1", hidden_states, temb, IMAGE)
        hidden_states = _after_attention(block, block.norm2, block.ff, hidden_states, attn_output, gate_msa,
                                         shift_mlp, scale_mlp, gate_mlp, hand)
        if block.context_pre_only:
            encoder_hidden_states = None
        else:
            encoder_hidden_states = _after_attention(
                block, block.norm2_context, block.ff_context, encoder_hidden_states, context_attn_output, c_gate_msa,
                c_shift_mlp, c_scale_mlp, c_gate_mlp, self._hand("norm1_context", encoder_hidden_states, temb, TEXT))
        return encoder_hidden_states, hidden_states


class _FluxForward(_HandingForward):
    """The instance ``forward`` of one FLUX block, in diffusers' signature: ``_fused`` serves the calls
    ``_unserved_joint`` lets through, the class's forward the others."""

    @scoped
    def __call__(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        temb: torch.Tensor,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        joint_attention_kwargs: dict | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        reason = _unserved_joint(hidden_states, encoder_hidden_states, joint_attention_kwargs)
        if reason is not None:
            return self._fallback(reason, hidden_states, encoder_hidden_states, temb, image_rotary_emb,
                                  joint_attention_kwargs)
        return self._fused(self.block, hidden_states, encoder_hidden_states, temb, image_rotary_emb)

    clips_fp16 = True


class FluxBlockForward(_FluxForward):
    """``FluxTransformerBlock`` (double-stream): diffusers 0.42.1's forward with each stream's adaLN-Zero
    LayerNorm in ``layer_norm_modulated`` and each stream's gated attention residual + norm2 in
    ``gated_residual_layer_norm``."""

    def _fused(self, block, hidden_states, encoder_hidden_states, temb, image_rotary_emb):
        norm_hidden_states, gate_msa, shift_mlp, scale_mlp, gate_mlp = self._stream_norm(
            "norm1", hidden_states, temb, IMAGE)
        norm_encoder_hidden_states, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = self._stream_norm(
            "norm1_context", encoder_hidden_states, temb, TEXT)
        attention_outputs = block.attn(hidden_states=norm_hidden_states,
                                       encoder_hidden_states=norm_encoder_hidden_states,
                                       image_rotary_emb=image_rotary_emb)
        attn_output, context_attn_output = attention_outputs[:2]

        hand = len(attention_outputs) == 2 and self._hand("norm1", hidden_states, temb, IMAGE)
        hidden_states = _after_attention(block, block.norm2, block.ff, hidden_states, attn_output, gate_msa,
                                         shift_mlp, scale_mlp, gate_mlp, hand)
        if len(attention_outputs) == 3:  # an IP-Adapter processor's image residual, after the feed-forward's
            hidden_states = hidden_states + attention_outputs[2]
        encoder_hidden_states = _after_attention(block, block.norm2_context, block.ff_context, encoder_hidden_states,
                                                 context_attn_output, c_gate_msa, c_shift_mlp, c_scale_mlp,
                                                 c_gate_mlp, self._hand("norm1_context", encoder_hidden_states, temb,
                                                                        TEXT))
        if encoder_hidden_states.dtype == torch.float16:
            encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
        return encoder_hidden_states, hidden_states


class FluxSingleBlockForward(_FluxForward):
    """``FluxSingleTransformerBlock`` (text and image tokens in one stream): diffusers 0.42.1's forward
    with its ``AdaLayerNormZeroSingle`` LayerNorm in ``layer_norm_modulated``, and the text + image join
    of the previous single block's output (its two halves) without a copy (``_joined``)."""

    def _fused(self, block, hidden_states, encoder_hidden_states, temb, image_rotary_emb):
        text_seq_len = encoder_hidden_states.shape[1]
        hidden_states = _joined(encoder_hidden_states, hidden_states)
        norm_hidden_states, gate = (dit_handoff.taken(self, "norm", encoder_hidden_states, temb, hidden_states)
                                    or _ada_norm_zero(block.norm, hidden_states, temb, (block.attn, IMAGE),
                                                      (block.proj_mlp, None)))
        # sd_kernels' FLUX processor in two halves: the MLP runs while a ring exchange of keys and values
        # (context parallelism) is under way; without one, the same ops in another order
        finish = _begun(block.attn, norm_hidden_states, image_rotary_emb)
        inner = block.attn.inner_dim
        fp8_joined = _fp8_joined(block, norm_hidden_states)
        if fp8_joined is not None:  # the FP8 tier: the GELU, the join and the quantization in one kernel
            mlp = block.proj_mlp(norm_hidden_states)
            attn_output = _attention_output(block, norm_hidden_states, image_rotary_emb, finish)
            joined = None if attn_output.shape == (*mlp.shape[:-1], inner) else (block.act_mlp(mlp),)
        else:
            # torch.cat([attn_output, act_mlp(proj_mlp(norm_hidden_states))], dim=2), the GELU written in its place
            joined = _mlp_beside(block, norm_hidden_states)
            attn_output = _attention_output(block, norm_hidden_states, image_rotary_emb, finish)
        hand = None if joined is not None else dit_handoff.next_norm(self, "norm", hidden_states)
        if hand is not None:  # the gated residual and the next block's norm in one kernel, handed on the text half
            after = self.following.block
            y = fp8_joined(attn_output, mlp, block.act_mlp.approximate, None, None)
            h, handed = dit_handoff.gated_norm(hand, hidden_states, y, gate.unsqueeze(1), temb,
                                               ((after.attn, IMAGE), (after.proj_mlp, None)))
            return dit_handoff.hand_on(h, hand, temb, handed, on=h[:, :text_seq_len]), h[:, text_seq_len:]
        if joined is None:
            hidden_states = fp8_joined(attn_output, mlp, block.act_mlp.approximate, gate, hidden_states)
        else:
            if not isinstance(joined, torch.Tensor):
                joined = torch.cat([attn_output, joined[0]], dim=2)
            elif attn_output.shape == (*joined.shape[:-1], inner):
                joined[..., :inner].copy_(attn_output)
            else:  # another attention output than the width planned for: stock's concatenation (and its errors)
                joined = torch.cat([attn_output, joined[..., inner:]], dim=2)
            # the gated residual in one pass (across blocks with the next norm: the FP8 tier's dit_handoff, above)
            hidden_states = gated_add(hidden_states, gate.unsqueeze(1), block.proj_out(joined))
        if hidden_states.dtype == torch.float16:
            hidden_states = hidden_states.clip(-65504, 65504)
        return hidden_states[:, :text_seq_len], hidden_states[:, text_seq_len:]


def _attention_output(block: nn.Module, norm_hidden_states: torch.Tensor, image_rotary_emb,
                      finish: Callable[[], torch.Tensor] | None) -> torch.Tensor:
    """The single block's attention output: the rest of a call ``_begun`` began, or the whole call."""
    if finish is None:
        return block.attn(hidden_states=norm_hidden_states, image_rotary_emb=image_rotary_emb)
    return finish()


def _fp8_joined(block: nn.Module, x: torch.Tensor) -> Callable[..., torch.Tensor] | None:
    """The FP8 tier's ``proj_out.joined`` (patches/fp8.py: ``residual + gate · proj_out(cat([attention,
    gelu(mlp)]))`` from the two parts, the concatenation never written) where this call can take it:
    torch's GELU, FLUX's widths, eager, no autograd, nothing on ``proj_out`` or ``act_mlp`` that their
    calls run besides their forwards; else None."""
    joined = getattr(block.proj_out, "joined", None)
    if (joined is None or called_beside(block.proj_out)
            or not _gelu_joinable(block, x, getattr(block.proj_mlp, "out_features", -1))):
        return None
    return joined


def _gelu_joinable(block: nn.Module, x: torch.Tensor, mlp_width: int) -> bool:
    """Whether a single block's ``act_mlp`` may be applied beside the attention output without calling
    it (our GELU kernels, ``_mlp_beside`` and ``_fp8_joined``): torch's GELU with nothing that its call
    runs besides its forward, ``proj_out`` reading FLUX's attention width + ``mlp_width``, eager, and
    ``x`` not tracked by autograd."""
    act = block.act_mlp
    return (type(act) is nn.GELU and not called_beside(act) and not torch.compiler.is_compiling()
            and not (torch.is_grad_enabled() and x.requires_grad)
            and getattr(block.proj_out, "in_features", None) == block.attn.inner_dim + mlp_width)


def _begun(attn: nn.Module, hidden_states: torch.Tensor, image_rotary_emb) -> Callable[[], torch.Tensor] | None:
    """``attn(hidden_states=..., image_rotary_emb=...)`` begun by its processor's ``begin`` (sd_kernels' FLUX
    processor), the rest to call; None where the processor has no ``begin``, where calling it would pass
    by the module's hooks (torch's, global or its own, or diffusers' on its forward) or its
    ``Module.compile()``, and under autograd (another order of
    the forward sums the input's gradient in another order: stock's bits kept)."""
    begin = getattr(attn.processor, "begin", None)
    if begin is None or called_beside(attn) or (torch.is_grad_enabled() and hidden_states.requires_grad):
        return None
    return begin(attn, hidden_states, image_rotary_emb=image_rotary_emb)


def _joined(text: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
    """``torch.cat([text, image], dim=1)``; where the two lie back to back in one storage as the halves of
    a contiguous [B, T + S, D] tensor (what the previous single block returned), that tensor as a view,
    uncopied (read from the storage, not from ``_base``, which views of inference tensors lack)."""
    # traced: a cat; tracked by autograd: a cat too (as_strided would pass gradients to text's rows only)
    grad = torch.is_grad_enabled() and (text.requires_grad or image.requires_grad)
    if (not torch.compiler.is_compiling() and not grad and type(text) is type(image) is torch.Tensor
            and text.dim() == image.dim() == 3 and text.dtype == image.dtype):
        (b, t, d), total = text.shape, text.shape[1] + image.shape[1]
        strides = (total * d, d, 1)
        if (image.shape[::2] == (b, d) and text.stride() == image.stride() == strides
                and image.storage_offset() == text.storage_offset() + t * d
                and text.untyped_storage().data_ptr() == image.untyped_storage().data_ptr()):
            return text.as_strided((b, total, d), strides, text.storage_offset())
    return torch.cat([text, image], dim=1)


def _mlp_beside(block: nn.Module, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor]:
    """A [..., attention width + MLP width] buffer whose second part holds ``act_mlp(proj_mlp(x))``, our
    GELU kernel writing it there (``ops.gelu_into``: rows at the buffer's stride, at full vector width;
    torch's GELU into such a slice measured slower than the copy it saves), for the attention output to
    be copied in front: stock's concatenation less one copy of its wider part. (The MLP's output,)
    where ``act_mlp`` is not torch's GELU or has hooks, the widths are not FLUX's or the call is traced
    (the caller concatenates)."""
    hidden = block.proj_mlp(x)
    act = block.act_mlp
    if not _gelu_joinable(block, hidden, hidden.shape[-1]):
        return (act(hidden),)
    width = block.proj_out.in_features
    joined = hidden.new_empty(*hidden.shape[:-1], width)
    gelu_into(hidden, joined[..., width - hidden.shape[-1]:], act.approximate)
    return joined


def _plain_ada_norm_zero(norm: nn.Module) -> bool:
    from diffusers.models.normalization import AdaLayerNormZero

    return type(norm) is AdaLayerNormZero and norm.emb is None and _plain_layer_norm(norm.norm)


def _plain_ada_norm_zero_single(norm: nn.Module) -> bool:
    from diffusers.models.normalization import AdaLayerNormZeroSingle

    return type(norm) is AdaLayerNormZeroSingle and _plain_layer_norm(norm.norm)


def _odd_norms(block: nn.Module, adaln: tuple[str, ...], plain: tuple[str, ...],
               single: bool = False) -> str | None:
    """Why the norms of ``block`` (the adaLN-Zero ones named in ``adaln``, of the ``single`` kind or not,
    and the LayerNorms named in ``plain``) are not the plain modules the fused forwards assume, or None."""
    ada = _plain_ada_norm_zero_single if single else _plain_ada_norm_zero
    odd = [f"{name} {type(getattr(block, name)).__name__}"
           for names, ok in ((adaln, ada), (plain, _plain_layer_norm))
           for name in names if not ok(getattr(block, name))]
    if odd:
        return (f"{', '.join(odd)}: not the plain adaLN-Zero (a LayerNorm, no class embedding) / LayerNorm "
                "over the last dim that the fused forward assumes")
    return None


def _unfit_joint(block: nn.Module) -> str | None:
    """Why a JointTransformerBlock's structure is not the one ``JointBlockForward`` serves."""
    if block.use_dual_attention or block.attn2 is not None:
        return "SD3.5 dual attention (a second attention and an SD35AdaLayerNormZeroX norm1)"
    if block.context_pre_only:
        return _odd_norms(block, ("norm1",), ("norm2",))
    return _odd_norms(block, ("norm1", "norm1_context"), ("norm2", "norm2_context"))


def _unfit_flux(block: nn.Module) -> str | None:
    """Why a FluxTransformerBlock's structure is not the one ``FluxBlockForward`` serves."""
    return _odd_norms(block, ("norm1", "norm1_context"), ("norm2", "norm2_context"))


def _unfit_flux_single(block: nn.Module) -> str | None:
    """Why a FluxSingleTransformerBlock's structure is not the one ``FluxSingleBlockForward`` serves."""
    return _odd_norms(block, ("norm",), (), single=True)


def _install(record: PatchRecord, blocks: list[tuple[str, nn.Module]], sources: tuple,
             unfit, forward: type[_BlockForward], kind: str) -> None:
    """Give each of ``blocks`` a ``forward`` instance, counted as ``layer_norm.<kind>``, while every
    function of ``sources`` (the diffusers code it re-states) is the verified one; a block ``unfit``
    names a reason for is left as it is. Every block left alone is listed in the record."""
    stale = [fn.__qualname__ for fn in sources if not is_verified(fn)]
    for path, block in blocks:
        if stale:
            record.skip(path, stale[0], f"not the diffusers {VERIFIED_WITH} forward that the fused adaLN "
                        "forward re-states: left as it is")
        elif (reason := unfit(block)) is not None:
            record.skip(path, kind, f"left as it is: {reason}")
        else:
            record.set_attr(block, "forward", forward(block), f"layer_norm.{kind}")


def _flux_blocks() -> tuple[type, type] | None:
    """diffusers' FLUX block classes (double-, single-stream), or None (``flux_attention.flux_module``)."""
    module = flux_module()
    return None if module is None else (module.FluxTransformerBlock, module.FluxSingleTransformerBlock)


def patch_layer_norm(model: nn.Module, record: PatchRecord) -> None:
    """Fuse the adaLN glue of ``model``'s DiT blocks: every ``JointTransformerBlock`` (SD3; exact type)
    gets a ``JointBlockForward`` while diffusers' block forward and ``AdaLayerNormZero.forward`` are the
    verified ones, every ``FluxTransformerBlock`` a ``FluxBlockForward`` alike, every
    ``FluxSingleTransformerBlock`` a ``FluxSingleBlockForward`` while its forward and
    ``AdaLayerNormZeroSingle.forward`` are, every ``BasicTransformerBlock`` (exact type) with
    ``norm_type="ada_norm_single"`` (PixArt) an ``AdaNormSingleForward`` while the block's forward is (the UNets'
    blocks: patches/unet_blocks.py)."""
    from diffusers.models.attention import BasicTransformerBlock, JointTransformerBlock
    from diffusers.models.normalization import AdaLayerNormZero, AdaLayerNormZeroSingle

    modules = list(model.named_modules())
    joint = [(path, m) for path, m in modules if type(m) is JointTransformerBlock]
    _install(record, joint, (JointTransformerBlock.forward, AdaLayerNormZero.forward), _unfit_joint,
             JointBlockForward, "JointTransformerBlock")
    if (flux := _flux_blocks()) is not None:
        double, single_stream = flux
        _install(record, [(path, m) for path, m in modules if type(m) is double],
                 (double.forward, AdaLayerNormZero.forward), _unfit_flux, FluxBlockForward, "FluxTransformerBlock")
        _install(record, [(path, m) for path, m in modules if type(m) is single_stream],
                 (single_stream.forward, AdaLayerNormZeroSingle.forward), _unfit_flux_single, FluxSingleBlockForward,
                 "FluxSingleTransformerBlock")
    for _, m in modules:  # SD3's and FLUX's transformers call each list's blocks in order (ControlNets' adds between)
        for name in ("transformer_blocks", "single_transformer_blocks"):
            blocks = getattr(m, name, None)
            if isinstance(blocks, nn.ModuleList):
                forwards = [vars(b).get("forward") for b in blocks]
                dit_handoff.link([f if isinstance(f, _HandingForward) else None for f in forwards])
    single = [(path, m) for path, m in modules
              if type(m) is BasicTransformerBlock and m.norm_type == "ada_norm_single"]
    _install(record, single, (BasicTransformerBlock.forward,), _unfit, AdaNormSingleForward,
             "BasicTransformerBlock")
