"""NCHW against channels_last for one UNet step, stock and patched: ``python -m bench.layout_check --out DIR
[--model sd15] [--latent 64]`` (GPU). Batch 2, fp16, random weights. Times: ms per step replayed from a
CUDA graph of 3 steps (VAE rows: decodes of one latent); the ``+graph`` rows use the patch's own
``cuda_graph=True`` (timed by
``triton.testing.do_bench``). rel_err against the stock NCHW step. Writes DIR/layout-MODEL.json.
The layouts are forced here (``ops=`` without "channels_last", then ``unet.to(channels_last)``), so
the rows do not depend on what the active profile chooses."""

from __future__ import annotations

import argparse
import json
import pathlib

import torch
from sd_kernels.patches import PATCHERS

import sd_kernels
from bench.common import environment, time_graph_ms, time_ms
from sd_kernels.models import build_pipeline
from sd_kernels.testing import rel_err


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=pathlib.Path, required=True)
    ap.add_argument("--model", default="sd15")
    ap.add_argument("--latent", type=int, default=64)
    args = ap.parse_args(argv)
    pipe = build_pipeline(args.model, device="cuda", dtype=torch.float16)
    unet = pipe.unet
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.float16, generator=g)

    x, t = randn(2, unet.config.in_channels, args.latent, args.latent), torch.tensor(500, device="cuda")
    ehs = randn(2, 77, unet.config.cross_attention_dim)
    extra = {}
    if args.model == "sdxl":
        extra = {"added_cond_kwargs": {"text_embeds": randn(2, 1280), "time_ids": randn(2, 6)}}
    ops = tuple(op for op in PATCHERS if op != "channels_last")  # the layout is forced below

    def step():
        return unet(x, t, encoder_hidden_states=ehs, **extra).sample

    rows = {}
    with torch.inference_mode():
        ref = step().double()
        for name, patched, graph in (("stock", False, False), ("patched", True, False), ("patched+graph", True, True)):
            for cl in (False, True):
                unet.to(memory_format=torch.channels_last if cl else torch.contiguous_format)
                if patched:
                    sd_kernels.patch(pipe, ops=ops, cuda_graph=graph)
                try:
                    out = step()
                    ms = time_ms(step) if graph else time_graph_ms(step, calls=3)
                    rows[name + ("+cl" if cl else "")] = {"ms": ms, "rel_err": rel_err(out, ref)}
                finally:
                    sd_kernels.unpatch(pipe)
                    unet.to(memory_format=torch.contiguous_format)
                print(name + ("+cl" if cl else ""), rows[name + ("+cl" if cl else "")], flush=True)
        # The VAE decode of the same latents (1 image per prompt: the first half of the batch).
        vae, z = pipe.vae, x[:1] / pipe.vae.config.scaling_factor
        ref = vae.decode(z).sample.double()
        for name, patched in (("vae stock", False), ("vae patched", True)):
            for cl in (False, True):
                vae.to(memory_format=torch.channels_last if cl else torch.contiguous_format)
                if patched:
                    sd_kernels.patch(vae, ops=ops)
                try:
                    out = vae.decode(z).sample
                    key = name + ("+cl" if cl else "")
                    ms = time_graph_ms(lambda: vae.decode(z).sample, calls=3)
                    rows[key] = {"ms": ms, "rel_err": rel_err(out, ref)}
                finally:
                    sd_kernels.unpatch(vae)
                    vae.to(memory_format=torch.contiguous_format)
                print(key, rows[key], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"layout-{args.model}.json").write_text(json.dumps({"env": environment(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
