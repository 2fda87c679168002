"""A latency model for the phone profiles: the roofline of each op, summed. A model, not a measurement.

    python -m sd_kernels.analysis.latency [--model sd15] [--profiles s23-ultra,iphone-14-pro-max] [--steps 20]

The paper (arXiv 2304.11267) reports 11.5 s for a 20-step 512² SD1.5 image on a Samsung S23 Ultra,
and −52% (S23 Ultra) / −33% (iPhone 14 Pro Max) latency against its baseline. We have no phone; this
module puts an estimate beside those figures. Each component (text encoder, one UNet call at batch 2
with guidance, the VAE decode) runs once on the meta device (shapes only: no memory, no weights),
with forward hooks recording every convolution, linear layer, normalization, activation and
attention. Each op costs the larger of its compute time (FLOPs / the profile's ``fp16_tflops``) and
its memory time (bytes moved / the profile's ``bandwidth_gbps``), counted two ways:

- ``baseline``: each op as separate kernels, the way a framework without fusion runs it (our reading
  of the paper's baseline): attention writes its scores and runs softmax as five kernels (max,
  subtract, exp, sum, divide); GroupNorm as mean, variance, normalize and affine; SiLU apart; GELU
  as the tanh approximation's 8 kernels; every 3×3 convolution direct.
- ``optimized``: the paper's kernels as the profile selects them: FlashAttention where the
  profile's fit rule allows it (K/V read once per block of ``flash_block[0]`` queries), else the
  partially fused softmax (scores written once, read three times, ``softmax(X)`` never written);
  GroupNorm (+ the SiLU after it) in one statistics pass and one apply pass; GEGLU in one kernel;
  each 3×3 stride-1 convolution as Winograd F(4×4, 3×3) where that is cheaper under the roofline
  (its transformed input, output and weights in memory, 36/16 and 36/9 the size), else direct.

Not counted (the same in both ways): residual adds, upsampling copies, the timestep embedding, the
scheduler and guidance arithmetic, kernel launch cost, caches. Peak FLOP/s and bandwidth are never
reached on a phone, so the absolute figure is a lower bound; the ratio between the two ways is the
model's point. The device figures and their sources are in docs/profiles.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

ELEM = 2  # bytes per element: fp16 everywhere
WAYS = ("baseline", "optimized")


@dataclasses.dataclass
class Op:
    """One recorded op: what it is, and per way (FLOPs, bytes moved)."""

    kind: str
    name: str
    cost: dict[str, tuple[float, float]]


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def _bytes(*shapes: tuple[int, ...]) -> float:
    return float(sum(_numel(s) for s in shapes) * ELEM)


def roofline_s(flops: float, nbytes: float, tflops: float, gbps: float) -> float:
    """Seconds of one op under the roofline: the slower of computing and moving its data."""
    return max(flops / (tflops * 1e12), nbytes / (gbps * 1e9))


def _conv(m: nn.Conv2d, x: tuple, y: tuple, tflops: float, gbps: float) -> dict[str, tuple[float, float]]:
    b, cin, _, _ = x
    _, cout, ho, wo = y
    kh, kw = m.kernel_size
    weight = _numel(tuple(m.weight.shape)) * ELEM
    direct = (2.0 * b * cout * ho * wo * (cin // m.groups) * kh * kw, _bytes(x, y) + weight)
    if (kh, kw) != (3, 3) or m.stride != (1, 1) or m.groups != 1 or m.dilation != (1, 1):
        return {"baseline": direct, "optimized": direct}
    tiles = b * math.ceil(ho / 4) * math.ceil(wo / 4)
    # F(4x4, 3x3): 6x6 input tiles; 36 elementwise GEMMs [tiles, cin] x [cin, cout]; transforms
    # B^T d B (2 * 6*6*6 multiply-adds per tile and channel) and A^T m A (2 * (4*6*6 + 4*4*6)).
    flops = 2.0 * tiles * 36 * cin * cout + tiles * (cin * 864 + cout * 480)
    v, mm = tiles * 36 * cin * ELEM, tiles * 36 * cout * ELEM  # transformed input and products
    winograd = (flops, _bytes(x, y) + 2 * v + 2 * mm + 36 * cin * cout * ELEM)
    best = min((direct, winograd), key=lambda fb: roofline_s(*fb, tflops, gbps))
    return {"baseline": direct, "optimized": best}


def _linear(m: nn.Linear, x: tuple, y: tuple) -> dict[str, tuple[float, float]]:
    rows = _numel(x[:-1])
    cost = (2.0 * rows * m.in_features * m.out_features, _bytes(x, y) + _numel(tuple(m.weight.shape)) * ELEM)
    return {"baseline": cost, "optimized": cost}


def _attention(heads: int, head_dim: int, batch: int, sq: int, sk: int, profile: Any) -> dict[str, tuple[float, float]]:
    flops = 4.0 * batch * heads * sq * sk * head_dim + 5.0 * batch * heads * sq * sk
    qo = 2 * batch * heads * sq * head_dim * ELEM  # Q read, O written
    kv = 2 * batch * heads * sk * head_dim * ELEM
    scores = batch * heads * sq * sk * ELEM
    # baseline: QK^T writes S; max, sub, exp, sum, div read 5 and write 3; PV reads P: 10 passes
    baseline = (flops, qo + kv + 10 * scores)
    if profile.attention_path(sq, sk, head_dim) == "flash":
        optimized = (flops, qo + kv * math.ceil(sq / profile.flash_block[0]))
    else:  # the partially fused softmax: S written once, read for max, for sum and by the fused matmul
        optimized = (flops, qo + kv + 4 * scores)
    return {"baseline": baseline, "optimized": optimized}


def _group_norm(x: tuple, silu_after: bool) -> dict[str, tuple[float, float]]:
    n = _bytes(x)
    # baseline: mean and variance (2 reads), normalize (read, write), affine (read, write), SiLU (read, write)
    baseline = (8.0 * _numel(x), (6 + 2 * silu_after) * n)
    return {"baseline": baseline, "optimized": (8.0 * _numel(x), 3 * n)}


def _elementwise(x: tuple, flops_per: float) -> dict[str, tuple[float, float]]:
    cost = (flops_per * _numel(x), 2 * _bytes(x))
    return {"baseline": cost, "optimized": cost}


def _geglu(gate: tuple) -> dict[str, tuple[float, float]]:
    n = _bytes(gate)
    # baseline: tanh-GELU as 8 kernels (x read 3 times, 7 intermediates written and read, 1 output
    # written) on the gate, then value * gelu (2 reads, 1 write); fused: 2 reads, 1 write
    return {"baseline": (20.0 * _numel(gate), 21 * n), "optimized": (20.0 * _numel(gate), 3 * n)}


def _shape(t: Any) -> tuple[int, ...] | None:
    if isinstance(t, (tuple, list)) and t:
        t = t[0]
    return tuple(t.shape) if isinstance(t, torch.Tensor) else None


def _heads(m: nn.Module) -> tuple[int, int] | None:
    """(heads, head_dim) of an attention module (diffusers' Attention, transformers' CLIP attention)."""
    heads = getattr(m, "heads", None) or getattr(m, "num_heads", None)
    q = getattr(m, "to_q", None) or getattr(m, "q_proj", None)
    if not heads or not isinstance(q, nn.Linear):
        return None
    return heads, q.out_features // heads


def trace(fn: Callable[[], Any], model: nn.Module, profile: Any) -> list[Op]:
    """The ops of one call ``fn()`` of ``model`` (on the meta device), costed both ways."""
    tflops, gbps = profile.fp16_tflops, profile.bandwidth_gbps
    ops: list[Op] = []
    names = {id(m): n for n, m in model.named_modules()}
    pending_norm: list[tuple[Op, tuple]] = []  # (a GroupNorm op, its output shape)

    def post(module: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        x, y = _shape(args[0] if args else kwargs.get("hidden_states")), _shape(out)
        if x is None or y is None:
            return
        name = names.get(id(module), type(module).__name__)
        silu = isinstance(module, nn.SiLU)
        if silu and pending_norm and ops and pending_norm[-1][0] is ops[-1] and pending_norm[-1][1] == x:
            # a SiLU on a GroupNorm's output right after it: fused in the optimized way, its own pass in the baseline
            norm, _ = pending_norm.pop()
            norm.cost = _group_norm(x, silu_after=True)
            return
        if isinstance(module, nn.Conv2d):
            cost, kind = _conv(module, x, y, tflops, gbps), "conv"
        elif isinstance(module, nn.Linear):
            cost, kind = _linear(module, x, y), "linear"
        elif isinstance(module, nn.GroupNorm):
            cost, kind = _group_norm(x, silu_after=False), "group_norm"
        elif isinstance(module, nn.LayerNorm):
            cost, kind = {w: (8.0 * _numel(x), 2 * _bytes(x)) for w in WAYS}, "layer_norm"  # one kernel both ways
        elif silu or type(module).__name__ in ("GELU", "QuickGELUActivation"):
            cost, kind = _elementwise(x, 8.0), "activation"
        elif type(module).__name__ == "GEGLU":
            cost, kind = _geglu(y), "geglu"  # the gate is the output's shape
        elif (hd := _heads(module)) is not None:
            ctx = kwargs.get("encoder_hidden_states")  # cross-attention (diffusers passes it by name)
            seq = x[-2] if len(x) == 3 else x[-1] * x[-2]
            keys = ctx.shape[-2] if isinstance(ctx, torch.Tensor) else seq
            cost, kind = _attention(hd[0], hd[1], x[0], seq, keys, profile), "attention"
        else:
            return
        op = Op(kind, name, cost)
        ops.append(op)
        if kind == "group_norm":
            pending_norm.append((op, y))

    handle = nn.modules.module.register_module_forward_hook(post, with_kwargs=True)
    try:
        with torch.no_grad():
            fn()
    finally:
        handle.remove()
    return ops


@dataclasses.dataclass
class Component:
    name: str
    calls: int
    ops: list[Op]

    def seconds(self, way: str, tflops: float, gbps: float) -> float:
        return self.calls * sum(roofline_s(*op.cost[way], tflops, gbps) for op in self.ops)

    def by_kind(self, way: str, tflops: float, gbps: float) -> dict[str, float]:
        out: dict[str, float] = {}
        for op in self.ops:
            out[op.kind] = out.get(op.kind, 0.0) + self.calls * roofline_s(*op.cost[way], tflops, gbps)
        return out


def sd_components(model: str, profile: Any, steps: int = 20) -> list[Component]:
    """The components of one image of a shipped SD config, traced on the meta device: the text
    encoder (2 calls: the prompt and the empty one), ``steps`` UNet calls at batch 2 (guidance),
    one VAE decode."""
    from sd_kernels import models

    pipe = models.build_pipeline(model, device="meta", dtype=torch.float16)
    unet, vae, enc = pipe.unet, pipe.vae, pipe.text_encoder
    side = unet.config.sample_size
    ids = torch.zeros(1, pipe.tokenizer.model_max_length, dtype=torch.long, device="meta")
    x = torch.zeros(2, unet.config.in_channels, side, side, device="meta", dtype=torch.float16)
    ctx = torch.zeros(2, ids.shape[1], unet.config.cross_attention_dim, device="meta", dtype=torch.float16)
    z = torch.zeros(1, vae.config.latent_channels, side, side, device="meta", dtype=torch.float16)
    return [
        Component("text_encoder", 2, trace(lambda: enc(ids), enc, profile)),
        Component("unet", steps, trace(lambda: unet(x, torch.tensor(10), encoder_hidden_states=ctx), unet, profile)),
        Component("vae_decode", 1, trace(lambda: vae.decode(z), vae, profile)),
    ]


def estimate(model: str, profile: Any, steps: int = 20) -> dict[str, Any]:
    """Seconds per image, per component and way, under ``profile``'s ``fp16_tflops`` and
    ``bandwidth_gbps`` (a ValueError names a profile without them)."""
    tflops, gbps = profile.fp16_tflops, profile.bandwidth_gbps
    if not tflops or not gbps:
        raise ValueError(f"profile {profile.name!r} has no fp16_tflops / bandwidth_gbps: no latency model for it")
    comps = sd_components(model, profile, steps)
    rows = {c.name: {w: c.seconds(w, tflops, gbps) for w in WAYS} for c in comps}
    total = {w: sum(r[w] for r in rows.values()) for w in WAYS}
    kinds = {w: {} for w in WAYS}
    for c in comps:
        for w in WAYS:
            for k, s in c.by_kind(w, tflops, gbps).items():
                kinds[w][k] = kinds[w].get(k, 0.0) + s
    return {"profile": profile.name, "model": model, "steps": steps, "fp16_tflops": tflops, "bandwidth_gbps": gbps,
            "components": rows, "total": total, "by_kind": kinds,
            "change": total["optimized"] / total["baseline"] - 1.0}


def format_estimate(e: dict[str, Any]) -> str:
    lines = [f"latency model (a roofline estimate, not a measurement): {e['model']}, {e['steps']} steps, "
             f"profile {e['profile']} ({e['fp16_tflops']} TFLOP/s fp16, {e['bandwidth_gbps']} GB/s)",
             f"  {'component':<14} {'baseline s':>11} {'optimized s':>12}"]
    for name, r in e["components"].items():
        lines.append(f"  {name:<14} {r['baseline']:11.2f} {r['optimized']:12.2f}")
    t = e["total"]
    lines.append(f"  {'total':<14} {t['baseline']:11.2f} {t['optimized']:12.2f}   ({e['change'] * 100:+.0f}%)")
    for way in WAYS:
        parts = ", ".join(f"{k} {s:.2f}" for k, s in sorted(e["by_kind"][way].items(), key=lambda kv: -kv[1]))
        lines.append(f"  {way} by op kind (s): {parts}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from sd_kernels.profiles import get_profile

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="sd15")
    ap.add_argument("--profiles", default="s23-ultra,iphone-14-pro-max,mobile-small")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args(argv)
    for name in args.profiles.split(","):
        print(format_estimate(estimate(args.model, get_profile(name), args.steps)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
