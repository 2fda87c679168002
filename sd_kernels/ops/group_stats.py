"""GroupNorm's statistics and normalization apart, for a tensor no one holds whole.

A streamed VAE decode (patches/stream_decode.py) never holds a whole activation: it gathers each
norm's statistics band by band and then normalizes every band with the whole image's. The three
steps are ops of their own:

* ``group_partials``: (count, mean, M2) of chunks of each (sample, group) of a band, by the split
  path's statistics kernel of ops/group_norm.py (a Welford per lane over chunks of every group, on
  the whole GPU); a norm's bands' partials are concatenated and merged once (``group_stats`` merges
  one tensor's);
* ``merge_group_stats``: partials over any axis merged with Chan's formula, n = Σ nᵢ,
  mean = Σ nᵢ·meanᵢ / n, M2 = Σ M2ᵢ + Σ nᵢ·(meanᵢ − mean)² (no E[x²] − E[x]² cancellation), float64;
  ``mean_rstd`` turns them into what the normalization applies;
* ``group_norm_given``: act((x − mean)·rstd·w + b) with the caller's (mean, rstd), by
  ``_given_norm_kernel``, the group path's normalize loop with the statistics read instead of
  computed.

Neither kernel is autotuned: a streamed decode's bands have many shapes and each runs a few times
per image; the warps follow the tile (``_warps``, the autotuners' prune rule).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from sd_kernels import reference
from sd_kernels.ops.group_norm import (
    Plan,
    _alloc,
    _channel_affine,
    _check,
    _check_shift,
    _finish,
    _group_stats_kernel,
    _kernel_reason,
    _load_tile,
    _span_reason,
    _spatial_stride,
    plan,
    sm_count,
)
from sd_kernels.ops.layout import check_writable, contiguous_strides, is_dense, vectors
from sd_kernels.runtime.dispatch import use_kernel
from sd_kernels.runtime.launch import Launcher


@triton.jit
def _given_norm_kernel(
    x_ptr, shift_ptr, y_ptr, w_ptr, b_ptr, stat_ptr, G, HW,
    stride_xn, stride_xc, stride_xs, stride_yn, stride_yc, stride_ys, CHUNK,
    CPG: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, HAS_SHIFT: tl.constexpr,
):
    """y = act((x [+ shift[n, c]] − mean)·rstd·w + b) over this program's chunk of its group, with the
    caller's (mean, rstd) per (sample, group) as stat[2, N·G]. Grid (N·G, S), as the group paths'."""
    pid_g, pid_s = tl.program_id(0), tl.program_id(1)
    n, g = pid_g // G, pid_g % G
    x_grp = x_ptr + n.to(tl.int64) * stride_xn + (g * CPG).to(tl.int64) * stride_xc
    y_grp = y_ptr + n.to(tl.int64) * stride_yn + (g * CPG).to(tl.int64) * stride_yc
    mean = tl.load(stat_ptr + pid_g)
    rstd = tl.load(stat_ptr + tl.num_programs(0) + pid_g)
    s_lo = pid_s * CHUNK
    s_hi = tl.minimum(s_lo + CHUNK, HW)
    for c0 in range(0, CPG, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        scale, shift = _channel_affine(w_ptr, b_ptr, g * CPG + c, c < CPG, rstd, HAS_WEIGHT, HAS_BIAS)
        centre = tl.full((BLOCK_C,), 0.0, tl.float32) + mean
        if HAS_SHIFT:  # x + shift − mean: the shift folded into the centre, per channel
            centre -= tl.load(shift_ptr + n * G * CPG + g * CPG + c, mask=c < CPG, other=0.0).to(tl.float32)
        for s0 in range(s_lo, s_hi, BLOCK_S):
            s = s0 + tl.arange(0, BLOCK_S)
            x, mask = _load_tile(x_grp, c, s, HW, stride_xc, stride_xs, CPG)
            y = _finish((x - centre[:, None]) * scale[:, None] + shift[:, None], ACT)
            tl.store(y_grp + c[:, None] * stride_yc + s[None, :] * stride_ys, y.to(y_ptr.dtype.element_ty), mask=mask)


# The statistics kernel is ops/group_norm.py's, run bare: a Launcher of the same JIT function would
# share the autotuned one's name (and its shipped tables), without its autotuner.
_BAND_STATS, _GIVEN_NORM = _group_stats_kernel.fn, Launcher(_given_norm_kernel)
# Its launch options as the autotuned launches pass them (all of the config, in its order): Triton keys
# its in-memory cache on the options' string, so a bare launch with num_warps alone would compile again
# a specialization the autotuned path has (sd_kernels/runtime/launch.py).
_OPTIONS = {c.num_warps: c.all_kwargs() for c in _group_stats_kernel.configs}


def _warps(tile_elems: int) -> int:
    """The fewest warps (of 4, 8, 16) that hold a tile at ≤ 32 elements a thread (the autotuners'
    prune rule)."""
    return next((w for w in (4, 8, 16) if tile_elems // (32 * w) <= 32), 16)


def _options(tile_elems: int) -> dict:
    """The launch options of a bare statistics launch: the autotuner's config of ``_warps`` warps."""
    warps = _warps(tile_elems)
    return _OPTIONS.get(warps, {"num_warps": warps})


