"""The client ⇄ daemon wire protocol, sans-IO (docs/ARCHITECTURE.md, "The wire
protocol"): no sockets, no asyncio.

Frames (see ``statestore_async.codecs.framing``)::

    u32 payload length | u8 opcode | u8 flags | u32 request id | payload

A request has flags 0. Its answer carries the same opcode and request id with ``RESPONSE`` set,
plus ``ERROR`` for a coded error (payload ``u32 code | UTF-8 message``; the code is the error
class's ``code``, see ``errors.error_for_code``) and ``MORE`` on every chunk of a streamed answer
except the last (SCAN, SCAN_RANGES). Requests may be pipelined; answers may come in any order.

Request payloads (integers little-endian; ``list``/``optional list``/``pairs`` as in framing)::

    HELLO          u16 min version | u16 max version | client name (UTF-8)
                   → u16 version | JSON limits {max_frame_bytes, max_batch, max_inflight}
    PING           any bytes → the same bytes
    OPEN           u32 partition | u64 version | list [root, operator, store name, ckptid or ""]
                   → u32 handle | u64 version | ckptid (ASCII) of the state opened
    GET_MANY       u32 handle | list keys → optional list values (None: absent)
    PUT_MANY       u32 handle | pairs → u32 count
    REMOVE_MANY    u32 handle | list keys → u32 count
    SCAN           u32 handle | u64 limit (2**64-1: none) | prefix → pairs chunks (MORE), last chunk
    SCAN_RANGES    u32 handle | u64 limit per range (2**64-1: none) | pairs of (start, stop)
                   → pairs chunks (MORE), last chunk: for each range, in order, at most ``limit``
                   (key, value) with start <= key < stop (an empty stop: no upper bound). The
                   ranges must be ascending and disjoint (start < stop <= next start; only the last
                   may be unbounded), so the answer is in key order and a key's range is found by
                   its position; at most ``max_batch`` ranges. A daemon without it answers
                   ``UnknownOpcodeError``.
    COMMIT         u32 handle | ckptid or "" → u64 version | ckptid
    ABORT          u32 handle → empty
    AWAIT_DURABLE  u32 partition | u64 version | f64 timeout | list [root, operator, store name, ckptid]
                   → u8 1 durable / 0 timed out
    STATS          empty → JSON object
    RELEASE        u32 n | n × (u32 partition | u64 below version) | list [root, operator, store name]
                   → JSON {released, kept, held}: partition ids (see ``registry.release``)

The daemon does not decode batches into Python objects: the ``GetMany.keys``, ``PutMany.items`` and
``RemoveMany.keys`` of decoded requests are validated ``packed.PackedList`` / ``PackedPairs`` (lazy
sequences equal to the lists they hold) that the engine reads straight from the payload. Clients
may build batch requests from Arrow-layout columns (``send_*_many_buffers``, see ``arrowframes``): the
same bytes on the wire; the answer to ``send_get_many_buffers`` is the tuple of
``arrowframes.decode_optional_list_buffers`` without its end offset.

``ClientProtocol`` and ``ServerProtocol`` hold one connection's state: feed received bytes with
``receive_data``, take events with ``next_event`` (``NEED_DATA`` when none is complete), and turn
requests or answers into bytes with the ``send_*`` methods. A framing error (a frame longer than
the limit) yields ``ConnectionFailed``: answer it if possible, then close — the stream cannot be
resynchronised. Any other bad request yields ``BadRequest``, to be answered with its coded error.
"""
from __future__ import annotations

import enum
import json
import math
import struct
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

from statestore_async.codecs import arrowframes, framing, packed
from statestore_async.errors import (
    ConnectionLostError,
    DecodeError,
    EncodeError,
    FrameTooLargeError,
    HandshakeRequiredError,
    InterfaceError,
    LimitExceededError,
    PermissionDeniedError,
    ProtocolError,
    ShuttingDownError,
    StateStoreError,
    UnknownHandleError,
    UnknownOpcodeError,
    UnsupportedVersionError,
    error_for_code,
)
from statestore_async.ids import DEFAULT_STORE_NAME, CheckpointRef, StoreId, check_checkpoint_id
from statestore_async.wire.events import (  # the events: importable from here too
    CLOSED,
    NEED_DATA,
    Abort,
    AwaitDurable,
    BadRequest,
    ClientEvent,
    Commit,
    ConnectionFailed,
    ErrorResponse,
    GetMany,
    Hello,
    HelloInfo,
    Open,
    Ping,
    PutMany,
    Release,
    RemoveMany,
    Request,
    Response,
    Scan,
    ScanRanges,
    ServerEvent,
    Stats,
    _Sentinel,
)

if TYPE_CHECKING:
    from statestore_async._ref import ArrowColumn

