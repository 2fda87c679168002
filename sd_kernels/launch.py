"""Launching autotuned Triton kernels with less host time per call.

``triton.autotune`` rebuilds its cache key from every argument on every launch, then
``triton.heuristics`` computes its values, then the JIT binds the arguments again: tens of
microseconds of Python per launch, as long as the kernels themselves at most SD shapes, paid ~150
times per eager UNet step. ``Launcher`` keeps, per key the caller computes from what it already
knows, the meta-parameters the autotuner chose (and the heuristics' values), and launches the
underlying JIT function with them directly. The first launch of a key goes through the autotuner
as usual (benchmarking the configs if there are several).

The caller's key must determine everything the autotuner's key and the heuristics read: it is the
caller's promise, kept next to each launch. The JIT still specializes on each call's arguments
(alignment, 1-valued ints), so correctness never rests on the key beyond the chosen config.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable
from typing import Any

from triton.runtime.autotuner import Autotuner, Heuristics

# SD_KERNELS_AUTOTUNE=0: every autotuned kernel takes its first listed config instead of timing them
# all (GPU test runs, where only correctness matters and autotuning costs minutes).
AUTOTUNE = os.environ.get("SD_KERNELS_AUTOTUNE", "1") != "0"
MAX_KEYS = 4096  # a bound on the memo: past it, it starts over (each key costs one slow launch)


class Launcher:
    """``Launcher(kernel)(key, grid, *args, **kwargs)``: ``kernel[grid](*args, **kwargs)`` for the
    first call of each ``key``, the bare JIT function with the remembered meta-parameters after."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.layers: list[Any] = []  # autotuner / heuristics wrappers, outermost first
        fn = kernel
        while isinstance(fn, (Autotuner, Heuristics)):
            self.layers.append(fn)
            fn = fn.fn
        self.jit = fn
        self.memo: dict[Hashable, dict[str, Any]] = {}

    def __call__(self, key: Hashable, grid: Callable | tuple, *args: Any, **kwargs: Any) -> None:
        meta = self.memo.get(key)
        if meta is not None:
            self.jit[grid](*args, **kwargs, **meta)
            return
        self.kernel[grid](*args, **kwargs)
        if len(self.memo) >= MAX_KEYS:
            self.memo.clear()
        self.memo[key] = self._chosen(args, kwargs)

    def _chosen(self, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The meta-parameters the wrappers added to the last launch, recomputed layer by layer."""
        meta: dict[str, Any] = {}
        for layer in self.layers:
            if isinstance(layer, Autotuner):
                meta.update(layer.best_config.all_kwargs())
            else:  # heuristics see the arguments and what the layers above added, as at launch
                named = {**dict(zip(layer.arg_names, args)), **kwargs, **meta}
                meta.update({name: value(named) for name, value in layer.values.items()})
        return meta


def cdiv(a: int, b: int) -> int:
    """⌈a / b⌉ for the host side (``triton.cdiv`` is a constexpr function: ~1 µs a call there)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two ≥ n (1 for n ≤ 1), like ``triton.next_power_of_2``, in plain Python."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
