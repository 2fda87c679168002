"""FLUX.1 (patches/families.py: FluxTransformer2DModel, part "transformer"): the tiny config's transformer
and whole FluxPipeline patched and exactly unpatched; the FLUX attention processor
(patches/flux_attention.py) of the double- and single-stream blocks through the kernels against
float64 (its inputs through qk_norm_rope, one launch per stream), with fused projections, and its
fallbacks (unverified source, custom processors, a chosen attention backend, a mask, norms of another
class); the blocks' fused adaLN forwards (patches/layer_norm.py) and theirs; the pipeline's model calls
replayed from (stand-in) CUDA graphs with the timesteps left on the device."""

import copy
import importlib

import pytest
import torch
import torch.nn as nn
from diffusers import FluxPipeline
from diffusers.models.activations import GELU
from diffusers.models.attention_dispatch import attention_backend
from diffusers.models.transformers.transformer_flux import (
    FluxAttention,
    FluxAttnProcessor,
    FluxSingleTransformerBlock,
    FluxTransformerBlock,
)
from dit_checks import (
    T5_COUNTS,
    check_gpu_pipeline_mode_syncs,
    check_gpu_transformer_fp16,
    check_pipeline_exact_with_reference_ops,
    check_pipeline_mode_graphs,
    check_transformer_kernels_close_to_stock,
    tiny_pipeline,
)
from sd_kernels.patches import cuda_graph, qkv_fusion
from sd_kernels.patches.flux_attention import SDKernelsFluxAttnProcessor
from sd_kernels.patches.layer_norm import FluxBlockForward, FluxSingleBlockForward
from test_cuda_graph import fake_cuda  # noqa: F401  (a fixture: the stand-in for CUDA graphs)

import sd_kernels
from sd_kernels import models
from sd_kernels.runtime import dispatch
from sd_kernels.testing import assert_close_to_reference

verified = importlib.import_module("sd_kernels.patches.diffusers_sources")
dispatch_module = importlib.import_module("diffusers.models.attention_dispatch")


@pytest.fixture
def transformer():
    return models.build_model("tiny-flux", "transformer")


