"""``patch(pipe, cuda_graph="step")``: each denoising step replayed from one CUDA graph.

One graph per step holds all of a step's GPU work: the classifier-free-guidance batch (``torch.cat``),
``scheduler.scale_model_input``, the UNet, the guidance combine (and ``guidance_rescale``) and
``scheduler.step``. The rest of ``cuda_graph="pipeline"`` stays as it is (VAE decode and text
encoders from graphs, timesteps on the host, the faster ``_execution_device``).

**Without a copy of the pipeline's loop.** The pipeline's own ``__call__`` runs: its prompt encoding,
progress bar, ``interrupt``, callbacks. For the length of a call (the pipeline object gets a subclass
whose ``__call__`` opens a session) the scheduler's ``scale_model_input`` and ``step`` and the
UNet's graphed ``forward`` change roles:

1. ``scale_model_input(x, t)`` returns ``x`` untouched and marks it as the UNet's coming input;
2. the UNet call with that input queues nothing: it returns a placeholder of the output's shape and
   dtype on the ``meta`` device, so the pipeline's guidance arithmetic on it costs no GPU work;
3. ``scheduler.step(placeholder, t, latents, ...)`` runs the whole step: it copies what changed into
   the graph's static inputs and replays the step's graph, which recomputes the batch, the scaling,
   the UNet, the combine (with the pipeline's ``guidance_scale`` and ``guidance_rescale``) and the
   scheduler's step from ``latents``, and returns a copy of the graph's output.

That re-statement of the loop body is checked against the pipeline's source (patches/diffusers_sources.py:
``STEP_PIPELINES``' ``__call__`` in diffusers 0.42.1); another version or pipeline class runs
``cuda_graph="pipeline"`` (noted in the record). Latents and prompt embeddings are real tensors
everywhere the pipeline or a callback can see them, so a ``callback_on_step_end`` may read and
replace ``latents``, ``prompt_embeds`` (copied in when their identity or version changed) or the
guidance scale (a new graph).

**Per step and signature.** A scheduler's step reads its state on the host (step index, sigma
tables, the solver order so far) and bakes it into the kernels' scalar arguments, so each step is
its own graph, keyed by: the scheduler's class and every host value of its state (numbers, and the
bytes of its host tables), the timestep, the latents' and the UNet arguments' shapes and dtypes, the
guidance settings and the step's other arguments. Tensors a step leaves in the scheduler's state
(multistep solvers' past model outputs, PNDM's ``ets``, UniPC's last sample) live in the graph
memory pool and enter the key by shape and dtype: a graph reads the ones its capture saw, and where
the state holds others (a call that followed another chain of steps: PNDM keeps a sample across
calls; an eager step's), they are copied into those first (``rebind``). After a replay the
scheduler's Python state becomes what the captured call left, whose tensors the replay has just
rewritten, so the scheduler is where an eager step would have left it.

**Randomness.** A step's ``randn_tensor`` draws (Euler ancestral, DDIM with ``eta > 0``, the SDE
solvers) are taken out of the graph: the captured step reads a static buffer, and before each
replay the same draw is made eagerly with the call's own generator, in the same order, so the same
seed gives the same image and leaves the generator where the eager loop leaves it. The buffers are
made in the warm-up run that precedes every capture, outside the graph's memory pool: a buffer made
during the capture would be pool memory the step's earlier kernels may also use, and they would
overwrite the noise written into it before the replay.

**Falls back**, logged once per reason, to the UNet-only graphs of the pipeline mode for: a scheduler
not in ``SCHEDULERS``, timesteps on the device, a step argument that is a tensor
(``variance_noise``), and a capture that fails (then that signature stays eager); and to an eager
step where the UNet's graphed call would run eagerly too (autograd, moved weights: the next call
captures, offloading hooks). Moving the pipeline to another device or dtype, loading or switching
adapters, swapping processors: the UNet's ``GraphedCall`` sees it (``eager_reason``) and drops the
step graphs with its own.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import sys
import types
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from sd_kernels.profiles import scoped

from . import call_gate
from .diffusers_sources import VERIFIED_WITH, is_verified
from .graph_capture import capture, copy_in, fresh_call, timestep_tensor
from .record import PatchRecord, same_name_subclass
from .scheduler import HOST_SCHEDULERS, HostScalars, host_timesteps

log = logging.getLogger(__name__)

# Pipelines whose denoising loop body loop_body re-states (checked: their __call__'s source).
STEP_PIPELINES = ("StableDiffusionPipeline", "StableDiffusionXLPipeline")
# Schedulers whose step was checked inside a captured graph (the ones the pipeline mode gives host timesteps).
SCHEDULERS = HOST_SCHEDULERS
_ATTR = "_sd_kernels_whole_step"  # the pipeline object's WholeStep (an instance attribute through the record)


def _base_pipeline(cls: type) -> type | None:
    """The class of ``STEP_PIPELINES`` that ``cls`` is or derives from without overriding ``__call__``
    (the subclass this module gives a patched pipeline aside)."""
    for i, base in enumerate(cls.__mro__):
        if base.__name__ in STEP_PIPELINES:
            own = [c for c in cls.__mro__[:i] if "_sd_kernels_whole_step" not in vars(c)]
            return base if all(c.__call__ is base.__call__ for c in own) else None
    return None


def supported_reason(pipe: object) -> str | None:
    """Why ``cuda_graph="step"`` cannot replay whole steps of ``pipe``'s class, or None if it can."""
    base = _base_pipeline(call_gate.class_of(pipe))
    if base is None:
        return (f"the whole-step graphs re-state the denoising loop of {', '.join(STEP_PIPELINES)}; "
                f"{type(pipe).__name__} is not one of them")
    if not is_verified(base.__call__):
        return f"{base.__name__}.__call__ is not the diffusers {VERIFIED_WITH} code the whole-step graphs re-state"
    return None


