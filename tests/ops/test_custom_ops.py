"""sd_kernels.ops.custom_ops: the ops as torch custom ops. Fake implementations agree with the real ones
(torch.library.opcheck, output layouts); eager calls skip the dispatcher (and are cheaper for it);
a patched UNet compiles with fullgraph=True, one custom-op node per patched call, same outputs."""

import copy
import timeit

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import sd_kernels
from sd_kernels import models
from sd_kernels.ops import custom_ops

_OPS = torch.ops.sd_kernels


def _cases():
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)
    x = r(2, 8, 3, 5)
    h = r(3, 5, 16)
    q = r(2, 9, 2, 16).transpose(1, 2)  # diffusers' [B, S, H, D] viewed as [B, H, S, D]
    kv = r(2, 7, 2, 16).transpose(1, 2)
    return {
        "group_norm": (_OPS.group_norm, (x, 4, r(8), r(8), 1e-5, "silu")),
        "group_norm-channels_last": (_OPS.group_norm, (x.to(memory_format=torch.channels_last), 4, None, None,
                                                       1e-6, None)),
        "gelu": (_OPS.gelu, (h, "tanh")),
        "gelu-strided": (_OPS.gelu, (h[:, ::2], "none")),
        "quick_gelu": (_OPS.quick_gelu, (h,)),
        "geglu": (_OPS.geglu, (h, "none")),
        "linear_geglu": (_OPS.linear_geglu, (h, r(8, 16), r(8), "none")),
        "attention": (_OPS.attention, (q, kv, kv, None, None, False)),
        "attention-mask-scale": (_OPS.attention, (q, kv, kv, torch.rand(2, 1, 1, 7, generator=g) > 0.3, 0.5, True)),
        "winograd_conv2d": (_OPS.winograd_conv2d, (x, r(4, 8, 3, 3), r(4), 2)),
        "winograd_conv2d-channels_last": (_OPS.winograd_conv2d, (x.to(memory_format=torch.channels_last),
                                                                 r(4, 8, 3, 3), None, 4)),
        "attention-contiguous": (_OPS.attention, (q.contiguous(), kv.contiguous(), kv.contiguous(), None, None,
                                                  False)),
        # PixArt's modulation: [B, 1, D] chunks of a [B, 6, D] table; a strided (transposed) residual
        "layer_norm_modulated": (_OPS.layer_norm_modulated, (h, None, None, 1e-6, r(3, 6, 16)[:, 1:2], r(3, 1, 16))),
        "gated_residual_layer_norm": (_OPS.gated_residual_layer_norm,
                                      (r(5, 3, 16).transpose(0, 1), h, r(3, 1, 16), r(16), r(16), 1e-6, r(3, 16),
                                       None)),
        # mixed dtypes: the kernels refuse them and the reference promotes; the fakes must promote alike
        "layer_norm_modulated-mixed": (_OPS.layer_norm_modulated, (h.bfloat16(), None, None, 1e-6, r(3, 16), None)),
        "gated_residual_layer_norm-mixed": (_OPS.gated_residual_layer_norm,
                                            (h.bfloat16(), h.bfloat16(), r(3, 16), None, None, 1e-6, None,
                                             r(3, 16).double())),
    }


CASES = _cases()


