"""The multi-process half of test_parallel.py and test_cp_plans.py: each process of ``torchrun --nproc_per_node 2``
(gloo, CPU) runs every case on the tiny configs, then cp_plans_worker.py's, and writes what it saw to
``OUT/rank<r>.json``; the tests read those. One launch for every case: each process pays its imports once.

Cases: CFG-parallel SD1.5- and SDXL-shaped pipelines against one process (latents; the reference ops:
the split is what is tested, the ops have their own tests) and exactly unpatched; FLUX under diffusers'
Ulysses context parallelism with sd_kernels' attention (the kernels, through the interpreter), patched
after and before ``enable_parallelism``, against one process, and exactly unpatched; FLUX under a ring
config, with the keys and values gathered for one attention call; the clear errors
(a batch the processes do not divide, a seed per process, mixed profiles under either split, heads the
Ulysses degree does not divide); the VAE decode split by rows (``enable_split_decode``). The splits of
the modulations and of the decode run on the reference ops too: the kernels under context parallelism are
the attention's, in the Ulysses and ring cases.
"""

import contextlib
import dataclasses
import functools
import json
import os
import pathlib
import sys
import time
import traceback

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("SD_KERNELS_AUTOTUNE_CACHE", "off")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from sd_kernels.patches import cfg_parallel, context_parallel, cuda_graph  # noqa: E402

import sd_kernels  # noqa: E402
from sd_kernels import models  # noqa: E402
from sd_kernels.profiles import get_profile  # noqa: E402

PROMPT = "a photo of a cat"
SIDE = 64
TEXT = 16  # FLUX's T5 tokens: 8 a process under Ulysses 2


@contextlib.contextmanager
def env(name, value):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


def build(name):
    pipe = models.build_pipeline(name)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def latents(pipe, seed=0, **kw):
    if "transformer" in pipe.components:
        kw.setdefault("max_sequence_length", TEXT)
    with torch.no_grad():
        return pipe(PROMPT, num_inference_steps=2, generator=torch.Generator().manual_seed(seed), height=SIDE,
                    width=SIDE, output_type="latent", **kw).images


@functools.cache
def flux_one() -> torch.Tensor:
    """One process's latents of the tiny FLUX pipeline through the kernels (the same seeded weights as every
    ``build("tiny-flux")``): what the cases under context parallelism compare with, made once."""
    with sd_kernels.patched(pipe := build("tiny-flux")):
        return latents(pipe)


def rel(a, b) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def error_of(fn) -> str | None:
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def cfg_case(name):
    pipe = build(name)
    stock = latents(pipe)
    with env("SD_KERNELS_BACKEND", "reference"):
        with sd_kernels.patched(pipe):
            one = latents(pipe)
        record = sd_kernels.patch(pipe, parallel="cfg")
        call = vars(pipe.unet)["forward"]
        batches = []
        inner = call.inner
        call.inner = lambda *a, **k: batches.append(a[0].shape[0]) or inner(*a, **k)
        split, again = latents(pipe), latents(pipe)
        summary = record.summary()
        sd_kernels.unpatch(pipe)
    return {"rel": rel(split, one), "again_equal": torch.equal(split, again), "batches": batches,
            "sum": float(split.double().sum()),
            "summary": summary, "unpatched_equal": torch.equal(latents(pipe), stock),
            "forward_restored": "forward" not in vars(pipe.unet) and "set_timesteps" not in vars(pipe.scheduler)}


def errors_case(rank):
    pipe = build("tiny")
    out = {}
    with env("SD_KERNELS_BACKEND", "reference"):
        sd_kernels.patch(pipe, parallel="cfg")
        out["no_guidance"] = error_of(lambda: latents(pipe, guidance_scale=1.0))
        out["seed_per_process"] = error_of(lambda: latents(pipe, seed=rank))
        sd_kernels.unpatch(pipe)
        cpu = get_profile("cpu")
        mine = cpu if rank == 0 else dataclasses.replace(cpu, name="cpu-other", flash_min_keys=cpu.flash_min_keys + 1)
        out["mixed_profiles"] = error_of(lambda: sd_kernels.patch(pipe, profile=mine, parallel="cfg"))
        out["mixed_left_unpatched"] = sd_kernels.patches.patch_record(pipe) is None
    return out


def _cp_config():
    from diffusers import ContextParallelConfig

    return ContextParallelConfig(ulysses_degree=2)


def _counting_forward_op(counts):
    original = context_parallel._forward_op

    def run(*args, **kwargs):
        counts.append(args[1].shape)
        return original(*args, **kwargs)

    context_parallel._forward_op = run


