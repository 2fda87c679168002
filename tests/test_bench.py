"""The end-to-end bench harness on CPU: its plan, CSV schema, time cap, failure handling, summaries, plots."""

import csv
import dataclasses
import importlib
import json
import pathlib
import sys
import types

import pytest
import torch

from bench import e2e, plot, report

ROOT = pathlib.Path(__file__).resolve().parents[1]
PNG = b"\x89PNG\r\n\x1a\n"


def _names(items, csv_name):
    return [(t.label, s.name) for t, s, n in items if n == csv_name]


def test_quick_plan_is_every_variant_on_sd15_and_the_uncompiled_ones_elsewhere():
    items = e2e.plan("quick")
    variants = _names(items, "e2e.csv")
    assert [v for t, v in variants if t == "sd15@512"] == list(e2e.DEFAULT_VARIANTS)
    assert "stock+compile-graphs" in e2e.DEFAULT_VARIANTS and "stock+compile-max-autotune" not in e2e.DEFAULT_VARIANTS
    for other in ("sd21@768", "sdxl@1024"):
        assert [v for t, v in variants if t == other] == ["stock", "stock+graph", "patched", "patched+graph"]
    assert _names(items, "ablation.csv") == [("sd15@512", s.name) for s in e2e.ABLATION]


def test_full_plan_runs_every_variant_everywhere():
    items = e2e.plan("full")
    labels = {t for t, _ in _names(items, "e2e.csv")}
    assert labels == {"sd15@512", "sd21@512", "sd21@768", "sdxl@1024"}
    assert len(_names(items, "e2e.csv")) == 4 * len(e2e.DEFAULT_VARIANTS)


def test_explicit_models_and_variants():
    items = e2e.plan("quick", e2e.parse_targets("sdxl, sd21@512"), ["patched+graph"], ablation=False)
    assert [(t.label, s.name, n) for t, s, n in items] == [("sdxl@1024", "patched+graph", "e2e.csv"),
                                                           ("sd21@512", "patched+graph", "e2e.csv")]


def test_the_fp8_tier_is_a_variant_asked_for_by_name_and_bench_fp8_runs_the_same_setup(monkeypatch):
    """bench.e2e and bench.dit run the FP8 tier when named (lossy: never by default); bench.fp8's rows are the
    same setups, with their switches."""
    from bench import fp8, setups

    tier, compiled = setups.VARIANTS["patched+graph+fp8"], setups.VARIANTS["patched+graph+compile+fp8"]
    assert (tier.precision, tier.patched, tier.graph, tier.patch_compile) == ("fp8", True, True, False)
    assert (compiled.precision, compiled.patch_compile) == ("fp8", True)
    assert not {tier.name, compiled.name} & set(setups.DEFAULT_VARIANTS)
    items = e2e.plan("quick", e2e.parse_targets("sdxl"), [tier.name], ablation=False)
    assert [(t.label, s) for t, s, n in items] == [("sdxl@1024", tier)]
    seen = []
    monkeypatch.setattr(fp8, "_applied_with", lambda pipe, setup, changed: seen.append((setup, changed)))
    for row, base in (("fp8", tier), ("fp8+compile", compiled), ("fp8+exact-attention", tier)):
        label, factory = fp8._setup(row, "regional")
        factory(None)
        setup, changed = seen[-1]
        assert label == setup.name == fp8.FP8_ROWS[row]
        assert setup == dataclasses.replace(base, name=label)
        assert (changed is None) == (row != "fp8+exact-attention")


def test_controlnet_targets_name_their_base_config():
    (t,) = e2e.parse_targets("sd15+controlnet")
    assert (t.label, t.base, t.controlnet, t.size) == ("sd15+controlnet@512", "sd15", True, 512)
    assert not e2e.parse_targets("sd15")[0].controlnet
    with pytest.raises(ValueError, match="needs a shipped config"):
        e2e.parse_targets("./somewhere+controlnet")


def test_controlnet_pipeline_rows_time_the_controlnet_on_cpu(tmp_path, monkeypatch):
    """The ControlNet target end to end on CPU (reference kernels in float32, which the CPU runs fast: the
    pipeline path, not the kernels)."""
    import torch

    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    items = e2e.plan("quick", e2e.parse_targets("tiny+controlnet@64"), ["stock", "patched"], ablation=False)
    rows = e2e.run(items, tmp_path, steps=2, max_minutes=5, device="cpu", dtype=torch.float32,
                   repeats=1)  # a test of the plumbing
    assert [r["status"] for r in rows] == ["ok", "ok"], rows
    import sd_kernels
    from sd_kernels import models

    plain = sd_kernels.patch(models.build_pipeline("tiny")).counts["attention_processor"]
    assert f"attention_processor={plain}" not in rows[1]["patched"]  # the patch reached the ControlNet too
    assert "attention_processor=" in rows[1]["patched"]
    assert float(rows[1]["unet_rel_err"]) < 1e-3


@pytest.mark.parametrize("text, message", [
    ("sd15@abc", "must be pixels"), ("sd15@500", "multiple of 64"), ("tiny@0", "the size, 0, must be a positive"),
    ("./no/such/model", "neither a shipped config"), ("", "no model given"),
])
def test_bad_targets_are_named(text, message):
    with pytest.raises(ValueError, match=message):
        e2e.parse_targets(text)


def test_the_end_to_end_harness_refuses_a_transformer_that_the_others_take():
    """bench.e2e times UNet pipelines and points to bench.dit; bench.tune and bench.cold parse the same targets."""
    import argparse

    assert [t.model for t in e2e.parse_targets("flux-dev@1024,sd3-medium@1024")] == ["flux-dev", "sd3-medium"]
    args = argparse.Namespace(steps=2, models="tiny-xl,tiny-flux", variants="stock", selection="quick",
                              no_ablation=True)
    with pytest.raises(ValueError, match="model 'tiny-flux@.*': a FluxPipeline; .* python -m bench.dit"):
        e2e.items_from(args)


def test_bad_variant_and_selection_are_named():
    with pytest.raises(ValueError, match="unknown.*'eager'.*known: stock"):
        e2e.plan("quick", variants=["eager"])
    with pytest.raises(ValueError, match="--selection 'huge'"):
        e2e.plan("huge")


def test_estimates_grow_with_size_and_compilation():
    sd15, sdxl = e2e.Target("sd15", 512), e2e.Target("sdxl", 1024)
    eager, compiled = e2e.VARIANTS["stock"], e2e.VARIANTS["stock+compile-graphs"]
    assert 0 < e2e.estimate_s(sd15, eager, 20) < e2e.estimate_s(sdxl, eager, 20)
    assert e2e.estimate_s(sd15, compiled, 20) >= e2e.estimate_s(sd15, eager, 20) + e2e.COMPILE_S["sd15"]


