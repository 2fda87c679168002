"""patch(..., cuda_graph=True): the UNet replayed from CUDA graphs, one per call signature.

On CPU: the argument normalisation (a number timestep becomes the tensor diffusers would make) and
the clear error for a model not on CUDA. On the GPU: replay == eager across two shapes and back, no
stale outputs, diffusers' calling conventions (SD1.x and SDXL), eager fallback under autograd, LoRA
loaded after capture, and an exact unpatch.
"""

import copy
import logging

import pytest
import torch
from sd_kernels.patches import cuda_graph

import sd_kernels
from sd_kernels import models


@pytest.mark.parametrize("t, dtype", [(10, torch.int64), (10.5, torch.float64)])
def test_number_timestep_becomes_diffusers_tensor(t, dtype):
    out = cuda_graph._timestep_tensor(t, torch.device("cpu"))
    assert out.dtype == dtype and out.shape == (1,) and out.item() == t


def test_tensor_and_bool_timesteps_pass_through():
    t = torch.tensor(3)
    assert cuda_graph._timestep_tensor(t, torch.device("cpu")) is t
    assert cuda_graph._timestep_tensor(True, torch.device("cpu")) is True


def test_model_not_on_cuda_is_a_clear_error():
    unet = models.build_model("tiny", "unet")
    with pytest.raises(ValueError, match=r"cuda_graph=True needs the UNet2DConditionModel on one CUDA device.*cpu"):
        sd_kernels.patch(unet, cuda_graph=True)
    assert "forward" not in vars(unet)


# ---------------------------------------------------------------------------------------------
# GPU


def _unet(name="tiny"):
    return models.build_model(name, "unet", device="cuda", dtype=torch.float16)


def _args(unet, batch, side, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 4, side, side, generator=g)
    ctx = torch.randn(batch, 7, unet.config.cross_attention_dim, generator=g)
    kwargs = {"encoder_hidden_states": ctx.cuda().half()}
    if unet.config.addition_embed_type == "text_time":
        n_text = unet.config.projection_class_embeddings_input_dim - 6 * unet.config.addition_time_embed_dim
        kwargs["added_cond_kwargs"] = {"text_embeds": torch.randn(batch, n_text, generator=g).cuda().half(),
                                       "time_ids": torch.tensor([[64.0, 64, 0, 0, 64, 64]] * batch).cuda().half()}
    return x.cuda().half(), kwargs


def _matches(got, want):
    """Replay vs eager: the same kernels and configs, so equal up to what library calls may do
    differently on a capture stream (cuBLAS workspaces); a stale or wrong output is off by O(1)."""
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


def _eager_and_graphed(name="tiny"):
    eager = _unet(name)
    graphed = copy.deepcopy(eager)
    sd_kernels.patch(eager)
    record = sd_kernels.patch(graphed, cuda_graph=True)
    return eager, graphed, record


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tiny", "tiny-xl"])
def test_replay_matches_eager_across_shapes_without_stale_outputs(name):
    eager, graphed, record = _eager_and_graphed(name)
    forward = graphed.forward
    assert isinstance(forward, cuda_graph.GraphedForward) and record.counts["cuda_graph"] == 1
    t = torch.tensor(10, device="cuda")
    with torch.no_grad():
        results = []
        for batch, side, seed in [(2, 8, 0), (2, 8, 1), (1, 16, 2), (2, 8, 3)]:
            x, kw = _args(eager, batch, side, seed)
            want = eager(x, t, **kw).sample
            got = graphed(x, t, **kw).sample
            _matches(got, want)
            results.append((got, got.clone()))
        assert len(forward.graphs) == 2  # two signatures; the third call of the first one replayed
        for got, snapshot in results:  # every returned output is still what it was: no replay overwrote it
            assert torch.equal(got, snapshot)
        assert not torch.equal(results[0][0], results[1][0])
    assert sd_kernels.unpatch(graphed) and "forward" not in vars(graphed)


@pytest.mark.gpu
def test_calling_conventions():
    eager, graphed, _ = _eager_and_graphed()
    x, kw = _args(eager, 2, 8)
    with torch.no_grad():
        want = eager(x, torch.tensor(10, device="cuda"), **kw).sample
        for t in (10, torch.tensor(10, device="cuda"), torch.tensor(10), torch.tensor([10, 10], device="cuda")):
            _matches(graphed(x, t, **kw).sample, want)
        as_tuple = graphed(x, 10, return_dict=False, cross_attention_kwargs=None, **kw)
        assert isinstance(as_tuple, tuple)
        _matches(as_tuple[0], want)
        _matches(graphed(sample=x, timestep=10, **kw).sample, want)


@pytest.mark.gpu
def test_autograd_runs_eagerly_and_says_so(caplog):
    eager, graphed, _ = _eager_and_graphed()
    x, kw = _args(eager, 2, 8)
    with caplog.at_level(logging.WARNING, logger="sd_kernels"):
        out = graphed(x, 10, **kw).sample  # grad mode on: no capture
        graphed(x, 10, **kw)
    assert not graphed.forward.graphs
    assert sum("running the UNet eagerly" in r.message for r in caplog.records) == 1  # logged once
    with torch.no_grad():
        _matches(out.detach(), eager(x, 10, **kw).sample)


@pytest.mark.gpu
def test_lora_loaded_after_capture_recaptures():
    peft = pytest.importorskip("peft", reason="peft is in the test extra")
    eager, graphed, _ = _eager_and_graphed()
    x, kw = _args(eager, 2, 8)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_v", "proj"], init_lora_weights=False)
    with torch.no_grad():
        before = graphed(x, 10, **kw).sample
        for model in (eager, graphed):
            torch.manual_seed(3)
            model.add_adapter(config)
            model.half()
        want = eager(x, 10, **kw).sample
        assert not torch.equal(want, before)
        _matches(graphed(x, 10, **kw).sample, want)
