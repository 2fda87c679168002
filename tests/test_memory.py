import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from sd_kernels import profiles
from sd_kernels.analysis import memory_report
from sd_kernels.runtime import memory
from sd_kernels.runtime.memory import BudgetGuard, MemoryBudgetExceeded

MiB = 2**20


@pytest.fixture(autouse=True)
def _profile(monkeypatch):
    monkeypatch.setattr(profiles, "_active", None)  # patch(profile=...) sets it: keep it to this test


class FakeMemory:
    """The stats BudgetGuard reads, driven by the fake modules below instead of CUDA."""

    def __init__(self, allocated=0):
        self.now = self.top = allocated
        self.caps = []

    def allocated(self):
        return self.now

    def peak(self):
        return self.top

    def reset_peak(self):
        self.top = self.now

    def cap(self, budget):
        self.caps.append(budget)

    def alloc(self, n):
        self.now += n
        self.top = max(self.top, self.now)

    def free(self, n):
        self.now -= n


class Temp(nn.Module):
    """Allocates ``n`` bytes of intermediates for the length of its forward."""

    def __init__(self, mem, n):
        super().__init__()
        self.mem, self.n = mem, n

    def forward(self, x):
        self.mem.alloc(self.n)
        self.mem.free(self.n)
        return x


class OOM(nn.Module):
    def forward(self, x):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity")


def model(mem, *sizes):
    return nn.Sequential(nn.Identity(), nn.Sequential(*[Temp(mem, n) for n in sizes]))


def test_within_budget_runs_and_the_cap_is_set_then_lifted():
    mem = FakeMemory(allocated=100 * MiB)
    m = model(mem, 10 * MiB, 20 * MiB)
    with BudgetGuard(128 * MiB, m, "unet", stats=mem):
        m(torch.ones(1))
    assert mem.caps == [128 * MiB, None]


def test_over_budget_names_the_module_the_bytes_and_the_budget():
    mem = FakeMemory(allocated=100 * MiB)
    m = model(mem, 10 * MiB, 40 * MiB, 1 * MiB)
    with pytest.raises(MemoryBudgetExceeded) as info:
        with BudgetGuard(128 * MiB, m, "unet", stats=mem):
            m(torch.ones(1))
    err = info.value
    assert err.op == "unet.1.1 (Temp)" and err.asked == 140 * MiB and err.budget == 128 * MiB
    assert "unet.1.1 (Temp)" in str(err) and str(140 * MiB) in str(err) and str(128 * MiB) in str(err)
    assert mem.caps[-1] is None  # lifted on the way out


class Tuned(nn.Module):
    """Holds ``before`` bytes for a moment, autotunes (as ``launch.Launcher`` does for a shape no
    table holds) with a ``timing`` buffer, then allocates ``n`` bytes as the tuned kernel's call."""

    def __init__(self, mem, before, timing, n):
        super().__init__()
        self.mem, self.before, self.timing, self.n = mem, before, timing, n

    def forward(self, x):
        from sd_kernels.runtime.memory import tuning

        self.mem.alloc(self.before)
        self.mem.free(self.before)
        with tuning():
            assert self.mem.caps[-1] is None  # the cap is lifted while it tunes
            self.mem.alloc(self.timing)
            self.mem.free(self.timing)
        assert self.mem.caps[-1] == 128 * MiB
        self.mem.alloc(self.n)
        self.mem.free(self.n)
        return x


@pytest.mark.parametrize("before, after, over", [(10, 5, False), (40, 5, True), (10, 40, True)])
def test_autotuning_runs_outside_the_budget(before, after, over):
    """A 256 MiB timing buffer under a 128 MiB budget: the tuning is not charged, the call's own
    bytes before it (``before``, in the same module: only the guard's floor remembers them when the
    module returns) and after it (``after``) still are."""
    mem = FakeMemory(allocated=100 * MiB)
    m = nn.Sequential(nn.Identity(), Tuned(mem, before * MiB, 256 * MiB, after * MiB))
    guard = BudgetGuard(128 * MiB, m, "unet", stats=mem)
    if over:
        with pytest.raises(MemoryBudgetExceeded), guard:
            m(torch.ones(1))
    else:
        with guard:
            m(torch.ones(1))
    assert mem.caps[-1] is None
    from sd_kernels.runtime import launch
    from sd_kernels.runtime.memory import tuning

    assert launch.TUNING is tuning  # what Launcher enters around a tuning launch
    with tuning():  # no guard running: nothing to lift
        pass
    assert mem.caps[-1] is None


def test_allocator_oom_under_the_cap_becomes_the_clear_error():
    mem = FakeMemory(allocated=3 * 2**30)
    m = nn.Sequential(nn.Identity(), nn.Sequential(nn.Identity(), OOM()))
    with pytest.raises(MemoryBudgetExceeded) as info:
        with BudgetGuard(4 * 2**30, m, "vae.decoder", stats=mem):
            m(torch.ones(1))
    assert info.value.op == "vae.decoder.1.1 (OOM)" and info.value.asked == 5 * 2**30
    assert isinstance(info.value.__cause__, torch.OutOfMemoryError)


