"""One VAE decode split over processes by rows (``enable_split_decode``): each decodes 1/W of the image, exact.

Under ``patch(pipe, parallel="cfg")`` or context parallelism every process ends the denoising loop with the
same latents, and each then runs the whole VAE decode: the same work W times. Here process r of the W of
torch.distributed's default group decodes its own band of rows, and one all-gather hands every process the
whole image, which the pipeline then post-processes as before.

A band cannot be decoded alone: a 3×3 convolution reads one row beyond each edge of its output, a
GroupNorm normalizes with the statistics of the whole image, and the mid-block's attention lets every
pixel attend to every other. So the decode runs unit by unit (``conv_in``, the mid-block's two ResNet
blocks and its attention, then the up-stack: ResNet blocks, upsamplers, the output head; the band
functions of patches/stream_decode.py and two of this module's), every process alike:

- process r owns latent rows [r·h/W, (r+1)·h/W) and the same rows, scaled, at every later resolution.
  ``conv_in`` reads the latent, which every process holds; each unit's output is written between margins
  as deep as the next unit reads past a band's edge (2 rows for a ResNet block's two convolutions, 1 for
  an upsampler or the output head, none for the attention), and one all-gather of every process's first
  and last rows fills them from the neighbours (at the image's edges the band functions pad as the
  convolution does);
- each GroupNorm's statistics are the whole image's: every process's (count, mean, M2) of the rows it
  owns, all-gathered and merged by Chan's formula in float64 (``ops.group_stats``), so every process
  applies the same numbers (a ResNet block's norm2 measures conv1's output after its bias is added);
- the attention's queries are the process's own pixels; its keys and values, projected from the own
  rows, are all-gathered (bands of unequal height padded to the tallest), so each query sees every
  pixel, through the op the patched processor calls (AttnProcessor2_0's steps,
  patches/attention_processor_steps.py);
- the image's bands are all-gathered at the end.

The image is the unsplit decode's up to rounding: the band functions' convolutions and the two-step
statistics are those of the streamed decode (tested against the untiled decode there); here the
statistics' parts are per process. Collectives per call: first a check that every process decodes latents
of the same shape and dtype (host numbers, over gloo, the group's or one beside it: the host does not wait for the
work queued on the GPU, so the decode's launches still overlap the denoising loop's last steps) and the
same sum (gathered on the device, compared once the decode is queued: a ValueError then, on every process,
instead of the image); both skipped while a CUDA graph captures the decode, so that graph's replays go
unchecked. Then one for the margins after every unit the next one reads past its edges, one per
GroupNorm, one for the attention's keys and values and one for the image, per sample: for one sample of
an SD VAE (conv_in, the mid-block, 12 ResNet blocks, 3 upsamplers, the output head) 1 + 18 + 30 + 1 + 1
= 51 on the device. The statistics are a few kB; a margin exchange sends a process's first and last k
rows, up to 4 rows × width × channels (SDXL at 1024² in fp32: 4 MiB), and every process receives all W
processes'; the keys and values are 2 × the latent's pixels × 512 channels (SDXL at 1024² in fp32: 64
MiB gathered). The statistics, margins and keys wait for every process, so the decode runs at the pace
of the slowest.

Where the mid-block is not the one re-stated here (another structure, an attention processor other than
ours or the stock ones ours mirrors, hooks on its modules) on any process, the head (``conv_in`` and the
mid-block) runs whole on every process and the split starts at the up-stack: decided at every call,
agreed by the latents' check (while a CUDA graph captures, where nothing can be read back, the last
agreement holds: the capture's warm-up call made one). Where the latent has fewer rows than 2 per
process, where autograd is on, or for ``latent_embeds`` (a decoder with spatial norms) the decoder's own
forward runs, on every process alike. A decoder whose up-stack the band functions do not know
(``stream_decode.units`` says why: another structure, hooks on its modules) is refused by
``enable_split_decode``. Its collectives keep the VAE's decode out of CUDA graphs
(patches/cuda_graph.py), unless ``SD_KERNELS_GRAPH_COLLECTIVES=1``.
"""

