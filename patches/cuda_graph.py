"""``patch(..., cuda_graph=True)``: the UNet call replayed from CUDA graphs, one per call signature.

Why: in eager mode a patched UNet step is bound by the host (each Triton launch costs more Python
time than an ATen one), so the kernels' device-time gain only shows when the whole step is replayed
from a CUDA graph, which costs one launch of host time.

``GraphedForward`` replaces the UNet's ``forward`` (an instance attribute set through the record, so
``unpatch`` removes it and the graphs with it). On each call it:

1. normalises the arguments as the UNet would see them: a Python-number ``timestep`` becomes the
   tensor diffusers itself would make of it (int64 or float64, on the model's device);
2. flattens positional and keyword arguments with torch's pytree (``added_cond_kwargs`` dicts of
   SDXL, ``encoder_hidden_states``, ``return_dict``, ``cross_attention_kwargs=None`` …): the tensor
   leaves' (shape, strides, dtype, device) and every other leaf's value, with the tree's structure,
   make the signature;
3. on a new signature: copies the inputs into static buffers, runs one warm-up call on a side stream
   (Triton autotuning, cuDNN/cuBLAS set-up happen there, outside the capture), then captures one
   call into a graph that draws from a memory pool shared by all of this model's graphs;
4. copies the inputs into that signature's static buffers, replays, and returns **clones** of the
   outputs, so that the next replay (which rewrites the static outputs) cannot change what an
   earlier call returned. The clone of a latent is a few hundred kB: negligible beside a UNet step.

Under ``torch.compile`` the wrapper steps aside (compile's mode="reduce-overhead" is its own way to
graph a model). Calls that cannot be captured run eagerly (logged once per reason): autograd
enabled, a tensor argument on another device (a CPU 0-d tensor is fine: it is copied in), a
non-tensor argument that is not hashable, or a capture that raised. The graphs hold the weights by
address: in-place weight changes (``fuse_lora``, ``load_state_dict``) show in the next replay; a
change of the module tree (``load_lora_weights`` adds modules, seen in ``peft_config``) or moved
weights (``.to(...)``, seen in a parameter's address) drop the graphs; offloading hooks added after
the patch make the calls eager.
"""

from __future__ import annotations

import logging
import numbers
from typing import Any

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

log = logging.getLogger("sd_kernels")

# The UNet2DConditionModel.forward argument diffusers turns into a tensor itself when given a number.
_TIMESTEP = "timestep"


def check_graphable(model: nn.Module) -> None:
    """Raise a clear error if ``model`` cannot be run from CUDA graphs."""
    devices = sorted({str(p.device) for p in model.parameters()})
    if len(devices) != 1 or not devices[0].startswith("cuda"):
        raise ValueError(
            f"cuda_graph=True needs the {type(model).__name__} on one CUDA device; its parameters are on "
            f"{', '.join(devices) or 'no device'} (move the pipeline with .to('cuda') first)"
        )
    if hasattr(model, "_hf_hook"):
        raise ValueError(
            f"cuda_graph=True cannot capture a {type(model).__name__} under accelerate hooks (CPU offload "
            "moves weights during the call); disable offloading first"
        )


def _timestep_tensor(t: Any, device: torch.device) -> Any:
    """diffusers' own conversion of a number timestep (UNet2DConditionModel.get_time_embed)."""
    if isinstance(t, bool) or not isinstance(t, numbers.Number):
        return t
    dtype = torch.float64 if isinstance(t, float) else torch.int64
    return torch.tensor([t], dtype=dtype, device=device)


def _model_state(model: nn.Module, first: torch.Tensor) -> tuple:
    """What invalidates captured graphs: peft adapters added or removed (the module tree changes with
    them), and the weights moved (``.to(device or dtype)``, offloading): the graphs read them by address."""
    cfg = getattr(model, "peft_config", None)
    return tuple(sorted(cfg)) if isinstance(cfg, dict) else (), first.data_ptr(), hasattr(model, "_hf_hook")


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
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        for _ in range(calls):
            out = run()
    return graph, out


