"""FLUX's adaLN modulations under context parallelism: each process computes 1/W of them, one all-gather a call.

Every FLUX block turns the step's embedding into its shifts, scales and gates with one matrix-vector product,
``norm.linear(silu(temb))``: 3,072 → 18,432 for each stream of a double-stream block, 3,072 → 9,216 for a
single-stream block, 3.2 billion weights (6.5 GB in bf16) read every step. Under context parallelism every
process holds the same ``temb`` and computes all of them: W processes read the weights W times, and that
time does not shrink with W (at 1024², 28 steps, the ``…x8…`` GEMMs: 56 ms an image on each of four H200,
bench/results/2026-11-28-h200x4-flux-ring-copy-engine; 62 ms on one, 2026-11-28-h200x2-flux-ring-nccl).

``enable`` (``enable_context_parallel(pipe, split_modulation=True)``) lets each process compute its 1/W
share of every block's output columns, all of them at the first block's call (one SiLU, one product per
block on a contiguous slice of its weight's rows, one concatenation), then exchanges the shares in one
all-gather ([B, N/W] from each process; N = 1.05 million for FLUX.1-dev, 2 MB gathered in bf16) and puts
the columns back in order (one gather of indices). The patched blocks (patches/layer_norm.py,
``_ada_norm_zero``) take their chunk of the result instead of their own product. Equal up to rounding: a
product over a slice of the rows may be reduced in another order than over all of them (two CPU processes:
the image within fp32 rounding of one process's; FLUX.1-dev under ring on H200s, torch 2.11, Triton 3.6: the
image as without the split (PSNR 47.87 dB against one GPU's stock image), 26 ms an image faster on 2 GPUs and
39 on 4, bench/results/2026-11-28-h200x4-split-decode/before-host-agreement).

The result is remembered with the ``temb`` object it came from (and its version, where it has one), so
every block of one call finds it and the next call computes anew; that result and that ``temb`` are all
that is kept between calls. Outside ``torch.no_grad()`` (autograd), under ``torch.compile``, for a block
norm this does not know (the FP8 tier's, a module replaced after ``enable``) or whose ``linear`` was
replaced since, the block computes its own product as before. Every process must take this path alike
(``enable_context_parallel`` is called alike on every process).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

from . import context_parallel
from .hooks import called_beside

# each block norm enabled -> its transformer's split
_SPLITS: weakref.WeakKeyDictionary[nn.Module, _Split] = weakref.WeakKeyDictionary()
_COMPUTED = 0  # splits computed in this process (``computed``)
_SILU = "_sd_kernels_silu"  # the attribute ``silu`` keeps an embedding's SiLU in


class _Split:
    """The modulation products of ``norms`` (modules with a ``linear``), 1/W of each per process of ``group``."""

    def __init__(self, norms: list[nn.Module], group) -> None:
        self.group, self.world, self.rank = group, group.size(), group.rank()
        self.linears = [n.linear for n in norms]
        self.index = {id(n): i for i, n in enumerate(norms)}
        outs = [lin.out_features for lin in self.linears]
        self.shares = [o // self.world for o in outs]
        self.starts = [sum(outs[:i]) for i in range(len(outs))]  # each product's first column in the result
        local_starts = [sum(self.shares[:i]) for i in range(len(outs))]
        self.local = sum(self.shares)
        # the result's column j of product i comes from process j // share, its local column start_i + j % share
        order = []
        for o, share, start in zip(outs, self.shares, local_starts):
            j = torch.arange(o)
            order.append(torch.div(j, share, rounding_mode="floor") * self.local + start + j % share)
        self.order = torch.cat(order).to(self.linears[0].weight.device)  # on the device before any capture
        self._source: tuple | None = None  # (temb, its version) the result is of
        self._result: torch.Tensor | None = None

    def product(self, norm: nn.Module, emb: torch.Tensor) -> torch.Tensor:
        """``norm.linear(silu(emb))`` for the norm at ``self.index``: its columns of this call's result."""
        version = None if emb.is_inference() else emb._version  # inference tensors keep no version counter
        if self._source is None or self._source[0] is not emb or self._source[1] != version:
            self._result = self._compute(emb)
            self._source = (emb, version)
        i = self.index[id(norm)]
        return self._result[:, self.starts[i]:self.starts[i] + self.linears[i].out_features]

    def _compute(self, emb: torch.Tensor) -> torch.Tensor:
        global _COMPUTED
        _COMPUTED += 1
        x = F.silu(emb)
        parts = []
        for lin, share in zip(self.linears, self.shares):
            rows = slice(self.rank * share, (self.rank + 1) * share)
            parts.append(F.linear(x, lin.weight[rows], None if lin.bias is None else lin.bias[rows]))
        mine = torch.cat(parts, dim=1)  # [B, N/W]
        every = context_parallel.waited(context_parallel.all_gather(mine, 0, self.group))  # [W·B, N/W]
        bsz = emb.shape[0]
        flat = every.view(self.world, bsz, self.local).transpose(0, 1).reshape(bsz, self.world * self.local)
        if self.order.device != flat.device:
            self.order = self.order.to(flat.device)
        return flat.index_select(1, self.order)


