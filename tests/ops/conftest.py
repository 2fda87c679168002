"""Fixtures shared by the op tests (the attention family; call counting for the plan-cache tests)."""

import importlib

import pytest

from sd_kernels.testing import poison_

common = importlib.import_module("sd_kernels.ops.attention_common")


@pytest.fixture
def poisoned_attention_outputs(monkeypatch):
    """Every output the attention kernels allocate starts as NaN: an unwritten element fails."""
    alloc = common.alloc_output
    monkeypatch.setattr(common, "alloc_output", lambda *a, **k: poison_(alloc(*a, **k)))


@pytest.fixture
def one_attention_config(monkeypatch):
    """GPU: time no configs (compile one per shape); test_gpu_every_config runs them all."""
    monkeypatch.setattr(common, "AUTOTUNE", False)


@pytest.fixture
def count_calls(monkeypatch):
    """``count_calls(module, label=attribute, ...)``: each named module attribute replaced by a wrapper
    that counts its calls under ``label``; returns the counts (a dict, updated as calls happen)."""

    def install(module, **attributes):
        seen = dict.fromkeys(attributes, 0)
        for label, name in attributes.items():
            real = getattr(module, name)

            def spy(*a, _real=real, _label=label, **kw):
                seen[_label] += 1
                return _real(*a, **kw)

            monkeypatch.setattr(module, name, spy)
        return seen

    return install
