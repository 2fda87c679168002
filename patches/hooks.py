"""Whether calling a module runs more than its class's ``forward``: what a patch that re-states or skips
the call must step aside for (hooks it would skip); and the forward hooks a CUDA graph's replay would skip
(``replay_skipped``)."""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch.nn as nn

from sd_kernels.runtime.graph_hooks import REPLAY_SAFE, replay_safe

__all__ = ["REPLAY_SAFE_DIFFUSERS_HOOKS", "REPLAY_SAFE_MODULES", "called_beside", "global_hooks", "hooked",
           "registrations", "replay_safe", "replay_skipped", "watch_registrations"]

# Modules whose hook functions a replay may skip: transformers' output-capturing hooks (installed on a text
# encoder's layers at its first call) only gather the hidden states its output returns, and a graph returns the
# captured output whole.
REPLAY_SAFE_MODULES = frozenset({"transformers.utils.output_capturing"})
# diffusers' hooks (a module's ``_diffusers_hook`` registry) a replay may run as captured: context parallelism's
# split and gather, the same collectives on the same buffers every call (patches/context_parallel.py). Every other
# diffusers hook (the caches: pyramid attention broadcast, FasterCache, first-block cache; layer skip; ...) keeps
# state across calls or decides per call what to compute: captured, one call's decision would be replayed.
REPLAY_SAFE_DIFFUSERS_HOOKS = frozenset({"diffusers.hooks.context_parallel"})


def global_hooks() -> bool:
    """Whether forward (pre-)hooks registered for every module are set: any module's call runs them."""
    from torch.nn.modules import module

    return bool(module._global_forward_hooks or module._global_forward_pre_hooks)


def hooked(m: nn.Module, own: tuple = (), installed: object = None) -> bool:
    """Whether calling ``m`` runs more than its class's ``forward``: its own or global forward (pre-)hooks,
    diffusers' hook registry holding hooks, accelerate's hook, a ``forward`` set on the instance. Not a
    ``forward`` that is the class's own bound to ``m`` (what accelerate's hook removal leaves behind), one
    of ``own`` bound to it (a patch's re-statement of the class's forward) or ``installed`` itself (a patch's
    instance forward: patches/layer_norm.py's block forwards), nor a registry emptied."""
    forward = vars(m).get("forward")
    replaced = forward is not None and forward is not installed and not (
        getattr(forward, "__self__", None) is m and getattr(forward, "__func__", None) in (type(m).forward, *own))
    registry = getattr(m, "_diffusers_hook", None)
    return bool(m._forward_hooks or m._forward_pre_hooks or replaced or getattr(registry, "hooks", registry)
                or hasattr(m, "_hf_hook") or global_hooks())


def called_beside(m: nn.Module, installed: object = None) -> bool:
    """Whether a fused path must call ``m`` itself rather than a method of it, its parts or its processor:
    what calling it runs besides its class's ``forward`` (hooks: a user's, accelerate's, bench.fp8's
    per-layer ones) or instead of it (``Module.compile()``) would be passed by. ``installed``: an instance forward a
    patch set on ``m``, not counted (``hooked``)."""
    return hooked(m, installed=installed) or getattr(m, "_compiled_call_impl", None) is not None


def replay_skipped(named: Iterable[tuple[str, nn.Module]]) -> str | None:
    """The first forward (pre-)hook, global or on one of the ``named`` modules (those a graphed call runs inside
    it), that a CUDA graph's replay would skip (neither marked ``replay_safe`` nor from ``REPLAY_SAFE_MODULES``), or
    the first diffusers hook on one of them (in its ``_diffusers_hook`` registry) not marked ``replay_safe`` nor
    from ``REPLAY_SAFE_DIFFUSERS_HOOKS``, as a phrase; None if there is none."""
    from torch.nn.modules import module

    def unsafe(hooks: dict) -> bool:
        return any(not (getattr(h, REPLAY_SAFE, False) or getattr(h, "__module__", None) in REPLAY_SAFE_MODULES)
                   for h in hooks.values())

    if unsafe(module._global_forward_pre_hooks) or unsafe(module._global_forward_hooks):
        return "a forward hook registered for every module"
    for name, m in named:
        if unsafe(m._forward_pre_hooks) or unsafe(m._forward_hooks):
            return f"a forward hook on {name} ({type(m).__name__})"
        held = getattr(vars(m).get("_diffusers_hook"), "hooks", None) or {}
        for hook_name, hook in held.items():
            if not (getattr(hook, REPLAY_SAFE, False) or type(hook).__module__ in REPLAY_SAFE_DIFFUSERS_HOOKS):
                return f"diffusers' hook {hook_name!r} ({type(hook).__name__}) on {name} ({type(m).__name__})"
    return None


class _Registrations:
    """diffusers' ``HookRegistry.register_hook`` counted while a patch's CUDA graphs watch the models
    (``watch_registrations``): registering a diffusers hook moves no counter torch keeps, and a graph captured
    before a hook was registered inside its model would replay the call without it."""

    def __init__(self) -> None:
        self.count = 0  # diffusers hooks registered while watched
        self.watchers = 0
        self.original = None
        self.wrapper = None

    def watch(self):
        """Count registrations until the returned function is called (once per watcher; the class's method is
        given back when the last stops watching, unless another wrapped it since)."""
        from diffusers.hooks.hooks import HookRegistry

        if self.watchers == 0:
            original = HookRegistry.register_hook

            @functools.wraps(original)
            def register_hook(registry, *args, **kwargs):
                self.count += 1
                return original(registry, *args, **kwargs)

            self.original, self.wrapper = original, register_hook
            HookRegistry.register_hook = register_hook
        self.watchers += 1
        stopped = []

        def stop() -> None:
            if stopped:
                return
            stopped.append(True)
            self.watchers -= 1
            if self.watchers == 0 and HookRegistry.__dict__.get("register_hook") is self.wrapper:
                HookRegistry.register_hook = self.original

        return stop


_REGISTRATIONS = _Registrations()


def watch_registrations():
    """Start counting diffusers' hook registrations (``registrations``); returns the function that stops."""
    return _REGISTRATIONS.watch()


def registrations() -> int:
    """How many diffusers hooks were registered while watched: a watcher reads the modules' hooks again when this
    moved."""
    return _REGISTRATIONS.count
