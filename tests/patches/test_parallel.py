"""One image on several processes: ``patch(pipe, parallel="cfg")`` (patches/cfg_parallel.py) and sd_kernels'
attention inside diffusers' Ulysses context parallelism (patches/context_parallel.py).

Two processes for real: one ``torchrun --nproc_per_node 2`` launch (gloo, CPU) runs every case of
parallel_worker.py (then test_cp_plans.py's, cp_plans_worker.py), and the tests here read what each process
saw: the CFG split of the SD1.5- and SDXL-shaped tiny pipelines equal to one process within fp32 rounding,
every process ending with the same latents; FLUX's Ulysses attention through sd_kernels' kernels, patched
after or before ``enable_parallelism``; exact unpatching; the clear errors. In this process, on a one-process
group and the stand-in for CUDA graphs: the split wraps the graphed UNet (its all-gather outside the graphs),
``cuda_graph="step"`` is refused with it; a model under context parallelism is not captured, and
unpatch hands diffusers' hooks the original forward back.
"""

import json
import os
import pathlib
import subprocess
import sys
import types

import pytest
import torch
import torch.distributed as dist
from diffusers.hooks import HookRegistry, ModelHook
from filelock import FileLock
from sd_kernels.patches import cfg_parallel, context_parallel, cuda_graph, patch_record
from test_cuda_graph import _args, fake_cuda  # noqa: F401  (fake_cuda: a fixture, the stand-in for CUDA graphs)

import sd_kernels
from sd_kernels import models

WORKER = pathlib.Path(__file__).with_name("parallel_worker.py")
# fp32 on the CPU: half the batch a process changes only the GEMMs' blocking (measured ~1.4e-6)
RTOL = 1e-5

needs_gloo = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="needs torch.distributed with the gloo backend")
# the tests that read the torchrun launch of parallel_worker.py (its two processes' imports and pipelines)
launched = pytest.mark.integration


