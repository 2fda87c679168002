"""PixArt-Σ (patches/families.py: PixArtTransformer2DModel, part "transformer"): the tiny config's
transformer and whole PixArtSigmaPipeline patched and exactly unpatched; the ada_norm_single blocks'
fused adaLN forward (patches/layer_norm.py) through the kernels against float64, its fallbacks; the
pipeline's model calls replayed from (stand-in) CUDA graphs."""

import copy
import importlib

import pytest
import torch
from diffusers.models.activations import GELU
from diffusers.models.attention import BasicTransformerBlock
from diffusers.models.attention_processor import Attention, AttnProcessor2_0
from dit_checks import (
    T5_COUNTS,
    check_gpu_pipeline_mode_syncs,
    check_gpu_transformer_fp16,
    check_pipeline_exact_with_reference_ops,
    check_pipeline_mode_graphs,
    check_transformer_kernels_close_to_stock,
    tiny_pipeline,
)
from sd_kernels.patches import cuda_graph
from sd_kernels.patches.layer_norm import AdaNormSingleForward
from test_cuda_graph import fake_cuda  # noqa: F401  (a fixture: the stand-in for CUDA graphs)

import sd_kernels
from sd_kernels import models
from sd_kernels.runtime import dispatch
from sd_kernels.testing import assert_close_to_reference

verified = importlib.import_module("sd_kernels.patches.diffusers_sources")


@pytest.fixture
def transformer():
    return models.build_model("tiny-pixart", "transformer")


