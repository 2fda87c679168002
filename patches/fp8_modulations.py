"""The FP8 tier's adaLN modulations of one transformer as one GEMM a call.

Every block norm of a DiT turns the same step embedding into its shifts, scales and gates,
``linear(silu(temb))``: FLUX.1-dev has 76 (two in each of its 19 double blocks, 3,072 → 18,432 columns; one in
each of its 38 single blocks, 3,072 → 9,216), SD3-medium 47 (1,536 → 9,216; its last block's context norm is of
another kind). A sample is one row, so each is a matrix-vector product that reads its FP8 codes once (56.6 or
28.3 MB at FLUX's) with too few columns to keep the GPU's memory busy: FLUX's are 144 or 72 programs of 128
columns on an H200's 132 SMs. Here the block norms' codes and scales are laid out in one buffer each, in the
order of the model's modules (each layer's own buffers become views of it: no byte more once laid out;
patches/fp8_layout.py), and the first block
norm of a call computes every product in one GEMM, 1,050,624 columns for FLUX (3.2 GB of codes); each block
norm takes its columns of the result.

The result is kept with the step embedding it came from (that tensor and its version counter), so each block
norm of one call finds it and the next call computes anew; a norm that finds it also checks that its layer's
weight and bias are unchanged since, that no hook was added since and that the result was not changed in
place (else the GEMM runs again, or the norm computes its own); a result made while a CUDA graph captured serves
only that capture, one made eagerly no capture. A call takes the joined GEMM only outside autograd
and torch.compile and outside inference mode, with the embedding not an inference tensor (no version counter to
know it by), while the
norm holds the layer it had and its ``silu`` is torch's plain ``nn.SiLU`` (not in place, not hooked), no
layer is hooked, and every layer's codes are still laid out (a weight changed while patched is quantized again
into buffers of its own, and a ``.to()`` moves each layer's buffers apart: then every block norm computes its
own product again, as without this). The biases, Parameters of the model, are laid out the same way, as
patches/qkv_fusion.py lays out q, k and v (each ``bias.data`` a view of one buffer: the same Parameters and
values; an update in place is the buffer's, which the GEMM reads); unpatch gives each storage of its own again
(``release``; a bias made under inference mode comes back a normal tensor, as q, k and v do), and a bias
assigned anew breaks the layout (each norm then computes its own product).
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from sd_kernels.ops.custom_ops import fp8_linear
from sd_kernels.ops.fp8_rows import RowTable
from sd_kernels.ops.weight_cache import weight_version

from . import fp8_layout, modulation_split, modulation_table, qkv_fusion
from .hooks import called_beside
from .modes import outside_inference_mode
from .qkv_fusion import lay_out, plain


class Fp8Modulations:
    """The modulation layers (``Fp8Linear``s of one input width) of ``norms`` as one GEMM a call."""

    def __init__(self, norms: list[nn.Module]) -> None:
        self.layers = tuple(n.linear for n in norms)
        self.index = {id(n): i for i, n in enumerate(norms)}
        self.starts = list(itertools.accumulate([0, *(layer.out_features for layer in self.layers[:-1])]))
        fp8_layout.lay_out_codes(self.layers)
        biases = lay_out([layer.bias for layer in self.layers]) if self.layers[0].bias is not None else None
        self.storages = qkv_fusion.WeakStorages((biases,))
        # (emb, its version, the result or None, the result's version, each layer's state, _where) of the last call
        self._last: tuple | None = None
        self.computed = 0  # joined GEMMs run (calls that took this path)
        self.silu_of = norms[0]  # whose SiLU a table's fill applies (patches/modulation_table.py)
        self.table: RowTable | None = None  # every step's products, made at a call's first step
        self.table_states: list | None = None  # each layer's state when the table was filled (None: empty)

    def product(self, norm: nn.Module, emb: torch.Tensor) -> torch.Tensor | None:
        """``norm.linear(norm.silu(emb))``: its columns of this call's joined GEMM, or None where the call does not
        take it (module docstring; the norm then computes its own)."""
        if (torch.compiler.is_compiling() or torch.is_grad_enabled() or torch.is_inference_mode_enabled()
                or emb.is_inference()):
            return None
        i = self.index.get(id(norm))
        act = norm.silu
        if (i is None or norm.linear is not self.layers[i] or type(act) is not nn.SiLU or act.inplace
                or called_beside(act)):
            return None
        layer, where = self.layers[i], _where(emb)
        last = self._last
        if (last is None or last[0] is not emb or last[1] != emb._version or last[5] != where
                or (last[2] is not None and (last[2]._version != last[3] or _state(layer) != last[4][i]))):
            last = self._compute(emb, norm, where)
            self._last = last  # one assignment: a call on another thread reads this tuple or the one before
        if last[2] is None or called_beside(layer):
            return None
        return last[2][:, self.starts[i]:self.starts[i] + layer.out_features]

    def _compute(self, emb: torch.Tensor, norm: nn.Module, where: tuple | None) -> tuple:
        """The cache entry of a call: the joined GEMM of ``silu(emb)``, or None where a layer is hooked or the
        layout broke; each layer's state before it ran (``_state``); where it ran (``_where``)."""
        states = [_state(layer) for layer in self.layers]
        operands = None if any(map(called_beside, self.layers)) else fp8_layout.operands(self.layers)
        result = None
        if operands is not None:
            self.computed += 1
            # a graph captured now serves from the table (empty until a fill: its rows are marked on the device)
            table = self.table if self.table_states in (None, states) else None
            result = fp8_linear(modulation_split.silu(norm, emb), *operands, table=table)
        version = None if result is None else result._version
        return emb, emb._version, result, version, states, where

    def fill(self, emb: torch.Tensor) -> None:
        """Keep the products of ``emb``'s rows (step embeddings: patches/modulation_table.py) in the table: one
        GEMM, the same this class runs a call; nothing where a call could not take the joined GEMM either."""
        act = self.silu_of.silu
        if type(act) is not nn.SiLU or act.inplace or called_beside(act) or any(map(called_beside, self.layers)):
            return
        operands = fp8_layout.operands(self.layers)  # each layer's codes made again first where stale
        if operands is None:
            return
        states = [_state(layer) for layer in self.layers]
        x = modulation_split.silu(self.silu_of, emb)
        table = self.ensure_table()
        if not table.fits(x[:1]) or x.shape[0] > table.keys.shape[0]:
            return
        if self.table_states != states:
            table.clear()
        table.store(x, fp8_linear(x, *operands))
        self.table_states = states

    def ensure_table(self) -> RowTable:
        """The table, made empty the first time (before a call that a CUDA graph may capture: the graph reads it
        where it is), in the layers' dtype on their device."""
        if self.table is None:  # outside inference mode: a call outside it, after one inside, fills it in place
            with outside_inference_mode():
                self.table = RowTable(modulation_table.ROWS, *self.table_shape(), self.layers[0].w_q.device)
        return self.table

    def table_shape(self) -> tuple[int, int, torch.dtype]:
        """The table's row widths (the layers' input, all their outputs) and dtype (the layers' weights')."""
        first = self.layers[0]
        return first.in_features, self.starts[-1] + self.layers[-1].out_features, first.weight.dtype

    def check_table(self) -> None:
        """Forget the table's rows if a layer changed since they were made (before a call reads them)."""
        if self.table_states is not None and self.table_states != [_state(layer) for layer in self.layers]:
            self.table.clear()
            self.table_states = None

    def drop_table(self) -> None:
        self.table, self.table_states = None, None

    def release(self) -> None:
        """The biases back in storage of their own, as before the patch (``qkv_fusion.release``)."""
        qkv_fusion.release(self.layers, self.storages)


