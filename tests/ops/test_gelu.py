"""gelu, quick_gelu, geglu, linear_geglu, linear_gelu against float64, with stock PyTorch's error as the yardstick.

CPU: tiny shapes through the Triton interpreter (linear_geglu in fp32/fp16 only: the interpreter's
bf16 tl.dot is garbage). GPU (-m gpu): SD1.5's feed-forward shapes, bf16 dots, offsets past 2^31.
"""

import importlib

import pytest
import torch
import torch.nn.functional as F

from sd_kernels import profiles, reference
from sd_kernels.ops import geglu, gelu, linear_geglu, linear_gelu
from sd_kernels.runtime import dispatch
from sd_kernels.testing import assert_close_to_reference, non_contiguous, poison_, rel_err

gelu_mod = importlib.import_module("sd_kernels.ops.gelu")  # the name `gelu` in sd_kernels.ops is the function
quick_gelu, reference_quick_gelu = gelu_mod.quick_gelu, gelu_mod.reference_quick_gelu
reference_linear_geglu = gelu_mod.reference_linear_geglu

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
APPROX = ["none", "tanh"]


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    """Every output starts as NaN, so an element the kernel does not write fails the comparison."""
    alloc = gelu_mod._alloc
    monkeypatch.setattr(gelu_mod, "_alloc", lambda *args: poison_(alloc(*args)))


def layout(x: torch.Tensor, kind: str) -> torch.Tensor:
    """The same values as x in another memory layout."""
    if kind == "contiguous":
        return x
    if kind == "strided":  # every other element of a doubled last dim: a [rows, last] view, no copy
        return non_contiguous(x)
    if kind == "transposed":  # dense, permuted: runs flat over storage and keeps its strides
        return x.transpose(0, -1).contiguous().transpose(0, -1)
    if kind == "channels_last":
        return x.contiguous(memory_format=torch.channels_last)
    if kind == "expanded":  # broadcast rows (row stride 0): other values, same shape; fine for a test
        return x.narrow(-2, 0, 1).expand(x.shape)
    if kind == "gapped":  # leading dims that do not collapse into one row stride: the one-copy path
        wide = torch.empty(x.shape[1], x.shape[0], *x.shape[2:-1], 2 * x.shape[-1], dtype=x.dtype,
                           device=x.device)
        view = wide.transpose(0, 1)[..., ::2]
        view.copy_(x)
        return view
    raise ValueError(kind)


DENSE_LAYOUTS = ("contiguous", "transposed", "channels_last")
GELU_CASES = [  # (shape, layout)
    ((7,), "contiguous"),
    ((3, 77), "contiguous"),
    ((2, 5, 1), "contiguous"),
    ((3, 77), "strided"),
    ((3, 77), "transposed"),
    ((2, 3, 4, 5), "channels_last"),
    ((3, 4, 9), "gapped"),
    ((3, 77), "expanded"),
    ((), "contiguous"),
]


def _input(shape, dtype, device, scale=3.0):
    return (scale * torch.randn(shape, dtype=torch.float64, device=device)).to(dtype)


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, kind", GELU_CASES)
def test_gelu(shape, kind, dtype, approximate, device):
    x = layout(_input(shape, dtype, device), kind)
    ours, stock = gelu(x, approximate), F.gelu(x, approximate=approximate)
    assert_close_to_reference(ours, stock, reference.gelu(x.double(), approximate))
    if kind in DENSE_LAYOUTS:
        assert ours.stride() == stock.stride()


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 5, 77), (1, 9, 24), (3, 40)])
def test_gelu_into_a_slice_of_a_wider_buffer(shape, dtype, approximate, device):
    """Written in place into the last columns of a wider buffer (a projection's input built without a
    concatenation): the slice as stock computes it, within float64's tolerance; the columns before it
    untouched; and into rows that are not one stride apart, the same result (through the reference)."""
    x = _input(shape, dtype, device)
    wide = torch.full((*shape[:-1], shape[-1] + 8), 7.0, dtype=dtype, device=device)
    stock, ref = F.gelu(x, approximate=approximate), reference.gelu(x.double(), approximate)
    out = gelu_mod.gelu_into(x, wide[..., 8:], approximate)
    assert out.data_ptr() == wide[..., 8:].data_ptr()
    assert_close_to_reference(wide[..., 8:], stock, ref)
    assert (wide[..., :8] == 7).all()
    if len(shape) == 3:  # batch rows and token rows at unrelated strides: no [rows, cols] view exists
        gapped = torch.zeros(shape[1], shape[0], shape[-1] + 3, dtype=dtype, device=device).transpose(0, 1)[..., 3:]
        gelu_mod.gelu_into(x, gapped, approximate)
        assert_close_to_reference(gapped, stock, ref)


