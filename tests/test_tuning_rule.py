"""The launch configuration of a key no table holds (sd_kernels/runtime/tuning_rule.py, the default
``SD_KERNELS_AUTOTUNE=rule``): the nearest tuned key's choice, from this GPU's tables, else from those
of GPUs of its architecture, else the kernel's first config for the call; never a timing run. Tables
serve across Triton versions where the kernel's fingerprint matches. Runs on CPU through the
interpreter, with the autotuner's benchmark replaced by a recorder that fails the test if called."""

import importlib
import json
import logging

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from sd_kernels import profiles
from sd_kernels.runtime import tuning_rule
from sd_kernels.runtime.launch import Launcher

cache_mod = importlib.import_module("sd_kernels.runtime.autotune_cache")
launch_mod = importlib.import_module("sd_kernels.runtime.launch")


@triton.jit
def _scale(x_ptr, y_ptr, n, factor, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * factor, mask=offs < n)


_CONFIGS = [triton.Config({"BLOCK": b}, num_warps=w) for b, w in ((64, 4), (32, 2), (16, 1))]


def _no_wider_than_n(configs, named_args, **kwargs):
    """The kernel's own pruning: no block wider than the data (the rule must respect it)."""
    return [c for c in configs if c.kwargs["BLOCK"] <= max(16, named_args["n"])]


_kernel = triton.autotune(_CONFIGS, key=["n"], prune_configs_by={"early_config_prune": _no_wider_than_n})(_scale)
ENTRY = {b: c.all_kwargs() for b, c in zip((64, 32, 16), _CONFIGS)}


@pytest.fixture
def rule(monkeypatch, tmp_path):
    """Rule mode, no user cache, the shipped tables under tmp_path (the package's own stay out), a
    hopper-like profile active, and the autotuner's benchmark forbidden."""
    monkeypatch.setattr(cache_mod, "MODE", "rule")
    monkeypatch.setattr(cache_mod, "AUTOTUNE", True)
    monkeypatch.setenv(cache_mod.CACHE_ENV, "off")
    monkeypatch.delenv(cache_mod.SHIPPED_ENV, raising=False)
    monkeypatch.setattr(cache_mod, "SHIPPED_ROOT", tmp_path)
    monkeypatch.setattr(cache_mod, "device_slug", lambda device: "gpu-a-sm90")
    monkeypatch.setattr(profiles, "_active", profiles.get_profile("cpu"))

    def timed(*args, **kwargs):
        raise AssertionError("a config was timed")

    monkeypatch.setattr(_kernel, "_bench", timed)
    monkeypatch.setattr(_kernel, "cache", {})
    return tmp_path


def _ship(root, slug, entries, version=None, fingerprint=None, timings=None):
    folder = root / "cpu" / slug / f"triton-{version or cache_mod.TRITON_VERSION}"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{Launcher(_kernel).name}.json"
    path.write_text(json.dumps({"format": cache_mod.CACHE_FORMAT, "fingerprint": fingerprint or
                                Launcher(_kernel).fingerprint, "entries": {repr(k): v for k, v in entries.items()},
                                **({} if timings is None else {"timings": {repr(k): v for k, v in timings.items()}})}))
    return path


def _run(launcher, n, device):
    x = torch.randn(n, device=device)
    y = torch.full_like(x, float("nan"))
    launcher(("scale", n), lambda meta: (triton.cdiv(n, meta["BLOCK"]),), x, y, n, 3.0)
    torch.testing.assert_close(y, x * 3.0)
    return launcher.memo[("scale", n)]["BLOCK"]


def test_a_key_splits_into_a_skeleton_and_its_numbers_on_a_log_scale():
    skeleton, numbers = tuning_rule.split_key(repr((4096, 77, "P(block=64, split=True)", torch.float16, "tf32")))
    assert skeleton == "(#, #, 'P(block=#, split=True)', torch.float16, 'tf32')"  # dtype and name digits stay
    assert numbers == pytest.approx([12.0004, 6.2854, 6.0224], abs=1e-4)


