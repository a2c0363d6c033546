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
2. run (``_run_tasks``, lazy): one ``mapInArrow`` task per partition (``task.partition.run_partition``)
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

import logging
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from statestore_async.codecs.keylayout import DEFAULT_KEY_GROUPS, check_num_key_groups
from statestore_async.errors import (
    InterfaceError,
    VersionNotFoundError,
)
from statestore_async.files.manifest import (
    Manifest,
    OwnerRecord,
)
from statestore_async.ids import DEFAULT_STORE_NAME, EMPTY_STATE, CheckpointRef, _check_name
from statestore_async.objectstore import ObjectStore, open_object_store
from statestore_async.spark.api.processors import (
    StatefulProcessor,
    VectorizedProcessor,
    check_picklable,
    check_processor,
    merge_declarations,
    uses_initial_state,
)
from statestore_async.spark.api.sinks import for_writer, reads_output_once
from statestore_async.spark.driver import commit, startstate, timeonly
from statestore_async.spark.driver.batches import (
    TIME_ONLY_SETTINGS,
    IdleContext,
    IdleTicker,
    TimeOnlyAfter,
    find_base,
    query_trigger,
)
from statestore_async.spark.driver.driverio import DriverIO
from statestore_async.spark.driver.errors import DuplicateReportError, FenceTimeoutError, OperatorConfigError, OutputReadError
from statestore_async.spark.driver.materialize import (
    ARROW_BYTES_UNLIMITED,
    MATERIALIZE,
    MATERIALIZERS,
    Materialized,
    arrow_batch_bytes,
    materialize_parquet,
    run_unkept,
)
from statestore_async.spark.driver.plan import (
    BatchPlan,
    Sink,
    arrow_schema,
    key_schema,
    streaming_query_id,
)
from statestore_async.spark.driver.progress import BatchProgress, reports_param, timed
from statestore_async.spark.shared import hooks, placement
from statestore_async.spark.shared.coordinator import Coordinator
from statestore_async.spark.shared.eventtime import (
    TimeSettings,
    batch_watermark,
    drop_heartbeat,
    event_time_kind,
    observe_event_time,
    time_settings,
    with_heartbeat,
)
from statestore_async.spark.shared.hooks import hook_point
from statestore_async.spark.shared.routing import KG_COLUMN, ROUTE_COLUMN, with_routing
from statestore_async.spark.shared.taskspec import TaskReport, TaskSpec
from statestore_async.spark.task.partition import run_partition
from statestore_async.state.roots import checkpoint_root as checkpoint_root_uri
from statestore_async.state.roots import s3_options_from_env

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark import Accumulator
    from pyspark.sql import Column, DataFrame, SparkSession
    from pyspark.sql.types import StructType


log = logging.getLogger(__name__)


