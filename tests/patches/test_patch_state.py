"""The patch's state under what users do to patched objects (never a silently wrong result):
copies and pickles are refused with the way out, nesting ``patched`` keeps the user's own patch, a
dtype move while patched is still undone exactly, arguments given as a bare string are refused."""

import copy
import gc
import io
import pickle

import pytest
import torch
from sd_kernels.patches import patch_record
from sd_kernels.patches import report as patch_report

import sd_kernels
from sd_kernels import models


def _processors(pipe):
    return {type(m.processor).__name__ for m in pipe.unet.modules() if hasattr(m, "processor")}


@pytest.fixture
def pipe():
    return models.build_pipeline("tiny")


def test_a_deep_copy_of_a_patched_pipeline_is_refused_and_the_original_untouched(pipe):
    sd_kernels.patch(pipe)
    before = _processors(pipe)
    with pytest.raises(TypeError, match=r"deep copy.*sd_kernels.unpatch\(obj\) first"):
        copy.deepcopy(pipe)
    assert _processors(pipe) == before and patch_record(pipe) is not None
    sd_kernels.unpatch(pipe)
    twin = copy.deepcopy(pipe)  # unpatched: copies as ever, and each patches on its own
    sd_kernels.patch(twin)
    sd_kernels.patch(pipe)
    sd_kernels.unpatch(twin)
    assert _processors(pipe) == before and _processors(twin) == {"AttnProcessor2_0"}


@pytest.mark.parametrize("save", ["pickle", "torch.save"])
def test_pickling_a_patched_model_is_refused_with_the_way_out(pipe, save):
    sd_kernels.patch(pipe.unet)
    dump = (lambda m: pickle.dumps(m)) if save == "pickle" else (lambda m: torch.save(m, io.BytesIO()))
    with pytest.raises(TypeError, match=r"pickle \(torch.save\).*unpatch"):
        dump(pipe.unet)
    sd_kernels.unpatch(pipe.unet)
    dump(pipe.unet)


def test_patched_block_on_a_patched_pipeline_gives_back_the_users_patch(pipe):
    mine = sd_kernels.patch(pipe, ops=["gelu"])
    with sd_kernels.patched(pipe, ops=["gelu"]) as same:
        assert same is mine
    assert patch_record(pipe) is mine  # the same patch: nothing to undo
    with sd_kernels.patched(pipe, ops=["attention"]):
        assert patch_record(pipe).ops == ("attention",)
    back = patch_record(pipe)
    assert back is not None and back.ops == ("gelu",)
    assert _processors(pipe) == {"AttnProcessor2_0"}  # attention is unpatched again, gelu patched
    assert back.counts.get("gelu.GEGLU", 0) > 0
    sd_kernels.unpatch(pipe)
    with sd_kernels.patched(pipe):
        pass
    assert patch_record(pipe) is None


def test_a_dtype_move_while_patched_is_laid_back_on_unpatch():
    vae = models.build_model("tiny", "vae")
    want = [p.detach().clone() for p in vae.parameters()]
    sd_kernels.patch(vae, profile="hopper", ops=["channels_last"])
    assert any(not p.is_contiguous() for p in vae.parameters())
    vae.to(torch.bfloat16)
    sd_kernels.unpatch(vae)
    assert all(p.is_contiguous() for p in vae.parameters())
    vae.to(torch.float32)
    assert all(torch.equal(p, w.to(torch.bfloat16).float()) for p, w in zip(vae.parameters(), want))


@pytest.mark.parametrize("kwargs", [{"ops": "attention"}, {"ignore": "vae"}])
def test_a_bare_string_for_a_list_is_refused(pipe, kwargs):
    ((name, value),) = kwargs.items()
    with pytest.raises(TypeError, match=rf"{name}= takes a list of names.*did you mean {name}=\['{value}'\]"):
        sd_kernels.patch(pipe, **kwargs)
    assert patch_record(pipe) is None