def _inputs(model, batch=2, side=8, text=9, seed=0):
    """What FluxPipeline passes: packed latents [B, side², 4·16] with their position ids, the T5 context
    with zero text ids, the pooled CLIP output, ``t.expand(B) / 1000`` and the guidance expanded to the
    batch, joint_attention_kwargs {} (the pipeline's when none is given)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, side * side, model.config.in_channels, generator=g)
    ctx = torch.randn(batch, text, model.config.joint_attention_dim, generator=g)
    pooled = torch.randn(batch, model.config.pooled_projection_dim, generator=g)
    img_ids = FluxPipeline._prepare_latent_image_ids(batch, side, side, "cpu", torch.float32)
    return x, {"encoder_hidden_states": ctx, "pooled_projections": pooled,
               "timestep": torch.tensor(812.5).expand(batch) / 1000, "img_ids": img_ids,
               "txt_ids": torch.zeros(text, 3), "guidance": torch.full([1], 3.5).expand(batch),
               "joint_attention_kwargs": {}}


def _run(model, x, kw, dtype=torch.float32):
    cast = lambda v: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
    with torch.no_grad():
        return model(cast(x), **{k: cast(v) for k, v in kw.items()}, return_dict=False)[0]


def _census(model):
    """What the patch should replace in the transformer, counted before patching."""
    return {
        "flux_attention_processor": sum(isinstance(m, FluxAttention) and type(m.processor) is FluxAttnProcessor
                                        for m in model.modules()),
        "gelu.GELU": sum(type(m) is GELU and m.approximate == "tanh" for m in model.modules()),
        "layer_norm.FluxTransformerBlock": sum(type(m) is FluxTransformerBlock for m in model.modules()),
        "layer_norm.FluxSingleTransformerBlock": sum(type(m) is FluxSingleTransformerBlock for m in model.modules()),
    }


def _tree(model):
    return [(name, m, getattr(m, "processor", None), vars(m).get("forward")) for name, m in model.named_modules()]


def _same(tree, other) -> bool:
    return len(tree) == len(other) and all(all(a is b for a, b in zip(s[1:], o[1:])) and s[0] == o[0]
                                           for s, o in zip(tree, other))


def _attentions(model):
    return [m for m in model.modules() if isinstance(m, FluxAttention)]


def test_tiny_config_is_flux_shaped(transformer):
    cfg = transformer.config
    assert cfg.attention_head_dim == 24 and sum(cfg.axes_dims_rope) == cfg.attention_head_dim  # not a power of two
    assert cfg.guidance_embeds and cfg.patch_size == 1 and cfg.in_channels == 4 * 16  # 16 channels packed 2x2
    double, single = transformer.transformer_blocks, transformer.single_transformer_blocks
    assert len(double) == len(single) == 2
    assert all(b.attn.added_kv_proj_dim is not None and not b.attn.pre_only for b in double)  # two streams
    assert all(b.attn.added_kv_proj_dim is None and b.attn.pre_only for b in single)  # one stream, no to_out
    assert all(type(b.act_mlp) is nn.GELU and b.act_mlp.approximate == "tanh" for b in single)


def test_patch_and_unpatch_restore_exactly(transformer):
    x, kw = _inputs(transformer)
    expected, tree = _census(transformer), _tree(transformer)
    assert expected == {"flux_attention_processor": 4, "gelu.GELU": 4,  # 2 double + 2 single; ff, ff_context
                        "layer_norm.FluxTransformerBlock": 2, "layer_norm.FluxSingleTransformerBlock": 2}
    params = dict(transformer.state_dict(keep_vars=True))
    stock = _run(transformer, x, kw)
    record = sd_kernels.patch(transformer)
    assert dict(record.counts) == {**expected, "qkv_fusion": 6}  # each attention's q, k, v; the text streams'
    assert record.parts == ["FluxTransformer2DModel"] and not record.skipped
    for a in _attentions(transformer):  # the projections' weights are rows of one buffer: no second copy
        for attr, names in qkv_fusion.STREAMS[:2 if a.added_kv_proj_dim else 1]:
            assert len({getattr(a, n).weight.untyped_storage().data_ptr() for n in names}) == 1
            with torch.no_grad():
                weight, _ = getattr(a.processor, attr).operands(a, names)
            assert weight.data_ptr() == getattr(a, names[0]).weight.data_ptr() and weight.shape[0] == 3 * a.inner_dim
    assert all(isinstance(a.processor, SDKernelsFluxAttnProcessor) for a in _attentions(transformer))
    assert all(isinstance(vars(b)["forward"], FluxBlockForward) for b in transformer.transformer_blocks)
    assert all(isinstance(vars(b)["forward"], FluxSingleBlockForward) for b in transformer.single_transformer_blocks)
    # the single blocks' nn.GELU(approximate="tanh") is torch's module, not diffusers': left as it is
    assert all(type(b.act_mlp) is nn.GELU for b in transformer.single_transformer_blocks)
    now = transformer.state_dict(keep_vars=True)
    assert now.keys() == params.keys() and all(now[k] is params[k] for k in params)
    assert sd_kernels.patch(transformer) is record  # idempotent
    assert sd_kernels.unpatch(transformer)
    assert _same(_tree(transformer), tree) and not hasattr(transformer, "_sd_kernels_owner")
    assert all(type(a.processor) is FluxAttnProcessor for a in _attentions(transformer))
    assert all(len({getattr(a, n).weight.untyped_storage().data_ptr() for n in ("to_q", "to_k", "to_v")}) == 3
               for a in _attentions(transformer))  # storage of their own again
    assert torch.equal(_run(transformer, x, kw), stock)


def test_processor_takes_the_arguments_diffusers_passes(transformer):
    """FluxAttention.forward hands a processor only the keyword arguments its __call__ names (and warns
    about the others): ours names the same ones."""
    import inspect

    stock = inspect.signature(FluxAttnProcessor().__call__).parameters
    ours = inspect.signature(SDKernelsFluxAttnProcessor(FluxAttnProcessor()).__call__).parameters
    assert list(ours) == list(stock)


def test_transformer_through_kernels(transformer):
    """The tiny transformer with the kernels (the interpreter on CPU: attention at head dim 24 over 9 text
    + 64 image tokens, in the double and the single blocks; GELU tanh; the fused adaLN LayerNorms) against
    a float64 copy; no op took the reference."""
    x, kw = _inputs(transformer)
    stock = _run(transformer, x, kw)
    ref64 = _run(copy.deepcopy(transformer).double(), x, kw, torch.float64)
    with sd_kernels.patched(transformer, cuda_graph=False) as record:
        assert record.counts["flux_attention_processor"] == 4
        assert record.counts["layer_norm.FluxTransformerBlock"] == 2
        assert record.counts["layer_norm.FluxSingleTransformerBlock"] == 2
        dispatch.reset_fallbacks()
        assert_close_to_reference(_run(transformer, x, kw), stock, ref64)
        assert not dispatch.fallbacks()  # the kernels ran, not the reference
    assert torch.equal(_run(transformer, x, kw), stock)


def _count_streams(monkeypatch) -> list:
    """The qk_norm_rope kernel's launches (one per stream of an attention call), by stream token count."""
    rope_ops = importlib.import_module("sd_kernels.ops.rope")
    launches, launch = [], rope_ops._launch_stream
    monkeypatch.setattr(rope_ops, "_launch_stream", lambda q, *a: launches.append(q.shape[1]) or launch(q, *a))
    return launches


