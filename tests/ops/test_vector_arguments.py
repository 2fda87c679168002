"""The ops' per-channel vector arguments (biases, norm weights, row scales) given as strided or expanded
views. Each op's shape checks accept such views, and each kernel reads the vector as ``ptr + index``:
the op must hand the kernel a contiguous vector (``ops.layout.vectors``), so that the result equals the
result for a contiguous copy of the same values, bit for bit. The kernels are required
(``SD_KERNELS_BACKEND=triton``), so a fallback to the PyTorch reference cannot pass for them."""

import importlib

import pytest
import torch

from sd_kernels import ops

C = 8
fp8 = importlib.import_module("sd_kernels.ops.fp8_linear")


def _cases(device):
    """(name, op taking one [C] vector) pairs, on fixed random inputs."""
    y, skip = torch.randn(2, C, 4, 4, device=device), torch.randn(2, C, 4, 4, device=device)
    x = torch.randn(2, 3, C, device=device)
    stats = ops.mean_rstd(ops.group_stats(y, 2), 1e-5)
    xl, wl = torch.randn(3, 8, device=device), torch.randn(C, 8, device=device)  # [2n, K]: n = C / 2
    q = torch.randn(1, 3, 2 * C, device=device)
    xc, wc = torch.randn(1, 4, 5, 5, device=device), torch.randn(C, 4, 3, 3, device=device)
    a_q, s_a = fp8.quantize_rows(torch.randn(C, 32, device=device))
    w_q, s_w = fp8.quantize_weight(torch.randn(C, 32, device=device))
    return {
        "bias_residual": lambda v: ops.bias_residual(y, v, skip),
        "bias_residual bias2": lambda v: ops.bias_residual(y, v.abs(), skip, bias2=v),
        "layer_norm_modulated weight": lambda v: ops.layer_norm_modulated(x, v),
        "gated_residual_layer_norm bias": lambda v: ops.gated_residual_layer_norm(x, x, None, None, v)[1],
        "layer_norm_modulated_fp8 weight": lambda v: ops.layer_norm_modulated_fp8(x, v)[1].float(),
        "group_norm weight": lambda v: ops.group_norm(y, 2, v),
        "group_norm channels_last bias": lambda v: ops.group_norm(y.to(memory_format=torch.channels_last), 2, None, v),
        "group_norm_given bias": lambda v: ops.group_norm_given(y, stats, None, v),
        "linear_geglu bias": lambda v: ops.linear_geglu(xl, wl, v),
        "qk_norm_rope q weight": lambda v: ops.qk_norm_rope(q, q, q, C, v, None, 1e-6)[0],
        "qk_norm_rope k weight": lambda v: ops.qk_norm_rope(q, q, q, C, None, v, 1e-6)[1],
        "conv2d bias": lambda v: ops.conv2d(xc, wc, v, padding=1),
        "winograd_conv2d bias": lambda v: ops.winograd_conv2d(xc, wc, v),
        "fp8_gemm bias": lambda v: ops.fp8_gemm(a_q, s_a, w_q, s_w, v, out_dtype=torch.float32),
        "fp8_gemm weight scales": lambda v: ops.fp8_gemm(a_q, s_a, w_q, v, out_dtype=torch.float32),
        "fp8_gemm row scales": lambda v: ops.fp8_gemm(a_q, v, w_q, s_w, out_dtype=torch.float32),
    }


CASES = list(_cases("cpu"))


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("view", ["strided", "expanded"])
def test_a_strided_or_expanded_vector_gives_the_contiguous_vectors_result(device, monkeypatch, name, view):
    op = _cases(device)[name]
    monkeypatch.setenv("SD_KERNELS_BACKEND", "triton")
    if view == "strided":
        v = torch.randn(2 * C, device=device)[::2]  # stride 2
    else:
        v = torch.randn(1, device=device).expand(C)  # stride 0: one element of storage
    got, want = op(v), op(v.contiguous())
    assert torch.equal(got, want), (got - want).abs().max()
