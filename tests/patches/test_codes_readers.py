"""The FP8 tier's DiT block norms write no values where every reader takes their codes alone
(patches/codes_readers.py): FLUX's and SD3's adaLN-Zero norms (norm1, norm1_context, the single blocks' norm) and
the gated norm2 before each feed-forward; the UNets' norms: tests/patches/test_unet_blocks.py. FLUX's and SD3's
blocks hand the next block's norm1 on with their last residual (patches/dit_handoff.py)."""

import types

import pytest
import torch
from dit_checks import cpu_only
from sd_kernels.patches import codes_readers, dit_handoff, fp8
from sd_kernels.patches import layer_norm as ln_patch
from test_flux_patch import _inputs as flux_inputs
from test_fp8_patch import _call, _model
from test_sd3_patch import _inputs as sd3_inputs

import sd_kernels


@pytest.fixture
def values_asked(monkeypatch):
    """``values`` of each call of the tier's modulated norm, gated norm2 and handed norm kernels (patches/
    dit_handoff.py: a block's last residual with the next block's norm1): (kind, values) in call order."""
    asked = []
    for module, name, kind in ((fp8, "layer_norm_modulated_fp8", "norm1"),
                               (ln_patch, "gated_residual_layer_norm_fp8", "norm2"),
                               (dit_handoff, "gated_residual_layer_norm_fp8", "handed")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _kind=kind, **k:
                            asked.append((_kind, k.get("values", True))) or _real(*a, **k))
    return asked


def _norms(model, name, handed=True):
    """{kind: calls} of the norms a call of ``model`` makes: FLUX's two streams' norm1 in each double block and
    each single block's norm, all but the first double and the first single block's handed on by the block before
    (``handed``); SD3's norm1, and norm1_context where it is adaLN-Zero (not the last block's); each stream's
    norm2."""
    if name == "tiny-flux":
        doubles, singles = len(model.transformer_blocks), len(model.single_transformer_blocks)
        on = 2 * (doubles - 1) + singles - 1 if handed else 0
        return {"norm1": 2 * doubles + singles - on, "norm2": 2 * doubles, "handed": on}
    pre_only = sum(b.context_pre_only for b in model.transformer_blocks)
    blocks = len(model.transformer_blocks)
    on = 2 * (blocks - 1) - pre_only if handed else 0  # the last block's text norm is not adaLN-Zero
    return {"norm1": 2 * blocks - pre_only - on, "norm2": 2 * blocks - pre_only, "handed": on}


def _flux32():
    """tiny-flux at head dim 64 in fp32: FLUX's blocks hand norms on in every dtype but fp16 (where diffusers clips
    each block's output: a new tensor), and the interpreter's bf16 dot is broken."""
    return _model("tiny-flux").float()


def _sd3_32():
    """tiny-sd3 at head dim 64 with three blocks, in fp32: the second block's two streams and the last block's image
    stream take handed norms. In fp16 our GEMM's epilogue adds the gated residual to its fp32 accumulator, which the
    hand-on rounds first: equal within rounding, not bit for bit (FLUX's GPU test below)."""
    model = _model("tiny-sd3")
    torch.manual_seed(0)
    return type(model).from_config({**model.config, "num_layers": 3}).float().eval().requires_grad_(False)


def _call32(model, **extra):
    x, kw = (flux_inputs(model, batch=1, side=4, text=4) if hasattr(model, "single_transformer_blocks")
             else sd3_inputs(model, batch=1, side=8))
    with torch.no_grad():
        return model(x, **kw, **extra, return_dict=False)[0]


def _controlnet_residuals(model) -> dict:
    """A ControlNet's residuals for ``_call32``, [1, 16 tokens, width]: FLUX's, one a double and one a single block;
    SD3's one, which its transformer adds after every block but the last. The transformers add them to the image
    stream between the blocks."""
    g = torch.Generator().manual_seed(1)
    width = model.transformer_blocks[0].norm2.normalized_shape[0]
    res = lambda n: [torch.randn(1, 16, width, generator=g) for _ in range(n)]  # noqa: E731
    if hasattr(model, "single_transformer_blocks"):
        return {"controlnet_block_samples": res(2), "controlnet_single_block_samples": res(2)}
    return {"block_controlnet_hidden_states": res(1)}


