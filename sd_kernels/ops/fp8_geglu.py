"""The GEGLU feed-forward's first FP8 GEMM with the GEGLU in its epilogue: half the output written.

diffusers' GEGLU projects x [M, K] to 2F columns and keeps ``a · gelu(g)``, a the first F columns and g the last F.
As two kernels (ops/fp8_linear.py's GEMM, then ops/fp8_quant.py's quantizer with the GEGLU fused) the GEMM writes
all 2F columns and the quantizer reads them back: at SDXL's 1,024-token level (M = 2,048 rows with guidance, 2F =
10,240) 42 MB each way at each of 60 calls a step, at its 4,096-token level 84 MB at each of 10. Here one
program owns the same F-column range of both halves: rows [n, n + BLOCK_N) of the weight and rows F + n onward,
one [2 · BLOCK_N]-column product whose accumulator's halves are a's and g's, and its epilogue stores

    h = (acc_a · s_a · s_w[a] + b[a]) · gelu(acc_g · s_a · s_w[g] + b[g])

in the output dtype: F columns, not 2F. The row quantization of h for the second GEMM still needs each row's
maximum over all F columns, which no tile sees; ops/fp8_quant.py's ``quantize_rows`` reads h once, half of what it
read before. The weight stays as diffusers lays it out (nn.Linear's [2F, K], the a rows first), read through a
three-dimensional tensor descriptor of it as [2, F, K]: nothing is interleaved or copied.

Numerics (``reference.fp8_gemm_geglu``): a and g are not rounded to the output dtype before the product, h is;
the two-kernel path rounds a and g and keeps h in fp32 up to its codes. Both are within the output dtype's
rounding of each other; the tests compare each with a float64 reference of the quantized computation.

The operands come in through the Tensor Memory Accelerator (Hopper and later, and Triton's interpreter), in
persistent programs or one tile a program as the tables choose. ``geglu_rows`` is the feed-forward's one decision
(patches/fp8.py): where ``geglu_epilogue_reason`` gives a reason or the TMA unit cannot read the input's codes, it
runs the two kernels.

It is off by default (``GEGLU_EPILOGUE``): it halves the traffic between the GEMM and the quantizer, and alone the
pair measured 2-9% faster than the two kernels at SD's shapes, but inside SDXL's and SD1.5's graphed steps the GEMM
with this epilogue cost more than the quantizer saved (docs/fp8.md, "The GEGLU epilogue").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sd_kernels import profiles, reference
from sd_kernels.ops.fp8_linear import _check_gemm, _programs, _scratch_allocator, _tma_ready, fp8_gemm, input_codes
from sd_kernels.ops.fp8_quant import _activate, _rows_view, fp8_reason, quantize_rows
from sd_kernels.ops.layout import vectors
from sd_kernels.ops.tiles import grouped_tile
from sd_kernels.runtime.dispatch import backend, device_reason, interpreting, use_kernel
from sd_kernels.runtime.launch import Launcher, cdiv

# Off: the feed-forward runs the GEMM and the GEGLU quantizer apart. Alone, at SDXL's two GEGLU shapes, this kernel
# and the quantizer took 105.0 and 72.0 µs against the two-kernel path's 106.3 and 73.5; in SDXL's graphed FP8 step
# the GEGLU GEMMs took 5.5 ms against the plain ones' 3.7 (and 1.1 ms of quantizer saved), the step 29.2 against
# 28.5 ms (H200, 2026-11-30, bench/results/2026-11-30-h200-unet-fp8-geglu-scaled-mm, both with every GEMM on our
# Triton kernels). True: bench.fp8's fp8+geglu-epilogue row.
GEGLU_EPILOGUE = False


def _config(m: int, n: int, warps: int, stages: int, persistent: bool, flatten: bool, k: int = 128) -> triton.Config:
    return triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 8, "PERSISTENT": persistent,
                          "FLATTEN": flatten}, num_warps=warps, num_stages=stages)


# BLOCK_N is the width of h a tile stores: each K step multiplies the A tile by 2 · BLOCK_N weight rows, so the
# 128 × 128 tiles do the work and hold the registers of ops/fp8_linear.py's 128 × 256 ones. Persistent programs
# first: one tile a program measured 1.2-2x slower at SD's shapes (H200, 2026-11-30).
CONFIGS = [_config(128, 128, 8, 3, True, True), _config(128, 64, 8, 4, True, True),
           _config(128, 128, 8, 3, False, False), _config(128, 64, 8, 4, False, False)]
# the interpreter's one config: two row tiles and two K steps at the tests' odd shapes, few programs elsewhere
_INTERPRETED = _config(64, 32, 4, 1, True, True, k=32)
_KEY = ["M", "F", "K", "HAS_BIAS", "ACT"]


def _autotune():
    if interpreting():
        return triton.autotune([_INTERPRETED], key=_KEY)
    return triton.autotune(CONFIGS, key=_KEY)


@_autotune()
@triton.jit
def _fp8_geglu_tma_kernel(
    a_ptr, w_ptr, sa_ptr, sw_ptr, b_ptr, y_ptr, M, F, K, stride_am, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PERSISTENT: tl.constexpr, FLATTEN: tl.constexpr,
):
    """Tiles [BLOCK_M, BLOCK_N] of h [M, F] from a_q [M, K] and w_q [2F, K] (e4m3, both K-major). The weight
    is read as [2, F, K]: one TMA load brings a tile's BLOCK_N rows of both halves, [2, BLOCK_N, BLOCK_K], which
    is the [2 · BLOCK_N, BLOCK_K] operand of one tensor-core product (two products, one a half, measured 10-30%
    slower: the second waited for the first). ``PERSISTENT``: one program per SM takes every grid-th tile;
    ``FLATTEN``: the next tile's loads are issued under this one's epilogue."""
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[stride_am, 1], block_shape=[BLOCK_M, BLOCK_K])
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[2, F, K], strides=[F * stride_wn, stride_wn, 1],
                                       block_shape=[2, BLOCK_N, BLOCK_K])
    tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(F, BLOCK_N)
    k_steps = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), tiles, tl.num_programs(0), flatten=FLATTEN):
        pid_m, pid_n = grouped_tile(tile, M, F, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
        for k in range(k_steps):
            a = a_desc.load([pid_m * BLOCK_M, k * BLOCK_K])
            w = w_desc.load([0, pid_n * BLOCK_N, k * BLOCK_K]).reshape(2 * BLOCK_N, BLOCK_K)
            acc = tl.dot(a, w.T, acc)
        # columns [0, BLOCK_N) of acc are a's, [BLOCK_N, 2 · BLOCK_N) g's
        acc_a, acc_g = tl.split(acc.reshape(BLOCK_M, 2, BLOCK_N).permute(0, 2, 1))
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = (offs_m % M).to(tl.int64)  # edge rows and columns read wrapped and are not stored
        cols = (offs_n % F).to(tl.int64)
        s_a = tl.load(sa_ptr + rows)[:, None]
        ya = acc_a * s_a * tl.load(sw_ptr + cols)[None, :]
        yg = acc_g * s_a * tl.load(sw_ptr + F + cols)[None, :]
        if HAS_BIAS:
            ya += tl.load(b_ptr + cols).to(tl.float32)[None, :]
            yg += tl.load(b_ptr + F + cols).to(tl.float32)[None, :]
        h = ya * _activate(yg, ACT)
        y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
        tl.store(y_ptrs, h.to(y_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < F))


_GEGLU = Launcher(_fp8_geglu_tma_kernel)


def geglu_epilogue_reason(x: torch.Tensor, w_q: torch.Tensor) -> str | None:
    """Why the GEGLU feed-forward whose input is ``x`` [..., K] and first weight's codes ``w_q`` [2F, K] does not
    take ``fp8_gemm_geglu`` (None: it may, ``geglu_rows`` deciding on the input's codes): ``GEGLU_EPILOGUE`` off,
    the reference backend, the active profile's disabled ops, the kernels' own reasons, or a weight the TMA kernel
    cannot read (a GPU before Hopper, K not a multiple of 16)."""
    if not GEGLU_EPILOGUE:
        return "fp8_geglu.GEGLU_EPILOGUE is off"
    if backend() == "reference":
        return "SD_KERNELS_BACKEND=reference"
    if x.device != w_q.device:
        return f"the input on {x.device}, the weight on {w_q.device}"
    reason = (device_reason(x.device) or fp8_reason(x, w_q)
              or profiles.active_profile().disabled_reason("fp8_geglu"))
    if reason is not None:
        return reason
    if w_q.dim() != 2 or w_q.shape[0] % 2 or x.shape[-1] != w_q.shape[1]:
        return f"weight codes {tuple(w_q.shape)} are not a GEGLU projection of {x.shape[-1]} features"
    if not _tma_ready(w_q[:1], w_q):
        return "the TMA kernel cannot read the weight (Hopper or later, 16-byte aligned rows)"
    return None


def geglu_rows(x: torch.Tensor, w_q: torch.Tensor, s_w: torch.Tensor, bias: torch.Tensor | None,
               act: str) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' GEGLU of the FP8 projection (w_q, s_w, bias) of x, ``a · gelu(g)`` with a and g its output's
    halves, as the codes and row scales the next GEMM reads: x's carried codes (or its quantization), then
    ``fp8_gemm_geglu`` and the row quantizer where ``geglu_epilogue_reason`` and the TMA kernel take the codes;
    else the GEMM writing both halves and the GEGLU quantizer."""
    q, s = input_codes(x)
    if geglu_epilogue_reason(x, w_q) is None and _tma_ready(_rows_view(q), w_q):
        return quantize_rows(fp8_gemm_geglu(q, s, w_q, s_w, bias, act, x.dtype))
    return quantize_rows(fp8_gemm(q, s, w_q, s_w, bias, out_dtype=x.dtype), act, gated=True)


def fp8_gemm_geglu(a_q: torch.Tensor, s_a: torch.Tensor, w_q: torch.Tensor, s_w: torch.Tensor,
                   bias: torch.Tensor | None = None, act: str = "none",
                   out_dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """``reference.fp8_gemm_geglu``: a_q [..., K] (rows any stride, columns unit), w_q [2F, K] → h [..., F] in
    ``out_dtype``, a new contiguous tensor; ``act`` the GELU's approximation ("none": erf, "tanh")."""
    if act not in ("none", "tanh"):
        raise ValueError(f"fp8_gemm_geglu: act must be 'none' or 'tanh' (the GELU's approximation), got {act!r}")
    if w_q.dim() != 2 or w_q.shape[0] % 2:
        raise ValueError(f"fp8_gemm_geglu: w_q [2F, K] needs an even number of rows, got {tuple(w_q.shape)}")
    m, f, k = s_a.numel(), w_q.shape[0] // 2, w_q.shape[1]
    _check_gemm(a_q, s_a, w_q, s_w, bias, None, (*a_q.shape[:-1], f), out_dtype)
    a2 = _rows_view(a_q)
    reason = (fp8_reason(a_q, s_a, w_q, s_w, bias) or device_reason(a_q.device)
              or ("no input features (K = 0)" if k == 0 else None))
    if reason is None and not _tma_ready(a2, w_q):
        reason = "operands the TMA kernel cannot read (Hopper or later; unit column stride, 16-byte aligned rows)"
    if not use_kernel("fp8_geglu", a_q, w_q, bias, unsupported=reason):
        return reference.fp8_gemm_geglu(a_q, s_a, w_q, s_w, bias, act, out_dtype)
    y = torch.empty((*a_q.shape[:-1], f), dtype=out_dtype, device=a_q.device)
    if y.numel() == 0:
        return y
    sa, s_w, bias = vectors(s_a.reshape(-1).float(), s_w, bias)
    key = (m, f, k, bias is not None, act, out_dtype)
    programs = _programs(y.device)
    tiles = lambda meta: cdiv(m, meta["BLOCK_M"]) * cdiv(f, meta["BLOCK_N"])  # noqa: E731
    grid = lambda meta: (min(programs, tiles(meta)) if meta["PERSISTENT"] else tiles(meta),)  # noqa: E731
    with _scratch_allocator(y.device):
        _GEGLU(key, grid, a2, w_q, sa, s_w, y if bias is None else bias, y, m, f, k, a2.stride(0), w_q.stride(0),
               f, HAS_BIAS=bias is not None, ACT=act)
    return y
