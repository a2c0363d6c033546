"""Which manifest a Spark micro-batch starts from, and when a time-only batch follows it.

A manifest version is one step of the operator's state: a data batch (one ``foreachBatch`` call's
rows) or a **time-only batch** — no rows, only the timers and TTLs that came due — which the
operator runs itself where Spark's own stateful operators would run a no-data batch (after the
last data batch of an ``AvailableNow`` or ``Once`` run; ``time_only_wanted``). Each step writes
the next version: with no time-only batch, Spark batch ``b`` reads version ``b`` and writes
``b + 1`` (as every manifest written before time-only batches existed); each time-only batch
shifts the later ones by one.

Every manifest records the Spark batch that wrote it (``batch_id``) and a random ``pass_id``; a
time-only manifest also records ``time_only`` and the ``pass_id`` of the manifest it read
(``follows``). Spark batch ``b`` starts from the newest version written by a batch before ``b``
(``find_base``): a replay of ``b`` (Spark runs a batch again when the driver died before recording
it) thus ignores, and then rewrites, whatever the first attempt of ``b`` wrote; a time-only manifest
whose ``follows`` no longer matches the manifest below it (that attempt's data step was rewritten
by a replay that ran no time-only step) is ignored too.

The batch id a sink gets (``sink(df, batch_id)``) is the version the step read: Spark's batch id
until a time-only batch has run, unique and stable across replays after.

An idle processing-time query (``ProcessingTime`` trigger, no new data) gets no ``foreachBatch``
call at all: an ``IdleTicker`` thread on the driver runs a time-only batch between Spark's batches,
once Spark has recorded the last one, after one and a half trigger intervals without a batch (``idle_period``):
once when the watermark moved, and every second period with processing-time timers or TTLs. Its
manifest says its sink is pending (``SINK_KEY``, with the clock and watermark it used) until the
sink returned; a driver that died in between runs it again before its next batch.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from statestore_async.files.manifest import Manifest, list_manifest_versions, read_manifest

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from statestore_async.files.manifest import OwnerRecord
    from statestore_async.objectstore import ObjectStore

log = logging.getLogger(__name__)
BATCH_KEY = "batch_id"
PASS_KEY = "pass_id"
TIME_ONLY_KEY = "time_only"
FOLLOWS_KEY = "follows"
SINK_KEY = "sink"         # an idle time-only batch's sink: SINK_PENDING until it returned, then SINK_DONE
SINK_PENDING = "pending"
SINK_DONE = "done"
NOW_KEY = "now_ms"        # the clock an idle time-only batch used (a rerun uses it again)
#: the shortest wait between an idle query's last step and its time-only batch (seconds): event time
IDLE_EVENT_PERIOD = 1.0
#: ... and between two time-only batches for processing-time timers and TTLs (seconds)
IDLE_PROCESSING_PERIOD = 10.0
#: the settings of ``StatefulOperator(time_only_batches=...)``
TIME_ONLY_SETTINGS = ("auto", "off")
#: the triggers after whose data batches the operator runs time-only batches (``time_only_wanted``):
#: a run that ends when the data does, after which Spark's own stateful operators run a no-data batch
ENDING_TRIGGERS = ("AvailableNowTrigger", "OneTimeTrigger")
NO_DATA_BATCHES_CONF = "spark.sql.streaming.noDataMicroBatches.enabled"


def written_by(m: Manifest) -> int:
    """The Spark batch that wrote ``m`` (manifests without the field: ``version - 1``)."""
    return int(m.metadata.get(BATCH_KEY, m.version - 1))


async def find_base(store: ObjectStore, operator_id: str, batch_id: int) -> Manifest | None:
    """The manifest Spark batch ``batch_id`` starts from: the newest written by an earlier batch
    (a LIST and a GET or two: a driver's first batch; later batches know it), skipping a time-only
    manifest that does not follow the manifest below it. None when there is none."""
    versions = await list_manifest_versions(store, operator_id)
    present = set(versions)
    read: dict[int, Manifest] = {}

    async def get(v: int) -> Manifest:
        if v not in read:
            read[v] = await read_manifest(store, operator_id, v)
        return read[v]

    for v in reversed(versions):
        m = await get(v)
        if written_by(m) >= batch_id:
            continue
        if m.metadata.get(TIME_ONLY_KEY):
            below = await get(v - 1) if v - 1 in present else None
            if below is None or below.metadata.get(PASS_KEY) != m.metadata.get(FOLLOWS_KEY):
                log.info("operator %s: manifest %d (a time-only batch of batch %d) follows a step since rewritten; "
                         "batch %d starts below it", operator_id, v, written_by(m), batch_id)
                continue
        return m
    return None


def _running_query(query_id: str | None) -> Any:
    """The JVM's ``StreamingQuery`` of the running query ``query_id``, or None (outside a query,
    the query stopped, or a driver without a JVM: Spark Connect). The session a batch's DataFrame
    carries is a clone that does not know the query; the driver's active session does."""
    if query_id is None:
        return None
    from pyspark.sql import SparkSession

    for session in (SparkSession.getActiveSession(), getattr(SparkSession, "_instantiatedSession", None)):
        jss = getattr(session, "_jsparkSession", None)
        q = jss.streams().get(query_id) if jss is not None else None
        if q is not None:
            return q
    return None


