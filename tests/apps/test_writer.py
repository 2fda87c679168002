"""Images written off the GPU's path (sd_kernels/apps/writer.py): nothing lost on an error or Ctrl-C, and
the manifest never lists an image whose file is incomplete; a rerun after an interruption makes each
image exactly once."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from PIL import Image

from sd_kernels.apps import cli, manifest, metadata, writer

FIELDS = {"prompt": "p", "negative": None, "seed": 1, "steps": 1, "guidance": 7.5, "width": 8, "height": 8,
          "scheduler": "pndm", "sampler": "PLMS", "model": "tiny", "loras": [], "strength": None, "version": "0"}


def _lines(out) -> list[dict]:
    path = out / manifest.MANIFEST
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _complete(path) -> bool:
    try:
        with Image.open(path) as im:
            im.load()
        return True
    except OSError:
        return False


def test_an_image_that_cannot_be_written_is_a_manifest_error_and_the_others_are_written(tmp_path, monkeypatch):
    real = metadata.encode

    def encode(image, path, fields):
        if path.name == "00001.png":
            raise OSError("No space left on device")
        real(image, path, fields)

    monkeypatch.setattr(metadata, "encode", encode)
    with writer.Writer(tmp_path) as w:
        for i in range(3):
            w.put(np.full((8, 8, 3), i / 3), tmp_path / f"{i:05d}.png", FIELDS, {"index": i, "file": f"{i:05d}.png"})
    assert (w.written, w.failed) == (2, 1) and "No space left" in w.errors[0]
    status = {e["index"]: e["status"] for e in _lines(tmp_path)}
    assert status == {0: "ok", 1: "error", 2: "ok"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["00000.png", "00002.png", manifest.MANIFEST]


def test_an_interrupted_producer_still_gets_every_handed_image_written(tmp_path, monkeypatch):
    """Ctrl-C in the loop that makes images: what the writer already holds is written and listed before
    the interruption goes on (the queue drained by ``with``)."""
    real = metadata.encode

    def slow(image, path, fields):
        time.sleep(0.05)
        real(image, path, fields)

    monkeypatch.setattr(metadata, "encode", slow)
    with pytest.raises(KeyboardInterrupt), writer.Writer(tmp_path, depth=8) as w:
        for i in range(6):
            w.put(np.zeros((8, 8, 3)), tmp_path / f"{i:05d}.png", FIELDS, {"index": i, "file": f"{i:05d}.png"})
        assert w.queue.qsize() > 0  # images still waiting when the interruption comes
        raise KeyboardInterrupt
    assert sorted(e["index"] for e in _lines(tmp_path) if e["status"] == "ok") == list(range(6))
    assert all(_complete(tmp_path / f"{i:05d}.png") for i in range(6))


SLOW_DISK = """
import sys, time
from sd_kernels.apps import cli, metadata
real = metadata.encode
def slow(image, path, fields):  # a disk slower than the pipeline: images wait in the writer's queue
    time.sleep(0.4)
    real(image, path, fields)
metadata.encode = slow
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.integration
@pytest.mark.skipif(os.name == "nt", reason="SIGINT to a child process is POSIX")
def test_sigint_during_a_run_then_a_rerun_makes_every_image_exactly_once(tmp_path, monkeypatch):
    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")  # the plumbing is under test, not the kernels
    prompts = tmp_path / "p.txt"
    prompts.write_text("\n".join(f"prompt {i}" for i in range(8)) + "\n")
    out = tmp_path / "out"
    argv = ["generate", "--prompts", str(prompts), "--out", str(out), "--steps", "1", "--device", "cpu"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen([sys.executable, "-c", SLOW_DISK, *argv], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not _lines(out) and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    child.send_signal(signal.SIGINT)
    _, err = child.communicate(timeout=300)
    assert child.returncode == 130, err[-2000:]
    assert "interrupted" in err
    ok_count = sum(e["status"] == "ok" for e in _lines(out))
    assert f"interrupted: {out} holds {ok_count} finished image(s), listed in manifest.jsonl" in err
    first = _lines(out)
    ok = sorted(e["index"] for e in first if e["status"] == "ok")
    assert 0 < len(ok) < 8, "the interruption came after the run ended: nothing was tested"
    assert all(_complete(out / f"{i:05d}.png") for i in ok)  # listed means complete
    assert not list(out.glob(".*.tmp"))
    assert sorted(int(p.stem) for p in out.glob("*.png")) == ok  # nothing written that is not listed

    assert cli.main(argv) == 0
    done = [e["index"] for e in _lines(out) if e["status"] == "ok"]
    assert sorted(done) == list(range(8))  # each image exactly once over both runs
