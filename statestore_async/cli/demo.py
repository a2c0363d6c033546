"""``make demo``: a PySpark streaming aggregation with exactly-once state, a daemon crash, and a check.

A Structured Streaming query (PySpark local mode) reads micro-batches of events (user, amount) from
parquet files and keeps a running (count, total) per user in statestore_async through
``StatefulOperator`` + ``foreachBatch``. During batch ``--crash-at`` the node's daemon is killed
with SIGKILL just before the tasks commit: the batch fails and the query stops. The query is then
restarted from its Spark checkpoint; the first task finds no daemon and starts one, which rebuilds
each partition from the files the last manifest names; the lost batch is replayed under new
checkpoint ids. Every batch's output and the final state are checked against Spark's own streaming
``groupBy(user).agg(count, sum)`` over the same files and against a plain dict (exit 1 on mismatch).

Run: ``python -m statestore_async.cli.demo [--dir DIR | --root s3://bucket/prefix] [--batches N] [--crash-at B]``.
With an S3 root, the driver and the daemon take their S3 settings from ``STATESTORE_S3_*`` and the
AWS chain (e.g. ``AWS_ACCESS_KEY_ID``).
"""
from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import click
from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from statestore_async.spark.shared.hooks import Hook, HookSite

OPERATOR = "user_totals"
PARTITIONS = 2
KEY_GROUPS = 256
OUTPUT = "user string, count bigint, total bigint"
console = Console(highlight=False)


