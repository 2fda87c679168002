"""The "winograd" patcher: which convs it swaps, per-call routing by the profile, the transformed-
weight cache, outputs ≈ stock, unpatch bit-identical.

The routing decision is the profile's; these tests install a stand-in profile with a chosen rule so
that they test the patch, not the catalog's data (tests/test_profiles.py tests that).
"""

import dataclasses
import importlib
from collections.abc import Callable

import pytest
import torch
import torch.nn as nn
from sd_kernels.patches import patch, unpatch

from sd_kernels.models import build_model
from sd_kernels.profiles import Profile, get_profile
from sd_kernels.runtime import dispatch
from sd_kernels.testing import rel_err

wg_patch = importlib.import_module("sd_kernels.patches.winograd")
WinogradConv2d = wg_patch.WinogradConv2d


@dataclasses.dataclass(frozen=True, eq=False)
class RouteProfile(Profile):
    """A profile (by default the cpu one, under its name) that routes the convs ``rule(n, c, h, w, k)``
    names a tile for."""

    rule: Callable = lambda n, c, h, w, k: None
    asked: list = dataclasses.field(default_factory=list)

    def routes_winograd(self, c, k, layout="nchw"):
        return any(self.rule(1, c, h, h, k) for h in (1, 4, 8, 16, 64))

    def winograd_tile(self, n, c, h, w, k, dtype, layout="nchw"):
        self.asked.append((n, c, h, w, k, dtype))
        return self.rule(n, c, h, w, k)


@pytest.fixture
def route(monkeypatch):
    """``route(rule)`` makes a RouteProfile with ``rule``: the profile to patch with, and the active
    one for a WinogradConv2d made by hand."""

    def install(rule, eager=True, base="cpu"):
        fields = {f.name: getattr(get_profile(base), f.name) for f in dataclasses.fields(Profile)}
        prof = RouteProfile(**fields, rule=rule)  # the base's name: its shipped tuning tables
        monkeypatch.setattr(wg_patch, "active_profile", lambda: prof)
        monkeypatch.setattr(wg_patch, "ROUTE_EAGER", eager)
        return prof

    return install


def _qualifying(model):
    return [m for m in model.modules() if wg_patch.qualifies(m)]


def _unet_call(model):
    """The tiny UNet on an 8x8 latent: its 32-channel convs run at 8x8, its 64-channel ones at 4x4 but
    the up-block's upsampler conv (8x8)."""
    g = torch.Generator().manual_seed(1)
    x, t, ctx = torch.randn(2, 4, 8, 8, generator=g), torch.tensor([10, 500]), torch.randn(2, 7, 32, generator=g)
    return lambda: model(x, t, ctx).sample


def test_qualifies_only_plain_3x3_stride_1():
    assert wg_patch.qualifies(nn.Conv2d(4, 8, 3, padding=1))
    assert not wg_patch.qualifies(nn.Conv2d(4, 8, 3, padding=1, stride=2))  # downsamplers
    assert not wg_patch.qualifies(nn.Conv2d(4, 8, 1))  # shortcuts, proj_in/out
    assert not wg_patch.qualifies(nn.Conv2d(4, 8, 3, padding=1, groups=2))
    assert not wg_patch.qualifies(nn.Conv2d(4, 8, 3, padding=1, padding_mode="reflect"))

    class MyConv(nn.Conv2d):
        pass

    assert not wg_patch.qualifies(MyConv(4, 8, 3, padding=1))  # a subclass's forward is not ours to vouch for


def test_profile_routing_nothing_swaps_nothing(route):
    prof = route(lambda n, c, h, w, k: None)
    unet = build_model("tiny", "unet")
    record = patch(unet, ops=["winograd"], profile=prof)
    assert record.counts.get("winograd_conv", 0) == 0
    assert not any(isinstance(m, WinogradConv2d) for m in unet.modules())
    unpatch(unet)


