"""sd_kernels.runtime.launch.Launcher: the first launch of a key goes through the autotuner, later ones skip it
with the same meta-parameters (runs on CPU through the interpreter); after that, the direct launch path
(on fakes of Triton's JIT pieces on CPU, on the real ones on the GPU)."""

import collections
import dataclasses
import importlib
import json
import logging
import os
import pathlib
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import triton
import triton.language as tl
from triton import knobs

from sd_kernels import profiles
from sd_kernels.runtime.dispatch import interpreting
from sd_kernels.runtime.launch import Launcher

launch_mod = importlib.import_module("sd_kernels.runtime.launch")
cache_mod = importlib.import_module("sd_kernels.runtime.autotune_cache")
direct_mod = importlib.import_module("sd_kernels.runtime.direct_launch")

# Autotuning between configs benchmarks them, which needs a GPU: the interpreter gets one config.
CONFIGS = [triton.Config({"BLOCK": 32}, num_warps=1)]
if not interpreting():
    CONFIGS.insert(0, triton.Config({"BLOCK": 16}, num_warps=1))


@triton.autotune(CONFIGS, key=["n"])
@triton.heuristics({"EVEN": lambda args: args["n"] % args["BLOCK"] == 0})
@triton.jit
def _scale_kernel(x_ptr, y_ptr, n, factor, BLOCK: tl.constexpr, EVEN: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    if EVEN:
        tl.store(y_ptr + offs, tl.load(x_ptr + offs) * factor)
    else:
        tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * factor, mask=offs < n)


@pytest.mark.parametrize("n", [48, 50])
def test_memo_launch_matches_autotuned_launch(n, device, monkeypatch):
    monkeypatch.setattr(cache_mod, "MODE", "time")  # the autotuner times the key (the default rule picks untimed)
    launch = Launcher(_scale_kernel)
    x = torch.randn(n, device=device)
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK"]),)
    outs = []
    for _ in range(3):
        y = torch.full_like(x, float("nan"))
        launch(n, grid, x, y, n, 3.0)
        outs.append(y)
    for y in outs:
        torch.testing.assert_close(y, x * 3.0)
    meta = launch.memo[n]
    assert meta["BLOCK"] == _scale_kernel.best_config.kwargs["BLOCK"]
    assert meta["EVEN"] == (n % meta["BLOCK"] == 0)
    assert meta["num_warps"] == 1


def test_memo_is_per_key(device):
    launch = Launcher(_scale_kernel)
    for n in (16, 17, 16):
        x = torch.randn(n, device=device)
        y = torch.empty_like(x)
        launch(n, lambda meta, n=n: (triton.cdiv(n, meta["BLOCK"]),), x, y, n, -1.0)
        torch.testing.assert_close(y, -x)
    assert sorted(launch.memo) == [16, 17]
    assert launch.memo[17]["EVEN"] is False


# ---------------------------------------------------------------------------------------------
# The direct launch path, on fakes of Triton's pieces (no GPU needed): a JIT function with a binder in
# its device_caches and a run that returns the compiled kernel, as Triton 3.6-3.9 have them.


class _FakeCompiled:
    """A CompiledKernel: ``run`` records its arguments (grid, stream, function, metadata, hooks, args)
    and calls the enter hook."""

    def __init__(self, launches, specialization):
        self.launches = launches
        self.specialization = specialization
        self.function = object()  # the loaded function's handle
        self.packed_metadata = ("packed", specialization)

    def run(self, *args):
        if args[7] is not None:  # the launch-enter hook, called with the launch metadata, as Triton's launcher
            args[7](args[6])
        self.launches.append(args)


class _FakeJit:
    """JITFunction's surface for the direct path; ``run`` binds, looks up or 'compiles', launches, as Triton's."""

    CompiledKernel = _FakeCompiled
    arg_names = ["x", "n", "factor", "BLOCK"]
    __name__ = "fake_kernel"

    def __init__(self):
        self.launches, self.runs, self.kernels = [], [], {}
        self.device_caches = collections.defaultdict(lambda: ({}, {}, "target", "backend", self.binder))
        self.used_global_vals, self.pre_run_hooks, self.debug = {}, [], None

    def binder(self, x, n, factor, BLOCK, **options):
        specialization = [("*fp32", "D" if x.data_ptr() % 16 == 0 else None),
                          ("i32", "D" if n % 16 == 0 else 1 if n == 1 else None), ("fp32", None), ("constexpr", BLOCK)]
        return {"x": x, "n": n, "factor": factor, "BLOCK": BLOCK}, specialization, options

    def run(self, *args, grid, warmup, **kwargs):
        kwargs["debug"] = kwargs.get("debug", self.debug) or knobs.runtime.debug
        kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        bound, specialization, options = self.device_caches[0][-1](*args, **kwargs)
        for (name, _), (value, scope) in self.used_global_vals.items():
            if scope.get(name) != value:
                raise RuntimeError(f"Global variable {name} has changed since we compiled this kernel")
        kernel = self.kernels.setdefault(str(specialization) + str(options),
                                         _FakeCompiled(self.launches, specialization))
        self.runs.append((tuple(specialization), options))
        grid = grid(bound) if callable(grid) else grid
        kernel.run(grid[0], 1, 1, 77, kernel.function, kernel.packed_metadata, "metadata",
                   knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *bound.values())
        return kernel

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.run(*args, grid=grid, warmup=False, **kwargs)