def _both_ways(monkeypatch, asked, call, switch, expected):
    """``call()`` with the module flag ``switch`` off, then on: ({on: output}, {on: the norms' (kind, values)}), each
    call's norm counts as ``expected(on)`` says."""
    outs, seen = {}, {}
    for on in (False, True):
        monkeypatch.setattr(*switch, on)
        asked.clear()
        outs[on] = call()
        seen[on] = list(asked)
        assert _counts(asked) == expected(on), asked
    return outs, seen


def _counts(asked):
    kinds = [kind for kind, _ in asked]
    return {kind: kinds.count(kind) for kind in ("norm1", "norm2", "handed")}


def _readers(model, name):
    """One reader of values for each kind of norm: a hook on it makes exactly that norm write its values (FLUX's
    second blocks' norms: made by the block before and handed on)."""
    first = model.transformer_blocks[0]
    readers = [first.attn.to_q, first.attn.add_k_proj, first.ff.net[0].proj]
    readers.append(model.transformer_blocks[1].attn.to_q)  # its norm made by the block before
    if name == "tiny-flux":
        readers += [model.single_transformer_blocks[0].proj_mlp, model.transformer_blocks[1].attn.add_k_proj,
                    model.single_transformer_blocks[1].proj_mlp]
    return readers


def _values_read(module, args):
    """A hook of a reader of values: the values it is given were written."""
    assert not torch.isnan(args[0]).any(), module


@cpu_only
@pytest.mark.parametrize("name", ["tiny-flux", pytest.param("tiny-sd3", marks=pytest.mark.integration)])
def test_dit_norms_whose_readers_take_codes_write_no_values(name, values_asked, monkeypatch):
    """Every norm before an FP8 projection or feed-forward writes no values, and the output is the one with every
    value written, bit for bit. A hook on one reader (a projection of one stream, the feed-forward's first GEMM,
    the single block's ``proj_mlp``) or on the norm itself keeps that one norm's values written, the output the
    same; under ``torch.inference_mode()`` (codes do not travel) the modulated norms write them."""
    model = _flux32() if name == "tiny-flux" else _model(name)
    call = _call32 if name == "tiny-flux" else lambda m: _call(m, name)
    with sd_kernels.patched(model, precision="fp8", ops=["attention", "layer_norm"], cuda_graph=False):
        outs, asked = _both_ways(monkeypatch, values_asked, lambda: call(model), (codes_readers, "CODES_ONLY"),
                                 lambda on: _norms(model, name))
        assert all([v for _, v in asked[on]] == [not on] * len(asked[on]) for on in asked)
        hooked = []
        for reader in [*_readers(model, name), model.transformer_blocks[0].norm1]:
            hook = reader.register_forward_pre_hook(_values_read)
            values_asked.clear()
            hooked.append(call(model))
            hook.remove()
            assert sum(v for _, v in values_asked) == 1, (reader, values_asked)
        values_asked.clear()
        with torch.inference_mode():  # norm2 is the lossless kernel there (no codes): not among these
            call(model)
        assert values_asked == [("norm1", True)] * _norms(model, name, handed=False)["norm1"]
    assert torch.equal(outs[True], outs[False]) and all(torch.equal(h, outs[False]) for h in hooked)
    assert not torch.isnan(outs[True]).any()


@cpu_only
def test_a_flux_attention_whose_projections_diffusers_fused_reads_values():
    """After diffusers' own ``fuse_qkv_projections()`` a FLUX attention reads ``to_qkv``, a Linear of its own
    (not one of the tier's): its norms' readers take values."""
    model = _model("tiny-flux")
    attn = model.transformer_blocks[0].attn
    with sd_kernels.patched(model, precision="fp8", ops=["attention", "layer_norm"], cuda_graph=False):
        assert codes_readers.codes_only((attn, codes_readers.IMAGE), (attn, codes_readers.TEXT))
        attn.fused_projections = True
        assert not codes_readers.codes_only((attn, codes_readers.IMAGE))
        attn.fused_projections = False


