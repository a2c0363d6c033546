"""Clients of the daemon: ``Client`` (blocking, for Spark Python workers) and ``AsyncClient``.

Both speak the sans-IO ``protocol`` over the daemon's Unix socket::

    client = Client.shared("/run/statestore-async/daemon.sock")   # one per process, fork-safe
    with client.open(StoreId(root, "op", 3), version=7, ckptid=ckpt) as store:
        values = store.get_many(keys)          # list of bytes | None
        store.put_many(zip(keys, new_values))
        ref = store.commit()                   # CheckpointRef(8, <fresh ckptid>)

Batches larger than the daemon's ``max_batch`` (or its frame limit) are split into several
requests, sent pipelined. Errors from the daemon are raised as the same error classes
(``errors.error_for_code``). Keys follow ``statestore_async.codecs.keylayout`` (2-byte key group prefix).
"""
from __future__ import annotations

import asyncio
import os
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from itertools import chain

from statestore_async.codecs import arrowframes, valuecodec, pyrows as rows
from statestore_async.config import default_socket_path
from statestore_async.errors import InterfaceError
from statestore_async.codecs.framing import HEADER_SIZE
from statestore_async.ids import DEFAULT_STORE_NAME, CheckpointRef, StoreId
from statestore_async.codecs.keylayout import DEFAULT_KEY_GROUPS
from statestore_async.wire.protocol import (
    CLOSED, NEED_DATA, ClientProtocol, ConnectionFailed, ConnectionLostError, ErrorResponse,
    LimitExceededError,
)

DEFAULT_TIMEOUT = 60.0
_FRAME_SLACK = 64
_READ_SIZE = 1 << 20
_BATCH_HEAD = HEADER_SIZE + 4  # frame header + handle, before the list a batch request carries


class RequestTimeoutError(ConnectionLostError):
    """No answer within the client's timeout (the connection is closed: the daemon aborts its versions)."""


def _split(items: list, max_batch: int, budget: int, pairs: bool) -> list[list]:
    """Cut ``items`` (keys, or (key, value) pairs) into runs of at most ``max_batch`` items and
    ``budget`` encoded bytes.

    Runs of ``max_batch`` items are sized at C speed (``sum(map(len, ...))``); only a run over the
    byte budget is cut item by item."""
    n = len(items)
    per_item = 8 if pairs else 4
    out: list = []
    for start in range(0, n, max_batch) if n > max_batch else (0,):
        run = items[start:start + max_batch] if n > max_batch else items
        flat = chain.from_iterable(run) if pairs else run
        if 4 + per_item * len(run) + sum(map(len, flat)) <= budget:
            out.append(run)
        else:
            out.extend(_split_bytes(run, budget, per_item, pairs))
    return out


def _split_bytes(items: list, budget: int, per_item: int, pairs: bool) -> list[list]:
    """Cut a run of items into runs of at most ``budget`` encoded bytes, item by item."""
    out, cur, cur_bytes = [], [], 4
    for x in items:
        s = (len(x[0]) + len(x[1]) if pairs else len(x)) + per_item
        if s + 4 > budget:
            raise LimitExceededError(f"one item of {s} bytes does not fit in a frame of {budget} bytes")
        if cur and cur_bytes + s > budget:
            out.append(cur)
            cur, cur_bytes = [], 4
        cur.append(x)
        cur_bytes += s
    if cur or not out:
        out.append(cur)
    return out


