"""Charts of figures already measured and recorded in the docs' tables, without running anything.

    .venv/bin/python benchmarks/charts_from_docs.py            # every chart of docs/img/figures.json
    .venv/bin/python benchmarks/charts_from_docs.py bench_spark

``docs/img/figures.json`` holds the figures copied exactly from docs/PERFORMANCE.md / docs/SPARK.md tables,
each chart with the table it comes from, the command that measured it and the date; the caption of
every chart written here says so ("recorded figures, not re-measured"). Charts of a fresh run come
from the benchmarks themselves (``--chart``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import charts

FIGURES = os.path.join(charts.IMG_DIR, "figures.json")


def caption(chart: dict) -> str:
    note = f"; {chart['note']}" if chart.get("note") else ""
    return (f"Recorded figures, not re-measured: {chart['source']}. Measured with {chart['command']} "
            f"(date: {chart['date']}){note}.")


def draw(chart: dict, out_dir: str) -> str:
    panels = []
    for p in chart["panels"]:
        fmt = p.get("format", "{:,.3g}")
        panels.append(charts.Panel(p["title"], p["groups"], p["series"], p["ylabel"], log=p.get("log", False),
                                   fmt=fmt.format, reference=tuple(p["reference"]) if p.get("reference") else None))
    width = min(15.0, 5.5 + 3.2 * len(panels)) if len(panels) > 1 else 10.0
    return charts.bar_charts(os.path.join(out_dir, f"{chart['name']}.png"), chart["title"], panels, caption(chart),
                             width=width)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help="charts to draw (default: all of figures.json)")
    ap.add_argument("--figures", default=FIGURES, help="the recorded figures (default docs/img/figures.json)")
    ap.add_argument("--out", default=charts.IMG_DIR, help="folder of the PNGs (default docs/img)")
    args = ap.parse_args()
    with open(args.figures) as fh:
        recorded = json.load(fh)["charts"]
    known = {c["name"] for c in recorded}
    unknown = [n for n in args.names if n not in known]
    if unknown:
        ap.error(f"no chart named {', '.join(unknown)} in {args.figures}; there are: {', '.join(sorted(known))}")
    for chart in recorded:
        if not args.names or chart["name"] in args.names:
            draw(chart, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
