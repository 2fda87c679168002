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

The direct path (``SD_KERNELS_FAST_LAUNCH``, on by default): even with the meta-parameters known,
``JITFunction.run`` costs ~20 µs a launch beyond its argument binder (its cache key formats the
compile options as a string, it builds launch metadata for hooks that are empty). After a key's
first launch, a ``Launcher`` runs Triton's own binder (native code: it reads each argument's dtype,
pointer alignment and integer divisibility), looks the resulting specialization up in its own table
of the ``CompiledKernel``s that ``JITFunction.run`` returned for it, and calls the compiled kernel's
``run`` directly. A specialization it has not seen (a misaligned view, an odd size) goes through
``JITFunction.run`` once, which compiles or finds the kernel, launches it and returns it for the
table. The direct call is made only while Triton's launch hooks (profilers) and pre-run hooks are
empty, and only with the compile-relevant knobs (debug, instrumentation mode, fp sanitizer) as they
were when the table entry was made; otherwise the call takes ``JITFunction.run``. Written against
Triton 3.6 and 3.9 (the same calling convention); anything missing from the structures it reads
turns it off for that launcher, with one log line.

**Persistence.** Benchmarking the configs costs seconds per kernel and shape on every start. So a
Launcher whose kernel has an autotuner with several configs also writes each key's tuned config to
a JSON file, ``repr(key) -> config``, and reads that file at its first launch in a process (its
first memo miss): a key found there launches with the stored config and never reaches the
autotuner. The file is ``<dir>/<device slug>/triton-<version>/<module>.<kernel>.json``, where
``<dir>`` is ``$SD_KERNELS_AUTOTUNE_CACHE`` ("off" or "0": no cache) or else the active profile's
``autotune_cache_dir()`` (None: no cache); another GPU or another Triton never reads it. The file
also holds a fingerprint of the kernel's own source and configs: after an edit its entries are
ignored (and rewritten). An entry is used only if it is exactly one of the autotuner's configs; the
heuristics' values are computed from the key's first call as without a cache. So a stale or
hand-edited file can pick a config, never pass the kernel anything the autotuner would not, and the
JIT still specializes each call. Writes go through a temporary file and ``os.replace``; a corrupt
or unreadable file, or a directory that cannot be written, is logged once and ignored. With
``SD_KERNELS_AUTOTUNE=0`` (first config, no timing) nothing is read or written: those launches are
not tuned choices. The memo hit, the hot path, does no more than before.

**Shipped tables.** The package ships the same files, tuned on the GPUs we measure on for the shapes
of SD1.5 / SD2.1 / SDXL (``sd_kernels/tuning/<profile>/<device slug>/triton-<version>/``, made by
``python -m bench.tune``), so that a fresh machine of such a GPU tunes nothing for them. A key not in
the user's file is looked up there (read only); a shipped file made for another version of the kernel
(its fingerprint, which covers the ``@triton.jit`` helpers it calls too) is ignored with one log
line, and what it would have served is tuned as before. ``SD_KERNELS_SHIPPED_TUNING=0`` ignores them
(``bench.tune`` does, to tune from scratch).
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import logging
import math
import os
import pathlib
import re
import tempfile
from collections.abc import Callable, Hashable
from typing import Any

import torch
import triton
from triton.runtime.autotuner import Autotuner, Heuristics

log = logging.getLogger("sd_kernels")

# SD_KERNELS_AUTOTUNE=0: every autotuned kernel takes its first listed config instead of timing them
# all (GPU test runs, where only correctness matters and autotuning costs minutes).
AUTOTUNE = os.environ.get("SD_KERNELS_AUTOTUNE", "1") != "0"
# SD_KERNELS_FAST_LAUNCH=0: memoized launches go through Triton's JITFunction.run, not the direct path
# (read here once; code may also set launch.FAST_LAUNCH, as bench.overhead does to compare the two).
FAST_LAUNCH = os.environ.get("SD_KERNELS_FAST_LAUNCH", "1") != "0"
MAX_KEYS = 4096  # a bound on the memo (past it, it starts over) and on the entries of one cache file
CACHE_ENV = "SD_KERNELS_AUTOTUNE_CACHE"
SHIPPED_ENV = "SD_KERNELS_SHIPPED_TUNING"
SHIPPED_ROOT = pathlib.Path(__file__).resolve().parent / "tuning"
CACHE_FORMAT = 1
TRITON_VERSION = triton.__version__
_MISSING = object()
_warned: set[str] = set()  # cache paths already logged as unusable


