"""``write_sink`` is exactly-once across a replayed batch (issue 39).

A ``write_sink`` sink reads its output once, so the operator's default runs it *before* the batch's
fence and manifest (``materialize="auto"`` resolves to ``"none"``). A driver killed after the sink
and before the manifest leaves the batch's output written and its state uncommitted: Spark replays
the batch on restart, the operator computes the same output from the same manifest, and the sink
writes it again. For a file format each batch goes to its own folder ``<out>/batch_id=<id>/``,
replaced by the replay: the output holds every session once.

The driver runs in its own process (this file as a script, its ``--faults`` armed with
``statestore_async.testing.faults.arm``): event-time sessionization of ``statestore_async.testing.sessions``
over one parquet file per micro-batch (AvailableNow), into ``write_sink(fmt, <out>)``. The first run
SIGKILLs itself at the ``before_fence`` point of a batch whose sink wrote sessions; the second run
finishes the stream. Delta (``txnAppId``/``txnVersion``) is not exercised: its jar comes from Maven
Central, which this test's machines cannot reach (docs/SPARK.md, "Sinks").
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections import Counter

import pytest

from statestore_async.testing import faults
from statestore_async.testing import sessions as S

pytestmark = [pytest.mark.spark, pytest.mark.slow]
OPERATOR = "sessions"
FORMATS = ("parquet", "json", "csv")


@pytest.fixture(scope="module")
def stream() -> S.SessionStream:
    return S.generate(users=60, batches=4, seed=11)


@pytest.fixture(scope="module")
def src(stream, tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("sink-replay") / "src")
    S.write_batches(stream, folder)
    return folder


def _run_driver(args: list[str], timeout: float = 300.0) -> subprocess.CompletedProcess:
    """``job_main(args)`` in its own driver process, faults armed (``spark_cluster.run_driver``)."""
    from spark_cluster import run_driver

    return run_driver(os.path.abspath(__file__), ["job", *args], timeout)


def _read(spark, fmt: str, out: str) -> list[tuple]:
    """``(batch_id, user, start_ms, end_ms, events)`` of every row the sink wrote under ``out``."""
    reader = spark.read.format(fmt)
    if fmt in ("json", "csv"):
        reader = reader.schema(S.OUTPUT_SCHEMA + ", batch_id int").option("header", "true")
    return [(r.batch_id, r.user, int(r.start_ms), int(r.end_ms), int(r.events))
            for r in reader.load(out).collect()]


def _manifests(tmp_path) -> list[int]:
    folder = tmp_path / "state" / OPERATOR / "_commits"
    return sorted(int(p.name.split(".")[0]) for p in folder.iterdir())


def _batches_written(out: str) -> list[int]:
    return sorted(int(n.split("=", 1)[1]) for n in os.listdir(out) if n.startswith("batch_id=")) \
        if os.path.isdir(out) else []


@pytest.mark.parametrize(("fmt", "point", "time_only"), [
    *((fmt, "before_fence", "off") for fmt in FORMATS),
    ("parquet", "after_sink", "auto"),
])
def test_driver_killed_after_the_sink_writes_each_session_once(spark, stream, src, tmp_path, fmt, point, time_only):
    """``before_fence``: the sink ran, the manifest did not (time-only batches off: the data batch's
    own output closes sessions). ``after_sink``: the data batch's sink, its manifest, the time-only
    batch's manifest and sink all ran, Spark did not record the batch: the replay writes them all again."""
    from spark_cluster import Daemon

    out = str(tmp_path / "out")
    args = ["--src", src, "--root", f"file://{tmp_path}/state", "--ckpt", str(tmp_path / "ckpt"), "--out", out,
            "--gap", str(stream.gap_ms), "--delay", str(stream.delay_ms), "--format", fmt, "--time-only", time_only]
    b = 2  # a batch in the middle of the stream, whose output holds sessions (checked below)
    with Daemon() as d:
        fault = f'[{{"point": "{point}", "batch": {b}, "action": "kill_self"}}]'
        r1 = _run_driver([*args, "--socket", d.socket, "--faults", fault])
        assert r1.returncode == -signal.SIGKILL, r1.stdout[-4000:]
        # the sink wrote batch b (before_fence: its manifest was never written); Spark did not record
        # it: the restart replays it. The sink's batch id is the version the batch read (Spark's batch id
        # plus the time-only batches before it)
        last = max(_manifests(tmp_path))
        assert _batches_written(out) == list(range(last + (point == "before_fence")))
        first = _read(spark, fmt, out)
        killed = last if point == "before_fence" else last - 1
        assert any(row[0] >= killed for row in first)  # batch b's sessions, written before the kill
        r2 = _run_driver([*args, "--socket", d.socket])
        assert r2.returncode == 0, r2.stdout[-4000:]
    rows = _read(spark, fmt, out)
    twice = [r for r, c in Counter(rows).items() if c > 1]
    assert not twice, f"rows written twice: {twice[:5]}"
    assert sorted(r[1:] for r in rows if r[4] > 0) == S.sessions_of(stream)
    assert {r for r in first if r[0] >= killed} <= set(rows)  # the replay wrote the same rows again


# --- the driver, in its own process -------------------------------------------------------------------
def job_main(argv: list[str]) -> int:
    """Sessionize ``--src`` to the end (AvailableNow) into ``write_sink(--format, --out)``."""
    import argparse

    ap = argparse.ArgumentParser()
    for name in ("--src", "--root", "--ckpt", "--out", "--socket", "--format"):
        ap.add_argument(name, required=True)
    ap.add_argument("--gap", type=int, required=True)
    ap.add_argument("--delay", type=int, required=True)
    ap.add_argument("--faults", default="[]")
    ap.add_argument("--time-only", default="auto")
    a = ap.parse_args(argv)
    import json

    from pyspark import cloudpickle
    from spark_cluster import driver_session

    from statestore_async.spark import write_sink

    spark = driver_session()
    cloudpickle.register_pickle_by_value(S)
    options = {"header": "true"} if a.format == "csv" else None
    op = S.session_operator(a.root, OPERATOR, a.gap, a.delay, socket_path=a.socket, fence_timeout=30,
                            time_only_batches=a.time_only)
    faults.arm(op, json.loads(a.faults))
    S.run_to_end(S.read_stream(spark, a.src), a.ckpt, op.foreach_batch(write_sink(a.format, a.out, options=options)))
    spark.stop()
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["job"]:
        sys.exit(job_main(sys.argv[2:]))
    sys.exit("usage: test_spark_sink_replay.py job --src … --root … --ckpt … --out … --socket … --format …")
