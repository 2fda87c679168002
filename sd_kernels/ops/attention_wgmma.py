"""Attention by the Hopper wgmma kernel (ops/attention_wgmma_kernel.py): when it can run, and its launch.

The kernel is written in Gluon against Triton 3.6 and runs on sm_90 only; elsewhere ``reason``
says why not and ``ops.attention`` takes its other paths. No attention mask, no autograd;
fp16 or bf16 [B, H, S, D] views whose strides TMA can address (16-byte aligned, D contiguous).
"""

from __future__ import annotations

import functools
import importlib
import math

import torch
import triton

from . import attention_common as _common

TESTED_TRITON = "3.6."  # Gluon is experimental: its API changed after 3.6
MAX_HEAD_DIM = 128
BLOCK_M = 64  # query rows per consumer warpgroup
# consumer warpgroups per program -> (the kernel's maxnreg, registers of each consumer run as a worker
# partition): 4 (NC = 3) or 3 warpgroups of 128 threads share 64K registers (the loader's takes 24)
REGISTERS = {2: (168, 240), 3: (128, 160)}
BLOCK_N = 128  # keys per block
STAGES = 3  # key/value blocks in the shared-memory ring (2 stalls the loader: docs)
MAX_GRID_Y = 65535
_DTYPES = (torch.float16, torch.bfloat16)


def gluon_reason(module: str, what: str) -> str | None:
    """Why this Triton cannot build the Gluon kernel of ``module`` (``what`` names it in the reason), or
    None."""
    if not triton.__version__.startswith(TESTED_TRITON):
        return (f"Triton {triton.__version__}: {what} is written against Triton {TESTED_TRITON}x's Gluon API, "
                "which later versions changed")
    try:
        importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - any import failure means the same: no kernel
        return f"Gluon unavailable: {type(exc).__name__}: {exc}"
    return None


_KERNEL = "sd_kernels.ops.attention_wgmma_kernel"


@functools.cache
def unavailable() -> str | None:
    """Why this Triton cannot build the kernel, or None."""
    return gluon_reason(_KERNEL, "the wgmma attention kernel")


def _kernel():
    return importlib.import_module(_KERNEL)


def _tma_reason(t: torch.Tensor) -> str | None:
    if t.stride(-1) != 1:
        return "the head dim is not contiguous"
    if any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape)):
        return "a broadcast (stride 0) dimension"
    if t.data_ptr() % 16 or any(s * t.element_size() % 16 for s in t.stride()[:-1]):
        return "a stride or the base address is not 16-byte aligned (TMA)"
    return None


def reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
           scale: float | None = None) -> str | None:
    """Why the wgmma kernel cannot take this call, or None."""
    if attn_mask is not None:
        return "an attention mask (the wgmma kernel takes none)"
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not 0 < scale < math.inf):
        return f"scale {scale!r}: the kernel takes the row max of the unscaled scores, so a finite number > 0"
    if not (q.dim() == k.dim() == v.dim() == 4):
        return "not [B, H, S, D] tensors"
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtypes {q.dtype}, {k.dtype}, {v.dtype}: fp16 or bf16, all alike"
    b, h, _, d = q.shape
    if k.shape[:2] != (b, h) or v.shape != k.shape or k.shape[-1] != d:
        return "k and v must match q's batch, heads and head dim (no broadcasting)"
    if d > MAX_HEAD_DIM or d % 8:
        return f"head dim {d}: a multiple of 8 up to {MAX_HEAD_DIM}"
    if q.numel() == 0 or k.numel() == 0:
        return "an empty batch, head or sequence"
    if b * h > MAX_GRID_Y:
        return f"{b * h} (batch, head) pairs > {MAX_GRID_Y}, CUDA's grid limit on the axis they take"
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return "autograd (forward only)"
    for t in (q, k, v):
        if (why := _tma_reason(t)) is not None:
            return why
    return hopper_reason(q, k, v) or unavailable()


