"""qk_norm_rope (FLUX's attention inputs: q/k RMSNorm, the rotary embedding, the text + image join, in one
launch per stream) against float64: head dims of FLUX (128), the tiny config (24) and odd ones (64, 80),
token counts off powers of two, B > 1, every dtype, projections as slices of one fused to_qkv output, with
and without the norm's weight, the norm, the rotation, the text stream. The reference is stock's ops (bits
of torch.nn.RMSNorm, torch.cat and diffusers' apply_rotary_emb). CPU: the interpreter; GPU (-m gpu):
FLUX.1-dev's shapes."""

import importlib

import pytest
import torch
from diffusers.models.embeddings import apply_rotary_emb

from sd_kernels import reference
from sd_kernels.ops import custom_ops, qk_norm_rope, qk_norm_rope_kv
from sd_kernels.runtime import dispatch
from sd_kernels.testing import assert_close_to_reference, non_contiguous, poison_

rope_ops = importlib.import_module("sd_kernels.ops.rope")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _rotary(tokens: int, head_dim: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """FLUX's form: fp32 [S, D], each angle repeated for its pair (repeat_interleave), here random angles."""
    angles = (torch.rand(tokens, head_dim // 2, generator=g) * 6.3).repeat_interleave(2, dim=1)
    return angles.cos(), angles.sin()


def make_args(b=2, s_text=3, s=5, heads=2, head_dim=24, dtype=torch.float32, *, text=True, norm="weight",
              rope=True, fused=True, device="cpu", seed=0) -> tuple:
    """qk_norm_rope's arguments as FLUX's processor passes them: q, k, v [B, S, H·D] (``fused``: chunks of
    one [B, S, 3·H·D] to_qkv output, strided), the text stream's alike, weights near 1 as trained."""
    g = torch.Generator().manual_seed(seed)
    n = heads * head_dim

    def stream(tokens):
        if fused:
            return torch.randn(b, tokens, 3 * n, generator=g).to(device, dtype).chunk(3, dim=-1)
        return tuple(torch.randn(b, tokens, n, generator=g).to(device, dtype) for _ in range(3))

    def weight():
        return (1 + 0.2 * torch.randn(head_dim, generator=g)).to(device, dtype) if norm == "weight" else None

    q, k, v = stream(s)
    eq, ek, ev = stream(s_text) if text else (None, None, None)
    weights = [weight() for _ in range(4)]
    eps = None if norm is None else 1e-6
    cos, sin = (t.to(device) for t in _rotary(s + (s_text if text else 0), head_dim, g)) if rope else (None, None)
    return (q, k, v, head_dim, weights[0], weights[1], eps, cos, sin, eq, ek, ev,
            *(weights[2:] if text else (None, None)))


def _float64(args):
    return tuple(a.double() if isinstance(a, torch.Tensor) else a for a in args)


def check_against_float64(args, ours=None):
    """qk_norm_rope's outputs (or ``ours``, another op's of the same args) against stock's and float64's."""
    ours = qk_norm_rope(*args) if ours is None else ours
    stock = reference.qk_norm_rope(*args)
    ref64 = reference.qk_norm_rope(*_float64(args))
    for name, o, st, r in zip(("query", "key"), ours, stock, ref64):
        assert o.is_contiguous(), name
        assert_close_to_reference(o, st, r)
    assert torch.equal(ours[2], stock[2])  # the values are copied, not computed
    return ours


CASES = {  # (text stream, norm, rotation, fused projections)
    "flux-double": dict(text=True, norm="weight", rope=True, fused=True),
    "flux-single": dict(text=False, norm="weight", rope=True, fused=False),
    "no-weight": dict(text=True, norm="plain", rope=True, fused=False),
    "no-norm": dict(text=True, norm=None, rope=True, fused=True),
    "no-rope": dict(text=True, norm="weight", rope=False, fused=False),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("head_dim", [24, 80])
def test_against_float64(dtype, case, head_dim, device):
    check_against_float64(make_args(head_dim=head_dim, dtype=dtype, device=device, **CASES[case]))


@pytest.mark.parametrize("head_dim", [64, 128])
def test_power_of_two_head_dims_batch_three(head_dim, device):
    check_against_float64(make_args(b=3, s_text=4, s=7, heads=3, head_dim=head_dim, dtype=torch.bfloat16,
                                    device=device))


def test_element_strided_projections_and_an_empty_stream(device):
    """Projections whose elements are not adjacent (every other of a doubled last dim) are read through their
    stride; an image stream of no tokens leaves the text stream's rows alone."""
    args = list(make_args(fused=False, device=device))
    args[:3] = [non_contiguous(t) for t in args[:3]]
    check_against_float64(tuple(args))
    empty = list(make_args(s=0, device=device))
    assert empty[0].shape[1] == 0
    query, _, value = check_against_float64(tuple(empty))
    assert query.shape == value.shape == (2, 3, 2, 24)


def test_every_output_element_is_written_and_the_streams_land_in_order(monkeypatch, device):
    """Outputs start as NaN: both launches (text at offset 0, image after it) cover their rows; and the text
    rows are the text stream's (a kernel with the streams swapped would be far off, not NaN)."""
    alloc = rope_ops._alloc
    monkeypatch.setattr(rope_ops, "_alloc", lambda *a: poison_(alloc(*a)))
    args = make_args(s_text=4, s=6, heads=3, head_dim=24, device=device)
    query, key, value = check_against_float64(args)
    assert not any(t.isnan().any() for t in (query, key, value))
    v, ev = args[2], args[11]
    assert torch.equal(value[:, :4].flatten(2), ev) and torch.equal(value[:, 4:].flatten(2), v)


def test_single_stream_values_are_the_projection_view(device):
    """Without a text stream the values need no join: v's [B, S, H, D] view, as diffusers' unflatten, no copy."""
    args = make_args(text=False, device=device)
    _, _, value = qk_norm_rope(*args)
    assert value.data_ptr() == args[2].data_ptr() and torch.equal(value.flatten(2), args[2])


def test_blocks():
    """Small programs on the GPU (8 rows of FLUX's 128, 2 warps: several resident on an SM); under the
    interpreter, whose cost is per program, larger ones."""
    rope = importlib.import_module("sd_kernels.ops.rope")
    assert rope.blocks(128) == (8, 128, 2)
    assert rope.blocks(64) == (16, 64, 2)
    assert rope.blocks(3) == (256, 4, 2)
    assert rope.blocks(128, rope._INTERPRETED_ELEMS) == (32, 128, 8)


def test_reference_is_stock_bit_for_bit():
    """reference.qk_norm_rope is diffusers' processor lines: torch.nn.RMSNorm per stream, torch.cat text first,
    apply_rotary_emb(sequence_dim=1); equal bits at bfloat16."""
    q, k, v, d, wq, wk, eps, cos, sin, eq, ek, ev, ewq, ewk = make_args(dtype=torch.bfloat16)

    def norm(x, w):
        m = torch.nn.RMSNorm(d, eps=eps, dtype=torch.bfloat16)
        m.weight.data.copy_(w)
        return m(x.unflatten(-1, (-1, d)))

    with torch.no_grad():
        query = apply_rotary_emb(torch.cat([norm(eq, ewq), norm(q, wq)], 1), (cos, sin), sequence_dim=1)
        key = apply_rotary_emb(torch.cat([norm(ek, ewk), norm(k, wk)], 1), (cos, sin), sequence_dim=1)
    value = torch.cat([ev.unflatten(-1, (-1, d)), v.unflatten(-1, (-1, d))], 1)
    ours = reference.qk_norm_rope(q, k, v, d, wq, wk, eps, cos, sin, eq, ek, ev, ewq, ewk)
    for o, want in zip(ours, (query, key, value)):
        assert torch.equal(o, want)


@pytest.mark.parametrize("backend", ["auto", "reference"])
@pytest.mark.parametrize("case", ["flux-double", "flux-single"])
def test_keys_and_values_side_by_side_are_qk_norm_ropes(case, backend, monkeypatch, device):
    """qk_norm_rope_kv (the ring exchange's one buffer): query and kv[:, :, 0] / kv[:, :, 1] equal to the bit
    qk_norm_rope's query, key and value, every element of the poisoned buffer written (the single stream's
    values copied in too), kv [B, S, 2, H, D] contiguous; the custom-op wrapper the same; written into a given
    buffer alike, a buffer of another shape or layout a clear error."""
    monkeypatch.setenv("SD_KERNELS_BACKEND", backend)
    alloc = rope_ops._alloc
    monkeypatch.setattr(rope_ops, "_alloc", lambda *a: poison_(alloc(*a)))
    args = make_args(b=2, s_text=4, s=6, heads=3, head_dim=24, dtype=torch.bfloat16, device=device, **CASES[case])
    query, kv = qk_norm_rope_kv(*args)
    assert kv.shape == (2, 10 if case == "flux-double" else 6, 2, 3, 24) and kv.is_contiguous()
    assert not kv.isnan().any()
    for got, want in zip((query, kv[:, :, 0], kv[:, :, 1]), qk_norm_rope(*args)):
        assert torch.equal(got, want)
    wrapped = custom_ops.qk_norm_rope_kv(*args)
    assert torch.equal(wrapped[0], query) and torch.equal(wrapped[1], kv)
    # into a given buffer (the exchange's slice of its symmetric buffer): that buffer returned, the same bits
    into = poison_(torch.empty_like(kv))
    given = custom_ops.qk_norm_rope_kv(*args, kv_out=into)
    assert given[1] is into and torch.equal(given[0], query) and torch.equal(into, kv)
    strided = torch.empty(kv.shape[::-1], dtype=kv.dtype, device=kv.device).permute(4, 3, 2, 1, 0)
    for bad in (strided, torch.empty_like(kv)[:1], torch.empty_like(kv, dtype=torch.float32)):  # layout, shape, dtype
        with pytest.raises(ValueError, match="kv_out must be a contiguous"):
            qk_norm_rope_kv(*args, kv_out=bad)


@pytest.mark.parametrize("case", ["flux-double", "flux-single"])
def test_fp8_statistics_are_those_of_the_keys_and_values_written(case, device):
    """qk_norm_rope_fp8: query and key as close to float64 as qk_norm_rope's are (compiled, its loop may contract
    another product into an FMA: not always the same bits), the value the same; its K/V partials, over chunks of
    each stream (a text stream of 77 tokens: chunks that do not divide it), sum to the key's per-channel sums
    and max to the value's per-channel max |v|; the FP8 pre-pass given them writes what its own statistics
    pass gives (K's codes within one, where the fp32 mean sums in another order), and refuses them once the
    key changed in place or for another key."""
    fp8_ops = importlib.import_module("sd_kernels.ops.attention_fp8")
    args = make_args(b=2, s_text=77, s=200, heads=2, head_dim=64, dtype=torch.bfloat16, device=device, **CASES[case])
    *outputs, stats = rope_ops.qk_norm_rope_fp8(*args)
    query, key, value = check_against_float64(args, outputs)
    chunk = rope_ops.stats_chunk(200, 77)
    tokens = 277 if case != "flux-single" else 200
    chunks = -(-200 // chunk) + (-(-77 // chunk) if case != "flux-single" else 0)
    assert stats.k_sum.shape == stats.v_max.shape == (4, chunks, 64) and chunks > 1
    k4, v4 = key.transpose(1, 2), value.transpose(1, 2)
    want_sum = k4.double().sum(2).flatten(0, 1)
    torch.testing.assert_close(stats.k_sum.double().sum(1), want_sum, rtol=0, atol=1e-5 * tokens)
    assert torch.equal(stats.v_max.amax(1), v4.float().abs().amax(2).flatten(0, 1))
    assert stats.serves(k4, v4)
    own = fp8_ops.quantize_kv(k4, v4, "fp8", "fp8")
    given = fp8_ops.quantize_kv(k4, v4, "fp8", "fp8", stats=stats)
    assert (own[0].float() - given[0].float()).abs().max() <= 2 ** -6 * 448  # e4m3's widest step at its max
    assert all(torch.equal(a, b) for a, b in zip(own[1:], given[1:]))
    before = dict(dispatch.fallbacks())
    assert not stats.serves(k4[:1], v4[:1])
    key.mul_(2)  # a change in place: the statistics no longer serve, the pass runs
    assert not stats.serves(k4, v4)
    again = fp8_ops.quantize_kv(k4, v4, "fp8", "fp8", stats=stats)
    fresh = fp8_ops.quantize_kv(k4, v4, "fp8", "fp8")
    assert all(torch.equal(a, b) for a, b in zip(again, fresh))
    assert sum(dispatch.fallbacks().values()) == sum(before.values()) + 1


@pytest.mark.parametrize("case", ["flux-double", "flux-single"])
def test_fp8_statistics_of_inference_tensors_are_none_and_never_serve(case, device):
    """Under ``torch.inference_mode()`` qk_norm_rope_fp8 writes what qk_norm_rope writes (the kernel without the
    statistics) and hands over no statistics: inference tensors keep no version counter, so a change made to them in
    place could not be told (the attention runs its own statistics pass). Statistics made of inference tensors some
    other way never serve."""
    fp8_ops = importlib.import_module("sd_kernels.ops.attention_fp8")
    args = make_args(b=1, s_text=77, s=200, heads=2, head_dim=64, dtype=torch.bfloat16, device=device, **CASES[case])
    want = rope_ops.qk_norm_rope(*args)
    with torch.inference_mode():
        *got, stats = rope_ops.qk_norm_rope_fp8(*args)
        assert stats is None and got[1].is_inference()
        k4, v4 = got[1].transpose(1, 2), got[2].transpose(1, 2)
        chunks = [torch.zeros(2, 1, 64, device=device)] * 2
        made = fp8_ops.KvStats.of(got[1], got[2], *chunks)
        assert not made.serves(k4, v4)
        own = fp8_ops.quantize_kv(k4, v4, "fp8", "fp8")
        assert all(torch.equal(a, b) for a, b in zip(own, fp8_ops.quantize_kv(k4, v4, "fp8", "fp8", stats=made)))
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_fp8_statistics_off_the_kernels_ground_are_none(device):
    """Where the kernel does not run (float64), qk_norm_rope_fp8 is the reference's three tensors and no
    statistics (the attention's pre-pass computes its own)."""
    args = _float64(make_args(device=device))
    *outputs, stats = rope_ops.qk_norm_rope_fp8(*args)
    assert stats is None
    for got, want in zip(outputs, reference.qk_norm_rope(*args)):
        assert torch.equal(got, want)


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # torch: its unfused path
def test_calls_off_the_kernels_ground_run_the_reference(device):
    """Float64, and norm weights of another dtype than the activations (stock's ops decide the result's
    dtype): the reference, counted as a fallback; the results are stock's."""
    for args in (_float64(make_args(device=device)),
                 tuple(a.float() if i == 4 else a for i, a in enumerate(make_args(dtype=torch.bfloat16,
                                                                                  device=device)))):
        dispatch.reset_fallbacks()
        got = qk_norm_rope(*args)
        assert any(op == "qk_norm_rope" for op, _ in dispatch.fallbacks())
        for g, want in zip(got, reference.qk_norm_rope(*args)):
            assert torch.equal(g, want)


def test_bad_arguments_raise_before_any_work(device):
    args = list(make_args(device=device))
    bad = {
        "of one shape": {1: args[1][:, :4]},
        "does not divide": {3: 7},
        "all of eq, ek, ev": {11: None},
        "q_weight must be": {4: args[4][:5]},
        "both cos and sin": {8: None},
        "cos and sin must be": {7: args[7][:-1]},
    }
    for message, change in bad.items():
        call = [change.get(i, a) for i, a in enumerate(args)]
        with pytest.raises(ValueError, match=message):
            qk_norm_rope(*call)
    with pytest.raises(ValueError, match="even head dim"):
        qk_norm_rope(*make_args(head_dim=5, device=device))
    no_norm = list(make_args(norm=None, device=device))
    no_norm[4] = args[4]
    with pytest.raises(ValueError, match="with a norm"):
        qk_norm_rope(*no_norm)


@pytest.mark.parametrize("text", [True, False])
@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_custom_op_agrees_with_its_fake(text, backend, monkeypatch):
    """torch.ops.sd_kernels.qk_norm_rope: schema and fake (opcheck), the fake's layouts and count of outputs
    (the values only with a text stream) those of the kernel and of the reference."""
    monkeypatch.setenv("SD_KERNELS_BACKEND", backend)
    args = make_args(text=text, fused=True)
    op = torch.ops.sd_kernels.qk_norm_rope.default
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
    real = op(*args)
    with torch._subclasses.FakeTensorMode() as mode:
        fake = op(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
    assert len(real) == len(fake) == (3 if text else 2)
    for f, r in zip(fake, real):
        assert (f.shape, f.stride(), f.dtype) == (r.shape, r.stride(), r.dtype)
    for got, want in zip(custom_ops.qk_norm_rope(*args), qk_norm_rope(*args)):
        assert torch.equal(got, want)


def test_custom_op_outputs_never_alias_its_inputs(monkeypatch):
    """No norm and no rotation: the reference's query is a view of q; the op returns a copy."""
    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    args = make_args(text=False, norm=None, rope=False, fused=False)
    query, key = torch.ops.sd_kernels.qk_norm_rope(*args)
    assert query.data_ptr() != args[0].data_ptr() and torch.equal(query.flatten(2), args[0])


@pytest.mark.gpu
@pytest.mark.parametrize("s", [4096, 3072])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_flux_dev_shapes(s, dtype):
    """FLUX.1-dev at 1024² (4096 image tokens) and 1024×768 (3072): 24 heads of 128, 512 text tokens, fused
    projections; and the single-stream blocks' one stream of 512 + S tokens."""
    check_against_float64(make_args(b=1, s_text=512, s=s, heads=24, head_dim=128, dtype=dtype, device="cuda"))
    check_against_float64(make_args(b=1, s_text=0, s=512 + s, heads=24, head_dim=128, dtype=dtype, text=False,
                                    fused=False, device="cuda"))
