"""The Hopper wgmma attention kernel: when it is chosen and when not (CPU), and its results (sm_90 GPU).

The kernel is Gluon, which the Triton interpreter cannot run, and it is tied to Triton 3.6: the
numerical tests need an H100-class GPU with that Triton and say so when they skip.
"""

import importlib
import os
import re

import pytest
import torch
import torch.nn.functional as F
import triton

from sd_kernels import profiles, reference
from sd_kernels.ops import attention_wgmma as wg
from sd_kernels.ops.custom_ops import attention_layout
from sd_kernels.runtime import dispatch
from sd_kernels.testing import assert_close_to_reference

attn_mod = importlib.import_module("sd_kernels.ops.attention")


def qkv(b, h, sq, sk, d, dtype, device="cpu", layout="diffusers"):
    def make(s):
        x = torch.randn(b, s, h, d, dtype=torch.float64, device=device).to(dtype)
        return x.transpose(1, 2) if layout == "diffusers" else x.transpose(1, 2).contiguous()

    return make(sq), make(sk), make(sk)


# ---------------------------------------------------------------------------------------------
# CPU: the choice


@pytest.mark.parametrize("change, match", [
    (lambda q, k, v: (q, k, v, torch.ones(1, 1, 8, 8, dtype=torch.bool)), "attention mask"),
    (lambda q, k, v: (q[0], k[0], v[0], None), r"not \[B, H, S, D\]"),
    (lambda q, k, v: (q.float(), k.float(), v.float(), None), "fp16 or bf16"),
    (lambda q, k, v: (q, k.bfloat16(), v, None), "fp16 or bf16"),
    (lambda q, k, v: (q, k[:, :1], v[:, :1], None), "no broadcasting"),
    (lambda q, k, v: (q[..., :36], k[..., :36], v[..., :36], None), "head dim 36"),
    (lambda q, k, v: (q.transpose(-1, -2).contiguous().transpose(-1, -2), k, v, None), "not contiguous"),
    (lambda q, k, v: (q, k[:, :, :0], v[:, :, :0], None), "empty"),
    (lambda q, k, v: (q[:, :, :0], k, v, None), "empty"),
    (lambda q, k, v: (q, k[:1, :, :1].expand_as(k), v, None), "broadcast"),
    (lambda q, k, v: (q, k, v, None), "CUDA"),
])
def test_reason_names_what_the_kernel_cannot_take(change, match):
    q, k, v, mask = change(*qkv(1, 2, 8, 8, 72, torch.float16))
    why = wg.reason(q, k, v, mask)
    assert why is not None and re.search(match, why), why


@pytest.mark.parametrize("scale", [0.0, -0.2, float("inf"), True, torch.tensor(0.1)])
def test_reason_refuses_a_scale_that_is_not_a_positive_number(scale):
    q, k, v = qkv(1, 2, 8, 8, 72, torch.float16)
    assert "scale" in wg.reason(q, k, v, None, scale)


def test_reason_refuses_unaligned_strides():
    base = torch.randn(1, 8, 2, 73, dtype=torch.float16)[..., :72]  # rows 146 bytes apart
    q = base.transpose(1, 2)
    assert "16-byte" in wg.reason(q, q, q, None)


def test_reason_refuses_autograd():
    q, k, v = qkv(1, 2, 8, 8, 64, torch.float16)
    q.requires_grad_(True)
    assert "autograd" in wg.reason(q, k, v, None)


@pytest.mark.skipif(triton.__version__.startswith(wg.TESTED_TRITON),
                    reason="this Triton is the one the kernel is written for")
def test_other_triton_versions_are_named():
    assert triton.__version__ in wg.unavailable()


@pytest.mark.parametrize("d, split", [(40, (64, 16, False)), (64, (64, 16, False)), (72, (64, 16, True)),
                                      (80, (64, 16, True)), (128, (128, 16, False))])
def test_split_head_dim(d, split):
    assert wg.split_head_dim(d) == split


def test_consumers_per_head_dim_and_the_override_checked():
    assert [wg.consumers(d) for d in (40, 64, 72, 80, 128)] == [3, 3, 2, 2, 2]
    q, k, v = qkv(1, 1, 8, 8, 128, torch.float16)
    for n in (3, 4, 1):
        with pytest.raises(ValueError, match="up to head dim 80"):
            wg.attention_wgmma(q, k, v, n_consumers=n)


def test_output_layout_is_the_custom_ops():
    for layout in ("diffusers", "contiguous"):
        q, k, v = qkv(2, 3, 5, 5, 72, torch.float16, layout=layout)
        out = wg.output_like(q)
        shape, strides = attention_layout(q, k, v)
        assert (tuple(out.shape), out.stride()) == (shape, strides)


