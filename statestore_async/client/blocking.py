"""The blocking ``Client`` (one per Spark Python worker process) and its ``StoreHandle``."""
from __future__ import annotations

import errno
import os
import select
import socket
import stat
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from statestore_async.client.arrow import pair_columns, values_array
from statestore_async.client.common import (
    DEFAULT_TIMEOUT,
    BatchRequest,
    ColumnsRequest,
    Frame,
    Request,
    RequestTimeoutError,
    scan_ranges_request,
)
from statestore_async.client.pipeline import Limits, Send, batch_frames, column_frames, pipeline
from statestore_async.codecs import arrowframes, valuecodec
from statestore_async.codecs import pyrows as rows
from statestore_async.codecs.keylayout import DEFAULT_KEY_GROUPS
from statestore_async.config import default_socket_path
from statestore_async.errors import InterfaceError, SocketPathError
from statestore_async.ids import DEFAULT_STORE_NAME, CheckpointRef, StoreId
from statestore_async.wire.events import CLOSED, NEED_DATA, ConnectionFailed, ErrorResponse, Response
from statestore_async.wire.protocol import ClientProtocol, ConnectionLostError, check_ranges

_READ_SIZE = 1 << 20
SOCKET_PATH_MAX = 107  # bytes in a Unix socket's path (sun_path holds 108 with the final NUL)


def _socket_fix(path: str) -> str:
    return (f"Point the client at the daemon's socket: socket_path= (a StatefulOperator's, or the Client's) or "
            f"$STATESTORE_SOCKET; when neither is set the default is {default_socket_path()!r}. A daemon is started "
            f"with `statestore-async serve --socket {path}`.")


def check_socket_path(path: str) -> str:
    """``path`` when it can be a daemon's socket, else ``SocketPathError`` naming it and the fix, at
    once: an empty path, one longer than a Unix socket's path may be, a file or folder that is not a
    socket, or a path under a file. A path that does not exist yet is fine (a daemon may create it),
    and so is one this process may not look at (connecting says why)."""
    if not path:
        raise SocketPathError(f"the daemon socket path is empty. {_socket_fix('PATH')}")
    size = len(os.fsencode(path))
    if size > SOCKET_PATH_MAX:
        raise SocketPathError(f"daemon socket {path!r} is {size} bytes long; a Unix socket's path holds at most "
                              f"{SOCKET_PATH_MAX}: choose a shorter one. {_socket_fix('PATH')}")
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        parent = os.path.dirname(os.path.abspath(path))
        while True:
            try:
                mode = os.stat(parent).st_mode
            except FileNotFoundError:
                parent = os.path.dirname(parent)
                continue
            except OSError:
                return path
            if not stat.S_ISDIR(mode):
                raise SocketPathError(f"daemon socket {path!r} cannot exist: {parent!r} is a file, not a folder. "
                                      f"{_socket_fix(path)}") from None
            return path
    except OSError:
        return path
    if stat.S_ISSOCK(mode):
        return path
    what = "a folder" if stat.S_ISDIR(mode) else "a file" if stat.S_ISREG(mode) else "not a socket"
    inside = f" (the socket inside it, e.g. {os.path.join(path, 'daemon.sock')!r}?)" if stat.S_ISDIR(mode) else ""
    raise SocketPathError(f"daemon socket {path!r} is {what}, not a socket{inside}. {_socket_fix(path)}")


def connect_error(path: str, exc: OSError, timeout: float | None = None) -> ConnectionLostError:
    """The error for a failed connect to ``path``, naming it, what the OS said, and the fix."""
    if isinstance(exc, TimeoutError):
        why = f"the daemon at {path!r} did not accept the connection within {timeout}s (it is overloaded or stuck)"
    elif exc.errno == errno.ENOENT:
        why = f"no daemon socket at {path!r} (no daemon runs there, or the path is wrong)"
    elif exc.errno == errno.ECONNREFUSED:
        why = f"{path!r} is a socket no daemon listens on (the daemon stopped or died)"
    elif exc.errno in (errno.EACCES, errno.EPERM):
        why = (f"this user (uid {os.getuid()}) may not connect to {path!r}: the socket's or its folders' "
               "permissions (the daemon's socket_mode)")
    else:
        why = f"cannot connect to the daemon at {path!r}"
    return ConnectionLostError(f"{why}: {exc.strerror or exc}. {_socket_fix(path)}")