def query_trigger(query_id: str | None) -> str | None:
    """The trigger of the running streaming query ``query_id`` as Spark names it
    (``AvailableNowTrigger``, ``OneTimeTrigger``, ``ProcessingTimeTrigger(1000)``...), from the
    driver's JVM; None outside a query, or where the driver has no JVM (Spark Connect)."""
    try:
        q = _running_query(query_id)
        return None if q is None else str(q.streamingQuery().trigger().toString())
    except Exception as exc:  # a JVM without the query: no trigger known, no time-only batch
        log.debug("the trigger of query %s is not known: %s", query_id, exc)
    return None


def time_only_wanted(setting: str, trigger: str | None, conf: Any) -> bool:
    """Whether time-only batches follow this query's data batches: ``setting`` ``"auto"``, the
    trigger one that ends the run when the data does (``ENDING_TRIGGERS``), and Spark's no-data
    batches not turned off (``NO_DATA_BATCHES_CONF``, read from ``conf``, a session's ``conf``)."""
    if setting != "auto" or trigger is None or trigger.split("(")[0] not in ENDING_TRIGGERS:
        return False
    try:
        enabled = conf.get(NO_DATA_BATCHES_CONF, "true")
    except Exception:  # a conf that cannot be read: Spark's default
        enabled = "true"
    return str(enabled).lower() != "false"


def recorded_by_spark(query_id: str | None, batch_id: int) -> bool:
    """Whether the running query ``query_id`` has recorded batch ``batch_id`` (its last progress is
    that batch or a later one): an idle time-only batch runs only after it, so that Spark never
    replays a batch under it."""
    try:
        q = _running_query(query_id)
        last = q.lastProgress() if q is not None else None
        return last is not None and int(last.batchId()) >= batch_id
    except Exception as exc:  # a JVM that cannot tell: not recorded as far as we know
        log.debug("query %s: whether batch %d is recorded is not known: %s", query_id, batch_id, exc)
    return False


def idle_period(trigger: str | None, *, event_time: bool) -> float | None:
    """How long a ``ProcessingTime`` query may go without a batch before its idle time-only batch
    (seconds: the trigger interval, at least ``IDLE_EVENT_PERIOD`` for event time and
    ``IDLE_PROCESSING_PERIOD`` for processing-time timers and TTLs); None for other triggers."""
    if trigger is None or not trigger.startswith("ProcessingTimeTrigger("):
        return None
    try:
        interval = int(trigger[len("ProcessingTimeTrigger("):].rstrip(")")) / 1000
    except ValueError:
        return None
    return max(interval, IDLE_EVENT_PERIOD if event_time else IDLE_PROCESSING_PERIOD)


@dataclass(frozen=True)
class TimeOnlyAfter:
    """What a time-only batch takes from the Spark batch it follows."""

    batch_id: int
    query_id: str | None
    owner: OwnerRecord | None
    key_types: dict[str, str] | None

    @classmethod
    def of(cls, plan: Any) -> TimeOnlyAfter:
        """From a data batch's ``BatchPlan``."""
        return cls(plan.batch_id, plan.query_id, plan.owner, plan.key_types)


@dataclass(frozen=True)
class IdleContext:
    """What the ``IdleTicker``'s time-only batch needs: the last batch's DataFrame (its columns and
    session; it is not read), the batch it follows and the query's sink."""

    df: DataFrame
    after: TimeOnlyAfter
    sink: Callable[[DataFrame, int], object] | None


class IdleTicker(threading.Thread):
    """A daemon thread that calls ``tick()`` every ``period`` seconds until it returns False or
    ``stop()`` is called (``StatefulOperator._idle_tick``)."""

    def __init__(self, tick: Callable[[], bool], period: float, name: str) -> None:
        super().__init__(name=name, daemon=True)
        self._tick = tick
        self.period = period
        self._stopped = threading.Event()

    def run(self) -> None:
        while not self._stopped.wait(self.period):
            if not self._tick():
                return

    def stop(self) -> None:
        self._stopped.set()
