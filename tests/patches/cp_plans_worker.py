"""The multi-process half of test_cp_plans.py: ``cases()``, which each process of parallel_worker.py's launch
(``torchrun --nproc_per_node 2``, gloo, CPU) runs after its own, on the tiny configs, into its
``OUT/rank<r>.json`` (under "cp_plans").

Cases: SD3 and PixArt-Σ under ``enable_context_parallel`` (sd_kernels' plans, Ulysses degree 2) with
sd_kernels' attention (the kernels, through the interpreter), patched after it, against one process; then,
on the reference ops (the plan's exchange is what they test), patched before it, unpatched and patched
again; diffusers' processors under the plan refused (never patched, and after unpatch); unpatch exact; FLUX
through the same function (diffusers' plan); the clear errors (heads or image tokens the degree does not
divide, a model without a plan).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("SD_KERNELS_AUTOTUNE_CACHE", "off")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from parallel_worker import PROMPT, TEXT, build, env, error_of, flux_one, rel  # noqa: E402
from parallel_worker import latents as latents_at_side  # noqa: E402
from sd_kernels.patches import context_parallel_plans as plans  # noqa: E402

import sd_kernels  # noqa: E402
from sd_kernels import models  # noqa: E402

CALLS = []  # each Ulysses.attention call's (local query shape, split)


def _counting():
    original = plans.Ulysses.attention

    def run(self, query, key, value, split, **kwargs):
        CALLS.append([list(query.shape), split])
        return original(self, query, key, value, split, **kwargs)

    plans.Ulysses.attention = run


def latents(pipe, side=None):
    """The tiny pipelines' latents (PixArt without its resolution bins: at the size asked)."""
    extra = {"use_resolution_binning": False} if "PixArt" in type(pipe).__name__ else {}
    if side is None:
        return latents_at_side(pipe, **extra)
    with torch.no_grad():
        return pipe(PROMPT, num_inference_steps=1, generator=torch.Generator().manual_seed(0), height=side, width=side,
                    output_type="latent", max_sequence_length=TEXT, **extra).images


def _processors(model) -> dict:
    return {path: m.processor for path, m in model.named_modules() if hasattr(m, "processor")}


def plan_case(name):
    with sd_kernels.patched(pipe := build(name)):
        one = latents(pipe)
    out = {}
    CALLS.clear()
    after = build(name)  # the same seeded weights
    stock = _processors(after.transformer)
    sd_kernels.enable_context_parallel(after)
    out["never_patched_error"] = error_of(lambda: latents(after))
    sd_kernels.patch(after)
    ours = latents(after)
    out["after_rel"] = rel(ours, one)
    out["sum"] = float(ours.double().sum())
    out["calls"], out["first_call"] = len(CALLS), CALLS[0] if CALLS else None
    with env("SD_KERNELS_BACKEND", "reference"):
        _plan_rest(name, after, stock, out)
    return out


def _plan_rest(name, after, stock, out):
    """``plan_case`` after its call through the kernels: unpatched, patched again, and patched before
    ``enable_context_parallel``, each compared with the first of these calls."""
    ours = latents(after)
    sd_kernels.unpatch(after)
    back = _processors(after.transformer)
    out["unpatched_same_processors"] = all(back[p] is stock[p] and not vars(stock[p]) for p in stock)
    out["unpatched_error"] = error_of(lambda: latents(after))
    sd_kernels.patch(after)
    out["repatched_equal"] = torch.equal(latents(after), ours)
    out["tokens_error"] = error_of(lambda: latents(after, side=40))  # 5×5 patches
    sd_kernels.unpatch(after)
    before = build(name)
    sd_kernels.patch(before)
    sd_kernels.enable_context_parallel(before)
    out["before_equal_after"] = torch.equal(latents(before), ours)
    sd_kernels.unpatch(before)
    out["before_unpatched_error"] = error_of(lambda: latents(before))


def flux_case():
    split = build("tiny-flux")
    sd_kernels.enable_context_parallel(split)
    with sd_kernels.patched(split):
        return {"rel": rel(latents(split), flux_one())}


def errors_case():
    from diffusers import PixArtTransformer2DModel, SD3Transformer2DModel

    heads = dict(num_attention_heads=3, attention_head_dim=8, in_channels=4, num_layers=1, sample_size=8)
    three = {"sd3": SD3Transformer2DModel(patch_size=2, joint_attention_dim=16, caption_projection_dim=24,
                                          pooled_projection_dim=8, out_channels=4, pos_embed_max_size=8, **heads),
             "pixart": PixArtTransformer2DModel(cross_attention_dim=24, caption_channels=8, norm_type="ada_norm_single",
                                                num_embeds_ada_norm=1000, **heads)}
    out = {}
    for key, model in three.items():
        out[f"{key}_heads"] = error_of(lambda m=model: sd_kernels.enable_context_parallel(m))
        out[f"{key}_heads_untouched"] = model._parallel_config is None and not any(
            plans.MARK in vars(m) for m in model.modules())
    one_patched = models.build_model("tiny-pixart", "transformer")
    if dist.get_rank() == 0:  # a patch made before, on one process only
        sd_kernels.patch(one_patched)
    out["patched_on_one"] = error_of(lambda: sd_kernels.enable_context_parallel(one_patched))
    out["patched_on_one_untouched"] = one_patched._parallel_config is None
    own = models.build_model("tiny-pixart", "transformer")
    sd_kernels.enable_context_parallel(own)
    if dist.get_rank() == 1:  # a processor of its own on one process: the others would wait in its exchange
        from diffusers.models.attention_processor import AttnProcessor2_0

        own.transformer_blocks[0].attn1.processor = type("Custom", (AttnProcessor2_0,), {})()
    out["own_processor"] = error_of(lambda: sd_kernels.patch(own))
    seeded = build("tiny-pixart")
    sd_kernels.enable_context_parallel(seeded)
    sd_kernels.patch(seeded, ops=["attention"])
    with torch.no_grad():  # a seed per process: each process's tokens would come from another noise
        out["seed_per_process"] = error_of(lambda: seeded(
            PROMPT, num_inference_steps=1, generator=torch.Generator().manual_seed(dist.get_rank()), height=64,
            width=64, output_type="latent", max_sequence_length=TEXT, use_resolution_binning=False))
    unet_pipe = build("tiny")
    out["no_plan"] = error_of(lambda: sd_kernels.enable_context_parallel(unet_pipe))
    out["no_plan_model"] = error_of(lambda: sd_kernels.enable_context_parallel(unet_pipe.unet))
    return out


def cases() -> list:
    """(name, case) for parallel_worker.run_cases, in the launch's process group."""
    # diffusers' enable_parallelism places each process on accelerator rank % device_count(), which a
    # CPU-only torch counts as 0; on CPU every process's "device" is the CPU.
    torch.accelerator.device_count = lambda: 1
    _counting()
    return [("sd3", lambda: plan_case("tiny-sd3")), ("pixart", lambda: plan_case("tiny-pixart")),
            ("flux", flux_case), ("errors", errors_case)]
