"""Parameter sweeps in two tiers: the README's test command runs a covering subset, CI's second step the rest.

``sweep(first, *others)`` is the cross product of the axes as pytest params; each axis is a list of tuples, the
values one case gives its argument names. Case i of the first tier takes value i (mod its length) of ``first``
and runs through the product of ``others`` as a mixed-radix counter, for max(len(first), the product's size)
cases: every value of ``first`` and every combination of the others at least once. The rest of the product is
marked ``integration`` (pyproject.toml: .ci/run runs it after the README's command)."""

from __future__ import annotations

import itertools
import math

import pytest


def _index(i: int, sizes: list[int]) -> tuple[int, ...]:
    out = []
    for size in sizes:
        out.append(i % size)
        i //= size
    return tuple(out)


def sweep(first: list[tuple], *others: list[tuple]) -> list:
    sizes = [len(axis) for axis in others]
    quick = {(i % len(first), *_index(i, sizes)) for i in range(max(len(first), math.prod(sizes)))}
    params = []
    for idx in itertools.product(range(len(first)), *(range(s) for s in sizes)):
        values = [v for axis, i in zip((first, *others), idx, strict=True) for v in axis[i]]
        params.append(pytest.param(*values, marks=() if idx in quick else (pytest.mark.integration,)))
    return params


def one(values) -> list[tuple]:
    """An axis of one argument name: each value as a one-value case."""
    return [(v,) for v in values]
