"""``handle_initial_state`` on the task side (issue 19): ``task.partition.run_initial_state`` — what a
Spark task runs for the operator's ``initial_state`` before the first batch — against a real
daemon, the refs it reports chained into the first batch as the driver's manifest would."""
from __future__ import annotations

import pyarrow as pa
import pytest
from test_spark_timers import G, Job, Killer, N, kg_of

from statestore_async import errors
from statestore_async.codecs import valuecodec
from statestore_async.spark.api.processors import StatefulProcessor
from statestore_async.spark.shared.routing import KG_COLUMN
from statestore_async.spark.task.partition import run_initial_state
from statestore_async.state import keys as state_keys


class InitJob(Job):
    def initial(self, rows: list[tuple[str, int]], now_ms: int, **kw) -> list[tuple]:
        """The initial state's stage: every partition's task; reports chained into ``refs`` (the
        first batch reads them); the batch number stays (the first batch is still batch 0)."""
        spec = self.spec(now_ms, None, **kw)
        out: list[tuple] = []
        self.reports = []
        for p in range(N):
            mine = [(k, v) for k, v in rows if kg_of(k) * N // G == p]
            batches = [pa.record_batch({"k": pa.array([k for k, _ in mine], pa.string()),
                                        "v": pa.array([v for _, v in mine], pa.int64()),
                                        KG_COLUMN: pa.array([kg_of(k) for k, _ in mine], pa.int32())})] if mine else []
            table = run_initial_state(self.processor, spec, p, 0, batches, self.reports.append)
            out += [tuple(r.values()) for r in table.to_pylist()]
        for r in self.reports:
            self.refs[r.partition] = r.ref
        return out


class Seeded(StatefulProcessor):
    """Initial rows (k, v) seed the count with the sum of v and a timer 1 s after the clock; rows
    add 1 each; the timer emits the count."""

    def init(self, handle):
        self.h = handle
        self.count = handle.value_state("count")
        self.seen = handle.list_state("seen", ttl_ms=10_000)

    def handle_initial_state(self, key, rows, state):
        assert self.count.get() is None  # once, before anything
        self.count.update(sum(v for (v,) in rows))
        self.seen.extend(v for (v,) in rows)
        state.timers.register(self.h.processing_time_ms + 1000)
        yield (key[0], -1, "initial", self.count.get())

    def handle_rows(self, key, rows, state):
        self.count.update((self.count.get() or 0) + len(rows))
        return ()

    def handle_expired_timer(self, key, timer, state):
        yield (key[0], timer.at_ms, timer.kind, self.count.get())


def test_initial_state_once_per_key_then_the_first_batch_reads_it(daemon, root):
    job = InitJob(root, daemon.socket, Seeded())
    out = job.initial([("a", 2), ("b", 5), ("a", 3)], now_ms=1000)
    assert sorted(out) == [("a", -1, "initial", 5), ("b", -1, "initial", 5)]
    assert {r.partition for r in job.reports} == {kg_of("a") * N // G, kg_of("b") * N // G}
    assert job.batch == 0
    # the first batch reads the initial state; a's and b's timers (2000) fire after its rows
    fired = job.run([("a", 0), ("c", 0)], now_ms=2500)
    assert sorted(fired) == [("a", 2000, "processing", 6), ("b", 2000, "processing", 5)]
    recs = job.records()
    state = {valuecodec.decode_row(k[2:]): valuecodec.decode_row(v) for k, v in recs.items() if state_keys.is_state_key(k)}
    assert state[("count", "a")] == 6 and state[("count", "b")] == 5 and state[("count", "c")] == 1
    assert [v for _, v in state[("seen", "a")][1]] == [2, 3]  # per-entry TTL: (expires, value) entries
    assert any(k[2] == state_keys.TTL_EXPIRY for k in recs)  # the initial TTL'd values are indexed
    assert not any(k[2] in (state_keys.TIMER_AT, state_keys.TIMER_KEY) for k in recs)  # fired, gone


def test_initial_state_with_its_daemon_killed_before_the_commit_is_applied_once(daemon, root):
    job = InitJob(root, daemon.socket, Seeded())
    p = kg_of("a") * N // G
    first = daemon.pid()
    out = job.initial([("a", 2), ("a", 3)], now_ms=1000, hook=Killer(0, p))
    assert out == [("a", -1, "initial", 5)]  # the retry's output only
    assert [r.timings.get("retries") for r in job.reports] == [1]
    assert daemon.pid() not in (None, first)
    recs = job.records()
    state = {valuecodec.decode_row(k[2:]): valuecodec.decode_row(v) for k, v in recs.items() if state_keys.is_state_key(k)}
    assert state[("count", "a")] == 5
    assert sum(1 for k in recs if k[2] == state_keys.TIMER_AT) == 1


def test_initial_state_needs_handle_initial_state(daemon, root):
    class NoInit(StatefulProcessor):
        def init(self, handle):
            self.v = handle.value_state("v")

        def handle_rows(self, key, rows, state):
            return ()

    with pytest.raises(errors.InterfaceError, match="handle_initial_state"):
        InitJob(root, daemon.socket, NoInit(), time_mode="none").initial([("a", 1)], now_ms=0)
    # no rows for a partition: nothing opened, nothing reported
    job = InitJob(root, daemon.socket, Seeded())
    assert job.initial([], now_ms=0) == [] and job.reports == []
