"""Scheduler timesteps on the host: a denoising loop in which the host never waits for the GPU.

diffusers' pipelines put the scheduler's timesteps on the GPU (``set_timesteps(n, device=...)``),
and then each step of PNDM (SD1.x's default) and DDIM indexes the scheduler's host tables with that
GPU timestep and branches on ``prev_timestep >= 0``: two device-to-host reads, so the host waits for
the GPU to finish the UNet before it can queue the next step. With the UNet replayed from a CUDA
graph the step's launches cost little host time, but the wait makes the GPU idle while the host runs
the pipeline's Python between steps (measured in docs/results.md).

With the timesteps on the host, the schedulers' arithmetic on them (table look-ups, ``sigma``
arithmetic, step-index searches) is host arithmetic, and reaches the GPU only as kernel scalar
arguments; the UNet's timestep reaches it through the graphs' asynchronous copy-in
(patches/cuda_graph.py). The pipeline's images are unchanged: the timesteps' values are the same.

Applied by ``patch(pipe, cuda_graph=True)`` to the pipeline's scheduler when its class is one of
``HOST_SCHEDULERS`` (checked on the GPU: same images, no sync inside the loop). ``set_timesteps``
becomes an instance attribute that calls the class's method with ``device="cpu"``; unpatch removes
it. A scheduler swapped in after the patch runs as diffusers ships it until the pipeline is patched
again.

UniPC needs one more change. Its predictor and corrector (``multistep_uni_p_bh_update``,
``multistep_uni_c_bh_update``) compute a step's few coefficients from the sigma table as 0-d tensors
on the sample's device: every ``sigma.to(device)`` is a blocking host-to-device copy and the
corrector's ``torch.linalg.solve`` checks its result on the host, so the host waited for the GPU
several times a step: 45.9 ms between the model calls of a 20-step SD1.5 image on the H100, against
1.4–2.0 ms with the other schedulers (``python -m bench.step_ops --gpu``, 2026-11-24). Under the
patch both methods run as diffusers ships them, inside ``HostScalars``: tensors of at most
``HOST_NUMEL`` elements that the code puts on the sample's device stay on the host, so the
coefficient arithmetic is host arithmetic (0-d host tensors reach the GPU's kernels as scalars), and
the one small vector that meets a latent-sized tensor (``rhos`` in the ``einsum``) is copied over
asynchronously. Only where the installed diffusers has the very code checked (patches/diffusers_sources.py).
"""

from __future__ import annotations

import functools
import inspect
import types

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from .diffusers_sources import VERIFIED_WITH, is_verified
from .record import PatchRecord

HOST_SCHEDULERS = ("PNDMScheduler", "DDIMScheduler", "EulerDiscreteScheduler", "EulerAncestralDiscreteScheduler",
                   "DPMSolverMultistepScheduler", "UniPCMultistepScheduler")
# Scheduler methods whose small tensors HostScalars keeps on the host, per class (see the docstring).
HOST_SCALAR_METHODS = {"UniPCMultistepScheduler": ("multistep_uni_p_bh_update", "multistep_uni_c_bh_update")}
# What else runs inside the mode and must be the code checked with it.
_CALLED_INSIDE = {"UniPCMultistepScheduler": ("_sigma_to_alpha_sigma_t",)}
HOST_NUMEL = 16  # at most this many elements: a step's coefficients, never a latent
_FACTORIES = frozenset({torch.ones, torch.zeros, torch.full, torch.tensor, torch.empty})


def _small_host(x: object) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == "cpu" and x.numel() <= HOST_NUMEL


