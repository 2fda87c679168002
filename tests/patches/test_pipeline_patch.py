"""The whole patch on tiny pipelines (SD1.x and SDXL shaped): every module kind that should be
replaced is, counted from the model's structure; text-to-image, image-to-image and inpainting run
patched; ``ops`` / ``ignore`` honoured; unpatch restores the very objects; pipelines sharing models;
what is left alone is reported."""

import copy

import diffusers
import numpy as np
import pytest
import torch
import torch.nn as nn
from diffusers.models.activations import GEGLU
from diffusers.models.attention import BasicTransformerBlock
from diffusers.models.attention_processor import Attention, AttnProcessor2_0
from diffusers.models.resnet import ResnetBlock2D
from sd_kernels.patches import patch_record
from sd_kernels.patches.group_norm import FusedGroupNorm

import sd_kernels
from sd_kernels import models
from sd_kernels.testing import assert_close_to_reference

VARIANTS = {  # config → pipeline classes built from the same components
    "tiny": ("StableDiffusionPipeline", "StableDiffusionImg2ImgPipeline", "StableDiffusionInpaintPipeline"),
    "tiny-xl": ("StableDiffusionXLPipeline", "StableDiffusionXLImg2ImgPipeline",
                "StableDiffusionXLInpaintPipeline"),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def pipe(request):
    p = models.build_pipeline(request.param)
    p.set_progress_bar_config(disable=True)
    return p


def _inputs(kind: str) -> dict:
    g = torch.Generator().manual_seed(5)
    image = torch.rand(1, 3, 64, 64, generator=g)
    mask = (torch.rand(1, 1, 64, 64, generator=g) > 0.5).float()
    return {"text": {}, "img2img": {"image": image, "strength": 0.75},
            "inpaint": {"image": image, "mask_image": mask, "strength": 0.75}}[kind]


def _run(pipe, **kwargs) -> np.ndarray:
    return pipe(prompt="a cat", num_inference_steps=2, height=64, width=64, output_type="np",
                generator=torch.Generator().manual_seed(0), **kwargs).images


def _census(model: nn.Module) -> dict[str, int]:
    """What the patch should replace in ``model``, counted before patching."""
    from diffusers.models.autoencoders.vae import Decoder, Encoder
    from diffusers.models.unets.unet_2d_condition import UNet2DConditionModel
    from diffusers.models.upsampling import Upsample2D

    return {
        "attention_processor": sum(isinstance(m, Attention) and type(m.processor) is AttnProcessor2_0
                                   for m in model.modules()),
        # each self-attention's q, k, v laid out as one GEMM (patches/qkv_fusion.py)
        "qkv_fusion": sum(isinstance(m, Attention) and type(m.processor) is AttnProcessor2_0
                          and not m.is_cross_attention for m in model.modules()),
        "gelu.GEGLU": sum(type(m) is GEGLU for m in model.modules()),
        "norms": sum(type(m) is nn.GroupNorm for m in model.modules()),
        "resnet_fused_forward": sum(type(m) is ResnetBlock2D for m in model.modules()),
        "silu_folded": sum(type(m) in (UNet2DConditionModel, Encoder, Decoder) for m in model.modules()),
        "upsample.polyphase": sum(type(m) is Upsample2D and m.use_conv and not m.use_conv_transpose
                                  for m in model.modules()),
        # the cross-attentions' keys and values of the text as one GEMM (patches/text_projections.py)
        "text_kv": sum(isinstance(m, Attention) and type(m.processor) is AttnProcessor2_0 and m.is_cross_attention
                       for m in model.modules()) if isinstance(model, UNet2DConditionModel) else 0,
        # the convolutions' biases added by ops.bias_residual (patches/conv_bias.py)
        "conv_bias_add": sum(type(m) is nn.Conv2d and m.bias is not None for m in model.modules()),
        # each residual add and the LayerNorm after it in one kernel (patches/layer_norm.py)
        "layer_norm.LayerNormBlock": sum(type(m) is BasicTransformerBlock and m.norm_type == "layer_norm"
                                         for m in model.modules()),
    }


def _tree(model: nn.Module) -> list:
    """Every module and processor object, in order: identity is what unpatch must restore."""
    return [(name, m, getattr(m, "processor", None)) for name, m in model.named_modules()]


def test_every_kind_replaced_and_restored(pipe):
    census = [_census(pipe.unet), _census(pipe.vae)]
    expected = {k: census[0][k] + census[1][k] for k in census[0]}
    trees = [_tree(pipe.unet), _tree(pipe.vae)]
    params = [dict(m.state_dict(keep_vars=True)) for m in (pipe.unet, pipe.vae)]
    record = sd_kernels.patch(pipe)
    counts, patched_trees = dict(record.counts), [_tree(pipe.unet), _tree(pipe.vae)]
    assert counts.pop("group_norm", 0) + counts.pop("group_norm_silu") == expected.pop("norms")
    assert counts == expected and all(v > 0 for v in expected.values())
    for model in (pipe.unet, pipe.vae):  # nothing of the replaced kinds is left
        assert not any(type(m) in (nn.GroupNorm, GEGLU) for m in model.modules())
        assert not any(type(getattr(m, "processor", None)) is AttnProcessor2_0 for m in model.modules())
    for model, before in zip((pipe.unet, pipe.vae), params):  # parameters: the same objects, nothing new
        now = model.state_dict(keep_vars=True)
        assert now.keys() == before.keys() and all(now[k] is before[k] for k in before)
    assert sd_kernels.patch(pipe) is record  # idempotent: nothing re-done
    for model, before in zip((pipe.unet, pipe.vae), patched_trees):
        assert _same(_tree(model), before)
    assert sd_kernels.unpatch(pipe)
    for model, before in zip((pipe.unet, pipe.vae), trees):
        assert _same(_tree(model), before)
        assert "forward" not in vars(model) and not hasattr(model, "_sd_kernels_owner")


def _same(tree, other) -> bool:
    return len(tree) == len(other) and all(
        a[0] == b[0] and a[1] is b[1] and a[2] is b[2] for a, b in zip(tree, other))


@pytest.mark.parametrize("kind", ["text", "img2img", "inpaint"])
def test_runs_patched_exactly_as_stock_with_reference_ops(pipe, kind, monkeypatch):
    """With SD_KERNELS_BACKEND=reference every patched module computes what stock computes, in the
    same order: images are bit-identical, which checks the plumbing (calling conventions, SDXL's
    added conditions, fused SiLUs skipped exactly once) of every pipeline kind."""
    variant = getattr(diffusers, VARIANTS["tiny-xl" if "XL" in type(pipe).__name__ else "tiny"][
        ["text", "img2img", "inpaint"].index(kind)])(**pipe.components)
    variant.set_progress_bar_config(disable=True)
    stock = _run(variant, **_inputs(kind))
    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    with sd_kernels.patched(variant) as record:
        assert record.counts["attention_processor"] > 0
        patched = _run(variant, **_inputs(kind))
    assert np.array_equal(patched, stock)
    assert np.array_equal(_run(variant, **_inputs(kind)), stock)  # and after unpatch


@pytest.mark.integration
def test_unet_step_through_kernels(pipe):
    """One UNet call with the kernels (interpreter on CPU), SDXL's added conditions included, against
    a float64 copy."""
    unet = pipe.unet
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 4, 8, 8, generator=g)
    ctx = torch.randn(2, 7, unet.config.cross_attention_dim, generator=g)
    kwargs = {}
    if unet.config.addition_embed_type == "text_time":
        n_text = unet.config.projection_class_embeddings_input_dim - 6 * unet.config.addition_time_embed_dim
        kwargs["added_cond_kwargs"] = {"text_embeds": torch.randn(2, n_text, generator=g),
                                       "time_ids": torch.tensor([[64.0, 64, 0, 0, 64, 64]] * 2)}

    def run(model, dtype=torch.float32):
        cast = lambda t: t.to(dtype) if t.is_floating_point() else t
        kw = {k: {n: cast(t) for n, t in v.items()} for k, v in kwargs.items()}
        with torch.no_grad():
            return model(cast(x), torch.tensor(10), encoder_hidden_states=cast(ctx), **kw).sample

    stock, ref64 = run(unet), run(copy.deepcopy(unet).double(), torch.float64)
    with sd_kernels.patched(unet):
        assert_close_to_reference(run(unet), stock, ref64)
    assert torch.equal(run(unet), stock)


