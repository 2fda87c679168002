"""GroupNorm with an optional fused SiLU, for NCHW and channels_last inputs.

A group is the [CPG, HW] block of one sample's CPG = C/G channels over HW = prod(spatial) pixels.
Three paths, chosen per call by ``plan`` (sizes in elements of one group); the first two have one
program per group (or per chunk of a group), the third one per chunk of whole pixels:

* **fused** (one launch): one program per group computes the group's statistics and normalizes
  it. A group that fits one register tile (≤ ``_ONE_TILE_ELEMS`` padded) is read once by
  ``_group_norm_tile_kernel``: 1 read + 1 write, the ideal. A larger group is streamed twice by
  ``_group_norm_kernel`` (statistics, then normalize); the second
  read comes from L2, because the data of the programs in flight (≈ SMs × group bytes) stays far
  below its 50 MB, so DRAM still sees ≈ 1 read + 1 write. All of SD's UNet shapes in NCHW take it.
* **split** (two launches): when there are few, huge groups (the VAE: 32 groups of up to 2 M
  elements, against 132 SMs) one program per group would leave the GPU idle. ``_group_stats_kernel``
  reduces chunks of every group on the whole GPU and writes partial (count, mean, M2);
  ``_group_norm_kernel`` merges its group's partials in its prologue (no third launch) and normalizes
  its chunk. Cost: 2 reads + 1 write, the floor when a group does not fit on chip. The normalize
  launch visits chunks in the reverse order of the statistics launch, so its first reads hit what
  the statistics launch read last and L2 still holds.
* **pixels** (three launches, channels-fast inputs: channels_last, [B, C, HW] views of [B, HW, C]):
  a group's pixels there are CPG-element runs C elements apart (8–160 bytes of every C·2), which
  group programs read piecemeal. Instead a program owns all C channels of a chunk of pixels, a
  contiguous slab. ``_pixel_stats_kernel`` sums each channel's deviations from a pivot (and their
  squares) on [pixels, C padded] tiles read in full-width vectors, reduces the pixel lanes into
  per-channel statistics and merges those, laid out [groups, channels of a group] by a gather,
  into partial (count, mean, M2)
  per (sample, chunk, group); ``_pixel_merge_kernel`` merges a group's partials into (mean, rstd);
  ``_pixel_norm_kernel`` normalizes [pixels, C padded to a power of two] tiles with per-channel
  mean and rstd·w gathered once per program. Taken for channels-fast inputs unless the group is one
  register tile (that stays 1 read + 1 write in one launch) or the padded pixel exceeds
  ``_TILE_ELEMS``. The merge is a launch of its own: merging in the normalize prologue would make
  every program read all G·S partials of its sample (≈ 100 KB at S = 256).

Statistics are fp32 and safe for inputs whose mean is large against their spread. On the group
paths every lane keeps a Welford (count, mean, M2) over the tiles it sees; lanes, chunks and partials
are combined with the k-way form of Chan's merge, mean = Σ nᵢ·meanᵢ / n, M2 = Σ M2ᵢ + Σ nᵢ·(meanᵢ −
mean)², whose terms are all nonnegative: no E[x²] − E[x]² cancellation. The pixel path's statistics
launch instead sums d = x − p and d² per channel and chunk, p being one of the very values summed
(the chunk's first pixel of that channel), then M2 = Σd² − (Σd)²/n: a Welford per lane made that
launch slower than its loads (H100, 2026-11-24, docs/kernels/group_norm.md). The subtraction loses at most a factor
1 + n·(mean − p)²/M2 of fp32's precision, and because p is one of the n values, (p − mean)² ≤ M2:
the loss is at most a factor n + 1 (n = the chunk's pixels, 2–1,024 at SD's shapes) however large
the mean, and about 2 when p is a typical value of its channel. Channels, chunks and partials
then meet in Chan's merge as above. Normalizing computes (x − mean)·(rstd·w) + b for the same
reason.

Layouts: the spatial dims are read through one stride (stride_s), so NCHW, channels_last, the
VAE attention's [B, C, HW] views and strided slices run without copies and the output keeps the
input's strides. The group paths' tile is [BLOCK_C channels, BLOCK_S pixels]; Triton vectorizes
along whichever axis has stride 1. NCHW tiles take a power-of-two divisor of CPG as BLOCK_C (no masked
lanes); channels_last tiles on the group paths take the whole contiguous run of a pixel's CPG group
channels. The pixel path reads and writes through the same runtime strides, so a channels-fast
input that is not dense (a strided or channel slice) runs on it too, into a contiguous output.
Only inputs whose spatial dims cannot be viewed through one stride cost a copy.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import triton
import triton.language as tl

from sd_kernels import reference
from sd_kernels.ops.attention_common import _aligned
from sd_kernels.ops.layout import contiguous_strides, is_dense, vectors
from sd_kernels.profiles import active_profile
from sd_kernels.runtime.dispatch import interpreting, tensor_reason, use_kernel
from sd_kernels.runtime.launch import Launcher, cdiv, device_properties, next_pow2

_TILE_ELEMS = 8192  # elements per loop tile: 16 KiB of fp16 in flight per program and iteration
_SPLIT_ELEMS = 128 * 1024  # groups above this split (a fused program would stream too much alone)
_SPLIT_ELEMS_FEW = 32 * 1024  # ... or above this when there are fewer groups than _FEW_GROUPS
# Tuned on an H100; plan() scales them to the device (sm_count) and the profile (register_file_kb):
_H100_SMS = 132  # the SM count they were tuned at, and the one assumed without a CUDA device
_FEW_GROUPS = 64  # at 132 SMs: below this many (sample, group) pairs the fused path leaves most SMs idle
_TARGET_PROGRAMS = 512  # at 132 SMs: the split path aims for ≈ 4 programs per SM
_PIXEL_PROGRAMS = 512  # at 132 SMs: the pixel path's normalize programs over all samples (its own knob)
_PIXEL_STAT_PROGRAMS = 256  # ... and its statistics programs: each a few tiles (measured faster than one)
_HOPPER_REGISTERS_KB = 256  # 64 K 32-bit registers per block, where _ONE_TILE_ELEMS was tuned
_ONE_TILE_ELEMS = 16384  # a fused group up to this many (padded) elements is read once, kept in registers;
# also the most the warps can hold: the autotuner's 16 warps × 32 threads × 32 elements a thread
_ONE_TILE_FLOOR = 2048  # the one-tile bound of the smallest register file: 16 elements a thread at 4 warps

_NEG_LOG2E = tl.constexpr(-1.4426950408889634)


# ---------------------------------------------------------------------------------------------
# Device helpers


@triton.jit
def _load_tile(x_grp, c, s, HW, stride_c, stride_s, CPG: tl.constexpr):
    """x[c, s] of the group at ``x_grp`` as fp32 (0 where masked), and the mask.

    Offsets inside a group are int32 (the host checks that a group spans < 2³¹ elements); the
    group's base, which can pass 2³¹, is already in the int64 pointer."""
    mask = (c < CPG)[:, None] & (s < HW)[None, :]
    x = tl.load(x_grp + c[:, None] * stride_c + s[None, :] * stride_s, mask=mask, other=0.0)
    return x.to(tl.float32), mask


