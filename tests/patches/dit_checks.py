"""Checks the DiT families' tests share (test_pixart_patch.py, test_sd3_patch.py, test_flux_patch.py): the
same tiny VAE, the same pipeline-level comparison against float64 and the same GPU checks."""

import copy
import os

import pytest
import torch
from sd_kernels.patches import cuda_graph

import sd_kernels
from sd_kernels.runtime import dispatch
from sd_kernels.testing import assert_close_to_reference

# A CPU model through the interpreter: on a GPU machine (no TRITON_INTERPRET) the CPU has no kernels to run
cpu_only = pytest.mark.skipif(torch.cuda.is_available() and not os.environ.get("TRITON_INTERPRET"),
                              reason="CPU pipelines through the interpreter; the GPU runs the gpu-marked test")

# What the patch counts in the tiny configs' VAE (every DiT tiny config shares tiny.json's VAE blocks).
VAE_COUNTS = {"conv_bias_add", "group_norm", "group_norm_silu", "resnet_fused_forward", "silu_folded",
              "upsample.polyphase"}


def check_transformer_kernels_close_to_stock(pipe, run) -> None:
    """``run(pipe)`` (two steps) with the transformer's kernels (the interpreter), the VAE left to stock:
    the images against a float64 run of the same pipeline, no op on the reference."""
    stock = run(pipe)
    ref64 = run(copy.deepcopy(pipe).to(torch.float64))
    with sd_kernels.patched(pipe, ignore=("vae",)) as record:
        assert record.parts == ["transformer"]
        dispatch.reset_fallbacks()
        assert_close_to_reference(run(pipe), stock, ref64)
        assert not dispatch.fallbacks()


def check_gpu_transformer_fp16(config: str, inputs, run, count: str, expected: int, side: int) -> None:
    """On the GPU, fp16: the patched tiny transformer of ``config`` eager and replayed from its CUDA graph
    against a float64 copy within a small multiple of stock fp16's own error; unpatched, bit-identical
    again. ``inputs(model, side)`` and ``run(model, x, kw, dtype)`` are the test file's own; ``count``
    is a record count that must equal ``expected`` while patched."""
    from sd_kernels import models

    model = models.build_model(config, "transformer", device="cuda", dtype=torch.float16)
    x, kw = inputs(model, side=side)
    x, kw = x.cuda(), {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    stock = run(model, x, kw, torch.float16)
    ref64 = run(copy.deepcopy(model).double(), x, kw, torch.float64)
    for graph in (False, "unet"):
        with sd_kernels.patched(model, cuda_graph=graph) as record:
            assert record.counts[count] == expected, record.counts
            for _ in range(2):  # the graph's capture, then a replay
                assert_close_to_reference(run(model, x, kw, torch.float16), stock, ref64)
    assert torch.equal(run(model, x, kw, torch.float16), stock)


def check_gpu_pipeline_mode_syncs(config: str, size: int, step_callback, steps: int = 4, **call_kwargs) -> None:
    """tiny ``config`` with every model call replayed: the eager patched pipeline's images, and no host
    sync between the first step's end and the last's. ``step_callback(count)`` gives the pipeline call's
    keyword arguments that call ``count()`` at every step's end (each pipeline has its own callback API)."""
    import warnings

    from sd_kernels import models

    eager = models.build_pipeline(config, device="cuda", dtype=torch.float16)
    eager.set_progress_bar_config(disable=True)
    graphed = copy.deepcopy(eager)
    sd_kernels.patch(eager, cuda_graph=False)
    assert sd_kernels.patch(graphed).cuda_graph == "pipeline"

    def run(pipe, **kw):
        return pipe(prompt="a cat", num_inference_steps=steps, height=size, width=size, output_type="pt",
                    generator=torch.Generator("cuda").manual_seed(0), **call_kwargs, **kw).images

    counts = []
    with torch.no_grad():
        want = run(eager)
        torch.testing.assert_close(run(graphed), want, rtol=1e-3, atol=1e-3)  # captures
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                got = run(graphed, **step_callback(
                    lambda: counts.append(sum("synchronizing" in str(w.message) for w in caught))))
            finally:
                torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
    assert len(counts) == steps and counts[-1] == counts[0], counts


def tiny_pipeline(config: str):
    from sd_kernels import models

    pipe = models.build_pipeline(config)
    pipe.set_progress_bar_config(disable=True)
    return pipe


# the tiny configs' 2-block T5 encoder (patches/t5_encoder.py): 2 × 2 block norms and the final one
T5_COUNTS = {"t5.rms_norm": 5, "t5.feed_forward": 2, "t5.attention": 2}


def check_pipeline_exact_with_reference_ops(pipe, run, monkeypatch, transformer_counts: dict[str, int]) -> None:
    """``patch(pipe)`` patches the VAE and the transformer (and its T5), with exactly ``transformer_counts`` beside the
    tiny VAE's counts (``attention_processor`` counts the VAE's two mid-block attentions too) and
    nothing of the transformer skipped; with the reference ops the images are stock's, patched and after."""
    stock = run(pipe)
    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    with sd_kernels.patched(pipe) as record:
        assert record.parts == ["vae", "transformer"]
        counts = dict(record.counts)
        for kind, expected in transformer_counts.items():
            assert counts.pop(kind) == expected, kind
        assert set(counts) == VAE_COUNTS
        assert not any(s.path == "transformer" for s in record.skipped)
        assert torch.equal(run(pipe), stock)
    assert torch.equal(run(pipe), stock)


def check_pipeline_mode_graphs(config: str, run, graphed_parts: tuple[str, ...]):
    """tiny ``config`` patched with ``cuda_graph="auto"`` (the stand-in for graphs says it can capture):
    pipeline mode, exactly ``graphed_parts`` replayed (the transformer first), the eager patched
    pipeline's images at 3 then 2 steps, one transformer signature. Returns (the graphed pipeline, its
    record) for the family's own checks, before it unpatches."""
    eager = tiny_pipeline(config)
    graphed = copy.deepcopy(eager)
    sd_kernels.patch(eager, cuda_graph=False)
    record = sd_kernels.patch(graphed)
    assert record.cuda_graph == "pipeline"
    assert record.counts["cuda_graph"] == len(graphed_parts) + 1  # and the VAE decode
    for part in graphed_parts:
        assert isinstance(vars(getattr(graphed, part))["forward"], cuda_graph.GraphedCall), part
    with torch.no_grad():
        for steps in (3, 2):
            assert torch.equal(run(graphed, steps), run(eager, steps))
    assert len(graphed.transformer.forward.graphs) == 1
    return graphed, record