class _Graph:
    """One captured call: static inputs (the tensor leaves), the graph, the static outputs."""

    def __init__(self, fn, tree: pytree.TreeSpec, leaves: list, device: torch.device, pool, stream) -> None:
        # On the model's device (a CPU 0-d timestep too: the UNet's own .to(device) is then a no-op),
        # in the argument's strides (clone keeps them).
        self.static = [x.to(device).clone() if isinstance(x, torch.Tensor) else x for x in leaves]
        args, kwargs = pytree.tree_unflatten(self.static, tree)
        self.graph, self.out = capture(lambda: fn(*args, **kwargs), pool, stream)

    def __call__(self, leaves: list) -> Any:
        for dst, src in zip(self.static, leaves):
            if isinstance(dst, torch.Tensor):
                dst.copy_(src)
        self.graph.replay()
        return pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, self.out)


class GraphedForward:
    """The UNet's forward, replayed from a CUDA graph per call signature (see the module docstring)."""

    def __init__(self, model: nn.Module, forward) -> None:
        check_graphable(model)
        self.forward = forward
        self.device = next(model.parameters()).device
        self.model_ref = model
        self.graphs: dict[Any, _Graph] = {}
        self.eager_keys: set = set()
        self.pool = torch.cuda.graph_pool_handle()  # shared by all signatures' graphs
        self.stream = torch.cuda.Stream(self.device)  # the side stream captures run on
        self.first_param = next(model.parameters())
        self.state = _model_state(model, self.first_param)
        self._logged: set[str] = set()

    def __repr__(self) -> str:
        return f"GraphedForward({len(self.graphs)} graphs)"

    def reset(self) -> None:
        """Drop every captured graph (the next call of each signature captures anew)."""
        self.graphs.clear()
        self.eager_keys.clear()

    def _eager(self, reason: str, args, kwargs) -> Any:
        if reason not in self._logged:
            self._logged.add(reason)
            log.warning("sd_kernels: cuda_graph: running the UNet eagerly: %s", reason)
        return self.forward(*args, **kwargs)

    def _signature(self, leaves: list, tree: pytree.TreeSpec) -> tuple[Any, str | None]:
        parts = []
        for x in leaves:
            if isinstance(x, torch.Tensor):
                if x.device != self.device and not (x.device.type == "cpu" and x.dim() == 0):
                    return None, f"a tensor argument on {x.device}, the model on {self.device}"
                parts.append((tuple(x.shape), tuple(x.stride()), x.dtype, x.device))
            else:
                try:
                    hash(x)
                except TypeError:
                    return None, f"an unhashable argument of type {type(x).__name__}"
                parts.append((type(x), x))
        return (tree, tuple(parts)), None

    def __call__(self, *args, **kwargs) -> Any:
        if torch.compiler.is_compiling():  # torch.compile traces the model itself (mode="reduce-overhead" graphs it)
            return self.forward(*args, **kwargs)
        if torch.is_grad_enabled():
            return self._eager("autograd is enabled (capture only runs under torch.no_grad / inference_mode)",
                               args, kwargs)
        if args[1:2]:
            args = (args[0], _timestep_tensor(args[1], self.device), *args[2:])
        elif _TIMESTEP in kwargs:
            kwargs = {**kwargs, _TIMESTEP: _timestep_tensor(kwargs[_TIMESTEP], self.device)}
        leaves, tree = pytree.tree_flatten((args, kwargs))
        key, reason = self._signature(leaves, tree)
        if reason is not None:
            return self._eager(reason, args, kwargs)
        state = _model_state(self.model_ref, self.first_param)
        if state != self.state:  # the captured kernels would run stale modules or read freed weights
            self.reset()
            self.state = state
        if state[2]:
            return self._eager("accelerate hooks (offloading) move the weights during the call", args, kwargs)
        graph = self.graphs.get(key)
        if graph is None and key not in self.eager_keys:
            try:
                graph = self.graphs[key] = _Graph(self.forward, tree, leaves, self.device, self.pool,
                                                          self.stream)
            except Exception as exc:  # a capture that fails runs eagerly from then on, for this signature
                self.eager_keys.add(key)
                return self._eager(f"capture failed ({type(exc).__name__}: {exc})", args, kwargs)
        if graph is None:
            return self.forward(*args, **kwargs)
        return graph(leaves)


def install(model: nn.Module, record) -> GraphedForward:
    """Replace ``model.forward`` by a GraphedForward, through ``record`` (undone by ``unpatch``)."""
    graphed = GraphedForward(model, model.forward)
    record.set_attr(model, "forward", graphed, "cuda_graph")
    return graphed
