"""The benchmarks' tables as PNG charts (matplotlib), for the README's performance section.

Every chart carries a caption line saying where its figures come from (measured by the run that
wrote it, or recorded earlier: ``charts_from_docs.py``), the command and the date. A benchmark
adds ``--chart PATH`` (default ``docs/img/<bench>.png``) and ``--no-chart`` with
:func:`add_chart_args`, then calls :func:`bar_charts` or :func:`line_chart` once its table is printed.

matplotlib is a benchmark-only dependency (``requirements/bench.txt``): when it is missing, this
module installs that file into the running interpreter, as ``bench_layouts.py`` does for its peers.
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import shlex
import subprocess
import sys
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMG_DIR = os.path.join(ROOT, "docs", "img")
# one colour per series, the same order in every chart (colour-blind safe: Okabe-Ito)
COLOURS = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000000")


@dataclass
class Panel:
    """One bar chart: ``series`` maps a label to one value per group (None: not measured)."""

    title: str
    groups: Sequence[str]
    series: dict[str, Sequence[float | None]]
    ylabel: str
    log: bool = False
    fmt: Callable[[float], str] = field(default=lambda v: si(v))
    reference: tuple[float, str] | None = None  # a horizontal line: (value, label)


def add_chart_args(ap: argparse.ArgumentParser, bench: str) -> None:
    """``--chart PATH`` (default docs/img/<bench>.png) and ``--no-chart``."""
    default = os.path.relpath(os.path.join(IMG_DIR, f"{bench}.png"))
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--chart", metavar="PATH", default=default,
                   help=f"also write the table as a PNG chart here (default {default})")
    g.add_argument("--no-chart", action="store_true", help="write no chart")


def chart_path(args: argparse.Namespace) -> str | None:
    return None if args.no_chart else args.chart


def command_line() -> str:
    """The command that is running, as a reader would type it from the repository's root."""
    exe = os.path.relpath(sys.executable, ROOT) if sys.executable.startswith(ROOT) else "python"
    script = os.path.relpath(os.path.abspath(sys.argv[0]), ROOT)
    return " ".join([exe, script, *(shlex.quote(a) for a in sys.argv[1:])])


def today() -> str:
    return datetime.date.today().isoformat()


def measured_caption(note: str = "") -> str:
    """The caption of a chart whose figures this run measured."""
    return f"Measured by this run on {today()}: {command_line()}" + (f" ({note})" if note else "")


