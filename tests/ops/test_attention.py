"""flash_attention and the path choice (``attention``) against float64 references.

CPU (interpreter): tiny shapes, fp32/fp16, head dims 8 and 40 (one and two head-dim blocks), 1-77
tokens. GPU: SD's shapes (head dims 40/80/160, 4096/1024/256 tokens, 77 for cross-attention),
fp16/bf16, every autotune config once. Stock = F.scaled_dot_product_attention at the same dtype.
"""

import importlib

import pytest
import torch
import torch.nn.functional as F

from sd_kernels import profiles, reference
from sd_kernels.ops import flash_attention
from sd_kernels.runtime import dispatch
from sd_kernels.testing import assert_close_to_reference, non_contiguous, rel_err

attn_mod = importlib.import_module("sd_kernels.ops.attention")


pytestmark = pytest.mark.usefixtures("poisoned_attention_outputs", "one_attention_config")


def qkv(b, h, sq, sk, d, dtype, device, layout="contiguous", dv=None, scale=1.0):
    """q [b, h, sq, d], k, v [b, h, sk, d]; "diffusers": views of [b, s, h, d] as diffusers makes them."""
    dv = dv or d

    def make(s, n):
        x = (scale * torch.randn(b, s, h, n, dtype=torch.float64, device=device)).to(dtype)
        return x.transpose(1, 2) if layout == "diffusers" else x.transpose(1, 2).contiguous()

    return make(sq, d), make(sk, d), make(sk, dv)


def check(q, k, v, mask=None, scale=None, fn=flash_attention, factor=4.0):
    ours = fn(q, k, v, mask, scale)
    ref64 = reference.attention(q.double(), k.double(), v.double(), mask, scale)
    stock = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return assert_close_to_reference(ours, stock, ref64, factor=factor), ours


def test_head_dim_blocks():
    table = {1: (16, 0), 8: (16, 0), 24: (32, 0), 40: (32, 16), 64: (64, 0), 72: (64, 16), 80: (64, 16),
             96: (64, 32), 128: (128, 0), 136: (128, 16), 160: (128, 32), 200: (256, 0), 256: (256, 0)}
    assert {d: attn_mod.head_dim_blocks(d) for d in table} == table
    for d in range(1, 257):
        lo, hi = attn_mod.head_dim_blocks(d)
        assert lo + hi >= d and lo >= 16 and (hi == 0 or hi >= 16)
    assert {d: attn_mod.flash_blocks(d) for d in (8, 40, 64, 80, 160)} == {
        8: ((16, 0), (16, 0)), 40: ((32, 16), (64, 0)), 64: ((64, 0), (64, 0)), 80: ((64, 16), (64, 16)),
        160: ((128, 32), (128, 32))}


@pytest.mark.parametrize("blocks", [((32, 16), (32, 16)), ((64, 0), (64, 0)), ((32, 16), (64, 0)),
                                    ((64, 0), (32, 16))], ids=str)
def test_head_dim_splits(blocks, device):
    """Q·Kᵀ and P·V may split the head dim differently; every split computes the same attention."""
    q, k, v = qkv(2, 2, 33, 40, 40, torch.float16, device, layout="diffusers")
    ref64 = reference.attention(q.double(), k.double(), v.double())
    stock = F.scaled_dot_product_attention(q, k, v)
    assert_close_to_reference(attn_mod._flash(q, k, v, None, 40**-0.5, blocks=blocks), stock, ref64)


