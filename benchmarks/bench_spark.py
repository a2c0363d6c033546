"""Workload W (see ../shared/PEERS.md) through our operator and the peers, in one run, one table.

    .venv/bin/python benchmarks/bench_spark.py            # K = 100k and 1M, B = 1M rows/batch, 1+5 batches
    .venv/bin/python benchmarks/bench_spark.py --quick    # K = 20k, B = 200k, 1+2 batches
    .venv/bin/python benchmarks/bench_spark.py --keys 10000 --rows 20000 --conf spark.some.setting=value

Rows ``(key 'k%08d', value int64 in [0, 1000))``, parquet input (2 files per batch) read by the file
source with ``maxFilesPerTrigger=2`` and ``Trigger.AvailableNow``; local[2], 2 state partitions;
state (count, sum) per key; every batch emits ``(key, count, sum)`` for its keys; sink ``noop``.
Figure: input rows / ``durationMs.triggerExecution``, median of the measured batches. Beside it, the
CPU seconds per batch each streaming peer's query took, by process (Spark's JVM, PySpark's Python
workers, our daemon, P4's redis, this driver process; from /proc, over all of the query's batches):
on the 2 cores of local[2] a batch is mostly bound by the CPU all of them share, so this says where
a peer's time goes and moves less with the machine's load than rows/s.

  ours per-key     StatefulOperator + examples.CountSum (a Python call per key, ValueState)
  ours vectorized  StatefulOperator + examples.VectorizedCountSum (numpy per partition)
  ours … pre-agg   StatefulOperator(pre_aggregate=[count, sum]) + examples.PreAggregatedCountSum: the
                   JVM combines each key's rows of the batch before they cross to Python
  ours … sink job  ``ours-none`` / ``ours-pre-none`` / ``ours-vec-none``: the same with the sink
                   ``write_sink("noop")``, marked as reading its output once, so that the default
                   ``materialize="auto"`` is ``"none"`` (the sink's write runs the stateful stage: one
                   Spark job per batch, not a local checkpoint and then the sink's job)
  P1 hdfs          Spark groupBy(key).agg(count, sum), HDFSBackedStateStoreProvider (default)
  P1 rocksdb+cl    the same, RocksDBStateStoreProvider with changelog checkpointing
  P2 pandas        applyInPandasWithState (RocksDB), on ``--p2-rows`` rows per batch (it is slow)
  P4 redis         foreachBatch + mapInArrow, pyarrow pre-aggregation, MGET/MSET to a local
                   redis-server (not durable, not exactly-once)

Not run unless named in ``--peers``: ``floor-vec`` and ``floor-pre``, Spark's part of our operator
alone — each batch's files read as a static DataFrame, our routing shuffle (``floor-pre``: and the
pre-aggregation), handed to a Python function that only counts the rows, noop write. No state, no
streaming bookkeeping: a bound that neither ``ours vectorized`` nor ``ours … pre-agg`` can pass.
``floor-pre-out``: ``floor-pre`` whose Python function returns its rows (one per key, the schema of
ours: key, count, sum), so Spark also carries the output back from Python to the JVM as it does for
ours — the tighter bound for ``ours … pre-agg``.
A floor peer may be named twice (``--peers floor-pre,ours-pre,floor-pre,p1``: before and after ours,
against the machine's drift); the split below takes the median of all its measured batches.
Any other peer may be named more than once too (``--peers ours-vec,p1,p1,ours-vec``): the order of
peers matters here — the JVM's JIT is still improving after one warm-up round, and the peer that
runs second in the measured round has measured up to ~25% faster than the same peer run first —
so running each peer before and after the other is fairer; its figure (and the ratios) are then the
median of all its measured batches, with each run's own figure beside it.
With a floor peer beside ours, each of our measured batches is printed split: the batch
(``triggerExecution``), Spark's streaming bookkeeping around ``foreachBatch`` (the batch less
``addBatch``: offsets, WAL, commit log — P1 pays it too), and ours over the floor (``addBatch`` less
the floor: our own time per batch — planning, the tasks' state work and commit, fence, manifest,
the sink's job), beside ``foreachBatch``'s phases (with ``materialize="none"`` the sink's job is in
``compute``, and ``sink`` is its part of it); with P1 in the run, then the most that peer could reach
if our own time were nothing (P1's batch over the floor plus the bookkeeping).
``--split`` measures that figure without the streaming query's noise: each batch's files go, back
to back in a shuffled order, through ``floor-pre-out`` and through ours with ``pre_aggregate`` called
directly (``process_batch`` on the same static DataFrame, a noop sink: a plain function with
``materialize="checkpoint"``, and ``write_sink("noop")`` under the default ``"auto"``, which then
keeps nothing), and each of ours is taken less that batch's floor; it prints those per batch, their
medians, our phases and the CPU seconds per batch each took by process (no P1: it has no static form).
It also runs the floor with its output kept as our default keeps it for a plain sink function in
local mode (a local checkpoint, its own job, then the sink's job reading it): what that costs Spark
alone, and ours with ``"checkpoint"`` over that floor. ``--split per-key``: the same for ours
per-key against ``floor-per-key``.
``floor-per-key``: ``floor-vec`` whose Python function does what any per-key Python API must:
groups the rows by key, makes them tuples, calls ``examples.CountSum``'s body once per key with a
dict in place of the store, and returns one row per key — the bound for ``ours per-key`` (with the
garbage collector paused and the tuples made a chunk of keys at a time, as ours does).
``floor-jvm``: the same harness with Spark's own ``groupBy(key).agg(count, sum)`` in place of our
routing — Spark aggregates each input task's rows before one shuffle by its hash of the key, as
P1 does; our routing by key group has to shuffle every row first. ``floor-jvm`` over ``floor-pre``
is what that costs.

The JVM is shared by every peer of a run. Its JIT compiler warms up over several batches (a batch
of the same plan runs ~2x slower on a cold JVM), so whichever peer ran first would pay for it: unless
``--warmup-rounds 0``, each selected peer first runs once on a smaller input (``--warmup-rows``, its
figures discarded), then every peer is measured on a JVM warmed by all of them.

Each run's final state is checked against the input (keys, total count, total sum) where it can be
read back (ours: ``load_state``; P1: Spark's ``statestore`` reader; P4: Redis).
"""
from __future__ import annotations

