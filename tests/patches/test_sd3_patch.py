"""Stable Diffusion 3 (patches/families.py: SD3Transformer2DModel, part "transformer"): the tiny config's
transformer and whole StableDiffusion3Pipeline patched and exactly unpatched; the joint attention
processor (patches/joint_attention.py) and the joint blocks' fused adaLN-Zero forward
(patches/layer_norm.py) through the kernels against float64, their fallbacks; the pipeline's model
calls replayed from (stand-in) CUDA graphs."""

import copy
import importlib

import pytest
import torch
from diffusers import SD3Transformer2DModel
from diffusers.models.activations import GELU
from diffusers.models.attention import JointTransformerBlock
from diffusers.models.attention_processor import Attention, FusedJointAttnProcessor2_0, JointAttnProcessor2_0
from dit_checks import (
    T5_COUNTS,
    check_gpu_transformer_fp16,
    check_pipeline_exact_with_reference_ops,
    check_pipeline_mode_graphs,
    check_transformer_kernels_close_to_stock,
    cpu_only,
    tiny_pipeline,
)
from sd_kernels.patches import cuda_graph
from sd_kernels.patches.joint_attention import SDKernelsJointAttnProcessor
from sd_kernels.patches.layer_norm import JointBlockForward
from test_cuda_graph import fake_cuda  # noqa: F401  (a fixture: the stand-in for CUDA graphs)
from torch.utils._python_dispatch import TorchDispatchMode

import sd_kernels
from sd_kernels import models
from sd_kernels.runtime import dispatch
from sd_kernels.testing import assert_close_to_reference

verified = importlib.import_module("sd_kernels.patches.diffusers_sources")
joint_attention = importlib.import_module("sd_kernels.patches.joint_attention")


@pytest.fixture
def transformer():
    return models.build_model("tiny-sd3", "transformer")


