"""T5's encoder on sd_kernels' kernels (patches/t5_encoder.py): against float64 with stock's error as the
yardstick, masks as transformers' SDPA path combines them, the calls handed back to transformers, the join
broken while patched, ops= and ignore=, an unverified source left alone, and unpatch exact.

CPU: fp32 and fp16 (the interpreter's bf16 dots are garbage: ../shared/gpu/README.md); GPU (-m gpu): bf16 and
fp16 at T5-XXL's head dim 64 and 512 tokens."""

import copy

import pytest
import torch
import transformers
from sd_kernels.patches import diffusers_sources, patch, t5_encoder, unpatch
from sd_kernels.patches.record import PatchRecord

from sd_kernels import models
from sd_kernels.testing import assert_close_to_reference

CLASSES = ("T5LayerNorm", "T5DenseGatedActDense", "T5Attention")


def _encoder(dtype=torch.float32, heads=4, d_kv=8, layers=2, act="gated-gelu"):
    """A tiny T5 encoder as the pipelines hold it (eval, relative attention bias in block 0)."""
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=64, d_model=heads * d_kv, d_kv=d_kv, num_heads=heads, num_layers=layers,
                                   d_ff=48, feed_forward_proj=act, dropout_rate=0.0)
    return transformers.T5EncoderModel(config).to(dtype).eval()


def _patch(encoder, ops=("attention", "gelu", "layer_norm"), **kwargs) -> PatchRecord:
    record = PatchRecord(tuple(ops), "cpu", [], **kwargs)
    t5_encoder.patch_t5(encoder, record)
    return record


def _classes(encoder) -> dict[str, int]:
    """How many modules of each T5 class carry our forward."""
    found = dict.fromkeys(CLASSES, 0)
    for m in encoder.modules():
        if vars(type(m)).get("_sd_kernels_t5"):
            found[type(m).__name__] += 1
    return found


def _ids(tokens=11, batch=1):
    return torch.randint(2, 64, (batch, tokens), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_patched_encoder_is_within_stock_rounding_and_unpatch_is_exact(dtype):
    _check_patched(_encoder(dtype), _ids())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_patched_encoder_at_t5_xxl_head_dim(dtype):
    """Compiled kernels, bf16 dots: 8 heads of 64 (T5-XXL's head dim), 512 tokens (FLUX's prompt length)."""
    _check_patched(_encoder(dtype, heads=8, d_kv=64).cuda(), _ids(tokens=512).cuda())


def _check_patched(encoder, ids):
    params = encoder.state_dict(keep_vars=True)
    with torch.no_grad():
        stock = encoder(ids)[0]
        ref64 = copy.deepcopy(encoder).double()(ids)[0]
        record = _patch(encoder)
        assert _classes(encoder) == {"T5LayerNorm": 5, "T5DenseGatedActDense": 2, "T5Attention": 2}
        assert record.counts == {"t5.rms_norm": 5, "t5.feed_forward": 2, "t5.attention": 2}
        ours = encoder(ids)[0]
        assert_close_to_reference(ours, stock, ref64)
        now = encoder.state_dict(keep_vars=True)  # the same Parameters under the same keys
        assert now.keys() == params.keys() and all(now[k] is params[k] for k in params)
        record.undo()
        assert _classes(encoder) == dict.fromkeys(CLASSES, 0)
        assert torch.equal(encoder(ids)[0], stock)
    for m in encoder.modules():  # each weight back in storage of its own
        if isinstance(m, torch.nn.Linear):
            assert m.weight.untyped_storage().nbytes() == m.weight.numel() * m.weight.element_size()


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_padding_mask_as_transformers_combines_it(implementation):
    """A batch of two prompts, the second padded: its mask reaches the attention as transformers makes it for
    the implementation (a boolean mask for SDPA, an additive one for eager), combined with the bias."""
    encoder = _encoder()
    encoder.config._attn_implementation = implementation
    ids = _ids(batch=2)
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, 7:] = 0
    with torch.no_grad():
        stock = encoder(ids, attention_mask=mask)[0]
        ref64 = copy.deepcopy(encoder).double()(ids, attention_mask=mask)[0]
        _patch(encoder)
        ours = encoder(ids, attention_mask=mask)[0]
    assert_close_to_reference(ours, stock, ref64)


