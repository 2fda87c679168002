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
convolution of four phases at the input's resolution (``ops.upsample``'s algebra: 16 instead of
36 multiply-adds per input pixel and channel pair, no upsampled copy), interleaved into the band. The
image is the untiled decode's up to rounding (the phases' summed weights are rounded once to the
weights' dtype; the norms' statistics are merged in float64).

With ``plan(pack=True)`` (the profile's ``stream_pack8``) the plan may keep an activation in 8 bits
(``ops.pack8``: int8 codes, a float32 scale per pixel and 32 channels; ``_Kept(packed=True)``): its
bands are unpacked into tensors of their own before a band runs and packed as the final pass writes
them. That is lossy (each element off by up to half a step of its group's largest value), so the
image is then close to the untiled one (≥ 40 dB, tested), not equal to it up to rounding; the plan
packs only where it buys at least ``_PACK_SECONDS`` of modelled time.

``plan`` (patches/stream_plan.py) chooses where segments end and how many bands each takes, from a
memory model (the segment's span of the buffer + the widest unit's live tensors; ``_peak``) and a
time model (convolution FLOPs + a cost per launch; ``_cost``): keeping an activation saves the
passes that would recompute it, but it must fit under the budget beside a band. On a CUDA device
each band is charged the cuDNN workspace measured for its convolutions (``_plan_measured``,
``measure_workspace``); the biases of the convolutions are added by the ops after them
(``ops.bias_residual`` for a ResNet's tail). The model only chooses; bench.stream_decode measures
the peak. Verified against diffusers 0.42.1's Decoder.forward, UpDecoderBlock2D.forward and
ResnetBlock2D.forward (source hashes, the last because a band re-states it); an unverified
diffusers, a decoder of another structure (SpatialNorm, a transposed-conv upsampler, a convolution
with hooks or of another class) or a latent_embeds argument runs the original forward.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from sd_kernels.ops.group_stats import group_norm_given, group_partials, mean_rstd, merge_group_stats
from sd_kernels.ops.pack8 import pack8, unpack8
from sd_kernels.ops.residual import bias_residual
from sd_kernels.ops.upsample import PhaseCache, interleave_phases

from .diffusers_sources import is_verified
from .group_norm import _resnet_forward
from .hooks import hooked
from .stream_plan import (  # noqa: F401  (_SLACK, _working: the planner's, named here for tests and bench)
    _PROBES,
    _SLACK,
    _UNSEEN,
    Conv,
    Plan,
    Segment,
    Unit,
    _bands,
    _layout,
    _Shape,
    _shape,
    _spans,
    _working,
    conv_input,
    convs_of,
    kept_row_bytes,
    plan,
)

log = logging.getLogger(__name__)


class Unsupported(Exception):
    """The decoder is not one this module streams (the message says why)."""


def _plain_conv(conv: nn.Module, where: str, kernel: int | None = None) -> None:
    """A convolution a band may run as ``F.conv2d`` on its weights: an exact nn.Conv2d, odd square
    kernel, same padding, stride 1, no hooks (a LoRA layer, a Winograd or an offloaded conv runs its
    own forward, which a band cannot)."""
    k = conv.kernel_size if isinstance(conv, nn.Conv2d) else None
    if (type(conv) is not nn.Conv2d or k[0] != k[1] or k[0] % 2 == 0 or (kernel is not None and k[0] != kernel)
            or conv.padding != (k[0] // 2,) * 2 or conv.stride != (1, 1) or conv.dilation != (1, 1)
            or conv.groups != 1 or conv.padding_mode != "zeros" or hooked(conv)):
        raise Unsupported(f"{where} is not a plain same-padded nn.Conv2d without hooks ({conv})")


def _norm(norm: nn.Module, where: str) -> None:
    """A GroupNorm a band applies with given statistics and a SiLU: nn.GroupNorm (ours included)
    that applies no activation of its own, or SiLU (ours fused, ``activation == "silu"``)."""
    if not isinstance(norm, nn.GroupNorm) or getattr(norm, "activation", "silu") not in (None, "silu") or hooked(norm):
        raise Unsupported(f"{where} is a {type(norm).__name__} (not a plain GroupNorm)")


def _resnet(name: str, r: nn.Module) -> Unit:
    from diffusers.models.resnet import ResnetBlock2D

    if type(r) is not ResnetBlock2D or not is_verified(ResnetBlock2D.forward):
        raise Unsupported(f"{name} is a {type(r).__name__}, not diffusers 0.42.1's ResnetBlock2D")
    if hooked(r, (_resnet_forward,)):  # the GroupNorm patch's forward re-states the class's: a band may too
        raise Unsupported(f"{name} has hooks (a band would skip them)")
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
    if hooked(u):
        raise Unsupported(f"{name} has hooks (a band would skip them)")
    if (type(u).__name__ not in ("Upsample2D", "PolyphaseUpsample2D")  # the upsample family's class: same module
            or not u.use_conv or u.use_conv_transpose or not u.interpolate or u.norm is not None
            or u.name != "conv" or getattr(u, "interpolate_mode", "nearest") != "nearest"):
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
        if hooked(block):
            raise Unsupported(f"up_blocks.{i} has hooks (a band would skip them)")
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
    """The upsampler's conv as the four phases' 2×2 weights (``ops.upsample.polyphase_weight``):
    output pixel (2i + a, 2j + b) is phase (a, b) at (i + a, j + b). Kept in a ``PhaseCache`` per conv
    (held weakly), per weight version, dtype and layout. The bias is not folded: ``interleave_phases``
    adds it."""
    conv = u.module.conv
    cache = _PHASES.get(conv)
    if cache is None or cache.weight is not conv.weight:  # first use, or the parameter was replaced
        cache = _PHASES[conv] = PhaseCache(conv.weight)
    return cache.get(like.dim() == 4 and like.shape[1] > 1 and like.stride(1) == 1)


_PHASES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _Pass:
    """One pass over bands: the statistics known so far, and the norm it measures (None: the final
    pass), whose band partials it gathers. A ``live`` pass (patches/split_decode.py) measures each
    norm's statistics as the norm runs, from the band's ``own`` rows: the band functions then add
    conv1's bias before norm2 instead of handing it over as a shift."""

    live = False

    def __init__(self, stats: dict[nn.Module, torch.Tensor], target: nn.Module | None = None) -> None:
        self.stats, self.target, self.parts = stats, target, []

    def measured(self, norm: nn.Module, x: torch.Tensor) -> bool:
        """If ``norm`` is the one measured: x (its input, the band's own rows) summed; the band stops."""
        if norm is not self.target:
            return False
        self.parts.append(group_partials(x, norm.num_groups))
        return True

    def norm(self, norm: nn.Module, x: torch.Tensor, out: torch.Tensor | None = None,
             shift: torch.Tensor | None = None, own: torch.Tensor | None = None,
             activation: str | None = "silu") -> torch.Tensor:
        """norm + SiLU (or ``activation``) of x (+ ``shift``, a [C] bias not yet added) with the whole
        image's statistics (``own``: x's rows that this band owns, which a live pass measures)."""
        stats = self.stats.get(norm)
        if stats is None:
            raise RuntimeError("sd_kernels: a norm without statistics ran in a streamed decode (a bug)")
        return group_norm_given(x, stats, norm.weight, norm.bias, activation, out=out,
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
    t = p.norm(r.norm1, x, own=own)
    c1, d1 = max(c - 1, 0), min(d + 1, height)
    h = _conv_rows(t, r.conv1.weight, a, b, c1, d1, height, 1, 1)
    del t
    if p.target is r.norm2 or p.live:  # norm2's statistics measured here: of conv1's output with its bias
        if r.conv1.bias is not None:
            h = h.add_(r.conv1.bias.view(1, -1, 1, 1))
        own_h = h[:, :, c - c1:d - c1]
        if p.measured(r.norm2, own_h):
            return None
        h = p.norm(r.norm2, h, out=h, own=own_h)
    else:
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
        return interleave_phases(phases, u.module.conv.bias, dst)
    n, _, _, w = x.shape
    fmt = torch.channels_last if phases.stride(1) == 1 else torch.contiguous_format
    out = torch.empty(n, u.c_out, 2 * (i1 - i0), 2 * w, dtype=x.dtype, device=x.device, memory_format=fmt)
    return interleave_phases(phases, u.module.conv.bias, out)[:, :, c - 2 * i0:d - 2 * i0]


def _head_band(u: Unit, x: torch.Tensor, a: int, b: int, c: int, d: int, height: int,
               p: _Pass, dst: torch.Tensor | None = None) -> torch.Tensor | None:
    """conv_out(SiLU(conv_norm_out(x))) on input rows [a, b), output rows [c, d) (into ``dst``)."""
    norm, conv = u.module.conv_norm_out, u.module.conv_out
    own = x[:, :, c - a:d - a]
    if p.measured(norm, own):
        return None
    y = _conv_rows(p.norm(norm, x, own=own), conv.weight, a, b, c, d, height, 1, 1)
    if conv.bias is None:
        return y if dst is None else dst.copy_(y)
    return bias_residual(y, conv.bias, out=dst if dst is not None else y)


_BAND = {"resnet": _resnet_band, "upsample": _upsample_band, "head": _head_band}


# ---------------------------------------------------------------------------------------------
# Running it


@dataclasses.dataclass
class _Kept:
    """An activation of one sample kept in the decode's (byte) buffer from offset ``base``: rows of
    [W, C] in ``dtype``, read and written as [1, C, rows, W] channels_last views; or, ``packed``
    (``ops.pack8``), rows of [W, C] int8 codes each followed by its [W, C / G] float32 scales, read
    by unpacking a band into a tensor of its own and written by packing one."""

    buf: torch.Tensor  # flat uint8
    base: int  # byte offset
    h: int
    w: int
    c: int
    dtype: torch.dtype
    packed: bool = False

    def _row_bytes(self) -> int:
        return kept_row_bytes(self.w, self.c, self.dtype.itemsize, self.packed)

    def view(self, lo: int, hi: int) -> torch.Tensor | None:
        """Rows [lo, hi) as a view of the buffer (None when packed: there is none)."""
        if self.packed:
            return None
        r = self._row_bytes()
        rows = self.buf[self.base + lo * r:self.base + hi * r].view(self.dtype)
        return rows.view(1, hi - lo, self.w, self.c).permute(0, 3, 1, 2)

    def _codes(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        r, wc = self._row_bytes(), self.w * self.c
        rows = self.buf[self.base + lo * r:self.base + hi * r].view(hi - lo, r)
        values = rows[:, :wc].view(torch.int8).view(1, hi - lo, self.w, self.c)
        return values, rows[:, wc:].view(torch.float32).view(1, hi - lo, self.w, -1)

    def rows(self, lo: int, hi: int) -> torch.Tensor:
        """Rows [lo, hi): a view, or unpacked into a channels_last tensor of their own."""
        if not self.packed:
            return self.view(lo, hi)
        out = torch.empty(1, self.c, hi - lo, self.w, dtype=self.dtype, device=self.buf.device,
                          memory_format=torch.channels_last)
        return unpack8(*self._codes(lo, hi), out)

    def write(self, lo: int, y: torch.Tensor) -> None:
        if self.packed:
            pack8(y, *self._codes(lo, lo + y.shape[2]))
        else:
            self.view(lo, lo + y.shape[2]).copy_(y)

    def partials(self, num_groups: int, bands: int) -> list[torch.Tensor]:
        """Partial statistics of the whole activation (``group_partials``): of the view at once, or
        of ``bands`` unpacked bands (the plan counted one band's unpacked rows)."""
        if not self.packed:
            return [group_partials(self.view(0, self.h), num_groups)]
        return [group_partials(self.rows(lo, hi), num_groups) for lo, hi in _bands(self.h, bands)]


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
    buf = torch.empty(size, dtype=torch.uint8, device=head.device)
    src = _Kept(buf, bases[0], head.shape[2], head.shape[3], head.shape[1], head.dtype)
    src.write(0, head)
    del head
    stats: dict[nn.Module, torch.Tensor] = {}
    out = None
    for i, seg in enumerate(p.segments):
        last = seg.stop - 1
        final = seg.stop == len(us)
        dst = None if final else _Kept(buf, bases[i + 1], sh.h_out[last], sh.w_out[last], us[last].c_out, src.dtype,
                                       seg.packed)
        if seg.bands == 1:  # the whole tensor at every unit: the norms take their own statistics
            x = src.view(0, src.h)  # never packed: the planner runs modules whole only in the untiled decode
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
                        measure.parts = src.partials(norm.num_groups, seg.bands)
                    else:
                        for lo, hi in _bands(sh.h_out[j], seg.bands):
                            _run_band(us, sh, _spans(us, sh, seg.start, j, lo, hi), src, seg.start, measure)
                    stats[norm] = measure.result()
            run = _Pass(stats)
            if final:
                out = torch.empty(1, us[last].c_out, sh.h_out[last], sh.w_out[last], dtype=src.dtype, device=buf.device)
            for lo, hi in _bands(sh.h_out[last], seg.bands):
                # the output rows: of the image, or in the buffer below the input rows later bands read
                rows = out[:, :, lo:hi] if final else dst.view(lo, hi)
                y = _run_band(us, sh, _spans(us, sh, seg.start, last, lo, hi), src, seg.start, run, rows)
                if rows is None:
                    dst.write(lo, y)
                elif y.data_ptr() != rows.data_ptr():
                    rows.copy_(y)
                del y
        src = dst
        if on_segment is not None:
            on_segment(seg)
    return out


def streaming_forward(decoder: nn.Module, budget: int, pack: bool = False) -> Callable[..., torch.Tensor]:
    """A ``forward`` for a diffusers VAE ``Decoder`` that streams (``stream_decode``) when the plan for
    the latent's shape under ``budget`` bytes bands anything, and runs the original otherwise (or for
    latent_embeds, gradients, an unsupported decoder: ``Unsupported`` is logged once). The plan is
    one sample's: ``stream_decode`` decodes a batch one sample at a time. ``pack``: the plan may keep
    activations in 8 bits (``plan(pack=True)``; the profile's ``stream_pack8``)."""
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
            p = plans[key] = _plan_measured(decoder, us, sample, budget, pack)
            log.info("sd_kernels: streamed VAE decode of %s: %s", list(sample.shape), p.format(us))
        if p.untiled:
            return original(sample, latent_embeds)
        return stream_decode(decoder, us, p, sample)

    return forward


_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _plan_measured(decoder: nn.Module, us: list[Unit], sample: torch.Tensor, budget: int, pack: bool = False) -> Plan:
    """The plan for ``sample``'s latent shape, on a CUDA device with the workspace of its
    convolutions measured (``measure_workspace``): plan, measure the convolutions not yet measured,
    plan again with them, until a plan runs only measured ones (at most ``_PROBES`` plans; past
    that, or on another device or inside a CUDA graph capture, ``_UNSEEN`` is held back instead)."""
    _, _, h, w = sample.shape
    param = next(decoder.up_blocks.parameters())
    elem = param.element_size()
    head_bytes = decoder.conv_in.out_channels * h * w * elem
    if param.device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return plan(us, 1, h, w, elem, budget, head_bytes, pack=pack)
    # channels_last weights make channels_last activations (cuDNN's output follows its operands)
    cl = decoder.conv_in.weight.stride(1) == 1 and decoder.conv_in.in_channels > 1
    workspace: dict[Conv, int] = {}
    for _ in range(_PROBES):
        p = plan(us, 1, h, w, elem, budget, head_bytes, workspace, pack)
        new = convs_of(us, p, h, w, elem) - workspace.keys()
        if not new:
            return p
        workspace.update(measure_workspace(us, new, h, w, param.dtype, param.device, cl))
    log.info("sd_kernels: the streamed decode's plan kept meeting unmeasured convolutions; %d MiB held back "
             "for their workspace instead", _UNSEEN >> 20)
    return plan(us, 1, h, w, elem, budget, head_bytes, pack=pack)


def plans_of(decoder: nn.Module) -> dict[tuple, Plan]:
    """The plans a streaming forward of ``decoder`` made, per (latent shape, dtype) (logs, tests, bench)."""
    return _PLANS.get(decoder, {})
