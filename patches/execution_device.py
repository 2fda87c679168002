"""The pipeline's host time before its first GPU work: ``_execution_device`` without its module walk.

Every call of a diffusers pipeline starts with ``self._execution_device``, and in diffusers 0.42.1
that property looks for group-offloading hooks by walking every module of every component
(``module.modules()``, a ``hasattr`` on each: about 3.4 µs per module, most of it the
AttributeError that ``nn.Module.__getattr__`` raises for a missing name). SD1.5's pipeline has 1,103
modules, SDXL's 2,717; measured on the H100 machine's host: 3.8 ms per SD1.5 call and 5.3 ms per
SDXL call, while the GPU waits for its first kernel (bench/results/2026-11-24-h100-host-time-conv/).

``patch(pipe)`` gives the pipeline object a subclass of its own class (same name, module and
qualified name: ``save_pretrained`` writes the same ``_class_name``) whose ``_execution_device``
gives the same answer by the same rules, from a walk that reads each module's ``__dict__`` instead
of raising and catching an AttributeError per module: the first group-offloading hook in
``named_modules`` order of the first component that has one, else accelerate's hooks exactly as
diffusers reads them, else ``pipe.device`` (the first component off the CPU; each diffusers model's
device is then its first tensor's, since the walk found no hook, where diffusers walks it again).
It is installed only where the installed diffusers has the very code this mirrors
(patches/diffusers_sources.py); unpatch gives the object its class back.
"""

from __future__ import annotations

import functools
import itertools

import torch
import torch.nn as nn

from . import call_gate
from .diffusers_sources import VERIFIED_WITH, is_verified
from .record import PatchRecord, same_name_subclass

_HOOK = "_diffusers_hook"


# A walk longer than this is not a module tree (a cycle, or sharing that multiplies paths): diffusers' own.
_MAX_VISITS = 1_000_000


def _first_group_hook(root: nn.Module, name: str):
    """diffusers' ``_get_top_level_group_offload_hook(root)``: the first module in ``named_modules``
    order (pre-order) whose hook registry holds a hook called ``name``. ``named_modules`` visits a
    shared module once; this walk may visit it again, but only after its first visit, which would
    have returned its hook: the answer is the same, without keeping a set of the modules seen."""
    stack = [root]
    pop, push = stack.pop, stack.extend
    plain = _PLAIN_CLASSES  # classes that do not define the hook attribute themselves
    visits = 0
    while stack:
        m = pop()
        if m is None:
            continue
        visits += 1
        if visits > _MAX_VISITS:
            from diffusers.hooks.group_offloading import _GROUP_OFFLOADING, _get_top_level_group_offload_hook

            return _get_top_level_group_offload_hook(root) if name == _GROUP_OFFLOADING else None
        d = m.__dict__
        registry = d.get(_HOOK)
        if registry is None and type(m) not in plain and _class_defines_hook(type(m)):
            registry = getattr(m, _HOOK, None)
        if registry is not None:
            hook = registry.get_hook(name)
            if hook is not None:
                return hook
        children = d["_modules"]
        if children:
            push(reversed(children.values()))
    return None


_PLAIN_CLASSES: set[type] = set()


def _class_defines_hook(cls: type) -> bool:
    """A class that defines the attribute itself (never in diffusers) is read the slow way; the
    others are remembered in ``_PLAIN_CLASSES`` (a set look-up per module after the first)."""
    if hasattr(cls, _HOOK):
        return True
    _PLAIN_CLASSES.add(cls)
    return False


def _execution_device(self) -> torch.device:
    """``DiffusionPipeline._execution_device`` of diffusers 0.42.1, with a faster walk (module docstring)."""
    from diffusers.hooks.group_offloading import _GROUP_OFFLOADING

    components = self.components
    for model in components.values():
        if isinstance(model, nn.Module):
            hook = _first_group_hook(model, _GROUP_OFFLOADING)
            if hook is not None:
                return hook.config.onload_device
    for name, model in components.items():  # accelerate's offloading hooks, read as diffusers reads them
        if not isinstance(model, nn.Module) or name in self._exclude_from_cpu_offload:
            continue
        if not hasattr(model, "_hf_hook"):
            return _device_of(self)
        for module in model.modules():
            hook = getattr(module, "_hf_hook", None)
            if hook is not None and getattr(hook, "execution_device", None) is not None:
                return torch.device(hook.execution_device)
    return _device_of(self)


def _device_of(pipe) -> torch.device:
    """``pipe.device`` once no component has a group-offloading hook (the walk above found none):
    ours where the class has diffusers' property, else the class's own."""
    from diffusers import DiffusionPipeline

    return _pipeline_device(pipe) if type(pipe).device is DiffusionPipeline.device else pipe.device


def _pipeline_device(pipe) -> torch.device:
    """``DiffusionPipeline.device``: the first component not on the CPU (or meta), else the first.
    Called where no component has a group-offloading hook, so each model's device is its first
    tensor's (diffusers' ModelMixin.device would walk the model for a hook once more)."""
    names, _ = pipe._get_signature_keys(pipe)
    modules = [m for m in (getattr(pipe, n, None) for n in names) if isinstance(m, nn.Module)]
    devices = (_model_device(m) for m in modules)
    first = None
    for device in devices:
        if device.type not in ("cpu", "meta"):
            return device
        first = device if first is None else first
    return first if first is not None else torch.device("cpu")


def _model_device(model: nn.Module) -> torch.device:
    """``model.device`` of a model without group-offloading hooks; for a diffusers model
    (``ModelMixin.device``) that is its first parameter's or buffer's."""
    from diffusers import ModelMixin

    if not isinstance(model, ModelMixin) or type(model).device is not ModelMixin.device:
        return model.device
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        return tensor.device
    return model.device  # no parameters or buffers: diffusers' own fallback


@functools.cache
def _fast_class(cls: type) -> type:
    return same_name_subclass(cls, {"_execution_device": property(_execution_device), "_sd_kernels_fast_device": True})


def verified() -> bool:
    """Whether the installed diffusers has the code ``_execution_device`` above mirrors."""
    from diffusers import DiffusionPipeline, ModelMixin
    from diffusers.hooks import group_offloading as go
    from diffusers.models import modeling_utils

    return all(map(is_verified, (DiffusionPipeline._execution_device.fget, go._get_top_level_group_offload_hook,
                                 go._get_group_onload_device, DiffusionPipeline.device.fget, ModelMixin.device.fget,
                                 modeling_utils.get_parameter_device)))


def fast_execution_device(pipe: object, record: PatchRecord) -> bool:
    """Give ``pipe`` the subclass with the faster ``_execution_device``; False (and a skip in the
    record) where diffusers' code is not the one mirrored or the pipeline's class overrides it."""
    from diffusers import DiffusionPipeline

    cls = call_gate.class_of(pipe)
    if not isinstance(pipe, DiffusionPipeline) or getattr(cls, "_sd_kernels_fast_device", False):
        return False
    if not verified():
        record.skip("", cls.__name__, f"_execution_device left as it is: not the diffusers {VERIFIED_WITH} code "
                    "its faster copy mirrors")
        return False
    if cls._execution_device is not DiffusionPipeline._execution_device:
        record.skip("", cls.__name__, "_execution_device left as it is: the pipeline class defines its own")
        return False
    record.set_class(pipe, _fast_class(cls), "fast_execution_device")
    return True
