"""The sans-IO protocol: a ClientProtocol piped into a ServerProtocol and back, in memory."""
from __future__ import annotations

import struct
import subprocess
import sys

import pytest

from statestore_async import errors
from statestore_async.codecs import framing
from statestore_async.ids import CheckpointRef, StoreId
from statestore_async.wire import protocol as P

SID = StoreId("file:///tmp/root", "op", 3, "name")
CK = "ab" * 16


def pair(**kw):
    client, server = P.ClientProtocol(), P.ServerProtocol(**kw)
    rid, data = client.send_hello("test")
    server.receive_data(data)
    ev = server.next_event()
    assert isinstance(ev, P.Hello) and ev.client == "test"
    client.receive_data(server.send_hello(rid, {"max_batch": 5}))
    hello = client.next_event()
    assert hello.value == P.HelloInfo(1, {"max_batch": 5})
    return client, server


def roundtrip(client, server, request):
    rid, data = request
    server.receive_data(data)
    return rid, server.next_event()


def test_protocol_does_not_import_asyncio():
    code = "import sys, statestore_async.wire.protocol; sys.exit('asyncio' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_every_request_decodes_to_its_event():
    c, s = pair()
    cases = [
        (c.send_ping(b"hi"), P.Ping(0, b"hi")),
        (c.send_open(SID, 7, CK), P.Open(0, SID, 7, CK)),
        (c.send_open(SID, 0), P.Open(0, SID, 0, None)),
        (c.send_get_many(4, [b"\x00\x01a", b""]), P.GetMany(0, 4, [b"\x00\x01a", b""])),
        (c.send_put_many(4, [(b"k1", b""), (b"k2", b"v")]), P.PutMany(0, 4, [(b"k1", b""), (b"k2", b"v")])),
        (c.send_remove_many(4, [b"k1"]), P.RemoveMany(0, 4, [b"k1"])),
        (c.send_scan(4, b"\x00\x01", 10), P.Scan(0, 4, b"\x00\x01", 10)),
        (c.send_scan(4), P.Scan(0, 4, b"", None)),
        (c.send_commit(4, CK), P.Commit(0, 4, CK)),
        (c.send_commit(4), P.Commit(0, 4, None)),
        (c.send_abort(4), P.Abort(0, 4)),
        (c.send_await_durable(SID, CheckpointRef(2, CK), 1.5), P.AwaitDurable(0, SID, CheckpointRef(2, CK), 1.5)),
        (c.send_stats(), P.Stats(0)),
        (c.send_release(SID.root, SID.operator_id, [3, (0, 5)]),
         P.Release(0, SID.root, SID.operator_id, "default", ((3, P.NO_LIMIT), (0, 5)))),
        (c.send_release(SID.root, SID.operator_id, [], "other"), P.Release(0, SID.root, SID.operator_id, "other", ())),
    ]
    for (rid, data), expected in cases:
        s.receive_data(data)
        ev = s.next_event()
        assert ev == type(expected)(rid, *[getattr(expected, f) for f in expected.__dataclass_fields__][1:])
    assert s.next_event() is P.NEED_DATA


def test_answers_decode_to_values_and_keep_none_apart_from_empty():
    c, s = pair()
    r1, _ = roundtrip(c, s, c.send_get_many(1, [b"a", b"b", b"c"]))
    r2, _ = roundtrip(c, s, c.send_open(SID, 0))
    r3, _ = roundtrip(c, s, c.send_commit(1))
    r4, _ = roundtrip(c, s, c.send_stats())
    r5, _ = roundtrip(c, s, c.send_await_durable(SID, CheckpointRef(1, CK), 0))
    r6, _ = roundtrip(c, s, c.send_release(SID.root, SID.operator_id, [1]))
    released = {"released": [1], "kept": [], "held": [0]}
    # answers in another order than the requests (pipelining)
    c.receive_data(s.send_stats(r4, {"x": 1}) + s.send_committed(r3, CheckpointRef(1, CK))
                   + s.send_values(r1, [b"v", None, b""]) + s.send_opened(r2, 9, CheckpointRef(0, ""))
                   + s.send_durable(r5, True) + s.send_released(r6, released))
    got = {ev.request_id: ev.value for ev in iter(c.next_event, P.NEED_DATA)}
    assert got == {r4: {"x": 1}, r3: CheckpointRef(1, CK), r1: [b"v", None, b""],
                   r2: (9, CheckpointRef(0, "")), r5: True, r6: released}
    assert c.pending == 0


