"""patches/bf16_decode.py: in the FP8 tier, the decode a pipeline would upcast to fp32 runs on a bf16 copy of the
VAE's decoder. The CPU cases patch without the attention family: Triton's interpreter computes bf16 ``tl.dot``
wrongly (the kernels' tests say so); the GPU case runs every op family, its decode replayed from a CUDA graph."""

import pytest
import torch
import torch.nn as nn
from diffusers import StableDiffusionXLPipeline
from dit_checks import cpu_only
from sd_kernels.patches import PATCHERS, bf16_decode

import sd_kernels
from sd_kernels.models import build_pipeline
from sd_kernels.testing import psnr, rel_err

NO_ATTENTION = [op for op in PATCHERS if op != "attention"]
KW = dict(num_inference_steps=1, height=64, width=64, return_dict=False)


def _xl(device="cpu", force_upcast=True, cls=None):
    """Tiny SDXL in fp16; its VAE asks for the fp32 upcast as SDXL's does."""
    pipe = build_pipeline("tiny-xl", device, torch.float16)
    pipe.vae.register_to_config(force_upcast=force_upcast)
    if cls is not None:
        pipe = cls(**pipe.components)
    pipe.set_progress_bar_config(disable=True)
    return pipe


class TwoDecodes(StableDiffusionXLPipeline):
    """A pipeline that upcasts once and then decodes twice (and may fail after), casting the latents as SDXL's
    pipeline does. The tests that call it patch no op family and leave the UNet alone: what they check is the
    routing, which neither changes."""

    def __call__(self, z, fail=False):
        self.upcast_vae()
        z = z.to(next(iter(self.vae.post_quant_conv.parameters())).dtype)
        out = [self.vae.decode(z).sample for _ in range(2)]
        if fail:
            raise RuntimeError("the call fails after its decodes")
        self.vae.to(dtype=torch.float16)
        return out


@pytest.fixture
def routed(monkeypatch):
    """A TwoDecodes pipeline patched in the FP8 tier, unpatched after the test."""
    monkeypatch.setattr(bf16_decode, "_verified", lambda cls: True)  # this test class's source is not diffusers'
    pipe = _xl(cls=TwoDecodes)
    sd_kernels.patch(pipe, precision="fp8", ops=[], ignore=["unet"])
    yield pipe
    sd_kernels.unpatch(pipe)


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


def _dtypes(module):
    return {p.dtype for p in module.parameters()}


@cpu_only
def test_the_pipelines_decode_runs_on_the_bf16_copy_and_unpatch_is_exact():
    """The image is the bf16 decode of the call's latents, within 2x stock bf16's error against float64, and unpatch
    gives back the stock VAE and pipeline class."""
    pipe = _xl()
    z = _latents(pipe)
    stock16 = pipe.vae.decode(z).sample
    record = sd_kernels.patch(pipe, precision="fp8", ops=NO_ATTENTION, ignore=["unet"])  # the decode's test
    try:
        assert record.counts[bf16_decode.KIND] == 1
        assert "runs on a bf16 copy of the VAE's decoder" in record.format()
        route = pipe.vae.decode.route
        calls = _decoder_calls(route)
        seen = []  # the latents the copy decodes, as it reads them
        route.copy.post_quant_conv.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
        with torch.no_grad():
            image = pipe("a cat", output_type="pt", generator=torch.Generator().manual_seed(0), **KW)[0]
            assert image.dtype == torch.float32 and calls == [1] and _dtypes(pipe.vae) == {torch.float16}
            z_call = seen[0]
            assert z_call.dtype == torch.bfloat16
            ref = (_decoded(pipe.vae, z_call, torch.float64) / 2 + 0.5).clamp(0, 1)
            bf16 = (_decoded(pipe.vae, z_call, torch.bfloat16) / 2 + 0.5).clamp(0, 1)
            assert 0 < rel_err(image, ref) <= 2 * rel_err(bf16, ref), (rel_err(image, ref), rel_err(bf16, ref))
            # outside a pipeline call: the VAE's own decode, and upcast_vae upcasts
            assert pipe.vae.decode(z).sample.dtype == torch.float16 and calls == [1]
            pipe.upcast_vae()
            assert _dtypes(pipe.vae) == {torch.float32}
            pipe.vae.to(dtype=torch.float16)
    finally:
        assert sd_kernels.unpatch(pipe)
    assert "upcast_vae" not in vars(pipe) and not {"decode", "encode"} & set(vars(pipe.vae))
    assert type(pipe) is StableDiffusionXLPipeline
    with torch.no_grad():
        assert torch.equal(pipe.vae.decode(z).sample, stock16)


