"""End-to-end benchmarks: whole pipeline calls, one UNet step, one VAE decode; stock vs patched.

    python -m bench.e2e --out DIR [--selection quick|full] [--models sd15@512,sdxl] [--variants ...]
                        [--steps 20] [--no-ablation] [--max-minutes 9]

Every (model, variant) is one row of ``DIR/e2e.csv``, appended as soon as it is measured (a run
that is killed keeps what it measured); the paper's cumulative ablation goes to ``DIR/ablation.csv``.
Variants (``bench/setups.py``): stock eager (SDPA); stock + CUDA graph; the recipe,
``stock+compile-graphs`` (diffusers' speed recipe: channels_last, fused QKV, torch.compile fullgraph of
the UNet and the VAE decode with CUDA graphs); patched; patched + CUDA graph; patched + CUDA graph
+ compile (``patch(cuda_graph=True, compile=True)``); patched + the recipe's compile; asked for by name,
the lossy FP8 tier (``patched+graph+fp8``, ``patched+graph+compile+fp8``: ``patch(precision="fp8")``, GPUs
with FP8 tensor cores). Per row:

- ``e2e_ms``: one ``pipe(prompt)`` call, ``steps`` denoising steps at batch 1 with classifier-free
  guidance (UNet batch 2), fp16, output as a tensor; median of 7 calls after a warm-up call
  (the H100 machines' end-to-end times vary by several ms from call to call: a median of 2 did not hold).
  "+graph" variants call ``sd_kernels.patch(pipe, cuda_graph=True)`` (stock: with no op patched),
  which replays the UNet, the VAE decode and the text encoder from CUDA graphs and keeps the
  scheduler's timesteps on the host.
- ``text_ms`` / ``unet_steps_ms`` / ``decode_ms`` / ``overhead_ms``: where one more pipeline call's
  time goes: CUDA events around every text-encoder, UNet and VAE-decode call inside the call
  (summed per part), and the rest of its wall time (scheduler, guidance, pipeline Python, the GPU
  waiting for the host), split into ``lead_ms`` (from the call's start to the first model call's
  first kernel: host work while the GPU idles), ``between_ms`` (GPU time between the first model
  call and the end of the last one that no model call covers: the scheduler, guidance and copies,
  and any idling) and ``tail_ms`` (the rest: after the last model call); ``syncs``: the operations
  in that call that made the host wait for the GPU (``torch.cuda.set_sync_debug_mode``).
- ``it_per_s``: denoising steps per second, from the marginal cost of a step:
  (steps - 1) / (time of a steps-step call - time of a 1-step call). Text encoding and the decode
  cancel out; the scheduler and guidance stay in, as in the progress bar's it/s.
- ``unet_ms`` / ``vae_ms``: one UNet step (batch 2) / one VAE decode, steady state over back-to-back
  calls, run the variant's way: eager, compiled, or replayed from CUDA graphs ("+graph": the UNet
  through ``patch(cuda_graph=True)``'s graphs, input copies included; the VAE from a graph the bench
  captures). ``*_device_ms``: the same call replayed
  from a CUDA graph (for compiled variants: torch.compile + CUDA graph), the device time without the
  host's launch cost.
- ``peak_MB``: ``torch.cuda.max_memory_allocated`` from before the variant is set up until after its
  pipeline calls (compilation, graph capture and the weights included); ``peak_over_weights_MB``
  subtracts the weights of UNet, VAE and text encoders.
- ``warmup_s``: set-up (patch, compile, capture) plus the first pipeline call.
- ``*_rel_err``: relative L2 error of the UNet / VAE output against stock eager on the same inputs.

Random weights from the configs shipped in ``sd_kernels/configs`` unless a model is a local path.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import functools
import pathlib
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from sd_kernels.patches.record import set_instance_attr

from bench import common
from bench.report import print_summary
from bench.setups import ABLATION, DEFAULT_VARIANTS, NO_COMPILE, VARIANTS, Setup, Unsupported, applied, graphs_part

PROMPT = "a photograph of an astronaut riding a horse"
BATCH = 2  # one prompt with classifier-free guidance
ENV_FIELDS = ["device", "torch", "cuda", "triton", "diffusers", "date"]
FIELDS = ["model", "size", "variant", "status", "steps", "ops", "attention", "patched", "e2e_mode", "e2e_ms",
          "it_per_s", "text_ms", "unet_steps_ms", "controlnet_ms", "decode_ms",
          "overhead_ms", "lead_ms", "between_ms", "tail_ms", "syncs", "unet_ms", "unet_device_ms",
          "vae_ms", "vae_device_ms", "peak_MB", "peak_over_weights_MB", "warmup_s", "unet_rel_err", "vae_rel_err",
          *ENV_FIELDS]


CONTROLNET = "+controlnet"  # a model name's suffix: its ControlNet pipeline (one random ControlNet)


@dataclasses.dataclass(frozen=True)
class Target:
    model: str  # a shipped config, or a local pipeline directory (real weights); may end in CONTROLNET
    size: int  # image side in pixels

    @property
    def label(self) -> str:
        return f"{self.model}@{self.size}"

    @property
    def base(self) -> str:
        """The model without its ControlNet suffix."""
        return self.model.removesuffix(CONTROLNET)

    @property
    def controlnet(self) -> bool:
        return self.model.endswith(CONTROLNET)


SELECTIONS = {  # targets; the first gets every variant and the ablation
    "quick": ("sd15@512", "sd21@768", "sdxl@1024"),
    "full": ("sd15@512", "sd21@512", "sd21@768", "sdxl@1024"),
}
# Rough H100 seconds, for the estimate and --max-minutes: building a pipeline and autotuning the
# kernels for its shapes; an eager SD1.5 512² UNet step (batch 2, host-bound: 30 ms measured
# 2026-11-22); compiling UNet + VAE decoder (UNet alone: 61 s measured for SD1.5).
BUILD_S, STEP_S, COMPILE_S = 30.0, 0.03, {"sd15": 90.0, "sd21": 100.0, "sdxl": 300.0}


UNET_PIPELINES = ("StableDiffusionPipeline", "StableDiffusionXLPipeline")  # what this harness times


def parse_targets(text: str) -> list[Target]:
    """``"sd15@512,sdxl"`` → targets; the size defaults to the config's resolution (512 for a path);
    ``sd15+controlnet@512``: the shipped config's ControlNet pipeline. The errors name the item, not the
    option (``--models`` here, ``--model`` for ``sd-kernels bench``)."""
    from sd_kernels import models

    targets = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        model, _, size = item.partition("@")
        base = model.removesuffix(CONTROLNET)
        if size and not size.isdigit():
            raise ValueError(f"model {item!r}: the size must be pixels, e.g. sd21@768")
        if base != model and base not in models.list_configs():
            raise ValueError(f"model {item!r}: {CONTROLNET} needs a shipped config "
                             f"({', '.join(models.list_configs())})")
        if base not in models.list_configs() and not pathlib.Path(base).is_dir():
            raise ValueError(f"model {item!r}: neither a shipped config ({', '.join(models.list_configs())}) nor a "
                             "local pipeline directory")
        default = models.load_config(base).get("resolution", 512) if base in models.list_configs() else 512
        side = int(size) if size else default
        if side <= 0 or side % 64:
            raise ValueError(f"model {item!r}: the size, {side}, must be a positive multiple of 64")
        targets.append(Target(model, side))
    if not targets:
        raise ValueError("no model given")
    return targets


def check_unet(target: Target) -> None:
    """This harness times UNet pipelines: a shipped diffusion transformer is a ValueError pointing to bench.dit
    (the other harnesses that parse targets, bench.tune, bench.cold, take them)."""
    from sd_kernels import models

    if target.base in models.list_configs():
        kind = models.load_config(target.base)["pipeline"]
        if kind not in UNET_PIPELINES:
            raise ValueError(f"model {target.label!r}: a {kind}; this harness times the UNet pipelines (SD1.x/2.x, "
                             "SDXL), python -m bench.dit the diffusion transformers (PixArt-Σ, SD3, FLUX)")


def plan(selection: str, targets: Sequence[Target] | None = None, variants: Sequence[str] | None = None,
         ablation: bool = True) -> list[tuple[Target, Setup, str]]:
    """(target, setup, csv name) in run order. Without ``variants``: the first target gets every default
    variant and the ablation; the others (quick) those that compile nothing, or (full) every default."""
    if selection not in SELECTIONS:
        raise ValueError(f"--selection {selection!r}: choose from {', '.join(SELECTIONS)}")
    unknown = set(variants or ()) - set(VARIANTS)
    if unknown:
        raise ValueError(f"--variants: unknown {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    targets = list(targets) if targets else parse_targets(",".join(SELECTIONS[selection]))
    items = []
    for i, target in enumerate(targets):
        names = variants or (DEFAULT_VARIANTS if i == 0 or selection == "full" else NO_COMPILE)
        items += [(target, VARIANTS[n], "e2e.csv") for n in names]
        if i == 0 and ablation:
            items += [(target, s, "ablation.csv") for s in ABLATION]
    return items


def estimate_s(target: Target, setup: Setup, steps: int) -> float:
    """Rough H100 seconds for one plan item (measurements, warm-up, compilation)."""
    scale = (target.size / 512) ** 2  # SDXL at 1024² costs about 4x SD1.5 at 512², like its pixels
    run = scale * (3 + STEP_S * (3 * steps + 100))  # 3 pipeline calls, ~100 UNet-step-sized calls
    compile_s = COMPILE_S.get(target.base, 200.0) * (1.5 if target.controlnet else 1.0)  # a second model to compile
    return run + (compile_s if setup.slow_start else 0.0)


def steady_ms(fn: Callable[[], Any], calls: int = 10, repeats: int = 3) -> float:
    """Milliseconds per call of ``calls`` back-to-back calls (as a denoising loop issues them), CUDA
    events around the whole run, median of ``repeats`` runs, after 2 warm-up calls. The host may run
    ahead of the GPU: an eager model bound by Python costs its host time, one bound by the GPU its GPU
    time."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def unet_call(pipe, batch: int, dtype: torch.dtype, side: int | None = None,
              timestep: torch.Tensor | None = None) -> Callable[[], torch.Tensor]:
    """One UNet step on random inputs shaped as the pipeline's (latent ``side``, default the config's)."""
    unet = pipe.unet
    side = side or unet.config.sample_size
    dev = unet.device
    g = torch.Generator(device=dev).manual_seed(0)
    latent, ctx, kwargs = unet_inputs(unet.config, batch, side, dev, dtype, g, side * pipe.vae_scale_factor)
    t = torch.tensor(500, device=dev) if timestep is None else timestep
    return lambda: unet(latent, t, encoder_hidden_states=ctx, return_dict=False, **kwargs)[0]


