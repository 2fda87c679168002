import logging

import pytest
import torch

from sd_kernels import profiles
from sd_kernels.runtime import dispatch


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    dispatch.reset_fallbacks()
    monkeypatch.delenv("SD_KERNELS_BACKEND", raising=False)
    yield
    dispatch.reset_fallbacks()


def test_interpreter_runs_kernels_on_cpu(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert dispatch.use_kernel("some_op", torch.ones(2))


def test_cpu_without_interpreter_falls_back_logged_once(monkeypatch, caplog):
    """Under a GPU profile, a CPU input is a fallback worth a warning: one line for the reason, however
    many calls and ops meet it; every pair is counted."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with caplog.at_level(logging.DEBUG, logger="sd_kernels"), profiles.using_profile(profiles.get_profile("hopper")):
        for _ in range(3):
            assert not dispatch.use_kernel("some_op", torch.ones(2))
            assert not dispatch.use_kernel("other_op", torch.ones(2))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "some_op" in warnings[0]
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG and "other_op" in r.getMessage()]
    counts = dispatch.fallbacks()
    assert sorted(op for op, _ in counts) == ["other_op", "some_op"] and set(counts.values()) == {3}
    assert all("CUDA" in reason for _, reason in counts)


def test_the_cpu_profiles_reference_path_is_not_a_warning(monkeypatch, caplog):
    """The cpu profile runs the reference on a CPU by design: counted, logged at DEBUG, no warning."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with caplog.at_level(logging.DEBUG, logger="sd_kernels"), profiles.using_profile(profiles.get_profile("cpu")):
        assert not dispatch.use_kernel("some_op", torch.ones(2))
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [r for r in caplog.records if "some_op" in r.getMessage()]
    assert sum(dispatch.fallbacks().values()) == 1


def test_op_reason_wins_and_is_reported(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not dispatch.use_kernel("some_op", torch.ones(2), unsupported="head dim 600 > 256")
    assert ("some_op", "head dim 600 > 256") in dispatch.fallbacks()


def test_forced_triton_raises_instead_of_falling_back(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("SD_KERNELS_BACKEND", "triton")
    with pytest.raises(dispatch.KernelUnavailable, match="some_op"):
        dispatch.use_kernel("some_op", torch.ones(2))


def test_forced_reference_never_runs_kernels(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    assert not dispatch.use_kernel("some_op", torch.ones(2))
    assert dispatch.fallbacks() == {}


def test_bad_backend_value(monkeypatch):
    monkeypatch.setenv("SD_KERNELS_BACKEND", "fast")
    with pytest.raises(ValueError, match="auto"):
        dispatch.use_kernel("some_op", torch.ones(2))


def test_mixed_devices_fall_back(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not dispatch.use_kernel("some_op", torch.ones(2), torch.ones(2, device="meta"))


def test_profile_can_disable_an_op(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    off = profiles.Profile("test-off", "disables gelu", disabled_ops=frozenset({"gelu"}))
    monkeypatch.setattr(profiles, "_active", off)
    assert not dispatch.use_kernel("gelu", torch.ones(2))
    assert ("gelu", "profile 'test-off' disables gelu") in dispatch.fallbacks()
    assert dispatch.use_kernel("geglu", torch.ones(2))
