"""The "upsample" patcher: which Upsample2D modules become polyphase (in place, same parameters),
outputs against float64, the calls it hands back to diffusers' forward, the phases' cache (a weight
updated in place, a LoRA on the conv, captured graphs' state), profiles that disable it, unpatch
bit-identical, one custom op under torch.compile."""

import copy
import importlib

import pytest
import torch
import torch.nn as nn
from sd_kernels.patches import patch, unpatch

import sd_kernels
from sd_kernels.models import build_model
from sd_kernels.testing import judge

upp = importlib.import_module("sd_kernels.patches.upsample")


@pytest.fixture(autouse=True)
def _every_size(request, monkeypatch):
    """The tiny models' upsamplers see 4²–8² maps, under the profiles' ``polyphase_min_pixels`` (256):
    these tests cover the polyphase path at every size, except where a test asks for the profile's rule."""
    if "profile_rule" not in request.keywords:
        monkeypatch.setattr(upp, "_min_pixels", lambda: 0)


def _upsamplers(model):
    from diffusers.models.upsampling import Upsample2D

    return [m for m in model.modules() if isinstance(m, Upsample2D)]


def _decode(vae, dtype=torch.float32):
    z = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.no_grad():
        return vae.decode(z).sample


def _unet(unet, dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    x, ctx = torch.randn(2, 4, 16, 16, generator=g).to(dtype), torch.randn(2, 7, 32, generator=g).to(dtype)
    with torch.no_grad():
        return unet(x, torch.tensor([10, 500]), ctx).sample


@pytest.mark.parametrize("part, run", [("vae", _decode), ("unet", _unet)])
def test_patched_upsamplers_against_float64(part, run):
    """Every Upsample2D of the tiny UNet and VAE runs polyphase, in place (same objects, same
    state_dict); the output is within 4x stock's error against the float64 model; unpatch gives
    stock's bits and class back."""
    model = build_model("tiny", part)
    want = run(copy.deepcopy(model).double(), torch.float64)
    stock = run(model)
    keys = {k: v.data_ptr() for k, v in model.state_dict().items()}
    ups = _upsamplers(model)
    record = patch(model, ops=["upsample"])
    assert record.counts["upsample.polyphase"] == len(ups) > 0
    assert [type(m).__name__ for m in _upsamplers(model)] == ["PolyphaseUpsample2D"] * len(ups)
    assert _upsamplers(model) == ups  # the very modules
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == keys
    ours = run(model)
    assert all(m.transformed_bytes() > 0 for m in ups)
    report = judge(ours, stock, want)
    assert report.ok and not torch.equal(ours, stock), report
    unpatch(model)
    assert {type(m).__name__ for m in _upsamplers(model)} == {"Upsample2D"}
    assert not any(hasattr(m, "_phases") for m in ups)
    assert torch.equal(run(model), stock)


def test_calls_it_does_not_cover_run_diffusers_forward():
    """An output_size other than 2×, the deprecated ``scale``, a conv wrapped after the patch: the
    stock forward, bit for bit."""
    vae = build_model("tiny", "vae")
    m = _upsamplers(vae.decoder)[0]
    x = torch.randn(1, m.channels, 5, 6)
    with torch.no_grad():
        stock_odd, stock_2x = m(x, output_size=(11, 13)), m(x)
        patch(vae, ops=["upsample"])
        assert type(m).__name__ == "PolyphaseUpsample2D"
        assert torch.equal(m(x, output_size=(11, 13)), stock_odd)
        assert not torch.equal(m(x), stock_2x)  # covered: polyphase rounding
        torch.testing.assert_close(m(x, output_size=(10, 12)), stock_2x, rtol=1e-5, atol=1e-5)
        with pytest.warns(FutureWarning):
            assert torch.equal(m(x, scale=1.0), stock_2x)

        class Wrapped(nn.Module):  # what peft's LoRA layers look like to us: not a plain conv
            def __init__(self, conv):
                super().__init__()
                self.base = conv

            def forward(self, x):
                return self.base(x)

        m.conv = Wrapped(m.conv)
        assert torch.equal(m(x), stock_2x)
        m.conv = m.conv.base
    unpatch(vae)


def test_a_weight_updated_in_place_is_seen_and_invalidates_graphs():
    """A fused LoRA or load_state_dict updates the conv's weight in place: the next call derives the
    phases again (output follows the weight) and a captured graph's watched state changes."""
    cg = importlib.import_module("sd_kernels.patches.cuda_graph")
    vae = build_model("tiny", "vae")
    m = _upsamplers(vae.decoder)[0]
    x = torch.randn(1, m.channels, 4, 4)
    patch(vae, ops=["upsample"])
    watch = cg._Watch(vae)
    before = watch.state(())
    with torch.no_grad():
        m(x)
        m.conv.weight.mul_(1.5)
        after_update = m(x)
    assert watch.state(()) != before
    sd_kernels.unpatch(vae)
    with torch.no_grad():
        torch.testing.assert_close(after_update, m(x), rtol=1e-5, atol=1e-5)


def test_lora_on_the_upsampler_conv_survives_patch_and_unpatch(monkeypatch):
    """peft wraps the upsamplers' ``conv`` after the patch: the patched model runs the LoRA (diffusers'
    forward), and unpatch keeps it."""
    peft = pytest.importorskip("peft", reason="peft is in the test extra: pip install -e '.[test]'")
    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")

    def lora(unet):
        torch.manual_seed(3)
        unet.add_adapter(peft.LoraConfig(r=2, lora_alpha=4, target_modules=["conv"], init_lora_weights=False))
        return unet

    never = build_model("tiny", "unet")
    ours = copy.deepcopy(never)
    expected = _unet(lora(never))
    patch(ours)
    lora(ours)
    assert type(_upsamplers(ours)[0]).__name__ == "PolyphaseUpsample2D"
    assert torch.equal(_unet(ours), expected)
    unpatch(ours)
    assert torch.equal(_unet(ours), expected)


@pytest.mark.profile_rule
def test_maps_under_the_profiles_min_pixels_run_diffusers_forward():
    """Below ``polyphase_min_pixels`` (the H100 lost at 2×1280×8²) the stock forward runs, bit for bit;
    at or above it, polyphase; a profile with 0 covers every size."""
    import dataclasses

    from sd_kernels.profiles import get_profile

    vae = build_model("tiny", "vae")
    m = _upsamplers(vae.decoder)[0]
    small, large = torch.randn(1, m.channels, 15, 16), torch.randn(1, m.channels, 16, 16)
    with torch.no_grad():
        stock_small, stock_large = m(small), m(large)
        patch(vae, profile="cuda", ops=["upsample"], cuda_graph=False)
        assert get_profile("cuda").polyphase_min_pixels == 256
        assert torch.equal(m(small), stock_small)
        assert not torch.equal(m(large), stock_large)
        unpatch(vae)
        patch(vae, profile=dataclasses.replace(get_profile("cuda"), polyphase_min_pixels=0), ops=["upsample"],
              cuda_graph=False)
        assert not torch.equal(m(small), stock_small)
        torch.testing.assert_close(m(small), stock_small, rtol=1e-5, atol=1e-5)
    unpatch(vae)


@pytest.mark.parametrize("profile", ["s23-ultra", "iphone-14-pro-max", "mobile-small"])
def test_budgeted_profiles_keep_stock_upsamplers(profile):
    vae = build_model("tiny", "vae")
    record = patch(vae, profile=profile, ops=["upsample"], cuda_graph=False)
    assert "upsample.polyphase" not in record.counts
    assert any(s.what == "Upsample2D" and "disables upsample_conv2d" in s.reason for s in record.skipped)
    unpatch(vae)


def test_unverified_forward_is_left_alone(monkeypatch):
    from diffusers.models.upsampling import Upsample2D

    monkeypatch.setattr(upp, "is_verified", lambda fn: fn is not Upsample2D.forward)
    vae = build_model("tiny", "vae")
    record = patch(vae, ops=["upsample"])
    assert "upsample.polyphase" not in record.counts
    assert any("not the source sd_kernels verified" in s.reason for s in record.skipped)
    unpatch(vae)


def test_unsupported_upsamplers_are_named():
    from diffusers.models.upsampling import Upsample2D

    assert upp.unsupported(Upsample2D(4, use_conv=False)) == "not nearest-2x followed by a conv"
    assert upp.unsupported(Upsample2D(4, use_conv=True, use_conv_transpose=True)) is not None
    assert "norm" in upp.unsupported(Upsample2D(4, use_conv=True, norm_type="ln_norm", eps=1e-5,
                                                elementwise_affine=True))
    assert upp.unsupported(Upsample2D(4, use_conv=True, kernel_size=1, padding=0)) is not None
    assert upp.unsupported(Upsample2D(4, use_conv=True)) is None
    assert upp.unsupported(Upsample2D(4, use_conv=True, name="Conv2d_0")) is None


@pytest.mark.integration
def test_compiled_unet_runs_each_upsampler_as_one_custom_op():
    """Under torch.compile(fullgraph=True) each covered upsampler is one sd_kernels.upsample_conv2d
    node, which finds the patched module's cached phases. (The UNet: the tiny VAE's decode does not
    run under aot_eager on the CPU even unpatched, a torch GroupNorm stride check.)"""
    from torch._dynamo.backends.registry import lookup_backend

    unet = build_model("tiny", "unet")
    patch(unet, ops=["upsample"])
    eager = _unet(unet)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return lookup_backend("aot_eager")(gm, example_inputs)

    torch._dynamo.reset()
    try:
        unet.forward = torch.compile(unet.forward, backend=backend, fullgraph=True)
        out = _unet(unet)
    finally:
        del unet.forward
        torch._dynamo.reset()
    nodes = [n for gm in graphs for n in gm.graph.nodes if str(n.target).startswith("sd_kernels.upsample_conv2d")]
    assert len(nodes) == len(_upsamplers(unet)) > 0
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
    unpatch(unet)


@pytest.mark.gpu
@pytest.mark.profile_rule
def test_gpu_sd15_unet_replayed_and_compiled():
    """SD1.5's UNet (random weights, fp16, batch 2, channels_last under hopper) patched with every
    family, replayed from a CUDA graph, with and without compile=True: the upsamplers of its 16² and
    32² maps run polyphase (the custom op finds the cached phases under inductor), the 8² one stock
    (hopper's polyphase_min_pixels), within 1e-2 of stock."""
    from sd_kernels.testing import rel_err

    unet = build_model("sd15", "unet", device="cuda", dtype=torch.float16)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(2, 4, 64, 64, device="cuda", dtype=torch.float16, generator=g)
    ctx = torch.randn(2, 77, 768, device="cuda", dtype=torch.float16, generator=g)
    t = torch.tensor([500, 500], device="cuda")
    ups = _upsamplers(unet)
    with torch.no_grad():
        stock = unet(x, t, ctx).sample
        for compile in (False, True):
            record = patch(unet, profile="hopper", cuda_graph="unet", compile=compile)
            assert record.counts["upsample.polyphase"] == len(ups) == 3, record.skipped
            ours = unet(x, t, ctx).sample
            ours = unet(x, t, ctx).sample  # replayed
            assert [m.transformed_bytes() > 0 for m in ups] == [False, True, True], compile
            assert rel_err(ours, stock) < 1e-2, compile
            unpatch(unet)
            torch._dynamo.reset()
    assert not any(hasattr(m, "_phases") for m in ups)
