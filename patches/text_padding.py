"""PixArt's cross-attention over the prompt's tokens, not over T5's padding.

PixArt-α/Σ pipelines pad every prompt to ``max_sequence_length`` T5 tokens (300 for Σ, 120 for α) and
hand the transformer the padded embeddings with a 0/1 mask. The transformer turns the mask into an
additive bias, (1 − mask) · −10000, and uses both only as the keys and values of each block's
cross-attention (after the caption projection, which works token by token). A key whose mask is 0
in every row therefore adds exp(s − 10000 − m) = 0 (fp32 underflow: the scores s are O(10)) to each
softmax sum and nothing to each output, as long as the row has one unmasked key: dropping such keys
changes no value. A short prompt leaves most of the 300 keys masked: the cross-attention then reads
and multiplies ~5x the data it needs (2 × 16 heads × 4,096 queries × 300 keys at 1024²; measured on
the H100: 0.082 ms per masked call over 300 keys, 0.041 over 64; 35.0 → 33.5 ms per replayed
PixArt-Σ step, docs/patch.md).

``install`` wraps the pipeline's ``encode_prompt`` so that it returns the embeddings and masks cut
after the last token any row attends to, rounded up to a multiple of ``TOKEN_BUCKET`` (each distinct
length is a new CUDA graph signature, and a new compilation under ``compile=True``: the rounding
bounds them to five at 300 tokens). It reads the masks on the host once per pipeline call, after the
text encoder ran and before the denoising loop (and once per T5 call before it, below). It leaves the
outputs whole when a mask is not 0/1, when a row attends to no token (stock then spreads that row
over every key, padding included), under ``SD_KERNELS_BACKEND=reference`` (whose promise is stock's
arithmetic, bit for bit), and when the pipeline's ``encode_prompt`` or the transformer's ``forward``
is not the verified diffusers source.

The T5 encoder runs over the prompt's tokens too (``PromptTokens``, hooks on the pipeline's
``T5EncoderModel``, active only inside the wrapped ``encode_prompt``): each call gets its input ids
and mask cut to ``kept_tokens`` of that mask, and its ``last_hidden_state`` comes back padded with
zeros to the length it was asked for. Exact for the tokens kept: T5's self-attention adds
(1 − mask) · finfo.min to the scores of the padded keys (exp → 0), and its relative position bias
depends only on j − i, which a cut at the end does not change; everything else works token by token.
The zeros stand where stock has T5's outputs for padding: every row masks them, so the transformer
gives them weight exactly 0 (and the cut above removes most of them). ``encode_prompt`` sizes the
negative prompt's tokenization from the prompt's embeddings: the padding back keeps that length.
Measured on the H100: 15.70 ms per replayed T5-XXL call at 300 tokens, 8.29 at 64 (docs/patch.md).
"""

from __future__ import annotations

import contextlib

import torch

from sd_kernels.runtime.dispatch import backend

from .diffusers_sources import VERIFIED_WITH, is_verified
from .families import family_of
from .record import PatchRecord

TOKEN_BUCKET = 64
KIND = "text_padding"


