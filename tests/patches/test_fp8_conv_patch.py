"""The FP8 tier's ResNet convolutions (patches/fp8_conv.py): which convolutions become ``Fp8Conv2d``, what a call
computes and when it runs the original instead, a changed weight, the patched ResNet forward's folded biases, the
record and an exact unpatch. The CPU runs the kernels through the interpreter."""

import importlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from dit_checks import cpu_only
from sd_kernels.patches import fp8_conv

import sd_kernels
from sd_kernels.models import build_pipeline
from sd_kernels.testing import rel_err

ops = importlib.import_module("sd_kernels.ops.fp8_conv")


def _resnet_convs(model):
    from diffusers.models.resnet import ResnetBlock2D

    return [(b, n) for b in model.modules() if type(b) is ResnetBlock2D for n in ("conv1", "conv2")]


@pytest.fixture
def fp8_convs(monkeypatch):
    """The opt-in on (``FP8_CONV``)."""
    monkeypatch.setattr(fp8_conv, "FP8_CONV", True)


def _conv(c=32, co=16):
    torch.manual_seed(0)
    return nn.Conv2d(c, co, 3, padding=1).half().eval()


@cpu_only
def test_the_denoisers_resnet_convs_and_nothing_else_and_an_exact_unpatch(fp8_convs):
    pipe = build_pipeline("tiny")
    pipe.set_progress_bar_config(disable=True)
    convs = _resnet_convs(pipe.unet)
    originals = [getattr(b, n) for b, n in convs]
    record = sd_kernels.patch(pipe, precision="fp8", cuda_graph=False)
    try:
        assert convs and all(type(getattr(b, n)) is fp8_conv.Fp8Conv2d for b, n in convs)
        assert all(getattr(b, n).weight is o.weight and getattr(b, n).bias is o.bias
                   for (b, n), o in zip(convs, originals))
        assert record.counts["fp8.conv"] == len(convs) == record.quantized.layers["conv"]
        assert f"and {len(convs)} 3×3 convolutions as E4M3 GEMMs" in record.format()
        assert not any(isinstance(m, fp8_conv.Fp8Conv2d) for m in pipe.vae.modules())  # the VAE's stay
    finally:
        sd_kernels.unpatch(pipe)
    assert all(getattr(b, n) is o for (b, n), o in zip(convs, originals))


@cpu_only
def test_fp8_conv_off_and_unserved_convs_are_listed(fp8_convs, monkeypatch):
    """A hooked convolution stays and is listed; with the opt-in off (the default), none is touched."""
    pipe = build_pipeline("tiny")
    (block, name), *_ = _resnet_convs(pipe.unet)
    getattr(block, name).register_forward_hook(lambda *args: None)
    record = sd_kernels.patch(pipe, precision="fp8", cuda_graph=False)
    try:
        assert type(getattr(block, name)) is nn.Conv2d
        assert any("hooks on the convolution" in s.reason for s in record.skipped), record.skipped
    finally:
        sd_kernels.unpatch(pipe)
    monkeypatch.setattr(fp8_conv, "FP8_CONV", False)
    record = sd_kernels.patch(pipe, precision="fp8", cuda_graph=False)
    try:
        assert "fp8.conv" not in record.counts
        assert not any(isinstance(m, fp8_conv.Fp8Conv2d) for m in pipe.unet.modules())
    finally:
        sd_kernels.unpatch(pipe)


def test_unserved_names_each_reason():
    assert fp8_conv.unserved(_conv()) is None
    half = lambda *args, **kwargs: nn.Conv2d(*args, **kwargs).half()  # noqa: E731
    for other in (half(32, 16, 3, stride=2, padding=1), half(32, 16, 1), half(32, 16, 3, padding=2, dilation=2),
                  half(32, 16, 3, padding=1, groups=2), half(32, 16, 3, padding=1, padding_mode="reflect")):
        assert "stride 1" in fp8_conv.unserved(other)
    assert "multiple of 32" in fp8_conv.unserved(half(24, 16, 3, padding=1))
    assert "torch.float64 weight" in fp8_conv.unserved(nn.Conv2d(32, 16, 3, padding=1).double())
    assert "subclass" in fp8_conv.unserved(type("MyConv", (nn.Conv2d,), {})(32, 16, 3, padding=1).half())


