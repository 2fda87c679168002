"""`sd-kernels generate --prompt ... --parallel cfg|ulysses`: one image made by every process of a torchrun
launch (two gloo processes on the CPU, the ops' PyTorch reference: the split is under test, the ops
and the patch's split have their own tests), equal to the one-process image within rounding and
written once, by the first process, with records that name the split; and every launch or option the
split cannot take is an error before any work (no pipeline built, no process group started)."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch.distributed as dist
from PIL import Image

from sd_kernels import models
from sd_kernels.apps import cli
from sd_kernels.apps import parallel as parallel_app

TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


@pytest.fixture(autouse=True)
def reference_ops(monkeypatch):
    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def no_build(monkeypatch):
    monkeypatch.setattr(models, "load_pipeline", lambda *a, **k: pytest.fail("a pipeline was built"))


def _read(path):
    with Image.open(path) as im:
        return np.asarray(im.convert("RGB")).astype(int), json.loads(im.text["sd-kernels"])


@pytest.mark.parametrize("argv,world,message", [
    (["--parallel", "cfg"], None, "--parallel cfg makes one image on several processes, and this process was not "
     "started as one of them (no RANK and WORLD_SIZE in its environment): torchrun --nproc_per_node 2 -m sd_kernels "
     "generate --prompt ... --parallel cfg"),
    (["--parallel", "cfg"], 3, "--parallel cfg splits one image's guidance batch [unconditional; conditional] over 2 "
     "processes, and this launch has 3"),
    (["--parallel", "cfg", "--model", "tiny-flux"], 2, "--parallel cfg splits the classifier-free-guidance batch, and "
     "a FluxPipeline has none"),
    (["--parallel", "cfg", "--guidance-scale", "1"], 2, "--parallel cfg: a guidance scale of 1 runs no "
     "classifier-free guidance"),
    (["--parallel", "cfg", "--cuda-graph", "step"], 2, "--cuda-graph step with --parallel cfg"),
    (["--parallel", "ulysses"], 2, "--parallel ulysses runs diffusers' context parallelism, which has no plan for the "
     "denoiser of a StableDiffusionPipeline"),
    (["--parallel", "ulysses", "--model", "tiny-flux"], 1, "--parallel ulysses splits the transformer's tokens over "
     "the processes, and this launch has 1"),
    (["--parallel", "ulysses", "--model", "tiny-flux", "--compile"], 2, "--compile with --parallel ulysses"),
    (["--parallel", "ring"], 2, "--parallel ring runs diffusers' context parallelism, which has no plan for the "
     "denoiser of a StableDiffusionPipeline"),
    (["--parallel", "ring", "--model", "tiny-sd3"], 2, "--parallel ring runs under diffusers' own context-parallel "
     "plans (FLUX); sd_kernels' plan for the denoiser of a StableDiffusion3Pipeline exchanges by Ulysses"),
    (["--parallel", "ring", "--model", "tiny-flux", "--compile"], 2, "--compile with --parallel ring"),
])
def test_what_the_split_cannot_take_is_an_error_before_any_work(tmp_path, no_build, monkeypatch, capsys, argv, world,
                                                                message):
    if world is not None:
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", str(world))
    out = tmp_path / "a.png"
    assert cli.main(["generate", "--prompt", "a cat", "--device", "cpu", "--out", str(out), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"sd-kernels generate: error: {message}"), err
    assert not out.exists() and not dist.is_initialized()


def test_parallel_with_a_prompts_file_points_to_the_batch_mode(tmp_path, no_build, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat\n")
    assert cli.main(["generate", "--prompts", str(prompts), "--parallel", "cfg", "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.strip() == (
        "sd-kernels generate: error: --parallel makes one image on several processes (--prompt); for --prompts, "
        "prompt-level sharding is the batch mode: accelerate launch --multi_gpu --num_processes N -m sd_kernels "
        "generate --prompts FILE --out DIR")
    with pytest.raises(SystemExit):
        cli.main(["generate", "--prompt", "a cat", "--parallel", "tree"])
    err = capsys.readouterr().err
    assert "argument --parallel: invalid choice: 'tree' (choose from 'cfg', 'ulysses', 'ring')" in err


@pytest.mark.integration
@pytest.mark.parametrize("mode,model", [("cfg", "tiny"), ("ulysses", "tiny-flux")])
def test_two_processes_make_the_one_process_image_and_the_first_writes_it(tmp_path, mode, model):
    """torchrun --nproc_per_node 2, a seed drawn at random (the first process's, on both: a seed per
    process would give each half of the work other latents): the image is the one a single process
    makes with the recorded seed, within rounding, written once."""
    if shutil.which("torchrun", path=os.path.dirname(sys.executable)) is None:
        pytest.skip("torchrun is not installed beside this python")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SD_KERNELS_BACKEND": "reference", "CUDA_VISIBLE_DEVICES": ""}
    argv = ["-m", "sd_kernels", "generate", "--prompt", "a cat", "--model", model, "--steps", "2", "--device", "cpu"]
    two = tmp_path / "two" / "image.png"
    run = subprocess.run([TORCHRUN, "--standalone", "--nproc_per_node", "2", *argv, "--parallel", mode, "--seed", "-1",
                          "--out", str(two)], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.stdout.count("wrote ") == 1 and run.stdout.count("generated in") == 1
    assert [p.name for p in two.parent.iterdir()] == ["image.png"]
    pixels, record = _read(two)
    assert (record["parallel"], record["processes"]) == (mode, 2)
    one = tmp_path / "one.png"
    subprocess.run([sys.executable, *argv, "--seed", str(record["seed"]), "--out", str(one)], env=env, check=True,
                   capture_output=True, timeout=600)
    alone, record_one = _read(one)
    assert (record_one["parallel"], record_one["processes"]) == (None, 1)
    assert np.abs(pixels - alone).max() <= 1 and (pixels != alone).mean() < 0.01  # fp32 rounding, then 8 bits
    assert {k: v for k, v in record.items() if k not in ("parallel", "processes", "setup")} == {
        k: v for k, v in record_one.items() if k not in ("parallel", "processes", "setup")}


def test_the_transformers_with_a_plan_take_ulysses_and_the_unets_do_not():
    """FLUX has diffusers' plan (ulysses or ring), SD3 and PixArt-Σ sd_kernels' (patches/context_parallel_plans.py:
    ulysses); a UNet none."""
    import diffusers

    from sd_kernels.apps.pipeline import _has_cp_plan

    names = ("FluxPipeline", "StableDiffusion3Pipeline", "PixArtSigmaPipeline", "StableDiffusionPipeline",
             "StableDiffusionXLPipeline")
    planned = {name: _has_cp_plan(getattr(diffusers, name)) for name in names}
    assert planned == {"FluxPipeline": True, "StableDiffusion3Pipeline": True, "PixArtSigmaPipeline": True,
                       "StableDiffusionPipeline": False, "StableDiffusionXLPipeline": False}
    assert [name for name in names if _has_cp_plan(getattr(diffusers, name), own=False)] == ["FluxPipeline"]


def test_an_eager_token_split_on_gpus_says_so(monkeypatch):
    """Under --parallel ulysses|ring on GPUs, without the switch that captures the collectives, the transformer
    runs eagerly: the first process says so and names the switch; not with it, not for cfg, not on the CPU."""
    from sd_kernels.patches.cuda_graph import COLLECTIVES_ENV

    monkeypatch.delenv(COLLECTIVES_ENV, raising=False)
    ring, cfg = parallel_app.Launch("ring", 0, 2, 0, 2), parallel_app.Launch("cfg", 0, 2, 0, 2)
    assert COLLECTIVES_ENV in parallel_app.eager_note(ring, on_gpu=True)
    assert parallel_app.eager_note(ring, on_gpu=False) is None and parallel_app.eager_note(cfg, on_gpu=True) is None
    monkeypatch.setenv(COLLECTIVES_ENV, "1")
    assert parallel_app.eager_note(ring, on_gpu=True) is None


def test_the_command_line_captures_a_token_split_unless_told_not_to(monkeypatch):
    """--parallel ulysses|ring sets SD_KERNELS_GRAPH_COLLECTIVES=1 where it is unset (so --cuda-graph pipeline
    is taken); set to 0 it stays eager and a --cuda-graph that would capture is refused; cfg leaves it alone."""
    from sd_kernels.patches.cuda_graph import COLLECTIVES_ENV

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv(COLLECTIVES_ENV, raising=False)
    parallel_app.launch("cfg", cuda_graph="auto", compile=False)
    assert COLLECTIVES_ENV not in os.environ
    assert parallel_app.launch("ring", cuda_graph="pipeline", compile=False).world == 2
    assert os.environ[COLLECTIVES_ENV] == "1"
    monkeypatch.setenv(COLLECTIVES_ENV, "0")
    with pytest.raises(ValueError, match="--cuda-graph pipeline with --parallel ulysses: with "
                                         f"{COLLECTIVES_ENV}=0 the transformer"):
        parallel_app.launch("ulysses", cuda_graph="pipeline", compile=False)
    assert os.environ[COLLECTIVES_ENV] == "0"
    # a launch refused for another reason leaves the environment as it was
    monkeypatch.delenv(COLLECTIVES_ENV)
    with pytest.raises(ValueError, match="--compile with --parallel ring"):
        parallel_app.launch("ring", cuda_graph="auto", compile=True)
    assert COLLECTIVES_ENV not in os.environ


def test_ring_mode_enables_the_ring_exchange(monkeypatch):
    """--parallel ring: enable_context_parallel(pipe, N, exchange="ring"); ulysses: exchange="ulysses"."""
    from sd_kernels.patches import context_parallel_plans

    from sd_kernels.apps import parallel

    calls = []
    monkeypatch.setattr(context_parallel_plans, "enable_context_parallel", lambda *a, **k: calls.append((a, k)))
    for mode in ("ring", "ulysses"):
        assert parallel.prepare("pipe", parallel.Launch(mode, 0, 4, 0, 4)) == {}
    assert calls == [(("pipe", 4), {"exchange": "ring"}), (("pipe", 4), {"exchange": "ulysses"})]


def test_ring_splits_flux_modulations_except_under_fp8(monkeypatch):
    """--parallel ring on a transformer with FLUX's adaLN-Zero block norms also asks for split_modulation;
    not under --precision fp8 (its norms are its own), not under ulysses, not for transformers without."""
    from sd_kernels.patches import context_parallel_plans

    from sd_kernels.apps import parallel

    flux, sd3 = models.build_pipeline("tiny-flux"), models.build_pipeline("tiny-sd3")
    calls = []
    monkeypatch.setattr(context_parallel_plans, "enable_context_parallel", lambda *a, **k: calls.append(k))
    ring, ulysses = parallel.Launch("ring", 0, 2, 0, 2), parallel.Launch("ulysses", 0, 2, 0, 2)
    parallel.prepare(flux, ring)
    parallel.prepare(flux, ring, "fp8")
    parallel.prepare(flux, ulysses)
    parallel.prepare(sd3, ulysses)
    assert calls == [{"exchange": "ring", "split_modulation": True}, {"exchange": "ring"}, {"exchange": "ulysses"},
                     {"exchange": "ulysses"}]


def test_finish_splits_the_decode_where_it_pays_or_says_why_not(monkeypatch):
    """After the patch, with the VAE's decode under the patch's CUDA graphs: every process splits the decode
    under a token split whose collectives are captured (replayed split), and under cfg from 1024² pixels up
    (eager split against the replayed whole); not where the decode has no graphs or a token split runs
    eagerly. A VAE it cannot split is a note, not an error."""
    from sd_kernels.patches.cuda_graph import COLLECTIVES_ENV

    import sd_kernels
    from sd_kernels.apps import parallel

    calls, graphed = [], [True]
    monkeypatch.setattr(sd_kernels, "enable_split_decode", lambda pipe: calls.append(pipe))
    monkeypatch.setattr(parallel, "_graphed_decode", lambda pipe: graphed[0])
    ring, cfg = parallel.Launch("ring", 0, 2, 0, 2), parallel.Launch("cfg", 0, 2, 0, 2)
    monkeypatch.setenv(COLLECTIVES_ENV, "1")
    assert parallel.finish("flux", ring, 64 * 64) == "the VAE decode split by rows over the 2 processes"
    assert parallel.finish("sd", cfg, 512 * 512) is None  # replayed whole, it stays whole
    assert parallel.finish("xl", cfg, 1024 * 1024) is not None and calls == ["flux", "xl"]
    monkeypatch.setenv(COLLECTIVES_ENV, "0")  # the transformer and the split decode eager
    assert parallel.finish("flux", ring, 64 * 64) is None
    graphed[0] = False  # --cuda-graph off
    monkeypatch.setenv(COLLECTIVES_ENV, "1")
    assert parallel.finish("flux", ring, 64 * 64) is None and parallel.finish("xl", cfg, 1024 * 1024) is None
    assert calls == ["flux", "xl"]
    graphed[0] = True

    def refuse(pipe):
        raise ValueError("enable_split_decode: this VAE's decoder cannot be split (hooks)")

    monkeypatch.setattr(sd_kernels, "enable_split_decode", refuse)
    assert parallel.finish("flux", ring, 64 * 64) == ("note: every process decodes the whole image "
                                                      "(enable_split_decode: this VAE's decoder cannot be split "
                                                      "(hooks))")


def test_the_decode_counts_as_graphed_where_the_patch_put_it_under_graphs(monkeypatch):
    """``_graphed_decode`` finds the graphs where ``patch(pipe, cuda_graph="pipeline")`` installs them on the
    VAE (CUDA graphs stood in for on the CPU: nothing is captured here), and not after unpatch, nor on a
    pipeline without a VAE."""
    import torch
    from sd_kernels.patches import cuda_graph

    import sd_kernels
    from sd_kernels.apps import parallel

    monkeypatch.setattr(cuda_graph, "check_graphable", lambda model: None)
    monkeypatch.setattr(cuda_graph, "graphable_reason", lambda model: None)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: "stream")
    pipe = models.build_pipeline("tiny")
    assert not parallel._graphed_decode(pipe) and not parallel._graphed_decode(object())
    sd_kernels.patch(pipe, cuda_graph="pipeline")
    try:
        assert parallel._graphed_decode(pipe)
    finally:
        sd_kernels.unpatch(pipe)
    assert not parallel._graphed_decode(pipe)


@pytest.mark.parametrize("fails", [None, "render", "finish"])
def test_a_launch_releases_the_patch_before_the_process_group_ends(monkeypatch, tmp_path, fails):
    """Under --parallel the patch (its CUDA graphs, which may hold captured collectives) is undone after the
    image is made, or when the split decode's set-up or the image fails, and before the caller ends the
    process group."""
    import argparse
    import types

    import sd_kernels
    from sd_kernels.apps import generate_command, options, pipeline

    calls = []

    def render(*_):
        calls.append("render")
        if fails == "render":
            raise RuntimeError("render failed")
        return [None]

    def finish(*_):
        calls.append("split decode")
        if fails == "finish":
            raise RuntimeError("finish failed")

    class Pipe:
        def set_progress_bar_config(self, **_):
            pass

        def __str__(self):
            return "pipe"

    monkeypatch.setattr(pipeline, "load", lambda *a: Pipe())
    monkeypatch.setattr(pipeline, "render", render)
    monkeypatch.setattr(parallel_app, "prepare", lambda pipe, launch, precision: {})
    monkeypatch.setattr(parallel_app, "finish", finish)
    monkeypatch.setattr(sd_kernels, "patch", lambda pipe, **k: calls.append("patch") or types.SimpleNamespace(
        summary=lambda: ""))
    monkeypatch.setattr(sd_kernels, "unpatch", lambda pipe: calls.append(f"unpatch {pipe}"))
    args = argparse.Namespace(cuda_graph="auto", profile=None, compile=False)
    settings = types.SimpleNamespace(precision="fp16")
    job = options.Job(index=0, prompt="a cat", negative=None, seed=0, width=64, height=64, steps=2, guidance=1.0)
    model = types.SimpleNamespace(name="tiny", shipped=True)
    launch = parallel_app.Launch("ring", 1, 2, 1, 2)  # not the first process: it writes nothing
    if fails:
        with pytest.raises(RuntimeError, match=f"{fails} failed"):
            generate_command._make_one(args, settings, job, False, model, "cpu", "fp32", tmp_path / "a.png", launch)
    else:
        assert generate_command._make_one(args, settings, job, False, model, "cpu", "fp32", tmp_path / "a.png",
                                          launch) == 0
    made = [] if fails == "finish" else ["render"]
    assert calls == ["patch", "split decode", *made, "unpatch pipe"]
