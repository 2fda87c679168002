"""Batch generation (sd_kernels/apps/generate.py, `sd-kernels generate --prompts`): images and manifest,
resume, failures recorded, errors before work, and the same images from one process or two (torchrun,
which `accelerate launch` uses for several processes; on CPU, gloo)."""

import functools
import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from sd_kernels import models
from sd_kernels.apps import generate, metadata, options
from sd_kernels.apps.cli import main

PROMPTS = ["a red cube", "a blue sphere", "boom", "a green cone", "a yellow torus"]


@pytest.fixture(autouse=True)
def reference_ops(monkeypatch):
    """This is about the plumbing: the ops' PyTorch reference, not kernels through the interpreter (the
    tests patch with ``monkeypatch.context()``: an ``undo()`` would drop this setting too)."""
    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(PROMPTS[:2]) + "\n\n  \n" + "\n".join(PROMPTS[2:]) + "\n")
    return path


def _manifest(out: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (out / generate.MANIFEST).read_text().splitlines()]


def _pixels(out: pathlib.Path) -> dict[str, np.ndarray]:
    return {p.name: np.asarray(Image.open(p)) for p in sorted(out.glob("*.png"))}


def test_read_prompts_skips_blank_lines_and_refuses_empty_or_missing_files(prompts_file, tmp_path):
    assert [s.prompt for s in options.read_prompts(prompts_file)] == PROMPTS
    (tmp_path / "empty.txt").write_text("\n \n")
    with pytest.raises(ValueError, match="no prompts"):
        options.read_prompts(tmp_path / "empty.txt")
    with pytest.raises(ValueError, match="cannot read"):
        options.read_prompts(tmp_path / "missing.txt")


def test_images_manifest_metadata_and_resume(tmp_path, monkeypatch, caplog):
    out = tmp_path / "images"
    summary = generate.generate_images(PROMPTS[:3], out, steps=2, seed=7, progress=False)
    assert (summary.written, summary.failed, summary.skipped, summary.exit_code) == (3, 0, 0, 0)
    entries = _manifest(out)
    assert [(e["index"], e["prompt"], e["seed"], e["status"]) for e in entries] == [
        (i, p, 7 + i, "ok") for i, p in enumerate(PROMPTS[:3])]
    assert {e["file"] for e in entries} == set(_pixels(out)) == {"00000.png", "00001.png", "00002.png"}
    meta = metadata.read(out / "00001.png")["sd-kernels"]
    assert (meta["prompt"], meta["seed"], meta["model"], meta["steps"]) == (PROMPTS[1], 8, "tiny", 2)
    assert "patch(" in meta["setup"] and meta["device"] == "cpu"
    first = _pixels(out)

    # A rerun builds nothing and redoes nothing; one more prompt makes one more image.
    def no_build(*a, **k):
        raise AssertionError("a pipeline was built although every image was there")

    with monkeypatch.context() as m:
        m.setattr(models, "load_pipeline", no_build)
        again = generate.generate_images(PROMPTS[:3], out, steps=2, seed=7, progress=False)
    assert (again.written, again.skipped) == (0, 3)
    more = generate.generate_images(PROMPTS[:4], out, steps=2, seed=7, progress=False)
    assert (more.written, more.skipped) == (1, 3)
    now = _pixels(out)
    assert all(np.array_equal(now[k], v) for k, v in first.items()) and "00003.png" in now

    # A changed setting (steps) is a different image: made again, in place.
    (out / "00000.png").unlink()  # a lost file is made again too
    redo = generate.generate_images(PROMPTS[:1], out, steps=3, seed=7, progress=False)
    assert (redo.written, redo.skipped) == (1, 0)
    # the images of the earlier runs that this one does not make stay, and the run says so
    assert "holds 3 image(s) of an earlier run that this one does not make (index 1, 2, 3)" in caplog.text
    assert {"00001.png", "00002.png", "00003.png"} <= set(_pixels(out))


def test_a_failing_prompt_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch):
    import diffusers

    real = diffusers.StableDiffusionPipeline.__call__

    @functools.wraps(real)
    def flaky(self, prompt, *a, **k):
        if prompt == "boom":
            raise RuntimeError("CUDA out of memory (simulated)")
        return real(self, prompt, *a, **k)

    out = tmp_path / "images"
    with monkeypatch.context() as m:
        m.setattr(diffusers.StableDiffusionPipeline, "__call__", flaky)
        summary = generate.generate_images(PROMPTS, out, steps=2, progress=False)
    assert (summary.written, summary.failed, summary.exit_code) == (4, 1, 1)
    failed = [e for e in _manifest(out) if e["status"] == "error"]
    assert [(e["index"], e["prompt"]) for e in failed] == [(2, "boom")] and "out of memory" in failed[0]["error"]
    assert not (out / "00002.png").exists()
    retry = generate.generate_images(PROMPTS, out, steps=2, progress=False)  # only the failed one runs again
    assert (retry.written, retry.failed, retry.skipped, retry.exit_code) == (1, 0, 4, 0)


