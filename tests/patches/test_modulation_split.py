"""patches/modulation_split.py: FLUX's adaLN modulation products, 1/W a process under context parallelism.

The two-process split (ring and Ulysses, equal to one process) is in test_parallel.py. Here, on a
one-process group: each norm's columns of the shared result equal its own product; the result is
computed once per embedding (object and version) and anew for another; autograd, torch.compile and
norms never enabled compute their own; a split the processes do not divide is a clear error."""

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
