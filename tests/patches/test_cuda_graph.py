"""patch(..., cuda_graph=True): the UNet replayed from CUDA graphs, one per call signature.

On CPU: the argument normalisation (a number timestep becomes the tensor diffusers would make) and
the clear error for a model not on CUDA. On the GPU: replay == eager across two shapes and back, no
stale outputs, diffusers' calling conventions (SD1.x and SDXL), LoRA loaded after capture, and an
exact unpatch. The same logic runs on CPU against a stand-in graph (FakeGraph below).
"""

import copy
import importlib
import logging
import re

import diffusers.loaders.peft  # noqa: F401  (its annotations read torch.cuda.Stream, which fake_cuda replaces)
import pytest
import torch
from diffusers.models.attention_processor import Attention, AttnProcessor
from dit_checks import cpu_only
from sd_kernels.patches import cuda_graph, graph_capture

import sd_kernels
from sd_kernels import models

pytree = torch.utils._pytree


@pytest.mark.parametrize("t, dtype", [(10, torch.int64), (10.5, torch.float64)])
def test_number_timestep_becomes_diffusers_tensor_on_the_host(t, dtype):
    out = graph_capture.timestep_tensor(t)
    assert out.dtype == dtype and out.shape == (1,) and out.item() == t and out.device.type == "cpu"


def test_tensor_and_bool_timesteps_pass_through():
    t = torch.tensor(3)
    assert graph_capture.timestep_tensor(t) is t
    assert graph_capture.timestep_tensor(True) is True


def test_model_not_on_cuda_is_a_clear_error():
    unet = models.build_model("tiny", "unet")
    with pytest.raises(ValueError, match=r"cuda_graph=True needs the UNet2DConditionModel on one CUDA device.*cpu"):
        sd_kernels.patch(unet, cuda_graph=True)
    assert "forward" not in vars(unet)


# ---------------------------------------------------------------------------------------------
# CPU, with a stand-in for CUDA graphs: GraphedCall's own logic (signatures, static buffers,
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
    monkeypatch.setattr(cuda_graph, "graphable_reason", lambda model: None)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: "stream")
    captures = []

    def capture(run, pool, stream, warmup=1):
        captures.append((pool, stream))
        graph = FakeGraph(run)
        return graph, graph.out

    monkeypatch.setattr(cuda_graph, "capture", capture)
    return captures


def _cpu_pair(name):
    eager = models.build_model(name, "unet")
    graphed = copy.deepcopy(eager)
    sd_kernels.patch(eager, cuda_graph=False)
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


def test_every_new_signature_precompiles_before_its_capture(fake_cuda, monkeypatch):
    """Before each new signature's capture, the eager method runs as sd_kernels.runtime.precompile's dry
    run (a new size may need new specializations even after a dry run found nothing); a signature
    already captured replays without one."""
    from sd_kernels.runtime import precompile

    eager, graphed = _cpu_pair("tiny")
    dry_runs = []

    def fake_precompile(run, device=None):
        dry_runs.append(device)
        run()  # the dry run calls the model's eager method (its output is thrown away)
        return precompile.Report(1 if len(dry_runs) == 1 else 0, 0, 0, 1, 0.0, 0.0)

    monkeypatch.setattr(precompile, "precompile", fake_precompile)
    with torch.no_grad():
        for batch, side in [(2, 8), (2, 8), (1, 8), (2, 16), (1, 16)]:
            x, kw = _cpu_args(eager, batch, side)
            assert torch.equal(graphed(x, 10, **kw).sample, eager(x, 10, **kw).sample)
    assert len(dry_runs) == 4  # one per new signature: (2, 8), (1, 8), (2, 16), (1, 16)
    assert len(fake_cuda) == 4


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


def test_a_compiled_call_that_fails_to_capture_and_to_run_runs_uncompiled(fake_cuda, monkeypatch, caplog):
    """compile=: a signature whose capture fails and whose compiled function raises too (a compiler
    failure at a new shape) runs the uncompiled method from then on, said once; not captured again."""
    eager, graphed = _cpu_pair("tiny")
    x, kw = _cpu_args(eager, 2, 8)
    call = graphed.forward
    tried = []

    def compiled(*args, **kwargs):  # stands in for torch.compile(forward) failing at this shape
        tried.append(None)
        raise RuntimeError("inductor: lowering failed")

    call.eager_fn, call.forward = call.forward, compiled

    def broken(run, pool, stream):
        fake_cuda.append(None)
        raise RuntimeError("capture failed")

    monkeypatch.setattr(cuda_graph, "capture", broken)
    monkeypatch.setattr(call, "precompile", False)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="sd_kernels"):
        want = eager(x, 10, **kw).sample
        for _ in range(3):
            assert torch.equal(graphed(x, 10, **kw).sample, want)
    assert len(fake_cuda) == 1 and len(tried) == 1  # neither the capture nor the compiled function again
    notes = [r.message for r in caplog.records if "eagerly" in r.message]
    assert len(notes) == 1 and "runs uncompiled" in notes[0] and "lowering failed" in notes[0]


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


def _two_adapters(*unets):
    peft = pytest.importorskip("peft", reason="peft is in the test extra")
    for name, seed in (("a", 3), ("b", 4)):
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_v", "proj"], init_lora_weights=False)
        for unet in unets:
            torch.manual_seed(seed)
            unet.add_adapter(config, adapter_name=name)


