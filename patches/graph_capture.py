"""One call captured into a CUDA graph, and what its replays read copied in: the pieces that the
model calls' graphs (patches/cuda_graph.py) and the whole-step graphs (patches/whole_step.py) share."""

from __future__ import annotations

import numbers
from typing import Any

import torch
from torch.utils import _pytree as pytree

from sd_kernels.runtime import blas

# A host tensor argument of at most this many elements (a timestep) is copied in; a larger one runs eagerly.
HOST_NUMEL = 16


def timestep_tensor(t: Any) -> Any:
    """diffusers' own conversion of a number timestep (UNet2DConditionModel.get_time_embed), made on
    the host: it reaches the graph through the asynchronous copy-in, not a blocking host-to-device copy."""
    if isinstance(t, bool) or not isinstance(t, numbers.Number):
        return t
    return torch.tensor([t], dtype=torch.float64 if isinstance(t, float) else torch.int64)


def copy_in(dst: torch.Tensor, src: torch.Tensor) -> None:
    if src.device.type == "cpu" and dst.device.type == "cuda":
        # from pinned memory the copy is queued on the stream; from pageable memory torch would wait
        dst.copy_(src.pin_memory(), non_blocking=True)
    else:
        dst.copy_(src)


def fresh_call(static: list, tree: Any) -> Any:
    """The arguments of one captured run, rebuilt from the static leaves: containers of its own (a model that takes from
    a list or dict argument, as diffusers' UNet pops a T2I-Adapter's residuals, would otherwise leave the next run,
    the captured one, without them), and every static tensor marked changed in place, so that nothing kept on it by
    version counter in an earlier run (FP8 codes of the text) serves the captured run: the graph computes it, and
    each replay again from the values copied in."""
    for x in static:
        if isinstance(x, torch.Tensor) and not x.is_inference():
            torch.autograd.graph.increment_version(x)
    return pytree.tree_unflatten(static, tree)


def capture(run, pool=None, stream=None, warmup: int = 1, calls: int = 1) -> tuple[Any, Any]:
    """(graph, static outputs of the last captured call) of ``run()``: ``warmup`` calls on ``stream``
    (a new side stream if None: Triton autotuning and lazy library set-up stay out of the capture),
    then ``calls`` captured calls drawing from ``pool`` (a private pool if None). The inputs ``run``
    reads are baked into the graph: replays read the same buffers, whatever they then hold."""
    stream = stream if stream is not None else torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    out = None
    with blas.capture_scope(), torch.cuda.graph(graph, pool=pool, stream=stream):
        for _ in range(calls):  # the FP8 tier's captured GEMMs without cuBLASLt's workspace (runtime/blas.py)
            out = run()
    return graph, out
