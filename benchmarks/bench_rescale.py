"""Rescaling a stateful query: the time to change its number of state partitions, by state size.

    .venv/bin/python benchmarks/bench_rescale.py                  # K = 1M and 10M keys, 4 -> 8 partitions
    .venv/bin/python benchmarks/bench_rescale.py --keys 200000    # one smaller size

For each K: a query (file source, ``foreachBatch``, ``examples.VectorizedCountSum``, local[2]) builds
a state of K keys (count, sum) at N = 4 from two batches of K/2 rows (each key once); its checkpoint
(state root and Spark checkpoint) is copied three times, and a small batch (``--rows``, random
keys) is run on each copy:

  same N          the query restarted at N = 4: a normal batch (each partition loads its state)
  ours online     the query restarted at N = 8: its first batch rescales (each new partition's
                  state assembled by the daemon from the key-group ranges of the old files)
  ours offline    ``repartition`` to N = 8 (files.repartition, in this process), then the query
                  restarted at N = 8: a normal batch
  Spark rebuild   Spark's only way to change a stateful query's partitions today: a new checkpoint
                  with ``spark.sql.shuffle.partitions`` = 8, the state rebuilt by reprocessing the
                  whole input (``groupBy(key).agg(count, sum)``, RocksDB state store with changelog)

Times are wall seconds of the restarted query's first batch (ours: ``BatchProgress.total``), of the
offline tool, and of the whole rebuild query. Bytes: what the daemon read to rescale
(``rescale_bytes_read``) against the stored size of the old layout. Each run's final state is
checked against the input (keys, total count, total sum).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time

import charts
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from bench_spark import run_query
from local_spark import local_session

OUT = "key string, count bigint, sum bigint"
G = 4096


def write_input(folder: str, keys: int, small_rows: int) -> tuple[str, str, dict]:
    """``history/``: every key once, in 2 batches (2 files each); ``next/``: ``small_rows`` random keys.
    Returns (history folder, next folder, oracle over both)."""
    hist, nxt = os.path.join(folder, "history"), os.path.join(folder, "next")
    os.makedirs(hist)
    os.makedirs(nxt)
    base = time.time() - 100_000
    rng = np.random.Generator(np.random.PCG64(5))
    total = 0
    for b in range(2):
        k = np.arange(b * keys // 2, (b + 1) * keys // 2)
        v = rng.integers(0, 1000, len(k))
        total += int(v.sum())
        t = pa.table({"key": pa.array(np.char.add("k", np.char.zfill(k.astype(str), 9)).tolist(), pa.string()),
                      "value": pa.array(v, pa.int64())})
        for i, part in enumerate((t.slice(0, len(k) // 2), t.slice(len(k) // 2))):
            path = os.path.join(hist, f"b{b:04d}-{i}.parquet")
            pq.write_table(part, path)
            os.utime(path, (base + 10 * b + i,) * 2)
    k = rng.integers(0, keys, small_rows)
    v = rng.integers(0, 1000, small_rows)
    total += int(v.sum())
    t = pa.table({"key": pa.array(np.char.add("k", np.char.zfill(k.astype(str), 9)).tolist(), pa.string()),
                  "value": pa.array(v, pa.int64())})
    for i, part in enumerate((t.slice(0, small_rows // 2), t.slice(small_rows // 2))):
        path = os.path.join(nxt, f"b9999-{i}.parquet")
        pq.write_table(part, path)
        os.utime(path, (base + 1000 + i,) * 2)
    return hist, nxt, {"keys": keys, "count": keys + small_rows, "sum": total}


def daemon_registry(sock: str) -> dict:
    from statestore_async.client import Client

    with Client(sock) as c:
        return c.stats()["registry"]


def stored_bytes(root: str) -> int:
    from statestore_async.files.loader import load_store
    from statestore_async.files.manifest import list_manifest_versions, read_manifest
    from statestore_async.ids import StoreId
    from statestore_async.objectstore import open_object_store

    async def go() -> int:
        async with open_object_store(root) as s:
            m = await read_manifest(s, "w", max(await list_manifest_versions(s, "w")))
            total = 0
            for p in range(m.num_partitions):
                _, report = await load_store(s, StoreId(root, "w", p), m.ref(p))
                total += report.bytes_read
            return total

    return asyncio.run(go())


def check(root: str, oracle: dict) -> bool:
    from statestore_async.spark import load_state

    state = {k[0]: v for (_, k), v in load_state(root, "w").items()}
    return (len(state), sum(c for c, _ in state.values()), sum(s for _, s in state.values())) == (
        oracle["keys"], oracle["count"], oracle["sum"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", default="1000000,10000000", help="comma-separated state sizes K")
    ap.add_argument("--rows", type=int, default=10_000, help="rows of the batch after the restart")
    ap.add_argument("--from-partitions", type=int, default=4)
    ap.add_argument("--to-partitions", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=3600)
    charts.add_chart_args(ap, "bench_rescale")
    a = ap.parse_args()
    n0, n1 = a.from_partitions, a.to_partitions
    from pyspark.sql import functions as F

    from statestore_async.files.repartition import repartition
    from statestore_async.objectstore import open_object_store
    from statestore_async.spark import StatefulOperator, placement
    from statestore_async.spark.api.examples import VectorizedCountSum

    work = tempfile.mkdtemp(prefix="bench-rescale-")
    spark = local_session("bench_rescale", work)
    sockdir = tempfile.mkdtemp(prefix="ssr-", dir="/tmp")
    sock = os.path.join(sockdir, "d.sock")
    placement.start_daemon(sock, args=["--log-level", "warning"])
    sink = lambda df, b: df.write.format("noop").mode("overwrite").save()

    def run(src: str, case: str, n: int) -> StatefulOperator:
        root = "file://" + os.path.join(work, case, "state")
        op = StatefulOperator(root, "w", ["key"], VectorizedCountSum(), OUT, n, G, socket_path=sock, fence_timeout=600)
        run_query(spark, src, os.path.join(work, case, "ckpt"),
                  lambda df: df.writeStream.foreachBatch(op.foreach_batch(sink)), a.timeout)
        return op

    rows_out = []
    try:
        for K in [int(k) for k in a.keys.split(",")]:
            base = os.path.join(work, f"in-{K}")
            hist, nxt, oracle = write_input(base, K, a.rows)
            src = os.path.join(base, "src")
            shutil.copytree(hist, src)
            t = time.perf_counter()
            run(src, "build", n0)
            build_s = time.perf_counter() - t
            stored = stored_bytes("file://" + os.path.join(work, "build", "state"))
            for name in os.listdir(nxt):
                shutil.copy2(os.path.join(nxt, name), src)
            row: dict = {"K": K, "stored": stored, "build_s": build_s}
            for case, n in (("same", n0), ("online", n1), ("offline", n1)):
                shutil.copytree(os.path.join(work, "build"), os.path.join(work, case))
                root = "file://" + os.path.join(work, case, "state")
                if case == "offline":
                    async def off(root: str = root) -> tuple[int, int]:
                        async with open_object_store(root) as s:
                            r = await repartition(s, root, "w", n1, owner=owner)
                            return r.bytes_read, r.bytes_written

                    from statestore_async.files.manifest import read_owner

                    async def who(root: str = root) -> str | None:
                        async with open_object_store(root) as s:
                            rec = await read_owner(s, "w")
                            return rec.owner if rec is not None else None

                    owner = asyncio.run(who())
                    t = time.perf_counter()
                    row["offline_read"], _ = asyncio.run(off())
                    row["offline_tool_s"] = time.perf_counter() - t
                before = daemon_registry(sock)
                op = run(src, case, n)
                after = daemon_registry(sock)
                row[f"{case}_s"] = op.history[0].total
                row[f"{case}_ok"] = check(root, oracle)
                if case == "online":
                    row["online_read"] = after["rescale_bytes_read"] - before["rescale_bytes_read"]
                shutil.rmtree(os.path.join(work, case), ignore_errors=True)
            # Spark's answer: a new checkpoint, the state rebuilt from the whole input at the new count
            spark.conf.set("spark.sql.shuffle.partitions", str(n1))
            for k, v in {"spark.sql.streaming.stateStore.providerClass":
                         "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider",
                         "spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled": "true"}.items():
                spark.conf.set(k, v)
            t = time.perf_counter()
            run_query(spark, src, os.path.join(work, "rebuild-ckpt"),
                      lambda df: df.groupBy("key").agg(F.count("*").alias("count"), F.sum("value").alias("sum"))
                      .writeStream.outputMode("update").format("noop"), a.timeout)
            row["rebuild_s"] = time.perf_counter() - t
            spark.conf.set("spark.sql.shuffle.partitions", "2")
            spark.conf.unset("spark.sql.streaming.stateStore.providerClass")
            spark.conf.unset("spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled")
            shutil.rmtree(os.path.join(work, "rebuild-ckpt"), ignore_errors=True)
            shutil.rmtree(os.path.join(work, "build"), ignore_errors=True)
            shutil.rmtree(base, ignore_errors=True)
            rows_out.append(row)
            print(f"# K={K:,}: {row}", flush=True)
    finally:
        placement.stop_daemon(sock)
        shutil.rmtree(sockdir, ignore_errors=True)
        spark.stop()
        shutil.rmtree(work, ignore_errors=True)

    print(f"\nrescale {n0} -> {n1} partitions, restarted query's first batch of {a.rows:,} rows (seconds)")
    print(f"{'K':>12} {'stored MiB':>10} {'same N':>8} {'online':>8} {'read/stored':>11} {'offline tool':>12} "
          f"{'+ batch':>8} {'Spark rebuild':>13} {'rebuild/online':>14} {'exact':>6}")
    for r in rows_out:
        ok = r["same_ok"] and r["online_ok"] and r["offline_ok"]
        print(f"{r['K']:>12,} {r['stored'] / 2**20:>10.1f} {r['same_s']:>8.2f} {r['online_s']:>8.2f} "
              f"{r['online_read'] / r['stored']:>11.3f} {r['offline_tool_s']:>12.2f} {r['offline_s']:>8.2f} "
              f"{r['rebuild_s']:>13.2f} {r['rebuild_s'] / r['online_s']:>13.1f}x {'yes' if ok else 'NO':>6}")
    path = charts.chart_path(a)
    if path and rows_out:
        groups = [f"K={r['K']:,}" for r in rows_out]
        charts.bar_charts(path, f"Changing a stateful query's partitions ({n0} -> {n1})", [
            charts.Panel("time to the first batch at the new count", groups, {
                "ours online (first batch)": [r["online_s"] for r in rows_out],
                "ours offline (tool + batch)": [r["offline_tool_s"] + r["offline_s"] for r in rows_out],
                "Spark: rebuild from the input": [r["rebuild_s"] for r in rows_out],
                "ours, same count (reference)": [r["same_s"] for r in rows_out]}, "seconds", log=True)],
            charts.measured_caption())
        print(f"chart: {path}")
    return 0 if all(r["same_ok"] and r["online_ok"] and r["offline_ok"] for r in rows_out) else 1


if __name__ == "__main__":
    sys.exit(main())