def test_ops_and_ignore_are_honoured(pipe):
    with sd_kernels.patched(pipe, ops=["gelu"], ignore=("vae",)) as record:
        assert record.parts == ["unet"] and set(record.counts) == {"gelu.GEGLU"}
        assert not any(isinstance(m, FusedGroupNorm) for m in pipe.unet.modules())
        assert not any(type(m).__module__.startswith("sd_kernels") for m in pipe.vae.modules())
    with sd_kernels.patched(pipe, ops=["group_norm", "attention"]) as record:
        assert not any(k.startswith("gelu") for k in record.counts)
        assert any(isinstance(m, FusedGroupNorm) for m in pipe.vae.modules())
        assert sd_kernels.patch(pipe, ops=["gelu"]) is not record  # other arguments: re-patched
        assert set(patch_record(pipe).counts) == {"gelu.GEGLU"}
    assert patch_record(pipe) is None


def test_pipelines_sharing_models_are_not_patched_twice(pipe):
    other = type(pipe)(**pipe.components)
    with sd_kernels.patched(pipe):
        with pytest.raises(ValueError, match="already patched through another object"):
            sd_kernels.patch(other)
        with pytest.raises(ValueError, match="already patched through another object"):
            sd_kernels.patch(pipe.unet)
        with sd_kernels.patched(other, ignore=("unet", "vae")):  # nothing shared asked for: fine
            pass
    with sd_kernels.patched(other) as record:
        assert record.counts["attention_processor"] > 0


