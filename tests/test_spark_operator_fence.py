"""The fence's hint: when every task of a batch has a slot of its own, each task that committed
waits, after its output, for its daemon to make the delta durable, so the fence's first look finds
every delta (the fence still checks each file itself)."""
from __future__ import annotations

import pytest

from statestore_async.files.names import DELTA, file_key
from statestore_async.ids import StoreId
from statestore_async.spark import StatefulOperator
from statestore_async.spark.examples import CountSum

OUT = "key string, count bigint, sum bigint"
pytestmark = pytest.mark.spark


def _batch(spark):
    return spark.createDataFrame([(f"k{i % 9}", i) for i in range(90)], "key string, value bigint")


@pytest.mark.parametrize("materialize", ["checkpoint", "none"])
def test_tasks_with_a_slot_each_wait_for_their_deltas(spark, daemon, tmp_path, materialize):
    root = f"file://{tmp_path}/s"
    op = StatefulOperator(root, "hint", ["key"], CountSum(), OUT, 2, 16, socket_path=daemon.socket,
                          materialize=materialize)
    assert spark.sparkContext.defaultParallelism >= 2
    for b in range(2):
        prog = op.process_batch(_batch(spark), b, lambda df, b: df.collect())
        assert set(prog.durable_waits) == set(prog.refs) == {0, 1}
        assert all(w >= 0 for w in prog.durable_waits.values())
        for p, ref in prog.refs.items():  # what the fence checked: the delta files
            assert (tmp_path / "s" / file_key(StoreId(root, "hint", p), ref, DELTA)).exists()


def test_tasks_of_several_waves_leave_the_wait_to_the_fence(spark, daemon, tmp_path):
    n = spark.sparkContext.defaultParallelism + 1
    op = StatefulOperator(f"file://{tmp_path}/s", "waves", ["key"], CountSum(), OUT, n, 16,
                          socket_path=daemon.socket)
    prog = op.process_batch(_batch(spark), 0, lambda df, b: df.collect())
    assert prog.partitions_committed > 0 and prog.durable_waits == {}
