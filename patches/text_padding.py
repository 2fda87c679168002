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
text encoder ran and before the denoising loop. It leaves the outputs whole when a mask is not 0/1,
when a row attends to no token (stock then spreads that row over every key, padding included), under
``SD_KERNELS_BACKEND=reference`` (whose promise is stock's arithmetic, bit for bit), and when the
pipeline's ``encode_prompt`` or the transformer's ``forward`` is not the verified diffusers source.
The T5 encoder itself still runs over the padded prompt.
"""

from __future__ import annotations

import torch

from sd_kernels.dispatch import backend

from .record import PatchRecord
from .verified import VERIFIED_WITH, is_verified

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


class TrimmedEncodePrompt:
    """The pipeline's ``encode_prompt`` (bound), returning its embeddings and masks cut to
    ``kept_tokens``; everything else it returns is passed through."""

    def __init__(self, encode_prompt) -> None:
        self.encode_prompt = encode_prompt

    def __call__(self, *args, **kwargs):
        out = self.encode_prompt(*args, **kwargs)
        if backend() == "reference" or not isinstance(out, tuple) or len(out) != 4:
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


def install(pipe: object, transformer: torch.nn.Module, record: PatchRecord) -> bool:
    """Wrap ``pipe.encode_prompt`` (an instance attribute; unpatch removes it); False, with the reason
    in the record, where the pipeline or the transformer is not the verified code."""
    reason = _reason(pipe, transformer)
    if reason is not None:
        record.skip("", type(pipe).__name__, f"cross-attention over the whole padded prompt: {reason}")
        return False
    record.set_attr(pipe, "encode_prompt", TrimmedEncodePrompt(pipe.encode_prompt), kind=KIND)
    return True
