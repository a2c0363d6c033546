"""Gap-based sessionization by event time (issue 19) through our operator and Spark's two stateful
Python APIs, in one run, one table.

    .venv/bin/python benchmarks/bench_sessions.py                  # 100k users, 1 + 3 measured batches
    .venv/bin/python benchmarks/bench_sessions.py --quick          # 10k users, 1 + 2 batches
    .venv/bin/python benchmarks/bench_sessions.py --users 200000 --repeat 3

The stream is ``statestore_async.testing.sessions.generate``: per batch about half the users are
active with 1-3 events each, 15% send an out-of-order event and 5% a late one (users go quiet and
come back); 30.5 s session gap, 20 s watermark delay. One parquet file per batch read by the file
source (``maxFilesPerTrigger=1``, ``Trigger.AvailableNow``), plus a trailing empty file (a batch
whose watermark closes what the last events left open); local[2], 2 state partitions / shuffle
partitions.

  ours per-key   StatefulOperator(time_mode="event") + testing.sessions.session_processor (a Python
                 call per user with rows and per due timer; value state + event-time timers)
  ours vectorized  the same operator + testing.sessions.vectorized_session_processor (numpy over the
                 partition's users; those with several open sessions take a Python path)
  AIPWS          applyInPandasWithState + GroupStateTimeout.EventTimeTimeout (RocksDB state store)
  TWS            transformWithStateInPandas, time mode EventTime, event-time timers (RocksDB)

Figure: input rows / the time of every batch after the first data batch (Spark's
``durationMs.triggerExecution``, the batches without data included: Spark's peers fire their
timers in such batches), the median over ``--repeat`` runs. Every run's output is checked against
the plain-Python batch computation (``sessions_of``): every peer's sink is one aggregate in the JVM
(``checksum_into``: the count of the batch's sessions and the sum of Spark's xxhash64 of each), so
no peer pays for moving its output to the driver; "correct" means the run's count and hash sum are
those of the expected sessions (a session lost, doubled or changed shows).

``ours-none`` / ``ours-vec-none``: the same with ``materialize="none"`` (the sink's one action runs
the stateful stage: one Spark job per batch instead of the stage's and the sink's; see docs/SPARK.md).

Before the measured runs, each of our peers and the floor runs once on a smaller stream
(``--warmup-users``, figures discarded): Spark's JIT compiler warms up over several batches, and
without it whichever peer ran first would pay for it. AIPWS and TWS run long enough to run warm.

``--peers ...,floor`` adds Spark's part of our batch alone (``spark_floor``: the same stream routed
and shuffled as ours, into a ``mapInArrow`` that only counts rows, noop sink; no state): its
rows/s over a peer's is the most any version of ours can be ahead of that peer.

``--overhead`` adds the cost of event time itself: our operator with a trivial per-key counter over
the same files with ``time_mode="none"`` and with ``time_mode="event"`` (the Observation of max
event time and late rows, the late-row filter, the watermark in the manifest), median batch ms.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import charts
from local_spark import local_session

from statestore_async.testing import sessions as S

PARTITIONS = [2]  # state partitions (ours) and spark.sql.shuffle.partitions (the peers): --partitions
PEERS = {"ours": "ours per-key", "ours-vec": "ours vectorized",
         "ours-none": "ours per-key, materialize='none'", "ours-vec-none": "ours vectorized, materialize='none'",
         "ours-off": "ours per-key, time_only_batches='off'",
         "aipws": "AIPWS applyInPandasWithState",
         "tws": "TWS transformWithStateInPandas", "floor": "Spark floor (routing + no-op mapInArrow)"}


def run_query(df, ckpt: str, sink, timeout: int) -> list[dict]:
    """Run to the end (AvailableNow); every batch's progress, the data-less ones included."""
    q = (df.writeStream.outputMode("update").foreachBatch(sink).option("checkpointLocation", ckpt)
         .trigger(availableNow=True).start())
    q.awaitTermination(timeout)
    if q.isActive:
        q.stop()
        raise TimeoutError(f"not done after {timeout}s")
    if q.exception() is not None:
        raise RuntimeError(str(q.exception())[:2000])
    return list(q.recentProgress)


def figure(progress: list[dict]) -> dict:
    """rows/s over the batches after the first data batch (which warms the query up)."""
    first = next((i for i, p in enumerate(progress) if p["numInputRows"]), 0)
    measured = progress[first + 1:]
    rows = sum(p["numInputRows"] for p in measured)
    ms = sum(p["durationMs"].get("triggerExecution", 0) for p in measured)
    data = [p["durationMs"].get("triggerExecution", 0) for p in measured if p["numInputRows"]]
    return {"rows_s": rows / ms * 1000 if ms else 0.0, "rows": rows, "batches": len(measured),
            "data_batch_ms": statistics.median(data) if data else 0}