PROTOCOL_VERSION = 1
MIN_PROTOCOL_VERSION = 1
NO_LIMIT = 0xFFFFFFFFFFFFFFFF
MAX_REQUEST_ID = 0xFFFFFFFF


class Op(enum.IntEnum):
    HELLO = 1
    PING = 2
    OPEN = 3
    GET_MANY = 4
    PUT_MANY = 5
    REMOVE_MANY = 6
    SCAN = 7
    COMMIT = 8
    ABORT = 9
    AWAIT_DURABLE = 10
    STATS = 11
    RELEASE = 12
    SCAN_RANGES = 13


RESPONSE = 0x01
ERROR = 0x02
MORE = 0x04

_OPS = {int(o) for o in Op}


# (opcode, flags, request id, payload): a frame cut by framing.split_frames
_Frame: TypeAlias = tuple[int, int, int, bytes]
_Items = TypeVar("_Items")  # the items of a batch request, as its encoder takes them


# --- payload helpers ------------------------------------------------------------------------------
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_HELLO = struct.Struct("<HH")
_OPEN = struct.Struct("<IQ")
_OPENED = struct.Struct("<IQ")
_SCAN = struct.Struct("<IQ")
_DURABLE = struct.Struct("<IQd")
_RELEASE = struct.Struct("<IQ")
_ERR = struct.Struct("<I")
_FRAME_HEADER = struct.Struct("<IBBI")  # payload length, opcode, flags, request id


def _need(payload: bytes, n: int, what: str) -> None:
    if len(payload) < n:
        raise DecodeError(f"{what}: payload of {len(payload)} bytes, at least {n} needed")


def _ascii(b: bytes, what: str) -> str:
    try:
        return b.decode("ascii")
    except UnicodeDecodeError:
        raise DecodeError(f"{what} is not ASCII") from None


def _utf8(b: bytes, what: str) -> str:
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        raise DecodeError(f"{what} is not UTF-8") from None


def _end(payload: bytes, pos: int, what: str) -> None:
    if pos != len(payload):
        raise DecodeError(f"{what}: {len(payload) - pos} unexpected trailing bytes")


def check_ranges(ranges: Iterable[tuple[bytes, bytes | None]], what: str = "SCAN_RANGES"
                 ) -> tuple[tuple[bytes, bytes | None], ...]:
    """``ranges`` as a tuple of ``(start, stop)`` bytes (stop None: no upper bound) once checked:
    each ``start < stop``, each ``stop <= the next start``, only the last unbounded; else
    ``InterfaceError`` naming the first range that is not."""
    out: list[tuple[bytes, bytes | None]] = []
    prev: bytes | None = b""
    for i, pair in enumerate(ranges):
        try:
            start, stop = pair
        except (TypeError, ValueError):
            raise InterfaceError(f"{what}: range {i} is not a (start, stop) pair: {pair!r}") from None
        if not isinstance(start, (bytes, bytearray, memoryview)) or not (
                stop is None or isinstance(stop, (bytes, bytearray, memoryview))):
            raise InterfaceError(f"{what}: range {i}'s start and stop are bytes (stop None: unbounded), got {pair!r}")
        start, stop = bytes(start), None if stop is None else bytes(stop)
        if prev is None:
            raise InterfaceError(f"{what}: range {i - 1} has no upper bound, so it must be the last; sort the ranges "
                                 "and give each but the last a stop")
        if start < prev:
            raise InterfaceError(f"{what}: range {i} starts at {start!r}, before the end of range {i - 1} ({prev!r}): "
                                 "the ranges must be ascending and disjoint (merge or sort them)")
        if stop is not None and stop <= start:
            raise InterfaceError(f"{what}: range {i} is empty or reversed (start {start!r}, stop {stop!r}): each range "
                                 "needs start < stop")
        out.append((start, stop))
        prev = stop
    return tuple(out)


def _store_fields(store_id: StoreId) -> list[bytes]:
    return [store_id.root.encode(), store_id.operator_id.encode(), store_id.store_name.encode()]


def _decode_store(partition: int, fields: list[bytes], what: str) -> tuple[StoreId, str]:
    if len(fields) != 4:
        raise DecodeError(f"{what}: 4 strings expected (root, operator, store name, ckptid), got {len(fields)}")
    root, op, name, ckpt = (_utf8(f, what) for f in fields)
    return StoreId(root, op, partition, name), ckpt


def _ckptid_or_none(s: str) -> str | None:
    return check_checkpoint_id(s) if s else None


def encode_error(exc: BaseException) -> bytes:
    """``u32 code | message`` for any exception (non-store errors get the root code)."""
    code = exc.code if isinstance(exc, StateStoreError) else StateStoreError.code
    msg = str(exc) if isinstance(exc, StateStoreError) else f"{type(exc).__name__}: {exc}"
    return _ERR.pack(code) + msg.encode("utf-8", "replace")[:65536]