def _stock_processors(transformer) -> bool:
    from diffusers.models.transformers.transformer_flux import FluxAttention, FluxAttnProcessor

    procs = [m.processor for m in transformer.modules() if isinstance(m, FluxAttention)]
    return all(type(p) is FluxAttnProcessor and p._parallel_config is not None for p in procs)


def ulysses_case():
    one = flux_one()
    out = {}
    counts = []
    _counting_forward_op(counts)
    after = build("tiny-flux")  # the same seeded weights
    after.transformer.enable_parallelism(config=_cp_config())
    stock_cp = latents(after)  # diffusers' own context parallelism (its native backend)
    out["stock_cp_rel"] = rel(stock_cp, one)
    sd_kernels.patch(after)
    ours = latents(after)
    out["after_rel"] = rel(ours, one)
    out["sum"] = float(ours.double().sum())
    out["after_calls"] = len(counts)
    sd_kernels.unpatch(after)
    out["after_unpatched_equal"] = torch.equal(latents(after), stock_cp)
    out["after_stock_processors"] = _stock_processors(after.transformer)
    counts.clear()
    before = build("tiny-flux")
    sd_kernels.patch(before)
    before.transformer.enable_parallelism(config=_cp_config())
    out["before_rel"] = rel(latents(before), one)
    out["before_calls"] = len(counts)
    out["local_shape"] = list(counts[0]) if counts else None
    sd_kernels.unpatch(before)
    out["before_unpatched_equal"] = torch.equal(latents(before), stock_cp)
    out["before_stock_processors"] = _stock_processors(before.transformer)
    return out


def ring_case():
    """FLUX under a ring config (sd_kernels.enable_context_parallel(exchange="ring")), patched before it:
    every attention call gathers the keys and values once and runs our attention over all of them; the
    single-stream blocks begin the attention before their MLP (the exchange overlaps it)."""
    from sd_kernels.patches import flux_attention
    from sd_kernels.patches.context_parallel_plans import enable_context_parallel

    one = flux_one()
    shapes, begun, in_parts_calls = [], [], []
    attend, begin = context_parallel.attend_gathered, flux_attention.SDKernelsFluxAttnProcessor.begin

    def counting(query, gathered, parallel_config, in_parts=False):
        out = attend(query, gathered, parallel_config, in_parts)
        shapes.append([list(query.shape), list(gathered.shape), list(out.shape)])
        in_parts_calls.append(in_parts)
        return out

    def counting_begin(self, *args, **kwargs):
        begun.append(1)
        return begin(self, *args, **kwargs)

    context_parallel.attend_gathered = counting
    flux_attention.SDKernelsFluxAttnProcessor.begin = counting_begin
    try:
        ring = build("tiny-flux")
        sd_kernels.patch(ring)
        enable_context_parallel(ring, exchange="ring")
        ours = latents(ring)
    finally:
        context_parallel.attend_gathered = attend
        flux_attention.SDKernelsFluxAttnProcessor.begin = begin
    bad = build("tiny-flux")  # its first call: the processes' arguments are compared at each signature's first
    enable_context_parallel(bad, exchange="ring")
    seed_per_process = error_of(lambda: latents(bad, seed=dist.get_rank()))
    out = {"rel": rel(ours, one), "sum": float(ours.double().sum()), "calls": len(shapes),
           "seed_per_process": seed_per_process,
           "shapes": shapes[0] if shapes else None, "begun": len(begun), "in_parts": sum(in_parts_calls),
           "single_blocks": len(ring.transformer.single_transformer_blocks),
           "config": vars(ring.transformer._parallel_config.context_parallel_config)["ring_degree"]}
    sd_kernels.unpatch(ring)
    out["stock_processors"] = _stock_processors(ring.transformer)
    return out


def ring_anything_case():
    """``ring_anything`` (shards of different lengths: 15 T5 tokens, 8 and 7 a process): diffusers' dispatch, not
    the gathered attention (which takes shards of one length): one process's latents or diffusers' refusal. On
    the reference ops: which attention serves the call is decided whichever backend runs the ops."""
    with env("SD_KERNELS_BACKEND", "reference"):
        return _ring_anything()


