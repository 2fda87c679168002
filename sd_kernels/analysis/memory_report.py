"""The paper's memory table, measured: one component call (``component_memory``), a pipeline's text
encoder, UNet step and VAE decode (``memory_report``), and one whole pipeline call (``PipelineMemory``).

Counted the way the paper counts: weights MB, and peak intermediate MB, the peak allocated during a
call above what was allocated before it, so that neither the inputs nor the weights are counted.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from sd_kernels.patches.record import set_instance_attr
from sd_kernels.runtime.memory import (
    MB,
    CudaMemory,
    peak_intermediate_bytes,
    weight_bytes,
    weight_bytes_of,
    weights_mb,
)


@dataclasses.dataclass
class ComponentMemory:
    component: str
    weights_mb: float
    peak_intermediate_mb: float
    ms: float
    peak_at: str = ""  # the leaf module in whose forward the most memory was in use


def peak_module(fn: Callable[[], Any], model: nn.Module, stats: Any) -> tuple[str, int]:
    """(name, bytes): the leaf module of ``model`` during whose forward the most memory was in use,
    and that peak above what was allocated before ``fn()``: where to look when a budget is missed.
    Work outside leaf modules (a residual add, a concat) shows in the next leaf's starting point."""
    names = {id(m): n for n, m in model.named_modules() if not m._modules}
    best = ("", 0)

    def pre(module: nn.Module, args: Any) -> None:
        if id(module) in names:
            stats.reset_peak()

    def post(module: nn.Module, args: Any, out: Any) -> None:
        nonlocal best
        if id(module) in names and stats.peak() - base > best[1]:
            best = (f"{names[id(module)]} ({type(module).__name__})", stats.peak() - base)

    hooks = torch.nn.modules.module
    handles = [hooks.register_module_forward_pre_hook(pre), hooks.register_module_forward_hook(post)]
    try:
        base = stats.allocated()
        fn()
    finally:
        for h in handles:
            h.remove()
    return best


