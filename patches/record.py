"""Bookkeeping that makes a patch exactly reversible, and says what it changed and what it left alone.

Every change the patch makes to a model goes through ``PatchRecord.set_attr``, which remembers what
was there before. ``undo`` replays those memories in reverse, so the model ends up holding the very
objects it held before (same modules, same processors, same parameters) and computes bit-identical
outputs. Nothing is copied: replacement modules hold references to the original parameters and
submodules.

Changes made by others after the patch are kept, not dropped:

* A replacement shares the original's submodules and parameters by name (FusedGEGLU's ``proj``,
  FusedGroupNorm's ``weight``). If one of those slots was filled anew while patched (peft's LoRA
  wraps ``proj`` in a ``lora.Linear``; ``load_state_dict(assign=True)`` puts new Parameters), undo
  moves the new occupant into the original, which then holds exactly what a never-patched model
  would hold after the same change.
* If the slot that holds a replacement now holds something else that wraps it (a wrapper whose
  subtree contains the replacement, e.g. peft's ``base_layer``), undo puts the original inside that
  wrapper in the replacement's place. If the replacement is gone altogether, the new occupant stays.
* An attribute (a processor, a rebound ``forward``) that someone set anew after the patch stays.

What a patcher deliberately leaves alone (custom attention processors, GroupNorm subclasses, an
unknown diffusers version's forward) is listed with ``skip``; ``format`` reports both lists.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch.nn as nn

from . import call_gate

log = logging.getLogger(__name__)
_MISSING = object()


def set_instance_attr(obj: Any, name: str, value: Any, undoer: str = "unpatch",
                      after: str = "the patch") -> Callable[[], None]:
    """``obj.name = value`` as an instance attribute (``object.__setattr__``: past an nn.Module's
    own ``__setattr__``); returns what puts back what was there (or removes the attribute when
    nothing was), unless the attribute was set anew meanwhile: then it stays, and ``undoer`` logs
    that it left it alone."""
    old = obj.__dict__.get(name, _MISSING)
    object.__setattr__(obj, name, value)

    def restore() -> None:
        if obj.__dict__.get(name, _MISSING) is not value:
            log.warning("sd_kernels: %s left %s.%s alone: it was set anew after %s", undoer, type(obj).__name__,
                        name, after)
        elif old is _MISSING:
            object.__delattr__(obj, name)
        else:
            object.__setattr__(obj, name, old)

    return restore


def refuse_deepcopy(self, memo: dict) -> Any:
    """``__deepcopy__`` of an object a patch holds that must not be copied: say why, as the record does."""
    raise TypeError(f"this {type(self).__name__} " + PatchRecord._REFUSED.format(what="a deep copy of", result="copy"))


def refuse_pickle(self, protocol: Any) -> Any:
    """``__reduce_ex__`` of a class a patch gave an object (not importable by its name): say why, as the record does."""
    raise TypeError(f"this {type(self).__name__} " + PatchRecord._REFUSED.format(
        what="a pickle (torch.save) of", result="loaded one"))


def same_name_subclass(cls: type, namespace: dict[str, Any], mixins: tuple[type, ...] = ()) -> type:
    """A subclass of ``cls`` (after ``mixins``) with ``namespace`` added, under ``cls``'s name, module, qualified name
    and docstring, so that the object reads as before in reprs and ``type(obj).__name__`` checks; pickling one is
    refused (``refuse_pickle``): its class cannot be found by that name."""
    return type(cls.__name__, (*mixins, cls), {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                                "__doc__": cls.__doc__, "__reduce_ex__": refuse_pickle, **namespace})


@dataclasses.dataclass(frozen=True)
class Skipped:
    """One module the patch left alone: where, what it is, why."""

    path: str
    what: str
    reason: str


def _shared_slots(old: nn.Module, new: nn.Module) -> list[tuple[str, str]]:
    """(dict, name) of the submodules and parameters ``new`` holds as the very objects ``old`` holds."""
    return [(d, name) for d in ("_modules", "_parameters") for name, value in getattr(new, d).items()
            if value is not None and getattr(old, d).get(name) is value]


def _replace_inside(wrapper: nn.Module, target: nn.Module, value: nn.Module) -> bool:
    """Put ``value`` where ``target`` sits in ``wrapper``'s subtree; False if it is not there."""
    for parent in wrapper.modules():
        for name, child in parent._modules.items():
            if child is target:
                parent._modules[name] = value
                return True
    return False


