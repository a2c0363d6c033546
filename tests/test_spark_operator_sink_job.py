"""``materialize="none"``, and ``"auto"`` with a sink marked as reading its output once
(``sinks.one_action``, ``sinks.write_sink``): the sink's action runs the stateful stage (one Spark
job per batch).

The state stays exactly-once: every partition's task must run to its end exactly once inside the
sink's action (else ``OutputReadError`` and nothing is committed), the fence and the manifest
come after the sink, and a batch whose sink fails is replayed from the same manifest.
"""
from __future__ import annotations

import os
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from statestore_async import errors
from statestore_async.spark import StatefulOperator, load_state
from statestore_async.spark.api.examples import CountSum
from statestore_async.spark.api.sinks import ReplayUnsafeSinkError, for_writer, one_action, write_sink
from statestore_async.spark.driver.errors import OutputReadError

OUT = "key string, count bigint, sum bigint"
pytestmark = pytest.mark.spark


class _Runs(CountSum):
    """CountSum that appends a line to ``path`` each time a task runs it."""

    def __init__(self, path):
        self.path = path

    def init(self, handle):
        from pyspark import TaskContext

        if TaskContext.get() is not None:  # not the operator's check of the declarations, on the driver
            with open(self.path, "a") as f:
                f.write("run\n")
        super().init(handle)


@pytest.fixture(autouse=True)
def _pickle_this_module_by_value():
    from pyspark import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _batch(spark, n=70, keys=7):
    return spark.createDataFrame([(f"k{i % keys}", i) for i in range(n)], "key string, value bigint")


def _manifests(tmp_path, op_id):
    folder = tmp_path / "s" / op_id / "_commits"
    return sorted(int(p.name.split(".")[0]) for p in folder.iterdir()) if folder.exists() else []


def _state(tmp_path, op_id):
    return {k[0]: v for (_, k), v in load_state(f"file://{tmp_path}/s", op_id).items()}


def test_the_sinks_write_runs_the_stage_once_and_commits_after_it(spark, daemon, tmp_path):
    runs = tmp_path / "runs"
    op = StatefulOperator(f"file://{tmp_path}/s", "fused", ["key"], _Runs(str(runs)), OUT, 2, 16,
                          socket_path=daemon.socket, materialize="none")
    seen, manifests_at_sink = {}, {}

    def sink(df, b):
        manifests_at_sink[b] = _manifests(tmp_path, "fused")
        seen[b] = sorted(tuple(r) for r in df.collect())

    for b in range(2):
        prog = op.process_batch(_batch(spark), b, sink)
        assert prog.partitions_committed == 2 and prog.sink > 0 and prog.compute >= prog.sink
    assert seen[1] == [(f"k{j}", 20, 2 * sum(range(j, 70, 7))) for j in range(7)]
    assert runs.read_text().count("run") == 2 * 2  # 2 partitions x 2 batches: only the sink's action ran them
    # the sink ran before its batch's manifest: batch b's sink saw manifests up to b only
    assert manifests_at_sink == {0: [], 1: [1]}
    assert _manifests(tmp_path, "fused") == [1, 2]
    assert _state(tmp_path, "fused") == {f"k{j}": (20, 2 * sum(range(j, 70, 7))) for j in range(7)}


def test_a_sink_that_reads_nothing_still_advances_the_state(spark, daemon, tmp_path):
    op = StatefulOperator(f"file://{tmp_path}/s", "idle", ["key"], CountSum(), OUT, 2, 16,
                          socket_path=daemon.socket, materialize="none")
    called = []
    op.process_batch(_batch(spark), 0, lambda df, b: called.append(b))
    assert called == [0] and _manifests(tmp_path, "idle") == [1]
    assert _state(tmp_path, "idle") == {f"k{j}": (10, sum(range(j, 70, 7))) for j in range(7)}


@pytest.mark.parametrize("reads", ["twice", "part"])
def test_a_sink_that_does_not_read_the_output_exactly_once_commits_nothing(spark, daemon, tmp_path, reads):
    op = StatefulOperator(f"file://{tmp_path}/s", "misread", ["key"], CountSum(), OUT, 2, 16,
                          socket_path=daemon.socket, materialize="none")
    op.process_batch(_batch(spark), 0, lambda df, b: df.collect())

    def sink(df, b):
        if reads == "twice":
            df.collect()
            df.collect()
        else:  # the first partition only (as a take() may read)
            spark.sparkContext.runJob(df.rdd, lambda rows: [sum(1 for _ in rows)], [0])

    with pytest.raises(OutputReadError, match="exactly once" if reads == "twice" else "not read to the end") as exc:
        op.process_batch(_batch(spark), 1, sink)
    assert "materialize='checkpoint'" in str(exc.value) and isinstance(exc.value, errors.InterfaceError)
    assert _manifests(tmp_path, "misread") == [1]  # batch 1 committed nothing
    # Spark's replay of batch 1 (a sink that writes once) starts again from manifest 1
    op.process_batch(_batch(spark), 1, lambda df, b: df.collect())
    assert _state(tmp_path, "misread") == {f"k{j}": (20, 2 * sum(range(j, 70, 7))) for j in range(7)}


