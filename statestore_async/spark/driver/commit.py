"""The end of a batch on the driver: its tasks' reports, the fence (every reported file is in the
object store), the batch's event time, the manifest, and what the operator records of the batch.
Functions of the operator (bound as its methods).
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING

from statestore_async.errors import (
    OwnerConflictError,
)
from statestore_async.files.manifest import (
    INITIAL_STATE_KEY,
    Manifest,
    read_owner,
    write_manifest,
)
from statestore_async.files.names import DELTA, SNAPSHOT, file_key
from statestore_async.files.rescale import RESCALED_FROM_KEY
from statestore_async.ids import DEFAULT_STORE_NAME, CheckpointRef, StoreId
from statestore_async.objectstore import ObjectStore
from statestore_async.spark.driver.batches import (
    BATCH_KEY,
    FOLLOWS_KEY,
    PASS_KEY,
    TIME_ONLY_KEY,
)
from statestore_async.spark.driver.driverio import FENCE_FAST_SECONDS, durable_answers
from statestore_async.spark.driver.errors import DuplicateReportError, FenceTimeoutError, OperatorConfigError
from statestore_async.spark.driver.plan import (
    LAYOUT,
    BatchPlan,
)
from statestore_async.spark.driver.progress import BatchProgress
from statestore_async.spark.shared.coordinator import local_socket
from statestore_async.spark.shared.eventtime import (
    MAX_EVENT_TIME_KEY,
    WATERMARK_KEY,
    observed_event_time,
    tasks_event_time,
)
from statestore_async.spark.shared.taskspec import TaskReport

if TYPE_CHECKING:

    from statestore_async.spark.driver.operator import StatefulOperator

log = logging.getLogger(__name__)


def collect_reports(op: StatefulOperator, reports: list[TaskReport], prog: BatchProgress) -> dict[int, CheckpointRef]:
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
        if not 0 <= p < op.num_partitions:
            raise OperatorConfigError(f"a task reported partition {p} outside [0, {op.num_partitions})")
        refs[p] = r.ref
    return refs


def fence(op: StatefulOperator, refs: dict[int, CheckpointRef], assembled: Manifest | None = None,
           locations: Mapping[int, str] | None = None) -> None:
    """Step 5: wait until every reported delta exists in the object store (HEAD, not the report),
    and after a rescale (``assembled``: the rescaled manifest the batch started from) every
    assembled state's snapshot, polling every <= 50 ms for ``FENCE_FAST_SECONDS`` then every <= 0.5 s;
    ``FenceTimeoutError`` after ``fence_timeout`` seconds (the batch is then not committed, and
    Spark replays it). A partition whose task ran on this host (``locations``: where each task
    ran, from the coordinator) also has its daemon asked to answer once its delta is durable
    (AWAIT_DURABLE, ``durable_answers``): each answer wakes the fence for a HEAD at once, instead
    of at its next poll. The HEADs decide, never the answers."""
    keys = {file_key(StoreId(op.root, op.operator_id, p), ref, DELTA) for p, ref in refs.items()}
    if assembled is not None:
        keys |= {file_key(StoreId(op.root, op.operator_id, p), assembled.ref(p), SNAPSHOT)
                 for p in range(op.num_partitions) if not assembled.ref(p).is_empty_state}
    if not keys:
        return
    timeout = op.fence_timeout
    asks: dict[str, list[tuple[StoreId, CheckpointRef]]] = {}
    for p, ref in refs.items():
        sock = local_socket((locations or {}).get(p))
        if sock is not None:
            asks.setdefault(sock, []).append((StoreId(op.root, op.operator_id, p), ref))

    async def fence(store: ObjectStore) -> None:
        pending = set(keys)
        started = time.monotonic()
        deadline = started + timeout
        pause = 0.01
        answers = [asyncio.ensure_future(durable_answers(sock, wanted, timeout)) for sock, wanted in asks.items()]
        try:
            while True:
                found = await asyncio.gather(*(store.exists(k) for k in sorted(pending)))
                pending -= {k for k, ok in zip(sorted(pending), found) if ok}
                if not pending:
                    return
                if time.monotonic() > deadline:
                    raise FenceTimeoutError(
                        f"{len(pending)} checkpoint file(s) of operator {op.operator_id!r} not in {op.root} "
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

    op._run(fence)


def event_time(op: StatefulOperator, plan: BatchPlan, prog: BatchProgress) -> dict[str, int | None]:
    """After the job ran: the batch's watermark, max event time and late rows into ``prog``, and
    the manifest metadata that lets batch ``batch_id + 1`` compute its watermark (and a replay of
    this batch read the same): the watermark this batch used and the max event time of the
    batches up to it. {} outside time_mode "event"."""
    if not op.time.event:
        return {}
    if plan.event_times is not None:
        top, late = tasks_event_time(plan.event_times.value)
    else:
        top, late = observed_event_time(plan.observation)
    prog.watermark_ms, prog.max_event_time_ms, prog.late_rows = plan.spec.watermark_ms, top, late
    before = plan.max_event_time_ms
    seen = before if top is None else top if before is None else max(top, before)
    return {WATERMARK_KEY: plan.spec.watermark_ms, MAX_EVENT_TIME_KEY: seen}


def commit(op: StatefulOperator, plan: BatchPlan, refs: dict[int, CheckpointRef], states: dict | None = None,
            event_time: dict[str, int | None] | None = None) -> Manifest:
    """Step 6, after the fence: check the batch's query still owns the state (``OwnerConflictError``
    otherwise: an owner record newer than ``plan.owner``), then write manifest ``plan.base.version + 1``
    (replacing one an earlier attempt of the batch wrote), and return it: each partition's reported
    checkpoint, else the one ``plan.base`` names; the Spark batch that wrote it and a new pass id
    (a time-only batch: marked, with the pass id of the manifest it follows; ``batches``);
    ``states``: the state variables' declarations (``api.processors.merge_declarations``), which the
    next batch's tasks check theirs against. From here on the batch's state counts (once Spark
    records the batch)."""
    stores = tuple(refs.get(p, plan.base.ref(p)) for p in range(op.num_partitions))
    metadata = {"layout": LAYOUT, "key_columns": list(op.key_columns),
                "processor": type(op.processor).__qualname__, BATCH_KEY: plan.batch_id,
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
    oid, root, known = op.operator_id, op.root, plan.owner
    if known is not None:  # who wrote it (the owner record's epoch)
        metadata["owner"], metadata["owner_epoch"] = known.owner, known.epoch
    manifest = Manifest(op.operator_id, plan.base.version + 1, op.num_partitions, op.num_key_groups,
                        {DEFAULT_STORE_NAME: stores}, metadata=metadata)

    async def write(store: ObjectStore) -> None:
        # one writer per state: an owner record newer than the batch's claim stops the batch here
        current = await read_owner(store, oid, known)
        if current is not None and (known is None or current.epoch != known.epoch):
            raise OwnerConflictError(
                f"operator {oid!r} at {root} was claimed by {current.owner!r} (epoch {current.epoch}) while batch "
                f"{plan.batch_id} of {plan.query_id or 'no streaming query'} ran: its manifest is not written")
        await write_manifest(store, manifest)

    op._run(write)
    return manifest


def observe(op: StatefulOperator, reports: list[TaskReport]) -> None:
    """After the sink: tell the coordinator (when on) where the batch's tasks ran. Only now: a
    batch that failed before its manifest taught the coordinator nothing."""
    if op.coordinator is not None:
        op.coordinator.observe([(r.partition, r.node) for r in reports if r.node is not None])


def record(op: StatefulOperator, prog: BatchProgress, refs: dict[int, CheckpointRef], t0: float, written: Manifest,
            last: bool = True) -> BatchProgress:
    """Complete ``prog`` (started at ``t0``, ``time.perf_counter``; it wrote ``written``), and
    for a data batch (``last``) keep it as ``last_progress`` and in ``history`` (a time-only
    batch is its data batch's ``time_only_after``); log it; returns it."""
    prog.partitions_committed = len(refs)
    prog.refs = refs
    prog.version = written.version
    prog.total = time.perf_counter() - t0
    if last:
        op.last_progress = prog
        op.history.append(prog)
    log.info("operator %s batch %d: %d partitions committed, compute %.3fs fence %.3fs",
             op.operator_id, prog.batch_id, len(refs), prog.compute, prog.fence)
    return prog
