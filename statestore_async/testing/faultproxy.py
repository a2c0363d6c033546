"""A fault-injecting HTTP/1.1 proxy to put between an S3 client and a real S3 server in tests.

It forwards each request to the upstream server unless a fault is due:
- ``latency``: seconds added before forwarding every request;
- ``error_rate``: share of requests answered ``503 SlowDown`` (S3's throttling reply) without
  reaching the server;
- ``reset_rate``: share of requests whose connection is cut (RST) before any answer;
- ``outage(seconds)``: for that long, every connection is cut at once (a network outage);
- ``drop_response_rate``: share of requests that are forwarded — the server acts on them — and
  whose connection is then cut before the answer reaches the client (a lost answer);
- ``drop_next_response(method, path_contains)``: the same, once, for the next request of that
  method whose target contains ``path_contains`` (each call arms one more).
It runs its own event loop in a thread, so it serves sync and async clients alike, and counts
what it did per kind in ``stats``, and the requests it forwarded per method and the body bytes of
their answers (``stats["GET"]``, ``stats["GET_bytes"]``, …): the object store's own request log.
"""
from __future__ import annotations

import asyncio
import random
import socket
import struct
import threading
import time
from collections import Counter
from typing import Self

_SLOWDOWN = (b"<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>SlowDown</Code>"
             b"<Message>Please reduce your request rate.</Message><RequestId>faultproxy</RequestId></Error>")


async def _read_message(reader: asyncio.StreamReader, writer: asyncio.StreamWriter | None = None) -> bytes | None:
    """One HTTP/1.1 message (head + body by Content-Length or chunked), or None at EOF.

    For a request with ``Expect: 100-continue`` (given the client's ``writer``) the proxy answers
    ``100 Continue`` itself so the client sends its body, and drops that header going upstream.
    """
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    lines = head.split(b"\r\n")
    headers = {}
    for line in lines[1:]:
        if b":" in line:
            k, v = line.split(b":", 1)
            headers[k.strip().lower()] = v.strip()
    if writer is not None and headers.get(b"expect", b"").lower() == b"100-continue":
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        await writer.drain()
        head = b"\r\n".join(ln for ln in lines if not ln.lower().startswith(b"expect:"))
    body = b""
    if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
        parts = []
        while True:
            size_line = await reader.readuntil(b"\r\n")
            size = int(size_line.split(b";")[0], 16)
            chunk = await reader.readexactly(size + 2)
            parts.append(size_line + chunk)
            if size == 0:
                # trailers end with an empty line; a bare CRLF follows the 0-size chunk otherwise
                if chunk != b"\r\n":
                    parts.append(await reader.readuntil(b"\r\n\r\n"))
                break
        body = b"".join(parts)
    elif b"content-length" in headers:
        body = await reader.readexactly(int(headers[b"content-length"]))
    return head + body


def _is_head_request(request: bytes) -> bool:
    return request.startswith(b"HEAD ")


async def _read_response(reader: asyncio.StreamReader, head_request: bool) -> bytes | None:
    if not head_request:
        return await _read_message(reader)
    try:
        return await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None


