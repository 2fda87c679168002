"""Launching autotuned Triton kernels with less host time per call, and keeping the autotuner's
choices across processes.

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

Its three jobs, one module each: the memo of meta-parameters per key and the first launch of a key
(here); the direct path, which launches a memoized key without ``JITFunction.run``'s overhead
(direct_launch.py; ``SD_KERNELS_FAST_LAUNCH=0`` turns it off); and the persistence of the tuned
choices, in the user's autotune cache and the tables the package ships (autotune_cache.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Hashable
from typing import Any

import torch
from triton.runtime.autotuner import Autotuner, Heuristics
from triton.runtime.errors import OutOfResources

from . import autotune_cache, tuning_rule
from .autotune_cache import (
    AUTOTUNE,
    MAX_KEYS,
    TIE,
    TIE_MS,
    CacheFile,
    cache_dir,
    device_properties,
    kernel_fingerprint,
    shipped_device_dirs,
)
from .direct_launch import DirectPath
from .precompile import dry

__all__ = ["AUTOTUNE", "FAST_LAUNCH", "Launcher", "cdiv", "device_properties", "next_pow2"]

# SD_KERNELS_FAST_LAUNCH=0: memoized launches go through Triton's JITFunction.run, not the direct path
# (read here once; code may also set launch.FAST_LAUNCH, as bench.overhead does to compare the two).
FAST_LAUNCH = os.environ.get("SD_KERNELS_FAST_LAUNCH", "1") != "0"
log = logging.getLogger(__name__)


# Entered around a kernel's autotuning launch. sd_kernels.runtime.memory sets it to ``memory.tuning`` (a
# running BudgetGuard's cap and peak lifted for the tuning); the launcher imports nothing above it.
TUNING: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext


class Launcher:
    """``Launcher(kernel)(key, grid, *args, **kwargs)``: ``kernel[grid](*args, **kwargs)`` for the
    first call of each ``key``, the bare JIT function with the remembered meta-parameters after."""

    def __init__(self, kernel: Any, relax: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> None:
        self.kernel = kernel
        # relax(the call's arguments by name) -> heuristics' values right for that call (flash attention's
        # EVEN_N=False: the masked path), taken at a key's first launch where the computed ones would
        # compile a new kernel and these would not
        self.relax = relax
        self.layers: list[Any] = []  # autotuner / heuristics wrappers, outermost first
        fn = kernel
        while isinstance(fn, (Autotuner, Heuristics)):
            self.layers.append(fn)
            fn = fn.fn
        self.jit = fn
        self.memo: dict[Hashable, dict[str, Any]] = {}
        self.direct = DirectPath(fn)
        # The autotune cache: only a choice between several configs is worth keeping on disk.
        self.tunable = any(len(layer.configs) > 1 for layer in self._autotuners())
        # in the configs' own order: a launch's options are part of Triton's in-memory cache key as a string
        # (str of the dict), so the same config in another key order (a table's JSON is sorted) misses it
        # and goes through the compiler again (a disk-cache hit: Triton's disk key sorts the options)
        self.config_order = list(dict.fromkeys(k for layer in self._autotuners() for c in layer.configs
                                               for k in c.all_kwargs()))
        self.config_names = set(self.config_order)
        self.cache: CacheFile | None = None  # the file of the last miss's device and directory
        self.tuned_any = False  # whether a key was autotuned in this process (logged the first time)
        self.ruled: dict[Hashable, str] = {}  # key -> the tuned key whose choice the rule gave it (or why none)
        self.tied: dict[Hashable, dict[str, Any]] = {}  # key -> the compiled alternative it took (_compiled_choice)
        self.too_large: list[dict[str, Any]] = []  # configs this GPU lacked the resources for
        self._fingerprint: str | None = None

    def knows(self, key: Hashable) -> bool:
        """Whether ``key`` has launched (its config is chosen: a launch of it runs no timing)."""
        return key in self.memo

    def __call__(self, key: Hashable, grid: Callable | tuple, *args: Any, **kwargs: Any) -> None:
        meta = self.memo.get(key)
        if meta is None:
            self._first(key, grid, args, kwargs)
            return
        try:
            if FAST_LAUNCH and self.direct.table is not None and self.direct.launch(key, meta, grid, args, kwargs):
                return
            self.jit[grid](*args, **kwargs, **meta)
        except OutOfResources as exc:  # compiling the config for this GPU failed: the next config that fits
            meta = self._smaller(meta, args, kwargs, exc)
            self.memo[key] = self._jit_launch(grid, args, kwargs, meta)

    def _first(self, key: Hashable, grid: Callable | tuple, args: tuple, kwargs: dict[str, Any]) -> None:
        """A key not in the memo: its config from the cache file if it has one; else, by default, the
        nearest tuned key's (tuning_rule.py); else (SD_KERNELS_AUTOTUNE=1) from the autotuner."""
        cache = self._cache_file(args) if self.tunable else None
        tuned, source = (None, "") if cache is None else (cache.get(key), repr(key))
        if tuned is None and self.tunable and autotune_cache.MODE == "rule":
            tuned, source = self._rule(key, args, kwargs, cache)
        if tuned is None and self.tunable and dry():  # tuning needs real launches: the real call tunes it
            return
        if tuned is not None:
            ties = cache.ties(source, tuned) if cache is not None and source else []
            meta = self._jit_launch(grid, args, kwargs, self._compiled_choice(key, tuned, ties, args, kwargs))
        else:
            if self.tunable and not self.tuned_any:  # once per kernel: a shape no table holds is timed now
                self.tuned_any = True
                log.info("sd_kernels: autotuning %s for a shape no tuning table holds (key %s); the choice is "
                         "kept in the autotune cache", self.name, key)
            # a tuning launch runs outside a memory budget's cap and peak (memory.tuning): a one-time cost, cached
            for layer in self._autotuners():
                layer.configs_timings = None  # set again by a layer that times configs in this launch
                # the autotuner's own key is coarser than ours (flash attention: powers of two): time
                # this key anew rather than take another key's choice untimed
                layer.cache.clear()
            with TUNING() if self.tunable else contextlib.nullcontext():
                self.kernel[grid](*args, **kwargs)
            meta = self._chosen(args, kwargs)
            if cache is not None and all(layer.best_config.pre_hook is None for layer in self._autotuners()):
                cache.put(key, {k: v for k, v in meta.items() if k in self.config_names}, self._timings())
        if len(self.memo) >= MAX_KEYS:
            self.memo.clear()
        self.memo[key] = meta

    def _jit_launch(self, grid: Callable | tuple, args: tuple, kwargs: dict[str, Any],
                    meta: dict[str, Any]) -> dict[str, Any]:
        """``self.jit[grid]`` with ``meta``, or with the next config the kernel keeps for the call where
        the GPU lacks the resources for it; the meta-parameters launched."""
        while True:
            try:
                self.jit[grid](*args, **kwargs, **meta)
                return meta
            except OutOfResources as exc:
                meta = self._smaller(meta, args, kwargs, exc)

    def _cache_file(self, args: tuple) -> CacheFile | None:
        return self._cache_for(next((a.device for a in args if isinstance(a, torch.Tensor)), None))

    def tuned_ms(self, key: Hashable, device: torch.device) -> float | None:
        """The fastest time of any config at ``key``'s tuning, from the table that holds its choice on
        ``device`` (the user's autotune cache, else the shipped table); None where none holds timings for
        it (or the kernel has one config). Comparable between kernels tuned on the same GPU (ops that
        choose between kernels per shape: ops/fp8_linear.py)."""
        cache = self._cache_for(device) if self.tunable else None
        return None if cache is None else cache.best_ms(key)

    def _cache_for(self, device: torch.device | None) -> CacheFile | None:
        directory, shipped = cache_dir(device), shipped_device_dirs(device)
        if directory is None and not shipped:
            return None
        path = None if directory is None else directory / f"{self.name}.json"
        if self.cache is None or (self.cache.path, self.cache.shipped_dirs) != (path, shipped):  # another device
            self.cache = CacheFile(path, self, shipped)
        return self.cache

    def _timings(self) -> list[tuple[dict[str, Any], float]]:
        """(config as a cache entry, ms) of every config the last launch's autotuner timed, fastest first
        (Triton's median); [] unless one autotuner timed configs in that launch."""
        layers = self._autotuners()
        timings = getattr(layers[0], "configs_timings", None) if len(layers) == 1 else None
        rows = [(self.entry(config), timing_ms(t)) for config, t in (timings or {}).items()]
        return sorted(rows, key=lambda row: row[1])

    def entry(self, config: Any) -> dict[str, Any]:
        """A ``triton.Config`` as a cache entry: its meta-parameters and options this kernel's configs name."""
        return {k: v for k, v in config.all_kwargs().items() if k in self.config_names}

    def _compiled_choice(self, key: Hashable, tuned: dict[str, Any], ties: list[dict[str, Any]], args: tuple,
                         kwargs: dict[str, Any]) -> dict[str, Any]:
        """The meta-parameters of ``tuned``, unless their kernel for this call is not compiled and one of
        these is, launched in this process for another key: a config of ``ties`` (within TIE + TIE_MS of
        ``tuned`` at tuning, fastest first), then ``tuned`` and each tie with the heuristics' values of
        ``relax``. That saves a compilation at a new size for a little kernel time."""
        meta = self._chosen(args, kwargs, tuned)
        if not (ties or self.relax) or self.direct.compiled(meta, args, kwargs):
            return meta
        allowed = self.allowed(args, kwargs)
        options = [option for tie in ties if (option := tuning_rule.accepted(tie, allowed)) is not None]
        metas = [meta, *(self._chosen(args, kwargs, option) for option in options)]
        relax = self.relax({**dict(zip(self.jit.arg_names, args)), **kwargs}) if self.relax else {}
        relaxed = [{**m, **relax} for m in metas if any(m.get(k) != v for k, v in relax.items())]
        for other in [*metas[1:], *relaxed]:
            if self.direct.compiled(other, args, kwargs):
                if not self.tied:
                    log.info("sd_kernels: %s: %s launches with %s, compiled already (a config within %.0f%% + %.1f "
                             "µs of its choice at tuning, or relaxed heuristics), not %s", self.name, key, other,
                             TIE * 100, TIE_MS * 1e3, meta)
                if len(self.tied) < MAX_KEYS:
                    self.tied[key] = {k: v for k, v in other.items() if k in self.config_names or k in relax}
                return other
        return meta

    def _rule(self, key: Hashable, args: tuple, kwargs: dict[str, Any],
              cache: CacheFile | None) -> tuple[dict[str, Any], str]:
        """(the config of the nearest tuned key the kernel accepts for this call, that key's repr), else
        (its first config for the call, ""): tuning_rule.py; nothing is timed."""
        allowed = self.allowed(args, kwargs)
        found = tuning_rule.nearest(repr(key), cache.neighbours() if cache is not None else [], allowed)
        config, near = found if found is not None else (allowed[0], "")
        if not self.ruled:  # once per kernel and process
            log.info("sd_kernels: %s: %s, a key no tuning table holds, takes %s, untimed (SD_KERNELS_AUTOTUNE=1 "
                     "times such keys)", self.name, key, f"the choice of the nearest tuned key {near}" if near else
                     "the kernel's first config for the call (no tuned key of its kind)")
        if len(self.ruled) < MAX_KEYS:
            self.ruled[key] = near
        return config, near

    def allowed(self, args: tuple, kwargs: dict[str, Any]) -> list[dict[str, Any]]:
        """The configs the kernel's autotuners keep for a call on ``args`` (their own pruning), in their
        order, as cache entries (one dict over all the autotuners)."""
        options: list[dict[str, Any]] = [{}]
        for layer in self._autotuners():
            configs = layer.configs
            prune = getattr(layer, "early_config_prune", None)
            if prune is not None:
                configs = prune(configs, dict(zip(layer.arg_names, args)), **kwargs) or configs
            options = [{**o, **self.entry(c)} for o in options for c in configs]
        return [o for o in options if o not in self.too_large] or options

    def _smaller(self, meta: dict[str, Any], args: tuple, kwargs: dict[str, Any],
                 exc: OutOfResources) -> dict[str, Any]:
        """The meta-parameters of the first config the kernel keeps for the call that this GPU has not
        refused, ``meta``'s config being refused now (more shared memory or registers than the GPU has:
        tables and the rule's fallback are made on Hopper); raises ``exc`` when none is left."""
        config = {k: v for k, v in meta.items() if k in self.config_names}
        self.too_large.append(config)
        allowed = self.allowed(args, kwargs)
        if not allowed or allowed[0] in self.too_large:
            raise exc
        log.warning("sd_kernels: %s: config %s needs more resources than this GPU has (%s); using %s", self.name,
                    config, exc, allowed[0])
        self.memo = {k: m for k, m in self.memo.items() if {n: m.get(n) for n in config} != config}
        return self._chosen(args, kwargs, allowed[0])

    def _chosen(self, args: tuple, kwargs: dict[str, Any], tuned: dict[str, Any] | None = None) -> dict[str, Any]:
        """The meta-parameters the wrappers added to the last launch, recomputed layer by layer; with
        ``tuned`` (a cache entry), the autotuners' configs are taken from it instead."""
        meta: dict[str, Any] = {}
        for layer in self.layers:
            if isinstance(layer, Autotuner):
                config = layer.best_config.all_kwargs() if tuned is None else tuned
                meta.update({k: config[k] for k in self.config_order if k in config})
            else:  # heuristics see the arguments and what the layers above added, as at launch
                named = {**dict(zip(layer.arg_names, args)), **kwargs, **meta}
                meta.update({name: value(named) for name, value in layer.values.items()})
        return meta

    def _autotuners(self) -> list[Autotuner]:
        return [layer for layer in self.layers if isinstance(layer, Autotuner)]

    # -- what the cache file checks ------------------------------------------------------------

    @property
    def name(self) -> str:
        """The kernel's cache file name: its module and name."""
        return f"{self.jit.fn.__module__}.{self.jit.fn.__qualname__}"

    @property
    def fingerprint(self) -> str:
        """What the cache files check (autotune_cache.kernel_fingerprint), computed once."""
        if self._fingerprint is None:
            self._fingerprint = kernel_fingerprint(self.jit, self.layers)
        return self._fingerprint

    def valid_entry(self, entry: Any) -> bool:
        """Whether a cache entry names exactly one config of each autotuner, and nothing else (the
        heuristics' values are never stored: they are computed from each key's first call)."""
        if not isinstance(entry, dict) or set(entry) - self.config_names:
            return False
        for layer in self._autotuners():
            configs = [c.all_kwargs() for c in layer.configs]
            own = set().union(*configs)
            part = {k: v for k, v in entry.items() if k in own}
            if not any(_same(part, c) for c in configs):
                return False
        return True


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Dict equality that also tells True from 1 (JSON keeps the difference; ``==`` does not)."""
    return a.keys() == b.keys() and all(type(a[k]) is type(b[k]) and a[k] == b[k] for k in a)


def timing_ms(timing: Any) -> float:
    """ms of one config as Triton's autotuner timed it: the median where it kept quantiles."""
    return float(timing[0] if isinstance(timing, (list, tuple)) else timing)


def cdiv(a: int, b: int) -> int:
    """⌈a / b⌉ for the host side (``triton.cdiv`` is a constexpr function: ~1 µs a call there)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two ≥ n (1 for n ≤ 1), like ``triton.next_power_of_2``, in plain Python."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
