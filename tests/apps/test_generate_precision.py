"""`sd-kernels generate --precision`: fp8 reaches ``patch(pipe, precision="fp8")`` for one image and for a
prompts file, the images' records say it (our JSON and AUTOMATIC1111's ``parameters``, read with
Pillow), a rerun with another precision makes the images again, and where the patch would refuse the
device the command refuses before building anything, with the patch's reason.

On the CPU the FP8 patch needs Triton's interpreter (conftest sets TRITON_INTERPRET=1); the ops run
their PyTorch reference of the quantized computation (SD_KERNELS_BACKEND=reference): the plumbing is
under test here, the FP8 kernels in tests/patches/test_fp8_patch.py and tests/ops."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from sd_kernels import models
from sd_kernels.apps import cli, generate, manifest, metadata, options


@pytest.fixture(autouse=True)
def reference_ops(monkeypatch):
    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def no_build(monkeypatch):
    monkeypatch.setattr(models, "load_pipeline", lambda *a, **k: pytest.fail("a pipeline was built"))


def _records(path):
    with Image.open(path) as im:  # Pillow alone, as another tool reads them
        return im.text["parameters"], json.loads(im.text["sd-kernels"]), np.asarray(im.convert("RGB"))


def test_fp8_reaches_the_patch_and_the_images_records(tmp_path):
    lossless, lossy = tmp_path / "fp16.png", tmp_path / "fp8.png"
    for path, precision in ((lossless, []), (lossy, ["--precision", "fp8"])):
        assert cli.main(["generate", "--prompt", "a cat", "--device", "cpu", "--steps", "1", "--out", str(path),
                         *precision]) == 0
    text16, ours16, pixels16 = _records(lossless)
    text8, ours8, pixels8 = _records(lossy)
    assert ours16["precision"] == "fp16" and "precision=" not in ours16["setup"] and "Precision" not in text16
    assert ours8["precision"] == "fp8" and ours8["setup"].endswith(", precision='fp8')")
    assert ", Precision: fp8, " in text8.splitlines()[-1]
    assert ours8["dtype"] == ours16["dtype"] == "fp32"  # --precision is not --dtype: the weights load alike
    assert not np.array_equal(pixels8, pixels16)  # the FP8 GEMMs did run: a lossy image


def test_a_rerun_with_another_precision_makes_the_images_again(tmp_path):
    out = tmp_path / "out"

    def run(**kw):
        return generate.generate_images(["a cat"], out, steps=1, device="cpu", progress=False, **kw)

    assert run(precision="fp8").written == 1
    assert run(precision="fp8").skipped == 1
    assert run().written == 1  # fp16, the default
    assert run().skipped == 1
    entries = [json.loads(x) for x in (out / manifest.MANIFEST).read_text().splitlines()]
    assert [e["precision"] for e in entries] == ["fp8", "fp16"]
    assert metadata.read(out / "00000.png")["sd-kernels"]["precision"] == "fp16"
    # a manifest written before the precision was recorded: its images were made lossless
    (out / manifest.MANIFEST).write_text(json.dumps({k: v for k, v in entries[-1].items() if k != "precision"}) + "\n")
    assert run().skipped == 1
    assert run(precision="fp8").written == 1


@pytest.mark.parametrize("which", ["--prompt", "--prompts"])
def test_the_cpu_without_the_interpreter_is_refused_before_any_work(tmp_path, no_build, monkeypatch, capsys, which):
    monkeypatch.delenv("TRITON_INTERPRET")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\n")
    out = tmp_path / ("a.png" if which == "--prompt" else "out")
    argv = [which, "a cat" if which == "--prompt" else str(prompts), "--out", str(out)]
    assert cli.main(["generate", *argv, "--device", "cpu", "--precision", "fp8"]) == 2
    assert capsys.readouterr().err.strip() == (
        "sd-kernels generate: error: --precision fp8: precision='fp8' runs on CUDA GPUs with FP8 tensor cores (or on "
        "the CPU through Triton's interpreter, TRITON_INTERPRET=1); the pipeline is on cpu")
    assert not out.is_file() and not list(tmp_path.glob("out/*.png")) and not list(tmp_path.glob("out/manifest*"))


def test_a_gpu_without_fp8_tensor_cores_is_refused_before_any_work(tmp_path, no_build, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    assert cli.main(["generate", "--prompt", "a cat", "--device", "cuda", "--profile", "hopper", "--precision", "fp8",
                     "--out", str(tmp_path / "a.png")]) == 2
    err = capsys.readouterr().err
    assert "--precision fp8: precision='fp8' needs FP8 tensor cores (compute capability 8.9 or later" in err
    assert "NVIDIA A100 (sm_80)" in err
    generate.check_precision("fp16", "cuda")  # the lossless default asks nothing of the device


def test_an_unknown_precision_is_an_error_naming_the_option(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli.main(["generate", "--prompt", "a cat", "--precision", "int8"])
    assert "argument --precision: invalid choice: 'int8' (choose from 'fp16', 'fp8')" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"--precision 'int8': one of fp16, fp8"):
        options.Settings(precision="int8").check()


def test_the_options_precisions_are_the_patchs():
    from sd_kernels.patches import fp8

    assert options.PRECISIONS == fp8.PRECISIONS
