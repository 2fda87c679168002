"""`sd-kernels generate` end to end on the tiny model (the patched pipeline on the PyTorch reference ops:
the plumbing is under test, the kernels have their own tests): every option reaches the pipeline call
and the image's records, a random seed is recorded and makes the same image again, a batch of one
is the single image, LoRAs, img2img and inpaint, defaults from the model."""

import functools
import json
import types

import numpy as np
import pytest
import torch
from PIL import Image

from sd_kernels import models
from sd_kernels.apps import cli, metadata, options, pipeline

peft = pytest.importorskip("peft", reason="peft is in the test extra: pip install -e '.[test]'")


@pytest.fixture(autouse=True)
def reference_ops(monkeypatch):
    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")


@pytest.fixture
def calls(monkeypatch):
    """Every pipeline call's class, scheduler and keyword arguments, the call itself unchanged."""
    import diffusers

    seen = []
    for cls in (diffusers.StableDiffusionPipeline, diffusers.StableDiffusionImg2ImgPipeline,
                diffusers.StableDiffusionInpaintPipeline):
        def spy(self, *args, __real=cls.__call__, **kwargs):
            seen.append((type(self).__name__, type(self.scheduler).__name__, dict(self.scheduler.config), kwargs))
            return __real(self, *args, **kwargs)

        monkeypatch.setattr(cls, "__call__", functools.wraps(cls.__call__)(spy))
    return seen


def _pixels(path) -> np.ndarray:
    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"))


def _gen(*argv) -> None:
    assert cli.main(["generate", "--device", "cpu", "--steps", "1", *map(str, argv)]) == 0


def test_options_reach_the_call_and_the_records_and_a_random_seed_makes_the_image_again(tmp_path, calls, capsys):
    a, b = tmp_path / "a.png", tmp_path / "b.png"
    common = ["--width", 64, "--height", 32, "--guidance-scale", 5, "--negative-prompt", "blur", "--scheduler",
              "euler-a", "--steps", 2]
    _gen("--prompt", "a cat", "--seed", -1, "--out", a, *common)
    printed = capsys.readouterr().out
    record = metadata.read(a)["sd-kernels"]
    seed = record["seed"]
    assert f"seed {seed} (drawn at random)" in printed and 0 <= seed < 2**32
    assert {k: record[k] for k in ("prompt", "negative", "width", "height", "guidance", "scheduler", "steps")} == {
        "prompt": "a cat", "negative": "blur", "width": 64, "height": 32, "guidance": 5.0, "scheduler": "euler-a",
        "steps": 2}
    assert _pixels(a).shape == (32, 64, 3)
    cls, scheduler, _, kwargs = calls[-1]
    assert (cls, scheduler) == ("StableDiffusionPipeline", "EulerAncestralDiscreteScheduler")
    assert {k: kwargs[k] for k in ("prompt", "negative_prompt", "guidance_scale", "height", "width",
                                   "num_inference_steps")} == {
        "prompt": "a cat", "negative_prompt": "blur", "guidance_scale": 5.0, "height": 32, "width": 64,
        "num_inference_steps": 2}
    assert kwargs["generator"].initial_seed() == seed
    assert "Sampler: Euler a, CFG scale: 5, Seed: " + str(seed) + ", Size: 64x32" in metadata.read(a)["parameters"]

    _gen("--prompt", "a cat", "--seed", seed, "--out", b, *common)
    assert np.array_equal(_pixels(a), _pixels(b))


def _batch(call) -> int:
    """Images in one pipeline call: one generator each (a list), or a single one."""
    kwargs = call[3]
    if isinstance(kwargs["generator"], list):
        assert len(kwargs["prompt"]) == len(kwargs["generator"])
        return len(kwargs["generator"])
    assert isinstance(kwargs["prompt"], str)
    return 1