def test_gelu_into_refuses_an_output_of_another_shape_or_dtype(device):
    x = torch.zeros(2, 3, device=device)
    for out in (torch.zeros(2, 4, device=device), torch.zeros(2, 3, device=device, dtype=torch.float16)):
        with pytest.raises(ValueError, match="must match x"):
            gelu_mod.gelu_into(x, out)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the interpreter's numpy
@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gelu_extreme_values(dtype, approximate, device):
    """Large |x|: the tanh form's exp2 overflows to inf on purpose; the limits must come out exact."""
    big = 1e4 if dtype == torch.float16 else 1e30
    x = torch.cat([torch.linspace(-60, 60, 241), torch.tensor([-big, big, 0.0, -0.0, 1e-6, -1e-6])])
    x = x.to(device=device, dtype=dtype)
    ours, ref = gelu(x, approximate), reference.gelu(x.double(), approximate)
    assert torch.isfinite(ours).all()
    assert_close_to_reference(ours, F.gelu(x, approximate=approximate), ref)
    assert ours[-6:-4].tolist() == [0.0, x[-5].item()]  # gelu(-big) = -0 and gelu(big) = big, exactly


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, kind", GELU_CASES[:5])
def test_quick_gelu(shape, kind, dtype, device):
    x = layout(_input(shape, dtype, device), kind)
    assert_close_to_reference(quick_gelu(x), reference_quick_gelu(x), reference_quick_gelu(x.double()))


GEGLU_CASES = [  # (h shape, layout); h's last dim is 2n
    ((4, 16), "contiguous"),
    ((2, 3, 154), "contiguous"),
    ((5, 2), "contiguous"),
    ((2,), "contiguous"),
    ((2, 3, 154), "strided"),
    ((6, 40), "transposed"),
    ((3, 4, 10), "gapped"),
    ((2, 3, 154), "expanded"),
]


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, kind", GEGLU_CASES)
def test_geglu(shape, kind, dtype, approximate, device):
    h = layout(_input(shape, dtype, device), kind)
    ours = geglu(h, approximate)
    assert_close_to_reference(ours, reference.geglu(h, approximate), reference.geglu(h.double(), approximate))
    assert ours.is_contiguous()


# (x shape, n): x [..., K] and weight [2n, K]
LINEAR_CASES = [((1, 16), 8), ((2, 33, 40), 24), ((70, 24), 40), ((5, 64), 32)]


def _linear_inputs(x_shape, n, dtype, device, bias=True):
    k = x_shape[-1]
    x = _input(x_shape, dtype, device, scale=1.0)
    w = (torch.randn(2 * n, k, dtype=torch.float64, device=device) / k**0.5).to(dtype)
    b = (0.5 * torch.randn(2 * n, dtype=torch.float64, device=device)).to(dtype) if bias else None
    return x, w, b


def _check_linear_geglu(x, w, b, approximate="none"):
    ours = linear_geglu(x, w, b, approximate)
    stock = reference_linear_geglu(x, w, b, approximate)
    ref64 = reference_linear_geglu(*(None if t is None else t.double() for t in (x, w, b)), approximate)
    return assert_close_to_reference(ours, stock, ref64)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("x_shape, n", LINEAR_CASES)
