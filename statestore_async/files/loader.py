"""Rebuild a committed state of a store from its checkpoint files
(docs/ARCHITECTURE.md, "Loading and retention").

``load_store`` reads the snapshot of (version, ckptid) if there is one; otherwise the delta of that
state, whose header lists its lineage back to a base (a snapshot, or the empty version 0); it then
reads the base snapshot and replays the lineage's deltas in order. It reads only the files the
lineage names — GETs, never a LIST — decoding blocks as they stream in. The deltas between a
lineage's head and its base are fetched while the replay runs, ``REPLAY_AHEAD`` at a time ahead of
it: a load holds the base, the table being built and a few deltas, however long the chain.

A snapshot is a shortcut, the deltas are the truth: when the snapshot a load would start from is
missing or damaged (truncated, corrupt: ``CorruptFileError``), the loader walks on through that
state's own delta, whose lineage leads to an older snapshot or to version 0, and so on. Each such
fallback is logged with the file (warning) and listed in ``LoadReport.damaged`` / ``missing_bases``.
A damaged or missing delta has no substitute: the load fails naming the file.

With ``cold`` (the daemon passes it), the base snapshot is not read at all when ``cold(ref)`` opens
a cold level over a local copy of it (``files.coldrun.ColdRun``): the store starts spilled onto
that file — a restart on the same node serves at once, reading blocks as keys are asked for. With
``cold_delta`` too, the deltas after it are not read into memory either: each is opened as a run
over its local copy (a ``file://`` root's own file, the cache folder's copy of an ``s3://`` one; a
delta without one is downloaded once into the cache folder, then opened), and the store comes back
as a ``ColdStack`` of those runs over the snapshot run with nothing in its hot part — a load reads
headers and footers only. More than ``max_runs`` runs, or a delta that cannot be opened as a run,
and the deltas are read into the hot part as before. A local copy that fails its checks is logged
and the file is read from the object store as usual.

A state with no snapshot and no delta but a recipe (``files.rescale``: the first state of a partition
after the operator's partition count changed) is assembled from the recipe's key-group ranges of the
old partitions' states, and its snapshot written before the load returns.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from statestore_async.engine.levels import ColdLevel
from statestore_async.engine.store import DEFAULT_HISTORY, VersionedStore
from statestore_async.engine.table import Table, load_records
from statestore_async.errors import (
    CorruptFileError,
    LineageError,
    ObjectNotFoundError,
    StateStoreError,
    VersionNotFoundError,
)
from statestore_async.files.checkpoint import FileHeader, Record, block_bytes_for, encode_snapshot, read_checkpoint
from statestore_async.files.coldrun import ColdRun, ColdStack
from statestore_async.files.names import DELTA, SNAPSHOT, file_key
from statestore_async.files.rescale import Recipe, read_key_groups, read_recipe
from statestore_async.files.transfer import ReadStats, create_checkpoint_file, read_checkpoint_file
from statestore_async.ids import EMPTY_STATE, CheckpointRef, StoreId

if TYPE_CHECKING:
    from statestore_async.objectstore.base import ObjectStore

log = logging.getLogger(__name__)


@dataclass
class LoadReport:
    """What a load read: for logs, metrics and tests (e.g. 'no LIST on the hot path')."""

    ref: CheckpointRef
    snapshot: CheckpointRef | None = None
    deltas: list[CheckpointRef] = field(default_factory=list)
    files_read: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    # snapshots the load would have started from and fell back from: failing their checks, or
    # missing although a lineage names them as its base
    damaged: list[str] = field(default_factory=list)
    missing_bases: list[str] = field(default_factory=list)
    bytes_read: int = 0
    records: int = 0
    cold: str | None = None  # the local snapshot file the store was opened over, if any
    # a rescaled partition's first state (files.rescale): the old partitions and states read, and
    # the bytes of the snapshot written for it
    rescaled_from: list[tuple[int, CheckpointRef]] | None = None
    snapshot_written: int = 0
    # deltas opened as runs over local copies (not read into memory), and of them those downloaded
    # into the cache folder first
    delta_runs: list[str] = field(default_factory=list)
    downloaded: list[str] = field(default_factory=list)
    # a load into memory that replayed more deltas than ``snapshot_after`` writes the loaded
    # state's snapshot (``snapshot_written`` bytes); the error that kept it from being written
    # (the load itself succeeded)
    snapshot_error: str | None = None


async def read_file(objstore: ObjectStore, store_id: StoreId, ref: CheckpointRef, kind: str,
                    report: LoadReport) -> tuple[FileHeader, list[Record]]:
    stats = ReadStats(report.files_read, report.missing)
    try:
        return await read_checkpoint_file(objstore, store_id, ref, kind, stats)
    finally:
        report.bytes_read += stats.bytes_read


OpenCold = Callable[[CheckpointRef], "ColdLevel | None"]
# a run over the local copy of the delta of a state (None: no local copy, or it failed its checks)
OpenColdDelta = Callable[[CheckpointRef], "ColdRun | None"]
# (ref, its records, or a run over its local copy, or None: read when the replay reaches it)
Pending = list[tuple[CheckpointRef, "list[Record] | ColdRun | None"]]
# deltas read ahead of the replay (in flight or waiting to be replayed) at most
REPLAY_AHEAD = 4
ReadFile = Callable[["ObjectStore", StoreId, CheckpointRef, str, LoadReport],
                    Awaitable[tuple[FileHeader, list[Record]]]]


def key_group_reader(first_kg: int, last_kg: int) -> ReadFile:
    """A ``read_file`` that reads and returns only the records of key groups ``first_kg..last_kg``."""

    async def read(objstore: ObjectStore, store_id: StoreId, ref: CheckpointRef, kind: str,
                   report: LoadReport) -> tuple[FileHeader, list[Record]]:
        stats = ReadStats(report.files_read, report.missing)
        try:
            return await read_key_groups(objstore, store_id, ref, kind, first_kg, last_kg, stats)
        finally:
            report.bytes_read += stats.bytes_read

    return read


async def _delta(objstore: ObjectStore, store_id: StoreId, ref: CheckpointRef, report: LoadReport,
                 read: ReadFile, open_run: OpenColdDelta | None) -> tuple[FileHeader, list[Record] | ColdRun]:
    """The delta of ``ref``: a run over its local copy when ``open_run`` opens one (downloading it
    into the object store's cache folder first when it has one and no copy), else its records."""
    if open_run is not None:
        run = open_run(ref)
        if run is None and hasattr(objstore, "cached_keys"):  # a cache folder: one GET keeps a copy
            key = file_key(store_id, ref, DELTA)
            try:
                data = await objstore.get(key)
            except ObjectNotFoundError:
                report.missing.append(key)
                raise
            report.files_read.append(key)
            report.bytes_read += len(data)
            run = open_run(ref)
            if run is None:  # the cache could not keep it: read what was downloaded
                f = await asyncio.to_thread(read_checkpoint, data, key, expect=(store_id, ref, DELTA))
                return f.header, f.records
            report.downloaded.append(key)
        if run is not None:
            report.delta_runs.append(run.path)
            return run.header, run
    return await read(objstore, store_id, ref, DELTA, report)


async def _chain(
    objstore: ObjectStore, store_id: StoreId, ref: CheckpointRef, report: LoadReport, max_depth: int,
    cold: OpenCold | None = None, read: ReadFile = read_file, cold_delta: OpenColdDelta | None = None,
) -> tuple[CheckpointRef, list[Record] | ColdLevel, Pending]:
    """(base snapshot ref or EMPTY, its records or a cold level over it, [(delta ref, records or a
    run over its local copy)] oldest first)."""
    pending: Pending = []
    current = ref
    depth = 0
    while True:
        if current.is_empty_state:
            return EMPTY_STATE, [], list(reversed(pending))
        damaged: CorruptFileError | None = None
        if cold is not None:
            level = cold(current)
            if level is not None:
                return current, level, list(reversed(pending))
        try:
            header, records = await read(objstore, store_id, current, SNAPSHOT, report)
            return current, records, list(reversed(pending))
        except ObjectNotFoundError:
            if current != ref:  # a lineage names its base for its snapshot: that one should be there
                report.missing_bases.append(file_key(store_id, current, SNAPSHOT))
                log.warning("store %s: snapshot %s, the base of %s, is missing: loading that state from its delta",
                            store_id, file_key(store_id, current, SNAPSHOT), ref)
        except CorruptFileError as exc:
            damaged = exc
            report.damaged.append(exc.name)
            log.warning("store %s: snapshot %s is damaged (%s): loading %s from its delta and the states "
                        "before it instead", store_id, exc.name, exc.reason, current)
        try:
            header, delta = await _delta(objstore, store_id, current, report, read, cold_delta)
        except ObjectNotFoundError:
            delta_key = file_key(store_id, current, DELTA)
            if damaged is not None:  # nothing replaces the damaged snapshot: the damage is the error
                raise CorruptFileError(damaged.name, f"{damaged.reason}; and {delta_key} is missing, so {ref} "
                                       "cannot be loaded without it", damaged.offset) from damaged
            if current == ref:
                raise VersionNotFoundError(
                    f"store {store_id}: no snapshot or delta file for {ref} "
                    f"({', '.join(report.missing)})"
                ) from None
            raise LineageError(f"store {store_id}: lineage of {ref} needs {current}, which has no file "
                               f"(neither {file_key(store_id, current, SNAPSHOT)} nor {delta_key})") from None
        pending.append((current, delta))
        lineage = header.lineage
        if not lineage or lineage[0].version != current.version - 1:
            raise LineageError(f"store {store_id}: delta {file_key(store_id, current, DELTA)} has a broken "
                               f"lineage {lineage}")
        # the base is tried as a snapshot next; the deltas between are opened as runs here (no
        # memory), or read when the replay reaches them (``_replay``)
        base = lineage[-1]
        middle = list(lineage[:-1])
        if middle and cold_delta is None:
            pending.extend((r, None) for r in middle)
        elif middle:
            results = await asyncio.gather(
                *(_delta(objstore, store_id, r, report, read, cold_delta) for r in middle), return_exceptions=True
            )
            for i, (r, res) in enumerate(zip(middle, results)):
                if isinstance(res, ObjectNotFoundError):
                    raise LineageError(f"store {store_id}: lineage of {ref} needs delta {r}, which is missing "
                                       f"({file_key(store_id, r, DELTA)})") from None
                if isinstance(res, BaseException):
                    raise res
                h, recs = res
                if h.lineage[:1] != (lineage[i + 1],):
                    raise LineageError(f"store {store_id}: delta {file_key(store_id, r, DELTA)} builds on "
                                       f"{h.lineage[:1]}, its child says {lineage[i + 1]}")
                pending.append((r, recs))
        current = base
        depth += 1
        if depth > max_depth:
            raise LineageError(f"store {store_id}: lineage of {ref} is longer than {max_depth} hops")


def _check_versions(store_id: StoreId, ref: CheckpointRef, base: CheckpointRef, deltas: Pending) -> None:
    """Each delta of ``ref``'s load follows the one before (``LineageError`` naming the gap otherwise)."""
    expect_version = base.version
    for r, _records in deltas:
        expect_version += 1
        if r.version != expect_version:
            raise LineageError(f"store {store_id}: replay of {ref} expected version {expect_version}, got {r}")


async def _replay(objstore: ObjectStore, store_id: StoreId, ref: CheckpointRef, base: CheckpointRef,
                  deltas: Pending, report: LoadReport, read: ReadFile,
                  apply: Callable[[CheckpointRef, list[Record]], None]) -> None:
    """``apply`` each delta of ``ref``'s load after ``base``, oldest first. A delta opened as a run is
    read here (and closed); one not read yet is fetched ``REPLAY_AHEAD`` at most ahead of the
    replay, and checked to build on the delta before it."""
    _check_versions(store_id, ref, base, deltas)
    fetches: dict[int, asyncio.Task[tuple[FileHeader, list[Record]]]] = {}
    waiting = [i for i, (_r, records) in enumerate(deltas) if records is None]
    started = 0
    try:
        previous = base
        for i, (r, records) in enumerate(deltas):
            while started < len(waiting) and len(fetches) < REPLAY_AHEAD:
                j = waiting[started]
                fetches[j] = asyncio.ensure_future(read(objstore, store_id, deltas[j][0], DELTA, report))
                started += 1
            if records is None:
                try:
                    header, records = await fetches.pop(i)
                except ObjectNotFoundError:
                    raise LineageError(f"store {store_id}: lineage of {ref} needs delta {r}, which is missing "
                                       f"({file_key(store_id, r, DELTA)})") from None
                if header.lineage[:1] != (previous,):
                    raise LineageError(f"store {store_id}: delta {file_key(store_id, r, DELTA)} builds on "
                                       f"{header.lineage[:1]}, its child says {previous}")
            elif isinstance(records, ColdRun):
                run, records = records, records.all_entries()
                run.close()
            apply(r, records)
            previous = r
    finally:
        for task in fetches.values():
            task.cancel()
        if fetches:
            await asyncio.gather(*fetches.values(), return_exceptions=True)
        _close_runs(deltas)


def _close_runs(deltas: Pending) -> None:
    for _r, records in deltas:
        if isinstance(records, ColdRun):
            records.close()


async def load_store(
    objstore: ObjectStore,
    store_id: StoreId,
    ref: CheckpointRef,
    *,
    history: int = DEFAULT_HISTORY,
    max_depth: int = 10000,
    cold: OpenCold | None = None,
    cold_delta: OpenColdDelta | None = None,
    max_runs: int = 16,
    snapshot_after: int | None = None,
) -> tuple[VersionedStore, LoadReport]:
    """Rebuild ``ref`` of ``store_id`` from files alone. Returns the store and what was read.

    ``cold(snapshot ref)`` may open a cold level over a local copy of that snapshot (None: read it);
    ``cold_delta(delta ref)`` a run over a local copy of a delta, so that a store over a cold level
    comes back as a stack of at most ``max_runs`` runs (see the module doc). A load into memory
    (not over a local snapshot file) that replays more than ``snapshot_after`` deltas writes the
    loaded state's snapshot before it returns (``_snapshot_long_chain``)."""
    report = LoadReport(ref)
    if ref.is_empty_state:
        return VersionedStore(store_id, history=history), report
    try:
        base, base_records, deltas = await _chain(objstore, store_id, ref, report, max_depth, cold,
                                                  cold_delta=cold_delta if cold is not None else None)
    except VersionNotFoundError:
        recipe = await read_recipe(objstore, store_id, ref)  # the first state of a rescaled partition?
        if recipe is None:
            raise
        return await _assemble(objstore, store_id, ref, recipe, report, history, max_depth), report
    try:
        if not isinstance(base_records, list):
            return await _over_cold(objstore, store_id, ref, base, base_records, deltas, report, history,
                                    max_runs), report
    except BaseException:
        _close_runs(deltas)
        raise
    data = Table()
    load_records(data, base_records)  # a snapshot's records: no tombstones
    del base_records
    if base.version:
        report.snapshot = base

    def replay(r: CheckpointRef, records: list[Record]) -> None:
        load_records(data, records)  # a tombstone removes the key
        report.deltas.append(r)

    await _replay(objstore, store_id, ref, base, deltas, report, read_file, replay)
    report.records = len(data)
    # the loaded head's lineage: its own ancestors back to the base that was used
    lineage = tuple(reversed([base] + [r for r, _ in deltas[:-1]])) if deltas else ()
    store = VersionedStore(store_id, data, ref, lineage, head_has_snapshot=not deltas, history=history)
    if base.version:
        store.mark_snapshot(base)
    await _snapshot_long_chain(objstore, store, report, snapshot_after)
    log.debug("loaded %s %s: %s", store_id, ref, report)
    return store, report


async def _snapshot_long_chain(objstore: ObjectStore, store: VersionedStore, report: LoadReport,
                               snapshot_after: int | None) -> None:
    """Write the snapshot of the state just loaded when the load replayed more than
    ``snapshot_after`` deltas into memory: the next load of that state, or of one after it, reads
    one file instead of the chain. A daemon's own snapshots keep chains short; this is what keeps
    them short when they fall behind (a store evicted before its snapshot was written comes back
    with a longer chain each time, and each load costs more). A snapshot that cannot be written
    (the object store failing, a full disk) is logged; the load stands."""
    if snapshot_after is None or len(report.deltas) <= snapshot_after or store.has_snapshot(store.head):
        return
    ref = store.head
    try:
        with store.freeze() as view:
            data = await asyncio.to_thread(encode_snapshot, view, block_bytes=block_bytes_for(store.memory_bytes))
        report.snapshot_written = await create_checkpoint_file(objstore, store.store_id, ref, SNAPSHOT, data)
    except StateStoreError as exc:
        report.snapshot_error = f"{type(exc).__name__}: {exc}"
        log.warning("store %s: the snapshot of %s, loaded from %d deltas, was not written (the next load "
                    "replays them again): %s", store.store_id, ref, len(report.deltas), report.snapshot_error)
        return
    store.mark_snapshot(ref)
    log.info("store %s: loaded %s from %d deltas and wrote its snapshot (%d bytes)", store.store_id, ref,
             len(report.deltas), len(data))


async def _assemble(objstore: ObjectStore, store_id: StoreId, ref: CheckpointRef, recipe: Recipe,
                    report: LoadReport, history: int, max_depth: int) -> VersionedStore:
    """The first state of a rescaled partition (``files.rescale``): the recipe's key groups of each
    old partition's state, read by ranges (lineage followed as in a load), then ``ref``'s snapshot
    written, so that the state is durable and loads from its own file from then on."""
    data = Table()
    for src in recipe.sources:
        sid = StoreId(store_id.root, store_id.operator_id, src.partition, store_id.store_name)
        base, base_records, deltas = await _chain(objstore, sid, src.ref, report, max_depth,
                                                  read=key_group_reader(src.first_kg, src.last_kg))
        assert isinstance(base_records, list)  # no cold level was offered
        load_records(data, base_records)
        del base_records
        await _replay(objstore, sid, src.ref, base, deltas, report, key_group_reader(src.first_kg, src.last_kg),
                      lambda _r, records: load_records(data, records))
    report.records = len(data)
    report.rescaled_from = [(s.partition, s.ref) for s in recipe.sources]
    store = VersionedStore(store_id, data, ref, (), head_has_snapshot=True, history=history)
    with store.freeze() as view:
        snapshot = await asyncio.to_thread(encode_snapshot, view, block_bytes=block_bytes_for(store.memory_bytes))
    await create_checkpoint_file(objstore, store_id, ref, SNAPSHOT, snapshot)
    report.snapshot_written = len(snapshot)
    store.mark_snapshot(ref)
    log.info("assembled %s %s from %d key-group ranges of %d old partitions: %d records, %d bytes read, "
             "snapshot of %d bytes written", store_id, ref, len(recipe.sources), recipe.from_partitions,
             report.records, report.bytes_read, len(snapshot))
    return store


async def _over_cold(objstore: ObjectStore, store_id: StoreId, ref: CheckpointRef, base: CheckpointRef,
                     level: ColdLevel, deltas: Pending, report: LoadReport, history: int,
                     max_runs: int) -> VersionedStore:
    """The store at ``ref``: spilled onto ``level`` (the snapshot of ``base``), the deltas after it
    stacked over it as runs when all were opened as runs and they fit ``max_runs``, else in memory."""
    report.snapshot = base
    report.cold = getattr(level, "path", repr(level))
    lineage = tuple(reversed([base] + [r for r, _ in deltas[:-1]])) if deltas else ()
    runs = [records for _r, records in deltas if isinstance(records, ColdRun)]
    if deltas and len(runs) == len(deltas) and len(runs) + 1 <= max_runs and isinstance(level, ColdRun):
        _check_versions(store_id, ref, base, deltas)
        report.deltas = [r for r, _ in deltas]
        stack = ColdStack.over(list(reversed(runs)), level)  # newest first
        store = VersionedStore.over_cold(store_id, stack, Table(), ref, lineage, history=history, snapshot=base)
        store.mark_snapshot(base)
        report.records = len(level)  # an estimate: the deltas add and remove
        return store
    report.delta_runs = []
    changes = Table()

    def replay(r: CheckpointRef, records: list[Record]) -> None:
        for k, v in records:
            changes.put(k, v)  # the newest change of each key; a tombstone stays one
        report.deltas.append(r)

    await _replay(objstore, store_id, ref, base, deltas, report, read_file, replay)
    store = VersionedStore.over_cold(store_id, level, changes, ref, lineage, history=history)
    store.mark_snapshot(base)
    report.records = len(level) + len(changes)  # an estimate: the deltas' keys may be in the snapshot
    return store