def _ring_anything():
    from diffusers import ContextParallelConfig

    with sd_kernels.patched(pipe := build("tiny-flux")):
        one = latents(pipe, max_sequence_length=15)
    ring = build("tiny-flux")
    sd_kernels.patch(ring)
    ring.transformer.enable_parallelism(config=ContextParallelConfig(ring_degree=2, ring_anything=True))
    try:
        return {"rel": rel(latents(ring, max_sequence_length=15), one)}
    except ValueError as exc:  # diffusers' native backend returns no log-sum-exp for its ring
        return {"error": str(exc)}


def ring_mixed_processors_case(rank):
    """Patched on the first process only, then split by ring: the processes would exchange keys and values in two
    layouts (ours, diffusers'): refused on both before the split."""
    from sd_kernels.patches.context_parallel_plans import enable_context_parallel

    pipe = build("tiny-flux")
    if rank == 0:
        sd_kernels.patch(pipe)
    return {"error": error_of(lambda: enable_context_parallel(pipe, exchange="ring")),
            "split": pipe.transformer._parallel_config is not None}


def ulysses_mixed_profiles_case(rank):
    pipe = build("tiny-flux")
    pipe.transformer.enable_parallelism(config=_cp_config())
    cpu = get_profile("cpu")
    mine = cpu if rank == 0 else dataclasses.replace(cpu, name="cpu-other", flash_min_keys=cpu.flash_min_keys + 1)
    out = {"error": error_of(lambda: sd_kernels.patch(pipe, profile=mine)),
           "left_unpatched": sd_kernels.patches.patch_record(pipe) is None}
    # the switch that captures collectives, on one process only: the other would wait in its exchange
    if rank == 1:
        os.environ[cuda_graph.COLLECTIVES_ENV] = "1"
    try:
        out["switch_error"] = error_of(lambda: sd_kernels.patch(pipe, profile=cpu))
    finally:
        os.environ.pop(cuda_graph.COLLECTIVES_ENV, None)
    return out


def heads_case():
    from diffusers import FluxTransformer2DModel

    def three_heads():
        torch.manual_seed(0)
        return FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                      attention_head_dim=8, num_attention_heads=3, joint_attention_dim=16,
                                      pooled_projection_dim=8, axes_dims_rope=(2, 2, 4))

    after = three_heads()
    after.enable_parallelism(config=_cp_config())
    out = {"patch_after": error_of(lambda: sd_kernels.patch(after))}
    out["patch_after_left_unpatched"] = sd_kernels.patches.patch_record(after) is None
    before = three_heads()
    sd_kernels.patch(before)
    before.enable_parallelism(config=_cp_config())
    x = torch.randn(1, 16, 16)
    ids = torch.zeros(16, 3)
    with torch.no_grad():
        out["patch_before"] = error_of(lambda: before(x, encoder_hidden_states=torch.randn(1, 4, 16),
                                                      pooled_projections=torch.randn(1, 8), timestep=torch.ones(1),
                                                      img_ids=ids, txt_ids=torch.zeros(4, 3), return_dict=False))
    return out


def split_modulation_case():
    """FLUX under ring and under Ulysses with ``split_modulation``: each process computes half of every block
    norm's modulation product, one all-gather a transformer call; the latents one process's within fp32
    rounding; every patched block norm takes its product from the split. On the reference ops, as in
    ``cfg_case``: the split is what is tested (the patched block norms ask it for their products whichever
    backend runs the ops; the kernels under context parallelism are ``ulysses_case``'s and ``ring_case``'s)."""
    with env("SD_KERNELS_BACKEND", "reference"):
        return _split_modulation()


def _split_modulation():
    from sd_kernels.patches import modulation_split
    from sd_kernels.patches.context_parallel_plans import enable_context_parallel

    with sd_kernels.patched(pipe := build("tiny-flux")):
        one = latents(pipe)
        two = latents(pipe, num_images_per_prompt=2)
    out = {}
    computed, taken = [], []
    compute, product = modulation_split._Split._compute, modulation_split.product

    def counting_compute(self, emb):
        computed.append(1)
        return compute(self, emb)

    def counting_product(norm, emb):
        got = product(norm, emb)
        taken.append(got is not None)
        return got

    modulation_split._Split._compute = counting_compute
    modulation_split.product = counting_product
    try:
        for exchange in ("ring", "ulysses"):
            computed.clear()
            taken.clear()
            split = build("tiny-flux")
            enable_context_parallel(split, exchange=exchange, split_modulation=True)
            sd_kernels.patch(split)
            got = latents(split)
            norms = sum(1 for b in split.transformer.transformer_blocks) * 2 + len(
                split.transformer.single_transformer_blocks)
            out[exchange] = {"rel": rel(got, one), "computed": len(computed), "taken": sum(taken),
                             "asked": len(taken), "norms": norms}
            if exchange == "ring":  # a batch of two: each process's shares of both samples' columns
                out["ring_batch2"] = rel(latents(split, num_images_per_prompt=2), two)
            sd_kernels.unpatch(split)
    finally:
        modulation_split._Split._compute = compute
        modulation_split.product = product
    return out


