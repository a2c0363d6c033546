"""``StatefulOperator(initial_state=...)``, the driver's side (the task side is
``test_spark_initial_state.py``): the initial rows go to ``handle_initial_state`` once, before
the first batch, in a job of their own; batch 0 starts from
what it committed, its output joins batch 0's, the manifests carry on, and a replay of batch 0
loads the initial state again without doubling it. Real Spark (local mode), a real daemon."""
from __future__ import annotations

import sys

import pytest
from spark_cluster import Daemon

from statestore_async.errors import InterfaceError
from statestore_async.spark import OperatorConfigError, StatefulOperator, StatefulProcessor, load_state
from statestore_async.spark.api.examples import CountSum

OUT = "user string, n bigint, source string"


class Carried(StatefulProcessor):
    """A count per user, seeded from the initial state (rows ``(n,)``)."""

    def init(self, handle):
        self.n = handle.value_state("n")

    def handle_initial_state(self, key, rows, state):
        n = sum(r[0] for r in rows)
        self.n.update(n)
        yield (key[0], n, "initial")

    def handle_rows(self, key, rows, state):
        n = (self.n.get() or 0) + len(rows)
        self.n.update(n)
        yield (key[0], n, "batch")


@pytest.fixture(scope="module")
def daemon():
    with Daemon() as d:
        yield d


@pytest.fixture(autouse=True)
def _pickle_this_module():
    from pyspark import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _sink(out: dict):
    def sink(df, batch_id):
        out[batch_id] = sorted(tuple(r) for r in df.collect())
    return sink


@pytest.mark.spark
def test_initial_state_seeds_the_first_batch_once(spark, daemon, tmp_path):
    root = f"file://{tmp_path}/state"
    initial = spark.createDataFrame([("a", 10), ("a", 5), ("b", 7), ("c", 1)], "user string, n bigint")
    events = lambda rows: spark.createDataFrame(rows, "user string, v bigint")

    def op():
        return StatefulOperator(root, "init", ["user"], Carried(), OUT, 2, 16, socket_path=daemon.socket,
                                initial_state=initial)

    out: dict = {}
    first = op()
    first.process_batch(events([("a", 1), ("d", 1)]), 0, _sink(out))
    assert out[0] == [("a", 15, "initial"), ("a", 16, "batch"), ("b", 7, "initial"), ("c", 1, "initial"),
                      ("d", 1, "batch")]
    first.process_batch(events([("b", 1)]), 1, _sink(out))
    assert out[1] == [("b", 8, "batch")]  # the initial state is loaded once
    assert {k[0]: v for (_, k), v in load_state(root, "init").items()} == {"a": 16, "b": 8, "c": 1, "d": 1}
    # a restarted query (a new driver) whose state exists refuses initial_state= before writing anything
    with pytest.raises(OperatorConfigError, match="already has state"):
        op().process_batch(events([("b", 1)]), 2, _sink(out))
    assert 2 not in out
    # Spark replays batch 0 (a new driver): the initial state is loaded again from scratch, not added
    out.clear()
    op().process_batch(events([("a", 1), ("d", 1)]), 0, _sink(out))
    assert out[0][:2] == [("a", 15, "initial"), ("a", 16, "batch")]
    assert {k[0]: v for (_, k), v in load_state(root, "init", 1).items()} == {"a": 16, "b": 7, "c": 1, "d": 1}


def test_initial_state_needs_a_processor_that_takes_it(spark, tmp_path):
    initial = spark.createDataFrame([("a", 1)], "user string, n bigint")
    with pytest.raises(InterfaceError, match="defines handle_initial_state"):
        StatefulOperator(f"file://{tmp_path}/s", "init", ["user"], CountSum(), "user string, c bigint, s bigint", 2,
                         initial_state=initial)
    with pytest.raises(InterfaceError, match=r"initial_state lacks the key columns \['user'\]"):
        StatefulOperator(f"file://{tmp_path}/s", "init", ["user"], Carried(), OUT, 2,
                         initial_state=initial.withColumnRenamed("user", "who"))
    with pytest.raises(InterfaceError, match="initial_state is a DataFrame"):
        StatefulOperator(f"file://{tmp_path}/s", "init", ["user"], Carried(), OUT, 2, initial_state=[("a", 1)])
