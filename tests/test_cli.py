import csv
import json

import pytest
import torch

from sd_kernels.apps import cli


def test_info_prints_versions_and_profile(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "diffusers" in out and "profile" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's answers")
def test_info_says_whether_the_fp8_tier_runs_here(capsys, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cli.main(["info"])
    assert "precision fp8: yes (the FP8 tier, docs/fp8.md) through Triton's interpreter" in capsys.readouterr().out
    monkeypatch.delenv("TRITON_INTERPRET")
    cli.main(["info"])
    assert "precision fp8: no: precision='fp8' runs on CUDA GPUs with FP8 tensor cores" in capsys.readouterr().out


def test_info_under_a_budget_prints_each_configs_weights_against_it(capsys):
    assert cli.main(["info", "--profile", "mobile-small"]) == 0
    out = capsys.readouterr().out
    assert "sd15: memory plan: budget 2560 MB" in out and "fits, every component resident" in out
    assert "sdxl: does not fit: unet needs" in out
    assert cli.main(["info", "--profile", "hopper"]) == 0
    assert "memory plan" not in capsys.readouterr().out  # no budget, no plan


def test_demo_writes_a_png_on_cpu(tmp_path, capsys, monkeypatch):
    # The command's plumbing, as below: the kernels through the interpreter would take minutes here (the
    # whole pipeline at 64x64); tests/patches/ runs them on the same tiny models, against float64.
    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    out = tmp_path / "img.png"
    assert cli.main(["demo", "--steps", "2", "--device", "cpu", "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = capsys.readouterr().out
    assert "stock:" in text and "patched:" in text and "PSNR" in text
    assert "on a CPU these timings say nothing of sd-kernels' speed" in text


@pytest.mark.parametrize(
    "argv", [[], ["frobnicate"], ["demo", "--steps", "0"], ["demo", "--steps", "x"], ["demo", "--dtype", "fp8"]]
)
def test_bad_arguments_exit_non_zero(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code != 0
    assert "usage" in capsys.readouterr().err


def test_unknown_model_is_a_clear_error(capsys):
    assert cli.main(["demo", "--model", "./no/such/dir", "--device", "cpu"]) == 2
    assert "neither a shipped config" in capsys.readouterr().err


def test_unknown_profile_is_a_clear_error(capsys):
    assert cli.main(["info", "--profile", "mali"]) == 2
    assert "known profiles" in capsys.readouterr().err


# The commands' plumbing is under test here, not the kernels (their own tests run them through the
# interpreter): the patched pipeline runs the PyTorch reference ops, which keeps these seconds-long.


def test_generate_labels_random_weights_in_text_and_png(tmp_path, capsys, monkeypatch):
    from PIL import Image

    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    out = tmp_path / "gen.png"
    assert cli.main(["generate", "--prompt", "a red cube", "--steps", "1", "--device", "cpu", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "sd_kernels patch" in text and "random weights from the shipped config 'tiny'" in text
    meta = Image.open(out).text
    assert meta["parameters"].startswith("a red cube\nSteps: 1, ") and "Model: tiny" in meta["parameters"]
    ours = json.loads(meta["sd-kernels"])
    assert ours["model"] == "tiny" and ours["prompt"] == "a red cube" and ours["steps"] == 1
    assert ours["weights"].startswith("random weights") and ours["setup"].startswith("patch(")


def test_bench_on_cpu_writes_csv_table_and_plot(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    argv = ["bench", "--device", "cpu", "--steps", "2", "--variants", "stock,patched", "--no-ablation",
            "--out", str(tmp_path)]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "== end to end" in text and "tiny" in text
    rows = list(csv.DictReader(open(tmp_path / "e2e.csv")))
    assert [(r["model"], r["variant"], r["status"]) for r in rows] == [("tiny", "stock", "ok"),
                                                                       ("tiny", "patched", "ok")]
    assert float(rows[1]["e2e_ms"]) > 0 and float(rows[1]["unet_rel_err"]) < 1e-3
    assert (tmp_path / "e2e.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_says_a_full_size_model_on_the_cpu_takes_minutes(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("bench.e2e.run", lambda *a, **k: [])  # what is said before any work, not the work
    assert cli.main(["bench", "--device", "cpu", "--model", "sd15@512", "--variants", "stock", "--no-ablation",
                     "--out", str(tmp_path)]) == 0
    assert "note: sd15 on the CPU: each call takes minutes" in capsys.readouterr().err
    assert cli.main(["bench", "--device", "cpu", "--variants", "stock", "--no-ablation", "--out", str(tmp_path)]) == 0
    assert "note:" not in capsys.readouterr().err  # the tiny model: nothing to say


@pytest.mark.parametrize("argv, message", [
    (["bench", "--device", "cpu", "--variants", "eager"], "--variants: unknown ['eager']"),
    (["bench", "--device", "cpu", "--model", "./no/such/dir"], "neither a shipped config"),
    (["bench", "--device", "cpu", "--steps", "0"], "--steps must be a positive integer, got 0"),
    (["bench", "--profile", "mali"], "known profiles"),
    (["demo", "--device", "cpu", "--profile", "mali"], "known profiles"),
    (["demo", "--device", "cpu", "--profile", "cpu", "--no-patch"], "--profile sets up the patch"),
    (["bench", "--device", "cpu", "--out", __file__], ": is a file; bench writes its CSVs and plots into a folder"),
    (["generate", "--prompt", "x", "--profile", "mali"], "known profiles"),
])
def test_bench_and_generate_name_bad_values(argv, message, capsys):
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal where torch sees no CUDA GPU")
@pytest.mark.parametrize("command", ["demo", "generate", "bench", "fidelity"])
def test_cuda_asked_for_without_a_gpu_is_one_line_from_every_command(command, capsys):
    argv = [command, "--device", "cuda"] + (["--prompt", "x"] if command == "generate" else [])
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"sd-kernels {command}: error: --device cuda asked for, but torch sees no CUDA GPU")
    assert err.count("sd-kernels") == 1 and "Traceback" not in err


@pytest.mark.parametrize("argv, mode", [(["demo"], False), (["demo", "--compile"], "default"),
                                        (["generate", "--prompt", "x", "--compile", "max-autotune"], "max-autotune")])
def test_compile_takes_an_optional_mode(argv, mode):
    assert cli.build_parser().parse_args(argv).compile == mode


def test_compile_without_the_patch_is_refused_before_any_work(capsys):
    assert cli.main(["demo", "--no-patch", "--compile", "--device", "cpu"]) == 2
    assert "cannot go with --no-patch" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["generate"], ["generate", "--prompt", "x", "--steps", "0"],
                                  ["bench", "--selection", "huge"], ["demo", "--compile", "fastest"],
                                  ["demo", "--seed", "-1"], ["fidelity", "--seed", "-1"]])
def test_bench_and_generate_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code != 0
    assert "usage" in capsys.readouterr().err


@pytest.mark.parametrize("out, demo_message, generate_message", [
    ("{tmp}", "is a folder", "is a folder"),
    ("{tmp}/image.xyz", "unknown image file extension", "cannot carry the generation settings"),
    ("{tmp}/image.bmp", None, "cannot carry the generation settings"),
    ("{tmp}/file.txt/x.png", "is a file, not a folder", "is a file, not a folder"),
])
def test_an_output_that_cannot_be_written_fails_before_any_work(tmp_path, capsys, monkeypatch, out, demo_message,
                                                                generate_message):
    (tmp_path / "file.txt").write_text("")
    monkeypatch.setattr("sd_kernels.models.load_pipeline", lambda *a, **k: pytest.fail("built a pipeline"))
    for command, message in (("demo", demo_message), ("generate", generate_message)):
        if message is None:
            continue
        argv = [command, "--device", "cpu", "--out", out.format(tmp=tmp_path)] + (
            ["--prompt", "x"] if command == "generate" else [])
        assert cli.main(argv) == 2
        assert message in capsys.readouterr().err


def test_a_size_off_the_vae_grid_and_a_forced_backend_that_cannot_run_fail_first(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("sd_kernels.models.load_pipeline", lambda *a, **k: pytest.fail("built a pipeline"))
    assert cli.main(["demo", "--device", "cpu", "--size", "60", "--out", str(tmp_path / "a.png")]) == 2
    assert "--size 60: the image side must be a positive multiple of 8" in capsys.readouterr().err
    assert cli.main(["fidelity", "--device", "cpu", "--size", "60"]) == 2
    assert "--size 60: the image side must be a positive multiple of 8" in capsys.readouterr().err
    monkeypatch.setenv("SD_KERNELS_BACKEND", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert cli.main(["demo", "--device", "cpu", "--out", str(tmp_path / "a.png")]) == 2
    assert "SD_KERNELS_BACKEND=triton forces the kernels" in capsys.readouterr().err


def test_a_graph_mode_on_the_cpu_is_refused_before_the_pipeline_is_built(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("sd_kernels.models.load_pipeline", lambda *a, **k: pytest.fail("built a pipeline"))
    assert cli.main(["generate", "--prompt", "x", "--device", "cpu", "--cuda-graph", "step",
                     "--out", str(tmp_path / "a.png")]) == 2
    assert "--cuda-graph step replays CUDA graphs: it needs --device cuda (on the cpu: auto or off)" in \
        capsys.readouterr().err


def test_an_unreachable_hub_id_is_one_line_not_a_traceback(tmp_path, capsys, monkeypatch):
    def offline(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files")

    monkeypatch.setattr("huggingface_hub.hf_hub_download", offline)  # the model's configs are read first
    monkeypatch.setattr("sd_kernels.models.load_pipeline", offline)
    assert cli.main(["generate", "--prompt", "x", "--model", "someone/model", "--device", "cpu",
                     "--out", str(tmp_path / "a.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sd-kernels generate: error: We couldn't connect") and "Traceback" not in err
