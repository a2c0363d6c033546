"""``StatefulOperator``: exactly-once keyed state for ``foreachBatch``.

    op = StatefulOperator("s3://bucket/ckpt", "totals", ["user"], RunningTotal(),
                          "user string, count bigint, total bigint", num_partitions=8)
    query = df.writeStream.foreachBatch(op.foreach_batch(sink)).option("checkpointLocation", ...).start()

Per micro-batch ``b`` (``sink(output_df, b)`` is the user's sink), ``process_batch`` runs these
steps, one method each:

1. plan (``_plan``): claim the state for the streaming query running the batch (``_claim``: one
   writer per state — a state another query owns is refused with ``OwnerConflictError`` before
   anything is written); read the manifest the batch starts from, ``_commits/<v>.json`` (batch 0: the
   empty state; ``v`` is ``b`` until a time-only batch has run: ``batches``) — which checkpoint of
   each partition counts; its number of key groups must equal the operator's (else
   ``OperatorConfigError``); a different number of partitions is a **rescale** (``_rescale``: each
   new partition's state will be assembled from the key-group ranges it owns in the old partitions'
   files, see ``files.rescale``); route in the JVM (``routing.with_routing``): key group
   ``pmod(xxhash64(keys), G)``, task ``i`` gets exactly state partition ``i``; build the ``TaskSpec``;
   with ``time_mode="event"`` the batch's watermark comes from manifest ``b``'s metadata (``eventtime``:
   Spark's rule), the tasks count the max event time and late rows of the rows they get and drop
   the late ones (``late_rows="drop"``) before grouping (with ``pre_aggregate``: observed and dropped
   in the JVM before the routing); the heartbeat's rows (``with_heartbeat``) go first;
2. run (``_run_tasks``, lazy): one ``mapInArrow`` task per partition (``runtime.run_partition``)
   opens its store at the state the manifest names, applies the processor, commits, and reports a
   ``TaskReport`` through an accumulator (the tasks run in a single result stage: Spark merges the
   updates of exactly one successful attempt per task); a task that loses its daemon retries its
   partition (``daemon_retries`` times: it reconnects, restarting the daemon when needed, reopens
   the manifest's state and runs its rows again; only the commit it reports counts), with where it ran (``coordinator``:
   optional, best effort — a task also asks its daemon to drop copies of partitions that another
   node owns now);
3. materialize (``_materialize``, which runs the job): the output is computed once (a local
   checkpoint of its blocks, ``persist`` + a ``noop`` write, or a parquet folder when
   ``output_path`` is set: ``MATERIALIZERS``, ``materialize_parquet``), so the sink cannot re-run
   the stateful stage; with ``materialize="none"`` (and ``"auto"`` for a sink marked as reading
   its output once: ``sinks``) nothing is kept: the sink's own action runs the
   job, here, before steps 4–6 (``_compute_in_sink``: one job per batch instead of two); without a
   sink the job is a ``noop`` write (``run_unkept``);
4. the reports (``_collect_reports``): the checkpoint each partition with rows committed;
5. the driver's fence (``_fence``): every reported delta file must exist in the object store (HEAD,
   not the report; after a rescale, every assembled state's snapshot too); after ``fence_timeout``
   seconds it raises ``FenceTimeoutError`` (a daemon died before uploading what a task committed):
   steps 2–5 run again from the same manifest with fresh checkpoint ids (``_compute``,
   ``daemon_retries`` times), then the batch fails and Spark replays it;
6. commit (``_commit``): the owner is checked again, then ``_commits/<v+1>.json`` is written
   (replacing the one of an earlier attempt of ``b``), with the watermark the batch used and the
   max event time seen so far (``_event_time``), from which the next batch computes its own;
7. ``sink(output_df, v)`` runs (unless it ran in step 3); a time-only batch follows when one is due
   under an ending trigger (``_time_only_batch``: steps 2–7 without rows); then foreachBatch returns
   and Spark records the batch. A processing-time query that idles gets its time-only batches from
   the ``IdleTicker`` between Spark's batches.

A crash anywhere before step 7 ends makes Spark replay ``b``: the replay reads the same manifest
``v``, writes new checkpoint ids and a new manifest ``v+1``: state is exactly-once; the sink is
called again for ``v`` (``write_sink`` replaces what it wrote; a plain sink function must be
idempotent per batch id, as with any foreachBatch sink).
A partition with no rows in a batch writes nothing: the manifest keeps its previous checkpoint.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import threading
import time
import uuid
import weakref
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from statestore_async.client.clients import AsyncClient
from statestore_async.codecs.keylayout import DEFAULT_KEY_GROUPS, check_num_key_groups
from statestore_async.errors import (
    InterfaceError,
    OwnerConflictError,
    StateStoreError,
    VersionError,
    VersionNotFoundError,
)
from statestore_async.files.manifest import (
    INITIAL_STATE_KEY,
    Manifest,
    OwnerRecord,
    claim_owner,
    delete_manifests_after,
    read_manifest,
    read_owner,
    write_manifest,
)
from statestore_async.files.names import DELTA, SNAPSHOT, file_key
from statestore_async.files.rescale import RESCALED_FROM_KEY, Recipe, plan_sources, write_recipe
from statestore_async.ids import DEFAULT_STORE_NAME, EMPTY_STATE, CheckpointRef, StoreId, _check_name, new_checkpoint_id
from statestore_async.objectstore import ObjectStore, open_object_store
from statestore_async.spark import placement
from statestore_async.spark.batches import (
    BATCH_KEY,
    FOLLOWS_KEY,
    NOW_KEY,
    PASS_KEY,
    SINK_DONE,
    SINK_KEY,
    SINK_PENDING,
    TIME_ONLY_KEY,
    TIME_ONLY_SETTINGS,
    IdleContext,
    IdleTicker,
    TimeOnlyAfter,
    find_base,
    idle_period,
    query_trigger,
    recorded_by_spark,
    time_only_wanted,
    written_by,
)
from statestore_async.spark.coordinator import Coordinator, local_socket
from statestore_async.spark.eventtime import (
    MAX_EVENT_TIME_KEY,
    WATERMARK_KEY,
    TimeSettings,
    batch_watermark,
    drop_heartbeat,
    event_time_kind,
    observe_event_time,
    observed_event_time,
    tasks_event_time,
    time_settings,
    with_heartbeat,
)
from statestore_async.spark.processor import (
    StatefulProcessor,
    VectorizedProcessor,
    check_picklable,
    check_processor,
    merge_declarations,
    uses_initial_state,
)
from statestore_async.spark.routing import KG_COLUMN, ROUTE_COLUMN, with_routing
from statestore_async.spark.runtime import (
    Fault,
    FaultHook,
    TaskReport,
    TaskSpec,
    fault_hook_for,
    fault_point,
    run_initial_state,
    run_partition,
)
from statestore_async.spark.sinks import for_writer, reads_output_once
from statestore_async.state.roots import checkpoint_root as checkpoint_root_uri
from statestore_async.state.roots import s3_options_from_env

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark import Accumulator, AccumulatorParam
    from pyspark.sql import Column, DataFrame, Observation, SparkSession
    from pyspark.sql.types import StructType

log = logging.getLogger(__name__)
T = TypeVar("T")
Sink = Callable[["DataFrame", int], object]  # the user's sink: sink(output_df, batch_id)
LAYOUT = "statestore_async.spark/1"
FENCE_FAST_SECONDS = 3.0  # the fence checks for the batch's files every <= 50 ms this long, then every <= 0.5 s
MATERIALIZE = ("auto", "checkpoint", "cache", "none")  # how the output waits for the sink (see StatefulOperator)
# the local property Spark sets on the thread that runs a streaming query's batch: the query's id
# (``query.id``), kept in its checkpoint location, so the same across restarts of the query
QUERY_ID_PROPERTY = "sql.streaming.queryId"


class OperatorConfigError(InterfaceError):
    """The operator's settings disagree with what its checkpoint recorded (partitions, key groups, keys)."""


class FenceTimeoutError(VersionError):
    """Reported checkpoint files did not appear in the object store in time: the batch is not committed."""


class DuplicateReportError(VersionError):
    """Two committed attempts reported for one partition of one batch (should never happen)."""


class OutputReadError(InterfaceError):
    """With ``materialize="none"`` the sink did not read the batch's whole output exactly once."""


def _reports_param() -> AccumulatorParam[list[TaskReport]]:
    """The accumulator of a batch's ``TaskReport`` lists (the tasks add one-element lists)."""
    from pyspark.accumulators import AccumulatorParam

    class _Reports(AccumulatorParam):
        def zero(self, value: list[TaskReport]) -> list[TaskReport]:
            return []

        def addInPlace(self, a: list[TaskReport], b: list[TaskReport]) -> list[TaskReport]:
            a.extend(b)
            return a

    return _Reports()


def _arrow_schema(output_schema: str | StructType) -> tuple[StructType, pa.Schema]:
    """The output schema as a Spark ``StructType`` (parsed from DDL when a string) and as Arrow's."""
    from pyspark.sql.pandas.types import to_arrow_schema
    from pyspark.sql.types import StructType, _parse_datatype_string

    schema = _parse_datatype_string(output_schema) if isinstance(output_schema, str) else output_schema
    if not isinstance(schema, StructType):
        raise InterfaceError(f"output_schema is a StructType or a DDL string, got {schema!r}")
    return schema, to_arrow_schema(schema)


def streaming_query_id(spark: SparkSession) -> str | None:
    """The id of the streaming query whose batch runs on this thread (``query.id``: the same after a
    restart from the same checkpoint location; a query started on a new one gets a new id), None
    outside a streaming query (``process_batch`` called directly)."""
    return spark.sparkContext.getLocalProperty(QUERY_ID_PROPERTY) or None