class HostScalars(TorchFunctionMode):
    """Inside it, small tensors bound for ``device`` stay on the host: ``.to(device)`` of a host
    tensor of at most ``HOST_NUMEL`` elements keeps it there, and ``torch.ones/zeros/full/tensor/
    empty(..., device=device)`` of that size are made there. Where a host tensor of one or more
    dimensions meets a tensor on ``device`` in one call, it is copied over from pinned memory,
    asynchronously (a 0-d host tensor needs no copy: kernels take it as a scalar). While a CUDA graph
    captures the step (patches/whole_step.py), ``keep`` is a list that holds those pinned sources: the
    graph's copy node reads them again on every replay."""

    keep: list | None = None

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device

    def _is_target(self, value: object) -> bool:
        if not isinstance(value, (str, torch.device)):
            return False
        device = torch.device(value)
        return device.type == self.device.type and device.index in (None, self.device.index)

    def _host(self, value: object) -> object:
        return torch.device("cpu") if self._is_target(value) else value

    def _over(self, x: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":  # from pinned memory the copy is queued: the host does not wait
            x = x.pin_memory()
            if HostScalars.keep is not None:
                HostScalars.keep.append(x)
        return x.to(self.device, non_blocking=True)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to and args and _small_host(args[0]) and (
                any(map(self._is_target, args[1:])) or self._is_target(kwargs.get("device"))):
            return func(args[0], *map(self._host, args[1:]), **{k: self._host(v) for k, v in kwargs.items()})
        if func in _FACTORIES and self._is_target(kwargs.get("device")):
            out = func(*args, **{**kwargs, "device": "cpu"})
            return out if out.numel() <= HOST_NUMEL else out.to(self.device)
        if "out" in kwargs or getattr(func, "__name__", "").endswith("_"):  # writes into its arguments: as it is
            return func(*args, **kwargs)
        leaves = pytree.tree_leaves((args, kwargs))
        if any(isinstance(x, torch.Tensor) and x.device == self.device for x in leaves) and any(
                _small_host(x) and x.dim() > 0 for x in leaves):
            args, kwargs = pytree.tree_map_only(
                torch.Tensor, lambda x: self._over(x) if _small_host(x) and x.dim() > 0 else x, (args, kwargs))
        return func(*args, **kwargs)


def host_timesteps(scheduler: object, record: PatchRecord) -> bool:
    """Make ``scheduler.set_timesteps`` keep its timesteps on the host; False if its class is not one
    of HOST_SCHEDULERS (then it is left alone, and noted in the record)."""
    name = type(scheduler).__name__
    if name not in HOST_SCHEDULERS:
        record.skip("scheduler", name, "timesteps stay where the pipeline puts them (a scheduler not checked "
                    f"with host timesteps: {', '.join(HOST_SCHEDULERS)})")
        return False
    signature = inspect.signature(scheduler.set_timesteps)  # bound: without self
    if "device" not in signature.parameters:
        record.skip("scheduler", name, "its set_timesteps takes no device")
        return False

    # inspect.signature (diffusers' retrieve_timesteps reads it) sees the class's method through wraps;
    # bound to the scheduler as a method, so that a copy (copy.deepcopy) is bound to the copy
    @functools.wraps(type(scheduler).set_timesteps)
    def on_host(self, *args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.arguments["device"] = "cpu"
        return type(self).set_timesteps(self, *bound.args, **bound.kwargs)

    set_timesteps = types.MethodType(on_host, scheduler)
    record.set_attr(scheduler, "set_timesteps", set_timesteps, "host_timesteps")
    host_scalars(scheduler, record)
    return True


def host_scalars(scheduler: object, record: PatchRecord) -> bool:
    """Run ``HOST_SCALAR_METHODS`` of ``scheduler`` inside HostScalars on their sample's device
    (an instance attribute each, through ``record``); False where its class has none, or the
    installed diffusers is not the code checked (noted in the record)."""
    cls = type(scheduler)
    names = HOST_SCALAR_METHODS.get(cls.__name__, ())
    if not names:
        return False
    if not all(is_verified(getattr(cls, n)) for n in (*names, *_CALLED_INSIDE.get(cls.__name__, ()))):
        record.skip("scheduler", cls.__name__, f"its step's coefficients stay on the GPU (the host waits for it "
                    f"every step): not the diffusers {VERIFIED_WITH} code checked with them on the host")
        return False
    for name in names:
        record.set_attr(scheduler, name, types.MethodType(_on_host(getattr(cls, name)), scheduler), "host_scalars")
    return True


def _on_host(function):
    """``function`` (a scheduler class's method) run inside HostScalars on its sample's device; as
    diffusers ships it where the sample is on the CPU or another scheduler solves the step (UniPC's
    ``solver_p``: code not checked under the mode)."""

    @functools.wraps(function)
    def run(self, *args, **kwargs):
        sample = kwargs.get("sample", kwargs.get("this_sample"))
        if not isinstance(sample, torch.Tensor) or sample.device.type == "cpu" or getattr(self, "solver_p", None):
            return function(self, *args, **kwargs)
        with HostScalars(sample.device):
            return function(self, *args, **kwargs)

    return run