@cpu_only
@pytest.mark.parametrize("name", ["tiny-flux", pytest.param("tiny-sd3", marks=pytest.mark.integration)])
def test_dit_blocks_hand_the_next_norm_on_and_the_next_block_checks_it(name, values_asked, monkeypatch):
    """Each FLUX and SD3 block but the last of its kind makes the next block's norm1 (and norm1_context) with its
    last gated residual, and the output is the one with every norm its own kernel, bit for bit. With a ControlNet's
    residuals added between the blocks (new image streams), the blocks after refuse the handed image norms and make
    them, and the call after the blocks before hand those on no more (``RETRY_AFTER``), the output again the one
    without the hand-on; a forward pre-hook on a block (which may change what its norm reads: here the step
    embedding, in place) gets no norm handed on. Unpatched, stock's bits."""
    model = _flux32() if name == "tiny-flux" else _sd3_32()
    stock = _call32(model)
    control = _controlnet_residuals(model)

    def scaled_emb(module, args, kwargs):
        kwargs["temb"].mul_(1.5)
        return args, kwargs

    expected = _norms(model, name)
    with sd_kernels.patched(model, precision="fp8", ops=["attention", "layer_norm"], cuda_graph=False):
        outs, _ = _both_ways(monkeypatch, values_asked, lambda: _call32(model), (dit_handoff, "HAND_ON"),
                             lambda on: _norms(model, name, handed=on))
        hook = model.transformer_blocks[1].register_forward_pre_hook(scaled_emb, with_kwargs=True)
        values_asked.clear()
        hooked = _call32(model)
        assert _counts(values_asked) == {**expected, "norm1": expected["norm1"] + 2, "handed": expected["handed"] - 2}
        hook.remove()
        skipped = None
        if name == "tiny-sd3":  # skip-layer guidance's call: the second block not called, its handed norms dropped
            values_asked.clear()
            skipped = [_call32(model, skip_layers=[1]), _call32(model)]  # the normal call after hands on as before
            assert _counts(values_asked)["handed"] == 2 + expected["handed"], values_asked
        controlled = []
        for handed in (3, 1):  # three made, the image streams' two refused; then the text stream's alone
            values_asked.clear()
            controlled.append(_call32(model, **control))
            assert _counts(values_asked) == {**expected, "norm1": expected["norm1"] + 2, "handed": handed}
        monkeypatch.setattr(dit_handoff, "HAND_ON", False)
        assert all(torch.equal(out, _call32(model, **control)) for out in controlled)
        if skipped is not None:
            assert torch.equal(skipped[0], _call32(model, skip_layers=[1])) and torch.equal(skipped[1], outs[False])
        hook = model.transformer_blocks[1].register_forward_pre_hook(scaled_emb, with_kwargs=True)
        assert torch.equal(hooked, _call32(model))
        hook.remove()
    assert torch.equal(outs[True], outs[False]) and not torch.equal(controlled[0], outs[False])
    assert torch.equal(_call32(model), stock)


@cpu_only
def test_flux_blocks_hand_no_norm_on_in_fp16(values_asked):
    """diffusers clips FLUX's block outputs in fp16 (new tensors), so its blocks hand no norm on there; SD3's blocks,
    which do not clip, do (``test_dit_norms_whose_readers_take_codes_write_no_values`` runs tiny-sd3 in fp16)."""
    model = _model("tiny-flux")
    with sd_kernels.patched(model, precision="fp8", ops=["attention", "layer_norm"], cuda_graph=False):
        _call(model, "tiny-flux")
    assert _counts(values_asked) == _norms(model, "tiny-flux", handed=False)


def test_a_handed_norm_is_taken_only_for_the_tensor_and_embedding_it_was_made_for():
    """``taken`` gives the handed norm once, to the block whose norm made it, for the same embedding unchanged and
    the same h unchanged (a view joined from its halves included); any other case, and a norm handed on that never
    arrived (its stream replaced), is a refusal, after which the block before hands that norm on no more for
    ``RETRY_AFTER`` calls. Nothing handed and nothing expected: no refusal; a norm made by another block's norm
    (the block it was made for was skipped) is dropped without one."""
    norm, other = torch.nn.LayerNorm(4), torch.nn.LayerNorm(4)
    refused = {"norm": dit_handoff.RETRY_AFTER}

    def forward():
        return types.SimpleNamespace(block=types.SimpleNamespace(norm=norm), skips={}, expected={})

    def handed(f, h, emb, on=None):
        return dit_handoff.hand_on(h, dit_handoff.Hand(f, "norm", norm), emb, ("normed",), on=on)

    h, emb = torch.zeros(1, 6, 4), torch.zeros(1, 4)
    f = forward()
    assert dit_handoff.taken(f, "norm", handed(f, h, emb), emb) == ("normed",)
    assert dit_handoff.taken(f, "norm", h, emb) is None and f.skips == {}  # taken off; nothing expected
    text = handed(f, h, emb, on=h[:, :2])
    assert dit_handoff.taken(f, "norm", text, emb, h.as_strided(h.shape, h.stride())) == ("normed",)
    for change in (lambda: h.add_(1), lambda: h[:, 2:].add_(1), lambda: emb.add_(1)):
        f = forward()
        handed(f, h, emb)
        change()
        assert dit_handoff.taken(f, "norm", h, emb) is None and f.skips == refused
    for case in ((h, emb.clone()), (h.clone(), emb)):
        f = forward()
        handed(f, h, emb, on=case[0])
        assert dit_handoff.taken(f, "norm", *case) is None and f.skips == refused
    f = forward()
    handed(f, h, emb)
    assert dit_handoff.taken(f, "norm", h + 0, emb) is None and f.skips == refused  # a new stream: never arrived
    f = forward()
    handed(f, h, emb)
    f.block.norm = other
    assert dit_handoff.taken(f, "norm", h, emb) is None and f.skips == refused
    skipped, f = forward(), forward()  # made for a block that was not called (skip-layer guidance): dropped
    handed(skipped, h, emb)
    f.block.norm = other
    assert dit_handoff.taken(f, "norm", h, emb) is None and f.skips == {} and not hasattr(h, dit_handoff._HANDED)