def _read(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_time_cap_skips_and_still_writes_every_row(tmp_path):
    items = e2e.plan("quick", e2e.parse_targets("tiny"), ["stock", "patched"], ablation=True)
    rows = e2e.run(items, tmp_path, steps=2, max_minutes=0, device="cpu")
    assert len(rows) == len(items)
    assert all("--max-minutes" in r["status"] for r in rows)
    written = _read(tmp_path / "e2e.csv") + _read(tmp_path / "ablation.csv")
    assert len(written) == len(items)
    with open(tmp_path / "e2e.csv", newline="") as f:
        assert next(csv.reader(f)) == e2e.FIELDS
    assert all(r["device"] and r["torch"] and r["date"] and r["diffusers"] for r in written)


def test_csv_of_another_schema_is_not_appended_to(tmp_path):
    (tmp_path / "e2e.csv").write_text("component,variant,ms\nunet,stock,1.0\n")
    log = e2e.CsvLog(tmp_path, {})
    with pytest.raises(ValueError, match="another schema"):
        log.append("e2e.csv", {"model": "tiny"})


class _FakeBench:
    """Stands in for e2e.Bench: no pipeline; "patched" fails as a broken variant would."""

    def __init__(self, target, steps, device, dtype, repeats):
        self.target = target

    def measure(self, setup):
        if setup.name == "patched":
            raise RuntimeError("kernel fault\nsecond line")
        return {"model": self.target.model, "size": self.target.size, "variant": setup.name, "status": "ok",
                "e2e_ms": 10.0}


def test_a_failing_variant_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch):
    monkeypatch.setattr(e2e, "Bench", _FakeBench)
    items = e2e.plan("quick", e2e.parse_targets("tiny"), ["patched", "stock", "stock+graph"], ablation=False)
    rows = e2e.run(items, tmp_path, steps=2, max_minutes=5, device="cpu", repeats=1)  # a test of the plumbing
    assert [r["status"] for r in rows] == ["error: RuntimeError: kernel fault", "ok",
                                           "skipped: CUDA graph and torch.compile variants need a GPU"]
    assert [r["status"] for r in _read(tmp_path / "e2e.csv")] == [r["status"] for r in rows]


def _row(variant, e2e_ms, peak, **kw):
    return {"model": "sd15", "size": 512, "variant": variant, "status": "ok", "e2e_ms": e2e_ms, "unet_ms": e2e_ms / 20,
            "peak_over_weights_MB": peak, **kw}


def test_ablation_changes_are_relative_to_the_baseline():
    rows = [_row("baseline", 200.0, 100.0), _row("+ FlashAttention", 150.0, 80.0),
            {"variant": "+ Winograd", "status": "skipped: over the --max-minutes 8 budget"}]
    out = report.ablation_rows(rows)
    assert out[0]["latency_change_pct"] == 0.0
    assert out[1]["latency_change_pct"] == -25.0 and out[1]["memory_change_pct"] == -20.0
    assert "latency_change_pct" not in out[2]
    total = report.ablation_total(out)
    assert total.startswith("Total, + FlashAttention vs baseline: latency -25.0%, peak memory over the weights -20.0% "
                            "(the paper: -52% latency")
    assert report.ablation_rows(rows[1:]) == []  # no baseline, no changes to report


def test_goals_compare_against_the_h100_targets():
    rows = [_row("stock+compile-graphs", 200.0, 0, unet_device_ms=6.6),
            _row("patched+graph", 160.0, 0, unet_device_ms=5.0, overhead_ms=3.0),
            _row("patched+graph+compile", 140.0, 0, unet_device_ms=6.0, overhead_ms=6.5),
            {**_row("stock+compile-graphs", 500.0, 0), "model": "sdxl", "size": 1024},
            {**_row("patched+graph", 520.0, 0), "model": "sdxl", "size": 1024}]
    lines = report.goals(rows)
    assert lines[0] == ("end to end: best ours (patched+graph+compile) 140.0 ms = 0.70x stock+compile-graphs "
                        "200.0 ms (goal <= 0.75x): met")
    assert lines[1] == "pipeline overhead: patched+graph+compile 6.5 ms per image (goal <= 5 ms): not met"
    assert lines[2].startswith("UNet step device time: best ours (patched+graph) 5.00 ms = 0.76x")
    assert lines[2].endswith(": met")
    assert lines[3].startswith("sdxl@1024 end to end: best ours (patched+graph) 520.0 ms = 1.04x")
    assert lines[3].endswith("(goal < 1x): not met")


def test_plots_are_written_from_the_csvs(tmp_path):
    log = e2e.CsvLog(tmp_path, {"device": "cpu", "date": "2026-11-22"})
    for name, variant, ms in (("e2e.csv", "stock", 900.0), ("e2e.csv", "patched+graph", 300.0),
                              ("ablation.csv", "baseline", 500.0), ("ablation.csv", "+ FlashAttention", 400.0)):
        log.append(name, _row(variant, ms, ms / 10, steps=20))
    log.append("e2e.csv", {"model": "sd15", "size": 512, "variant": "stock+compile-graphs", "status": "error: X"})
    ops = ROOT / "bench" / "results" / "2026-11-22-h100-ops" / "ops.csv"
    (tmp_path / "ops.csv").write_bytes(ops.read_bytes())
    written = plot.plot_folder(tmp_path)
    assert sorted(p.name for p in written) == ["ablation.png", "e2e.png", "ops-speedup.png"]
    assert all(p.read_bytes()[:8] == PNG for p in written)


def test_plot_of_an_empty_folder_is_a_clear_error(tmp_path, capsys):
    assert plot.main([str(tmp_path)]) == 2
    assert "nothing to plot" in capsys.readouterr().err


def test_the_readmes_figure_reads_every_pair_from_the_folders_it_names(tmp_path):
    """Each pair of the README's figure comes from a results folder the README links, and the ratio drawn is
    the quotient of the two rows' times."""
    entries = plot.main(["--summary", str(tmp_path / "summary.png")])
    assert entries == 0 and (tmp_path / "summary.png").read_bytes()[:8] == PNG
    readme = (ROOT / "README.md").read_text()
    assert "](docs/results.png)" in readme
    for e in plot.summary_ratios():
        assert f"bench/results/{e['folder']}/" in readme, e["folder"]
        assert e["ratio"] == pytest.approx(e["ours_ms"] / e["peer_ms"]) and 0 < e["ratio"] < 2


def test_a_figure_pair_without_its_row_is_a_clear_error(tmp_path, monkeypatch):
    folder = tmp_path / "2026-01-01-cpu-x"
    log = e2e.CsvLog(folder, {"device": "cpu", "date": "2026-01-01"})
    log.append("e2e.csv", _row("stock+compile-graphs", 200.0, 10.0, steps=20))
    monkeypatch.setattr(plot, "SUMMARY", (("p", "SD1.5", "2026-01-01-cpu-x/e2e.csv", "sd15", "stock+compile-graphs",
                                           "patched+graph"),))
    with pytest.raises(LookupError, match="sd15 / patched\\+graph"):
        plot.summary_ratios(tmp_path)


