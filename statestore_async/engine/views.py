"""``FrozenView``: one committed state of a store, read-only, that later commits do not change
(what a snapshot is written from)."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from statestore_async.codecs import blockcodec
from statestore_async.codecs.keylayout import key_group_or_zero
from statestore_async.engine.levels import merge_lazy
from statestore_async.engine.table import Table, TableView
from statestore_async.errors import InterfaceError, StoreStateError

if TYPE_CHECKING:
    from statestore_async.engine.store import VersionedStore


class FrozenView:
    """A read-only view of one committed state that later commits do not change.

    Made by ``VersionedStore.freeze()`` for snapshot writing: the committed table is frozen
    (``Table.freeze``: its arena stays append-only while the view lives, and the view keeps the
    records' order), so reading the view stays exact while puts and commits go on. ``release()``
    it when done. A spilled store's view is its frozen hot table over its cold level (which
    never changes); its ``chunk``/``chunk_packed`` are read in order, from position 0, and its
    snapshot is written block by block from the cold level (``merged_blocks``).
    """

    def __init__(self, store: VersionedStore):
        self._store: VersionedStore | None = store  # None once released: a view kept around holds no store
        self.store_id = store.store_id
        self.ref = store.head
        self.lineage = store.lineage
        self._view: TableView | None = store._data.freeze()
        self._cold = store._cold
        self._len: int | None = None
        self._cursor: tuple[int, Iterator[tuple[bytes, bytes]], tuple[bytes, bytes] | None] | None = None

    def _live(self) -> TableView:
        if self._view is None:
            raise StoreStateError(f"the frozen view of store {self.store_id} at {self.ref} was released")
        return self._view

    def __len__(self) -> int:
        if self._view is None:
            return 0
        if self._cold is None:
            return len(self._view)
        if self._len is None:
            self._len = sum(1 for _ in self.items())
        return self._len

    def keys(self) -> list[bytes]:
        """The keys of the frozen state, in key order."""
        if self._view is None:
            return []
        return [k for k, _ in self.items()]

    def get(self, key: bytes) -> bytes | None:
        """The frozen value of ``key`` (None if it was not in the frozen state)."""
        view = self._live()
        if self._cold is None or view.get(key) is not None:
            return view.get(key)
        if _has_entry(view, key):
            return None  # removed since the cold state
        return self._cold.get(key)

    def items(self) -> Iterator[tuple[bytes, bytes]]:
        """The frozen records in key order (key groups ascending)."""
        view = self._live()
        if self._cold is None:
            return view.items()  # type: ignore[return-value]  # a committed table holds no tombstone
        return merge_lazy(view.items(), self._cold.items())

    def _merged_chunk(self, pos: int, max_bytes: int,
                      size_of: Callable[[bytes, bytes], int]) -> list[tuple[bytes, bytes]]:
        """A spilled store's merged records from position ``pos`` (the position the last chunk
        ended at, or 0) while their ``size_of`` adds up to at most ``max_bytes`` (at least one)."""
        self._live()
        cursor = self._cursor
        if cursor is not None and cursor[0] == pos:
            it, held = cursor[1], cursor[2]
        elif pos == 0:
            it, held = self.items(), None
        else:
            raise InterfaceError(f"the view of spilled store {self.store_id} is read in order: position {pos} "
                                 f"follows {cursor[0] if cursor else 0}")
        out: list[tuple[bytes, bytes]] = []
        size = 0
        while True:
            rec = held if held is not None else next(it, None)
            held = None
            if rec is None:
                break
            n = size_of(rec[0], rec[1])
            if out and size + n > max_bytes:
                held = rec
                break
            out.append(rec)
            size += n
        self._cursor = (pos + len(out), it, held)
        return out

    def chunk(self, pos: int, max_bytes: int) -> tuple[list[tuple[bytes, bytes]], int]:
        """The records from position ``pos`` in key order while ``len(key) + len(value) + 11``
        adds up to at most ``max_bytes`` (at least one when any is left), and the next position;
        an empty list at the end."""
        if self._cold is None:
            return self._live().chunk(pos, max_bytes)  # type: ignore[return-value]
        out = self._merged_chunk(pos, max_bytes, lambda k, v: len(k) + len(v) + 11)
        return out, pos + len(out)

    def chunk_packed(self, pos: int, max_bytes: int) -> tuple[bytes, int, int, int]:
        """The records from position ``pos`` as one encoded block payload (``TableView.chunk_packed``):
        ``(payload, next_pos, min_kg, max_kg)``."""
        if self._cold is None:
            return self._live().chunk_packed(pos, max_bytes)
        out = self._merged_chunk(pos, max_bytes, _record_size)
        if not out:
            return b"", pos, 0, 0
        kgs = [key_group_or_zero(k) for k, _ in out]
        return blockcodec.encode_records_raw(out), pos + len(out), min(kgs), max(kgs)

    def merged_blocks(self, max_payload: int) -> Iterator[tuple[bytes, int, int, int, bytes, bool]] | None:
        """A spilled store's snapshot blocks: its cold level's ``merged_blocks`` of the frozen hot
        part (a compaction that copies untouched blocks through: ``files.coldrun``); None when the
        store is not spilled (write ``chunk_packed``) or its cold level cannot merge by block."""
        view = self._live()
        merge = getattr(self._cold, "merged_blocks", None)
        if merge is None:
            return None
        blocks: Iterator[tuple[bytes, int, int, int, bytes, bool]] = merge(view.items(), max_payload)
        return blocks

    @property
    def approx_bytes(self) -> int:
        """About how many bytes the view's records take (its store's memory; 0 once released):
        a writer sizes its blocks by it."""
        return self._store.memory_bytes if self._store is not None else 0

    def release(self) -> None:
        """End the view: the table may reclaim what only the view needed, and the view lets go of the store."""
        store, view = self._store, self._view
        self._store = self._view = None
        self._cold = None
        self._cursor = None
        if view is not None:
            view.release()
        if store is not None:
            store._views.remove(self)

    def __enter__(self) -> FrozenView:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _varint_len(n: int) -> int:
    size = 1
    while n >= 0x80:
        n >>= 7
        size += 1
    return size


def _record_size(key: bytes, value: bytes) -> int:
    """Bytes of one record in a ``blockcodec`` records payload."""
    return 1 + _varint_len(len(key)) + len(key) + _varint_len(len(value)) + len(value)


def _has_entry(table: Table | TableView, key: bytes) -> bool:
    """Whether ``table`` has an entry for ``key`` (a tombstone included)."""
    if isinstance(table, Table):
        return key in table
    return any(True for _ in table.items(key, key + b"\x00"))
