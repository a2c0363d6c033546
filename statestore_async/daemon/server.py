"""The daemon: serves the stores of one node to its Python workers over a Unix socket
(docs/ARCHITECTURE.md, "The daemon" and "The wire protocol").

``Daemon`` owns the ``StoreRegistry`` and the ``Uploader`` and listens on ``config.socket`` (no
TCP). Each connection is an ``asyncio.Protocol`` that feeds a sans-IO ``ServerProtocol``:

* requests that touch only memory (GET/PUT/REMOVE/ABORT/PING/STATS, an OPEN served from memory,
  a COMMIT the upload queue has room for) are answered inline, in the order they arrived;
* the others (an OPEN that loads, a COMMIT waiting for queue room, SCAN streaming, AWAIT_DURABLE)
  run as tasks; at most ``max_inflight`` per connection — beyond that the connection stops reading
  (back-pressure), as it does while the peer does not read its answers;
* a peer whose uid (SO_PEERCRED) is not allowed gets a ``PermissionDeniedError`` frame and a close;
* a peer that goes away has its open versions aborted.

``stop()`` (SIGTERM/SIGINT under ``run``): stop listening, let the connections finish what they have
open or in flight (OPEN refused) while the uploader drains, then close them, all within
``drain_timeout``. ``serve`` exits 0 only when every
acknowledged commit is durable; otherwise it logs the versions that are not and exits
``EXIT_NOT_DURABLE``.

``health()`` (in STATS, read by ``statestore-async health``): ``ok``, ``stopping``, or ``degraded``
with the reasons — an object-store root that refuses uploads in a way retrying does not heal.
"""
from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import signal
import stat
import struct
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Iterable
from typing import TYPE_CHECKING, Any, Self, cast

from statestore_async import __version__
from statestore_async.codecs.packed import PackedList
from statestore_async.config import DaemonConfig
from statestore_async.daemon import payloads
from statestore_async.daemon.commits import Commits
from statestore_async.daemon.maintenance import Maintenance
from statestore_async.daemon.metrics import COMMIT_LATENCY_BOUNDS, Buckets, start_metrics
from statestore_async.daemon.objectstores import ObjectStores, open_root
from statestore_async.daemon.registry import StoreRegistry
from statestore_async.daemon.snapshotter import SnapshotWorker
from statestore_async.daemon.unixsocket import peer_credentials, prepare_socket_path
from statestore_async.daemon.uploader import Uploader
from statestore_async.engine.store import State, StoreVersion
from statestore_async.errors import (
    FrameBudgetError,
    ObjectStoreError,
    StateStoreError,
    StoreStateError,
    VersionIdleTimeoutError,
)
from statestore_async.files.names import DELTA, SNAPSHOT, file_key
from statestore_async.ids import CheckpointRef, StoreId
from statestore_async.objectstore.base import ObjectStore
from statestore_async.objectstore.s3 import warm_up as s3_warm_up
from statestore_async.wire.protocol import (
    CLOSED,
    NEED_DATA,
    Abort,
    AwaitDurable,
    BadRequest,
    Commit,
    ConnectionFailed,
    GetMany,
    Hello,
    Op,
    Open,
    PermissionDeniedError,
    Ping,
    PutMany,
    Release,
    RemoveMany,
    Scan,
    ScanRanges,
    ServerProtocol,
    ShuttingDownError,
    Stats,
    UnknownHandleError,
)

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

GIL_SWITCH_INTERVAL = 0.0005
# The memory budget is checked this long after a commit, off the request's path: summing every
# store's memory costs O(stores), and a burst of commits needs one check, not one each.
BUDGET_CHECK_DELAY = 0.05
# at most one malloc_trim (give_back_free_pages) per this many seconds, after evictions
TRIM_INTERVAL = 1.0
# With exit_when_idle, a daemon idle that long but with an upload still running looks again this often.
IDLE_RECHECK = 1.0
# Open versions are checked against open_version_idle_timeout every quarter of it, and at least
# every IDLE_SWEEP_MAX seconds: one is aborted at most that much later than the limit.
IDLE_SWEEP_MAX = 5.0
# serve's exit code when it stopped with acknowledged commits not durable (drain timed out, uploads
# failed): they are lost unless the client side replays them (docs/GUARANTEES.md)
EXIT_NOT_DURABLE = 3
# versions listed per store in the log line of a stop that left commits not durable
LIST_NOT_DURABLE = 200
# while stopping, how often the drain looks whether the connections and uploads are done
DRAIN_POLL = 0.02

log = logging.getLogger("statestore_async.daemon")

SCAN_CHUNK_ITEMS = 4096
SCAN_CHUNK_BYTES = 1 << 20
MAX_FINISHED_HANDLES = 256
_OPCODE = {Hello: Op.HELLO, Ping: Op.PING, Open: Op.OPEN, GetMany: Op.GET_MANY, PutMany: Op.PUT_MANY,
           RemoveMany: Op.REMOVE_MANY, Scan: Op.SCAN, ScanRanges: Op.SCAN_RANGES, Commit: Op.COMMIT, Abort: Op.ABORT,
           AwaitDurable: Op.AWAIT_DURABLE, Stats: Op.STATS, Release: Op.RELEASE}


# A connection whose partial frame waited this long for room in the shared budget
# (``partial_frames_bytes``): the frames holding it that sent nothing for as long are refused with
# FrameBudgetError and closed; with none such, the waiting one is.
PARTIAL_FRAME_WAIT = 30.0


