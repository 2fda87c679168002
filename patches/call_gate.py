"""Patching and unpatching an object that other threads are calling: no call sees half a patch.

A patch changes hundreds of attributes one after another; a call running meanwhile on another
thread would run on whatever part is done (a norm fused with its SiLU while the SiLU after it still
runs: SiLU twice). ``exclusive(obj, models)`` brackets every ``patch`` and ``unpatch``:

1. **Hold off new calls.** The pipeline object and each model the change touches get, for the
   length of the change, a subclass of their own class (same name, module and qualified name) whose
   ``__call__`` waits until the change is done and then calls on as the class then is. A class swap
   is one assignment, so a call on another thread looks its ``__call__`` up either before it (and is
   then a call in flight, below) or after it (and waits). Once done, each object gets its class back,
   or the class the patch gave it (``set_class``: the record changes classes through it).
2. **Wait for calls in flight.** A call that started before the swap has no wrapper to count it. It
   is found in the threads' Python stacks (``sys._current_frames``): a frame whose receiver (first
   argument: ``self``, or the first of ``*args`` for a decorated ``__call__``) is the pipeline, one
   of its components or their submodules, or a pipeline that holds one of the models (pipelines
   sharing models). The change starts once no other thread has such a frame; calls nested inside
   a call in flight (the pipeline's own ``self.unet(...)``) pass the gate, the others wait, so a
   thread that calls again and again does not starve the change.
3. A patch asked for on a thread that is itself inside a call of the object (from a step callback)
   is refused: that call would go on half stock, half patched.

Every call of the pipeline (``pipe(...)``) and of a model it patches (``pipe.unet(...)``) therefore
runs entirely stock or entirely patched. Not held off: other entry points called straight from
another thread while a change runs (``pipe.vae.decode(...)``, ``pipe.encode_prompt(...)``, a
submodule); they are waited for when they were in flight first. Relies on CPython's global
interpreter lock (one class assignment is atomic to other threads).
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch.nn as nn

log = logging.getLogger(__name__)

_GATE = "_sd_kernels_gate"  # on a gated class: True
_LOCK = threading.Condition()  # guards _CHANGES (and waits for another thread's change of the same object)
_CHANGES: dict[int, _Change] = {}  # id(gated object) -> the change it is gated for
_POLL = (1e-4, 1e-2)  # the first and the longest pause between two looks at the threads' stacks


def class_of(obj: Any) -> type:
    """``type(obj)`` as it is outside a change (the class a gated object gets back)."""
    cls = type(obj)
    return cls.__bases__[0] if vars(cls).get(_GATE) else cls


def set_class(obj: Any, cls: type) -> None:
    """``obj.__class__ = cls``, keeping the gate of an object being changed."""
    obj.__class__ = _gated(cls) if vars(type(obj)).get(_GATE) else cls


def _gate_call(self, *args, **kwargs):
    while True:
        cls = type(self)
        if not vars(cls).get(_GATE):  # the change is over: call on as the class is now
            return cls.__call__(self, *args, **kwargs)
        change = _CHANGES.get(id(self))
        if change is None:  # gated a moment ago, its class given back since: look again
            continue
        if change.lets_through(sys._getframe(1)):
            return cls.__bases__[0].__call__(self, *args, **kwargs)
        change.done.wait()


_GATE_CODE = _gate_call.__code__


@functools.cache
def _gated(cls: type) -> type:
    return type(cls.__name__, (cls,), {"__call__": _gate_call, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__, "__doc__": cls.__doc__, _GATE: True})


def _receiver(frame) -> Any:
    """A frame's first argument (``self``; for ``def f(*args)``, ``args[0]``), or None."""
    code = frame.f_code
    if code.co_argcount:
        return frame.f_locals.get(code.co_varnames[0])
    if code.co_flags & inspect.CO_VARARGS:
        args = frame.f_locals.get(code.co_varnames[code.co_kwonlyargcount])
        return args[0] if isinstance(args, tuple) and args else None
    return None


@functools.cache
def _method_codes(cls: type) -> frozenset:
    """The code of every method (decorators' wrappers and what they wrap, property getters) of ``cls``:
    a frame whose receiver is an instance runs one of these while it runs a call of that object (a
    function such as ``patch(pipe)`` has ``pipe`` as its first argument too, and is no call of it)."""
    return frozenset(code for klass in cls.__mro__ for value in vars(klass).values() for code in _codes(value))


def _codes(value: Any) -> Iterator[Any]:
    """The code of a function, a decorator's wrapper and what it wraps, a property's getter."""
    value = value.fget if isinstance(value, property) else value
    for _ in range(8):
        if not callable(value) or isinstance(value, type):
            return
        code = getattr(value, "__code__", None)
        if code is not None:
            yield code
        value = getattr(value, "__wrapped__", None)