@pytest.mark.gpu
def test_every_variant_and_the_ablation_run_on_the_gpu(tmp_path):
    """The GPU-only paths (CUDA graphs, torch.compile, peak memory) on the tiny model, 2 steps."""
    import torch

    items = e2e.plan("quick", e2e.parse_targets("tiny"))
    rows = e2e.run(items, tmp_path, steps=2, max_minutes=9, device="cuda", dtype=torch.float16)
    failed = [(r["variant"], r["status"]) for r in rows if r["status"] != "ok"]
    assert not failed
    for r in (r for r in rows if r["status"] == "ok"):
        assert r["e2e_ms"] > 0 and r["unet_device_ms"] > 0 and r["vae_device_ms"] > 0
        assert r["peak_over_weights_MB"] > 0
        assert float(r["unet_rel_err"]) < 2e-2 and float(r["vae_rel_err"]) < 2e-2, r
    stock = {r["variant"]: r for r in rows}["stock"]
    assert float(stock["unet_rel_err"]) < 1e-3  # stock against itself: nothing left patched or compiled


@pytest.mark.gpu
def test_controlnet_target_runs_the_compile_recipe_and_ours_on_the_gpu(tmp_path):
    """The ControlNet rows' GPU paths (diffusers' compile recipe compiles the ControlNet too; ours graphs it)."""
    import torch

    items = e2e.plan("quick", e2e.parse_targets("tiny+controlnet@64"),
                     ["stock", "patched+graph", "stock+compile-graphs"], ablation=False)
    rows = e2e.run(items, tmp_path, steps=2, max_minutes=9, device="cuda", dtype=torch.float16)
    assert [r["status"] for r in rows] == ["ok"] * 3, rows
    assert all(r["controlnet_ms"] > 0 for r in rows)


@pytest.mark.gpu
def test_dit_bench_runs_stock_the_compile_recipe_and_ours_on_the_tiny_pixart(tmp_path):
    """bench.dit on tiny-pixart: every default variant measured, ours and the compile recipe within fp16 reach of
    stock eager (the reference) after a few steps."""
    import csv

    from bench import dit

    assert dit.main(["--out", str(tmp_path), "--model", "tiny-pixart", "--size", "256", "--steps", "4",
                     "--calls", "2"]) == 0
    rows = {r["variant"]: r for r in csv.DictReader(open(tmp_path / "dit.csv"))}
    assert list(rows) == list(dit.DEFAULT)
    assert rows["stock"]["patched"] == ""
    for name, r in rows.items():
        assert float(r["e2e_ms"]) > 0 and float(r["step_ms"]) > 0, r
        assert float(r["latent_rel_err"]) < 2e-2 and float(r["psnr_db"]) > 30, (name, r)
    assert "layer_norm.BasicTransformerBlock" in rows["patched+graph"]["patched"]


def test_dit_bench_names_bad_variants(capsys):
    from bench import dit

    assert dit.main(["--out", "unused", "--variants", "patched+graph"]) == 2
    assert "must start with stock" in capsys.readouterr().err


