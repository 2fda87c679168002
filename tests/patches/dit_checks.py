"""Checks the DiT families' tests share (test_pixart_patch.py, test_sd3_patch.py): the same tiny VAE
and the same pipeline-level comparison against float64."""

import copy

import torch

import sd_kernels
from sd_kernels import dispatch
from sd_kernels.testing import assert_close_to_reference

# What the patch counts in the tiny configs' VAE (every DiT tiny config shares tiny.json's VAE blocks).
VAE_COUNTS = {"group_norm", "group_norm_silu", "resnet_fused_forward", "silu_folded"}


def check_transformer_kernels_close_to_stock(pipe, run) -> None:
    """``run(pipe)`` (two steps) with the transformer's kernels (the interpreter), the VAE left to stock:
    the images against a float64 run of the same pipeline, no op on the reference."""
    stock = run(pipe)
    ref64 = run(copy.deepcopy(pipe).to(torch.float64))
    with sd_kernels.patched(pipe, ignore=("vae",)) as record:
        assert record.parts == ["transformer"]
        dispatch.reset_fallbacks()
        assert_close_to_reference(run(pipe), stock, ref64)
        assert not dispatch.fallbacks()
