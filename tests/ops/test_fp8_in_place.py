"""The FP8 quantizer reading, and the FP8 GEMM writing, a token slice of a batch where it lies
(``fp8_quant.segments``): SD3's joint attention has its projections write the streams' join in place and
quantizes the two parts of the attention's output without copying them (patches/joint_attention.py)."""

import importlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sd_kernels import reference

fp8 = importlib.import_module("sd_kernels.ops.fp8_linear")
fp8_quant = importlib.import_module("sd_kernels.ops.fp8_quant")


def _bits(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


@pytest.mark.parametrize("part", ["head", "tail"])
def test_quantize_a_token_slice_of_a_batch_where_it_lies(device, part):
    """buffer[:, :21] and buffer[:, 21:] of a [3, 29, 40] batch: read in three segments of their own rows,
    not copied, with the very codes and scales of their contiguous copies."""
    buffer = torch.randn(3, 29, 40, device=device, dtype=torch.float16)
    x = buffer[:, :21] if part == "head" else buffer[:, 21:]
    rows = fp8_quant.segments(x)
    assert rows.base.data_ptr() == x.data_ptr()
    assert (rows.seg, rows.stride_s, rows.stride_r) == (x.shape[1], 29 * 40, 40)
    q, s = fp8.quantize_rows(x)
    want_q, want_s = fp8.quantize_rows(x.contiguous())
    ref_q, ref_s = reference.fp8_quantize_rows(x)
    assert torch.equal(_bits(q), _bits(want_q)) and torch.equal(s, want_s)
    assert torch.equal(_bits(q), _bits(ref_q)) and torch.equal(s, ref_s)


def test_rows_one_stride_apart_are_one_segment_and_others_a_copy():
    x = torch.randn(4, 6, 8)
    assert fp8_quant.segments(x).seg == 24 and fp8_quant.segments(x[:, ::2]).seg == 12  # a view of 12 rows
    t = x.transpose(0, 1)  # rows 8 apart within a sample but samples 8·6 apart: [6, 4] over the first two dims
    rows = fp8_quant.segments(t)
    assert rows.seg == 4 and rows.stride_s == 8 and rows.stride_r == 48
    columns = x.transpose(1, 2)  # columns 8 apart: segments all the same
    assert (fp8_quant.segments(columns).seg, fp8_quant.segments(columns).stride_c) == (8, 8)
    mixed = torch.randn(2, 3, 4, 5).transpose(0, 1)  # the leading dimensions do not merge: a copy
    assert fp8_quant.segments(mixed).base.data_ptr() != mixed.data_ptr()
    q, s = fp8.quantize_rows(mixed)
    assert torch.equal(_bits(q), _bits(reference.fp8_quantize_rows(mixed)[0]))


class _CopiesInto(TorchDispatchMode):
    """The shapes copied (``copy_``) into ``tensor``'s memory under it (the interpreter writes a kernel's output
    back into the whole storage, one dimension)."""

    def __init__(self, tensor: torch.Tensor):
        super().__init__()
        self.storage, self.seen = tensor.untyped_storage().data_ptr(), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default and args[0].untyped_storage().data_ptr() == self.storage:
            self.seen.append(tuple(args[0].shape))
        return func(*args, **(kwargs or {}))


def _streams(device, k, n=37, batch=3, image=21, text=8):
    torch.manual_seed(0)
    quantized = [reference.fp8_quantize_rows(torch.randn(batch, rows, k, device=device)) for rows in (image, text)]
    w_q, s_w = fp8.quantize_weight(torch.randn(n, k, device=device) / k**0.5)
    extras = dict(bias=torch.randn(n, device=device), gate=torch.randn(batch, n, device=device))
    return quantized, w_q, s_w, extras


@pytest.mark.parametrize("k,kernel", [(50, "pointer"), (80, "tma")])
def test_gemm_writes_each_stream_into_the_join_where_it_lies(device, count_calls, k, kernel):
    """Two streams' GEMMs (21 and 8 rows a sample, batch 3, a per-sample gate) write buffer[:, :21] and
    buffer[:, 21:] of one [3, 29, N] join where they lie (nothing made apart and copied in: torch cannot tell
    whether such a slice overlaps itself, ``_disjoint`` can): the rows of each and nothing else, the bits of their
    own outputs."""
    if kernel == "tma" and device == "cuda" and torch.cuda.get_device_capability() < fp8.TMA_CAPABILITY:
        kernel = "pointer"
    ((a_img, s_img), (a_txt, s_txt)), w_q, s_w, extras = _streams(device, k)
    join = torch.full((3, 29, 37), float("nan"), device=device, dtype=torch.float16)
    launched = count_calls(fp8, tma="_GEMM_TMA", pointer="_GEMM")
    with _CopiesInto(join) as copies:
        got = fp8.fp8_gemm(a_img, s_img, w_q, s_w, out_dtype=torch.float16, out=join[:, :21], **extras)
        assert got.data_ptr() == join.data_ptr() and join[:, 21:].isnan().all()
        fp8.fp8_gemm(a_txt, s_txt, w_q, s_w, out_dtype=torch.float16, out=join[:, 21:], **extras)
    assert launched == {"tma": 0, "pointer": 0, kernel: 2}
    assert {(3, 21, 37), (3, 8, 37)}.isdisjoint(copies.seen), "an output was made apart and copied into the join"
    want = [fp8.fp8_gemm(a, s, w_q, s_w, out_dtype=torch.float16, **extras)
            for a, s in ((a_img, s_img), (a_txt, s_txt))]
    assert torch.equal(join, torch.cat(want, dim=1))


@pytest.mark.parametrize("layout, apart", [
    ((5, 8, 1), True),  # one segment of 5 rows, 8 apart: the rows of an [N, 8] tensor
    ((5, 6, 1), False),  # rows 6 apart, 8 wide: each row overlaps the next
    ((5, 8, 2), False),  # columns not unit-strided
], ids=["rows-apart", "rows-overlap", "columns-strided"])
def test_disjoint_takes_one_segment_only_with_rows_apart(layout, apart):
    rows, stride_r, stride_c = layout
    base = torch.empty(64)
    assert fp8._disjoint(fp8_quant.Segments(base, rows, 8, rows, stride_r * rows, stride_r, stride_c)) is apart


@pytest.mark.parametrize("stride_s, apart", [(29 * 37, True), (3 * 37, False), (37, False)],
                         ids=["samples-apart", "samples-overlap", "samples-interleaved"])
def test_disjoint_takes_segments_only_past_the_previous_one(stride_s, apart):
    """Three segments of 21 rows 37 apart (buffer[:, :21] of a [3, 29, 37] join: samples 29 · 37 apart) are
    disjoint; segments starting inside the previous one are not."""
    segments = fp8_quant.Segments(torch.empty(4096), 3 * 21, 37, 21, stride_s, 37, 1)
    assert fp8._disjoint(segments) is apart


@pytest.mark.parametrize("route", [False, True], ids=["triton", "torch"])
def test_an_out_the_kernels_cannot_write_in_place_gets_the_result_copied_in(monkeypatch, route):
    """Columns not unit-strided (or torch's GEMM serving the call, faked available on the CPU): the output is
    made as usual and copied into ``out``, the same values; a wrong shape or dtype is refused first."""
    monkeypatch.setattr(fp8, "_torch_gemm_device", lambda device: route)
    ((a, s), _), w_q, s_w, extras = _streams("cpu", 64, n=32)
    want = fp8.fp8_gemm(a, s, w_q, s_w, out_dtype=torch.bfloat16, **extras)
    out = torch.empty(3, 32, 21, dtype=torch.bfloat16).transpose(1, 2)
    assert fp8.fp8_gemm(a, s, w_q, s_w, out_dtype=torch.bfloat16, out=out, **extras) is out
    assert torch.equal(out, want)
    for wrong in (torch.empty(3, 21, 31, dtype=torch.bfloat16), torch.empty(3, 21, 32)):
        with pytest.raises(ValueError, match="out must be"):
            fp8.fp8_gemm(a, s, w_q, s_w, out_dtype=torch.bfloat16, out=wrong, **extras)


def test_an_out_sharing_memory_with_an_input_gets_the_result_of_the_inputs_as_they_were(device):
    """``out`` one token past its own residual (the tiles would overwrite rows the next tile reads): made apart and
    copied in, the result of the inputs before the call; ``out`` that is the residual itself is added to in place;
    an ``out`` whose elements overlap (expanded) is refused as ``copy_`` refuses it."""
    ((a, s), _), w_q, s_w, extras = _streams(device, 64, n=32, batch=1, image=199)
    buffer = torch.randn(1, 200, 32, device=device, dtype=torch.float16)
    want = fp8.fp8_gemm(a, s, w_q, s_w, residual=buffer[:, :199].clone(), out_dtype=torch.float16)
    fp8.fp8_gemm(a, s, w_q, s_w, residual=buffer[:, :199], out_dtype=torch.float16, out=buffer[:, 1:])
    assert torch.equal(buffer[:, 1:], want)
    residual = torch.randn(1, 199, 32, device=device, dtype=torch.float16)
    want = fp8.fp8_gemm(a, s, w_q, s_w, residual=residual.clone(), out_dtype=torch.float16, **extras)
    assert fp8.fp8_gemm(a, s, w_q, s_w, residual=residual, out_dtype=torch.float16, out=residual, **extras) is residual
    assert torch.equal(residual, want)
    expanded = torch.zeros(1, 1, 32, device=device, dtype=torch.float16).expand(1, 199, 32)
    with pytest.raises(RuntimeError, match="single memory location"):
        fp8.fp8_gemm(a, s, w_q, s_w, out_dtype=torch.float16, out=expanded)


def test_writing_out_moves_its_version_so_its_attached_quantization_is_not_reused(device):
    """A kernel's write into ``out`` counts as an in-place change: the quantization ``fp8_linear`` left on the tensor
    is dropped, and the next ``fp8_linear`` of it quantizes the new values. An ``out`` that requires grad is refused."""
    torch.manual_seed(0)
    x = torch.randn(2, 21, 64, device=device, dtype=torch.float16)
    w_q, s_w = fp8.quantize_weight(torch.randn(64, 64, device=device) / 8)
    first = fp8.fp8_linear(x, w_q, s_w)
    assert fp8.attached_quantization(x) is not None
    version = x._version
    other = torch.randn(2, 21, 64, device=device, dtype=torch.float16)
    fp8.fp8_linear(other, w_q, s_w, out=x)
    assert x._version > version and fp8.attached_quantization(x) is None
    assert not torch.equal(fp8.fp8_linear(x, w_q, s_w), first)
    assert torch.equal(fp8.fp8_linear(x, w_q, s_w, reuse=False), fp8.fp8_linear(x.clone(), w_q, s_w))
    with pytest.raises(RuntimeError, match="requires grad"):
        fp8.fp8_linear(other, w_q, s_w, out=torch.zeros_like(x, requires_grad=True))
