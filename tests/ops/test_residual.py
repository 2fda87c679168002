"""bias_residual (a ResNet block's tail: conv2's bias, the shortcut and its bias, the output scale, in
one pass) against float64: odd shapes, every layout and dtype, in place and into a view of a larger
buffer (as the streamed VAE decode writes its bands). CPU: the interpreter; GPU (-m gpu): the SD1.5
VAE decoder's band shapes. gated_add (a DiT block's gated residual in one pass) against float64 and the
reference backend's bits."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sd_kernels import reference
from sd_kernels.ops import bias_residual, gated_add
from sd_kernels.testing import UNIT_ROUNDOFF, channels_last, non_contiguous, poison_

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _layout(x, kind):
    return {"nchw": lambda t: t, "nhwc": channels_last, "strided": non_contiguous}[kind](x)


def _want(y, bias, skip, bias2, divisor):
    v = y.double() + bias.double().view(1, -1, 1, 1)
    v = v if bias2 is None else v + bias2.double().view(1, -1, 1, 1)
    return (v if skip is None else v + skip.double()) / divisor


def _tolerance(y, bias, skip, bias2, divisor, want):
    """Twice what PyTorch's ops make of it at y's dtype, as diffusers runs them (each sum rounded), or
    one ulp of the result (one rounding, the interpreter's fp32 → bf16 truncating)."""
    v = y + bias.view(1, -1, 1, 1)
    if skip is not None:
        v = (skip if bias2 is None else skip + bias2.view(1, -1, 1, 1)) + v
    stock = ((v / divisor).double() - want).abs().max().item()
    return max(2 * stock, 2 * UNIT_ROUNDOFF[y.dtype] * want.abs().max().item())


@pytest.mark.parametrize("shape", [(1, 24, 5, 7), (2, 40, 3, 9), (1, 3, 11, 4)])
@pytest.mark.parametrize("kind", ["nchw", "nhwc", "strided"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("skip, bias2, divisor", [(False, False, 1.0), (True, False, 1.0), (True, True, 2.0)])
def test_bias_residual_is_the_sum(shape, kind, dtype, skip, bias2, divisor, device):
    g = torch.Generator().manual_seed(0)
    y = _layout(torch.randn(shape, generator=g) * 3, kind).to(device, dtype)
    bias = torch.randn(shape[1], generator=g).to(device, dtype)
    s = _layout(torch.randn(shape, generator=g), kind).to(device, dtype) if skip else None
    b2 = torch.randn(shape[1], generator=g).to(device, dtype) if bias2 else None
    want = _want(y, bias, s, b2, divisor)
    got = bias_residual(y, bias, s, b2, divisor)
    assert got.dtype == dtype and got.shape == y.shape
    assert got.stride() == y.stride() or kind == "strided"
    err = (got.double() - want).abs().max().item()
    assert err <= _tolerance(y, bias, s, b2, divisor, want), err


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_bias_residual_in_place_and_into_a_band_of_a_buffer(dtype, device):
    """``out=y`` in place; ``out=`` rows of a channels_last buffer (a view) get the values and
    nothing else of the buffer changes."""
    y = channels_last(torch.randn(1, 16, 6, 5)).to(device, dtype)
    bias, skip = torch.randn(16).to(device, dtype), channels_last(torch.randn(1, 16, 6, 5)).to(device, dtype)
    want = bias_residual(y, bias, skip)
    buf = poison_(channels_last(torch.empty(1, 16, 10, 5, device=device, dtype=dtype)))
    before = buf.clone()
    assert bias_residual(y, bias, skip, out=buf[:, :, 3:9]) is not None
    torch.testing.assert_close(buf[:, :, 3:9], want, rtol=0, atol=0)
    torch.testing.assert_close(torch.cat([buf[:, :, :3], buf[:, :, 9:]], 2),
                               torch.cat([before[:, :, :3], before[:, :, 9:]], 2), rtol=0, atol=0, equal_nan=True)
    y2 = y.clone()
    assert bias_residual(y2, bias, skip, out=y2) is y2
    torch.testing.assert_close(y2, want, rtol=0, atol=0)


def test_bias_residual_checks_its_arguments(device):
    y = torch.randn(1, 8, 3, 3, device=device)
    with pytest.raises(ValueError, match="bias must be"):
        bias_residual(y, torch.randn(7, device=device))
    with pytest.raises(ValueError, match="skip must have"):
        bias_residual(y, torch.randn(8, device=device), torch.randn(1, 8, 3, 2, device=device))
    with pytest.raises(ValueError, match="out must have y's dtype"):
        bias_residual(y, torch.randn(8, device=device), out=torch.empty_like(y, dtype=torch.float16))


class _Ops(TorchDispatchMode):
    """The aten ops called under it."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, gate_shape", [((2, 77, 40), (2, 1, 40)), ((1, 333, 24), (1, 1, 24)),
                                               ((3, 5, 8), (3, 5, 8)), ((2, 9, 1100), (2, 1, 1100))])
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_gated_add_rounds_once(dtype, shape, gate_shape, layout, device, monkeypatch):
    """x + gate · y with a per-sample gate broadcast over the tokens (SD3's, FLUX's, PixArt-Σ's feed-forward
    residual), on our kernel: within one rounding of float64 (one ulp under the interpreter in bf16: its fp32 →
    bf16 cast truncates) or twice diffusers' two ops' error, no torch arithmetic (the kernel makes it); x and y
    strided as well; under the reference backend diffusers' two ops, bit for bit; with mixed dtypes the
    reference's type promotion."""
    monkeypatch.delenv("SD_KERNELS_BACKEND", raising=False)
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randn(shape, generator=g).to(device, dtype) for _ in range(2))
    if layout == "strided":
        x, y = (non_contiguous(t) for t in (x, y))
    gate = torch.randn(gate_shape, generator=g).to(device, dtype)
    want = x.double() + gate.double() * y.double()
    with _Ops() as ops:
        got = gated_add(x, gate, y)
    arithmetic = {torch.ops.aten.addcmul.default, torch.ops.aten.mul.Tensor, torch.ops.aten.add.Tensor}
    assert not arithmetic & set(ops.seen), ops.seen  # the kernel makes it
    assert got.dtype == dtype and got.shape == want.shape and got.is_contiguous()
    error = (got.double() - want).abs().max().item()
    stock = ((x + gate * y).double() - want).abs().max().item()
    rounding = (2 if device == "cpu" and dtype == torch.bfloat16 else 1) * UNIT_ROUNDOFF[dtype]  # the truncating cast
    assert error <= max(2 * stock, rounding * want.abs().max().item()), (error, stock)
    with _Ops() as ops:
        mixed = gated_add(x, gate.double(), y)
    assert torch.ops.aten.addcmul.default not in ops.seen  # the reference's type promotion decides
    assert mixed.dtype == torch.float64 and torch.equal(mixed, x + gate.double() * y)
    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    assert torch.equal(gated_add(x, gate, y), x + gate * y)


def test_gated_add_is_one_addcmul_where_no_kernel_runs(monkeypatch):
    """On a CPU without Triton's interpreter (and for shapes the kernel does not take: 4-D) the gated residual
    is one ``torch.addcmul`` pass, rounded once; the fallback is counted (``dispatch.fallbacks``), and under
    SD_KERNELS_BACKEND=triton it is an error."""
    from sd_kernels.runtime import dispatch

    monkeypatch.delenv("SD_KERNELS_BACKEND", raising=False)
    before = sum(n for (op, _), n in dispatch.fallbacks().items() if op == "gated_add")
    x, y, gate = torch.randn(2, 7, 16), torch.randn(2, 7, 16), torch.randn(2, 1, 16)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with _Ops() as ops:
        got = gated_add(x, gate, y)
    assert ops.seen == [torch.ops.aten.addcmul.default] and torch.equal(got, torch.addcmul(x, gate, y))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x4, y4, gate4 = x[None], y[None], gate[None]
    with _Ops() as ops:
        got = gated_add(x4, gate4, y4)
    assert ops.seen == [torch.ops.aten.addcmul.default] and torch.equal(got, torch.addcmul(x4, gate4, y4))
    assert sum(n for (op, _), n in dispatch.fallbacks().items() if op == "gated_add") == before + 2
    monkeypatch.setenv("SD_KERNELS_BACKEND", "triton")
    with pytest.raises(dispatch.KernelUnavailable, match="gated_add"):
        gated_add(x4, gate4, y4)


def test_gated_add_takes_batches_the_grid_holds_only(device, monkeypatch):
    """The samples are the kernel's second grid axis (at most 65,535 on CUDA): a larger batch is refused with its
    reason (torch's ops then run it), and the FP8 tier's residual-only pass after ``_scaled_mm`` hands its rows
    over as one sample's tokens, not as that many samples."""
    import importlib

    from sd_kernels.ops import residual as residual_ops

    fp8_linear = importlib.import_module("sd_kernels.ops.fp8_linear")  # the module, not the op of that name
    y = torch.empty(70_000, 1, 8, device=device)
    assert "batch of 70000" in residual_ops.gated_reason(None, None, y)
    monkeypatch.setattr(torch, "_scaled_mm", lambda a, b, **kw: torch.ones(a.shape[0], b.shape[1], device=a.device))
    seen = []
    monkeypatch.setattr(fp8_linear, "gated_add_into", lambda x, g, y, out: seen.append(y.shape) or out.copy_(x + y))
    # on the test's device: on a GPU host, CPU tensors would take torch's add (no kernel device), not the kernel's pass
    e4m3 = torch.float8_e4m3fn
    a2, w = torch.zeros(70_000, 16, device=device, dtype=e4m3), torch.zeros(8, 16, device=device, dtype=e4m3)
    residual = torch.zeros(70_000, 8, device=device)
    out = fp8_linear._torch_gemm(a2, torch.ones(70_000, device=device), w, torch.ones(8, device=device), None, None, 1,
                                 residual, (70_000, 8), torch.float32)
    assert seen == [(1, 70_000, 8)] and torch.equal(out, torch.ones(70_000, 8, device=device))


def test_gated_add_into_writes_a_view_without_gate_or_residual(device):
    """``gated_add_into`` (the FP8 tier's gated GEMMs on ``_scaled_mm``): x + gate · y, gate · y and x + y into a
    token slice of a larger buffer, the rest of it untouched."""
    from sd_kernels.ops.residual import gated_add_into

    g = torch.Generator().manual_seed(1)
    x, y = (torch.randn(2, 6, 24, generator=g).to(device) for _ in range(2))
    gate = torch.randn(2, 1, 24, generator=g).to(device)
    for xi, gi, want in ((x, gate, x + gate * y), (None, gate, gate * y), (x, None, x + y)):
        buffer = poison_(torch.empty(2, 9, 24, device=device))
        out = gated_add_into(xi, gi, y, buffer[:, 2:8])
        assert out.data_ptr() == buffer[:, 2:8].data_ptr()
        torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
        assert buffer[:, :2].isnan().all() and buffer[:, 8:].isnan().all()


def test_gated_add_traces_whole_under_torch_compile():
    """In a graph torch.compile traces, gated_add is diffusers' two ops (inductor fuses them): the dispatch
    check, which reads the active profile from a context variable dynamo cannot trace, is not reached."""
    x, gate, y = torch.randn(2, 5, 8), torch.randn(2, 1, 8), torch.randn(2, 5, 8)
    compiled = torch.compile(gated_add, backend="eager", fullgraph=True)
    assert torch.equal(compiled(x, gate, y), x + gate * y)


def test_reference_matches_the_kernel_contract():
    y, b = torch.randn(1, 4, 2, 3, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    torch.testing.assert_close(reference.bias_residual(y, b, y, b, 4.0), (2 * y + 2 * b.view(1, -1, 1, 1)) / 4)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 512, 24, 256), (1, 256, 18, 512), (1, 128, 19, 512)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_vae_band_shapes(shape, dtype):
    y = channels_last(torch.randn(shape)).to("cuda", dtype)
    skip = channels_last(torch.randn(shape)).to("cuda", dtype)
    bias, b2 = torch.randn(shape[1]).to("cuda", dtype), torch.randn(shape[1]).to("cuda", dtype)
    want = _want(y, bias, skip, b2, 1.0)
    err = (bias_residual(y, bias, skip, b2).double() - want).abs().max().item()
    assert err <= _tolerance(y, bias, skip, b2, 1.0, want)