def _inputs(model, batch=2, side=16, seed=0):
    """What StableDiffusion3Pipeline passes: latents, the CLIP + T5 context and the pooled CLIP
    projections, a float timestep tensor expanded to the batch, joint_attention_kwargs None."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, model.config.in_channels, side, side, generator=g)
    ctx = torch.randn(batch, 9, model.config.joint_attention_dim, generator=g)
    pooled = torch.randn(batch, model.config.pooled_projection_dim, generator=g)
    t = torch.tensor(812.5).expand(batch)
    return x, {"encoder_hidden_states": ctx, "pooled_projections": pooled, "timestep": t,
               "joint_attention_kwargs": None}


def _run(model, x, kw, dtype=torch.float32):
    cast = lambda v: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
    with torch.no_grad():
        return model(cast(x), **{k: cast(v) for k, v in kw.items()}, return_dict=False)[0]


def _census(model):
    """What the patch should replace in the transformer, counted before patching."""
    return {
        "joint_attention_processor": sum(isinstance(m, Attention) and type(m.processor) is JointAttnProcessor2_0
                                         for m in model.modules()),
        "gelu.GELU": sum(type(m) is GELU and m.approximate == "tanh" for m in model.modules()),
        # the patch embedding's convolution, its bias added by ops.bias_residual (patches/conv_bias.py)
        "conv_bias_add": sum(type(m) is torch.nn.Conv2d and m.bias is not None for m in model.modules()),
        "layer_norm.JointTransformerBlock": sum(type(m) is JointTransformerBlock for m in model.modules()),
    }


def _tree(model):
    return [(name, m, getattr(m, "processor", None), vars(m).get("forward")) for name, m in model.named_modules()]


def _same(tree, other) -> bool:
    return len(tree) == len(other) and all(all(a is b for a, b in zip(s[1:], o[1:])) and s[0] == o[0]
                                           for s, o in zip(tree, other))


def test_tiny_config_is_sd3_shaped(transformer):
    assert transformer.config.attention_head_dim == 24  # not a power of two
    blocks = transformer.transformer_blocks
    assert [b.context_pre_only for b in blocks] == [False, True]  # SD3's last block: context in, none out
    assert not any(b.use_dual_attention for b in blocks) and transformer.config.qk_norm is None
    assert transformer.config.caption_projection_dim == transformer.inner_dim


def test_patch_and_unpatch_restore_exactly(transformer):
    x, kw = _inputs(transformer)
    expected, tree = _census(transformer), _tree(transformer)
    assert expected == {"joint_attention_processor": 2, "gelu.GELU": 3, "layer_norm.JointTransformerBlock": 2,
                        "conv_bias_add": 1}
    params = dict(transformer.state_dict(keep_vars=True))
    stock = _run(transformer, x, kw)
    record = sd_kernels.patch(transformer)
    assert dict(record.counts) == {**expected, "qkv_fusion": 4}  # each joint attention's q, k, v of both streams
    assert record.parts == ["SD3Transformer2DModel"] and not record.skipped
    blocks = list(transformer.transformer_blocks)
    assert all(isinstance(vars(b)["forward"], JointBlockForward) for b in blocks)
    assert all(isinstance(b.attn.processor, SDKernelsJointAttnProcessor) for b in blocks)
    now = transformer.state_dict(keep_vars=True)
    assert now.keys() == params.keys() and all(now[k] is params[k] for k in params)
    assert sd_kernels.patch(transformer) is record  # idempotent
    assert sd_kernels.unpatch(transformer)
    assert _same(_tree(transformer), tree)
    assert all("forward" not in vars(b) for b in blocks) and not hasattr(transformer, "_sd_kernels_owner")
    assert all(type(b.attn.processor) is JointAttnProcessor2_0 for b in blocks)
    assert torch.equal(_run(transformer, x, kw), stock)


def test_transformer_through_kernels(transformer):
    """The tiny transformer with the kernels (the interpreter on CPU: joint attention at head dim 24 over
    64 image + 9 context tokens, GELU tanh, the fused adaLN-Zero LayerNorms) against a float64 copy;
    no op took the reference."""
    x, kw = _inputs(transformer)
    stock = _run(transformer, x, kw)
    ref64 = _run(copy.deepcopy(transformer).double(), x, kw, torch.float64)
    with sd_kernels.patched(transformer, cuda_graph=False) as record:
        assert record.counts["layer_norm.JointTransformerBlock"] == 2
        dispatch.reset_fallbacks()
        assert_close_to_reference(_run(transformer, x, kw), stock, ref64)
        assert not dispatch.fallbacks()  # the kernels ran, not the reference
    assert torch.equal(_run(transformer, x, kw), stock)


def test_fused_qkv_projections_served(transformer, monkeypatch):
    """After ``fuse_qkv_projections()`` (FusedJointAttnProcessor2_0: one to_qkv and one to_added_qkv GEMM)
    the joint processor serves the fused projections: with the reference behind every op it computes
    what diffusers' fused processor does, bit for bit; with the kernels it is close to float64; unpatch
    puts diffusers' fused processors back."""
    transformer.fuse_qkv_projections()
    stock_processors = [b.attn.processor for b in transformer.transformer_blocks]
    assert {type(p) for p in stock_processors} == {FusedJointAttnProcessor2_0}
    x, kw = _inputs(transformer)
    stock = _run(transformer, x, kw)
    ref64 = _run(copy.deepcopy(transformer).double(), x, kw, torch.float64)
    with sd_kernels.patched(transformer, cuda_graph=False) as record:
        assert record.counts["joint_attention_processor"] == 2 and not record.skipped
        assert all(b.attn.processor.fused for b in transformer.transformer_blocks)
        dispatch.reset_fallbacks()
        assert_close_to_reference(_run(transformer, x, kw), stock, ref64)
        assert not dispatch.fallbacks()
        monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
        assert torch.equal(_run(transformer, x, kw), stock)
    assert [b.attn.processor for b in transformer.transformer_blocks] == stock_processors