def checked(out: list[tuple[int, int]], expected: tuple[int, int]) -> bool | str:
    got = (sum(n for n, _ in out), sum(h for _, h in out))
    return got == expected or f"{got[0]} sessions, expected {expected[0]} (or another hash sum)"


def ours(spark, src: str, work: str, stream: S.SessionStream, timeout: int, vectorized: bool = False,
         materialize: str = "auto", time_only: str = "auto") -> dict:
    from statestore_async.spark.shared import placement

    sockdir = tempfile.mkdtemp(prefix="ssb-", dir="/tmp")
    sock = os.path.join(sockdir, "d.sock")
    placement.start_daemon(sock, args=["--log-level", "warning"])
    try:
        op = S.session_operator("file://" + os.path.join(work, "state"), "sessions", stream.gap_ms, stream.delay_ms,
                                socket_path=sock, fence_timeout=120, vectorized=vectorized,
                                materialize=materialize, time_only_batches=time_only, num_partitions=PARTITIONS[0])
        out: list = []
        prog = run_query(S.read_stream(spark, src), os.path.join(work, "ckpt"), op.foreach_batch(S.checksum_into(out)),
                         timeout)
        fig = figure(prog)
        fig["out"] = out
        hist = op.history[1:] or op.history
        fig["phases"] = {ph: round(statistics.median(getattr(p, ph) for p in hist) * 1000) for ph in
                         ("plan", "compute", "fence", "manifest", "sink", "total")} if hist else {}
        tasks = [t for p in hist for t in p.tasks.values()]
        fig["task_ms"] = {k: round(statistics.median(t.get(k, 0) for t in tasks) * 1000) for k in
                          ("group", "time_scan", "read", "decode", "call", "process", "write", "total")} if tasks else {}
        fig["timers_fired"] = statistics.median(t.get("timers_fired", 0) for t in tasks) if tasks else 0
        after = [p.time_only_after for p in hist if p.time_only_after is not None]
        fig["time_only_ms"] = round(statistics.median(p.total for p in after) * 1000) if after else 0
        if after:
            fig["time_only_phases"] = {ph: round(statistics.median(getattr(p, ph) for p in after) * 1000) for ph in
                                       ("plan", "compute", "fence", "manifest", "sink", "total")}
            ttasks = [t for p in after for t in p.tasks.values()]
            fig["time_only_task_ms"] = {k: round(statistics.median(t.get(k, 0) for t in ttasks) * 1000) for k in
                                        ("time_scan", "read", "decode", "call", "process", "write", "total")}
        return fig
    finally:
        placement.stop_daemon(sock)
        shutil.rmtree(sockdir, ignore_errors=True)


def spark_peer(spark, src: str, work: str, stream: S.SessionStream, timeout: int, build) -> dict:
    key = "spark.sql.streaming.stateStore.providerClass"
    spark.conf.set(key, S.ROCKSDB_PROVIDER)
    try:
        out: list = []
        prog = run_query(build(S.read_stream(spark, src), stream.gap_ms, stream.delay_ms), os.path.join(work, "ckpt"),
                         S.checksum_into(out), timeout)
    finally:
        spark.conf.unset(key)
    fig = figure(prog)
    fig["out"] = out
    return fig


def spark_floor(spark, src: str, work: str, timeout: int) -> dict:
    """Spark's part of our batch alone: the same stream, each batch routed as our operator routes
    it (``with_routing``: the key group, the route, the shuffle to ``--partitions``) into a
    ``mapInArrow`` that only counts its rows, written to the noop sink. No state, no event time, no
    output to materialize: a bound no version of ours can pass."""
    import pyarrow as pa

    from statestore_async.spark.driver.materialize import arrow_batch_bytes
    from statestore_async.spark.shared.routing import with_routing

    def count(batches):
        yield pa.RecordBatch.from_pydict({"n": [sum(b.num_rows for b in batches)]})

    def sink(df, batch_id):
        with arrow_batch_bytes(df.sparkSession, None):  # as the operator runs its stage
            (with_routing(df, ["user"], PARTITIONS[0], 4096, columns=["user", "et"]).mapInArrow(count, "n long")
             .write.format("noop").mode("overwrite").save())

    fig = figure(run_query(S.read_stream(spark, src), os.path.join(work, "ckpt"), sink, timeout))
    fig["out"] = None
    return fig


