"""The FP8 (E4M3) row-scaled linear: the quantizer, the GEMM with its epilogue, the LayerNorm's FP8
output. Exactness against a float64 reference of the quantized math; the quantization's own error
against fp32 beside torch's e4m3 round trip. Tiny shapes: the CPU runs them through the interpreter."""

import importlib
import math

import pytest
import torch
import torch.nn.functional as F

from sd_kernels import reference
from sd_kernels.ops.residual import gated_add_into
from sd_kernels.testing import UNIT_ROUNDOFF, non_contiguous, rel_err

fp8 = importlib.import_module("sd_kernels.ops.fp8_linear")
fq = importlib.import_module("sd_kernels.ops.fp8_quant")
layer_norm = importlib.import_module("sd_kernels.ops.layer_norm")
importlib.import_module("sd_kernels.ops.custom_ops")  # registers torch.ops.sd_kernels.*
E4M3 = torch.float8_e4m3fn


def _codes(q):
    return q.float()


def _accumulation_floor(k: int) -> float:
    """The relative error the FP8 tensor cores' accumulation (a few mantissa bits short of fp32: see
    ``_fp32_floor``) may add over K products: 2⁻¹² at up to 64, growing as √K beyond (the partial sums'
    rounding errors add like a random walk). Measured on an H200: 7.2e-5 at K ≤ 80 (fp32 output), about
    1.0e-3 at K = 6,144 (fp16 output, its rounding 2.1e-4 included)."""
    return 2.0**-12 * math.sqrt(max(1.0, k / 64))


def _fp32_floor(device) -> float:
    """The least relative error an fp32 output of the GEMM is held to: fp32's rounding on the CPU; on a
    GPU, the FP8 tensor cores' accumulation, which adds the products into fewer mantissa bits than
    fp32 has (about 14 on Hopper: DeepSeek-V3 technical report, section 3.3.2). cuBLASLt's
    ``torch._scaled_mm(..., use_fast_accum=True)`` accumulates the same way; the error is ~1e-4 of the
    output at the small K of these tests (it grows with K: ``_accumulation_floor``), far under the e4m3
    codes' own (~3e-2)."""
    return 8 * UNIT_ROUNDOFF[torch.float32] if device == "cpu" else 2.0**-12


@pytest.mark.parametrize("shape", [(77, 50), (2, 5, 33)])
def test_quantize_rows_matches_the_reference_exactly(device, shape):
    x = torch.randn(shape, device=device) * torch.rand(shape[:-1] + (1,), device=device) * 10
    q, s = fp8.quantize_rows(x)
    q_ref, s_ref = reference.fp8_quantize_rows(x)
    assert q.dtype == E4M3 and q.shape == x.shape and s.shape == x.shape[:-1]
    assert torch.equal(_codes(q), _codes(q_ref)) and torch.equal(s, s_ref)


@pytest.mark.parametrize("n_prefix,n_x,pieces", [
    (0, 12288, ((8192, 4096, 0, 0), 0)),  # FLUX's feed-forward: no lane padded
    (3072, 12288, ((2048, 1024, 8192, 4096), 2)),  # FLUX's single blocks' join
    (0, 15360, ((8192, 8192, 0, 0), 0)),  # one part's rest padded: 1,024 lanes masked
    (24, 40, ((16, 8, 32, 8), 2)), (1, 3, ((1, 2, 1, 0), 1)), (24, 0, ((16, 8, 0, 0), 2)), (0, 0, ((0, 0, 0, 0), 0)),
])
def test_row_pieces(n_prefix, n_x, pieces):
    assert fq.row_pieces(n_prefix, n_x) == pieces


def test_quantize_blocks():
    """A row that fits one program is held whole (BLOCK_C 0: as pieces), narrow rows batched up to 2,048
    (padded) elements, a warp per 2,048, 2 to 4 (FLUX's GELU rows faster on 4 than on 8); a wider row is read
    in chunks, 8 warps."""
    assert fq.quantize_blocks(4608, 3072) == (1, 0, 2)  # FLUX's attention output
    assert fq.quantize_blocks(4096, 12288) == (1, 0, 4)  # FLUX's feed-forward (GELU)
    assert fq.quantize_blocks(4608, 15360) == (1, 0, 4)  # FLUX's single blocks' join
    assert fq.quantize_blocks(8192, 6144) == (1, 0, 4)  # SD3's
    assert fq.quantize_blocks(8192, 1536) == (1, 0, 2)
    assert fq.quantize_blocks(77, 50) == (32, 0, 2)
    assert fq.quantize_blocks(3, 50) == (4, 0, 2)
    assert fq.quantize_blocks(16, 40000) == (1, 16384, 8)
    assert fq.quantize_blocks(77, 50, batch=fq._INTERPRETED_ROW_ELEMS) == (128, 0, 4)  # the interpreter's


@pytest.mark.parametrize("p_cols,x_cols,act,gated", [
    (16, 40, "", False), (24, 32, "tanh", False), (0, 50, "tanh", False), (40, 0, "", False), (3, 5, "", False),
    (19, 8, "", False),  # the prefix's rest padded (16 + 4 holding 3), x after it
    (17, 50, "", False),  # both parts' rests padded: 16 + 1, 32 + 32 holding 18
    (3, 24, "tanh", True), (0, 20, "none", True),  # GEGLU: the gate n_x columns after a, with a prefix and without
])
def test_quantize_pieces_of_every_layout(device, p_cols, x_cols, act, gated):
    """The row held as one, two, three or four pieces, the prefix's and x's (a masked rest or none): the
    reference's codes and scales, rows batched several to a program. Some rows' largest values sit in the
    last column of the prefix, and the next rows' in the first of each part, so that a piece that misses its
    part's end, or reads past it into the next row, moves a scale."""
    x = torch.randn(37, x_cols * (2 if gated else 1), device=device) * 3
    if x_cols:
        x[1::4, 0] = 500.0
    prefix = torch.randn(37, p_cols, device=device) if p_cols else None
    if prefix is not None:
        prefix[::4, -1] = 200.0
        prefix[1::4, 0] = 300.0
    q, s = fp8.quantize_rows(x, act, gated, prefix=prefix)
    q_ref, s_ref = reference.fp8_quantize_rows(x, act, gated, prefix=prefix)
    assert q.shape == (37, p_cols + x_cols) and torch.allclose(s, s_ref, rtol=1e-6, atol=0)
    if act:  # the GELU's last bit moves a code now and then
        assert (_codes(q) == _codes(q_ref)).float().mean() > 0.99
    else:
        assert torch.equal(_codes(q), _codes(q_ref)) and torch.equal(s, s_ref)


def _read_in_chunks(monkeypatch, chunk: int | None) -> None:
    """Rows wider than ``chunk`` columns read in chunks, in two passes (the maximum, then the codes): the
    path of rows wider than one program holds (None: the rule as shipped)."""
    if chunk:
        blocks = fq.quantize_blocks
        monkeypatch.setattr(fq, "quantize_blocks", lambda r, c, **kw: blocks(r, c, chunk, **kw))


def test_quantize_rows_non_contiguous_and_wide_rows(device, monkeypatch):
    """Rows wider than one chunk take the two-pass loop; a strided input is read in place."""
    _read_in_chunks(monkeypatch, 16)
    x = non_contiguous(torch.randn(9, 40, device=device))
    q, s = fp8.quantize_rows(x)
    q_ref, s_ref = reference.fp8_quantize_rows(x)
    assert torch.equal(_codes(q), _codes(q_ref)) and torch.equal(s, s_ref)


def test_a_zero_row_gets_scale_zero(device):
    x = torch.randn(3, 16, device=device)
    x[1] = 0
    q, s = fp8.quantize_rows(x)
    assert s[1] == 0 and not _codes(q[1]).any() and torch.isfinite(_codes(q)).all()


