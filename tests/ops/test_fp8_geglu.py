"""The GEGLU feed-forward's first FP8 GEMM with the GEGLU in its epilogue (ops/fp8_geglu.py): the kernel
against a float64 evaluation of the same quantized math, and against the two-kernel path it replaces. Tiny
shapes: the CPU runs them through the interpreter."""

import dataclasses
import importlib

import pytest
import torch

from sd_kernels import profiles, reference
from sd_kernels.testing import rel_err

fg = importlib.import_module("sd_kernels.ops.fp8_geglu")
fp8 = importlib.import_module("sd_kernels.ops.fp8_linear")


def _operands(device, m=77, k=80, f=50, scale=1.0):
    x = torch.randn(m, k, device=device) * scale
    w = torch.randn(2 * f, k, device=device) / k**0.5
    a_q, s_a = reference.fp8_quantize_rows(x)
    w_q, s_w = fp8.quantize_weight(w)
    return a_q, s_a, w_q, s_w, torch.randn(2 * f, device=device)


def _tma_device(device) -> bool:
    return device == "cpu" or torch.cuda.get_device_capability() >= fp8.TMA_CAPABILITY


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("act,bias", [("none", True), ("tanh", False)])
def test_geglu_gemm_is_the_quantized_math(device, out_dtype, act, bias, count_calls):
    """Odd shapes (M = 77, F = 50: two row tiles, the last column tile partial; K = 80: a K tail the TMA unit
    zero-fills): h against float64, within the output dtype's rounding (h is rounded once)."""
    if not _tma_device(device):
        pytest.skip("the GEGLU epilogue kernel reads through the TMA unit: Hopper or later")
    a_q, s_a, w_q, s_w, b = _operands(device)
    b = b if bias else None
    launched = count_calls(fg, kernel="_GEGLU")
    h = fg.fp8_gemm_geglu(a_q, s_a, w_q, s_w, b, act, out_dtype)
    assert launched == {"kernel": 1}
    ref = reference.fp8_gemm_geglu(a_q, s_a, w_q, s_w, b, act, torch.float64, compute=torch.float64)
    assert h.dtype == out_dtype and h.shape == (77, 50) and h.is_contiguous()
    rounding = rel_err(ref.to(out_dtype), ref)
    factor = 4 if out_dtype == torch.bfloat16 and device == "cpu" else 2  # the interpreter truncates to bf16
    floor = 2.0**-12 if device == "cuda" else 1e-6  # the FP8 tensor cores' accumulation (test_fp8_linear.py)
    assert rel_err(h, ref) <= max(factor * rounding, floor), (rel_err(h, ref), rounding)


def test_geglu_gemm_matches_the_two_kernel_path(device):
    """The fused kernel and the path it replaces (the GEMM writing both halves, then the GEGLU quantizer) give
    the same codes up to one e4m3 step where an fp16 rounding moves a value across a code boundary: 3-D input
    (batch 2 of 40 tokens), the row scales within a few of fp16's roundings (a, g and h rounded apart)."""
    if not _tma_device(device):
        pytest.skip("the GEGLU epilogue kernel reads through the TMA unit: Hopper or later")
    a_q, s_a, w_q, s_w, b = _operands(device, m=80, scale=3.0)
    a_q, s_a = a_q.view(2, 40, -1), s_a.view(2, 40)
    y = fp8.fp8_gemm(a_q, s_a, w_q, s_w, b, out_dtype=torch.float16)
    q_two, s_two = fp8.quantize_rows(y, "none", gated=True)
    q_one, s_one = fp8.quantize_rows(fg.fp8_gemm_geglu(a_q, s_a, w_q, s_w, b, "none", torch.float16))
    assert q_one.shape == q_two.shape == (2, 40, 50)
    assert torch.allclose(s_one, s_two, rtol=2**-8, atol=0)
    one, two = q_one.float() * s_one[..., None], q_two.float() * s_two[..., None]
    assert torch.allclose(one, two, rtol=2**-3, atol=1e-6 * float(s_two.max()) * 448)
    assert (q_one.float() == q_two.float()).float().mean() > 0.95


