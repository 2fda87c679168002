"""A GEMM's products of known rows served from a table by bit equality (sd_kernels/ops/fp8_rows.py) and the FP8
GEMM that then does nothing (``fp8_gemm(..., skip=)``). Tiny shapes on the CPU (the interpreter); on a GPU also
the modulation GEMM's shape, the table made by one GEMM of many rows against each row's own GEMM, bit for bit,
and a captured CUDA graph that serves some replays and computes others."""

import importlib

import pytest
import torch

fp8 = importlib.import_module("sd_kernels.ops.fp8_linear")
fp8_rows = importlib.import_module("sd_kernels.ops.fp8_rows")


def _layer(device, k=48, n=80, dtype=torch.bfloat16):
    w_q, s_w = fp8.quantize_weight(torch.randn(n, k, device=device))
    return w_q, s_w, torch.randn(n, device=device, dtype=dtype)


def _table(device, keys, layer, rows=8):
    table = fp8_rows.RowTable(rows, keys.shape[1], layer[0].shape[0], keys.dtype, torch.device(device))
    table.store(keys, fp8.fp8_linear(keys, *layer, reuse=False))
    return table


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rows_the_table_holds_are_served_and_the_gemm_does_nothing(device, dtype):
    layer = _layer(device, dtype=dtype)
    keys = torch.randn(5, 48, device=device, dtype=dtype)
    table = _table(device, keys, layer)
    own = fp8.fp8_linear(keys, *layer, reuse=False)
    table.values[3] = 7  # a marked product: only a served row can carry it
    for rows in ([1], [4, 0, 2], [3]):
        y = fp8.fp8_linear(keys[rows].clone(), *layer, reuse=False, table=table)
        expected = torch.full_like(own[rows], 7) if rows == [3] else own[rows]
        assert torch.equal(y, expected)
    assert table.served.item() == 3


def test_a_row_the_table_lacks_computes_every_row(device):
    layer = _layer(device)
    keys = torch.randn(4, 48, device=device, dtype=torch.bfloat16)
    table = _table(device, keys, layer)
    table.values.fill_(7)  # nothing of it may reach a computed call
    new = torch.randn(1, 48, device=device, dtype=torch.bfloat16)
    for x in (new, torch.cat([keys[:2], new])):
        assert torch.equal(fp8.fp8_linear(x, *layer, reuse=False, table=table), fp8.fp8_linear(x, *layer, reuse=False))
    assert table.served.item() == 0


def test_equality_is_of_the_bits(device):
    """-0 and +0 are different rows, a NaN the same row; a key stored and then cleared is not found."""
    layer = _layer(device)
    keys = torch.zeros(2, 48, device=device, dtype=torch.bfloat16)
    keys[1, 5] = float("nan")
    table = _table(device, keys, layer)
    table.values.fill_(7)
    minus = keys[:1].clone()
    minus[0, 0] = -0.0
    assert not (fp8.fp8_linear(minus, *layer, reuse=False, table=table) == 7).any()
    assert (fp8.fp8_linear(keys[1:].clone(), *layer, reuse=False, table=table) == 7).all()
    table.clear()
    assert not (fp8.fp8_linear(keys[1:].clone(), *layer, reuse=False, table=table) == 7).any()


def test_the_ring_overwrites_the_oldest_rows(device):
    layer = _layer(device)
    rows = torch.randn(7, 48, device=device, dtype=torch.bfloat16)
    table = fp8_rows.RowTable(4, 48, 80, torch.bfloat16, torch.device(device))
    values = fp8.fp8_linear(rows, *layer, reuse=False)
    table.store(rows[:3], values[:3])
    table.store(rows[3:5], values[3:5])  # does not fit after row 3: from row 0
    assert torch.equal(table.keys[:2], rows[3:5]) and torch.equal(table.keys[2], rows[2])
    assert table.valid.tolist() == [1, 1, 1, 0]
    with pytest.raises(ValueError, match="at most 4 rows"):
        table.store(rows[:5], values[:5])


def test_what_a_table_does_not_take(device):
    layer = _layer(device)
    table = fp8_rows.RowTable(4, 48, 80, torch.bfloat16, torch.device(device))
    x = torch.randn(2, 48, device=device, dtype=torch.bfloat16)
    assert table.fits(x)
    assert not table.fits(x.half()) and not table.fits(x[:, :40]) and not table.fits(x.t().contiguous().t()[:, :1])
    assert not table.fits(torch.randn(fp8_rows.MAX_ROWS + 1, 48, device=device, dtype=torch.bfloat16))
    narrow = fp8_rows.RowTable(4, 48, 40, torch.bfloat16, torch.device(device))
    with pytest.raises(ValueError, match="40 wide"):
        fp8.fp8_linear(x, *layer, table=narrow)
    with pytest.raises(ValueError, match="skip= needs out="):
        fp8.fp8_gemm(*fp8.quantize_rows(x), layer[0], layer[1], skip=torch.ones(1, dtype=torch.int32))
    with pytest.raises(TypeError, match="16- or 32-bit"):
        fp8_rows.RowTable(4, 48, 80, torch.float64, torch.device(device))


@pytest.mark.gpu
@pytest.mark.parametrize("k,n", [(3072, 18432 * 2 + 9216), (1536, 9216 * 3)])
def test_gpu_a_table_of_many_rows_is_each_rows_own_gemm_bit_for_bit(k, n):
    """The table's products come from one GEMM of 20 rows (FLUX's and SD3's joined modulation widths, in part);
    each row's own GEMM (one row, as a step runs it) gives the same bits, so a served step is the step
    computed."""
    layer = _layer("cuda", k, n)
    keys = torch.nn.functional.silu(torch.randn(20, k, device="cuda", dtype=torch.bfloat16))
    table = _table("cuda", keys, layer, rows=64)
    own = torch.cat([fp8.fp8_linear(keys[i:i + 1].clone(), *layer, reuse=False) for i in range(20)])
    assert torch.equal(table.values[:20], own)
    pair = keys[[3, 11]].clone()
    assert torch.equal(fp8.fp8_linear(pair, *layer, reuse=False, table=table), own[[3, 11]])


@pytest.mark.gpu
def test_gpu_a_captured_graph_serves_or_computes_on_each_replay():
    layer = _layer("cuda", 3072, 18432)
    keys = torch.randn(6, 3072, device="cuda", dtype=torch.bfloat16)
    table = _table("cuda", keys, layer, rows=16)
    table.values[2] = 7
    x = keys[:1].clone()
    for _ in range(2):  # the key's first launches (its config, the skipping kernel) before the capture
        fp8.fp8_linear(x, *layer, reuse=False, table=table)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fp8.fp8_linear(x, *layer, reuse=False, table=table)
    new = torch.randn(1, 3072, device="cuda", dtype=torch.bfloat16)
    for source, expected in ((keys[2:3], torch.full((1, 18432), 7.0, device="cuda", dtype=torch.bfloat16)),
                             (new, fp8.fp8_linear(new, *layer, reuse=False)),
                             (keys[4:5], fp8.fp8_linear(keys[4:5].clone(), *layer, reuse=False))):
        x.copy_(source)
        graph.replay()
        assert torch.equal(y, expected)