class _FakeActiveDriver:
    @staticmethod
    def get_current_device():
        return 0

    @staticmethod
    def get_current_stream(device):
        return 77


class _FakeDriver:
    active = _FakeActiveDriver


@pytest.fixture
def fake(monkeypatch):
    """A Launcher over heuristics over a fake JIT function, Triton's runtime faked, the direct path on."""
    monkeypatch.setattr(launch_mod, "FAST_LAUNCH", True)
    monkeypatch.setattr(direct_mod, "_triton_runtime", lambda: (_FakeDriver, knobs.runtime, knobs.compilation))
    jit = _FakeJit()
    return jit, Launcher(triton.heuristics({"BLOCK": lambda args: 32})(jit))


def _grid(meta):
    return (triton.cdiv(meta["n"], meta["BLOCK"]),)


def test_direct_launch_after_first_launches(fake):
    jit, launch = fake
    x = torch.randn(64)
    for _ in range(5):
        launch("key", _grid, x, 64, 2.0)
    # 1: memo miss through the heuristics; 2: memo hit through run, kernel kept; 3-5: direct.
    assert len(jit.runs) == 2 and len(jit.launches) == 5
    kernel = next(iter(jit.kernels.values()))
    assert jit.launches[-1] == (2, 1, 1, 77, kernel.function, kernel.packed_metadata, None, None, None, x, 64, 2.0, 32)
    assert jit.launches[-1][9:] == jit.launches[0][9:]  # the arguments as run binds them, in order
    # a tuple grid is passed through
    launch("key", (5, 6, 7), x, 64, 2.0)
    assert len(jit.runs) == 2 and jit.launches[-1][:4] == (5, 6, 7, 77)
    launch("key", (5,), x, 64, 2.0)
    assert jit.launches[-1][:3] == (5, 1, 1)


def test_changed_specialization_goes_through_run(fake):
    jit, launch = fake
    storage = torch.randn(65)
    aligned, misaligned = storage[:64], storage[1:]  # one float past: not 16-byte aligned
    assert aligned.data_ptr() % 16 == 0 and misaligned.data_ptr() % 16 != 0
    for x in (aligned, aligned, aligned, misaligned, misaligned, aligned, misaligned, storage[:63]):
        launch("key", _grid, x, x.numel(), 1.0)
    runs = [spec[0][1] for spec, _ in jit.runs]
    # miss, hit (kept), direct; misaligned through run (kept), direct; direct; direct; n = 63 through run
    assert runs == ["D", "D", None, "D"] and jit.runs[-1][0][1] == ("i32", None)
    assert len(jit.launches) == 8
    for args, x in zip(jit.launches, (aligned, aligned, aligned, misaligned, misaligned, aligned, misaligned)):
        assert args[9] is x
        assert args[5] == ("packed", [("*fp32", "D" if x is aligned else None), ("i32", "D"), ("fp32", None),
                                      ("constexpr", 32)])


def test_hooks_pre_run_hooks_and_knobs_take_run(fake, monkeypatch):
    jit, launch = fake
    x = torch.randn(64)
    for _ in range(3):
        launch("key", _grid, x, 64, 1.0)
    assert len(jit.runs) == 2
    seen = []
    hook = seen.append
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        launch("key", _grid, x, 64, 1.0)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert len(jit.runs) == 3 and seen == ["metadata"]  # run called the profiler's hook
    launch("key", _grid, x, 64, 1.0)
    assert len(jit.runs) == 3  # direct again
    jit.pre_run_hooks.append(lambda *a, **k: None)
    launch("key", _grid, x, 64, 1.0)
    assert len(jit.runs) == 4
    jit.pre_run_hooks.clear()
    monkeypatch.setattr(knobs.runtime, "debug", True)  # compiles another kernel: run, kept, then direct
    launch("key", _grid, x, 64, 1.0)
    launch("key", _grid, x, 64, 1.0)
    assert len(jit.runs) == 5 and jit.runs[-1][1]["debug"] is True and len(jit.kernels) == 2
    assert jit.launches[-1][5] is list(jit.kernels.values())[1].packed_metadata
    assert len(jit.launches) == 8


def test_it_tells_whether_a_call_would_launch_a_kernel_it_launched(fake):
    """DirectPath.compiled: the call's specialization and options (Triton's binder) among the kernels
    the path launched; nothing before any; a misaligned view, another constexpr or other options not."""
    jit, launch = fake
    storage = torch.randn(65)
    x, misaligned = storage[:64], storage[1:]
    assert not launch.direct.compiled({"BLOCK": 32}, (x, 64, 2.0), {})
    for _ in range(2):
        launch("key", _grid, x, 64, 2.0)
    assert launch.direct.compiled({"BLOCK": 32}, (x, 64, 2.0), {})
    assert launch.direct.compiled({"BLOCK": 32}, (storage[16:], 48, 5.0), {})  # aligned, n % 16 == 0: the same
    assert not launch.direct.compiled({"BLOCK": 16}, (x, 64, 2.0), {})
    assert not launch.direct.compiled({"BLOCK": 32}, (misaligned, 64, 2.0), {})
    assert not launch.direct.compiled({"BLOCK": 32, "num_warps": 2}, (x, 64, 2.0), {})
    assert not launch.direct.compiled({"BLOCK": 32}, (x,), {})  # the binder refuses: cannot tell


