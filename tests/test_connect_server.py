"""A real Spark Connect server (``statestore_async.testing.connect_server``): a client session runs
queries on it, and a streaming query's foreachBatch function runs in a Python process of the server
with a Connect session of its own, importing this project."""
from __future__ import annotations

import json
import os
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from statestore_async.testing.connect_server import (
    CONNECT_MODE_VAR,
    ConnectServer,
    ConnectServerError,
    running,
    start_query,
)

pytestmark = [pytest.mark.spark, pytest.mark.slow]

STREAM_TIMEOUT = 300.0  # seconds for a two-batch query on a loaded machine; bounds a hang only
STOP_DEADLINE = 60.0  # seconds for the processes of a stopped server to be gone


@pytest.fixture(scope="module")
def connect_server(tmp_path_factory):
    """The module's server; once stopped, no process of its group (the JVM, its Python processes) is left."""
    for server in running(tmp_path_factory.mktemp("connect")):
        yield server
    deadline = time.monotonic() + STOP_DEADLINE  # a killed process may take a moment to exit
    while server.live_processes() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.live_processes() == []


@pytest.fixture
def remote(connect_server):
    """A Connect client session on the module's server, closed after the test; this process is a
    classic pyspark process again afterwards (the other Spark tests share it)."""
    before = os.environ.get(CONNECT_MODE_VAR)
    with connect_server.client() as session:
        assert os.environ.get(CONNECT_MODE_VAR) == "1"  # pyspark's mark of a Connect client process
        yield session
    assert os.environ.get(CONNECT_MODE_VAR) == before


def test_a_client_session_runs_queries_on_the_server(connect_server, remote):
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    with connect_server.explained():
        assert isinstance(remote, ConnectSession)
        assert remote.range(100).selectExpr("sum(id) AS s").collect()[0]["s"] == 4950
        assert remote.conf.get("spark.master") == "local[2]"
        rows = remote.createDataFrame([("a", 1), ("b", 2), ("a", 3)], "k string, v long") \
            .groupBy("k").sum("v").orderBy("k").collect()
        assert [(r[0], r[1]) for r in rows] == [("a", 4), ("b", 2)]


def _record_batches(out: str):
    """A foreachBatch function (defined here, so it is pickled by value) that writes each batch as
    parquet with Connect's writer and, beside it, what it saw of the process it runs in."""

    def record(df, batch_id):
        import statestore_async

        session = df.sparkSession
        df.write.mode("overwrite").parquet(f"{out}/rows/batch={batch_id}")
        facts = {
            "pid": os.getpid(),
            "process_group": os.getpgid(0),
            "executable": sys.executable,
            "session_class": f"{type(session).__module__}.{type(session).__qualname__}",
            "session_id": session.session_id,
            "package": statestore_async.__file__,
            "rows": df.count(),
        }
        with open(f"{out}/facts-{batch_id}.json", "w") as f:
            json.dump(facts, f)

    return record


def test_foreach_batch_runs_in_a_server_python_process_with_a_connect_session(connect_server, remote, tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    out.mkdir()
    for i in range(2):  # two files, one per micro-batch
        pq.write_table(pa.table({"key": [f"k{i}{j}" for j in range(5)], "value": list(range(i * 10, i * 10 + 5))}),
                       src / f"part-{i}.parquet")

    with connect_server.explained():
        writer = (remote.readStream.schema("key string, value long").option("maxFilesPerTrigger", 1)
                  .parquet(str(src)).writeStream.foreachBatch(_record_batches(str(out)))
                  .option("checkpointLocation", str(tmp_path / "checkpoint")).trigger(availableNow=True))
        query = start_query(writer)
        try:
            finished = query.awaitTermination(STREAM_TIMEOUT)
        finally:
            if query.isActive:
                query.stop()
        assert finished, f"the query did not finish within {STREAM_TIMEOUT} s"
        assert query.exception() is None

        facts = [json.loads((out / f"facts-{b}.json").read_text()) for b in (0, 1)]
        for seen in facts:
            assert seen["pid"] != os.getpid()  # not in this client process
            assert seen["process_group"] == connect_server.proc.pid  # the server's: stop() ends it
            assert seen["executable"] == connect_server.python
            assert seen["session_class"] == "pyspark.sql.connect.session.SparkSession"
            assert seen["session_id"] != remote.session_id  # the batch's own (cloned) session
            assert seen["package"].startswith(os.path.dirname(os.path.dirname(__file__)))
            assert seen["rows"] == 5
        written = remote.read.parquet(str(out / "rows")).orderBy("value").collect()
        assert [(r["key"], r["value"], r["batch"]) for r in written] == \
            [(f"k0{j}", j, 0) for j in range(5)] + [(f"k1{j}", 10 + j, 1) for j in range(5)]


def test_a_server_that_cannot_start_raises_with_its_log(tmp_path):
    server = ConnectServer(tmp_path / "bad", master="no-such-master")
    with pytest.raises(ConnectServerError, match="exited with") as failure:
        server.start(timeout=STREAM_TIMEOUT)
    assert "SparkException: Master must" in str(failure.value)  # Spark's own complaint, from its log
    assert not server.alive()
