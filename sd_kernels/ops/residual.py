"""A convolution's bias, a residual and a scale, added in one pass: the tail of a ResNet block.

``bias_residual(y, bias, skip, bias2, divisor, out)`` = (y + bias [+ bias2] [+ skip]) / divisor, the
sum made in fp32 and rounded once, written to ``out`` (any strides with a common spatial one: a
view into a larger buffer, or y itself). It is what diffusers' ResnetBlock2D does after its second
convolution — conv2's bias, the shortcut (with the 1×1 shortcut conv's bias), the add and
``/ output_scale_factor`` — which stock PyTorch runs as three to five elementwise kernels (cuDNN
adds a convolution's bias in a kernel of its own). The streamed VAE decode (patches/stream_decode.py)
runs its convolutions without bias and finishes each band with this, writing straight into the
buffer that keeps the activation.

``gated_add(x, gate, y)`` = x + gate · y, a DiT block's gated residual (``gate`` a per-sample vector
broadcast over the tokens), is one pass: the product and the sum in fp32, rounded once, where diffusers'
``x + gate * y`` runs two elementwise kernels and writes the product in between (at SD3-medium 1024² with
guidance, 25 MB written and read back for the image stream of each block). On a GPU (and under the
interpreter) a Triton kernel makes it, the gate loaded once a tile; elsewhere one ``torch.addcmul``, whose
broadcast gate takes torch's strided elementwise path (docs/kernels/layer_norm.md, "The gated add", measures
both); under the reference backend diffusers' two ops, bit for bit. Rounded once, a sum whose product alone
would overflow fp16 stays finite where stock's is ±inf (FLUX's single blocks then clip either to ±65,504). The
FP8 tier's gated GEMMs on torch's ``_scaled_mm`` add their gate and residual with the same kernel
(``gated_add_into``).

``bias_residual``'s kernel is elementwise over a [N, C, S] view (S the flattened spatial dims, which must
share one stride: a band of rows of a channels_last tensor has stride C). A program owns a [BLOCK_S, BLOCK_C]
tile, channels fastest when they are (16-byte loads along C in channels_last). ``gated_add``'s runs over
[B, T, D] (any strides; the gate's token stride 0 for a per-sample gate), a [BLOCK_T, BLOCK_D] tile a
program. Neither is autotuned: the tile follows the layout.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from sd_kernels import reference
from sd_kernels.ops.group_norm import _spatial_stride
from sd_kernels.ops.layout import check_writable, vectors
from sd_kernels.runtime.dispatch import backend, tensor_reason, use_kernel
from sd_kernels.runtime.launch import Launcher, cdiv, next_pow2


@triton.jit
def _bias_residual_kernel(
    y_ptr, b_ptr, b2_ptr, s_ptr, o_ptr, C, S, divisor,
    sy_n, sy_c, sy_s, ss_n, ss_c, ss_s, so_n, so_c, so_s,
    BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr, HAS_B2: tl.constexpr, HAS_SKIP: tl.constexpr,
):
    pid_s, pid_c, n = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    s = (pid_s * BLOCK_S + tl.arange(0, BLOCK_S)).to(tl.int64)
    c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = c < C
    mask = (s < S)[:, None] & cm[None, :]
    b = tl.load(b_ptr + c, mask=cm, other=0.0).to(tl.float32)
    if HAS_B2:
        b += tl.load(b2_ptr + c, mask=cm, other=0.0).to(tl.float32)
    v = tl.load(y_ptr + n * sy_n + s[:, None] * sy_s + c[None, :] * sy_c, mask=mask, other=0.0).to(tl.float32)
    v += b[None, :]
    if HAS_SKIP:
        v += tl.load(s_ptr + n * ss_n + s[:, None] * ss_s + c[None, :] * ss_c, mask=mask, other=0.0).to(tl.float32)
    v = v / divisor
    tl.store(o_ptr + n * so_n + s[:, None] * so_s + c[None, :] * so_c, v.to(o_ptr.dtype.element_ty), mask=mask)


_LAUNCH = Launcher(_bias_residual_kernel)


def _check(y: torch.Tensor, bias: torch.Tensor, skip, bias2, out) -> None:
    c = y.shape[1] if y.dim() >= 2 else None
    for name, t in (("bias", bias), ("bias2", bias2)):
        if t is not None and (c is None or t.shape != (c,)):
            raise ValueError(f"bias_residual: {name} must be [C] for y of shape {list(y.shape)}, got "
                             f"{list(t.shape)}")
    for name, t in (("skip", skip), ("out", out)):
        if t is not None and (t.shape != y.shape or t.device != y.device):
            raise ValueError(f"bias_residual: {name} must have y's shape and device ({list(y.shape)}, {y.device}), "
                             f"got {list(t.shape)}, {t.device}")
    if out is not None and out.dtype != y.dtype:
        raise ValueError(f"bias_residual: out must have y's dtype {y.dtype}, got {out.dtype}")


def _reason(y, bias, skip, bias2, out) -> str | None:
    reason = tensor_reason(y, bias, skip, bias2, out)
    if reason is None and y.numel() == 0:
        return "empty input"
    if reason is None and any(t is not None and _spatial_stride(t) is None for t in (y, skip, out)):
        return "spatial dims with no common stride"
    return reason


def bias_residual(y: torch.Tensor, bias: torch.Tensor, skip: torch.Tensor | None = None,
                  bias2: torch.Tensor | None = None, divisor: float = 1.0,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """(y + bias[c] [+ bias2[c]] [+ skip]) / divisor for y of [N, C, *spatial], in fp32, rounded once
    to y's dtype, into ``out`` (y's shape and dtype; ``out=y`` in place) or a new tensor of y's
    layout."""
    _check(y, bias, skip, bias2, out)
    check_writable("bias_residual", out=out)
    if not use_kernel("residual", y, bias, skip, bias2, out, unsupported=_reason(y, bias, skip, bias2, out)):
        r = reference.bias_residual(y, bias, skip, bias2, divisor)
        return r if out is None else out.copy_(r)
    bias, bias2 = vectors(bias, bias2)
    if out is None:
        out = torch.empty_like(y)  # preserves a dense layout (channels_last included)
    n, c = y.shape[:2]
    s = math.prod(y.shape[2:])
    channels_fast = abs(y.stride(1)) <= abs(_spatial_stride(y) or 1)
    block_c = min(triton.next_power_of_2(c), 64 if channels_fast else 16)
    block_s = max(4096 // block_c, 16)
    sk = skip if skip is not None else y
    grid = (cdiv(s, block_s), cdiv(c, block_c), n)
    key = (block_s, block_c, bias2 is not None, skip is not None, y.dtype, out.dtype, bias.dtype,
           sk.dtype, None if bias2 is None else bias2.dtype)
    _LAUNCH(key, grid, y, bias, bias if bias2 is None else bias2, sk, out, c, s, float(divisor),
            y.stride(0), y.stride(1), _spatial_stride(y), sk.stride(0), sk.stride(1), _spatial_stride(sk),
            out.stride(0), out.stride(1), _spatial_stride(out),
            BLOCK_S=block_s, BLOCK_C=block_c, HAS_B2=bias2 is not None, HAS_SKIP=skip is not None,
            num_warps=8 if block_s * block_c >= 4096 else 4)
    return out


@triton.jit
def _gated_add_kernel(
    x_ptr, g_ptr, y_ptr, o_ptr, T, D, tiles_d,
    sx_b, sx_t, sx_d, sg_b, sg_t, sg_d, sy_b, sy_t, sy_d, so_b, so_t, so_d,
    HAS_X: tl.constexpr, HAS_GATE: tl.constexpr, GATE_ROW: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """out[b, t, d] = x[b, t, d] + gate[b, t, d] · y[b, t, d] in fp32, rounded once (HAS_X / HAS_GATE: without
    either). GATE_ROW: the gate's token stride is 0 (one vector a sample), loaded once for the tile."""
    pid, b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    t = ((pid // tiles_d) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    d = (pid % tiles_d) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = d < D
    mask = (t < T)[:, None] & d_mask[None, :]
    v = tl.load(y_ptr + b * sy_b + t[:, None] * sy_t + d[None, :] * sy_d, mask=mask, other=0.0).to(tl.float32)
    if HAS_GATE:
        if GATE_ROW:
            g = tl.load(g_ptr + b * sg_b + d * sg_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        else:
            g = tl.load(g_ptr + b * sg_b + t[:, None] * sg_t + d[None, :] * sg_d, mask=mask, other=0.0).to(tl.float32)
        v = v * g
    if HAS_X:
        v += tl.load(x_ptr + b * sx_b + t[:, None] * sx_t + d[None, :] * sx_d, mask=mask, other=0.0).to(tl.float32)
    tl.store(o_ptr + b * so_b + t[:, None] * so_t + d[None, :] * so_d, v.to(o_ptr.dtype.element_ty), mask=mask)


_GATED = Launcher(_gated_add_kernel)
# elements a program: 16 a thread at 4 warps (two 16-byte loads of each 16-bit input); as fast as 4,096 or faster
# at FLUX's and SD3's shapes (docs/kernels/layer_norm.md, "The gated add")
_GATED_ELEMS = 2048
_GATED_WARPS = 4
_MAX_BATCH = 65535  # the samples are the grid's second axis, which CUDA caps here


def _expanded(t: torch.Tensor | None, shape: torch.Size) -> tuple[int, int, int]:
    """The [B, T, D] strides ``t`` is read at, broadcast to ``shape`` (0 along a broadcast dim); (0, 0, 0) for none."""
    return (0, 0, 0) if t is None else t.expand(shape).stride()


def gated_reason(x: torch.Tensor | None, gate: torch.Tensor | None, y: torch.Tensor) -> str | None:
    """Why the gated-add kernel cannot take ``x + gate · y`` (None: it can): the shared reasons, shapes other
    than y's [B, T, D] with x of y's shape and a gate that broadcasts to it, a batch past the grid's limit. The
    device is ``use_kernel``'s to judge, which the callers ask with this as the op's own reason."""
    reason = tensor_reason(x, gate, y)
    if reason is not None:
        return reason
    if y.dim() != 3 or (x is not None and x.shape != y.shape) or y.numel() == 0:
        return f"shape {list(y.shape)} (the kernel takes a non-empty [B, T, D] and an x of its shape)"
    if y.shape[0] > _MAX_BATCH:
        return f"a batch of {y.shape[0]} (the kernel's grid takes up to {_MAX_BATCH} samples)"
    if gate is not None:
        try:
            fits = gate.dim() <= 3 and torch.broadcast_shapes(gate.shape, y.shape) == y.shape
        except RuntimeError:
            fits = False
        if not fits:
            return f"gate of shape {list(gate.shape)} does not broadcast to {list(y.shape)}"
    return None


def gated_add_into(x: torch.Tensor | None, gate: torch.Tensor | None, y: torch.Tensor,
                   out: torch.Tensor) -> torch.Tensor:
    """``out = x + gate · y`` (either of x and gate may be None) for inputs ``gated_reason`` accepts and ``out``
    of y's shape (any strides, its elements its own): one kernel, fp32, rounded once to out's dtype. Returns out."""
    bsz, t, d = y.shape
    block_d = min(next_pow2(d), 1024)
    block_t = max(1, min(_GATED_ELEMS // block_d, next_pow2(t)))
    tiles_d = cdiv(d, block_d)
    sg = _expanded(gate, y.shape)
    flags = dict(HAS_X=x is not None, HAS_GATE=gate is not None, GATE_ROW=gate is not None and sg[1] == 0)
    key = (*flags.values(), block_t, block_d, _GATED_WARPS, y.dtype, out.dtype, None if x is None else x.dtype,
           None if gate is None else gate.dtype)
    _GATED(key, (cdiv(t, block_t) * tiles_d, bsz), y if x is None else x, y if gate is None else gate, y, out,
           t, d, tiles_d, *_expanded(x, y.shape), *sg, *y.stride(), *out.stride(), **flags,
           BLOCK_T=block_t, BLOCK_D=block_d, num_warps=_GATED_WARPS)
    return out


def gated_add(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x + gate · y`` in one pass, rounded once (where the reference rounds the product too), in x's dtype: our
    kernel where ``gated_reason`` lets it run (a contiguous result); else (the fallback counted and logged by the
    dispatch, as every op's) one ``torch.addcmul``, laid out as torch lays it out; the reference (diffusers' two
    ops) under the reference backend, where the three dtypes differ (torch's type promotion is then the
    reference's to decide), for a 0-dim gate (which may sit on another device) and in a graph torch.compile
    traces (inductor fuses the two ops itself)."""
    if (torch.compiler.is_compiling() or not x.dtype == gate.dtype == y.dtype or gate.dim() == 0
            or backend() == "reference"):
        return reference.gated_add(x, gate, y)
    if use_kernel("gated_add", x, gate, y, unsupported=gated_reason(x, gate, y)):
        return gated_add_into(x, gate, y, torch.empty(y.shape, dtype=y.dtype, device=y.device))
    return torch.addcmul(x, gate, y)
