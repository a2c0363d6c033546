"""Does the memory budget bound the daemon's memory? A soak under constant eviction.

    .venv/bin/python benchmarks/bench_memory_soak.py [--seconds 180] [--clients 8] [--stores 50]
        [--budget 32MiB] [--keys 1000] [--value-bytes 64] [--every 10]

A daemon (a separate process, the default uvloop) serves ``--clients`` client processes. Each keeps
one connection open and loops over its own ``--stores`` stores: open the store at its last commit,
put_many ``--keys`` keys (the same keys every round, new values), commit. Together the stores hold
far more than ``--budget``, so the daemon keeps evicting idle, durable stores and reloading them
from their files (snapshots + deltas) when they are opened again.

Every ``--every`` seconds it prints the daemon's RSS (``/proc/<pid>/status``) next to its own count
(``memory_bytes`` of STATS: the stores; ``queued``: deltas waiting for upload, in the budget too),
the stores it holds, evictions, loads, commits, the snapshots written and in progress, and the
upload records the uploader keeps (one per
delta, durable ones included, for AWAIT_DURABLE; not in the budget). At the end it prints:

* the fixed overhead: the RSS of the same daemon once started, before any client (an empty
  daemon), plus the stated working overhead (``--working-overhead``, 48 MiB: what serving 8
  connections and 400 stores that come and go takes beyond the stores themselves — buffers, upload
  records, the Python allocator's partly used pages; measured at a 1 MiB budget, where it is 30 MiB,
  and not growing with the budget);
* the peak RSS of the soak against ``budget + fixed overhead``;
* whether the RSS is flat: the peak of the last third of the samples is within ``--flat-margin``
  of the peak of the middle third (the first third is the warm-up: stores loading, the allocator's
  arenas and Python's free lists filling).

The verdict line reads ``flat: yes|no, bounded: yes|no``; the exit code is 0 only when both hold.
"""
from __future__ import annotations

import argparse
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
from statestore_async.ids import StoreId
from statestore_async.testing.daemon import start_daemon, stop_daemon

MIB = 1 << 20


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


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
    charts.add_chart_args(ap, "bench_memory_soak")
    args = ap.parse_args()
    budget = parse_size(args.budget)
    flat_margin = parse_size(args.flat_margin)
    working = parse_size(args.working_overhead)

    folder = tempfile.mkdtemp(prefix="soak-", dir="/tmp")
    root = f"file://{folder}/root"
    sock = f"{folder}/d.sock"
    extra = () if args.retention_versions is None else ("--retention-versions", str(args.retention_versions))
    daemon = start_daemon(sock, "--memory-budget", str(budget), "--log-level", "warning", "--loop", args.loop, *extra,
                          log_path=f"{folder}/daemon.log")
    procs: list[multiprocessing.Process] = []
    try:
        # the fixed overhead: an empty daemon, started and settled (no client yet)
        time.sleep(2.0)
        empty = rss_bytes(daemon.pid)
        fixed = empty + working
        print(f"daemon pid {daemon.pid}, budget {budget / MIB:.1f} MiB, fixed overhead {fixed / MIB:.1f} MiB "
              f"(empty daemon RSS {empty / MIB:.1f} + working {working / MIB:.1f}); "
              f"{args.clients} clients x {args.stores} stores x {args.keys} keys "
              f"x {args.value_bytes} B values, {args.seconds:.0f} s", flush=True)
        ctx = multiprocessing.get_context("spawn")
        rounds_q = ctx.Queue()
        start = time.time()
        stop_at = start + args.seconds
        for i in range(args.clients):
            p = ctx.Process(target=client_loop, args=(i, sock, root, args.stores, args.keys, args.value_bytes,
                                                      stop_at, rounds_q, args.new_keys), daemon=True)
            p.start()
            procs.append(p)
        samples: list[tuple[float, int]] = []
        print(f"{'t (s)':>6} {'RSS MiB':>8} {'counted MiB':>11} {'queued MiB':>10} {'stores':>6} {'evictions':>9} "
              f"{'loads':>6} {'commits':>8} {'upload records':>14} {'snapshots':>9} {'snap busy':>9} {'spilled':>7} "
              f"{'spills':>6} {'spill asks':>10} {'flushes':>7} {'fds':>5}", flush=True)
        with Client(sock, timeout=60) as stats_client:
            next_sample = start + args.every
            while True:
                time.sleep(max(0.0, next_sample - time.time()))
                now = time.time()
                rss = rss_bytes(daemon.pid)
                try:
                    st = stats_client.stats()
                except StateStoreError as exc:
                    print(f"STATS failed: {exc}", flush=True)
                    st = {"registry": {}, "uploader": {}}
                reg, upl, mnt = st.get("registry", {}), st.get("uploader", {}), st.get("maintenance", {})
                samples.append((now - start, rss))
                print(f"{now - start:6.0f} {rss / MIB:8.1f} {reg.get('memory_bytes', 0) / MIB:11.1f} "
                      f"{upl.get('queued_bytes', 0) / MIB:10.1f} {reg.get('stores', 0):6d} {reg.get('evictions', 0):9d} "
                      f"{reg.get('loads', 0):6d} {upl.get('submitted', 0):8d} "
                      f"{sum(upl.get('states', {}).values()):14d} {mnt.get('snapshots', 0):9d} "
                      f"{mnt.get('in_progress', 0):9d} {reg.get('spilled', 0):7d} {reg.get('spills', 0):6d} "
                      f"{reg.get('spill_requests', 0):10d} {reg.get('flushes', 0):7d} {open_files(daemon.pid):5d}",
                      flush=True)
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
        peak = max(r for _, r in samples)
        n = len(samples)
        middle = samples[n // 3: 2 * n // 3] or samples
        last = samples[2 * n // 3:] or samples
        growth = max(r for _, r in last) - max(r for _, r in middle)
        flat = growth <= flat_margin
        bounded = peak <= budget + fixed
        print(f"rounds per client: {[rounds.get(i) for i in range(args.clients)]}"
              + (f"; client exit codes {failed}" if failed else ""))
        print(f"fixed overhead {fixed / MIB:.1f} MiB, budget {budget / MIB:.1f} MiB: bound {(budget + fixed) / MIB:.1f} MiB; "
              f"peak RSS {peak / MIB:.1f} MiB (first sample {samples[0][1] / MIB:.1f}, last {samples[-1][1] / MIB:.1f}); "
              f"last third vs middle third peak: {growth / MIB:+.1f} MiB (flat within {flat_margin / MIB:.0f} MiB)")
        print(f"verdict: flat: {'yes' if flat else 'no'}, bounded: {'yes' if bounded else 'no'}", flush=True)
        if charts.chart_path(args):
            charts.line_chart(charts.chart_path(args), f"Daemon RSS under constant eviction ({args.clients} clients, "
                              f"budget {budget / MIB:.0f} MiB)", [t for t, _ in samples],
                              {"daemon RSS": [r / MIB for _, r in samples]},
                              charts.measured_caption(f"{args.clients} clients x {args.stores} stores x {args.keys} keys; "
                                                      f"verdict: flat {'yes' if flat else 'no'}, "
                                                      f"bounded {'yes' if bounded else 'no'}"),
                              xlabel="seconds", ylabel="MiB",
                              hlines=[((budget + fixed) / MIB, f"bound: budget + empty daemon + working overhead "
                                       f"= {(budget + fixed) / MIB:.1f} MiB"),
                                      (budget / MIB, f"memory budget {budget / MIB:.0f} MiB")])
        return 0 if flat and bounded and not failed else 1
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
        stop_daemon(daemon, timeout=60)
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