@pytest.mark.parametrize("act,chunk", [("", None), ("tanh", None), ("tanh", 16)])
def test_quantize_with_a_prefix(device, act, chunk, monkeypatch):
    """``prefix``: the concatenation [prefix, act(x)] quantized without being written: FLUX's single
    blocks' attention output beside their MLP's GELU. The row max may lie in either part; a chunk of
    16 columns makes the two-pass loop cross the seam (a strided prefix, read in place)."""
    _read_in_chunks(monkeypatch, chunk)
    x = torch.randn(2, 9, 40, device=device)
    prefix = non_contiguous(torch.randn(2, 9, 24, device=device))
    prefix[0, :4] *= 20  # these rows' max in the prefix
    q, s = fp8.quantize_rows(x, act, prefix=prefix)
    q_ref, s_ref = reference.fp8_quantize_rows(x, act, prefix=prefix)
    q_cat, s_cat = reference.fp8_quantize_rows(torch.cat([prefix, F.gelu(x, approximate=act) if act else x], -1))
    assert q.shape == (2, 9, 64) and torch.equal(s_ref, s_cat) and torch.equal(_codes(q_ref), _codes(q_cat))
    assert torch.allclose(s, s_ref, rtol=1e-6, atol=0)
    assert (_codes(q) == _codes(q_ref)).float().mean() > 0.99  # the GELU's last bit, as below
    same = s == s_ref  # rows whose scale the GELU's rounding did not move: the prefix's codes exact
    assert same.any() and torch.equal(_codes(q[..., :24])[same], _codes(q_ref[..., :24])[same])


@pytest.mark.parametrize("x_cols,p_cols", [(40, 0), (0, 24), (0, 0)])
def test_quantize_with_an_empty_part(device, x_cols, p_cols):
    """An empty prefix (or nothing after it): the quantization of what there is, as the reference's."""
    x, prefix = torch.randn(2, 3, x_cols, device=device), torch.randn(2, 3, p_cols, device=device)
    q, s = fp8.quantize_rows(x, "tanh", prefix=prefix)
    q_ref, s_ref = reference.fp8_quantize_rows(x, "tanh", prefix=prefix)
    assert q.shape == (2, 3, x_cols + p_cols) and torch.allclose(s, s_ref, rtol=1e-6, atol=0)
    assert (_codes(q) == _codes(q_ref)).float().mean() > 0.99 if q.numel() else not s.any()


@pytest.mark.parametrize("x_shape,p_shape", [((3, 8), (2, 8)), ((8,), ())])
def test_quantize_refuses_a_prefix_of_other_rows(device, x_shape, p_shape):
    with pytest.raises(ValueError, match="prefix"):
        fp8.quantize_rows(torch.randn(x_shape, device=device), prefix=torch.randn(p_shape, device=device))


@pytest.mark.parametrize("act,gated", [("tanh", False), ("none", True), ("tanh", True)])
def test_quantize_with_activation(device, act, gated):
    """GELU (GEGLU) then the quantization, in one kernel: the codes of the reference up to the last
    bit where the kernel's GELU differs from torch's by an fp32 rounding."""
    x = torch.randn(21, 48, device=device) * 3
    q, s = fp8.quantize_rows(x, act, gated)
    q_ref, s_ref = reference.fp8_quantize_rows(x, act, gated)
    assert q.shape == q_ref.shape
    assert torch.allclose(s, s_ref, rtol=1e-6, atol=0)
    assert (_codes(q) == _codes(q_ref)).float().mean() > 0.99
    ours, ref = _codes(q) * s[:, None], _codes(q_ref) * s_ref[:, None]
    assert torch.allclose(ours, ref, rtol=2**-3, atol=1e-6)  # one e4m3 step at most


def test_the_quantizers_erf_gelu_polynomial_gives_erffs_codes(device, monkeypatch):
    """The quantizer's erf GELU from Abramowitz & Stegun's polynomial (``GELU_ERF_POLY``): the scales of libdevice
    erff's GELU to fp32 rounding, and its codes but for the few products sitting at a rounding boundary."""
    x = torch.randn(64, 1024, device=device) * 3
    q, s = fp8.quantize_rows(x, "none", True)
    monkeypatch.setattr(fq, "GELU_ERF_POLY", False)
    q_erff, s_erff = fp8.quantize_rows(x, "none", True)
    assert torch.allclose(s, s_erff, rtol=1e-6, atol=0)
    assert (_codes(q) == _codes(q_erff)).float().mean() > 0.999
    assert not (torch.equal(s, s_erff) and torch.equal(_codes(q), _codes(q_erff)))  # two GELUs ran, not one twice


def _operands(device, m=77, k=50, n=37, batch=7):
    x = torch.randn(m, k, device=device)
    w = torch.randn(n, k, device=device) / k**0.5
    a_q, s_a = reference.fp8_quantize_rows(x)
    w_q, s_w = fp8.quantize_weight(w)
    extras = dict(bias=torch.randn(n, device=device), gate=torch.randn(batch, n, device=device),
                  residual=torch.randn(m, n, device=device))
    return x, w, a_q, s_a, w_q, s_w, extras


EPILOGUES = [{}, {"bias"}, {"bias", "act"}, {"gate"}, {"residual"}, {"bias", "gate", "residual"},
             {"bias", "act", "gate", "residual"}]


@pytest.mark.parametrize("epilogue", EPILOGUES, ids=lambda e: "+".join(sorted(e)) or "plain")
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("k,kernel", [(50, "pointer"), (80, "tma")])
def test_gemm_is_the_quantized_math(device, epilogue, out_dtype, k, kernel, count_calls):
    """Odd shapes (M = 77, N = 37, K not a multiple of the block): the kernel's output against a float64
    evaluation of the same quantized math, within the output dtype's own rounding. K = 50 gives rows the
    Tensor Memory Accelerator cannot read (not 16-byte aligned): the pointer kernel; K = 80 the TMA
    kernel (on Hopper and under the interpreter), its K tail zero-filled by the TMA unit."""
    if kernel == "tma" and device == "cuda" and torch.cuda.get_device_capability() < fp8.TMA_CAPABILITY:
        kernel = "pointer"
    _, _, a_q, s_a, w_q, s_w, extras = _operands(device, k=k)
    kw = {k: v for k, v in extras.items() if k in epilogue}
    act = "tanh" if "act" in epilogue else ""
    launched = count_calls(fp8, tma="_GEMM_TMA", pointer="_GEMM")
    y = fp8.fp8_gemm(a_q, s_a, w_q, s_w, act=act, out_dtype=out_dtype, **kw)
    assert launched == {"tma": 0, "pointer": 0, kernel: 1}
    ref = reference.fp8_gemm(a_q, s_a, w_q, s_w, act=act, out_dtype=torch.float64, compute=torch.float64, **kw)
    assert y.dtype == out_dtype and y.shape == ref.shape
    rounding = rel_err(ref.to(out_dtype), ref)
    # The interpreter rounds fp32 to bf16 by truncation (twice nearest's error); the GPU to nearest.
    factor = 4 if out_dtype == torch.bfloat16 and device == "cpu" else 2
    assert rel_err(y, ref) <= max(factor * rounding, _fp32_floor(device)), (rel_err(y, ref), rounding)


def test_strided_scales_bias_and_operands_take_a_kernel_that_reads_them(device, count_calls):
    """Scales and a bias given as strided views, an expanded input (row stride 0) and a view whose rows
    start off the 16-byte grid: the result is the reference's; the last two go to the pointer kernel
    (the TMA kernel takes 16-byte-aligned rows that do not overlap)."""
    _, _, a_q, s_a, w_q, s_w, extras = _operands(device, k=64)
    wide_s = torch.stack([s_w, s_w], -1).flatten()  # s_w at stride 2
    wide_b = torch.stack([extras["bias"], extras["bias"]], -1).flatten()
    y = fp8.fp8_gemm(a_q, s_a, w_q, wide_s[::2], wide_b[::2], out_dtype=torch.float32)
    ref = reference.fp8_gemm(a_q, s_a, w_q, s_w, extras["bias"], out_dtype=torch.float64, compute=torch.float64)
    assert rel_err(y, ref) < _fp32_floor(device)
    launched = count_calls(fp8, tma="_GEMM_TMA", pointer="_GEMM")
    expanded, one_scale = a_q[:1].expand(5, -1), s_a[:1].expand(5)
    y = fp8.fp8_gemm(expanded, one_scale, w_q, s_w, out_dtype=torch.float32)
    ref = reference.fp8_gemm(expanded, one_scale, w_q, s_w, out_dtype=torch.float64, compute=torch.float64)
    assert rel_err(y, ref) < _fp32_floor(device)
    wider = torch.zeros(a_q.shape[0], 80, dtype=torch.float32, device=device)
    wider[:, 1:65] = a_q.float()
    offset = wider.to(fp8.E4M3)[:, 1:65]  # rows 80 bytes apart, starting one byte off the grid
    y = fp8.fp8_gemm(offset, s_a, w_q, s_w, out_dtype=torch.float32)
    ref = reference.fp8_gemm(a_q, s_a, w_q, s_w, out_dtype=torch.float64, compute=torch.float64)
    assert rel_err(y, ref) < _fp32_floor(device) and launched == {"tma": 0, "pointer": 2}


