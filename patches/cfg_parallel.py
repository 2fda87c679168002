"""``patch(pipe, parallel="cfg")``: one image's classifier-free-guidance batch split over processes.

With guidance, the text-to-image pipelines (SD1.x/2.x, SDXL; PixArt and SD3 the same way) call their
denoiser once a step on the batch [unconditional; conditional]: two images' worth of UNet for one
image. Under ``parallel="cfg"`` each of the W processes of torch.distributed's default group runs
1/W of that batch: the denoiser's ``forward`` becomes a ``CfgParallelCall`` that takes process r's
r-th chunk along the first dimension of every tensor argument whose first dimension is the batch's
(the latents, the prompt embeddings, SDXL's ``text_embeds`` and ``time_ids``, a timestep expanded to
the batch; a 0-d or 1-element timestep goes as it is), calls the forward it replaced on that chunk,
and all-gathers the outputs along the batch. Every process then holds what the whole batch would have
given, and the pipeline goes on unchanged on every process: guidance, scheduler step and VAE decode
run on each, with the same numbers, so every process ends with the same image.

What is exchanged: the denoiser's output, once a step: one ``all_gather_into_tensor`` of the batch's
noise prediction (SDXL 1024²: 2×4×128×128 fp16 = 256 kB), the least that lets each process combine the
guidance itself (the combine needs both halves). The collective sits outside the CUDA graphs: the
call wraps the denoiser's ``GraphedCall`` (patches/cuda_graph.py), which replays the chunk's call from
its graphs, and the all-gather follows the replay, on the current stream (ordered after the replay's
work; the host does not wait for it). ``cuda_graph="step"`` (one graph per denoising step, the
UNet's call inside it) is refused with it.

Checked before any work, with clear errors raised on every process alike: at ``patch``, that
torch.distributed is initialized and every process makes the same patch (profile, ops, graph mode,
compile, the denoiser's class, config and a float64 sum of its weights: one ``all_gather_object``);
at the first call of each argument signature and at the first call after each ``set_timesteps`` of the
pipeline's scheduler (every image), that the batch divides among the processes and that their
arguments agree (structure, shapes, dtypes, the other arguments' values, the tensors' float64 sums:
the same prompt, seed and settings everywhere; a seed per process would make each process's half of
the batch come from different latents, a silently wrong image).

Unpatch removes the call (and the scheduler's wrapper) through the record: the denoiser's ``forward``
is again what it was.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils import _pytree as pytree

from .cuda_graph import COLLECTIVES_ENV, collectives_captured, context_parallel
from .families import family_of, is_denoiser
from .record import PatchRecord

MODES = ("cfg",)
KIND = "cfg_parallel"
# Relative difference of the processes' float64 sums that counts as different inputs: identical
# tensors give identical sums on identical devices; different seeds or prompts differ by far more.
SUM_RTOL = 1e-6


def mode_of(value: Any) -> str | None:
    """The split ``parallel=value`` asks for (None: none); a clear error for anything else."""
    if value is None or value is False:
        return None
    if isinstance(value, str) and value in MODES:
        return value
    raise ValueError(f"parallel={value!r}: choose None or 'cfg' (the guidance batch split over the processes of "
                     "torch.distributed's default group). Context parallelism (Ulysses, ring) is diffusers' own: "
                     "transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=N)), before or after "
                     "patch; docs/parallel.md")


def group_or_error(what: str):
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"{what} splits the work over the processes of torch.distributed's default group, and none "
                         "is initialized: start the processes with torchrun (or accelerate launch) and call "
                         "torch.distributed.init_process_group() first (docs/parallel.md)")
    return dist.group.WORLD


def weights_sum(model: nn.Module) -> float:
    sums = [p.detach().sum(dtype=torch.float64) for p in model.parameters()]
    return float(torch.stack(sums).sum()) if sums else 0.0


def config_text(model: nn.Module) -> str:
    """The model's config as text, the same on every process (diffusers' private keys, some built from
    sets whose order changes between processes, left out)."""
    return repr(sorted((k, v) for k, v in dict(getattr(model, "config", {})).items() if not k.startswith("_")))


def close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=SUM_RTOL, abs_tol=1e-12) for x, y in zip(a, b))


def _differing(gathered: list, labels: tuple[str, ...]) -> list[str]:
    """The labels of the fields in which the processes' tuples differ."""
    return [label for i, label in enumerate(labels) if any(g[i] != gathered[0][i] for g in gathered[1:])]


