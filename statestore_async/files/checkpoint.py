"""Checkpoint files: deltas and snapshots of one store (docs/ARCHITECTURE.md, "Checkpoint
files"). Pure bytes in, bytes out.

File layout (every integer little-endian)::

    header   magic b"SSCK" | u16 format version | u8 kind (1 delta, 2 snapshot) | u8 0
             u32 n | u64 xxh3 of the JSON | n bytes of JSON:
             {"store": {operator_id, partition_id, store_name}, "version", "ckptid",
              "lineage": [[version, ckptid], ...]  (newest first, back to the base),
              "codec": "zstd" | "none", "created": unix seconds, "writer": "statestore_async x.y"}
    blocks   record blocks (statestore_async.codecs.blockcodec: magic, lengths, xxh3 checksum, zstd body)
    footer   b"\\xf0\\x07" | u32 n | n bytes of JSON:
             {"records": total, "blocks": [[offset, length, count, first_kg, last_kg], ...],
              "first_keys": [hex of each block's first key, ...]}
    trailer  u64 footer offset | u32 footer length | u64 xxh3(footer) | b"SSCE"   (24 bytes)

Records are in key order, so key groups (the first two key bytes) ascend through the file and the
footer's block index (each block's smallest and largest key group) tells which byte ranges hold a
range of key groups (for a rescale). ``first_keys`` (files written since the cold tier; older files
lack it and read the same) names each block's first key, so that a reader can find the block of any
key from the footer alone and read just that block (``files.coldrun``: a snapshot serves as the cold
level of a store without being read whole). In a delta a tombstone (value None) marks a removed key.
Readers do not rely on the order: files written in commit order read the same.

Writing: the records of an engine table are written into block payloads straight from its arena
(``TableView.chunk_packed``: no Python object per record) and each payload is compressed
(``blockcodec.encode_payload_block``; zstd runs without the GIL) in a small pool of threads,
``ENCODE_THREADS`` of them, while the next payload is gathered; blocks are appended in order. The
snapshot of a spilled store is written from its snapshot run's blocks instead (``merged_blocks``,
``files.coldrun``): blocks nothing changed in are copied as stored, the others merged and compressed.

A reader checks every checksum, every length and that the header names the file it was asked
for; any failure raises ``CorruptFileError`` naming the file — never a wrong value.
"""
from __future__ import annotations

import json
import os
import struct
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NoReturn, Protocol, TypeAlias, TypedDict, Unpack

import xxhash

from statestore_async import __version__
from statestore_async.codecs import blockcodec
from statestore_async.codecs.keylayout import key_group_or_zero
from statestore_async.errors import CorruptBlockError, CorruptFileError, InterfaceError
from statestore_async.files.names import DELTA, SNAPSHOT, file_name
from statestore_async.ids import CheckpointRef, StoreId

if TYPE_CHECKING:
    from statestore_async.engine.delta import Delta
    from statestore_async.engine.views import FrozenView

# (key, value), or (key, None) for a tombstone (delta files only)
Record: TypeAlias = tuple[bytes, bytes | None]

MAGIC = b"SSCK"
END_MAGIC = b"SSCE"
FORMAT_VERSION = 1
KIND_CODES = {DELTA: 1, SNAPSHOT: 2}
KIND_NAMES = {v: k for k, v in KIND_CODES.items()}
CODECS = {"none": blockcodec.CODEC_NONE, "zstd": blockcodec.CODEC_ZSTD}
#: The zstd level of the files' blocks. Level 1 measured both faster and smaller than 3 on records
#: of workload W's shape in the <= 64 KiB blocks files are cut into (``benchmarks/bench_encode.py``;
#: docs/ARCHITECTURE.md). Files of any level read the same.
ZSTD_LEVEL = 1
FOOTER_MARK = b"\xf0\x07"