def test_unverified_fused_joint_processor_is_left_alone(transformer, monkeypatch):
    transformer.fuse_qkv_projections()
    monkeypatch.setitem(verified.VERIFIED, "FusedJointAttnProcessor2_0.__call__", "0" * 16)
    verified.is_verified.cache_clear()
    try:
        with sd_kernels.patched(transformer, cuda_graph=False) as record:
            assert "joint_attention_processor" not in record.counts
            assert all(type(b.attn.processor) is FusedJointAttnProcessor2_0 for b in transformer.transformer_blocks)
            reasons = [s.reason for s in record.skipped if s.what == "FusedJointAttnProcessor2_0"]
            assert len(reasons) == 2 and "not the diffusers 0.42.1" in reasons[0]
    finally:
        verified.is_verified.cache_clear()


def test_fused_joint_processor_takes_4d_streams(transformer):
    """diffusers' fused processor reads [B, C, H, W] streams too, but slices the image stream by the
    channel count there (residual.shape[1] before the reshape) and fails; ours gives the 3-D call's
    result in each stream's 4-D shape."""
    transformer.fuse_qkv_projections()
    attn = transformer.transformer_blocks[0].attn
    g = torch.Generator().manual_seed(1)
    x, ctx = torch.randn(2, attn.inner_dim, 4, 4, generator=g), torch.randn(2, attn.inner_dim, 2, 3, generator=g)
    flat = lambda t: t.flatten(2).transpose(1, 2)
    ours = SDKernelsJointAttnProcessor(fused=True)
    with torch.no_grad():
        got = ours(attn, x, ctx)
        want = ours(attn, flat(x), flat(ctx))
        with pytest.raises(RuntimeError):
            attn.processor(attn, x, ctx)
    assert [t.shape for t in got] == [x.shape, ctx.shape]
    assert all(torch.equal(flat(a), b) for a, b in zip(got, want))
    with pytest.raises(ValueError, match="needs encoder_hidden_states"):
        ours(attn, flat(x))


class _Copies(TorchDispatchMode):
    """The copies (their outputs' element counts; the shapes ``copy_`` wrote into; apart, those read from a
    ``watched`` storage, which the caller keeps alive), concatenations (theirs, and whether each input is
    contiguous) and in-place adds of a vector of the calls made under it, except while ``paused``."""

    def __init__(self):
        super().__init__()
        self.paused, self.copies, self.cats, self.bias_adds, self.copied_into = False, [], [], [], []
        self.watched, self.watched_copies = set(), []  # storages (data pointers) of live tensors, copies of them

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.paused:
            if func in (torch.ops.aten.clone.default, torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default):
                self.copies.append(out.numel())
                if func is torch.ops.aten.copy_.default:
                    self.copied_into.append(tuple(args[0].shape))
                source = args[1] if func is torch.ops.aten.copy_.default else args[0]
                if source.untyped_storage().data_ptr() in self.watched:
                    self.watched_copies.append(out.numel())
            elif func is torch.ops.aten.cat.default:
                self.cats.append((out.numel(), all(t.is_contiguous() for t in args[0])))
            elif (func in (torch.ops.aten.add.Tensor, torch.ops.aten.add_.Tensor) and args[0].dim() == 3
                  and isinstance(args[1], torch.Tensor) and args[1].dim() == 1):  # F.linear's bias after a matmul
                self.bias_adds.append(out.numel())
        return out


