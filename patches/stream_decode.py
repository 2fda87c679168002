"""A VAE decode that streams the up-stack in row bands under an intermediate-memory budget, exact.

The decoder's GroupNorms normalize with statistics of the *whole* image, so a band cannot be run
alone: everything before a norm must have been seen before the norm applies. The decode therefore
runs as a few **segments**, each from an activation kept in memory to the next one kept, or to the
image. Every kept activation lives in one buffer allocated per decode (``_layout``: each segment's
output starts far enough below its input that no band's rows overwrite rows a later band reads),
so the decode's memory is that buffer and a band's live tensors, whatever the allocator does with
blocks of many sizes; a batch is decoded one sample at a time:

1. the head (conv_in and the mid-block, with its global attention) at latent resolution, whole;
2. per segment, for each norm of its units in order whose statistics are not known yet, a
   **statistics pass**: the segment's units run band by band up to that norm, the norms before it
   applying their known statistics, and the norm's input rows that the band owns are summed per
   (sample, group) (``ops.group_partials``: count, mean, M2; bands merged with Chan's formula, no
   E[x²] − E[x]² cancellation); the band stops there. A norm that reads the segment's kept input
   directly (a ResNet's norm1, the output norm) needs no pass: its statistics come from the kept
   chunks;
3. the segment's **final pass** runs its units band by band with every norm applying the whole
   image's statistics (``ops.group_norm_given``) and writes each band's rows of the output into the
   buffer, over input rows no later band reads: a segment holds about the larger of its input and
   output, not both.

A band runs each unit as its own short sequence of ops (``_resnet_band``, ``_upsample_band``,
``_head_band``), not the module's forward: the norms apply given statistics (fused with their
SiLU; norm2 in place), every 3×3 convolution computes only the rows the next op needs (no vertical
padding inside the image: ``_conv_rows``), and the nearest-2× + 3×3 upsampler runs as one 2×2
convolution of four phases at the input's resolution (``_polyphase``: 16 instead of 36
multiply-adds per input pixel and channel pair, no upsampled copy), interleaved into the band. The
image is the untiled decode's up to rounding (the phases' summed weights are rounded once to the
weights' dtype; the norms' statistics are merged in float64).

``plan`` chooses where segments end and how many bands each takes, from a memory model (the
segment's span of the buffer + the widest unit's live tensors; ``_peak``) and a time model (convolution
FLOPs + a cost per launch; ``_cost``): keeping an activation saves the passes that would recompute
it, but it must fit under the budget beside a band. On a CUDA device each band is charged the cuDNN
workspace measured for its convolutions (``_plan_measured``, ``measure_workspace``); the biases of
the convolutions are added by the ops after them (``ops.bias_residual`` for a ResNet's tail). The
model only chooses; bench.stream_decode measures the peak. Verified against diffusers 0.42.1's
Decoder.forward, UpDecoderBlock2D.forward and ResnetBlock2D.forward (source hashes, the last because
a band re-states it); an unverified diffusers, a decoder of another structure (SpatialNorm, a
transposed-conv upsampler, a convolution with hooks or of another class) or a latent_embeds argument
runs the original forward.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Callable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from sd_kernels.ops.group_stats import group_norm_given, group_partials, mean_rstd, merge_group_stats
from sd_kernels.ops.residual import bias_residual

from .verified import is_verified

log = logging.getLogger("sd_kernels")

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


class Unsupported(Exception):
    """The decoder is not one this module streams (the message says why)."""


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


def _plain_conv(conv: nn.Module, where: str, kernel: int | None = None) -> None:
    """A convolution a band may run as ``F.conv2d`` on its weights: an exact nn.Conv2d, odd square
    kernel, same padding, stride 1, no hooks (a LoRA layer, a Winograd or an offloaded conv runs its
    own forward, which a band cannot)."""
    k = conv.kernel_size if isinstance(conv, nn.Conv2d) else None
    if (type(conv) is not nn.Conv2d or k[0] != k[1] or k[0] % 2 == 0 or (kernel is not None and k[0] != kernel)
            or conv.padding != (k[0] // 2,) * 2 or conv.stride != (1, 1) or conv.dilation != (1, 1)
            or conv.groups != 1 or conv.padding_mode != "zeros" or conv._forward_hooks or conv._forward_pre_hooks):
        raise Unsupported(f"{where} is not a plain same-padded nn.Conv2d without hooks ({conv})")


def _norm(norm: nn.Module, where: str) -> None:
    """A GroupNorm a band applies with given statistics and a SiLU: nn.GroupNorm (ours included)
    that applies no activation of its own, or SiLU (ours fused, ``activation == "silu"``)."""
    if not isinstance(norm, nn.GroupNorm) or getattr(norm, "activation", "silu") not in (None, "silu") \
            or norm._forward_hooks or norm._forward_pre_hooks:
        raise Unsupported(f"{where} is a {type(norm).__name__} (not a plain GroupNorm)")


def _resnet(name: str, r: nn.Module) -> Unit:
    from diffusers.models.resnet import ResnetBlock2D

    if type(r) is not ResnetBlock2D or not is_verified(ResnetBlock2D.forward):
        raise Unsupported(f"{name} is a {type(r).__name__}, not diffusers 0.42.1's ResnetBlock2D")
    if r.up or r.down or r.time_emb_proj is not None or type(r.nonlinearity) is not nn.SiLU \
            or (r.dropout.p and r.training):
        raise Unsupported(f"{name} samples up/down, takes a time embedding, or applies no plain SiLU")
    _norm(r.norm1, f"{name}.norm1")
    _norm(r.norm2, f"{name}.norm2")
    _plain_conv(r.conv1, f"{name}.conv1", 3)
    _plain_conv(r.conv2, f"{name}.conv2", 3)
    if r.conv_shortcut is not None:
        _plain_conv(r.conv_shortcut, f"{name}.conv_shortcut", 1)
    return Unit(name, "resnet", r, 2, 1, r.conv1.in_channels, r.conv2.out_channels, (r.norm1, r.norm2))


def _upsampler(name: str, u: nn.Module) -> Unit:
    if (type(u).__name__ != "Upsample2D" or not u.use_conv or u.use_conv_transpose or not u.interpolate
            or u.norm is not None or u.name != "conv" or getattr(u, "interpolate_mode", "nearest") != "nearest"):
        raise Unsupported(f"{name} is not a nearest-2× + conv Upsample2D")
    _plain_conv(u.conv, f"{name}.conv", 3)
    return Unit(name, "upsample", u, 1, 2, u.conv.in_channels, u.conv.out_channels)


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
    norm, act, conv = decoder.conv_norm_out, decoder.conv_act, decoder.conv_out
    _norm(norm, "conv_norm_out")
    # our GroupNorm patch folds conv_act's SiLU into the norm and leaves an nn.Identity
    if not (type(act) is nn.SiLU or (type(act) is nn.Identity and getattr(norm, "activation", None) == "silu")):
        raise Unsupported(f"conv_act is a {type(act).__name__}")
    _plain_conv(conv, "conv_out", 3)
    out.append(Unit("conv_out", "head", decoder, 1, 1, conv.in_channels, conv.out_channels, (norm,)))
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


def measure_workspace(us: list[Unit], convs: set[Conv], h: int, w: int, dtype: torch.dtype, device: torch.device,
                      channels_last: bool) -> dict[Conv, int]:
    """cuDNN's workspace for each convolution, in ``dtype`` on ``device``: the conv run once on
    zeros of its band's shape, the bytes the caching allocator handed out beyond its output (a
    cumulative counter: no peak is reset). cuDNN keeps the plan it picked per shape, so the decode
    runs the same one. Off CUDA nothing is measured."""
    if torch.device(device).type != "cuda":
        return {}
    sh = _shape(us, 1, h, w, torch.empty(0, dtype=dtype).element_size())
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    out = {}
    for cv in sorted(convs, key=dataclasses.astuple):
        x = torch.zeros(conv_input(us, sh, cv), dtype=dtype, device=device).contiguous(memory_format=fmt)
        weight = _polyphase(us[cv.unit], x) if cv.role == "up" else _conv_module(us[cv.unit], cv.role).weight
        before = torch.cuda.memory_stats(device)["allocated_bytes.all.allocated"]
        y = F.conv2d(x, weight, None, 1, (cv.pad, 0 if weight.shape[3] == 1 else 1))
        handed = torch.cuda.memory_stats(device)["allocated_bytes.all.allocated"] - before
        out[cv] = max(handed - -(-y.untyped_storage().nbytes() // 512) * 512, 0)
        del x, y
    return out


def conv_input(us: list[Unit], sh: _Shape, cv: Conv) -> tuple[int, int, int, int]:
    """The shape of a convolution's input (one sample)."""
    u, role = us[cv.unit], cv.role.removeprefix("whole.")
    width = sh.w_out[cv.unit] if role == "conv" else sh.w_out[cv.unit] // u.scale  # "conv": after the 2× upsampling
    return 1, u.c_out if role == "conv2" else u.c_in, cv.rows, width


