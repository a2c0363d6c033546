"""Protocol framing, pure-Python reference: byte stream <-> frames, byte-string lists <-> payloads.

This module *defines* the behaviour; ``_ext/framing.pyx`` must produce the same bytes, the same
values and the same errors. The format is documented in ``statestore_async.codecs.framing``.
"""
from __future__ import annotations

import struct
from typing import TYPE_CHECKING, Any

from statestore_async.errors import DecodeError, EncodeError

if TYPE_CHECKING:
    from collections.abc import Iterable

    from statestore_async._ref import Buffer, BytesLike

HEADER_SIZE = 10
NONE_LEN = 0xFFFFFFFF
MAX_ITEM_LEN = 0xFFFFFFFE
MAX_U32 = 0xFFFFFFFF
_HEADER = struct.Struct("<IBBI")  # payload length, opcode, flags, request id
_U32 = struct.Struct("<I")


def _as_bytes(item: object, what: str) -> bytes:
    if type(item) is bytes:
        return item
    if isinstance(item, (bytearray, memoryview)):
        return bytes(item)
    raise EncodeError(f"{what} must be bytes, got {type(item).__name__}")


def encode_frame(opcode: int, flags: int, request_id: int, payload: BytesLike = b"") -> bytes:
    """One frame: ``u32 payload length | u8 opcode | u8 flags | u32 request id | payload``."""
    if not (0 <= opcode <= 255 and 0 <= flags <= 255 and 0 <= request_id <= MAX_U32):
        raise EncodeError(f"frame header out of range: opcode={opcode} flags={flags} request_id={request_id}")
    payload = _as_bytes(payload, "a payload")
    if len(payload) > MAX_U32:
        raise EncodeError(f"a payload of {len(payload)} bytes does not fit a frame")
    return _HEADER.pack(len(payload), opcode, flags, request_id) + payload


def split_frames(
    buf: Buffer, max_payload: int
) -> tuple[list[tuple[int, int, int, bytes]], int, tuple[int, int, int, int] | None]:
    """Cut the complete frames at the start of ``buf``.

    Returns ``(frames, consumed, oversized)``: ``frames`` is a list of
    ``(opcode, flags, request_id, payload)``, ``consumed`` the bytes they took, and ``oversized``
    the header ``(opcode, flags, request_id, length)`` of a frame announcing more than
    ``max_payload`` bytes (the stream cannot be resynchronised after it), else None.
    """
    view = memoryview(buf)
    n = len(view)
    pos = 0
    frames: list[tuple[int, int, int, bytes]] = []
    while n - pos >= HEADER_SIZE:
        length, opcode, flags, rid = _HEADER.unpack_from(view, pos)
        if length > max_payload:
            return frames, pos, (opcode, flags, rid, length)
        end = pos + HEADER_SIZE + length
        if end > n:
            break
        frames.append((opcode, flags, rid, bytes(view[pos + HEADER_SIZE : end])))
        pos = end
    return frames, pos, None


def _check_count(n: int, max_count: int, remaining: int, min_item: int, what: str) -> None:
    if n > max_count:
        raise DecodeError(f"{what}: {n} items, at most {max_count} allowed")
    if n * min_item > remaining:
        raise DecodeError(f"{what}: {n} items cannot fit in the {remaining} bytes left")


def _read_u32(view: memoryview, pos: int, end: int, what: str) -> int:
    if end - pos < 4:
        raise DecodeError(f"{what}: truncated at byte {pos}")
    n: int = _U32.unpack_from(view, pos)[0]
    return n


def encode_list(items: Iterable[BytesLike]) -> bytes:
    """``u32 count | (u32 length | bytes)*``."""
    parts = [b""]
    n = 0
    for item in items:
        b = _as_bytes(item, "a list item")
        if len(b) > MAX_ITEM_LEN:
            raise EncodeError(f"an item of {len(b)} bytes is too long")
        parts.append(_U32.pack(len(b)))
        parts.append(b)
        n += 1
    parts[0] = _U32.pack(n)
    return b"".join(parts)


