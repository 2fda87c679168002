"""A GEMM's products of known input rows, kept in a table and served again by bit equality.

A DiT's adaLN modulation is ``linear(silu(temb))`` with one row per sample, and ``temb`` depends only on the
step's timestep, the guidance and the pooled text embedding: every step of an image reads all of the
modulation weights (3.2 GB of FP8 codes in FLUX.1-dev, 0.9 ms on an H200) to multiply one row. The rows of
every step of a call can be made at its first step, as one GEMM with a row per step that reads those weights
once (patches/modulation_table.py, ``Fp8Modulations.fill``). A later step then finds its row here:

- ``RowTable`` holds ``keys`` [R, K] (input rows), ``values`` [R, N] (their products) and ``valid`` [R];
  ``store`` adds rows (a ring: the oldest are overwritten), ``clear`` forgets them all.
- ``serve(x, table, y)`` compares each row of ``x`` with every valid key **bit for bit** (one program a
  pair), and where every row of x has its key it copies their products into ``y`` and sets a flag on the
  device. The GEMM that follows (``fp8_gemm(..., skip=flag)``) then returns at once; where any row has no
  key it computes every row, as without the table. Nothing is decided on the host, so the three launches
  can be captured into a CUDA graph and replayed with any ``x``.

A served product is the one the GEMM makes for that row: the caller stores the GEMM's own output for the
keys (the same kernels, the same tile K order: each output row of the GEMM depends only on its input row),
and keeps the table only while the weights it was made with are the layer's (else it ``clear``\\s it).
Under the interpreter and on GPUs the kernels run; elsewhere the same arithmetic in torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sd_kernels.runtime.dispatch import use_kernel
from sd_kernels.runtime.launch import Launcher, cdiv, next_pow2

MAX_ROWS = 16  # rows of x a served call takes (a batch of samples); more: the GEMM computes them
_BITS = {2: torch.int16, 4: torch.int32}
_SERVE_ELEMS = 2048  # elements a serving program copies (its columns, for every row of x)


@triton.jit
def _match_kernel(x_ptr, keys_ptr, valid_ptr, eq_ptr, K, R, stride_xm, stride_kr, BLOCK_K: tl.constexpr,
                  WIDE: tl.constexpr):
    """eq[m, r] = 1 where key r is valid and holds x's row m bit for bit, else 0: one program a (m, r).
    The rows are compared as integers of their width (``WIDE``: 32 bits, else 16): NaN equals the same NaN,
    -0 differs from +0."""
    m, r = tl.program_id(0), tl.program_id(1)
    same = tl.load(valid_ptr + r) != 0
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + m * stride_xm + k, mask=k < K, other=0.0)
        b = tl.load(keys_ptr + r * stride_kr + k, mask=k < K, other=0.0)
        if WIDE:
            differ = a.to(tl.int32, bitcast=True) != b.to(tl.int32, bitcast=True)
        else:
            differ = a.to(tl.int16, bitcast=True) != b.to(tl.int16, bitcast=True)
        same = same & (tl.sum(differ.to(tl.int32), axis=0) == 0)
    tl.store(eq_ptr + m * R + r, same.to(tl.int32))


@triton.jit
def _serve_kernel(eq_ptr, values_ptr, y_ptr, skip_ptr, served_ptr, M, R, N, stride_vr, stride_ym,
                  BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """Where every row of x found its key: y[m, cols] = values[its key, cols] for this program's columns, and
    (program 0) skip = 1 and one more call served; else nothing is copied and skip = 0."""
    pid = tl.program_id(0)
    m = tl.arange(0, BLOCK_M)
    r = tl.arange(0, BLOCK_R)
    eq = tl.load(eq_ptr + m[:, None] * R + r[None, :], mask=(m[:, None] < M) & (r[None, :] < R), other=0)
    key = tl.max(tl.where(eq != 0, r[None, :], -1), axis=1)  # the last matching key of each row
    served = tl.min(tl.where(m < M, key, 0), axis=0) >= 0
    if pid == 0:
        tl.store(skip_ptr, served.to(tl.int32))
        tl.store(served_ptr, tl.load(served_ptr) + served.to(tl.int32))
    cols = (pid * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rows = tl.maximum(key, 0).to(tl.int64)
    mask = (m[:, None] < M) & (cols[None, :] < tl.where(served, N, 0))  # nothing where a row has no key
    v = tl.load(values_ptr + rows[:, None] * stride_vr + cols[None, :], mask=mask)
    tl.store(y_ptr + m[:, None].to(tl.int64) * stride_ym + cols[None, :], v, mask=mask)


_MATCH = Launcher(_match_kernel)
_SERVE = Launcher(_serve_kernel)


class RowTable:
    """Up to ``rows`` input rows of width ``in_features`` (``keys``) and their products of width
    ``out_features`` (``values``), in ``dtype`` on ``device``; ``valid[r]`` marks the rows stored. The
    buffers never move (a CUDA graph that serves from them reads them where they are)."""

    def __init__(self, rows: int, in_features: int, out_features: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        if dtype.itemsize not in _BITS:
            raise TypeError(f"RowTable: 16- or 32-bit floating rows, got {dtype}")
        self.keys = torch.zeros(rows, in_features, dtype=dtype, device=device)
        self.values = torch.zeros(rows, out_features, dtype=dtype, device=device)
        self.valid = torch.zeros(rows, dtype=torch.int32, device=device)
        self.served = torch.zeros(1, dtype=torch.int32, device=device)  # calls served (counted on the device)
        self.next = 0  # the row the next store begins at (host: the ring's position)

    @property
    def nbytes(self) -> int:
        return table_bytes(self.keys.shape[0], self.keys.shape[1], self.values.shape[1], self.keys.dtype)

    def fits(self, x: torch.Tensor) -> bool:
        """Whether ``x`` [M, in_features] is rows this table can serve: its dtype, device and width, at most
        ``MAX_ROWS`` of them, each row contiguous."""
        return (x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.shape[1] == self.keys.shape[1]
                and x.dtype == self.keys.dtype and x.device == self.keys.device and x.stride(1) == 1)

    def store(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Keep ``values`` [n, out_features] as the products of ``keys`` [n, in_features] (n at most the
        table's rows), from the ring's position on (wrapping to the first row where they do not fit after it)."""
        n, rows = keys.shape[0], self.keys.shape[0]
        if n > rows or values.shape[0] != n:
            raise ValueError(f"RowTable.store: at most {rows} rows, keys and values alike; got {n} and "
                             f"{values.shape[0]}")
        start = self.next if self.next + n <= rows else 0
        window = slice(start, start + n)
        self.valid[window] = 0  # in stream order: a later serve sees a row only once both are written
        self.keys[window] = keys
        self.values[window] = values
        self.valid[window] = 1
        self.next = (start + n) % rows

    def clear(self) -> None:
        self.valid.zero_()
        self.next = 0


