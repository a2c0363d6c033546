"""Timers and TTL cleanup in the task runtime (issue 19), against a real daemon.

Most tests run ``task.partition.run_partition`` itself — what a Spark task runs — with a ``TaskSpec`` the
test makes (so it sets the batch clock and the watermark), feeding the partitions' rows as Arrow
batches routed as the JVM routes them, and chaining each batch's committed refs into the next as
the driver's manifest would. One test runs the whole ``StatefulOperator`` in Spark local mode.
Checkpoint files are read back with the loader (no daemon) to see what a batch really committed.
"""
from __future__ import annotations

import asyncio
import signal

import pyarrow as pa
import pytest

from statestore_async import errors
from statestore_async.codecs import pyrows, valuecodec
from statestore_async.files.loader import load_store
from statestore_async.ids import EMPTY_STATE, StoreId
from statestore_async.objectstore import open_object_store
from statestore_async.spark.api.processors import StatefulProcessor
from statestore_async.spark.shared import placement
from statestore_async.spark.shared.routing import KG_COLUMN
from statestore_async.spark.shared.taskspec import TaskSpec
from statestore_async.spark.task.partition import run_partition
from statestore_async.state import keys as state_keys

N, G = 2, 16
OUT = pa.schema([("k", pa.string()), ("at", pa.int64()), ("kind", pa.string()), ("n", pa.int64())])


def kg_of(k: str) -> int:
    return int.from_bytes(pyrows.encode_keys([(k,)], ["string"], G)[0][:2], "big")