def test_linear_geglu(x_shape, n, dtype, bias, device):
    _check_linear_geglu(*_linear_inputs(x_shape, n, dtype, device, bias))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_linear_geglu_tanh_and_strided_operands(dtype, device):
    x, w, b = _linear_inputs((2, 33, 40), 24, dtype, device)
    w_col_major = w.t().contiguous().t()  # same values, K-major storage: the kernel takes any strides
    _check_linear_geglu(non_contiguous(x), w_col_major, b, "tanh")


# ---------------------------------------------------------------------------------------------
# linear_gelu: cuBLASLt's bias + tanh-GELU epilogue on CUDA where the profile sets it; else linear + gelu


def _gelu_linear_inputs(x_shape, n, dtype, device, bias=True):
    x, w, b = _linear_inputs(x_shape, n, dtype, device, bias)
    return x, w[:n].contiguous(), None if b is None else b[:n].contiguous()


def _check_linear_gelu(x, w, b, approximate):
    ours = linear_gelu(x, w, b, approximate)
    stock = F.gelu(F.linear(x, w, b), approximate=approximate)
    ref64 = reference.gelu(F.linear(*(None if t is None else t.double() for t in (x, w, b))), approximate)
    return assert_close_to_reference(ours, stock, ref64)


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("x_shape, n", LINEAR_CASES)
def test_linear_gelu(x_shape, n, bias, approximate, device):
    _check_linear_gelu(*_gelu_linear_inputs(x_shape, n, torch.float32, device, bias), approximate)


def _epilogue_profile(monkeypatch, **fields):
    import dataclasses

    monkeypatch.setattr(profiles, "_active", dataclasses.replace(profiles.get_profile("cpu"), **fields))


def test_gelu_epilogue_reason(monkeypatch, device):
    """Only the tanh GELU with a bias, on CUDA, where the profile sets gelu_epilogue and does not disable
    linear_gelu, outside the reference backend, for inputs autograd does not track."""
    x, w, b = _gelu_linear_inputs((3, 16), 8, torch.float32, device)
    why = lambda approximate="tanh", bias=b: gelu_mod.gelu_epilogue_reason(x, w, bias, approximate)  # noqa: E731
    assert "tanh" in why("none") and "bias" in why(bias=None) and "CUDA" in why()
    _epilogue_profile(monkeypatch)
    assert "does not set gelu_epilogue" in gelu_mod._profile_epilogue_reason()
    _epilogue_profile(monkeypatch, gelu_epilogue=True)
    assert gelu_mod._profile_epilogue_reason() == ""
    _epilogue_profile(monkeypatch, gelu_epilogue=True, disabled_ops=frozenset({"linear_gelu"}))
    assert "disables linear_gelu" in gelu_mod._profile_epilogue_reason()
    _epilogue_profile(monkeypatch, gelu_epilogue=True)
    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    assert "reference" in gelu_mod._profile_epilogue_reason()


def test_only_hopper_takes_the_gelu_epilogue():
    """Set where it was measured (docs/kernels/gelu.md): the H100."""
    assert {n for n in profiles.list_profiles() if profiles.get_profile(n).gelu_epilogue} == {"hopper"}