def test_gate_per_sample_of_3d_input(device):
    """A [B, T, K] input with a [B, 1, N] gate (a DiT block's gate_mlp.unsqueeze(1))."""
    x = torch.randn(2, 9, 32, device=device)
    w_q, s_w = fp8.quantize_weight(torch.randn(24, 32, device=device))
    gate = torch.randn(2, 1, 24, device=device)
    a_q, s_a = fp8.quantize_rows(x)
    y = fp8.fp8_gemm(a_q, s_a, w_q, s_w, gate=gate, out_dtype=torch.float32)
    ref = reference.fp8_gemm(a_q, s_a, w_q, s_w, gate=gate, out_dtype=torch.float64, compute=torch.float64)
    assert y.shape == (2, 9, 24) and rel_err(y, ref) < _fp32_floor(device)


def test_quantization_error_is_bounded_by_torchs_e4m3_round_trip(device):
    """fp8_linear against fp32's F.linear: no worse than 1.5x the error of rounding x and W through
    torch's e4m3 cast with one scale per tensor (row-wise scales can only fit the rows better)."""
    x, w, *_ = _operands(device)
    x[3] *= 50  # an outlier token: per-tensor scaling loses the other rows' precision to it
    w_q, s_w = fp8.quantize_weight(w)
    ours = fp8.fp8_linear(x, w_q, s_w)
    exact = F.linear(x.double(), w.double())

    def round_trip(t):
        scale = t.abs().max() / reference.E4M3_MAX
        return (t / scale).to(E4M3).double() * scale

    torch_error = rel_err(F.linear(round_trip(x), round_trip(w)), exact)
    assert rel_err(ours, exact) <= 1.5 * torch_error, (rel_err(ours, exact), torch_error)
    assert rel_err(ours, exact) < 0.05


def test_fp8_linear_non_contiguous_input_and_reuse(device, count_calls):
    """A strided input is quantized in place; a second projection of the same tensor reads the
    codes the first left on it; an in-place change drops them."""
    x = non_contiguous(torch.randn(2, 5, 32, device=device))
    w_q, s_w = fp8.quantize_weight(torch.randn(16, 32, device=device))
    seen = count_calls(fp8, quantize="quantize_rows")
    y1 = fp8.fp8_linear(x, w_q, s_w)
    y2 = fp8.fp8_linear(x, w_q, s_w)
    assert seen["quantize"] == 1 and torch.equal(y1, y2)
    ref = reference.fp8_gemm(*reference.fp8_quantize_rows(x), w_q, s_w, out_dtype=torch.float64,
                             compute=torch.float64)
    assert rel_err(y1, ref) < _fp32_floor(device)
    x.mul_(2)
    y3 = fp8.fp8_linear(x, w_q, s_w)
    assert seen["quantize"] == 2 and rel_err(y3, 2 * ref) < _fp32_floor(device)


def test_layer_norm_modulated_fp8(device):
    """The modulated LayerNorm's output and, from the same pass, its FP8 codes and row scales: those of
    the reference's quantization of the fp32 LayerNorm."""
    x = torch.randn(2, 9, 40, device=device)
    scale, shift = torch.randn(2, 40, device=device), torch.randn(2, 1, 40, device=device)
    y, q, s = layer_norm.layer_norm_modulated_fp8(x, None, None, 1e-6, scale, shift)
    y64 = reference.layer_norm_modulated(x.double(), None, None, 1e-6, scale.double(), shift.double())
    q_ref, s_ref = reference.fp8_quantize_rows(y64.float())
    assert rel_err(y, y64) < 1e-6 and q.shape == x.shape and s.shape == (2, 9)
    assert torch.allclose(s, s_ref, rtol=1e-6, atol=0)
    assert (_codes(q) == _codes(q_ref)).float().mean() > 0.99
    assert torch.allclose(_codes(q) * s[..., None], _codes(q_ref) * s_ref[..., None], rtol=2**-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gated_residual_layer_norm_fp8(device, dtype, monkeypatch):
    """A DiT block's norm2 before the FP8 tier's feed-forward: h = residual + gate · branch and its modulated
    LayerNorm, as the lossless op makes them (the same kernel), with the codes and row scales of the reference's
    quantization of the fp32 LayerNorm of h in the same pass; the reference path (no kernel, stock's h) the same
    of its h. (In bf16
    the interpreter normalizes h before its truncation to bf16, which only the store makes: the scales agree
    to bf16's step there, to fp32's on the GPU.)"""
    rtol = 2**-7 if dtype == torch.bfloat16 and fp8.interpreting() else 1e-6
    g = torch.Generator().manual_seed(3)
    residual, branch = (non_contiguous(torch.randn(2, 9, 40, generator=g)).to(device, dtype) for _ in range(2))
    gate, scale, shift = (torch.randn(2, 1, 40, generator=g).to(device, dtype) for _ in range(3))
    h, y, q, s = layer_norm.gated_residual_layer_norm_fp8(residual, branch, gate, None, None, 1e-6, scale, shift)
    h_ref, y_ref = layer_norm.gated_residual_layer_norm(residual, branch, gate, None, None, 1e-6, scale, shift)
    assert torch.equal(h, h_ref) and torch.equal(y, y_ref)
    q_ref, s_ref = reference.fp8_quantize_rows(reference.layer_norm_modulated(
        h.float(), None, None, 1e-6, scale.float(), shift.float()))
    assert q.shape == h.shape and q.dtype == E4M3 and s.shape == (2, 9)
    assert torch.allclose(s, s_ref, rtol=rtol, atol=0)
    assert (_codes(q) == _codes(q_ref)).float().mean() > (0.9 if rtol > 1e-6 else 0.99)
    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    h2, y2, q2, s2 = layer_norm.gated_residual_layer_norm_fp8(residual, branch, gate, None, None, 1e-6, scale, shift)
    assert torch.equal(h2, reference.gated_residual(residual, branch, gate))
    y32 = reference.layer_norm_modulated(h2.float(), None, None, 1e-6, scale.float(), shift.float())
    assert y2.dtype == dtype and torch.equal(y2, y32.to(dtype))  # the normed rows, rounded once
    q_ref2, s_ref2 = reference.fp8_quantize_rows(y32)
    assert torch.equal(s2, s_ref2) and torch.equal(_codes(q2), _codes(q_ref2))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(2, 4096, 320), (2, 4096, 640), (2, 1024, 1280), (2, 4096, 1152), (2, 4429, 1536),
                                   (1, 4608, 3072)])
