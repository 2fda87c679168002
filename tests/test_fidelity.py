"""sd_kernels.analysis.fidelity: stock vs patched pipelines with the same weights and seed.

On CPU: with the reference backend the patched pipeline is exact (error 0, PSNR inf); an op made
wrong on purpose shows in the totals and in its own per-op row only; a patched pipeline is refused.
On the GPU: SD1.5 at 512², SD2.1 at 768², SDXL at 1024², fp16, 20 steps, within the limits (latent rel.
error ≤ 1e-2, PSNR ≥ 40 dB).
"""

import math

import pytest
import torch

import sd_kernels
from sd_kernels import models, reference
from sd_kernels.analysis import fidelity


@pytest.fixture(scope="module")
def pipe():
    p = models.build_pipeline("tiny")
    p.set_progress_bar_config(disable=True)
    return p


def test_reference_ops_are_exact(pipe, monkeypatch):
    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    result = fidelity.check_fidelity(pipe, steps=2)
    assert result.patched == fidelity.Fidelity(0.0, math.inf) and result.ok()
    assert set(result.per_op) == set(result.ops) == set(sd_kernels.patches.PATCHERS)
    assert {"attention", "gelu", "group_norm"} <= set(result.ops)
    assert result.size == (64, 64) and result.steps == 2 and result.dtype == "float32"
    assert "ok (limits" in result.format()
    assert sd_kernels.patches.patch_record(pipe) is None


def test_pixarts_older_step_callback_gives_its_latents_too(monkeypatch):
    """PixArt's pipelines take diffusers' older per-step ``callback`` (no ``callback_on_step_end``): the last
    step's latents come from it, as they come from the newer one elsewhere (the reference backend: exact)."""
    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    pixart = models.build_pipeline("tiny-pixart")
    pixart.set_progress_bar_config(disable=True)
    result = fidelity.check_fidelity(pixart, steps=1, ops=["layer_norm"], per_op=False, clean_caption=False)
    assert result.patched == fidelity.Fidelity(0.0, math.inf)


def test_a_wrong_op_shows_and_is_attributed(pipe, monkeypatch):
    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    exact = reference.group_norm
    monkeypatch.setattr(reference, "group_norm", lambda *a, **k: exact(*a, **k) * 1.05)
    result = fidelity.check_fidelity(pipe, steps=2)
    assert result.patched.latent_rel_err > 1e-3 and result.patched.psnr_db < math.inf
    assert result.per_op["group_norm"].latent_rel_err > 1e-3
    clean = fidelity.Fidelity(0.0, math.inf)
    assert all(f == clean for op, f in result.per_op.items() if op != "group_norm")
    assert not fidelity.Fidelity(2e-2, 50.0).ok() and not fidelity.Fidelity(1e-3, 30.0).ok()


def test_the_verdict_line_uses_the_limits_given():
    result = fidelity.FidelityResult("P", 1, (8, 8), "float32", ("gelu",), False, fidelity.Fidelity(1e-3, 50.0), {})
    assert result.format().endswith("ok (limits: latent rel. err ≤ 0.01, PSNR ≥ 40 dB)")
    assert result.format(-1, 40).endswith("FAIL (limits: latent rel. err ≤ -1, PSNR ≥ 40 dB)")
    assert not result.ok(-1, 40)


def test_patched_pipeline_is_refused(pipe):
    with sd_kernels.patched(pipe), pytest.raises(ValueError, match="unpatched pipeline"):
        fidelity.check_fidelity(pipe, steps=1)


def test_cli(monkeypatch, capsys):
    from sd_kernels.apps.cli import main

    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    assert main(["fidelity", "--model", "tiny", "--steps", "1", "--ops", "gelu", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "StableDiffusionPipeline, 64x64, 1 steps, float32" in out and "gelu" in out


@pytest.mark.gpu
@pytest.mark.parametrize("name, cuda_graph", [("sd15", False), ("sd15", True), ("sd21", False), ("sdxl", False)])
def test_sd_architectures_fp16(name, cuda_graph):
    """One pipeline per architecture at its resolution (SDXL 1024²), fp16, 20 steps, patched vs stock;
    per-op rows off to keep it under a minute (``sd-kernels fidelity --model NAME`` prints them)."""
    pipe = models.build_pipeline(name, device="cuda", dtype=torch.float16)
    pipe.set_progress_bar_config(disable=True)
    result = fidelity.check_fidelity(pipe, steps=20, per_op=False, cuda_graph=cuda_graph)
    print(result.format())
    assert result.ok(), result.format()
