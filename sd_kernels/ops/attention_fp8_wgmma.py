"""FP8 attention by the Hopper kernel (ops/attention_fp8_wgmma_kernel.py): when it can run, and its launch.

``ops.attention_fp8`` calls it for ``pv="fp8"`` on sm_90 with Triton 3.6 (the exact Hopper kernel's
conditions, ops/attention_wgmma.py), after its pre-pass has written K in 8 bits and Vᵀ in e4m3 with
its keys in ``wgmma_key_order``; everywhere else the Triton kernel of ops/attention_fp8.py runs.
"""

from __future__ import annotations

import functools
import importlib

import torch
import triton

from . import attention_wgmma as _wgmma

BLOCK_M = 64  # query rows per consumer warpgroup
STAGES = 3  # key blocks in the shared-memory ring (K8 and Vᵀ: 32 KiB a stage at head dim 128)
# Per Q·Kᵀ mode, whether the consumer warpgroups take turns on the tensor cores (a token ring): e4m3 3%
# faster with it at head dim 128 and within 2% at 64; int8 faster without, 6% at 128 and 2-7% at 64
# (H200, 2026-11-29; docs/kernels/attention_fp8.md)
PINGPONG = {"fp8": True, "int8": False}
HEAD_DIMS = (64, 128)
# How the kernel relabels P's keys (``_operand``): a 32-key chunk's key 16a + 8b + 2t + e seen as (a, b, t,
# e), then [rows, chunk, a, b, t, e] → [rows, chunk, a, t, b, e]; ops.attention_fp8's ``wgmma_key_order``
# writes Vᵀ in that order.
P_KEY_SPLIT = (2, 2, 4, 2)
P_KEY_PERM = (0, 1, 2, 4, 3, 5)


_KERNEL = "sd_kernels.ops.attention_fp8_wgmma_kernel"


@functools.cache
def unavailable() -> str | None:
    """Why this Triton cannot build the kernel, or None."""
    return _wgmma.gluon_reason(_KERNEL, "the FP8 Hopper kernel")


def _kernel():
    return importlib.import_module(_KERNEL)


def reason(q4: torch.Tensor, key_block: int) -> str | None:
    """Why the Hopper kernel cannot take q4 [B, H, Sq, D] (arguments ``attention_fp8`` already accepted),
    or None. K and V need no checks: the pre-pass writes them."""
    b, h, _, d = q4.shape
    if d not in HEAD_DIMS:
        return f"head dim {d}: {' or '.join(map(str, HEAD_DIMS))}"
    if key_block != 128:
        return f"key block {key_block}: the kernel's is 128"
    if b * h > _wgmma.MAX_GRID_Y:
        return f"{b * h} (batch, head) pairs > {_wgmma.MAX_GRID_Y}, CUDA's grid limit on the axis they take"
    if (why := _wgmma._tma_reason(q4)) is not None:
        return f"q: {why}"
    return _wgmma.hopper_reason(q4) or unavailable()


def consumers(d: int) -> int:
    """Consumer warpgroups per program: three at head dim 64 (SD3's joint attention 8-10% faster than
    with two, SDXL's 4,096-token self-attention 2-5% slower; H200, 2026-11-29), two at 128 (three
    measured 12-14% slower at FLUX's shape: their registers run short). docs/kernels/attention_fp8.md."""
    return 3 if d <= 64 else 2


def attention(q4, k8, k_scale, v8, v_scale, out, sk: int, qk_scale: float, qk: str,
              n_consumers: int | None = None):
    """out [B, H, Sq, D] ← the kernel over q4 (fp16/bf16, TMA-addressable) and the pre-pass's k8 [B·H,
    S_PAD, D] (int8 or e4m3), k_scale [B·H, S_PAD/128], v8 [B·H, D, S_PAD] (e4m3, keys in
    ``wgmma_key_order``), v_scale [B·H, D]; sk: the key count (keys past it are padding).
    qk_scale = scale·log2(e); ``n_consumers`` (2 or 3) overrides ``consumers(d)``, for benchmarks."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    b, h, sq, d = q4.shape
    nc = consumers(d) if n_consumers is None else n_consumers
    if nc not in _wgmma.REGISTERS:
        raise ValueError(f"n_consumers={n_consumers!r}: one of {sorted(_wgmma.REGISTERS)}")
    maxnreg, consumer_regs = _wgmma.REGISTERS[nc]
    n_blocks = k_scale.shape[1]
    block_n = k8.shape[1] // n_blocks
    k_kind = gl.int8 if qk == "int8" else gl.float8e4nv

    def desc(x, block, kind):
        return TensorDescriptor(x, list(x.shape), list(x.stride()), block,
                                gl.NVMMASharedLayout.get_default_for(block, kind))

    kd = desc(k8, [1, block_n, d], k_kind)
    vd = desc(v8, [1, d, block_n], gl.float8e4nv)
    qd = _wgmma.descriptor(q4, BLOCK_M, d)
    od = _wgmma.descriptor(out, BLOCK_M, d)
    grid = (triton.cdiv(sq, nc * BLOCK_M), b * h)
    with torch.cuda.device(q4.device):
        _kernel()._attn_fp8_wgmma_fwd[grid](qd, kd, vd, od, k_scale, v_scale, h, sk, n_blocks, qk_scale,
                                            NS=STAGES, QK_INT8=qk == "int8", NC=nc, CONSUMER_REGS=consumer_regs,
                                            PINGPONG=PINGPONG[qk],
                                            num_warps=4, maxnreg=maxnreg)
    return out
