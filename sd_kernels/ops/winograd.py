"""Winograd F(m×m, 3×3) convolution: 3×3, stride 1, padding 1, in three Triton kernels.

y = Aᵀ [ (G g Gᵀ) ⊙ (Bᵀ d B) ] A computes an m×m output tile from an α×α input tile (α = m + 2)
with α² multiplies instead of 9m². Summed over input channels, the elementwise product becomes α²
independent GEMMs, which is where the tensor cores come in:

1. input transform (``_input_transform_kernel``): V[ξ, t, c] = (Bᵀ d_{t,c} B)[ξ] for every tile t
   and channel c, in fp32, stored in the input's dtype (fp16/bf16/fp32);
2. batched GEMM (``_batched_gemm_kernel``, or ``torch.bmm`` for comparison):
   M[ξ] = V[ξ] · U[ξ] with U[ξ] = (G g Gᵀ)[ξ] ∈ [C, K] (``winograd_weight``, computed once, in
   float64), fp32 accumulation, M stored in fp32;
3. output transform (``_output_transform_kernel``): y = Aᵀ M_{t,k} A + bias, masked at the image edge.

``_fused_gemm_output_kernel`` (experimental, tiles 2 and 4, ``_winograd(..., gemm="fused")``) runs
steps 2 and 3 as one kernel, so M never reaches memory; the benchmark decides whether it becomes the
default.

Both transforms are one small matmul per block of (tile, channel) pairs: the α×α tile flattened to
α² values is multiplied by kron(Bᵀ, Bᵀ) (α²×α²) or kron(Aᵀ, Aᵀ) (m²×α²) on the tensor cores. That
does more multiply-adds than the separable Bᵀ·d·B, but needs no per-thread register arrays (Triton
has none) and runs on tensor cores. It is exact in fp32: fp16/bf16 inputs and the transform entries
of tiles 2 and 6 are exact in tf32 (≤ 11 significant bits), so one tf32 MMA with fp32 accumulation
computes the fp32 transform; where an operand is not (fp32 data, fp32 M, tile 4's thirds, tile 8's
wider products) "tf32x3" (three tf32 MMAs) recovers fp32 accuracy.

The matrices are built from interpolation points (``POINTS``) with the Cook–Toom construction in
exact rational arithmetic, then rescaled by powers of two (exact) so that every row of Bᵀ and G has
an absolute sum in (1/2, 1]: V and U can then never overflow fp16 where x and the weights do not.
The points are chosen for fp16 error (docs/kernels/winograd.md has the table and the search).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import math
from fractions import Fraction

import torch
import triton
import triton.language as tl

from sd_kernels import reference
from sd_kernels.ops.conv import check_operands
from sd_kernels.ops.layout import is_channels_last, vectors
from sd_kernels.ops.weight_cache import DerivedWeights, find
from sd_kernels.runtime.dispatch import KERNEL_DTYPES, interpreting, use_kernel
from sd_kernels.runtime.launch import AUTOTUNE, Launcher, cdiv, next_pow2

R = 3  # filter size

# Finite interpolation points per output tile m (α − 1 = m + 1 of them; the point at infinity is
# implied). Chosen by fp16 error of the whole conv (emulated, float64 oracle), see the docs:
# tile 4 uses the reciprocal pairs ±3/2, ±2/3, 2.3× less error than Lavin & Gray's 0, ±1, ±2.
_F = Fraction
POINTS: dict[int, tuple[Fraction, ...]] = {
    2: (_F(0), _F(1), _F(-1)),
    4: (_F(0), _F(3, 2), _F(-3, 2), _F(2, 3), _F(-2, 3)),
    6: (_F(0), _F(1), _F(-1), _F(2), _F(-2), _F(1, 2), _F(-1, 2)),
    8: (_F(0), _F(1), _F(-1), _F(2), _F(-2), _F(1, 2), _F(-1, 2), _F(3, 4), _F(-3, 4)),
}
TILES = tuple(POINTS)


# ----------------------------------------------------------------------------------------------
# The algebra: Cook–Toom matrices from the points
# ----------------------------------------------------------------------------------------------

def _poly_from_roots(roots: list[Fraction]) -> list[Fraction]:
    """Coefficients (ascending powers) of ∏ (x − r)."""
    coeffs = [Fraction(1)]
    for r in roots:
        shifted = [Fraction(0)] + coeffs  # x · p
        coeffs = [s - r * c for s, c in zip(shifted, coeffs + [Fraction(0)])]
    return coeffs


def _pow2_scale(row: list[Fraction]) -> Fraction:
    """The power of two that brings the row's absolute sum into (1/2, 1]."""
    total = sum(abs(v) for v in row)
    return Fraction(2) ** -math.ceil(math.log2(total))


