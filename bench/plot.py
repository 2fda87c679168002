"""PNG plots from a results folder: ``python -m bench.plot DIR``.

- ``ops-speedup.png`` from ``ops.csv``: per op, each implementation's speedup over stock at every
  shape (device time, log scale; above 1 is faster than stock).
- ``e2e.png`` from ``e2e.csv``: end-to-end latency per variant, one panel per model and size.
- ``ablation.png`` from ``ablation.csv``: the paper's cumulative ablation, latency and peak memory.

Rows whose status is not "ok" are left out. The device, versions and date of the run go in the title.

``python -m bench.plot --summary PNG``: the README's figure, each of ours against its peer as a fraction
of the peer's time, read from the results folders ``SUMMARY`` names (each panel's title: device,
versions, dates; the folders are named beside the figure where it is shown).
"""

from __future__ import annotations

import argparse
import csv
import pathlib
import sys
from collections.abc import Callable


def _rows(path: pathlib.Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return [r for r in csv.DictReader(f) if r.get("status", "ok") == "ok"]


def _machine(r: dict[str, str]) -> str:
    return f"{r.get('device', '?')}, torch {r.get('torch', '?')}, Triton {r.get('triton', '?')}"


def _stamp(rows: list[dict[str, str]]) -> str:
    return f"{_machine(rows[0])}, {rows[0].get('date', '?')}"


def _figure(panels: int, width: float = 10.0, height: float = 3.2, height_ratios: list[int] | None = None):
    """(pyplot, the figure, its panels one above the other): ``height`` inches a panel on average, shared out by
    ``height_ratios`` where given."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(panels, 1, figsize=(width, height * panels), squeeze=False,
                             gridspec_kw={"height_ratios": height_ratios} if height_ratios else None)
    return plt, fig, [a[0] for a in axes]


def ops_speedup(rows: list[dict[str, str]], path: pathlib.Path) -> None:
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ops = list(dict.fromkeys(r["op"] for r in rows))
    most = max(len({(r["shape"], r["variant"]) for r in rows if r["op"] == op}) for op in ops)
    plt, fig, axes = _figure(len(ops), width=max(8.0, 0.45 * most), height=3.8)
    for ax, op in zip(axes, ops):
        mine = [r for r in rows if r["op"] == op]
        points = list(dict.fromkeys(f"{r['shape']} {r['variant']}" for r in mine))
        impls = [i for i in dict.fromkeys(r["impl"] for r in mine) if i != "stock"]
        width = 0.8 / max(len(impls), 1)
        for k, impl in enumerate(impls):
            got = {f"{r['shape']} {r['variant']}": float(r["speedup_vs_stock"]) for r in mine if r["impl"] == impl}
            xs = [i + k * width for i, p in enumerate(points) if p in got]
            ax.bar(xs, [got[p] for p in points if p in got], width, label=impl)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(points))], points, fontsize=6, rotation=35,
                      ha="right")
        ax.set_ylabel("speedup vs stock")
        ax.set_title(op, fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(f"per-op device time vs stock — {_stamp(rows)}", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def e2e_latency(rows: list[dict[str, str]], path: pathlib.Path) -> None:
    targets = list(dict.fromkeys((r["model"], r["size"]) for r in rows))
    plt, fig, axes = _figure(len(targets), width=8.0, height=2.8)
    for ax, (model, size) in zip(axes, targets):
        mine = [r for r in rows if (r["model"], r["size"]) == (model, size) and r.get("e2e_ms")]
        names = [r["variant"] for r in mine]
        ms = [float(r["e2e_ms"]) for r in mine]
        colors = ["tab:orange" if n.startswith("patched") else "tab:gray" for n in names]
        bars = ax.barh(names, ms, color=colors)
        ax.bar_label(bars, [f"{v:.0f} ms" for v in ms], fontsize=7, padding=2)
        ax.invert_yaxis()
        ax.set_xlabel(f"ms per image, {mine[0]['steps']} steps" if mine else "ms")
        ax.set_title(f"{model}, {size}x{size}, fp16, batch 1 with guidance", fontsize=9)
    fig.suptitle(f"end to end — {_stamp(rows)}", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def ablation(rows: list[dict[str, str]], path: pathlib.Path) -> None:
    plt, fig, axes = _figure(2, width=8.0, height=2.6)
    names = [r["variant"] for r in rows]
    panels = ((axes[0], "e2e_ms", "ms end to end"), (axes[1], "peak_over_weights_MB", "MB peak over weights"))
    for ax, col, unit in panels:
        values = [float(r[col]) if r.get(col) else 0.0 for r in rows]
        bars = ax.barh(names, values, color="tab:blue")
        base = values[0] if values and values[0] else None
        labels = [f"{v:.0f}" + (f" ({100 * (v - base) / base:+.0f}%)" if base else "") for v in values]
        ax.bar_label(bars, labels, fontsize=7, padding=2)
        ax.invert_yaxis()
        ax.set_xlabel(unit)
    axes[0].set_title(f"the paper's ablation, cumulative ({rows[0]['model']}, {rows[0]['size']}²)", fontsize=9)
    fig.suptitle(_stamp(rows), fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=120)
    plt.close(fig)


RESULTS = pathlib.Path(__file__).resolve().parent / "results"

# the README's figure: (panel, label, CSV under bench/results/, model, the peer's variant, ours)
SUMMARY: tuple[tuple[str, str, str, str, str, str], ...] = (
    ("lossless, against diffusers' compile recipe", "SD1.5 512²",
     "2026-11-25-h100-upsample/sd15-e2e/e2e/e2e.csv", "sd15", "stock+compile-graphs",
     "patched+graph+compile+fused-qkv"),
    ("lossless, against diffusers' compile recipe", "SD2.1 768²",
     "2026-11-25-h100-wgmma-consumers/sd21-sdxl-e2e/e2e-sd21/e2e.csv", "sd21", "stock+compile-graphs",
     "patched+graph+compile+fused-qkv"),
    ("lossless, against diffusers' compile recipe", "SDXL 1024²",
     "2026-11-24-h100-gn-stats/sdxl-e2e/e2e/e2e.csv", "sdxl", "stock+compile-graphs",
     "patched+graph+compile+fused-qkv"),
    ("lossless, against diffusers' compile recipe", "SD1.5 + ControlNet 512²",
     "2026-11-24-h100-e2e-controlnet-cold/e2e-sd15-controlnet-best.csv", "sd15+controlnet",
     "stock+compile-graphs", "patched+graph+compile+fused-qkv"),
    ("lossless, against diffusers' compile recipe", "PixArt-Σ 1024²",
     "2026-11-25-h100-wgmma-consumers/pixart-e2e/dit-pixart/dit.csv", "pixart-sigma", "stock+compile-graphs",
     "patched+graph+compile"),
    ("lossless, against diffusers' compile recipe", "SD3-medium 1024²",
     "2026-11-25-h100-wgmma-consumers/sd3-e2e/dit-sd3/dit.csv", "sd3-medium", "stock+compile-graphs",
     "patched+graph+compile+fused-qkv"),
    ("lossless, against diffusers' compile recipe", "FLUX.1-dev 1024²",
     "2026-11-24-h100-dit-attention-gelu/flux-e2e/dit-flux/dit.csv", "flux-dev", "stock+compile-graphs",
     "patched+graph+compile+fused-qkv"),
    ("the transformers and SDXL: patch(pipe) and the FP8 tier", "FLUX.1-dev, patch(pipe) vs compile",
     "2026-11-30-h200-t5-encoder-resnet-tail/fp8_e2e-flux.csv", "flux-dev", "compile-regional+no-cublaslt-workspace",
     "patched+graph"),
    ("the transformers and SDXL: patch(pipe) and the FP8 tier", "FLUX.1-dev, FP8 vs compile",
     "2026-12-02-h200-dit-norm-codes-and-handoff/fp8_e2e-flux.csv", "flux-dev",
     "compile-regional+no-cublaslt-workspace", "patched+graph+fp8"),
    ("the transformers and SDXL: patch(pipe) and the FP8 tier", "FLUX.1-dev, FP8 vs torchao's FP8",
     "2026-11-29-h200-fp8-vs-torchao/fp8_e2e-flux-peers.csv", "flux-dev", "torchao-fp8+regional-compile",
     "patched+graph+fp8"),
    ("the transformers and SDXL: patch(pipe) and the FP8 tier", "SD3-medium, patch(pipe) vs the recipe",
     "2026-12-01-h200-fp8-targets-sd3-flux/fp8_e2e-sd3.csv", "sd3-medium", "stock+compile-graphs",
     "patched+graph"),
    ("the transformers and SDXL: patch(pipe) and the FP8 tier", "SD3-medium, FP8 vs the recipe",
     "2026-12-02-h200-sd3-norm-handoff/fp8_e2e-sd3.csv", "sd3-medium", "stock+compile-graphs",
     "patched+graph+fp8"),
    ("the transformers and SDXL: patch(pipe) and the FP8 tier", "SDXL, patch(pipe) vs the recipe",
     "2026-12-02-h200-sd3-norm-handoff/fp8_e2e-sdxl.csv", "sdxl", "stock+compile-graphs", "patched+graph"),
    ("the transformers and SDXL: patch(pipe) and the FP8 tier", "SDXL, FP8 vs the recipe",
     "2026-12-02-h200-sd3-norm-handoff/fp8_e2e-sdxl.csv", "sdxl", "stock+compile-graphs", "patched+graph+fp8"),
)


def summary_ratios(results: pathlib.Path = RESULTS) -> list[dict[str, str | float]]:
    """Each ``SUMMARY`` entry's times and ratio (ours / the peer), with the machine and date of its row, read
    from its CSV; a missing row is a ``LookupError`` naming it (a missing file, ``FileNotFoundError``)."""
    out = []
    for panel, label, csv_path, model, peer, ours in SUMMARY:
        rows = [r for r in _rows(results / csv_path) if r.get("model") == model and r.get("e2e_ms")]
        ms = {r["variant"]: (float(r["e2e_ms"]), r) for r in rows}
        for variant in (peer, ours):
            if variant not in ms:
                raise LookupError(f"{csv_path}: no ok row {model} / {variant}")
        row = ms[ours][1]
        out.append({"panel": panel, "label": label, "folder": csv_path.split("/")[0], "peer_ms": ms[peer][0],
                    "ours_ms": ms[ours][0], "ratio": ms[ours][0] / ms[peer][0], "fp8": "fp8" in ours,
                    "machine": _machine(row), "date": row.get("date", "?")})
    return out


def summary(path: pathlib.Path, results: pathlib.Path = RESULTS) -> list[dict[str, str | float]]:
    """The README's figure: one panel per ``SUMMARY`` panel, a bar per entry at ours / the peer (below 1 is
    faster than the peer; FP8 rows in red), each labelled with both times. Returns the entries drawn."""
    entries = summary_ratios(results)
    panels = list(dict.fromkeys(e["panel"] for e in entries))
    counts = [sum(e["panel"] == p for e in entries) for p in panels]
    plt, fig, axes = _figure(len(panels), 8.0, 0.42 * sum(counts) / len(panels) + 1.3, counts)
    for ax, panel in zip(axes, panels):
        mine = [e for e in entries if e["panel"] == panel]
        colors = ["tab:gray" if e["ratio"] >= 1 else "tab:red" if e["fp8"] else "tab:orange" for e in mine]
        ax.barh([e["label"] for e in mine], [e["ratio"] for e in mine], color=colors)
        for y, e in enumerate(mine):
            ax.text(1.03, y, f"{e['ratio']:.3f}x   {e['ours_ms']:,.0f} / {e['peer_ms']:,.0f} ms", va="center",
                    fontsize=7)
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_xlim(0, 1.45)
        ax.set_xticks([0, 0.2, 0.4, 0.6, 0.8, 1.0])
        ax.invert_yaxis()
        ax.tick_params(axis="y", labelsize=8)
        machines = "; ".join(dict.fromkeys(str(e["machine"]) for e in mine))
        dates = ", ".join(sorted(dict.fromkeys(str(e["date"]) for e in mine)))
        ax.set_title(f"{panel}\n{machines}; {dates}", fontsize=8)
    axes[-1].set_xlabel("time per image, ours / the peer's (below 1: faster), one process per pair")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return entries


PLOTS: dict[str, tuple[str, Callable[[list[dict[str, str]], pathlib.Path], None]]] = {
    "ops.csv": ("ops-speedup.png", ops_speedup),
    "e2e.csv": ("e2e.png", e2e_latency),
    "ablation.csv": ("ablation.png", ablation),
}


def plot_folder(folder: pathlib.Path) -> list[pathlib.Path]:
    """Every plot whose CSV is in ``folder`` (with at least one "ok" row); returns the PNGs written."""
    written = []
    for name, (png, draw) in PLOTS.items():
        src = folder / name
        rows = _rows(src) if src.exists() else []
        if rows:
            draw(rows, folder / png)
            written.append(folder / png)
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=pathlib.Path, nargs="?")
    ap.add_argument("--summary", type=pathlib.Path, metavar="PNG", help="write the README's figure to PNG")
    args = ap.parse_args(argv)
    if args.summary is not None:
        for e in summary(args.summary):
            print(f"{e['label']}: {e['ratio']:.3f}x ({e['ours_ms']:.1f} / {e['peer_ms']:.1f} ms, {e['folder']})")
        print(f"wrote {args.summary}")
        return 0
    if args.folder is None:
        ap.error("a results folder, or --summary PNG")
    written = plot_folder(args.folder)
    for png in written:
        print(f"wrote {png}")
    if not written:
        print(f"nothing to plot in {args.folder} (no ops.csv, e2e.csv or ablation.csv with ok rows)", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
