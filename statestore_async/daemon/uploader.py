"""``Uploader``: makes committed deltas durable in the background (docs/GUARANTEES.md).

``submit(delta)`` registers the delta at once (its durability is queryable from then on) and
returns as soon as the upload queue has room for it: when ``queue_bytes`` or ``queue_count``
deltas are already waiting, commits wait (back-pressure) — a delta is never dropped. A store an
OPEN waits for (``hurry``) has its deltas admitted and its uploads sent before other stores'. A
background task per store uploads its deltas in commit order, with at most ``concurrency`` uploads
at a time across stores: holding one of those slots, it encodes the delta
(``checkpoint.encode_delta``, in a worker thread, ``ENCODE_THREADS`` at a time) and creates its file
with ``files.transfer.create_checkpoint_file``. A delta is encoded only once its upload holds a
slot, so the encoded files waiting for the object store are ``concurrency`` at most, whatever the
number of stores with deltas queued, besides those of uploads waiting to retry (each keeps its file
across its attempts).

What it promises:

* **Durable means loadable.** A delta is uploaded only once every delta of its lineage that this
  daemon uploads is durable, so a delta file in the object store can always be loaded; a version
  is reported durable only when its own file is there (and so its lineage's).
* **Retried until it succeeds or the daemon stops.** Any failure of an attempt is retried with
  exponential backoff (botocore retries underneath), whatever its type, except the failures
  that cannot heal: the delta cannot be encoded, the name is taken by other bytes
  (``CheckpointConflictError``: two writers used one checkpoint id; an earlier attempt of this
  upload whose answer was lost is recognised by its bytes and is a success), or a misuse
  (``InterfaceError``). Such an upload fails for good, and so does every later upload of the store
  whose lineage needs it (``UploadFailedError`` naming the file), without being sent.
* **Failures are answered, never left to time out.** ``wait_durable`` raises the typed error of a
  failed upload (or of the failed file a lineage needs). A root whose last attempt was refused in
  a way that retrying does not heal by itself (``ObjectStoreAccessError``: credentials,
  permissions, a missing bucket; ``StorageFullError``) is *degraded*: waiters for anything not yet
  durable there get that error at once, uploads go on being retried in the background, and the
  first success there clears it.
* **A store's folder is swept once.** Before this daemon's first upload to a store, incomplete
  multipart uploads (or a local store's temp files) left under its folder by a killed process are
  aborted (``abort_incomplete_uploads``; best effort: a failed look is tried again before its next upload).
"""
from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from typing import Any

from statestore_async.daemon.metrics import DURABLE_LATENCY_BOUNDS, Buckets
from statestore_async.engine.delta import Delta
from statestore_async.errors import (
    CheckpointConflictError,
    InterfaceError,
    ObjectStoreAccessError,
    ObjectStoreError,
    StateStoreError,
    StorageFullError,
    UploadFailedError,
)
from statestore_async.files import checkpoint
from statestore_async.files.names import DELTA, file_key
from statestore_async.files.transfer import create_checkpoint_file
from statestore_async.ids import CheckpointRef, StoreId
from statestore_async.objectstore.base import ObjectStore

log = logging.getLogger(__name__)

# deltas encoded at once (CPU work in worker threads: more than the cores only adds buffers)
ENCODE_THREADS = 2


class UploadState(enum.Enum):
    QUEUED = "queued"
    UPLOADING = "uploading"
    DURABLE = "durable"
    FAILED = "failed"


# errors after which a root is reported degraded (see the module docstring)
_DEGRADING = (ObjectStoreAccessError, StorageFullError)
# failures of an attempt that retrying cannot heal
_PERMANENT = (CheckpointConflictError, InterfaceError)


