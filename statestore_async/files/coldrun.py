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

``ColdRun`` and ``ColdStack`` satisfy the engine's ``engine.store.ColdLevel``: the engine does no
IO of its own.
"""
from __future__ import annotations

import bisect
import heapq
import itertools
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import cast

from statestore_async.codecs import blockcodec
from statestore_async.engine.table import Table, load_records
from statestore_async.errors import CorruptBlockError, CorruptFileError
from statestore_async.files.checkpoint import (
    HEADER_FIXED,
    TRAILER_SIZE,
    FileHeader,
    Footer,
    header_length,
    parse_header,
    read_index,
    read_trailer,
)
from statestore_async.files.names import DELTA, SNAPSHOT
from statestore_async.ids import CheckpointRef, StoreId

_ids = itertools.count(1)
MISSING = object()  # ``lookup_many``: the run has no entry for the key (a tombstone gives None)


class BlockCache:
    """Decoded blocks of cold runs, by (run, block), least recently used out first, within ``max_bytes``.

    Each block is held as an engine ``Table`` (compact: no Python object per record); ``nbytes``
    is what they take. Thread-safe (blocks may be read from a worker thread).
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._lru: OrderedDict[tuple[int, int], Table] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def get(self, key: tuple[int, int]) -> Table | None:
        with self._lock:
            block = self._lru.get(key)
            if block is None:
                self.misses += 1
                return None
            self._lru.move_to_end(key)
            self.hits += 1
            return block

    def put(self, key: tuple[int, int], block: Table) -> None:
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
    blocks read once, at open, to learn them. The run keeps its file open: removing the file (the
    cache evicting its copy, retention deleting it) does not affect a run already open.
    """

    def __init__(self, path: str, fd: int, header: FileHeader, footer: Footer, first_keys: list[bytes],
                 cache: BlockCache) -> None:
        self.path = path
        self.kind = header.kind
        self.header = header
        self.ref = header.ref
        self._fd: int | None = fd
        self._blocks = footer.blocks
        self._first = first_keys
        self._records = footer.records
        self._cache = cache
        self.id = next(_ids)
        self.blocks_read = 0
        # what the run holds in memory: its index (the first keys and the block entries)
        self.nbytes = sum(len(k) + 33 for k in first_keys) + 120 * len(footer.blocks) + 200

    @classmethod
    def open(cls, path: str | os.PathLike[str], store_id: StoreId, ref: CheckpointRef, cache: BlockCache,
             kind: str = SNAPSHOT) -> ColdRun:
        """Open the ``kind`` file (the snapshot, or a delta) of ``store_id`` at ``ref``."""
        path = os.fspath(path)
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            size = os.fstat(fd).st_size
            head = os.pread(fd, min(size, 65536), 0)
            need = header_length(head, path)
            if len(head) < need:
                head = os.pread(fd, need, 0)
            header = parse_header(head, path)
            if header.kind != kind or header.ref != ref or not header.matches(store_id):
                raise CorruptFileError(path, f"the file is the {header.kind} of {header.store} at {header.ref}, "
                                             f"expected the {kind} of {store_id.to_json()} at {ref}", HEADER_FIXED)
            tail = os.pread(fd, TRAILER_SIZE, size - TRAILER_SIZE) if size >= TRAILER_SIZE else b""
            footer_at, footer_len, _ = read_trailer(tail, path)
            if footer_at < need or footer_at + footer_len + TRAILER_SIZE != size:
                raise CorruptFileError(path, "footer and trailer do not line up (truncated or extended file)", footer_at)
            footer = read_index(os.pread(fd, footer_len + TRAILER_SIZE, footer_at), path)
            if footer.blocks and footer.blocks[0].offset != need:
                raise CorruptFileError(path, "the first block does not follow the header", need)
            first_keys = footer.first_keys
            run = cls(path, fd, header, footer, first_keys or [], cache)
            if first_keys is None:  # written before footers named first keys: learn them once
                run._first = [run._read_block(i)[0][0] if b.count else b"" for i, b in enumerate(footer.blocks)]
                run.nbytes = sum(len(k) + 33 for k in run._first) + 120 * len(footer.blocks) + 200
            return run
        except BaseException:
            os.close(fd)
            raise

    def __len__(self) -> int:
        return self._records

    def close(self) -> None:
        """Close the file and drop the run's cached blocks (idempotent). Also done when collected."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
            self._cache.drop_run(self.id)

    def __del__(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None:
            self._fd = None
            try:
                os.close(fd)
            except OSError:
                pass

    # --- blocks ----------------------------------------------------------------------------------
    def _read_block(self, i: int) -> list[tuple[bytes, bytes | None]]:
        fd = self._fd
        if fd is None:
            raise CorruptFileError(self.path, "the cold run was closed", None)
        e = self._blocks[i]
        data = os.pread(fd, e.length, e.offset)
        try:
            if len(data) != e.length:
                raise CorruptBlockError(f"truncated: {len(data)} of {e.length} bytes")
            records, end = blockcodec.decode_block(data, 0)
            if end != e.length or len(records) != e.count:
                raise CorruptBlockError(f"the block holds {len(records)} records in {end} bytes, the index "
                                        f"says {e.count} in {e.length}")
        except CorruptBlockError as exc:
            raise CorruptFileError(self.path, f"block {i} at {e.offset}: {exc}", e.offset) from None
        self.blocks_read += 1
        return records

    def _block(self, i: int) -> Table:
        key = (self.id, i)
        block = self._cache.get(key)
        if block is None:
            block = Table()
            if self.kind == SNAPSHOT:
                load_records(block, self._read_block(i))
            else:  # a delta's tombstones stay entries: they hide older runs' values
                for k, v in self._read_block(i):
                    block.put(k, v)
            self._cache.put(key, block)
        return block

    def _block_of(self, key: bytes) -> int:
        """The block that would hold ``key`` (-1: before the first key)."""
        return bisect.bisect_right(self._first, key) - 1

    # --- the engine's ColdLevel -------------------------------------------------------------------
    def get(self, key: bytes) -> bytes | None:
        i = self._block_of(key)
        return None if i < 0 else self._block(i).get(key)

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The values of ``keys`` (None: absent or removed); each block needed is read once."""
        return [None if v is MISSING else cast("bytes | None", v) for v in self.lookup_many(keys)]

    def lookup_many(self, keys: Sequence[bytes]) -> list[object]:
        """Per key: its value, None for a tombstone (delta runs), ``MISSING`` when the run has no entry."""
        out: list[object] = [MISSING] * len(keys)
        by_block: dict[int, list[int]] = {}
        first = self._first
        for j, k in enumerate(keys):
            i = bisect.bisect_right(first, k) - 1
            if i >= 0:
                by_block.setdefault(i, []).append(j)
        for i, js in by_block.items():
            block = self._block(i)
            for j in js:
                k = keys[j]
                if k in block:
                    out[j] = block.get(k)
        return out

    def entries(self, start: bytes = b"", stop: bytes | None = None) -> Iterator[tuple[bytes, bytes | None]]:
        """(key, value | None) with ``start <= key < stop`` in key order, tombstones included."""
        i = max(0, self._block_of(start))
        n = len(self._blocks)
        while i < n:
            if stop is not None and self._first[i] >= stop:
                return
            yield from self._block(i).items(start, stop)
            i += 1

    def items(self, start: bytes = b"", stop: bytes | None = None) -> Iterator[tuple[bytes, bytes]]:
        """(key, value) with ``start <= key < stop`` in key order, reading blocks as it goes."""
        for k, v in self.entries(start, stop):
            if v is not None:
                yield k, v

    def __repr__(self) -> str:
        return f"ColdRun({self.path!r}, {self.ref}, {self._records} records in {len(self._blocks)} blocks)"


class ColdStack:
    """Runs newest first — deltas over a snapshot — read as one committed state (``ColdLevel``):
    the newest run with an entry for a key decides (a tombstone: absent). ``ref`` is the newest
    run's state."""

    def __init__(self, runs: Sequence[ColdRun]) -> None:
        if not runs or runs[-1].kind != SNAPSHOT or any(r.kind != DELTA for r in runs[:-1]):
            raise ValueError("a cold stack is delta runs, newest first, over one snapshot run")
        self.runs = list(runs)
        self.ref = runs[0].ref
        self.nbytes = sum(r.nbytes for r in runs)

    @classmethod
    def over(cls, deltas: Sequence[ColdRun], base: ColdRun | ColdStack) -> ColdStack:
        """``deltas`` (newest first) over ``base``."""
        return cls(list(deltas) + (base.runs if isinstance(base, ColdStack) else [base]))

    def __len__(self) -> int:
        return len(self.runs[-1])  # the snapshot's records: an estimate (the deltas add and remove)

    def get(self, key: bytes) -> bytes | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        out: list[bytes | None] = [None] * len(keys)
        pending = list(range(len(keys)))
        for run in self.runs:
            if not pending:
                break
            found = run.lookup_many([keys[j] for j in pending])
            left = []
            for j, v in zip(pending, found):
                if v is MISSING:
                    left.append(j)
                else:
                    out[j] = cast("bytes | None", v)  # bytes, or None for a tombstone
            pending = left
        return out

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

    def close(self) -> None:
        for run in self.runs:
            run.close()

    def __repr__(self) -> str:
        return f"ColdStack({self.ref}, {len(self.runs)} runs)"


__all__ = ["MISSING", "BlockCache", "ColdRun", "ColdStack"]
