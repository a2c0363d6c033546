"""Time-only batches: after a data batch whose watermark moved (or any, with processing-time timers
or TTLs), under an ending trigger (``AvailableNow``, ``Once``), the steps of a batch run again without
rows in the same ``foreachBatch`` call; a processing-time query that idles gets them from the
``IdleTicker`` between Spark's batches. A time-only manifest is written "sink pending" and rewritten
"done" after the sink; a pending one is finished before the next batch. Functions of the operator
(bound as its methods).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from statestore_async.errors import (
    VersionError,
)
from statestore_async.files.manifest import (
    Manifest,
    read_manifest,
    write_manifest,
)
from statestore_async.objectstore import ObjectStore
from statestore_async.spark.api.processors import (
    merge_declarations,
)
from statestore_async.spark.api.sinks import for_writer
from statestore_async.spark.driver.batches import (
    NOW_KEY,
    PASS_KEY,
    SINK_DONE,
    SINK_KEY,
    SINK_PENDING,
    IdleContext,
    IdleTicker,
    TimeOnlyAfter,
    idle_period,
    query_trigger,
    recorded_by_spark,
    time_only_wanted,
    written_by,
)
from statestore_async.spark.driver.materialize import (
    Materialized,
    arrow_batch_bytes,
)
from statestore_async.spark.driver.plan import (
    BatchPlan,
    Sink,
    key_schema,
    no_rows,
    streaming_query_id,
)
from statestore_async.spark.driver.progress import BatchProgress, timed
from statestore_async.spark.shared import hooks
from statestore_async.spark.shared.eventtime import (
    MAX_EVENT_TIME_KEY,
    WATERMARK_KEY,
    batch_watermark,
    drop_heartbeat,
)
from statestore_async.spark.shared.hooks import hook_point
from statestore_async.spark.shared.taskspec import TaskSpec

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from statestore_async.spark.driver.operator import StatefulOperator

log = logging.getLogger(__name__)


def arm_idle(op: StatefulOperator, df: DataFrame, plan: BatchPlan, sink: Sink | None) -> None:
    """After a data batch of a processing-time query whose processor has time work: keep what an
    idle time-only batch needs (``_idle_tick``) and start the ``IdleTicker`` at the trigger's
    interval (``batches.idle_period``)."""
    if op.time_only_batches != "auto" or not op._time_work:
        return
    period = idle_period(op._trigger(plan.query_id), event_time=op.time.event)
    if period is None:
        return
    op._idle_ctx = IdleContext(df=df, after=TimeOnlyAfter.of(plan), sink=sink)
    op._last_step_end = time.monotonic()
    if op._ticker is None or not op._ticker.is_alive():
        op._ticker = IdleTicker(op._idle_tick, period, name=f"statestore-idle-{op.operator_id}")
        op._ticker.start()


def wants_time_only(op: StatefulOperator, spark: SparkSession, plan: BatchPlan, written: Manifest) -> bool:
    """Whether a time-only batch follows data batch ``plan`` (which wrote ``written``):
    ``batches.time_only_wanted`` for the query's trigger, a processor with timers or TTLs, and
    with ``time_mode="event"`` a watermark that moves (processing-time timers and TTLs may be
    due whenever the clock moved)."""
    if not time_only_wanted(op.time_only_batches, op._trigger(plan.query_id), spark.conf):
        return False
    if not op._time_work:
        return False
    if op.time.event:
        watermark, _ = batch_watermark(op.time, written.metadata)
        return watermark is not None and watermark != plan.spec.watermark_ms
    return True


def time_only_batch(op: StatefulOperator, df: DataFrame, spark: SparkSession, after: TimeOnlyAfter, base: Manifest,
                     sink: Sink | None, *, idle: bool = False, now_ms: int | None = None,
                     watermark_ms: int | None = None) -> tuple[Manifest, BatchProgress] | None:
    """A time-only batch after Spark batch ``after.batch_id``, from manifest ``base`` (the last
    the operator wrote): every partition's task runs without rows at the next batch's watermark
    (``watermark_ms`` when given) and the clock (``now_ms``), firing the timers and expiring the
    TTLs due (a partition with nothing due commits nothing); its output is kept, its deltas
    fenced, its manifest written (version ``base.version + 1``, marked time-only and following
    ``base``), then ``sink(output, base.version)``. Nothing is written, and the sink not called,
    when no partition had anything due: returns None.

    Inside a ``foreachBatch`` call (``idle`` False: after a data batch of an ending trigger),
    before Spark records the batch: a crash anywhere makes Spark replay both. An ``idle`` one runs
    between Spark's batches (``IdleTicker``), after Spark recorded the last: its manifest says
    its sink is pending (with the clock and watermark it used) until the sink has returned, and
    is then written again saying done; a driver that died between the two finds it pending and
    runs it again, the same way, before its next batch (``_finish_pending``)."""
    t0 = time.perf_counter()
    plan = op._plan_time_only(df, after, base, now_ms, watermark_ms)
    prog = BatchProgress(batch_id=after.batch_id, sink_batch_id=plan.sink_batch_id, time_only=True,
                         watermark_ms=plan.spec.watermark_ms)
    prog.plan = time.perf_counter() - t0
    output: Materialized | None = None
    sank = False  # the sink ran already
    with arrow_batch_bytes(spark, op.arrow_max_bytes_per_batch):
        if sink is not None and not idle and op.materialize_mode(spark, sink) == "none":
            # a one-action sink computes the batch, before its manifest (Spark replays both on a
            # crash); once it ran, the manifest is written even if nothing was due, so that the
            # batch id it was given is never given to another step
            reports, refs = op._compute_in_sink(plan, spark, prog, t0, sink)
            sank = True
        else:
            output, reports, refs = op._compute(plan, spark, prog, t0, keep=sink is not None)
    try:
        if not refs and not sank:
            return None
        extra: dict[str, Any] = ({WATERMARK_KEY: plan.spec.watermark_ms, MAX_EVENT_TIME_KEY: plan.max_event_time_ms}
                                 if op.time.event else {})
        if idle:  # what a rerun uses again (the watermark, with event time, is in ``extra`` already)
            extra.update({SINK_KEY: SINK_PENDING, NOW_KEY: plan.spec.now_ms})
        states = merge_declarations(plan.spec.declared, (r.states for r in reports))
        with timed(prog, "manifest"):
            written = op._commit(plan, refs, states, extra)
        hook_point(hooks.installed(op), "time_only_after_manifest", after.batch_id, socket_path=op.socket_path)
        if sink is not None and output is not None:
            with timed(prog, "sink"):
                sink(output.result, plan.sink_batch_id)
        if idle:
            written = op._rewrite(written, {SINK_KEY: SINK_DONE})
    finally:
        if output is not None:
            output.release()
    op._observe(reports)
    op._record(prog, refs, t0, written, last=False)
    log.info("operator %s: a time-only batch after batch %d (watermark %s%s) committed %d partitions as version %d",
             op.operator_id, after.batch_id, plan.spec.watermark_ms, ", idle stream" if idle else "", len(refs),
             written.version)
    return written, prog


def plan_time_only(op: StatefulOperator, df: DataFrame, after: TimeOnlyAfter, base: Manifest, now_ms: int | None = None,
                    watermark_ms: int | None = None) -> BatchPlan:
    """The plan of a time-only batch: no rows (an empty frame of ``df``'s columns, one task per
    state partition), the state ``base`` names, the watermark the next batch would use
    (``eventtime.batch_watermark`` of ``base``, or ``watermark_ms``) and the clock now (or ``now_ms``)."""
    watermark, seen = batch_watermark(op.time, base.metadata)
    if watermark_ms is not None:
        watermark = watermark_ms
    df = drop_heartbeat(df)
    routed = no_rows(df, op.num_partitions)  # task i is partition i: no rows to route, no shuffle
    values = op.value_columns or tuple(c for c in df.columns if c not in op.key_columns)
    spec = TaskSpec(root=op.root, operator_id=op.operator_id, key_columns=op.key_columns, value_columns=values,
                    output_schema=op.arrow_schema, num_partitions=op.num_partitions,
                    num_key_groups=op.num_key_groups, batch_id=after.batch_id,
                    refs=tuple(base.ref(p) for p in range(op.num_partitions)),
                    now_ms=int(op.clock() * 1000) if now_ms is None else now_ms, socket_path=op.socket_path,
                    daemon_env=op._task_daemon_env(df.sparkSession), hook=None, releases=None,
                    keys_unique=bool(op.pre_aggregate), declared=base.metadata.get("states"),
                    daemon_retries=op.daemon_retries, time_mode=op.time.mode, watermark_ms=watermark,
                    rescaled=None, key_schema=key_schema(df, op.key_columns), event_time_column=None,
                    drop_late=op.time.late_rows == "drop")
    return BatchPlan(batch_id=after.batch_id, base=base, routed=routed, spec=spec, query_id=after.query_id,
                     owner=after.owner, key_types=after.key_types, max_event_time_ms=seen, time_only=True)


def rewrite(op: StatefulOperator, m: Manifest, metadata: Mapping[str, Any]) -> Manifest:
    """Manifest ``m`` written again with ``metadata`` added (an idle time-only batch's sink done)."""
    again = Manifest(m.operator_id, m.version, m.num_partitions, m.num_key_groups, dict(m.stores),
                     metadata={**m.metadata, **metadata})

    async def write(store: ObjectStore) -> None:
        await write_manifest(store, again)

    op._run(write)
    return again


def finish_pending(op: StatefulOperator, df: DataFrame, spark: SparkSession, batch_id: int, sink: Sink | None) -> None:
    """Before batch ``batch_id``: when the manifest it starts from is an idle time-only batch
    whose sink did not return (the driver died in between), run that time-only batch again from
    the manifest below it, with the clock and watermark it recorded, and its sink: the same
    output under the same batch id, then the manifest says done."""
    if batch_id == 0:
        return
    m = op.base_manifest(batch_id)
    if m.metadata.get(SINK_KEY) != SINK_PENDING:
        return
    oid = op.operator_id

    async def read(store: ObjectStore) -> Manifest:
        return await read_manifest(store, oid, m.version - 1)

    below = op._run(read)
    log.warning("operator %s: the idle time-only batch of version %d did not finish its sink; running it again",
                oid, m.version)
    query_id = streaming_query_id(spark)
    after = TimeOnlyAfter(batch_id=written_by(m), query_id=query_id, owner=op._claim(query_id, batch_id),
                          key_types=below.metadata.get("key_types"))
    done = op._time_only_batch(df, spark, after, below, for_writer(sink, op.writer_id) if sink else None,
                                 idle=True, now_ms=int(m.metadata[NOW_KEY]),
                                 watermark_ms=m.metadata.get(WATERMARK_KEY))
    if done is None:  # nothing came due this time (its tasks' state said so): the state is below's
        raise VersionError(f"operator {oid!r}: running the pending time-only batch of version {m.version} again "
                           "fired nothing; its manifest stays pending")
    op._last_done = (batch_id - 1, done[0])


def idle_tick(op: StatefulOperator) -> bool:
    """Called by the ``IdleTicker`` between Spark's batches of a processing-time query: a time-only
    batch when one is due (``_idle_due``), unless a batch runs now. Returns whether the ticker
    should keep going (False once the query is gone or the operator closed)."""
    ctx = op._idle_ctx
    if ctx is None:
        return False
    if not op._step_lock.acquire(blocking=False):
        return True  # a batch runs: it fires what is due itself
    try:
        trigger = query_trigger(ctx.after.query_id)
        if trigger is None:
            return False  # the query stopped
        last = op._last_done
        if time.monotonic() - op._last_step_end < 1.5 * (op._ticker.period if op._ticker else 0.0):
            return True  # a batch ran within the last period and a half: the stream is not idle
        if last is None or last[0] != ctx.after.batch_id or not recorded_by_spark(ctx.after.query_id, last[0]):
            return True
        if not op._idle_due(last[1]):
            return True
        done = op._time_only_batch(ctx.df, ctx.df.sparkSession, ctx.after, last[1], ctx.sink, idle=True)
        if done is not None:
            op._last_done = (last[0], done[0])
            if op.last_progress.time_only_after is None:
                op.last_progress.time_only_after = done[1]
        else:  # nothing was due: with event time nothing will be until a batch moves the watermark
            op._idle_quiet = last[1].metadata.get(PASS_KEY)
        op._last_step_end = time.monotonic()
        return True
    except Exception:
        log.exception("operator %s: an idle time-only batch failed; the next batch runs it again",
                      op.operator_id)
        return True
    finally:
        op._step_lock.release()


def idle_due(op: StatefulOperator, last: Manifest) -> bool:
    """Whether an idle time-only batch may fire something after manifest ``last``: with
    ``time_mode="event"`` a watermark that moved since ``last``'s batch (once); with
    processing-time timers or TTLs, the clock (every ``IdleTicker`` period)."""
    if op.time.event:
        watermark, _ = batch_watermark(op.time, last.metadata)
        return (watermark is not None and watermark != last.metadata.get(WATERMARK_KEY)
                and op._idle_quiet != last.metadata.get(PASS_KEY))
    return True