@cpu_only
def test_every_decode_of_the_call_is_served_and_its_end_disarms(routed):
    pipe, z = routed, _latents(routed)
    calls = _decoder_calls(pipe.vae.decode.route)
    with torch.no_grad():
        out = pipe(z)
        assert [o.dtype for o in out] == [torch.float32] * 2 and calls == [1, 1]
        with pytest.raises(RuntimeError, match="fails after its decodes"):
            pipe(z, fail=True)
        assert calls == [1] * 4 and _dtypes(pipe.vae) == {torch.float16}
        assert pipe.vae.decode(z).sample.dtype == torch.float16 and len(calls) == 4  # disarmed


class EncodeThenDecode(StableDiffusionXLPipeline):
    """A pipeline that upcasts, then encodes (a path the copy does not serve) and decodes."""

    def __call__(self, z):
        self.upcast_vae()
        return self.vae.encode(torch.zeros(1, 3, 16, 16)).latent_dist.mean, self.vae.decode(z).sample


@cpu_only
def test_an_encode_after_the_upcast_gets_stocks_upcast(monkeypatch):
    monkeypatch.setattr(bf16_decode, "_verified", lambda cls: True)
    pipe = _xl(cls=EncodeThenDecode)
    sd_kernels.patch(pipe, precision="fp8", ops=[], ignore=["unet"])
    try:
        calls = _decoder_calls(pipe.vae.decode.route)
        with torch.no_grad():
            encoded, decoded = pipe(_latents(pipe).float())
        assert encoded.dtype == decoded.dtype == torch.float32 and _dtypes(pipe.vae) == {torch.float32} and not calls
    finally:
        pipe.vae.to(dtype=torch.float16)
        sd_kernels.unpatch(pipe)


@cpu_only
def test_weights_changed_in_place_are_copied_again(routed):
    pipe, z = routed, _latents(routed)
    with torch.no_grad():
        pipe.vae.decoder.conv_out.weight.mul_(-2)
        pipe.vae.post_quant_conv.bias.add_(0.5)
        ref = _decoded(pipe.vae, z, torch.float64)
        bf16_err = rel_err(_decoded(pipe.vae, z, torch.bfloat16), ref)
        assert rel_err(pipe(z)[0], ref) <= 2 * bf16_err


@cpu_only
def test_a_copy_made_under_inference_mode_takes_changed_weights_outside_it(monkeypatch):
    """The tier applied under ``torch.inference_mode()``: the bf16 copy holds no inference tensors, so a weight
    changed in place after it, outside inference mode, is copied again into it."""
    monkeypatch.setattr(bf16_decode, "_verified", lambda cls: True)
    pipe = _xl(cls=TwoDecodes)
    with torch.inference_mode():
        sd_kernels.patch(pipe, precision="fp8", ops=[], ignore=["unet"])
    try:
        assert not any(p.is_inference() for p in pipe.vae.decode.route.copy.parameters())
        z = _latents(pipe)
        with torch.no_grad():
            pipe.vae.decoder.conv_out.weight.mul_(-2)
            ref = _decoded(pipe.vae, z, torch.float64)
            assert rel_err(pipe(z)[0], ref) <= 2 * rel_err(_decoded(pipe.vae, z, torch.bfloat16), ref)
    finally:
        sd_kernels.unpatch(pipe)


@cpu_only
@pytest.mark.parametrize("change", ["module added", "vae replaced"])
def test_a_changed_decoder_or_vae_gets_stocks_fp32_upcast(routed, change, caplog):
    pipe, z = routed, _latents(routed)
    calls = _decoder_calls(pipe.vae.decode.route)
    if change == "module added":
        pipe.vae.decoder.extra = nn.Linear(2, 2).half()  # a module the copy does not have
    else:
        pipe.vae = type(pipe.vae).from_config(pipe.vae.config).half()
    upcast = []
    pipe.vae.decoder.register_forward_pre_hook(lambda m, args: upcast.append(args[0].dtype))
    with torch.no_grad():
        out = pipe(z)
    assert upcast == [torch.float32] * 2 and [o.dtype for o in out] == [torch.float32] * 2 and not calls
    assert (change == "module added") == ("changed its modules since the patch" in caplog.text)