def test_switched_off(fake, monkeypatch):
    jit, launch = fake
    monkeypatch.setattr(launch_mod, "FAST_LAUNCH", False)
    x = torch.randn(64)
    for _ in range(4):
        launch("key", _grid, x, 64, 1.0)
    assert len(jit.runs) == 4 and len(jit.launches) == 4 and launch.direct.table == {}


def test_environment_variable_switches_it_off():
    code = "import sd_kernels.runtime.launch as l; print(l.FAST_LAUNCH)"
    for value, expected in (("0", "False"), ("1", "True")):
        env = {**os.environ, "SD_KERNELS_FAST_LAUNCH": value}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == expected


def test_changed_global_or_memo_takes_run(fake):
    jit, launch = fake
    x = torch.randn(64)
    for _ in range(3):
        launch("key", _grid, x, 64, 1.0)
    scope = {"SCALE": 2}
    jit.used_global_vals = {("SCALE", id(scope)): (2, scope)}
    launch("key", _grid, x, 64, 1.0)
    assert len(jit.runs) == 2
    scope["SCALE"] = 3
    with pytest.raises(RuntimeError, match="Global variable SCALE has changed"):
        launch("key", _grid, x, 64, 1.0)
    scope["SCALE"] = 2
    launch.memo["key"] = {"BLOCK": 16}  # another config for the key: its kernel, not the kept one
    launch("key", _grid, x, 64, 1.0)
    assert len(jit.runs) == 3 and jit.launches[-1][-1] == 16 and jit.launches[-1][0] == 4


def test_set_up_failure_falls_back_for_good(fake, monkeypatch, caplog):
    jit, launch = fake

    def broken():
        raise ImportError("no such driver")

    monkeypatch.setattr(direct_mod, "_triton_runtime", broken)
    x = torch.randn(64)
    with caplog.at_level(logging.WARNING, logger="sd_kernels"):
        for _ in range(4):
            launch("key", _grid, x, 64, 1.0)
    assert len(jit.runs) == 4 and launch.direct.table is None
    assert [r.getMessage() for r in caplog.records] == [
        "sd_kernels: fake_kernel launches through Triton's JITFunction.run (direct launch path off: no such driver)"]


def test_unusable_structures_fall_back(fake, caplog):
    jit, launch = fake
    jit.device_caches = collections.defaultdict(lambda: ({}, "target", "backend", jit.binder))  # a 4-tuple
    x = torch.randn(64)
    for _ in range(3):
        launch("key", _grid, x, 64, 1.0)
    assert len(jit.runs) == 3 and launch.direct.table == {}

    jit2 = _FakeJit()
    launch2 = Launcher(triton.heuristics({"BLOCK": lambda args: 32})(jit2))
    jit2.kernels = _NoFunction(jit2.launches)
    with caplog.at_level(logging.WARNING, logger="sd_kernels"):
        for _ in range(3):
            launch2("key", _grid, x, 64, 1.0)
    assert len(jit2.runs) == 3 and launch2.direct.table is None and len(caplog.records) == 1
    assert "the compiled kernel has no loaded function" in caplog.records[0].getMessage()


class _NoFunction(dict):
    """A kernel cache whose kernels have no loaded function (what the direct path must refuse)."""

    def __init__(self, launches):
        super().__init__()
        self.launches = launches

    def setdefault(self, key, kernel):
        kernel.function = None
        return super().setdefault(key, kernel)


def test_direct_call_refused_falls_back_without_launching_twice(fake, caplog):
    jit, launch = fake
    x = torch.randn(64)
    for _ in range(3):
        launch("key", _grid, x, 64, 1.0)
    ((key, entry),) = launch.direct.table.items()

    def refuses(*args):
        raise TypeError("takes 9 positional arguments")

    launch.direct.table[key] = (entry[0], refuses, *entry[2:])
    with caplog.at_level(logging.WARNING, logger="sd_kernels"):
        launch("key", _grid, x, 64, 1.0)
    assert len(jit.launches) == 4 and len(jit.runs) == 3 and launch.direct.table is None
    assert "refused the call" in caplog.records[0].getMessage()


def test_interpreted_kernels_stay_on_run(monkeypatch):
    """Under TRITON_INTERPRET the JIT function is Triton's interpreter: no direct path, no log line."""
    if not interpreting():
        pytest.skip("the interpreter is off")
    monkeypatch.setattr(launch_mod, "FAST_LAUNCH", True)
    launch = Launcher(_scale_kernel)
    x = torch.randn(48)
    for _ in range(3):
        y = torch.empty_like(x)
        launch(48, lambda meta: (triton.cdiv(48, meta["BLOCK"]),), x, y, 48, 2.0)
        torch.testing.assert_close(y, x * 2.0)
    assert launch.direct.table is None