# (set-up before the capture, the change after it): each alters what the UNet computes.
CHANGES = {
    "set_adapters": (None, lambda m: m.set_adapters(["b"])),
    "weights": (None, lambda m: m.set_adapters(["a", "b"], weights=[0.5, 1.0])),
    "disable_lora": (None, lambda m: m.disable_lora()),
    "fuse_lora": (None, lambda m: m.fuse_lora()),
    "unfuse_lora": (lambda m: m.fuse_lora(), lambda m: m.unfuse_lora()),
    "delete_adapters": (lambda m: m.set_adapters(["a", "b"]), lambda m: m.delete_adapters("b")),
    "processor": (None, lambda m: m.set_attn_processor(AttnProcessor())),
    # read by the processors when a call is captured (the division by it is skipped at 1)
    "rescale_output_factor": (None, lambda m: _every_attention(m, "rescale_output_factor", 2.0)),
    "residual_connection": (None, lambda m: _every_attention(m, "residual_connection", True)),
}


def _every_attention(model, name, value):
    for m in model.modules():
        if isinstance(m, Attention):
            setattr(m, name, value)


@pytest.mark.parametrize("change", CHANGES)
def test_what_a_call_bakes_in_is_watched(fake_cuda, change):
    """A change that alters what the UNet computes without touching its inputs drops the graphs: the
    stand-in graph re-runs the model, so the capture count is what shows it (a real replay would run
    the old adapter mix: a 0.54 error)."""
    eager, graphed = _cpu_pair("tiny")
    _two_adapters(eager, graphed)
    x, kw = _cpu_args(eager, 2, 8)
    before, after = CHANGES[change]
    with torch.no_grad():
        for model in (eager, graphed):
            model.set_adapters(["a"])
            if before is not None:
                before(model)
        first = graphed(x, 10, **kw).sample
        graphed(x, 10, **kw)
        assert len(fake_cuda) == 1
        for model in (eager, graphed):
            after(model)
        want = eager(x, 10, **kw).sample
        # the change matters (a stale replay would show); a swapped processor may compute the same values
        assert change == "processor" or not torch.equal(want, first)
        assert torch.equal(graphed(x, 10, **kw).sample, want)
        graphed(x, 10, **kw)
    assert len(fake_cuda) == 2  # captured anew once, then replayed


def test_lora_scale_per_call_is_part_of_the_signature(fake_cuda):
    """``cross_attention_kwargs={"scale": s}`` scales the LoRA layers for that call only: each scale is
    its own graph, and the default scale replays its own again."""
    eager, graphed = _cpu_pair("tiny")
    _two_adapters(eager, graphed)
    x, kw = _cpu_args(eager, 2, 8)
    with torch.no_grad():
        for scale in (None, 0.5, None, 0.5):
            call = kw if scale is None else {**kw, "cross_attention_kwargs": {"scale": scale}}
            assert torch.equal(graphed(x, 10, **call).sample, eager(x, 10, **call).sample)
        halved = eager(x, 10, **kw, cross_attention_kwargs={"scale": 0.5}).sample
        assert not torch.equal(eager(x, 10, **kw).sample, halved)
    assert len(fake_cuda) == 2


def test_ip_adapter_loaded_after_capture_recaptures(fake_cuda):
    """``load_ip_adapter`` after a capture swaps the cross-attention processors and adds the image
    projection: the next call captures anew (the new processors run as diffusers ships them until
    the model is patched again, on both models here)."""
    eager, graphed = _cpu_pair("tiny")
    x, kw = _cpu_args(eager, 2, 8)
    with torch.no_grad():
        graphed(x, 10, **kw)
        for unet in (eager, graphed):
            models.load_random_ip_adapters(unet, 1)
        kw["added_cond_kwargs"] = {"image_embeds": [torch.randn(2, 1, 16, generator=torch.Generator().manual_seed(3))]}
        assert torch.equal(graphed(x, 10, **kw).sample, eager(x, 10, **kw).sample)
    assert len(fake_cuda) == 2


def test_a_call_the_model_refuses_raises_its_own_error(fake_cuda, caplog):
    """Bad input (an IP-Adapter image embedding of the wrong size) gives diffusers' own error, as
    without the patch: no "capture failed" fallback, nothing remembered for the bad signature, and
    the right call after it captures and matches."""
    eager, graphed = _cpu_pair("tiny")
    for unet in (eager, graphed):
        models.load_random_ip_adapters(unet, 1)
    x, kw = _cpu_args(eager, 2, 8)
    good = {**kw, "added_cond_kwargs": {"image_embeds": [torch.randn(2, 1, 16)]}}
    bad = {**kw, "added_cond_kwargs": {"image_embeds": [torch.randn(2, 1, 15)]}}
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="sd_kernels"):
        with pytest.raises(RuntimeError) as stock_error:
            eager(x, 10, **bad)
        with pytest.raises(type(stock_error.value), match=re.escape(str(stock_error.value).splitlines()[0])):
            graphed(x, 10, **bad)
        assert torch.equal(graphed(x, 10, **good).sample, eager(x, 10, **good).sample)
    assert not graphed.forward.eager_keys and len(graphed.forward.graphs) == 1
    assert not [r for r in caplog.records if "eagerly" in r.message]


def test_an_unknown_adapter_name_is_diffusers_error_and_changes_nothing(fake_cuda):
    pipes = [models.build_pipeline("tiny") for _ in range(2)]
    _two_adapters(*(p.unet for p in pipes))
    sd_kernels.patch(pipes[0].unet, cuda_graph=False)
    sd_kernels.patch(pipes[1].unet, cuda_graph=True)
    eager, graphed = (p.unet for p in pipes)
    x, kw = _cpu_args(eager, 2, 8)
    with torch.no_grad():
        for pipe in pipes:
            pipe.set_adapters(["a"])
        graphed(x, 10, **kw)
        for pipe in pipes:
            with pytest.raises(ValueError, match="missing"):
                pipe.set_adapters(["missing"])
        assert torch.equal(graphed(x, 10, **kw).sample, eager(x, 10, **kw).sample)
    assert len(fake_cuda) == 1


