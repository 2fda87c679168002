"""The mark on a forward hook that a CUDA graph's replay may skip (``replay_safe``). Graphed calls run eagerly
while a hook they would skip is registered inside the model (patches/cuda_graph.py, patches/hooks.py's
``replay_skipped``); the hooks sd_kernels registers itself carry this mark."""

from __future__ import annotations

from collections.abc import Callable

REPLAY_SAFE = "_sd_kernels_replay_safe"  # the attribute set on the hook's function


def replay_safe(hook: Callable) -> Callable:
    """Mark ``hook`` (a forward or forward-pre hook function, or a bound method: its function is marked) as one a
    CUDA graph's replay may skip: its device work, if any, is the same on every call (a capture records it), and
    what it does on the host matters only on the calls it runs for (a layout change, a check a capture already
    passed, a record of the first call). Returns ``hook``."""
    setattr(getattr(hook, "__func__", hook), REPLAY_SAFE, True)
    return hook
