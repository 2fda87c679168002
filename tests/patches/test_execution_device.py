"""The pipeline's faster ``_execution_device`` (patches/execution_device.py): the same device as
diffusers' property in every state its rules distinguish, the same class name, exact undo. On CPU
through the function ``patch(pipe, cuda_graph=True)`` calls (it needs CUDA); that the patch calls it
is checked on the GPU (tests/patches/test_cuda_graph.py)."""

import contextlib
import json
import pickle
import types

import pytest
import torch
from diffusers import DiffusionPipeline, StableDiffusionPipeline
from diffusers.hooks import HookRegistry, ModelHook
from sd_kernels.patches import execution_device
from sd_kernels.patches.record import PatchRecord

from sd_kernels import models

stock_device = DiffusionPipeline._execution_device.fget


@pytest.fixture
def pipe():
    return models.build_pipeline("tiny")


class _OnloadHook(ModelHook):
    """Stands for diffusers' group-offloading hook: all _execution_device reads is its config."""

    def __init__(self, device: str) -> None:
        super().__init__()
        self.config = types.SimpleNamespace(onload_device=torch.device(device))


def _hook(module, device: str, name: str = "group_offloading"):
    HookRegistry.check_if_exists_or_initialize(module).register_hook(_OnloadHook(device), name)


@contextlib.contextmanager
def fast(pipe):
    record = PatchRecord((), "cpu", [])
    execution_device.fast_execution_device(pipe, record)
    try:
        yield record
    finally:
        record.undo()


def test_same_class_name_and_exact_undo(pipe, tmp_path):
    with fast(pipe) as record:
        assert record.counts["fast_execution_device"] == 1
        assert type(pipe) is not StableDiffusionPipeline and isinstance(pipe, StableDiffusionPipeline)
        assert (type(pipe).__name__, type(pipe).__module__, type(pipe).__qualname__) == (
            "StableDiffusionPipeline", StableDiffusionPipeline.__module__, "StableDiffusionPipeline")
        pipe.save_pretrained(tmp_path)
        assert json.loads((tmp_path / "model_index.json").read_text())["_class_name"] == "StableDiffusionPipeline"
        with pytest.raises(TypeError, match="unpatch"):  # the record's reason, not pickle's class lookup
            pickle.dumps(pipe)
    assert type(pipe) is StableDiffusionPipeline
    assert pickle.loads(pickle.dumps(pipe.scheduler)) is not None


@pytest.mark.parametrize("where", ["none", "meta-part", "deep", "two", "siblings", "parent-child", "shared",
                                   "other-name", "accelerate", "accelerate-none"])
def test_same_device_as_diffusers(pipe, where):
    """Group-offloading hooks deep in a component, in two components (the first component in
    ``components`` order wins, and in it the first module in named_modules order), a module shared
    twice in a tree, a hook of another name (not group offloading), accelerate's ``_hf_hook``s."""
    unet, vae = pipe.unet, pipe.vae
    if where == "meta-part":  # the CPU and meta both give way to another device; here none is: the first
        pipe.text_encoder.to("meta")
    elif where == "deep":
        _hook(unet.up_blocks[1].resnets[0].conv1, "meta")
    elif where == "two":
        _hook(vae.decoder.mid_block, "meta")
        _hook(unet.down_blocks[0].resnets[0], "cpu")
        _hook(unet.down_blocks[0].resnets[0].norm1, "meta")
    elif where == "siblings":  # in the first component: the earlier sibling's subtree comes first
        first = next(m for m in pipe.components.values() if isinstance(m, torch.nn.Module))
        parent = next(m for m in first.modules() if sum(any(c.children()) for c in m.children()) >= 2)
        a, b = [c for c in parent.children() if any(c.children())][:2]
        _hook(list(a.modules())[-1], "meta")  # deep in the earlier sibling
        _hook(b, "cpu")  # at the top of the later one: a level-order walk would find it first
    elif where == "parent-child":  # pre-order: a parent before its child
        first = next(m for m in pipe.components.values() if isinstance(m, torch.nn.Module))
        parent = next(m for m in first.modules() if any(m.children()) and m is not first)
        _hook(parent, "meta")
        _hook(next(parent.children()), "cpu")
    elif where == "shared":
        unet.extra = unet.down_blocks[0]  # visited once, where it first appears
        _hook(unet.down_blocks[0].resnets[0], "meta")
    elif where == "other-name":
        _hook(unet.conv_in, "meta", name="layerwise_casting")
    elif where.startswith("accelerate"):
        for model in (unet, vae, pipe.text_encoder):  # as sequential CPU offload leaves them
            model._hf_hook = types.SimpleNamespace(execution_device=None)
        inner = list(pipe.text_encoder.modules())[5]
        inner._hf_hook = types.SimpleNamespace(execution_device=None if where == "accelerate-none" else "meta")
    want = stock_device(pipe)
    with fast(pipe) as record:
        assert record.counts["fast_execution_device"] == 1
        assert pipe._execution_device == want
    assert where in ("none", "meta-part", "other-name", "accelerate-none") or want == torch.device("meta")