def test_lora_hotswap_after_capture_takes_effect(fake_cuda, tmp_path):
    """diffusers' LoRA hot-swap (``load_lora_weights(..., hotswap=True)``) copies the new adapter's
    weights into the loaded one's tensors: the graphs read them there (the watch sees the same
    addresses) or, if a tensor was replaced, capture anew; either way the next call runs the new LoRA."""
    peft = pytest.importorskip("peft", reason="peft is in the test extra")
    from peft.utils import get_peft_model_state_dict

    pipes = []
    for seed in (3, 4):  # two LoRAs of one shape, saved as a user would have them
        source = models.build_model("tiny", "unet")
        torch.manual_seed(seed)
        source.add_adapter(peft.LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_v"],
                                           init_lora_weights=False))
        type(models.build_pipeline("tiny")).save_lora_weights(
            tmp_path / str(seed), unet_lora_layers=get_peft_model_state_dict(source), safe_serialization=True)
    for graph in (False, True):
        pipe = models.build_pipeline("tiny")
        pipe.load_lora_weights(tmp_path / "3", adapter_name="a")
        sd_kernels.patch(pipe.unet, cuda_graph=graph)
        pipes.append(pipe)
    eager, graphed = (p.unet for p in pipes)
    x, kw = _cpu_args(eager, 2, 8)
    with torch.no_grad():
        first = graphed(x, 10, **kw).sample
        graphed(x, 10, **kw)
        places = [t.data_ptr() for t in graphed.parameters()]
        for pipe in pipes:
            pipe.load_lora_weights(tmp_path / "4", adapter_name="a", hotswap=True)
        want = eager(x, 10, **kw).sample
        assert not torch.equal(want, first)
        assert torch.equal(graphed(x, 10, **kw).sample, want)
    # the stand-in graph re-runs the model; a real one reads the weights where they were at capture:
    # so either they are still there, or the graphs were captured anew
    assert places == [t.data_ptr() for t in graphed.parameters()] or len(fake_cuda) == 2


def test_ip_adapter_scale_set_after_capture_recaptures(fake_cuda):
    """set_ip_adapter_scale changes the IP-Adapter processors' scale lists in place: a new scale is
    a new capture, an unchanged one a replay."""
    from diffusers.models.attention_processor import IPAdapterAttnProcessor2_0

    eager = models.build_model("tiny", "unet")
    models.load_random_ip_adapters(eager, 1)
    graphed = copy.deepcopy(eager)
    sd_kernels.patch(eager, cuda_graph=False)
    sd_kernels.patch(graphed, cuda_graph=True)
    x, kw = _cpu_args(eager, 2, 8)
    kw["added_cond_kwargs"] = {"image_embeds": [torch.randn(2, 1, 16, generator=torch.Generator().manual_seed(3))]}
    with torch.no_grad():
        for scale in (1.0, 0.3, 0.3):
            for unet in (eager, graphed):
                for p in unet.attn_processors.values():
                    if isinstance(p, IPAdapterAttnProcessor2_0):
                        p.scale[0] = scale  # what pipe.set_ip_adapter_scale(scale) does
            assert torch.equal(graphed(x, 10, **kw).sample, eager(x, 10, **kw).sample)
    assert len(fake_cuda) == 2  # captured at 1.0 and at 0.3, then replayed


def test_vae_tiling_switched_on_after_capture_recaptures(fake_cuda):
    pipe = models.build_pipeline("tiny")
    sd_kernels.patch(pipe, cuda_graph=True)
    z = torch.randn(1, 4, 8, 8)
    with torch.no_grad():
        pipe.vae.decode(z)
        pipe.vae.decode(z)
        pipe.vae.enable_tiling()
        pipe.vae.decode(z)
    assert len(pipe.vae.decode.graphs) == 1 and len(fake_cuda) == 2  # the decode captured twice, replayed once


def test_moved_weights_recapture(fake_cuda):
    """Graphs read weights by address: after .to(...) moved them, the first call runs eagerly and the
    second, the weights still in place, captures anew."""
    eager, graphed = _cpu_pair("tiny")
    x, kw = _cpu_args(eager, 2, 8)
    with torch.no_grad():
        graphed(x, 10, **kw)
        old = [p.data for p in graphed.parameters()]  # alive: the moved weights cannot reuse their addresses
        graphed.to(torch.float64).to(torch.float32)
        assert next(graphed.parameters()).data_ptr() != old[0].data_ptr()
        for captures in (1, 2, 2):
            assert torch.equal(graphed(x, 10, **kw).sample, eager(x, 10, **kw).sample)
            assert len(fake_cuda) == captures


def test_a_buffer_moved_alone_recaptures(fake_cuda):
    """Every parameter and buffer is watched, not only the first parameter."""
    eager, graphed = _cpu_pair("tiny")
    x, kw = _cpu_args(eager, 2, 8)
    with torch.no_grad():
        graphed(x, 10, **kw)
        last = list(graphed.parameters())[-1]
        last.data = last.data.clone()
        graphed(x, 10, **kw)
        assert len(fake_cuda) == 1 and not graphed.forward.graphs  # dropped, this call eager
        graphed(x, 10, **kw)
    assert len(fake_cuda) == 2


