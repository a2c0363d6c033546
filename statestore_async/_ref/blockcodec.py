"""Record block codec, pure-Python reference: (key, value | None) records <-> checksummed blocks.

This module *defines* the behaviour; ``_ext/blockcodec.pyx`` must produce the same bytes, the
same records and the same errors. The format is documented for users in
``statestore_async.codecs.blockcodec``.
"""
from __future__ import annotations

import bisect
import struct
import threading
from typing import TYPE_CHECKING, Any

import xxhash
import zstandard

from statestore_async.errors import CorruptBlockError, EncodeError, InterfaceError

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

    from statestore_async._ref import Buffer, BytesLike

MAGIC = b"\xb1\x0c"
HEADER_SIZE = 24
CODEC_NONE = 0
CODEC_ZSTD = 1
#: Largest uncompressed payload of one block (256 MiB).
MAX_RAW_LEN = 256 * 1024 * 1024
KIND_PUT = 0
KIND_TOMBSTONE = 1
MIN_ZSTD_LEVEL = -(1 << 17)
NO_VALUE = 0xFFFFFFFF  # a tombstone's value length in ``record_spans``

_HEADER = struct.Struct("<2sBBIII")  # magic, codec, flags, count, raw_len, stored_len
_CHECKSUM = struct.Struct("<Q")
_SPAN = struct.Struct("<IIII")


def max_stored_len(raw_len: int) -> int:
    """Upper bound of a zstd frame holding ``raw_len`` bytes (ZSTD_compressBound plus slack)."""
    return raw_len + (raw_len >> 7) + 512


# --- zstd objects, one set per thread (they are not thread-safe) ---------------------------------
_local = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    cache: dict[int, zstandard.ZstdCompressor] | None = getattr(_local, "compressors", None)
    if cache is None:
        cache = _local.compressors = {}
    c = cache.get(level)
    if c is None:
        c = cache[level] = zstandard.ZstdCompressor(level=level)
    return c


def _decompressor() -> zstandard.ZstdDecompressor:
    d: zstandard.ZstdDecompressor | None = getattr(_local, "decompressor", None)
    if d is None:
        d = _local.decompressor = zstandard.ZstdDecompressor()
    return d


# --- helpers -------------------------------------------------------------------------------------
def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _varint_len(n: int) -> int:
    size = 1
    while n >= 0x80:
        n >>= 7
        size += 1
    return size


def _type_name(value: object) -> str:
    t = type(value)
    return t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _bytes_of(value: object, index: int, what: str) -> bytes:
    if isinstance(value, (bytes, bytearray, memoryview)):
        try:
            return memoryview(value).tobytes()
        except ValueError as exc:  # released memoryview
            raise EncodeError(f"record {index}: cannot read {what}: {exc}") from None
    raise EncodeError(f"record {index}: {what} must be bytes-like, not {_type_name(value)}")


def _record(records: Sequence[tuple[BytesLike, BytesLike | None]], index: int) -> tuple[bytes, bytes | None]:
    rec = records[index]
    if not isinstance(rec, (tuple, list)) or len(rec) != 2:
        raise EncodeError(f"record {index}: expected a (key, value) pair, got {_type_name(rec)}")
    key = _bytes_of(rec[0], index, "key")
    value = rec[1]
    if value is not None:
        value = _bytes_of(value, index, "value")
    return key, value


def _record_size(key: bytes, value: bytes | None) -> int:
    size = 1 + _varint_len(len(key)) + len(key)
    if value is not None:
        size += _varint_len(len(value)) + len(value)
    return size


def _append_record(out: bytearray, key: bytes, value: bytes | None) -> None:
    if value is None:
        out.append(KIND_TOMBSTONE)
        out += _varint(len(key))
        out += key
    else:
        out.append(KIND_PUT)
        out += _varint(len(key))
        out += key
        out += _varint(len(value))
        out += value


