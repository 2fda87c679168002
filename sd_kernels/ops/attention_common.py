"""What the two attention kernels share: flash (ops/attention.py) and the partially fused softmax
(ops/softmax_matmul.py) take the same arguments, check them with torch's errors, view them as
[B, H, S, D], allocate their outputs in q's layout and give the compiler the same alignment hints.
Both import this module; neither imports the other for it (``attention``, the one function that
picks a path, lives with flash and calls the partial softmax).

``AUTOTUNE`` (SD_KERNELS_AUTOTUNE, read in sd_kernels.runtime.launch) is read from here as a module global by
both kernels' config pruners: the GPU tests switch it off (first config only) to save compile time;
a separate test runs every config. ``alloc_output`` is looked up here on every call, so that tests
can poison every attention output at one place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sd_kernels import reference
from sd_kernels.runtime.dispatch import tensor_reason
from sd_kernels.runtime.launch import AUTOTUNE

__all__ = ["AUTOTUNE", "LOG2E", "alignment", "alloc_output", "as_4d", "check_attention_args", "default_scale",
           "dot_precision", "from_4d", "kernel_reason"]

LOG2E = 1.4426950408889634


@triton.jit
def _aligned(stride, ALIGN: tl.constexpr):
    """``stride``, known to the compiler as a multiple of ALIGN (the launcher checked it).

    Triton only learns divisibility by 16 from integer arguments; a head dim of 40 gives row or head
    strides of 40·n, so without this hint every load is scalar and none is pipelined (cp.async).
    """
    return stride // ALIGN * ALIGN


def alloc_output(shape, like: torch.Tensor, heads_inner: bool) -> torch.Tensor:
    """Every attention output comes from here (tests poison it to catch unwritten elements).

    [B, H, S, D]; ``heads_inner`` lays it out as [B, S, H, D] memory (q's layout in diffusers), so
    that the caller's transpose(1, 2).reshape(B, S, H·D) is a view.
    """
    b, h, s, d = shape
    if heads_inner:
        return torch.empty(b, s, h, d, dtype=like.dtype, device=like.device).transpose(1, 2)
    return torch.empty(b, h, s, d, dtype=like.dtype, device=like.device)


_TYPE_NAMES = {torch.int64: "Long", torch.int32: "Int", torch.int16: "Short", torch.int8: "Char", torch.uint8: "Byte",
               torch.bool: "Bool"}


def check_attention_args(op: str, q, k, v, attn_mask) -> tuple[int, ...]:
    """Raise torch-like errors for inputs F.scaled_dot_product_attention rejects; return the batch shape."""
    for name, t in (("query", q), ("key", k), ("value", v)):
        if t.dim() < 2:
            raise RuntimeError(f"{op}: {name} must have at least 2 dims [..., S, D], got {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise RuntimeError(
            f"{op}: expected query, key, and value to have the same dtype, but got query.dtype: {q.dtype} "
            f"key.dtype: {k.dtype} and value.dtype: {v.dtype} instead."
        )
    if not q.is_floating_point():  # torch's own words for an integer query
        raise RuntimeError(f"{op}: expected scalar type Float but found {_TYPE_NAMES.get(q.dtype, q.dtype)}")
    if q.shape[-1] != k.shape[-1]:
        raise RuntimeError(f"{op}: query and key head dims differ: {q.shape[-1]} != {k.shape[-1]}")
    if k.shape[-2] != v.shape[-2]:
        raise RuntimeError(f"{op}: key and value sequence lengths differ: {k.shape[-2]} != {v.shape[-2]}")
    batch = q.shape[:-2]
    try:
        if not (batch == k.shape[:-2] == v.shape[:-2]):  # torch.broadcast_shapes costs ~10 µs a call
            batch = torch.broadcast_shapes(batch, k.shape[:-2], v.shape[:-2])
    except RuntimeError as exc:
        raise RuntimeError(
            f"{op}: batch dims of query {tuple(q.shape[:-2])}, key {tuple(k.shape[:-2])} and value "
            f"{tuple(v.shape[:-2])} do not broadcast"
        ) from exc
    if attn_mask is not None:
        if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
            raise RuntimeError(f"{op}: expected attn_mask dtype to be bool or float, got {attn_mask.dtype}")
        want = torch.Size((*batch, q.shape[-2], k.shape[-2]))
        try:
            if attn_mask.shape != want and torch.broadcast_shapes(attn_mask.shape, want) != want:
                raise RuntimeError
        except RuntimeError as exc:
            raise RuntimeError(
                f"{op}: attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to {want}"
            ) from exc
    return tuple(batch)


def as_4d(t: torch.Tensor, batch: tuple[int, ...], rows: int, cols: int) -> torch.Tensor:
    """``t`` expanded to (*batch, rows, cols) and viewed [B, H, rows, cols] (broadcast = stride 0)."""
    t = t.expand(*batch, rows, cols)
    return t.reshape(*(1,) * (4 - t.dim()), *t.shape) if t.dim() < 4 else t


def from_4d(out4: torch.Tensor, batch: tuple[int, ...]) -> torch.Tensor:
    return out4.reshape(*batch, *out4.shape[-2:]) if len(batch) < 2 else out4


def kernel_reason(*tensors: torch.Tensor | None, batch: tuple[int, ...]) -> str | None:
    """Why the attention kernels cannot take these inputs, or None. Offsets inside one (b, h) slice are
    int32 in the kernels, so each slice must span < 2^31 elements."""
    if len(batch) > 2:
        return f"{len(batch)} batch dims (the kernels take [B, H, S, D])"
    if any(t is not None and t.numel() == 0 for t in tensors):
        return "an empty input (the reference gives torch's result)"
    reason = tensor_reason(*tensors, also=(torch.bool,))  # masks may be bool
    if reason is not None:
        return reason
    for t in tensors:
        if t is None or t.dim() < 2:
            continue
        if sum((n - 1) * abs(s) for n, s in zip(t.shape[-2:], t.stride()[-2:])) >= 2**31:
            return "a (batch, head) slice spans 2^31 elements or more"
    return None


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input_precision: fp32 follows torch's TF32 switch for matmuls; halves ignore it."""
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def alignment(*tensors: torch.Tensor) -> int:
    """The largest power of two, up to 16 bytes' worth of elements, dividing every stride but the last
    of every tensor: what ``_aligned`` may promise the compiler (and vectorised loads need)."""
    align = 16 // tensors[0].element_size()
    while align > 1 and any(s % align for t in tensors for s, n in zip(t.stride()[:-1], t.shape) if n > 1):
        align //= 2
    return align


def default_scale(q: torch.Tensor, scale: float | None) -> float:
    """SDPA's default (reference.default_scale), or the given scale."""
    return reference.default_scale(q.shape[-1]) if scale is None else float(scale)
