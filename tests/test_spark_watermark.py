"""The driver's side of event time (``spark/eventtime.py`` wired into ``StatefulOperator``): the
time arguments and their errors, the watermark of each batch (Spark's ``withWatermark`` rule),
late rows dropped before any state is read or kept and counted, the watermark recorded in the
manifest so that a replay uses the same value, and the heartbeat that makes Spark call
``foreachBatch`` in an idle stream. Real Spark (local mode) and a real daemon."""
from __future__ import annotations

import os
import sys
import threading
import time
from datetime import timedelta

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from spark_cluster import Daemon

from statestore_async.errors import InterfaceError
from statestore_async.files.manifest import Manifest, manifest_key
from statestore_async.spark import StatefulOperator, StatefulProcessor, load_state
from statestore_async.spark.shared.eventtime import HEARTBEAT_COLUMN, next_watermark, time_settings

OUT = "user string, et bigint, n bigint"
DELAY = timedelta(seconds=10)


class Seen(StatefulProcessor):
    """Echoes every row it gets (so the output shows which rows reached the processor) and counts
    the key's rows in state."""

    def init(self, handle):
        self.n = handle.value_state("n")

    def handle_rows(self, key, rows, state):
        n = (self.n.get() or 0) + len(rows)
        self.n.update(n)
        for (et,) in rows:  # a timestamp column's values arrive as datetimes: echoed in ms
            yield (key[0], et if et is None or isinstance(et, int) else round(et.timestamp() * 1000), n)


@pytest.fixture(scope="module")
def daemon():
    with Daemon() as d:
        yield d


@pytest.fixture(autouse=True)
def _pickle_this_module():
    from pyspark import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _op(root: str, daemon, **kw) -> StatefulOperator:
    kw.setdefault("time_mode", "event")
    kw.setdefault("event_time_column", "et")
    kw.setdefault("watermark_delay", DELAY)
    return StatefulOperator(root, "wm", ["user"], Seen(), OUT, 2, 16, socket_path=daemon.socket,
                            value_columns=["et"], **kw)


def _manifest(root: str, version: int) -> Manifest:
    path = root.removeprefix("file://") + "/" + manifest_key("wm", version)
    with open(path, "rb") as f:
        return Manifest.from_bytes(f.read(), path)


def _batch(spark, rows, et_type: str = "bigint"):
    df = spark.createDataFrame(rows, "user string, et bigint")
    if et_type == "timestamp":
        from pyspark.sql import functions as F

        df = df.withColumn("et", F.timestamp_millis("et"))
    return df


def _sink(out: dict):
    def sink(df, batch_id):
        out[batch_id] = sorted(tuple(r) for r in df.collect())
    return sink


# -- arguments ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, words", [
    ({"time_mode": "events"}, "time_mode must be one of"),
    ({"time_mode": "event", "watermark_delay": DELAY}, "needs event_time_column"),
    ({"time_mode": "event", "event_time_column": "et"}, "needs watermark_delay"),
    ({"time_mode": "event", "event_time_column": "et", "watermark_delay": 10}, "has no unit"),
    ({"time_mode": "event", "event_time_column": "et", "watermark_delay": "10 seconds"}, "is a datetime.timedelta"),
    ({"time_mode": "event", "event_time_column": "et", "watermark_delay": -DELAY}, "must not be negative"),
    ({"time_mode": "processing", "event_time_column": "et"}, "need time_mode='event'"),
    ({"watermark_delay": DELAY}, "need time_mode='event'"),
    ({"time_mode": "event", "event_time_column": "et", "watermark_delay": DELAY, "late_rows": "skip"},
     "late_rows must be 'drop' or 'keep'"),
])
def test_time_arguments_are_checked(tmp_path, kw, words):
    with pytest.raises(InterfaceError, match=words):
        StatefulOperator(f"file://{tmp_path}/s", "wm", ["user"], Seen(), OUT, 2, 16, **kw)


def test_time_settings_and_the_watermark_rule():
    s = time_settings("event", "et", timedelta(minutes=1, milliseconds=5), "keep")
    assert (s.mode, s.event_time_column, s.delay_ms, s.late_rows) == ("event", "et", 60_005, "keep")
    assert time_settings("processing").mode == "processing" and not time_settings("processing").event
    assert next_watermark(None, None, 10) is None             # nothing seen: no watermark
    assert next_watermark(None, 100, 10) == 90
    assert next_watermark(95, 100, 10) == 95                 # never decreases
    assert next_watermark(80, 100, 10) == 90
    assert next_watermark(80, None, 10) == 80                # a batch without event times keeps it


