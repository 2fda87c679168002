"""Weights derived from a module's weight (Winograd's transformed U, the polyphase upsampler's
phases), held by the patched module that needs them and found again by the weight tensor.

A patched module owns one ``DerivedWeights`` per weight it transforms. While the owner lives,
``find(weight, kind)`` returns that cache: this is how a torch.compile custom op, which sees tensors
only, reaches it. A derived value is recomputed when the weight's storage or version counter changes
(an in-place update: a fused LoRA, ``load_state_dict``); dropping the owner (``unpatch``) frees
everything derived from its weight.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch


def weight_version(w: torch.Tensor) -> tuple:
    """What identifies a weight's values for a cache: its storage and version counter. Inference
    tensors (made under torch.inference_mode) have no version counter: their storage alone identifies
    them, so an in-place change made to one inside inference mode is not seen (outside it they cannot be
    changed in place). docs/fp8.md and docs/patch.md say so to the user: unpatch and patch again."""
    return w.data_ptr(), None if w.is_inference() else w._version


class DerivedWeights:
    """``derive(weight, arg)`` per (arg, dtype, device), kept until the weight changes."""

    def __init__(self, weight: torch.Tensor, kind: str, derive: Callable[[torch.Tensor, Any], Any]) -> None:
        self.weight, self.kind, self.derive = weight, kind, derive
        self.slots: dict[tuple, tuple[tuple, Any]] = {}  # (arg, dtype, device) → (weight version, value)
        key = (id(weight), kind)  # unique while this cache (and so the weight) lives
        _CACHES[key] = weakref.ref(self, lambda ref: _CACHES.pop(key) if _CACHES.get(key) is ref else None)

    def get(self, arg: Any) -> Any:
        w = self.weight
        slot, version = (arg, w.dtype, w.device), weight_version(w)
        cached = self.slots.get(slot)
        if cached is None or cached[0] != version:
            cached = self.slots[slot] = (version, self.derive(w, arg))
        return cached[1]

    def nbytes(self) -> int:
        """Bytes held by the derived values (each has ``nbytes``, as tensors do)."""
        return sum(value.nbytes for _, value in self.slots.values())


_CACHES: dict[tuple[int, str], weakref.ref] = {}  # (id(weight), kind) → the cache its owner keeps


def find(weight: torch.Tensor, kind: str) -> DerivedWeights | None:
    """The ``kind`` cache a live owner keeps for this very tensor, or None."""
    ref = _CACHES.get((id(weight), kind))
    cache = ref() if ref is not None else None
    return cache if cache is not None and cache.weight is weight else None
