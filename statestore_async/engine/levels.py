"""The levels a spilled store reads through, and key-ordered streams merged across them.

A spilled store's committed state is a hot table in memory over a ``ColdLevel`` (in the daemon a
``files.coldrun.ColdRun`` or ``ColdStack``: files on local disk, read a block at a time); an open
version that flushed its changes reads them back through ``FlushedRun``s. The engine does no IO:
these protocols are what it asks of the levels. ``merge_lazy``, ``merge_entries`` and
``merge_ordered`` merge the key-ordered reads of several levels, newest first.
"""
from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol, TypeAlias

import numpy as np

from statestore_async.engine.lookup import KeyLookup
from statestore_async.engine.table import Table
from statestore_async.ids import CheckpointRef

# a FlushedRun's ``lookup_many`` (and a cold level's): the run has no entry for the key (a
# tombstone gives None)
MISSING = object()


class ColdLevel(Protocol):
    """The committed records of one state (``ref``) outside memory, read on demand: key order, no
    tombstones. ``nbytes`` is what it holds in memory itself (its index)."""

    ref: CheckpointRef
    nbytes: int

    def __len__(self) -> int: ...

    def get(self, key: bytes) -> bytes | None: ...

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]: ...

    def lookup_into(self, lookup: KeyLookup, js: np.ndarray) -> None:
        """Look the keys of ``js`` (int64 indexes of ``lookup``'s keys, none found yet) up in the
        level's blocks (``KeyLookup.from_block``)."""
        ...

    def items(self, start: bytes = b"", stop: bytes | None = None) -> Iterator[tuple[bytes, bytes]]: ...

    def close(self) -> None:
        """Let go of what it holds (its store replaced it; no view of it is left)."""


class FlushedRun(Protocol):
    """Changes of an open version written out in key order by a write-buffer flush (``engine.store``:
    the write buffer), tombstones kept: in the daemon a ``files.coldrun.ColdRun`` of a delta file on local
    disk. ``nbytes`` is what it holds in memory (its index)."""

    ref: CheckpointRef
    nbytes: int

    def __len__(self) -> int: ...

    def lookup_many(self, keys: Sequence[bytes]) -> list[object]:
        """Per key: its value, None for a tombstone, ``MISSING`` when the run has no entry."""
        ...

    def lookup_into(self, lookup: KeyLookup, js: np.ndarray) -> None:
        """``ColdLevel.lookup_into``, a tombstone found (its length -1)."""
        ...

    def entries(self, start: bytes = b"", stop: bytes | None = None) -> Iterator[tuple[bytes, bytes | None]]:
        """(key, value | None) with ``start <= key < stop`` in key order, tombstones included."""
        ...

    def reopen(self) -> FlushedRun:
        """The same run read through a handle of its own (closing either leaves the other open)."""
        ...

    def close(self) -> None: ...


# write_run(overlay) -> the flushed run of it; stack(runs newest first, cold level, state) -> the
# cold level holding ``state``: the runs over the cold level (see StoreVersion.flush)
WriteRun: TypeAlias = Callable[[Table], FlushedRun]
StackRuns: TypeAlias = Callable[[Sequence[FlushedRun], ColdLevel, CheckpointRef], ColdLevel]


def prefix_stop(prefix: bytes) -> bytes | None:
    """The smallest key above every key that starts with ``prefix`` (None: there is none)."""
    p = prefix.rstrip(b"\xff")
    return p[:-1] + bytes([p[-1] + 1]) if p else None


def merge_lazy(changes: Iterator[tuple[bytes, bytes | None]],
               base: Iterator[tuple[bytes, bytes | None]]) -> Iterator[tuple[bytes, bytes]]:
    """``merge_ordered`` of two key-ordered iterators, reading each only as far as the output goes
    (a caller that stops early has paid only for what it took, and the tombstones before it)."""
    c = next(changes, None)
    b = next(base, None)
    while c is not None:
        if b is not None and b[0] < c[0]:
            k, v = b
            b = next(base, None)
        else:
            k, v = c
            if b is not None and b[0] == k:
                b = next(base, None)
            c = next(changes, None)
        if v is not None:
            yield k, v
    while b is not None:
        if b[1] is not None:
            yield b[0], b[1]
        b = next(base, None)


def merge_entries(streams: Sequence[Iterator[tuple[bytes, bytes | None]]]) -> Iterator[tuple[bytes, bytes | None]]:
    """Key-ordered iterators of (key, value | None), newest first, merged in key order: for each
    key the newest stream's entry, tombstones kept."""
    def aged(age: int, stream: Iterator[tuple[bytes, bytes | None]]) -> Iterator[tuple[bytes, int, bytes | None]]:
        for k, v in stream:
            yield k, age, v  # on equal keys the newer stream (lower age) comes first

    last = None
    for k, _age, v in heapq.merge(*(aged(age, s) for age, s in enumerate(streams))):
        if k != last:
            last = k
            yield k, v


def merge_ordered(changes: list[tuple[bytes, bytes | None]],
                  base: list[tuple[bytes, bytes | None]]) -> Iterator[tuple[bytes, bytes]]:
    """The key-ordered union of two key-ordered lists, ``changes`` winning on equal keys; a None
    value (a tombstone) hides the key."""
    i = j = 0
    nc, nb = len(changes), len(base)
    while i < nc or j < nb:
        if j >= nb or (i < nc and changes[i][0] <= base[j][0]):
            k, v = changes[i]
            i += 1
            if j < nb and base[j][0] == k:
                j += 1
        else:
            k, v = base[j]
            j += 1
        if v is not None:
            yield k, v