# -- the watermark per batch, late rows, replays ---------------------------------------------------
@pytest.mark.spark
@pytest.mark.parametrize("et_type", ["bigint", "timestamp"])
def test_watermark_per_batch_and_late_rows_dropped(spark, daemon, tmp_path, et_type):
    root = f"file://{tmp_path}/state"
    op = _op(root, daemon)
    out: dict = {}
    sink = _sink(out)
    p0 = op.process_batch(_batch(spark, [("a", 50_000), ("b", 30_000), ("a", 10_000)], et_type), 0, sink)
    assert (p0.watermark_ms, p0.max_event_time_ms, p0.late_rows) == (None, 50_000, 0)  # no watermark in batch 0
    assert len(out[0]) == 3
    # batch 1: W = 50 s - 10 s = 40 s; rows at or before 40 s are late: dropped before any state
    p1 = op.process_batch(_batch(spark, [("a", 40_000), ("b", 40_001), ("c", 39_000), ("c", 60_000)], et_type), 1, sink)
    assert (p1.watermark_ms, p1.max_event_time_ms, p1.late_rows) == (40_000, 60_000, 2)
    assert [(u, e) for u, e, _ in out[1]] == [("b", 40_001), ("c", 60_000)]
    assert {u: n for u, _, n in out[1]} == {"b": 2, "c": 1}  # c's late row never reached its state
    # batch 2: only late rows: nothing reaches the processor; the max seen stays 60 s
    p2 = op.process_batch(_batch(spark, [("a", 1_000), ("d", 50_000)], et_type), 2, sink)
    assert (p2.watermark_ms, p2.max_event_time_ms, p2.late_rows) == (50_000, 50_000, 2) and out[2] == []
    p3 = op.process_batch(_batch(spark, [("d", 50_001)], et_type), 3, sink)
    assert p3.watermark_ms == 50_000 and p3.late_rows == 0  # the max is still 60 s (batch 2 saw only 50 s)
    m = _manifest(root, 4)
    assert (m.metadata["watermark_ms"], m.metadata["max_event_time_ms"]) == (50_000, 60_000)
    state = load_state(root, "wm")
    assert {k[0]: v for (name, k), v in state.items()} == {"a": 2, "b": 2, "c": 1, "d": 1}


@pytest.mark.spark
def test_a_replayed_batch_uses_the_watermark_of_its_first_run(spark, daemon, tmp_path):
    root = f"file://{tmp_path}/state"
    op = _op(root, daemon)
    out: dict = {}
    op.process_batch(_batch(spark, [("a", 100_000)]), 0, _sink(out))
    first = op.process_batch(_batch(spark, [("a", 95_000), ("b", 200_000)]), 1, _sink(out))
    assert first.watermark_ms == 90_000 and first.late_rows == 0
    op.process_batch(_batch(spark, [("a", 300_000)]), 2, _sink(out))
    # Spark replays batch 1 (e.g. after a driver crash): it starts from manifest 1 again, so it uses
    # the same watermark, not one computed from what batches 1 and 2 saw since
    again = StatefulOperator(root, "wm", ["user"], Seen(), OUT, 2, 16, socket_path=daemon.socket,
                             value_columns=["et"], time_mode="event", event_time_column="et",
                             watermark_delay=DELAY).process_batch(
        _batch(spark, [("a", 95_000), ("b", 200_000)]), 1, _sink(out))
    assert again.watermark_ms == 90_000 and again.late_rows == 0 and len(out[1]) == 2
    assert _manifest(root, 2).metadata["max_event_time_ms"] == 200_000


@pytest.mark.spark
def test_late_rows_kept_reach_the_processor_and_are_counted(spark, daemon, tmp_path):
    op = _op(f"file://{tmp_path}/state", daemon, late_rows="keep")
    out: dict = {}
    op.process_batch(_batch(spark, [("a", 50_000)]), 0, _sink(out))
    p = op.process_batch(_batch(spark, [("a", 40_000), ("a", 1), ("b", 41_000)]), 1, _sink(out))
    assert p.late_rows == 2 and p.watermark_ms == 40_000
    assert [(u, e) for u, e, _ in out[1]] == [("a", 1), ("a", 40_000), ("b", 41_000)]


@pytest.mark.spark
def test_null_event_times_are_never_late_and_empty_batches_keep_the_watermark(spark, daemon, tmp_path):
    op = _op(f"file://{tmp_path}/state", daemon)
    out: dict = {}
    op.process_batch(_batch(spark, [("a", 50_000)]), 0, _sink(out))
    p = op.process_batch(_batch(spark, [("a", None), ("b", 5)]), 1, _sink(out))
    assert p.late_rows == 1 and p.max_event_time_ms == 5 and out[1] == [("a", None, 2)]
    empty = _batch(spark, []).filter("et > 0")
    p = op.process_batch(empty, 2, _sink(out))
    assert (p.watermark_ms, p.max_event_time_ms, p.late_rows) == (40_000, None, 0) and out[2] == []
    assert op.process_batch(_batch(spark, [("c", 60_000)]), 3, _sink(out)).watermark_ms == 40_000


