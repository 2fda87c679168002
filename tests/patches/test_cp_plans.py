"""One image's tokens over several processes for SD3 and PixArt-Σ: ``enable_context_parallel`` with sd_kernels'
context-parallel plans and its Ulysses exchange (patches/context_parallel_plans.py).

Two processes for real: test_parallel.py's ``torchrun --nproc_per_node 2`` launch (gloo, CPU) also runs every
case of cp_plans_worker.py on the tiny configs, and the tests here read what each process saw: the latents
equal one process's, patched after or before ``enable_context_parallel``; diffusers' own processors
under the plan refused, never patched or after unpatch; the clear errors. In this process: no process
group, one process.
"""

import types

import pytest
import torch
import torch.distributed as dist
from sd_kernels.patches import context_parallel_plans, patch_record
from test_parallel import RTOL, WORKER, launch_once, launched, needs_gloo, one_process_group  # noqa: F401

import sd_kernels
from sd_kernels import models

# The tiny pipelines at 64²: 8×8 = 64 image tokens, 32 a process; SD3's text: 77 CLIP + 16 T5 tokens, whole
# on each process. Two steps of two blocks, a guidance batch of 2, 2 heads of 24.
FIRST_CALL = {"sd3": [[2, 2, 32 + 93, 24], 32], "pixart": [[2, 2, 32, 24], 32]}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, pytestconfig):
    """What each process of parallel_worker.py's launch saw in cp_plans_worker.py's cases."""
    reports = [r["cp_plans"] for r in launch_once(WORKER, tmp_path_factory, pytestconfig)]
    for report in reports:
        crashed = {k: v["crashed"] for k, v in report.items() if isinstance(v, dict) and "crashed" in v}
        assert not crashed, crashed
    return reports


@needs_gloo
@launched
@pytest.mark.parametrize("case", ["sd3", "pixart"])
def test_tokens_over_two_processes_give_one_process_latents(ranks, case):
    """Every joint (SD3) or self (PixArt) attention call exchanges: this process's 32 image tokens (SD3: and
    the whole text) in, all 64 attended; the latents (through the kernels) equal one process's within fp32
    rounding, the same on both processes; whichever came first, the patch or enable_context_parallel, and
    unpatched and patched again, the same latents (on the reference ops)."""
    for r in ranks:
        got = r[case]
        assert got["after_rel"] < RTOL
        assert got["calls"] == 4 and got["first_call"] == FIRST_CALL[case]
        assert got["before_equal_after"] and got["repatched_equal"]
    assert ranks[0][case]["sum"] == ranks[1][case]["sum"]


@needs_gloo
@launched
@pytest.mark.parametrize("case", ["sd3", "pixart"])
def test_diffusers_processors_under_the_plan_are_refused_and_unpatch_is_exact(ranks, case):
    """diffusers' SD3 and PixArt processors would attend over a process's tokens only: never patched, or after
    unpatch (which gives back the very processor objects, with nothing of ours on them), the transformer
    refuses to run, naming the module and the way out."""
    stock = {"sd3": "transformer_blocks.0.attn has JointAttnProcessor2_0",
             "pixart": "transformer_blocks.0.attn1 has AttnProcessor2_0"}[case]
    for r in ranks:
        got = r[case]
        for when in ("never_patched_error", "unpatched_error", "before_unpatched_error"):
            assert got[when].startswith("ValueError") and stock in got[when] and "sd_kernels.patch" in got[when]
        assert got["unpatched_same_processors"]


@needs_gloo
@launched
def test_bad_setups_are_clear_errors_on_every_process(ranks):
    for r in ranks:
        for case in ("sd3", "pixart"):
            assert "5×5 = 25 tokens" in r[case]["tokens_error"] and "2 processes" in r[case]["tokens_error"]
        errors = r["errors"]
        for model in ("sd3", "pixart"):
            assert errors[f"{model}_heads"].startswith("ValueError") and "2 does not divide" in errors[f"{model}_heads"]
            assert errors[f"{model}_heads_untouched"]
        assert "StableDiffusionPipeline has no transformer" in errors["no_plan"]
        # patched on one process only: that one's exchange would wait for the other's forever
        assert "patch every process alike" in errors["patched_on_one"] and errors["patched_on_one_untouched"]
        assert "different hidden_states" in errors["seed_per_process"]
        assert "patch differently (in attention processors)" in errors["own_processor"]
        assert "no context-parallel plan for UNet2DConditionModel" in errors["no_plan_model"]


@needs_gloo
@launched
def test_flux_goes_to_diffusers_plan(ranks):
    for r in ranks:
        assert r["flux"]["rel"] < RTOL


def test_no_process_group_is_a_clear_error():
    transformer = models.build_model("tiny-sd3", "transformer")
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="init_process_group"):
        sd_kernels.enable_context_parallel(transformer)
    assert transformer._parallel_config is None


