"""The Spark driver of the Spark-level campaign: one long-lived process that runs one query after
another, so that the JVM starts once for many schedules (``spark_level`` starts it, and starts it
again after a schedule killed it).

    python -m statestore_async.testing.campaign.spark_driver MASTER

It reads one job a line on stdin (JSON: ``spark_level.job_for`` builds it) and runs the job's query
to its end (``Trigger.AvailableNow``, one input file per micro-batch) through a fresh
``StatefulOperator``: per-key or vectorized event-time sessions with timers
(``statestore_async.testing.sessions``, fired timers marked), or a counter with a TTL'd state
(``TtlCounter``) whose processing-time clock is ``BatchClock``. Each batch's output rows go to
``<out>/<batch id>.json``, replaced when Spark replays the batch (an idempotent sink: exactly once
by batch id). It answers each job with one line ``@campaign {"ok": …, "error": …}`` on stdout.

Faults: the operator's fault hook is a ``CampaignHook``, which asks the campaign (over its control
socket) whether an armed event fires at a hook point — each event fires once, whatever process
reaches its point first and however often — and then does what the campaign says: SIGKILL its own
process (the driver, or a task's Python worker) or raise ``InjectedFault`` (a task fails and Spark
retries it). Faults that the campaign's process does itself (daemon signals, the S3 fault proxy)
are done before it answers.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from statestore_async.spark.api.processors import StatefulProcessor
from statestore_async.testing.faults import FaultSite, InjectedFault, arm

REPLY = "@campaign "
COUNTER_SCHEMA = "user string, count bigint, total bigint, seen bigint"


@dataclass(frozen=True)
class CampaignHook:
    """A fault hook (``testing.faults.FaultHook``) over the campaign's armed events ``(index, point, batch, partition,
    attempt)`` (partition/attempt None: any). It pickles (tasks get it in their ``TaskSpec``) and
    its module is importable by Spark's Python workers."""

    control: str                                   # the campaign's control socket
    events: tuple[tuple[int, str, int, int | None, int | None], ...]

    def __call__(self, site: FaultSite) -> None:
        for index, point, batch, partition, attempt in self.events:
            if point != site.point or batch != site.batch:
                continue
            if partition is not None and partition != site.partition:
                continue
            if attempt is not None and attempt != site.attempt:
                continue
            act = ask(self.control, {"event": index, "point": site.point, "batch": site.batch,
                                     "partition": site.partition, "attempt": site.attempt, "pid": os.getpid()})
            if act == "kill_self":
                os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(10)  # the signal is on its way
            elif act == "fail":
                raise InjectedFault(f"campaign event {index}: fail at {site.point} of batch {site.batch} "
                                    f"partition {site.partition} attempt {site.attempt}")


