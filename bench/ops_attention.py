"""Attention benchmarks (fp16): our FlashAttention and partially fused softmax against SDPA with each of
its backends, and against naive softmax(q·kᵀ)·v, at SD1.5's shapes.

Shapes (batch 2 for classifier-free guidance, 8 heads): self-attention at 64², 32², 16² latent tokens
with head dims 40, 80, 160, each also as cross-attention over the 77 text tokens, and the VAE's
mid-block attention (1 head, d = 512, 4,096 tokens; FlashAttention does not take d > 256). q, k, v are
diffusers' views of [B, S, H, D] tensors. "stock" is F.scaled_dot_product_attention with torch's own
backend choice; an SDPA backend that refuses a shape is left out and named in ``skipped``. The
partial softmax's ``extra`` columns give its peak memory beyond inputs and output against the size of
X (what the paper's design must add) and against the naive path's (X and softmax(X)).

``python -m bench.ops_attention OUT [--dit]`` runs the tuning sweep instead (``sweep``): flash configs and
head-dim splits at the self-attention shapes, the partial softmax's two paths at the cross-attention
shapes, written to OUT/sweep.json; ``--dit`` sweeps the diffusion transformers' self-attention shapes
instead (``DIT_SHAPES``: PixArt-Σ, SD3's joint text + image sequence, FLUX's, at 1024²); ``--wgmma``
times the Hopper wgmma kernel (two and three consumer warpgroups) against cuDNN and our flash at the
DiTs' and the UNets' long-sequence shapes (``WGMMA_SHAPES``; at key counts that are a multiple of its key
block also its variant without the run-time ragged-block test), written to OUT/wgmma.json.
"""

from __future__ import annotations

import functools
import importlib
import itertools
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
DIT_SHAPES = [  # 1024², batch 2 (guidance; FLUX: one sample at batch 1 would halve it), 64² latent patches
    (2, 16, 4096, 4096, 72),  # PixArt-Σ: 16 heads of 72
    (2, 24, 4429, 4429, 64),  # SD3-medium: 24 heads of 64 over 4,096 image + 333 text tokens (77 CLIP + 256 T5)
    (1, 24, 4608, 4608, 128),  # FLUX.1: 24 heads of 128 over 4,096 image + 512 text tokens
]
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


def _qkv(b: int, h: int, sq: int, sk: int, d: int, dtype: torch.dtype = DTYPE) -> tuple[torch.Tensor, ...]:
    def make(s: int) -> torch.Tensor:
        return torch.randn(b, s, h, d, device="cuda", dtype=dtype).transpose(1, 2)

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


# ---------------------------------------------------------------------------------------------
# The tuning sweep (not part of bench.run): python -m bench.ops_attention OUT_DIR

SWEEP_CONFIGS = {  # head dim: (BLOCK_M, BLOCK_N, warps, stages, maxnreg) candidates at the self-attention
    # shapes; maxnreg 128 lets two 8-warp programs share an SM
    40: [(128, 128, 8, 3, 128), (128, 128, 8, 2, 128), (128, 128, 8, 3, None), (128, 64, 8, 3, None),
         (128, 64, 8, 3, 128)],
    80: [(128, 64, 8, 3, None), (128, 64, 8, 2, None), (64, 64, 4, 3, None), (128, 128, 8, 3, 128),
         (128, 64, 8, 3, 128)],
    160: [(64, 64, 4, 2, None), (128, 64, 8, 2, None), (64, 32, 4, 2, None)],
    64: [(128, 128, 8, 3, 128), (128, 128, 8, 2, None), (128, 64, 8, 3, None), (128, 64, 8, 2, None),
         (128, 64, 4, 3, None), (64, 64, 4, 3, None)],
    72: [(128, 64, 8, 3, None), (128, 64, 8, 2, None), (128, 128, 8, 2, None), (128, 128, 8, 3, 128),
         (64, 64, 4, 3, None), (128, 32, 8, 3, None), (64, 128, 4, 2, None)],
    128: [(128, 64, 8, 3, None), (128, 64, 8, 2, None), (128, 128, 8, 2, None), (64, 64, 4, 3, None),
          (128, 32, 8, 3, None)],
}
SWEEP_BLOCKS = {  # head dim: ((D_LO, D_HI) for Q·Kᵀ, (DV_LO, DV_HI) for P·V) candidates
    40: [((32, 16), (64, 0)), ((32, 16), (32, 16)), ((64, 0), (64, 0))],
    80: [((64, 16), (64, 16)), ((64, 16), (128, 0))],
    160: [((128, 32), (128, 32))],
    64: [((64, 0), (64, 0))],
    72: [((64, 16), (64, 16)), ((64, 16), (128, 0)), ((128, 0), (128, 0))],
    128: [((128, 0), (128, 0))],
}