def kept_tokens(masks, bucket: int = TOKEN_BUCKET) -> int | None:
    """How many leading tokens the cross-attention needs for these [B, T] 0/1 masks (None entries
    skipped): the last token any row attends to, rounded up to ``bucket``; None when nothing can be
    cut (or a mask is not a plain 0/1 key mask, or a row attends to nothing)."""
    masks = [m for m in masks if m is not None]
    if not masks or any(m.ndim != 2 for m in masks) or len({m.shape[1] for m in masks}) != 1:
        return None
    host = torch.cat([m.detach().to(masks[0].dtype) for m in masks]).cpu()  # one copy, one wait
    tokens = host.shape[1]
    if tokens == 0 or not bool(((host == 0) | (host == 1)).all()):
        return None
    attends = host != 0
    if not bool(attends.any(1).all()):
        return None
    last = int(attends.any(0).nonzero().max()) + 1
    keep = min(tokens, -(-last // bucket) * bucket)
    return keep if keep < tokens else None


class PromptTokens:
    """Forward hooks of the pipeline's T5 encoder: while ``on``, a call ``encoder(ids,
    attention_mask=mask)`` (the verified ``encode_prompt``'s only form) runs over ``kept_tokens(mask)``
    tokens and returns its ``last_hidden_state`` padded back with zeros. Any other call, or one whose
    mask keeps everything, runs as asked."""

    def __init__(self) -> None:
        self.on = False
        self.full: int | None = None  # the length asked for, between the two hooks of a cut call

    @contextlib.contextmanager
    def active(self):
        """The hooks on for the block, off after it (whether or not it raised)."""
        self.on = True
        try:
            yield
        finally:
            self.on = False

    def before(self, module, args, kwargs):
        self.full = None
        if not self.on or len(args) != 1 or set(kwargs) != {"attention_mask"}:
            return None
        (ids,), mask = args, kwargs["attention_mask"]
        config = module.config
        if (not isinstance(ids, torch.Tensor) or not isinstance(mask, torch.Tensor) or ids.shape != mask.shape
                or config.output_hidden_states or config.output_attentions):
            return None
        keep = kept_tokens((mask,))
        if keep is None:
            return None
        self.full = ids.shape[1]
        return (ids[:, :keep],), {"attention_mask": mask[:, :keep]}

    def after(self, module, args, kwargs, output):
        full, self.full = self.full, None
        if full is None:
            return None
        hidden = output[0]
        padded = torch.cat([hidden, hidden.new_zeros(hidden.shape[0], full - hidden.shape[1], *hidden.shape[2:])], 1)
        if isinstance(output, tuple):
            return (padded, *output[1:])
        output["last_hidden_state"] = padded  # transformers' ModelOutput: the key and the attribute
        return output


class TrimmedEncodePrompt:
    """The pipeline's ``encode_prompt`` (bound), returning its embeddings and masks cut to
    ``kept_tokens``; everything else it returns is passed through. ``tokens``: the T5 encoder's
    hooks, switched on for the call (None: the encoder runs over the padded prompt)."""

    def __init__(self, encode_prompt, tokens: PromptTokens | None = None) -> None:
        self.encode_prompt = encode_prompt
        self.tokens = tokens

    def __call__(self, *args, **kwargs):
        if backend() == "reference":
            return self.encode_prompt(*args, **kwargs)
        with contextlib.nullcontext() if self.tokens is None else self.tokens.active():
            out = self.encode_prompt(*args, **kwargs)
        if not isinstance(out, tuple) or len(out) != 4:
            return out
        keep = kept_tokens(out[1::2])  # (mask, negative mask)
        if keep is None:
            return out
        return tuple(None if t is None else t[:, :keep].contiguous() for t in out)


def _reason(pipe, transformer) -> str | None:
    encode = getattr(type(pipe), "encode_prompt", None)
    if encode is None or not is_verified(encode):
        return f"its encode_prompt is not the one verified with diffusers {VERIFIED_WITH}"
    if not is_verified(type(transformer).forward):
        return f"{type(transformer).__name__}.forward is not the one verified with diffusers {VERIFIED_WITH}"
    return None


def _prompt_tokens(pipe, record: PatchRecord) -> PromptTokens | None:
    """The hooks on ``pipe.text_encoder`` (a T5 encoder, not in ``ignore=``); unpatch removes them."""
    encoder = getattr(pipe, "text_encoder", None)
    if "text_encoder" in record.ignore or type(encoder).__name__ != "T5EncoderModel":
        return None
    tokens = PromptTokens()
    handles = (encoder.register_forward_pre_hook(tokens.before, with_kwargs=True),
               encoder.register_forward_hook(tokens.after, with_kwargs=True))
    record.on_undo(lambda: [h.remove() for h in handles], kind=KIND)
    return tokens


def install(pipe: object, transformer: torch.nn.Module, record: PatchRecord) -> bool:
    """Wrap ``pipe.encode_prompt`` (an instance attribute) and hook its T5 encoder (unpatch removes
    both); False, with the reason in the record, where the pipeline or the transformer is not the
    verified code."""
    reason = _reason(pipe, transformer)
    if reason is not None:
        record.skip("", type(pipe).__name__, f"cross-attention over the whole padded prompt: {reason}")
        return False
    tokens = _prompt_tokens(pipe, record)
    record.set_attr(pipe, "encode_prompt", TrimmedEncodePrompt(pipe.encode_prompt, tokens), kind=KIND)
    return True


def install_all(obj: object, models: list, record: PatchRecord) -> None:
    """A pipeline whose denoiser's cross-attention masks the prompt's padding: its ``encode_prompt``
    cuts the padding no row attends to (part of the "attention" op family)."""
    if "attention" not in record.ops or isinstance(obj, torch.nn.Module):
        return
    record.scope = ""
    for _, model in models:
        fam = family_of(model)
        if fam is not None and fam.denoiser and fam.text_padding:
            install(obj, model, record)