# ---------------------------------------------------------------------------------------------
# Device facts the host side needs, queried once per device


_PROPS: dict[int, Any] = {}


def device_properties(index: int) -> Any:
    """``torch.cuda.get_device_properties(index)``, cached (the query costs microseconds)."""
    props = _PROPS.get(index)
    if props is None:
        props = _PROPS[index] = torch.cuda.get_device_properties(index)
    return props


def device_slug(device: torch.device | None) -> str:
    """A directory name for a device: its name and capability on CUDA (``nvidia-h100-80gb-hbm3-sm90``),
    ``cpu`` otherwise; ``-interpreter`` appended under TRITON_INTERPRET."""
    from sd_kernels.dispatch import interpreting

    if device is not None and device.type == "cuda":
        props = device_properties(torch.cuda.current_device() if device.index is None else device.index)
        name = re.sub(r"[^a-z0-9]+", "-", props.name.lower()).strip("-") or "cuda"
        slug = f"{name}-sm{props.major}{props.minor}"
    else:
        slug = "cpu"
    return slug + "-interpreter" if interpreting() else slug


# ---------------------------------------------------------------------------------------------
# Where tuned choices persist


def cache_root(profile: Any = None) -> tuple[pathlib.Path | None, str]:
    """(the autotune cache directory before the device and Triton namespace, or None; why): from
    $SD_KERNELS_AUTOTUNE_CACHE, else ``profile`` (default: the active one)."""
    if not AUTOTUNE:
        return None, "off: SD_KERNELS_AUTOTUNE=0 (first configs, nothing tuned)"
    env = os.environ.get(CACHE_ENV, "")
    if env.lower() in ("off", "0"):
        return None, f"off: {CACHE_ENV}={env}"
    if env:
        return pathlib.Path(os.path.expanduser(env)), f"from {CACHE_ENV}"
    if profile is None:
        from sd_kernels.profiles import active_profile

        profile = active_profile()
    root = profile.autotune_cache_dir()
    if root is None:
        return None, f"off: profile {profile.name!r} sets no autotune_cache"
    return root, f"from profile {profile.name!r}"


def cache_dir(device: torch.device | None, profile: Any = None) -> pathlib.Path | None:
    """The directory of the cache files for kernels launched on ``device``, or None (no cache)."""
    root, _ = cache_root(profile)
    return None if root is None else root / device_slug(device) / f"triton-{TRITON_VERSION}"


def shipped_dir(device: torch.device | None, profile: Any = None) -> pathlib.Path | None:
    """The package's tuned tables for kernels launched on ``device`` under ``profile`` (default: the
    active one), or None where autotuning is off or $SD_KERNELS_SHIPPED_TUNING=0."""
    if not AUTOTUNE or os.environ.get(SHIPPED_ENV, "1") == "0":
        return None
    if profile is None:
        from sd_kernels.profiles import active_profile

        profile = active_profile()
    return SHIPPED_ROOT / profile.name / device_slug(device) / f"triton-{TRITON_VERSION}"


def _warn_once(path: pathlib.Path, what: str) -> None:
    if str(path) not in _warned:
        _warned.add(str(path))
        log.warning("sd_kernels: autotune cache %s %s; ignoring it (choices are tuned again)", path, what)


def _scalar(value: Any) -> bool:
    """Whether a meta value survives JSON unchanged: bool, int, str, None or a finite float."""
    return (value is None or isinstance(value, (bool, int, str))
            or (isinstance(value, float) and math.isfinite(value)))


