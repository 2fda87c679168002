"""One GEMM for a FLUX attention's q, k and v projections, with no second copy of their weights.

diffusers' ``fuse_qkv_projections()`` (the recipe torch.compile's FLUX numbers use) builds a ``to_qkv``
Linear from a concatenated copy of ``to_q``, ``to_k`` and ``to_v``: one [tokens, 3·inner] GEMM per
stream instead of three, at the cost of a second copy of those weights (4.3 GB in FLUX.1-dev). Here the
three weights (and biases) are laid out once, in q, k, v order, in one buffer, and the three
Parameters become views of it (``param.data``: the same Parameter objects, their state_dict keys and
values unchanged): the fused GEMM reads the buffer, the modules read their rows, and nothing is held
twice. ``SDKernelsFluxAttnProcessor`` (patches/flux_attention.py) calls ``FusedProjections`` where
diffusers' processor calls the three Linears, and only while ``intact``: the attention module still
holds those very Linears, exactly ``nn.Linear`` without hooks, whose weights and biases are still the
buffer's rows. Anything that changes that while patched (a LoRA wrapping a projection, a Parameter or
``weight.data`` assigned anew, ``.to()`` moving the weights, a memory budget swapping them) sends the
call back to the three separate projections; an in-place update through the views (``weight.data.add_``,
``copy_``) is an update of the buffer, which the fused GEMM reads.

Installed by the attention patcher on every FluxAttention it gives our processor, for the image stream
(``to_q``/``to_k``/``to_v``) and the double-stream blocks' text stream (``add_q_proj``/...), in the
lossless patch without a memory budget and without ``compile=True``; a call torch.compile traces takes
diffusers' projections (the guard reads data pointers, which the compiler does not trace); not where
``fuse_qkv_projections()`` already fused the module (diffusers' ``to_qkv`` then serves). Unpatch lays
each Parameter still a view of the buffer back into storage of its own (the same values, bit for bit)
and drops the buffer, block by block.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .record import PatchRecord

KIND = "qkv_fusion"
STREAMS = (("qkv", ("to_q", "to_k", "to_v")), ("added_qkv", ("add_q_proj", "add_k_proj", "add_v_proj")))


def _unfit(linears: list) -> str | None:
    """Why these Linears cannot share one buffer, or None."""
    if any(type(m) is not nn.Linear for m in linears):
        return "not exactly nn.Linear (a LoRA layer, a quantized one, ...)"
    if any(m._forward_hooks or m._forward_pre_hooks or hasattr(m, "_hf_hook") for m in linears):
        return "hooks on a projection (the fused GEMM would skip them)"
    first = linears[0].weight
    if first.device.type == "meta" or any(m.weight.shape != first.shape or m.weight.dtype != first.dtype
                                          or m.weight.device != first.device for m in linears):
        return "projections of different shapes, dtypes or devices"
    if len({m.bias is None for m in linears}) != 1:
        return "a bias on some projections only"
    return None


class FusedProjections:
    """Three Linears whose weights (and biases) are rows of one buffer; called, one GEMM for all three."""

    def __init__(self, linears: list[nn.Linear]) -> None:
        self.linears = tuple(linears)
        rows = linears[0].out_features
        with torch.no_grad():
            self.weight = torch.cat([m.weight.detach() for m in linears])
            self.bias = None if linears[0].bias is None else torch.cat([m.bias.detach() for m in linears])
            for i, m in enumerate(linears):
                m.weight.data = self.weight[i * rows:(i + 1) * rows]
                if self.bias is not None:
                    m.bias.data = self.bias[i * rows:(i + 1) * rows]
        self.views = self._pointers()

    def _pointers(self) -> tuple:
        return tuple((m.weight.data_ptr(), None if m.bias is None else m.bias.data_ptr()) for m in self.linears)

    def intact(self, module: nn.Module, names: tuple[str, ...]) -> bool:
        """Whether ``module`` still holds these Linears, unhooked, their weights still this buffer's rows."""
        if self.weight is None:
            return False
        for linear, name in zip(self.linears, names):
            if module._modules.get(name) is not linear or linear._forward_hooks or linear._forward_pre_hooks:
                return False
        return self._pointers() == self.views

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return F.linear(x, self.weight, self.bias).chunk(3, dim=-1)

    def release(self) -> None:
        """Each Parameter still a view of the buffer gets storage of its own (the same values); the
        buffer is dropped."""
        with torch.no_grad():
            for m, (w, b) in zip(self.linears, self.views):
                if m.weight.data_ptr() == w:
                    m.weight.data = m.weight.data.clone()
                if b is not None and m.bias is not None and m.bias.data_ptr() == b:
                    m.bias.data = m.bias.data.clone()
        self.weight = self.bias = None


def wanted(record: PatchRecord) -> str | None:
    """Why this patch fuses no projections, or None."""
    if record.precision is not None:
        return f"precision={record.precision!r} quantizes the projections themselves"
    if record.compile:
        return "compile=True (the fused call's guard reads data pointers)"
    if record.memory_plan is not None:
        return "a memory budget moves weights"
    return None


def install(attn: nn.Module, processor, path: str, record: PatchRecord) -> None:
    """Fuse ``attn``'s projections for ``processor`` (``processor.qkv``, ``processor.added_qkv``), each
    stream whose Linears fit; recorded for unpatch."""
    if wanted(record) is not None or getattr(attn, "fused_projections", False):
        return
    for attr, names in STREAMS:
        linears = [attn._modules.get(n) for n in names]
        if all(m is None for m in linears):
            continue
        why = "missing" if any(m is None for m in linears) else _unfit(linears)
        if why is not None:
            record.skip(f"{path}.{names[0]}", type(linears[0]).__name__, f"q, k, v not fused: {why}")
            continue
        fused = FusedProjections(linears)
        setattr(processor, attr, fused)
        record.on_undo(fused.release, KIND)


def projections(processor, attn: nn.Module, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None):
    """diffusers' ``_get_qkv_projections(attn, hidden_states, encoder_hidden_states)``, each stream through
    its ``FusedProjections`` where it is intact."""
    from diffusers.models.transformers.transformer_flux import _get_qkv_projections

    qkv, added = processor.qkv, processor.added_qkv
    if (qkv is None or attn.fused_projections or torch.compiler.is_compiling()  # a traced guard: diffusers' lines
            or not qkv.intact(attn, STREAMS[0][1])):
        return _get_qkv_projections(attn, hidden_states, encoder_hidden_states)
    query, key, value = qkv(hidden_states)
    encoder_query = encoder_key = encoder_value = None
    if encoder_hidden_states is not None and attn.added_kv_proj_dim is not None:
        if added is not None and added.intact(attn, STREAMS[1][1]):
            encoder_query, encoder_key, encoder_value = added(encoder_hidden_states)
        else:
            encoder_query, encoder_key, encoder_value = (getattr(attn, n)(encoder_hidden_states) for n in STREAMS[1][1])
    return query, key, value, encoder_query, encoder_key, encoder_value