def unet_inputs(cfg, batch: int, side: int, device, dtype: torch.dtype = torch.float32,
                generator: torch.Generator | None = None, pixels: int | None = None) -> tuple:
    """(latents, text context, keyword arguments) of one UNet call, random, shaped as a pipeline's:
    ``cfg`` is the UNet's config; SDXL's (``addition_embed_type`` "text_time") also get the pooled
    text embeddings and the size ids of a ``pixels``² image (default ``side``·8)."""
    r = functools.partial(torch.randn, device=device, dtype=dtype, generator=generator)
    latent = r(batch, cfg["in_channels"], side, side)
    ctx = r(batch, 77, cfg["cross_attention_dim"])
    kwargs: dict[str, Any] = {}
    if cfg.get("addition_embed_type") == "text_time":  # SDXL: pooled text embeddings and size ids
        pooled = cfg["projection_class_embeddings_input_dim"] - 6 * cfg["addition_time_embed_dim"]
        px = pixels or side * 8
        kwargs["added_cond_kwargs"] = {
            "text_embeds": r(batch, pooled),
            "time_ids": torch.tensor([[px, px, 0, 0, px, px]] * batch, device=device, dtype=dtype),
        }
    return latent, ctx, kwargs


def vae_call(pipe, dtype: torch.dtype, side: int | None = None) -> Callable[[], torch.Tensor]:
    side = side or pipe.unet.config.sample_size
    g = torch.Generator(device=pipe.vae.device).manual_seed(1)
    latent = torch.randn(1, pipe.vae.config.latent_channels, side, side, device=pipe.vae.device, dtype=dtype,
                         generator=g) / pipe.vae.config.scaling_factor
    return lambda: pipe.vae.decode(latent, return_dict=False)[0]


