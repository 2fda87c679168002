"""patches/split_decode.py: one VAE decode split over processes by rows, every process ending with the image.

Here, in one process: W "processes" as threads whose collectives meet in memory (``Threads``), each
decoding its band, against the decoder's own forward (W = 1 to 4, even and uneven bands, odd widths;
the norms on the PyTorch reference: the interpreter is not thread-safe, and the kernels' own tests
are in tests/ops/test_group_norm.py); processes holding different latents all raise; the public
``enable_split_decode`` on a one-process group (its refusals, the record, exact unpatch); the split
VAE kept out of CUDA graphs. Two real processes (gloo): test_parallel.py."""

import threading

import pytest
import torch
import torch.distributed as dist
from diffusers.models.attention_processor import AttnProcessor2_0
from sd_kernels.patches import cuda_graph, split_decode, stream_decode
from test_cuda_graph import fake_cuda  # noqa: F401  (a fixture: the stand-in for CUDA graphs)

import sd_kernels
from sd_kernels import models

# fp32 on the CPU: a band's convolutions and attention block differently from the whole image's (measured
# ≤ 6e-6 of an output whose largest value is about 2)
ATOL = 2e-5


class Custom(AttnProcessor2_0):
    """A processor of the user's own (the band re-states only ours and the stock ones)."""


class Threads(split_decode.Exchange):
    """Process ``rank`` of ``world`` threads: an all-gather is every thread's tensor stacked, in rank order."""

    def __init__(self, rank: int, world: int, shared: dict) -> None:
        self.rank, self.world, self.shared = rank, world, shared

    def gather(self, x):
        slots, barrier = self.shared["slots"], self.shared["barrier"]
        slots[self.rank] = x.contiguous().clone()
        barrier.wait()
        out = torch.stack(slots)
        barrier.wait()
        return out


