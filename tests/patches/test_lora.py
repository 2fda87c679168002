"""LoRA (peft, through diffusers' adapter API) loaded after ``patch``: peft wraps ``to_q`` … and
``ff.net.0.proj`` (a child that FusedGEGLU shares with the GEGLU it replaced). The patched model then
runs with the LoRA, and ``unpatch`` hands the LoRA layers to the original modules instead of
dropping them: the result equals a model that was never patched and got the same LoRA."""

import copy

import pytest
import torch

import sd_kernels
from sd_kernels import models

peft = pytest.importorskip("peft", reason="peft is in the test extra: pip install -e '.[test]'")
from peft.tuners.lora import LoraLayer  # noqa: E402

TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "proj", "ff.net.2", "proj_in", "proj_out", "conv1"]


def _with_lora(unet):
    torch.manual_seed(3)  # random (not zero) LoRA weights, the same for the same module tree
    unet.add_adapter(peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False))
    return unet


def _out(unet):
    g = torch.Generator().manual_seed(1)
    x, ctx = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 7, 32, generator=g)
    with torch.no_grad():
        return unet(x, torch.tensor(10), encoder_hidden_states=ctx).sample


@pytest.fixture
def unets():
    never = models.build_model("tiny", "unet")
    return never, copy.deepcopy(never)


def test_lora_after_patch_runs_and_survives_unpatch(unets, monkeypatch):
    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")  # exact comparisons; the kernels are tested elsewhere
    never, ours = unets
    expected = _out(_with_lora(never))
    sd_kernels.patch(ours)
    _with_lora(ours)
    geglu = ours.down_blocks[0].attentions[0].transformer_blocks[0].ff.net[0]
    assert type(geglu).__name__ == "FusedGEGLU" and isinstance(geglu.proj, LoraLayer)
    assert ours.state_dict().keys() == never.state_dict().keys()
    assert torch.equal(_out(ours), expected)  # the patched model runs the LoRA
    sd_kernels.unpatch(ours)
    restored = ours.down_blocks[0].attentions[0].transformer_blocks[0].ff.net[0]
    assert type(restored).__name__ == "GEGLU" and isinstance(restored.proj, LoraLayer)  # kept, not dropped
    assert sum(isinstance(m, LoraLayer) for m in ours.modules()) == sum(
        isinstance(m, LoraLayer) for m in never.modules())
    assert torch.equal(_out(ours), expected)


def test_lora_before_patch(unets, monkeypatch):
    """LoRA first, then patch: the wrapped projections are shared by the replacements as they are."""
    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    never, ours = unets
    expected = _out(_with_lora(never))
    _with_lora(ours)
    with sd_kernels.patched(ours) as record:
        assert record.counts["gelu.GEGLU"] > 0
        assert torch.equal(_out(ours), expected)
    assert torch.equal(_out(ours), expected)


@pytest.mark.integration
def test_patch_kernels_with_lora(unets):
    """With the kernels (interpreter on CPU): close to the unpatched LoRA model."""
    never, ours = unets
    expected = _out(_with_lora(never))
    with sd_kernels.patched(_with_lora(ours)):
        torch.testing.assert_close(_out(ours), expected, rtol=1e-4, atol=1e-4)


def test_pipeline_load_lora_weights_after_patch(tmp_path, monkeypatch):
    """The user's path: ``pipe.load_lora_weights`` on a patched pipeline, then unpatch."""
    from peft.utils import get_peft_model_state_dict

    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    source = _with_lora(models.build_model("tiny", "unet"))
    type(models.build_pipeline("tiny")).save_lora_weights(
        tmp_path, unet_lora_layers=get_peft_model_state_dict(source), safe_serialization=True)
    never, ours = models.build_pipeline("tiny"), models.build_pipeline("tiny")
    never.load_lora_weights(tmp_path)
    expected = _out(never.unet)
    with sd_kernels.patched(ours):
        ours.load_lora_weights(tmp_path)
        assert torch.equal(_out(ours.unet), expected)
    assert torch.equal(_out(ours.unet), expected)
    assert sum(isinstance(m, LoraLayer) for m in ours.unet.modules()) == sum(
        isinstance(m, LoraLayer) for m in never.unet.modules()) > 0
