"""patches/bf16_decode.py: in the FP8 tier, the decode a pipeline would upcast to fp32 runs on a bf16 copy of the
VAE's decoder. The CPU cases patch without the attention family: Triton's interpreter computes bf16 ``tl.dot``
wrongly (the kernels' tests say so); the GPU case runs every op family, its decode replayed from a CUDA graph."""

import pytest
import torch
import torch.nn as nn
from dit_checks import cpu_only
from sd_kernels.patches import PATCHERS, bf16_decode

import sd_kernels
from sd_kernels.models import build_pipeline
from sd_kernels.testing import psnr, rel_err

NO_ATTENTION = [op for op in PATCHERS if op != "attention"]


def _xl(device="cpu", force_upcast=True):
    """Tiny SDXL in fp16; its VAE asks for the fp32 upcast as SDXL's does."""
    pipe = build_pipeline("tiny-xl", device, torch.float16)
    pipe.vae.register_to_config(force_upcast=force_upcast)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _latents(pipe):
    return torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(1)).half().to(pipe.device)


def _decoded(vae, z, dtype):
    """Stock diffusers' decode of ``z`` by an unpatched copy of ``vae`` in ``dtype`` (float64: the reference)."""
    fresh = type(vae).from_config(vae.config).to(vae.device, dtype)
    fresh.load_state_dict(vae.state_dict())
    with torch.no_grad():
        return fresh.decode(z.to(dtype)).sample.double()


def _decoder_calls(route):
    calls = []
    route.copy.decoder.register_forward_hook(lambda *_: calls.append(1))
    return calls


@cpu_only
def test_the_upcast_decode_runs_on_the_bf16_copy_and_unpatch_is_exact():
    pipe = _xl()
    z = _latents(pipe)
    ref = _decoded(pipe.vae, z, torch.float64)
    bf16_err = rel_err(_decoded(pipe.vae, z, torch.bfloat16), ref)  # stock's own error in bf16
    stock16 = pipe.vae.decode(z).sample
    record = sd_kernels.patch(pipe, precision="fp8", ops=NO_ATTENTION)
    try:
        assert record.counts[bf16_decode.KIND] == 1
        assert "runs on a bf16 copy of the VAE's decoder" in record.format()
        route = pipe.vae.decode.route
        calls = _decoder_calls(route)
        with torch.no_grad():
            pipe.upcast_vae()  # as the pipeline calls it: the VAE stays fp16
            assert {p.dtype for p in pipe.vae.parameters()} == {torch.float16}
            out = pipe.vae.decode(z, return_dict=False)[0]
            assert out.dtype == torch.float32 and calls == [1]  # the dtype the upcast VAE returns
            assert 0 < rel_err(out, ref) <= 2 * bf16_err, (rel_err(out, ref), bf16_err)
            pipe.vae.to(dtype=torch.float16)  # the pipeline's cast back: nothing moves
            assert pipe.vae.decode(z).sample.dtype == torch.float16 and calls == [1]  # unarmed: the VAE's own
            # the whole pipeline: its one decode on the copy, an fp32 image
            image = pipe("a cat", num_inference_steps=1, height=64, width=64, output_type="pt",
                         generator=torch.Generator().manual_seed(0), return_dict=False)[0]
            assert image.dtype == torch.float32 and calls == [1, 1]
    finally:
        assert sd_kernels.unpatch(pipe)
    assert "upcast_vae" not in vars(pipe) and "decode" not in vars(pipe.vae)
    with torch.no_grad():
        assert torch.equal(pipe.vae.decode(z).sample, stock16)


@cpu_only
def test_weights_changed_in_place_are_copied_again():
    pipe = _xl()
    z = _latents(pipe)
    sd_kernels.patch(pipe, precision="fp8", ops=NO_ATTENTION)
    try:
        with torch.no_grad():
            pipe.vae.decoder.conv_out.weight.mul_(-2)
            pipe.vae.post_quant_conv.bias.add_(0.5)
            ref = _decoded(pipe.vae, z, torch.float64)
            bf16_err = rel_err(_decoded(pipe.vae, z, torch.bfloat16), ref)
            pipe.upcast_vae()
            assert rel_err(pipe.vae.decode(z).sample, ref) <= 2 * bf16_err
    finally:
        sd_kernels.unpatch(pipe)


