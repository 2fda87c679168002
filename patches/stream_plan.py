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

from sd_kernels.ops.pack8 import pack_group

# The time model (bench.stream_decode measures the real thing): effective conv throughput and the
# cost of one kernel launch (host time when eager, the gap between kernels when replayed).
_FLOPS = 300e12
_LAUNCH_SECONDS = 8e-6
_WORKING_COPIES = 5  # a module's forward on a whole tensor: its input, intermediates, the add and the scale
_SEGMENT_SECONDS = 10e-6  # a segment's own bookkeeping: of two equal plans, the one of fewer segments
_MAX_BANDS = 128  # the most bands a segment is cut into (launches grow with them)
# What the model does not see, held back from the budget: cuDNN's workspace for a band's conv (the
# caching allocator counts it; up to 9.1 MiB measured on the H100 for SD1.5's band shapes, 2026-11-25,
# set by the algorithm cuDNN picks, not by the band's size) and the allocator's rounding of a
# band's temporaries.
_UNSEEN = 10 * 2**20
# What the model does not see once the workspace of each band convolution is measured (``plan``'s
# ``workspace``): the caching allocator charging a band's temporaries for the slightly larger cached
# blocks they land in (it splits a block only when more than 1 MiB would be left over).
_SLACK = 3 * 2**20
_PROBES = 8  # plans made at most while measuring the workspace of their convolutions
# What keeping an activation in 8 bits (``ops.pack8``, where ``plan(pack=True)``) must save in modelled
# time before the search takes it: the image moves by up to half a step of each group's largest value
# there, so an activation is packed only where that buys real time (where the budget cannot hold it in
# its dtype), not for a launch or two.
_PACK_SECONDS = 1e-3
_ALIGN = 16  # bytes: every kept activation starts on a 16-byte boundary of the buffer (vector loads)


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
    packed: bool = False  # its output is kept in 8 bits (ops.pack8), not in the decode's dtype


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
        parts = [f"{us[s.start].name}..{us[s.stop - 1].name} in {s.bands} band(s)"
                 + (", kept in 8 bits" if s.packed else "") for s in self.segments]
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

    def kept_row_bytes(self, us: list[Unit], j: int, out: bool = True, packed: bool = False) -> int:
        """Bytes of one row of unit j's output (or input) as the buffer keeps it (``kept_row_bytes``)."""
        c, w = (us[j].c_out, self.w_out[j]) if out else (us[j].c_in, self.w_out[j] // us[j].scale)
        return self.n * kept_row_bytes(w, c, self.elem, packed)

    def kept_bytes(self, us: list[Unit], j: int, packed: bool = False) -> int:
        """Bytes of unit j's whole output as the buffer keeps it."""
        return self.kept_row_bytes(us, j, True, packed) * self.h_out[j]


def kept_row_bytes(w: int, c: int, elem: int, packed: bool) -> int:
    """Bytes of one row of [W, C] of one sample as the decode's buffer keeps it: ``elem`` bytes an
    element, or ``packed`` (``ops.pack8``: an int8 code an element, then a float32 scale per group of
    channels). The plan lays the buffer out by it and ``stream_decode._Kept`` addresses it by it."""
    return w * (c + 4 * (c // pack_group(c))) if packed else w * c * elem


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
    input band included unless it is ``kept`` (a view of the decode's buffer, counted there; a
    packed kept input is unpacked into a band of its own, and counted)."""
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


def _cost(us: list[Unit], sh: _Shape, start: int, stop: int, bands: int, src8: bool = False,
          out8: bool = False) -> float:
    """Seconds of a segment: a statistics pass per norm that does not read the kept input (each
    ending with a launch of the partial statistics per band), and the final pass; with its input
    kept in 8 bits (``src8``) a launch more per band of every pass to unpack it, with its output
    (``out8``) one per band of the final pass to pack it. Remembered per structure of the units and
    shape (the search asks again for every plan it makes)."""
    key = (tuple((u.kind, u.c_in, u.c_out, u.radius, u.scale, len(u.norms)) for u in us), sh, start, stop, bands,
           src8, out8)
    seconds = _COSTS.get(key)
    if seconds is None:
        if len(_COSTS) > 2**16:
            _COSTS.clear()
        seconds = _COSTS[key] = _segment_seconds(us, sh, start, stop, bands, src8, out8)
    return seconds


_COSTS: dict[tuple, float] = {}


def _segment_seconds(us: list[Unit], sh: _Shape, start: int, stop: int, bands: int, src8: bool,
                     out8: bool) -> float:
    if bands == 1:
        return _SEGMENT_SECONDS + sum(us[j].flops(sh.h_out[j], sh.w_out[j]) / _FLOPS + us[j].launches()
                                      * _LAUNCH_SECONDS for j in range(start, stop))
    seconds = _SEGMENT_SECONDS + _pass_cost(us, sh, start, stop - 1, bands, None)
    passes = 1
    for j in range(start, stop):
        for k in range(len(us[j].norms)):
            if j > start or k > 0:
                seconds += _pass_cost(us, sh, start, j, bands, k) + bands * _LAUNCH_SECONDS
                passes += 1
            elif src8:  # the input's own statistics: unpacked and summed band by band
                passes += 1
    return seconds + bands * _LAUNCH_SECONDS * (passes * src8 + out8)


def _shift(us: list[Unit], sh: _Shape, start: int, stop: int, bands: int, src8: bool = False,
           out8: bool = False) -> int:
    """How far below its input (bytes, a multiple of ``_ALIGN``) a segment's output starts in the
    buffer (``_layout``) so that no band's output rows overwrite input rows a later band still reads
    (rows as kept: ``src8``, ``out8`` packed)."""
    if bands == 1:
        return 0  # the module's output is written once the whole input has been read
    last = stop - 1
    r_in = sh.kept_row_bytes(us, start, False, src8)
    r_out = sh.kept_row_bytes(us, last, True, out8)
    cuts = _bands(sh.h_out[last], bands)
    shift = max([0] + [cuts[i][1] * r_out - _spans(us, sh, start, last, *cuts[i + 1])[0][0] * r_in
                       for i in _sample(len(cuts) - 1)])
    return -(-shift // _ALIGN) * _ALIGN


def _working(us: list[Unit], sh: _Shape, start: int, stop: int, bands: int, src8: bool = False) -> int:
    """Bytes a segment holds beside the buffer: the widest unit's live tensors over its bands (in
    one band, ``_WORKING_COPIES`` of the widest activation: the modules' own temporaries and
    output); the image, in the last segment. ``src8``: its input is kept packed (its bands are
    unpacked, so counted here)."""
    last = stop - 1
    image = sh.out_bytes(us, last) if stop == len(us) else 0
    if bands == 1:
        return image + _WORKING_COPIES * max(sh.n * sh.elem * sh.w_out[j] * sh.h_out[j] * max(us[j].c_in, us[j].c_out)
                                             for j in range(start, stop))
    cuts = _bands(sh.h_out[last], bands)
    return image + max(_live(us, sh, j, span, j == start and not src8) for i in _sample(len(cuts))
                       for j, span in enumerate(_spans(us, sh, start, last, *cuts[i]), start))


def _peak(us: list[Unit], sh: _Shape, start: int, stop: int, bands: int, kept_in: int, src8: bool = False,
          out8: bool = False) -> int:
    """Modelled peak bytes of a segment alone: its span of the buffer (its input, and its output
    ``_shift`` below it; the image is not kept) + ``_working``. ``plan`` then fits every
    segment's band beside the whole buffer (``_layout``)."""
    out = 0 if stop == len(us) else sh.kept_bytes(us, stop - 1, out8)
    span = max(kept_in + _shift(us, sh, start, stop, bands, src8, out8), out)
    return span + _working(us, sh, start, stop, bands, src8)


def _layout(us: list[Unit], sh: _Shape, segments: tuple[Segment, ...], head_bytes: int) -> tuple[list[int], int]:
    """Byte offsets in one buffer of the activations kept (the head's output, then each segment's
    but the last's), and the buffer's size. Each segment's output starts ``_shift`` below its input
    (the last kept one at 0): rows written never cover rows still to be read."""
    sizes = [head_bytes] + [sh.kept_bytes(us, seg.stop - 1, seg.packed) for seg in segments[:-1]]
    bases = [0] * len(sizes)
    src8 = _packed_inputs(segments)
    for i in range(len(sizes) - 2, -1, -1):
        seg = segments[i]
        bases[i] = bases[i + 1] + _shift(us, sh, seg.start, seg.stop, seg.bands, src8[i], seg.packed)
    return bases, max(base + size for base, size in zip(bases, sizes))


def plan(us: list[Unit], n: int, h: int, w: int, elem: int, budget: int, head_bytes: int,
         workspace: dict[Conv, int] | None = None, pack: bool = False) -> Plan:
    """Segments and bands for a latent of n×h×w (head output ``head_bytes``) under ``budget`` bytes:
    the fastest plan (``_cost``) whose segments' modelled peaks fit the budget less what the model
    does not see (else the one of the smallest peak); then, since the buffer is held for the whole
    decode, each segment in the fewest bands whose live tensors fit beside the whole buffer.
    ``workspace``: cuDNN's workspace per band convolution as measured (``measure_workspace``), counted
    in each band's live bytes; then only ``_SLACK`` is held back, else ``_UNSEEN``. ``pack``: an
    activation may be kept in 8 bits (``ops.pack8``) where that saves at least ``_PACK_SECONDS`` each
    (the plan without packing is made too, and kept unless the packed one is faster by that)."""
    sh = _shape(us, n, h, w, elem, workspace)
    limit = budget - (_UNSEEN if workspace is None else _SLACK)
    plans = [_plan(us, sh, limit, head_bytes, budget, packing) for packing in ((False, True) if pack else (False,))]

    def rank(p: Plan) -> tuple:  # a plan that fits first, then the fastest (a packed activation charged), or smallest
        return (0, p.seconds + _PACK_SECONDS * sum(s.packed for s in p.segments)) if p.peak <= limit else (1, p.peak)
    return min(plans, key=rank)


def _plan(us: list[Unit], sh: _Shape, limit: float, head_bytes: int, budget: int, pack: bool) -> Plan:
    barred: set[int] = set()
    while True:
        segments = _fit(us, sh, _search(us, sh, limit, head_bytes, frozenset(barred), pack), limit, head_bytes)
        bases, buffer = _layout(us, sh, segments, head_bytes)
        peak = buffer + max(_working(us, sh, s.start, s.stop, s.bands, src8)
                            for s, src8 in zip(segments, _packed_inputs(segments)))
        # The search checks each segment alone; in the buffer, a kept activation sits above the
        # shifts of every later segment (``_layout``), and the earlier ones above it. Over the
        # limit, the search runs again without keeping the largest of the activations that reach
        # the buffer's top.
        kept = [(sh.kept_bytes(us, seg.stop - 1, seg.packed), base, seg.stop)
                for base, seg in zip(bases[1:], segments[:-1])]
        top = [(size, stop) for size, base, stop in kept if base + size >= buffer - 2**20 and stop not in barred]
        if peak <= limit or not top:
            break
        barred.add(max(top)[1])
    return Plan(segments, peak, sum(_cost(us, sh, s.start, s.stop, s.bands, src8, s.packed)
                                    for s, src8 in zip(segments, _packed_inputs(segments))), budget)


def _packed_inputs(segments: tuple[Segment, ...]) -> list[bool]:
    """Per segment, whether its input is kept packed (the previous segment's output)."""
    return [False] + [s.packed for s in segments[:-1]]


def _fit(us: list[Unit], sh: _Shape, segments: tuple[Segment, ...], limit: float,
         head_bytes: int) -> tuple[Segment, ...]:
    """Each segment in the fewest bands whose live tensors fit beside the whole buffer (re-chosen a
    few times: the shifts move the buffer a little)."""
    for _ in range(4):
        _, buffer = _layout(us, sh, segments, head_bytes)
        rebanded = tuple(_reband(us, sh, seg, limit - buffer, src8)
                         for seg, src8 in zip(segments, _packed_inputs(segments)))
        if rebanded == segments:
            break
        segments = rebanded
    return segments


def _reband(us: list[Unit], sh: _Shape, seg: Segment, room: float, src8: bool) -> Segment:
    """``seg`` in the fewest bands whose live tensors fit ``room`` bytes beside the buffer (as it was
    if it fits; the most bands if none does)."""
    if _working(us, sh, seg.start, seg.stop, seg.bands, src8) <= room:
        return seg
    counts = list(_band_counts(sh.h_out[seg.stop - 1]))
    fits = [b for b in counts if b > seg.bands and _working(us, sh, seg.start, seg.stop, b, src8) <= room]
    return dataclasses.replace(seg, bands=fits[0] if fits else counts[-1])


def _search(us: list[Unit], sh: _Shape, limit: float, head_bytes: int, barred: frozenset[int],
            pack: bool = False) -> tuple[Segment, ...]:
    """The dynamic program over where segments end, their bands and (``pack``) whether the activation
    each keeps is packed: the fastest plan whose every segment's ``_peak`` (alone) fits ``limit``
    (each packed activation charged ``_PACK_SECONDS``), else the one of the smallest peak; no segment
    ends before a unit in ``barred`` (its input is not kept)."""
    last = len(us)
    # state (i, p): the up-stack's units [0, i) with unit i-1's output kept, packed if p (the head's
    # output, i = 0, never is); best: (seconds, segments); fallback: (peak, seconds, segments)
    best: dict[tuple[int, bool], tuple[float, tuple[Segment, ...]]] = {(0, False): (0.0, ())}
    fallback: dict[tuple[int, bool], tuple[int, float, tuple[Segment, ...]]] = {(0, False): (head_bytes, 0.0, ())}
    for stop in range(1, last + 1):
        if stop in barred:
            continue
        for out8 in (False, True) if pack and stop < last else (False,):
            for (start, src8) in [k for k in fallback if k[0] < stop]:
                kept_in = head_bytes if start == 0 else sh.kept_bytes(us, start - 1, src8)
                for bands in _band_counts(sh.h_out[stop - 1]):
                    if bands == 1 and (stop - start < last or out8):
                        # modules run whole only where the whole decode does: their temporaries are a
                        # rule of thumb (``_WORKING_COPIES``), a band's are counted op by op (measured:
                        # a whole 64² segment peaked 4–9 MiB above its model under mobile-small)
                        continue
                    peak = _peak(us, sh, start, stop, bands, kept_in, src8, out8)
                    seconds = _cost(us, sh, start, stop, bands, src8, out8) + _PACK_SECONDS * out8
                    seg = Segment(start, stop, bands, out8)
                    prev = best.get((start, src8))
                    if prev is not None and peak <= limit:
                        cand = (prev[0] + seconds, prev[1] + (seg,))
                        if (stop, out8) not in best or cand[0] < best[stop, out8][0]:
                            best[stop, out8] = cand
                    low = fallback[start, src8]
                    cand2 = (max(low[0], peak), low[1] + seconds, low[2] + (seg,))
                    if (stop, out8) not in fallback or cand2[:2] < fallback[stop, out8][:2]:
                        fallback[stop, out8] = cand2
    return best[last, False][1] if (last, False) in best else fallback[last, False][2]


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