def decode_error(payload: bytes) -> StateStoreError:
    """The exception an error payload stands for (the class registered for its code)."""
    if len(payload) < 4:
        return ProtocolError(f"malformed error answer ({len(payload)} bytes)")
    code = _ERR.unpack_from(payload)[0]
    msg = payload[4:].decode("utf-8", "replace")
    cls = error_for_code(code)
    try:
        exc = cls(msg)
    except TypeError:  # a class with a richer constructor (CorruptFileError): keep class and message
        exc = cls.__new__(cls)
        Exception.__init__(exc, msg)
    exc.remote_code = code
    return exc


def _split(conn: ServerProtocol | ClientProtocol, data: bytes) -> tuple[list[_Frame], tuple[int, int, int, int] | None]:
    """Cut the complete frames out of ``conn._buf`` + ``data`` (bytes-like); keep the rest buffered.

    With nothing buffered (the usual case: a read ends on a frame boundary) the frames are cut
    straight from ``data``, which is then neither copied nor kept.
    """
    buf = conn._buf
    if buf:
        buf += data
        frames, consumed, oversized = framing.split_frames(buf, conn.max_frame_bytes)
        if consumed:
            del buf[:consumed]
    else:
        frames, consumed, oversized = framing.split_frames(data, conn.max_frame_bytes)
        if consumed < len(data) and oversized is None:
            buf += data[consumed:]
    return frames, oversized


