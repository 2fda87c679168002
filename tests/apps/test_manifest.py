"""Resumable batch runs that neither block nor redo work (sd_kernels/apps/manifest.py and the run): a
damaged manifest line is skipped with one warning naming the file and line, a last line without its
newline does not swallow the next entry, two runs on one folder do not both render, batch mode checks
what single mode checks before any work, prompt files split on newlines only; and the small ones: no
temporary file after a failed rename, no images/s from failed calls, a new dtype or profile makes
images again, profile errors that say what is wrong, an unusable autotune cache path flagged."""

import json
import logging
import os
import subprocess
import sys
import types

import pytest

from sd_kernels import models, profiles
from sd_kernels.apps import cli, generate, manifest, metadata, options, pipeline

PROMPTS = ["café crème", "a blue sphere"]


@pytest.fixture(autouse=True)
def reference_ops(monkeypatch):
    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")


def _run(out, prompts=PROMPTS, **kw):
    return generate.generate_images(prompts, out, steps=1, device="cpu", progress=False, **kw)


def _entries(out):
    return [json.loads(x) for x in (out / manifest.MANIFEST).read_bytes().decode().splitlines()]


@pytest.fixture
def no_build(monkeypatch):
    monkeypatch.setattr(models, "load_pipeline", lambda *a, **k: pytest.fail("a pipeline was built"))


def test_damaged_lines_are_skipped_with_one_warning_and_their_images_made_again(tmp_path, caplog):
    out = tmp_path / "out"
    assert _run(out).written == 2
    lines = (out / manifest.MANIFEST).read_bytes().split(b"\n")
    cut = lines[0][: lines[0].index("é".encode()) + 1]  # a crash inside the two bytes of "é"
    (out / manifest.MANIFEST).write_bytes(cut + b"\n" + lines[1] + b"\n" + b'{"index": [1], "status": "ok"}\n'
                                          + b'{"index": 0, "status": 3}\n')
    with caplog.at_level(logging.WARNING, logger="sd_kernels"):
        again = _run(out)
    assert (again.written, again.skipped) == (1, 1)  # image 0's line was the damaged one
    warnings = [r.getMessage() for r in caplog.records if "unreadable" in r.getMessage()]
    assert warnings == [f"sd_kernels: generate: {out / manifest.MANIFEST}: skipped 3 unreadable line(s) "
                        "(line 1, 3, 4); the images they list are made again"]


def test_a_last_line_without_its_newline_does_not_swallow_the_next_entry(tmp_path):
    out = tmp_path / "out"
    assert _run(out, PROMPTS[:1]).written == 1
    path = out / manifest.MANIFEST
    path.write_bytes(path.read_bytes().rstrip(b"\n"))  # the crash came before the newline
    assert (_run(out).written, _run(out).skipped) == (1, 2)  # the second rerun redoes nothing
    assert [e["index"] for e in _entries(out)] == [0, 1]


def test_a_second_run_on_the_same_folder_stops_before_any_work(tmp_path, no_build):
    out = tmp_path / "out"
    out.mkdir()
    with manifest.Lock(out):  # another run holds the folder
        with pytest.raises(ValueError, match=f"--out {out}: another run is writing there \\(process {os.getpid()} "):
            _run(out)
    assert not list(out.glob("*.png"))