@dataclasses.dataclass(frozen=True)
class Transforms:
    """Aᵀ [m, α], G [α, 3], Bᵀ [α, α] (float64) with y = Aᵀ[(G g) ⊙ (Bᵀ d)] for a 1-D tile."""

    tile: int
    points: tuple[Fraction, ...]
    AT: torch.Tensor
    G: torch.Tensor
    BT: torch.Tensor

    @property
    def alpha(self) -> int:
        return self.tile + R - 1


@functools.cache
def winograd_transforms(tile: int) -> Transforms:
    """Cook–Toom (Lavin & Gray) matrices for F(tile, 3), from ``POINTS[tile]`` and the point at ∞.

    Correlation is the transpose of polynomial multiplication, which Toom–Cook computes by evaluating
    at α points (the α − 1 finite ones and ∞, i.e. the leading coefficient), multiplying, and
    interpolating: Aᵀ = E_mᵀ, G = E_3, Bᵀ = E_α⁻ᵀ, with E_n[j, i] = p_jⁱ (E_n's ∞ row picks the
    coefficient of x^(n−1)). Row j of E_α⁻ᵀ is the Lagrange basis polynomial ∏_{l≠j}(x − p_l)/f_j,
    f_j = ∏_{l≠j}(p_j − p_l), and the ∞ row is ∏_l (x − p_l); the 1/f_j moves into G (a diagonal
    scale D between the two factors is free: Bᵀ → D Bᵀ, G → D⁻¹ G). Then powers of two balance the
    ranges (rows of Bᵀ and G get absolute sums in (1/2, 1], Aᵀ's columns take the inverse factors).
    """
    if tile not in POINTS:
        raise ValueError(f"tile must be one of {TILES}, got {tile!r}")
    pts = list(POINTS[tile])
    alpha = tile + R - 1
    assert len(pts) == alpha - 1 and len(set(pts)) == len(pts)

    def evaluation(n: int) -> list[list[Fraction]]:
        return [[p**i for i in range(n)] for p in pts] + [[Fraction(int(i == n - 1)) for i in range(n)]]

    e_m, g = evaluation(tile), evaluation(R)
    bt = []
    for j, pj in enumerate(pts):
        others = pts[:j] + pts[j + 1:]
        bt.append(_poly_from_roots(others) + [Fraction(0)])
        f_j = math.prod((pj - pl for pl in others), start=Fraction(1))
        g[j] = [v / f_j for v in g[j]]
    bt.append(_poly_from_roots(pts))
    at = [list(col) for col in zip(*e_m)]  # [m][α]
    for xi in range(alpha):
        sb, sg = _pow2_scale(bt[xi]), _pow2_scale(g[xi])
        bt[xi] = [v * sb for v in bt[xi]]
        g[xi] = [v * sg for v in g[xi]]
        for row in at:
            row[xi] /= sb * sg

    def f64(rows):
        return torch.tensor([[float(v) for v in row] for row in rows], dtype=torch.float64)

    return Transforms(tile, tuple(pts), f64(at), f64(g), f64(bt))


def _exact_in_tf32(t: torch.Tensor) -> bool:
    """Every entry has at most 11 significant bits (tf32's 10 stored + 1) and is exact in fp32."""
    mant, _ = torch.frexp(t.to(torch.float64))
    scaled = mant * 2**11
    return bool((scaled == scaled.round()).all()) and bool((t.float().double() == t.double()).all())


@dataclasses.dataclass(frozen=True)
class _KernelMats:
    kb: torch.Tensor  # kron(Bᵀ, Bᵀ) zero-padded to [P, P], fp32
    ka: torch.Tensor  # kron(Aᵀ, Aᵀ) zero-padded to [Q, P], fp32
    kb_tf32_exact: bool
    ka_tf32_exact: bool
    P: int
    Q: int


@functools.cache
def _kernel_mats(tile: int, device: torch.device) -> _KernelMats:
    tr = winograd_transforms(tile)
    alpha2, m2 = tr.alpha**2, tile**2
    # tl.dot wants power-of-two dims of at least 16.
    P, Q = max(16, next_pow2(alpha2)), max(16, next_pow2(m2))
    kb = torch.zeros(P, P, dtype=torch.float64)
    kb[:alpha2, :alpha2] = torch.kron(tr.BT, tr.BT)
    ka = torch.zeros(Q, P, dtype=torch.float64)
    ka[:m2, :alpha2] = torch.kron(tr.AT, tr.AT)
    return _KernelMats(kb.float().to(device), ka.float().to(device), _exact_in_tf32(kb), _exact_in_tf32(ka),
                       P, Q)


