"""The "attention" patcher: stock processors swapped for SDKernelsAttnProcessor, exactly undone."""

import copy
import importlib

import pytest
import torch
from diffusers import AutoencoderKL, UNet2DConditionModel
from diffusers.models.attention_processor import (
    Attention,
    AttnAddedKVProcessor,
    AttnProcessor,
    AttnProcessor2_0,
    FusedAttnProcessor2_0,
)
from sd_kernels.patches.record import PatchRecord

import sd_kernels
from sd_kernels.runtime import dispatch
from sd_kernels.testing import assert_close_to_reference

attn_patch = importlib.import_module("sd_kernels.patches.attention")  # registers the "attention" patcher
attn_mod = importlib.import_module("sd_kernels.ops.attention")
steps = importlib.import_module("sd_kernels.patches.attention_processor_steps")


def tiny_unet() -> UNet2DConditionModel:
    torch.manual_seed(0)
    return UNet2DConditionModel(
        block_out_channels=(32, 64), layers_per_block=1, sample_size=8, in_channels=4, out_channels=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=32,
    ).eval()


def tiny_vae() -> AutoencoderKL:
    """Its mid-block attention: 1 head, d = 64, group_norm, residual connection, 4-D hidden states."""
    torch.manual_seed(0)
    return AutoencoderKL(
        block_out_channels=(32, 64), layers_per_block=1, latent_channels=4, norm_num_groups=32,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
    ).eval()


