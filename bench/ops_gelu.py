"""GELU family benchmarks (fp16): gelu, geglu, linear_geglu, the SD feed-forward block, the DiTs' tanh-GELU
projection (``linear_gelu``), and the paper's figure (``paper_figure``: kernels launched and bytes moved
by a tanh GELU built from 8 torch ops vs one kernel).

Shapes are SD1.5's at 512² with classifier-free guidance (batch 2): 64², 32², 16² latent tokens
(4096, 1024, 256) with model dims 320, 640, 1280; a transformer block's feed-forward is
``Linear(dim, 8·dim) → GEGLU → Linear(4·dim, dim)``, so GEGLU's input h is [2, tokens, 8·dim].
The DiTs' feed-forward is ``Linear(dim, 4·dim) → GELU(tanh) → Linear(4·dim, dim)`` (``DIT_LEVELS``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from bench.common import Case, rotating, time_ms
from sd_kernels import reference
from sd_kernels.ops import geglu, gelu, linear_geglu, linear_gelu
from sd_kernels.testing import rel_err

DTYPE = torch.float16
GELU_SHAPES = [(2, 4096, 1280), (8192, 2560)]
SD_LEVELS = [(4096, 320), (1024, 640), (256, 1280)]  # (tokens per image, model dim); batch 2
DIT_LEVELS = [  # (rows, model dim) of a DiT feed-forward at 1024²: PixArt-Σ, SD3-medium's image and text
    (8192, 1152), (8192, 1536), (666, 1536), (4096, 3072)]  # streams (batch 2), FLUX's image stream (batch 1)

# The paper's figure: the tanh GELU 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))) as built-in ops, one
# kernel each. Steps are (output, op, operands); strings name tensors ("x" is the input), so the
# traffic below is counted from the program itself.
BUILTIN_TANH_GELU = (
    ("x3", torch.pow, ("x", 3)),
    ("t1", torch.mul, ("x3", 0.044715)),
    ("t2", torch.add, ("x", "t1")),
    ("u", torch.mul, ("t2", math.sqrt(2.0 / math.pi))),
    ("th", torch.tanh, ("u",)),
    ("t3", torch.add, ("th", 1.0)),
    ("hx", torch.mul, ("x", 0.5)),
    ("y", torch.mul, ("hx", "t3")),
)


def builtin_tanh_gelu(x: torch.Tensor) -> torch.Tensor:
    env = {"x": x}
    for out, op, args in BUILTIN_TANH_GELU:
        env[out] = op(*(env[a] if isinstance(a, str) else a for a in args))
    return env[BUILTIN_TANH_GELU[-1][0]]


def _builtin_traffic() -> dict[str, int]:
    reads = [a for _, _, args in BUILTIN_TANH_GELU for a in args if isinstance(a, str)]
    return {"ops": len(BUILTIN_TANH_GELU), "intermediate_tensors": len(BUILTIN_TANH_GELU) - 1,
            "reads_of_x": reads.count("x"), "tensor_reads": len(reads),
            "tensor_writes": len(BUILTIN_TANH_GELU)}


def count_kernels(fn: Callable[..., Any], *args: Any) -> int:
    """GPU kernels one call of ``fn`` launches, as torch.profiler (CUPTI) sees them; warmed up first."""
    from torch.profiler import ProfilerActivity, profile

    fn(*args)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn(*args)
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def paper_figure(shape: tuple[int, ...] = (2, 4096, 1280), dtype: torch.dtype = DTYPE,
                 device: str = "cuda") -> dict[str, Any]:
    """The paper's GELU figure, reproduced: per implementation of the tanh GELU, the kernels it
    launches (counted on CUDA; None elsewhere), intermediate tensors, reads of x, bytes moved, its
    relative error against float64 and its median time (CUDA only)."""
    x = torch.randn(shape, device=device, dtype=dtype)
    size = x.numel() * x.element_size()
    ref = reference.gelu(x.double(), "tanh")
    t = _builtin_traffic()
    impls = {
        "builtin 8 ops": (builtin_tanh_gelu, t["intermediate_tensors"], t["reads_of_x"],
                          (t["tensor_reads"] + t["tensor_writes"]) * size),
        "F.gelu(tanh)": (lambda v: F.gelu(v, approximate="tanh"), 0, 1, 2 * size),
        "sd_kernels gelu(tanh)": (lambda v: gelu(v, "tanh"), 0, 1, 2 * size),
    }
    cuda = torch.device(device).type == "cuda"
    nxt = rotating(lambda: torch.randn(shape, device=device, dtype=dtype), size) if cuda else None
    rows = {}
    for name, (fn, intermediates, x_reads, moved) in impls.items():
        rows[name] = {
            "kernels": count_kernels(fn, x) if cuda else None,
            "intermediate_tensors": intermediates,
            "reads_of_x": x_reads,
            "bytes_moved": moved,
            "rel_err": rel_err(fn(x), ref),
            "ms": round(time_ms(lambda fn=fn: fn(nxt())), 5) if cuda else None,
        }
    return {"shape": "x".join(map(str, shape)), "dtype": str(dtype).removeprefix("torch."), "impls": rows}


def format_figure(fig: dict[str, Any]) -> str:
    cols = ["kernels", "intermediate_tensors", "reads_of_x", "bytes_moved", "ms", "rel_err"]
    lines = [f"paper figure: tanh GELU on {fig['shape']} {fig['dtype']}",
             "  " + "  ".join(["impl".ljust(22), *cols])]
    for name, row in fig["impls"].items():
        cells = (f"{row[c]:.2e}" if isinstance(row[c], float) else str(row[c]) for c in cols)
        lines.append("  " + "  ".join([name.ljust(22), *(v.ljust(len(c)) for v, c in zip(cells, cols))]))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Stock implementations, as diffusers runs them


def stock_geglu(h: torch.Tensor) -> torch.Tensor:
    a, gate = h.chunk(2, dim=-1)
    return a * F.gelu(gate)


def stock_linear_geglu(x, w, b):
    return stock_geglu(F.linear(x, w, b))


def ours_linear_geglu(x, w, b):
    return geglu(F.linear(x, w, b))


def stock_feed_forward(x, w1, b1, w2, b2):
    return F.linear(stock_linear_geglu(x, w1, b1), w2, b2)


def ours_feed_forward(x, w1, b1, w2, b2):
    return F.linear(ours_linear_geglu(x, w1, b1), w2, b2)


def fused_feed_forward(x, w1, b1, w2, b2):
    return F.linear(linear_geglu(x, w1, b1), w2, b2)


def _compiled(fn: Callable) -> Callable:
    # Static shapes: one specialised graph per case, as a fixed-resolution pipeline would compile.
    return torch.compile(fn, dynamic=False)


def _case(op: str, shape: str, variant: str, make: Callable[[], tuple], impls: dict[str, Callable],
          ref64: Callable, nbytes: int, flops: int = 0, extra: dict | None = None) -> Case:
    """A Case whose impls take the tuple ``make()`` builds; errors against float64 are measured first
    (which also compiles / autotunes every impl before timing), timing rotates over input sets."""
    inputs = make()
    ref = ref64(*(t.double() for t in inputs))
    errors = {name: rel_err(fn(*inputs), ref) for name, fn in impls.items()}
    in_bytes = sum(t.numel() * t.element_size() for t in inputs)
    del inputs, ref
    nxt = rotating(make, in_bytes)
    timed = {name: (lambda fn=fn: fn(*nxt())) for name, fn in impls.items()}
    return Case(op, shape, DTYPE, variant, timed, bytes=nbytes, flops=flops, errors=errors, extra=extra or {})


def _randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(shape, device="cuda", dtype=DTYPE) * scale


def _dims(shape) -> str:
    return "x".join(map(str, shape))


def _gelu_cases(quick: bool) -> Iterator[Case]:
    for shape in GELU_SHAPES[:1] if quick else GELU_SHAPES:
        n = math.prod(shape)
        for approx in ("none", "tanh"):
            stock = lambda x, a=approx: F.gelu(x, approximate=a)
            ours = lambda x, a=approx: gelu(x, a)
            yield _case("gelu", _dims(shape), approx, lambda s=shape: (_randn(*s),),
                        {"stock": stock, "compiled": _compiled(stock), "ours": ours},
                        lambda x, a=approx: reference.gelu(x, a), nbytes=2 * n * 2)


def _geglu_cases(quick: bool) -> Iterator[Case]:
    for tokens, dim in SD_LEVELS[:1] if quick else SD_LEVELS:
        shape = (2, tokens, 8 * dim)
        n = math.prod(shape)
        yield _case("geglu", _dims(shape), "erf", lambda s=shape: (_randn(*s),),
                    {"stock": stock_geglu, "compiled": _compiled(stock_geglu), "ours": geglu},
                    reference.geglu, nbytes=(n + n // 2) * 2)


def _projection_inputs(m: int, dim: int, n: int, out_proj: bool = False) -> tuple[torch.Tensor, ...]:
    """x [m, dim], GEGLU's projection (weight [2n, dim], bias [2n]) and, with ``out_proj``, the
    feed-forward's output Linear (weight [dim, n], bias [dim]); nn.Linear-like scales."""
    x, w1, b1 = _randn(m, dim), _randn(2 * n, dim, scale=dim**-0.5), _randn(2 * n, scale=0.1)
    return (x, w1, b1, _randn(dim, n, scale=n**-0.5), _randn(dim, scale=0.1)) if out_proj else (x, w1, b1)


