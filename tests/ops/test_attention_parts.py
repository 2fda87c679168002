"""attention_lse and merge_attention (ops/attention_parts.py: attention over keys that arrive in parts, the
ring exchange's): each against float64, the parts merged against one attention over all keys, at odd
token counts (77, 333), head dims 40/64/80/128, fp32/fp16/bf16, the [B, S, H, D] memory of diffusers'
processors seen as [B, H, S, D] views and keys and values as strided views of one [B, S, 2, H, D] buffer.
CPU: merge's kernel through the interpreter (attention_lse is then the float32 reference); GPU: cuDNN's
attention through its ATen op, and the kernel compiled."""

import pytest
import torch

from sd_kernels import reference
from sd_kernels.ops import attention_lse, merge_attention
from sd_kernels.testing import UNIT_ROUNDOFF

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _inputs(b, h, sq, sk, d, dtype, device, seed=0):
    """q as the [B, H, Sq, D] view of [B, Sq, H, D]; k and v as views of one [B, Sk, 2, H, D] buffer."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, h, d, generator=g).to(device, dtype).permute(0, 2, 1, 3)
    kv = (torch.randn(b, sk, 2, h, d, generator=g) * 1.5).to(device, dtype)
    return q, kv[:, :, 0].permute(0, 2, 1, 3), kv[:, :, 1].permute(0, 2, 1, 3)


def _exact(q, k, v):
    return reference.attention_lse(q.double(), k.double(), v.double())


def _stock_error(q, k, v, want):
    """What PyTorch's fused attention makes of it at q's dtype."""
    got = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    return (got.double() - want).abs().max().item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sq, sk, d", [(77, 77, 64), (40, 333, 80), (64, 200, 40), (96, 160, 128)])
def test_attention_lse_is_attention_and_its_log_sum_exp(dtype, sq, sk, d, device):
    if device == "cpu" and dtype != torch.float32:
        pytest.skip("on the CPU attention_lse is the float32 reference: its half-precision inputs add nothing")
    q, k, v = _inputs(2, 3, sq, sk, d, dtype, device)
    out, lse = attention_lse(q, k, v)
    want, want_lse = _exact(q, k, v)
    assert out.shape == (2, 3, sq, d) and out.dtype == dtype and lse.shape == (2, 3, sq) and lse.dtype == torch.float32
    tol = max(4 * _stock_error(q, k, v, want), 4 * UNIT_ROUNDOFF[dtype])
    assert (out.double() - want).abs().max().item() <= tol
    assert (lse.double() - want_lse).abs().max().item() <= 1e-3 * want_lse.abs().max().item() + 1e-4


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [(50,), (30, 100), (1, 2, 200)])
def test_parts_merged_are_attention_over_all_keys(dtype, splits, device):
    """Keys split into 2–4 parts (one of a single key), merged in a chain (fp32 between, the last in the
    input dtype): within a few times stock's own error of float64 attention over all of them."""
    sk = 333
    q, k, v = _inputs(1, 4, 77, sk, 64, dtype, device, seed=1)
    bounds = [0, *splits, sk]
    acc = None
    for lo, hi in zip(bounds, bounds[1:]):
        part = attention_lse(q, k[:, :, lo:hi], v[:, :, lo:hi])
        acc = part if acc is None else merge_attention(acc, part, dtype if hi == sk else torch.float32)
    out, lse = acc
    want, want_lse = _exact(q, k, v)
    assert out.dtype == dtype and out.stride(1) < out.stride(2)  # heads inner, as q's memory
    tol = max(4 * _stock_error(q, k, v, want), 4 * UNIT_ROUNDOFF[dtype])
    assert (out.double() - want).abs().max().item() <= tol
    assert (lse.double() - want_lse).abs().max().item() <= 1e-4 * want_lse.abs().max().item() + 1e-5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [40, 128])
def test_merge_kernel_is_the_float64_merge(dtype, d, device):
    """The kernel against the reference merge in float64 of the same parts: one rounding of the result."""
    g = torch.Generator().manual_seed(2)
    parts = [((torch.randn(2, 17, 3, d, generator=g)).to(device, dtype).permute(0, 2, 1, 3),
              (torch.randn(2, 3, 17, generator=g) * 4).to(device)) for _ in range(2)]
    out, lse = merge_attention(*parts)
    want, want_lse = reference.merge_attention(*[(o.double(), la.double()) for o, la in parts])
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert (out.double() - want).abs().max().item() <= 2 * UNIT_ROUNDOFF[dtype] * want.abs().max().item()
    assert (lse.double() - want_lse).abs().max().item() <= 1e-6 * want_lse.abs().max().item()
    wide, _ = merge_attention(*parts, dtype=torch.float32)
    assert wide.dtype == torch.float32


def test_a_row_with_no_key_in_either_part_is_zero_not_nan(device):
    """Both log-sum-exps −∞ (a query with no key in either part): output 0, log-sum-exp −∞; the other rows
    merge as usual."""
    o = torch.ones(1, 2, 3, 8, device=device, dtype=torch.float16)
    lse = torch.zeros(1, 2, 3, device=device)
    lse[0, 1, 2] = float("-inf")
    out, merged = merge_attention((o, lse), (2 * o, lse.clone()))
    want, want_lse = reference.merge_attention((o.double(), lse.double()), (2 * o.double(), lse.double()))
    assert not out.isnan().any() and out[0, 1, 2].abs().max().item() == 0 and merged[0, 1, 2].item() == float("-inf")
    assert torch.equal(out.double(), want)
    torch.testing.assert_close(merged.double(), want_lse, rtol=1e-6, atol=0)  # −∞ where −∞, log 2 elsewhere
    assert out[0, 0, 0, 0].item() == 1.5


def test_bad_arguments_are_clear_errors(device):
    q, k, v = _inputs(1, 2, 8, 8, 16, torch.float32, device)
    with pytest.raises(ValueError, match="must be \\[B, H, S, D\\]"):
        attention_lse(q[0], k, v)
    with pytest.raises(ValueError, match="do not fit"):
        attention_lse(q, k[:, :1], v)
    out, lse = attention_lse(q, k, v)
    with pytest.raises(ValueError, match="of one shape"):
        merge_attention((out, lse), (out[:, :, :4], lse[:, :, :4]))
