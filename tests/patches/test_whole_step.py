"""patch(pipe, cuda_graph="step"): each denoising step replayed from one CUDA graph (patches/whole_step.py).

On CPU against the stand-in for CUDA graphs (test_cuda_graph.FakeGraph: a replay re-runs the captured
step on the same static inputs and writes into the same outputs): the hooks, keys, scheduler-state
snapshots, noise tape, callbacks, changes between calls, fallbacks and unpatch, with images compared
exactly against the eager patched pipeline. On the GPU: the same comparisons with real graphs, for
every scheduler, and no host sync inside the loop.
"""

import logging

import diffusers
import pytest
import torch
from sd_kernels.patches import cuda_graph, whole_step
from sd_kernels.patches import diffusers_sources as verified
from test_cuda_graph import SCHEDULERS, _pipe_pair, fake_cuda  # noqa: F401  (fake_cuda: a fixture)

import sd_kernels
from sd_kernels import models


@pytest.fixture
def fake_step(fake_cuda, monkeypatch):  # noqa: F811
    """fake_cuda, and the whole-step captures through the same stand-in."""
    monkeypatch.setattr(whole_step, "capture", cuda_graph.capture)  # fake_cuda replaced cuda_graph.capture
    return fake_cuda


def _pair(name="tiny", scheduler=None, device="cpu", dtype=torch.float32, mode="step"):
    """(patched eagerly, patched with cuda_graph=mode, the latter's record): copies of one tiny pipeline."""
    return _pipe_pair(name, scheduler, device, dtype, mode=mode)


def _run(pipe, steps=3, seed=0, device="cpu", size=32, generator=None, prompt="a cat", **kwargs):
    generator = generator if generator is not None else torch.Generator(device).manual_seed(seed)
    return pipe(prompt=prompt, num_inference_steps=steps, height=size, width=size, output_type="pt",
                generator=generator, **kwargs).images


def _steps(pipe):
    return vars(pipe)[whole_step._ATTR]


@pytest.mark.integration
@pytest.mark.parametrize("name, scheduler", [("tiny", s) for s in SCHEDULERS]
                         + [("tiny-xl", "EulerAncestralDiscreteScheduler"), ("tiny-xl", "UniPCMultistepScheduler")])
def test_whole_steps_match_the_eager_loop(fake_step, name, scheduler):
    """Every step runs from a step graph (the UNet's own graphs stay empty); the images and the
    generator's state after the call are the eager loop's, across captures and replays."""
    eager, graphed, record = _pair(name, scheduler)
    assert record.cuda_graph == "step" and record.counts["whole_step"] == 1
    with torch.no_grad():
        for steps in (3, 3, 4, 3):
            g_eager, g_graphed = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
            want = _run(eager, steps, generator=g_eager)
            assert torch.equal(_run(graphed, steps, generator=g_graphed), want)
            assert torch.equal(g_graphed.get_state(), g_eager.get_state())  # the same draws, in the same order
    assert len(graphed.unet.forward.graphs) == 0
    assert _steps(graphed).steps == 13 + (4 if scheduler == "PNDMScheduler" else 0)  # PNDM: one more step a call


def test_alternating_step_counts_replay_without_new_captures(fake_step):
    """PNDM keeps a sample across calls (a 1-step call leaves it set): the next call's first step finds
    another tensor in the state than its capture did, and copies it over instead of capturing again."""
    eager, graphed, _ = _pair("tiny", "PNDMScheduler")
    with torch.no_grad():
        for steps in (3, 1, 3, 1):
            assert torch.equal(_run(graphed, steps), _run(eager, steps))
        captured = len(fake_step)
        for steps in (3, 1, 3, 1, 3):
            assert torch.equal(_run(graphed, steps), _run(eager, steps))
    assert len(fake_step) == captured


CHANGES = [{}, {"prompt": "a dog"}, {"size": 64}, {"num_images_per_prompt": 2}, {"steps": 5}, {"guidance_scale": 2.0},
           {"guidance_scale": 1.0}, {"guidance_rescale": 0.7}, {"eta": 0.5}, {}]


@pytest.mark.integration
def test_changes_between_calls_recapture_or_replay_correctly(fake_step):
    """The prompt (embeddings copied in), resolution, batch, step count, guidance (none at 1.0: a
    batch of one), guidance_rescale, DDIM's eta (noise from the generator), and a scheduler swapped
    in between calls."""
    eager, graphed, _ = _pair("tiny", "DDIMScheduler")
    with torch.no_grad():
        for kwargs in CHANGES:
            assert torch.equal(_run(graphed, **dict(kwargs)), _run(eager, **dict(kwargs))), kwargs
        for pipe in (eager, graphed):
            pipe.scheduler = diffusers.EulerAncestralDiscreteScheduler.from_config(pipe.scheduler.config)
        assert torch.equal(_run(graphed), _run(eager))
    assert "set_timesteps" in vars(graphed.scheduler)  # the swapped-in scheduler got host timesteps
    assert len(graphed.unet.forward.graphs) == 0


