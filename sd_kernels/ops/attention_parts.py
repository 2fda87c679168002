"""Attention over keys that arrive in parts: each part's output and log-sum-exp, merged exactly.

Split the keys (and their values) into sets K_1 … K_P. For one query row q, part p gives

    o_p = Σ_{k∈K_p} exp(s_k − lse_p) v_k,    lse_p = log Σ_{k∈K_p} exp(s_k),    s_k = scale · q·k,

and the attention over all the keys is their weighted sum, with weights that are the parts' shares of the
softmax's denominator:

    lse = log Σ_p exp(lse_p),    o = Σ_p exp(lse_p − lse) o_p.

``merge_attention`` applies this to two parts at a time (max-shifted, so no exp overflows), in fp32,
writing the merged output in the dtype asked for and the merged log-sum-exp in fp32: a chain of merges
over P parts keeps its running output in fp32 and rounds once at the last. Against one attention call
over all keys, the result differs by the rounding of each part's output to the input dtype before the
merge (cuDNN's, like every fused attention's, is in q's dtype): within a unit or two in the last place.

What it is for: the ring exchange (patches/context_parallel.py) attends to this process's own keys while the
other processes' keys are still being copied, then to each process's keys as they arrive, so the copies
hide behind the attention instead of waiting before it.

``attention_lse`` is stock PyTorch's fused attention that also returns the log-sum-exp (cuDNN's, else
FlashAttention-2's, through their ATen ops; the float32 reference elsewhere). ``merge_attention`` is one
Triton kernel: a program owns BLOCK_S query rows of one (sample, head), reads both parts' rows and
log-sum-exps once and writes the merged ones; memory-bound (two outputs read, one written).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sd_kernels import reference
from sd_kernels.runtime.dispatch import declined, tensor_reason, use_kernel
from sd_kernels.runtime.launch import Launcher, cdiv


@triton.jit
def _merge_kernel(
    oa_ptr, la_ptr, ob_ptr, lb_ptr, o_ptr, l_ptr, H, S, D,
    sa_b, sa_h, sa_s, sa_d, sla_b, sla_h, sla_s,
    sb_b, sb_h, sb_s, sb_d, slb_b, slb_h, slb_s,
    so_b, so_h, so_s, so_d, slo_b, slo_h, slo_s,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_s, bh = tl.program_id(0), tl.program_id(1)
    b, h = (bh // H).to(tl.int64), (bh % H).to(tl.int64)
    s = (pid_s * BLOCK_S + tl.arange(0, BLOCK_S)).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    sm, dm = s < S, d < D
    mask = sm[:, None] & dm[None, :]
    la = tl.load(la_ptr + b * sla_b + h * sla_h + s * sla_s, mask=sm, other=0.0).to(tl.float32)
    lb = tl.load(lb_ptr + b * slb_b + h * slb_h + s * slb_s, mask=sm, other=0.0).to(tl.float32)
    m = tl.maximum(la, lb)
    empty = m == float("-inf")  # no key in either part: the output 0, the log-sum-exp -inf (not NaN)
    m = tl.where(empty, 0.0, m)
    wa, wb = tl.exp(la - m), tl.exp(lb - m)
    den = tl.where(empty, 1.0, wa + wb)
    oa = tl.load(oa_ptr + b * sa_b + h * sa_h + s[:, None] * sa_s + d[None, :] * sa_d, mask=mask, other=0.0)
    ob = tl.load(ob_ptr + b * sb_b + h * sb_h + s[:, None] * sb_s + d[None, :] * sb_d, mask=mask, other=0.0)
    o = (oa.to(tl.float32) * (wa / den)[:, None] + ob.to(tl.float32) * (wb / den)[:, None])
    tl.store(o_ptr + b * so_b + h * so_h + s[:, None] * so_s + d[None, :] * so_d, o.to(o_ptr.dtype.element_ty),
             mask=mask)
    tl.store(l_ptr + b * slo_b + h * slo_h + s * slo_s, tl.where(empty, float("-inf"), m + tl.log(den)), mask=sm)


_LAUNCH = Launcher(_merge_kernel)

# (op, dtype, head dims, device) that cuDNN's / FlashAttention's ATen op refused once: not asked again
_REFUSED: set[tuple] = set()


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"attention_lse: q, k, v must be [B, H, S, D], got {list(q.shape)}, {list(k.shape)}, "
                         f"{list(v.shape)}")
    if (q.shape[:2] != k.shape[:2] or k.shape[:3] != v.shape[:3] or q.shape[-1] != k.shape[-1]
            or q.dtype != k.dtype or k.dtype != v.dtype or q.device != k.device or k.device != v.device):
        raise ValueError(f"attention_lse: q {list(q.shape)} {q.dtype}, k {list(k.shape)} {k.dtype}, v {list(v.shape)} "
                         f"{v.dtype} do not fit: same B, H, dtype and device; k and v the same keys; q·k's D alike")


def _aten(which: str, q, k, v, scale):
    if which == "cudnn":
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, scale=scale)[:2]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, scale=scale)[:2]
    return out, lse.reshape(lse.shape[:3])  # cuDNN on newer torch: [B, H, S, 1]


def attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, H, Sq, Dv] in q's dtype, lse [B, H, Sq] float32) of softmax(scale · q kᵀ) v on [B, H, S, D]
    inputs: cuDNN's fused attention on CUDA fp16/bf16 with D contiguous, else FlashAttention-2's, else the
    float32 reference (also under autograd, and what an op refused, logged once as declined)."""
    _check(q, k, v)
    fused = (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and not torch.is_grad_enabled()
             and all(x.stride(-1) == 1 for x in (q, k, v)))
    for which in ("cudnn", "flash") if fused else ():
        key = (which, q.dtype, q.shape[-1], v.shape[-1], q.device)
        if key in _REFUSED:
            continue
        try:
            return _aten(which, q, k, v, scale)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as e:  # this torch / GPU has no such kernel for these inputs
            if torch.cuda.is_current_stream_capturing():
                raise
            _REFUSED.add(key)
            declined("attention_lse", f"{which} refused {q.dtype} head dim {q.shape[-1]}: {str(e)[:200]}")
    return reference.attention_lse(q, k, v, scale)


