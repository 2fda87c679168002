"""patches/modulation_split.py: FLUX's adaLN modulation products, 1/W a process under context parallelism.

The two-process split (ring and Ulysses, equal to one process) is in test_parallel.py. Here, on a
one-process group: each norm's columns of the shared result equal its own product; the result is
computed once per embedding (object and version) and anew for another; autograd, torch.compile and
norms never enabled compute their own; a split the processes do not divide is a clear error. The blocks' shared
SiLU of the step embedding (``silu``, on one GPU too)."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from sd_kernels.patches import modulation_split

from sd_kernels import models


@pytest.fixture
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _norms():
    from diffusers.models.normalization import AdaLayerNormZero, AdaLayerNormZeroSingle

    transformer = models.build_model("tiny-flux", "transformer")
    return [m for m in transformer.modules() if type(m) in (AdaLayerNormZero, AdaLayerNormZeroSingle)]


@pytest.mark.skipif(not dist.is_gloo_available(), reason="needs torch.distributed with the gloo backend")
def test_each_norm_gets_its_own_product_computed_once_per_embedding(group, monkeypatch):
    norms = _norms()
    modulation_split.enable(norms, group)
    calls = []
    compute = modulation_split._Split._compute
    monkeypatch.setattr(modulation_split._Split, "_compute", lambda self, emb: calls.append(1) or compute(self, emb))
    emb = torch.randn(2, norms[0].linear.in_features)
    with torch.no_grad():
        for n in norms:
            got = modulation_split.product(n, emb)
            torch.testing.assert_close(got, n.linear(F.silu(emb)), rtol=1e-6, atol=1e-6)
        assert len(calls) == 1
        modulation_split.product(norms[0], emb.clone())  # another embedding: computed anew
        emb.mul_(2)  # the same object changed in place: anew
        torch.testing.assert_close(modulation_split.product(norms[-1], emb), norms[-1].linear(F.silu(emb)),
                                   rtol=1e-6, atol=1e-6)
        assert len(calls) == 3
        assert modulation_split.product(torch.nn.Linear(2, 2), emb) is None  # never enabled
        replaced = norms[1].linear
        norms[1].linear = torch.nn.Linear(replaced.in_features, replaced.out_features)
        assert modulation_split.product(norms[1], emb) is None  # its linear replaced since
        norms[1].linear = replaced
    assert modulation_split.product(norms[0], emb) is None  # autograd on
    with torch.inference_mode():  # inference tensors keep no version counter: the object alone decides
        emb = torch.randn(1, norms[0].linear.in_features)
        torch.testing.assert_close(modulation_split.product(norms[0], emb), norms[0].linear(F.silu(emb)),
                                   rtol=1e-6, atol=1e-6)
        modulation_split.product(norms[1], emb)
        assert len(calls) == 4
        modulation_split.disable(norms)  # each computes its own again
        assert modulation_split.product(norms[0], emb) is None and not modulation_split.covers(norms[0])


def test_the_fp8_tiers_norms_are_named_when_split_modulation_is_asked_for():
    """After patch(precision="fp8") FLUX's block norms are the FP8 tier's own: the split names why it cannot
    take them (rather than finding no norms)."""
    from sd_kernels.patches import context_parallel_plans

    import sd_kernels

    transformer = models.build_model("tiny-flux", "transformer")
    assert len(context_parallel_plans._block_norms(transformer, "FluxTransformer2DModel", 2)) > 0
    with sd_kernels.patched(transformer, precision="fp8", cuda_graph=False):
        with pytest.raises(ValueError, match="the FP8 tier, patch\\(pipe, precision='fp8'\\), replaces them"):
            context_parallel_plans._block_norms(transformer, "FluxTransformer2DModel", 2)


def test_a_split_the_processes_do_not_divide_is_named():
    norms = _norms()
    cols = norms[0].linear.out_features
    assert modulation_split.reason(norms, 1) is None
    assert f"7 processes do not divide AdaLayerNormZero's {cols} modulation columns" in modulation_split.reason(
        norms, 7)
    assert "has no nn.Linear 'linear'" in modulation_split.reason([torch.nn.LayerNorm(4)], 2)


def test_the_blocks_share_one_silu_of_an_embedding_until_either_changes():
    """``silu``: the first norm's SiLU of an embedding serves every later norm while neither the embedding nor
    that SiLU has changed in place; an in-place ``nn.SiLU``, another activation, autograd and inference tensors
    compute their own, each equal to the norm's own SiLU."""
    norms = _norms()
    emb = torch.randn(2, norms[0].linear.in_features)
    with torch.no_grad():
        first = modulation_split.silu(norms[0], emb)
        assert torch.equal(first, F.silu(emb))
        assert all(modulation_split.silu(n, emb) is first for n in norms[1:])
        first.add_(1)  # the shared SiLU changed in place: made again
        again = modulation_split.silu(norms[1], emb)
        assert again is not first and torch.equal(again, F.silu(emb))
        emb.mul_(2)  # the embedding changed in place
        assert torch.equal(modulation_split.silu(norms[1], emb), F.silu(emb))
        inplace = type(norms[0])(norms[0].linear.in_features)  # a norm whose SiLU works in place
        inplace.silu = torch.nn.SiLU(inplace=True)
        other = emb.clone()
        assert torch.equal(modulation_split.silu(inplace, other), F.silu(emb))
        assert not hasattr(other, "_sd_kernels_silu")
    x = torch.randn(2, norms[0].linear.in_features, requires_grad=True)
    assert modulation_split.silu(norms[0], x) is not modulation_split.silu(norms[1], x)  # autograd: its own
    with torch.inference_mode():
        y = torch.randn(2, norms[0].linear.in_features)
        assert modulation_split.silu(norms[0], y) is not modulation_split.silu(norms[1], y)