def test_release_requests_are_checked():
    c, s = pair()
    for payload, error in (
        (b"", errors.DecodeError),                                    # no count
        (struct.pack("<I", 2) + struct.pack("<IQ", 1, 2), errors.DecodeError),  # fewer ids than counted
        (struct.pack("<I", 1 << 30), errors.LimitExceededError),       # over the batch limit
        (struct.pack("<I", 0) + framing.encode_list([b"r", b"op"]), errors.DecodeError),  # 2 names
        (struct.pack("<I", 0) + framing.encode_list([b"r", b"a/b", b"default"]), errors.InterfaceError),
        (struct.pack("<I", 0) + framing.encode_list([b"r", b"op", b"default"]) + b"x", errors.DecodeError),
    ):
        s.receive_data(framing.encode_frame(P.Op.RELEASE, 0, 5, payload))
        ev = s.next_event()
        assert isinstance(ev, P.BadRequest) and isinstance(ev.error, error), (payload, ev)
    for bad in ([-1], [(1, -2)], [(1,)], [True]):
        with pytest.raises(errors.InterfaceError):
            c.send_release(SID.root, SID.operator_id, bad)


def test_byte_by_byte_delivery():
    c, s = pair()
    stream = b""
    rids = []
    for i in range(5):
        rid, data = c.send_put_many(1, [(b"k%d" % i, b"v" * i)])
        rids.append(rid)
        stream += data
    events = []
    for b in stream:
        s.receive_data(bytes([b]))
        ev = s.next_event()
        if ev is not P.NEED_DATA:
            events.append(ev)
    assert [e.request_id for e in events] == rids
    assert events[3].items == [(b"k3", b"vvv")]


def test_scan_streams_chunks_then_the_end():
    c, s = pair()
    rid, _ = roundtrip(c, s, c.send_scan(1, b""))
    c.receive_data(s.send_scan_chunk(rid, [(b"a", b"1")], True) + s.send_scan_chunk(rid, [(b"b", b"2")], True)
                   + s.send_scan_chunk(rid, [], False))
    evs = list(iter(c.next_event, P.NEED_DATA))
    assert [(e.value, e.more) for e in evs] == [([(b"a", b"1")], True), ([(b"b", b"2")], True), ([], False)]
    assert c.pending == 0


@pytest.mark.parametrize("exc", [errors.WriterConflictError("w"), errors.VersionNotFoundError("v"),
                                 errors.KeyFormatError("k"), errors.ObjectExistsError("o"),
                                 P.LimitExceededError("l"), P.UnknownHandleError("h"),
                                 errors.CorruptFileError("f", "bad", 3), ValueError("a bug")])
def test_errors_cross_the_wire_as_the_same_class(exc):
    c, s = pair()
    rid, _ = roundtrip(c, s, c.send_ping())
    c.receive_data(s.send_error(rid, P.Op.PING, exc))
    ev = c.next_event()
    assert isinstance(ev, P.ErrorResponse) and ev.request_id == rid
    expected = type(exc) if isinstance(exc, errors.StateStoreError) else errors.StateStoreError
    assert type(ev.error) is expected
    assert ev.error.code == expected.code
    if isinstance(exc, errors.CorruptFileError):
        assert "bad" in str(ev.error)


def test_handshake_is_required_and_versions_checked():
    c, s = P.ClientProtocol(), P.ServerProtocol()
    rid, data = c.send_ping()
    s.receive_data(data)
    ev = s.next_event()
    assert isinstance(ev, P.BadRequest) and isinstance(ev.error, P.HandshakeRequiredError)
    rid, data = c.send_hello(min_version=7, max_version=9)
    s.receive_data(data)
    ev = s.next_event()
    assert isinstance(ev, P.BadRequest) and isinstance(ev.error, P.UnsupportedVersionError)
    c.receive_data(s.send_error(ev.request_id, ev.opcode, ev.error))
    answer = c.next_event()
    assert isinstance(answer.error, P.UnsupportedVersionError) and answer.error.code == 52
    assert not s.greeted


