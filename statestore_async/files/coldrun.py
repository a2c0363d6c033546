"""The cold level of a store: a snapshot file on local disk, read one block at a time.

A store over the daemon's memory budget keeps its recent records in memory (the engine's hot
table) and the rest in a ``ColdRun``: the store's snapshot file itself — the file written to the
object store, whose local copy the node keeps (the object store's cache folder, or the file of a
``file://`` root). Its records are in key order in blocks, and the footer names each block's first
key (``checkpoint.Footer.first_keys``), so finding a key costs a binary search in memory and
reading one block; nothing is read whole. A restart on the same node opens the same files again;
a new node still recovers from the object store alone.

Decoded blocks are kept in a ``BlockCache`` shared by the daemon's runs, least recently used out
first within its byte bound: recency is tracked per block, not per store. A block's bytes are
checked (checksums, lengths) when it is read; a damaged block raises ``CorruptFileError`` naming the
file and the offset.

A delta file opens as a run too (``kind=DELTA``): its tombstones hide older values. A
``ColdStack`` puts runs newest first — the deltas of the commits made since a store spilled over
its snapshot — so that a spilled store's hot part can leave memory without rewriting anything: the
files are on local disk already (an LSM's flushed memtables, written by the uploader).

``ColdRun`` and ``ColdStack`` satisfy the engine's ``engine.levels.ColdLevel``: the engine does no
IO of its own.

**Compaction** (the snapshot of a spilled store) is block-wise: ``merged_blocks`` walks the
snapshot run's blocks once, with the newer records (the hot part and the delta runs, merged into
one key-ordered list of changes) split by the blocks' first keys. A block no change falls in is
copied through as it is stored (its checksum checked, nothing decoded or compressed again); a
block with changes is decompressed and its records payload spliced: when its records all have
one size (the common case: fixed-size keys and values) the changes' positions come from a binary
search over the payload's key column (numpy) and the untouched stretches are copied as byte
slices, so the Python work is per change, not per record; otherwise its records are decoded and
merged as lists. Merged blocks keep about the size of the block they replace (split past twice it).
"""
from __future__ import annotations

import bisect
import heapq
import itertools
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import cast

import numpy as np
import xxhash
import zstandard

from statestore_async.codecs import blockcodec
from statestore_async.codecs.keylayout import key_group_or_zero
from statestore_async.engine.levels import MISSING  # ``lookup_many``: no entry (a tombstone gives None)
from statestore_async.engine.lookup import KeyLookup
from statestore_async.engine.table import Table, put_items, remove_keys
from statestore_async.errors import CorruptBlockError, CorruptFileError
from statestore_async.files.checkpoint import (
    HEADER_FIXED,
    TRAILER_SIZE,
    BlockIndexEntry,
    FileHeader,
    Footer,
    header_length,
    parse_header,
    read_index,
    read_trailer,
)
from statestore_async.files.names import DELTA, SNAPSHOT
from statestore_async.files.runfiles import RunFile, RunFiles
from statestore_async.ids import CheckpointRef, StoreId

_ids = itertools.count(1)
# snapshot blocks a compaction merges at a time (see ColdRun._merged)
MERGE_GROUP = 16

# what ``merged_blocks`` yields: (data, records, first key group, last key group, first key, encoded);
# ``data`` is a block as stored when ``encoded``, else a records payload still to be compressed
MergedBlock = tuple[bytes, int, int, int, bytes, bool]
_Entries = Iterable[tuple[bytes, "bytes | None"]]
_BLOCK_HEAD = 24  # blockcodec's block header: magic, codec, flags, count, raw_len, stored_len, checksum
_zstd = threading.local()


