"""The "group_norm" patcher on tiny diffusers models: outputs ≈ stock through the kernels, counts of
each kind of replacement, parameters untouched, unpatch bit-identical."""

import copy
import importlib

import pytest
import torch
import torch.nn as nn
from diffusers import AutoencoderKL, UNet2DConditionModel
from diffusers.models.resnet import ResnetBlock2D
from sd_kernels.patches import patch, patched, unpatch
from sd_kernels.patches.record import PatchRecord

from sd_kernels.runtime import dispatch
from sd_kernels.testing import assert_close_to_reference

gn_patch = importlib.import_module("sd_kernels.patches.group_norm")
FusedGroupNorm = gn_patch.FusedGroupNorm


def tiny_unet(**overrides) -> UNet2DConditionModel:
    config = dict(block_out_channels=(32, 64), layers_per_block=1, sample_size=8, in_channels=4,
                  out_channels=4,
                  down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                  up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
                  cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8)
    return UNet2DConditionModel(**{**config, **overrides}).eval()


def tiny_vae() -> AutoencoderKL:
    return AutoencoderKL(block_out_channels=(32, 64), layers_per_block=1, norm_num_groups=8,
                         latent_channels=4, down_block_types=("DownEncoderBlock2D",) * 2,
                         up_block_types=("UpDecoderBlock2D",) * 2, sample_size=16).eval()


