"""`sd-kernels generate`'s options: parsing, prompt files (text and JSONL), the plan of images and their
seeds, and a clear error naming the option for every bad value, before any model is built."""

import json

import pytest

from sd_kernels import models
from sd_kernels.apps import cli, options


@pytest.fixture
def no_work(monkeypatch):
    """Any model built or loaded fails the test: the errors below come before any work."""
    def fail(*a, **k):
        pytest.fail("a pipeline was built")

    monkeypatch.setattr(models, "load_pipeline", fail)
    monkeypatch.setattr(models, "build_pipeline", fail)
    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")


@pytest.fixture
def files(tmp_path):
    from PIL import Image

    (tmp_path / "p.txt").write_text("a cat\n")
    Image.new("RGB", (64, 48)).save(tmp_path / "init.png")
    (tmp_path / "notes.txt").write_text("not an image")
    (tmp_path / "lora.safetensors").write_bytes(b"")
    return tmp_path


@pytest.mark.parametrize("argv, message", [
    (["--width", "60"], "--width 60: the image side must be a multiple of 8"),
    (["--height", "100"], "--height 100: the image side must be a multiple of 8"),
    (["--size", "64", "--width", "64"], "--size is the square shorthand"),
    (["--size", "513"], "--size 513: the image side must be a multiple of 8"),
    (["--guidance-scale", "-1"], "--guidance-scale -1.0: a finite number >= 0"),
    (["--guidance-scale", "nan"], "--guidance-scale nan"),
    (["--scheduler", "euler_a"], "--scheduler 'euler_a': unknown; one of ddim"),
    (["--seed", "-2"], "--seed -2: a seed is in [0, 2**64 - 1], or -1"),
    (["--seed", str(2**64)], "--seed 18446744073709551616"),
    (["--lora", "{tmp}/missing.safetensors:0.5"], "--lora {tmp}/missing.safetensors:0.5: no such file"),
    (["--lora", "{tmp}/lora.safetensors:inf"], "the scale must be a finite number"),
    (["--mask", "{tmp}/init.png"], "--mask repaints part of an --image"),
    (["--strength", "0.5"], "--strength is how much of an --image"),
    (["--image", "{tmp}/init.png", "--strength", "1.5"], "--strength 1.5: a number in (0, 1]"),
    (["--image", "{tmp}/missing.png"], "--image {tmp}/missing.png: no such file"),
    (["--image", "{tmp}/notes.txt"], "--image/--mask: cannot read it as an image"),
    (["--images-per-prompt", "2"], "--images-per-prompt goes with --prompts"),
    (["--batch-size", "4"], "--batch-size goes with --prompts"),
    (["--scheduler", "lms"], "--scheduler lms: LMSDiscreteScheduler needs scipy"),
    (["--negative-prompt", "blur", "--guidance-scale", "1"], "--negative-prompt: a negative prompt works only with a "
                                                             "guidance scale above 1"),
    (["--config", "tiny"], "--config tiny: names a single-file checkpoint's architecture"),
    (["--profile", "mali"], "known profiles"),
])
def test_a_bad_value_is_named_before_any_work(argv, message, files, no_work, capsys):
    if "lms" in argv:
        pytest.importorskip("diffusers")
        import importlib.util

        if importlib.util.find_spec("scipy") is not None:
            pytest.skip("scipy is installed here: LMS can run")
    argv = [a.replace("{tmp}", str(files)) for a in argv]
    assert cli.main(["generate", "--prompt", "x", "--device", "cpu", "--out", str(files / "o.png"), *argv]) == 2
    err = capsys.readouterr().err
    assert message.replace("{tmp}", str(files)) in err and "Traceback" not in err


@pytest.mark.parametrize("argv, message", [
    (["--width", "0"], "expected a positive integer"), (["--images-per-prompt", "0"], "expected a positive integer"),
    (["--batch-size", "x"], "expected a positive integer"), (["--guidance-scale", "high"], "expected a number"),
    (["--strength", "most"], "expected a number"), (["--cuda-graph", "always"], "invalid choice"),
])
def test_malformed_values_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["generate", "--prompt", "x", *argv])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_batch_mode_names_bad_values_before_any_work(files, no_work, capsys):
    """The same checks with --prompts, and those only a batch has: JSONL lines, a seed that would pass
    2**64 - 1 on a later image (named --seed, not a failure at image 3)."""
    out = str(files / "out")
    base = ["generate", "--prompts", str(files / "p.txt"), "--out", out, "--device", "cpu"]
    assert cli.main([*base, "--width", "12"]) == 2
    assert "--width 12" in capsys.readouterr().err
    (files / "three.txt").write_text("a\nb\nc\n")
    argv = ["generate", "--prompts", str(files / "three.txt"), "--out", out, "--device", "cpu"]
    assert cli.main([*argv, "--seed", str(2**64 - 2)]) == 2
    err = capsys.readouterr().err
    assert "--seed: image 2 would get seed 18446744073709551616, past 2**64 - 1" in err
    assert cli.main([*argv, "--seed", str(2**64 - 3), "--images-per-prompt", "2"]) == 2
    assert "--seed: image 3 would get seed" in capsys.readouterr().err
    assert not list((files / "out").glob("*.png"))
    fresh = ["generate", "--prompts", str(files / "three.txt"), "--out", str(files / "new"), "--device", "cpu"]
    assert cli.main([*fresh, "--model", "tiny-flux", "--scheduler", "euler"]) == 2  # refused by the model's checks
    assert "--scheduler euler: a EulerDiscreteScheduler cannot replace" in capsys.readouterr().err
    assert not (files / "new").exists()  # and no folder left behind