def _as_bytes(data: Buffer) -> bytes:
    """The raw bytes of a C-contiguous bytes-like object (TypeError for anything else)."""
    if isinstance(data, bytes):
        return data
    try:
        view = memoryview(data)
    except TypeError:
        raise TypeError(f"expected a bytes-like object, got {_type_name(data)}") from None
    if not view.c_contiguous:
        raise TypeError("expected a C-contiguous bytes-like object")
    return view.tobytes()


def _check_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InterfaceError(f"{name} must be an int, not {_type_name(value)}")
    return int(value)


# --- encoding ------------------------------------------------------------------------------------
def encode_records_raw(records: Iterable[tuple[BytesLike, BytesLike | None]]) -> bytes:
    """The uncompressed payload holding every record of ``records``, in order."""
    if not isinstance(records, list):
        records = list(records)
    out = bytearray()
    for i in range(len(records)):
        key, value = _record(records, i)
        _append_record(out, key, value)
    return bytes(out)


def key_group_range(records: Iterable[tuple[BytesLike, BytesLike | None]], start: int, stop: int) -> tuple[int, int]:
    """``(min, max)`` of the key groups of ``records[start:stop]`` (a key's first two bytes,
    big-endian; 0 for a shorter key)."""
    start, stop = _check_int("start", start), _check_int("stop", stop)
    if not isinstance(records, list):
        records = list(records)
    if not 0 <= start < stop <= len(records):
        raise InterfaceError(f"range {start}..{stop} is empty or outside 0..{len(records)}")
    groups = []
    for i in range(start, stop):
        key, _ = _record(records, i)
        groups.append((key[0] << 8) | key[1] if len(key) >= 2 else 0)
    return min(groups), max(groups)


def encode_block(
    records: Iterable[tuple[BytesLike, BytesLike | None]],
    start: int = 0,
    max_raw_bytes: int = 1048576,
    codec: int = CODEC_ZSTD,
    level: int = 3,
) -> tuple[bytes, int]:
    """Encode ``records[start:]`` into one block, as many as fit in ``max_raw_bytes`` of raw
    payload (at least one when any remain). Returns ``(block, index of the next record)``.

    With ``codec=CODEC_ZSTD`` the payload is stored uncompressed (codec 0 in the header) when
    compressing does not make it smaller.
    """
    start = _check_int("start", start)
    max_raw_bytes = _check_int("max_raw_bytes", max_raw_bytes)
    codec = _check_int("codec", codec)
    level = _check_int("level", level)
    if not isinstance(records, list):
        records = list(records)
    if not 0 <= start <= len(records):
        raise InterfaceError(f"start {start} outside 0..{len(records)}")
    if max_raw_bytes < 1:
        raise InterfaceError(f"max_raw_bytes must be at least 1, got {max_raw_bytes}")
    if codec not in (CODEC_NONE, CODEC_ZSTD):
        raise InterfaceError(f"unknown codec {codec}")
    if not MIN_ZSTD_LEVEL <= level <= zstandard.MAX_COMPRESSION_LEVEL:
        raise InterfaceError(f"zstd level {level} outside {MIN_ZSTD_LEVEL}..{zstandard.MAX_COMPRESSION_LEVEL}")
    limit = min(max_raw_bytes, MAX_RAW_LEN)
    out = bytearray()
    end = start
    n = len(records)
    while end < n:
        key, value = _record(records, end)
        size = _record_size(key, value)
        if len(out) + size > limit:
            if end == start:
                if size > MAX_RAW_LEN:
                    raise EncodeError(
                        f"record {end}: {size} bytes encoded, more than a block holds ({MAX_RAW_LEN})"
                    )
            else:
                break
        _append_record(out, key, value)
        end += 1
    return _make_block(bytes(out), end - start, codec, level), end