def decode_list(buf: Buffer, offset: int = 0, max_count: int = MAX_U32) -> tuple[list[bytes], int]:
    """``(list of bytes, end offset)`` from an ``encode_list`` payload at ``offset``."""
    view = memoryview(buf)
    end = len(view)
    if offset < 0 or offset > end:
        raise DecodeError(f"list: offset {offset} outside the buffer")
    n = _read_u32(view, offset, end, "list")
    pos = offset + 4
    _check_count(n, max_count, end - pos, 4, "list")
    out = []
    for _ in range(n):
        ln = _read_u32(view, pos, end, "list")
        pos += 4
        if ln > end - pos:
            raise DecodeError(f"list: an item of {ln} bytes overruns the buffer at byte {pos}")
        out.append(bytes(view[pos : pos + ln]))
        pos += ln
    return out, pos


def encode_optional_list(items: Iterable[BytesLike | None]) -> bytes:
    """Like ``encode_list``, with None encoded as the length ``0xFFFFFFFF`` (distinct from b"")."""
    parts = [b""]
    n = 0
    for item in items:
        if item is None:
            parts.append(_U32.pack(NONE_LEN))
        else:
            b = _as_bytes(item, "a list item")
            if len(b) > MAX_ITEM_LEN:
                raise EncodeError(f"an item of {len(b)} bytes is too long")
            parts.append(_U32.pack(len(b)))
            parts.append(b)
        n += 1
    parts[0] = _U32.pack(n)
    return b"".join(parts)


def encode_found(values: Buffer, voff: Any, vlen: Any, found: Any) -> bytes:
    """The ``encode_optional_list`` payload of a batch lookup by index's answer: item ``i`` is
    ``values[voff[i] : voff[i] + vlen[i]]`` when ``found[i]`` and ``vlen[i] >= 0``, else None
    (absent, or ``vlen[i] < 0``: a tombstone). ``voff`` and ``vlen`` are int64 arrays and ``found``
    a uint8 array, all as long; a span outside ``values`` raises ``EncodeError``."""
    data = bytes(values)
    n = len(found)
    if len(voff) != n or len(vlen) != n:
        raise EncodeError(f"found answer: {n} found, {len(voff)} value offsets, {len(vlen)} value lengths")
    items: list[bytes | None] = []
    for i, (f, o, ln) in enumerate(zip(list(found), [int(x) for x in voff], [int(x) for x in vlen])):
        if not f or ln < 0:
            items.append(None)
            continue
        if ln > MAX_ITEM_LEN or o < 0 or o > len(data) or ln > len(data) - o:
            raise EncodeError(f"found answer: item {i} ({ln} bytes at {o}) is not inside the "
                              f"{len(data)} bytes of values")
        items.append(data[o : o + ln])
    return encode_optional_list(items)


def decode_optional_list(buf: Buffer, offset: int = 0, max_count: int = MAX_U32) -> tuple[list[bytes | None], int]:
    """``(list of bytes | None, end offset)`` from an ``encode_optional_list`` payload."""
    view = memoryview(buf)
    end = len(view)
    if offset < 0 or offset > end:
        raise DecodeError(f"optional list: offset {offset} outside the buffer")
    n = _read_u32(view, offset, end, "optional list")
    pos = offset + 4
    _check_count(n, max_count, end - pos, 4, "optional list")
    out: list[bytes | None] = []
    for _ in range(n):
        ln = _read_u32(view, pos, end, "optional list")
        pos += 4
        if ln == NONE_LEN:
            out.append(None)
            continue
        if ln > end - pos:
            raise DecodeError(f"optional list: an item of {ln} bytes overruns the buffer at byte {pos}")
        out.append(bytes(view[pos : pos + ln]))
        pos += ln
    return out, pos


