"""``Uploader``: makes committed deltas durable in the background (DESIGN §7).

``submit(delta)`` registers the delta at once (its durability is queryable from then on) and
returns as soon as the upload queue has room for it: when ``queue_bytes`` are already waiting,
commits wait (back-pressure) — a delta is never dropped. A background task per store encodes
each delta (``checkpoint.encode_delta``, in a worker thread) and writes it with ``put_if_absent``,
in commit order, with at most ``concurrency`` uploads at a time across stores. An
``ObjectStoreError`` is retried with exponential backoff, except ``ObjectExistsError``: the name is
taken, which must never happen for a fresh checkpoint id, so the upload fails and the error is
reported (never overwritten).
"""
from __future__ import annotations

import asyncio
import enum
import logging
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

from statestore_async.engine.store import Delta
from statestore_async.errors import ObjectExistsError, ObjectStoreError
from statestore_async.files import checkpoint
from statestore_async.files.names import DELTA, file_key
from statestore_async.files.transfer import create_checkpoint_file
from statestore_async.ids import CheckpointRef, StoreId
from statestore_async.objectstore.base import ObjectStore

log = logging.getLogger(__name__)


class UploadState(enum.Enum):
    QUEUED = "queued"
    UPLOADING = "uploading"
    DURABLE = "durable"
    FAILED = "failed"


class _Upload:
    __slots__ = ("admitted", "attempts", "delta", "done", "error", "ref", "size", "state", "store_id")

    def __init__(self, delta: Delta, size: int) -> None:
        self.store_id: StoreId = delta.store_id
        self.ref: CheckpointRef = delta.ref
        self.delta: Delta | None = delta  # None once the upload is finished
        self.size = size
        self.state = UploadState.QUEUED
        self.error: BaseException | None = None
        self.attempts = 0
        self.admitted = asyncio.Event()
        self.done = asyncio.Event()


