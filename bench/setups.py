"""How a pipeline is set up for one end-to-end measurement: the variants, the paper's ablation.

A ``Setup`` says whether the pipeline is patched (which op families), which CUDA graphs
``patch(cuda_graph=)`` installs, whether the patch compiles what its graphs capture, whether the
pipeline is torch.compiled the way diffusers documents it (the recipe), and which attention path the
profile forces. ``applied(pipe, setup)`` sets the pipeline up for the block and undoes it after.

The recipe, ``stock+compile-graphs`` (``PEER``: what our numbers are compared with), is diffusers'
own speed recipe ("Accelerate inference of text-to-image diffusion models" in its docs): UNet and VAE
channels_last, ``pipe.fuse_qkv_projections()``,
``torch.compile(..., fullgraph=True)`` of the UNet and of the VAE's decode in a mode with CUDA graphs.
The recipe names mode="max-autotune"; its compile of the SD1.5 UNet autotunes every GEMM and
convolution and does not fit one 10-minute call on the GPU machine (measured on the H100: 18 of them
autotuned, 7–16 s each, 395 s into the UNet's compile when a 520 s limit stopped it), so the default
variant uses mode="reduce-overhead" (the same CUDA graphs, inductor's default kernel choices);
``stock+compile-max-autotune`` is the recipe's mode, for a machine with time for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator

import torch
from sd_kernels.patches import PATCHERS


@dataclasses.dataclass(frozen=True)
class Setup:
    """How a pipeline runs: patched or stock, which op families (None: all), CUDA graphs, torch.compile,
    and the attention path forced in the profile (the ablation's rows)."""

    name: str
    patched: bool = False
    ops: tuple[str, ...] | None = None
    graph: bool | str = False  # patch(cuda_graph=...)
    compile: str = ""  # torch.compile mode of diffusers' recipe ("" none)
    attention: str | None = None
    patch_compile: bool | str = False  # patch(compile=...): the graphs capture torch.compile'd calls
    fuse_qkv: bool = False  # pipe.fuse_qkv_projections() (replaces every attention processor)
    precision: str | None = None  # patch(precision=...): "fp8" for the FP8 tier

    @property
    def slow_start(self) -> bool:
        """Whether the set-up compiles (minutes of warm-up)."""
        return bool(self.compile or self.patch_compile)


PEER = "stock+compile-graphs"
PEER_UNFUSED = "stock+compile-graphs-unfused-qkv"
VARIANTS = {s.name: s for s in (
    Setup("stock"),
    Setup("stock+graph", graph=True),
    Setup(PEER, compile="reduce-overhead", fuse_qkv=True),
    # The recipe less fuse_qkv_projections(): whether the fused projections (strided q/k/v into
    # cuDNN's attention) pay on the DiTs, measured beside it (bench.dit takes the faster peer row).
    Setup(PEER_UNFUSED, compile="reduce-overhead"),
    Setup("patched", patched=True),
    Setup("patched+graph", patched=True, graph=True),
    Setup("patched+graph+compile", patched=True, graph=True, patch_compile=True),
    Setup("patched+compile-graphs", patched=True, compile="reduce-overhead"),
    Setup("stock+compile-max-autotune", compile="max-autotune", fuse_qkv=True),
    # Our best without Winograd (every other family): what the Winograd routes are worth end to end.
    Setup("patched+graph+compile-no-winograd", patched=True, graph=True, patch_compile=True,
          ops=tuple(sorted(set(PATCHERS) - {"winograd"}))),
    # The lossless patch after fuse_qkv_projections() (our processor serves the fused projections): set
    # beside patched+graph, what the fusion is worth without compile.
    Setup("patched+graph+fused-qkv", patched=True, graph=True, fuse_qkv=True),
    # Our best after the recipe's fuse_qkv_projections() (our processor serves the fused projections).
    Setup("patched+graph+compile+fused-qkv", patched=True, graph=True, patch_compile=True, fuse_qkv=True),
    # Each denoising step (guidance batch, UNet, combine, scheduler.step) from one graph, without and with compile.
    Setup("patched+step-graph", patched=True, graph="step"),
    Setup("patched+step-graph+compile+fused-qkv", patched=True, graph="step", patch_compile=True, fuse_qkv=True),
    # The same with inductor's autotuning inside our graphs: against the recipe's own mode.
    Setup("patched+graph+compile-max-autotune+fused-qkv", patched=True, graph=True, patch_compile="max-autotune",
          fuse_qkv=True),
    # The opt-in FP8 tier (lossy; GPUs with FP8 tensor cores): bench.fp8's rows, and asked for by name in
    # bench.e2e and bench.dit.
    Setup("patched+graph+fp8", patched=True, graph=True, precision="fp8"),
    Setup("patched+graph+compile+fp8", patched=True, graph=True, patch_compile=True, precision="fp8"),
)}
# What a plan runs by default (max-autotune's compile does not fit the GPU machine's 10-minute calls;
# the Winograd-less row is an ablation, the FP8 tier lossy: asked for by name).
DEFAULT_VARIANTS = tuple(n for n in VARIANTS if VARIANTS[n].precision is None and n not in (
    "stock+compile-max-autotune", PEER_UNFUSED, "patched+graph+compile-no-winograd", "patched+graph+fused-qkv",
    "patched+graph+compile+fused-qkv", "patched+step-graph", "patched+step-graph+compile+fused-qkv",
    "patched+graph+compile-max-autotune+fused-qkv"))
NO_COMPILE = tuple(n for n in DEFAULT_VARIANTS if not VARIANTS[n].slow_start)
# Graphs that replay a part's calls (then its steady time is its device time): ours or inductor's.
CUDAGRAPH_COMPILE_MODES = ("reduce-overhead", "max-autotune")

# The paper's ablation, cumulative; every row replays the UNet step from CUDA graphs (in eager mode
# an H100 is bound by the host, which would hide the kernels), the rest of the pipeline as diffusers
# runs it.
ABLATION = (
    Setup("baseline", graph="unet"),
    Setup("+ partially fused softmax", True, ("attention",), "unet", attention="partial_softmax"),
    Setup("+ FlashAttention", True, ("attention",), "unet", attention="auto"),
    Setup("+ GroupNorm/GELU fusion", True, ("attention", "gelu", "group_norm"), "unet", attention="auto"),
    Setup("+ Winograd", True, ("attention", "gelu", "group_norm", "winograd"), "unet", attention="auto"),
)


def graphs_part(setup: Setup, part: str) -> bool:
    """Whether ``setup`` replays ``part``'s ("unet", "vae") calls from CUDA graphs."""
    if setup.compile in CUDAGRAPH_COMPILE_MODES:
        return True
    return bool(setup.graph) and (part == "unet" or setup.graph in (True, "pipeline", "step"))


class Unsupported(Exception):
    """A measurement that cannot run here (no GPU for a graph variant, over the time cap, ...)."""


def denoiser_of(pipe):
    """The model the denoising loop calls: the UNet, or a DiT pipeline's transformer."""
    return pipe.unet if getattr(pipe, "unet", None) is not None else pipe.transformer


def qkv_owner(pipe):
    """What ``fuse_qkv_projections()`` is called on: SD pipelines fuse their UNet's and VAE's
    projections; DiT pipelines have no such method, their transformer has."""
    return pipe if hasattr(pipe, "fuse_qkv_projections") else denoiser_of(pipe)


@contextlib.contextmanager
def compiled(pipe, mode: str, fuse_qkv: bool) -> Iterator[None]:
    """diffusers' recipe: channels_last, fused QKV projections (``fuse_qkv``), torch.compile(mode,
    fullgraph=True) of the denoiser's forward (the UNet's, or a DiT pipeline's transformer's), the
    ControlNet's (if any: its docs compile it beside the UNet) and the VAE's decode; undone after the
    block. With a ControlNet and CUDA graphs, each ControlNet call first marks a new step
    (``torch.compiler.cudagraph_mark_step_begin``, torch's advice for loops over several graphed
    functions): without it, the UNet's graph reads ControlNet outputs that the next replay overwrote,
    and torch raises ("accessing tensor output of CUDAGraphs that has been overwritten by a subsequent
    run", measured on the H100)."""
    calls = [(denoiser_of(pipe), "forward"), (pipe.vae, "decode")]
    if getattr(pipe, "controlnet", None) is not None:
        calls.append((pipe.controlnet, "forward"))
    fused = qkv_owner(pipe)
    if fuse_qkv:
        fused.fuse_qkv_projections()
    try:
        with compiled_methods(calls, mode, marked=getattr(pipe, "controlnet", None)):
            yield
    finally:
        if fuse_qkv:
            fused.unfuse_qkv_projections()
        torch._dynamo.reset()


@contextlib.contextmanager
def compiled_methods(calls, mode: str, marked=None, fullgraph: bool = True,
                     channels_last: bool = True) -> Iterator[None]:
    """Each (module, method name) of ``calls`` (in channels_last) with the method torch.compiled (mode,
    fullgraph) in its place; put back after the block. ``marked``: the module whose compiled calls
    first mark a new CUDA-graph step (the recipe's ControlNet, above)."""
    saved = [m.__dict__.get(name) for m, name in calls]  # a patch may have bound its own
    try:
        for m, name in calls:
            if channels_last:
                m.to(memory_format=torch.channels_last)
            fn = torch.compile(getattr(m, name), mode=mode, fullgraph=fullgraph)
            if m is marked and mode in CUDAGRAPH_COMPILE_MODES:
                fn = _new_step_first(fn)
            object.__setattr__(m, name, fn)
        yield
    finally:
        for (m, name), old in reversed(list(zip(calls, saved))):  # every method put back before any layout
            if old is None:
                m.__dict__.pop(name, None)
            else:
                object.__setattr__(m, name, old)
        for m, _ in reversed(calls if channels_last else []):
            m.to(memory_format=torch.contiguous_format)


def _new_step_first(fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        torch.compiler.cudagraph_mark_step_begin()
        return fn(*args, **kwargs)

    return call


@contextlib.contextmanager
def applied(pipe, setup: Setup) -> Iterator[dict[str, str]]:
    """Run the block with ``pipe`` set up as ``setup`` says; yields facts for the row."""
    import sd_kernels

    graph = {True: "graph"}.get(setup.graph, f"graph={setup.graph}") if setup.graph else ""
    ours = {False: "", True: "compile"}.get(setup.patch_compile, f"compile={setup.patch_compile}")
    mode = [m for m in (graph, ours, setup.compile and f"compile={setup.compile}") if m]
    info = {"e2e_mode": "+".join(mode) or "eager", "patched": "", "profile": ""}
    with contextlib.ExitStack() as stack:
        if setup.fuse_qkv and not setup.compile:  # ours: fused before the patch, which then serves them
            qkv_owner(pipe).fuse_qkv_projections()
            stack.callback(qkv_owner(pipe).unfuse_qkv_projections)
        if setup.patched or setup.graph:  # stock + graph: patch(ops=()) only installs the CUDA graphs
            profile = (dataclasses.replace(sd_kernels.get_profile(), attention=setup.attention)
                       if setup.attention else None)
            record = sd_kernels.patch(pipe, ops=setup.ops if setup.patched else (), profile=profile,
                                      cuda_graph=setup.graph, compile=setup.patch_compile,
                                      precision=setup.precision)
            stack.callback(sd_kernels.unpatch, pipe)
            info["patched"] = " ".join(f"{k}={n}" for k, n in sorted(record.counts.items()))
            info["profile"] = record.profile
        if setup.compile:
            stack.enter_context(compiled(pipe, setup.compile, setup.fuse_qkv))
        yield info