def test_geglu_gemm_refuses_what_it_cannot_compute(device):
    a_q, s_a, w_q, s_w, b = _operands(device)
    with pytest.raises(ValueError, match="w_q \\[2F, K\\]"):
        fg.fp8_gemm_geglu(a_q, s_a, w_q[:-1], s_w[:-1])
    with pytest.raises(ValueError, match="approximation"):
        fg.fp8_gemm_geglu(a_q, s_a, w_q, s_w, act="")
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        fg.fp8_gemm_geglu(a_q.float(), s_a, w_q, s_w)
    with pytest.raises(ValueError, match="bias"):
        fg.fp8_gemm_geglu(a_q, s_a, w_q, s_w, b[:-1])


def test_the_epilogue_reason(device, monkeypatch):
    """The feed-forward asks at each call whether the fused GEMM may serve: with the switch on, not for a weight
    whose rows the TMA unit cannot read (K not a multiple of 16), nor under the reference backend or a profile
    that disables the op; with the switch off (the default), never."""
    monkeypatch.setattr(fg, "GEGLU_EPILOGUE", True)
    a_q, _, w_q, _, _ = _operands(device)
    x = torch.zeros(3, 80, device=device, dtype=torch.float16)
    _, _, odd_w, _, _ = _operands(device, k=50)
    if _tma_device(device):
        assert fg.geglu_epilogue_reason(x, w_q) is None
        assert "TMA" in fg.geglu_epilogue_reason(torch.zeros(3, 50, device=device), odd_w)
    else:
        assert fg.geglu_epilogue_reason(x, w_q) is not None
    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    assert "reference" in fg.geglu_epilogue_reason(x, w_q)
    monkeypatch.delenv("SD_KERNELS_BACKEND")
    off = dataclasses.replace(profiles.active_profile(), disabled_ops=frozenset({"fp8_geglu"}))
    with profiles.using_profile(off):
        assert fg.geglu_epilogue_reason(x, w_q) is not None
    monkeypatch.setattr(fg, "GEGLU_EPILOGUE", False)
    assert "GEGLU_EPILOGUE" in fg.geglu_epilogue_reason(x, w_q)


@pytest.mark.parametrize("codes", ["carried", "offset"])
def test_geglu_rows_takes_the_two_kernels_where_the_fused_one_cannot_read_the_codes(device, monkeypatch, codes,
                                                                                  count_calls):
    """``geglu_rows``: the fused GEMM on codes the TMA unit reads; codes carried on the input whose rows start off
    the 16-byte grid go to the GEMM writing both halves and the GEGLU quantizer, the same result to fp16's
    roundings."""
    if not _tma_device(device):
        pytest.skip("the GEGLU epilogue kernel reads through the TMA unit: Hopper or later")
    monkeypatch.setattr(fg, "GEGLU_EPILOGUE", True)
    a_q, s_a, w_q, s_w, b = _operands(device, m=40, scale=2.0)
    x = torch.randn(40, 80, device=device, dtype=torch.float16)
    q, s = fp8.quantize_rows(x)
    if codes == "offset":  # the same codes in rows 96 bytes apart, one byte off the grid
        wide = torch.zeros(40, 96, device=device).to(fp8.E4M3)
        wide[:, 1:81] = q
        q = wide[:, 1:81]
    fp8.attach_quantized(x, q, s)
    launched = count_calls(fg, fused="_GEGLU")
    got = fg.geglu_rows(x, w_q, s_w, b.half(), "none")
    assert launched == {"fused": int(codes == "carried")}
    monkeypatch.setattr(fg, "GEGLU_EPILOGUE", False)
    apart = fg.geglu_rows(x, w_q, s_w, b.half(), "none")
    assert launched == {"fused": int(codes == "carried")}
    one, two = got[0].float() * got[1][:, None], apart[0].float() * apart[1][:, None]
    assert torch.allclose(one, two, rtol=2**-3, atol=1e-6 * float(apart[1].max()) * 448)
