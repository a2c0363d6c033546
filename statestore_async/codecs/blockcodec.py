"""Record block codec: many ``(key, value | None)`` records <-> one checksummed, compressed block.

The functions come from the compiled module when it is built (``statestore_async._native``), else
from the pure-Python reference (``statestore_async._ref``); both give the same bytes and errors.
A record is ``(key: bytes, value: bytes | None)``; ``None`` is a tombstone (a removed key).

Block layout (all integers little-endian)
-----------------------------------------
======  ==========  ======  ==========================================================================
offset  field       size    meaning
======  ==========  ======  ==========================================================================
0       magic       2       ``b"\\xb1\\x0c"``
2       codec       u8      0 = none, 1 = zstd
3       flags       u8      0 (reserved; decoders reject anything else)
4       count       u32     number of records
8       raw_len     u32     length of the uncompressed payload (at most 256 MiB)
12      stored_len  u32     length of the payload as stored (= raw_len when codec is 0)
16      checksum    u64     ``xxhash.xxh3_64_intdigest(bytes 0..15 of the header + stored payload)``
24      payload     stored  the payload, a single zstd frame (with its content size) when codec is 1
======  ==========  ======  ==========================================================================

The uncompressed payload is ``count`` records, each: u8 kind (0 = put, 1 = tombstone), varint
key length, key, and for puts varint value length, value (varints: unsigned LEB128, shortest
form).

Functions
---------
``encode_block(records, start=0, max_raw_bytes=1048576, codec=CODEC_ZSTD, level=3)``
    Encodes ``records[start:]`` until the next record would push the raw payload past
    ``max_raw_bytes`` (always at least one record when any remain; a single record larger than
    256 MiB raises ``EncodeError``). Returns ``(block, next index)``; calling it again from the
    returned index until it reaches ``len(records)`` covers every record once, in order. With
    zstd, a payload that does not get smaller is stored uncompressed (codec 0 in the header), and
    an empty payload is never compressed. The bytes depend only on the records and arguments.
    Keys and values may be bytes, bytearray or memoryview; anything else raises ``EncodeError``.
``encode_payload_block(payload, count, codec=CODEC_ZSTD, level=3) -> bytes``
    The block of an already encoded records payload of exactly ``count`` records (the payload
    ``encode_records_raw`` gives, or ``engine.table``'s ``TableView.chunk_packed`` writes straight
    from a table): the same bytes as ``encode_block`` gives for those records when they fit one
    block. The payload is checked whole first (a malformed one, or one of more than 256 MiB,
    raises ``EncodeError``: no block is made that would not decode). zstd runs without the GIL,
    so files encode their blocks in parallel threads (``files.checkpoint``).
``decode_block(buf, offset=0) -> (records, offset past the block)``
    Verifies magic, codec, flags, sizes, checksum, the zstd frame and its size, and that the
    payload holds exactly ``count`` well-formed records. Any failure raises ``CorruptBlockError``
    with the reason ("checksum mismatch", "truncated: need 1234 bytes, have 100", ...).
``read_block_header(buf, offset=0) -> (codec, count, raw_len, stored_len, total_len)``
    Checks magic, codec, flags and sizes only, so a streaming reader knows how many bytes
    (``total_len``) the block needs; fewer than 24 bytes raise ``CorruptBlockError("truncated...")``.
``encode_records_raw(records) -> bytes`` / ``decode_records_raw(payload, count) -> list``
    The uncompressed payload alone, with the same validation.
``record_spans(payload, count) -> bytes``
    Where the records of an uncompressed payload lie in it, with the same validation and no
    object per record: ``count`` × four u32 little-endian (key offset, key length, value offset,
    value length, the last ``NO_VALUE`` for a tombstone).
``RecordBlock(payload, count)``
    A block's decompressed payload read in place (checked as ``decode_records_raw`` checks it;
    then the payload and 16 bytes of span per record, no object per record): ``len``,
    ``bisect_left(key)``, ``entry(i) -> (key, value | None)``, ``nbytes``, and
    ``lookup_spans(kbuf, koff, js, found, voff, vlen, base) -> bytes``: a batch lookup by index over
    packed keys (key ``j`` is the bytes of ``kbuf`` at ``koff[j]``, its length the u32 before them:
    a ``framing.encode_list`` payload seen through ``framing.list_offsets``). For each index ``j``
    of the int64 array ``js`` (none found yet) whose key the block holds, by binary search:
    ``found[j]`` = 1 and, for a value, ``vlen[j]`` its length and ``voff[j]`` = ``base`` + its offset
    in the returned bytes (the values found, in the order of ``js``); for a tombstone ``vlen[j]`` =
    -1. No Python object per key or value. A cold run's block cache holds its blocks so;
    ``engine.lookup.KeyLookup`` drives the lookups.
``block_indexes(first_keys, kbuf, koff, js) -> bytes``
    For each index ``j`` of the int64 array ``js``: ``bisect_right(first_keys, key j) - 1`` as
    int64 little-endian (keys packed as for ``lookup_spans``), the block of a file (whose blocks
    start at ``first_keys``) that would hold the key; -1 before the first. A cold run's reads find
    their blocks with it.
``key_group_range(records, start, stop) -> (min, max)``
    The smallest and largest key group (a key's first two bytes, big-endian; 0 for a shorter key)
    of ``records[start:stop]``, for a block's index entry; records are checked as for encoding.

Bad arguments (negative offset/start/count, unknown codec for encoding, zstd level out of range)
raise ``InterfaceError``; an object that is not bytes-like where bytes are read raises
``TypeError``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from statestore_async.codecs import twins

if TYPE_CHECKING or twins.NO_EXTENSIONS:
    from statestore_async._ref.blockcodec import *
else:
    try:
        from statestore_async._native.blockcodec import *
    except ImportError as _exc:
        twins.missing('blockcodec', _exc)
        from statestore_async._ref.blockcodec import *


