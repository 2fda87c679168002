"""One GEMM for an attention's q, k and v projections (FLUX's, SD3's), with no second copy of their weights.

diffusers' ``fuse_qkv_projections()`` (the recipe torch.compile's FLUX numbers use) builds a ``to_qkv``
Linear from a concatenated copy of ``to_q``, ``to_k`` and ``to_v``: one [tokens, 3·inner] GEMM per
stream instead of three, at the cost of a second copy of those weights (4.3 GB in FLUX.1-dev). Here the
three weights (and biases) are laid out once, in q, k, v order, in one buffer, and the three
Parameters become views of it (``param.data``: the same Parameter objects, their state_dict keys and
values unchanged): the fused GEMM reads the buffer, the modules read their rows, and nothing is held
twice. ``SDKernelsFluxAttnProcessor`` (patches/flux_attention.py) calls ``FusedProjections`` where
diffusers' processor calls the three Linears, and only while the layout holds: the attention module still
holds those very Linears, exactly ``nn.Linear`` without hooks, whose weights and biases are still the
buffer's rows. Anything that changes that while patched (a LoRA wrapping a projection, a Parameter or
``weight.data`` assigned anew, ``.to()`` moving the weights, a memory budget swapping them) sends the
call back to the three separate projections; an in-place update through the views (``weight.data.add_``,
``copy_``) is an update of the buffer, which the fused GEMM reads. Nothing but the Parameters holds the
buffer (the fused operands are views made at each call), so weights moved or offloaded free it; and a
call that wants gradients for them takes the separate projections (autograd would not reach the
Parameters through those views): fusion serves calls under ``torch.no_grad`` or inference mode, as
diffusers' pipelines make them.

Under ``precision="fp8"`` the three Linears become FP8 GEMMs after this layout (patches/fp8.py): that patch
lays their codes and scales out the same way and sets ``FusedProjections.quantized``, which serves the
call as one FP8 GEMM (the biases read from this layout) while those layers hold. The GEMM then reads
codes made from the weights, so an update in place through ``weight.data`` is not seen, as for every FP8
layer (docs/fp8.md); one through the Parameter itself is (its codes are made again, its stream goes back
to three GEMMs).

Installed by the attention patcher on every FluxAttention it gives our processor, for the image stream
(``to_q``/``to_k``/``to_v``) and the double-stream blocks' text stream (``add_q_proj``/...), and likewise on
every SD3 joint attention given ``SDKernelsJointAttnProcessor`` (whose one GEMM a stream writes q, k and v side
by side into the streams' join: patches/joint_attention.py ``_projected_in_place``), and on every
self-attention given ``SDKernelsAttnProcessor`` (the UNets', PixArt-Σ's, the VAE's: ``to_q``/``to_k``/``to_v``
of the hidden states; a cross-attention's read two inputs), in the lossless patch and the FP8 tier,
without a memory budget and without ``compile=True``; a call torch.compile traces takes diffusers'
projections (the guard reads data pointers, which the compiler does not trace); not where
``fuse_qkv_projections()`` already fused the module (diffusers' ``to_qkv`` then serves). Unpatch lays
each Parameter still a view of the buffer back into storage of its own (the same values, bit for bit)
and drops the buffer, block by block.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef

from .hooks import hooked
from .record import PatchRecord, refuse_deepcopy, refuse_pickle

KIND = "qkv_fusion"
STREAMS = (("qkv", ("to_q", "to_k", "to_v")), ("added_qkv", ("add_q_proj", "add_k_proj", "add_v_proj")))


def plain(t: torch.Tensor | None) -> bool:
    """Whether a Parameter's data is a plain tensor with storage (not a tensor subclass, e.g. a quantized
    weight, nor on the meta device)."""
    return t is not None and type(t.data) is torch.Tensor and t.device.type != "meta"


def plain_parameters(linear: nn.Module) -> bool:
    """Whether a Linear's weight, and its bias if it has one, are ``plain``."""
    return plain(linear.weight) and (linear.bias is None or plain(linear.bias))