class Job:
    """Batches of one operator run partition by partition with ``run_partition``; refs chained."""

    def __init__(self, root: str, socket: str, processor, time_mode: str = "processing", out=OUT, op: str = "timers"):
        self.root, self.socket, self.processor, self.time_mode, self.out, self.op = root, socket, processor, time_mode, out, op
        self.refs = [EMPTY_STATE] * N
        self.batch = 0
        self.reports: list = []

    def spec(self, now_ms: int, watermark_ms: int | None = None, **kw) -> TaskSpec:
        return TaskSpec(root=self.root, operator_id=self.op, key_columns=("k",), value_columns=("v",),
                        output_schema=self.out, num_partitions=N, num_key_groups=G, batch_id=self.batch,
                        refs=tuple(self.refs), now_ms=now_ms, socket_path=self.socket, time_mode=self.time_mode,
                        watermark_ms=watermark_ms, **kw)

    def run(self, rows: list[tuple[str, int]], now_ms: int, watermark_ms: int | None = None, **kw) -> list[tuple]:
        """One batch: every partition's task (with or without rows); the output rows, partition by partition."""
        spec = self.spec(now_ms, watermark_ms, **kw)
        out: list[tuple] = []
        self.reports = []
        for p in range(N):
            mine = [(k, v) for k, v in rows if kg_of(k) * N // G == p]
            batches = [pa.record_batch({"k": pa.array([k for k, _ in mine], pa.string()),
                                        "v": pa.array([v for _, v in mine], pa.int64()),
                                        KG_COLUMN: pa.array([kg_of(k) for k, _ in mine], pa.int32())})] if mine else []
            table = run_partition(self.processor, spec, p, 0, batches, self.reports.append)
            out += [tuple(r.values()) for r in table.to_pylist()]
        for r in self.reports:
            self.refs[r.partition] = r.ref
        self.batch += 1
        return out

    def records(self) -> dict[bytes, bytes]:
        """Every record of the committed state, read from the checkpoint files (no daemon)."""
        client = placement.connect(self.socket)
        for p, ref in enumerate(self.refs):  # the fence's job: every committed delta is in the files
            if not ref.is_empty_state:
                assert client.await_durable(StoreId(self.root, self.op, p), ref, 60)

        async def go():
            out: dict[bytes, bytes] = {}
            async with open_object_store(self.root) as store:
                for p, ref in enumerate(self.refs):
                    if not ref.is_empty_state:
                        vs, _ = await load_store(store, StoreId(self.root, self.op, p), ref)
                        out.update(vs.items())
            return out

        return asyncio.run(go())


class Sessions(StatefulProcessor):
    """Counts rows per key; each batch with rows moves the key's one timer to 1 s after the batch;
    the timer emits the count and clears it."""

    def init(self, handle):
        self.h = handle
        self.count = handle.value_state("count")

    def handle_rows(self, key, rows, state):
        self.count.update((self.count.get() or 0) + len(rows))
        for t in state.timers.list():
            state.timers.delete(t)
        state.timers.register(self.h.processing_time_ms + 1000)
        return ()

    def handle_expired_timer(self, key, timer, state):
        assert state.timers.list() == []  # the fired timer is gone before the call
        yield (key[0], timer.at_ms, timer.kind, self.count.get())
        self.count.clear()


def test_timers_fire_once_in_time_order_for_idle_keys_too(daemon, root):
    job = Job(root, daemon.socket, Sessions())
    assert job.run([("a", 1), ("b", 1), ("c", 1), ("c", 2)], now_ms=10_000) == []
    assert job.run([("a", 1)], now_ms=10_500) == []  # a's timer moves to 11 500
    # no rows at all: every partition's task still runs and fires b's and c's timers
    fired = job.run([], now_ms=11_200)
    assert sorted(fired) == [("b", 11_000, "processing", 1), ("c", 11_000, "processing", 2)]
    assert {r.partition for r in job.reports} == {kg_of("b") * N // G, kg_of("c") * N // G}
    assert job.run([], now_ms=12_000) == [("a", 11_500, "processing", 2)]
    assert job.run([], now_ms=99_000) == []  # each fired once
    assert not job.reports  # nothing due: no partition committed, the refs stay
    recs = job.records()
    assert not any(k[2] in (state_keys.TIMER_AT, state_keys.TIMER_KEY) for k in recs)  # fired timers are gone from the files


class Multi(StatefulProcessor):
    """Registers the times given as rows; a timer registered by a callback at a due time fires a
    batch later; one registered by handle_rows at a due time fires in the same batch."""

    def init(self, handle):
        self.h = handle
        self.seen = handle.value_state("seen")

    def handle_rows(self, key, rows, state):
        self.seen.update(True)
        for (at,) in rows:
            state.timers.register(at)

    def handle_expired_timer(self, key, timer, state):
        if timer.at_ms == 5:
            state.timers.register(1)  # already due: fires next batch, not in this one
        return [(key[0], timer.at_ms, timer.kind, len(state.timers.list()))]


def test_time_order_within_a_partition_and_callbacks_registering_due_timers(daemon, root):
    job = Job(root, daemon.socket, Multi())
    keys = [k for k in "abcdefgh" if kg_of(k) * N // G == 0][:3]
    assert len(keys) >= 2
    rows = [(keys[0], 30), (keys[0], 5), (keys[1], 20), (keys[1], 10_000)] + [(k, 7) for k in keys[2:]]
    out = job.run(rows, now_ms=100)  # registered by handle_rows at due times: fire in this batch, in time order
    assert [r[:2] for r in out] == sorted([(keys[0], 5), (keys[0], 30), (keys[1], 20)] + [(k, 7) for k in keys[2:]],
                                          key=lambda r: r[1])
    nxt = job.run([], now_ms=200)
    assert nxt == [(keys[0], 1, "processing", 0)]  # the callback's due timer, one batch later
    assert job.run([], now_ms=20_000) == [(keys[1], 10_000, "processing", 0)]


class EventTimers(StatefulProcessor):
    def init(self, handle):
        self.h = handle
        self.last = handle.value_state("last")

    def handle_rows(self, key, rows, state):
        assert self.h.watermark_ms == self.expect_wm
        t = max(v for (v,) in rows)
        self.last.update(t)
        state.timers.register(t + 100)  # kind None: the operator's time mode, event

    def handle_expired_timer(self, key, timer, state):
        yield (key[0], timer.at_ms, timer.kind, self.last.get())


def test_event_time_timers_wait_for_the_watermark(daemon, root):
    proc = EventTimers()
    job = Job(root, daemon.socket, proc, time_mode="event")
    proc.expect_wm = None
    assert job.run([("a", 1000), ("b", 2000)], now_ms=10**12) == []  # no watermark yet: nothing due
    proc.expect_wm = 1050
    assert job.run([], now_ms=10**12, watermark_ms=1050) == []
    assert job.run([], now_ms=10**12, watermark_ms=1100) == [("a", 1100, "event", 1000)]
    assert job.run([], now_ms=10**12, watermark_ms=5000) == [("b", 2100, "event", 2000)]


def test_timer_misuse_gets_typed_errors(daemon, root):
    class NoCallback(StatefulProcessor):
        def init(self, handle):
            self.v = handle.value_state("v")

        def handle_rows(self, key, rows, state):
            state.timers.register(5, "processing")

    with pytest.raises(errors.InterfaceError, match="handle_expired_timer"):
        Job(root, daemon.socket, NoCallback()).run([("a", 1)], now_ms=1)

    class BadKind(Sessions):
        def handle_rows(self, key, rows, state):
            state.timers.register(5, "wall")

    with pytest.raises(errors.InterfaceError, match='"processing" or "event"'):
        Job(root, daemon.socket, BadKind(), op="bad1").run([("a", 1)], now_ms=1)

    class NoMode(Sessions):
        def handle_rows(self, key, rows, state):
            state.timers.register(5)

    with pytest.raises(errors.InterfaceError, match='time_mode="none"'):
        Job(root, daemon.socket, NoMode(), time_mode="none", op="bad2").run([("a", 1)], now_ms=1)

    class BadTime(Sessions):
        def handle_rows(self, key, rows, state):
            state.timers.register(1.5)

    with pytest.raises(errors.InterfaceError, match="int of milliseconds"):
        Job(root, daemon.socket, BadTime(), op="bad3").run([("a", 1)], now_ms=1)


class Killer:
    """A fault hook (pickled in the spec like the product's): SIGKILL the daemon at the first try's
    ``before_commit`` of ``partition`` in ``batch``."""

    def __init__(self, batch: int, partition: int):
        self.batch, self.partition = batch, partition

    def __call__(self, site):
        if site.point == "before_commit" and site.batch == self.batch and site.partition == self.partition \
                and site.retry == 0:
            placement.stop_daemon(site.socket_path, signal.SIGKILL, timeout=10)


def test_daemon_killed_mid_batch_fires_each_timer_once(daemon, root):
    """The daemon dies after the timers' callbacks ran, before the commit: the task retries from
    the last committed state on a new daemon, which loads the timers from the files; each timer
    fires exactly once in the output of the batch and is gone after it."""
    job = Job(root, daemon.socket, Sessions())
    keys = [k for k in "abcdefghijkl" if kg_of(k) * N // G == 1][:3]
    job.run([(k, 1) for k in keys], now_ms=1000)
    job.records()  # the driver's fence: batch 0 is in the files before batch 1 runs
    first = daemon.pid()
    fired = job.run([], now_ms=5000, hook=Killer(1, 1))
    assert sorted(fired) == sorted((k, 2000, "processing", 1) for k in keys)
    assert [r.timings.get("retries") for r in job.reports] == [1]
    assert daemon.pid() not in (None, first)
    assert job.run([], now_ms=9000) == []  # not twice
    recs = job.records()
    assert not any(len(k) > 2 and k[2] in (state_keys.TIMER_AT, state_keys.TIMER_KEY) for k in recs)
    assert not any(valuecodec.decode_row(k[2:])[0] == "count" for k in recs if state_keys.is_state_key(k))


class Remember(StatefulProcessor):
    def init(self, handle):
        self.last = handle.value_state("last", ttl_ms=1000)
        self.seen = handle.list_state("seen", ttl_ms=5000)

    def handle_rows(self, key, rows, state):
        self.last.update(rows[-1][0])
        self.seen.extend(v for (v,) in rows)
        return [(key[0], 0, "rows", len(rows))]


def test_ttl_entries_of_keys_never_seen_again_are_gone_from_the_files(daemon, root):
    out = pa.schema([("k", pa.string()), ("at", pa.int64()), ("kind", pa.string()), ("n", pa.int64())])
    job = Job(root, daemon.socket, Remember(), time_mode="none", out=out, op="ttl")
    job.run([("x", 1), ("y", 2), ("z", 3)], now_ms=0)
    recs = job.records()
    ttl_index = [k for k in recs if k[2] == state_keys.TTL_EXPIRY]
    assert len(ttl_index) == 6  # one per TTL'd value
    job.run([("z", 4)], now_ms=500)  # z refreshed at 500: expires at 1500 and 5500
    job.run([], now_ms=1200)  # x's and y's "last" expired at 1000; z's still live
    removed = sum(r.timings.get("ttl_removed", 0) for r in job.reports)
    assert removed == 2
    recs = job.records()
    names = sorted((valuecodec.decode_row(k[2:])[0], valuecodec.decode_row(k[2:])[1]) for k in recs
                   if state_keys.is_state_key(k))
    assert names == [("last", "z"), ("seen", "x"), ("seen", "y"), ("seen", "z")]
    job.run([], now_ms=6000)  # everything expired: state and index are empty in the files
    recs = job.records()
    assert recs == {}


@pytest.mark.spark
def test_operator_in_spark_fires_timers_of_idle_keys_and_cleans_ttl(spark, daemon, tmp_path):
    """The whole operator in Spark local mode: batches with rows register timers and TTL'd values;
    a batch with no rows still runs every partition's task, whose timers fire and whose expired
    values go; the manifest records the partitions that changed."""
    import sys

    from pyspark import cloudpickle

    from statestore_async.spark import StatefulOperator, load_state

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    root = f"file://{tmp_path}/state"
    now = [10.0]
    op = StatefulOperator(root, "sessions", ["k"], SessionsTTL(), "k string, at bigint, kind string, n bigint", N, G,
                          socket_path=daemon.socket, clock=lambda: now[0], time_mode="processing")
    out: dict = {}
    sink = lambda df, b: out.__setitem__(b, sorted(tuple(r) for r in df.collect()))
    batch = lambda rows: spark.createDataFrame(rows, "k string, v bigint")
    op.process_batch(batch([("a", 1), ("b", 1), ("b", 2), ("c", 5)]), 0, sink)
    assert out[0] == []
    now[0] = 10.5
    op.process_batch(batch([("a", 7)]), 1, sink)
    assert out[1] == []
    now[0] = 11.2  # b's and c's timers (11 000) are due; a's moved to 11 500; nothing has rows
    op.process_batch(batch([]), 2, sink)
    assert out[2] == [("b", 11_000, "processing", 2), ("c", 11_000, "processing", 1)]
    state = load_state(root, "sessions")
    assert sorted(k for (name, k) in state if name == "count") == [("a",)]
    now[0] = 30.0  # a's timer fires; every TTL'd "last" (10 s) has expired: the files hold nothing
    op.process_batch(batch([]), 3, sink)
    assert out[3] == [("a", 11_500, "processing", 2)]
    assert load_state(root, "sessions") == {}
    assert sum(t.get("ttl_removed", 0) for t in op.last_progress.tasks.values()) == 3


class SessionsTTL(Sessions):
    def init(self, handle):
        super().init(handle)
        self.last = handle.value_state("last", ttl_ms=10_000)

    def handle_rows(self, key, rows, state):
        self.last.update(rows[-1][0])
        return super().handle_rows(key, rows, state)


class EventSessions(StatefulProcessor):
    """Each key's timer at its latest event time + 100 ms (event time: fires once the watermark passes)."""

    def init(self, handle):
        self.last = handle.value_state("last")

    def handle_rows(self, key, rows, state):
        for t in state.timers.list():
            state.timers.delete(t)
        self.last.update(max(ts for (ts,) in rows))
        state.timers.register(self.last.get() + 100)

    def handle_expired_timer(self, key, timer, state):
        yield (key[0], timer.at_ms, timer.kind, self.last.get())


@pytest.mark.spark
def test_operator_event_time_timers_follow_the_drivers_watermark(spark, daemon, tmp_path):
    """Through the operator: batch b's watermark is max event time of batches < b minus the delay,
    and an event-time timer fires in the first batch whose watermark reaches it — a batch without rows too."""
    import sys
    from datetime import timedelta

    from pyspark import cloudpickle

    from statestore_async.spark import StatefulOperator

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    op = StatefulOperator(f"file://{tmp_path}/state", "ev", ["k"], EventSessions(),
                          "k string, at bigint, kind string, n bigint", N, G, socket_path=daemon.socket,
                          time_mode="event", event_time_column="ts", watermark_delay=timedelta(milliseconds=50))
    out: dict = {}
    sink = lambda df, b: out.__setitem__(b, sorted(tuple(r) for r in df.collect()))
    batch = lambda rows: spark.createDataFrame(rows, "k string, ts bigint")
    op.process_batch(batch([("a", 1000), ("b", 1200)]), 0, sink)  # timers a@1100, b@1300; watermark None
    op.process_batch(batch([("c", 1160)]), 1, sink)  # watermark 1200 - 50 = 1150: a fires, c@1260 set
    assert out[0] == [] and out[1] == [("a", 1100, "event", 1000)]
    op.process_batch(batch([("d", 1400)]), 2, sink)  # watermark 1150 still (max of batches < 2 is 1200)
    assert out[2] == []
    op.process_batch(batch([]), 3, sink)  # watermark 1400 - 50 = 1350: c@1260 and b@1300 fire, in time order
    assert out[3] == [("b", 1300, "event", 1200), ("c", 1260, "event", 1160)]
