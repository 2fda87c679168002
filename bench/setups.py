"""How a pipeline is set up for one end-to-end measurement: the variants, the paper's ablation.

A ``Setup`` says whether the pipeline is patched (which op families), runs its UNet step from CUDA
graphs, is compiled, and which attention path the profile forces. ``applied(pipe, setup)`` sets the
pipeline up for the block and undoes it after. It codes against sd_kernels' contracts
(``patch(pipe, profile=, ops=, ignore=, cuda_graph=)``, ``Profile.attention``, the ``winograd``
patcher); where a build lacks one, the setup raises ``Unsupported`` naming it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Iterator
from typing import Any

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
    """A setup this build cannot run (a contract another part of sd-kernels has not delivered yet)."""


def _profile_for(attention: str | None):
    """The active profile with its attention path forced (None: the profile as detected)."""
    import sd_kernels

    if attention is None:
        return None
    prof = sd_kernels.get_profile()
    if not hasattr(prof, "attention"):
        raise Unsupported("this build's Profile has no `attention` field to force the path with")
    return dataclasses.replace(prof, attention=attention)


def patch_supports_cuda_graph() -> bool:
    import sd_kernels

    return "cuda_graph" in inspect.signature(sd_kernels.patch).parameters


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
    from sd_kernels.patches import PATCHERS

    import sd_kernels

    missing = set(setup.ops or ()) - set(PATCHERS)
    if missing:
        raise Unsupported(f"no {', '.join(sorted(missing))} patcher in this build")
    info = {"e2e_mode": "compile" if setup.compile else "eager", "patched": "", "profile": ""}
    with contextlib.ExitStack() as stack:
        if setup.patched or (setup.graph and patch_supports_cuda_graph()):
            kwargs: dict[str, Any] = {"ops": setup.ops if setup.patched else ()}
            if setup.attention:
                kwargs["profile"] = _profile_for(setup.attention)
            if setup.graph and patch_supports_cuda_graph():
                kwargs["cuda_graph"] = True
                info["e2e_mode"] = "graph"
            record = sd_kernels.patch(pipe, **kwargs)
            stack.callback(sd_kernels.unpatch, pipe)
            info["patched"] = " ".join(f"{k}={n}" for k, n in sorted(record.counts.items()))
            info["profile"] = record.profile
        if setup.graph and info["e2e_mode"] != "graph":
            info["e2e_mode"] = "eager (no patch(cuda_graph=True) in this build)"
        if setup.compile:
            stack.enter_context(compiled(pipe))
        yield info
