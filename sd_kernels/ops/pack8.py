"""An activation kept in 8 bits: int8 codes with one fp32 scale per pixel and group of channels.

``pack8(x, values, scales)`` writes x [N, C, H, W] as codes q = round(x / s) in [−127, 127]
(``values``, int8 [N, H, W, C]) with s = max |x| / 127 over each pixel's run of G channels
(``pack_group``: 32, or all C where 32 does not divide it; ``scales``, float32 [N, H, W, C / G]);
``unpack8(values, scales, out)`` writes q · s back in out's dtype and layout. Each element is then
off by at most s / 2 (plus the rounding of q · s to out's dtype): about 2⁻⁸ of its group's largest
magnitude. A group that holds a NaN or an infinity gets a NaN scale, so it unpacks as NaN: a
non-finite activation is never turned into finite numbers (downstream, a GroupNorm over it is NaN
as stock's would be).

The streamed VAE decode (patches/stream_decode.py) keeps an activation this way where the profile
allows it and its plan's model says that saves at least 1 ms (in practice: where the activation in
its own dtype does not fit the budget beside a band): 1.125 bytes an element (32 channels a scale)
instead of 2. Both kernels are elementwise over [BLOCK_P pixels, C channels] tiles:
the groups are a reshape of the tile, so G and the padded C must be powers of two (other shapes run
the PyTorch reference). Strides are free on every operand (bands of rows of a larger buffer). Not
autotuned: the tile follows C.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sd_kernels import reference
from sd_kernels.ops.layout import check_writable
from sd_kernels.runtime.dispatch import tensor_reason, use_kernel
from sd_kernels.runtime.launch import Launcher, cdiv

GROUP = 32  # channels per scale where C allows it (``pack_group``)
_SCALE_TINY = tl.constexpr(reference.SCALE_TINY)  # a group no larger is quantized as zeros


def pack_group(c: int) -> int:
    """Channels per scale for C channels: 32 where they divide C, else all C (one scale a pixel)."""
    return GROUP if c % GROUP == 0 else c


@triton.jit
def _tile(C, W, HW, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, G: tl.constexpr):
    """This program's sample n, its pixels' rows and columns, the channel and group indices, and the
    masks of the [pixels, channels] and [pixels, groups] tiles."""
    n = tl.program_id(1).to(tl.int64)
    p = (tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)).to(tl.int64)
    c, g = tl.arange(0, BLOCK_C), tl.arange(0, BLOCK_C // G)
    pm = (p < HW)[:, None]
    return n, p // W, p % W, c, g, pm & (c < C)[None, :], pm & (g < C // G)[None, :]


@triton.jit
def _at(n, h, w, sn, sh, sw):
    """Each pixel's offset ([BLOCK_P, 1]) in an operand of sample, row and column strides sn, sh, sw."""
    return n * sn + h[:, None] * sh + w[:, None] * sw


