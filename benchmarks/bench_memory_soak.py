"""Does the memory budget bound the daemon's memory? A soak under constant eviction.

    .venv/bin/python benchmarks/bench_memory_soak.py [--seconds 180] [--clients 8] [--stores 50]
        [--budget 32MiB] [--keys 1000] [--value-bytes 64] [--every 10] [--max-open-runs 256]
        [--samples PATH.json] [--chart PATH.png]
    .venv/bin/python benchmarks/bench_memory_soak.py --replot PATH.json --chart PATH.png

A daemon (a separate process, the default uvloop) serves ``--clients`` client processes. Each keeps
one connection open and loops over its own ``--stores`` stores: open the store at its last commit,
put_many ``--keys`` keys (the same keys every round, new values), commit. Together the stores hold
far more than ``--budget``, so the daemon keeps evicting idle, durable stores and reloading them
from their files (snapshots + deltas) when they are opened again.

Every ``--every`` seconds it prints the daemon's RSS (``/proc/<pid>/status``) next to its own count
(``memory_bytes`` of STATS: the stores; ``queued``: deltas waiting for upload, in the budget too),
the stores it holds, evictions, loads, commits, the snapshots written and in progress, the
upload records the uploader keeps (one per delta, durable ones included, for AWAIT_DURABLE; not in
the budget), the spilled stores, and the daemon's open files (``/proc/<pid>/fd``) next to the
files of runs it holds and how many of those are open (``--max-open-runs`` at most). With
``--samples`` every sample is written to a JSON file (with the soak's settings and bounds), from
which ``--replot`` draws the chart again. At the end it prints:

* the fixed overhead: the RSS of the same daemon once started, before any client (an empty
  daemon), plus the stated working overhead (``--working-overhead``, 48 MiB: what serving 8
  connections and 400 stores that come and go takes beyond the stores themselves — buffers, upload
  records, the Python allocator's partly used pages; measured at a 1 MiB budget, where it is 30 MiB,
  and not growing with the budget);
* the peak RSS of the soak against ``budget + fixed overhead``;
* whether the RSS is flat: the peak of the last third of the samples is within ``--flat-margin``
  of the peak of the middle third (the first third is the warm-up: stores loading, the allocator's
  arenas and Python's free lists filling);
* the range of the daemon's own count (stores, block cache and upload queue) against the budget;
* the peak of the daemon's open files against their bound: the empty daemon's open files, one
  per connection (the clients and this script's), ``--max-open-runs`` for the runs of spilled
  stores and ``--files-slack`` (32) for files open for moments (uploads and snapshots being
  written, a snapshot worker's pipes).

The verdict line reads ``flat: yes|no, bounded: yes|no, files bounded: yes|no``; the exit code is 0
only when all three hold.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import charts

from statestore_async.client import Client
from statestore_async.config import parse_size
from statestore_async.errors import StateStoreError
from statestore_async.files.runfiles import DEFAULT_MAX_OPEN
from statestore_async.ids import StoreId
from statestore_async.testing.daemon import start_daemon, stop_daemon

MIB = 1 << 20


def status_bytes(pid: int, field: str = "VmRSS") -> int:
    """A size from ``/proc/<pid>/status``: ``VmRSS`` (resident now) or ``VmHWM`` (its high-water mark)."""
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} for pid {pid}")


def rss_bytes(pid: int) -> int:
    return status_bytes(pid, "VmRSS")


def reset_high_water_mark(pid: int) -> bool:
    """Start ``VmHWM`` again from the current RSS (Linux: ``5`` to ``/proc/<pid>/clear_refs``), so that
    the soak's true peak, between samples too, is not the daemon's start."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def open_files(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


