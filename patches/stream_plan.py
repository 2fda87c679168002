"""The streamed VAE decode's plan (patches/stream_decode.py runs it): the up-stack as units, where
segments end and how many bands each takes, from a memory model (the buffer of kept activations + a
band's live tensors, each band charged the cuDNN workspace measured for its convolutions) and a time
model (convolution FLOPs + a cost per launch). The model only chooses; bench.stream_decode measures.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch
import torch.nn as nn

# The time model (bench.stream_decode measures the real thing): effective conv throughput and the
# cost of one kernel launch (host time when eager, the gap between kernels when replayed).
_FLOPS = 300e12
_LAUNCH_SECONDS = 8e-6
_WORKING_COPIES = 5  # a module's forward on a whole tensor: its input, intermediates, the add and the scale
_SEGMENT_SECONDS = 10e-6  # a segment's own bookkeeping: of two equal plans, the one of fewer segments
_MAX_BANDS = 128  # the most bands a segment is cut into (launches grow with them)
# What the model does not see, held back from the budget: cuDNN's workspace for a band's conv (the
# caching allocator counts it; up to 9.1 MiB measured on the H100 for SD1.5's band shapes, session 17
# call 2, by the algorithm cuDNN picks, not by the band's size) and the allocator's rounding of a
# band's temporaries.
_UNSEEN = 10 * 2**20
# What the model does not see once the workspace of each band convolution is measured (``plan``'s
# ``workspace``): the caching allocator charging a band's temporaries for the slightly larger cached
# blocks they land in (it splits a block only when more than 1 MiB would be left over).
_SLACK = 3 * 2**20
_PROBES = 8  # plans made at most while measuring the workspace of their convolutions


@dataclasses.dataclass
class Unit:
    """One step of the up-stack: a ResNet block, an upsampler or the output head (norm, act, conv)."""

    name: str
    kind: str  # "resnet", "upsample" or "head"
    module: nn.Module  # the ResnetBlock2D, the Upsample2D, or the decoder (head)
    radius: int  # input rows of context a band's output needs on each side
    scale: int  # output rows per input row
    c_in: int
    c_out: int
    norms: tuple[nn.Module, ...] = ()  # the GroupNorms it applies, in order; the first reads its input

    def need(self, lo: int, hi: int, height: int) -> tuple[int, int]:
        """Input rows [ilo, ihi) that output rows [lo, hi) need (clipped to the input's height)."""
        if self.scale == 1:
            return max(lo - self.radius, 0), min(hi + self.radius, height)
        # whole output row pairs [2·i0, 2·i1) from the phases at i0..i1, each reading input rows i - 1, i
        return max(lo // 2 - 1, 0), min(-(-hi // 2) + 1, height)

    def whole(self, x: torch.Tensor) -> torch.Tensor:
        """The unit on a whole tensor, by its module (a one-band segment: the norms' own statistics)."""
        if self.kind == "resnet":
            return self.module(x, None)
        if self.kind == "upsample":
            return self.module(x)
        d = self.module
        return d.conv_out(d.conv_act(d.conv_norm_out(x)))

    def flops(self, rows: int, width: int, upto: int | None = None) -> float:
        """Multiply-adds × 2 of ``rows`` output rows of ``width`` (up to norm ``upto``'s input, or all)."""
        px = rows * width
        if self.kind == "resnet":
            conv1 = 18 * self.c_in * self.c_out * (px + 2 * width)  # two more rows for conv2's context
            if upto is not None:
                return 0.0 if upto == 0 else conv1
            return conv1 + px * (18 * self.c_out * self.c_out + 2 * self.c_in * self.c_out * (self.c_in != self.c_out))
        if self.kind == "upsample":
            return 8.0 * self.c_in * self.c_out * px  # four taps per output pixel (_polyphase)
        return 0.0 if upto is not None else 18.0 * self.c_in * self.c_out * px

    def launches(self, upto: int | None = None) -> int:
        if self.kind == "resnet":  # norm1, conv1, norm2, conv2, the tail (+ the shortcut's conv)
            return (1, 3)[upto] if upto is not None else 5 + (self.c_in != self.c_out)
        if self.kind == "upsample":
            return 2
        return 1 if upto is not None else 2


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
    # cuDNN's workspace per band convolution (``Conv``), measured on the device (``measure_workspace``);
    # a convolution not measured is taken to need none
    workspace: dict = dataclasses.field(default_factory=dict, compare=False)

    def out_bytes(self, us: list[Unit], j: int) -> int:
        return self.row_bytes(us, j) * self.h_out[j]

    def row_bytes(self, us: list[Unit], j: int, out: bool = True) -> int:
        """Bytes of one row of unit j's output (or input)."""
        c, w = (us[j].c_out, self.w_out[j]) if out else (us[j].c_in, self.w_out[j] // us[j].scale)
        return self.n * c * w * self.elem


def _shape(us: list[Unit], n: int, h: int, w: int, elem: int, workspace: dict | None = None) -> _Shape:
    h_in, h_out, w_out = [], [], []
    for u in us:
        h_in.append(h)
        h, w = h * u.scale, w * u.scale
        h_out.append(h)
        w_out.append(w)
    return _Shape(tuple(h_in), tuple(h_out), tuple(w_out), elem, n, {} if workspace is None else workspace)


@dataclasses.dataclass(frozen=True)
class Conv:
    """One convolution a band (or a whole-tensor unit) runs: unit ``unit``'s conv ``role`` on ``rows``
    input rows with ``pad`` rows of zero padding above and below (what ``_conv_rows`` passes)."""

    unit: int
    role: str  # "conv1", "conv2", "shortcut", "up" (the polyphase 2×2), "head", or "whole.<module>"
    rows: int
    pad: int


def _pad(a: int, b: int, c: int, d: int, up: int, down: int) -> int:
    """The vertical padding ``_conv_rows`` gives a conv of input rows [a, b) for output rows [c, d)."""
    return 0 if (a == c - up and b == d + down) else max(up, down)


def _unit_convs(us: list[Unit], sh: _Shape, j: int, span: tuple[int, int, int, int] | None,
                upto: int | None = None) -> list[Conv]:
    """The convolutions unit j runs on one band (``span``; None: the whole tensor, by its module),
    up to norm ``upto``'s input (None: all), as the band functions below run them."""
    u, h = us[j], sh.h_in[j]
    if span is None:
        roles = {"resnet": ("conv1", "conv2") + (("conv_shortcut",) if u.c_in != u.c_out else ()),
                 "upsample": ("conv",), "head": ("conv_out",)}[u.kind]
        rows = h * u.scale if u.kind == "upsample" else h
        return [Conv(j, f"whole.{r}", rows, 0 if r == "conv_shortcut" else 1) for r in roles]
    a, b, c, d = span
    if u.kind == "resnet":
        if upto == 0:
            return []
        c1, d1 = max(c - 1, 0), min(d + 1, sh.h_out[j])
        out = [Conv(j, "conv1", b - a, _pad(a, b, c1, d1, 1, 1))]
        if upto is None:
            out.append(Conv(j, "conv2", d1 - c1, _pad(c1, d1, c, d, 1, 1)))
            if u.c_in != u.c_out:
                out.append(Conv(j, "shortcut", d - c, 0))
        return out
    if u.kind == "upsample":
        i0, i1 = c // 2, -(-d // 2)
        return [Conv(j, "up", b - a, _pad(a, b, i0, i1 + 1, 1, 0))]
    return [] if upto is not None else [Conv(j, "head", b - a, _pad(a, b, c, d, 1, 1))]


def _segment_convs(us: list[Unit], sh: _Shape, seg: Segment) -> set[Conv]:
    """Every convolution a segment runs, over its statistics passes and its final pass."""
    if seg.bands == 1:
        return {cv for j in range(seg.start, seg.stop) for cv in _unit_convs(us, sh, j, None)}
    convs: set[Conv] = set()
    passes = [(j, k) for j in range(seg.start, seg.stop) for k in range(len(us[j].norms))
              if j > seg.start or k > 0] + [(seg.stop - 1, None)]
    for last, upto in passes:
        for lo, hi in _bands(sh.h_out[last], seg.bands):
            for j, span in enumerate(_spans(us, sh, seg.start, last, lo, hi), seg.start):
                convs.update(_unit_convs(us, sh, j, span, upto if j == last else None))
    return convs


def _workspace(us: list[Unit], sh: _Shape, j: int, span: tuple[int, int, int, int]) -> int:
    """The most workspace (bytes, as measured) any convolution of unit j's band takes."""
    if not sh.workspace:
        return 0
    return max((sh.workspace.get(cv, 0) for cv in _unit_convs(us, sh, j, span)), default=0)


def _spans(us: list[Unit], sh: _Shape, start: int, last: int, lo: int, hi: int) -> list[tuple[int, int, int, int]]:
    """(input lo, input hi, output lo, output hi) of units start..last for output rows [lo, hi) of the last."""
    spans = []
    for j in range(last, start - 1, -1):
        ilo, ihi = us[j].need(lo, hi, sh.h_in[j])
        spans.append((ilo, ihi, lo, hi))
        lo, hi = ilo, ihi
    return spans[::-1]


def _bands(height: int, bands: int) -> list[tuple[int, int]]:
    r = -(-height // bands)
    return [(lo, min(lo + r, height)) for lo in range(0, height, r)]


def _sample(n: int) -> list[int]:
    """Indices of the bands the models look at: the two at each edge and one in the middle (the
    bands between are alike)."""
    return sorted({i for i in (0, 1, n // 2, n - 2, n - 1) if 0 <= i < n})


def _live(us: list[Unit], sh: _Shape, j: int, span: tuple[int, int, int, int], kept: bool) -> int:
    """Bytes unit j's band holds at its widest moment, as the band functions below run it: its
    input band included unless it is ``kept`` (a view of the decode's buffer, counted there)."""
    ilo, ihi, lo, hi = span
    x = 0 if kept else sh.row_bytes(us, j, out=False) * (ihi - ilo)
    t = sh.row_bytes(us, j, out=False) * (ihi - ilo)  # norm1's output (or the head norm's)
    rows = sh.row_bytes(us, j)
    u = us[j]
    ws = _workspace(us, sh, j, span)  # beside any of the convolutions (counted at the widest moment)
    if u.kind == "resnet":
        h = rows * min(hi - lo + 2, sh.h_out[j])
        o = rows * (hi - lo)
        # conv1 (x, norm1's output, h); conv2 (x, h normalized in place, o); the shortcut (x, o, its output)
        return max(x + t + h, x + h + o, x + 2 * o) + ws
    if u.kind == "upsample":
        pairs = -(-hi // 2) - lo // 2
        return x + rows * (pairs + 1) * 2 + rows * 2 * pairs + ws  # the phases (4 channels a pixel, half the rows)
    return x + t + rows * (hi - lo) + ws


def _pass_cost(us: list[Unit], sh: _Shape, start: int, last: int, bands: int, upto: int | None) -> float:
    cuts = _bands(sh.h_out[last], bands)
    seconds = 0.0
    picked = _sample(len(cuts))
    for i in picked:
        for j, (_, _, a, b) in enumerate(_spans(us, sh, start, last, *cuts[i]), start):
            up = upto if j == last else None
            seconds += us[j].flops(b - a, sh.w_out[j], up) / _FLOPS + us[j].launches(up) * _LAUNCH_SECONDS
    return seconds * len(cuts) / len(picked)


def _cost(us: list[Unit], sh: _Shape, start: int, stop: int, bands: int) -> float:
    """Seconds of a segment: a statistics pass per norm that does not read the kept input (each
    ending with a launch of the partial statistics per band), and the final pass. Remembered per
    structure of the units and shape (the search asks again for every plan it makes)."""
    key = (tuple((u.kind, u.c_in, u.c_out, u.radius, u.scale, len(u.norms)) for u in us), sh, start, stop, bands)
    seconds = _COSTS.get(key)
    if seconds is None:
        if len(_COSTS) > 2**16:
            _COSTS.clear()
        seconds = _COSTS[key] = _segment_seconds(us, sh, start, stop, bands)
    return seconds


_COSTS: dict[tuple, float] = {}


def _segment_seconds(us: list[Unit], sh: _Shape, start: int, stop: int, bands: int) -> float:
    if bands == 1:
        return _SEGMENT_SECONDS + sum(us[j].flops(sh.h_out[j], sh.w_out[j]) / _FLOPS + us[j].launches()
                                      * _LAUNCH_SECONDS for j in range(start, stop))
    seconds = _SEGMENT_SECONDS + _pass_cost(us, sh, start, stop - 1, bands, None)
    for j in range(start, stop):
        for k in range(len(us[j].norms)):
            if j > start or k > 0:
                seconds += _pass_cost(us, sh, start, j, bands, k) + bands * _LAUNCH_SECONDS
    return seconds


def _shift(us: list[Unit], sh: _Shape, start: int, stop: int, bands: int) -> int:
    """How far below its input (bytes) a segment's output starts in the buffer (``_layout``) so that
    no band's output rows overwrite input rows a later band still reads."""
    if bands == 1:
        return 0  # the module's output is written once the whole input has been read
    last = stop - 1
    r_in = sh.row_bytes(us, start, out=False)
    r_out = sh.row_bytes(us, last)
    cuts = _bands(sh.h_out[last], bands)
    return max([0] + [cuts[i][1] * r_out - _spans(us, sh, start, last, *cuts[i + 1])[0][0] * r_in
                      for i in _sample(len(cuts) - 1)])


def _working(us: list[Unit], sh: _Shape, start: int, stop: int, bands: int) -> int:
    """Bytes a segment holds beside the buffer: the widest unit's live tensors over its bands (in
    one band, ``_WORKING_COPIES`` of the widest activation: the modules' own temporaries and
    output); the image, in the last segment."""
    last = stop - 1
    image = sh.out_bytes(us, last) if stop == len(us) else 0
    if bands == 1:
        return image + _WORKING_COPIES * max(sh.n * sh.elem * sh.w_out[j] * sh.h_out[j] * max(us[j].c_in, us[j].c_out)
                                             for j in range(start, stop))
    cuts = _bands(sh.h_out[last], bands)
    return image + max(_live(us, sh, j, span, j == start) for i in _sample(len(cuts))
                       for j, span in enumerate(_spans(us, sh, start, last, *cuts[i]), start))


def _peak(us: list[Unit], sh: _Shape, start: int, stop: int, bands: int, kept_in: int) -> int:
    """Modelled peak bytes of a segment alone: its span of the buffer (its input, and its output
    ``_shift`` below it; the image is not kept) + ``_working``. ``plan`` then fits every
    segment's band beside the whole buffer (``_layout``)."""
    out = 0 if stop == len(us) else sh.out_bytes(us, stop - 1)
    span = max(kept_in + _shift(us, sh, start, stop, bands), out)
    return span + _working(us, sh, start, stop, bands)


def _layout(us: list[Unit], sh: _Shape, segments: tuple[Segment, ...], head_bytes: int) -> tuple[list[int], int]:
    """Byte offsets in one buffer of the activations kept (the head's output, then each segment's
    but the last's), and the buffer's size. Each segment's output starts ``_shift`` below its input
    (the last kept one at 0): rows written never cover rows still to be read."""
    sizes = [head_bytes] + [sh.out_bytes(us, seg.stop - 1) for seg in segments[:-1]]
    bases = [0] * len(sizes)
    for i in range(len(sizes) - 2, -1, -1):
        seg = segments[i]
        bases[i] = bases[i + 1] + _shift(us, sh, seg.start, seg.stop, seg.bands)
    return bases, max(base + size for base, size in zip(bases, sizes))


def plan(us: list[Unit], n: int, h: int, w: int, elem: int, budget: int, head_bytes: int,
         workspace: dict[Conv, int] | None = None) -> Plan:
    """Segments and bands for a latent of n×h×w (head output ``head_bytes``) under ``budget`` bytes:
    the fastest plan (``_cost``) whose segments' modelled peaks fit the budget less what the model
    does not see (else the one of the smallest peak); then, since the buffer is held for the whole
    decode, each segment in the fewest bands whose live tensors fit beside the whole buffer.
    ``workspace``: cuDNN's workspace per band convolution as measured (``measure_workspace``), counted
    in each band's live bytes; then only ``_SLACK`` is held back, else ``_UNSEEN``."""
    sh = _shape(us, n, h, w, elem, workspace)
    limit = budget - (_UNSEEN if workspace is None else _SLACK)
    barred: set[int] = set()
    while True:
        segments = _fit(us, sh, _search(us, sh, limit, head_bytes, frozenset(barred)), limit, head_bytes)
        bases, buffer = _layout(us, sh, segments, head_bytes)
        peak = buffer + max(_working(us, sh, s.start, s.stop, s.bands) for s in segments)
        # The search checks each segment alone; in the buffer, a kept activation sits above the
        # shifts of every later segment (``_layout``), and the earlier ones above it. Over the
        # limit, the search runs again without keeping the largest of the activations that reach
        # the buffer's top.
        kept = [(sh.out_bytes(us, seg.stop - 1), base, seg.stop) for base, seg in zip(bases[1:], segments[:-1])]
        top = [(size, stop) for size, base, stop in kept if base + size >= buffer - 2**20 and stop not in barred]
        if peak <= limit or not top:
            break
        barred.add(max(top)[1])
    return Plan(segments, peak, sum(_cost(us, sh, s.start, s.stop, s.bands) for s in segments), budget)


def _fit(us: list[Unit], sh: _Shape, segments: tuple[Segment, ...], limit: float,
         head_bytes: int) -> tuple[Segment, ...]:
    """Each segment in the fewest bands whose live tensors fit beside the whole buffer (re-chosen a
    few times: the shifts move the buffer a little)."""
    for _ in range(4):
        _, buffer = _layout(us, sh, segments, head_bytes)
        rebanded = tuple(_reband(us, sh, seg, limit - buffer) for seg in segments)
        if rebanded == segments:
            break
        segments = rebanded
    return segments


def _reband(us: list[Unit], sh: _Shape, seg: Segment, room: float) -> Segment:
    """``seg`` in the fewest bands whose live tensors fit ``room`` bytes beside the buffer (as it was
    if it fits; the most bands if none does)."""
    if _working(us, sh, seg.start, seg.stop, seg.bands) <= room:
        return seg
    counts = list(_band_counts(sh.h_out[seg.stop - 1]))
    fits = [b for b in counts if b > seg.bands and _working(us, sh, seg.start, seg.stop, b) <= room]
    return Segment(seg.start, seg.stop, fits[0] if fits else counts[-1])


def _search(us: list[Unit], sh: _Shape, limit: float, head_bytes: int, barred: frozenset[int]) -> tuple[Segment, ...]:
    """The dynamic program over where segments end and their bands: the fastest plan whose every
    segment's ``_peak`` (alone) fits ``limit``, else the one of the smallest peak; no segment ends
    before a unit in ``barred`` (its input is not kept)."""
    kept = [head_bytes] + [sh.out_bytes(us, j) for j in range(len(us))]  # kept[j]: input of unit j
    # best[i]: (seconds, segments) of the up-stack's units [0, i) with unit i-1's output kept;
    # fallback[i]: (peak, seconds, segments), the smallest peak
    best: list[tuple[float, tuple[Segment, ...]] | None] = [(0.0, ())] + [None] * len(us)
    fallback: list[tuple[int, float, tuple[Segment, ...]] | None] = [(kept[0], 0.0, ())] + [None] * len(us)
    for stop in range(1, len(us) + 1):
        if stop in barred:
            continue
        for start in range(stop):
            if best[start] is None and fallback[start] is None:
                continue
            for bands in _band_counts(sh.h_out[stop - 1]):
                if bands == 1 and stop - start < len(us):
                    # modules run whole only where the whole decode does: their temporaries are a
                    # rule of thumb (``_WORKING_COPIES``), a band's are counted op by op (session 18:
                    # a whole 64² segment peaked 4–9 MiB above its model under mobile-small)
                    continue
                peak = _peak(us, sh, start, stop, bands, kept[start])
                seconds = _cost(us, sh, start, stop, bands)
                seg = Segment(start, stop, bands)
                if best[start] is not None and peak <= limit:
                    cand = (best[start][0] + seconds, best[start][1] + (seg,))
                    if best[stop] is None or cand[0] < best[stop][0]:
                        best[stop] = cand
                prev = fallback[start]
                cand2 = (max(prev[0], peak), prev[1] + seconds, prev[2] + (seg,))
                if fallback[stop] is None or cand2[:2] < fallback[stop][:2]:
                    fallback[stop] = cand2
    return best[-1][1] if best[-1] is not None else fallback[-1][2]


def _band_counts(height: int) -> Iterator[int]:
    """Band counts worth trying over ``height`` rows: each distinct band height ⌈height / k⌉ once."""
    seen = set()
    for k in range(1, min(height, _MAX_BANDS) + 1):
        r = -(-height // k)
        if r not in seen:
            seen.add(r)
            yield -(-height // r)


def convs_of(us: list[Unit], p: Plan, h: int, w: int, elem: int) -> set[Conv]:
    """Every convolution plan ``p`` runs for a latent of h×w (one sample)."""
    sh = _shape(us, 1, h, w, elem)
    return {cv for seg in p.segments for cv in _segment_convs(us, sh, seg)}


def conv_input(us: list[Unit], sh: _Shape, cv: Conv) -> tuple[int, int, int, int]:
    """The shape of a convolution's input (one sample)."""
    u, role = us[cv.unit], cv.role.removeprefix("whole.")
    width = sh.w_out[cv.unit] if role == "conv" else sh.w_out[cv.unit] // u.scale  # "conv": after the 2× upsampling
    return 1, u.c_out if role == "conv2" else u.c_in, cv.rows, width
