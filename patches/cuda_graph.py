"""``patch(..., cuda_graph=...)``: a pipeline's model calls replayed from CUDA graphs, one per call signature.

Why: in eager mode a patched UNet step is bound by the host (each Triton launch costs more Python
time than an ATen one), so the kernels' device-time gain only shows when the whole step is replayed
from a CUDA graph, which costs one launch of host time. And a replayed step only pays if the host
never waits for the GPU: then the host queues step after step while the GPU works, and the
pipeline's own Python (scheduler, guidance, progress bar) hides behind the GPU's work.

Modes (``MODES``; ``cuda_graph=True`` means ``"pipeline"``):

- ``"pipeline"``: the denoiser's ``forward`` (the UNet's, or a DiT's transformer's: families.DENOISERS),
  the VAE's ``decode`` and the text encoders' ``forward`` each
  replayed from graphs, and the scheduler's timesteps kept on the host (patches/scheduler.py), which
  removes the host sync that diffusers' PNDM/DDIM steps make on every step.
- ``"step"``: all of ``"pipeline"``, and each denoising step of an SD/SDXL text-to-image pipeline
  (guidance batch, UNet, guidance combine, ``scheduler.step``) replayed from one graph
  (patches/whole_step.py; the UNet's ``GraphedCall`` hands its step calls to it).
- ``"unet"``: the denoiser's ``forward`` only (named for the UNet, the first denoiser).

``patch()`` asks ``resolve`` which mode a call means (``"auto"``: ``auto_mode``; a clear error where
the graphs asked for cannot be captured) and ``install_mode`` installs it.

``GraphedCall`` replaces one method of a model (an instance attribute set through the record, so
``unpatch`` removes it and the graphs with it). On each call it:

1. normalises the arguments as the model would see them: a Python-number ``timestep`` becomes the
   tensor diffusers itself would make of it (int64 or float64; on the host, copied in below), and
   arguments the method ignores (``vae.decode``'s ``generator``) are dropped;
2. flattens positional and keyword arguments with torch's pytree (``added_cond_kwargs`` dicts of
   SDXL, ``encoder_hidden_states``, ``return_dict``, ``cross_attention_kwargs=None`` …): the tensor
   leaves' (shape, strides, dtype, device) and every other leaf's value, with the tree's structure,
   make the signature;
3. on a new signature: copies the inputs into static buffers; the first time, compiles the Triton kernels the call
   needs in parallel (``sd_kernels.runtime.precompile``: a dry run of the eager method records them, a thread pool
   compiles them; no longer tried once a dry run found nothing to compile); runs one warm-up call on a side stream
   (Triton autotuning, torch.compile, cuDNN/cuBLAS set-up happen there, outside the capture), then captures one call
   into a graph that draws from a memory pool shared by all of this model's graphs. Each of those runs gets argument
   containers of its own and finds every static tensor marked changed (``graph_capture.fresh_call``): diffusers'
   UNet pops a T2I-Adapter's residuals off its list, which would leave the captured call without them (FLUX and SD3
   take an IP-Adapter's embeddings off a copy of their dict: tested for FLUX), and what the warm-up kept on a static
   input by version counter (FP8 codes of the text) must not stand in for the captured call's own work;
4. copies the inputs into that signature's static buffers (a small host tensor — a timestep on the
   host — through pinned memory, asynchronously: the host does not wait), replays, and returns
   **clones** of the outputs, so that the next replay (which rewrites the static outputs) cannot
   change what an earlier call returned. The clone of a latent is a few hundred kB: negligible.

A call made under ``torch.inference_mode()`` is prepared, captured and replayed outside it, autograd off
(``modes.outside_inference_mode``): its static buffers and outputs are normal tensors, so calls in and out of
inference mode share one graph per signature, and the captured call takes the paths that check tensors by
version counter. Eager calls keep the caller's mode.

Under ``torch.compile`` the wrapper steps aside (compile's mode="reduce-overhead" is its own way to
graph a model); ``patch(..., compile=True)`` instead compiles the method that the graphs capture.
Calls that cannot be captured run eagerly (logged once per reason): autograd enabled, a tensor
argument on another device (a host tensor of at most ``HOST_NUMEL`` elements is fine: it is copied
in), a non-tensor argument that is not hashable, or a capture that raised while the same call runs
eagerly (a call the model itself refuses — an IP-Adapter image embedding of the wrong size, say —
raises the model's own error, and nothing is remembered for that signature). The graphs hold the
weights by address: in-place weight changes (``load_state_dict``) show in the next replay; what a
call reads on the host and bakes into the graph is checked on every call and drops the graphs when
it changed: the module tree (``load_lora_weights`` adds modules, seen in ``peft_config``), moved
weights (``.to(...)``, seen in the parameters' and buffers' addresses; the first call after a move
runs eagerly and the next captures, so weights moved around every call — SDXL's fp32 VAE upcast —
never pay for a capture they will not replay), the adapters' activation, scales, disabling
and fusing (``set_adapters``, ``disable_lora``, ``fuse_lora``), the attention processors, their
``scale`` and the attention backend diffusers' dispatch would run (``set_attn_processor``,
``set_ip_adapter_scale``, ``set_attention_backend``, the ``attention_backend`` context manager: FLUX's
processors read them); offloading hooks added after the patch make the calls eager, and so does a forward
(pre-)hook on any module inside the model or on every module (``register_forward_hook``,
``register_module_forward_hook``), added before or after a capture: a replay would not run it (the model's
own hooks run around the graphed call). The patch's own hooks, others marked ``hooks.replay_safe`` and
transformers' output-capturing hooks (``hooks.REPLAY_SAFE_MODULES``) are captured with the call.

A model under diffusers' context parallelism (``enable_parallelism``) is not graphed by default: its
forward runs collectives (Ulysses' all-to-alls, the ring's exchange, the output's all-gather) that a
capture bakes into the graph, and a process that then ends its process group while such graphs are alive
does not exit. ``cuda_graph="auto"`` then captures nothing, ``cuda_graph=True`` is refused, and a model
graphed before ``enable_parallelism`` runs eagerly from then on. ``SD_KERNELS_GRAPH_COLLECTIVES=1`` (set
alike on every process; the command line's ``generate --parallel ulysses|ring`` sets it) lifts that: the
calls are captured with their collectives inside the graphs (``collectives_captured``), and the caller
unpatches (releasing the graphs) before ``destroy_process_group()``. diffusers'
hooks wrap the ``GraphedCall`` they find as the model's ``forward``; unpatch hands them the
original method in its place (``_release``), so the model is left as ``enable_parallelism`` would have
left a model never patched.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree
from torch.utils.hooks import RemovableHandle

from sd_kernels.profiles import scoped
from sd_kernels.runtime import precompile

from . import execution_device, whole_step
from .families import DENOISERS, GRAPH_PARTS, PARTS, family_of, is_denoiser
from .graph_capture import HOST_NUMEL, capture, copy_in, fresh_call, timestep_tensor
from .hooks import registrations, replay_skipped, watch_registrations
from .modes import outside_inference_mode
from .scheduler import host_timesteps

log = logging.getLogger(__name__)

MODES = ("pipeline", "unet", "step")
PIPELINE_MODES = ("pipeline", "step")  # the modes that graph the whole pipeline's model calls
AUTO = "auto"  # patch()'s default: "pipeline" where the UNet can be captured and the profile has no budget
# patch(compile=...): the torch.compile mode of what the graphs capture, by the name patch() takes.
# Inductor's own CUDA graphs stay off: ours capture the compiled call.
COMPILE_MODES = {"default": "default", "max-autotune": "max-autotune-no-cudagraphs"}
# The text encoders compile= compiles as well (beside the patched families' calls): T5-XXL (PixArt,
# SD3, FLUX), whose compiled replay is about 40% faster for ~50 s of compilation; CLIP's stay eager in
# their graphs, 0.2-0.4 ms not being worth 10 and 33 s (H100 figures: docs/patch.md, compile=).
COMPILED_TEXT_ENCODERS = ("T5EncoderModel",)
# The UNet2DConditionModel.forward argument diffusers turns into a tensor itself when given a number.
_TIMESTEP = "timestep"


def mode_of(value: Any) -> str | None:
    """The graph mode ``cuda_graph=value`` asks for (None: no graphs; ``AUTO`` is resolved by
    ``auto_mode``); a clear error for anything else."""
    if value is None or value is False:
        return None
    if value is True:
        return MODES[0]
    if isinstance(value, str) and value in (*MODES, AUTO):
        return value
    raise ValueError(f"cuda_graph={value!r}: choose False, True (= {MODES[0]!r}) or one of "
                     f"{', '.join(map(repr, (*MODES, AUTO)))}")


def compile_of(value: Any) -> str | None:
    """The compile mode ``compile=value`` asks for (None: not compiled); a clear error for anything else."""
    if value is None or value is False:
        return None
    if value is True:
        return "default"
    if isinstance(value, str) and value in COMPILE_MODES:
        return value
    raise ValueError(f"compile={value!r}: choose False, True (= 'default') or one of "
                     f"{', '.join(map(repr, COMPILE_MODES))}")


def auto_mode(unets: list[nn.Module], profile: Any) -> tuple[str | None, str]:
    """(what ``cuda_graph="auto"`` means here, why): the pipeline mode where every UNet can be
    captured, none where one cannot (off CUDA, offloaded) or the profile caps memory (a graph's pool
    keeps every intermediate of its call for the next replay)."""
    if profile.memory_budget_mb is not None or profile.intermediate_budget_mb is not None:
        return None, f"profile {profile.name!r} caps memory"
    reasons = [r for r in map(graphable_reason, unets) if r is not None]
    if not unets or reasons:
        return None, reasons[0] if reasons else "no denoiser (UNet, DiT transformer) to capture"
    return MODES[0], f"the {type(unets[0]).__name__} is on CUDA"


def context_parallel(model: Any) -> bool:
    """Whether diffusers' context parallelism is on for ``model`` (``enable_parallelism``; it also sets its
    config on the attention processors it splits, which this reads as well)."""
    return getattr(getattr(model, "_parallel_config", None), "context_parallel_config", None) is not None


COLLECTIVES_ENV = "SD_KERNELS_GRAPH_COLLECTIVES"
# Why a model under context parallelism runs eagerly (module docstring).
CONTEXT_PARALLEL = ("it runs under diffusers' context parallelism (enable_parallelism), whose collectives a capture "
                    f"would bake into the graph ({COLLECTIVES_ENV}=1 on every process captures them; unpatch before "
                    "the process group ends)")


def collectives_captured() -> bool:
    """Whether calls under context parallelism are captured too, their NCCL collectives inside the graphs
    (``SD_KERNELS_GRAPH_COLLECTIVES=1``; every process must set it alike: a process that replays a graph
    waits in its collectives for the others'). Off by default in the library; the command line's
    ``generate --parallel ulysses|ring`` sets it."""
    return os.environ.get(COLLECTIVES_ENV, "0") == "1"


# On a VAE whose decode is split over processes (patches/split_decode.py): its calls run collectives too.
SPLIT_DECODE = "_sd_kernels_split_decode"
SPLIT = (f"its decode is split over processes (enable_split_decode), whose collectives a capture would bake into "
         f"the graph ({COLLECTIVES_ENV}=1 on every process captures them; unpatch before the process group ends)")


def runs_collectives(model: Any) -> str | None:
    """Why ``model``'s calls run collectives (context parallelism, a split decode), or None."""
    if context_parallel(model):
        return CONTEXT_PARALLEL
    return SPLIT if getattr(model, SPLIT_DECODE, False) else None


def _parallel_blocks_capture(model: Any) -> str | None:
    return None if collectives_captured() else runs_collectives(model)


def graphable_reason(model: nn.Module) -> str | None:
    """Why ``model`` cannot be run from CUDA graphs, or None if it can."""
    if why := _parallel_blocks_capture(model):
        return f"cannot capture the {type(model).__name__}: {why}"
    devices = sorted({str(p.device) for p in model.parameters()})
    if len(devices) != 1 or not devices[0].startswith("cuda"):
        return (f"needs the {type(model).__name__} on one CUDA device; its parameters are on "
                f"{', '.join(devices) or 'no device'} (move the pipeline with .to('cuda') first)")
    if hasattr(model, "_hf_hook"):
        return (f"cannot capture a {type(model).__name__} under accelerate hooks (CPU offload moves weights "
                "during the call); disable offloading first")
    return None


def check_graphable(model: nn.Module) -> None:
    """Raise a clear error if ``model`` cannot be run from CUDA graphs."""
    reason = graphable_reason(model)
    if reason is not None:
        raise ValueError(f"cuda_graph=True {reason}")


def check_request(cuda_graph: Any, compile: Any) -> None:
    """A clear error for a ``cuda_graph=`` / ``compile=`` that no pipeline could honour (before
    anything else is looked at)."""
    mode = mode_of(cuda_graph)
    if compile_of(compile) and mode is None:
        raise ValueError(f"compile={compile!r} compiles what the CUDA graphs capture: pass cuda_graph=True too "
                         "(or torch.compile the patched model yourself)")


def resolve(cuda_graph: Any, compile: Any, denoisers: list[nn.Module], profile: Any, plan: Any, owner: str,
            ignore: Iterable[str]) -> tuple[str | None, str | None]:
    """(graph mode, compile mode) of ``patch(cuda_graph=..., compile=...)`` for a patch of ``denoisers``
    (the models every graph mode captures) under ``profile`` and its memory ``plan``: ``AUTO`` resolved
    (``auto_mode``, logged), and a clear error where the graphs asked for cannot be captured (``owner``
    names what is patched)."""
    mode, compiled = mode_of(cuda_graph), compile_of(compile)
    if plan is not None and plan.swapped and mode not in (None, AUTO):
        raise ValueError(f"cuda_graph={cuda_graph!r}: under profile {profile.name!r} the pipeline's weights are moved "
                         "in and out for each component's call (they do not fit the budget at once), and a CUDA "
                         "graph reads weights where they were at capture")
    if mode == AUTO:
        mode, why = auto_mode(denoisers, profile)
        if compiled and mode is None:
            raise ValueError(f"compile={compile!r} compiles what the CUDA graphs capture, and cuda_graph='auto' "
                             f"captures nothing here ({why})")
        log.info("sd_kernels: cuda_graph='auto' -> %s (%s)", mode, why)
    if mode and not denoisers:
        raise ValueError(f"cuda_graph=True captures the denoiser, but there is no {' or '.join(DENOISERS)} to patch "
                         f"in {owner} (ignore={tuple(ignore)})")
    for model in denoisers if mode else ():
        check_graphable(model)
    return mode, compiled


# Why a call after the weights moved runs eagerly (a capture costs about two calls; SDXL's pipeline
# moves its VAE to fp32 and back around every decode, so a capture there would never be replayed).
MOVED = ("its weights moved since the last call; the next call with them in place captures (weights that "
         "move around every call, like the SDXL pipeline's fp32 upcast of its VAE, keep it eager)")

# Model attributes a call reads on the host: the VAE's enable_tiling() / enable_slicing().
_MODEL_FLAGS = ("use_tiling", "use_slicing")


def _active_attention_backend() -> Any:
    """The attention backend diffusers' dispatch runs when a processor names none (None where that
    module was never imported)."""
    dispatch = sys.modules.get("diffusers.models.attention_dispatch")
    return None if dispatch is None else dispatch._AttentionBackendRegistry._active_backend


# What an Attention module's processor reads from it on each call, baked into a capture: a division by
# ``rescale_output_factor`` (skipped at 1: patches/attention_processor_steps.py) and the residual connection.
_ATTENTION_FLAGS = ("rescale_output_factor", "residual_connection")


class _Watch:
    """The Python-side state a captured call bakes in and a user may change between calls: the
    attention processors (``set_attn_processor``, IP-Adapter's, with their ``scale`` and the backend
    set on them or for the process, which processors that call diffusers' dispatch read; the attention modules'
    ``_ATTENTION_FLAGS``) and, once peft
    adapters are loaded, every tuner layer's active adapters, scales, disabled flag and merged
    adapters (``set_adapters`` with names or weights, ``disable_lora``, ``fuse_lora``, LoRA
    hot-swap), the VAE's tiling and slicing switches, and the weights behind state that a patched
    module derives from them (``graph_state()``: Winograd's transformed weights, stale after an
    in-place ``load_state_dict``). The modules to read are found once per module tree (the peft
    config's adapters name it)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.tree: tuple | None = None
        self.named: list[tuple[str, nn.Module]] = []
        self.attention: list[nn.Module] = []
        self.tuners: list[nn.Module] = []
        self.derived: list[nn.Module] = []
        self.held: list[dict] = []  # each module's _parameters and _buffers: where the tensors are held
        self.handles = None  # torch's hook handle counter (and diffusers' registrations) when last read
        self.skipped: str | None = None  # ...and the hook a replay would skip that they held

    def _find(self, tree: tuple) -> None:
        self.tree = tree
        self.handles = None
        self.named = list(self.model.named_modules())[1:]  # the model's own hooks run around the graphed call
        # the modules holding tensors (containers hold none): the tensors are read from these on every call
        self.held = [held for m in self.model.modules() for held in (m._parameters, m._buffers) if held]
        self.attention = [m for m in self.model.modules() if hasattr(m, "processor")]
        self.tuners = [m for m in self.model.modules() if hasattr(m, "merged_adapters")] if tree else []
        self.derived = [m for m in self.model.modules() if hasattr(m, "graph_state")]

    def state(self, tree: tuple) -> tuple:
        if tree != self.tree:
            self._find(tree)
        procs = tuple((id(p := m.processor), repr(getattr(p, "scale", None)), getattr(p, "_attention_backend", None),
                       *(getattr(m, name, None) for name in _ATTENTION_FLAGS))
                      for m in self.attention)
        flags = (*(getattr(self.model, f, None) for f in _MODEL_FLAGS), _active_attention_backend())
        tuners = tuple((repr(getattr(m, "_active_adapter", None)), repr(getattr(m, "scaling", None)),
                        getattr(m, "_disable_adapters", None), tuple(m.merged_adapters)) for m in self.tuners)
        return procs, tuners, flags, tuple(m.graph_state() for m in self.derived)

    def hook(self, tree: tuple, again: bool = False) -> str | None:
        """A forward hook on the model's modules (or on every module), or a diffusers hook on them, that a replay
        would skip, or None (``hooks.replay_skipped``). Registering a forward hook takes a handle from torch's
        counter, and a diffusers hook is counted while graphs watch (``hooks.registrations``), so the modules are
        read again when either moved; while they hold such a hook, on every call (a removal moves nothing); and
        with ``again``, before each capture."""
        if tree != self.tree:
            self._find(tree)
        handles = (RemovableHandle.next_id, registrations())
        if again or handles != self.handles or self.skipped is not None:
            self.handles, self.skipped = handles, replay_skipped(self.named)
        return self.skipped

    def placement(self, tree: tuple) -> tuple[int | None, ...]:
        """Every parameter's and buffer's address: the graphs read them there. Read from the modules' slots on every
        call, so that a Parameter or buffer set anew (``module.weight = nn.Parameter(...)``,
        ``load_state_dict(assign=True)``), added or removed is seen: a replay would read the one it replaced."""
        if tree != self.tree:
            self._find(tree)
        return tuple([None if t is None else t.data_ptr() for held in self.held for t in held.values()])


def _model_state(model: nn.Module, watch: _Watch) -> tuple:
    """What invalidates captured graphs: peft adapters added or removed (the module tree changes with
    them), the weights moved or set anew (``.to(device or dtype)``, offloading, ``module.weight =
    nn.Parameter(...)``: the graphs read every parameter and buffer by address), what ``watch`` reads
    (adapter switches and scales, fused LoRA, swapped processors), and context parallelism or a split
    decode turned on (a graph captured before holds no collectives)."""
    cfg = getattr(model, "peft_config", None)
    tree = tuple(sorted(cfg)) if isinstance(cfg, dict) else ()
    return tree, watch.placement(tree), hasattr(model, "_hf_hook"), watch.state(tree), runs_collectives(model)


def _writable(x: torch.Tensor) -> torch.Tensor:
    """x, or a copy of it where it is an inference tensor and the call runs outside inference mode (which may not
    change it in place)."""
    return x.clone() if x.is_inference() and not torch.is_inference_mode_enabled() else x


class _Graph:
    """One captured call: static inputs (the tensor leaves), the graph, the static outputs."""

    def __init__(self, fn, tree: pytree.TreeSpec, leaves: list, device: torch.device, pool, stream) -> None:
        # On the model's device (a host timestep too: the model's own .to(device) is then a no-op),
        # in the argument's strides (clone keeps them).
        self.static = [x.to(device).clone() if isinstance(x, torch.Tensor) else x for x in leaves]

        def run():  # the warm-up and the captured call each on arguments of their own (``fresh_call``)
            args, kwargs = fresh_call(self.static, tree)
            return fn(*args, **kwargs)

        self.graph, self.out = capture(run, pool, stream)

    def __call__(self, leaves: list) -> Any:
        for dst, src in zip(self.static, leaves):
            if isinstance(dst, torch.Tensor):
                copy_in(dst, src)
        self.graph.replay()
        return pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, self.out)


class GraphedCall:
    """One method of a model (``forward``, ``decode``), replayed from a CUDA graph per call signature
    (see the module docstring). ``fn`` is what the graphs capture (the method, or a compiled version
    of it); ``drop`` names keyword arguments the method ignores; ``timestep``: the second argument is
    a UNet's timestep (a number becomes the tensor diffusers makes of it)."""

    profile_scoped = True  # captures and eager fallbacks run under the patch's profile
    replays_outside_inference_mode = True  # read by patches/modulation_table.py (no import: a duck type)

    def __init__(self, model: nn.Module, fn, label: str, drop: Iterable[str] = (), timestep: bool = False,
                 eager=None) -> None:
        check_graphable(model)
        self.forward = fn
        self.eager_fn = eager if eager is not None else fn  # what a precompile dry run calls (not compiled)
        self.precompile = True  # False: captures without a dry run first (tests set it)
        precompile.start_workers()  # SD_KERNELS_COMPILE_PROCESSES: compiler processes, started long before a dry run
        self.label = label
        self.drop = tuple(drop)
        self.timestep = timestep
        self.device = next(model.parameters()).device
        self.model_ref = model
        self.graphs: dict[Any, _Graph] = {}
        self.eager_keys: dict[Any, Any] = {}  # signature whose capture failed -> the function it runs
        self.pool = torch.cuda.graph_pool_handle()  # shared by all signatures' graphs
        self.stream = torch.cuda.Stream(self.device)  # the side stream captures run on
        self.watch = _Watch(model)
        self.state = _model_state(model, self.watch)
        self._logged: set[str] = set()
        self.step_hook = None  # cuda_graph="step": the pipeline's WholeStep (patches/whole_step.py)
        self.moved_dry_run = False  # whether a call with moved weights had its precompile (see __call__)

    def __repr__(self) -> str:
        return f"GraphedCall({self.label}, {len(self.graphs)} graphs)"

    def reset(self) -> None:
        """Drop every captured graph (the next call of each signature captures anew), the whole-step
        graphs that capture this call too."""
        self.graphs.clear()
        self.eager_keys.clear()
        if self.step_hook is not None:
            self.step_hook.reset()

    def _eager(self, reason: str, args, kwargs, level: int = logging.WARNING) -> Any:
        self._eager_note(reason, level)
        if runs_collectives(self.model_ref) is SPLIT:  # a split decode reads values back: not for torch.compile
            return self.eager_fn(*args, **kwargs)
        return self.forward(*args, **kwargs)

    def _eager_note(self, reason: str, level: int = logging.WARNING) -> None:
        if reason not in self._logged:
            self._logged.add(reason)
            log.log(level, "sd_kernels: cuda_graph: running the %s eagerly: %s", self.label, reason)

    def signature(self, leaves: list, tree: pytree.TreeSpec) -> tuple[Any, str | None]:
        parts = []
        for x in leaves:
            if isinstance(x, torch.Tensor):
                if x.device != self.device and not (x.device.type == "cpu" and x.numel() <= HOST_NUMEL):
                    return None, f"a tensor argument on {x.device}, the model on {self.device}"
                parts.append((tuple(x.shape), tuple(x.stride()), x.dtype, x.device))
            else:
                try:
                    hash(x)
                except TypeError:
                    return None, f"an unhashable argument of type {type(x).__name__}"
                parts.append((type(x), x))
        return (tree, tuple(parts)), None

    def eager_reason(self) -> tuple[str, int] | None:
        """(why this call must run eagerly, log level), or None where captured graphs may replay. Drops
        every graph (``reset``) when the model changed since the last call (see ``_model_state``)."""
        if torch.is_grad_enabled():
            return "autograd is enabled (capture only runs under torch.no_grad / inference_mode)", logging.WARNING
        if why := _parallel_blocks_capture(self.model_ref):
            return why, logging.INFO
        state = _model_state(self.model_ref, self.watch)
        if state != self.state:  # the captured kernels would run stale modules or read freed weights
            moved = state[0] == self.state[0] and state[1] != self.state[1]  # same modules, new places
            self.reset()
            self.state = state
            if moved:  # capture only once the weights stay put for a second call: never for every call
                return MOVED, logging.INFO
        if state[2]:
            return "accelerate hooks (offloading) move the weights during the call", logging.WARNING
        if hook := self.watch.hook(state[0]):  # captured, the call would run it once, at the capture
            return f"{hook}: a graph's replay would not run it", logging.WARNING
        return None

    def prepare(self, leaves: list, tree: pytree.TreeSpec) -> None:
        """Before each signature's capture: compile, in parallel, the Triton kernels a call on these
        arguments needs (a precompile dry run of the eager method). Every new signature gets one: a new
        size or batch can need new specializations (sizes divisible by 16 or not, other plans), which
        would otherwise compile one by one in the capture's warm-up call; a dry run that finds nothing
        costs one eager call beside the capture's own."""
        if self.precompile:  # on the inputs as the graph will hold them: a host timestep on the device
            dry_args, dry_kwargs = pytree.tree_unflatten(  # inference tensors copied: outside inference mode
                [_writable(x.to(self.device)) if isinstance(x, torch.Tensor) else x for x in leaves], tree)
            precompile.precompile(lambda: self.eager_fn(*dry_args, **dry_kwargs), self.device)

    def normalise(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The arguments as the graphs take them: ignored keywords dropped, a number timestep made the
        tensor diffusers would make of it."""
        for name in self.drop:
            kwargs.pop(name, None)
        if self.timestep and args[1:2]:
            args = (args[0], timestep_tensor(args[1]), *args[2:])
        elif self.timestep and _TIMESTEP in kwargs:
            kwargs = {**kwargs, _TIMESTEP: timestep_tensor(kwargs[_TIMESTEP])}
        return args, kwargs

    @scoped
    def __call__(self, *args, **kwargs) -> Any:
        if torch.compiler.is_compiling():  # torch.compile traces the model itself (mode="reduce-overhead" graphs it)
            return self.forward(*args, **kwargs)
        if self.step_hook is not None:  # cuda_graph="step": the step's graph runs this call (patches/whole_step.py)
            out = self.step_hook.intercept(self, args, kwargs)
            if out is not None:
                return out
        args, kwargs = self.normalise(args, kwargs)
        leaves, tree = pytree.tree_flatten((args, kwargs))
        key, reason = self.signature(leaves, tree)
        level = logging.WARNING
        if reason is None:
            reason, level = self.eager_reason() or (None, level)
        if reason is MOVED and not self.moved_dry_run:
            # The first call with weights that moved (SDXL's VAE, upcast to fp32 for every decode) runs
            # eagerly; without a dry run its kernels would compile one after the other inside it (nine
            # for SDXL's decode at 1024²). Only the first: later moved calls at new sizes compile their
            # few new kernels inline, where a dry run each would cost one more eager call.
            self.moved_dry_run = True
            self.prepare(leaves, tree)
        if reason is not None:
            return self._eager(reason, args, kwargs, level)
        graph = self.graphs.get(key)
        if graph is None and key not in self.eager_keys:
            if hook := self.watch.hook(self.state[0], again=True):  # one the counter did not show
                return self._eager(f"{hook}: a graph's replay would not run it", args, kwargs, logging.WARNING)
            with outside_inference_mode():
                self.prepare(leaves, tree)
            try:
                with outside_inference_mode():
                    graph = self.graphs[key] = _Graph(self.forward, tree, leaves, self.device, self.pool,
                                                      self.stream)
            except Exception as exc:  # a capture that fails runs eagerly from then on, for this signature
                out, self.eager_keys[key], how = self._after_failed_capture(args, kwargs)
                self._eager_note(f"capture failed ({type(exc).__name__}: {exc}){how}")
                return out
        if graph is None:
            return self.eager_keys.get(key, self.forward)(*args, **kwargs)
        with outside_inference_mode():
            return graph(leaves)

    def _after_failed_capture(self, args, kwargs) -> tuple[Any, Any, str]:
        """(output, the function this signature runs from now on, a note) after a failed capture: the
        captured function run outside a graph; where that is a compiled one and raises too (a compiler
        failure at a new shape), the uncompiled method. A call the model refuses raises its own error
        from the last function tried."""
        try:
            return self.forward(*args, **kwargs), self.forward, ""
        except Exception as exc:
            if self.eager_fn is self.forward:
                raise
            failed = f"; compiled, it failed too ({type(exc).__name__}: {exc}), so it runs uncompiled"
        return self.eager_fn(*args, **kwargs), self.eager_fn, failed


def install(model: nn.Module, record, method: str = "forward", drop: Iterable[str] = (),
            compile: str | None = None) -> GraphedCall:
    """Replace ``model.<method>`` by a GraphedCall, through ``record`` (undone by ``unpatch``);
    ``compile`` (a ``COMPILE_MODES`` name): the graphs capture ``torch.compile(method, fullgraph=True)``
    in that mode."""
    eager = fn = getattr(model, method)
    if compile:
        fn = torch.compile(fn, fullgraph=True, mode=COMPILE_MODES[compile])
    fam = family_of(model)
    label = (fam.label if fam else type(model).__name__) + ("" if method == "forward" else f".{method}")
    graphed = GraphedCall(model, fn, label, drop, timestep=fam is not None and fam.timestep and method == fam.graphed,
                          eager=eager)
    record.set_attr(model, method, graphed, "cuda_graph")
    record.on_undo(lambda: _release(model, method, graphed, eager), "cuda_graph", count=0)
    record.on_undo(watch_registrations(), "cuda_graph", count=0)  # a diffusers hook registered after a capture
    return graphed


def install_mode(obj: object, models: list[tuple[str, nn.Module]], record) -> None:
    """The graphs of the record's mode (``resolve`` checked the denoisers graphable): the denoisers'
    calls; in the pipeline modes also the other models' graphed methods, the text encoders'
    ``forward``, the scheduler's host timesteps, the faster ``_execution_device`` and, for "step",
    the whole-step graphs."""
    mode, compile = record.cuda_graph, record.compile
    if not mode:
        return
    for _, model in models:
        if is_denoiser(model):
            fam = family_of(model)
            install(model, record, fam.graphed, fam.graph_drop, compile=compile)
    if mode not in PIPELINE_MODES:
        return
    record.scope = ""
    components = getattr(obj, "components", None) or {}
    calls = [(part, model, fam.graphed, fam.graph_drop) for part, model in models
             if not is_denoiser(model) and (fam := family_of(model)) is not None]
    calls += [(part, components[part], "forward", ()) for part in GRAPH_PARTS
              if part not in record.ignore and isinstance(components.get(part), nn.Module)]
    for part, model, method, drop in calls:
        reason = graphable_reason(model)
        if reason is not None:
            record.skip(part, type(model).__name__, f"not replayed from CUDA graphs: {reason}")
            continue
        compiled = part in PARTS or type(model).__name__ in COMPILED_TEXT_ENCODERS
        install(model, record, method, drop, compile=compile if compiled else None)
    device_steps = [f.device_timesteps for _, m in models if (f := family_of(m)) is not None
                    and f.denoiser and not f.host_timesteps]
    if record.scheduler is not None and device_steps:
        record.skip("scheduler", type(record.scheduler).__name__, f"timesteps stay on the device: {device_steps[0]}")
    elif record.scheduler is not None:
        host_timesteps(record.scheduler, record)
    execution_device.fast_execution_device(obj, record)
    unet = getattr(obj, "unet", None)
    if mode == "step" and not isinstance(getattr(unet, "__dict__", {}).get("forward"), GraphedCall):
        record.skip("", type(obj).__name__, "cuda_graph='step' needs the pipeline's UNet graphed: the pipeline mode's "
                    "graphs run instead")
    elif mode == "step":
        whole_step.install(obj, vars(unet)["forward"], record)


def _release(model: nn.Module, method: str, graphed: GraphedCall, original) -> None:
    """diffusers' hooks registered after the patch (``enable_parallelism``'s, a cache's) call the
    ``GraphedCall`` they found as ``model.<method>``: give them ``original`` in its place, and make the
    outermost wrapper's ``functools.update_wrapper`` attributes the ones it would have copied from
    ``original``."""
    registry = model.__dict__.get("_diffusers_hook")
    refs = getattr(registry, "_fn_refs", ())
    for ref in refs:
        for attr in ("forward", "original_forward"):
            if getattr(ref, attr, None) is graphed:
                setattr(ref, attr, original)
    outer = model.__dict__.get(method)
    if refs and outer is not graphed and getattr(outer, "__wrapped__", None) is graphed:
        for name, value in vars(graphed).items():
            if outer.__dict__.get(name) is value:
                del outer.__dict__[name]
        functools.update_wrapper(outer, original)