class Upload:
    """One delta on its way to the object store: ``admitted`` is set once the queue has room for
    it (its COMMIT may be answered), ``done`` once it is durable or failed for good."""

    __slots__ = ("admitted", "attempts", "delta", "done", "enqueued", "error", "lineage", "ref", "size", "state",
                 "store_id")

    def __init__(self, delta: Delta, size: int) -> None:
        self.store_id: StoreId = delta.store_id
        self.ref: CheckpointRef = delta.ref
        self.delta: Delta | None = delta  # None once the upload is finished
        # the refs this one's load needs (until it is finished: a durable delta's lineage was durable)
        self.lineage: tuple[CheckpointRef, ...] = delta.lineage
        self.size = size
        self.enqueued = time.monotonic()  # when it was committed: upload lag and commit-to-durable time
        self.state = UploadState.QUEUED
        # the last attempt's error while pending; the typed reason once FAILED
        self.error: BaseException | None = None
        self.attempts = 0
        self.admitted = asyncio.Event()
        self.done = asyncio.Event()

    @property
    def key(self) -> str:
        return file_key(self.store_id, self.ref, DELTA)

    @property
    def finished(self) -> bool:
        return self.state is UploadState.DURABLE or self.state is UploadState.FAILED


class _Durable:
    """What the uploader keeps of a finished, durable upload: its state. The delta, the lineage and
    the events go with the ``Upload`` (thousands of durable uploads are remembered)."""

    __slots__ = ()
    state = UploadState.DURABLE
    error = None
    finished = True


_DURABLE = _Durable()


class _Degraded:
    """Why a root is degraded: the last attempt's error, since when, and how often it was seen."""

    __slots__ = ("count", "error", "since")

    def __init__(self, error: ObjectStoreError) -> None:
        self.error = error
        self.since = time.time()
        self.count = 1


class _Slots:
    """``concurrency`` upload slots, handed out first come first served, except that a worker of a
    store someone waits for (``hurry``: an OPEN that must load it) goes before every other."""

    def __init__(self, n: int) -> None:
        self.free = n
        self._waiting: OrderedDict[asyncio.Future[None], StoreId] = OrderedDict()
        self._urgent: OrderedDict[asyncio.Future[None], StoreId] = OrderedDict()

    async def acquire(self, store_id: StoreId, urgent: bool) -> None:
        if self.free and not self._waiting and not self._urgent:
            self.free -= 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        (self._urgent if urgent else self._waiting)[fut] = store_id
        try:
            await fut
        except asyncio.CancelledError:
            if not self._waiting.pop(fut, None) and not self._urgent.pop(fut, None) and fut.done() \
                    and not fut.cancelled():
                self.release()  # handed over just as it was cancelled: pass it on
            raise

    def release(self) -> None:
        for queue in (self._urgent, self._waiting):
            while queue:
                fut, _ = queue.popitem(last=False)
                if not fut.done():
                    fut.set_result(None)
                    return
        self.free += 1

    def hurry(self, store_id: StoreId) -> None:
        """Move the store's waiting worker, if any, before every other."""
        for fut, sid in list(self._waiting.items()):
            if sid == store_id:
                del self._waiting[fut]
                self._urgent[fut] = sid


def _close_runs(delta: Delta) -> None:
    close_runs = getattr(delta, "close_runs", None)
    if close_runs is not None:  # a flushed version's runs: read once, into the encoded file
        close_runs()


def delta_size(delta: Delta) -> int:
    """Bytes a delta is accounted for in the upload queue (its keys and values)."""
    if delta.nbytes:  # counted by the engine while it applied the commit
        return delta.nbytes + 256
    return sum(len(k) + (len(v) if v is not None else 0) + 8 for k, v in delta.records.items()) + 256