def test_forward_hooks_inside_the_model_run_eagerly_until_removed(fake_cuda, monkeypatch, caplog):
    """A forward hook on a module inside the graphed model, added after a capture, or one for every module: a
    replay would not run it, so the calls run eagerly and it runs on each (logged once); removed, the graph
    captured before replays again. The model's own hooks run around the graphed call and replay-safe ones are
    captured with it: neither makes a call eager."""
    from sd_kernels.patches import hooks

    eager, graphed = _cpu_pair("tiny")
    x, kw = _cpu_args(eager, 2, 8)
    call, eager_calls, seen = graphed.forward, [], []
    real = call._eager
    monkeypatch.setattr(call, "_eager", lambda reason, *a, **k: eager_calls.append(reason) or real(reason, *a, **k))
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="sd_kernels"):
        want = eager(x, 10, **kw).sample
        assert torch.equal(graphed(x, 10, **kw).sample, want) and len(fake_cuda) == 1 and not eager_calls
        handle = graphed.conv_in.register_forward_hook(lambda *a: seen.append("conv_in"))
        for _ in range(2):
            assert torch.equal(graphed(x, 10, **kw).sample, want)
        assert seen == ["conv_in"] * 2 and len(eager_calls) == 2 and "conv_in (Conv2d)" in eager_calls[0]
        handle.remove()
        assert torch.equal(graphed(x, 10, **kw).sample, want)
        assert len(eager_calls) == 2 and len(fake_cuda) == 1  # the graph captured before replays
        handle = torch.nn.modules.module.register_module_forward_hook(lambda *a: None)
        graphed(x, 10, **kw)
        handle.remove()
        assert len(eager_calls) == 3 and "every module" in eager_calls[2]
        own = graphed.register_forward_pre_hook(lambda *a: seen.append("own"))
        safe = graphed.conv_in.register_forward_hook(hooks.replay_safe(lambda *a: None))
        assert torch.equal(graphed(x, 10, **kw).sample, want)
        own.remove()
        safe.remove()
        assert len(eager_calls) == 3 and seen[-1] == "own" and len(fake_cuda) == 1
    assert len([r for r in caplog.records if "conv_in (Conv2d)" in r.message]) == 1