@triton.jit
def _chan_merge(count, mean, m2):
    """Merge k partial (count, mean, M2) (any shape, count 0 where empty) into one: Chan et al."""
    n = tl.sum(count)
    mu = tl.sum(count * mean) / tl.maximum(n, 1.0)
    d = mean - mu
    return n, mu, tl.sum(m2) + tl.sum(count * d * d)


@triton.jit
def _chunk_stats(x_grp, s_lo, s_hi, HW, stride_c, stride_s,
                 CPG: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr):
    """(count, mean, M2) of pixels [s_lo, s_hi) × all CPG channels: a Welford per lane, then a merge.

    The loop carries no reduction (no barrier between tiles), only a running mean and M2 per lane.
    Pixels outer, channels inner, and channel chunks that are all full or one chunk: a lane's
    masked tiles can only come after all its valid ones (the last pixel tile), so its count so far
    is the iteration number k, one scalar reciprocal per tile; its final count is computed after.
    """
    tl.static_assert(BLOCK_C >= CPG or CPG % BLOCK_C == 0)
    c = tl.arange(0, BLOCK_C)
    s = tl.arange(0, BLOCK_S)
    mean = tl.zeros((BLOCK_C, BLOCK_S), dtype=tl.float32)
    m2 = tl.zeros((BLOCK_C, BLOCK_S), dtype=tl.float32)
    k = 0.0
    for s0 in range(s_lo, s_hi, BLOCK_S):
        for c0 in range(0, CPG, BLOCK_C):
            x, mask = _load_tile(x_grp, c0 + c, s0 + s, HW, stride_c, stride_s, CPG)
            k += 1.0
            delta = x - mean
            mean = tl.where(mask, mean + delta * (1.0 / k), mean)
            m2 = tl.where(mask, m2 + delta * (x - mean), m2)
    # Valid tiles per lane: pixel tiles where s0 + s < s_hi, times the channel chunks if c < CPG.
    pixel_tiles = tl.maximum(s_hi - s_lo - s + (BLOCK_S - 1), 0) // BLOCK_S
    chunks = (CPG + BLOCK_C - 1) // BLOCK_C
    count = tl.where(c < CPG, chunks, 0)[:, None] * pixel_tiles[None, :]
    return _chan_merge(count.to(tl.float32), mean, m2)


@triton.jit
def _finish(y, ACT: tl.constexpr):
    if ACT == "silu":
        y = y / (1.0 + tl.exp2(y * _NEG_LOG2E))
    return y


