"""``python -m bench.throughput --quick``: the throughput benchmark's own run, on the tiny model (CPU; the
reference ops), writes its CSV and prints its table."""

import csv

from bench import throughput


def test_quick_run_writes_rows_and_a_table(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    assert throughput.main(["--quick", "--out", str(tmp_path), "--device", "cpu"]) == 0
    rows = list(csv.DictReader(open(tmp_path / "throughput.csv")))
    assert [(r["model"], r["batch_size"], r["images"], r["failed"], r["status"]) for r in rows] == [
        ("tiny", "1", "6", "0", "ok"), ("tiny", "2", "6", "0", "ok")]
    assert all(float(r["steady_images_per_s"]) > 0 and float(r["first_call_s"]) > 0 for r in rows)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["throughput.csv"]  # the images were temporary
    table = capsys.readouterr().out
    assert "steady_images_per_s" in table and "wrote" in table
