"""IP-Adapter under the patch: diffusers' IPAdapterAttnProcessor2_0 served by sd_kernels' attention
(patches/ip_adapter.py), the processor objects kept (a change of class), exactly undone. The adapters
are random (models.load_random_ip_adapters: diffusers' own loader on a random state dict, no hub)."""

import copy
import importlib

import pytest
import torch
from diffusers.models.attention_processor import AttnProcessor2_0, IPAdapterAttnProcessor2_0
from sd_kernels.patches.ip_adapter import SDKernelsIPAdapterProcessor
from sd_kernels.patches.record import PatchRecord

import sd_kernels
from sd_kernels import models
from sd_kernels.runtime import dispatch
from sd_kernels.testing import assert_close_to_reference

attn_patch = importlib.import_module("sd_kernels.patches.attention")
EMBED = 16  # the image encoder's embedding size the random adapters take


def ip_out(unet, n: int = 1, side: int = 8, **cross_attention_kwargs) -> torch.Tensor:
    """The UNet's output for fixed inputs (made on the CPU in float32, then on the UNet's device and
    dtype), on the CPU."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, side, side, generator=g)
    ctx = torch.randn(2, 77, 32, generator=g)
    embeds = [torch.randn(2, 1, EMBED, generator=g) for _ in range(n)]
    p = next(unet.parameters())
    cast = lambda t: t.to(p.device, p.dtype)  # noqa: E731
    with torch.no_grad():
        return unet(cast(x), 10, encoder_hidden_states=cast(ctx),
                    added_cond_kwargs={"image_embeds": list(map(cast, embeds))},
                    cross_attention_kwargs=cross_attention_kwargs or None).sample.cpu()


def processors(model) -> dict:
    return dict(model.attn_processors)


def ip_unet(n: int = 1):
    unet = models.build_model("tiny", "unet").eval()
    models.load_random_ip_adapters(unet, n, EMBED)
    return unet


@pytest.mark.integration
def test_ip_adapter_processors_are_served_and_undone_exactly():
    """Two adapters: the processor's loop over them is the code one adapter runs too. A 4x4 latent
    (16 queries; the kernels' tiling is tested in tests/ops/test_attention.py) keeps the interpreter
    to seconds."""
    n = 2
    run = lambda model: ip_out(model, n, side=4)  # noqa: E731
    unet = ip_unet(n)
    before = processors(unet)
    kinds = {name: type(p) for name, p in before.items()}
    n_ip = sum(k is IPAdapterAttnProcessor2_0 for k in kinds.values())
    n_plain = sum(k is AttnProcessor2_0 for k in kinds.values())
    assert n_ip and n_plain and n_ip + n_plain == len(kinds)
    keys = list(unet.state_dict())
    stock = run(unet)
    ref64 = run(copy.deepcopy(unet).double())
    record = sd_kernels.patch(unet, ops=["attention"], cuda_graph=False)
    # the plain processors are the self-attentions': each one's q, k, v laid out as one GEMM (patches/qkv_fusion.py)
    assert record.counts == {"attention_processor": n_plain, "ip_adapter_processor": n_ip, "qkv_fusion": n_plain}
    now = processors(unet)
    for name, p in now.items():  # the IP-Adapter processors are the same objects, of our subclass
        if kinds[name] is IPAdapterAttnProcessor2_0:
            assert p is before[name] and type(p) is SDKernelsIPAdapterProcessor
    assert list(unet.state_dict()) == keys
    dispatch.reset_fallbacks()
    with pytest.MonkeyPatch.context() as m:  # our processor's own path, not diffusers' code through super()
        m.setattr(IPAdapterAttnProcessor2_0, "__call__", lambda *a, **k: pytest.fail("ran diffusers' __call__"))
        assert_close_to_reference(run(unet), stock, ref64)
    assert not dispatch.fallbacks()  # the kernels ran (the interpreter on CPU), not the reference
    assert sd_kernels.unpatch(unet)
    after = processors(unet)
    assert all(after[k] is before[k] and type(after[k]) is kinds[k] for k in before)
    assert all("_sd_profile" not in p.__dict__ for p in after.values())
    assert torch.equal(run(unet), stock)


def test_set_ip_adapter_scale_while_patched_acts_and_survives_unpatch(monkeypatch):
    """diffusers' set_ip_adapter_scale finds the patched processors (they are IPAdapterAttnProcessor2_0
    instances); a scale of 0 skips an adapter; a per-block scale dict (InstantStyle) and a mask run
    diffusers' own code; the scale set while patched stays after unpatch. The processor's plumbing is
    under test: the reference ops (the kernels under it: the test above)."""
    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    pipe = models.build_pipeline("tiny")
    models.load_random_ip_adapters(pipe.unet, 2, EMBED)
    stock_pipe = copy.deepcopy(pipe)
    sd_kernels.patch(pipe, ops=["attention"], cuda_graph=False)
    for scale in ([0.5, 0.0], [{"down": 0.7, "up": {"block_1": [0.2]}}, 1.0]):
        for p in (pipe, stock_pipe):
            p.set_ip_adapter_scale(scale)
        assert torch.allclose(ip_out(pipe.unet, 2), ip_out(stock_pipe.unet, 2), rtol=1e-4, atol=1e-5)
    masks = [torch.ones(1, 1, 8, 8), torch.zeros(1, 1, 8, 8)]
    got, want = (ip_out(p.unet, 2, ip_adapter_masks=masks) for p in (pipe, stock_pipe))
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5)
    pipe.set_ip_adapter_scale([0.25, 0.25])
    sd_kernels.unpatch(pipe)
    scales = {tuple(p.scale) for p in processors(pipe.unet).values() if isinstance(p, IPAdapterAttnProcessor2_0)}
    assert scales == {(0.25, 0.25)}


def test_a_changed_ip_adapter_processor_is_left_alone(monkeypatch):
    verified = importlib.import_module("sd_kernels.patches.diffusers_sources")
    monkeypatch.setitem(verified.VERIFIED, "IPAdapterAttnProcessor2_0.__call__", "0" * 16)
    verified.is_verified.cache_clear()
    try:
        unet = ip_unet()
        record = PatchRecord(("attention",), "cpu", ["test"])
        attn_patch.patch_attention(unet, record)
        assert "ip_adapter_processor" not in record.counts
        assert any(s.what == "IPAdapterAttnProcessor2_0" and "0.42.1" in s.reason for s in record.skipped)
        assert all(type(p) is not SDKernelsIPAdapterProcessor for p in processors(unet).values())
    finally:
        verified.is_verified.cache_clear()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_ip_adapter_unet_patched_and_graphed(dtype):
    """Compiled kernels: the patched IP-Adapter UNet, eager and replayed from CUDA graphs, within the
    tolerance rule of stock at the same dtype against float64; a scale change after capture shows."""
    unet = ip_unet(2)
    ref64 = ip_out(copy.deepcopy(unet).double(), 2)
    unet = unet.to("cuda", dtype)
    stock = ip_out(unet, 2)
    sd_kernels.patch(unet, cuda_graph=True)
    for _ in range(2):  # capture, then replay
        assert_close_to_reference(ip_out(unet, 2), stock, ref64)
    for p in processors(unet).values():
        if isinstance(p, IPAdapterAttnProcessor2_0):
            p.scale[1] = 0.0
    graphed = ip_out(unet, 2)
    sd_kernels.unpatch(unet)
    assert_close_to_reference(graphed, ip_out(unet, 2), ip_out(unet.double().cpu(), 2))

