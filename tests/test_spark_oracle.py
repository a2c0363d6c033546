"""The operator against Spark's own streaming aggregation: same outputs per batch, same final state.

The same parquet micro-batches (file source, ``maxFilesPerTrigger=2``, ``Trigger.AvailableNow``) go
through Spark's ``groupBy(key).agg(count, sum)`` in update mode and through ``StatefulOperator``
with a per-key processor (local root) and a vectorized one (S3 root on SeaweedFS); the routing is
checked with adaptive query execution on.
"""
from __future__ import annotations

import pytest
from spark_cluster import Daemon, collector, dict_oracle, final_count_sum, run_stream, spark_oracle, write_batches

from statestore_async.spark import OperatorConfigError, StatefulOperator, load_state, read_state
from statestore_async.spark.api.examples import CountSum, VectorizedCountSum
from statestore_async.spark.shared.coordinator import location_of

pytestmark = [pytest.mark.spark, pytest.mark.slow]
OUT = "key string, count bigint, sum bigint"


@pytest.fixture(scope="module")
def data(tmp_path_factory, spark):
    """5 micro-batches of 4000 rows over 1500 keys, and Spark's own answer for them."""
    tmp = tmp_path_factory.mktemp("oracle")
    src = str(tmp / "src")
    batches = write_batches(src, 5, 4000, 1500, seed=7)
    expected = spark_oracle(spark, src, str(tmp / "oracle-ckpt"))
    per_batch, final = dict_oracle(batches)
    assert [expected[b] for b in sorted(expected)] == per_batch  # Spark agrees with a plain dict
    return src, expected, final


@pytest.fixture(scope="module")
def daemon():
    with Daemon() as d:
        yield d


def test_per_key_processor_equals_spark(spark, data, daemon, tmp_path):
    src, expected, final = data
    spark.conf.set("spark.sql.adaptive.enabled", "true")
    spark.conf.set("spark.sql.adaptive.advisoryPartitionSizeInBytes", "1k")  # AQE would love to coalesce
    root = f"file://{tmp_path}/state"
    op = StatefulOperator(root, "counts", ["key"], CountSum(), OUT, num_partitions=3, num_key_groups=64,
                          socket_path=daemon.socket, fence_timeout=20)
    got: dict = {}
    try:
        run_stream(spark, src, str(tmp_path / "ckpt"), op.foreach_batch(collector(got)))
    finally:
        spark.conf.unset("spark.sql.adaptive.advisoryPartitionSizeInBytes")
    assert got == expected
    assert final_count_sum(load_state(root, "counts")) == final
    assert set(op.locations()) == {0, 1, 2} and set(op.locations().values()) == {location_of(daemon.socket)}
    df = read_state(spark, root, "counts")
    rows = df.collect()
    assert len(rows) == len(final)
    assert {r.partition for r in rows} == {0, 1, 2}
    assert all(r.key_group * 3 // 64 == r.partition for r in rows)
    # a restart with other key groups is refused with a clear error (another number of partitions
    # rescales: tests/test_spark_rescale.py)
    op2 = StatefulOperator(root, "counts", ["key"], CountSum(), OUT, num_partitions=3, num_key_groups=128,
                           socket_path=daemon.socket)
    with pytest.raises(OperatorConfigError, match="64 key groups"):
        op2.base_manifest(len(expected))


def test_vectorized_processor_on_s3_equals_spark(spark, data, seaweedfs, s3_bucket, tmp_path):
    src, expected, final = data
    root = f"s3://{s3_bucket}/ckpt"
    with Daemon(env=seaweedfs.env()) as d:
        op = StatefulOperator(root, "vcounts", ["key"], VectorizedCountSum(), OUT, num_partitions=2,
                              socket_path=d.socket, s3_options=seaweedfs.client_options(), fence_timeout=30)
        got: dict = {}
        run_stream(spark, src, str(tmp_path / "ckpt"), op.foreach_batch(collector(got)))
    assert got == expected
    state = load_state(root, "vcounts", s3_options=seaweedfs.client_options())
    assert final_count_sum(state) == final
    assert sum(p.partitions_committed for p in op.history) == 2 * len(expected)


def test_jvm_pre_aggregation_equals_spark(spark, data, daemon, tmp_path):
    from pyspark.sql import functions as F

    from statestore_async.spark.api.examples import PreAggregatedCountSum

    src, expected, final = data
    root = f"file://{tmp_path}/state"
    op = StatefulOperator(root, "pre", ["key"], PreAggregatedCountSum(), OUT, num_partitions=2,
                          socket_path=daemon.socket, pre_aggregate=[F.count("*").alias("n"), F.sum("value").alias("s")],
                          coordinate=False)  # correctness does not depend on the coordinator
    got: dict = {}
    run_stream(spark, src, str(tmp_path / "ckpt"), op.foreach_batch(collector(got)))
    assert got == expected
    assert final_count_sum(load_state(root, "pre")) == final
    assert op.locations() == {} and all(not p.locations for p in op.history)
