"""Plain-PyTorch versions of every op sd-kernels implements.

Each function here has exactly the contract of the kernel of the same name in ``sd_kernels.ops``.
They serve twice: as the oracle in tests (run on float64 copies of the inputs) and as the fallback
that dispatch uses wherever a Triton kernel cannot run (CPU without the interpreter, shapes off a
kernel's ground). Nothing here is clever on purpose.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

ACTIVATIONS = (None, "silu")
GELU_APPROXIMATIONS = ("none", "tanh")


def check_activation(activation: str | None) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def check_gelu_approximation(approximate: str) -> None:
    if approximate not in GELU_APPROXIMATIONS:
        raise ValueError(f"approximate must be one of {GELU_APPROXIMATIONS}, got {approximate!r}")


def group_norm(
    x: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    activation: str | None = None,
) -> torch.Tensor:
    """``F.group_norm`` followed by an optional activation (``"silu"``)."""
    check_activation(activation)
    y = F.group_norm(x, num_groups, weight, bias, eps)
    return F.silu(y) if activation == "silu" else y


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    check_gelu_approximation(approximate)
    return F.gelu(x, approximate=approximate)


def check_geglu_input(h: torch.Tensor) -> None:
    """What GEGLU's ``h.chunk(2, -1)`` needs: a dimension to split (torch's words), an even one."""
    if h.dim() == 0:
        raise RuntimeError("chunk expects at least a 1-dimensional tensor")
    if h.shape[-1] % 2:
        raise ValueError(f"geglu needs an even last dimension, got {h.shape[-1]}")


def geglu(h: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """diffusers' GEGLU after its projection: ``a * gelu(gate)`` with ``a, gate = h.chunk(2, -1)``."""
    check_gelu_approximation(approximate)
    check_geglu_input(h)
    a, gate = h.chunk(2, dim=-1)
    return a * F.gelu(gate, approximate=approximate)


def default_scale(head_dim: int) -> float:
    """SDPA's default scale 1/√D; inf at D = 0, as torch computes it."""
    return 1.0 / math.sqrt(head_dim) if head_dim else math.inf


def _additive_mask(attn_mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """Boolean masks (True = attend) become 0 / -inf, as in ``F.scaled_dot_product_attention``."""
    if attn_mask is None or attn_mask.dtype != torch.bool:
        return attn_mask
    return torch.zeros(attn_mask.shape, dtype=dtype, device=attn_mask.device).masked_fill(
        ~attn_mask, float("-inf")
    )


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Naive ``softmax(q kᵀ · scale + mask) v``: the Sq×Sk scores are materialised, in float32 for
    half-precision inputs (as SDPA and the kernels accumulate them: fp16 scores past 65504 would be
    inf, then NaN).

    Rows whose every key is masked out produce zeros (not NaN), the behaviour the kernels share; a
    NaN anywhere else (a NaN input, say) stays NaN, as in torch.
    """
    scale = default_scale(q.shape[-1]) if scale is None else scale
    acc = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    scores = (q.to(acc) @ k.to(acc).transpose(-1, -2)) * scale
    mask = _additive_mask(attn_mask, scores.dtype)
    if mask is not None:
        scores = scores + mask
    probs = torch.softmax(scores, dim=-1)
    if mask is not None:
        probs = probs.masked_fill(torch.isneginf(scores).all(dim=-1, keepdim=True), 0.0)
    return (probs @ v.to(probs.dtype)).to(v.dtype)


def sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """PyTorch's fused attention, the stock path of diffusers' ``AttnProcessor2_0``."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)


def softmax_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``softmax(x, -1) @ w`` for x [..., a, b] and w [..., b, c]; softmax(x) is materialised here."""
    return torch.softmax(x, dim=-1) @ w


def conv2d_3x3(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """3×3 convolution, stride 1, padding 1: the convs Winograd replaces."""
    if tuple(weight.shape[-2:]) != (3, 3):
        raise ValueError(f"conv2d_3x3 needs a 3x3 kernel, got {tuple(weight.shape[-2:])}")
    return F.conv2d(x, weight, bias, stride=1, padding=1)


def conv2d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, stride=1,
           padding=0) -> torch.Tensor:
    """``F.conv2d`` with groups 1 and dilation 1: what ``ops.conv.conv2d`` computes."""
    return F.conv2d(x, weight, bias, stride=stride, padding=padding)


def upcast(*tensors: torch.Tensor | None, dtype: torch.dtype = torch.float64) -> tuple:
    """Detached copies in ``dtype`` (default float64) for building oracles; None stays None."""
    return tuple(None if t is None else t.detach().to(dtype) for t in tensors)
