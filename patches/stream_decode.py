"""A VAE decode that streams the up-stack in row bands under an intermediate-memory budget, exact.

The decoder's GroupNorms normalize with statistics of the *whole* image, so a band cannot be run
alone: everything before a norm must have been seen before the norm applies. The decode therefore
runs as a few **segments**, each from an activation kept in memory (``_Rows``: row chunks, dropped
from the top as they are consumed) to the next one kept, or to the image:

1. the head (conv_in and the mid-block, with its global attention) at latent resolution, whole;
2. per segment, for each norm of its units in order whose statistics are not known yet, a
   **statistics pass**: the segment's units up to that norm run band by band, the other norms
   applying their known statistics, and the norm's input rows that the band owns are summed per
   (sample, group) (``ops.group_stats``: count, mean, M2; bands merged with Chan's formula, no
   E[x²] − E[x]² cancellation), then the pass stops at the norm (``_Stop``). A norm that reads the
   segment's kept input directly (a ResNet's norm1, the output norm) needs no pass: its statistics
   come from the kept chunks;
3. the segment's **final pass** runs its units band by band with every norm applying the whole
   image's statistics (``ops.group_norm_given``) and keeps each band's rows of the output.

A band of a unit's output needs a few more rows of its input (``Unit.need``: 2 for a ResNet's two
3×3 convs, 1 input row for nearest-2× + 3×3 conv); the unit runs on that taller band (each conv's
zero padding lands on rows that are cropped away, except at the image's edges, where it is the
real padding) and the band's own rows are kept: no seams, the untiled decode to rounding.

``plan`` chooses where segments end and how many bands each takes, from a memory model (what is
kept + a band's working set; ``_working``) and a time model (convolution FLOPs + a host cost per
unit and band; ``_cost``): keeping an activation saves the passes that would recompute it, but it
must fit under the budget beside a band. The model only chooses; bench.memory measures the peak.
Verified against diffusers 0.42.1's Decoder.forward and UpDecoderBlock2D.forward (source hashes); an
unverified diffusers, a decoder of another structure (SpatialNorm, a transposed-conv upsampler) or
a latent_embeds argument runs the original forward.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import weakref
from collections.abc import Callable, Iterator

import torch
import torch.nn as nn

from sd_kernels.ops.group_stats import group_norm_given, group_partials, mean_rstd, merge_group_stats

from .record import set_instance_attr
from .verified import is_verified

log = logging.getLogger("sd_kernels")

# The time model (bench.memory measures the real thing): effective conv throughput and the host
# time of one unit on one band (its ~10 launches).
_FLOPS = 300e12
_UNIT_SECONDS = 60e-6
_WORKING_COPIES = 5  # a unit's band: its input, the block's intermediates, the add and the scale (measured on the H100)
_SEGMENT_SECONDS = 10e-6  # a segment's own bookkeeping: of two equal plans, the one of fewer segments
_MAX_BANDS = 128  # the most bands a segment is cut into (host time grows with them)
_PLAN_SHARE = 0.9  # the share of the budget the model may plan to (the rest: what it does not see)


class Unsupported(Exception):
    """The decoder is not one this module streams (the message says why)."""


class _Stop(Exception):
    """Ends a statistics pass at the norm being measured."""


@dataclasses.dataclass
class Unit:
    """One step of the up-stack: a ResNet block, an upsampler or the output head (norm, act, conv)."""

    name: str
    call: Callable[[torch.Tensor], torch.Tensor]
    radius: int  # input rows of context a band's output needs on each side
    scale: int  # output rows per input row
    c_in: int
    c_out: int
    norms: tuple[nn.Module, ...] = ()  # the GroupNorms it calls, in order; the first reads its input
    flops: tuple[float, ...] = (0.0,)  # per output pixel: before each norm, then in all (last)

    def need(self, lo: int, hi: int, height: int) -> tuple[int, int]:
        """Input rows [ilo, ihi) that output rows [lo, hi) need (clipped to the input's height)."""
        if self.scale == 1:
            return max(lo - self.radius, 0), min(hi + self.radius, height)
        # nearest upsampling, then a conv of radius ``radius`` at the output resolution
        return max((lo - self.radius) // self.scale, 0), min(-(-(hi + self.radius) // self.scale), height)


def _conv_radius(conv: nn.Module) -> int:
    k, p, s, d = conv.kernel_size, conv.padding, conv.stride, conv.dilation
    if not isinstance(conv, nn.Conv2d) or k[0] != k[1] or s != (1, 1) or d != (1, 1) or p != (k[0] // 2,) * 2 \
            or k[0] % 2 == 0:
        raise Unsupported(f"a convolution other than a same-padded odd square one ({conv})")
    return k[0] // 2


def _is_group_norm(m: nn.Module) -> bool:
    return isinstance(m, nn.GroupNorm)


def _resnet(name: str, r: nn.Module) -> Unit:
    norms = (r.norm1, r.norm2)
    if type(r).__name__ != "ResnetBlock2D" or r.up or r.down or not all(map(_is_group_norm, norms)):
        raise Unsupported(f"{name} is a {type(r).__name__} with up/down sampling or conditioned norms")
    c_in, c_out = r.conv1.in_channels, r.conv2.out_channels
    k1, k2 = ((2 * _conv_radius(c) + 1) ** 2 for c in (r.conv1, r.conv2))
    conv1 = 2 * k1 * c_in * c_out
    total = conv1 + 2 * k2 * c_out * c_out + (2 * c_in * c_out if r.conv_shortcut is not None else 0)
    return Unit(name, lambda x: r(x, None), _conv_radius(r.conv1) + _conv_radius(r.conv2), 1, c_in, c_out,
                norms, (0.0, conv1, total))


def _upsampler(name: str, u: nn.Module) -> Unit:
    if (type(u).__name__ != "Upsample2D" or not u.use_conv or u.use_conv_transpose or not u.interpolate
            or u.norm is not None or u.name != "conv"):
        raise Unsupported(f"{name} is not a nearest-2× + conv Upsample2D")
    c = u.conv.in_channels
    k = 2 * _conv_radius(u.conv) + 1
    return Unit(name, lambda x: u(x), _conv_radius(u.conv), 2, c, u.conv.out_channels, (),
                (2.0 * k * k * c * u.conv.out_channels,))


def units(decoder: nn.Module) -> list[Unit]:
    """The up-stack of a diffusers ``Decoder`` as units, in order; ``Unsupported`` says why not."""
    from diffusers.models.autoencoders.vae import Decoder
    from diffusers.models.unets.unet_2d_blocks import UpDecoderBlock2D

    if type(decoder) is not Decoder or not is_verified(Decoder.forward) or not is_verified(UpDecoderBlock2D.forward):
        raise Unsupported("not diffusers 0.42.1's Decoder (its forward and its blocks' are re-stated here)")
    out: list[Unit] = []
    for i, block in enumerate(decoder.up_blocks):
        if type(block) is not UpDecoderBlock2D:
            raise Unsupported(f"up_blocks.{i} is a {type(block).__name__}")
        out += [_resnet(f"up_blocks.{i}.resnets.{j}", r) for j, r in enumerate(block.resnets)]
        out += [_upsampler(f"up_blocks.{i}.upsamplers.{j}", u) for j, u in enumerate(block.upsamplers or ())]
    norm, conv = decoder.conv_norm_out, decoder.conv_out
    if not _is_group_norm(norm):
        raise Unsupported(f"conv_norm_out is a {type(norm).__name__}")
    k = 2 * _conv_radius(conv) + 1
    out.append(Unit("conv_out", lambda x: conv(decoder.conv_act(norm(x))), _conv_radius(conv), 1, conv.in_channels,
                    conv.out_channels, (norm,), (0.0, 2.0 * k * k * conv.in_channels * conv.out_channels)))
    return out


# ---------------------------------------------------------------------------------------------
# The plan


@dataclasses.dataclass(frozen=True)
class Segment:
    start: int  # units[start:stop], from the activation kept before ``start`` to the one after ``stop - 1``
    stop: int
    bands: int  # bands over each pass's last unit's output


@dataclasses.dataclass(frozen=True)
class Plan:
    segments: tuple[Segment, ...]
    peak: int  # the model's estimate, bytes
    seconds: float  # the model's estimate
    budget: int

    @property
    def untiled(self) -> bool:
        return all(s.bands == 1 for s in self.segments)

    def format(self, us: list[Unit]) -> str:
        parts = [f"{us[s.start].name}..{us[s.stop - 1].name} in {s.bands} band(s)" for s in self.segments]
        return (f"{len(self.segments)} segments ({'; '.join(parts)}), model peak {self.peak / 2**20:.1f} MiB of "
                f"{self.budget / 2**20:.1f}, model time {self.seconds * 1e3:.1f} ms")


@dataclasses.dataclass(frozen=True)
class _Shape:
    """Per unit: input and output heights and output widths; the element size and the samples."""

    h_in: tuple[int, ...]
    h_out: tuple[int, ...]
    w_out: tuple[int, ...]
    elem: int
    n: int

    def out_bytes(self, us: list[Unit], j: int) -> int:
        return self.n * us[j].c_out * self.h_out[j] * self.w_out[j] * self.elem


def _shape(us: list[Unit], n: int, h: int, w: int, elem: int) -> _Shape:
    h_in, h_out, w_out = [], [], []
    for u in us:
        h_in.append(h)
        h, w = h * u.scale, w * u.scale
        h_out.append(h)
        w_out.append(w)
    return _Shape(tuple(h_in), tuple(h_out), tuple(w_out), elem, n)


def _band_rows(us: list[Unit], sh: _Shape, start: int, last: int, bands: int) -> list[int]:
    """Output rows of each unit start..last for one band of ``bands`` over unit ``last``'s output."""
    rows = [0] * (last + 1)
    r = -(-sh.h_out[last] // bands)
    for j in range(last, start - 1, -1):
        rows[j] = min(r, sh.h_out[j])
        r = min(-(-rows[j] // us[j].scale) + 2 * -(-us[j].radius // us[j].scale), sh.h_in[j])
    return rows


def _working(us: list[Unit], sh: _Shape, start: int, last: int, bands: int) -> int:
    """Bytes a band of units start..last holds at once (the widest unit's, ``_WORKING_COPIES`` times)."""
    rows = _band_rows(us, sh, start, last, bands)
    # a unit computes on its whole input band: its output band with the halo, at the output width
    return max(_WORKING_COPIES * sh.n * sh.elem * sh.w_out[j] * max(us[j].c_in, us[j].c_out)
               * min(sh.h_out[j], rows[j] + 2 * us[j].radius * us[j].scale)
               for j in range(start, last + 1))


def _pass_seconds(us: list[Unit], sh: _Shape, start: int, last: int, bands: int, flops_index: int) -> float:
    """Units start..last on all bands, the last one up to its ``flops_index`` entry."""
    rows = _band_rows(us, sh, start, last, bands)
    flops = 0.0
    for j in range(start, last + 1):
        per_px = us[j].flops[flops_index if j == last else -1]
        flops += per_px * sh.n * sh.w_out[j] * min(sh.h_out[j], (rows[j] + 2 * us[j].radius * us[j].scale) * bands)
    return flops / _FLOPS + bands * (last - start + 1) * _UNIT_SECONDS


def _cost(us: list[Unit], sh: _Shape, start: int, stop: int, bands: int) -> float:
    """Seconds of a segment: a statistics pass per norm that does not read the kept input, the final
    pass; in one band, only the final pass (the norms see the whole tensor)."""
    seconds = _SEGMENT_SECONDS + _pass_seconds(us, sh, start, stop - 1, bands, -1)
    if bands == 1:
        return seconds
    for j in range(start, stop):
        for k in range(len(us[j].norms)):
            if j > start or k > 0:
                seconds += _pass_seconds(us, sh, start, j, bands, k)
    return seconds


def plan(us: list[Unit], n: int, h: int, w: int, elem: int, budget: int, head_bytes: int) -> Plan:
    """Segments and bands for a latent of n×h×w (head output ``head_bytes``) under ``budget`` bytes:
    the fastest plan (``_cost``) whose modelled peak fits ``_PLAN_SHARE`` of the budget; if none
    does, the one of the smallest modelled peak."""
    sh = _shape(us, n, h, w, elem)
    kept = [head_bytes] + [sh.out_bytes(us, j) for j in range(len(us))]  # kept[j]: input of unit j
    limit = budget * _PLAN_SHARE
    # best[i]: (seconds, peak, segments) of the up-stack's units [0, i) with unit i-1's output kept
    best: list[tuple[float, int, tuple[Segment, ...]] | None] = [(0.0, kept[0], ())] + [None] * len(us)
    fallback: list[tuple[int, float, tuple[Segment, ...]] | None] = [(kept[0], 0.0, ())] + [None] * len(us)
    for stop in range(1, len(us) + 1):
        for start in range(stop):
            if best[start] is None and fallback[start] is None:
                continue
            for bands in _band_counts(sh.h_out[stop - 1]):
                # the input is dropped a chunk at a time as the output grows: both, nearly, at the end
                held = kept[start] + kept[stop]
                peak = held + _working(us, sh, start, stop - 1, bands)
                seconds = _cost(us, sh, start, stop, bands)
                if best[start] is not None and peak <= limit:
                    done, done_peak, segments = best[start]
                    cand = (done + seconds, max(done_peak, peak), segments + (Segment(start, stop, bands),))
                    if best[stop] is None or cand[0] < best[stop][0]:
                        best[stop] = cand
                prev = fallback[start]
                cand2 = (max(prev[0], peak), prev[1] + seconds, prev[2] + (Segment(start, stop, bands),))
                if fallback[stop] is None or cand2[:2] < fallback[stop][:2]:
                    fallback[stop] = cand2
    if best[-1] is not None:
        seconds, peak, segments = best[-1]
    else:
        peak, seconds, segments = fallback[-1]
    return Plan(segments, peak, seconds, budget)


def _band_counts(height: int) -> Iterator[int]:
    """Band counts worth trying over ``height`` rows: each distinct band height ⌈height / k⌉ once."""
    seen = set()
    for k in range(1, min(height, _MAX_BANDS) + 1):
        r = -(-height // k)
        if r not in seen:
            seen.add(r)
            yield -(-height // r)


# ---------------------------------------------------------------------------------------------
# Running it


class _Rows:
    """An [N, C, H, W] activation kept as row chunks appended top to bottom; read by row range;
    dropped from the top once consumed."""

    def __init__(self, first: torch.Tensor | None = None) -> None:
        self.chunks: list[tuple[int, torch.Tensor]] = [] if first is None else [(0, first)]

    def append(self, lo: int, t: torch.Tensor) -> None:
        self.chunks.append((lo, t))

    def rows(self, lo: int, hi: int) -> torch.Tensor:
        parts = [t[:, :, max(lo, a) - a:min(hi, a + t.shape[2]) - a] for a, t in self.chunks
                 if a < hi and a + t.shape[2] > lo]
        return parts[0] if len(parts) == 1 else torch.cat(parts, 2)

    def drop_before(self, row: int) -> None:
        self.chunks = [(a, t) for a, t in self.chunks if a + t.shape[2] > row]


def _compact(t: torch.Tensor) -> torch.Tensor:
    """``t`` in a storage of its own size (a band's own rows are a view into the band with its halo)."""
    fmt = torch.channels_last if t.dim() == 4 and t.stride(1) == 1 and t.shape[1] > 1 else torch.contiguous_format
    return t.contiguous(memory_format=fmt) if t.is_contiguous(memory_format=fmt) else t.clone(memory_format=fmt)


def _spans(us: list[Unit], sh: _Shape, start: int, last: int, lo: int, hi: int) -> list[tuple[int, int, int, int]]:
    """(input lo, input hi, output lo, output hi) of units start..last for output rows [lo, hi) of the last."""
    spans = []
    for j in range(last, start - 1, -1):
        ilo, ihi = us[j].need(lo, hi, sh.h_in[j])
        spans.append((ilo, ihi, lo, hi))
        lo, hi = ilo, ihi
    return spans[::-1]


class _Measure:
    """A norm's stand-in during its statistics pass: adds the band's own rows' (count, mean, M2)."""

    def __init__(self, norm: nn.Module) -> None:
        self.norm, self.parts, self.own = norm, [], (0, 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.parts.append(group_partials(x[:, :, self.own[0]:self.own[1]], self.norm.num_groups))
        raise _Stop

    def stats(self) -> torch.Tensor:
        return mean_rstd(merge_group_stats(torch.cat(self.parts, -1)), self.norm.eps)


def _apply_given(norm: nn.Module, stats: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return group_norm_given(x, stats, norm.weight, norm.bias, getattr(norm, "activation", None))


def _unexpected(x: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("sd_kernels: a norm without statistics ran in a streamed decode (a bug)")


@contextlib.contextmanager
def _norm_forwards(norms: list[nn.Module], stats: dict[nn.Module, torch.Tensor],
                   measure: _Measure | None) -> Iterator[None]:
    """Instance forwards for one pass: known statistics applied, the measured norm measuring."""
    restores = []
    for norm in norms:
        if norm in stats:
            forward = functools.partial(_apply_given, norm, stats[norm])
        else:
            forward = measure if measure is not None and measure.norm is norm else _unexpected
        restores.append(set_instance_attr(norm, "forward", forward, "the streamed decode", "its pass began"))
    try:
        yield
    finally:
        for restore in reversed(restores):
            restore()


def _bands(height: int, bands: int) -> list[tuple[int, int]]:
    r = -(-height // bands)
    return [(lo, min(lo + r, height)) for lo in range(0, height, r)]


def _run_band(us: list[Unit], spans: list[tuple[int, int, int, int]], src: _Rows, start: int,
              measure: _Measure | None = None) -> torch.Tensor:
    x = src.rows(spans[0][0], spans[0][1])
    for j, (ilo, _, lo, hi) in enumerate(spans, start):
        if measure is not None and j == len(spans) + start - 1:
            measure.own = (lo - ilo, hi - ilo)  # a unit with norms keeps its rows (scale 1)
        first = ilo * us[j].scale
        x = us[j].call(x)[:, :, lo - first:hi - first]
    return x


def stream_decode(decoder: nn.Module, us: list[Unit], p: Plan, z: torch.Tensor,
                  on_segment: Callable[[Segment], None] | None = None) -> torch.Tensor:
    """``decoder(z)`` by plan ``p`` (see the module docstring); ``on_segment`` is called after each
    segment (bench.stream_decode reads the memory peak of each)."""
    head = decoder.mid_block(decoder.conv_in(z), None)
    sh = _shape(us, head.shape[0], head.shape[2], head.shape[3], head.element_size())
    norms = [norm for u in us for norm in u.norms]
    stats: dict[nn.Module, torch.Tensor] = {}
    src, out = _Rows(head), None
    del head
    for seg in p.segments:
        last = seg.stop - 1
        if seg.bands == 1:  # the whole tensor at every unit: the norms take their own statistics
            x = src.rows(0, sh.h_in[seg.start])
            src = None
            for u in us[seg.start:seg.stop]:
                x = u.call(x)
            src = _Rows(x)
            if on_segment is not None:
                on_segment(seg)
            if seg.stop == len(us):
                return x
            continue
        for j in range(seg.start, seg.stop):
            for k, norm in enumerate(us[j].norms):
                measure = _Measure(norm)
                if j == seg.start and k == 0:  # it reads the kept input: its chunks are the statistics' parts
                    measure.parts = [group_partials(t, norm.num_groups) for _, t in src.chunks]
                else:
                    with _norm_forwards(norms, stats, measure):
                        for lo, hi in _bands(sh.h_out[j], seg.bands):
                            with contextlib.suppress(_Stop):
                                _run_band(us, _spans(us, sh, seg.start, j, lo, hi), src, seg.start, measure)
                stats[norm] = measure.stats()
        kept = _Rows()
        bands = _bands(sh.h_out[last], seg.bands)
        with _norm_forwards(norms, stats, None):
            for b, (lo, hi) in enumerate(bands):
                y = _run_band(us, _spans(us, sh, seg.start, last, lo, hi), src, seg.start)
                if seg.stop == len(us):
                    if out is None:
                        out = y.new_empty(*y.shape[:2], sh.h_out[last], sh.w_out[last])
                    out[:, :, lo:hi] = y
                else:
                    kept.append(lo, _compact(y))
                del y
                if b + 1 < len(bands):  # free what the next band no longer reads
                    src.drop_before(_spans(us, sh, seg.start, last, *bands[b + 1])[0][0])
        src = kept
        if on_segment is not None:
            on_segment(seg)
    return out


def streaming_forward(decoder: nn.Module, budget: int) -> Callable[..., torch.Tensor]:
    """A ``forward`` for a diffusers VAE ``Decoder`` that streams (``stream_decode``) when the plan for
    the latent's shape under ``budget`` bytes bands anything, and runs the original otherwise (or for
    latent_embeds, gradients, an unsupported decoder: ``Unsupported`` is logged once)."""
    original = decoder.forward
    try:
        us: list[Unit] | None = units(decoder)
    except Unsupported as exc:
        log.warning("sd_kernels: the VAE decode is not streamed (%s): it runs untiled", exc)
        us = None
    plans = _PLANS.setdefault(decoder, {})
    plans.clear()

    def forward(sample: torch.Tensor, latent_embeds: torch.Tensor | None = None) -> torch.Tensor:
        if us is None or latent_embeds is not None or torch.is_grad_enabled():
            return original(sample, latent_embeds)
        key = (tuple(sample.shape), sample.dtype)
        p = plans.get(key)
        if p is None:
            n, _, h, w = sample.shape
            elem = next(decoder.up_blocks.parameters()).element_size()
            p = plans[key] = plan(us, n, h, w, elem, budget, n * decoder.conv_in.out_channels * h * w * elem)
            log.info("sd_kernels: streamed VAE decode of %s: %s", list(sample.shape), p.format(us))
        if p.untiled:
            return original(sample, latent_embeds)
        return stream_decode(decoder, us, p, sample)

    return forward


_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def plans_of(decoder: nn.Module) -> dict[tuple, Plan]:
    """The plans a streaming forward of ``decoder`` made, per (latent shape, dtype) (logs, tests, bench)."""
    return _PLANS.get(decoder, {})