def unfit(linears: list, whole_shape: bool = True) -> str | None:
    """Why these Linears (None where a module lacks one) cannot share one buffer, or None; ``whole_shape`` False:
    their widths (in_features) must agree, not their output sizes (patches/text_projections.py)."""
    if any(m is None for m in linears):
        return "missing"
    if any(type(m) is not nn.Linear for m in linears):
        return "not exactly nn.Linear (a LoRA layer, a quantized one, ...)"
    if any(map(hooked, linears)):
        return "hooks on a projection (the fused GEMM would skip them)"
    first = linears[0].weight
    if not all(map(plain_parameters, linears)):
        return "weights that are not plain tensors with storage (a tensor subclass, the meta device)"
    shape = (lambda w: w.shape) if whole_shape else (lambda w: w.shape[1:])
    if any(shape(m.weight) != shape(first) or m.weight.dtype != first.dtype or m.weight.device != first.device
           for m in linears):
        return "projections of different shapes, dtypes or devices"
    if len({m.bias is None for m in linears}) != 1:
        return "a bias on some projections only"
    if len({t.is_inference() for m in linears for t in (m.weight, m.bias) if t is not None}) != 1:
        return "weights made in and out of torch.inference_mode"
    return None


def lay_out(params: list[torch.Tensor]) -> torch.Tensor:
    """The Parameters' data laid out as consecutive rows of one new buffer, in their order: each ``param.data``
    becomes a view of it (the same Parameter objects, the same values). Returns the buffer. Made in inference mode
    exactly where the Parameters are inference tensors (a model built under ``torch.inference_mode``), whatever
    the caller's mode: normal Parameters stay normal tensors, and inference ones keep data without a version
    counter (a normal tensor's data under an inference Parameter reads as one that has a version counter, and
    reading it fails)."""
    with torch.inference_mode(params[0].is_inference()), torch.no_grad():
        buffer = torch.cat([p.detach() for p in params])
        for p, rows in zip(params, buffer.split([p.shape[0] for p in params])):
            p.data = rows
    return buffer


class WeakStorages(tuple):
    """Weak references to the storages a layout made (``StorageWeakRef``s), to find them at unpatch. A deep copy or
    a pickle of them is refused as the patch record's is: a copied ``StorageWeakRef`` frees its weak reference a
    second time when both are collected, which crashes the process."""

    def __new__(cls, tensors) -> WeakStorages:
        return super().__new__(cls, (StorageWeakRef(t.untyped_storage()) for t in tensors if t is not None))

    __deepcopy__ = refuse_deepcopy
    __reduce_ex__ = refuse_pickle


def release(modules, storages: WeakStorages) -> None:
    """Undo ``lay_out``: each Parameter of ``modules`` (theirs, and any a parametrization added) still in one of
    ``storages`` gets storage of its own (the same values), whatever became of the others (one assigned anew
    leaves the rest in it)."""
    live = [ref for ref in storages if not ref.expired()]
    with torch.no_grad():
        for m in modules:
            for t in m.parameters():
                if plain(t) and StorageWeakRef(t.untyped_storage()) in live:
                    with torch.inference_mode(t.is_inference()):  # as ``lay_out`` made it
                        t.data = t.data.clone()