CPU_SHAPES = [  # (B, H, Sq, Sk, D)
    (1, 2, 1, 5, 8),
    (2, 1, 5, 77, 40),
    (1, 2, 77, 77, 40),
    (1, 1, 77, 1, 8),
    (1, 2, 70, 33, 40),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", CPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_flash_attention(shape, dtype, device):
    check(*qkv(*shape, dtype, device))


@pytest.mark.parametrize("layout", ["diffusers", "strided", "broadcast"])
def test_layouts(layout, device):
    """diffusers' [B, S, H, D] views, a strided last dim, K/V broadcast over heads (stride 0): no copies,
    and the output in q's layout (diffusers' transpose + reshape after it is a view)."""
    q, k, v = qkv(2, 2, 9, 40, 40, torch.float16, device, layout="diffusers" if layout == "diffusers" else "")
    if layout == "strided":
        q, k, v = (non_contiguous(t) for t in (q, k, v))
    if layout == "broadcast":
        k, v = k[:, :1].expand_as(k), v[:, :1]
    _, out = check(q, k, v)
    if layout == "diffusers":
        assert out.transpose(1, 2).is_contiguous()


@pytest.mark.parametrize("dims", [(5, 40), (3, 7, 8), (1, 2, 3, 5, 8)], ids=str)
def test_batch_dims(dims, device):
    """2-D / 3-D inputs run the kernel; 3 batch dims take the reference (the kernel takes [B, H, S, D])."""
    *batch, s, d = dims
    q, k, v = (torch.randn(*batch, s, d, device=device) for _ in range(3))
    dispatch.reset_fallbacks()
    check(q, k, v)
    assert bool(dispatch.fallbacks()) == (len(batch) > 2)


MASKS = [  # (mask shape for q [2, 3, 5, 77], kind)
    ((1, 77), "bool"),
    ((5, 77), "float"),
    ((2, 1, 1, 77), "bool"),
    ((1, 3, 5, 77), "float"),
    ((2, 3, 5, 77), "bool"),
    ((6, 1, 77), "float"),  # diffusers' [B·heads, 1, Sk] viewed below as [B, heads, 1, Sk]
]


def make_mask(shape, kind, device, dtype=torch.float32):
    keep = torch.rand(shape, device=device) > 0.4
    keep[..., 0] = True  # no fully masked rows here (stock SDPA may give NaN for them)
    if kind == "bool":
        return keep
    bias = torch.randn(shape, device=device).masked_fill(~keep, -1e4)  # diffusers' "-inf" for masks
    return bias.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape, kind", MASKS, ids=lambda x: str(x))
def test_masks(shape, kind, dtype, device):
    q, k, v = qkv(2, 3, 5, 77, 40, dtype, device, layout="diffusers")
    mask = make_mask(shape, kind, device, dtype)
    if len(shape) == 3:
        mask = mask.view(2, 3, 1, 77)
    check(q, k, v, mask)


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_fully_masked_rows_are_zero(kind, device):
    """Rows with every key masked: zeros (the reference's nan → 0), whatever the block order. Row 1's
    first keys are masked and the rest not: the running max starts at -inf and must recover."""
    q, k, v = qkv(1, 2, 4, 77, 40, torch.float16, device)
    keep = torch.ones(4, 77, dtype=torch.bool, device=device)
    keep[0] = False
    keep[1, :50] = False
    keep[3, 1:] = False
    mask = keep if kind == "bool" else torch.zeros(4, 77, device=device).masked_fill(~keep, float("-inf"))
    out = flash_attention(q, k, v, mask)
    assert torch.equal(out[:, :, 0], torch.zeros_like(out[:, :, 0]))
    ref = reference.attention(q.double(), k.double(), v.double(), mask)
    assert torch.isfinite(out).all() and rel_err(out, ref) < 4 * 2**-11
    assert rel_err(out[:, :, 3], v[:, :, 0]) < 2**-11  # one key left: its value row, exactly


def test_large_logits_fp16(device):
    """q, k × 30: scores in the thousands. They stay in fp32 on chip: no overflow, no NaN."""
    q, k, v = qkv(1, 2, 77, 77, 40, torch.float16, device, scale=1.0)
    q, k = q * 30, k * 30
    out = flash_attention(q, k, v)
    ref = reference.attention(q.double(), k.double(), v.double())
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < 8 * 2**-11


@pytest.mark.parametrize("scale", [0.3, 0.0, -0.2])
def test_scale(scale, device):
    check(*qkv(1, 2, 5, 40, 8, torch.float32, device), scale=scale)


def test_empty(device):
    q, k, v = qkv(1, 2, 0, 5, 8, torch.float16, device)
    assert flash_attention(q, k, v).shape == (1, 2, 0, 8)
    q, k, v = qkv(1, 2, 3, 0, 8, torch.float16, device)
    assert torch.equal(flash_attention(q, k, v), torch.zeros(1, 2, 3, 8, dtype=torch.float16, device=device))


BAD = [  # (q shape, k shape, v shape, dtypes, mask, error match)
    ((1, 2, 5, 8), (1, 2, 7, 8), (1, 2, 7, 8), ("f16", "f32", "f16"), None, "same dtype"),
    ((1, 2, 5, 8), (1, 2, 7, 6), (1, 2, 7, 8), None, None, "head dims differ"),
    ((1, 2, 5, 8), (1, 2, 7, 8), (1, 2, 6, 8), None, None, "sequence lengths differ"),
    ((1, 2, 5, 8), (1, 3, 7, 8), (1, 3, 7, 8), None, None, "do not broadcast"),
    ((8,), (7, 8), (7, 8), None, None, "at least 2 dims"),
    ((1, 2, 5, 8), (1, 2, 7, 8), (1, 2, 7, 8), None, ("long", (5, 7)), "bool or float"),
    ((1, 2, 5, 8), (1, 2, 7, 8), (1, 2, 7, 8), None, ("bool", (4, 7)), "does not broadcast"),
]
_DT = {"f16": torch.float16, "f32": torch.float32, "long": torch.int64, "bool": torch.bool}


@pytest.mark.parametrize("fn", ["flash_attention", "attention"])
@pytest.mark.parametrize("qs, ks, vs, dtypes, mask, match", BAD)
def test_bad_input(qs, ks, vs, dtypes, mask, match, fn, device):
    dtypes = [_DT[d] for d in dtypes or ("f16",) * 3]
    q, k, v = (torch.ones(s, dtype=d, device=device) for s, d in zip((qs, ks, vs), dtypes))
    m = None if mask is None else torch.ones(mask[1], dtype=_DT[mask[0]], device=device)
    with pytest.raises(RuntimeError, match=match):
        getattr(attn_mod, fn)(q, k, v, m)


def test_head_dim_over_256(monkeypatch, device):
    """Flash takes D ≤ 256: beyond, it runs the reference, or raises when the kernel is forced."""
    q, k, v = qkv(1, 1, 3, 5, 260, torch.float32, device)
    check(q, k, v)
    monkeypatch.setenv("SD_KERNELS_BACKEND", "triton")
    with pytest.raises(dispatch.KernelUnavailable, match="head dim 260 > 256"):
        flash_attention(q, k, v)


# ---------------------------------------------------------------------------------------------
# The path choice


@pytest.fixture
def profile(monkeypatch):
    """Switch the active profile for one test: ``profile(disabled_ops)``."""

    def use(*disabled):
        p = profiles.Profile("test", "test profile", disabled_ops=frozenset(disabled))
        monkeypatch.setattr(profiles, "_active", p)

    return use


@pytest.mark.parametrize("d, disabled, backend, path", [
    (40, (), "auto", "flash"),
    (260, (), "auto", "partial_softmax"),
    (40, ("flash_attention",), "auto", "partial_softmax"),
    (40, ("flash_attention", "partial_softmax_attention"), "auto", "sdpa"),
    (40, (), "reference", "sdpa"),
])
def test_attention_path(d, disabled, backend, path, profile, monkeypatch, device):
    profile(*disabled)
    monkeypatch.setenv("SD_KERNELS_BACKEND", backend)
    q, k, v = qkv(1, 2, 5, 7, d, torch.float32, device)
    assert attn_mod.attention_path(q, k, v) == path
    check(q, k, v, fn=attn_mod.attention)


def test_attention_value_head_dim_differs(device):
    """v's head dim ≠ q's: flash cannot, the partial softmax can."""
    q, k, v = qkv(1, 2, 5, 7, 8, torch.float32, device, dv=24)
    assert attn_mod.attention_path(q, k, v) == "partial_softmax"
    check(q, k, v, fn=attn_mod.attention)


def test_attention_upcast(monkeypatch, device):
    """upcast=True (diffusers' upcast_attention): the partial softmax is asked for fp32 scores."""
    psm = importlib.import_module("sd_kernels.ops.softmax_matmul")
    seen, real = [], psm.partial_softmax_attention
    monkeypatch.setattr(psm, "partial_softmax_attention", lambda *a, **kw: seen.append(kw) or real(*a, **kw))
    monkeypatch.setattr(attn_mod, "FLASH_MAX_HEAD_DIM", 0)
    q, k, v = qkv(1, 2, 5, 7, 8, torch.float16, device)
    check(q, k, v, fn=lambda *a: attn_mod.attention(*a, upcast=True))
    check(q, k, v, fn=attn_mod.attention)
    assert [kw["scores_dtype"] for kw in seen] == [torch.float32, None]


# ---------------------------------------------------------------------------------------------
# Plans per call signature: a call like an earlier flash call skips the checks and the path choice


@pytest.fixture
def spied(monkeypatch, count_calls):
    """A fresh plan cache; counts of path choices (``decided``) and of flash launches (``launched``)."""
    monkeypatch.setattr(attn_mod, "_PLANS", {})
    return count_calls(attn_mod, decided="_choose_path", launched="_FLASH")


def test_plan_cache_skips_the_decision(spied, device):
    q, k, v = qkv(2, 3, 5, 7, 40, torch.float16, device, layout="diffusers")
    for _ in range(3):
        check(q, k, v, fn=attn_mod.attention)
    assert spied == {"decided": 1, "launched": 3} and len(attn_mod._PLANS) == 1
    q2, k2, v2 = qkv(2, 3, 5, 7, 40, torch.float16, device, layout="diffusers")  # other data, same signature
    check(q2, k2, v2, fn=attn_mod.attention)
    check(q2, k2, v2, scale=0.3, fn=attn_mod.attention)  # another scale: planned again
    for _ in range(2):  # flash_attention keeps its own plans (its checks differ from attention's)
        check(q, k, v, fn=flash_attention)
    assert spied == {"decided": 2, "launched": 7} and len(attn_mod._PLANS) == 3
    attn_mod.clear_plans()
    check(q, k, v, fn=attn_mod.attention)
    assert spied["decided"] == 3


def test_plan_cache_sees_profile_switches(spied, profile, device):
    q, k, v = qkv(1, 2, 5, 7, 8, torch.float32, device)
    profile()
    check(q, k, v, fn=attn_mod.attention)
    check(q, k, v, fn=attn_mod.attention)
    assert spied == {"decided": 1, "launched": 2}
    dispatch.reset_fallbacks()
    profile("flash_attention")  # a new active profile object: flash off, the fallback counted per call
    for _ in range(2):
        check(q, k, v, fn=attn_mod.attention)
    assert spied == {"decided": 3, "launched": 2}
    assert dispatch.fallbacks() == {("flash_attention", "profile 'test' disables flash_attention"): 2}
    profiles.set_profile(profiles.Profile("test", "test profile"))  # back on: flash, planned anew
    try:
        check(q, k, v, fn=attn_mod.attention)
        check(q, k, v, fn=attn_mod.attention)
    finally:
        profiles.set_profile(None)
    assert spied == {"decided": 4, "launched": 4}


def test_plan_cache_sees_the_backend(spied, monkeypatch, device):
    q, k, v = qkv(1, 2, 5, 7, 8, torch.float32, device)
    check(q, k, v, fn=attn_mod.attention)
    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    check(q, k, v, fn=attn_mod.attention)
    check(q, k, v, fn=flash_attention)
    assert spied == {"decided": 2, "launched": 1}
    monkeypatch.setenv("SD_KERNELS_BACKEND", "triton")
    check(q, k, v, fn=attn_mod.attention)
    monkeypatch.setenv("SD_KERNELS_BACKEND", "auto")
    check(q, k, v, fn=attn_mod.attention)
    assert spied == {"decided": 4, "launched": 3}
    monkeypatch.setenv("SD_KERNELS_BACKEND", "fast")  # invalid: raises as before, never a cached launch
    with pytest.raises(ValueError, match="SD_KERNELS_BACKEND"):
        attn_mod.attention(q, k, v)


def test_plan_cache_sees_masks(spied, device):
    q, k, v = qkv(2, 3, 5, 7, 8, torch.float16, device, layout="diffusers")
    masks = [None, make_mask((2, 3, 5, 7), "float", device, torch.float16), make_mask((2, 3, 5, 7), "bool", device),
             make_mask((5, 7), "float", device), make_mask((2, 1, 1, 7), "bool", device), None]
    masks.append(masks[1].transpose(-1, -2).contiguous().transpose(-1, -2))  # same shape, other strides
    for mask in masks + masks[1:]:
        check(q, k, v, mask, fn=attn_mod.attention)
    assert spied == {"decided": 6, "launched": 13}


def test_plan_cache_sees_grad_mode(spied, device):
    q, k, v = qkv(1, 2, 5, 7, 8, torch.float32, device)
    q.requires_grad_()
    out = attn_mod.attention(q, k, v)
    assert out.requires_grad and spied["launched"] == 0  # autograd: the stock path
    with torch.no_grad():
        check(q, k, v, fn=attn_mod.attention)
        check(q, k, v, fn=attn_mod.attention)
    assert spied == {"decided": 2, "launched": 2}
    out = attn_mod.attention(q, k, v)
    assert out.requires_grad and spied == {"decided": 3, "launched": 2}
    out.sum().backward()
    assert q.grad is not None


def test_plan_cache_sees_strides(spied, device):
    """Same shapes, other strides: each layout gets its own plan, and every output is right."""
    layouts = []
    for layout in ("contiguous", "diffusers"):
        layouts.append(qkv(2, 3, 5, 7, 40, torch.float16, device, layout=layout))
    q, k, v = layouts[0]
    layouts.append((q, non_contiguous(k), v))
    layouts.append((q, k.expand(2, 3, 7, 40)[:, :, :, :], v[:1].expand(2, 3, 7, 40)))  # stride-0 batch
    for q, k, v in layouts * 2:
        _, ours = check(q, k, v, fn=attn_mod.attention)
        assert ours.shape == q.shape
    assert spied == {"decided": 4, "launched": 8}
    q3, k3, v3 = (t[0] for t in layouts[1])  # three dims: the output comes back [H, S, D]
    for _ in range(2):
        _, ours = check(q3, k3, v3, fn=attn_mod.attention)
        assert ours.shape == q3.shape
    assert spied == {"decided": 5, "launched": 10}


def test_plan_cache_fp32_follows_tf32(spied, device):
    q, k, v = qkv(1, 2, 5, 7, 8, torch.float32, device)
    matmul, before = torch.backends.cuda.matmul, torch.backends.cuda.matmul.allow_tf32
    matmul.allow_tf32 = False
    try:
        check(q, k, v, fn=attn_mod.attention)
        matmul.allow_tf32 = True
        attn_mod.attention(q, k, v)
    finally:
        matmul.allow_tf32 = before
    assert sorted(p.meta["PRECISION"] for p in attn_mod._PLANS.values()) == ["ieee", "tf32"]


def test_plan_cache_is_bounded(spied, monkeypatch, device):
    monkeypatch.setattr(attn_mod, "MAX_PLANS", 2)
    for sq in (3, 4, 5, 6, 3):
        check(*qkv(1, 2, sq, 7, 8, torch.float32, device), fn=attn_mod.attention)
        assert len(attn_mod._PLANS) <= 2
    assert spied == {"decided": 5, "launched": 5}


def test_plan_cache_does_not_keep_tensor_scales(spied, device):
    q, k, v = qkv(1, 2, 5, 7, 8, torch.float32, device)
    scale = torch.tensor(0.5)
    check(q, k, v, scale=scale, fn=attn_mod.attention)
    scale.fill_(0.25)  # the same object, another value
    check(q, k, v, scale=scale, fn=attn_mod.attention)
    assert spied == {"decided": 2, "launched": 2} and not attn_mod._PLANS


# ---------------------------------------------------------------------------------------------
# GPU: SD's shapes, fp16 / bf16

GPU_CASES = [  # (B, H, Sq, Sk, D, dtype, layout)
    (2, 8, 4096, 4096, 40, torch.float16, "diffusers"),
    (2, 8, 4096, 77, 40, torch.bfloat16, "diffusers"),
    (2, 8, 1024, 1024, 80, torch.bfloat16, "diffusers"),
    (2, 8, 1024, 77, 80, torch.float16, "contiguous"),
    (2, 8, 256, 256, 160, torch.float16, "diffusers"),
    (2, 8, 256, 77, 160, torch.bfloat16, "diffusers"),
    (1, 4, 1031, 1031, 64, torch.float16, "contiguous"),
    (2, 3, 100, 1031, 128, torch.bfloat16, "diffusers"),
    (1, 2, 1, 4096, 40, torch.float16, "contiguous"),
    (2, 2, 4096, 1, 80, torch.float16, "diffusers"),
    (1, 2, 77, 100, 8, torch.float16, "contiguous"),
    (1, 2, 333, 257, 256, torch.bfloat16, "contiguous"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "x".join(map(str, c[:5])) + f"-{c[5]}-{c[6]}")
def test_gpu_sd_shapes(case, device):
    b, h, sq, sk, d, dtype, layout = case
    check(*qkv(b, h, sq, sk, d, dtype, device, layout=layout))


GPU_MASKS = [  # (mask shape for q [2, 8, 1024, Sk], kind, Sk)
    ((16, 1, 77), "float", 77),  # diffusers' prepared cross-attention mask
    ((2, 1, 1, 1024), "bool", 1024),
    ((1024, 1024), "float", 1024),
    ((2, 8, 1024, 77), "bool", 77),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape, kind, sk", GPU_MASKS, ids=str)
def test_gpu_masks(shape, kind, sk, dtype, device):
    q, k, v = qkv(2, 8, 1024, sk, 40, dtype, device, layout="diffusers")
    mask = make_mask(shape, kind, device, dtype)
    check(q, k, v, mask.view(2, 8, 1, sk) if len(shape) == 3 else mask)


@pytest.mark.gpu
@pytest.mark.parametrize("sk", [64, 77, 333])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("d", [40, 80, 160])
def test_gpu_every_config(d, masked, sk, device):
    """Each config the autotuner may pick, on key lengths shorter than, not a multiple of, and a
    multiple of some BLOCK_N (partial query blocks everywhere)."""
    dtype = torch.float16
    q, k, v = qkv(2, 3, 300, sk, d, dtype, device, layout="diffusers")
    mask = make_mask((2, 1, 300, sk), "float", device, dtype) if masked else None
    ref64 = reference.attention(q.double(), k.double(), v.double(), mask)
    stock = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    views = attn_mod._views(q, k, v, mask, (2, 3))
    for config in attn_mod.flash_configs(dtype, d, masked):
        ours = attn_mod._flash(*views, d**-0.5, config=config)
        report = assert_close_to_reference(ours, stock, ref64)
        assert report.ok, f"{config}: {report}"


@pytest.mark.gpu
def test_gpu_large_logits_and_fully_masked(device):
    q, k, v = qkv(2, 8, 1024, 1024, 80, torch.float16, device, layout="diffusers")
    q, k = q * 30, k * 30
    keep = torch.rand(2, 1, 1024, 1024, device=device) > 0.5
    keep[:, :, :7] = False
    out = flash_attention(q, k, v, keep)
    ref = reference.attention(q.double(), k.double(), v.double(), keep)
    assert torch.isfinite(out).all() and rel_err(out, ref) < 8 * 2**-11
    assert (out[:, :, :7] == 0).all()


@pytest.mark.gpu
def test_gpu_fp32(device):
    check(*qkv(2, 3, 200, 77, 40, torch.float32, device, layout="diffusers"))


@pytest.mark.gpu
def test_gpu_plans_and_direct_launches_with_misaligned_views(monkeypatch, device):
    """Cached plans and the launcher's direct path on SD's cross-attention shapes, with views whose data
    starts one element past a 16-byte boundary (same plan key, another specialization of the kernel)."""
    launch_mod = importlib.import_module("sd_kernels.runtime.launch")
    monkeypatch.setattr(launch_mod, "FAST_LAUNCH", True)
    monkeypatch.setattr(attn_mod, "_PLANS", {})
    b, h, sq, sk, d = 2, 8, 64, 77, 160

    def view(s, offset):
        buf = torch.randn(b * s * h * d + offset, device=device, dtype=torch.float16)
        return buf[offset:].view(b, s, h, d).transpose(1, 2)

    cases = [(view(sq, o), view(sk, o), view(sk, o)) for o in (0, 1, 0, 1)]
    assert cases[1][0].data_ptr() % 16 != 0
    for _ in range(3):
        for q, k, v in cases:
            check(q, k, v, fn=attn_mod.attention)
            check(q, k, v, fn=flash_attention)
    # Misaligned calls run on realigned copies and are not planned: one plan per entry point.
    assert len(attn_mod._PLANS) == 2
    assert attn_mod._FLASH.direct.table is not None and len(attn_mod._FLASH.direct.table) >= 1


def test_misaligned_inputs_run_on_aligned_copies(monkeypatch, device):
    """Views starting off a 16-byte boundary are copied before the kernel (Triton 3.6 miscompiled
    flash for such pointers on the H100); the copies are not planned, aligned calls still are."""
    monkeypatch.setattr(attn_mod, "_PLANS", {})
    copies = []
    real = attn_mod.realigned
    monkeypatch.setattr(attn_mod, "realigned", lambda t: copies.append(t) or real(t))
    b, h, s, d = 1, 2, 24, 40

    def view(offset):
        buf = torch.randn(b * s * h * d + offset, device=device, dtype=torch.float16)
        return buf[offset:].view(b, s, h, d).transpose(1, 2)

    q, k, v = view(1), view(1), view(0)
    assert q.data_ptr() % 16 and v.data_ptr() % 16 == 0
    check(q, k, v, fn=attn_mod.attention)
    assert copies and not attn_mod._PLANS
    copies.clear()
    check(view(0), view(0), view(0), fn=attn_mod.attention)
    assert not copies and len(attn_mod._PLANS) == 1


def _masked_heuristic(monkeypatch):
    """The flash kernel's EVEN_N heuristic replaced by the value its launcher may relax it to (False:
    every key block masked), as a new size takes it where only that kernel is compiled."""
    (heuristics,) = [layer for layer in attn_mod._FLASH.layers if hasattr(layer, "values")]
    monkeypatch.setitem(heuristics.values, "EVEN_N", lambda args: False)
    monkeypatch.setattr(attn_mod, "_PLANS", {})
    monkeypatch.setattr(attn_mod._FLASH, "memo", {})
    relax = attn_mod._FLASH.relax
    assert relax({"Sk": attn_mod.RELAX_MAX_KEYS}) == {"EVEN_N": False}
    assert relax({"Sk": attn_mod.RELAX_MAX_KEYS + 1}) == {}


@pytest.mark.parametrize("sk", [32, 64])
def test_the_masked_path_is_exact_at_key_counts_a_block_divides(sk, monkeypatch, device):
    _masked_heuristic(monkeypatch)
    check(*qkv(1, 2, 40, sk, 40, torch.float16, device))
    assert all(meta["EVEN_N"] is False for meta in attn_mod._FLASH.memo.values())


@pytest.mark.gpu
@pytest.mark.parametrize("d, sk", [(160, 64), (160, 256), (64, 256), (40, 4096), (80, 1024)])
def test_gpu_the_masked_path_is_exact_at_key_counts_a_block_divides(d, sk, monkeypatch, device):
    """Every config at SD1.5's even self-attention lengths, EVEN_N relaxed to False."""
    _masked_heuristic(monkeypatch)
    q, k, v = qkv(2, 8, sk, sk, d, torch.float16, device, layout="diffusers")
    ref64 = reference.attention(q.double(), k.double(), v.double())
    stock = F.scaled_dot_product_attention(q, k, v)
    views = attn_mod._views(q, k, v, None, (2, 8))
    for config in attn_mod.flash_configs(torch.float16, d, False, sk, sk):
        report = assert_close_to_reference(attn_mod._flash(*views, d**-0.5, config=config), stock, ref64)
        assert report.ok, f"{config}: {report}"
