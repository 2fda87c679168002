"""How far a patched pipeline lands from the stock one: same weights, same seed, same prompt.

``check_fidelity(pipe)`` runs the pipeline stock, then patched, and compares the final latents
(relative L2 error, ‖patched − stock‖ / ‖stock‖) and the decoded images (PSNR, values in [0, 1]).
With ``per_op=True`` it also runs the pipeline with one op family patched at a time, which says how
much each contributes. The latents are read at the last denoising step through diffusers'
``callback_on_step_end``, so the images come from the pipeline's own decode path (SDXL's fp32 VAE
upcast included) and each configuration costs one pipeline call.

Errors compound over the steps: a kernel whose single-call error is at fp16 rounding level can
still move the final latent by ~1e-3 after 20 steps; the thresholds below (1e-2, 40 dB) are what
the GPU tests hold the SD1.5 / SD2.1 / SDXL architectures to at fp16.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Iterable
from typing import Any

import torch

from sd_kernels.testing import psnr, rel_err

MAX_LATENT_REL_ERR = 1e-2
MIN_PSNR_DB = 40.0
DEFAULT_PROMPT = "a photograph of an astronaut riding a horse"


@dataclasses.dataclass(frozen=True)
class Fidelity:
    """One comparison with stock: final-latent relative error and image PSNR (dB; inf = identical)."""

    latent_rel_err: float
    psnr_db: float

    def ok(self, max_latent_rel_err: float = MAX_LATENT_REL_ERR, min_psnr_db: float = MIN_PSNR_DB) -> bool:
        return self.latent_rel_err <= max_latent_rel_err and self.psnr_db >= min_psnr_db


@dataclasses.dataclass(frozen=True)
class FidelityResult:
    pipeline: str
    steps: int
    size: tuple[int, int]
    dtype: str
    ops: tuple[str, ...]
    cuda_graph: bool
    patched: Fidelity
    per_op: dict[str, Fidelity]  # op family → the pipeline with only that family patched

    def ok(self, max_latent_rel_err: float = MAX_LATENT_REL_ERR, min_psnr_db: float = MIN_PSNR_DB) -> bool:
        return self.patched.ok(max_latent_rel_err, min_psnr_db)

    def format(self, max_latent_rel_err: float = MAX_LATENT_REL_ERR, min_psnr_db: float = MIN_PSNR_DB) -> str:
        """The table and the verdict under the limits given (those ``ok`` is asked with)."""
        h, w = self.size
        graph = ", CUDA graph" if self.cuda_graph else ""
        rows = [(", ".join(self.ops), self.patched), *((f"{op} only", f) for op, f in self.per_op.items())]
        width = max(len(name) for name, _ in rows)
        lines = [f"{self.pipeline}, {w}x{h}, {self.steps} steps, {self.dtype}{graph}: patched vs stock",
                 f"  {'ops':<{width}} {'latent rel. err':>16} {'image PSNR':>12}"]
        for name, f in rows:
            lines.append(f"  {name:<{width}} {f.latent_rel_err:>16.3e} {f.psnr_db:>9.1f} dB")
        verdict = "ok" if self.ok(max_latent_rel_err, min_psnr_db) else "FAIL"
        lines.append(f"  {verdict} (limits: latent rel. err ≤ {max_latent_rel_err:g}, PSNR ≥ {min_psnr_db:g} dB)")
        return "\n".join(lines)


def _run(pipe, steps: int, seed: int, call_kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """(final latents, images in [0, 1] as a float tensor) of one seeded pipeline call."""
    seen: dict[str, torch.Tensor] = {}

    def keep_latents(pipeline, i, t, kwargs):
        seen["latents"] = kwargs["latents"].detach().clone()
        return kwargs

    def keep_latents_legacy(i, t, latents):  # pipelines with diffusers' older per-step callback (PixArt)
        seen["latents"] = latents.detach().clone()

    if "callback_on_step_end" in inspect.signature(type(pipe).__call__).parameters:
        hook = {"callback_on_step_end": keep_latents, "callback_on_step_end_tensor_inputs": ["latents"]}
    else:
        hook = {"callback": keep_latents_legacy, "callback_steps": 1}
    out = pipe(num_inference_steps=steps, generator=torch.Generator("cpu").manual_seed(seed), output_type="np",
               **hook, **call_kwargs)
    if "latents" not in seen:
        raise TypeError(f"fidelity: {type(pipe).__name__} called no per-step callback: its latents cannot be "
                        "compared (the images alone would hide an error they round away)")
    return seen["latents"], torch.as_tensor(out.images)


def check_fidelity(
    pipe,
    *,
    steps: int = 20,
    seed: int = 0,
    prompt: str = DEFAULT_PROMPT,
    size: int | None = None,
    ops: Iterable[str] | None = None,
    per_op: bool = True,
    cuda_graph: bool = False,
    profile=None,
    **call_kwargs: Any,
) -> FidelityResult:
    """Run ``pipe`` stock and patched (``ops``: default all; ``per_op``: also one family at a time)
    with the same seed and compare. ``size`` sets height and width; ``call_kwargs`` go to the
    pipeline (``image=``, ``mask_image=``, ``strength=`` for img2img and inpainting). ``pipe`` must
    not be patched; it is left unpatched."""
    from sd_kernels.patches import PATCHERS, patch_record, patched

    if patch_record(pipe) is not None:
        raise ValueError("check_fidelity needs an unpatched pipeline (it patches and unpatches it itself); "
                         "call sd_kernels.unpatch(pipe) first")
    ops = tuple(sorted(PATCHERS)) if ops is None else tuple(sorted(set(ops)))
    if steps < 1:
        raise ValueError(f"steps must be ≥ 1, got {steps}")
    call_kwargs = {"prompt": prompt, **call_kwargs}
    if size is not None:
        call_kwargs.update(height=size, width=size)
    stock_latents, stock_images = _run(pipe, steps, seed, call_kwargs)

    def compare(families: tuple[str, ...], graph: bool) -> Fidelity:
        with patched(pipe, ops=families, cuda_graph=graph, profile=profile):
            latents, images = _run(pipe, steps, seed, call_kwargs)
        return Fidelity(rel_err(latents, stock_latents), psnr(images, stock_images))

    whole = compare(ops, cuda_graph)
    # Each family alone, graphed like the whole run: some only act under CUDA graphs (winograd).
    singles = {op: compare((op,), cuda_graph) for op in ops} if per_op and len(ops) > 1 else {}
    return FidelityResult(
        pipeline=type(pipe).__name__,
        steps=steps,
        size=tuple(stock_images.shape[1:3]),
        dtype=str(pipe.dtype).removeprefix("torch."),
        ops=ops,
        cuda_graph=cuda_graph,
        patched=whole,
        per_op=singles,
    )