def _band_plan(x: torch.Tensor, num_groups: int) -> tuple[Plan, int]:
    """The split path's tiles and chunks for x (statistics and normalization alike), and x's spatial
    stride (x has one: ``_band_reason`` sends others to the reference)."""
    n, c = x.shape[:2]
    hw = math.prod(x.shape[2:])
    stride_s = _spatial_stride(x)
    channels_fast = hw == 1 or abs(x.stride(1)) < abs(stride_s)
    p = plan(n, num_groups, c // num_groups, hw, channels_fast, 0, sms=sm_count(x.get_device()), pixels=False)
    return p, stride_s


def _band_reason(x: torch.Tensor, num_groups: int, weight=None, bias=None) -> str | None:
    """Why the band kernels cannot take x (they read the spatial dims through one stride, no copy)."""
    stride_s = _spatial_stride(x)
    if stride_s is None:
        return _kernel_reason(x, weight, bias) or "spatial dims with no common stride"
    return _kernel_reason(x, weight, bias) or _span_reason(x, x.shape[1] // num_groups, math.prod(x.shape[2:]),
                                                           stride_s)


def group_partials(x: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Partial (count, mean, M2) of chunks of each (sample, group) of x, fp32 [3, N, G, S] (S ≥ 1
    chunks): what ``merge_group_stats`` merges, alone or concatenated with other parts' along S."""
    _check(x, num_groups, None, None)
    if not use_kernel("group_norm", x, unsupported=_band_reason(x, num_groups)):
        return reference.group_stats(x, num_groups).float()[..., None]
    n = x.shape[0]
    p, stride_s = _band_plan(x, num_groups)
    parts = torch.empty(3, n * num_groups, p.chunks, dtype=torch.float32, device=x.device)
    _BAND_STATS[(n * num_groups, p.chunks)](x, parts, num_groups, math.prod(x.shape[2:]), p.chunks,
                x.stride(0), x.stride(1), stride_s, p.chunk, CPG=x.shape[1] // num_groups,
                BLOCK_C=p.block_c, BLOCK_S=p.block_s, **_options(p.block_c * p.block_s))
    return parts.view(3, n, num_groups, p.chunks)


def group_stats(x: torch.Tensor, num_groups: int) -> torch.Tensor:
    """(count, mean, M2) of each (sample, group) of x as a float64 [3, N, G]: M2 is the sum of squared
    deviations from the mean. For statistics gathered part by part, ``group_partials`` of each part
    concatenated and merged once (``merge_group_stats``: Chan's merge, as in the kernels);
    ``mean_rstd`` turns them into what ``group_norm_given`` applies. Per lane Welford sums in fp32
    in the kernel, merged in float64."""
    return merge_group_stats(group_partials(x, num_groups))


def merge_group_stats(parts: torch.Tensor) -> torch.Tensor:
    """[3, ..., k] partial (count, mean, M2) over the last axis merged into [3, ...] float64:
    n = Σ nᵢ, mean = Σ nᵢ·meanᵢ / n, M2 = Σ M2ᵢ + Σ nᵢ·(meanᵢ − mean)² (no cancellation)."""
    count, mean, m2 = parts.double().unbind(0)
    n = count.sum(-1)
    mu = (count * mean).sum(-1) / n.clamp_min(1)
    return torch.stack([n, mu, (m2 + count * (mean - mu[..., None]) ** 2).sum(-1)])


def mean_rstd(stats: torch.Tensor, eps: float) -> torch.Tensor:
    """[3, N, G] (count, mean, M2) -> [2, N, G] float32 (mean, 1/√(var + eps)), var biased as
    GroupNorm's."""
    count, mean, m2 = stats.unbind(0)
    return torch.stack([mean, torch.rsqrt(m2 / count + eps)]).float()


def group_norm_given(
    x: torch.Tensor,
    stats: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    out: torch.Tensor | None = None,
    shift: torch.Tensor | None = None,
) -> torch.Tensor:
    """``group_norm`` with given statistics: act((x − mean)·rstd·w + b) per (sample, group), with
    ``stats`` = [2, N, G] (mean, rstd) (``mean_rstd``), e.g. those of a whole image of which x is a
    band. The output keeps x's strides when x is dense; ``out`` (x's shape and dtype, any strides
    with a common spatial one; ``out=x`` normalizes in place: each element is read and written by
    the same program) receives it instead. ``shift`` ([N, C]): normalize x + shift[:, :, None, …]
    (e.g. a convolution's bias not yet added), the sum made in fp32 and never written; ``stats``
    are then the sum's."""
    reference.check_activation(activation)
    _check_shift(x, shift)
    if stats.dim() != 3 or stats.shape[:2] != (2, x.shape[0]):
        raise ValueError(f"stats must be [2, N, G] (mean, rstd) for x of shape {list(x.shape)}, "
                         f"got {list(stats.shape)}")
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype or out.device != x.device):
        raise ValueError(f"out must have x's shape, dtype and device ({list(x.shape)}, {x.dtype}, {x.device}), "
                         f"got {list(out.shape)}, {out.dtype}, {out.device}")
    num_groups = stats.shape[2]
    _check(x, num_groups, weight, bias)
    check_writable("group_norm_given", out=out)
    unsupported = _band_reason(x, num_groups, weight, bias) or (
        None if out is None or _spatial_stride(out) is not None else "out's spatial dims have no common stride")
    if not use_kernel("group_norm", x, weight, bias, unsupported=unsupported):
        y = reference.group_norm_given(x, stats, weight, bias, activation, shift=shift)
        return y if out is None else out.copy_(y)
    weight, bias = vectors(weight, bias)
    n, c = x.shape[:2]
    hw = math.prod(x.shape[2:])
    p, stride_s = _band_plan(x, num_groups)
    y = out if out is not None else _alloc(x.shape, x.stride() if is_dense(x) else contiguous_strides(x.shape), x)
    stat = stats.to(device=x.device, dtype=torch.float32).contiguous()
    key = ("given", hw, num_groups, c // num_groups, p, x.dtype, None if weight is None else weight.dtype,
           None if bias is None else bias.dtype, activation, None if shift is None else shift.dtype)
    _GIVEN_NORM(key, (n * num_groups, p.chunks), x, x if shift is None else shift.contiguous(), y,
                weight if weight is not None else x,
                bias if bias is not None else x, stat, num_groups, hw,
                x.stride(0), x.stride(1), stride_s, y.stride(0), y.stride(1), _spatial_stride(y), p.chunk,
                CPG=c // num_groups, BLOCK_C=p.block_c, BLOCK_S=p.block_s,
                HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, ACT=activation or "none",
                HAS_SHIFT=shift is not None, num_warps=_warps(p.block_c * p.block_s))
    return y
