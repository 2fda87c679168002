"""The channels_last patcher (patches/layout.py): which parts it re-lays, exactness, exact undo."""

import dataclasses

import pytest
import torch

import sd_kernels
from sd_kernels import models
from sd_kernels.ops.layout import is_channels_last


@pytest.fixture(scope="module")
def pipe():
    return models.build_pipeline("tiny")


def _profile(parts):
    return dataclasses.replace(sd_kernels.get_profile("cpu"), name="cpu", channels_last=tuple(parts))


def _weights(model):
    return [p for p in model.parameters() if p.dim() == 4]


def _unet_out(unet):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 4, 16, 16, generator=g)
    ctx = torch.randn(1, 77, 32, generator=g)
    return unet(x, 10, encoder_hidden_states=ctx).sample


def test_unet_runs_channels_last_and_undo_is_exact(pipe):
    before = _unet_out(pipe.unet)
    params = _weights(pipe.unet)
    values = [p.detach().clone() for p in params]
    with sd_kernels.patched(pipe, profile=_profile(["unet"]), ops=["channels_last"]) as record:
        # 1×1 kernels are NCHW and NHWC at once: only the others need re-laying
        assert record.counts["channels_last_weight"] == sum(p.shape[-2:] != (1, 1) for p in params) > 0
        assert all(is_channels_last(p) or p.shape[-2:] == (1, 1) for p in params)
        assert all(p.is_contiguous(memory_format=torch.channels_last) for p in params)
        assert all(p.is_contiguous() for p in _weights(pipe.vae))  # the VAE was not named
        out = _unet_out(pipe.unet)
        assert out.is_contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(out, before, rtol=1e-5, atol=1e-5)  # fp32 CPU: reordered sums only
    assert [p for p in _weights(pipe.unet)] == params  # the same Parameter objects
    assert all(p.is_contiguous() for p in params)
    assert all(torch.equal(p, v) for p, v in zip(params, values))
    assert torch.equal(_unet_out(pipe.unet), before)


def test_nothing_happens_unless_the_profile_names_the_part(pipe):
    params = _weights(pipe.unet)
    with sd_kernels.patched(pipe, profile=_profile([]), ops=["channels_last"]) as record:
        assert "channels_last_weight" not in record.counts
        assert all(p.is_contiguous() for p in params)
    with sd_kernels.patched(pipe, profile=_profile(["vae"]), ops=["channels_last"]) as record:
        assert record.counts["channels_last_weight"] == sum(p.shape[-2:] != (1, 1) for p in _weights(pipe.vae))
        assert all(p.is_contiguous() for p in params)
        assert all(p.is_contiguous(memory_format=torch.channels_last) for p in _weights(pipe.vae))
    assert all(p.is_contiguous() for p in _weights(pipe.vae))


def test_weights_already_channels_last_stay_so(pipe):
    unet = pipe.unet
    unet.to(memory_format=torch.channels_last)
    try:
        with sd_kernels.patched(unet, profile=_profile(["unet"]), ops=["channels_last"]) as record:
            assert record.counts.get("channels_last_weight", 0) == 0
        assert all(p.is_contiguous(memory_format=torch.channels_last) for p in _weights(unet))
    finally:
        unet.to(memory_format=torch.contiguous_format)


def test_weights_assigned_while_patched_are_kept(pipe):
    conv = pipe.unet.conv_in
    with sd_kernels.patched(pipe.unet, profile=_profile(["unet"]), ops=["channels_last"]):
        new = torch.randn_like(conv.weight).contiguous(memory_format=torch.channels_last)
        saved, conv.weight.data = conv.weight.data, new
    assert conv.weight.data_ptr() == new.data_ptr() and is_channels_last(conv.weight)  # not the patch's
    conv.weight.data = saved.contiguous()


def test_profile_validation_of_channels_last():
    with pytest.raises(sd_kernels.profiles.ProfileError, match="channels_last"):
        sd_kernels.profiles.from_dict({"name": "x", "description": "x", "channels_last": ["text_encoder"]})
    p = sd_kernels.profiles.from_dict({"name": "x", "description": "x", "channels_last": ["unet"]})
    assert p.channels_last == ("unet",) and p.describe()["channels_last"] == ["unet"]


def test_winograd_rules_are_per_layout():
    hopper = sd_kernels.get_profile("hopper")
    assert hopper.winograd_tile(2, 640, 32, 32, 640, torch.float16) == 4  # measured: a win on NCHW input
    assert hopper.winograd_tile(2, 640, 32, 32, 640, torch.float16, "channels_last") is None
    assert hopper.routes_winograd(1280, 1280, "nchw") and not hopper.routes_winograd(1280, 1280, "channels_last")


def test_every_conv_after_conv_in_sees_nhwc(pipe):
    """The UNet stays NHWC end to end: diffusers' Transformer2DModel hands its 1×1 proj_out an NCHW
    map (a ``.contiguous()`` after a permute), which the patch's pre-hook re-lays; without it every
    layer after the first attention block would run NCHW. Unpatch removes the hooks."""
    convs = [(n, m) for n, m in pipe.unet.named_modules() if isinstance(m, torch.nn.Conv2d)]
    seen = {}
    hooks = []
    try:
        with sd_kernels.patched(pipe, profile=_profile(["unet"]), ops=["channels_last"]) as record:
            # registered after the patch's: they see what the conv gets
            hooks += [m.register_forward_pre_hook(lambda m, a, n=n: seen.__setitem__(n, is_channels_last(a[0])))
                      for n, m in convs]
            proj_outs = sum(n.endswith("proj_out") for n, _ in convs)
            assert record.counts["channels_last_input"] == proj_outs > 0
            _unet_out(pipe.unet)
            assert {n for n, cl in seen.items() if not cl} == {"conv_in"}  # the NCHW latents
        seen.clear()
        _unet_out(pipe.unet)
        assert not any(seen.values())  # stock again: NCHW throughout
    finally:
        for h in hooks:
            h.remove()