def _sweep_row(shape, impl, fn, inputs, ref, nxt, **info) -> dict:
    """One timed, checked row of the sweep; a config that does not compile is a row with its error."""
    from bench.common import time_graph_ms

    b, h, sq, sk, d = shape
    base = {"shape": "x".join(map(str, shape)), "impl": impl, **info}
    try:
        err = rel_err(fn(*inputs), ref) if ref is not None else float("nan")
        ms = time_graph_ms(lambda: fn(*nxt()))
    except Exception as exc:  # a config that does not compile, a backend that refuses
        row = {**base, "error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:100]}"}
    else:
        row = {**base, "ms": round(ms, 5), "TFLOP/s": round(4 * b * h * sq * sk * d / ms / 1e9, 1),
               "rel_err": f"{err:.3e}"}
    print(row, flush=True)
    return row


def sweep(shapes=SHAPES) -> list[dict]:
    """Every candidate config × head-dim split at SD's self-attention shapes, the
    SDPA backends beside them, and the partial softmax's one-tile kernel against its two-kernel
    path at the cross-attention shapes. Device times from CUDA graphs; errors against float64."""
    import triton

    attn = importlib.import_module("sd_kernels.ops.attention")
    smm = importlib.import_module("sd_kernels.ops.softmax_matmul")

    rows = []
    for shape in [s for s in shapes if s[4] in SWEEP_CONFIGS or s[3] == 77]:
        inputs = _qkv(*shape)
        ref = reference.attention(*(t.double() for t in inputs))
        nxt = rotating(functools.partial(_qkv, *shape), sum(t.numel() * t.element_size() for t in inputs))
        run = functools.partial(_sweep_row, shape, inputs=inputs, ref=ref, nxt=nxt)
        d = shape[4]
        if shape[2] == shape[3]:  # self-attention: flash configs
            rows.append(run("stock", F.scaled_dot_product_attention))
            rows += [run(name, _sdpa_with(backend)) for name, backend in SDPA_BACKENDS.items()
                     if name != "sdpa_math"]
            for (bm, bn, warps, stages, maxnreg), blocks in itertools.product(SWEEP_CONFIGS[d], SWEEP_BLOCKS[d]):
                cfg = triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages,
                                    maxnreg=maxnreg)
                ours = functools.partial(attn._flash, mask4=None, scale=d**-0.5, config=cfg, blocks=blocks)
                rows.append(run("ours", ours, config=f"{bm}x{bn} w{warps} s{stages} r{maxnreg}",
                                blocks=str(blocks)))
            rows.append(run("ours_autotuned", flash_attention))
        else:  # cross-attention: the partial softmax's two paths and naive
            rows.append(run("naive", naive))
            one_tile = smm.ONE_TILE_MAX_K
            for name, limit in (("partial_two_kernels", 0), ("partial_one_tile", one_tile)):
                smm.ONE_TILE_MAX_K = limit
                try:
                    rows.append(run(name, partial_softmax_attention))
                finally:
                    smm.ONE_TILE_MAX_K = one_tile
            b, h, sq, sk, d = shape  # where the partial softmax's time goes: cuBLAS's X, then the kernel
            x3 = torch.empty(b * h, sq, sk, dtype=DTYPE, device="cuda")
            stats = torch.empty(2, b * h * sq, dtype=torch.float32, device="cuda")
            x4 = x3.view(b, h, sq, sk)
            rows.append(run("scores_gemm_only", lambda q, k, v, x3=x3: smm._scores(x3, q, k, 0, 1.0), ref=None))
            rows.append(run("naive_scores_only", lambda q, k, v: q @ k.transpose(-1, -2), ref=None))
            rows.append(run("one_tile_kernel_only", lambda q, k, v, x4=x4, stats=stats: smm._launch(
                x4, v, torch.empty_like(q), stats, zero_empty=True), ref=None))
        del inputs, ref, nxt, run
        torch.cuda.empty_cache()
    return rows


