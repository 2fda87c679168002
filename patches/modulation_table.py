"""The FP8 tier's adaLN modulations of every step of a call, made in one GEMM at its first step.

A DiT's block norms turn the step embedding ``temb`` into their shifts, scales and gates; patches/fp8_modulations.py
makes all of them one GEMM a call (FLUX.1-dev: 3.2 GB of FP8 codes read for one row, 0.9 ms a step on an H200).
``temb`` depends only on the step's timestep, the guidance and the pooled prompt, all known before the loop, so
the rows of every step can be multiplied at once: one GEMM with a row per step (and sample) reads the weights
once, and each step serves its row from a table (ops/fp8_rows.py).

- **Filled at the first step.** A forward hook on the transformer runs after a call where the pipeline's
  scheduler has not stepped yet (``step_index`` None: the loop's first call, and with true CFG its second), once
  that call's work is queued, so the host's part of the fill runs while the GPU computes the first step. It
  computes the embedding of each of the scheduler's timesteps (from its ``begin_index``) as the transformer's own
  ``forward`` would from the timestep the pipeline passes (``EMBEDDINGS``: FLUX's pipelines pass
  ``t.to(latents' dtype) / 1000``, SD3's ``t``), with this call's guidance and pooled prompt, one step at a
  time at the call's batch (the same kernels, shapes and so bits as the step computes it). A call made under
  ``torch.inference_mode()`` fills it outside that mode (patches/modes.py) where the transformer's calls replay
  CUDA graphs, which run outside it too; an eager call there takes no table, and makes none. Their SiLU is
  multiplied in one GEMM and kept with it, in a ring of ``ROWS`` rows (the oldest overwritten first). The first
  step itself is served where an earlier call left its row (the same prompt and settings), else computed.
- **Served by bit equality.** Each step's joined GEMM gets the table: on the device, its input rows are compared
  with the table's keys bit for bit; where all are found their products are copied and the GEMM returns at once,
  else it computes as without the table. A wrong timestep rule, a callback that changes the prompt, a user's own
  loop: rows not found, the GEMM runs. Decided on the device, so a CUDA graph captures the three launches once
  and serves every step of every later call.
- **Only while the weights are the ones it was made with.** The fill records each layer's state (its weight's
  identity, storage and version; its bias's); a forward pre-hook clears the table before a call that finds
  another (before anything reads it), and a capture or eager call then takes no table
  (patches/fp8_modulations.py).

Costs: the table (``ROWS`` rows of the input and of the products: 135 MB at FLUX.1-dev in bf16, 56 MB at
SD3-medium), made before the first call and kept until unpatch (a captured graph reads it where it is); at each
call's first step, the step embeddings (about 20 small kernels a step) and the one GEMM (0.64 ms on an H200 for
FLUX's 20 steps: about one step's own GEMM); at every call, each layer's state read on the host.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from sd_kernels.ops.fp8_rows import MAX_ROWS
from sd_kernels.ops.fp8_rows import table_bytes as row_table_bytes

from .modes import outside_inference_mode
from .record import PatchRecord

ROWS = 64  # rows the table keeps: 64 steps of one sample, 32 of a CFG pair
STEP_TABLE = True  # False: every step runs its joined GEMM (bench.fp8's fp8+own-step-modulations row)
KIND = "fp8.step_modulations"


def _flux(model: nn.Module, kwargs: dict, t: torch.Tensor) -> torch.Tensor:
    """FLUX's ``temb`` for scheduler timestep ``t``: its pipelines pass ``t.expand(B).to(latents.dtype) / 1000``,
    its forward multiplies by 1000 in the hidden states' dtype (diffusers 0.42.1, transformer_flux.py)."""
    hidden = kwargs["hidden_states"]
    timestep = (t.expand(hidden.shape[0]).to(hidden.dtype) / 1000).to(hidden.dtype) * 1000
    guidance, pooled = kwargs.get("guidance"), kwargs["pooled_projections"]
    if guidance is None:
        return model.time_text_embed(timestep, pooled)
    return model.time_text_embed(timestep, guidance.to(hidden.dtype) * 1000, pooled)


