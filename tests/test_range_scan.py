"""Ordered range scans through the stack: the engine's ``scan_range``, the SCAN_RANGES wire op, a daemon
end to end with both clients, malformed requests, and the work a scan does (records touched, not time)."""
from __future__ import annotations

import random
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from statestore_async import errors
from statestore_async.client.clients import AsyncClient, Client
from statestore_async.codecs import framing
from statestore_async.engine.levels import merge_lazy
from statestore_async.engine.store import VersionedStore
from statestore_async.ids import StoreId
from statestore_async.wire import protocol as P

SID = StoreId("file:///tmp/root", "op", 0)


def key(kg: int, i: int) -> bytes:
    return struct.pack(">H", kg) + b"k%06d" % i


def _model(committed: dict, changes: dict, start: bytes, stop: bytes | None, limit: int | None) -> list:
    merged = dict(committed)
    for k, v in changes.items():
        if v is None:
            merged.pop(k, None)
        else:
            merged[k] = v
    out = sorted((k, v) for k, v in merged.items() if k >= start and (stop is None or k < stop))
    return out if limit is None else out[:limit]


# --- engine ----------------------------------------------------------------------------------------
_keys = st.binary(min_size=2, max_size=4)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(_keys, st.binary(max_size=3), max_size=40),
       st.dictionaries(_keys, st.one_of(st.none(), st.binary(max_size=3)), max_size=20),
       st.binary(max_size=4), st.one_of(st.none(), st.binary(max_size=4)), st.one_of(st.none(), st.integers(0, 50)))
def test_scan_range_equals_a_model(committed, changes, start, stop, limit):
    """Overlay over committed map, tombstones hiding keys, bounds half-open, limit: same as a dict."""
    s = VersionedStore(SID)
    w = s.open(0)
    w.put_many(committed.items())
    w.commit()
    w = s.open(1)
    for k, v in changes.items():
        if v is None:
            w.remove(k)
        else:
            w.put(k, v)
    assert w.scan_range(start, stop, limit) == _model(committed, changes, start, stop, limit)
    w.abort()


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(_keys, st.binary(max_size=3), max_size=40),
       st.dictionaries(_keys, st.one_of(st.none(), st.binary(max_size=3)), max_size=10),
       st.lists(_keys, max_size=8, unique=True), st.booleans(), st.one_of(st.none(), st.integers(0, 5)))
def test_scan_ranges_equals_scan_range_of_each(committed, changes, bounds, open_end, limit):
    """A version's ``scan_ranges`` (one call into the table while the version has no change) gives
    what ``scan_range`` of each range gives, with changes or without, with a limit or without."""
    b = sorted(bounds)
    ranges: list = list(zip(b[0::2], b[1::2]))
    if open_end and len(b) % 2:
        ranges.append((b[-1], None))
    s = VersionedStore(SID)
    w = s.open(0)
    w.put_many(committed.items())
    w.commit()
    w = s.open(1)
    want = [kv for lo, hi in ranges for kv in _model(committed, {}, lo, hi, limit)]
    assert w.scan_ranges(ranges, limit) == want
    for k, v in changes.items():
        if v is None:
            w.remove(k)
        else:
            w.put(k, v)
    want = [kv for lo, hi in ranges for kv in _model(committed, changes, lo, hi, limit)]
    assert w.scan_ranges(ranges, limit) == want
    w.abort()
    with pytest.raises(errors.StoreStateError):
        w.scan_ranges(ranges)


def test_scan_range_refuses_a_bad_limit_and_a_finished_version():
    s = VersionedStore(SID)
    w = s.open(0)
    with pytest.raises(errors.InterfaceError, match="limit"):
        w.scan_range(b"", None, -1)
    w.abort()
    with pytest.raises(errors.StoreStateError):
        w.scan_range(b"", None)


class _Counting:
    """An iterator that counts what is taken from it."""

    def __init__(self, items):
        self.items, self.taken = iter(items), 0

    def __iter__(self):
        return self

    def __next__(self):
        item = next(self.items)
        self.taken += 1
        return item


def test_merge_lazy_takes_only_what_the_output_needs():
    """A limited scan reads the tables' ordered iterators only as far as its output (plus the
    tombstones it skips and one look-ahead each): O(matches), whatever follows in the range."""
    base = _Counting((key(1, i), b"b") for i in range(100_000))
    changes = _Counting([(key(1, 1), None), (key(1, 2), b"c"), (key(1, 50_000), b"c")])
    out = list(zip(range(10), merge_lazy(changes, base)))
    assert [kv for _, kv in out][:2] == [(key(1, 0), b"b"), (key(1, 2), b"c")]
    assert base.taken <= 10 + 1 + 2  # 10 returned, one hidden by a tombstone, look-ahead
    assert changes.taken <= 3