def _inputs(model, batch=2, side=8, seed=0):
    """What PixArtSigmaPipeline passes: latents, T5 states with their padding mask, a timestep tensor
    expanded to the batch, and the resolution / aspect-ratio conditions it sets to None."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, model.config.in_channels, side, side, generator=g)
    ctx = torch.randn(batch, 7, model.config.caption_channels, generator=g)
    mask = torch.ones(batch, 7)
    mask[0, 5:] = 0  # a padded prompt: the cross-attention gets an additive mask
    t = torch.tensor(500).expand(batch)
    return x, {"encoder_hidden_states": ctx, "encoder_attention_mask": mask, "timestep": t,
               "added_cond_kwargs": {"resolution": None, "aspect_ratio": None}}


def _run(model, x, kw, dtype=torch.float32):
    cast = lambda v: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
    with torch.no_grad():
        return model(cast(x), **{k: cast(v) for k, v in kw.items()}, return_dict=False)[0]


def _census(model):
    """What the patch should replace in the transformer, counted before patching."""
    return {
        "attention_processor": sum(isinstance(m, Attention) and type(m.processor) is AttnProcessor2_0
                                   for m in model.modules()),
        # each self-attention's q, k, v laid out as one GEMM (patches/qkv_fusion.py)
        "qkv_fusion": sum(isinstance(m, Attention) and type(m.processor) is AttnProcessor2_0
                          and not m.is_cross_attention for m in model.modules()),
        "gelu.GELU": sum(type(m) is GELU and m.approximate == "tanh" for m in model.modules()),
        # the cross-attentions' keys and values of the text as one GEMM (patches/text_projections.py)
        "text_kv": sum(isinstance(m, Attention) and type(m.processor) is AttnProcessor2_0 and m.is_cross_attention
                       for m in model.modules()),
        # the patch embedding's convolution, its bias added by ops.bias_residual (patches/conv_bias.py)
        "conv_bias_add": sum(type(m) is torch.nn.Conv2d and m.bias is not None for m in model.modules()),
        "layer_norm.BasicTransformerBlock": sum(type(m) is BasicTransformerBlock and m.norm_type == "ada_norm_single"
                                                for m in model.modules()),
    }


def _tree(model):
    return [(name, m, getattr(m, "processor", None), vars(m).get("forward")) for name, m in model.named_modules()]


def _same(tree, other) -> bool:
    return len(tree) == len(other) and all(all(a is b for a, b in zip(s[1:], o[1:])) and s[0] == o[0]
                                           for s, o in zip(tree, other))


def test_tiny_config_is_pixart_sigma_shaped(transformer):
    assert transformer.config.attention_head_dim == 24  # not a power of two, as PixArt-Σ's 72
    assert transformer.config.norm_type == "ada_norm_single" and not transformer.config.use_additional_conditions


def test_patch_and_unpatch_restore_exactly(transformer):
    x, kw = _inputs(transformer)
    expected, tree = _census(transformer), _tree(transformer)
    params = dict(transformer.state_dict(keep_vars=True))
    stock = _run(transformer, x, kw)
    record = sd_kernels.patch(transformer)
    assert dict(record.counts) == expected and all(v > 0 for v in expected.values())
    assert record.parts == ["PixArtTransformer2DModel"] and not record.skipped
    blocks = [m for m in transformer.modules() if type(m) is BasicTransformerBlock]
    assert all(isinstance(vars(b)["forward"], AdaNormSingleForward) for b in blocks)
    now = transformer.state_dict(keep_vars=True)
    assert now.keys() == params.keys() and all(now[k] is params[k] for k in params)
    assert sd_kernels.patch(transformer) is record  # idempotent
    assert sd_kernels.unpatch(transformer)
    assert _same(_tree(transformer), tree)
    assert all("forward" not in vars(b) for b in blocks) and not hasattr(transformer, "_sd_kernels_owner")
    assert torch.equal(_run(transformer, x, kw), stock)


def test_transformer_through_kernels(transformer):
    """The tiny transformer with the kernels (the interpreter on CPU: attention at head dim 24, GELU
    tanh, the fused adaLN LayerNorms) against a float64 copy; no op took the reference."""
    x, kw = _inputs(transformer)
    stock = _run(transformer, x, kw)
    ref64 = _run(copy.deepcopy(transformer).double(), x, kw, torch.float64)
    with sd_kernels.patched(transformer, cuda_graph=False) as record:
        assert record.counts["layer_norm.BasicTransformerBlock"] == 2
        dispatch.reset_fallbacks()
        assert_close_to_reference(_run(transformer, x, kw), stock, ref64)
        assert not dispatch.fallbacks()  # the kernels ran, not the reference
    assert torch.equal(_run(transformer, x, kw), stock)


def test_reference_ops_compute_what_stock_computes(transformer, monkeypatch):
    """With the PyTorch reference behind every op, the fused forward is stock's arithmetic in stock's
    order: bit-identical outputs (the plumbing: chunks, gates, masks, the cross-attention residual)."""
    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    x, kw = _inputs(transformer)
    stock = _run(transformer, x, kw)
    with sd_kernels.patched(transformer, ops=["layer_norm"]) as record:
        assert dict(record.counts) == {"layer_norm.BasicTransformerBlock": 2}
        assert torch.equal(_run(transformer, x, kw), stock)


def test_a_block_without_cross_attention_fuses_its_self_attention_residual(monkeypatch):
    from sd_kernels.patches import layer_norm as ln_patch
    from sd_kernels.patches.record import PatchRecord

    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    block = BasicTransformerBlock(48, 2, 24, norm_type="ada_norm_single", num_embeds_ada_norm=1000,
                                  norm_elementwise_affine=False, norm_eps=1e-6,
                                  activation_fn="gelu-approximate").eval()
    assert block.attn2 is None
    torch.nn.init.normal_(block.scale_shift_table)
    g = torch.Generator().manual_seed(3)
    x, t = torch.randn(2, 5, 48, generator=g), torch.randn(2, 6 * 48, generator=g)
    calls = []
    monkeypatch.setattr(ln_patch, "gated_residual_layer_norm", lambda *a: calls.append(a[2]) or
                        importlib.import_module("sd_kernels.ops.custom_ops").gated_residual_layer_norm(*a))
    with torch.no_grad():
        stock = block(x, timestep=t)
        record = PatchRecord(("layer_norm",), "cpu", ["block"])
        ln_patch.patch_layer_norm(block, record)
        assert torch.equal(block(x, timestep=t), stock)
        record.undo()
    assert len(calls) == 1 and calls[0] is not None  # fused with gate_msa


def test_calls_it_does_not_serve_run_diffusers_forward(transformer, monkeypatch):
    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    x, kw = _inputs(transformer)
    kw["cross_attention_kwargs"] = {"scale": None}  # diffusers ignores it; the fused path does not serve it
    stock = _run(transformer, x, kw)
    with sd_kernels.patched(transformer, ops=["layer_norm"]):
        seen = []
        original = BasicTransformerBlock.forward
        monkeypatch.setattr(BasicTransformerBlock, "forward", lambda self, *a, **k: seen.append(1) or
                            original(self, *a, **k))
        assert torch.equal(_run(transformer, x, kw), stock)
        assert len(seen) == transformer.config.num_layers


def test_unverified_diffusers_forward_is_left_alone(transformer, monkeypatch):
    monkeypatch.setitem(verified.VERIFIED, "BasicTransformerBlock.forward", "0" * 16)
    verified.is_verified.cache_clear()
    try:
        with sd_kernels.patched(transformer) as record:
            assert "layer_norm.BasicTransformerBlock" not in record.counts
            assert record.counts["attention_processor"] > 0  # the other patchers still apply
            skipped = [s for s in record.skipped if s.what == "BasicTransformerBlock.forward"]
            assert len(skipped) == transformer.config.num_layers
            assert "not the diffusers 0.42.1 forward" in skipped[0].reason
            assert not any("forward" in vars(m) for m in transformer.modules())
    finally:
        verified.is_verified.cache_clear()


def test_a_block_of_another_structure_is_reported_not_patched(transformer):
    block = transformer.transformer_blocks[0]
    block.pos_embed = torch.nn.Identity()
    with sd_kernels.patched(transformer, ops=["layer_norm"]) as record:
        assert record.counts["layer_norm.BasicTransformerBlock"] == transformer.config.num_layers - 1
        assert "forward" not in vars(block)
        (skip,) = record.skipped
        assert skip.path == "PixArtTransformer2DModel.transformer_blocks.0" and "pos_embed" in skip.reason


# ---------------------------------------------------------------------------------------------
# The whole pipeline.


@pytest.fixture(scope="module")
def pipe():
    return tiny_pipeline("tiny-pixart")


def _pipe_run(pipe, steps=2, **kwargs):
    return pipe(prompt="a cat", num_inference_steps=steps, height=64, width=64, output_type="pt",
                use_resolution_binning=False, max_sequence_length=16,
                generator=torch.Generator().manual_seed(0), **kwargs).images


def test_pipeline_patched_per_part_and_exact_with_reference_ops(pipe, monkeypatch):
    check_pipeline_exact_with_reference_ops(pipe, _pipe_run, monkeypatch, {
        "layer_norm.BasicTransformerBlock": 2, "gelu.GELU": 2,
        # 2 blocks × (self, cross) + the VAE's mid-blocks
        "attention_processor": 4 + 2, "qkv_fusion": 2 + 2, "text_kv": 2, "text_padding": 2, **T5_COUNTS})


def test_pipeline_through_kernels_close_to_stock(pipe):
    check_transformer_kernels_close_to_stock(pipe, _pipe_run)


def test_pipeline_mode_graphs_the_transformer_call(fake_cuda):  # noqa: F811
    graphed, record = check_pipeline_mode_graphs("tiny-pixart", _pipe_run, ("transformer", "text_encoder"))
    # PixArt's pipeline copies each timestep to the device itself: host timesteps would make it wait
    assert "host_timesteps" not in record.counts and "set_timesteps" not in vars(graphed.scheduler)
    assert any(s.path == "scheduler" and "stay on the device" in s.reason for s in record.skipped)
    sd_kernels.unpatch(graphed)
    assert "forward" not in vars(graphed.transformer) and "forward" not in vars(graphed.text_encoder)


def test_unet_mode_graphs_the_transformer_alone(fake_cuda):  # noqa: F811
    pipe = models.build_pipeline("tiny-pixart")
    record = sd_kernels.patch(pipe, cuda_graph="unet")
    assert record.counts["cuda_graph"] == 1 and isinstance(vars(pipe.transformer)["forward"], cuda_graph.GraphedCall)
    assert "decode" not in vars(pipe.vae) and "set_timesteps" not in vars(pipe.scheduler)
    sd_kernels.unpatch(pipe)


def test_cli_generate_tiny_pixart(tmp_path, capsys, monkeypatch):
    from sd_kernels.apps import cli

    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    out = tmp_path / "pixart.png"
    assert cli.main(["generate", "--prompt", "a red cube", "--model", "tiny-pixart", "--steps", "1", "--size", "64",
                     "--device", "cpu", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "layer_norm.BasicTransformerBlock: 2" in text and out.exists()


@pytest.mark.integration
@pytest.mark.slow
def test_patched_transformer_compiles_fullgraph(transformer):
    """torch.compile(fullgraph=True) of the patched transformer: no graph break, the fused adaLN ops as
    torch.ops.sd_kernels nodes (one modulated norm and one gated norm per block), eager's outputs."""
    x, kw = _inputs(transformer)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    with sd_kernels.patched(transformer, cuda_graph=False) as record, torch.no_grad():
        eager = _run(transformer, x, kw)
        torch._dynamo.reset()
        compiled = torch.compile(transformer, backend=backend, fullgraph=True)
        out = compiled(x, **kw, return_dict=False)[0]
        torch._dynamo.reset()
        counts = dict(record.counts)  # read while patched: unpatch empties the record
    (gm,) = graphs
    calls = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    blocks = counts["layer_norm.BasicTransformerBlock"]
    assert blocks > 0 and counts["attention_processor"] > 0, counts
    for op in ("layer_norm_modulated", "gated_residual_layer_norm"):
        assert sum(c.startswith(f"sd_kernels.{op}") for c in calls) == blocks, (op, calls)
    assert sum(c.startswith("sd_kernels.attention") for c in calls) == counts["attention_processor"], calls
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_gpu_transformer_fp16_against_float64_and_exact_unpatch():
    check_gpu_transformer_fp16("tiny-pixart", _inputs, _run, "layer_norm.BasicTransformerBlock", 2, side=16)


@pytest.mark.gpu
def test_gpu_pipeline_mode_matches_eager_and_syncs_at_most_on_the_first_step():
    """After the first step's end (DPM-Solver's step-index lookup) no host sync until the last step's
    end. PixArt's pipeline has the legacy per-step callback only (it swallows unknown kwargs)."""
    check_gpu_pipeline_mode_syncs("tiny-pixart", 256, lambda count: {
        "callback_steps": 1, "callback": lambda i, t, latents: count()}, max_sequence_length=16, clean_caption=False)