# --- server side ----------------------------------------------------------------------------------
class ServerProtocol:
    """One connection, daemon side: bytes in → request events; answers → bytes out."""

    def __init__(self, *, max_frame_bytes: int = 64 << 20, max_batch: int = 100_000):
        self.max_frame_bytes = max_frame_bytes
        self.max_batch = max_batch
        self.greeted = False
        self.closed = False
        self._buf = bytearray()
        self._events: deque[ServerEvent] = deque()
        self._decoders: dict[int, Callable[[int, bytes], Request]] = {
            Op.HELLO: self._hello,
            Op.PING: lambda rid, p: Ping(rid, p),
            Op.OPEN: self._open,
            Op.GET_MANY: self._get_many,
            Op.PUT_MANY: self._put_many,
            Op.REMOVE_MANY: self._remove_many,
            Op.SCAN: self._scan,
            Op.SCAN_RANGES: self._scan_ranges,
            Op.COMMIT: self._commit,
            Op.ABORT: self._abort,
            Op.AWAIT_DURABLE: self._await_durable,
            Op.STATS: self._stats,
            Op.RELEASE: self._release,
        }

    # -- input --
    def receive_data(self, data: bytes) -> None:
        """Feed bytes read from the peer (b"" at end of stream is not needed: just stop)."""
        if self.closed:
            return
        frames, oversized = _split(self, data)
        events = self._events
        for opcode, flags, rid, payload in frames:
            events.append(self._decode(opcode, flags, rid, payload))
        if oversized is not None:
            opcode, _, rid, length = oversized
            events.append(ConnectionFailed(rid, opcode, FrameTooLargeError(
                f"a frame of {length} bytes is over the limit of {self.max_frame_bytes}")))
            self.closed = True
            self._buf = bytearray()

    def next_event(self) -> ServerEvent | _Sentinel:
        """The next request event, ``NEED_DATA``, or ``CLOSED`` after a framing error."""
        if self._events:
            return self._events.popleft()
        return CLOSED if self.closed else NEED_DATA

    def events(self) -> Iterator[ServerEvent]:
        """Every complete event now buffered."""
        events = self._events
        while events:
            yield events.popleft()

    @property
    def buffered(self) -> int:
        return len(self._buf)

    @property
    def pending_events(self) -> int:
        """Requests decoded and not taken by ``next_event`` yet."""
        return len(self._events)

    def partial_frame(self) -> tuple[int, int, int] | None:
        """The frame begun but not complete in the buffer, as ``(size, opcode, request id)``: its
        payload's length once its header is in (what a daemon must make room for to complete it),
        before that the bytes buffered with opcode and id 0; None when the buffer ends on a frame
        boundary."""
        buf = self._buf
        n = len(buf)
        if not n:
            return None
        if n < _FRAME_HEADER.size:
            return n, 0, 0
        length, opcode, _flags, rid = _FRAME_HEADER.unpack_from(buf, 0)
        return max(length, n), opcode, rid

    def discard(self) -> None:
        """Forget what is buffered, complete or not (the connection is gone): its memory goes now,
        whoever still holds this object."""
        self._buf = bytearray()
        self._events.clear()
        self.closed = True

    def _decode(self, opcode: int, flags: int, rid: int, payload: bytes) -> ServerEvent:
        if flags != 0 or opcode not in _OPS:
            what = f"flags {flags:#x}" if opcode in _OPS else f"opcode {opcode}"
            return BadRequest(rid, opcode, UnknownOpcodeError(f"a request with unknown {what}"))
        if not self.greeted and opcode != Op.HELLO:
            return BadRequest(rid, opcode, HandshakeRequiredError("the first request must be HELLO"))
        try:
            return self._decoders[opcode](rid, payload)
        except StateStoreError as exc:
            return BadRequest(rid, opcode, exc)

    def _hello(self, rid: int, p: bytes) -> Hello:
        _need(p, 4, "HELLO")
        lo, hi = _HELLO.unpack_from(p)
        client = _utf8(p[4:], "HELLO client name")
        if not (max(lo, MIN_PROTOCOL_VERSION) <= min(hi, PROTOCOL_VERSION)):
            raise UnsupportedVersionError(
                f"the client speaks protocol versions {lo}..{hi}, this daemon {MIN_PROTOCOL_VERSION}..{PROTOCOL_VERSION}")
        self.greeted = True
        return Hello(rid, lo, hi, client)

    def _check_batch(self, p: bytes, pos: int, what: str) -> None:
        _need(p, pos + 4, what)
        n = _U32.unpack_from(p, pos)[0]
        if n > self.max_batch:
            raise LimitExceededError(f"{what}: a batch of {n} is over the limit of {self.max_batch}")

    def _open(self, rid: int, p: bytes) -> Open:
        _need(p, _OPEN.size, "OPEN")
        partition, version = _OPEN.unpack_from(p)
        fields, end = framing.decode_list(p, _OPEN.size, 4)
        _end(p, end, "OPEN")
        store_id, ckpt = _decode_store(partition, fields, "OPEN")
        return Open(rid, store_id, version, _ckptid_or_none(ckpt))

    # The batches are validated here but not decoded: the events carry them as ``PackedList`` /
    # ``PackedPairs`` that the engine reads straight from the payload (and that decode on demand).
    def _get_many(self, rid: int, p: bytes) -> GetMany:
        self._check_batch(p, 4, "GET_MANY")
        n, end = framing.check_list(p, 4, self.max_batch)
        _end(p, end, "GET_MANY")
        return GetMany(rid, _U32.unpack_from(p)[0], packed.PackedList(p, 4, n))

    def _put_many(self, rid: int, p: bytes) -> PutMany:
        self._check_batch(p, 4, "PUT_MANY")
        n, end = framing.check_pairs(p, 4, self.max_batch)
        _end(p, end, "PUT_MANY")
        return PutMany(rid, _U32.unpack_from(p)[0], packed.PackedPairs(p, 4, n))

    def _remove_many(self, rid: int, p: bytes) -> RemoveMany:
        self._check_batch(p, 4, "REMOVE_MANY")
        n, end = framing.check_list(p, 4, self.max_batch)
        _end(p, end, "REMOVE_MANY")
        return RemoveMany(rid, _U32.unpack_from(p)[0], packed.PackedList(p, 4, n))

    def _scan(self, rid: int, p: bytes) -> Scan:
        _need(p, _SCAN.size, "SCAN")
        handle, limit = _SCAN.unpack_from(p)
        return Scan(rid, handle, bytes(p[_SCAN.size:]), None if limit == NO_LIMIT else limit)

    def _scan_ranges(self, rid: int, p: bytes) -> ScanRanges:
        _need(p, _SCAN.size, "SCAN_RANGES")
        self._check_batch(p, _SCAN.size, "SCAN_RANGES")
        handle, limit = _SCAN.unpack_from(p)
        pairs, end = framing.decode_pairs(p, _SCAN.size, self.max_batch)
        _end(p, end, "SCAN_RANGES")
        ranges = check_ranges((a, b or None) for a, b in pairs)
        return ScanRanges(rid, handle, ranges, None if limit == NO_LIMIT else limit)

    def _commit(self, rid: int, p: bytes) -> Commit:
        _need(p, 4, "COMMIT")
        return Commit(rid, _U32.unpack_from(p)[0], _ckptid_or_none(_ascii(p[4:], "COMMIT ckptid")))

    def _abort(self, rid: int, p: bytes) -> Abort:
        _need(p, 4, "ABORT")
        _end(p, 4, "ABORT")
        return Abort(rid, _U32.unpack_from(p)[0])

    def _await_durable(self, rid: int, p: bytes) -> AwaitDurable:
        _need(p, _DURABLE.size, "AWAIT_DURABLE")
        partition, version, timeout = _DURABLE.unpack_from(p)
        fields, end = framing.decode_list(p, _DURABLE.size, 4)
        _end(p, end, "AWAIT_DURABLE")
        store_id, ckpt = _decode_store(partition, fields, "AWAIT_DURABLE")
        if not math.isfinite(timeout) or timeout < 0:
            raise InterfaceError(f"AWAIT_DURABLE: timeout must be a finite number >= 0, got {timeout}")
        return AwaitDurable(rid, store_id, CheckpointRef(version, ckpt), timeout)

    def _stats(self, rid: int, p: bytes) -> Stats:
        _end(p, 0, "STATS")
        return Stats(rid)

    def _release(self, rid: int, p: bytes) -> Release:
        _need(p, 4, "RELEASE")
        n = _U32.unpack_from(p)[0]
        if n > self.max_batch:
            raise LimitExceededError(f"RELEASE of {n} partitions is over the batch limit of {self.max_batch}")
        _need(p, 4 + _RELEASE.size * n, "RELEASE")
        partitions = tuple(_RELEASE.iter_unpack(p[4:4 + _RELEASE.size * n]))
        fields, end = framing.decode_list(p, 4 + _RELEASE.size * n, 3)
        _end(p, end, "RELEASE")
        if len(fields) != 3:
            raise DecodeError(f"RELEASE: 3 strings expected (root, operator, store name), got {len(fields)}")
        root, op, name = (_utf8(f, "RELEASE") for f in fields)
        StoreId(root, op, 0, name)  # checks the names
        return Release(rid, root, op, name, partitions)

    # -- output --
    @staticmethod
    def _frame(opcode: int, rid: int, payload: bytes = b"", more: bool = False) -> bytes:
        return framing.encode_frame(opcode, RESPONSE | (MORE if more else 0), rid, payload)

    def send_hello(self, rid: int, limits: Mapping[str, object]) -> bytes:
        return self._frame(Op.HELLO, rid, struct.pack("<H", PROTOCOL_VERSION) + json.dumps(limits).encode())

    def send_pong(self, rid: int, payload: bytes) -> bytes:
        return self._frame(Op.PING, rid, payload)

    def send_opened(self, rid: int, handle: int, ref: CheckpointRef) -> bytes:
        return self._frame(Op.OPEN, rid, _OPENED.pack(handle, ref.version) + ref.ckptid.encode())

    @staticmethod
    def send_values_packed(rid: int, payload: bytes) -> tuple[bytes, bytes]:
        """The GET_MANY answer of a payload already encoded as a packed optional list
        (``daemon.payloads.get_many``): the frame header and the payload, to be written one
        after the other (no copy of the payload)."""
        if len(payload) > 0xFFFFFFFF:
            raise EncodeError(f"a payload of {len(payload)} bytes does not fit a frame")
        return _FRAME_HEADER.pack(len(payload), Op.GET_MANY, RESPONSE, rid), payload

    def send_values(self, rid: int, values: Iterable[bytes | None]) -> bytes:
        return self._frame(Op.GET_MANY, rid, framing.encode_optional_list(values))

    def send_count(self, rid: int, opcode: int, n: int) -> bytes:
        return self._frame(opcode, rid, _U32.pack(n))

    def send_scan_chunk(self, rid: int, pairs: Iterable[tuple[bytes, bytes]], more: bool) -> bytes:
        return self._frame(Op.SCAN, rid, framing.encode_pairs(pairs), more)

    def send_scan_ranges_chunk(self, rid: int, pairs: Iterable[tuple[bytes, bytes]], more: bool) -> bytes:
        return self._frame(Op.SCAN_RANGES, rid, framing.encode_pairs(pairs), more)

    def send_committed(self, rid: int, ref: CheckpointRef) -> bytes:
        return self._frame(Op.COMMIT, rid, _U64.pack(ref.version) + ref.ckptid.encode())

    def send_aborted(self, rid: int) -> bytes:
        return self._frame(Op.ABORT, rid)

    def send_durable(self, rid: int, durable: bool) -> bytes:
        return self._frame(Op.AWAIT_DURABLE, rid, b"\x01" if durable else b"\x00")

    def send_stats(self, rid: int, stats: Mapping[str, object]) -> bytes:
        return self._frame(Op.STATS, rid, json.dumps(stats, default=str).encode())

    def send_released(self, rid: int, outcome: Mapping[str, object]) -> bytes:
        return self._frame(Op.RELEASE, rid, json.dumps(outcome).encode())

    def send_error(self, rid: int, opcode: int, exc: BaseException) -> bytes:
        return framing.encode_frame(opcode & 0xFF, RESPONSE | ERROR, rid & MAX_REQUEST_ID, encode_error(exc))