class Uploader:
    """Background, ordered, bounded uploads of deltas; see the module docstring."""

    def __init__(
        self,
        objstore_for: Callable[[str], ObjectStore],
        *,
        concurrency: int = 8,
        queue_bytes: int = 256 << 20,
        queue_count: int = 1000,
        retry_base: float = 0.05,
        retry_max: float = 5.0,
        keep_done: int = 10_000,
        encode: Callable[[Delta], bytes] = checkpoint.encode_delta,
    ) -> None:
        self._objstore_for = objstore_for
        self._slots = _Slots(concurrency)
        self._encoding = asyncio.Semaphore(ENCODE_THREADS)
        self.queue_limit = queue_bytes
        self.queue_count_limit = queue_count
        self.queued_count = 0  # deltas admitted and not finished (bounded by queue_count)
        # stores an OPEN waits for (their uploads must settle before it can load them): admitted
        # and given upload slots before every other store's
        self._urgent: set[StoreId] = set()
        self.retry_base = retry_base
        self.retry_max = retry_max
        self._keep_done = keep_done
        self._encode = encode
        self.queued_bytes = 0
        self._waiting: deque[Upload] = deque()  # not yet admitted, FIFO
        self._by_store: dict[StoreId, deque[Upload]] = {}
        self._workers: dict[StoreId, asyncio.Task[None]] = {}
        # every upload not yet trimmed, in commit order; a durable one is only ``_DURABLE``
        self._status: OrderedDict[tuple[StoreId, CheckpointRef], Upload | _Durable] = OrderedDict()
        # the keys of ``_status`` made ``_DURABLE``, oldest first: what ``_trim`` forgets first. Trimming
        # walks only what it forgets (iterating ``_status`` would hash every StoreId it holds, on each
        # upload: ~10 ms at 10,000 entries, a fifth of a busy daemon's time)
        self._durable_order: deque[tuple[StoreId, CheckpointRef]] = deque()
        self._idle = asyncio.Event()
        self._idle.set()
        # pulsed (set, then replaced) when an upload of the store changes state: wakes its waiters
        self._changed: dict[StoreId, asyncio.Event] = {}
        self._degraded: dict[str, _Degraded] = {}  # root -> why it is degraded
        self._swept: set[StoreId] = set()  # stores whose leftovers were looked for
        self._closed = False
        #: awaited with each delta before it is encoded: the commit's owner (``daemon.commits``)
        #: applies a deferred commit's changes there, on the loop (None: nothing to wait for)
        self.before_encode: Callable[[Delta], Awaitable[None]] | None = None
        #: called as ``on_durable(store_id, ref, nbytes, lineage)`` after each delta is in the object store
        self.on_durable: Callable[[StoreId, CheckpointRef, int, tuple[CheckpointRef, ...]], None] | None = None
        self.counters = {"submitted": 0, "durable": 0, "failed": 0, "retries": 0, "bytes_uploaded": 0,
                         "multipart_aborted": 0}
        #: seconds from each delta's commit (``enqueue``) to its file being durable
        self.durable_latency = Buckets(DURABLE_LATENCY_BOUNDS)

    # --- submitting -----------------------------------------------------------------------------
    async def submit(self, delta: Delta) -> None:
        """Queue ``delta`` for upload; returns once the queue has room for it (never drops it).

        Cancelling the caller does not cancel the upload.
        """
        up = self.enqueue(delta)
        if not up.admitted.is_set():
            await asyncio.shield(up.admitted.wait())

    def enqueue(self, delta: Delta) -> Upload:
        """Register ``delta`` now (ordered after earlier commits of its store); admission may wait."""
        if self._closed:
            raise InterfaceError("the uploader is closed: the daemon is stopping")
        up = Upload(delta, delta_size(delta))
        key = (up.store_id, up.ref)
        self._status[key] = up  # a second upload of the same name fails with ObjectExistsError
        self._status.move_to_end(key)
        self.counters["submitted"] += 1
        self._idle.clear()
        self._by_store.setdefault(up.store_id, deque()).append(up)
        self._waiting.append(up)
        self._admit()
        if up.store_id not in self._workers:
            self._workers[up.store_id] = asyncio.get_running_loop().create_task(self._run_store(up.store_id))
        return up

    @property
    def idle(self) -> bool:
        """True when no upload is queued or running."""
        return self._idle.is_set()

    def would_admit(self, size: int) -> bool:
        """Whether a delta of ``size`` queue bytes enqueued now is admitted at once."""
        return not self._waiting and self._has_room(size)

    def _has_room(self, size: int) -> bool:
        # an empty queue takes any delta, however large: a commit never waits forever
        return not self.queued_count or (self.queued_bytes + size <= self.queue_limit
                                         and self.queued_count < self.queue_count_limit)

    def _admit(self) -> None:
        while self._waiting:
            up = self._waiting[0]
            if not self._has_room(up.size):
                return
            self._waiting.popleft()
            self._take(up)

    def _take(self, up: Upload) -> None:
        self.queued_bytes += up.size
        self.queued_count += 1
        up.admitted.set()

    def hurry(self, store_id: StoreId) -> None:
        """An OPEN waits for the uploads of ``store_id`` (it must load the store once they are in):
        admit them now, whatever the queue holds (they are in memory already; admitting lets them
        go, and answers their COMMITs), and give the store's worker the next upload slot, so the
        OPEN does not wait behind other stores' queues. Lasts until the store's queue is empty."""
        queue = self._by_store.get(store_id)
        if not queue:
            return
        self._urgent.add(store_id)
        for up in queue:
            if not up.admitted.is_set():
                self._waiting.remove(up)
                self._take(up)
        self._slots.hurry(store_id)

    # --- the per-store worker -------------------------------------------------------------------
    async def _run_store(self, store_id: StoreId) -> None:
        queue = self._by_store[store_id]
        try:
            while queue:
                up = queue[0]
                await up.admitted.wait()
                try:
                    await self._sweep(store_id)
                    await self._upload(up)
                finally:
                    queue.popleft()
                    self.queued_bytes -= up.size
                    self.queued_count -= 1
                    up.delta = None
                    up.lineage = ()
                    up.done.set()
                    if up.state is UploadState.DURABLE and self._status.get((store_id, up.ref)) is up:
                        self._status[(store_id, up.ref)] = _DURABLE
                        self._durable_order.append((store_id, up.ref))
                    self._notify(store_id)
                    self._admit()
        finally:
            del self._workers[store_id]
            if not queue:
                del self._by_store[store_id]
                self._urgent.discard(store_id)
            if not self._workers:
                self._idle.set()
            self._trim()

    async def _sweep(self, store_id: StoreId) -> None:
        """Before the first upload to ``store_id``: abort what killed writers left in its folder."""
        if store_id in self._swept:
            return
        try:
            store = self._objstore_for(store_id.root)
            abort: Callable[[str], Awaitable[int]] | None = getattr(store, "abort_incomplete_uploads", None)
            if abort is None:
                self._swept.add(store_id)
                return
            n = await abort(store_id.prefix + "/")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # best effort: a lifecycle rule covers what stays (docs/GUARANTEES.md)
            # looked for again before the store's next upload
            log.warning("cannot look for incomplete uploads under %s/%s: %s", store_id.root, store_id.prefix, exc)
            return
        self._swept.add(store_id)
        if n:
            self.counters["multipart_aborted"] += n
            log.info("aborted %d incomplete uploads under %s/%s left by an earlier writer", n, store_id.root,
                     store_id.prefix)

    def _failed_ancestor(self, up: Upload) -> Upload | None:
        """The first upload of ``up``'s lineage that failed for good, if any."""
        status = self._status
        for r in up.lineage:
            a = status.get((up.store_id, r))
            if isinstance(a, Upload) and a.state is UploadState.FAILED:
                return a
        return None

    async def _upload(self, up: Upload) -> None:
        key = up.key
        delay = self.retry_base
        delta = up.delta  # set to None by _run_store only once this returns
        assert delta is not None
        failed = self._failed_ancestor(up)
        if failed is not None:
            # never upload a delta whose load needs a file that will not exist: it could be
            # reported durable and still not load
            self._fail(up, _dependent_error(up, failed))
            return
        try:
            if self.before_encode is not None:
                await self.before_encode(delta)  # StoreBrokenError if a deferred commit's changes fail part-way
        except BaseException as exc:
            _close_runs(delta)
            if not isinstance(exc, Exception):
                raise  # cancelled (the daemon stopping)
            self._fail(up, exc)
            return
        data: bytes | None = None  # encoded once it holds a slot: at most ``concurrency`` files wait
        root = up.store_id.root
        while True:
            up.attempts += 1
            try:
                await self._slots.acquire(up.store_id, up.store_id in self._urgent)
                try:
                    if data is None:
                        data = await self._encoded(up, delta)
                        if data is None:
                            return  # it cannot be encoded: failed, reported
                    up.state = UploadState.UPLOADING
                    store = self._objstore_for(root)
                    await create_checkpoint_file(store, up.store_id, up.ref, DELTA, data)
                finally:
                    self._slots.release()
            except _PERMANENT as exc:
                self._fail(up, exc)
                return
            except Exception as exc:  # anything else may heal: retried until the daemon stops
                self.counters["retries"] += 1
                up.error = exc
                up.state = UploadState.QUEUED
                self._attempt_failed(up, exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.retry_max)
                continue
            up.state = UploadState.DURABLE
            up.error = None
            # observed first: a scrape that sees the delta counted durable sees its latency too
            self.durable_latency.observe(time.monotonic() - up.enqueued)
            self.counters["durable"] += 1
            self.counters["bytes_uploaded"] += len(data)
            self._healed(root)
            log.debug("uploaded %s (%d bytes)", key, len(data))
            if self.on_durable is not None:
                try:
                    self.on_durable(up.store_id, up.ref, len(data), delta.lineage)
                except Exception:  # a listener must never break uploads
                    log.exception("on_durable listener failed for %s", key)
            return

    async def _encoded(self, up: Upload, delta: Delta) -> bytes | None:
        """The delta's file, encoded in a thread, ``ENCODE_THREADS`` at a time (encoding is CPU work:
        more at once only adds their buffers to the daemon's memory); None when it cannot be
        encoded (reported as the upload's failure, never retried)."""
        try:
            async with self._encoding:
                return await asyncio.to_thread(self._encode, delta)
        except Exception as exc:  # an engine delta that cannot be encoded: report, never loop
            self._fail(up, exc)
            return None
        finally:
            _close_runs(delta)

    def _attempt_failed(self, up: Upload, exc: Exception, delay: float) -> None:
        root = up.store_id.root
        if isinstance(exc, _DEGRADING):
            deg = self._degraded.get(root)
            if deg is None:
                self._degraded[root] = _Degraded(exc)
                log.error("object store %s is degraded: %s: %s; uploads are retried, waiters get this error "
                          "until one succeeds", root, type(exc).__name__, exc)
                self._notify_root(root)
            else:
                deg.error, deg.count = exc, deg.count + 1
            log.debug("upload of %s failed (attempt %d), retrying in %.2fs: %s", up.key, up.attempts, delay, exc)
        elif isinstance(exc, ObjectStoreError):
            log.warning("upload of %s failed (attempt %d), retrying in %.2fs: %s", up.key, up.attempts, delay, exc)
        else:  # not an object-store error: unexpected, so loud (with its traceback), and retried
            log.error("upload of %s failed (attempt %d), retrying in %.2fs: %s: %s", up.key, up.attempts, delay,
                      type(exc).__name__, exc, exc_info=exc)
        self._notify(up.store_id)

    def _healed(self, root: str) -> None:
        deg = self._degraded.pop(root, None)
        if deg is not None:
            log.warning("object store %s is healthy again (it had refused %d attempts since %s)", root, deg.count,
                        time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(deg.since)))
            self._notify_root(root)

    def _fail(self, up: Upload, exc: BaseException) -> None:
        up.state = UploadState.FAILED
        up.error = _typed(up, exc)
        self.counters["failed"] += 1
        log.error("upload of %s failed for good: %s: %s", up.key, type(up.error).__name__, up.error)
        self._notify(up.store_id)

    def _notify(self, store_id: StoreId) -> None:
        ev = self._changed.pop(store_id, None)
        if ev is not None:
            ev.set()

    def _notify_root(self, root: str) -> None:
        for store_id in [s for s in self._changed if s.root == root]:
            self._notify(store_id)

    def _trim(self) -> None:
        """Forget the oldest durable entries beyond ``keep_done`` (failed ones are kept)."""
        excess = len(self._status) - self._keep_done
        order, status = self._durable_order, self._status
        while excess > 0 and order:
            key = order.popleft()
            if status.get(key) is _DURABLE:  # else forgotten already, or uploaded again since
                del status[key]
                excess -= 1

    # --- durability -----------------------------------------------------------------------------
    def state(self, store_id: StoreId, ref: CheckpointRef) -> UploadState | None:
        """What this uploader knows of (store, ref): None when it never uploaded it (or forgot it)."""
        up = self._status.get((store_id, ref))
        return up.state if up is not None else None

    def error(self, store_id: StoreId, ref: CheckpointRef) -> BaseException | None:
        up = self._status.get((store_id, ref))
        return up.error if up is not None else None

    def pending(self, store_id: StoreId) -> int:
        """Uploads of ``store_id`` not finished yet."""
        q = self._by_store.get(store_id)
        return len(q) if q else 0

    def pending_ref(self, store_id: StoreId, ref: CheckpointRef) -> bool:
        """Whether the upload of ``ref`` of ``store_id`` is queued or running."""
        up = self._status.get((store_id, ref))
        return isinstance(up, Upload) and not up.finished

    async def wait_settled(self, store_id: StoreId, timeout: float | None = None) -> bool:
        """Return once no upload of ``store_id`` is queued or running (each ends durable or failed):
        True; False when ``timeout`` seconds passed first."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while self.pending(store_id):
            ev = self._changed.get(store_id)
            if ev is None:
                ev = self._changed[store_id] = asyncio.Event()
            if deadline is None:
                await ev.wait()
                continue
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            try:
                await asyncio.wait_for(ev.wait(), remaining)
            except TimeoutError:
                return not self.pending(store_id)
        return True

    def refusal(self, root: str) -> ObjectStoreError | None:
        """The error a degraded ``root`` refuses uploads with (None when it is not degraded)."""
        deg = self._degraded.get(root)
        return deg.error if deg is not None else None

    def last_error(self, store_id: StoreId) -> BaseException | None:
        """The last failed attempt's error of the store's oldest pending upload (None: none failed)."""
        q = self._by_store.get(store_id)
        return q[0].error if q else None

    def will_settle(self, store_id: StoreId, ref: CheckpointRef) -> bool:
        """True unless ``ref`` of ``store_id`` failed for good: it is durable, unknown here, or on
        its way (its files will all be in the object store)."""
        return self.state(store_id, ref) is not UploadState.FAILED

    def is_settled(self, store_id: StoreId, ref: CheckpointRef) -> bool:
        """True when nothing of the store is queued and ``ref`` is not a failed or pending upload."""
        if self.pending(store_id):
            return False
        st = self.state(store_id, ref)
        return st is None or st is UploadState.DURABLE

    def verdict(self, store_id: StoreId, ref: CheckpointRef) -> bool | None:
        """True when ``ref`` is durable (and so loadable), None while it may still become durable,
        False when this uploader does not know it; raises the typed error when it will not become
        durable or its root is degraded."""
        up = self._status.get((store_id, ref))
        if up is None:
            return False
        if up.state is UploadState.DURABLE:
            return True
        assert isinstance(up, Upload)  # only a durable upload is kept as _DURABLE
        if up.state is UploadState.FAILED:
            assert isinstance(up.error, StateStoreError)  # _fail types it
            raise up.error
        failed = self._failed_ancestor(up)
        if failed is not None:
            raise _dependent_error(up, failed)
        deg = self._degraded.get(store_id.root)
        if deg is not None:
            raise type(deg.error)(f"{store_id} at {ref} is not durable: the object store refuses this daemon's "
                                  f"uploads: {deg.error}", up.key)
        return None

    async def wait_durable(self, store_id: StoreId, ref: CheckpointRef, timeout: float) -> bool:
        """True once the delta of ``ref`` is durable; False on timeout or when it is unknown here.

        Raises the typed error as soon as ``ref`` will not become durable (its upload, or one its
        lineage needs, failed for good; the daemon stopped first) or its root is degraded.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            v = self.verdict(store_id, ref)
            if v is not None:
                return v
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            ev = self._changed.get(store_id)
            if ev is None:
                ev = self._changed[store_id] = asyncio.Event()
            try:
                await asyncio.wait_for(ev.wait(), remaining)
            except TimeoutError:
                return bool(self.verdict(store_id, ref))

    async def drain(self, timeout: float | None = None) -> bool:
        """Wait until every queued upload has finished (or ``timeout``); True if all did."""
        if self._idle.is_set():
            return True  # also with no time left (a wait of 0 s would time out)
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    async def close(self) -> None:
        """Cancel the workers (call ``drain`` first to keep queued uploads): every upload not
        finished fails with ``UploadFailedError`` (its waiters are answered) and is listed by
        ``not_durable``. Nothing can be submitted afterwards."""
        self._closed = True
        tasks = list(self._workers.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for up in self._status.values():
            if isinstance(up, Upload) and not up.finished:
                why = f": the last attempt failed with {type(up.error).__name__}: {up.error}" if up.error else ""
                up.state = UploadState.FAILED
                up.error = UploadFailedError(f"{up.key} was not uploaded before the daemon stopped{why}", up.key)
                up.delta = None
                up.lineage = ()
                up.done.set()
                self.counters["failed"] += 1
        for store_id in list(self._changed):
            self._notify(store_id)

    def not_durable(self) -> list[tuple[StoreId, CheckpointRef, BaseException | None]]:
        """Every acknowledged commit this uploader knows of that is not durable (pending or failed),
        in commit order, with its error."""
        return [(up.store_id, up.ref, up.error) for up in self._status.values() if isinstance(up, Upload)
                and up.state is not UploadState.DURABLE]

    def degraded(self) -> dict[str, dict[str, Any]]:
        """Degraded roots: the error that degraded each, since when (epoch seconds), how many
        attempts it refused, and how many uploads wait there."""
        out: dict[str, dict[str, Any]] = {}
        for root, deg in self._degraded.items():
            waiting = sum(len(q) for sid, q in self._by_store.items() if sid.root == root)
            out[root] = {"error": type(deg.error).__name__, "message": str(deg.error), "since": round(deg.since, 3),
                         "refused": deg.count, "uploads_waiting": waiting}
        return out

    def lag(self) -> float:
        """Seconds since the oldest delta not yet durable was committed (queued, waiting for
        admission or uploading; one that failed for good is not waiting): 0 when none is. O(stores)."""
        now = time.monotonic()
        oldest = now
        # read by the metrics endpoint's thread while the loop changes the queues: copy, then look
        for queue in list(self._by_store.values()):
            try:
                oldest = min(oldest, queue[0].enqueued)  # each store's queue is in commit order
            except IndexError:  # emptied meanwhile
                continue
        return now - oldest

    def stats(self) -> dict[str, Any]:
        states = {s.value: 0 for s in UploadState}
        for up in list(self._status.values()):  # a copy: the metrics endpoint reads this from its thread
            states[up.state.value] += 1
        return {
            "queued_bytes": self.queued_bytes,
            "queue_limit": self.queue_limit,
            "queued_count": self.queued_count,
            "queue_count_limit": self.queue_count_limit,
            "stores_hurried": len(self._urgent),
            "waiting_admission": len(self._waiting),
            "stores_uploading": len(self._workers),
            "states": states,
            "degraded_roots": len(self._degraded),
            "lag_seconds": round(self.lag(), 6),
            "durable_latency": self.durable_latency.stats(),
            **self.counters,
        }


def _typed(up: Upload, exc: BaseException) -> StateStoreError:
    """The error a failed upload is answered with: typed, naming the file."""
    if isinstance(exc, ObjectStoreError) and exc.key == up.key:
        return exc
    return UploadFailedError(f"the upload of {up.key} failed for good: {type(exc).__name__}: {exc}", up.key)


def _dependent_error(up: Upload, failed: Upload) -> UploadFailedError:
    return UploadFailedError(
        f"{up.store_id} at {up.ref} cannot become durable: its lineage needs {failed.key}, whose upload failed "
        f"for good ({type(failed.error).__name__}: {failed.error})", failed.key)