@pytest.mark.parametrize("shape", [(0, 6), (3, 0), (2, 0, 4)])
def test_empty(shape, device):
    h = torch.randn(shape, device=device)
    assert gelu(h).shape == h.shape
    assert geglu(h).shape == (*shape[:-1], shape[-1] // 2)
    x, w, b = torch.randn(*shape[:-1], 8, device=device), torch.randn(6, 8, device=device), None
    assert linear_geglu(x, w, b).shape == (*shape[:-1], 3)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda d: geglu(torch.randn(3, 77, device=d)), ValueError, "even last dimension, got 77"),
        (lambda d: geglu(torch.randn(1, device=d)), ValueError, "even last dimension, got 1"),
        (lambda d: gelu(torch.randn(4, device=d), "sigmoid"), ValueError, "approximate must be one of"),
        (lambda d: geglu(torch.randn(4, device=d), "erf"), ValueError, "approximate must be one of"),
        (lambda d: linear_geglu(torch.randn(2, 8, device=d), torch.randn(6, 7, device=d)), RuntimeError,
         r"shapes cannot be multiplied \(2x8 and 7x6\)"),
        (lambda d: linear_geglu(torch.randn(2, 8, device=d), torch.randn(5, 8, device=d)), ValueError,
         "even number of output features, got 5"),
        (lambda d: linear_geglu(torch.randn(2, 8, device=d), torch.randn(6, 8, device=d),
                                torch.randn(5, device=d)), ValueError, r"bias must have shape \(6,\)"),
        (lambda d: linear_geglu(torch.randn(2, 8, device=d), torch.randn(6, 8, device=d).half()),
         RuntimeError, "one dtype"),
        (lambda d: linear_geglu(torch.randn(2, 8, device=d), torch.randn(6, 8, 1, device=d)), ValueError,
         "2-D weight"),
    ],
)
def test_bad_input(call, error, match, device):
    with pytest.raises(error, match=match):
        call(device)


def test_off_ground_inputs_take_the_reference(device):
    """float64 and autograd inputs are off the kernels' ground: the reference runs, logged once."""
    dispatch.reset_fallbacks()
    x = torch.randn(4, 10, dtype=torch.float64, device=device)
    assert torch.equal(gelu(x), reference.gelu(x))
    assert torch.equal(geglu(x), reference.geglu(x))
    xg = torch.randn(4, 10, device=device, requires_grad=True)
    geglu(xg).sum().backward()
    assert xg.grad is not None and torch.isfinite(xg.grad).all()
    reasons = {reason for _, reason in dispatch.fallbacks()}
    assert any("float64" in r for r in reasons) and any("requires grad" in r for r in reasons)


# ---------------------------------------------------------------------------------------------
# geglu's plans per call signature: a call like an earlier kernel call skips the checks and dispatch


@pytest.fixture
def geglu_spied(monkeypatch, count_calls):
    """A fresh plan cache; counts of dispatch decisions and of elementwise launches."""
    monkeypatch.setattr(gelu_mod, "_GEGLU_PLANS", {})
    return count_calls(gelu_mod, decided="use_kernel", launched="_ELEMENTWISE")


def _check_geglu(h, approximate="none"):
    ours = geglu(h, approximate)
    assert_close_to_reference(ours, reference.geglu(h, approximate), reference.geglu(h.double(), approximate))
    return ours


def test_geglu_plans(geglu_spied, device):
    h = _input((2, 3, 154), torch.float16, device)
    for _ in range(3):
        _check_geglu(h)
    _check_geglu(_input((2, 3, 154), torch.float16, device))  # other data, same signature
    assert geglu_spied == {"decided": 1, "launched": 4} and len(gelu_mod._GEGLU_PLANS) == 1
    for _ in range(2):
        _check_geglu(h, "tanh")
        _check_geglu(h.float())
    assert geglu_spied == {"decided": 3, "launched": 8} and len(gelu_mod._GEGLU_PLANS) == 3


@pytest.mark.parametrize("kind, cached", [("strided", True), ("rows", True), ("transposed", False),
                                          ("expanded", False), ("gapped", False)])
def test_geglu_plans_see_strides(kind, cached, geglu_spied, device):
    """Same shape, other strides: planned apart; a layout that costs _as_rows a copy is never cached."""
    h = _input((3, 4, 10), torch.float16, device)
    if kind == "rows":  # rows of a wider tensor: a [rows, 10] view with row stride 16
        other = torch.zeros(3, 4, 16, dtype=h.dtype, device=device)[..., :10].copy_(h)
    else:
        other = layout(h, kind)
    assert other.shape == h.shape and other.stride() != h.stride()
    for x in (h, other, h, other):
        _check_geglu(x)
    assert geglu_spied == {"decided": 2 if cached else 3, "launched": 4}
    assert len(gelu_mod._GEGLU_PLANS) == (2 if cached else 1)


