"""One batched GEMM for the keys and values of the text, for every cross-attention of a UNet at once.

A UNet's cross-attentions (SD 1.x's 16, SDXL's 70) all read the same text, the ``encoder_hidden_states`` its
forward hands to every transformer block, and each projects it to keys and values: two GEMMs of a few hundred
rows each (SDXL with guidance: 154 rows of 2,048 to 640 or 1,280 columns). On an H200 those 140 small GEMMs take
0.9 ms of SDXL's 27 ms FP8 step, each a few µs with most of the GPU idle
(bench/results/2026-11-30-h200-fp8-gemm-into/unet_kernels-sdxl-fp8-before.json). Here the projections' weights
(and biases) are laid out in one buffer per output width, [n, width, D], k then v, attention after attention
(``qkv_fusion.lay_out``: the Parameters become views of it, the same objects and values, nothing held twice), and
the first cross-attention a forward calls projects the text for all of them: one batched GEMM per width (SDXL: two),
which writes each projection's output as a contiguous [B·T, width] block; each attention reads its two blocks.
One GEMM writing a [B·T, Σ width] product was tried first: the attention kernels reading its column slices, rows
129 kB (PixArt-Σ) to 333 kB (SDXL) apart, measured slower. PixArt-Σ's FP8 step took 25.74 ms with them, 25.55
before the product and 25.20 with these blocks, on an H200 (bench/results/2026-11-30-h200-unet-block-fusions/).
Each output is the same dot product as before, over the same inputs: only the GEMM's tiling, and so the order of
its fp32 sums, changes.

When the product serves (``TextProjections.keys_values``):

- the first member (in module order, the first cross-attention a model's forward calls: a down block's) makes it,
  from the context it is given, and only while its own projections are exactly ``nn.Linear``, unhooked, held by
  the module, outside autograd and compilation, every weight still laid out (``qkv_fusion.stacked``);
- another member reads its blocks where the product was made from the very tensor it is given (the same object,
  data pointer and version counter) and it has not read that product before; otherwise (its own projections
  changed, hooked or wrapped by a LoRA; another context) it projects as diffusers does;
- the product is dropped once every member has read it, and in any case at the first member's next call, which
  makes it again: one per forward, so a CUDA graph captures it with the rest of the call.

Laying the weights out copies one width's bank before the old storages are freed, and unpatch gives each Parameter
its storage back the same way: for a moment, a second copy of one bank (SDXL's 1,280-wide one: 0.7 GB in fp16).

Installed by the attention patcher on the cross-attentions it gives ``SDKernelsAttnProcessor`` (not diffusers'
fused one, whose ``to_kv`` serves; none whose ``norm_cross`` normalizes the text per attention), those whose
projections share one input width, dtype and device forming a group, in the lossless patch and the FP8 tier (where a
cross-attention's keys and values stay in the model's dtype: patches/fp8.py ``CROSS_KV_FP8``), not with
``compile=True`` or a memory budget (``qkv_fusion.wanted``). Unpatch gives each Parameter storage of its own again.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from sd_kernels.ops.weight_cache import weight_version

from . import qkv_fusion
from .record import PatchRecord

KIND = "text_kv"
NAMES = ("to_k", "to_v")


class _Product:
    """The text's projections by every member: made from ``context``, read once by each member."""

    def __init__(self, context: torch.Tensor, product: list[torch.Tensor], members: int) -> None:
        self.context, self.state = context, weight_version(context)  # its data pointer and version counter
        self.product = product
        self.unread = set(range(members))

    def made_from(self, context: torch.Tensor) -> bool:
        return context is self.context and weight_version(context) == self.state