# --- client side ----------------------------------------------------------------------------------
def _dec_hello(p: bytes) -> HelloInfo:
    _need(p, 2, "HELLO answer")
    try:
        limits = json.loads(p[2:])
    except ValueError:
        raise DecodeError("HELLO answer: limits are not JSON") from None
    return HelloInfo(struct.unpack_from("<H", p)[0], limits)


def _dec_opened(p: bytes) -> tuple[int, CheckpointRef]:
    _need(p, _OPENED.size, "OPEN answer")
    handle, version = _OPENED.unpack_from(p)
    return handle, CheckpointRef(version, _ascii(p[_OPENED.size:], "OPEN answer"))


def _dec_values(p: bytes) -> list[bytes | None]:
    values, end = framing.decode_optional_list(p)
    _end(p, end, "GET_MANY answer")
    return values


def _dec_values_buffers(p: bytes) -> tuple[int, int, bytes | None, bytes, bytes, int]:
    n, nulls, validity, offsets, data, width, end = arrowframes.decode_optional_list_buffers(p)
    _end(p, end, "GET_MANY answer")
    return n, nulls, validity, offsets, data, width


def _dec_count(p: bytes) -> int:
    _need(p, 4, "count answer")
    count: int = _U32.unpack_from(p)[0]
    return count