class _Changes:
    """Key-ordered changes for a compaction: ``keys``, ``values`` (None: a removal), and, when every
    key has one length and every value another (both under 128 bytes), the same as numpy arrays:
    ``key_array`` (``S<klen>``), ``puts`` (one row of ``width`` bytes per put record, in order) and
    ``puts_before`` (how many puts precede each change)."""

    def __init__(self, keys: list[bytes], values: list[bytes | None]) -> None:
        self.keys, self.values = keys, values
        self.width = 0  # 0: not fixed-size
        klens = set(map(len, keys))
        vlens = {len(v) for v in values if v is not None}
        if len(klens) == 1 and len(vlens) <= 1:
            self.klen = klens.pop()
            vlen = vlens.pop() if vlens else 0
            if 0 < self.klen < 0x80 and vlen < 0x80:
                self.width = 3 + self.klen + vlen
                self.key_array = np.array(keys, dtype=f"S{self.klen}")
                is_put = np.fromiter((v is not None for v in values), bool, len(values))
                self.is_put = is_put
                self.puts_before = np.concatenate(([0], np.cumsum(is_put)))
                raw = blockcodec.encode_records_raw([(k, v) for k, v in zip(keys, values) if v is not None])
                self.puts = np.frombuffer(raw, f"V{self.width}")


class _Cursor:
    """A key-ordered iterator of changes, taken one key range after the other."""

    def __init__(self, entries: _Entries) -> None:
        self._it = iter(entries)
        self._next = next(self._it, None)

    def until(self, hi: bytes | None) -> list[tuple[bytes, bytes | None]]:
        """The entries left with keys below ``hi`` (None: all of them)."""
        out = []
        while self._next is not None and (hi is None or self._next[0] < hi):
            out.append(self._next)
            self._next = next(self._it, None)
        return out


def _sorted_changes(layers: Sequence[_Entries]) -> _Changes:
    """The entries of ``layers`` (each in key order, oldest layer first), the newest layer's entry
    for each key (tombstones kept as None)."""
    if len(layers) == 1:
        pairs = list(layers[0])
    else:
        merged = Table()
        for layer in layers:  # a layer has one entry per key: its puts and removals in any order
            entries = list(layer)
            put_items(merged, [(k, v) for k, v in entries if v is not None], 0)
            remove_keys(merged, [k for k, v in entries if v is None], 0)
        with merged.freeze() as view:
            pairs = list(view.items())
    return _Changes([k for k, _ in pairs], [v for _, v in pairs])


class BlockCache:
    """Decoded blocks of cold runs, by (run, block), least recently used out first, within ``max_bytes``.

    Each block is held as a ``blockcodec.RecordBlock`` (its decompressed payload and a span per
    record: no Python object per record); ``nbytes`` is what they take. Thread-safe (blocks may be
    read from a worker thread).
    """

    def __init__(self, max_bytes: int, files: RunFiles | None = None) -> None:
        self.max_bytes = max_bytes
        # the runs' files, at most ``files.max_open`` of them open at a time
        self.files = RunFiles() if files is None else files
        self.nbytes = 0
        self._lru: OrderedDict[tuple[int, int], blockcodec.RecordBlock] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def get(self, key: tuple[int, int]) -> blockcodec.RecordBlock | None:
        with self._lock:
            block = self._lru.get(key)
            if block is None:
                self.misses += 1
                return None
            self._lru.move_to_end(key)
            self.hits += 1
            return block

    def put(self, key: tuple[int, int], block: blockcodec.RecordBlock) -> None:
        with self._lock:
            old = self._lru.pop(key, None)
            if old is not None:
                self.nbytes -= old.nbytes
            self._lru[key] = block
            self.nbytes += block.nbytes
            self._shrink_locked(self.max_bytes)

    def shrink(self, to_bytes: int) -> int:
        """Drop least recently used blocks until at most ``to_bytes`` are held; returns bytes freed."""
        with self._lock:
            return self._shrink_locked(to_bytes)

    def _shrink_locked(self, to_bytes: int) -> int:
        freed = 0
        while self.nbytes > to_bytes and self._lru:
            _, block = self._lru.popitem(last=False)
            self.nbytes -= block.nbytes
            freed += block.nbytes
            self.evictions += 1
        return freed

    def drop_run(self, run_id: int) -> None:
        """Forget every block of one run (it was closed)."""
        with self._lock:
            for key in [k for k in self._lru if k[0] == run_id]:
                self.nbytes -= self._lru.pop(key).nbytes

    def __len__(self) -> int:
        return len(self._lru)

    def stats(self) -> dict[str, int]:
        return {"blocks": len(self._lru), "bytes": self.nbytes, "max_bytes": self.max_bytes, "hits": self.hits,
                "misses": self.misses, "evictions": self.evictions}