from __future__ import annotations

import logging
import zlib

import torch
import torch.distributed as dist
import torch.nn as nn

from sd_kernels.ops.group_stats import group_partials, mean_rstd, merge_group_stats
from sd_kernels.ops.residual import bias_residual

from . import attention_processor_steps as steps
from . import cfg_parallel, context_parallel
from .cuda_graph import SPLIT_DECODE as MARK
from .cuda_graph import GraphedCall
from .diffusers_sources import is_verified
from .hooks import hooked
from .record import PatchRecord
from .stream_decode import _BAND, Unit, Unsupported, _conv_rows, _Pass, _plain_conv, _resnet, units

log = logging.getLogger(__name__)
KIND = "split_decode"
MIN_ROWS = 2  # latent rows a process must own: a ResNet block reads 2 rows past its band's edges


class Exchange:
    """The decode's collectives over ``group``: an all-gather along a new first axis, in rank order;
    ``agree`` gathers host numbers, over ``host_group`` (gloo) where there is one."""

    host_group = None

    def __init__(self, group, host_group=None) -> None:
        self.group, self.host_group = group, host_group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        every = context_parallel.waited(context_parallel.all_gather(x.contiguous(), 0, self.group))
        return every.view(self.world, *x.shape)

    def agree(self, values: list[float], device: torch.device) -> list[list[float]]:
        """Every process's ``values`` (numbers the host knows), in rank order. Over the host group the
        host waits for the other processes only; through the device's all-gather it would wait for all
        the work queued on the GPU before it (the whole denoising loop, at a decode's start)."""
        mine = torch.tensor(values, dtype=torch.float64)
        if self.host_group is None:
            return self.gather(mine.to(device)).tolist()
        every = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(every, mine, group=self.host_group)
        return [e.tolist() for e in every]


def host_group(group):
    """A group over ``group``'s processes that gathers host (CPU) tensors: ``group`` itself where it has a
    gloo backend (``init_process_group("gloo")`` or ``"cpu:gloo,cuda:nccl"``), else a new gloo group (a
    collective call: ``enable`` makes it on every process alike, ``group`` being the default one); None
    where this torch has no gloo."""
    if "gloo" in str(dist.get_backend(group)):
        return group
    if not dist.is_gloo_available():
        return None
    return dist.new_group(dist.get_process_group_ranks(group), backend="gloo")


class _LivePass(_Pass):
    """Each norm's statistics measured as it runs: this process's own rows, merged with every other's."""

    live = True

    def __init__(self, exchange: Exchange) -> None:
        super().__init__({})
        self.exchange = exchange

    def norm(self, norm: nn.Module, x: torch.Tensor, out: torch.Tensor | None = None,
             shift: torch.Tensor | None = None, own: torch.Tensor | None = None,
             activation: str | None = "silu") -> torch.Tensor:
        if norm not in self.stats:
            if own is None or shift is not None:
                raise RuntimeError("sd_kernels: a split decode's norm ran without its own rows (a bug)")
            mine = merge_group_stats(group_partials(own, norm.num_groups))  # [3, N, G] float64
            every = self.exchange.gather(mine).movedim(0, -1)  # [3, N, G, W]
            self.stats[norm] = mean_rstd(merge_group_stats(every), norm.eps)
        return super().norm(norm, x, out, shift, activation=activation)


def _attention_flags(attn: nn.Module) -> tuple[bool, bool, str]:
    """(legacy, fused, precision) of the processor the mid-block's attention runs: ours, or the stock
    ones ours mirrors (``Unsupported`` for any other: its code is not what a band re-states)."""
    from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0, FusedAttnProcessor2_0

    from .attention import SDKernelsAttnProcessor

    proc = attn.processor
    if type(proc) is SDKernelsAttnProcessor:
        return proc.legacy, proc.fused, proc.precision
    stock = {AttnProcessor2_0: (False, False), AttnProcessor: (True, False), FusedAttnProcessor2_0: (False, True)}
    if type(proc) in stock and is_verified(type(proc).__call__):
        return (*stock[type(proc)], "exact")
    raise Unsupported(f"mid_block.attentions.0 runs a {type(proc).__name__}")