def overhead(spark, src: str, work: str, timeout: int) -> dict[str, float]:
    """Median batch ms (after the first) of a trivial per-key counter, without and with event time."""
    from datetime import timedelta

    from statestore_async.spark import StatefulOperator, placement
    from statestore_async.spark.api.examples import CountSum

    sockdir = tempfile.mkdtemp(prefix="ssb-", dir="/tmp")
    sock = os.path.join(sockdir, "d.sock")
    placement.start_daemon(sock, args=["--log-level", "warning"])
    res = {}
    try:
        for mode in ("none", "event"):
            kw = {"time_mode": mode}
            if mode == "event":
                kw.update(event_time_column="et", watermark_delay=timedelta(seconds=20))
            d = os.path.join(work, f"overhead-{mode}")
            op = StatefulOperator("file://" + os.path.join(d, "state"), "o", ["user"], CountSum(),
                                  "user string, count bigint, sum bigint", 2, socket_path=sock, value_columns=["et"],
                                  **kw)
            run_query(S.read_stream(spark, src), os.path.join(d, "ckpt"),
                      op.foreach_batch(lambda df, b: df.write.format("noop").mode("overwrite").save()), timeout)
            res[mode] = statistics.median(p.total * 1000 for p in op.history[1:] if p.partitions_committed)
    finally:
        placement.stop_daemon(sock)
        shutil.rmtree(sockdir, ignore_errors=True)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="10k users, 1 + 2 batches")
    ap.add_argument("--users", type=int, default=None, help="users (default 100,000)")
    ap.add_argument("--batches", type=int, default=None, help="measured batches after the first (default 3)")
    ap.add_argument("--repeat", type=int, default=1, help="runs of every peer; the figure is their median")
    ap.add_argument("--peers", default="ours,ours-vec,aipws,tws")
    ap.add_argument("--overhead", action="store_true", help="also measure what event time adds per batch")
    ap.add_argument("--timeout", type=int, default=3600)
    ap.add_argument("--partitions", type=int, default=2,
                    help="state partitions of ours and spark.sql.shuffle.partitions of the peers (default 2)")
    ap.add_argument("--warmup-users", type=int, default=None,
                    help="users of the warm-up stream each of our peers and the floor first run on, figures discarded "
                         "(default 20,000; 0: none). Spark's JIT warms up over several batches: without it the "
                         "first peer pays for it")
    charts.add_chart_args(ap, "bench_sessions")
    a = ap.parse_args()
    users = a.users or (10_000 if a.quick else 100_000)
    batches = 1 + (a.batches or (2 if a.quick else 3))
    peers = a.peers.split(",")
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        ap.error(f"unknown peers {unknown}; choose from {sorted(PEERS)}")

    work = tempfile.mkdtemp(prefix="bench-sessions-")
    PARTITIONS[0] = a.partitions
    spark = local_session("bench_sessions", work, conf=[("spark.sql.shuffle.partitions", str(a.partitions))])
    from pyspark import cloudpickle

    cloudpickle.register_pickle_by_value(S)  # the workers import it by value (no install needed)
    results: dict[str, list[dict]] = {}
    try:
        t = time.perf_counter()
        stream = S.generate(users=users, batches=batches, seed=1)
        src = os.path.join(work, "in")
        S.write_batches(stream, src)
        sessions = S.sessions_of(stream)
        expected = S.checksum(sessions)
        n_rows = sum(map(len, stream.batches))
        print(f"# {users:,} users, {batches} batches, {n_rows:,} events ({sum(stream.late()):,} late), "
              f"{len(sessions):,} sessions; written in {time.perf_counter() - t:.1f}s", flush=True)
        runs = {
            "ours": lambda d: ours(spark, src, d, stream, a.timeout),
            "ours-vec": lambda d: ours(spark, src, d, stream, a.timeout, vectorized=True),
            "ours-none": lambda d: ours(spark, src, d, stream, a.timeout, materialize="none"),
            "ours-off": lambda d: ours(spark, src, d, stream, a.timeout, time_only="off"),
            "ours-vec-none": lambda d: ours(spark, src, d, stream, a.timeout, vectorized=True, materialize="none"),
            "aipws": lambda d: spark_peer(spark, src, d, stream, a.timeout, S.apply_in_pandas_with_state),
            "tws": lambda d: spark_peer(spark, src, d, stream, a.timeout, S.transform_with_state_in_pandas),
            "floor": lambda d: spark_floor(spark, src, d, a.timeout),
        }
        warm_users = a.warmup_users if a.warmup_users is not None else (0 if a.quick else 20_000)
        warm = [p for p in dict.fromkeys(peers) if p not in ("aipws", "tws")]  # those two run long, on a warm JVM
        if warm_users and warm:
            t = time.perf_counter()
            wstream = S.generate(users=warm_users, batches=3, seed=2)
            wsrc = os.path.join(work, "warm-in")
            S.write_batches(wstream, wsrc)
            for short in warm:
                d = os.path.join(work, f"warm-{short}")
                os.makedirs(d)
                {"ours": lambda: ours(spark, wsrc, d, wstream, a.timeout),
                 "ours-vec": lambda: ours(spark, wsrc, d, wstream, a.timeout, vectorized=True),
                 "ours-none": lambda: ours(spark, wsrc, d, wstream, a.timeout, materialize="none"),
                 "ours-off": lambda: ours(spark, wsrc, d, wstream, a.timeout, time_only="off"),
                 "ours-vec-none": lambda: ours(spark, wsrc, d, wstream, a.timeout, vectorized=True, materialize="none"),
                 "floor": lambda: spark_floor(spark, wsrc, d, a.timeout)}[short]()
                shutil.rmtree(d, ignore_errors=True)
            print(f"# warm-up ({warm_users:,} users, {', '.join(warm)}): {time.perf_counter() - t:.0f}s", flush=True)
        for r in range(a.repeat):
            for short in peers:
                d = os.path.join(work, f"{short}-{r}")
                os.makedirs(d)
                t = time.perf_counter()
                try:
                    fig = runs[short](d)
                    out = fig.pop("out")
                    fig["correct"] = checked(out, expected) if out is not None else "n/a (no state)"
                except Exception as exc:
                    fig = {"rows_s": 0.0, "correct": f"error: {str(exc).splitlines()[0][:200]}"}
                fig["wall"] = time.perf_counter() - t
                results.setdefault(short, []).append(fig)
                print(f"  run {r + 1} {PEERS[short]:32s} {fig['rows_s']:>10,.0f} rows/s ({fig.get('batches', 0)} "
                      f"batches, data batch median {fig.get('data_batch_ms', 0):,.0f} ms, wall {fig['wall']:.0f}s, "
                      f"correct={fig['correct']}) {fig.get('phases', '')} tasks {fig.get('task_ms', '')} timers fired per "
                      f"task {fig.get('timers_fired', '')}, time-only batch median {fig.get('time_only_ms', 0)} ms "
                      f"{fig.get('time_only_phases', '')} tasks {fig.get('time_only_task_ms', '')}",
                      flush=True)
                shutil.rmtree(d, ignore_errors=True)
        cost = overhead(spark, src, work, a.timeout) if a.overhead else None
    finally:
        spark.stop()
        shutil.rmtree(work, ignore_errors=True)

    med = {k: statistics.median(f["rows_s"] for f in v) for k, v in results.items()}
    print()
    print(f"sessionization: {users:,} users, 1 warm-up + {batches - 1} measured batches (+ a trailing empty one), "
          f"local[2], {a.partitions} partitions; median of {a.repeat} run(s)")
    print("| peer | rows/s | × AIPWS | × TWS | data batch ms | correct |")
    print("|---|---:|---:|---:|---:|---|")
    for short, figs in results.items():
        rs = med[short]
        ra, rt = med.get("aipws") or 0, med.get("tws") or 0
        print(f"| {PEERS[short]} | {rs:,.0f} | {rs / ra if ra else 0:.1f} | {rs / rt if rt else 0:.1f} | "
              f"{statistics.median(f.get('data_batch_ms', 0) for f in figs):,.0f} | "
              f"{', '.join(str(f['correct']) for f in figs)} |")
    if charts.chart_path(a):
        charts.bar_charts(charts.chart_path(a), f"Event-time sessions: {users:,} users, local[2]", [
            charts.Panel("rows/s (log scale)", ["median of the runs"], {PEERS[k]: [med[k] or None] for k in results},
                         "rows/s", log=True)],
            charts.measured_caption(f"1 warm-up + {batches - 1} measured batches, median of {a.repeat} run(s); "
                                    "every peer's sessions checked"), width=9.0)
    if cost:
        print(f"\nevent time's cost per batch (trivial counter, same files): time_mode='none' {cost['none']:,.0f} ms, "
              f"'event' {cost['event']:,.0f} ms (+{cost['event'] - cost['none']:,.0f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
