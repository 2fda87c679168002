"""Compiling the Triton kernels a call will need in parallel, before the call runs them.

A new process pays Triton's compilation at the first launch of every kernel specialization, one
after the other: for SD1.5 at 512² with CUDA graphs, 57 compilations took 19.0 of the 27.4 s from
``patch(pipe)`` to the first image (H100, ``python -m bench.cold``, 2026-11-23). With this module
the 49 it needs compile ahead, in 5.5 s, and the first image takes 7.6 s (2026-11-24).

``precompile(run, device)`` runs ``run()`` once as a *dry run*: while it runs, a launch that would
compile a kernel is recorded instead (Triton's ``knobs.runtime.jit_cache_hook`` returns True, and the
JIT then neither compiles nor launches it); everything else runs as usual, on whatever the skipped
kernels' outputs hold. Nothing the dry run computes is kept: the caller throws its result away.
Then the recorded specializations compile on a thread pool (``JITFunction.preload`` of the
specialization data Triton serializes for the hook), and the caller's real call finds each kernel
compiled. Triton's compiler spends most of a compilation in native passes and in ptxas, a separate
process, which is what lets threads overlap (measured in docs/results.md).

What keeps the dry run from leaving anything wrong behind:
- the hook records only on the dry run's own thread; other threads compile as usual;
- a kernel whose config is not known yet (no shipped table entry, nothing in the autotune cache)
  is neither launched nor tuned nor remembered (``sd_kernels.runtime.launch.Launcher``; ``dry()`` tells):
  tuning needs real launches, so the real call tunes it as before. Every autotuned kernel of
  ``sd_kernels.ops`` launches through a Launcher: an autotuner run in a dry run would time launches
  the hook skips and keep a config chosen by noise (tests/test_precompile.py checks this);
- no patched module caches a tensor that a Triton kernel computes (Winograd's transformed weights
  are computed with torch);
- if another ``jit_cache_hook`` is set (a profiler, a user's), or the hook or ``preload`` is missing
  from this Triton, or ``SD_KERNELS_PRECOMPILE=0``, there is no dry run and kernels compile at their
  first launch as before.
A compilation that fails in the pool is left to the real call, which compiles the kernel again and
raises what it raises.

Triton holds the interpreter's lock for most of a compilation (its front end and MLIR passes), so the
threads overlap little besides ptxas: 52 kernels, about 80 s summed, take 7.5-10 s on 16 threads
(SD1.5 512², H200). Opt-in, ``SD_KERNELS_COMPILE_PROCESSES=N`` starts N compiler processes when a patch
installs its CUDA graphs (compile_pool.py); each precompile then shares its kernels between the threads
and the processes that are ready, which compile into Triton's disk cache for the threads to load (the
worker's compilation is checked on CPU against Triton's own preload: tests/test_compile_worker.py).
Off by default: on an H200 they did not shorten a new size's first image beyond the run-to-run spread
and lengthened the first image (compile_pool.py has the figures).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from . import compile_pool

log = logging.getLogger(__name__)
ENV = "SD_KERNELS_PRECOMPILE"
MAX_THREADS = 16
_local = threading.local()  # .todo: {(kernel id, specialization data): (kernel, data)} during a dry run


@dataclasses.dataclass
class Report:
    """What a precompile did: specializations the dry run recorded, compiled in the pool, failed there."""

    recorded: int
    compiled: int
    failed: int
    threads: int
    dry_s: float
    compile_s: float
    processes: int = 0  # compiler processes that compiled any of them (compile_pool.py; 0: threads alone)


def dry() -> bool:
    """Whether this thread is in a dry run (launches that need a kernel not yet tuned are skipped)."""
    return getattr(_local, "todo", None) is not None


def unavailable() -> str | None:
    """Why there can be no dry run here, or None."""
    if os.environ.get(ENV, "1") == "0":
        return f"{ENV}=0"
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return "the Triton interpreter compiles nothing"
    try:
        from triton import knobs
        from triton.runtime.jit import JITFunction
    except ImportError as exc:
        return f"this Triton has no knobs ({exc})"
    if not hasattr(knobs.runtime, "jit_cache_hook") or not hasattr(JITFunction, "preload"):
        return "this Triton has no jit_cache_hook or JITFunction.preload"
    if knobs.runtime.jit_cache_hook is not None:
        return "another jit_cache_hook is set"
    return None


def _hook(*, fn: Any = None, compile: Any = None, **_: Any) -> bool:
    """Triton's jit_cache_hook: True (skip: neither compile nor launch) for what a dry run records."""
    todo = getattr(_local, "todo", None)
    if todo is None:
        return False
    data = compile.get("specialization_data") if isinstance(compile, dict) else None
    jit = getattr(fn, "jit_function", None)
    if not isinstance(data, str) or not callable(getattr(jit, "preload", None)):
        return False  # compile it now, as without a dry run
    todo.setdefault((id(jit), data), (jit, data))
    return True