@pytest.mark.parametrize("in_place", [True, False], ids=["join-in-place", "join-by-cat"])
def test_joint_attention_joins_the_streams_heads_inner(transformer, monkeypatch, in_place):
    """The streams' q, k and v are joined with the heads inner in memory, the projections' layout, and the
    attention writes its output heads inner, so the ``transpose(1, 2).reshape`` to [B, S, heads·D] after it
    copies nothing (SD3-medium at 1024²: 27 MB per block, 24 blocks a call). In place (``JOIN_IN_PLACE``,
    the default) the projections write the join and the output projections read their token slices of the
    attention output where they lie: no join is concatenated, nothing of the attention output copied, and
    no bias added in a pass of its own. Joined by torch.cat (diffusers' data flow), each concatenation reads
    contiguous inputs."""
    monkeypatch.setattr(joint_attention, "JOIN_IN_PLACE", in_place)
    monkeypatch.setattr(joint_attention, "PER_SAMPLE_ROWS", 1)  # every stream a GEMM a sample (9 text tokens here)
    seen, real = [], joint_attention.attention

    def attention(q, k, v, **kwargs):
        mode.paused = True  # the op's own work (the kernel in the interpreter) is not the processor's
        out = real(q, k, v, **kwargs)
        mode.paused = False
        seen.append((q, k, v, out))  # kept alive: its storage is not reused while watched
        mode.watched.add(out.untyped_storage().data_ptr())
        return out

    monkeypatch.setattr(joint_attention, "attention", attention)
    x, kw = _inputs(transformer)
    with sd_kernels.patched(transformer, cuda_graph=False), _Copies() as mode:
        _run(transformer, x, kw)
    assert len(seen) == transformer.config.num_layers
    for tensors in seen:
        assert all(t.stride(1) < t.stride(2) for t in tensors)  # [B, heads, S, D] views of [B, S, heads, D]
    outputs = {out.numel() for *_, out in seen}
    assert not outputs & set(mode.copies), "the attention's output was copied"
    joins = [contiguous for n, contiguous in mode.cats if n == seen[0][0].numel()]  # q's, k's and v's
    if not in_place:
        assert len(joins) == 3 * len(seen) and all(joins)
        return
    assert not joins and not mode.watched_copies, "a join was concatenated or a token slice copied"
    assert not mode.bias_adds, "a bias was added in a pass of its own"


@cpu_only
@pytest.mark.parametrize("dtype, head_dim", [(torch.float32, 24), (torch.float16, 64)])
def test_heads_inner_join_gives_the_same_bits(monkeypatch, dtype, head_dim):
    """Through the kernels (the interpreter on CPU), the patched transformer's output is bit for bit what it
    is with the streams joined as diffusers joins them ([B, heads, S, D] memory): the kernels read any strides."""
    monkeypatch.setattr(joint_attention, "JOIN_IN_PLACE", False)  # the join by torch.cat, which _joined lays out
    model = _tiny_sd3(dtype, head_dim)
    x, kw = _inputs(model)
    with sd_kernels.patched(model, cuda_graph=False):
        dispatch.reset_fallbacks()
        ours = _run(model, x, kw, dtype)
        monkeypatch.setattr(joint_attention, "_joined", lambda a, b: torch.cat([a, b], dim=2))
        diffusers_layout = _run(model, x, kw, dtype)
        assert not dispatch.fallbacks()
    assert torch.equal(ours, diffusers_layout)


def _tiny_sd3(dtype, head_dim):
    torch.manual_seed(0)
    return SD3Transformer2DModel(sample_size=16, patch_size=2, in_channels=16, num_layers=2,
                                 attention_head_dim=head_dim, num_attention_heads=2, joint_attention_dim=64,
                                 caption_projection_dim=2 * head_dim, pooled_projection_dim=64, out_channels=16,
                                 pos_embed_max_size=16).to(dtype).eval()


def _unfused(monkeypatch):
    """The patch without qkv_fusion's layouts: each projection a GEMM of its own."""
    monkeypatch.setattr(importlib.import_module("sd_kernels.patches.qkv_fusion"), "install", lambda *args: None)


def _error(exact: torch.Tensor):
    return lambda t: ((t.double().cpu() - exact).norm() / exact.norm()).item()


