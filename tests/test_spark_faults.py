"""Crashes of the node's daemon inside a batch (kill -9 before commit, after commit, before the fence).

Each run: a query with a fault (``statestore_async.testing.faults``) that SIGKILLs the daemon
during batch 2, which fails the batch (or not, when the uploads won the race); then the query is
restarted from its Spark checkpoint with a fresh operator. The next task finds no daemon and
starts one (placement), which loads the state from the files the last manifest names. Outputs per
batch and the final state must equal Spark's own aggregation.
"""
from __future__ import annotations

import pytest
from spark_cluster import Daemon, collector, dict_oracle, final_count_sum, run_stream, write_batches

from statestore_async.files.manifest import list_manifest_versions
from statestore_async.spark import StatefulOperator, daemon_pid, load_state
from statestore_async.spark.api.examples import CountSum
from statestore_async.spark.shared.placement import _zombie
from statestore_async.testing import faults

pytestmark = [pytest.mark.spark, pytest.mark.slow]
OUT = "key string, count bigint, sum bigint"



@pytest.fixture(scope="module")
def data(tmp_path_factory):
    src = str(tmp_path_factory.mktemp("faults") / "src")
    batches = write_batches(src, 4, 3000, 800, seed=3)
    return src, *dict_oracle(batches)


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not _zombie(pid)


@pytest.mark.parametrize("point", ["before_commit", "after_commit", "before_fence"])
def test_daemon_killed_mid_batch_then_restart(spark, data, tmp_path, point):
    src, per_batch, final = data
    root, ckpt = f"file://{tmp_path}/state", str(tmp_path / "ckpt")
    got: dict = {}
    with Daemon() as d:
        first_pid = d.pid()
        fault = {"point": point, "batch": 2, "action": "kill_daemon", "partition": 0 if "commit" in point else None}
        op = StatefulOperator(root, "counts", ["key"], CountSum(), OUT, 2, 64, socket_path=d.socket,
                              fence_timeout=3)
        faults.arm(op, [fault])
        failed = None
        try:
            run_stream(spark, src, ckpt, op.foreach_batch(collector(got)))
        except Exception as exc:  # the batch of the crash fails (unless the upload won the race)
            failed = exc
        if point == "before_commit":
            assert failed is not None  # no commit, no report: the batch cannot complete
        # after the commit, the delta's upload may win the race with the kill: then the batch
        # completes on the daemon a task restarts; either way the results below must be exact
        assert not _alive(first_pid)  # it really died
        op2 = StatefulOperator(root, "counts", ["key"], CountSum(), OUT, 2, 64, socket_path=d.socket, fence_timeout=20)
        run_stream(spark, src, ckpt, op2.foreach_batch(collector(got)))
        assert daemon_pid(d.socket) not in (None, first_pid)  # restarted by a task
    assert [got[b] for b in sorted(got)] == per_batch
    assert final_count_sum(load_state(root, "counts")) == final

    async def versions():
        from statestore_async.objectstore import open_object_store
        async with open_object_store(root) as s:
            return await list_manifest_versions(s, "counts")

    import asyncio
    assert asyncio.run(versions()) == [1, 2, 3, 4]
