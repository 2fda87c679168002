"""Edge inputs get torch's result or torch's error (never a silently wrong result): integer
inputs, empty tensors, a zero head dim, a 0-d GEGLU input; and the reference attention (the oracle
and the fallback) keeps torch's NaN semantics and does not overflow half-precision scores."""

import importlib

import pytest
import torch
import torch.nn.functional as F

from sd_kernels import ops, reference

attention = importlib.import_module("sd_kernels.ops.attention").attention
ATTENTION_OPS = {"attention": attention, "flash_attention": ops.flash_attention,
                 "partial_softmax_attention": ops.partial_softmax_attention}


@pytest.mark.parametrize("name", ATTENTION_OPS)
def test_integer_inputs_raise_torchs_error(name):
    q = torch.ones(1, 1, 4, 8, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="expected scalar type Float but found Long") as stock:
        F.scaled_dot_product_attention(q, q, q)
    with pytest.raises(RuntimeError, match="expected scalar type Float but found Long"):
        ATTENTION_OPS[name](q, q, q)
    assert "Long" in str(stock.value)


@pytest.mark.parametrize("name", ATTENTION_OPS)
@pytest.mark.parametrize("shape_q, shape_v", [((0, 1, 4, 8), (0, 1, 4, 8)), ((1, 1, 4, 0), (1, 1, 4, 0)),
                                              ((1, 1, 0, 8), (1, 1, 5, 8))])
def test_empty_inputs_and_a_zero_head_dim_give_torchs_result(name, shape_q, shape_v):
    q = torch.randn(shape_q)
    k = torch.randn(*shape_v[:-1], shape_q[-1])
    v = torch.randn(shape_v)
    want = F.scaled_dot_product_attention(q, k, v)
    got = ATTENTION_OPS[name](q, k, v)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, equal_nan=True)


def test_softmax_matmul_of_an_empty_batch_is_empty():
    x, w = torch.randn(0, 4, 5), torch.randn(0, 5, 3)
    got = ops.softmax_matmul(x, w)
    assert got.shape == (0, 4, 3)


def test_linear_geglu_without_input_features_is_the_bias_through_geglu():
    x, w, b = torch.randn(3, 0), torch.randn(8, 0), torch.randn(8)
    h = F.linear(x, w, b)
    torch.testing.assert_close(ops.linear_geglu(x, w, b), reference.geglu(h))


def test_geglu_of_a_0d_tensor_raises_torchs_error():
    with pytest.raises(RuntimeError, match="chunk expects at least a 1-dimensional tensor"):
        ops.geglu(torch.tensor(1.0))


def test_reference_attention_does_not_overflow_half_scores():
    """Scores past fp16's 65504: SDPA accumulates them in float32 and stays finite, so does the
    reference (it returned finite wrong values after turning the overflow's NaN into zeros)."""
    torch.manual_seed(0)
    q, k, v = ((torch.randn(1, 1, 8, 512) * 250).half(), (torch.randn(1, 1, 8, 512) * 250).half(),
               torch.randn(1, 1, 8, 512).half())
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    got = reference.attention(q, k, v)
    assert got.isfinite().all()
    assert (got.double() - want).abs().max() < 1e-2


def test_reference_attention_keeps_nan_and_zeroes_only_fully_masked_rows():
    q, k, v = torch.randn(1, 1, 3, 4), torch.randn(1, 1, 5, 4), torch.randn(1, 1, 5, 4)
    mask = torch.ones(1, 1, 3, 5, dtype=torch.bool)
    mask[..., 1, :] = False  # row 1 attends to nothing
    got = reference.attention(q, k, v, mask)
    assert torch.equal(got[0, 0, 1], torch.zeros(4)) and got[0, 0, [0, 2]].isfinite().all()
    k_nan = k.clone()
    k_nan[..., 2, 0] = float("nan")
    assert reference.attention(q, k_nan, v).isnan().all()  # every query meets the NaN key, as in torch
    assert F.scaled_dot_product_attention(q, k_nan, v).isnan().all()


def test_partial_softmax_fp16_scores_beyond_fp16_range_stay_finite(device):
    """fp16 q·kᵀ beyond 65504 (a VAE's 512-dim heads can get there): SDPA keeps the scores in fp32 and
    stays finite; so must the partial softmax (it used to store them in fp16: 3072 NaN of 4096)."""
    _check_fp16_score_overflow(device)


@pytest.mark.gpu
def test_gpu_partial_softmax_fp16_scores_beyond_fp16_range_stay_finite():
    """The same on CUDA, where the scores come from cuBLAS's fp16 GEMM with an fp32 output (not from
    fp32 copies of q and k: the fallback for a torch without that GEMM)."""
    _check_fp16_score_overflow("cuda")
    sm = importlib.import_module("sd_kernels.ops.softmax_matmul")
    assert not sm._MIXED_GEMM_FAILED, sm._MIXED_GEMM_FAILED


def _check_fp16_score_overflow(device):
    g = torch.Generator().manual_seed(0)
    q, k = ((torch.randn(1, 1, 8, 512, generator=g) * 250).half().to(device) for _ in range(2))
    v = torch.randn(1, 1, 8, 512, generator=g).half().to(device)
    ours = ops.partial_softmax_attention(q, k, v)
    assert torch.isfinite(F.scaled_dot_product_attention(q, k, v)).all()
    assert torch.isfinite(ours).all()
    want = reference.attention(*(t.double() for t in (q, k, v)))
    torch.testing.assert_close(ours.double(), want, rtol=2e-2, atol=2e-2)