# ---------------------------------------------------------------------------------------------
# On the GPU: the direct path against JITFunction.run with Triton's real pieces.


@pytest.mark.gpu
def test_gpu_direct_launches_match_run(monkeypatch):
    monkeypatch.setattr(launch_mod, "FAST_LAUNCH", True)
    direct, normal = Launcher(_scale_kernel), Launcher(_scale_kernel)
    storage = torch.randn(4099, device="cuda")
    cases = []
    for n in (48, 47, 1, 4096):
        for offset in (0, 1, 3):  # 4-byte steps: offsets 1 and 3 are misaligned pointers
            cases.append((storage[offset:offset + n], n))
    grid = lambda meta, n: (triton.cdiv(n, meta["BLOCK"]),)
    for rep in range(4):
        for i, (x, n) in enumerate(cases):
            factor = float(i + rep)
            outs = []
            for launcher, enabled in ((direct, True), (normal, False)):
                monkeypatch.setattr(launch_mod, "FAST_LAUNCH", enabled)
                y = torch.full((n + 2,), float("nan"), device="cuda")[1:n + 1]  # a misaligned output too
                launcher(n, lambda meta, n=n: grid(meta, n), x, y, n, factor)
                outs.append(y)
            torch.cuda.synchronize()
            torch.testing.assert_close(outs[0], x * factor, rtol=0, atol=0)
            torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    # the path was taken: one table entry per (key, specialization) seen
    assert direct.direct.table is not None and len(direct.direct.table) >= 6, direct.direct.table
    assert normal.direct.table == {}


@pytest.mark.gpu
def test_gpu_direct_launch_keeps_streams_and_hooks(monkeypatch):
    monkeypatch.setattr(launch_mod, "FAST_LAUNCH", True)
    launch = Launcher(_scale_kernel)
    x = torch.randn(4096, device="cuda")
    grid = lambda meta: (triton.cdiv(4096, meta["BLOCK"]),)
    for _ in range(3):
        launch(4096, grid, x, torch.empty_like(x), 4096, 1.0)
    assert len(launch.direct.table) == 1
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ys = [torch.empty_like(x) for _ in range(8)]
        for i, y in enumerate(ys):
            launch(4096, grid, x, y, 4096, float(i))
    side.synchronize()
    for i, y in enumerate(ys):
        torch.testing.assert_close(y, x * float(i), rtol=0, atol=0)
    seen = []
    # Triton 3.6 hands hooks a LazyDict (``.get()`` gives the dict), later versions a dict
    hook = lambda metadata: seen.append(metadata.get()["name"] if type(metadata).__name__ == "LazyDict"
                                        else metadata["name"])
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        for _ in range(3):
            launch(4096, grid, x, torch.empty_like(x), 4096, 1.0)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert len(seen) == 3 and "_scale_kernel" in seen[0]


# ---------------------------------------------------------------------------------------------
# The autotune cache: tuned choices persist across processes (a fresh Launcher stands for a new one)


# The same heuristics and kernel with two configs to choose from (the benchmark is faked below).
_tuned_kernel = triton.autotune([triton.Config({"BLOCK": 16}, num_warps=1), triton.Config({"BLOCK": 32}, num_warps=1)],
                                key=["n"])(_scale_kernel.fn)