def test_a_failing_sink_leaves_the_batch_to_be_replayed(spark, daemon, tmp_path):
    op = StatefulOperator(f"file://{tmp_path}/s", "failing", ["key"], CountSum(), OUT, 2, 16,
                          socket_path=daemon.socket, materialize="none")
    op.process_batch(_batch(spark), 0, lambda df, b: df.collect())

    def failing(df, b):
        df.collect()
        raise RuntimeError("the sink's system is down")

    with pytest.raises(RuntimeError, match="down"):
        op.process_batch(_batch(spark), 1, failing)
    assert _manifests(tmp_path, "failing") == [1]
    out = []
    op.process_batch(_batch(spark), 1, lambda df, b: out.extend(df.collect()))
    assert sorted(tuple(r) for r in out) == [(f"k{j}", 20, 2 * sum(range(j, 70, 7))) for j in range(7)]
    assert _state(tmp_path, "failing") == {f"k{j}": (20, 2 * sum(range(j, 70, 7))) for j in range(7)}


def test_a_streaming_query_with_the_sink_job(spark, daemon, tmp_path):
    """foreachBatch with ``materialize="none"`` and a sink that writes parquet per batch: the
    state and the files hold every row once."""
    src, out = tmp_path / "in", tmp_path / "out"
    src.mkdir()
    for b in range(3):
        t = pa.table({"key": [f"k{i % 5}" for i in range(50)], "value": pa.array(range(50), pa.int64())})
        pq.write_table(t, src / f"b{b}.parquet")
        os.utime(src / f"b{b}.parquet", (1_000_000 + b,) * 2)
    op = StatefulOperator(f"file://{tmp_path}/s", "stream", ["key"], CountSum(), OUT, 2, 16,
                          socket_path=daemon.socket, materialize="none")

    def sink(df, b):
        df.write.mode("overwrite").parquet(str(out / str(b)))

    q = (spark.readStream.schema("key string, value bigint").option("maxFilesPerTrigger", 1).parquet(str(src))
         .writeStream.foreachBatch(op.foreach_batch(sink)).option("checkpointLocation", str(tmp_path / "ckpt"))
         .trigger(availableNow=True).start())
    q.awaitTermination(300)
    assert q.exception() is None
    assert _state(tmp_path, "stream") == {f"k{j}": (30, 3 * sum(range(j, 50, 5))) for j in range(5)}
    last = sorted(tuple(r) for r in spark.read.parquet(str(out / "2")).collect())
    assert last == [(f"k{j}", 30, 3 * sum(range(j, 50, 5))) for j in range(5)]


def test_output_path_and_no_materialization_exclude_each_other(tmp_path):
    with pytest.raises(errors.InterfaceError, match="output_path"):
        StatefulOperator(str(tmp_path), "op", ["k"], CountSum(), OUT, 2, output_path=str(tmp_path / "o"),
                         materialize="none")


# -- sinks marked as reading their output once: materialize="auto" (the default) keeps no copy --

def test_auto_resolves_to_the_sink_job_only_for_a_marked_sink(spark, tmp_path):
    plain = lambda df, b: None
    marked = one_action(plain)
    auto = StatefulOperator(str(tmp_path), "m", ["k"], CountSum(), OUT, 2)
    assert auto.materialize_mode(spark, marked) == "none" and auto.materialize_mode(spark, write_sink("noop")) == "none"
    assert auto.materialize_mode(spark, plain) == "checkpoint" and auto.materialize_mode(spark) == "checkpoint"
    # an explicit mode, or output_path (parquet files for the sink), is kept whatever the sink says
    assert StatefulOperator(str(tmp_path), "m", ["k"], CountSum(), OUT, 2,
                            materialize="cache").materialize_mode(spark, marked) == "cache"
    assert StatefulOperator(str(tmp_path), "m", ["k"], CountSum(), OUT, 2,
                            output_path=str(tmp_path / "o")).materialize_mode(spark, marked) == "checkpoint"
    assert one_action(marked) is marked and repr(marked).startswith("one_action(")


def test_a_marked_sink_runs_the_stage_once_and_the_state_commits_after_it(spark, daemon, tmp_path):
    runs = tmp_path / "runs"
    op = StatefulOperator(f"file://{tmp_path}/s", "marked", ["key"], _Runs(str(runs)), OUT, 2, 16,
                          socket_path=daemon.socket)
    seen, manifests_at_sink = {}, {}

    @one_action
    def sink(df, b):
        manifests_at_sink[b] = _manifests(tmp_path, "marked")
        seen[b] = sorted(tuple(r) for r in df.collect())

    for b in range(2):
        assert op.process_batch(_batch(spark), b, sink).partitions_committed == 2
    assert seen[1] == [(f"k{j}", 20, 2 * sum(range(j, 70, 7))) for j in range(7)]
    assert runs.read_text().count("run") == 2 * 2  # only the sink's action ran the tasks: no kept copy, no second job
    assert manifests_at_sink == {0: [], 1: [1]}
    assert _state(tmp_path, "marked") == {f"k{j}": (20, 2 * sum(range(j, 70, 7))) for j in range(7)}