def test_calls_the_patch_does_not_serve_take_transformers_forward(monkeypatch):
    """Autograd and training run transformers' own forward (the others: the test below)."""
    encoder = _encoder()
    ids = _ids()
    _patch(encoder)
    calls = []
    attention_cls = type(encoder.encoder.block[0].layer[0].SelfAttention).__mro__[2]
    stock_forward = attention_cls.forward
    monkeypatch.setattr(attention_cls, "forward", lambda self, *a, **k: calls.append(1) or stock_forward(self, *a, **k))
    with torch.no_grad():
        encoder(ids)
    assert calls == []
    encoder(ids)  # autograd on
    assert len(calls) == 2
    encoder.train()
    with torch.no_grad():
        encoder(ids)
    assert len(calls) == 4


def test_a_broken_join_takes_the_separate_projections():
    """A weight assigned anew while patched leaves the layout: the call takes the module's own Linears and
    stays right (the new weight counts)."""
    encoder = _encoder()
    ids = _ids()
    _patch(encoder)
    attn = encoder.encoder.block[1].layer[0].SelfAttention
    ff = encoder.encoder.block[1].layer[1].DenseReluDense
    with torch.no_grad():
        attn.k.weight = torch.nn.Parameter(attn.k.weight * 2)
        ff.wi_0.weight = torch.nn.Parameter(ff.wi_0.weight * 0.5)
        ours = encoder(ids)[0]
        record_free = copy.deepcopy(_encoder())
        record_free.load_state_dict(encoder.state_dict())
        stock = record_free(ids)[0]
    torch.testing.assert_close(ours, stock, rtol=1e-5, atol=1e-5)


def test_ops_choose_the_modules():
    encoder = _encoder()
    _patch(encoder, ops=("layer_norm",))
    assert _classes(encoder) == {"T5LayerNorm": 5, "T5DenseGatedActDense": 0, "T5Attention": 0}


def test_other_activation_and_unverified_source_are_left_alone(monkeypatch):
    encoder = _encoder(act="gated-silu")
    record = _patch(encoder)
    assert _classes(encoder)["T5DenseGatedActDense"] == 0
    assert any("not the tanh GELU" in s.reason for s in record.skipped)

    monkeypatch.setitem(diffusers_sources.TRANSFORMERS_VERIFIED, "T5Attention.forward", ("0" * 16,))
    diffusers_sources.is_verified.cache_clear()
    try:
        encoder = _encoder()
        record = _patch(encoder)
        assert _classes(encoder)["T5Attention"] == 0 and _classes(encoder)["T5LayerNorm"] == 5
        assert any("T5Attention.forward is not the transformers source" in s.reason for s in record.skipped)
    finally:
        monkeypatch.undo()
        diffusers_sources.is_verified.cache_clear()


def test_pipeline_patch_reaches_its_t5_unless_ignored():
    pipe = models.build_pipeline("tiny-flux")
    encoder = pipe.text_encoder_2
    ids = _ids()
    with torch.no_grad():
        stock = encoder(ids)[0]
        record = patch(pipe, cuda_graph=False)
        assert record.counts["t5.attention"] == 2 and record.counts["t5.rms_norm"] == 5
        assert "t5.attention" in record.format()
        torch.testing.assert_close(encoder(ids)[0], stock, rtol=1e-4, atol=1e-4)
        unpatch(pipe)
        assert torch.equal(encoder(ids)[0], stock)
        record = patch(pipe, cuda_graph=False, ignore=["text_encoder_2"])
        assert not any(k.startswith("t5.") for k in record.counts)
        unpatch(pipe)