def _where(emb: torch.Tensor) -> tuple | None:
    """Whether the call is being captured into a CUDA graph, and on which stream: a result made in a capture has not
    run yet (an eager call must not read it), and one made eagerly lies outside the graph's memory (a capture must
    not bake it in)."""
    if not emb.is_cuda:
        return None
    return torch.cuda.is_current_stream_capturing(), torch.cuda.current_stream(emb.device).cuda_stream


def _state(layer: nn.Module) -> tuple:
    """What a layer's product depends on besides the input: its weight's state (``graph_state``) and its bias's
    identity, storage and version."""
    bias = layer.bias
    return layer.graph_state(), None if bias is None else (id(bias), *weight_version(bias))


def groups(norms: list[nn.Module]) -> list[list[nn.Module]]:
    """``norms`` (the FP8 tier's block norms of one model, in its order) in groups that one GEMM can serve: the
    same input width, device and dtypes, each of at least two norms; a norm whose bias is no plain tensor (a
    subclass, the meta device) in none."""
    found: dict[tuple, list[nn.Module]] = {}
    for norm in norms:
        layer = norm.linear
        if layer.bias is not None and not plain(layer.bias):
            continue
        bias = None if layer.bias is None else (layer.bias.dtype, layer.bias.device)
        found.setdefault((layer.in_features, layer.w_q.device, layer.w_q.dtype, bias), []).append(norm)
    return [group for group in found.values() if len(group) > 1]