def test_patch_routes_per_call_and_round_trips(route):
    # Route only convs with 64 output channels at 8x8 maps, with F(2,3): every 64-channel conv is swapped,
    # and all but the upsampler's (the only one at 8x8) stay stock per call.
    prof = route(lambda n, c, h, w, k: 2 if (k, h) == (64, 8) else None)
    unet = build_model("tiny", "unet")
    call = _unet_call(unet)
    params = unet.state_dict(keep_vars=True)
    with torch.no_grad():
        stock = call()
        expected = sum(m.out_channels == 64 for m in _qualifying(unet))
        record = patch(unet, ops=["winograd"], profile=prof)
        assert record.counts["winograd_conv"] == expected > 0
        swapped = [m for m in unet.modules() if isinstance(m, WinogradConv2d)]
        assert all(m.out_channels == 64 for m in swapped)
        ours = call()
        routed = [a for a in prof.asked if prof.rule(*a[:5])]
        assert routed, "no conv was routed: the test would not test Winograd"
        assert len(routed) < len(prof.asked), "every call was routed: per-call routing is not tested"
        assert any(m.transformed_bytes() > 0 for m in swapped)
        # fp32 through the interpreter: Winograd F(2,3) rounds a little differently from a direct conv.
        assert rel_err(ours, stock) < 1e-4
        sd = unet.state_dict(keep_vars=True)
        assert sd.keys() == params.keys() and all(sd[k] is params[k] for k in sd)
        unpatch(unet)
        assert not any(isinstance(m, WinogradConv2d) for m in unet.modules())
        assert torch.equal(call(), stock)


def test_without_cuda_graphs_nothing_is_swapped(route):
    prof = route(lambda n, c, h, w, k: 2, eager=False)
    unet = build_model("tiny", "unet")
    record = patch(unet, ops=["winograd"], profile=prof)
    assert not record.counts.get("winograd_conv")
    assert any("cuda_graph=True" in s.reason for s in record.skipped)
    unpatch(unet)


def test_a_profile_routing_nothing_reports_nothing(route):
    prof = route(lambda n, c, h, w, k: None, eager=False)
    unet = build_model("tiny", "unet")
    record = patch(unet, ops=["winograd"], profile=prof)
    assert not record.counts.get("winograd_conv") and not record.skipped
    unpatch(unet)


def test_unrouted_call_is_the_stock_conv(route):
    route(lambda n, c, h, w, k: 2 if h == 8 else None)
    conv = nn.Conv2d(6, 5, 3, padding=1)
    ours = WinogradConv2d(conv)
    x = torch.randn(2, 6, 7, 9)  # h = 7: not routed
    with torch.no_grad():
        assert torch.equal(ours(x), conv(x))
    assert ours.transformed_bytes() == 0


def test_transformed_weight_cache_follows_the_weight(route):
    route(lambda n, c, h, w, k: 2)
    conv = nn.Conv2d(6, 5, 3, padding=1).requires_grad_(False)
    ours = WinogradConv2d(conv)
    x = torch.randn(1, 6, 8, 8)
    with torch.no_grad():
        first = ours.transformed(2)
        assert ours.transformed(2) is first  # cached
        before = ours(x)
        conv.weight.mul_(2)  # in place, e.g. fusing a LoRA: the version counter moves
        assert ours.transformed(2) is not first
        after = ours(x)
    ref = torch.nn.functional.conv2d(x.double(), conv.weight.double(), conv.bias.double(), padding=1)
    assert rel_err(after, ref) < 1e-5
    assert rel_err(before, ref) > 0.1  # the stale weights would have been far off


