"""What a whole-step CUDA graph could take off a denoising step: the tensor ops a pipeline runs per
step outside its models (classifier-free-guidance glue, ``scale_model_input``, ``scheduler.step``).

    python -m bench.step_ops [--model tiny] [--out DIR]
    python -m bench.step_ops --gpu sd15@512 [--out DIR]   # their measured device time, per scheduler,
                                                          # and what whole-step graphs could take off

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
from sd_kernels.patches.scheduler import HOST_SCHEDULERS
from torch.utils._python_dispatch import TorchDispatchMode

# The schedulers the pipeline mode gives host timesteps (patches/scheduler.py): SD pipelines' usual ones.
SCHEDULERS = HOST_SCHEDULERS


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


def glue_ms(model: str = "sd15", size: int = 512, steps: int = 20, repeats: int = 5,
            patch_kwargs: dict | None = None) -> dict[str, dict]:
    """On the GPU, per scheduler: where one ``patch(pipe, **patch_kwargs)`` call's time outside the
    models goes (bench.e2e's breakdown, median of ``repeats`` calls): ``between_ms``, GPU time
    between the first model call and the last that no model call covers (the ops counted above,
    the graphs' copies, any idling), and ``lead_ms``, host time before the first model call."""
    import statistics

    import diffusers

    import sd_kernels
    from bench.e2e import breakdown, pipeline_call
    from sd_kernels import models

    pipe = models.build_pipeline(model, device="cuda", dtype=torch.float16)
    pipe.set_progress_bar_config(disable=True)
    config, rows = pipe.scheduler.config, {}
    sd_kernels.patch(pipe, **(patch_kwargs or {}))
    call = pipeline_call(pipe, size, steps)
    for name in SCHEDULERS:
        sd_kernels.unpatch(pipe)
        pipe.scheduler = getattr(diffusers, name).from_config(config)
        sd_kernels.patch(pipe, **(patch_kwargs or {}))  # the host-timesteps patch is per scheduler
        with torch.no_grad():
            call(), call()
            parts = [breakdown(pipe, call) for _ in range(repeats)]
        rows[name] = {k: statistics.median(p[k] for p in parts) for k in ("between_ms", "lead_ms", "overhead_ms")}
        rows[name]["between_per_step_us"] = round(rows[name]["between_ms"] / steps * 1e3, 1)
    sd_kernels.unpatch(pipe)
    return rows


def _device_ms(fn, repeats: int) -> float:
    """Median device time of ``fn()`` with the host ahead of the GPU (a sleep kernel queued first)."""
    import statistics

    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        torch.cuda._sleep(100_000_000)  # ~50 ms: the host queues all of fn's work before the GPU reaches it
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def whole_step_ceiling(model: str = "sd15", size: int = 512, steps: int = 20, repeats: int = 5,
                       guidance: float = 7.5) -> dict[str, dict]:
    """What a whole-step CUDA graph could take off, at best, per scheduler: the device time of the
    denoising loop (guidance batching, UNet, guidance combine, ``scheduler.step``; ``steps`` steps,
    one prompt) run two ways under ``patch(pipe)``, with the host ahead of the GPU:

    - ``loop_ms``: as diffusers' loop runs it: the UNet from its graphs (with their input copies and
      output clone), everything else eagerly;
    - ``whole_step_ms``: one CUDA graph per step index that this bench captures around the very same
      code (the patched UNet's forward inside): no input copies or output clones, no launch gaps
      (UniPC's graphs keep its coefficient vector's copy from a pinned host buffer, which PyTorch
      may reuse after the capture: its ``max_diff`` says whether the replay still matched). It is a
      ceiling, not a mode: replaying it needs a denoising loop of one's own (see docs/benchmarks.md).

    ``max_diff``: the largest difference between the two loops' final latents."""
    import sd_kernels
    from bench.e2e import PROMPT
    from sd_kernels import models

    pipe = models.build_pipeline(model, device="cuda", dtype=torch.float16)
    side = size // pipe.vae_scale_factor
    with torch.no_grad():
        cond, uncond = pipe.encode_prompt(PROMPT, "cuda", 1, True)[:2]
        emb = torch.cat([uncond, cond])
        start = torch.randn(1, pipe.unet.config.in_channels, side, side, device="cuda",
                            generator=torch.Generator("cuda").manual_seed(0)).half()
        rows = {name: _ceiling_row(pipe, name, emb, start, steps, repeats, guidance) for name in SCHEDULERS}
    sd_kernels.unpatch(pipe)
    return rows


def _ceiling_row(pipe, name: str, emb: torch.Tensor, start: torch.Tensor, steps: int, repeats: int,
                 guidance: float) -> dict:
    import diffusers

    import sd_kernels
    from sd_kernels.profiles import using_profile

    sd_kernels.unpatch(pipe)
    sched = pipe.scheduler = getattr(diffusers, name).from_config(pipe.scheduler.config)
    record = sd_kernels.patch(pipe)
    graphed_unet = pipe.unet  # its forward replays the patch's graphs
    captured = vars(pipe.unet)["forward"].forward  # the method those graphs capture

    def unet_fn(*args, **kwargs):
        with using_profile(record.profile_spec):  # as the graphs' wrapper runs it
            return captured(*args, **kwargs)

    def step(latents, t, unet, t_unet):
        x = sched.scale_model_input(torch.cat([latents] * 2), t)
        uncond_eps, cond_eps = unet(x, t_unet, encoder_hidden_states=emb, return_dict=False)[0].chunk(2)
        return sched.step(uncond_eps + guidance * (cond_eps - uncond_eps), t, latents, return_dict=False)[0]

    def loop():
        sched.set_timesteps(steps, device="cuda")  # on the host: the patch's set_timesteps
        latents = start.clone()
        for t in sched.timesteps:
            latents = step(latents, t, graphed_unet, t)  # a host timestep: the graphs copy it in
        return latents

    loop()
    torch.cuda.manual_seed(0)  # Euler ancestral's noise: the same draws in both loops
    want = loop()
    loop_ms = _device_ms(loop, repeats)
    sched.set_timesteps(steps, device="cuda")
    static, pool, graphs = start.clone(), torch.cuda.graph_pool_handle(), []
    latents = static
    on_device = [t.to("cuda") for t in sched.timesteps]  # inside a capture nothing is copied from the host
    for t, t_unet in zip(sched.timesteps, on_device):  # a capture runs nothing: the scheduler's state advances
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            latents = step(latents, t, unet_fn, t_unet)
        graphs.append(graph)

    def replay():
        static.copy_(start)
        for graph in graphs:
            graph.replay()

    torch.cuda.manual_seed(0)
    replay()
    diff = (latents.float() - want.float()).abs().max().item()
    whole_ms = _device_ms(replay, repeats)
    return {"loop_ms": round(loop_ms, 3), "whole_step_ms": round(whole_ms, 3),
            "ceiling_ms": round(loop_ms - whole_ms, 3), "max_diff": diff}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="a shipped config (the ops do not depend on its size)")
    ap.add_argument("--out", type=pathlib.Path, default=None, help="write step_ops.json here")
    ap.add_argument("--gpu", default=None, metavar="MODEL@SIZE",
                    help="instead: on the GPU, the device time between model calls of a patch(pipe) call per "
                         "scheduler (e.g. sd15@512), written to step_glue.json")
    args = ap.parse_args(argv)
    if args.gpu:
        model, _, size = args.gpu.partition("@")
        rows = glue_ms(model, int(size or 512))
        for name, row in rows.items():
            print(f"{name:<34} between models {row['between_ms']:6.2f} ms ({row['between_per_step_us']} us/step), "
                  f"before the first {row['lead_ms']:5.2f} ms, overhead {row['overhead_ms']:5.2f} ms")
        ceiling = whole_step_ceiling(model, int(size or 512))
        for name, row in ceiling.items():
            print(f"{name:<34} loop {row['loop_ms']:7.2f} ms, whole-step graphs {row['whole_step_ms']:7.2f} ms: "
                  f"ceiling {row['ceiling_ms']:5.2f} ms per image (max diff {row['max_diff']:.1e})")
        out = {"model": args.gpu, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "between_models": rows, "whole_step_ceiling": ceiling}
        name = "step_glue.json"
    else:
        rows = count_step_ops(args.model)
        for name, row in rows.items():
            print(f"{name:<34} {row['per_step']:5.1f} ops per step outside the models")
        out, name = {"model": args.model, "rows": rows}, "step_ops.json"
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / name).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