def test_the_nearest_key_of_the_same_skeleton_wins_and_equal_distances_vote():
    table = tuning_rule.Neighbours({
        repr((4096, 40, torch.float16)): ENTRY[64],
        repr((1024, 40, torch.float16)): ENTRY[32],
        repr((3000, 40, torch.float32)): ENTRY[16],  # closer, but another dtype: another skeleton
    })
    allowed = list(ENTRY.values())
    assert tuning_rule.nearest(repr((3000, 40, torch.float16)), [table], allowed) == (
        ENTRY[64], repr((4096, 40, torch.float16)))
    assert tuning_rule.nearest(repr((1500, 40, torch.float16)), [table], allowed)[0] == ENTRY[32]
    # a config the kernel does not keep for this call is passed over for the next nearest
    assert tuning_rule.nearest(repr((3000, 40, torch.float16)), [table], [ENTRY[32], ENTRY[16]])[0] == ENTRY[32]
    # two keys at the same distance with the same config outvote a third
    tied = tuning_rule.Neighbours({repr((16, 8, 8)): ENTRY[16], repr((8, 16, 8)): ENTRY[16],
                                   repr((8, 8, 16)): ENTRY[32]})
    assert tuning_rule.nearest(repr((8, 8, 8)), [tied], allowed)[0] == ENTRY[16]
    assert tuning_rule.nearest(repr(("other",)), [table], allowed) is None


def test_an_untabled_key_takes_the_nearest_tuned_choice_without_timing(rule, device, caplog):
    _ship(rule, "gpu-a-sm90", {("scale", 1000): ENTRY[32], ("scale", 48): ENTRY[16]})
    launcher = Launcher(_kernel)
    with caplog.at_level(logging.INFO, logger="sd_kernels"):
        assert _run(launcher, 900, device) == 32  # nearest: 1000
        assert _run(launcher, 50, device) == 16  # nearest: 48
        assert _run(launcher, 1000, device) == 32  # tabled
    assert launcher.ruled == {("scale", 900): repr(("scale", 1000)), ("scale", 50): repr(("scale", 48))}
    said = [r.getMessage() for r in caplog.records if "no tuning table holds" in r.getMessage()]
    assert len(said) == 1 and "nearest tuned key" in said[0]  # once per kernel


def test_a_config_launches_with_its_options_in_one_order_whichever_source_gave_it(rule, device):
    """Triton keys its in-memory kernel cache on the launch options' string: a table's entry (JSON,
    keys sorted) and the rule's or the autotuner's choice of the same config must launch alike, or the
    same kernel compiles again at each new size."""
    _ship(rule, "gpu-a-sm90", {("scale", 1000): dict(sorted(ENTRY[32].items()))})
    launcher = Launcher(_kernel)
    _run(launcher, 1000, device)  # tabled
    _run(launcher, 900, device)  # the rule
    order = list(_CONFIGS[1].all_kwargs())
    assert list(launcher.memo[("scale", 1000)]) == list(launcher.memo[("scale", 900)]) == order


def test_the_rule_respects_the_kernels_pruning_for_the_call(rule, device):
    _ship(rule, "gpu-a-sm90", {("scale", 4096): ENTRY[64]})
    assert _run(Launcher(_kernel), 20, device) == 16  # 64 and 32 are wider than 20: the first kept config


def test_without_any_table_the_kernels_first_config_for_the_call_serves(rule, device):
    launcher = Launcher(_kernel)
    assert _run(launcher, 1000, device) == 64 and _run(launcher, 40, device) == 32
    assert launcher.ruled == {("scale", 1000): "", ("scale", 40): ""}


def test_a_gpu_without_a_table_takes_one_of_its_architecture_never_another(rule, device):
    _ship(rule, "gpu-b-sm80", {("scale", 1000): ENTRY[16]})  # another architecture: never read
    assert _run(Launcher(_kernel), 900, device) == 64
    _ship(rule, "gpu-b-sm90", {("scale", 1000): ENTRY[32]})
    launcher = Launcher(_kernel)
    assert _run(launcher, 900, device) == 32
    assert launcher.cache.describe().startswith("no table for this GPU: nearest keys of cpu/gpu-b-sm90/")
    assert launcher.cache.get(("scale", 1000)) is None  # a sibling's table serves the rule, not as this GPU's