@pytest.fixture
def tuning(monkeypatch, tmp_path):
    """The cache in tmp_path; _tuned_kernel's benchmark faked (the second config, BLOCK 32, wins: the
    interpreter cannot time) and recorded; the autotuner's in-memory cache empty."""
    monkeypatch.setenv(cache_mod.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(cache_mod, "AUTOTUNE", True)
    monkeypatch.setattr(cache_mod, "MODE", "time")  # keys no table holds are timed (the rule's tests set "rule")
    monkeypatch.setattr(cache_mod, "SHIPPED_ROOT", tmp_path / "shipped")  # the package's own tables stay out
    benched = []

    times = {32: 1.0, 16: 2.0}

    def bench(*args, config, **meta):
        benched.append(config.kwargs["BLOCK"])
        return [times[config.kwargs["BLOCK"]]] * 3

    monkeypatch.setattr(_tuned_kernel, "_bench", bench)
    monkeypatch.setattr(_tuned_kernel, "cache", {})
    return SimpleNamespace(dir=tmp_path, benched=benched, times=times)


def _run(launcher, n, device, key=None):
    x = torch.randn(n, device=device)
    y = torch.full_like(x, float("nan"))
    launcher(("scale", n) if key is None else key, lambda meta: (triton.cdiv(n, meta["BLOCK"]),), x, y, n, 3.0)
    torch.testing.assert_close(y, x * 3.0)


def _no_autotuner(*args, **kwargs):
    raise AssertionError("the autotuner ran")


def _cache_file(device):
    return cache_mod.cache_dir(torch.device(device)) / f"{Launcher(_tuned_kernel).name}.json"


def test_a_tuned_choice_is_reused_by_the_next_process(tuning, device, monkeypatch):
    first = Launcher(_tuned_kernel)
    for n in (48, 64):
        _run(first, n, device)
    assert tuning.benched == [16, 32, 16, 32]
    path = _cache_file(device)
    slug = cache_mod.device_slug(torch.device(device))
    assert path == tuning.dir / slug / f"triton-{triton.__version__}" / "test_launch._scale_kernel.json"
    data = json.loads(path.read_text())
    config = _tuned_kernel.configs[1].all_kwargs()  # the config only: heuristics are computed per key
    assert data["entries"] == {repr(("scale", 48)): config, repr(("scale", 64)): config}
    assert list(tuning.dir.rglob("*.tmp")) == []  # written through a temporary file, replaced

    second = Launcher(_tuned_kernel)  # another process: an empty memo
    monkeypatch.setattr(_tuned_kernel, "run", _no_autotuner)
    _run(second, 48, device)
    monkeypatch.setattr(cache_mod.CacheFile, "_read", _no_autotuner)  # the file was read at the first launch
    _run(second, 64, device)
    assert second.memo == first.memo
    assert second.memo[("scale", 48)]["EVEN"] is False and second.memo[("scale", 64)]["EVEN"] is True
    monkeypatch.setattr(Launcher, "_first", _no_autotuner)  # a memo hit does nothing more than before
    _run(second, 48, device)
    assert tuning.benched == [16, 32, 16, 32]


@pytest.mark.parametrize("slower, tied", [(1 + cache_mod.TIE + cache_mod.TIE_MS * 0.9, True),
                                          (1 + cache_mod.TIE + cache_mod.TIE_MS * 1.1, False)])
def test_every_timed_config_is_kept_and_one_within_the_tie_is_a_tie(tuning, device, slower, tied):
    """The file keeps, per key, every config timed and its ms; another process reads them, and a config
    within TIE + TIE_MS of the choice is a tie (CacheFile.ties); the key's next tuning
    replaces them."""
    tuning.times[16] = slower
    _run(Launcher(_tuned_kernel), 48, device)
    data = json.loads(_cache_file(device).read_text())
    config, other = (c.all_kwargs() for c in reversed(_tuned_kernel.configs))
    assert data["entries"] == {repr(("scale", 48)): config}
    assert data["timings"] == {repr(("scale", 48)): [[config, 1.0], [other, slower]]}
    fresh = Launcher(_tuned_kernel)
    _run(fresh, 48, device)
    assert fresh.cache.ties(repr(("scale", 48)), config) == ([other] if tied else [])
    assert fresh.cache.ties(repr(("scale", 48)), other) == []  # ties of another choice: none
    tuning.times[16] = 3.0  # tuned again (the autotuner's own memory emptied)
    _tuned_kernel.cache.clear()
    fresh.cache.entries.clear()
    fresh.memo.clear()
    _run(fresh, 48, device)
    timings = json.loads(_cache_file(device).read_text())["timings"]
    assert timings == {repr(("scale", 48)): [[config, 1.0], [other, 3.0]]}
    assert fresh.cache.ties(repr(("scale", 48)), config) == []


def test_a_dry_run_leaves_a_key_without_a_tuned_choice_to_the_real_call(tuning, device, monkeypatch):
    """sd_kernels.runtime.precompile's dry run: a key that would need tuning is neither launched, tuned, nor
    remembered (the autotuner would time launches that the dry run skips); a key the cache file has
    is remembered as usual."""
    launcher = Launcher(_tuned_kernel)
    monkeypatch.setattr(launch_mod, "dry", lambda: True)
    x = torch.randn(48, device=device)
    y = torch.full_like(x, float("nan"))
    launcher(("scale", 48), lambda meta: (triton.cdiv(48, meta["BLOCK"]),), x, y, 48, 3.0)
    assert tuning.benched == [] and launcher.memo == {} and y.isnan().all()
    assert not _cache_file(device).exists()
    monkeypatch.setattr(launch_mod, "dry", lambda: False)
    _run(launcher, 48, device)  # the real call tunes it
    assert tuning.benched == [16, 32]
    fresh = Launcher(_tuned_kernel)  # a new process: the choice is in the file
    monkeypatch.setattr(launch_mod, "dry", lambda: True)
    _run(fresh, 48, device)  # under the interpreter the launch is not skipped: it runs with the file's choice
    assert fresh.memo == launcher.memo and tuning.benched == [16, 32]


def test_a_key_the_file_lacks_is_tuned_and_added(tuning, device, caplog):
    launcher = Launcher(_tuned_kernel)
    with caplog.at_level(logging.INFO, logger="sd_kernels"):
        _run(launcher, 48, device)
        _run(launcher, 50, device)
    assert tuning.benched == [16, 32, 16, 32]
    assert set(json.loads(_cache_file(device).read_text())["entries"]) == {repr(("scale", 48)), repr(("scale", 50))}
    tuned = [r.getMessage() for r in caplog.records if "autotuning" in r.getMessage()]
    assert len(tuned) == 1 and launcher.name in tuned[0]  # said once per kernel, with the first key


@pytest.mark.parametrize("content, what", [
    ("{not json", "unreadable"),
    ('["a list"]', "not an autotune cache file"),
    ("entry", "match no config"),
])
def test_a_corrupt_file_is_logged_once_and_ignored(tuning, device, caplog, content, what):
    path = _cache_file(device)
    path.parent.mkdir(parents=True)
    if content == "entry":  # the right kernel version, but a config the autotuner does not have
        fingerprint = Launcher(_tuned_kernel).fingerprint
        content = json.dumps({"format": cache_mod.CACHE_FORMAT, "fingerprint": fingerprint,
                              "entries": {repr(("scale", 48)): {"BLOCK": 64, "num_warps": 1}}})
    path.write_text(content)
    launcher = Launcher(_tuned_kernel)
    with caplog.at_level(logging.WARNING, logger="sd_kernels"):
        for n in (48, 64, 48):
            _run(launcher, n, device)
    assert tuning.benched == [16, 32, 16, 32]  # both keys tuned, as without a file
    warnings = [r.getMessage() for r in caplog.records if str(path) in r.getMessage()]
    assert len(warnings) == 1 and what in warnings[0], warnings
    assert len(json.loads(path.read_text())["entries"]) == 2  # and replaced by a good one


def test_an_unwritable_cache_is_logged_once_and_never_fatal(tuning, device, caplog, monkeypatch):
    blocker = tuning.dir / "file"
    blocker.write_text("")
    monkeypatch.setenv(cache_mod.CACHE_ENV, str(blocker))  # a file where the directory should be
    launcher = Launcher(_tuned_kernel)
    with caplog.at_level(logging.WARNING, logger="sd_kernels"):
        for n in (48, 64):
            _run(launcher, n, device)
    assert len([r for r in caplog.records if str(blocker) in r.getMessage()]) == 1  # read or write: once


@pytest.mark.parametrize("how", ["env off", "env 0", "SD_KERNELS_AUTOTUNE=0"])
def test_disabled_cache_reads_and_writes_nothing(tuning, device, monkeypatch, how):
    _run(Launcher(_tuned_kernel), 48, device)  # a good file exists
    before = {p: p.read_bytes() for p in tuning.dir.rglob("*.json")}
    if how == "SD_KERNELS_AUTOTUNE=0":
        monkeypatch.setattr(cache_mod, "AUTOTUNE", False)
    else:
        monkeypatch.setenv(cache_mod.CACHE_ENV, how.split()[1])
    assert cache_mod.cache_dir(torch.device(device)) is None
    launcher = Launcher(_tuned_kernel)
    monkeypatch.setattr(_tuned_kernel, "cache", {})
    for n in (48, 64):
        _run(launcher, n, device)
    assert tuning.benched == [16, 32] * 3  # 48 tuned again: the file was not read
    assert {p: p.read_bytes() for p in tuning.dir.rglob("*") if p.is_file()} == before  # nor written


@pytest.mark.parametrize("other", ["triton version", "device", "kernel source"])
def test_another_triton_device_or_kernel_version_never_reuses_a_file(tuning, device, monkeypatch, other):
    _run(Launcher(_tuned_kernel), 48, device)
    monkeypatch.setattr(_tuned_kernel, "cache", {})
    launcher = Launcher(_tuned_kernel)
    if other == "triton version":
        monkeypatch.setattr(cache_mod, "TRITON_VERSION", "0.0.0-other")
    elif other == "device":
        monkeypatch.setattr(cache_mod, "device_slug", lambda device: "other-gpu-sm00")
    else:
        launcher._fingerprint = "0123456789abcdef"
    _run(launcher, 48, device)
    assert tuning.benched == [16, 32, 16, 32]
    files = sorted(tuning.dir.rglob("*.json"))
    assert len(files) == (1 if other == "kernel source" else 2), files
    if other == "kernel source":  # the stale file was rewritten for the new kernel
        assert json.loads(files[0].read_text())["fingerprint"] == "0123456789abcdef"


def test_the_profile_names_the_directory(tuning, device, monkeypatch):
    monkeypatch.delenv(cache_mod.CACHE_ENV)
    mine = dataclasses.replace(profiles.get_profile("cpu"), name="mine", autotune_cache=str(tuning.dir / "{name}"))
    monkeypatch.setattr(profiles, "_active", mine)
    _run(Launcher(_tuned_kernel), 48, device)
    (path,) = tuning.dir.rglob("*.json")
    assert path.relative_to(tuning.dir).parts[0] == "mine"
    monkeypatch.setattr(profiles, "_active", profiles.get_profile("cpu"))  # autotune_cache null: no cache
    assert cache_mod.cache_dir(torch.device(device)) is None


def test_keys_or_configs_json_cannot_keep_are_not_written(tuning, device):
    class Opaque:  # repr names an address: it would never match in another process
        pass

    _run(Launcher(_tuned_kernel), 48, device, key=Opaque())
    assert list(tuning.dir.rglob("*.json")) == []


def test_info_prints_the_cache_in_use(tuning, capsys):
    from sd_kernels.apps import cli

    assert cli.main(["info"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if "autotune cache" in line)
    assert str(tuning.dir) in line and cache_mod.CACHE_ENV in line


# ---------------------------------------------------------------------------------------------
# Shipped tables: the package's files, read where the user's file lacks a key


def _ship(device, entries, fingerprint=None):
    """Write a shipped table for _tuned_kernel under the active profile; its path."""
    path = cache_mod.shipped_dir(torch.device(device)) / f"{Launcher(_tuned_kernel).name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"format": cache_mod.CACHE_FORMAT, "entries": entries,
                                "fingerprint": fingerprint or Launcher(_tuned_kernel).fingerprint}))
    return path