def test_bad_requests_are_answered_and_the_stream_goes_on():
    c, s = pair(max_batch=3)
    bad = [
        framing.encode_frame(200, 0, 11, b""),  # unknown opcode
        framing.encode_frame(P.Op.PING, P.RESPONSE, 12, b""),  # a response sent as a request
        framing.encode_frame(P.Op.GET_MANY, 0, 13, struct.pack("<I", 1) + framing.encode_list([b"a"] * 4)),
        framing.encode_frame(P.Op.GET_MANY, 0, 14, struct.pack("<I", 1) + framing.encode_list([b"a"]) + b"x"),
        framing.encode_frame(P.Op.OPEN, 0, 15, b"\x00" * 12 + framing.encode_list([b"r", b"../x", b"n", b""])),
        framing.encode_frame(P.Op.COMMIT, 0, 16, struct.pack("<I", 1) + b"not-a-ckptid"),
        framing.encode_frame(P.Op.ABORT, 0, 17, b"\x01"),
        framing.encode_frame(P.Op.AWAIT_DURABLE, 0, 18, struct.pack("<IQd", 0, 1, float("nan"))
                             + framing.encode_list([b"r", b"o", b"n", CK.encode()])),
    ]
    expected = [P.UnknownOpcodeError, P.UnknownOpcodeError, P.LimitExceededError, errors.DecodeError,
                errors.InterfaceError, errors.InterfaceError, errors.DecodeError, errors.InterfaceError]
    s.receive_data(b"".join(bad) + c.send_ping(b"still here")[1])
    evs = list(iter(s.next_event, P.NEED_DATA))
    assert [e.request_id for e in evs[:-1]] == list(range(11, 19))
    for ev, cls in zip(evs, expected):
        assert isinstance(ev, P.BadRequest) and isinstance(ev.error, cls), (ev, cls)
        assert isinstance(ev.error, errors.StateStoreError) and ev.error.code
    assert evs[-1].payload == b"still here"


def test_oversized_frame_fails_the_connection_after_earlier_frames():
    c, s = pair(max_frame_bytes=100)
    rid, ping = c.send_ping(b"before")
    s.receive_data(ping + struct.pack("<IBBI", 101, P.Op.PUT_MANY, 0, 77) + b"\x00" * 50 + ping)
    assert s.next_event() == P.Ping(rid, b"before")
    failed = s.next_event()
    assert isinstance(failed, P.ConnectionFailed) and failed.request_id == 77
    assert isinstance(failed.error, P.FrameTooLargeError)
    assert s.next_event() is P.CLOSED
    [(opcode, flags, rid, payload)], _, _ = framing.split_frames(
        s.send_error(failed.request_id, failed.opcode, failed.error), 1 << 20)
    assert (opcode, flags, rid) == (P.Op.PUT_MANY, P.RESPONSE | P.ERROR, 77)
    assert isinstance(P.decode_error(payload), P.FrameTooLargeError)


def test_client_refuses_non_answers_and_drops_forgotten_ones():
    c, s = pair()
    rid, _ = roundtrip(c, s, c.send_ping(b"a"))
    c.forget(rid)
    c.receive_data(s.send_pong(rid, b"a"))
    assert c.next_event() is P.NEED_DATA
    c.receive_data(framing.encode_frame(P.Op.PING, 0, 5, b""))
    ev = c.next_event()
    assert isinstance(ev, P.ConnectionFailed) and isinstance(ev.error, P.ProtocolError)
    assert c.next_event() is P.CLOSED


def test_connection_level_error_has_request_id_zero():
    c = P.ClientProtocol()
    s = P.ServerProtocol()
    c.receive_data(s.send_error(0, P.Op.HELLO, P.PermissionDeniedError("uid 5")))
    ev = c.next_event()
    assert isinstance(ev, P.ErrorResponse) and ev.request_id == 0
    assert isinstance(ev.error, P.PermissionDeniedError)


def test_client_validates_arguments_before_sending():
    c = P.ClientProtocol()
    with pytest.raises(errors.InterfaceError):
        c.send_open(SID, -1)
    with pytest.raises(errors.InterfaceError):
        c.send_commit(1, "nope")
    with pytest.raises(errors.EncodeError):
        c.send_put_many(1, [(b"k", "str")])
    assert c.pending == 0