@pytest.mark.integration
def test_attention_inputs_are_one_kernel_launch_per_stream(transformer, monkeypatch):
    """Between the projections and the attention each call runs qk_norm_rope's kernel: the double blocks one
    launch for the text stream (9 tokens) and one for the image's (64), the single blocks one for their joined
    73; with fused projections alike. A block whose norms are not torch.nn.RMSNorm (diffusers' own RMSNorm
    here, as another model might build) runs diffusers' lines."""
    from diffusers.models.normalization import RMSNorm

    x, kw = _inputs(transformer)
    launches = _count_streams(monkeypatch)
    with sd_kernels.patched(transformer, cuda_graph=False):
        _run(transformer, x, kw)
        assert launches == [9, 64, 9, 64, 73, 73]
        launches.clear()
        transformer.fuse_qkv_projections()
        _run(transformer, x, kw)
        assert launches == [9, 64, 9, 64, 73, 73]
        transformer.unfuse_qkv_projections()
    attn = transformer.transformer_blocks[0].attn
    for name in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
        norm = RMSNorm(attn.head_dim, eps=1e-6)
        norm.weight.data.copy_(getattr(attn, name).weight)
        setattr(attn, name, norm)
    stock = _run(transformer, x, kw)
    ref64 = _run(copy.deepcopy(transformer).double(), x, kw, torch.float64)
    launches.clear()
    with sd_kernels.patched(transformer, cuda_graph=False):
        assert_close_to_reference(_run(transformer, x, kw), stock, ref64)
        assert launches == [9, 64, 73, 73]  # block 0: diffusers' lines
        monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
        assert torch.equal(_run(transformer, x, kw), stock)


@pytest.mark.parametrize("ops", [["attention"], ["layer_norm"], None])
def test_reference_ops_compute_what_stock_computes(transformer, monkeypatch, ops):
    """With the PyTorch reference behind every op, the patched forward is stock's arithmetic in stock's
    order: bit-identical outputs (the plumbing: projections, QK RMSNorm, the text-first concatenation,
    the rotary embedding, the [B, S, H, D] <-> [B, H, S, D] views, the split back; the adaLN chunks,
    gates and residuals of both kinds of block)."""
    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    x, kw = _inputs(transformer)
    stock = _run(transformer, x, kw)
    with sd_kernels.patched(transformer, ops=ops, cuda_graph=False):
        assert torch.equal(_run(transformer, x, kw), stock)


def test_single_blocks_join_their_streams_without_a_copy(transformer, monkeypatch):
    """Stock's single block concatenates text and image. Patched, the second single block takes the
    first's output as it is (its text and image halves: one tensor), with stock's bits (reference ops)."""
    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    layer_norm = importlib.import_module("sd_kernels.patches.layer_norm")
    joins, joined = [], layer_norm._joined
    monkeypatch.setattr(layer_norm, "_joined", lambda t, i: joins.append(
        (out := joined(t, i)).untyped_storage().data_ptr() == t.untyped_storage().data_ptr()) or out)
    x, kw = _inputs(transformer)
    stock, stock_model = _run(transformer, x, kw), copy.deepcopy(transformer)
    with sd_kernels.patched(transformer, cuda_graph=False):
        assert torch.equal(_run(transformer, x, kw), stock)
        with torch.inference_mode():  # views of inference tensors have no _base: found from the storage
            assert torch.equal(transformer(x, **kw, return_dict=False)[0], stock)
        grads = []
        for model in (transformer, stock_model):  # tracked by autograd, a cat: every row gets its gradient
            latents = x.clone().requires_grad_(True)
            model(latents, **kw, return_dict=False)[0].square().sum().backward()
            grads.append(latents.grad)
        assert torch.equal(*grads)
    assert joins == [False, True] * 2 + [False, False]  # the double blocks' streams are two tensors; then one


def test_single_blocks_write_the_mlp_beside_the_attention_output(transformer, monkeypatch):
    """The single blocks' MLP GELU is written into proj_out's input (``ops.gelu_into``), the attention
    output copied in front: stock's concatenation's values, bits included (reference ops), without
    building it; traced or tracked by autograd, the concatenation."""
    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    layer_norm = importlib.import_module("sd_kernels.patches.layer_norm")
    made, beside = [], layer_norm._mlp_beside
    monkeypatch.setattr(layer_norm, "_mlp_beside", lambda b, x: made.append(isinstance(out := beside(b, x),
                                                                                        torch.Tensor)) or out)
    x, kw = _inputs(transformer)
    stock = _run(transformer, x, kw)
    with sd_kernels.patched(transformer, cuda_graph=False):
        assert torch.equal(_run(transformer, x, kw), stock)
        latents = x.clone().requires_grad_(True)
        transformer(latents, **kw, return_dict=False)[0].sum().backward()  # autograd: stock's cat
    assert made == [True, True, False, False]


