"""Tile orders of the GEMM-shaped kernels (fp8_linear; gelu's fused linear keeps its own copy inline, as
its shipped tuning tables were fingerprinted with it)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of program ``pid`` over the [M, N] output in grouped order: GROUP_M row tiles in a
    row sweep the same weight tiles while those sit in L2."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * num_pid_n
    first_m = (pid // group) * GROUP_M
    group_m = min(num_pid_m - first_m, GROUP_M)
    return first_m + (pid % group) % group_m, (pid % group) // group_m