def launch(worker: pathlib.Path, out: pathlib.Path) -> list[dict]:
    """What each of the two processes of one torchrun launch of ``worker`` saw (its ``out/rank<r>.json``)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "SD_KERNELS_AUTOTUNE_CACHE": "off", "CUDA_VISIBLE_DEVICES": "",
           "OMP_NUM_THREADS": "1"}
    env.pop("SD_KERNELS_BACKEND", None)
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          str(worker), str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for report in reports:
        crashed = {k: v["crashed"] for k, v in report.items() if isinstance(v, dict) and "crashed" in v}
        assert not crashed, crashed
    return reports


def launch_once(worker: pathlib.Path, tmp_path_factory, config) -> list[dict]:
    """``launch``, once per test session: under pytest-xdist every worker that runs a test of the module builds
    its module fixture; the first launches (the others wait, their core free for the launch's two processes) and
    leaves its outcome in the session's shared temporary folder: the reports ``launch`` checked, or its failure,
    which each later worker raises again."""
    worker_id = getattr(config, "workerinput", {}).get("workerid")
    if worker_id is None:  # not under xdist
        return launch(worker, tmp_path_factory.mktemp(worker.stem))
    shared = tmp_path_factory.getbasetemp().parent  # this session's, all workers'
    outcome = shared / f"{worker.stem}.json"
    with FileLock(str(outcome) + ".lock"):
        if not outcome.exists():
            try:
                reports = launch(worker, tmp_path_factory.mktemp(worker.stem))
            except BaseException as exc:
                outcome.write_text(json.dumps({"failed": f"{type(exc).__name__}: {str(exc)[-4000:]}"}))
                raise
            outcome.write_text(json.dumps({"reports": reports}))
    done = json.loads(outcome.read_text())
    if "failed" in done:
        pytest.fail(f"the launch of {worker.name} (by another xdist worker) failed: {done['failed']}")
    return done["reports"]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, pytestconfig):
    """What each of the two processes of one torchrun launch of parallel_worker.py saw."""
    return launch_once(WORKER, tmp_path_factory, pytestconfig)


@needs_gloo
@launched
@pytest.mark.parametrize("case", ["sd15", "sdxl"])
def test_cfg_split_over_two_processes_is_one_process_image(ranks, case):
    """Each process runs half the guidance batch (batch 1 of 2 on every UNet call) and ends with the
    one-process latents within fp32 rounding, the same on both; a second image is the first; unpatched,
    the pipeline is stock's to the bit and its UNet and scheduler hold no instance attributes of ours."""
    for r in ranks:
        got = r[case]
        assert got["rel"] < RTOL
        assert got["again_equal"] and got["unpatched_equal"] and got["forward_restored"]
        assert got["batches"] and set(got["batches"]) == {1}
        assert "cfg_parallel: 1" in got["summary"] and "parallel=cfg" in got["summary"]
    assert ranks[0][case]["sum"] == ranks[1][case]["sum"]


@needs_gloo
@launched
def test_ulysses_local_attention_is_ours_patched_after_or_before_enable_parallelism(ranks):
    """FLUX under diffusers' Ulysses (degree 2): every attention call's local attention (2 steps × 4 blocks)
    is sd_kernels' on the whole sequence (64 image + 16 text tokens) and one of the two heads, whichever
    came first, patch or enable_parallelism; the latents are one process's within fp32 rounding, the
    same on both processes; unpatched, the stock processors (with the parallel config) run diffusers'
    own context parallelism to the bit."""
    for r in ranks:
        got = r["ulysses"]
        assert got["after_calls"] == got["before_calls"] == 8
        assert got["local_shape"] == [1, 80, 1, 24]
        assert got["after_rel"] < RTOL and got["before_rel"] < RTOL and got["stock_cp_rel"] < RTOL
        assert got["after_unpatched_equal"] and got["before_unpatched_equal"]
        assert got["after_stock_processors"] and got["before_stock_processors"]
    assert ranks[0]["ulysses"]["sum"] == ranks[1]["ulysses"]["sum"]


@needs_gloo
@launched
def test_ring_gathers_keys_and_values_for_one_attention_call(ranks):
    """FLUX under a ring config of degree 2: each of the 8 attention calls (2 steps × 4 blocks) takes this
    process's 40 of the 80 tokens as queries against both processes' keys and values (one gathered
    [2·1, 40, 2, 2, 24] buffer) and answers for its queries; the single-stream blocks' calls are begun
    before their MLP, the double-stream blocks' calls ask for the keys in parts (taken where the exchange
    runs on the copy engines: on GPUs); the latents are one process's within fp32 rounding, the same on
    both processes; a seed per process is a clear error; unpatched, the stock processors are back."""
    for r in ranks:
        got = r["ring"]
        assert "crashed" not in got, got.get("crashed")
        assert got["config"] == 2 and got["calls"] == 8
        assert got["shapes"] == [[1, 40, 2, 24], [2, 40, 2, 2, 24], [1, 40, 2, 24]]
        assert got["single_blocks"] >= 1 and got["begun"] == 2 * got["single_blocks"]
        # the double-stream blocks (called whole, nothing beside their exchange) ask for the keys in parts
        assert got["in_parts"] == got["calls"] - got["begun"]
        # a seed per process: different noise side by side, refused before the first step on every process
        assert "under context parallelism: the processes call it with different hidden_states" in (
            got["seed_per_process"] or "")
        assert got["rel"] < RTOL
        assert got["stock_processors"]
    assert ranks[0]["ring"]["sum"] == ranks[1]["ring"]["sum"]


@needs_gloo
@launched
def test_split_modulation_is_one_process_image_with_one_product_a_call(ranks):
    """split_modulation under ring and Ulysses (2 processes, each computing half of every block norm's
    modulation columns; on the reference ops): the latents one process's within fp32 rounding, also for a batch
    of two; the shares computed once per transformer call (2 steps: 2) and every patched block norm's product
    taken from them."""
    for r in ranks:
        got = r["split_modulation"]
        assert "crashed" not in got, got.get("crashed")
        for exchange in ("ring", "ulysses"):
            seen = got[exchange]
            assert seen["rel"] < RTOL, (exchange, seen)
            assert seen["computed"] == 2 and seen["asked"] == seen["taken"] == 2 * seen["norms"], (exchange, seen)
        assert got["ring_batch2"] < RTOL


@needs_gloo
@launched
def test_split_decode_is_one_process_decode_and_image(ranks):
    """The VAE decode split by rows over two processes (each decoding 8 of the 16 latent rows; on the reference
    ops: the split is under test, the band kernels have their own tests): one process's decode within fp32
    rounding, the same on both; one image end to end under parallel="cfg" equal to one process's; processes
    decoding different latents both raise; unpatched, the decoder's own forward is back."""
    for r in ranks:
        got = r["split_decode"]
        assert "crashed" not in got, got.get("crashed")
        assert got["rel"] < RTOL and got["image_rel"] < RTOL
        # the decode, the image's, and the refused call's: different sums are compared once its decode is
        # queued (the host then waits for it), raising instead of returning the image
        assert got["bands"] == 3
        assert "split_decode: 1" in got["summary"]
        assert "decode different latents" in (got["differ"] or "")
        assert got["restored"]
    assert ranks[0]["split_decode"]["sum"] == ranks[1]["split_decode"]["sum"]


@needs_gloo
@launched
def test_ring_anything_with_uneven_shards_is_one_process_image_or_a_clear_error(ranks):
    """ring_anything (40 and 39 tokens a process) is diffusers' to run: the gathered attention takes shards of one
    length (an uneven gather aborts the process under gloo)."""
    for r in ranks:
        got = r["ring_anything"]
        assert got.get("rel", 1.0) < RTOL or "return_lse" in got.get("error", ""), got


@needs_gloo
@launched
def test_ring_on_processes_with_different_processors_is_refused(ranks):
    for r in ranks:
        got = r["ring_mixed_processors"]
        assert "hold different attention processors" in (got["error"] or ""), got
        assert not got["split"]


@needs_gloo
@launched
def test_bad_setups_are_clear_errors_on_every_process(ranks):
    errors = [r["errors"] for r in ranks]
    for e in errors:
        assert "batch is 1, which 2 processes do not divide" in e["no_guidance"]
        assert "different sample" in e["seed_per_process"]
        assert "patch differently (in profile)" in e["mixed_profiles"] and "'cpu', 'cpu-other'" in e["mixed_profiles"]
        assert e["mixed_left_unpatched"]
    for r in ranks:
        mixed = r["ulysses_mixed_profiles"]
        assert mixed["error"].startswith("ValueError: context parallelism: the processes patch differently (in "
                                         "profile)") and mixed["left_unpatched"]
        assert mixed["switch_error"].startswith("ValueError: context parallelism: the processes patch differently "
                                                "(in SD_KERNELS_GRAPH_COLLECTIVES)")
        heads = r["heads"]
        for when in ("patch_after", "patch_before"):
            assert heads[when].startswith("ValueError") and "2 does not divide 3 heads" in heads[when]
        assert heads["patch_after_left_unpatched"]
        assert "init_process_group" in r["no_group_after_destroy"]


def test_parallel_argument_and_missing_process_group_are_clear_errors():
    unet = models.build_model("tiny", "unet")
    with pytest.raises(ValueError, match="enable_parallelism"):
        sd_kernels.patch(unet, parallel="ulysses")
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="init_process_group"):
        sd_kernels.patch(unet, parallel="cfg")
    assert patch_record(unet) is None and "forward" not in vars(unet)


