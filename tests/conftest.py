"""Test set-up: Triton runs through its interpreter when there is no GPU.

TRITON_INTERPRET must be set before any kernel module is imported (triton.jit reads it when it
decorates), so this happens at the top of conftest, before the tests import sd_kernels.ops.
"""

import functools
import inspect
import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _skip_repatching_the_language() -> None:
    """Triton's interpreter re-patches ``triton.language`` at every call of a nested ``@triton.jit``
    function (``_patch_lang``), scanning each package with ``inspect.getmembers`` although the launch
    around it has already replaced every builtin: a third of the interpreter's time in kernels with
    helper functions. A package whose builtins are all replaced is remembered until a launch restores
    the language, so a nested call skips the scan that would find nothing to replace. What runs is
    unchanged; where the interpreter's internals differ (another Triton), nothing is changed."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    scan, scope = getattr(interpreter, "_patch_builtin", None), getattr(interpreter, "_LangPatchScope", None)
    if scan is None or scope is None or not callable(getattr(scope, "restore", None)):
        return
    done: set[int] = set()  # ids of the packages with no builtin left unreplaced
    restore = scope.restore

    def patch_builtin(pkg, builder, patch_scope):
        if id(pkg) not in done:
            scan(pkg, builder, patch_scope)
            done.add(id(pkg))

    def restore_all(self):
        done.clear()
        restore(self)

    interpreter._patch_builtin = patch_builtin
    scope.restore = restore_all


def _no_overflow_sanitizer() -> None:
    """Triton's interpreter checks every 32-bit integer add, subtract and multiply for overflow (its builder's
    ``sanitize_overflow``, on by default there; compiled kernels check only in debug mode): each such op runs again
    in int64 with two comparisons and an assert. At the tests' tiny shapes no index comes near 2³¹, so the check
    cannot fire, and it took a quarter of the interpreter's time in the FP8 kernels (a tiny FLUX transformer's call
    under the FP8 tier, 2.00 s with it, 1.45 s without). Where the interpreter's internals differ (another Triton),
    nothing is changed."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    import dataclasses

    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if dataclasses.is_dataclass(options) and getattr(options, "sanitize_overflow", None) is True:
        builder.options = dataclasses.replace(options, sanitize_overflow=False)


if not HAS_CUDA:
    _skip_repatching_the_language()
    _no_overflow_sanitizer()
    # One intra-op thread unless OMP_NUM_THREADS says otherwise: the tests' tensors are tiny, and two
    # OpenMP threads on a loaded two-core machine wait on each other far longer than they compute
    # (test_whole_step.py: 18 s of CPU with one, 350 s with two); tests in parallel processes each take one.
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"  # and the subprocesses some tests start
        torch.set_num_threads(1)

# Tests never read or write the user's autotune cache (sd_kernels.runtime.launch); the tests of the cache
# point it at a temporary directory themselves.
os.environ.setdefault("SD_KERNELS_AUTOTUNE_CACHE", "off")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: runs compiled Triton (bench/gpu.sh on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _process_attention_backend():
    """diffusers' ``set_attention_backend`` on a model also makes that backend the process's, which our
    processors step aside for: each test gets back the backend the process had before it."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry as registry

    active = registry._active_backend
    yield
    registry._active_backend = active


@pytest.fixture(scope="session")
def device() -> str:
    """Where kernels run in this session: the GPU if there is one, else the CPU interpreter."""
    return "cuda" if HAS_CUDA else "cpu"


@pytest.fixture(autouse=True)
def _graph_collectives_unset(monkeypatch):
    """Every test starts without SD_KERNELS_GRAPH_COLLECTIVES, and whatever a test's command line sets for its
    process (``generate --parallel ulysses|ring`` sets it) is undone after the test: set, then deleted, so
    that monkeypatch records the variable's state before the test (which a bare ``delenv`` of an unset
    variable does not) and restores it at the end."""
    monkeypatch.setenv("SD_KERNELS_GRAPH_COLLECTIVES", "")
    monkeypatch.delenv("SD_KERNELS_GRAPH_COLLECTIVES")


@pytest.fixture
def count_calls(monkeypatch):
    """``count_calls(module, label=attribute, ...)``: each named module attribute replaced by a wrapper
    that counts its calls under ``label`` (and reads any other attribute from the original: a launcher's
    methods); returns the counts (a dict, updated as calls happen), whose ``args[label]`` lists each call's
    arguments by name, as the original's signature binds them (defaults included)."""

    class Calls(dict):
        args: dict[str, list[dict]]

    class Spy:
        def __init__(self, real, label, seen):
            self.real, self.label, self.seen = real, label, seen

        def __call__(self, *a, **kw):
            self.seen[self.label] += 1
            try:
                bound = inspect.signature(self.real).bind(*a, **kw)
                bound.apply_defaults()
                named = dict(bound.arguments)
            except (TypeError, ValueError):  # no signature to bind to (a builtin)
                named = {"args": a, "kwargs": kw}
            self.seen.args[self.label].append(named)
            return self.real(*a, **kw)

        def __getattr__(self, name):
            return getattr(self.real, name)

        def __get__(self, obj, objtype=None):  # a spied method stays a method
            return self if obj is None else functools.partial(self, obj)

    def install(module, **attributes):
        seen = Calls.fromkeys(attributes, 0)
        seen.args = {label: [] for label in attributes}
        for label, name in attributes.items():
            monkeypatch.setattr(module, name, Spy(getattr(module, name), label, seen))
        return seen

    return install