def _column_frames(proto: ClientProtocol, limits: "_Limits", method: str, handle: int, n: int, cols: tuple) -> list:
    """(request id, frame) of each request of a batch given as Arrow-layout columns: runs of at most
    ``max_batch`` items, halved until each frame fits the budget."""
    todo = [(s, min(limits.max_batch, n - s)) for s in range(0, n, limits.max_batch)] or [(0, 0)]
    todo.reverse()
    out: list = []
    fn = getattr(proto, method)
    try:
        while todo:
            start, count = todo.pop()
            rid, data = fn(handle, count, *[(o, d, first + start, w) for o, d, first, w in cols])
            if len(data) - _BATCH_HEAD <= limits.budget:
                out.append((rid, data))
                continue
            proto.forget(rid)
            if count <= 1:
                raise LimitExceededError(f"one item of {len(data) - _BATCH_HEAD} bytes does not fit in a frame of "
                                         f"{limits.budget} bytes")
            todo += [(start + count // 2, count - count // 2), (start, count // 2)]
    except BaseException:
        for rid, _ in out:
            proto.forget(rid)
        raise
    return out


def _arrow_values(parts: list):
    arrays = [arrowframes.to_array(*p) for p in parts]
    if len(arrays) == 1:
        return arrays[0]
    import pyarrow as pa

    if any(pa.types.is_large_binary(a.type) for a in arrays):
        arrays = [a.cast(pa.large_binary()) for a in arrays]
    return pa.concat_arrays(arrays)


def _arrow_pair(keys, values) -> tuple[int, tuple]:
    n, kc = arrowframes.column(keys, "keys")
    m, vc = arrowframes.column(values, "values")
    if n != m:
        raise InterfaceError(f"{n} keys but {m} values")
    return n, (kc, vc)


class _Limits:
    def __init__(self, limits: dict):
        self.max_batch = int(limits.get("max_batch", 100_000))
        self.max_inflight = max(1, int(limits.get("max_inflight", 64)))
        self.budget = int(limits.get("max_frame_bytes", 64 << 20)) - _FRAME_SLACK


# --- blocking client ------------------------------------------------------------------------------
class Client:
    """A blocking connection to the daemon. Thread-safe (one request at a time); reconnects after fork."""

    _shared: dict[str, "Client"] = {}
    _shared_lock = threading.Lock()

    def __init__(self, socket_path: str | None = None, *, timeout: float = DEFAULT_TIMEOUT,
                 connect_timeout: float = 5.0, name: str = "statestore_async.client"):
        self.socket_path = socket_path or default_socket_path()
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.name = name
        self._lock = threading.RLock()
        self._sock: socket.socket | None = None
        self._proto: ClientProtocol | None = None
        self._pid: int | None = None
        self._stash: dict[int, deque] = {}
        self._rbuf = bytearray(_READ_SIZE)  # every read lands here: no fresh buffer per read
        self.generation = 0
        self.limits: _Limits | None = None
        self.server_info: dict = {}

    @classmethod
    def shared(cls, socket_path: str | None = None, **kwargs) -> "Client":
        """The process-wide client for ``socket_path`` (a new one in a forked child)."""
        path = socket_path or default_socket_path()
        with cls._shared_lock:
            c = cls._shared.get(path)
            if c is None:
                c = cls._shared[path] = cls(path, **kwargs)
            return c

    # -- connection --
    def _ensure(self) -> ClientProtocol:
        if self._sock is None or self._pid != os.getpid():
            self._connect()
        return self._proto

    def _drop(self) -> None:
        sock, self._sock, self._proto = self._sock, None, None
        self._stash.clear()
        if sock is not None:
            try:
                if self._pid == os.getpid():
                    sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()  # in a forked child this only drops our copy of the parent's descriptor

    def _connect(self) -> None:
        self._drop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.connect_timeout)
        try:
            sock.connect(self.socket_path)
        except OSError as exc:
            sock.close()
            raise ConnectionLostError(f"cannot connect to the daemon at {self.socket_path}: {exc}") from None
        sock.settimeout(self.timeout)
        self._sock, self._proto, self._pid = sock, ClientProtocol(), os.getpid()
        self.generation += 1
        try:
            rid, data = self._proto.send_hello(self.name)
            self._send(data)
            info = self._wait(rid)
        except BaseException:
            self._drop()
            raise
        self.server_info = info.limits
        self.limits = _Limits(info.limits)

    def close(self) -> None:
        """Close the connection (the daemon aborts versions left open on it)."""
        with self._lock:
            self._drop()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- requests --
    def _read_some(self, timeout: float | None) -> None:
        sock = self._sock
        if timeout is not None:
            sock.settimeout(timeout)
        rbuf = self._rbuf
        try:
            n = sock.recv_into(rbuf)
        except socket.timeout:
            self._drop()
            raise RequestTimeoutError(f"no answer from the daemon within {timeout or self.timeout}s") from None
        except OSError as exc:
            self._drop()
            raise ConnectionLostError(f"connection to the daemon failed: {exc}") from None
        finally:
            if timeout is not None and self._sock is not None:
                self._sock.settimeout(self.timeout)
        if not n:
            proto = self._proto
            self._drop()
            ev = proto.next_event() if proto is not None else NEED_DATA
            if isinstance(ev, ErrorResponse) and ev.request_id == 0:
                raise ev.error
            raise ConnectionLostError("the daemon closed the connection")
        proto = self._proto
        with memoryview(rbuf) as view:
            proto.receive_data(view[:n])
        while True:
            ev = proto.next_event()
            if ev is NEED_DATA or ev is CLOSED:
                return
            if isinstance(ev, ConnectionFailed) or (isinstance(ev, ErrorResponse) and ev.request_id == 0):
                self._drop()
                raise ev.error
            self._stash.setdefault(ev.request_id, deque()).append(ev)

    def _next(self, rid: int, timeout: float | None = None):
        """The next answer event of ``rid`` (raising its error)."""
        while True:
            q = self._stash.get(rid)
            if q:
                ev = q.popleft()
                if not q:
                    del self._stash[rid]
                if isinstance(ev, ErrorResponse):
                    raise ev.error
                return ev
            if self._sock is None:
                raise ConnectionLostError("the connection to the daemon was lost")
            self._read_some(timeout)

    def _wait(self, rid: int, timeout: float | None = None):
        return self._next(rid, timeout).value

    def _call(self, method: str, *args, timeout: float | None = None):
        with self._lock:
            proto = self._ensure()
            rid, data = getattr(proto, method)(*args)
            self._send(data)
            return self._wait(rid, timeout)

    def _send(self, data: bytes) -> None:
        try:
            self._sock.sendall(data)
        except OSError as exc:
            self._raise_goodbye()
            self._drop()
            raise ConnectionLostError(f"cannot send to the daemon: {exc}") from None

    def _send_reading(self, data: bytes) -> None:
        """Send while answers to earlier requests are due: read them whenever they arrive.

        The daemon stops reading a connection whose answers are not being read; blocking in
        ``sendall`` then would wait forever for room the daemon never makes.
        """
        sock = self._sock
        view = memoryview(data)
        deadline = time.monotonic() + self.timeout
        try:
            while view:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._drop()
                    raise RequestTimeoutError(f"could not send to the daemon within {self.timeout}s")
                readable, writable, _ = select.select([sock], [sock], [], left)
                if readable:
                    self._read_some(None)
                    sock = self._sock
                if writable and sock is not None:
                    try:
                        n = sock.send(view)
                    except (BlockingIOError, InterruptedError):
                        continue
                    view = view[n:]
                    deadline = time.monotonic() + self.timeout
        except OSError as exc:
            self._raise_goodbye()
            self._drop()
            raise ConnectionLostError(f"cannot send to the daemon: {exc}") from None
        finally:
            view.release()

    def _raise_goodbye(self) -> None:
        """If the daemon closed after a connection-level error (e.g. permission denied), raise it."""
        sock, proto = self._sock, self._proto
        if sock is None or proto is None:
            return
        try:
            sock.settimeout(0.5)
            data = sock.recv(1 << 16)
        except OSError:
            return
        proto.receive_data(data)
        ev = proto.next_event()
        if isinstance(ev, (ErrorResponse, ConnectionFailed)) and ev.request_id == 0:
            self._drop()
            raise ev.error

    def _call_batch(self, method: str, handle: int, items: list, pairs: bool) -> list:
        """One batch operation: a single request when it fits the daemon's limits (the common case:
        the frame is encoded once, its size checked after), else split and pipelined."""
        with self._lock:
            proto = self._ensure()
            lim = self.limits
            if len(items) <= lim.max_batch:
                rid, data = getattr(proto, method)(handle, items)
                if len(data) - _BATCH_HEAD <= lim.budget:
                    self._send(data)
                    return [self._wait(rid)]
                proto.forget(rid)
            return self._call_many(method, handle, _split(items, lim.max_batch, lim.budget, pairs))

    def _call_many(self, method: str, first, batches: list) -> list:
        """Pipeline one request per batch (at most ``max_inflight`` unanswered); answers in order."""
        with self._lock:
            proto = self._ensure()
            if len(batches) == 1:
                rid, data = getattr(proto, method)(first, batches[0])
                self._send(data)
                return [self._wait(rid)]
            window = self.limits.max_inflight
            rids: list[int] = []
            out: list = []
            fn = getattr(proto, method)
            sent = 0
            errors: list[BaseException] = []
            while len(out) < len(batches):
                while sent < len(batches) and sent - len(out) < window:
                    rid, data = fn(first, batches[sent])
                    if sent > len(out):  # answers are due: never block in send without reading them
                        self._send_reading(data)
                    else:
                        self._send(data)
                    rids.append(rid)
                    sent += 1
                try:
                    out.append(self._wait(rids[len(out)]))
                except ConnectionLostError:
                    raise
                except Exception as exc:  # keep reading the other answers, raise the first error after
                    errors.append(exc)
                    out.append(None)
            if errors:
                raise errors[0]
            return out

    def _call_columns(self, method: str, handle: int, n: int, cols: tuple) -> list:
        """A batch given as Arrow-layout columns: its requests pipelined (``_call_many``'s rules)."""
        with self._lock:
            proto = self._ensure()
            frames = _column_frames(proto, self.limits, method, handle, n, cols)
            window = self.limits.max_inflight
            out: list = []
            errors: list[BaseException] = []
            sent = 0
            while len(out) < len(frames):
                while sent < len(frames) and sent - len(out) < window:
                    if sent > len(out):
                        self._send_reading(frames[sent][1])
                    else:
                        self._send(frames[sent][1])
                    sent += 1
                try:
                    out.append(self._wait(frames[len(out)][0]))
                except ConnectionLostError:
                    raise
                except Exception as exc:
                    errors.append(exc)
                    out.append(None)
            if errors:
                raise errors[0]
            return out

    # -- the API --
    def _check_gen(self, generation: int) -> None:
        if generation != self.generation or self._sock is None or self._pid != os.getpid():
            raise InterfaceError("this store handle belongs to a connection that is gone (closed, lost or forked)")

    def ping(self, payload: bytes = b"") -> bytes:
        return self._call("send_ping", payload)

    def stats(self) -> dict:
        return self._call("send_stats")

    def release(self, root: str, operator_id: str, partitions, store_name: str = DEFAULT_STORE_NAME) -> dict:
        """Ask the daemon to drop its idle copies of these partitions of an operator's store:
        ``partitions`` are ids or ``(id, below)`` pairs (then only a copy whose head version is lower).

        Returns ``{"released": [...], "kept": [...], "held": [...]}`` (``StoreRegistry.release``)."""
        return self._call("send_release", root, operator_id, partitions, store_name)

    def open(self, store_id: StoreId, version: int, ckptid: str | None = None) -> "StoreHandle":
        """Open committed ``version`` of ``store_id`` (attempt ``ckptid``) for update."""
        with self._lock:
            handle, ref = self._call("send_open", store_id, version, ckptid)
            return StoreHandle(self, handle, store_id, ref, self.generation)

    def await_durable(self, store_id: StoreId, ref: CheckpointRef, timeout: float = 30.0) -> bool:
        """True once the daemon has made ``ref`` of ``store_id`` durable; False on timeout."""
        return self._call("send_await_durable", store_id, ref, float(timeout), timeout=max(self.timeout, timeout + 5))


class StoreHandle:
    """One open version of a store (single-use: commit or abort it; ``with`` aborts on error)."""

    def __init__(self, client: Client, handle: int, store_id: StoreId, ref: CheckpointRef, generation: int):
        self.client = client
        self.handle = handle
        self.store_id = store_id
        self.ref = ref
        self._gen = generation
        self.done = False

    @property
    def version(self) -> int:
        return self.ref.version

    def get_many(self, keys: Iterable[bytes]) -> list:
        """The value of each key (None when absent), this version's changes included."""
        keys = keys if isinstance(keys, list) else list(keys)
        with self.client._lock:
            self.client._check_gen(self._gen)
            parts = self.client._call_batch("send_get_many", self.handle, keys, False)
        if len(parts) == 1:
            return parts[0]
        return [v for part in parts for v in part]

    def get(self, key: bytes):
        return self.get_many([key])[0]

    def get_many_arrow(self, keys):
        """``get_many`` of a pyarrow ``binary``/``large_binary`` array of keys; the values come back as
        a pyarrow binary array (null: absent). No Python object is made per key or value here."""
        n, col = arrowframes.column(keys, "keys")
        with self.client._lock:
            self.client._check_gen(self._gen)
            parts = self.client._call_columns("send_get_many_buffers", self.handle, n, (col,))
        return _arrow_values(parts)

    def put_many_arrow(self, keys, values) -> int:
        """``put_many`` of two pyarrow ``binary``/``large_binary`` arrays of equal length (no nulls),
        sent straight from their buffers."""
        n, cols = _arrow_pair(keys, values)
        with self.client._lock:
            self.client._check_gen(self._gen)
            return sum(self.client._call_columns("send_put_many_buffers", self.handle, n, cols))

    def remove_many_arrow(self, keys) -> int:
        """``remove_many`` of a pyarrow ``binary``/``large_binary`` array of keys (no nulls)."""
        n, col = arrowframes.column(keys, "keys")
        with self.client._lock:
            self.client._check_gen(self._gen)
            return sum(self.client._call_columns("send_remove_many_buffers", self.handle, n, (col,)))

    def put_many(self, items: Iterable[tuple[bytes, bytes]]) -> int:
        items = items if isinstance(items, list) else list(items)
        with self.client._lock:
            self.client._check_gen(self._gen)
            return sum(self.client._call_batch("send_put_many", self.handle, items, True))

    def put(self, key: bytes, value: bytes) -> None:
        self.put_many([(key, value)])

    def remove_many(self, keys: Iterable[bytes]) -> int:
        keys = keys if isinstance(keys, list) else list(keys)
        with self.client._lock:
            self.client._check_gen(self._gen)
            return sum(self.client._call_batch("send_remove_many", self.handle, keys, False))

    def remove(self, key: bytes) -> None:
        self.remove_many([key])

    def scan(self, prefix: bytes = b"", limit: int | None = None) -> Iterator[tuple[bytes, bytes]]:
        """Every (key, value) whose key starts with ``prefix`` (at most ``limit``), streamed in chunks."""
        c = self.client
        with c._lock:
            c._check_gen(self._gen)
            rid, data = c._proto.send_scan(self.handle, prefix, limit)
            c._send(data)
        while True:
            with c._lock:
                ev = c._next(rid)
            yield from ev.value
            if not ev.more:
                return

    # --- rows (plain Python values; see statestore_async.codecs.pyrows) -----------------------------------
    def put_rows(self, items, *, key_types=None, num_key_groups: int = DEFAULT_KEY_GROUPS) -> int:
        """Put (key row, value) pairs: key rows are tuples of the key columns, values any row-codec value."""
        items = items if isinstance(items, list) else list(items)
        keys = rows.encode_keys([k for k, _ in items], key_types, num_key_groups)
        return self.put_many(list(zip(keys, rows.encode_values([v for _, v in items]))))

    def get_rows(self, keys, *, key_types=None, num_key_groups: int = DEFAULT_KEY_GROUPS) -> list:
        """Values of key rows (None where absent)."""
        return rows.decode_values(self.get_many(rows.encode_keys(keys, key_types, num_key_groups)))

    def remove_rows(self, keys, *, key_types=None, num_key_groups: int = DEFAULT_KEY_GROUPS) -> int:
        return self.remove_many(rows.encode_keys(keys, key_types, num_key_groups))

    def scan_rows(self, limit: int | None = None) -> Iterator[tuple[tuple, object]]:
        """Every (key row, value) of the version (keys written by the ``*_rows`` calls)."""
        for k, v in self.scan(b"", limit):
            yield rows.decode_key(k), valuecodec.decode_row(v)

    def commit(self, ckptid: str | None = None) -> CheckpointRef:
        """Commit as version ``version + 1``; returns its (version, ckptid) once queued for upload."""
        with self.client._lock:
            self.client._check_gen(self._gen)
            ref = self.client._call("send_commit", self.handle, ckptid)
        self.done = True
        return ref

    def abort(self) -> None:
        """Drop this version's changes (a no-op on a lost connection: the daemon aborted it)."""
        if self.done:
            return
        self.done = True
        with self.client._lock:
            try:
                self.client._check_gen(self._gen)
            except InterfaceError:
                return
            self.client._call("send_abort", self.handle)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if not self.done:
            self.abort()


def _forget_shared_after_fork() -> None:
    Client._shared_lock = threading.Lock()
    Client._shared = {path: c for path, c in Client._shared.items()}
    for c in Client._shared.values():
        c._lock = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_shared_after_fork)