# --- partial frames --------------------------------------------------------------------------------
class FramePool:
    """The byte budget that the frames still arriving on all connections share
    (``partial_frames_bytes``).

    A connection whose buffer ends inside a frame holds room for that frame's whole payload (known
    from its header) until the frame completes or the connection goes. One that cannot get the room
    stops reading (so it buffers at most what one read brought) and waits, first come first served;
    room is handed over as frames complete or their connections go. Holding whole frames, never
    parts, means a frame that got its room can always complete: no two half-read frames wait for
    each other."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.used = 0
        self._waiting: OrderedDict[_Connection, int] = OrderedDict()
        self.counters = {"partial_frame_waits": 0, "partial_frames_refused": 0}

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def take(self, n: int) -> bool:
        """Take ``n`` bytes now if they fit and nobody waits before."""
        if self._waiting or self.used + n > self.budget:
            return False
        self.used += n
        return True

    def give(self, n: int) -> None:
        self.used -= n
        self._hand_over()

    def wait(self, conn: _Connection, n: int) -> None:
        """``conn`` waits for ``n`` bytes: ``conn.frame_room(n)`` once they are its (waiting
        already, it keeps its place in line and now waits for ``n``)."""
        if conn not in self._waiting:
            self.counters["partial_frame_waits"] += 1
        self._waiting[conn] = n

    def is_waiting(self, conn: _Connection) -> bool:
        return conn in self._waiting

    def cancel(self, conn: _Connection) -> None:
        if self._waiting.pop(conn, None) is not None:
            self._hand_over()

    def _hand_over(self) -> None:
        waiting = self._waiting
        while waiting:
            conn, n = next(iter(waiting.items()))
            if self.used + n > self.budget:
                return
            del waiting[conn]
            self.used += n
            conn.frame_room(n)


# --- one connection -------------------------------------------------------------------------------
class _Finished:
    """A handle its connection committed or aborted, or the daemon aborted after ``idle_limit``
    seconds without a request: what a late request on it is told. It keeps the store's id, never
    the store (nor the version's changes)."""

    __slots__ = ("idle_limit", "state", "store_id", "version")

    def __init__(self, w: StoreVersion, idle_limit: float | None = None) -> None:
        self.store_id = w.store_id
        self.version = w.version
        self.state = w.state
        self.idle_limit = idle_limit

    def error(self, op: str) -> StateStoreError:
        if self.idle_limit is not None:
            return VersionIdleTimeoutError(
                f"cannot {op} store {self.store_id} version {self.version}: the daemon aborted it after "
                f"{self.idle_limit:g} s without a request (open_version_idle_timeout); its changes are gone, "
                "open the store again")
        # the engine's words for a finished version
        return StoreStateError(f"cannot {op} store {self.store_id} version {self.version}: "
                               f"it is already {self.state.value}")


class _Connection(asyncio.Protocol):
    #: set by ``connection_made``, which asyncio calls before any other callback
    transport: asyncio.Transport

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        cfg = daemon.config
        self.proto = ServerProtocol(max_frame_bytes=cfg.max_frame_bytes, max_batch=cfg.max_batch)
        self.max_inflight = cfg.max_inflight
        self.peer: tuple[int, int, int] | None = None
        self.closed = False
        self.handles: dict[int, StoreVersion] = {}  # the versions this connection has open (UPDATING)
        self._touched: dict[int, float] = {}  # open handle -> time.monotonic() of its last request
        self._next_handle = 0
        # the last MAX_FINISHED_HANDLES handles it committed or aborted, oldest first: what is needed
        # to answer a late request on one with the right error, and nothing that keeps a store alive
        self._finished: OrderedDict[int, _Finished] = OrderedDict()
        self._tasks: set[asyncio.Task[None]] = set()
        self._reading_paused = False
        self._write_ok = asyncio.Event()
        self._write_ok.set()
        self._frame_bytes = 0  # room held in the daemon's FramePool for the frame arriving
        self._last_data = time.monotonic()  # when the peer last sent anything
        self._frame_wait: asyncio.TimerHandle | None = None  # set while waiting for that room

    @property
    def open_versions(self) -> int:
        """Versions this connection has open for update (each holds its store's writer slot)."""
        return len(self.handles)

    # -- transport callbacks --
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # a Unix stream socket's
        self.transport = transport
        d = self.daemon
        try:
            pid, uid, gid = peer_credentials(transport.get_extra_info("socket"))
        except (OSError, AttributeError, struct.error) as exc:
            pid = uid = gid = -1
            log.warning("cannot read peer credentials: %s", exc)
        self.peer = (pid, uid, gid)
        if uid not in d.allowed_uids:
            d.counters["refused"] += 1
            log.warning("refused connection from pid %s uid %s (allowed: %s)", pid, uid, d.allowed_uids)
            transport.write(self.proto.send_error(0, Op.HELLO, PermissionDeniedError(
                f"uid {uid} is not allowed to use this daemon")))
            self.closed = True
            transport.close()
            return
        if d.stopping:
            transport.write(self.proto.send_error(0, Op.HELLO, ShuttingDownError("the daemon is stopping")))
            self.closed = True
            transport.close()
            return
        d.connections.add(self)
        d.counters["connections"] += 1
        d.watch_idle()
        log.debug("connection from pid %s uid %s", pid, uid)

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        self.proto.receive_data(data)
        self._last_data = time.monotonic()
        self._hold_partial_frame()
        self._process()

    # -- partial frames: room in the daemon's FramePool --
    def _hold_partial_frame(self) -> None:
        """Hold room in the shared budget for the frame the buffer ends in (none: give it back);
        without room, stop reading and wait for it."""
        partial = self.proto.partial_frame()
        need = partial[0] if partial is not None else 0
        held = self._frame_bytes
        pool = self.daemon.frame_pool
        if need <= held:
            if need < held:
                self._frame_bytes = need
                pool.give(held - need)
            return
        assert partial is not None
        if need > pool.budget:
            self._refuse_frame(partial, f"a frame of {need} bytes is larger than the {pool.budget} bytes all partial "
                                        "frames may hold (partial_frames_bytes); send smaller batches or raise it")
            return
        if self._frame_wait is not None:  # waiting already (data read before the pause took)
            pool.wait(self, need - held)  # the same place in line, for what it needs now
            return
        if pool.take(need - held):
            self._frame_bytes = need
            return
        pool.wait(self, need - held)
        self._frame_wait = asyncio.get_running_loop().call_later(PARTIAL_FRAME_WAIT, self._frame_wait_expired)
        if not self._reading_paused:
            self._reading_paused = True
            self.transport.pause_reading()

    def frame_room(self, n: int) -> None:
        """The pool gave this connection the room its partial frame waited for: read on."""
        self._frame_bytes += n
        if self._frame_wait is not None:
            self._frame_wait.cancel()
            self._frame_wait = None
        if not self.closed:
            # called from another connection's callback: this one reads on once that returns
            asyncio.get_running_loop().call_soon(self._process)

    def _frame_wait_expired(self) -> None:
        """This connection waited ``PARTIAL_FRAME_WAIT`` for room. The frames holding it whose
        connections sent nothing for as long (stalled mid-frame: a worker stopped, a peer gone
        without a close) are refused and their room handed on, and this one waits on; when none
        is stalled, this one is refused."""
        self._frame_wait = None
        if self.closed:
            return
        pool = self.daemon.frame_pool
        now = time.monotonic()
        # (one whose reading the daemon paused — requests in flight, answers unread — is not stalled)
        stalled = [c for c in self.daemon.connections
                   if c._frame_bytes and not c.closed and not c._reading_paused
                   and now - c._last_data >= PARTIAL_FRAME_WAIT]
        if stalled:
            for c in stalled:
                c._refuse_frame(c.proto.partial_frame() or (0, 0, 0),
                                f"its frame sent nothing for {now - c._last_data:.0f} s while other connections "
                                f"waited for its room among the partial frames (partial_frames_bytes)")
            if pool.is_waiting(self):  # their room was not enough yet: wait on
                self._frame_wait = asyncio.get_running_loop().call_later(PARTIAL_FRAME_WAIT,
                                                                         self._frame_wait_expired)
            return
        pool.cancel(self)
        partial = self.proto.partial_frame() or (0, 0, 0)
        self._refuse_frame(partial, f"its frame of {partial[0]} bytes waited {PARTIAL_FRAME_WAIT:g} s for room among "
                                    f"the partial frames of other connections ({pool.used} of {pool.budget} bytes, "
                                    "partial_frames_bytes); send smaller batches, or raise it")

    def _refuse_frame(self, partial: tuple[int, int, int], why: str) -> None:
        """Answer the frame in progress with ``FrameBudgetError`` and close (the stream cannot be
        resynchronised without reading the frame)."""
        _size, opcode, rid = partial
        self.daemon.frame_pool.counters["partial_frames_refused"] += 1
        self.daemon.counters["errors"] += 1
        log.warning("closing connection of %s (pid, uid, gid): %s", self.peer, why)
        self._write(self.proto.send_error(rid, opcode, FrameBudgetError(why)))
        self.closed = True
        self.proto.discard()
        self.transport.close()
        if self._frame_bytes:  # its room goes to the next in line now, not when the close completes
            held, self._frame_bytes = self._frame_bytes, 0
            self.daemon.frame_pool.give(held)

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.daemon.connections.discard(self)
        self.daemon.watch_idle()
        # what the peer sent and nobody will read goes now, not when a cycle of this object is
        # collected (a client killed mid-frame left up to a frame of memory for tens of seconds)
        self.proto.discard()
        pool = self.daemon.frame_pool
        pool.cancel(self)
        if self._frame_wait is not None:
            self._frame_wait.cancel()
            self._frame_wait = None
        if self._frame_bytes:
            held, self._frame_bytes = self._frame_bytes, 0
            pool.give(held)
        for w in self.handles.values():
            if w.state is State.UPDATING:
                w.abort()
                self.daemon.counters["aborted_on_disconnect"] += 1
                log.info("peer %s went away: aborted its open version of %s at %s", self.peer, w.store_id, w.version)
        self.handles.clear()
        self._touched.clear()
        self._finished.clear()
        for t in list(self._tasks):
            if not getattr(t, "keep_on_close", False):
                t.cancel()
        self._write_ok.set()

    def pause_writing(self) -> None:
        self._write_ok.clear()

    def resume_writing(self) -> None:
        self._write_ok.set()
        self._process()

    # -- request flow --
    def _process(self) -> None:
        proto = self.proto
        tasks = self._tasks
        while not self.closed:
            if len(tasks) >= self.max_inflight or not self._write_ok.is_set():
                if not self._reading_paused:
                    self._reading_paused = True
                    self.transport.pause_reading()
                return
            ev = proto.next_event()
            if ev is NEED_DATA or ev is CLOSED:
                break
            self._handle(ev)
        if self._reading_paused and not self.closed and self._frame_wait is None:
            self._reading_paused = False
            self.transport.resume_reading()

    def _write(self, data: bytes) -> None:
        if not self.closed:
            self.transport.write(data)

    def _writelines(self, parts: Iterable[bytes]) -> None:
        if not self.closed:
            self.transport.writelines(parts)

    def _spawn(self, coro: Coroutine[Any, Any, None], *, keep_on_close: bool = False) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        t.keep_on_close = keep_on_close  # type: ignore[attr-defined]  # read back by connection_lost
        self._tasks.add(t)
        self.daemon.note_inflight(len(self._tasks))
        t.add_done_callback(self._task_done)

    def _task_done(self, t: asyncio.Task[None]) -> None:
        self._tasks.discard(t)
        if not t.cancelled() and t.exception() is not None:
            log.error("request task failed", exc_info=t.exception())
        if not self.closed:
            self._process()

    def _writer(self, handle: int, op: str) -> StoreVersion:
        """The open version of ``handle``; for a finished one, the error ``op`` on it gets."""
        w = self.handles.get(handle)
        if w is None:
            finished = self._finished.get(handle)
            if finished is not None:
                raise finished.error(op)
            raise UnknownHandleError(f"handle {handle} was not opened on this connection")
        self._touched[handle] = time.monotonic()
        return w

    def _finish(self, handle: int, w: StoreVersion) -> None:
        """``handle``'s version is committed or aborted: forget it but for a small tombstone."""
        self._forget(handle, _Finished(w))

    def _forget(self, handle: int, tombstone: _Finished) -> None:
        self.handles.pop(handle, None)
        self._touched.pop(handle, None)
        finished = self._finished
        finished[handle] = tombstone
        if len(finished) > MAX_FINISHED_HANDLES:
            finished.popitem(last=False)

    def expire_idle(self, now: float, limit: float) -> int:
        """Abort the open versions without a request for ``limit`` seconds (the peer stalled, maybe
        mid-frame): their stores' writer slots are freed, and the next request on one is told why
        (``VersionIdleTimeoutError``). Returns how many."""
        expired = [(h, now - t) for h, t in self._touched.items() if now - t >= limit]
        for handle, idle in expired:
            w = self.handles[handle]
            w.abort()
            self._forget(handle, _Finished(w, limit))
            log.warning("aborted the open version of %s at %s of peer %s (pid, uid, gid): no request for "
                        "%.1f s (open_version_idle_timeout = %g s)", w.store_id, w.version, self.peer, idle, limit)
        return len(expired)

    def _handle(self, ev: Any) -> None:  # a request event, dispatched on its exact class (not narrowed)
        d = self.daemon
        proto = self.proto
        cls = ev.__class__
        rid = ev.request_id
        d.count_request(cls)
        try:
            if cls is GetMany:
                keys = ev.keys
                if type(keys) is PackedList:
                    self._writelines(proto.send_values_packed(rid, payloads.get_many(self._writer(ev.handle,
                                                                                                  "get from"), keys)))
                else:
                    self._write(proto.send_values(rid, self._writer(ev.handle, "get from").get_many(keys)))
            elif cls is PutMany:
                w = self._writer(ev.handle, "put to")
                payloads.put_many(w, ev.items)
                self._write(proto.send_count(rid, Op.PUT_MANY, len(ev.items)))
                d.note_changes(w)  # an open version's changes count too (the registry flushes them)
            elif cls is RemoveMany:
                w = self._writer(ev.handle, "remove from")
                payloads.remove_many(w, ev.keys)
                self._write(proto.send_count(rid, Op.REMOVE_MANY, len(ev.keys)))
                d.note_changes(w)
            elif cls is Commit:
                self._commit(ev)
            elif cls is Abort:
                self._abort(ev.handle)
                self._write(proto.send_aborted(rid))
            elif cls is Open:
                if d.stopping:
                    raise ShuttingDownError("the daemon is stopping; open the store elsewhere or later")
                d.objstores.check(ev.store_id.root)  # RootError: malformed, or outside allowed_roots
                registry = d.registry
                assert registry is not None  # set by start(), before any connection
                opened = registry.try_open(ev.store_id, ev.version, ev.ckptid)
                if opened is not None:
                    self._opened(rid, opened)
                else:
                    self._spawn(self._open_async(ev))
            elif cls is Scan:
                self._scan(ev)
            elif cls is ScanRanges:
                self._scan_ranges(ev)
            elif cls is AwaitDurable:
                d.objstores.check(ev.store_id.root)
                self._spawn(self._await_durable(ev))
            elif cls is Ping:
                self._write(proto.send_pong(rid, ev.payload))
            elif cls is Stats:
                self._write(proto.send_stats(rid, d.stats()))
            elif cls is Release:
                registry = d.registry
                assert registry is not None
                d.objstores.check(ev.root)
                self._write(proto.send_released(rid, registry.release(ev.root, ev.operator_id, ev.store_name,
                                                                      ev.partitions)))
            elif cls is Hello:
                self._write(proto.send_hello(rid, d.limits()))
            elif cls is BadRequest:
                d.counters["errors"] += 1
                self._write(proto.send_error(rid, ev.opcode, ev.error))
            elif cls is ConnectionFailed:
                d.counters["errors"] += 1
                log.warning("closing connection of %s: %s", self.peer, ev.error)
                self._write(proto.send_error(rid, ev.opcode, ev.error))
                self.closed = True
                self.transport.close()
        except StateStoreError as exc:
            d.counters["errors"] += 1
            self._write(proto.send_error(rid, _OPCODE.get(cls, 0), exc))
        except Exception as exc:  # a bug: answer with the root code and keep serving
            d.counters["errors"] += 1
            log.exception("request %s failed", cls.__name__)
            self._write(proto.send_error(rid, _OPCODE.get(cls, 0), exc))

    def _abort(self, handle: int) -> None:
        w = self.handles.get(handle)
        if w is None:
            finished = self._finished.get(handle)
            if finished is not None and finished.state is State.ABORTED:
                return  # aborting twice is fine, as in the engine
            self._writer(handle, "abort")  # raises
            return
        w.abort()
        self._finish(handle, w)

    def _opened(self, rid: int, w: StoreVersion) -> None:
        if self.closed:
            w.abort()
            return
        self._next_handle += 1
        self.handles[self._next_handle] = w
        self._touched[self._next_handle] = time.monotonic()
        self._write(self.proto.send_opened(rid, self._next_handle, w.parent))

    async def _open_async(self, ev: Open) -> None:
        registry = self.daemon.registry
        assert registry is not None
        try:
            w = await registry.open(ev.store_id, ev.version, ev.ckptid)
        except StateStoreError as exc:
            self.daemon.counters["errors"] += 1
            self._write(self.proto.send_error(ev.request_id, Op.OPEN, exc))
            return
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("OPEN of %s failed", ev.store_id)
            self._write(self.proto.send_error(ev.request_id, Op.OPEN, exc))
            return
        self._opened(ev.request_id, w)

    def _commit(self, ev: Commit) -> None:
        """COMMIT: ``daemon.commits.Commits`` runs it; the connection answers and keeps its handles."""
        commits = self.daemon.commits
        assert commits is not None  # set by start(), before any connection
        w = self._writer(ev.handle, "commit")
        rid = ev.request_id
        try:
            waiting = commits.commit(w, ev.ckptid, lambda ref: self._write(self.proto.send_committed(rid, ref)),
                                     self._cut)
        finally:
            if w.state is not State.UPDATING:
                self._finish(ev.handle, w)
        if waiting is not None:
            self._spawn(waiting, keep_on_close=True)

    def _cut(self) -> None:
        """Close the connection at once, without an answer (see ``Commits.commit``)."""
        self.closed = True
        self.transport.abort()

    def _scan(self, ev: Scan) -> None:
        pairs = list(self._writer(ev.handle, "scan").scan(ev.prefix))
        if ev.limit is not None:
            del pairs[ev.limit:]
        if len(pairs) <= SCAN_CHUNK_ITEMS:
            self._write(self.proto.send_scan_chunk(ev.request_id, pairs, False))
        else:
            self._spawn(self._scan_stream(ev.request_id, pairs))

    def _scan_ranges(self, ev: ScanRanges) -> None:
        """SCAN_RANGES: each range's records (at most ``ev.limit`` each), in key order, in chunks
        like SCAN. Costs O(ranges × log n + records returned)."""
        pairs = self._writer(ev.handle, "scan").scan_ranges(ev.ranges, ev.limit)
        if len(pairs) <= SCAN_CHUNK_ITEMS:
            self._write(self.proto.send_scan_ranges_chunk(ev.request_id, pairs, False))
        else:
            self._spawn(self._scan_stream(ev.request_id, pairs, self.proto.send_scan_ranges_chunk))

    async def _scan_stream(self, rid: int, pairs: list[tuple[bytes, bytes]],
                           send: Callable[[int, list[tuple[bytes, bytes]], bool], bytes] | None = None) -> None:
        proto = self.proto
        send = send or proto.send_scan_chunk
        i, n = 0, len(pairs)
        while i < n:
            j, size = i, 0
            while j < n and j - i < SCAN_CHUNK_ITEMS and size < SCAN_CHUNK_BYTES:
                size += len(pairs[j][0]) + len(pairs[j][1]) + 8
                j += 1
            await self._write_ok.wait()
            if self.closed:
                return
            self._write(send(rid, pairs[i:j], j < n))
            i = j
            await asyncio.sleep(0)

    async def _await_durable(self, ev: AwaitDurable) -> None:
        try:
            durable = await self.daemon.await_durable(ev.store_id, ev.ref, ev.timeout)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # every waiter gets an answer: never a timeout for an error
            if not isinstance(exc, StateStoreError):
                log.exception("AWAIT_DURABLE of %s at %s failed", ev.store_id, ev.ref)
            self.daemon.counters["errors"] += 1
            self._write(self.proto.send_error(ev.request_id, Op.AWAIT_DURABLE, exc))
            return
        self._write(self.proto.send_durable(ev.request_id, durable))

    @property
    def busy(self) -> bool:
        """A request of this connection is in flight (a task: a load, a waiting commit, a scan, an
        AWAIT_DURABLE) or decoded and not handled yet."""
        return bool(self._tasks) or bool(self.proto.pending_events)

    def close(self) -> None:
        """Close the connection (the daemon is stopping): ``connection_lost`` aborts what is open."""
        if not self.closed:
            self.transport.close()


# --- the daemon -----------------------------------------------------------------------------------
class Daemon:
    """One node's daemon: ``await start()``, serve, ``await stop()``."""

    def __init__(self, config: DaemonConfig, *, open_objstore: Callable[[str], ObjectStore] | None = None) -> None:
        self.config = config
        self.allowed_uids = tuple(config.effective_allowed_uids)
        self._default_objstores = open_objstore is None
        if open_objstore is None:
            s3 = config.s3_options()

            def open_objstore(uri: str) -> ObjectStore:
                return open_root(uri, s3_options=s3, cache_dir=config.cache_dir, cache_bytes=config.cache_bytes)

        self.objstores = ObjectStores(open_objstore, allowed=config.allowed_root_parts)
        #: the room that frames still arriving share across connections (``partial_frames_bytes``)
        self.frame_pool = FramePool(config.partial_frames_bytes)
        self.uploader: Uploader | None = None
        self.registry: StoreRegistry | None = None
        self.maintenance: Maintenance | None = None
        self.commits: Commits | None = None
        self.connections: set[_Connection] = set()
        self.stopping = False
        self._server: asyncio.AbstractServer | None = None
        self._metrics_server: WSGIServer | None = None
        self._budget_check: asyncio.TimerHandle | None = None
        self._last_trim = 0.0
        self._trimmed_at = 0  # the registry's ``releases`` at the last malloc_trim
        self._idle_sweep: asyncio.TimerHandle | None = None
        self._idle_timer: asyncio.TimerHandle | None = None
        #: set when ``exit_when_idle`` seconds passed with no client and no upload: ``serve`` then stops
        self.idle_exit = asyncio.Event()
        self._socket_inode: tuple[int, int] | None = None
        self._started = time.monotonic()
        self.counters = {"connections": 0, "refused": 0, "requests": 0, "errors": 0, "aborted_on_disconnect": 0,
                         "commits_waited": 0, "max_inflight_seen": 0,
                         "versions_expired": 0}
        #: seconds from handling each COMMIT to writing its answer (waits for upload-queue room included)
        self.commit_latency = Buckets(COMMIT_LATENCY_BOUNDS)
        #: after ``stop``: True when every acknowledged commit was durable
        self.clean_stop: bool | None = None
        self.requests_by_op: dict[str, int] = {}

    def limits(self) -> dict[str, Any]:
        c = self.config
        return {"max_frame_bytes": c.max_frame_bytes, "max_batch": c.max_batch, "max_inflight": c.max_inflight,
                "daemon": f"statestore_async {__version__}"}

    def count_request(self, cls: type) -> None:
        self.counters["requests"] += 1
        name = cls.__name__
        self.requests_by_op[name] = self.requests_by_op.get(name, 0) + 1

    def note_inflight(self, n: int) -> None:
        if n > self.counters["max_inflight_seen"]:
            self.counters["max_inflight_seen"] = n

    async def start(self) -> None:
        cfg = self.config
        # Deltas and snapshots are encoded in worker threads. A request arriving while such a thread
        # holds the GIL waits for the next switch: Python's default of 5 ms would be the latency
        # tail of COMMIT; 0.5 ms keeps it small at a negligible cost to the encoding threads.
        sys.setswitchinterval(GIL_SWITCH_INTERVAL)
        # deltas waiting for upload count against the memory budget too: the queue never holds
        # more than the budget (commits wait for room, as they do for upload_queue_bytes)
        self.uploader = Uploader(self.objstores, concurrency=cfg.upload_concurrency,
                                 queue_bytes=min(cfg.upload_queue_bytes, cfg.memory_budget),
                                 queue_count=cfg.upload_queue_count)
        self.registry = StoreRegistry(self.objstores, self.uploader, memory_budget=cfg.memory_budget,
                                      block_cache_bytes=cfg.block_cache_bytes or None,
                                      spill_min_bytes=cfg.spill_min_bytes,
                                      scratch_dir=os.path.join(cfg.cache_dir, "flushed") if cfg.cache_dir else None,
                                      flush_min_bytes=cfg.flush_min_bytes, open_wait_timeout=cfg.open_wait_timeout,
                                      max_open_runs=cfg.max_open_runs)
        worker = None
        if cfg.snapshot_builder == "process" and self._default_objstores:
            # the worker opens the same object stores from the same settings (a custom factory,
            # as tests use, cannot be handed to another process: those snapshot inline)
            worker = SnapshotWorker({"s3": cfg.s3_options(), "cache_dir": cfg.cache_dir, "cache_bytes": cfg.cache_bytes})
        self.maintenance = Maintenance(self.registry, self.objstores, snapshot_interval=cfg.snapshot_interval,
                                       snapshot_delta_bytes=cfg.snapshot_delta_bytes,
                                       retention_versions=cfg.retention_versions, worker=worker,
                                       served=lambda: self.counters["requests"])
        self.commits = Commits(self.uploader, self.registry, latency=self.commit_latency, counters=self.counters,
                               after_commit=self.check_budget_soon)
        self.uploader.on_durable = self._on_durable
        await s3_warm_up()
        prepare_socket_path(cfg.socket, cfg.socket_mode)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(lambda: _Connection(self), path=cfg.socket, backlog=1024)
        os.chmod(cfg.socket, cfg.socket_mode)
        st = os.lstat(cfg.socket)
        self._socket_inode = (st.st_dev, st.st_ino)
        self.watch_idle()
        self._sweep_idle_versions()
        if cfg.metrics_port:
            self._metrics_server = start_metrics(self.stats, cfg.metrics_host, cfg.metrics_port)
        log.info("serving on %s (mode %04o, uids %s, loop %s, pid %d)", cfg.socket, cfg.socket_mode,
                 list(self.allowed_uids), type(loop).__module__, os.getpid())

    def watch_idle(self) -> None:
        """With ``exit_when_idle``: count down while no client is connected, stop counting otherwise."""
        delay = self.config.exit_when_idle
        if self.connections or self.stopping or delay <= 0:
            if self._idle_timer is not None:
                self._idle_timer.cancel()
                self._idle_timer = None
        elif self._idle_timer is None:
            self._idle_timer = asyncio.get_running_loop().call_later(delay, self._idle_expired)

    def _idle_expired(self) -> None:
        self._idle_timer = None
        if self.connections or self.stopping:
            return
        if self.uploader is not None and not self.uploader.idle:
            # a delta still on its way to the object store: look again shortly
            self._idle_timer = asyncio.get_running_loop().call_later(IDLE_RECHECK, self._idle_expired)
            return
        log.info("no client for %.0fs and no upload pending: exiting", self.config.exit_when_idle)
        self.idle_exit.set()

    def _on_durable(self, store_id: StoreId, ref: CheckpointRef, nbytes: int,
                    lineage: tuple[CheckpointRef, ...]) -> None:
        assert self.maintenance is not None  # set by start(), with the uploader that calls this
        self.maintenance.note_durable(store_id, ref, nbytes, lineage)
        self.check_budget_soon()  # a store whose uploads settled may be evictable now

    def _sweep_idle_versions(self) -> None:
        """Every quarter of ``open_version_idle_timeout`` (``IDLE_SWEEP_MAX`` at most): abort the
        open versions that had no request for that long, on every connection."""
        limit = self.config.open_version_idle_timeout
        self._idle_sweep = None
        if limit <= 0 or self.stopping:
            return
        now = time.monotonic()
        for conn in list(self.connections):
            self.counters["versions_expired"] += conn.expire_idle(now, limit)
        self._idle_sweep = asyncio.get_running_loop().call_later(min(limit / 4, IDLE_SWEEP_MAX),
                                                                 self._sweep_idle_versions)

    def note_changes(self, w: StoreVersion) -> None:
        """An open version took changes: large ones are checked against the budget now, any
        others shortly (``check_budget_soon``)."""
        if self.registry is not None:
            self.registry.note_changes(w)
        self.check_budget_soon()

    def check_budget_soon(self) -> None:
        """Evict idle stores over the memory budget shortly (``BUDGET_CHECK_DELAY``), once per burst."""
        if self._budget_check is None:
            self._budget_check = asyncio.get_running_loop().call_later(BUDGET_CHECK_DELAY, self._check_budget)

    def _check_budget(self) -> None:
        self._budget_check = None
        registry = self.registry
        if registry is None:
            return
        registry.enforce_budget()
        # memory given back (stores evicted or spilled, deltas stacked, changes flushed, blocks
        # dropped) is scattered through malloc's heap: hand its pages back now and then
        if registry.releases != self._trimmed_at:
            now = time.monotonic()
            if now - self._last_trim >= TRIM_INTERVAL:
                self._last_trim, self._trimmed_at = now, registry.releases
                give_back_free_pages()

    async def await_durable(self, store_id: StoreId, ref: CheckpointRef, timeout: float) -> bool:
        """True once ``ref``'s file is in the object store (asking the store when the uploader never saw it).

        The uploader creates a delta only after every delta of its lineage is durable, so a file
        there is a loadable state. Raises the typed error when ``ref`` will not become durable or
        its root is degraded (see ``Uploader.wait_durable``)."""
        if ref.is_empty_state:
            return True
        uploader = self.uploader
        assert uploader is not None  # set by start()
        if uploader.state(store_id, ref) is not None:
            return await uploader.wait_durable(store_id, ref, timeout)
        objstore = self.objstores(store_id.root)
        for kind in (DELTA, SNAPSHOT):
            try:
                if await objstore.exists(file_key(store_id, ref, kind)):
                    return True
            except ObjectStoreError:
                raise
        return False

    def health(self) -> dict[str, Any]:
        """``{"status": "ok" | "degraded" | "stopping", "reasons": [...], "degraded_roots": {...}}``:
        degraded while an object-store root refuses uploads in a way retrying does not heal by
        itself (credentials, permissions, a missing bucket, a full disk); uploads are retried and
        the first success there clears it."""
        degraded = self.uploader.degraded() if self.uploader is not None else {}
        reasons = [f"{root}: {d['error']}: {d['message']} ({d['uploads_waiting']} uploads waiting, "
                   f"{d['refused']} attempts refused)" for root, d in degraded.items()]
        status = "stopping" if self.stopping else "degraded" if degraded else "ok"
        return {"status": status, "reasons": reasons, "degraded_roots": degraded}

    def stats(self) -> dict[str, Any]:
        return {
            "health": self.health(),
            "daemon": {"version": __version__, "pid": os.getpid(), "uptime": round(time.monotonic() - self._started, 3),
                       "open_connections": len(self.connections), "stopping": self.stopping,
                       "open_versions": sum(c.open_versions for c in self.connections), **self.counters,
                       "requests_by_op": dict(self.requests_by_op), "commit_latency": self.commit_latency.stats(),
                       "partial_frame_bytes": self.frame_pool.used, "partial_frames_waiting": self.frame_pool.waiting,
                       **self.frame_pool.counters},
            # ``is not None``: an empty registry is falsy (it has a length), and its section must
            # still carry every key (zeros), as the metrics endpoint reads them all
            "registry": self.registry.stats() if self.registry is not None else {},
            "uploader": self.uploader.stats() if self.uploader is not None else {},
            "maintenance": self.maintenance.stats() if self.maintenance is not None else {},
            "object_stores": self.objstores.stats(),
        }

    async def stop(self) -> bool:
        """Stop listening; let the connections commit or abort the versions they have open and
        finish their requests (OPEN refused) while the uploads drain; close them once all is done
        or at ``drain_timeout``, then finish draining within it. True when every acknowledged
        commit is durable (``clean_stop``); else the versions that are not are logged."""
        if self.stopping:
            return bool(self.clean_stop)
        self.stopping = True
        cfg = self.config
        loop = asyncio.get_running_loop()
        deadline = loop.time() + cfg.drain_timeout
        log.info("stopping: %d connections, %d open versions, %d bytes queued for upload", len(self.connections),
                 sum(c.open_versions for c in self.connections), self.uploader.queued_bytes if self.uploader else 0)
        # No new connection: the socket stops listening at once, so a successor daemon may bind its
        # path while this one drains (a client finds no daemon there rather than a refusal).
        if self._server is not None:
            self._server.close()
        # The connections stay through the drain: a version open on one may still be written and
        # committed (OPEN is refused), AWAIT_DURABLE and STATS are answered. They are closed once
        # no version is open and no request in flight on any of them and every upload is done,
        # or at the drain's end (a version still open then is aborted: it was never acknowledged).
        await self._drain_connections(deadline)
        left = [c for c in self.connections if c.open_versions]
        if left:
            log.warning("drain over after %.1f s: aborting %d versions still open on %d connections",
                        cfg.drain_timeout, sum(c.open_versions for c in left), len(left))
        for c in list(self.connections):
            c.close()
        if self._budget_check is not None:
            self._budget_check.cancel()
            self._budget_check = None
        if self._idle_sweep is not None:
            self._idle_sweep.cancel()
            self._idle_sweep = None
        self.watch_idle()
        drained = True
        if self.uploader is not None:
            drained = await self.uploader.drain(max(0.0, deadline - loop.time()))
        if self.maintenance is not None:
            await self.maintenance.close()
        not_durable: list[tuple[StoreId, CheckpointRef, BaseException | None]] = []
        if self.uploader is not None:
            if not drained:
                log.error("drain timed out after %.1fs: %s", cfg.drain_timeout, self.uploader.stats())
            await self.uploader.close()
            not_durable = self.uploader.not_durable()
            _log_not_durable(not_durable)
        self.clean_stop = drained and not not_durable
        await self.objstores.close()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
        try:
            # only our own socket: a daemon started while this one was stopping has bound a new
            # socket at the same path
            st = os.lstat(cfg.socket)
            if self._socket_inode == (st.st_dev, st.st_ino) and stat.S_ISSOCK(st.st_mode):
                os.unlink(cfg.socket)
        except FileNotFoundError:
            pass
        if self.clean_stop:
            log.info("stopped (uploads drained: True): every acknowledged commit is durable")
        else:
            log.error("stopped with %d acknowledged commits not durable (uploads drained: %s)", len(not_durable),
                      drained)
        return self.clean_stop

    async def _drain_connections(self, deadline: float) -> None:
        """Return once no connection has a version open or a request in flight and the uploader is
        idle, or at ``deadline`` (loop time)."""
        loop = asyncio.get_running_loop()
        while loop.time() < deadline:
            busy = any(c.open_versions or c.busy for c in self.connections)
            if not busy and (self.uploader is None or self.uploader.idle):
                return
            await asyncio.sleep(min(DRAIN_POLL, max(0.0, deadline - loop.time())))

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


def _log_not_durable(items: list[tuple[StoreId, CheckpointRef, BaseException | None]]) -> None:
    """One error line per store: the versions (``version_ckptid``) not durable and the last error."""
    by_store: dict[StoreId, list[tuple[CheckpointRef, BaseException | None]]] = {}
    for store_id, ref, err in items:
        by_store.setdefault(store_id, []).append((ref, err))
    for store_id, refs in by_store.items():
        shown = " ".join(f"{r.version}_{r.ckptid}" for r, _ in refs[:LIST_NOT_DURABLE])
        more = f" and {len(refs) - LIST_NOT_DURABLE} more" if len(refs) > LIST_NOT_DURABLE else ""
        last = refs[-1][1]
        log.error("NOT DURABLE: %s %s: %d acknowledged versions: %s%s (%s)", store_id.root, store_id.prefix,
                  len(refs), shown, more, f"{type(last).__name__}: {last}" if last else "not uploaded")


# --- logs ----------------------------------------------------------------------------------------
class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg (+ exc)."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": round(record.created, 3), "level": record.levelname.lower(), "logger": record.name,
               "msg": record.getMessage(), "pid": record.process}
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