def _linear_geglu_cases(quick: bool) -> Iterator[Case]:
    for tokens, dim in SD_LEVELS[:1] if quick else SD_LEVELS:
        m, n = 2 * tokens, 4 * dim
        make = lambda m=m, d=dim, n=n: _projection_inputs(m, d, n)
        yield _case("linear_geglu", f"{m}x{dim}->{n}", "erf", make,
                    {"stock": stock_linear_geglu, "ours": ours_linear_geglu, "ours_fused": linear_geglu},
                    stock_linear_geglu,  # run on float64 copies: the oracle
                    nbytes=(m * dim + 2 * n * dim + 2 * n + m * n) * 2, flops=2 * m * dim * 2 * n)


def _feed_forward_cases(quick: bool) -> Iterator[Case]:
    for tokens, dim in SD_LEVELS[:1] if quick else SD_LEVELS:
        m, n = 2 * tokens, 4 * dim
        impls = {"stock": stock_feed_forward, "ours": ours_feed_forward, "ours_fused": fused_feed_forward}
        if not quick:
            impls["compiled"] = _compiled(stock_feed_forward)
        make = lambda m=m, d=dim, n=n: _projection_inputs(m, d, n, out_proj=True)
        yield _case("feed_forward", f"{m}x{dim}", "geglu", make, impls, stock_feed_forward,  # fp64: oracle
                    nbytes=(2 * m * dim + 3 * n * dim + 2 * n + dim) * 2, flops=2 * m * dim * 3 * n)