def test_geglu_plans_see_profile_backend_and_grad(geglu_spied, monkeypatch, device):
    profiles = importlib.import_module("sd_kernels.profiles")
    h = _input((5, 2, 8), torch.float32, device)
    _check_geglu(h)
    _check_geglu(h)
    assert geglu_spied == {"decided": 1, "launched": 2}
    monkeypatch.delenv("SD_KERNELS_BACKEND", raising=False)
    dispatch.reset_fallbacks()
    monkeypatch.setattr(profiles, "_active", profiles.Profile("test", "test", disabled_ops=frozenset({"geglu"})))
    _check_geglu(h)
    _check_geglu(h)
    assert geglu_spied == {"decided": 3, "launched": 2}
    assert dispatch.fallbacks() == {("geglu", "profile 'test' disables geglu"): 2}
    monkeypatch.setattr(profiles, "_active", profiles.Profile("test", "test"))
    _check_geglu(h)
    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    assert torch.equal(geglu(h), reference.geglu(h))
    monkeypatch.delenv("SD_KERNELS_BACKEND")
    _check_geglu(h)  # as before the switch: the plan made then
    assert geglu_spied == {"decided": 5, "launched": 4}
    hg = h.clone().requires_grad_()
    out = geglu(hg)
    assert out.requires_grad and geglu_spied["launched"] == 4
    with torch.no_grad():  # nothing to track: h's plan
        _check_geglu(hg)
    assert geglu_spied == {"decided": 6, "launched": 5}


# ---------------------------------------------------------------------------------------------
# GPU: SD1.5 feed-forward shapes. GEGLU's projection has 2n outputs for n = 4·dim: dim 320, 640,
# 1280 at 64², 32², 16² latent tokens (batch 2 for classifier-free guidance).

SD_GEGLU = [(2, 4096, 2560), (2, 1024, 5120), (2, 256, 10240)]  # h [B, tokens, 2n]
SD_LINEAR = [((2, 4096, 320), 1280), ((2, 1024, 640), 2560), ((2, 256, 1280), 5120), ((77, 40), 24)]


@pytest.mark.gpu
@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, kind", [((2, 4096, 1280), "contiguous"), ((8192, 2560), "strided"),
                                         ((2, 320, 64, 64), "channels_last"), ((2, 1024, 5120), "gapped")])
def test_gelu_gpu(shape, kind, dtype, approximate):
    test_gelu(shape, kind, dtype, approximate, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SD_GEGLU + [(2, 4096, 5120)])
