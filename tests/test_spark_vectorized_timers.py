"""A ``VectorizedProcessor``'s timers (issue 19): registered and deleted in bulk through
``self.timers``, fired by one ``handle_expired_timers`` call per task with the due timers as Arrow
columns, against a real daemon. Most tests run ``task.partition.run_partition`` (what a Spark task runs)
batch after batch with the refs chained as the driver's manifest would (``test_spark_timers.Job``);
the last one runs the ``StatefulOperator`` in Spark local mode. Checkpoint files are read back
with the loader to see what was committed."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from test_spark_timers import G, Job, Killer, N, kg_of

from statestore_async import errors
from statestore_async.spark.api.processors import VectorizedProcessor
from statestore_async.state import keys as state_keys


class VSessions(VectorizedProcessor):
    """Counts rows per key; each batch with rows moves the key's one timer to 1 s after the batch
    (deleting the old one in bulk); a fired timer emits the count and removes the key's state."""

    state_name = "s"
    state_schema = pa.schema([("count", pa.int64()), ("deadline", pa.int64())])

    def process(self, keys, rows, offsets, state, exists):
        n = keys.num_rows
        had = np.flatnonzero(exists)
        self.timers.delete(had, state["deadline"].fill_null(0).to_numpy()[had])
        deadline = np.full(n, self.processing_time_ms + 1000, np.int64)
        self.timers.register(np.arange(n), deadline)
        count = state["count"].fill_null(0).to_numpy() + np.diff(offsets)
        return pa.table({"count": count, "deadline": deadline}), None

    def handle_expired_timers(self, keys, timers, state, exists):
        assert exists.all()
        out = pa.table({"k": timers["k"], "at": timers["at_ms"], "kind": timers["kind"],
                        "n": state["count"].take(timers["key_index"])})
        return state, out, np.zeros(keys.num_rows, bool)


def timer_records(recs: dict) -> list[bytes]:
    return [k for k in recs if k[2] in (state_keys.TIMER_AT, state_keys.TIMER_KEY)]


def test_vectorized_timers_fire_once_for_idle_keys_in_batches_without_rows(daemon, root):
    job = Job(root, daemon.socket, VSessions(), op="vs")
    assert job.run([("a", 1), ("b", 1), ("c", 1), ("c", 2)], now_ms=10_000) == []
    assert len(timer_records(job.records())) == 6  # one timer per key, by time and by key
    assert job.run([("a", 1)], now_ms=10_500) == []  # a's timer moves to 11 500 (the old one deleted)
    assert len(timer_records(job.records())) == 6
    fired = job.run([], now_ms=11_200)  # no rows: every partition's task runs, b's and c's fire
    assert sorted(fired) == [("b", 11_000, "processing", 1), ("c", 11_000, "processing", 2)]
    assert job.run([], now_ms=12_000) == [("a", 11_500, "processing", 2)]
    assert job.run([], now_ms=99_000) == []  # each fired once
    assert not job.reports  # nothing due: nothing committed
    assert job.records() == {}  # the fired timers and the removed state are gone from the files


class Registrar(VectorizedProcessor):
    """Registers the times given as rows (value v: a timer at v for the row's key); a fired timer
    at 5 registers one at 1 (due: fires next batch) and one at its own time 5 (kept: fires next
    batch too); every fired timer is one output row in firing order."""

    state_name = "s"
    state_schema = pa.schema([("seen", pa.int64())])

    def process(self, keys, rows, offsets, state, exists):
        key_of_row = np.repeat(np.arange(keys.num_rows), np.diff(offsets))
        self.timers.register(key_of_row, rows["v"])
        return pa.table({"seen": np.ones(keys.num_rows, np.int64)}), None

    def handle_expired_timers(self, keys, timers, state, exists):
        fives = np.flatnonzero(timers["at_ms"].to_numpy() == 5)
        idx = timers["key_index"].to_numpy()[fives]
        self.timers.register(idx, 1)
        self.timers.register(idx, 5)
        out = pa.table({"k": timers["k"], "at": timers["at_ms"], "kind": timers["kind"],
                        "n": pa.array(np.zeros(timers.num_rows, np.int64))})
        return state, out