def _paper_case() -> Iterator[Case]:
    shape = GELU_SHAPES[0]
    try:
        fig = paper_figure(shape)
        print(format_figure(fig))
        extra = {f"kernels[{name}]": row["kernels"] for name, row in fig["impls"].items()}
        extra.update({f"bytes_moved[{name}]": row["bytes_moved"] for name, row in fig["impls"].items()})
    except Exception as exc:  # the figure is a report; never let it hide the timings
        print(f"paper_figure failed: {type(exc).__name__}: {exc}")
        extra = {"paper_figure_error": f"{type(exc).__name__}: {exc}"}
    yield _case("gelu_paper_figure", _dims(shape), "tanh", lambda: (_randn(*shape),),
                {"stock": builtin_tanh_gelu, "aten": lambda x: F.gelu(x, approximate="tanh"),
                 "ours": lambda x: gelu(x, "tanh")},
                lambda x: reference.gelu(x, "tanh"), nbytes=2 * math.prod(shape) * 2, extra=extra)


def stock_linear_gelu(x, w, b):
    return F.gelu(F.linear(x, w, b), approximate="tanh")


def ours_linear_then_gelu(x, w, b):
    return gelu(F.linear(x, w, b), "tanh")


def _linear_gelu_cases(quick: bool) -> Iterator[Case]:
    """The tanh-GELU projection: cuBLAS linear + F.gelu (stock), inductor's (compiled), cuBLAS linear +
    our gelu (ours), ``linear_gelu`` as the active profile runs it (cuBLASLt's epilogue on hopper)."""
    for m, dim in DIT_LEVELS:  # all four in --quick too: the op has no other shapes
        n = 4 * dim
        make = lambda m=m, d=dim, n=n: (_randn(m, d), _randn(n, d, scale=d**-0.5), _randn(n, scale=0.1))
        yield _case("linear_gelu", f"{m}x{dim}->{n}", "tanh", make,
                    {"stock": stock_linear_gelu, "compiled": _compiled(stock_linear_gelu),
                     "ours": ours_linear_then_gelu, "ours_epilogue": lambda x, w, b: linear_gelu(x, w, b, "tanh")},
                    stock_linear_gelu,  # run on float64 copies: the oracle
                    nbytes=(m * dim + n * dim + n + m * n) * 2, flops=2 * m * dim * n)


def cases(quick: bool) -> Iterator[Case]:
    yield from _paper_case()
    yield from _gelu_cases(quick)
    yield from _geglu_cases(quick)
    yield from _linear_geglu_cases(quick)
    yield from _feed_forward_cases(quick)
    yield from _linear_gelu_cases(quick)
