"""sd_kernels.runtime.precompile: the dry run records what would compile (on its own thread only), the pool
compiles it, the hook is put back; when there can be no dry run, it says why. The GPU test checks
that a precompiled capture compiles nothing more and matches a capture without it."""

import logging
import threading
import types

import pytest
import torch

from sd_kernels.runtime import precompile


class FakeJit:
    def __init__(self, fail=()):
        self.loaded, self.fail = [], set(fail)

    def preload(self, data):
        if data in self.fail:
            raise RuntimeError(f"cannot compile {data}")
        self.loaded.append((data, threading.current_thread().name))


def _launch(jit, data):
    """What Triton's JIT does on a kernel-cache miss: ask the hook, which says whether to skip."""
    from triton import knobs

    hook = knobs.runtime.jit_cache_hook
    return bool(hook and hook(key="k", repr="r", fn=types.SimpleNamespace(jit_function=jit),
                              compile={"key": "k", "specialization_data": data}, is_manual_warmup=False,
                              already_compiled=False))


@pytest.fixture
def available(monkeypatch):
    from triton import knobs

    monkeypatch.setattr(precompile, "unavailable", lambda: None)
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)


def test_dry_run_records_on_its_thread_and_the_pool_compiles(available):
    from triton import knobs

    jit = FakeJit()
    elsewhere = []

    def run():
        assert precompile.dry()
        assert _launch(jit, "a") and _launch(jit, "b") and _launch(jit, "a")  # skipped, recorded once each
        other = threading.Thread(target=lambda: elsewhere.append((_launch(jit, "c"), precompile.dry())))
        other.start()
        other.join()

    report = precompile.precompile(run)
    assert elsewhere == [(False, False)]  # another thread compiles as usual, and is not in a dry run
    assert sorted(d for d, _ in jit.loaded) == ["a", "b"]
    assert all(name.startswith("sd-kernels-compile") for _, name in jit.loaded)
    assert (report.recorded, report.compiled, report.failed) == (2, 2, 0)
    assert knobs.runtime.jit_cache_hook is None and not precompile.dry()
    assert not _launch(jit, "d")  # no hook left behind


def test_a_model_on_the_cpu_is_dry_run_without_a_cuda_device(available):
    """A CUDA-graph wrapper of a model on the CPU (the graph tests' stand-in) passes its CPU device: the dry
    run and the compiles go on with no device to synchronize or set, as on a machine with no GPU."""
    jit = FakeJit()
    report = precompile.precompile(lambda: _launch(jit, "a"), torch.device("cpu"))
    assert [d for d, _ in jit.loaded] == ["a"] and report.compiled == 1


def test_failures_are_left_to_the_real_call_and_the_hook_is_restored_after_an_error(available, caplog):
    from triton import knobs

    jit = FakeJit(fail={"b"})
    with caplog.at_level(logging.INFO, logger="sd_kernels"):
        report = precompile.precompile(lambda: (_launch(jit, "a"), _launch(jit, "b")))
    assert (report.recorded, report.compiled, report.failed) == (2, 1, 1)
    assert "cannot compile b" in caplog.text

    def broken():
        _launch(jit, "x")
        raise ValueError("the dry run failed")

    with pytest.raises(ValueError):
        precompile.precompile(broken)
    assert knobs.runtime.jit_cache_hook is None and not precompile.dry()


def test_what_the_hook_cannot_record_compiles_now(available):
    from triton import knobs

    def run():
        hook = knobs.runtime.jit_cache_hook
        assert hook(fn=types.SimpleNamespace(jit_function=FakeJit()), compile={"key": "k"}) is False
        assert hook(fn=types.SimpleNamespace(jit_function=object()), compile={"specialization_data": "a"}) is False

    assert precompile.precompile(run).recorded == 0


def test_when_there_is_no_dry_run_it_says_why(monkeypatch):
    from triton import knobs

    monkeypatch.setenv(precompile.ENV, "0")
    assert precompile.unavailable() == f"{precompile.ENV}=0"
    monkeypatch.delenv(precompile.ENV)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "interpreter" in precompile.unavailable()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **kw: False)
    assert "another jit_cache_hook" in precompile.unavailable()
    ran = []
    assert precompile.precompile(lambda: ran.append(1)) is None and ran == []  # not even run


