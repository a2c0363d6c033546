"""Timers fire at the end of a run: time-only batches under ``Trigger.AvailableNow`` and ``Once``;
processor declarations checked when the operator is made (issue 39).

``foreachBatch`` runs only when a batch has rows, so the sessions that the last batch's watermark
closes would never be emitted by an ``AvailableNow`` run. The operator runs a time-only batch
(``spark.driver.batches``) after a data batch of such a run whose watermark moved: here the stream has no
trailing empty batch and no heartbeat source, and one run emits exactly the oracle's sessions. A
state written with time-only batches off (as every release before them) is finished the same way by
one run with them on.
"""
from __future__ import annotations

import sys
from collections import Counter

import pytest

from statestore_async.spark.api.examples import CountSum, VectorizedCountSum
from statestore_async.spark.driver import batches as B
from statestore_async.testing import sessions as S

pytestmark = pytest.mark.spark


@pytest.fixture(autouse=True)
def _pickle_sessions_by_value():
    from pyspark import cloudpickle

    cloudpickle.register_pickle_by_value(S)
    cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _run(spark, src, ckpt, op, sink, trigger=None):
    w = (S.read_stream(spark, src).writeStream.outputMode("update").foreachBatch(op.foreach_batch(sink))
         .option("checkpointLocation", ckpt))
    q = w.trigger(**(trigger or {"availableNow": True})).start()
    q.awaitTermination(600)
    assert not q.isActive
    assert q.exception() is None, q.exception()
    return q


@pytest.mark.parametrize("vectorized", [False, True], ids=["per-key", "vectorized"])
def test_available_now_emits_every_session_in_one_run(spark, daemon, tmp_path, vectorized):
    stream = S.generate(users=80, batches=5, seed=23)
    src = str(tmp_path / "src")
    S.write_batches(stream, src, trailing_empty=False)  # no trailing batch: the run must flush by itself
    out: list = []
    ids: list = []
    op = S.session_operator(f"file://{tmp_path}/state", "sessions", stream.gap_ms, stream.delay_ms,
                            socket_path=daemon.socket, vectorized=vectorized)
    q = _run(spark, src, str(tmp_path / "ckpt"), op, S.collect_into(out, ids))
    assert sorted(out) == S.sessions_of(stream)
    assert not [s for s, c in Counter(out).items() if c > 1]
    # Spark ran 5 data batches; the operator's time-only batches came after them, each with its own
    # manifest version and sink batch id (in order, none twice)
    assert q.lastProgress["batchId"] == len(stream.batches) - 1
    assert len(op.history) == len(stream.batches) and not any(p.time_only for p in op.history)
    steps = [x for p in op.history for x in (p, p.time_only_after) if x is not None]
    time_only = [p for p in steps if p.time_only]
    assert time_only and ids == sorted(set(ids)) == [p.sink_batch_id for p in steps]
    assert [p.version for p in steps] == list(range(1, len(steps) + 1))
    assert op.history[-1].time_only_after is time_only[-1]
    assert time_only[-1].watermark_ms == stream.final_watermark
    # the figures a user reads beside query.lastProgress (Spark's names where they mean the same)
    fig = op.last_progress.figures()
    assert fig["numInputRows"] + fig["numRowsDroppedByWatermark"] == len(stream.batches[-1])
    assert fig["numRowsUpdated"] > 0 and fig["watermarkMs"] == stream.watermarks[-2]
    assert fig["timeOnlyBatch"]["numTimersFired"] > 0 and fig["timeOnlyBatch"]["timeOnly"]


def test_a_state_written_without_time_only_batches_is_finished_by_one_run(spark, daemon, tmp_path):
    stream = S.generate(users=80, batches=5, seed=29)
    src = str(tmp_path / "src")
    S.write_batches(S.SessionStream(stream.batches[:3], stream.gap_ms, stream.delay_ms, stream.watermarks[:4]), src,
                    trailing_empty=False)
    root, ckpt = f"file://{tmp_path}/state", str(tmp_path / "ckpt")
    out: list = []
    ids: list = []
    old = S.session_operator(root, "sessions", stream.gap_ms, stream.delay_ms, socket_path=daemon.socket,
                             time_only_batches="off")  # manifests as every release before time-only batches
    _run(spark, src, ckpt, old, S.collect_into(out, ids))
    assert ids == [0, 1, 2] and not any(p.time_only_after for p in old.history)
    S.write_batches(stream, src, trailing_empty=False)  # the rest of the stream arrives (files 3, 4)
    new = S.session_operator(root, "sessions", stream.gap_ms, stream.delay_ms, socket_path=daemon.socket)
    _run(spark, src, ckpt, new, S.collect_into(out, ids))
    assert sorted(out) == S.sessions_of(stream)
    assert ids[:4] == [0, 1, 2, 3] and ids == sorted(set(ids))