@triton.jit
def _channel_affine(w_ptr, b_ptr, ch, c_mask, rstd, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Per-channel (scale, shift) with y = (x − mean)·scale + shift."""
    scale = tl.full(ch.shape, 1.0, tl.float32) * rstd
    if HAS_WEIGHT:
        scale = scale * tl.load(w_ptr + ch, mask=c_mask, other=0.0).to(tl.float32)
    shift = tl.zeros(ch.shape, dtype=tl.float32)
    if HAS_BIAS:
        shift = tl.load(b_ptr + ch, mask=c_mask, other=0.0).to(tl.float32)
    return scale, shift


def _autotune(key, tile=("BLOCK_C", "BLOCK_S"), per_thread=32):
    # Tiles are picked on the host; only the warps are tuned. The interpreter would run every config.
    # ``tile``: the constexprs whose product is the tile's element count; ``per_thread``: the most
    # tile elements a thread may hold (32: x, mean and M2 each in registers).
    warps = (4,) if interpreting() else (4, 8, 16)

    def prune(configs, named_args, **kwargs):
        args = {**named_args, **kwargs}
        elems = math.prod(args[name] for name in tile)
        kept = [c for c in configs if elems // (32 * c.num_warps) <= per_thread]
        return kept or configs[-1:]

    return triton.autotune([triton.Config({}, num_warps=w) for w in warps], key=key,
                           prune_configs_by={"early_config_prune": prune})


# ---------------------------------------------------------------------------------------------
# Kernels. Grid (N·G, S): program (pid_g, pid_s) owns pixels [pid_s·CHUNK, (pid_s + 1)·CHUNK) of
# group pid_g = n·G + g. CHUNK is a multiple of BLOCK_S, so only the last tile of a group is masked
# (by s < HW, whose divisibility Triton knows: masked loads stay vectorized).


@_autotune(key=["HW", "G", "S", "CPG", "BLOCK_C", "BLOCK_S"])
@triton.jit
def _group_stats_kernel(
    x_ptr, part_ptr, G, HW, S, stride_xn, stride_xc, stride_xs, CHUNK,
    CPG: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Split path, launch 1: partial (count, mean, M2) of every chunk, as part[3, N·G, S]."""
    pid_g, pid_s = tl.program_id(0), tl.program_id(1)
    n, g = pid_g // G, pid_g % G
    x_grp = x_ptr + n.to(tl.int64) * stride_xn + (g * CPG).to(tl.int64) * stride_xc
    s_lo = pid_s * CHUNK
    count, mean, m2 = _chunk_stats(x_grp, s_lo, tl.minimum(s_lo + CHUNK, HW), HW,
                                   stride_xc, stride_xs, CPG, BLOCK_C, BLOCK_S)
    plane = tl.num_programs(0) * S
    idx = pid_g * S + pid_s
    tl.store(part_ptr + idx, count)
    tl.store(part_ptr + plane + idx, mean)
    tl.store(part_ptr + 2 * plane + idx, m2)


# One program per group, the group one register tile (grid (N·G,)). Neither HW nor the tile follows
# the image size: HW bounds the pixel mask and counts pixels, and the tile is the largest a group of
# CPG channels may have (``plan``), so every size and batch at which a group is one tile shares one
# kernel per CPG (a channels-fast tile's vectors run along the channels). Where pixels are the vector
# axis of x or y (NCHW), HW_ALIGN (16 when HW is a multiple of 16, else 1) gives the mask the
# divisibility that keeps those loads and stores vectorized. HAS_SHIFT is a run-time flag (one load
# per program), so shifted and plain calls share the kernel too.
@_autotune(key=["HW", "G", "CPG", "BLOCK_C", "BLOCK_S"])
@triton.jit(do_not_specialize=["HW", "HAS_SHIFT"])
def _group_norm_tile_kernel(
    x_ptr, shift_ptr, y_ptr, w_ptr, b_ptr, G, HW, eps,
    stride_xn, stride_xc, stride_xs, stride_yn, stride_yc, stride_ys, HAS_SHIFT,
    CPG: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr, HW_ALIGN: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
):
    """y = act((x − mean)·rstd·w + b) over a group that is one register tile, read once (HAS_SHIFT != 0:
    x + shift[n, c] is, the sum made in registers)."""
    pid_g = tl.program_id(0)
    n, g = pid_g // G, pid_g % G
    x_grp = x_ptr + n.to(tl.int64) * stride_xn + (g * CPG).to(tl.int64) * stride_xc
    y_grp = y_ptr + n.to(tl.int64) * stride_yn + (g * CPG).to(tl.int64) * stride_yc
    c = tl.arange(0, BLOCK_C)
    s = tl.arange(0, BLOCK_S)
    x, mask = _load_tile(x_grp, c, s, _aligned(HW, HW_ALIGN), stride_xc, stride_xs, CPG)
    if HAS_SHIFT != 0:
        sh = tl.load(shift_ptr + n * G * CPG + g * CPG + c, mask=c < CPG, other=0.0).to(tl.float32)
        x = tl.where(mask, x + sh[:, None], 0.0)
    count = CPG * HW * 1.0
    mean = tl.div_rn(tl.sum(x), count)  # rounded division (``/`` is approximate): a constant group's is exact
    d = tl.where(mask, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(d * d) / count + eps)
    scale, shift = _channel_affine(w_ptr, b_ptr, g * CPG + c, c < CPG, rstd, HAS_WEIGHT, HAS_BIAS)
    y = _finish(d * scale[:, None] + shift[:, None], ACT)
    tl.store(y_grp + c[:, None] * stride_yc + s[None, :] * stride_ys, y.to(y_ptr.dtype.element_ty), mask=mask)


@_autotune(key=["HW", "G", "S", "CPG", "BLOCK_C", "BLOCK_S", "HAS_PARTIALS"])
@triton.jit
def _group_norm_kernel(
    x_ptr, y_ptr, w_ptr, b_ptr, part_ptr, G, HW, S, eps,
    stride_xn, stride_xc, stride_xs, stride_yn, stride_yc, stride_ys, CHUNK,
    CPG: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr,
    HAS_PARTIALS: tl.constexpr, PART_BLOCK: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
):
    """y = act((x − mean)·rstd·w + b) over this program's chunk of its group, streamed (looped and
    split paths; a shifted input was summed by the host). HAS_PARTIALS: the statistics are merged
    from the split path's partials; otherwise the program streams its group for them first."""
    pid_g = tl.program_id(0)
    pid_s = tl.program_id(1)
    if HAS_PARTIALS:  # reversed: the statistics launch read the last chunks last; L2 still has them
        pid_s = S - 1 - pid_s
    n, g = pid_g // G, pid_g % G
    x_grp = x_ptr + n.to(tl.int64) * stride_xn + (g * CPG).to(tl.int64) * stride_xc
    y_grp = y_ptr + n.to(tl.int64) * stride_yn + (g * CPG).to(tl.int64) * stride_yc
    w_base = g * CPG
    if HAS_PARTIALS:
        k = tl.arange(0, PART_BLOCK)
        plane = tl.num_programs(0) * S
        idx = pid_g * S + k
        k_mask = k < S
        count, mean, m2 = _chan_merge(tl.load(part_ptr + idx, mask=k_mask, other=0.0),
                                      tl.load(part_ptr + plane + idx, mask=k_mask, other=0.0),
                                      tl.load(part_ptr + 2 * plane + idx, mask=k_mask, other=0.0))
    else:
        count, mean, m2 = _chunk_stats(x_grp, 0, HW, HW, stride_xc, stride_xs, CPG, BLOCK_C, BLOCK_S)
    rstd = 1.0 / tl.sqrt(m2 / count + eps)
    s_lo = pid_s * CHUNK
    s_hi = tl.minimum(s_lo + CHUNK, HW)
    for c0 in range(0, CPG, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        scale, shift = _channel_affine(w_ptr, b_ptr, w_base + c, c < CPG, rstd, HAS_WEIGHT, HAS_BIAS)
        for s0 in range(s_lo, s_hi, BLOCK_S):
            s = s0 + tl.arange(0, BLOCK_S)
            x, mask = _load_tile(x_grp, c, s, HW, stride_xc, stride_xs, CPG)
            y = _finish((x - mean) * scale[:, None] + shift[:, None], ACT)
            tl.store(y_grp + c[:, None] * stride_yc + s[None, :] * stride_ys, y.to(y_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------
# Pixel path (channels-fast inputs). Grid (N, S): program (n, s) owns pixels [s·CHUNK, (s+1)·CHUNK)
# of sample n, all C channels: with channels stride 1 that is one contiguous [pixels, C] slab.
# The chunk's base is an int64 pointer; offsets inside a chunk are int32 (the host checks the span).
# HW, S and CHUNK are not specialized on (divisible by 16 or not): the loads are vectors along the
# channels, whose alignment the channel count and pixel stride (C) carry, so a new image size
# compiles nothing new here (a dozen Triton compilations fewer per size). Nor are CPG and HAS_SHIFT:
# they are run-time arguments (CPG sets a per-channel index once per program, HAS_SHIFT one load),
# so layers whose channel counts pad alike (SD1.5's 640 and 960, 1280 and 1920) and their shifted
# calls share one kernel; only the padded shapes (C_P, G_P, CPG_P, tiles) are compile-time.


@_autotune(key=["HW", "G", "S", "CPG", "C_P", "G_P", "CPG_P", "BLOCK_S"], tile=("BLOCK_S", "C_P"), per_thread=64)
@triton.jit(do_not_specialize=["HW", "S", "CHUNK", "CPG", "HAS_SHIFT"])
def _pixel_stats_kernel(
    x_ptr, shift_ptr, part_ptr, C, G, HW, S, stride_xn, stride_xc, stride_xs, CHUNK, CPG, HAS_SHIFT,
    C_P: tl.constexpr, G_P: tl.constexpr, CPG_P: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Pixel path, launch 1: partial (count, mean, M2) of every (sample, chunk, group), as
    part[3, N, G, S] (a group's S partials contiguous, for the merge launch).

    The tile is [BLOCK_S pixels, C_P = C padded to a power of two]: whole pixels, flat, read in
    full-width vectors. Every channel is shifted by its pivot p, the chunk's first value of that
    channel, and each lane sums d = x − p and d² over the chunk's tiles; the pixel lanes are reduced
    once, at the end (reducing every tile measured slower). A channel's mean is p + Σd/n and its
    M2 = Σd² − (Σd)²/n (the module docstring says why the shift keeps that subtraction exact
    enough); a gather lays the channels out as [G_P groups, CPG_P channels] (channel g·CPG + c at
    (g, c)) for a Chan merge of each group's channels. Fastest at 4 warps, 64 elements a thread:
    the only cross-warp reduction is the last one. HAS_SHIFT: the statistics are those of
    x + shift[n, c]; the shift moves only the pivot (d = (x + s) − (p + s) = x − p)."""
    pid_n, pid_s = tl.program_id(0), tl.program_id(1)
    s_lo = pid_s * CHUNK
    n_s = tl.minimum(CHUNK, HW - s_lo)  # pixels in this chunk
    x_blk = x_ptr + pid_n.to(tl.int64) * stride_xn + s_lo.to(tl.int64) * stride_xs
    s = tl.arange(0, BLOCK_S)[:, None]
    ch = tl.arange(0, C_P)[None, :]
    c_ok = ch < C
    pivot = tl.load(x_blk + ch * stride_xc, mask=c_ok, other=0.0).to(tl.float32)
    s1 = tl.zeros((BLOCK_S, C_P), dtype=tl.float32)
    s2 = tl.zeros((BLOCK_S, C_P), dtype=tl.float32)
    for s0 in range(0, n_s, BLOCK_S):
        mask = c_ok & (s0 + s < n_s)
        x = tl.load(x_blk + ch * stride_xc + (s0 + s) * stride_xs, mask=mask, other=0.0).to(tl.float32)
        d = tl.where(mask, x - pivot, 0.0)
        s1 += d
        s2 += d * d
    n = n_s.to(tl.float32)
    sum1, sum2 = tl.sum(s1, axis=0), tl.sum(s2, axis=0)  # [C_P]
    if HAS_SHIFT != 0:
        pivot += tl.load(shift_ptr + pid_n * C + ch, mask=c_ok, other=0.0).to(tl.float32)
    mu_c = tl.reshape(pivot, (C_P,)) + sum1 / n
    m2_c = tl.maximum(sum2 - sum1 * sum1 / n, 0.0)
    # Channels to groups: lane (g, c) takes channel g·CPG + c (clamped where the lane is padding).
    g = tl.arange(0, G_P)[:, None]
    c = tl.arange(0, CPG_P)[None, :]
    lane = (g < G) & (c < CPG)
    at = tl.reshape(tl.minimum(g * CPG + c, C_P - 1), (G_P * CPG_P,))
    mu_l = tl.reshape(tl.gather(mu_c, at, 0), (G_P, CPG_P))
    m2_l = tl.where(lane, tl.reshape(tl.gather(m2_c, at, 0), (G_P, CPG_P)), 0.0)
    mu = tl.sum(tl.where(lane, mu_l, 0.0), axis=1) / CPG  # every channel of a group has n pixels
    dg = tl.where(lane, mu_l - mu[:, None], 0.0)
    m2_g = tl.sum(m2_l + n * dg * dg, axis=1)
    gs = tl.arange(0, G_P)
    plane = tl.num_programs(0) * G * S
    idx = (pid_n * G + gs) * S + pid_s
    tl.store(part_ptr + idx, tl.zeros((G_P,), tl.float32) + CPG * n, mask=gs < G)
    tl.store(part_ptr + plane + idx, mu, mask=gs < G)
    tl.store(part_ptr + 2 * plane + idx, m2_g, mask=gs < G)


@triton.jit(do_not_specialize=["S"])
def _pixel_merge_kernel(part_ptr, stat_ptr, S, eps, PART_BLOCK: tl.constexpr):
    """Pixel path, launch 2, one program per (sample, group): merges the group's S partials (Chan)
    into (mean, rstd), stored as stat[2, N·G]."""
    pid = tl.program_id(0)
    plane = tl.num_programs(0) * S
    k = tl.arange(0, PART_BLOCK)
    idx = pid * S + k
    k_mask = k < S
    count, mean, m2 = _chan_merge(tl.load(part_ptr + idx, mask=k_mask, other=0.0),
                                  tl.load(part_ptr + plane + idx, mask=k_mask, other=0.0),
                                  tl.load(part_ptr + 2 * plane + idx, mask=k_mask, other=0.0))
    tl.store(stat_ptr + pid, mean)
    tl.store(stat_ptr + tl.num_programs(0) + pid, 1.0 / tl.sqrt(m2 / count + eps))


@_autotune(key=["C", "HW", "G", "S", "CPG", "BLOCK_C", "BLOCK_S"])
@triton.jit(do_not_specialize=["HW", "S", "CHUNK", "CPG", "HAS_SHIFT"])
def _pixel_norm_kernel(
    x_ptr, shift_ptr, y_ptr, w_ptr, b_ptr, stat_ptr, C, G, HW, S,
    stride_xn, stride_xc, stride_xs, stride_yn, stride_yc, stride_ys, CHUNK, CPG, HAS_SHIFT,
    BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
):
    """Pixel path, launch 3: y = act((x − mean)·(rstd·w) + b) over the chunk's [pixels, C] slab.

    The tile is [BLOCK_S pixels, BLOCK_C = C padded to a power of two]: whole pixels, flat, so a
    channels-last slab is read and written in full-width vectors. Per-channel mean and rstd·w are
    gathered once from the merged per-group statistics (group = channel // CPG). HAS_SHIFT: x + shift[n, c]
    is normalized, as x − (mean − shift)."""
    pid_n = tl.program_id(0)
    pid_s = S - 1 - tl.program_id(1)  # reversed: the statistics launch read the last chunks last
    s_lo = pid_s * CHUNK
    n_s = tl.minimum(CHUNK, HW - s_lo)
    x_blk = x_ptr + pid_n.to(tl.int64) * stride_xn + s_lo.to(tl.int64) * stride_xs
    y_blk = y_ptr + pid_n.to(tl.int64) * stride_yn + s_lo.to(tl.int64) * stride_ys
    ch = tl.arange(0, BLOCK_C)
    c_mask = ch < C
    stat_ptr += pid_n * G + ch // CPG  # stat[2, N·G], the merge launch's output
    mean = tl.load(stat_ptr, mask=c_mask, other=0.0)
    rstd = tl.load(stat_ptr + tl.num_programs(0) * G, mask=c_mask, other=0.0)
    if HAS_SHIFT != 0:
        mean -= tl.load(shift_ptr + pid_n * C + ch, mask=c_mask, other=0.0).to(tl.float32)
    scale, shift = _channel_affine(w_ptr, b_ptr, ch, c_mask, rstd, HAS_WEIGHT, HAS_BIAS)
    s = tl.arange(0, BLOCK_S)
    for s0 in range(0, n_s, BLOCK_S):
        mask = (s0 + s < n_s)[:, None] & c_mask[None, :]
        x = tl.load(x_blk + (s0 + s)[:, None] * stride_xs + ch[None, :] * stride_xc, mask=mask, other=0.0)
        y = _finish((x.to(tl.float32) - mean[None, :]) * scale[None, :] + shift[None, :], ACT)
        tl.store(y_blk + (s0 + s)[:, None] * stride_ys + ch[None, :] * stride_yc,
                 y.to(y_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------
# Host side


@dataclasses.dataclass(frozen=True)
class Plan:
    """How one call runs: tile shape, whether the group is one tile, the split into S chunks, and
    whether programs own whole pixels (``pixels``: the channels-fast path) rather than groups.

    Group paths: the tile is [block_c channels of a group, block_s pixels]; S chunks per group.
    Pixel path: the statistics tile is [block_s pixels, block_c = C padded to a power of two], the
    normalize tile [norm_block_s pixels, norm_block_c = C padded]; S chunks per sample."""

    block_c: int
    block_s: int
    one_tile: bool
    split: bool  # statistics reduced over chunks by a launch of their own
    chunk: int  # pixels per program
    chunks: int  # S: programs per group (pixel path: per sample)
    pixels: bool = False
    norm_block_c: int = 0  # pixel path only
    norm_block_s: int = 0
    stat_chunk: int = 0  # pixel path only: pixels per statistics program, whose launch has its own chunks
    stat_chunks: int = 0

    @property
    def launches(self) -> int:
        return 3 if self.pixels else 2 if self.split else 1

    @property
    def name(self) -> str:
        """The path, as the benchmark and ``sd-kernels info`` report it."""
        if self.pixels:
            return f"pixels x{self.chunks}"
        return "one_tile" if self.one_tile else f"split x{self.chunks}" if self.split else "looped"


_SMS: dict[int, int] = {}  # device index (-1: CPU) -> SM count


def sm_count(device_index: int) -> int:
    """The SM count of CUDA device ``device_index`` (``tensor.get_device()``), queried once per device;
    132 (the H100's, what the constants were tuned at) for the CPU (-1) and under the interpreter."""
    sms = _SMS.get(device_index)
    if sms is None:
        cpu = device_index < 0 or interpreting()
        sms = _SMS[device_index] = _H100_SMS if cpu else device_properties(device_index).multi_processor_count
    return sms


def one_tile_elems(register_file_kb: int | None) -> int:
    """The one-tile bound for a profile's register file per block: 16384 elements at Hopper's 256 KB,
    proportionally fewer with fewer registers (at least 2048), never more (the warps' limit); None
    (unknown, e.g. the mobile emulations): 16384."""
    if register_file_kb is None:
        return _ONE_TILE_ELEMS
    return min(_ONE_TILE_ELEMS, max(_ONE_TILE_FLOOR, _ONE_TILE_ELEMS * register_file_kb // _HOPPER_REGISTERS_KB))


def _per_sms(at_h100: int, sms: int) -> int:
    """A count tuned at 132 SMs, scaled to ``sms`` (rounded; exact at 132)."""
    return max(1, (at_h100 * sms + _H100_SMS // 2) // _H100_SMS)


def plan(n: int, groups: int, cpg: int, hw: int, channels_fast: bool,
         split_threshold: int | None = None, *, sms: int = _H100_SMS, register_file_kb: int | None = None,
         pixels: bool | None = None) -> Plan:
    """The path and tiles for x [n, groups·cpg, hw] (``channels_fast``: channels have the smaller
    stride, e.g. channels_last). ``split_threshold``: group elements above which the split path
    runs; None applies the size heuristic (see the module docstring). ``sms``: the device's SM count
    (``sm_count``), which scales _FEW_GROUPS, _TARGET_PROGRAMS, _PIXEL_PROGRAMS and _PIXEL_STAT_PROGRAMS;
    ``register_file_kb``: the active profile's, which bounds the one-tile path (``one_tile_elems``).
    ``pixels``: None lets the
    heuristic choose the pixel path (channels-fast inputs whose group is not one tile and whose
    padded pixel fits a tile); True forces it (ValueError unless ``channels_fast``); False keeps
    the group paths."""
    group_elems, programs = cpg * hw, n * groups
    if pixels and not channels_fast:
        raise ValueError("the pixel path needs channels-fast input (channels stride < spatial stride)")
    if split_threshold is None:
        split_threshold = _SPLIT_ELEMS if programs >= _per_sms(_FEW_GROUPS, sms) else _SPLIT_ELEMS_FEW
    split = group_elems > split_threshold
    p2c, p2s, one_tile = next_pow2(cpg), next_pow2(hw), one_tile_elems(register_file_kb)
    if not pixels and not split and p2c * p2s <= one_tile:  # the largest tile of CPG channels: one kernel at every size
        return Plan(p2c, one_tile // p2c, one_tile=True, split=False, chunk=hw, chunks=1)
    if pixels or (pixels is None and channels_fast and next_pow2(groups * cpg) <= _TILE_ELEMS):
        return _pixel_plan(n, groups, cpg, hw, sms)
    if channels_fast and p2c <= _TILE_ELEMS:  # a pixel's CPG channels are one contiguous run: all of it
        block_c = p2c
    else:  # pixels are contiguous: a power-of-two divisor of CPG leaves no masked channel lanes
        block_c = min(cpg & -cpg, max(1, _TILE_ELEMS // 64))
    block_s = max(1, min(p2s, _TILE_ELEMS // block_c))
    tiles = cdiv(hw, block_s)
    if not split:
        return Plan(block_c, block_s, one_tile=False, split=False, chunk=tiles * block_s, chunks=1)
    per_group = min(tiles, cdiv(_per_sms(_TARGET_PROGRAMS, sms), programs))
    chunk = cdiv(tiles, per_group) * block_s
    return Plan(block_c, block_s, one_tile=False, split=True, chunk=chunk, chunks=cdiv(hw, chunk))


def _pixel_plan(n: int, groups: int, cpg: int, hw: int, sms: int) -> Plan:
    """The pixel path's tiles and chunks: ≈ _PIXEL_PROGRAMS normalize and _PIXEL_STAT_PROGRAMS
    statistics programs (scaled to the SMs) over all samples, each a whole number of statistics
    tiles; the normalize tile is the largest power of two of pixels dividing the chunk that fits
    _TILE_ELEMS with C padded (at least one pixel)."""
    block_c = norm_c = next_pow2(groups * cpg)
    block_s = max(1, min(next_pow2(hw), _TILE_ELEMS // block_c))
    tiles = cdiv(hw, block_s)

    def chunking(programs: int) -> tuple[int, int]:
        chunk = cdiv(tiles, min(tiles, cdiv(_per_sms(programs, sms), n))) * block_s
        return chunk, cdiv(hw, chunk)

    (chunk, chunks), (stat_chunk, stat_chunks) = chunking(_PIXEL_PROGRAMS), chunking(_PIXEL_STAT_PROGRAMS)
    norm_s = max(1, min(chunk & -chunk, _TILE_ELEMS // norm_c))
    return Plan(block_c, block_s, one_tile=False, split=True, chunk=chunk, chunks=chunks,
                pixels=True, norm_block_c=norm_c, norm_block_s=norm_s, stat_chunk=stat_chunk, stat_chunks=stat_chunks)


def _merge_block(sms: int) -> int:
    """The merge launch's lanes: the most statistics chunks a sample can have on this GPU (``_pixel_plan``
    makes at most _PIXEL_STAT_PROGRAMS, scaled to the SMs, over all samples), whatever the size and
    batch, so one compilation serves them all (lanes sized to each call's chunk count compiled it again
    at a new size or batch)."""
    return next_pow2(_per_sms(_PIXEL_STAT_PROGRAMS, sms))


_STATS, _NORM, _TILE = Launcher(_group_stats_kernel), Launcher(_group_norm_kernel), Launcher(_group_norm_tile_kernel)
_PIXEL_STATS, _PIXEL_MERGE, _PIXEL_NORM = (Launcher(_pixel_stats_kernel), Launcher(_pixel_merge_kernel),
                                           Launcher(_pixel_norm_kernel))


def _alloc(shape, stride, like: torch.Tensor) -> torch.Tensor:
    """Every output of this module comes from here (tests poison it to catch unwritten elements)."""
    return torch.empty_strided(tuple(shape), tuple(stride), dtype=like.dtype, device=like.device)


def _spatial_stride(x: torch.Tensor) -> int | None:
    """The one stride through which x's spatial dims (2…) read as a flat run, or None if none does."""
    dims = [(x.shape[d], x.stride(d)) for d in range(2, x.dim()) if x.shape[d] != 1]
    if not dims:
        return 1
    for (_, outer), (size, inner) in zip(dims, dims[1:]):
        if outer != inner * size:
            return None
    return dims[-1][1]


def _check(x: torch.Tensor, num_groups: int, weight, bias) -> None:
    """The checks F.group_norm makes, with its error types and messages."""
    if isinstance(num_groups, bool) or not isinstance(num_groups, int):
        raise TypeError(f"group_norm(): argument 'num_groups' must be int, not {type(num_groups).__name__}")
    if x.dim() < 2:
        raise RuntimeError(f"Expected at least 2 dimensions for input tensor but received {x.dim()}")
    c = x.shape[1]
    if num_groups <= 0 or c % num_groups:
        raise RuntimeError(
            "Expected number of channels in input to be divisible by num_groups, but got input of shape "
            f"{list(x.shape)} and num_groups={num_groups}"
        )
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (t.dim() != 1 or t.numel() != c):
            raise RuntimeError(
                f"Expected {name} to be a vector of size equal to the number of channels in input, but got "
                f"{name} of shape {list(t.shape)} and input of shape {list(x.shape)}"
            )


def _span_reason(x: torch.Tensor, cpg: int, hw: int, stride_s: int | None) -> str | None:
    """In-group offsets are int32: the group's extent in x (or in a contiguous copy / output) must fit."""
    span = max(cpg * hw, 0 if stride_s is None else (cpg - 1) * abs(x.stride(1)) + (hw - 1) * abs(stride_s))
    return f"one group spans {span} elements (the kernel's in-group offsets are int32)" if span >= 2**31 else None


def _check_shift(x: torch.Tensor, shift: torch.Tensor | None) -> None:
    if shift is not None and (shift.dim() != 2 or tuple(shift.shape) != tuple(x.shape[:2])
                              or not shift.is_floating_point()):
        raise ValueError(f"group_norm: shift must be a floating-point [N, C] = {list(x.shape[:2])} tensor, got "
                         f"{shift.dtype} {list(shift.shape)}")


def _shifted(x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """x + shift[:, :, None, …] in x's dtype and memory format (the streaming group paths' input when
    shifted): one elementwise kernel over x, the shift rounded to x's dtype first."""
    return x + shift.to(x.dtype).view(*shift.shape, *(1,) * (x.dim() - 2))


def _kernel_reason(x: torch.Tensor, weight, bias, shift=None) -> str | None:
    reason = tensor_reason(x, weight, bias, shift)
    if reason is None and x.numel() == 0:
        return "empty input"
    return reason

def group_norm(
    x: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    activation: str | None = None,
    *,
    shift: torch.Tensor | None = None,
    split_threshold: int | None = None,
    pixels: bool | None = None,
) -> torch.Tensor:
    """``F.group_norm(x, num_groups, weight, bias, eps)``, then ``activation`` ("silu" or None), fused.

    x is [N, C, *spatial] in any memory format; the output keeps x's strides when x is dense
    (contiguous, channels_last, permuted). ``shift`` ([N, C], any float dtype): normalize
    x + shift[:, :, None, …] instead, the sum in fp32 and never written (the pixel path folds it into
    its pivots and means, a one-tile group adds it in registers); the streaming group paths (looped,
    split) add it to x first, in x's dtype, one elementwise kernel. ``split_threshold``
    (group elements above which the two-launch split path runs; None: the size heuristic) and
    ``pixels`` (None: the heuristic; True: the pixel path, for channels-fast x only; False: never)
    are for tuning and tests (``plan``).
    """
    reference.check_activation(activation)
    _check(x, num_groups, weight, bias)
    _check_shift(x, shift)
    n, c = x.shape[:2]
    hw, cpg = math.prod(x.shape[2:]), c // num_groups
    stride_s = _spatial_stride(x)
    reason = _kernel_reason(x, weight, bias, shift) or _span_reason(x, cpg, hw, stride_s)
    if not use_kernel("group_norm", x, weight, bias, shift, unsupported=reason):
        return reference.group_norm(x, num_groups, weight, bias, eps, activation, shift=shift)
    weight, bias = vectors(weight, bias)
    if stride_s is None:  # spatial dims with no common stride (e.g. H and W swapped): one copy
        x = x.contiguous()
        stride_s = _spatial_stride(x)
    y = _alloc(x.shape, x.stride() if is_dense(x) else contiguous_strides(x.shape), x)
    ys = _spatial_stride(y)
    channels_fast = hw == 1 or abs(x.stride(1)) < abs(stride_s)
    sms, kb = sm_count(x.get_device()), active_profile().register_file_kb
    p = plan(n, num_groups, cpg, hw, channels_fast, split_threshold, sms=sms, register_file_kb=kb, pixels=pixels)
    # The pixel path's in-chunk offsets are int32: a chunk's extent in x and y must fit (it always
    # does at SD's sizes; a sample of > 2³¹ elements in one chunk plans the group paths instead).
    chunk_span = ((max(p.chunk, p.stat_chunk) - 1) * max(abs(stride_s), abs(ys))
                  + (c - 1) * max(abs(x.stride(1)), abs(y.stride(1))))
    if p.pixels and chunk_span >= 2**31:
        p = plan(n, num_groups, cpg, hw, channels_fast, split_threshold, sms=sms, register_file_kb=kb, pixels=False)
    if shift is not None and not (p.pixels or p.one_tile):  # the streaming group paths normalize the sum, made here
        x, shift = _shifted(x, shift), None
        stride_s = _spatial_stride(x)
    # The shift as fp32 (the patch's is), a missing one as an fp32 null pointer: one kernel serves both.
    shift_arg = x.new_empty(0, dtype=torch.float32) if shift is None else shift.float().contiguous()

    grid = (n * num_groups, p.chunks)
    # Launcher keys: the autotuners key on (HW, G, S, CPG, tiles, path) and the dtypes, all set by
    # (hw, num_groups, cpg, p) and the tensors' dtypes; a shifted call is a key of its own in the tables
    # (the shipped entries choose as for the plain call: the kernels are shared).
    key = (hw, num_groups, cpg, p, x.dtype, None if weight is None else weight.dtype,
           None if bias is None else bias.dtype, activation) + (() if shift is None else ("shift",))
    if p.pixels:  # statistics, merge, normalize; one fp32 buffer: part[3, N, G, S_stat], then stat[2, N·G]
        buf = torch.empty((3 * p.stat_chunks + 2) * n * num_groups, dtype=torch.float32, device=x.device)
        parts, stat = buf.split([3 * p.stat_chunks * n * num_groups, 2 * n * num_groups])
        _PIXEL_STATS(
            key, (n, p.stat_chunks), x, shift_arg, parts, c, num_groups, hw, p.stat_chunks,
            x.stride(0), x.stride(1), stride_s, p.stat_chunk, cpg, int(shift is not None),
            C_P=p.block_c, G_P=next_pow2(num_groups), CPG_P=next_pow2(cpg), BLOCK_S=p.block_s,
        )
        _PIXEL_MERGE(key, (n * num_groups,), parts, stat, p.stat_chunks, float(eps),
                     PART_BLOCK=_merge_block(sms))
        _PIXEL_NORM(
            key, (n, p.chunks), x, shift_arg, y, weight if weight is not None else x,
            bias if bias is not None else x, stat, c, num_groups, hw, p.chunks,
            x.stride(0), x.stride(1), stride_s, y.stride(0), y.stride(1), ys, p.chunk, cpg, int(shift is not None),
            BLOCK_C=p.norm_block_c, BLOCK_S=p.norm_block_s,
            HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, ACT=activation or "none",
        )
        return y
    if p.one_tile:  # HW_ALIGN: HW's divisibility where pixels are x's or y's vector axis (see the kernel)
        _TILE(
            key, (n * num_groups,), x, shift_arg, y, weight if weight is not None else x,
            bias if bias is not None else x, num_groups, hw, float(eps),
            x.stride(0), x.stride(1), stride_s, y.stride(0), y.stride(1), ys, int(shift is not None),
            CPG=cpg, BLOCK_C=p.block_c, BLOCK_S=p.block_s, HW_ALIGN=16 if hw % 16 == 0 and 1 in (stride_s, ys) else 1,
            HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, ACT=activation or "none",
        )
        return y
    parts = x  # dummy pointer when unused
    if p.split:
        parts = torch.empty(3 * n * num_groups * p.chunks, dtype=torch.float32, device=x.device)
        _STATS(
            key, grid, x, parts, num_groups, hw, p.chunks, x.stride(0), x.stride(1), stride_s, p.chunk,
            CPG=cpg, BLOCK_C=p.block_c, BLOCK_S=p.block_s,
        )
    _NORM(
        key, grid, x, y, weight if weight is not None else x, bias if bias is not None else x, parts,
        num_groups, hw, p.chunks, float(eps),
        x.stride(0), x.stride(1), stride_s, y.stride(0), y.stride(1), ys, p.chunk,
        CPG=cpg, BLOCK_C=p.block_c, BLOCK_S=p.block_s, HAS_PARTIALS=p.split, PART_BLOCK=next_pow2(p.chunks),
        HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, ACT=activation or "none",
    )
    return y