def _conv_module(u: Unit, role: str) -> nn.Module:
    role = role.removeprefix("whole.")
    if u.kind == "head":
        return u.module.conv_out
    if u.kind == "upsample":
        return u.module.conv
    return getattr(u.module, "conv_shortcut" if role == "shortcut" else role)


# ---------------------------------------------------------------------------------------------
# A band of a unit


def _conv_rows(x: torch.Tensor, weight: torch.Tensor, a: int, b: int, c: int, d: int,
               height: int, up: int, down: int) -> torch.Tensor:
    """Output rows [c, d) of a same-width convolution without its bias whose output row y reads
    input rows y − up … y + down (zeros outside [0, height)), from x = input rows [a, b) =
    [c − up, d + down) clipped to the image. Inside the image nothing is padded: exactly the rows
    asked for are computed; where the band is clipped at an edge, the conv pads (the image's own
    zero padding) and the one surplus row on the other side is cropped. The bias is left to the op
    after (cuDNN would add it in a kernel of its own)."""
    pad_w = (weight.shape[3] - 1) // 2 if weight.shape[3] % 2 else 1
    p = 0 if (a == c - up and b == d + down) else max(up, down)
    first = a - p + up  # the output row index of the conv's first row
    y = F.conv2d(x, weight, None, 1, (p, pad_w))
    return y[:, :, c - first:d - first]


