"""sd_kernels.launch.Launcher: the first launch of a key goes through the autotuner, later ones skip it
with the same meta-parameters (runs on CPU through the interpreter)."""

import pytest
import torch
import triton
import triton.language as tl

from sd_kernels.dispatch import interpreting
from sd_kernels.launch import Launcher

# Autotuning between configs benchmarks them, which needs a GPU: the interpreter gets one config.
CONFIGS = [triton.Config({"BLOCK": 32}, num_warps=1)]
if not interpreting():
    CONFIGS.insert(0, triton.Config({"BLOCK": 16}, num_warps=1))


@triton.autotune(CONFIGS, key=["n"])
@triton.heuristics({"EVEN": lambda args: args["n"] % args["BLOCK"] == 0})
@triton.jit
def _scale_kernel(x_ptr, y_ptr, n, factor, BLOCK: tl.constexpr, EVEN: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    if EVEN:
        tl.store(y_ptr + offs, tl.load(x_ptr + offs) * factor)
    else:
        tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * factor, mask=offs < n)


@pytest.mark.parametrize("n", [48, 50])
def test_memo_launch_matches_autotuned_launch(n, device):
    launch = Launcher(_scale_kernel)
    x = torch.randn(n, device=device)
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK"]),)
    outs = []
    for _ in range(3):
        y = torch.full_like(x, float("nan"))
        launch(n, grid, x, y, n, 3.0)
        outs.append(y)
    for y in outs:
        torch.testing.assert_close(y, x * 3.0)
    meta = launch.memo[n]
    assert meta["BLOCK"] == _scale_kernel.best_config.kwargs["BLOCK"]
    assert meta["EVEN"] == (n % meta["BLOCK"] == 0)
    assert meta["num_warps"] == 1


def test_memo_is_per_key(device):
    launch = Launcher(_scale_kernel)
    for n in (16, 17, 16):
        x = torch.randn(n, device=device)
        y = torch.empty_like(x)
        launch(n, lambda meta, n=n: (triton.cdiv(n, meta["BLOCK"]),), x, y, n, -1.0)
        torch.testing.assert_close(y, -x)
    assert sorted(launch.memo) == [16, 17]
    assert launch.memo[17]["EVEN"] is False