def test_memory_bench_reports_each_component_and_saves_after_each_variant(tmp_path, monkeypatch, capsys):
    """bench.memory's loop on CPU, the GPU parts faked: a line per component as it finishes, the CSV
    rewritten after every variant, and a variant over its budget keeps the components it measured."""
    import sd_kernels.patches

    import sd_kernels.models
    from bench import memory as bench_memory
    from sd_kernels.analysis import memory_report
    from sd_kernels.runtime import memory

    state = {"profile": None, "csv_rows_at_patch": []}
    csv_path = tmp_path / "memory.csv"

    def rows_on_disk():
        return list(csv.DictReader(csv_path.open())) if csv_path.exists() else []

    def patch(pipe, profile):
        state["profile"] = profile
        state["csv_rows_at_patch"].append(len(rows_on_disk()))

    def report(pipe, batch, progress):
        for name in ("text_encoder", f"unet_step_b{batch}", "vae_decode"):
            if state["profile"] == "s23-ultra" and name.startswith("unet"):
                raise memory.MemoryBudgetExceeded("UNet2DConditionModel", 2 * 2**20, 2**20)
            progress(memory_report.ComponentMemory(name, 1.0, 2.0, 3.0, "conv"))

    monkeypatch.setattr(bench_memory.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(sd_kernels.models, "build_pipeline", lambda *a, **k: object())
    monkeypatch.setattr(sd_kernels.patches, "patch", patch)
    monkeypatch.setattr(sd_kernels.patches, "unpatch", lambda pipe: state.update(profile=None))
    monkeypatch.setattr(bench_memory.common, "environment", lambda: {"device": "fake"})
    monkeypatch.setattr(bench_memory.profiles, "set_profile", lambda profile: None)  # would ask the fake CUDA
    monkeypatch.setattr(memory_report, "memory_report", report)
    assert bench_memory.main(["--out", str(tmp_path), "--profiles", "s23-ultra,mobile-small", "--steps", "0"]) == 0

    out = capsys.readouterr().out
    assert "variant 3/4: s23-ultra (patched under s23-ultra)" in out
    assert "mobile-small: vae_decode: weights 1.0 MB, peak intermediates 2.0 MB, 3.00 ms, peak at conv" in out
    assert "s23-ultra: budget exceeded: UNet2DConditionModel needs 2.0 MB" in out
    rows = [(r["variant"], r["component"]) for r in rows_on_disk()]
    assert rows == [*[(f"stock b{b}", c) for b in (1, 2) for c in ("text_encoder", f"unet_step_b{b}", "vae_decode")],
                    ("s23-ultra", "text_encoder"), ("s23-ultra", "budget exceeded"),
                    ("mobile-small", "text_encoder"), ("mobile-small", "unet_step_b1"), ("mobile-small", "vae_decode")]
    assert state["csv_rows_at_patch"] == [6, 8]  # written after the stock variants, then after s23-ultra


def test_tune_merges_into_tables_of_the_same_kernel_version(tmp_path):
    from bench import tune

    def table(path, fingerprint, entries, timings=None):
        path.write_text(json.dumps({"format": 1, "fingerprint": fingerprint, "entries": entries,
                                    **({} if timings is None else {"timings": timings})}))
        return path

    dest = table(tmp_path / "dest.json", "aaaa", {"k1": {"BLOCK": 16}, "k2": {"BLOCK": 16}},
                 timings={"k1": [[{"BLOCK": 16}, 1.0]], "k2": [[{"BLOCK": 16}, 1.0]]})
    tune.merge(table(tmp_path / "new.json", "aaaa", {"k2": {"BLOCK": 32}}, timings={}), dest)
    merged = json.loads(dest.read_text())
    assert merged["entries"] == {"k1": {"BLOCK": 16}, "k2": {"BLOCK": 32}}
    assert merged["timings"] == {"k1": [[{"BLOCK": 16}, 1.0]]}  # k2 was tuned again, untimed: its old ones go
    tune.merge(table(tmp_path / "newer.json", "bbbb", {"k3": {"BLOCK": 64}}), dest)  # a new kernel version
    assert json.loads(dest.read_text()) == {"format": 1, "fingerprint": "bbbb", "entries": {"k3": {"BLOCK": 64}}}


def test_tune_at_fp8_times_both_gemm_kernels_and_puts_the_switch_back():
    """``bench.tune --precision fp8`` runs each pipeline once per FP8 GEMM kernel (TMA, then pointer),
    and leaves ``fp8_linear.TMA_GEMM`` as it found it; other precisions leave the switch alone."""
    from bench import tune

    fp8_linear = importlib.import_module("sd_kernels.ops.fp8_linear")
    assert tune.fp8_gemm_kernels("fp8") == [True, False] and tune.fp8_gemm_kernels(None) == [None]
    before, seen = fp8_linear.TMA_GEMM, []
    for value in tune.fp8_gemm_kernels("fp8") + [None]:
        with tune._tma_gemm(value):
            seen.append(fp8_linear.TMA_GEMM)
    assert seen == [True, False, before] and fp8_linear.TMA_GEMM is before
    with pytest.raises(SystemExit):
        tune.main(["--precision", "int4"])


def test_tune_and_cold_need_a_gpu_or_say_what_is_missing(capsys):
    from bench import cold, tune

    assert tune.main([]) == 2 and "none here" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tune.main(["--batches", "x"])
    with pytest.raises(SystemExit):
        cold.main([])
    assert "--out is required" in capsys.readouterr().err


def test_cold_runs_name_a_model_and_its_shapes_in_order():
    from bench import cold

    assert cold.parse_runs("sd15@640x448x3+768x512+512; sdxl@1216x832x2") == [
        ("sd15", [(640, 448, 3), (768, 512, 1), (512, 512, 1)]), ("sdxl", [(1216, 832, 2)])]
    for bad in ("sd15", "sd15@", "sd15@640x447", "sd15@0", "sd15@axb", "sd15@1x2x3x4"):
        with pytest.raises(ValueError):
            cold.parse_runs(bad)


def test_rule_summary_weighs_each_key_by_its_launches():
    from bench import rule

    keys = [{"kernel": "k", "rule": "a", "best": "a", "rule_ms": 1.0, "best_ms": 1.0, "launches": 30},
            {"kernel": "k", "rule": "a", "best": "b", "rule_ms": 2.0, "best_ms": 1.0, "launches": 10},
            {"kernel": "j", "rule": "c", "best": "c", "rule_ms": 0.5, "best_ms": 0.5, "launches": 1}]
    (j, k) = rule.summary(keys)
    assert (j["kernel"], j["keys"], j["rule_is_best"], j["launch_weighted_slowdown"]) == ("j", 1, 1, 0.0)
    assert (k["keys"], k["rule_is_best"], k["worst_slowdown"]) == (2, 1, 1.0)
    assert k["median_slowdown"] == 0.5 and k["launch_weighted_slowdown"] == pytest.approx(50 / 40 - 1)


def test_timeline_gaps_merge_overlapping_kernels():
    from bench import timeline

    busy, gaps = timeline.gaps([(0, 10, "a"), (5, 12, "b"), (20, 30, "c"), (31, 32, "d")])
    assert busy == 12 + 10 + 1
    assert gaps == [{"us": 8, "after": "b", "before": "c"}, {"us": 1, "after": "c", "before": "d"}]


def test_timeline_sums_idle_time_by_the_kernels_on_each_side():
    from bench import timeline

    idle = [{"us": 3.0, "after": "nvjet_sm90_gemm", "before": "_layer_norm_kernel"},
            {"us": 1.0, "after": "nvjet_sm90_gemm", "before": "_layer_norm_kernel"},
            {"us": 5.0, "after": "_quantize_kernel", "before": "nvjet_sm90_gemm"}]
    assert timeline.idle_by_boundary(idle) == [
        {"after": "fp8 quantize (ours)", "before": "gemm", "us": 5.0, "gaps": 1, "mean_us": 5.0,
         "example": "_quantize_kernel -> nvjet_sm90_gemm"},
        {"after": "gemm", "before": "layer_norm (ours)", "us": 4.0, "gaps": 2, "mean_us": 2.0,
         "example": "nvjet_sm90_gemm -> _layer_norm_kernel"}]


def test_cold_stopwatch_counts_calls_and_leaves_out_what_it_excludes():
    import time
    import types

    from bench import cold

    mod = types.SimpleNamespace(compile=lambda: time.sleep(0.1), capture=None)
    compiles = cold.Stopwatch(mod, "compile")

    def capture():  # a capture whose warm-up call compiles
        mod.compile()
        time.sleep(0.01)

    mod.capture = capture
    captures = cold.Stopwatch(mod, "capture", exclude=compiles)
    mod.capture()
    mod.compile()
    assert compiles.calls == 2 and captures.calls == 1
    assert compiles.seconds >= 0.2
    assert 0.01 <= captures.seconds < 0.09  # the 100 ms compile inside it is not counted
    assert not cold.Stopwatch(mod, "missing").hooked


def test_switch_bench_sees_every_state_take_effect_on_cpu(tmp_path, monkeypatch):
    """bench.switch's logic on CPU: each state's image equals stock's, and differs from the previous
    state's (so a stale replay would show)."""
    from bench import switch

    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    assert switch.main(["--out", str(tmp_path), "--model", "tiny", "--size", "64", "--steps", "2",
                        "--device", "cpu"]) == 0
    rows = _read(tmp_path / "switch.csv")
    assert [r["state"] for r in rows] == [s for s, _ in switch.STATES]
    assert all(float(r["max_diff"]) < 1e-4 for r in rows), rows
    assert all(float(r["stale_diff"]) > 1e-2 for r in rows[1:]), rows


@pytest.mark.integration
def test_step_ops_count_kernels_outside_the_models():
    import torch

    from bench import step_ops

    count = step_ops._Count()
    x = torch.randn(4, 4)
    with count:
        x.view(16)  # a view: no kernel
        x + 1  # one
        torch.tensor(2.0) * 3  # one element: timestep arithmetic, not counted
        step_ops._uncounted(count, lambda: x * 2)()  # inside a model: not counted
    assert dict(count.ops) == {"aten.add": 1}
    rows = step_ops.count_step_ops("tiny")
    assert set(rows) == set(step_ops.SCHEDULERS)
    assert all(r["per_step"] > 0 for r in rows.values())
    assert rows["UniPCMultistepScheduler"]["per_step"] > rows["EulerDiscreteScheduler"]["per_step"]


@pytest.mark.gpu
def test_step_ops_gpu_measures_the_glue_and_the_whole_step_ceiling():
    """bench.step_ops --gpu on the tiny model: each scheduler's time between model calls, and the
    bench's own whole-step graphs give the loop's latents (they replay the same code)."""
    from bench import step_ops

    glue = step_ops.glue_ms("tiny", 64, steps=3, repeats=1)
    assert set(glue) == set(step_ops.SCHEDULERS) and all(r["between_ms"] > 0 for r in glue.values())
    ceiling = step_ops.whole_step_ceiling("tiny", 64, steps=3, repeats=1)
    for name, row in ceiling.items():
        assert row["loop_ms"] > 0 and row["whole_step_ms"] > 0, name
        assert row["max_diff"] < 1e-2, (name, row)


@pytest.mark.gpu
def test_memory_bench_end_to_end_under_a_phone_budget():
    """bench.memory's whole-call table on the GPU: the tiny pipeline patched under s23-ultra, each
    component measured, the call's peak (weights included) within the budget."""
    import torch

    import sd_kernels
    from bench import memory as bench_memory
    from sd_kernels import models, profiles
    from sd_kernels.runtime import memory

    pipe = models.build_pipeline("tiny", device="cuda", dtype=torch.float16)
    budget = profiles.get_profile("s23-ultra").memory_budget_bytes()
    with torch.inference_mode(), sd_kernels.patched(pipe, profile="s23-ultra"):
        rows, text = bench_memory.end_to_end(pipe, "s23-ultra", budget, 3, 0.0)
    parts = {r["component"].split()[1]: r for r in rows[:-1]}
    assert set(parts) == {"text_encoder", "unet", "vae"} and all(r["peak_intermediate_mb"] > 0 for r in parts.values())
    total = rows[-1]
    assert total["weights_mb"] * memory.MB == pytest.approx(sum(
        memory.weight_bytes(m) for m in pipe.components.values() if isinstance(m, torch.nn.Module)))
    assert 0 < (total["weights_mb"] + total["peak_intermediate_mb"]) * memory.MB <= budget
    assert "within" in text


def test_breakdown_splits_the_overhead_into_lead_between_and_tail(monkeypatch):
    """bench.e2e.breakdown's arithmetic with events that read the host clock (an idle GPU's events
    complete when recorded): a call that waits 30 ms, encodes (10), waits 5, runs two UNet steps
    (20 each) with 7 between them, waits 3, decodes (15), then waits 2."""
    import torch

    clock = {"now": 0.0}

    class Event:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self):
            self.t = clock["now"]

        def elapsed_time(self, other):
            return (other.t - self.t) * 1e3

    def wait(ms):
        clock["now"] += ms / 1e3

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda mode: None)
    monkeypatch.setattr(e2e.time, "perf_counter", lambda: clock["now"])

    class Model(torch.nn.Module):
        def __init__(self, ms):
            super().__init__()
            self.ms = ms

        def forward(self, *a):
            wait(self.ms)

        decode = forward

    class Pipe:
        text_encoder, unet, vae = Model(10), Model(20), Model(15)

    def call():
        wait(30)
        Pipe.text_encoder.forward()
        wait(5)
        Pipe.unet.forward()
        wait(7)
        Pipe.unet.forward()
        wait(3)
        Pipe.vae.decode()
        wait(2)

    out = e2e.breakdown(Pipe, call)
    assert (out["text_ms"], out["unet_steps_ms"], out["decode_ms"]) == (10, 40, 15)
    assert (out["lead_ms"], out["between_ms"], out["tail_ms"]) == (30, 15, 2)
    assert out["overhead_ms"] == 47 and out["syncs"] == 0
    assert "forward" not in vars(Pipe.unet)  # the spans' wrappers are gone