def configure_logging(config: DaemonConfig) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if config.log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("statestore_async")
    root.handlers[:] = [handler]
    root.setLevel(config.log_level.upper())
    root.propagate = False


# --- running it -----------------------------------------------------------------------------------
async def serve(config: DaemonConfig, *, open_objstore: Callable[[str], ObjectStore] | None = None) -> int:
    """Run the daemon until SIGTERM or SIGINT (or, with ``exit_when_idle``, until it is idle that long);
    then stop gracefully. Returns the exit code: 0 when every acknowledged commit is durable,
    ``EXIT_NOT_DURABLE`` otherwise (the versions are in the log)."""
    daemon = Daemon(config, open_objstore=open_objstore)
    await daemon.start()
    # Everything loaded so far lives as long as the process (botocore's service models alone are
    # ~80k objects): keep it out of the cyclic collector, whose full passes would otherwise walk
    # it all — a 30 ms pause in the middle of requests.
    gc.collect()
    gc.freeze()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(daemon.idle_exit.wait())]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        log.info("signal received" if stop.is_set() else "idle: stopping")
    finally:
        for w in waits:
            w.cancel()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        clean = await daemon.stop()
    return 0 if clean else EXIT_NOT_DURABLE


# glibc's mallopt parameters, the size from which its malloc maps memory of its own, and how many
# malloc arenas the daemon's threads share
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
MMAP_THRESHOLD = 128 << 10
ARENA_MAX = 2


