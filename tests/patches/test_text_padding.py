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


def _run(pipe, **kwargs):
    return pipe(prompt="a cat", num_inference_steps=2, height=64, width=64, output_type="pt",
                use_resolution_binning=False, generator=torch.Generator().manual_seed(0), **kwargs).images


def _tokens_seen(pipe, **kwargs) -> tuple[torch.Tensor, set[int]]:
    seen: set[int] = set()
    hook = pipe.transformer.register_forward_pre_hook(
        lambda _m, _a, kw: seen.add(kw["encoder_hidden_states"].shape[1]), with_kwargs=True)
    try:
        return _run(pipe, **kwargs), seen
    finally:
        hook.remove()


@pytest.fixture
def stock_attention():
    """Every attention on stock SDPA: what changes is only how many tokens reach it."""
    return dataclasses.replace(profiles.get_profile("cpu"), attention="sdpa")


def test_padding_cut_gives_stock_images(pipe, stock_attention):
    stock, seen = _tokens_seen(pipe)
    assert seen == {300}
    with sd_kernels.patched(pipe, ops=["attention"], profile=stock_attention) as record:
        assert record.counts[text_padding.KIND] == 1
        trimmed, seen = _tokens_seen(pipe)
        assert seen == {64}
        torch.testing.assert_close(trimmed, stock, rtol=1e-5, atol=1e-5)
        # a negative prompt longer than the prompt sets the length for both
        negative = " ".join(["blurry"] * 20)
        assert 64 < len(pipe.tokenizer(negative).input_ids) <= 128
        _, seen = _tokens_seen(pipe, negative_prompt=negative)
        assert seen == {128}
    assert "encode_prompt" not in vars(pipe)
    assert _tokens_seen(pipe)[1] == {300}


def test_reference_backend_and_other_families_keep_the_padding(pipe, monkeypatch):
    with sd_kernels.patched(pipe, ops=["gelu"]) as record:
        assert text_padding.KIND not in record.counts and "encode_prompt" not in vars(pipe)
    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    with sd_kernels.patched(pipe, ops=["attention"]):
        assert _tokens_seen(pipe)[1] == {300}


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