def test_inference_mode_weights(route):
    """Weights made under torch.inference_mode have no version counter: the cache keys on storage."""
    route(lambda n, c, h, w, k: 2)
    with torch.inference_mode():
        conv = nn.Conv2d(6, 5, 3, padding=1)
        ours = WinogradConv2d(conv)
        x = torch.randn(1, 6, 8, 8)
        assert ours.transformed(2) is ours.transformed(2)
        y = ours(x)
    ref = torch.nn.functional.conv2d(x.double(), conv.weight.double(), conv.bias.double(), padding=1)
    assert rel_err(y, ref) < 1e-5


def test_dtype_mismatch_runs_stock(route):
    route(lambda n, c, h, w, k: 2)
    conv = nn.Conv2d(6, 5, 3, padding=1)
    ours = WinogradConv2d(conv)
    x = torch.randn(1, 6, 8, 8, dtype=torch.float64)  # conv weights are fp32: torch raises, like stock
    with pytest.raises(RuntimeError):
        conv(x)
    with pytest.raises(RuntimeError):
        ours(x)


def test_triton_backend_reaches_the_kernel(route, monkeypatch):
    """SD_KERNELS_BACKEND=triton: a routed conv must run the kernel (or raise), never fall back quietly."""
    if not dispatch.interpreting() and not torch.cuda.is_available():
        pytest.skip("kernels need the interpreter or a GPU")
    monkeypatch.setenv("SD_KERNELS_BACKEND", "triton")
    route(lambda n, c, h, w, k: 4)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    conv = nn.Conv2d(3, 4, 3, padding=1).to(device).requires_grad_(False)
    x = torch.randn(1, 3, 5, 6, device=device)
    ref = torch.nn.functional.conv2d(x.double(), conv.weight.double(), conv.bias.double(), padding=1)
    assert rel_err(WinogradConv2d(conv)(x), ref) < 1e-4


@pytest.mark.gpu
def test_gpu_sd15_unet_routed_by_the_profile():
    """SD1.5's UNet (random weights, fp16, batch 2) patched with only the winograd family and
    cuda_graph=True, under the detected profile's real routing: convs swapped and routed (transformed
    weights cached), the graph replay within 1e-2 of stock (the bar for whole-pipeline
    latents), and unpatch bit-identical."""
    unet = build_model("sd15", "unet", device="cuda", dtype=torch.float16)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(2, 4, 64, 64, device="cuda", dtype=torch.float16, generator=g)
    ctx = torch.randn(2, 77, 768, device="cuda", dtype=torch.float16, generator=g)
    t = torch.tensor([500, 500], device="cuda")
    with torch.no_grad():
        stock = unet(x, t, ctx).sample
        record = patch(unet, ops=["winograd"], cuda_graph=True)
        if not record.counts.get("winograd_conv"):
            pytest.skip(f"profile {record.profile!r} routes no SD1.5 conv to Winograd")
        ours = unet(x, t, ctx).sample
        again = unet(x, t, ctx).sample  # a replay
        routed = sum(m.transformed_bytes() > 0 for m in unet.modules() if isinstance(m, WinogradConv2d))
        unpatch(unet)
        after = unet(x, t, ctx).sample
    assert routed > 0
    assert rel_err(ours, stock) < 1e-2
    assert torch.equal(ours, again)
    assert torch.equal(after, stock)


@pytest.mark.integration
@pytest.mark.slow
def test_compiled_unet_runs_routed_convs_as_one_custom_op(route):
    """torch.compile(fullgraph=True) of a UNet with routed convs: the routing is decided at trace time,
    each routed call is one ``sd_kernels.winograd_conv2d`` node, the op finds the transformed weights
    its conv cached (no per-call transform), and the output is the eager patched one."""
    from torch._dynamo.backends.registry import lookup_backend

    wg_ops = importlib.import_module("sd_kernels.ops.winograd")
    prof = route(lambda n, c, h, w, k: 2 if (c, k, h) == (32, 32, 8) else None)  # four calls: the ResNets' 32→32
    unet = build_model("tiny", "unet")
    patch(unet, ops=["winograd"], profile=prof)
    call = _unet_call(unet)
    with torch.no_grad():
        prof.asked.clear()
        eager = call()
        routed = sum(prof.rule(*a[:5]) is not None for a in prof.asked)
        graphs = []

        def backend(gm, example_inputs):
            graphs.append(gm)
            return lookup_backend("aot_eager")(gm, example_inputs)

        torch._dynamo.reset()
        unet.forward = torch.compile(unet.forward, backend=backend, fullgraph=True)
        before = wg_ops.uncached_calls
        out = call()
        del unet.forward
        torch._dynamo.reset()
    (gm,) = graphs
    nodes = [n for n in gm.graph.nodes if str(n.target).startswith("sd_kernels.winograd_conv2d")]
    assert routed > 0 and len(nodes) == routed
    assert wg_ops.uncached_calls == before
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
    unpatch(unet)


