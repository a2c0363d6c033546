"""A task's run of one state partition: open the store at the manifest's state, run the processor
(per key: ``perkey``; vectorized: ``vectorized``), commit, and retry the partition when the daemon
is lost; the ``TaskReport`` the driver collects.

No round trip per key: the partition's rows are grouped by key with numpy/pyarrow (``grouping``),
every key's state is fetched in one batched call (``get_many``; never a call per key), the
processor runs, then ONE ``put_many`` and ONE ``remove_many``, and the commit.

Also the low-level API ``open_partition_store`` for mapPartitions / mapInArrow / pandas UDF users.
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import pyarrow as pa

from statestore_async.client.clients import StaleHandleError
from statestore_async.errors import (
    ConnectionLostError,
    InterfaceError,
    RetriesExhaustedError,
    ShuttingDownError,
    StateStoreError,
)
from statestore_async.ids import CheckpointRef, StoreId
from statestore_async.spark.api.processors import (
    StatefulProcessor,
    StateHandle,
    VectorizedProcessor,
    uses_initial_state,
    uses_timers,
    uses_vectorized_timers,
)
from statestore_async.spark.shared import placement
from statestore_async.spark.shared.coordinator import location_of
from statestore_async.spark.shared.eventtime import split_late
from statestore_async.spark.shared.hooks import hook_point
from statestore_async.spark.shared.routing import KG_COLUMN
from statestore_async.spark.shared.taskspec import TaskReport, TaskSpec
from statestore_async.spark.task.grouping import check_routing, group_rows
from statestore_async.spark.task.output import table_of
from statestore_async.spark.task.perkey import gc_paused, run_per_key
from statestore_async.spark.task.storecalls import Puts, Removes, write_all
from statestore_async.spark.task.vectorized import run_vectorized
from statestore_async.state.keys import TIME_MODES
from statestore_async.state.roots import checkpoint_root

if TYPE_CHECKING:
    from statestore_async.client.clients import Client, StoreHandle


log = logging.getLogger(__name__)


T = TypeVar("T")


# what a task's call to its daemon raises when the daemon is gone (killed, restarting, stopping), not
# because of the request: the task retries its partition (``spec.daemon_retries`` times)
DAEMON_LOST = (ConnectionLostError, StaleHandleError, ShuttingDownError)


RETRY_PAUSES = (0.1, 0.5, 1.0)  # seconds before the 1st, 2nd, and every later retry


def run_partition(processor: StatefulProcessor | VectorizedProcessor, spec: TaskSpec, partition: int, attempt: int,
                  batches: list[pa.RecordBatch], report: Callable[[TaskReport], object] | None = None,
                  event_time: Callable[[int | None, int], object] | None = None) -> pa.Table:
    """Apply ``processor`` to one state partition's rows of a batch; returns the output table.

    With ``spec.event_time_column`` the rows' max event time and late rows are counted first and
    given to ``event_time(max_ms, late)`` (a partition with rows, before anything else), and the
    late rows are dropped (``spec.drop_late``): the processor never sees them.

    Opens the store at ``spec.refs[partition]``, commits, calls ``report(TaskReport(...))`` after
    the commit (``timings``: seconds spent grouping, in the store, in the processor; ``node``: where
    it ran, for the coordinator, see ``_coordinate``). A partition without rows opens nothing and
    reports nothing, unless its processor has time work (timers or TTLs, ``has_time_work``): then
    it opens the store, fires its due timers and removes its expired values, and commits and reports
    only when that changed something. A daemon lost on the way (``DAEMON_LOST``) makes the task try
    again (``_commit_partition``); only the commit it reports counts.
    """
    return _run(processor, spec, partition, attempt, batches, report, initial=False, event_time=event_time)


def run_initial_state(processor: StatefulProcessor, spec: TaskSpec, partition: int, attempt: int,
                      batches: list[pa.RecordBatch], report: Callable[[TaskReport], object] | None = None) -> pa.Table:
    """Apply ``processor.handle_initial_state`` to one state partition's rows of the operator's
    ``initial_state`` (routed as a batch's rows: key columns, ``spec.value_columns``, the key group
    column); returns its output table.

    Like ``run_partition`` (same grouping, one read, one write, one commit on top of
    ``spec.refs[partition]``, reported the same way, the same retries when the daemon is lost), but
    each key's rows go to ``handle_initial_state``; timers it registers and TTL'd values it writes
    are stored as in a batch, and nothing fires nor expires (the first batch does that). A
    partition without initial rows opens nothing and reports nothing. The driver runs it once, before
    the first batch, and that batch reads the refs it reports (see ``docs/SPARK.md``)."""
    if isinstance(processor, VectorizedProcessor) or not uses_initial_state(processor):
        raise InterfaceError(
            f"{type(processor).__name__} has no handle_initial_state(self, key, rows, state): define it on a "
            "StatefulProcessor to use initial_state= (VectorizedProcessors take no initial state)")
    return _run(processor, spec, partition, attempt, batches, report, initial=True)


def _run(processor: StatefulProcessor | VectorizedProcessor, spec: TaskSpec, partition: int, attempt: int,
         batches: list[pa.RecordBatch], report: Callable[[TaskReport], object] | None, initial: bool,
         event_time: Callable[[int | None, int], object] | None = None) -> pa.Table:
    t0 = time.perf_counter()
    if spec.time_mode not in TIME_MODES:
        raise InterfaceError(f"time_mode is one of {TIME_MODES}, got {spec.time_mode!r}")
    table = table_of([b for b in batches if b.num_rows])
    if table is not None and spec.event_time_column is not None and not initial:
        table, top, late = split_late(table, spec.event_time_column, spec.watermark_ms, spec.drop_late)
        if event_time is not None:
            event_time(top, late)
        if not table.num_rows:
            table = None
    idle = table is None
    if table is None:
        if spec.rescaled is not None and not initial and not has_time_work(processor):
            _assemble_only(spec, partition, timings={})
            return spec.output_schema.empty_table()
        if initial or not has_time_work(processor):
            return spec.output_schema.empty_table()
        table = pa.table({KG_COLUMN: pa.array([], pa.int32())})
    kg = table[KG_COLUMN].to_numpy()
    check_routing(kg, partition, spec)
    if idle:
        keys_table = rows_table = pa.table({})
    else:
        keys_table, rows_table = table.select(list(spec.key_columns)), table.select(list(spec.value_columns))
    if spec.keys_unique or idle:
        offsets, kgs = np.arange(table.num_rows + 1, dtype=np.int64), kg
    else:
        order, offsets = group_rows(table, list(spec.key_columns))
        firsts = order[offsets[:-1]]
        kgs = kg[firsts]
        keys_table, rows_table = keys_table.take(pa.array(firsts)), rows_table.take(pa.array(order))
    timings = {"rows": table.num_rows, "keys": len(kgs), "group": time.perf_counter() - t0}

    def apply(client: Client, retry: int) -> tuple[pa.Table, CheckpointRef | None, dict[str, dict[str, Any]]]:
        base = spec.refs[partition]
        puts: Puts
        removes: Removes
        with client.open(StoreId(spec.root, spec.operator_id, partition), base.version, base.ckptid or None) as handle:
            writes: list[tuple[Puts, Removes]]
            if isinstance(processor, VectorizedProcessor):
                out, writes, states = run_vectorized(processor, spec, keys_table, rows_table, offsets, kgs,
                                                      handle, timings, partition)
                if idle and not any(len(p[0]) or (r is not None and len(r)) for p, r in writes) and not out.num_rows:
                    handle.abort()  # nothing was due: the manifest keeps the partition's state
                    return out, None, states
            else:
                with gc_paused():  # back on once the task's per-key objects are gone (freed as it returns)
                    out, puts, removes, states = run_per_key(processor, spec, keys_table, rows_table, offsets, kgs,
                                                              handle, timings, partition, initial)
                if idle and not len(puts[0]) and (removes is None or not len(removes)):
                    handle.abort()  # nothing was due: the manifest keeps the partition's state
                    return out, None, states
                writes = [(puts, removes)]
            t = time.perf_counter()
            timings["puts"] = timings["removes"] = 0
            for puts, removes in writes:  # in order: a later change of a key wins
                write_all(handle, puts, removes)
                timings["puts"] += len(puts[0]) if isinstance(puts, tuple) else len(puts)
                timings["removes"] += len(removes) if removes is not None else 0
            hook_point(spec.hook, "before_commit", spec.batch_id, partition, attempt, spec.socket_path, retry)
            ref = handle.commit()
            timings["write"] = time.perf_counter() - t
        return out, ref, states

    client, (out, ref, states) = _commit_partition(spec, partition, apply, timings)
    _drop_old_layout(client, spec, partition)
    if ref is None:
        return out
    node = _coordinate(client, spec, partition)
    timings["total"] = time.perf_counter() - t0
    if report is not None:
        report(TaskReport(partition=partition, ref=ref, attempt=attempt, timings=timings, node=node, states=states))
    hook_point(spec.hook, "after_commit", spec.batch_id, partition, attempt, spec.socket_path)
    return out


def _commit_partition(spec: TaskSpec, partition: int, apply: Callable[[Client, int], T],
                      timings: dict[str, float]) -> tuple[Client, T]:
    """``apply(client, retry)`` — open the partition's store at the manifest's state, process, write,
    commit — with the client of this node's daemon (``placement.connect``: it reconnects, and starts
    a daemon when none answers). When the daemon is lost on the way (``DAEMON_LOST``: killed,
    restarted, stopping), the open version died with the connection, so the task tries again from
    the start, up to ``spec.daemon_retries`` more times: the state is reopened at the manifest's
    state (the new daemon loads it from the files the manifest names), the rows are processed
    again, and the commit gets a fresh checkpoint id (a commit whose answer was lost is in no
    report, so in no manifest). ``RetriesExhaustedError`` (a ``ConnectionLostError``) when every
    try lost it; ``timings["retries"]``: the tries after the first."""
    tries = spec.daemon_retries + 1
    for retry in range(tries):
        try:
            client = placement.connect(spec.socket_path, env=spec.daemon_env)
            return client, apply(client, retry)
        except DAEMON_LOST as exc:
            where = placement.socket_path_for(spec.socket_path)
            if retry + 1 >= tries:
                raise RetriesExhaustedError(
                    f"partition {partition} of operator {spec.operator_id!r}, batch {spec.batch_id}: the daemon at "
                    f"{where} was lost on each of {tries} tries (the last: {type(exc).__name__}: {exc}); the task "
                    "fails") from exc
            timings["retries"] = retry + 1
            log.warning("partition %d of operator %s, batch %d: lost the daemon at %s (%s: %s); trying again (%d of %d)",
                        partition, spec.operator_id, spec.batch_id, where, type(exc).__name__, exc, retry + 1,
                        tries - 1)
            time.sleep(RETRY_PAUSES[min(retry, len(RETRY_PAUSES) - 1)])
    raise AssertionError("unreachable: the last try returns or raises")


def _assemble_only(spec: TaskSpec, partition: int, timings: dict[str, float]) -> None:
    """The first batch after a rescale, a partition without rows nor time work: open its state (the
    daemon assembles it from the old partitions' files and writes its snapshot, so that the manifest
    may name it) and leave it unchanged."""

    def open_only(client: Client, retry: int) -> None:
        base = spec.refs[partition]
        with client.open(StoreId(spec.root, spec.operator_id, partition), base.version, base.ckptid or None) as handle:
            handle.abort()

    client, _ = _commit_partition(spec, partition, open_only, timings)
    _drop_old_layout(client, spec, partition)


def _drop_old_layout(client: Client, spec: TaskSpec, partition: int) -> None:
    """After a rescale: ask this node's daemon to drop the copies it holds of the old layout's
    partitions (older than the assembled states; its copies of new states stay). Best effort."""
    if spec.rescaled is None:
        return
    old_n, version = spec.rescaled
    stale = [(p, version + 1) for p in range(max(old_n, spec.num_partitions)) if p != partition]
    try:
        client.release(spec.root, spec.operator_id, stale)
    except StateStoreError as exc:
        log.warning("could not ask the daemon to drop the old layout's partitions %s: %s", stale, exc)


def _coordinate(client: Client, spec: TaskSpec, partition: int) -> dict[str, Any] | None:
    """Where this task ran, and (the coordinator being on) its daemon's answer to RELEASE of the
    partitions the driver says another location owns now. Best effort: never fails the task."""
    if spec.releases is None:
        return None
    loc = location_of(placement.socket_path_for(spec.socket_path))
    node: dict[str, Any] = {"location": loc}
    # a copy at or below the state this batch starts from: one this batch committed (its partition
    # back on this node, run by another task) is newer, and stays
    stale = [(p, spec.refs[p].version + 1) for p in spec.releases.get(loc, ())
             if p != partition and p < len(spec.refs)]
    try:
        node.update(client.release(spec.root, spec.operator_id, stale))
    except StateStoreError as exc:
        log.warning("could not ask the daemon at %s to release partitions %s: %s", loc, stale, exc)
    return node


def has_time_work(processor: StatefulProcessor | VectorizedProcessor) -> bool:
    """Whether a task must run even without rows: the processor defines ``handle_expired_timer`` or
    declares a state variable with a TTL (its ``init`` runs on a scratch handle to tell)."""
    if isinstance(processor, VectorizedProcessor):
        return uses_vectorized_timers(processor)
    if uses_timers(processor):
        return True
    h = StateHandle()
    processor.init(h)
    return any(v.ttl_ms is not None for v in h.variables.values())


@contextlib.contextmanager
def open_partition_store(root: str, operator_id: str, partition_id: int, version: int, ckptid: str | None = None,
                         *, socket_path: str | None = None, store_name: str = "default",
                         result: list[CheckpointRef] | None = None) -> Iterator[StoreHandle]:
    """A store handle of one partition at ``version``: committed on success, aborted on an exception.

    For mapPartitions / mapInArrow / pandas UDF code that manages its own keys (see
    ``statestore_async.codecs.keylayout`` for the 2-byte key-group prefix). The committed ``CheckpointRef`` is
    appended to ``result`` when given; report it to the driver, which must check the file exists
    before it records the version (``StatefulOperator`` does all of this for you).
    """
    root = checkpoint_root(root)
    client = placement.connect(socket_path)
    handle = client.open(StoreId(root, operator_id, partition_id, store_name), version, ckptid)
    try:
        yield handle
    except BaseException:
        handle.abort()
        raise
    ref = handle.commit()
    if result is not None:
        result.append(ref)


__all__ = ["has_time_work", "open_partition_store", "run_initial_state", "run_partition"]
