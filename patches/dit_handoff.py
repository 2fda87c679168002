"""The FP8 tier's DiT blocks (SD3's, FLUX's) hand the next block its norm: a block's last gated residual and the
next block's adaLN-Zero LayerNorm in one kernel.

An SD3 or FLUX block ends each stream with ``h = x + gate · y`` (y: the feed-forward's second GEMM in SD3's and FLUX's
double blocks, ``proj_out`` of the join in FLUX's single blocks), and the block the transformer calls next begins with
its ``Fp8AdaLayerNormZero`` on h: the modulated LayerNorm and its FP8 codes. On Hopper the GEMM is torch's, so the gated
residual is one pass of its own after it (x, y read, h written) and the norm another (h read again). Here the block
computes the next block's modulation (the same joined GEMM or step table that norm would use:
``Fp8AdaLayerNormZero.modulation``) and runs ``gated_residual_layer_norm_fp8`` once: x and y read, h and the codes
written (no values where every reader of the normed output takes the codes alone: patches/codes_readers.py). The
normed output and the modulation's other chunks travel on h (``hand_on``); the next block takes them (``taken``) if h
reaches it unchanged (the same storage, shape and version counter; the same step embedding, unchanged; the same
norm), and normalizes h itself otherwise (a ControlNet residual added between the blocks, an in-place change,
another caller); after such a refusal the block before makes ``RETRY_AFTER`` calls without handing that norm on. No
norm is handed to a block with hooks (a pre-hook could change what its norm reads after the block before made it) or
one compiled on its own (``Module.compile()``).

Where: consecutive SD3 joint blocks and FLUX double blocks (each stream: norm1, norm1_context; not SD3's last
block's text stream, whose norm is not adaLN-Zero), consecutive FLUX single blocks (norm; the halves the block returns
joined again without a copy by the next: patches/layer_norm.py's ``_joined``). Not across FLUX's last double block and
its first single one (their streams are concatenated there), not after an IP-Adapter's image residual, not in FLUX
in fp16 (diffusers clips its blocks' outputs there: new tensors), and only where codes travel (eager calls with a
version counter: not under inference mode, autograd or compilation). Where the GEMM is ours (fewer rows than
``ops.fp8_linear.TORCH_GEMM_ROWS``, or no ``torch._scaled_mm`` row scaling), its epilogue would add the gated residual
to the fp32 accumulator; handed on, its output is rounded to the model's dtype first, as torch's GEMM path always
rounds it. ``HAND_ON`` False: each block's norm its own kernel (bench.fp8's ``fp8+own-norms`` row). Measured on an
H200 at 1024²: FLUX.1-dev (bf16), the norms and gated residuals 3.36 → 2.76 ms a step, the image 1,640.2 → 1,629.0 ms
(bench/results/2026-12-02-h200-dit-norm-codes-and-handoff/); SD3-medium (fp16, guidance), 2.04 → 1.81 ms a step, the
image 596.9 → 589.0 ms (bench/results/2026-12-02-h200-sd3-norm-handoff/).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn as nn

from sd_kernels.ops.fp8_linear import attach_quantized
from sd_kernels.ops.layer_norm import gated_residual_layer_norm_fp8

from .codes_readers import codes_only
from .fp8 import Fp8AdaLayerNormZero, codes_travel
from .hooks import called_beside

HAND_ON = True
# After a block refused a handed norm (its stream changed between the blocks: a ControlNet's residual), the block
# before makes this many calls without handing that norm on, then tries again: the norm made twice at most once in
# that many calls. A CUDA graph captured meanwhile keeps the path its capture took.
RETRY_AFTER = 16
_HANDED = "_sd_kernels_handed_ada_norm"


def link(forwards: list) -> None:
    """Tell each block forward among ``forwards`` (the transformer's blocks of one kind, in the order it calls them;
    None for a block another forward serves) which one follows it."""
    for this, following in zip(forwards, forwards[1:]):
        if this is not None and following is not None:
            this.following = following


class Hand(NamedTuple):
    """A norm to hand on: the next block's forward, the norm's name there and the norm."""

    following: object
    name: str
    norm: nn.Module


def next_norm(forward, name: str, h: torch.Tensor) -> Hand | None:
    """The ``name`` norm (``norm1``, ``norm1_context``, ``norm``) of the block after ``forward``'s, where the block's
    residual ``h`` may carry it there: the next block still served by its linked forward and called as nothing but
    that (no hooks: one could change what the norm reads after this block made it), its norm the FP8 tier's
    (``Fp8AdaLayerNormZero``), its norm and modulation layer unhooked, a call in which codes travel, and no norm that
    block refused lately (``taken``); else None."""
    following = getattr(forward, "following", None)
    if (not HAND_ON or following is None or not codes_travel(h) or vars(following.block).get("forward") is not following
            or (h.dtype == torch.float16 and forward.clips_fp16) or h.dim() != 3
            or called_beside(following.block, installed=following)):
        return None
    norm = getattr(following.block, name, None)
    if not isinstance(norm, Fp8AdaLayerNormZero) or called_beside(norm) or called_beside(norm.linear):
        return None
    skips = following.skips.get(name, 0)
    if skips:  # refused lately (a ControlNet's residual between the blocks): made by the block itself a while
        following.skips[name] = skips - 1
        return None
    return Hand(following, name, norm)


def gated_norm(hand: Hand, residual: torch.Tensor, branch: torch.Tensor, gate: torch.Tensor,
               emb: torch.Tensor, readers: tuple) -> tuple[torch.Tensor, tuple]:
    """``h = residual + gate · branch`` and ``norm(h, emb=emb)`` (``hand.norm``, from ``next_norm``) in one kernel:
    (h, the normed output with its codes, without values where ``readers`` take the codes alone, and the modulation's
    other chunks: what the norm's forward returns), for ``hand_on``."""
    norm = hand.norm
    chunks = norm.modulation(emb)
    shift, scale = chunks[0], chunks[1]
    ln = norm.norm
    h, y, q, s = gated_residual_layer_norm_fp8(residual, branch, gate, ln.weight, ln.bias, ln.eps, scale[:, None],
                                               shift[:, None], values=not codes_only(*readers))
    return h, (attach_quantized(y, q, s), *chunks[2:])


def hand_on(h: torch.Tensor, hand: Hand, emb: torch.Tensor, normed: tuple,
            on: torch.Tensor | None = None) -> torch.Tensor:
    """Let ``on`` (default h: the tensor the next block receives) carry ``normed`` (``hand.norm(h, emb=emb)``'s
    result) to the next block, with what ``taken`` checks of h and emb; the next block expects it. Returns ``on``."""
    on = h if on is None else on
    setattr(on, _HANDED, (normed, hand.norm, emb, emb._version, h.data_ptr(), h.shape, h._version))
    hand.following.expected[hand.name] = True
    return on


def taken(forward, name: str, carrier: torch.Tensor, emb: torch.Tensor,
          h: torch.Tensor | None = None) -> tuple | None:
    """``norm(h, emb=emb)`` (``norm``: ``forward``'s block's ``name``) as the block before handed it on ``carrier``
    (``hand_on``; h default: the carrier itself), taken off it; else None. A refusal, after which the block before
    hands that norm on again only after ``RETRY_AFTER`` calls: a norm handed on that did not arrive (the stream
    replaced between the blocks: a ControlNet's residual), or one made for another embedding, or for another h, or
    with h or emb changed in place since. A norm another block's norm made (the block it was made for was not called:
    SD3's skip-layer guidance) is dropped without a refusal: the block that made it hands on as before, to a block
    that is called in the other calls."""
    expected = forward.expected.pop(name, False)
    held = None if torch.compiler.is_compiling() else getattr(carrier, _HANDED, None)
    ours = False
    if held is not None:
        delattr(carrier, _HANDED)
        h = carrier if h is None else h
        normed, by, e, e_version, ptr, shape, version = held
        ours = by is getattr(forward.block, name, None)
        if (ours and e is emb and emb._version == e_version
                and h.data_ptr() == ptr and h.shape == shape and h._version == version):
            return normed
    if expected or ours:
        forward.skips[name] = RETRY_AFTER
    return None