def test_bias_and_mask_combined_once_a_call(monkeypatch):
    """Every block gets the same bias and mask: their sum is made by the first and kept for the others, and
    made again for a mask changed in place."""
    encoder = _encoder(layers=3)
    ids = _ids(batch=2)
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, 7:] = 0
    _patch(encoder)
    made = []
    combine = t5_encoder._with_mask
    monkeypatch.setattr(t5_encoder, "_with_mask", lambda *a: made.append(1) or combine(*a))
    with torch.no_grad():
        first = encoder(ids, attention_mask=mask)[0]
        assert len(made) == 1
        bias = torch.zeros(1, 4, 11, 11)
        m = torch.ones(2, 1, 11, 11, dtype=torch.bool)
        a = t5_encoder._masked_bias(bias, m)
        m[1, ..., 7:] = False  # in place: a new version
        b = t5_encoder._masked_bias(bias, m)
        assert torch.equal(a, bias.expand(2, 4, 11, 11)) and not torch.equal(a, b)
        assert torch.equal(encoder(ids, attention_mask=mask)[0], first)


def test_compile_patches_without_the_joins():
    """Under ``compile=`` the joins are left out (their guard reads data pointers; the compiled call is traced as
    the test below traces one) and the feed-forwards keep transformers' forward."""
    encoder = _encoder()
    record = _patch(encoder, compile="default")
    assert record.counts == {"t5.rms_norm": 5, "t5.attention": 2}
    assert sum("not joined: compile=True" in s.reason for s in record.skipped) == 4


@pytest.mark.integration
@pytest.mark.parametrize("case", ["flex_attention", "config_output_attentions", "output_attentions"])
def test_implementations_and_weights_the_patch_does_not_take_go_to_transformers(case):
    """Flex attention (its BlockMask) and attention weights asked for, by argument or by the config, run
    transformers' attention: outputs and weights as stock's, up to the norms' and feed-forwards' rounding."""
    encoder = _encoder()
    ids = _ids()
    kwargs = {}
    if case == "flex_attention":
        encoder.config._attn_implementation = "flex_attention"
    elif case == "config_output_attentions":
        encoder.config._attn_implementation = "eager"
        encoder.config.output_attentions = True
    else:
        encoder.config._attn_implementation = "eager"
        kwargs = {"output_attentions": True}
    try:
        with torch.no_grad():
            stock = encoder(ids, **kwargs)
            _patch(encoder)
            ours = encoder(ids, **kwargs)
    except Exception as exc:  # flex attention needs a torch that can run it here; the patch must not be why
        if case == "flex_attention" and "BlockMask" not in str(exc):
            pytest.skip(f"flex attention does not run on this machine: {type(exc).__name__}: {exc}")
        raise
    torch.testing.assert_close(ours[0], stock[0], rtol=1e-4, atol=1e-5)  # the norms and feed-forwards are ours
    if case != "flex_attention":  # the weights come back: transformers' attention ran
        assert len(ours.attentions) == len(stock.attentions) == 2
        for a, b in zip(ours.attentions, stock.attentions):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_traced_calls_take_the_separate_projections():
    """A user's torch.compile of the patched encoder (patched without compile=) traces the whole graph: the joins,
    whose guard reads data pointers, step aside in traced calls."""
    encoder = _encoder()
    ids = _ids()
    with torch.no_grad():
        stock = encoder(ids)[0]
        _patch(encoder)
        torch._dynamo.reset()
        try:
            compiled = torch.compile(encoder, fullgraph=True)(ids)[0]
        finally:
            torch._dynamo.reset()
    torch.testing.assert_close(compiled, stock, rtol=1e-5, atol=1e-5)


def test_an_encoder_already_patched_through_another_pipeline_is_left_alone():
    encoder = _encoder()
    _patch(encoder)
    record = _patch(encoder)
    assert not record.counts
    assert any("already patched through another pipeline" in s.reason for s in record.skipped)
