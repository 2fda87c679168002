"""FLUX's attention inputs (bf16): q/k RMSNorm, the text + image join and the rotary embedding, from the
projections' outputs to the attention's inputs, at FLUX.1-dev's shapes.

Shapes: one image (batch 1: FLUX.1-dev is guidance-distilled), 24 heads of 128, 512 T5 tokens and 4096
image tokens at 1024² (3072 at 1024×768). Variants: ``double`` = a double-stream block's call (text and
image streams, separate to_q / to_k / to_v outputs), ``double-fused`` = the same after
``fuse_qkv_projections()`` (q, k, v strided chunks of one to_qkv output), ``single`` = a single-stream
block's call (one stream of text + image tokens, no join).

Implementations: ``stock`` = diffusers' processor lines (unflatten, torch.nn.RMSNorm ×2 or ×4,
torch.cat ×3, apply_rotary_emb ×2), ``compiled`` = torch.compile of the same, ``ours`` =
``sd_kernels.ops.custom_ops.qk_norm_rope`` (what the patched processor calls). Bytes are the fused op's
traffic, the least any implementation moves: q and k read and written once, v too where the streams
are joined (the single stream's v is a view, untouched), cos and sin read once.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from diffusers.models.embeddings import apply_rotary_emb

from bench.common import Case, rotating
from sd_kernels import reference
from sd_kernels.ops import custom_ops
from sd_kernels.testing import rel_err

DTYPE = torch.bfloat16
HEADS, HEAD_DIM, TEXT, EPS = 24, 128, 512, 1e-6
SIZES = {"1024x1024": 4096, "1024x768": 3072}  # image tokens: (H/16)·(W/16)
VARIANTS = ("double", "double-fused", "single")
QUICK = ("1024x1024",)


def make_inputs(variant: str, tokens: int, text: int = TEXT, heads: int = HEADS, head_dim: int = HEAD_DIM,
                device: str = "cuda") -> dict:
    """The processor's state after its projections for ``tokens`` image and ``text`` text tokens: q, k, v
    [1, S, H·D] per stream (the single variant: one stream of text + image tokens), the norms' weights near
    1, FLUX's (cos, sin) [S_text + S, D] fp32 (each angle repeated for its pair)."""
    n = heads * head_dim

    def stream(s):
        if variant == "double-fused":
            return torch.randn(1, s, 3 * n, device=device, dtype=DTYPE).chunk(3, dim=-1)
        return tuple(torch.randn(1, s, n, device=device, dtype=DTYPE) for _ in range(3))

    joined = variant != "single"
    angles = (torch.rand(tokens + text, head_dim // 2, device=device) * 6.3).repeat_interleave(2, dim=1)
    return {
        "image": stream(tokens if joined else tokens + text),
        "text": stream(text) if joined else None,
        "weights": [(1 + 0.1 * torch.randn(head_dim, device=device)).to(DTYPE) for _ in range(4 if joined else 2)],
        "rotary": (angles.cos(), angles.sin()),
    }


def _norm(weight: torch.Tensor) -> torch.nn.RMSNorm:
    m = torch.nn.RMSNorm(weight.shape[0], eps=EPS, device=weight.device, dtype=weight.dtype)
    m.weight.data.copy_(weight)
    return m


def stock(inputs: dict, norms: list) -> tuple:
    """diffusers 0.42.1 FluxAttnProcessor.__call__'s lines between the projections and the attention."""
    query, key, value = (t.unflatten(-1, (-1, HEAD_DIM)) for t in inputs["image"])
    query, key = norms[0](query), norms[1](key)
    if inputs["text"] is not None:
        eq, ek, ev = (t.unflatten(-1, (-1, HEAD_DIM)) for t in inputs["text"])
        eq, ek = norms[2](eq), norms[3](ek)
        query, key, value = (torch.cat([e, x], dim=1) for e, x in ((eq, query), (ek, key), (ev, value)))
    query = apply_rotary_emb(query, inputs["rotary"], sequence_dim=1)
    key = apply_rotary_emb(key, inputs["rotary"], sequence_dim=1)
    return query, key, value


def _op_args(inputs: dict) -> tuple:
    w = inputs["weights"]
    text = inputs["text"] or (None, None, None)
    return (*inputs["image"], HEAD_DIM, w[0], w[1], EPS, *inputs["rotary"], *text,
            *(w[2:] if inputs["text"] is not None else (None, None)))


def ours(inputs: dict, norms: list | None = None) -> tuple:
    return custom_ops.qk_norm_rope(*_op_args(inputs))


def traffic(variant: str, tokens: int, text: int = TEXT, heads: int = HEADS, head_dim: int = HEAD_DIM,
            itemsize: int = 2) -> int:
    """The fused op's bytes per call: q and k (and the joined v) read and written, cos and sin (fp32) read."""
    n = (tokens + text) * heads * head_dim * itemsize
    return (4 if variant == "single" else 6) * n + 2 * (tokens + text) * head_dim * 4


def _case(variant: str, size: str, tokens: int) -> Case:
    make = lambda: make_inputs(variant, tokens)
    inputs = make()
    norms = [_norm(w) for w in inputs["weights"]]
    ref = reference.qk_norm_rope(*(a.double() if isinstance(a, torch.Tensor) else a for a in _op_args(inputs)))
    impls = {"stock": stock, "compiled": torch.compile(stock, dynamic=False), "ours": ours}
    with torch.no_grad():  # also compiles before timing
        errors = {name: max(rel_err(o, r) for o, r in zip(fn(inputs, norms)[:2], ref[:2]))
                  for name, fn in impls.items()}
    nbytes = traffic(variant, tokens)
    del inputs, ref
    nxt = rotating(make, nbytes)

    def timed(fn):
        def call():
            with torch.no_grad():
                return fn(nxt(), norms)
        return call

    return Case("qk_norm_rope", f"1x{tokens + TEXT}x{HEADS}x{HEAD_DIM}", DTYPE, f"{variant}-{size}",
                {name: timed(fn) for name, fn in impls.items()}, bytes=nbytes, errors=errors)


def cases(quick: bool) -> Iterator[Case]:
    for size, tokens in SIZES.items():
        if quick and size not in QUICK:
            continue
        for variant in VARIANTS:
            yield _case(variant, size, tokens)
