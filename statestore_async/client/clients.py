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
from collections.abc import Iterable

from statestore_async.client.arrow import pair_columns as _arrow_pair
from statestore_async.client.arrow import values_array as _arrow_values
from statestore_async.client.blocking import Client, StaleHandleError, StoreHandle
from statestore_async.client.common import DEFAULT_TIMEOUT, RequestTimeoutError
from statestore_async.client.pipeline import _BATCH_HEAD
from statestore_async.client.pipeline import Limits as _Limits
from statestore_async.client.pipeline import split as _split
from statestore_async.codecs import arrowframes, valuecodec
from statestore_async.codecs import pyrows as rows
from statestore_async.codecs.keylayout import DEFAULT_KEY_GROUPS
from statestore_async.config import default_socket_path
from statestore_async.errors import LimitExceededError
from statestore_async.ids import DEFAULT_STORE_NAME, CheckpointRef, StoreId
from statestore_async.wire.protocol import (
    CLOSED,
    NEED_DATA,
    ClientProtocol,
    ConnectionFailed,
    ConnectionLostError,
    ErrorResponse,
)

__all__ = ["DEFAULT_TIMEOUT", "AsyncClient", "AsyncStoreHandle", "Client", "RequestTimeoutError",
           "StaleHandleError", "StoreHandle"]


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