def test_fused_projections_are_served(transformer, monkeypatch):
    """After ``transformer.fuse_qkv_projections()`` diffusers keeps FluxAttnProcessor and reads
    ``attn.fused_projections`` (to_qkv, and to_added_qkv for the text stream): ours too, with stock's
    bits on the reference and within the float64 tolerance on the kernels."""
    x, kw = _inputs(transformer)
    ref64 = _run(copy.deepcopy(transformer).double(), x, kw, torch.float64)
    transformer.fuse_qkv_projections()
    assert all(a.fused_projections and type(a.processor) is FluxAttnProcessor for a in _attentions(transformer))
    stock = _run(transformer, x, kw)
    with sd_kernels.patched(transformer, cuda_graph=False) as record:
        assert record.counts["flux_attention_processor"] == 4 and not record.skipped
        assert_close_to_reference(_run(transformer, x, kw), stock, ref64)
        monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
        assert torch.equal(_run(transformer, x, kw), stock)


def test_unverified_diffusers_processor_is_left_alone(transformer, monkeypatch):
    monkeypatch.setitem(verified.VERIFIED, "FluxAttnProcessor.__call__", "0" * 16)
    verified.is_verified.cache_clear()
    try:
        with sd_kernels.patched(transformer, cuda_graph=False) as record:
            assert "flux_attention_processor" not in record.counts
            assert record.counts["gelu.GELU"] == 4  # the other patchers still apply
            assert all(type(a.processor) is FluxAttnProcessor for a in _attentions(transformer))
            assert len(record.skipped) == 4 and all(s.what == "FluxAttnProcessor" for s in record.skipped)
            assert "not the diffusers 0.42.1" in record.skipped[0].reason
    finally:
        verified.is_verified.cache_clear()


def test_custom_processors_and_chosen_backends_are_left_alone(transformer, monkeypatch):
    """A processor of another class (a user's subclass here; FLUX's IP-Adapter one alike) and a stock one
    given a backend with ``set_attention_backend`` are listed and kept; the others are served."""
    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")

    class Mine(FluxAttnProcessor):
        pass

    double, single = transformer.transformer_blocks, transformer.single_transformer_blocks
    double[1].attn.set_processor(Mine())
    single[0].attn.set_attention_backend("native")
    kept = (double[1].attn.processor, single[0].attn.processor)
    x, kw = _inputs(transformer)
    stock = _run(transformer, x, kw)
    with sd_kernels.patched(transformer, cuda_graph=False) as record:
        assert record.counts["flux_attention_processor"] == 2
        reasons = {s.path.removeprefix("FluxTransformer2DModel."): (s.what, s.reason) for s in record.skipped}
        assert set(reasons) == {"transformer_blocks.1.attn", "single_transformer_blocks.0.attn"}
        what, reason = reasons["transformer_blocks.1.attn"]
        assert what == "Mine" and "custom FLUX attention processor" in reason
        what, reason = reasons["single_transformer_blocks.0.attn"]
        assert what == "FluxAttnProcessor" and "_attention_backend" in reason
        assert (double[1].attn.processor, single[0].attn.processor) == kept
        assert torch.equal(_run(transformer, x, kw), stock)


def _count_dispatch(monkeypatch) -> list:
    calls = []
    original = dispatch_module.dispatch_attention_fn
    monkeypatch.setattr(dispatch_module, "dispatch_attention_fn", lambda *a, **k: calls.append(k) or original(*a, **k))
    return calls


def test_calls_the_native_backend_would_not_serve_go_to_diffusers_dispatch(transformer, monkeypatch):
    """A process-wide backend (the ``attention_backend`` context manager, DIFFUSERS_ATTN_BACKEND), one set
    on a patched processor after the patch, and an attention mask (through joint_attention_kwargs) run
    diffusers' dispatch as diffusers' processor does: stock's bits."""
    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    x, kw = _inputs(transformer)
    mask = torch.ones(2, 9 + 64, dtype=torch.bool)
    mask[0, 5:9] = False  # a padded prompt
    masked = {**kw, "joint_attention_kwargs": {"attention_mask": mask}}
    with attention_backend("_native_math"):
        stock_math = _run(transformer, x, kw)
    stock_masked = _run(transformer, x, masked)
    with sd_kernels.patched(transformer, cuda_graph=False):
        calls = _count_dispatch(monkeypatch)
        _run(transformer, x, kw)
        assert not calls  # the default: our attention
        with attention_backend("_native_math"):
            assert torch.equal(_run(transformer, x, kw), stock_math)
        assert len(calls) == 4 and all(c["backend"] is None for c in calls)
        calls.clear()
        assert torch.equal(_run(transformer, x, masked), stock_masked)
        assert len(calls) == 4 and all(c["attn_mask"] is mask for c in calls)
        calls.clear()
        transformer.single_transformer_blocks[1].attn.set_attention_backend("_native_math")
        _run(transformer, x, kw)
        assert [c["backend"] for c in calls] == ["_native_math"]
    # the choice made while patched was made on the stock processor too: it stays after unpatch
    processor = transformer.single_transformer_blocks[1].attn.processor
    assert type(processor) is FluxAttnProcessor and processor._attention_backend == "_native_math"