def pipeline_call(pipe, size: int, steps: int, **kwargs: Any) -> Callable[[], Any]:
    """One pipeline call at ``size``² with ``steps`` steps (``kwargs``: e.g. a ControlNet's image).
    The generator's device is read once, here: diffusers' ``pipe.device`` walks the VAE's modules
    twice (2–3 ms of host time on the H100 machine), the harness's cost, not the pipeline's."""
    device = pipe.device

    def call() -> Any:
        gen = torch.Generator(device=device).manual_seed(0)
        return pipe(PROMPT, num_inference_steps=steps, height=size, width=size, guidance_scale=7.5,
                    generator=gen, output_type="pt", return_dict=False, **kwargs)[0]

    return call


class Spans:
    """CUDA events around every call of some model methods, summed per label; the methods are
    wrapped as instance attributes on top of whatever the set-up put there, and put back after."""

    def __init__(self, calls: Sequence[tuple[object, str, str]]) -> None:
        self.calls = [(obj, name, label) for obj, name, label in calls if obj is not None]
        self.events: dict[str, list] = {label: [] for _, _, label in self.calls}

    def _timed(self, fn: Callable, label: str) -> Callable:
        def timed(*args, **kwargs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn(*args, **kwargs)
            end.record()
            self.events[label].append((start, end))
            return out

        return timed

    def __enter__(self) -> Spans:
        self.restores = [set_instance_attr(obj, name, self._timed(getattr(obj, name), label), "Spans",
                                           "it timed it") for obj, name, label in self.calls]
        return self

    def __exit__(self, *exc) -> None:
        for restore in reversed(self.restores):
            restore()

    def totals_ms(self) -> dict[str, float]:
        torch.cuda.synchronize()
        return {label: sum(s.elapsed_time(e) for s, e in pairs) for label, pairs in self.events.items()}

    def bounds(self) -> tuple[Any, Any] | None:
        """(the earliest start event, the latest end event) over every span, in GPU time; None if none."""
        pairs = [p for label in self.events.values() for p in label]
        if not pairs:
            return None
        anchor = pairs[0][0]
        key = anchor.elapsed_time
        return min((s for s, _ in pairs), key=key), max((e for _, e in pairs), key=key)


def breakdown(pipe, call: Callable[[], Any]) -> dict[str, Any]:
    """One more ``call()`` of ``pipe``, split into text encoding, UNet steps, VAE decode and the rest
    (see the module docstring), with the count of host syncs inside it."""
    import warnings

    encoders = [(getattr(pipe, p, None), "forward", "text_ms") for p in ("text_encoder", "text_encoder_2")]
    calls = [*encoders, (pipe.unet, "forward", "unet_steps_ms"), (pipe.vae, "decode", "decode_ms"),
             (getattr(pipe, "controlnet", None), "forward", "controlnet_ms")]
    # cuda_graph="step": the UNet call queues nothing, scheduler.step replays the whole step (guidance and
    # scheduler work included in unet_steps_ms; a step that falls back calls the UNet from inside it)
    calls.append((vars(pipe).get("_sd_kernels_whole_step"), "_run", "unet_steps_ms"))
    with Spans(calls) as spans:
        _sync()
        call_start = torch.cuda.Event(enable_timing=True)
        start = time.perf_counter()
        call_start.record()  # the GPU is idle: it reads the host's clock at the call's start
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")  # the call's own waits, not the two synchronize() around it
            try:
                call()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        _sync()
        total = (time.perf_counter() - start) * 1e3
        parts = spans.totals_ms()
        bounds = spans.bounds()
    syncs = sum("synchronizing CUDA operation" in str(w.message) for w in caught)
    out: dict[str, Any] = {k: round(v, 2) for k, v in parts.items()}
    out["overhead_ms"] = round(total - sum(parts.values()), 2)
    if bounds is not None:  # the overhead, split: before the first model call, between the calls, after the last
        first, last = bounds
        out["lead_ms"] = round(call_start.elapsed_time(first), 2)
        out["between_ms"] = round(first.elapsed_time(last) - sum(parts.values()), 2)
        out["tail_ms"] = round(out["overhead_ms"] - out["lead_ms"] - out["between_ms"], 2)
    out["syncs"] = syncs
    return out


def wall_ms(fn: Callable[[], Any]) -> float:
    _sync()
    t = time.perf_counter()
    fn()
    _sync()
    return (time.perf_counter() - t) * 1e3


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def weights_bytes(pipe) -> int:
    parts = ("unet", "vae", "text_encoder", "text_encoder_2", "controlnet")
    mods = [getattr(pipe, p, None) for p in parts]
    return sum(t.numel() * t.element_size() for m in mods if m is not None for t in m.parameters())


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


class Bench:
    """One pipeline (one target) and the stock outputs every variant's error is measured against."""

    def __init__(self, target: Target, steps: int, device: str = "cuda", dtype: torch.dtype = torch.float16,
                 repeats: int | None = None) -> None:
        from sd_kernels import models

        if repeats is None:
            repeats = 7 if device == "cuda" else 2  # a CPU run is a test of the plumbing
        self.target, self.steps, self.device, self.repeats = target, steps, device, repeats
        if target.controlnet:
            self.pipe = models.build_controlnet_pipeline(target.base, device=device, dtype=dtype)
            g = torch.Generator(device=device).manual_seed(2)
            self.call_kwargs = {"image": torch.rand(1, 3, target.size, target.size, device=device, dtype=dtype,
                                                    generator=g)}
        else:
            self.pipe = models.load_pipeline(target.model, device=device, dtype=dtype)
            self.call_kwargs = {}
        self.pipe.set_progress_bar_config(disable=True)
        self.weights = weights_bytes(self.pipe)
        self.pipe.scheduler.set_timesteps(steps, device=device)
        side = target.size // self.pipe.vae_scale_factor
        t = self.pipe.scheduler.timesteps[0].clone()  # its dtype, as the pipeline passes it (no recompiles)
        self.unet = unet_call(self.pipe, BATCH, dtype, side, t)
        self.vae = vae_call(self.pipe, dtype, side)
        self.ref = {"unet": self.unet().float(), "vae": self.vae().float()}

    def measure(self, setup: Setup) -> dict[str, Any]:
        """One row: set the pipeline up as ``setup``, time it, undo."""
        cuda = self.device == "cuda"
        row: dict[str, Any] = {"model": self.target.model, "size": self.target.size, "variant": setup.name,
                               "steps": self.steps, "ops": " ".join(setup.ops or ()) if setup.patched else "",
                               "attention": setup.attention or ""}
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        with applied(self.pipe, setup) as info:
            row.update(e2e_mode=info["e2e_mode"], patched=info["patched"])
            full = pipeline_call(self.pipe, self.target.size, self.steps, **self.call_kwargs)
            one = pipeline_call(self.pipe, self.target.size, 1, **self.call_kwargs)
            wall_ms(full)
            row["warmup_s"] = round(time.perf_counter() - t0, 1)
            wall_ms(one)
            e2e = statistics.median(wall_ms(full) for _ in range(self.repeats))
            first = statistics.median(wall_ms(one) for _ in range(self.repeats))
            row["e2e_ms"] = round(e2e, 2)
            row["it_per_s"] = round((self.steps - 1) * 1e3 / (e2e - first), 2) if e2e > first else ""
            if cuda:
                peak = torch.cuda.max_memory_allocated()
                row["peak_MB"] = round(peak / 2**20, 1)
                row["peak_over_weights_MB"] = round((peak - self.weights) / 2**20, 1)
                row.update(breakdown(self.pipe, full))
            for part, call in (("unet", self.unet), ("vae", self.vae)):
                row[f"{part}_rel_err"] = f"{rel_err(call(), self.ref[part]):.3e}"
                if not cuda:
                    row[f"{part}_ms"] = round(statistics.median(wall_ms(call) for _ in range(self.repeats)), 3)
                    continue
                if graphs_part(setup, part):  # replayed from graphs already (ours or inductor's)
                    steady = device_ms = steady_ms(call)
                else:
                    steady, device_ms = steady_ms(call), steady_ms(common.graphed(call))
                row[f"{part}_ms"] = round(steady, 3)
                row[f"{part}_device_ms"] = round(device_ms, 3)
        row["status"] = "ok"
        return row


class CsvLog:
    """Rows appended to ``folder/name`` as they come, header written once; a new header must match."""

    def __init__(self, folder: pathlib.Path, env: dict[str, str]) -> None:
        self.folder, self.env = folder, env
        folder.mkdir(parents=True, exist_ok=True)

    def append(self, name: str, row: dict[str, Any]) -> None:
        path = self.folder / name
        new = not path.exists() or path.stat().st_size == 0
        if not new:
            with open(path, newline="") as f:
                header = next(csv.reader(f), [])
            if header != FIELDS:
                raise ValueError(f"{path} has another schema (columns {header[:4]}...); write to another --out")
        with open(path, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=FIELDS, restval="")
            if new:
                w.writeheader()
            w.writerow({**row, **{k: self.env.get(k, "") for k in ENV_FIELDS}})


def run(items: list[tuple[Target, Setup, str]], out: pathlib.Path, steps: int, max_minutes: float,
        device: str = "cuda", dtype: torch.dtype = torch.float16, repeats: int | None = None) -> list[dict[str, Any]]:
    """Measure ``items`` in order, appending rows to ``out``'s CSVs; returns the rows."""
    from tqdm import tqdm

    log = CsvLog(out, common.environment())
    budget, start = max_minutes * 60, time.perf_counter()
    # The estimates are H100 seconds; elsewhere only the time already spent counts against the cap.
    est = {id(it): estimate_s(it[0], it[1], steps) if device == "cuda" else 0.0 for it in items}
    n_targets = len({t for t, _, _ in items})
    total = (sum(est.values()) + BUILD_S * n_targets) / 60
    print(f"bench.e2e: {len(items)} measurements of {n_targets} models"
          + (f", ~{total:.1f} min estimated on an H100" if device == "cuda" else "")
          + f", capped at {max_minutes:g} min; rows go to {out}/", flush=True)
    rows: list[dict[str, Any]] = []
    bench: Bench | None = None
    broken: dict[Target, str] = {}  # targets whose pipeline could not be built
    bar = tqdm(items, unit="run", dynamic_ncols=True)
    for item in bar:
        target, setup, name = item
        bar.set_description(f"{target.label} {setup.name}")
        row: dict[str, Any] = {"model": target.model, "size": target.size, "variant": setup.name, "steps": steps}
        try:
            if device != "cuda" and (setup.graph or setup.slow_start):
                if name != "ablation.csv":
                    raise Unsupported("CUDA graph and torch.compile variants need a GPU")
                setup = dataclasses.replace(setup, graph=False)  # the ablation's op choices still run
            if target in broken:
                raise Unsupported(f"the pipeline could not be built ({broken[target]})")
            if time.perf_counter() - start + est[id(item)] > budget:
                raise Unsupported(f"over the --max-minutes {max_minutes:g} budget")
            if bench is None or bench.target != target:
                bench = None
                _free()
                try:
                    with torch.inference_mode():
                        bench = Bench(target, steps, device, dtype, repeats)
                except Exception as exc:
                    broken[target] = _why(exc)
                    raise
            with torch.inference_mode():
                row = bench.measure(setup)
        except Unsupported as exc:
            row["status"] = f"skipped: {exc}"
        except Exception as exc:  # one broken variant must not hide the others' numbers
            row["status"] = f"error: {_why(exc)}"
            _sync()
        log.append(name, row)
        rows.append({**row, "csv": name})
        bar.write(f"  {target.label:<10} {setup.name:<26} {_brief(row)}", file=sys.stdout)
    bar.close()
    return rows


def _why(exc: Exception) -> str:
    first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first}"


