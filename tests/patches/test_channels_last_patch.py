"""The channels_last patcher (patches/channels_last.py): which parts it re-lays, exactness, exact undo."""

import dataclasses
import pickle

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


def test_weights_cast_away_and_back_while_patched_are_laid_back(pipe):
    """SDXL's pipeline casts its VAE to fp32 for each decode and back to fp16: the data is new, of the dtype the
    patch saw, still NHWC (``.to`` keeps the layout). Unpatch lays it back NCHW, the values unchanged; data of new
    values assigned while patched stays as given (above)."""
    vae = pipe.vae
    params = _weights(vae)
    values = [p.detach().clone() for p in params]
    with sd_kernels.patched(pipe, profile=_profile(["vae"]), ops=["channels_last"]):
        vae.to(torch.float64)
        vae.to(torch.float32)
        assert all(is_channels_last(p) for p in params if p.shape[-2:] != (1, 1))
        assert all(p.dtype == torch.float32 for p in params)
    assert all(p.is_contiguous() for p in params)
    assert all(torch.equal(p, v) for p, v in zip(params, values))


def test_the_unpatch_probe_spans_the_weight_and_compares_bits():
    """The probe's last element is the weight's last (integer steps: a float32 step lands past the end of a
    59-million-element weight), a NaN there compares equal to itself, and a weight of another shape or other
    values is not the one the patch re-laid."""
    from sd_kernels.patches import channels_last

    _, index, _ = channels_last._probe(torch.empty((2560, 2560, 3, 3), dtype=torch.float8_e4m3fn))
    assert [int(i[-1]) for i in index] == [2559, 2559, 2, 2] and [int(i[0]) for i in index] == [0, 0, 0, 0]
    w = torch.randn(4, 3, 3, 3)
    w[3, 2, 2, 2] = float("nan")
    probe = channels_last._probe(w)
    assert channels_last._same_probe(w.contiguous(memory_format=torch.channels_last).double(), probe)
    assert not channels_last._same_probe(w[:2], probe)
    assert not channels_last._same_probe(torch.randn(4, 3, 3, 3), probe)


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


def _xl_kwargs(unet):
    """The SDXL UNet's added conditioning, for a batch of one."""
    cfg = unet.config
    n_text = cfg.projection_class_embeddings_input_dim - 6 * cfg.addition_time_embed_dim
    g = torch.Generator().manual_seed(2)
    return {"added_cond_kwargs": {"text_embeds": torch.randn(1, n_text, generator=g),
                                  "time_ids": torch.randn(1, 6, generator=g)}}


@pytest.mark.parametrize("verified", [True, False], ids=["verified", "other-diffusers"])
@pytest.mark.parametrize("name", ["tiny", "tiny-xl"])
def test_every_layer_after_conv_in_sees_nhwc(name, verified, monkeypatch):
    """The UNet stays NHWC end to end: diffusers' Transformer2DModel ends its output with an NCHW
    ``.contiguous()`` (before a 1×1 conv proj_out in SD1.5, after a linear one in SD2.1/SDXL), which
    the patch's copy of that method leaves out; under a diffusers whose method we have not checked,
    a pre-hook re-lays a conv proj_out's input, and blocks with a linear proj_out are skipped (NCHW
    after them, said in the record). Outputs match stock; unpatch restores everything."""
    from diffusers.models.transformers.transformer_2d import Transformer2DModel
    from sd_kernels.patches import channels_last as layout

    if not verified:
        monkeypatch.setattr(layout, "is_verified", lambda fn: False)
    unet = models.build_pipeline(name).unet
    x = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(1))
    ctx = torch.randn(1, 77, unet.config.cross_attention_dim, generator=torch.Generator().manual_seed(3))
    kwargs = _xl_kwargs(unet) if name == "tiny-xl" else {}
    run = lambda: unet(x, 10, encoder_hidden_states=ctx, **kwargs).sample  # noqa: E731
    linear = unet.config.use_linear_projection
    blocks = [m for m in unet.modules() if isinstance(m, Transformer2DModel)]
    assert blocks and all(type(m.proj_out) is (torch.nn.Linear if linear else torch.nn.Conv2d) for m in blocks)
    stock = run()
    layers = [(n, m) for n, m in unet.named_modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.GroupNorm))]
    seen = {}
    hooks = []
    try:
        with sd_kernels.patched(unet, profile=_profile(["unet"]), ops=["channels_last"]) as record:
            if verified:  # the copy is bound as a partial: a pickled block (torch.save) loads, and runs alike
                clone = pickle.loads(pickle.dumps(blocks[0]))
                assert clone._get_output_for_continuous_inputs.args[0] is clone
            # registered after the patch's: they see what the layer gets
            hooks += [m.register_forward_pre_hook(lambda m, a, n=n: seen.__setitem__(n, is_channels_last(a[0])))
                      for n, m in layers]
            out = run()
            if verified:
                assert record.counts["channels_last_output"] == len(blocks)
                assert "channels_last_input" not in record.counts and not record.skipped
                assert {n for n, cl in seen.items() if not cl} == {"conv_in"}  # the NCHW latents
            elif not linear:
                assert record.counts["channels_last_input"] == len(blocks)
                assert {n for n, cl in seen.items() if not cl} == {"conv_in"}
            else:  # left alone and said so: the layers after the first transformer block see NCHW
                assert len(record.skipped) == len(blocks) and "channels_last_output" not in record.counts
                assert {n for n, cl in seen.items() if not cl} - {"conv_in"}
            assert out.is_contiguous(memory_format=torch.channels_last)  # conv_out's weight is NHWC
            torch.testing.assert_close(out, stock, rtol=1e-5, atol=1e-5)  # fp32 CPU: reordered sums only
        assert all("_get_output_for_continuous_inputs" not in m.__dict__ for m in blocks)
        assert all(len(m.proj_out._forward_pre_hooks) == (type(m.proj_out) is torch.nn.Conv2d) for m in blocks)  # ours
        seen.clear()
        assert torch.equal(run(), stock)
        assert not any(seen.values())  # stock again: NCHW throughout
    finally:
        for h in hooks:
            h.remove()