class _Change:
    def __init__(self, objects: list[Any], models: list[nn.Module]) -> None:
        self.owner = threading.get_ident()
        self.watched = {id(o) for o in objects}  # the objects whose calls the change must not run under
        self.models = models  # their submodules are watched too; a pipeline holding one of them as well
        self._submodules: set[int] | None = None  # ids of the models' modules, walked when first needed
        # The methods those calls run (a submodule's call runs nn.Module's, which are among them). Only
        # frames running one are read for their receiver: reading a frame's arguments (``f_locals``)
        # keeps a snapshot of all its locals until it returns, which for a long-lived frame (a
        # script's main loop) would keep what it deletes meanwhile alive.
        self.codes = frozenset().union(*map(_method_codes, {type(o) for o in objects}), _pipeline_call_codes())
        self.gated: list[Any] = []
        self.done = threading.Event()

    def _is_watched(self, receiver: Any, seen: dict[int, bool]) -> bool:
        key = id(receiver)
        if key in self.watched:
            return True
        if key not in seen:
            if isinstance(receiver, nn.Module):  # a submodule of one of the models
                if self._submodules is None:
                    self._submodules = {id(m) for model in self.models for m in model.modules()}
                seen[key] = key in self._submodules
            else:  # another pipeline that holds one of the models (they share it)
                held = getattr(receiver, "__dict__", None) if _is_pipeline(receiver) else None
                seen[key] = bool(held) and any(v is m for v in held.values() for m in self.models)
        return seen[key]

    def inside(self, frame, seen: dict[int, bool] | None = None) -> bool:
        """Whether the stack that ``frame`` tops runs a call of a watched object (the gate's frames aside)."""
        seen = {} if seen is None else seen
        while frame is not None:
            code = frame.f_code
            if code in self.codes and code is not _GATE_CODE:
                receiver = _receiver(frame)
                if (receiver is not None and self._is_watched(receiver, seen)
                        and code in _method_codes(type(receiver))):
                    return True
            frame = frame.f_back
        return False

    def lets_through(self, frame) -> bool:
        return threading.get_ident() == self.owner or self.inside(frame)

    def busy_threads(self) -> list[int]:
        seen: dict[int, bool] = {}
        return [tid for tid, frame in sys._current_frames().items()
                if tid != self.owner and self.inside(frame, seen)]


def _is_pipeline(obj: Any) -> bool:
    utils = sys.modules.get("diffusers.pipelines.pipeline_utils")
    return utils is not None and isinstance(obj, utils.DiffusionPipeline)


def _pipeline_call_codes() -> frozenset:
    """The code of every loaded pipeline class's ``__call__`` (and its decorators'): the frame a call of
    a pipeline that shares one of the models keeps open from its start to its end."""
    utils = sys.modules.get("diffusers.pipelines.pipeline_utils")
    classes, todo = set(), [utils.DiffusionPipeline] if utils is not None else []
    while todo:
        cls = todo.pop()
        if cls not in classes:
            classes.add(cls)
            todo.extend(cls.__subclasses__())
    return frozenset(code for cls in classes for code in _call_codes(cls))


@functools.cache
def _call_codes(cls: type) -> frozenset:
    return frozenset(_codes(vars(cls).get("__call__")))


def _watched(obj: Any, models: Iterable[nn.Module]) -> tuple[list[Any], list[nn.Module]]:
    """(``obj`` and its components, the models among them and ``models``)."""
    objects = [obj]
    held = getattr(obj, "components", None)
    if not isinstance(obj, nn.Module) and isinstance(held, dict):
        objects += [c for c in held.values() if c is not None]
    return objects, list({id(m): m for m in (*models, *objects) if isinstance(m, nn.Module)}.values())


def _names(threads: list[int]) -> str:
    names = {t.ident: t.name for t in threading.enumerate()}
    return ", ".join(names.get(tid, str(tid)) for tid in threads)


@contextmanager
def exclusive(obj: Any, models: Iterable[nn.Module], what: str = "patch") -> Iterator[None]:
    """Run the block (a ``what`` of ``obj``) with no call of ``obj`` or ``models`` in flight on another
    thread, new ones held off until it ends (module docstring); refused on a thread inside such a call."""
    models = list(models)
    gate = [obj, *(m for m in models if m is not obj)]
    me = threading.get_ident()
    with _LOCK:  # one change of an object at a time; a thread's own nested change (patch -> unpatch) joins it
        while any((c := _CHANGES.get(id(o))) is not None and c.owner != me for o in gate):
            _LOCK.wait()
        change = _Change(*_watched(obj, models))
        for o in gate:
            if id(o) not in _CHANGES:
                _CHANGES[id(o)] = change
                change.gated.append(o)
                set_class(o, _gated(class_of(o)))  # registered first: a gated class always finds its change
    try:
        if change.inside(sys._getframe()):
            raise RuntimeError(f"sd_kernels.{what}: called inside a call of this {type(obj).__name__} on the same "
                               f"thread (a step callback?): the call would go on half stock, half patched; "
                               f"{what} before or after the call")
        _wait_for(change, obj, what)
        yield
    finally:
        for o in change.gated:
            o.__class__ = class_of(o)
        with _LOCK:
            for o in change.gated:
                del _CHANGES[id(o)]
            _LOCK.notify_all()
        change.done.set()


def _wait_for(change: _Change, obj: Any, what: str) -> None:
    """Until no other thread runs a call of a watched object."""
    pause, start, told = _POLL[0], time.monotonic(), False
    while busy := change.busy_threads():
        if not told:
            told = True
            log.info("sd_kernels: %s of a %s waits for its calls in flight (threads %s); new calls wait for the %s",
                     what, type(obj).__name__, _names(busy), what)
        time.sleep(pause)
        pause = min(2 * pause, _POLL[1])
    if told:
        log.info("sd_kernels: %s of a %s: the calls in flight ended after %.2f s", what, type(obj).__name__,
                 time.monotonic() - start)
