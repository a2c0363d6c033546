"""Late rows counted and dropped by the stateful stage's tasks (``eventtime.split_late``,
``eventtime.tasks_event_time``): the max event time and the late rows of a partition's Arrow rows in
each unit Spark or a user may give (integer ms, timestamps in s/ms/us/ns, before 1970, nulls), a
partition counted once whatever its attempts, and through the operator an event-time column that is
neither a key nor a value column (routed for the tasks, never handed to the processor)."""
from __future__ import annotations

import sys
from datetime import timedelta

import pyarrow as pa
import pytest
from spark_cluster import Daemon

from statestore_async.spark import StatefulOperator, StatefulProcessor
from statestore_async.spark.shared.eventtime import split_late, tasks_event_time


def _table(values, type_):
    return pa.table({"k": [str(i) for i in range(len(values))], "et": pa.array(values, type_)})


@pytest.mark.parametrize("unit, per_ms", [("ms", 1), ("us", 1_000), ("ns", 1_000_000)])
def test_timestamps_floor_to_the_millisecond_as_spark_does(unit, per_ms):
    # in ms: 5, 4.99.. (floors to 4), 6, null, and one unit before 1970 (floors to -1)
    raw = [5 * per_ms, 5 * per_ms - 1, 6 * per_ms, None, -1]
    table = _table(raw, pa.timestamp(unit, tz="UTC"))
    kept, top, late = split_late(table, "et", 4, drop=True)
    assert top == 6 and late == 2  # 4.999 ms and -0.001 ms are <= 4 ms; a null is never late
    assert kept.column("k").to_pylist() == ["0", "2", "3"]
    kept, top, late = split_late(table, "et", 4, drop=False)
    assert (kept.num_rows, top, late) == (5, 6, 2)


def test_timestamps_in_seconds_and_integer_milliseconds():
    kept, top, late = split_late(_table([3, 4, None], pa.timestamp("s")), "et", 3_999, drop=True)
    assert (top, late, kept.column("k").to_pylist()) == (4_000, 1, ["1", "2"])  # 3 s = 3000 ms <= 3999
    kept, top, late = split_late(_table([10, 11, 9], pa.int32()), "et", 10, drop=True)
    assert (top, late, kept.column("k").to_pylist()) == (11, 2, ["1"])


def test_no_watermark_nothing_is_late_and_all_nulls_have_no_max():
    kept, top, late = split_late(_table([7, 1], pa.int64()), "et", None, drop=True)
    assert (kept.num_rows, top, late) == (2, 7, 0)
    kept, top, late = split_late(_table([None, None], pa.int64()), "et", 100, drop=True)
    assert (kept.num_rows, top, late) == (2, None, 0)


def test_a_partition_counts_once_whatever_its_attempts():
    # partition 1 ran twice (a retried task adds its figures again): its late rows count once
    assert tasks_event_time([(0, 50, 2), (1, 70, 3), (1, 70, 3), (2, None, 0)]) == (70, 5)
    assert tasks_event_time([]) == (None, 0)
    assert tasks_event_time([(0, None, 1)]) == (None, 1)


class Count(StatefulProcessor):
    """Counts a key's rows; emits what each row it gets holds (the event-time column must not be there)."""

    def init(self, handle):
        self.n = handle.value_state("n")

    def handle_rows(self, key, rows, state):
        n = (self.n.get() or 0) + len(rows)
        self.n.update(n)
        for row in rows:
            yield (key[0], len(row), row[0], n)


@pytest.fixture(scope="module")
def daemon():
    with Daemon() as d:
        yield d


@pytest.fixture(autouse=True)
def _pickle_this_module():
    from pyspark import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.mark.spark
def test_event_time_column_outside_the_values_is_routed_for_the_tasks_only(spark, daemon, tmp_path):
    op = StatefulOperator(f"file://{tmp_path}/state", "late", ["user"], Count(),
                          "user string, width int, v string, n bigint", 2, 16, socket_path=daemon.socket,
                          value_columns=["v"], time_mode="event", event_time_column="et",
                          watermark_delay=timedelta(seconds=10))
    out: dict = {}

    def sink(df, batch_id):
        out[batch_id] = sorted(tuple(r) for r in df.collect())

    schema = "user string, v string, et bigint"
    p0 = op.process_batch(spark.createDataFrame([("a", "x", 50_000), ("b", "y", 30_000)], schema), 0, sink)
    assert (p0.watermark_ms, p0.max_event_time_ms, p0.late_rows) == (None, 50_000, 0)
    assert out[0] == [("a", 1, "x", 1), ("b", 1, "y", 1)]  # one value per row: et was not handed over
    # W = 40 s: b's row at 40 s and c's at 39 s are late, dropped before their keys' state is read
    rows = [("a", "p", 45_000), ("b", "q", 40_000), ("c", "r", 39_000), ("c", "s", 41_000)]
    p1 = op.process_batch(spark.createDataFrame(rows, schema), 1, sink)
    assert (p1.watermark_ms, p1.max_event_time_ms, p1.late_rows) == (40_000, 45_000, 2)
    assert out[1] == [("a", 1, "p", 2), ("c", 1, "s", 1)]
    # only late rows: nothing reaches a processor, the batch still counts them
    p2 = op.process_batch(spark.createDataFrame([("a", "z", 1_000)], schema), 2, sink)
    assert (p2.watermark_ms, p2.max_event_time_ms, p2.late_rows) == (40_000, 1_000, 1) and out[2] == []