def _make_block(raw: bytes, count: int, codec: int, level: int) -> bytes:
    """The block of a raw payload of ``count`` records (arguments checked by the caller)."""
    stored = raw
    used = CODEC_NONE
    if codec == CODEC_ZSTD and raw:
        compressed = _compressor(level).compress(raw)
        if len(compressed) < len(raw):
            stored = compressed
            used = CODEC_ZSTD
    header = _HEADER.pack(MAGIC, used, 0, count, len(raw), len(stored))
    checksum = xxhash.xxh3_64_intdigest(header + stored)
    return header + _CHECKSUM.pack(checksum) + stored


def encode_payload_block(payload: Buffer, count: int, codec: int = CODEC_ZSTD, level: int = 3) -> bytes:
    """The block holding ``payload``, an already encoded records payload (as ``encode_records_raw``
    or ``TableView.chunk_packed`` makes it) of exactly ``count`` records: the same bytes as
    ``encode_block`` of those records gives when they all fit. The payload is checked whole (a
    malformed one, or one larger than ``MAX_RAW_LEN``, raises ``EncodeError``: a block is never
    written that would not decode); zstd runs without the GIL in the compiled twin, so blocks can
    be encoded in parallel threads."""
    count = _check_int("count", count)
    codec = _check_int("codec", codec)
    level = _check_int("level", level)
    if count < 0:
        raise InterfaceError(f"count must not be negative, got {count}")
    if codec not in (CODEC_NONE, CODEC_ZSTD):
        raise InterfaceError(f"unknown codec {codec}")
    if not MIN_ZSTD_LEVEL <= level <= zstandard.MAX_COMPRESSION_LEVEL:
        raise InterfaceError(f"zstd level {level} outside {MIN_ZSTD_LEVEL}..{zstandard.MAX_COMPRESSION_LEVEL}")
    raw = _as_bytes(payload)
    if len(raw) > MAX_RAW_LEN:
        raise EncodeError(f"a payload of {len(raw)} bytes is more than a block holds ({MAX_RAW_LEN})")
    try:
        _parse_records(raw, count)
    except CorruptBlockError as exc:
        raise EncodeError(f"not a payload of {count} records: {exc}") from None
    return _make_block(raw, count, codec, level)


# --- decoding ------------------------------------------------------------------------------------
def _header(buf: bytes, offset: int) -> tuple[int, int, int, int, int]:
    have = len(buf) - offset if offset < len(buf) else 0
    if have < HEADER_SIZE:
        raise CorruptBlockError(f"truncated: need {HEADER_SIZE} bytes for the block header, have {have}")
    magic, codec, flags, count, raw_len, stored_len = _HEADER.unpack_from(buf, offset)
    if magic != MAGIC:
        raise CorruptBlockError(f"bad magic {magic.hex()} (expected {MAGIC.hex()})")
    if codec not in (CODEC_NONE, CODEC_ZSTD):
        raise CorruptBlockError(f"unknown codec {codec}")
    if flags != 0:
        raise CorruptBlockError(f"reserved flags set: 0x{flags:02x}")
    if raw_len > MAX_RAW_LEN:
        raise CorruptBlockError(f"raw length {raw_len} exceeds the limit {MAX_RAW_LEN}")
    if count > raw_len // 2:
        raise CorruptBlockError(f"count {count} impossible in a payload of {raw_len} bytes")
    if codec == CODEC_NONE:
        if stored_len != raw_len:
            raise CorruptBlockError(f"stored length {stored_len} differs from raw length {raw_len} without compression")
    elif stored_len > max_stored_len(raw_len):
        raise CorruptBlockError(f"stored length {stored_len} too large for raw length {raw_len}")
    return codec, count, raw_len, stored_len, HEADER_SIZE + stored_len


def _check_offset(offset: int) -> int:
    offset = _check_int("offset", offset)
    if offset < 0:
        raise InterfaceError(f"offset must not be negative, got {offset}")
    return offset