def check_setup(models: list[tuple[str, nn.Module]], profile: Any, ops: tuple[str, ...], graph_mode: str | None,
                compile: str | None) -> Any:
    """Before any change: the process group, a denoiser to split, a graph mode that leaves the collective
    outside the graphs, and the same patch on every process; returns the group. A collective: every
    process of the group calls it (as every process calls ``patch``)."""
    group = group_or_error("parallel='cfg'")
    denoisers = [(part, m) for part, m in models if is_denoiser(m)]
    if not denoisers:
        raise ValueError("parallel='cfg' splits the denoiser's guidance batch, and there is no denoiser (UNet or DiT "
                         "transformer) among the parts patched")
    if split := [part for part, m in denoisers if context_parallel(m)]:
        raise ValueError(f"parallel='cfg' hands each process a different half of the guidance batch, and the "
                         f"{', '.join(split)} is under context parallelism (enable_context_parallel, "
                         "enable_parallelism), which exchanges tokens assuming every process holds the same images (a "
                         "wrong image): patch it without parallel=")
    if graph_mode == "step":
        raise ValueError("parallel='cfg' exchanges the denoiser's output between processes each step, outside the "
                         "CUDA graphs; cuda_graph='step' would capture that call inside a step's graph: use "
                         "cuda_graph=True ('pipeline')")
    same_patch(group, denoisers, profile, ops, graph_mode, compile, "parallel='cfg'")
    return group


def same_patch(group, denoisers: list[tuple[str, nn.Module]], profile: Any, ops: tuple[str, ...],
               graph_mode: str | None, compile: str | None, what: str) -> None:
    """Raise on every process of ``group`` unless all of them patch alike: profile, ops, graph mode,
    compile, the switch that captures collectives (``SD_KERNELS_GRAPH_COLLECTIVES``), the denoisers'
    classes, configs, attention processors (which the patch replaces or leaves: under context
    parallelism one left on some process only would have the others wait in its exchange) and weights
    (float64 sums). A collective."""
    mine = (repr(profile), ops, graph_mode, compile, collectives_captured(),
            tuple((part, type(m).__name__, config_text(m)) for part, m in denoisers),
            tuple((part, path, type(x.processor).__name__) for part, m in denoisers
                  for path, x in m.named_modules() if hasattr(x, "processor")))
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (mine, [weights_sum(m) for _, m in denoisers], profile.name), group=group)
    differ = _differing([g[0] for g in gathered], ("profile", "ops", "cuda_graph", "compile",
                                                   COLLECTIVES_ENV, "denoiser class or config",
                                                   "attention processors"))
    if not differ and not all(close(g[1], gathered[0][1]) for g in gathered):
        differ = ["denoiser weights"]
    if differ:
        profiles = [g[2] for g in gathered]
        raise ValueError(f"{what}: the processes patch differently (in {', '.join(differ)}): every process must "
                         f"load the same weights and call patch() with the same arguments; profiles per process: "
                         f"{profiles}")


def splits_guidance(model: nn.Module) -> bool:
    """Whether ``model`` is patched with ``parallel="cfg"`` (its patch's record says so: hooks registered
    since may wrap the forward that splits)."""
    from . import _OWNER  # here: the package imports this module

    record = vars(model).get(_OWNER)
    return record is not None and record.parallel == "cfg"


