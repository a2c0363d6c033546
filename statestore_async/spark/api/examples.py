"""Ready-made processors: a running (count, sum) per key, per-key and vectorized (demo, benchmarks, tests).

Both emit ``(*key, count, sum)`` for every key of the batch — Spark's streaming
``groupBy(key).agg(count(*), sum(value))`` in update mode.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa

from statestore_async.spark.api.processors import StatefulProcessor, VectorizedProcessor


class CountSum(StatefulProcessor):
    """Per key: ``total = (count, sum of the first value column)``; emits ``(*key, count, sum)``."""

    def init(self, handle):
        self.total = handle.value_state("total")

    def handle_rows(self, key, rows, state):
        count, total = self.total.get() or (0, 0)
        count += len(rows)
        total += sum(r[0] for r in rows)
        self.total.update((count, total))
        return ((*key, count, total),)


class VectorizedCountSum(VectorizedProcessor):
    """The same as ``CountSum`` for a whole partition with numpy (no Python loop per row)."""

    state_name = "total"
    state_schema = pa.schema([("count", pa.int64()), ("sum", pa.int64())])

    def process(self, keys, rows, offsets, state, exists):
        counts = np.diff(offsets)
        values = rows.column(0).to_numpy(zero_copy_only=False).astype(np.int64)
        sums = np.add.reduceat(values, offsets[:-1]) if len(values) else np.zeros(0, np.int64)
        old_c = state.column("count").fill_null(0).to_numpy(zero_copy_only=False)
        old_s = state.column("sum").fill_null(0).to_numpy(zero_copy_only=False)
        new_c, new_s = old_c + counts, old_s + sums
        new_state = pa.table({"count": new_c, "sum": new_s})
        output = pa.Table.from_arrays([*keys.columns, pa.array(new_c), pa.array(new_s)],
                                      names=[*keys.column_names, "count", "sum"])
        return new_state, output


class PreAggregatedCountSum(VectorizedProcessor):
    """``VectorizedCountSum`` for rows already combined by the JVM: columns ``(n, s)`` per key.

    Use with ``StatefulOperator(..., pre_aggregate=[F.count("*").alias("n"), F.sum("value").alias("s")])``.
    """

    state_name = "total"
    state_schema = VectorizedCountSum.state_schema

    def process(self, keys, rows, offsets, state, exists):
        starts = offsets[:-1]
        n = rows.column("n").to_numpy(zero_copy_only=False).astype(np.int64)
        s = rows.column("s").to_numpy(zero_copy_only=False).astype(np.int64)
        counts = np.add.reduceat(n, starts) if len(n) else np.zeros(0, np.int64)
        sums = np.add.reduceat(s, starts) if len(s) else np.zeros(0, np.int64)
        new_c = state.column("count").fill_null(0).to_numpy(zero_copy_only=False) + counts
        new_s = state.column("sum").fill_null(0).to_numpy(zero_copy_only=False) + sums
        output = pa.Table.from_arrays([*keys.columns, pa.array(new_c), pa.array(new_s)],
                                      names=[*keys.column_names, "count", "sum"])
        return pa.table({"count": new_c, "sum": new_s}), output