def head_units(decoder: nn.Module) -> list[Unit]:
    """The decoder's head as units a band runs: ``conv_in``, the mid-block's first ResNet block, its
    attention (over every process's keys), its second ResNet block; ``Unsupported`` says why not."""
    from diffusers.models.attention_processor import Attention
    from diffusers.models.unets.unet_2d_blocks import UNetMidBlock2D

    mid = decoder.mid_block
    if type(mid) is not UNetMidBlock2D or not is_verified(UNetMidBlock2D.forward):
        raise Unsupported("the mid-block is not diffusers 0.42.1's UNetMidBlock2D")
    if len(mid.resnets) != 2 or len(mid.attentions) != 1 or mid.attentions[0] is None:
        raise Unsupported("the mid-block is not two ResNet blocks around one attention")
    attn = mid.attentions[0]
    norm = attn.group_norm
    if hooked(mid) or hooked(attn) or hooked(norm):  # the ResNet blocks and conv_in: checked as units are made
        raise Unsupported("the mid-block, its attention or the attention's norm has hooks (a band would skip them)")
    _plain_conv(decoder.conv_in, "conv_in", 3)
    if (type(attn) is not Attention or attn.spatial_norm is not None or attn.norm_q is not None
            or attn.norm_k is not None or attn.is_cross_attention or not isinstance(norm, nn.GroupNorm)
            or getattr(norm, "activation", None) is not None):
        raise Unsupported("mid_block.attentions.0 is not a self-attention with a plain GroupNorm")
    _attention_flags(attn)
    conv = decoder.conv_in
    return [Unit("conv_in", "conv", conv, 1, 1, conv.in_channels, conv.out_channels),
            _resnet("mid_block.resnets.0", mid.resnets[0]),
            Unit("mid_block.attentions.0", "attention", attn, 0, 1, norm.num_channels, norm.num_channels, (norm,)),
            _resnet("mid_block.resnets.1", mid.resnets[1])]


def _conv_band(u: Unit, x: torch.Tensor, a: int, b: int, c: int, d: int, height: int, p: _Pass,
               dst: torch.Tensor | None = None) -> torch.Tensor:
    """A 3×3 convolution (``conv_in``): output rows [c, d) from input rows [a, b), its bias added."""
    conv = u.module
    y = _conv_rows(x, conv.weight, a, b, c, d, height, 1, 1)
    return y if conv.bias is None else bias_residual(y, conv.bias, out=y)


def _attention_band(u: Unit, x: torch.Tensor, a: int, b: int, c: int, d: int, height: int, p: _LivePass,
                    dst: torch.Tensor | None = None) -> torch.Tensor:
    """The mid-block's attention (AttnProcessor2_0's steps, patches/attention_processor_steps.py) for this
    process's rows [c, d) = [a, b) as queries, over every process's keys and values: the GroupNorm on the
    whole image's statistics, q, k, v of the own rows, one all-gather of the keys and values (bands of
    unequal height padded to the tallest), the attention, the output projection and the residual."""
    attn, ex = u.module, p.exchange
    legacy, fused, precision = _attention_flags(attn)
    n, ch, rows, w = x.shape
    t = p.norm(attn.group_norm, x, own=x, activation=None)
    tokens = t.permute(0, 2, 3, 1).reshape(n, rows * w, ch)
    if fused:
        query, key, value = attn.to_qkv(tokens).chunk(3, dim=-1)
    else:
        query, key, value = attn.to_q(tokens), attn.to_k(tokens), attn.to_v(tokens)
    key, value = _joined(torch.stack((key, value)), ex, height, w, dim=2)  # [2, n, rows · w, C] from each process
    head_dim = key.shape[-1] // attn.heads
    query, key, value = (steps.heads(z, n, attn.heads, head_dim) for z in (query, key, value))
    out = steps.attend(attn, query, key, value, None, legacy, precision)
    return steps.finish(attn, out, x, (n, ch, rows, w))


