"""The UNets' transformer blocks (``BasicTransformerBlock``, ``norm_type="layer_norm"``: SD's and SDXL's) under
patches/unet_blocks.py's ``LayerNormBlockForward``: each residual add and the LayerNorm after it in one kernel, the
result stock's (bit for bit with the reference behind the ops; against float64 through the kernels), the calls and
blocks it does not serve left to diffusers, an exact unpatch; in the FP8 tier, the same kernel writes the codes."""

import copy
import importlib

import pytest
import torch
import torch.nn as nn
from diffusers.models.attention import BasicTransformerBlock
from dit_checks import cpu_only
from sd_kernels.patches import codes_readers, unet_blocks
from sd_kernels.patches import layer_norm as ln_patch
from sd_kernels.patches.record import PatchRecord
from sd_kernels.patches.registry import PATCHERS
from sd_kernels.patches.unet_blocks import LayerNormBlockForward

import sd_kernels
from sd_kernels import models
from sd_kernels.runtime import dispatch
from sd_kernels.testing import assert_close_to_reference, rel_err

custom_ops = importlib.import_module("sd_kernels.ops.custom_ops")
fp8_ops = importlib.import_module("sd_kernels.ops.fp8_linear")
layer_norm_ops = importlib.import_module("sd_kernels.ops.layer_norm")


@pytest.fixture
def unet():
    return models.build_model("tiny", "unet")


def _inputs(unet, seed=0, side=16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, unet.config.in_channels, side, side, generator=g)
    return x, torch.randn(2, 7, unet.config.cross_attention_dim, generator=g)


def _run(unet, x, ctx, dtype=torch.float32, **kwargs):
    with torch.no_grad():
        return unet(x.to(dtype), 500, encoder_hidden_states=ctx.to(dtype), return_dict=False, **kwargs)[0]


def _blocks(model):
    return [m for m in model.modules() if type(m) is BasicTransformerBlock and m.norm_type == "layer_norm"]


def _spy_fused(monkeypatch, name="gated_residual_layer_norm"):
    """The calls of patches/layer_norm.py's fused residual + LayerNorm op ``name``, each call's (residual, branch)."""
    calls, real = [], getattr(ln_patch, name)
    monkeypatch.setattr(ln_patch, name, lambda *a, **k: calls.append(a[:2]) or real(*a, **k))
    return calls


def test_reference_ops_compute_what_stock_computes(unet, monkeypatch):
    """With the PyTorch reference behind the op, the fused forward is stock's arithmetic in stock's order: the
    same bits; two fused calls a block (after the self- and the cross-attention); unpatch takes the forwards away."""
    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    x, ctx = _inputs(unet)
    stock = _run(unet, x, ctx)
    blocks = _blocks(unet)
    calls = _spy_fused(monkeypatch)
    with sd_kernels.patched(unet, ops=["layer_norm"], cuda_graph=False) as record:
        assert dict(record.counts) == {"layer_norm.LayerNormBlock": len(blocks)} and not record.skipped
        assert all(isinstance(vars(b)["forward"], LayerNormBlockForward) for b in blocks)
        assert torch.equal(_run(unet, x, ctx), stock)
    assert len(calls) == 2 * len(blocks)
    assert all("forward" not in vars(b) for b in blocks)
    assert torch.equal(_run(unet, x, ctx), stock)


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_unet_through_the_kernel_close_to_float64(unet, dtype):
    """Through the kernel (the interpreter on the CPU): the UNet's output against a float64 copy, as close as
    stock's; no call took the reference."""
    x, ctx = _inputs(unet)
    unet = unet.to(dtype)
    stock = _run(unet, x, ctx, dtype)
    ref64 = _run(copy.deepcopy(unet).double(), x, ctx, torch.float64)
    with sd_kernels.patched(unet, ops=["layer_norm"], cuda_graph=False):
        dispatch.reset_fallbacks()
        assert_close_to_reference(_run(unet, x, ctx, dtype), stock, ref64)
        assert not dispatch.fallbacks()


def _linked(model) -> int:
    """The pairs of consecutive blocks in the model's transformer models."""
    return sum(len(m.transformer_blocks) - 1 for m in model.modules() if type(m).__name__ == "Transformer2DModel")