def si(v: float) -> str:
    """1234567 -> '1.23M' (three significant digits)."""
    for div, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= div:
            return f"{v / div:.3g}{unit}"
    return f"{v:.3g}"


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        req = os.path.join(ROOT, "requirements", "bench.txt")
        print(f"installing {os.path.relpath(req, ROOT)} into {sys.executable} (matplotlib)", file=sys.stderr, flush=True)
        subprocess.check_call([sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q", "-r", req])
        import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _finish(plt: Any, fig: Any, path: str, title: str, caption: str) -> str:
    fig.suptitle(title, fontsize=13, fontweight="bold")
    fig.text(0.01, 0.01, "\n".join(textwrap.wrap(caption, 150)), fontsize=8, color="#444444", va="bottom")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"chart: {os.path.relpath(path)}", file=sys.stderr, flush=True)
    return path


def _caption_space(caption: str) -> float:
    return 0.05 + 0.035 * len(textwrap.wrap(caption, 150))


def bar_charts(path: str, title: str, panels: Sequence[Panel], caption: str, *, width: float = 11.0,
               height: float = 5.0) -> str:
    """Grouped bar charts side by side, each bar labelled with its value; written to ``path``."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(width, height), squeeze=False)
    labels = list(dict.fromkeys(label for p in panels for label in p.series))
    colour = {label: COLOURS[i % len(COLOURS)] for i, label in enumerate(labels)}
    for ax, p in zip(axes[0], panels, strict=True):
        n = len(p.series)
        bar_w = 0.8 / max(n, 1)
        for i, (label, values) in enumerate(p.series.items()):
            xs, ys = [], []
            for g, v in enumerate(values):
                if v is not None and not (isinstance(v, float) and math.isnan(v)):
                    xs.append(g - 0.4 + bar_w * (i + 0.5))
                    ys.append(v)
            bars = ax.bar(xs, ys, bar_w, label=label, color=colour[label])
            ax.bar_label(bars, labels=[p.fmt(y) for y in ys], fontsize=7, padding=1,
                         rotation=90 if n > 3 else 0)
        if p.reference is not None:
            ax.axhline(p.reference[0], color="#888888", linestyle="--", linewidth=1)
            ax.annotate(p.reference[1], (0.99, p.reference[0]), xycoords=("axes fraction", "data"), ha="right",
                        va="center", fontsize=8, color="#333333",
                        bbox={"boxstyle": "round,pad=0.2", "facecolor": "white", "edgecolor": "#888888", "alpha": 0.9})
        wrap = max(8, int(60 / max(len(p.groups), 1)))
        ax.set_xticks(range(len(p.groups)), ["\n".join(textwrap.wrap(g, wrap)) for g in p.groups], fontsize=9)
        ax.set_title(p.title, fontsize=10)
        ax.set_ylabel(p.ylabel)
        if p.log:
            # bars start a decade or so below the smallest value, ticks read as 10k, 1M (not 2x10^5)
            shown = [v for vs in p.series.values() for v in vs if v is not None and v > 0]
            ax.set_yscale("log")
            if shown:
                ax.set_ylim(10 ** math.floor(math.log10(min(shown) / 2)), max(shown) * 4)
            ax.yaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: si(v)))
            ax.yaxis.set_minor_formatter(plt.NullFormatter())
        else:
            ax.set_ylim(0, ax.get_ylim()[1] * 1.15)
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
    fig.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=colour[lb]) for lb in labels], labels=labels,
               loc="upper center", bbox_to_anchor=(0.5, 0.935), ncol=min(len(labels), 4), fontsize=9, frameon=False)
    top = 0.81 - 0.04 * ((len(labels) - 1) // 4)
    tick_lines = max(len(textwrap.wrap(g, max(8, int(60 / max(len(p.groups), 1))))) for p in panels for g in p.groups)
    fig.subplots_adjust(left=0.07, right=0.98, top=top, bottom=_caption_space(caption) + 0.035 * tick_lines + 0.03,
                        wspace=0.3)
    return _finish(plt, fig, path, title, caption)


def line_chart(path: str, title: str, x: Sequence[float], series: dict[str, Sequence[float]], caption: str, *,
               xlabel: str, ylabel: str, hlines: Sequence[tuple[float, str]] = ()) -> str:
    """Lines over a common x (e.g. RSS over time), with labelled horizontal lines (e.g. a bound)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(11.0, 5.0))
    for i, (label, ys) in enumerate(series.items()):
        ax.plot(x, ys, label=label, color=COLOURS[i % len(COLOURS)], linewidth=1.8, marker="o", markersize=3)
    for value, label in hlines:
        ax.axhline(value, color="#888888", linestyle="--", linewidth=1)
        ax.annotate(label, (0.005, value), xycoords=("axes fraction", "data"), va="bottom", fontsize=8,
                    color="#555555")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, max([*(max(ys) for ys in series.values() if ys), *(v for v, _ in hlines)]) * 1.15)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=9, frameon=False, loc="lower right")
    fig.subplots_adjust(left=0.07, right=0.98, top=0.9, bottom=_caption_space(caption) + 0.1)
    return _finish(plt, fig, path, title, caption)


def soak_chart(path: str, title: str, t: Sequence[float], mib: dict[str, Sequence[float]],
               files: dict[str, Sequence[float]], caption: str, *, mib_lines: Sequence[tuple[float, str]] = (),
               files_lines: Sequence[tuple[float, str]] = ()) -> str:
    """A soak over time in two panels sharing the x axis (seconds): memory in MiB above (e.g. the
    daemon's RSS and its own count), open files below, each with labelled horizontal lines (bounds)."""
    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11.0, 7.5), sharex=True, height_ratios=(3, 2))
    panels = ((top, mib, mib_lines, "MiB", "center right"), (bottom, files, files_lines, "open files", "upper right"))
    for ax, series, lines, ylabel, where in panels:
        for i, (label, ys) in enumerate(series.items()):
            ax.plot(t, ys, label=label, color=COLOURS[i % len(COLOURS)], linewidth=1.4)
        for k, (value, label) in enumerate(lines):  # labels above, then below their lines: close lines stay legible
            ax.axhline(value, color="#888888", linestyle="--", linewidth=1)
            ax.annotate(label, (0.005, value), xycoords=("axes fraction", "data"), va="bottom" if k % 2 == 0 else "top",
                        fontsize=8, color="#555555")
        ax.set_ylabel(ylabel)
        ax.set_ylim(0, max([*(max(ys) for ys in series.values() if ys), *(v for v, _ in lines)]) * 1.15)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=9, frameon=True, framealpha=0.9, loc=where)
    third = (t[-1] - t[0]) / 3 if t else 0
    for ax in (top, bottom):  # the thirds the flatness verdict compares
        for k in (1, 2):
            ax.axvline(t[0] + k * third, color="#bbbbbb", linestyle=":", linewidth=1)
    bottom.set_xlabel("seconds")
    fig.subplots_adjust(left=0.07, right=0.98, top=0.93, bottom=0.03 + 0.022 * len(textwrap.wrap(caption, 150)) + 0.05,
                        hspace=0.08)
    return _finish(plt, fig, path, title, caption)