# The GPU transformers: FLUX's head dim 128 in bf16 (4 blocks of each kind), SD3's 64 in fp16 (4 joint blocks, 4 heads).
_GPU_CONFIGS = {
    "tiny-flux": ({"num_layers": 4, "num_single_layers": 4, "attention_head_dim": 128, "axes_dims_rope": [16, 56, 56]},
                  torch.bfloat16, lambda m: flux_inputs(m, batch=1, side=16, text=8)),
    "tiny-sd3": ({"num_layers": 4, "num_attention_heads": 4, "attention_head_dim": 64, "caption_projection_dim": 256},
                 torch.float16, lambda m: sd3_inputs(m, batch=2, side=32)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(_GPU_CONFIGS))
def test_gpu_dit_norms_handed_on_without_values_stay_with_the_written_ones(name, values_asked, monkeypatch):
    """On the GPU, compiled, in the model's dtype (FLUX's bf16 at head dim 128, 256 image tokens; SD3's fp16, 256
    image tokens, batch 2): with the norms handed on and without values, the transformer's output differs from the
    one with every norm its own kernel and its values written by less than half the tier's own error against stock.
    Not bit for bit as on the CPU: the text stream's rows stay on our GEMM (fewer than ``TORCH_GEMM_ROWS``), whose
    epilogue adds the gated residual to the fp32 accumulator; handed on, that GEMM's output is rounded to the model's
    dtype before the norm's kernel adds it (as torch's GEMM path, which the image rows take, always rounds it), and a
    rounding that moves can flip an e4m3 code, which the next blocks carry on. A norm made from the wrong block's
    modulation or a stale stream would be far off. Measured on an H200 (2026-12-02): FLUX 4.3e-3 against the tier's
    9.6e-3, SD3 3.0e-4 against 3.2e-3; the two kernels' h and codes equal bit for bit on the same inputs; in fp32 the
    outputs equal."""
    from sd_kernels.testing import rel_err

    changes, dtype, inputs = _GPU_CONFIGS[name]
    model = _model(name)
    torch.manual_seed(0)
    model = type(model).from_config({**model.config, **changes}).to("cuda", dtype).eval().requires_grad_(False)
    x, kw = inputs(model)
    cast = lambda v: v.to("cuda", dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v  # noqa: E731
    x, kw = cast(x), {k: cast(v) for k, v in kw.items()}

    def call():
        with torch.no_grad():
            return model(x, **kw, return_dict=False)[0].float()

    stock = call()
    outs = {}
    with sd_kernels.patched(model, precision="fp8", cuda_graph=False):
        for on in (False, True):
            monkeypatch.setattr(codes_readers, "CODES_ONLY", on)
            monkeypatch.setattr(dit_handoff, "HAND_ON", on)
            values_asked.clear()
            outs[on] = call()
            assert _counts(values_asked)["handed"] == _norms(model, name, handed=on)["handed"], values_asked
    tier, apart = rel_err(outs[False], stock), rel_err(outs[True], outs[False])
    print(f"{name}: handed on, codes only against every norm its own, values written: {apart:.2e}; "
          f"the tier: {tier:.2e}")
    assert torch.isfinite(outs[True]).all() and apart < 0.5 * tier, (apart, tier)