@pytest.mark.integration
@pytest.mark.slow
def test_patched_transformer_compiles_fullgraph(transformer):
    """torch.compile(fullgraph=True) of the patched transformer: no graph break, one
    torch.ops.sd_kernels.attention and one qk_norm_rope node per FLUX attention, eager's outputs."""
    x, kw = _inputs(transformer)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    with sd_kernels.patched(transformer, cuda_graph=False) as record, torch.no_grad():
        counts = dict(record.counts)  # (unpatch empties them)
        eager = _run(transformer, x, kw)
        torch._dynamo.reset()
        compiled = torch.compile(transformer, backend=backend, fullgraph=True)
        out = compiled(x, **kw, return_dict=False)[0]
        torch._dynamo.reset()
    (gm,) = graphs
    # the custom ops' targets, whatever torch names them (the packet or its .default overload)
    calls = [str(n.target).removesuffix(".default") for n in gm.graph.nodes if n.op == "call_function"]
    assert calls.count("sd_kernels.attention") == counts["flux_attention_processor"] == 4
    assert calls.count("sd_kernels.qk_norm_rope") == 4  # the attention's inputs: one op per call
    assert calls.count("sd_kernels.layer_norm_modulated") == 2 * 2 + 2  # the double blocks' streams, the singles
    assert calls.count("sd_kernels.gated_residual_layer_norm") == 2 * 2
    gelus = [c for c in calls if c.startswith("sd_kernels.") and "gelu" in c]  # gelu, or linear_gelu
    assert len(gelus) == counts["gelu.GELU"] == 4
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# The blocks' adaLN forwards (patches/layer_norm.py).


def _spy_norm_ops(monkeypatch) -> list:
    ln_patch = importlib.import_module("sd_kernels.patches.layer_norm")
    calls = []
    for name in ("layer_norm_modulated", "gated_residual_layer_norm"):
        original = getattr(ln_patch, name)
        monkeypatch.setattr(ln_patch, name, lambda *a, _o=original, _n=name: calls.append(_n) or _o(*a))
    return calls


def _spy_forwards(monkeypatch) -> list:
    """The class forwards of FLUX's blocks, as they run (a patched block's fallback calls them)."""
    seen = []
    for cls in (FluxTransformerBlock, FluxSingleTransformerBlock):
        original = cls.forward
        monkeypatch.setattr(cls, "forward",
                            lambda self, *a, _o=original, **k: seen.append(type(self)) or _o(self, *a, **k))
    return seen


def test_block_forwards_call_the_fused_ops_and_fall_back_for_joint_attention_kwargs(transformer, monkeypatch):
    """Per double block: norm1 and norm1_context modulated, both streams' gated residual + norm2 fused;
    per single block: its norm modulated. A call with joint_attention_kwargs (an attention mask here; an
    IP-Adapter's ip_hidden_states alike) runs diffusers' forwards, with stock's bits."""
    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    x, kw = _inputs(transformer)
    mask = torch.ones(2, 9 + 64, dtype=torch.bool)
    mask[1, 7:9] = False
    masked = {**kw, "joint_attention_kwargs": {"attention_mask": mask}}
    stock_masked = _run(transformer, x, masked)
    with sd_kernels.patched(transformer, ops=["layer_norm"], cuda_graph=False):
        calls, seen = _spy_norm_ops(monkeypatch), _spy_forwards(monkeypatch)
        _run(transformer, x, kw)
        assert calls.count("layer_norm_modulated") == 2 * 2 + 2 and calls.count("gated_residual_layer_norm") == 2 * 2
        assert not seen
        calls.clear()
        assert torch.equal(_run(transformer, x, masked), stock_masked)
        assert not calls and seen == [FluxTransformerBlock] * 2 + [FluxSingleTransformerBlock] * 2


def test_a_third_attention_output_is_added_after_the_feed_forward(transformer, monkeypatch):
    """A processor that returns a third output (what diffusers' IP-Adapter processor returns: the image
    prompt's residual) gets it added to the image stream after the feed-forward residual, as diffusers'
    forward adds it: stock's bits."""
    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")

    class WithResidual(FluxAttnProcessor):
        def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                     image_rotary_emb=None):
            out = super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
            return (*out, 0.25 * out[0].flip(1)) if encoder_hidden_states is not None else out

    for block in transformer.transformer_blocks:
        block.attn.set_processor(WithResidual())
    x, kw = _inputs(transformer)
    stock = _run(transformer, x, kw)
    with sd_kernels.patched(transformer, ops=["layer_norm"], cuda_graph=False) as record:
        assert record.counts["layer_norm.FluxTransformerBlock"] == 2
        assert torch.equal(_run(transformer, x, kw), stock)