@triton.jit
def _pack8_kernel(
    x_ptr, v_ptr, s_ptr, C, W, HW,
    sx_n, sx_c, sx_h, sx_w, sv_n, sv_h, sv_w, ss_n, ss_h, ss_w,
    BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, G: tl.constexpr,
):
    n, h, w, c, g, mask, gmask = _tile(C, W, HW, BLOCK_P, BLOCK_C, G)
    x = tl.load(x_ptr + _at(n, h, w, sx_n, sx_h, sx_w) + c[None, :] * sx_c, mask=mask, other=0.0).to(tl.float32)
    xg = tl.reshape(x, (BLOCK_P, BLOCK_C // G, G))
    amax = tl.max(tl.abs(xg), axis=2)
    bad = tl.max(((xg != xg) | (tl.abs(xg) == float("inf"))).to(tl.int32), axis=2) > 0
    big = amax > _SCALE_TINY  # a group no larger is quantized as zeros (reference.SCALE_TINY)
    inv = tl.where(big, 127.0 / tl.where(big, amax, 1.0), 0.0)  # no 1/0 in the masked lanes
    q = tl.floor(xg * inv[:, :, None] + 0.5)
    q = tl.minimum(tl.maximum(q, -127.0), 127.0)
    q = tl.reshape(tl.where(bad[:, :, None], 0.0, q), (BLOCK_P, BLOCK_C))
    tl.store(v_ptr + _at(n, h, w, sv_n, sv_h, sv_w) + c[None, :], q.to(tl.int8), mask=mask)
    tl.store(s_ptr + _at(n, h, w, ss_n, ss_h, ss_w) + g[None, :], tl.where(bad, float("nan"), amax / 127.0),
             mask=gmask)


@triton.jit
def _unpack8_kernel(
    v_ptr, s_ptr, o_ptr, C, W, HW,
    sv_n, sv_h, sv_w, ss_n, ss_h, ss_w, so_n, so_c, so_h, so_w,
    BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, G: tl.constexpr,
):
    n, h, w, c, g, mask, gmask = _tile(C, W, HW, BLOCK_P, BLOCK_C, G)
    q = tl.load(v_ptr + _at(n, h, w, sv_n, sv_h, sv_w) + c[None, :], mask=mask, other=0)
    s = tl.load(s_ptr + _at(n, h, w, ss_n, ss_h, ss_w) + g[None, :], mask=gmask, other=0.0)
    y = tl.reshape(tl.reshape(q.to(tl.float32), (BLOCK_P, BLOCK_C // G, G)) * s[:, :, None], (BLOCK_P, BLOCK_C))
    tl.store(o_ptr + _at(n, h, w, so_n, so_h, so_w) + c[None, :] * so_c, y.to(o_ptr.dtype.element_ty), mask=mask)


_PACK = Launcher(_pack8_kernel)
_UNPACK = Launcher(_unpack8_kernel)


def _check(op: str, x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> None:
    """x [N, C, H, W] (the unpacked side), values int8 [N, H, W, C], scales float32 [N, H, W, C / G]."""
    if x.dim() != 4:
        raise ValueError(f"{op}: the unpacked tensor must be [N, C, H, W], got {list(x.shape)}")
    n, c, h, w = x.shape
    if values.dtype != torch.int8 or tuple(values.shape) != (n, h, w, c):
        raise ValueError(f"{op}: values must be int8 of shape {[n, h, w, c]}, got {values.dtype} "
                         f"{list(values.shape)}")
    g = pack_group(c)
    if scales.dtype != torch.float32 or tuple(scales.shape) != (n, h, w, c // g):
        raise ValueError(f"{op}: scales must be float32 of shape {[n, h, w, c // g]} (one per {g} channels), "
                         f"got {scales.dtype} {list(scales.shape)}")
    if values.stride(3) != 1 or scales.stride(3) != 1 or len({x.device, values.device, scales.device}) > 1:
        raise ValueError(f"{op}: values and scales need their last dim dense, all on x's device")


def _reason(x: torch.Tensor) -> str | None:
    reason = tensor_reason(x)
    c = x.shape[1]
    g = pack_group(c)
    if reason is None and x.numel() == 0:
        return "empty input"
    if reason is None and (g & (g - 1)):
        return f"{c} channels: a group of {g} is not a power of two"
    return reason


def _grid(x: torch.Tensor) -> tuple[tuple[int, int], int, int]:
    n, c, h, w = x.shape
    block_c = triton.next_power_of_2(c)
    block_p = max(4096 // block_c, 1)
    return (cdiv(h * w, block_p), n), block_p, block_c


def _nhw(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def pack8(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> None:
    """x [N, C, H, W] (any strides) into ``values`` (int8 [N, H, W, C]) and ``scales`` (float32
    [N, H, W, C / pack_group(C)]), both with their last dim dense (the module docstring)."""
    _check("pack8", x, values, scales)
    check_writable("pack8", values=values, scales=scales)
    if not use_kernel("pack8", x, unsupported=_reason(x)):
        reference.pack8(x, values, scales)
        return
    grid, block_p, block_c = _grid(x)
    _PACK((block_p, block_c, x.dtype), grid, x, values, scales, x.shape[1], x.shape[3], x.shape[2] * x.shape[3],
          *x.stride(), *_nhw(values), *_nhw(scales), BLOCK_P=block_p, BLOCK_C=block_c, G=pack_group(x.shape[1]),
          num_warps=4)


def unpack8(values: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """codes · scales (what ``pack8`` wrote) into ``out`` [N, C, H, W] (any strides, a float dtype); returns out."""
    _check("unpack8", out, values, scales)
    check_writable("unpack8", out=out)
    if not use_kernel("pack8", out, unsupported=_reason(out)):
        return reference.unpack8(values, scales, out)
    grid, block_p, block_c = _grid(out)
    _UNPACK((block_p, block_c, out.dtype), grid, values, scales, out, out.shape[1], out.shape[3],
            out.shape[2] * out.shape[3], *_nhw(values), *_nhw(scales), *out.stride(), BLOCK_P=block_p,
            BLOCK_C=block_c, G=pack_group(out.shape[1]), num_warps=4)
    return out