def _sd3(model: nn.Module, kwargs: dict, t: torch.Tensor) -> torch.Tensor:
    """SD3's ``temb``: its pipelines pass ``t.expand(B)`` (transformer_sd3.py takes it as it is)."""
    return model.time_text_embed(t.expand(kwargs["hidden_states"].shape[0]), kwargs["pooled_projections"])


# the transformer classes whose step embedding a fill computes, and the keyword arguments it reads
EMBEDDINGS: dict[str, tuple[Callable[[nn.Module, dict, torch.Tensor], torch.Tensor], tuple[str, ...]]] = {
    "FluxTransformer2DModel": (_flux, ("hidden_states", "pooled_projections")),
    "SD3Transformer2DModel": (_sd3, ("hidden_states", "pooled_projections")),
}


class StepTables:
    """The forward hooks that fill the joined modulation GEMMs' tables of one transformer (``groups``: its
    ``Fp8Modulations``) from the scheduler of ``target()`` (the patched pipeline), and clear them."""

    def __init__(self, groups: list, embedding: Callable, needs: tuple[str, ...], target: Callable) -> None:
        self.groups, self.embedding, self.needs, self.target = groups, embedding, needs, target
        self.fills = 0  # fills made (calls at which the scheduler had not stepped)

    def before(self, model: nn.Module, args: tuple, kwargs: dict) -> None:
        if not (torch.compiler.is_compiling() or _capturing()):
            for group in self.groups:
                group.ensure_table()
                group.check_table()

    def after(self, model: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        if torch.compiler.is_compiling() or _capturing():
            return
        scheduler = getattr(self.target(), "scheduler", None)
        timesteps = getattr(scheduler, "timesteps", None)
        if (args or any(kwargs.get(name) is None for name in self.needs) or not isinstance(timesteps, torch.Tensor)
                or getattr(scheduler, "step_index", 0) is not None or torch.is_grad_enabled()
                or (torch.is_inference_mode_enabled() and not _replays_outside_inference_mode(model))):
            return
        batch = kwargs["hidden_states"].shape[0]
        if batch > MAX_ROWS:  # a step of more rows is never served (fp8_rows.RowTable.fits): nothing to make
            return
        begin = getattr(scheduler, "begin_index", None) or 0
        steps = timesteps[begin:begin + ROWS // batch]
        if not len(steps):
            return
        with outside_inference_mode():  # a call under inference mode fills the table as one outside it does
            emb = torch.cat([self.embedding(model, kwargs, t) for t in steps])
            self.fills += 1
            for group in self.groups:
                group.fill(emb)


def _replays_outside_inference_mode(model: nn.Module) -> bool:
    """Whether the model's calls replay CUDA graphs captured outside inference mode (patches/cuda_graph.py), where
    a table filled for a call under inference mode serves; an eager call there computes each norm's own product
    (patches/fp8_modulations.py), and a fill would be work for nothing."""
    return getattr(vars(model).get("forward"), "replays_outside_inference_mode", False)


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def install(model: nn.Module, groups: list, record: PatchRecord) -> StepTables | None:
    """The hooks on ``model`` (unpatch removes them and frees the tables), where its class has a step embedding
    here, the patch compiles nothing and has a pipeline whose scheduler it can read; None otherwise."""
    known = EMBEDDINGS.get(type(model).__name__)
    if (not STEP_TABLE or known is None or not groups or record.compile
            or not hasattr(record.target(), "scheduler")):
        return None  # compiled calls take no table (custom_ops.fp8_linear): a fill would be work for nothing
    tables = StepTables(groups, *known, record.target)
    handles = (model.register_forward_pre_hook(tables.before, with_kwargs=True),
               model.register_forward_hook(tables.after, with_kwargs=True))

    def remove() -> None:
        for handle in handles:
            handle.remove()
        for group in groups:
            group.drop_table()

    record.on_undo(remove, KIND)
    return tables


def table_bytes(group) -> int:
    """What the table of ``group`` (an ``Fp8Modulations``) will take once made (``RowTable.nbytes``)."""
    return row_table_bytes(ROWS, *group.table_shape())