# --------------------------------------------------------------------------------------------------
# The scheduler's state: snapshots, and the key of what a step reads from it.


def _is_method(value: object) -> bool:
    return callable(value) and not isinstance(value, torch.Tensor)


def _copy(value: object) -> object:
    """A copy of the containers (lists and dicts a step mutates in place), not of the tensors."""
    if isinstance(value, list):
        return [_copy(v) for v in value]
    if type(value) is dict:
        return {k: _copy(v) for k, v in value.items()}
    return value


def snapshot(scheduler: object) -> dict:
    """The scheduler's state (its instance attributes other than methods), containers copied."""
    return {k: _copy(v) for k, v in vars(scheduler).items() if not _is_method(v)}


def restore(scheduler: object, state: dict) -> None:
    """Make the scheduler's state ``state`` again (methods set on the instance are left alone)."""
    d = vars(scheduler)
    for k in [k for k, v in d.items() if k not in state and not _is_method(v)]:
        del d[k]
    d.update({k: _copy(v) for k, v in state.items()})


def _tensors(value: object):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


def state_tensors(state: dict) -> list[torch.Tensor]:
    """Every tensor in a snapshot, in a fixed order (attribute order, then container order)."""
    return [t for v in state.values() for t in _tensors(v)]


class _StateKey:
    """The hashable key of a scheduler state: host values as they are, host tensors (tables a step
    reads on the host, baked into the graph) by their bytes, and tensors on the model's device (past
    model outputs, a kept sample: what the graph reads by address) by shape, dtype and strides only,
    collected in ``tensors`` in a fixed order."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.tensors: list[torch.Tensor] = []

    def __call__(self, value: object) -> object:
        if isinstance(value, torch.Tensor):
            if value.device == self.device:
                self.tensors.append(value)
                return ("device", value.dtype, tuple(value.shape), tuple(value.stride()))
            raw = value.detach().reshape(-1).contiguous().view(torch.uint8).cpu().numpy().tobytes()
            return ("tensor", str(value.device), value.dtype, tuple(value.shape), hash(raw))
        if isinstance(value, (list, tuple)):
            return (type(value).__name__, *map(self, value))
        if isinstance(value, dict):
            return ("dict", *((k, self(v)) for k, v in value.items()))
        if hasattr(value, "tobytes"):  # numpy arrays and scalars
            return (type(value).__name__, str(getattr(value, "dtype", "")), hash(value.tobytes()))
        try:
            hash(value)
        except TypeError:
            return ("id", id(value))
        return value


def scheduler_key(scheduler: object, device: torch.device) -> tuple[tuple, list[torch.Tensor]]:
    """(key of the scheduler's state, its tensors on ``device`` in a fixed order)."""
    key = _StateKey(device)
    parts = tuple((k, key(v)) for k, v in vars(scheduler).items() if not _is_method(v))
    return (type(scheduler), parts), key.tensors


def rebind(captured: list[torch.Tensor], current: list[torch.Tensor]) -> None:
    """Copy the state's device tensors into those the graph was captured reading, where they are other
    tensors (the same shapes, dtypes and strides: the key says so). Sources that are themselves
    among the captured tensors are cloned first, so that no copy reads a tensor an earlier copy wrote."""
    pairs = [(dst, src) for dst, src in zip(captured, current) if dst is not src]
    if not pairs:
        return
    targets = {id(dst) for dst, _ in pairs}
    pairs = [(dst, src.clone() if id(src) in targets else src) for dst, src in pairs]
    for dst, src in pairs:
        dst.copy_(src)


# --------------------------------------------------------------------------------------------------
# Random draws out of the graph.


class _Tape:
    """A step's ``randn_tensor`` draws, taken out of its graph: while the captured step runs, the
    scheduler module's ``randn_tensor`` hands out static buffers (made at the first run, the same ones
    after); ``draw`` fills them before a replay by the real calls, with the step's generator."""

    def __init__(self) -> None:
        self.specs: list[tuple[tuple, dict, bool]] = []
        self.buffers: list[torch.Tensor] = []
        self._next = 0

    @contextlib.contextmanager
    def recording(self, module: types.ModuleType, generator: object):
        real = getattr(module, "randn_tensor", None)
        self._next = 0
        if real is None:  # a scheduler that draws no noise (PNDM, UniPC)
            yield
            return

        def taped(shape, generator=None, device=None, dtype=None, layout=None):
            i, self._next = self._next, self._next + 1
            if i == len(self.buffers):
                if generator is not None and generator is not step_generator:
                    raise RuntimeError("a step draws noise from a generator it was not given")
                self.specs.append((tuple(shape), {"device": device, "dtype": dtype, "layout": layout},
                                   generator is not None))
                self.buffers.append(torch.empty(shape, device=device, dtype=dtype, layout=layout or torch.strided))
            return self.buffers[i]

        step_generator = generator
        module.randn_tensor = taped
        try:
            yield
        finally:
            module.randn_tensor = real

    def draw(self, module: types.ModuleType, generator: object) -> None:
        for (shape, kwargs, seeded), buf in zip(self.specs, self.buffers):
            buf.copy_(module.randn_tensor(shape, generator=generator if seeded else None, **kwargs))


@contextlib.contextmanager
def _keep_pinned(keep: list):
    """Pinned host tensors that HostScalars copies from while a graph is captured (UniPC's
    coefficient vector): the graph's copy node reads them on every replay, so they live with it."""
    old = HostScalars.keep
    HostScalars.keep = keep
    try:
        yield
    finally:
        HostScalars.keep = old


# --------------------------------------------------------------------------------------------------
# One step: the loop body, and its graph.


@dataclass
class _Pending:
    """The UNet call a step's placeholder stands for: its timestep and keyword arguments."""

    sample: torch.Tensor  # the pipeline's (unscaled) UNet input, real
    t_scale: Any  # the timestep scale_model_input was given
    t_unet: Any  # the timestep the UNet was given
    kwargs: dict  # the UNet's keyword arguments (return_dict as the pipeline asked)
    graphed: Any  # the UNet's GraphedCall (patches/cuda_graph.py)


@dataclass
class _Guidance:
    cfg: bool
    scale: float
    rescale: float
    rescale_fn: Any = field(compare=False)


def _guidance(pipe: object) -> _Guidance:
    module = sys.modules[_base_pipeline(call_gate.class_of(pipe)).__module__]
    cfg = bool(pipe.do_classifier_free_guidance)
    return _Guidance(cfg, float(pipe.guidance_scale), float(pipe.guidance_rescale), module.rescale_noise_cfg)


def loop_body(scheduler, unet, latents, lmi, pending: _Pending, t_unet, kwargs: dict, guide: _Guidance,
              bound: inspect.BoundArguments):
    """One step of the STEP_PIPELINES' loop (their source is checked): from ``latents`` (or the
    pipeline's own batch ``lmi``) through ``unet`` to ``scheduler.step``'s return value."""
    cls = type(scheduler)
    if lmi is None:
        lmi = torch.cat([latents] * 2) if guide.cfg else latents
    lmi = cls.scale_model_input(scheduler, lmi, pending.t_scale)
    noise = unet(lmi, t_unet, **{**kwargs, "return_dict": False})[0]
    if guide.cfg:
        uncond, text = noise.chunk(2)
        noise = uncond + guide.scale * (text - uncond)
        if guide.rescale > 0.0:
            noise = guide.rescale_fn(noise, text, guidance_rescale=guide.rescale)
    bound.arguments["model_output"] = noise
    bound.arguments["sample"] = latents
    return cls.step(*bound.args, **bound.kwargs)


class _StepGraph:
    """One captured step: its static inputs, the graph, its outputs and the scheduler state it left."""

    def __init__(self, owner: WholeStep, scheduler, pending: _Pending, latents, bound, guide, slab: _Slab,
                 pre: dict, pre_tensors: list[torch.Tensor]) -> None:
        """``pre``: the scheduler's snapshot before the step; ``pre_tensors``: its tensors on the
        model's device (``scheduler_key``), which the graph reads by address."""
        graphed = pending.graphed
        self.latents = latents.clone()  # this step's own copy: a scheduler may keep a step's sample
        self.t_unet = timestep_tensor(pending.t_unet)
        if isinstance(self.t_unet, torch.Tensor):
            self.t_unet = self.t_unet.to(graphed.device)
        self.tape = _Tape()
        self.pinned: list[torch.Tensor] = []
        module = sys.modules[type(scheduler).step.__module__]
        pre_ids = {id(t) for t in state_tensors(pre)}
        self.pre_tensors = pre_tensors
        device = graphed.device

        def run():
            restore(scheduler, pre)  # every run (warm-up, capture, a stand-in's replay) starts from here
            kwargs = fresh_call(slab.static, slab.tree)  # containers of its own, the slab marked changed
            with self.tape.recording(module, bound.arguments.get("generator")), _keep_pinned(self.pinned):
                out = loop_body(scheduler, graphed.forward, self.latents, None, pending, self.t_unet, kwargs,
                                guide, _copy_bound(bound))
            made = [t for t in state_tensors(snapshot(scheduler)) if t.device == device and id(t) not in pre_ids]
            return out, made

        # Every capture has a warm-up run: the noise buffers are made there, outside the graph. A buffer
        # made inside it would be pool memory that the graph's earlier kernels (the UNet's) may use too,
        # and the noise written into it before a replay would be overwritten by them.
        self.graph, (self.out, _) = capture(run, owner.pool, owner.stream, warmup=1)
        self.post = snapshot(scheduler)

    def replay(self, scheduler, latents, generator, state_tensors: list[torch.Tensor]) -> Any:
        self.latents.copy_(latents)
        rebind(self.pre_tensors, state_tensors)
        self.tape.draw(sys.modules[type(scheduler).step.__module__], generator)
        self.graph.replay()
        restore(scheduler, self.post)
        return pytree.tree_map_only(torch.Tensor, torch.Tensor.clone, self.out)


def _copy_bound(bound: inspect.BoundArguments) -> inspect.BoundArguments:
    return inspect.BoundArguments(bound.signature, dict(bound.arguments))


class _Slab:
    """The static copies of the UNet's keyword-argument tensors, shared by the steps of one
    signature; a source is copied in only when it is another tensor, or the same one changed in place."""

    def __init__(self, leaves: list, tree, device: torch.device) -> None:
        self.static = [x.to(device).clone() if isinstance(x, torch.Tensor) else x for x in leaves]
        self.tree = tree
        self.sources = [(x, _version(x)) if isinstance(x, torch.Tensor) else None for x in leaves]

    def copy_in(self, leaves: list) -> None:
        for i, (dst, src) in enumerate(zip(self.static, leaves)):
            if not isinstance(dst, torch.Tensor):
                continue
            last = self.sources[i]
            if last is not None and last[0] is src and last[1] is not None and last[1] == _version(src):
                continue
            copy_in(dst, src)
            self.sources[i] = (src, _version(src))


def _version(x: torch.Tensor) -> int | None:
    """The tensor's in-place version counter; None for an inference tensor (torch.inference_mode),
    which has none: such a source is copied in on every step."""
    return None if x.is_inference() else x._version


# --------------------------------------------------------------------------------------------------
# The pipeline's side: the session around a call, the hooks, the graphs.


@dataclass
class _Call:
    scheduler: Any
    armed: Any = None  # the tensor scale_model_input just handed back (the UNet's coming input)
    t_scale: Any = None
    pending: _Pending | None = None


class WholeStep:
    """The whole-step graphs of one pipeline (see the module docstring)."""

    profile_scoped = True  # steps run under the patch's profile, as the GraphedCall's own calls

    def __init__(self, pipe: object, graphed: Any, record: PatchRecord) -> None:
        self.pipe_ref = pipe
        self.graphed = graphed
        self.record = record
        self.graphs: dict[Any, _StepGraph] = {}
        self.slabs: dict[Any, _Slab] = {}
        self.failed: set = set()
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(graphed.device)
        self.call: _Call | None = None
        self.steps = 0  # steps replayed from whole-step graphs (captures included)
        self._prepared: set = set()
        self._logged: set[str] = set()

    def __repr__(self) -> str:
        return f"WholeStep({len(self.graphs)} step graphs)"

    def reset(self) -> None:
        self.graphs.clear()
        self.slabs.clear()
        self.failed.clear()
        self._prepared.clear()

    def _note(self, reason: str, level: int = logging.WARNING) -> None:
        if reason not in self._logged:
            self._logged.add(reason)
            log.log(level, "sd_kernels: cuda_graph='step': %s; those steps replay the UNet alone", reason)

    # ---- the session

    def _session_reason(self, pipe) -> str | None:
        scheduler = getattr(pipe, "scheduler", None)
        name = type(scheduler).__name__
        if name not in SCHEDULERS:
            return f"the scheduler {name} was not checked inside a step graph ({', '.join(SCHEDULERS)})"
        if getattr(pipe, "unet", None) is not self.graphed.model_ref:
            return "the pipeline's UNet is not the one patched"
        return None

    @contextlib.contextmanager
    def session(self, pipe):
        """The hooks of one pipeline call (a no-op, logged once, where whole steps cannot run)."""
        reason = self._session_reason(pipe)
        if reason is not None or self.call is not None:  # a call inside a call runs as the pipeline mode
            if reason is not None:
                self._note(reason)
            yield
            return
        scheduler = pipe.scheduler
        if "set_timesteps" not in vars(scheduler):  # swapped in after the patch: host timesteps, as patch() gives
            if host_timesteps(scheduler, self.record):
                self.record.scheduler = scheduler
        d = vars(scheduler)
        saved = {name: d[name] for name in ("scale_model_input", "step") if name in d}
        d["scale_model_input"], d["step"] = self._hooks(scheduler)
        self.call = _Call(scheduler)
        try:
            yield
        finally:
            self.call = None
            for name in ("scale_model_input", "step"):
                d.pop(name, None)
            d.update(saved)

    def _hooks(self, scheduler):
        cls = type(scheduler)

        @functools.wraps(cls.scale_model_input)  # inspect.signature sees the class's method
        def scale_model_input(sched, sample, *args, **kwargs):
            call = self.call
            if call is None or call.scheduler is not sched or not isinstance(sample, torch.Tensor):
                return cls.scale_model_input(sched, sample, *args, **kwargs)
            call.armed, call.t_scale = sample, (args[0] if args else kwargs.get("timestep"))
            return sample  # scaled inside the step's graph

        @functools.wraps(cls.step)  # the pipeline reads its parameters (eta, generator)
        def step(sched, *args, **kwargs):
            return self._step(sched, args, kwargs)

        return types.MethodType(scale_model_input, scheduler), types.MethodType(step, scheduler)

    def intercept(self, graphed: Any, args: tuple, kwargs: dict) -> Any:
        """The UNet call of a step: a placeholder (None: not a step's call, the GraphedCall runs it)."""
        call = self.call
        if call is None or call.armed is None:
            return None
        if not args or args[0] is not call.armed or len(args) != 2:
            raise RuntimeError("sd_kernels: cuda_graph='step': the UNet was not called with the input "
                               "scale_model_input returned; this pipeline's loop is not the one checked")
        sample, t = args
        call.armed = None
        call.pending = _Pending(sample, call.t_scale, t, dict(kwargs), graphed)
        shape = (sample.shape[0], graphed.model_ref.config.out_channels, *sample.shape[2:])
        placeholder = torch.empty(shape, dtype=graphed.model_ref.dtype, device="meta")
        if kwargs.get("return_dict", True):
            from diffusers.models.unets.unet_2d_condition import UNet2DConditionOutput

            return UNet2DConditionOutput(sample=placeholder)
        return (placeholder,)

    # ---- one step

    def _step(self, scheduler, args: tuple, kwargs: dict) -> Any:
        cls = type(scheduler)
        bound = _signature(cls).bind(scheduler, *args, **kwargs)
        model_output = bound.arguments.get("model_output")
        call = self.call
        if not (isinstance(model_output, torch.Tensor) and model_output.device.type == "meta"):
            return cls.step(scheduler, *args, **kwargs)
        pending = call.pending if call is not None else None
        if pending is None:
            raise RuntimeError("sd_kernels: cuda_graph='step': scheduler.step got a placeholder with no UNet "
                               "call behind it")
        call.pending = None
        return self._run(scheduler, pending, bound)

    def _eager(self, scheduler, pending: _Pending, bound, guide: _Guidance, reason: str | None,
               level: int = logging.WARNING, unet=None) -> Any:
        """The step as the pipeline would run it, its UNet call through the UNet's own graphs (or
        ``unet``: the model's method, where the UNet's graphs would not replay either)."""
        if reason is not None:
            self._note(reason, level)
        return loop_body(scheduler, unet or pending.graphed, bound.arguments["sample"], pending.sample, pending,
                         pending.t_unet, pending.kwargs, guide, bound)

    @scoped
    def _run(self, scheduler, pending: _Pending, bound: inspect.BoundArguments) -> Any:
        guide = _guidance(self.pipe_ref)
        latents = bound.arguments["sample"]
        graphed = pending.graphed
        args, kwargs = graphed.normalise((pending.sample, pending.t_unet), dict(pending.kwargs))
        why = graphed.eager_reason()
        if why is not None:
            return self._eager(scheduler, pending, bound, guide, why[0], why[1], unet=graphed.forward)
        kw_leaves, kw_tree = pytree.tree_flatten(kwargs)
        kw_key, reason = graphed.signature(kw_leaves, kw_tree)
        extra = {k: v for k, v in bound.arguments.items()
                 if k not in ("self", "model_output", "sample", "timestep", "generator")}
        t = bound.arguments.get("timestep")
        if reason is None and any(isinstance(v, torch.Tensor) for v in pytree.tree_leaves(extra)):
            reason = "a tensor argument to scheduler.step (variance_noise)"
        if reason is None and any(isinstance(x, torch.Tensor) and x.device.type != "cpu"
                                  for x in (t, pending.t_scale, args[1])):
            reason = ("the scheduler's timesteps are on the device (a scheduler swapped in after the patch that "
                      "sd_kernels does not give host timesteps)")
        if reason is None and latents.device != graphed.device:
            reason = f"latents on {latents.device}, the UNet on {graphed.device}"
        if reason is not None:
            return self._eager(scheduler, pending, bound, guide, reason)
        state_key, state = scheduler_key(scheduler, graphed.device)
        generator = bound.arguments.get("generator")
        values = _hashable_values(extra, (t, pending.t_scale, args[1]))
        # and the inference mode: a step captured under torch.inference_mode() holds inference tensors (its slab, the
        # scheduler's state), which a call outside it could not copy into
        inputs_key = (kw_key, (tuple(latents.shape), tuple(latents.stride()), latents.dtype),
                      tuple(pending.sample.shape), torch.is_inference_mode_enabled())
        key = (inputs_key, state_key, values, guide.cfg, guide.scale, guide.rescale, generator is not None)
        if key in self.failed:
            return self._eager(scheduler, pending, bound, guide, None)
        entry = self.graphs.get(key)
        slab = self.slabs.get(inputs_key)
        if slab is None:
            slab = self.slabs[inputs_key] = _Slab(kw_leaves, kw_tree, graphed.device)
        else:
            slab.copy_in(kw_leaves)
        if entry is None:
            pre = snapshot(scheduler)
            try:
                if inputs_key not in self._prepared:
                    graphed.prepare(*pytree.tree_flatten((args, kwargs)))
                entry = _StepGraph(self, scheduler, pending, latents, bound, guide, slab, pre, state)
            except Exception as exc:
                restore(scheduler, pre)
                self.failed.add(key)
                return self._eager(scheduler, pending, bound, guide,
                                   f"a step's capture failed ({type(exc).__name__}: {exc})")
            self._prepared.add(inputs_key)
            self.graphs[key] = entry
        self.steps += 1
        return entry.replay(scheduler, latents, generator, state)


@functools.cache
def _signature(cls: type) -> inspect.Signature:
    return inspect.signature(cls.step)


def _hashable_values(extra: dict, timesteps: tuple) -> tuple:
    """The step's other arguments and the timesteps as values (host numbers or 0-d host tensors)."""
    def value(x):
        if isinstance(x, torch.Tensor):
            return ("tensor", x.dtype, tuple(x.tolist()) if x.dim() else x.item())
        return x

    return tuple(sorted((k, value(v)) for k, v in extra.items())) + tuple(map(value, timesteps))


# --------------------------------------------------------------------------------------------------
# Install.


@functools.cache
def _step_class(cls: type) -> type:
    base_call = cls.__call__

    @functools.wraps(base_call)
    def __call__(self, *args, **kwargs):
        steps = vars(self).get(_ATTR)
        if steps is None:
            return base_call(self, *args, **kwargs)
        with steps.session(self):
            return base_call(self, *args, **kwargs)

    return same_name_subclass(cls, {"__call__": __call__, "_sd_kernels_whole_step": True})


def install(pipe: object, graphed: Any, record: PatchRecord) -> WholeStep | None:
    """Give ``pipe`` whole-step graphs around its graphed UNet call (``graphed``: the UNet's
    ``GraphedCall``, patches/cuda_graph.py); None (and a skip in the record)
    where its class is not one whose loop is re-stated here."""
    reason = supported_reason(pipe)
    if reason is not None:
        record.skip("", type(pipe).__name__, f"cuda_graph='step' replays the UNet alone: {reason}")
        log.warning("sd_kernels: cuda_graph='step': %s; the pipeline mode's graphs run instead", reason)
        return None
    steps = WholeStep(pipe, graphed, record)
    record.set_attr(graphed, "step_hook", steps, None)
    object.__setattr__(pipe, _ATTR, steps)
    record.on_undo(lambda: vars(pipe).pop(_ATTR, None), "whole_step", 0)
    cls = call_gate.class_of(pipe)
    if not getattr(cls, "_sd_kernels_whole_step", False):
        record.set_class(pipe, _step_class(cls), "whole_step")
    return steps