class ColdRun:
    """The records of one snapshot file on local disk, read a block at a time (see the module doc).

    ``ColdRun.open(path, store_id, ref, cache)`` checks the header (the snapshot of ``store_id`` at
    ``ref``), the trailer and the footer; a file written before footers named first keys has its
    blocks read once, at open, to learn them. The run reads its file through ``cache.files``
    (``files.runfiles.RunFiles``: a name of the daemon's own, an open file only while among the most
    recently read): removing the file (the cache evicting its copy, retention deleting it) does not
    affect a run already open.
    """

    def __init__(self, path: str, file: RunFile, header: FileHeader, footer: Footer, first_keys: list[bytes],
                 cache: BlockCache) -> None:
        self.path = path
        self.kind = header.kind
        self.header = header
        self.ref = header.ref
        self._fd: RunFile | None = file  # None: closed
        self._blocks = footer.blocks
        self._first = first_keys
        self._records = footer.records
        self._cache = cache
        self.id = next(_ids)
        self.blocks_read = 0
        # a write-buffer flush of an open version (``engine.store.StoreVersion.flush``): a file of
        # the daemon's own, removed from its folder once opened, gone when its last handle closes
        self.flushed = False
        # what the run holds in memory: its index (the first keys and the block entries)
        self.nbytes = sum(len(k) + 33 for k in first_keys) + 120 * len(footer.blocks) + 200

    def reopen(self) -> ColdRun:
        """The same run, sharing its file (``RunFile.share``): closing either leaves the other
        readable. It reads past the block cache (the delta file of a flushed version's commit
        reads its runs once)."""
        if self._fd is None:
            raise CorruptFileError(self.path, "the run is closed")
        file = self._fd.share()
        twin = ColdRun.__new__(ColdRun)
        twin.__dict__.update(self.__dict__)
        twin._fd = file
        twin._cache = BlockCache(0, self._cache.files)
        twin.id = next(_ids)
        twin.blocks_read = 0
        return twin

    @classmethod
    def open(cls, path: str | os.PathLike[str], store_id: StoreId, ref: CheckpointRef, cache: BlockCache,
             kind: str = SNAPSHOT, *, verify: bool = False) -> ColdRun:
        """Open the ``kind`` file (the snapshot, or a delta) of ``store_id`` at ``ref``; with
        ``verify`` every block's lengths and checksum are checked now (read, not decoded)."""
        path = os.fspath(path)
        fd = cache.files.open(path)
        try:
            size = fd.size
            head = fd.pread(min(size, 65536), 0)
            need = header_length(head, path)
            if len(head) < need:
                head = fd.pread(need, 0)
            header = parse_header(head, path)
            if header.kind != kind or header.ref != ref or not header.matches(store_id):
                raise CorruptFileError(path, f"the file is the {header.kind} of {header.store} at {header.ref}, "
                                             f"expected the {kind} of {store_id.to_json()} at {ref}", HEADER_FIXED)
            tail = fd.pread(TRAILER_SIZE, size - TRAILER_SIZE) if size >= TRAILER_SIZE else b""
            footer_at, footer_len, _ = read_trailer(tail, path)
            if footer_at < need or footer_at + footer_len + TRAILER_SIZE != size:
                raise CorruptFileError(path, "footer and trailer do not line up (truncated or extended file)", footer_at)
            footer = read_index(fd.pread(footer_len + TRAILER_SIZE, footer_at), path)
            if footer.blocks and footer.blocks[0].offset != need:
                raise CorruptFileError(path, "the first block does not follow the header", need)
            first_keys = footer.first_keys
            run = cls(path, fd, header, footer, first_keys or [], cache)
            if first_keys is None:  # written before footers named first keys: learn them once
                run._first = [run._read_block(i)[0][0] if b.count else b"" for i, b in enumerate(footer.blocks)]
                run.nbytes = sum(len(k) + 33 for k in run._first) + 120 * len(footer.blocks) + 200
            if verify:
                for i in range(len(footer.blocks)):
                    run._raw_block(i)
                run.blocks_read = 0
            return run
        except BaseException:
            fd.release()
            raise

    def __len__(self) -> int:
        return self._records

    def close(self) -> None:
        """Close the file and drop the run's cached blocks (idempotent). Also done when collected."""
        fd, self._fd = self._fd, None
        if fd is not None:
            fd.release()
            self._cache.drop_run(self.id)

    def __del__(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None:
            self._fd = None
            try:
                fd.release()
            except Exception:  # collected at interpreter exit: the process's end closes it
                pass

    # --- blocks ----------------------------------------------------------------------------------
    def _pread(self, i: int) -> tuple[BlockIndexEntry, bytes]:
        """Block ``i``'s index entry and its bytes as stored (a closed run or a short read:
        ``CorruptFileError``)."""
        fd = self._fd
        if fd is None:
            raise CorruptFileError(self.path, "the cold run was closed", None)
        e = self._blocks[i]
        data = fd.pread(e.length, e.offset)
        if len(data) != e.length:
            raise CorruptFileError(self.path, f"block {i} at {e.offset}: truncated: {len(data)} of {e.length} bytes",
                                   e.offset)
        return e, data

    def _read_block(self, i: int) -> list[tuple[bytes, bytes | None]]:
        e, data = self._pread(i)
        try:
            records, end = blockcodec.decode_block(data, 0)
            if end != e.length or len(records) != e.count:
                raise CorruptBlockError(f"the block holds {len(records)} records in {end} bytes, the index "
                                        f"says {e.count} in {e.length}")
        except CorruptBlockError as exc:
            raise CorruptFileError(self.path, f"block {i} at {e.offset}: {exc}", e.offset) from None
        self.blocks_read += 1
        return records

    def _block(self, i: int) -> blockcodec.RecordBlock:
        """Block ``i``, from the cache or read into it: decompressed, its records checked and read
        in place (``blockcodec.RecordBlock``: no Python object per record)."""
        key = (self.id, i)
        block = self._cache.get(key)
        if block is None:
            payload = self._payload(i, self._raw_block(i))
            try:
                block = blockcodec.RecordBlock(payload, self._blocks[i].count)
            except CorruptBlockError as exc:
                raise CorruptFileError(self.path, f"block {i} at {self._blocks[i].offset}: {exc}",
                                       self._blocks[i].offset) from None
            self._cache.put(key, block)
        return block

    def _block_entries(self, i: int, start: bytes, stop: bytes | None) -> Iterator[tuple[bytes, bytes | None]]:
        """(key, value | None) of block ``i`` with ``start <= key < stop``, in key order."""
        block = self._block(i)
        for j in range(block.bisect_left(start), len(block)):
            k, v = block.entry(j)
            if stop is not None and k >= stop:
                return
            yield k, v

    def _block_of(self, key: bytes) -> int:
        """The block that would hold ``key`` (-1: before the first key)."""
        return bisect.bisect_right(self._first, key) - 1

    # --- the engine's ColdLevel -------------------------------------------------------------------
    def get(self, key: bytes) -> bytes | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The values of ``keys`` (None: absent or removed); each block needed is read once."""
        return cast("list[bytes | None]", _look_up_all(self, keys, None))

    def lookup_many(self, keys: Sequence[bytes]) -> list[object]:
        """Per key: its value, None for a tombstone (delta runs), ``MISSING`` when the run has no entry."""
        return _look_up_all(self, keys, MISSING)

    def lookup_into(self, lookup: KeyLookup, js: np.ndarray) -> None:
        """Look the keys of ``js`` (indexes of ``lookup``'s keys, none found yet) up in this run (a
        tombstone is found, as in ``engine.lookup``). The keys are grouped by block, each block
        needed read once, and looked up in it natively."""
        first = self._first
        if not len(js) or not first:
            return
        at = lookup.block_indexes(first, js)
        order = np.argsort(at, kind="stable")
        at, js = at[order], js[order]
        cuts = (np.flatnonzero(at[1:] != at[:-1]) + 1).tolist()
        for lo, hi in zip([0, *cuts], [*cuts, len(at)]):
            i = int(at[lo])
            if i >= 0:  # -1: before the first key
                lookup.from_block(self._block(i), js[lo:hi])

    def entries(self, start: bytes = b"", stop: bytes | None = None, *,
                cached: bool = True) -> Iterator[tuple[bytes, bytes | None]]:
        """(key, value | None) with ``start <= key < stop`` in key order, tombstones included;
        not ``cached``: the blocks are read past the block cache (a compaction reads them once)."""
        i = max(0, self._block_of(start))
        n = len(self._blocks)
        while i < n:
            if stop is not None and self._first[i] >= stop:
                return
            if cached:
                yield from self._block_entries(i, start, stop)
            else:
                for k, v in self._read_block(i):
                    if start <= k and (stop is None or k < stop):
                        yield k, v
            i += 1

    def payloads(self) -> Iterator[tuple[bytes, int, int, int, bytes]]:
        """Each block's records payload, decompressed, in order, read past the block cache:
        ``(payload, records, first key group, last key group, first key)``."""
        for i, e in enumerate(self._blocks):
            yield self._payload(i, self._raw_block(i)), e.count, e.first_kg, e.last_kg, self._first[i]

    def all_entries(self) -> list[tuple[bytes, bytes | None]]:
        """Every entry in key order, tombstones included, read past the block cache (a compaction
        reads a delta run once)."""
        out: list[tuple[bytes, bytes | None]] = []
        for i in range(len(self._blocks)):
            out.extend(self._read_block(i))
        return out

    def items(self, start: bytes = b"", stop: bytes | None = None) -> Iterator[tuple[bytes, bytes]]:
        """(key, value) with ``start <= key < stop`` in key order, reading blocks as it goes."""
        for k, v in self.entries(start, stop):
            if v is not None:
                yield k, v

    # --- compaction (see the module doc) ---------------------------------------------------------
    def merged_blocks(self, changes: _Entries, max_payload: int) -> Iterator[MergedBlock]:
        """The blocks of a snapshot of this (snapshot) run's records with ``changes`` (key order;
        None: a removal) applied, in key order: untouched blocks as stored, the others as payloads
        of about ``max_payload`` bytes or the size of the block they replace."""
        cursor = _Cursor(changes)
        return self._merged(lambda lo, hi: [cursor.until(hi)], max_payload)

    def _merged(self, layers_in: Callable[[bytes, bytes | None], Sequence[_Entries]],
                max_payload: int, splits: Sequence[bytes] = ()) -> Iterator[MergedBlock]:
        """The compaction, ``MERGE_GROUP`` blocks at a time: ``layers_in(lo, hi)`` gives the
        changes with ``lo <= key < hi`` (each layer in key order, oldest first), so what a
        compaction holds at once is one group's changes, not all of them. A snapshot with no
        block (the empty state) takes them between ``splits`` (ascending keys) instead."""
        if self.kind != SNAPSHOT:
            raise ValueError("only a snapshot run is the base of a compaction")
        n, first = len(self._blocks), self._first
        if not n:
            bounds: list[bytes | None] = [*splits, None]
            start = b""
            for stop in bounds:
                part = _sorted_changes(layers_in(start, stop))
                yield from _payloads([(k, v) for k, v in zip(part.keys, part.values) if v is not None], max_payload)
                if stop is not None:
                    start = stop
            return
        for g in range(0, n, MERGE_GROUP):
            end = min(n, g + MERGE_GROUP)
            # the group's blocks take the changes below the next group's first key (the first
            # group those before its own first key too)
            changes = _sorted_changes(layers_in(b"" if g == 0 else first[g], None if end == n else first[end]))
            ckeys, m, j = changes.keys, len(changes.keys), 0
            for i in range(g, end):
                e = self._blocks[i]
                hi = m if i == end - 1 else bisect.bisect_left(ckeys, first[i + 1], j)
                raw = self._raw_block(i)
                if hi == j:
                    yield raw, e.count, e.first_kg, e.last_kg, first[i], True
                else:
                    yield from self._merge_block(i, raw, changes, j, hi, max_payload)
                j = hi

    def _raw_block(self, i: int) -> bytes:
        """Block ``i`` as stored, its lengths and checksum checked (not decoded)."""
        e, data = self._pread(i)
        try:
            _codec, count, _raw_len, _stored, total = blockcodec.read_block_header(data, 0)
            if total != e.length or count != e.count:
                raise CorruptBlockError(f"the block holds {count} records in {total} bytes, the index says "
                                        f"{e.count} in {e.length}")
            if xxhash.xxh3_64_intdigest(data[:16] + data[_BLOCK_HEAD:]) != int.from_bytes(data[16:24], "little"):
                raise CorruptBlockError("checksum mismatch")
        except CorruptBlockError as exc:
            raise CorruptFileError(self.path, f"block {i} at {e.offset}: {exc}", e.offset) from None
        self.blocks_read += 1
        return data

    def _payload(self, i: int, raw: bytes) -> bytes:
        """The records payload of block ``i`` (``raw``, checked by ``_raw_block``), decompressed."""
        codec, _count, raw_len, _stored, _total = blockcodec.read_block_header(raw, 0)
        if codec == blockcodec.CODEC_NONE:
            return raw[_BLOCK_HEAD:]
        d = getattr(_zstd, "d", None)
        if d is None:
            d = _zstd.d = zstandard.ZstdDecompressor()
        try:
            payload = d.decompress(raw[_BLOCK_HEAD:], max_output_size=raw_len)
        except zstandard.ZstdError as exc:
            raise CorruptFileError(self.path, f"block {i}: zstd decompression failed: {exc}", self._blocks[i].offset) from None
        if len(payload) != raw_len:
            raise CorruptFileError(self.path, f"block {i}: decompressed {len(payload)} bytes, the header says "
                                   f"{raw_len}", self._blocks[i].offset)
        return payload

    def _merge_block(self, i: int, raw: bytes, changes: _Changes, j: int, hi: int,
                     max_payload: int) -> Iterator[MergedBlock]:
        payload = self._payload(i, raw)
        count = self._blocks[i].count
        spliced = _splice_fixed(payload, count, changes, j, hi)
        if spliced is None:  # records of different sizes: decode them and merge lists
            try:
                recs = blockcodec.decode_records_raw(payload, count)
            except CorruptBlockError as exc:
                raise CorruptFileError(self.path, f"block {i}: {exc}", self._blocks[i].offset) from None
            out = _merge_lists(recs, changes.keys[j:hi], changes.values[j:hi])
            if out:
                yield from _payloads(out, max(max_payload, len(payload)))
            return
        merged, n, first_key, last_key = spliced
        if not n:
            return  # every record of the block removed
        target = max(max_payload, len(payload))
        if len(merged) > 2 * target:
            yield from _payloads(blockcodec.decode_records_raw(merged, n), target)
        else:
            yield merged, n, key_group_or_zero(first_key), key_group_or_zero(last_key), first_key, False

    def __repr__(self) -> str:
        return f"ColdRun({self.path!r}, {self.ref}, {self._records} records in {len(self._blocks)} blocks)"


def _splice_fixed(payload: bytes, count: int, changes: _Changes, j: int,
                  hi: int) -> tuple[bytes, int, bytes, bytes] | None:
    """A snapshot block's payload with changes ``j:hi`` applied, when its records are all puts of the
    changes' one key size and one record size: (payload, records, first key, last key). Rows are
    deleted and inserted with numpy: no Python work per record or per change. None otherwise (the
    caller decodes and merges)."""
    width, klen, size = changes.width, changes.klen if changes.width else 0, len(payload)
    if not width or not count or size != count * width or payload[1] != klen or payload[2 + klen] != width - 3 - klen:
        return None
    if (payload[0::width] != bytes(count) or payload[1::width] != bytes((klen,)) * count
            or payload[2 + klen::width] != bytes((width - 3 - klen,)) * count):
        return None
    keys = np.ascontiguousarray(np.frombuffer(payload, np.uint8).reshape(count, width)[:, 2:2 + klen]
                                ).view(f"S{klen}").ravel()  # compared as memcmp: equal lengths
    rows = np.frombuffer(payload, f"V{width}")  # a record per element
    wanted = changes.key_array[j:hi]
    pos = keys.searchsorted(wanted)
    hit = (pos < count) & (keys[np.minimum(pos, count - 1)] == wanted)
    gone = pos[hit]  # base rows replaced or removed
    put = changes.is_put[j:hi]
    at = pos[put]
    at = at - np.searchsorted(gone, at)  # where each put goes once the gone rows are out
    out = np.insert(np.delete(rows, gone, axis=0), at, changes.puts[changes.puts_before[j]:changes.puts_before[hi]],
                    axis=0)
    n = len(out)
    if not n:
        return b"", 0, b"", b""
    merged = out.tobytes()
    return merged, n, merged[2:2 + klen], merged[-width + 2:-width + 2 + klen]


def _merge_lists(recs: list[tuple[bytes, bytes | None]], ks: list[bytes],
                 vs: list[bytes | None]) -> list[tuple[bytes, bytes | None]]:
    """``recs`` (key order, no tombstones) with the changes applied (a None value removes the key)."""
    keys = [r[0] for r in recs]
    out: list[tuple[bytes, bytes | None]] = []
    prev, count = 0, len(recs)
    for k, v in zip(ks, vs):
        p = bisect.bisect_left(keys, k, prev)
        if p > prev:
            out.extend(recs[prev:p])
        prev = p + 1 if p < count and keys[p] == k else p
        if v is not None:
            out.append((k, v))
    out.extend(recs[prev:])
    return out


def _payloads(records: Sequence[tuple[bytes, bytes | None]], max_payload: int) -> Iterator[MergedBlock]:
    """``records`` (key order) as records payloads of at most ``max_payload`` bytes (at least one record each)."""
    start, n = 0, len(records)
    while start < n:
        block, nxt = blockcodec.encode_block(records, start, max_payload, blockcodec.CODEC_NONE)
        lo, hi = blockcodec.key_group_range(records, start, nxt)
        yield block[_BLOCK_HEAD:], nxt - start, lo, hi, bytes(records[start][0]), False
        start = nxt


def _look_up_all(level: ColdRun | ColdStack, keys: Sequence[bytes], absent: object) -> list[object]:
    """Per key of ``keys``: ``level.lookup_into``'s answer, ``absent`` where it has no entry."""
    lookup = KeyLookup.of(keys)
    level.lookup_into(lookup, lookup.all())
    return lookup.values(absent)