def encode_pairs(items: Iterable[tuple[BytesLike, BytesLike]]) -> bytes:
    """``u32 count | (u32 klen | key | u32 vlen | value)*`` from (key, value) pairs."""
    parts = [b""]
    n = 0
    for item in items:
        try:
            k, v = item
        except (TypeError, ValueError):
            raise EncodeError(f"pairs are (key, value) tuples, got {item!r:.80}") from None
        k = _as_bytes(k, "a key")
        v = _as_bytes(v, "a value")
        if len(k) > MAX_ITEM_LEN or len(v) > MAX_ITEM_LEN:
            raise EncodeError("a key or value is too long")
        parts += (_U32.pack(len(k)), k, _U32.pack(len(v)), v)
        n += 1
    parts[0] = _U32.pack(n)
    return b"".join(parts)


def decode_pairs(buf: Buffer, offset: int = 0, max_count: int = MAX_U32) -> tuple[list[tuple[bytes, bytes]], int]:
    """``(list of (key, value), end offset)`` from an ``encode_pairs`` payload."""
    view = memoryview(buf)
    end = len(view)
    if offset < 0 or offset > end:
        raise DecodeError(f"pairs: offset {offset} outside the buffer")
    n = _read_u32(view, offset, end, "pairs")
    pos = offset + 4
    _check_count(n, max_count, end - pos, 8, "pairs")
    out = []
    for _ in range(n):
        kl = _read_u32(view, pos, end, "pairs")
        pos += 4
        if kl > end - pos:
            raise DecodeError(f"pairs: a key of {kl} bytes overruns the buffer at byte {pos}")
        k = bytes(view[pos : pos + kl])
        pos += kl
        vl = _read_u32(view, pos, end, "pairs")
        pos += 4
        if vl > end - pos:
            raise DecodeError(f"pairs: a value of {vl} bytes overruns the buffer at byte {pos}")
        out.append((k, bytes(view[pos : pos + vl])))
        pos += vl
    return out, pos


def check_list(buf: Buffer, offset: int = 0, max_count: int = MAX_U32) -> tuple[int, int]:
    """``(count, end offset)`` of an ``encode_list`` payload, validated like ``decode_list``
    (same errors) without building the items."""
    items, end = decode_list(buf, offset, max_count)
    return len(items), end


def list_offsets(buf: Buffer, offset: int = 0, max_count: int = MAX_U32) -> tuple[bytes, int]:
    """``(offsets, end offset)`` of an ``encode_list`` payload at ``offset``, validated like
    ``decode_list`` (same errors): the offset in ``buf`` of each item's bytes (its length is the
    u32 before them), as int64 little-endian bytes. A batch lookup by index reads the keys of a
    request in place through them."""
    items, end = decode_list(buf, offset, max_count)
    pos = offset + 4
    offsets = []
    for item in items:
        offsets.append(pos + 4)
        pos += 4 + len(item)
    return struct.pack(f"<{len(offsets)}q", *offsets), end


def check_pairs(buf: Buffer, offset: int = 0, max_count: int = MAX_U32) -> tuple[int, int]:
    """``(count, end offset)`` of an ``encode_pairs`` payload, validated like ``decode_pairs``
    (same errors) without building the pairs."""
    items, end = decode_pairs(buf, offset, max_count)
    return len(items), end


def encode_frame_list(opcode: int, flags: int, request_id: int, head: BytesLike, items: Iterable[BytesLike]) -> bytes:
    """``encode_frame(opcode, flags, request_id, head + encode_list(items))`` in one step."""
    return encode_frame(opcode, flags, request_id, _as_bytes(head, "a head") + encode_list(items))


def encode_frame_pairs(
    opcode: int, flags: int, request_id: int, head: BytesLike, items: Iterable[tuple[BytesLike, BytesLike]]
) -> bytes:
    """``encode_frame(opcode, flags, request_id, head + encode_pairs(items))`` in one step."""
    return encode_frame(opcode, flags, request_id, _as_bytes(head, "a head") + encode_pairs(items))