def test_hooks_are_gone_after_the_guard():
    mem = FakeMemory()
    m = model(mem, 10 * MiB)
    with BudgetGuard(64 * MiB, m, stats=mem):
        m(torch.ones(1))
    big = model(mem, 1000 * MiB)
    big(torch.ones(1))  # no guard, no error


@pytest.mark.parametrize("text, n", [
    ("Tried to allocate 2.00 GiB.", 2 * 2**30), ("Tried to allocate 20.50 MiB", 21495808), ("out of memory", None),
])
def test_requested_bytes(text, n):
    assert memory.requested_bytes(RuntimeError(text)) == n


def test_weights_and_peak_helpers():
    lin = nn.Linear(16, 8).to(torch.float16)
    assert memory.weights_mb(lin) == (16 * 8 + 8) * 2 / MiB
    mem = FakeMemory(allocated=5)
    peak, out = memory.peak_intermediate_bytes(lambda: (mem.alloc(7), mem.free(7), "y")[-1], mem)
    assert (peak, out) == (7, "y")


def test_peak_module_finds_where_the_peak_is():
    mem = FakeMemory(allocated=100)
    m = model(mem, 10, 70, 20)
    assert memory_report.peak_module(lambda: m(torch.ones(1)), m, mem) == ("1.1 (Temp)", 70)


# ---------------------------------------------------------------------------------------------
# The patcher


def test_chunked_feed_forward_matches_the_original():
    from diffusers.models.attention import FeedForward
    from sd_kernels.patches.memory_budget import ChunkedFeedForward

    torch.manual_seed(0)
    ff = FeedForward(8, mult=4, activation_fn="geglu").double()
    x = torch.randn(2, 13, 8, dtype=torch.float64)
    chunked = ChunkedFeedForward(ff, max_bytes=2 * 2 * 64 * 8 * 3)  # 3 tokens per slice at batch 2
    assert chunked.chunk_tokens(2, 8) == 3
    torch.testing.assert_close(chunked(x), ff(x), rtol=1e-14, atol=1e-14)
    assert chunked.state_dict().keys() == ff.state_dict().keys()
    assert ChunkedFeedForward(ff, max_bytes=1)(x).shape == x.shape  # one token at a time


def test_patch_under_a_mobile_profile_chunks_guards_and_reverts():
    from sd_kernels.patches import patch, unpatch

    from sd_kernels import models

    unet = models.build_model("tiny", "unet")
    before = {n: type(m) for n, m in unet.named_modules()}
    record = patch(unet, profile="s23-ultra", ops=["memory"])
    assert record.counts["memory.ChunkedFeedForward"] == sum(1 for t in before.values() if t.__name__ == "FeedForward")
    assert record.counts["memory.budget(4096 MB)"] == 1 and "forward" in unet.__dict__
    x = torch.randn(1, 4, 16, 16)
    ctx = torch.randn(1, 77, 32)
    with torch.no_grad():
        patched = unet(x, 10, ctx).sample  # on CPU the guard stands aside
    unpatch(unet)
    assert {n: type(m) for n, m in unet.named_modules()} == before and "forward" not in unet.__dict__
    with torch.no_grad():
        torch.testing.assert_close(patched, unet(x, 10, ctx).sample, rtol=0, atol=0)


def test_a_budget_that_cannot_be_enforced_is_said_in_the_record_and_logged_once(caplog):
    from sd_kernels.patches import patch, unpatch

    from sd_kernels import models
    from sd_kernels.runtime import memory

    unet = models.build_model("tiny", "unet")
    memory._UNGUARDED.clear()
    record = patch(unet, profile="s23-ultra", ops=["memory"])
    assert any("memory budget 4096 MB not enforced: the model is on cpu" in s.reason for s in record.skipped)
    x, ctx = torch.randn(1, 4, 16, 16), torch.randn(1, 77, 32)
    with caplog.at_level("WARNING", logger="sd_kernels"), torch.no_grad():
        for _ in range(3):
            unet(x, 10, ctx)
    logged = [r.getMessage() for r in caplog.records if "not enforced" in r.getMessage()]
    assert logged == ["sd_kernels: the 4096 MB memory budget is not enforced for UNet2DConditionModel: its inputs "
                      "are on cpu (the guard measures CUDA memory)"]
    unpatch(unet)


def test_desktop_profiles_change_nothing():
    from sd_kernels.patches import patch, unpatch

    from sd_kernels import models

    unet = models.build_model("tiny", "unet")
    record = patch(unet, profile="hopper", ops=["memory"])
    assert sum(record.counts.values()) == 0
    unpatch(unet)


# ---------------------------------------------------------------------------------------------
# GPU