def client_loop(index: int, socket_path: str, root: str, stores: int, keys: int, value_bytes: int,
                stop_at: float, rounds_out, new_keys: bool = False) -> None:
    """One client process: one connection, open / put_many / commit over its own stores until ``stop_at``
    (with ``new_keys``, each round's keys are new ones: the stores grow)."""
    ids = [StoreId(root, f"soak{index}", p) for p in range(stores)]
    refs: dict[StoreId, tuple[int, str | None]] = dict.fromkeys(ids, (0, None))
    key_list = [b"\x00\x01" + b"k%07d" % i for i in range(keys)]
    rounds = 0
    with Client(socket_path, timeout=300) as client:
        while time.time() < stop_at:
            if new_keys:
                key_list = [b"\x00\x01" + b"k%07d" % (rounds * keys + i) for i in range(keys)]
            for sid in ids:
                version, ckptid = refs[sid]
                h = client.open(sid, version, ckptid)
                fill = b"%08d" % rounds
                value = (fill * (value_bytes // len(fill) + 1))[:value_bytes]
                h.put_many([(k, value) for k in key_list])
                ref = h.commit()
                refs[sid] = (ref.version, ref.ckptid)
                if time.time() >= stop_at:
                    break
            rounds += 1
    rounds_out.put((index, rounds))


def summarize(meta: dict, samples: list[dict]) -> dict:
    """The soak's figures and verdict from its samples (see the module doc)."""
    mib = 1.0 * MIB
    rss = [s["rss"] for s in samples]
    n = len(samples)
    middle = samples[n // 3: 2 * n // 3] or samples
    last = samples[2 * n // 3:] or samples
    growth = max(s["rss"] for s in last) - max(s["rss"] for s in middle)
    # the true peak: the kernel's high-water mark, which sees the spikes between samples too
    hwm = max((s.get("hwm", 0) for s in samples), default=0) if meta.get("hwm_reset") else 0
    counted = [s["counted"] + s["queued"] for s in samples]
    fds = [s["fds"] for s in samples if s["fds"] >= 0]
    out = {"peak_rss_mib": max(rss) / mib, "first_rss_mib": rss[0] / mib, "last_rss_mib": rss[-1] / mib,
           "middle_peak_mib": max(s["rss"] for s in middle) / mib, "last_peak_mib": max(s["rss"] for s in last) / mib,
           "growth_mib": growth / mib, "count_min_mib": min(counted) / mib, "count_max_mib": max(counted) / mib,
           "count_over_budget": sum(1 for c in counted if c > meta["budget"]), "samples": n,
           "peak_fds": max(fds) if fds else -1, "peak_run_files": max(s["run_files"] for s in samples),
           "peak_run_files_open": max(s["run_files_open"] for s in samples),
           "peak_pinned": max(s["run_files_pinned"] for s in samples),
           "peak_hwm_mib": hwm / mib if hwm else None}
    out["flat"] = growth <= meta["flat_margin"]
    out["bounded"] = max(max(rss), hwm) <= meta["budget"] + meta["fixed"]
    out["files_bounded"] = out["peak_fds"] <= meta["files_bound"]
    return out


def report(meta: dict, samples: list[dict]) -> dict:
    """Print the soak's figures and verdict; return them."""
    v = summarize(meta, samples)
    budget, bound = meta["budget"] / MIB, (meta["budget"] + meta["fixed"]) / MIB
    print(f"fixed overhead {meta['fixed'] / MIB:.1f} MiB, budget {budget:.1f} MiB: bound {bound:.1f} MiB; "
          f"peak RSS {v['peak_rss_mib']:.1f} MiB (first sample {v['first_rss_mib']:.1f}, last {v['last_rss_mib']:.1f}); "
          f"peak of the middle third {v['middle_peak_mib']:.1f}, of the last third {v['last_peak_mib']:.1f}: "
          f"{v['growth_mib']:+.1f} MiB (flat within {meta['flat_margin'] / MIB:.0f} MiB)")
    if v.get("peak_hwm_mib") is not None:
        print(f"high-water mark of the RSS over the soak (VmHWM, between samples too): {v['peak_hwm_mib']:.1f} MiB")
    print(f"the daemon's count (stores, block cache, upload queue): {v['count_min_mib']:.1f}..{v['count_max_mib']:.1f} "
          f"MiB, over the budget in {v['count_over_budget']} of {v['samples']} samples")
    print(f"open files: peak {v['peak_fds']} against a bound of {meta['files_bound']} (empty daemon "
          f"{meta['empty_fds']} + {meta['connections']} connections + max_open_runs {meta['max_open_runs']} + slack "
          f"{meta['files_slack']}); runs' files held: peak {v['peak_run_files']}, open at once: peak "
          f"{v['peak_run_files_open']}, pinned: peak {v['peak_pinned']}")
    print(f"verdict: flat: {'yes' if v['flat'] else 'no'}, bounded: {'yes' if v['bounded'] else 'no'}, "
          f"files bounded: {'yes' if v['files_bounded'] else 'no'}", flush=True)
    return v


def draw(path: str, meta: dict, samples: list[dict], v: dict) -> None:
    budget, bound = meta["budget"] / MIB, (meta["budget"] + meta["fixed"]) / MIB
    t = [s["t"] for s in samples]
    charts.soak_chart(
        path, f"Daemon memory and open files over a {meta['seconds']:.0f} s soak ({meta['clients']} clients, "
              f"budget {budget:.0f} MiB, {meta['value_bytes']} B values)", t,
        {"daemon RSS": [s["rss"] / MIB for s in samples],
         "daemon's own count (stores, block cache, upload queue)": [(s["counted"] + s["queued"]) / MIB for s in samples]},
        {"daemon's open files": [s["fds"] for s in samples],
         "runs' files held": [s["run_files"] for s in samples],
         "runs' files open": [s["run_files_open"] for s in samples]},
        f"Measured {meta['date']}: {meta['command']}. {meta['clients']} clients x {meta['stores']} stores x "
        f"{meta['keys']} keys; peak RSS {v['peak_rss_mib']:.1f} MiB, middle third {v['middle_peak_mib']:.1f}, "
        f"last third {v['last_peak_mib']:.1f}"
        + (f", high-water mark {v['peak_hwm_mib']:.1f}" if v.get("peak_hwm_mib") is not None else "")
        + f"; open files peak {v['peak_fds']}. Verdict: flat "
        f"{'yes' if v['flat'] else 'no'}, bounded {'yes' if v['bounded'] else 'no'}, files bounded "
        f"{'yes' if v['files_bounded'] else 'no'}. The dotted lines cut the thirds.",
        mib_lines=[(bound, f"bound: budget + empty daemon + working overhead = {bound:.1f} MiB"),
                   (budget, f"memory budget {budget:.0f} MiB")],
        files_lines=[(meta["files_bound"], f"bound of open files: {meta['files_bound']}"),
                     (meta["max_open_runs"], f"max_open_runs {meta['max_open_runs']}")])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=180.0, help="length of the soak (default 180)")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--stores", type=int, default=50, help="stores per client")
    ap.add_argument("--budget", default="32MiB", help="the daemon's memory_budget")
    ap.add_argument("--keys", type=int, default=1000, help="keys per put_many (the same keys each round)")
    ap.add_argument("--value-bytes", type=int, default=64)
    ap.add_argument("--new-keys", action="store_true",
                    help="each round puts new keys (the stores grow: they spill to local disk) instead of the same ones")
    ap.add_argument("--every", type=float, default=10.0, help="seconds between samples")
    ap.add_argument("--working-overhead", default="48MiB",
                    help="stated overhead of a working daemon beyond its empty RSS and its budget")
    ap.add_argument("--flat-margin", default="16MiB", help="growth of the last third over the middle third still called flat")
    ap.add_argument("--loop", default="uvloop", choices=("uvloop", "asyncio"))
    ap.add_argument("--retention-versions", type=int, default=None,
                    help="the daemon's retention window (default: its own, 100); smaller starts retention sooner")
    ap.add_argument("--max-open-runs", type=int, default=DEFAULT_MAX_OPEN,
                    help=f"the daemon's max_open_runs (default {DEFAULT_MAX_OPEN}, its own default)")
    ap.add_argument("--files-slack", type=int, default=32,
                    help="files the bound of open files allows for moments (uploads, snapshots being written)")
    ap.add_argument("--samples", metavar="PATH", help="write the settings, bounds and samples to this JSON file")
    ap.add_argument("--replot", metavar="PATH", help="draw the chart of a --samples file (no soak)")
    charts.add_chart_args(ap, "bench_memory_soak")
    args = ap.parse_args()
    if args.replot:
        with open(args.replot) as fh:
            saved = json.load(fh)
        verdict = report(saved["meta"], saved["samples"])
        path = charts.chart_path(args)
        if path:
            draw(path, saved["meta"], saved["samples"], verdict)
        return 0
    budget = parse_size(args.budget)
    flat_margin = parse_size(args.flat_margin)
    working = parse_size(args.working_overhead)

    folder = tempfile.mkdtemp(prefix="soak-", dir="/tmp")
    root = f"file://{folder}/root"
    sock = f"{folder}/d.sock"
    extra = () if args.retention_versions is None else ("--retention-versions", str(args.retention_versions))
    daemon = start_daemon(sock, "--memory-budget", str(budget), "--log-level", "warning", "--loop", args.loop,
                          "--max-open-runs", str(args.max_open_runs), *extra, log_path=f"{folder}/daemon.log")
    procs: list[multiprocessing.process.BaseProcess] = []
    try:
        # the fixed overhead: an empty daemon, started and settled (no client yet)
        time.sleep(2.0)
        empty = rss_bytes(daemon.pid)
        empty_fds = open_files(daemon.pid)
        hwm_reset = reset_high_water_mark(daemon.pid)
        fixed = empty + working
        connections = args.clients + 1  # the clients' and this script's (STATS)
        meta = {"budget": budget, "fixed": fixed, "empty_rss": empty, "working": working, "flat_margin": flat_margin,
                "empty_fds": empty_fds, "hwm_reset": hwm_reset, "connections": connections, "max_open_runs": args.max_open_runs,
                "files_slack": args.files_slack, "files_bound": empty_fds + connections + args.max_open_runs
                + args.files_slack, "seconds": args.seconds, "clients": args.clients, "stores": args.stores,
                "keys": args.keys, "value_bytes": args.value_bytes, "new_keys": args.new_keys,
                "command": charts.command_line(), "date": charts.today()}
        print(f"daemon pid {daemon.pid}, budget {budget / MIB:.1f} MiB, fixed overhead {fixed / MIB:.1f} MiB "
              f"(empty daemon RSS {empty / MIB:.1f} + working {working / MIB:.1f}); "
              f"{args.clients} clients x {args.stores} stores x {args.keys} keys "
              f"x {args.value_bytes} B values, {args.seconds:.0f} s; open files: empty daemon {empty_fds}, "
              f"max_open_runs {args.max_open_runs}, bound {meta['files_bound']}", flush=True)
        ctx = multiprocessing.get_context("spawn")
        rounds_q = ctx.Queue()
        start = time.time()
        stop_at = start + args.seconds
        for i in range(args.clients):
            proc = ctx.Process(target=client_loop, args=(i, sock, root, args.stores, args.keys, args.value_bytes,
                                                         stop_at, rounds_q, args.new_keys), daemon=True)
            proc.start()
            procs.append(proc)
        samples: list[dict] = []
        print(f"{'t (s)':>6} {'RSS MiB':>8} {'HWM MiB':>8} {'counted MiB':>11} {'queued MiB':>10} {'stores':>6} {'evictions':>9} "
              f"{'loads':>6} {'commits':>8} {'upload records':>14} {'snapshots':>9} {'snap busy':>9} {'spilled':>7} "
              f"{'spills':>6} {'spill asks':>10} {'flushes':>7} {'fds':>5} {'runs':>5} {'runs open':>9} "
              f"{'reopens':>8}", flush=True)
        with Client(sock, timeout=60) as stats_client:
            next_sample = start + args.every
            while True:
                time.sleep(max(0.0, next_sample - time.time()))
                now = time.time()
                rss = rss_bytes(daemon.pid)
                hwm = status_bytes(daemon.pid, "VmHWM")
                fds = open_files(daemon.pid)
                try:
                    st = stats_client.stats()
                except StateStoreError as exc:
                    print(f"STATS failed: {exc}", flush=True)
                    st = {"registry": {}, "uploader": {}}
                reg, upl, mnt = st.get("registry", {}), st.get("uploader", {}), st.get("maintenance", {})
                sample = {"t": round(now - start, 2), "rss": rss, "hwm": hwm, "counted": reg.get("memory_bytes", 0),
                          "queued": upl.get("queued_bytes", 0), "stores": reg.get("stores", 0),
                          "spilled": reg.get("spilled", 0), "fds": fds, "run_files": reg.get("run_files_files", 0),
                          "run_files_open": reg.get("run_files_open", 0),
                          "run_files_pinned": reg.get("run_files_pinned", 0),
                          "run_files_reopens": reg.get("run_files_opens", 0), "commits": upl.get("submitted", 0)}
                samples.append(sample)
                print(f"{now - start:6.0f} {rss / MIB:8.1f} {hwm / MIB:8.1f} {sample['counted'] / MIB:11.1f} "
                      f"{sample['queued'] / MIB:10.1f} {sample['stores']:6d} {reg.get('evictions', 0):9d} "
                      f"{reg.get('loads', 0):6d} {sample['commits']:8d} "
                      f"{sum(upl.get('states', {}).values()):14d} {mnt.get('snapshots', 0):9d} "
                      f"{mnt.get('in_progress', 0):9d} {sample['spilled']:7d} {reg.get('spills', 0):6d} "
                      f"{reg.get('spill_requests', 0):10d} {reg.get('flushes', 0):7d} {fds:5d} "
                      f"{sample['run_files']:5d} {sample['run_files_open']:9d} {sample['run_files_reopens']:8d}",
                      flush=True)
                if args.samples:  # rewritten at each sample: a soak cut short keeps what it measured
                    with open(args.samples + ".tmp", "w") as fh:
                        json.dump({"meta": meta, "samples": samples}, fh)
                    os.replace(args.samples + ".tmp", args.samples)
                next_sample += args.every
                if now >= stop_at or not any(p.is_alive() for p in procs):
                    break
        for p in procs:
            p.join(timeout=120)
        failed = [p.exitcode for p in procs if p.exitcode != 0]
        rounds = {}
        while not rounds_q.empty():
            i, n = rounds_q.get()
            rounds[i] = n
        print(f"rounds per client: {[rounds.get(i) for i in range(args.clients)]}"
              + (f"; client exit codes {failed}" if failed else ""))
        verdict = report(meta, samples)
        path = charts.chart_path(args)
        if path:
            draw(path, meta, samples, verdict)
        ok = verdict["flat"] and verdict["bounded"] and verdict["files_bounded"]
        return 0 if ok and not failed else 1
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
        stop_daemon(daemon, timeout=60)
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