def test_every_autotuned_kernel_launches_through_a_launcher():
    """An autotuner run in a dry run would time launches the hook skips and keep a config chosen by
    noise: each autotuned kernel of sd_kernels.ops is launched by a Launcher (which leaves a key not
    tuned yet to the real call)."""
    import importlib
    import pkgutil

    from triton.runtime.autotuner import Autotuner, Heuristics

    import sd_kernels.ops
    from sd_kernels.runtime.launch import Launcher

    tuned, launched = {}, set()
    for info in pkgutil.iter_modules(sd_kernels.ops.__path__):
        module = importlib.import_module(f"sd_kernels.ops.{info.name}")
        for value in vars(module).values():
            layers = [value]
            while isinstance(layers[-1], (Autotuner, Heuristics)):
                layers.append(layers[-1].fn)
            if any(isinstance(layer, Autotuner) for layer in layers):
                jit = layers[-1]
                tuned[f"{jit.fn.__module__}.{jit.fn.__qualname__}"] = jit
            if isinstance(value, Launcher):
                launched.add(id(value.jit))
    assert len(tuned) >= 8, sorted(tuned)  # flash, 4 GroupNorm, 2 softmax·matmul, linear_geglu, Winograd...
    loose = sorted(name for name, jit in tuned.items() if id(jit) not in launched)
    assert not loose, f"autotuned kernels launched outside a Launcher: {loose}"


@pytest.mark.gpu
def test_gpu_precompiled_capture_compiles_nothing_more_and_matches(monkeypatch):
    """A fresh graphed UNet (empty Triton cache) compiles its kernels in the pool: the capture after
    it compiles none but the configs its autotuners try (a kernel with no known config is left to the
    real call, which tunes it: the tiny model's shapes are in no shipped table), and its replays equal
    those of a UNet patched with precompiling off. The profile is the device's without the fused
    linear_geglu: with it, every kernel of the tiny UNet is an autotuned one with no table entry, and
    the dry run would have nothing to record."""
    import copy
    import dataclasses
    import os
    import tempfile

    import triton.compiler
    from triton.runtime import autotuner

    import sd_kernels
    from sd_kernels import models, profiles
    from sd_kernels.analysis.selection import launchers

    monkeypatch.setenv("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="sd-kernels-precompile-"))
    for launcher in launchers().values():  # what earlier tests compiled in this process is forgotten too:
        launcher.jit.device_caches.clear()  # GroupNorm's kernels serve every size, so the tiny UNet's were there
    unet = models.build_model("tiny", "unet", device="cuda", dtype=torch.float16)
    plain = copy.deepcopy(unet)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 16, 16, generator=g).cuda().half()
    ctx = torch.randn(2, 7, 32, generator=g).cuda().half()
    compiled_during = []
    inner, tune = triton.compiler.compile, autotuner.Autotuner.run
    tuning = threading.local()

    def counting(*args, **kwargs):
        if not getattr(tuning, "on", False):
            compiled_during.append(threading.current_thread().name)
        return inner(*args, **kwargs)

    def tuning_run(self, *args, **kwargs):  # an autotuner choosing a config (by timing, or the one the
        tuning.on = True                     # pruning leaves) compiles what it tries
        try:
            return tune(self, *args, **kwargs)
        finally:
            tuning.on = False

    monkeypatch.setattr(triton.compiler, "compile", counting)
    monkeypatch.setattr(autotuner.Autotuner, "run", tuning_run)
    reports = []
    real = precompile.precompile
    monkeypatch.setattr(precompile, "precompile", lambda *a, **k: reports.append(real(*a, **k)) or reports[-1])
    profile = dataclasses.replace(profiles.get_profile(), linear_geglu_max_k=0)
    with torch.inference_mode():
        sd_kernels.patch(unet, cuda_graph=True, profile=profile)
        out = unet(x, 10, encoder_hidden_states=ctx).sample
        assert reports and reports[0] is not None and reports[0].recorded > 0 and reports[0].failed == 0
        on_main = [n for n in compiled_during if not n.startswith("sd-kernels-compile")]
        assert not on_main, f"{len(on_main)} compilations outside the pool and outside autotuning"
        assert len(compiled_during) >= reports[0].compiled > 0
        monkeypatch.setenv(precompile.ENV, "0")
        sd_kernels.patch(plain, cuda_graph=True, profile=profile)
        want = plain(x, 10, encoder_hidden_states=ctx).sample
    assert os.environ[precompile.ENV] == "0"
    torch.testing.assert_close(out, want, rtol=0, atol=0)