def test_firing_order_and_timers_registered_while_firing(daemon, root):
    job = Job(root, daemon.socket, Registrar(), op="reg")
    keys = [k for k in "abcdefghijkl" if kg_of(k) * N // G == 0][:3]
    rows = [(keys[0], 30), (keys[0], 5), (keys[1], 20), (keys[1], 10_000), (keys[2], 7), (keys[2], 20)]
    out = job.run(rows, now_ms=100)  # registered by process at due times: fire in this batch
    expect = [(keys[0], 5), (keys[2], 7), (keys[1], 20), (keys[2], 20), (keys[0], 30)]
    # time order; ties (20) by key group, then key, as the per-key API
    ties = sorted([keys[1], keys[2]], key=lambda k: (kg_of(k), k))
    expect[2:4] = [(ties[0], 20), (ties[1], 20)]
    assert [r[:2] for r in out] == expect
    assert job.run([], now_ms=200) == [(keys[0], 1, "processing", 0), (keys[0], 5, "processing", 0)]
    assert job.run([], now_ms=300) == [(keys[0], 1, "processing", 0), (keys[0], 5, "processing", 0)]
    assert job.run([], now_ms=20_000)[-1] == (keys[1], 10_000, "processing", 0)


def test_vectorized_timers_daemon_killed_before_commit_fire_once(daemon, root):
    job = Job(root, daemon.socket, VSessions(), op="kill")
    keys = [k for k in "abcdefghijkl" if kg_of(k) * N // G == 1][:3]
    job.run([(k, 1) for k in keys], now_ms=1000)
    job.records()  # the fence: batch 0 is in the files
    first = daemon.pid()
    fired = job.run([], now_ms=5000, hook=Killer(1, 1))
    assert sorted(fired) == sorted((k, 2000, "processing", 1) for k in keys)
    assert [r.timings.get("retries") for r in job.reports] == [1]
    assert daemon.pid() not in (None, first)
    assert job.run([], now_ms=9000) == []
    assert job.records() == {}


class EventV(VectorizedProcessor):
    state_name = "s"
    state_schema = pa.schema([("last", pa.int64())])

    def process(self, keys, rows, offsets, state, exists):
        last = np.maximum.reduceat(rows["v"].to_numpy(), offsets[:-1])
        self.timers.register(np.arange(keys.num_rows), last + 100)  # kind None: the time mode, event
        return pa.table({"last": last}), None

    def handle_expired_timers(self, keys, timers, state, exists):
        assert self.watermark_ms is not None and (timers["at_ms"].to_numpy() <= self.watermark_ms).all()
        return state, pa.table({"k": timers["k"], "at": timers["at_ms"], "kind": timers["kind"],
                                "n": state["last"].take(timers["key_index"])})


def test_event_time_timers_wait_for_the_watermark(daemon, root):
    job = Job(root, daemon.socket, EventV(), time_mode="event", op="ev")
    assert job.run([("a", 1000), ("b", 2000)], now_ms=10**12) == []  # no watermark: nothing due
    assert job.run([], now_ms=10**12, watermark_ms=1050) == []
    assert job.run([], now_ms=10**12, watermark_ms=1100) == [("a", 1100, "event", 1000)]
    assert job.run([], now_ms=10**12, watermark_ms=5000) == [("b", 2100, "event", 2000)]


def test_vectorized_timer_misuse_gets_typed_errors(daemon, root):
    class NoCallback(VectorizedProcessor):
        state_name = "s"
        state_schema = pa.schema([("x", pa.int64())])

        def process(self, keys, rows, offsets, state, exists):
            self.timers.register(0, 5, "processing")

    with pytest.raises(errors.InterfaceError, match="handle_expired_timers"):
        Job(root, daemon.socket, NoCallback(), op="e1").run([("a", 1)], now_ms=1)

    def failing(body):
        class P(VSessions):
            def process(self, keys, rows, offsets, state, exists):
                body(self, keys)
        return P()

    cases = [(lambda s, k: s.timers.register(np.arange(k.num_rows), np.full(k.num_rows, 1.5)), "takes ints"),
             (lambda s, k: s.timers.register(k.num_rows, 5), "key_index must be in"),
             (lambda s, k: s.timers.register(0, 5, "wall"), '"processing" or "event"'),
             (lambda s, k: s.timers.delete(pa.array([0, None]), 5), "nulls")]
    for i, (body, msg) in enumerate(cases):
        with pytest.raises(errors.InterfaceError, match=msg):
            Job(root, daemon.socket, failing(body), op=f"e{i + 2}").run([("a", 1)], now_ms=1)
    with pytest.raises(errors.InterfaceError, match='time_mode="none"'):
        Job(root, daemon.socket, failing(lambda s, k: s.timers.register(0, 5)), time_mode="none",
            op="e9").run([("a", 1)], now_ms=1)


class Lister(VSessions):
    def process(self, keys, rows, offsets, state, exists):
        result = super().process(keys, rows, offsets, state, exists)
        listed = self.timers.list()
        assert listed["key_index"].to_pylist() == list(range(keys.num_rows))
        assert listed["at_ms"].to_pylist() == [self.processing_time_ms + 1000] * keys.num_rows
        return result


def test_list_sees_stored_timers_and_this_batchs_changes(daemon, root):
    job = Job(root, daemon.socket, Lister(), op="list")
    job.run([("a", 1), ("b", 1)], now_ms=0)
    job.run([("a", 1), ("b", 1)], now_ms=100)  # the stored timer at 1000 deleted, 1100 registered
    assert sorted(job.run([], now_ms=5000)) == [("a", 1100, "processing", 2), ("b", 1100, "processing", 2)]


@pytest.mark.spark
def test_operator_in_spark_fires_vectorized_timers(spark, daemon, tmp_path):
    """The operator in Spark local mode: a batch without rows still runs every partition's task,
    whose due timers fire through handle_expired_timers; the state goes with them."""
    import sys

    from pyspark import cloudpickle

    from statestore_async.spark import StatefulOperator, load_state

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    root = f"file://{tmp_path}/state"
    now = [10.0]
    op = StatefulOperator(root, "vs", ["k"], VSessions(), "k string, at bigint, kind string, n bigint", N, G,
                          socket_path=daemon.socket, clock=lambda: now[0], time_mode="processing")
    out: dict = {}
    sink = lambda df, b: out.__setitem__(b, sorted(tuple(r) for r in df.collect()))
    batch = lambda rows: spark.createDataFrame(rows, "k string, v bigint")
    op.process_batch(batch([("a", 1), ("b", 1), ("b", 2), ("c", 5)]), 0, sink)
    now[0] = 10.5
    op.process_batch(batch([("a", 7)]), 1, sink)
    now[0] = 11.2
    op.process_batch(batch([]), 2, sink)
    assert out[0] == out[1] == [] and out[2] == [("b", 11_000, "processing", 2), ("c", 11_000, "processing", 1)]
    assert list(load_state(root, "vs")) == [("s", ("a",))]
    now[0] = 30.0
    op.process_batch(batch([]), 3, sink)
    assert out[3] == [("a", 11_500, "processing", 2)]
    assert load_state(root, "vs") == {}