def read_block_header(buf: Buffer, offset: int = 0) -> tuple[int, int, int, int, int]:
    """``(codec, count, raw_len, stored_len, total_len)`` of the block at ``buf[offset:]``,
    checking magic, flags and sizes only (not the checksum)."""
    return _header(_as_bytes(buf), _check_offset(offset))


def _read_varint(payload: bytes, pos: int, end: int, index: int, what: str) -> tuple[int, int]:
    start = pos
    result = 0
    shift = 0
    while True:
        if pos >= end:
            raise CorruptBlockError(f"record {index}: truncated {what} length at payload offset {start}")
        b = payload[pos]
        pos += 1
        if shift == 63 and b > 1:
            raise CorruptBlockError(f"record {index}: {what} length overflows 64 bits at payload offset {start}")
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            if b == 0 and pos - start > 1:
                raise CorruptBlockError(f"record {index}: non-canonical {what} length at payload offset {start}")
            return result, pos
        shift += 7


def _walk_records(payload: bytes, count: int) -> list[tuple[int, int, int, int]]:
    """The spans (key offset, key length, value offset, value length or ``NO_VALUE``) of the
    ``count`` records of a payload, checked (``CorruptBlockError`` naming the record)."""
    if count > len(payload) // 2:
        raise CorruptBlockError(f"count {count} impossible in a payload of {len(payload)} bytes")
    end = len(payload)
    pos = 0
    spans: list[tuple[int, int, int, int]] = []
    for i in range(count):
        if pos >= end:
            raise CorruptBlockError(f"record {i}: truncated at payload offset {pos}")
        kind = payload[pos]
        if kind > KIND_TOMBSTONE:
            raise CorruptBlockError(f"record {i}: unknown kind {kind} at payload offset {pos}")
        pos += 1
        n, pos = _read_varint(payload, pos, end, i, "key")
        if n > end - pos:
            raise CorruptBlockError(f"record {i}: key length {n} beyond payload")
        kpos, klen = pos, n
        pos += n
        if kind == KIND_PUT:
            n, pos = _read_varint(payload, pos, end, i, "value")
            if n > end - pos:
                raise CorruptBlockError(f"record {i}: value length {n} beyond payload")
            spans.append((kpos, klen, pos, n))
            pos += n
        else:
            spans.append((kpos, klen, 0, NO_VALUE))
    if pos != end:
        raise CorruptBlockError(f"{end - pos} bytes left over after the last record")
    return spans


def _parse_records(payload: bytes, count: int) -> list[tuple[bytes, bytes | None]]:
    return [(payload[kp : kp + kl], None if vl == NO_VALUE else payload[vp : vp + vl])
            for kp, kl, vp, vl in _walk_records(payload, count)]


def record_spans(payload: Buffer, count: int) -> bytes:
    """Where the ``count`` records of an uncompressed payload lie in it, checked as
    ``decode_records_raw`` checks them: ``count`` spans of four u32 little-endian each (key offset,
    key length, value offset, value length), the value length ``NO_VALUE`` (and its offset 0) for
    a tombstone. Payloads are at most 4 GiB."""
    count = _check_int("count", count)
    if count < 0:
        raise InterfaceError(f"count must not be negative, got {count}")
    payload = _as_bytes(payload)
    if len(payload) > 0xFFFFFFFF:
        raise InterfaceError(f"a payload of {len(payload)} bytes is over 4 GiB")
    return b"".join(_SPAN.pack(*span) for span in _walk_records(payload, count))


def decode_records_raw(payload: Buffer, count: int) -> list[tuple[bytes, bytes | None]]:
    """The ``count`` records of an uncompressed payload that holds exactly them."""
    count = _check_int("count", count)
    if count < 0:
        raise InterfaceError(f"count must not be negative, got {count}")
    return _parse_records(_as_bytes(payload), count)