class TextProjections:
    """The key and value projections of ``members`` (cross-attentions reading the same text), their weights laid out
    as one buffer per projection width; ``keys_values`` serves a member's call from one product a forward (module
    docstring)."""

    def __init__(self, members: list[nn.Module]) -> None:
        self.members = tuple(members)
        self.linears = tuple(getattr(attn, n) for attn in members for n in NAMES)
        self.has_bias = self.linears[0].bias is not None
        # a bank a width: its projections' weights one [n, width, D] buffer, so that a batched GEMM writes each
        # projection's keys or values as a contiguous [B·T, width] block (column slices of one [B·T, Σ] product,
        # rows far apart, cost the attention kernels more than the GEMMs they saved: the TLB)
        banks: dict[int, list[int]] = {}
        for j, m in enumerate(self.linears):
            banks.setdefault(m.out_features, []).append(j)
        self.banks = tuple(banks.values())
        self._slots = {j: (b, i) for b, bank in enumerate(self.banks) for i, j in enumerate(bank)}
        made = []
        for bank in self.banks:
            made.append(qkv_fusion.lay_out([self.linears[j].weight for j in bank]))
            if self.has_bias:
                made.append(qkv_fusion.lay_out([self.linears[j].bias for j in bank]))
        self.storages = qkv_fusion.WeakStorages(made)
        self._index = {id(attn): i for i, attn in enumerate(members)}
        self._product: _Product | None = None

    def _operands(self) -> list[tuple[torch.Tensor, torch.Tensor | None]] | None:
        """Each bank's (weight [n, width, D], bias [n, 1, width] or None) while every projection is exactly
        ``nn.Linear`` and still laid out (``qkv_fusion.laid_out``); else None."""
        out = []
        for bank in self.banks:
            operands = qkv_fusion.laid_out(tuple(self.linears[j] for j in bank), self.has_bias)
            if operands is None:
                return None
            (weight, bias), n, width = operands, len(bank), self.linears[bank[0]].out_features
            out.append((weight.view(n, width, -1), None if bias is None else bias.view(n, 1, width)))
        return out

    @staticmethod
    def _project(context: torch.Tensor, operands: list) -> list[torch.Tensor]:
        """Each bank's projections of ``context`` [..., D] as [n, rows, width]: one batched GEMM a bank."""
        x = context.reshape(1, -1, context.shape[-1])
        return [torch.matmul(x, w.transpose(1, 2)) if b is None else torch.baddbmm(b, x.expand(w.shape[0], -1, -1),
                                                                                   w.transpose(1, 2))
                for w, b in operands]

    def keys_values(self, attn: nn.Module, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(attn.to_k(context), attn.to_v(context))`` from the product where it serves (module docstring), else
        None: the caller projects as diffusers does."""
        i = self._index.get(id(attn))
        if i is None or torch.compiler.is_compiling():
            return None
        if i == 0:  # a forward begins: nothing of the last one's product is read again, served or not
            self._product = None
        own = self.linears[2 * i:2 * i + 2]
        if not qkv_fusion.held(attn, NAMES, own) or any(type(m) is not nn.Linear for m in own):
            return None
        product = self._product
        if product is None or i not in product.unread or not product.made_from(context):
            self._product = None
            operands = self._operands() if i == 0 else None
            if operands is None or context.dtype != operands[0][0].dtype:
                return None
            product = self._product = _Product(context, self._project(context, operands), len(self.members))
        product.unread.discard(i)
        if not product.unread:
            self._product = None
        shape = (*context.shape[:-1], -1)
        return tuple(product.product[b][k].view(shape) for b, k in (self._slots[2 * i], self._slots[2 * i + 1]))

    def release(self) -> None:
        """Each Parameter back in storage of its own (``qkv_fusion.release``); no product kept."""
        self._product = None
        qkv_fusion.release(self.linears, self.storages)


def _member(attn: nn.Module, processor) -> bool:
    """Whether ``attn`` (given ``processor``, ours) projects a text its group shares: a cross-attention whose keys
    and values come from two Linears of the text as it is."""
    return attn.is_cross_attention and not processor.fused and not attn.norm_cross


def install(candidates: list[tuple[str, nn.Module, object]], record: PatchRecord) -> None:
    """A ``TextProjections`` for each group of ``candidates`` ((path, attention, our processor), in module order)
    that are members (``_member``) with projections of one width, dtype and device (at least two of them); each
    member's processor gets it as ``text_kv``; recorded for unpatch."""
    if qkv_fusion.wanted(record) is not None:
        return
    groups: dict[tuple, list[tuple[nn.Module, object]]] = {}
    for path, attn, processor in candidates:
        if not _member(attn, processor):
            continue
        linears = [attn._modules.get(n) for n in NAMES]
        why = qkv_fusion.unfit(linears, whole_shape=False)
        if why is not None:
            record.skip(f"{path}.to_k", type(linears[0]).__name__, f"the text's keys and values not joined: {why}")
            continue
        w = linears[0].weight
        key = (w.shape[1], w.dtype, w.device, linears[0].bias is None, w.is_inference())
        groups.setdefault(key, []).append((attn, processor))
    for members in groups.values():
        if len(members) < 2:
            continue
        joined = TextProjections([attn for attn, _ in members])
        for _, processor in members:
            processor.text_kv = joined
        record.on_undo(joined.release, KIND, len(members))
