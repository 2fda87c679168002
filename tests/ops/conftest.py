"""Fixtures shared by the attention-family tests (test_attention.py, test_softmax_matmul.py)."""

import importlib

import pytest

from sd_kernels.testing import poison_

attn_mod = importlib.import_module("sd_kernels.ops.attention")


@pytest.fixture
def poisoned_attention_outputs(monkeypatch):
    """Every output the attention kernels allocate starts as NaN: an unwritten element fails."""
    alloc = attn_mod.alloc_output
    monkeypatch.setattr(attn_mod, "alloc_output", lambda *a, **k: poison_(alloc(*a, **k)))


@pytest.fixture
def one_attention_config(monkeypatch):
    """GPU: time no configs (compile one per shape); test_gpu_every_config runs them all."""
    monkeypatch.setattr(attn_mod, "AUTOTUNE", False)