import argparse
import itertools
import os
import shutil
import statistics
import sys
import tempfile
import time

import charts
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from local_spark import local_session

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

OUT = "key string, count bigint, sum bigint"


def gen(folder: str, keys: int, rows: int, batches: int) -> dict:
    """Write the input; returns the oracle summary {keys, count, sum}."""
    os.makedirs(folder, exist_ok=True)
    seen = np.zeros(keys, dtype=bool)
    total = 0
    base = time.time() - 100_000
    for b in range(batches):
        rng = np.random.Generator(np.random.PCG64(1000 + b))
        k = rng.integers(0, keys, rows)
        v = rng.integers(0, 1000, rows)
        seen[k] = True
        total += int(v.sum())
        names = pa.array([f"k{i:08d}" for i in k.tolist()], pa.string())
        t = pa.table({"key": names, "value": pa.array(v, pa.int64())})
        for i, part in enumerate((t.slice(0, rows // 2), t.slice(rows // 2))):
            path = os.path.join(folder, f"b{b:04d}-{i}.parquet")
            pq.write_table(part, path)
            os.utime(path, (base + 10 * b + i,) * 2)
    return {"keys": int(seen.sum()), "count": rows * batches, "sum": total}


# the processes a run uses, by role, from their command lines (``cpu_seconds``)
ROLES = (("daemon", "statestore_async.cli serve"), ("python", "pyspark.daemon"), ("python", "pyspark/worker"),
         ("redis", "redis-server"))


def cpu_seconds() -> dict[int, tuple[str, float]]:
    """pid -> (role, CPU seconds so far: user + system, every thread) of this process (``driver``)
    and the processes it started, directly or not: Spark's JVM (``jvm``), PySpark's Python workers
    (``python``), our daemon (``daemon``), P4's ``redis``. From /proc (Linux; empty elsewhere)."""
    tick = os.sysconf("SC_CLK_TCK")
    me = os.getpid()
    seen: dict[int, tuple[int, bytes, float]] = {}  # pid -> (parent, command line, CPU seconds)
    for name in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        seen[int(name)] = (int(fields[1]), cmdline, (int(fields[11]) + int(fields[12])) / tick)

    def ours(pid: int) -> bool:
        while pid > 1 and pid in seen:
            if pid == me:
                return True
            pid = seen[pid][0]
        return False

    out: dict[int, tuple[str, float]] = {}
    for pid, (_, cmdline, t) in seen.items():
        if not ours(pid):
            continue
        argv = cmdline.split(b"\0")
        cmd = b" ".join(argv).decode(errors="replace")
        if pid == me:
            role = "driver"
        elif os.path.basename(argv[0]) == b"java":
            role = "jvm"
        else:
            role = next((r for r, needle in ROLES if needle in cmd), "")
        if role:
            out[pid] = (role, t)
    return out


def cpu_used(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds by role between two ``cpu_seconds`` (a process started meanwhile from 0; one that
    ended meanwhile is not counted)."""
    used: dict[str, float] = {}
    for pid, (role, t) in after.items():
        used[role] = used.get(role, 0.0) + t - before.get(pid, (role, 0.0))[1]
    return used


def run_query(spark, src: str, ckpt: str, build, timeout: float) -> tuple[list[dict], dict[str, float]]:
    """The progress of each batch that had input rows, and the CPU seconds by role the query took."""
    df = spark.readStream.schema("key string, value bigint").option("maxFilesPerTrigger", 2).parquet(src)
    before = cpu_seconds()
    q = build(df).option("checkpointLocation", ckpt).trigger(availableNow=True).start()
    q.awaitTermination(timeout)
    if q.isActive:
        q.stop()
    cpu = cpu_used(before, cpu_seconds())
    if q.exception() is not None:
        raise RuntimeError(str(q.exception())[:2000])
    return [p for p in q.recentProgress if p["numInputRows"]], cpu


def figure(query: tuple[list[dict], dict[str, float]], warmup: int = 1) -> dict:
    """``run_query``'s result as figures: rows/s (median of the measured batches), batch times, P1's
    commit, ``durationMs``; ``cpu``: CPU seconds per batch by role, over all of the query's batches
    (the warm-up batch included: the processes are sampled before and after the whole query)."""
    progress, cpu = query
    measured = progress[warmup:] or progress
    rates = [p["numInputRows"] / max(p["durationMs"]["triggerExecution"], 1) * 1000 for p in measured]
    commit = [op.get("commitTimeMs", 0) for p in measured for op in p.get("stateOperators", [])]
    return {"rows_s": statistics.median(rates) if rates else 0.0, "batches": len(measured), "rates": rates,
            "batch_list": [p["durationMs"]["triggerExecution"] for p in measured],
            "batch_ms": statistics.median(p["durationMs"]["triggerExecution"] for p in measured) if measured else 0,
            "commit_ms": statistics.median(commit) if commit else None,
            "duration_ms": {k: statistics.median(p["durationMs"].get(k, 0) for p in measured)
                            for k in measured[0]["durationMs"]} if measured else {},
            "cpu": {role: t / len(progress) for role, t in cpu.items()} if progress else {}}


def cpu_text(cpu: dict[str, float]) -> str:
    """``cpu`` (seconds per batch by role) as ``4.21 (jvm 2.90, python 0.48, daemon 0.61, driver 0.22)``."""
    if not cpu:
        return "-"
    order = ("jvm", "python", "daemon", "redis", "driver")
    parts = ", ".join(f"{r} {cpu[r]:.2f}" for r in order if cpu.get(r, 0) >= 0.005)
    return f"{sum(cpu.values()):.2f} ({parts})"


def merge_repeats(results: list[dict]) -> list[dict]:
    """One figure per (K, peer): a peer named more than once in ``--peers`` (``ours-vec,p1,p1,ours-vec``:
    each runs once before and once after the other, so neither always gets the JVM the other has
    warmed further) gets the median of all its measured batches; the ratios use those."""
    groups: dict[tuple[int, str], list[dict]] = {}
    for r in results:
        groups.setdefault((r["K"], r["peer"]), []).append(r)
    out = []
    for (K, peer), rs in groups.items():
        if len(rs) == 1 or not all(r.get("rates") for r in rs):  # a floor peer: the split takes all its batches
            out.extend(rs)
            continue
        m = dict(rs[-1])
        m.update(rows_s=statistics.median(x for r in rs for x in r["rates"]),
                 batches=sum(r["batches"] for r in rs),
                 batch_ms=statistics.median(x for r in rs for x in r["batch_list"]),
                 correct=all(r.get("correct") is True for r in rs),
                 peer=f"{peer} (x{len(rs)}: " + " / ".join(f"{r['rows_s']:,.0f}" for r in rs) + ")",
                 ref_name=peer)
        cms = [r["commit_ms"] for r in rs if r.get("commit_ms") is not None]
        m["commit_ms"] = statistics.median(cms) if cms else None
        cpus = [r["cpu"] for r in rs if r.get("cpu")]
        m["cpu"] = {role: statistics.fmean(c.get(role, 0.0) for c in cpus) for role in {x for c in cpus for x in c}}
        if any(r.get("per_batch") for r in rs):  # the split below: every run's batches
            m["per_batch"] = [b for r in rs for b in r.get("per_batch", ())]
        out.append(m)
    return out


def du(path: str) -> tuple[int, int]:
    n = size = 0
    for d, _, files in os.walk(path):
        for f in files:
            n += 1
            size += os.path.getsize(os.path.join(d, f))
    return size, n


def daemon_report(sock: str) -> str:
    """The daemon's peak RSS, its budget and what its registry did (spills, cold loads, evictions)."""
    from statestore_async.client import Client

    with Client(sock, timeout=60) as c:
        st = c.stats()
    pid, reg = st["daemon"]["pid"], st["registry"]
    with open(f"/proc/{pid}/status") as fh:
        peak = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmHWM:"))
    return (f"daemon peak RSS {peak / 2**20:.0f} MiB, budget {reg['memory_budget'] / 2**20:.0f} MiB, counted "
            f"{reg['memory_bytes'] / 2**20:.0f} MiB; spills {reg['spills']}, spilled stores {reg['spilled']}, "
            f"evictions {reg['evictions']}, loads {reg['loads']} (over local files {reg['cold_loads']}); "
            f"flushes of open versions {reg.get('flushes', 0)} ({reg.get('flushed_bytes', 0) / 2**20:.0f} MiB)")


def raw_state_bytes(root: str, operator_id: str) -> int:
    """Keys and values of the final state, in bytes (what a memory budget is compared with)."""
    import asyncio

    from statestore_async.files.loader import load_store
    from statestore_async.files.manifest import list_manifest_versions, read_manifest
    from statestore_async.ids import StoreId
    from statestore_async.objectstore import LocalObjectStore

    async def go() -> int:
        async with LocalObjectStore(root) as st:
            m = await read_manifest(st, operator_id, max(await list_manifest_versions(st, operator_id)))
            total = 0
            for name, refs in m.stores.items():
                for p, ref in enumerate(refs):
                    store, _ = await load_store(st, StoreId(st.uri, operator_id, p, name), ref)
                    total += sum(len(k) + len(v) for k, v in store.items())
            return total
    return asyncio.run(go())


# --- peers ----------------------------------------------------------------------------------------
DAEMON_ARGS: list[str] = []  # extra daemon settings for our peers (--memory-budget)


def ours(spark, src, work, processor, oracle, timeout, pre_aggregate=None, sink_once=False):
    """Our operator with the default ``materialize="auto"``; its sink writes to ``noop``, as an
    unmarked function (the output is kept in a local checkpoint, then the sink's job reads it) or,
    ``sink_once``, as ``write_sink("noop")``, marked as reading the output once (its write runs the
    stateful stage: one job)."""
    from statestore_async.spark import StatefulOperator, load_state, placement, write_sink

    sockdir = tempfile.mkdtemp(prefix="ssb-", dir="/tmp")
    sock = os.path.join(sockdir, "d.sock")
    placement.start_daemon(sock, args=["--log-level", "warning", *DAEMON_ARGS])
    root = os.path.join(work, "state")
    try:
        op = StatefulOperator("file://" + root, "w", ["key"], processor, OUT, 2, 4096, socket_path=sock,
                              fence_timeout=120, pre_aggregate=pre_aggregate)
        sink = write_sink("noop", mode="overwrite") if sink_once else (
            lambda df, b: df.write.format("noop").mode("overwrite").save())
        query = run_query(spark, src, os.path.join(work, "ckpt"),
                          lambda df: df.writeStream.foreachBatch(op.foreach_batch(sink)), timeout)
        fig = figure(query)
        prog = query[0]
        hist = op.history[1:] or op.history
        fig["commit_ms"] = statistics.median(p.fence * 1000 for p in hist) if hist else None
        fig["phases"] = {ph: round(statistics.median(getattr(p, ph) for p in hist) * 1000) for ph in
                         ("plan", "compute", "fence", "manifest", "sink", "total")} if hist else {}
        # per measured batch: the foreachBatch call's phases (ms), for the split against the floor
        fig["per_batch"] = [{**{ph: round(getattr(p, ph) * 1000) for ph in ("plan", "compute", "fence", "manifest",
                                                                            "sink", "total")},
                             "trigger": pr["durationMs"]["triggerExecution"], "add": pr["durationMs"]["addBatch"]}
                            for p, pr in zip(hist, prog[-len(hist):])]
        tasks = [t for p in hist for t in p.tasks.values()]
        fig["task_ms"] = {k: round(statistics.median(t.get(k, 0) for t in tasks) * 1000) for k in
                          ("group", "read", "process", "write", "total")} if tasks else {}
        if DAEMON_ARGS:
            print(f"#   {daemon_report(sock)}; raw state {raw_state_bytes(root, 'w') / 2**20:.0f} MiB", flush=True)
        state = {k[0]: v for (n, k), v in load_state("file://" + root, "w").items()}
        fig["correct"] = (len(state), sum(c for c, _ in state.values()), sum(s for _, s in state.values())) == (
            oracle["keys"], oracle["count"], oracle["sum"])
        fig["ckpt"] = du(root)
        return fig
    finally:
        placement.stop_daemon(sock)
        shutil.rmtree(sockdir, ignore_errors=True)


def p1(spark, src, work, oracle, timeout, rocksdb: bool):
    from pyspark.sql import functions as F

    conf = {"spark.sql.streaming.stateStore.providerClass":
            "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider" if rocksdb else
            "org.apache.spark.sql.execution.streaming.state.HDFSBackedStateStoreProvider",
            "spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled": "true" if rocksdb else "false"}
    for k, v in conf.items():
        spark.conf.set(k, v)
    ckpt = os.path.join(work, "ckpt")
    try:
        query = run_query(spark, src, ckpt, lambda df: df.groupBy("key").agg(F.count("*").alias("count"),
                                                                            F.sum("value").alias("sum"))
                          .writeStream.outputMode("update").format("noop"), timeout)
    finally:
        spark.conf.unset("spark.sql.streaming.stateStore.providerClass")
        spark.conf.unset("spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled")
    fig = figure(query)
    try:
        st = spark.read.format("statestore").load(ckpt).select("value.*").agg(
            F.count("*").alias("n"), F.sum("count").alias("c"), F.sum("sum").alias("s")).collect()[0]
        fig["correct"] = (st["n"], st["c"], st["s"]) == (oracle["keys"], oracle["count"], oracle["sum"])
    except Exception as exc:  # the reader is best effort
        fig["correct"] = f"unchecked ({type(exc).__name__})"
    fig["ckpt"] = du(os.path.join(ckpt, "state"))
    return fig


def p2(spark, src, work, timeout):
    import pandas as pd
    from pyspark.sql.streaming.state import GroupStateTimeout

    def fn(key, pdfs, state):
        count, total = state.get if state.exists else (0, 0)
        for pdf in pdfs:
            count += len(pdf)
            total += int(pdf["value"].sum())
        state.update((count, total))
        yield pd.DataFrame({"key": [key[0]], "count": [count], "sum": [total]})

    spark.conf.set("spark.sql.streaming.stateStore.providerClass",
                   "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider")
    try:
        query = run_query(spark, src, os.path.join(work, "ckpt"), lambda df: df.groupBy("key").applyInPandasWithState(
            fn, OUT, "count long, sum long", "Update", GroupStateTimeout.NoTimeout).writeStream.outputMode("update")
            .format("noop"), timeout)
    finally:
        spark.conf.unset("spark.sql.streaming.stateStore.providerClass")
    fig = figure(query)
    fig["correct"] = "unchecked (bounded run)"
    return fig


# floor-per-key's state. Pickled with the task's function, so each task starts with it empty: every
# key misses, and a miss plus an insert costs about what a hit plus an update does (a floor need
# not be exact)
_PER_KEY_STATE: dict = {}


def _count_sum(key, rows, state):
    """``examples.CountSum.handle_rows`` with a dict in place of the store's ``ValueState``."""
    count, total = state.get(key) or (0, 0)
    count += len(rows)
    total += sum(r[0] for r in rows)
    state[key] = (count, total)
    return ((*key, count, total),)


def floor_stage(df, plan: str) -> None:
    """Our operator's Spark side alone on ``df`` (``plan``: "vec", "pre", "pre-out", "per-key"), or
    Spark's own aggregation in the same harness ("jvm"), run as a noop write; see the module
    docstring. ``plan`` + "-ck" ("pre-out-ck", "per-key-ck"): the output is kept by a local
    checkpoint (its own job) and then read by the noop write, as our default keeps it."""
    from pyspark.sql import functions as F

    from statestore_async.spark.driver.materialize import arrow_batch_bytes, materialize_checkpoint
    from statestore_async.spark.shared.routing import KG_COLUMN, ROUTE_COLUMN, with_routing

    keep = plan.endswith("-ck")
    plan = plan.removesuffix("-ck")

    def count(batches):
        yield pa.RecordBatch.from_pydict({"n": [sum(b.num_rows for b in batches)]})

    def rows_out(batches):  # one output row per key, as ours returns for W: Arrow back to the JVM
        for b in batches:
            yield pa.RecordBatch.from_arrays([b.column("key"), b.column("n"), b.column("s")],
                                             names=["key", "count", "sum"])

    def per_key(batches):  # a Python call per key with a dict for its state: no store, no commit
        # with what makes our per-key runtime cheap that any per-key API could do too: the cyclic
        # garbage collector paused, each chunk of keys' row tuples made just before their calls
        # (freed while still in cache), the key column of the output taken from the input
        import gc

        from statestore_async.codecs import arrowcodec
        from statestore_async.spark.task.perkey import PER_KEY_CHUNK

        batches = [b for b in batches if b.num_rows]
        if not batches:
            return
        table = pa.Table.from_batches(batches)
        gc.disable()
        try:
            order, bounds = arrowcodec.group([table["key"]])
            firsts = order[bounds[:-1]]
            key_column = table["key"].take(pa.array(firsts))  # the output's key column (one row per key, in order)
            keys = [(k,) for k in key_column.to_pylist()]
            values = table["value"].take(pa.array(order)).to_numpy().tolist()
            offs = bounds.tolist()
            out = []
            add = out.append
            for first in range(0, len(keys), PER_KEY_CHUNK):
                last = min(len(keys), first + PER_KEY_CHUNK)
                lo = offs[first]
                rows = list(zip(values[lo:offs[last]]))
                for i in range(first, last):
                    add(_count_sum(keys[i], rows[offs[i] - lo:offs[i + 1] - lo], _PER_KEY_STATE))
            cols = list(zip(*itertools.chain.from_iterable(out)))
        finally:
            gc.enable()
        yield pa.RecordBatch.from_arrays([key_column.combine_chunks(), pa.array(cols[1], pa.int64()),
                                          pa.array(cols[2], pa.int64())], names=["key", "count", "sum"])

    aggs = (F.count("*").alias("n"), F.sum("value").alias("s"))
    if plan in ("pre", "pre-out"):
        routed = with_routing(df, ["key"], 2, 4096).groupBy(ROUTE_COLUMN, KG_COLUMN, "key").agg(*aggs)
    elif plan == "jvm":  # spark.sql.shuffle.partitions is 2: one task per state partition, as ours
        routed = df.groupBy("key").agg(*aggs)
    else:
        routed = with_routing(df, ["key"], 2, 4096, columns=["key", "value"])
    with arrow_batch_bytes(df.sparkSession, None):  # as the operator runs its stage
        rows_fn = {"pre-out": rows_out, "per-key": per_key}.get(plan)
        out = routed.mapInArrow(rows_fn, OUT) if rows_fn else routed.mapInArrow(count, "n long")
        if not keep:
            out.write.format("noop").mode("overwrite").save()
            return
        # as the operator's default in local mode: the output kept by a local checkpoint (its own
        # job), then the sink's job reads it
        held = materialize_checkpoint(out)
        try:
            held.result.write.format("noop").mode("overwrite").save()
        finally:
            held.release()


def spark_floor(spark, src, batch_rows: int, plan: str) -> dict:
    """``floor_stage`` on each batch of ``src``: its figure, from the batches after the first."""
    files = sorted(os.path.join(src, f) for f in os.listdir(src) if f.endswith(".parquet"))
    times = []
    for i in range(0, len(files), 2):  # a micro-batch is 2 files (maxFilesPerTrigger)
        t = time.perf_counter()
        floor_stage(spark.read.schema("key string, value bigint").parquet(*files[i:i + 2]), plan)
        times.append(time.perf_counter() - t)
    measured = times[1:] or times
    ms = statistics.median(measured) * 1000
    return {"rows_s": batch_rows / ms * 1000, "batches": len(measured), "batch_ms": ms, "correct": "n/a (no state)",
            "batch_times": [t * 1000 for t in measured]}


def split(spark, src: str, work: str, batches: int, seed: int = 7, api: str = "pre") -> None:
    """``--split``: per batch, the floor (``api`` "pre": the pre-aggregated floor with its rows out,
    ``floor-pre-out``; "per-key": ``floor-per-key``) and ours with that API (``process_batch`` on
    the same static batch, noop sink: a plain function with ``materialize="checkpoint"``, and
    ``write_sink("noop")`` under the default ``"auto"``, which keeps nothing), back to back in a
    shuffled order; prints ours less the floor per batch and the medians, and the CPU seconds each
    took by process (see the module docstring)."""
    import random

    from pyspark.sql import functions as F

    from statestore_async.spark import StatefulOperator, placement, write_sink
    from statestore_async.spark.api.examples import CountSum, PreAggregatedCountSum

    files = sorted(os.path.join(src, f) for f in os.listdir(src) if f.endswith(".parquet"))
    aggs = lambda: [F.count("*").alias("n"), F.sum("value").alias("s")]
    read = lambda i: spark.read.schema("key string, value bigint").parquet(*files[2 * i:2 * i + 2])
    sink = lambda df, b: df.write.format("noop").mode("overwrite").save()

    plan = "pre-out" if api == "pre" else "per-key"

    def floor(i: int, plan: str = plan) -> tuple[float, None]:
        t = time.perf_counter()
        floor_stage(read(i), plan)
        return (time.perf_counter() - t) * 1000, None

    sockdir = tempfile.mkdtemp(prefix="ssb-", dir="/tmp")
    sock = os.path.join(sockdir, "d.sock")
    placement.start_daemon(sock, args=["--log-level", "warning", *DAEMON_ARGS])
    try:
        sinks = {"checkpoint": sink, "none": write_sink("noop", mode="overwrite")}
        ops = {mode: StatefulOperator("file://" + os.path.join(work, f"state-{mode}"), "w", ["key"],
                                      PreAggregatedCountSum() if api == "pre" else CountSum(), OUT, 2, 4096,
                                      socket_path=sock, fence_timeout=120, pre_aggregate=aggs() if api == "pre" else None,
                                      materialize="checkpoint" if mode == "checkpoint" else "auto") for mode in sinks}

        def ours(mode: str, i: int):
            t = time.perf_counter()
            prog = ops[mode].process_batch(read(i), i, sinks[mode])
            return (time.perf_counter() - t) * 1000, prog

        def measured(run, i: int):
            before = cpu_seconds()
            ms, prog = run(i)
            return ms, prog, cpu_used(before, cpu_seconds())

        runs = {"floor": floor, "floor-ck": lambda i: floor(i, plan + "-ck"),
                **{m: (lambda i, m=m: ours(m, i)) for m in ops}}
        rng = random.Random(seed)
        got: dict[str, list] = {k: [] for k in runs}
        for i in range(batches):
            order = list(runs)
            rng.shuffle(order)
            row = {k: measured(runs[k], i) for k in order}
            if i == 0:  # the first batch of each (a cold state, the plans' first run) is not measured
                continue
            for k, v in row.items():
                got[k].append(v)
    finally:
        placement.stop_daemon(sock)
        shutil.rmtree(sockdir, ignore_errors=True)
    fl = [ms for ms, _, _ in got["floor"]]
    fl_ck = [ms for ms, _, _ in got["floor-ck"]]

    def cpu(k: str) -> str:
        roles = sorted({r for _, _, c in got[k] for r in c})
        return ", ".join(f"{r} {statistics.median(c.get(r, 0.0) for _, _, c in got[k]):.2f}" for r in roles)

    what = ("ours (pre_aggregate", "the pre-aggregated floor with its rows out") if api == "pre" else (
        "ours (per-key", "floor-per-key")
    print(f"\n--split: {what[0]}, process_batch on static batches, noop sink) less {what[1]} on the same batch, ms; "
          f"{len(fl)} batches, floor median {statistics.median(fl):,.0f} ms "
          f"(CPU s per batch: {cpu('floor')}), load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    ck_cost = [c - f for c, f in zip(fl_ck, fl)]
    print(f"The same floor kept by a local checkpoint and read by a second job, as our default keeps its output: median "
          f"{statistics.median(fl_ck):,.0f} ms, {statistics.median(ck_cost):,.0f} ms over the floor (min "
          f"{min(ck_cost):,.0f}, max {max(ck_cost):,.0f}; CPU s per batch: {cpu('floor-ck')})")
    print("| materialize (sink) | ours over floor (median) | min | max | over the floor with the same materialize | batch "
          "| plan | compute (job) | fence | manifest | sink | slower task: total / read / write | CPU s per batch |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|")
    for mode in ops:
        over = [ms - f for (ms, _, _), f in zip(got[mode], fl)]
        same = statistics.median(ms - f for (ms, _, _), f in zip(got[mode], fl_ck if mode == "checkpoint" else fl))
        progs = [p for _, p, _ in got[mode]]
        ph = {k: statistics.median(getattr(p, k) * 1000 for p in progs)
              for k in ("total", "plan", "compute", "fence", "manifest", "sink")}
        slow = [max(p.tasks.values(), key=lambda t: t.get("total", 0)) for p in progs]
        tk = "/".join(f"{statistics.median(t.get(k, 0) * 1000 for t in slow):.0f}" for k in ("total", "read", "write"))
        label = "checkpoint (a function)" if mode == "checkpoint" else "auto: none (write_sink)"
        print(f"| {label} | {statistics.median(over):,.0f} | {min(over):,.0f} | {max(over):,.0f} | {same:,.0f} | "
              + " | ".join(f"{ph[k]:,.0f}" for k in ph) + f" | {tk} | {cpu(mode)} |")


def p4(spark, src, work, oracle, timeout):
    from redis_peer import RedisServer

    with RedisServer() as server:
        port = server.port
        r = server.client()

        def part(it):
            import numpy as np
            import pyarrow as pa
            import redis

            batches = [b for b in it if b.num_rows]
            if not batches:
                return
            t = pa.Table.from_batches(batches).group_by("key").aggregate([("value", "count"), ("value", "sum")])
            keys = t["key"].to_pylist()
            cnt = t["value_count"].to_numpy().astype(np.int64)
            sm = t["value_sum"].to_numpy().astype(np.int64)
            cli = redis.Redis(port=port)
            old_c = np.zeros(len(keys), np.int64)
            old_s = np.zeros(len(keys), np.int64)
            step = 20000
            for i in range(0, len(keys), step):
                vals = cli.mget(keys[i:i + step])
                for j, v in enumerate(vals):
                    if v is not None:
                        c, s = np.frombuffer(v, np.int64)
                        old_c[i + j], old_s[i + j] = c, s
            new_c, new_s = old_c + cnt, old_s + sm
            packed = np.stack([new_c, new_s], axis=1).tobytes()
            for i in range(0, len(keys), step):
                cli.mset({k: packed[16 * (i + j):16 * (i + j + 1)] for j, k in enumerate(keys[i:i + step])})
            yield pa.RecordBatch.from_arrays([t["key"].combine_chunks(), pa.array(new_c), pa.array(new_s)],
                                             names=["key", "count", "sum"])

        def batch(df, batch_id):
            df.repartition(2, "key").mapInArrow(part, OUT).write.format("noop").mode("overwrite").save()

        fig = figure(run_query(spark, src, os.path.join(work, "ckpt"), lambda df: df.writeStream.foreachBatch(batch),
                               timeout))
        c = s = 0
        keys = list(r.scan_iter(count=50000))
        n = len(keys)
        for i in range(0, len(keys), 50000):
            for v in r.mget(keys[i:i + 50000]):
                a, b = np.frombuffer(v, np.int64)
                c += int(a)
                s += int(b)
        fig["correct"] = (n, c, s) == (oracle["keys"], oracle["count"], oracle["sum"])
        fig["ckpt"] = None
        r.close()
        return fig


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="K=20k, B=200k, 1+2 batches, P2 on 5k rows")
    ap.add_argument("--keys", default=None, help="comma-separated K values (default 100000,1000000)")
    ap.add_argument("--rows", type=int, default=None, help="rows per batch (default 1,000,000)")
    ap.add_argument("--batches", type=int, default=None, help="measured batches (default 5)")
    ap.add_argument("--p2-rows", type=int, default=None, help="rows per batch for P2 (default 20,000)")
    ap.add_argument("--peers", default="ours,ours-vec,ours-pre,p1,p1-rocks,p2,p4")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--warmup-rounds", type=int, default=1,
                    help="discarded rounds of every peer before measuring (warms the shared JVM; default 1)")
    ap.add_argument("--warmup-rows", type=int, default=None, help="rows per batch of the warm-up rounds (default B/2)")
    ap.add_argument("--memory-budget", default=None, metavar="SIZE",
                    help="our daemon's memory budget (e.g. 64MiB: state larger than memory); prints its peak RSS, "
                         "spills and the raw state size after each of our runs")
    ap.add_argument("--split", nargs="?", const="pre", default=None, choices=("pre", "per-key"),
                    help="instead of the peers: ours with pre_aggregate less the pre-aggregated floor ('pre', the "
                         "default), or ours per-key less floor-per-key ('per-key'), batch by batch, interleaved (see "
                         "the module docstring); --keys takes the first K, --batches the batches")
    ap.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE",
                    help="an extra Spark setting for the session every peer shares (repeatable)")
    charts.add_chart_args(ap, "bench_spark")
    a = ap.parse_args()
    confs = []
    for c in a.conf:
        key, sep, value = c.partition("=")
        if not sep or not key:
            ap.error(f"--conf takes KEY=VALUE, got {c!r}")
        confs.append((key, value))
    if a.memory_budget:
        DAEMON_ARGS.extend(["--memory-budget", a.memory_budget])
    keys = [int(k) for k in (a.keys or ("20000" if a.quick else "100000,1000000")).split(",")]
    rows = a.rows or (200_000 if a.quick else 1_000_000)
    measured = a.batches or (2 if a.quick else 5)
    p2_rows = a.p2_rows or (5_000 if a.quick else 20_000)
    peers = a.peers.split(",")
    if "p4" in peers:  # before Spark starts: on a fresh machine this installs redis-server
        from redis_peer import RedisUnavailable, ensure_redis_server

        try:
            ensure_redis_server()
        except RedisUnavailable as exc:
            print(f"# {exc}: P4 is not run", file=sys.stderr, flush=True)
            peers.remove("p4")

    work = tempfile.mkdtemp(prefix="bench-spark-")
    spark = local_session("bench_spark", work, conf=confs)
    from pyspark.sql import functions as F

    from statestore_async.spark.api.examples import CountSum, PreAggregatedCountSum, VectorizedCountSum

    wanted = {"ours": "ours per-key", "ours-vec": "ours vectorized", "ours-pre": "ours vectorized + JVM pre-agg",
              "ours-none": "ours per-key, sink job", "ours-vec-none": "ours vectorized, sink job",
              "ours-pre-none": "ours vectorized + JVM pre-agg, sink job",
              "p1": "P1 hdfs (default)", "p1-rocks": "P1 rocksdb+changelog", "p2": "P2 applyInPandasWithState",
              "p4": "P4 redis pre-aggregated", "floor-vec": "Spark floor, vectorized input (no state)",
              "floor-pre": "Spark floor, pre-aggregated input (no state)",
              "floor-pre-out": "Spark floor, pre-aggregated input, rows out (no state)",
              "floor-jvm": "Spark floor, Spark's own aggregation (no state)",
              "floor-per-key": "Spark floor, per-key Python calls (no store)"}
    unknown = [p for p in peers if p not in wanted]
    if unknown:
        ap.error(f"unknown peers {unknown}; choose from {sorted(wanted)}")

    def round_(K: int, batch_rows: int, n_measured: int, label: str) -> list[dict]:
        """Every selected peer on one input of ``1 + n_measured`` batches of ``batch_rows`` rows."""
        src = os.path.join(work, f"in-{label}-{K}")
        t = time.perf_counter()
        oracle = gen(src, K, batch_rows, n_measured + 1)
        print(f"# {label} K={K:,}: input {n_measured + 1} x {batch_rows:,} rows written in "
              f"{time.perf_counter() - t:.1f}s", flush=True)
        src_p2 = os.path.join(work, f"in-p2-{label}-{K}")
        if "p2" in peers:
            gen(src_p2, K, p2_rows, 3)
        runs = {
            "ours per-key": lambda d: ours(spark, src, d, CountSum(), oracle, a.timeout),
            "ours vectorized": lambda d: ours(spark, src, d, VectorizedCountSum(), oracle, a.timeout),
            "ours vectorized + JVM pre-agg": lambda d: ours(spark, src, d, PreAggregatedCountSum(), oracle, a.timeout,
                                                            [F.count("*").alias("n"), F.sum("value").alias("s")]),
            "ours per-key, sink job": lambda d: ours(spark, src, d, CountSum(), oracle, a.timeout, sink_once=True),
            "ours vectorized, sink job": lambda d: ours(spark, src, d, VectorizedCountSum(), oracle, a.timeout,
                                                        sink_once=True),
            "ours vectorized + JVM pre-agg, sink job": lambda d: ours(
                spark, src, d, PreAggregatedCountSum(), oracle, a.timeout,
                [F.count("*").alias("n"), F.sum("value").alias("s")], sink_once=True),
            "P1 hdfs (default)": lambda d: p1(spark, src, d, oracle, a.timeout, False),
            "P1 rocksdb+changelog": lambda d: p1(spark, src, d, oracle, a.timeout, True),
            "P2 applyInPandasWithState": lambda d: p2(spark, src_p2, d, a.timeout),
            "P4 redis pre-aggregated": lambda d: p4(spark, src, d, oracle, a.timeout),
            "Spark floor, vectorized input (no state)": lambda d: spark_floor(spark, src, batch_rows, "vec"),
            "Spark floor, pre-aggregated input (no state)": lambda d: spark_floor(spark, src, batch_rows, "pre"),
            "Spark floor, pre-aggregated input, rows out (no state)":
                lambda d: spark_floor(spark, src, batch_rows, "pre-out"),
            "Spark floor, Spark's own aggregation (no state)": lambda d: spark_floor(spark, src, batch_rows, "jvm"),
            "Spark floor, per-key Python calls (no store)": lambda d: spark_floor(spark, src, batch_rows, "per-key"),
        }
        out = []
        for short in peers:
            name = wanted[short]
            d = os.path.join(work, f"{label}-{short}-{K}")
            os.makedirs(d)
            t = time.perf_counter()
            try:
                fig = runs[name](d)
            except Exception as exc:
                fig = {"rows_s": 0.0, "error": str(exc).splitlines()[0][:200]}
            fig.update(K=K, peer=name, wall=time.perf_counter() - t)
            out.append(fig)
            print(f"  {name:28s} {fig['rows_s']:>12,.0f} rows/s  ({fig.get('batches', 0)} batches, "
                  f"median {fig.get('batch_ms', 0):,.0f} ms, correct={fig.get('correct')}, "
                  f"wall {fig['wall']:.0f}s) {fig.get('phases', '')} tasks {fig.get('task_ms', '')} {fig.get('error', '')}"
                  f"\n    durationMs {fig.get('duration_ms', '')}\n    CPU s per batch {cpu_text(fig.get('cpu', {}))}",
                  flush=True)
            shutil.rmtree(d, ignore_errors=True)
        shutil.rmtree(src, ignore_errors=True)
        shutil.rmtree(src_p2, ignore_errors=True)
        return out

    if a.split:
        try:
            src = os.path.join(work, "in-split")
            gen(src, keys[0], rows, measured + 1)
            split(spark, src, os.path.join(work, "split"), measured + 1, api=a.split)
        finally:
            spark.stop()
            shutil.rmtree(work, ignore_errors=True)
        return 0
    results = []
    try:
        for w in range(a.warmup_rounds):  # figures discarded: see the module docstring
            round_(keys[0], a.warmup_rows or max(rows // 2, 1000), 2, f"warm-up-{w + 1}")
        for K in keys:
            results.extend(round_(K, rows, measured, "measured"))
    finally:
        spark.stop()
        shutil.rmtree(work, ignore_errors=True)
    results = merge_repeats(results)
    print()
    print(f"workload W: B={rows:,} rows/batch, 1 warm-up + {measured} measured batches (P2: {p2_rows:,} rows/batch, "
          f"1 + 2), local[2], 2 state partitions; JVM warmed by {a.warmup_rounds} discarded round(s) of every peer")
    print("| K | peer | rows/s | × P1 hdfs | × P4 | × P2 | batch ms | commit/fence ms | CPU s per batch | checkpoint "
          "| correct |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|---:|---|")
    for K in keys:
        by = {r.get("ref_name", r["peer"]): r for r in results if r["K"] == K}
        ref1 = by.get("P1 hdfs (default)", {}).get("rows_s") or 0
        ref4 = by.get("P4 redis pre-aggregated", {}).get("rows_s") or 0
        ref2 = by.get("P2 applyInPandasWithState", {}).get("rows_s") or 0
        for r in (x for x in results if x["K"] == K):
            rs = r["rows_s"]
            ck = r.get("ckpt")
            ckpt = f"{ck[0] / 1e6:.1f} MB / {ck[1]} files" if ck else "-"
            cm = r.get("commit_ms")
            print(f"| {K:,} | {r['peer']} | {rs:,.0f} | {rs / ref1 if ref1 else 0:.2f} | {rs / ref4 if ref4 else 0:.2f} "
                  f"| {rs / ref2 if ref2 else 0:.1f} | {r.get('batch_ms', 0):,.0f} | "
                  f"{'-' if cm is None else f'{cm:,.0f}'} | {cpu_text(r.get('cpu', {}))} | {ckpt} "
                  f"| {r.get('correct', r.get('error'))} |")
    pre, pre_out, vec, per_key = (wanted["floor-pre"], wanted["floor-pre-out"], wanted["floor-vec"],
                                  wanted["floor-per-key"])
    split_of = [("ours vectorized + JVM pre-agg", pre), ("ours vectorized + JVM pre-agg, sink job", pre),
                ("ours vectorized + JVM pre-agg", pre_out), ("ours vectorized + JVM pre-agg, sink job", pre_out),
                ("ours per-key", vec), ("ours per-key", per_key), ("ours per-key, sink job", per_key),
                ("ours vectorized", vec), ("ours vectorized, sink job", vec)]
    for K in keys:
        by = {r.get("ref_name", r["peer"]): r for r in results if r["K"] == K}
        for ours_name, floor_name in split_of:
            o = by.get(ours_name)
            floors = [t for r in results if r["K"] == K and r["peer"] == floor_name for t in r.get("batch_times", ())]
            if not o or not o.get("per_batch") or not floors:
                continue
            floor = statistics.median(floors)
            print(f"\nK={K:,} {ours_name}: per batch, ms (floor = {floor_name}, median of {len(floors)} batches "
                  f"{floor:,.0f} ms; bookkeeping = Spark's streaming bookkeeping around foreachBatch, the batch less "
                  "addBatch, paid by P1 too; ours over floor = addBatch less the floor: our own time per batch)")
            print("| batch | batch (trigger) | bookkeeping | addBatch | ours over floor | foreachBatch | plan "
                  "| compute (job) | fence | manifest | sink |")
            print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
            rows = [[b["trigger"], b["trigger"] - b["add"], b["add"], b["add"] - floor, b["total"], b["plan"],
                     b["compute"], b["fence"], b["manifest"], b["sink"]] for b in o["per_batch"]]
            for i, row in enumerate(rows, 1):
                print(f"| {i} | " + " | ".join(f"{v:,.0f}" for v in row) + " |")
            print("| median | " + " | ".join(f"{statistics.median(col):,.0f}" for col in zip(*rows)) + " |")
            p1_ms = by.get("P1 hdfs (default)", {}).get("batch_ms")
            if p1_ms:  # what this peer could reach if our own time per batch were nothing
                bound = floor + statistics.median(row[1] for row in rows)
                print(f"With no time of ours at all, a batch would take the floor plus the bookkeeping: {bound:,.0f} ms, "
                      f"at most {p1_ms / bound:.2f}× P1 hdfs (its batch {p1_ms:,.0f} ms in this run).")
    if charts.chart_path(a):
        by_k = {K: {r.get("ref_name", r["peer"]): r["rows_s"] or None for r in results if r["K"] == K} for K in keys}
        names = list(dict.fromkeys(r.get("ref_name", r["peer"]) for r in results))
        p1_rows = {K: by_k[K].get("P1 hdfs (default)") for K in keys}
        groups = [f"K = {K:,}" for K in keys]
        charts.bar_charts(charts.chart_path(a), f"Workload W: {rows:,} rows per micro-batch, local[2]", [
            charts.Panel("rows/s (log scale)", groups, {n: [by_k[K].get(n) for K in keys] for n in names}, "rows/s",
                         log=True),
            charts.Panel("× P1 hdfs (Spark's default provider)", groups, {
                n: [by_k[K][n] / p1_rows[K] if by_k[K].get(n) and p1_rows[K] else None for K in keys] for n in names
                if n != "P2 applyInPandasWithState"}, "ratio", fmt=lambda v: f"{v:.2f}×", reference=(1.0, "P1"))],
            charts.measured_caption(f"median of {measured} batches after a warm-up batch; "
                                    f"JVM warmed by {a.warmup_rounds} discarded round(s)"), width=13.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