@pytest.mark.parametrize("name", list(CASES))
def test_opcheck(name):
    op, args = CASES[name]
    torch.library.opcheck(op.default, args, test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_fake_layout_is_the_real_layout(name, backend, monkeypatch):
    """Code compiled after an op assumes the fake's strides: the real op must return exactly them,
    from the kernels and from the reference fallback alike."""
    monkeypatch.setenv("SD_KERNELS_BACKEND", backend)
    op, args = CASES[name]
    real = op(*args)
    with torch._subclasses.FakeTensorMode() as mode:
        fake = op(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
    for f, r in zip(*(o if isinstance(o, tuple) else (o,) for o in (fake, real)), strict=True):
        assert (f.shape, f.stride(), f.dtype) == (r.shape, r.stride(), r.dtype)


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.name())
        return func(*args, **(kwargs or {}))


def test_eager_calls_skip_the_dispatcher():
    x = torch.randn(2, 8, 4, 4)
    with _Ops() as seen:
        custom_ops.group_norm(x, 4, activation="silu")
    assert not any(n.startswith("sd_kernels::") for n in seen.names)
    with _Ops() as seen:
        _OPS.group_norm(x, 4, None, None, 1e-5, "silu")
    assert "sd_kernels::group_norm" in seen.names


def _host_us(*fns, number=50, rounds=40) -> list[float]:
    """Best µs per call of each fn, measured in alternation (a shared machine's load hits all alike)."""
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            best[i] = min(best[i], timeit.timeit(fn, number=number) / number * 1e6)
    return best


def test_eager_route_costs_less_host_time(monkeypatch, capsys):
    """Host time per call with the reference backend (tiny tensors: the call's overhead dominates)."""
    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    x, q = torch.randn(1, 8, 2, 2), torch.randn(1, 2, 4, 8)
    routes = {
        "group_norm": (lambda: custom_ops.group_norm(x, 4, None, None, 1e-5, "silu"),
                       lambda: _OPS.group_norm(x, 4, None, None, 1e-5, "silu")),
        "attention": (lambda: custom_ops.attention(q, q, q), lambda: _OPS.attention(q, q, q, None, None, False)),
    }
    with torch.no_grad():
        times = {name: _host_us(eager, custom) for name, (eager, custom) in routes.items()}
    with capsys.disabled():
        for name, (eager, custom) in times.items():
            print(f"\n  {name}: custom_ops (eager route) {eager:.1f} us/call, "
                  f"torch.ops.sd_kernels {custom:.1f} us/call")
    assert all(eager < custom for eager, custom in times.values()), times


def _count_backend(graphs):
    from torch._dynamo.backends.registry import lookup_backend

    def backend(gm, example_inputs):
        graphs.append(gm)
        return lookup_backend("aot_eager")(gm, example_inputs)

    return backend


@pytest.mark.integration
@pytest.mark.slow
def test_patched_unet_compiles_fullgraph():
    """torch.compile(fullgraph=True) of the patched tiny UNet: no graph break (fullgraph raises on
    one), one sd_kernels node per patched call, outputs as in eager. One sample, a 4x4 latent: the graph is
    under test, and the kernels run twice through the interpreter."""
    unet = models.build_model("tiny", "unet")
    g = torch.Generator().manual_seed(1)
    x, ctx = torch.randn(1, 4, 4, 4, generator=g), torch.randn(1, 7, 32, generator=g)
    with sd_kernels.patched(unet) as record, torch.no_grad():
        eager = unet(x, torch.tensor(10), encoder_hidden_states=ctx).sample
        torch._dynamo.reset()
        graphs = []
        compiled = torch.compile(unet, backend=_count_backend(graphs), fullgraph=True)
        out = compiled(x, torch.tensor(10), encoder_hidden_states=ctx).sample
        torch._dynamo.reset()
    (gm,) = graphs
    calls = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    found = {op: sum(c == f"sd_kernels.{op}.default" for c in calls) for op in ("group_norm", "attention", "geglu")}
    assert found == {"group_norm": record.counts["group_norm"] + record.counts["group_norm_silu"],
                     "attention": record.counts["attention_processor"], "geglu": record.counts["gelu.GEGLU"]}
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_patched_unet_compiles_with_inductor_on_cuda():
    """Inductor on CUDA, fullgraph: compiled patched UNet ≈ eager patched UNet (fp16)."""
    unet = models.build_model("tiny", "unet", device="cuda", dtype=torch.float16)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 16, 16, generator=g).cuda().half()
    ctx = torch.randn(2, 7, 32, generator=g).cuda().half()
    t = torch.tensor(10, device="cuda")
    stock_model = copy.deepcopy(unet)
    with sd_kernels.patched(unet, cuda_graph=False), torch.no_grad():  # eager: compile traces the modules
        eager = unet(x, t, encoder_hidden_states=ctx).sample
        torch._dynamo.reset()
        out = torch.compile(unet, fullgraph=True)(x, t, encoder_hidden_states=ctx).sample
        torch._dynamo.reset()
        stock = stock_model(x, t, encoder_hidden_states=ctx).sample
    # inductor fuses the ATen parts differently: allow what stock fp16 vs patched fp16 differ by, twice
    budget = 2 * (eager - stock).float().norm() / stock.float().norm() + 1e-3
    assert (out - eager).float().norm() / eager.float().norm() <= budget


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_patched_unet_under_inductor_cuda_graphs_is_never_skipped(mode):
    """patch(), then torch.compile in a mode with CUDA graphs, as diffusers' recipe runs it (channels_last,
    fullgraph): inductor graphs the whole call (no "skipping cudagraphs" for our custom ops: a skipped
    graph shows in inductor's counter) and the replays match the eager patched UNet."""
    from torch._dynamo.utils import counters

    unet = models.build_model("tiny", "unet", device="cuda", dtype=torch.float16)
    unet.to(memory_format=torch.channels_last)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 16, 16, generator=g).cuda().half()
    ctx = torch.randn(2, 7, 32, generator=g).cuda().half()
    t = torch.tensor(10, device="cuda")
    with sd_kernels.patched(unet, cuda_graph=False), torch.no_grad():
        eager = unet(x, t, encoder_hidden_states=ctx).sample
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(unet, mode=mode, fullgraph=True)
        outs = [compiled(x, t, encoder_hidden_states=ctx).sample.clone() for _ in range(3)]
        skips = dict(counters["inductor"])
        torch._dynamo.reset()
    assert skips.get("cudagraph_skips", 0) == 0, skips
    for out in outs:
        torch.testing.assert_close(out, eager, rtol=2e-2, atol=2e-2)


def test_every_custom_op_has_its_eager_entry_point():
    """custom_ops.OPS is read off the registrations: each is a torch.ops.sd_kernels op, and custom_ops has the
    function of that name that patched modules call (eager: the plain op; compiling: the custom op)."""
    assert len(custom_ops.OPS) == len(set(custom_ops.OPS)) >= 7
    for name in custom_ops.OPS:
        assert hasattr(torch.ops.sd_kernels, name) and callable(getattr(custom_ops, name)), name
