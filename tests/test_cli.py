import pytest

from sd_kernels import cli


def test_info_prints_versions_and_profile(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "diffusers" in out and "profile" in out


def test_demo_writes_a_png_on_cpu(tmp_path, capsys):
    out = tmp_path / "img.png"
    assert cli.main(["demo", "--steps", "2", "--device", "cpu", "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = capsys.readouterr().out
    assert "stock:" in text and "patched:" in text and "PSNR" in text


@pytest.mark.parametrize(
    "argv", [[], ["frobnicate"], ["demo", "--steps", "0"], ["demo", "--steps", "x"], ["demo", "--dtype", "fp8"]]
)
def test_bad_arguments_exit_non_zero(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code != 0
    assert "usage" in capsys.readouterr().err


def test_unknown_model_is_a_clear_error(capsys):
    assert cli.main(["demo", "--model", "./no/such/dir", "--device", "cpu"]) == 2
    assert "neither a shipped config" in capsys.readouterr().err


def test_unknown_profile_is_a_clear_error(capsys):
    assert cli.main(["info", "--profile", "mali"]) == 2
    assert "known profiles" in capsys.readouterr().err
