"""softmax_matmul and partial_softmax_attention against float64 references.

CPU (interpreter): tiny shapes, fp32/fp16. GPU: SD's head dims, the VAE's d = 512 over 4,096 tokens,
fp16/bf16, and the partial softmax's extra memory (X and two row vectors, nothing of size X more).
Stock: ``softmax(x) @ w`` and naive attention (scores materialised) at the same dtype, which round
the scores to the input dtype as the partial softmax does.
"""

import importlib

import pytest
import torch

from sd_kernels import reference
from sd_kernels.ops import partial_softmax_attention, softmax_matmul
from sd_kernels.runtime import dispatch
from sd_kernels.testing import assert_close_to_reference, extra_cuda_bytes, rel_err

attn_mod = importlib.import_module("sd_kernels.ops.attention")
psm_mod = importlib.import_module("sd_kernels.ops.softmax_matmul")


pytestmark = pytest.mark.usefixtures("poisoned_attention_outputs", "one_attention_config")


@pytest.fixture(params=["one_tile", "two_kernels"])
def path(request, monkeypatch):
    """Rows of X up to ONE_TILE_MAX_K long take the one-tile kernel; "two_kernels" sets the limit to 0
    so that the same inputs take the stats kernel and the fused matmul."""
    if request.param == "two_kernels":
        monkeypatch.setattr(psm_mod, "ONE_TILE_MAX_K", 0)
    return request.param


def randn(*shape, dtype=torch.float32, device="cpu", scale=1.0):
    return (scale * torch.randn(shape, dtype=torch.float64, device=device)).to(dtype)