def hopper_reason(t: torch.Tensor, *others: torch.Tensor) -> str | None:
    """Why t (and ``others``, on t's device) is not on an sm_90 (Hopper) CUDA GPU, the Gluon kernels'
    target, or None."""
    if not (t.is_cuda and all(o.device == t.device for o in others)) or torch.version.hip is not None:
        return f"not on {'one' if others else 'a'} CUDA (NVIDIA) device"
    if torch.cuda.get_device_capability(t.device) != (9, 0):
        return "not an sm_90 (Hopper) GPU"
    return None


def split_head_dim(d: int) -> tuple[int, int, bool]:
    """(D_LO, D_HI, has_hi): the head dim as one power-of-two block, or 64 + 16 for 65..80."""
    if d <= 64:
        return 64, 16, False
    if d <= 80:
        return 64, 16, True
    return 128, 16, False


def descriptor(x: torch.Tensor, rows: int, width: int):
    """The TMA descriptor of x [B, H, S, D] (fp16/bf16) seen as [B, S, H, D], blocks [1, rows, 1, width]."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    b, h, s, d = x.shape
    kind = gl.float16 if x.dtype == torch.float16 else gl.bfloat16
    block = [1, rows, 1, width]
    return TensorDescriptor(x, [b, s, h, d], [x.stride(0), x.stride(2), x.stride(1), 1], block,
                            gl.NVMMASharedLayout.get_default_for(block, kind))


def _descriptors(x: torch.Tensor, rows: int, d_lo: int, d_hi: int) -> list:
    """``descriptor`` of x for its D_LO and D_HI column blocks."""
    return [descriptor(x, rows, width) for width in (d_lo, d_hi)]


def output_like(q: torch.Tensor) -> torch.Tensor:
    """[B, H, Sq, D] in ``library.attention_layout``'s layout: heads inner when q's are."""
    return _common.alloc_output(q.shape, q, heads_inner=q.stride(1) < q.stride(2))  # looked up per call


def consumers(d: int) -> int:
    """Consumer warpgroups per program: three at head dims up to 64, where a key block's softmax
    takes as long as its two wgmmas, so two other warpgroups' wgmmas must cover it (FA3 takes 192
    query rows there too); two above."""
    return 3 if d <= 64 else 2


def attention_wgmma(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                    n_consumers: int | None = None, even_k: bool = False) -> torch.Tensor:
    """softmax(q·kᵀ·scale)·v for calls ``reason`` accepts (it is not checked again here).
    ``n_consumers`` (2 or 3) overrides ``consumers(d)``, for benchmarks; three need head dim ≤ 80 (at 128
    the three Q tiles and the ring exceed shared memory).

    ``even_k``, for benchmarks: compile the variant without the ragged-block test (only where the key
    count is a multiple of BLOCK_N). By default every key count runs one compilation, which tests each
    key block for raggedness at run time (a uniform branch): a new image size then compiles nothing
    here, where a variant per raggedness cost a Gluon compilation of seconds at the first odd size."""
    b, h, sq, d = q.shape
    nc = consumers(d) if n_consumers is None else n_consumers
    if nc not in REGISTERS or (nc == 3 and d > 80):
        raise ValueError(f"n_consumers={n_consumers!r} at head dim {d}: 2, or 3 up to head dim 80")
    maxnreg, consumer_regs = REGISTERS[nc]
    sk = k.shape[2]
    if even_k and sk % BLOCK_N:
        raise ValueError(f"even_k=True needs a key count that is a multiple of {BLOCK_N}, not {sk}")
    d_lo, d_hi, has_hi = split_head_dim(d)
    out = output_like(q)
    qd, kd, vd, od = (_descriptors(t, r, d_lo, d_hi) for t, r in ((q, BLOCK_M), (k, BLOCK_N), (v, BLOCK_N),
                                                                   (out, BLOCK_M)))
    qk_scale = (d ** -0.5 if scale is None else float(scale)) * math.log2(math.e)
    grid = (triton.cdiv(sq, nc * BLOCK_M), b * h)
    with torch.cuda.device(q.device):
        _kernel()._attn_wgmma_fwd[grid](*qd, *kd, *vd, *od, h, sk, qk_scale, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                                        NS=STAGES, HAS_HI=has_hi, EVEN_K=even_k, NC=nc,
                                        CONSUMER_REGS=consumer_regs, num_warps=4, maxnreg=maxnreg)
    return out
