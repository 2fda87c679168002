"""The op patchers: one function per op family that rewires a model's modules to our kernels.

A patcher has the signature ``patcher(model: nn.Module, record: PatchRecord) -> None`` and makes
every change through ``record.set_attr``. Patchers live beside this file, one per op family, and
register themselves with ``@register("name")``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.nn as nn

from .record import PatchRecord

Patcher = Callable[[nn.Module, PatchRecord], None]
PATCHERS: dict[str, Patcher] = {}


def register(op: str) -> Callable[[Patcher], Patcher]:
    def deco(fn: Patcher) -> Patcher:
        PATCHERS[op] = fn
        return fn

    return deco