def _unet_call(model, dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    args = (torch.randn(2, 4, 8, 8, generator=g), torch.tensor([10, 500]), torch.randn(2, 7, 32, generator=g))
    dev = model.device
    return lambda m: m(args[0].to(dev, dtype), args[1].to(dev), args[2].to(dev, dtype)).sample


def _vae_call(model, dtype=torch.float32):
    x = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    return lambda m: m(x.to(model.device, dtype)).sample


def _params(model):
    return model.state_dict(keep_vars=True)


def _expected_counts(model, fused_resnets: bool = True) -> dict[str, int]:
    """The record's counts, from the model's structure before patching."""
    from diffusers.models.autoencoders.vae import Decoder, Encoder

    plain = sum(type(m) is nn.GroupNorm for m in model.modules())
    resnets = [m for m in model.modules() if type(m) is ResnetBlock2D] if fused_resnets else []
    norm_outs = sum(type(m) in (UNet2DConditionModel, Encoder, Decoder) and type(m.conv_act) is nn.SiLU
                    for m in model.modules())
    silu_norms = sum(1 + (r.time_embedding_norm != "scale_shift") for r in resnets) + norm_outs
    counts = {"group_norm_silu": silu_norms, "group_norm": plain - silu_norms,
              "resnet_fused_forward": len(resnets), "silu_folded": norm_outs}
    return {k: v for k, v in counts.items() if v}


MODELS = {
    "unet": (tiny_unet, _unet_call),
    "unet_scale_shift": (lambda: tiny_unet(resnet_time_scale_shift="scale_shift"), _unet_call),
    "unet_one_group": (lambda: tiny_unet(norm_num_groups=32), _unet_call),
    "vae": (tiny_vae, _vae_call),
}


@pytest.mark.integration
@pytest.mark.parametrize("name", list(MODELS))
def test_patch_tiny_model(name):
    build, call_of = MODELS[name]
    model = build()
    call = call_of(model)
    with torch.no_grad():
        stock = call(model)
        ref64 = call_of(model, torch.float64)(copy.deepcopy(model).double())
    params, expected = _params(model), _expected_counts(model)
    assert expected["resnet_fused_forward"] > 0 and expected["group_norm"] > 0

    record = PatchRecord(("group_norm",), "cpu", [name])
    gn_patch.patch_group_norm(model, record)
    assert dict(record.counts) == expected
    assert not any(type(m) is nn.GroupNorm for m in model.modules())  # every plain GroupNorm replaced
    assert all("forward" in vars(m) for m in model.modules() if type(m) is ResnetBlock2D)
    assert _params(model).keys() == params.keys()
    assert all(_params(model)[k] is v for k, v in params.items())  # the same Parameter objects

    dispatch.reset_fallbacks()
    with torch.no_grad():
        patched = call(model)
    assert not [k for k in dispatch.fallbacks() if k[0] == "group_norm"]  # the kernels ran
    assert_close_to_reference(patched, stock, ref64)

    record.undo()
    assert sum(type(m) is nn.GroupNorm for m in model.modules()) == sum(expected.get(k, 0) for k in
                                                                         ("group_norm", "group_norm_silu"))
    assert not any("forward" in vars(m) for m in model.modules())
    assert all(_params(model)[k] is v for k, v in params.items())
    with torch.no_grad():
        assert torch.equal(call(model), stock)


def test_patch_api_round_trip():
    """Through sd_kernels.patches.patch / unpatch, as users call it."""
    model = tiny_vae()
    call = _vae_call(model)
    with torch.no_grad():
        stock = call(model)
    record = patch(model, ops=["group_norm"])
    assert record.counts["group_norm_silu"] > 0
    assert isinstance(model.decoder.conv_norm_out, nn.GroupNorm)  # still a GroupNorm to inspectors
    assert type(model.decoder.conv_act) is nn.Identity
    assert type(model.decoder.mid_block.attentions[0].group_norm) is FusedGroupNorm
    assert unpatch(model)
    assert type(model.decoder.conv_act) is nn.SiLU
    with torch.no_grad():
        assert torch.equal(call(model), stock)


RESNETS = {  # ResnetBlock2D keyword arguments; each variant of its forward
    "default": dict(in_channels=16, out_channels=32, temb_channels=8, groups=4),
    "scale_shift": dict(in_channels=16, temb_channels=8, groups=4, time_embedding_norm="scale_shift"),
    "no_temb": dict(in_channels=16, temb_channels=None, groups=4, output_scale_factor=2.0),
    "up": dict(in_channels=16, temb_channels=8, groups=4, up=True),
    "down": dict(in_channels=16, temb_channels=8, groups=4, down=True, skip_time_act=True),
}


@pytest.mark.parametrize("variant", list(RESNETS))
def test_fused_resnet_forward_matches_diffusers(variant):
    block = ResnetBlock2D(**RESNETS[variant]).eval()
    x, temb = torch.randn(2, 16, 6, 6), torch.randn(2, 8)
    temb = None if block.time_emb_proj is None else temb
    with torch.no_grad():
        stock = block(x, temb)
        ref64 = copy.deepcopy(block).double()(x.double(), None if temb is None else temb.double())
    record = PatchRecord(("group_norm",), "cpu", ["block"])
    gn_patch.patch_group_norm(block, record)
    assert record.counts["resnet_fused_forward"] == 1
    assert block.norm2.activation == (None if variant == "scale_shift" else "silu")
    with torch.no_grad():
        assert_close_to_reference(block(x, temb), stock, ref64)
    record.undo()
    with torch.no_grad():
        assert torch.equal(block(x, temb), stock)


class _ConvSubclass(nn.Conv2d):  # what a LoRA or Winograd wrapper is to the fold: not a plain nn.Conv2d
    pass


@pytest.mark.parametrize("conv1", ["plain", "hooked", "subclass", "no_bias", "reference_backend"])
def test_conv1_bias_and_temb_fold_into_norm2(conv1, monkeypatch):
    """A plain, hook-free conv1 with a bias runs without it, and norm2 gets bias + temb as its shift;
    any other conv1 runs its own forward and the sum is added as diffusers adds it. Same outputs.
    SD_KERNELS_BACKEND=reference keeps stock's arithmetic: no fold, the very same output."""
    if conv1 == "reference_backend":
        monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    block = ResnetBlock2D(in_channels=16, out_channels=32, temb_channels=8, groups=4).eval()
    if conv1 == "subclass":
        block.conv1 = _ConvSubclass(16, 32, 3, padding=1)
    if conv1 == "no_bias":
        block.conv1.bias = None
    calls = []
    if conv1 == "hooked":
        block.conv1.register_forward_hook(lambda *_: calls.append(1))
    x, temb = torch.randn(2, 16, 6, 6), torch.randn(2, 8)
    with torch.no_grad():
        stock = block(x, temb)
        ref64 = copy.deepcopy(block).double()(x.double(), temb.double())
    calls.clear()
    gn_patch.patch_group_norm(block, PatchRecord(("group_norm",), "cpu", ["block"]))
    shifts = []
    norm = gn_patch.group_norm
    monkeypatch.setattr(gn_patch, "group_norm", lambda *a: shifts.append(a[6]) or norm(*a))
    with torch.no_grad():
        assert_close_to_reference(block(x, temb), stock, ref64)
    folded = shifts[1] is not None  # norm1, norm2
    assert folded == (conv1 == "plain") and shifts[0] is None
    assert calls == ([1] if conv1 == "hooked" else [])
    if conv1 == "reference_backend":
        with torch.no_grad():
            assert torch.equal(block(x, temb), stock)
    if folded:
        want = block.time_emb_proj(torch.nn.functional.silu(temb)) + block.conv1.bias
        assert shifts[1].dtype == torch.float32 and torch.allclose(shifts[1], want)


@pytest.mark.parametrize("case", ["plain", "shortcut", "channels_last", "hooked", "subclass", "no_bias", "training",
                                  "reference_backend"])
def test_conv2_bias_shortcut_and_scale_in_one_pass(case, monkeypatch):
    """A plain, hook-free conv2 with a bias (and a plain shortcut conv) runs without its bias, and the biases,
    the shortcut and / output_scale_factor are one ``bias_residual`` pass; otherwise diffusers' lines. Same
    outputs; the reference backend exact."""
    if case == "reference_backend":
        monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    out_channels = 32 if case == "shortcut" else 16
    block = ResnetBlock2D(in_channels=16, out_channels=out_channels, temb_channels=None, groups=4,
                          output_scale_factor=2.0).eval()
    if case == "subclass":
        block.conv2 = _ConvSubclass(16, 16, 3, padding=1)
    if case == "no_bias":
        block.conv2.bias = None
    if case == "hooked":
        block.conv2.register_forward_hook(lambda *_: None)
    x = torch.randn(2, 16, 6, 6)
    if case == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        stock = block(x, None)
        ref64 = copy.deepcopy(block).double()(x.double(), None)
    gn_patch.patch_group_norm(block, PatchRecord(("group_norm",), "cpu", ["block"]))
    tails, shifts = [], []
    tail, norm = gn_patch.bias_residual, gn_patch.group_norm
    monkeypatch.setattr(gn_patch, "bias_residual", lambda *a, **k: tails.append(a) or tail(*a, **k))
    monkeypatch.setattr(gn_patch, "group_norm", lambda *a: shifts.append(a[6]) or norm(*a))
    if case == "training":  # dropout 0: the same function, by diffusers' tail
        block.train()
    with torch.no_grad():
        got = block(x, None)
    assert_close_to_reference(got, stock, ref64)
    fused = case in ("plain", "shortcut", "channels_last")
    assert len(tails) == int(fused)
    assert shifts[1] is None  # no time embedding: conv1's bias is added as diffusers adds it (_folds_into_norm2)
    if case == "shortcut":
        assert tails[0][3] is block.conv_shortcut.bias and tails[0][4] == 2.0
    if case == "reference_backend":
        with torch.no_grad():
            assert torch.equal(block(x, None), stock)


def test_resnet_without_silu_only_swaps_norms():
    block = ResnetBlock2D(in_channels=16, temb_channels=8, groups=4, non_linearity="mish").eval()
    record = PatchRecord(("group_norm",), "cpu", ["block"])
    gn_patch.patch_group_norm(block, record)
    assert dict(record.counts) == {"group_norm": 2}
    assert "forward" not in vars(block) and block.norm1.activation is None


def test_unknown_diffusers_forward_is_not_mirrored(monkeypatch):
    """If diffusers' ResnetBlock2D.forward is not the one we copied, fall back to plain norm swaps."""
    verified = importlib.import_module("sd_kernels.patches.diffusers_sources")
    assert gn_patch.resnet_forward_is_known()  # the installed diffusers is the mirrored one
    monkeypatch.setitem(verified.VERIFIED, "ResnetBlock2D.forward", "0" * 16)
    verified.is_verified.cache_clear()
    try:
        block = ResnetBlock2D(in_channels=16, temb_channels=8, groups=4).eval()
        record = PatchRecord(("group_norm",), "cpu", ["block"])
        gn_patch.patch_group_norm(block, record)
        assert dict(record.counts) == {"group_norm": 2} and "forward" not in vars(block)
        assert any("ResnetBlock2D.forward" in s.what for s in record.skipped)
    finally:
        verified.is_verified.cache_clear()


def test_subclasses_and_spatial_norm_are_left_alone():
    from diffusers.models.attention_processor import SpatialNorm

    class MyNorm(nn.GroupNorm):
        pass

    holder = nn.ModuleDict({"mine": MyNorm(2, 8), "spatial": SpatialNorm(32, 4)})
    record = PatchRecord(("group_norm",), "cpu", ["holder"])
    gn_patch.patch_group_norm(holder, record)
    assert type(holder["mine"]) is MyNorm and type(holder["spatial"]) is SpatialNorm
    # SpatialNorm's inner norm is a plain nn.GroupNorm called as one: swapped like any other
    assert dict(record.counts) == {"group_norm": 1} and type(holder["spatial"].norm_layer) is FusedGroupNorm


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["unet", "vae"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_patched_tiny_model(name, dtype):
    build, call_of = MODELS[name]
    model = build().cuda()
    with torch.no_grad():
        ref64 = call_of(model, torch.float64)(copy.deepcopy(model).double())
        model = model.to(dtype)
        call = call_of(model, dtype)
        stock = call(model)
        with patched(model, ops=["group_norm"], cuda_graph=False) as record:
            assert record.counts["resnet_fused_forward"] > 0
            assert_close_to_reference(call(model), stock, ref64)
        assert torch.equal(call(model), stock)
