"""The fault campaign's coverage chart: for each level, which fault fired in which phase of the
protocol, and how many schedules it fired in (a heat map, counts in the cells).

    .venv/bin/python benchmarks/campaign_chart.py OUT/coverage.json [MORE/coverage.json ...] \
        [--chart docs/campaign_coverage.png]

It reads the ``coverage.json`` files ``benchmarks/campaign.py --out DIR`` writes (a later file's
level replaces an earlier one's), so runs of the two levels made apart end in one chart. The
caption names each level's command, date, schedules, failures and lost / doubled / unloadable totals.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import charts

DEFAULT_PATH = os.path.join(charts.ROOT, "docs", "campaign_coverage.png")


def merged(paths: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Every level of the coverage files, with the command and date of the run that measured it."""
    levels: dict[str, dict[str, Any]] = {}
    for path in paths:
        with open(path) as f:
            doc = json.load(f)
        for name, level in doc["levels"].items():
            levels[name] = dict(level, command=doc.get("command", "?"), date=doc.get("date", "?"))
    return levels


def render(paths: Sequence[str], out: str) -> str:
    """Write the chart of the coverage files ``paths`` to ``out``; returns ``out``."""
    import numpy as np

    levels = merged(paths)
    plt = charts._pyplot()
    names = list(levels)
    widths = [max(4, len(levels[n]["phases"])) for n in names]
    fig, axes = plt.subplots(1, len(names), figsize=(max(8.0, 1.0 * sum(widths) + 3 * len(names)), 6.2),
                             squeeze=False, gridspec_kw={"width_ratios": widths})
    captions = []
    for ax, name in zip(axes[0], names, strict=True):
        lv = levels[name]
        faults, phases = lv["faults"], lv["phases"]
        grid = np.zeros((len(faults), len(phases)))
        for pair, n in lv["counts"].items():
            f, p = pair.split("|", 1)
            if f in faults and p in phases:
                grid[faults.index(f), phases.index(p)] = n
        allowed = lv.get("allowed")
        shown = np.where(grid > 0, np.log10(np.maximum(grid, 1)) + 1, 0)
        ax.imshow(shown, cmap="Blues", aspect="auto", vmin=0, vmax=max(1.0, float(shown.max())))
        for i, f in enumerate(faults):
            for j, p in enumerate(phases):
                n = int(grid[i, j])
                drawn = allowed is None or p in allowed.get(f, ())
                if not drawn and not n:
                    ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, color="#dddddd"))
                ax.text(j, i, str(n) if n else ("·" if drawn else ""), ha="center", va="center", fontsize=8,
                        color="white" if shown[i, j] > 0.6 * max(1.0, float(shown.max())) else "#222222")
        ax.set_xticks(range(len(phases)), phases, rotation=40, ha="right", fontsize=9)
        ax.set_yticks(range(len(faults)), faults, fontsize=9)
        hit = int((grid > 0).sum())
        t = lv.get("totals", {})
        ax.set_title(f"{name} level: {lv['schedules']} schedules, {len(lv['failures'])} failed; "
                     f"{hit} pairs hit", fontsize=10)
        captions.append(f"{name}: {lv['command']} on {lv['date']}; lost {t.get('lost', 0)}, doubled "
                        f"{t.get('doubled', 0)}, wrong {t.get('wrong', 0)}, unloadable {t.get('unloadable', 0)}")
    caption = ("Cells: schedules in which that fault fired in that phase (· never; grey: a pair the level does "
               "not draw). " + " | ".join(captions))
    fig.subplots_adjust(left=0.16, right=0.98, top=0.88, bottom=charts._caption_space(caption) + 0.12, wspace=0.45)
    return charts._finish(plt, fig, out, "Seeded fault campaign: faults × phases hit", caption)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("coverage", nargs="+", help="coverage.json files written by campaign.py --out")
    ap.add_argument("--chart", default=os.path.relpath(DEFAULT_PATH), metavar="PATH")
    args = ap.parse_args()
    render(args.coverage, args.chart)
    return 0


if __name__ == "__main__":
    sys.exit(main())