# --- asyncio client -------------------------------------------------------------------------------
class AsyncClient:
    """An asyncio connection to the daemon; requests from many tasks are pipelined on it."""

    def __init__(self, socket_path: str | None = None, *, timeout: float = DEFAULT_TIMEOUT,
                 name: str = "statestore_async.asyncclient"):
        self.socket_path = socket_path or default_socket_path()
        self.timeout = timeout
        self.name = name
        self._proto: ClientProtocol | None = None
        self._reader = self._writer = None
        self._task: asyncio.Task | None = None
        self._waiters: dict[int, object] = {}
        self._error: BaseException | None = None
        self._slots: asyncio.Semaphore | None = None
        self.limits: _Limits | None = None

    @classmethod
    async def connect(cls, socket_path: str | None = None, **kwargs) -> "AsyncClient":
        c = cls(socket_path, **kwargs)
        await c._connect()
        return c

    async def _connect(self) -> None:
        try:
            self._reader, self._writer = await asyncio.open_unix_connection(self.socket_path)
        except OSError as exc:
            raise ConnectionLostError(f"cannot connect to the daemon at {self.socket_path}: {exc}") from None
        self._proto = ClientProtocol()
        self._task = asyncio.get_running_loop().create_task(self._read_loop())
        self._slots = asyncio.Semaphore(1)
        info = await self._call("send_hello", self.name)
        self.limits = _Limits(info.limits)
        self._slots = asyncio.Semaphore(self.limits.max_inflight)

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            try:
                await self._writer.wait_closed()
            except OSError:
                pass
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        self._fail(ConnectionLostError("the client was closed"))

    async def __aenter__(self):
        if self._proto is None:
            await self._connect()
        return self

    async def __aexit__(self, *exc):
        await self.close()

    def _fail(self, exc: BaseException) -> None:
        if self._error is None:
            self._error = exc
        waiters, self._waiters = self._waiters, {}
        for w in waiters.values():
            if isinstance(w, asyncio.Queue):
                w.put_nowait(exc)
            elif not w.done():
                w.set_exception(exc)

    async def _read_loop(self) -> None:
        proto = self._proto
        try:
            while True:
                data = await self._reader.read(1 << 20)
                if not data:
                    raise ConnectionLostError("the daemon closed the connection")
                proto.receive_data(data)
                while True:
                    ev = proto.next_event()
                    if ev is NEED_DATA or ev is CLOSED:
                        break
                    if isinstance(ev, ConnectionFailed) or (isinstance(ev, ErrorResponse) and ev.request_id == 0):
                        raise ev.error
                    w = self._waiters.get(ev.request_id)
                    if w is None:
                        continue
                    if isinstance(w, asyncio.Queue):
                        w.put_nowait(ev)
                        if isinstance(ev, ErrorResponse) or not ev.more:
                            del self._waiters[ev.request_id]
                    else:
                        del self._waiters[ev.request_id]
                        if not w.done():
                            if isinstance(ev, ErrorResponse):
                                w.set_exception(ev.error)
                            else:
                                w.set_result(ev.value)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._fail(exc if isinstance(exc, Exception) else ConnectionLostError(str(exc)))

    def _start(self, method: str, *args, stream: bool = False):
        if self._error is not None:
            raise self._error
        rid, data = getattr(self._proto, method)(*args)
        return rid, self._send(rid, data, stream)

    def _send(self, rid: int, data: bytes, stream: bool = False):
        w = asyncio.Queue() if stream else asyncio.get_running_loop().create_future()
        self._waiters[rid] = w
        self._writer.write(data)
        return w

    async def _answer(self, rid: int, fut, timeout: float | None):
        try:
            return await asyncio.wait_for(fut, timeout or self.timeout)
        except asyncio.TimeoutError:
            self._proto.forget(rid)
            self._waiters.pop(rid, None)
            raise RequestTimeoutError(f"no answer from the daemon within {timeout or self.timeout}s") from None

    async def _call(self, method: str, *args, timeout: float | None = None):
        async with self._slots:
            rid, fut = self._start(method, *args)
            return await self._answer(rid, fut, timeout)

    async def _call_batch(self, method: str, handle: int, items: list, pairs: bool) -> list:
        """Like ``Client._call_batch``: one request when the batch fits, else split and pipelined."""
        lim = self.limits
        if len(items) <= lim.max_batch:
            async with self._slots:
                if self._error is not None:
                    raise self._error
                rid, data = getattr(self._proto, method)(handle, items)
                if len(data) - _BATCH_HEAD <= lim.budget:
                    return [await self._answer(rid, self._send(rid, data), None)]
                self._proto.forget(rid)
        return await self._call_many(method, handle, _split(items, lim.max_batch, lim.budget, pairs))

    async def _call_columns(self, method: str, handle: int, n: int, cols: tuple) -> list:
        if self._error is not None:
            raise self._error
        frames = _column_frames(self._proto, self.limits, method, handle, n, cols)

        async def one(rid: int, data: bytes):
            async with self._slots:
                if self._error is not None:
                    raise self._error
                return await self._answer(rid, self._send(rid, data), None)

        return list(await asyncio.gather(*(one(rid, data) for rid, data in frames)))

    async def _call_many(self, method: str, first, batches: list) -> list:
        return list(await asyncio.gather(*(self._call(method, first, b) for b in batches)))

    async def ping(self, payload: bytes = b"") -> bytes:
        return await self._call("send_ping", payload)

    async def stats(self) -> dict:
        return await self._call("send_stats")

    async def release(self, root: str, operator_id: str, partitions, store_name: str = DEFAULT_STORE_NAME) -> dict:
        """See ``Client.release``."""
        return await self._call("send_release", root, operator_id, partitions, store_name)

    async def open(self, store_id: StoreId, version: int, ckptid: str | None = None) -> "AsyncStoreHandle":
        handle, ref = await self._call("send_open", store_id, version, ckptid)
        return AsyncStoreHandle(self, handle, store_id, ref)

    async def await_durable(self, store_id: StoreId, ref: CheckpointRef, timeout: float = 30.0) -> bool:
        return await self._call("send_await_durable", store_id, ref, float(timeout), timeout=max(self.timeout, timeout + 5))