def on_threads(world: int, fn) -> list:
    """``fn(exchange)`` on ``world`` threads; what each returned (an exception, where it raised)."""
    shared = {"slots": [None] * world, "barrier": threading.Barrier(world, timeout=60)}
    out: list = [None] * world

    def run(rank):
        try:
            with torch.no_grad():  # grad mode is per thread: the decode runs outside autograd, as SplitForward's
                out[rank] = fn(Threads(rank, world, shared))
        except Exception as exc:  # noqa: BLE001  (reported to the test; a thread left waiting times out)
            out[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


@pytest.fixture(scope="module")
def vae():
    torch.manual_seed(0)
    return models.build_model("tiny-xl", "vae").eval()


@pytest.fixture
def reference_ops(monkeypatch):
    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")


def split(decoder, z, world: int, head: bool = True) -> list:
    """Every process's image of ``decoder(z)`` split over ``world`` threads (``head``: the head in bands too)."""
    us = (split_decode.head_units(decoder) if head else []) + stream_decode.units(decoder)
    return on_threads(world, lambda ex: split_decode.decode_band(decoder, us, z, ex, head))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("shape", [(1, 4, 16, 12), (1, 4, 13, 7)])
@pytest.mark.parametrize("head", [True, False])
def test_every_process_ends_with_the_whole_decode(vae, reference_ops, world, shape, head):
    """Each band with its neighbours' margins and the whole image's statistics (the mid-block's attention
    over every process's keys, or the head whole on every process): the image is the decoder's own to
    fp32 rounding, on every process (13 rows over 3 or 4 processes: bands of unequal height)."""
    z = torch.randn(shape)
    with torch.no_grad():
        want = vae.decoder(z)
        got = split(vae.decoder, z, world, head)
    for image in got:
        assert not isinstance(image, Exception), image
        assert image.shape == want.shape
        torch.testing.assert_close(image, want, rtol=0, atol=ATOL)


@pytest.mark.parametrize("processor", ["legacy", "fused"])
def test_the_attention_band_under_each_stock_processor(vae, reference_ops, processor):
    """The mid-block's attention in bands under diffusers' AttnProcessor (its scale) and FusedAttnProcessor2_0
    (fuse_qkv_projections: one q/k/v GEMM) too: the decoder's own image, over 3 processes."""
    import copy

    from diffusers.models.attention_processor import AttnProcessor

    other = copy.deepcopy(vae)
    if processor == "legacy":
        other.decoder.mid_block.attentions[0].set_processor(AttnProcessor())
    else:
        other.fuse_qkv_projections()
    assert split_decode.head_units(other.decoder)
    z = torch.randn(1, 4, 9, 7)
    with torch.no_grad():
        want = other.decoder(z)
        for image in split(other.decoder, z, 3):
            torch.testing.assert_close(image, want, rtol=0, atol=ATOL)


def test_a_channels_last_decoder_in_its_band_kernels(vae):
    """One process, the norms' kernels through the interpreter, a channels_last decoder (as the patch
    leaves it on a GPU): the decoder's own image."""
    import copy

    cl = copy.deepcopy(vae).to(memory_format=torch.channels_last)
    z = torch.randn(1, 4, 6, 5).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        torch.testing.assert_close(split(cl.decoder, z, 1)[0], cl.decoder(z), rtol=0, atol=ATOL)


def _check(ex, z, head=True):
    """``SplitForward._check`` of ``z`` by process ``ex.rank``, then its ``_verify`` of the sums (a forward
    of its own: the check reads only its exchange)."""
    forward = split_decode.SplitForward.__new__(split_decode.SplitForward)
    forward.exchange = ex
    agreed, sums = forward._check(z, head)
    forward._verify(sums)
    return agreed


def test_processes_with_different_latents_all_raise():
    """A seed per process, or another dtype or shape, raises on every process; the same latents pass, NaN
    and infinite ones too; the head runs in bands only where every process can."""
    for outcome in on_threads(2, lambda ex: _check(ex, torch.zeros(1, 4, 8, 8) + ex.rank)):  # a seed per process
        assert isinstance(outcome, ValueError) and "decode different latents" in str(outcome)
    for outcome in on_threads(2, lambda ex: _check(ex, torch.ones(1, 4, 8, 8, dtype=(torch.float32, torch.float64)[
            ex.rank]))):
        assert isinstance(outcome, ValueError) and "of different shapes or dtypes" in str(outcome)
    for outcome in on_threads(2, lambda ex: _check(ex, torch.ones(1, 4, 8 + ex.rank, 8))):
        assert isinstance(outcome, ValueError) and "of different shapes or dtypes" in str(outcome)
    assert on_threads(2, lambda ex: _check(ex, torch.full((1, 4, 8, 8), float("inf")))) == [True, True]
    inf = float("inf")
    for pair in [(1.0, float("nan")), (1.0, inf), (inf, -inf), (1e300, inf)]:  # overflowed on one process only
        for outcome in on_threads(2, lambda ex, pair=pair: _check(ex, torch.full((1, 4, 8, 8), pair[ex.rank],
                                                                      dtype=torch.float64))):
            assert isinstance(outcome, ValueError) and "decode different latents" in str(outcome), pair
    assert on_threads(2, lambda ex: _check(ex, torch.ones(1, 4, 8, 8))) == [True, True]
    assert on_threads(2, lambda ex: _check(ex, torch.full((1, 4, 8, 8), float("nan")))) == [True, True]
    assert on_threads(2, lambda ex: _check(ex, torch.ones(1, 4, 8, 8), head=ex.rank == 0)) == [False, False]


@pytest.fixture
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_gloo_available(), reason="needs torch.distributed with the gloo backend")
def test_host_numbers_go_over_gloo_not_the_device_exchange(group, monkeypatch):
    """The agreement's host numbers travel over a gloo group: the group itself where it has gloo (alone or
    beside NCCL), else a gloo twin; never through the device's all-gather, whose read-back would wait for
    the GPU's queued work."""
    assert split_decode.host_group(group) is group
    monkeypatch.setattr(dist, "get_backend", lambda g=None: "cpu:gloo,cuda:nccl")
    assert split_decode.host_group(group) is group
    made = []
    monkeypatch.setattr(dist, "get_backend", lambda g=None: "nccl")
    monkeypatch.setattr(dist, "new_group", lambda ranks, backend: made.append((ranks, backend)) or "twin")
    assert split_decode.host_group(group) == "twin" and made == [([0], "gloo")]
    ex = split_decode.Exchange(group, group)
    monkeypatch.setattr(ex, "gather", lambda x: pytest.fail("host numbers went through the device exchange"))
    assert ex.agree([1.0, 2.0], torch.device("cpu")) == [[1.0, 2.0]]


