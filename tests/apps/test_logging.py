"""What users see of the library's logging: nothing from a library that configures no logging (a
NullHandler on ``sd_kernels``, documented), every warning from the command line (its handler), one
line per fallback reason, none where the cpu profile runs the reference by design; a readable
PatchRecord."""

import logging
import subprocess
import sys

import pytest

import sd_kernels
from sd_kernels import models
from sd_kernels.apps import cli
from sd_kernels.runtime import dispatch

WARN = """
import logging, sys
{setup}
import sd_kernels
logging.getLogger("sd_kernels.runtime.dispatch").warning("sd_kernels: a test warning")
"""


@pytest.mark.parametrize("setup, shown", [("", False), ("logging.basicConfig()", True)])
def test_a_library_user_sees_the_warnings_once_logging_is_configured(setup, shown):
    run = subprocess.run([sys.executable, "-c", WARN.format(setup=setup)], capture_output=True, text=True, check=True,
                         timeout=60)
    assert ("a test warning" in run.stderr) == shown
    assert any(isinstance(h, logging.NullHandler) for h in logging.getLogger("sd_kernels").handlers)


@pytest.fixture
def no_interpreter(monkeypatch):
    """CPU without Triton's interpreter: the kernels cannot run, every op takes the reference."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.delenv("SD_KERNELS_BACKEND", raising=False)
    dispatch.reset_fallbacks()
    yield
    dispatch.reset_fallbacks()


@pytest.mark.parametrize("profile, lines", [("hopper", 1), ("cpu", 0)])
def test_the_command_shows_one_line_per_fallback_reason(no_interpreter, tmp_path, capsys, profile, lines):
    """Under a GPU profile on a CPU every op falls back for one reason: one warning line, though
    several ops fall back (all counted); under the cpu profile that is its design: no line."""
    assert cli.main(["generate", "--prompt", "x", "--steps", "1", "--device", "cpu", "--profile", profile,
                     "--out", str(tmp_path / "x.png")]) == 0
    err = capsys.readouterr().err
    shown = [line for line in err.splitlines() if line.startswith("sd_kernels: ")]
    assert len(shown) == lines, err
    assert len({op for op, _ in dispatch.fallbacks()}) >= 3
    assert "torchvision" not in err


def test_a_patch_record_says_what_it_is():
    pipe = models.build_pipeline("tiny")
    record = sd_kernels.patch(pipe, profile="cpu")
    text = repr(record)
    assert text.startswith("<PatchRecord applied: profile='cpu', parts=['unet', 'vae'], cuda_graph=None, compile=None")
    assert f"{sum(record.counts.values())} replacements" in text
    sd_kernels.unpatch(pipe)
    assert repr(record).startswith("<PatchRecord undone:")