def test_hopper_profile_chooses_it_at_pixarts_and_sd3s_attention():
    hopper = profiles.get_profile("hopper")
    assert hopper.attention_choice(4096, 4096, 72)[0] == "flash_wgmma"
    assert hopper.attention_choice(4096, 4096, 72, "bfloat16")[0] == "flash_wgmma"
    assert hopper.attention_choice(4429, 4429, 64)[0] == "flash_wgmma"  # SD3's joint attention, ragged keys
    assert hopper.attention_choice(1024, 1024, 64)[0] == "flash_wgmma"  # SDXL's 32² self-attention
    # what it was measured slower at, or never measured: the path without it
    assert hopper.attention_choice(4096, 300, 72)[0] == "sdpa"
    assert hopper.attention_choice(4096, 77, 64)[0] == "flash"
    assert hopper.attention_choice(4096, 4096, 72, "float32")[0] == "sdpa"
    assert hopper.attention_choice(4096, 4096, 72, wgmma=False)[0] == "sdpa"
    assert hopper.attention_choice(4096, 4096, 128)[0] == "sdpa"
    assert hopper.attention_choice(4096, 4096, 40)[0] == "flash"
    assert profiles.get_profile("cuda").attention_choice(4096, 4096, 72)[0] != "flash_wgmma"


def test_a_call_it_cannot_take_runs_the_path_without_it(monkeypatch):
    monkeypatch.setattr(profiles, "_active", profiles.get_profile("hopper"))
    dispatch.reset_fallbacks()
    q, k, v = qkv(1, 2, 1024, 1024, 72, torch.float16)  # on the CPU: the kernel declines
    assert attn_mod.attention_path(q, k, v) == "sdpa"
    out = attn_mod.attention(q, k, v)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v))
    assert any(op == "flash_wgmma" and "CUDA" in why for op, why in dispatch.fallbacks())  # said, and counted


def test_the_path_without_it_is_the_profiles_not_always_stock(monkeypatch):
    """Head dim 64 on hopper: a call the kernel declines runs our flash kernel, as without it (on the
    GPU too: the kernel's checks are made to decline)."""
    hopper = profiles.get_profile("hopper")
    monkeypatch.setattr(profiles, "_active", hopper)
    monkeypatch.setattr(wg, "reason", lambda *a, **kw: "declined for the test")
    cuda = torch.cuda.is_available()
    if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("our flash kernel runs on a CUDA GPU or through the interpreter (TRITON_INTERPRET=1)")
    q, k, v = qkv(1, 1, 1024, 1024, 64, torch.float16, "cuda" if cuda else "cpu")
    assert hopper.attention_choice(1024, 1024, 64)[0] == "flash_wgmma"
    assert attn_mod.attention_path(q, k, v) == "flash"


def test_a_call_it_takes_goes_to_it_with_its_scale(monkeypatch):
    """The dispatch with the kernel's checks passed (patched: no GPU here): the path is flash_wgmma,
    and the scale reaches the kernel's checks."""
    monkeypatch.setattr(profiles, "_active", profiles.get_profile("hopper"))
    seen = []
    monkeypatch.setattr(wg, "reason", lambda q, k, v, mask, scale=None: seen.append(scale))
    monkeypatch.setattr(attn_mod, "use_kernel", lambda *a, **kw: True)
    q, k, v = qkv(1, 2, 1024, 1024, 72, torch.float16)
    assert attn_mod.attention_path(q, k, v, scale=0.25) == "flash_wgmma"
    assert seen == [0.25]


@pytest.mark.parametrize("value", ["72", [0], [72.5], [136], [100]])
def test_profile_json_checks_the_head_dims(value):
    with pytest.raises(profiles.ProfileError, match="wgmma_attention_head_dims"):
        profiles.from_dict({"name": "x", "description": "x", "wgmma_attention_head_dims": value})


# ---------------------------------------------------------------------------------------------
# GPU: the kernel's results


def _gpu_reason():
    if not torch.cuda.is_available():
        return "no CUDA GPU (the interpreter cannot run Gluon)"
    if torch.cuda.get_device_capability() != (9, 0):
        return "not an sm_90 GPU"
    return wg.unavailable()


gpu = pytest.mark.skipif(_gpu_reason() is not None, reason=str(_gpu_reason()))
poisoned = pytest.mark.usefixtures("poisoned_attention_outputs")  # unwritten output elements are NaN


def check(q, k, v, scale=None, n_consumers=None):
    assert wg.reason(q, k, v, None, scale) is None
    ours = wg.attention_wgmma(q, k, v, scale, n_consumers)
    ref64 = reference.attention(q.double(), k.double(), v.double(), None, scale)
    stock = F.scaled_dot_product_attention(q, k, v, scale=scale)
    assert_close_to_reference(ours, stock, ref64)
    return ours


