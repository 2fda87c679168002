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
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Hashable
from typing import Any

from triton.runtime.autotuner import Autotuner, Heuristics

log = logging.getLogger("sd_kernels")

# SD_KERNELS_AUTOTUNE=0: every autotuned kernel takes its first listed config instead of timing them
# all (GPU test runs, where only correctness matters and autotuning costs minutes).
AUTOTUNE = os.environ.get("SD_KERNELS_AUTOTUNE", "1") != "0"
# SD_KERNELS_FAST_LAUNCH=0: memoized launches go through Triton's JITFunction.run, not the direct path
# (read here once; code may also set launch.FAST_LAUNCH, as bench.overhead does to compare the two).
FAST_LAUNCH = os.environ.get("SD_KERNELS_FAST_LAUNCH", "1") != "0"
MAX_KEYS = 4096  # a bound on the memo: past it, it starts over (each key costs one slow launch)
_MISSING = object()


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

    def __call__(self, key: Hashable, grid: Callable | tuple, *args: Any, **kwargs: Any) -> None:
        meta = self.memo.get(key)
        if meta is not None:
            if FAST_LAUNCH and self._direct is not None and self._launch_direct(key, meta, grid, args, kwargs):
                return
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


def cdiv(a: int, b: int) -> int:
    """⌈a / b⌉ for the host side (``triton.cdiv`` is a constexpr function: ~1 µs a call there)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two ≥ n (1 for n ≤ 1), like ``triton.next_power_of_2``, in plain Python."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