def _dec_pairs(p: bytes) -> list[tuple[bytes, bytes]]:
    pairs, end = framing.decode_pairs(p)
    _end(p, end, "SCAN answer")
    return pairs


def _dec_committed(p: bytes) -> CheckpointRef:
    _need(p, 8, "COMMIT answer")
    return CheckpointRef(_U64.unpack_from(p)[0], _ascii(p[8:], "COMMIT answer"))


def _dec_stats(p: bytes) -> Any:  # the daemon's JSON object
    try:
        return json.loads(p)
    except ValueError:
        raise DecodeError("STATS answer is not JSON") from None


def _dec_released(p: bytes) -> dict[str, Any]:
    try:
        out = json.loads(p)
    except ValueError:
        raise DecodeError("RELEASE answer is not JSON") from None
    if not isinstance(out, dict):
        raise DecodeError("RELEASE answer is not a JSON object")
    return out


_RESPONSE_DECODERS: dict[int, Callable[[bytes], object]] = {
    Op.HELLO: _dec_hello,
    Op.PING: bytes,
    Op.OPEN: _dec_opened,
    Op.GET_MANY: _dec_values,
    Op.PUT_MANY: _dec_count,
    Op.REMOVE_MANY: _dec_count,
    Op.SCAN: _dec_pairs,
    Op.SCAN_RANGES: _dec_pairs,
    Op.COMMIT: _dec_committed,
    Op.ABORT: lambda p: None,
    Op.AWAIT_DURABLE: lambda p: p[:1] == b"\x01",
    Op.STATS: _dec_stats,
    Op.RELEASE: _dec_released,
}