def test_other_diffusers_is_left_alone(pipe, monkeypatch):
    monkeypatch.setattr(execution_device, "verified", lambda: False)
    with fast(pipe) as record:
        assert type(pipe) is StableDiffusionPipeline and "fast_execution_device" not in record.counts
        assert any("_execution_device" in s.reason for s in record.skipped)


@pytest.mark.parametrize("own", ["device", "_execution_device"])
def test_a_pipeline_class_with_its_own_property_keeps_it(pipe, own):
    """A subclass's own ``device`` is what the faster property falls back to; a subclass's own
    ``_execution_device`` is left in place."""
    pipe.__class__ = type("Custom", (StableDiffusionPipeline,), {own: property(lambda self: torch.device("meta"))})
    custom = type(pipe)
    with fast(pipe) as record:
        assert pipe._execution_device == torch.device("meta")
        assert own != "device" or stock_device(pipe) == torch.device("meta")
        assert (type(pipe) is custom) == (own == "_execution_device")
        assert ("fast_execution_device" in record.counts) == (own == "device")


def test_a_module_graph_that_is_not_a_tree_gets_diffusers_answer(monkeypatch):
    """Shared modules are visited again (after their first visit, so the first hook found is the
    same); a cycle would never end: past _MAX_VISITS the walk hands over to diffusers' own."""
    from diffusers.hooks.group_offloading import _get_top_level_group_offload_hook

    shared = torch.nn.Linear(2, 2)
    root = torch.nn.Sequential(torch.nn.Sequential(shared), shared, torch.nn.Linear(2, 2))
    _hook(root[2], "cuda:1")
    _hook(shared, "cuda:0")
    assert execution_device._first_group_hook(root, "group_offloading") is _get_top_level_group_offload_hook(root)
    plain = torch.nn.Linear(2, 2)  # shared and hook-less: visited twice, then the hooked sibling after it
    root = torch.nn.Sequential(torch.nn.Sequential(plain), plain, torch.nn.Linear(2, 2))
    _hook(root[2], "cuda:3")
    assert execution_device._first_group_hook(root, "group_offloading") is _get_top_level_group_offload_hook(root)
    assert _get_top_level_group_offload_hook(root).config.onload_device == torch.device("cuda:3")
    looped = torch.nn.Sequential(torch.nn.Linear(2, 2))
    looped[0].add_module("back", looped)  # a cycle: named_modules ends it, a plain walk would not
    after = torch.nn.Linear(2, 2)
    _hook(after, "cuda:2")
    root = torch.nn.Sequential(looped, after)
    monkeypatch.setattr(execution_device, "_MAX_VISITS", 50)
    assert _get_top_level_group_offload_hook(root) is not None
    assert execution_device._first_group_hook(root, "group_offloading") is _get_top_level_group_offload_hook(root)
    assert execution_device._first_group_hook(root, "other") is None