def test_gpu_gated_residual_layer_norm_fp8_at_model_widths(shape):
    """Compiled, at the widths the FP8 tier's norms run (SD1.5's 320, SDXL's 640 and 1,280, PixArt-Σ's 1,152, SD3's
    1,536, FLUX's 3,072), each in the program shape ``layer_norm.QUANT_BLOCKS`` gives it: h as the lossless kernel
    makes it; the values within twice the lossless kernel's error against float64 (another program shape sums the
    row's statistics in another order); the row scales those of the reference's quantization of the float64
    LayerNorm of h, to fp32's rounding; at least 99% of the codes equal to the reference's and the rest one code
    apart."""
    g = torch.Generator(device="cuda").manual_seed(0)
    residual, branch = (torch.randn(*shape, device="cuda", dtype=torch.float16, generator=g) for _ in range(2))
    w, b = (torch.randn(shape[-1], device="cuda", dtype=torch.float16, generator=g) for _ in range(2))
    h, y, q, s = layer_norm.gated_residual_layer_norm_fp8(residual, branch, None, w, b, 1e-5)
    h_ref, y_ref = layer_norm.gated_residual_layer_norm(residual, branch, None, w, b, 1e-5)
    y64 = reference.layer_norm_modulated(h.double(), w.double(), b.double(), 1e-5)
    assert torch.equal(h, h_ref) and rel_err(y, y64) < 2 * rel_err(y_ref, y64)
    q_ref, s_ref = reference.fp8_quantize_rows(y64.float())
    assert torch.allclose(s, s_ref, rtol=1e-5, atol=0)
    assert (_codes(q) == _codes(q_ref)).float().mean() > 0.99
    got, want = _codes(q) * s[..., None], _codes(q_ref) * s_ref[..., None]  # one code apart: an e4m3 step
    assert ((got - want).abs() <= 2**-3 * want.abs() + 2**-9 * s_ref[..., None]).all()


def test_bad_inputs_raise_before_work(device):
    _, _, a_q, s_a, w_q, s_w, _ = _operands(device)
    with pytest.raises(ValueError, match="act must be one of"):
        fp8.quantize_rows(torch.randn(2, 4, device=device), act="relu")
    with pytest.raises(ValueError, match="even last dimension"):
        fp8.quantize_rows(torch.randn(2, 5, device=device), gated=True)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        fp8.fp8_gemm(a_q.float(), s_a, w_q, s_w)
    with pytest.raises(ValueError, match="do not match"):
        fp8.fp8_gemm(a_q[:, :40], s_a, w_q, s_w)
    with pytest.raises(ValueError, match="gate must be"):
        fp8.fp8_gemm(a_q, s_a, w_q, s_w, gate=torch.randn(5, w_q.shape[0], device=device))
    with pytest.raises(ValueError, match="residual"):
        fp8.fp8_gemm(a_q, s_a, w_q, s_w, residual=torch.randn(3, 3, device=device))
    with pytest.raises(RuntimeError, match="expected"):
        fp8.fp8_linear(torch.randn(3, 7, device=device), w_q, s_w)


def test_reference_backend_computes_the_same_quantized_math(device, monkeypatch):
    _, _, a_q, s_a, w_q, s_w, extras = _operands(device)
    kernel = fp8.fp8_gemm(a_q, s_a, w_q, s_w, out_dtype=torch.float32, **extras)
    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    assert rel_err(fp8.fp8_gemm(a_q, s_a, w_q, s_w, out_dtype=torch.float32, **extras), kernel) < _fp32_floor(device)


def test_custom_ops_fake_and_schema(device):
    _, _, a_q, s_a, w_q, s_w, extras = _operands(device, m=8, k=32, n=16, batch=2)
    checks = ("test_faketensor",)  # test_schema compares fp8 tensors with ops torch lacks for them
    torch.library.opcheck(torch.ops.sd_kernels.fp8_gemm,
                          (a_q, s_a, w_q, s_w, extras["bias"][:16], "tanh", None, None, torch.bfloat16),
                          test_utils=checks)
    torch.library.opcheck(torch.ops.sd_kernels.fp8_quantize_rows, (torch.randn(4, 32, device=device), "", False),
                          test_utils=checks)


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n", [(4608, 3072, 3072), (4608, 3072, 12288), (4608, 12288, 3072), (2, 3072, 18432),
                                   (8192, 1536, 1536), (4096, 1152, 4608), (77, 1000, 333)])
