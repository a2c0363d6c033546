"""What one commit changed: ``Delta`` (the records to persist, its lineage) and ``Records``, a
read-only mapping over its table of changes; ``table_of`` makes such a table."""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from statestore_async.engine.levels import FlushedRun, merge_entries
from statestore_async.engine.table import Table
from statestore_async.errors import InterfaceError
from statestore_async.ids import CheckpointRef, StoreId

if TYPE_CHECKING:
    from statestore_async.engine.store import VersionedStore


class Records(Mapping[bytes, "bytes | None"]):
    """A read-only mapping over a table of changes: key → value, or None for a removed key.

    Iteration is in key order (key groups ascending). ``table`` is the table itself, for the
    routines that read it whole (file encoding); nothing may change it.
    """

    __slots__ = ("table",)

    def __init__(self, table: Table):
        self.table = table

    def __getitem__(self, key: bytes) -> bytes | None:
        if key not in self.table:
            raise KeyError(key)
        return self.table.get(key)

    def __contains__(self, key: object) -> bool:
        return type(key) is bytes and key in self.table

    def __iter__(self) -> Iterator[bytes]:
        return (k for k, _ in self.table.items())

    def __len__(self) -> int:
        return len(self.table)

    def items(self) -> Iterator[tuple[bytes, bytes | None]]:  # type: ignore[override]
        """(key, value | None) in key order."""
        return self.table.items()

    def __repr__(self) -> str:
        return f"Records({len(self.table)} records)"


@dataclass(frozen=True, eq=False)
class Delta:
    """What one commit changed: the records to persist for ``ref``.

    ``records`` maps key → new value, or None for a removed key (a tombstone), in key order.
    ``lineage`` lists the committed states this one builds on, newest first, back to its base (a
    state with a snapshot, or the empty state, version 0). ``lineage[0]`` is the parent.

    The delta of a deferred commit (``StoreVersion.commit(defer=True)``) has its records once the
    store has applied the changes: reading ``records`` applies them (``VersionedStore.apply_pending``)
    if that has not happened yet; ``applied`` tells without doing it.
    """

    store_id: StoreId
    ref: CheckpointRef
    lineage: tuple[CheckpointRef, ...]
    _records: Table | None
    # bytes of the records' keys and values (+ 8 each): what the upload queue counts (for a deferred
    # commit, counted from the changes before they were applied: an upper bound)
    nbytes: int = 0
    _store: VersionedStore | None = field(default=None, repr=False)
    # a commit of a version that flushed: its runs (newest first, handles of the delta's own), which
    # hold the changes made before the last flush; ``_records`` holds those made after it
    runs: tuple[FlushedRun, ...] = ()

    @property
    def records(self) -> Records:
        return Records(self.table)

    @property
    def table(self) -> Table:
        """The records as the engine's table (read only). A delta with ``runs`` has no such table
        (its records are mostly on disk): read ``entries()``."""
        if self.runs:
            raise InterfaceError(f"the delta of {self.store_id} at {self.ref} has {len(self.runs)} flushed runs: "
                                 "read its records with entries()")
        return self._table()

    def _table(self) -> Table:
        self.apply()
        records = self._records
        assert records is not None  # apply() set them
        return records

    def entries(self) -> Iterator[tuple[bytes, bytes | None]]:
        """Every (key, value | None) of the delta in key order, its flushed runs merged in (the
        newest entry of a key wins)."""
        table = self._table()
        if not self.runs:
            return table.items()
        return merge_entries([table.items(), *(run.entries() for run in self.runs)])

    @property
    def entries_in_memory(self) -> int:
        """Changes of the delta held in memory (made after its version's last flush)."""
        return len(self._table())

    def close_runs(self) -> None:
        """Let go of the runs' handles (the delta file is written). Idempotent."""
        for run in self.runs:
            run.close()

    @property
    def applied(self) -> bool:
        return self._records is not None

    def apply(self) -> None:
        """Apply a deferred commit's changes now (nothing if they are applied already)."""
        if self._records is None:
            assert self._store is not None  # a deferred commit's delta names its store
            self._store.apply_pending()

    @property
    def parent(self) -> CheckpointRef:
        return self.lineage[0]

    @property
    def version(self) -> int:
        return self.ref.version

    @property
    def ckptid(self) -> str:
        return self.ref.ckptid

    def __len__(self) -> int:
        return len(self.table)


def table_of(records: Mapping[bytes, bytes | None] | Iterable[tuple[bytes, bytes | None]]) -> Table:
    """A new table holding ``records`` (a mapping, or (key, value | None) pairs; None is kept as
    a tombstone entry)."""
    t = Table()
    pairs = records.items() if isinstance(records, Mapping) else records
    for k, v in pairs:
        t.put(k, v)
    return t