_HEAD = struct.Struct("<4sHBBIQ")  # magic, format, kind, reserved, json length, json checksum
_FOOT = struct.Struct("<2sI")  # mark, json length
_TRAIL = struct.Struct("<QIQ4s")  # footer offset, footer length, footer checksum, magic
HEADER_FIXED = _HEAD.size
TRAILER_SIZE = _TRAIL.size
MAX_JSON = 64 << 20
DEFAULT_BLOCK_BYTES = 1 << 20
# a write-buffer flush's blocks (``write_flushed``): small, as the version's reads look keys up in them
FLUSH_BLOCK_BYTES = 16 << 10
# blocks per file that ``block_bytes_for`` aims at, and its bounds: a rescale reads the blocks of
# the key groups it needs, and at each edge of a range at most one block holds records of both
# sides, so with ~64 blocks per file the bytes read beyond the records needed stay a few percent
BLOCKS_PER_FILE = 64
MIN_BLOCK_BYTES = 4 << 10
MAX_BLOCK_BYTES = 64 << 10


def block_bytes_for(payload_bytes: int) -> int:
    """The block payload size for a file of about ``payload_bytes`` of records: ~1/64 of it,
    between 4 KiB (smaller blocks compress poorly and grow the footer) and 64 KiB."""
    return max(MIN_BLOCK_BYTES, min(MAX_BLOCK_BYTES, payload_bytes // BLOCKS_PER_FILE))


class CodecOptions(TypedDict, total=False):
    """How a file's blocks are encoded (``encode_delta`` and ``snapshot_steps`` keywords)."""

    codec: str
    level: int
    block_bytes: int


@dataclass(frozen=True)
class FileHeader:
    """What a checkpoint file says about itself."""

    kind: str
    store: dict[str, str | int]  # StoreId.to_json() of the store it belongs to
    ref: CheckpointRef
    lineage: tuple[CheckpointRef, ...]
    codec: str
    created: float
    writer: str = ""

    def matches(self, store_id: StoreId) -> bool:
        return self.store == store_id.to_json()


@dataclass(frozen=True)
class BlockIndexEntry:
    offset: int
    length: int
    count: int
    first_kg: int
    last_kg: int


@dataclass
class Footer:
    records: int
    blocks: list[BlockIndexEntry] = field(default_factory=list)
    # each block's first key, in block order (None: a file written before the footer carried them)
    first_keys: list[bytes] | None = None


def first_key_of_payload(payload: bytes | memoryview) -> bytes:
    """The key of the first record of a non-empty records payload (``blockcodec`` layout:
    kind byte, varint key length, key)."""
    n = shift = 0
    pos = 1
    while True:
        b = payload[pos]
        pos += 1
        n |= (b & 0x7F) << shift
        if not b & 0x80:
            break
        shift += 7
    return bytes(payload[pos:pos + n])


_kg = key_group_or_zero


class PackedRecords(Protocol):
    """Records in key order that write their own block payloads: an engine ``TableView`` or
    ``FrozenView``."""

    def __len__(self) -> int: ...

    def chunk_packed(self, pos: int, max_bytes: int) -> tuple[bytes, int, int, int]: ...


# a block of a compaction (``FrozenView.merged_blocks`` of a spilled store, ``files.coldrun``):
# (data, records, first key group, last key group, first key, encoded) — ``data`` is a block as
# stored (copied through) when ``encoded``, else a records payload to compress
MergedBlock: TypeAlias = tuple[bytes, int, int, int, bytes, bool]


#: Threads that compress the blocks of one file in parallel (zstd runs without the GIL); files share
#: them. With 1 (or a file of one block) blocks are compressed in the calling thread.
ENCODE_THREADS = max(1, min(os.cpu_count() or 1, 4))
_pool_lock = threading.Lock()
_pool: tuple[int, ThreadPoolExecutor] | None = None  # (pid that made it, the pool)


def _encode_pool() -> ThreadPoolExecutor | None:
    """The process's pool of block encoders (a forked child makes its own)."""
    global _pool
    if ENCODE_THREADS <= 1:
        return None
    made = _pool
    if made is not None and made[0] == os.getpid():
        return made[1]
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid():
            _pool = (os.getpid(), ThreadPoolExecutor(ENCODE_THREADS, thread_name_prefix="ssa-encode"))
        return _pool[1]


# ------------------------------------------------------------------------------------------------
# writing
# ------------------------------------------------------------------------------------------------
def _encode_header(kind: str, store_id: StoreId, ref: CheckpointRef, lineage: Iterable[CheckpointRef], codec: str) -> bytes:
    if codec not in CODECS:
        raise InterfaceError(f"codec must be one of {sorted(CODECS)}, got {codec!r}")
    body = json.dumps(
        {
            "store": store_id.to_json(),
            "version": ref.version,
            "ckptid": ref.ckptid,
            "lineage": [r.to_json() for r in lineage],
            "codec": codec,
            "created": round(time.time(), 3),
            "writer": f"statestore_async {__version__}",
        },
        sort_keys=True,
        separators=(",", ":"),
    ).encode()
    return _HEAD.pack(MAGIC, FORMAT_VERSION, KIND_CODES[kind], 0, len(body), xxhash.xxh3_64_intdigest(body)) + body


class CheckpointWriter:
    """Builds one checkpoint file block by block: ``add_block_records`` then ``finish``."""

    def __init__(
        self,
        kind: str,
        store_id: StoreId,
        ref: CheckpointRef,
        lineage: Iterable[CheckpointRef],
        *,
        codec: str = "zstd",
        level: int = ZSTD_LEVEL,
        block_bytes: int = DEFAULT_BLOCK_BYTES,
    ):
        if kind not in KIND_CODES:
            raise InterfaceError(f"kind must be 'delta' or 'snapshot', got {kind!r}")
        self.kind = kind
        self.name = file_name(ref, kind)
        self._level = level
        self._block_bytes = block_bytes
        head = _encode_header(kind, store_id, ref, tuple(lineage), codec)
        self._codec = CODECS[codec]  # a known codec: _encode_header checked it
        self._parts: list[bytes] = [head]
        self._offset = len(head)
        self._index: list[BlockIndexEntry] = []
        self._first_keys: list[bytes] = []
        self._records = 0

    def add_records(self, records: Sequence[Record]) -> Iterator[None]:
        """Encode ``records`` (a list of (key, value|None)) into blocks; yields after each block."""
        start = 0
        n = len(records)
        while start < n:
            block, nxt = blockcodec.encode_block(records, start, self._block_bytes, self._codec, self._level)
            kgs_first, kgs_last = blockcodec.key_group_range(records, start, nxt)
            self.add_block(block, nxt - start, kgs_first, kgs_last, bytes(records[start][0]))
            start = nxt
            yield

    def add_entries(self, entries: Iterable[Record]) -> None:
        """Encode key-ordered (key, value|None) pairs as they come, about a block's worth at a
        time (an iterator merging runs on disk is never held whole)."""
        limit = self._payload_limit() - 64
        chunk: list[Record] = []
        size = 0
        for k, v in entries:
            chunk.append((k, v))
            size += len(k) + (len(v) if v is not None else 0) + 11
            if size >= limit:
                for _ in self.add_records(chunk):
                    pass
                chunk, size = [], 0
        for _ in self.add_records(chunk):
            pass

    def add_block(self, block: bytes, count: int, first_kg: int, last_kg: int, first_key: bytes) -> None:
        """Append an encoded block of ``count`` records whose key groups span ``first_kg..last_kg``
        and whose first key is ``first_key``."""
        self._index.append(BlockIndexEntry(self._offset, len(block), count, first_kg, last_kg))
        self._first_keys.append(first_key)
        self._parts.append(block)
        self._offset += len(block)
        self._records += count

    def _payload_limit(self) -> int:
        if self._block_bytes < 1:
            raise InterfaceError(f"max_raw_bytes must be at least 1, got {self._block_bytes}")
        return min(self._block_bytes, blockcodec.MAX_RAW_LEN)

    def _encode(self, payload: bytes, count: int) -> bytes:
        return blockcodec.encode_payload_block(payload, count, self._codec, self._level)

    def add_packed_steps(self, records: PackedRecords) -> Iterator[None]:
        """Encode every record of ``records`` (in its key order) into blocks in this thread,
        yielding after each block: the same blocks as ``add_records`` of the same records."""
        if not len(records):
            return
        limit = self._payload_limit()
        pos = 0
        while True:
            payload, nxt, lo, hi = records.chunk_packed(pos, limit)
            if nxt == pos:
                return
            self.add_block(self._encode(payload, nxt - pos), nxt - pos, lo, hi, first_key_of_payload(payload))
            pos = nxt
            yield

    def add_packed(self, records: PackedRecords, *, threads: bool = True) -> None:
        """Encode every record of ``records`` (in its key order) into blocks, the same blocks as
        ``add_records`` of the same records: the payloads are gathered in this thread and, with
        ``threads`` and more than one block, compressed in the encoding pool meanwhile (a bounded
        number in flight)."""
        n = len(records)
        if not n:
            return
        limit = self._payload_limit()
        pool = _encode_pool() if threads else None
        pending: deque[tuple[Future[bytes], int, int, int, bytes]] = deque()
        try:
            pos = 0
            while pos < n:
                payload, nxt, lo, hi = records.chunk_packed(pos, limit)
                count = nxt - pos
                first = first_key_of_payload(payload)
                if pool is None or (pos == 0 and nxt >= n):  # one block: no hand-over
                    self.add_block(self._encode(payload, count), count, lo, hi, first)
                else:
                    pending.append((pool.submit(self._encode, payload, count), count, lo, hi, first))
                    while len(pending) > 2 * ENCODE_THREADS:
                        fut, c, a, b, k = pending.popleft()
                        self.add_block(fut.result(), c, a, b, k)
                pos = nxt
            while pending:
                fut, c, a, b, k = pending.popleft()
                self.add_block(fut.result(), c, a, b, k)
        finally:
            for fut, *_ in pending:  # after a failure: nothing more is needed
                fut.cancel()

    def add_merged_steps(self, blocks: Iterable[MergedBlock]) -> Iterator[None]:
        """Append ``blocks`` (a spilled view's ``merged_blocks``) in this thread, yielding after each."""
        for data, count, lo, hi, first, encoded in blocks:
            self.add_block(data if encoded else self._encode(data, count), count, lo, hi, first)
            yield

    def add_merged(self, blocks: Iterable[MergedBlock], *, threads: bool = True) -> None:
        """Append ``blocks`` (a spilled view's ``merged_blocks``): blocks as stored go in as they are,
        payloads are compressed in the encoding pool (with ``threads``) while the next are merged."""
        pool = _encode_pool() if threads else None
        if pool is None:
            for _ in self.add_merged_steps(blocks):
                pass
            return
        pending: deque[tuple[Future[bytes] | bytes, int, int, int, bytes]] = deque()
        try:
            for data, count, lo, hi, first, encoded in blocks:
                pending.append((data if encoded else pool.submit(self._encode, data, count), count, lo, hi, first))
                while len(pending) > 2 * ENCODE_THREADS:
                    self._add_pending(pending.popleft())
            while pending:
                self._add_pending(pending.popleft())
        finally:
            for fut, *_ in pending:  # after a failure: nothing more is needed
                if isinstance(fut, Future):
                    fut.cancel()

    def _add_pending(self, item: tuple[Future[bytes] | bytes, int, int, int, bytes]) -> None:
        block, count, lo, hi, first = item
        self.add_block(block.result() if isinstance(block, Future) else block, count, lo, hi, first)

    def finish(self) -> bytes:
        """The whole file."""
        return b"".join(self.finish_parts())

    def take_parts(self) -> list[bytes]:
        """The parts written so far, handed over (a writer streaming to a file): ``finish_parts``
        then gives only what follows them."""
        parts, self._parts = self._parts, []
        return parts

    def finish_parts(self) -> list[bytes]:
        """The whole file, as a list of parts in order."""
        body = json.dumps(
            {
                "records": self._records,
                "blocks": [[b.offset, b.length, b.count, b.first_kg, b.last_kg] for b in self._index],
                "first_keys": [k.hex() for k in self._first_keys],
            },
            separators=(",", ":"),
        ).encode()
        footer = _FOOT.pack(FOOTER_MARK, len(body)) + body
        trailer = _TRAIL.pack(self._offset, len(footer), xxhash.xxh3_64_intdigest(footer), END_MAGIC)
        parts = self._parts + [footer, trailer]
        self._parts = []
        return parts


def encode_delta(delta: Delta, *, codec: str = "zstd", level: int = ZSTD_LEVEL, block_bytes: int | None = None,
                 threads: bool = True) -> bytes:
    """The delta file of an engine ``Delta``: its records in key order, written straight from its
    table (``Table.freeze``), blocks compressed in parallel threads unless ``threads``
    is False. The bytes are those of ``CheckpointWriter.add_records(list(delta.records.items()))``.
    ``block_bytes`` None: ``block_bytes_for`` the delta's size."""
    if block_bytes is None:
        block_bytes = block_bytes_for(delta.nbytes)
    w = CheckpointWriter(DELTA, delta.store_id, delta.ref, delta.lineage, codec=codec, level=level, block_bytes=block_bytes)
    if delta.runs:  # a version that flushed: its runs on disk merged with the rest, a block at a time
        only = delta.runs[0]
        payloads = getattr(only, "payloads", None)
        if len(delta.runs) == 1 and payloads is not None and not delta.entries_in_memory:
            # every change in one run (flushed at its commit): its blocks' payloads are the delta's,
            # compressed again (gathered to the file's block size), nothing decoded
            w.add_merged(_gathered(payloads(), w._payload_limit()), threads=threads)
        else:
            w.add_entries(delta.entries())
        return w.finish()
    view = delta.table.freeze()
    try:
        w.add_packed(view, threads=threads)
    finally:
        view.release()
    return w.finish()


def _gathered(payloads: Iterable[tuple[bytes, int, int, int, bytes]], limit: int) -> Iterator[MergedBlock]:
    """Consecutive records payloads joined up to ``limit`` bytes (a payload is its records back
    to back), as ``add_merged``'s blocks still to compress."""
    parts: list[bytes] = []
    size = count = lo = hi = 0
    first = b""
    for payload, n, a, b, k in payloads:
        if parts and size + len(payload) > limit:
            yield b"".join(parts), count, lo, hi, first, False
            parts, size, count = [], 0, 0
        if not parts:
            lo, first = a, k
        parts.append(payload)
        size += len(payload)
        count += n
        hi = b
    if parts:
        yield b"".join(parts), count, lo, hi, first, False


def write_flushed(path: str, store_id: StoreId, ref: CheckpointRef, changes: PackedRecords, *,
                  block_bytes: int = FLUSH_BLOCK_BYTES) -> int:
    """Write ``changes`` (a frozen table of an open version's changes, tombstones kept) to ``path``
    as a delta file of ``ref`` with no lineage, blocks uncompressed: a write-buffer flush, read back
    by ``coldrun.ColdRun`` and never uploaded. Returns the file's size."""
    w = CheckpointWriter(DELTA, store_id, ref, (), codec="none", block_bytes=block_bytes)
    size = 0
    with open(path, "wb") as f:
        for _ in w.add_packed_steps(changes):  # a block at a time: the file is never whole in memory
            for part in w.take_parts():
                size += f.write(part)
        for part in w.finish_parts():
            size += f.write(part)
    return size


def snapshot_steps(view: FrozenView, *, codec: str = "zstd", level: int = ZSTD_LEVEL, block_bytes: int | None = None,
                   ) -> Iterator[list[bytes] | None]:
    """Write the snapshot of a frozen engine view in small steps.

    Yields ``None`` after each bounded piece of work — writing one block payload of records in
    key order (so in key-group order) straight from the view's table and encoding it — so an event
    loop can serve requests between pieces; then, as the last item, the file as a list of parts
    (``b"".join`` them; a large join releases the GIL, so it can run in a thread).
    ``block_bytes`` None: ``block_bytes_for`` the view's size.
    """
    w = CheckpointWriter(SNAPSHOT, view.store_id, view.ref, view.lineage, codec=codec, level=level,
                         block_bytes=block_bytes if block_bytes is not None else block_bytes_for(view.approx_bytes))
    merged = view.merged_blocks(w._payload_limit())
    if merged is not None:  # a spilled store: its snapshot run's blocks, merged with what changed
        yield from w.add_merged_steps(merged)
    else:
        yield from w.add_packed_steps(view)
    yield w.finish_parts()


def encode_snapshot(view: FrozenView, *, threads: bool = True, **kwargs: Unpack[CodecOptions]) -> bytes:
    """The snapshot file of a frozen engine view, in one call (the bytes of ``snapshot_steps``),
    blocks compressed in parallel threads unless ``threads`` is False; ``block_bytes`` by default
    ``block_bytes_for`` the view's size."""
    kwargs.setdefault("block_bytes", block_bytes_for(view.approx_bytes))
    w = CheckpointWriter(SNAPSHOT, view.store_id, view.ref, view.lineage, **kwargs)
    merged = view.merged_blocks(w._payload_limit())
    if merged is not None:  # a spilled store: its snapshot run's blocks, merged with what changed
        w.add_merged(merged, threads=threads)
    else:
        w.add_packed(view, threads=threads)
    return w.finish()


# ------------------------------------------------------------------------------------------------
# reading
# ------------------------------------------------------------------------------------------------
def _parse_header_json(name: str, kind_code: int, body: bytes) -> FileHeader:
    try:
        h = json.loads(body)
        store = h["store"]
        ref = CheckpointRef(h["version"], h["ckptid"])
        lineage = tuple(CheckpointRef.from_json(x) for x in h["lineage"])
        codec = h["codec"]
        if codec not in CODECS or not isinstance(store, dict):
            raise ValueError(f"codec {codec!r}")
        return FileHeader(KIND_NAMES[kind_code], store, ref, lineage, codec, float(h.get("created", 0)), h.get("writer", ""))
    except (ValueError, KeyError, TypeError, InterfaceError) as exc:
        raise CorruptFileError(name, f"bad header: {exc}", HEADER_FIXED) from None


def header_length(data: bytes, name: str) -> int:
    """Bytes the header takes, from its first ``HEADER_FIXED`` bytes."""
    if len(data) < HEADER_FIXED:
        raise CorruptFileError(name, f"truncated: {len(data)} bytes, a header needs {HEADER_FIXED}", 0)
    n: int
    magic, fmt, kind, reserved, n, _ = _HEAD.unpack_from(data, 0)
    if magic != MAGIC:
        raise CorruptFileError(name, f"not a checkpoint file (magic {magic!r})", 0)
    if fmt != FORMAT_VERSION:
        raise CorruptFileError(name, f"unsupported format version {fmt} (this build reads {FORMAT_VERSION})", 4)
    if kind not in KIND_NAMES or reserved != 0:
        raise CorruptFileError(name, f"bad kind byte {kind} / reserved byte {reserved}", 6)
    if n > MAX_JSON:
        raise CorruptFileError(name, f"header length {n} is not plausible", 8)
    return HEADER_FIXED + n


def parse_header(data: bytes, name: str) -> FileHeader:
    """The header at the start of ``data`` (which must hold at least the whole header)."""
    end = header_length(data, name)
    if len(data) < end:
        raise CorruptFileError(name, f"truncated header: {len(data)} of {end} bytes", 0)
    _, _, kind, _, _n, checksum = _HEAD.unpack_from(data, 0)
    body = bytes(data[HEADER_FIXED:end])
    if xxhash.xxh3_64_intdigest(body) != checksum:
        raise CorruptFileError(name, "header checksum mismatch", HEADER_FIXED)
    return _parse_header_json(name, kind, body)


def _parse_footer(name: str, data: bytes, offset: int, length: int, checksum: int) -> Footer:
    footer = bytes(data[offset : offset + length])
    if len(footer) != length or xxhash.xxh3_64_intdigest(footer) != checksum:
        raise CorruptFileError(name, "footer checksum mismatch", offset)
    mark, n = _FOOT.unpack_from(footer, 0)
    if mark != FOOTER_MARK or n != length - _FOOT.size:
        raise CorruptFileError(name, "bad footer mark or length", offset)
    try:
        f = json.loads(footer[_FOOT.size :])
        blocks = [BlockIndexEntry(*map(int, b)) for b in f["blocks"]]
        first_keys = f.get("first_keys")
        if first_keys is not None:
            first_keys = [bytes.fromhex(k) for k in first_keys]
            if len(first_keys) != len(blocks):
                raise ValueError(f"{len(first_keys)} first keys for {len(blocks)} blocks")
        return Footer(int(f["records"]), blocks, first_keys)
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptFileError(name, f"bad footer: {exc}", offset) from None


def read_trailer(data: bytes, name: str) -> tuple[int, int, int]:
    """(footer offset, footer length, footer checksum) from the file's last 24 bytes."""
    if len(data) < TRAILER_SIZE:
        raise CorruptFileError(name, "truncated: no trailer", len(data))
    off, n, checksum, magic = _TRAIL.unpack_from(data, len(data) - TRAILER_SIZE)
    if magic != END_MAGIC:
        raise CorruptFileError(name, "truncated or damaged: bad trailer magic", len(data) - TRAILER_SIZE)
    return off, n, checksum


@dataclass
class CheckpointFile:
    """A fully checked checkpoint file: its header, index and records."""

    name: str
    header: FileHeader
    footer: Footer
    records: list[Record]


class CheckpointParser:
    """Sans-IO reader: ``feed`` chunks as they arrive, get records as each block completes.

    ``feed`` returns the records decoded from the blocks completed by that chunk; ``header`` is set
    once known; ``finish`` checks the footer and trailer and returns the ``Footer``.
    """

    def __init__(self, name: str, *, expect: tuple[StoreId, CheckpointRef, str] | None = None):
        self.name = name
        self._expect = expect
        self._buf = bytearray()
        self._pos = 0  # absolute offset of self._buf[0]
        self.header: FileHeader | None = None
        self._blocks: list[BlockIndexEntry] = []
        self._first_keys: list[bytes] = []
        self._records = 0
        self._footer_at: int | None = None
        self._done = False

    def _fail(self, reason: str, offset: int | None = None) -> NoReturn:
        raise CorruptFileError(self.name, reason, offset)

    def feed(self, chunk: bytes) -> list[Record]:
        if self._done:
            self._fail("data after the end of the file")
        self._buf += chunk
        out: list[Record] = []
        buf = self._buf
        consumed = 0
        if self.header is None:
            if len(buf) < HEADER_FIXED:
                return out
            end = header_length(buf, self.name)
            if len(buf) < end:
                return out
            self.header = header = parse_header(buf, self.name)
            self._check_expected(header)
            consumed = end
        while self._footer_at is None:
            avail = len(buf) - consumed
            if avail < 2:
                break
            if bytes(buf[consumed : consumed + 2]) == FOOTER_MARK:
                self._footer_at = self._pos + consumed
                break
            if avail < blockcodec.HEADER_SIZE:
                break
            try:
                _, count, _, _, total = blockcodec.read_block_header(buf, consumed)
                if avail < total:
                    break
                records, nxt = blockcodec.decode_block(buf, consumed)
            except CorruptBlockError as exc:
                self._fail(f"block {len(self._blocks)}: {exc}", self._pos + consumed)
            first, last = (_kg(records[0][0]), _kg(records[-1][0])) if records else (0, 0)
            self._blocks.append(BlockIndexEntry(self._pos + consumed, total, count, first, last))
            self._first_keys.append(records[0][0] if records else b"")
            self._records += count
            out.extend(records)
            consumed = nxt
        if consumed:
            del buf[:consumed]
            self._pos += consumed
        return out

    def _check_expected(self, h: FileHeader) -> None:
        if self._expect is None:
            return
        store_id, ref, kind = self._expect
        if h.kind != kind or h.ref != ref or not h.matches(store_id):
            self._fail(
                f"the file says it is the {h.kind} of {h.store} at {h.ref}, expected the {kind} of "
                f"{store_id.to_json()} at {ref}",
                HEADER_FIXED,
            )

    def finish(self) -> Footer:
        if self.header is None:
            self._fail(f"truncated: {len(self._buf)} bytes, no complete header", 0)
        if self._footer_at is None:
            self._fail("truncated: the file ends inside a block (no footer)", self._pos)
        buf = bytes(self._buf)
        base = self._footer_at - self._pos
        off, n, checksum = read_trailer(buf, self.name)
        if off != self._footer_at or base + n + TRAILER_SIZE != len(buf):
            self._fail("footer and trailer do not line up (truncated or extended file)", self._footer_at)
        footer = _parse_footer(self.name, buf, base, n, checksum)
        if footer.records != self._records or len(footer.blocks) != len(self._blocks):
            self._fail(f"the footer counts {footer.records} records in {len(footer.blocks)} blocks, "
                       f"the file holds {self._records} in {len(self._blocks)}", self._footer_at)
        for i, (a, b) in enumerate(zip(footer.blocks, self._blocks)):
            if a.offset != b.offset or a.length != b.length or a.count != b.count:
                self._fail(f"footer entry {i} does not match block {i}", self._footer_at)
        if footer.first_keys is not None and footer.first_keys != self._first_keys:
            self._fail("the footer's first keys do not match the blocks' first keys", self._footer_at)
        self._done = True
        return footer


def read_checkpoint(data: bytes, name: str, *, expect: tuple[StoreId, CheckpointRef, str] | None = None) -> CheckpointFile:
    """Parse and check a whole checkpoint file held in memory."""
    p = CheckpointParser(name, expect=expect)
    records = p.feed(data)
    footer = p.finish()
    assert p.header is not None  # finish() checked it
    return CheckpointFile(name, p.header, footer, records)


def read_index(data: bytes, name: str) -> Footer:
    """The block index of a file from its tail (``data`` holds at least footer + trailer)."""
    _off, n, checksum = read_trailer(data, name)
    start = len(data) - TRAILER_SIZE - n
    if start < 0:
        raise CorruptFileError(name, "the tail given does not hold the whole footer")
    return _parse_footer(name, data, start, n, checksum)


def blocks_for_key_groups(footer: Footer, first_kg: int, last_kg: int) -> list[BlockIndexEntry]:
    """The blocks of a snapshot that may hold records of key groups ``first_kg..last_kg``."""
    return [b for b in footer.blocks if b.last_kg >= first_kg and b.first_kg <= last_kg]


def decode_blocks(data: bytes, name: str, entries: list[BlockIndexEntry], base_offset: int = 0) -> list[Record]:
    """Decode the given blocks out of ``data`` (which starts at file offset ``base_offset``)."""
    out: list[Record] = []
    for e in entries:
        try:
            records, _ = blockcodec.decode_block(data, e.offset - base_offset)
        except CorruptBlockError as exc:
            raise CorruptFileError(name, f"block at {e.offset}: {exc}", e.offset) from None
        out.extend(records)
    return out
