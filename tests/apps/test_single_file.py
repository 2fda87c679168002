"""Real checkpoints, offline: a single-file ``.safetensors`` (the original layout, as checkpoints are
shared) loaded with the configs shipped in the package, in the target dtype; the architecture from
--config or inferred; the tokenizer a real SD checkpoint needs found in the Hugging Face cache or asked
for; a folder's dtype variant."""

import json

import numpy as np
import pytest
import torch
from ldm_checkpoint import save_ldm_checkpoint
from PIL import Image

from sd_kernels import models
from sd_kernels.apps import cli, metadata


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    """No hub, and an empty Hugging Face cache unless a test fills one."""
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")


@pytest.fixture
def checkpoint(tmp_path):
    """The tiny pipeline's random weights (seed 0: those `generate --model tiny` uses) as one file."""
    path = tmp_path / "tiny.safetensors"
    save_ldm_checkpoint(models.build_pipeline("tiny", seed=0), path)
    return path


def test_a_single_file_loads_offline_in_the_target_dtype_with_the_same_weights(checkpoint):
    original = models.build_pipeline("tiny", seed=0)
    loaded = models.load_pipeline(str(checkpoint), dtype=torch.bfloat16, config="tiny")
    assert type(loaded).__name__ == "StableDiffusionPipeline" and type(loaded.scheduler) is type(original.scheduler)
    for part in ("unet", "vae", "text_encoder"):
        want, got = getattr(original, part).state_dict(), getattr(loaded, part).state_dict()
        assert want.keys() == got.keys(), part
        assert all(got[k].dtype == torch.bfloat16 and torch.equal(got[k], want[k].bfloat16()) for k in want), part


def test_generate_from_a_single_file_makes_the_shipped_models_image(checkpoint, tmp_path):
    a, b = tmp_path / "shipped.png", tmp_path / "file.png"
    base = ["generate", "--prompt", "a cat", "--steps", "2", "--device", "cpu", "--seed", "4"]
    assert cli.main([*base, "--out", str(a)]) == 0
    assert cli.main([*base, "--model", str(checkpoint), "--config", "tiny", "--out", str(b)]) == 0
    assert np.array_equal(np.asarray(Image.open(a)), np.asarray(Image.open(b)))
    record = metadata.read(b)["sd-kernels"]
    assert (record["model"], record["config"], record["weights"]) == (str(checkpoint), "tiny",
                                                                      f"loaded from {checkpoint}")


def test_a_diffusers_folder_as_config(checkpoint, tmp_path):
    folder = models.write_config_folder("tiny", tmp_path / "config")
    assert not list(folder.rglob("*.safetensors")) and (folder / "tokenizer" / "tokenizer_config.json").is_file()
    loaded = models.load_pipeline(str(checkpoint), config=str(folder))
    assert torch.equal(loaded.unet.conv_in.weight, models.build_pipeline("tiny", seed=0).unet.conv_in.weight)


def test_the_architecture_is_inferred_and_a_missing_tokenizer_is_asked_for_before_loading(checkpoint, monkeypatch,
                                                                                          tmp_path, capsys):
    """Without --config the checkpoint's tensor names say SD1.x; the real SD1.5 tokenizer is not in the
    package, and here not in the cache: one clear error, before any weights are read."""
    assert models.checkpoint_config(str(checkpoint)) == "sd15"
    monkeypatch.setattr("diffusers.StableDiffusionPipeline.from_single_file",
                        lambda *a, **k: pytest.fail("loaded weights"))
    assert cli.main(["generate", "--prompt", "x", "--model", str(checkpoint), "--device", "cpu",
                     "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert "a sd15 single-file checkpoint needs its CLIP tokenizer" in err and "--config DIR" in err


def test_a_cached_tokenizer_is_used(tmp_path):
    """A tokenizer in the Hugging Face cache (as `hf download` leaves it) goes into the config folder."""
    snapshot = tmp_path / "hf-cache" / "models--stable-diffusion-v1-5--stable-diffusion-v1-5"
    (snapshot / "refs").mkdir(parents=True)
    (snapshot / "refs" / "main").write_text("abc123")
    tokenizer = models.write_tokenizer(snapshot / "snapshots" / "abc123" / "tokenizer")
    config = tmp_path / "sd15"
    models.write_config_folder("sd15", config)
    assert (config / "tokenizer" / "vocab.json").read_bytes() == (tokenizer / "vocab.json").read_bytes()
    assert json.loads((config / "unet" / "config.json").read_text())["cross_attention_dim"] == 768


@pytest.mark.parametrize("content, message", [(b"not safetensors", "cannot read it as safetensors")])
def test_a_damaged_checkpoint_is_named(tmp_path, content, message):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(content)
    with pytest.raises(ValueError, match=f"--model {bad}: {message}"):
        models.checkpoint_config(str(bad))


def test_a_file_of_other_weights_is_named_not_taken_for_sd15(tmp_path, capsys):
    """A safetensors file with no denoiser in it (a LoRA, another model's weights): diffusers' inference would
    call it SD1.x; here it is refused as what it is, and with --config its load failure is one line."""
    from safetensors.torch import save_file

    junk = tmp_path / "junk.safetensors"
    save_file({"lora_unet_down.weight": torch.zeros(4, 4)}, str(junk))
    with pytest.raises(ValueError, match="no denoiser weights in it"):
        models.checkpoint_config(str(junk))
    assert cli.main(["generate", "--prompt", "x", "--model", str(junk), "--config", "tiny", "--device", "cpu",
                     "--steps", "1", "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert f"sd-kernels generate: error: --model {junk}: its weights do not load as a" in err
    assert "Traceback" not in err and not (tmp_path / "x.png").exists()


def test_a_folder_loads_its_variant_in_the_target_dtype(tmp_path):
    pipe = models.build_pipeline("tiny", seed=0)
    pipe.to(torch.float16).save_pretrained(tmp_path / "pipe", variant="fp16")
    assert sorted(p.name for p in (tmp_path / "pipe" / "unet").iterdir()) == [
        "config.json", "diffusion_pytorch_model.fp16.safetensors"]
    loaded = models.load_pipeline(str(tmp_path / "pipe"), dtype=torch.float16)
    assert loaded.unet.dtype == torch.float16 and loaded.text_encoder.dtype == torch.float16
    assert torch.equal(loaded.unet.conv_in.weight, pipe.unet.conv_in.weight)