def table_bytes(rows: int, in_features: int, out_features: int, dtype: torch.dtype) -> int:
    """What a ``RowTable`` of these sizes holds: its keys and values, a valid flag a row, the served count."""
    return rows * ((in_features + out_features) * dtype.itemsize + 4) + 4


def serve(x: torch.Tensor, table: RowTable, y: torch.Tensor) -> torch.Tensor:
    """Copy the products of ``x``'s rows into ``y`` [M, out_features] (unit column stride) where the table
    holds every row of x bit for bit; returns the device flag (int32 [1]: 1 served, 0 not: y untouched) that
    ``fp8_gemm(..., skip=)`` reads. ``table.fits(x)`` must hold."""
    m, k = x.shape
    r, n = table.values.shape
    skip = torch.empty(1, dtype=torch.int32, device=x.device)
    if not use_kernel("fp8_linear", x, table.keys, y):
        bits = _BITS[x.dtype.itemsize]
        eq = (x.view(bits)[:, None, :] == table.keys.view(bits)[None]).all(-1) & (table.valid != 0)[None]
        key = torch.where(eq, torch.arange(r, device=x.device), -1).amax(1)
        served = bool((key >= 0).all())
        if served:
            y.copy_(table.values[key])
            table.served += 1
        return skip.fill_(int(served))
    eq = torch.empty(m, r, dtype=torch.int32, device=x.device)
    block_k = min(next_pow2(k), 4096)
    _MATCH((block_k, x.dtype), (m, r), x, table.keys, table.valid, eq, k, r, x.stride(0), table.keys.stride(0),
           BLOCK_K=block_k, WIDE=x.dtype.itemsize == 4, num_warps=4)
    block_m, block_r = next_pow2(m), next_pow2(r)
    block_n = _SERVE_ELEMS // block_m
    _SERVE((block_m, block_r, block_n, x.dtype), (cdiv(n, block_n),), eq, table.values, y, skip, table.served, m, r,
           n, table.values.stride(0), y.stride(0), BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_N=block_n, num_warps=4)
    return skip