class _Callback:
    """Replaces the latents and scales the prompt embeddings in place at step 1, turns guidance off
    from step 2 (diffusers' dynamic CFG recipe)."""

    def __call__(self, pipe, i, t, kwargs):
        if i == 1:
            kwargs["latents"] = kwargs["latents"] * 0.5
            kwargs["prompt_embeds"].mul_(0.5)
        if i == 2:
            pipe._guidance_scale = 0.0
            kwargs["prompt_embeds"] = kwargs["prompt_embeds"].chunk(2)[-1]
        return kwargs


@pytest.mark.parametrize("grad_off", [torch.no_grad, torch.inference_mode])
def test_callbacks_that_change_tensors_and_guidance(fake_step, grad_off):
    """Under torch.inference_mode the tensors keep no version counter: the slab copies them in on every
    step (an in-place change by a callback cannot be seen otherwise)."""
    eager, graphed, _ = _pair("tiny", "DPMSolverMultistepScheduler")
    inputs = ["latents", "prompt_embeds"]
    with grad_off():
        for _ in range(2):
            want = _run(eager, 5, callback_on_step_end=_Callback(), callback_on_step_end_tensor_inputs=inputs)
            got = _run(graphed, 5, callback_on_step_end=_Callback(), callback_on_step_end_tensor_inputs=inputs)
            assert torch.equal(got, want)
    assert len(graphed.unet.forward.graphs) == 0 and _steps(graphed).steps == 10


def test_an_unchecked_scheduler_replays_the_unet_alone_logged_once(fake_step, caplog):
    eager, graphed, _ = _pair("tiny", "DDPMScheduler")
    with torch.no_grad(), caplog.at_level(logging.WARNING, "sd_kernels"):
        for _ in range(2):
            assert torch.equal(_run(graphed), _run(eager))
    notes = [r.getMessage() for r in caplog.records if "DDPMScheduler was not checked" in r.getMessage()]
    assert len(notes) == 1 and "replay the UNet alone" in notes[0]
    assert len(graphed.unet.forward.graphs) == 1 and not _steps(graphed).graphs