SMM_CASES = [  # (x shape, w shape)
    ((1, 5), (5, 8)),
    ((2, 3, 77, 77), (2, 3, 77, 40)),
    ((3, 33, 100), (100, 24)),  # w broadcast over x's batch
    ((2, 1, 5, 1), (3, 1, 16)),  # b = 1, batch dims broadcast both ways
    ((2, 40, 70), (2, 70, 3)),
    ((3, 200), (200, 24)),  # b > ONE_TILE_MAX_K: the two-kernel path either way
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("xs, ws", SMM_CASES, ids=str)
def test_softmax_matmul(xs, ws, dtype, path, device):
    x, w = randn(*xs, dtype=dtype, device=device, scale=3.0), randn(*ws, dtype=dtype, device=device)
    assert_close_to_reference(softmax_matmul(x, w), reference.softmax_matmul(x, w),
                              reference.softmax_matmul(x.double(), w.double()))


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")  # the interpreter's numpy: 1/0, inf - inf
@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
def test_softmax_matmul_rows_of_minus_inf_are_nan(path, device):
    """As torch.softmax: a row of -inf gives NaN (partial_softmax_attention turns them into zeros)."""
    x, w = randn(4, 40, device=device), randn(40, 8, device=device)
    x[1] = float("-inf")
    x[2, :20] = float("-inf")
    y = softmax_matmul(x, w)
    assert y[1].isnan().all() and torch.isfinite(y[[0, 2, 3]]).all()
    rows = [0, 2, 3]
    ref, stock = reference.softmax_matmul(x.double(), w.double()), reference.softmax_matmul(x, w)
    assert stock[1].isnan().all()
    assert_close_to_reference(y[rows], stock[rows], ref[rows])


def test_softmax_matmul_bad_input(device):
    with pytest.raises(RuntimeError, match="disagree on b"):
        softmax_matmul(randn(3, 4, device=device), randn(5, 2, device=device))
    with pytest.raises(RuntimeError, match="same dtype"):
        softmax_matmul(randn(3, 4, device=device), randn(4, 2, device=device, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="a, b"):
        softmax_matmul(randn(4, device=device), randn(4, 2, device=device))
    with pytest.raises(RuntimeError, match="do not broadcast"):
        softmax_matmul(randn(2, 3, 4, device=device), randn(3, 4, 2, device=device))


def qkv(b, h, sq, sk, d, dtype, device, dv=None, layout="contiguous"):
    def make(s, n):
        x = randn(b, s, h, n, dtype=dtype, device=device)
        return x.transpose(1, 2) if layout == "diffusers" else x.transpose(1, 2).contiguous()

    return make(sq, d), make(sk, d), make(sk, dv or d)


def check(q, k, v, mask=None, scale=None, **kwargs):
    ours = partial_softmax_attention(q, k, v, mask, scale, **kwargs)
    stock = reference.attention(q, k, v, mask, scale)
    ref64 = reference.attention(q.double(), k.double(), v.double(), mask, scale)
    return assert_close_to_reference(ours, stock, ref64), ours


PSA_CASES = [  # (B, H, Sq, Sk, D, Dv, layout)
    (1, 2, 1, 5, 8, 8, "contiguous"),
    (2, 2, 77, 77, 40, 40, "diffusers"),
    (1, 1, 5, 77, 40, 72, "contiguous"),
    (2, 1, 70, 1, 8, 8, "diffusers"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", PSA_CASES, ids=lambda c: "x".join(map(str, c[:6])) + f"-{c[6]}")
def test_partial_softmax_attention(case, dtype, device):
    b, h, sq, sk, d, dv, layout = case
    _, out = check(*qkv(b, h, sq, sk, d, dtype, device, dv, layout))
    if layout == "diffusers" and h > 1:
        assert out.transpose(1, 2).is_contiguous()  # q's layout: diffusers' reshape after it is a view


@pytest.mark.parametrize("chunk_rows", [1, 7, 32])
def test_chunks(chunk_rows, device):
    """max_chunk_bytes: query rows in chunks through one X buffer; the result does not change."""
    q, k, v = qkv(2, 3, 33, 20, 8, torch.float16, device, layout="diffusers")
    check(q, k, v, max_chunk_bytes=chunk_rows * 2 * 3 * 20 * 2)


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_masks_and_fully_masked_rows(kind, path, device):
    q, k, v = qkv(2, 3, 6, 40, 8, torch.float16, device, layout="diffusers")
    keep = torch.rand(2, 1, 6, 40, device=device) > 0.5
    keep[..., 3] = True
    keep[:, :, 0] = False  # row 0 fully masked: zeros, not NaN
    mask = keep
    if kind == "float":  # in q's dtype: the reference's probs·v needs one dtype
        mask = torch.zeros(keep.shape, device=device).masked_fill(~keep, float("-inf")).to(torch.float16)
    _, out = check(q, k, v, mask, max_chunk_bytes=2 * 3 * 40 * 2 * 4)
    assert torch.equal(out[:, :, 0], torch.zeros_like(out[:, :, 0]))


def test_scores_dtype(device):
    q, k, v = qkv(1, 2, 5, 9, 8, torch.float16, device)
    ref = reference.attention(q.double(), k.double(), v.double())
    out = partial_softmax_attention(q, k, v, scores_dtype=torch.float32)
    assert out.dtype == torch.float16 and rel_err(out, ref) < 4 * 2**-11
    with pytest.raises(ValueError, match="scores_dtype"):
        partial_softmax_attention(q, k, v, scores_dtype=torch.int32)


def test_partial_softmax_runs_the_kernels(device):
    dispatch.reset_fallbacks()
    check(*qkv(1, 2, 5, 9, 300, torch.float32, device))
    assert not dispatch.fallbacks()


# ---------------------------------------------------------------------------------------------
# GPU: SD's shapes, fp16 / bf16

GPU_CASES = [  # (B, H, Sq, Sk, D, dtype, layout)
    (1, 1, 4096, 4096, 512, torch.float16, "contiguous"),  # the VAE's mid-block attention
    (1, 1, 4096, 4096, 512, torch.bfloat16, "diffusers"),
    (2, 8, 4096, 77, 40, torch.float16, "diffusers"),  # cross-attention: the one-tile kernel
    (2, 8, 1024, 77, 80, torch.bfloat16, "diffusers"),
    (2, 8, 256, 77, 160, torch.float16, "diffusers"),
    (2, 8, 1024, 1024, 80, torch.bfloat16, "diffusers"),
    (2, 8, 256, 256, 160, torch.float16, "diffusers"),
    (1, 2, 1031, 100, 64, torch.float16, "contiguous"),
    (2, 2, 1, 1031, 512, torch.float16, "contiguous"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "x".join(map(str, c[:5])) + f"-{c[5]}-{c[6]}")
def test_gpu_partial_softmax_attention(case, path, device):
    b, h, sq, sk, d, dtype, layout = case
    check(*qkv(b, h, sq, sk, d, dtype, device, layout=layout))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_softmax_matmul(dtype, device):
    x, w = randn(2, 8, 1024, 1031, dtype=dtype, device=device, scale=3.0), randn(2, 8, 1031, 80, dtype=dtype,
                                                                               device=device)
    assert_close_to_reference(softmax_matmul(x, w), reference.softmax_matmul(x, w),
                              reference.softmax_matmul(x.double(), w.double()))


@pytest.mark.gpu
def test_gpu_masks_and_chunks(device):
    q, k, v = qkv(2, 8, 1024, 77, 80, torch.float16, device, layout="diffusers")
    keep = torch.rand(2, 1, 1, 77, device=device) > 0.3
    keep[0, 0, 0, :] = False  # batch 0: every row fully masked
    keep[1, 0, 0, 0] = True
    _, out = check(q, k, v, keep, max_chunk_bytes=300 * 2 * 8 * 77 * 2)
    assert (out[0] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("chunk_rows", [None, 1000])
def test_gpu_extra_memory_is_x_and_two_vectors(chunk_rows, device):
    """Extra memory: X (B·H·rows·Sk, fp32 for fp16 inputs: fp16 scores could overflow) and two fp32
    row vectors; no T = softmax(X), no fp32 copies of q and k (cuBLAS writes fp32 from fp16)."""
    b, h, sq, sk, d = 1, 1, 4096, 4096, 512
    q, k, v = qkv(b, h, sq, sk, d, torch.float16, device)
    rows = sq if chunk_rows is None else chunk_rows
    max_chunk = None if chunk_rows is None else b * h * rows * sk * 4
    extra, _ = extra_cuda_bytes(lambda *a: partial_softmax_attention(*a, max_chunk_bytes=max_chunk), q, k, v)
    x_bytes = b * h * rows * sk * 4
    vectors = 2 * b * h * rows * 4
    # The caching allocator rounds each block up to 512 B, and serves a request of 10 MB or more from a
    # segment rounded up to 2 MiB whose remainder, under 1 MiB, it does not split off: the block counts
    # whole (X of 1000 rows: 16,384,000 B in a 16 MiB block, seen with a memory snapshot on the H100).
    rest = -x_bytes % (2 << 20)
    slack = 4096 + (rest if x_bytes >= 10 << 20 and rest < 1 << 20 else 0)
    assert x_bytes <= extra <= x_bytes + vectors + slack, (extra, x_bytes, vectors)
    naive, _ = extra_cuda_bytes(reference.attention, q, k, v)
    assert naive >= 2 * b * h * sq * sk * 2  # the naive path holds X and T