def test_layer_norm_bench_is_a_family_and_its_impls_agree(device):
    """bench.ops_layer_norm at tiny shapes (on CPU through the Triton interpreter): bench.run finds it, its
    stock and ours compute the same op on the inputs it builds, and its byte counts are the docs' 2/6
    and 4/11 passes of [B, T, D]."""
    import torch

    from bench import ops_layer_norm as lnb
    from bench import run

    assert "layer_norm" in run.families()
    shape = (2, 5, 40)
    for form in ("table", "emb"):
        for gated in (False, True):
            inputs = lnb.make_inputs(shape, form, gated, device=device)
            assert inputs[-1].shape == ((2, 1, 40) if form == "table" else (2, 40))
            stock, ours = (lnb.stock_gated, lnb.ours_gated) if gated else (lnb.stock_modulated, lnb.ours_modulated)
            got, want = ours(*inputs), stock(*inputs)
            for g, w in zip(got if gated else (got,), want if gated else (want,)):
                torch.testing.assert_close(g, w, rtol=2e-3, atol=4e-3)
    n = 2 * 4096 * 1152 * 2
    assert lnb.traffic((2, 4096, 1152), False) == {"ours": 2 * n + 2 * 2 * 1152 * 2, "stock": 6 * n}
    assert lnb.traffic((2, 4096, 1152), True) == {"ours": 4 * n + 3 * 2 * 1152 * 2, "stock": 11 * n}


def test_rope_bench_is_a_family_and_its_impls_agree(device):
    """bench.ops_rope at tiny token counts (FLUX's head dim; on CPU through the Triton interpreter): bench.run
    finds it, its stock lines and ours give the same attention inputs for every variant, and its byte counts
    are 6 passes of [S_text + S, H, D] (4 for the single stream, whose v is a view) plus cos and sin."""
    import torch

    from bench import ops_rope as rb
    from bench import run

    assert "rope" in run.families()
    for variant in rb.VARIANTS:
        inputs = rb.make_inputs(variant, tokens=5, text=3, heads=2, device=device)
        norms = [rb._norm(w) for w in inputs["weights"]]
        with torch.no_grad():
            got, want = rb.ours(inputs), rb.stock(inputs, norms)
        assert got[0].shape == (1, 8, 2, rb.HEAD_DIM)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2)
        assert torch.equal(got[2], want[2])
    n = (4096 + 512) * 24 * 128 * 2
    assert rb.traffic("double", 4096) == 6 * n + 2 * 4608 * 128 * 4
    assert rb.traffic("single", 4096) == 4 * n + 2 * 4608 * 128 * 4