def return_freed_memory() -> bool:
    """Make glibc's malloc give large blocks back to the system as soon as they are freed, and keep
    the threads' small blocks in few heaps.

    By default glibc raises its mmap threshold each time a mapped block is freed (up to 32 MiB),
    so later tables, payloads and file buffers of a few MiB come from the heap, where freed memory
    stays resident: the daemon's RSS then drifts far above what its stores hold, and the memory
    budget would not bound it. A fixed threshold keeps every block of 128 KiB or more mapped on its
    own and unmapped when freed (and a growing table's arena is moved by ``mremap``, not copied).
    glibc also gives each thread that allocates its own heap (up to 8 per core), each keeping
    freed pages resident; the encoding and IO threads then share one heap besides the event
    loop's (``ARENA_MAX``): -3.7 MiB of peak RSS in ``benchmarks/bench_budget_rss.py --rounds 20``
    (156.5 -> 152.8 MiB). Set before any thread allocates (``run``). Nothing happens on a C library
    without ``mallopt``. True when both settings took."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_ARENA_MAX, ARENA_MAX))


def give_back_free_pages() -> None:
    """Return the free pages inside malloc's heap to the system (glibc's ``malloc_trim``).

    Evicted stores free many small blocks (their Python objects, small tables) scattered through
    the heap; the heap can only shrink from its top, so without this their pages stay resident
    while a few live blocks sit between them. Costs a walk of the heap (~1 ms for tens of MiB)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def _malloc_trim() -> Callable[[int], int] | None:
    import ctypes

    try:
        fn = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return cast("Callable[[int], int]", fn)