def test_a_batch_of_one_is_the_single_image_and_larger_batches_agree(tmp_path, calls):
    prompts = tmp_path / "p.txt"
    prompts.write_text("a red cube\na blue sphere\n")
    _gen("--prompts", prompts, "--out", tmp_path / "one", "--seed", 10, "--images-per-prompt", 2)
    assert [_batch(c) for c in calls] == [1, 1, 1, 1]
    entries = [json.loads(x) for x in (tmp_path / "one" / "manifest.jsonl").read_text().splitlines()]
    assert [(e["index"], e["prompt"], e["seed"]) for e in entries] == [
        (0, "a red cube", 10), (1, "a red cube", 11), (2, "a blue sphere", 12), (3, "a blue sphere", 13)]
    _gen("--prompt", "a blue sphere", "--seed", 12, "--out", tmp_path / "single.png")
    assert np.array_equal(_pixels(tmp_path / "one" / "00002.png"), _pixels(tmp_path / "single.png"))
    one = metadata.read(tmp_path / "one" / "00002.png")["sd-kernels"]
    single = metadata.read(tmp_path / "single.png")["sd-kernels"]
    assert one.keys() == single.keys() and one == single  # the same records from both modes

    calls.clear()
    _gen("--prompts", prompts, "--out", tmp_path / "three", "--seed", 10, "--images-per-prompt", 2,
         "--batch-size", 3)
    assert [_batch(c) for c in calls] == [3, 1]
    for name in ("00000.png", "00001.png", "00002.png", "00003.png"):  # the same noise; rounding of batch 3
        x, y = _pixels(tmp_path / "one" / name).astype(int), _pixels(tmp_path / "three" / name).astype(int)
        assert np.abs(x - y).max() <= 2, name


def _tiny_lora(path) -> None:
    import diffusers
    from peft.utils import get_peft_model_state_dict

    unet = models.build_model("tiny", "unet")
    torch.manual_seed(5)
    unet.add_adapter(peft.LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"],
                                     init_lora_weights=False))
    diffusers.StableDiffusionPipeline.save_lora_weights(path, unet_lora_layers=get_peft_model_state_dict(unet))


def test_loras_are_loaded_weighted_and_recorded(tmp_path):
    _tiny_lora(tmp_path / "lora")
    file = tmp_path / "lora" / "pytorch_lora_weights.safetensors"
    _gen("--prompt", "x", "--out", tmp_path / "base.png")
    _gen("--prompt", "x", "--lora", f"{file}:0", "--out", tmp_path / "zero.png")
    _gen("--prompt", "x", "--lora", f"{file}:1.5", "--lora", tmp_path / "lora", "--out", tmp_path / "two.png")
    assert np.array_equal(_pixels(tmp_path / "base.png"), _pixels(tmp_path / "zero.png"))  # weight 0: no change
    assert not np.array_equal(_pixels(tmp_path / "base.png"), _pixels(tmp_path / "two.png"))
    record = metadata.read(tmp_path / "two.png")
    sha = metadata.file_sha256(file)
    assert [(x["path"], x["scale"]) for x in record["sd-kernels"]["loras"]] == [(str(file), 1.5),
                                                                               (str(tmp_path / "lora"), 1.0)]
    assert record["sd-kernels"]["loras"][0]["sha256"] == sha
    assert f"Lora hashes: \"pytorch_lora_weights: {sha[:12]}, lora: " in record["parameters"]


def test_img2img_and_inpaint(tmp_path, calls):
    rng = np.random.default_rng(1)
    Image.fromarray((rng.random((52, 76, 3)) * 255).astype("uint8")).save(tmp_path / "init.png")
    mask = Image.new("L", (76, 52), 0)
    mask.paste(255, (16, 16, 48, 40))
    mask.save(tmp_path / "mask.png")
    _gen("--prompt", "x", "--image", tmp_path / "init.png", "--steps", 2, "--out", tmp_path / "i2i.png")
    cls, _, _, kwargs = calls[-1]
    assert cls == "StableDiffusionImg2ImgPipeline" and kwargs["image"].size == (72, 48) and kwargs["strength"] == 0.8
    assert _pixels(tmp_path / "i2i.png").shape == (48, 72, 3)  # the image's own size, rounded down to 8
    record = metadata.read(tmp_path / "i2i.png")
    assert record["sd-kernels"]["image"] == {"path": str(tmp_path / "init.png"),
                                             "sha256": metadata.file_sha256(tmp_path / "init.png")}
    assert "Denoising strength: 0.8" in record["parameters"]

    _gen("--prompt", "x", "--image", tmp_path / "init.png", "--mask", tmp_path / "mask.png", "--strength", 0.9,
         "--steps", 2, "--size", 64, "--out", tmp_path / "inpaint.webp")
    cls, _, _, kwargs = calls[-1]
    assert cls == "StableDiffusionInpaintPipeline" and kwargs["mask_image"].size == (64, 64)
    assert (kwargs["height"], kwargs["width"], kwargs["strength"]) == (64, 64, 0.9)
    record = metadata.read(tmp_path / "inpaint.webp")["sd-kernels"]
    assert record["pipeline"] == "StableDiffusionInpaintPipeline"
    assert record["mask"]["path"] == str(tmp_path / "mask.png")