@pytest.mark.parametrize("in_place", [False, True], ids=["as-called", "changed-between-blocks"])
def test_a_blocks_last_residual_and_the_next_blocks_norm1_are_one_kernel(monkeypatch, in_place):
    """tiny-xl's transformer models with two blocks: the first block's feed-forward residual and the second's norm1
    are one fused call, the sum carrying the normed output on; the same bits as stock (the reference behind the op).
    A pre-hook that changes the sum in place between the blocks: the second block normalizes it itself."""
    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    unet = models.build_model("tiny-xl", "unet")
    assert _linked(unet) > 0
    x, ctx, added = _tiny_xl_inputs(unet)
    if in_place:
        second = [m.transformer_blocks[1] for m in unet.modules() if type(m).__name__ == "Transformer2DModel"
                  and len(m.transformer_blocks) > 1]
        for block in second:
            block.register_forward_pre_hook(lambda module, args: [args[0].add_(1.0)] and None)
    stock = _run(unet, x, ctx, added_cond_kwargs=added)
    calls = _spy_fused(monkeypatch)
    taken = []
    real = unet_blocks._handed_norm
    monkeypatch.setattr(unet_blocks, "_handed_norm", lambda *a: taken.append(r := real(*a)) or r)
    with sd_kernels.patched(unet, ops=["layer_norm"], cuda_graph=False):
        assert torch.equal(_run(unet, x, ctx, added_cond_kwargs=added), stock)
    assert len(calls) == 2 * len(_blocks(unet)) + _linked(unet)
    assert sum(t is not None for t in taken) == (0 if in_place else _linked(unet))


def _tiny_xl_inputs(unet):
    x, ctx = _inputs(unet)
    text_embeds = torch.randn(2, 32, generator=torch.Generator().manual_seed(4))
    return x, ctx, {"time_ids": torch.zeros(2, 6), "text_embeds": text_embeds}


def test_no_norm_is_handed_on_with_autograd_on(monkeypatch):
    """With autograd on (training; a recomputing checkpoint would see the next block normalize where the first pass
    did not) each block normalizes its own input: nothing handed on, stock's result."""
    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    unet = models.build_model("tiny-xl", "unet")
    x, ctx, added = _tiny_xl_inputs(unet)
    stock = _run(unet, x, ctx, added_cond_kwargs=added)
    handed = []
    real = unet_blocks._hand_norm
    monkeypatch.setattr(unet_blocks, "_hand_norm", lambda *a: handed.append(1) or real(*a))
    with sd_kernels.patched(unet, ops=["layer_norm"], cuda_graph=False):
        out = unet(x, 500, encoder_hidden_states=ctx, added_cond_kwargs=added, return_dict=False)[0]
        assert torch.is_grad_enabled() and torch.equal(out.detach(), stock) and not handed
        with torch.no_grad():
            _run(unet, x, ctx, added_cond_kwargs=added)
    assert len(handed) == _linked(unet)


@pytest.mark.integration
def test_a_compiled_patched_unet_hands_nothing_on(monkeypatch):
    """torch.compile of a patched tiny-xl UNet (dynamo cannot trace an attribute set on a tensor and deleted): each
    block normalizes its own input under the compiler, and the compiled call gives the eager patched call's result."""
    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    unet = models.build_model("tiny-xl", "unet")
    x, ctx, added = _tiny_xl_inputs(unet)
    with sd_kernels.patched(unet, ops=["layer_norm"], cuda_graph=False):
        eager = _run(unet, x, ctx, added_cond_kwargs=added)
        compiled = torch.compile(unet, backend="eager", fullgraph=False)
        with torch.no_grad():
            out = compiled(x, 500, encoder_hidden_states=ctx, added_cond_kwargs=added, return_dict=False)[0]
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)


def _block(cross: bool) -> BasicTransformerBlock:
    torch.manual_seed(0)
    block = BasicTransformerBlock(32, 2, 16, cross_attention_dim=24 if cross else None,
                                  activation_fn="geglu", norm_type="layer_norm").eval()
    for norm in (block.norm1, block.norm2, block.norm3):
        if norm is not None:
            nn.init.normal_(norm.weight)
            nn.init.normal_(norm.bias)
    return block


def _patched_block(block: BasicTransformerBlock) -> PatchRecord:
    record = PatchRecord(("layer_norm",), "cpu", ["block"])
    unet_blocks.patch_unet_blocks(block, record)
    return record