class ClientProtocol:
    """One connection, client side: requests → bytes; bytes in → answer events.

    Each ``send_*`` returns ``(request_id, bytes)``. Answers to unknown request ids, or frames
    that are not answers, yield ``ConnectionFailed``.
    """

    def __init__(self, *, max_frame_bytes: int = 1 << 31):
        self.max_frame_bytes = max_frame_bytes
        self.closed = False
        self._next_id = 0
        self._pending: dict[int, int] = {}  # request id -> opcode
        self._decoders: dict[int, Callable[[bytes], object]] = {}  # request id -> answer decoder, when not the opcode's usual one
        self._buf = bytearray()
        self._events: deque[ClientEvent] = deque()

    @property
    def pending(self) -> int:
        """Requests sent and not fully answered."""
        return len(self._pending)

    def _new_id(self) -> int:
        if self.closed:
            raise ConnectionLostError("the connection is closed")
        rid = self._next_id = (self._next_id % MAX_REQUEST_ID) + 1
        while rid in self._pending:
            rid = self._next_id = (self._next_id % MAX_REQUEST_ID) + 1
        return rid

    def _request(self, opcode: int, payload: bytes) -> tuple[int, bytes]:
        rid = self._new_id()
        data = framing.encode_frame(opcode, 0, rid, payload)
        self._pending[rid] = opcode
        return rid, data

    def _batch_request(self, opcode: int, handle: int, items: _Items,
                       encode: Callable[[int, int, int, bytes, _Items], bytes]) -> tuple[int, bytes]:
        """A batch request: ``encode`` is ``framing.encode_frame_list`` or ``encode_frame_pairs``."""
        rid = self._new_id()
        data = encode(opcode, 0, rid, _U32.pack(handle), items)
        self._pending[rid] = opcode
        return rid, data

    def send_hello(self, client: str = "statestore_async", min_version: int = MIN_PROTOCOL_VERSION,
                   max_version: int = PROTOCOL_VERSION) -> tuple[int, bytes]:
        return self._request(Op.HELLO, _HELLO.pack(min_version, max_version) + client.encode())

    def send_ping(self, payload: bytes = b"") -> tuple[int, bytes]:
        return self._request(Op.PING, bytes(payload))

    def send_open(self, store_id: StoreId, version: int, ckptid: str | None = None) -> tuple[int, bytes]:
        if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version < NO_LIMIT:
            raise InterfaceError(f"version must be an int >= 0, got {version!r}")
        if ckptid:
            check_checkpoint_id(ckptid)
        fields = _store_fields(store_id) + [(ckptid or "").encode()]
        return self._request(Op.OPEN, _OPEN.pack(store_id.partition_id, version) + framing.encode_list(fields))

    # Batches given as Arrow-layout columns (``arrowframes``): the same frames, written straight from
    # the columns' buffers; a GET answer then decodes into buffers too (see ``arrowframes``).
    def send_get_many_buffers(self, handle: int, n: int, keys: ArrowColumn) -> tuple[int, bytes]:
        rid, data = self._columns_request(Op.GET_MANY, handle, n, (keys,))
        self._decoders[rid] = _dec_values_buffers
        return rid, data

    def send_put_many_buffers(self, handle: int, n: int, keys: ArrowColumn, values: ArrowColumn) -> tuple[int, bytes]:
        return self._columns_request(Op.PUT_MANY, handle, n, (keys, values))

    def send_remove_many_buffers(self, handle: int, n: int, keys: ArrowColumn) -> tuple[int, bytes]:
        return self._columns_request(Op.REMOVE_MANY, handle, n, (keys,))

    def _columns_request(self, opcode: int, handle: int, n: int,
                         cols: tuple[ArrowColumn] | tuple[ArrowColumn, ArrowColumn]) -> tuple[int, bytes]:
        rid = self._new_id()
        if len(cols) == 2:
            data = arrowframes.encode_frame_pairs_buffers(opcode, 0, rid, _U32.pack(handle), n, *cols)
        else:
            data = arrowframes.encode_frame_list_buffers(opcode, 0, rid, _U32.pack(handle), n, *cols)
        self._pending[rid] = opcode
        return rid, data

    def send_get_many(self, handle: int, keys: Iterable[bytes]) -> tuple[int, bytes]:
        return self._batch_request(Op.GET_MANY, handle, keys, framing.encode_frame_list)

    def send_put_many(self, handle: int, items: Iterable[tuple[bytes, bytes]]) -> tuple[int, bytes]:
        return self._batch_request(Op.PUT_MANY, handle, items, framing.encode_frame_pairs)

    def send_remove_many(self, handle: int, keys: Iterable[bytes]) -> tuple[int, bytes]:
        return self._batch_request(Op.REMOVE_MANY, handle, keys, framing.encode_frame_list)

    def send_scan(self, handle: int, prefix: bytes = b"", limit: int | None = None) -> tuple[int, bytes]:
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or not 0 <= limit < NO_LIMIT):
            raise InterfaceError(f"limit must be None or an int >= 0, got {limit!r}")
        return self._request(Op.SCAN, _SCAN.pack(handle, NO_LIMIT if limit is None else limit) + bytes(prefix))

    def send_scan_ranges(self, handle: int, ranges: Iterable[tuple[bytes, bytes | None]],
                         limit: int | None = None) -> tuple[int, bytes]:
        """``ranges``: ascending, disjoint ``(start, stop)`` (``check_ranges``); ``limit`` per range."""
        return self.send_checked_scan_ranges(handle, check_ranges(ranges), limit)

    def send_checked_scan_ranges(self, handle: int, ranges: tuple[tuple[bytes, bytes | None], ...],
                                 limit: int | None = None) -> tuple[int, bytes]:
        """``send_scan_ranges`` of ranges ``check_ranges`` returned already (not checked again: the
        clients check a call's ranges once, then split them into requests)."""
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or not 0 <= limit < NO_LIMIT):
            raise InterfaceError(f"limit must be None or an int >= 0, got {limit!r}")
        return self._request(Op.SCAN_RANGES, _SCAN.pack(handle, NO_LIMIT if limit is None else limit)
                             + framing.encode_pairs([(a, b or b"") for a, b in ranges]))

    def send_commit(self, handle: int, ckptid: str | None = None) -> tuple[int, bytes]:
        if ckptid:
            check_checkpoint_id(ckptid)
        return self._request(Op.COMMIT, _U32.pack(handle) + (ckptid or "").encode())

    def send_abort(self, handle: int) -> tuple[int, bytes]:
        return self._request(Op.ABORT, _U32.pack(handle))

    def send_await_durable(self, store_id: StoreId, ref: CheckpointRef, timeout: float) -> tuple[int, bytes]:
        if not math.isfinite(timeout) or timeout < 0:
            raise InterfaceError(f"timeout must be a finite number >= 0, got {timeout}")
        fields = _store_fields(store_id) + [ref.ckptid.encode()]
        return self._request(Op.AWAIT_DURABLE, _DURABLE.pack(store_id.partition_id, ref.version, float(timeout))
                             + framing.encode_list(fields))

    def send_stats(self) -> tuple[int, bytes]:
        return self._request(Op.STATS, b"")

    def send_release(self, root: str, operator_id: str, partitions: Iterable[int | tuple[int, int] | list[int]],
                     store_name: str = DEFAULT_STORE_NAME) -> tuple[int, bytes]:
        """``partitions``: ids, or ``(id, below)`` pairs (only a copy whose head version is lower)."""
        pairs = [tuple(x) if isinstance(x, (tuple, list)) else (x, NO_LIMIT) for x in partitions]
        StoreId(root, operator_id, 0, store_name)  # checks the names
        for pair in pairs:
            if (len(pair) != 2 or any(isinstance(x, bool) or not isinstance(x, int) for x in pair)
                    or not 0 <= pair[0] <= 0xFFFFFFFF or not 0 <= pair[1] <= NO_LIMIT):
                raise InterfaceError(f"a partition id in [0, 2**32) or (id, below version) expected, got {pair!r}")
        return self._request(Op.RELEASE, _U32.pack(len(pairs)) + b"".join(_RELEASE.pack(*x) for x in pairs)
                             + framing.encode_list([root.encode(), operator_id.encode(), store_name.encode()]))

    def forget(self, request_id: int) -> None:
        """Stop expecting an answer to ``request_id`` (its answer, if it comes, is dropped)."""
        self._pending.pop(request_id, None)
        self._decoders.pop(request_id, None)

    def receive_data(self, data: bytes) -> None:
        if self.closed:
            return
        frames, oversized = _split(self, data)
        for opcode, flags, rid, payload in frames:
            ev = self._decode(opcode, flags, rid, payload)
            if ev is not None:
                self._events.append(ev)
                if isinstance(ev, ConnectionFailed):
                    self.closed = True
                    return
        if oversized is not None:
            self._events.append(ConnectionFailed(oversized[2], oversized[0], FrameTooLargeError(
                f"an answer of {oversized[3]} bytes is over the limit of {self.max_frame_bytes}")))
            self.closed = True

    def next_event(self) -> ClientEvent | _Sentinel:
        """The next answer event, ``NEED_DATA``, or ``CLOSED`` after a broken stream."""
        if self._events:
            return self._events.popleft()
        return CLOSED if self.closed else NEED_DATA

    def _decode(self, opcode: int, flags: int, rid: int, payload: bytes) -> ClientEvent | None:
        if not flags & RESPONSE:
            return ConnectionFailed(rid, opcode, ProtocolError(f"the daemon sent a request frame (opcode {opcode})"))
        if flags & ERROR:
            exc = decode_error(payload)
            if rid == 0:
                return ErrorResponse(0, opcode, exc)
            expected = self._pending.pop(rid, None)
            if expected is None:
                return None  # forgotten request
            if self._decoders:
                self._decoders.pop(rid, None)
            return ErrorResponse(rid, expected, exc)
        expected = self._pending.get(rid)
        if expected is None:
            return None
        if expected != opcode:
            return ConnectionFailed(rid, opcode, ProtocolError(
                f"answer to request {rid} has opcode {opcode}, the request had {expected}"))
        more = bool(flags & MORE)
        if not more:
            del self._pending[rid]
        decode = (self._decoders.pop(rid, None) if not more and self._decoders else None) or _RESPONSE_DECODERS[opcode]
        try:
            value = decode(payload)
        except StateStoreError as exc:
            self._pending.pop(rid, None)
            return ErrorResponse(rid, opcode, exc)
        return Response(rid, opcode, value, more)


__all__ = [
    "CLOSED",
    "ERROR",
    "MORE",
    "NEED_DATA",
    "NO_LIMIT",
    "PROTOCOL_VERSION",
    "RESPONSE",
    "Abort",
    "AwaitDurable",
    "BadRequest",
    "ClientProtocol",
    "Commit",
    "ConnectionFailed",
    "ConnectionLostError",
    "EncodeError",
    "ErrorResponse",
    "FrameTooLargeError",
    "GetMany",
    "HandshakeRequiredError",
    "Hello",
    "HelloInfo",
    "LimitExceededError",
    "Op",
    "Open",
    "PermissionDeniedError",
    "Ping",
    "ProtocolError",
    "PutMany",
    "Release",
    "RemoveMany",
    "Response",
    "Scan",
    "ScanRanges",
    "ServerProtocol",
    "ShuttingDownError",
    "Stats",
    "UnknownHandleError",
    "UnknownOpcodeError",
    "UnsupportedVersionError",
    "check_ranges",
    "decode_error",
    "encode_error",
]
