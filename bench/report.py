"""Markdown tables from a results folder (ops.csv, e2e.csv, ablation.csv): ``python -m bench.report DIR``.

docs/results.md pastes its output, so that the numbers there are the measured ones, not retyped.
Per op and shape: stock, then every other implementation, device time (CUDA graph) and the ratio to
stock, the roofline fraction that applies (copy bandwidth for memory-bound ops, matmul TFLOP/s for
the rest) and the eager time (one call at a time from Python). End to end: one row per model and
variant; the ablation with each row's change against the baseline and the total beside the paper's.
``print_summary`` is the terminal form bench.e2e and ``sd-kernels bench`` print after a run.
"""

from __future__ import annotations

import argparse
import csv
import pathlib
import sys
from typing import Any

PAPER_REDUCTION = {"latency, Samsung S23 Ultra": -52, "latency, iPhone 14 Pro Max": -33}  # arXiv 2304.11267


def _f(v: str, fmt: str) -> str:
    try:
        x = float(v)
    except (TypeError, ValueError):
        return "-"
    return "-" if x != x else format(x, fmt)


def ops_tables(rows: list[dict[str, str]]) -> str:
    out = []
    for op in dict.fromkeys(r["op"] for r in rows):
        mine = [r for r in rows if r["op"] == op]
        compute = any(_f(r.get("TFLOP/s", ""), ".1f") != "-" for r in mine)
        roof = "TFLOP/s (% of matmul)" if compute else "GB/s (% of copy)"
        out += [f"\n#### {op}\n", f"| shape | variant | impl | ms (graph) | vs stock | {roof} | eager ms | rel err |",
                "|---|---|---|---:|---:|---:|---:|---:|"]
        for r in mine:
            if compute:
                roofline = f'{_f(r["TFLOP/s"], ".0f")} ({_f(r.get("pct_matmul", ""), ".0f")}%)'
            else:
                roofline = f'{_f(r["GB/s"], ".0f")} ({_f(r["pct_copy_bw"], ".0f")}%)'
            name = f'**{r["impl"]}**' if r["impl"].startswith("ours") else r["impl"]
            out.append(f'| {r["shape"]} | {r["variant"]} | {name} | {_f(r["ms"], ".4f")} | '
                       f'{_f(r["speedup_vs_stock"], ".2f")}x | {roofline} | {_f(r.get("eager_ms", ""), ".4f")} | '
                       f'{_f(r.get("rel_err", ""), ".1e")} |')
    return "\n".join(out)


E2E_COLUMNS = [("model", "model"), ("size", "size"), ("variant", "variant"), ("e2e_ms", "end to end ms"),
               ("it_per_s", "it/s"), ("unet_ms", "UNet step ms"), ("unet_device_ms", "UNet, graph ms"),
               ("vae_ms", "VAE decode ms"), ("vae_device_ms", "VAE, graph ms"), ("peak_MB", "peak MB"),
               ("warmup_s", "warm-up s"), ("unet_rel_err", "UNet rel err"), ("status", "status")]
ABLATION_COLUMNS = [("variant", "step (cumulative)"), ("e2e_ms", "end to end ms"), ("latency_change_pct", "latency"),
                    ("unet_ms", "UNet step ms"), ("vae_ms", "VAE decode ms"), ("peak_over_weights_MB",
                    "peak MB over weights"), ("memory_change_pct", "memory"), ("patched", "modules patched"),
                    ("status", "status")]


def cell(key: str, v: object) -> str:
    if v in (None, ""):
        return "-"
    return f"{float(v):+.1f}%" if key.endswith("_pct") else str(v)