BANDS = {**_BAND, "conv": _conv_band, "attention": _attention_band}


def _rows(n: int, c: int, h: int, w: int, like: torch.Tensor) -> torch.Tensor:
    """An [n, c, h, w] tensor in channels_last memory (a band of rows is then one contiguous block)."""
    return torch.empty(n, h, w, c, dtype=like.dtype, device=like.device).permute(0, 3, 1, 2)


def _fill_margins(buf: torch.Tensor, top: int, rows: int, bottom: int, k: int, ex: Exchange) -> None:
    """The margins of ``buf`` (``top`` rows above this process's ``rows``, ``bottom`` below) from the
    neighbours' edge rows: one all-gather of every process's first and last ``k`` rows."""
    own = buf[:, :, top:top + rows]
    edges = ex.gather(torch.cat([own[:, :, :k], own[:, :, rows - k:]], dim=2))  # [W, n, C, 2k, w]
    if top:
        buf[:, :, :top].copy_(edges[ex.rank - 1][:, :, 2 * k - top:])
    if bottom:
        buf[:, :, top + rows:].copy_(edges[ex.rank + 1][:, :, :bottom])


def _band_of(rank: int, world: int, height: int) -> tuple[int, int]:
    return rank * height // world, (rank + 1) * height // world


def decode_band(decoder: nn.Module, us: list[Unit], z: torch.Tensor, ex: Exchange,
                head: bool = True) -> torch.Tensor:
    """``decoder(z)`` for one sample (module docstring): this process's band of ``us`` (``head``: the
    head's units first, from the latent; else the up-stack's, after the head ran whole), and the whole
    image from every process's band."""
    x = z if head else decoder.mid_block(decoder.conv_in(z), None)
    n, _, h0, w0 = x.shape
    lo0, hi0 = _band_of(ex.rank, ex.world, h0)
    p = _LivePass(ex)
    # per unit: the input rows its owned output rows [lo, hi) need [a, b), the input's height, the scale after it
    spans, scale = [], 1
    for u in us:
        h_in = h0 * scale
        scale *= u.scale
        spans.append((*u.need(lo0 * scale, hi0 * scale, h_in), lo0 * scale, hi0 * scale, h_in, scale))
    x_lo = 0  # the absolute row of the input's first row
    for j, (u, (a, b, lo, hi, h_in, s)) in enumerate(zip(us, spans)):
        rows = hi - lo
        last = j + 1 == len(us)
        # margins as deep as the next unit reads past the band's edges (none at the image's)
        top, bottom = (0, 0) if last else (lo - spans[j + 1][0], spans[j + 1][1] - hi)
        buf = _rows(n, u.c_out, top + rows + bottom, w0 * s, x)
        dst = buf[:, :, top:top + rows]
        y = BANDS[u.kind](u, x[:, :, a - x_lo:b - x_lo], a, b, lo, hi, h_in, p, dst)
        if y.data_ptr() != dst.data_ptr():
            dst.copy_(y)
        del y
        if not last and us[j + 1].radius:
            _fill_margins(buf, top, rows, bottom, us[j + 1].radius, ex)
        x, x_lo = buf, lo - top
    return _joined(x, ex, h0, scale, dim=2)  # the image


