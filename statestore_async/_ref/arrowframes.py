"""Batch frames from and to Arrow-layout buffers, pure-Python reference.

This module *defines* the behaviour; ``_ext/arrowframes.pyx`` must give the same bytes and the same
errors. The layout and contracts are documented in ``statestore_async.codecs.arrowframes``.
"""
from __future__ import annotations

import struct
from typing import TYPE_CHECKING

from statestore_async._ref import framing as _fr
from statestore_async.errors import EncodeError

if TYPE_CHECKING:
    from statestore_async._ref import ArrowColumn, Buffer, BytesLike

_LARGE = 0x7FFFFFFF  # past this many data bytes, offsets are 64-bit


def _spans(col: ArrowColumn, n: int, what: str) -> list[tuple[int, int]]:
    """The (begin, end) byte range of each of the n items of column ``col``."""
    offsets, data, start, width = col
    if width not in (4, 8):
        raise EncodeError(f"{what}: offsets are 4 or 8 bytes wide, not {width}")
    offsets, data = memoryview(offsets).cast("B"), memoryview(data).cast("B")
    if start < 0 or n < 0 or (start + n + 1) * width > len(offsets):
        raise EncodeError(f"{what}: {len(offsets)} offset bytes cannot hold {n} items from item {start}")
    fmt = "<i" if width == 4 else "<q"
    offs = [struct.unpack_from(fmt, offsets, (start + i) * width)[0] for i in range(n + 1)]
    spans = []
    for i in range(n):
        b, e = offs[i], offs[i + 1]
        if b < 0 or e < b or e > len(data):
            raise EncodeError(f"{what}: item {i} spans bytes {b}..{e}, outside the {len(data)} data bytes")
        if e - b > _fr.MAX_ITEM_LEN:
            raise EncodeError(f"an item of {e - b} bytes is too long")
        spans.append((b, e))
    return spans


def _items(col: ArrowColumn, n: int, what: str) -> list[bytes]:
    data = memoryview(col[1]).cast("B")
    return [bytes(data[b:e]) for b, e in _spans(col, n, what)]


def encode_frame_list_buffers(opcode: int, flags: int, request_id: int, head: BytesLike, n: int, keys: ArrowColumn) -> bytes:
    """``framing.encode_frame_list(opcode, flags, request_id, head, items)`` where the n items are
    the column ``keys = (offsets, data, start, width)``."""
    return _fr.encode_frame_list(opcode, flags, request_id, head, _items(keys, n, "keys"))


def encode_frame_pairs_buffers(
    opcode: int, flags: int, request_id: int, head: BytesLike, n: int, keys: ArrowColumn, values: ArrowColumn
) -> bytes:
    """``framing.encode_frame_pairs`` of the n pairs of columns ``keys`` and ``values``."""
    ks = _items(keys, n, "keys")
    vs = _items(values, n, "values")
    return _fr.encode_frame_pairs(opcode, flags, request_id, head, list(zip(ks, vs)))


def decode_optional_list_buffers(
    buf: Buffer, offset: int = 0, max_count: int = _fr.MAX_U32
) -> tuple[int, int, bytes | None, bytes, bytes, int, int]:
    """An ``encode_optional_list`` payload as Arrow-layout buffers.

    Returns ``(count, null_count, validity, offsets, data, width, end)``: ``validity`` is a bitmap
    (bit i set: item i present; None when nothing is absent), ``offsets`` holds count + 1
    little-endian integers of ``width`` bytes (8 only past 2**31 - 1 data bytes), ``end`` is the
    end offset of the payload. Errors as ``framing.decode_optional_list``.
    """
    items, end = _fr.decode_optional_list(buf, offset, max_count)
    n = len(items)
    total = sum(len(x) for x in items if x is not None)
    width = 8 if total > _LARGE else 4
    fmt = "<i" if width == 4 else "<q"
    offsets = bytearray((n + 1) * width)
    bits = bytearray((n + 7) // 8)
    pos = nulls = 0
    for i, x in enumerate(items):
        if x is None:
            nulls += 1
        else:
            bits[i >> 3] |= 1 << (i & 7)
            pos += len(x)
        struct.pack_into(fmt, offsets, (i + 1) * width, pos)
    data = b"".join(x for x in items if x is not None)
    return n, nulls, (bytes(bits) if nulls else None), bytes(offsets), data, width, end