@pytest.fixture
def one_process_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@needs_gloo
def test_split_wraps_the_graphed_unet_and_unpatches_exactly(fake_cuda, one_process_group):  # noqa: F811
    """The split wraps the UNet's GraphedCall (the all-gather follows the replay, outside the graphs), gives
    what the graphed UNet gives, and unpatch leaves the UNet without instance attributes of ours;
    cuda_graph="step" (the UNet's call inside a step's graph) is refused before any change."""
    unet = models.build_model("tiny-xl", "unet")
    x, kw = _args(unet, 2, 8, device="cpu", dtype=torch.float32)
    with sd_kernels.patched(unet, cuda_graph=True), torch.no_grad():
        want = unet(x, 10, **kw).sample
    with pytest.raises(ValueError, match="cuda_graph='step'"):
        sd_kernels.patch(unet, cuda_graph="step", parallel="cfg")
    assert patch_record(unet) is None
    record = sd_kernels.patch(unet, cuda_graph=True, parallel="cfg")
    assert record.arguments["parallel"] == "cfg"
    call = vars(unet)["forward"]
    assert isinstance(call, cfg_parallel.CfgParallelCall) and isinstance(call.inner, cuda_graph.GraphedCall)
    with torch.no_grad():
        assert torch.equal(unet(x, 10, **kw).sample, want)
    assert len(call.inner.graphs) == 1  # the process's part of the batch, replayed
    sd_kernels.unpatch(unet)
    assert "forward" not in vars(unet)


def _flux_inputs(model) -> tuple[torch.Tensor, dict]:
    """One call's inputs for the tiny FLUX transformer: 16 image and 4 text tokens."""
    kw = dict(encoder_hidden_states=torch.randn(1, 4, model.config.joint_attention_dim),
              pooled_projections=torch.randn(1, model.config.pooled_projection_dim), timestep=torch.ones(1) / 2,
              img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(4, 3), guidance=torch.full([1], 3.5), return_dict=False)
    return torch.randn(1, 16, model.config.in_channels), kw


