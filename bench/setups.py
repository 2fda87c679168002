"""How a pipeline is set up for one end-to-end measurement: the variants, the paper's ablation.

A ``Setup`` says whether the pipeline is patched (which op families), runs its UNet step from CUDA
graphs, is compiled, and which attention path the profile forces. ``applied(pipe, setup)`` sets the
pipeline up for the block and undoes it after, through ``patch(pipe, profile=, ops=, cuda_graph=)``
with ``dataclasses.replace(profile, attention=...)`` for the ablation's forced attention paths.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch


@dataclasses.dataclass(frozen=True)
class Setup:
    """How a pipeline runs: patched or stock, which op families (None: all), CUDA graphs, torch.compile,
    and the attention path forced in the profile (the ablation's rows)."""

    name: str
    patched: bool = False
    ops: tuple[str, ...] | None = None
    graph: bool = False
    compile: bool = False
    attention: str | None = None


VARIANTS = {s.name: s for s in (
    Setup("stock"),
    Setup("stock+compile", compile=True),
    Setup("stock+graph", graph=True),
    Setup("patched", patched=True),
    Setup("patched+graph", patched=True, graph=True),
    Setup("patched+compile", patched=True, compile=True),
)}
NO_COMPILE = tuple(name for name, s in VARIANTS.items() if not s.compile)

# The paper's ablation, cumulative; every row replays the UNet step from CUDA graphs (in eager mode
# an H100 is bound by the host, which would hide the kernels).
ABLATION = (
    Setup("baseline", graph=True),
    Setup("+ partially fused softmax", True, ("attention",), True, attention="partial_softmax"),
    Setup("+ FlashAttention", True, ("attention",), True, attention="auto"),
    Setup("+ GroupNorm/GELU fusion", True, ("attention", "gelu", "group_norm"), True, attention="auto"),
    Setup("+ Winograd", True, ("attention", "gelu", "group_norm", "winograd"), True, attention="auto"),
)


class Unsupported(Exception):
    """A measurement that cannot run here (no GPU for a graph variant, over the time cap, ...)."""


@contextlib.contextmanager
def compiled(pipe) -> Iterator[None]:
    """torch.compile (default mode) of the UNet and the VAE decoder, channels-last as is usual with it."""
    mods = [pipe.unet, pipe.vae.decoder]
    saved = [m.__dict__.get("forward") for m in mods]  # a patch may have bound its own forward
    for m in mods:
        m.to(memory_format=torch.channels_last)
        m.forward = torch.compile(m.forward)
    try:
        yield
    finally:
        for m, old in zip(mods, saved):
            if old is None:
                del m.forward
            else:
                m.forward = old
            m.to(memory_format=torch.contiguous_format)
        torch._dynamo.reset()


@contextlib.contextmanager
def applied(pipe, setup: Setup) -> Iterator[dict[str, str]]:
    """Run the block with ``pipe`` set up as ``setup`` says; yields facts for the row."""
    import sd_kernels

    info = {"e2e_mode": "graph" if setup.graph else "compile" if setup.compile else "eager",
            "patched": "", "profile": ""}
    with contextlib.ExitStack() as stack:
        if setup.patched or setup.graph:  # stock + graph: patch(ops=()) only installs the CUDA graphs
            profile = (dataclasses.replace(sd_kernels.get_profile(), attention=setup.attention)
                       if setup.attention else None)
            record = sd_kernels.patch(pipe, ops=setup.ops if setup.patched else (), profile=profile,
                                      cuda_graph=setup.graph)
            stack.callback(sd_kernels.unpatch, pipe)
            info["patched"] = " ".join(f"{k}={n}" for k, n in sorted(record.counts.items()))
            info["profile"] = record.profile
        if setup.compile:
            stack.enter_context(compiled(pipe))
        yield info
