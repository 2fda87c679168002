"""What a whole-step CUDA graph could take off a denoising step: the tensor ops a pipeline runs per
step outside its models (classifier-free-guidance glue, ``scale_model_input``, ``scheduler.step``).

    python -m bench.step_ops [--model tiny] [--out DIR]

Runs one pipeline call of 10 and one of 20 steps per scheduler (CPU is enough: the ops a step runs
do not depend on the device) with the UNet, the VAE decode and the text encoder called with
counting off, and counts the ATen ops that make a tensor of more than one element and are not views
(on a GPU each is a kernel launch; views and scalar timestep arithmetic are not). Per step =
(count at 20 steps − count at 10) / 10. Replaying them from a graph removes their launch gaps, not
the kernels; fusing them removes most of their device time: either way at most their device time,
a few µs each on latent-sized tensors.
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SCHEDULERS = ("PNDMScheduler", "DDIMScheduler", "EulerDiscreteScheduler", "EulerAncestralDiscreteScheduler",
              "DPMSolverMultistepScheduler", "UniPCMultistepScheduler")


class _Count(TorchDispatchMode):
    """Counts non-view ops with a tensor output of more than one element while ``on``."""

    def __init__(self) -> None:
        super().__init__()
        self.on = True
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.on and not func.is_view:
            outs = out if isinstance(out, (tuple, list)) else (out,)
            if any(isinstance(o, torch.Tensor) and o.numel() > 1 for o in outs):
                self.ops[str(func.overloadpacket)] += 1
        return out


def _uncounted(count: _Count, fn):
    def call(*args, **kwargs):
        count.on = False
        try:
            return fn(*args, **kwargs)
        finally:
            count.on = True

    return call


def count_step_ops(model: str = "tiny") -> dict[str, dict]:
    """scheduler → {"per_step": ops per step outside the models, "ops": the 20-step call's by op}."""
    import diffusers

    from sd_kernels import models

    pipe = models.build_pipeline(model)
    pipe.set_progress_bar_config(disable=True)
    count = _Count()
    for part, method in (("unet", "forward"), ("vae", "decode"), ("text_encoder", "forward"),
                         ("text_encoder_2", "forward")):
        obj = getattr(pipe, part, None)
        if obj is not None:
            setattr(obj, method, _uncounted(count, getattr(obj, method)))
    side = pipe.unet.config.sample_size * pipe.vae_scale_factor
    config, rows = pipe.scheduler.config, {}
    for name in SCHEDULERS:
        pipe.scheduler = getattr(diffusers, name).from_config(config)
        totals = {}
        for steps in (10, 20):
            count.ops.clear()
            with torch.no_grad(), count:
                pipe("a cat", num_inference_steps=steps, height=side, width=side,
                     generator=torch.Generator().manual_seed(0), output_type="pt")
            totals[steps] = sum(count.ops.values())
        rows[name] = {"per_step": (totals[20] - totals[10]) / 10, "ops": dict(count.ops.most_common())}
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="a shipped config (the ops do not depend on its size)")
    ap.add_argument("--out", type=pathlib.Path, default=None, help="write step_ops.json here")
    args = ap.parse_args(argv)
    rows = count_step_ops(args.model)
    for name, row in rows.items():
        print(f"{name:<34} {row['per_step']:5.1f} ops per step outside the models")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "step_ops.json").write_text(json.dumps({"model": args.model, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