def precompile(run: Callable[[], Any], device: Any = None) -> Report | None:
    """Dry-run ``run()`` and compile what it would have compiled, on up to MAX_THREADS threads; None
    when there can be no dry run (``unavailable()``). ``device``: the CUDA device the kernels run on."""
    why = unavailable()
    if why is not None:
        log.debug("sd_kernels: no parallel precompile: %s", why)
        return None
    from triton import knobs

    if device is not None and str(device).startswith("cpu"):  # a model on the CPU: no CUDA device to sync or set
        device = None

    start = time.perf_counter()
    _local.todo = {}
    knobs.runtime.jit_cache_hook = _hook
    try:
        run()
    finally:
        todo, _local.todo = _local.todo, None
        knobs.runtime.jit_cache_hook = None  # it was None before (unavailable() checked)
    if device is not None:
        import torch

        torch.cuda.synchronize(device)  # the dry run's own launches, before the timer reads
    dry_s = time.perf_counter() - start
    items = sorted(todo.values(), key=lambda item: -len(getattr(item[0], "src", "")))  # the longest first
    threads = max(1, min(len(items), os.cpu_count() or 1, MAX_THREADS))
    start = time.perf_counter()
    errors, processes = _compile(items, threads, device) if items else ([], 0)
    failed = len(errors)
    if errors:
        log.info("sd_kernels: %d of %d kernels did not compile ahead (the call compiles them): %s",
                 failed, len(items), errors[0])
    report = Report(len(items), len(items) - failed, failed, threads, round(dry_s, 3),
                    round(time.perf_counter() - start, 3), processes)
    log.info("sd_kernels: compiled %d kernels on %d threads%s in %.1f s (dry run %.2f s)", report.compiled,
             threads, f" and {processes} processes" if processes else "", report.compile_s, dry_s)
    return report


class _Queue:
    """The kernels left to compile, taken by the threads and the compiler processes' drivers alike."""

    def __init__(self, items: list) -> None:
        self.items, self.lock = list(items), threading.Lock()

    def __call__(self, peek: bool = False) -> Any:
        with self.lock:
            return None if not self.items else self.items[0] if peek else self.items.pop(0)


def _compile(items: list[tuple[Any, str]], threads: int, device: Any) -> tuple[list[str], int]:
    """Compile ``items`` on ``threads`` threads and the ready compiler processes (compile_pool.py);
    (the errors, how many processes compiled any)."""
    take, errors = _Queue(items), []
    workers, target = compile_pool.start(), None
    if workers:
        try:
            target = compile_pool.target_of_device(device)
        except Exception as exc:  # the threads compile everything, as without processes
            log.info("sd_kernels: no compiler processes for this precompile (%s: %s)", type(exc).__name__, exc)
            workers = []
    until = time.monotonic() + compile_pool.READY_TIMEOUT_S

    def load(item: tuple[Any, str]) -> None:
        error = _preload(item)
        if error is not None:
            errors.append(error)

    def drain() -> None:
        while (item := take()) is not None:
            load(item)

    with ThreadPoolExecutor(threads + len(workers), thread_name_prefix="sd-kernels-compile",
                            initializer=_on_device, initargs=(device,)) as pool:
        driven = [pool.submit(compile_pool.drive, w, take, load, target, until) for w in workers]
        for future in [pool.submit(drain) for _ in range(threads)]:
            future.result()
        processes = sum(f.result() > 0 for f in driven)
    return errors, processes


def start_workers() -> None:
    """Start the compiler processes ``SD_KERNELS_COMPILE_PROCESSES`` asks for, ahead of the first
    precompile (a patch calls it when it installs CUDA graphs); nothing where there is no dry run."""
    if unavailable() is None:
        compile_pool.start()


def _on_device(device: Any) -> None:
    if device is not None:
        import torch

        torch.cuda.set_device(device)


def _preload(item: tuple[Any, str]) -> str | None:
    jit, data = item
    try:
        jit.preload(data)
    except Exception as exc:  # the real call compiles it and reports what is wrong
        return f"{getattr(jit, '__name__', jit)}: {type(exc).__name__}: {exc}"
    return None
