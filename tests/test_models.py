import pytest
import torch

from sd_kernels import models


def test_configs_shipped():
    assert {"sd15", "sd21", "sdxl", "tiny", "tiny-xl", "pixart-sigma", "tiny-pixart", "sd3-medium",
            "tiny-sd3", "flux-dev", "tiny-flux"} <= set(models.list_configs())


def test_unknown_config_lists_known():
    with pytest.raises(ValueError, match="known configs: .*sd15"):
        models.build_pipeline("sd9")


def test_unknown_part():
    with pytest.raises(ValueError, match="parts: unet, vae, text_encoder"):
        models.build_model("sd15", "text_encoder_2", "meta")


# Parameter counts of the real checkpoints' models (SD1.5 UNet: 859.5 M; SD2.1: 865.9 M; SDXL: 2567.5 M).
@pytest.mark.parametrize(
    "name, part, millions",
    [("sd15", "unet", 859.52), ("sd15", "vae", 83.65), ("sd15", "text_encoder", 123.06),
     ("sd21", "unet", 865.91), ("sd21", "text_encoder", 340.39), ("sdxl", "unet", 2567.46),
     ("sdxl", "text_encoder_2", 694.66),
     # PixArt-Σ XL/2: the 0.6 B DiT (610.86 M here, from its published config) and T5-XXL's encoder (4762.3 M)
     ("pixart-sigma", "transformer", 610.86), ("pixart-sigma", "text_encoder", 4762.31),
     ("pixart-sigma", "vae", 83.65),
     # SD3-medium: the 2B MMDiT (2028.33 M), CLIP-L and CLIP-G with projections, T5-XXL's encoder, and
     # its 16-channel VAE (no quant convs)
     ("sd3-medium", "transformer", 2028.33), ("sd3-medium", "text_encoder", 123.65),
     ("sd3-medium", "text_encoder_2", 694.66), ("sd3-medium", "text_encoder_3", 4762.31),
     ("sd3-medium", "vae", 83.82),
     # FLUX.1-dev: the 12B MMDiT (11901.41 M: 19 double-stream and 38 single-stream blocks), CLIP-L's text
     # model, T5-XXL's encoder, and its 16-channel VAE (SD3's architecture, no quant convs)
     ("flux-dev", "transformer", 11901.41), ("flux-dev", "text_encoder", 123.06),
     ("flux-dev", "text_encoder_2", 4762.31), ("flux-dev", "vae", 83.82)],
)
def test_architecture_sizes(name, part, millions):
    model = models.build_model(name, part, device="meta")
    assert models.count_parameters(model) / 1e6 == pytest.approx(millions, abs=0.01)


def test_tokenizer_is_offline_and_clip_shaped():
    tok = models.make_tokenizer()
    ids = tok("A photo!", padding="max_length", max_length=77, truncation=True).input_ids
    assert len(ids) == 77 and ids[0] == tok.bos_token_id and tok.eos_token_id in ids


def test_t5_tokenizer_is_offline_and_t5_shaped():
    tok = models.make_t5_tokenizer()
    enc = tok("A photo!", padding="max_length", max_length=12, truncation=True)
    ids = enc.input_ids
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
    assert len(ids) == 12 and ids[enc.attention_mask.index(0) - 1] == tok.eos_token_id and ids[-1] == 0
    assert tok.decode(ids, skip_special_tokens=True) == "A photo!"
    assert len(tok) < models.load_config("tiny-pixart")["text_encoder"]["vocab_size"]


def test_pixart_sigma_config_is_the_published_one():
    cfg = models.load_config("pixart-sigma")
    t, te = cfg["transformer"], cfg["text_encoder"]
    assert (t["num_layers"], t["num_attention_heads"], t["attention_head_dim"], t["patch_size"]) == (28, 16, 72, 2)
    assert (t["sample_size"], t["caption_channels"], t["cross_attention_dim"]) == (128, 4096, 1152)
    assert (te["d_model"], te["num_layers"], te["num_heads"], te["d_ff"], te["d_kv"]) == (4096, 24, 64, 10240, 64)
    assert te["feed_forward_proj"] == "gated-gelu" and cfg["vae"]["scaling_factor"] == 0.13025
    assert "PixArt-Sigma-XL-2-1024-MS" in cfg["description"]


def test_sd3_medium_config_is_the_published_one():
    cfg = models.load_config("sd3-medium")
    t, vae = cfg["transformer"], cfg["vae"]
    assert (t["num_layers"], t["num_attention_heads"], t["attention_head_dim"], t["patch_size"]) == (24, 24, 64, 2)
    assert (t["sample_size"], t["pooled_projection_dim"], t["caption_projection_dim"]) == (128, 2048, 1536)
    assert (t["joint_attention_dim"], t["in_channels"], t["out_channels"]) == (4096, 16, 16)
    assert (vae["latent_channels"], vae["shift_factor"], vae["scaling_factor"]) == (16, 0.0609, 1.5305)
    clip_g = cfg["text_encoder_2"]
    assert (clip_g["hidden_size"], clip_g["num_hidden_layers"], clip_g["projection_dim"]) == (1280, 32, 1280)
    assert cfg["text_encoder_3"]["d_model"] == t["joint_attention_dim"]
    assert cfg["text_encoder"]["projection_dim"] + clip_g["projection_dim"] == t["pooled_projection_dim"]
    assert "stable-diffusion-3-medium-diffusers" in cfg["description"]