@pytest.mark.integration
def test_two_models_patched_with_different_profiles_each_run_under_their_own(monkeypatch):
    """A patch's profile belongs to what it patched: the ops of each model see its own profile, in any
    order of calls, and neither patch, unpatch nor report changes the process default."""
    import dataclasses
    import importlib

    from sd_kernels import profiles

    gn_patch = importlib.import_module("sd_kernels.patches.group_norm")
    attn_steps = importlib.import_module("sd_kernels.patches.attention_processor_steps")  # where the processors call it
    seen = []

    def spy(fn):
        def run(*args, **kwargs):
            seen.append(profiles.active_profile().name)
            return fn(*args, **kwargs)
        return run

    monkeypatch.setattr(gn_patch, "group_norm", spy(gn_patch.group_norm))
    monkeypatch.setattr(attn_steps, "attention", spy(attn_steps.attention))
    default = profiles.active_profile()
    base = sd_kernels.get_profile("cpu")
    a, b = models.build_model("tiny", "unet"), models.build_model("tiny", "unet")
    g = torch.Generator().manual_seed(0)
    x, ctx = torch.randn(1, 4, 8, 8, generator=g), torch.randn(1, 7, 32, generator=g)
    sd_kernels.patch(a, profile=dataclasses.replace(base, name="profile-a"), cuda_graph=False)
    sd_kernels.patch(b, profile=dataclasses.replace(base, name="profile-b"), cuda_graph=False)
    assert profiles.active_profile() is default
    with torch.no_grad():
        for model, name in ((a, "profile-a"), (b, "profile-b"), (a, "profile-a")):
            seen.clear()
            model(x, 10, encoder_hidden_states=ctx)
            assert seen and set(seen) == {name}
    sd_kernels.unpatch(a)
    patch_report(a, profile="s23-ultra")
    sd_kernels.unpatch(b)
    assert profiles.active_profile() is default


def _stock(model) -> bool:
    return _processors_of(model) == {"AttnProcessor2_0"} and not hasattr(model, "_sd_kernels_owner")


def _processors_of(model):
    return {type(m.processor).__name__ for m in model.modules() if hasattr(m, "processor")}


def test_a_component_replaced_after_patching_is_patched_by_the_next_patch_and_the_old_one_unpatched(pipe):
    record = sd_kernels.patch(pipe)
    old, new = pipe.unet, models.build_model("tiny", "unet")
    pipe.unet = new
    again = sd_kernels.patch(pipe)  # the same arguments, another model: no longer the old record
    assert again is not record and again.models[0] is new
    assert _processors_of(new) == {"SDKernelsAttnProcessor"} and _stock(old)
    assert sd_kernels.patch(pipe) is again
    sd_kernels.unpatch(pipe)
    assert _stock(new) and _stock(old)


def test_unpatching_the_pipeline_after_a_replacement_unpatches_the_replaced_model(pipe):
    sd_kernels.patch(pipe)
    old = pipe.unet
    pipe.unet = models.build_model("tiny", "unet")
    assert sd_kernels.unpatch(pipe) and _stock(old) and _stock(pipe.unet)


def test_a_replaced_model_can_be_unpatched_by_itself_and_a_held_one_says_how(pipe):
    sd_kernels.patch(pipe)
    with pytest.raises(ValueError, match="patched as the unet of a StableDiffusionPipeline: unpatch that pipeline"):
        sd_kernels.unpatch(pipe.unet)
    old = pipe.unet
    pipe.unet = models.build_model("tiny", "unet")
    assert sd_kernels.unpatch(old)  # the pipeline's stale patch is undone with it
    assert _stock(old) and patch_record(pipe) is None and _processors_of(pipe.vae) == {"AttnProcessor2_0"}
    other = models.build_pipeline("tiny")
    record = sd_kernels.patch(other)
    old = other.unet
    other.unet = models.build_model("tiny", "unet")
    del other
    gc.collect()
    assert record.target() is None  # the pipeline is gone: its record still undoes the model
    assert sd_kernels.unpatch(old) and _stock(old)
