"""The FP8 tier: its kernels at the models' GEMM shapes, whole pipelines beside their peers, and the quality.

    python -m bench.fp8 --out DIR [--models flux-dev,sd3-medium,pixart-sigma,sdxl,sd15] [--modes ops,e2e,layers]
                        [--shapes NAME,...]
                        [--rows stock,compile,compile+no-cublaslt-workspace,patched,patched+step-graph,
                                patched+inference-mode,
                                patched+cat-join,patched+unfused-qkv,patched+two-pass-residual,
                                patched+addcmul-residual,fp8,
                                fp8+exact-attention,fp8+attention-everywhere,fp8+attention-int8,fp8+triton-gemm,
                                fp8+fused-gate-gemm,fp8+pointer-gemm,fp8+tma-gemm,fp8+cat-join,fp8+unfused-qkv,
                                fp8+addcmul-residual,fp8+previous-glue,fp8+own-modulations,
                                fp8+own-step-modulations,fp8+cublaslt-workspace,fp8+cross-kv-fp8,
                                fp8+plain-norms,fp8+geglu-epilogue,fp8+into-ours,fp8+into-copy,
                                fp8+offloaded-originals,fp8+fp8-conv,fp8+fp32-decode,fp8+norm-values,
                                fp8+torch-conv-bias,fp8+inference-mode,fp8+compile,fp8+step-graph,torchao]
                        [--steps 20] [--calls 2]
                        [--compile recipe|regional]
                        [--compile-mode default|reduce-overhead|max-autotune|max-autotune-no-cudagraphs]

Random weights from the shipped configs (images are noise-like: the quality columns compare two runs
of the same random model, not image quality). Three modes, each writing its CSV to DIR as it goes:

- ``ops`` (fp8_ops.csv): at each model's GEMM shapes (M tokens × K → N), torch's bf16 ``F.linear``
  (stock), torch's row-wise FP8 ``torch._scaled_mm`` (fast accumulation, as our kernels accumulate), our
  ``fp8_gemm`` as dispatched (``ours``: where it hands a GEMM to ``_scaled_mm``, the same kernel) and our
  Triton kernels alone (``triton``), on inputs already quantized and from bf16 input (our quantizer
  first); the epilogues (bias + GELU-tanh; bias + gate + residual) as dispatched (``ours``: on
  ``_scaled_mm`` + one gated-add pass where it serves the call) and fused in our kernel (``triton``) against
  ``_scaled_mm`` + torch's ops; the fused producers (GELU + quantization, modulated LayerNorm + quantization)
  against the op, then the quantizer; and SDXL's GEGLU projections with a · gelu(g) in the GEMM's epilogue, then
  the quantizer (``ours``), against the GEMM as dispatched writing both halves and the GEGLU quantizer
  (``two_kernels``) and fp16's ``F.linear`` + GEGLU, unquantized (stock). Device time from CUDA graphs
  (bench/common.py), TFLOP/s and ratios.
- ``e2e`` (fp8_e2e.csv): one pipeline call, ``--steps`` steps, in one process per model: stock eager;
  torch.compile (``--compile recipe``: bench/setups.py's ``stock+compile-graphs``, diffusers' recipe;
  ``regional``: fused QKV + ``compile_repeated_blocks(fullgraph=True)``, or the whole transformer
  compiled where diffusers names no repeated blocks: SD3, PixArt-Σ; ``--compile-mode``: torch.compile's
  mode for both regional peers, e.g. ``reduce-overhead`` for CUDA graphs as ours run, named in the row's
  label; ``compile+no-cublaslt-workspace``: that peer with cuBLASLt's workspace at 0 bytes for the whole process
  from its warm-up to its last call, as the FP8 tier's captured GEMMs run, ``runtime.blas``; the ratio columns take
  the faster compile row); ours lossless (``patch(pipe)``: CUDA graphs; ``patched+cat-join``: with SD3's joint
  attention in diffusers' data flow,
  the projections' outputs joined by torch.cat and F.linear on the output's token slices,
  ``patches.joint_attention.JOIN_IN_PLACE`` off; ``patched+unfused-qkv``: each q, k, v projection a GEMM of its
  own, ``patches.qkv_fusion.install`` skipped, for FLUX too; ``patched+two-pass-residual``: the blocks' gated
  feed-forward residuals as diffusers' two ops instead of one pass; ``patched+addcmul-residual``: that pass a
  ``torch.addcmul`` instead of our kernel); ours ``patch(pipe, precision="fp8")``,
  whose attention runs FP8 at the head dims of ``patches.fp8.FP8_ATTENTION`` (FLUX's 128), with every attention
  exact (``fp8+exact-attention``), with FP8 attention at every head dim the kernel takes
  (``fp8+attention-everywhere``: SD3's and SDXL's 64 too), and so with its Q·Kᵀ in int8 at every head dim
  (``fp8+attention-int8``: ``ops.attention.FP8_QK``; the FP8 attention the tier offered as an option before
  2026-11-29), with every GEMM on our Triton kernels (``fp8+triton-gemm``: none on ``torch._scaled_mm``), with the
  gated GEMMs' gate and residual fused into our kernel's epilogue instead of ``_scaled_mm`` + our gated add
  (``fp8+fused-gate-gemm``), with every GEMM on the pointer-load kernel instead of the TMA one
  (``fp8+pointer-gemm``), with every GEMM the TMA kernel can read on it rather than the kernel the tables time
  faster per shape (``fp8+tma-gemm``), with SD3's joint attention joining the projections' outputs by torch.cat
  instead of their GEMMs writing the join in place (``fp8+cat-join``: ``patches.joint_attention.JOIN_IN_PLACE``
  off), with each q, k, v projection a GEMM of its own (``fp8+unfused-qkv``), with the gated residuals on
  ``torch.addcmul`` (``fp8+addcmul-residual``), with that and each block norm's own SiLU and norm2's codes made
  by the feed-forward (``fp8+previous-glue``), with each block norm's modulation a GEMM of its own
  (``fp8+own-modulations``: ``patches.fp8.JOIN_MODULATIONS`` off), with each step's joined modulation GEMM run
  rather than served from the rows made before the first step (``fp8+own-step-modulations``:
  ``patches.modulation_table.STEP_TABLE`` off), with cuBLASLt's workspace left as torch sets it
  (``fp8+cublaslt-workspace``: ``ops.fp8_linear.NO_CUBLASLT_WORKSPACE`` off), with the cross-attentions' key and
  value projections (of the text) in FP8 too (``fp8+cross-kv-fp8``: ``patches.fp8.CROSS_KV_FP8``), with the UNet
  blocks' LayerNorms as stock's and each projection quantizing their outputs (``fp8+plain-norms``: no
  ``patches.fp8.Fp8LayerNorm``), with the GEGLU feed-forwards' first GEMM writing a · gelu(g) itself, half its
  columns, for the quantizer (``fp8+geglu-epilogue``: ``ops.fp8_geglu.GEGLU_EPILOGUE`` on), with an output our
  kernels can write where it lies (SD3's joined q, k, v) written by our kernel rather than by torch's GEMM a sample
  (``fp8+into-ours``) or by one torch GEMM copied in (``fp8+into-copy``: ``ops.fp8_linear.TORCH_GEMM_INTO``),
  with the original weights moved to the CPU's memory (``fp8+offloaded-originals``:
  ``sd_kernels.offload_originals``), with the UNets' ResNet convolutions in FP8 too (``fp8+fp8-conv``:
  ``patches.fp8_conv.FP8_CONV`` on), with the decode its pipeline upcasts to fp32 run so (``fp8+fp32-decode``:
  ``patches.bf16_decode.BF16_DECODE`` off, not the bf16 copy of the VAE's decoder), with every block norm's
  values written though its readers take the codes alone (``fp8+norm-values``: ``patches.codes_readers.CODES_ONLY``
  off), with each FLUX or SD3 block's norm1 its own kernel, not made by the block before with its last residual
  (``fp8+own-norms``: ``patches.dit_handoff.HAND_ON`` off), with torch adding the cuDNN convolutions' biases
  (``fp8+torch-conv-bias``: patches/conv_bias.py's ``serves`` false), with every pipeline call under
  ``torch.inference_mode()`` instead of the pipeline's own ``torch.no_grad()`` (``fp8+inference-mode``;
  ``patched+inference-mode`` for the lossless patch), with ``compile=True`` (``fp8+compile``: the graphs capture
  torch.compile'd calls), and with each denoising step (the guidance batch,
  the denoiser, the guidance combine, the scheduler's step) replayed from one graph (``fp8+step-graph``,
  ``patched+step-graph``: ``cuda_graph="step"``); torchao's float8 dynamic row-wise quantization +
  fused QKV + regional compile (imported only here, only if installed; it changes the model in place, so it runs
  last). Per row the times of bench.dit and, against stock's image of the same seed, PSNR, SSIM and the final
  latents' relative error; and the GPU memory the row holds once warm (``gpu_gib``: allocated tensors, the CUDA
  graphs' outputs included) and its peak during the timed calls (``peak_gib``), both torch's allocated bytes: the
  intermediates a CUDA graph's replay writes lie in the graph's private pool, reserved and not counted, so rows
  that replay graphs and rows that run eagerly do not compare.
- ``layers`` (fp8_layers.csv): one transformer call patched with ``precision="fp8"``; for every
  quantized GEMM (a fused feed-forward counts as one), its relative error against the same layer in
  fp32 beside the error of the layer in the model's own dtype.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import os
import pathlib
import statistics
import sys
import time
from unittest import mock

import torch
import torch.nn.functional as F

from bench import common

MODELS = ("flux-dev", "sd3-medium", "pixart-sigma", "sdxl", "sd15")  # sd15: e2e rows only (no GEMM shapes listed)
ROWS = ("stock", "compile", "compile+no-cublaslt-workspace", "patched", "patched+step-graph", "patched+inference-mode",
        "patched+cat-join", "patched+unfused-qkv",
        "patched+two-pass-residual", "patched+addcmul-residual", "fp8", "fp8+exact-attention",
        "fp8+attention-everywhere", "fp8+attention-int8", "fp8+triton-gemm", "fp8+fused-gate-gemm", "fp8+pointer-gemm",
        "fp8+tma-gemm", "fp8+cat-join", "fp8+unfused-qkv", "fp8+addcmul-residual", "fp8+previous-glue",
        "fp8+own-modulations", "fp8+own-step-modulations", "fp8+cublaslt-workspace", "fp8+cross-kv-fp8",
        "fp8+plain-norms", "fp8+geglu-epilogue", "fp8+into-ours", "fp8+into-copy", "fp8+offloaded-originals",
        "fp8+fp8-conv", "fp8+fp32-decode", "fp8+norm-values", "fp8+own-norms", "fp8+torch-conv-bias",
        "fp8+inference-mode",
        "fp8+compile", "fp8+step-graph", "torchao")
MODES = ("ops", "e2e", "layers")
# (name, M, K, N, epilogue) at 1024²: FLUX batch 1 (4096 image + 512 text tokens), the others with
# guidance (batch 2): SD3 4096 image tokens, PixArt-Σ 4096, SDXL 4096 (640 ch) and 1024 (1280 ch) a sample.
SHAPES = {
    "flux-dev": [("qkv", 4608, 3072, 3072, ""), ("ff_up", 4096, 3072, 12288, "gelu"),
                 ("ff_down", 4096, 12288, 3072, "gate_res"), ("single_proj_mlp", 4608, 3072, 12288, "gelu"),
                 ("single_proj_out", 4608, 15360, 3072, "gate_res"), ("modulation", 1, 3072, 18432, ""),
                 ("single_modulation", 1, 3072, 9216, ""), ("modulation", 2, 3072, 18432, ""),
                 ("modulation", 4, 3072, 18432, ""), ("modulation", 8, 3072, 18432, ""),
                 ("modulation", 16, 3072, 18432, "")],
    "sd3-medium": [("qkv", 8192, 1536, 1536, ""), ("ff_up", 8192, 1536, 6144, "gelu"),
                   ("ff_down", 8192, 6144, 1536, "gate_res"), ("modulation", 2, 1536, 9216, ""),
                   ("modulation", 8, 1536, 9216, "")],
    "pixart-sigma": [("qkv", 8192, 1152, 1152, ""), ("ff_up", 8192, 1152, 4608, "gelu"),
                     ("ff_down", 8192, 4608, 1152, "gate_res"), ("cross_kv", 600, 1152, 1152, "")],
    "sdxl": [("qkv_640", 8192, 640, 640, ""), ("geglu_640", 8192, 640, 5120, "geglu"),
             ("ff_down_640", 8192, 2560, 640, ""),
             ("qkv_1280", 2048, 1280, 1280, ""), ("geglu_1280", 2048, 1280, 10240, "geglu"),
             ("ff_down_1280", 2048, 5120, 1280, "")],
}
DTYPES = {"flux-dev": torch.bfloat16}  # FLUX's own; the others fp16 as bench.dit


DTYPE_OVERRIDE: dict[str, torch.dtype] = {}  # --dtype: every model in that dtype


def _dtype(model: str) -> torch.dtype:
    return DTYPE_OVERRIDE.get("all") or DTYPES.get(model, torch.float16)


# ---------------------------------------------------------------------------------------------- ops


def _on_triton(f, *args, **kwargs) -> torch.Tensor:
    """``fp8_gemm`` on our Triton kernels only (none handed to ``torch._scaled_mm``)."""
    with mock.patch.object(f, "TORCH_GEMM", False):
        return f.fp8_gemm(*args, **kwargs)


def _geglu(y: torch.Tensor) -> torch.Tensor:
    a, g = y.chunk(2, -1)
    return a * F.gelu(g)


def _gemm_cases(model: str, name: str, m: int, k: int, n: int, epilogue: str) -> list[common.Case]:
    f = importlib.import_module("sd_kernels.ops.fp8_linear")  # sd_kernels.ops.fp8_linear is also a function

    dtype = _dtype(model)
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    w = torch.randn(n, k, device="cuda", dtype=dtype) / k**0.5
    bias = torch.randn(n, device="cuda", dtype=dtype)
    a_q, s_a = f.quantize_rows(x)
    w_q, s_w = f.quantize_weight(w)
    scaled = lambda a, s: torch._scaled_mm(a, w_q.t(), scale_a=s[:, None], scale_b=s_w[None, :],  # noqa: E731
                                           bias=bias, out_dtype=dtype, use_fast_accum=True)
    flops = 2 * m * k * n
    shape = f"{name}:{m}x{k}x{n}"
    cases = [common.Case("fp8_gemm", shape, dtype, "quantized", flops=flops, impls={
        "stock": lambda: F.linear(x, w, bias), "scaled_mm": lambda: scaled(a_q, s_a),
        "ours": lambda: f.fp8_gemm(a_q, s_a, w_q, s_w, bias, out_dtype=dtype),
        "triton": lambda: _on_triton(f, a_q, s_a, w_q, s_w, bias, out_dtype=dtype)}),
        common.Case("fp8_linear", shape, dtype, "from_bf16" if dtype == torch.bfloat16 else "from_fp16", flops=flops,
                    impls={"stock": lambda: F.linear(x, w, bias), "scaled_mm": lambda: scaled(*f.quantize_rows(x)),
                           "ours": lambda: f.fp8_linear(x, w_q, s_w, bias, reuse=False)})]
    if epilogue == "gelu":
        cases.append(common.Case("fp8_epilogue", shape, dtype, "bias+gelu", flops=flops, impls={
            "stock": lambda: F.gelu(F.linear(x, w, bias), approximate="tanh"),
            "scaled_mm": lambda: F.gelu(scaled(a_q, s_a), approximate="tanh"),
            "ours": lambda: f.fp8_gemm(a_q, s_a, w_q, s_w, bias, "tanh", out_dtype=dtype)}))
        h = torch.randn(m, n, device="cuda", dtype=dtype)
        cases.append(common.Case("fp8_quant", f"gelu:{m}x{n}", dtype, "gelu+quant", bytes=m * n * 3, impls={
            "stock": lambda: f.quantize_rows(F.gelu(h, approximate="tanh")),
            "ours": lambda: f.quantize_rows(h, "tanh")}))
    if epilogue == "geglu":  # the feed-forward's hidden rows, as codes for the second GEMM
        fg = importlib.import_module("sd_kernels.ops.fp8_geglu")
        cases.append(common.Case("fp8_geglu", shape, dtype, "gemm+geglu+quant", flops=flops, impls={
            "stock": lambda: _geglu(F.linear(x, w, bias)),
            "two_kernels": lambda: f.quantize_rows(f.fp8_gemm(a_q, s_a, w_q, s_w, bias, out_dtype=dtype), "none",
                                                   gated=True),
            "ours": lambda: f.quantize_rows(fg.fp8_gemm_geglu(a_q, s_a, w_q, s_w, bias, "none", dtype))}))
    if epilogue == "gate_res":
        batch = 2 if m % 2 == 0 else 1
        gate = torch.randn(batch, 1, n, device="cuda", dtype=dtype)
        res = torch.randn(batch, m // batch, n, device="cuda", dtype=dtype)
        a3, s3 = a_q.view(batch, m // batch, k), s_a.view(batch, m // batch)
        cases.append(common.Case("fp8_epilogue", shape, dtype, "bias+gate+residual", flops=flops, impls={
            "stock": lambda: res + gate * F.linear(x.view(batch, -1, k), w, bias),
            "scaled_mm": lambda: res + gate * scaled(a_q, s_a).view(batch, -1, n),
            "ours": lambda: f.fp8_gemm(a3, s3, w_q, s_w, bias, gate=gate, residual=res, out_dtype=dtype),
            "triton": lambda: _on_triton(f, a3, s3, w_q, s_w, bias, gate=gate, residual=res, out_dtype=dtype)}))
    if name == "qkv":  # the producer of the projections' input: adaLN's modulated LayerNorm
        from sd_kernels.ops import layer_norm_modulated, layer_norm_modulated_fp8

        x3, sc, sh = x.view(1, m, k), torch.randn(1, k, device="cuda", dtype=dtype), torch.randn(1, k, device="cuda",
                                                                                               dtype=dtype)
        cases.append(common.Case("fp8_quant", f"layer_norm:{m}x{k}", dtype, "ln_mod+quant", bytes=m * k * 5, impls={
            "stock": lambda: f.quantize_rows(layer_norm_modulated(x3, None, None, 1e-6, sc, sh)),
            "ours": lambda: layer_norm_modulated_fp8(x3, None, None, 1e-6, sc, sh)}))
    return cases


def _few_rows_cases(model: str, name: str, m: int, k: int, n: int) -> list[common.Case]:
    """A GEMM of a few rows (adaLN modulation: one row per sample) streams its weight: each call here runs
    it on enough distinct weights to exceed L2 three times (as a step reads each block's weight from HBM
    once), ms and GB/s per call of all of them: ours, cuBLASLt's row-wise ``_scaled_mm``, and torch's bf16
    ``F.linear`` (on its own bf16 weights: twice the bytes; the GB/s column counts the FP8 codes' bytes
    for every row)."""
    f = importlib.import_module("sd_kernels.ops.fp8_linear")
    dtype = _dtype(model)
    copies = max(1, -(-3 * common.L2_BYTES // (n * k)))
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    a_q, s_a = f.quantize_rows(x)
    weights = [torch.randn(n, k, device="cuda", dtype=dtype) / k**0.5 for _ in range(copies)]
    codes = [f.quantize_weight(w) for w in weights]
    bias = torch.randn(n, device="cuda", dtype=dtype)

    def ours():
        return [f.fp8_gemm(a_q, s_a, w_q, s_w, bias, out_dtype=dtype) for w_q, s_w in codes]

    impls = {"stock": lambda: [F.linear(x, w, bias) for w in weights],
             "scaled_mm": lambda: [torch._scaled_mm(a_q, w_q.t(), scale_a=s_a[:, None], scale_b=s_w[None, :],
                                                    bias=bias, out_dtype=dtype, use_fast_accum=True)
                                   for w_q, s_w in codes],
             "ours": ours}
    return [common.Case("fp8_gemm", f"{name}:{m}x{k}x{n} x{copies}", dtype, "few_rows", bytes=copies * n * k,
                        flops=2 * m * k * n * copies, impls=impls)]


def run_ops(models: list[str], out: pathlib.Path, only: set[str] | None = None) -> list[dict]:
    rows = []
    for model in models:
        for name, m, k, n, epilogue in SHAPES.get(model, []):
            if only and name not in only:
                continue
            few = m <= 16 and not epilogue
            for case in (_few_rows_cases(model, name, m, k, n) if few else _gemm_cases(model, name, m, k, n, epilogue)):
                got = [{"model": model, **r} for r in common.measure(case)]
                for r in got:
                    ours = next(g["ms"] for g in got if g["impl"] == "ours")
                    r["ours_vs_this"] = round(ours / r["ms"], 3)
                common.append_csv(out / "fp8_ops.csv", got)
                rows += got
                print(common.format_table(got, ["model", "op", "shape", "variant", "impl", "ms", "TFLOP/s", "GB/s",
                                                "speedup_vs_stock", "ours_vs_this"]), flush=True)
                torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------------------------------------- e2e


@contextlib.contextmanager
def _regional_compile(pipe, quantize: bool, mode: str = "default"):
    """Fused QKV, (torchao's float8 row-wise dynamic quantization,) regional compile of the blocks in
    torch.compile's ``mode``, and the VAE's decode compiled in the same mode, in channels_last, as
    diffusers' recipe and diffusers-torchao's compile it (eager, it takes 88 ms of a FLUX image where ours
    takes 27: bench/results/2026-11-29-h200-dit-outside-steps). The compile row is undone on exit (blocks
    uncompiled, QKV unfused, the decode put back, dynamo reset), also where its set-up fails after the
    fusion, so that a row after it measures its own setup and not the fused projections or compiled
    blocks under it (the lossless patch serves fused projections too, in another layout); torchao's
    transformer is not: quantize_ replaces the weights in place (its row runs last)."""
    from bench.setups import compiled_methods

    with compiled_methods([(pipe.vae, "decode")], mode):
        with _regional_blocks(pipe, quantize, mode) as info:
            yield info


@contextlib.contextmanager
def _regional_blocks(pipe, quantize: bool, mode: str):
    """``_regional_compile``'s transformer: fused QKV, torchao's quantization, the blocks compiled."""
    transformer = pipe.transformer
    dtype = next(transformer.parameters()).dtype
    if quantize and dtype != torch.bfloat16:  # torchao asserts it deep inside quantize_
        raise ValueError(f"torchao's row-wise float8 takes bfloat16 models; this one is {dtype} (--dtype bf16)")
    transformer.fuse_qkv_projections()
    try:
        if quantize:
            from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

            quantize_(transformer, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))
        if getattr(transformer, "_repeated_blocks", None):
            transformer.compile_repeated_blocks(fullgraph=True, mode=mode)
            how = "regional-compile"
        else:  # SD3's and PixArt's transformers name no repeated blocks (diffusers 0.42.1): the whole forward
            transformer.compile(fullgraph=True, mode=mode)
            how = "whole-transformer-compile"
        yield {"e2e_mode": f"{how}+vae-decode-compile mode={mode}",
               "patched": "torchao float8 row-wise" if quantize else ""}
    finally:
        if not quantize:
            _uncompile(transformer)


def _uncompile(transformer) -> None:
    """Undo ``nn.Module.compile`` on every module (what compile_repeated_blocks calls per block) and the
    fused QKV; forget what dynamo compiled."""
    for module in transformer.modules():
        if getattr(module, "_compiled_call_impl", None) is not None:
            module._compiled_call_impl = None
    transformer.unfuse_qkv_projections()
    torch._dynamo.reset()


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
REGIONAL, TORCHAO = "compile-regional", "torchao-fp8+regional-compile"  # the regional peers' labels
NO_WORKSPACE = "+no-cublaslt-workspace"  # the compile peer's suffix: cuBLASLt without a workspace for the row


def _setup(row: str, compile_mode: str, torch_mode: str = "default"):
    """(label, a context factory for bench.dit.measure) of one e2e row; a regional peer compiled in
    another mode than torch.compile's default carries it in its label."""
    from bench.setups import PEER, VARIANTS, applied

    suffix = "" if torch_mode == "default" else f"[{torch_mode}]"
    if row == "compile" + NO_WORKSPACE:
        label, context = _setup("compile", compile_mode, torch_mode)
        return label + NO_WORKSPACE, lambda p: _no_workspace(context(p))
    if row == "stock":
        return "stock", lambda p: applied(p, VARIANTS["stock"])
    if row == "compile":
        if compile_mode == "regional":
            return REGIONAL + suffix, lambda p: _regional_compile(p, quantize=False, mode=torch_mode)
        return PEER, lambda p: applied(p, VARIANTS[PEER])
    if row == "patched":
        return "patched+graph", lambda p: applied(p, VARIANTS["patched+graph"])
    if row == "patched+step-graph":  # each denoising step one graph (``cuda_graph="step"``)
        return row, lambda p: applied(p, VARIANTS[row])
    if row == "patched+inference-mode":
        return "patched+graph+inference-mode", lambda p: _inference_mode(applied(p, VARIANTS["patched+graph"]))
    from sd_kernels.patches import joint_attention, modulation_split, qkv_fusion
    from sd_kernels.patches import layer_norm as layer_norm_patch

    from sd_kernels import reference

    fp8_ops = importlib.import_module("sd_kernels.ops.fp8_linear")  # the package's fp8_linear is the op
    residual_ops = importlib.import_module("sd_kernels.ops.residual")
    no_kernel = lambda *args: "the bench's ablation"  # noqa: E731
    addcmul = [(residual_ops, "gated_reason", no_kernel), (fp8_ops, "gated_reason", no_kernel)]
    ablations = {"cat-join": (joint_attention, "JOIN_IN_PLACE", False),
                 "unfused-qkv": (qkv_fusion, "install", lambda *args: None),
                 "two-pass-residual": (layer_norm_patch, "gated_add", reference.gated_add),
                 "addcmul-residual": addcmul}
    if row.startswith("patched+"):
        label = "patched+graph+" + row.removeprefix("patched+")
        return label, lambda p: _applied_with(p, VARIANTS["patched+graph"], ablations[row.removeprefix("patched+")])
    if row in FP8_ROWS:
        base = VARIANTS["patched+graph+compile+fp8" if row == "fp8+compile" else "patched+graph+fp8"]
        setup = dataclasses.replace(base, name=FP8_ROWS[row], graph="step" if row == "fp8+step-graph" else base.graph)
        from sd_kernels.patches import bf16_decode, codes_readers, conv_bias, dit_handoff, modulation_table
        from sd_kernels.patches import fp8 as fp8_patch
        from sd_kernels.patches import fp8_conv as fp8_conv_patch

        attention_ops = importlib.import_module("sd_kernels.ops.attention")
        fp8_attention = importlib.import_module("sd_kernels.ops.attention_fp8")

        changed = {"fp8+exact-attention": (fp8_patch, "FP8_ATTENTION", ()),
                   "fp8+attention-everywhere": (fp8_patch, "FP8_ATTENTION", fp8_attention.HEAD_DIMS),
                   "fp8+attention-int8": [(fp8_patch, "FP8_ATTENTION", fp8_attention.HEAD_DIMS),
                                          (attention_ops, "FP8_QK", dict.fromkeys(fp8_attention.HEAD_DIMS, "int8"))],
                   "fp8+triton-gemm": (fp8_ops, "TORCH_GEMM", False),
                   "fp8+fused-gate-gemm": (fp8_ops, "TORCH_GEMM_GATED", False),
                   "fp8+pointer-gemm": (fp8_ops, "TMA_GEMM", False),
                   "fp8+tma-gemm": (fp8_ops, "_tma_chosen", lambda key, device: True),
                   "fp8+cat-join": ablations["cat-join"], "fp8+unfused-qkv": ablations["unfused-qkv"],
                   "fp8+addcmul-residual": addcmul,
                   "fp8+previous-glue": [*addcmul, (fp8_patch.Fp8FeedForward, "reads_codes", lambda self: False),
                                         (modulation_split, "silu", lambda norm, emb: norm.silu(emb))],
                   "fp8+own-modulations": (fp8_patch, "JOIN_MODULATIONS", False),
                   "fp8+own-step-modulations": (modulation_table, "STEP_TABLE", False),
                   "fp8+cublaslt-workspace": (fp8_ops, "NO_CUBLASLT_WORKSPACE", False),
                   "fp8+cross-kv-fp8": (fp8_patch, "CROSS_KV_FP8", True),
                   "fp8+plain-norms": (fp8_patch, "_unet_norm", lambda *args: False),
                   "fp8+geglu-epilogue": (importlib.import_module("sd_kernels.ops.fp8_geglu"), "GEGLU_EPILOGUE",
                                          True),
                   "fp8+into-ours": (fp8_ops, "TORCH_GEMM_INTO", "ours"),
                   "fp8+into-copy": (fp8_ops, "TORCH_GEMM_INTO", "copy"),
                   "fp8+fp8-conv": (fp8_conv_patch, "FP8_CONV", True),
                   "fp8+fp32-decode": (bf16_decode, "BF16_DECODE", False),
                   "fp8+norm-values": (codes_readers, "CODES_ONLY", False),
                   "fp8+own-norms": (dit_handoff, "HAND_ON", False),
                   "fp8+torch-conv-bias": (conv_bias, "serves", lambda *args: False)}.get(row)
        if row == "fp8+offloaded-originals":
            return setup.name, lambda p: _offloaded(p, setup)
        if row == "fp8+inference-mode":
            return setup.name, lambda p: _inference_mode(_applied_with(p, setup, None))
        return setup.name, lambda p: _applied_with(p, setup, changed)
    if row != "torchao":  # a row named in ROWS but set up nowhere here
        raise ValueError(f"bench.fp8: no setup for the row {row!r}")
    return TORCHAO + suffix, lambda p: _regional_compile(p, quantize=True, mode=torch_mode)


# the tier's rows: the patch as shipped, with every attention exact / FP8 at every head dim it takes
# (patches.fp8.FP8_ATTENTION) / so with int8 Q·Kᵀ (ops.attention.FP8_QK), with every
# GEMM on our Triton kernels (fp8_linear.TORCH_GEMM), with the gated GEMMs' gate and residual in our kernel's
# epilogue (fp8_linear.TORCH_GEMM_GATED), with every GEMM on the pointer-load kernel instead of the
# TMA one (fp8_linear.TMA_GEMM), with every GEMM the TMA kernel can read on it (not the faster kernel of the
# tables per shape), with SD3's join made by torch.cat (patches.joint_attention.JOIN_IN_PLACE), with each q, k, v
# projection a GEMM of its own (qkv_fusion.install skipped), with the gated residuals in torch.addcmul (not our
# gated-add kernel), with that and each block norm's own SiLU and quantization and norm2's codes made by the
# feed-forward (the tier's glue before 2026-11-29's changes), with each block norm's modulation a GEMM of its own
# (patches.fp8.JOIN_MODULATIONS), with each step's joined modulation GEMM its own (not served from the rows made
# before the first step: patches.modulation_table.STEP_TABLE), with cuBLASLt's workspace as torch sets it
# (fp8_linear.NO_CUBLASLT_WORKSPACE), with the cross-attentions' key/value projections in FP8 too
# (patches.fp8.CROSS_KV_FP8), with the UNet blocks' LayerNorms writing no codes (no patches.fp8.Fp8LayerNorm), with
# the GEGLU feed-forwards' first GEMM writing a · gelu(g) itself (fp8_geglu.GEGLU_EPILOGUE on), with
# the originals moved to the CPU's memory, with the pipeline's fp32 decode (no bf16 copy: patches.bf16_decode), and
# with compile=True, and with each denoising step one graph (``cuda_graph="step"``)
FP8_ROWS = {row: "patched+graph+" + row for row in ("fp8", "fp8+exact-attention", "fp8+attention-everywhere",
                                                    "fp8+attention-int8", "fp8+triton-gemm", "fp8+fused-gate-gemm",
                                                    "fp8+pointer-gemm", "fp8+tma-gemm", "fp8+cat-join",
                                                    "fp8+unfused-qkv", "fp8+addcmul-residual", "fp8+previous-glue",
                                                    "fp8+own-modulations", "fp8+own-step-modulations",
                                                    "fp8+cublaslt-workspace", "fp8+cross-kv-fp8",
                                                    "fp8+plain-norms", "fp8+geglu-epilogue", "fp8+into-ours",
                                                    "fp8+into-copy", "fp8+offloaded-originals", "fp8+fp8-conv",
                                                    "fp8+fp32-decode", "fp8+norm-values", "fp8+own-norms",
                                                    "fp8+torch-conv-bias", "fp8+inference-mode")}
FP8_ROWS["fp8+compile"] = "patched+graph+compile+fp8"
FP8_ROWS["fp8+step-graph"] = "patched+step-graph+fp8"


@contextlib.contextmanager
def _applied_with(pipe, setup, changed: tuple | list | None):
    """``applied(pipe, setup)`` with ``changed`` = (module, attribute, value), or a list of them, set for the
    row's time."""
    from bench.setups import applied

    with contextlib.ExitStack() as stack:
        for switch in [changed] if isinstance(changed, tuple) else changed or []:
            stack.enter_context(mock.patch.object(*switch))
        with applied(pipe, setup) as record:
            yield record


@contextlib.contextmanager
def _inference_mode(context):
    """``context`` (the patch applied as usual), then every pipeline call of the row under ``torch.inference_mode()``
    instead of the pipeline's own ``torch.no_grad()``."""
    with context as record, torch.inference_mode():
        yield record


@contextlib.contextmanager
def _no_workspace(context):
    """``context`` (the compile peer's row) with cuBLASLt's workspace at 0 bytes for the whole process from its
    warm-up to its last call (torch 2.11 reads ``CUBLASLT_WORKSPACE_SIZE`` at every call; runtime/blas.py). A
    stream whose first cuBLASLt GEMM ran then would keep a 0-byte workspace that later GEMMs get at the default
    size: the regional peer runs on the default stream, whose workspace the stock row (always first) made. A
    ``CUBLASLT_WORKSPACE_SIZE`` set for the process is refused (the row would be mislabelled)."""
    from sd_kernels.runtime import blas

    if blas.ENV in os.environ:
        raise RuntimeError(f"compile{NO_WORKSPACE}: {blas.ENV} is set for the process already")
    os.environ[blas.ENV] = "0"
    try:
        with context as info:
            yield info
    finally:
        os.environ.pop(blas.ENV, None)


@contextlib.contextmanager
def _offloaded(pipe, setup):
    """``applied(pipe, setup)`` (the FP8 tier), then the originals moved to the CPU's memory for the row's time;
    its unpatch brings them back."""
    import sd_kernels
    from bench.setups import applied

    with applied(pipe, setup) as info:
        record = sd_kernels.offload_originals(pipe)
        info = {**info, "patched": f"{info.get('patched', '')} offloaded={record.quantized.offloaded_bytes}".strip()}
        yield info


def peer_columns(rows: list[dict]) -> dict[str, float]:
    """{ratio column: the peer's e2e_ms} of the peers measured in ``rows``, each at its best: vs_compile against
    the fastest compile row (the recipe's or a regional one, in any mode, with cuBLASLt's workspace or without),
    vs_torchao against torchao's."""
    from bench.setups import PEER

    found: dict[str, float] = {}
    for r in rows:
        variant, ms = r.get("variant", ""), r.get("e2e_ms")
        if not ms:
            continue
        column = ("vs_compile" if variant.startswith((PEER, REGIONAL)) else
                  "vs_torchao" if variant.startswith(TORCHAO) else None)
        if column is not None:
            found[column] = min(ms, found.get(column, ms))
    return found


def run_e2e(model: str, rows: list[str], args, out: pathlib.Path) -> list[dict]:
    from bench.dit import _extra_kwargs, measure
    from sd_kernels.models import build_pipeline, image_side
    from sd_kernels.testing import ssim

    if "torchao" in rows:
        try:
            import torchao  # noqa: F401
        except ImportError as exc:
            print(f"bench.fp8: torchao row skipped: torchao is not installed ({exc})", flush=True)
            rows = [r for r in rows if r != "torchao"]
    rows = [r for r in rows if r != "torchao"] + (["torchao"] if "torchao" in rows else [])  # in-place: last
    if rows[0] != "stock":
        rows = ["stock", *[r for r in rows if r != "stock"]]  # every quality column compares with stock
    env = common.environment()
    pipe = build_pipeline(model, "cuda", _dtype(model))
    pipe.set_progress_bar_config(disable=True)
    side = image_side(model, args.size or None)
    embeds = pipe.encode_prompt("a photograph", device="cuda", **_extra_kwargs(pipe.encode_prompt))[0]
    if not torch.isfinite(embeds).all():
        print(f"bench.fp8: {model}'s random text encoder is not finite in {_dtype(model)}", file=sys.stderr)
        return []
    ref: dict = {}
    images: dict = {}
    got = []
    for row in rows:
        label, context = _setup(row, args.compile, args.compile_mode)
        t0 = time.perf_counter()
        try:
            result = measure(pipe, label, side, args.steps, args.calls, ref, context=context, images=images)
            result["ssim"] = round(ssim(images[label], ref["image"]), 4)
            result["status"] = "ok"
        except Exception as exc:  # a row that fails must not hide the others
            result = {"variant": label, "status": f"error: {type(exc).__name__}: {str(exc)[:200]}"}
            if row == "stock":
                raise
        result.update(model=model, size=side, steps=args.steps, dtype=str(_dtype(model)).removeprefix("torch."),
                      **{k: env.get(k, "") for k in ("device", "torch", "triton", "diffusers", "date")})
        got.append(result)
        for r in got:
            for col, peer in peer_columns(got).items():
                if r.get("e2e_ms"):
                    r[col] = round(r["e2e_ms"] / peer, 3)
        print(f"[{time.perf_counter() - t0:6.1f} s] {model} {label}: {result}", flush=True)
        common.append_csv(out / "fp8_e2e.csv", [result], E2E_COLUMNS)
        torch.cuda.empty_cache()
    print(common.format_table(got, ["model", "variant", "warmup_s", "e2e_ms", "vs_compile", "vs_torchao", "step_ms",
                                    "psnr_db", "ssim", "latent_rel_err", "status"]), flush=True)
    return got


E2E_COLUMNS = ["model", "size", "steps", "dtype", "variant", "status", "warmup_s", "e2e_ms", "vs_compile", "vs_torchao",
               "step_ms", "psnr_db", "ssim", "latent_rel_err", "gpu_gib", "peak_gib", "kernels_ms", "patched", "device",
               "torch", "triton", "diffusers", "date"]


# ---------------------------------------------------------------------------------------------- layers


def _layer_reference(module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the layer in fp32, the layer in the model's dtype) on the same input, with its weights."""
    from sd_kernels.patches.fp8 import Fp8FeedForward
    from sd_kernels.patches.fp8_conv import Fp8Conv2d

    def run(dtype):
        xi = x.to(dtype)
        if isinstance(module, Fp8FeedForward):
            first, second = module.net[0].proj, module.net[2]
            h = F.linear(xi, first.weight.to(dtype), None if first.bias is None else first.bias.to(dtype))
            if module.gated:
                a, g = h.chunk(2, dim=-1)
                h = a * F.gelu(g, approximate=module.act)
            else:
                h = F.gelu(h, approximate=module.act)
            return F.linear(h, second.weight.to(dtype), None if second.bias is None else second.bias.to(dtype))
        bias = None if module.bias is None else module.bias.to(dtype)
        if isinstance(module, Fp8Conv2d):
            return F.conv2d(xi, module.weight.to(dtype), bias, padding=1)
        return F.linear(xi, module.weight.to(dtype), bias)

    return run(torch.float32), run(x.dtype)


def run_layers(model: str, args, out: pathlib.Path) -> list[dict]:
    from sd_kernels.patches.fp8 import Fp8FeedForward, Fp8Linear, _family
    from sd_kernels.patches.fp8_conv import Fp8Conv2d

    import sd_kernels
    from sd_kernels.models import build_pipeline, image_side
    from sd_kernels.testing import rel_err

    pipe = build_pipeline(model, "cuda", _dtype(model))
    pipe.set_progress_bar_config(disable=True)
    side = image_side(model, args.size or None)
    record = sd_kernels.patch(pipe, precision="fp8", cuda_graph=False)
    denoiser = pipe.transformer if getattr(pipe, "transformer", None) is not None else pipe.unet
    rows: list[dict] = []
    inner = {id(m) for ff in denoiser.modules() if isinstance(ff, Fp8FeedForward) for m in (ff.net[0].proj, ff.net[2])}

    def hook(name):
        def record_error(module, inputs, output):
            if len(rows) >= 4000 or not isinstance(inputs[0], torch.Tensor):
                return
            exact, own = _layer_reference(module, inputs[0])
            family = ("feed_forward_fused" if isinstance(module, Fp8FeedForward)
                      else "conv" if isinstance(module, Fp8Conv2d) else _family(name))
            rows.append({"model": model, "layer": name, "family": family,
                         "rows": inputs[0].numel() // inputs[0].shape[1 if family == "conv" else -1],
                "fp8_rel_err": f"{rel_err(output, exact):.3e}", "own_dtype_rel_err": f"{rel_err(own, exact):.3e}"})
        return record_error

    handles = [m.register_forward_hook(hook(n)) for n, m in denoiser.named_modules()
               if isinstance(m, Fp8FeedForward) or (isinstance(m, Fp8Linear) and id(m) not in inner)]
    try:
        from bench.dit import _extra_kwargs

        with torch.no_grad():
            pipe("a photograph", num_inference_steps=1, height=side, width=side, output_type="latent",
                 generator=torch.Generator("cuda").manual_seed(0), **_extra_kwargs(pipe.__call__))
    finally:
        for h in handles:
            h.remove()
        sd_kernels.unpatch(pipe)
    common.append_csv(out / "fp8_layers.csv", rows)
    by_family: dict[str, list[float]] = {}
    for r in rows:
        by_family.setdefault(r["family"], []).append(float(r["fp8_rel_err"]))
    own = statistics.median(float(r["own_dtype_rel_err"]) for r in rows) if rows else float("nan")
    print(f"{model}: {record.quantized.format() if record.quantized else ''}")
    for family, errs in sorted(by_family.items()):
        print(f"  {family:<20} {len(errs):4d} GEMMs  rel. error vs fp32: median {statistics.median(errs):.2e}, "
              f"max {max(errs):.2e}  (the layers in {_dtype(model)}: median {own:.2e})", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=pathlib.Path, required=True)
    ap.add_argument("--models", default="flux-dev", help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"e2e rows, of {', '.join(ROWS)} (stock always runs)")
    ap.add_argument("--shapes", default="", help="ops: only the GEMM shapes of these names (default: all), e.g. "
                                                 "modulation,single_modulation")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--calls", type=int, default=2, help="timed pipeline calls per row (median)")
    ap.add_argument("--size", type=int, default=0, help="image side (default: the model's, 1024)")
    ap.add_argument("--dtype", choices=("auto", "bf16", "fp16"), default="auto",
                    help="auto: FLUX bf16, the others fp16; torchao's row needs bf16")
    ap.add_argument("--compile", choices=("recipe", "regional"), default="recipe",
                    help="the compile row: bench/setups.py's recipe (whole forward) or regional compilation")
    ap.add_argument("--compile-mode", choices=COMPILE_MODES, default="default",
                    help="torch.compile's mode for the regional peers (compile --compile regional, torchao): "
                         "reduce-overhead adds CUDA graphs")
    args = ap.parse_args(argv)
    if args.dtype != "auto":
        DTYPE_OVERRIDE["all"] = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    models, modes, rows = (s.split(",") for s in (args.models, args.modes, args.rows))
    for what, given, known in (("--models", models, MODELS), ("--modes", modes, MODES), ("--rows", rows, ROWS)):
        if unknown := set(given) - set(known):
            ap.error(f"{what}: unknown {sorted(unknown)}; choose from {', '.join(known)}")
    if not torch.cuda.is_available():
        print("bench.fp8 needs a CUDA GPU", file=sys.stderr)
        return 2
    if torch.cuda.get_device_capability() < (8, 9):
        print(f"bench.fp8 needs FP8 tensor cores (sm_89+); this is {torch.cuda.get_device_name()}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"bench.fp8: {common.environment()}; random weights", flush=True)
    if "ops" in modes:
        run_ops(models, args.out, {s for s in args.shapes.split(",") if s})
    for model in models:
        if "layers" in modes:
            run_layers(model, args, args.out)
            torch.cuda.empty_cache()
        if "e2e" in modes:
            run_e2e(model, rows, args, args.out)
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