def test_offload_leaves_the_weight_its_fallback_reads(monkeypatch):
    """``offload_originals`` parks the linear layers' weights; a convolution's stays, since a call it does not serve
    (autograd here) reads it."""
    from sd_kernels.patches import fp8

    monkeypatch.setattr(fp8, "_PARK_FROM_THE_CPU", True)
    conv = _conv()
    layer = fp8_conv.Fp8Conv2d(conv)
    assert layer.offload() == 0 and layer.weight is conv.weight and layer._home is None
    x = torch.randn(1, 32, 4, 4).half().requires_grad_()
    assert torch.equal(layer(x), conv(x))


def test_a_call_is_the_fp8_conv_and_falls_back_to_the_original_where_not_served():
    conv = _conv()
    layer = fp8_conv.Fp8Conv2d(conv)
    x = torch.randn(2, 32, 5, 6).half().contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        expected = ops.conv3x3_fp8(x, *ops.quantize_conv_weight(conv.weight), conv.bias)
        assert torch.equal(layer(x), expected)
        assert torch.equal(layer._conv_forward(x, layer.weight, None),
                           ops.conv3x3_fp8(x, *ops.quantize_conv_weight(conv.weight)))
        other = torch.randn_like(conv.weight)
        assert torch.equal(layer._conv_forward(x, other, None), F.conv2d(x, other, None, padding=1))  # not its weight
    stock = conv(x.requires_grad_())  # autograd: the original convolution, differentiable
    assert torch.equal(layer(x), stock) and layer(x).requires_grad
    layer.train()
    with torch.no_grad():
        assert torch.equal(layer(x.detach()), conv(x.detach()))


def test_a_weight_changed_in_place_is_quantized_again():
    """And its ``graph_state`` changes with it: the CUDA graphs' watch (patches/cuda_graph.py) reads it, so a graph
    that baked the old codes in is captured anew."""
    conv = _conv()
    layer = fp8_conv.Fp8Conv2d(conv)
    x = torch.randn(1, 32, 4, 4).half()
    state = layer.graph_state()
    with torch.no_grad():
        before = layer(x)
        conv.weight.mul_(-2)
        assert layer.graph_state() != state
        after = layer(x)
        assert torch.equal(after, ops.conv3x3_fp8(x, *ops.quantize_conv_weight(conv.weight), conv.bias))
        assert not torch.equal(before, after)


@cpu_only
def test_the_patched_resnet_folds_the_biases_around_fp8_convs(fp8_convs, monkeypatch):
    """The patched ResNet forward (patches/group_norm.py) calls an Fp8Conv2d as a plain convolution: conv1 and conv2
    without their biases (conv1's goes into norm2's shift, conv2's into the residual's pass), and the block's output
    is the FP8 convolutions' within the FP8 error of stock's."""
    pipe = build_pipeline("tiny")
    from diffusers.models.resnet import ResnetBlock2D

    block = next(b for b in pipe.unet.modules() if type(b) is ResnetBlock2D and b.time_emb_proj is not None)
    block.half()
    x = torch.randn(2, block.in_channels, 8, 8).half()
    temb = torch.randn(2, block.time_emb_proj.in_features).half()
    with torch.no_grad():
        stock = block(x, temb)
    sd_kernels.patch(pipe, precision="fp8", cuda_graph=False)
    calls = []
    real = ops.conv3x3_fp8
    monkeypatch.setattr(fp8_conv, "conv3x3_fp8", lambda x, w_q, s_w, bias=None: calls.append(bias) or real(x, w_q, s_w,
                                                                                                           bias))
    try:
        with torch.no_grad():
            ours = block(x, temb)
    finally:
        sd_kernels.unpatch(pipe)
    assert calls == [None, None], calls
    assert 0 < rel_err(ours, stock) < 0.1, rel_err(ours, stock)