def test_fp16_streams_are_clipped_as_diffusers_clips_them(transformer, monkeypatch):
    """In fp16 diffusers clips the double block's text stream and the single block's joined stream to
    ±65504 after the last residual: a gated branch that overflows (the largest fp16 bias times a gate
    near 2) gives stock's finite bits."""
    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    double, single = transformer.transformer_blocks[0], transformer.single_transformer_blocks[0]
    with torch.no_grad():
        double.ff_context.net[2].bias.fill_(65504)
        double.norm1_context.linear.bias[5 * 48:].add_(2)  # c_gate_mlp, the last of 6 chunks
        single.proj_out.bias.fill_(65504)
        single.norm.linear.bias[2 * 48:].add_(2)  # gate, the last of 3
    double, single = double.half(), single.half()
    g = torch.Generator().manual_seed(3)
    x, ctx, temb = (torch.randn(1, t, 48, generator=g).half() for t in (16, 5, 1))
    temb = temb[:, 0]
    with torch.no_grad():
        stock = double(x, ctx, temb) + single(x, ctx, temb)
        assert all(t.abs().max() == 65504 for t in (stock[0], stock[2]))  # clipped, not inf
        with sd_kernels.patched(transformer, ops=["layer_norm"], cuda_graph=False):
            ours = double(x, ctx, temb) + single(x, ctx, temb)
            assert all(torch.equal(a, b) for a, b in zip(ours, stock, strict=True))


def test_blocks_with_other_norms_are_left_alone(transformer, monkeypatch):
    """A norm that is not the plain module the fused forwards assume (diffusers' RMSNorm as norm2_context,
    an adaLN with an RMSNorm inside) leaves its block to diffusers' forward, listed; the others are served."""
    from diffusers.models.normalization import RMSNorm

    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    transformer.transformer_blocks[1].norm2_context = RMSNorm(48, eps=1e-6, elementwise_affine=False)
    transformer.single_transformer_blocks[0].norm.norm = RMSNorm(48, eps=1e-6, elementwise_affine=False)
    x, kw = _inputs(transformer)
    stock = _run(transformer, x, kw)
    with sd_kernels.patched(transformer, ops=["layer_norm"], cuda_graph=False) as record:
        counts = record.counts
        assert counts["layer_norm.FluxTransformerBlock"] == counts["layer_norm.FluxSingleTransformerBlock"] == 1
        reasons = {s.path.removeprefix("FluxTransformer2DModel."): s.reason for s in record.skipped}
        assert set(reasons) == {"transformer_blocks.1", "single_transformer_blocks.0"}
        assert reasons["transformer_blocks.1"].startswith("left as it is: norm2_context RMSNorm: not the plain")
        assert reasons["single_transformer_blocks.0"].startswith("left as it is: norm AdaLayerNormZeroSingle: not")
        assert "forward" not in vars(transformer.transformer_blocks[1])
        assert torch.equal(_run(transformer, x, kw), stock)


@pytest.mark.parametrize("qualname", ["FluxTransformerBlock.forward", "AdaLayerNormZeroSingle.forward"])
def test_unverified_block_sources_are_left_alone(transformer, monkeypatch, qualname):
    monkeypatch.setitem(verified.VERIFIED, qualname, "0" * 16)
    verified.is_verified.cache_clear()
    try:
        with sd_kernels.patched(transformer, ops=["layer_norm"], cuda_graph=False) as record:
            kind = "FluxTransformerBlock" if qualname.startswith("Flux") else "FluxSingleTransformerBlock"
            other = "FluxSingleTransformerBlock" if qualname.startswith("Flux") else "FluxTransformerBlock"
            assert f"layer_norm.{kind}" not in record.counts and record.counts[f"layer_norm.{other}"] == 2
            assert len(record.skipped) == 2 and all(s.what == qualname for s in record.skipped)
            assert "not the diffusers 0.42.1" in record.skipped[0].reason
    finally:
        verified.is_verified.cache_clear()