def test_parallel_bench_plans_ulysses_where_a_plan_exists_and_cfg_where_guidance_splits():
    """FLUX (guidance-distilled, a diffusers context-parallel plan) gets the Ulysses and ring rows at every W > 1; SD3
    and PixArt-Σ (guidance, sd_kernels' plans) ours at every W > 1 (no peer: diffusers' processors for them
    have no context-parallel path) and the CFG rows at W = 2; SDXL the CFG rows at W = 2 only: one image's
    guidance batch is 2. cfg-ours, ulysses-ours+graphs and ring-ours+graphs again with the split decode; FLUX's
    ring-ours+graphs with its modulations split, with and without the split decode."""
    import diffusers
    from sd_kernels.patches.context_parallel_plans import plan_for

    from bench import parallel

    for model in parallel.MODELS:
        assert parallel.plan(model, 1) == parallel.ONE_GPU
    split, modulation = parallel.SPLIT_DECODE, parallel.SPLIT_MODULATION
    assert parallel.plan("flux-dev", 2) == parallel.plan("flux-dev", 4) == parallel.ULYSSES + parallel.RING + (
        "ulysses-ours+graphs" + split, "ring-ours+graphs" + split, "ring-ours+graphs" + modulation,
        "ring-ours+graphs" + modulation + split)
    assert parallel.modifiers("ring-ours+graphs" + modulation + split) == ("ring-ours+graphs", {modulation, split})
    assert parallel.modifiers("cfg-ours") == ("cfg-ours", set())
    assert parallel.plan("sdxl", 2) == parallel.CFG + ("cfg-ours" + split,) and parallel.plan("sdxl", 4) == ()
    ours = ("ulysses-ours", "ulysses-ours+compile", "ulysses-ours+graphs")
    for model in ("sd3-medium", "pixart-sigma"):
        assert parallel.plan(model, 2) == ours + parallel.CFG + ("ulysses-ours+graphs" + split, "cfg-ours" + split)
        assert parallel.plan(model, 4) == ours + ("ulysses-ours+graphs" + split,)
    classes = {"flux-dev": diffusers.FluxTransformer2DModel, "sd3-medium": diffusers.SD3Transformer2DModel,
               "pixart-sigma": diffusers.PixArtTransformer2DModel}
    assert {m for m, cls in classes.items() if getattr(cls, "_cp_plan", None)} == set(parallel.CP_PLANS)
    assert {m for m, cls in classes.items() if plan_for(cls)} == set(parallel.OUR_CP_PLANS)


def test_parallel_bench_divides_each_exchange_by_its_own_peer():
    """vs_peer: a ring row over ring-peer, a Ulysses row over ulysses-peer, a row whose exchange has no peer row
    (or a one-GPU row) over the one-GPU peer; skipped and failed rows get no ratio."""
    from bench import parallel

    rows = [{"variant": v, "status": st, "e2e_ms": ms} for v, st, ms in (
        ("ulysses-peer", "ok", 3000.0), ("ulysses-ours+graphs", "ok", 1500.0), ("ring-peer", "ok", 2000.0),
        ("ring-ours+graphs", "ok", 1000.0), ("cfg-ours", "ok", 800.0), ("ring-ours", "skipped: ...", None))]
    parallel._ratios(rows, {"ours": 4000.0, "peer": 1600.0})
    got = {r["variant"]: (r.get("vs_one_gpu"), r.get("vs_peer")) for r in rows}
    assert got == {"ulysses-peer": (0.75, 1.0), "ulysses-ours+graphs": (0.375, 0.5), "ring-peer": (0.5, 1.0),
                   "ring-ours+graphs": (0.25, 0.5), "cfg-ours": (0.2, 0.5), "ring-ours": (None, None)}


def test_split_decode_bench_rows_on_one_cpu_process(monkeypatch):
    """bench.split_decode's rows on a one-process gloo group (the tiny VAE, fp32, CPU: no graph row): the split
    image is the whole one's (one process owns every row), each row stamped; needs GPUs under torchrun."""
    import torch.distributed as dist

    from bench import split_decode

    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        rows = split_decode.rows_of("tiny", ("float32",), 64, 1, 1, {"device": "cpu"}, device="cpu")
    finally:
        dist.destroy_process_group()
    assert [r["variant"] for r in rows] == ["whole", "split"]
    assert all(r["device"] == "cpu" and r["ms"] > 0 for r in rows)
    assert float(rows[1]["max_abs_diff"]) < 2e-5 and rows[1]["psnr_db"] > 90
    assert split_decode.main(["--out", "unused"]) == 2


def test_parallel_bench_sets_up_a_split_decode_variant_and_undoes_it(monkeypatch):
    """cfg-ours+split-decode on a one-process gloo group (the tiny pipeline, CPU): the guidance split and the
    split decode in the row's record, both gone after the row."""
    import torch.distributed as dist

    from bench import parallel
    from sd_kernels import models

    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    pipe = models.build_pipeline("tiny")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with parallel.set_up(pipe, "cfg-ours" + parallel.SPLIT_DECODE, 1) as patched:
            assert "cfg_parallel=1" in patched and "split_decode=1" in patched
            assert "forward" in vars(pipe.vae.decoder)
    finally:
        dist.destroy_process_group()
    assert "forward" not in vars(pipe.vae.decoder) and "forward" not in vars(pipe.unet)


def test_parallel_bench_says_it_needs_gpus_under_torchrun(tmp_path, capsys):
    from bench import parallel

    assert parallel.main(["--out", str(tmp_path)]) == 2
    assert "torchrun" in capsys.readouterr().err


def test_parallel_bench_keeps_one_gpu_times_across_runs_of_some_variants():
    from bench import parallel

    ref = {"one_gpu": {"stock": 9.0, "ours": 5.0}}
    rows = [{"variant": "ours", "status": "ok", "e2e_ms": 4.0}, {"variant": "peer", "status": "failed: X"},
            {"variant": "ours+compile", "status": "ok", "e2e_ms": 3.0}]
    assert parallel.one_gpu_times(ref, rows) == {"stock": 9.0, "ours": 4.0, "ours+compile": 3.0}


def _fp8_bench_pipe(compiles: bool = True):
    """A pipeline stand-in for bench.fp8's regional compile row: a transformer with one repeated block whose
    ``compile_repeated_blocks`` compiles it (as diffusers': nn.Module.compile per block) or raises."""
    import torch.nn as nn

    class Transformer(nn.Module):
        _repeated_blocks = ["Linear"]

        def __init__(self):
            super().__init__()
            self.block, self.fused = nn.Linear(2, 2), False

        def fuse_qkv_projections(self):
            self.fused = True

        def unfuse_qkv_projections(self):
            self.fused = False

        def compile_repeated_blocks(self, **kwargs):
            if not compiles:
                raise ValueError("`_repeated_blocks` attribute is empty")
            self.block._compiled_call_impl = self.block._call_impl

    class Vae(nn.Module):
        def decode(self, z):
            return z

    class Pipe:
        transformer = Transformer().to(torch.bfloat16)
        vae = Vae()

    return Pipe


def test_fp8_bench_undoes_the_regional_compile_row_but_not_torchaos(monkeypatch):
    """A row after the compile row must measure its own setup, not the compiled blocks left under it."""
    from bench import fp8

    Pipe = _fp8_bench_pipe()
    t = Pipe.transformer
    with fp8._regional_compile(Pipe, quantize=False):
        assert t.fused and t.block._compiled_call_impl is not None
        assert "decode" in vars(Pipe.vae)  # the peer's VAE decode compiled too, as diffusers' recipe does
    assert not t.fused and t.block._compiled_call_impl is None
    assert "decode" not in vars(Pipe.vae)
    monkeypatch.setitem(sys.modules, "torchao.quantization", types.SimpleNamespace(
        Float8DynamicActivationFloat8WeightConfig=lambda **kw: None, PerRow=lambda: None, quantize_=lambda m, c: None))
    with fp8._regional_compile(Pipe, quantize=True):
        pass
    assert t.fused and t.block._compiled_call_impl is not None  # quantize_ cannot be undone: its row runs last
    assert "decode" not in vars(Pipe.vae)  # but its compiled decode is