@pytest.mark.parametrize("line, message", [
    ('{"prompt": ""}', "'prompt' must be a non-empty string"),
    ('{"text": "a"}', "unknown key(s) ['text']"),
    ('["a"]', "a JSON object is expected, got list"),
    ('{"prompt": "a", "seed": "1"}', "'seed' must be an integer"),
    ('{"prompt": "a", "seed": true}', "'seed' must be an integer"),
    ('{"prompt": "a", "size": 60}', "'size' 60: the image side must be a multiple of 8"),
    ('{"prompt": "a", "width": 64.0}', "'width' 64.0: a positive integer"),
    ('{"prompt": "a", "size": 64, "width": 64}', "'size' is the square shorthand"),
    ('{"prompt": "a", "steps": 0}', "'steps' 0: a positive integer"),
    ('{"prompt": "a", "guidance": "high"}', "'guidance' 'high': a finite number"),
    ('{"prompt": "a", "negative": 3}', "'negative' must be a string"),
    ('{"prompt": "a"', "not JSON"),
])
def test_jsonl_lines_are_checked_with_file_and_line(tmp_path, line, message):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "fine"}\n\n' + line + "\n")
    with pytest.raises(ValueError) as exc:
        options.read_prompts(path)
    assert f"--prompts {path} line 3: " in str(exc.value) and message in str(exc.value)


def test_jsonl_fields_override_the_run_settings(tmp_path):
    path = tmp_path / "p.jsonl"
    lines = [{"prompt": "a"}, {"prompt": "b", "negative": "blur", "seed": 100, "size": 32, "steps": 3, "guidance": 2},
             {"prompt": "c", "width": 48}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    specs = options.read_prompts(path)
    settings = options.Settings(steps=5, images_per_prompt=2, negative="ugly")
    jobs = options.plan(specs, settings, 7, (64, 64), 7.5)
    got = [(j.index, j.prompt, j.negative, j.seed, j.width, j.height, j.steps, j.guidance) for j in jobs]
    assert got == [(0, "a", "ugly", 7, 64, 64, 5, 7.5), (1, "a", "ugly", 8, 64, 64, 5, 7.5),
                   (2, "b", "blur", 100, 32, 32, 3, 2.0), (3, "b", "blur", 101, 32, 32, 3, 2.0),
                   (4, "c", "ugly", 11, 48, 64, 5, 7.5), (5, "c", "ugly", 12, 48, 64, 5, 7.5)]
    assert [j.file for j in jobs[:2]] == ["00000.png", "00001.png"]


def test_batches_group_images_that_share_a_shape():
    settings = options.Settings(steps=2)
    specs = [options.PromptSpec("a"), options.PromptSpec("b", width=32), options.PromptSpec("c"),
             options.PromptSpec("d", negative="x"), options.PromptSpec("e"), options.PromptSpec("f")]
    jobs = options.plan(specs, settings, 0, (64, 64), 7.5)
    groups = [[j.prompt for j in b] for b in options.batches(jobs, 2)]
    # a missing negative prompt and a given one never share a call (SDXL zeroes the former)
    assert groups == [["a", "c"], ["b"], ["d"], ["e", "f"]]
    assert [[j.prompt for j in b] for b in options.batches(jobs, 1)] == [[p] for p in "abcdef"]


@pytest.mark.parametrize("text, lora", [
    ("{tmp}/l.safetensors", ("{tmp}/l.safetensors", 1.0)),
    ("{tmp}/l.safetensors:0.6", ("{tmp}/l.safetensors", 0.6)),
    ("{tmp}/dir:with:colons", ("{tmp}/dir:with:colons", 1.0)),
    ("{tmp}/dir:with:colons:-0.5", ("{tmp}/dir:with:colons", -0.5)),
])
def test_lora_specs(tmp_path, text, lora):
    (tmp_path / "l.safetensors").write_bytes(b"")
    (tmp_path / "dir:with:colons").mkdir()
    got = options.parse_lora(text.format(tmp=tmp_path))
    assert (got.path, got.scale) == (lora[0].format(tmp=tmp_path), lora[1])


def test_scheduler_names_map_to_diffusers_classes_that_exist():
    import diffusers

    for name, spec in options.SCHEDULERS.items():
        cls = getattr(diffusers, spec.cls)
        if type(cls).__name__ == "DummyObject":  # its extra package is not installed: refused, tested above
            continue
        params = __import__("inspect").signature(cls.__init__).parameters
        assert all(k in params for k, _ in spec.overrides), name
    assert options.scheduler_name("DPMSolverMultistepScheduler", {"use_karras_sigmas": True,
                                                                   "algorithm_type": "dpmsolver++"}) == "dpm++2m-karras"
    assert options.scheduler_name("PNDMScheduler", {}) == "pndm"
    assert options.scheduler_name("FlowMatchEulerDiscreteScheduler", {}) == "FlowMatchEulerDiscreteScheduler"
