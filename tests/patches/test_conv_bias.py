"""The convolutions' bias added by ``ops.bias_residual`` (patches/conv_bias.py): which convs get it, the values
(stock CUDA's conv-then-add, bit for bit; float64 for the whole VAE decode), the calls it hands back to torch, and
an exact unpatch."""

import copy
import importlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from sd_kernels.patches import patch, unpatch
from sd_kernels.patches.record import PatchRecord

from sd_kernels.models import build_model
from sd_kernels.ops import residual

cb = importlib.import_module("sd_kernels.patches.conv_bias")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class Convs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.biased = nn.Conv2d(8, 12, 3, padding=1)
        self.plain = nn.Conv2d(12, 12, 1, bias=False)
        self.sub = type("MyConv", (nn.Conv2d,), {})(12, 4, 3, padding=1)

    def forward(self, x):
        return self.sub(self.plain(self.biased(x)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_bias_added_as_torch_adds_it(dtype, layout):
    """A biased nn.Conv2d gets the bias add; its output is the convolution without bias plus the bias as torch adds
    it on CUDA (one fp32 sum rounded once): the same bits, in the input's layout."""
    model = Convs().to(DEVICE, dtype)
    x = torch.randn(2, 8, 6, 10, device=DEVICE).to(dtype)
    if layout == "channels_last":
        model, x = model.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)
    conv = model.biased
    with torch.no_grad():
        want = F.conv2d(x, conv.weight, None, 1, 1) + conv.bias.view(1, -1, 1, 1)
    record = PatchRecord(("winograd",), "hopper", ["model"])
    cb.patch_conv_bias(model, record)
    assert record.counts[cb.KIND] == 1  # not the bias-free conv, not the subclass
    assert "_conv_forward" in vars(conv) and "_conv_forward" not in vars(model.plain)
    assert "_conv_forward" not in vars(model.sub)
    with torch.no_grad():
        got = conv(x)
    if DEVICE == "cpu" and dtype == torch.bfloat16:  # the interpreter's bf16 rounding may differ by one ulp
        torch.testing.assert_close(got, want, rtol=2**-7, atol=0)
    else:
        assert torch.equal(got, want)
    assert got.is_contiguous(memory_format=torch.channels_last) == (layout == "channels_last")
    record.undo()
    assert "_conv_forward" not in vars(conv)


def test_where_torch_adds_the_bias(monkeypatch):
    """Autograd, autocast and the reference backend keep torch's conv with its bias; a bias-free call (the
    patched ResNet's, which folds the bias elsewhere) is the conv alone."""
    conv = nn.Conv2d(4, 6, 3, padding=1).to(DEVICE)
    x = torch.randn(1, 4, 5, 5, device=DEVICE)
    calls = []
    monkeypatch.setattr(cb, "bias_residual", lambda *a, **k: calls.append(1) or residual.bias_residual(*a, **k))
    record = PatchRecord(("winograd",), "hopper", ["model"])
    cb.patch_conv_bias(conv, record)
    y = conv(x)  # grad enabled and the weight requires grad
    assert y.requires_grad and not calls
    y.sum().backward()
    assert conv.weight.grad is not None
    with torch.no_grad():
        assert torch.equal(conv._conv_forward(x, conv.weight, None), F.conv2d(x, conv.weight, None, 1, 1))
        assert not calls
        monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
        assert torch.equal(conv(x), F.conv2d(x, conv.weight, conv.bias, 1, 1))
        assert not calls
        monkeypatch.delenv("SD_KERNELS_BACKEND")
        with torch.autocast(x.device.type, dtype=torch.bfloat16):  # torch rounds the bias to bf16 first
            assert torch.equal(conv(x), F.conv2d(x, conv.weight, conv.bias, 1, 1))
        assert not calls
        conv(x)
        assert calls == [1]
    record.undo()


def test_vae_decode_against_float64():
    """The tiny VAE's decode with only this patch: each biased conv served (its ResNets' conv1 among them), the
    image within 2x stock's error against float64 (fp16), and stock's bits after unpatch."""
    vae = build_model("tiny", "vae").to(DEVICE)
    z = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    with torch.no_grad():
        want = copy.deepcopy(vae).double().decode(z.double()).sample
        half = vae.half()
        stock = half.decode(z.half()).sample
        biased = sum(type(m) is nn.Conv2d and m.bias is not None for m in half.modules())
        record = patch(half, ops=["winograd", "group_norm"])
        assert record.counts[cb.KIND] == biased > 0
        got = half.decode(z.half()).sample
        unpatch(half)
        again = half.decode(z.half()).sample
    err, stock_err = ((t.double() - want).abs().max().item() for t in (got, stock))
    assert err <= 2 * stock_err + 1e-3, (err, stock_err)
    assert torch.equal(again, stock)
