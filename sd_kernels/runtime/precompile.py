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
(SD1.5 512², H200). Opt-in, ``SD_KERNELS_COMPILE_PROCESSES=1``: where a dry run records many kernels
(``PROCESS_MIN``: a new process's first graph), they first compile in worker processes
(compile_worker.py, each a share of them, no GPU) into Triton's disk cache, from which the threads then
load them; a kernel a worker could not compile the threads compile as before. Off by default: its one
GPU measurement ran a worker that refused every kernel (Triton 3.6 names kernels module.qualname), so
the threads compiled everything after the workers had started (first image 24 s against 11.5 s); fixed
and checked on CPU against Triton's own preload (tests/test_compile_worker.py), not yet measured.
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

log = logging.getLogger(__name__)
ENV = "SD_KERNELS_PRECOMPILE"
PROCESS_ENV = "SD_KERNELS_COMPILE_PROCESSES"
MAX_THREADS = 16
PROCESS_MIN = 24  # kernels a dry run records before worker processes pay their start (~2-3 s: torch's import)
PROCESS_TIMEOUT_S = 300.0
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
    processes: int = 0  # worker processes that compiled ahead of the threads (0: threads alone)


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
    items = list(todo.values())
    threads = max(1, min(len(items), os.cpu_count() or 1, MAX_THREADS))
    start = time.perf_counter()
    processes = _in_processes(items, threads) if len(items) >= PROCESS_MIN else 0
    failed = 0
    if items:
        with ThreadPoolExecutor(threads, thread_name_prefix="sd-kernels-compile",
                                initializer=_on_device, initargs=(device,)) as pool:
            errors = [e for e in pool.map(_preload, items) if e is not None]
        failed = len(errors)
        if errors:
            log.info("sd_kernels: %d of %d kernels did not compile ahead (the call compiles them): %s",
                     failed, len(items), errors[0])
    report = Report(len(items), len(items) - failed, failed, threads, round(dry_s, 3),
                    round(time.perf_counter() - start, 3), processes)
    log.info("sd_kernels: compiled %d kernels on %d %s in %.1f s (dry run %.2f s)", report.compiled,
             processes or threads, "processes" if processes else "threads", report.compile_s, dry_s)
    return report


def _in_processes(items: list[tuple[Any, str]], workers: int) -> int:
    """Compile ``items`` into Triton's disk cache in up to ``workers`` processes; how many ran (0 where
    none could: switched off, no disk cache, the target unknown)."""
    try:
        from triton import knobs
        from triton.runtime import driver

        if os.environ.get(PROCESS_ENV, "0") != "1" or knobs.compilation.always_compile or not knobs.cache.dir:
            return 0
        target = driver.active.get_current_target()
        longest_first = sorted(items, key=lambda item: -len(getattr(item[0], "src", "")))  # shares alike
        jobs = [(jit.fn.__module__, jit.fn.__qualname__, data) for jit, data in longest_first]
        workers = min(workers, -(-len(jobs) // 3))  # at least three kernels a worker: each pays an import
        errors = compile_in_processes(jobs, (target.backend, target.arch, target.warp_size), workers,
                                      knobs.cache.dir)
    except Exception as exc:  # the threads compile everything, as without workers
        log.info("sd_kernels: no compiler processes (%s: %s)", type(exc).__name__, exc)
        return 0
    if errors:  # each costs the time it waited for the workers
        log.warning("sd_kernels: %d of %d kernels did not compile in the worker processes (the threads compile "
                    "them): %s", len(errors), len(items), errors[0])
    return workers


def compile_in_processes(jobs: list[tuple[str, str, str]], target: tuple, workers: int,
                         cache_dir: str, timeout_s: float = PROCESS_TIMEOUT_S) -> list[str]:
    """Compile ``jobs`` ((module, kernel name, specialization data)) for ``target`` ((backend, arch,
    warp size)) into the Triton disk cache ``cache_dir``, on ``workers`` processes of
    compile_worker.py; the errors (a job not done, a worker that failed or took over ``timeout_s``)."""
    import json
    import subprocess
    import sys

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TRITON_CACHE_DIR": str(cache_dir), "OMP_NUM_THREADS": "1",
           "TRITON_INTERPRET": "0", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    shares = [jobs[i::workers] for i in range(workers)]  # the caller lists the longest sources first
    procs = []
    for share in shares:
        proc = subprocess.Popen([sys.executable, "-m", "sd_kernels.runtime.compile_worker"], env=env, text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        proc.stdin.write(json.dumps({"target": list(target), "jobs": share}))
        proc.stdin.close()
        procs.append(proc)
    deadline, errors = time.monotonic() + timeout_s, []
    for proc, share in zip(procs, shares):
        try:  # its stdin is closed and its one line of output fits the pipe: waiting cannot block it
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            lines = proc.stdout.read().strip().splitlines()
            errors += json.loads(lines[-1])["errors"] if proc.returncode == 0 and lines else [
                f"a worker exited with {proc.returncode} ({len(share)} kernels)"]
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            errors.append(f"a worker took over {timeout_s:.0f} s ({len(share)} kernels)")
        finally:
            proc.stdout.close()
    return errors


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
