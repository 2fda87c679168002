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
broadcast over the tokens), is one ``torch.addcmul`` pass: the product and the sum in fp32, rounded once,
where diffusers' ``x + gate * y`` runs two elementwise kernels and writes the product in between (at
SD3-medium 1024² with guidance, 25 MB written and read back for the image stream of each block). No Triton
kernel: a rewrite in torch calls, on any device; under the reference backend diffusers' two ops, bit for
bit. Rounded once, a sum whose product alone would overflow fp16 stays finite where stock's is ±inf (FLUX's
single blocks then clip either to ±65,504).

The kernel is elementwise over a [N, C, S] view (S the flattened spatial dims, which must share one
stride: a band of rows of a channels_last tensor has stride C). A program owns a [BLOCK_S, BLOCK_C]
tile, channels fastest when they are (16-byte loads along C in channels_last). Not autotuned: the
tile follows the layout.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from sd_kernels import reference
from sd_kernels.ops.group_norm import _spatial_stride
from sd_kernels.ops.layout import check_writable, vectors
from sd_kernels.runtime.dispatch import tensor_reason, use_kernel
from sd_kernels.runtime.launch import Launcher, cdiv


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


def gated_add(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x + gate · y`` in one pass (``torch.addcmul``: rounded once, where the reference rounds the product
    too); the reference (diffusers' two ops) under the reference backend, where the three dtypes differ
    (torch's type promotion is then the reference's to decide), for a 0-dim gate (which may sit on another
    device) and in a graph torch.compile traces (inductor fuses the two ops itself)."""
    if (torch.compiler.is_compiling() or not x.dtype == gate.dtype == y.dtype or gate.dim() == 0
            or not use_kernel("gated_add", x, gate, y, any_device=True)):
        return reference.gated_add(x, gate, y)
    return torch.addcmul(x, gate, y)