def test_a_weight_updated_in_place_invalidates_captured_graphs(route):
    """What a CUDA graph of the UNet watches: an in-place update of a routed conv's weight (e.g.
    ``load_state_dict``) changes it, so the graph is captured again and the weight transformed again."""
    cg = importlib.import_module("sd_kernels.patches.cuda_graph")
    prof = route(lambda n, c, h, w, k: 2)
    unet = build_model("tiny", "unet")
    patch(unet, ops=["winograd"], profile=prof)
    watch = cg._Watch(unet)
    before = watch.state(())
    assert watch.state(()) == before
    conv = next(m for m in unet.modules() if isinstance(m, WinogradConv2d))
    with torch.no_grad():
        unet.load_state_dict(unet.state_dict())  # copies in place: same storage, new versions
    assert watch.state(()) != before
    conv.weight = nn.Parameter(conv.weight.detach().clone(), requires_grad=False)  # replaced
    after = watch.state(())
    assert after != before and watch.state(()) == after
    unpatch(unet)


@pytest.mark.gpu
def test_gpu_channels_last_routes_also_under_compile(route):
    """SD1.5's UNet (random weights, fp16, batch 2) patched with every family (channels_last on
    Hopper) and a stand-in profile that routes its deep convs (the shipped one routes none
    channels_last: they lose inside the UNet, tests/test_profiles.py), with and without
    ``compile=True``: every routed call reaches the kernel in channels_last, replays are within 1e-2
    of stock, and under inductor the custom op finds the cached transforms (no per-call transform)."""
    wg_ops = importlib.import_module("sd_kernels.ops.winograd")
    prof = route(lambda n, c, h, w, k: 2 if c >= 640 and h <= 16 else None, eager=False, base="hopper")
    unet = build_model("sd15", "unet", device="cuda", dtype=torch.float16)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(2, 4, 64, 64, device="cuda", dtype=torch.float16, generator=g)
    ctx = torch.randn(2, 77, 768, device="cuda", dtype=torch.float16, generator=g)
    t = torch.tensor([500, 500], device="cuda")
    layouts = []
    real_tile = wg_patch.WinogradConv2d.tile_for
    with torch.no_grad():
        stock = unet(x, t, ctx).sample
        for compile in (False, True):
            record = patch(unet, profile=prof, cuda_graph="unet", compile=compile)
            assert record.counts.get("winograd_conv"), record.skipped
            before = wg_ops.uncached_calls
            prof.asked.clear()
            wg_patch.WinogradConv2d.tile_for = lambda self, x: layouts.append(x.stride(1) == 1) or real_tile(self, x)
            try:
                ours = unet(x, t, ctx).sample
            finally:
                wg_patch.WinogradConv2d.tile_for = real_tile
            routed = sum(m.transformed_bytes() > 0 for m in unet.modules() if isinstance(m, WinogradConv2d))
            assert routed > 0 and all(layouts), compile
            assert wg_ops.uncached_calls == before, compile
            assert rel_err(ours, stock) < 1e-2, compile
            unpatch(unet)
            torch._dynamo.reset()
