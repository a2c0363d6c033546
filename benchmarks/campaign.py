"""The seeded fault campaign's runner: schedules drawn from seeds, run with faults, checked against
an oracle (``statestore_async.testing.campaign``; docs/CAMPAIGN.md).

    .venv/bin/python benchmarks/campaign.py --level store --schedules 2000 --seed 1000 --out /tmp/camp
    .venv/bin/python benchmarks/campaign.py --level store --only-seed 1234 --shrink   # replay one seed

Schedule ``i`` uses seed ``S + i``. One line per schedule, then a summary: schedules, failures,
lost / doubled / wrong / unloadable totals, the daemons' peak RSS against their bound, and the
coverage matrix (which fault fired in which phase, how often). ``--out DIR`` writes
``outcomes.jsonl`` (a JSON line per schedule) and ``coverage.json``; the chart of that coverage
(``campaign_chart.py``) goes to ``docs/campaign_coverage.png`` unless ``--no-chart``. Exit status 1
on any failure, 2 when a level asked for is not available.

A level's module is imported only when it runs, so a missing one does not stop the other.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from types import ModuleType
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import campaign_chart
import charts

LEVELS = ("store", "spark")
MIB = 1 << 20


def load_level(level: str) -> ModuleType | None:
    """``statestore_async.testing.campaign.<level>_level``, or None when it is not there."""
    name = f"statestore_async.testing.campaign.{level}_level"
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != name:
            raise
        return None


def outcome_record(level: str, o: Any) -> dict[str, Any]:
    """A JSON-able line for one outcome (the contract's fields, whatever the level)."""
    s = o.schedule
    return {"level": level, "seed": s.seed, "ok": o.ok, "lost": o.lost, "doubled": o.doubled, "wrong": o.wrong,
            "unloadable": o.unloadable, "rss_peak": o.rss_peak, "rss_bound": o.rss_bound,
            "coverage": sorted([f, p] for f, p in o.coverage), "seconds": round(o.seconds, 3),
            "events": [[e.fault, e.step, e.phase, [list(p) if isinstance(p, tuple) else p for p in e.params]]
                       for e in s.events],
            "detail": o.detail}


class Totals:
    """What one level's run found, added up."""

    def __init__(self, level: str, module: ModuleType):
        self.level = level
        self.faults = tuple(module.FAULTS)
        self.phases = tuple(module.PHASES)
        # the (fault, phase) pairs the level can draw, when it says (store: ALLOWED; spark: PHASES_OF)
        allowed = getattr(module, "ALLOWED", None) or getattr(module, "PHASES_OF", None)
        self.allowed = ({f: list(ps) for f, ps in allowed.items()} if isinstance(allowed, dict) else None)
        self.schedules = 0
        self.failures: list[int] = []
        self.counts: Counter[str] = Counter()
        self.coverage: Counter[tuple[str, str]] = Counter()
        self.rss_peak = 0
        self.rss_bound_at_peak: int | None = None
        self.worst_margin: float | None = None  # smallest bound - peak seen, bytes
        self.seconds = 0.0

    def add(self, rec: dict[str, Any]) -> None:
        """Count one outcome (its ``outcome_record``)."""
        self.schedules += 1
        self.seconds += rec["seconds"]
        if not rec["ok"]:
            self.failures.append(rec["seed"])
        for k in ("lost", "doubled", "wrong", "unloadable"):
            self.counts[k] += rec[k]
        for f, p in rec["coverage"]:
            self.coverage[(f, p)] += 1
        peak, bound = rec["rss_peak"], rec["rss_bound"]
        if peak is not None:
            if peak > self.rss_peak:
                self.rss_peak, self.rss_bound_at_peak = peak, bound
            if bound is not None:
                margin = bound - peak
                self.worst_margin = margin if self.worst_margin is None else min(self.worst_margin, margin)

    def matrix(self) -> str:
        width = max(len(f) for f in self.faults)
        head = " " * width + " " + " ".join(f"{p[:9]:>9}" for p in self.phases)
        lines = [head]
        for f in self.faults:
            cells = [self.coverage.get((f, p), 0) for p in self.phases]
            lines.append(f"{f:<{width}} " + " ".join(f"{c:>9}" if c else f"{'.':>9}" for c in cells))
        return "\n".join(lines)

    def summary(self) -> str:
        c = self.counts
        rss = "no RSS measured"
        if self.rss_peak:
            bound = f"{self.rss_bound_at_peak / MIB:.1f}" if self.rss_bound_at_peak else "?"
            rss = f"peak RSS {self.rss_peak / MIB:.1f} MiB (its bound {bound} MiB)"
            if self.worst_margin is not None:
                rss += f", smallest margin under a bound {self.worst_margin / MIB:.1f} MiB"
        hit = sum(1 for v in self.coverage.values() if v)
        return (f"[{self.level}] {self.schedules} schedules, {len(self.failures)} failed"
                f"{' (seeds ' + ' '.join(map(str, self.failures[:20])) + ')' if self.failures else ''}; "
                f"lost {c['lost']}, doubled {c['doubled']}, wrong {c['wrong']}, unloadable {c['unloadable']}; "
                f"{rss}; {self.seconds:.0f} s in schedules ({self.seconds / max(1, self.schedules):.2f} s each); "
                f"coverage: {hit} (fault, phase) pairs hit\n{self.matrix()}")

    def to_json(self) -> dict[str, Any]:
        return {"faults": list(self.faults), "phases": list(self.phases), "schedules": self.schedules,
                "failures": self.failures, "totals": dict(self.counts), "rss_peak": self.rss_peak,
                "rss_bound_at_peak": self.rss_bound_at_peak, "worst_rss_margin": self.worst_margin,
                "seconds": round(self.seconds, 1), "allowed": self.allowed,
                "counts": {f"{f}|{p}": n for (f, p), n in sorted(self.coverage.items())}}


def line(level: str, o: Any) -> str:
    cov = ",".join(f"{f}@{p}" for f, p in sorted(o.coverage)) or "-"
    rss = ""
    if o.rss_peak:
        rss = f" rss {o.rss_peak / MIB:.0f}/{o.rss_bound / MIB:.0f}MiB" if o.rss_bound else f" rss {o.rss_peak / MIB:.0f}MiB"
    text = f"[{level}] seed {o.schedule.seed} {'ok  ' if o.ok else 'FAIL'} {o.seconds:6.2f}s{rss} fired {cov}"
    if not o.ok:
        text += (f"\n    lost {o.lost} doubled {o.doubled} wrong {o.wrong} unloadable {o.unloadable}: {o.detail}"
                 f"\n    " + o.schedule.describe().replace("\n", "\n    "))
    return text


def seeds_of(args: argparse.Namespace) -> list[int]:
    if args.only_seed is not None:
        return [args.only_seed]
    seeds = [args.seed + i for i in range(args.schedules)]
    if args.shard:
        i, n = (int(x) for x in args.shard.split("/"))
        seeds = seeds[i::n]
    return seeds


def run_level(level: str, module: ModuleType, args: argparse.Namespace, out: Any, totals: Totals) -> Totals:
    """Run the level's schedules; with ``--jobs N`` for the store level, in N threads, each with an
    Env of its own (its daemons, fault proxy and cache disk) and one S3 server for all."""
    seeds = seeds_of(args)
    jobs = max(1, min(args.jobs, len(seeds))) if level == "store" else 1
    if args.workdir:
        os.makedirs(args.workdir, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix=f"campaign-{level}-", dir=args.workdir)
    print(f"[{level}] {len(seeds)} schedules from seed {seeds[0]}; {jobs} at a time; work folder {workdir}",
          flush=True)
    lock = threading.Lock()
    stop = threading.Event()

    def work(env: Any, mine: list[int]) -> None:
        for seed in mine:
            if stop.is_set():
                return
            schedule = module.draw(seed, args.size) if args.size else module.draw(seed)
            try:
                o = module.run(schedule, env)
            except Exception as exc:  # the campaign's own error: counted as a failure, the run goes on
                o = module.Outcome(schedule, False, 0, 0, 0, 0, None, None, set(),
                                   f"the campaign failed: {type(exc).__name__}: {exc}", 0.0)
            rec = outcome_record(level, o)
            with lock:
                totals.add(rec)
                print(line(level, o), flush=True)
                if out is not None:
                    out.write(json.dumps(rec) + "\n")
                    out.flush()
            if not o.ok and args.shrink:
                small = module.shrink(schedule, env)
                with lock:
                    print(f"[{level}] seed {seed}: shortest failing schedule found ({len(small.events)} of "
                          f"{len(schedule.events)} events):\n{small.describe()}", flush=True)

    opts: dict[str, Any] = {"keep_logs": True} if args.keep_logs and level == "store" else {}
    try:
        if jobs == 1:
            with module.Env(workdir, **opts) as env:
                work(env, seeds)
        else:
            run_threads(module, workdir, jobs, seeds, work, stop, opts)
    finally:
        shutil.rmtree(os.path.join(workdir, "seaweedfs"), ignore_errors=True)
        if totals.failures or args.keep_logs:
            print(f"[{level}] logs kept in {workdir}", flush=True)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return totals


def run_threads(module: ModuleType, workdir: str, jobs: int, seeds: list[int], work: Any, stop: threading.Event,
                opts: dict[str, Any]) -> None:
    """``work(env, seeds)`` in ``jobs`` threads, each with its own Env, one S3 server for all."""
    from statestore_async.testing.seaweedfs import SeaweedFS

    with SeaweedFS(os.path.join(workdir, "seaweedfs")) as s3, contextlib.ExitStack() as stack:
        envs = [stack.enter_context(module.Env(os.path.join(workdir, f"job{i}"), seaweedfs=s3, **opts))
                for i in range(jobs)]
        threads = [threading.Thread(target=work, args=(env, seeds[i::jobs]), name=f"campaign-{i}")
                   for i, env in enumerate(envs)]
        for t in threads:
            t.start()
        try:
            for t in threads:
                t.join()
        except BaseException:
            # SIGTERM or ^C: each thread finishes the schedule it runs, then every Env stops
            # what it started
            stop.set()
            for t in threads:
                t.join()
            raise


def run_sharded(level: str, module: ModuleType, args: argparse.Namespace, out: Any, totals: Totals) -> Totals:
    """``run_level`` split over ``args.jobs`` child processes (``--shard i/N``); their lines are
    passed on as they come, their outcomes added up."""
    shard_dir = tempfile.mkdtemp(prefix=f"campaign-{level}-shards-", dir=args.workdir)
    procs = []
    for i in range(args.jobs):
        cmd = [sys.executable, os.path.abspath(__file__), "--level", level, "--schedules", str(args.schedules),
               "--seed", str(args.seed), "--shard", f"{i}/{args.jobs}", "--out", os.path.join(shard_dir, str(i)),
               "--no-chart", "--size", str(args.size)]
        if args.workdir:
            cmd += ["--workdir", args.workdir]
        if args.keep_logs:
            cmd.append("--keep-logs")
        if args.shrink:
            cmd.append("--shrink")
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))

    def relay(p: subprocess.Popen) -> None:
        assert p.stdout is not None
        for text in p.stdout:
            if text.startswith(f"[{level}]") or text.startswith("    "):
                print(text, end="", flush=True)

    threads = [threading.Thread(target=relay, args=(p,), daemon=True) for p in procs]
    for t in threads:
        t.start()
    for p in procs:
        p.wait()
    for t in threads:
        t.join()
    for i in range(args.jobs):
        path = os.path.join(shard_dir, str(i), "outcomes.jsonl")
        if not os.path.exists(path):
            print(f"[{level}] shard {i} wrote no outcomes", flush=True)
            totals.failures.append(-1)
            continue
        with open(path) as f:
            for text in f:
                rec = json.loads(text)
                totals.add(rec)
                if out is not None:
                    out.write(text)
    return totals


