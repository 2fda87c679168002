"""``sd-kernels generate --prompt ... --parallel MODE``: one image made by the processes of one launch.

    torchrun --nproc_per_node 2 -m sd_kernels generate --prompt "a cat" --parallel cfg --out cat.png
    torchrun --nproc_per_node 4 -m sd_kernels generate --model flux-dev --prompt "a cat" --parallel ring

Every process builds the same pipeline (a shipped config's weights are always seed 0's; a checkpoint
is the same file) and calls it with the same prompt and seed (rank 0's, drawn or given); rank 0 alone
prints and writes the image, whose records name the split and the process count. The two splits
(docs/parallel.md):

- ``cfg``: ``patch(pipe, parallel="cfg")``: the classifier-free-guidance batch [unconditional;
  conditional] of the denoiser's calls split over 2 processes (SD1.x/2.x, SDXL, PixArt-Σ, SD3);
- ``ulysses``: diffusers' context parallelism over all N processes through
  ``sd_kernels.enable_context_parallel(pipe)`` (diffusers' plan for FLUX, ours for SD3 and PixArt-Σ:
  patches/context_parallel_plans.py), then ``patch(pipe)``: the attention inside is ours;
- ``ring`` (FLUX: diffusers' plan): the same with ``exchange="ring"``: each attention gathers the keys
  and values of every process and runs ours once over them (faster than ``ulysses`` for FLUX at 2 and
  4 processes: docs/parallel.md).

This is not the batch mode's sharding (``--prompts`` under ``accelerate launch``: whole images per
process). Everything the launch, the model and the options allow is checked before any work; the
process group is torch.distributed's (gloo on the CPU; on GPUs NCCL for the collectives and gloo for
the checks' small objects), started after those checks and ended by the caller.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the command line's parsing imports this module: nothing heavy at import
    from sd_kernels.apps.pipeline import Model

MODES = ("cfg", "ulysses", "ring")
TOKENS = ("ulysses", "ring")  # the modes that split the transformer's tokens (context parallelism)
CFG_PROCESSES = 2  # one image's guidance batch has two halves


@dataclasses.dataclass(frozen=True)
class Launch:
    """This process's place in the launch: the split, its rank among ``world`` processes, and its
    rank and the process count on this host (torchrun's LOCAL_RANK, LOCAL_WORLD_SIZE)."""

    mode: str
    rank: int
    world: int
    local_rank: int
    local_world: int

    @property
    def main(self) -> bool:
        return self.rank == 0


def _command(mode: str) -> str:
    n = CFG_PROCESSES if mode == "cfg" else "N"
    return f"torchrun --nproc_per_node {n} -m sd_kernels generate --prompt ... --parallel {mode}"


def launch(mode: str, *, cuda_graph: str, compile: bool | str) -> Launch:
    """The launch ``--parallel mode`` runs in, from the environment torchrun (or accelerate launch)
    sets; a ValueError naming the option for a launch or option the split cannot take."""
    if mode not in MODES:
        raise ValueError(f"--parallel {mode!r}: one of {', '.join(MODES)}")
    env = os.environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        raise ValueError(f"--parallel {mode} makes one image on several processes, and this process was not started "
                         f"as one of them (no RANK and WORLD_SIZE in its environment): {_command(mode)}")
    try:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local = int(env.get("LOCAL_RANK", rank))
        local_world = int(env.get("LOCAL_WORLD_SIZE", world))
    except ValueError:
        raise ValueError("--parallel: RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE must be integers, as torchrun "
                         "sets them") from None
    if mode == "cfg" and world != CFG_PROCESSES:
        raise ValueError(f"--parallel cfg splits one image's guidance batch [unconditional; conditional] over "
                         f"{CFG_PROCESSES} processes, and this launch has {world}: {_command(mode)}")
    if mode in TOKENS and world < 2:
        raise ValueError(f"--parallel {mode} splits the transformer's tokens over the processes, and this launch has "
                         f"{world}: {_command(mode)} with N >= 2")
    if mode == "cfg" and cuda_graph == "step":
        raise ValueError("--cuda-graph step with --parallel cfg: the outputs are exchanged between the processes "
                         "each step, outside the CUDA graphs; a step's graph would capture the exchange (use auto or "
                         "pipeline)")
    from sd_kernels.patches.cuda_graph import COLLECTIVES_ENV, collectives_captured

    # the command line captures the transformer with its exchanges (its teardown releases the graphs before
    # the process group ends); SD_KERNELS_GRAPH_COLLECTIVES=0, set alike on every process, runs it eagerly
    captured = collectives_captured() or (mode in TOKENS and COLLECTIVES_ENV not in os.environ)
    if mode in TOKENS and compile:
        raise ValueError(f"--compile with --parallel {mode}: the patch compiles what its CUDA graphs capture, and a "
                         "transformer under context parallelism is captured with its exchanges inside, which "
                         "torch.compile is not run on")
    if mode in TOKENS and cuda_graph not in ("auto", "off") and not captured:
        raise ValueError(f"--cuda-graph {cuda_graph} with --parallel {mode}: with {COLLECTIVES_ENV}="
                         f"{os.environ.get(COLLECTIVES_ENV)} the transformer under context parallelism is not "
                         f"captured; use auto or off, or leave {COLLECTIVES_ENV} unset (the command line then "
                         "captures it with its exchanges)")
    if mode in TOKENS:
        os.environ.setdefault(COLLECTIVES_ENV, "1")
    return Launch(mode, rank, world, local, local_world)


def check_model(launch: Launch, model: Model, guidance: float) -> None:
    """``model`` (read from its configs: nothing built) and the image's guidance scale against the
    split; a ValueError naming --parallel."""
    if launch.mode == "cfg":
        if not model.guidance_batch:
            raise ValueError(f"--parallel cfg splits the classifier-free-guidance batch, and a {model.pipeline} has "
                             "none (its guidance is distilled: one denoiser call per step on one image); --parallel "
                             "ulysses splits its transformer's tokens")
        if guidance <= 1:
            raise ValueError(f"--parallel cfg: a guidance scale of {guidance:g} runs no classifier-free guidance (a "
                             "batch of one image, which 2 processes do not split); give --guidance-scale above 1")
    elif not model.context_parallel:
        raise ValueError(f"--parallel {launch.mode} runs diffusers' context parallelism, which has no plan for the "
                         f"denoiser of a {model.pipeline} (FLUX, SD3 and PixArt-Σ have one); "
                         + ("--parallel cfg splits its guidance batch over 2 processes" if model.guidance_batch
                            else "make its image on one process"))
    elif launch.mode == "ring" and not model.ring:
        raise ValueError(f"--parallel ring runs under diffusers' own context-parallel plans (FLUX); sd_kernels' plan "
                         f"for the denoiser of a {model.pipeline} exchanges by Ulysses: --parallel ulysses")


def start(launch: Launch, device: str) -> str:
    """The default process group, started (after every check); returns this process's device: on a
    GPU host, GPU number LOCAL_RANK."""
    import torch
    import torch.distributed as dist

    if device == "cuda":
        if launch.local_world > torch.cuda.device_count():
            raise ValueError(f"--parallel {launch.mode}: {launch.local_world} processes on this host, which has "
                             f"{torch.cuda.device_count()} GPU(s): one process per GPU")
        torch.cuda.set_device(launch.local_rank)
        dist.init_process_group("cpu:gloo,cuda:nccl")
        return f"cuda:{launch.local_rank}"
    dist.init_process_group("gloo")
    return device


def shared(value: Any) -> Any:
    """Rank 0's ``value`` on every process (a seed drawn at random is drawn once)."""
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def eager_note(launch: Launch, on_gpu: bool) -> str | None:
    """What the first process prints under a token split on GPUs whose transformer runs eagerly (its
    collectives not captured: ``SD_KERNELS_GRAPH_COLLECTIVES=0``), else None."""
    from sd_kernels.patches.cuda_graph import COLLECTIVES_ENV, collectives_captured

    if launch.mode not in TOKENS or not on_gpu or collectives_captured():
        return None
    return (f"note: with {COLLECTIVES_ENV}={os.environ.get(COLLECTIVES_ENV, '')} the transformer runs eagerly under "
            f"--parallel {launch.mode} (outside CUDA graphs), which on several GPUs can be slower than one; unset, "
            "the command line captures it with its collectives (docs/parallel.md)")


def prepare(pipe: Any, launch: Launch, precision: str = "fp16") -> dict[str, Any]:
    """``pipe`` set up for the split before the patch; returns what ``patch`` takes for it. Under ``ring``
    a transformer with FLUX's adaLN-Zero block norms also splits their modulations over the processes
    (``split_modulation``; not under the FP8 tier, whose norms compute their own)."""
    if launch.mode == "cfg":
        return {"parallel": "cfg"}
    import torch

    from sd_kernels.patches.context_parallel_plans import enable_context_parallel

    more = {"split_modulation": True} if launch.mode == "ring" and _modulated(pipe, precision) else {}
    with _cpu_counted_as_one_device() if torch.accelerator.device_count() == 0 else contextlib.nullcontext():
        enable_context_parallel(pipe, launch.world, exchange=launch.mode, **more)
    return {}


def _modulated(pipe: Any, precision: str) -> bool:
    from sd_kernels.patches.context_parallel_plans import block_norms

    transformer = getattr(pipe, "transformer", None)
    return precision != "fp8" and transformer is not None and bool(block_norms(transformer))


SPLIT_DECODE_PIXELS = 1024 * 1024  # under cfg, the image size from which the split decode was measured to pay


def finish(pipe: Any, launch: Launch, pixels: int) -> str | None:
    """After the patch, on every process alike: the VAE decode split by rows over the processes
    (``enable_split_decode``) where it was measured to pay (docs/parallel.md), with the patch's CUDA
    graphs on the VAE: under ``ulysses`` and ``ring`` when the collectives are captured too (the split
    decode replayed from a graph, its exchanges inside); under ``cfg``, where the split decode runs
    eagerly and the whole one is replayed, for images of ``SPLIT_DECODE_PIXELS`` or more (``pixels``: the
    job's width × height). Returns the line to print: the split, or why this VAE could not be split."""
    import sd_kernels
    from sd_kernels.patches.cuda_graph import collectives_captured

    graphed = _graphed_decode(pipe)
    wanted = graphed and (collectives_captured() if launch.mode in TOKENS else pixels >= SPLIT_DECODE_PIXELS)
    if not wanted:
        return None
    try:
        sd_kernels.enable_split_decode(pipe)
    except ValueError as exc:  # raised alike on every process (their findings are gathered first)
        return f"note: every process decodes the whole image ({exc})"
    return f"the VAE decode split by rows over the {launch.world} processes"


def _graphed_decode(pipe: Any) -> bool:
    """Whether the patch put the VAE's decode under its CUDA graphs."""
    from sd_kernels.patches.cuda_graph import GraphedCall

    vae = getattr(pipe, "vae", None)
    return vae is not None and isinstance(vars(vae).get("decode"), GraphedCall)


@contextlib.contextmanager
def _cpu_counted_as_one_device() -> Iterator[None]:
    """diffusers' ``enable_parallelism`` places process r on accelerator ``r % device_count()``, which a
    torch without one counts as 0 (a ZeroDivisionError): for that call only, the CPU counts as one
    device, so every process's device is the CPU (what gloo runs on)."""
    import torch

    count = torch.accelerator.device_count
    torch.accelerator.device_count = lambda: 1
    try:
        yield
    finally:
        torch.accelerator.device_count = count
