"""Attention benchmarks (fp16): our FlashAttention and partially fused softmax against SDPA with each of
its backends, and against naive softmax(q·kᵀ)·v, at SD1.5's shapes.

Shapes (batch 2 for classifier-free guidance, 8 heads): self-attention at 64², 32², 16² latent tokens
with head dims 40, 80, 160, each also as cross-attention over the 77 text tokens, and the VAE's
mid-block attention (1 head, d = 512, 4,096 tokens; FlashAttention does not take d > 256). q, k, v are
diffusers' views of [B, S, H, D] tensors. "stock" is F.scaled_dot_product_attention with torch's own
backend choice; an SDPA backend that refuses a shape is left out and named in ``skipped``. The
partial softmax's ``extra`` columns give its peak memory beyond inputs and output against the size of
X (what the paper's design must add) and against the naive path's (X and softmax(X)).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench.common import Case, rotating
from sd_kernels import reference
from sd_kernels.ops import flash_attention, partial_softmax_attention
from sd_kernels.ops.attention import MAX_HEAD_DIM
from sd_kernels.testing import extra_cuda_bytes, rel_err

DTYPE = torch.float16
SHAPES = [  # (B, H, Sq, Sk, D)
    (2, 8, 4096, 4096, 40),
    (2, 8, 4096, 77, 40),
    (2, 8, 1024, 1024, 80),
    (2, 8, 1024, 77, 80),
    (2, 8, 256, 256, 160),
    (2, 8, 256, 77, 160),
    (1, 1, 4096, 4096, 512),  # the VAE's mid-block attention
]
QUICK = [SHAPES[0], SHAPES[1], SHAPES[-1]]
SDPA_BACKENDS = {
    "sdpa_flash": SDPBackend.FLASH_ATTENTION,
    "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
    "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
    "sdpa_math": SDPBackend.MATH,
}
MiB = 2**20


def naive(q, k, v):
    """softmax(q·kᵀ·scale)·v with the scores and probabilities written out (diffusers' AttnProcessor)."""
    return torch.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5, dim=-1) @ v


def _sdpa_with(backend: SDPBackend) -> Callable:
    def run(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v)

    return run


def _qkv(b: int, h: int, sq: int, sk: int, d: int) -> tuple[torch.Tensor, ...]:
    def make(s: int) -> torch.Tensor:
        return torch.randn(b, s, h, d, device="cuda", dtype=DTYPE).transpose(1, 2)

    return make(sq), make(sk), make(sk)


def _case(shape: tuple[int, ...], quick: bool) -> Case:
    b, h, sq, sk, d = shape
    impls: dict[str, Callable] = {"stock": F.scaled_dot_product_attention, **{
        name: _sdpa_with(backend) for name, backend in SDPA_BACKENDS.items()}}
    if quick:
        impls.pop("sdpa_math")
    impls["naive"] = naive
    extra: dict = {}
    if d <= MAX_HEAD_DIM:
        impls["ours"] = flash_attention
    else:
        extra["flash"] = f"N/A: head dim {d} > {MAX_HEAD_DIM}"
    impls["ours_partial"] = partial_softmax_attention

    inputs = _qkv(*shape)
    ref = reference.attention(*(t.double() for t in inputs))
    errors, skipped = {}, {}
    for name in list(impls):
        try:  # also compiles / autotunes every impl before timing
            errors[name] = rel_err(impls[name](*inputs), ref)
        except RuntimeError as exc:  # an SDPA backend that does not take this shape
            skipped[name] = str(exc).strip().splitlines()[0][:120]
            del impls[name]
    del ref
    x_bytes = b * h * sq * sk * inputs[0].element_size()
    extra.update({
        "skipped": "; ".join(f"{k}: {v}" for k, v in skipped.items()) or "-",
        "X_MiB": round(x_bytes / MiB, 2),
        "partial_extra_MiB": round(extra_cuda_bytes(partial_softmax_attention, *inputs)[0] / MiB, 2),
        "naive_extra_MiB": round(extra_cuda_bytes(naive, *inputs)[0] / MiB, 2),
    })
    in_bytes = sum(t.numel() * t.element_size() for t in inputs)
    del inputs
    torch.cuda.empty_cache()
    nxt = rotating(lambda: _qkv(*shape), in_bytes)
    timed = {name: (lambda fn=fn: fn(*nxt())) for name, fn in impls.items()}
    out_bytes = b * h * sq * d * 2
    return Case("attention", "x".join(map(str, shape)), DTYPE, "self" if sq == sk else "cross", timed,
                bytes=in_bytes + out_bytes, flops=4 * b * h * sq * sk * d, errors=errors, extra=extra)


def cases(quick: bool) -> Iterator[Case]:
    for shape in QUICK if quick else SHAPES:
        yield _case(shape, quick)