def test_a_table_of_another_triton_serves_when_the_kernel_is_unchanged(rule, device, caplog):
    _ship(rule, "gpu-a-sm90", {("scale", 1000): ENTRY[32]}, version="0.1.0")
    launcher = Launcher(_kernel)
    assert _run(launcher, 1000, device) == 32 and launcher.ruled == {}  # served as this GPU's own table
    assert "triton-0.1.0" in launcher.cache.describe()
    # the installed Triton's own table wins; one made for another source of the kernel is ignored, said once
    stale = _ship(rule, "gpu-a-sm90", {("scale", 1000): ENTRY[16]}, fingerprint="0123456789abcdef")
    launcher = Launcher(_kernel)
    with caplog.at_level(logging.WARNING, logger="sd_kernels"):
        assert _run(launcher, 1000, device) == 32
    assert [r for r in caplog.records if str(stale) in r.getMessage()] == []  # an older valid table served
    (stale.parent.parent / "triton-0.1.0" / stale.name).unlink()
    launcher = Launcher(_kernel)
    with caplog.at_level(logging.WARNING, logger="sd_kernels"):
        assert _run(launcher, 1000, device) == 64  # nothing valid: the rule's fallback
    assert len([r for r in caplog.records if str(stale) in r.getMessage()]) == 1


def test_a_dry_run_records_a_ruled_key_instead_of_leaving_it_to_the_real_call(rule, device, monkeypatch):
    """The precompile dry run launches (so records the compile of) a key the rule serves: unlike a key
    that needs timing, it needs no real launch to be chosen."""
    monkeypatch.setattr(launch_mod, "dry", lambda: True)
    launcher = Launcher(_kernel)
    assert _run(launcher, 900, device) == 64  # the interpreter does not skip the launch: it ran


def test_a_config_the_gpu_cannot_hold_gives_way_to_the_next(rule, device, monkeypatch, caplog):
    """Tables and the rule's fallback are made on Hopper; a GPU with less shared memory refuses some
    configs when they compile (OutOfResources): the next config the kernel keeps takes over, said once."""
    launcher = Launcher(_kernel)
    jit = launcher.jit

    class Refusing:
        fn = jit.fn

        def __getitem__(self, grid):
            def run(*args, **kwargs):
                if kwargs["BLOCK"] == 64:
                    raise OutOfResources(300_000, 232_448, "shared memory")
                return jit[grid](*args, **kwargs)
            return run

    monkeypatch.setattr(launcher, "jit", Refusing())
    monkeypatch.setattr(launch_mod, "FAST_LAUNCH", False)
    with caplog.at_level(logging.WARNING, logger="sd_kernels"):
        assert _run(launcher, 1000, device) == 32
        assert _run(launcher, 2000, device) == 32  # the refused config is not tried again
    assert len([r for r in caplog.records if "needs more resources" in r.getMessage()]) == 1
    assert launcher.too_large == [ENTRY[64]]


@pytest.mark.parametrize("value, mode", [("", "rule"), ("rule", "rule"), ("1", "time"), ("on", "time"),
                                         ("0", "first"), ("OFF", "first")])
def test_the_environment_names_the_mode(value, mode):
    assert cache_mod._mode(value) == mode


def test_an_unknown_mode_is_refused_naming_the_variable():
    with pytest.raises(ValueError, match="SD_KERNELS_AUTOTUNE='sometimes'"):
        cache_mod._mode("sometimes")


# ---------------------------------------------------------------------------------------------
# Ties: a config that timed within TIE + TIE_MS of a key's choice serves it where it is compiled and the
# choice is not


def _compiled(launcher, monkeypatch, blocks):
    """The launcher's direct path faked to say which BLOCKs are compiled (the interpreter compiles
    nothing: DirectPath.compiled is tested against a fake JIT in tests/test_launch.py)."""
    seen = []

    def compiled(meta, args, kwargs):
        seen.append(meta["BLOCK"])
        return meta["BLOCK"] in blocks

    monkeypatch.setattr(launcher.direct, "compiled", compiled)
    return seen