@pytest.mark.integration
@pytest.mark.parametrize("fused", [False, True], ids=["three-gemms", "fused-qkv"])
def test_fp8_projections_write_the_join_in_place(monkeypatch, device, fused):
    """Under the FP8 tier the projections of a joint attention write their rows of the join where they lie
    (every block; the last, context_pre_only, too), and no concatenation runs. Six GEMMs: the output is bit for
    bit the one the projections' own outputs joined by torch.cat give. With each stream's q, k and v laid out
    as one (qkv_fusion, the default): one GEMM a stream writes q, k and v side by side, the same codes in
    wider tiles: its error against float64 within 1.5x the torch.cat join's (the interpreter on CPU,
    compiled on a GPU)."""
    from sd_kernels.patches.fp8 import Fp8Linear, Fp8Projections

    if not fused:
        _unfused(monkeypatch)
    model = _tiny_sd3(torch.float16, 64)
    x, kw = _inputs(model)
    exact = _run(copy.deepcopy(model).double(), x, kw, torch.float64)
    model, x = model.to(device), x.to(device)
    kw = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    writes = []
    into, fused_into = Fp8Linear.into, Fp8Projections.into
    monkeypatch.setattr(Fp8Linear, "into", lambda self, x, out: writes.append(out.shape) or into(self, x, out))
    monkeypatch.setattr(Fp8Projections, "into", staticmethod(
        lambda operands, x, out: writes.append(out.shape) or fused_into(operands, x, out)))
    with sd_kernels.patched(model, cuda_graph=False, precision="fp8"):
        dispatch.reset_fallbacks()
        with _Copies() as mode:
            in_place = _run(model, x, kw, torch.float16)
        monkeypatch.setattr(joint_attention, "JOIN_IN_PLACE", False)
        joined_by_cat = _run(model, x, kw, torch.float16)
        assert not dispatch.fallbacks()
    per_block = 2 if fused else 6
    assert len(writes) == per_block * 2 and {w[-1] for w in writes} == {model.inner_dim * (3 if fused else 1)}
    assert not set(writes) & set(mode.copied_into), "a GEMM's output was made apart and copied into the join"
    joins = writes[0].numel() + writes[1].numel()  # the image and text rows of q's join (of q, k and v's fused)
    assert not [n for n, _ in mode.cats if n == joins]
    if not fused:
        assert torch.equal(in_place, joined_by_cat)
    error = _error(exact)
    assert error(in_place) <= 1.5 * error(joined_by_cat) + 1e-7, (error(in_place), error(joined_by_cat))


@pytest.mark.integration
@pytest.mark.parametrize("fused", [False, True], ids=["three-gemms", "fused-qkv"])
@pytest.mark.parametrize("batch, per_sample_rows", [(1, 1), (2, 1), (2, 32)])
def test_lossless_projections_write_the_join_in_place(monkeypatch, device, batch, per_sample_rows, fused):
    """In the lossless patch the projections of a joint attention write the join where it lies, one GEMM a
    sample (``_linear_into``), and the output projections read their token slices in place; a stream of fewer
    rows a sample than ``PER_SAMPLE_ROWS`` (the 9 text tokens at 32) takes one GEMM, copied into the join, and
    diffusers' output projection. Six GEMMs at batch 1: F.linear's GEMMs, the output bit for bit the torch.cat
    join's. At batch 2 each GEMM has half the rows, and with each stream's q, k and v laid out as one
    (qkv_fusion, the default) one GEMM a stream writes them side by side, which a GPU library may tile
    otherwise: the output's error against float64 within 1.5x the torch.cat join's (the interpreter on CPU,
    compiled on a GPU)."""
    if not fused:
        _unfused(monkeypatch)
    monkeypatch.setattr(joint_attention, "PER_SAMPLE_ROWS", per_sample_rows)
    model = _tiny_sd3(torch.float16, 64)
    x, kw = _inputs(model, batch=batch)
    exact = _run(copy.deepcopy(model).double(), x, kw, torch.float64)
    model, x = model.to(device), x.to(device)
    kw = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    writes, into = [], joint_attention._linear_into
    monkeypatch.setattr(joint_attention, "_linear_into", lambda weight, bias, x, out: writes.append(
        (out.shape[-1], out.is_contiguous())) or into(weight, bias, x, out))
    with sd_kernels.patched(model, cuda_graph=False):
        dispatch.reset_fallbacks()
        in_place = _run(model, x, kw, torch.float16)
        monkeypatch.setattr(joint_attention, "JOIN_IN_PLACE", False)
        joined_by_cat = _run(model, x, kw, torch.float16)
        assert not dispatch.fallbacks()
    # per block: the projections into the join (a token slice of it, not contiguous at batch 2), then at batch 2
    # the output projections (the image's and the text's; the last, context_pre_only, block has no text output)
    # into tensors of their own, where their rows take a GEMM a sample (at batch 1 a token slice is contiguous:
    # F.linear reads it in place)
    width = model.inner_dim
    join = [(3 * width, batch == 1)] * 2 if fused else [(width, batch == 1)] * 6
    image, text = ([(width, True)] * (batch - 1), [(width, True)] * (batch - 1) if per_sample_rows <= 9 else [])
    assert writes == join + text + image + join + image
    if batch == 1 and not fused:
        assert torch.equal(in_place, joined_by_cat)
    error = _error(exact)
    assert error(in_place) <= 1.5 * error(joined_by_cat) + 1e-7, (error(in_place), error(joined_by_cat))


