"""FP8 attention (ops.attention_fp8) against our exact attention and torch's SDPA, at the self-attention
of the DiTs and SDXL (1024², and FLUX at other sizes): time, TFLOP/s and accuracy in one run.

    python -m bench.ops_attention_fp8 --out DIR [--quick] [--case FLUX --case SD3 ...]
    python -m bench.ops_attention_fp8 --out DIR --accuracy     # anywhere (CPU): the algorithm's error

Shapes (B, H, S, D): FLUX.1 (1, 24, 4608, 128: 4,096 image + 512 text tokens, one sample: guidance
is distilled; and at 768², 1536² and 2048²: 2,304, 9,216 and 16,384 image tokens + 512), SD3-medium
(2, 24, 4429, 64: 4,096 + 333, batch 2 for guidance), SDXL's two self-attention levels (2, 10, 4096,
64) and (2, 20, 1024, 64). PixArt-Σ's 16 heads of 72 are listed as not covered (the FP8 kernel takes
head dims 64 and 128). Inputs are bf16 (``--dtype float16`` for fp16), diffusers' transposed views of
[B, S, H, D].

Rows per shape:
- ``fp8[QK/PV]``: each of the four modes (Q·Kᵀ in int8 or e4m3, P·V in e4m3 or the input dtype), each
  of its configs timed (``config``: the Triton kernel's BLOCK_M×keys, warps and stages; on Hopper, for
  e4m3 P·V, ``hopper NCx64``: the Hopper kernel with NC consumer warpgroups), the best one marked
  ``best``; ``prepass[QK/PV]``: the K/V quantization alone (part of the fp8 rows' time);
- ``ours_exact``: ``ops.attention`` as the lossless patch runs it (the Hopper wgmma kernel where the
  profile takes it), ``ours_flash``: the Triton flash kernel, ``ours_wgmma``: the wgmma kernel
  (where it runs);
- ``sdpa_flash``, ``sdpa_cudnn``: torch's SDPA with one backend (left out, with the reason, where
  it refuses).
Times are device times from CUDA graphs over rotating inputs (bench.common.time_graph_ms); TFLOP/s
counts 4·S_q·S_k·D per head; ``vs_exact`` and ``vs_sdpa_flash`` are speed ratios (> 1: faster than
that row); ``rel_err`` is ‖out − ref‖/‖ref‖ with ref = SDPA on the fp32 upcast inputs. Rows go to
DIR/ops_attention_fp8.csv as they are measured, stamped with device, versions and date.

``--accuracy`` measures the algorithm alone, on any device: ``reference.attention_fp8`` (what the
kernel computes, up to fp32 accumulation) in each mode against exact float64 attention, over one batch
of two heads of 4,096 queries and keys at head dims 64 and 128, bf16 inputs: random (σ 1, and σ 2 for
Q: a peaked softmax) and with outliers (two of Q's channels 10x, K offset by 8 on every 8th channel),
beside stock bf16 attention (the inputs' own rounding, fp32 softmax, output rounded to bf16), to
DIR/accuracy.csv.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import pathlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench import common
from sd_kernels.ops import attention_fp8, flash_attention
from sd_kernels.testing import rel_err

fp8 = importlib.import_module("sd_kernels.ops.attention_fp8")
attn = importlib.import_module("sd_kernels.ops.attention")
wgmma = importlib.import_module("sd_kernels.ops.attention_wgmma")

SHAPES = [  # (name, (B, H, S, D))
    ("FLUX 1024²", (1, 24, 4608, 128)),
    ("FLUX 768²", (1, 24, 2816, 128)),
    ("FLUX 1536²", (1, 24, 9728, 128)),
    ("FLUX 2048²", (1, 24, 16896, 128)),
    ("SD3 1024²", (2, 24, 4429, 64)),
    ("PixArt-Σ 1024²", (2, 16, 4096, 72)),
    ("SDXL 1024² 64²", (2, 10, 4096, 64)),
    ("SDXL 1024² 32²", (2, 20, 1024, 64)),
]
MODES = [(qk, pv) for qk in fp8.QK_MODES for pv in fp8.PV_MODES]
COLUMNS = ["case", "shape", "impl", "config", "best", "ms", "TFLOP/s", "vs_exact", "vs_sdpa_flash", "rel_err", "note"]


def _qkv(b, h, s, d, dtype):
    return tuple(torch.randn(b, s, h, d, device="cuda", dtype=dtype).transpose(1, 2) for _ in range(3))


def _sdpa(backend):
    def run(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v)

    return run


def _exact_impls() -> dict:
    impls = {"ours_exact": attn.attention, "ours_flash": flash_attention}
    impls["ours_wgmma"] = lambda q, k, v: wgmma.attention_wgmma(q, k, v)
    impls["sdpa_flash"] = _sdpa(SDPBackend.FLASH_ATTENTION)
    impls["sdpa_cudnn"] = _sdpa(SDPBackend.CUDNN_ATTENTION)
    return impls


def _fp8_impls(d: int, quick: bool, hopper: bool) -> list[tuple[str, str, object]]:
    """(impl, config, fn): every mode with every config of the head dim's list (the Triton kernel's, and
    where ``hopper``, the Hopper kernel's with 2 and 3 consumer warpgroups for ``pv="fp8"``) and its
    pre-pass, or (quick) with its default config (as ops.attention_fp8 picks it)."""
    rows = []
    for qk, pv in MODES:
        name = f"fp8[{qk}/{pv}]"
        if quick:
            rows.append((name, "default", functools.partial(attention_fp8, qk=qk, pv=pv)))
            continue
        for cfg in fp8._CONFIGS[d]:
            label = f"{cfg.kwargs['BLOCK_M']}x{fp8.KEY_BLOCK} w{cfg.num_warps} s{cfg.num_stages}"
            rows.append((name, label, functools.partial(_fp8_with, qk=qk, pv=pv, config=cfg)))
        if hopper and pv == "fp8":
            for nc in (2, 3):
                rows.append((name, f"hopper {nc}x64", functools.partial(_fp8_with, qk=qk, pv=pv, n_consumers=nc)))
        rows.append((f"prepass[{qk}/{pv}]", "-", functools.partial(_prepass, qk=qk, pv=pv)))
    return rows


def _fp8_with(q, k, v, qk, pv, config=None, n_consumers=None):
    return fp8._attention_fp8(q, k, v, q.shape[-1] ** -0.5, qk, pv, config=config, n_consumers=n_consumers)


def _prepass(q, k, v, qk, pv):
    return fp8.quantize_kv(k, v, qk, pv)


def run_case(name: str, shape: tuple[int, ...], dtype: torch.dtype, quick: bool, env: dict) -> list[dict]:
    b, h, s, d = shape
    base = {"case": name, "shape": "x".join(map(str, shape)), **env}
    flops = 4 * b * h * s * s * d
    inputs = _qkv(b, h, s, d, dtype)
    ref = F.scaled_dot_product_attention(*(t.float() for t in inputs))
    nxt = common.rotating(functools.partial(_qkv, b, h, s, d, dtype), 3 * inputs[0].numel() * inputs[0].element_size())
    candidates = [(n, "-", fn) for n, fn in _exact_impls().items()]
    if d in fp8.HEAD_DIMS:
        candidates += _fp8_impls(d, quick, hopper=fp8._hopper_reason(inputs[0], "fp8", fp8.KEY_BLOCK) is None)
    rows = []
    for impl, config, fn in candidates:
        row = {**base, "impl": impl, "config": config}
        try:
            out = fn(*inputs)
            if not impl.startswith("prepass"):
                row["rel_err"] = f"{rel_err(out, ref):.3e}"
            ms = common.time_graph_ms(lambda fn=fn, nxt=nxt: fn(*nxt()))
        except Exception as exc:  # a backend or config that refuses this shape, or does not compile
            row["note"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:100]}"
        else:
            row.update({"ms": round(ms, 5), "TFLOP/s": round(flops / ms / 1e9, 1)})
        rows.append(row)
        print({k: row.get(k, "") for k in COLUMNS}, flush=True)
    if d not in fp8.HEAD_DIMS:
        rows.append({**base, "impl": "fp8", "note": f"not covered: head dim {d} (the FP8 kernel takes 64 and 128)"})
    _ratios(rows)
    del inputs, ref, nxt
    torch.cuda.empty_cache()
    return rows


def _ratios(rows: list[dict]) -> None:
    """Mark each fp8 mode's fastest config, and every row's speed against ours_exact and sdpa_flash."""
    timed = [r for r in rows if "ms" in r]
    by = {r["impl"]: r["ms"] for r in timed if r["config"] == "-"}
    for impl in {r["impl"] for r in timed if r["impl"].startswith("fp8")}:
        best = min((r for r in timed if r["impl"] == impl), key=lambda r: r["ms"])
        best["best"] = "yes"
    for r in timed:
        for col, ref in (("vs_exact", "ours_exact"), ("vs_sdpa_flash", "sdpa_flash")):
            if ref in by:
                r[col] = round(by[ref] / r["ms"], 3)


ACCURACY_INPUTS = {
    "random": (1.0, False),
    "random, peaked (σ_q 2)": (2.0, False),
    "outliers": (1.0, True),
}


def _accuracy_inputs(s: int, d: int, amp: float, outliers: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, s, d, generator=gen) for _ in range(3))
    q = q * amp
    if outliers:
        q = q * torch.where(torch.arange(d) < 2, 10.0, 1.0)
        k = k + torch.where(torch.arange(d) % 8 == 0, 8.0, 0.0)
    return tuple(t.to(torch.bfloat16) for t in (q, k, v))


def accuracy(out: pathlib.Path, s: int = 4096) -> list[dict]:
    """The relative error of each mode's algorithm against exact attention (see the module docstring)."""
    from sd_kernels import reference

    env = {**common.environment(), "dtype": "bfloat16"}
    rows = []
    for d in fp8.HEAD_DIMS:
        for name, (amp, outliers) in ACCURACY_INPUTS.items():
            q, k, v = _accuracy_inputs(s, d, amp, outliers)
            exact = reference.attention(q.double(), k.double(), v.double())
            errs = {"stock bf16": rel_err(reference.attention(q, k, v), exact)}
            for qk, pv in MODES:
                errs[f"fp8[{qk}/{pv}]"] = rel_err(reference.attention_fp8(q, k, v, None, qk, pv), exact)
            for impl, err in errs.items():
                row = {"inputs": name, "shape": f"1x2x{s}x{d}", "impl": impl, "rel_err": f"{err:.3e}", **env}
                rows.append(row)
                print(row, flush=True)
            common.append_csv(out / "accuracy.csv", rows[-len(errs):], ["inputs", "shape", "impl", "rel_err", *env])
    print(common.format_table(rows, ["inputs", "shape", "impl", "rel_err"]))
    return rows