def _heads_inner(like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A new [B, H, S, D] tensor of ``dtype`` with the heads inner in memory: the [B, H, S, D] view of a
    contiguous [B, S, H, D], the layout diffusers' processors hold their attention's output in."""
    b, h, s, d = like.shape
    return torch.empty((b, s, h, d), dtype=dtype, device=like.device).permute(0, 2, 1, 3)


def merge_attention(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor],
                    dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The (out, lse) of attention over two parts' keys from each part's (out [B, H, S, D], lse [B, H, S]), the
    output in ``dtype`` (default: a's output's) with the heads inner in memory (``_heads_inner``), the
    log-sum-exp in float32."""
    (oa, la), (ob, lb) = a, b
    if oa.shape != ob.shape or oa.dim() != 4 or la.shape != oa.shape[:3] or lb.shape != la.shape:
        raise ValueError(f"merge_attention: the parts must be (out [B, H, S, D], lse [B, H, S]) of one shape, got "
                         f"{list(oa.shape)}/{list(la.shape)} and {list(ob.shape)}/{list(lb.shape)}")
    dtype = dtype or oa.dtype
    if not use_kernel("attention_merge", oa, la, ob, lb, unsupported=tensor_reason(oa, la, ob, lb)):
        o, lse = reference.merge_attention(a, b)
        return _heads_inner(o, dtype).copy_(o), lse.float()
    out, lse = _heads_inner(oa, dtype), torch.empty(la.shape, dtype=torch.float32, device=la.device)
    bsz, h, s, d = oa.shape
    block_d = triton.next_power_of_2(d)
    block_s = max(1, min(64, 4096 // block_d))
    _LAUNCH((block_s, block_d, oa.dtype, ob.dtype, dtype), (cdiv(s, block_s), bsz * h),
            oa, la, ob, lb, out, lse, h, s, d, *oa.stride(), *la.stride(), *ob.stride(), *lb.stride(),
            *out.stride(), *lse.stride(), BLOCK_S=block_s, BLOCK_D=block_d, num_warps=4)
    return out, lse
