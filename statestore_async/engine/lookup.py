"""A batch of keys looked up level by level, keys and values kept packed: ``KeyLookup``.

A spilled version answers a GET_MANY from several levels (its changes, its flushed runs, the hot
part, the cold runs' blocks), each asked only for the keys no newer level has an entry for. A
``KeyLookup`` reads the keys where they are — in any buffer, each after its u32 length, through
each key's offset in it (the daemon hands a request's payload over so, ``daemon.payloads``) — and
each level copies the values it finds into a chunk of its own (``table.lookup_spans``,
``blockcodec.RecordBlock.lookup_spans``), recording per key where its value lies. Whoever asked
then reads the values in key order in one step (the daemon writes its answer from ``value_bytes``,
``voff``, ``vlen`` and ``found``). So the working memory of a lookup is a few bytes per key plus
the values, never a Python object per key or per value: a GET_MANY of 475k keys holds ~30 bytes
per key besides its request and its answer, where lists of ``bytes`` held ~95.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from statestore_async.codecs import blockcodec
from statestore_async.engine import table as _table

if TYPE_CHECKING:
    from collections.abc import Sequence

    from statestore_async._ref import Buffer
    from statestore_async.engine.table import Table


class KeyLookup:
    """The keys of one batch lookup and what the levels asked so far found for them.

    ``found[j]`` is 1 once a level had an entry for key ``j``; then ``vlen[j]`` is its value's
    length (-1: a tombstone) and ``voff[j]`` where the value lies in the chunks found so far, taken
    end to end."""

    __slots__ = ("_chunks", "_size", "found", "kbuf", "koff", "vlen", "voff")

    def __init__(self, kbuf: Buffer, koff: np.ndarray) -> None:
        """The keys at the offsets ``koff`` (int64) of ``kbuf``, each after its u32 length there
        (checked by each level before it reads them)."""
        self.kbuf = kbuf
        self.koff = koff
        n = len(self.koff)
        self.found = np.zeros(n, np.uint8)
        self.voff = np.zeros(n, np.int64)
        self.vlen = np.zeros(n, np.int64)
        self._chunks: list[bytes] = []
        self._size = 0

    @classmethod
    def of(cls, keys: Sequence[bytes]) -> KeyLookup:
        """A lookup of a Python sequence of keys (packed first; a key that is not bytes-like raises
        ``KeyFormatError``)."""
        kbuf, koff = _table.pack_keys(keys)
        return cls(kbuf, np.frombuffer(koff, np.int64))

    def __len__(self) -> int:
        return len(self.koff)

    def all(self) -> np.ndarray:
        """Every key's index."""
        return np.arange(len(self.koff), dtype=np.int64)

    def pending(self, js: np.ndarray) -> np.ndarray:
        """The indexes of ``js`` not found yet."""
        left: np.ndarray = js[self.found[js] == 0]
        return left

    def from_table(self, table: Table, js: np.ndarray) -> None:
        """Look the keys of ``js`` (none found yet) up in ``table`` (tombstone entries found)."""
        self._take(_table.lookup_spans(table, self.kbuf, self.koff, js, self.found, self.voff, self.vlen,
                                       self._size))

    def from_block(self, block: blockcodec.RecordBlock, js: np.ndarray) -> None:
        """Look the keys of ``js`` (none found yet) up in a file's block."""
        self._take(block.lookup_spans(self.kbuf, self.koff, js, self.found, self.voff, self.vlen, self._size))

    def block_indexes(self, first_keys: list[bytes], js: np.ndarray) -> np.ndarray:
        """For each key of ``js``, the block of a file (its blocks' ``first_keys``) that would hold
        it (-1: before the first)."""
        return np.frombuffer(blockcodec.block_indexes(first_keys, self.kbuf, self.koff, js), np.int64)

    def _take(self, chunk: bytes) -> None:
        if chunk:
            self._chunks.append(chunk)
            self._size += len(chunk)

    def value_bytes(self) -> bytes:
        """The found values end to end (``voff``, ``vlen`` name each key's)."""
        if len(self._chunks) > 1:
            self._chunks = [b"".join(self._chunks)]
        return self._chunks[0] if self._chunks else b""

    def values(self, absent: object = None) -> list[object]:
        """The answer as a list in key order: a key's value, None for a tombstone, ``absent`` where
        no level had an entry."""
        data = self.value_bytes()
        return [absent if not f else None if ln < 0 else data[o : o + ln]
                for f, o, ln in zip(self.found.tolist(), self.voff.tolist(), self.vlen.tolist())]
