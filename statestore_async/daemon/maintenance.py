"""Maintenance in the daemon, off the request path: snapshots and retention
(docs/ARCHITECTURE.md, "The daemon": ``Maintenance``).

When the uploader reports a delta durable, its store is checked: if the head's delta chain (the
deltas since its last snapshot) is ``snapshot_interval`` long or holds more than
``snapshot_delta_bytes``, a snapshot is made with ``put_if_absent``. By default (inline) the head
is written from a frozen view in bounded steps, giving way to requests between steps. With a
worker (``snapshotter.SnapshotWorker``, ``snapshot_builder = "process"``) a separate process
rebuilds the newest durable state from its files at a lower CPU priority and snapshots it, so the
daemon's event loop spends nothing on it. Only once the snapshot is in the object store does the
store learn of it (``mark_snapshot``), so later deltas' lineages stop there.
After a snapshot, once a quarter of the window has aged out since the last cleanup, retention
deletes files older than the window (the last ``retention_versions`` versions) that no state in the
window needs (``retention.cleanup_store`` with ``keep=None``), in a task of its own: snapshots are
encoded one at a time, cleanups run one at a time, and neither waits for the other.

Maintenance never blocks a commit; it is best effort: a failed snapshot is retried at the next
durable delta, a failed cleanup at the next snapshot.
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, cast

from statestore_async.engine.views import FrozenView
from statestore_async.errors import StateStoreError
from statestore_async.files.checkpoint import FileHeader, block_bytes_for, snapshot_steps
from statestore_async.files.names import DELTA, SNAPSHOT, file_key
from statestore_async.files.retention import cleanup_store
from statestore_async.files.transfer import create_checkpoint_file
from statestore_async.ids import CheckpointRef, StoreId
from statestore_async.objectstore.base import ObjectStore

if TYPE_CHECKING:
    from statestore_async.daemon.registry import StoreRegistry
    from statestore_async.daemon.snapshotter import SnapshotWorker

log = logging.getLogger(__name__)

# Snapshot work between two yields to the event loop: small enough that a request waiting behind
# it is delayed by a fraction of a millisecond (gathering and encoding a 64 KiB block ~0.3 ms;
# 256 KiB blocks took over a millisecond and showed in the commit latency tail).
STEP_BLOCK_BYTES = 64 << 10
_DONE = object()  # the end of snapshot_steps
CLEANED_KEPT = 1 << 16  # stores whose last cleanup is remembered after they leave memory


class _Pacer:
    """Between two snapshot steps: give way to requests, and to the clients they woke.

    Each call lets the event loop serve what is waiting (``sleep(0)``). It sleeps ``rest`` seconds
    for real instead when the daemon has served a request since the previous step (``served``, a
    count that grows with every request), or once the steps have kept the loop busy for ``busy``
    seconds. A client's request wakes the daemon on the client's own core (a Unix-socket write is
    a synchronous wake-up) and the daemon preempts it there; the client, runnable with its answer
    already written, then waits for that core until the daemon sleeps, even with the other core
    idle — measured: 1-3.5 ms of COMMIT latency when snapshot steps followed the answer. Requests
    arriving while the pacer rests are served at once, as the loop only waits on a timer.
    (``sched_yield`` between steps instead was measured worse: with no client waiting, it hands
    the core to any runnable task, a low-priority one included, for its whole slice. The daemon
    does yield right after answering a COMMIT, when the client is the task waiting.)
    """

    def __init__(self, busy: float = 0.001, rest: float = 0.001, served: Callable[[], int] | None = None) -> None:
        self.busy = busy
        self.rest = rest
        self._served = served
        self._seen = served() if served is not None else 0
        self._since = time.monotonic()

    async def __call__(self) -> None:
        if self._served is not None and self._served() != self._seen:
            await self._rest()
        elif time.monotonic() - self._since < self.busy:
            await asyncio.sleep(0)
        else:
            await self._rest()

    async def _rest(self) -> None:
        # counted before the sleep: a request answered as the rest ends (its timer due at once)
        # leaves its client waiting for this core just the same, so it earns the next rest
        if self._served is not None:
            self._seen = self._served()
        await asyncio.sleep(self.rest)
        self._since = time.monotonic()


@contextlib.contextmanager
def _no_cyclic_gc() -> Iterator[None]:
    """Pause Python's cyclic garbage collector during one synchronous step of a snapshot.

    A step sorts thousands of records into per-group lists: allocations that would trigger
    collections walking them in the middle of the step. Never held across an await: with the
    collector off across the snapshot's pauses, the requests served in between (a busy daemon
    snapshots nearly all the time) left their reference cycles — and any store they reached —
    uncollected, and the daemon's memory grew without bound.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class Maintenance:
    """Snapshots and retention for the stores of one daemon's registry."""

    def __init__(self, registry: StoreRegistry, objstores: Callable[[str], ObjectStore], *, snapshot_interval: int = 10,
                 snapshot_delta_bytes: int = 256 << 20, retention_versions: int = 100, concurrency: int = 1,
                 worker: SnapshotWorker | None = None, served: Callable[[], int] | None = None) -> None:
        self._registry = registry
        self._served = served  # a count of the requests the daemon has served, for the snapshot's pacer
        self._worker = worker  # a snapshotter.SnapshotWorker, or None to snapshot in this process
        self._objstores = objstores
        self.snapshot_interval = snapshot_interval
        self.snapshot_delta_bytes = snapshot_delta_bytes
        self.retention_versions = retention_versions
        self._chain_bytes: dict[StoreId, int] = {}
        self._headers: dict[StoreId, dict[str, FileHeader]] = {}  # per store: file key -> parsed header (files never change)
        # per store: min_version of its last cleanup, kept across evictions (the most recent
        # CLEANED_KEPT stores): a store reloaded all the time does not LIST its folder at each reload
        self._cleaned_below: OrderedDict[StoreId, int] = OrderedDict()
        self._busy: set[StoreId] = set()  # stores with a snapshot queued or in progress
        self._cleaning: set[StoreId] = set()  # stores with a cleanup queued or in progress
        self._cleanup_sem = asyncio.Semaphore(1)
        self._tasks: set[asyncio.Task[None]] = set()
        self._sem = asyncio.Semaphore(concurrency)
        self._closed = False
        self.counters = {"snapshots": 0, "snapshot_bytes": 0, "snapshot_errors": 0, "cleanups": 0,
                         "files_deleted": 0, "cleanup_errors": 0}
        self._spill_after: set[StoreId] = set()  # stores to spill once their snapshot is written
        listeners = getattr(registry, "evict_listeners", None)
        if listeners is not None:
            listeners.append(self.forget)
        if hasattr(registry, "request_spill"):
            registry.request_spill = self.request_spill

    def forget(self, store_id: StoreId) -> None:
        """Drop what is kept for ``store_id`` (its store left memory): a daemon that serves many
        stores over its life does not keep each one's retention headers forever. A reloaded store
        starts over: its delta chain is counted again, its next cleanup LISTs once more."""
        self._headers.pop(store_id, None)
        self._chain_bytes.pop(store_id, None)
        self._spill_after.discard(store_id)
        self._cleaned_below.pop(store_id, None)

    def request_spill(self, store_id: StoreId) -> None:
        """The registry wants ``store_id`` out of memory: snapshot its head now (whatever its delta
        chain), then let the registry spill it onto that file (``StoreRegistry.spill_at``)."""
        if self._closed:
            return
        self._spill_after.add(store_id)
        if store_id in self._busy:
            return  # a snapshot is on its way: it spills at its end
        store = self._registry.get(store_id)
        if store is None:
            return
        self._busy.add(store_id)
        task = asyncio.get_running_loop().create_task(self._snapshot(store_id, store.head))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def note_durable(self, store_id: StoreId, ref: CheckpointRef, nbytes: int,
                     lineage: Iterable[CheckpointRef] | None = None) -> None:
        """The uploader made the delta of ``ref`` durable (``nbytes`` bytes): snapshot if due.

        ``lineage`` (the delta's own) seeds retention's header cache: this daemon wrote that file,
        so retention need not GET its header back (each S3 request costs the loop ~1 ms)."""
        if self._closed:
            return
        store = self._registry.get(store_id)
        if store is None:
            return  # not in memory (dropped already): nothing is kept for it
        if lineage is not None:
            self._headers.setdefault(store_id, {})[file_key(store_id, ref, DELTA)] = FileHeader(
                DELTA, store_id.to_json(), ref, tuple(lineage), "zstd", time.time())
        self._chain_bytes[store_id] = self._chain_bytes.get(store_id, 0) + nbytes
        if store_id in self._busy:
            return
        if (store.deltas_since_snapshot() >= self.snapshot_interval
                or self._chain_bytes[store_id] >= self.snapshot_delta_bytes):
            self._busy.add(store_id)
            task = asyncio.get_running_loop().create_task(self._snapshot(store_id, ref))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _snapshot(self, store_id: StoreId, ref: CheckpointRef) -> None:
        # The store is looked up by id, never held across an await: the registry may evict it
        # meanwhile (a snapshot in progress must not keep an evicted store alive). Only the frozen
        # view holds it, while the records are encoded, and the registry evicts no store with a view.
        # ``_sem`` bounds the encoding (event-loop work, or the worker's); the file's upload and the
        # cleanup after it run outside it: waiting on IO, a snapshot never holds up the next one's
        # encoding, and no snapshot waits for a cleanup (a cleanup LISTs and deletes: with it inside,
        # a daemon reloading stores all the time queued 60-90 snapshots behind cleanups, its delta
        # chains grew, and so did what each load read and held).
        try:
            async with self._sem:
                store = self._registry.get(store_id)
                if store is None or self._closed:
                    return
                objstore = self._objstores(store_id.root)
                data: bytes | None = None
                if self._worker is not None:
                    # the worker reads files: snapshot the newest durable state (``ref``, whose
                    # ancestors are durable too), if it is still on the head's lineage
                    if ref != store.head and ref not in store.lineage:
                        return
                    if ref.version == 0 or store.has_snapshot(ref):
                        return
                    del store
                    size = await self._worker.snapshot(store_id, ref, objstore)
                else:
                    # in memory: a snapshot is self-contained, take the head now
                    ref = store.head
                    if ref.version == 0 or store.has_snapshot(ref):
                        return
                    if store.cold is not None:
                        self._spill_after.add(store_id)  # a spilled store moves onto its new snapshot
                    if store_id in self._spill_after:
                        store.pin_history(ref)  # the spill onto it keeps the commits made meanwhile
                    view = store.freeze()
                    block_bytes = block_bytes_for(store.memory_bytes)  # ~ its records' bytes
                    del store
                    data = await self._encode_here(view, block_bytes)
            if data is not None:
                size = await create_checkpoint_file(objstore, store_id, ref, SNAPSHOT, data)
                del data
            self.counters["snapshots"] += 1
            self.counters["snapshot_bytes"] += size
            log.info("snapshot of %s at %s: %d bytes", store_id, ref, size)
            store = self._registry.get(store_id)
            if store is None:
                # evicted meanwhile: keep nothing of it (``forget`` ran); a reload reads the
                # files, this snapshot included, and its next snapshot cleans up
                return
            store.mark_snapshot(ref)
            del store
            self._chain_bytes[store_id] = 0
            if store_id in self._spill_after:
                self._spill_after.discard(store_id)
                self._registry.spill_at(store_id, ref)
            self._schedule_cleanup(objstore, store_id, ref)
        except StateStoreError as exc:
            self.counters["snapshot_errors"] += 1
            log.warning("snapshot of %s at %s failed (retried at the next durable delta): %s", store_id, ref, exc)
        except Exception:
            self.counters["snapshot_errors"] += 1
            log.exception("snapshot of %s at %s failed", store_id, ref)
        finally:
            self._busy.discard(store_id)

    async def _encode_here(self, view: FrozenView, block_bytes: int = STEP_BLOCK_BYTES) -> bytes:
        """The snapshot file of ``view`` (released here), encoded in this process in bounded steps
        between requests."""
        try:
            parts: list[bytes] = []
            steps = snapshot_steps(view, block_bytes=min(block_bytes, STEP_BLOCK_BYTES))
            give_way = _Pacer(served=self._served)
            while True:
                # the collector is off during each step only, never across an await: requests
                # served in between make garbage (cycles too) that must be collectable
                with _no_cyclic_gc():
                    item = next(steps, _DONE)
                if item is _DONE:
                    break
                if item is None:
                    await give_way()
                else:
                    parts = cast("list[bytes]", item)
        finally:
            view.release()
        return await asyncio.to_thread(b"".join, parts)  # a large join releases the GIL

    def _schedule_cleanup(self, objstore: ObjectStore, store_id: StoreId, ref: CheckpointRef) -> None:
        """Start retention for ``store_id`` after its snapshot at ``ref``, when due: its own task,
        one cleanup at a time (``_cleanup_sem``), at most one per store at any time."""
        min_version = ref.version - self.retention_versions + 1
        if min_version <= 1 or store_id in self._cleaning or self._closed:
            return
        # Batch the deletions: a cleanup LISTs the store's folder and parses every entry on the
        # event loop (~2 ms at 120 files), so it runs once a quarter of the window has aged out,
        # not after every snapshot. Files outlive the window by at most that quarter.
        if min_version - self._cleaned_below.get(store_id, 0) < max(1, self.retention_versions // 4):
            return
        self._cleaning.add(store_id)
        task = asyncio.get_running_loop().create_task(self._cleanup(objstore, store_id, min_version))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _cleanup(self, objstore: ObjectStore, store_id: StoreId, min_version: int) -> None:
        try:
            async with self._cleanup_sem:
                await self._cleanup_now(objstore, store_id, min_version)
        finally:
            self._cleaning.discard(store_id)

    async def _cleanup_now(self, objstore: ObjectStore, store_id: StoreId, min_version: int) -> None:
        if self._closed:
            return
        try:
            headers = self._headers.setdefault(store_id, {})
            if len(headers) > 4 * self.retention_versions:  # attempts pile up only in odd cases
                headers.clear()
            report = await cleanup_store(objstore, store_id, None, min_version=min_version, header_cache=headers)
        except StateStoreError as exc:
            self.counters["cleanup_errors"] += 1
            log.warning("retention of %s failed (retried after the next snapshot): %s", store_id, exc)
            return
        self._cleaned_below[store_id] = min_version
        self._cleaned_below.move_to_end(store_id)
        while len(self._cleaned_below) > CLEANED_KEPT:
            self._cleaned_below.popitem(last=False)
        self.counters["cleanups"] += 1
        self.counters["files_deleted"] += len(report.deleted)

    @property
    def idle(self) -> bool:
        """True when no snapshot and no cleanup is queued or in progress."""
        return not self._busy and not self._cleaning

    async def close(self) -> None:
        """Stop: cancel snapshots in progress (they are optional; the deltas are the truth)."""
        self._closed = True
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._worker is not None:
            await self._worker.close()

    def stats(self) -> dict[str, Any]:
        out = {"in_progress": len(self._busy), "cleanups_in_progress": len(self._cleaning),
               "builder": "process" if self._worker else "inline", **self.counters}
        if self._worker is not None:
            out.update(self._worker.stats())
        return out
