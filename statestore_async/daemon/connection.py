"""One client connection of the daemon: ``Connection``, an ``asyncio.Protocol`` that feeds a
sans-IO ``ServerProtocol`` and answers each request (docs/ARCHITECTURE.md, "The daemon" and "The
wire protocol").

* requests that touch only memory (GET/PUT/REMOVE/ABORT/PING/STATS, an OPEN served from memory,
  a COMMIT the upload queue has room for) are answered inline, in the order they arrived;
* the others (an OPEN that loads, a COMMIT waiting for queue room, SCAN streaming, AWAIT_DURABLE)
  run as tasks; at most ``max_inflight`` per connection — beyond that the connection stops reading
  (back-pressure), as it does while the peer does not read its answers;
* a peer whose uid (SO_PEERCRED) is not allowed gets a ``PermissionDeniedError`` frame and a close;
* a peer that goes away has its open versions aborted.

Batch payloads go to the open version through the request layer (``daemon.payloads``), a COMMIT
through its one owner (``daemon.commits``). Frames still arriving share the daemon's
``FramePool`` (``partial_frames_bytes``).
"""
from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Iterable
from typing import TYPE_CHECKING, Any, cast

from statestore_async.codecs.packed import PackedList
from statestore_async.daemon import payloads
from statestore_async.daemon.unixsocket import peer_credentials
from statestore_async.engine.store import State, StoreVersion
from statestore_async.errors import (
    FrameBudgetError,
    StateStoreError,
    StoreStateError,
    VersionIdleTimeoutError,
)
from statestore_async.wire.events import (
    CLOSED,
    NEED_DATA,
    Abort,
    AwaitDurable,
    BadRequest,
    Commit,
    ConnectionFailed,
    GetMany,
    Hello,
    Open,
    Ping,
    PutMany,
    Release,
    RemoveMany,
    Scan,
    ScanRanges,
    Stats,
)
from statestore_async.wire.protocol import Op, PermissionDeniedError, ServerProtocol, ShuttingDownError, UnknownHandleError

if TYPE_CHECKING:
    from statestore_async.daemon.server import Daemon


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
        self._waiting: OrderedDict[Connection, int] = OrderedDict()
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

    def wait(self, conn: Connection, n: int) -> None:
        """``conn`` waits for ``n`` bytes: ``conn.frame_room(n)`` once they are its (waiting
        already, it keeps its place in line and now waits for ``n``)."""
        if conn not in self._waiting:
            self.counters["partial_frame_waits"] += 1
        self._waiting[conn] = n

    def is_waiting(self, conn: Connection) -> bool:
        return conn in self._waiting

    def cancel(self, conn: Connection) -> None:
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


class Connection(asyncio.Protocol):
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