class _CacheFile:
    """One kernel's persisted choices on one device and Triton version: ``repr(key) -> config``."""

    def __init__(self, path: pathlib.Path | None, launcher: Launcher, shipped: pathlib.Path | None = None) -> None:
        self.path, self.launcher, self.shipped_path = path, launcher, shipped
        self.writable = path is not None
        self.entries: dict[str, dict[str, Any]] = self._read(path, warn=True) if path is not None else {}
        self.shipped = self._read(shipped, warn=True, stale_warns=True) if shipped is not None else {}

    def _read(self, path: pathlib.Path, warn: bool, stale_warns: bool = False) -> dict[str, dict[str, Any]]:
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            if warn:
                _warn_once(path, f"is unreadable ({type(exc).__name__}: {exc})")
            return {}
        if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
            if warn:
                _warn_once(path, "is not an autotune cache file")
            return {}
        if data.get("format") != CACHE_FORMAT or data.get("fingerprint") != self.launcher.fingerprint:
            if stale_warns:  # a user's file is simply rewritten; a shipped one says why it is not used
                _warn_once(path, "was tuned for another version of the kernel (regenerate: python -m bench.tune)")
            return {}  # another version of the kernel or of this format: tuned again, then rewritten
        entries = {k: v for k, v in data["entries"].items() if self.launcher.valid_entry(v)}
        if warn and len(entries) < len(data["entries"]):
            _warn_once(path, f"has {len(data['entries']) - len(entries)} entries that match no config")
        return entries

    def get(self, key: Hashable) -> dict[str, Any] | None:
        name = repr(key)
        return self.entries.get(name) or self.shipped.get(name)

    def put(self, key: Hashable, config: dict[str, Any]) -> None:
        name = repr(key)
        if (not self.writable or " at 0x" in name or len(self.entries) >= MAX_KEYS
                or not all(_scalar(v) for v in config.values())):
            return  # a key whose repr names an address would never match again; a value JSON changes
        self.entries[name] = dict(config)
        merged = {**self._read(self.path, warn=False), **self.entries}  # keep what another process wrote meanwhile
        data = {"format": CACHE_FORMAT, "kernel": self.launcher.name, "fingerprint": self.launcher.fingerprint,
                "triton": TRITON_VERSION, "entries": merged}
        tmp = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name + ".", suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True, allow_nan=False)
            os.replace(tmp, self.path)
        except (OSError, TypeError, ValueError) as exc:
            self.writable = False
            _warn_once(self.path, f"cannot be written ({type(exc).__name__}: {exc})")
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)


