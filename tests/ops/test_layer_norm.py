"""layer_norm_modulated, gated_residual_layer_norm and T5's rms_norm against float64, with stock PyTorch's
error as the yardstick (the reference run in the inputs' dtype: F.layer_norm, then the modulation ops;
T5LayerNorm's own lines for rms_norm).

CPU: tiny shapes through the Triton interpreter (odd D, 77 and 5 tokens, batch 1 and 2, modulation
as [B, D], [B, 1, D], chunks of a wider tensor, a broadcast batch, or absent; strided inputs). The
interpreter rounds fp32 → bf16 by truncation (the GPU rounds to nearest), which the 4× stock
tolerance absorbs. GPU (-m gpu): PixArt-Σ at 1024² (D = 1152) and SD3-medium (D = 1536) shapes.
"""

import importlib

import pytest
import torch
import torch.nn.functional as F

from sd_kernels import reference
from sd_kernels.ops import gated_residual_layer_norm, layer_norm_modulated
from sd_kernels.ops.layer_norm import rms_norm
from sd_kernels.runtime import dispatch
from sd_kernels.testing import assert_close_to_reference, non_contiguous, poison_, rel_err

ln = importlib.import_module("sd_kernels.ops.layer_norm")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(2, 77, 40), (1, 5, 72), (2, 5, 96), (1, 3, 1152)]  # [B, T, D]: D not a power of two but 96's pad


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    """Every output starts as NaN, so an element the kernel does not write fails the comparison."""
    alloc = ln._alloc
    monkeypatch.setattr(ln, "_alloc", lambda like, dtype=None: poison_(alloc(like, dtype)))


def _randn(*shape, dtype, device, mean=0.0, std=1.0):
    return (mean + std * torch.randn(shape, dtype=torch.float64, device=device)).to(dtype)


def _modulation(form: str | None, b: int, d: int, dtype, device, std=0.5):
    """A per-sample modulation tensor in one of the forms the blocks hand over; None for None."""
    if form is None:
        return None
    if form == "[B,D]":
        return _randn(b, d, dtype=dtype, device=device, std=std)
    if form == "[B,1,D]":
        return _randn(b, 1, d, dtype=dtype, device=device, std=std)
    if form == "sd3_chunk":  # SD3's AdaLayerNormZero: emb [B, 6·D].chunk(6, dim=1) → [B, D], row stride 6·D
        return _randn(b, 6 * d, dtype=dtype, device=device, std=std).chunk(6, dim=1)[2]
    if form == "pixart_chunk":  # PixArt: ([B, 6, D] table + t).chunk(6, dim=1) → [B, 1, D], row stride 6·D
        return _randn(b, 6, d, dtype=dtype, device=device, std=std).chunk(6, dim=1)[4]
    if form == "broadcast":  # one sample's vector for the whole batch
        return _randn(1, d, dtype=dtype, device=device, std=std)
    raise ValueError(form)


def _affine(affine: str, d: int, dtype, device):
    w = _randn(d, dtype=dtype, device=device, mean=1.0, std=0.5) if "weight" in affine else None
    b = _randn(d, dtype=dtype, device=device, std=0.5) if "bias" in affine else None
    return w, b


def _check_modulated(x, w, b, eps, scale, shift):
    ours = layer_norm_modulated(x, w, b, eps, scale, shift)
    stock = reference.layer_norm_modulated(x, w, b, eps, scale, shift)
    ref64 = reference.layer_norm_modulated(*reference.upcast(x, w, b), eps, *reference.upcast(scale, shift))
    assert_close_to_reference(ours, stock, ref64)
    assert ours.is_contiguous()
    return ours


def _check_gated(residual, branch, gate, w, b, eps, scale, shift):
    h, normed = gated_residual_layer_norm(residual, branch, gate, w, b, eps, scale, shift)
    stock_h, stock = reference.gated_residual_layer_norm(residual, branch, gate, w, b, eps, scale, shift)
    h64, ref64 = reference.gated_residual_layer_norm(*reference.upcast(residual, branch, gate, w, b), eps,
                                                     *reference.upcast(scale, shift))
    assert_close_to_reference(h, stock_h, h64)
    assert_close_to_reference(normed, stock, ref64)
    assert h.is_contiguous() and normed.is_contiguous()
    # normed is the modulated norm of the h it returns (the rounded residual stream), up to rounding
    again = reference.layer_norm_modulated(*reference.upcast(h, w, b), eps, *reference.upcast(scale, shift))
    assert rel_err(normed, again) <= 4 * rel_err(stock, ref64) + 2 * 2.0**-24
    return h, normed