def write_input(folder: str, batches: int, rows: int, users: int) -> list[list[tuple[str, int]]]:
    """``batches`` micro-batches of (user, amount) as 2 parquet files each; returns the rows."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(folder, exist_ok=True)
    out, base = [], time.time() - 100_000
    for b in range(batches):
        rng = np.random.Generator(np.random.PCG64(b))
        names = [f"user-{i:05d}" for i in rng.integers(0, users, rows).tolist()]
        amounts = rng.integers(1, 100, rows).tolist()
        t = pa.table({"user": pa.array(names, pa.string()), "amount": pa.array(amounts, pa.int64())})
        for i, part in enumerate((t.slice(0, rows // 2), t.slice(rows // 2))):
            path = os.path.join(folder, f"events-{b:04d}-{i}.parquet")
            pq.write_table(part, path)
            os.utime(path, (base + 10 * b + i,) * 2)
        out.append(list(zip(names, amounts)))
    return out


Totals = dict[str, tuple[int, int]]  # user -> (count, total)


def dict_oracle(batches: list[list[tuple[str, int]]]) -> tuple[list[Totals], Totals]:
    state: Totals = {}
    per_batch: list[Totals] = []
    for rows in batches:
        touched = set()
        for u, a in rows:
            c, t = state.get(u, (0, 0))
            state[u] = (c + 1, t + a)
            touched.add(u)
        per_batch.append({u: state[u] for u in touched})
    return per_batch, state


def _session() -> Any:
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master("local[2]").appName("statestore_async demo")
             .config("spark.ui.enabled", "false").config("spark.driver.host", "127.0.0.1")
             .config("spark.driver.bindAddress", "127.0.0.1").config("spark.sql.shuffle.partitions", "2")
             .config("spark.ui.showConsoleProgress", "false").getOrCreate())
    spark.sparkContext.setLogLevel("OFF")
    return spark


def _run(spark: Any, src: str, checkpoint: str, fn: Callable[[Any, int], None], aggregate: bool = False) -> BaseException | None:
    from pyspark.sql import functions as F

    df = spark.readStream.schema("user string, amount bigint").option("maxFilesPerTrigger", 2).parquet(src)
    mode = "append"
    if aggregate:
        df = df.groupBy("user").agg(F.count("*").alias("count"), F.sum("amount").alias("total"))
        mode = "update"
    q = (df.writeStream.outputMode(mode).foreachBatch(fn).option("checkpointLocation", checkpoint)
         .trigger(availableNow=True).start())
    try:
        q.awaitTermination(600)
    except Exception as exc:  # StreamingQueryException: the query failed
        return exc
    return q.exception()


@dataclass(frozen=True)
class KillDaemonBeforeCommit:
    """The demo's crash, installed at the operator's hook points (``spark.shared.hooks``): SIGKILL
    the node's daemon when partition 0 of ``batch`` is about to commit (first attempt). It reaches
    the tasks in their ``TaskSpec``."""

    batch: int

    def __call__(self, site: HookSite) -> None:
        from statestore_async.spark.shared import placement

        if (site.point, site.batch, site.partition, site.attempt) == ("before_commit", self.batch, 0, 0):
            pid = placement.daemon_pid(site.socket_path)
            if pid:
                os.kill(pid, signal.SIGKILL)
                time.sleep(0.1)


def _collect(out: dict[int, Totals]) -> Callable[[Any, int], None]:
    def sink(df: Any, batch_id: int) -> None:
        out[batch_id] = {r[0]: (r[1], r[2]) for r in df.collect()}
        console.print(f"  batch {batch_id}: {len(out[batch_id]):,} users updated")

    return sink


@click.command()
@click.option("--dir", "directory", default="demo-data", show_default=True, help="work folder (input, checkpoints)")
@click.option("--root", default=None, help="checkpoint root URI for the state (default: <dir>/state)")
@click.option("--batches", default=6, show_default=True)
@click.option("--rows", default=50_000, show_default=True, help="events per micro-batch")
@click.option("--users", default=20_000, show_default=True)
@click.option("--crash-at", default=3, show_default=True, help="batch during which the daemon is killed (-1: none)")
def main(directory: str, root: str | None, batches: int, rows: int, users: int, crash_at: int) -> None:
    """Run the demo: a stateful streaming aggregation, a daemon crash, recovery, and a check."""
    from statestore_async.spark import StatefulOperator, load_state, placement
    from statestore_async.spark.api.examples import CountSum
    from statestore_async.spark.shared import hooks

    work = os.path.abspath(directory)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    root = root or "file://" + os.path.join(work, "state")
    sockdir = tempfile.mkdtemp(prefix="ssa-demo-", dir="/tmp")
    sock = os.path.join(sockdir, "daemon.sock")
    console.rule("[bold]statestore_async demo: exactly-once state for PySpark Structured Streaming")
    console.print(f"state root: {root}\ninput: {batches} micro-batches of {rows:,} events over {users:,} users; "
                  f"{PARTITIONS} state partitions; daemon socket {sock}\n")
    t0 = time.perf_counter()
    inputs = write_input(os.path.join(work, "input"), batches, rows, users)
    per_batch, final = dict_oracle(inputs)
    spark = _session()
    try:
        console.print("[bold]Spark's own streaming aggregation[/] (the oracle)")
        expected: dict[int, Totals] = {}
        err = _run(spark, os.path.join(work, "input"), os.path.join(work, "oracle-ckpt"), _collect(expected),
                   aggregate=True)
        if err is not None:
            raise SystemExit(f"the oracle query failed: {err}")

        def operator(crash: Hook | None = None) -> StatefulOperator:
            op = StatefulOperator(root, OPERATOR, ["user"], CountSum(), OUTPUT, PARTITIONS, KEY_GROUPS,
                                  socket_path=sock, fence_timeout=20)
            hooks.install(op, crash)
            return op

        got: dict[int, Totals] = {}
        ckpt = os.path.join(work, "query-ckpt")
        console.print(f"\n[bold]run 1[/]: the stateful query; the daemon is killed (SIGKILL) inside batch {crash_at}, "
                      "before its tasks commit")
        crash = KillDaemonBeforeCommit(crash_at) if crash_at >= 0 else None
        err = _run(spark, os.path.join(work, "input"), ckpt, operator(crash).foreach_batch(_collect(got)))
        if err is not None:
            console.print(f"  [bold red]query failed[/]: {str(err).splitlines()[0][:160]}…")
        console.print("\n[bold]run 2[/]: restart the query from its Spark checkpoint; a task starts a new daemon, "
                      "which loads the state from the last manifest's files; the lost batch is replayed")
        op = operator()
        err = _run(spark, os.path.join(work, "input"), ckpt, op.foreach_batch(_collect(got)))
        if err is not None:
            raise SystemExit(f"the restarted query failed: {err}")
        state = {k[0]: tuple(v) for (name, k), v in load_state(root, OPERATOR).items() if name == "total"}
    finally:
        spark.stop()
        placement.stop_daemon(sock)
        shutil.rmtree(sockdir, ignore_errors=True)

    same_batches = [got.get(b) for b in range(batches)] == [expected.get(b) for b in range(batches)] == per_batch
    table = Table(title="statestore_async vs Spark's aggregation vs a plain dict")
    for col in ("", "batches", "users", "events counted", "sum of amounts"):
        table.add_column(col, justify="right")
    for name, n, s in (("statestore_async", len(got), state), ("Spark groupBy/agg", len(expected), final),
                       ("plain dict", len(per_batch), final)):
        table.add_row(name, str(n), f"{len(s):,}", f"{sum(c for c, _ in s.values()):,}",
                      f"{sum(t for _, t in s.values()):,}")
    console.print()
    console.print(table)
    if not same_batches or state != final:
        console.print("[bold red]MISMATCH[/]: " + ("batch outputs differ" if not same_batches else "final state differs"))
        raise SystemExit(1)
    console.print(f"[bold green]OK[/] in {time.perf_counter() - t0:.1f}s: every batch's output and the final state "
                  "equal Spark's own aggregation — nothing lost, nothing counted twice.")


if __name__ == "__main__":
    main()