@pytest.mark.integration
def test_two_runs_at_once_make_each_image_once(tmp_path):
    """Two processes started together on one folder: one renders, the other stops at once (or, if it
    came after, finds everything done); never both."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("\n".join(f"prompt {i}" for i in range(4)) + "\n")
    argv = [sys.executable, "-m", "sd_kernels", "generate", "--prompts", str(prompts), "--out", str(tmp_path / "out"),
            "--steps", "1", "--device", "cpu"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runs = [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(2)]
    results = [(r.communicate(timeout=600)[1], r.returncode) for r in runs]
    assert sorted(code for _, code in results) in ([0, 0], [0, 2]), results
    for err, code in results:
        assert code == 0 or "another run is writing there" in err
    ok = [e["index"] for e in _entries(tmp_path / "out") if e["status"] == "ok"]
    assert sorted(ok) == [0, 1, 2, 3]


@pytest.mark.parametrize("env, message", [
    ({"SD_KERNELS_BACKEND": "foo"}, "SD_KERNELS_BACKEND must be one of"),
    ({"SD_KERNELS_BACKEND": "triton", "TRITON_INTERPRET": "0"}, "SD_KERNELS_BACKEND=triton forces the kernels"),
])
def test_batch_mode_checks_the_backend_before_any_work(tmp_path, no_build, monkeypatch, capsys, env, message):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    (tmp_path / "p.txt").write_text("a\n")
    assert cli.main(["generate", "--prompts", str(tmp_path / "p.txt"), "--out", str(tmp_path / "out"),
                     "--device", "cpu"]) == 2
    assert message in capsys.readouterr().err


def test_a_manifest_path_that_is_a_folder_is_refused_before_any_work(tmp_path, no_build):
    (tmp_path / "out" / manifest.MANIFEST).mkdir(parents=True)
    with pytest.raises(ValueError, match="manifest.jsonl is not a file"):
        _run(tmp_path / "out")
    assert not list((tmp_path / "out").glob("*.png"))


def test_prompt_files_split_on_newlines_only(tmp_path):
    path = tmp_path / "p.txt"
    path.write_bytes("\ufeffa\x0cform feed\r\nnext\x85line\nline\u2028separator\n\n  spaced  \r\n".encode())
    assert [s.prompt for s in options.read_prompts(path)] == [
        "a\x0cform feed", "next\x85line", "line\u2028separator", "spaced"]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_bytes('\ufeff{"prompt": "x\u2028y"}\r\n'.encode())
    assert [s.prompt for s in options.read_prompts(jsonl)] == ["x\u2028y"]


def test_a_failed_rename_leaves_no_temporary_file(tmp_path, monkeypatch):
    import numpy as np

    def refuse(src, dst):
        raise PermissionError("rename refused")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(PermissionError):
        metadata.encode(np.zeros((8, 8, 3)), tmp_path / "00000.png", {
            "prompt": "p", "steps": 1, "sampler": "PLMS", "guidance": 7.5, "seed": 0, "width": 8, "height": 8,
            "model": "tiny", "version": "0"})
    assert list(tmp_path.iterdir()) == []


def test_no_images_per_second_from_calls_that_failed(tmp_path, monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("out of memory (simulated)")

    monkeypatch.setattr(pipeline, "render", broken)
    summary = _run(tmp_path / "out", ["a", "b", "c"])
    assert (summary.written, summary.failed) == (0, 3)
    assert summary.processes[0].steady_images_per_s is None and "then -" in summary.format()


def test_another_dtype_or_profile_makes_the_images_again(tmp_path):
    out = tmp_path / "out"
    assert _run(out, PROMPTS[:1]).written == 1
    assert _run(out, PROMPTS[:1]).skipped == 1
    assert _run(out, PROMPTS[:1], profile="hopper").written == 1
    assert _run(out, PROMPTS[:1], dtype="bf16").written == 1
    assert [(e["dtype"], e["profile"]) for e in _entries(out)] == [("fp32", "cpu"), ("fp32", "hopper"),
                                                                   ("bf16", "cpu")]


def test_profile_errors_say_what_is_wrong(tmp_path):
    with pytest.raises(ValueError, match="profile file /no/such/profile.json: not found"):
        profiles.get_profile("/no/such/profile.json")
    rule = {"n": "1", "c": 4, "h": 8, "w": 8, "k": 4, "dtype": "float16", "tile": 4}
    with pytest.raises(profiles.ProfileError, match=r"winograd\[0\]\.n = '1'; expected an integer"):
        profiles.from_dict({"name": "x", "description": "d", "winograd": [rule]})


def test_info_flags_an_autotune_cache_under_a_regular_file(tmp_path, monkeypatch, capsys):
    (tmp_path / "afile").write_text("")
    monkeypatch.setenv("SD_KERNELS_AUTOTUNE_CACHE", str(tmp_path / "afile" / "cache"))
    assert cli.main(["info", "--profile", "cpu"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "autotune cache" in x)
    assert f"unusable: {tmp_path / 'afile'} is a file" in line


def test_a_killed_runs_temporary_images_are_removed_and_nothing_else(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / ".00003.png.4242.tmp").write_bytes(b"\x89PNG half")  # a run killed inside a write
    (out / ".notes.tmp").write_text("the user's own")
    assert _run(out, PROMPTS[:1]).written == 1
    assert sorted(p.name for p in out.iterdir() if p.name.endswith(".tmp")) == [".notes.tmp"]


def test_images_beyond_a_run_are_those_listed_ok_with_their_file_there(tmp_path):
    """``manifest.beyond``: images of an earlier run that this run's jobs do not make, their files there; a line
    with no file (hand-edited, or another tool's) is passed over, not an error."""
    (tmp_path / "00003.png").write_bytes(b"")
    entries = [{"index": 3, "status": "ok", "file": "00003.png"}, {"index": 4, "status": "ok", "file": "00004.png"},
               {"index": 5, "status": "ok"}, {"index": 6, "status": "error", "file": "00006.png"},
               {"index": 0, "status": "ok", "file": "00000.png"}]
    jobs = [types.SimpleNamespace(index=0)]
    assert manifest.beyond(tmp_path, jobs, entries) == [3]
