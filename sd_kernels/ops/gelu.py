"""GELU, GEGLU and a matmul with a GEGLU epilogue: one read of the input, one write of the output.

The paper's point about GELU: written with built-in ops, the tanh form is 8 kernels, 7 intermediate
tensors and 3 reads of x; fused it is 1 read and 1 write. Here one elementwise kernel body serves
``gelu`` (y = act(x)), ``quick_gelu`` (x·sigmoid(1.702x), diffusers' ApproximateGELU) and ``geglu``
(y = a·gelu(gate) with a, gate = h[..., :n], h[..., n:], read in place: no chunk copies).
``linear_geglu`` goes one step further: a matmul with two accumulators (rows j and n+j of the
weight) whose epilogue applies the GEGLU, so the 2n-wide projection never reaches memory.

All math is in fp32, cast at the store. Inference only: inputs that need autograd take the
reference. Layouts: dense tensors of any stride order (contiguous, channels_last, permuted) run
flat over their storage and keep their strides; other strided tensors run as a [rows, last] view
with arbitrary row and column strides; only tensors that cannot be viewed so (e.g. a transposed
non-dense slice) cost one copy.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from sd_kernels import profiles, reference
from sd_kernels.ops.layout import check_writable, contiguous_strides, is_dense, vectors
from sd_kernels.runtime.dispatch import backend, interpreting, keep_plan, plan_context, tensor_reason, use_kernel
from sd_kernels.runtime.launch import Launcher, cdiv, next_pow2

_ELEMS = 4096  # elements per elementwise program: 8 KiB of fp16 in flight per input, 16 per thread

# constexpr: Triton kernels may only read globals so marked.
# Written tensor-first in the kernels (x * C): the interpreter's constexpr * tensor is a constexpr.
_NEG_LOG2E = tl.constexpr(-1.4426950408889634)
_NEG_1702_LOG2E = tl.constexpr(-1.702 * 1.4426950408889634)
_SQRT1_2 = tl.constexpr(0.7071067811865476)
_TWO_SQRT_2_OVER_PI = tl.constexpr(2.0 * math.sqrt(2.0 / math.pi))


@triton.jit
def _act(x, ACT: tl.constexpr):
    """The activation of fp32 ``x``: "none" (erf GELU), "tanh" (tanh GELU), "sigmoid" (x·σ(1.702x))."""
    if ACT == "none":
        return 0.5 * x * (1.0 + tl.erf(x * _SQRT1_2))
    elif ACT == "tanh":
        # tanh(u) = 1 − 2/(exp(2u) + 1), so 0.5·(1 + tanh(u)) = 1/(1 + exp(−2u)): one exp2, no
        # libdevice tanh, and exact limits: exp2 → inf gives x/inf = −0, exp2 → 0 gives x.
        u2 = (x + 0.044715 * x * x * x) * _TWO_SQRT_2_OVER_PI
        return x / (1.0 + tl.exp2(u2 * _NEG_LOG2E))
    else:
        return x / (1.0 + tl.exp2(x * _NEG_1702_LOG2E))


@triton.jit(do_not_specialize=["n_rows"])  # rows are masked per row: vectors run along the columns
def _elementwise_kernel(
    x_ptr, y_ptr, n_rows, n_cols, stride_xr, stride_xc, stride_yr,
    GATED: tl.constexpr, ACT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """y[r, c] = act(x[r, c]), or with GATED: y[r, c] = x[r, c] · act(x[r, n_cols + c]).

    One program per [BLOCK_R, BLOCK_C] tile of y; a 1-D grid (split by division) so that neither
    rows nor column blocks run into the 65,535 limit of the grid's second axis. A dense tensor runs
    as one row of numel columns.
    """
    pid = tl.program_id(0)
    n_col_blocks = tl.cdiv(n_cols, BLOCK_C)
    pid_r = pid // n_col_blocks
    pid_c = pid % n_col_blocks
    # int64: flat offsets of a dense tensor, and rows·stride, pass 2^31 on large activations.
    rows = pid_r.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_c.to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    x_ptrs = x_ptr + rows[:, None] * stride_xr + cols[None, :] * stride_xc
    if GATED:
        a = tl.load(x_ptrs, mask=mask).to(tl.float32)
        gate = tl.load(x_ptrs + n_cols * stride_xc, mask=mask).to(tl.float32)
        y = a * _act(gate, ACT)
    else:
        y = _act(tl.load(x_ptrs, mask=mask).to(tl.float32), ACT)
    tl.store(y_ptr + rows[:, None] * stride_yr + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


def elementwise_blocks(n_rows: int, n_cols: int, elems: int = _ELEMS) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_C, num_warps) for an elementwise [n_rows, n_cols] launch.

    BLOCK_C is the widest power of two that wastes at most 1/8 of a row to padding (SD's 1280,
    2560, 5120 get 256, 512, 1024: no masked lanes); the rest of the ``elems`` budget goes to rows.
    """
    block_c = min(next_pow2(n_cols), elems)
    while block_c > 64 and cdiv(n_cols, block_c) * block_c - n_cols > n_cols // 8:
        block_c //= 2
    block_r = max(1, min(elems // block_c, next_pow2(n_rows)))
    return block_r, block_c, 8 if block_r * block_c >= 4096 else 4


# Not autotuned: the Launcher is here for its direct launch path (sd_kernels.runtime.launch), keyed by the blocks.
_ELEMENTWISE = Launcher(_elementwise_kernel)


def _elementwise_launch(n_rows: int, n_cols: int, gated: bool, act: str) -> tuple[tuple, tuple, dict]:
    """(launcher key, grid, meta-parameters) of an elementwise launch over [n_rows, n_cols]."""
    block_r, block_c, num_warps = elementwise_blocks(n_rows, n_cols)
    grid = (cdiv(n_rows, block_r) * cdiv(n_cols, block_c),)
    meta = dict(GATED=gated, ACT=act, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=num_warps)
    return (gated, act, block_r, block_c, num_warps), grid, meta


def _launch_elementwise(x2: torch.Tensor, y2_ptr: torch.Tensor, n_rows: int, n_cols: int,
                        stride_xr: int, stride_xc: int, stride_yr: int, gated: bool, act: str) -> None:
    key, grid, meta = _elementwise_launch(n_rows, n_cols, gated, act)
    _ELEMENTWISE(key, grid, x2, y2_ptr, n_rows, n_cols, stride_xr, stride_xc, stride_yr, **meta)


def _alloc(shape, stride, like: torch.Tensor) -> torch.Tensor:
    """Every output of this module comes from here (tests poison it to catch unwritten elements)."""
    return torch.empty_strided(tuple(shape), tuple(stride), dtype=like.dtype, device=like.device)


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """x as a 2-D [rows, last] view with any row and column stride; one copy only if no view exists."""
    x = x.reshape(1) if x.dim() == 0 else x
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:  # leading dims that do not collapse into one row stride
        return x.reshape(-1, x.shape[-1])


def _activation(x: torch.Tensor, act: str) -> torch.Tensor:
    if is_dense(x):  # flat over storage; the output keeps x's strides (channels_last stays so)
        y = _alloc(x.shape, x.stride(), x)
        if x.numel():
            _launch_elementwise(x, y, 1, x.numel(), 0, 1, 0, gated=False, act=act)
        return y
    y = _alloc(x.shape, contiguous_strides(x.shape), x)
    if x.numel():
        x2 = _as_rows(x)
        _launch_elementwise(x2, y, x2.shape[0], x2.shape[1], x2.stride(0), x2.stride(1), x2.shape[1],
                            gated=False, act=act)
    return y


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``F.gelu(x, approximate)`` in one kernel: "none" is the exact erf GELU, "tanh" the approximation."""
    reference.check_gelu_approximation(approximate)
    if not use_kernel("gelu", x, unsupported=tensor_reason(x)):
        return reference.gelu(x, approximate)
    return _activation(x, approximate)


def gelu_into(x: torch.Tensor, out: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``out.copy_(F.gelu(x, approximate))`` in one kernel, written in place: ``out`` of x's shape and
    dtype, its last dim contiguous and its rows at any stride (a slice of a wider buffer, e.g. the input
    of a projection that a concatenation would otherwise build). Returns ``out``."""
    reference.check_gelu_approximation(approximate)
    if out.shape != x.shape or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(f"gelu_into: out {tuple(out.shape)} {out.dtype} on {out.device} must match x "
                         f"{tuple(x.shape)} {x.dtype} on {x.device}")
    check_writable("gelu_into", out=out)
    try:
        rows = out.view(-1, out.shape[-1]) if x.dim() else None
    except RuntimeError:
        rows = None
    unsupported = tensor_reason(x) or (None if rows is not None and rows.stride(1) == 1 else
                                       "out's rows are not one stride apart with a contiguous last dim")
    if not use_kernel("gelu", x, out, unsupported=unsupported):
        return out.copy_(reference.gelu(x, approximate))
    if x.numel():
        x2 = _as_rows(x)
        _launch_elementwise(x2, rows, x2.shape[0], x2.shape[1], x2.stride(0), x2.stride(1), rows.stride(0),
                            gated=False, act=approximate)
    return out


def reference_quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """diffusers' ApproximateGELU activation, as it computes it."""
    return x * torch.sigmoid(1.702 * x)


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """``x · sigmoid(1.702 x)`` (diffusers' ApproximateGELU after its projection) in one kernel."""
    if not use_kernel("gelu", x, unsupported=tensor_reason(x)):
        return reference_quick_gelu(x)
    return _activation(x, "sigmoid")


def geglu(h: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``a · gelu(gate)`` with ``a, gate = h.chunk(2, -1)``: h [..., 2n] → [..., n], h read once.

    A call like an earlier kernel call (``_geglu_key``) launches that call's plan directly.
    """
    reference.check_gelu_approximation(approximate)
    reference.check_geglu_input(h)
    key = _geglu_key(h, approximate)
    plan = _GEGLU_PLANS.get(key)
    if plan is not None:
        return plan(h)
    if not use_kernel("geglu", h, unsupported=tensor_reason(h)):
        return reference.geglu(h, approximate)
    n = h.shape[-1] // 2
    out_shape = (*h.shape[:-1], n)
    y = _alloc(out_shape, contiguous_strides(out_shape), h)
    if y.numel():
        h2 = _as_rows(h)
        plan = _GegluPlan(out_shape, y.stride(), h2, n, approximate)
        plan.launch(h2, y)
        if h2.data_ptr() == h.data_ptr():  # a view of h, not _as_rows' copy: the plan may launch on h
            keep_plan(_GEGLU_PLANS, key, plan)
    return y


class _GegluPlan:
    """A geglu launch derived from h's metadata: the output's shape and strides, h's [rows, 2n] view's
    sizes and strides, the launch's key, grid and blocks. ``launch`` takes h or that view (the same
    address: Triton reads nothing of a tensor argument but its address and dtype)."""

    __slots__ = ("out_shape", "out_stride", "args", "key", "grid", "meta", "profile")

    def __init__(self, out_shape: tuple[int, ...], out_stride: tuple[int, ...], h2: torch.Tensor, n: int,
                 approximate: str) -> None:
        self.out_shape, self.out_stride = out_shape, out_stride
        self.args = (h2.shape[0], n, h2.stride(0), h2.stride(1), n)
        self.key, self.grid, self.meta = _elementwise_launch(h2.shape[0], n, True, approximate)
        self.profile = None  # a cached plan holds the profile its key names by id (so the id stays its)

    def launch(self, h: torch.Tensor, y: torch.Tensor) -> None:
        _ELEMENTWISE(self.key, self.grid, h, y, *self.args, **self.meta)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        y = _alloc(self.out_shape, self.out_stride, h)
        self.launch(h, y)
        return y


# Plans per call signature, as for attention (ops/attention.py): the key holds everything geglu's
# checks, dispatch.use_kernel and the plan read (h's shape, strides, dtype and device, the
# approximation, whether autograd would track h, the active profile by identity, SD_KERNELS_BACKEND,
# TRITON_INTERPRET for CPU tensors); not h's address (Triton specializes on its alignment). Calls that
# fall back to the reference are never cached: use_kernel sees, logs and counts each of them.
_GEGLU_PLANS: dict[tuple, _GegluPlan] = {}


def _geglu_key(h: torch.Tensor, approximate: str) -> tuple:
    return (h.shape, h.stride(), h.dtype, h.device, approximate, h.requires_grad and torch.is_grad_enabled(),
            *plan_context(h))


# ---------------------------------------------------------------------------------------------
# linear + GEGLU: y = (x Waᵀ + ba) · gelu(x Wgᵀ + bg), Wa = weight[:n], Wg = weight[n:]


def _config(m: int, n: int, k: int, warps: int, stages: int) -> triton.Config:
    tiles = {"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 8}
    return triton.Config(tiles, num_warps=warps, num_stages=stages)


# Two fp32 accumulators per program: a 128×128 tile holds 2·64 accumulator registers per thread at
# 8 warps; smaller tiles serve small M (SD's 512 rows). All compile for sm_90 to wgmma with cp.async
# pipelining, 177-213 registers and no spills (checked offline with triton.compile + cuobjdump).
_HALF_CONFIGS = [_config(128, 128, 64, 8, 3), _config(128, 128, 32, 8, 4), _config(128, 64, 64, 4, 4),
                 _config(64, 128, 64, 4, 4), _config(64, 64, 64, 4, 4)]
# fp32 takes IEEE FMA dots (no tensor cores), twice the shared memory per tile and spills on the
# tiles above: two small tiles that do not.
_FP32_CONFIGS = [_config(64, 64, 32, 8, 3), _config(32, 64, 32, 4, 3)]


def _prune_by_dtype(configs, named_args, **kwargs):
    wanted = _FP32_CONFIGS if named_args["x_ptr"].dtype == torch.float32 else _HALF_CONFIGS
    return [c for c in configs if any(c is w for w in wanted)]


def _linear_geglu_autotune():
    if interpreting():  # the interpreter would run every config: one small one
        return triton.autotune([_config(32, 32, 32, 4, 1)], key=["M", "N", "K", "HAS_BIAS", "ACT"])
    return triton.autotune(_HALF_CONFIGS + _FP32_CONFIGS, key=["M", "N", "K", "HAS_BIAS", "ACT"],
                           prune_configs_by={"early_config_prune": _prune_by_dtype})


@_linear_geglu_autotune()
@triton.jit
def _linear_geglu_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_ym,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile of y [M, N] from x [M, K] and weight [2N, K] (nn.Linear layout)."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # Grouped order: GROUP_M row tiles in a row sweep the same weight tiles while they sit in L2.
    group = GROUP_M * num_pid_n
    first_m = (pid // group) * GROUP_M
    group_m = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % group_m
    pid_n = (pid % group) // group_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Edge tiles wrap (% M, % N) instead of masking the loads; only the store is masked.
    rows = (offs_m % M).to(tl.int64)
    wrows = (offs_n % N).to(tl.int64)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk
    wa_ptrs = w_ptr + wrows[None, :] * stride_wn + offs_k[:, None] * stride_wk  # [BLOCK_K, BLOCK_N] of Waᵀ
    wg_ptrs = wa_ptrs + N * stride_wn  # the gate's rows n + j of the same weight

    acc_a = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        xt = tl.load(x_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        wa = tl.load(wa_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        wg = tl.load(wg_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        acc_a = tl.dot(xt, wa, acc_a, input_precision=PRECISION)
        acc_g = tl.dot(xt, wg, acc_g, input_precision=PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        wa_ptrs += BLOCK_K * stride_wk
        wg_ptrs += BLOCK_K * stride_wk

    n_mask = offs_n < N
    if HAS_BIAS:
        acc_a += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        acc_g += tl.load(b_ptr + N + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y = acc_a * _act(acc_g, ACT)
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & n_mask[None, :])


def reference_linear_geglu(x, weight, bias=None, approximate: str = "none") -> torch.Tensor:
    """``geglu(F.linear(x, weight, bias))``: what diffusers' GEGLU computes, projection included."""
    return reference.geglu(F.linear(x, weight, bias), approximate)


def _check_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if weight.dim() != 2:
        raise ValueError(f"linear_geglu needs a 2-D weight [2n, K], got shape {tuple(weight.shape)}")
    if x.dim() == 0 or x.shape[-1] != weight.shape[1]:
        rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
        raise RuntimeError(  # torch's own message for F.linear
            f"mat1 and mat2 shapes cannot be multiplied ({rows}x{x.shape[-1] if x.dim() else 1} and "
            f"{weight.shape[1]}x{weight.shape[0]})"
        )
    if weight.shape[0] % 2:
        raise ValueError(f"linear_geglu needs an even number of output features, got {weight.shape[0]}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    dtypes = sorted({str(t.dtype) for t in (x, weight, bias) if t is not None})
    if len(dtypes) > 1:
        raise RuntimeError(f"linear_geglu needs one dtype for x, weight and bias, got {dtypes}")


_LINEAR_GEGLU = Launcher(_linear_geglu_kernel)


def linear_geglu(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, approximate: str = "none"
) -> torch.Tensor:
    """``geglu(F.linear(x, weight, bias), approximate)`` with the GEGLU fused into the matmul's epilogue.

    x [..., K], weight [2n, K], bias [2n] → [..., n]; the [..., 2n] projection is never written.
    """
    reference.check_gelu_approximation(approximate)
    _check_linear(x, weight, bias)
    # K = 0: torch's linear gives the bias alone; the kernel's row view of x needs K > 0
    empty = "no input features (K = 0)" if weight.shape[1] == 0 else None
    if not use_kernel("linear_geglu", x, weight, bias, unsupported=empty or tensor_reason(x, weight, bias)):
        return reference_linear_geglu(x, weight, bias, approximate)
    (bias,) = vectors(bias)
    K, n = weight.shape[1], weight.shape[0] // 2
    x2 = _as_rows(x)
    M = x2.shape[0]
    out_shape = (*x.shape[:-1], n)
    y = _alloc(out_shape, contiguous_strides(out_shape), x)
    if y.numel() == 0:
        return y
    if K == 0:
        return y.copy_(reference_linear_geglu(x, weight, bias, approximate))
    # fp32 inputs: IEEE fp32 products like torch's default, not TF32 (which Triton would pick).
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    grid = lambda meta: (cdiv(M, meta["BLOCK_M"]) * cdiv(n, meta["BLOCK_N"]),)
    # The key holds what the autotuner keys on (M, N, K, HAS_BIAS, ACT) and what its pruning reads (the
    # dtype); the tuned choice ships in the tables like every Launcher kernel's (so a dry run compiles it).
    _LINEAR_GEGLU(
        (M, n, K, bias is not None, approximate, x.dtype, precision), grid,
        x2, weight, weight if bias is None else bias, y, M, n, K,
        x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1), n,
        HAS_BIAS=bias is not None, ACT=approximate, PRECISION=precision,
    )
    return y


@torch.compiler.assume_constant_result
def _profile_epilogue_reason() -> str:
    """What the environment and the active profile say against the GELU epilogue ("" for nothing):
    read when torch.compile traces, a constant of the compiled graph like ``fuse_linear_geglu``."""
    if backend() == "reference":
        return "SD_KERNELS_BACKEND=reference"
    profile = profiles.active_profile()
    if not profile.gelu_epilogue:
        return f"profile {profile.name!r} does not set gelu_epilogue"
    return profile.disabled_reason("linear_gelu") or ""


def gelu_epilogue_reason(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         approximate: str) -> str | None:
    """Why ``linear_gelu`` cannot take cuBLASLt's GELU epilogue for this call, or None (it can).

    The epilogue is the tanh GELU, on CUDA only (``torch._addmm_activation`` applies the erf GELU on
    the CPU), with the bias added before it, in half precision only (in fp32 its GELU measured 2.0e-6
    relative error on the H100 where cuBLAS + F.gelu make 8e-8: fine below fp16's rounding, not at
    fp32's); the active profile decides whether it is worth it
    (``Profile.gelu_epilogue``; ``disabled_ops: ["linear_gelu"]`` turns it off); the reference
    backend never takes it, and neither do inputs autograd tracks. Reads metadata only."""
    if approximate != "tanh":
        return f"approximate={approximate!r} (the epilogue is the tanh GELU)"
    if bias is None:
        return "no bias (the epilogue adds one)"
    if not (x.is_cuda and weight.is_cuda and bias.is_cuda):
        return "not on a CUDA device"
    if x.dtype not in (torch.float16, torch.bfloat16):  # fp32: the epilogue's tanh measured 25x stock's error
        return f"dtype {x.dtype} (the epilogue is taken for float16 and bfloat16)"
    return _profile_epilogue_reason() or tensor_reason(x, weight, bias)


def linear_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                approximate: str = "none", activation=None) -> torch.Tensor:
    """``gelu(F.linear(x, weight, bias), approximate)``: diffusers' GELU module, projection included.

    x [..., K], weight [n, K], bias [n] → [..., n]. Where ``gelu_epilogue_reason`` finds nothing
    against it, one cuBLASLt matmul whose epilogue adds the bias and applies the tanh GELU on the fp32
    accumulator (``torch._addmm_activation``, which torch.compile keeps as one ATen call): the
    [..., n] projection is written once, as the activation, and never read back. Otherwise cuBLAS's
    linear, then ``activation`` (default: our ``gelu`` kernel; sd_kernels.ops.custom_ops passes its custom
    op). Not a Triton kernel: a choice between two library routes."""
    reference.check_gelu_approximation(approximate)
    if gelu_epilogue_reason(x, weight, bias, approximate) is not None:
        return (activation or gelu)(F.linear(x, weight, bias), approximate)
    rows = x.reshape(-1, x.shape[-1])  # a view of a contiguous x (DiT tokens): no copy
    return torch._addmm_activation(bias, rows, weight.t(), use_gelu=True).view(*x.shape[:-1], weight.shape[0])
