"""Markdown tables from a results folder (ops.csv, e2e.csv, ablation.csv): ``python -m bench.report DIR``.

docs/results.md pastes its output, so that the numbers there are the measured ones, not retyped.
Per op and shape: stock, then every other implementation, device time (CUDA graph) and the ratio to
stock, the roofline fraction that applies (copy bandwidth for memory-bound ops, matmul TFLOP/s for
the rest) and the eager time (one call at a time from Python).
"""

from __future__ import annotations

import argparse
import csv
import pathlib
import sys


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
    from bench.e2e import ablation_rows, ablation_total

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
