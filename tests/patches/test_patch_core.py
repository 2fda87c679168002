"""The patch bookkeeping, exercised with a stand-in patcher (each op family tests its own)."""

import pytest
import torch
import torch.nn as nn
from sd_kernels.patches import patch_record, registry

import sd_kernels
from sd_kernels import models


class Doubled(nn.Module):
    """Wraps a module (no parameter copies) and doubles its output."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        return 2 * self.inner(*args, **kwargs)


def _owner(model):
    """The module holding the output conv: the UNet itself, or the VAE's decoder."""
    return model if hasattr(model, "conv_out") else model.decoder


def fake_patcher(model, record):
    record.set_attr(_owner(model), "conv_out", Doubled(_owner(model).conv_out), "doubled_conv_out")
    record.set_attr(model, "note", "patched", "note")


@pytest.fixture
def fake_op(monkeypatch):
    monkeypatch.setitem(registry.PATCHERS, "fake", fake_patcher)
    return ["fake"]


@pytest.fixture(scope="module")
def pipe():
    return models.build_pipeline("tiny")


def _unet_out(unet):
    torch.manual_seed(1)
    x = torch.randn(1, 4, 16, 16)
    ctx = torch.randn(1, 77, 32)
    return unet(x, 10, encoder_hidden_states=ctx).sample


def test_patch_unpatch_round_trip_is_exact(pipe, fake_op):
    before = _unet_out(pipe.unet)
    conv_out = pipe.unet.conv_out
    params = {k: v for k, v in pipe.unet.state_dict(keep_vars=True).items()}
    record = sd_kernels.patch(pipe, ops=fake_op)
    assert record.counts == {"doubled_conv_out": 2, "note": 2}  # unet and vae
    assert torch.allclose(_unet_out(pipe.unet), 2 * before)
    assert sd_kernels.unpatch(pipe)
    assert pipe.unet.conv_out is conv_out and not hasattr(pipe.unet, "note")
    assert torch.equal(_unet_out(pipe.unet), before)
    after = pipe.unet.state_dict(keep_vars=True)
    assert after.keys() == params.keys() and all(after[k] is params[k] for k in params)
    assert not sd_kernels.unpatch(pipe)  # nothing left to undo


def test_patching_twice_equals_once(pipe, fake_op):
    first = sd_kernels.patch(pipe, ops=fake_op)
    assert sd_kernels.patch(pipe, ops=fake_op) is first
    assert not isinstance(pipe.unet.conv_out.inner, Doubled)
    sd_kernels.unpatch(pipe)


def test_ignore_skips_parts(pipe, fake_op):
    with sd_kernels.patched(pipe, ops=fake_op, ignore=("vae",)) as record:
        assert record.parts == ["unet"] and isinstance(pipe.unet.conv_out, Doubled)
        assert not isinstance(pipe.vae.decoder.conv_out, Doubled)
    assert patch_record(pipe) is None and not isinstance(pipe.unet.conv_out, Doubled)


def test_context_manager_restores_on_error(pipe, fake_op):
    with pytest.raises(RuntimeError), sd_kernels.patched(pipe, ops=fake_op):
        raise RuntimeError("boom")
    assert patch_record(pipe) is None and not isinstance(pipe.unet.conv_out, Doubled)


def test_bare_model(pipe, fake_op):
    record = sd_kernels.patch(pipe.unet, ops=fake_op)
    assert record.parts == ["UNet2DConditionModel"]
    sd_kernels.unpatch(pipe.unet)


@pytest.mark.parametrize(
    "obj, kwargs, error, match",
    [
        (nn.Linear(2, 2), {}, TypeError, "supported models: UNet2DConditionModel"),
        ("not a pipeline", {}, TypeError, "expected a diffusers pipeline"),
        (None, {"ops": ["warp_drive"]}, ValueError, "unknown ops"),
        (None, {"ignore": ["tokenizer"]}, ValueError, "unknown parts"),
        (None, {"cuda_graph": "whole"}, ValueError, r"cuda_graph='whole': choose False, True \(= 'pipeline'\)"),
        (None, {"cuda_graph": 1}, ValueError, "cuda_graph=1: choose"),
        (None, {"compile": True}, ValueError, "compile=True compiles what the CUDA graphs capture"),
        (None, {"compile": "max-autotune", "cuda_graph": False}, ValueError,
         "compile='max-autotune' compiles what the CUDA graphs capture: pass cuda_graph=True"),
        (None, {"compile": "fast", "cuda_graph": True}, ValueError,
         r"compile='fast': choose False, True \(= 'default'\) or one of 'default', 'max-autotune'"),
        (None, {"profile": "mali"}, ValueError, "known profiles"),
    ],
)
def test_bad_input(pipe, obj, kwargs, error, match):
    with pytest.raises(error, match=match):
        sd_kernels.patch(pipe if obj is None else obj, **kwargs)
    assert patch_record(pipe) is None


def test_a_failing_patcher_leaves_nothing_half_patched(pipe, fake_op, monkeypatch):
    def broken(model, record):
        fake_patcher(model, record)
        if model is pipe.vae:
            raise RuntimeError("patcher bug")

    monkeypatch.setitem(registry.PATCHERS, "fake", broken)
    conv_out = pipe.unet.conv_out
    with pytest.raises(RuntimeError, match="patcher bug"):
        sd_kernels.patch(pipe, ops=fake_op)
    assert patch_record(pipe) is None and pipe.unet.conv_out is conv_out and not hasattr(pipe.unet, "note")
    assert not hasattr(pipe.unet, "_sd_kernels_owner")


def test_report_leaves_the_pipeline_as_it_was(pipe, fake_op):
    from sd_kernels.patches import report

    text = report(pipe, ops=fake_op)
    assert "doubled_conv_out: 2" in text and patch_record(pipe) is None
    with sd_kernels.patched(pipe, ops=fake_op) as record:
        assert report(pipe) == record.format() and patch_record(pipe) is record


def test_changes_made_after_the_patch_are_kept(pipe, fake_op):
    """Undo puts originals back where the replacements are, not over what others put there since."""
    unet = pipe.unet
    conv_out = unet.conv_out
    with sd_kernels.patched(pipe, ops=fake_op):
        ours = unet.conv_out
        unet.conv_out = Doubled(ours)  # someone wraps our replacement (as peft's base_layer does)
        unet.note = "theirs"  # and sets an attribute the patch had set
    assert type(unet.conv_out) is Doubled and unet.conv_out.inner is conv_out  # original, inside their wrapper
    assert unet.note == "theirs"
    unet.conv_out = conv_out
    del unet.note


def test_repatch_with_a_changed_profile_of_the_same_name_repatches():
    """dataclasses.replace keeps a profile's name: patch() must compare the whole profile."""
    import dataclasses

    from sd_kernels.patches import patch, unpatch

    from sd_kernels import profiles
    from sd_kernels.models import build_model

    unet = build_model("tiny", "unet")
    base = profiles.get_profile("cpu")
    try:
        first = patch(unet, profile=base)
        assert patch(unet, profile=base) is first
        forced = dataclasses.replace(base, attention="sdpa")
        second = patch(unet, profile=forced)
        assert second is not first and second.profile_spec == forced
    finally:
        unpatch(unet)
        profiles.set_profile(None)