WGMMA_SHAPES = [  # (name, shape, dtype): the DiTs' attention and the UNets' head-dim-64 self-attention
    ("SD3 1024", (2, 24, 4429, 4429, 64), torch.float16), ("SD3 1024", (2, 24, 4429, 4429, 64), torch.bfloat16),
    ("SD3 512", (2, 24, 1357, 1357, 64), torch.float16), ("PixArt 1024", (2, 16, 4096, 4096, 72), torch.float16),
    ("PixArt 1024", (2, 16, 4096, 4096, 72), torch.bfloat16), ("SD2 768", (2, 5, 9216, 9216, 64), torch.float16),
    ("SD2 512", (2, 5, 4096, 4096, 64), torch.float16), ("SDXL 64²", (2, 10, 4096, 4096, 64), torch.float16),
    ("SDXL 32²", (2, 20, 1024, 1024, 64), torch.float16), ("SDXL 52×76", (2, 10, 3952, 3952, 64), torch.float16),
    ("SD1.5 64²", (2, 8, 4096, 4096, 40), torch.float16),
    ("FLUX 1024", (1, 24, 4608, 4608, 128), torch.float16),
]


def wgmma_sweep() -> list[dict]:
    """The Hopper wgmma kernel with two and three consumer warpgroups (three up to head dim 80) against
    cuDNN's SDPA and our Triton flash at ``WGMMA_SHAPES``; device times from CUDA graphs, errors
    against float64. Needs sm_90 and Triton 3.6 (``attention_wgmma.unavailable``)."""
    wg = importlib.import_module("sd_kernels.ops.attention_wgmma")
    rows = []
    for name, shape, dtype in WGMMA_SHAPES:
        inputs = _qkv(*shape, dtype)
        if (why := wg.reason(*inputs, None)) is not None:
            raise SystemExit(f"bench.ops_attention --wgmma: the kernel cannot run here: {why}")
        ref = reference.attention(*(t.double() for t in inputs))
        nxt = rotating(functools.partial(_qkv, *shape, dtype), sum(t.numel() * t.element_size() for t in inputs))
        run = functools.partial(_sweep_row, shape, inputs=inputs, ref=ref, nxt=nxt, case=name, dtype=str(dtype))
        rows.append(run("sdpa_cudnn", _sdpa_with(SDPBackend.CUDNN_ATTENTION)))
        for n in (2, 3) if shape[-1] <= 80 else (2,):
            rows.append(run(f"wgmma_{n}_consumers", functools.partial(wg.attention_wgmma, n_consumers=n)))
            if n == wg.consumers(shape[-1]) and shape[3] % wg.BLOCK_N == 0:  # what the run-time ragged test costs
                rows.append(run(f"wgmma_{n}_consumers_even_k",
                                functools.partial(wg.attention_wgmma, n_consumers=n, even_k=True)))
        rows.append(run("ours_flash", flash_attention))
        del inputs, ref, nxt, run
        torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    import json
    import pathlib
    import sys

    out = pathlib.Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    if "--wgmma" in sys.argv[2:]:
        (out / "wgmma.json").write_text(json.dumps(wgmma_sweep(), indent=1))
    else:
        result = sweep(DIT_SHAPES if "--dit" in sys.argv[2:] else SHAPES)
        (out / "sweep.json").write_text(json.dumps(result, indent=1))