class ColdStack:
    """Runs newest first — deltas over a snapshot — read as one committed state (``ColdLevel``):
    the newest run with an entry for a key decides (a tombstone: absent). ``ref`` is the newest
    run's state."""

    def __init__(self, runs: Sequence[ColdRun], ref: CheckpointRef | None = None) -> None:
        if not runs or runs[-1].kind != SNAPSHOT or any(r.kind != DELTA for r in runs[:-1]):
            raise ValueError("a cold stack is delta runs, newest first, over one snapshot run")
        self.runs = list(runs)
        # the state it holds: the newest run's, or (its newest runs flushed by a version) the
        # state that version's commit made
        self.ref = runs[0].ref if ref is None else ref
        self.nbytes = sum(r.nbytes for r in runs)

    @classmethod
    def over(cls, deltas: Sequence[ColdRun], base: ColdRun | ColdStack, ref: CheckpointRef | None = None) -> ColdStack:
        """``deltas`` (newest first) over ``base``; ``ref`` the state it holds (default: the newest
        delta's)."""
        return cls(list(deltas) + (base.runs if isinstance(base, ColdStack) else [base]), ref)

    def below_flushed(self) -> ColdRun | ColdStack | None:
        """The stack without its newest runs that a version flushed (None: there are none): the
        state the committed delta files rebuild when stacked over it."""
        n = 0
        while self.runs[n].flushed:
            n += 1
        if n == 0:
            return None
        rest = self.runs[n:]
        return rest[0] if len(rest) == 1 else ColdStack(rest)

    def __len__(self) -> int:
        return len(self.runs[-1])  # the snapshot's records: an estimate (the deltas add and remove)

    def get(self, key: bytes) -> bytes | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        return cast("list[bytes | None]", _look_up_all(self, keys, None))

    def lookup_into(self, lookup: KeyLookup, js: np.ndarray) -> None:
        """``ColdRun.lookup_into`` through the runs, newest first, each asked only for the keys the
        newer ones have no entry for."""
        for run in self.runs:
            if not len(js):
                return
            run.lookup_into(lookup, js)
            js = lookup.pending(js)

    def items(self, start: bytes = b"", stop: bytes | None = None) -> Iterator[tuple[bytes, bytes]]:
        """The merged records in key order: for each key the newest run's entry, tombstones dropped."""
        def aged(age: int, run: ColdRun) -> Iterator[tuple[bytes, int, bytes | None]]:
            for k, v in run.entries(start, stop):
                yield k, age, v  # on equal keys the newer run (lower age) comes first

        streams = [aged(age, run) for age, run in enumerate(self.runs)]
        last = None
        for k, _age, v in heapq.merge(*streams):
            if k == last:
                continue  # an older run's entry for a key a newer run decided
            last = k
            if v is not None:
                yield k, v

    def merged_blocks(self, changes: _Entries, max_payload: int) -> Iterator[MergedBlock]:
        """``ColdRun.merged_blocks`` of the snapshot run under the stack, with the delta runs'
        entries and then ``changes`` (the newest) applied: a group of the snapshot's blocks at a
        time, each delta run read over that group's key range (past the block cache)."""
        cursor = _Cursor(changes)
        deltas = list(reversed(self.runs[:-1]))  # oldest first

        def layers_in(lo: bytes, hi: bytes | None) -> Sequence[_Entries]:
            return [list(run.entries(lo, hi, cached=False)) for run in deltas] + [cursor.until(hi)]

        # over an empty snapshot, each block of the largest delta sets a group's key range
        largest = max(deltas, key=len, default=None)
        splits = largest._first[1:] if largest is not None else []
        return self.runs[-1]._merged(layers_in, max_payload, splits)

    def close(self) -> None:
        for run in self.runs:
            run.close()

    def __repr__(self) -> str:
        return f"ColdStack({self.ref}, {len(self.runs)} runs)"


__all__ = ["MISSING", "BlockCache", "ColdRun", "ColdStack"]
