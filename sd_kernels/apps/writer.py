"""Images encoded and written off the GPU's path: a thread of its own takes each finished image from a
bounded queue, encodes it with its records (PNG: zlib, which releases the GIL), writes it to a
temporary file renamed into place, and only then appends its manifest line. The pipeline's next call
runs meanwhile; when the queue is full (the disk slower than the GPU), ``put`` waits, so memory stays
bounded.

Nothing is lost and nothing is claimed that is not there: ``close`` (also on an error or Ctrl-C in
the caller, through ``with``) writes every image already handed over before it returns; a manifest
line that says "ok" follows a complete file; an image that cannot be written is a manifest line with
its error. A process killed outright loses at most the images in the queue, which the manifest does
not list, so a rerun makes them.
"""

from __future__ import annotations

import logging
import pathlib
import queue
import threading
import time
from typing import Any

from sd_kernels.apps import manifest, metadata

log = logging.getLogger(__name__)

DEPTH = 8  # images waiting to be written, at most


class Writer:
    """``put(image, path, fields, entry)``: write ``image`` with the records of ``fields`` to ``path``,
    then append ``entry`` (with its status) to the manifest of ``out`` (None: no manifest)."""

    def __init__(self, out: pathlib.Path | None, depth: int = DEPTH) -> None:
        self.out = out
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.written = 0
        self.failed = 0
        self.errors: list[str] = []
        self.busy_s = 0.0  # seconds the thread spent encoding and writing
        self._thread = threading.Thread(target=self._loop, name="sd_kernels-image-writer", daemon=True)
        self._thread.start()

    def put(self, image: Any, path: pathlib.Path, fields: dict[str, Any], entry: dict[str, Any] | None) -> None:
        if not self._thread.is_alive():
            raise RuntimeError("the image writer has stopped")
        self.queue.put((image, path, fields, entry))

    def _loop(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            image, path, fields, entry = item
            t = time.perf_counter()
            try:
                metadata.encode(image, path, fields)
                status = {"status": "ok"}
                self.written += 1
            except Exception as exc:  # a full disk, a vanished folder: this image fails, the run goes on
                status = {"status": "error", "error": f"writing {path.name}: {type(exc).__name__}: {exc}"}
                self.failed += 1
                self.errors.append(status["error"])
                log.warning("sd_kernels: generate: %s", status["error"])
            if entry is not None and self.out is not None:
                try:
                    manifest.append(self.out, {**entry, **status})
                except OSError as exc:  # the image is there but unlisted: a rerun makes it again
                    self.errors.append(f"manifest: {type(exc).__name__}: {exc}")
                    log.warning("sd_kernels: generate: cannot append to the manifest: %s", exc)
            self.busy_s += time.perf_counter() - t

    def close(self) -> None:
        """Write everything handed over, then stop the thread."""
        if self._thread.is_alive():
            self.queue.put(None)
            self._thread.join()

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
