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
    diffusers' hook registry holding hooks, accelerate's hook, a ``forward`` set on the instance. Not a
    ``forward`` that is the class's own bound to ``m`` (what accelerate's hook removal leaves behind) or one
    of ``own`` bound to it (a patch's re-statement of the class's forward), nor a registry emptied."""
    forward = vars(m).get("forward")
    replaced = forward is not None and not (getattr(forward, "__self__", None) is m
                                            and getattr(forward, "__func__", None) in (type(m).forward, *own))
    registry = getattr(m, "_diffusers_hook", None)
    return bool(m._forward_hooks or m._forward_pre_hooks or replaced or getattr(registry, "hooks", registry)
                or hasattr(m, "_hf_hook") or global_hooks())


def called_beside(m: nn.Module) -> bool:
    """Whether a fused path must call ``m`` itself rather than a method of it, its parts or its processor:
    what calling it runs besides its class's ``forward`` (hooks: a user's, accelerate's, bench.fp8's
    per-layer ones) or instead of it (``Module.compile()``) would be passed by."""
    return hooked(m) or getattr(m, "_compiled_call_impl", None) is not None
