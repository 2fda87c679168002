"""PixArt's cross-attention over the prompt's tokens (patches/text_padding.py): which tokens the masks
let go, the pipeline's images unchanged with the padding cut, and every case that keeps it whole."""

import dataclasses

import pytest
import torch
from dit_checks import tiny_pipeline
from sd_kernels.patches import text_padding
from sd_kernels.patches.text_padding import kept_tokens

import sd_kernels
from sd_kernels import profiles


def _mask(*lengths, tokens=300):
    m = torch.zeros(len(lengths), tokens, dtype=torch.int64)
    for row, n in enumerate(lengths):
        m[row, :n] = 1
    return m


@pytest.mark.parametrize(("lengths", "want"), [
    ((7, 1), 64), ((64,), 64), ((65, 3), 128), ((256, 1), 256), ((257,), None), ((300, 2), None)])
def test_kept_tokens_rounds_the_last_attended_token_up(lengths, want):
    assert kept_tokens((_mask(*lengths), None)) == want


def test_kept_tokens_reads_every_row_of_both_masks():
    assert kept_tokens((_mask(5), _mask(130))) == 192
    holes = _mask(3)
    holes[0, 100] = 1  # a token attended to after padding: kept, with what lies before it
    assert kept_tokens((holes,)) == 128
    assert kept_tokens((_mask(5).bool(), _mask(2).bool())) == 64


@pytest.mark.parametrize("case", ["no row", "empty row", "fractional", "3-d", "lengths differ", "no tokens"])
def test_kept_tokens_keeps_all_where_cutting_could_change_a_value(case):
    masks = {
        "no row": (None, None),
        "empty row": (_mask(5, 0),),  # stock spreads a row with no token over every key, padding included
        "fractional": (_mask(5).float() * 0.5,),
        "3-d": (_mask(5)[:, None],),
        "lengths differ": (_mask(5), _mask(5, tokens=120)),
        "no tokens": (_mask(0, tokens=0),),
    }[case]
    assert kept_tokens(masks) is None


# The pipeline: the tiny PixArt-Σ at its default 300 tokens, a short prompt.


@pytest.fixture(scope="module")
def pipe():
    return tiny_pipeline("tiny-pixart")


def _run(pipe, prompt="a cat", **kwargs):
    return pipe(prompt=prompt, num_inference_steps=2, height=64, width=64, output_type="pt",
                use_resolution_binning=False, generator=torch.Generator().manual_seed(0), **kwargs).images


def _tokens_seen(pipe, **kwargs) -> tuple[torch.Tensor, set[int], set[int]]:
    """The images, and the token counts the transformer's cross-attention and the T5 encoder saw."""
    seen: set[int] = set()
    encoded: set[int] = set()
    hooks = (pipe.transformer.register_forward_pre_hook(
        lambda _m, _a, kw: seen.add(kw["encoder_hidden_states"].shape[1]), with_kwargs=True),
        pipe.text_encoder.register_forward_pre_hook(lambda _m, a: encoded.add(a[0].shape[1])))
    try:
        return _run(pipe, **kwargs), seen, encoded
    finally:
        for hook in hooks:
            hook.remove()


@pytest.fixture
def stock_attention():
    """Every attention on stock SDPA: what changes is only how many tokens reach it."""
    return dataclasses.replace(profiles.get_profile("cpu"), attention="sdpa")


def test_padding_cut_gives_stock_images(pipe, stock_attention):
    stock, seen, encoded = _tokens_seen(pipe)
    assert seen == encoded == {300}
    with sd_kernels.patched(pipe, ops=["attention"], profile=stock_attention) as record:
        assert record.counts[text_padding.KIND] == 2  # encode_prompt's wrapper, the T5 encoder's hooks
        trimmed, seen, encoded = _tokens_seen(pipe)
        assert seen == encoded == {64}  # the prompt and the empty negative prompt: 64 tokens each
        torch.testing.assert_close(trimmed, stock, rtol=1e-5, atol=1e-5)
        # a negative prompt longer than the prompt sets the length for both; T5 cuts each call by its own
        negative = " ".join(["blurry"] * 20)
        assert 64 < len(pipe.tokenizer(negative).input_ids) <= 128
        _, seen, encoded = _tokens_seen(pipe, negative_prompt=negative)
        assert seen == {128} and encoded == {64, 128}
    assert "encode_prompt" not in vars(pipe)
    assert not pipe.text_encoder._forward_pre_hooks and not pipe.text_encoder._forward_hooks
    assert _tokens_seen(pipe)[1:] == ({300}, {300})