@gpu
@poisoned
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [
    (2, 3, 333, 333, 72),  # ragged query rows and keys, PixArt's head dim
    (1, 2, 1030, 1030, 72),
    (2, 2, 256, 2125, 64),  # SD3-like ragged joint length
    (1, 2, 300, 77, 72),  # one partial key block
    (1, 2, 520, 640, 40),
    (1, 2, 384, 512, 128),
    (1, 1, 64, 129, 80),
    (1, 2, 200, 256, 64),  # two whole key blocks: the ragged test finds none
], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("n_consumers", [2, 3])
def test_matches_float64(shape, dtype, n_consumers):
    """Both programs' shapes (two or three consumer warpgroups) at every head dim, whichever the
    head dim picks by default; three are refused above head dim 80 (shared memory)."""
    q, k, v = qkv(*shape, dtype, "cuda")
    if n_consumers == 3 and shape[-1] > 80:
        with pytest.raises(ValueError, match="up to head dim 80"):
            wg.attention_wgmma(q, k, v, n_consumers=3)
        return
    check(q, k, v, n_consumers=n_consumers)


@gpu
@poisoned
@pytest.mark.parametrize("layout", ["diffusers", "contiguous"])
def test_layouts_and_scale(layout):
    q, k, v = qkv(2, 3, 200, 300, 72, torch.float16, "cuda", layout)
    out = check(q, k, v, scale=0.05)
    assert (tuple(out.shape), out.stride()) == attention_layout(q, k, v)


@gpu
@poisoned
def test_sliced_heads_of_a_fused_projection():
    """q, k, v as diffusers' fused QKV projection slices them: strided, heads inner."""
    b, s, h, d = 2, 257, 4, 72
    qkv_proj = torch.randn(b, s, 3 * h * d, device="cuda", dtype=torch.float16)
    q, k, v = (t.view(b, s, h, d).transpose(1, 2) for t in qkv_proj.chunk(3, dim=-1))
    check(q, k, v)


@gpu
@poisoned
def test_ops_attention_takes_it_under_the_hopper_profile(monkeypatch):
    monkeypatch.setattr(profiles, "_active", profiles.get_profile("hopper"))
    q, k, v = qkv(2, 16, 1024, 1024, 72, torch.float16, "cuda")
    assert attn_mod.attention_path(q, k, v) == "flash_wgmma"
    check(q, k, v)
    torch.testing.assert_close(attn_mod.attention(q, k, v), wg.attention_wgmma(q, k, v), rtol=0, atol=0)
    mask = torch.ones(1024, 1024, device="cuda", dtype=torch.bool)
    assert attn_mod.attention_path(q, k, v, mask) == "sdpa"
    assert attn_mod.attention_path(q, k, v, scale=-0.2) == "sdpa"
    for scale in (-0.2, 0.0):  # the path without it: stock's very call, NaNs included. On the H100
        # with equal_nan off this failed on NaN in 1.4% of the elements at scale -0.2; both sides are the
        # same F.scaled_dot_product_attention call (this version was not re-run on the GPU)
        out = attn_mod.attention(q, k, v, scale=scale)
        stock = F.scaled_dot_product_attention(q, k, v, scale=scale)
        torch.testing.assert_close(out, stock, atol=0, rtol=0, equal_nan=True)


@gpu
@poisoned
def test_the_even_key_variant_equals_the_default_and_refuses_ragged_keys():
    """``even_k=True`` compiles the ragged-block test out: at a key count that is a multiple of BLOCK_N
    nothing is masked either way, so the two agree bit for bit; at a ragged count it is refused."""
    q, k, v = qkv(1, 3, 333, 2 * wg.BLOCK_N, 64, torch.float16, "cuda")
    torch.testing.assert_close(wg.attention_wgmma(q, k, v, even_k=True), wg.attention_wgmma(q, k, v), rtol=0, atol=0)
    with pytest.raises(ValueError, match="multiple of"):
        wg.attention_wgmma(q, k[:, :, :100], v[:, :, :100], even_k=True)


@gpu
def test_one_compilation_serves_every_sequence_length():
    """SDXL's second level at 1024² (4096 keys), then at 832×1216 (3952, ragged) and its third level
    there (988, not a multiple of 16): after the first, no length compiles the kernel again."""
    from triton import knobs

    wg.attention_wgmma(*qkv(1, 2, 4096, 4096, 64, torch.float16, "cuda"))
    compiled, before = [], knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = lambda *, fn=None, **_: compiled.append(getattr(fn, "name", fn)) and False
    try:
        for s in (3952, 988, 77):
            check(*qkv(1, 2, s, s, 64, torch.float16, "cuda"))
        torch.cuda.synchronize()
    finally:
        knobs.runtime.jit_cache_hook = before
    assert compiled == []