def test_fp8_adaln_runs_as_itself_inside_the_fused_forwards(monkeypatch):
    """Under precision="fp8" the FP8 tier swaps the blocks' adaLN modules after the layer_norm patcher
    installed its forwards: those call the swapped module (its LayerNorm writes the FP8 codes the q/k/v
    projections read), once per stream and block: as its forward in the first block of each kind, made by the block
    before (patches/dit_handoff.py: its modulation, the norm in that block's last residual kernel) in the others."""
    from sd_kernels.patches import fp8

    model = models.build_model("tiny-flux", "transformer")
    calls = {"forward": 0, "modulation": 0}
    for name in calls:
        original = getattr(fp8.Fp8AdaLayerNormZero, name)
        monkeypatch.setattr(fp8.Fp8AdaLayerNormZero, name, lambda self, *a, _name=name, _original=original, **k:
                            calls.__setitem__(_name, calls[_name] + 1) or _original(self, *a, **k))
    x, kw = _inputs(model, batch=1, side=2, text=3)
    with sd_kernels.patched(model, ops=["layer_norm"], precision="fp8", cuda_graph=False) as record:
        assert record.counts["layer_norm.FluxTransformerBlock"] == 2 and record.counts["fp8.AdaLayerNormZero"] == 6
        _run(model, x, kw)
    assert calls == {"forward": 2 + 1, "modulation": 2 * 2 + 2}, calls


# ---------------------------------------------------------------------------------------------
# The whole pipeline.


@pytest.fixture(scope="module")
def pipe():
    return tiny_pipeline("tiny-flux")


def _pipe_run(pipe, steps=2, **kwargs):
    return pipe(prompt="a cat", num_inference_steps=steps, height=64, width=64, output_type="pt",
                max_sequence_length=16, generator=torch.Generator().manual_seed(0), **kwargs).images


def test_pipeline_patched_per_part_and_exact_with_reference_ops(pipe, monkeypatch):
    check_pipeline_exact_with_reference_ops(pipe, _pipe_run, monkeypatch, {
        "flux_attention_processor": 4, "gelu.GELU": 4, "layer_norm.FluxTransformerBlock": 2,
        "layer_norm.FluxSingleTransformerBlock": 2, "attention_processor": 2,
        "qkv_fusion": 6 + 2,  # and the VAE's two mid-block self-attentions
        **T5_COUNTS})


@pytest.mark.integration
def test_pipeline_through_kernels_close_to_stock(pipe):
    check_transformer_kernels_close_to_stock(pipe, _pipe_run)


def test_pipeline_mode_graphs_the_transformer_call(fake_cuda):  # noqa: F811
    graphed, record = check_pipeline_mode_graphs("tiny-flux", _pipe_run, (
        "transformer", "text_encoder", "text_encoder_2"))
    # the timesteps stay on the device (Family.host_timesteps=False), said in the record
    assert "host_timesteps" not in record.counts and "set_timesteps" not in vars(graphed.scheduler)
    (note,) = [s for s in record.skipped if s.path == "scheduler"]
    assert note.what == "FlowMatchEulerDiscreteScheduler" and "FLUX transformer" in note.reason
    sd_kernels.unpatch(graphed)
    assert all("forward" not in vars(getattr(graphed, p)) for p in ("transformer", "text_encoder_2"))


def test_pipeline_mode_keeps_device_timesteps_for_a_host_timestep_scheduler(fake_cuda):  # noqa: F811
    """A scheduler the host-timestep mode knows (DPM-Solver++ with flow sigmas) keeps its timesteps on
    the device under FLUX too; the images are eager's."""
    from diffusers import DPMSolverMultistepScheduler

    eager = models.build_pipeline("tiny-flux")
    eager.scheduler = DPMSolverMultistepScheduler(use_flow_sigmas=True, prediction_type="flow_prediction",
                                                  use_dynamic_shifting=True, time_shift_type="exponential")
    eager.set_progress_bar_config(disable=True)
    graphed = copy.deepcopy(eager)
    sd_kernels.patch(eager, cuda_graph=False)
    record = sd_kernels.patch(graphed)
    assert "host_timesteps" not in record.counts and "set_timesteps" not in vars(graphed.scheduler)
    with torch.no_grad():
        assert torch.equal(_pipe_run(graphed, 3), _pipe_run(eager, 3))


def test_an_attention_backend_chosen_after_capture_captures_anew(fake_cuda):  # noqa: F811
    """The graphs bake in which attention ran: a backend set on the transformer's processors
    (``set_attention_backend``) or for the process (``attention_backend(...)``) after the capture drops
    the transformer's graph, and the next call captures with diffusers' dispatch."""
    model = models.build_model("tiny-flux", "transformer")
    x, kw = _inputs(model)
    record = sd_kernels.patch(model, cuda_graph="unet")
    graphs = vars(model)["forward"].graphs
    _run(model, x, kw)
    _run(model, x, kw)
    assert len(fake_cuda) == 1  # captured once, then replayed
    with attention_backend("_native_math"):
        _run(model, x, kw)
    assert len(fake_cuda) == 2 and len(graphs) == 1
    _run(model, x, kw)  # the process default again: captured anew
    assert len(fake_cuda) == 3
    model.set_attention_backend("_native_math")
    _run(model, x, kw)
    assert len(fake_cuda) == 4
    assert record.counts["flux_attention_processor"] == 4
    sd_kernels.unpatch(model)