class _Wrapped(torch.Tensor):
    """A tensor subclass, as quantized weights are (torchao's keep the module an nn.Linear)."""


@pytest.mark.parametrize("case", ["subclass-weight", "hooked", "autograd"])
def test_lossless_join_in_place_only_for_plain_unhooked_linears(monkeypatch, case):
    """The in-place join computes with torch.addmm what the layers' own calls compute only for plain Linears:
    a weight that is a tensor subclass (its own F.linear would be passed by) or a hooked projection sends that
    block's attention to diffusers' lines (the hook runs), autograd sends every block; the output is the torch.cat
    join's, bit for bit (batch 1, three GEMMs a stream, so that the blocks still written in place are exact)."""
    _unfused(monkeypatch)
    model = _tiny_sd3(torch.float32, 24)
    x, kw = _inputs(model, batch=1)
    first = model.transformer_blocks[0].attn
    calls = []
    if case == "subclass-weight":
        first.to_k.weight = torch.nn.Parameter(first.to_k.weight.detach().as_subclass(_Wrapped))
    elif case == "hooked":
        first.to_k.register_forward_hook(lambda *args: calls.append("hook"))
    writes, into = [], joint_attention._linear_into
    monkeypatch.setattr(joint_attention, "_linear_into",
                        lambda weight, bias, x, out: writes.append(weight.shape) or into(weight, bias, x, out))
    run = _run if case != "autograd" else (
        lambda m, x, kw, dtype: m(x, **kw, return_dict=False)[0].detach())
    with sd_kernels.patched(model, cuda_graph=False):
        in_place = run(model, x, kw, torch.float32)
        monkeypatch.setattr(joint_attention, "JOIN_IN_PLACE", False)
        joined_by_cat = run(model, x, kw, torch.float32)
    # the second block alone writes its join (six projections), unless autograd is on; its output projections at
    # batch 1 read contiguous slices (no write)
    assert len(writes) == (0 if case == "autograd" else 6)
    assert calls == (["hook", "hook"] if case == "hooked" else [])
    assert torch.equal(in_place, joined_by_cat)


@pytest.mark.parametrize("ops", [["layer_norm"], ["attention"], None])
def test_reference_ops_compute_what_stock_computes(transformer, monkeypatch, ops):
    """With the PyTorch reference behind every op, the patched forward is stock's arithmetic in stock's
    order: bit-identical outputs (the plumbing: adaLN chunks, gates, the joint concatenation and split,
    the context_pre_only block)."""
    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    x, kw = _inputs(transformer)
    stock = _run(transformer, x, kw)
    with sd_kernels.patched(transformer, ops=ops, cuda_graph=False):
        assert torch.equal(_run(transformer, x, kw), stock)


def test_fused_ops_are_the_ones_called(transformer, monkeypatch):
    """Per full block: norm1 and norm1_context modulated, both streams' gated residual + norm2 fused;
    the context_pre_only block: norm1 and the image stream's only."""
    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    ln_patch = importlib.import_module("sd_kernels.patches.layer_norm")
    calls = []
    for name in ("layer_norm_modulated", "gated_residual_layer_norm"):
        original = getattr(ln_patch, name)
        monkeypatch.setattr(ln_patch, name, lambda *a, _o=original, _n=name: calls.append(_n) or _o(*a))
    x, kw = _inputs(transformer)
    with sd_kernels.patched(transformer, ops=["layer_norm"]):
        _run(transformer, x, kw)
    assert calls.count("layer_norm_modulated") == 2 + 1 and calls.count("gated_residual_layer_norm") == 2 + 1