def test_once_fires_the_timers_its_batch_made_due(spark, daemon, tmp_path):
    stream = S.generate(users=60, batches=1, seed=31, step_s=200)  # one batch whose watermark closes sessions
    src = str(tmp_path / "src")
    S.write_batches(stream, src, trailing_empty=False)
    out: list = []
    ids: list = []
    op = S.session_operator(f"file://{tmp_path}/state", "sessions", stream.gap_ms, stream.delay_ms,
                            socket_path=daemon.socket)
    _run(spark, src, str(tmp_path / "ckpt"), op, S.collect_into(out, ids), trigger={"once": True})
    assert sorted(out) == S.sessions_of(stream) and S.sessions_of(stream)
    assert ids == [0, 1] and len(op.history) == 1 and op.history[0].time_only_after.sink_batch_id == 1


def test_a_run_with_time_only_batches_off_leaves_the_last_timers_as_before(spark, daemon, tmp_path):
    stream = S.generate(users=60, batches=3, seed=37)
    src = str(tmp_path / "src")
    S.write_batches(stream, src, trailing_empty=False)
    out: list = []
    ids: list = []
    op = S.session_operator(f"file://{tmp_path}/state", "sessions", stream.gap_ms, stream.delay_ms,
                            socket_path=daemon.socket, time_only_batches="off")
    _run(spark, src, str(tmp_path / "ckpt"), op, S.collect_into(out, ids))
    assert ids == [0, 1, 2]
    assert set(out) < set(S.sessions_of(stream))  # the final watermark's sessions wait for a next batch


@pytest.mark.parametrize(("setting", "trigger", "conf", "wanted"), [
    ("auto", "AvailableNowTrigger", {}, True),
    ("auto", "OneTimeTrigger", {}, True),
    ("auto", "ProcessingTimeTrigger(1000)", {}, False),
    ("auto", None, {}, False),  # outside a query, or no JVM
    ("off", "AvailableNowTrigger", {}, False),
    ("auto", "AvailableNowTrigger", {B.NO_DATA_BATCHES_CONF: "false"}, False),
])
def test_which_runs_get_time_only_batches(setting, trigger, conf, wanted):
    assert B.time_only_wanted(setting, trigger, conf) is wanted


def test_time_only_batches_setting_is_checked(tmp_path):
    from statestore_async.errors import InterfaceError
    from statestore_async.spark.driver.operator import StatefulOperator

    with pytest.raises(InterfaceError, match="time_only_batches must be one of auto, off"):
        StatefulOperator(f"file://{tmp_path}", "op", ["k"], CountSum(), "k string, count bigint, sum bigint", 2,
                         time_only_batches="always")


class _NoState(CountSum):
    def init(self, handle):
        self.n = 0


class _Broken(CountSum):
    def init(self, handle):
        self.total = handle.value_state("total")
        self.limit = handle.config["limit"]  # no such attribute: fails on the driver, not in a task


class _NoSchema(VectorizedCountSum):
    state_schema = "count long, sum long"


@pytest.mark.parametrize(("processor", "why"), [
    (_NoState(), "declared no state"),
    (_Broken(), "init\\(handle\\) failed .* AttributeError"),
    (_NoSchema(), "state_schema must be a pyarrow.Schema"),
])
def test_processor_declarations_are_checked_when_the_operator_is_made(tmp_path, processor, why):
    from statestore_async.errors import StateDeclarationError
    from statestore_async.spark.driver.operator import StatefulOperator

    with pytest.raises(StateDeclarationError, match=why):
        StatefulOperator(f"file://{tmp_path}", "op", ["k"], processor, "k string, count bigint, sum bigint", 2)