def test_unet_mode_graphs_the_transformer_alone(fake_cuda):  # noqa: F811
    pipe = models.build_pipeline("tiny-flux")
    record = sd_kernels.patch(pipe, cuda_graph="unet")
    assert record.counts["cuda_graph"] == 1 and isinstance(vars(pipe.transformer)["forward"], cuda_graph.GraphedCall)
    assert "decode" not in vars(pipe.vae) and "forward" not in vars(pipe.text_encoder_2)
    sd_kernels.unpatch(pipe)


def test_an_ip_adapter_image_reaches_every_replay(fake_cuda):  # noqa: F811
    """FLUX with an IP-Adapter (diffusers' loader, random weights): the transformer takes the image embeddings out of
    ``joint_attention_kwargs`` (on a copy of the dict: diffusers' ``apply_lora_scale``), the graphed call replays
    one graph, and each call's image reaches it: eager's output at every call, a new one for each image, the
    caller's dict as it was."""
    eager = models.build_model("tiny-flux", "transformer")
    models.load_random_ip_adapters(eager, 1, image_embed_dim=16)
    graphed = copy.deepcopy(eager)
    sd_kernels.patch(eager, cuda_graph=False)
    sd_kernels.patch(graphed, cuda_graph="unet")
    x, kw = _inputs(eager)
    seen = []
    for seed in (0, 1, 2):
        image = torch.randn(2, 1, 16, generator=torch.Generator().manual_seed(seed))
        want = _run(eager, x, {**kw, "joint_attention_kwargs": {"ip_adapter_image_embeds": [image]}})
        given = {"ip_adapter_image_embeds": [image]}
        got = _run(graphed, x, {**kw, "joint_attention_kwargs": given})
        assert torch.equal(got, want) and not any(torch.equal(got, s) for s in seen)
        assert list(given) == ["ip_adapter_image_embeds"] and given["ip_adapter_image_embeds"][0] is image
        seen.append(got)
    assert len(fake_cuda) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("precision", [None, "fp8"])
def test_gpu_an_ip_adapter_image_reaches_every_replay(precision):
    """Compiled kernels, real CUDA graphs (a warm-up, then the captured call), bf16, both tiers: FLUX with an
    IP-Adapter replays one graph, each call's image reaches it (the eager patched output of that image, within
    bf16's rounding), and each image gives its own output."""
    eager = models.build_model("tiny-flux", "transformer")
    models.load_random_ip_adapters(eager, 1, image_embed_dim=16)
    eager = eager.to("cuda", torch.bfloat16)
    graphed = copy.deepcopy(eager)
    sd_kernels.patch(eager, cuda_graph=False, precision=precision)
    sd_kernels.patch(graphed, cuda_graph="unet", precision=precision)
    x, kw = _inputs(eager)
    to = lambda v: v.to("cuda", torch.bfloat16) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
    x, kw = to(x), {k: (v.to("cuda") if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    seen = []
    for seed in (0, 1, 2):
        image = to(torch.randn(2, 1, 16, generator=torch.Generator().manual_seed(seed)))
        want = _run(eager, x, {**kw, "joint_attention_kwargs": {"ip_adapter_image_embeds": [image]}}, torch.bfloat16)
        got = _run(graphed, x, {**kw, "joint_attention_kwargs": {"ip_adapter_image_embeds": [image]}},
                   torch.bfloat16)
        torch.testing.assert_close(got, want, rtol=2**-7, atol=2**-7)
        assert all((got - s).abs().max() > 0.1 for s in seen)
        seen.append(got)
    assert len(vars(graphed)["forward"].graphs) == 1
    sd_kernels.unpatch(graphed)
    sd_kernels.unpatch(eager)


@pytest.mark.parametrize("command", ["generate", "demo"])
def test_cli_tiny_flux(tmp_path, capsys, monkeypatch, command):
    from sd_kernels.apps import cli

    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    out = tmp_path / "flux.png"
    assert cli.main([command, "--prompt", "a red cube", "--model", "tiny-flux", "--steps", "1", "--size", "64",
                     "--device", "cpu", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "flux_attention_processor: 4" in text and "gelu.GELU: 4" in text and out.exists()


@pytest.mark.gpu
def test_gpu_transformer_fp16_against_float64_and_exact_unpatch():
    check_gpu_transformer_fp16("tiny-flux", _inputs, _run, "flux_attention_processor", 4, side=16)


@pytest.mark.gpu
def test_gpu_pipeline_mode_matches_eager_and_never_syncs_in_the_loop():
    """The timesteps on the device: no host sync between the first step's end and the last's."""
    check_gpu_pipeline_mode_syncs("tiny-flux", 128, lambda count: {
        "callback_on_step_end": lambda p, i, t, kw: count() or kw}, max_sequence_length=16)