def test_a_shipped_choice_serves_a_fresh_machine(tuning, device, monkeypatch):
    config = _tuned_kernel.configs[0].all_kwargs()  # not the one the (faked) benchmark would pick
    _ship(device, {repr(("scale", 48)): config})
    launcher = Launcher(_tuned_kernel)
    monkeypatch.setattr(_tuned_kernel, "run", _no_autotuner)
    _run(launcher, 48, device)
    assert launcher.memo[("scale", 48)]["BLOCK"] == 16 and tuning.benched == []
    monkeypatch.undo()


def test_the_users_own_choice_wins_over_the_shipped_one(tuning, device):
    _run(Launcher(_tuned_kernel), 48, device)  # the user's file: BLOCK 32
    _ship(device, {repr(("scale", 48)): _tuned_kernel.configs[0].all_kwargs()})
    launcher = Launcher(_tuned_kernel)
    _run(launcher, 48, device)
    assert launcher.memo[("scale", 48)]["BLOCK"] == 32


def test_tuned_ms_is_the_fastest_time_of_the_table_that_serves_the_key(tuning, device):
    """``Launcher.tuned_ms``: the fastest config's time at the key's tuning, from the user's file where it
    holds the key, else the shipped table; None for a key no table times."""
    configs = [c.all_kwargs() for c in _tuned_kernel.configs]
    path = _ship(device, {repr(("scale", 48)): configs[0], repr(("scale", 80)): configs[0]})
    data = json.loads(path.read_text())
    data["timings"] = {repr(("scale", 48)): [[configs[0], 0.5], [configs[1], 0.7]]}
    path.write_text(json.dumps(data))
    dev = torch.device(device)
    assert Launcher(_tuned_kernel).tuned_ms(("scale", 48), dev) == 0.5
    assert Launcher(_tuned_kernel).tuned_ms(("scale", 80), dev) is None  # chosen there, no timings
    assert Launcher(_tuned_kernel).tuned_ms(("scale", 64), dev) is None
    _run(Launcher(_tuned_kernel), 48, device)  # nothing timed: the shipped choice serves it
    _run(Launcher(_tuned_kernel), 64, device)  # timed (faked: 1.0 and 2.0 ms), kept in the user's file
    assert Launcher(_tuned_kernel).tuned_ms(("scale", 64), dev) == tuning.times[32]