def test_scan_range_costs_the_records_returned_not_the_store():
    """Due entries at the front of many key groups of a big store: one range per key group returns
    exactly the due ones, and the engine pulls only those (and a look-ahead) from its tables."""
    s = VersionedStore(SID)
    w = s.open(0)
    w.put_many((key(kg, i), b"v") for kg in range(64) for i in range(2000))
    w.commit()
    w = s.open(1)
    pulled = 0
    original = w._base

    class Spy:
        def items(self, start=b"", stop=None):
            nonlocal pulled
            for kv in original.items(start, stop):
                pulled += 1
                yield kv

    w._base = Spy()
    got = []
    for kg in range(0, 64, 4):
        got += w.scan_range(key(kg, 0), key(kg, 3))
    assert len(got) == 16 * 3
    assert pulled == len(got)  # the half-open bound stops the base's iterator itself
    pulled = 0
    assert len(w.scan_range(key(5, 0), None, limit=7)) == 7
    assert pulled <= 8
    w._base = original
    w.abort()


# --- protocol --------------------------------------------------------------------------------------
def pair(**kw):
    client, server = P.ClientProtocol(), P.ServerProtocol(**kw)
    rid, data = client.send_hello("test")
    server.receive_data(data)
    assert isinstance(server.next_event(), P.Hello)
    client.receive_data(server.send_hello(rid, {}))
    client.next_event()
    return client, server


def test_scan_ranges_round_trip():
    c, s = pair()
    ranges = [(b"\x00\x01", b"\x00\x02"), (b"\x00\x05a", b"\x00\x05b"), (b"\x00\x09", None)]
    rid, data = c.send_scan_ranges(7, ranges, 3)
    s.receive_data(data)
    ev = s.next_event()
    assert ev == P.ScanRanges(rid, 7, tuple(ranges), 3)
    rid, data = c.send_scan_ranges(7, [])
    s.receive_data(data)
    assert s.next_event() == P.ScanRanges(rid, 7, (), None)
    # the answer: pairs chunks with MORE but the last, as SCAN's
    c.receive_data(s.send_scan_ranges_chunk(rid, [(b"a", b"1")], True) + s.send_scan_ranges_chunk(rid, [(b"b", b"2")], False))
    first, last = c.next_event(), c.next_event()
    assert (first.value, first.more, last.value, last.more) == ([(b"a", b"1")], True, [(b"b", b"2")], False)
    assert c.pending == 1  # the first request, never answered here


@pytest.mark.parametrize("ranges, match", [
    ([(b"b", b"c"), (b"a", b"b")], "before the end of range 0"),
    ([(b"a", b"c"), (b"b", b"d")], "before the end of range 0"),
    ([(b"a", None), (b"b", b"c")], "no upper bound"),
    ([(b"b", b"b")], "empty or reversed"),
    ([(b"c", b"b")], "empty or reversed"),
    ([(b"a",)], "not a \\(start, stop\\) pair"),
    ([("a", b"b")], "bytes"),
])
def test_bad_ranges_are_refused_by_name_on_both_sides(ranges, match):
    c, s = pair()
    with pytest.raises(errors.InterfaceError, match=match):
        c.send_scan_ranges(1, ranges)
    if all(isinstance(x, bytes) for r in ranges for x in r if x is not None) and all(len(r) == 2 for r in ranges):
        # the same ranges sent raw: the daemon side refuses them with the same typed error
        payload = struct.pack("<IQ", 1, P.NO_LIMIT) + framing.encode_pairs([(a, b or b"") for a, b in ranges])
        s.receive_data(framing.encode_frame(P.Op.SCAN_RANGES, 0, 9, payload))
        ev = s.next_event()
        assert isinstance(ev, P.BadRequest) and isinstance(ev.error, errors.InterfaceError)
        assert ev.error.args and match.split("\\")[0] in str(ev.error)


@pytest.mark.parametrize("payload, error", [
    (b"\x01\x00", errors.DecodeError),                                            # short header
    (struct.pack("<IQ", 1, 5) + b"\x01\x00\x00\x00", errors.DecodeError),        # truncated pairs
    (struct.pack("<IQ", 1, 5) + framing.encode_pairs([(b"a", b"b")]) + b"x", errors.DecodeError),  # trailing
    (struct.pack("<IQ", 1, 5) + struct.pack("<I", 6), errors.LimitExceededError),  # over max_batch
])
def test_malformed_scan_ranges_get_typed_errors(payload, error):
    _, s = pair(max_batch=5)
    s.receive_data(framing.encode_frame(P.Op.SCAN_RANGES, 0, 4, payload))
    ev = s.next_event()
    assert isinstance(ev, P.BadRequest) and type(ev.error) is error and ev.opcode == P.Op.SCAN_RANGES
    assert s.next_event() is P.NEED_DATA  # the connection goes on


