"""Where the autotuner's choices persist between processes: the user's autotune cache and the tables
the package ships (the second of ``sd_kernels.runtime.launch.Launcher``'s three jobs; the first, remembering
each key's meta-parameters in memory, is the Launcher itself, the third is direct_launch.py).

Benchmarking the configs costs seconds per kernel and shape on every start. So a
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
the user's file is looked up there (read only). A table serves whatever Triton is installed as long as
it was made for the kernel's current source (its fingerprint, which covers the ``@triton.jit`` helpers
it calls and the configs): the table of the installed Triton's version if there is one, else the
newest other version's; a kernel whose every shipped table was made for another version of it is
logged once, and what they would have served is chosen as for any other key.
``SD_KERNELS_SHIPPED_TUNING=0`` ignores them (``bench.tune`` does, to tune from scratch).

**Keys no table holds** (``SD_KERNELS_AUTOTUNE``): by default (``rule``) they take the choice of the
nearest tuned key, from this GPU's tables or else those of GPUs of its architecture
(sd_kernels/runtime/tuning_rule.py), without timing anything; ``1`` (or ``time``) has Triton's
autotuner time them and keeps the choices in the user's file; ``0`` (or ``first``) gives every
kernel its first config, with no tables (GPU test runs).
"""

from __future__ import annotations

import ast
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
import textwrap
from collections.abc import Hashable
from typing import Any

import torch
import triton
from triton.runtime.autotuner import Autotuner

from .tuning_rule import Neighbours

log = logging.getLogger(__name__)

MODE_ENV = "SD_KERNELS_AUTOTUNE"
_MODES = {"rule": "rule", "": "rule", "1": "time", "on": "time", "time": "time", "0": "first", "off": "first",
          "first": "first"}


def _mode(value: str) -> str:
    mode = _MODES.get(value.strip().lower())
    if mode is None:
        raise ValueError(f"{MODE_ENV}={value!r}: expected rule (the default: keys no table holds take the nearest "
                         "tuned key's choice), 1 (time them) or 0 (every kernel's first config)")
    return mode


# How a key no table holds gets its config: "rule", "time" or "first" (module docstring). Read once.
MODE = _mode(os.environ.get(MODE_ENV, "rule"))
# False under "first": every autotuned kernel takes its first listed config (the ops' pruning reads it).
AUTOTUNE = MODE != "first"
MAX_KEYS = 4096  # a bound on a launcher's memo (past it, it starts over) and on the entries of one cache file
CACHE_ENV = "SD_KERNELS_AUTOTUNE_CACHE"
SHIPPED_ENV = "SD_KERNELS_SHIPPED_TUNING"
SHIPPED_ROOT = pathlib.Path(__file__).resolve().parents[1] / "tuning"
CACHE_FORMAT = 1
# Ties: a config that timed within TIE (relative) plus TIE_MS of a key's choice at tuning. A later key
# whose choice would compile a new kernel takes a tie that is compiled already (launch.Launcher). About
# the noise of Triton's timing of 10-30 µs kernels (docs/design.md, "Ties").
TIE, TIE_MS = 0.10, 0.002
TRITON_VERSION = triton.__version__
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
    from sd_kernels.runtime.dispatch import interpreting

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
        return None, f"off: {MODE_ENV}=0 (first configs, nothing tuned)"
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
    """Where ``bench.tune`` writes the package's tables for kernels launched on ``device`` under
    ``profile`` (default: the active one) with the installed Triton, or None where autotuning is off or
    $SD_KERNELS_SHIPPED_TUNING=0."""
    dirs = shipped_device_dirs(device, profile)
    return None if not dirs else dirs[0] / f"triton-{TRITON_VERSION}"


def shipped_device_dirs(device: torch.device | None, profile: Any = None) -> list[pathlib.Path]:
    """The package's table folders that may serve ``device`` under ``profile``: its own first, then
    those of other GPUs of its architecture (the slug's ``-smXY``), the most similar name first; empty
    where autotuning is off or $SD_KERNELS_SHIPPED_TUNING=0."""
    if not AUTOTUNE or os.environ.get(SHIPPED_ENV, "1") == "0":
        return []
    if profile is None:
        from sd_kernels.profiles import active_profile

        profile = active_profile()
    return device_dirs(SHIPPED_ROOT / profile.name, device_slug(device))


def device_dirs(base: pathlib.Path, slug: str) -> list[pathlib.Path]:
    """``base``'s folder for the GPU named ``slug``, then those of other GPUs of its architecture (the
    slug's ``-smXY``), the most similar name first."""
    arch = slug.rpartition("-")[2]
    others = sorted((p for p in (base.iterdir() if base.is_dir() else ()) if p.is_dir() and p.name != slug
                     and p.name.rpartition("-")[2] == arch), key=lambda p: (-_common_prefix(p.name, slug), p.name))
    return [base / slug, *others]


def _common_prefix(a: str, b: str) -> int:
    return len(os.path.commonprefix([a, b]))


