"""Shared benchmark machinery: cases, timing, ceilings, the environment stamp, CSV output.

An op's benchmark module (``bench/ops_<family>.py``) only describes cases; timing, roofline
fractions and reporting happen here, the same way for every op. Timing follows
/work/.library/device/METHOD.md: warm-up first, CUDA events, medians, inputs rotated so that a small
case is not timed out of L2, stock and ours in one process.

Two times per implementation:
- ``ms``: device time. The calls are captured into one CUDA graph and replayed, so the host's launch
  cost is gone and what remains is the kernels' own time (plus the gaps between a call's kernels).
  Speedups and roofline fractions use it.
- ``eager_ms``: one call at a time from Python, as an eager diffusers run issues it
  (``triton.testing.do_bench``). Where it exceeds ``ms`` the call is bound by the host: Python,
  argument checks and the launch itself.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import itertools
import math
import platform
from collections.abc import Callable, Iterator
from typing import Any

import torch

# One capture for the benchmarks and for patch(..., cuda_graph=True): warm-up on a side stream, then capture.
from sd_kernels.patches.cuda_graph import capture

L2_BYTES = 50 * 2**20  # H100's L2; rotating over more than twice this defeats it


@dataclasses.dataclass
class Case:
    """One benchmark point: several implementations of the same op on the same inputs.

    ``impls`` maps a name to a zero-argument callable; "stock" is the baseline every ratio uses.
    ``bytes`` is the fewest bytes the op must move (inputs read once, outputs written once) and
    ``flops`` its arithmetic; either may be 0 when it does not apply. ``errors`` maps impl names
    to their relative error against float64 (filled by the case's author, optional).
    """

    op: str
    shape: str
    dtype: torch.dtype
    variant: str
    impls: dict[str, Callable[[], Any]]
    bytes: int = 0
    flops: int = 0
    errors: dict[str, float] = dataclasses.field(default_factory=dict)
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.op}[{self.shape},{str(self.dtype).removeprefix('torch.')},{self.variant}]"


def rotating(make: Callable[[], Any], bytes_per_set: int) -> Callable[[], Any]:
    """A callable returning the next of enough input sets (built by ``make``) to exceed L2 twice."""
    n = max(1, min(32, math.ceil(2 * L2_BYTES / max(bytes_per_set, 1))))
    sets = [make() for _ in range(n)]
    cycle = itertools.cycle(sets)
    return lambda: next(cycle)


def time_ms(fn: Callable[[], Any], warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds of ``fn`` on the GPU (do_bench's warm-up and rep are in ms)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def graphed(fn: Callable[[], Any], warmup: int = 3) -> Callable[[], Any]:
    """``fn`` as a replay of a CUDA graph of one call: returns the (static) output buffer."""
    graph, out = capture(fn, warmup=warmup)
    return lambda: (graph.replay(), out)[1]


def time_graph_ms(fn: Callable[[], Any], calls: int = 0, replays: int = 10) -> float:
    """Median milliseconds per call of ``fn`` replayed from a CUDA graph of ``calls`` captured calls.

    Rotating inputs keep rotating: each captured call bakes in the buffers it saw.
    ``calls`` = 0: enough for ~20 ms per replay.
    """
    if calls <= 0:
        est = time_ms(fn, warmup=5, rep=20)  # also the warm-up capture needs
        calls = max(8, min(500, int(20 / max(est, 1e-3))))
    graph, _ = capture(fn, calls=calls)
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    del graph
    torch.cuda.synchronize()
    return float(sorted(times)[len(times) // 2])


@functools.cache
def copy_ceiling_gbps() -> float:
    """Measured device-to-device copy bandwidth, bytes read + written per second, in GB/s."""
    n = 1 << 28  # 512 MiB of fp16 each way
    src = torch.randn(n, device="cuda", dtype=torch.float16)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / ms / 1e6


@functools.cache
def matmul_ceiling_tflops(dtype: torch.dtype = torch.float16) -> float:
    """Measured dense matmul rate at 8192³ in TFLOP/s."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    ms = time_ms(lambda: a @ b)
    return 2 * n**3 / ms / 1e9


def environment() -> dict[str, str]:
    """Device, versions and date: stamped on every result row."""
    import diffusers
    import triton

    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    return {
        "device": dev,
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "triton": triton.__version__,
        "diffusers": diffusers.__version__,
        "date": datetime.date.today().isoformat(),
    }


def measure(case: Case, warmup: int = 25, rep: int = 100) -> Iterator[dict[str, Any]]:
    """Time every impl of ``case`` (device time from a CUDA graph, and eager); one row per impl.

    An impl that cannot be captured (a host sync inside) keeps its eager time as ``ms``, marked in
    the ``timing`` column.
    """
    eager = {name: time_ms(fn, warmup, rep) for name, fn in case.impls.items()}
    times, how = {}, {}
    for name, fn in case.impls.items():
        try:
            times[name], how[name] = time_graph_ms(fn), "graph"
        except Exception:  # not capturable: report what we have, say so
            torch.cuda.synchronize()
            times[name], how[name] = eager[name], "eager"
    stock = times.get("stock")
    stock_eager = eager.get("stock")
    copy_bw = copy_ceiling_gbps()
    mm = matmul_ceiling_tflops()
    for name, ms in times.items():
        gbps = case.bytes / ms / 1e6 if case.bytes else float("nan")
        tflops = case.flops / ms / 1e9 if case.flops else float("nan")
        yield {
            "op": case.op,
            "shape": case.shape,
            "dtype": str(case.dtype).removeprefix("torch."),
            "variant": case.variant,
            "impl": name,
            "ms": round(ms, 5),
            "speedup_vs_stock": round(stock / ms, 3) if stock else float("nan"),
            "eager_ms": round(eager[name], 5),
            "eager_speedup": round(stock_eager / eager[name], 3) if stock_eager else float("nan"),
            "timing": how[name],
            "GB/s": round(gbps, 1),
            "pct_copy_bw": round(100 * gbps / copy_bw, 1) if case.bytes else float("nan"),
            "TFLOP/s": round(tflops, 2),
            "pct_matmul": round(100 * tflops / mm, 1) if case.flops else float("nan"),
            "rel_err": case.errors.get(name, float("nan")),
            **{k: v for k, v in case.extra.items()},
        }


def append_csv(path, rows: list[dict[str, Any]], fields: list[str] | None = None) -> None:
    """Append ``rows`` to the CSV at ``path`` (``fields``: its columns, default the first row's keys;
    keys outside them are dropped), writing the header when the file is new: a benchmark's rows are
    on disk as soon as they are measured. A file with other columns (an older version of the
    benchmark) is rewritten once with its columns followed by the new ones, so no cell moves."""
    import csv
    import pathlib

    path = pathlib.Path(path)
    if not rows:
        return
    fields = list(fields or rows[0])
    if path.exists():
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            header, old = list(reader.fieldnames or []), list(reader)
        if header and header != fields:
            union = header + [k for k in fields if k not in header]
            with open(path, "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=union, restval="", extrasaction="ignore")
                w.writeheader()
                w.writerows(old)
            fields = union
    new = not path.exists()
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, restval="", extrasaction="ignore")
        if new:
            w.writeheader()
        w.writerows(rows)


def format_table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return "-" if math.isnan(v) else (f"{v:.3e}" if 0 < abs(v) < 1e-2 else f"{v:g}")
        return str(v)

    table = [columns] + [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(columns))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in table)
