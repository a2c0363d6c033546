"""The versioned key-value engine: no IO, no asyncio (DESIGN §5).

A ``VersionedStore`` holds the committed map of one store at its head ``(version, ckptid)``.
``open(version)`` hands out a ``StoreVersion``: an overlay (changed keys and tombstones) over the
committed map, so ``put``/``remove`` cost O(1) and the committed map is never copied.
``commit()`` applies the overlay in O(changed keys), keeps the pre-images as an undo log, and
returns the ``Delta`` to persist. ``abort()`` drops the overlay.

Recent commits stay in memory as (undo, redo) pairs, so a retry that opens an earlier version (or
another attempt's checkpoint of it) is served by rolling back and forward in O(changes), without
reading any file. Keys are bytes in the layout of ``statestore_async.codecs.keylayout``; values are bytes.

A ``StoreVersion`` is single-use: UPDATING → COMMITTED | ABORTED, checked on every call. At most
one is UPDATING per store (one writer per store and version).
"""
from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TypeAlias

from statestore_async.codecs.keylayout import KEY_GROUP_BYTES
from statestore_async.codecs.packed import PackedList, PackedPairs
from statestore_async.engine import overlay as _overlay
from statestore_async.errors import (
    InterfaceError,
    KeyFormatError,
    StoreStateError,
    VersionNotFoundError,
    WriterConflictError,
)
from statestore_async.ids import EMPTY_STATE, CheckpointRef, StoreId, new_checkpoint_id

# Approximate bytes a dict entry with two bytes objects costs beyond the payload lengths
# (two object headers of 33 bytes plus a dict slot), for memory accounting.
ENTRY_OVERHEAD = 2 * 33 + 40
DEFAULT_HISTORY = 4
# Refs a commit's lineage names at most (a delta file's header carries it); see _lineage_tail.
MAX_LINEAGE = 1000

# key -> value, or None for a removed key (a tombstone): an overlay, a commit's changes or records
Changes: TypeAlias = dict[bytes, bytes | None]
# the map a finished StoreVersion reads from (never, its state checks come first): none of the store's
_NO_DATA: dict[bytes, bytes] = {}


class State(enum.Enum):
    UPDATING = "UPDATING"
    COMMITTED = "COMMITTED"
    ABORTED = "ABORTED"


@dataclass(frozen=True, eq=False)
class Delta:
    """What one commit changed: the records to persist for ``ref``.

    ``records`` maps key → new value, or None for a removed key (a tombstone). ``lineage`` lists the
    committed states this one builds on, newest first, back to its base (a state with a snapshot,
    or the empty state, version 0). ``lineage[0]`` is the parent.

    The delta of a deferred commit (``StoreVersion.commit(defer=True)``) has its records once the
    store has applied the changes: reading ``records`` applies them (``VersionedStore.apply_pending``)
    if that has not happened yet; ``applied`` tells without doing it.
    """

    store_id: StoreId
    ref: CheckpointRef
    lineage: tuple[CheckpointRef, ...]
    _records: Changes | None
    # bytes of the records' keys and values (+ 8 each): what the upload queue counts (for a deferred
    # commit, counted from the changes before they were applied: an upper bound)
    nbytes: int = 0
    _store: VersionedStore | None = field(default=None, repr=False)

    @property
    def records(self) -> Changes:
        self.apply()
        records = self._records
        assert records is not None  # apply() set them
        return records

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
        return len(self.records)


@dataclass
class _Commit:
    parent: CheckpointRef
    child: CheckpointRef
    child_lineage: tuple[CheckpointRef, ...]
    # both None until the commit's changes are applied (a deferred commit: VersionedStore.apply_pending)
    undo: list[bytes | None] | None  # the value before the commit of each key of ``redo``, in its order (None: absent)
    redo: Changes | None  # key -> value after the commit (None: removed)
    nbytes: int = 0

    def undo_changes(self) -> Changes:
        """key -> value before the commit: the changes that roll it back."""
        assert self.redo is not None and self.undo is not None  # applied: see apply_pending
        return dict(zip(self.redo, self.undo))


