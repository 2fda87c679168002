"""The output folder of a batch run: ``manifest.jsonl`` (one JSON object per image, appended as each
is written or fails) and the lock that keeps two runs out of one folder.

- **Reading never blocks a rerun.** A line cut short by a crash (even inside a multi-byte UTF-8
  character), a line that is not a JSON object or has fields of the wrong type: skipped, with one
  warning naming the file and the lines; their images are made again.
- **Appending never glues lines.** A run first ends a last line that lacks its newline, then each
  entry is one ``write`` of a whole line to the file opened for appending (the processes of one run
  share it).
- **One run per folder.** The main process of a run holds an exclusive lock on ``.generate.lock`` in
  the folder (``fcntl.flock``; ``msvcrt.locking`` on Windows) from before it reads the manifest until
  the run ends; a second run on the same folder stops at once with an error naming the first one's
  process. The operating system drops the lock when its process dies, so a crash leaves nothing to
  clean up. On a network file system, whether locks reach other machines depends on its set-up.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import tempfile
from collections.abc import Iterable
from typing import Any

log = logging.getLogger(__name__)

MANIFEST = "manifest.jsonl"
LOCK = ".generate.lock"


def check(out: pathlib.Path) -> None:
    """Create ``out`` if needed and make sure the images and the manifest can be written there (before
    any model is built)."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: is a file; batch generation writes into a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".write-test-"):
            pass
    except OSError as exc:
        raise ValueError(f"--out {out}: cannot write there ({type(exc).__name__}: {exc})") from None
    path = out / MANIFEST
    if path.exists() and not path.is_file():
        raise ValueError(f"--out {out}: {path} is not a file; the run records its images there")
    if path.exists() and not os.access(path, os.R_OK | os.W_OK):
        raise ValueError(f"--out {out}: {path} cannot be read and written")


def _valid(entry: Any) -> bool:
    """Whether a manifest line has the types a rerun reads: an object with an integer index and
    string status and file."""
    return (isinstance(entry, dict) and type(entry.get("index")) is int and entry["index"] >= 0
            and isinstance(entry.get("status"), str) and isinstance(entry.get("file", ""), str))


def read(out: pathlib.Path) -> list[dict[str, Any]]:
    """The manifest's entries; lines that cannot be read are skipped with one warning."""
    path = out / MANIFEST
    if not path.is_file():
        return []
    entries, bad = [], []
    for n, raw in enumerate(path.read_bytes().split(b"\n"), 1):
        if not raw.strip():
            continue
        try:
            entry = json.loads(raw.decode("utf-8"))
        except ValueError:  # UnicodeDecodeError is one
            entry = None
        if _valid(entry):
            entries.append(entry)
        else:
            bad.append(n)
    if bad:
        shown = ", ".join(map(str, bad[:10])) + (f" and {len(bad) - 10} more" if len(bad) > 10 else "")
        log.warning("sd_kernels: generate: %s: skipped %d unreadable line(s) (line %s); the images they list are "
                    "made again", path, len(bad), shown)
    return entries


def end_last_line(out: pathlib.Path) -> None:
    """Give the manifest's last line its newline if a crash left it without one, so that the next entry
    starts a line of its own."""
    path = out / MANIFEST
    if not path.is_file() or path.stat().st_size == 0:
        return
    with open(path, "rb+") as f:
        f.seek(-1, os.SEEK_END)
        if f.read(1) != b"\n":
            f.write(b"\n")


def append(out: pathlib.Path, entry: dict[str, Any]) -> None:
    """One manifest line, in one write to a file opened for appending (processes share the file)."""
    data = (json.dumps(entry, ensure_ascii=False) + "\n").encode()
    fd = os.open(out / MANIFEST, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


# Settings an entry of an earlier sd-kernels lacks, read as the value its images were made with.
_UNRECORDED = {"precision": "fp16"}  # before --precision every image was made lossless


def done(out: pathlib.Path, jobs: Iterable[Any], identity: dict[str, Any], same: Iterable[str],
         entries: list[dict[str, Any]] | None = None) -> set[int]:
    """Indices of ``jobs`` whose image the manifest lists as written with the same ``same`` fields
    (``identity`` and the job's own), with the file still there; ``entries``: the manifest as ``read`` gave it."""
    ok = {e["index"]: e for e in (read(out) if entries is None else entries) if e["status"] == "ok"}
    found = set()
    for job in jobs:
        entry = ok.get(job.index)
        if entry is None or not (out / job.file).is_file():
            continue
        want = {**identity, **job_fields(job)}
        if all(entry.get(k, _UNRECORDED.get(k)) == want.get(k) for k in same):
            found.add(job.index)
    return found


def finished(out: pathlib.Path, entries: list[dict[str, Any]]) -> set[int]:
    """Indices of the images the manifest (``entries``, as ``read`` gave them) lists as written, their file in
    ``out`` still there (a rerun appends lines: an index may be listed more than once)."""
    return {e["index"] for e in entries if e["status"] == "ok" and e.get("file") and (out / str(e["file"])).is_file()}


def beyond(out: pathlib.Path, jobs: Iterable[Any], entries: list[dict[str, Any]]) -> list[int]:
    """Indices of images the manifest (``entries``) lists as written in ``out`` that this run's ``jobs`` do not
    make (an earlier run with more prompts or images per prompt): they stay, with their own settings."""
    return sorted(finished(out, entries) - {job.index for job in jobs})


def job_fields(job: Any) -> dict[str, Any]:
    """What a manifest line records of one image's own settings."""
    return {"index": job.index, "file": job.file, "prompt": job.prompt, "negative": job.negative, "seed": job.seed,
            "width": job.width, "height": job.height, "steps": job.steps, "guidance": job.guidance}


class Lock:
    """An exclusive lock on ``out/.generate.lock`` for one run (see the module docstring)."""

    def __init__(self, out: pathlib.Path) -> None:
        self.path = out / LOCK
        self.fd: int | None = None

    def __enter__(self) -> Lock:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            _lock(fd)
        except OSError:
            holder = os.read(fd, 64).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)
            raise ValueError(f"--out {self.path.parent}: another run is writing there (process {holder} holds "
                             f"{self.path}); wait for it to end, or give another --out") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            _unlock(self.fd)
            os.close(self.fd)
            self.fd = None


if os.name == "nt":  # pragma: no cover - exercised on Windows only
    import msvcrt

    def _lock(fd: int) -> None:
        msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)

    def _unlock(fd: int) -> None:
        os.lseek(fd, 0, os.SEEK_SET)
        msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)
else:
    import fcntl

    def _lock(fd: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)

    def _unlock(fd: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_UN)