def test_sd3_pipeline_has_three_offline_tokenizers():
    pipe = models.build_pipeline("tiny-sd3")
    assert type(pipe).__name__ == "StableDiffusion3Pipeline"
    assert type(pipe.tokenizer).__name__ == type(pipe.tokenizer_2).__name__ == "CLIPTokenizer"
    assert type(pipe.tokenizer_3).__name__.startswith("T5Tokenizer")  # transformers 5 names the fast one so
    assert type(pipe.text_encoder_3).__name__ == "T5EncoderModel"


def test_flux_dev_config_is_the_published_one():
    cfg = models.load_config("flux-dev")
    t, vae = cfg["transformer"], cfg["vae"]
    blocks = (t["num_layers"], t["num_single_layers"], t["num_attention_heads"], t["attention_head_dim"])
    assert blocks == (19, 38, 24, 128)
    widths = (t["patch_size"], t["in_channels"], t["joint_attention_dim"], t["pooled_projection_dim"])
    assert widths == (1, 64, 4096, 768)
    assert t["guidance_embeds"] is True and t["axes_dims_rope"] == [16, 56, 56]
    assert sum(t["axes_dims_rope"]) == t["attention_head_dim"]
    assert (vae["latent_channels"], vae["shift_factor"], vae["scaling_factor"]) == (16, 0.1159, 0.3611)
    assert 4 * vae["latent_channels"] == t["in_channels"]  # latents packed 2x2
    clip, t5 = cfg["text_encoder"], cfg["text_encoder_2"]
    assert clip["class"] == "CLIPTextModel" and clip["hidden_size"] == t["pooled_projection_dim"]
    assert t5["class"] == "T5EncoderModel" and t5["d_model"] == t["joint_attention_dim"]
    sched = cfg["scheduler"]
    assert sched["class"] == "FlowMatchEulerDiscreteScheduler" and sched["use_dynamic_shifting"] is True
    assert "black-forest-labs/FLUX.1-dev" in cfg["description"]


def test_flux_pipeline_has_two_offline_tokenizers():
    pipe = models.build_pipeline("tiny-flux")
    assert type(pipe).__name__ == "FluxPipeline"
    assert type(pipe.tokenizer).__name__ == "CLIPTokenizer" and type(pipe.text_encoder).__name__ == "CLIPTextModel"
    assert type(pipe.tokenizer_2).__name__.startswith("T5Tokenizer")  # transformers 5 names the fast one so
    assert type(pipe.text_encoder_2).__name__ == "T5EncoderModel"


def _run(pipe, **kw):
    gen = torch.Generator().manual_seed(0)
    return pipe("a photo", num_inference_steps=2, generator=gen, output_type="np", **kw).images


@pytest.mark.parametrize("name", ["tiny", "tiny-xl", "tiny-pixart", "tiny-sd3", "tiny-flux"])
def test_random_pipeline_runs(name):
    pipe = models.build_pipeline(name)
    # PixArt's pipeline bins the size to its table for sample_size 32 (256²) unless told not to
    if "pixart" in name:
        images = _run(pipe, use_resolution_binning=False, height=64, width=64)
    elif "sd3" in name or "flux" in name:  # SD3's default size is 128² here (sample_size 32 × the tiny VAE's 4),
        # FLUX's 512² (its pipeline's 128 × 4)
        images = _run(pipe, height=64, width=64, max_sequence_length=16)
    else:
        images = _run(pipe)
    assert images.shape == (1, 64, 64, 3) and (images >= 0).all() and (images <= 1).all()


def test_seeded_weights_are_reproducible():
    a = models.build_pipeline("tiny", seed=3).unet
    b = models.build_pipeline("tiny", seed=3).unet
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_save_and_load_from_directory(tmp_path):
    pipe = models.build_pipeline("tiny")
    pipe.save_pretrained(tmp_path / "pipe")
    loaded = models.load_pipeline(str(tmp_path / "pipe"))
    assert type(loaded) is type(pipe)
    assert torch.equal(torch.as_tensor(_run(pipe)), torch.as_tensor(_run(loaded)))


def test_missing_directory_is_a_clear_error(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="neither a shipped config"):
        models.load_pipeline(str(tmp_path / "nope"))
    # "models/my-sdxl" has a hub id's form: asked of the hub, whose error says it is no local folder either where a
    # models/ folder is here (a mistyped path, most likely)
    (tmp_path / "models").mkdir()
    monkeypatch.chdir(tmp_path)
    assert models.is_hub_id("someone/model") and models.is_hub_id("models/my-sdxl")

    def offline(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files")

    monkeypatch.setattr("huggingface_hub.hf_hub_download", offline)
    with pytest.raises(OSError, match=r"couldn't connect .* \(nor is there a local folder models/my-sdxl, though "
                                      r"models/ is here\)"):
        models.model_facts("models/my-sdxl")
    with pytest.raises(OSError, match="couldn't connect to 'https://huggingface.co' to load the files$"):
        models.model_facts("someone/model")