@dataclass(frozen=True)
class BatchPlan:
    """What one batch reads and runs, decided on the driver before Spark runs anything (``_plan``)."""

    batch_id: int
    base: Manifest        # manifest ``batch_id``: the state the batch starts from
    routed: DataFrame     # the batch's rows, shuffled so that task i holds state partition i's rows (lazy)
    spec: TaskSpec        # what every task gets
    query_id: str | None = None      # the streaming query running the batch (None: outside one)
    owner: OwnerRecord | None = None  # its claim on the state (None: outside a query, the state unowned)
    # event time: the max event time (ms) of batches < batch_id, and where this batch's max event time
    # and late rows come from: the tasks' accumulator of their ``(partition, max, late)`` (``split_late``),
    # or with pre_aggregate the Observation of the JVM's input (None outside time_mode "event"); the
    # watermark is ``spec.watermark_ms``
    max_event_time_ms: int | None = None
    observation: Observation | None = None
    event_times: Accumulator | None = None
    # batch 0 of an operator with ``initial_state``: handle_initial_state's output, computed and kept
    # (it joins the batch's output); released with the batch's
    initial: Materialized | None = None
    # the key columns' Spark types in this batch's rows (recorded in the manifest for readers)
    key_types: dict[str, str] | None = None
    # a time-only batch (``batches``): no rows, the timers and TTLs due at its watermark and clock
    time_only: bool = False

    @property
    def sink_batch_id(self) -> int:
        """The batch id the sink gets: the version the batch reads (``batches``)."""
        return self.base.version


@dataclass(frozen=True)
class Materialized:
    """A batch's output, computed once: the sink reads ``result``; ``release()`` frees what holds it."""

    result: DataFrame
    release: Callable[[], object]


def materialize_checkpoint(out: DataFrame) -> Materialized:
    """``localCheckpoint``: one job; the blocks hold the output's rows as computed (no columnar cache
    to build: with ~630k output rows a batch takes ~0.3 s less than with persist). Blocks lost with
    an executor are not recomputed: reading them fails the batch."""
    result = out.localCheckpoint(eager=True)
    return Materialized(result, lambda: _release_checkpoint(result))


def materialize_cache(out: DataFrame) -> Materialized:
    """``persist(MEMORY_AND_DISK)`` and a ``noop`` write; lost blocks are recomputed by running the
    stateful stage again (that run's commit is in no manifest)."""
    from pyspark import StorageLevel

    out = out.persist(StorageLevel.MEMORY_AND_DISK)
    out.write.format("noop").mode("overwrite").save()
    return Materialized(out, out.unpersist)


def materialize_parquet(out: DataFrame, spark: SparkSession, folder: str, schema: StructType) -> Materialized:
    """Parquet files in ``folder`` (which must not exist), read back with ``schema``; released by
    deleting the folder when it is local (one in an object store is left)."""
    out.write.mode("errorifexists").parquet(folder)
    return Materialized(spark.read.schema(schema).parquet(folder), lambda: _remove_local_folder(folder))


ARROW_MAX_BYTES_KEY = "spark.sql.execution.arrow.maxBytesPerBatch"
ARROW_BYTES_UNLIMITED = 2**31 - 1  # Spark skips its per-row size check at exactly this value


@contextlib.contextmanager
def arrow_batch_bytes(spark: SparkSession, limit: int | None) -> Iterator[None]:
    """Within: ``spark``'s ``spark.sql.execution.arrow.maxBytesPerBatch`` is ``limit``, or (None)
    the session's own value when it sets one, else ``ARROW_BYTES_UNLIMITED``; after: as before
    (unset again if it was). See ``StatefulOperator``'s ``arrow_max_bytes_per_batch``."""
    before = spark.conf.get(ARROW_MAX_BYTES_KEY, None)
    wanted = limit if limit is not None else (None if before is not None else ARROW_BYTES_UNLIMITED)
    if wanted is None:
        yield
        return
    spark.conf.set(ARROW_MAX_BYTES_KEY, str(wanted))
    try:
        yield
    finally:
        if before is None:
            spark.conf.unset(ARROW_MAX_BYTES_KEY)
        else:
            spark.conf.set(ARROW_MAX_BYTES_KEY, before)


def run_unkept(out: DataFrame) -> Materialized:
    """Run the job and keep nothing (a ``noop`` write): for a batch without a sink, whose output no
    one reads, and for a ``materialize="none"`` sink that read none of it."""
    out.write.format("noop").mode("overwrite").save()
    return Materialized(out, lambda: None)


# how the output waits for the sink, by ``StatefulOperator.materialize_mode`` (with ``output_path``: parquet)
MATERIALIZERS: dict[str, Callable[[DataFrame], Materialized]] = {
    "checkpoint": materialize_checkpoint,
    "cache": materialize_cache,
}


@contextlib.contextmanager
def _timed(prog: BatchProgress, name: str) -> Iterator[None]:
    """Set ``prog.<name>`` to the seconds the block took (left as it was when the block raises)."""
    t = time.perf_counter()
    yield
    setattr(prog, name, time.perf_counter() - t)


@dataclass
class BatchProgress:
    """Timings (seconds) and counts of the last batch, for logs and benchmarks."""

    batch_id: int = -1
    plan: float = 0.0      # reading the manifest and building the plan, before Spark runs anything
    compute: float = 0.0   # from the start to the output's materialization (plan included; materialize "none": to
    #                        the end of the sink, whose action runs the job, and ``sink`` is the sink's part of it)
    fence: float = 0.0
    manifest: float = 0.0
    sink: float = 0.0
    total: float = 0.0
    partitions_committed: int = 0
    reruns: int = 0        # runs of the stateful stage again after a fence timeout (a daemon lost deltas)
    refs: dict = field(default_factory=dict)
    tasks: dict = field(default_factory=dict)  # partition -> the task's timings (seconds) and counts
    # event time (time_mode "event"): the watermark the batch used (None: none yet), the max event time
    # of the batch's rows (ms; None: no row had one), and its late rows (event time <= watermark), which
    # were dropped before any state was read, or kept (``late_rows``)
    watermark_ms: int | None = None
    max_event_time_ms: int | None = None
    late_rows: int = 0
    locations: dict = field(default_factory=dict)  # partition -> where its task ran (coordinator on)
    version: int = 0       # the manifest version the batch wrote (0: none yet)
    sink_batch_id: int = -1  # the batch id its sink got (``batches``: Spark's until a time-only batch ran)
    time_only: bool = False  # a time-only batch (``batches``): no rows, only timers and TTLs
    # the time-only batch that followed this data batch (None: none ran): in the same foreachBatch
    # call (an ending trigger), or later while the stream idled
    time_only_after: BatchProgress | None = None

    def figures(self) -> dict[str, Any]:
        """The batch's figures under the names of Spark's own stateful operators' progress
        (``StreamingQueryProgress.stateOperators``) where they mean the same, summed over its tasks,
        and its time-only batch's as ``timeOnlyBatch``: rows in, state records written and removed,
        timers fired, values expired by TTL, rows dropped as late, the watermark (ms)."""
        def total(name: str) -> int:
            return int(sum(t.get(name, 0) for t in self.tasks.values()))

        out: dict[str, Any] = {
            "batchId": self.batch_id, "sinkBatchId": self.sink_batch_id, "version": self.version,
            "timeOnly": self.time_only, "numInputRows": total("rows"), "numKeys": total("keys"),
            "numRowsUpdated": total("puts"), "numRowsRemoved": total("removes"),
            "numTimersFired": total("timers_fired"), "numRowsExpiredByTTL": total("ttl_removed"),
            "numRowsDroppedByWatermark": self.late_rows, "watermarkMs": self.watermark_ms,
            "numPartitionsCommitted": self.partitions_committed, "durationMs": round(self.total * 1000, 1),
        }
        if self.time_only_after is not None:
            out["timeOnlyBatch"] = self.time_only_after.figures()
        return out