def summary(rows: list[dict]) -> list[dict]:
    """The rows the printout shows: each exact row, each mode's best (or default) config, and every row
    that has no time (a refusal, or a shape the FP8 kernel does not cover, which has no config)."""
    return [r for r in rows if r.get("best") == "yes" or r.get("config") in ("-", "default") or "ms" not in r]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=pathlib.Path, required=True, help="folder for ops_attention_fp8.csv")
    ap.add_argument("--quick", action="store_true", help="each mode's default config only, no pre-pass rows")
    ap.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    ap.add_argument("--accuracy", action="store_true", help="the algorithm's error only (any device)")
    ap.add_argument("--case", action="append", default=[], help="only the shapes whose name contains this "
                    "(repeatable; e.g. FLUX, SD3, SDXL)")
    args = ap.parse_args()
    if args.accuracy:
        args.out.mkdir(parents=True, exist_ok=True)
        accuracy(args.out)
        return
    if not torch.cuda.is_available():
        raise SystemExit("bench.ops_attention_fp8 needs a CUDA GPU")
    args.out.mkdir(parents=True, exist_ok=True)
    dtype = getattr(torch, args.dtype)
    env = {**common.environment(), "dtype": args.dtype}
    rows = []
    for name, shape in SHAPES:
        if args.case and not any(c.lower() in name.lower() for c in args.case):
            continue
        case_rows = run_case(name, shape, dtype, args.quick, env)
        common.append_csv(args.out / "ops_attention_fp8.csv", case_rows, COLUMNS + list(env))
        rows += case_rows
    print(f"\n{env['device']}, torch {env['torch']}, triton {env['triton']}, {env['date']}, {args.dtype}")
    print(common.format_table(summary(rows), COLUMNS))


if __name__ == "__main__":
    main()
