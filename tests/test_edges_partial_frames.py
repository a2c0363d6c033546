"""Issue 40, edge 2: frames still arriving share one bounded pool across connections
(``partial_frames_bytes``), and a connection's partial frame is freed when the connection goes.

Before: each client that died mid-frame left its half frame in the daemon's memory until a cycle
collection (ten clients sending half of a 60 MB PUT_MANY: RSS 76 -> 376 MB, 676 MB after a second
round), and nothing bounded what partial frames held together. Real daemons, in-process (both
loops) and as a process (RSS)."""
from __future__ import annotations

import asyncio
import socket
import struct
import time

import pytest

from statestore_async import errors
from statestore_async.client.clients import Client
from statestore_async.config import DaemonConfig
from statestore_async.daemon import connection
from statestore_async.testing.daemon import wait_until
from statestore_async.wire.events import CLOSED, NEED_DATA, ErrorResponse, Response
from statestore_async.wire.protocol import ClientProtocol, Op

DEADLINE = 60.0
HEADER = struct.Struct("<IBBI")  # payload length, opcode, flags, request id
MIB = 1 << 20



class RawClient:
    """A client that writes its frames by hand: HELLO, then a PING sent in parts."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer
        self.proto = ClientProtocol()
        self._rest = b""

    @classmethod
    async def connect(cls, path: str) -> RawClient:
        c = cls(*await asyncio.open_unix_connection(path))
        c.writer.write(c.proto.send_hello()[1])
        await c.next_event()
        return c

    async def next_event(self):
        """The next answer; None once the daemon closed the connection."""
        while True:
            ev = self.proto.next_event()
            if ev is not NEED_DATA and ev is not CLOSED:
                return ev
            data = await asyncio.wait_for(self.reader.read(1 << 20), DEADLINE)
            if not data:
                return None
            self.proto.receive_data(data)

    def start_ping(self, size: int, sent: int) -> int:
        """A PING frame of ``size`` payload bytes, of which ``sent`` are written now; its id."""
        rid, frame = self.proto.send_ping(b"p" * size)
        cut = HEADER.size + sent
        self.writer.write(frame[:cut])
        self._rest = frame[cut:]
        return rid

    def send_more(self, n: int) -> None:
        self.writer.write(self._rest[:n])
        self._rest = self._rest[n:]

    def close(self) -> None:
        self.writer.close()


async def test_partial_frames_share_one_budget_and_go_with_their_connection(daemon_factory):
    d = await daemon_factory(max_frame_bytes=4 * MIB, partial_frames_bytes=8 * MIB)
    pool = d.frame_pool
    a = await RawClient.connect(d.config.socket)
    b = await RawClient.connect(d.config.socket)
    a.start_ping(4 * MIB, 2 * MIB)
    b.start_ping(4 * MIB, 2 * MIB)
    await wait_until(lambda: pool.used == 8 * MIB, "two half frames to hold room for their whole frames")
    await wait_until(lambda: sum(c.proto.buffered for c in d.connections) == 2 * (2 * MIB + HEADER.size),
                   "both halves to be read")
    held = list(d.connections)
    c = await RawClient.connect(d.config.socket)
    c.start_ping(4 * MIB, 4 * MIB)  # whole, but it has to wait for room
    await wait_until(lambda: pool.waiting == 1, "the third frame to wait for room")
    waiter = next(x for x in d.connections if x not in held)
    assert waiter.proto.buffered < 4 * MIB  # it stopped reading: at most what reads brought
    assert pool.used == 8 * MIB and d.stats()["daemon"]["partial_frames_waiting"] == 1
    a.close()  # a client gone mid-frame: its half frame is freed and its room handed on
    await wait_until(lambda: pool.waiting == 0, "the waiter to get the room")
    first = next(x for x in held if x.closed)
    assert first.proto.buffered == 0
    pong = await c.next_event()  # the third frame completes and is answered
    assert isinstance(pong, Response) and pong.value == b"p" * 4 * MIB
    await wait_until(lambda: pool.used == 4 * MIB, "the completed frame to give its room back")
    b.send_more(2 * MIB)  # the second completes too
    pong = await b.next_event()
    assert isinstance(pong, Response) and len(pong.value) == 4 * MIB
    await wait_until(lambda: pool.used == 0, "no room held once every frame is complete")
    b.close()
    c.close()
    await wait_until(lambda: not d.connections, "the connections to go")
    assert all(x.proto.buffered == 0 for x in held + [waiter])
    assert pool.counters["partial_frame_waits"] == 1 and pool.counters["partial_frames_refused"] == 0


async def test_a_frame_stalled_mid_way_while_others_wait_is_refused_and_its_room_handed_on(daemon_factory,
                                                                                          monkeypatch):
    monkeypatch.setattr(connection, "PARTIAL_FRAME_WAIT", 0.5)
    d = await daemon_factory(max_frame_bytes=4 * MIB, partial_frames_bytes=4 * MIB)
    stalled = await RawClient.connect(d.config.socket)
    rid = stalled.start_ping(4 * MIB, 1 * MIB)  # a client stalled mid-frame holds the whole budget
    await wait_until(lambda: d.frame_pool.used == 4 * MIB, "the stalled frame to hold the budget")
    late = await RawClient.connect(d.config.socket)
    late.start_ping(1 * MIB, 1 * MIB)
    ev = await stalled.next_event()
    assert isinstance(ev, ErrorResponse) and ev.request_id == rid
    assert isinstance(ev.error, errors.FrameBudgetError)
    assert "sent nothing" in str(ev.error) and "partial_frames_bytes" in str(ev.error)
    assert await stalled.next_event() is None  # closed
    pong = await late.next_event()  # the waiting frame got the room and completed
    assert isinstance(pong, Response) and len(pong.value) == 1 * MIB
    assert d.frame_pool.counters["partial_frames_refused"] == 1
    stalled.close()
    late.close()
    await wait_until(lambda: d.frame_pool.used == 0, "no room held")


async def test_a_frame_that_waits_too_long_behind_live_frames_is_refused_with_a_typed_error(daemon_factory,
                                                                                          monkeypatch):
    monkeypatch.setattr(connection, "PARTIAL_FRAME_WAIT", 0.5)
    d = await daemon_factory(max_frame_bytes=4 * MIB, partial_frames_bytes=4 * MIB)
    slow = await RawClient.connect(d.config.socket)
    slow.start_ping(4 * MIB, 1 * MIB)  # a slow sender holds the whole budget, still sending
    await wait_until(lambda: d.frame_pool.used == 4 * MIB, "the slow frame to hold the budget")
    late = await RawClient.connect(d.config.socket)
    rid = late.start_ping(1 * MIB, 1000)
    answer = asyncio.ensure_future(late.next_event())
    while not answer.done():  # the slow one keeps sending a little: it is not stalled
        slow.send_more(100)
        await asyncio.wait([answer], timeout=0.05)
    ev = answer.result()
    assert isinstance(ev, ErrorResponse) and ev.request_id == rid
    assert isinstance(ev.error, errors.FrameBudgetError)
    assert "partial_frames_bytes" in str(ev.error) and "waited" in str(ev.error)
    assert await late.next_event() is None  # closed
    assert d.frame_pool.counters["partial_frames_refused"] == 1
    slow.close()
    late.close()
    await wait_until(lambda: d.frame_pool.used == 0, "no room held")


def test_the_budget_must_hold_one_largest_frame():
    with pytest.raises(errors.InterfaceError, match="partial_frames_bytes"):
        DaemonConfig(max_frame_bytes=64 * MIB, partial_frames_bytes=32 * MIB)


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _half_frame_client(path: str, size: int) -> socket.socket:
    proto = ClientProtocol()
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    s.sendall(proto.send_hello()[1])
    s.recv(1 << 16)
    s.settimeout(0.5)
    try:
        s.sendall(HEADER.pack(size, Op.PUT_MANY, 0, 7) + b"\0" * (size // 2))
    except TimeoutError:
        pass  # the daemon stopped reading this one: no room for its frame now
    return s


def test_clients_dying_mid_frame_leave_no_memory_behind(daemon_process):
    """The issue's probe: ten clients each send half of a 60 MB PUT_MANY and close, twice."""
    d = daemon_process()
    with Client(d.socket) as c:
        c.ping()
    start = _rss_mib(d.pid)
    for _ in range(2):
        socks = [_half_frame_client(d.socket, 60 * MIB) for _ in range(10)]
        with Client(d.socket) as c:  # the daemon answers others while the budget is taken
            assert c.ping(b"x") == b"x"
            assert c.stats()["daemon"]["partial_frame_bytes"] <= 128 * MIB
        held = _rss_mib(d.pid) - start
        assert held < 128 + 24, f"partial frames took {held:.1f} MiB, over the 128 MiB budget"
        for s in socks:
            s.close()
        deadline = time.monotonic() + DEADLINE
        while _rss_mib(d.pid) - start > 16:
            assert time.monotonic() < deadline, f"RSS still {_rss_mib(d.pid) - start:.1f} MiB over its start"
            time.sleep(0.05)
    assert d.stop() == 0