@pytest.mark.skipif(not dist.is_gloo_available(), reason="needs torch.distributed with the gloo backend")
def test_a_gloo_group_made_for_the_split_ends_with_it(group, reference_ops, monkeypatch):
    """On a process group without gloo the split makes a gloo group for its host numbers; unpatch ends it
    (a library user who splits and unpatches again and again keeps no groups); the group itself, where it
    has gloo, is never ended by the split."""
    def alive(g) -> bool:
        try:
            return dist.get_process_group_ranks(g) == [0]
        except KeyError:  # torch's answer for a group that was ended
            return False

    twin = dist.new_group([0], backend="gloo")
    pipe = models.build_pipeline("tiny-xl")
    sd_kernels.patch(pipe, cuda_graph=False)
    monkeypatch.setattr(split_decode, "host_group", lambda g: twin)
    sd_kernels.enable_split_decode(pipe)
    assert vars(pipe.vae.decoder)["forward"].exchange.host_group is twin and alive(twin)
    sd_kernels.unpatch(pipe)
    assert not alive(twin)
    monkeypatch.setattr(split_decode, "host_group", lambda g: g)
    sd_kernels.patch(pipe, cuda_graph=False)
    sd_kernels.enable_split_decode(pipe)
    sd_kernels.unpatch(pipe)
    assert alive(group)


def _decode(pipe, z):
    with torch.no_grad():
        return pipe.vae.decode(z, return_dict=False)[0]


@pytest.mark.skipif(not dist.is_gloo_available(), reason="needs torch.distributed with the gloo backend")
def test_enable_on_a_patched_pipeline_and_unpatch(group, reference_ops):
    pipe = models.build_pipeline("tiny-xl")
    z = torch.randn(1, 4, 8, 8)
    stock = _decode(pipe, z)
    with pytest.raises(ValueError, match="patch this StableDiffusionXLPipeline first"):
        sd_kernels.enable_split_decode(pipe)
    sd_kernels.patch(pipe, cuda_graph=False)
    record = sd_kernels.enable_split_decode(pipe)
    assert sd_kernels.enable_split_decode(pipe) is record  # again: nothing more
    assert record.counts["split_decode"] == 1
    forward = vars(pipe.vae.decoder)["forward"]
    assert isinstance(forward, split_decode.SplitForward) and forward.head()  # our processor: the head in bands
    assert cuda_graph.runs_collectives(pipe.vae) == cuda_graph.SPLIT
    torch.testing.assert_close(_decode(pipe, z), stock, rtol=0, atol=ATOL)
    mid = pipe.vae.decoder.mid_block.attentions[0]
    ours = mid.processor
    mid.set_processor(Custom())  # set since: not one a band re-states, so the head runs whole
    assert forward.head() is None
    torch.testing.assert_close(_decode(pipe, z), stock, rtol=0, atol=ATOL)
    mid.set_processor(ours)
    sd_kernels.unpatch(pipe)
    assert "forward" not in vars(pipe.vae.decoder) and cuda_graph.SPLIT_DECODE not in vars(pipe.vae)
    assert torch.equal(_decode(pipe, z), stock)


@pytest.mark.skipif(not dist.is_gloo_available(), reason="needs torch.distributed with the gloo backend")
def test_refusals(group):
    pipe = models.build_pipeline("tiny")
    sd_kernels.patch(pipe, cuda_graph=False)
    pipe.vae.decoder.up_blocks[0].resnets[0].conv1.register_forward_hook(lambda *a: None)
    with pytest.raises(ValueError, match="cannot be split .*conv1 is not a plain same-padded nn.Conv2d"):
        sd_kernels.enable_split_decode(pipe)
    pipe.vae.decoder.up_blocks[0].resnets[0].conv1._forward_hooks.clear()
    own = pipe.vae.decoder.forward
    pipe.vae.decoder.forward = lambda *args, **kwargs: own(*args, **kwargs)
    with pytest.raises(ValueError, match="forward is replaced already"):
        sd_kernels.enable_split_decode(pipe)
    pipe.vae.decoder.forward = own  # the class's own, bound: what accelerate's hook removal leaves behind
    sd_kernels.enable_split_decode(pipe)
    sd_kernels.unpatch(pipe)
    assert vars(pipe.vae.decoder)["forward"] == own