def _version(path: pathlib.Path) -> tuple:
    """A ``triton-<version>`` folder's version, comparable (numbers as numbers)."""
    return tuple(int(p) if p.isdigit() else -1 for p in re.split(r"[.+-]", path.name.removeprefix("triton-")))


def _warn_once(path: pathlib.Path, what: str) -> None:
    if str(path) not in _warned:
        _warned.add(str(path))
        log.warning("sd_kernels: autotune cache %s %s; ignoring it (choices are tuned again)", path, what)


def _ms(value: Any) -> bool:
    """Whether ``value`` is a time a table may hold: a finite positive number."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(float(value)) and value > 0
    except OverflowError:  # an int JSON read past float's range
        return False


def _scalar(value: Any) -> bool:
    """Whether a meta value survives JSON unchanged: bool, int, str, None or a finite float."""
    return (value is None or isinstance(value, (bool, int, str))
            or (isinstance(value, float) and math.isfinite(value)))


class CacheFile:
    """One kernel's persisted choices on one device and Triton version: ``repr(key) -> config``; the
    shipped table that serves the device (``shipped_dirs[0]``: its own folder) and, for keys none of
    them holds, the tables of the other folders (GPUs of its architecture) for the nearest-key rule."""

    def __init__(self, path: pathlib.Path | None, launcher: Any, shipped_dirs: list[pathlib.Path] = ()) -> None:
        self.path, self.launcher, self.shipped_dirs = path, launcher, list(shipped_dirs)
        self.writable = path is not None
        self.entries, self.timings = self._read(path, warn=True) if path is not None else ({}, {})
        self.shipped_path, (self.shipped, self.shipped_timings) = (self._shipped(self.shipped_dirs[0], warn=True)
                                                                   if self.shipped_dirs else (None, ({}, {})))
        self._neighbours: list[Neighbours] | None = None  # the shipped tables'
        self._others: list[tuple[dict, dict]] = []  # the other GPUs' tables: (entries, timings), with _neighbours
        self._mine: tuple[int, list[Neighbours]] | None = None  # with the user's entries: (their count, tables)

    def _read(self, path: pathlib.Path, warn: bool, stale: list | None = None) -> tuple[dict, dict]:
        """(entries, timings) of the file at ``path``: ``repr(key) -> config`` and ``repr(key) -> [[config,
        ms], ...]`` (every config timed for the key at tuning), each config one the kernel has."""
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return {}, {}
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            if warn:
                _warn_once(path, f"is unreadable ({type(exc).__name__}: {exc})")
            return {}, {}
        if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
            if warn:
                _warn_once(path, "is not an autotune cache file")
            return {}, {}
        if data.get("format") != CACHE_FORMAT or data.get("fingerprint") != self.launcher.fingerprint:
            if stale is not None:  # a user's file is simply rewritten; a shipped one says why it is not used
                stale.append(path)
            return {}, {}  # another version of the kernel or of this format: tuned again, then rewritten
        entries = {k: v for k, v in data["entries"].items() if self.launcher.valid_entry(v)}
        if warn and len(entries) < len(data["entries"]):
            _warn_once(path, f"has {len(data['entries']) - len(entries)} entries that match no config")
        # timings are optional: a malformed one is dropped, never the file's entries with it
        found = data.get("timings")
        timings = {k: [(c, float(ms)) for c, ms in v if self.launcher.valid_entry(c) and _ms(ms)]
                   for k, v in (found.items() if isinstance(found, dict) else ())
                   if k in entries and isinstance(v, list) and all(isinstance(r, list) and len(r) == 2 for r in v)}
        return entries, {k: v for k, v in timings.items() if v}

    def _shipped(self, device_dir: pathlib.Path, warn: bool) -> tuple[pathlib.Path | None, tuple[dict, dict]]:
        """(the file, its (entries, timings)) of the table in ``device_dir`` made for the kernel's current source:
        the installed Triton's version first, then the newest other version's (a table names configs
        and keys, which mean the same under any Triton that compiles the kernel)."""
        own = f"triton-{TRITON_VERSION}"
        files = sorted(device_dir.glob(f"triton-*/{self.launcher.name}.json"),
                       key=lambda f: (f.parent.name != own, [-v for v in _version(f.parent)]))
        stale: list[pathlib.Path] = []
        for path in files:
            entries, timings = self._read(path, warn=warn, stale=stale)
            if entries:
                return path, (entries, timings)
        if stale and warn:
            _warn_once(stale[0], "was tuned for another version of the kernel (regenerate: python -m bench.tune)")
        return None, ({}, {})

    def get(self, key: Hashable) -> dict[str, Any] | None:
        name = repr(key)
        return self.entries.get(name) or self.shipped.get(name)

    def best_ms(self, key: Hashable) -> float | None:
        """The fastest config's time at ``key``'s tuning, from the file whose choice serves it (the user's,
        else the shipped table); None where that file holds no timings for it."""
        name = repr(key)
        timed = self.timings.get(name, []) if name in self.entries else self.shipped_timings.get(name, [])
        return min((ms for _, ms in timed), default=None)

    def ties(self, name: str, choice: dict[str, Any]) -> list[dict[str, Any]]:
        """The configs that timed within TIE + TIE_MS of ``choice`` for the key ``name`` (a key's repr) at
        its tuning, fastest first, from the first file that holds the key: this device's, else another
        GPU's of its architecture (where the rule found it); [] where that file holds another choice
        for it, or no timings."""
        if name in self.entries:
            entry, timed = self.entries[name], self.timings.get(name, [])
        elif name in self.shipped:
            entry, timed = self.shipped[name], self.shipped_timings.get(name, [])
        else:
            self.neighbours()  # reads the other GPUs' tables on first use
            entry, timed = next(((e[name], t.get(name, [])) for e, t in self._others if name in e), (None, []))
        if entry != choice:
            return []
        chosen = [ms for config, ms in timed if config == entry]
        if not chosen:
            return []
        limit = chosen[0] * (1 + TIE) + TIE_MS
        return [config for config, ms in sorted(timed, key=lambda row: row[1]) if config != entry and ms <= limit]

    def neighbours(self, mine: bool = True) -> list[Neighbours]:
        """The tables the nearest-key rule searches, in order: this device's (the user's choices, unless
        ``mine`` is False, and the shipped ones), then each other folder's shipped table (read on first
        use)."""
        if self._neighbours is None:
            self._others = [self._shipped(d, warn=False)[1] for d in self.shipped_dirs[1:]]  # (entries, timings)
            self._neighbours = [Neighbours(t) for t in [self.shipped, *(e for e, _ in self._others)] if t]
        if not mine or not self.entries:
            return self._neighbours
        if self._mine is None or self._mine[0] != len(self.entries):  # rebuilt only after a put
            merged = Neighbours({**self.shipped, **self.entries})
            self._mine = (len(self.entries), [merged, *self._neighbours[1 if self.shipped else 0:]])
        return self._mine[1]

    def describe(self) -> str:
        """Which table serves this kernel, for ``sd-kernels info``."""
        if self.shipped_path is not None:
            return f"shipped table {self.shipped_path.relative_to(SHIPPED_ROOT)} ({len(self.shipped)} keys)"
        others = [p for d in self.shipped_dirs[1:] if (p := self._shipped(d, warn=False)[0]) is not None]
        if others:
            return f"no table for this GPU: nearest keys of {others[0].relative_to(SHIPPED_ROOT)}"
        return "no table for this GPU class: each kernel's first config for the call"

    def put(self, key: Hashable, config: dict[str, Any], timings: list[tuple[dict[str, Any], float]] = ()) -> None:
        """Keep ``config`` for ``key`` in the user's file, with ``timings``: (config, ms) of every config
        timed for it."""
        name = repr(key)
        if (not self.writable or " at 0x" in name or len(self.entries) >= MAX_KEYS
                or not all(_scalar(v) for c in (config, *(c for c, _ in timings)) for v in c.values())):
            return  # a key whose repr names an address would never match again; a value JSON changes
        self.entries[name] = dict(config)
        self.timings[name] = [(dict(c), float(ms)) for c, ms in timings if _ms(ms)]
        entries, timings_read = self._read(self.path, warn=False)  # keep what another process wrote meanwhile
        merged = {**entries, **self.entries}
        timed = {k: self.timings.get(k) if k in self.entries else timings_read.get(k) for k in merged}
        data = {"format": CACHE_FORMAT, "kernel": self.launcher.name, "fingerprint": self.launcher.fingerprint,
                "triton": TRITON_VERSION, "entries": merged,
                "timings": {k: [[c, ms] for c, ms in v] for k, v in timed.items() if v}}
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
# What a cache file checks: the kernel it was tuned for


def kernel_fingerprint(jit: Any, layers: list[Any]) -> str:
    """A hash of the kernel's source, the sources of the ``@triton.jit`` helpers it calls (to any
    depth), and its wrappers' (``layers``: autotuners, heuristics) configs and names.

    Each source is taken from its ``def`` line on, without its decorators: what the autotune and
    heuristics layers choose is hashed from the layer objects, and how the JIT specializes integer
    arguments (``do_not_specialize``) changes no result a table records."""
    parts = _jit_sources(jit)
    for layer in layers:
        if isinstance(layer, Autotuner):
            parts += ["autotune", *map(_config_text, layer.configs), *getattr(layer, "keys", ())]
        else:
            parts += ["heuristics", *sorted(layer.values)]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


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
            sources.append(_def_source(py))
        except (OSError, TypeError, SyntaxError):
            sources.append(f"{getattr(py, '__module__', '?')}.{getattr(py, '__qualname__', '?')}")
        for name in getattr(getattr(py, "__code__", None), "co_names", ()):
            value = getattr(py, "__globals__", {}).get(name)
            if isinstance(value, type(jit)):
                visit(value)

    visit(jit)
    return sources


def _def_source(fn: Any) -> str:
    """``fn``'s source from its ``def`` line on (``inspect.getsource`` starts at its first decorator)."""
    lines, _ = inspect.getsourcelines(fn)
    node = ast.parse(textwrap.dedent("".join(lines))).body[0]
    return "".join(lines[node.lineno - 1:])
