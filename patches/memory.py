"""The memory patcher: fit a model into the active profile's budgets (mobile emulation).

Desktop profiles set no budgets and this patcher changes nothing. A profile with
``intermediate_budget_mb`` gets its feed-forwards chunked over tokens so that the GEGLU's 2n-wide
projection (at 4096 tokens the largest intermediate in a UNet step once flash attention stores no
scores) never exceeds ``profile.chunk_bytes()``, and its VAE decoder tiled (``tiled_decode``: global
GroupNorm statistics, a halo as wide as the receptive field, so no seams). A profile with
``memory_budget_mb`` gets the model's entry points run under ``memory.BudgetGuard``: past the budget
the call fails with ``MemoryBudgetExceeded`` naming the module, the bytes and the budget.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from sd_kernels.memory import guarded
from sd_kernels.profiles import active_profile

from .families import family_of
from .record import PatchRecord
from .registry import register


class ChunkedFeedForward(nn.Module):
    """A diffusers FeedForward run over slices of the tokens, each within ``max_bytes``.

    Tokens are independent in a feed-forward, so the slices' outputs are the unchunked output (the
    same kernels on fewer rows; bit-identical where the matmul does not pick another algorithm for
    another row count). Holds the original's ``net`` (same modules, same state_dict keys) and calls
    the original module itself, hooks and all.
    """

    def __init__(self, ff: nn.Module, max_bytes: int) -> None:
        super().__init__()
        self.net = ff.net
        object.__setattr__(self, "_original", ff)  # not a submodule: its parameters are net's
        self.max_bytes = max_bytes
        self.widest = max(m.out_features for m in ff.modules() if isinstance(m, nn.Linear))

    def chunk_tokens(self, batch: int, element_size: int) -> int:
        # The widest projection's output and as much again alive beside it (GEGLU's halves, its output).
        return max(1, self.max_bytes // (2 * batch * self.widest * element_size))

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        x = hidden_states
        if x.dim() < 2:
            return self._original(x)
        tokens = x.shape[-2]
        step = self.chunk_tokens(x.numel() // max(1, tokens * x.shape[-1]), x.element_size())
        if step >= tokens:
            return self._original(x)
        first = self._original(x[..., :step, :])
        out = first.new_empty(*x.shape[:-1], first.shape[-1])
        out[..., :step, :] = first
        del first
        for t0 in range(step, tokens, step):
            out[..., t0:t0 + step, :] = self._original(x[..., t0:t0 + step, :])
        return out

    def extra_repr(self) -> str:
        return f"max_bytes={self.max_bytes}"


# ---------------------------------------------------------------------------------------------
# Tiled VAE decode with global GroupNorm statistics

class _Stop(Exception):
    """Ends a statistics pass once the norm being measured has seen its input."""


def _norms(decoder: nn.Module) -> list[nn.GroupNorm]:
    """The up-stack's GroupNorms in execution order (diffusers builds them in that order)."""
    ups = [m for block in decoder.up_blocks for m in block.modules() if isinstance(m, nn.GroupNorm)]
    return [*ups, decoder.conv_norm_out]


