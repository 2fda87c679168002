"""patch(..., cuda_graph=True): the UNet replayed from CUDA graphs, one per call signature.

On CPU: the argument normalisation (a number timestep becomes the tensor diffusers would make) and
the clear error for a model not on CUDA. On the GPU: replay == eager across two shapes and back, no
stale outputs, diffusers' calling conventions (SD1.x and SDXL), LoRA loaded after capture, and an
exact unpatch. The same logic runs on CPU against a stand-in graph (FakeGraph below).
"""

import copy
import logging

import pytest
import torch
from sd_kernels.patches import cuda_graph

import sd_kernels
from sd_kernels import models

pytree = torch.utils._pytree


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
# CPU, with a stand-in for CUDA graphs: GraphedForward's own logic (signatures, static buffers,
# clones, fallbacks, recapture) without a GPU.


class FakeGraph:
    """Replay re-runs the captured call on the same static inputs and writes into the same static
    outputs, as a CUDA graph replay does: an output handed out without a copy would change."""

    def __init__(self, run):
        self.run, self.out = run, run()

    def replay(self):
        for dst, src in zip(pytree.tree_leaves(self.out), pytree.tree_leaves(self.run())):
            dst.copy_(src)


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")  # exact, and fast: this is about the plumbing
    monkeypatch.setattr(cuda_graph, "check_graphable", lambda model: None)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: "stream")
    captures = []

    def capture(run, pool, stream):
        captures.append((pool, stream))
        graph = FakeGraph(run)
        return graph, graph.out

    monkeypatch.setattr(cuda_graph, "capture", capture)
    return captures


def _cpu_pair(name):
    eager = models.build_model(name, "unet")
    graphed = copy.deepcopy(eager)
    sd_kernels.patch(eager)
    sd_kernels.patch(graphed, cuda_graph=True)
    return eager, graphed


def _cpu_args(unet, batch, side, seed=0):
    x, kw = _args(unet, batch, side, seed, device="cpu", dtype=torch.float32)
    return x, kw


@pytest.mark.parametrize("name", ["tiny", "tiny-xl"])
def test_signatures_static_buffers_and_clones(fake_cuda, name):
    eager, graphed = _cpu_pair(name)
    with torch.no_grad():
        results = []
        for batch, side, seed in [(2, 8, 0), (2, 8, 1), (1, 16, 2), (2, 8, 3)]:
            x, kw = _cpu_args(eager, batch, side, seed)
            got = graphed(x, 10, **kw).sample
            assert torch.equal(got, eager(x, 10, **kw).sample)
            results.append((got, got.clone()))
    assert len(graphed.forward.graphs) == len(fake_cuda) == 2  # one capture per signature
    assert {pool for pool, _ in fake_cuda} == {"pool"}  # one memory pool for all of them
    assert all(torch.equal(got, snapshot) for got, snapshot in results)  # no replay overwrote an output
    sd_kernels.unpatch(graphed)
    assert "forward" not in vars(graphed)


def test_calling_conventions_share_or_split_signatures(fake_cuda):
    eager, graphed = _cpu_pair("tiny")
    x, kw = _cpu_args(eager, 2, 8)
    with torch.no_grad():
        want = eager(x, 10, **kw).sample
        for t in (10, torch.tensor([10]), torch.tensor(10), torch.tensor([10, 10])):
            assert torch.equal(graphed(x, t, **kw).sample, want)
        # a number and the int64 [1] tensor diffusers makes of it are one signature
        assert len(graphed.forward.graphs) == 3
        out = graphed(x, 10, return_dict=False, cross_attention_kwargs=None, **kw)
        assert isinstance(out, tuple) and torch.equal(out[0], want)
        assert torch.equal(graphed(sample=x, timestep=10, **kw).sample, want)
        assert torch.equal(graphed(x, 10.0, **kw).sample, eager(x, 10.0, **kw).sample)


def test_eager_fallbacks_are_logged_once(fake_cuda, monkeypatch, caplog):
    eager, graphed = _cpu_pair("tiny")
    x, kw = _cpu_args(eager, 2, 8)
    with caplog.at_level(logging.WARNING, logger="sd_kernels"):
        with torch.no_grad():
            want = eager(x, 10, **kw).sample
        for _ in range(2):  # autograd on
            assert torch.equal(graphed(x, 10, **kw).sample, want)
        assert not fake_cuda

        def broken(run, pool, stream):
            fake_cuda.append(None)
            raise RuntimeError("operation not permitted when stream is capturing")

        monkeypatch.setattr(cuda_graph, "capture", broken)
        with torch.no_grad():
            for _ in range(2):
                assert torch.equal(graphed(x, 10, **kw).sample, want)
    assert len(fake_cuda) == 1  # a signature whose capture failed is not tried again
    messages = [r.message for r in caplog.records if "running the UNet eagerly" in r.message]
    assert len(messages) == 2 and "autograd" in messages[0] and "capture failed" in messages[1]


def _lora_after_capture(eager, graphed, x, kw):
    """Both models get the same random LoRA after ``graphed`` captured a call: (graphed's output, eager's)."""
    peft = pytest.importorskip("peft", reason="peft is in the test extra")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_v", "proj"], init_lora_weights=False)
    with torch.no_grad():
        before = graphed(x, 10, **kw).sample
        for model in (eager, graphed):
            torch.manual_seed(3)
            model.add_adapter(config)
            model.to(x.dtype)  # peft makes the LoRA weights in fp32
        want = eager(x, 10, **kw).sample
        assert not torch.equal(want, before)
        return graphed(x, 10, **kw).sample, want


def test_adapters_loaded_after_capture_recapture(fake_cuda):
    eager, graphed = _cpu_pair("tiny")
    got, want = _lora_after_capture(eager, graphed, *_cpu_args(eager, 2, 8))
    assert torch.equal(got, want) and len(fake_cuda) == 2


def test_moved_weights_recapture(fake_cuda):
    """Graphs read weights by address: after .to(...) moved them, the same signature captures anew."""
    eager, graphed = _cpu_pair("tiny")
    x, kw = _cpu_args(eager, 2, 8)
    with torch.no_grad():
        graphed(x, 10, **kw)
        graphed.to(torch.float64).to(torch.float32)
        assert torch.equal(graphed(x, 10, **kw).sample, eager(x, 10, **kw).sample)
    assert len(fake_cuda) == 2


# ---------------------------------------------------------------------------------------------
# GPU


def _unet(name="tiny"):
    return models.build_model(name, "unet", device="cuda", dtype=torch.float16)


def _args(unet, batch, side, seed=0, device="cuda", dtype=torch.float16):
    """(sample, keyword arguments) of a UNet call; SDXL's added conditions when the UNet takes them."""
    g = torch.Generator().manual_seed(seed)
    to = lambda t: t.to(device, dtype)
    x = torch.randn(batch, 4, side, side, generator=g)
    kwargs = {"encoder_hidden_states": to(torch.randn(batch, 7, unet.config.cross_attention_dim, generator=g))}
    if unet.config.addition_embed_type == "text_time":
        n_text = unet.config.projection_class_embeddings_input_dim - 6 * unet.config.addition_time_embed_dim
        kwargs["added_cond_kwargs"] = {"text_embeds": to(torch.randn(batch, n_text, generator=g)),
                                       "time_ids": to(torch.tensor([[64.0, 64, 0, 0, 64, 64]] * batch))}
    return to(x), kwargs


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
def test_lora_loaded_after_capture_recaptures():
    eager, graphed, _ = _eager_and_graphed()
    _matches(*_lora_after_capture(eager, graphed, *_args(eager, 2, 8)))