def test_fp8_attention_bench_summary_shows_a_shape_it_does_not_cover():
    from bench import ops_attention_fp8 as bench_attn

    rows = [{"impl": "ours_exact", "config": "-", "ms": 1.0}, {"impl": "fp8[int8/fp8]", "config": "a", "ms": 2.0},
            {"impl": "fp8[int8/fp8]", "config": "b", "ms": 1.5, "best": "yes"},
            {"impl": "fp8", "note": "not covered: head dim 72"}]
    assert [r.get("config") for r in bench_attn.summary(rows)] == ["-", "b", None]


def test_compiled_methods_put_back_what_was_there_also_when_the_block_fails():
    """The recipes' compiled methods: a method a patch had bound on the instance comes back as it was, a
    class method's compiled stand-in goes, and both modules return to the contiguous layout."""
    import torch.nn as nn

    from bench.setups import compiled_methods

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(2, 2, 3)

        def decode(self, z):
            return z

    a, b = M(), M()
    bound = (lambda z: z)
    object.__setattr__(b, "decode", bound)
    with pytest.raises(RuntimeError, match="row failed"), compiled_methods([(a, "decode"), (b, "decode")], "default"):
        assert vars(a)["decode"] is not None and vars(b)["decode"] is not bound
        assert a.conv.weight.is_contiguous(memory_format=torch.channels_last) and not a.conv.weight.is_contiguous()
        raise RuntimeError("row failed")
    assert "decode" not in vars(a) and vars(b)["decode"] is bound
    assert a.conv.weight.is_contiguous() and b.conv.weight.is_contiguous()


def test_parallel_bench_compiles_a_forward_in_place_and_puts_it_back():
    """The context-parallel rows' compiled forward: the method as it stood (a patch's bound one) comes back,
    and the module's layout is left alone (no channels_last for the collectives' graphs)."""
    import torch.nn as nn

    from bench import parallel

    m = nn.Conv2d(2, 2, 3)
    bound = (lambda x: x)
    object.__setattr__(m, "forward", bound)
    with parallel._compiled_forward(m):
        assert vars(m)["forward"] is not bound
        assert m.weight.is_contiguous()
    assert vars(m)["forward"] is bound


def test_fp8_bench_undoes_the_fusion_of_a_compile_row_whose_set_up_fails():
    """A compile row that fails after fusing the projections (diffusers refusing a model's repeated blocks)
    leaves them unfused: the rows after it measure their own setup, not our processor's fused path."""
    from bench import fp8

    Pipe = _fp8_bench_pipe(compiles=False)
    with pytest.raises(ValueError, match="_repeated_blocks"), fp8._regional_compile(Pipe, quantize=False):
        pass
    assert not Pipe.transformer.fused and "decode" not in vars(Pipe.vae)


def test_every_fp8_bench_row_has_a_setup_of_its_own():
    """Each row ``--rows`` takes is set up as itself: only the torchao row quantizes with torchao (a row left out of
    the setups once ran torchao's row in its place), and a name outside ROWS is refused."""
    from bench import fp8

    labels = {row: fp8._setup(row, "regional")[0] for row in fp8.ROWS}
    assert [row for row, label in labels.items() if label.startswith(fp8.TORCHAO)] == ["torchao"], labels
    assert len(set(labels.values())) == len(labels), labels
    with pytest.raises(ValueError, match="no setup"):
        fp8._setup("fp8+no-such-row", "regional")


def test_fp8_bench_names_the_regional_peers_mode_and_finds_its_peers_by_label():
    from bench import fp8

    assert fp8._setup("compile", "regional")[0] == "compile-regional"
    assert fp8._setup("compile", "regional", "reduce-overhead")[0] == "compile-regional[reduce-overhead]"
    assert fp8._setup("torchao", "regional", "reduce-overhead")[0] == "torchao-fp8+regional-compile[reduce-overhead]"
    assert fp8._setup("compile", "recipe", "reduce-overhead")[0] == "stock+compile-graphs"  # the recipe's own modes
    rows = [{"variant": "stock", "e2e_ms": 4.0}, {"variant": "compile-regional[reduce-overhead]", "e2e_ms": 2.5},
            {"variant": "patched+graph+fp8", "e2e_ms": 2.0},
            {"variant": "torchao-fp8+regional-compile[reduce-overhead]", "e2e_ms": 2.2},
            {"variant": "torchao-fp8+regional-compile", "status": "error: X"}]
    assert fp8.peer_columns(rows) == {"vs_compile": 2.5, "vs_torchao": 2.2}
    label = fp8._setup("compile+no-cublaslt-workspace", "regional")[0]
    assert label == "compile-regional+no-cublaslt-workspace"
    faster = [*rows, {"variant": label, "e2e_ms": 2.4}, {"variant": "stock+compile-graphs", "e2e_ms": 2.6}]
    assert fp8.peer_columns(faster)["vs_compile"] == 2.4  # the peer at its best


def test_the_no_workspace_peer_runs_with_cublaslts_workspace_at_zero_for_its_row(monkeypatch):
    import contextlib
    import os

    from bench import fp8
    from sd_kernels.runtime import blas

    monkeypatch.delenv(blas.ENV, raising=False)
    seen = []

    @contextlib.contextmanager
    def row(pipe, **kwargs):
        seen.append(os.environ.get(blas.ENV))
        yield {}

    monkeypatch.setattr(fp8, "_regional_compile", lambda p, quantize, mode: row(p))
    with fp8._setup("compile+no-cublaslt-workspace", "regional")[1](object()):
        assert os.environ.get(blas.ENV) == "0"
    assert seen == ["0"] and blas.ENV not in os.environ
    monkeypatch.setenv(blas.ENV, "1024")  # set for the process: the row would not be what its label says
    with pytest.raises(RuntimeError, match="set for the process"):
        with fp8._setup("compile+no-cublaslt-workspace", "regional")[1](object()):
            pass


PATCH_FP8, OPS_ATTENTION, FP8_LINEAR = "sd_kernels.patches.fp8", "sd_kernels.ops.attention", "sd_kernels.ops.fp8_linear"