# ----------------------------------------------------------------------------------------------
# Weights
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class WinogradWeight:
    """Transformed 3×3 weights, accepted by ``winograd_conv2d`` in place of the weight tensor.

    ``u`` is [α², C, K] (row-major [C, K] per ξ: the GEMM's B operand). ``weight`` references the
    original [K, C, 3, 3] tensor (no copy): the reference fallback and the shape checks use it.
    """

    u: torch.Tensor
    tile: int
    weight: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.u.nbytes


def winograd_weight(weight: torch.Tensor, tile: int = 4, dtype: torch.dtype | None = None) -> WinogradWeight:
    """U[ξ] = (G g Gᵀ)[ξ] for every (output, input) channel pair, in float64, stored in ``dtype``
    (default: the weight's). Compute once per weight and pass the result to ``winograd_conv2d``."""
    if weight.dim() != 4 or tuple(weight.shape[-2:]) != (R, R):
        raise ValueError(f"winograd_weight needs a [K, C, 3, 3] weight, got {tuple(weight.shape)}")
    tr = winograd_transforms(tile)
    K, C = weight.shape[:2]
    kg = torch.kron(tr.G, tr.G).to(weight.device)  # [α², 9]
    with torch.no_grad():
        u = torch.einsum("xs,kcs->xck", kg, weight.detach().reshape(K, C, R * R).double())
    return WinogradWeight(u.to(dtype or weight.dtype).contiguous(), tile, weight)