def _entry_bytes(key: bytes, value: bytes | None) -> int:
    return len(key) + (len(value) if value is not None else 0) + ENTRY_OVERHEAD


def _check_key(key: object) -> bytes:
    if type(key) is not bytes:
        if isinstance(key, (bytearray, memoryview)):
            key = bytes(key)
        else:
            raise KeyFormatError(f"keys are bytes, got {type(key).__name__}")
    if len(key) < KEY_GROUP_BYTES:
        raise KeyFormatError(f"a store key starts with its {KEY_GROUP_BYTES}-byte key group, got {len(key)} bytes")
    return key


def _check_value(value: object) -> bytes:
    if type(value) is not bytes:
        if isinstance(value, (bytearray, memoryview)):
            return bytes(value)
        raise InterfaceError(f"values are bytes, got {type(value).__name__}")
    return value


class FrozenView:
    """A read-only view of one committed state that later commits do not change.

    Made by ``VersionedStore.freeze()`` for snapshot writing: the keys are listed once (a pointer
    copy); later mutations of the store first save the pre-image of each key they touch into this
    view, so reading the view stays exact while puts and commits go on. ``release()`` it when done.
    """

    def __init__(self, store: VersionedStore):
        self._store: VersionedStore | None = store  # None once released: a view kept around holds no store
        self.store_id = store.store_id
        self.ref = store.head
        self.lineage = store.lineage
        self._keys = list(store._data)
        self._shadow: Changes = {}  # key -> its frozen value where a later change saved it (None: absent)

    def __len__(self) -> int:
        return len(self._keys)

    def _preserve(self, keys: Iterable[bytes], pre_images: Iterable[bytes | None]) -> None:
        shadow = self._shadow
        for k, old in zip(keys, pre_images):
            if k not in shadow:
                shadow[k] = old

    def keys(self) -> list[bytes]:
        """The keys of the frozen state (``get`` gives each one's frozen value, even if a later
        commit changed or removed it). The list belongs to the view: do not change it."""
        return self._keys

    def get(self, key: bytes) -> bytes | None:
        """The frozen value of ``key`` (None if it was not in the frozen state)."""
        if key in self._shadow:
            return self._shadow[key]
        return self._live()._data.get(key)

    def group(self, start: int, stop: int, groups: list[list[bytes] | None]) -> None:
        """Sort the frozen records of ``keys()[start:stop]`` into ``groups`` by key group
        (``overlay.group_records``; ``overlay.gather_records`` hands them out in order)."""
        _overlay.group_records(self._keys, start, stop, self._shadow, self._live()._data, groups)

    def _live(self) -> VersionedStore:
        if self._store is None:
            raise StoreStateError(f"the frozen view of store {self.store_id} at {self.ref} was released")
        return self._store

    def release(self) -> None:
        """End the view: the store stops saving pre-images for it, and the view lets go of the store."""
        store = self._store
        if store is not None:
            store._views.remove(self)
            self._store = None
            self._shadow = {}
            self._keys = []

    def __enter__(self) -> FrozenView:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class VersionedStore:
    """The committed state of one store plus a short history of recent commits."""

    def __init__(
        self,
        store_id: StoreId,
        data: dict[bytes, bytes] | None = None,
        head: CheckpointRef = EMPTY_STATE,
        lineage: Sequence[CheckpointRef] = (),
        *,
        head_has_snapshot: bool = False,
        history: int = DEFAULT_HISTORY,
    ):
        if history < 1:
            raise InterfaceError("history must keep at least 1 commit (2 versions)")
        if head.version > 0 and not lineage and not head_has_snapshot:
            raise InterfaceError("a non-empty state needs its lineage or a snapshot")
        self.store_id = store_id
        self._data: dict[bytes, bytes] = data if data is not None else {}
        self._head = head
        self._lineage = tuple(lineage)
        self._history_limit = history
        self._history: list[_Commit] = []
        self._snapshots: set[CheckpointRef] = {head} if (head_has_snapshot or head.version == 0) else set()
        self._writer: StoreVersion | None = None
        self._views: list[FrozenView] = []
        self._data_bytes = sum(_entry_bytes(k, v) for k, v in self._data.items())
        # a deferred commit whose changes are not in the map yet: (changes, its _Commit, its Delta)
        self._pending: tuple[Changes, _Commit, Delta] | None = None

    # --- what is committed ----------------------------------------------------------------------
    @property
    def head(self) -> CheckpointRef:
        """The committed state the map holds now."""
        return self._head

    @property
    def lineage(self) -> tuple[CheckpointRef, ...]:
        """The head's lineage, newest first, back to its base (empty for version 0)."""
        return self._lineage

    @property
    def writer(self) -> StoreVersion | None:
        """The version being updated now, if any."""
        return self._writer

    def __len__(self) -> int:
        self.apply_pending()
        return len(self._data)

    @property
    def memory_bytes(self) -> int:
        """Approximate bytes held: committed map, open overlay and the undo/redo history."""
        self.apply_pending()
        total = self._data_bytes + sum(c.nbytes for c in self._history)
        if self._writer is not None:
            total += self._writer._overlay_bytes
        return total

    def known_states(self) -> list[CheckpointRef]:
        """Every committed state this store can switch to without reading a file."""
        refs = {self._head}
        for c in self._history:
            refs.add(c.parent)
            refs.add(c.child)
        return sorted(refs)

    def mark_snapshot(self, ref: CheckpointRef) -> None:
        """Record that ``ref`` has a durable snapshot: later lineages stop there."""
        self._snapshots.add(ref)
        if len(self._snapshots) > 64:
            keep = sorted(self._snapshots, key=lambda r: r.version)[-32:]
            self._snapshots = set(keep)

    def has_snapshot(self, ref: CheckpointRef) -> bool:
        return ref in self._snapshots

    def deltas_since_snapshot(self) -> int:
        """Deltas a load of the head would replay on top of its newest known snapshot (or version 0)."""
        n = 0
        for r in (self._head,) + self._lineage:
            if r in self._snapshots or r.version == 0:
                break
            n += 1
        return n

    # --- reading the committed state --------------------------------------------------------------
    def get(self, key: bytes) -> bytes | None:
        """The committed value of ``key`` at the head (None if absent)."""
        self.apply_pending()
        return self._data.get(key)

    def items(self) -> Iterator[tuple[bytes, bytes]]:
        """The committed records at the head (do not commit while iterating; use freeze())."""
        self.apply_pending()
        return iter(self._data.items())

    def freeze(self) -> FrozenView:
        """A view of the head that later commits and rollbacks leave unchanged."""
        self.apply_pending()
        view = FrozenView(self)
        self._views.append(view)
        return view

    # --- opening a version for update ------------------------------------------------------------
    def open(self, version: int, ckptid: str | None = None) -> StoreVersion:
        """Open committed ``version`` (of attempt ``ckptid``; the head's when None) for update.

        Raises ``WriterConflictError`` if another version is being updated, and
        ``VersionNotFoundError`` if that state is not in memory (the caller loads it from files).
        """
        self.apply_pending()
        if self._writer is not None:
            raise WriterConflictError(
                f"store {self.store_id} already has a writer at version {self._writer.version}; "
                "commit or abort it first"
            )
        target = self._resolve(version, ckptid)
        self._switch_to(target)
        self._writer = StoreVersion(self)
        return self._writer

    def _resolve(self, version: int, ckptid: str | None) -> CheckpointRef:
        if ckptid is None:
            if self._head.version == version:
                return self._head
            candidates = [r for r in self.known_states() if r.version == version]
            if len(candidates) == 1:
                return candidates[0]
            raise VersionNotFoundError(
                f"store {self.store_id}: version {version} is "
                + ("ambiguous in memory; name its checkpoint id" if candidates else "not in memory")
            )
        return CheckpointRef(version, ckptid)

    def _path_to(self, target: CheckpointRef) -> tuple[list[_Commit], list[_Commit]] | None:
        """(commits to undo, commits to redo) to move the map from head to target, or None."""
        if target == self._head:
            return [], []
        by_child = {c.child: c for c in self._history}
        # the head's ancestors reachable through the history, nearest first
        back: list[_Commit] = []
        pos = {self._head: 0}
        ref = self._head
        while ref in by_child:
            c = by_child[ref]
            back.append(c)
            ref = c.parent
            pos[ref] = len(back)
        # walk from the target up to the first state on the head's line
        forward: list[_Commit] = []
        ref = target
        while ref not in pos:
            step = by_child.get(ref)
            if step is None:
                return None
            forward.append(step)
            ref = step.parent
        return back[: pos[ref]], list(reversed(forward))

    def _switch_to(self, target: CheckpointRef) -> None:
        path = self._path_to(target)
        if path is None:
            raise VersionNotFoundError(
                f"store {self.store_id}: state {target} is not in memory (head is {self._head})"
            )
        undo, redo = path
        for c in undo:
            self._mutate(c.undo_changes())
            self._head, self._lineage = c.parent, self._lineage_of(c.parent)
        for c in redo:
            assert c.redo is not None  # applied: open() applies a pending commit first
            self._mutate(c.redo)
            self._head, self._lineage = c.child, c.child_lineage

    def _lineage_of(self, ref: CheckpointRef) -> tuple[CheckpointRef, ...]:
        if ref == self._head:
            return self._lineage
        for c in self._history:
            if c.child == ref:
                return c.child_lineage
        # ref is the parent of the oldest kept commit: its lineage is the tail of its child's
        for c in self._history:
            if c.parent == ref:
                return c.child_lineage[1:]
        raise VersionNotFoundError(f"no lineage known for {ref}")

    def _lineage_tail(self) -> tuple[CheckpointRef, ...]:
        """The head's lineage cut after the newest state known to have a snapshot (or version 0),
        and to at most ``MAX_LINEAGE - 1`` refs.

        A snapshot may become durable after later commits were made on top of it: lineages of
        new commits stop there all the same. Without snapshots (failing, or a huge
        ``snapshot_interval``) the cap keeps each commit's cost and each delta header bounded; a
        loader goes on from the oldest named delta's own header, one more hop.
        """
        if self._head in self._snapshots or self._head.version == 0:
            return ()
        tail: list[CheckpointRef] = []
        for r in self._lineage:
            if len(tail) >= MAX_LINEAGE - 1:
                break
            tail.append(r)
            if r in self._snapshots or r.version == 0:
                break
        return tuple(tail)

    def _mutate(self, changes: Changes) -> tuple[list[bytes | None], Changes, int, int]:
        """Apply key → value|None to the map in one pass (``overlay.apply_changes``).

        Returns (pre-images in the records' order, effective records, accounted bytes of the
        pre-images, of the records).
        """
        pre, records, data_delta, undo_bytes, record_bytes = _overlay.apply_changes(self._data, changes, ENTRY_OVERHEAD)
        for view in self._views:
            view._preserve(records, pre)
        self._data_bytes += data_delta
        return pre, records, undo_bytes, record_bytes

    def _child(self, ckptid: str | None) -> CheckpointRef:
        """The state a commit on the head makes (a fresh checkpoint id when None), checked new."""
        child = CheckpointRef(self._head.version + 1, ckptid or new_checkpoint_id())
        if any(c.child == child for c in self._history):
            raise InterfaceError(f"checkpoint {child} was committed already")
        return child

    def _commit(self, overlay: Changes, ckptid: str | None, defer: bool = False, bound: int = 0) -> Delta:
        self.apply_pending()
        parent = self._head
        child = self._child(ckptid)
        lineage = (parent,) + self._lineage_tail()
        commit = _Commit(parent, child, lineage, None, None, 0)
        self._history.append(commit)
        if len(self._history) > self._history_limit:
            del self._history[: len(self._history) - self._history_limit]
        self._head, self._lineage = child, lineage
        if defer:
            delta = Delta(self.store_id, child, lineage, None, bound, self)
            self._pending = (overlay, commit, delta)
            return delta
        records, record_bytes = self._apply(overlay, commit)
        return Delta(self.store_id, child, lineage, records, record_bytes)

    def _apply(self, overlay: Changes, commit: _Commit) -> tuple[Changes, int]:
        # a tombstone for a key that did not exist changes nothing: apply_changes leaves it out
        undo, records, nbytes, record_bytes = self._mutate(overlay)
        commit.undo, commit.redo, commit.nbytes = undo, records, nbytes
        return records, record_bytes

    def apply_pending(self) -> None:
        """Apply a deferred commit's changes to the map, if one waits (see ``StoreVersion.commit``).

        Every method that reads the map or the history calls it first, so a deferred commit is
        never seen half done; a caller may also call it when it is idle. Idempotent."""
        pending = self._pending
        if pending is None:
            return
        self._pending = None
        overlay, commit, delta = pending
        records, _ = self._apply(overlay, commit)
        object.__setattr__(delta, "_records", records)
        object.__setattr__(delta, "_store", None)  # applied: the delta no longer keeps the store alive