def test_geglu_gpu(shape, dtype, approximate):
    test_geglu(shape, "contiguous", dtype, approximate, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_geglu_gpu_strided(dtype):
    test_geglu((2, 1024, 5120), "strided", dtype, "none", "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("x_shape, n", SD_LINEAR)
def test_linear_geglu_gpu(x_shape, n, dtype, approximate):
    """Tolerance from stock: cuBLAS linear at the same dtype (fp32: no TF32), then geglu."""
    x, w, b = _linear_inputs(x_shape, n, dtype, "cuda")
    _check_linear_geglu(x, w, b, approximate)


DIT_GELU = [((2, 4096, 1152), 4608), ((2, 333, 1536), 6144), ((2, 77, 40), 72)]  # PixArt, SD3's context, odd


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["contiguous", "strided"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("x_shape, n", DIT_GELU)
def test_linear_gelu_gpu_epilogue(x_shape, n, dtype, kind, monkeypatch):
    """The tanh GELU projection through cuBLASLt's epilogue in half precision (the test counts that it
    ran; fp32 takes linear + gelu) against float64, stock (cuBLAS linear + F.gelu at the same dtype)
    the yardstick."""
    _epilogue_profile(monkeypatch, gelu_epilogue=True)
    calls = []
    addmm_act = torch._addmm_activation
    monkeypatch.setattr(torch, "_addmm_activation", lambda *a, **k: calls.append(1) or addmm_act(*a, **k))
    x, w, b = _gelu_linear_inputs(x_shape, n, dtype, "cuda")
    _check_linear_gelu(layout(x, kind), w, b, "tanh")
    assert calls == ([] if dtype == torch.float32 else [1])  # fp32: linear + gelu (the epilogue's error)
    _check_linear_gelu(x, w, b, "none")  # the erf GELU: linear + our gelu
    assert len(calls) == (dtype != torch.float32)


@pytest.mark.gpu
def test_linear_gelu_gpu_compiles_to_the_epilogue(monkeypatch):
    """Under torch.compile(fullgraph=True) the epilogue is one ATen call; the output matches eager's."""
    from sd_kernels.ops import custom_ops

    _epilogue_profile(monkeypatch, gelu_epilogue=True)
    torch._dynamo.reset()
    x, w, b = _gelu_linear_inputs((2, 4096, 1152), 4608, torch.float16, "cuda")
    compiled = torch.compile(lambda x: custom_ops.linear_gelu(x, w, b, "tanh"), fullgraph=True)
    torch.testing.assert_close(compiled(x), linear_gelu(x, w, b, "tanh"), rtol=0, atol=0)  # compiles
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        compiled(x)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.name.startswith("Memset")]  # cuBLASLt clears its workspace (measured)
    assert len(kernels) == 1, kernels  # the matmul with its epilogue, no separate GELU kernel


@pytest.mark.gpu
def test_linear_geglu_gpu_strided_no_bias():
    x, w, _ = _linear_inputs((2, 1024, 640), 2560, torch.float16, "cuda")
    _check_linear_geglu(non_contiguous(x), w, None)


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["gelu", "geglu", "linear_geglu"])
def test_offsets_past_2_31(op):
    """Inputs of more than 2^31 elements: int64 offsets (only the tail is compared, to save memory)."""
    big = 2**31 + 4096
    if op == "linear_geglu":
        k = 512
        x = torch.randn(big // k + 1, k, device="cuda", dtype=torch.float16)
        w = (torch.randn(32, k, device="cuda") / k**0.5).half()
        ours, tail = linear_geglu(x, w)[-300:], reference_linear_geglu(x[-300:].double(), w.double())
        stock = reference_linear_geglu(x[-300:], w)
    else:
        h = torch.randn(big // 2048, 2048, device="cuda", dtype=torch.float16)
        fn, ref = (gelu, reference.gelu) if op == "gelu" else (geglu, reference.geglu)
        ours, tail, stock = fn(h)[-3:], ref(h[-3:].double()), ref(h[-3:])
        del h
    assert rel_err(ours, tail) <= max(4 * rel_err(stock, tail), 2 * 2.0**-11)


@pytest.mark.gpu
def test_geglu_gpu_plans_and_direct_launches_with_misaligned_views(monkeypatch):
    """Cached plans and the launcher's direct path, on SD's smallest GEGLU shape and on views of it that
    start one element past a 16-byte boundary (same plan key, another specialization of the kernel)."""
    launch_mod = importlib.import_module("sd_kernels.runtime.launch")
    monkeypatch.setattr(launch_mod, "FAST_LAUNCH", True)
    monkeypatch.setattr(gelu_mod, "_GEGLU_PLANS", {})
    shape = (2, 256, 10240)
    hs = []
    for offset in (0, 1, 0, 1):
        buf = _input((2 * 256 * 10240 + offset,), torch.float16, "cuda")
        hs.append(buf[offset:].view(shape))
    assert hs[1].data_ptr() % 16 != 0
    for _ in range(3):
        for h in hs:
            _check_geglu(h)
    assert len(gelu_mod._GEGLU_PLANS) == 1
    assert gelu_mod._ELEMENTWISE.direct.table is not None and len(gelu_mod._ELEMENTWISE.direct.table) >= 2