def test_gpu_model_shapes_against_the_reference_and_scaled_mm(monkeypatch, count_calls, m, k, n):
    """FLUX, SD3, PixArt GEMMs on the GPU: the quantized math in float64, for the GEMM as dispatched (on
    Hopper, torch's row-wise ``torch._scaled_mm`` where it serves the shape), our Triton kernels alone,
    and ``_scaled_mm`` called directly on the same codes."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    a_q, s_a = fp8.quantize_rows(x)
    q_ref, s_ref = reference.fp8_quantize_rows(x)
    assert torch.equal(_codes(a_q), _codes(q_ref)) and torch.allclose(s_a, s_ref, rtol=1e-6)
    w_q, s_w = fp8.quantize_weight(w)
    launched = count_calls(fp8, torch_gemm="_torch_gemm")
    y = fp8.fp8_gemm(a_q, s_a, w_q, s_w, bias, out_dtype=torch.bfloat16)
    takes = m >= fp8.TORCH_GEMM_ROWS and k % 16 == 0 and n % 16 == 0  # what torch's GEMM serves on Hopper
    assert launched == {"torch_gemm": int(takes and fp8._torch_gemm_device(x.device))}
    ref = reference.fp8_gemm(a_q, s_a, w_q, s_w, bias, out_dtype=torch.float64, compute=torch.float64)
    rounding = rel_err(ref.to(torch.bfloat16), ref)
    assert rel_err(y, ref) <= 2 * rounding
    monkeypatch.setattr(fp8, "TORCH_GEMM", False)
    assert rel_err(fp8.fp8_gemm(a_q, s_a, w_q, s_w, bias, out_dtype=torch.bfloat16), ref) <= 2 * rounding
    if n % 16 == 0 and k % 16 == 0:
        for fast in (False, True):
            torchs = torch._scaled_mm(a_q, w_q.t(), scale_a=s_a[:, None], scale_b=s_w[None, :], bias=bias,
                                      out_dtype=torch.bfloat16, use_fast_accum=fast)
            assert rel_err(torchs, ref) <= 2 * rounding


@pytest.mark.gpu
@pytest.mark.parametrize("b,t,k,n,dtype", [(1, 4608, 15360, 3072, torch.bfloat16),
                                           (1, 4096, 12288, 3072, torch.bfloat16),
                                           (2, 4096, 6144, 1536, torch.float16), (2, 666, 6144, 1536, torch.float16)])
def test_gpu_gated_projections_against_the_reference(monkeypatch, count_calls, b, t, k, n, dtype):
    """A DiT block's gated down-projection (bias, per-sample gate, residual) at FLUX's (bf16) and SD3's (fp16,
    its image and text streams) shapes, as dispatched (on Hopper: ``torch._scaled_mm`` and one pass of our
    gated-add kernel, the very computation the route makes) and on our fused epilogue, against the quantized math
    in float64 (torch's ``addcmul`` beside them): within twice the output's rounding or the FP8 tensor cores'
    accumulation error at this K, whichever is larger (``_accumulation_floor``: in fp16 at K = 6,144 the
    accumulation, about 1e-3, exceeds fp16's rounding)."""
    x = torch.randn(b, t, k, device="cuda", dtype=dtype)
    w_q, s_w = fp8.quantize_weight(torch.randn(n, k, device="cuda", dtype=dtype) / k**0.5)
    bias, gate = torch.randn(n, device="cuda", dtype=dtype), torch.randn(b, 1, n, device="cuda", dtype=dtype)
    residual = torch.randn(b, t, n, device="cuda", dtype=dtype)
    a_q, s_a = fp8.quantize_rows(x)
    ref = reference.fp8_gemm(a_q, s_a, w_q, s_w, bias, gate=gate, residual=residual, out_dtype=torch.float64,
                             compute=torch.float64)
    torchs = torch._scaled_mm(a_q.view(b * t, k), w_q.t(), scale_a=s_a.view(-1, 1), scale_b=s_w.view(1, -1),
                              bias=bias, out_dtype=dtype, use_fast_accum=True)
    peer = gated_add_into(residual, gate, torchs.view(b, t, n), torch.empty_like(residual))
    addcmul = torch.addcmul(residual, gate, torchs.view(b, t, n))
    bound = max(2 * rel_err(ref.to(dtype), ref), _accumulation_floor(k))
    launched = count_calls(fp8, torch_gemm="_torch_gemm")
    y = fp8.fp8_gemm(a_q, s_a, w_q, s_w, bias, gate=gate, residual=residual, out_dtype=dtype)
    on_torch = (dtype in fp8.TORCH_GEMM_DTYPES and fp8._torch_gemm_device(x.device)  # Hopper: the profile's choice
                and fp8._torch_gemm_takes(x.device, dtype))
    assert launched == {"torch_gemm": int(on_torch)}
    if on_torch:
        assert torch.equal(y, peer)
    monkeypatch.setattr(fp8, "TORCH_GEMM", False)
    fused = fp8.fp8_gemm(a_q, s_a, w_q, s_w, bias, gate=gate, residual=residual, out_dtype=dtype)
    print(f"gated {b}x{t}x{k}->{n} {dtype}: dispatched {rel_err(y, ref):.2e}, fused {rel_err(fused, ref):.2e}, "
          f"_scaled_mm + ours {rel_err(peer, ref):.2e}, _scaled_mm + addcmul {rel_err(addcmul, ref):.2e}, "
          f"bound {bound:.2e}")
    assert rel_err(y, ref) <= bound and rel_err(fused, ref) <= bound and rel_err(addcmul, ref) <= bound


_F32, _BF16, _F16 = torch.float32, torch.bfloat16, torch.float16


@pytest.mark.gpu
@pytest.mark.parametrize("gate_dtype, residual_dtype", [(_F32, _BF16), (_BF16, _F32), (_F16, _F32)])
def test_gpu_gated_add_into_rounds_once_whatever_the_dtypes(gate_dtype, residual_dtype):
    """The pass after ``_scaled_mm`` (``gated_add_into``) with a gate and residual in other dtypes than the bf16
    GEMM output: applied in full precision and rounded once, so equal to float64's rounding to bf16 but where
    fp32's own rounding of the sum lands on a bf16 tie."""
    y = torch.randn(2, 333, 3072, device="cuda", dtype=torch.bfloat16)
    gate = torch.randn(2, 1, 3072, device="cuda", dtype=gate_dtype)
    residual = torch.randn(2, 333, 3072, device="cuda", dtype=residual_dtype)
    out = gated_add_into(residual, gate, y, torch.empty_like(y))
    want = (residual.double() + gate.double() * y.double()).to(torch.bfloat16).double()
    assert (out.double() != want).float().mean() < 0.01  # a tie of fp32's rounding, at most
    assert ((out.double() - want).abs() <= 2**-7 * want.abs()).all()  # and then one bf16 step


@pytest.mark.gpu
@pytest.mark.parametrize("rows,x_cols,p_cols", [(4608, 12288, 3072), (666, 6144, 1536)])
def test_gpu_prefix_quantizer_at_the_single_blocks_shapes(rows, x_cols, p_cols):
    """FLUX's single block (the attention output [4608, 3072] beside the MLP's 12,288 pre-GELU columns:
    one pass over 15,360) and a narrower join, compiled: the codes and scales against the reference's
    fp32 math, and the dequantized rows against float64's ``cat([prefix, gelu(x)])`` within the error
    the reference's own codes make."""
    x = torch.randn(rows, x_cols, device="cuda", dtype=torch.bfloat16)
    prefix = torch.randn(rows, p_cols, device="cuda", dtype=torch.bfloat16)
    prefix[: rows // 3] *= 20  # a third of the rows take their max from the prefix
    q, s = fp8.quantize_rows(x, "tanh", prefix=prefix)
    q_ref, s_ref = reference.fp8_quantize_rows(x, "tanh", prefix=prefix)
    assert q.shape == (rows, p_cols + x_cols) and torch.allclose(s, s_ref, rtol=1e-6, atol=0)
    assert (_codes(q) == _codes(q_ref)).float().mean() > 0.99  # the GELU's last bit moves a code now and then
    exact = torch.cat([prefix.double(), F.gelu(x.double(), approximate="tanh")], -1)
    ours, theirs = _codes(q).double() * s[:, None], _codes(q_ref).double() * s_ref[:, None]
    assert rel_err(ours, exact) <= 1.01 * rel_err(theirs, exact)


def test_inference_mode_inputs_are_quantized_each_call(device, count_calls):
    """Tensors made under torch.inference_mode have no version counter: an in-place change cannot be
    seen, so they carry no codes (each projection quantizes) rather than failing or reusing stale ones."""
    w_q, s_w = fp8.quantize_weight(torch.randn(16, 32, device=device))
    seen = count_calls(fp8, quantize="quantize_rows")
    with torch.inference_mode():
        x = torch.randn(3, 32, device=device)
        y1 = fp8.fp8_linear(x, w_q, s_w)
        x.mul_(2)  # not tracked: a kept quantization would be stale
        y2 = fp8.fp8_linear(x, w_q, s_w)
    assert seen["quantize"] == 2 and rel_err(y2, 2 * y1) < 1e-6


@pytest.mark.parametrize("chunk", [None, 16])
def test_a_nan_poisons_its_own_row_only(device, monkeypatch, chunk):
    """A NaN in an activation row gives that output row NaN, as torch's linear does, not a finite
    value (the kernel's clamp would turn the NaN into ±448); the other rows are unchanged. The
    LayerNorm's FP8 output: a NaN row gets a NaN scale. ``chunk``: rows read in chunks (two passes)."""
    _read_in_chunks(monkeypatch, chunk)
    x = torch.randn(4, 32, device=device)
    w_q, s_w = fp8.quantize_weight(torch.randn(16, 32, device=device))
    clean = fp8.fp8_linear(x, w_q, s_w, reuse=False)
    x[1, 3] = float("nan")
    y = fp8.fp8_linear(x, w_q, s_w, reuse=False)
    assert y[1].isnan().all()
    assert torch.equal(y[[0, 2, 3]], clean[[0, 2, 3]])
    x = torch.randn(2, 9, 40, device=device)
    x[0, 4, 7] = float("nan")
    _, _, s = layer_norm.layer_norm_modulated_fp8(x, None, None, 1e-6, torch.randn(2, 40, device=device))
    assert s[0, 4].isnan() and s.isnan().sum() == 1


def test_a_row_too_small_to_scale_is_quantized_as_zeros(device):
    """448 / max|v| overflows fp32 below 1.32e-36: such a row (at most reference.SCALE_TINY) gets codes 0 and its scale,
    as the reference, and its output row is finite, not the NaN that 0 · inf would make; a row just above
    it is quantized as any other (its largest value 448)."""
    x = torch.randn(3, 40, device=device)
    x[0] = 0.0
    x[0, :2] = torch.tensor([1e-37, -5e-38])
    x[1] *= 2.0**-118 / x[1].abs().max()
    q, s = fp8.quantize_rows(x)
    q_ref, s_ref = reference.fp8_quantize_rows(x)
    # the scales of such rows are subnormal: the GPU's division may flush them to 0 (codes 0 either way)
    assert torch.equal(_codes(q), _codes(q_ref)) and torch.allclose(s, s_ref, rtol=1e-6, atol=2.0**-126)
    assert not _codes(q[0]).any() and _codes(q[1]).abs().max() == 448
    w_q, s_w = fp8.quantize_weight(torch.randn(16, 40, device=device))
    assert torch.isfinite(fp8.fp8_linear(x, w_q, s_w, reuse=False)).all()


@pytest.mark.parametrize("chunk", [None, 16])
def test_non_finite_values_get_the_references_codes(device, monkeypatch, chunk):
    """A NaN element's row gets a NaN scale, an inf's an inf scale, and the other codes are the reference's
    (0 in the inf's row); a NaN element's own code is NaN compiled (the saturating cast keeps it, as the
    reference's clamp does), which the interpreter's cast cannot make."""
    _read_in_chunks(monkeypatch, chunk)
    x = torch.randn(3, 40, device=device)
    x[0, 5], x[1, 7] = float("nan"), float("inf")
    q, s = fp8.quantize_rows(x)
    q_ref, s_ref = reference.fp8_quantize_rows(x)
    assert torch.equal(s.isnan(), s_ref.isnan()) and torch.equal(s.isinf(), s_ref.isinf()) and s[0].isnan()
    finite = ~_codes(q_ref).isnan()
    assert torch.equal(_codes(q)[finite], _codes(q_ref)[finite])
    if device == "cuda":
        assert torch.equal(_codes(q).isnan(), _codes(q_ref).isnan()) and _codes(q)[0, 5].isnan()


def test_layer_norm_modulated_fp8_mixed_dtypes_promote_as_stock(device):
    """An fp16 input with fp32 modulation: the output in the promoted dtype, as the lossless op, stock
    PyTorch and the custom op's fake give it."""
    x = torch.randn(2, 5, 32, device=device, dtype=torch.float16)
    scale = torch.randn(2, 32, device=device)
    y, q, s = layer_norm.layer_norm_modulated_fp8(x, None, None, 1e-6, scale, None)
    assert y.dtype == layer_norm.layer_norm_modulated(x, None, None, 1e-6, scale, None).dtype == torch.float32
    assert q.dtype == E4M3 and s.dtype == torch.float32


def test_the_tma_kernels_allocator_is_set_for_the_launch_only():
    """The TMA kernel's descriptors need Triton's allocator: set around its launch where the caller has
    none, then put back; a caller's own allocator is used as it is."""
    from triton.runtime import _allocation

    before = _allocation._allocator.get()
    with fp8._scratch_allocator(torch.device("cpu")):
        buffer = _allocation._allocator.get()(256, 128, None)
    assert _allocation._allocator.get() is before and buffer.numel() == 256 and buffer.device.type == "cpu"

    def mine(size, alignment, stream):
        return torch.empty(size, dtype=torch.int8)

    token = _allocation._allocator.set(mine)
    try:
        with fp8._scratch_allocator(torch.device("cpu")):
            assert _allocation._allocator.get() is mine
        assert _allocation._allocator.get() is mine
    finally:
        _allocation._allocator.reset(token)


@pytest.mark.parametrize("tma_ms,pointer_ms,kernel", [(2.0, 1.0, "pointer"), (1.0, 2.0, "tma"), (1.0, 1.0, "tma"),
                                                      (None, 1.0, "tma"), (2.0, None, "tma")])
def test_the_kernel_the_tables_time_faster_serves_its_key(device, monkeypatch, count_calls, tma_ms, pointer_ms,
                                                          kernel):
    """Where both kernels' tables hold timings for a key, the faster one at tuning serves it; where either
    lacks them, or the GEMM has fewer rows than a tile, the TMA kernel (where it can read the operands).
    Decided once a key: the choice is kept."""
    if device == "cuda" and torch.cuda.get_device_capability() < fp8.TMA_CAPABILITY:
        pytest.skip("the TMA kernel needs Hopper or later")
    monkeypatch.setattr(fp8, "_CHOICE", {})
    monkeypatch.setattr(fp8._GEMM_TMA, "tuned_ms", lambda key, dev: tma_ms)
    monkeypatch.setattr(fp8._GEMM, "tuned_ms", lambda key, dev: pointer_ms)
    _, _, a_q, s_a, w_q, s_w, extras = _operands(device, k=64)
    launched = count_calls(fp8, tma="_GEMM_TMA", pointer="_GEMM")
    y = fp8.fp8_gemm(a_q, s_a, w_q, s_w, extras["bias"], out_dtype=torch.float32)
    monkeypatch.setattr(fp8._GEMM, "tuned_ms", lambda key, dev: 0.0)  # not asked again
    fp8.fp8_gemm(a_q, s_a, w_q, s_w, extras["bias"], out_dtype=torch.float32)
    assert launched == {"tma": 0, "pointer": 0, kernel: 2}
    ref = reference.fp8_gemm(a_q, s_a, w_q, s_w, extras["bias"], out_dtype=torch.float64, compute=torch.float64)
    assert rel_err(y, ref) <= _fp32_floor(device)
    few = fp8.TIMED_ROWS - 1  # fewer rows than a tile: the TMA kernel, whatever the tables time
    fp8.fp8_gemm(a_q[:few], s_a[:few], w_q, s_w, out_dtype=torch.float32)
    assert launched["tma"] == (2 if kernel == "tma" else 0) + 1


@pytest.mark.parametrize("epilogue", [{"bias"}, set(), {"bias", "gate", "residual"}, {"residual"}, {"gate"}],
                         ids=lambda e: "+".join(sorted(e)) or "plain")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_torchs_scaled_gemm_serves_the_epilogues_it_can_make(monkeypatch, count_calls, epilogue, dtype):
    """Where ``torch._scaled_mm`` may run (Hopper: faked here on the CPU, where torch runs it too), a bf16
    or fp16 GEMM of at least TORCH_GEMM_ROWS rows with a bias, and with a gate and residual (one pass after
    it), goes to it and not to our kernels: the reference's math to the output's rounding (twice for the
    gate's: the GEMM's output is rounded before the gate is applied)."""
    _cpu_routes_only()
    monkeypatch.setattr(fp8, "_torch_gemm_device", lambda device: True)
    _, _, a_q, s_a, w_q, s_w, extras = _operands("cpu", m=96, k=64, n=48, batch=4)
    kw = {k: (v.to(dtype) if k != "gate" else v.to(dtype)[:, None]) for k, v in extras.items() if k in epilogue}
    a3, s3 = a_q.view(4, 24, 64), s_a.view(4, 24)
    if "residual" in kw:
        kw["residual"] = kw["residual"].view(4, 24, 48)
    launched = count_calls(fp8, tma="_GEMM_TMA", pointer="_GEMM", torch_gemm="_torch_gemm")
    y = fp8.fp8_gemm(a3, s3, w_q, s_w, out_dtype=dtype, **kw)
    assert launched == {"tma": 0, "pointer": 0, "torch_gemm": 1}
    ref = reference.fp8_gemm(a3, s3, w_q, s_w, out_dtype=torch.float64, compute=torch.float64, **kw)
    assert y.shape == (4, 24, 48) and y.dtype == dtype
    assert rel_err(y, ref) <= 2 * (2 if "gate" in kw else 1) * rel_err(ref.to(dtype), ref)


def test_fp16_goes_to_torchs_gemm_only_where_this_torch_writes_it(monkeypatch, count_calls):
    """fp16 output with row-wise scales arrived in torch's ``_scaled_mm`` after bf16: it is tried once per device
    (a torch that refuses it keeps fp16 GEMMs on our kernels), and bf16 is never tried."""
    _cpu_routes_only()
    monkeypatch.setattr(fp8, "_torch_gemm_device", lambda device: True)
    monkeypatch.setattr(fp8, "_TORCH_GEMM_TAKES", {})
    real = torch._scaled_mm

    def older_torch(*args, out_dtype=None, **kwargs):
        if out_dtype != torch.bfloat16:
            raise RuntimeError("Only bf16 high precision output types are supported for row-wise scaling.")
        return real(*args, out_dtype=out_dtype, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", older_torch)
    tried = count_calls(torch, scaled_mm="_scaled_mm")
    fp16 = _route_case(out_dtype=torch.float16, bias=torch.float16)
    assert not fp8._torch_gemm_ready(*fp16) and not fp8._torch_gemm_ready(*fp16)
    assert tried["scaled_mm"] == 1 and fp8._TORCH_GEMM_TAKES == {(torch.device("cpu"), torch.float16): False}
    assert fp8._torch_gemm_ready(*_route_case()) and tried["scaled_mm"] == 1  # bf16: taken, nothing tried
    monkeypatch.setattr(torch, "_scaled_mm", real)
    monkeypatch.setattr(fp8, "_TORCH_GEMM_TAKES", {})
    assert fp8._torch_gemm_ready(*fp16)  # a torch that writes fp16


def _route_case(**change):
    """(a2, sa, w_q, s_w, bias, act, gated, out_dtype) of a GEMM torch's scaled GEMM takes, with ``change``
    applied (``offset``: the codes' bytes, ``vector_offset``: the scales' and bias's elements off a 16-byte
    aligned address)."""
    case = dict(m=fp8.TORCH_GEMM_ROWS, k=64, n=32, act="", gated=False, out_dtype=torch.bfloat16,
                bias=torch.bfloat16, contiguous=True, offset=0, w_contiguous=True, vector_offset={},
                scale_dtype=torch.float32)
    case.update(change)
    m, k, n, offset = case["m"], case["k"], case["n"], case["offset"]
    a = torch.zeros(m * k * (1 if case["contiguous"] else 2) + 16, dtype=fp8.E4M3)[offset:]  # 16-byte aligned base
    a = a[:m * k].view(m, k) if case["contiguous"] else a[:2 * m * k].view(m, 2 * k)[:, :k]
    w = torch.zeros(n, k, dtype=fp8.E4M3) if case["w_contiguous"] else torch.zeros(k, n, dtype=fp8.E4M3).t()
    shift = case["vector_offset"]
    vector = lambda size, dtype, name: torch.ones(size + 8, dtype=dtype)[shift.get(name, 0):][:size]  # noqa: E731
    bias = None if case["bias"] is None else vector(n, case["bias"], "bias")
    sa, s_w = vector(m, case["scale_dtype"], "sa"), vector(n, case["scale_dtype"], "s_w")
    return a, sa, w, s_w, bias, case["act"], case["gated"], case["out_dtype"]


@pytest.mark.parametrize("change,switch,taken", [
    ({}, {}, True), ({"bias": None}, {}, True), ({"gated": True}, {}, True),
    ({"gated": True}, {"TORCH_GEMM_GATED": False}, False), ({}, {"TORCH_GEMM": False}, False),
    ({"m": fp8.TORCH_GEMM_ROWS - 1}, {}, False), ({"act": "tanh"}, {}, False),
    ({"out_dtype": torch.float16, "bias": torch.float16}, {}, True), ({"out_dtype": torch.float16}, {}, False),
    ({"out_dtype": torch.float16, "bias": torch.float16}, {"TORCH_GEMM_DTYPES": (torch.bfloat16,)}, False),
    ({"out_dtype": torch.float32, "bias": None}, {}, False), ({"bias": torch.float32}, {}, False),
    ({"k": 72}, {}, False), ({"n": 40}, {}, False), ({"contiguous": False}, {}, False),
    ({"offset": 1}, {}, False), ({"w_contiguous": False}, {}, False), ({"vector_offset": {"sa": 1}}, {}, False),
    ({"vector_offset": {"s_w": 1}}, {}, False), ({"vector_offset": {"bias": 1}}, {}, False),
    ({"vector_offset": {"sa": 4, "s_w": 4, "bias": 8}}, {}, True), ({"scale_dtype": torch.float16}, {}, False)],
    ids=str)
def test_torchs_scaled_gemm_takes_only_what_it_can_make(monkeypatch, change, switch, taken):
    """The rule: bf16 or fp16 output (``TORCH_GEMM_DTYPES``; fp16 where this torch writes it) with a bias of that
    dtype or none, no activation, at least TORCH_GEMM_ROWS rows, contiguous operands with K and N multiples of 16,
    fp32 scales, operands, scales and bias at 16-byte aligned addresses (cuBLASLt refuses others); gated GEMMs
    while TORCH_GEMM_GATED; nothing while TORCH_GEMM is off; and only on a device that has it (a CPU tensor
    never: our kernels run there)."""
    for name, value in switch.items():
        monkeypatch.setattr(fp8, name, value)
    assert not fp8._torch_gemm_ready(*_route_case(**change))  # the CPU: our kernels (or the interpreter)
    monkeypatch.setattr(fp8, "_torch_gemm_device", lambda device: True)
    assert fp8._torch_gemm_ready(*_route_case(**change)) is taken


def _cpu_routes_only() -> None:
    if not fp8.interpreting():
        pytest.skip("CPU tensors reach the op's routes only under Triton's interpreter (the CPU run); on a GPU the "
                    "route runs for real in test_gpu_gated_projections_against_the_reference")


@pytest.mark.parametrize("case", ["gate_fp32", "gate_fp16", "residual_fp32", "residual_strided", "residual_2d_strided",
                                  "gate_only", "residual_only"])
@pytest.mark.parametrize("route", [False, True], ids=["triton", "torch"])
def test_the_output_is_contiguous_in_out_dtype_on_either_gemm(monkeypatch, count_calls, case, route):
    """fp8_gemm's contract whichever GEMM serves it (torch's ``_scaled_mm`` faked as available on the CPU, or our
    kernel under the interpreter): a new contiguous tensor in ``out_dtype`` (what the custom op's fake says,
    and torch.compile reads it so), whatever the gate's and residual's dtypes and strides; the reference's
    math within four times bf16's rounding (the interpreter truncates to bf16, and torch's GEMM rounds its
    output before the gate). On torch's GEMM the gate and residual are applied to its bf16 output in full
    precision and rounded once: within one bf16 step of float64's rounding (the interpreter's cast to bf16
    truncates)."""
    _cpu_routes_only()
    monkeypatch.setattr(fp8, "_torch_gemm_device", lambda device: route)
    torch.manual_seed(0)
    a_q, s_a = reference.fp8_quantize_rows(torch.randn(2, 48, 64))
    w_q, s_w = fp8.quantize_weight(torch.randn(32, 64) / 8)
    bias, gate = torch.randn(32, dtype=torch.bfloat16), torch.randn(2, 32, dtype=torch.bfloat16)  # [B, N]
    residual = torch.randn(2, 48, 32, dtype=torch.bfloat16)
    if case == "gate_fp32":
        gate = torch.randn(2, 32)
    elif case == "gate_fp16":
        gate = torch.randn(2, 32, dtype=torch.float16)
    elif case == "residual_fp32":
        residual = torch.randn(2, 48, 32)
    elif case == "residual_strided":
        residual = torch.randn(48, 2, 32, dtype=torch.bfloat16).transpose(0, 1)
    elif case == "residual_2d_strided":  # a 2-D input, its residual a transposed view, no gate
        a_q, s_a, gate, residual = a_q.view(96, 64), s_a.view(96), None, torch.randn(32, 96, dtype=torch.bfloat16).t()
    elif case == "gate_only":
        residual = None
    elif case == "residual_only":
        gate = None
    launched = count_calls(fp8, torch_gemm="_torch_gemm")
    y = fp8.fp8_gemm(a_q, s_a, w_q, s_w, bias, gate=gate, residual=residual, out_dtype=torch.bfloat16)
    assert launched == {"torch_gemm": int(route)}
    ref = reference.fp8_gemm(a_q, s_a, w_q, s_w, bias, gate=gate, residual=residual, out_dtype=torch.float64,
                             compute=torch.float64)
    assert y.dtype == torch.bfloat16 and y.shape == ref.shape and y.is_contiguous(), (y.dtype, y.stride())
    assert rel_err(y, ref) <= 4 * rel_err(ref.to(torch.bfloat16), ref)
    if route:  # the ungated GEMM's bf16 output, then the gate and residual in float64, rounded once
        want = fp8.fp8_gemm(a_q, s_a, w_q, s_w, bias, out_dtype=torch.bfloat16).double()
        if gate is not None:
            want = gate.double()[:, None, :] * want
        if residual is not None:
            want = want + residual.double()
        want = want.to(torch.bfloat16).double()
        # one bf16 step: the interpreter's fp32 → bf16 cast truncates (on the GPU, where it rounds to nearest,
        # test_gpu_gated_add_into_rounds_once_whatever_the_dtypes holds it to a tie of fp32's rounding)
        assert ((y.double() - want).abs() <= 2**-7 * want.abs()).all()


@pytest.mark.parametrize("mode,batch,rows,want", [
    ("samples", 2, 24, {"scaled_mm": 2, "torch_gemm": 0, "ours": 0}),
    ("samples", 1, 48, {"scaled_mm": 1, "torch_gemm": 0, "ours": 0}),  # one sample: its rows are one block
    ("samples", 2, 16, {"scaled_mm": 0, "torch_gemm": 0, "ours": 1}),  # samples under TORCH_GEMM_SEGMENT_ROWS
    ("ours", 2, 24, {"scaled_mm": 0, "torch_gemm": 0, "ours": 1}),
    ("copy", 2, 24, {"scaled_mm": 1, "torch_gemm": 1, "ours": 0}),
    ("misaligned", 2, 24, {"scaled_mm": 0, "torch_gemm": 0, "ours": 1})], ids=str)  # a block off 16 bytes: ours
def test_an_out_in_a_larger_buffer_is_written_where_it_lies(monkeypatch, count_calls, mode, batch, rows, want):
    """``out=`` a token slice of a batch (SD3's joined q, k, v: ``buffer[:, :rows]``) where torch's GEMM serves the
    shape: "samples" runs it once a sample into the slice (each sample's rows are one block), "ours" our kernel in
    place, "copy" one torch GEMM then a copy; the rows around the slice stay as they were, the values are the
    reference's within four times bf16's rounding (the interpreter's cast to bf16 truncates)."""
    _cpu_routes_only()
    monkeypatch.setattr(fp8, "_torch_gemm_device", lambda device: True)
    monkeypatch.setattr(fp8, "TORCH_GEMM_INTO", "samples" if mode == "misaligned" else mode)
    monkeypatch.setattr(fp8, "TORCH_GEMM_SEGMENT_ROWS", 20)
    monkeypatch.setattr(fp8, "TORCH_GEMM_ROWS", 16)
    torch.manual_seed(0)
    a_q, s_a = reference.fp8_quantize_rows(torch.randn(batch, rows, 64))
    w_q, s_w = fp8.quantize_weight(torch.randn(32, 64) / 8)
    bias = torch.randn(32, dtype=torch.bfloat16)
    shift = int(mode == "misaligned")  # the buffer 2 bytes off a 16-byte address
    buffer = torch.randn(batch * (rows + 8) * 32 + shift, dtype=torch.bfloat16)[shift:].view(batch, rows + 8, 32)
    around = buffer[:, rows:].clone()
    launched = count_calls(fp8, torch_gemm="_torch_gemm", tma="_GEMM_TMA", pointer="_GEMM")
    scaled = count_calls(torch, scaled_mm="_scaled_mm")
    y = fp8.fp8_gemm(a_q, s_a, w_q, s_w, bias, out_dtype=torch.bfloat16, out=buffer[:, :rows])
    ours = launched["tma"] + launched["pointer"]
    assert {"scaled_mm": scaled["scaled_mm"], "torch_gemm": launched["torch_gemm"], "ours": ours} == want
    assert y.data_ptr() == buffer.data_ptr() and torch.equal(buffer[:, rows:], around)
    ref = reference.fp8_gemm(a_q, s_a, w_q, s_w, bias, out_dtype=torch.float64, compute=torch.float64)
    assert rel_err(buffer[:, :rows], ref) <= 4 * rel_err(ref.to(torch.bfloat16), ref)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["samples", "ours", "copy"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_sd3s_joined_projection_in_every_out_mode(monkeypatch, count_calls, mode, dtype):
    """SD3-medium's q projection at 1024² with guidance written into its join (``buffer[:, :4096]`` of 4,096
    image and 333 text tokens a sample) in each ``TORCH_GEMM_INTO`` mode on the GPU: on Hopper, "samples" runs
    torch's GEMM twice, into the buffer; the text rows untouched, the image rows the quantized math's within twice
    the dtype's rounding or the FP8 tensor cores' accumulation error at this K, whichever is larger
    (``_accumulation_floor``: in fp16 the accumulation's)."""
    monkeypatch.setattr(fp8, "TORCH_GEMM_INTO", mode)
    torch.manual_seed(0)
    x = torch.randn(2, 4096, 1536, device="cuda", dtype=dtype)
    # asked before the count: the first ask per device and dtype tries torch's GEMM once (_torch_gemm_takes)
    on_torch = fp8._torch_gemm_device(x.device) and fp8._torch_gemm_takes(x.device, dtype)
    scaled = count_calls(torch, scaled_mm="_scaled_mm")
    a_q, s_a = fp8.quantize_rows(x)
    w_q, s_w = fp8.quantize_weight(torch.randn(1536, 1536, device="cuda", dtype=dtype) / 40)
    bias = torch.randn(1536, device="cuda", dtype=dtype)
    buffer = torch.randn(2, 4096 + 333, 1536, device="cuda", dtype=dtype)
    text = buffer[:, 4096:].clone()
    fp8.fp8_gemm(a_q, s_a, w_q, s_w, bias, out_dtype=dtype, out=buffer[:, :4096])
    assert scaled["scaled_mm"] == {"samples": 2 if on_torch else 0, "ours": 0, "copy": int(on_torch)}[mode]
    ref = reference.fp8_gemm(a_q, s_a, w_q, s_w, bias, out_dtype=torch.float64, compute=torch.float64)
    assert torch.equal(buffer[:, 4096:], text)
    assert rel_err(buffer[:, :4096], ref) <= max(2 * rel_err(ref.to(dtype), ref), _accumulation_floor(1536))


def test_torchs_gemm_runs_where_the_profile_says(monkeypatch):
    """A CUDA device (faked: capability and the interpreter) takes torch's GEMM under a profile that sets
    ``fp8_torch_gemm`` (``hopper`` alone: measured there); not under another profile, at a capability below
    Hopper, or on the CPU."""
    import types

    from sd_kernels import profiles

    monkeypatch.setattr(fp8, "interpreting", lambda: False)
    props = types.SimpleNamespace(major=9, minor=0)
    monkeypatch.setattr(fp8, "device_properties", lambda index: props)
    cuda = torch.device("cuda", 0)
    assert {n for n in profiles.list_profiles() if profiles.get_profile(n).fp8_torch_gemm} == {"hopper"}
    with profiles.using_profile(profiles.get_profile("hopper")):
        assert fp8._torch_gemm_device(cuda) and not fp8._torch_gemm_device(torch.device("cpu"))
        props.major, props.minor = 8, 9
        assert not fp8._torch_gemm_device(cuda)
        props.major, props.minor = 9, 0
    with profiles.using_profile(profiles.get_profile("cuda")):
        assert not fp8._torch_gemm_device(cuda)


def test_a_triton_without_the_allocator_module_runs_the_pointer_kernel(device, monkeypatch, count_calls):
    """The TMA kernel needs Triton's (private) allocator module; where a Triton lacks it, every GEMM takes
    the pointer kernel rather than failing."""
    _, _, a_q, s_a, w_q, s_w, _ = _operands(device, k=64)
    want = fp8.fp8_gemm(a_q, s_a, w_q, s_w, out_dtype=torch.float32)
    monkeypatch.setattr(fp8, "_allocation", None)
    launched = count_calls(fp8, tma="_GEMM_TMA", pointer="_GEMM")
    got = fp8.fp8_gemm(a_q, s_a, w_q, s_w, out_dtype=torch.float32)
    assert launched == {"tma": 0, "pointer": 1}
    assert rel_err(got, want) <= (0.0 if device == "cpu" else _fp32_floor(device))


@pytest.mark.parametrize("programs", [1, 3, 1000])
def test_the_tma_kernel_walks_every_tile_whatever_its_grid(device, monkeypatch, count_calls, programs):
    """The TMA kernel's programs take every grid-th tile: one program for all of them, a grid that does not
    divide the tiles, and one tile a program (the grid of its non-persistent configs), each giving the
    quantized math with the whole epilogue."""
    if device == "cuda" and torch.cuda.get_device_capability() < fp8.TMA_CAPABILITY:
        pytest.skip("the TMA kernel needs Hopper or later")
    monkeypatch.setattr(fp8, "_programs", lambda _device: programs)
    _, _, a_q, s_a, w_q, s_w, extras = _operands(device, m=200, k=64, n=150, batch=8)
    launched = count_calls(fp8, tma="_GEMM_TMA", pointer="_GEMM")
    y = fp8.fp8_gemm(a_q, s_a, w_q, s_w, act="tanh", out_dtype=torch.float32, **extras)
    ref = reference.fp8_gemm(a_q, s_a, w_q, s_w, act="tanh", out_dtype=torch.float64, compute=torch.float64,
                             **extras)
    assert launched == {"tma": 1, "pointer": 0} and rel_err(y, ref) <= _fp32_floor(device)