@cpu_only
@pytest.mark.parametrize("case", ["lossless", "no force_upcast", "vae ignored", "fp32 vae", "bf16 vae",
                                  "unverified", "lora"])
def test_where_the_copy_is_not_made(case, monkeypatch):
    pipe = _xl(force_upcast=case != "no force_upcast")
    if case in ("fp32 vae", "bf16 vae"):
        pipe.vae.to(torch.float32 if case == "fp32 vae" else torch.bfloat16)
    if case == "unverified":
        monkeypatch.setattr(bf16_decode, "_verified", lambda cls: False)
    if case == "lora":
        from peft import LoraConfig

        pipe.vae.add_adapter(LoraConfig(r=2, target_modules=["conv_out"]))
    record = sd_kernels.patch(pipe, ops=NO_ATTENTION, precision=None if case == "lossless" else "fp8",
                              ignore=["vae"] if case == "vae ignored" else ())
    try:
        assert bf16_decode.KIND not in record.counts and not hasattr(type(pipe), "_sd_kernels_bf16_route")
        noted = [s for s in record.skipped if "decodes in fp32 as the pipeline asks" in s.reason]
        assert bool(noted) == (case in ("unverified", "lora")), record.format()
        assert all(s.path == "vae" for s in noted)
    finally:
        sd_kernels.unpatch(pipe)


def test_only_pipelines_that_upcast_once_for_their_decode_are_served():
    import diffusers

    assert bf16_decode._verified(diffusers.StableDiffusionXLPipeline)
    assert bf16_decode._verified(diffusers.StableDiffusionXLImg2ImgPipeline)
    assert bf16_decode._verified(diffusers.StableDiffusionXLControlNetPipeline)
    assert not bf16_decode._verified(diffusers.StableDiffusionXLInstructPix2PixPipeline)  # also upcasts to encode
    assert not bf16_decode._verified(diffusers.LEditsPPPipelineStableDiffusionXL)  # upcasts three times
    assert bf16_decode._verified(diffusers.StableDiffusionUpscalePipeline)  # its __call__'s one upcast and decode


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["pipeline", "step"])
def test_gpu_sdxl_decodes_on_the_graphed_bf16_copy(mode):
    """Every op family on CUDA, the pipeline's graphs (and the whole-step graphs' class under ours): the image
    close to stock's fp32 decode, the copy's decode captured once and replayed, and a weight changed in place
    served by the copy."""
    pipe = _xl("cuda")
    kwargs = dict(num_inference_steps=2, height=64, width=64, output_type="pt", return_dict=False)
    stock = pipe("a cat", generator=torch.Generator("cuda").manual_seed(0), **kwargs)[0]
    record = sd_kernels.patch(pipe, precision="fp8", cuda_graph=mode)
    try:
        assert record.counts[bf16_decode.KIND] == 1 and record.cuda_graph == mode
        assert (record.counts["whole_step"] == 1) == (mode == "step")
        route = pipe.vae.decode.route
        images = [pipe("a cat", generator=torch.Generator("cuda").manual_seed(0), **kwargs)[0] for _ in range(3)]
        assert all(torch.equal(images[0], im) for im in images[1:])
        assert images[0].dtype == torch.float32 and psnr(images[0], stock) > 30, psnr(images[0], stock)
        graphed = route.copy.decode
        assert len(graphed.graphs) == 1 and not graphed.eager_keys  # captured, then replayed
        assert _dtypes(pipe.vae) == {torch.float16}
        served = []
        route.copy.decode = lambda *a, **k: served.append(1) or graphed(*a, **k)  # counts the copy's calls
        with torch.no_grad():  # a weight changed in place (one the patch's fused q, k, v reads) reaches the copy
            pipe.vae.decoder.mid_block.attentions[0].to_v.weight.mul_(-1)
        changed = pipe("a cat", generator=torch.Generator("cuda").manual_seed(0), **kwargs)[0]
        assert served == [1] and len(graphed.graphs) == 1
        route.copy.decode = graphed
    finally:
        sd_kernels.unpatch(pipe)
    stock = pipe("a cat", generator=torch.Generator("cuda").manual_seed(0), **kwargs)[0]
    assert not torch.equal(changed, images[0]) and psnr(changed, stock) > 30, psnr(changed, stock)
