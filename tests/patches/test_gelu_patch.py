"""The "gelu" patcher: diffusers' GEGLU / GELU / ApproximateGELU swapped for sd_kernels', exactly undone."""

import copy
import importlib

import pytest
import torch
from diffusers.models import activations
from diffusers.models.attention import FeedForward
from sd_kernels.patches.record import PatchRecord

import sd_kernels
from sd_kernels import models
from sd_kernels.runtime import dispatch
from sd_kernels.testing import assert_close_to_reference

gelu_patch = importlib.import_module("sd_kernels.patches.gelu")  # registers the "gelu" patcher

# FeedForward's activation_fn → (diffusers class in net[0], its replacement)
FEED_FORWARDS = {
    "geglu": (activations.GEGLU, gelu_patch.FusedGEGLU),
    "gelu": (activations.GELU, gelu_patch.FusedGELU),
    "gelu-approximate": (activations.GELU, gelu_patch.FusedGELU),
    "geglu-approximate": (activations.ApproximateGELU, gelu_patch.FusedApproximateGELU),
}


def _params(model):
    return model.state_dict(keep_vars=True)


def _assert_same_params(model, params):
    now = _params(model)
    assert now.keys() == params.keys() and all(now[k] is params[k] for k in params)


@pytest.mark.parametrize("fuse", [False, True], ids=["linear+geglu", "linear_geglu"])
@pytest.mark.parametrize("activation_fn", list(FEED_FORWARDS))
def test_feed_forward(activation_fn, fuse, monkeypatch):
    if fuse:  # every shape takes the fused matmul+GEGLU kernel
        _max_k(monkeypatch, 10**6)
    ff = FeedForward(16, mult=2, activation_fn=activation_fn).eval()
    original, replacement = FEED_FORWARDS[activation_fn]
    x = torch.randn(2, 5, 16)
    stock, params = ff(x), _params(ff)
    ref64 = copy.deepcopy(ff).double()(x.double())

    record = PatchRecord(("gelu",), "cpu", ["FeedForward"])
    gelu_patch.patch_gelu(ff, record)
    assert type(ff.net[0]) is replacement and record.counts == {f"gelu.{original.__name__}": 1}
    _assert_same_params(ff, params)
    if activation_fn == "gelu-approximate":
        assert ff.net[0].approximate == "tanh"
    assert_close_to_reference(ff(x), stock, ref64)

    record.undo()
    assert type(ff.net[0]) is original
    _assert_same_params(ff, params)
    assert torch.equal(ff(x), stock)


def test_geglu_shape_choice(monkeypatch):
    """fuse_linear_geglu decides, per call, between linear_geglu and cuBLAS linear + geglu."""
    calls = []
    monkeypatch.setattr(gelu_patch, "linear_geglu", lambda *a, **k: calls.append(a[0].shape[-1]) or 0)
    _max_k(monkeypatch, 24)
    small, large = (FeedForward(k, activation_fn="geglu").net[0] for k in (16, 32))
    record = PatchRecord(("gelu",), "cpu", ["test"])
    holder = torch.nn.ModuleList([small, large])
    gelu_patch.patch_gelu(holder, record)
    holder[0](torch.randn(3, 16))
    assert holder[1](torch.randn(3, 32)).shape == (3, 4 * 32)
    assert calls == [16]  # K = 16 <= 24 fused; K = 32 > 24 not


def _max_k(monkeypatch, k):
    """The active profile with ``linear_geglu_max_k = k``."""
    import dataclasses

    from sd_kernels import profiles

    monkeypatch.setattr(profiles, "_active", dataclasses.replace(profiles.get_profile("cpu"), linear_geglu_max_k=k))


def test_default_is_cublas_plus_geglu():
    """Fusing is measured data: only the hopper profile fuses, at K ≤ 320 (SD1.5's 64² level measured
    faster as one kernel on the H100, docs/kernels/gelu.md; at K = 640 it lost)."""
    from sd_kernels import profiles

    assert not gelu_patch.fuse_linear_geglu(8192, 320, 1280)
    fusing = {name: profiles.get_profile(name).linear_geglu_max_k for name in profiles.list_profiles()}
    assert {name: k for name, k in fusing.items() if k} == {"hopper": 320}


def _unet_out(unet):
    torch.manual_seed(1)
    x = torch.randn(1, 4, 16, 16).to(unet.dtype)
    ctx = torch.randn(1, 77, 32).to(unet.dtype)
    return unet(x, 10, encoder_hidden_states=ctx).sample


def test_tiny_unet():
    unet = models.build_model("tiny", "unet")
    n_geglu = sum(type(m) is activations.GEGLU for m in unet.modules())
    assert n_geglu > 0
    stock, params = _unet_out(unet), _params(unet)
    ref64 = _unet_out(copy.deepcopy(unet).double())

    record = sd_kernels.patch(unet, ops=["gelu"])
    assert record.counts == {"gelu.GEGLU": n_geglu}
    assert sum(type(m) is gelu_patch.FusedGEGLU for m in unet.modules()) == n_geglu
    _assert_same_params(unet, params)
    dispatch.reset_fallbacks()
    assert_close_to_reference(_unet_out(unet), stock, ref64)
    assert not dispatch.fallbacks()  # the kernels ran (the interpreter on CPU), not the reference

    assert sd_kernels.unpatch(unet)
    assert not any(type(m) is gelu_patch.FusedGEGLU for m in unet.modules())
    _assert_same_params(unet, params)
    assert torch.equal(_unet_out(unet), stock)
