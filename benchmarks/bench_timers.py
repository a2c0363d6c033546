"""What firing timers costs (issue 19): the time of a batch whose due timers are 0, 0.1%, 1% and
10% of the keys', at 1M and 100k keys that each hold a timer, per-key and vectorized APIs.

    .venv/bin/python benchmarks/bench_timers.py                    # 1M and 100k keys, both APIs
    .venv/bin/python benchmarks/bench_timers.py --quick            # 100k and 10k keys
    .venv/bin/python benchmarks/bench_timers.py --keys 1000000 --apis vectorized

Each key ``i`` holds a value state (its row count) and one processing-time timer at ``BASE + i``
ms. The state is built by a few large batches (``--build-batch`` keys each) whose clock is before
every timer. Then every measured batch has the same ``--rows`` input rows (keys from the top of
the range, whose timers never come due here; each row re-registers its key's timer, which exists:
the same writes in every case) and a clock that makes exactly the next ``d`` timers due: ``d`` =
0 ("none due"), then 0.1%, 1% and 10% of the keys. The callback emits ``(key, at_ms)`` and
registers nothing; the sink counts the output in the JVM and the count is checked to be ``d``. A
discarded batch with nothing due warms the query up first. Figure: ``BatchProgress.total`` (the
driver's whole batch: plan, the Spark job, fence, manifest, sink), median of ``--repeat`` batches
per case; the difference to "none due" and that difference per due timer; the same for the
slower task's whole time (``timings["total"]``: grouping, the due-timer scan, reads, the calls,
writes and the commit; less noisy than the batch, whose Spark part does not depend on timers);
and the slower task's time in the due-timer scan (the vectorized path: the wait for the scan sent
before ``process`` ran, and its merge with ``process``'s timer changes) and in the processor's
calls (vectorized: ``process``, both calls and the state's encoding).

local[2], 2 state partitions, one daemon on a private socket, the checkpoint on local disk. The
machine is shared: compare the cases of one run, not figures across runs.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

from local_spark import local_session

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

BASE_MS = 2_000_000_000_000        # key i's timer is at BASE_MS + i
BUILD_MS = 1_000_000_000_000       # the clock of the batches that build the state: nothing is due
FRACTIONS = (0.0, 0.001, 0.01, 0.1)
OUTPUT = "k bigint, at bigint"
PHASES = ("group", "time_scan", "read", "process", "write", "total")  # a task's timings printed per case


def processors():
    """(per-key, vectorized) processors: a row count per key and the key's one timer at its row's
    value; a fired timer emits ``(key, at_ms)``."""
    import numpy as np
    import pyarrow as pa

    from statestore_async.spark.api.processors import StatefulProcessor, VectorizedProcessor

    class PerKey(StatefulProcessor):
        def init(self, handle):
            self.n = handle.value_state("n")

        def handle_rows(self, key, rows, state):
            self.n.update((self.n.get() or 0) + len(rows))
            state.timers.register(rows[0][0])
            return ()

        def handle_expired_timer(self, key, timer, state):
            return ((key[0], timer.at_ms),)

    class Vectorized(VectorizedProcessor):
        state_name = "n"
        state_schema = pa.schema([("n", pa.int64())])

        def process(self, keys, rows, offsets, state, exists):
            self.timers.register(np.arange(keys.num_rows), rows["v"].to_numpy()[offsets[:-1]])
            n = state["n"].fill_null(0).to_numpy() + np.diff(offsets)
            return pa.table({"n": n}), None

        def handle_expired_timers(self, keys, timers, state, exists):
            return state, pa.table({"k": timers["k"], "at": timers["at_ms"]})

    return PerKey(), Vectorized()


def clock_of(now_ms: list[int]):
    """The operator's clock (seconds) reading ``now_ms[0]`` exactly (``int(clock() * 1000)``)."""
    return lambda: (now_ms[0] + 0.5) / 1000


def rows_df(spark, lo: int, hi: int):
    from pyspark.sql import functions as F

    return spark.range(lo, hi, numPartitions=2).select(F.col("id").alias("k"), (F.col("id") + BASE_MS).alias("v"))


