"""Fixtures shared by the op tests (the attention family; call counting for the plan-cache tests)."""

import functools
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
    that counts its calls under ``label`` (and reads any other attribute from the original: a launcher's
    methods); returns the counts (a dict, updated as calls happen)."""

    class Spy:
        def __init__(self, real, label, seen):
            self.real, self.label, self.seen = real, label, seen

        def __call__(self, *a, **kw):
            self.seen[self.label] += 1
            return self.real(*a, **kw)

        def __getattr__(self, name):
            return getattr(self.real, name)

        def __get__(self, obj, objtype=None):  # a spied method stays a method
            return self if obj is None else functools.partial(self, obj)

    def install(module, **attributes):
        seen = dict.fromkeys(attributes, 0)
        for label, name in attributes.items():
            monkeypatch.setattr(module, name, Spy(getattr(module, name), label, seen))
        return seen

    return install
