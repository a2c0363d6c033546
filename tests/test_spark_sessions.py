"""Gap-based sessionization by event time (``statestore_async.testing.sessions``): the stream is
what it claims to be, Spark's ``applyInPandasWithState`` (EventTimeTimeout) and
``transformWithStateInPandas`` (event-time timers) emit exactly the sessions a plain-Python batch
computation finds, and so does this project's operator once its timers exist. Real Spark, local
mode, file source read one file per micro-batch."""
from __future__ import annotations

import itertools
import sys
from collections import Counter

import pytest
from spark_cluster import Daemon

from statestore_async.spark.api import processors as processor_module
from statestore_async.testing import sessions as S

HAS_TIMERS = hasattr(processor_module, "ExpiredTimer")


@pytest.fixture(scope="module")
def stream() -> S.SessionStream:
    return S.generate(users=60, batches=7, seed=7)


def test_add_events_merges_runs_within_the_gap_and_split_due_closes_past_the_watermark():
    assert S.add_events([], [10_000, 12_000, 50_000], 5_500) == [(10_000, 12_000, 2), (50_000, 50_000, 1)]
    # an event between two sessions joins them into one
    assert S.add_events([(0, 1_000, 2), (9_000, 9_000, 1)], [5_000], 4_500) == [(0, 9_000, 4)]
    assert S.split_due([(0, 1_000, 2), (9_000, 9_000, 1)], 5_600, 4_500) == ([(0, 1_000, 2)], [(9_000, 9_000, 1)])
    assert S.split_due([(0, 1_000, 2)], None, 4_500) == ([], [(0, 1_000, 2)])


def test_timer_changes_move_one_timer_per_open_session():
    # a session grew (its timer moves), one closed (its timer goes), one is new
    before = [(0, 1_000, 1), (10_000, 12_000, 2)]
    after = [(10_000, 14_000, 3), (30_000, 30_000, 1)]
    assert S.timer_changes(before, after, 500) == ([1_500, 12_500], [14_500, 30_500])
    assert S.timer_changes(after, after, 500) == ([], [])


def test_the_stream_has_late_out_of_order_and_quiet_users_and_no_ties(stream):
    wm = stream.watermarks
    assert wm[0] is None and all(a is None or b >= a for a, b in itertools.pairwise(wm) if b is not None)
    late = stream.late()
    assert sum(late) > 0, "some events are late"
    for b, rows in enumerate(stream.batches):
        for _, t in rows:
            assert t % 1000 == 0 and (t + stream.gap_ms) % 1000 == 500  # a close time is never a watermark
            if wm[b] is not None and t <= wm[b]:  # late: late under the previous batch's watermark too
                assert b >= 2 and t <= wm[b - 1]
    batch_top = [max(t for _, t in rows) for rows in stream.batches]
    assert any(t < top for b, rows in enumerate(stream.batches) for _, t in rows
               if wm[b] is not None and t > wm[b] for top in [batch_top[b - 1]] if b), "out-of-order events"
    active = [{u for u, _ in rows} for rows in stream.batches]
    assert any(u not in active[b + 1] and u in active[b + 2] for b in range(len(active) - 2) for u in active[b]), \
        "users go quiet and come back"
    expected = S.sessions_of(stream)
    assert len(expected) > 50 and any(n > 1 for *_, n in expected)


@pytest.fixture
def rocksdb(spark):
    """transformWithState needs the RocksDB state store provider (set for the test, then restored)."""
    key = "spark.sql.streaming.stateStore.providerClass"
    old = spark.conf.get(key, None)
    spark.conf.set(key, S.ROCKSDB_PROVIDER)
    yield
    if old is None:
        spark.conf.unset(key)
    else:
        spark.conf.set(key, old)


def _run(spark, folder, ckpt, build) -> list:
    out: list = []
    S.run_to_end(build(S.read_stream(spark, folder)), ckpt, S.collect_into(out))
    return out


def _check(out: list, stream) -> None:
    dup = [s for s, n in Counter(out).items() if n > 1]
    assert not dup, f"sessions emitted twice: {dup[:5]}"
    assert sorted(out) == S.sessions_of(stream)