def _apply(norm: nn.GroupNorm, x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """``norm`` (and its fused SiLU, if it has one: patches/group_norm.py) with given statistics."""
    n, c = x.shape[:2]
    y = ((x.reshape(n, norm.num_groups, -1).float() - mean[..., None]) * rstd[..., None]).reshape(x.shape)
    if norm.weight is not None:
        y = y * norm.weight.float().view(1, c, 1, 1) + norm.bias.float().view(1, c, 1, 1)
    if getattr(norm, "activation", None) == "silu":
        y = F.silu(y)
    return y.to(x.dtype)


@contextlib.contextmanager
def _fixed_norms(norms: list[nn.GroupNorm], stats: list[tuple[torch.Tensor, torch.Tensor]],
                 measure: Any) -> Iterator[None]:
    """Norms with known global statistics apply them; the next one goes to ``measure`` (which raises
    _Stop). Instance ``forward``s for the length of one pass, removed after it."""
    saved = [norm.__dict__.get("forward") for norm in norms]
    for i, norm in enumerate(norms):
        if i < len(stats):
            norm.forward = lambda x, norm=norm, st=stats[i]: _apply(norm, x, *st)
        elif i == len(stats):
            norm.forward = measure
    try:
        yield
    finally:
        for norm, forward in zip(norms, saved):
            if forward is None:
                norm.__dict__.pop("forward", None)
            else:
                norm.forward = forward


def _up_stack(decoder: nn.Module, h: torch.Tensor) -> torch.Tensor:
    for block in decoder.up_blocks:
        h = block(h, None)
    return decoder.conv_out(decoder.conv_act(decoder.conv_norm_out(h)))


def _up_convs(decoder: nn.Module) -> Iterator[tuple[nn.Conv2d, int]]:
    """The up-stack's convolutions with the upscale over the latent at which each runs."""
    scale = 1
    for block in decoder.up_blocks:
        for m in block.resnets.modules():
            if isinstance(m, nn.Conv2d):
                yield m, scale
        if getattr(block, "upsamplers", None):
            scale *= 2  # nearest 2× then a conv: the conv runs at the new scale
            yield from ((m, scale) for m in block.upsamplers.modules() if isinstance(m, nn.Conv2d))
    yield decoder.conv_out, scale


def receptive_radius(decoder: nn.Module) -> int:
    """Latent pixels of context one output pixel of the up-stack depends on (each k×k conv at upscale
    s reaches (k // 2) · dilation pixels there, 1/s of that in the latent): a halo this wide makes the
    tiles exact."""
    return math.ceil(sum(m.kernel_size[0] // 2 * m.dilation[0] / s for m, s in _up_convs(decoder)))


def tile_side(decoder: nn.Module, max_bytes: int, element_size: int, halo: int) -> int:
    """Latent pixels per tile side such that the widest activation of a tile with its halo stays within
    ``max_bytes`` where it can (at least 8: below that the halo's recomputation dominates)."""
    per_px = max(max(m.in_channels, m.out_channels) * s * s for m, s in _up_convs(decoder)) * element_size
    return max(8, math.isqrt(max(1, max_bytes // per_px)) - 2 * halo)


def _spans(size: int, tile: int, halo: int) -> list[tuple[int, int, int, int]]:
    """One axis of ``size`` latent pixels cut into tiles: (lo, hi, b0, b1) per tile, its own pixels
    [lo, hi) and its padded box [b0, b1), every box of side min(size, tile + 2·halo).

    A box is as large at the image's edges as inside (shifted inward to stay in the image), so the
    edge tiles own more: the first owns [0, side − halo), the last its box's end but the halo above
    it, the ones between ``tile`` pixels each, with ``halo`` on both sides. Every side of a tile's own
    pixels that is not the image's edge has ≥ halo pixels of context in its box: exact as before,
    one box shape for all tiles and fewer tiles than a regular grid whose edge boxes are clipped.
    """
    side = min(size, tile + 2 * halo)
    if side == size:
        return [(0, size, 0, size)]
    cuts = [0, side - halo]
    while size - cuts[-1] > side - halo:  # the rest does not fit under a last box with a halo above it
        cuts.append(cuts[-1] + tile)
    cuts.append(size)
    boxes = [min(max(lo - halo, 0), size - side) for lo in cuts[:-1]]
    return [(lo, hi, b0, b0 + side) for lo, hi, b0 in zip(cuts, cuts[1:], boxes)]


class _Tile:
    """One tile of the latent: its own pixels [y0, y1) × [x0, x1) and the padded box around them,
    of the same size for every tile (``_spans``): each conv and norm of the up-stack sees one shape,
    not one per kind of edge tile (Triton tunes and compiles per shape, cuDNN plans per shape)."""

    def __init__(self, ys: tuple[int, int, int, int], xs: tuple[int, int, int, int]) -> None:
        (y0, y1, self.py0, self.py1), (x0, x1, self.px0, self.px1) = ys, xs
        self.own = (y0, y1, x0, x1)

    def crop(self, m: torch.Tensor) -> torch.Tensor:
        return m[..., self.py0:self.py1, self.px0:self.px1]

    def own_part(self, t: torch.Tensor) -> torch.Tensor:
        """The tile's own pixels of ``t``, an activation of the padded box at any upscale."""
        s = t.shape[-2] // (self.py1 - self.py0)
        y0, y1, x0, x1 = self.own
        return t[..., (y0 - self.py0) * s:(y1 - self.py0) * s, (x0 - self.px0) * s:(x1 - self.px0) * s]


class _GroupStats:
    """A norm's stand-in during its statistics pass: sums its input over the current tile's own
    pixels per (sample, group), then stops the pass."""

    def __init__(self, n: int, groups: int, device: torch.device) -> None:
        self.sums = torch.zeros(3, n, groups, dtype=torch.float64, device=device)
        self.tile: _Tile | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        g = self.tile.own_part(x).double().reshape(*self.sums.shape[1:], -1)
        self.sums[0] += g.shape[-1]
        self.sums[1] += g.sum(-1)
        self.sums[2] += (g * g).sum(-1)
        raise _Stop

    def mean_rstd(self, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        count, total, squares = self.sums
        mean = total / count
        var = (squares / count - mean * mean).clamp_min(0)  # biased, as GroupNorm's; fp64 sums
        return mean.float(), torch.rsqrt(var + eps).float()


def tiled_decoder_forward(decoder: nn.Module, z: torch.Tensor, tile: int, halo: int) -> torch.Tensor:
    """``decoder(z)`` with the up-stack run one box of (``tile`` + 2·``halo``)² latent pixels at a time
    (``_spans``: edge tiles own more of their box); exact (to rounding) when ``halo >=
    receptive_radius(decoder)``.

    conv_in and the mid-block (global attention, at latent resolution: small) run on the whole
    latent. Every GroupNorm of the up-stack normalizes with statistics of the *whole* image, as
    untiled: pass k runs every tile up to norm k with norms < k fixed to their global statistics and
    sums norm k's input over the tile's own pixels (the halo belongs to the neighbours); the last pass
    writes each tile's own pixels of the output. Peak memory: one tile's activations, the output;
    cost: one partial pass per norm (≈ norms / 2 decodes, times the halo's overhead).
    """
    m = decoder.mid_block(decoder.conv_in(z), None)
    n, _, H, W = m.shape
    tiles = [_Tile(ys, xs) for ys in _spans(H, tile, halo) for xs in _spans(W, tile, halo)]
    norms = _norms(decoder)
    stats: list[tuple[torch.Tensor, torch.Tensor]] = []
    for norm in norms:
        measure = _GroupStats(n, norm.num_groups, z.device)
        for measure.tile in tiles:
            with _fixed_norms(norms, stats, measure), contextlib.suppress(_Stop):
                _up_stack(decoder, measure.tile.crop(m))
        stats.append(measure.mean_rstd(norm.eps))

    out = None
    with _fixed_norms(norms, stats, None):
        for t in tiles:
            y = t.own_part(_up_stack(decoder, t.crop(m)))
            y0, y1, x0, x1 = t.own
            s = y.shape[-2] // (y1 - y0)
            if out is None:
                out = y.new_empty(n, y.shape[1], H * s, W * s)
            out[..., y0 * s:y1 * s, x0 * s:x1 * s] = y
    return out


def tiled_decode(decoder: nn.Module, max_bytes: int) -> Any:
    """A ``forward`` for a diffusers VAE Decoder that tiles (see tiled_decoder_forward) when the whole
    up-stack would not fit ``max_bytes`` per activation; exact halo. A latent no larger than one
    tile's box decodes untiled: its activations are no larger than the box's, and it takes one pass."""
    original, halo = decoder.forward, receptive_radius(decoder)

    def forward(sample: torch.Tensor, latent_embeds: torch.Tensor | None = None) -> torch.Tensor:
        tile = tile_side(decoder, max_bytes, sample.element_size(), halo)
        box = tile + 2 * halo
        if latent_embeds is not None or torch.is_grad_enabled() or max(sample.shape[-2:]) <= box:
            return original(sample, latent_embeds)
        return tiled_decoder_forward(decoder, sample, tile, halo)

    return forward


def _feed_forwards(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    from diffusers.models.attention import FeedForward

    return [(parent, name, child) for parent in model.modules() for name, child in parent._modules.items()
            if type(child) is FeedForward]


@register("memory")
def patch_memory(model: nn.Module, record: PatchRecord) -> None:
    prof, fam = active_profile(), family_of(model)
    if prof.intermediate_budget_mb is not None:
        for parent, name, ff in _feed_forwards(model):
            record.set_attr(parent, name, ChunkedFeedForward(ff, prof.chunk_bytes()), "memory.ChunkedFeedForward")
        decoder = getattr(model, "decoder", None)
        if fam is not None and fam.tiled_decode and decoder is not None:
            record.set_attr(decoder, "forward", tiled_decode(decoder, prof.chunk_bytes()), "memory.tiled_vae_decode")
    budget = prof.memory_budget_bytes()
    if budget is not None:
        kind = type(model).__name__
        device = next(model.parameters()).device
        if device.type != "cuda":
            record.skip("", kind, f"memory budget {prof.memory_budget_mb} MB not enforced: the model is on "
                        f"{device} and the guard measures CUDA memory (each unguarded call is logged once)")
        for path in fam.guarded if fam else ():
            module = model.get_submodule(path)
            label = f"{kind}.{path}" if path else kind
            record.set_attr(module, "forward", guarded(module.forward, budget, module, label),
                            f"memory.budget({prof.memory_budget_mb} MB)")