def _encoded(pipe, negative):
    return pipe.encode_prompt("a cat", negative_prompt=negative, device="cpu", clean_caption=False)


def test_encode_prompt_keeps_stock_values_where_any_row_attends(pipe, stock_attention):
    """T5 over the prompt's tokens: the embeddings are stock's at every attended token; the padding a
    longer negative prompt keeps in the prompt's row is zeros (masked, so weighted 0)."""
    negative = " ".join(["blurry"] * 20)
    with torch.no_grad():
        stock = _encoded(pipe, negative)
        with sd_kernels.patched(pipe, ops=["attention"], profile=stock_attention):
            cut = _encoded(pipe, negative)
    assert [t.shape[1] for t in cut] == [128] * 4
    for embeds, stock_embeds, mask in ((cut[0], stock[0], cut[1]), (cut[2], stock[2], cut[3])):
        attended = mask[0].bool()
        torch.testing.assert_close(embeds[0, attended], stock_embeds[0, :128][attended], rtol=1e-5, atol=1e-5)
    assert torch.equal(cut[1], stock[1][:, :128]) and torch.equal(cut[3], stock[3][:, :128])
    assert not cut[0][0, 64:].any()  # past the prompt's own 64: zeros up to the negative's length
    assert int(cut[1].sum()) < 64 < int(cut[3].sum())


def test_text_encoder_runs_whole_outside_encode_prompt_and_when_ignored(pipe, stock_attention):
    ids = pipe.tokenizer("a cat", padding="max_length", max_length=300, return_tensors="pt")
    with torch.no_grad():
        stock = pipe.text_encoder(ids.input_ids, attention_mask=ids.attention_mask)[0]
        with sd_kernels.patched(pipe, ops=["attention"], profile=stock_attention):
            assert torch.equal(pipe.text_encoder(ids.input_ids, attention_mask=ids.attention_mask)[0], stock)
        with sd_kernels.patched(pipe, ops=["attention"], profile=stock_attention, ignore=["text_encoder"]) as rec:
            assert rec.counts[text_padding.KIND] == 1 and not pipe.text_encoder._forward_hooks
            assert _tokens_seen(pipe)[1:] == ({64}, {300})


def test_a_cut_call_pads_tuple_and_model_outputs_back():
    """The hooks alone, on a stand-in encoder: ids and mask cut to 64, the first output padded back with
    zeros (a tuple, return_dict=False, or a ModelOutput), the rest passed through; off, nothing changes."""
    from transformers.modeling_outputs import BaseModelOutput

    tokens = text_padding.PromptTokens()
    module = type("Encoder", (), {"config": type("Config", (), {"output_hidden_states": False,
                                                                "output_attentions": False})()})()
    ids, mask = torch.arange(300)[None], _mask(7)
    assert tokens.before(module, (ids,), {"attention_mask": mask}) is None  # off
    tokens.on = True
    (cut,), kw = tokens.before(module, (ids,), {"attention_mask": mask})
    assert cut.shape == kw["attention_mask"].shape == (1, 64) and torch.equal(cut, ids[:, :64])
    hidden = torch.randn(1, 64, 8)
    padded, extra = tokens.after(module, (cut,), kw, (hidden, "extra"))
    assert padded.shape == (1, 300, 8) and torch.equal(padded[:, :64], hidden) and not padded[:, 64:].any()
    assert extra == "extra" and tokens.full is None
    tokens.before(module, (ids,), {"attention_mask": mask})
    out = tokens.after(module, (cut,), kw, BaseModelOutput(last_hidden_state=hidden))
    assert out.last_hidden_state.shape == out[0].shape == (1, 300, 8)
    assert tokens.after(module, (ids,), {}, (hidden,)) is None  # no cut pending: the output as it is
    assert tokens.before(module, (ids,), {"attention_mask": mask, "return_dict": False}) is None  # another form