@pytest.mark.skipif(not dist.is_gloo_available(), reason="needs torch.distributed with the gloo backend")
def test_graphs_captured_before_are_dropped_and_a_compiled_decode_steps_aside(group, fake_cuda,  # noqa: F811
                                                                              monkeypatch):
    """A VAE decode captured before the split loses its graphs at ``enable_split_decode`` (they hold no
    collectives and would be kept, unreplayed, until unpatch); then it runs eagerly, and under
    ``compile=True`` through its uncompiled method (torch.compile cannot trace the split's read-back)."""
    pipe = models.build_pipeline("tiny")
    z = torch.randn(1, 4, 8, 8)
    stock = _decode(pipe, z)
    sd_kernels.patch(pipe, cuda_graph=True)
    graphed = vars(pipe.vae)["decode"]
    torch.testing.assert_close(_decode(pipe, z), stock, rtol=0, atol=ATOL)
    assert graphed.graphs and len(fake_cuda) == 1
    sd_kernels.enable_split_decode(pipe)
    assert not graphed.graphs

    def compiled(*args, **kwargs):
        raise AssertionError("the compiled decode ran a split decode")

    graphed.forward = compiled  # as compile=True leaves it; eager_fn stays the plain method
    torch.testing.assert_close(_decode(pipe, z), stock, rtol=0, atol=ATOL)
    assert not graphed.graphs and len(fake_cuda) == 1
    # with collectives captured, a call eager for another reason (SDXL's weights, moved every call) too
    monkeypatch.setenv(cuda_graph.COLLECTIVES_ENV, "1")
    pipe.vae.to(torch.float64)
    torch.testing.assert_close(_decode(pipe, z.double()), stock.double(), rtol=0, atol=ATOL)
    sd_kernels.unpatch(pipe)


@pytest.mark.skipif(not dist.is_gloo_available(), reason="needs torch.distributed with the gloo backend")
def test_a_head_it_does_not_know_runs_whole(vae, group):
    """A mid-block attention with a processor of its own: the split runs the head whole on every process
    (test_every_process_ends_with_the_whole_decode: the decoder's own image then too); a head of another
    structure is named."""
    import copy

    other = copy.deepcopy(vae)
    other.decoder.mid_block.attentions[0].set_processor(Custom())
    with pytest.raises(stream_decode.Unsupported, match="runs a Custom"):
        split_decode.head_units(other.decoder)
    forward = split_decode.SplitForward(other.decoder, stream_decode.units(other.decoder), group)
    assert forward.head() is None and len(forward.units) == len(stream_decode.units(other.decoder))
    other.decoder.mid_block.attentions = torch.nn.ModuleList([])
    with pytest.raises(stream_decode.Unsupported, match="two ResNet blocks around one attention"):
        split_decode.head_units(other.decoder)


@pytest.mark.skipif(not dist.is_gloo_available(), reason="needs torch.distributed with the gloo backend")
def test_hooks_are_run_not_skipped(group, reference_ops):
    """A hook on the mid-block: the split runs the head whole, the hook with it (the hooked decode's image);
    a hook inside the up-stack: the split is refused (a band would skip it)."""
    pipe = models.build_pipeline("tiny-xl")
    sd_kernels.patch(pipe, cuda_graph=False)
    handle = pipe.vae.decoder.mid_block.register_forward_hook(lambda module, args, out: out * 0.5)
    z = torch.randn(1, 4, 8, 8)
    hooked = _decode(pipe, z)
    sd_kernels.enable_split_decode(pipe)
    assert vars(pipe.vae.decoder)["forward"].head() is None
    torch.testing.assert_close(_decode(pipe, z), hooked, rtol=0, atol=ATOL)
    handle.remove()
    sd_kernels.unpatch(pipe)
    sd_kernels.patch(pipe, cuda_graph=False)
    pipe.vae.decoder.up_blocks[1].resnets[0].register_forward_pre_hook(lambda module, args: None)
    with pytest.raises(ValueError, match="up_blocks.1.resnets.0 has hooks"):
        sd_kernels.enable_split_decode(pipe)
    sd_kernels.unpatch(pipe)


