"""ops.attention_fp8: the kernel against a float64 reference of its quantized algorithm (exact up to
fp32 accumulation and the output's rounding), the algorithm's error against exact attention, the
inputs it takes and refuses, the dispatch hook (``attention(..., precision="fp8")``) and the custom op.

On CPU the kernels run through Triton's interpreter at tiny shapes, with small key blocks so that
several blocks and a ragged last one are crossed. The interpreter's bf16 ``tl.dot`` is broken (its
8-bit dots are not): bf16 inputs run here only where both dots are 8-bit (``pv="fp8"``); bf16 with
``pv="input"`` is tested on the GPU. GPU tests (marked ``gpu``) run the compiled kernel at the DiTs'
and SDXL's shapes.
"""

import importlib
import textwrap

import pytest
import torch
import triton
import triton.language as tl
from torch._subclasses.fake_tensor import FakeTensorMode

from sd_kernels import reference
from sd_kernels.ops import attention_fp8
from sd_kernels.ops.custom_ops import attention_layout
from sd_kernels.runtime import dispatch
from sd_kernels.testing import rel_err

fp8 = importlib.import_module("sd_kernels.ops.attention_fp8")
hopper = importlib.import_module("sd_kernels.ops.attention_fp8_wgmma")
attn = importlib.import_module("sd_kernels.ops.attention")
custom_ops = importlib.import_module("sd_kernels.ops.custom_ops")

gpu = pytest.mark.gpu
poisoned = pytest.mark.usefixtures("poisoned_attention_outputs")  # unwritten output elements are NaN
# CPU tensors reach the kernels only under Triton's interpreter (the CPU run); on a GPU host the test_gpu_* tests
# run the same kernels compiled
interpreted = pytest.mark.skipif(not dispatch.interpreting(), reason="CPU tensors reach the kernels only under "
                                 "Triton's interpreter; on a GPU the test_gpu_* tests run them compiled")
# The kernel against the quantized reference: both round the output once to the input dtype; the
# interpreter converts fp32 to bf16 by truncation (the GPU rounds), one more bf16 unit.
MATCH = {torch.float16: 2 * 2.0**-11, torch.bfloat16: 2 * 2.0**-8}


def compiled_bound(qk: str, pv: str, dtype: torch.dtype) -> float:
    """The compiled kernels against the quantized reference: their scores and probabilities (the tensor cores'
    sums, ex2.approx) and the reference's (float64) take neighbouring 8-bit codes where they straddle a
    rounding boundary (``test_gpu_matches_the_quantized_reference`` says how much that moves)."""
    return (8e-3 if qk == pv == "fp8" else 4e-3) + MATCH[dtype]


def bound(dtype: torch.dtype, qk: str = "int8", pv: str = "fp8") -> float:
    """The kernel against the quantized reference where it runs: the interpreter, or compiled on a GPU."""
    return MATCH[dtype] if dispatch.interpreting() else compiled_bound(qk, pv, dtype)


def qkv(b, h, sq, sk, d, dtype=torch.float16, device="cpu", scale_q=1.0):
    """Diffusers' layout: transposed views of [B, S, H, D]."""
    def make(s, amp=1.0):
        return (torch.randn(b, s, h, d, device=device) * amp).to(dtype).transpose(1, 2)

    return make(sq, scale_q), make(sk), make(sk)


