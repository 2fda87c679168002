"""adaLN benchmarks (fp16): LayerNorm + modulation, and the gated residual before it, at DiT shapes.

Shapes (batch 2 for classifier-free guidance, 1024² images): PixArt-Σ's 4096 tokens at D = 1152,
modulation as [B, 1, D] chunks of its [B, 6, D] table; SD3-medium's 4096 image tokens at D = 1536
and (full runs) its 154 context tokens, modulation as [B, D] chunks of AdaLayerNormZero's [B, 6·D].

Implementations: ``stock`` = the blocks' own torch ops (``norm(x) * (1 + scale) + shift``, and
``residual + gate * branch`` before it), ``compiled`` = torch.compile of the same, ``ours`` =
``sd_kernels.ops``. Bytes are the fused op's traffic, the least any implementation moves: x read
and y written (the gated form: residual and branch read, h and y written), plus the modulation
vectors. Stock eager moves 3× (6 passes of [B, T, D] against 2) and 2.75× (11 against 4) that.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from bench.common import Case, rotating
from sd_kernels import reference
from sd_kernels.ops import gated_residual_layer_norm, layer_norm_modulated
from sd_kernels.testing import rel_err

DTYPE = torch.float16
EPS = 1e-6
# (model, [B, T, D], modulation form): "table" = [B, 1, D] chunks of [B, 6, D]; "emb" = [B, D] chunks of [B, 6·D]
SHAPES = [("pixart", (2, 4096, 1152), "table"), ("sd3", (2, 4096, 1536), "emb"), ("sd3_context", (2, 154, 1536), "emb")]
QUICK = ("pixart", "sd3")


def _per_sample(m: torch.Tensor) -> torch.Tensor:
    return m if m.dim() == 3 else m[:, None]


def stock_modulated(x, scale, shift):
    d = x.shape[-1]
    return F.layer_norm(x, (d,), None, None, EPS) * (1 + _per_sample(scale)) + _per_sample(shift)


def stock_gated(residual, branch, gate, scale, shift):
    h = residual + _per_sample(gate) * branch
    return h, stock_modulated(h, scale, shift)


def ours_modulated(x, scale, shift):
    return layer_norm_modulated(x, None, None, EPS, scale, shift)


def ours_gated(residual, branch, gate, scale, shift):
    return gated_residual_layer_norm(residual, branch, gate, None, None, EPS, scale, shift)


def _modulations(n: int, bsz: int, d: int, form: str, device: str) -> list[torch.Tensor]:
    """``n`` modulation vectors as the model slices them (values ≈ 0.1, like trained adaLN outputs)."""
    if form == "table":
        return list((0.1 * torch.randn(bsz, 6, d, device=device, dtype=DTYPE)).chunk(6, dim=1)[:n])
    return list((0.1 * torch.randn(bsz, 6 * d, device=device, dtype=DTYPE)).chunk(6, dim=1)[:n])


def make_inputs(shape: tuple[int, int, int], form: str, gated: bool, device: str = "cuda") -> tuple:
    """(x, scale, shift) or (residual, branch, gate, scale, shift): never zeros, residual off-center."""
    bsz, _, d = shape
    if gated:
        residual = torch.randn(shape, device=device, dtype=DTYPE) + 0.5
        gate, scale, shift = _modulations(3, bsz, d, form, device)
        return residual, torch.randn(shape, device=device, dtype=DTYPE), gate, scale, shift
    return (torch.randn(shape, device=device, dtype=DTYPE) + 0.5, *_modulations(2, bsz, d, form, device))


def traffic(shape: tuple[int, int, int], gated: bool, itemsize: int = 2) -> dict[str, int]:
    """Bytes moved per call: the fused kernel's (``ours``) and stock eager's separate ops'.

    Stock, per [B, T, D] pass (read or write): layer_norm 2, ·(1 + scale) 2, + shift 2; before it,
    gate · branch 2, + residual 3. The modulation vectors ([B, D] each, plus 1 + scale's temporary)
    are the same order for both and small; they are counted for ours only.
    """
    bsz, t, d = shape
    n = bsz * t * d * itemsize
    vectors = (3 if gated else 2) * bsz * d * itemsize
    return {"ours": (4 if gated else 2) * n + vectors, "stock": (11 if gated else 6) * n}


def _error(out, ref) -> float:
    if isinstance(out, tuple):  # (h, normed): the worse of the two
        return max(rel_err(o, r) for o, r in zip(out, ref))
    return rel_err(out, ref)


def _case(model: str, shape: tuple[int, int, int], form: str, gated: bool, impls: dict[str, Callable]) -> Case:
    make = lambda: make_inputs(shape, form, gated)
    inputs = make()
    upcast = reference.upcast(*inputs)
    if gated:
        ref = reference.gated_residual_layer_norm(upcast[0], upcast[1], upcast[2], None, None, EPS, *upcast[3:])
    else:
        ref = reference.layer_norm_modulated(upcast[0], None, None, EPS, *upcast[1:])
    errors = {name: _error(fn(*inputs), ref) for name, fn in impls.items()}  # also compiles before timing
    nbytes = traffic(shape, gated)
    del inputs, upcast, ref
    nxt = rotating(make, (3 if gated else 2) * math.prod(shape) * 2)
    timed = {name: (lambda fn=fn: fn(*nxt())) for name, fn in impls.items()}
    op = "gated_residual_layer_norm" if gated else "layer_norm_modulated"
    return Case(op, "x".join(map(str, shape)), DTYPE, model, timed, bytes=nbytes["ours"], errors=errors,
                extra={"stock_bytes": nbytes["stock"]})


def cases(quick: bool) -> Iterator[Case]:
    for model, shape, form in SHAPES:
        if quick and model not in QUICK:
            continue
        for gated, stock, ours in ((False, stock_modulated, ours_modulated), (True, stock_gated, ours_gated)):
            # Static shapes: one specialised graph per case, as a fixed-resolution pipeline would compile.
            impls = {"stock": stock, "compiled": torch.compile(stock, dynamic=False), "ours": ours}
            yield _case(model, shape, form, gated, impls)