class PreAggregated(StatefulProcessor):
    """Gets one row (n, top) per key: the JVM's count and max event time of the key's admitted rows."""

    def init(self, handle):
        self.n = handle.value_state("n")

    def handle_rows(self, key, rows, state):
        ((n, top),) = rows
        total = (self.n.get() or 0) + n
        self.n.update(total)
        yield (key[0], top, total)


@pytest.mark.spark
def test_late_rows_are_dropped_before_the_jvm_pre_aggregation(spark, daemon, tmp_path):
    from pyspark.sql import functions as F

    op = StatefulOperator(f"file://{tmp_path}/state", "wm", ["user"], PreAggregated(), OUT, 2, 16,
                          socket_path=daemon.socket, pre_aggregate=[F.count("*").alias("n"), F.max("et").alias("top")],
                          time_mode="event", event_time_column="et", watermark_delay=DELAY)
    out: dict = {}
    op.process_batch(_batch(spark, [("a", 50_000), ("a", 10_000), ("b", 20_000)]), 0, _sink(out))
    assert out[0] == [("a", 50_000, 2), ("b", 20_000, 1)]
    p = op.process_batch(_batch(spark, [("a", 40_000), ("a", 45_000), ("b", 30_000)]), 1, _sink(out))
    assert (p.watermark_ms, p.late_rows) == (40_000, 2) and out[1] == [("a", 45_000, 3)]


@pytest.mark.spark
def test_event_time_column_is_checked_at_the_first_batch(spark, daemon, tmp_path):
    op = _op(f"file://{tmp_path}/state", daemon, event_time_column="when")
    with pytest.raises(InterfaceError, match="event_time_column 'when' is not in the batch's columns"):
        op.process_batch(_batch(spark, [("a", 1)]), 0)
    op = _op(f"file://{tmp_path}/state2", daemon)
    bad = spark.createDataFrame([("a", "x")], "user string, et string")
    with pytest.raises(InterfaceError, match="is of type string: it must be a timestamp or integer milliseconds"):
        op.process_batch(bad, 0)


@pytest.mark.spark
def test_without_event_time_the_manifest_carries_no_watermark(spark, daemon, tmp_path):
    root = f"file://{tmp_path}/state"
    op = StatefulOperator(root, "wm", ["user"], Seen(), OUT, 2, 16, socket_path=daemon.socket,
                          value_columns=["et"], time_mode="processing")
    p = op.process_batch(_batch(spark, [("a", 1)]), 0, _sink({}))
    assert (p.watermark_ms, p.late_rows) == (None, 0)
    assert "watermark_ms" not in _manifest(root, 1).metadata


# -- the heartbeat: foreachBatch without new events -------------------------------------------------
@pytest.mark.spark
def test_heartbeat_runs_batches_in_an_idle_stream(spark, daemon, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    pq.write_table(pa.table({"user": ["a", "b"], "et": pa.array([10_000, 20_000], pa.int64())}), src / "0.parquet")
    root = f"file://{tmp_path}/state"
    op = _op(root, daemon)
    seen: dict[int, list] = {}
    lock = threading.Lock()

    def sink(df, batch_id):
        with lock:
            seen[batch_id] = sorted(tuple(r) for r in df.collect())

    events = spark.readStream.schema("user string, et bigint").parquet(str(src))
    with pytest.raises(InterfaceError, match="takes the streaming DataFrame"):
        op.with_heartbeat(spark.range(1))
    beating = op.with_heartbeat(events)
    assert HEARTBEAT_COLUMN in beating.columns
    q = (beating.writeStream.foreachBatch(op.foreach_batch(sink)).trigger(processingTime="500 milliseconds")
         .option("checkpointLocation", str(tmp_path / "ckpt")).start())
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and len(op.history) < 4 and q.exception() is None:
            time.sleep(0.2)
    finally:
        q.stop()
    assert q.exception() is None
    assert len(op.history) >= 4, "the heartbeat made Spark run batches with no new event"
    with lock:
        rows = [r for b in sorted(seen) for r in seen[b]]
    assert rows == [("a", 10_000, 1), ("b", 20_000, 1)]  # the heartbeat's rows reached no processor
    assert op.history[-1].watermark_ms == 10_000 and all(p.late_rows == 0 for p in op.history)
    assert {k[0]: v for (_, k), v in load_state(root, "wm").items()} == {"a": 1, "b": 1}
    assert os.path.exists(root.removeprefix("file://") + "/" + manifest_key("wm", len(op.history)))