def reason(norms: list[nn.Module], world: int) -> str | None:
    """Why the modulations of ``norms`` cannot be split over ``world`` processes, or None."""
    for n in norms:
        lin = getattr(n, "linear", None)
        if not isinstance(lin, nn.Linear):
            return f"{type(n).__name__} has no nn.Linear 'linear'"
        if lin.out_features % world:
            return f"{world} processes do not divide {type(n).__name__}'s {lin.out_features} modulation columns"
    return None


def enable(norms: list[nn.Module], group) -> None:
    """Split the modulation products of ``norms`` (one transformer's block norms) over ``group``'s processes."""
    why = reason(norms, group.size())
    if why is not None:
        raise ValueError(f"split_modulation: {why}")
    split = _Split(norms, group)
    for n in norms:
        _SPLITS[n] = split


def disable(norms: list[nn.Module]) -> None:
    """Undo ``enable`` for ``norms``: each computes its own product again (every process alike)."""
    for n in norms:
        _SPLITS.pop(n, None)


def product(norm: nn.Module, emb: torch.Tensor) -> torch.Tensor | None:
    """``norm.linear(silu(emb))`` from the split where ``enable`` covered ``norm`` and the call may take it (no
    autograd, not compiling, ``norm.linear`` the one enabled), else None (the caller computes it). Every
    process of the group must take it alike: the first block's call runs a collective."""
    split = _SPLITS.get(norm)
    if split is None or torch.is_grad_enabled() or torch.compiler.is_compiling():
        return None
    if norm.linear is not split.linears[split.index[id(norm)]]:
        return None  # its linear replaced since (another patch's): the norm computes with what it now holds
    return split.product(norm, emb)


def silu(norm: nn.Module, emb: torch.Tensor) -> torch.Tensor:
    """``norm.silu(emb)``, made once per ``emb`` (and its version): every block norm of a DiT call reads the same
    step embedding, so the first block's SiLU serves the rest (and, in the FP8 tier, the codes its linear
    attaches to it: one quantization a call, not one a block). The SiLU is kept on ``emb`` (the tensor holds
    it, as ``attach_quantized`` keeps codes), so it lives no longer than ``emb``; it serves again while neither
    ``emb`` nor the SiLU itself has changed in place since (their version counters; a write through ``.data``,
    which moves no counter, is not seen, as anywhere in torch). A norm whose ``silu`` is not torch's ``nn.SiLU``,
    is an in-place one or has hooks, calls autograd tracks or torch.compile traces, and an inference tensor or a
    call under inference mode (whose outputs keep no version counter) run ``norm.silu(emb)`` as it is."""
    act = norm.silu
    if (type(act) is not nn.SiLU or act.inplace or called_beside(act) or torch.compiler.is_compiling()
            or emb.is_inference() or torch.is_inference_mode_enabled()
            or (torch.is_grad_enabled() and emb.requires_grad)):
        return act(emb)
    held = getattr(emb, _SILU, None)
    if held is not None and held[0] == emb._version and held[1]._version == held[2]:
        return held[1]
    out = act(emb)
    setattr(emb, _SILU, (emb._version, out, out._version))
    return out


def covers(norm: nn.Module) -> bool:
    """Whether ``enable`` covered ``norm``."""
    return norm in _SPLITS


def computed() -> int:
    """How many times this process has computed a split (each a transformer call that took it)."""
    return _COMPUTED