def test_calls_it_does_not_serve_run_diffusers_forward(transformer, monkeypatch):
    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    x, kw = _inputs(transformer)
    kw["joint_attention_kwargs"] = {"unused": None}  # diffusers' Attention drops it with a warning
    stock = _run(transformer, x, kw)
    with sd_kernels.patched(transformer, ops=["layer_norm"]):
        seen = []
        original = JointTransformerBlock.forward
        monkeypatch.setattr(JointTransformerBlock, "forward", lambda self, *a, **k: seen.append(1) or
                            original(self, *a, **k))
        assert torch.equal(_run(transformer, x, kw), stock)
        assert len(seen) == transformer.config.num_layers
        seen.clear()
        kw["joint_attention_kwargs"] = {"scale": 1.0}  # a LoRA scale: the model pops it, the blocks get {}
        _run(transformer, x, kw)
        assert not seen


@pytest.mark.parametrize("qualname", ["JointTransformerBlock.forward", "AdaLayerNormZero.forward",
                                      "JointAttnProcessor2_0.__call__"])
def test_unverified_diffusers_code_is_left_alone(transformer, monkeypatch, qualname):
    monkeypatch.setitem(verified.VERIFIED, qualname, "0" * 16)
    verified.is_verified.cache_clear()
    try:
        with sd_kernels.patched(transformer, cuda_graph=False) as record:
            skipped = [s for s in record.skipped if s.what == qualname or qualname.startswith(s.what)]
            if qualname.startswith("JointAttn"):
                assert "joint_attention_processor" not in record.counts
                assert record.counts["layer_norm.JointTransformerBlock"] == 2  # the other patchers still apply
                assert all(type(b.attn.processor) is JointAttnProcessor2_0 for b in transformer.transformer_blocks)
            else:
                assert "layer_norm.JointTransformerBlock" not in record.counts
                assert record.counts["joint_attention_processor"] == 2
                assert not any("forward" in vars(m) for m in transformer.modules())
            assert len(skipped) == transformer.config.num_layers
            assert "not the diffusers 0.42.1" in skipped[0].reason
    finally:
        verified.is_verified.cache_clear()


def test_sd35_blocks_dual_attention_left_alone_qk_norm_served(monkeypatch):
    """SD3.5's structure: a dual-attention block (SD35AdaLayerNormZeroX, a second image-only attention)
    is reported and left to diffusers' forward; its attentions (RMSNorm q/k, the image-only call of the
    joint processor) and the plain block are patched, their q, k, v not laid out as one; with reference ops,
    stock's bits."""
    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    torch.manual_seed(0)
    model = SD3Transformer2DModel(sample_size=16, patch_size=2, in_channels=16, num_layers=3, attention_head_dim=24,
                                  num_attention_heads=2, joint_attention_dim=64, caption_projection_dim=48,
                                  pooled_projection_dim=64, out_channels=16, pos_embed_max_size=16,
                                  dual_attention_layers=(0,), qk_norm="rms_norm").eval()
    x, kw = _inputs(model)
    stock = _run(model, x, kw)
    with sd_kernels.patched(model, cuda_graph=False) as record:
        assert record.counts["layer_norm.JointTransformerBlock"] == 2
        assert record.counts["joint_attention_processor"] == 3 + 1  # the joint attentions + block 0's attn2
        assert "qkv_fusion" not in record.counts  # q/k norms between projections and join: no fused GEMM would serve
        (skip,) = record.skipped
        assert skip.path == "SD3Transformer2DModel.transformer_blocks.0" and "dual attention" in skip.reason
        assert torch.equal(_run(model, x, kw), stock)


# ---------------------------------------------------------------------------------------------
# The whole pipeline.


@pytest.fixture(scope="module")
def pipe():
    return tiny_pipeline("tiny-sd3")