@pytest.mark.gpu
def test_gpu_budget_exceeded_is_the_clear_error_not_an_oom():
    from sd_kernels.patches import patch, unpatch

    from sd_kernels import models

    unet = models.build_model("tiny", "unet", device="cuda", dtype=torch.float16)
    tight = dataclasses.replace(profiles.get_profile("s23-ultra"), name="tight", memory_budget_mb=64,
                                intermediate_budget_mb=32)
    patch(unet, profile=tight, ops=["memory"])
    try:
        x = torch.randn(16, 4, 128, 128, device="cuda", dtype=torch.float16)  # ≫ 64 MB of activations
        ctx = torch.randn(16, 77, 32, device="cuda", dtype=torch.float16)
        with pytest.raises(MemoryBudgetExceeded, match=r"UNet2DConditionModel.*budget of 64.0 MB"):
            with torch.no_grad():
                unet(x, 10, ctx)
        with torch.no_grad():
            unet(x[:1, :, :16, :16], 10, ctx[:1])  # a small call still runs: the cap was lifted
    finally:
        unpatch(unet)
        profiles.set_profile(None)


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_sd15_unet_step_fits_the_papers_84_mb_under_s23_ultra():
    """The paper's figure: 84 MB of intermediates (arXiv 2304.11267). SD1.5 UNet, batch 1, fp16."""
    from sd_kernels.patches import patch, unpatch

    from sd_kernels import models

    pipe = models.build_pipeline("sd15", device="cuda", dtype=torch.float16)
    patch(pipe, profile="s23-ultra")
    try:
        unet_row = memory_report.memory_report(pipe, batch=1)[1]
    finally:
        unpatch(pipe)
        profiles.set_profile(None)
    assert unet_row.peak_intermediate_mb <= 84, unet_row


# ---------------------------------------------------------------------------------------------
# Streamed VAE decode (patches/stream_decode.py)


def _img(x):
    return (x.float() / 2 + 0.5).clamp(0, 1)


@pytest.fixture(scope="module")
def tiny_vae():
    from sd_kernels import models

    torch.manual_seed(0)
    return models.build_model("tiny", "vae")


def _plan(decoder, z, budget, pack=False):
    """The plan whose modelled peak fits ``budget`` (the planner holds ``_UNSEEN`` back for cuDNN's
    workspace on the GPU: given here on top, so that tiny budgets plan what they say)."""
    from sd_kernels.patches import stream_decode as sd

    us = sd.units(decoder)
    n, _, h, w = z.shape
    head = n * decoder.conv_in.out_channels * h * w * z.element_size()
    return us, sd.plan(us, n, h, w, z.element_size(), budget + sd._UNSEEN, head, pack=pack)


def test_units_of_the_tiny_decoder(tiny_vae):
    from sd_kernels.patches.stream_decode import units

    us = units(tiny_vae.decoder)
    assert [(u.radius, u.scale, len(u.norms)) for u in us] == [(2, 1, 2)] * 2 + [(1, 2, 0)] + [(2, 1, 2)] * 2 + [
        (1, 2, 0)] + [(2, 1, 2)] * 2 + [(1, 1, 1)]
    up = us[2]
    assert up.need(0, 4, 10) == (0, 3) and up.need(4, 8, 10) == (1, 5) and up.need(18, 20, 10) == (8, 10)
    assert us[0].need(3, 5, 6) == (1, 6)


@pytest.mark.integration
@pytest.mark.parametrize("shape", [(1, 4, 24, 21), (2, 4, 13, 9), (1, 4, 7, 30)])
@pytest.mark.parametrize("share", [1.0, 0.4, 0.2, 0.0])
def test_streamed_decode_is_the_untiled_decode(tiny_vae, shape, share, monkeypatch):
    """Every plan (one band; bands over a few segments; the smallest-peak fallback under a budget no
    plan meets) gives the untiled decode to fp32 rounding: the whole image's statistics, no seams.
    The norms run the PyTorch reference here (hundreds of bands through the interpreter would take
    minutes); the kernels are tested in tests/ops/test_group_norm.py and below."""
    from sd_kernels.patches.stream_decode import stream_decode

    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    z = torch.randn(shape)
    _, whole = _plan(tiny_vae.decoder, z, 10**12)
    us, p = _plan(tiny_vae.decoder, z, 10**12 if share == 1 else max(1, int(whole.peak * share)))
    assert p.untiled == (share == 1.0)
    with torch.no_grad():
        ref, out = tiny_vae.decoder(z), stream_decode(tiny_vae.decoder, us, p, z)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=0, atol=2e-5)


@pytest.mark.integration
def test_streamed_decode_of_a_channels_last_decoder(tiny_vae):
    import copy

    from sd_kernels.patches.stream_decode import Plan, Segment, stream_decode, units

    vae = copy.deepcopy(tiny_vae).to(memory_format=torch.channels_last)
    z = torch.randn(1, 4, 8, 6).contiguous(memory_format=torch.channels_last)
    us = units(vae.decoder)
    # a plan of two bands a segment (the kernels run through the interpreter: few launches)
    p = Plan((Segment(0, 2, 1), Segment(2, 5, 2), Segment(5, len(us), 2)), peak=0, seconds=0, budget=0)
    with torch.no_grad():
        torch.testing.assert_close(stream_decode(vae.decoder, us, p, z), vae.decoder(z), rtol=0, atol=2e-5)


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_polyphase_upsampler_is_nearest_then_conv(layout):
    """The streamed decode's upsampler (one 2×2 conv of four phases at the input's resolution,
    interleaved) gives diffusers' nearest-2× + 3×3 conv on any band of output rows, the image's
    edges included, in float64 to rounding; a change of the conv's weights is seen."""
    from diffusers.models.upsampling import Upsample2D
    from sd_kernels.patches import stream_decode as sd

    torch.manual_seed(0)
    m = Upsample2D(6, use_conv=True, out_channels=5).double()
    x = torch.randn(2, 6, 7, 5, dtype=torch.float64)
    if layout == "nhwc":
        m, x = m.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)
    u = sd._upsampler("u", m)
    for _ in range(2):
        want = m(x)
        for c, d in [(0, 14), (0, 5), (3, 9), (9, 14), (1, 2), (13, 14), (4, 6)]:
            a, b = u.need(c, d, 7)
            with torch.no_grad():  # as the streamed decode runs (under grad it runs the original)
                got = sd._upsample_band(u, x[:, :, a:b], a, b, c, d, 7, None)
            assert got.shape == want[:, :, c:d].shape
            torch.testing.assert_close(got, want[:, :, c:d], rtol=0, atol=1e-12)
        with torch.no_grad():
            m.conv.weight.mul_(-2)  # the cached phases must follow