_MALLOC_TRIM = _malloc_trim()


def raise_open_files_limit() -> tuple[int, int]:
    """Raise the soft limit of open files to the hard one; the (soft, hard) limits after.

    Spilled stores read their runs (a snapshot, the deltas stacked over it, flushed changes)
    through at most ``max_open_runs`` open files (``files.runfiles``), connections take one each,
    and a soft limit of 1024, which many systems start a process with, leaves little room (opens
    then fail with EMFILE). The hard limit is what the system allows."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        want = hard if hard != resource.RLIM_INFINITY else max(soft, OPEN_FILES_WANTED)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open files limit from %d to %d: %s", soft, want, exc)
    if soft < OPEN_FILES_WANTED:
        log.warning("the open files limit is %d: spilled stores' runs take up to max_open_runs, connections one each; raise it "
                    "(ulimit -n, LimitNOFILE) to at least %d", soft, OPEN_FILES_WANTED)
    return soft, hard


# open files a daemon with spilled stores may need (a soft limit below this is logged)
OPEN_FILES_WANTED = 4096


def run(config: DaemonConfig) -> int:
    """Configure logs, malloc and the open files limit, pick the event loop (``config.loop``) and
    serve until a signal."""
    configure_logging(config)
    return_freed_memory()
    raise_open_files_limit()
    if config.loop == "uvloop":
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    else:
        runner = asyncio.Runner()
    with runner:
        return runner.run(serve(config))