class CfgParallelCall:
    """A denoiser's ``forward`` whose batch is split over the processes of ``group`` (module docstring)."""

    def __init__(self, model: nn.Module, inner, group) -> None:
        self.inner = inner  # the forward it replaced: a GraphedCall, or the model's own
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        fam = family_of(model)
        self.label = fam.label if fam else type(model).__name__
        # Names of forward's positional parameters (the first is the batched input: sample / hidden_states)
        self.params = [n for n in inspect.signature(type(model).forward).parameters][1:]
        self.checked: set = set()
        self.armed = True  # the next call checks that the processes agree (a new image)

    def __repr__(self) -> str:
        return f"CfgParallelCall({self.label}, process {self.rank} of {self.world})"

    def _name(self, path) -> str:
        """A readable name of an argument leaf from its pytree key path: (args or kwargs, index or key, …)."""
        where, key, rest = path[0].idx, path[1], path[2:]
        name = self.params[key.idx] if where == 0 and key.idx < len(self.params) else str(getattr(key, "key", key))
        return name + pytree.keystr(rest)

    def _check(self, batch: int, paths: list, leaves: list, tree) -> None:
        """The batch divides among the processes, and their arguments agree (raises on every process)."""
        described = [(tuple(x.shape), str(x.dtype), x.device.type) if isinstance(x, torch.Tensor) else repr(x)
                     for x in leaves]
        values = [float(x.detach().sum(dtype=torch.float64)) for x in leaves if isinstance(x, torch.Tensor)]
        gathered: list = [None] * self.world
        dist.all_gather_object(gathered, (batch, str(tree), described, values), group=self.group)
        if batch % self.world:
            raise ValueError(f"parallel='cfg': the {self.label}'s batch is {batch}, which {self.world} processes do "
                             "not divide; the guidance batch is 2 × the images per call when guidance is on "
                             "(guidance_scale > 1), so run 2 processes per image (or images × 2 divisible by the "
                             "processes)")
        names = [self._name(p) for p in paths]
        problems = []
        if any(g[1] != gathered[0][1] for g in gathered):
            problems.append("the arguments' structure")
        else:
            tensors = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
            for i, d in enumerate(described):
                if any(g[2][i] != d for g in gathered):
                    problems.append(names[i])
            for j, i in enumerate(tensors):
                vals = [g[3][j] for g in gathered]
                if names[i] not in problems and not close(vals, [vals[0]] * len(vals)):
                    problems.append(f"{names[i]} (sums {', '.join(f'{v:.6g}' for v in vals)})")
        if problems:
            raise ValueError(f"parallel='cfg': the processes call the {self.label} with different "
                             f"{'; '.join(problems)}: every process must run the same pipeline call (same prompt, "
                             "seed or generator, size and settings); only the denoiser's batch is split among them")

    def __call__(self, *args, **kwargs) -> Any:
        first = args[0] if args else kwargs.get(self.params[0]) if self.params else None
        if not isinstance(first, torch.Tensor) or first.dim() == 0:
            raise TypeError(f"parallel='cfg': the {self.label}'s first argument must be its batched input tensor")
        batch = first.shape[0]
        paths_leaves, tree = pytree.tree_flatten_with_path((args, kwargs))
        leaves = [x for _, x in paths_leaves]
        key = (tree, tuple((x.shape, x.dtype, x.device) if isinstance(x, torch.Tensor) else repr(x) for x in leaves))
        if self.armed or key not in self.checked:
            self._check(batch, [p for p, _ in paths_leaves], leaves, tree)
            self.checked.add(key)
            self.armed = False
        mine = [x.chunk(self.world)[self.rank] if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == batch
                else x for x in leaves]
        args, kwargs = pytree.tree_unflatten(mine, tree)
        out = self.inner(*args, **kwargs)
        return pytree.tree_map_only(torch.Tensor, self._gather, out)

    def _gather(self, part: torch.Tensor) -> torch.Tensor:
        part = part.contiguous()
        full = part.new_empty((part.shape[0] * self.world, *part.shape[1:]))
        dist.all_gather_into_tensor(full, part, group=self.group)
        return full


def _armed_set_timesteps(set_timesteps, calls: list[CfgParallelCall]):
    """The scheduler's ``set_timesteps`` that also makes the next denoiser call check the processes
    (pipelines call it once per image, before the loop)."""
    def run(*args, **kwargs):
        for call in calls:
            call.armed = True
        return set_timesteps(*args, **kwargs)

    return run


def install(obj: object, models: list[tuple[str, nn.Module]], record: PatchRecord, group) -> None:
    """Each denoiser's ``forward`` (as the patch left it: graphed or not) split over ``group``; the
    pipeline's scheduler arms the agreement check for every image."""
    record.scope = ""
    calls = []
    for _, model in models:
        if is_denoiser(model):
            call = CfgParallelCall(model, model.forward, group)
            record.set_attr(model, "forward", call, KIND)
            calls.append(call)
    scheduler = getattr(obj, "scheduler", None) if not isinstance(obj, nn.Module) else None
    if scheduler is not None and hasattr(scheduler, "set_timesteps"):
        record.set_attr(scheduler, "set_timesteps", _armed_set_timesteps(scheduler.set_timesteps, calls), None)
