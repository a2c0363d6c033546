"""``StoreRegistry``: the stores a daemon holds in memory, by ``StoreId`` (DESIGN §2, §5).

``open`` hands out a writer (engine ``StoreVersion``) for a committed (version, ckptid):

* from memory when the store holds that state (the hot path: no object-store request at all);
* else by loading it from the checkpoint files (``loader.load_store``); concurrent opens of one
  store wait for a single load.

One writer per store: the engine raises ``WriterConflictError``. Memory is accounted with the
engine's ``memory_bytes``; above ``memory_budget`` the least recently used stores that are idle
(no writer) and whose head is durable (the uploader has nothing of them pending) are evicted —
they reload from the object store when opened again. ``release`` evicts named stores on the same
terms, at once (the driver's coordinator knows another node now owns them).
"""
from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable

from statestore_async.daemon.objectstores import ObjectStores
from statestore_async.daemon.uploader import Uploader
from statestore_async.engine.store import DEFAULT_HISTORY, StoreVersion, VersionedStore
from statestore_async.errors import StateStoreError, VersionNotFoundError, WriterConflictError
from statestore_async.files import loader
from statestore_async.ids import EMPTY_STATE, CheckpointRef, StoreId

log = logging.getLogger(__name__)


class StoreRegistry:
    """StoreId → ``VersionedStore``, with hot reopen, single loads and a memory budget."""

    def __init__(self, objstores: ObjectStores, uploader: Uploader, *, memory_budget: int = 2 << 30,
                 history: int = DEFAULT_HISTORY) -> None:
        self._objstores = objstores
        self._uploader = uploader
        self.memory_budget = memory_budget
        self._history = history
        self._stores: OrderedDict[StoreId, VersionedStore] = OrderedDict()  # least recently used first
        self._loading: dict[StoreId, asyncio.Future[None]] = {}
        self._loads_running = 0
        self._load_finished = asyncio.Event()
        self.counters = {"opens": 0, "hot_opens": 0, "loads": 0, "load_errors": 0, "loads_waited": 0,
                         "evictions": 0, "writer_conflicts": 0, "released": 0}
        # called with the StoreId of each evicted store (maintenance drops what it keeps per store)
        self.evict_listeners: list[Callable[[StoreId], None]] = []

    def __len__(self) -> int:
        return len(self._stores)

    def get(self, store_id: StoreId) -> VersionedStore | None:
        return self._stores.get(store_id)

    # --- opening --------------------------------------------------------------------------------
    def try_open(self, store_id: StoreId, version: int, ckptid: str | None) -> StoreVersion | None:
        """Open from memory without awaiting; None when a load is needed."""
        if store_id in self._loading:
            return None
        store = self._stores.get(store_id)
        if store is None:
            if version == 0 and not ckptid:
                store = self._stores[store_id] = VersionedStore(store_id, history=self._history)
            else:
                return None
        return self._open_in(store, version, ckptid)

    def _open_in(self, store: VersionedStore, version: int, ckptid: str | None) -> StoreVersion | None:
        if store.writer is not None:
            self.counters["writer_conflicts"] += 1
            store.open(version, ckptid)  # raises WriterConflictError
        try:
            writer = store.open(version, ckptid)
        except VersionNotFoundError:
            return None
        self.counters["opens"] += 1
        self.counters["hot_opens"] += 1
        self._stores.move_to_end(store.store_id)
        return writer

    async def open(self, store_id: StoreId, version: int, ckptid: str | None = None) -> StoreVersion:
        """A writer on committed ``version`` (attempt ``ckptid``; the one in memory when None)."""
        while True:
            writer = self.try_open(store_id, version, ckptid)
            if writer is not None:
                return writer
            pending = self._loading.get(store_id)
            if pending is None:
                break
            await asyncio.shield(pending)  # another open is loading this store: wait, then retry
        if ckptid is None:
            if version == 0:
                ref = EMPTY_STATE
            else:
                raise VersionNotFoundError(
                    f"store {store_id}: version {version} is not in memory; name its checkpoint id to load it")
        else:
            ref = CheckpointRef(version, ckptid)
        return await self._load_and_open(store_id, ref)

    async def _admit_load(self) -> None:
        """Wait until a load may start: at once while the budget has room, else one at a time.

        A load holds every file it reads (their records) until it has replayed them: transient
        memory the budget does not see. Over budget, loads run one after another, so that what
        they hold beyond the budget is one store's files, not one per waiting client."""
        while self._loads_running and not self._has_room():
            self.counters["loads_waited"] += 1
            self._load_finished.clear()
            await self._load_finished.wait()
        self._loads_running += 1

    def _has_room(self) -> bool:
        return self.memory_bytes + self._uploader.queued_bytes < self.memory_budget

    async def _load_and_open(self, store_id: StoreId, ref: CheckpointRef) -> StoreVersion:
        done = asyncio.get_running_loop().create_future()
        self._loading[store_id] = done
        try:
            try:
                await self._admit_load()
                try:
                    store, report = await loader.load_store(self._objstores(store_id.root), store_id, ref,
                                                            history=self._history)
                finally:
                    self._loads_running -= 1
                    self._load_finished.set()
            except asyncio.CancelledError:
                raise
            except StateStoreError as exc:
                # the client gets the error; the operator must see it too (the message names the file)
                self.counters["load_errors"] += 1
                log.error("cannot load %s at %s: %s: %s", store_id, ref, type(exc).__name__, exc)
                raise
            except BaseException:
                self.counters["load_errors"] += 1
                log.exception("cannot load %s at %s", store_id, ref)
                raise
            self.counters["loads"] += 1
            if report.damaged or report.missing_bases:
                log.warning("loaded %s at %s from older states: snapshots damaged %s, missing %s; %d records "
                            "from %d files", store_id, ref, report.damaged, report.missing_bases, report.records,
                            len(report.files_read))
            else:
                log.info("loaded %s at %s: %d records from %d files", store_id, ref, report.records,
                         len(report.files_read))
            old = self._stores.get(store_id)
            if old is not None and old.writer is not None:
                self.counters["writer_conflicts"] += 1
                raise WriterConflictError(
                    f"store {store_id} already has a writer at version {old.writer.version}; commit or abort it first")
            self._stores[store_id] = store
            self._stores.move_to_end(store_id)
            writer = store.open(ref.version, ref.ckptid)
            self.counters["opens"] += 1
        finally:
            del self._loading[store_id]
            done.set_result(None)
        self.enforce_budget()
        return writer

    # --- memory ---------------------------------------------------------------------------------
    @property
    def memory_bytes(self) -> int:
        return sum(s.memory_bytes for s in self._stores.values())

    def _evictable(self, store: VersionedStore) -> bool:
        return (store.writer is None and not store._views and store.store_id not in self._loading
                and self._uploader.is_settled(store.store_id, store.head))

    def enforce_budget(self) -> int:
        """Evict idle, durable stores (least recently used first) until under budget. Returns how many.

        The budget covers the stores and the deltas waiting for upload (``Uploader.queued_bytes``):
        a delta older than its store's history is held by the upload queue alone."""
        total = self.memory_bytes + self._uploader.queued_bytes
        if total <= self.memory_budget:
            return 0
        evicted = 0
        for store_id, store in list(self._stores.items()):
            if total <= self.memory_budget:
                break
            if self._evictable(store):
                total -= store.memory_bytes
                self._drop(store_id)
                evicted += 1
                log.info("evicted %s at %s (memory %d > budget %d)", store_id, store.head, total,
                         self.memory_budget)
        self.counters["evictions"] += evicted
        return evicted

    def _drop(self, store_id: StoreId) -> None:
        del self._stores[store_id]
        for listener in self.evict_listeners:
            listener(store_id)

    def release(self, root: str, operator_id: str, store_name: str,
                partitions: Iterable[tuple[int, int]]) -> dict[str, list[int]]:
        """Drop the copies of ``partitions`` (``(partition id, below version)`` pairs) of one
        operator's store that are idle and durable and whose head version is lower than ``below``:
        a copy newer than the state the asker knows of (its partition back on this node, committed
        again) is not the stale one meant.

        Returns partition ids: ``released`` (dropped now), ``kept`` (held but in use, loading,
        with uploads pending or too new: asked again later) and ``held`` (every partition of that
        operator's store still in this daemon's memory). A partition this daemon does not hold is
        neither released nor kept. Nothing is lost either way: a dropped store reloads when opened.
        """
        released: list[int] = []
        kept: list[int] = []
        for p, below in sorted(set(partitions)):
            store_id = StoreId(root, operator_id, p, store_name)
            store = self._stores.get(store_id)
            if store is None or p in released or p in kept:
                continue
            if self._evictable(store) and store.head.version < below:
                self._drop(store_id)
                released.append(p)
                log.info("released %s at %s: another node owns it now", store_id, store.head)
            else:
                kept.append(p)
        self.counters["released"] += len(released)
        held = sorted(s.partition_id for s in self._stores
                      if s.root == root and s.operator_id == operator_id and s.store_name == store_name)
        return {"released": released, "kept": kept, "held": held}

    def stats(self) -> dict[str, int]:
        return {"stores": len(self._stores), "memory_bytes": self.memory_bytes,
                "memory_budget": self.memory_budget, "loading": len(self._loading), **self.counters}
