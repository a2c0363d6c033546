"""Timers fire in an idle processing-time stream, without a heartbeat source (issue 39).

A ``ProcessingTime`` query whose input stops gets no ``foreachBatch`` call: the operator's
``IdleTicker`` runs a time-only batch (``spark.driver.batches``) once Spark has recorded the last batch and
a trigger interval passed without another, at the watermark that batch moved. The sessions it
closes reach the sink while the query idles. A driver killed after such a time-only batch's manifest
and before its sink finds the manifest pending and runs it again, with the same clock and watermark,
before its next batch: every session once.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest

from statestore_async.testing import faults
from statestore_async.testing import sessions as S

pytestmark = pytest.mark.spark


@pytest.fixture(autouse=True)
def _pickle_sessions_by_value():
    from pyspark import cloudpickle

    cloudpickle.register_pickle_by_value(S)


def test_an_idle_stream_emits_the_sessions_its_last_watermark_closed(spark, daemon, tmp_path):
    stream = S.generate(users=60, batches=3, seed=41)
    src = str(tmp_path / "src")
    S.write_batches(stream, src, trailing_empty=False)
    out: list = []
    ids: list = []
    sink = S.collect_into(out, ids)
    op = S.session_operator(f"file://{tmp_path}/state", "sessions", stream.gap_ms, stream.delay_ms,
                            socket_path=daemon.socket)
    q = (S.read_stream(spark, src).writeStream.foreachBatch(op.foreach_batch(sink))
         .option("checkpointLocation", str(tmp_path / "ckpt")).trigger(processingTime="1 second").start())
    expected = S.sessions_of(stream)
    try:
        deadline = time.monotonic() + 300
        while len(out) < len(expected) and time.monotonic() < deadline and q.exception() is None:
            time.sleep(0.2)
        assert q.exception() is None, q.exception()
    finally:
        q.stop()
    assert sorted(out) == expected
    assert len(op.history) == len(stream.batches)  # Spark ran the data batches only
    idle = op.history[-1].time_only_after
    assert idle is not None and idle.watermark_ms == stream.final_watermark
    assert ids == sorted(set(ids)) and ids[-1] == idle.sink_batch_id


@pytest.mark.slow
def test_a_driver_killed_before_an_idle_batch_s_sink_runs_it_again(tmp_path):
    from spark_cluster import Daemon

    stream = S.generate(users=60, batches=4, seed=43)
    src = str(tmp_path / "src")
    first = S.SessionStream(stream.batches[:3], stream.gap_ms, stream.delay_ms, stream.watermarks[:4])
    S.write_batches(first, src, trailing_empty=False)
    out = tmp_path / "out"
    args = ["--src", src, "--root", f"file://{tmp_path}/state", "--ckpt", str(tmp_path / "ckpt"), "--out", str(out),
            "--gap", str(stream.gap_ms), "--delay", str(stream.delay_ms)]
    with Daemon() as d:
        fault = json.dumps([{"point": "time_only_after_manifest", "batch": 2, "action": "kill_self"}])
        r1 = _run_driver([*args, "--socket", d.socket, "--faults", fault, "--trigger", "idle"])
        assert r1.returncode == -signal.SIGKILL, r1.stdout[-4000:]
        pending = json.loads((tmp_path / "state" / "sessions" / "_commits" / "4.json").read_text())["manifest"]
        assert pending["metadata"]["sink"] == "pending" and pending["metadata"]["time_only"]
        assert not (out / "3.json").exists()  # its sink never ran
        S.write_batches(stream, src, trailing_empty=False)  # the last batch arrives
        r2 = _run_driver([*args, "--socket", d.socket, "--trigger", "available-now"])
        assert r2.returncode == 0, r2.stdout[-4000:]
    got = {int(p.name[:-5]): json.loads(p.read_text()) for p in out.iterdir() if p.name.endswith(".json")}
    rows = [tuple(r) for b in sorted(got) for r in got[b]]
    assert not [r for r, c in Counter(rows).items() if c > 1]
    assert sorted(rows) == S.sessions_of(stream)
    assert 3 in got  # the idle batch's output, under the batch id it first had
    done = json.loads((tmp_path / "state" / "sessions" / "_commits" / "4.json").read_text())["manifest"]
    assert done["metadata"]["sink"] == "done"


def _run_driver(args: list[str], timeout: float = 300.0) -> subprocess.CompletedProcess:
    """``job_main(args)`` in its own driver process, faults armed (``spark_cluster.run_driver``)."""
    from spark_cluster import run_driver

    return run_driver(os.path.abspath(__file__), ["job", *args], timeout)


# --- the driver, in its own process -------------------------------------------------------------------
def job_main(argv: list[str]) -> int:
    """Sessionize ``--src``: ``--trigger idle`` runs a 1-second processing-time query until it is
    killed (its fault) or 240 s pass; ``available-now`` runs to the end. Each sink batch's rows go to
    ``<out>/<batch id>.json`` (atomically: a batch written again replaces its file)."""
    import argparse

    ap = argparse.ArgumentParser()
    for name in ("--src", "--root", "--ckpt", "--out", "--socket", "--trigger"):
        ap.add_argument(name, required=True)
    ap.add_argument("--gap", type=int, required=True)
    ap.add_argument("--delay", type=int, required=True)
    ap.add_argument("--faults", default="[]")
    a = ap.parse_args(argv)
    from pyspark import cloudpickle
    from spark_cluster import driver_session, json_batch_sink

    spark = driver_session()
    cloudpickle.register_pickle_by_value(S)
    sink = json_batch_sink(a.out)

    op = S.session_operator(a.root, "sessions", a.gap, a.delay, socket_path=a.socket, fence_timeout=30)
    faults.arm(op, json.loads(a.faults))
    if a.trigger == "available-now":
        S.run_to_end(S.read_stream(spark, a.src), a.ckpt, op.foreach_batch(sink))
    else:
        q = (S.read_stream(spark, a.src).writeStream.foreachBatch(op.foreach_batch(sink))
             .option("checkpointLocation", a.ckpt).trigger(processingTime="1 second").start())
        q.awaitTermination(240)
        q.stop()
    spark.stop()
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["job"]:
        sys.exit(job_main(sys.argv[2:]))
    sys.exit("usage: test_spark_idle_timers.py job --src … --root … --ckpt … --out … --socket … --trigger …")
