"""patches/text_projections.py: a UNet's cross-attentions project the text to keys and values in one batched
GEMM a forward (one a projection width), each reading its blocks; the result stock's; a member changed, hooked or
given another context projects for itself; nothing joined where it cannot be; unpatch gives each weight storage of
its own, the same values."""

import copy

import pytest
import torch
import torch.nn as nn
from diffusers.models.attention_processor import Attention
from sd_kernels.patches import text_projections
from test_unet_blocks import _inputs, _run

import sd_kernels
from sd_kernels import models
from sd_kernels.testing import assert_close_to_reference


@pytest.fixture
def unet():
    return models.build_model("tiny", "unet")


def _cross(model):
    return [m for m in model.modules() if isinstance(m, Attention) and m.is_cross_attention]


@pytest.fixture
def products(monkeypatch):
    """The products made (each one's context) and each member's call: (attention, served from a product)."""
    made, served = [], []
    real_init, real_kv = text_projections._Product.__init__, text_projections.TextProjections.keys_values

    def init(self, *args):
        made.append(args[0])
        real_init(self, *args)

    def keys_values(self, attn, context):
        out = real_kv(self, attn, context)
        served.append((attn, out is not None))
        return out

    monkeypatch.setattr(text_projections._Product, "__init__", init)
    monkeypatch.setattr(text_projections.TextProjections, "keys_values", keys_values)
    return made, served


def test_one_gemm_a_forward_serves_every_cross_attention(unet, products, monkeypatch):
    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    made, served = products
    x, ctx = _inputs(unet)
    stock = _run(unet, x, ctx)
    ref64 = _run(copy.deepcopy(unet).double(), x, ctx, torch.float64)
    cross = _cross(unet)
    params = dict(unet.state_dict(keep_vars=True))
    values = {k: v.detach().clone() for k, v in params.items()}
    with sd_kernels.patched(unet, ops=["attention"], cuda_graph=False) as record:
        assert record.counts["text_kv"] == len(cross) >= 2
        weights = [a.to_k.weight for a in cross]
        widths = {w.shape[0] for w in weights}
        assert len({w.untyped_storage().data_ptr() for w in weights}) == len(widths) < len(cross)  # one a width
        for _ in range(2):
            assert_close_to_reference(_run(unet, x, ctx), stock, ref64)
        assert len(made) == 2 and [ok for _, ok in served] == [True] * (2 * len(cross))
        assert cross[0].processor.text_kv._product is None  # dropped once every member read it
    now = unet.state_dict(keep_vars=True)
    assert all(now[k] is params[k] and torch.equal(now[k], values[k]) for k in params)
    assert len({a.to_k.weight.untyped_storage().data_ptr() for a in cross}) == len(cross)  # storage of their own
    assert torch.equal(_run(unet, x, ctx), stock)


def test_a_member_hooked_or_given_another_weight_projects_for_itself(unet, products, monkeypatch):
    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    made, served = products
    x, ctx = _inputs(unet)
    cross = _cross(unet)
    with sd_kernels.patched(unet, ops=["attention"], cuda_graph=False):
        seen = []
        handle = cross[1].to_k.register_forward_hook(lambda *a: seen.append(1))
        _run(unet, x, ctx)
        handle.remove()
        assert seen == [1] and {a: ok for a, ok in served} == {a: a is not cross[1] for a in cross}
        # a weight assigned anew: no longer laid out with the others; nobody is served, the new weight is used
        with torch.no_grad():
            cross[-1].to_v.weight = nn.Parameter(cross[-1].to_v.weight * 2)
        served.clear()
        patched = _run(unet, x, ctx)
        assert not any(ok for _, ok in served)
    assert len(made) == 1
    assert torch.equal(patched, _run(unet, x, ctx))  # unpatched, with the new weight


def test_a_product_left_unread_is_not_read_in_the_next_forward(unet, products, monkeypatch):
    """A member that projected for itself (hooked) leaves the product unread by it; the next forward's first member
    drops it, served or not. Here the first member is hooked in the next forward and a weight changed in place
    through its view (the product of the first forward is stale): every member projects with the new weights."""
    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    made, served = products
    x, ctx = _inputs(unet)
    cross = _cross(unet)
    with sd_kernels.patched(unet, ops=["attention"], cuda_graph=False):
        joined = cross[0].processor.text_kv
        first = joined.members[0]
        late = unet.mid_block.attentions[0].transformer_blocks[0].attn2  # the one a forward calls after the first
        assert late in joined.members and first is not late
        handle = late.to_k.register_forward_hook(lambda *a: None)
        _run(unet, x, ctx)
        handle.remove()
        assert joined._product is not None  # left unread by the hooked member
        first.to_k.register_forward_hook(lambda *a: None)
        with torch.no_grad():
            late.to_k.weight.data.mul_(2)  # in place, through its view of the bank
        patched = _run(unet, x, ctx)
        assert not any(ok for a, ok in served[len(cross):])
    assert torch.equal(patched, _run(unet, x, ctx))  # unpatched, the same weights


def test_a_member_given_another_context_projects_for_itself(unet, products, monkeypatch):
    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    made, served = products
    cross = _cross(unet)
    g = torch.Generator().manual_seed(1)
    h = torch.randn(2, 5, cross[0].query_dim, generator=g)
    ctx = torch.randn(2, 7, unet.config.cross_attention_dim, generator=g)
    other = ctx.clone()
    with sd_kernels.patched(unet, ops=["attention"], cuda_graph=False), torch.no_grad():
        first = cross[0](h, encoder_hidden_states=ctx)
        second = cross[1](torch.randn(2, 5, cross[1].query_dim, generator=g), encoder_hidden_states=other)
        ctx.add_(1)  # changed in place: a new version, so member 2 is not served from the product of the old values
        third = cross[2](torch.randn(2, 5, cross[2].query_dim, generator=g), encoder_hidden_states=ctx)
    assert [ok for _, ok in served] == [True, False, False] and len(made) == 1
    assert first.shape == (2, 5, cross[0].query_dim) and second.isfinite().all() and third.isfinite().all()


def test_nothing_joined_where_the_patch_fuses_no_projections(unet, monkeypatch):
    """Where qkv_fusion's ``wanted`` names a reason (compile=True, a memory budget: tests/patches/test_qkv_fusion.py)
    the text's projections stay apart too."""
    monkeypatch.setattr(text_projections.qkv_fusion, "wanted", lambda record: "a reason")
    with sd_kernels.patched(unet, ops=["attention"], cuda_graph=False) as record:
        assert "text_kv" not in record.counts and record.counts["attention_processor"] > 0
        assert all(a.processor.text_kv is None for a in _cross(unet))