T = TypeVar("T")


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
        self.output_schema, self.arrow_schema = arrow_schema(output_schema)
        self.num_partitions = num_partitions
        self.num_key_groups = num_key_groups
        self.socket_path = socket_path
        self.daemon_env = daemon_env
        self.fence_timeout = fence_timeout
        self.s3_options = s3_options
        self.output_path = output_path
        self.clock = clock  # seconds; the TTL clock of a batch is read once, on the driver
        self.pre_aggregate = list(pre_aggregate) if pre_aggregate else None
        self.coordinator = Coordinator() if coordinate else None
        self.materialize = materialize
        self.takeover = takeover
        self.daemon_retries = daemon_retries
        self._owner: OwnerRecord | None = None  # this operator's last claim (the next batches only look for a newer one)
        self._io = DriverIO(self._objstore)
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

    def _task_spec(self, batch_id: int, base: Manifest, values: tuple[str, ...], spark: SparkSession,
                   **batch: Any) -> TaskSpec:
        """What every task of a batch (or of the initial state's load) gets: the operator's settings,
        the state each partition starts from (``base``), and this batch's own fields."""
        return TaskSpec(root=self.root, operator_id=self.operator_id, key_columns=self.key_columns,
                        value_columns=values, output_schema=self.arrow_schema, num_partitions=self.num_partitions,
                        num_key_groups=self.num_key_groups, batch_id=batch_id,
                        refs=tuple(base.ref(p) for p in range(self.num_partitions)),
                        now_ms=int(self.clock() * 1000), socket_path=self.socket_path,
                        daemon_env=self._task_daemon_env(spark), daemon_retries=self.daemon_retries,
                        time_mode=self.time.mode, **batch)

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
                with timed(prog, "manifest"):
                    written = self._commit(plan, refs, merge_declarations(plan.spec.declared,
                                                                          (r.states for r in reports)), event_time)
                hook_point(hooks.installed(self), "after_manifest", batch_id, socket_path=self.socket_path)
                if output is not None and sink is not None:
                    with timed(prog, "sink"):
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
        hook_point(hooks.installed(self), "after_sink", batch_id, socket_path=self.socket_path)
        self._last_done = (batch_id, written)
        self._hold_daemon(spark)
        self._arm_idle(df, plan, sink)
        return prog

    def _trigger(self, query_id: str | None) -> str | None:
        """The trigger of streaming query ``query_id`` (``batches.query_trigger``), asked once per query."""
        if self._trigger_of[0] != query_id or query_id is None:
            self._trigger_of = (query_id, query_trigger(query_id))
        return self._trigger_of[1]

    # time-only batches, from an ending trigger or the idle ticker (``timeonly``)
    _arm_idle = timeonly.arm_idle
    _wants_time_only = timeonly.wants_time_only
    _time_only_batch = timeonly.time_only_batch
    _plan_time_only = timeonly.plan_time_only
    _rewrite = timeonly.rewrite
    _finish_pending = timeonly.finish_pending
    _idle_tick = timeonly.idle_tick
    _idle_due = timeonly.idle_due

    # -- time-only batches (``batches``) --
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
            event_times = df.sparkSession.sparkContext.accumulator([], reports_param())
        elif self.time.event:  # observed and filtered in the JVM, before its pre-aggregation
            df, observation = observe_event_time(df, self.time, watermark)
        routed, values = self.routed(df, in_tasks)
        spec = self._task_spec(batch_id, base, values, df.sparkSession, hook=hooks.installed(self),
                               releases=self.coordinator.releases() if self.coordinator is not None else None,
                               keys_unique=bool(self.pre_aggregate), declared=base.metadata.get("states"),
                               watermark_ms=watermark, rescaled=rescaled, key_schema=key_schema(df, self.key_columns),
                               event_time_column=in_tasks, drop_late=self.time.late_rows == "drop")
        types = {f.name: f.dataType.simpleString() for f in df.schema.fields if f.name in self.key_columns}
        return BatchPlan(batch_id=batch_id, base=base, routed=routed, spec=spec, query_id=query_id, owner=owner,
                         key_types=types if len(types) == len(self.key_columns) else None,
                         max_event_time_ms=seen, observation=observation, event_times=event_times, initial=initial)

    # the state a batch starts from: the query's claim, a rescale, an initial state (``startstate``)
    _rescale = startstate.rescale
    _load_initial_state = startstate.load_initial_state
    _claim = startstate.claim
    owner = startstate.owner

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
                hook_point(hooks.installed(self), "time_only_before_fence" if plan.time_only else "before_fence",
                            plan.batch_id, socket_path=self.socket_path)
                with timed(prog, "fence"):
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
        with timed(prog, "sink"):
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
        hook_point(hooks.installed(self), "before_fence", plan.batch_id, socket_path=self.socket_path)
        with timed(prog, "fence"):
            self._fence(refs, assembled=plan.base if plan.spec.rescaled else None, locations=prog.locations)
        return reports, refs

    def _run_tasks(self, plan: BatchPlan, spark: SparkSession) -> tuple[DataFrame, Accumulator, Accumulator]:
        """Step 2: the stateful stage, lazily: one ``mapInArrow`` task per state partition
        (``task.partition.run_partition``), the accumulator that collects the ``TaskReport`` of every task
        that committed, and the one where each task adds its partition once it has handed over its
        last output row. Nothing runs until the output is materialized."""
        acc = spark.sparkContext.accumulator([], reports_param())
        finished = spark.sparkContext.accumulator([], reports_param())
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

    # the reports, the fence, the manifest and the batch's record (``commit``)
    _collect_reports = commit.collect_reports
    _fence = commit.fence
    _event_time = commit.event_time
    _commit = commit.commit
    _observe = commit.observe
    _record = commit.record

    def with_heartbeat(self, events: DataFrame, rows_per_batch: int = 1) -> DataFrame:
        """``events`` (the query's streaming DataFrame) with a heartbeat source, so that Spark calls
        ``foreachBatch`` at every trigger even when no event arrives, and timers fire in idle
        streams; the heartbeat's rows are dropped by the operator before anything else. Give the
        query a trigger interval. See ``eventtime.with_heartbeat``."""
        return with_heartbeat(events, rows_per_batch)

    def __getstate__(self) -> NoReturn:
        raise InterfaceError("StatefulOperator lives on the driver; tasks get a TaskSpec")


__all__ = ["BatchProgress", "DuplicateReportError", "FenceTimeoutError", "OperatorConfigError", "OutputReadError",
           "StatefulOperator"]
