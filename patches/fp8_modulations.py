"""The FP8 tier's adaLN modulations of one transformer as one GEMM a call.

Every block norm of a DiT turns the same step embedding into its shifts, scales and gates,
``linear(silu(temb))``: FLUX.1-dev has 76 (two in each of its 19 double blocks, 3,072 → 18,432 columns; one in
each of its 38 single blocks, 3,072 → 9,216), SD3-medium 47 (1,536 → 9,216; its last block's context norm is of
another kind). A sample is one row, so each is a matrix-vector product that reads its FP8 codes once (56.6 or
28.3 MB at FLUX's) with too few columns to keep the GPU's memory busy: FLUX's are 144 or 72 programs of 128
columns on an H200's 132 SMs. Here the block norms' codes and scales are laid out in one buffer each, in the
order of the model's modules (each layer's own buffers become views of it: no byte added), and the first block
norm of a call computes every product in one GEMM, 1,050,624 columns for FLUX (3.2 GB of codes); each block
norm takes its columns of the result.

The result is kept with the step embedding it came from (that tensor and its version counter), so each block
norm of one call finds it and the next call computes anew. A call takes the joined GEMM only outside autograd
and torch.compile, with the embedding not an inference tensor (no version counter to know it by), while the
norm holds the layer it had and its ``silu`` is torch's plain ``nn.SiLU`` (not in place, not hooked), no
layer is hooked, and every layer's codes are still laid out (a weight changed while patched is quantized again
into buffers of its own, and a ``.to()`` moves each layer's buffers apart: then every block norm computes its
own product again, as without this). The biases, Parameters of the model, are laid out the same way, as
patches/qkv_fusion.py lays out q, k and v (each ``bias.data`` a view of one buffer: the same Parameters and
values; an update in place is the buffer's, which the GEMM reads); unpatch gives each storage of its own again
(``release``), and a bias assigned anew breaks the layout (each norm then computes its own product).
"""

from __future__ import annotations

import itertools

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from sd_kernels.ops.custom_ops import fp8_linear

from . import modulation_split, qkv_fusion
from .hooks import called_beside, hooked
from .qkv_fusion import lay_out, plain, stacked


class Fp8Modulations:
    """The modulation layers (``Fp8Linear``s of one input width) of ``norms`` as one GEMM a call."""

    def __init__(self, norms: list[nn.Module]) -> None:
        self.layers = tuple(n.linear for n in norms)
        self.index = {id(n): i for i, n in enumerate(norms)}
        widths = [layer.out_features for layer in self.layers]
        self.starts = list(itertools.accumulate([0, *widths[:-1]]))
        codes = torch.cat([layer.w_q for layer in self.layers])
        scales = torch.cat([layer.s_w for layer in self.layers])
        for layer, start, width in zip(self.layers, self.starts, widths):
            layer.w_q, layer.s_w = codes[start:start + width], scales[start:start + width]
            layer._source = layer._source[0], layer.w_q.data_ptr()
        self.has_bias = self.layers[0].bias is not None
        biases = lay_out([layer.bias for layer in self.layers]) if self.has_bias else None
        self.storages = [] if biases is None else [StorageWeakRef(biases.untyped_storage())]
        self._source: tuple | None = None  # (the step embedding, its version) the result is of
        self._result: torch.Tensor | None = None
        self.computed = 0  # joined GEMMs run (calls that took this path)

    def product(self, norm: nn.Module, emb: torch.Tensor) -> torch.Tensor | None:
        """``norm.linear(norm.silu(emb))``: its columns of this call's joined GEMM, or None where the call does not
        take it (module docstring; the norm then computes its own)."""
        i = self.index.get(id(norm))
        act = norm.silu
        if (i is None or norm.linear is not self.layers[i] or torch.is_grad_enabled()
                or torch.compiler.is_compiling() or emb.is_inference()
                or type(act) is not nn.SiLU or act.inplace or called_beside(act)):
            return None
        if self._source is None or self._source[0] is not emb or self._source[1] != emb._version:
            self._result = self._compute(modulation_split.silu(norm, emb))
            self._source = (emb, emb._version)
        if self._result is None:
            return None
        return self._result[:, self.starts[i]:self.starts[i] + self.layers[i].out_features]

    def _compute(self, x: torch.Tensor) -> torch.Tensor | None:
        if any(map(hooked, self.layers)):
            return None
        for layer in self.layers:
            layer.fresh()
        codes, scales = stacked([m.w_q for m in self.layers]), stacked([m.s_w for m in self.layers])
        bias = stacked([m.bias for m in self.layers]) if self.has_bias else None
        if codes is None or scales is None or (bias is None) is self.has_bias:
            return None
        self.computed += 1
        return fp8_linear(x, codes, scales, bias)

    def release(self) -> None:
        """The biases back in storage of their own, as before the patch (``qkv_fusion.release``)."""
        qkv_fusion.release(self.layers, self.storages)


def join(norms: list[nn.Module]) -> list[Fp8Modulations]:
    """One ``Fp8Modulations`` per group of ``norms`` (the FP8 tier's block norms of one model) whose layers share
    the input width, device and dtypes, each of at least two norms."""
    groups: dict[tuple, list[nn.Module]] = {}
    for norm in norms:
        layer = norm.linear
        if layer.bias is not None and not plain(layer.bias):
            continue  # a bias that is no plain tensor (a subclass, the meta device) is not laid out
        bias = None if layer.bias is None else (layer.bias.dtype, layer.bias.device)
        key = (layer.in_features, layer.w_q.device, layer.w_q.dtype, bias)
        groups.setdefault(key, []).append(norm)
    return [Fp8Modulations(group) for group in groups.values() if len(group) > 1]