@cpu_only
def test_a_decoder_with_other_modules_falls_back_to_the_fp32_upcast(caplog):
    pipe = _xl()
    sd_kernels.patch(pipe, precision="fp8", ops=NO_ATTENTION)
    try:
        pipe.vae.decoder.extra = nn.Linear(2, 2).half()  # a module the copy does not have
        pipe.upcast_vae()
        assert {p.dtype for p in pipe.vae.parameters()} == {torch.float32}  # stock's upcast
        assert "changed its modules since the patch" in caplog.text
        assert pipe.vae.decode(_latents(pipe).float()).sample.dtype == torch.float32
        pipe.vae.to(dtype=torch.float16)
    finally:
        sd_kernels.unpatch(pipe)


@cpu_only
@pytest.mark.parametrize("case", ["lossless", "no force_upcast", "vae ignored", "fp32 vae"])
def test_where_the_copy_is_not_made(case):
    pipe = _xl(force_upcast=case != "no force_upcast")
    if case == "fp32 vae":
        pipe.vae.float()
    record = sd_kernels.patch(pipe, ops=NO_ATTENTION, precision=None if case == "lossless" else "fp8",
                              ignore=["vae"] if case == "vae ignored" else ())
    try:
        assert bf16_decode.KIND not in record.counts and "upcast_vae" not in vars(pipe)
        noted = [s for s in record.skipped if "decodes in fp32 as the pipeline asks" in s.reason]
        assert bool(noted) == (case == "fp32 vae"), record.format()
    finally:
        sd_kernels.unpatch(pipe)


def test_only_pipelines_that_upcast_once_for_their_one_decode_are_served():
    import diffusers

    assert bf16_decode._verified(diffusers.StableDiffusionXLPipeline)
    assert bf16_decode._verified(diffusers.StableDiffusionXLImg2ImgPipeline)
    assert bf16_decode._verified(diffusers.StableDiffusionXLControlNetPipeline)
    assert not bf16_decode._verified(diffusers.StableDiffusionXLInstructPix2PixPipeline)  # also upcasts to encode
    assert not bf16_decode._verified(diffusers.LEditsPPPipelineStableDiffusionXL)  # upcasts three times
    assert bf16_decode._verified(diffusers.StableDiffusionUpscalePipeline)  # its __call__'s one upcast and decode


@pytest.mark.gpu
def test_gpu_sdxl_decodes_on_the_graphed_bf16_copy():
    """Every op family on CUDA, the pipeline's graphs: the image close to stock's fp32 decode, the copy's decode
    captured once and replayed."""
    pipe = _xl("cuda")
    kwargs = dict(num_inference_steps=2, height=64, width=64, output_type="pt", return_dict=False)
    stock = pipe("a cat", generator=torch.Generator("cuda").manual_seed(0), **kwargs)[0]
    record = sd_kernels.patch(pipe, precision="fp8")
    try:
        assert record.counts[bf16_decode.KIND] == 1 and record.cuda_graph == "pipeline"
        route = pipe.vae.decode.route
        images = [pipe("a cat", generator=torch.Generator("cuda").manual_seed(0), **kwargs)[0] for _ in range(3)]
        assert all(torch.equal(images[0], im) for im in images[1:])
        assert images[0].dtype == torch.float32 and psnr(images[0], stock) > 30, psnr(images[0], stock)
        assert len(route.copy.decode.graphs) == 1 and not route.copy.decode.eager_keys  # captured, then replayed
        assert {p.dtype for p in pipe.vae.parameters()} == {torch.float16}
        with torch.no_grad():  # a weight changed in place (one the patch's fused q, k, v reads) reaches the copy
            pipe.vae.decoder.mid_block.attentions[0].to_v.weight.mul_(-1)
        changed = pipe("a cat", generator=torch.Generator("cuda").manual_seed(0), **kwargs)[0]
    finally:
        sd_kernels.unpatch(pipe)
    stock = pipe("a cat", generator=torch.Generator("cuda").manual_seed(0), **kwargs)[0]
    assert not torch.equal(changed, images[0]) and psnr(changed, stock) > 30, psnr(changed, stock)