def split_decode_case():
    """The VAE decode split by rows over the two processes (``enable_split_decode``): a decode equal to one
    process's, then one image end to end under ``parallel="cfg"``; processes decoding different latents both
    raise; unpatched, the decoder's own forward. On the reference ops, as in ``cfg_case``: the split is what is
    tested (its bands, margins, statistics and gathers are the same whichever backend runs the norms; the band
    kernels are tests/ops/test_group_stats.py's and the streamed decode's in tests/test_memory.py)."""
    with env("SD_KERNELS_BACKEND", "reference"):
        return _split_decode()


def _split_decode():
    from sd_kernels.patches import split_decode

    pipe = build("tiny-xl")
    z = torch.randn(1, 4, SIDE // 4, SIDE // 4, generator=torch.Generator().manual_seed(1))  # alike on both
    with torch.no_grad(), sd_kernels.patched(pipe):
        whole = pipe.vae.decode(z, return_dict=False)[0]
        one = pipe(PROMPT, num_inference_steps=2, generator=torch.Generator().manual_seed(0), height=SIDE,
                   width=SIDE, output_type="pt").images
    bands = []
    decode_band = split_decode.decode_band
    split_decode.decode_band = lambda *a: bands.append(1) or decode_band(*a)
    try:
        with torch.no_grad():
            sd_kernels.patch(pipe, parallel="cfg")
            record = sd_kernels.enable_split_decode(pipe)
            split = pipe.vae.decode(z, return_dict=False)[0]
            image = pipe(PROMPT, num_inference_steps=2, generator=torch.Generator().manual_seed(0), height=SIDE,
                         width=SIDE, output_type="pt").images
            differ = error_of(lambda: pipe.vae.decode(z + dist.get_rank(), return_dict=False))
            summary = record.summary()
            sd_kernels.unpatch(pipe)
    finally:
        split_decode.decode_band = decode_band
    return {"rel": rel(split, whole), "image_rel": rel(image, one), "bands": len(bands), "summary": summary,
            "differ": differ, "sum": float(split.double().sum()), "restored": "forward" not in vars(pipe.vae.decoder)}


def run_cases(report: dict, cases) -> None:
    """Each (name, case) of ``cases`` run into ``report[name]``: what it returned, or its traceback as
    ``{"crashed": ...}``; its seconds in ``report["seconds"]``."""
    for name, case in cases:
        start = time.perf_counter()
        try:
            report[name] = case()
        except Exception:
            report[name] = {"crashed": traceback.format_exc()}
        report.setdefault("seconds", {})[name] = round(time.perf_counter() - start, 1)


def main(out_dir: pathlib.Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # diffusers' enable_parallelism places each process on accelerator rank % device_count(), which a
    # CPU-only torch counts as 0; on CPU every process's "device" is the CPU.
    torch.accelerator.device_count = lambda: 1
    report = {"world": dist.get_world_size()}
    run_cases(report, [("sd15", lambda: cfg_case("tiny")), ("sdxl", lambda: cfg_case("tiny-xl")),
                       ("errors", lambda: errors_case(rank)), ("ulysses", ulysses_case), ("ring", ring_case),
                       ("ring_anything", ring_anything_case), ("split_modulation", split_modulation_case),
                       ("split_decode", split_decode_case),
                       ("ring_mixed_processors", lambda: ring_mixed_processors_case(rank)),
                       ("heads", heads_case),
                       ("ulysses_mixed_profiles", lambda: ulysses_mixed_profiles_case(rank))])
    # test_cp_plans.py's cases in the same launch (its processes' imports paid once); cp_plans_worker imports
    # this module by name and finds this one, with its FLUX latents made once
    sys.modules.setdefault("parallel_worker", sys.modules[__name__])
    import cp_plans_worker

    report["cp_plans"] = {"world": dist.get_world_size()}
    run_cases(report["cp_plans"], cp_plans_worker.cases())
    report["no_group_after_destroy"] = None
    dist.destroy_process_group()
    report["no_group_after_destroy"] = error_of(lambda: cfg_parallel.check_setup([], None, (), None, None))
    (out_dir / f"rank{rank}.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]))