def test_a_relaxed_heuristic_serves_where_its_kernel_is_compiled_and_the_computed_one_is_not(
        tuning, device, monkeypatch):
    """Launcher(relax=...): a heuristic's value correct for the call (EVEN=False: the masked path), as
    ``relax`` gives it from the call's arguments, is taken at a key's first launch where it is compiled
    and the computed value is not; never otherwise, and never where ``relax`` gives nothing."""
    config = _tuned_kernel.configs[1].all_kwargs()
    _ship(device, {repr(("scale", n)): config for n in (64, 96, 128)})
    launcher = Launcher(_tuned_kernel, relax=lambda named: {"EVEN": False} if named["n"] <= 96 else {})
    compiled = {(32, False)}
    asked = []

    def fake(meta, args, kwargs):
        asked.append((meta["BLOCK"], meta["EVEN"]))
        return (meta["BLOCK"], meta["EVEN"]) in compiled

    monkeypatch.setattr(launcher.direct, "compiled", fake)
    _run(launcher, 64, device)  # 64 % 32 == 0: EVEN, not compiled; the masked kernel is
    assert launcher.memo[("scale", 64)]["EVEN"] is False and asked == [(32, True), (32, False)]
    assert launcher.tied == {("scale", 64): {**config, "EVEN": False}}
    asked.clear()
    _run(launcher, 128, device)  # past relax's bound: the computed value, though the masked one is compiled
    assert launcher.memo[("scale", 128)]["EVEN"] is True and asked == [(32, True)]
    compiled.clear()
    _run(launcher, 96, device)  # nothing compiled: the computed value
    assert launcher.memo[("scale", 96)]["EVEN"] is True and set(launcher.tied) == {("scale", 64)}
    plain = Launcher(_tuned_kernel)  # no relax, no ties: the computed value, nothing asked
    monkeypatch.setattr(plain.direct, "compiled", fake)
    asked.clear()
    _run(plain, 64, device)
    assert plain.memo[("scale", 64)]["EVEN"] is True and asked == []


