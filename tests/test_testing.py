"""The judging helpers must catch what they are there to catch."""

import math

import pytest
import torch

from sd_kernels import reference
from sd_kernels.testing import assert_close_to_reference, judge, non_contiguous, poison_, psnr, rel_err


def _gelu_cases(dtype):
    x = torch.randn(64, 33, dtype=dtype)
    ref64 = reference.gelu(*reference.upcast(x))
    stock = reference.gelu(x)
    return x, stock, ref64


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_stock_passes_its_own_bar(dtype):
    _, stock, ref64 = _gelu_cases(dtype)
    assert_close_to_reference(stock, stock, ref64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_an_error_of_a_few_ulps_everywhere_fails(dtype):
    _, stock, ref64 = _gelu_cases(dtype)
    wrong = (stock.double() * (1 + 16 * torch.finfo(dtype).eps)).to(dtype)
    assert not judge(wrong, stock, ref64).ok


def test_one_unwritten_element_fails():
    _, stock, ref64 = _gelu_cases(torch.float16)
    out = stock.clone()
    poison_(out.view(-1)[7:8])
    assert rel_err(out, ref64) == math.inf
    with pytest.raises(AssertionError):
        assert_close_to_reference(out, stock, ref64)


def test_wrong_dtype_or_shape_fails():
    _, stock, ref64 = _gelu_cases(torch.float16)
    with pytest.raises(AssertionError, match="dtype"):
        assert_close_to_reference(stock.float(), stock, ref64)
    with pytest.raises(AssertionError, match="shape"):
        assert_close_to_reference(stock[:-1], stock[:-1], ref64)


def test_non_contiguous_keeps_values():
    x = torch.randn(3, 5)
    y = non_contiguous(x)
    assert not y.is_contiguous() and torch.equal(x, y)


def test_psnr():
    a = torch.rand(8, 8, 3)
    assert psnr(a, a) == math.inf
    assert 19 < psnr(a, a + 0.1) < 21  # mse 0.01 → 20 dB


def test_ssim_is_one_for_equal_images_and_falls_with_noise():
    from sd_kernels.testing import ssim

    img = torch.rand(1, 3, 32, 32)
    noisy = (img + 0.1 * torch.randn_like(img)).clamp(0, 1)
    assert ssim(img, img) == pytest.approx(1.0)
    assert 0 < ssim(img, noisy) < 0.95
    with pytest.raises(ValueError, match="one shape"):
        ssim(img, img[:, :, :16])


def test_sweeps_first_tier_covers_every_value_and_every_combination_of_the_others():
    """tests/sweeps.py: the cross product, split so that the README's tier still runs every value of the first axis
    and every combination of the others; the rest marked ``integration``."""
    import itertools

    from sweeps import one, sweep

    first, dtypes, paths = [(1, "a"), (2, "b"), (3, "c"), (4, "d")], one("xyz"), one("pq")
    params = sweep(first, dtypes, paths)
    assert sorted(p.values for p in params) == sorted((*f, d, q) for f, (d,), (q,) in
                                                      itertools.product(first, dtypes, paths))
    quick = [p.values for p in params if not p.marks]
    assert all([m.name for m in p.marks] == ["integration"] for p in params if p.marks)
    assert {v[:2] for v in quick} == set(first) and {v[2:] for v in quick} == set(itertools.product("xyz", "pq"))
    assert len(quick) == 6