class AsyncStoreHandle:
    """One open version of a store, asyncio flavour (``async with`` aborts when not committed)."""

    def __init__(self, client: AsyncClient, handle: int, store_id: StoreId, ref: CheckpointRef):
        self.client = client
        self.handle = handle
        self.store_id = store_id
        self.ref = ref
        self.done = False

    @property
    def version(self) -> int:
        return self.ref.version

    async def get_many(self, keys: Iterable[bytes]) -> list:
        keys = keys if isinstance(keys, list) else list(keys)
        parts = await self.client._call_batch("send_get_many", self.handle, keys, False)
        return parts[0] if len(parts) == 1 else [v for p in parts for v in p]

    async def get_many_arrow(self, keys):
        """See ``StoreHandle.get_many_arrow``."""
        n, col = arrowframes.column(keys, "keys")
        return _arrow_values(await self.client._call_columns("send_get_many_buffers", self.handle, n, (col,)))

    async def put_many_arrow(self, keys, values) -> int:
        """See ``StoreHandle.put_many_arrow``."""
        n, cols = _arrow_pair(keys, values)
        return sum(await self.client._call_columns("send_put_many_buffers", self.handle, n, cols))

    async def remove_many_arrow(self, keys) -> int:
        """See ``StoreHandle.remove_many_arrow``."""
        n, col = arrowframes.column(keys, "keys")
        return sum(await self.client._call_columns("send_remove_many_buffers", self.handle, n, (col,)))

    async def put_many(self, items: Iterable[tuple[bytes, bytes]]) -> int:
        items = items if isinstance(items, list) else list(items)
        return sum(await self.client._call_batch("send_put_many", self.handle, items, True))

    async def remove_many(self, keys: Iterable[bytes]) -> int:
        keys = keys if isinstance(keys, list) else list(keys)
        return sum(await self.client._call_batch("send_remove_many", self.handle, keys, False))

    async def scan(self, prefix: bytes = b"", limit: int | None = None):
        """Async iterator of (key, value) whose key starts with ``prefix``."""
        c = self.client
        async with c._slots:
            rid, q = c._start("send_scan", self.handle, prefix, limit, stream=True)
            while True:
                ev = await asyncio.wait_for(q.get(), c.timeout)
                if isinstance(ev, BaseException):
                    raise ev
                if isinstance(ev, ErrorResponse):
                    raise ev.error
                for kv in ev.value:
                    yield kv
                if not ev.more:
                    return

    # --- rows (plain Python values; see statestore_async.codecs.pyrows) -----------------------------------
    async def put_rows(self, items, *, key_types=None, num_key_groups: int = DEFAULT_KEY_GROUPS) -> int:
        items = items if isinstance(items, list) else list(items)
        keys = rows.encode_keys([k for k, _ in items], key_types, num_key_groups)
        return await self.put_many(list(zip(keys, rows.encode_values([v for _, v in items]))))

    async def get_rows(self, keys, *, key_types=None, num_key_groups: int = DEFAULT_KEY_GROUPS) -> list:
        return rows.decode_values(await self.get_many(rows.encode_keys(keys, key_types, num_key_groups)))

    async def remove_rows(self, keys, *, key_types=None, num_key_groups: int = DEFAULT_KEY_GROUPS) -> int:
        return await self.remove_many(rows.encode_keys(keys, key_types, num_key_groups))

    async def scan_rows(self, limit: int | None = None):
        async for k, v in self.scan(b"", limit):
            yield rows.decode_key(k), valuecodec.decode_row(v)

    async def commit(self, ckptid: str | None = None) -> CheckpointRef:
        ref = await self.client._call("send_commit", self.handle, ckptid)
        self.done = True
        return ref

    async def abort(self) -> None:
        if self.done:
            return
        self.done = True
        if self.client._error is None:
            await self.client._call("send_abort", self.handle)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        if not self.done:
            await self.abort()