class WeightCache(DerivedWeights):
    """The transformed weights of one conv weight, per (tile, dtype, device), recomputed when the
    weight changes (ops/weight_cache.py). A patched conv owns one; while it lives,
    ``cached_weight(weight, tile)`` finds it by the weight tensor, which is how the torch.compile
    custom op (it sees tensors only) reaches it. Dropping the owner frees the transformed weights."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__(weight, "winograd", winograd_weight)


uncached_calls = 0  # cached_weight calls that found no cache (each transformed the weight anew)


def cached_weight(weight: torch.Tensor, tile: int) -> WinogradWeight:
    """``weight``'s transform for ``tile`` from the WeightCache that holds this very tensor, or, where
    none does, computed for this call only (counted in ``uncached_calls``)."""
    global uncached_calls
    cache = find(weight, "winograd")
    if cache is None:
        uncached_calls += 1
        return winograd_weight(weight, tile)
    return cache.get(tile)


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------

@triton.jit
def _tile_block(pid_t, pid_c, T, C, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, TILES_FAST: tl.constexpr):
    """The BLOCK_T × BLOCK_C (tile, channel) pairs of one program, flattened to one axis. The axis
    that is contiguous in memory runs fastest (channels for channels_last, tiles for NCHW)."""
    n = tl.arange(0, BLOCK_T * BLOCK_C)
    if TILES_FAST:
        t_loc, c_loc = n % BLOCK_T, n // BLOCK_T
    else:
        t_loc, c_loc = n // BLOCK_C, n % BLOCK_C
    # int64: t · stride passes 2^31 on large activations.
    t = pid_t.to(tl.int64) * BLOCK_T + t_loc
    c = pid_c.to(tl.int64) * BLOCK_C + c_loc
    return t, c, (t < T) & (c < C)


# H, W, TH, TW are only divided and compared: specializing on their divisibility by 16 would only
# recompile per SD shape. T and the channel counts stay specialized: they mask the contiguous axis
# (NCHW's tiles, channels_last's channels), and a known multiple of 16 lets those accesses vectorize.
@triton.jit(do_not_specialize=["H", "W", "TH", "TW"])
def _input_transform_kernel(
    x_ptr, kb_ptr, v_ptr, C, H, W, T, TH, TW,
    sxn, sxc, sxh, sxw, svx, svt, svc,
    TILE: tl.constexpr, ALPHA: tl.constexpr, P: tl.constexpr, TILES_FAST: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_FAST: tl.constexpr, BLOCK_SLOW: tl.constexpr,
):
    """V[ξ, t, c] = Σ_s kron(Bᵀ, Bᵀ)[ξ, s] · d_{t,c}[s]: the (α×α) tile s = (i, j) of channel c
    starting at (ty·m − 1, tx·m − 1); zero padding is the load's mask."""
    BLOCK_T: tl.constexpr = BLOCK_FAST if TILES_FAST else BLOCK_SLOW
    BLOCK_C: tl.constexpr = BLOCK_SLOW if TILES_FAST else BLOCK_FAST
    t, c, ok = _tile_block(tl.program_id(0), tl.program_id(1), T, C, BLOCK_T, BLOCK_C, TILES_FAST)
    tx, ty, b = t % TW, (t // TW) % TH, t // (TW * TH)
    s = tl.arange(0, P)
    h = ty[None, :] * TILE + (s // ALPHA)[:, None] - 1
    w = tx[None, :] * TILE + (s % ALPHA)[:, None] - 1
    inside = (s < ALPHA * ALPHA)[:, None] & ok[None, :] & (h >= 0) & (h < H) & (w >= 0) & (w < W)
    d = tl.load(x_ptr + b[None, :] * sxn + c[None, :] * sxc + h * sxh + w * sxw, mask=inside, other=0.0)
    kb = tl.load(kb_ptr + s[:, None] * P + s[None, :])
    v = tl.dot(kb, d.to(tl.float32), input_precision=PRECISION)
    out = v_ptr + s[:, None].to(tl.int64) * svx + t[None, :] * svt + c[None, :] * svc
    tl.store(out, v.to(v_ptr.dtype.element_ty), mask=(s < ALPHA * ALPHA)[:, None] & ok[None, :])


@triton.jit(do_not_specialize=["H", "W", "TH", "TW"])
def _output_transform_kernel(
    m_ptr, ka_ptr, bias_ptr, y_ptr, K, H, W, T, TH, TW,
    smx, smt, smk, syn, syk, syh, syw,
    HAS_BIAS: tl.constexpr, TILE: tl.constexpr, ALPHA: tl.constexpr, P: tl.constexpr, Q: tl.constexpr,
    TILES_FAST: tl.constexpr, PRECISION: tl.constexpr, BLOCK_FAST: tl.constexpr, BLOCK_SLOW: tl.constexpr,
):
    """y[(ty·m + i, tx·m + j), k] = Σ_ξ kron(Aᵀ, Aᵀ)[(i, j), ξ] · M[ξ, t, k] + bias[k], masked at
    the bottom/right edge where the last tiles overhang the image."""
    BLOCK_T: tl.constexpr = BLOCK_FAST if TILES_FAST else BLOCK_SLOW
    BLOCK_K: tl.constexpr = BLOCK_SLOW if TILES_FAST else BLOCK_FAST
    t, k, ok = _tile_block(tl.program_id(0), tl.program_id(1), T, K, BLOCK_T, BLOCK_K, TILES_FAST)
    tx, ty, b = t % TW, (t // TW) % TH, t // (TW * TH)
    s = tl.arange(0, P)
    mt = tl.load(m_ptr + s[:, None].to(tl.int64) * smx + t[None, :] * smt + k[None, :] * smk,
                 mask=(s < ALPHA * ALPHA)[:, None] & ok[None, :], other=0.0)
    q = tl.arange(0, Q)
    ka = tl.load(ka_ptr + q[:, None] * P + s[None, :])
    y = tl.dot(ka, mt.to(tl.float32), input_precision=PRECISION)
    if HAS_BIAS:
        y += tl.load(bias_ptr + k, mask=ok, other=0.0).to(tl.float32)[None, :]
    h = ty[None, :] * TILE + (q // TILE)[:, None]
    w = tx[None, :] * TILE + (q % TILE)[:, None]
    inside = (q < TILE * TILE)[:, None] & ok[None, :] & (h < H) & (w < W)
    tl.store(y_ptr + b[None, :] * syn + k[None, :] * syk + h * syh + w * syw,
             y.to(y_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _grouped_pid(pid, n_m, n_n, GROUP_M: tl.constexpr):
    """(row block, column block) of program ``pid`` in grouped order: GROUP_M row blocks share each
    column block (of U) while it sits in L2."""
    group = pid // (GROUP_M * n_n)
    first_m = group * GROUP_M
    rows = min(n_m - first_m, GROUP_M)
    return first_m + (pid % (GROUP_M * n_n)) % rows, (pid % (GROUP_M * n_n)) // rows


@triton.jit
def _gemm_block(v_xi, u_xi, offs_m, offs_n, T, K, C, svt, svc, suc, suk,
                PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """V[ξ][offs_m, :] · U[ξ][:, offs_n] in fp32, for V[ξ] at v_xi and U[ξ] at u_xi."""
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = v_xi + offs_m[:, None] * svt + offs_k[None, :] * svc
    b_ptrs = u_xi + offs_k[:, None] * suc + offs_n[None, :] * suk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, C, BLOCK_K):
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < T) & (offs_k[None, :] < C - k0), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < C - k0) & (offs_n[None, :] < K), other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K * svc
        b_ptrs += BLOCK_K * suc
    return acc


@triton.jit
def _batched_gemm_kernel(
    v_ptr, u_ptr, m_ptr, T, K, C,
    svx, svt, svc, sux, suc, suk, smx, smt, smk,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """M[ξ] = V[ξ] · U[ξ] ([T, C] · [C, K]), fp32 accumulation; program axis 1 is ξ."""
    xi = tl.program_id(1).to(tl.int64)
    pid_m, pid_n = _grouped_pid(tl.program_id(0), tl.cdiv(T, BLOCK_M), tl.cdiv(K, BLOCK_N), GROUP_M)
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = _gemm_block(v_ptr + xi * svx, u_ptr + xi * sux, offs_m, offs_n, T, K, C, svt, svc, suc, suk,
                      PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
    out = m_ptr + xi * smx + offs_m[:, None] * smt + offs_n[None, :] * smk
    tl.store(out, acc.to(m_ptr.dtype.element_ty), mask=(offs_m[:, None] < T) & (offs_n[None, :] < K))


@triton.jit(do_not_specialize=["H", "W", "TH", "TW"])
def _fused_gemm_output_kernel(
    v_ptr, u_ptr, ka_ptr, bias_ptr, y_ptr, T, K, C, H, W, TH, TW,
    svx, svt, svc, sux, suc, suk, syn, syk, syh, syw,
    HAS_BIAS: tl.constexpr, TILE: tl.constexpr, ALPHA: tl.constexpr, P: tl.constexpr, Q: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """Steps 2 and 3 in one program (experimental, tiles 2 and 4): for a block of tiles × output
    channels, each of the α² GEMMs is folded into the m² outputs as soon as it is done,
    out[q] += Aᵀ⊗Aᵀ[q, ξ] · M_ξ (fp32 FMAs), so M never reaches memory. The price: a Q×BLOCK_M×BLOCK_N
    fp32 accumulator (Q = m², hence tiles ≤ 4) and Q FMAs per M element on the CUDA cores."""
    pid_m, pid_n = _grouped_pid(tl.program_id(0), tl.cdiv(T, BLOCK_M), tl.cdiv(K, BLOCK_N), GROUP_M)
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    q = tl.arange(0, Q)
    out = tl.zeros((Q, BLOCK_M, BLOCK_N), dtype=tl.float32)
    v_xi, u_xi = v_ptr, u_ptr  # advanced by one ξ stride a step: 64-bit pointers, no int32 ξ·stride
    for xi in range(0, ALPHA * ALPHA):
        acc = _gemm_block(v_xi, u_xi, offs_m, offs_n, T, K, C, svt, svc, suc, suk,
                          PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
        col = tl.load(ka_ptr + q * P + xi)  # column ξ of kron(Aᵀ, Aᵀ); rows ≥ m² are zero
        out += col[:, None, None] * acc[None, :, :]
        v_xi += svx
        u_xi += sux
    if HAS_BIAS:
        out += tl.load(bias_ptr + offs_n, mask=offs_n < K, other=0.0).to(tl.float32)[None, None, :]
    tx, ty, b = offs_m % TW, (offs_m // TW) % TH, offs_m // (TW * TH)
    h = ty[None, :, None] * TILE + (q // TILE)[:, None, None]
    w = tx[None, :, None] * TILE + (q % TILE)[:, None, None]
    inside = ((q < TILE * TILE)[:, None, None] & (offs_m < T)[None, :, None] & (offs_n < K)[None, None, :]
              & (h < H) & (w < W))
    ptrs = y_ptr + b[None, :, None] * syn + offs_n[None, None, :] * syk + h * syh + w * syw
    tl.store(ptrs, out.to(y_ptr.dtype.element_ty), mask=inside)


# Autotune lists. The interpreter runs every config (and is slow): one small config there.
if interpreting():
    _TRANSFORM_CONFIGS = [triton.Config({"BLOCK_FAST": 16, "BLOCK_SLOW": 2}, num_warps=4)]
    _GEMM_CONFIGS = [triton.Config({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 8})]
    _FUSED_CONFIGS = [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 8})]
else:
    _TRANSFORM_CONFIGS = [
        triton.Config({"BLOCK_FAST": f, "BLOCK_SLOW": s}, num_warps=w)
        for f, s, w in [(16, 8, 4), (32, 4, 4), (64, 2, 4), (64, 4, 8)]
    ]
    _GEMM_CONFIGS = [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_stages=st, num_warps=w)
        for bm, bn, bk, st, w in [(128, 128, 64, 3, 8), (128, 256, 64, 3, 8), (128, 64, 64, 4, 4),
                                  (64, 128, 64, 4, 4), (64, 64, 64, 4, 4)]
    ]
    # The fused kernel's accumulator is Q·BLOCK_M·BLOCK_N fp32: ≤ 128 registers a thread at Q = 16.
    _FUSED_CONFIGS = [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=3, num_warps=w)
        for bm, bn, w in [(32, 64, 8), (64, 32, 8), (16, 64, 4), (32, 32, 4), (16, 32, 4)]
    ]


def _quick_bench(kernel_call, quantiles=None):
    """Autotuning needs a ranking, not a precise time: 5 ms warm-up and 20 ms of runs per config
    (Triton's default, 25 + 100 ms, makes 3 kernels × 4–5 configs × the SD shapes take minutes)."""
    return triton.testing.do_bench(kernel_call, warmup=5, rep=20, quantiles=quantiles)


def _autotune(configs, key):
    # do_bench= and cache_results= (autotune results kept on disk, so the benchmark reuses the tests'
    # choices) are recent arguments: pass them only where this Triton has them.
    params = inspect.signature(triton.autotune).parameters
    extra = {k: v for k, v in (("do_bench", _quick_bench), ("cache_results", True)) if k in params}
    return triton.autotune(configs if AUTOTUNE else configs[:1], key=key, **extra)


# Launchers remember each autotuned choice per key (sd_kernels.runtime.launch): an eager call would
# otherwise pay the autotuner's key building three times, ~100 µs of host time per conv. Each key
# passed below holds every value the autotuner's key reads (channels, tiles, P or Q, layout) and
# every tensor dtype.
_input_transform = Launcher(_autotune(_TRANSFORM_CONFIGS, ["C", "T", "P", "TILES_FAST"])(_input_transform_kernel))
_output_transform = Launcher(_autotune(_TRANSFORM_CONFIGS, ["K", "T", "P", "TILES_FAST"])(_output_transform_kernel))
_batched_gemm = Launcher(_autotune(_GEMM_CONFIGS, ["T", "K", "C"])(_batched_gemm_kernel))
_fused_gemm_output = Launcher(_autotune(_FUSED_CONFIGS, ["T", "K", "C", "Q"])(_fused_gemm_output_kernel))
FUSED_TILES = (2, 4)  # m² ≤ 16: the fused kernel's accumulator fits in registers


# ----------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------

M_DTYPE = torch.float32  # the GEMM's output: fp16 would round before Aᵀ·A cancels (≈ +25% error)


def intermediate_shapes(N: int, C: int, H: int, W: int, K: int, tile: int) -> dict[str, tuple[int, ...]]:
    """Logical shapes of what the op allocates besides y: V [α², T, C], M [α², T, K], and the
    cached U [α², C, K], with T = N·⌈H/m⌉·⌈W/m⌉ tiles. The launcher allocates exactly these."""
    a2 = (tile + R - 1) ** 2
    T = N * cdiv(H, tile) * cdiv(W, tile)
    return {"V": (a2, T, C), "M": (a2, T, K), "U": (a2, C, K)}


def _alloc(shape, dtype: torch.dtype, device, memory_format=torch.contiguous_format) -> torch.Tensor:
    """Every buffer the op writes comes from here (tests poison and record it)."""
    return torch.empty(shape, dtype=dtype, device=device, memory_format=memory_format)


def _precision(exact: bool) -> str:
    return "tf32" if exact else "tf32x3"


def _winograd(x: torch.Tensor, u: torch.Tensor, bias: torch.Tensor | None, tile: int,
              gemm: str = "triton", m_dtype: torch.dtype = M_DTYPE) -> torch.Tensor:
    """The three launches. Variants the benchmark compares: ``m_dtype=x.dtype`` halves M's traffic
    (fp16/bf16 M), ``gemm="bmm"`` runs step 2 with torch.bmm (cuBLAS; M in x's dtype),
    ``gemm="fused"`` runs steps 2 and 3 as one kernel (tiles 2 and 4; no M at all)."""
    if gemm == "fused" and tile not in FUSED_TILES:
        raise ValueError(f"the fused GEMM + output transform takes tiles {FUSED_TILES}, got {tile}")
    (bias,) = vectors(bias)
    N, C, H, W = x.shape
    K = u.shape[2]
    mats = _kernel_mats(tile, x.device)
    shapes = intermediate_shapes(N, C, H, W, K, tile)
    a2, T = shapes["V"][:2]
    TH, TW = cdiv(H, tile), cdiv(W, tile)
    cl = is_channels_last(x)
    # V and M keep the input's fast axis: [ξ, T, C] for channels_last, [ξ, C, T] for NCHW (then
    # viewed as [ξ, T, C]), so both transforms read and write along contiguous memory.
    def buffer(name, last, dtype):
        if cl:
            return _alloc(shapes[name], dtype, x.device)
        return _alloc((a2, last, T), dtype, x.device).transpose(1, 2)

    v = buffer("V", C, x.dtype)
    y = _alloc((N, K, H, W), x.dtype, x.device, torch.channels_last if cl else torch.contiguous_format)
    common = dict(TILE=tile, ALPHA=tile + R - 1, P=mats.P, TILES_FAST=not cl)

    def grid(channels):
        return lambda META: (
            cdiv(T, META["BLOCK_FAST"] if not cl else META["BLOCK_SLOW"]),
            cdiv(channels, META["BLOCK_SLOW"] if not cl else META["BLOCK_FAST"]),
        )

    exact_x = x.dtype != torch.float32 and mats.kb_tf32_exact
    key = (T, C, K, tile, cl, gemm, x.dtype, u.dtype, m_dtype, None if bias is None else bias.dtype)
    _input_transform(
        key, grid(C), x, mats.kb, v, C, H, W, T, TH, TW, *x.stride(), *v.stride(),
        PRECISION=_precision(exact_x), **common,
    )
    if gemm == "fused":
        _fused_gemm_output(
            key, lambda META: (cdiv(T, META["BLOCK_M"]) * cdiv(K, META["BLOCK_N"]),),
            v, u, mats.ka, bias if bias is not None else v, y, T, K, C, H, W, TH, TW,
            *v.stride(), *u.stride(), *y.stride(),
            HAS_BIAS=bias is not None, TILE=tile, ALPHA=tile + R - 1, P=mats.P,
            Q=next_pow2(tile * tile), PRECISION=_precision(x.dtype != torch.float32),
        )
        return y
    if gemm == "bmm":
        m = torch.bmm(v, u)
    else:
        m = buffer("M", K, m_dtype)
        _batched_gemm(
            key, lambda META: (cdiv(T, META["BLOCK_M"]) * cdiv(K, META["BLOCK_N"]), a2),
            v, u, m, T, K, C, *v.stride(), *u.stride(), *m.stride(),
            PRECISION=_precision(x.dtype != torch.float32),
        )
    exact_m = m.dtype != torch.float32 and mats.ka_tf32_exact
    _output_transform(
        key, grid(K), m, mats.ka, bias if bias is not None else m, y, K, H, W, T, TH, TW,
        *m.stride(), *y.stride(),
        HAS_BIAS=bias is not None, Q=mats.Q, PRECISION=_precision(exact_m), **common,
    )
    return y


def _pair(v, name: str) -> tuple[int, int]:
    if isinstance(v, str):
        raise ValueError(f"{name}={v!r}: Winograd takes explicit integers (padding 1)")
    return (v, v) if isinstance(v, int) else tuple(v)


def unsupported_conv(weight: torch.Tensor, stride=1, padding=1, dilation=1, groups: int = 1,
                     padding_mode: str = "zeros") -> str | None:
    """Why a conv with these parameters cannot run as Winograd F(m×m, 3×3), or None if it can.
    The arguments are ``nn.Conv2d``'s (a patch passes the module's attributes)."""
    kh, kw = weight.shape[-2:]
    if (kh, kw) != (R, R):
        return f"kernel {kh}x{kw}: Winograd F(m, 3) needs a 3x3 kernel"
    if isinstance(padding, str):  # nn.Conv2d's "same" is 1 for a 3×3 kernel at stride 1
        padding = {"same": 1, "valid": 0}.get(padding, padding)
    for name, value, want in (("stride", stride, 1), ("padding", padding, 1), ("dilation", dilation, 1)):
        if _pair(value, name) != (want, want):
            return f"{name} {value}: Winograd here needs {name} {want}"
    if groups != 1:
        return f"groups {groups}: Winograd here needs groups 1 (a dense C→K conv)"
    if padding_mode != "zeros":
        return f"padding_mode {padding_mode!r}: Winograd here pads with zeros"
    return None


def _kernel_reason(x: torch.Tensor, u: torch.Tensor | None, bias: torch.Tensor | None) -> str | None:
    if x.dtype not in KERNEL_DTYPES:
        return f"dtype {x.dtype} (the kernels take float16, bfloat16, float32)"
    if u is not None and u.dtype != x.dtype:
        return f"transformed weight dtype {u.dtype} != input dtype {x.dtype}"
    if bias is not None and bias.dtype != x.dtype:
        return f"bias dtype {bias.dtype} != input dtype {x.dtype}"
    if x.numel() == 0:
        return "empty input"
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, u, bias)):
        return "input requires grad (the kernels are inference-only)"
    return None


def winograd_conv2d(
    x: torch.Tensor,
    weight: torch.Tensor | WinogradWeight,
    bias: torch.Tensor | None = None,
    tile: int | None = None,
    *,
    stride=1,
    padding=1,
    dilation=1,
    groups: int = 1,
) -> torch.Tensor:
    """``F.conv2d(x, weight, bias, padding=1)`` for a 3×3 kernel, computed as Winograd F(tile, 3).

    ``weight`` is [K, C, 3, 3] or a ``WinogradWeight`` from ``winograd_weight`` (then ``tile``
    defaults to its tile). stride/padding/dilation/groups are taken only to refuse, with a
    ValueError naming the condition, the convs Winograd cannot compute. The output keeps x's memory
    format (channels_last in, channels_last out).
    """
    cached = weight if isinstance(weight, WinogradWeight) else None
    w = cached.weight if cached is not None else weight
    if cached is not None and tile not in (None, cached.tile):
        raise ValueError(f"tile {tile} != the transformed weight's tile {cached.tile}")
    tile = cached.tile if cached is not None else (4 if tile is None else tile)
    if tile not in POINTS:
        raise ValueError(f"tile must be one of {TILES}, got {tile!r}")
    if x.dim() != 4 or w.dim() != 4:
        raise ValueError(f"winograd_conv2d needs 4-D x and weight, got {tuple(x.shape)} and {tuple(w.shape)}")
    reason = unsupported_conv(w, stride, padding, dilation, groups)
    if reason is not None:
        raise ValueError(f"winograd_conv2d: {reason}")
    check_operands(x, w, bias)
    u = cached.u if cached is not None else None
    reason = _kernel_reason(x, u if u is not None else w, bias)
    if not use_kernel("winograd_conv2d", x, w, bias, u, unsupported=reason):
        return reference.conv2d_3x3(x, w, bias)
    if u is None:
        u = winograd_weight(w, tile).u
    return _winograd(x, u, bias, tile)


# ----------------------------------------------------------------------------------------------
# The paper's table, from our tensors
# ----------------------------------------------------------------------------------------------

@contextlib.contextmanager
def _tf32_off():
    """Stock fp32 convs on the GPU use TF32 by default; the table compares against real fp32."""
    saved = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32 = saved


def winograd_table(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   tiles=TILES) -> list[dict]:
    """One row per tile: the algebraic ratios (multiply savings 9m²/α², intermediate α²/m², weights
    α²/9), the byte ratios of the tensors the op actually allocates for this input (V vs x, M vs y,
    U vs the 3×3 weight: tile padding at the edge and fp32 M included), and the relative error vs
    a float64 direct conv, ours next to stock (cuDNN on a GPU, torch on CPU) at x's dtype."""
    from sd_kernels.testing import rel_err

    N, C, H, W = x.shape
    K = weight.shape[0]
    ref64 = reference.conv2d_3x3(*reference.upcast(x, weight, bias))
    with _tf32_off():
        stock = rel_err(reference.conv2d_3x3(x, weight, bias), ref64)
    x_bytes = x.numel() * x.element_size()
    y_bytes = N * K * H * W * x.element_size()
    w_bytes = weight.numel() * x.element_size()
    rows = []
    for tile in tiles:
        tr = winograd_transforms(tile)
        shapes = intermediate_shapes(N, C, H, W, K, tile)
        itemsize = {"V": x.element_size(), "M": M_DTYPE.itemsize, "U": x.element_size()}
        nbytes = {k: math.prod(s) * itemsize[k] for k, s in shapes.items()}
        ours = winograd_conv2d(x, winograd_weight(weight, tile), bias)
        rows.append({
            "tile": f"{tile}x{tile}",
            "alpha": tr.alpha,
            "points": ", ".join(str(p) for p in tr.points) + ", inf",
            "mult_savings": round(R * R * tile**2 / tr.alpha**2, 3),
            "intermediate_algebraic": round(tr.alpha**2 / tile**2, 3),
            "weights_algebraic": round(tr.alpha**2 / (R * R), 3),
            "V_vs_input": round(nbytes["V"] / x_bytes, 3),
            "M_vs_output": round(nbytes["M"] / y_bytes, 3),
            "U_vs_weight": round(nbytes["U"] / w_bytes, 3),
            "rel_err_ours": rel_err(ours, ref64),
            "rel_err_stock": stock,
        })
    return rows