@triton.jit
def _round_kernel(X, Y, Z, N: tl.constexpr, SOFT: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(X + offs)
    tl.store(Y + offs, fp8._e4m3(x, SOFT))
    tl.store(Z + offs, fp8._quantize(x / 4.0, True, SOFT))


def test_roundings_match_torch(device):
    """e4m3 (ties to even, carries into the exponent, subnormals) and int8 rounding as torch rounds;
    on CPU through the kernels' rounding in fp32 (the interpreter's own cast gets 31.6 → 16)."""
    n = 4096
    x = torch.cat([torch.linspace(-448, 448, n // 2), torch.linspace(-0.05, 0.05, n // 4),
                   torch.tensor([31.6, 200.0, -200.0, 15.5, 0.0029296875, 2.0**-10, 447.9]),
                   torch.randn(n // 4 - 7) * 30]).to(device)
    y = torch.empty(n, dtype=torch.float8_e4m3fn, device=device)
    z = torch.empty(n, dtype=torch.int8, device=device)
    _round_kernel[(1,)](x, y, z, N=n, SOFT=not x.is_cuda)
    assert torch.equal(y.float(), x.to(torch.float8_e4m3fn).float())
    assert torch.equal(z, torch.round(x / 4).to(torch.int8))


CASES = [  # (B, H, Sq, Sk, D, dtype, qk, pv, key block)
    (1, 2, 77, 77, 64, torch.float16, "int8", "fp8", 32),  # ragged: 77 = 2·32 + 13
    (1, 1, 333, 333, 64, torch.float16, "int8", "fp8", 128),  # the kernel's own key block
    (1, 1, 96, 333, 128, torch.float16, "fp8", "fp8", 64),
    (2, 1, 77, 77, 128, torch.bfloat16, "int8", "fp8", 32),
    (1, 1, 64, 64, 64, torch.bfloat16, "fp8", "fp8", 32),  # whole key blocks (no score mask)
    (1, 2, 50, 77, 64, torch.float16, "int8", "input", 32),
    (1, 1, 77, 64, 128, torch.float16, "fp8", "input", 16),
]


@poisoned
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(x).removeprefix("torch.") for x in c))
def test_matches_the_quantized_reference(case, device):
    b, h, sq, sk, d, dtype, qk, pv, block = case
    q, k, v = qkv(b, h, sq, sk, d, dtype, device)
    out = fp8._attention_fp8(q, k, v, d**-0.5, qk, pv, key_block=block)
    ref = reference.attention_fp8(*(t.cpu() for t in (q, k, v)), None, qk, pv, key_block=block)
    exact = reference.attention(*(t.double().cpu() for t in (q, k, v)))
    assert out.stride() == q.stride() or out.is_contiguous()
    assert rel_err(out, ref) <= bound(dtype, qk, pv)
    assert 3e-3 < rel_err(ref, exact) < 0.06  # quantized, so not exact: what the match above is beyond


@pytest.mark.parametrize("qk", fp8.QK_MODES)
def test_a_query_row_too_small_to_scale(qk, device):
    """448 (or 127) / max|q_row| overflows fp32 below 1.32e-36 (3.7e-37): a row no larger than
    reference.SCALE_TINY is quantized as zeros (uniform scores over the keys), in the kernel as in the
    reference, and the output is finite."""
    q, k, v = qkv(1, 1, 40, 77, 64, torch.bfloat16, device)  # bf16 holds 1e-37
    q[0, 0, 3] = 0.0
    q[0, 0, 3, :2] = torch.tensor([1e-37, -5e-38])
    out = fp8._attention_fp8(q, k, v, 0.125, qk, "fp8", key_block=32)
    ref = reference.attention_fp8(*(t.cpu() for t in (q, k, v)), 0.125, qk, "fp8", key_block=32)
    assert out.isfinite().all() and ref.isfinite().all() and rel_err(out, ref) <= bound(torch.bfloat16, qk)


def _outliers(q, k):
    """Two of Q's channels 10x the others and a K offset of 8 on every 8th channel: activations as
    large models have them (the offset leaves exact attention unchanged)."""
    d = q.shape[-1]
    q = q * torch.where(torch.arange(d) < 2, 10.0, 1.0).to(q.dtype)
    k = k + torch.where(torch.arange(d) % 8 == 0, 8.0, 0.0).to(k.dtype)
    return q, k


@pytest.mark.parametrize("d", [64, 128])
def test_error_against_exact_attention(d):
    """The algorithm's relative error (reference.attention_fp8, as the kernel computes it) at 1024
    keys, random inputs and with outliers: bounded for every mode; with outliers int8 Q·Kᵀ (the
    default) beats e4m3's, and P·V in the input dtype beats e4m3's."""
    q, k, v = qkv(1, 2, 256, 1024, d, torch.bfloat16, scale_q=2.0)  # scores with σ 2: a peaked softmax
    errors = {}
    for case, (qq, kk) in {"random": (q, k), "outliers": _outliers(q, k)}.items():
        exact = reference.attention(qq.double(), kk.double(), v.double())
        for qk in fp8.QK_MODES:
            for pv in fp8.PV_MODES:
                errors[case, qk, pv] = rel_err(reference.attention_fp8(qq, kk, v, None, qk, pv), exact)
    assert max(errors.values()) < 0.15, errors
    assert errors["random", "int8", "fp8"] < 0.05, errors
    assert errors["outliers", "int8", "fp8"] < errors["outliers", "fp8", "fp8"], errors
    assert errors["outliers", "int8", "input"] < errors["outliers", "int8", "fp8"], errors


@pytest.mark.parametrize("qk", fp8.QK_MODES)
def test_key_smoothing_takes_out_a_channel_offset(qk, device):
    """K + a per-channel offset (which exact attention ignores) is computed as accurately as K: the
    smoothing takes the offset out before the 8 bits' range is set. Without it the offset (σ 8
    against the keys' σ 1) would widen each step about tenfold."""
    q, k, v = qkv(1, 1, 40, 77, 64, torch.float16, device)
    shifted = k + (torch.randn(64, device=device) * 8).to(k.dtype)  # rounded to fp16: ≤ 2^-8 off
    a = fp8._attention_fp8(q, k, v, 0.125, qk, "fp8", key_block=32)
    b = fp8._attention_fp8(q, shifted, v, 0.125, qk, "fp8", key_block=32)
    exact = reference.attention(q.double(), k.double(), v.double())
    exact_shifted = reference.attention(q.double(), shifted.double(), v.double())
    assert rel_err(b, exact_shifted) < 1.5 * rel_err(a, exact)


@poisoned
def test_strided_and_broadcast_inputs(device):
    """Slices of a fused QKV projection (strided, heads inner), a strided K, K and V broadcast over
    the batch, 3-D inputs."""
    b, s, h, d = 2, 77, 2, 64
    proj = torch.randn(b, s, 3 * h * d, device=device).half()
    q, k, v = (t.view(b, s, h, d).transpose(1, 2) for t in proj.chunk(3, dim=-1))
    for kk, vv in ((k, v), (k[:1].expand(b, h, s, d), v[:1].expand(b, h, s, d)), (k[:1], v[:1]),
                   (torch.randn(b, h, 2 * s, d, device=device).half()[:, :, ::2], v)):
        ours = attention_fp8(q, kk, vv)
        assert rel_err(ours.cpu(), reference.attention_fp8(q.cpu(), kk.cpu(), vv.cpu())) <= bound(q.dtype)
        assert ours.stride() == attention_layout(q, kk, vv)[1]
    q3 = q[0].contiguous()
    assert rel_err(attention_fp8(q3, q3, q3), reference.attention_fp8(q3.cpu(), q3.cpu(), q3.cpu())) <= bound(q.dtype)


@pytest.mark.parametrize(("change", "error", "match"), [
    (dict(attn_mask=torch.ones(8, 8, dtype=torch.bool)), ValueError, "attention mask"),
    (dict(d=72), ValueError, "64 or 128"),
    (dict(d=40), ValueError, "64 or 128"),
    (dict(dtype=torch.float32), ValueError, "float16 or bfloat16"),
    (dict(qk="int4"), ValueError, "qk='int4'"),
    (dict(pv="fp16"), ValueError, "pv='fp16'"),
    (dict(scale=-0.1), ValueError, "scale -0.1"),
    (dict(scale=float("inf")), ValueError, "scale inf"),
    (dict(kd=128), RuntimeError, "head dims differ"),
])
def test_bad_inputs_are_refused_before_any_work(change, error, match, count_calls):
    d = change.pop("d", 64)
    q = torch.randn(1, 1, 8, d, dtype=change.pop("dtype", torch.float16))
    k = torch.randn(1, 1, 8, change.pop("kd", d), dtype=q.dtype)
    calls = count_calls(fp8, quantize="quantize_kv", kernel="_attention_fp8")
    with pytest.raises(error, match=match):
        attention_fp8(q, k, k, **change)
    assert calls == {"quantize": 0, "kernel": 0}


def test_reference_runs_where_no_kernel_can(monkeypatch):
    """No interpreter and no GPU: the quantized algorithm in torch, logged as a fallback."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    dispatch.reset_fallbacks()
    q, k, v = qkv(1, 1, 20, 30, 64)
    torch.testing.assert_close(attention_fp8(q, k, v), reference.attention_fp8(q, k, v), rtol=0, atol=0)
    assert [op for op, _ in dispatch.fallbacks()] == ["attention_fp8"]


# ---------------------------------------------------------------------------------------------
# The hook: ops.attention.attention(..., precision="fp8")


@interpreted
def test_precision_fp8_routes_self_attention(monkeypatch, count_calls):
    monkeypatch.setattr(attn, "FP8_MIN_KEYS", 64)
    calls = count_calls(fp8, fp8="attention_fp8")
    q, k, v = qkv(1, 2, 64, 64, 64)
    out = attn.attention(q, k, v, precision="fp8")
    assert calls["fp8"] == 1
    assert rel_err(out, reference.attention_fp8(q, k, v)) <= bound(q.dtype)
    torch.testing.assert_close(custom_ops.attention(q, k, v, precision="fp8"), out, rtol=0, atol=0)
    exact = attn.attention(q, k, v)  # the default path is untouched
    assert calls["fp8"] == 2
    assert rel_err(exact, reference.attention(q.double(), k.double(), v.double())) < 1e-3


@interpreted
@pytest.mark.parametrize("d", [64, 128])
def test_precision_fp8_takes_the_q_k_mode_of_its_head_dim(monkeypatch, count_calls, d):
    """``ops.attention.FP8_QK`` picks the Q·Kᵀ mode a routed call runs (int8 at 64, e4m3 at 128 as shipped;
    here both swapped, so that the test sees the table and not a default)."""
    monkeypatch.setattr(attn, "FP8_MIN_KEYS", 64)
    monkeypatch.setattr(attn, "FP8_QK", {64: "fp8", 128: "int8"})
    calls = count_calls(fp8, fp8="attention_fp8")
    q, k, v = qkv(1, 2, 64, 64, d)
    out = attn.attention(q, k, v, precision="fp8")
    assert [(call["qk"], call["pv"]) for call in calls.args["fp8"]] == [(attn.FP8_QK[d], "fp8")]
    assert rel_err(out, reference.attention_fp8(q, k, v, qk=attn.FP8_QK[d])) <= bound(q.dtype, attn.FP8_QK[d])


@pytest.mark.parametrize(("sk", "d", "mask", "why"), [
    (32, 64, False, "32 keys < FP8_MIN_KEYS 64"),  # cross-attention over a short text sequence
    (64, 40, False, "the FP8 kernel takes 64 or 128"),
    (64, 64, True, "an attention mask"),
])
def test_precision_fp8_declines_to_the_exact_path(monkeypatch, count_calls, sk, d, mask, why):
    monkeypatch.setattr(attn, "FP8_MIN_KEYS", 64)
    calls = count_calls(fp8, fp8="attention_fp8")
    dispatch.reset_fallbacks()
    q, k, v = qkv(1, 1, 16, sk, d)
    m = torch.ones(16, sk, dtype=torch.bool) if mask else None
    out = attn.attention(q, k, v, m, precision="fp8")
    assert calls["fp8"] == 0
    assert rel_err(out, reference.attention(q.double(), k.double(), v.double())) < 1e-3
    assert any(op == "attention_fp8" and why in reason for op, reason in dispatch.fallbacks())


def test_precision_is_checked():
    q = torch.randn(1, 1, 8, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="precision must be one of"):
        attn.attention(q, q, q, precision="int4")


def test_custom_op_promises_the_layout():
    q, k, v = qkv(2, 3, 50, 70, 64)
    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
        out = torch.ops.sd_kernels.attention_fp8(fq, fk, fv, None, "int8", "fp8")
        assert (tuple(out.shape), out.stride()) == attention_layout(q, k, v)
    out = torch.ops.sd_kernels.attention_fp8(q, k, v, None, "int8", "fp8")
    assert out.stride() == attention_layout(q, k, v)[1]


# ---------------------------------------------------------------------------------------------
# The Hopper kernel's key order and the choice of kernel (CPU); the kernel itself runs on the GPU


@triton.jit
def _key_order_kernel(Out, N: tl.constexpr):
    n = tl.arange(0, N)
    tl.store(Out + n, fp8.wgmma_key_order(n))


@interpreted
def test_the_key_order_is_the_register_renaming_of_the_pv_operand():
    """In a quad's thread t, wgmma's fp32 accumulator holds keys 8b + 2t + e of every 16 (b, e ∈ {0, 1}),
    and the 8-bit A operand reads keys 4t + 2b + e there (PTX ISA, wgmma register fragments): the order
    must send each thread's accumulator keys to its own operand keys, in order, and be a permutation; and
    it must be the relabelling the Hopper kernel makes of P (its reshape and permute, whose constants it
    shares with this test)."""
    n = 64
    order = torch.empty(n, dtype=torch.int32)
    _key_order_kernel[(1,)](order, N=n)
    assert sorted(order.tolist()) == list(range(n))
    for base in range(0, n, 16):
        for t in range(4):
            acc = [base + 8 * b + 2 * t + e for b in (0, 1) for e in (0, 1)]
            operand = [base + 4 * t + j for j in range(4)]
            assert [order[key].item() for key in acc] == operand
    # the kernel's relabelling of one row of P: position i of the operand holds accumulator key relabeled[i]
    relabeled = torch.arange(n).reshape(1, n // 32, *hopper.P_KEY_SPLIT).permute(hopper.P_KEY_PERM).reshape(n)
    assert torch.equal(order[relabeled].long(), torch.arange(n))


@interpreted
def test_the_prepass_writes_v_in_the_hopper_kernels_key_order():
    q, k, v = qkv(1, 2, 8, 77, 64)
    k8, ks, v8, vs = fp8.quantize_kv(k, v, "int8", "fp8", key_block=32)
    k8p, ksp, v8p, vsp = fp8.quantize_kv(k, v, "int8", "fp8", key_block=32, permute_v=True)
    order = torch.empty(128, dtype=torch.int32)
    _key_order_kernel[(1,)](order, N=128)
    order = order[:v8.shape[-1]]  # 96: three key blocks of 32
    assert torch.equal(k8, k8p) and torch.equal(ks, ksp) and torch.equal(vs, vsp)
    assert torch.equal(v8p[..., order.long()].view(torch.uint8), v8.view(torch.uint8))


@interpreted
def test_the_prepass_takes_longer_chunks_past_max_chunks(monkeypatch, count_calls):
    """Past MAX_CHUNKS statistics programs a head, each takes more keys (a power of two): the same V8 bits
    and scales, K8 within one code (the mean's sum runs in other chunks)."""
    _, k, v = qkv(1, 2, 8, 333, 64)
    before = fp8.quantize_kv(k, v, "int8", "fp8", key_block=32)
    monkeypatch.setattr(fp8, "STATS_ROWS", 16)
    monkeypatch.setattr(fp8, "MAX_CHUNKS", 3)  # 333 keys: chunks of 128, not 21 of 16
    calls = count_calls(fp8, stats="_STATS")
    after = fp8.quantize_kv(k, v, "int8", "fp8", key_block=32)
    assert [tuple(call["grid"]) for call in calls.args["stats"]] == [(2, 3)]
    assert torch.equal(after[2].view(torch.uint8), before[2].view(torch.uint8)) and torch.equal(after[3], before[3])
    assert (after[0].int() - before[0].int()).abs().max() <= 1 and torch.allclose(after[1], before[1], rtol=1e-6)


# Every mode's pre-pass compiled for an sm_90 target, in a process without the interpreter (which neither
# types nor compiles a kernel): a store of the wrong type in a branch one mode never runs fails only there.
_PREPASS_COMPILES = textwrap.dedent("""
    import importlib, json
    import torch
    import cuda_standin

    cuda_standin.install()
    fp8 = importlib.import_module("sd_kernels.ops.attention_fp8")

    class Compile:  # the launcher's arguments, compiled (warmup) instead of launched
        def __init__(self, launcher):
            self.jit = launcher.jit

        def __call__(self, key, grid, *args, **kwargs):
            self.jit.warmup(*args, grid=grid, **kwargs)

    fp8._STATS, fp8._QUANT = Compile(fp8._STATS), Compile(fp8._QUANT)
    out = {}
    for qk in fp8.QK_MODES:
        for pv in fp8.PV_MODES:
            k = torch.empty(1, 2, 300, 64, dtype=torch.float16)
            try:
                fp8.quantize_kv(k, k, qk, pv, permute_v=pv == "fp8")
                out[f"{qk}/{pv}"] = "ok"
            except Exception as exc:
                out[f"{qk}/{pv}"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    print(json.dumps(out))
""")


def test_the_prepass_compiles_for_hopper_in_every_mode(tmp_path):
    import cuda_standin

    result = cuda_standin.run(_PREPASS_COMPILES, env={"TRITON_CACHE_DIR": str(tmp_path)})
    assert result == {f"{qk}/{pv}": "ok" for qk in fp8.QK_MODES for pv in fp8.PV_MODES}


def test_kernel_choice(monkeypatch):
    q = qkv(1, 2, 64, 64, 64)[0]
    assert fp8.kernel_choice(q, pv="fp8") == "triton"  # no GPU (or the interpreter)
    monkeypatch.setattr(fp8, "interpreting", lambda: False)
    assert "not on a CUDA" in hopper.reason(q, 128)
    monkeypatch.setattr(hopper, "reason", lambda q4, key_block: None)  # as on an H100 / H200
    assert fp8.kernel_choice(q, pv="fp8") == "wgmma"
    assert fp8.kernel_choice(q, pv="input") == "triton"  # the Hopper kernel has no 16-bit P·V
    q128 = qkv(1, 2, 64, 64, 128)[0]
    assert fp8.kernel_choice(q128, qk="fp8", pv="fp8") == "wgmma"
    assert fp8.kernel_choice(q128, qk="int8", pv="fp8") == "triton"  # measured faster there
    monkeypatch.setattr(fp8, "HOPPER", False)
    assert fp8.kernel_choice(q, pv="fp8") == "triton"


def test_a_declined_hopper_kernel_is_logged_on_hopper(monkeypatch):
    """On an sm_90 GPU a call the Hopper kernel cannot take is counted with the reason; elsewhere (no
    Hopper GPU) nothing is counted, since nothing was expected of it."""
    q = qkv(1, 2, 64, 64, 64)[0]
    monkeypatch.setattr(fp8, "interpreting", lambda: False)
    monkeypatch.setattr(hopper, "reason", lambda q4, key_block: "q: a broadcast (stride 0) dimension")
    dispatch.reset_fallbacks()
    assert fp8.kernel_choice(q, pv="fp8") == "triton"
    assert dispatch.fallbacks() == {}
    monkeypatch.setattr(fp8, "_on_hopper", lambda t: True)
    assert fp8.kernel_choice(q, pv="fp8") == "triton"
    assert dispatch.fallbacks() == {("attention_fp8_wgmma", "q: a broadcast (stride 0) dimension"): 1}


def test_asking_for_the_hopper_kernel_where_it_cannot_run_raises():
    q, k, v = qkv(1, 2, 64, 64, 64)
    with pytest.raises(ValueError, match="n_consumers=2 asks for the Hopper kernel"):
        fp8._attention_fp8(q, k, v, 0.125, n_consumers=2)  # CPU: the interpreter runs no Gluon


def _misaligned(shape):
    return torch.empty(int(torch.tensor(shape).prod()) + 1, dtype=torch.float16)[1:].view(shape)


@pytest.mark.parametrize(("q", "key_block", "why"), [
    (torch.empty(1, 2, 64, 72, dtype=torch.float16), 128, "head dim 72"),
    (torch.empty(1, 2, 64, 64, dtype=torch.float16), 64, "key block 64"),
    (torch.empty(1, 70000, 1, 64, dtype=torch.float16), 128, "grid limit"),
    (torch.empty(1, 1, 64, 64, dtype=torch.float16).expand(2, 3, 64, 64), 128, "broadcast (stride 0)"),
    (_misaligned((1, 2, 64, 64)), 128, "not 16-byte aligned"),
], ids=["head-dim", "key-block", "grid", "broadcast", "misaligned"])
def test_the_hopper_kernel_refuses(q, key_block, why):
    assert why in hopper.reason(q, key_block)


# ---------------------------------------------------------------------------------------------
# GPU: the compiled kernel at the models' shapes

GPU_SHAPES = [  # (B, H, S, D): self-attention at 1024²
    (1, 24, 4608, 128),  # FLUX.1: 4,096 image + 512 text tokens
    (2, 24, 4429, 64),  # SD3-medium: 4,096 + 333
    (2, 10, 4096, 64),  # SDXL at 64² latent tokens
    (2, 20, 1024, 64),  # SDXL at 32²
]


def _heads(t, n=2):
    return t[:, :n].double()


GPU_MODES = [("int8", "fp8", "wgmma"), ("fp8", "fp8", "wgmma"), ("int8", "fp8", "triton"), ("fp8", "fp8", "triton"),
             ("int8", "input", "triton"), ("fp8", "input", "triton")]


@pytest.fixture
def kernel(request, monkeypatch):
    """Run ``attention_fp8`` on the kernel named by the test's parameter; a wgmma case checks that
    this GPU takes it (an sm_90 GPU with Triton 3.6), and skips with the reason where it cannot."""
    name = request.param
    monkeypatch.setattr(fp8, "HOPPER", name == "wgmma")
    if name == "wgmma" and (why := hopper.reason(torch.empty(1, 1, 64, 64, device="cuda", dtype=torch.float16),
                                                  fp8.KEY_BLOCK)) is not None:
        pytest.skip(f"the Hopper FP8 kernel cannot run here: {why}")
    return name


@gpu
@poisoned
@pytest.mark.usefixtures("one_attention_config")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("modes", "kernel"), [(m[:2], m[2]) for m in GPU_MODES], indirect=["kernel"],
                         ids=["-".join(m) for m in GPU_MODES])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gpu_matches_the_quantized_reference(shape, modes, kernel, dtype):
    """Against the quantized algorithm in float64 (two heads: the reference's scores are large). The
    e4m3 wgmma accumulates in less than fp32 (reported for Hopper), hence the looser bound here; the
    error against exact attention is printed beside it (pytest -s).

    With Q·Kᵀ and P both in e4m3, the kernel's scores and probabilities (the wgmma's sums, ex2.approx)
    and the reference's (float64) round to neighbouring e4m3 codes wherever they straddle a rounding
    boundary, each such value off by 1/16: at FLUX's 4,608 keys that put the fp16 output 5.6-5.8e-3 from
    the reference on an H200 (2026-11-28; bf16 5.9e-3, within its own bound), and adding each key block's
    P·V in fp32 did not change it (5.55e-3). With int8 Q·Kᵀ the same e4m3 P stays within 2.0e-3 (fp16).
    So e4m3 for both gets 8e-3, every other mode 4e-3, over the input's own rounding."""
    b, h, s, d = shape
    qk, pv = modes
    q, k, v = qkv(b, h, s, s, d, dtype, "cuda")
    if kernel == "wgmma":  # by name: kernel_choice leaves int8 Q·Kᵀ at head dim 128 to the Triton kernel
        assert fp8._hopper_reason(q, pv, fp8.KEY_BLOCK) is None
        out = fp8._attention_fp8(q, k, v, d**-0.5, qk, pv, n_consumers=hopper.consumers(d))
    else:
        out = attention_fp8(q, k, v, qk=qk, pv=pv)
    ref = reference.attention_fp8(q[:, :2], k[:, :2], v[:, :2], None, qk, pv)
    exact = reference.attention(_heads(q), _heads(k), _heads(v))
    e_ref, e_exact = rel_err(out[:, :2], ref), rel_err(out[:, :2], exact)
    print(f"{shape} {dtype} qk={qk} pv={pv} {kernel}: vs quantized reference {e_ref:.2e}, vs exact {e_exact:.2e}")
    assert e_ref <= compiled_bound(qk, pv, dtype)
    assert e_exact < 0.06


@gpu
@poisoned
@pytest.mark.parametrize(("kernel", "qk"), [("wgmma", "int8"), ("wgmma", "fp8"), ("triton", "int8")],
                         indirect=["kernel"], ids=["wgmma-int8", "wgmma-fp8", "triton-int8"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("s", [1, 77, 333, 1030])
def test_gpu_ragged_lengths(s, d, kernel, qk):
    """One key, and lengths that leave a ragged last key block, in each kernel (the Hopper kernel asked
    for by name, in both Q·Kᵀ modes; the bounds as in the test above)."""
    q, k, v = qkv(2, 3, s, s, d, torch.bfloat16, "cuda")
    if kernel == "wgmma":
        out = fp8._attention_fp8(q, k, v, d**-0.5, qk, "fp8", n_consumers=hopper.consumers(d))
    else:
        out = attention_fp8(q, k, v, qk=qk)
    assert rel_err(out, reference.attention_fp8(q, k, v, qk=qk)) <= compiled_bound(qk, "fp8", q.dtype)


@gpu
@poisoned
@pytest.mark.parametrize("kernel", ["wgmma"], indirect=True)
@pytest.mark.parametrize("pingpong", [True, False])
@pytest.mark.parametrize("qk", ["int8", "fp8"])
@pytest.mark.parametrize(("s", "d"), [(1030, 64), (333, 128), (4608, 128)])
def test_gpu_hopper_kernel_with_and_without_the_token_ring(kernel, pingpong, qk, s, d, monkeypatch):
    """Both schedules of the Hopper kernel (the consumers' token ring on and off), whichever ``PINGPONG``
    picks for the mode, against the quantized reference within the bounds above."""
    monkeypatch.setitem(hopper.PINGPONG, qk, pingpong)
    q, k, v = qkv(1, 3, s, s, d, torch.bfloat16, "cuda")
    for nc in (2, 3) if d == 64 else (2,):
        out = fp8._attention_fp8(q, k, v, d**-0.5, qk, "fp8", n_consumers=nc)
        assert rel_err(out, reference.attention_fp8(q, k, v, qk=qk)) <= compiled_bound(qk, "fp8", q.dtype)


@gpu
@poisoned
@pytest.mark.parametrize("kernel", ["wgmma"], indirect=True)
def test_gpu_hopper_kernel_takes_the_layouts_diffusers_passes(kernel):
    """Heads inner ([B, S, H, D] transposed, diffusers' layout) and heads outer (contiguous [B, H, S, D]),
    fewer queries than keys: the output in q's layout, against the quantized reference."""
    q, k, v = qkv(2, 5, 300, 1100, 128, torch.float16, "cuda")
    for args in ((q, k, v), tuple(t.contiguous() for t in (q, k, v))):
        assert fp8.kernel_choice(args[0], qk="fp8", pv="fp8") == kernel
        out = attention_fp8(*args, qk="fp8")
        assert out.stride() == args[0].stride()
        assert rel_err(out, reference.attention_fp8(*args, qk="fp8")) <= compiled_bound("fp8", "fp8", q.dtype)


@gpu
def test_gpu_compiles_with_the_hook():
    """torch.compile(fullgraph=True) over the patched attention call with precision="fp8"."""
    q, k, v = qkv(2, 10, 4096, 4096, 64, torch.bfloat16, "cuda")
    fn = torch.compile(lambda q, k, v: custom_ops.attention(q, k, v, precision="fp8"), fullgraph=True)
    out = fn(q, k, v)
    torch.testing.assert_close(out, attention_fp8(q, k, v), rtol=0, atol=0)