def test_a_diffusers_hook_inside_the_model_makes_the_calls_eager_until_removed(fake_cuda, monkeypatch):
    """diffusers' hooks (a cache, layer skip: state across calls, a decision per call) on a module inside the
    graphed model, registered before any capture: a capture would replay one call's decision, so the calls run
    eagerly and the hook runs on each; removed, the model captures. Registering one moves no counter torch keeps:
    the modules are read again before each capture. Context parallelism's split and gather (and hooks marked
    ``replay_safe``) are replay-safe."""
    from diffusers.hooks import HookRegistry, ModelHook
    from sd_kernels.patches import hooks

    class Counting(ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            seen.append(type(module).__name__)
            return args, kwargs

    eager, graphed = _cpu_pair("tiny")
    x, kw = _cpu_args(eager, 2, 8)
    call, eager_calls, seen = graphed.forward, [], []
    real = call._eager
    monkeypatch.setattr(call, "_eager", lambda reason, *a, **k: eager_calls.append(reason) or real(reason, *a, **k))
    registry = HookRegistry.check_if_exists_or_initialize(graphed.conv_in)
    registry.register_hook(Counting(), "counting")
    with torch.no_grad():
        want = eager(x, 10, **kw).sample
        for _ in range(3):
            assert torch.equal(graphed(x, 10, **kw).sample, want)
        assert seen == ["Conv2d"] * 3 and not fake_cuda
        assert "diffusers' hook 'counting' (Counting) on conv_in (Conv2d)" in eager_calls[-1]
        registry.remove_hook("counting", recurse=False)
        for _ in range(3):
            assert torch.equal(graphed(x, 10, **kw).sample, want)
        assert len(fake_cuda) == 1 and seen == ["Conv2d"] * 3
    inside = list(graphed.named_modules())[1:]
    registry.register_hook(hooks.replay_safe(Counting()), "marked")
    assert hooks.replay_skipped(inside) is None
    registry.remove_hook("marked", recurse=False)
    split = type("Split", (ModelHook,), {"__module__": "diffusers.hooks.context_parallel"})
    registry.register_hook(split(), "split")
    assert hooks.replay_skipped(inside) is None
    registry.register_hook(Counting(), "counting")
    assert "'counting'" in hooks.replay_skipped(inside)


def test_a_diffusers_hook_registered_after_a_capture_makes_the_calls_eager(fake_cuda, monkeypatch):
    """A diffusers hook registered inside the graphed model after its graph was captured: the next calls run
    eagerly with the hook (a replay would pass it by: diffusers' registrations move no counter torch keeps, so the
    patch counts them while its graphs watch); removed, the graph captured before replays again. The count stops
    with the patch: diffusers' own ``register_hook`` is back after unpatch."""
    from diffusers.hooks import HookRegistry, ModelHook

    import sd_kernels

    class Counting(ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            seen.append(type(module).__name__)
            return args, kwargs

    stock_register = HookRegistry.__dict__["register_hook"]
    eager, graphed = _cpu_pair("tiny")
    x, kw = _cpu_args(eager, 2, 8)
    call, eager_calls, seen = graphed.forward, [], []
    real = call._eager
    monkeypatch.setattr(call, "_eager", lambda reason, *a, **k: eager_calls.append(reason) or real(reason, *a, **k))
    with torch.no_grad():
        want = eager(x, 10, **kw).sample
        for _ in range(2):  # the capture, then a replay
            assert torch.equal(graphed(x, 10, **kw).sample, want)
        assert len(fake_cuda) == 1 and not eager_calls
        registry = HookRegistry.check_if_exists_or_initialize(graphed.conv_in)
        registry.register_hook(Counting(), "counting")
        for _ in range(2):
            assert torch.equal(graphed(x, 10, **kw).sample, want)
        assert seen == ["Conv2d"] * 2 and len(eager_calls) == 2 and "'counting'" in eager_calls[0]
        registry.remove_hook("counting", recurse=False)
        assert torch.equal(graphed(x, 10, **kw).sample, want)
        assert len(eager_calls) == 2 and len(fake_cuda) == 1 and seen == ["Conv2d"] * 2
    sd_kernels.unpatch(graphed)
    assert HookRegistry.__dict__["register_hook"] is stock_register


def test_a_parameter_set_anew_is_not_replayed_from_the_old_one(fake_cuda, monkeypatch):
    """A Parameter of a module inside the graphed model set anew after a capture (``conv.weight =
    nn.Parameter(...)``, ``load_state_dict(assign=True)``): the graph reads the old one's address, so the graphs
    are dropped, the next call runs eagerly with the new weight and the one after captures again; so with a buffer
    set to None."""
    eager, graphed = _cpu_pair("tiny")
    x, kw = _cpu_args(eager, 2, 8)
    call, eager_calls = graphed.forward, []
    real = call._eager
    monkeypatch.setattr(call, "_eager", lambda reason, *a, **k: eager_calls.append(reason) or real(reason, *a, **k))
    with torch.no_grad():
        for _ in range(2):
            graphed(x, 10, **kw)
        assert len(fake_cuda) == 1 and not eager_calls
        for model in (eager, graphed):
            model.conv_in.weight = torch.nn.Parameter(model.conv_in.weight.detach() * 2)
        want = eager(x, 10, **kw).sample
        assert torch.equal(graphed(x, 10, **kw).sample, want) and eager_calls == [cuda_graph.MOVED]
        assert torch.equal(graphed(x, 10, **kw).sample, want) and len(fake_cuda) == 2
        graphed.conv_in.bias = None
        graphed(x, 10, **kw)
        assert len(eager_calls) == 2


def test_transformers_output_capturing_hooks_are_replay_safe():
    """SDXL's CLIP encoders, asked for their hidden states, carry transformers' output-capturing hooks on their
    layers from their first call: they only gather what the call returns (a graph returns its captured output
    whole), so they do not make the graphed encoders eager; a hook of the user's on a layer does."""
    from sd_kernels.patches import hooks

    pipe = models.build_pipeline("tiny-xl")
    with torch.no_grad():
        pipe("a cat", num_inference_steps=1, height=64, width=64, output_type="latent")
    for encoder in (pipe.text_encoder, pipe.text_encoder_2):
        inside = list(encoder.named_modules())[1:]
        assert any(m._forward_hooks for _, m in inside)
        assert hooks.replay_skipped(inside) is None
        name, layer_norm = next((n, m) for n, m in inside if n.endswith("final_layer_norm"))
        handle = layer_norm.register_forward_hook(lambda *a: None)
        assert f"{name} (LayerNorm)" in hooks.replay_skipped(inside)
        handle.remove()


def test_weights_moved_around_every_call_never_capture(fake_cuda, caplog, monkeypatch):
    """The SDXL pipeline moves its VAE to fp32 for the decode and back after it, on every call: a
    capture would never be replayed, so those calls run eagerly (said once), and stay exact. The first
    of them has its kernels precompiled (a dry run), the later ones not."""
    eager, pipe, _ = _pipe_pair()
    ref, graphed = eager.vae, pipe.vae
    prepared = []
    prepare = cuda_graph.GraphedCall.prepare
    monkeypatch.setattr(cuda_graph.GraphedCall, "prepare",
                        lambda self, leaves, tree: prepared.append(leaves[0].dtype) or prepare(self, leaves, tree))
    z = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    kept = []  # each round's weights stay alive, so the next round's cannot take their addresses
    with torch.no_grad(), caplog.at_level(logging.INFO, logger="sd_kernels"):
        graphed.decode(z)
        for _ in range(3):
            graphed.to(torch.float64)
            kept.append([p.data for p in graphed.parameters()])
            out = graphed.decode(z.double()).sample
            graphed.to(torch.float32)
            kept.append([p.data for p in graphed.parameters()])
            assert torch.equal(out, ref.double().decode(z.double()).sample)
            ref.float()
    assert len(fake_cuda) == 1  # the first decode only
    assert sum("weights moved" in r.getMessage() for r in caplog.records) == 1
    assert prepared == [torch.float32, torch.float64]  # the capture's, then the first moved call's


SCHEDULERS = ["PNDMScheduler", "DDIMScheduler", "EulerDiscreteScheduler", "EulerAncestralDiscreteScheduler",
              "DPMSolverMultistepScheduler", "UniPCMultistepScheduler"]


def _pipe_pair(name="tiny", scheduler=None, device="cpu", dtype=torch.float32, compile=False, mode=True):
    """(patched eagerly, patched with cuda_graph=mode, the latter's record): copies of one tiny
    pipeline with the same scheduler."""
    import diffusers

    eager = models.build_pipeline(name, device=device, dtype=dtype)
    eager.set_progress_bar_config(disable=True)
    if scheduler:
        eager.scheduler = getattr(diffusers, scheduler).from_config(eager.scheduler.config)
    graphed = copy.deepcopy(eager)
    sd_kernels.patch(eager, cuda_graph=False)
    return eager, graphed, sd_kernels.patch(graphed, cuda_graph=mode, compile=compile)


def _pipe_run(pipe, steps=3, **kwargs):
    return pipe(prompt="a cat", num_inference_steps=steps, height=64, width=64, output_type="pt",
                generator=torch.Generator().manual_seed(0), **kwargs).images


@pytest.mark.integration
@pytest.mark.parametrize("name", ["tiny", "tiny-xl"])
def test_pipeline_mode_graphs_every_model_call(fake_cuda, name):
    eager, graphed, record = _pipe_pair(name)
    encoders = [p for p in ("text_encoder", "text_encoder_2") if getattr(graphed, p, None) is not None]
    assert record.cuda_graph == "pipeline" and record.counts["cuda_graph"] == 2 + len(encoders)
    assert isinstance(vars(graphed.vae)["decode"], cuda_graph.GraphedCall)
    for part in encoders:
        assert isinstance(vars(getattr(graphed, part))["forward"], cuda_graph.GraphedCall)
    with torch.no_grad():
        for steps in (3, 3, 2):
            assert torch.equal(_pipe_run(graphed, steps), _pipe_run(eager, steps))
    # one signature per model call kind: UNet (batch 2 with guidance), VAE decode, each encoder's call
    assert len(graphed.unet.forward.graphs) == 1 and len(graphed.vae.decode.graphs) == 1
    assert graphed.scheduler.timesteps.device.type == "cpu"
    assert record.counts["fast_execution_device"] == 1 and type(graphed) is not type(eager)
    sd_kernels.unpatch(graphed)
    assert type(graphed) is type(eager)
    assert "decode" not in vars(graphed.vae) and "set_timesteps" not in vars(graphed.scheduler)
    assert all("forward" not in vars(getattr(graphed, p)) for p in encoders)


@pytest.mark.integration
@pytest.mark.parametrize("mode", [True, "step"])
def test_calls_in_and_out_of_inference_mode_share_one_graph(fake_cuda, mode):
    """A pipeline called under ``torch.inference_mode()``, then outside it, then under it again: each call's images
    are eager's, and the UNet's calls of all three replay one graph (captured and replayed outside inference mode,
    its static inputs are normal tensors, which a call outside it can copy into)."""
    eager, graphed, _ = _pipe_pair("tiny", mode=mode)
    want = _pipe_run(eager, 2)
    for inference in (True, False, True):
        with torch.inference_mode(inference):
            assert torch.equal(_pipe_run(graphed, 2), want)
    assert len(graphed.unet.forward.graphs) == 1


def test_a_call_under_inference_mode_is_captured_and_replayed_outside_it_with_autograd_off(fake_cuda):
    """What the graphs run of a call made under ``torch.inference_mode()`` runs outside it (so the kernels' paths that
    need version counters serve it) and without autograd; its output is a normal tensor with the eager call's values.
    A call that runs eagerly (here: a forward hook inside the model, which a replay would skip) keeps the caller's
    mode."""
    eager, graphed = _cpu_pair("tiny")
    seen = []
    call = graphed.forward
    method = call.forward
    call.forward = lambda *a, **kw: seen.append((torch.is_inference_mode_enabled(), torch.is_grad_enabled())) or \
        method(*a, **kw)
    x, kw = _cpu_args(eager, 2, 8)
    with torch.no_grad():
        want = eager(x, 10, **kw).sample
    with torch.inference_mode():
        first, second = graphed(x, 10, **kw).sample, graphed(x, 10, **kw).sample
    assert torch.equal(first, want) and torch.equal(second, want) and not first.is_inference()
    assert len(seen) >= 2 and set(seen) == {(False, False)}, seen  # the capture's calls and each replay
    seen.clear()
    graphed.conv_in.register_forward_hook(lambda *a: None)
    with torch.inference_mode():
        assert torch.equal(graphed(x, 10, **kw).sample, want)
    assert seen == [(True, False)]


def _adapter_residuals(unet, x, seed):
    """A T2I-Adapter's residuals for ``unet`` (one per down block with cross-attention, at its input's size)."""
    g = torch.Generator().manual_seed(seed)
    out, side = [], x.shape[-1]
    for channels, block in zip(unet.config.block_out_channels, unet.down_blocks, strict=True):
        if getattr(block, "has_cross_attention", False):
            out.append(torch.randn(x.shape[0], channels, side, side, generator=g))
        if block.downsamplers is not None:
            side //= 2
    return out


@pytest.mark.parametrize("inference", [False, True])
def test_a_list_argument_the_model_takes_from_reaches_the_capture_and_every_replay(fake_cuda, inference):
    """diffusers' UNet pops a T2I-Adapter's residuals off the list it is given (``down_intrablock_additional_
    residuals``): each run of a capture gets containers of its own, so the captured call and every replay add them,
    the new ones at each call."""
    eager, graphed = _cpu_pair("tiny")
    x, kw = _cpu_args(eager, 2, 8)
    with torch.inference_mode(inference), torch.no_grad():
        plain = eager(x, 10, **kw).sample
        for seed in (0, 1, 2):
            residuals = _adapter_residuals(eager, x, seed)
            want = eager(x, 10, **kw, down_intrablock_additional_residuals=list(residuals)).sample
            got = graphed(x, 10, **kw, down_intrablock_additional_residuals=list(residuals)).sample
            assert torch.equal(got, want) and not torch.equal(got, plain)


@cpu_only
@pytest.mark.parametrize("inference", [False, True])
def test_codes_kept_on_a_static_input_by_the_warm_up_do_not_serve_the_captured_call(fake_cuda, monkeypatch,
                                                                                     inference):
    """A capture's warm-up and its captured call run on the same static inputs. With the FP8 tier's cross-attention
    keys and values in FP8 (``CROSS_KV_FP8``) the warm-up's quantization of the text stays on the static text (by
    version counter); the captured call must quantize it again, or every replay reads the warm-up's prompt."""
    from sd_kernels.patches import fp8 as fp8_patch
    from test_fp8_patch import _model

    fp8_linear = importlib.import_module("sd_kernels.ops.fp8_linear")
    monkeypatch.setattr(fp8_patch, "CROSS_KV_FP8", True)
    phase, quantized = [None], {"warm-up": [], "capture": []}
    quantize = fp8_linear.quantize_rows

    def spy(x, *a, **k):
        if phase[0]:
            quantized[phase[0]].append(x)
        return quantize(x, *a, **k)

    def capture(run, pool, stream, warmup=1):  # fake_cuda's, with graph_capture.capture's warm-up call first
        phase[0] = "warm-up"
        run()
        phase[0] = "capture"
        graph = FakeGraph(run)
        phase[0] = None
        return graph, graph.out

    monkeypatch.setattr(fp8_linear, "quantize_rows", spy)
    monkeypatch.setattr(cuda_graph, "capture", capture)
    model = _model("tiny")
    g = torch.Generator().manual_seed(0)
    x, text = torch.randn(1, 4, 8, 8, generator=g).half(), torch.randn(1, 4, 32, generator=g).half()
    sd_kernels.patch(model, precision="fp8", cuda_graph="unet", ops=[])
    try:
        vars(model)["forward"].precompile = False
        with torch.inference_mode(inference), torch.no_grad():
            model(x, 10, encoder_hidden_states=text)
        (graph,) = vars(model)["forward"].graphs.values()
        static = next(t for t in graph.static if isinstance(t, torch.Tensor) and t.shape == text.shape)
        counts = {k: sum(t is static for t in v) for k, v in quantized.items()}
        assert counts["warm-up"] > 0 and counts["capture"] == counts["warm-up"], counts
    finally:
        sd_kernels.unpatch(model)


@pytest.mark.integration
@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_host_timesteps_keep_images(fake_cuda, scheduler):
    """Each scheduler the pipeline mode gives host timesteps: the same images as with its own."""
    eager, graphed, record = _pipe_pair("tiny", scheduler)
    assert record.counts["host_timesteps"] == 1
    with torch.no_grad():
        assert torch.equal(_pipe_run(graphed, 4), _pipe_run(eager, 4))
    assert graphed.scheduler.timesteps.device.type == "cpu"


def test_unknown_scheduler_is_left_alone_and_reported(fake_cuda):
    eager, graphed, record = _pipe_pair("tiny", "DDPMScheduler")
    assert "host_timesteps" not in record.counts and "set_timesteps" not in vars(graphed.scheduler)
    assert any(s.path == "scheduler" and "not checked with host timesteps" in s.reason for s in record.skipped)


def test_unet_mode_graphs_the_unet_alone(fake_cuda):
    pipe = models.build_pipeline("tiny")
    record = sd_kernels.patch(pipe, cuda_graph="unet")
    assert record.counts["cuda_graph"] == 1 and "decode" not in vars(pipe.vae)
    assert "set_timesteps" not in vars(pipe.scheduler)


def test_a_new_scheduler_repatches(fake_cuda):
    import diffusers

    pipe = models.build_pipeline("tiny")
    first = sd_kernels.patch(pipe, cuda_graph=True)
    assert sd_kernels.patch(pipe, cuda_graph=True) is first
    old = pipe.scheduler
    pipe.scheduler = diffusers.DDIMScheduler.from_config(old.config)
    second = sd_kernels.patch(pipe, cuda_graph=True)
    assert second is not first and "set_timesteps" in vars(pipe.scheduler)
    assert "set_timesteps" not in vars(old)  # the first patch's wrapper went with its unpatch


def test_model_off_cuda_is_reported_not_graphed(fake_cuda, monkeypatch):
    monkeypatch.setattr(cuda_graph, "graphable_reason",
                        lambda model: "off CUDA" if type(model).__name__ == "CLIPTextModel" else None)
    pipe = models.build_pipeline("tiny")
    record = sd_kernels.patch(pipe, cuda_graph=True)
    assert "forward" not in vars(pipe.text_encoder)
    assert any(s.path == "text_encoder" and "off CUDA" in s.reason for s in record.skipped)


def test_auto_graphs_what_can_be_captured_unless_the_profile_caps_memory(fake_cuda):
    pipe = models.build_pipeline("tiny")
    assert sd_kernels.patch(pipe).cuda_graph == "pipeline"  # the default, where the UNet can be captured
    assert sd_kernels.patch(pipe, profile="s23-ultra").cuda_graph is None  # a graph pool would defeat the budget
    assert sd_kernels.patch(pipe, cuda_graph=False).cuda_graph is None
    sd_kernels.unpatch(pipe)


@pytest.mark.parametrize("asked, mode, label", [
    (True, "default", ", compile"), ("max-autotune", "max-autotune-no-cudagraphs", ", compile=max-autotune")])
def test_compile_modes_reach_torch_compile_without_inductors_own_graphs(fake_cuda, monkeypatch, asked, mode, label):
    """compile= picks torch.compile's mode for what the graphs capture (the UNet's forward, the VAE's
    decode, not SD's CLIP text encoder); inductor's own CUDA graphs stay off; the record says which; the
    same arguments again keep the patch, another mode re-patches."""
    compiled = []

    def fake_compile(fn, **kwargs):
        compiled.append((getattr(fn, "__name__", ""), kwargs))
        return fn

    monkeypatch.setattr(torch, "compile", fake_compile)
    _, graphed, record = _pipe_pair(compile=asked)
    assert sorted(compiled) == [("decode", {"fullgraph": True, "mode": mode}),
                                ("forward", {"fullgraph": True, "mode": mode})]
    assert f"{label}):" in record.summary() and record.arguments["compile"] == record.compile
    assert sd_kernels.patch(graphed, **record.arguments) is record
    other = "default" if asked == "max-autotune" else "max-autotune"
    assert sd_kernels.patch(graphed, cuda_graph=True, compile=other).compile == other


def test_compile_takes_a_t5_text_encoder_too(fake_cuda, monkeypatch):
    """PixArt's T5 encoder is compiled with its transformer and VAE decode (COMPILED_TEXT_ENCODERS);
    SD's CLIP encoder is not (the test above); without compile= nothing is."""
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiled.append(fn.__self__) or fn)
    pipe = models.build_pipeline("tiny-pixart")
    sd_kernels.patch(pipe, cuda_graph=True)
    assert compiled == [] and isinstance(vars(pipe.text_encoder)["forward"], cuda_graph.GraphedCall)
    sd_kernels.patch(pipe, cuda_graph=True, compile=True)
    assert sorted(type(m).__name__ for m in compiled) == ["AutoencoderKL", "PixArtTransformer2DModel",
                                                          "T5EncoderModel"]
    sd_kernels.unpatch(pipe)


def test_auto_on_cpu_patches_eagerly_and_compile_says_why_not():
    pipe = models.build_pipeline("tiny")
    assert sd_kernels.patch(pipe).cuda_graph is None and "forward" not in vars(pipe.unet)
    sd_kernels.unpatch(pipe)
    with pytest.raises(ValueError, match=r"cuda_graph='auto' captures nothing here \(needs the UNet2DConditionModel"):
        sd_kernels.patch(pipe, compile=True)


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
    sd_kernels.patch(eager, cuda_graph=False)
    record = sd_kernels.patch(graphed, cuda_graph=True)
    return eager, graphed, record


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tiny", "tiny-xl"])
def test_replay_matches_eager_across_shapes_without_stale_outputs(name):
    eager, graphed, record = _eager_and_graphed(name)
    forward = graphed.forward
    assert isinstance(forward, cuda_graph.GraphedCall) and record.counts["cuda_graph"] == 1
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


def _gpu_pipe_pair(scheduler=None, compile=False):
    return _pipe_pair("tiny", scheduler, "cuda", torch.float16, compile)[:2]


def _gpu_run(pipe, steps=4, seed=0, **kwargs):
    return pipe(prompt="a cat", num_inference_steps=steps, height=kwargs.pop("size", 64), width=64,
                output_type="pt", generator=torch.Generator("cuda").manual_seed(seed), **kwargs).images


class _SyncsPerStep:
    """A callback_on_step_end that records how many host syncs the loop made up to each step's end."""

    def __init__(self, caught):
        self.caught, self.counts = caught, []

    def __call__(self, pipe, i, t, kwargs):
        self.counts.append(sum("synchronizing CUDA operation" in str(w.message) for w in self.caught))
        return kwargs


@pytest.mark.gpu
@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_pipeline_mode_matches_eager_and_the_loop_never_waits(scheduler):
    """Every model call replayed, the timesteps on the host (and UniPC's coefficients): the images of
    the eager pipeline given the same scheduler arithmetic (host timesteps, UniPC's host coefficients:
    they round differently from diffusers' device ones, up to 3 fp16 ulps of the image here; their
    accuracy against float64 is test_scheduler_patch's), and no host sync between the end of the first
    step and the end of the last."""
    import warnings

    from sd_kernels.patches.scheduler import host_timesteps

    eager, graphed = _gpu_pipe_pair(scheduler)
    assert host_timesteps(eager.scheduler, sd_kernels.patch(eager, cuda_graph=False))  # the patch it has
    with torch.no_grad():
        want = _gpu_run(eager)
        _matches(_gpu_run(graphed), want)  # captures
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            steps = _SyncsPerStep(caught)
            torch.cuda.set_sync_debug_mode("warn")
            try:
                got = _gpu_run(graphed, callback_on_step_end=steps)
            finally:
                torch.cuda.set_sync_debug_mode("default")
    _matches(got, want)
    assert len(steps.counts) >= 4  # PNDM's first step runs twice (its Runge-Kutta warm-up)
    assert steps.counts[-1] == steps.counts[0], steps.counts


@pytest.mark.gpu
def test_pipeline_mode_recaptures_or_replays_correctly_when_the_call_changes():
    eager, graphed = _gpu_pipe_pair()
    calls = [{}, {"size": 128}, {"num_images_per_prompt": 2}, {"steps": 6}, {"guidance_scale": 2.0},
             {"guidance_scale": 1.0}, {}]  # guidance 1: no classifier-free guidance, UNet batch 1
    with torch.no_grad():
        for kwargs in calls:
            _matches(_gpu_run(graphed, **dict(kwargs)), _gpu_run(eager, **dict(kwargs)))
    assert len(graphed.unet.forward.graphs) == 4  # batch 2 at 64 and 128, batch 4, batch 1


@pytest.mark.gpu
def test_pipeline_mode_drops_its_graphs_when_the_pipeline_moves():
    eager, graphed = _gpu_pipe_pair()
    with torch.no_grad():
        _gpu_run(graphed)
        graphed.to(torch.float32)
        eager.to(torch.float32)
        _matches(_gpu_run(graphed), _gpu_run(eager))


@pytest.mark.gpu
@pytest.mark.parametrize("compile", [True, "max-autotune"])
def test_compile_inside_the_graphs_matches_eager(compile):
    eager, graphed = _gpu_pipe_pair(compile=compile)
    with torch.no_grad():
        want = _gpu_run(eager)
        for _ in range(2):
            got = _gpu_run(graphed)
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)  # inductor fuses in another order
    torch._dynamo.reset()


