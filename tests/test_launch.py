"""sd_kernels.launch.Launcher: the first launch of a key goes through the autotuner, later ones skip it
with the same meta-parameters (runs on CPU through the interpreter)."""

import dataclasses
import json
import logging
from types import SimpleNamespace

import pytest
import torch
import triton
import triton.language as tl

from sd_kernels import launch, profiles
from sd_kernels.dispatch import interpreting
from sd_kernels.launch import Launcher

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
def test_memo_launch_matches_autotuned_launch(n, device):
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
# The autotune cache: tuned choices persist across processes (a fresh Launcher stands for a new one)


# The same heuristics and kernel with two configs to choose from (the benchmark is faked below).
_tuned_kernel = triton.autotune([triton.Config({"BLOCK": 16}, num_warps=1), triton.Config({"BLOCK": 32}, num_warps=1)],
                                key=["n"])(_scale_kernel.fn)


@pytest.fixture
def tuning(monkeypatch, tmp_path):
    """The cache in tmp_path; _tuned_kernel's benchmark faked (the second config, BLOCK 32, wins: the
    interpreter cannot time) and recorded; the autotuner's in-memory cache empty."""
    monkeypatch.setenv(launch.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(launch, "AUTOTUNE", True)
    benched = []

    def bench(*args, config, **meta):
        benched.append(config.kwargs["BLOCK"])
        return [1.0 if config.kwargs["BLOCK"] == 32 else 2.0] * 3

    monkeypatch.setattr(_tuned_kernel, "_bench", bench)
    monkeypatch.setattr(_tuned_kernel, "cache", {})
    return SimpleNamespace(dir=tmp_path, benched=benched)


def _run(launcher, n, device, key=None):
    x = torch.randn(n, device=device)
    y = torch.full_like(x, float("nan"))
    launcher(("scale", n) if key is None else key, lambda meta: (triton.cdiv(n, meta["BLOCK"]),), x, y, n, 3.0)
    torch.testing.assert_close(y, x * 3.0)


def _no_autotuner(*args, **kwargs):
    raise AssertionError("the autotuner ran")


def _cache_file(device):
    return launch.cache_dir(torch.device(device)) / f"{Launcher(_tuned_kernel).name}.json"


def test_a_tuned_choice_is_reused_by_the_next_process(tuning, device, monkeypatch):
    first = Launcher(_tuned_kernel)
    for n in (48, 64):
        _run(first, n, device)
    assert tuning.benched == [16, 32, 16, 32]
    path = _cache_file(device)
    slug = launch.device_slug(torch.device(device))
    assert path == tuning.dir / slug / f"triton-{triton.__version__}" / "test_launch._scale_kernel.json"
    data = json.loads(path.read_text())
    config = _tuned_kernel.configs[1].all_kwargs()  # the config only: heuristics are computed per key
    assert data["entries"] == {repr(("scale", 48)): config, repr(("scale", 64)): config}
    assert list(tuning.dir.rglob("*.tmp")) == []  # written through a temporary file, replaced

    second = Launcher(_tuned_kernel)  # another process: an empty memo
    monkeypatch.setattr(_tuned_kernel, "run", _no_autotuner)
    _run(second, 48, device)
    monkeypatch.setattr(launch._CacheFile, "_read", _no_autotuner)  # the file was read at the first launch
    _run(second, 64, device)
    assert second.memo == first.memo
    assert second.memo[("scale", 48)]["EVEN"] is False and second.memo[("scale", 64)]["EVEN"] is True
    monkeypatch.setattr(Launcher, "_first", _no_autotuner)  # a memo hit does nothing more than before
    _run(second, 48, device)
    assert tuning.benched == [16, 32, 16, 32]


def test_a_key_the_file_lacks_is_tuned_and_added(tuning, device):
    _run(Launcher(_tuned_kernel), 48, device)
    _run(Launcher(_tuned_kernel), 50, device)
    assert tuning.benched == [16, 32, 16, 32]
    assert set(json.loads(_cache_file(device).read_text())["entries"]) == {repr(("scale", 48)), repr(("scale", 50))}


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
        content = json.dumps({"format": launch.CACHE_FORMAT, "fingerprint": fingerprint,
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
    monkeypatch.setenv(launch.CACHE_ENV, str(blocker))  # a file where the directory should be
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
        monkeypatch.setattr(launch, "AUTOTUNE", False)
    else:
        monkeypatch.setenv(launch.CACHE_ENV, how.split()[1])
    assert launch.cache_dir(torch.device(device)) is None
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
        monkeypatch.setattr(launch, "TRITON_VERSION", "0.0.0-other")
    elif other == "device":
        monkeypatch.setattr(launch, "device_slug", lambda device: "other-gpu-sm00")
    else:
        launcher._fingerprint = "0123456789abcdef"
    _run(launcher, 48, device)
    assert tuning.benched == [16, 32, 16, 32]
    files = sorted(tuning.dir.rglob("*.json"))
    assert len(files) == (1 if other == "kernel source" else 2), files
    if other == "kernel source":  # the stale file was rewritten for the new kernel
        assert json.loads(files[0].read_text())["fingerprint"] == "0123456789abcdef"


def test_the_profile_names_the_directory(tuning, device, monkeypatch):
    monkeypatch.delenv(launch.CACHE_ENV)
    mine = dataclasses.replace(profiles.get_profile("cpu"), name="mine", autotune_cache=str(tuning.dir / "{name}"))
    monkeypatch.setattr(profiles, "_active", mine)
    _run(Launcher(_tuned_kernel), 48, device)
    (path,) = tuning.dir.rglob("*.json")
    assert path.relative_to(tuning.dir).parts[0] == "mine"
    monkeypatch.setattr(profiles, "_active", profiles.get_profile("cpu"))  # autotune_cache null: no cache
    assert launch.cache_dir(torch.device(device)) is None


def test_keys_or_configs_json_cannot_keep_are_not_written(tuning, device):
    class Opaque:  # repr names an address: it would never match in another process
        pass

    _run(Launcher(_tuned_kernel), 48, device, key=Opaque())
    assert list(tuning.dir.rglob("*.json")) == []


def test_info_prints_the_cache_in_use(tuning, capsys):
    from sd_kernels import cli

    assert cli.main(["info"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if "autotune cache" in line)
    assert str(tuning.dir) in line and launch.CACHE_ENV in line