def report(results: dict[str, Totals], args: argparse.Namespace, wall: float, note: str = "") -> None:
    """Print the summary; with ``--out``, write coverage.json and (unless --no-chart) the chart."""
    print(f"\nsummary ({note}{wall:.0f} s wall)", flush=True)
    for t in results.values():
        print(t.summary(), flush=True)
    if args.out:
        cov_path = os.path.join(args.out, "coverage.json")
        doc = {"command": charts.command_line(), "date": charts.today(), "wall_seconds": round(wall, 1),
               "note": note.rstrip(": "), "levels": {lv: t.to_json() for lv, t in results.items()}}
        os.makedirs(args.out, exist_ok=True)
        with open(cov_path, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"coverage: {cov_path}", flush=True)
        if not args.no_chart:
            campaign_chart.render([cov_path], args.chart)


def summarize(args: argparse.Namespace) -> int:
    """``--summarize``: the totals of outcomes already written, as a run would print them."""
    results: dict[str, Totals] = {}
    for path in args.summarize:
        with open(path) as f:
            for text in f:
                rec = json.loads(text)
                lv = rec["level"]
                if lv not in results:
                    module = load_level(lv)
                    if module is None:
                        print(f"[{lv}] level not available: its outcomes are skipped", flush=True)
                        continue
                    results[lv] = Totals(lv, module)
                results[lv].add(rec)
    report(results, args, 0.0, f"added up from {', '.join(args.summarize)}: ")
    return 1 if any(t.failures for t in results.values()) else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--level", choices=(*LEVELS, "all"), default="store")
    ap.add_argument("--schedules", type=int, default=20, help="how many schedules per level")
    ap.add_argument("--seed", type=int, default=1, help="schedule i uses seed SEED + i")
    ap.add_argument("--only-seed", type=int, default=None, metavar="N", help="replay the schedule of seed N alone")
    ap.add_argument("--size", type=int, default=0, help="most events per schedule (0: the level's default)")
    ap.add_argument("--out", default=None, metavar="DIR", help="write outcomes.jsonl and coverage.json here")
    ap.add_argument("--shrink", action="store_true", help="on a failure, print the shortest failing schedule found")
    ap.add_argument("--workdir", default=None, help="parent of the work folders (default: the system's temp)")
    ap.add_argument("--keep-logs", action="store_true", help="keep the daemons' logs of passing schedules too")
    ap.add_argument("--jobs", type=int, default=1,
                    help="run this many schedules at a time (much of a schedule is waiting: uploads, retries' "
                         "backoff, drains); the seeds and checks are the same. The store level runs them in "
                         "threads with one S3 server, another level in processes")
    ap.add_argument("--shard", default=None, metavar="I/N", help=argparse.SUPPRESS)  # one process of --jobs
    ap.add_argument("--summarize", nargs="+", default=None, metavar="JSONL",
                    help="run nothing: add up these outcomes.jsonl files (e.g. of a run stopped early) into the "
                         "summary, --out DIR/coverage.json and the chart")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--chart", default=os.path.relpath(campaign_chart.DEFAULT_PATH), metavar="PATH",
                   help="the coverage chart (needs --out)")
    g.add_argument("--no-chart", action="store_true")
    args = ap.parse_args(argv)
    # SIGTERM unwinds like an exception, so every Env stops what it started (daemons, S3, the tmpfs)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    if args.summarize:
        return summarize(args)
    levels = LEVELS if args.level == "all" else (args.level,)
    modules = {lv: load_level(lv) for lv in levels}
    missing = [lv for lv, m in modules.items() if m is None]
    for lv in missing:
        print(f"[{lv}] level not available: statestore_async.testing.campaign.{lv}_level is not installed", flush=True)
    if args.level != "all" and missing:
        return 2
    out = None
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        out = open(os.path.join(args.out, "outcomes.jsonl"), "a")
    started = time.monotonic()
    results: dict[str, Totals] = {}
    stopped = False
    try:
        for lv, module in modules.items():
            if module is None:
                continue
            results[lv] = Totals(lv, module)
            if args.jobs > 1 and args.only_seed is None and lv != "store":
                run_sharded(lv, module, args, out, results[lv])
            else:
                run_level(lv, module, args, out, results[lv])
    except (KeyboardInterrupt, SystemExit):
        stopped = True  # the summary of what ran
    finally:
        if out is not None:
            out.close()
    wall = time.monotonic() - started
    report(results, args, wall, "stopped early: " if stopped else "")
    failed = any(t.failures for t in results.values())
    return 1 if failed or stopped or (missing and args.level != "all") else 0


if __name__ == "__main__":
    sys.exit(main())
