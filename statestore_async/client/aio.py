"""The asyncio ``AsyncClient`` and its ``AsyncStoreHandle``."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Sequence
from contextlib import aclosing
from typing import Any, TypeVar

from statestore_async.client.arrow import pair_columns, values_array
from statestore_async.client.blocking import check_socket_path, connect_error
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
from statestore_async.errors import InterfaceError
from statestore_async.ids import DEFAULT_STORE_NAME, CheckpointRef, StoreId
from statestore_async.wire.events import CLOSED, NEED_DATA, ConnectionFailed, ErrorResponse, Response
from statestore_async.wire.protocol import ClientProtocol, ConnectionLostError, check_ranges

_Answer = Response | ErrorResponse | BaseException  # what a streamed answer's queue carries
_W = TypeVar("_W", asyncio.Future[Any], asyncio.Queue[_Answer])
_NOT_CONNECTED = "the client is not connected: use `await AsyncClient.connect(...)` or `async with`"


class AsyncClient:
    """An asyncio connection to the daemon; requests from many tasks are pipelined on it.

    ``AsyncStoreHandle`` talks to it only through ``call``, ``call_batch``, ``call_columns``,
    ``stream`` and ``closed``; each takes the request as an encoder (see ``client.common``).
    """

    def __init__(self, socket_path: str | None = None, *, timeout: float = DEFAULT_TIMEOUT,
                 name: str = "statestore_async.asyncclient"):
        self.socket_path = check_socket_path(socket_path or default_socket_path())
        self.timeout = timeout
        self.name = name
        self._proto: ClientProtocol | None = None
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._task: asyncio.Task[None] | None = None
        self._waiters: dict[int, asyncio.Future[Any] | asyncio.Queue[_Answer]] = {}
        self._error: BaseException | None = None
        self._slots = asyncio.Semaphore(1)  # requests in flight: max_inflight once HELLO has told it
        self.limits: Limits | None = None

    @classmethod
    async def connect(cls, socket_path: str | None = None, **kwargs: Any) -> AsyncClient:
        c = cls(socket_path, **kwargs)
        await c._connect()
        return c

    async def _connect(self) -> None:
        try:
            self._reader, self._writer = await asyncio.open_unix_connection(self.socket_path)
        except OSError as exc:
            check_socket_path(self.socket_path)  # what became of the path, if it cannot hold a socket now
            raise connect_error(self.socket_path, exc) from None
        self._proto = proto = ClientProtocol()
        self._task = asyncio.get_running_loop().create_task(self._read_loop(self._reader, proto))
        self._slots = asyncio.Semaphore(1)
        info = await self.call(lambda p: p.send_hello(self.name))
        self.limits = Limits(info.limits)
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

    async def __aenter__(self) -> AsyncClient:
        if self._proto is None:
            await self._connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
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

    async def _read_loop(self, reader: asyncio.StreamReader, proto: ClientProtocol) -> None:
        try:
            while True:
                data = await reader.read(1 << 20)
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
        except OSError as exc:  # reset, broken pipe: the daemon went away (stopped, killed)
            self._fail(ConnectionLostError(f"the connection to the daemon was lost: {exc}"))
        except BaseException as exc:
            self._fail(exc if isinstance(exc, Exception) else ConnectionLostError(str(exc)))

    def _protocol(self) -> ClientProtocol:
        """The live connection's protocol (raising what broke the connection)."""
        if self._error is not None:
            raise self._error
        if self._proto is None:
            raise InterfaceError(_NOT_CONNECTED)
        return self._proto

    def _live(self) -> tuple[ClientProtocol, Limits]:
        """The live connection's protocol and the daemon's limits (raising what broke the connection)."""
        proto, limits = self._proto, self.limits
        if self._error is not None:
            raise self._error
        if proto is None or limits is None:
            raise InterfaceError(_NOT_CONNECTED)
        return proto, limits

    def _send(self, rid: int, data: bytes, waiter: _W) -> _W:
        """Send request ``rid``; its answer goes to ``waiter`` (a future; a queue for a streamed answer)."""
        writer = self._writer
        if self._error is not None:
            raise self._error
        if writer is None:
            raise InterfaceError(_NOT_CONNECTED)
        self._waiters[rid] = waiter
        try:
            writer.write(data)
        except OSError as exc:  # the daemon closed the connection before the reader saw it
            self._waiters.pop(rid, None)
            lost = ConnectionLostError(f"the daemon closed the connection: {exc}")
            self._fail(lost)
            raise lost from None
        return waiter

    async def _answer(self, rid: int, fut: asyncio.Future[Any], timeout: float | None) -> Any:
        try:
            return await asyncio.wait_for(fut, timeout or self.timeout)
        except TimeoutError:
            if self._proto is not None:
                self._proto.forget(rid)
            self._waiters.pop(rid, None)
            raise RequestTimeoutError(f"no answer from the daemon within {timeout or self.timeout}s") from None

    async def _pipelined(self, frames: Iterable[Frame], window: int) -> list[Any]:
        """The answers to ``frames``, in order: ``pipeline``'s steps done on the connection.

        Each request holds one of the connection's ``max_inflight`` slots from its send until its
        answer arrives (so that pipelines of several tasks never wait for each other's slots)."""
        slots, loop = self._slots, asyncio.get_running_loop()
        sent: dict[int, asyncio.Future[Any]] = {}  # sent and not answered
        todo = iter(frames)
        steps = pipeline(todo, window)
        try:
            step = next(steps)
            while True:
                if isinstance(step, Send):
                    try:
                        await slots.acquire()
                    except BaseException:
                        self._forget(step.rid)
                        raise
                    try:
                        fut = self._send(step.rid, step.data, loop.create_future())
                    except BaseException:
                        slots.release()
                        raise
                    fut.add_done_callback(lambda _: slots.release())
                    sent[step.rid] = fut
                    step = steps.send(None)
                    continue
                rid = step.rid
                try:
                    answer = await self._answer(rid, sent[rid], None)
                except Exception as exc:
                    del sent[rid]
                    step = steps.throw(exc)
                else:
                    del sent[rid]
                    step = steps.send(answer)
        except StopIteration as done:
            answers: list[Any] = done.value
            return answers
        finally:  # after an error or a cancellation: drop what is left
            for rid, fut in sent.items():
                fut.cancel()
                self._forget(rid)
            if isinstance(frames, list):  # encoded, never sent (a lazy iterator encodes nothing more)
                for rid, _ in todo:
                    self._forget(rid)

    def _forget(self, rid: int) -> None:
        """Stop expecting an answer to ``rid``."""
        self._waiters.pop(rid, None)
        if self._proto is not None:
            self._proto.forget(rid)

    # -- the interface of AsyncStoreHandle --
    @property
    def closed(self) -> bool:
        """True once the connection was closed or lost: requests then raise why."""
        return self._error is not None

    async def call(self, encode: Request, *, timeout: float | None = None) -> Any:
        """Send the request ``encode`` makes and return its answer (its error raised)."""
        async with self._slots:
            rid, data = encode(self._protocol())
            fut = asyncio.get_running_loop().create_future()
            return await self._answer(rid, self._send(rid, data, fut), timeout)

    async def call_batch(self, encode: BatchRequest, handle: int, items: list[Any], *, pairs: bool) -> list[Any]:
        """The answers to one batch operation on ``items`` (keys, or (key, value) pairs): one request
        when it fits the daemon's limits, else split and pipelined (``pipeline.batch_frames``)."""
        proto, limits = self._live()
        frames = batch_frames(proto, limits, encode, handle, items, pairs)
        if isinstance(frames, tuple):  # the common case: one request, nothing to pipeline
            rid, data = frames
            try:
                async with self._slots:
                    fut = asyncio.get_running_loop().create_future()
                    return [await self._answer(rid, self._send(rid, data, fut), None)]
            except asyncio.CancelledError:  # before its turn came, or while it waited for the answer
                self._forget(rid)
                raise
        return await self._pipelined(frames, limits.max_inflight)

    async def call_columns(self, encode: ColumnsRequest, handle: int, n: int, cols: tuple[Any, ...]) -> list[Any]:
        """``call_batch`` of a batch of ``n`` items given as Arrow-layout columns (``pipeline.column_frames``)."""
        proto, limits = self._live()
        return await self._pipelined(column_frames(proto, limits, encode, handle, n, cols), limits.max_inflight)

    async def stream(self, encode: Request) -> AsyncGenerator[Any, None]:
        """Send the request ``encode`` makes; yield the value of each chunk of its streamed answer
        (holding one slot throughout)."""
        async with self._slots:
            rid, data = encode(self._protocol())
            q: asyncio.Queue[_Answer] = self._send(rid, data, asyncio.Queue())
            while True:
                ev = await asyncio.wait_for(q.get(), self.timeout)
                if isinstance(ev, BaseException):
                    raise ev
                if isinstance(ev, ErrorResponse):
                    raise ev.error
                yield ev.value
                if not ev.more:
                    return

    # -- the API --
    async def ping(self, payload: bytes = b"") -> bytes:
        return await self.call(lambda p: p.send_ping(payload))

    async def stats(self) -> dict[str, Any]:
        return await self.call(lambda p: p.send_stats())

    async def release(self, root: str, operator_id: str, partitions: Iterable[int | tuple[int, int]],
                      store_name: str = DEFAULT_STORE_NAME) -> dict[str, Any]:
        """See ``Client.release``."""
        return await self.call(lambda p: p.send_release(root, operator_id, partitions, store_name))

    async def open(self, store_id: StoreId, version: int, ckptid: str | None = None) -> AsyncStoreHandle:
        handle, ref = await self.call(lambda p: p.send_open(store_id, version, ckptid))
        return AsyncStoreHandle(self, handle, store_id, ref)

    async def await_durable(self, store_id: StoreId, ref: CheckpointRef, timeout: float = 30.0) -> bool:
        return await self.call(lambda p: p.send_await_durable(store_id, ref, float(timeout)),
                               timeout=max(self.timeout, timeout + 5))


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

    async def get_many(self, keys: Iterable[bytes]) -> list[bytes | None]:
        keys = keys if isinstance(keys, list) else list(keys)
        parts = await self.client.call_batch(ClientProtocol.send_get_many, self.handle, keys, pairs=False)
        return parts[0] if len(parts) == 1 else [v for p in parts for v in p]

    async def get_many_arrow(self, keys: Any) -> Any:
        """See ``StoreHandle.get_many_arrow``."""
        n, col = arrowframes.column(keys, "keys")
        return values_array(await self.client.call_columns(ClientProtocol.send_get_many_buffers, self.handle, n,
                                                           (col,)))

    async def put_many_arrow(self, keys: Any, values: Any) -> int:
        """See ``StoreHandle.put_many_arrow``."""
        n, cols = pair_columns(keys, values)
        return sum(await self.client.call_columns(ClientProtocol.send_put_many_buffers, self.handle, n, cols))

    async def remove_many_arrow(self, keys: Any) -> int:
        """See ``StoreHandle.remove_many_arrow``."""
        n, col = arrowframes.column(keys, "keys")
        return sum(await self.client.call_columns(ClientProtocol.send_remove_many_buffers, self.handle, n, (col,)))

    async def put_many(self, items: Iterable[tuple[bytes, bytes]]) -> int:
        items = items if isinstance(items, list) else list(items)
        return sum(await self.client.call_batch(ClientProtocol.send_put_many, self.handle, items, pairs=True))

    async def remove_many(self, keys: Iterable[bytes]) -> int:
        keys = keys if isinstance(keys, list) else list(keys)
        return sum(await self.client.call_batch(ClientProtocol.send_remove_many, self.handle, keys, pairs=False))

    async def scan(self, prefix: bytes = b"", limit: int | None = None) -> AsyncIterator[tuple[bytes, bytes]]:
        """Async iterator of (key, value) whose key starts with ``prefix``."""
        handle = self.handle
        async with aclosing(self.client.stream(lambda p: p.send_scan(handle, prefix, limit))) as chunks:
            async for chunk in chunks:
                for kv in chunk:
                    yield kv

    async def scan_ranges(self, ranges: Iterable[tuple[bytes, bytes | None]],
                          limit: int | None = None) -> AsyncIterator[tuple[bytes, bytes]]:
        """Async iterator of every (key, value) with ``start <= key < stop`` for each of ``ranges``
        (ascending, disjoint; stop None: no upper bound), at most ``limit`` per range, in key order
        (see ``StoreHandle.scan_ranges``)."""
        checked = check_ranges(ranges)
        handle = self.handle
        step = max(1, self.client.limits.max_batch if self.client.limits is not None else len(checked))
        for i in range(0, len(checked), step):
            part = checked[i:i + step]
            async with aclosing(self.client.stream(scan_ranges_request(handle, part, limit))) as chunks:
                async for chunk in chunks:
                    for kv in chunk:
                        yield kv

    async def scan_range(self, start: bytes, stop: bytes | None = None,
                         limit: int | None = None) -> list[tuple[bytes, bytes]]:
        """The (key, value) with ``start <= key < stop`` (stop None: no upper bound), at most ``limit``."""
        if stop is not None and bytes(stop) <= bytes(start):
            return []
        return [kv async for kv in self.scan_ranges([(start, stop)], limit)]

    # --- rows (plain Python values; see statestore_async.codecs.pyrows) -----------------------------------
    async def put_rows(self, items: Iterable[tuple[tuple[Any, ...], Any]], *, key_types: Sequence[str] | None = None,
                       num_key_groups: int = DEFAULT_KEY_GROUPS) -> int:
        items = items if isinstance(items, list) else list(items)
        keys = rows.encode_keys([k for k, _ in items], key_types, num_key_groups)
        return await self.put_many(list(zip(keys, rows.encode_values([v for _, v in items]))))

    async def get_rows(self, keys: Sequence[tuple[Any, ...]], *, key_types: Sequence[str] | None = None,
                       num_key_groups: int = DEFAULT_KEY_GROUPS) -> list[Any]:
        return rows.decode_values(await self.get_many(rows.encode_keys(keys, key_types, num_key_groups)))

    async def remove_rows(self, keys: Sequence[tuple[Any, ...]], *, key_types: Sequence[str] | None = None,
                          num_key_groups: int = DEFAULT_KEY_GROUPS) -> int:
        return await self.remove_many(rows.encode_keys(keys, key_types, num_key_groups))

    async def scan_rows(self, limit: int | None = None) -> AsyncIterator[tuple[tuple[Any, ...], object]]:
        async for k, v in self.scan(b"", limit):
            yield rows.decode_key(k), valuecodec.decode_row(v)

    async def commit(self, ckptid: str | None = None) -> CheckpointRef:
        handle = self.handle
        ref: CheckpointRef = await self.client.call(lambda p: p.send_commit(handle, ckptid))
        self.done = True
        return ref

    async def abort(self) -> None:
        if self.done:
            return
        self.done = True
        if not self.client.closed:
            handle = self.handle
            await self.client.call(lambda p: p.send_abort(handle))

    async def __aenter__(self) -> AsyncStoreHandle:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if not self.done:
            await self.abort()
