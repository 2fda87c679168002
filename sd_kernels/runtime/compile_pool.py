"""Compiler processes that outlive one precompile (opt-in: ``SD_KERNELS_COMPILE_PROCESSES=N``).

Triton's compilations in threads serialize on the interpreter lock (precompile.py). Worker processes
(compile_worker.py) compile in parallel, but each pays an interpreter start and the import of torch,
Triton and the kernels' modules (seconds) before its first kernel. So the workers start when a patch
installs its CUDA graphs (``start``), before the first capture's dry run needs them, and stay for the
life of the process, at a lower CPU priority (``nice`` 10): a later new size hands them its kernels
with nothing to import. Each process of a program that patches (each rank under torchrun) starts its
own N workers.

Off by default: measured on an H200 (16 cores; bench/results/2026-11-28-h200-compile-processes), they
did not shorten a new size's first image beyond the run-to-run spread and lengthened the first
image (SD1.5 512²: 9.7 s without, 10.9 s with 8 started at the patch, 17.8 s with 8 started after
the process's first precompile, which is the text encoder's: their imports then ran beside the
UNet's precompile).

A precompile shares its kernels between its threads and the workers that have said they are ready
(``Worker.compile`` per kernel; the thread that fed the worker then loads the kernel from Triton's
disk cache); a worker that is not ready yet takes nothing, and one that fails, hangs or dies is
stopped and its kernel compiled by a thread, so a kernel is never waited for longer than without the
workers plus ``JOB_TIMEOUT_S``. Workers need Triton's disk cache (they write where the threads read).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
from typing import Any

log = logging.getLogger(__name__)
ENV = "SD_KERNELS_COMPILE_PROCESSES"
MAX_WORKERS = 16
JOB_TIMEOUT_S = 120.0
READY_TIMEOUT_S = 120.0
WARM_MODULES = ("sd_kernels.ops",)  # what a worker imports before it says ready: every kernel module


def requested() -> int:
    """How many workers ``SD_KERNELS_COMPILE_PROCESSES`` asks for (unset: 0), capped at the cores and
    MAX_WORKERS; a value that is not a count raises."""
    value = os.environ.get(ENV, "0").strip() or "0"
    if not value.isdigit():
        raise ValueError(f"{ENV}={value!r}: give a number of worker processes (0: none)")
    return min(int(value), os.cpu_count() or 1, MAX_WORKERS)


class Worker:
    """One compiler process (compile_worker.py), driven by one thread at a time."""

    def __init__(self, cache_dir: str, command: list[str] | None = None) -> None:
        """``command``: what runs instead of compile_worker.py (tests: a stand-in speaking its protocol)."""
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TRITON_CACHE_DIR": str(cache_dir), "OMP_NUM_THREADS": "1",
               "TRITON_INTERPRET": "0", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        command = command or [sys.executable, "-m", "sd_kernels.runtime.compile_worker", *WARM_MODULES]
        self.proc = subprocess.Popen(command, env=env, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL)
        self.ready = False
        self.dead = False
        self.busy = threading.Lock()  # one driving thread at a time

    def _line(self, timeout: float) -> str | None:
        """The worker's next line; "" if it ended (its output closed), None if no line came within
        ``timeout`` s."""
        if not select.select([self.proc.stdout], [], [], max(0.0, timeout))[0]:
            return None
        return self.proc.stdout.readline()  # "" at the end of its output

    def _ended(self) -> str:
        """Why a worker whose output closed is gone (waiting a moment for its exit status)."""
        try:
            return f"exited with {self.proc.wait(timeout=5)}"
        except subprocess.TimeoutExpired:
            return "closed its output"

    def poll_ready(self, timeout: float = 0.0) -> bool:
        """Whether it has said it is ready (waiting up to ``timeout`` s for it to)."""
        if not self.ready and not self.dead:
            line = self._line(timeout)
            if line == "":
                self.stop(f"{self._ended()} before it was ready")
            elif line is not None:
                self.ready = line.strip() == '"ready"'
                if not self.ready:
                    self.stop(f"said {line.strip()[:80]!r} instead of ready")
        return self.ready

    def compile(self, job: list, timeout: float = JOB_TIMEOUT_S) -> str | None:
        """Compile one job ([module, name, data, target]); None when done, else why not (a worker that
        did not answer in time, or ended, is stopped)."""
        try:
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()
        except OSError as exc:
            return self.stop(f"could not take a job ({exc})")
        line = self._line(timeout)
        if line is None:
            return self.stop(f"gave no answer within {timeout:.0f} s")
        if line == "":
            return self.stop(self._ended())
        try:
            answer = json.loads(line)
        except ValueError:
            return self.stop(f"answered {line.strip()[:80]!r}")
        if not isinstance(answer, dict):
            return self.stop(f"answered {line.strip()[:80]!r}")
        return None if answer.get("ok") is True else str(answer.get("error", answer))

    def stop(self, why: str = "stopped") -> str:
        """End the process; ``why`` is returned (and logged once)."""
        if not self.dead:
            self.dead = True
            log.info("sd_kernels: a compiler process %s; the threads compile without it", why)
            for close in (self.proc.stdin.close, self.proc.kill, self.proc.wait, self.proc.stdout.close):
                try:
                    close()
                except OSError:
                    pass
        return why


_workers: list[Worker] = []
_lock = threading.Lock()


def start() -> list[Worker]:
    """Start the requested workers, once per process (no-op when none are requested or without Triton's
    disk cache; callers come through precompile.py, which has no dry run under the interpreter); the
    live ones."""
    with _lock:
        if not _workers:
            count = requested()
            cache_dir = _cache_dir() if count else None
            if cache_dir:
                _workers.extend(Worker(cache_dir) for _ in range(count))
                atexit.register(shutdown)
                log.info("sd_kernels: started %d compiler processes", count)
    return live()


def live() -> list[Worker]:
    """The workers started and not stopped (none are started here)."""
    with _lock:
        return [w for w in _workers if not w.dead]


def _cache_dir() -> str | None:
    from triton import knobs

    if knobs.compilation.always_compile:  # nothing would be read from the disk cache
        return None
    return knobs.cache.dir or None


def shutdown() -> None:
    """End every worker (at exit; tests)."""
    with _lock:
        for worker in _workers:
            if not worker.dead:
                try:
                    worker.proc.stdin.close()  # it exits at the end of its input
                    worker.proc.wait(timeout=5)
                except (OSError, subprocess.TimeoutExpired):
                    pass
                worker.stop("ended with the process")
        _workers.clear()


def target_of_device(device: Any = None) -> list:
    """The Triton target of ``device`` (None: the current one) as the workers take it: [backend, arch,
    warp size]. The caller's current device is left as it was."""
    import contextlib

    from triton.runtime import driver

    if device is None:
        scope = contextlib.nullcontext()
    else:
        import torch

        scope = torch.cuda.device(device)
    with scope:
        target = driver.active.get_current_target()
    return [target.backend, target.arch, target.warp_size]


def drive(worker: Worker, take: Any, load: Any, target: list, until: float) -> int:
    """Feed ``worker`` jobs from ``take()`` (an item, or None when none are left) until none are left:
    each compiled item is then loaded with ``load(item)`` in this thread; an item the worker could not
    compile is loaded (compiled) here too. Waits for the worker to be ready while items remain, up to
    ``until`` (monotonic). How many it compiled."""
    done = 0
    if not worker.busy.acquire(blocking=False):
        return 0
    try:
        while not worker.poll_ready(0.05):
            if worker.dead or time.monotonic() > until:
                return done
            item = take(peek=True)
            if item is None:
                return done
        while (item := take()) is not None:
            jit, data = item
            error = worker.compile([jit.fn.__module__, jit.fn.__qualname__, data, target]) if not worker.dead \
                else "the worker stopped"
            done += error is None
            if error is not None:
                log.debug("sd_kernels: %s", error)
            load(item)
        return done
    finally:
        worker.busy.release()