def _joined(x: torch.Tensor, ex: Exchange, height: int, per_row: int, dim: int) -> torch.Tensor:
    """Every process's ``x``, its band of the ``height`` latent rows laid along ``dim`` (``per_row`` entries a
    row), joined in rank order along ``dim``: bands of unequal height padded to the tallest for the
    all-gather (the padding gathered, never read)."""
    bands = [_band_of(r, ex.world, height) for r in range(ex.world)]
    shape = list(x.shape)
    shape[dim] = max(hi - lo for lo, hi in bands) * per_row
    padded = x.new_empty(shape)
    padded.narrow(dim, 0, x.shape[dim]).copy_(x)
    every = ex.gather(padded)
    return torch.cat([every[r].narrow(dim, 0, (hi - lo) * per_row) for r, (lo, hi) in enumerate(bands)], dim=dim)


def _capturing(x: torch.Tensor) -> bool:
    """Whether a CUDA graph captures the work on ``x`` (nothing can be read back then)."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


class SplitForward:
    """A VAE ``Decoder``'s ``forward`` that decodes its band of rows on each process of ``group``: the
    head in bands too (``head_units``) where every process can, else whole on each (decided again at
    every call, alike on every process: a processor set on the attention since may not be one a band
    re-states)."""

    def __init__(self, decoder: nn.Module, us: list[Unit], group, host=None) -> None:
        self.original = decoder.forward
        self.decoder, self.units, self.exchange = decoder, us, Exchange(group, host)
        self.warned = self.short = False  # logged once: the head runs whole; a latent too short to split
        self.agreed = False  # the last check: every process could run the head in bands

    def __repr__(self) -> str:
        return f"SplitForward(process {self.exchange.rank} of {self.exchange.world})"

    def head(self) -> list[Unit] | None:
        """The head's units, where this process can run them in bands (else None, the reason logged once)."""
        try:
            return head_units(self.decoder)
        except Unsupported as exc:
            if not self.warned:
                log.info("sd_kernels: the split VAE decode runs the decoder's head whole on every process (%s)", exc)
                self.warned = True
            return None

    def _check(self, z: torch.Tensor, head: bool) -> tuple[bool, torch.Tensor]:
        """Every process decodes latents of the same shape and dtype (a ValueError on every process alike,
        otherwise: they set the exchanges' sizes), agreed on the host; returns whether every process can
        run the head in bands, and every process's latents' sum, gathered on the device for ``_verify``
        to compare once the decode is queued (no wait here for the GPU's queued work)."""
        dtype = float(zlib.crc32(str(z.dtype).encode()))
        every = self.exchange.agree([float(head), *z.shape, dtype], z.device)
        if any(e[1:] != every[0][1:] for e in every):
            raise ValueError("the split VAE decode: the processes decode latents of different shapes or dtypes (head "
                             f"in bands, shape and dtype code by process: {every}): every process must run the same "
                             "pipeline call (same prompt, seed and settings)")
        sums = self.exchange.gather(z.detach().double().sum().reshape(1)).view(-1)
        return all(e[0] for e in every), sums

    @staticmethod
    def _verify(sums: torch.Tensor) -> None:
        """Every process's latents' sum the same (NaN as NaN), else a ValueError on every process alike:
        the image of different latents is no process's."""
        a, b = sums, sums[:1]
        near = (a - b).abs() <= (cfg_parallel.SUM_RTOL * torch.maximum(a.abs(), b.abs())).clamp_min(1e-12)
        same = (a == b) | (a.isnan() & b.isnan()) | (near & a.isfinite() & b.isfinite())  # inf only as inf
        if not bool(same.all()):
            raise ValueError("the split VAE decode: the processes decode different latents (their sums by process: "
                             f"{sums.tolist()}): every process must run the same pipeline call (same prompt, seed and "
                             "settings)")

    def __call__(self, sample: torch.Tensor, latent_embeds: torch.Tensor | None = None) -> torch.Tensor:
        if latent_embeds is not None or torch.is_grad_enabled():
            return self.original(sample, latent_embeds)
        head = self.head()
        if _capturing(sample):
            # a graph cannot read values back: the last agreement holds (the capture's warm-up call made one)
            if self.agreed and head is None:
                raise RuntimeError("the split VAE decode: every process agreed to run the decoder's head in bands, "
                                   "and this one no longer can while a CUDA graph captures the decode (its mid-block "
                                   "changed since): capture again on every process")
            head = head if self.agreed else None
            sums = None
        else:
            self.agreed, sums = self._check(sample, head is not None)
            head = head if self.agreed else None
        if sample.shape[2] < MIN_ROWS * self.exchange.world:
            if not self.short:
                log.warning("sd_kernels: the split VAE decode runs whole on every process: %d latent rows are fewer "
                            "than %d per process", sample.shape[2], MIN_ROWS)
                self.short = True
            image = self.original(sample, latent_embeds)
        else:
            us = self.units if head is None else head + self.units
            image = torch.cat([decode_band(self.decoder, us, sample[i:i + 1], self.exchange, head is not None)
                               for i in range(sample.shape[0])])
        if sums is not None:
            self._verify(sums)
        return image