class OwnProcessor(AttnProcessor2_0):
    """A user's processor (a subclass: its behaviour may differ from the stock one)."""


class OwnGroupNorm(nn.GroupNorm):
    pass


def test_unknown_modules_are_left_alone_and_reported(pipe):
    unet = pipe.unet
    name, attn = next((n, m) for n, m in unet.named_modules() if isinstance(m, Attention))
    stock_processor, own_processor = attn.processor, OwnProcessor()
    attn.processor = own_processor
    parent = unet.conv_norm_out
    own_norm = OwnGroupNorm(parent.num_groups, parent.num_channels)
    unet.conv_norm_out = own_norm
    try:
        with sd_kernels.patched(pipe) as record:
            assert attn.processor is own_processor and unet.conv_norm_out is own_norm
            assert type(unet.conv_act) is nn.SiLU  # not folded: its norm is not ours
            skipped = {(s.path, s.what) for s in record.skipped}
            assert (f"unet.{name}", "OwnProcessor") in skipped
            assert ("unet.conv_norm_out", "OwnGroupNorm") in skipped
            text = record.format()
            assert "left alone" in text and "OwnProcessor ×1" in text and "OwnGroupNorm ×1" in text
        assert attn.processor is own_processor and unet.conv_norm_out is own_norm
    finally:
        attn.processor, unet.conv_norm_out = stock_processor, parent


@pytest.mark.parametrize(
    "kwargs, match",
    [({"cuda_graph": True}, "needs the UNet2DConditionModel on one CUDA device"),
     ({"cuda_graph": True, "ignore": ("unet",)}, "no UNet2DConditionModel")],
)
def test_cuda_graph_bad_input(pipe, kwargs, match):
    with pytest.raises(ValueError, match=match):
        sd_kernels.patch(pipe, **kwargs)
    assert patch_record(pipe) is None and "forward" not in vars(pipe.unet)


class Parts:
    """A stand-in pipeline: only ``components`` matters to the patch."""

    def __init__(self, **components):
        self.components = components


def test_unsupported_pipeline_lists_what_is_supported():
    with pytest.raises(TypeError, match=r"\(it has unet: Linear, transformer: Linear\); supported: unet, vae, "
                                        r"controlnet, transformer as UNet2DConditionModel, AutoencoderKL, "
                                        r"ControlNetModel, MultiControlNetModel, PixArtTransformer2DModel, "
                                        r"SD3Transformer2DModel, FluxTransformer2DModel"):
        sd_kernels.patch(Parts(unet=nn.Linear(2, 2), transformer=nn.Linear(2, 2)))


def test_a_transformer_pipeline_patches_its_vae_and_says_the_transformer_is_left_alone(pipe, caplog):
    """A DiT pipeline whose transformer no family names (Sana; PixArt's, SD3's and FLUX's have one:
    test_pixart_patch.py, test_sd3_patch.py, test_flux_patch.py). The VAE is patched, the transformer
    (and any other model no family names) is in the record, and a warning says so."""
    import logging

    from diffusers import SanaTransformer2DModel

    transformer = SanaTransformer2DModel(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8,
                                         num_layers=1, num_cross_attention_heads=2, cross_attention_head_dim=8,
                                         cross_attention_dim=16, caption_channels=16, sample_size=8, patch_size=1)
    dit = Parts(transformer=transformer, vae=pipe.vae, image_encoder=nn.Linear(2, 2))
    with caplog.at_level(logging.WARNING, logger="sd_kernels"), sd_kernels.patched(dit) as record:
        assert record.parts == ["vae"] and record.counts["group_norm_silu"] > 0
        skipped = {(k.path, k.what) for k in record.skipped}
        assert {("transformer", "SanaTransformer2DModel"), ("image_encoder", "Linear")} <= skipped
        assert "transformer" in record.format() and "left as diffusers ships it" in record.format()
    warned = [r.getMessage() for r in caplog.records if "has no family" in r.getMessage()]
    assert len(warned) == 1 and "transformer of this Parts (SanaTransformer2DModel)" in warned[0]
    assert "image_encoder" not in warned[0]  # recorded, not warned about: not a denoiser


def test_an_unsupported_part_is_reported_and_the_rest_patched(pipe):
    other = Parts(unet=nn.Linear(2, 2), vae=pipe.vae)
    with sd_kernels.patched(other) as record:
        assert record.parts == ["vae"] and record.counts["group_norm_silu"] > 0
        assert record.skipped[0] == type(record.skipped[0])("unet", "Linear", record.skipped[0].reason)
        assert "not a supported model" in record.format()
