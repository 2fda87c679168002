"""Test set-up: Triton runs through its interpreter when there is no GPU.

TRITON_INTERPRET must be set before any kernel module is imported (triton.jit reads it when it
decorates), so this happens at the top of conftest, before the tests import sd_kernels.ops.
"""

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Tests never read or write the user's autotune cache (sd_kernels.runtime.launch); the tests of the cache
# point it at a temporary directory themselves.
os.environ.setdefault("SD_KERNELS_AUTOTUNE_CACHE", "off")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: runs compiled Triton (bench/gpu.sh on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def device() -> str:
    """Where kernels run in this session: the GPU if there is one, else the CPU interpreter."""
    return "cuda" if HAS_CUDA else "cpu"