def markdown(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """A markdown table of ``rows``; numbers right-aligned, percentages signed, empty cells as "-"."""
    numeric = {k for k, _ in columns if any(_f(str(r.get(k, "")), "g") != "-" for r in rows)}
    out = ["| " + " | ".join(h for _, h in columns) + " |",
           "|" + "|".join("---:" if k in numeric else "---" for k, _ in columns) + "|"]
    out += ["| " + " | ".join(cell(k, r.get(k)) for k, _ in columns) + " |" for r in rows]
    return "\n".join(out)


def e2e_table(rows: list[dict[str, str]]) -> str:
    if "component" not in rows[0]:
        return markdown(rows, E2E_COLUMNS)
    return _component_table(rows)


def ablation_table(rows: list[dict[str, str]]) -> str:
    rows = ablation_rows(rows)
    total = ablation_total(rows)
    return markdown(rows, ABLATION_COLUMNS) + (f"\n\n{total}." if total else "")


def _component_table(rows: list[dict[str, str]]) -> str:
    """The first e2e.csv schema (one row per component and variant, 2026-11-22)."""
    out = ["| component | variant | ms | vs stock (same mode) | peak MB over weights | rel err vs stock |",
           "|---|---|---:|---:|---:|---:|"]
    base = {}
    for r in rows:
        mode = "eager" if "eager" in r["variant"] else "graph"
        if r["variant"].startswith("stock"):
            base[(r["component"], mode)] = float(r["ms"])
        ref = base.get((r["component"], mode))
        ratio = f'{ref / float(r["ms"]):.2f}x' if ref else "-"
        out.append(f'| {r["component"]} | {r["variant"]} | {float(r["ms"]):.2f} | {ratio} | {r["peak_MB"]} | '
                   f'{r["rel_err_vs_stock"]} |')
    return "\n".join(out)


# The end-to-end summary bench.e2e prints (terminal tables, the ablation's total, the issue's goals).

SHORT = ["model", "size", "variant", "e2e_ms", "it_per_s", "unet_ms", "unet_device_ms", "vae_ms", "vae_device_ms",
         "peak_MB", "warmup_s", "status"]


def ablation_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ablation rows with the change of latency and peak memory (over the weights) from the baseline."""
    ok = [r for r in rows if r.get("status") == "ok"]
    if not ok or ok[0]["variant"] != "baseline":
        return []
    base = ok[0]
    out = []
    for r in rows:
        d = dict(r)
        if r.get("status") == "ok":
            for col, key in (("e2e_ms", "latency"), ("unet_ms", "unet"), ("peak_over_weights_MB", "memory")):
                a, b = _num(base.get(col)), _num(r.get(col))
                d[f"{key}_change_pct"] = round(100 * (b - a) / a, 1) if a and b is not None else ""
        out.append(d)
    return out


def ablation_total(rows: list[dict[str, Any]]) -> str:
    """The last measured ablation row against the baseline, beside the paper's reductions ("" if none)."""
    last = next((r for r in reversed(rows) if r.get("status") == "ok"), None)
    if not rows or last is None or last is rows[0]:
        return ""
    paper = ", ".join(f"{v}% {k}" for k, v in PAPER_REDUCTION.items())
    latency, memory = (cell(k, last.get(k)) for k in ("latency_change_pct", "memory_change_pct"))
    return (f"Total, {last['variant']} vs baseline: latency {latency}, peak memory over the weights {memory} "
            f"(the paper: {paper})")


ABLATION_SHORT = ["variant", "e2e_ms", "latency_change_pct", "unet_ms", "unet_change_pct", "vae_ms", "peak_MB",
                  "peak_over_weights_MB", "memory_change_pct", "patched", "status"]


def goals(rows: list[dict[str, Any]]) -> list[str]:
    """The issue's H100 goals for SD1.5 at 512², against this run's numbers."""
    sd15 = {r["variant"]: r for r in rows if r.get("model") == "sd15" and str(r.get("size")) == "512"
            and r.get("status") == "ok" and r.get("csv", "e2e.csv") == "e2e.csv"}

    def val(variant: str, col: str) -> float | None:
        return _num(sd15.get(variant, {}).get(col))

    lines = []
    ours, theirs = val("patched+graph", "unet_ms"), val("stock+compile", "unet_device_ms")
    if ours and theirs:
        lines.append(f"UNet step: patched+graph {ours:.2f} ms = {ours / theirs:.2f}x torch.compile+graph "
                     f"{theirs:.2f} ms (goal <= 0.6x): {'met' if ours <= 0.6 * theirs else 'not met'}")
    vae = [v for v in (val(n, "vae_device_ms") for n in sd15 if n.startswith("patched")) if v]
    if vae:
        lines.append(f"VAE decode: best patched {min(vae):.2f} ms (goal <= 4.5 ms): "
                     f"{'met' if min(vae) <= 4.5 else 'not met'}")
    e2e = {n: v for n in sd15 if n.startswith("patched") and (v := val(n, "e2e_ms"))}
    if e2e:
        best = min(e2e, key=e2e.get)
        lines.append(f"end to end, 20 steps: best patched ({best}) {e2e[best]:.1f} ms (goal <= 100 ms): "
                     f"{'met' if e2e[best] <= 100 else 'not met'}")
    return lines


def _num(v: Any) -> float | None:
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return None if x != x else x


def print_summary(rows: list[dict[str, Any]]) -> None:
    e2e = [r for r in rows if r.get("csv", "e2e.csv") == "e2e.csv"]
    from bench.common import format_table

    abl = ablation_rows([r for r in rows if r.get("csv") == "ablation.csv"])
    if abl:
        print("\n== ablation (cumulative; UNet step from CUDA graphs):")
        print(format_table(abl, ABLATION_SHORT))
        total = ablation_total(abl)
        if total:
            print(total)
    if e2e:
        print("\n== end to end (ms; *_device_ms: replayed from a CUDA graph):")
        print(format_table(e2e, SHORT))
    for line in goals(e2e):
        print("goal: " + line)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=pathlib.Path)
    args = ap.parse_args(argv)
    found = False
    for name, render in (("e2e.csv", e2e_table), ("ablation.csv", ablation_table), ("ops.csv", ops_tables)):
        path = args.folder / name
        if path.exists():
            found = True
            rows = list(csv.DictReader(open(path)))
            print(f"\n### {name}\n\n{render(rows)}")
    if not found:
        print(f"no ops.csv, e2e.csv or ablation.csv in {args.folder}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