def test_a_block_without_cross_attention_fuses_its_self_attention_residual_with_norm3(monkeypatch):
    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    block = _block(cross=False)
    assert block.attn2 is None
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(1))
    calls = _spy_fused(monkeypatch)
    with torch.no_grad():
        stock = block(x)
        record = _patched_block(block)
        assert record.counts["layer_norm.LayerNormBlock"] == 1
        assert torch.equal(block(x), stock)
        record.undo()
    assert len(calls) == 1 and calls[0][0] is x


def test_a_norm_swapped_in_after_the_patch_runs_as_itself(monkeypatch):
    """A norm module of another kind put in the block after the patch: the block adds stock's way and calls it."""
    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")

    class MyNorm(nn.LayerNorm):
        def forward(self, x):
            return super().forward(x) * 2

    block = _block(cross=True)
    g = torch.Generator().manual_seed(2)
    x, ctx = torch.randn(2, 5, 32, generator=g), torch.randn(2, 3, 24, generator=g)
    calls = _spy_fused(monkeypatch)
    record = _patched_block(block)
    with torch.no_grad():
        block.norm2 = MyNorm(32)
        patched = block(x, encoder_hidden_states=ctx)
        record.undo()
        assert torch.equal(patched, block(x, encoder_hidden_states=ctx))
    assert len(calls) == 1  # norm3's; norm2 ran as itself


def test_calls_it_does_not_serve_run_diffusers_forward(monkeypatch):
    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    block = _block(cross=True)
    g = torch.Generator().manual_seed(2)
    x, ctx = torch.randn(2, 5, 32, generator=g), torch.randn(2, 3, 24, generator=g)
    kwargs = {"cross_attention_kwargs": {"scale": None}}  # diffusers ignores it; the fused path does not serve it
    calls = _spy_fused(monkeypatch)
    with torch.no_grad():
        stock = block(x, encoder_hidden_states=ctx, **kwargs)
        record = _patched_block(block)
        assert torch.equal(block(x, encoder_hidden_states=ctx, **kwargs), stock)
        assert not calls
        block(x, encoder_hidden_states=ctx)
        assert len(calls) == 2
        record.undo()


def test_a_block_with_a_pos_embed_is_reported_not_patched(unet):
    block = _blocks(unet)[0]
    block.pos_embed = nn.Identity()
    with sd_kernels.patched(unet, ops=["layer_norm"], cuda_graph=False) as record:
        assert record.counts["layer_norm.LayerNormBlock"] == len(_blocks(unet)) - 1
        assert "forward" not in vars(block)
        (skip,) = record.skipped
        assert "pos_embed" in skip.reason


@cpu_only
@pytest.mark.parametrize("config", ["tiny", "tiny-xl"])
def test_fp8_tier_norms_write_their_codes_with_the_residual_add(config, count_calls, monkeypatch):
    """In the FP8 tier norm2's and norm3's codes come from the fused residual + LayerNorm kernel, and (tiny-xl's
    transformer models of two blocks) the second block's norm1's from the first block's last residual add: no
    quantization more than the tier's own norms make (``Fp8LayerNorm``), and the output as close to stock's as
    theirs."""
    unet = models.build_model(config, "unet")
    x, ctx, *added = _tiny_xl_inputs(unet) if config == "tiny-xl" else _inputs(unet)
    kwargs = {"added_cond_kwargs": added[0]} if added else {}
    stock = _run(unet, x, ctx, **kwargs)
    blocks = _blocks(unet)
    quantized = count_calls(fp8_ops, quantize="quantize_rows")
    runs = {}
    for ops in ([], ["layer_norm"]):
        calls = _spy_fused(monkeypatch, "gated_residual_layer_norm_fp8")
        with sd_kernels.patched(unet, precision="fp8", ops=ops, cuda_graph=False) as record:
            assert record.counts["fp8.LayerNorm"] == 3 * len(blocks)
            assert record.counts.get("layer_norm.LayerNormBlock", 0) == len(blocks) * bool(ops)
            before = quantized["quantize"]
            runs[bool(ops)] = _run(unet, x, ctx, **kwargs), quantized["quantize"] - before
        assert len(calls) == (2 * len(blocks) + _linked(unet)) * bool(ops)
    assert runs[True][1] == runs[False][1]
    errors = [rel_err(runs[fused][0], stock) for fused in (True, False)]
    assert errors[0] < 1.5 * errors[1], errors