def ask(control: str, message: dict, timeout: float = 60.0) -> str:
    """Send ``message`` to the campaign's control socket; its answer: what the asking process does
    (``""``: nothing — the event fired already, or the campaign did the fault itself)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(control)
        s.sendall(json.dumps(message).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
    return str(json.loads(data or b'{"act": ""}').get("act", ""))


class BatchClock:
    """The operator's processing-time clock (its ``clock``), in seconds: a function of the batch
    being run — ``t0 + batch * step`` plus every jump at or before the batch — so that a replayed
    batch reads the same time and the campaign's oracle knows every batch's clock."""

    def __init__(self, t0_ms: int, step_ms: int, jumps: dict[int, int]):
        self.t0_ms, self.step_ms, self.jumps = t0_ms, step_ms, jumps
        self.batch = 0

    def now_ms(self, batch: int) -> int:
        return self.t0_ms + batch * self.step_ms + sum(d for b, d in self.jumps.items() if b <= batch)

    def __call__(self) -> float:
        return self.now_ms(self.batch) / 1000.0


class TtlCounter(StatefulProcessor):
    """Per user: how many events, and the sum of their event times' milliseconds within the second,
    since the user's state last expired (a value state with a TTL of ``ttl_ms``). Emits ``(user,
    count, total, events in this batch)`` for every user with rows."""

    def __init__(self, ttl_ms: int):
        self.ttl_ms = ttl_ms

    def init(self, handle: Any) -> None:
        self.state = handle.value_state("count", ttl_ms=self.ttl_ms)

    def handle_rows(self, key: tuple, rows: list[tuple], state: Any) -> Iterator[tuple]:
        count, total = self.state.get() or (0, 0)
        count, total = count + len(rows), total + sum(et % 1000 for (et,) in rows)
        self.state.update((count, total))
        yield (key[0], count, total, len(rows))


def json_sink(out: str):
    """foreachBatch sink: the batch's rows ``(string, int, int, int)`` to ``<out>/<batch id>.json``,
    atomically (a replayed batch replaces its file)."""
    os.makedirs(out, exist_ok=True)

    def sink(df: Any, batch_id: int) -> None:
        rows = [[r[0], int(r[1]), int(r[2]), int(r[3])] for r in df.collect()]
        tmp = os.path.join(out, f".{batch_id}.json")
        with open(tmp, "w") as f:
            json.dump(rows, f)
        os.replace(tmp, os.path.join(out, f"{batch_id}.json"))

    return sink


def operator_for(job: dict[str, Any], clock: BatchClock) -> Any:
    """The job's ``StatefulOperator``."""
    from statestore_async.spark.driver.operator import StatefulOperator
    from statestore_async.testing import sessions as S

    hook = CampaignHook(job["control"], tuple(tuple(e) for e in job["events"]))
    common: dict[str, Any] = {"socket_path": job["socket"], "daemon_env": job["daemon_env"],
                              "fence_timeout": job["fence_timeout"], "s3_options": job["s3_options"],
                              "num_key_groups": job["key_groups"], "time_only_batches": "off", "clock": clock}
    if job["kind"] == "counter":
        op = StatefulOperator(job["root"], job["operator"], ["user"], TtlCounter(job["ttl_ms"]), COUNTER_SCHEMA,
                              job["partitions"], value_columns=["et"], **common)
    else:
        op = S.session_operator(job["root"], job["operator"], job["gap_ms"], job["delay_ms"], job["partitions"],
                                vectorized=job["kind"] == "vectorized", mark_timers=True, **common)
    arm(op, hook)
    return op


def run_job(spark: Any, job: dict[str, Any]) -> None:
    """Run the job's query over everything in ``src`` (AvailableNow), raising the query's error."""
    from statestore_async.testing import sessions as S

    clock = BatchClock(job["clock"]["t0_ms"], job["clock"]["step_ms"],
                       {int(b): int(d) for b, d in job["clock"]["jumps"].items()})
    op = operator_for(job, clock)
    inner = op.foreach_batch(json_sink(job["out"]))

    def fn(df: Any, batch_id: int) -> None:
        clock.batch = batch_id
        inner(df, batch_id)

    q = (S.read_stream(spark, job["src"]).writeStream.outputMode("update").foreachBatch(fn)
         .option("checkpointLocation", job["ckpt"]).trigger(availableNow=True).start())
    try:
        q.awaitTermination(job["timeout"])
        if q.isActive:
            q.stop()
            raise TimeoutError(f"the query did not finish within {job['timeout']}s")
        exc = q.exception()
        if exc is not None:
            raise RuntimeError(str(exc)[:3000])
    finally:
        op.close()


def main(argv: list[str]) -> int:
    master = argv[0] if argv else "local[2,3]"
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master(master).config("spark.ui.enabled", "false")
             .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
             .config("spark.sql.shuffle.partitions", "2").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    print(REPLY + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        job = json.loads(line)
        try:
            run_job(spark, job)
            reply: dict[str, Any] = {"ok": True, "error": None}
        except Exception as exc:  # the campaign reruns the query (Spark replays from its checkpoint)
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:3000],
                     "trace": traceback.format_exc()[-3000:]}
        print(REPLY + json.dumps(reply), flush=True)
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