def test_a_bad_limit_is_refused_before_sending():
    c, _ = pair()
    with pytest.raises(errors.InterfaceError, match="limit"):
        c.send_scan_ranges(1, [(b"a", b"b")], -1)


# --- a daemon, end to end --------------------------------------------------------------------------
@pytest.fixture
def root(tmp_path):
    return f"file://{tmp_path}/root"


async def test_async_client_scans_ranges_end_to_end(daemon_factory, root):
    d = await daemon_factory(max_batch=3)
    sid = StoreId(root, "op", 0)
    committed = {key(kg, i): b"c%d" % i for kg in range(8) for i in range(50)}
    async with AsyncClient(d.config.socket) as c:
        h = await c.open(sid, 0)
        await h.put_many(list(committed.items()))
        ref = await h.commit()
        h = await c.open(sid, ref.version, ref.ckptid)
        await h.remove_many([key(2, 1), key(4, 0)])
        await h.put_many([(key(2, 100), b"new"), (key(6, 2), b"upd")])
        changes = {key(2, 1): None, key(4, 0): None, key(2, 100): b"new", key(6, 2): b"upd"}
        # 5 ranges with a daemon batch limit of 3: the client sends two requests
        ranges = [(key(kg, 0), key(kg, 5)) for kg in (0, 2, 4, 6)] + [(key(7, 48), None)]
        got = [kv async for kv in h.scan_ranges(ranges)]
        want = [kv for a, b in ranges for kv in _model(committed, changes, a, b, None)]
        assert got == want
        limited = [kv async for kv in h.scan_ranges(ranges, limit=2)]
        assert limited == [kv for a, b in ranges for kv in _model(committed, changes, a, b, 2)]
        assert await h.scan_range(key(2, 90), key(3, 0)) == [(key(2, 100), b"new")]
        assert await h.scan_range(key(3, 0), key(2, 0)) == []
        with pytest.raises(errors.InterfaceError, match="ascending and disjoint"):
            [kv async for kv in h.scan_ranges([(key(1, 0), key(3, 0)), (key(2, 0), key(4, 0))])]
        # a raw request with unordered ranges gets the daemon's typed error, and the connection goes on
        payload = struct.pack("<IQ", h.handle, P.NO_LIMIT) + framing.encode_pairs([(b"\x00\x02", b"\x00\x03"),
                                                                                    (b"\x00\x01", b"\x00\x02")])
        with pytest.raises(errors.InterfaceError, match="before the end of range 0"):
            await c.call(lambda p: p._request(P.Op.SCAN_RANGES, payload))
        assert await h.get_many([key(6, 2)]) == [b"upd"]
        await h.abort()
        with pytest.raises(errors.StoreStateError):
            [kv async for kv in h.scan_ranges(ranges)]


async def test_big_range_answer_is_streamed_in_chunks(daemon_factory, root):
    d = await daemon_factory()
    async with AsyncClient(d.config.socket) as c:
        h = await c.open(StoreId(root, "op", 1), 0)
        items = [(key(3, i), b"x" * 300) for i in range(10_000)]
        await h.put_many(items)
        assert [kv async for kv in h.scan_ranges([(key(3, 0), key(4, 0))])] == items
        await h.abort()


def test_blocking_client_scans_ranges(daemon_process, tmp_path):
    d = daemon_process("--max-batch", "2", "--log-level", "warning")
    sid = StoreId(f"file://{tmp_path}/root", "op", 0)
    rng = random.Random(7)
    data = {key(rng.randrange(16), rng.randrange(10**6)): b"v" for _ in range(3000)}
    client = Client(d.socket)
    try:
        with client.open(sid, 0) as h:
            h.put_many(list(data.items()))
            ranges = [(key(kg, 0), key(kg, 500_000)) for kg in range(0, 16, 3)]
            got = list(h.scan_ranges(ranges))
            assert got == [kv for a, b in ranges for kv in _model(data, {}, a, b, None)]
            assert h.scan_range(key(5, 0), None, 4) == _model(data, {}, key(5, 0), None, 4)
            with pytest.raises(errors.InterfaceError, match="no upper bound"):
                list(h.scan_ranges([(key(1, 0), None), (key(2, 0), None)]))
    finally:
        client.close()
