"""Whether calling a module runs more than its class's ``forward``: what a patch that re-states or skips
the call must step aside for (hooks it would skip)."""

from __future__ import annotations

import torch.nn as nn


def global_hooks() -> bool:
    """Whether forward (pre-)hooks registered for every module are set: any module's call runs them."""
    from torch.nn.modules import module

    return bool(module._global_forward_hooks or module._global_forward_pre_hooks)


def hooked(m: nn.Module, own: tuple = ()) -> bool:
    """Whether calling ``m`` runs more than its class's ``forward``: its own or global forward (pre-)hooks,
    diffusers' hook registry, accelerate's hook, a ``forward`` set on the instance (other than a method
    bound from one of ``own``: a patch's re-statement of the class's forward)."""
    forward = vars(m).get("forward")
    replaced = forward is not None and getattr(forward, "__func__", None) not in own
    return bool(m._forward_hooks or m._forward_pre_hooks or replaced or hasattr(m, "_diffusers_hook")
                or hasattr(m, "_hf_hook") or global_hooks())