def test_a_compiled_tie_serves_a_tabled_or_ruled_key_whose_choice_is_not_compiled(rule, device, monkeypatch):
    _ship(rule, "gpu-a-sm90", {("scale", 1000): ENTRY[64], ("scale", 48): ENTRY[16]},
          timings={("scale", 1000): [[ENTRY[64], 0.1], [ENTRY[32], 0.1025], [ENTRY[16], 0.101]]})
    launcher = Launcher(_kernel)
    seen = _compiled(launcher, monkeypatch, {32})
    assert _run(launcher, 1000, device) == 32  # tabled 64, not compiled; ties 16 (not compiled), then 32
    assert seen == [64, 16, 32] and launcher.tied == {("scale", 1000): ENTRY[32]}
    assert _run(launcher, 900, device) == 32 and launcher.ruled == {("scale", 900): repr(("scale", 1000))}
    assert _run(launcher, 50, device) == 16  # the nearest key (48) has no ties: its choice
    assert set(launcher.tied) == {("scale", 1000), ("scale", 900)}


def test_a_compiled_choice_or_no_compiled_tie_keeps_the_choice(rule, device, monkeypatch):
    _ship(rule, "gpu-a-sm90", {("scale", 1000): ENTRY[64]},
          timings={("scale", 1000): [[ENTRY[64], 1.0], [ENTRY[32], 1.0]]})
    launcher = Launcher(_kernel)
    seen = _compiled(launcher, monkeypatch, {64, 32})
    assert _run(launcher, 1000, device) == 64 and seen == [64]  # the choice is compiled: nothing else asked
    other = Launcher(_kernel)
    _compiled(other, monkeypatch, {16})
    assert _run(other, 1000, device) == 64 and other.tied == {}


def test_a_tie_the_kernel_prunes_for_the_call_or_does_not_have_is_never_taken(rule, device, monkeypatch):
    path = _ship(rule, "gpu-a-sm90", {("scale", 40): ENTRY[16]},
                 timings={("scale", 40): [[ENTRY[16], 0.01], [ENTRY[64], 0.01], [{"BLOCK": 8}, 0.01],
                                          [ENTRY[32], 0.02]]})
    launcher = Launcher(_kernel)
    _compiled(launcher, monkeypatch, {64, 8})
    assert _run(launcher, 40, device) == 16  # 64 is wider than 40: pruned for this call
    # BLOCK 8 is no config of the kernel: dropped; 32 took twice as long: no tie
    assert launcher.cache.ties(repr(("scale", 40)), ENTRY[16]) == [ENTRY[64]]
    data = json.loads(path.read_text())
    data["timings"] = ["not a mapping"]
    path.write_text(json.dumps(data))
    fresh = Launcher(_kernel)
    _compiled(fresh, monkeypatch, {32})
    assert _run(fresh, 40, device) == 16  # malformed timings are dropped, the entries serve
    assert fresh.cache.shipped_timings == {} and fresh.tied == {}


def test_a_gpu_without_a_table_takes_ties_from_the_table_the_rule_used(rule, device, monkeypatch):
    """An H100 takes the H200's choices by the rule, and with them the H200's ties."""
    _ship(rule, "gpu-b-sm90", {("scale", 1000): ENTRY[64]},
          timings={("scale", 1000): [[ENTRY[64], 1.0], [ENTRY[32], 1.05]]})
    launcher = Launcher(_kernel)
    _compiled(launcher, monkeypatch, {32})
    assert _run(launcher, 900, device) == 32 and launcher.ruled == {("scale", 900): repr(("scale", 1000))}
    assert launcher.cache.get(("scale", 1000)) is None  # not this GPU's table


def test_a_ruled_key_takes_no_ties_measured_against_another_choice(rule, device, monkeypatch):
    """The rule found the nearest key in another GPU's table; this GPU's own table holds the same key
    with another choice and its timings: those ties belong to that choice, not to the rule's."""
    _ship(rule, "gpu-a-sm90", {("scale", 48): ENTRY[16]},
          timings={("scale", 48): [[ENTRY[16], 1.0], [ENTRY[32], 1.0]]})
    cache = Launcher(_kernel)._cache_file((torch.empty(1),))
    assert cache.ties(repr(("scale", 48)), ENTRY[64]) == []
    assert cache.ties(repr(("scale", 48)), ENTRY[16]) == [ENTRY[32]]
