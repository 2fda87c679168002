"""A launch configuration for a key no table holds, chosen without timing anything.

Timing every config of a kernel at every new shape (Triton's autotuner) costs seconds per kernel and
shape: 45-70 s before the first image at a size the shipped tables do not hold. Instead, a key no
table holds takes the choice of the *nearest tuned key* of the same kernel:

- a key is compared by its ``repr`` (the form the tables store): its numbers (sizes, tiles of a plan,
  alignments) are taken out, and what is left (dtypes, flags, the names of a plan's fields) is its
  *skeleton*. Only keys with the same skeleton are candidates: same dtypes, same mask kind, same path;
- the distance between two keys of one skeleton is the sum, over their numbers, of
  ``|log2(1 + a) - log2(1 + b)|``: a factor of two in one size counts 1, whatever the size;
- the nearest candidate whose config the kernel accepts for this call (its autotuner's own pruning:
  shared memory per head dim, dtype, tile no wider than the data) wins; equally near candidates vote,
  and a tie goes to the key that sorts first, so the choice is the same in every process;
- the tables searched, in order: this GPU's (the user's autotune cache and the shipped table), then
  the shipped tables of other GPUs of the same architecture under the same profile (an H100 PCIe takes
  the H100 SXM's), then nothing: the kernel's first config that its pruning keeps for the call (the
  configs are listed best-first for Hopper; ``Launcher`` moves to the next one where a GPU lacks the
  resources for it).

``SD_KERNELS_AUTOTUNE=1`` times such keys instead and keeps the choices in the autotune cache
(docs/design.md, "Launch configurations"); ``python -m bench.rule`` measures how far this rule is from
timing.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Any

# A number standing alone in a repr: not part of a name (float16, tf32) or of a dotted path.
_NUMBER = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?(?![\w.])")


def split_key(text: str) -> tuple[str, tuple[float, ...]]:
    """(skeleton, numbers on a log scale) of a key's repr."""
    values = []
    for token in _NUMBER.findall(text):
        v = float(token)
        values.append(math.copysign(math.log2(1.0 + abs(v)), v))
    return _NUMBER.sub("#", text), tuple(values)


class Neighbours:
    """One table's keys, grouped by skeleton, for nearest-key lookups: ``entries`` maps a key's repr
    to its config (a cache file's entries)."""

    def __init__(self, entries: dict[str, dict[str, Any]]) -> None:
        self.groups: dict[str, list[tuple[tuple[float, ...], str, dict[str, Any]]]] = {}
        for name in sorted(entries):
            skeleton, numbers = split_key(name)
            self.groups.setdefault(skeleton, []).append((numbers, name, entries[name]))

    def __len__(self) -> int:
        return sum(map(len, self.groups.values()))

    def ranked(self, text: str) -> list[tuple[float, str, dict[str, Any]]]:
        """The keys of ``text``'s skeleton, nearest first: (distance, key, config)."""
        skeleton, numbers = split_key(text)
        rows = [(sum(abs(a - b) for a, b in zip(numbers, other)), name, config)
                for other, name, config in self.groups.get(skeleton, ())]
        return sorted(rows, key=lambda row: (row[0], row[1]))


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Dict equality that also tells True from 1 (JSON keeps the difference; ``==`` does not)."""
    return a.keys() == b.keys() and all(type(a[k]) is type(b[k]) and a[k] == b[k] for k in a)


def accepted(config: dict[str, Any], allowed: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The allowed config ``config`` names (the part of it each allowed config has), or None."""
    for option in allowed:
        if _same({k: v for k, v in config.items() if k in option}, option):
            return option
    return None


def nearest(text: str, tables: Iterable[Neighbours], allowed: list[dict[str, Any]]
            ) -> tuple[dict[str, Any], str] | None:
    """(the config, the key it was tuned for) of the nearest key in the first table that has one the
    kernel accepts (``allowed``: its configs for this call, as cache entries); None if none has."""
    for table in tables:
        ranked = [(d, name, option) for d, name, config in table.ranked(text)
                  if (option := accepted(config, allowed)) is not None]
        if not ranked:
            continue
        best = ranked[0][0]
        tied = [(name, option) for d, name, option in ranked if d <= best + 1e-9]
        votes: dict[int, list[str]] = {}
        for name, option in tied:
            votes.setdefault(allowed.index(option), []).append(name)
        index, names = min(votes.items(), key=lambda kv: (-len(kv[1]), min(kv[1])))
        return allowed[index], min(names)
    return None
