"""The direct launch path (the third of ``sd_kernels.runtime.launch.Launcher``'s jobs; ``SD_KERNELS_FAST_LAUNCH``,
on by default, read in launch.py).

Even with the meta-parameters known, ``JITFunction.run`` costs ~20 µs a launch beyond its argument
binder (its cache key formats the compile options as a string, it builds launch metadata for hooks
that are empty). After a key's
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
from collections.abc import Callable, Hashable
from typing import Any

from .autotune_cache import MAX_KEYS

log = logging.getLogger(__name__)
_MISSING = object()


class DirectPath:
    """One launcher's direct path: ``table`` maps (key, device, specialization) to what launching the
    compiled kernel needs; None once the path is off for this launcher (interpreter, or structures it
    cannot use)."""

    def __init__(self, jit: Any) -> None:
        self.jit = jit
        self.table: dict[Hashable, tuple] | None = {}
        self.kernels: set[tuple] = set()  # (device, specialization, options) of every kernel in ``table``
        self._runtime: tuple | None = None  # (triton's driver, knobs.runtime, knobs.compilation)

    def compiled(self, meta: dict[str, Any], args: tuple, kwargs: dict[str, Any]) -> bool:
        """Whether a call on ``args`` with the meta-parameters ``meta`` would launch a kernel this path
        already launched (the same device, specialization and options; the debug and instrumentation
        knobs are not compared): False where the path is off, has launched nothing (``kernels`` is
        filled by direct launches only: not with SD_KERNELS_FAST_LAUNCH=0 or a launch hook set) or
        cannot tell. Triton's binder runs once (native code, microseconds)."""
        if not self.kernels or self.table is None:
            return False
        runtime = self._runtime or self._set_up()
        if runtime is None:
            return False
        device = runtime[0].active.get_current_device()
        caches = self.jit.device_caches.get(device)
        if caches is None or len(caches) != 5:
            return False
        try:
            _, specialization, options = caches[4](*args, **kwargs, **meta)
            return (device, tuple(specialization), repr(options)) in self.kernels
        except Exception:  # arguments the binder refuses, unhashable options: cannot tell
            return False

    def launch(self, key: Hashable, meta: dict[str, Any], grid: Callable | tuple, args: tuple,
               kwargs: dict[str, Any]) -> bool:
        """Launch a memoized key: directly when its specialization has a table entry, else through
        ``JITFunction.run``, keeping the kernel it returns. False: the caller launches the usual way
        (hooks set, a device or arguments the binder refuses: ``run`` then does what it does)."""
        runtime = self._runtime or self._set_up()
        table = self.table  # None once turned off (another thread may have)
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
                self.turn_off(f"the compiled kernel's run refused the call ({exc})")
                return False
            return True
        kernel = jit.run(*args, grid=grid, warmup=False, **kwargs, **meta)
        self._remember(table, direct_key, kernel, meta, knobs, options)
        return True

    def _set_up(self) -> tuple | None:
        """Check, once per launcher, that the JIT function and Triton have what the direct path reads."""
        jit = self.jit
        if type(jit).__name__ == "InterpretedFunction":  # TRITON_INTERPRET: nothing compiled to call
            self.table = None
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
            self.turn_off(exc)
            return None
        self._runtime = (driver, run_knobs, compile_knobs)
        return self._runtime

    def _remember(self, table: dict, direct_key: tuple, kernel: Any, meta: dict[str, Any], knobs: tuple,
                  options: dict[str, Any]) -> None:
        """Keep what ``JITFunction.run`` returned for a direct launch of the same specialization."""
        compiled = getattr(self.jit, "CompiledKernel", None)  # set by the JIT's create_binder
        if compiled is None:
            self.turn_off("the JIT function has no CompiledKernel class")
            return
        if not isinstance(kernel, compiled):  # None (a compile hook skipped it), an async compile's future
            return
        try:
            # The kernel itself stays referenced: its module is unloaded when it is freed.
            entry = (kernel, kernel.run, kernel.function, kernel.packed_metadata, meta, knobs, options)
            if not callable(entry[1]) or entry[2] is None:
                raise TypeError("the compiled kernel has no loaded function")
        except Exception as exc:
            self.turn_off(exc)
            return
        if len(table) >= MAX_KEYS:
            table.clear()
            self.kernels.clear()
        table[direct_key] = entry
        self.kernels.add((direct_key[1], direct_key[2], repr(options)))

    def turn_off(self, why: object) -> None:
        self.table = None
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