# How long a COMMIT answered before its changes were applied leaves them pending: the event loop
# sleeps in between, so the client woken by the answer — often onto the daemon's own core — runs
# first (see server._Connection._commit). One timer tick of uvloop (milliseconds).
DEFERRED_APPLY_DELAY = 0.001


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
        retry_base: float = 0.05,
        retry_max: float = 5.0,
        keep_done: int = 100_000,
        encode: Callable[[Delta], bytes] = checkpoint.encode_delta,
    ) -> None:
        self._objstore_for = objstore_for
        self._sem = asyncio.Semaphore(concurrency)
        self.queue_limit = queue_bytes
        self.retry_base = retry_base
        self.retry_max = retry_max
        self._keep_done = keep_done
        self._encode = encode
        self.queued_bytes = 0
        self._waiting: deque[_Upload] = deque()  # not yet admitted, FIFO
        self._by_store: dict[StoreId, deque[_Upload]] = {}
        self._workers: dict[StoreId, asyncio.Task[None]] = {}
        self._status: OrderedDict[tuple[StoreId, CheckpointRef], _Upload] = OrderedDict()
        self._idle = asyncio.Event()
        self._idle.set()
        #: called as ``on_durable(store_id, ref, nbytes, lineage)`` after each delta is in the object store
        self.on_durable: Callable[[StoreId, CheckpointRef, int, tuple[CheckpointRef, ...]], None] | None = None
        self.counters = {"submitted": 0, "durable": 0, "failed": 0, "retries": 0, "bytes_uploaded": 0}

    # --- submitting -----------------------------------------------------------------------------
    async def submit(self, delta: Delta) -> None:
        """Queue ``delta`` for upload; returns once the queue has room for it (never drops it).

        Cancelling the caller does not cancel the upload.
        """
        up = self.enqueue(delta)
        if not up.admitted.is_set():
            await asyncio.shield(up.admitted.wait())

    def enqueue(self, delta: Delta) -> _Upload:
        """Register ``delta`` now (ordered after earlier commits of its store); admission may wait."""
        up = _Upload(delta, delta_size(delta))
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
        return not self.queued_bytes or self.queued_bytes + size <= self.queue_limit

    def _admit(self) -> None:
        while self._waiting:
            up = self._waiting[0]
            if not self._has_room(up.size):
                return
            self._waiting.popleft()
            self.queued_bytes += up.size
            up.admitted.set()

    # --- the per-store worker -------------------------------------------------------------------
    async def _run_store(self, store_id: StoreId) -> None:
        queue = self._by_store[store_id]
        try:
            while queue:
                up = queue[0]
                await up.admitted.wait()
                try:
                    await self._upload(up)
                finally:
                    queue.popleft()
                    self.queued_bytes -= up.size
                    up.delta = None
                    up.done.set()
                    self._admit()
        finally:
            del self._workers[store_id]
            if not queue:
                del self._by_store[store_id]
            if not self._workers:
                self._idle.set()
            self._trim()

    async def _upload(self, up: _Upload) -> None:
        key = file_key(up.store_id, up.ref, DELTA)
        delay = self.retry_base
        delta = up.delta  # set to None by _run_store only once this returns
        assert delta is not None
        if not getattr(delta, "applied", True):
            # a deferred commit (the daemon answered it before applying its changes to the map):
            # give the loop the time to sleep first, as the daemon does, then apply it here on the
            # loop if that has not happened yet — never in the encoding thread
            await asyncio.sleep(DEFERRED_APPLY_DELAY)
            delta.apply()
        try:
            data = await asyncio.to_thread(self._encode, delta)
        except Exception as exc:  # an engine delta that cannot be encoded: report, never loop
            self._fail(up, exc, key)
            return
        while True:
            up.attempts += 1
            try:
                async with self._sem:
                    up.state = UploadState.UPLOADING
                    store = self._objstore_for(up.store_id.root)
                    await create_checkpoint_file(store, up.store_id, up.ref, DELTA, data)
            except ObjectExistsError as exc:
                self._fail(up, exc, key)
                return
            except ObjectStoreError as exc:
                self.counters["retries"] += 1
                up.error = exc
                up.state = UploadState.QUEUED
                log.warning("upload of %s failed (attempt %d), retrying in %.2fs: %s", key, up.attempts, delay, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.retry_max)
                continue
            except Exception as exc:
                self._fail(up, exc, key)
                return
            up.state = UploadState.DURABLE
            up.error = None
            self.counters["durable"] += 1
            self.counters["bytes_uploaded"] += len(data)
            log.debug("uploaded %s (%d bytes)", key, len(data))
            if self.on_durable is not None:
                try:
                    self.on_durable(up.store_id, up.ref, len(data), delta.lineage)
                except Exception:  # a listener must never break uploads
                    log.exception("on_durable listener failed for %s", key)
            return

    def _fail(self, up: _Upload, exc: BaseException, key: str) -> None:
        up.state = UploadState.FAILED
        up.error = exc
        self.counters["failed"] += 1
        log.error("upload of %s failed for good: %s", key, exc)

    def _trim(self) -> None:
        """Forget the oldest durable entries beyond ``keep_done`` (failed ones are kept)."""
        excess = len(self._status) - self._keep_done
        if excess <= 0:
            return
        for key in list(self._status):
            if excess <= 0:
                break
            if self._status[key].state is UploadState.DURABLE:
                del self._status[key]
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

    def is_settled(self, store_id: StoreId, ref: CheckpointRef) -> bool:
        """True when nothing of the store is queued and ``ref`` is not a failed or pending upload."""
        if self.pending(store_id):
            return False
        st = self.state(store_id, ref)
        return st is None or st is UploadState.DURABLE

    async def wait_durable(self, store_id: StoreId, ref: CheckpointRef, timeout: float) -> bool:
        """True once the delta of ``ref`` is durable; False on timeout or when it is unknown here.

        A failed upload raises its error.
        """
        up = self._status.get((store_id, ref))
        if up is None:
            return False
        if not up.done.is_set():
            try:
                await asyncio.wait_for(asyncio.shield(up.done.wait()), timeout)
            except TimeoutError:
                return False
        if up.state is UploadState.FAILED:
            assert up.error is not None  # _fail always sets it
            raise up.error
        return up.state is UploadState.DURABLE

    async def drain(self, timeout: float | None = None) -> bool:
        """Wait until every queued upload has finished (or ``timeout``); True if all did."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    async def close(self) -> None:
        """Cancel the workers (call ``drain`` first to keep queued uploads)."""
        tasks = list(self._workers.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def stats(self) -> dict[str, Any]:
        states = {s.value: 0 for s in UploadState}
        for up in self._status.values():
            states[up.state.value] += 1
        return {
            "queued_bytes": self.queued_bytes,
            "queue_limit": self.queue_limit,
            "waiting_admission": len(self._waiting),
            "stores_uploading": len(self._workers),
            "states": states,
            **self.counters,
        }
