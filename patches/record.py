"""Bookkeeping that makes a patch exactly reversible.

Every change the patch makes to a model goes through ``PatchRecord.set_attr``, which remembers what
was there before. ``undo`` replays those memories in reverse, so the model ends up holding the very
objects it held before (same modules, same processors, same parameters) and computes bit-identical
outputs. Nothing is copied: replacement modules hold references to the original parameters.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import torch.nn as nn

_MISSING = object()


class PatchRecord:
    def __init__(self, ops: tuple[str, ...], profile: str, parts: list[str]) -> None:
        self.ops = ops
        self.profile = profile
        self.parts = parts
        self.counts: collections.Counter = collections.Counter()
        self._undo: list[Callable[[], None]] = []

    def set_attr(self, obj: Any, name: str, value: Any, kind: str) -> None:
        """``obj.name = value``, remembered; ``kind`` names the replacement in the counts."""
        if isinstance(obj, nn.Module) and name in obj._modules:
            old = obj._modules[name]
            obj._modules[name] = value
            self._undo.append(lambda: obj._modules.__setitem__(name, old))
        else:
            old = obj.__dict__.get(name, _MISSING)
            object.__setattr__(obj, name, value)

            def restore() -> None:
                if old is _MISSING:
                    object.__delattr__(obj, name)
                else:
                    object.__setattr__(obj, name, old)

            self._undo.append(restore)
        self.counts[kind] += 1

    def undo(self) -> None:
        while self._undo:
            self._undo.pop()()
        self.counts.clear()

    def summary(self) -> str:
        parts = ", ".join(f"{k}: {n}" for k, n in sorted(self.counts.items()))
        return f"sd_kernels patch (profile {self.profile}, ops {', '.join(self.ops)}): {parts or 'nothing'}"