def test_a_failing_encode_prompt_leaves_the_hooks_off(pipe, stock_attention):
    with sd_kernels.patched(pipe, ops=["attention"], profile=stock_attention):
        wrapper = vars(pipe)["encode_prompt"]

        def fail(_m, _a):
            assert wrapper.tokens.on
            raise RuntimeError("the encoder failed")

        hook = pipe.text_encoder.register_forward_pre_hook(fail)
        try:
            with pytest.raises(RuntimeError, match="the encoder failed"):
                _encoded(pipe, None)
        finally:
            hook.remove()
        assert not wrapper.tokens.on


def test_reference_backend_and_other_families_keep_the_padding(pipe, monkeypatch):
    with sd_kernels.patched(pipe, ops=["gelu"]) as record:
        assert text_padding.KIND not in record.counts and "encode_prompt" not in vars(pipe)
    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    with sd_kernels.patched(pipe, ops=["attention"]):
        assert _tokens_seen(pipe)[1:] == ({300}, {300})


def test_unverified_encode_prompt_is_left_alone(pipe, monkeypatch):
    monkeypatch.setitem(text_padding.is_verified.__wrapped__.__globals__["VERIFIED"],
                        "PixArtSigmaPipeline.encode_prompt", "0" * 16)
    text_padding.is_verified.cache_clear()
    try:
        with sd_kernels.patched(pipe, ops=["attention"]) as record:
            assert text_padding.KIND not in record.counts and "encode_prompt" not in vars(pipe)
            assert any("encode_prompt is not the one verified" in s.reason for s in record.skipped)
    finally:
        text_padding.is_verified.cache_clear()


@pytest.mark.gpu
def test_gpu_compiled_pipeline_over_the_prompts_tokens_matches_stock():
    """On the GPU, fp16, ``patch(pipe, compile=True)``: T5 compiled in its graphs and run over the
    prompt's 64 tokens, the transformer's cross-attention over 64 keys; then another prompt replayed
    from the same graphs, and a negative prompt that makes T5 run (and compile) at 128 tokens too; the
    images stay within inductor's reordering of stock's (the compile test's tolerance,
    tests/patches/test_cuda_graph.py)."""
    from sd_kernels.patches import cuda_graph

    from sd_kernels import models

    pipe = models.build_pipeline("tiny-pixart", device="cuda", dtype=torch.float16)
    pipe.set_progress_bar_config(disable=True)
    negative = " ".join(["blurry"] * 20)
    cases = [({}, {64}, {64}), ({"prompt": "a dog on a beach"}, {64}, {64}),  # the capture, then a replay
             ({"prompt": "a dog on a beach", "negative_prompt": negative}, {128}, {64, 128})]
    with torch.no_grad():
        stock = [_run(pipe, **kwargs) for kwargs, _, _ in cases]
        assert not torch.allclose(stock[0], stock[1], rtol=2e-2, atol=2e-2)  # a stale replay would show
        try:
            with sd_kernels.patched(pipe, cuda_graph=True, compile=True) as record:
                assert record.counts[text_padding.KIND] == 2
                graphed = vars(pipe.text_encoder)["forward"]
                assert isinstance(graphed, cuda_graph.GraphedCall) and graphed.forward is not graphed.eager_fn
                for (kwargs, attended, encoded_lengths), want in zip(cases, stock):
                    images, seen, encoded = _tokens_seen(pipe, **kwargs)
                    assert seen == attended and encoded == encoded_lengths
                    torch.testing.assert_close(images, want, rtol=2e-2, atol=2e-2)
                assert len(graphed.graphs) == 2  # T5 at 64 and at 128 tokens
        finally:
            torch._dynamo.reset()