class StaleHandleError(InterfaceError):
    """A store handle used after its connection is gone (closed, lost or forked)."""


class Client:
    """A blocking connection to the daemon. Thread-safe (one request at a time); reconnects after fork.

    ``StoreHandle`` talks to it only through ``call``, ``call_batch``, ``call_columns`` and
    ``stream``: each takes the request as an encoder (see ``client.common``) and the handle's
    connection ``generation``, and raises ``StaleHandleError`` when that connection is gone.
    """

    _shared: dict[str, Client] = {}
    _shared_lock = threading.Lock()

    def __init__(self, socket_path: str | None = None, *, timeout: float = DEFAULT_TIMEOUT,
                 connect_timeout: float = 5.0, name: str = "statestore_async.client"):
        self.socket_path = check_socket_path(socket_path or default_socket_path())
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.name = name
        self._lock = threading.RLock()
        self._sock: socket.socket | None = None
        self._proto: ClientProtocol | None = None
        self._pid: int | None = None
        self._stash: dict[int, deque[Response | ErrorResponse]] = {}
        self._rbuf = bytearray(_READ_SIZE)  # every read lands here: no fresh buffer per read
        self.generation = 0
        self.limits: Limits | None = None
        self.server_info: dict[str, Any] = {}

    @classmethod
    def shared(cls, socket_path: str | None = None, **kwargs: Any) -> Client:
        """The process-wide client for ``socket_path`` (a new one in a forked child)."""
        path = socket_path or default_socket_path()
        with cls._shared_lock:
            c = cls._shared.get(path)
            if c is None:
                c = cls._shared[path] = cls(path, **kwargs)
            return c

    # -- connection --
    def _ensure(self) -> tuple[ClientProtocol, Limits]:
        """The live connection's protocol and limits (connecting first when there is none, or after a fork)."""
        proto, limits = self._proto, self.limits
        if proto is None or limits is None or self._pid != os.getpid():
            return self._connect()
        return proto, limits

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

    def _connect(self) -> tuple[ClientProtocol, Limits]:
        self._drop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.connect_timeout)
        try:
            sock.connect(self.socket_path)
        except OSError as exc:
            sock.close()
            check_socket_path(self.socket_path)  # what became of the path, if it cannot hold a socket now
            raise connect_error(self.socket_path, exc, self.connect_timeout) from None
        sock.settimeout(self.timeout)
        proto = ClientProtocol()
        self._sock, self._proto, self._pid = sock, proto, os.getpid()
        self.generation += 1
        try:
            rid, data = proto.send_hello(self.name)
            self._send(data)
            info = self._wait(rid)
        except BaseException:
            self._drop()
            raise
        self.server_info = info.limits
        self.limits = limits = Limits(info.limits)
        return proto, limits

    def close(self) -> None:
        """Close the connection (the daemon aborts versions left open on it)."""
        with self._lock:
            self._drop()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_gen(self, generation: int) -> None:
        if generation != self.generation or self._sock is None or self._pid != os.getpid():
            raise StaleHandleError("this store handle belongs to a connection that is gone (closed, lost or forked)")

    # -- socket IO --
    def _read_some(self, timeout: float | None) -> None:
        """Read what the daemon sent (at least one byte) and stash its answer events by request id."""
        sock = self._sock
        if sock is None:
            raise ConnectionLostError("the connection to the daemon was lost")
        if timeout is not None:
            sock.settimeout(timeout)
        rbuf = self._rbuf
        try:
            n = sock.recv_into(rbuf)
        except TimeoutError:
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
        if proto is None:
            raise ConnectionLostError("the connection to the daemon was lost")
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

    def _next(self, rid: int, timeout: float | None = None) -> Response:
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

    def _wait(self, rid: int, timeout: float | None = None) -> Any:
        return self._next(rid, timeout).value

    def _send(self, data: bytes) -> None:
        sock = self._sock
        if sock is None:
            raise ConnectionLostError("the connection to the daemon was lost")
        try:
            sock.sendall(data)
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
                if sock is None:
                    raise ConnectionLostError("the connection to the daemon was lost")
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

    def _pipelined(self, frames: Iterable[Frame], window: int) -> list[Any]:
        """The answers to ``frames``, in order: ``pipeline``'s steps done on the socket."""
        if isinstance(frames, list) and len(frames) == 1:  # one request, nothing to pipeline
            rid, data = frames[0]
            self._send(data)
            return [self._wait(rid)]
        steps = pipeline(frames, window)
        try:
            step = next(steps)
            while True:
                if isinstance(step, Send):
                    if step.answers_due:  # never block in send without reading them
                        self._send_reading(step.data)
                    else:
                        self._send(step.data)
                    step = steps.send(None)
                    continue
                try:
                    answer = self._wait(step.rid)
                except Exception as exc:
                    step = steps.throw(exc)
                else:
                    step = steps.send(answer)
        except StopIteration as done:
            answers: list[Any] = done.value
            return answers

    # -- the interface of StoreHandle --
    def call(self, encode: Request, *, generation: int | None = None, timeout: float | None = None) -> Any:
        """Send the request ``encode`` makes and return its answer (its error raised)."""
        with self._lock:
            if generation is not None:
                self._check_gen(generation)
            proto, _ = self._ensure()
            rid, data = encode(proto)
            self._send(data)
            return self._wait(rid, timeout)

    def call_batch(self, encode: BatchRequest, handle: int, items: list[Any], *, pairs: bool,
                   generation: int) -> list[Any]:
        """The answers to one batch operation on ``items`` (keys, or (key, value) pairs): one request
        when it fits the daemon's limits, else split and pipelined (``pipeline.batch_frames``)."""
        with self._lock:
            self._check_gen(generation)
            proto, limits = self._ensure()
            frames = batch_frames(proto, limits, encode, handle, items, pairs)
            if isinstance(frames, tuple):  # the common case: one request, nothing to pipeline
                rid, data = frames
                self._send(data)
                return [self._wait(rid)]
            return self._pipelined(frames, limits.max_inflight)

    def call_columns(self, encode: ColumnsRequest, handle: int, n: int, cols: tuple[Any, ...], *,
                     generation: int) -> list[Any]:
        """``call_batch`` of a batch of ``n`` items given as Arrow-layout columns (``pipeline.column_frames``)."""
        with self._lock:
            self._check_gen(generation)
            proto, limits = self._ensure()
            return self._pipelined(column_frames(proto, limits, encode, handle, n, cols), limits.max_inflight)

    def stream(self, encode: Request, *, generation: int) -> Iterator[Any]:
        """Send the request ``encode`` makes; yield the value of each chunk of its streamed answer."""
        rid = self.send(encode, generation=generation)
        yield from self.chunks(rid)

    def send(self, encode: Request, *, generation: int) -> int:
        """Send the request ``encode`` makes now, without waiting: its request id, for ``chunks``.
        Answers that arrive meanwhile are kept until read."""
        with self._lock:
            self._check_gen(generation)
            proto, _ = self._ensure()
            rid, data = encode(proto)
            self._send(data)
            return rid

    def chunks(self, rid: int) -> Iterator[Any]:
        """The value of each chunk of the streamed answer to the request ``rid`` (``send``)."""
        while True:
            with self._lock:
                ev = self._next(rid)
            yield ev.value
            if not ev.more:
                return

    # -- the API --
    def ping(self, payload: bytes = b"") -> bytes:
        return self.call(lambda p: p.send_ping(payload))

    def stats(self) -> dict[str, Any]:
        return self.call(lambda p: p.send_stats())

    def release(self, root: str, operator_id: str, partitions: Iterable[int | tuple[int, int]],
                store_name: str = DEFAULT_STORE_NAME) -> dict[str, Any]:
        """Ask the daemon to drop its idle copies of these partitions of an operator's store:
        ``partitions`` are ids or ``(id, below)`` pairs (then only a copy whose head version is lower).

        Returns ``{"released": [...], "kept": [...], "held": [...]}`` (``StoreRegistry.release``)."""
        return self.call(lambda p: p.send_release(root, operator_id, partitions, store_name))

    def open(self, store_id: StoreId, version: int, ckptid: str | None = None) -> StoreHandle:
        """Open committed ``version`` of ``store_id`` (attempt ``ckptid``) for update."""
        with self._lock:
            handle, ref = self.call(lambda p: p.send_open(store_id, version, ckptid))
            return StoreHandle(self, handle, store_id, ref, self.generation)

    def await_durable(self, store_id: StoreId, ref: CheckpointRef, timeout: float = 30.0) -> bool:
        """True once the daemon has made ``ref`` of ``store_id`` durable; False on timeout."""
        return self.call(lambda p: p.send_await_durable(store_id, ref, float(timeout)),
                         timeout=max(self.timeout, timeout + 5))


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

    def get_many(self, keys: Iterable[bytes]) -> list[bytes | None]:
        """The value of each key (None when absent), this version's changes included."""
        keys = keys if isinstance(keys, list) else list(keys)
        parts = self.client.call_batch(ClientProtocol.send_get_many, self.handle, keys, pairs=False,
                                       generation=self._gen)
        if len(parts) == 1:
            return parts[0]
        return [v for part in parts for v in part]

    def get(self, key: bytes) -> bytes | None:
        return self.get_many([key])[0]

    def get_many_arrow(self, keys: Any) -> Any:
        """``get_many`` of a pyarrow ``binary``/``large_binary`` array of keys; the values come back as
        a pyarrow binary array (null: absent). No Python object is made per key or value here."""
        n, col = arrowframes.column(keys, "keys")
        return values_array(self.client.call_columns(ClientProtocol.send_get_many_buffers, self.handle, n, (col,),
                                                     generation=self._gen))

    def put_many_arrow(self, keys: Any, values: Any) -> int:
        """``put_many`` of two pyarrow ``binary``/``large_binary`` arrays of equal length (no nulls),
        sent straight from their buffers."""
        n, cols = pair_columns(keys, values)
        return sum(self.client.call_columns(ClientProtocol.send_put_many_buffers, self.handle, n, cols,
                                            generation=self._gen))

    def remove_many_arrow(self, keys: Any) -> int:
        """``remove_many`` of a pyarrow ``binary``/``large_binary`` array of keys (no nulls)."""
        n, col = arrowframes.column(keys, "keys")
        return sum(self.client.call_columns(ClientProtocol.send_remove_many_buffers, self.handle, n, (col,),
                                            generation=self._gen))

    def put_many(self, items: Iterable[tuple[bytes, bytes]]) -> int:
        items = items if isinstance(items, list) else list(items)
        return sum(self.client.call_batch(ClientProtocol.send_put_many, self.handle, items, pairs=True,
                                          generation=self._gen))

    def put(self, key: bytes, value: bytes) -> None:
        self.put_many([(key, value)])

    def remove_many(self, keys: Iterable[bytes]) -> int:
        keys = keys if isinstance(keys, list) else list(keys)
        return sum(self.client.call_batch(ClientProtocol.send_remove_many, self.handle, keys, pairs=False,
                                          generation=self._gen))

    def remove(self, key: bytes) -> None:
        self.remove_many([key])

    def scan(self, prefix: bytes = b"", limit: int | None = None) -> Iterator[tuple[bytes, bytes]]:
        """Every (key, value) whose key starts with ``prefix`` (at most ``limit``), streamed in chunks."""
        handle = self.handle
        for chunk in self.client.stream(lambda p: p.send_scan(handle, prefix, limit), generation=self._gen):
            yield from chunk

    def scan_ranges(self, ranges: Iterable[tuple[bytes, bytes | None]],
                    limit: int | None = None) -> Iterator[tuple[bytes, bytes]]:
        """Every (key, value) with ``start <= key < stop`` for each of ``ranges`` (ascending, disjoint
        ``(start, stop)`` pairs, stop None: no upper bound; ``InterfaceError`` otherwise), at most
        ``limit`` per range, in key order: one SCAN_RANGES request per ``max_batch`` ranges, answered
        in chunks. Costs the daemon O(ranges × log n + records returned)."""
        checked = check_ranges(ranges)
        handle = self.handle
        step = self.client.limits.max_batch if self.client.limits is not None else len(checked)
        for i in range(0, len(checked), max(1, step)):
            part = checked[i:i + step]
            for chunk in self.client.stream(scan_ranges_request(handle, part, limit), generation=self._gen):
                yield from chunk

    def start_scan_ranges(self, ranges: Iterable[tuple[bytes, bytes | None]],
                          limit: int | None = None) -> Callable[[], list[tuple[bytes, bytes]]]:
        """``scan_ranges`` sent now, read later: its requests go out at once and the function returned
        collects the answer (the list ``scan_ranges`` would give), so the daemon scans while the
        caller works. Collect it before sending large requests on this client: the daemon stops
        reading a connection whose answers wait unread."""
        checked = check_ranges(ranges)
        handle = self.handle
        step = max(1, self.client.limits.max_batch if self.client.limits is not None else len(checked))
        rids = [self.client.send(scan_ranges_request(handle, checked[i:i + step], limit), generation=self._gen)
                for i in range(0, len(checked), step)]

        def collect() -> list[tuple[bytes, bytes]]:
            return [kv for rid in rids for chunk in self.client.chunks(rid) for kv in chunk]

        return collect

    def scan_range(self, start: bytes, stop: bytes | None = None, limit: int | None = None) -> list[tuple[bytes, bytes]]:
        """The (key, value) with ``start <= key < stop`` (stop None: no upper bound), at most
        ``limit``, in key order (``scan_ranges`` of one range; an empty range gives none)."""
        if stop is not None and bytes(stop) <= bytes(start):
            return []
        return list(self.scan_ranges([(start, stop)], limit))

    # --- rows (plain Python values; see statestore_async.codecs.pyrows) -----------------------------------
    def put_rows(self, items: Iterable[tuple[tuple[Any, ...], Any]], *, key_types: Sequence[str] | None = None,
                 num_key_groups: int = DEFAULT_KEY_GROUPS) -> int:
        """Put (key row, value) pairs: key rows are tuples of the key columns, values any row-codec value."""
        items = items if isinstance(items, list) else list(items)
        keys = rows.encode_keys([k for k, _ in items], key_types, num_key_groups)
        return self.put_many(list(zip(keys, rows.encode_values([v for _, v in items]))))

    def get_rows(self, keys: Sequence[tuple[Any, ...]], *, key_types: Sequence[str] | None = None,
                 num_key_groups: int = DEFAULT_KEY_GROUPS) -> list[Any]:
        """Values of key rows (None where absent)."""
        return rows.decode_values(self.get_many(rows.encode_keys(keys, key_types, num_key_groups)))

    def remove_rows(self, keys: Sequence[tuple[Any, ...]], *, key_types: Sequence[str] | None = None,
                    num_key_groups: int = DEFAULT_KEY_GROUPS) -> int:
        return self.remove_many(rows.encode_keys(keys, key_types, num_key_groups))

    def scan_rows(self, limit: int | None = None) -> Iterator[tuple[tuple[Any, ...], object]]:
        """Every (key row, value) of the version (keys written by the ``*_rows`` calls)."""
        for k, v in self.scan(b"", limit):
            yield rows.decode_key(k), valuecodec.decode_row(v)

    def commit(self, ckptid: str | None = None) -> CheckpointRef:
        """Commit as version ``version + 1``; returns its (version, ckptid) once queued for upload."""
        handle = self.handle
        ref: CheckpointRef = self.client.call(lambda p: p.send_commit(handle, ckptid), generation=self._gen)
        self.done = True
        return ref

    def abort(self) -> None:
        """Drop this version's changes (a no-op on a lost connection: the daemon aborted it)."""
        if self.done:
            return
        self.done = True
        handle = self.handle
        try:
            self.client.call(lambda p: p.send_abort(handle), generation=self._gen)
        except StaleHandleError:
            return

    def __enter__(self) -> StoreHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.done:
            self.abort()


def _forget_shared_after_fork() -> None:
    Client._shared_lock = threading.Lock()
    Client._shared = dict(Client._shared)
    for c in Client._shared.values():
        c._lock = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_shared_after_fork)