def test_a_pipeline_that_cannot_be_built_fails_its_share_not_the_run(tmp_path, monkeypatch):
    """A process whose pipeline cannot be built (out of memory, a bad path) records each of its prompts
    as failed and returns, so that the other processes' collective steps do not wait for it forever."""
    monkeypatch.setattr(models, "load_pipeline", lambda *a, **k: (_ for _ in ()).throw(MemoryError("no room")))
    summary = generate.generate_images(PROMPTS[:2], tmp_path / "out", steps=2, progress=False)
    assert (summary.written, summary.failed, summary.exit_code) == (0, 2, 1)
    assert all("pipeline set-up failed: MemoryError: no room" in e["error"] for e in _manifest(tmp_path / "out"))


def test_errors_before_any_model_is_built(tmp_path, prompts_file, monkeypatch, capsys):
    monkeypatch.setattr(models, "load_pipeline", lambda *a, **k: pytest.fail("built a pipeline"))
    (tmp_path / "empty.txt").write_text("")
    assert main(["generate", "--prompts", str(tmp_path / "empty.txt"), "--out", str(tmp_path / "o")]) == 2
    assert "no prompts" in capsys.readouterr().err
    (tmp_path / "afile").write_text("x")
    assert main(["generate", "--prompts", str(prompts_file), "--out", str(tmp_path / "afile")]) == 2
    assert "is a file" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # --prompt and --prompts together: argparse's own error
        main(["generate", "--prompt", "x", "--prompts", str(prompts_file)])


def test_cli_batch_writes_the_folder(tmp_path, prompts_file, capsys):
    out = tmp_path / "cli"
    assert main(["generate", "--prompts", str(prompts_file), "--out", str(out), "--steps", "2"]) == 0
    assert "5 images written, 0 failed" in capsys.readouterr().out
    assert len(_pixels(out)) == 5 and len(_manifest(out)) == 5


@pytest.mark.integration
def test_two_processes_make_the_same_images_as_one(tmp_path, prompts_file):
    """torchrun (what `accelerate launch` runs for several processes): the prompts are split between
    two processes, and each image is bit-identical to the one-process run's (same thread count:
    torchrun runs each process with OMP_NUM_THREADS=1, and so does the one-process run here)."""
    if shutil.which("torchrun", path=os.path.dirname(sys.executable)) is None:
        pytest.skip("torchrun is not installed beside this python")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SD_KERNELS_BACKEND": "reference"}
    args = ["-m", "sd_kernels", "generate", "--prompts", str(prompts_file), "--steps", "2", "--device", "cpu"]
    one, two = tmp_path / "one", tmp_path / "two"
    subprocess.run([sys.executable, *args, "--out", str(one)], env=env, check=True, capture_output=True, timeout=600)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    run = subprocess.run([torchrun, "--nproc_per_node", "2", *args, "--out", str(two)], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "process 1 (cpu)" in run.stdout
    entries = _manifest(two)
    assert sorted(e["index"] for e in entries) == list(range(5)) and {e["process"] for e in entries} == {0, 1}
    a, b = _pixels(one), _pixels(two)
    assert a.keys() == b.keys() and len(a) == 5
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_memory_table_is_measured_only_on_cuda_under_a_budget(tmp_path):
    """On the CPU no table is made (the measurement reads CUDA's allocator), and the summary says
    nothing of one; on the GPU see the test below."""
    summary = generate.generate_images(["a cat"], tmp_path / "out", model="tiny", steps=2, device="cpu",
                                       profile="s23-ultra", progress=False)
    assert summary.written == 1 and summary.processes[0].memory == ""
    assert "memory of one pipeline call" not in summary.format()


@pytest.mark.gpu
def test_gpu_generate_under_a_phone_budget_prints_the_memory_table(tmp_path, monkeypatch):
    monkeypatch.delenv("SD_KERNELS_BACKEND")  # the kernels, as a user runs them
    summary = generate.generate_images(["a cat", "a dog"], tmp_path / "out", model="tiny", steps=3,
                                       profile="s23-ultra", progress=False)
    assert summary.written == 2
    table = summary.processes[0].memory
    assert "memory of one pipeline call (s23-ultra, 64x64, 3 steps, call 2)" in table
    assert "of the 4096 MB budget: within" in table
    for part in ("text_encoder", "unet", "vae"):
        assert part in table
    assert table in summary.format()