@pytest.mark.parametrize("pack", [False, True])
def test_a_measured_norm_sees_each_row_once(tiny_vae, pack, monkeypatch):
    """A statistics pass sums each row of a norm's input exactly once over its bands: the counts
    merged for every norm are the image's pixels times the group's channels (``pack``: a kept input
    in 8 bits is summed band by band)."""
    from sd_kernels.patches import stream_decode as sd

    merged = []
    result = sd._Pass.result
    monkeypatch.setattr(sd._Pass, "result", lambda self: merged.append(
        (self.target, sd.merge_group_stats(torch.cat(self.parts, -1))[0])) or result(self))
    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    z = torch.randn(1, 4, 20, 11)
    us, p = _plan(tiny_vae.decoder, z, 400_000, pack)
    assert any(s.packed for s in p.segments) == pack, p.format(us)
    with torch.no_grad():
        sd.stream_decode(tiny_vae.decoder, us, p, z)
    sizes = {id(n): (u, i) for i, u in enumerate(us) for n in u.norms}
    assert len(merged) == sum(len(u.norms) for s in p.segments if s.bands > 1 for u in us[s.start:s.stop])
    assert any(s.bands > 1 and s.stop - s.start > 1 for s in p.segments), p.format(us)  # passes through units
    sh = sd._shape(us, 1, 20, 11, 4)
    for norm, count in merged:
        _, i = sizes[id(norm)]
        pixels = sh.h_in[i] * sh.w_out[i] // us[i].scale
        assert torch.all(count == pixels * norm.num_channels // norm.num_groups), (us[i].name, count)


@pytest.mark.integration
@pytest.mark.parametrize("budget, pack", [(400_000, False), (150_000, False), (10**12, False), (400_000, True)])
def test_convs_of_a_plan_are_the_convs_it_runs(tiny_vae, budget, pack, monkeypatch):
    """``convs_of`` (what the workspace probe measures and the model charges) names exactly the
    convolutions a streamed decode runs: input shape, weight shape and padding, over every pass."""
    from sd_kernels.patches import stream_decode as sd

    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    z = torch.randn(1, 4, 20, 11)
    us, p = _plan(tiny_vae.decoder, z, budget, pack)
    assert any(s.packed for s in p.segments) == pack, p.format(us)
    ran, conv2d = set(), F.conv2d
    dec = tiny_vae.decoder
    head = {id(m.weight) for m in [dec.conv_in, *dec.mid_block.modules()] if isinstance(m, nn.Conv2d)}

    def spy(x, weight, bias=None, stride=1, padding=0, *args):
        if id(weight) not in head:  # the up-stack's (the head runs whole, before the buffer)
            pad = tuple(padding) if isinstance(padding, tuple) else (padding,) * 2
            ran.add((tuple(x.shape), tuple(weight.shape), pad))
        return conv2d(x, weight, bias, stride, padding, *args)

    monkeypatch.setattr(F, "conv2d", spy)
    with torch.no_grad():
        sd.stream_decode(tiny_vae.decoder, us, p, z)
    sh = sd._shape(us, 1, 20, 11, 4)
    named = set()
    for cv in sd.convs_of(us, p, 20, 11, 4):
        u = us[cv.unit]
        w = sd._polyphase(u, z).shape if cv.role == "up" else sd._conv_module(u, cv.role).weight.shape
        named.add((sd.conv_input(us, sh, cv), tuple(w), (cv.pad, 0 if w[3] == 1 else 1)))
    assert named == ran
    assert p.untiled == (budget == 10**12)


@pytest.mark.integration
@pytest.mark.parametrize("shape, budget, kernels", [
    ((1, 4, 12, 7), 250_000, False), ((1, 4, 32, 32), 1_000_000, False), ((1, 4, 12, 7), 250_000, True)])
def test_a_packed_plan_decodes_close_to_the_untiled_decode(tiny_vae, shape, budget, kernels, monkeypatch):
    """``plan(pack=True)`` keeps an activation in 8 bits (``ops.pack8``) where that fits the budget
    or is faster by the model: at 32² the plan without packing does not fit 1 MB and the packed one
    does. The image is then within the decode's 40 dB target of the untiled one, not equal to it; the norms
    still see each row once (above). ``kernels``: the Triton kernels through the interpreter."""
    from sd_kernels.patches.stream_decode import stream_decode

    from sd_kernels.testing import psnr

    if not kernels:
        monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    z = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    us, p = _plan(tiny_vae.decoder, z, budget, pack=True)
    _, plain = _plan(tiny_vae.decoder, z, budget)
    assert any(s.packed for s in p.segments) and p.peak <= budget, p.format(us)
    assert plain.peak > budget or p.seconds < plain.seconds, (p.format(us), plain.format(us))
    with torch.no_grad():
        ref, out = tiny_vae.decoder(z), stream_decode(tiny_vae.decoder, us, p, z)
    assert psnr(_img(out), _img(ref)) >= 40
    assert not torch.equal(out, ref)


@pytest.mark.integration
def test_sd15_under_64_mib_keeps_its_512_activations_in_8_bits(monkeypatch):
    """SD1.5's decode under mobile-small's 64 MiB cannot keep a 128-channel 512² activation in fp16
    (64 MiB); packed (36 MiB) it can, and the plan then runs each 512² ResNet from it instead of
    recomputing the last stage from 256² for each of its norms. Under 84 MiB nothing is packed: the
    fp16 plan is as fast. ``plan(pack=True)`` makes the plan without packing too (``_plan``), the very plan
    ``plan(pack=False)`` returns: each budget's is taken from there rather than searched again."""
    from sd_kernels.patches import stream_decode as sd
    from sd_kernels.patches import stream_plan

    from sd_kernels import models

    made = []  # (packing, the plan) of each search, in order
    search = stream_plan._plan
    monkeypatch.setattr(stream_plan, "_plan", lambda *a: made.append((a[-1], p := search(*a))) or p)

    def plans(budget):  # (the plan chosen with packing allowed, the plan without)
        made.clear()
        chosen = sd.plan(us, 1, 64, 64, 2, budget, head, pack=True)
        assert [packing for packing, _ in made] == [False, True]
        return chosen, made[0][1]

    vae = models.build_model("sd15", "vae", device="meta", dtype=torch.float16)
    us = sd.units(vae.decoder)
    head = 512 * 64 * 64 * 2
    roomy, unpacked = plans(84 * 2**20)
    assert roomy == unpacked and not any(s.packed for s in roomy.segments)
    tight, plain = plans(64 * 2**20)
    assert tight.peak <= 64 * 2**20 - sd._UNSEEN and tight.seconds < plain.seconds / 1.5, (tight.format(us),
                                                                                           plain.format(us))
    packed = {us[s.stop - 1].name for s in tight.segments if s.packed}
    assert {"up_blocks.3.resnets.0", "up_blocks.3.resnets.1"} <= packed, tight.format(us)


def test_measured_workspace_is_charged_to_its_band(tiny_vae):
    """A plan given measured workspace (as the GPU's first decode of a shape measures it) holds only
    ``_SLACK`` back and charges each band the workspace of its convolutions: charging every conv of
    a plan makes its bands' modelled peaks grow by it, and the next plan still fits."""
    from sd_kernels.patches import stream_decode as sd

    us = sd.units(tiny_vae.decoder)
    budget, head = 400_000 + sd._SLACK, 64 * 20 * 11 * 4
    p0 = sd.plan(us, 1, 20, 11, 4, budget, head, workspace={})
    assert not p0.untiled and p0.peak <= budget - sd._SLACK
    ws = dict.fromkeys(sd.convs_of(us, p0, 20, 11, 4), 30_000)
    sh0, sh1 = sd._shape(us, 1, 20, 11, 4, {}), sd._shape(us, 1, 20, 11, 4, ws)
    for s in p0.segments:
        if s.bands > 1:
            base = sd._working(us, sh0, s.start, s.stop, s.bands)
            assert sd._working(us, sh1, s.start, s.stop, s.bands) == base + 30_000
    p1 = sd.plan(us, 1, 20, 11, 4, budget, head, workspace=ws)
    assert p1.peak <= budget - sd._SLACK and p1 != p0


def test_plan_fits_the_budget_and_prefers_fewer_passes(tiny_vae):
    z = torch.randn(1, 4, 32, 32)
    _, roomy = _plan(tiny_vae.decoder, z, 10**9)
    assert roomy.untiled and len(roomy.segments) == 1
    _, tight = _plan(tiny_vae.decoder, z, 4 * 2**20)  # untiled: ≈ 12 MiB by the model
    assert tight.peak <= 4 * 2**20 and not tight.untiled
    _, impossible = _plan(tiny_vae.decoder, z, 1)
    assert impossible.peak > 1  # the smallest-peak plan, over the budget: still a plan


@pytest.mark.integration
def test_sd15_plan_under_s23_ultra_keeps_the_model_peak_under_84_mb():
    from sd_kernels.patches import stream_decode as sd

    from sd_kernels import models

    vae = models.build_model("sd15", "vae", device="meta", dtype=torch.float16)
    us = sd.units(vae.decoder)
    p = sd.plan(us, 1, 64, 64, 2, 84 * 2**20, 512 * 64 * 64 * 2)
    assert not p.untiled and p.peak <= 84 * 2**20 - sd._UNSEEN, p.format(us)
    # the 512² activations are kept (one pass per ResNet there), not recomputed from 256² for each norm
    assert any(us[s.start].name == "up_blocks.3.resnets.1" and s.stop - s.start == 1 for s in p.segments), p.format(us)


def test_a_batch_is_planned_and_decoded_one_sample_at_a_time(tiny_vae, monkeypatch):
    """``stream_decode`` decodes a batch sample by sample, so the forward plans for one sample: a
    batch of 2 gets the same plan as a batch of 1, and the untiled decode's images."""
    from sd_kernels.patches import stream_decode as sd

    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    z = torch.randn(2, 4, 16, 12)
    _, one = _plan(tiny_vae.decoder, z[:1], 400_000)
    with torch.no_grad():
        out = sd.streaming_forward(tiny_vae.decoder, 400_000 + sd._UNSEEN)(z)
        ref = tiny_vae.decoder(z)
    (p,) = sd.plans_of(tiny_vae.decoder).values()
    assert p.segments == one.segments and not p.untiled
    torch.testing.assert_close(out, ref, rtol=0, atol=2e-5)


def test_an_unsupported_decoder_runs_untiled_and_says_so(tiny_vae, caplog):
    import copy

    from sd_kernels.patches.stream_decode import streaming_forward

    vae = copy.deepcopy(tiny_vae)
    vae.decoder.up_blocks[0].upsamplers[0].interpolate = False
    z = torch.randn(1, 4, 8, 8)
    with caplog.at_level("WARNING", logger="sd_kernels"), torch.no_grad():
        forward = streaming_forward(vae.decoder, 1)
        out = forward(z)
    assert "not a nearest-2× + conv Upsample2D" in caplog.text
    torch.testing.assert_close(out, vae.decoder(z), rtol=0, atol=0)


@pytest.mark.integration
@pytest.mark.parametrize("ops, pack", [(["memory"], False), (["group_norm", "memory"], False), (["memory"], True)])
def test_patched_vae_decode_streams_under_a_small_budget(tiny_vae, ops, pack, monkeypatch):
    """``pack``: the profile's ``stream_pack8`` reaches the plan (the image within 40 dB, not 60); a
    48² latent, with nothing held back for cuDNN (none on CPU), so that packing is what fits 4 MB."""
    from sd_kernels.patches import patch, stream_plan, unpatch
    from sd_kernels.patches.stream_decode import plans_of

    from sd_kernels.testing import psnr

    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")  # many bands: see above
    small = dataclasses.replace(profiles.get_profile("s23-ultra"), name="small", intermediate_budget_mb=4,
                                stream_pack8=pack)
    z = torch.randn(1, 4, 32, 32)  # untiled: ≈ 6.4 MiB of intermediates by the plan's model
    if pack:
        monkeypatch.setattr(stream_plan, "_UNSEEN", 0)
        z = torch.randn(1, 4, 48, 48)
    with torch.no_grad():
        ref = tiny_vae.decode(z).sample
        record = patch(tiny_vae, profile=small, ops=ops)
        try:
            assert record.counts["memory.streaming_vae_decode"] == 1
            out = tiny_vae.decode(z).sample
            (p,) = plans_of(tiny_vae.decoder).values()
            assert not p.untiled and any(s.packed for s in p.segments) == pack
            tiny_vae.decode(z[..., :4, :4])  # a small latent fits: the original forward
        finally:
            unpatch(tiny_vae)
            profiles.set_profile(None)
    assert "forward" not in tiny_vae.decoder.__dict__
    assert psnr(_img(out), _img(ref)) >= (40 if pack else 60)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("profile", ["s23-ultra", "mobile-small"])
def test_gpu_sd15_vae_decode_streamed_within_the_budget_and_exact(profile):
    """SD1.5's VAE in fp16 at 512²: the streamed decode the mobile patch installs peaks within the
    profile's intermediate budget (allocated during the call, weights and latent excluded) and gives
    the untiled image (PSNR ≥ 40 dB)."""
    from sd_kernels.patches import patch, unpatch

    from sd_kernels import models
    from sd_kernels.testing import psnr

    vae = models.build_model("sd15", "vae", device="cuda", dtype=torch.float16)
    z = torch.randn(1, 4, 64, 64, device="cuda", dtype=torch.float16, generator=torch.Generator("cuda").manual_seed(0))
    with torch.no_grad():
        ref = vae.decode(z).sample
        record = patch(vae, profile=profile)
        try:
            assert record.counts["memory.streaming_vae_decode"] == 1
            vae.decode(z)  # compiles and tunes the bands' kernels (their own allocations)
            peak, out = memory.peak_intermediate_bytes(lambda: vae.decode(z).sample, memory.CudaMemory())
        finally:
            unpatch(vae)
            profiles.set_profile(None)
    budget = profiles.get_profile(profile).intermediate_budget_mb * 2**20
    assert peak <= budget, f"{peak / 2**20:.1f} MiB"
    assert psnr(_img(out), _img(ref)) >= 40


# ---------------------------------------------------------------------------------------------
# The budget checked before any work: weights (counted on the meta device) and the profile's allowance


def test_plan_counts_each_tensor_once_and_says_what_is_over():
    lin = nn.Linear(16, 8).half()
    shared = nn.Sequential(lin, lin)  # the same weights twice: held once
    assert memory.weight_bytes(shared) == (16 * 8 + 8) * 2
    meta = nn.Sequential(nn.Linear(16, 8, device="meta"), nn.Linear(16, 8, device="meta"))  # addresses all 0
    assert memory.weight_bytes(meta) == 2 * (16 * 8 + 8) * 4
    plan = memory.plan_budget({"a": lin, "b": meta}, budget=10_000, allowance=100)
    assert plan.resident and plan.total == 272 + 1088 + 100 and "fits" in plan.format()
    with pytest.raises(MemoryBudgetExceeded, match=r"^b needs .* \(1088 bytes of weights \+ 100 bytes"):
        memory.plan_budget({"a": lin, "b": meta}, budget=1000, allowance=100)  # b alone is over
    with pytest.raises(MemoryBudgetExceeded, match=r"held at once \(a 0\.0 MB \+ b 0\.0 MB\) needs .* \(1460 bytes\)"):
        memory.plan_budget({"a": lin, "b": meta}, budget=1400, allowance=100)  # each fits, both do not
    swapped = memory.plan_budget({"a": lin, "b": meta}, budget=1400, allowance=100, chain=["a", "b"])
    assert not swapped.resident and swapped.swapped and "moved to the device for its call" in swapped.format()
    with pytest.raises(MemoryBudgetExceeded, match=r"^b needs"):  # moving weights cannot help one that is over alone
        memory.plan_budget({"a": lin, "b": meta}, budget=1000, allowance=100, chain=["a", "b"])
    # a model outside the chain stays on the device beside the largest of it (diffusers' offload keeps it)
    with pytest.raises(MemoryBudgetExceeded, match=r"one model at a time \(b 0\.0 MB \+ a 0\.0 MB on the device"):
        memory.plan_budget({"a": lin, "b": meta}, budget=1400, allowance=100, chain=["b"])


def test_sdxl_under_a_phone_budget_fails_before_any_change():
    """SDXL's UNet alone (4.9 GB of fp16 weights) is over the S23 Ultra's 4096 MB: patch() says so
    before it changes anything (the pipeline is built on the meta device: no memory, no weights)."""
    import sd_kernels
    from sd_kernels import models

    pipe = models.build_pipeline("sdxl", device="meta", dtype=torch.float16)
    unet_bytes = memory.weight_bytes(pipe.unet)
    with pytest.raises(MemoryBudgetExceeded, match=r"^unet needs") as err:
        sd_kernels.patch(pipe, profile="s23-ultra")
    assert err.value.asked == unet_bytes + 84 * MiB and err.value.budget == 4096 * MiB
    assert sd_kernels.patches.patch_record(pipe) is None and "forward" not in vars(pipe.unet)


def test_weights_that_fit_only_one_at_a_time_are_moved_in_and_out():
    """SD1.5 1 MiB short of holding everything at once: the plan moves each model in for its call
    (on CUDA: the GPU test below); built on the meta device, the patch says it moved nothing. An
    object without diffusers' model_cpu_offload_seq cannot: the clear error before any work."""
    import types

    import sd_kernels
    from sd_kernels import models

    pipe = models.build_pipeline("sd15", device="meta", dtype=torch.float16)
    total = sum(memory.weight_bytes(m) for m in pipe.components.values() if isinstance(m, nn.Module))
    tight = dataclasses.replace(profiles.get_profile("s23-ultra"), name="tight",
                                memory_budget_mb=(total + 84 * MiB) // MiB)  # 1 MiB short of everything at once
    with sd_kernels.patched(pipe, profile=tight, cuda_graph=False) as record:
        assert record.memory_plan.swapped and "moved to the device for its call" in record.format()
        assert any(s.what == "weights" and "the pipeline is on meta" in s.reason for s in record.skipped)
    with pytest.raises(ValueError, match="moved in and out"):
        sd_kernels.patch(pipe, profile=tight, cuda_graph=True)
    bare = types.SimpleNamespace(components=dict(pipe.components))
    with pytest.raises(MemoryBudgetExceeded, match="held at once .*model_cpu_offload_seq"):
        sd_kernels.patches.memory_plan(bare, tight)
    roomy = dataclasses.replace(tight, memory_budget_mb=tight.memory_budget_mb + 1)
    plan = sd_kernels.patches.memory_plan(pipe, roomy)
    assert plan.resident and not plan.swapped and set(plan.weights) == {"vae", "text_encoder", "unet"}


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_weights_moved_in_and_out_give_the_resident_image_and_unpatch_exactly():
    """SD1.5 on the GPU under a 1,900 MB budget (the UNet's 1,639 MB fit with the intermediates, all
    2,034 MB do not): two steps give the image the same profile gives with every model resident
    (a roomy budget; ≥ 55 dB: the streamed decode's plan and cuDNN's choices follow the memory
    around them), within the budget; unpatch puts every model back on the GPU, with no hook or
    attribute left."""
    import sd_kernels
    from sd_kernels import models

    pipe = models.build_pipeline("sd15", device="cuda", dtype=torch.float16)
    pipe.set_progress_bar_config(disable=True)
    pipe("a cat", num_inference_steps=1, output_type="pt")  # the call's own attributes (_guidance_scale, …)
    before = {k: set(vars(m)) for k, m in pipe.components.items() if isinstance(m, nn.Module)}
    pipe_keys = set(vars(pipe))
    # the decode kept exact (no 8-bit activations): the two runs' plans may differ with the memory around them
    base = dataclasses.replace(profiles.get_profile("mobile-small"), name="swap", stream_pack8=False)
    images = {}
    for name, mb in (("resident", 4096), ("swapped", 1900)):
        prof = dataclasses.replace(base, memory_budget_mb=mb)
        with sd_kernels.patched(pipe, profile=prof) as record:
            assert record.memory_plan.swapped == (name == "swapped"), record.format()
            images[name] = pipe("a cat", num_inference_steps=2, generator=torch.Generator("cuda").manual_seed(0),
                                output_type="pt").images
            if name == "swapped":
                assert record.counts["memory.weights_moved_in_and_out"] == 3
                assert all(p.device.type == "cpu" for p in pipe.unet.parameters())  # offloaded after the call
        profiles.set_profile(None)
        assert all(p.device.type == "cuda" for m in before for p in getattr(pipe, m).parameters())
        assert {k: set(vars(getattr(pipe, k))) for k in before} == before and set(vars(pipe)) == pipe_keys
    from sd_kernels.testing import psnr

    assert psnr(images["swapped"], images["resident"]) >= 55


def test_the_plan_is_in_the_record(capsys):
    import sd_kernels
    from sd_kernels import models

    pipe = models.build_pipeline("tiny")
    with sd_kernels.patched(pipe, profile="s23-ultra") as record:
        assert record.memory_plan.resident and record.memory_plan.budget == 4096 * MiB
        assert "memory plan: budget 4096 MB" in record.format()
    with sd_kernels.patched(pipe, profile="cpu") as record:
        assert record.memory_plan is None


def test_generate_checks_the_budget_before_building(tmp_path, monkeypatch, capsys):
    from sd_kernels import models
    from sd_kernels.apps.cli import main

    monkeypatch.setattr(models, "load_pipeline", lambda *a, **k: pytest.fail("built a pipeline"))
    (tmp_path / "p.txt").write_text("a cat\n")
    argv = ["generate", "--prompts", str(tmp_path / "p.txt"), "--out", str(tmp_path / "o"), "--model", "sdxl",
            "--profile", "s23-ultra", "--device", "cpu"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "error: unet needs" in err and "over the budget of 4096.0 MB" in err and "before any work" in err
    assert not (tmp_path / "o" / "manifest.jsonl").exists()


class _Grows(nn.Module):
    """Wraps a model: each call holds ``n`` more bytes of intermediates for its length."""

    def __init__(self, mem, n):
        super().__init__()
        self.mem, self.n = mem, n

    def __call__(self, fn):
        def call(*args, **kwargs):
            self.mem.alloc(self.n)
            try:
                return fn(*args, **kwargs)
            finally:
                self.mem.free(self.n)

        return call


def test_pipeline_memory_table_of_one_call():
    """PipelineMemory: per component its weights, the largest call's intermediates, its calls; the
    whole call's peak against the budget; and every method put back afterwards."""
    from sd_kernels import models

    pipe = models.build_pipeline("tiny")
    pipe.set_progress_bar_config(disable=True)
    weights = sum(memory.weight_bytes(m) for m in pipe.components.values() if isinstance(m, nn.Module))
    mem = FakeMemory(allocated=weights)
    sizes = {"text_encoder": 3 * MiB, "unet": 7 * MiB, "vae": 11 * MiB}
    pipe.vae.decode = _Grows(mem, sizes["vae"])(pipe.vae.decode)  # a patch's wrapper: stays below ours
    pipe.unet.forward = _Grows(mem, sizes["unet"])(pipe.unet.forward)
    wrapped = (vars(pipe.unet)["forward"], vars(pipe.vae)["decode"])
    encoder = type(pipe.text_encoder)
    grows = _Grows(mem, sizes["text_encoder"])
    # the text encoder's forward is its class's (no instance attribute to put back)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(encoder, "forward", grows(encoder.forward))
        mp.setattr(pipe.scheduler, "step", _Grows(mem, 20 * MiB)(pipe.scheduler.step))  # between the models
        with memory_report.PipelineMemory(pipe, budget=weights + 10 * MiB, stats=mem) as table, torch.no_grad():
            pipe("a cat", num_inference_steps=3, height=64, width=64, output_type="pt")
    assert {p: r.peak_intermediate for p, r in table.parts.items()} == sizes
    # two prompts encoded (with guidance); PNDM runs its first of 3 steps twice (its Runge-Kutta warm-up)
    assert {p: r.calls for p, r in table.parts.items()} == {"text_encoder": 2, "unet": 4, "vae": 1}
    assert table.parts["unet"].weights == memory.weight_bytes(pipe.unet) and table.weights == weights
    assert table.before == weights and table.total_peak == weights + 20 * MiB  # the scheduler's, between calls
    text = table.format("test")
    assert "unet" in text and "OVER" in text and f"{(weights + 20 * MiB) / MiB:.1f} MB" in text
    assert "forward" not in vars(pipe.text_encoder)  # put back: no instance attribute, as before
    assert (vars(pipe.unet)["forward"], vars(pipe.vae)["decode"]) == wrapped