@pytest.mark.spark
def test_spark_oracles_emit_exactly_the_batch_computations_sessions(spark, rocksdb, stream, tmp_path):
    folder = str(tmp_path / "src")
    S.write_batches(stream, folder)
    gap, delay = stream.gap_ms, stream.delay_ms
    fmgws = _run(spark, folder, str(tmp_path / "c1"), lambda df: S.apply_in_pandas_with_state(df, gap, delay))
    _check(fmgws, stream)
    tws = _run(spark, folder, str(tmp_path / "c2"), lambda df: S.transform_with_state_in_pandas(df, gap, delay))
    _check(tws, stream)
    assert sorted(fmgws) == sorted(tws)


@pytest.mark.spark
@pytest.mark.skipif(not HAS_TIMERS, reason="the task runtime has no timers yet (handle.timers, handle_expired_timer)")
@pytest.mark.parametrize("vectorized", [False, True], ids=["per-key", "vectorized"])
def test_our_operator_emits_exactly_the_same_sessions(spark, stream, tmp_path, vectorized):
    from pyspark import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[S.__name__])
    folder = str(tmp_path / "src")
    S.write_batches(stream, folder)
    with Daemon() as d:
        op = S.session_operator(f"file://{tmp_path}/state", "sessions", stream.gap_ms, stream.delay_ms,
                                socket_path=d.socket, vectorized=vectorized)
        out: list = []
        S.run_to_end(S.read_stream(spark, folder), str(tmp_path / "c"), op.foreach_batch(S.collect_into(out)))
    _check(out, stream)
    assert [p.late_rows for p in op.history] == [*stream.late(), 0]
    assert [p.watermark_ms for p in op.history] == stream.watermarks


@pytest.mark.spark
@pytest.mark.skipif(not HAS_TIMERS, reason="the task runtime has no timers yet (handle.timers, handle_expired_timer)")
def test_a_timer_at_the_watermark_fires_a_group_state_timeout_does_not(spark, rocksdb, tmp_path):
    """What docs/PORTING.md's ``+ 1`` rests on: a session of ``a`` closes at 15 s and the watermark
    reaches exactly 15 s in the last batch. transformWithState's timer and ours fire (``at <=
    watermark``); applyInPandasWithState's timeout does not (``timeout < watermark``)."""
    from pyspark import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[S.__name__])
    tie = S.SessionStream([[("a", 10_000)], [("b", 15_000)]], gap_ms=5_000, delay_ms=0,
                          watermarks=[None, 10_000, 15_000])
    folder = str(tmp_path / "src")
    S.write_batches(tie, folder)
    tws = _run(spark, folder, str(tmp_path / "c1"), lambda df: S.transform_with_state_in_pandas(df, 5_000, 0))
    aipws = _run(spark, folder, str(tmp_path / "c2"), lambda df: S.apply_in_pandas_with_state(df, 5_000, 0))
    with Daemon() as d:
        op = S.session_operator(f"file://{tmp_path}/state", "tie", 5_000, 0, socket_path=d.socket)
        ours: list = []
        S.run_to_end(S.read_stream(spark, folder), str(tmp_path / "c3"), op.foreach_batch(S.collect_into(ours)))
    assert tws == ours == [("a", 10_000, 10_000, 1)] == S.sessions_of(tie)
    assert aipws == []
    assert op.history[-1].watermark_ms == 15_000


@pytest.mark.spark
def test_the_benchmarks_checksum_sink_agrees_with_the_python_checksum(spark, stream):
    sessions = S.sessions_of(stream)
    df = spark.createDataFrame(sessions, S.OUTPUT_SCHEMA)
    out: list = []
    S.checksum_into(out)(df, 0)
    S.checksum_into(out)(df.limit(0), 1)
    assert out == [S.checksum(sessions), (0, 0)]
    assert S.checksum(sessions[1:]) != S.checksum(sessions)
    assert S.checksum([(u, s, e, n + 1) for u, s, e, n in sessions]) != S.checksum(sessions)