def _check_spans(kbuf: Buffer, koff: Any, js: Iterable[int], found: Any, voff: Any, vlen: Any,
                 what: str) -> list[tuple[int, bytes]]:
    """The indexes of ``js`` for a batch lookup by index over packed keys (``what``), checked, with
    their keys: ``found``, ``voff`` and ``vlen`` as long as ``koff`` (``InterfaceError``); each index
    within them (``IndexError``) and not found yet (``InterfaceError``: a level is asked only for the
    keys no newer level has); its key (the bytes of ``kbuf`` at ``koff[j]``, its length the u32
    before them) inside ``kbuf`` (``InterfaceError``). Shared by the lookups here and in
    ``_ref.table``; the compiled twins share ``_wire.check_spans``."""
    data = memoryview(kbuf)  # not copied: a level is asked once per block
    n, size = len(koff), data.nbytes
    if len(found) != n or len(voff) != n or len(vlen) != n:
        raise InterfaceError(f"{what}: {n} key offsets, {len(found)} found, {len(voff)} value offsets, "
                             f"{len(vlen)} value lengths")
    out = []
    for j in (int(x) for x in js):
        if j < 0 or j >= n:
            raise IndexError(f"{what}: index {j} out of range for {n} keys")
        if found[j]:
            raise InterfaceError(f"{what}: key {j} is already found (ask a level only for the keys no newer level has)")
        at = int(koff[j])
        if at < 4 or at > size or struct.unpack_from("<I", data, at - 4)[0] > size - at:
            raise InterfaceError(f"{what}: key {j} at offset {at} is not inside the {size}-byte key buffer")
        out.append((j, bytes(data[at : at + struct.unpack_from("<I", data, at - 4)[0]])))
    return out


def _answer(hits: list[tuple[int, bytes | None]], found: Any, voff: Any, vlen: Any, base: int) -> bytes:
    """Record a lookup's ``hits`` (index, value | None) in ``found``/``voff``/``vlen``: the values
    one after another in the returned bytes, their offsets counted from ``base``."""
    parts, pos = [], 0
    for j, v in hits:
        found[j] = 1
        if v is None:
            vlen[j] = -1
        else:
            voff[j], vlen[j] = base + pos, len(v)
            parts.append(v)
            pos += len(v)
    return b"".join(parts)


def block_indexes(first_keys: Sequence[bytes], kbuf: Buffer, koff: Any, js: Iterable[int]) -> bytes:
    """For each index ``j`` of ``js`` (an int64 array), the block of a file whose blocks start at
    the sorted ``first_keys`` that would hold key ``j`` (the bytes of ``kbuf`` at ``koff[j]``, as in
    ``RecordBlock.lookup_spans``): ``bisect.bisect_right(first_keys, key) - 1`` (-1: before the
    first block), as int64 little-endian bytes. Bad arguments raise as ``lookup_spans`` does."""
    first = list(first_keys)
    for f in first:
        if type(f) is not bytes:
            raise InterfaceError(f"first keys are bytes, got {type(f).__name__}")
    n = len(koff)
    keys = _check_spans(kbuf, koff, js, bytes(n), koff, koff, "block_indexes")
    return struct.pack(f"<{len(keys)}q", *(bisect.bisect_right(first, k) - 1 for _, k in keys))