def _reset(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.transport.abort()


class FaultProxy:
    """``FaultProxy(upstream_port).start()``; point the client at ``endpoint_url``; ``stop()`` at the end."""

    def __init__(self, upstream_port: int, upstream_host: str = "127.0.0.1", *, seed: int = 1) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.latency = 0.0
        self.error_rate = 0.0
        self.reset_rate = 0.0
        self.drop_response_rate = 0.0
        self._drops: list[tuple[bytes, bytes]] = []  # armed one-shot lost answers: (method, in target)
        self._drops_lock = threading.Lock()
        self._outage_until = 0.0
        self._rnd = random.Random(seed)
        self.stats: Counter[str] = Counter()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._thread: threading.Thread | None = None
        self.port = 0
        self._conns: set[asyncio.StreamWriter] = set()
        self._handlers: set[asyncio.Task[None]] = set()

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def outage(self, seconds: float) -> None:
        """Cut every connection, and every new one, for ``seconds``."""
        self._outage_until = time.monotonic() + seconds
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._cut_all)

    def drop_next_response(self, method: str = "PUT", path_contains: str = "") -> None:
        """Forward the next ``method`` request whose target contains ``path_contains`` to the
        server, read the server's answer, and cut the client's connection instead of answering."""
        with self._drops_lock:
            self._drops.append((method.upper().encode(), path_contains.encode()))

    @property
    def armed_drops(self) -> int:
        """One-shot lost answers armed and not yet used."""
        with self._drops_lock:
            return len(self._drops)

    def _take_drop(self, request: bytes) -> bool:
        method, _, rest = request.partition(b" ")
        target = rest.split(b" ", 1)[0]
        with self._drops_lock:
            for i, (m, part) in enumerate(self._drops):
                if m == method and part in target:
                    del self._drops[i]
                    return True
        return False

    def _cut_all(self) -> None:
        for w in list(self._conns):
            _reset(w)

    def _in_outage(self) -> bool:
        return time.monotonic() < self._outage_until

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._conns.add(writer)
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        up_w = None
        try:
            if self._in_outage():
                self.stats["outage"] += 1
                _reset(writer)
                return
            up_r, up_w = await asyncio.open_connection(*self.upstream)
            while True:
                request = await _read_message(reader, writer)
                if request is None:
                    return
                self.stats["requests"] += 1
                if self._in_outage():
                    self.stats["outage"] += 1
                    _reset(writer)
                    return
                if self.latency:
                    await asyncio.sleep(self.latency)
                roll = self._rnd.random()
                if roll < self.reset_rate:
                    self.stats["reset"] += 1
                    _reset(writer)
                    return
                if roll < self.reset_rate + self.error_rate:
                    self.stats["503"] += 1
                    writer.write(b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
                                 b"Content-Length: %d\r\nConnection: keep-alive\r\n\r\n" % len(_SLOWDOWN) + _SLOWDOWN)
                    await writer.drain()
                    continue
                drop = self._take_drop(request) or (
                    self.drop_response_rate > 0 and self._rnd.random() < self.drop_response_rate)
                up_w.write(request)
                await up_w.drain()
                response = await _read_response(up_r, _is_head_request(request))
                if response is None:
                    _reset(writer)
                    return
                self.stats["forwarded"] += 1
                method = request.split(b" ", 1)[0].decode("ascii", "replace")
                self.stats[method] += 1
                self.stats[f"{method}_bytes"] += len(response) - (response.find(b"\r\n\r\n") + 4)
                if drop:
                    self.stats["dropped_response"] += 1
                    _reset(writer)
                    return
                writer.write(response)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
            _reset(writer)
        finally:
            self._conns.discard(writer)
            if task is not None:
                self._handlers.discard(task)
            if up_w is not None:
                up_w.close()
            if not writer.is_closing():
                writer.close()

    def start(self) -> Self:
        ready = threading.Event()

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)

            async def serve() -> None:
                self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0, limit=1 << 24)
                self.port = self._server.sockets[0].getsockname()[1]
                ready.set()

            self._loop.run_until_complete(serve())
            self._loop.run_forever()
            self._loop.close()

        self._thread = threading.Thread(target=run, name="faultproxy", daemon=True)
        self._thread.start()
        ready.wait(10)
        return self

    def stop(self) -> None:
        if self._loop is None:
            return

        async def shutdown() -> None:
            assert self._server is not None  # set by start() before _loop runs
            self._server.close()
            self._cut_all()
            # end the connections still being served (one waiting out a latency, or for the
            # server's answer) while the loop runs: not as coroutines destroyed with the loop
            handlers = list(self._handlers)
            for t in handlers:
                t.cancel()
            await asyncio.gather(*handlers, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        assert self._thread is not None  # started along with _loop
        self._thread.join(10)
        self._loop = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