def test_keys_sharing_the_autotuners_key_are_each_timed(tuning, device):
    """Our keys can be finer than the autotuner's own (flash attention keys exact lengths, its
    autotuner powers of two): each is timed and keeps its timings, not the other key's choice."""
    launcher = Launcher(_tuned_kernel)
    _run(launcher, 48, device, key=("silu", 48))
    _run(launcher, 48, device, key=(None, 48))
    assert tuning.benched == [16, 32, 16, 32]
    timings = json.loads(_cache_file(device).read_text())["timings"]
    assert set(timings) == {repr(("silu", 48)), repr((None, 48))}


def test_a_malformed_or_out_of_range_time_is_dropped_with_nothing_else(tuning, device):
    """Timings are optional: a malformed field, or a time JSON reads as an int past float's range,
    is dropped; the file's entries stay (the next write keeps another process's entries)."""
    launcher = Launcher(_tuned_kernel)
    _run(launcher, 48, device)
    path = _cache_file(device)
    data = json.loads(path.read_text())
    data["timings"] = ["not a mapping"]
    path.write_text(json.dumps(data))
    other = Launcher(_tuned_kernel)  # another process
    _run(other, 64, device)
    assert set(json.loads(path.read_text())["entries"]) == {repr(("scale", 48)), repr(("scale", 64))}
    config = _tuned_kernel.configs[1].all_kwargs()
    data = json.loads(path.read_text())
    data["timings"][repr(("scale", 48))] = [[config, 10**400], [_tuned_kernel.configs[0].all_kwargs(), 1.0]]
    path.write_text(json.dumps(data))
    third = Launcher(_tuned_kernel)
    _run(third, 48, device)  # read without raising; the huge time dropped
    assert third.memo[("scale", 48)]["BLOCK"] == 32 and third.cache.ties(repr(("scale", 48)), config) == []


@pytest.mark.parametrize("what", ["another kernel version", "corrupt", "switched off"])
def test_a_stale_corrupt_or_refused_shipped_table_is_ignored(tuning, device, caplog, monkeypatch, what):
    config = _tuned_kernel.configs[0].all_kwargs()
    path = _ship(device, {repr(("scale", 48)): config}, fingerprint="0123456789abcdef"
                 if what == "another kernel version" else None)
    if what == "corrupt":
        path.write_text("{not json")
    if what == "switched off":
        monkeypatch.setenv(cache_mod.SHIPPED_ENV, "0")
    launcher = Launcher(_tuned_kernel)
    with caplog.at_level(logging.WARNING, logger="sd_kernels"):
        for n in (48, 48, 64):
            _run(launcher, n, device)
    assert tuning.benched == [16, 32, 16, 32] and launcher.memo[("scale", 48)]["BLOCK"] == 32  # tuned as before
    logged = [r.getMessage() for r in caplog.records if str(path) in r.getMessage()]
    want = {"another kernel version": ["another version of the kernel"], "corrupt": ["unreadable"],
            "switched off": []}[what]
    assert len(logged) == len(want) and all(w in m for w, m in zip(want, logged)), logged


_CHECK_SHIPPED = """
import importlib, json, pathlib, pkgutil, sys
import sd_kernels.ops
from sd_kernels.runtime.launch import Launcher
launchers = {}
for info in pkgutil.iter_modules(sd_kernels.ops.__path__):
    module = importlib.import_module(f"sd_kernels.ops.{info.name}")
    launchers.update({v.name: v for v in vars(module).values() if isinstance(v, Launcher)})
out = {}
for path in sys.argv[1:]:
    stem = pathlib.Path(path).stem
    launcher = launchers.get(stem)
    data = json.loads(pathlib.Path(path).read_text())
    out[path] = None if launcher is None else {
        "format": data.get("format"), "fingerprint": data.get("fingerprint") == launcher.fingerprint,
        "entries": len(data.get("entries", {})),
        "valid": all(launcher.valid_entry(e) for e in data.get("entries", {}).values())}
print(json.dumps(out))
"""


def test_the_shipped_tables_parse_and_name_only_configs_the_kernels_accept():
    """Each shipped file is a cache file of a kernel we have, made for its current source (helpers
    included: regenerate with python -m bench.tune on the GPU after an edit), every entry one of the
    kernel's configs. Checked in a process without the interpreter, where the kernels have the
    configs a GPU has (the interpreter gets one config each)."""
    files = [str(p) for p in sorted(cache_mod.SHIPPED_ROOT.rglob("*.json"))]
    assert files, f"no shipped tables under {cache_mod.SHIPPED_ROOT}"
    for path in files:
        profile, slug, triton_dir, name = pathlib.Path(path).relative_to(cache_mod.SHIPPED_ROOT).parts
        assert profile in profiles.list_profiles() and triton_dir.startswith("triton-"), path
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _CHECK_SHIPPED, *files], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for path, found in json.loads(proc.stdout.strip().splitlines()[-1]).items():
        assert found is not None, f"{path}: no kernel of that name"
        assert found["format"] == cache_mod.CACHE_FORMAT and found["fingerprint"], (
            f"{path} was tuned for another version of its kernel: regenerate it (python -m bench.tune)")
        assert found["entries"] and found["valid"], path