class StoreVersion:
    """One writer's open version: reads see the overlay first, then the committed map."""

    __slots__ = ("_base", "_overlay", "_overlay_bytes", "_result", "_store", "parent", "state", "store_id")

    def __init__(self, store: VersionedStore):
        # None and empty once the version is committed or aborted: a finished version someone
        # keeps (a connection's handle, a caller's variable) holds neither the store nor its map.
        self._store: VersionedStore | None = store
        self._base = store._data
        self.store_id = store.store_id
        self._overlay: Changes = {}
        self._overlay_bytes = 0
        self.state = State.UPDATING
        self.parent = store.head
        self._result: Delta | None = None

    @property
    def version(self) -> int:
        """The committed version this update started from."""
        return self.parent.version

    @property
    def num_changes(self) -> int:
        return len(self._overlay)

    def _check_updating(self, op: str) -> VersionedStore:
        store = self._store
        if self.state is not State.UPDATING or store is None:
            raise StoreStateError(
                f"cannot {op} store {self.store_id} version {self.version}: it is already {self.state.value}"
            )
        return store

    def _finished(self, state: State) -> None:
        """Committed or aborted: let go of the changes, the store and its map; free the writer slot."""
        store = self._store
        self.state = state
        self._overlay = {}
        self._overlay_bytes = 0
        self._base = _NO_DATA
        self._store = None
        if store is not None:
            store._writer = None

    # --- reads --------------------------------------------------------------------------------------
    def get(self, key: bytes) -> bytes | None:
        self._check_updating("get from")
        overlay = self._overlay
        if key in overlay:
            return overlay[key]
        return self._base.get(key)

    def get_many(self, keys: Iterable[bytes]) -> list[bytes | None]:
        self._check_updating("get from")
        return _overlay.get_list(self._overlay, self._base, keys)

    def get_many_packed(self, keys: PackedList) -> bytes:
        """The values of the keys of a packed list, as a packed optional list (None: absent), built
        straight from the maps without a Python list of values."""
        self._check_updating("get from")
        return _overlay.get_packed(self._overlay, self._base, keys.buf, keys.offset)

    def scan(self, prefix: bytes = b"") -> Iterator[tuple[bytes, bytes]]:
        """Every (key, value) whose key starts with ``prefix``, this version's changes included.

        It looks at every key of the store (the map is hashed, not sorted): O(state).
        """
        self._check_updating("scan")
        prefix = bytes(prefix)
        overlay, base = self._overlay, self._base
        found = [(k, v) for k, v in base.items() if k.startswith(prefix) and k not in overlay]
        found.extend((k, v) for k, v in overlay.items() if v is not None and k.startswith(prefix))
        return iter(found)

    def items(self) -> Iterator[tuple[bytes, bytes]]:
        return self.scan(b"")

    def __len__(self) -> int:
        self._check_updating("count")
        n = len(self._base)
        base = self._base
        for k, v in self._overlay.items():
            if k in base:
                n -= v is None
            else:
                n += v is not None
        return n

    # --- writes -------------------------------------------------------------------------------------
    def _set(self, key: bytes, value: bytes | None) -> None:
        overlay = self._overlay
        old = overlay.get(key, ...)
        if old is not ...:
            self._overlay_bytes -= _entry_bytes(key, old)
        overlay[key] = value
        self._overlay_bytes += _entry_bytes(key, value)

    def put(self, key: bytes, value: bytes) -> None:
        self._check_updating("put to")
        self._set(_check_key(key), _check_value(value))

    def put_many(self, items: Iterable[tuple[bytes, bytes]]) -> None:
        """Put every (key, value); all are checked before any is applied.

        ``items`` may be a ``packed.PackedPairs`` (a request payload): it is read straight into the overlay.
        """
        self._check_updating("put to")
        if type(items) is PackedPairs:
            self._overlay_bytes += _overlay.put_packed(self._overlay, items.buf, items.offset, KEY_GROUP_BYTES,
                                                       ENTRY_OVERHEAD)[1]
        else:
            self._overlay_bytes += _overlay.put_items(self._overlay, items, KEY_GROUP_BYTES, ENTRY_OVERHEAD)

    def remove(self, key: bytes) -> None:
        self._check_updating("remove from")
        self._set(_check_key(key), None)

    def remove_many(self, keys: Iterable[bytes]) -> None:
        """Remove every key (a tombstone each); all are checked before any is applied."""
        self._check_updating("remove from")
        if type(keys) is PackedList:
            self._overlay_bytes += _overlay.remove_packed(self._overlay, keys.buf, keys.offset, KEY_GROUP_BYTES,
                                                          ENTRY_OVERHEAD)[1]
        else:
            self._overlay_bytes += _overlay.remove_keys(self._overlay, keys, KEY_GROUP_BYTES, ENTRY_OVERHEAD)

    # --- ending the version -----------------------------------------------------------------------
    def prepare_commit(self, ckptid: str | None = None) -> CheckpointRef:
        """What ``commit(ckptid)`` will make, checked now: the new state's ref (its checkpoint id
        fresh when None). Raises what ``commit`` would; once it returned, ``commit(ref.ckptid)``
        only applies the changes (O(changed keys)) and cannot fail on what it was given."""
        return self._check_updating("commit")._child(ckptid)

    def upload_bound(self) -> int:
        """An upper bound of the upload queue bytes (``Delta.nbytes`` + 256) its commit will count:
        the changes' keys and values + 8 each (a removal of a missing key is counted, then dropped)."""
        return self._change_bytes() + 256

    def _change_bytes(self) -> int:
        return self._overlay_bytes - (ENTRY_OVERHEAD - 8) * len(self._overlay)

    def commit(self, ckptid: str | None = None, *, defer: bool = False) -> Delta:
        """Make the changes version ``version + 1`` (checkpoint ``ckptid``, fresh when None).

        Costs O(changed keys). Returns the ``Delta`` to persist. With ``defer`` the version is
        committed (head, lineage, history) but its changes reach the map only later, in
        ``VersionedStore.apply_pending`` — called by the owner when idle, and by every read of the
        store or of the delta's records before that — so the commit itself costs O(1).
        """
        store = self._check_updating("commit")
        delta = store._commit(self._overlay, ckptid, defer, self._change_bytes() if defer else 0)
        self._result = delta
        self._finished(State.COMMITTED)
        return delta

    def abort(self) -> None:
        """Drop the changes; the store stays at the version it was opened at. Idempotent."""
        if self.state is State.ABORTED:
            return
        self._check_updating("abort")
        self._finished(State.ABORTED)

    @property
    def result(self) -> Delta | None:
        """The delta of a committed version."""
        return self._result