def test_context_parallel_models_are_not_captured_and_hooks_get_the_original_back(fake_cuda):  # noqa: F811
    """A model under context parallelism: ``graphable_reason`` says why (cuda_graph="auto" captures nothing,
    True is refused); one graphed before ``enable_parallelism`` runs eagerly; unpatch gives diffusers' hook
    chain the original forward, as if the model had never been patched."""
    model = models.build_model("tiny-flux", "transformer")
    twin = models.build_model("tiny-flux", "transformer")
    cp = types.SimpleNamespace(context_parallel_config=object())
    sd_kernels.patch(model, cuda_graph=True)
    graphed = vars(model)["forward"]
    for m in (model, twin):  # what enable_parallelism does to the model object: a config, hooks on its forward
        m._parallel_config = cp
        HookRegistry.check_if_exists_or_initialize(m).register_hook(ModelHook(), "probe")
    x, kw = _flux_inputs(model)
    with torch.no_grad():
        model(x, **kw)
    assert not graphed.graphs and not fake_cuda
    sd_kernels.unpatch(model)
    ref = model._diffusers_hook._fn_refs[0]
    assert ref.forward == model.__class__.forward.__get__(model) and not isinstance(ref.forward, cuda_graph.GraphedCall)
    outer, stock = vars(model)["forward"], vars(twin)["forward"]
    assert sorted(vars(outer)) == sorted(vars(stock)) and outer.__wrapped__ == model.__class__.forward.__get__(model)


def test_graphable_reason_names_context_parallelism(monkeypatch):
    """Refused by default, with the switch that lifts it named; allowed under it (experimental)."""
    model = models.build_model("tiny-flux", "transformer")
    model._parallel_config = types.SimpleNamespace(context_parallel_config=object())
    reason = cuda_graph.graphable_reason(model)
    assert "context parallelism" in reason and cuda_graph.COLLECTIVES_ENV in reason
    monkeypatch.setenv(cuda_graph.COLLECTIVES_ENV, "1")
    assert "context parallelism" not in cuda_graph.graphable_reason(model)  # what is left: not on CUDA here


def _cp(ring=1, ulysses=2, anything=False):
    return types.SimpleNamespace(context_parallel_config=types.SimpleNamespace(
        ring_degree=ring, ulysses_degree=ulysses, ulysses_anything=anything))


def test_our_local_attention_serves_ulysses_only_on_the_verified_templates(monkeypatch):
    """Ring is ours (one gathered attention); Ulysses × ring goes to diffusers' dispatch, and so do templates
    other than the checked source; a head count the degree does not divide is named (not under
    ulysses_anything, which pads heads)."""
    verified = context_parallel.is_verified
    assert context_parallel.serves(_cp()) and context_parallel.serves(_cp(ulysses=4, anything=True))
    assert context_parallel.serves(_cp(ring=2, ulysses=1)) and context_parallel.ring_degree(_cp(ring=4, ulysses=1)) == 4
    uneven = _cp(ring=2, ulysses=1)
    uneven.context_parallel_config.ring_anything = True
    assert context_parallel.ring_degree(uneven) is None and not context_parallel.serves(uneven)
    assert not context_parallel.serves(_cp(ring=2)) and context_parallel.ring_degree(_cp(ring=2)) is None
    assert not context_parallel.serves(None) and not context_parallel.serves(types.SimpleNamespace(
        context_parallel_config=None))
    monkeypatch.setitem(verified.__wrapped__.__globals__["VERIFIED"], "TemplatedUlyssesAttention.forward", "0" * 16)
    monkeypatch.setattr(context_parallel, "_VERIFIED", None)
    verified.cache_clear()
    try:
        assert not context_parallel.serves(_cp())
    finally:
        verified.cache_clear()
    with pytest.raises(ValueError, match="4 does not divide 6 heads.*ulysses_anything"):
        context_parallel.check_heads(6, _cp(ulysses=4), "FluxAttention")
    context_parallel.check_heads(6, _cp(ulysses=4, anything=True), "FluxAttention")
    context_parallel.check_heads(6, _cp(ring=4, ulysses=1), "FluxAttention")


def test_under_the_switch_calls_under_context_parallelism_are_captured_anew(fake_cuda, monkeypatch):  # noqa: F811
    """``SD_KERNELS_GRAPH_COLLECTIVES=1``: a call under context parallelism is captured (its collectives
    inside), and a graph captured before parallelism was on is dropped, never replayed without them."""
    monkeypatch.setenv(cuda_graph.COLLECTIVES_ENV, "1")
    model = models.build_model("tiny-flux", "transformer")
    sd_kernels.patch(model, cuda_graph=True)
    x, kw = _flux_inputs(model)
    with torch.no_grad():
        model(x, **kw)
        assert len(fake_cuda) == 1
        model._parallel_config = types.SimpleNamespace(context_parallel_config=object())
        model(x, **kw)
        assert len(fake_cuda) == 2  # the same signature, captured again now that parallelism is on
        model(x, **kw)
    assert len(fake_cuda) == 2  # then replayed