def _disjoint(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a and b share no byte of memory (a kernel may then read one while writing the other)."""
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return True
    def extent(t: torch.Tensor) -> tuple[int, int]:
        lo = t.data_ptr()
        return lo, lo + (sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1) * t.element_size()
    (a0, a1), (b0, b1) = extent(a), extent(b)
    return a1 <= b0 or b1 <= a0


def _polyphase(u: Unit, like: torch.Tensor) -> torch.Tensor:
    """Nearest-2× then a 3×3 conv, as one 2×2 conv of 4·C_out channels on the input: output pixel
    (2i + a, 2j + b) is phase (a, b) at (i + a, j + b), whose 2×2 taps read input rows i + a − 1,
    i + a (and the columns alike). Phase a's tap rows sum the 3×3 kernel's rows {−1 | 0, +1} (a = 0)
    or {−1, 0 | +1} (a = 1). Summed in float64, rounded once to the weights' dtype; cached per conv
    (weakly) and per weight version, dtype and layout; made of device ops only (no host copy, so a
    CUDA graph may capture a first call). The bias is not folded: ``_interleave`` adds it."""
    conv = u.module.conv
    cl = like.dim() == 4 and like.shape[1] > 1 and like.stride(1) == 1
    key = (conv.weight.data_ptr(), conv.weight._version, conv.weight.dtype, conv.weight.device, cl)
    cached = _PHASES.get(conv)
    if cached is None or cached[0] != key:
        w = conv.weight.double()
        taps = {0: ((0,), (1, 2)), 1: ((0, 1), (2,))}

        def fold(t: torch.Tensor, dim: int, a: int) -> torch.Tensor:
            return torch.stack([sum(t.select(dim, i) for i in group) for group in taps[a]], dim)

        w4 = torch.cat([fold(fold(w, 2, a), 3, b) for a in (0, 1) for b in (0, 1)]).to(conv.weight.dtype)
        w4 = w4.contiguous(memory_format=torch.channels_last) if cl else w4.contiguous()
        cached = _PHASES[conv] = (key, w4)
    return cached[1]


_PHASES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _interleave(p: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """out[n, c, 2i + a, 2j + b] = p[n, (2a + b)·C + c, i + a, j + b] + bias[c] for the rows of out
    (one elementwise kernel through two strided views: any layout of either)."""
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


class _Pass:
    """One pass over bands: the statistics known so far, and the norm it measures (None: the final
    pass), whose band partials it gathers."""

    def __init__(self, stats: dict[nn.Module, torch.Tensor], target: nn.Module | None = None) -> None:
        self.stats, self.target, self.parts = stats, target, []

    def measured(self, norm: nn.Module, x: torch.Tensor) -> bool:
        """If ``norm`` is the one measured: x (its input, the band's own rows) summed; the band stops."""
        if norm is not self.target:
            return False
        self.parts.append(group_partials(x, norm.num_groups))
        return True

    def norm(self, norm: nn.Module, x: torch.Tensor, out: torch.Tensor | None = None,
             shift: torch.Tensor | None = None) -> torch.Tensor:
        """norm + SiLU of x (+ ``shift``, a [C] bias not yet added) with the whole image's statistics."""
        stats = self.stats.get(norm)
        if stats is None:
            raise RuntimeError("sd_kernels: a norm without statistics ran in a streamed decode (a bug)")
        return group_norm_given(x, stats, norm.weight, norm.bias, "silu", out=out,
                                shift=None if shift is None else shift.view(1, -1))

    def result(self) -> torch.Tensor:
        return mean_rstd(merge_group_stats(torch.cat(self.parts, -1)), self.target.eps)


def _resnet_band(u: Unit, x: torch.Tensor, a: int, b: int, c: int, d: int, height: int,
                 p: _Pass, dst: torch.Tensor | None = None) -> torch.Tensor | None:
    """diffusers' ResnetBlock2D.forward (no time embedding, SiLU, eval) on input rows [a, b), output
    rows [c, d): norm1 + SiLU, conv1 on the rows conv2 needs, norm2 + SiLU in place (conv1's bias
    added as it reads), conv2, then conv2's bias, the shortcut (and its conv's bias) and
    ``/ output_scale_factor`` in one pass (``ops.bias_residual``), into ``dst`` (the output's rows,
    e.g. in the decode's buffer) where no read of the band's input can meet it."""
    r = u.module
    own = x[:, :, c - a:d - a]
    if p.measured(r.norm1, own):
        return None
    t = p.norm(r.norm1, x)
    c1, d1 = max(c - 1, 0), min(d + 1, height)
    h = _conv_rows(t, r.conv1.weight, a, b, c1, d1, height, 1, 1)
    del t
    if p.target is r.norm2:  # a statistics pass: of conv1's output with its bias
        if r.conv1.bias is not None:
            h = h.add_(r.conv1.bias.view(1, -1, 1, 1))
        p.measured(r.norm2, h[:, :, c - c1:d - c1])
        return None
    h = p.norm(r.norm2, h, out=h, shift=r.conv1.bias)
    o = _conv_rows(h, r.conv2.weight, c1, d1, c, d, height, 1, 1)
    del h
    skip, bias2 = own, None
    if r.conv_shortcut is not None:
        skip, bias2 = F.conv2d(own, r.conv_shortcut.weight), r.conv_shortcut.bias
    if r.conv2.bias is None:
        bias, bias2 = bias2, None
    else:
        bias = r.conv2.bias
    if dst is None or not _disjoint(dst, skip):
        dst = o
    if bias is None:  # no bias anywhere (a decoder built without): the residual alone
        return torch.add(o, skip, out=dst).div_(r.output_scale_factor)
    return bias_residual(o, bias, skip, bias2, r.output_scale_factor, out=dst)


def _upsample_band(u: Unit, x: torch.Tensor, a: int, b: int, c: int, d: int, height: int,
                   p: _Pass, dst: torch.Tensor | None = None) -> torch.Tensor:
    """Output rows [c, d) of nearest-2× + 3×3 conv from input rows [a, b), by ``_polyphase``: the
    phases at i0..i1 (one 2×2 conv), interleaved with the bias into rows [2·i0, 2·i1), cropped to
    [c, d); straight into ``dst`` when the band is whole row pairs."""
    i0, i1 = c // 2, -(-d // 2)
    phases = _conv_rows(x, _polyphase(u, x), a, b, i0, i1 + 1, height, 1, 0)
    if dst is not None and (c, d) == (2 * i0, 2 * i1):
        return _interleave(phases, u.module.conv.bias, dst)
    n, _, _, w = x.shape
    fmt = torch.channels_last if phases.stride(1) == 1 else torch.contiguous_format
    out = torch.empty(n, u.c_out, 2 * (i1 - i0), 2 * w, dtype=x.dtype, device=x.device, memory_format=fmt)
    return _interleave(phases, u.module.conv.bias, out)[:, :, c - 2 * i0:d - 2 * i0]


def _head_band(u: Unit, x: torch.Tensor, a: int, b: int, c: int, d: int, height: int,
               p: _Pass, dst: torch.Tensor | None = None) -> torch.Tensor | None:
    """conv_out(SiLU(conv_norm_out(x))) on input rows [a, b), output rows [c, d) (into ``dst``)."""
    norm, conv = u.module.conv_norm_out, u.module.conv_out
    if p.measured(norm, x[:, :, c - a:d - a]):
        return None
    y = _conv_rows(p.norm(norm, x), conv.weight, a, b, c, d, height, 1, 1)
    if conv.bias is None:
        return y if dst is None else dst.copy_(y)
    return bias_residual(y, conv.bias, out=dst if dst is not None else y)


_BAND = {"resnet": _resnet_band, "upsample": _upsample_band, "head": _head_band}


# ---------------------------------------------------------------------------------------------
# Running it


@dataclasses.dataclass
class _Kept:
    """An activation of one sample kept in the decode's buffer: rows of [W, C] from an element
    offset, read and written as [1, C, rows, W] channels_last views."""

    buf: torch.Tensor  # flat
    base: int  # element offset
    h: int
    w: int
    c: int

    def rows(self, lo: int, hi: int) -> torch.Tensor:
        r = self.w * self.c
        return self.buf[self.base + lo * r:self.base + hi * r].view(1, hi - lo, self.w, self.c).permute(0, 3, 1, 2)

    def write(self, lo: int, y: torch.Tensor) -> None:
        self.rows(lo, lo + y.shape[2]).copy_(y)


def _run_band(us: list[Unit], sh: _Shape, spans: list[tuple[int, int, int, int]], src: _Kept, start: int,
              p: _Pass, dst: torch.Tensor | None = None) -> torch.Tensor | None:
    """The band's units in turn from the kept input; the last one's output into ``dst`` where it can
    (the returned tensor: ``dst`` itself, or the output to copy there)."""
    x = src.rows(spans[0][0], spans[0][1])
    last = start + len(spans) - 1
    for j, (a, b, c, d) in enumerate(spans, start):
        x = _BAND[us[j].kind](us[j], x, a, b, c, d, sh.h_in[j], p, dst if j == last else None)
        if x is None:
            return None
    return x


def stream_decode(decoder: nn.Module, us: list[Unit], p: Plan, z: torch.Tensor,
                  on_segment: Callable[[Segment], None] | None = None) -> torch.Tensor:
    """``decoder(z)`` by plan ``p`` (see the module docstring), one sample at a time; ``on_segment`` is
    called after each segment (bench.stream_decode reads the memory peak of each)."""
    if z.shape[0] > 1:
        return torch.cat([stream_decode(decoder, us, p, z[i:i + 1], on_segment) for i in range(z.shape[0])])
    head = decoder.mid_block(decoder.conv_in(z), None)
    sh = _shape(us, 1, head.shape[2], head.shape[3], head.element_size())
    bases, size = _layout(us, sh, p.segments, head.numel() * head.element_size())
    buf = head.new_empty(size // sh.elem)
    src = _Kept(buf, bases[0] // sh.elem, head.shape[2], head.shape[3], head.shape[1])
    src.write(0, head)
    del head
    stats: dict[nn.Module, torch.Tensor] = {}
    out = None
    for i, seg in enumerate(p.segments):
        last = seg.stop - 1
        final = seg.stop == len(us)
        dst = None if final else _Kept(buf, bases[i + 1] // sh.elem, sh.h_out[last], sh.w_out[last], us[last].c_out)
        if seg.bands == 1:  # the whole tensor at every unit: the norms take their own statistics
            x = src.rows(0, src.h)
            for u in us[seg.start:seg.stop]:
                x = u.whole(x)
            if final:
                out = x
            else:
                dst.write(0, x)
        else:
            for j in range(seg.start, seg.stop):
                for k, norm in enumerate(us[j].norms):
                    measure = _Pass(stats, norm)
                    if j == seg.start and k == 0:  # it reads the kept input: the statistics are the input's
                        measure.parts = [group_partials(src.rows(0, src.h), norm.num_groups)]
                    else:
                        for lo, hi in _bands(sh.h_out[j], seg.bands):
                            _run_band(us, sh, _spans(us, sh, seg.start, j, lo, hi), src, seg.start, measure)
                    stats[norm] = measure.result()
            run = _Pass(stats)
            if final:
                out = buf.new_empty(1, us[last].c_out, sh.h_out[last], sh.w_out[last])
            for lo, hi in _bands(sh.h_out[last], seg.bands):
                # the output rows: of the image, or in the buffer below the input rows later bands read
                rows = out[:, :, lo:hi] if final else dst.rows(lo, hi)
                y = _run_band(us, sh, _spans(us, sh, seg.start, last, lo, hi), src, seg.start, run, rows)
                if y.data_ptr() != rows.data_ptr():
                    rows.copy_(y)
                del y
        src = dst
        if on_segment is not None:
            on_segment(seg)
    return out


def streaming_forward(decoder: nn.Module, budget: int) -> Callable[..., torch.Tensor]:
    """A ``forward`` for a diffusers VAE ``Decoder`` that streams (``stream_decode``) when the plan for
    the latent's shape under ``budget`` bytes bands anything, and runs the original otherwise (or for
    latent_embeds, gradients, an unsupported decoder: ``Unsupported`` is logged once). The plan is
    one sample's: ``stream_decode`` decodes a batch one sample at a time."""
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
            p = plans[key] = _plan_measured(decoder, us, sample, budget)
            log.info("sd_kernels: streamed VAE decode of %s: %s", list(sample.shape), p.format(us))
        if p.untiled:
            return original(sample, latent_embeds)
        return stream_decode(decoder, us, p, sample)

    return forward


_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _plan_measured(decoder: nn.Module, us: list[Unit], sample: torch.Tensor, budget: int) -> Plan:
    """The plan for ``sample``'s latent shape, on a CUDA device with the workspace of its
    convolutions measured (``measure_workspace``): plan, measure the convolutions not yet measured,
    plan again with them, until a plan runs only measured ones (at most ``_PROBES`` plans; past
    that, or on another device or inside a CUDA graph capture, ``_UNSEEN`` is held back instead)."""
    _, _, h, w = sample.shape
    param = next(decoder.up_blocks.parameters())
    elem = param.element_size()
    head_bytes = decoder.conv_in.out_channels * h * w * elem
    if param.device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return plan(us, 1, h, w, elem, budget, head_bytes)
    # channels_last weights make channels_last activations (cuDNN's output follows its operands)
    cl = decoder.conv_in.weight.stride(1) == 1 and decoder.conv_in.in_channels > 1
    workspace: dict[Conv, int] = {}
    for _ in range(_PROBES):
        p = plan(us, 1, h, w, elem, budget, head_bytes, workspace)
        new = convs_of(us, p, h, w, elem) - workspace.keys()
        if not new:
            return p
        workspace.update(measure_workspace(us, new, h, w, param.dtype, param.device, cl))
    log.info("sd_kernels: the streamed decode's plan kept meeting unmeasured convolutions; %d MiB held back "
             "for their workspace instead", _UNSEEN >> 20)
    return plan(us, 1, h, w, elem, budget, head_bytes)


def plans_of(decoder: nn.Module) -> dict[tuple, Plan]:
    """The plans a streaming forward of ``decoder`` made, per (latent shape, dtype) (logs, tests, bench)."""
    return _PLANS.get(decoder, {})
