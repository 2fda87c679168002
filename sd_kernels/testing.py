"""Helpers for judging kernels: poisoned outputs and errors measured against float64.

The rule the tests follow: a kernel's error against a float64 oracle may be at most a small multiple
of the error stock PyTorch makes on the same inputs at the same dtype (``stock``), with a floor of a
few units of the dtype's rounding so that an exact stock op does not demand more than exactness.
Benchmarks use the same functions to report errors next to timings.
"""

from __future__ import annotations

import dataclasses
import math

import torch

# Unit roundoff of each dtype's storage format: the error of rounding one value.
UNIT_ROUNDOFF = {
    torch.float64: 2.0**-53,
    torch.float32: 2.0**-24,
    torch.float16: 2.0**-11,
    torch.bfloat16: 2.0**-8,
}


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` with NaN (floats) in place, so that any element a kernel fails to write shows."""
    if t.is_floating_point():
        return t.fill_(float("nan"))
    return t.fill_(torch.iinfo(t.dtype).min)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """‖x − ref‖ / ‖ref‖ in float64, on x's device (a GPU's outputs are not copied to the host); inf if x
    has NaN/inf where ref is finite."""
    x64, ref64 = x.detach().to(torch.float64), ref.detach().to(x.device, torch.float64)
    finite = torch.isfinite(ref64)
    if not torch.isfinite(x64[finite]).all():
        return math.inf
    num = (x64[finite] - ref64[finite]).norm().item()
    den = ref64[finite].norm().item()
    return num / den if den > 0 else num


@dataclasses.dataclass
class ErrorReport:
    ours: float
    stock: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.ours <= self.tolerance

    def __str__(self) -> str:
        return f"rel. error ours {self.ours:.3e}, stock {self.stock:.3e}, tolerance {self.tolerance:.3e}"


def judge(
    ours: torch.Tensor,
    stock: torch.Tensor,
    ref64: torch.Tensor,
    *,
    factor: float = 4.0,
    floor_ulps: float = 2.0,
) -> ErrorReport:
    """Error of ``ours`` and ``stock`` against the float64 ``ref64``, and the tolerance for ours:
    ``max(factor · stock error, floor_ulps · unit roundoff of ours' dtype)``."""
    e_ours, e_stock = rel_err(ours, ref64), rel_err(stock, ref64)
    floor = floor_ulps * UNIT_ROUNDOFF[ours.dtype]
    return ErrorReport(e_ours, e_stock, max(factor * e_stock, floor))


def assert_close_to_reference(
    ours: torch.Tensor,
    stock: torch.Tensor,
    ref64: torch.Tensor,
    *,
    factor: float = 4.0,
    floor_ulps: float = 2.0,
) -> ErrorReport:
    """Fail unless ``ours`` has the reference's shape and dtype of ``stock``, no NaN where the
    reference is finite, and an error within ``judge``'s tolerance."""
    assert ours.shape == ref64.shape, f"shape {tuple(ours.shape)} != reference {tuple(ref64.shape)}"
    assert ours.dtype == stock.dtype, f"dtype {ours.dtype} != stock {stock.dtype}"
    report = judge(ours, stock, ref64, factor=factor, floor_ulps=floor_ulps)
    assert report.ok, str(report)
    return report


def channels_last(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous(memory_format=torch.channels_last)


def non_contiguous(x: torch.Tensor) -> torch.Tensor:
    """The same values as ``x`` in a strided view (every other element of a doubled last dim)."""
    wide = torch.empty(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype, device=x.device)
    view = wide[..., ::2]
    view.copy_(x)
    return view


def psnr(a, b, peak: float = 1.0) -> float:
    """Peak signal-to-noise ratio in dB between two images with values in [0, peak] (arrays or tensors)."""
    ta = torch.as_tensor(a, dtype=torch.float64)
    tb = torch.as_tensor(b, dtype=torch.float64)
    mse = torch.mean((ta - tb) ** 2).item()
    return math.inf if mse == 0 else 10 * math.log10(peak**2 / mse)


def ssim(a: torch.Tensor, b: torch.Tensor, peak: float = 1.0) -> float:
    """Structural similarity of two image batches [N, C, H, W] with values in [0, peak]: the mean over
    pixels and channels of Wang et al.'s index with an 11×11 Gaussian window (σ 1.5), in float64."""
    x, y = (torch.as_tensor(t).detach().to(torch.float64).cpu() for t in (a, b))
    if x.shape != y.shape or x.dim() != 4:
        raise ValueError(f"ssim takes two [N, C, H, W] images of one shape, got {tuple(x.shape)}, {tuple(y.shape)}")
    g = torch.exp(-((torch.arange(11, dtype=torch.float64) - 5) ** 2) / (2 * 1.5**2))
    window = (g[:, None] * g[None, :] / g.sum() ** 2).expand(x.shape[1], 1, 11, 11)
    blur = lambda t: torch.nn.functional.conv2d(t, window, groups=x.shape[1])  # noqa: E731
    mx, my = blur(x), blur(y)
    vx, vy, cov = blur(x * x) - mx**2, blur(y * y) - my**2, blur(x * y) - mx * my
    c1, c2 = (0.01 * peak) ** 2, (0.03 * peak) ** 2
    index = (2 * mx * my + c1) * (2 * cov + c2) / ((mx**2 + my**2 + c1) * (vx + vy + c2))
    return index.mean().item()


def extra_cuda_bytes(fn, *inputs: torch.Tensor) -> tuple[int, torch.Tensor]:
    """(peak CUDA memory one ``fn(*inputs)`` allocates beyond its output, that output), measured after
    a warm-up call (cuBLAS workspace, Triton autotuning stay out of it). Tests and benchmarks share it."""
    from sd_kernels.runtime.memory import CudaMemory, peak_intermediate_bytes

    fn(*inputs)
    peak, out = peak_intermediate_bytes(lambda: fn(*inputs), CudaMemory())
    return peak - out.numel() * out.element_size(), out
