"""Several ``Fp8Linear``s' FP8 codes and scales laid out as one buffer each, read as one GEMM's operands.

``lay_out_codes`` concatenates the layers' codes (and their scales) in the layers' order and makes each layer's
own buffers views of the result (a layer's ``_source`` follows its new codes, so its weight's state still says
they are fresh): no byte more once laid out (the patch holds both for that moment). ``operands`` gives the one
GEMM's (codes, scales, bias) while the layout holds: each layer's codes fresh (``Fp8Linear.fresh``: a weight
changed since is quantized again into buffers of its own, which breaks the layout), every layer's codes,
scales and biases still consecutive blocks of one storage (``qkv_fusion.stacked``). Users: the q, k and v
projections of one stream (``patches.fp8.Fp8Projections``, their biases laid out by qkv_fusion) and a
transformer's block-norm modulations (patches/fp8_modulations.py).
"""

from __future__ import annotations

import torch
from torch import nn

from .qkv_fusion import stacked


def lay_out_codes(layers: tuple[nn.Module, ...]) -> None:
    """The layers' codes and scales as consecutive blocks of one buffer each, in the layers' order."""
    rows = [m.w_q.shape[0] for m in layers]
    codes, scales = torch.cat([m.w_q for m in layers]), torch.cat([m.s_w for m in layers])
    for m, w_q, s_w in zip(layers, codes.split(rows), scales.split(rows)):
        m.w_q, m.s_w = w_q, s_w
        m._source = m._source[0], w_q.data_ptr()


def operands(layers: tuple[nn.Module, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """(codes, scales, bias) of the layers as one GEMM while the layout holds (module docstring), else None."""
    for m in layers:
        m.fresh()
    codes, scales = stacked([m.w_q for m in layers]), stacked([m.s_w for m in layers])
    biases = [m.bias for m in layers]
    bias = None if all(b is None for b in biases) else stacked(biases)
    if codes is None or scales is None or (bias is None and any(b is not None for b in biases)):
        return None
    return codes, scales, bias
