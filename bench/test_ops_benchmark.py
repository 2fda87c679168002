"""The per-op microbenchmarks through pytest-benchmark, for its JSON:

    pytest bench/test_ops_benchmark.py --benchmark-enable --benchmark-json OUT/ops-benchmark.json

The cases are bench/run.py's (``bench/ops_<family>.py``, quick shapes); every (case, implementation)
is one benchmark: one call then a synchronize, so pytest-benchmark's times are eager times, the
host's launch cost included. Each benchmark's ``extra_info`` names the op, shape, dtype, layout,
bytes, FLOPs, device, versions and date. Device times (CUDA graphs) and roofline fractions come from
``python -m bench.run`` (ops.csv), which gpu.sh runs beside this.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from bench import common, run

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU: these benchmarks time compiled Triton kernels", allow_module_level=True)

QUICK = True
_open: dict[str, tuple] = {}  # family -> (its cases generator, the current case): each case built once


def _module(family: str):
    return importlib.import_module(f"bench.ops_{family}")


def _catalog() -> list:
    params = []
    for family in run.families():
        for case in _module(family).cases(QUICK):
            params += [pytest.param(family, case.name, impl, id=f"{case.name}-{impl}") for impl in case.impls]
            del case
        torch.cuda.empty_cache()
    return params


def _case(family: str, name: str) -> common.Case:
    """The case called ``name``, walking the family's generator forward (tests run in collection order)."""
    for attempt in range(2):
        cases, case = _open.get(family, (None, None))
        if case is not None and case.name == name:
            return case
        if cases is None or attempt:
            cases = iter(_module(family).cases(QUICK))
        for case in cases:
            if case.name == name:
                _open[family] = (cases, case)
                return case
        _open.pop(family, None)
    raise LookupError(f"bench.ops_{family} yields no case {name!r}")


@pytest.mark.parametrize("family, name, impl", _catalog())
def test_op(benchmark, family: str, name: str, impl: str) -> None:
    case = _case(family, name)
    fn = case.impls[impl]
    benchmark.extra_info.update(op=case.op, shape=case.shape, dtype=str(case.dtype).removeprefix("torch."),
                                variant=case.variant, impl=impl, bytes=case.bytes, flops=case.flops,
                                **common.environment())
    benchmark.pedantic(lambda: (fn(), torch.cuda.synchronize()), rounds=30, warmup_rounds=5)