class PatchRecord:
    def __init__(self, ops: tuple[str, ...], profile: str, parts: list[str], cuda_graph: str | None = None,
                 compile: str | None = None, *, profile_spec: Any = None, models: list[nn.Module] = (),
                 ignore: tuple[str, ...] = (), scheduler: object = None, memory_plan: Any = None,
                 target: object = None, parallel: str | None = None, precision: str | None = None) -> None:
        self.ops = ops
        self.profile = profile  # the profile's name
        self.parts = parts
        self.cuda_graph = cuda_graph  # the graph mode (patches/cuda_graph.py MODES), None for none
        self.compile = compile  # the compile mode (patches/cuda_graph.py COMPILE_MODES), None for none
        self.parallel = parallel  # the split over processes (patches/cfg_parallel.py MODES), None for none
        self.precision = precision  # "fp8": the blocks' linears as FP8 GEMMs (patches/fp8.py); None: lossless
        self.quantized: Any = None  # with precision: what was quantized and its memory (a summary with format())
        self.profile_spec = profile_spec  # the Profile itself: the patchers read it, the patched modules run under it
        self.models = list(models)  # the models patched, in ``parts`` order
        self.ignore = ignore  # the parts patch() was told to leave alone
        self.scheduler = scheduler  # the scheduler given host timesteps (cuda_graph="pipeline")
        self.memory_plan = memory_plan  # under a memory budget: the weights checked against it (memory.BudgetPlan)
        self.target: Callable[[], Any] = weakref.ref(target) if target is not None else lambda: None
        self.counts: collections.Counter = collections.Counter()
        self.skipped: list[Skipped] = []
        self.scope = ""  # the pipeline part being patched: prefixes skipped modules' paths
        self._undo: list[Callable[[], None]] = []

    # A record's undo steps are closures over the very objects it patched: a copy of a patched model
    # would carry steps that undo the original. Copying or pickling one is refused with the way out.
    _REFUSED = ("is patched by sd_kernels: {what} it would carry a record that undoes the original's modules. "
                "Call sd_kernels.unpatch(obj) first, then patch the original and the {result} separately")

    @property
    def request(self) -> tuple:
        """What makes two patches the same: ``patch`` asked again for this one changes nothing. The
        whole profile, not its name (``dataclasses.replace(profile, attention=...)`` keeps the name),
        and the models themselves (a component replaced since is patched anew)."""
        return (self.ops, self.profile_spec, self.parts, self.ignore, self.cuda_graph, self.compile, self.scheduler,
                tuple(self.models), self.parallel, self.precision)

    @property
    def arguments(self) -> dict[str, Any]:
        """The arguments that make this patch again (``patched()`` re-applies a patch it displaced)."""
        return {"profile": self.profile_spec, "ops": self.ops, "ignore": self.ignore,
                "cuda_graph": self.cuda_graph or False, "compile": self.compile or False, "parallel": self.parallel,
                "precision": self.precision}

    def __deepcopy__(self, memo: dict) -> PatchRecord:
        raise TypeError("this object " + self._REFUSED.format(what="a deep copy of", result="copy"))

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError("this object " + self._REFUSED.format(what="a pickle (torch.save) of", result="loaded one"))

    def set_attr(self, obj: Any, name: str, value: Any, kind: str | None) -> None:
        """``obj.name = value``, remembered; ``kind`` names the replacement in the counts (None: not
        counted, for bookkeeping)."""
        self._scope(value, type(value))
        if isinstance(obj, nn.Module) and name in obj._modules:
            self._undo.append(self._swap_module(obj, name, value))
        else:
            self._undo.append(set_instance_attr(obj, name, value))
        if kind is not None:
            self.counts[kind] += 1

    def set_class(self, obj: Any, cls: type, kind: str) -> None:
        """``obj.__class__ = cls``, remembered: ``cls`` is a subclass of ``obj``'s class that adds
        behaviour, not state, so the object (and whatever is done to it while patched) stays the one
        the model holds; undo gives it its class back. ``kind`` names the change in the counts."""
        old = call_gate.class_of(obj)
        self._scope(obj, cls)
        call_gate.set_class(obj, cls)

        def restore() -> None:
            obj.__dict__.pop("_sd_profile", None)
            if call_gate.class_of(obj) is cls:
                call_gate.set_class(obj, old)
            else:
                log.warning("sd_kernels: unpatch left a %s alone: its class was changed after the patch",
                            type(obj).__name__)

        self._undo.append(restore)
        self.counts[kind] += 1

    def _scope(self, obj: Any, cls: type) -> None:
        """Objects of a class with ``profile_scoped`` run their scoped methods under this patch's profile."""
        if getattr(cls, "profile_scoped", False):
            object.__setattr__(obj, "_sd_profile", self.profile_spec)

    @staticmethod
    def _swap_module(parent: nn.Module, name: str, new: nn.Module) -> Callable[[], None]:
        old = parent._modules[name]
        shared = _shared_slots(old, new) if isinstance(old, nn.Module) and isinstance(new, nn.Module) else []
        parent._modules[name] = new

        def restore() -> None:
            for d, slot in shared:  # what was put into the replacement while patched moves to the original
                if getattr(new, d).get(slot) is not getattr(old, d).get(slot):
                    getattr(old, d)[slot] = getattr(new, d)[slot]
            current = parent._modules.get(name)
            if current is new:
                parent._modules[name] = old
            elif isinstance(current, nn.Module) and _replace_inside(current, new, old):
                log.info("sd_kernels: unpatch put the original %s back inside %s", type(old).__name__,
                         type(current).__name__)
            else:
                log.warning("sd_kernels: unpatch left %s.%s alone: it was replaced after the patch",
                            type(parent).__name__, name)

        return restore

    def on_undo(self, restore: Callable[[], None], kind: str, count: int = 1) -> None:
        """A change a patcher made by other means than ``set_attr`` (e.g. re-laid parameter data):
        ``restore`` undoes it, in reverse order with the rest; ``count`` changes of ``kind``."""
        self._undo.append(restore)
        if count:
            self.counts[kind] += count

    def skip(self, path: str, what: str, reason: str) -> None:
        """Note a module left alone on purpose (``sd-kernels info`` reports these)."""
        self.skipped.append(Skipped(".".join(p for p in (self.scope, path) if p), what, reason))

    def undo(self) -> None:
        while self._undo:
            self._undo.pop()()
        self.counts.clear()
        self.quantized = None

    def summary(self) -> str:
        parts = ", ".join(f"{k}: {n}" for k, n in sorted(self.counts.items()))
        graph = f", cuda_graph={self.cuda_graph}" if self.cuda_graph else ""
        graph += {None: "", "default": ", compile"}.get(self.compile, f", compile={self.compile}")
        graph += f", parallel={self.parallel}" if self.parallel else ""
        graph += f", precision={self.precision}" if self.precision else ""
        return f"sd_kernels patch (profile {self.profile}, ops {', '.join(self.ops)}{graph}): {parts or 'nothing'}"

    def __repr__(self) -> str:
        state = "applied" if self._undo else "undone"
        return (f"<PatchRecord {state}: profile={self.profile!r}, parts={self.parts}, cuda_graph={self.cuda_graph!r}, "
                f"compile={self.compile!r}, {sum(self.counts.values())} replacements, {len(self.skipped)} left alone>")

    def format(self, examples: int = 3) -> str:
        """The summary, then what was left alone grouped by (what, reason), with a few module paths."""
        lines = [self.summary()]
        if self.memory_plan is not None:
            lines.append(self.memory_plan.format())
        if self.quantized is not None:
            lines.append(self.quantized.format())
        groups: dict[tuple[str, str], list[str]] = collections.defaultdict(list)
        for s in self.skipped:
            groups[(s.what, s.reason)].append(s.path)
        if groups:
            lines.append("left alone:")
        for (what, reason), paths in sorted(groups.items()):
            more = f", … ({len(paths)} in all)" if len(paths) > examples else ""
            lines.append(f"  {what} ×{len(paths)}: {reason} [{', '.join(paths[:examples])}{more}]")
        return "\n".join(lines)