@pytest.mark.parametrize("row,switches", [
    ("fp8+exact-attention", [(PATCH_FP8, "FP8_ATTENTION", ())]),
    ("fp8+attention-everywhere", [(PATCH_FP8, "FP8_ATTENTION", (64, 128))]),
    ("fp8+attention-int8", [(PATCH_FP8, "FP8_ATTENTION", (64, 128)),
                            (OPS_ATTENTION, "FP8_QK", {64: "int8", 128: "int8"})]),
    ("fp8+triton-gemm", [(FP8_LINEAR, "TORCH_GEMM", False)]),
    ("fp8+fused-gate-gemm", [(FP8_LINEAR, "TORCH_GEMM_GATED", False)]),
    ("fp8+pointer-gemm", [(FP8_LINEAR, "TMA_GEMM", False)]),
    ("fp8+geglu-epilogue", [("sd_kernels.ops.fp8_geglu", "GEGLU_EPILOGUE", True)]),
    ("fp8+into-ours", [(FP8_LINEAR, "TORCH_GEMM_INTO", "ours")]),
    ("fp8+into-copy", [(FP8_LINEAR, "TORCH_GEMM_INTO", "copy")]),
])
def test_fp8_bench_rows_change_what_the_patch_reads_for_their_time_only(monkeypatch, row, switches):
    """The tier's experiment rows set the switches the patch reads (``sd_kernels.patches.fp8``, not the
    repository's top-level copy of the package) to their values while the row runs, and put them back after."""
    import contextlib

    from bench import fp8, setups

    mods = [importlib.import_module(module) for module, _, _ in switches]
    before, seen = [getattr(mod, name) for mod, (_, name, _) in zip(mods, switches, strict=True)], []

    @contextlib.contextmanager
    def applied(pipe, setup):
        seen.append((setup.precision, [getattr(mod, name) for mod, (_, name, _) in zip(mods, switches, strict=True)]))
        yield {}

    monkeypatch.setattr(setups, "applied", applied)
    label, context = fp8._setup(row, "regional")
    with context(object()):
        pass
    assert label == fp8.FP8_ROWS[row] and seen == [("fp8", [value for _, _, value in switches])]
    assert [getattr(mod, name) for mod, (_, name, _) in zip(mods, switches, strict=True)] == before


@pytest.mark.parametrize(("row", "precision"), [("fp8+inference-mode", "fp8"), ("patched+inference-mode", None)])
def test_the_inference_mode_rows_patch_outside_it_and_call_inside_it(monkeypatch, row, precision):
    """bench.fp8's ``fp8+inference-mode`` and ``patched+inference-mode``: the patch applied as in the plain rows (not
    under inference mode), the row's pipeline calls under ``torch.inference_mode()``, and inference mode off again
    after the unpatch."""
    import contextlib

    import torch

    from bench import fp8, setups

    events = []

    @contextlib.contextmanager
    def applied(pipe, setup):
        events.append(("patch", setup.precision, torch.is_inference_mode_enabled()))
        yield {}
        events.append(("unpatch", torch.is_inference_mode_enabled()))

    monkeypatch.setattr(setups, "applied", applied)
    label, context = fp8._setup(row, "regional")
    with context(object()):
        events.append(("call", torch.is_inference_mode_enabled()))
    assert events == [("patch", precision, False), ("call", True), ("unpatch", False)]
    assert label == {"fp8+inference-mode": fp8.FP8_ROWS["fp8+inference-mode"],
                     "patched+inference-mode": "patched+graph+inference-mode"}[row]
    assert not torch.is_inference_mode_enabled()


@pytest.mark.parametrize(("row", "precision"), [("fp8+step-graph", "fp8"), ("patched+step-graph", None)])
def test_the_step_graph_rows_patch_with_one_graph_a_step(monkeypatch, row, precision):
    """bench.fp8's ``fp8+step-graph`` and ``patched+step-graph``: the tier's (or the lossless patch's) setup with
    ``cuda_graph="step"``, everything else as in their plain rows."""
    import contextlib

    from bench import fp8, setups

    seen = []

    @contextlib.contextmanager
    def applied(pipe, setup):
        seen.append(setup)
        yield {}

    monkeypatch.setattr(setups, "applied", applied)
    for name in (row, "fp8" if precision else "patched"):
        label, context = fp8._setup(name, "regional")
        with context(object()):
            pass
    step, plain = seen
    assert step.graph == "step" and step.precision == precision == plain.precision and plain.graph != "step"
    assert label != fp8._setup(row, "regional")[0] == (fp8.FP8_ROWS.get(row) or row)


def test_the_offloaded_originals_row_is_the_fp8_tier_with_its_originals_moved(monkeypatch):
    """bench.fp8's ``fp8+offloaded-originals``: the tier's setup, then ``offload_originals`` on the pipeline inside
    it (the row's facts say how many bytes moved); the unpatch at its end brings them back."""
    import contextlib
    import types

    import sd_kernels
    from bench import fp8, setups

    events = []

    @contextlib.contextmanager
    def applied(pipe, setup):
        events.append(("patch", setup.precision))
        yield {"patched": "fp8.attention=3"}
        events.append("unpatch")

    def offload(pipe):
        events.append("offload")
        return types.SimpleNamespace(quantized=types.SimpleNamespace(offloaded_bytes=1024))

    monkeypatch.setattr(setups, "applied", applied)
    monkeypatch.setattr(sd_kernels, "offload_originals", offload)
    label, context = fp8._setup("fp8+offloaded-originals", "regional")
    with context(object()) as info:
        assert info["patched"] == "fp8.attention=3 offloaded=1024"
    assert label == "patched+graph+fp8+offloaded-originals" and events == [("patch", "fp8"), "offload", "unpatch"]
    assert {"gpu_gib", "peak_gib"} <= set(fp8.E2E_COLUMNS)


def test_rows_appended_to_a_csv_of_other_columns_keep_every_cell_under_its_name(tmp_path):
    from bench import common

    path = tmp_path / "cold.csv"
    common.append_csv(path, [{"a": 1, "b": 2}], ["a", "b"])
    common.append_csv(path, [{"a": 3, "b": 4}], ["a", "b"])  # same columns: appended
    common.append_csv(path, [{"a": 5, "new": 6, "b": 7}], ["a", "new", "b"])  # a column added mid-list
    import csv

    rows = list(csv.DictReader(open(path)))
    assert list(rows[0]) == ["a", "b", "new"]
    assert [(r["a"], r["b"], r["new"]) for r in rows] == [("1", "2", ""), ("3", "4", ""), ("5", "7", "6")]


def test_every_kernel_of_ours_is_counted_as_ours_in_the_step_profiles():
    """bench.unet_kernels' categories split a step's device time between our kernels and stock's by
    name; a kernel of ours whose name matched a stock pattern (``_qk_norm_rope_kernel`` as a stock
    norm, ``_attention_fp8_kernel`` as stock attention) would move its time to the wrong side."""
    import importlib
    import pkgutil

    from triton.runtime.jit import KernelInterface

    import sd_kernels.ops
    from bench.unet_kernels import category

    names = {"_attn_wgmma_fwd"}  # Gluon, imported only under Triton 3.6
    for info in pkgutil.iter_modules(sd_kernels.ops.__path__):
        if info.name != "attention_wgmma_kernel":
            module = importlib.import_module(f"sd_kernels.ops.{info.name}")
            names |= {n for n, v in vars(module).items() if isinstance(v, KernelInterface) and n.endswith("_kernel")}
    assert len(names) > 20
    misplaced = {n: c for n in sorted(names) if not ((c := category(n)).endswith("(ours)") or c == "winograd")}
    assert not misplaced