def component_memory(component: str, module: nn.Module, fn: Callable[[], Any], stats: Any = None,
                     warmup: int = 1, repeats: int = 3) -> ComponentMemory:
    """Weights, peak intermediates and median latency of ``fn`` (one call of ``module``) on CUDA.
    The warm-up keeps one-time allocations (cuBLAS workspace, Triton compilation) out of the peak."""
    stats = CudaMemory() if stats is None else stats
    for _ in range(warmup):
        fn()
    peak, _ = peak_intermediate_bytes(fn, stats)
    at, _ = peak_module(fn, module, stats)
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return ComponentMemory(component, weights_mb(module), peak / MB, sorted(times)[len(times) // 2], at)


@torch.no_grad()
def memory_report(pipe, batch: int = 1, prompt: str = "a photograph of an astronaut riding a horse",
                  stats: Any = None, progress: Callable[[ComponentMemory], Any] | None = None) -> list[ComponentMemory]:
    """The paper's table for a diffusers SD pipeline on CUDA, in whatever state it is (stock or
    patched, under whichever profile): text encoder, one UNet step at ``batch``, the VAE decode.
    ``progress`` is called with each component's row as soon as it is measured."""
    unet, vae = pipe.unet, pipe.vae
    dev, dtype = unet.device, unet.dtype
    if dev.type != "cuda":
        raise ValueError(f"memory_report measures CUDA memory; the pipeline is on {dev}")
    g = torch.Generator(device=dev).manual_seed(0)
    ids = pipe.tokenizer([prompt] * batch, padding="max_length", max_length=pipe.tokenizer.model_max_length,
                         truncation=True, return_tensors="pt").input_ids.to(dev)
    side = unet.config.sample_size
    latent = torch.randn(batch, unet.config.in_channels, side, side, device=dev, dtype=dtype, generator=g)
    ctx = torch.randn(batch, ids.shape[1], unet.config.cross_attention_dim, device=dev, dtype=dtype, generator=g)
    t = torch.tensor(500, device=dev)
    z = torch.randn(1, vae.config.latent_channels, side, side, device=dev, dtype=vae.dtype, generator=g)
    components = [
        ("text_encoder", pipe.text_encoder, lambda: pipe.text_encoder(ids)[0]),
        (f"unet_step_b{batch}", unet, lambda: unet(latent, t, encoder_hidden_states=ctx, return_dict=False)[0]),
        ("vae_decode", vae, lambda: vae.decode(z, return_dict=False)[0]),
    ]
    rows = []
    for name, module, fn in components:
        rows.append(component_memory(name, module, fn, stats))
        if progress is not None:
            progress(rows[-1])
    return rows


# ---------------------------------------------------------------------------------------------
# One whole pipeline call, as a phone would run it

# The calls of a diffusers SD pipeline's components that PipelineMemory measures: (part, method).
PIPELINE_CALLS = (("text_encoder", "forward"), ("text_encoder_2", "forward"), ("unet", "forward"),
                  ("controlnet", "forward"), ("vae", "decode"))


@dataclasses.dataclass
class PartMemory:
    part: str
    weights: int  # bytes
    peak_intermediate: int = 0  # bytes above what was allocated when the call began, the largest call's
    calls: int = 0


class PipelineMemory:
    """``with PipelineMemory(pipe, budget) as table: pipe(...)``: the paper's memory table of one whole
    pipeline call: per component (text encoders, UNet, ControlNet, VAE decode) its weights, the peak
    of intermediates over its calls (allocated during a call above what was allocated when it began:
    neither its inputs nor any weights) and the number of calls; and the peak of the whole call,
    weights and everything between the components included (``total_peak``), against ``budget``
    (bytes; None: no budget). Each component's method is wrapped as an instance attribute on top of
    whatever is there (a patch's guard, CUDA graphs) and put back on exit. ``stats``: a CudaMemory
    (default) or a stand-in with its methods."""

    def __init__(self, pipe: Any, budget: int | None = None, stats: Any = None) -> None:
        self.pipe, self.budget = pipe, budget
        self.stats = CudaMemory() if stats is None else stats
        self.parts: dict[str, PartMemory] = {}
        self._calls: list[tuple[nn.Module, str, Any]] = []
        for part, method in PIPELINE_CALLS:
            module = getattr(pipe, part, None)
            if isinstance(module, nn.Module):
                self.parts[part] = PartMemory(part, weight_bytes(module))
                self._calls.append((module, method, part))
        self.weights = weight_bytes_of({k: m for k, m in (getattr(pipe, "components", None) or {}).items()
                                        if isinstance(m, nn.Module)})
        self.before = self.total_peak = 0

    def _seen_peak(self) -> None:
        self.total_peak = max(self.total_peak, self.stats.peak())

    def _wrap(self, fn: Callable[..., Any], part: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            self._seen_peak()  # the peak since the last reset, before this call resets it
            self.stats.reset_peak()
            base = self.stats.allocated()
            try:
                return fn(*args, **kwargs)
            finally:  # the allocator's counters are kept on the host: no wait for the GPU
                row = self.parts[part]
                row.peak_intermediate = max(row.peak_intermediate, self.stats.peak() - base)
                row.calls += 1
                self._seen_peak()

        return call

    def __enter__(self) -> PipelineMemory:
        self._restores = []
        try:
            for module, name, part in self._calls:
                self._restores.append(set_instance_attr(module, name, self._wrap(getattr(module, name), part),
                                                        "PipelineMemory", "it wrapped it"))
        except BaseException:
            self.__exit__()
            raise
        self.stats.reset_peak()
        self.before = self.stats.allocated()
        return self

    def __exit__(self, *exc: Any) -> None:
        for restore in reversed(self._restores):
            restore()
        self._seen_peak()

    def format(self, title: str = "") -> str:
        head = f"memory of one pipeline call{f' ({title})' if title else ''}:"
        lines = [head, f"  {'component':<16} {'weights MB':>11} {'peak intermediates MB':>22} {'calls':>6}"]
        for row in self.parts.values():
            lines.append(f"  {row.part:<16} {row.weights / MB:11.1f} {row.peak_intermediate / MB:22.1f} "
                         f"{row.calls:6d}")
        lines.append(f"  {'all weights':<16} {self.weights / MB:11.1f}")
        verdict = ("" if self.budget is None else f" of the {self.budget / MB:.0f} MB budget: "
                   + ("within" if self.total_peak <= self.budget else "OVER"))
        lines.append(f"  total peak in use during the call: {self.total_peak / MB:.1f} MB (in use before it: "
                     f"{self.before / MB:.1f} MB){verdict}")
        return "\n".join(lines)