def run(spark, api: str, keys: int, rows: int, build_batch: int, repeat: int, work: str) -> dict:
    """Build ``keys`` keys with a timer each, then time the cases; one operator, one daemon."""
    from statestore_async.spark import StatefulOperator, placement

    sockdir = tempfile.mkdtemp(prefix="sst-", dir="/tmp")
    sock = os.path.join(sockdir, "d.sock")
    placement.start_daemon(sock, args=["--log-level", "warning"])
    now = [BUILD_MS]
    counts: list[int] = []

    def sink(df, batch_id):
        counts.append(df.count())

    try:
        per_key, vec = processors()
        op = StatefulOperator("file://" + os.path.join(work, "state"), "timers", ["k"],
                              per_key if api == "per-key" else vec, OUTPUT, 2, socket_path=sock,
                              value_columns=["v"], clock=clock_of(now), time_mode="processing", fence_timeout=600)
        batch = 0
        t = time.perf_counter()
        for lo in range(0, keys, build_batch):
            op.process_batch(rows_df(spark, lo, min(keys, lo + build_batch)), batch, sink)
            batch += 1
        build_s = time.perf_counter() - t
        small = rows_df(spark, keys - rows, keys)
        fired = 0  # timers BASE_MS .. BASE_MS + fired - 1 have fired
        now[0] = BASE_MS - 1
        op.process_batch(small, batch, sink)  # warm-up: nothing due
        batch += 1
        cases = []
        for frac in FRACTIONS:
            due = round(keys * frac)
            totals, tasks_ms, scans, calls, slowest = [], [], [], [], []
            for _ in range(repeat):
                now[0] = BASE_MS + fired + due - 1
                counts.clear()
                p = op.process_batch(small, batch, sink)
                batch += 1
                fired += due
                if counts != [due]:
                    raise AssertionError(f"{api}, {keys:,} keys: {counts} timers fired, expected {due}")
                totals.append(p.total)
                tasks = list(p.tasks.values())
                tasks_ms.append(max((t.get("total", 0.0) for t in tasks), default=0.0))
                slowest.append(max(tasks, key=lambda t: t.get("total", 0.0), default={}))
                scans.append(max((t.get("time_scan", 0.0) for t in tasks), default=0.0))
                calls.append(max((t.get("call", t.get("process", 0.0)) for t in tasks), default=0.0))
            cases.append({"frac": frac, "due": due, "ms": statistics.median(totals) * 1000,
                          "all_ms": [round(x * 1000) for x in totals], "task_ms": statistics.median(tasks_ms) * 1000,
                          "scan_ms": statistics.median(scans) * 1000, "call_ms": statistics.median(calls) * 1000,
                          "phases": {k: round(statistics.median(t.get(k, 0.0) for t in slowest) * 1000, 1)
                                     for k in PHASES}})
        if fired >= keys - rows:
            raise AssertionError("the measured batches fired timers of the keys that have rows")
        return {"api": api, "keys": keys, "build_s": build_s, "cases": cases}
    finally:
        placement.stop_daemon(sock)
        shutil.rmtree(sockdir, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="100k and 10k keys")
    ap.add_argument("--keys", default=None, help="comma-separated key counts (default 1000000,100000)")
    ap.add_argument("--apis", default="per-key,vectorized")
    ap.add_argument("--rows", type=int, default=1000, help="input rows of every measured batch")
    ap.add_argument("--build-batch", type=int, default=250_000, help="keys per batch while building the state")
    ap.add_argument("--repeat", type=int, default=3, help="measured batches per case (their median)")
    a = ap.parse_args()
    sizes = [int(k) for k in (a.keys or ("100000,10000" if a.quick else "1000000,100000")).split(",")]
    apis = a.apis.split(",")
    bad = [x for x in apis if x not in ("per-key", "vectorized")]
    if bad:
        ap.error(f"unknown APIs {bad}: per-key, vectorized")
    if any(round(k * sum(FRACTIONS)) * a.repeat + a.rows >= k for k in sizes):
        ap.error("too few keys for the cases: the measured batches would fire the timers of the keys with rows")

    work = tempfile.mkdtemp(prefix="bench-timers-")
    spark = local_session("bench_timers", work, driver_memory="4g")
    from pyspark import cloudpickle
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers get the processors by value
    results = []
    try:
        for keys in sizes:
            for api in apis:
                d = os.path.join(work, f"{api}-{keys}")
                os.makedirs(d)
                r = run(spark, api, keys, a.rows, a.build_batch, a.repeat, d)
                results.append(r)
                print(f"# {api} {keys:,} keys: state built in {r['build_s']:.0f}s; batch ms per case "
                      f"{[(c['due'], c['all_ms']) for c in r['cases']]}; the slower task's ms (median): "
                      f"{[(c['due'], c['phases']) for c in r['cases']]}", flush=True)
                shutil.rmtree(d, ignore_errors=True)
    finally:
        spark.stop()
        shutil.rmtree(work, ignore_errors=True)

    print()
    print(f"timer firing: every key holds a timer; {a.rows:,} input rows per batch; local[2], 2 partitions; "
          f"median of {a.repeat} batches per case (load average at the end: {os.getloadavg()[0]:.1f})")
    print("| API | keys | due timers | batch ms | − none due | µs / due timer | task ms | − none due | "
          "µs / due timer | task: scan + write ms | task: calls ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        none, none_task = r["cases"][0]["ms"], r["cases"][0]["task_ms"]
        for c in r["cases"]:
            extra, extra_task = c["ms"] - none, c["task_ms"] - none_task
            per = f"{extra * 1000 / c['due']:,.1f}" if c["due"] else "–"
            per_task = f"{extra_task * 1000 / c['due']:,.1f}" if c["due"] else "–"
            print(f"| {r['api']} | {r['keys']:,} | {c['due']:,} ({c['frac']:.1%}) | {c['ms']:,.0f} | {extra:+,.0f} | "
                  f"{per} | {c['task_ms']:,.0f} | {extra_task:+,.0f} | {per_task} | {c['scan_ms']:,.1f} | "
                  f"{c['call_ms']:,.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