def test_a_failed_capture_runs_that_step_eagerly_logged_once(fake_step, monkeypatch, caplog):
    eager, graphed, _ = _pair("tiny", "EulerDiscreteScheduler")

    def refuse(*args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(whole_step, "capture", refuse)
    with torch.no_grad(), caplog.at_level(logging.WARNING, "sd_kernels"):
        for _ in range(2):
            assert torch.equal(_run(graphed), _run(eager))
    notes = [r.getMessage() for r in caplog.records if "capture failed" in r.getMessage()]
    assert len(notes) == 1 and "not permitted" in notes[0]
    assert not _steps(graphed).graphs and _steps(graphed).failed


def test_moved_pipeline_drops_its_step_graphs(fake_step):
    eager, graphed, _ = _pair("tiny", "EulerDiscreteScheduler")
    with torch.no_grad():
        _run(graphed)
        assert _steps(graphed).graphs
        for pipe in (eager, graphed):
            pipe.to(torch.float64)
        for _ in range(2):  # the first call after the move runs eagerly, the next captures
            assert torch.equal(_run(graphed), _run(eager))
    assert all(k[0][1][2] == torch.float64 for k in _steps(graphed).graphs)


def test_unpatch_is_exact(fake_step):
    eager, graphed, _ = _pair("tiny", "UniPCMultistepScheduler")
    cls = type(eager)
    with torch.no_grad():
        _run(graphed)
    sd_kernels.unpatch(graphed)
    assert type(graphed).__mro__[1:] == cls.__mro__[1:] and type(graphed).__name__ == cls.__name__
    assert not getattr(type(graphed), "_sd_kernels_whole_step", False)
    assert whole_step._ATTR not in vars(graphed)
    assert not {"step", "scale_model_input", "set_timesteps"} & set(vars(graphed.scheduler))


def test_a_pipeline_whose_loop_is_not_checked_runs_the_pipeline_mode(fake_step, monkeypatch):
    monkeypatch.setitem(verified.VERIFIED, "StableDiffusionPipeline.__call__", "0" * 16)
    whole_step.is_verified.cache_clear()
    try:
        pipe = models.build_pipeline("tiny")
        record = sd_kernels.patch(pipe, cuda_graph="step")
    finally:
        whole_step.is_verified.cache_clear()
    assert record.cuda_graph == "step" and "whole_step" not in record.counts
    assert any("not the diffusers" in s.reason for s in record.skipped)
    assert whole_step._ATTR not in vars(pipe)


def test_scheduler_state_snapshots_copy_containers_not_tensors():
    sched = diffusers.DPMSolverMultistepScheduler()
    sched.set_timesteps(4)
    x = torch.ones(2, device="meta")
    sched.model_outputs = [None, x]
    snap = whole_step.snapshot(sched)
    sched.model_outputs[0] = x
    sched.lower_order_nums = 7
    sched.extra = 1
    whole_step.restore(sched, snap)
    assert sched.model_outputs == [None, x] and sched.model_outputs[1] is x
    assert sched.lower_order_nums == 0 and not hasattr(sched, "extra")
    meta = torch.device("meta")
    key, tensors = whole_step.scheduler_key(sched, meta)
    assert len(tensors) == 1 and tensors[0] is x  # device tensors: by shape and dtype, listed
    sched.model_outputs = [None, torch.zeros(2, device="meta")]
    assert whole_step.scheduler_key(sched, meta)[0] == key  # another tensor of the same kind: the same key
    sched.sigmas = sched.sigmas * 2  # a host table with other values: another key
    assert whole_step.scheduler_key(sched, meta)[0] != key


def test_rebind_copies_through_clones_where_sources_overlap_targets():
    a, b, c = torch.tensor([1.0]), torch.tensor([2.0]), torch.tensor([3.0])
    whole_step.rebind([b, c], [a, b])  # the graph reads (b, c); the state holds (a, b): a shifted history
    assert (b.item(), c.item()) == (1.0, 2.0)


# ---------------------------------------------------------------------------------------------
# GPU: real graphs.


def _gpu_pair(scheduler=None, mode="step"):
    return _pair("tiny", scheduler, "cuda", torch.float16, mode)[:2]


def _close(got, want):
    diff = (got.float() - want.float()).abs().max().item()
    assert diff <= 2 / 255, diff  # the pipeline mode's own tolerance (test_cuda_graph._matches)
    return diff


@pytest.mark.gpu
@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_gpu_whole_steps_match_the_pipeline_mode_and_never_wait(scheduler):
    """Against the same patch's pipeline mode (UNet-only graphs, same kernels): the measured max
    difference of the images, printed; the generator ends where the eager loop leaves it; no host
    sync between the first step's end and the last's (CUDA generator: its draws stay on the GPU)."""
    import warnings

    from test_cuda_graph import _SyncsPerStep

    pipeline, graphed = _gpu_pair(scheduler, "step")
    sd_kernels.patch(pipeline, cuda_graph="pipeline")
    with torch.no_grad():
        diffs = []
        for _ in range(2):  # capture, then replay
            g1, g2 = torch.Generator("cuda").manual_seed(3), torch.Generator("cuda").manual_seed(3)
            want = _run(pipeline, 6, device="cuda", generator=g1)
            diffs.append(_close(_run(graphed, 6, device="cuda", generator=g2), want))
            assert torch.equal(g1.get_state(), g2.get_state())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            steps = _SyncsPerStep(caught)
            torch.cuda.set_sync_debug_mode("warn")
            try:
                got = _run(graphed, 6, device="cuda", callback_on_step_end=steps)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        diffs.append(_close(got, _run(pipeline, 6, device="cuda")))
    print(f"whole-step vs pipeline mode, {scheduler}: max |diff| {max(diffs):.3g} (images in [0, 1], fp16)")
    assert steps.counts[-1] == steps.counts[0], steps.counts
    assert len(graphed.unet.forward.graphs) == 0 and _steps(graphed).graphs


@pytest.mark.gpu
def test_gpu_changes_between_calls_recapture_or_replay_correctly():
    eager, graphed = _gpu_pair("DDIMScheduler")
    with torch.no_grad():
        for kwargs in CHANGES:
            _close(_run(graphed, device="cuda", **dict(kwargs)), _run(eager, device="cuda", **dict(kwargs)))
        for pipe in (eager, graphed):
            pipe.scheduler = diffusers.EulerAncestralDiscreteScheduler.from_config(pipe.scheduler.config)
        for _ in range(2):
            _close(_run(graphed, device="cuda"), _run(eager, device="cuda"))
        for pipe in (eager, graphed):
            pipe.to(torch.float32)
        for _ in range(2):
            _close(_run(graphed, device="cuda"), _run(eager, device="cuda"))
    assert len(graphed.unet.forward.graphs) == 0


@pytest.mark.gpu
def test_gpu_callbacks_that_change_tensors_and_guidance():
    eager, graphed = _gpu_pair("DPMSolverMultistepScheduler")
    inputs = ["latents", "prompt_embeds"]
    with torch.no_grad():
        for _ in range(2):
            want = _run(eager, 5, device="cuda", callback_on_step_end=_Callback(),
                        callback_on_step_end_tensor_inputs=inputs)
            _close(_run(graphed, 5, device="cuda", callback_on_step_end=_Callback(),
                        callback_on_step_end_tensor_inputs=inputs), want)
