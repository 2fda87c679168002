"""Adapter switches under the patch: what a LoRA or IP-Adapter change costs, and that it takes effect.

    python -m bench.switch --out DIR [--model sd15] [--size 512] [--steps 20]

One pipeline with two random LoRA adapters ("a", "b": peft, rank 16 on the attention projections)
and one random IP-Adapter (``models.load_random_ip_adapters``). First the stock pipeline, eager,
gives a reference image for every adapter state below; then ``patch(pipe)`` with its defaults (CUDA
graphs on a GPU) and the states in turn: per state one row of ``DIR/switch.csv`` with

- ``switch_ms``: the change (``set_adapters`` / ``set_ip_adapter_scale``) plus the next image, whose
  graphs are re-captured because the change alters what the UNet computes (patches/cuda_graph.py);
- ``steady_ms``: one more image in that state (replayed); ``extra_ms`` = switch − steady, what the
  switch costs on top of an image;
- ``max_diff``: the largest difference, over the image in [0, 1], between the switched image and the
  stock image of that state: a stale graph (the previous adapter) shows as a large difference.
"""

from __future__ import annotations

import argparse
import csv
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any

FIELDS = ["state", "switch_ms", "steady_ms", "extra_ms", "max_diff", "stale_diff", "model", "size", "steps",
          "cuda_graph", "device", "torch", "triton", "diffusers", "date"]
# (state, what it changes): applied in this order after the warm-up in state "a".
STATES: list[tuple[str, Callable[[Any], None]]] = [
    ("a", lambda p: p.set_adapters(["a"])),
    ("b", lambda p: p.set_adapters(["b"])),
    ("a+b (0.5, 0.5)", lambda p: p.set_adapters(["a", "b"], [0.5, 0.5])),
    ("a again", lambda p: p.set_adapters(["a"])),
    ("a, IP scale 0.5", lambda p: p.set_ip_adapter_scale(0.5)),
]


def add_random_loras(unet, names=("a", "b"), rank: int = 16, seed: int = 0) -> None:
    """Random peft LoRA adapters (non-zero B: they change the image) on the attention projections."""
    import peft
    import torch

    for i, name in enumerate(names):
        torch.manual_seed(seed + i)
        config = peft.LoraConfig(r=rank, lora_alpha=rank, init_lora_weights=False,
                                 target_modules=["to_q", "to_k", "to_v", "to_out.0"])
        unet.add_adapter(config, adapter_name=name)


def build(model: str, device: str, dtype) -> tuple[Any, dict[str, Any]]:
    """The pipeline with its adapters, and the keyword arguments every call passes (the IP-Adapter's
    image embeddings, negative and positive, for classifier-free guidance)."""
    import torch

    from sd_kernels import models

    pipe = models.load_pipeline(model, device=device, dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    add_random_loras(pipe.unet)
    embed = 16
    models.load_random_ip_adapters(pipe.unet, 1, image_embed_dim=embed)
    pipe.unet.to(device=device, dtype=dtype)
    g = torch.Generator(device=device).manual_seed(3)
    image_embeds = torch.randn(2, 1, embed, device=device, dtype=dtype, generator=g)  # [negative, positive]
    return pipe, {"ip_adapter_image_embeds": [image_embeds]}


def measure(model: str, size: int, steps: int, device: str = "cuda") -> list[dict[str, Any]]:
    import torch

    import sd_kernels
    from bench.e2e import pipeline_call, wall_ms

    dtype = torch.float16 if device == "cuda" else torch.float32
    pipe, kwargs = build(model, device, dtype)
    image = pipeline_call(pipe, size, steps, **kwargs)
    refs = {}
    with torch.inference_mode():
        for state, change in STATES:  # the stock images, eager; the changes accumulate in this order
            change(pipe)
            refs[state] = image().float()
        pipe.set_adapters(["a"])
        pipe.set_ip_adapter_scale(1.0)
        record = sd_kernels.patch(pipe)
        for _ in range(2):  # capture, then one replay: the warm state
            image()
        rows, previous = [], refs["a"]
        for state, change in STATES:
            _sync(device)
            t = time.perf_counter()
            change(pipe)
            out = image().float()
            _sync(device)
            switch = (time.perf_counter() - t) * 1e3
            steady = wall_ms(image)
            rows.append({"state": state, "switch_ms": round(switch, 1), "steady_ms": round(steady, 1),
                         "extra_ms": round(switch - steady, 1),
                         "max_diff": f"{(out - refs[state]).abs().max().item():.3e}",
                         "stale_diff": f"{(previous - refs[state]).abs().max().item():.3e}",
                         "model": model, "size": size, "steps": steps, "cuda_graph": record.cuda_graph})
            previous = refs[state]
        sd_kernels.unpatch(pipe)
    return rows


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=pathlib.Path, required=True, help="folder for switch.csv")
    ap.add_argument("--model", default="sd15")
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: the logic only, no timing")
    args = ap.parse_args(argv)
    from bench import common

    env = common.environment()
    rows = measure(args.model, args.size, args.steps, args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "switch.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS, restval="", extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({**r, **{k: env.get(k, "") for k in FIELDS if k in env}})
    for r in rows:
        print(f"  {r['state']:<16} switch + image {r['switch_ms']:>8} ms, image {r['steady_ms']:>7} ms, "
              f"extra {r['extra_ms']:>7} ms, max diff vs stock {r['max_diff']} (stale would be {r['stale_diff']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
