"""Fixtures shared by the op tests (the attention family)."""

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
