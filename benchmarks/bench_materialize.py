"""What keeping a batch's output for the sink costs: each way the stateful operator can hold it.

Run: ``.venv/bin/python benchmarks/bench_materialize.py [--keys 1000000] [--rows 1000000] [--repeat 7]``

Workload W's shape without state: each batch is ``--rows`` rows of ``--keys`` keys in two parquet
files, routed to 2 partitions by key and summed per key in a ``mapInArrow`` task (pyarrow's
``group_by``: ~630k output rows ``(key, count, sum)`` at 1M keys, as our operator emits), so that
only the way the output is kept differs. Each batch, in turn (the first round discarded: JIT):

* ``none``: the sink's ``noop`` write runs the stage (``materialize="none"``: nothing kept);
* ``checkpoint``: the operator's ``materialize_checkpoint`` (``localCheckpoint``, Spark's default
  level for it), then the sink's write over the blocks, then their release (``materialize="auto"``
  in local mode);
* ``checkpoint <level>``: the same at another storage level (``localCheckpoint(storageLevel=…)``,
  Spark 4): PySpark's ``MEMORY_AND_DISK`` and ``MEMORY_ONLY`` keep rows serialized, ``DISK_ONLY`` on
  local disk;
* ``cache``: the operator's ``materialize_cache`` (``persist(MEMORY_AND_DISK)`` and a ``noop``
  write: Spark's columnar cache), then the sink's write, then ``unpersist``.

Printed per way: the median and best batch (ms), the median over ``none`` — what holding the
output costs a batch —, and the CPU seconds per batch of the JVM and the Python workers together
(median; ``bench_spark.cpu_seconds``). local[2], as ``bench_spark.py``.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from bench_spark import cpu_seconds, cpu_used
from local_spark import local_session

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

OUT = "key string, count bigint, sum bigint"


def sums(batches):
    t = pa.Table.from_batches(list(batches))
    if not t.num_rows:
        return
    g = t.group_by("key").aggregate([("value", "count"), ("value", "sum")])
    yield from pa.table({"key": g["key"], "count": g["value_count"], "sum": g["value_sum"]}).to_batches(65536)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", type=int, default=1_000_000)
    ap.add_argument("--rows", type=int, default=1_000_000, help="rows per batch")
    ap.add_argument("--repeat", type=int, default=7, help="measured batches per way (one more discarded)")
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="bench-materialize-")
    spark = local_session("bench_materialize", work)
    from pyspark import StorageLevel

    from statestore_async.spark.driver.materialize import arrow_batch_bytes, materialize_cache, materialize_checkpoint

    try:
        rng = np.random.default_rng(1)
        os.makedirs(f"{work}/in")
        for i in range(2):
            idx = rng.integers(0, a.keys, a.rows // 2)
            pq.write_table(pa.table({"key": pa.array([f"k{j:08d}" for j in idx]),
                                     "value": pa.array(rng.integers(0, 1000, a.rows // 2))}), f"{work}/in/{i}.parquet")
        routed = spark.read.parquet(f"{work}/in").repartition(2, "key")

        def sink(df):
            df.write.format("noop").mode("overwrite").save()

        def held(keep):
            def run(out):
                m = keep(out)
                sink(m.result)
                m.release()
            return run

        def at_level(level):
            def run(out):
                kept = out.localCheckpoint(eager=True, storageLevel=level)
                sink(kept)
                kept.unpersist()
            return run

        ways = {"none": sink, "checkpoint": held(materialize_checkpoint),
                "checkpoint MEMORY_AND_DISK (serialized)": at_level(StorageLevel.MEMORY_AND_DISK),
                "checkpoint MEMORY_ONLY (serialized)": at_level(StorageLevel.MEMORY_ONLY),
                "checkpoint DISK_ONLY": at_level(StorageLevel.DISK_ONLY),
                "cache": held(materialize_cache)}
        times: dict[str, list[float]] = {w: [] for w in ways}
        cpu: dict[str, list[float]] = {w: [] for w in ways}
        rows_out = routed.mapInArrow(sums, OUT).count()
        for rep in range(a.repeat + 1):
            for name, run in ways.items():
                before, t = cpu_seconds(), time.perf_counter()
                with arrow_batch_bytes(spark, None):  # as the operator runs its stage
                    run(routed.mapInArrow(sums, OUT))
                if rep:
                    times[name].append((time.perf_counter() - t) * 1000)
                    cpu[name].append(sum(cpu_used(before, cpu_seconds()).values()))
        base = statistics.median(times["none"])
        print(f"{a.rows:,} rows of {a.keys:,} keys per batch -> {rows_out:,} output rows; local[2]; "
              f"{a.repeat} batches per way")
        print("| way | median ms | best ms | over none, ms | CPU s |")
        print("|---|---:|---:|---:|---:|")
        for name, ts in times.items():
            med = statistics.median(ts)
            print(f"| {name} | {med:,.0f} | {min(ts):,.0f} | {med - base:+,.0f} | {statistics.median(cpu[name]):.2f} |")
    finally:
        spark.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