@needs_gloo
def test_one_process_is_a_clear_error(one_process_group):  # noqa: F811
    transformer = models.build_model("tiny-pixart", "transformer")
    with pytest.raises(ValueError, match="at least 2"):
        sd_kernels.enable_context_parallel(transformer)
    assert transformer._parallel_config is None
    assert not any(context_parallel_plans.MARK in vars(m) for m in transformer.modules())


@needs_gloo
def test_exchange_is_named_and_ring_is_refused_under_our_plans(one_process_group, monkeypatch):  # noqa: F811
    """``exchange``: "ulysses" or "ring"; sd_kernels' SD3 / PixArt-Σ plans exchange by Ulysses only (ring runs
    under diffusers' own plans: FLUX). Refused before any change."""
    transformer = models.build_model("tiny-sd3", "transformer")
    with pytest.raises(ValueError, match="exchange must be one of"):
        sd_kernels.enable_context_parallel(transformer, exchange="tree")
    monkeypatch.setattr(context_parallel_plans.dist, "get_world_size", lambda: 2)
    with pytest.raises(ValueError, match="exchange='ring'.*exchanges by Ulysses"):
        sd_kernels.enable_context_parallel(transformer, exchange="ring")
    assert transformer._parallel_config is None


@needs_gloo
def test_guidance_split_and_token_split_together_are_refused(one_process_group):  # noqa: F811
    """parallel='cfg' gives each process a different half of the guidance batch, and the token split
    assumes every process holds the same images: together, an exchange of tokens of different images (a
    wrong image without an error). Refused in either order, before any change."""
    model = models.build_model("tiny-sd3", "transformer")
    sd_kernels.patch(model, parallel="cfg")
    with pytest.raises(ValueError, match="parallel='cfg'.*context parallelism"):
        sd_kernels.enable_context_parallel(model)
    assert model._parallel_config is None
    sd_kernels.unpatch(model)
    model._parallel_config = types.SimpleNamespace(context_parallel_config=object())  # what enable_parallelism sets
    with pytest.raises(ValueError, match="parallel='cfg'.*context parallelism"):
        sd_kernels.patch(model, parallel="cfg")
    assert patch_record(model) is None and "forward" not in vars(model)


@needs_gloo
def test_controlnet_residuals_under_the_split_are_a_clear_error(one_process_group):  # noqa: F811
    """SD3's ControlNet residuals are whole-sequence tensors that the plan does not split: added to a
    process's share of the tokens they would fail in a broadcast deep in the first block; named first."""
    model = models.build_model("tiny-sd3", "transformer")
    check = context_parallel_plans._Check([], 2)
    latent = torch.randn(1, model.config.in_channels, 8, 8)
    check.pre_forward(model, hidden_states=latent, block_controlnet_hidden_states=None)
    with pytest.raises(ValueError, match="ControlNet"):
        check.pre_forward(model, hidden_states=latent, block_controlnet_hidden_states=[torch.randn(1, 16, 48)])


@needs_gloo
def test_sd3_split_by_diffusers_alone_is_refused_at_patch(one_process_group):  # noqa: F811
    """diffusers' ``enable_parallelism(cp_plan=plan_for(model))`` without ``enable_context_parallel`` splits the
    tokens and marks nothing: sd_kernels' processors would attend over a process's share only (a wrong image).
    The patch refuses, naming the way."""
    model = models.build_model("tiny-sd3", "transformer")
    mesh = types.SimpleNamespace(get_group=lambda: dist.group.WORLD)
    model._parallel_config = types.SimpleNamespace(context_parallel_config=types.SimpleNamespace(_flattened_mesh=mesh))
    with pytest.raises(ValueError, match="enable_context_parallel"):
        sd_kernels.patch(model)
    assert patch_record(model) is None


@pytest.mark.parametrize("name", ["tiny-sd3", "tiny-pixart"])
def test_patched_then_split_by_diffusers_alone_is_refused_at_the_call(name):
    """Patched first, then diffusers' ``enable_parallelism(cp_plan=plan_for(model))`` without
    ``enable_context_parallel``: diffusers sets its config on each processor that has the attribute (as here),
    and nothing marks the attentions for the exchange; sd_kernels' processors refuse to attend over a
    process's share of the tokens."""
    pipe = models.build_pipeline(name)
    sd_kernels.patch(pipe, ops=["attention"])
    split = types.SimpleNamespace(context_parallel_config=object())
    for m in pipe.transformer.modules():  # what enable_parallelism does to the processors
        if hasattr(getattr(m, "processor", None), "_parallel_config"):
            m.processor._parallel_config = split
    with pytest.raises(ValueError, match="enable_context_parallel"), torch.no_grad():
        pipe("a cat", num_inference_steps=1, height=64, width=64, output_type="latent", max_sequence_length=16,
             **({"use_resolution_binning": False} if "pixart" in name else {}))