def test_a_marked_sink_that_reads_twice_commits_nothing_and_says_to_drop_the_mark(spark, daemon, tmp_path):
    op = StatefulOperator(f"file://{tmp_path}/s", "twice", ["key"], CountSum(), OUT, 2, 16, socket_path=daemon.socket)

    @one_action
    def sink(df, b):
        df.collect()
        df.collect()

    with pytest.raises(OutputReadError, match=r"marked one_action, so it must read.*drop the one_action mark"):
        op.process_batch(_batch(spark), 0, sink)
    assert _manifests(tmp_path, "twice") == []
    op.process_batch(_batch(spark), 0, lambda df, b: (df.collect(), df.collect()))  # unmarked: the output is kept
    assert _state(tmp_path, "twice") == {f"k{j}": (10, sum(range(j, 70, 7))) for j in range(7)}


def test_write_sink_writes_each_batch_once_with_its_options_and_partitions(spark, daemon, tmp_path):
    out = tmp_path / "out"
    runs = tmp_path / "runs"
    op = StatefulOperator(f"file://{tmp_path}/s", "written", ["key"], _Runs(str(runs)), OUT, 2, 16,
                          socket_path=daemon.socket)
    sink = write_sink("parquet", str(out), mode="append", partition_by="key",
                      options=lambda b: {"compression": "gzip" if b else "snappy"})
    for b in range(2):
        op.process_batch(_batch(spark), b, sink)
    assert runs.read_text().count("run") == 2 * 2
    rows = sorted(tuple(r) for r in spark.read.parquet(str(out)).select("batch_id", "key", "count", "sum").collect())
    assert rows == sorted([(0, f"k{j}", 10, sum(range(j, 70, 7))) for j in range(7)]
                          + [(1, f"k{j}", 20, 2 * sum(range(j, 70, 7))) for j in range(7)])
    # each batch in its own folder (replaced if the batch is replayed), the user's partitions inside
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["batch_id=0", "batch_id=1"]
    assert sorted(p.name for p in (out / "batch_id=1").iterdir() if p.is_dir()) == [f"key=k{j}" for j in range(7)]
    files = [p.name for p in out.rglob("*.parquet")]
    assert any(".gz." in f for f in files) and any(".snappy." in f for f in files)  # batch 1's and batch 0's options


def test_write_sink_refuses_what_cannot_be_written():
    with pytest.raises(errors.InterfaceError, match="path or to a table"):
        write_sink("parquet", "/tmp/x", table="t")
    with pytest.raises(errors.InterfaceError, match="mode must be one of"):
        write_sink("parquet", "/tmp/x", mode="upsert")
    with pytest.raises(errors.InterfaceError, match="format name"):
        write_sink("")
    with pytest.raises(errors.InterfaceError, match="mapping or a function"):
        write_sink("parquet", "/tmp/x", options=["compression"])
    with pytest.raises(errors.InterfaceError, match="wraps a sink function"):
        one_action("not a function")
    with pytest.raises(errors.InterfaceError, match="batch_column"):
        write_sink("parquet", "/tmp/x", partition_by=["batch_id"])


@pytest.mark.parametrize(("args", "kw", "why"), [
    (("parquet", "/tmp/x"), {"mode": "ignore"}, "partial"),
    (("json", "/tmp/x"), {"mode": "error"}, "fail the query"),
    (("csv", "/tmp/x"), {"mode": "errorifexists"}, "fail the query"),
    (("parquet",), {"table": "db.t"}, "saveAsTable has no per-batch replace"),
    (("jdbc",), {"options": {"url": "jdbc:x"}}, "cannot make a jdbc write replace itself"),
    (("kafka",), {}, "at_least_once=True"),
    (("iceberg",), {"table": "cat.db.t"}, "Iceberg"),
])
def test_write_sink_refuses_writes_a_replay_would_double(args, kw, why):
    with pytest.raises(ReplayUnsafeSinkError, match=why):
        write_sink(*args, **kw)


def test_write_sink_layouts_and_delta_transactions():
    s = write_sink("parquet", "s3://b/out/", partition_by="day")
    assert s.layout == "batch_folder" and s.target(7) == "s3://b/out/batch_id=7"
    assert write_sink("CSV", "/o", batch_column="epoch").target(3) == "/o/epoch=3"
    assert write_sink("parquet", "/o", mode="overwrite").layout == "replace_path"
    assert write_sink("noop").layout == "as_given"
    assert write_sink("kafka", at_least_once=True).layout == "as_given"  # duplicates accepted by the user
    d = write_sink("delta", "/t", options={"mergeSchema": "true"})
    with pytest.raises(errors.InterfaceError, match="app_id"):
        d.writer_options(4)  # not bound to an operator, and no app_id
    bound = for_writer(d, "file:///s/op")
    assert bound.writer_options(4) == {"mergeSchema": "true", "txnAppId": "file:///s/op", "txnVersion": "4"}
    assert for_writer(write_sink("delta", table="t", app_id="mine"), "x").writer_options(0)["txnAppId"] == "mine"
    plain = one_action(lambda df, b: None)
    assert for_writer(plain, "x") is plain