def _pipe_run(pipe, steps=2, **kwargs):
    return pipe(prompt="a cat", num_inference_steps=steps, height=64, width=64, output_type="pt",
                max_sequence_length=16, generator=torch.Generator().manual_seed(0), **kwargs).images


def test_pipeline_patched_per_part_and_exact_with_reference_ops(pipe, monkeypatch):
    check_pipeline_exact_with_reference_ops(pipe, _pipe_run, monkeypatch, {
        "layer_norm.JointTransformerBlock": 2, "gelu.GELU": 3,
        "joint_attention_processor": 2, "attention_processor": 2,
        "qkv_fusion": 4 + 2, **T5_COUNTS})  # and the VAE's two mid-block self-attentions


@pytest.mark.integration
def test_pipeline_through_kernels_close_to_stock(pipe):
    check_transformer_kernels_close_to_stock(pipe, _pipe_run)


def test_pipeline_mode_graphs_the_transformer_call(fake_cuda):  # noqa: F811
    graphed, record = check_pipeline_mode_graphs("tiny-sd3", _pipe_run, (
        "transformer", "text_encoder", "text_encoder_2", "text_encoder_3"))
    # FlowMatchEulerDiscreteScheduler is not among the schedulers checked with host timesteps
    assert "host_timesteps" not in record.counts
    assert any(s.path == "scheduler" and s.what == "FlowMatchEulerDiscreteScheduler" for s in record.skipped)
    sd_kernels.unpatch(graphed)
    assert all("forward" not in vars(getattr(graphed, p)) for p in ("transformer", "text_encoder_3"))


def test_unet_mode_graphs_the_transformer_alone(fake_cuda):  # noqa: F811
    pipe = models.build_pipeline("tiny-sd3")
    record = sd_kernels.patch(pipe, cuda_graph="unet")
    assert record.counts["cuda_graph"] == 1 and isinstance(vars(pipe.transformer)["forward"], cuda_graph.GraphedCall)
    assert "decode" not in vars(pipe.vae) and "forward" not in vars(pipe.text_encoder_3)
    sd_kernels.unpatch(pipe)


def test_cli_generate_tiny_sd3(tmp_path, capsys, monkeypatch):
    from sd_kernels.apps import cli

    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    out = tmp_path / "sd3.png"
    assert cli.main(["generate", "--prompt", "a red cube", "--model", "tiny-sd3", "--steps", "1", "--size", "64",
                     "--device", "cpu", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "layer_norm.JointTransformerBlock: 2" in text and "joint_attention_processor: 2" in text and out.exists()


@pytest.mark.gpu
def test_gpu_transformer_fp16_against_float64_and_exact_unpatch():
    check_gpu_transformer_fp16("tiny-sd3", _inputs, _run, "layer_norm.JointTransformerBlock", 2, side=32)


@pytest.mark.gpu
def test_gpu_heads_inner_join_gives_the_same_bits(monkeypatch):
    """On the GPU, fp16 at SD3's head dim 64 over 1,024 image + 9 text tokens (the Hopper wgmma kernel's
    range on an H200, the flash kernel elsewhere): the same bits as with diffusers' [B, heads, S, D] join."""
    torch.manual_seed(0)
    model = SD3Transformer2DModel(sample_size=64, patch_size=2, in_channels=16, num_layers=2, attention_head_dim=64,
                                  num_attention_heads=4, joint_attention_dim=64, caption_projection_dim=256,
                                  pooled_projection_dim=64, out_channels=16, pos_embed_max_size=64)
    model = model.to("cuda", torch.float16).eval()
    x, kw = _inputs(model, side=64)
    x, kw = x.cuda(), {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    monkeypatch.setattr(joint_attention, "JOIN_IN_PLACE", False)  # the join by torch.cat, which _joined lays out
    with sd_kernels.patched(model, cuda_graph=False):
        ours = _run(model, x, kw, torch.float16)
        monkeypatch.setattr(joint_attention, "_joined", lambda a, b: torch.cat([a, b], dim=2))
        diffusers_layout = _run(model, x, kw, torch.float16)
    assert torch.equal(ours, diffusers_layout)
