"""Nearest-neighbour 2× upsampling followed by a 3×3 convolution (padding 1), computed as one 2×2
convolution at the input's resolution: diffusers' ``Upsample2D`` (the upsamplers of the UNet and of
the VAE decoder) without the upsampled copy and with 4/9 of the multiply-adds.

The algebra. Let u = up2(x), u[y, z] = x[⌊y/2⌋, ⌊z/2⌋], and o = conv3x3(u, w) + b with padding 1.
Output row 2i + a (a ∈ {0, 1}) reads u's rows 2i + a − 1, 2i + a, 2i + a + 1, which are x's rows
i − 1, i, i (a = 0) or i, i, i + 1 (a = 1): two distinct input rows, whose taps sum the kernel's
rows {0 | 1, 2} (a = 0) or {0, 1 | 2} (a = 1). Columns alike. So output phase (a, b) — the pixels
(2i + a, 2j + b) — is a 2×2 convolution of x with folded weights w_ab, reading x's rows i + a − 1,
i + a and columns j + b − 1, j + b. Stacking the four w_ab as 4·K output channels, one 2×2
convolution of x with padding 1 gives, at (H + 1) × (W + 1) positions, phase (a, b) of output pixel
(2i + a, 2j + b) at position (i + a, j + b). ``interleave_phases`` scatters the phases into the
2H × 2W output and adds the bias, one elementwise pass.

Cost: 16 instead of 36 multiply-adds per input pixel and channel pair (2.25x fewer); the upsampled
input (4× x) is never written or read. The phases (4·K channels at (H + 1)(W + 1)) are written by
the convolution and read once by the interleave: the memory traffic is about stock's (which writes
and reads the upsampled copy). The convolution is cuDNN's (``F.conv2d``), so this op runs on any
device; it needs no Triton kernel (``use_kernel(..., any_device=True)``: the reference backend and
a profile's ``disabled_ops`` still route it to the reference).

Numerics: w_ab is summed in float64 and rounded once to the weight's dtype (one rounding, as the
weight itself had); the convolution rounds its output once and the interleave adds the bias with
one more rounding (stock adds it inside the convolution). tests/ops/test_upsample.py holds it to a
small multiple of stock's error against float64.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sd_kernels import reference
from sd_kernels.ops.conv import check_operands
from sd_kernels.ops.layout import is_channels_last
from sd_kernels.ops.weight_cache import DerivedWeights, find
from sd_kernels.runtime.dispatch import tensor_reason, use_kernel

KIND = "polyphase"  # the weight cache's kind (ops/weight_cache.py)
# Taps of the 3×3 kernel that phase a's two 2×2 taps sum, along one axis.
_TAPS = {0: ((0,), (1, 2)), 1: ((0, 1), (2,))}


def polyphase_weight(weight: torch.Tensor, channels_last: bool = False) -> torch.Tensor:
    """The four phases' 2×2 weights of a [K, C, 3, 3] weight, stacked as [4·K, C, 2, 2] in phase order
    (a, b) = (0, 0), (0, 1), (1, 0), (1, 1); summed in float64, rounded once to the weight's dtype,
    channels_last if asked (the layout cuDNN wants beside a channels_last input). Device ops only: no
    host copy, so a CUDA graph may capture a first call."""
    if weight.dim() != 4 or tuple(weight.shape[-2:]) != (3, 3):
        raise ValueError(f"polyphase_weight needs a [K, C, 3, 3] weight, got {tuple(weight.shape)}")
    with torch.no_grad():
        w = weight.detach().double()

        def fold(t: torch.Tensor, dim: int, a: int) -> torch.Tensor:
            return torch.stack([sum(t.select(dim, i) for i in group) for group in _TAPS[a]], dim)

        w4 = torch.cat([fold(fold(w, 2, a), 3, b) for a in (0, 1) for b in (0, 1)]).to(weight.dtype)
    return w4.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)


def interleave_phases(p: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """out[n, c, 2i + a, 2j + b] = p[n, (2a + b)·C + c, i + a, j + b] + bias[c], for every pixel of
    ``out`` ([N, C, 2h, 2w]; p has at least h + 1 rows and w + 1 columns). One elementwise kernel
    through two strided views: any layout of either, ``out`` may be a view of a larger buffer."""
    n, c, h2, w2 = out.shape
    sn, sc, sh, sw = p.stride()
    src = p.as_strided((n, c, h2 // 2, 2, w2 // 2, 2), (sn, sc, sh, 2 * c * sc + sh, sw, c * sc + sw),
                       p.storage_offset())
    on, oc, oh, ow = out.stride()
    dst = out.as_strided((n, c, h2 // 2, 2, w2 // 2, 2), (on, oc, 2 * oh, oh, 2 * ow, ow), out.storage_offset())
    if bias is None:
        dst.copy_(src)
    else:
        torch.add(src, bias.view(1, c, 1, 1, 1, 1), out=dst)
    return out


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x.dim() != 4 or weight.dim() != 4 or tuple(weight.shape[-2:]) != (3, 3):
        raise ValueError(f"upsample_conv2d needs a 4-D x and a [K, C, 3, 3] weight, got {tuple(x.shape)} "
                         f"and {tuple(weight.shape)}")
    check_operands(x, weight, bias)


def upsample_conv2d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                    cached: bool = False) -> torch.Tensor:
    """``conv2d(interpolate(x, scale_factor=2, mode="nearest"), weight, bias, padding=1)`` as one 2×2
    convolution of the phases at x's resolution, interleaved into the output (x's memory format).

    ``cached``: take the phases from the PhaseCache a patched upsampler keeps for ``weight``
    (``cached_phases``), else compute them for this call."""
    _check(x, weight, bias)
    reason = tensor_reason(x, weight, bias)
    if reason is None and not (x.dtype == weight.dtype and (bias is None or bias.dtype == x.dtype)):
        reason = f"mixed dtypes (x {x.dtype}, weight {weight.dtype}): the convolution's own error is torch's"
    if not use_kernel("upsample_conv2d", x, weight, bias, unsupported=reason, any_device=True):
        return reference.upsample_conv2d(x, weight, bias)
    cl = is_channels_last(x)
    w4 = cached_phases(weight, cl) if cached else polyphase_weight(weight, cl)
    p = F.conv2d(x, w4, None, padding=1)
    n, _, h, w = x.shape
    out = torch.empty(n, weight.shape[0], 2 * h, 2 * w, dtype=x.dtype, device=x.device,
                      memory_format=torch.channels_last if cl else torch.contiguous_format)
    return interleave_phases(p, bias, out)


class PhaseCache(DerivedWeights):
    """The phases of one upsampler's weight, per layout (and dtype, device), kept by the patched
    upsampler that owns it (patches/upsample.py) and recomputed when the weight changes."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__(weight, KIND, polyphase_weight)


def cached_phases(weight: torch.Tensor, channels_last: bool) -> torch.Tensor:
    """``weight``'s phases from the PhaseCache that holds this very tensor, or computed for this call."""
    cache = find(weight, KIND)
    return polyphase_weight(weight, channels_last) if cache is None else cache.get(channels_last)