class StatefulOperator:
    """A stateful foreachBatch operator; see the module docstring for the per-batch protocol.

    ``checkpoint_root``: ``file:///…``, an absolute path, or ``s3://bucket/prefix`` (the daemons reach it
    with their own S3 settings; the driver with ``s3_options`` or ``STATESTORE_S3_*`` + AWS chain).
    ``key_columns``: the grouping columns; ``value_columns``: the columns handed to the processor
    (default: every other input column). ``num_key_groups`` (G) is fixed for the operator's life;
    ``num_partitions`` (N, 1 <= N <= G) may change between runs of the query: the first batch of a
    run with another N rescales the state (``_rescale``). Both are recorded in every manifest. ``pre_aggregate``: optional
    aggregate Columns (``[F.count("*").alias("n"), F.sum("v").alias("s")]``): the JVM first computes
    ``groupBy(keys).agg(*pre_aggregate)`` per batch, and the processor gets one row of those
    columns per key (much less data crosses to Python; for associative state updates).
    ``coordinate``: keep track of where each partition runs and have daemons drop the copies that
    another node owns now (``coordinator``; best effort, correctness does not depend on it).
    ``materialize``: how the output is kept between the job that computes it and the sink (unless
    ``output_path`` is set): ``"checkpoint"`` — ``localCheckpoint``, the cheapest: blocks that are
    never recomputed, so an executor lost before the sink has read them fails the batch (Spark
    replays it; state stays exactly-once); ``"cache"`` — ``persist(MEMORY_AND_DISK)``, whose lost
    blocks Spark recomputes by running the stateful stage again (that run's commit is in no
    manifest); ``"auto"`` (default) — ``"none"`` for a sink marked as reading its output once with
    one action (``sinks.one_action``, ``sinks.write_sink``), else ``"checkpoint"`` in local mode (an
    executor is lost only with the driver), ``"cache"`` on a cluster; ``"none"`` — nothing is kept:
    the sink's one action on the output runs the stateful stage (one Spark job per batch instead of two; the sink must read
    the whole output exactly once, else ``OutputReadError``), and the sink runs *before* the
    batch's state is fenced and its manifest written (``_compute_in_sink``). Without a sink the
    stage runs as a ``noop`` write whatever the mode.
    ``takeover``: one writer per state — the first streaming query that runs a batch owns the
    operator's state (its ``query.id``, recorded under ``<root>/<operator>/_owner/``; restarts of
    that query keep it); any other query is refused with ``OwnerConflictError`` before it writes
    anything. ``takeover=<old query id>`` (or ``True``: whichever query owns it) hands the state to
    this query when the owner is known to be dead for good: this query continues from the manifest
    of the batch it starts at (a query on a new checkpoint location starts at batch 0: the empty
    state), and the later manifests the old owner wrote are deleted. It takes over at this
    operator's first batch only (an owner that takes over from it later is not taken back while it
    runs); remove ``takeover=True`` once done (the named form only ever matches the dead query).
    ``daemon_retries``: how often a task that lost its daemon (killed, restarted) retries its
    partition, and how often the driver runs a batch's stateful stage again when a daemon died
    before uploading what its tasks committed (the fence timed out); then the batch fails
    (``RetriesExhaustedError``, ``FenceTimeoutError``).
    ``faults`` (tests): ``runtime.Fault`` records or dicts of their fields, which need the hook maker
    of ``statestore_async.testing.faults`` installed (``InterfaceError`` otherwise), or a
    ``runtime.FaultHook``; without faults every hook point is a no-op.
    ``time_mode``: ``"none"`` (default), ``"processing"`` or ``"event"`` — what a timer's
    ``kind=None`` means, and with ``"event"`` a watermark: ``event_time_column`` (a timestamp, or
    integer milliseconds since the epoch) and ``watermark_delay`` (a ``timedelta``) give batch b the
    watermark max(previous, max event time of batches < b - delay), Spark's ``withWatermark``
    (``eventtime``); it is recorded in the batch's manifest, so a replay uses the same value.
    ``late_rows``: rows whose event time is <= the batch's watermark are dropped before any state
    is touched (``"drop"``, default) or handed to the processor (``"keep"``); counted in
    ``BatchProgress.late_rows`` either way.
    ``arrow_max_bytes_per_batch``: the byte cap of the Arrow batches Spark sends the stateful
    stage's tasks (``spark.sql.execution.arrow.maxBytesPerBatch`` while the operator's stage runs,
    the session's own value restored after). Default None: the session's value when it sets one,
    else no byte cap (``ARROW_BYTES_UNLIMITED``), a batch then being bounded by
    ``spark.sql.execution.arrow.maxRecordsPerBatch`` rows (10,000 by default). Spark 4 checks its
    default 64 MiB cap before each row by measuring the whole batch (``ArrowWriter.sizeInBytes``):
    workload W at K = 1M spent ~0.7 of its ~2.5 JVM CPU seconds per batch there. Set a cap for rows
    so large that 10,000 of them do not fit in an executor's memory.
    ``time_only_batches``: ``"auto"`` (default) — after a data batch of an ``AvailableNow`` or
    ``Once`` run whose watermark moved (``time_mode="event"``), or any data batch of such a run with
    processing-time timers or TTLs, the operator runs a **time-only batch** in the same
    ``foreachBatch`` call: no rows, the timers and TTLs due at the next watermark and the clock, with
    its own manifest version and its own sink call — what Spark's no-data batch does for its own
    stateful operators, so the sessions the last batch's watermark closes are emitted by the run
    (``batches``); nothing runs when nothing was due; off when Spark's
    ``spark.sql.streaming.noDataMicroBatches.enabled`` is false. ``"off"``: timers fire only in
    data batches. The batch id a sink gets is the version its batch read: Spark's batch id until a
    time-only batch has run, then shifted by one per time-only batch (unique, and the same on a replay).
    ``initial_state``: a DataFrame of the key columns and value columns whose rows go, per key, to
    the processor's ``handle_initial_state(key, rows, state)`` once, before the first batch (in its
    planning, as a job of its own, committed and fenced like a batch; batch 0 starts from it, and
    so does a replay of batch 0, which loads it again). Needs a ``StatefulProcessor`` that defines
    ``handle_initial_state``; ignored when the operator's state exists already (batch > 0).
    """

    def __init__(self, checkpoint_root: str, operator_id: str, key_columns: str | Sequence[str],
                 processor: StatefulProcessor | VectorizedProcessor, output_schema: str | StructType,
                 num_partitions: int, num_key_groups: int = DEFAULT_KEY_GROUPS, *,
                 value_columns: Sequence[str] | None = None, socket_path: str | None = None,
                 daemon_env: dict[str, str] | None = None, fence_timeout: float = 60.0,
                 s3_options: dict[str, Any] | None = None, output_path: str | None = None,
                 pre_aggregate: Sequence[Column] | None = None,
                 faults: Iterable[Fault | Mapping[str, Any]] | FaultHook = (),
                 clock: Callable[[], float] = time.time, coordinate: bool = True, materialize: str = "auto",
                 takeover: bool | str = False, daemon_retries: int = 2, time_mode: str = "none",
                 event_time_column: str | None = None, watermark_delay: timedelta | None = None,
                 late_rows: str = "drop", initial_state: DataFrame | None = None,
                 arrow_max_bytes_per_batch: int | None = None, time_only_batches: str = "auto") -> None:
        if not isinstance(processor, (StatefulProcessor, VectorizedProcessor)):
            raise InterfaceError("processor must be a StatefulProcessor or a VectorizedProcessor instance")
        if time_only_batches not in TIME_ONLY_SETTINGS:
            raise InterfaceError(f"time_only_batches must be one of {', '.join(TIME_ONLY_SETTINGS)}, "
                                 f"got {time_only_batches!r}")
        if materialize not in MATERIALIZE:
            raise InterfaceError(f"materialize must be one of {', '.join(MATERIALIZE)}, got {materialize!r}")
        if materialize == "none" and output_path:
            raise InterfaceError("output_path keeps the output in parquet files for the sink; materialize='none' keeps "
                                 "nothing (the sink's action computes it): give one or the other")
        if isinstance(key_columns, str):
            key_columns = [key_columns]
        if not key_columns:
            raise InterfaceError("key_columns must name at least one column")
        if isinstance(num_partitions, bool) or not isinstance(num_partitions, int) or num_partitions < 1:
            raise InterfaceError(f"num_partitions must be an int >= 1, got {num_partitions!r}")
        if not (isinstance(takeover, bool) or (isinstance(takeover, str) and takeover)):
            raise InterfaceError(f"takeover is a bool or the id of the query to take over from, got {takeover!r}")
        if isinstance(daemon_retries, bool) or not isinstance(daemon_retries, int) or daemon_retries < 0:
            raise InterfaceError(f"daemon_retries must be an int >= 0, got {daemon_retries!r}")
        if arrow_max_bytes_per_batch is not None and (
                isinstance(arrow_max_bytes_per_batch, bool) or not isinstance(arrow_max_bytes_per_batch, int)
                or not 0 < arrow_max_bytes_per_batch <= ARROW_BYTES_UNLIMITED):
            raise InterfaceError(f"arrow_max_bytes_per_batch is an int in 1..{ARROW_BYTES_UNLIMITED} (bytes) or None, "
                                 f"got {arrow_max_bytes_per_batch!r}")
        self.arrow_max_bytes_per_batch = arrow_max_bytes_per_batch
        check_num_key_groups(num_key_groups)
        self.time: TimeSettings = time_settings(time_mode, event_time_column, watermark_delay, late_rows)
        # the processor's declarations, checked now rather than in its first task; whether it has timers or TTLs
        self._time_work = check_processor(processor, self.time.mode)
        if initial_state is not None:
            if not hasattr(initial_state, "sparkSession") or not hasattr(initial_state, "columns"):
                raise InterfaceError(f"initial_state is a DataFrame, got {type(initial_state).__name__}")
            if not uses_initial_state(processor):
                raise InterfaceError(
                    f"initial_state needs a StatefulProcessor that defines handle_initial_state(self, key, rows, "
                    f"state); {type(processor).__name__} does not")
            lacking = [c for c in ([key_columns] if isinstance(key_columns, str) else key_columns)
                       if c not in initial_state.columns]
            if lacking:
                raise InterfaceError(f"initial_state lacks the key columns {lacking} (it has {initial_state.columns})")
        self.initial_state = initial_state
        if num_key_groups < num_partitions:
            raise OperatorConfigError(
                f"num_partitions ({num_partitions}) exceeds num_key_groups ({num_key_groups}): a partition owns at least "
                "one key group, which are fixed for an operator's life. Use at most num_key_groups partitions (or, "
                "for a new operator id, more key groups)")
        self.root = checkpoint_root_uri(checkpoint_root)  # a relative path: refused
        check_picklable(processor)
        self.operator_id = _check_name("operator_id", str(operator_id))
        self.key_columns = tuple(key_columns)
        self.value_columns = tuple(value_columns) if value_columns is not None else None
        self.processor = processor
        self.output_schema, self.arrow_schema = _arrow_schema(output_schema)
        self.num_partitions = num_partitions
        self.num_key_groups = num_key_groups
        self.socket_path = socket_path
        self.daemon_env = daemon_env
        self.fence_timeout = fence_timeout
        self.s3_options = s3_options
        self.output_path = output_path
        if callable(faults):
            self.faults: tuple[Fault, ...] = ()
            self._fault_hook: FaultHook | None = faults
        else:
            self.faults = tuple(Fault(**f) if isinstance(f, Mapping) else f for f in faults)
            self._fault_hook = fault_hook_for(self.faults)  # None (no fault): the hook points do nothing
        self.clock = clock  # seconds; the TTL clock of a batch is read once, on the driver
        self.pre_aggregate = list(pre_aggregate) if pre_aggregate else None
        self.coordinator = Coordinator() if coordinate else None
        self.materialize = materialize
        self.takeover = takeover
        self.daemon_retries = daemon_retries
        self._owner: OwnerRecord | None = None  # this operator's last claim (the next batches only look for a newer one)
        self._io = _DriverIO(self._objstore)
        self.time_only_batches = time_only_batches
        # the last Spark batch this operator completed and the last manifest it wrote: the next batch
        # starts from it without looking (``base_manifest``)
        self._last_done: tuple[int, Manifest] | None = None
        self._lease: placement.DaemonLease | None = None  # local mode: the driver's hold on the node's daemon
        # one step at a time: a batch (``process_batch``) or an idle time-only batch (``_idle_tick``)
        self._step_lock = threading.RLock()
        self._idle_ctx: IdleContext | None = None  # what an idle time-only batch needs (``_arm_idle``)
        self._ticker: IdleTicker | None = None
        self._last_step_end = 0.0  # time.monotonic() when the last step ended
        self._idle_quiet: str | None = None  # the pass id after which an idle time-only batch fired nothing
        self._trigger_of: tuple[str | None, str | None] = (None, None)  # (query id, its trigger)
        self.last_progress = BatchProgress()
        self.history: list[BatchProgress] = []

    @property
    def writer_id(self) -> str:
        """Who writes this operator's state, as sinks name a writer: ``<root>/<operator id>`` (the
        ``txnAppId`` of a ``write_sink`` to Delta without its own ``app_id``)."""
        return f"{self.root.rstrip('/')}/{self.operator_id}"

    def locations(self) -> dict[int, str]:
        """Partition → where (host and daemon socket) its last committed task ran; {} when not coordinating."""
        return self.coordinator.locations() if self.coordinator is not None else {}

    # -- object store --
    def _objstore(self) -> ObjectStore:
        """A new connection to the checkpoint root's object store (the driver's settings)."""
        if self.root.startswith("s3://"):
            opts = self.s3_options if self.s3_options is not None else s3_options_from_env()
            return open_object_store(self.root, s3_options=opts)
        return open_object_store(self.root)

    def _run(self, coro_fn: Callable[[ObjectStore], Awaitable[T]]) -> T:
        """``await coro_fn(object_store)`` on the operator's I/O loop; its result."""
        return self._io.run(coro_fn)

    def close(self) -> None:
        """Close the driver's object store connection and its I/O thread, and (local mode) let go of
        the node's daemon (``placement.DaemonLease``: an autostarted daemon exits
        ``placement.LOCAL_EXIT_WHEN_IDLE`` seconds after its last client). Optional: the thread is a
        daemon thread, the lease goes when the SparkContext stops; the next batch opens them again."""
        if self._ticker is not None:
            self._ticker.stop()
            self._ticker = None
        self._idle_ctx = None
        self._io.close()
        if self._lease is not None:
            self._lease.release()
            self._lease = None

    def _local(self, spark: SparkSession) -> bool:
        """Whether ``spark`` runs in local mode (its tasks on this host, the driver's daemon theirs)."""
        return (spark.sparkContext.master or "").startswith("local")

    def _task_daemon_env(self, spark: SparkSession) -> dict[str, str] | None:
        """``daemon_env`` for the batch's tasks: in local mode, with the short idle exit of a daemon
        they autostart (``placement.local_daemon_env``)."""
        return placement.local_daemon_env(self.daemon_env) if self._local(spark) else self.daemon_env

    def _hold_daemon(self, spark: SparkSession) -> None:
        """In local mode, after a batch: hold the node's daemon for as long as the operator is open
        and the SparkContext runs (``placement.hold``), so that it outlives idle workers."""
        if self._lease is not None and self._lease.held:
            return
        if not self._local(spark):
            return
        sc = spark.sparkContext

        def alive() -> bool:
            from pyspark import SparkContext

            return SparkContext._active_spark_context is sc

        self._lease = placement.hold(self.socket_path, alive)

    def base_manifest(self, batch_id: int) -> Manifest:
        """The manifest Spark batch ``batch_id`` reads, checked against the settings: batch 0 the
        empty state, else the newest manifest an earlier batch wrote (``batches.find_base``; version
        ``batch_id`` unless time-only batches ran), known without a request when this operator
        completed batch ``batch_id - 1``."""
        if batch_id == 0:
            return Manifest(self.operator_id, 0, self.num_partitions, self.num_key_groups,
                            {DEFAULT_STORE_NAME: (EMPTY_STATE,) * self.num_partitions})
        if self._last_done is not None and self._last_done[0] == batch_id - 1:
            m = self._last_done[1]
        else:
            op = self.operator_id

            async def find(store: ObjectStore) -> Manifest | None:
                return await find_base(store, op, batch_id)

            found = self._run(find)
            if found is None:
                raise VersionNotFoundError(
                    f"operator {self.operator_id!r} at {self.root} has no manifest written before batch {batch_id}, "
                    "which the batch starts from: was the checkpoint root changed or cleaned while the query's "
                    "Spark checkpoint was kept?")
            m = found
            self._last_done = (batch_id - 1, m)  # the state after batch_id - 1: asked for again by _plan
        self.check_manifest(m)
        return m

    def check_manifest(self, m: Manifest) -> None:
        """``OperatorConfigError`` unless ``m`` was written with this operator's G and key columns
        (its N may differ: the batch then rescales)."""
        if m.num_key_groups != self.num_key_groups:
            raise OperatorConfigError(
                f"operator {self.operator_id!r} was checkpointed with {m.num_key_groups} key groups; it is now "
                f"configured with {self.num_key_groups}. The key groups are fixed for an operator's life (the "
                f"number of partitions may change, up to the key groups): keep num_key_groups="
                f"{m.num_key_groups}, or start a new operator id.")
        keys = m.metadata.get("key_columns")
        if keys is not None and tuple(keys) != self.key_columns:
            raise OperatorConfigError(
                f"operator {self.operator_id!r} was checkpointed with key columns {keys}, now {list(self.key_columns)}")

    # -- the batch: plan, run, materialize, fence and commit, sink --
    def foreach_batch(self, sink: Sink | None = None) -> Callable[[DataFrame, int], None]:
        """The function to pass to ``writeStream.foreachBatch``; ``sink(output_df, batch_id)`` is optional."""

        def run(df: DataFrame, batch_id: int) -> None:
            self.process_batch(df, batch_id, sink)

        return run

    def process_batch(self, df: DataFrame, batch_id: int, sink: Sink | None = None) -> BatchProgress:
        """Run the operator on one micro-batch: the output goes to ``sink(output_df, batch_id)``, the
        only place it can be read (its blocks are released when the sink returns). Returns the
        batch's ``BatchProgress``.

        The steps of the module docstring: ``_plan`` (with ``_claim``), ``_compute`` (``_run_tasks``,
        ``_materialize`` — the Spark job runs here —, ``_collect_reports``, ``_fence``), ``_commit``,
        the sink, then ``_observe`` and ``_record``; with ``materialize="none"`` the sink runs
        inside ``_compute_in_sink``, before the fence. An exception anywhere before the sink returns
        leaves manifest ``batch_id + 1`` unwritten or replaceable: Spark replays the batch from the
        same manifest. One step at a time: an idle time-only batch (``IdleTicker``) and a batch wait
        for each other.
        """
        with self._step_lock:
            return self._process_batch(df, batch_id, sink)

    def _process_batch(self, df: DataFrame, batch_id: int, sink: Sink | None) -> BatchProgress:
        t0 = time.perf_counter()
        spark = df.sparkSession
        sink = for_writer(sink, self.writer_id) if sink is not None else None
        query_id = streaming_query_id(spark)
        self._finish_pending(df, spark, batch_id, sink)
        plan = self._plan(df, batch_id, query_id)
        prog = BatchProgress(batch_id=batch_id, sink_batch_id=plan.sink_batch_id)
        prog.plan = time.perf_counter() - t0
        try:
            output: Materialized | None = None
            with arrow_batch_bytes(spark, self.arrow_max_bytes_per_batch):
                if sink is not None and self.materialize_mode(spark, sink) == "none":
                    reports, refs = self._compute_in_sink(plan, spark, prog, t0, sink)
                else:
                    output, reports, refs = self._compute(plan, spark, prog, t0, keep=sink is not None)
            try:
                event_time = self._event_time(plan, prog)
                with _timed(prog, "manifest"):
                    written = self._commit(plan, refs, merge_declarations(plan.spec.declared,
                                                                          (r.states for r in reports)), event_time)
                fault_point(self._fault_hook, "after_manifest", batch_id, socket_path=self.socket_path)
                if output is not None and sink is not None:
                    with _timed(prog, "sink"):
                        sink(output.result, plan.sink_batch_id)
            finally:
                if output is not None:
                    output.release()
        finally:
            if plan.initial is not None:
                plan.initial.release()
        self._observe(reports)
        self._record(prog, refs, t0, written)
        if self._wants_time_only(spark, plan, written):
            after = self._time_only_batch(df, spark, TimeOnlyAfter.of(plan), written, sink)
            if after is not None:
                written, prog.time_only_after = after
        fault_point(self._fault_hook, "after_sink", batch_id, socket_path=self.socket_path)
        self._last_done = (batch_id, written)
        self._hold_daemon(spark)
        self._arm_idle(df, plan, sink)
        return prog

    def _trigger(self, query_id: str | None) -> str | None:
        """The trigger of streaming query ``query_id`` (``batches.query_trigger``), asked once per query."""
        if self._trigger_of[0] != query_id or query_id is None:
            self._trigger_of = (query_id, query_trigger(query_id))
        return self._trigger_of[1]

    def _arm_idle(self, df: DataFrame, plan: BatchPlan, sink: Sink | None) -> None:
        """After a data batch of a processing-time query whose processor has time work: keep what an
        idle time-only batch needs (``_idle_tick``) and start the ``IdleTicker`` at the trigger's
        interval (``batches.idle_period``)."""
        if self.time_only_batches != "auto" or not self._time_work:
            return
        period = idle_period(self._trigger(plan.query_id), event_time=self.time.event)
        if period is None:
            return
        self._idle_ctx = IdleContext(df=df, after=TimeOnlyAfter.of(plan), sink=sink)
        self._last_step_end = time.monotonic()
        if self._ticker is None or not self._ticker.is_alive():
            self._ticker = IdleTicker(self._idle_tick, period, name=f"statestore-idle-{self.operator_id}")
            self._ticker.start()

    # -- time-only batches (``batches``) --
    def _wants_time_only(self, spark: SparkSession, plan: BatchPlan, written: Manifest) -> bool:
        """Whether a time-only batch follows data batch ``plan`` (which wrote ``written``):
        ``batches.time_only_wanted`` for the query's trigger, a processor with timers or TTLs, and
        with ``time_mode="event"`` a watermark that moves (processing-time timers and TTLs may be
        due whenever the clock moved)."""
        if not time_only_wanted(self.time_only_batches, self._trigger(plan.query_id), spark.conf):
            return False
        if not self._time_work:
            return False
        if self.time.event:
            watermark, _ = batch_watermark(self.time, written.metadata)
            return watermark is not None and watermark != plan.spec.watermark_ms
        return True

    def _time_only_batch(self, df: DataFrame, spark: SparkSession, after: TimeOnlyAfter, base: Manifest,
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
        plan = self._plan_time_only(df, after, base, now_ms, watermark_ms)
        prog = BatchProgress(batch_id=after.batch_id, sink_batch_id=plan.sink_batch_id, time_only=True,
                             watermark_ms=plan.spec.watermark_ms)
        prog.plan = time.perf_counter() - t0
        output: Materialized | None = None
        sank = False  # the sink ran already
        with arrow_batch_bytes(spark, self.arrow_max_bytes_per_batch):
            if sink is not None and not idle and self.materialize_mode(spark, sink) == "none":
                # a one-action sink computes the batch, before its manifest (Spark replays both on a
                # crash); once it ran, the manifest is written even if nothing was due, so that the
                # batch id it was given is never given to another step
                reports, refs = self._compute_in_sink(plan, spark, prog, t0, sink)
                sank = True
            else:
                output, reports, refs = self._compute(plan, spark, prog, t0, keep=sink is not None)
        try:
            if not refs and not sank:
                return None
            extra: dict[str, Any] = ({WATERMARK_KEY: plan.spec.watermark_ms, MAX_EVENT_TIME_KEY: plan.max_event_time_ms}
                                     if self.time.event else {})
            if idle:  # what a rerun uses again (the watermark, with event time, is in ``extra`` already)
                extra.update({SINK_KEY: SINK_PENDING, NOW_KEY: plan.spec.now_ms})
            states = merge_declarations(plan.spec.declared, (r.states for r in reports))
            with _timed(prog, "manifest"):
                written = self._commit(plan, refs, states, extra)
            fault_point(self._fault_hook, "time_only_after_manifest", after.batch_id, socket_path=self.socket_path)
            if sink is not None and output is not None:
                with _timed(prog, "sink"):
                    sink(output.result, plan.sink_batch_id)
            if idle:
                written = self._rewrite(written, {SINK_KEY: SINK_DONE})
        finally:
            if output is not None:
                output.release()
        self._observe(reports)
        self._record(prog, refs, t0, written, last=False)
        log.info("operator %s: a time-only batch after batch %d (watermark %s%s) committed %d partitions as version %d",
                 self.operator_id, after.batch_id, plan.spec.watermark_ms, ", idle stream" if idle else "", len(refs),
                 written.version)
        return written, prog

    def _plan_time_only(self, df: DataFrame, after: TimeOnlyAfter, base: Manifest, now_ms: int | None = None,
                        watermark_ms: int | None = None) -> BatchPlan:
        """The plan of a time-only batch: no rows (an empty frame of ``df``'s columns, one task per
        state partition), the state ``base`` names, the watermark the next batch would use
        (``eventtime.batch_watermark`` of ``base``, or ``watermark_ms``) and the clock now (or ``now_ms``)."""
        watermark, seen = batch_watermark(self.time, base.metadata)
        if watermark_ms is not None:
            watermark = watermark_ms
        df = drop_heartbeat(df)
        routed = _no_rows(df, self.num_partitions)  # task i is partition i: no rows to route, no shuffle
        values = self.value_columns or tuple(c for c in df.columns if c not in self.key_columns)
        spec = TaskSpec(root=self.root, operator_id=self.operator_id, key_columns=self.key_columns, value_columns=values,
                        output_schema=self.arrow_schema, num_partitions=self.num_partitions,
                        num_key_groups=self.num_key_groups, batch_id=after.batch_id,
                        refs=tuple(base.ref(p) for p in range(self.num_partitions)),
                        now_ms=int(self.clock() * 1000) if now_ms is None else now_ms, socket_path=self.socket_path,
                        daemon_env=self._task_daemon_env(df.sparkSession), fault_hook=None, releases=None,
                        keys_unique=bool(self.pre_aggregate), declared=base.metadata.get("states"),
                        daemon_retries=self.daemon_retries, time_mode=self.time.mode, watermark_ms=watermark,
                        rescaled=None, key_schema=_key_schema(df, self.key_columns), event_time_column=None,
                        drop_late=self.time.late_rows == "drop")
        return BatchPlan(batch_id=after.batch_id, base=base, routed=routed, spec=spec, query_id=after.query_id,
                         owner=after.owner, key_types=after.key_types, max_event_time_ms=seen, time_only=True)

    def _rewrite(self, m: Manifest, metadata: Mapping[str, Any]) -> Manifest:
        """Manifest ``m`` written again with ``metadata`` added (an idle time-only batch's sink done)."""
        again = Manifest(m.operator_id, m.version, m.num_partitions, m.num_key_groups, dict(m.stores),
                         metadata={**m.metadata, **metadata})

        async def write(store: ObjectStore) -> None:
            await write_manifest(store, again)

        self._run(write)
        return again

    def _finish_pending(self, df: DataFrame, spark: SparkSession, batch_id: int, sink: Sink | None) -> None:
        """Before batch ``batch_id``: when the manifest it starts from is an idle time-only batch
        whose sink did not return (the driver died in between), run that time-only batch again from
        the manifest below it, with the clock and watermark it recorded, and its sink: the same
        output under the same batch id, then the manifest says done."""
        if batch_id == 0:
            return
        m = self.base_manifest(batch_id)
        if m.metadata.get(SINK_KEY) != SINK_PENDING:
            return
        op = self.operator_id

        async def read(store: ObjectStore) -> Manifest:
            return await read_manifest(store, op, m.version - 1)

        below = self._run(read)
        log.warning("operator %s: the idle time-only batch of version %d did not finish its sink; running it again",
                    op, m.version)
        query_id = streaming_query_id(spark)
        after = TimeOnlyAfter(batch_id=written_by(m), query_id=query_id, owner=self._claim(query_id, batch_id),
                              key_types=below.metadata.get("key_types"))
        done = self._time_only_batch(df, spark, after, below, for_writer(sink, self.writer_id) if sink else None,
                                     idle=True, now_ms=int(m.metadata[NOW_KEY]),
                                     watermark_ms=m.metadata.get(WATERMARK_KEY))
        if done is None:  # nothing came due this time (its tasks' state said so): the state is below's
            raise VersionError(f"operator {op!r}: running the pending time-only batch of version {m.version} again "
                               "fired nothing; its manifest stays pending")
        self._last_done = (batch_id - 1, done[0])

    def _idle_tick(self) -> bool:
        """Called by the ``IdleTicker`` between Spark's batches of a processing-time query: a time-only
        batch when one is due (``_idle_due``), unless a batch runs now. Returns whether the ticker
        should keep going (False once the query is gone or the operator closed)."""
        ctx = self._idle_ctx
        if ctx is None:
            return False
        if not self._step_lock.acquire(blocking=False):
            return True  # a batch runs: it fires what is due itself
        try:
            trigger = query_trigger(ctx.after.query_id)
            if trigger is None:
                return False  # the query stopped
            last = self._last_done
            if time.monotonic() - self._last_step_end < 1.5 * (self._ticker.period if self._ticker else 0.0):
                return True  # a batch ran within the last period and a half: the stream is not idle
            if last is None or last[0] != ctx.after.batch_id or not recorded_by_spark(ctx.after.query_id, last[0]):
                return True
            if not self._idle_due(last[1]):
                return True
            done = self._time_only_batch(ctx.df, ctx.df.sparkSession, ctx.after, last[1], ctx.sink, idle=True)
            if done is not None:
                self._last_done = (last[0], done[0])
                if self.last_progress.time_only_after is None:
                    self.last_progress.time_only_after = done[1]
            else:  # nothing was due: with event time nothing will be until a batch moves the watermark
                self._idle_quiet = last[1].metadata.get(PASS_KEY)
            self._last_step_end = time.monotonic()
            return True
        except Exception:
            log.exception("operator %s: an idle time-only batch failed; the next batch runs it again",
                          self.operator_id)
            return True
        finally:
            self._step_lock.release()

    def _idle_due(self, last: Manifest) -> bool:
        """Whether an idle time-only batch may fire something after manifest ``last``: with
        ``time_mode="event"`` a watermark that moved since ``last``'s batch (once); with
        processing-time timers or TTLs, the clock (every ``IdleTicker`` period)."""
        if self.time.event:
            watermark, _ = batch_watermark(self.time, last.metadata)
            return (watermark is not None and watermark != last.metadata.get(WATERMARK_KEY)
                    and self._idle_quiet != last.metadata.get(PASS_KEY))
        return True

    def _plan(self, df: DataFrame, batch_id: int, query_id: str | None = None) -> BatchPlan:
        """Step 1, on the driver, before Spark runs anything: claim the state for ``query_id``
        (``_claim``), read the manifest the batch starts from (``base_manifest``: checked against the
        settings), check the key columns, route the rows (``routed``: lazy) and build the tasks'
        ``TaskSpec``. Raises ``OwnerConflictError``, ``OperatorConfigError``,
        ``VersionNotFoundError``, ``InterfaceError``; writes nothing but the claim (an owner record)."""
        owner = self._claim(query_id, batch_id)
        base = self.base_manifest(batch_id)
        if self.initial_state is not None and base.version > 0 and not self.history:
            raise OperatorConfigError(
                f"operator {self.operator_id!r} at {self.root} already has state (version {base.version}, batch "
                f"{batch_id}): initial_state= is applied once, before a query's first batch, and this run would "
                "not apply it. Drop initial_state= when restarting the query (its state carries on), or start a "
                "new operator id (or checkpoint root) to begin again from the initial state.")
        rescaled = None
        if base.num_partitions != self.num_partitions:
            base, rescaled = self._rescale(base)
        df = drop_heartbeat(df)
        missing = [c for c in self.key_columns if c not in df.columns]
        if missing:
            raise InterfaceError(f"key columns {missing} are not in the batch's columns {df.columns}")
        initial = None
        if base.version == 0 and self.initial_state is not None:
            base, initial = self._load_initial_state(base, batch_id)
        watermark, seen = batch_watermark(self.time, base.metadata)
        observation = event_times = None
        # the tasks count (and drop) late rows, unless the JVM aggregates the rows before any task sees them
        in_tasks = self.time.event_time_column if self.time.event and not self.pre_aggregate else None
        if in_tasks is not None:
            event_time_kind(df, in_tasks)  # InterfaceError: missing, or not a time
            event_times = df.sparkSession.sparkContext.accumulator([], _reports_param())
        elif self.time.event:  # observed and filtered in the JVM, before its pre-aggregation
            df, observation = observe_event_time(df, self.time, watermark)
        routed, values = self.routed(df, in_tasks)
        spec = TaskSpec(root=self.root, operator_id=self.operator_id, key_columns=self.key_columns, value_columns=values,
                        output_schema=self.arrow_schema, num_partitions=self.num_partitions,
                        num_key_groups=self.num_key_groups, batch_id=batch_id,
                        refs=tuple(base.ref(p) for p in range(self.num_partitions)),
                        now_ms=int(self.clock() * 1000), socket_path=self.socket_path,
                        daemon_env=self._task_daemon_env(df.sparkSession),
                        fault_hook=self._fault_hook,
                        releases=self.coordinator.releases() if self.coordinator is not None else None,
                        keys_unique=bool(self.pre_aggregate), declared=base.metadata.get("states"),
                        daemon_retries=self.daemon_retries, time_mode=self.time.mode, watermark_ms=watermark,
                        rescaled=rescaled, key_schema=_key_schema(df, self.key_columns),
                        event_time_column=in_tasks,
                        drop_late=self.time.late_rows == "drop")
        types = {f.name: f.dataType.simpleString() for f in df.schema.fields if f.name in self.key_columns}
        return BatchPlan(batch_id=batch_id, base=base, routed=routed, spec=spec, query_id=query_id, owner=owner,
                         key_types=types if len(types) == len(self.key_columns) else None,
                         max_event_time_ms=seen, observation=observation, event_times=event_times, initial=initial)

    def _rescale(self, base: Manifest) -> tuple[Manifest, tuple[int, int]]:
        """The state of manifest ``base`` (written with another number of partitions) at this
        operator's: for each new partition, a state R (version: the newest of the old states'; a fresh
        checkpoint id) whose recipe names the key-group ranges it owns in the old partitions' states
        (``files.rescale``; written now). The daemon that opens R first in the batch assembles it
        from those ranges of the old files and writes its snapshot; the fence checks the snapshots.
        Like the initial state, the R's are in no manifest of their own: a replay of the batch
        rescales again, under new checkpoint ids. Returns the manifest the batch starts from (its
        metadata says where it came from) and ``TaskSpec.rescaled``."""
        old = tuple(base.ref(p) for p in range(base.num_partitions))
        version = max(base.version, *(r.version for r in old))
        plans = plan_sources(old, self.num_partitions, self.num_key_groups)
        refs = [CheckpointRef(version, new_checkpoint_id()) if sources else EMPTY_STATE for sources in plans]
        recipes = [(StoreId(self.root, self.operator_id, p), ref,
                    Recipe(p, self.num_partitions, self.num_key_groups, base.num_partitions, base.version, sources))
                   for p, (ref, sources) in enumerate(zip(refs, plans)) if sources]

        async def write(store: ObjectStore) -> None:
            await asyncio.gather(*(write_recipe(store, sid, ref, recipe) for sid, ref, recipe in recipes))

        self._run(write)
        log.warning("operator %s: rescaling from %d to %d partitions at version %d (%d key groups); each new "
                    "partition's state is assembled from the old partitions' files when first opened",
                    self.operator_id, base.num_partitions, self.num_partitions, base.version, self.num_key_groups)
        metadata = dict(base.metadata)
        metadata[RESCALED_FROM_KEY] = {"version": base.version, "num_partitions": base.num_partitions,
                                       "stores": [[r.version, r.ckptid] for r in old]}
        return (Manifest(self.operator_id, base.version, self.num_partitions, self.num_key_groups,
                         {DEFAULT_STORE_NAME: tuple(refs)}, metadata=metadata),
                (base.num_partitions, version))

    def _load_initial_state(self, empty: Manifest, batch_id: int) -> tuple[Manifest, Materialized]:
        """Before the first batch: ``initial_state``'s rows, routed like a batch's, through
        ``runtime.run_initial_state`` (``handle_initial_state`` per key; nothing fires or expires)
        in a job of its own, its deltas fenced; returns the state batch 0 starts from (in no
        manifest: a replay of batch 0 loads the initial state again, under new checkpoint ids) and
        the calls' output, materialized (it joins batch 0's output; the caller releases it)."""
        df = self.initial_state
        assert df is not None
        values = tuple(c for c in df.columns if c not in self.key_columns)
        routed = with_routing(df, list(self.key_columns), self.num_partitions, self.num_key_groups,
                              columns=[*self.key_columns, *values])
        spec = TaskSpec(root=self.root, operator_id=self.operator_id, key_columns=self.key_columns, value_columns=values,
                        output_schema=self.arrow_schema, num_partitions=self.num_partitions,
                        num_key_groups=self.num_key_groups, batch_id=batch_id,
                        refs=tuple(empty.ref(p) for p in range(self.num_partitions)),
                        now_ms=int(self.clock() * 1000), socket_path=self.socket_path,
                        daemon_env=self._task_daemon_env(df.sparkSession),
                        daemon_retries=self.daemon_retries, time_mode=self.time.mode)
        acc = df.sparkSession.sparkContext.accumulator([], _reports_param())
        output = self._materialize(routed.mapInArrow(self._task_fn(spec, acc, run_initial_state), self.output_schema),
                                   df.sparkSession, batch_id)
        try:
            prog = BatchProgress()
            refs = self._collect_reports(acc.value, prog)
            self._fence(refs, locations=prog.locations)
        except BaseException:
            output.release()
            raise
        log.info("operator %s: initial state loaded into %d partitions", self.operator_id, len(refs))
        return Manifest(self.operator_id, 0, self.num_partitions, self.num_key_groups,
                        {DEFAULT_STORE_NAME: tuple(refs.get(p, empty.ref(p)) for p in range(self.num_partitions))},
                        metadata={INITIAL_STATE_KEY: True}), output

    def _claim(self, query_id: str | None, batch_id: int) -> OwnerRecord | None:
        """One writer per state: ``OwnerConflictError`` unless the streaming query ``query_id`` owns
        the operator's state, claiming it when nobody does (or taking it over, see ``takeover``; a
        takeover then deletes the manifests after ``batch_id`` that the old owner wrote). Later
        batches of this operator only look for a newer owner record (one GET). Outside a streaming
        query (``query_id`` None) a batch may run only on a state that no query owns, and claims
        nothing. Returns the claim (None outside a query)."""
        op, root, takeover = self.operator_id, self.root, self.takeover
        known = self._owner if self._owner is not None and self._owner.owner == query_id else None

        async def claim(store: ObjectStore) -> OwnerRecord | None:
            if query_id is None:
                current = await read_owner(store, op)
                if current is not None:
                    raise OwnerConflictError(
                        f"operator {op!r} at {root} is owned by streaming query {current.owner} (epoch "
                        f"{current.epoch}); a batch run outside any streaming query (no {QUERY_ID_PROPERTY} "
                        "on this thread) may not write a query's state")
                return None
            if known is not None:
                current = await read_owner(store, op, known)
                if current is not None and current.epoch != known.epoch:
                    raise OwnerConflictError(
                        f"operator {op!r} at {root} was taken over by {current.owner!r} (epoch {current.epoch}) "
                        f"while query {query_id} ran it: this query stops before batch {batch_id} writes anything")
                return known
            try:
                record = await claim_owner(store, op, query_id, takeover=takeover, from_version=batch_id)
            except OwnerConflictError:
                current = await read_owner(store, op)
                owner, epoch = (current.owner, current.epoch) if current is not None else ("?", "?")
                raise OwnerConflictError(
                    f"operator {op!r} at {root} belongs to streaming query {owner} (owner epoch {epoch}), not to "
                    f"this query ({query_id}): one writer per state, so this query is refused before its batch "
                    f"{batch_id} writes anything"
                    + (f" (takeover={takeover!r} does not name the owner)" if isinstance(takeover, str) else "")
                    + f". Restarting query {owner} (from its checkpoint location) continues it. If that query is "
                    f"dead for good, StatefulOperator(..., takeover={owner!r}) hands the state to this query, which "
                    f"continues from the state of its batch {batch_id} (see docs/SPARK.md)") from None
            if record.previous is not None:
                # a takeover, now or by an earlier run of this query: the old owner's later manifests
                # go (again, if a crash came between the claim and their deletion)
                base = await find_base(store, op, batch_id) if batch_id > 0 else None
                dropped = await delete_manifests_after(store, op, base.version if base is not None else 0)
                if dropped:
                    log.warning("operator %s: query %s took over from %s at batch %d; deleted manifests %s of the "
                                "old owner", op, query_id, record.previous, batch_id, dropped)
            return record

        record = self._run(claim)
        if record is not None and record is not known:
            log.info("operator %s at %s: owned by query %s (epoch %d)", op, root, record.owner, record.epoch)
        self._owner = record if record is not None else self._owner
        return record

    def owner(self) -> OwnerRecord | None:
        """The record of the streaming query that owns the operator's state now (None: none does)."""
        op = self.operator_id

        async def read(store: ObjectStore) -> OwnerRecord | None:
            return await read_owner(store, op)

        return self._run(read)

    def routed(self, df: DataFrame, event_time_column: str | None = None) -> tuple[DataFrame, tuple[str, ...]]:
        """``(routed, value_columns)``: the batch shuffled so task i holds state partition i's rows (and,
        with ``pre_aggregate``, one row per key of those rows' aggregates); ``event_time_column`` (the
        tasks count late rows) is routed too when it is neither a key nor a value column (the
        processor does not get it)."""
        if self.pre_aggregate:
            # the JVM combines each key's rows of the batch right after the routing shuffle: grouped by
            # (route, key group, keys), the aggregate is satisfied by the shuffle's partitioning, so it
            # adds no shuffle of its own (a groupBy before the routing would shuffle twice)
            routed = with_routing(df, list(self.key_columns), self.num_partitions, self.num_key_groups)
            routed = routed.groupBy(ROUTE_COLUMN, KG_COLUMN, *self.key_columns).agg(*self.pre_aggregate)
            return routed, tuple(c for c in routed.columns if c not in (ROUTE_COLUMN, KG_COLUMN, *self.key_columns))
        values = self.value_columns or tuple(c for c in df.columns if c not in self.key_columns)
        extra = [event_time_column] if event_time_column not in (None, *self.key_columns, *values) else []
        return with_routing(df, list(self.key_columns), self.num_partitions, self.num_key_groups,
                            columns=[*self.key_columns, *values, *extra]), values

    def _compute(self, plan: BatchPlan, spark: SparkSession, prog: BatchProgress, t0: float,
                 keep: bool = True) -> tuple[Materialized, list[TaskReport], dict[int, CheckpointRef]]:
        """Steps 2 to 5: run the stateful stage (``_run_tasks``, ``_materialize``; ``keep`` False: no
        sink will read the output, the stage runs as a ``noop`` write), collect the reports and fence
        them; returns the output (the caller must ``release()`` it), the reports and the committed
        checkpoints. A fence that times out means a daemon died before uploading what a task had
        committed on it: the stage runs again from the same manifest, with fresh checkpoint ids (the
        lost ones are in no manifest), up to ``daemon_retries`` times."""
        for run in range(self.daemon_retries + 1):
            prog.reruns = run
            prog.tasks, prog.locations = {}, {}
            out, acc, _ = self._run_tasks(plan, spark)
            output = self._materialize(out, spark, plan.batch_id) if keep else run_unkept(out)
            prog.compute = time.perf_counter() - t0
            try:
                reports: list[TaskReport] = acc.value
                refs = self._collect_reports(reports, prog)
                fault_point(self._fault_hook, "time_only_before_fence" if plan.time_only else "before_fence",
                            plan.batch_id, socket_path=self.socket_path)
                with _timed(prog, "fence"):
                    self._fence(refs, assembled=plan.base if plan.spec.rescaled else None, locations=prog.locations)
            except FenceTimeoutError as exc:
                output.release()
                if run == self.daemon_retries:
                    raise
                log.warning("operator %s batch %d: %s; running the batch's stateful stage again (%d of %d)",
                            self.operator_id, plan.batch_id, exc, run + 1, self.daemon_retries)
                continue
            except BaseException:
                output.release()
                raise
            return output, reports, refs
        raise AssertionError("unreachable: the last run returns or raises")

    def _compute_in_sink(self, plan: BatchPlan, spark: SparkSession, prog: BatchProgress, t0: float,
                         sink: Sink) -> tuple[list[TaskReport], dict[int, CheckpointRef]]:
        """Steps 2 to 5 with ``materialize="none"``: the sink gets the stateful stage's output
        unmaterialized, and its action runs the stage (one job: no copy of the output is kept, no
        second job reads it); a sink that read none of it is followed by a ``noop`` write. Then every
        partition's task must have run to its end exactly once (``OutputReadError`` otherwise: the
        batch fails, nothing is committed), and the reports are collected and fenced. The sink
        therefore runs before the state is committed: a fence that times out fails the batch, for
        Spark to replay it (the sink is called again for the batch), instead of running the stage
        again here. ``prog.compute`` includes the sink, and ``prog.sink`` is its part of it."""
        prog.tasks, prog.locations = {}, {}
        out, acc, finished = self._run_tasks(plan, spark)
        with _timed(prog, "sink"):
            sink(out, plan.sink_batch_id)
        if not finished.value and not acc.value:
            run_unkept(out)
        prog.compute = time.perf_counter() - t0
        ran = sorted(finished.value)
        if ran != list(range(self.num_partitions)):
            twice = sorted({p for p in ran if ran.count(p) > 1})
            missing = sorted(set(range(self.num_partitions)) - set(ran))
            raise OutputReadError(
                f"batch {plan.batch_id} of operator {self.operator_id!r}: "
                + ("the sink is marked one_action, so it" if self.materialize == "auto" else "with materialize='none' the sink")
                + " must read the whole output exactly once, with one action (its action computes the state); "
                + (f"partitions {twice} ran more than once" if twice else f"partitions {missing} were not read to the end")
                + ". Nothing is committed. Write the DataFrame once in the sink, or "
                + ("drop the one_action mark" if self.materialize == "auto" else "use materialize='checkpoint'")
                + " (the output is then kept for any number of reads)")
        reports: list[TaskReport] = acc.value
        refs = self._collect_reports(reports, prog)
        fault_point(self._fault_hook, "before_fence", plan.batch_id, socket_path=self.socket_path)
        with _timed(prog, "fence"):
            self._fence(refs, assembled=plan.base if plan.spec.rescaled else None, locations=prog.locations)
        return reports, refs

    def _run_tasks(self, plan: BatchPlan, spark: SparkSession) -> tuple[DataFrame, Accumulator, Accumulator]:
        """Step 2: the stateful stage, lazily: one ``mapInArrow`` task per state partition
        (``runtime.run_partition``), the accumulator that collects the ``TaskReport`` of every task
        that committed, and the one where each task adds its partition once it has handed over its
        last output row. Nothing runs until the output is materialized."""
        acc = spark.sparkContext.accumulator([], _reports_param())
        finished = spark.sparkContext.accumulator([], _reports_param())
        out = plan.routed.mapInArrow(self._task_fn(plan.spec, acc, finished=finished, event_times=plan.event_times),
                                     self.output_schema)
        if plan.initial is not None:  # handle_initial_state's rows join batch 0's output
            out = out.union(plan.initial.result)
        return out, acc, finished

    def _task_fn(self, spec: TaskSpec, acc: Accumulator, run: Callable[..., pa.Table] = run_partition,
                 finished: Accumulator | None = None, event_times: Accumulator | None = None,
                 ) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
        """The function ``mapInArrow`` runs on an executor: ``run`` (``run_partition``, or
        ``run_initial_state``) on the task's partition (Spark's partition id is the state
        partition), its report added to ``acc``, its ``(partition, max event time, late rows)`` to
        ``event_times`` (when given: the tasks count late rows), and its partition to ``finished``
        (when given) after its last output row."""
        processor = self.processor

        def task(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
            from pyspark import TaskContext

            ctx = TaskContext.get()
            assert ctx is not None  # set in every task
            part, attempt = ctx.partitionId(), ctx.attemptNumber()
            kw = {} if event_times is None else {"event_time": lambda top, late: event_times.add([(part, top, late)])}
            out = run(processor, spec, part, attempt, list(batches), lambda r: acc.add([r]), **kw)
            yield from out.to_batches(max_chunksize=65536)
            if finished is not None:
                finished.add([part])

        return task

    def _materialize(self, out: DataFrame, spark: SparkSession, batch_id: int) -> Materialized:
        """Step 3: compute the output once and keep it for the sink, so that the sink cannot run the
        stateful stage again. This runs the Spark job, and with it the tasks' commits; when it
        returns, the accumulator holds the reports. Parquet files under ``output_path`` when set,
        else ``materialize_mode``'s ``MATERIALIZERS`` entry. The caller must ``release()`` it."""
        if self.output_path:
            folder = f"{self.output_path.rstrip('/')}/{batch_id}-{uuid.uuid4().hex[:12]}"
            return materialize_parquet(out, spark, folder, self.output_schema)
        return MATERIALIZERS[self._holding_mode(spark)](out)

    def materialize_mode(self, spark: SparkSession, sink: Sink | None = None) -> str:
        """``"checkpoint"``, ``"cache"`` or ``"none"``: ``materialize``, with ``"auto"`` resolved for
        this session and ``sink``: ``"none"`` for a sink marked as reading its output once
        (``sinks.one_action``, ``sinks.write_sink``; unless ``output_path`` is set), else
        ``"checkpoint"`` in local mode, ``"cache"`` on a cluster."""
        if self.materialize != "auto":
            return self.materialize
        if sink is not None and not self.output_path and reads_output_once(sink):
            return "none"
        return self._holding_mode(spark)

    def _holding_mode(self, spark: SparkSession) -> str:
        """How an output that must be held is kept: ``materialize``, ``"auto"`` and ``"none"`` (the
        initial state's output, which joins batch 0's) resolved for this session."""
        if self.materialize in MATERIALIZERS:
            return self.materialize
        return "checkpoint" if (spark.sparkContext.master or "").startswith("local") else "cache"

    def _collect_reports(self, reports: list[TaskReport], prog: BatchProgress) -> dict[int, CheckpointRef]:
        """Step 4: the committed checkpoint of every partition that had rows, from the tasks' reports
        (recorded in ``prog``). Raises ``DuplicateReportError`` for two reports of one partition,
        ``OperatorConfigError`` for a partition out of range."""
        refs: dict[int, CheckpointRef] = {}
        for r in reports:
            p = r.partition
            prog.tasks[p] = r.timings
            if r.node is not None:
                prog.locations[p] = r.node["location"]
            if p in refs:
                raise DuplicateReportError(f"partition {p} reported two committed attempts: {refs[p]} and {r.ref}")
            if not 0 <= p < self.num_partitions:
                raise OperatorConfigError(f"a task reported partition {p} outside [0, {self.num_partitions})")
            refs[p] = r.ref
        return refs

    def _fence(self, refs: dict[int, CheckpointRef], assembled: Manifest | None = None,
               locations: Mapping[int, str] | None = None) -> None:
        """Step 5: wait until every reported delta exists in the object store (HEAD, not the report),
        and after a rescale (``assembled``: the rescaled manifest the batch started from) every
        assembled state's snapshot, polling every <= 50 ms for ``FENCE_FAST_SECONDS`` then every <= 0.5 s;
        ``FenceTimeoutError`` after ``fence_timeout`` seconds (the batch is then not committed, and
        Spark replays it). A partition whose task ran on this host (``locations``: where each task
        ran, from the coordinator) also has its daemon asked to answer once its delta is durable
        (AWAIT_DURABLE, ``_durable_answers``): each answer wakes the fence for a HEAD at once, instead
        of at its next poll. The HEADs decide, never the answers."""
        keys = {file_key(StoreId(self.root, self.operator_id, p), ref, DELTA) for p, ref in refs.items()}
        if assembled is not None:
            keys |= {file_key(StoreId(self.root, self.operator_id, p), assembled.ref(p), SNAPSHOT)
                     for p in range(self.num_partitions) if not assembled.ref(p).is_empty_state}
        if not keys:
            return
        timeout = self.fence_timeout
        asks: dict[str, list[tuple[StoreId, CheckpointRef]]] = {}
        for p, ref in refs.items():
            sock = local_socket((locations or {}).get(p))
            if sock is not None:
                asks.setdefault(sock, []).append((StoreId(self.root, self.operator_id, p), ref))

        async def fence(store: ObjectStore) -> None:
            pending = set(keys)
            started = time.monotonic()
            deadline = started + timeout
            pause = 0.01
            answers = [asyncio.ensure_future(_durable_answers(sock, wanted, timeout)) for sock, wanted in asks.items()]
            try:
                while True:
                    found = await asyncio.gather(*(store.exists(k) for k in sorted(pending)))
                    pending -= {k for k, ok in zip(sorted(pending), found) if ok}
                    if not pending:
                        return
                    if time.monotonic() > deadline:
                        raise FenceTimeoutError(
                            f"{len(pending)} checkpoint file(s) of operator {self.operator_id!r} not in {self.root} "
                            f"after {timeout}s (e.g. {sorted(pending)[0]}): the daemon that committed them may have "
                            "died before uploading; the batch is not committed and will be replayed")
                    # a delta usually lands within a few hundred ms of the job's end: look every 50 ms
                    # at most for the first seconds (the batch waits on this), then back off to 0.5 s;
                    # a local daemon's answer wakes the fence before that
                    waiting = [a for a in answers if not a.done()]
                    if waiting:
                        await asyncio.wait(waiting, timeout=pause, return_when=asyncio.FIRST_COMPLETED)
                    else:
                        await asyncio.sleep(pause)
                    pause = min(pause * 2, 0.05 if time.monotonic() - started < FENCE_FAST_SECONDS else 0.5)
            finally:
                for a in answers:
                    a.cancel()
                await asyncio.gather(*answers, return_exceptions=True)

        self._run(fence)

    def _event_time(self, plan: BatchPlan, prog: BatchProgress) -> dict[str, int | None]:
        """After the job ran: the batch's watermark, max event time and late rows into ``prog``, and
        the manifest metadata that lets batch ``batch_id + 1`` compute its watermark (and a replay of
        this batch read the same): the watermark this batch used and the max event time of the
        batches up to it. {} outside time_mode "event"."""
        if not self.time.event:
            return {}
        if plan.event_times is not None:
            top, late = tasks_event_time(plan.event_times.value)
        else:
            top, late = observed_event_time(plan.observation)
        prog.watermark_ms, prog.max_event_time_ms, prog.late_rows = plan.spec.watermark_ms, top, late
        before = plan.max_event_time_ms
        seen = before if top is None else top if before is None else max(top, before)
        return {WATERMARK_KEY: plan.spec.watermark_ms, MAX_EVENT_TIME_KEY: seen}

    def with_heartbeat(self, events: DataFrame, rows_per_batch: int = 1) -> DataFrame:
        """``events`` (the query's streaming DataFrame) with a heartbeat source, so that Spark calls
        ``foreachBatch`` at every trigger even when no event arrives, and timers fire in idle
        streams; the heartbeat's rows are dropped by the operator before anything else. Give the
        query a trigger interval. See ``eventtime.with_heartbeat``."""
        return with_heartbeat(events, rows_per_batch)

    def _commit(self, plan: BatchPlan, refs: dict[int, CheckpointRef], states: dict | None = None,
                event_time: dict[str, int | None] | None = None) -> Manifest:
        """Step 6, after the fence: check the batch's query still owns the state (``OwnerConflictError``
        otherwise: an owner record newer than ``plan.owner``), then write manifest ``plan.base.version + 1``
        (replacing one an earlier attempt of the batch wrote), and return it: each partition's reported
        checkpoint, else the one ``plan.base`` names; the Spark batch that wrote it and a new pass id
        (a time-only batch: marked, with the pass id of the manifest it follows; ``batches``);
        ``states``: the state variables' declarations (``processor.merge_declarations``), which the
        next batch's tasks check theirs against. From here on the batch's state counts (once Spark
        records the batch)."""
        stores = tuple(refs.get(p, plan.base.ref(p)) for p in range(self.num_partitions))
        metadata = {"layout": LAYOUT, "key_columns": list(self.key_columns),
                    "processor": type(self.processor).__qualname__, BATCH_KEY: plan.batch_id,
                    PASS_KEY: uuid.uuid4().hex}
        if plan.time_only:
            metadata[TIME_ONLY_KEY] = True
            metadata[FOLLOWS_KEY] = plan.base.metadata.get(PASS_KEY)
        key_types = plan.key_types or plan.base.metadata.get("key_types")
        if key_types:  # the key columns' Spark types, for readers (``read_state``)
            metadata["key_types"] = key_types
        if states:
            metadata["states"] = states
        if event_time:
            metadata.update(event_time)
        if plan.base.metadata.get(INITIAL_STATE_KEY):
            metadata[INITIAL_STATE_KEY] = True
        if plan.spec.rescaled:  # the first batch after a rescale: where its states came from
            metadata[RESCALED_FROM_KEY] = plan.base.metadata[RESCALED_FROM_KEY]
        op, root, known = self.operator_id, self.root, plan.owner
        if known is not None:  # who wrote it (the owner record's epoch)
            metadata["owner"], metadata["owner_epoch"] = known.owner, known.epoch
        manifest = Manifest(self.operator_id, plan.base.version + 1, self.num_partitions, self.num_key_groups,
                            {DEFAULT_STORE_NAME: stores}, metadata=metadata)

        async def write(store: ObjectStore) -> None:
            # one writer per state: an owner record newer than the batch's claim stops the batch here
            current = await read_owner(store, op, known)
            if current is not None and (known is None or current.epoch != known.epoch):
                raise OwnerConflictError(
                    f"operator {op!r} at {root} was claimed by {current.owner!r} (epoch {current.epoch}) while batch "
                    f"{plan.batch_id} of {plan.query_id or 'no streaming query'} ran: its manifest is not written")
            await write_manifest(store, manifest)

        self._run(write)
        return manifest

    def _observe(self, reports: list[TaskReport]) -> None:
        """After the sink: tell the coordinator (when on) where the batch's tasks ran. Only now: a
        batch that failed before its manifest taught the coordinator nothing."""
        if self.coordinator is not None:
            self.coordinator.observe([(r.partition, r.node) for r in reports if r.node is not None])

    def _record(self, prog: BatchProgress, refs: dict[int, CheckpointRef], t0: float, written: Manifest,
                last: bool = True) -> BatchProgress:
        """Complete ``prog`` (started at ``t0``, ``time.perf_counter``; it wrote ``written``), and
        for a data batch (``last``) keep it as ``last_progress`` and in ``history`` (a time-only
        batch is its data batch's ``time_only_after``); log it; returns it."""
        prog.partitions_committed = len(refs)
        prog.refs = refs
        prog.version = written.version
        prog.total = time.perf_counter() - t0
        if last:
            self.last_progress = prog
            self.history.append(prog)
        log.info("operator %s batch %d: %d partitions committed, compute %.3fs fence %.3fs",
                 self.operator_id, prog.batch_id, len(refs), prog.compute, prog.fence)
        return prog

    def __getstate__(self) -> NoReturn:
        raise InterfaceError("StatefulOperator lives on the driver; tasks get a TaskSpec")


async def _durable_answers(socket_path: str, wanted: Sequence[tuple[StoreId, CheckpointRef]], timeout: float) -> None:
    """Returns once the daemon at ``socket_path`` (on the driver's host) has answered AWAIT_DURABLE
    for every one of ``wanted`` (pipelined on one connection): the fence's wake-up for a HEAD of
    those files. Best effort: an error only leaves the fence to its polling."""
    client = AsyncClient(socket_path, timeout=timeout + 5, name="statestore_async.fence")
    try:
        async with client:
            await asyncio.gather(*(client.await_durable(sid, ref, timeout) for sid, ref in wanted))
    except (StateStoreError, OSError) as exc:
        log.debug("fence: no durability answers from the daemon at %s (%s); polling only", socket_path, exc)
    finally:  # also when the fence cancels this while the client connects (its reader task is started)
        await client.close()


class _DriverIO:
    """The driver's object store, kept for the operator's life: one event loop in a daemon thread
    (foreachBatch may call from any thread) and one store on it. A fresh loop and S3 client per
    call cost ~30 ms each against a local S3 server (vs ~1.5 ms for a HEAD on a warm client), and a
    batch makes three calls: manifest read, fence, manifest write. Closed by ``close()``, when the
    operator is collected, or at exit."""

    def __init__(self, open_store: Callable[[], ObjectStore]) -> None:
        self._open_store = open_store
        self._lock = threading.Lock()
        self._io: dict[str, Any] = {}  # loop, thread, store: shared with the finalizer, which must not hold self
        self._finalizer = weakref.finalize(self, _DriverIO._shutdown, self._io, self._lock)

    def run(self, coro_fn: Callable[[ObjectStore], Awaitable[T]]) -> T:
        """``await coro_fn(store)`` on the I/O thread's loop (started on first use); its result."""
        io = self._io
        with self._lock:
            if "loop" not in io:
                io["loop"] = asyncio.new_event_loop()
                io["thread"] = threading.Thread(target=io["loop"].run_forever, name="statestore-driver-io",
                                                daemon=True)
                io["thread"].start()
            loop = io["loop"]
        return asyncio.run_coroutine_threadsafe(self._call(coro_fn), loop).result()

    async def _call(self, coro_fn: Callable[[ObjectStore], Awaitable[T]]) -> T:
        if self._io.get("store") is None:
            self._io["store"] = self._open_store()
        return await coro_fn(self._io["store"])

    def close(self) -> None:
        _DriverIO._shutdown(self._io, self._lock)

    @staticmethod
    def _shutdown(io: dict[str, Any], lock: threading.Lock) -> None:
        with lock:
            loop, thread, store = io.pop("loop", None), io.pop("thread", None), io.pop("store", None)
        if loop is None:
            return
        try:
            if store is not None:
                asyncio.run_coroutine_threadsafe(store.close(), loop).result(timeout=30)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(30)
            loop.close()


def _no_rows(df: DataFrame, num_partitions: int) -> DataFrame:
    """An empty frame of ``df``'s columns and the routing's over exactly ``num_partitions``
    partitions (a range of that many slices: task i is partition i, as after the routing shuffle),
    which the optimizer cannot prove empty (a time-only batch runs one task per state partition)."""
    from pyspark.sql import functions as F

    columns = [F.lit(None).cast(f.dataType).alias(f.name) for f in df.schema.fields]
    columns += [F.lit(None).cast("int").alias(KG_COLUMN), F.lit(None).cast("int").alias(ROUTE_COLUMN)]
    return df.sparkSession.range(0, num_partitions, 1, num_partitions).where("id < 0").select(*columns)


def _key_schema(df: DataFrame, key_columns: Sequence[str]) -> pa.Schema | None:
    """The key columns' Arrow types as the tasks receive them (``TaskSpec.key_schema``: the keys of
    due timers without rows decode straight to them); None when Spark cannot say."""
    from pyspark.sql.pandas.types import to_arrow_schema
    from pyspark.sql.types import StructType

    try:
        return to_arrow_schema(StructType([df.schema[c] for c in key_columns]))
    except Exception as exc:  # a type Arrow cannot carry: the tasks infer from the values
        log.debug("no Arrow schema for the key columns %s: %s", list(key_columns), exc)
        return None


def _release_checkpoint(df: DataFrame) -> None:
    """Drop the blocks of a locally checkpointed DataFrame now; otherwise they stay until the JVM's
    garbage collector lets Spark's cleaner find the RDD (for a streaming query: many batches' outputs)."""
    try:
        df._jdf.logicalPlan().rdd().unpersist(False)
    except Exception as exc:  # a plan that is not the checkpoint's LogicalRDD: leave it to the cleaner
        log.warning("could not release the output's checkpoint blocks now (Spark's cleaner will): %s", exc)


def _remove_local_folder(folder: str) -> None:
    """Delete an output folder of ``materialize_parquet`` if it is local (``/…``, ``file:…``)."""
    if folder.startswith(("/", "file:")):
        shutil.rmtree(folder.removeprefix("file://").removeprefix("file:"), ignore_errors=True)


__all__ = ["BatchProgress", "DuplicateReportError", "FenceTimeoutError", "OperatorConfigError", "OutputReadError",
           "StatefulOperator"]
