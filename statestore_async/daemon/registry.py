"""``StoreRegistry``: the stores a daemon holds in memory, by ``StoreId``
(docs/ARCHITECTURE.md, "The daemon"; the budget's promise: docs/GUARANTEES.md, "The memory budget").

``open`` hands out a writer (engine ``StoreVersion``) for a committed (version, ckptid):

* from memory when the store holds that state (the hot path: no object-store request at all);
* else by loading it from the checkpoint files (``loader.load_store``); concurrent opens of one
  store wait for a single load.

One writer per store: the engine raises ``WriterConflictError``. Memory is accounted with the
engine's ``memory_bytes`` plus the block cache of the stores' cold levels; above ``memory_budget``
the block cache gives back its least recently used blocks first, then the least recently used
stores that are idle (no writer, no frozen view) and whose head will be durable (its upload did
not fail for good; it may still be on its way: the upload queue holds the delta, counted in the
budget, and a later load of the store waits for its uploads) leave memory:

* a store whose map takes ``spill_min_bytes`` or more *spills* (``VersionedStore.spill``; in use
  or not: an open version reads on through the cold level): its
  head's snapshot file, on local disk (the object store's cache, or a ``file://`` root's own file),
  becomes its cold level (``files.coldrun.ColdRun``) and only what changes after stays in memory.
  When the head has no snapshot yet, maintenance is asked for one (``request_spill``) and the store
  spills once it is written. A spilled store's hot part leaves memory the same way without any
  write: the delta files of its commits since (durable, with local copies) are stacked over its
  cold level as newer runs (``ColdStack``, up to ``MAX_RUNS``), until a snapshot replaces the stack;
* a smaller store, or one whose head's snapshot has no local copy, is evicted whole — it reloads
  from its files when opened again. A spilled store that holds less than ``spill_min_bytes``
  stays (evicting it would free little and cost a reload).

Over budget with every idle store spilled or gone, the open versions with the largest changes
*flush* them (``StoreVersion.flush``: the write buffer): the changes go in key order to a file in
the scratch folder (``checkpoint.write_flushed``; the file is unlinked once opened, so a crash
leaves only its run's link, removed when the next daemon starts), read back as a run by the version
and, after its commit, by the store's cold level. A version can flush once its store is spilled (an
empty store spills onto an empty snapshot file of its own) and its hot part is empty (its durable deltas are stacked first). When
the commit's delta file is durable and local, it replaces the flushed runs (``_stack_deltas``).

A load offers the loader the local copies of a store's files (``_cold_opener``, ``_delta_opener``):
a store whose snapshot is on local disk comes back spilled onto it, with the deltas after it opened
as runs (up to ``MAX_RUNS``), reading none of their records into memory.

``release`` evicts named stores on the same terms as eviction, at once (the driver's coordinator
knows another node now owns them).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import tempfile
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from statestore_async.daemon.objectstores import ObjectStores
from statestore_async.daemon.uploader import Uploader, UploadState
from statestore_async.engine.levels import ColdLevel, FlushedRun
from statestore_async.engine.store import DEFAULT_HISTORY, StoreVersion, VersionedStore
from statestore_async.engine.table import Table
from statestore_async.errors import OpenTimeoutError, StateStoreError, VersionNotFoundError, WriterConflictError
from statestore_async.files import loader
from statestore_async.files.checkpoint import CheckpointWriter, write_flushed
from statestore_async.files.coldrun import BlockCache, ColdRun, ColdStack
from statestore_async.files.names import DELTA, SNAPSHOT, file_key
from statestore_async.files.runfiles import DEFAULT_MAX_OPEN, RunFiles
from statestore_async.ids import EMPTY_STATE, CheckpointRef, StoreId, new_checkpoint_id

# a store whose committed map takes less is evicted whole rather than spilled (its reload is cheap)
SPILL_MIN_BYTES = 1 << 20
# runs a spilled store's cold level may have (deltas over its snapshot) before the next spill goes
# onto a new snapshot instead: every run is one more place a read may have to look
MAX_RUNS = 16
# by default, an open version's changes smaller than this stay in memory (a flush costs a file and a run)
FLUSH_MIN_BYTES = 1 << 20
# Over budget, at most this many idle stores too large to go whole stay in memory, waiting to spill
# (their snapshot being written, their last deltas uploading); the others leave memory whole.
# Maintenance writes one snapshot at a time: more waiting would hold memory and gain nothing.
MAX_SPILL_WAITS = 2
# how long an OPEN waits at most for its store's earlier uploads to settle (``open_wait_timeout``)
OPEN_WAIT_TIMEOUT = 30.0
# while it waits, it looks this often whether the root started refusing uploads
OPEN_WAIT_RECHECK = 1.0

log = logging.getLogger(__name__)


class StoreRegistry:
    """StoreId → ``VersionedStore``, with hot reopen, single loads and a memory budget."""

    def __init__(self, objstores: ObjectStores, uploader: Uploader, *, memory_budget: int = 2 << 30,
                 history: int = DEFAULT_HISTORY, block_cache_bytes: int | None = None,
                 spill_min_bytes: int = SPILL_MIN_BYTES, scratch_dir: str | None = None,
                 flush_min_bytes: int = FLUSH_MIN_BYTES, open_wait_timeout: float = OPEN_WAIT_TIMEOUT,
                 max_open_runs: int = DEFAULT_MAX_OPEN, snapshot_after: int | None = None) -> None:
        self._objstores = objstores
        # a load that replays more deltas than this writes the loaded state's snapshot (the
        # snapshot interval: more means the maintenance's snapshots fell behind)
        self.snapshot_after = snapshot_after
        self.open_wait_timeout = open_wait_timeout
        self._uploader = uploader
        self.memory_budget = memory_budget
        self._history = history
        # decoded blocks of the spilled stores' cold levels (a quarter of the budget by default)
        # their runs' files: at most ``max_open_runs`` open, linked in the scratch folder (its file system)
        self.block_cache = BlockCache(memory_budget // 4 if block_cache_bytes is None else block_cache_bytes,
                                      RunFiles(max_open_runs, park_dir=scratch_dir))
        self.spill_min_bytes = spill_min_bytes
        self.flush_min_bytes = flush_min_bytes  # an open version's changes smaller than this stay in memory
        # where flushed changes are written (None: a temporary folder, made when first needed)
        self._scratch = scratch_dir
        self._scratch_ids = itertools.count(1)
        # stores whose new snapshot came while the deltas since it were still uploading: spilled
        # onto it (those deltas stacked over it) once they are durable
        self._spill_later: dict[StoreId, CheckpointRef] = {}
        self._deep: set[StoreId] = set()  # stacks past MAX_RUNS whose snapshot was asked for
        # stores whose snapshot to spill onto was asked for, with the head it was asked at
        self._spill_asked: dict[StoreId, CheckpointRef] = {}
        # set by maintenance: snapshot a store's head now, then call ``spill_at`` (None: no spilling
        # of stores without a snapshot at their head)
        self.request_spill: Callable[[StoreId], None] | None = None
        self._stores: OrderedDict[StoreId, VersionedStore] = OrderedDict()  # least recently used first
        self._loading: dict[StoreId, asyncio.Future[None]] = {}
        self._loads_running = 0
        self._load_finished = asyncio.Event()
        self.counters = {"opens": 0, "hot_opens": 0, "loads": 0, "load_errors": 0, "loads_waited": 0,
                         "evictions": 0, "writer_conflicts": 0, "released": 0, "spills": 0, "spill_requests": 0,
                         "cold_loads": 0, "deltas_stacked": 0, "delta_runs_loaded": 0, "deltas_downloaded": 0,
                         "loads_waited_for_uploads": 0, "rescales": 0, "rescale_bytes_read": 0, "load_snapshots": 0,
                         "flushes": 0, "flushed_bytes": 0, "flush_errors": 0, "broken_dropped": 0,
                         "opens_refused_uploads": 0, "opens_timed_out": 0}
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
        if store is not None and store.broken:
            self._drop_broken(store)  # loaded again from its files, below (or made empty: version 0)
            store = None
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
                # an evicted store's last commits may still be uploading: its files are complete
                # only once they are in the object store
                if self._uploader.pending(store_id):
                    self.counters["loads_waited_for_uploads"] += 1
                    await self._wait_uploads(store_id, ref)
                await self._admit_load()
                try:
                    store, report = await loader.load_store(
                        self._objstores(store_id.root), store_id, ref, history=self._history,
                        cold=self._cold_opener(store_id), cold_delta=self._delta_opener(store_id), max_runs=MAX_RUNS,
                        snapshot_after=self.snapshot_after)
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
            if report.cold is not None:
                self.counters["cold_loads"] += 1
                self.counters["delta_runs_loaded"] += len(report.delta_runs)
                self.counters["deltas_downloaded"] += len(report.downloaded)
            if report.snapshot_written and report.rescaled_from is None:
                self.counters["load_snapshots"] += 1  # a long chain replayed: its snapshot written
            if report.rescaled_from is not None:  # a rescaled partition's first state, assembled
                self.counters["rescales"] += 1
                self.counters["rescale_bytes_read"] += report.bytes_read
            if report.damaged or report.missing_bases:
                log.warning("loaded %s at %s from older states: snapshots damaged %s, missing %s; %d records "
                            "from %d files", store_id, ref, report.damaged, report.missing_bases, report.records,
                            len(report.files_read))
            elif report.cold is not None:
                log.info("loaded %s at %s over its local snapshot file %s (read by block on demand) and %d "
                         "deltas (%d of them as runs over local files)", store_id, ref, report.cold,
                         len(report.deltas), len(report.delta_runs))
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

    async def _wait_uploads(self, store_id: StoreId, ref: CheckpointRef) -> None:
        """Wait until the store's queued uploads settle, at most ``open_wait_timeout`` seconds:
        the files of its last commits are complete only then. A root that refuses uploads
        (degraded: credentials, permissions, a full disk) fails the open at once with that error,
        and a wait past the bound with ``OpenTimeoutError``; both are logged with the reason."""
        uploader = self._uploader
        uploader.hurry(store_id)  # its uploads go before other stores' queues
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.open_wait_timeout
        while uploader.pending(store_id):
            refusal = uploader.refusal(store_id.root)
            if refusal is not None:
                self.counters["opens_refused_uploads"] += 1
                msg = (f"cannot open {store_id} at {ref}: {uploader.pending(store_id)} earlier commits of it are "
                       f"still to be uploaded and its object store refuses this daemon's uploads "
                       f"({type(refusal).__name__}: {refusal}); fix the credentials, permissions or space of "
                       f"{store_id.root} (the uploads are retried), or open a version the daemon holds in memory")
                log.warning("%s", msg)
                raise type(refusal)(msg, refusal.key)
            remaining = deadline - loop.time()
            if remaining <= 0 or not await uploader.wait_settled(store_id, min(remaining, OPEN_WAIT_RECHECK)):
                if loop.time() < deadline:
                    continue  # look at the root again
                self.counters["opens_timed_out"] += 1
                last = uploader.last_error(store_id)
                why = f"; the last attempt failed with {type(last).__name__}: {last}" if last is not None else ""
                msg = (f"cannot open {store_id} at {ref}: {uploader.pending(store_id)} earlier commits of it were "
                       f"still not uploaded after {self.open_wait_timeout:g} s (open_wait_timeout){why}; the "
                       f"uploads go on, open it again later")
                log.warning("%s", msg)
                raise OpenTimeoutError(msg)

    # --- memory ---------------------------------------------------------------------------------
    @property
    def memory_bytes(self) -> int:
        return sum(s.memory_bytes for s in self._stores.values()) + self.block_cache.nbytes

    def _evictable(self, store: VersionedStore) -> bool:
        # A head still uploading may leave memory: the upload queue holds its delta (counted in
        # the budget), and a load of the store waits for its uploads (``_load_and_open``). Keeping
        # such stores made a stalled object store pin every store with a commit queued — above the
        # budget. A head whose upload failed for good stays: no file could reload it.
        return (store.writer is None and not store._views and store.store_id not in self._loading
                and self._uploader.will_settle(store.store_id, store.head))

    def _spillable(self, store: VersionedStore) -> bool:
        # a store in use may spill: an open version reads on through the cold level, a frozen
        # view keeps the tables it froze
        return (store.store_id not in self._loading and not store.broken
                and self._uploader.will_settle(store.store_id, store.head))

    def enforce_budget(self) -> int:
        """Bring memory under budget: the block cache first, then idle stores (least
        recently used first) spill or leave memory (see the module doc). Returns the stores
        evicted whole.

        The budget covers the stores, the block cache and the deltas waiting for upload
        (``Uploader.queued_bytes``): a delta older than its store's history is held by the upload
        queue alone."""
        for broken in [s for s in self._stores.values() if s.broken]:
            self._drop_broken(broken)
        for store_id, ref in list(self._spill_later.items()):  # a new snapshot the store could not move onto yet
            store = self._stores.get(store_id)
            if store is None or store.head.version < ref.version:
                del self._spill_later[store_id]
            elif store_id not in self._loading and self._spillable(store):
                self._spill_now(store, ref)
        for store in self._stores.values():
            cold = store.cold
            if (isinstance(cold, ColdStack) and cold.runs[0].flushed and store.store_id not in self._loading
                    and not store.broken):
                self._stack_deltas(store)  # the runs a version flushed give way to its durable delta file
        total = self.memory_bytes + self._uploader.queued_bytes
        if total <= self.memory_budget:
            return 0
        total -= self.block_cache.shrink(max(0, self.block_cache.nbytes - (total - self.memory_budget)))
        evicted = 0
        # spilled stores keep little in memory and would reload their cold level: they go last
        order = sorted(self._stores.items(), key=lambda item: item[1].cold is not None)
        small_spilled: list[StoreId] = []
        waits = 0  # idle stores kept over the budget this pass until they can spill
        for store_id, store in order:
            if total <= self.memory_budget:
                break
            if store.hot_bytes >= self.spill_min_bytes and self._spillable(store):
                stacked = self._stack_deltas(store)  # None: it can once its last deltas are durable
                freed = stacked or (self._spill_now(store) if stacked is not None else 0)
                if freed:
                    total -= freed
                    if self._evictable(store):
                        small_spilled.append(store_id)  # to go whole if spilling all is not enough
                    continue
                can_ask = stacked is not None and not store.has_snapshot(store.head) and self.request_spill is not None
                if (stacked is None or can_ask) and waits < MAX_SPILL_WAITS:
                    # it spills once its last deltas are durable, or its snapshot is written
                    waits += 1
                    if can_ask and self._spill_asked.get(store_id) != store.head:
                        assert self.request_spill is not None
                        self._spill_asked[store_id] = store.head  # asked again once the head moves
                        self.counters["spill_requests"] += 1
                        self.request_spill(store_id)
                    continue
                # Beyond MAX_SPILL_WAITS such stores, an idle one leaves memory whole rather than
                # wait (kept, every store too large to go whole and without a snapshot yet, while
                # their clients went on committing and the snapshots queued, took the daemon's
                # count to 25 times the budget).
            if not self._evictable(store):
                continue
            if store.cold is not None and store.memory_bytes < self.spill_min_bytes:
                small_spilled.append(store_id)  # evicting it frees little and its reload costs a load: last
                continue
            total -= store.memory_bytes
            self._drop(store_id)
            evicted += 1
            log.info("evicted %s at %s (memory %d > budget %d)", store_id, store.head, total, self.memory_budget)
        for store_id in small_spilled:  # still over budget: many small spilled stores add up
            if total <= self.memory_budget:
                break
            store = self._stores[store_id]
            if not self._evictable(store):
                continue
            total -= store.memory_bytes
            self._drop(store_id)
            evicted += 1
            log.info("evicted the spilled %s at %s (memory %d > budget %d)", store_id, store.head, total,
                     self.memory_budget)
        self.counters["evictions"] += evicted
        if total > self.memory_budget:
            self._flush_open_versions(total)
        return evicted

    # --- the write buffer: open versions' changes to local disk ---------------------------------
    def note_changes(self, w: StoreVersion) -> None:
        """``w`` took changes (PUT_MANY, REMOVE_MANY): once they pass an eighth of the budget,
        check the budget now rather than after the burst (a pipelined batch of hundreds of MB
        arrives well within the delayed check), so that a flush keeps them near the budget."""
        if w.overlay_bytes >= max(self.flush_min_bytes, self.memory_budget // 8):
            self.enforce_budget()

    def before_commit(self, w: StoreVersion) -> None:
        """``w`` is about to commit: when its changes, applied to its store's map (where a commit
        copies them, while its delta keeps them until uploaded), would take memory over the
        budget, flush them first (when the store allows it): the commit then only stacks runs."""
        if w.overlay_bytes < self.flush_min_bytes:
            return
        if self.memory_bytes + self._uploader.queued_bytes + w.overlay_bytes <= self.memory_budget:
            return
        store = self._stores.get(w.store_id)
        if store is not None and store.writer is w:
            self._flush(store, w)

    def _flush(self, store: VersionedStore, w: StoreVersion) -> int:
        """Flush ``w``'s changes when its store allows it (made so if it can be); the bytes freed.
        A flush that fails (a full disk) leaves the changes in memory, logged and counted."""
        if not w.flushable and not self._make_flushable(store, w):
            return 0
        try:
            return w.flush(self._flush_writer(store), _stack_runs)
        except (OSError, StateStoreError) as exc:
            self.counters["flush_errors"] += 1
            log.warning("cannot flush the changes of %s at version %d to %s (they stay in memory): %s: %s",
                        store.store_id, w.version, self._scratch, type(exc).__name__, exc)
            return 0

    def _flush_open_versions(self, total: int) -> int:
        """Flush the largest open versions' changes (see the module doc) until memory is within
        the budget; the bytes freed. A flush that fails (a full disk) leaves the changes in memory."""
        freed = 0
        writers = [(s, s.writer) for s in self._stores.values() if s.writer is not None]
        writers.sort(key=lambda sw: sw[1].overlay_bytes, reverse=True)
        for store, w in writers:
            if total - freed <= self.memory_budget or w.overlay_bytes < self.flush_min_bytes:
                break
            freed += self._flush(store, w)
        return freed

    def _make_flushable(self, store: VersionedStore, w: StoreVersion) -> bool:
        """Make ``store``'s open version ``w`` able to flush: an empty store spills onto an empty
        snapshot file; a spilled store stacks its durable deltas to empty its hot part."""
        if store.cold is None:
            if store.hot_records:
                return False  # its committed map is in memory: it spills once it has a snapshot
            try:
                store.spill(self._empty_snapshot(store))
            except (OSError, StateStoreError) as exc:
                self.counters["flush_errors"] += 1
                log.warning("cannot spill the empty store %s onto a file in %s: %s: %s", store.store_id,
                            self._scratch, type(exc).__name__, exc)
                return False
        elif store.hot_records:
            self._stack_deltas(store)
        return w.flushable

    def _scratch_path(self, suffix: str) -> str:
        if self._scratch is None:
            self._scratch = tempfile.mkdtemp(prefix="statestore-flush-")
        os.makedirs(self._scratch, exist_ok=True)
        return os.path.join(self._scratch, f"{os.getpid()}-{next(self._scratch_ids)}{suffix}")

    def _scratch_run(self, suffix: str, write: Callable[[str], int], store_id: StoreId, ref: CheckpointRef,
                     kind: str) -> tuple[ColdRun, int]:
        """A scratch file written by ``write(path)`` (which returns its size), opened as a run and
        removed from its folder at once (the run's handle keeps it readable; nothing is left behind
        once it is closed, nor when writing or opening fails). Returns the run and the size."""
        path = self._scratch_path(suffix)
        try:
            size = write(path)
            return ColdRun.open(path, store_id, ref, self.block_cache, kind=kind), size
        finally:
            if os.path.exists(path):
                os.unlink(path)

    def _flush_writer(self, store: VersionedStore) -> Callable[[Table], FlushedRun]:
        store_id = store.store_id

        def write(changes: Table) -> FlushedRun:
            ref = CheckpointRef(store.head.version + 1, new_checkpoint_id())
            with changes.freeze() as view:
                run, size = self._scratch_run(".flush", lambda path: write_flushed(path, store_id, ref, view),
                                              store_id, ref, DELTA)
            run.flushed = True
            self.counters["flushes"] += 1
            self.counters["flushed_bytes"] += size
            log.info("flushed %d changes of %s at version %d to local disk (%d bytes)", len(changes), store_id,
                     store.head.version, size)
            return run

        return write

    def _empty_snapshot(self, store: VersionedStore) -> ColdRun:
        """A snapshot run of ``store``'s head (an empty state) holding no record, over a file in
        the scratch folder. The file names a state of its own (version 0, the empty state, has
        none); the run holds the head's."""
        own = CheckpointRef(store.head.version + 1, new_checkpoint_id())

        def write(path: str) -> int:
            data = CheckpointWriter(SNAPSHOT, store.store_id, own, ()).finish()
            with open(path, "wb") as f:
                return f.write(data)

        run, _ = self._scratch_run(".empty", write, store.store_id, own, SNAPSHOT)
        run.ref = store.head
        return run

    def _cold_opener(self, store_id: StoreId) -> Callable[[CheckpointRef], ColdRun | None]:
        """For the loader: a cold level over the local copy of a snapshot of ``store_id``, when there
        is one worth opening lazily (a file of at least a quarter of ``spill_min_bytes``: a
        smaller store is read whole, its reads then never touch the disk)."""
        objstore = self._objstores(store_id.root)

        def open_cold(ref: CheckpointRef) -> ColdRun | None:
            path = objstore.local_path(file_key(store_id, ref, SNAPSHOT))
            try:
                if path is None or os.path.getsize(path) < self.spill_min_bytes // 4:
                    return None
                return ColdRun.open(path, store_id, ref, self.block_cache)
            except (OSError, StateStoreError) as exc:
                log.warning("cannot open the local copy %s of the snapshot of %s at %s (reading the object store's "
                            "instead): %s: %s", path, store_id, ref, type(exc).__name__, exc)
                return None

        return open_cold

    def _delta_opener(self, store_id: StoreId) -> Callable[[CheckpointRef], ColdRun | None]:
        """For the loader: a run over the local copy of a delta of ``store_id`` (its blocks' checksums
        checked at open), or None. A damaged copy is logged and dropped from the cache (the loader
        then reads the object store's)."""
        objstore = self._objstores(store_id.root)

        def open_delta(ref: CheckpointRef) -> ColdRun | None:
            key = file_key(store_id, ref, DELTA)
            path = objstore.local_path(key)
            if path is None:
                return None
            try:
                return ColdRun.open(path, store_id, ref, self.block_cache, kind=DELTA, verify=True)
            except (OSError, StateStoreError) as exc:
                log.warning("cannot open the local copy %s of the delta of %s at %s (reading the object store's "
                            "instead): %s: %s", path, store_id, ref, type(exc).__name__, exc)
                forget = getattr(objstore, "forget", None)
                if forget is not None:
                    forget(key)
                return None

        return open_delta

    def _spill_now(self, store: VersionedStore, ref: CheckpointRef | None = None) -> int:
        """Spill ``store`` onto the local copy of the snapshot of ``ref`` (its head, or a state of
        its recent history); the bytes freed (0: no such snapshot, or no local copy of it)."""
        store_id = store.store_id
        ref = store.head if ref is None else ref
        if ref.version == 0 or not store.has_snapshot(ref) or (store.cold is not None and store.cold.ref == ref):
            return 0
        path = self._objstores(store_id.root).local_path(file_key(store_id, ref, SNAPSHOT))
        if path is None:
            return 0
        try:
            run = ColdRun.open(path, store_id, ref, self.block_cache)
        except (OSError, StateStoreError) as exc:
            self._spill_later.pop(store_id, None)
            log.warning("cannot spill %s onto %s: %s: %s", store_id, path, type(exc).__name__, exc)
            return 0
        before = store.memory_bytes
        old = store.cold
        try:
            store.spill(run)
        except StateStoreError as exc:
            # the head moved past what the history can rebuild (commits made since, some flushed):
            # the delta files of those commits go over the new snapshot instead
            stacked = self._stack_deltas(store, onto=run)
            if store.cold is old:  # not stacked (its figure alone cannot tell: stacking may free nothing)
                run.close()
                self._spill_later[store_id] = ref  # tried again at each budget check
                log.info("cannot spill %s onto %s yet: %s", store_id, path, exc)
                return 0
            self._spill_later.pop(store_id, None)
            self._deep.discard(store_id)
            return stacked or 0
        self._spill_later.pop(store_id, None)
        self._deep.discard(store_id)
        self._spill_asked.pop(store_id, None)
        if old is not None and not store._views:  # a view being written reads on from it (closed when collected)
            old.close()
        self.counters["spills"] += 1
        log.info("spilled %s at %s onto %s (%d bytes freed)", store_id, ref, path, before - store.memory_bytes)
        return max(0, before - store.memory_bytes)

    def _stack_deltas(self, store: VersionedStore, onto: ColdRun | None = None) -> int | None:
        """A spilled store's hot part leaves memory without a write: the delta files of the commits
        made since its cold state that are durable (with local copies) become the newer runs of its
        cold level (``ColdStack``); the commits still uploading stay in memory (the hot part starts
        again with them, from the store's recent history). With ``onto`` (a new snapshot of a state
        behind the head) the deltas since that state are stacked over it instead, and the old cold
        level goes. The bytes freed; 0 when it cannot (not spilled, a delta not local, the lineage
        not leading to the cold state, the stack at ``MAX_RUNS``, a commit since that only its
        delta file holds whole still uploading); None when it can once a delta still uploading is
        durable."""
        cold, store_id, head = store.cold, store.store_id, store.head
        if not isinstance(cold, (ColdRun, ColdStack)) and onto is None:
            return 0
        # runs a version flushed give way to its commit's delta file: the chain starts below them
        below = cold.below_flushed() if isinstance(cold, ColdStack) else None
        base: ColdRun | ColdStack
        if onto is not None:
            base = onto
        else:
            assert isinstance(cold, (ColdRun, ColdStack))
            base = cold if below is None else below
        if head == base.ref:
            return 0
        chain: list[CheckpointRef] = []  # the states since the base one, newest first
        for r in (head, *store.lineage):
            if r == base.ref:
                break
            chain.append(r)
        else:
            return 0  # a newer snapshot cut the lineage: the next spill goes onto a snapshot
        # uploads go in commit order: the durable states are the oldest of the chain
        refs = [r for r in chain if self._uploader.state(store_id, r) in (None, UploadState.DURABLE)
                and not self._uploader.pending_ref(store_id, r)]
        if not refs:
            return None if self._uploader.will_settle(store_id, head) else 0
        depth = len(base.runs) if isinstance(base, ColdStack) else 1
        if depth + len(refs) > MAX_RUNS:
            # deeper than reads should go: a new snapshot will bring it back down; until it is
            # written the stack may grow to twice that, rather than keep every commit in memory
            if self.request_spill is not None and onto is None and store.store_id not in self._deep:
                self._deep.add(store.store_id)
                self.counters["spill_requests"] += 1
                self.request_spill(store.store_id)
            if depth + len(refs) > 2 * MAX_RUNS:
                return 0
        objstore = self._objstores(store_id.root)
        runs: list[ColdRun] = []
        try:
            for r in refs:
                path = objstore.local_path(file_key(store_id, r, DELTA))
                if path is None:
                    return 0
                runs.append(ColdRun.open(path, store_id, r, self.block_cache, kind=DELTA))
            before = store.memory_bytes
            store.spill(ColdStack.over(runs, base))
        except (OSError, StateStoreError) as exc:
            log.warning("cannot stack the deltas of %s since %s: %s: %s", store_id, base.ref, type(exc).__name__, exc)
            return 0
        finally:
            if store.cold is cold:  # not stacked: let go of the runs opened
                for run in runs:
                    run.close()
        if not store._views:  # a view being written reads on from them (closed when collected)
            if onto is not None and cold is not None:
                cold.close()  # the new snapshot replaces the whole old level
            elif below is not None:
                assert isinstance(cold, ColdStack)
                for run in cold.runs:
                    if run.flushed:
                        run.close()
        self.counters["spills"] += 1
        self.counters["deltas_stacked"] += len(refs)
        log.info("stacked %d deltas of %s over %s (%d bytes freed)", len(refs), store_id, base.ref,
                 before - store.memory_bytes)
        return max(0, before - store.memory_bytes)

    def spill_at(self, store_id: StoreId, ref: CheckpointRef) -> None:
        """Maintenance wrote the snapshot of ``ref`` that a spill asked for, or a snapshot of a
        spilled store: spill the store onto it if memory is still over budget, and always when the
        store is spilled already (its runs and hot part give way to one file). Commits made since
        the snapshot stay in memory: the hot part starts with them."""
        self._deep.discard(store_id)  # a later stack past MAX_RUNS asks again
        self._spill_asked.pop(store_id, None)
        store = self._stores.get(store_id)
        if store is None or not self._spillable(store):
            return
        if store.cold is not None or self.memory_bytes + self._uploader.queued_bytes > self.memory_budget:
            self._spill_now(store, ref)
            self.enforce_budget()

    def _drop_broken(self, store: VersionedStore) -> None:
        """Let go of a store whose changes failed part-way in memory (``VersionedStore.broken``: it
        refuses every request); its next open loads it from the files the caller names."""
        if store.store_id in self._loading or store.writer is not None:
            return  # a broken store has no writer (a failed commit ended it); a load replaces it anyway
        log.error("dropping %s from memory: %s", store.store_id, store.broken)
        self.counters["broken_dropped"] += 1
        self._drop(store.store_id)

    def _drop(self, store_id: StoreId) -> None:
        del self._stores[store_id]
        self._spill_later.pop(store_id, None)
        self._deep.discard(store_id)
        self._spill_asked.pop(store_id, None)
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
            # another node will load it: its head must be in the object store already
            if (self._evictable(store) and self._uploader.is_settled(store_id, store.head)
                    and store.head.version < below):
                self._drop(store_id)
                released.append(p)
                log.info("released %s at %s: another node owns it now", store_id, store.head)
            else:
                kept.append(p)
        self.counters["released"] += len(released)
        held = sorted(s.partition_id for s in self._stores
                      if s.root == root and s.operator_id == operator_id and s.store_name == store_name)
        return {"released": released, "kept": kept, "held": held}

    @property
    def releases(self) -> int:
        """How many times memory was given back so far (stores evicted, spilled or stacked,
        changes flushed, cached blocks dropped): the daemon trims malloc's heap when it moves."""
        c = self.counters
        return c["evictions"] + c["spills"] + c["flushes"] + c["released"] + self.block_cache.evictions

    def stats(self) -> dict[str, int]:
        return {"stores": len(self._stores), "memory_bytes": self.memory_bytes,
                "memory_budget": self.memory_budget, "loading": len(self._loading),
                "spilled": sum(1 for s in self._stores.values() if s.cold is not None),
                "block_cache_bytes": self.block_cache.nbytes, **self.counters,
                **{f"run_files_{k}": v for k, v in self.block_cache.files.stats().items()}}


def _stack_runs(runs: Sequence[FlushedRun], cold: ColdLevel, ref: CheckpointRef) -> ColdLevel:
    """A flushed version's commit: its runs (``ColdRun``s) over its store's cold level, holding ``ref``."""
    assert isinstance(cold, (ColdRun, ColdStack)) and all(isinstance(r, ColdRun) for r in runs)
    return ColdStack.over([r for r in runs if isinstance(r, ColdRun)], cold, ref)