def _free() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _brief(row: dict[str, Any]) -> str:
    if row.get("status") != "ok":
        return str(row.get("status"))
    g = lambda k: row.get(k, "-")
    return (f"e2e {g('e2e_ms')} ms, {g('it_per_s')} it/s, UNet {g('unet_ms')} ms, VAE {g('vae_ms')} ms, "
            f"peak {g('peak_MB')} MB, warm-up {g('warmup_s')} s")


def add_arguments(ap: argparse.ArgumentParser, models: bool = True) -> None:
    """The options ``python -m bench.e2e`` and ``sd-kernels bench`` share (the CLI names ``--model`` itself)."""
    ap.add_argument("--selection", default="quick", choices=sorted(SELECTIONS),
                    help="quick (~9 min estimated on an H100): SD1.5 all variants + ablation, SD2.1 768 and SDXL "
                    "1024 without compile; full: every model and variant (> 10 min: run it model by model)")
    if models:
        ap.add_argument("--models", help="comma-separated NAME[@SIZE] (shipped config or local pipeline "
                        "directory); default: the selection's")
    ap.add_argument("--variants", help=f"comma-separated, of {', '.join(VARIANTS)}; default: the selection's "
                    f"({', '.join(DEFAULT_VARIANTS)})")
    ap.add_argument("--steps", type=int, default=20, help="denoising steps (default 20)")
    ap.add_argument("--no-ablation", action="store_true", help="skip the paper's ablation")
    ap.add_argument("--max-minutes", type=float, default=9.0,
                    help="skip what would end past this many minutes (estimated; default 9)")


def items_from(args: argparse.Namespace) -> list[tuple[Target, Setup, str]]:
    if args.steps < 1:
        raise ValueError(f"--steps must be a positive integer, got {args.steps}")
    targets = parse_targets(args.models) if args.models else None
    for target in targets or ():
        check_unet(target)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()] if args.variants else None
    return plan(args.selection, targets, variants, ablation=not args.no_ablation)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=pathlib.Path, required=True, help="folder for e2e.csv and ablation.csv")
    add_arguments(ap)
    args = ap.parse_args(argv)
    try:
        items = items_from(args)
    except ValueError as exc:
        ap.error(str(exc))
    if not torch.cuda.is_available():
        print("bench.e2e needs a CUDA GPU (sd-kernels bench --device cpu runs the tiny model on CPU)", file=sys.stderr)
        return 2
    rows = run(items, args.out, args.steps, args.max_minutes)
    print_summary(rows)
    return 0 if all(r.get("status") == "ok" or str(r.get("status")).startswith("skipped") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