def unet_out(unet, mask=False):
    """A 4x4 latent (16 and 4 queries: the processor is under test here, the kernels' tiling in
    tests/ops/test_attention.py) and SD's 77 text tokens, with a padding mask if ``mask``."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 4, 4, generator=g).to(unet.dtype)
    ctx = torch.randn(2, 77, 32, generator=g).to(unet.dtype)
    kwargs = {}
    if mask:  # padding mask for the text tokens: diffusers turns it into an additive bias
        keep = torch.ones(2, 77, dtype=torch.bool)
        keep[1, 40:] = False
        kwargs["encoder_attention_mask"] = keep
    with torch.no_grad():
        return unet(x, 10, encoder_hidden_states=ctx, **kwargs).sample


def vae_out(vae):
    z = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(2)).to(vae.dtype)
    with torch.no_grad():
        return vae.decode(z).sample


def processors(model):
    return {name: m.processor for name, m in model.named_modules() if isinstance(m, Attention)}


def params(model):
    return model.state_dict(keep_vars=True)


def round_trip(model, run, **run_kwargs):
    """Patch, compare with the stock model and a float64 copy, unpatch, compare bit for bit."""
    before, ps = processors(model), params(model)
    stock = run(model, **run_kwargs)
    ref64 = run(copy.deepcopy(model).double(), **run_kwargs)
    record = sd_kernels.patch(model, ops=["attention"])
    stock_kinds = (AttnProcessor2_0, AttnProcessor, FusedAttnProcessor2_0)
    n = sum(type(p) in stock_kinds for p in before.values())
    # each self-attention's q, k, v laid out as one GEMM (patches/qkv_fusion.py) unless diffusers fused them
    selfs = sum(type(p) in stock_kinds and type(p) is not FusedAttnProcessor2_0 and not m.is_cross_attention
                for m, p in ((dict(model.named_modules())[k], p) for k, p in before.items()))
    # the cross-attentions' keys and values of the text as one GEMM a width (patches/text_projections.py), two or more
    crosses = sum(type(p) in stock_kinds and type(p) is not FusedAttnProcessor2_0 and m.is_cross_attention
                  for m, p in ((dict(model.named_modules())[k], p) for k, p in before.items()))
    assert n > 0 and record.counts == {"attention_processor": n, **({"qkv_fusion": selfs} if selfs else {}),
                                       **({"text_kv": crosses} if crosses > 1 else {})}
    assert all(type(p) is attn_patch.SDKernelsAttnProcessor for p in processors(model).values())
    dispatch.reset_fallbacks()
    assert_close_to_reference(run(model, **run_kwargs), stock, ref64)
    assert not dispatch.fallbacks()  # the kernels ran (the interpreter on CPU), not the reference
    assert sd_kernels.unpatch(model)
    after = processors(model)
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)
    now = params(model)
    assert now.keys() == ps.keys() and all(now[k] is ps[k] for k in ps)
    assert torch.equal(run(model, **run_kwargs), stock)
    return n


@pytest.mark.integration
@pytest.mark.parametrize("mask", [False, True], ids=["no-mask", "text-mask"])
def test_unet(mask):
    n = round_trip(tiny_unet(), unet_out, mask=mask)
    assert n == 8  # self + cross attention in 4 transformer blocks (down 1, mid 1, up 2)


@pytest.mark.integration
@pytest.mark.parametrize("mask", [False, True], ids=["no-mask", "text-mask"])
def test_unet_with_fused_qkv_projections(mask):
    """After diffusers' ``fuse_qkv_projections()`` (FusedAttnProcessor2_0: one to_qkv GEMM for
    self-attention, to_q + to_kv for cross-attention) the kernels serve the fused processors too."""
    unet = tiny_unet()
    unet.fuse_qkv_projections()
    assert {type(p) for p in processors(unet).values()} == {FusedAttnProcessor2_0}
    assert round_trip(unet, unet_out, mask=mask) == 8
    assert {type(p) for p in processors(unet).values()} == {FusedAttnProcessor2_0}


@pytest.mark.parametrize("model", [tiny_unet, tiny_vae])
def test_fusing_while_patched_then_unfusing_after_unpatch_gives_the_stock_processors_back(model):
    """diffusers' fuse_qkv_projections() keeps the processors it finds for unfuse_qkv_projections():
    fused while patched, those are ours, and unpatch makes them the stock ones again."""
    model = model()
    before = dict(model.attn_processors)
    sd_kernels.patch(model, ops=["attention"])
    model.fuse_qkv_projections()
    sd_kernels.unpatch(model)
    model.unfuse_qkv_projections()
    after = model.attn_processors
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)
    assert sd_kernels.patch(model, ops=["attention"]).counts["attention_processor"] == len(before)
    sd_kernels.unpatch(model)


@pytest.mark.integration
def test_self_attention_is_one_gemm_after_diffusers_fused_and_unfused_it():
    """diffusers' ``unfuse_qkv_projections()`` of a UNet puts its processors back but leaves each attention's
    ``fused_projections`` flag set (and its ``to_qkv``): the stock processors call q, k and v one by one, so the
    patch still lays each self-attention's three out as one GEMM; a cross-attention's stay apart."""
    unet = tiny_unet()
    unet.fuse_qkv_projections()
    unet.unfuse_qkv_projections()
    attentions = [m for m in unet.modules() if isinstance(m, Attention)]
    assert all(m.fused_projections for m in attentions)
    stock, ref64 = unet_out(unet), unet_out(copy.deepcopy(unet).double())
    with sd_kernels.patched(unet, ops=["attention"]) as record:
        served = [m.processor.qkv is not None for m in attentions]
        assert served == [not m.is_cross_attention for m in attentions] and record.counts["qkv_fusion"] == 4
        assert_close_to_reference(unet_out(unet), stock, ref64)


def test_fused_vae_attention():
    vae = tiny_vae()
    vae.fuse_qkv_projections()
    assert round_trip(vae, vae_out) == 2  # the encoder's and the decoder's mid-block attention


@pytest.mark.parametrize("path", ["flash", "partial_softmax"])
def test_vae(path, monkeypatch):
    if path == "partial_softmax":  # as for SD's VAE (d = 512 > 256): here d = 64, so force it
        monkeypatch.setattr(attn_mod, "FLASH_MAX_HEAD_DIM", 32)
    vae = tiny_vae()
    mid = vae.decoder.mid_block.attentions[0]
    assert mid.heads == 1 and mid.group_norm is not None and mid.residual_connection
    calls = []
    choose = attn_mod._choose_path
    monkeypatch.setattr(attn_mod, "_PLANS", {})  # earlier tests' plans would skip the choice being watched
    monkeypatch.setattr(attn_mod, "_choose_path", lambda *a: calls.append(choose(*a)) or calls[-1])
    round_trip(vae, vae_out)
    assert set(calls) == {path}


@pytest.mark.parametrize("factor", [1.0, 2.0])
def test_rescale_output_factor_divides_unless_it_is_one(factor, monkeypatch):
    vae = tiny_vae()
    mid = vae.decoder.mid_block.attentions[0]
    mid.rescale_output_factor = factor
    inside, divisions = [False], []
    mid.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
    mid.register_forward_hook(lambda *_: inside.__setitem__(0, False))
    divide = torch.Tensor.__truediv__
    monkeypatch.setattr(torch.Tensor, "__truediv__",
                        lambda a, b: (inside[0] and divisions.append(b)) or divide(a, b))
    round_trip(vae, vae_out)  # the same output as the stock processor's, which divides by any factor
    divisions.clear()
    with sd_kernels.patched(vae, ops=["attention"]):
        vae_out(vae)
    assert divisions == ([] if factor == 1 else [factor])  # x / 1 is x: no kernel for it


def test_legacy_processor_keeps_its_scale_and_custom_processors_stay():
    """AttnProcessor (diffusers' choice when scale_qk=False) is mirrored with attn.scale; other processors
    (here AttnAddedKVProcessor, as LoRA / IP-adapter ones would be) are left alone."""
    torch.manual_seed(0)
    legacy = Attention(16, heads=2, dim_head=8, scale_qk=False)
    custom = Attention(16, heads=2, dim_head=8, added_kv_proj_dim=16, processor=AttnAddedKVProcessor())
    holder = torch.nn.ModuleList([legacy, custom]).eval()
    assert type(legacy.processor) is AttnProcessor and legacy.scale == 1.0
    x = torch.randn(2, 5, 16)
    stock = legacy(x)
    ref64 = copy.deepcopy(legacy).double()(x.double())
    custom_processor = custom.processor
    record = PatchRecord(("attention",), "cpu", ["test"])
    attn_patch.patch_attention(holder, record)
    assert record.counts == {"attention_processor": 1, "qkv_fusion": 1} and custom.processor is custom_processor
    assert legacy.processor.legacy and legacy.processor.qkv is not None
    assert_close_to_reference(legacy(x), stock, ref64)
    record.undo()
    assert type(legacy.processor) is AttnProcessor


@pytest.mark.parametrize("name", ["AttnProcessor2_0.__call__", "AttnProcessor.__call__"])  # (fused: as 2_0)
def test_a_changed_diffusers_processor_is_left_alone(name, monkeypatch):
    """SDKernelsAttnProcessor re-states diffusers 0.42.1's processors: under a diffusers whose processor
    source differs (here: a changed hash), the stock processor stays and the record says why."""
    verified = importlib.import_module("sd_kernels.patches.diffusers_sources")
    assert all(verified.is_verified(cls.__call__) for cls in (AttnProcessor2_0, AttnProcessor))
    monkeypatch.setitem(verified.VERIFIED, name, "0" * 16)
    verified.is_verified.cache_clear()
    try:
        attn = Attention(16, heads=2, dim_head=8, scale_qk=not name.startswith("AttnProcessor."))
        processor = attn.processor
        assert f"{type(processor).__name__}.__call__" == name
        record = PatchRecord(("attention",), "cpu", ["test"])
        attn_patch.patch_attention(torch.nn.ModuleList([attn]), record)
        assert attn.processor is processor and not record.counts
        assert len(record.skipped) == 1 and "0.42.1" in record.skipped[0].reason
    finally:
        verified.is_verified.cache_clear()


def test_processor_output_layout_needs_no_copy(monkeypatch):
    """The attention output comes in q's [B, S, heads, D] layout, so diffusers' reshape is a view."""
    outs = []
    real = attn_mod.attention
    monkeypatch.setattr(steps, "attention", lambda *a, **k: outs.append(real(*a, **k)) or outs[-1])
    attn = Attention(32, heads=4, dim_head=8).eval()
    attn.processor = attn_patch.SDKernelsAttnProcessor()
    with torch.no_grad():
        attn(torch.randn(2, 9, 32))
    (out,) = outs
    assert out.shape == (2, 4, 9, 8) and out.transpose(1, 2).is_contiguous()
