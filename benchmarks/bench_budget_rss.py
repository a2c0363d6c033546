"""The daemon's peak RSS against its memory budget under workload W's shape, without Spark.

``P`` clients (one per state partition, as the stateful operator's tasks) each commit ``--rounds``
versions of one store: every version reads ``--batch`` random keys of its half of a ``--keys``
key space (GET_MANY), writes them all back changed (PUT_MANY) and waits until the commit is
durable — the per-partition pattern of workload W at K = 10M, where each batch changes ~475k keys
per partition, ~19 MiB of open changes each. The state grows past the budget, so the stores spill
to local disk, and the versions' changes alone are over it: the daemon's write buffer has to move
them to disk as they arrive and at their commits.

Printed: the empty daemon's RSS (started, one STATS answered, before any store), the peak RSS
(``VmHWM``), the bound of ``docs/GUARANTEES.md`` (budget + empty RSS + 48 MiB working overhead),
the largest memory the daemon counted against its budget (sampled), and what its registry did.
Exit status 1 when the peak is over the bound.

    .venv/bin/python benchmarks/bench_budget_rss.py                       # K=10M, 32 MiB, 2 x 475k
    .venv/bin/python benchmarks/bench_budget_rss.py --budget 64MiB --rounds 6
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time

import numpy as np

from statestore_async.client import Client
from statestore_async.config import parse_size
from statestore_async.ids import StoreId
from statestore_async.testing.daemon import start_daemon, stop_daemon

MIB = 1 << 20
WORKING_OVERHEAD = 48 * MIB  # docs/GUARANTEES.md


def status(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def partition(sock: str, root: str, p: int, a: argparse.Namespace, errors: list[BaseException], pid: int) -> None:
    try:
        rnd = np.random.default_rng(p)
        sid = StoreId(root, "w", p)
        with Client(sock) as c:
            ref = None
            for r in range(a.rounds):
                ids = rnd.integers(0, a.keys // a.partitions, a.batch)
                keys = [bytes([0, int(i) % 200]) + int(i).to_bytes(10, "big") for i in ids]
                h = c.open(sid, ref.version if ref else 0, ref.ckptid if ref else None)
                t0 = time.perf_counter()
                values = h.get_many(keys)
                t1 = time.perf_counter()
                h.put_many([(k, (v or bytes(16))[:8] + b"%08d" % r) for k, v in zip(keys, values)])
                t2 = time.perf_counter()
                ref = h.commit()
                if not c.await_durable(sid, ref, timeout=600):
                    raise RuntimeError(f"partition {p} round {r}: not durable")
                print(f"  partition {p} round {r}: get {t1 - t0:.2f} s, put {t2 - t1:.2f} s, "
                      f"commit to durable {time.perf_counter() - t2:.2f} s; RSS {status(pid, 'VmRSS') / MIB:.0f} MiB "
                      f"(peak so far {status(pid, 'VmHWM') / MIB:.0f})",
                      flush=True)
    except BaseException as exc:  # reported by main
        errors.append(exc)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", default="32MiB", help="the daemon's memory budget (default 32MiB)")
    ap.add_argument("--keys", type=int, default=10_000_000, help="key space (default 10M)")
    ap.add_argument("--batch", type=int, default=475_000, help="keys each version reads and writes (default 475k)")
    ap.add_argument("--rounds", type=int, default=4, help="versions per partition (default 4)")
    ap.add_argument("--partitions", type=int, default=2, help="clients, one store each (default 2)")
    a = ap.parse_args()
    budget = parse_size(a.budget)
    with tempfile.TemporaryDirectory(prefix="bench-budget-") as tmp:
        sock = f"{tmp}/d.sock"
        proc = start_daemon(sock, "--memory-budget", str(budget), "--cache-dir", f"{tmp}/cache",
                            log_path=f"{tmp}/daemon.log")
        try:
            with Client(sock) as c:
                c.stats()
            time.sleep(1.0)
            empty = status(proc.pid, "VmRSS")
            bound = budget + empty + WORKING_OVERHEAD
            print(f"budget {budget / MIB:.0f} MiB, empty daemon RSS {empty / MIB:.1f} MiB, bound {bound / MIB:.1f} MiB; "
                  f"{a.partitions} x {a.rounds} versions of {a.batch:,} keys in {a.keys:,}", flush=True)
            counted = [0]
            done = threading.Event()

            def sample() -> None:
                with Client(sock) as mc:
                    while not done.is_set():
                        st = mc.stats()
                        counted[0] = max(counted[0], st["registry"]["memory_bytes"] + st["uploader"]["queued_bytes"])
                        time.sleep(0.01)

            sampler = threading.Thread(target=sample)
            sampler.start()
            errors: list[BaseException] = []
            workers = [threading.Thread(target=partition, args=(sock, f"file://{tmp}/root", p, a, errors, proc.pid))
                       for p in range(a.partitions)]
            for t in workers:
                t.start()
            for t in workers:
                t.join()
            done.set()
            sampler.join()
            if errors:
                raise errors[0]
            with Client(sock) as c:
                reg = c.stats()["registry"]
            peak = status(proc.pid, "VmHWM")
        finally:
            stop_daemon(proc)
    print(f"peak RSS {peak / MIB:.1f} MiB against the bound {bound / MIB:.1f} MiB "
          f"({'within' if peak <= bound else 'OVER'}); most memory counted against the budget (sampled) "
          f"{counted[0] / MIB:.1f} MiB; flushes {reg['flushes']} ({reg['flushed_bytes'] / MIB:.0f} MiB), "
          f"spills {reg['spills']}, deltas stacked {reg['deltas_stacked']}, flush errors {reg['flush_errors']}")
    return 0 if peak <= bound else 1


if __name__ == "__main__":
    sys.exit(main())