def _local(obj: object) -> tuple[nn.Module | None, list[Unit] | None, str | None, bool]:
    """(the VAE, its units, why it cannot be split here, whether it is split already), on this process."""
    vae = getattr(obj, "vae", None) if hasattr(obj, "components") else obj
    decoder = getattr(vae, "decoder", None)
    if decoder is None:
        return vae, None, f"this {type(obj).__name__} has no VAE with a decoder to split", False
    current = vars(decoder).get("forward")
    if isinstance(current, SplitForward):
        return vae, None, None, True
    if current is not None and not (getattr(current, "__self__", None) is decoder
                                    and getattr(current, "__func__", None) is type(decoder).forward):
        return vae, None, ("the VAE decoder's forward is replaced already (a memory budget's streamed decode, or "
                           "another wrapper): the split decode runs the decoder's own"), False
    try:
        return vae, units(decoder), None, False
    except Unsupported as exc:
        return vae, None, f"this VAE's decoder cannot be split ({exc})", False


def enable(obj: object, record: PatchRecord) -> None:
    """``enable_split_decode`` on ``obj``'s VAE, through ``record`` (unpatch undoes it). Every process
    says what it found before any raises, so that all raise alike."""
    group = cfg_parallel.group_or_error("enable_split_decode")
    vae, us, why, done = _local(obj)
    decoder = getattr(vae, "decoder", None)
    mine = (why, done, type(vae).__name__, cfg_parallel.config_text(vae) if decoder is not None else "",
            cfg_parallel.weights_sum(decoder) if decoder is not None else 0.0)
    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    if whys := [(r, e[0]) for r, e in enumerate(every) if e[0]]:
        some = "" if len(whys) == len(every) else f" (on process {', '.join(str(r) for r, _ in whys)} only)"
        raise ValueError(f"enable_split_decode: {whys[0][1]}{some}")
    if any(e[1] != done for e in every):
        raise ValueError("enable_split_decode: the VAE decode is split on some processes already and not on others: "
                         "call it alike on every process")
    if done:
        return
    first = every[0]  # every process compares with the first: one verdict everywhere (closeness is not transitive)
    if any(e[2:4] != first[2:4] for e in every) or not cfg_parallel.close([e[4] for e in every],
                                                                           [first[4]] * len(every)):
        raise ValueError("enable_split_decode: the processes hold different VAEs (class, config or weights): every "
                         "process must load the same pipeline")
    graphed = vars(vae).get("decode")
    if isinstance(graphed, GraphedCall):  # graphs captured before hold no collectives: dropped now, not at unpatch
        graphed.reset()
    host = host_group(group)
    record.set_attr(decoder, "forward", SplitForward(decoder, us, group, host), KIND)
    record.set_attr(vae, MARK, True, None)
    if host is not None and host is not group:  # the gloo group made here ends with the split
        record.on_undo(lambda: dist.destroy_process_group(host) if dist.is_initialized() else None, KIND, count=0)