class RecordBlock:
    """The records of one block's decompressed ``payload`` (``count`` of them, in key order, as in
    every file's blocks), read in place: checked at construction as ``decode_records_raw`` checks
    them (``CorruptBlockError``), then searched by binary search over their spans. The compiled twin
    keeps only the payload and 16 bytes of span per record (no object per record); ``nbytes`` is
    that. A cold run's cache holds its blocks so."""

    __slots__ = ("_keys", "_values", "count", "nbytes")

    def __init__(self, payload: Buffer, count: int) -> None:
        data = _as_bytes(payload)
        spans = record_spans(data, count)
        self.count = count
        self.nbytes = len(data) + len(spans) + 160
        self._keys: list[bytes] = []
        self._values: list[bytes | None] = []
        for kp, kl, vp, vl in struct.iter_unpack("<IIII", spans):
            self._keys.append(data[kp : kp + kl])
            self._values.append(None if vl == NO_VALUE else data[vp : vp + vl])

    def __len__(self) -> int:
        return self.count

    def bisect_left(self, key: bytes) -> int:
        """The index of the first record whose key is not below ``key``."""
        if type(key) is not bytes:
            raise InterfaceError(f"keys are bytes, got {type(key).__name__}")
        return bisect.bisect_left(self._keys, key)

    def entry(self, i: int) -> tuple[bytes, bytes | None]:
        """Record ``i``: (key, value), the value None for a tombstone."""
        if i < 0 or i >= self.count:
            raise IndexError(f"record {i} of a block of {self.count}")
        return self._keys[i], self._values[i]

    def lookup_spans(self, kbuf: Buffer, koff: Any, js: Iterable[int], found: Any, voff: Any, vlen: Any,
                     base: int) -> bytes:
        """A batch lookup by index over packed keys: for each index ``j`` of ``js`` (an int64 array)
        whose key (the bytes of ``kbuf`` at ``koff[j]``; its length the u32 before them, as in a
        ``framing.encode_list`` payload, see ``framing.list_offsets``) the block holds,
        ``found[j]`` = 1 and, for a value, ``vlen[j]`` = its length and ``voff[j]`` = ``base`` + its
        offset in the returned bytes (the values found, in the order of ``js``); for a tombstone
        ``vlen[j]`` = -1. ``found`` is a uint8 array, ``voff`` and ``vlen`` int64 arrays, as long as
        ``koff``; only indexes not found yet may be asked. Bad arguments raise before anything is
        written."""
        keys = _check_spans(kbuf, koff, js, found, voff, vlen, "lookup_spans")
        hits: list[tuple[int, bytes | None]] = []
        for j, k in keys:
            at = bisect.bisect_left(self._keys, k)
            if at < self.count and self._keys[at] == k:
                hits.append((j, self._values[at]))
        return _answer(hits, found, voff, vlen, base)


def decode_block(buf: Buffer, offset: int = 0) -> tuple[list[tuple[bytes, bytes | None]], int]:
    """Decode and verify the block at ``buf[offset:]``: ``(records, offset past the block)``."""
    buf = _as_bytes(buf)
    offset = _check_offset(offset)
    codec, count, raw_len, _stored_len, total = _header(buf, offset)
    have = len(buf) - offset
    if have < total:
        raise CorruptBlockError(f"truncated: need {total} bytes, have {have}")
    stored = buf[offset + HEADER_SIZE : offset + total]
    (expected,) = _CHECKSUM.unpack_from(buf, offset + 16)
    if xxhash.xxh3_64_intdigest(buf[offset : offset + 16] + stored) != expected:
        raise CorruptBlockError("checksum mismatch")
    if codec == CODEC_ZSTD:
        payload = _decompress(stored, raw_len)
    else:
        payload = stored
    return _parse_records(payload, count), offset + total


def _decompress(stored: bytes, raw_len: int) -> bytes:
    try:
        size = zstandard.frame_content_size(stored)
    except zstandard.ZstdError as exc:
        raise CorruptBlockError(f"bad zstd frame header: {exc}") from None
    if size != raw_len:
        raise CorruptBlockError(f"zstd frame declares {size} bytes, header says {raw_len}")
    try:
        dobj = _decompressor().decompressobj(write_size=max(raw_len, 1))
        payload = dobj.decompress(stored)
    except zstandard.ZstdError as exc:
        raise CorruptBlockError(f"zstd decompression failed: {exc}") from None
    if not dobj.eof:
        raise CorruptBlockError("zstd frame incomplete")
    if dobj.unused_data:
        raise CorruptBlockError(f"{len(dobj.unused_data)} bytes after the zstd frame")
    if len(payload) != raw_len:
        raise CorruptBlockError(f"decompressed {len(payload)} bytes, header says {raw_len}")
    return payload
