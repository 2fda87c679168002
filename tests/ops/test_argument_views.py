"""Arguments given as views that pass the ops' shape checks but that a kernel could read or write
wrongly. Per-channel vectors (biases, norm weights, row scales) as strided or expanded views: each
kernel reads a vector as ``ptr + index``, so the op must hand it a contiguous one (``ops.layout.vectors``)
and give the bits it gives for a contiguous copy. The kernels are required (``SD_KERNELS_BACKEND=triton``),
so a fallback to the PyTorch reference cannot pass for them. Outputs the caller gives whose elements
share memory (expanded views) are refused, as torch refuses them (``ops.layout.check_writable``)."""

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


def _outputs(device):
    """(name, op taking its caller-given output tensors made by ``make(shape, dtype)``) pairs."""
    y = torch.randn(2, C, 4, 4, device=device)
    stats = ops.mean_rstd(ops.group_stats(y, 2), 1e-5)
    x = torch.randn(2, 64, 3, 3, device=device)
    values = torch.empty(2, 3, 3, 64, dtype=torch.int8, device=device)
    scales = torch.empty(2, 3, 3, 2, device=device)
    ops.pack8(x, values, scales)
    gelu_ops = importlib.import_module("sd_kernels.ops.gelu")
    g = torch.randn(2, 3, 16, device=device)
    return {
        "bias_residual out": lambda make: ops.bias_residual(y, y[0, :, 0, 0], out=make(y.shape, y.dtype)),
        "group_norm_given out": lambda make: ops.group_norm_given(y, stats, out=make(y.shape, y.dtype)),
        "pack8 values": lambda make: ops.pack8(x, make(values.shape, torch.int8), scales.clone()),
        "pack8 scales": lambda make: ops.pack8(x, values.clone(), make(scales.shape, torch.float32)),
        "unpack8 out": lambda make: ops.unpack8(values, scales, make(x.shape, x.dtype)),
        "gelu_into out": lambda make: gelu_ops.gelu_into(g, make(g.shape, g.dtype)),
    }


@pytest.mark.parametrize("name", list(_outputs("cpu")))
def test_an_output_whose_elements_share_memory_is_refused(device, name):
    """An expanded output would have each of its shared elements written several times (the last write
    winning); the ops refuse it as torch's do, and take the same output with memory of its own."""
    op = _outputs(device)[name]

    def expanded(shape, dtype):
        return torch.zeros((1, *shape[1:]), dtype=dtype, device=device).expand(shape)

    with pytest.raises(ValueError, match="share memory"):
        op(expanded)
    op(lambda shape, dtype: torch.zeros(shape, dtype=dtype, device=device))