@pytest.mark.gpu
@pytest.mark.parametrize("precision", [None, "fp8"], ids=["lossless", "fp8"])
def test_gpu_unet_blocks_eager_and_graphed(precision):
    """On the GPU, fp16, the whole patch: the tiny UNet eager and replayed from its CUDA graph. Lossless: against a
    float64 copy, within a small multiple of stock fp16's own error. FP8: as close to stock as the tier's norms
    without the fused residual add (``ops`` without ``layer_norm``). Unpatched: stock's bits again."""
    unet = models.build_model("tiny", "unet", device="cuda", dtype=torch.float16)
    x, ctx = (t.cuda() for t in _inputs(unet))
    stock = _run(unet, x, ctx, torch.float16)
    ref64 = _run(copy.deepcopy(unet).double(), x, ctx, torch.float64)
    every = sorted(PATCHERS)
    apart = None
    if precision == "fp8":
        with sd_kernels.patched(unet, precision="fp8", ops=[op for op in every if op != "layer_norm"],
                                cuda_graph=False):
            apart = rel_err(_run(unet, x, ctx, torch.float16), stock)
    for graph in (False, "unet"):
        with sd_kernels.patched(unet, precision=precision, cuda_graph=graph) as record:
            assert record.counts["layer_norm.LayerNormBlock"] == len(_blocks(unet)), record.counts
            for _ in range(2):  # the graph's capture, then a replay
                out = _run(unet, x, ctx, torch.float16)
                if precision is None:
                    assert_close_to_reference(out, stock, ref64)
                else:
                    assert rel_err(out, stock) < 1.5 * apart, (rel_err(out, stock), apart)
    assert torch.equal(_run(unet, x, ctx, torch.float16), stock)


@cpu_only
def test_fp8_norms_whose_readers_take_codes_write_no_values(monkeypatch):
    """In the FP8 tier, with sd_kernels' attention processors, every fused norm's reader takes its codes alone
    (norm2's the cross-attention's query, norm3's the feed-forward, a handed norm1 the next self-attention's q, k,
    v): no fused call writes values, and the UNet's output is the one with every value written, bit for bit. A hook
    on the cross-attention's query projection or the feed-forward's first GEMM (readers of values) keeps norm2's or
    norm3's written, the output the same."""
    unet = models.build_model("tiny-xl", "unet")
    x, ctx, added = _tiny_xl_inputs(unet)
    blocks = _blocks(unet)
    values, real = [], ln_patch.gated_residual_layer_norm_fp8
    monkeypatch.setattr(ln_patch, "gated_residual_layer_norm_fp8",
                        lambda *a, **k: values.append(k["values"]) or real(*a, **k))
    outs = {}
    with sd_kernels.patched(unet, precision="fp8", ops=["attention", "layer_norm"], cuda_graph=False):
        for codes_only in (False, True):
            monkeypatch.setattr(codes_readers, "CODES_ONLY", codes_only)
            values.clear()
            outs[codes_only] = _run(unet, x, ctx, added_cond_kwargs=added)
            assert len(values) == 2 * len(blocks) + _linked(unet)
            assert values == [not codes_only] * len(values)
        hooked = []
        for reader in (blocks[0].attn2.to_q, blocks[0].ff.net[0].proj):  # norm2's, norm3's
            hook = reader.register_forward_pre_hook(lambda *_: None)
            values.clear()
            hooked.append(_run(unet, x, ctx, added_cond_kwargs=added))
            hook.remove()
            assert values.count(True) == 1  # the hooked block's norm
    assert torch.equal(outs[True], outs[False]) and all(torch.equal(h, outs[False]) for h in hooked)
    assert not torch.isnan(outs[True]).any()


def test_a_norm_written_without_values_carries_nan():
    """``values=False``: the normed output is a NaN stand-in (broadcast, no memory of its own) that carries the
    codes; its reader of codes gets the same codes as with values written."""
    g = torch.Generator().manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # on a GPU host, CPU tensors take the reference
    r, b, w, bias = (torch.randn(*shape, generator=g).to(device) for shape in ((2, 5, 16), (2, 5, 16), (16,), (16,)))
    h, y, q, s = layer_norm_ops.gated_residual_layer_norm_fp8(r, b, None, w, bias, 1e-6)
    h2, y2, q2, s2 = layer_norm_ops.gated_residual_layer_norm_fp8(r, b, None, w, bias, 1e-6, values=False)
    assert torch.equal(h, h2) and torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)
    assert y2.shape == y.shape and y2.dtype == y.dtype and y2.stride() == (0, 0, 0) and torch.isnan(y2).all()