def test_schedulers_by_name_replace_the_models_own(tmp_path):
    settings = options.Settings(scheduler="dpm++2m-karras")
    model = pipeline.inspect(settings, "tiny")
    pipe = pipeline.load(model, "cpu", torch.float32)
    assert type(pipe.scheduler).__name__ == "DPMSolverMultistepScheduler"
    assert pipe.scheduler.config.use_karras_sigmas and pipe.scheduler.config.algorithm_type == "dpmsolver++"
    assert pipe.scheduler.config.beta_schedule == "scaled_linear"  # the model's own training schedule kept
    assert pipeline.inspect(options.Settings(), "tiny").scheduler == "pndm"


def test_defaults_come_from_the_model(tmp_path):
    """A folder's native size and its pipeline's guidance: an SDXL folder gets 1024² and 5, as diffusers
    gives it (the configs only: no weights are needed to read them)."""
    pipe = models.build_pipeline("sdxl", device="meta")
    folder = tmp_path / "sdxl"
    pipe.save_config(folder)
    for part in ("unet", "vae", "scheduler"):
        getattr(pipe, part).save_config(folder / part)
    model = pipeline.inspect(options.Settings(), str(folder))
    assert (model.size, model.guidance, model.pipeline) == ((1024, 1024), 5.0, "StableDiffusionXLPipeline")
    assert models.image_side(str(folder)) == 1024
    tiny = tmp_path / "tiny"
    models.build_pipeline("tiny").save_pretrained(tiny)
    assert pipeline.inspect(options.Settings(), str(tiny)).size == (64, 64)


def test_a_random_seed_in_batch_mode_is_printed_and_recorded(tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("a\nb\n")
    _gen("--prompts", prompts, "--out", tmp_path / "out", "--seed", -1)
    entries = [json.loads(x) for x in (tmp_path / "out" / "manifest.jsonl").read_text().splitlines()]
    seed = entries[0]["seed"]
    assert [e["seed"] for e in entries] == [seed, seed + 1]
    assert f"seed {seed} (drawn at random; --seed {seed} makes these images again)" in capsys.readouterr().out
    assert metadata.read(tmp_path / "out" / "00001.png")["sd-kernels"]["seed"] == seed + 1


@pytest.mark.parametrize("available", [False, True])
def test_pixarts_caption_cleaning_is_asked_for_only_where_it_can_run(monkeypatch, available):
    """PixArt's pipelines clean captions by default and, without Beautiful Soup or ftfy, fall back with a
    warning per prompt: the call then asks for no cleaning (the same text); with both it keeps the default."""
    seen = {}

    class PixArtLike:
        def __call__(self, prompt, clean_caption=True, **kwargs):
            seen["clean_caption"] = clean_caption
            return types.SimpleNamespace(images=[None])

    monkeypatch.setattr(pipeline, "_caption_cleaning", lambda: available)
    job = options.Job(index=0, prompt="a cat", negative=None, seed=0, width=64, height=64, steps=1, guidance=4.5)
    model = types.SimpleNamespace(takes_size=True, image=None)
    pipeline.render(PixArtLike(), [job], model, pipeline.InitImages(model))
    assert seen["clean_caption"] is available