@pytest.mark.skipif(not dist.is_gloo_available(), reason="needs torch.distributed with the gloo backend")
def test_while_a_graph_captures_the_last_agreement_holds(group, reference_ops, monkeypatch):
    """During a capture (nothing read back, no check) the head runs as the last check agreed (the capture's
    warm-up call makes one): in bands after an agreement, whole before any; a process that can no longer
    run it in bands after agreeing raises instead of leaving the others in different collectives."""
    pipe = models.build_pipeline("tiny-xl")
    sd_kernels.patch(pipe, cuda_graph=False)
    sd_kernels.enable_split_decode(pipe)
    forward = vars(pipe.vae.decoder)["forward"]
    z = torch.randn(1, 4, 8, 8)
    heads, capturing = [], [True]
    decode_band, check = split_decode.decode_band, split_decode.SplitForward._check
    monkeypatch.setattr(split_decode, "decode_band", lambda *a: heads.append(a[-1]) or decode_band(*a))
    monkeypatch.setattr(split_decode, "_capturing", lambda x: capturing[0])
    monkeypatch.setattr(split_decode.SplitForward, "_check",
                        lambda *a: pytest.fail("checked while capturing") if capturing[0] else check(*a))
    _decode(pipe, z)  # never agreed: whole
    capturing[0] = False
    _decode(pipe, z)  # a call outside a capture: checked, agreed
    assert forward.agreed
    capturing[0] = True
    _decode(pipe, z)
    assert heads == [False, True, True]
    pipe.vae.decoder.mid_block.attentions[0].set_processor(Custom())
    with pytest.raises(RuntimeError, match="no longer can while a CUDA graph captures"):
        _decode(pipe, z)
    sd_kernels.unpatch(pipe)


def test_no_process_group_is_a_clear_error():
    pipe = models.build_pipeline("tiny")
    sd_kernels.patch(pipe, cuda_graph=False)
    with pytest.raises(ValueError, match="no(ne)? .*initialized"):
        sd_kernels.enable_split_decode(pipe)
    sd_kernels.unpatch(pipe)


def test_a_split_vae_is_not_captured_unless_collectives_are(monkeypatch):
    vae = models.build_model("tiny", "vae")
    assert cuda_graph.runs_collectives(vae) is None
    setattr(vae, cuda_graph.SPLIT_DECODE, True)
    monkeypatch.setenv(cuda_graph.COLLECTIVES_ENV, "0")
    assert "enable_split_decode" in cuda_graph.graphable_reason(vae)
    monkeypatch.setenv(cuda_graph.COLLECTIVES_ENV, "1")
    assert cuda_graph._parallel_blocks_capture(vae) is None


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gpu_split_decode_errs_as_little_as_the_whole_decode(dtype):
    """SD1.5's VAE on the GPU at 512² (fp16, and fp32 as the SDXL pipeline decodes), patched: two processes
    (threads, after one warm-up decode compiled the kernels) each decode their band; against the float64
    decode, the split image errs within a small multiple of stock diffusers' decode's own error."""
    import copy

    vae = models.build_model("sd15", "vae", device="cuda", dtype=dtype).eval()
    z = torch.randn(1, 4, 64, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    with torch.no_grad():
        exact = copy.deepcopy(vae).double().decoder(z.double())
        stock = vae.decoder(z.to(dtype))
        sd_kernels.patch(vae, cuda_graph=False)
        split(vae.decoder, z.to(dtype), 1)  # compiles the kernels (threads must not compile at once)
        got = split(vae.decoder, z.to(dtype), 2)
        torch.cuda.synchronize()
        sd_kernels.unpatch(vae)
    err_stock = float((stock.double() - exact).abs().max())
    for image in got:
        assert not isinstance(image, Exception), image
        assert float((image.double() - exact).abs().max()) <= 4 * err_stock + 1e-6, err_stock