def _controlnet_run(pipe, steps=3, scale=1.0):
    image = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(5))
    cond = [image] * 2 if type(pipe.controlnet).__name__ == "MultiControlNetModel" else image
    return _pipe_run(pipe, steps, image=cond, controlnet_conditioning_scale=scale)


@pytest.mark.integration
@pytest.mark.parametrize("controlnets", [1, 2])
def test_pipeline_mode_graphs_the_controlnet_call(fake_cuda, controlnets):
    """ControlNet pipelines (one ControlNet, or a MultiControlNetModel of two): the ControlNet call is
    replayed from graphs beside the UNet's, with the same images as eager; a new conditioning scale is
    a new signature, not a stale replay."""
    eager = models.build_controlnet_pipeline("tiny", controlnets=controlnets)
    eager.set_progress_bar_config(disable=True)
    graphed = copy.deepcopy(eager)
    sd_kernels.patch(eager, cuda_graph=False)
    record = sd_kernels.patch(graphed, cuda_graph=True)
    assert "controlnet" in record.parts and record.counts["cuda_graph"] == 4  # + UNet, VAE, text encoder
    assert isinstance(vars(graphed.controlnet)["forward"], cuda_graph.GraphedCall)
    with torch.no_grad():
        for scale in (1.0, 1.0, 0.5):
            assert torch.equal(_controlnet_run(graphed, scale=scale), _controlnet_run(eager, scale=scale))
    assert len(graphed.controlnet.forward.graphs) == 2
    sd_kernels.unpatch(graphed)
    assert "forward" not in vars(graphed.controlnet)