def stacked(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The tensors as one, where they are plain, consecutive contiguous blocks of one storage with the same
    dtype and trailing shape (as ``FusedProjections`` laid out q, k and v; the FP8 tier's modulation codes,
    patches/fp8_modulations.py): a view made now, no reference kept; None otherwise."""
    if not tensors or not all(map(plain, tensors)):
        return None
    first = tensors[0]
    storage, start = first.untyped_storage(), first.storage_offset()
    offset = start
    for t in tensors:
        if (t.shape[1:] != first.shape[1:] or t.dtype != first.dtype or not t.is_contiguous()
                or t.storage_offset() != offset or t.untyped_storage().data_ptr() != storage.data_ptr()):
            return None
        offset += t.numel()
    shape = (sum(t.shape[0] for t in tensors), *first.shape[1:])
    strides = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))  # contiguous (is_contiguous skips size-1 dims)
    return first.new_empty(0).set_(storage, start, shape, strides)


def held(module: nn.Module, names: tuple[str, ...], layers: tuple[nn.Module, ...]) -> bool:
    """Whether a call may take a fused GEMM for ``layers``: ``module`` still holds them under ``names``, none
    hooked (the fused GEMM would skip the hooks), and autograd is off (the fused operands are views it would
    not trace to the Parameters, nor run a projection's backward hooks for)."""
    return not torch.is_grad_enabled() and all(module._modules.get(n) is m and not hooked(m)
                                               for m, n in zip(layers, names))


def laid_out(linears: tuple[nn.Module, ...], has_bias: bool) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight, bias or None) of ``linears`` as one GEMM's operands, views of the storage ``lay_out`` gave them, while
    each is exactly ``nn.Linear``, has a bias exactly where they were laid out with one (``has_bias``) and its weight
    and bias are still consecutive rows of one storage (``stacked``); None otherwise."""
    if any(type(m) is not nn.Linear or (m.bias is None) == has_bias for m in linears):
        return None
    weight = stacked([m.weight for m in linears])
    bias = stacked([m.bias for m in linears]) if has_bias else None
    return None if weight is None or (has_bias and bias is None) else (weight, bias)


class FusedProjections:
    """Three Linears whose weights (and biases) are consecutive rows of one storage; called, one GEMM on
    it for all three. Only their Parameters hold that storage: weights moved, offloaded or dropped take
    it with them (nothing here keeps a copy alive; ``storages`` are weak references, to find it at unpatch).
    Made and released in inference mode only for inference-tensor Parameters (``lay_out``), whatever the caller's
    mode."""

    def __init__(self, linears: list[nn.Linear]) -> None:
        self.linears = tuple(linears)
        weight = lay_out([m.weight for m in linears])
        bias = None if linears[0].bias is None else lay_out([m.bias for m in linears])
        self.has_bias = bias is not None
        # (module, names, x) -> the three projections of x as one tensor, or None where it cannot serve: set
        # by the FP8 tier (patches/fp8.py) once the Linears are FP8 GEMMs; None: ``operands`` and F.linear
        self.quantized = None
        self.storages = WeakStorages((weight, bias))

    def operands(self, module: nn.Module, names: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """(weight, bias) of the fused GEMM while ``module`` still holds these Linears, exactly ``nn.Linear``,
        unhooked, their weights (and biases) still laid out as one, outside autograd (the fused operands are
        views it would not trace to the Parameters, nor run a projection's backward hooks for); None
        otherwise."""
        return laid_out(self.linears, self.has_bias) if held(module, names, self.linears) else None

    def project(self, module: nn.Module, names: tuple[str, ...], x: torch.Tensor) -> torch.Tensor | None:
        """The three projections of ``x`` as one [..., 3·out] tensor while the layout holds, else None."""
        if self.quantized is not None:
            return self.quantized(module, names, x)
        fused = self.operands(module, names)
        return None if fused is None else F.linear(x, *fused)

    def release(self) -> None:
        """Each Parameter of the Linears back in storage of its own (``release``)."""
        release(self.linears, self.storages)


def wanted(record: PatchRecord) -> str | None:
    """Why this patch fuses no projections, or None."""
    if record.compile:
        return "compile=True (the fused call's guard reads data pointers)"
    if record.memory_plan is not None:
        return "a memory budget moves weights"
    return None


def install(attn: nn.Module, processor, path: str, record: PatchRecord) -> None:
    """Fuse ``attn``'s projections for ``processor`` (``processor.qkv``, ``processor.added_qkv``), each
    stream whose Linears fit; recorded for unpatch. The caller leaves out processors that call diffusers' own
    fused projections (patches/attention.py)."""
    if wanted(record) is not None:
        return
    for attr, names in STREAMS:
        linears = [attn._modules.get(n) for n in names]
        if all(m is None for m in linears):
            continue
        why = unfit(linears)
        if why is not None:
            record.skip(f"{path}.{names[0]}", type(linears[0]).__name__, f"q, k, v not fused: {why}")
            continue
        fused = FusedProjections(linears)
        setattr(processor, attr, fused)
        record.on_undo(fused.release, KIND)


def stream(fused: FusedProjections | None, attn: nn.Module, index: int, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The q, k, v projections of ``x`` by stream ``index`` (of STREAMS): one GEMM where ``fused`` serves
    the call, else the module's three Linears called as diffusers' processors call them. Not for a call
    torch.compile traces (``projections`` sends those to diffusers' lines)."""
    names = STREAMS[index][1]
    y = None if fused is None else fused.project(attn, names, x)
    return tuple(getattr(attn, n)(x) for n in names) if y is None else y.chunk(3, dim=-1)


def projections(processor, attn: nn.Module, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None):
    """diffusers' ``_get_qkv_projections(attn, hidden_states, encoder_hidden_states)`` (FLUX), each stream
    through its ``FusedProjections`` where the layout holds (``project``)."""
    from diffusers.models.transformers.transformer_flux import _get_qkv_projections

    # diffusers' lines where it fused the module itself (its own to_qkv), and in a call torch.compile traces (the
    # fused call's guard reads storages the compiler does not trace)
    if attn.fused_projections or torch.compiler.is_compiling():
        return _get_qkv_projections(attn, hidden_states, encoder_hidden_states)
    image = stream(processor.qkv, attn, 0, hidden_states)  # diffusers' _get_projections, a stream at a time,
    encoder = (None, None, None)  # in its order (hooks on the projections see the same calls)
    if encoder_hidden_states is not None and attn.added_kv_proj_dim is not None:
        encoder = stream(processor.added_qkv, attn, 1, encoder_hidden_states)
    return *image, *encoder