MODULATIONS = [  # (scale form, shift form)
    ("[B,D]", "[B,D]"),
    ("[B,1,D]", "[B,1,D]"),
    ("[B,D]", None),
    (None, "[B,1,D]"),
    (None, None),
]


@pytest.mark.parametrize("scale_form, shift_form", MODULATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_layer_norm_modulated(shape, dtype, scale_form, shift_form, device):
    bsz, t, d = shape
    x = _randn(*shape, dtype=dtype, device=device, std=2.0)
    scale = _modulation(scale_form, bsz, d, dtype, device)
    shift = _modulation(shift_form, bsz, d, dtype, device)
    _check_modulated(x, None, None, 1e-6, scale, shift)


@pytest.mark.parametrize("gate_form", ["[B,D]", "[B,1,D]", None])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_gated_residual_layer_norm(shape, dtype, gate_form, device):
    bsz, t, d = shape
    residual = _randn(*shape, dtype=dtype, device=device, std=2.0)
    branch = _randn(*shape, dtype=dtype, device=device)
    gate = _modulation(gate_form, bsz, d, dtype, device)
    scale, shift = (_modulation(f, bsz, d, dtype, device) for f in ("[B,D]", "[B,1,D]"))
    _check_gated(residual, branch, gate, None, None, 1e-6, scale, shift)


@pytest.mark.parametrize("affine", ["weight+bias", "weight", "bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_elementwise_affine(affine, dtype, device):
    """LayerNorm's own weight and bias (diffusers' blocks with elementwise_affine=True), then the modulation."""
    bsz, t, d = 2, 5, 72
    w, b = _affine(affine, d, dtype, device)
    x = _randn(bsz, t, d, dtype=dtype, device=device)
    scale, shift = (_modulation("[B,D]", bsz, d, dtype, device) for _ in range(2))
    _check_modulated(x, w, b, 1e-5, scale, shift)
    _check_gated(x, _randn(bsz, t, d, dtype=dtype, device=device), scale, w, b, 1e-5, scale, shift)


def _layout(x: torch.Tensor, kind: str) -> torch.Tensor:
    """The same values as x [B, T, D] in another layout."""
    if kind == "contiguous":
        return x
    if kind == "token_slice":  # tokens 1..T of a [B, T + 2, D] tensor: batch stride (T + 2)·D
        wide = torch.zeros(x.shape[0], x.shape[1] + 2, x.shape[2], dtype=x.dtype, device=x.device)
        wide[:, 1:-1] = x
        return wide[:, 1:-1]
    if kind == "strided_last":  # every other element of a doubled last dim
        return non_contiguous(x)
    if kind == "token_major":  # [T, B, D] storage seen as [B, T, D]
        return x.transpose(0, 1).contiguous().transpose(0, 1)
    raise ValueError(kind)


LAYOUTS = ["token_slice", "strided_last", "token_major"]
CHUNK_FORMS = ["sd3_chunk", "pixart_chunk", "broadcast"]


@pytest.mark.parametrize("form", CHUNK_FORMS)
@pytest.mark.parametrize("kind", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_strided_inputs_and_modulation_views(kind, form, dtype, device):
    """Non-contiguous x, residual and branch; modulation as the models slice it, or broadcast."""
    bsz, t, d = 2, 7, 40
    x = _layout(_randn(bsz, t, d, dtype=dtype, device=device, std=2.0), kind)
    scale, shift, gate = (_modulation(form, bsz, d, dtype, device) for _ in range(3))
    _check_modulated(x, None, None, 1e-6, scale, shift)
    branch = _layout(_randn(bsz, t, d, dtype=dtype, device=device), LAYOUTS[(LAYOUTS.index(kind) + 1) % 3])
    _check_gated(x, branch, gate, None, None, 1e-6, scale, shift)


@pytest.mark.parametrize("dtype, mean", [(torch.float32, 1000.0), (torch.float16, 1000.0), (torch.bfloat16, 100.0)])
def test_large_mean(dtype, mean, device):
    """x = mean + noise: a variance taken as E[x²] − E[x]² in fp32 would lose most of its digits."""
    bsz, t, d = 2, 5, 96
    x = _randn(bsz, t, d, dtype=dtype, device=device, mean=mean)
    scale, shift = (_modulation("[B,D]", bsz, d, dtype, device) for _ in range(2))
    ours = _check_modulated(x, None, None, 1e-6, scale, shift)
    _check_gated(x, _randn(bsz, t, d, dtype=dtype, device=device), None, None, None, 1e-6, scale, shift)
    if dtype == torch.float32:  # in absolute terms: within a few fp32 roundings of |mean|/σ
        ref64 = reference.layer_norm_modulated(*reference.upcast(x), None, None, 1e-6, *reference.upcast(scale, shift))
        assert rel_err(ours, ref64) < 16 * 2.0**-24 * mean


def test_constant_rows_give_the_modulated_bias(device):
    """Variance 0: the normalized row is 0 (through eps), never NaN; y = b·(1 + scale) + shift."""
    bsz, t, d = 2, 3, 40
    x = torch.full((bsz, t, d), 7.0, device=device)
    w, b = _affine("weight+bias", d, torch.float32, device)
    scale, shift = (_modulation("[B,D]", bsz, d, torch.float32, device) for _ in range(2))
    want = (b * (1 + scale) + shift)[:, None, :].expand(bsz, t, d)
    torch.testing.assert_close(layer_norm_modulated(x, w, b, 1e-6, scale, shift), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("shape", [(2, 1, 40), (1, 3, 1), (1, 1, 1)])
def test_sizes_of_one(shape, device):
    """One token, one feature (the GPU specializes integer arguments equal to 1)."""
    bsz, t, d = shape
    x = _randn(*shape, dtype=torch.float16, device=device)
    w, b = _affine("weight+bias", d, torch.float16, device)
    scale, shift, gate = (_modulation("[B,D]", bsz, d, torch.float16, device) for _ in range(3))
    _check_modulated(x, w, b, 1e-6, scale, shift)
    _check_gated(x, _randn(*shape, dtype=torch.float16, device=device), gate, w, b, 1e-6, scale, shift)


@pytest.mark.parametrize("shape", [(0, 5, 8), (2, 0, 8), (2, 3, 0)])
def test_empty(shape, device):
    x = torch.randn(shape, device=device)
    scale = torch.randn(shape[0], shape[2], device=device)
    assert layer_norm_modulated(x, scale=scale, shift=scale).shape == shape
    h, y = gated_residual_layer_norm(x, x, scale, scale=scale)
    assert h.shape == y.shape == shape


def test_blocks():
    """A whole row per program, padded to a power of two; small rows batched up to _ELEMS elements; rows up to
    1,280 wide a warp per 2,048 of them, at least 1; wider rows a warp per 1,024, at least 4."""
    assert ln.blocks(8192, 640) == (2, 1024, 1)  # SDXL's 64² level
    assert ln.blocks(2048, 1280) == (1, 2048, 1)  # SDXL's 32² level
    assert ln.blocks(8192, 1152) == (1, 2048, 1)  # PixArt-Σ
    assert ln.blocks(8192, 1536) == (1, 2048, 4)  # SD3-medium
    assert ln.blocks(4608, 3072) == (1, 4096, 4)  # FLUX
    assert ln.blocks(8192, 8192) == (1, 8192, 8)
    assert ln.blocks(8192, 40) == (32, 64, 1)
    assert ln.blocks(3, 40) == (4, 64, 1)
    assert ln.blocks(8192, 40, ln._INTERPRETED_ELEMS) == (64, 64, 2)  # the interpreter: fewer, larger programs


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda d: layer_norm_modulated(torch.randn(4, 8, device=d)), ValueError,
         r"layer_norm_modulated needs a 3-D input \[B, T, D\], got shape \[4, 8\]"),
        (lambda d: layer_norm_modulated(torch.randn(1, 2, 4, 8, device=d)), ValueError, "needs a 3-D input"),
        (lambda d: layer_norm_modulated(torch.randn(2, 3, 8, device=d), scale=torch.randn(2, 7, device=d)),
         ValueError, r"scale must have shape \[B, D\] or \[B, 1, D\] with B = 2 \(or 1\) and D = 8, got \[2, 7\]"),
        (lambda d: layer_norm_modulated(torch.randn(2, 3, 8, device=d), shift=torch.randn(3, 8, device=d)),
         ValueError, r"shift must have shape .* got \[3, 8\]"),
        (lambda d: layer_norm_modulated(torch.randn(2, 3, 8, device=d), shift=torch.randn(2, 3, 8, device=d)),
         ValueError, r"shift must have shape .* got \[2, 3, 8\]"),
        (lambda d: layer_norm_modulated(torch.randn(2, 3, 8, device=d), scale=torch.randn(8, device=d)),
         ValueError, r"scale must have shape .* got \[8\]"),
        (lambda d: gated_residual_layer_norm(torch.randn(2, 3, 8, device=d), torch.randn(2, 3, 8, device=d),
                                             torch.randn(2, 1, 9, device=d)),
         ValueError, r"gated_residual_layer_norm: gate must have shape .* got \[2, 1, 9\]"),
        (lambda d: gated_residual_layer_norm(torch.randn(2, 3, 8, device=d), torch.randn(2, 1, 8, device=d)),
         ValueError, r"branch must have the residual's shape \[2, 3, 8\], got \[2, 1, 8\]"),
    ],
)
def test_bad_input(call, error, match, device):
    with pytest.raises(error, match=match):
        call(device)


@pytest.mark.parametrize("weight, bias", [((7,), None), (None, (8, 1))])
def test_bad_affine_raises_like_torch(weight, bias, device):
    x = torch.randn(2, 3, 8, device=device)
    w = None if weight is None else torch.randn(weight, device=device)
    b = None if bias is None else torch.randn(bias, device=device)
    with pytest.raises(RuntimeError) as stock:
        F.layer_norm(x, (8,), w, b)
    for op in (lambda: layer_norm_modulated(x, w, b), lambda: gated_residual_layer_norm(x, x, None, w, b)):
        with pytest.raises(RuntimeError) as ours:
            op()
        assert str(ours.value) == str(stock.value)


def test_off_ground_inputs_take_the_reference(monkeypatch, device):
    """float64, autograd, mixed dtypes and rows wider than the tile run the reference, logged once each."""
    dispatch.reset_fallbacks()
    x64 = torch.randn(2, 3, 8, dtype=torch.float64, device=device)
    assert torch.equal(layer_norm_modulated(x64, scale=x64[:, 0]), reference.layer_norm_modulated(x64, scale=x64[:, 0]))
    xg = torch.randn(2, 3, 8, device=device, requires_grad=True)
    h, y = gated_residual_layer_norm(xg, xg, xg[:, 0])
    (h.sum() + y.square().sum()).backward()
    assert xg.grad is not None and torch.isfinite(xg.grad).all()
    x = torch.randn(2, 3, 8, device=device)
    torch.testing.assert_close(layer_norm_modulated(x, scale=x[:, 0].half()),
                               reference.layer_norm_modulated(x, scale=x[:, 0].half()))
    monkeypatch.setattr(ln, "_MAX_D", 4)
    torch.testing.assert_close(layer_norm_modulated(x), reference.layer_norm_modulated(x))
    reasons = {reason for op, reason in dispatch.fallbacks() if op == "layer_norm"}
    assert any("float64" in r for r in reasons) and any("requires grad" in r for r in reasons)
    assert any("several dtypes" in r for r in reasons) and any("D = 8 is wider" in r for r in reasons)


# ---------------------------------------------------------------------------------------------
# GPU: PixArt-Σ at 1024² (latent 128², patch 2: 4096 tokens, D = 1152) and SD3-medium at 1024²
# (4096 image tokens and 154 context tokens, each stream with its own norm, D = 1536); batch 2 for
# classifier-free guidance. Modulation as the models slice it.

GPU_CASES = [((2, 4096, 1152), "pixart_chunk"), ((2, 4096, 1536), "sd3_chunk"), ((2, 154, 1536), "sd3_chunk"),
             ((1, 1024, 4096), "[B,D]")]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, form", GPU_CASES)
def test_gpu_model_shapes(shape, form, dtype):
    bsz, t, d = shape
    x = _randn(*shape, dtype=dtype, device="cuda", std=2.0)
    branch = _randn(*shape, dtype=dtype, device="cuda")
    scale, shift, gate = (_modulation(form, bsz, d, dtype, "cuda") for _ in range(3))
    _check_modulated(x, None, None, 1e-6, scale, shift)
    _check_gated(x, branch, gate, None, None, 1e-6, scale, shift)
    _check_gated(x, branch, None, None, None, 1e-6, scale, shift)  # PixArt's cross-attention residual


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_large_mean_and_strided(dtype):
    bsz, t, d = 2, 4096, 1152
    x = _layout(_randn(bsz, t, d, dtype=dtype, device="cuda", mean=100.0), "token_slice")
    scale, shift = (_modulation("pixart_chunk", bsz, d, dtype, "cuda") for _ in range(2))
    _check_modulated(x, None, None, 1e-6, scale, shift)
    _check_gated(x, non_contiguous(_randn(bsz, t, d, dtype=dtype, device="cuda")), scale, None, None, 1e-6,
                 scale, shift)


@pytest.mark.gpu
def test_gpu_one_launch(monkeypatch):
    from torch.profiler import ProfilerActivity, profile

    monkeypatch.setattr(ln, "_alloc", lambda like, dtype=None: torch.empty(like.shape, dtype=dtype or like.dtype,
                                                                           device=like.device))
    bsz, t, d = 2, 4096, 1536
    x, branch = (_randn(bsz, t, d, dtype=torch.float16, device="cuda") for _ in range(2))
    scale, shift, gate = (_modulation("sd3_chunk", bsz, d, torch.float16, "cuda") for _ in range(3))
    call = lambda: gated_residual_layer_norm(x, branch, gate, None, None, 1e-6, scale, shift)
    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    assert sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA) == 1


@pytest.mark.gpu
def test_gpu_offsets_past_2_31():
    """More than 2³¹ elements: int64 row offsets (only the last rows are compared, to save memory)."""
    d = 1152
    rows = 2**31 // d + 64
    x = _randn(1, rows, d, dtype=torch.float16, device="cuda")
    scale = _modulation("[B,D]", 1, d, torch.float16, "cuda")
    tail = x[:, -64:]
    ours = layer_norm_modulated(x, None, None, 1e-6, scale, scale)[:, -64:]
    del x
    stock = reference.layer_norm_modulated(tail, None, None, 1e-6, scale, scale)
    ref64 = reference.layer_norm_modulated(tail.double(), None, None, 1e-6, scale.double(), scale.double())
    assert_close_to_reference(ours, stock, ref64)


def _rms_reference64(x, w, eps):
    x64 = x.double()
    y = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w.double()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm(shape, dtype, device):
    """T5's LayerNorm (no mean, no bias) with its weight, and without one."""
    x = _randn(*shape, dtype=dtype, device=device, mean=0.5, std=2.0)
    w = _randn(shape[-1], dtype=dtype, device=device, mean=1.0, std=0.5)
    for weight in (w, None):
        ours = rms_norm(x, weight, 1e-6)
        assert_close_to_reference(ours, reference.rms_norm(x, weight, 1e-6), _rms_reference64(x, weight, 1e-6))
        assert ours.is_contiguous()


@pytest.mark.parametrize("x_dtype, w_dtype", [(torch.float32, torch.float16), (torch.float32, torch.bfloat16),
                                              (torch.bfloat16, torch.float32)])
def test_rms_norm_mixed_dtypes(x_dtype, w_dtype, device):
    """A real T5 checkpoint in fp16 keeps ``wo`` in fp32, so its residual stream is fp32 under fp16 weights:
    the output takes stock's dtype (a half weight's, else fp32)."""
    x = _randn(2, 5, 72, dtype=x_dtype, device=device, std=3.0)
    w = _randn(72, dtype=w_dtype, device=device, mean=1.0, std=0.5)
    ours = rms_norm(x, w, 1e-6)
    stock = reference.rms_norm(x, w, 1e-6)
    assert ours.dtype == stock.dtype == reference.rms_norm_dtype(x, w)
    assert_close_to_reference(ours, stock, _rms_reference64(x, w, 1e-6))


@pytest.mark.parametrize("kind", ["non_contiguous", "transposed"])
def test_rms_norm_strided(kind, device):
    x = _randn(2, 7, 40, dtype=torch.float16, device=device)
    xs = non_contiguous(x) if kind == "non_contiguous" else x.transpose(0, 1).contiguous().transpose(0, 1)
    w = _randn(40, dtype=torch.float16, device=device, mean=1.0)
    torch.testing.assert_close(rms_norm(xs, w), rms_norm(x.contiguous(), w), rtol=0, atol=0)


def test_rms_norm_refuses_bad_shapes():
    with pytest.raises(ValueError, match="3-D"):
        rms_norm(torch.randn(4, 8), None)
    with pytest.raises(RuntimeError, match="normalized_shape"):
        rms_norm(torch.randn(1, 2, 8), torch.ones(7))