# ---------------------------------------------------------------------------------------------


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
        # The direct path: (key, device, specialization) -> what launching the compiled kernel needs;
        # None once the path is off for this launcher (interpreter, or structures it cannot use).
        self._direct: dict[Hashable, tuple] | None = {}
        self._runtime: tuple | None = None  # (triton's driver, knobs.runtime, knobs.compilation)
        # The autotune cache: only a choice between several configs is worth keeping on disk.
        self.tunable = any(len(layer.configs) > 1 for layer in self._autotuners())
        self.config_names = {k for layer in self._autotuners() for c in layer.configs for k in c.all_kwargs()}
        self.cache: _CacheFile | None = None  # the file of the last miss's device and directory
        self._fingerprint: str | None = None

    def __call__(self, key: Hashable, grid: Callable | tuple, *args: Any, **kwargs: Any) -> None:
        meta = self.memo.get(key)
        if meta is not None:
            if FAST_LAUNCH and self._direct is not None and self._launch_direct(key, meta, grid, args, kwargs):
                return
            self.jit[grid](*args, **kwargs, **meta)
            return
        self._first(key, grid, args, kwargs)

    def _first(self, key: Hashable, grid: Callable | tuple, args: tuple, kwargs: dict[str, Any]) -> None:
        """A key not in the memo: its config from the cache file if it has one, else from the autotuner."""
        cache = self._cache_file(args) if self.tunable else None
        tuned = None if cache is None else cache.get(key)
        if tuned is not None:
            meta = self._chosen(args, kwargs, tuned)
            self.jit[grid](*args, **kwargs, **meta)
        else:
            self.kernel[grid](*args, **kwargs)
            meta = self._chosen(args, kwargs)
            if cache is not None and all(layer.best_config.pre_hook is None for layer in self._autotuners()):
                cache.put(key, {k: v for k, v in meta.items() if k in self.config_names})
        if len(self.memo) >= MAX_KEYS:
            self.memo.clear()
        self.memo[key] = meta

    def _cache_file(self, args: tuple) -> _CacheFile | None:
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
        directory, shipped = cache_dir(device), shipped_dir(device)
        if directory is None and shipped is None:
            return None
        path = None if directory is None else directory / f"{self.name}.json"
        table = None if shipped is None else shipped / f"{self.name}.json"
        if self.cache is None or (self.cache.path, self.cache.shipped_path) != (path, table):  # another device/profile
            self.cache = _CacheFile(path, self, table)
        return self.cache

    def _chosen(self, args: tuple, kwargs: dict[str, Any], tuned: dict[str, Any] | None = None) -> dict[str, Any]:
        """The meta-parameters the wrappers added to the last launch, recomputed layer by layer; with
        ``tuned`` (a cache entry), the autotuners' configs are taken from it instead."""
        meta: dict[str, Any] = {}
        for layer in self.layers:
            if isinstance(layer, Autotuner):
                config = layer.best_config.all_kwargs() if tuned is None else tuned
                meta.update({k: v for k, v in config.items() if k in self.config_names})
            else:  # heuristics see the arguments and what the layers above added, as at launch
                named = {**dict(zip(layer.arg_names, args)), **kwargs, **meta}
                meta.update({name: value(named) for name, value in layer.values.items()})
        return meta

    def _autotuners(self) -> list[Autotuner]:
        return [layer for layer in self.layers if isinstance(layer, Autotuner)]

    # -- the direct path ---------------------------------------------------------------------------

    def _launch_direct(self, key: Hashable, meta: dict[str, Any], grid: Callable | tuple, args: tuple,
                       kwargs: dict[str, Any]) -> bool:
        """Launch a memoized key: directly when its specialization has a table entry, else through
        ``JITFunction.run``, keeping the kernel it returns. False: the caller launches the usual way
        (hooks set, a device or arguments the binder refuses: ``run`` then does what it does)."""
        runtime = self._runtime or self._set_up()
        table = self._direct  # None once turned off (another thread may have)
        if runtime is None or table is None:
            return False
        driver, run_knobs, compile_knobs = runtime
        jit = self.jit
        if (jit.pre_run_hooks or _hooked(run_knobs.launch_enter_hook) or _hooked(run_knobs.launch_exit_hook)
                or getattr(run_knobs, "add_stages_inspection_hook", None) is not None):
            return False
        active = driver.active
        device = active.get_current_device()
        caches = jit.device_caches.get(device)  # (kernels, keys, target, backend, binder), made by run
        if caches is None or len(caches) != 5:
            return False
        try:
            bound, specialization, options = caches[4](*args, **kwargs, **meta)
        except Exception:  # bad arguments: JITFunction.run raises what is wrong with them
            return False
        # What JITFunction.run adds to the compile options besides the call's own (Triton 3.6: debug,
        # instrumentation_mode; 3.9 also fpsan_homomorphic_casts).
        knobs = (options.get("debug", jit.debug) or run_knobs.debug, compile_knobs.instrumentation_mode,
                 getattr(compile_knobs, "fpsan_homomorphic_casts", None))
        direct_key = (key, device, tuple(specialization))
        entry = table.get(direct_key)
        if (entry is not None and entry[4] is meta and entry[5] == knobs and entry[6] == options
                and _globals_unchanged(jit)):
            grid = grid(bound) if callable(grid) else grid
            n = len(grid)
            stream = active.get_current_stream(device)
            try:
                entry[1](grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, stream, entry[2], entry[3],
                         None, None, None, *bound.values())
            except TypeError as exc:  # a launcher whose calling convention is not the one read here
                self._turn_off(f"the compiled kernel's run refused the call ({exc})")
                return False
            return True
        kernel = jit.run(*args, grid=grid, warmup=False, **kwargs, **meta)
        self._remember(table, direct_key, kernel, meta, knobs, options)
        return True

    def _set_up(self) -> tuple | None:
        """Check, once per launcher, that the JIT function and Triton have what the direct path reads."""
        jit = self.jit
        if type(jit).__name__ == "InterpretedFunction":  # TRITON_INTERPRET: nothing compiled to call
            self._direct = None
            return None
        try:
            driver, run_knobs, compile_knobs = _triton_runtime()
            missing = [name for obj, names in ((jit, ("run", "device_caches", "used_global_vals", "pre_run_hooks",
                                                       "debug")),
                                               (run_knobs, ("launch_enter_hook", "launch_exit_hook", "debug")),
                                               (compile_knobs, ("instrumentation_mode",)),
                                               (driver.active, ("get_current_device", "get_current_stream")))
                       for name in names if not hasattr(obj, name)]
            if missing:
                raise AttributeError(f"no {', '.join(missing)}")
            if not (callable(jit.run) and hasattr(jit.device_caches, "get")
                    and isinstance(jit.used_global_vals, dict) and isinstance(jit.pre_run_hooks, list)):
                raise TypeError("JITFunction attributes of unexpected types")
        except Exception as exc:
            self._turn_off(exc)
            return None
        self._runtime = (driver, run_knobs, compile_knobs)
        return self._runtime

    def _remember(self, table: dict, direct_key: tuple, kernel: Any, meta: dict[str, Any], knobs: tuple,
                  options: dict[str, Any]) -> None:
        """Keep what ``JITFunction.run`` returned for a direct launch of the same specialization."""
        compiled = getattr(self.jit, "CompiledKernel", None)  # set by the JIT's create_binder
        if compiled is None:
            self._turn_off("the JIT function has no CompiledKernel class")
            return
        if not isinstance(kernel, compiled):  # None (a compile hook skipped it), an async compile's future
            return
        try:
            # The kernel itself stays referenced: its module is unloaded when it is freed.
            entry = (kernel, kernel.run, kernel.function, kernel.packed_metadata, meta, knobs, options)
            if not callable(entry[1]) or entry[2] is None:
                raise TypeError("the compiled kernel has no loaded function")
        except Exception as exc:
            self._turn_off(exc)
            return
        if len(table) >= MAX_KEYS:
            table.clear()
        table[direct_key] = entry

    def _turn_off(self, why: object) -> None:
        self._direct = None
        log.warning("sd_kernels: %s launches through Triton's JITFunction.run (direct launch path off: %s)",
                    getattr(self.jit, "__name__", self.jit), why)

    # -- what the cache file checks ------------------------------------------------------------

    @property
    def name(self) -> str:
        """The kernel's cache file name: its module and name."""
        return f"{self.jit.fn.__module__}.{self.jit.fn.__qualname__}"

    @property
    def fingerprint(self) -> str:
        """A hash of the kernel's source, the sources of the ``@triton.jit`` helpers it calls (to any
        depth), and the wrappers' configs and names."""
        if self._fingerprint is None:
            parts = _jit_sources(self.jit)
            for layer in self.layers:
                if isinstance(layer, Autotuner):
                    parts += ["autotune", *map(_config_text, layer.configs), *getattr(layer, "keys", ())]
                else:
                    parts += ["heuristics", *sorted(layer.values)]
            self._fingerprint = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
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


def _config_text(config: Any) -> str:
    """What a config chooses, in a form that does not change with the Triton release (``str(config)``
    lists every field the release has): the shipped tables are checked on CPU machines with another
    Triton than the GPU's they were tuned on."""
    return f"{sorted(config.kwargs.items())} warps={config.num_warps} stages={config.num_stages}"


def _jit_sources(jit: Any) -> list[str]:
    """The source of a JIT function and of every JIT function it names, depth first, each once: an
    edit to a helper changes what the kernel computes, so it must change the fingerprint too."""
    seen: set[int] = set()
    sources: list[str] = []

    def visit(fn: Any) -> None:
        if id(fn) in seen:
            return
        seen.add(id(fn))
        py = getattr(fn, "fn", None)
        try:
            sources.append(inspect.getsource(py))
        except (OSError, TypeError):
            sources.append(f"{getattr(py, '__module__', '?')}.{getattr(py, '__qualname__', '?')}")
        for name in getattr(getattr(py, "__code__", None), "co_names", ()):
            value = getattr(py, "__globals__", {}).get(name)
            if isinstance(value, type(jit)):
                visit(value)

    visit(jit)
    return sources


def _triton_runtime() -> tuple[Any, Any, Any]:
    """Triton's driver and the knobs the direct path reads (a function, so that tests can fake them)."""
    from triton import knobs
    from triton.runtime.driver import driver

    return driver, knobs.runtime, knobs.compilation


def _hooked(hook: Any) -> bool:
    """Whether a launch hook would do anything: set, and (Triton's HookChain) with something in it."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _globals_unchanged(jit: Any) -> bool:
    """JITFunction.run's check that the globals the kernel was compiled with still hold (it raises
    when they do not: the caller then takes that path)."""
    for (name, _), (value, scope) in jit.used_global_vals.items():
        if scope.get(name, _MISSING) != value:
            return False
    return True


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Dict equality that also tells True from 1 (JSON keeps the difference; ``==`` does not)."""
    return a.keys() == b.keys() and all(type(a[k]) is type(b[k]) and a[k] == b[k] for k in a)


def cdiv(a: int, b: int) -> int:
    """⌈a / b⌉ for the host side (``triton.cdiv`` is a constexpr function: ~1 µs a call there)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two ≥ n (1 for n ≤ 1), like ``triton.next_power_of_2``, in plain Python."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
