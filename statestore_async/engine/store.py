"""The versioned key-value engine: no IO, no asyncio, no wire format
(docs/ARCHITECTURE.md, "The engine").

A ``VersionedStore`` holds the committed map of one store at its head ``(version, ckptid)``.
``open(version)`` hands out a ``StoreVersion``: an overlay (changed keys and tombstones) over the
committed map, so ``put``/``remove`` cost O(1) and the committed map is never copied.

Both the committed map and every overlay are ``engine.table.Table``s: keys and values live in one
arena per table, with no Python object per record (about 1.7× the raw bytes of small records, where
a ``dict`` of bytes took ~9×), and ordered scans cost O(log n + matches).
``commit()`` applies the overlay in O(changed keys), keeps the pre-images as an undo log, and
returns the ``Delta`` to persist. ``abort()`` drops the overlay.

Recent commits stay in memory as (undo, redo) pairs, so a retry that opens an earlier version (or
another attempt's checkpoint of it) is served by rolling back and forward in O(changes), without
reading any file. Keys are bytes in the layout of ``statestore_async.codecs.keylayout``; values are bytes.

A ``StoreVersion`` is single-use: UPDATING → COMMITTED | ABORTED, checked on every call. At most
one is UPDATING per store (one writer per store and version).

**State larger than memory.** ``VersionedStore.spill(cold)`` hands the committed map of an idle
store to a *cold level* (``ColdLevel``: in the daemon a ``files.coldrun.ColdRun``, the store's
snapshot file on local disk read a block at a time) that holds exactly the head state; the map in
memory becomes a *hot* table of what changed since. In the hot table a
tombstone entry hides a key the cold level still has. Reads look at the overlay, then the hot
table, then the cold level; ordered reads merge the three. A spilled store's commits are blind
writes (only a removal asks the cold level whether its key exists) and keep no undo/redo history:
a retry of an earlier version loads it from files. The engine does no IO: the cold level does.

**The write buffer.** An open version's changes are its overlay, in memory. When the daemon is
over its memory budget, ``StoreVersion.flush(write_run, stack)`` hands the overlay of a version of
a spilled store whose hot part is empty to ``write_run`` (the daemon writes it in key order to a
file on local disk, tombstones included: a ``FlushedRun``) and starts a new, empty overlay; the
version then reads overlay, flushed runs (newest first), cold level. Its commit does not bring the
runs back into memory: ``stack`` puts them over the cold level as the newest runs, only the
changes made after the last flush go to the hot part, and the ``Delta`` names the runs
(``Delta.runs``; ``Delta.entries`` merges them with the rest in key order for the delta file).
Such a commit keeps no undo and no complete redo: a retry of an earlier version, or a spill onto a
snapshot older than it, goes through files.
"""
from __future__ import annotations

import enum
import functools
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeAlias, TypeVar, cast

from statestore_async.codecs.keylayout import KEY_GROUP_BYTES
from statestore_async.engine import table as _table
from statestore_async.engine.delta import Delta, table_of
from statestore_async.engine.levels import (
    ColdLevel,
    FlushedRun,
    StackRuns,
    WriteRun,
    merge_entries,
    merge_lazy,
    merge_ordered,
    prefix_stop,
)
from statestore_async.engine.lookup import KeyLookup
from statestore_async.engine.table import Table
from statestore_async.engine.views import FrozenView
from statestore_async.errors import (
    InterfaceError,
    StoreBrokenError,
    StoreStateError,
    VersionNotFoundError,
    WriterConflictError,
)
from statestore_async.ids import EMPTY_STATE, CheckpointRef, StoreId, new_checkpoint_id

T = TypeVar("T")

DEFAULT_HISTORY = 4
# commits a spilled store keeps (redo only; more while a state is pinned for a spill, see
# pin_history): what stacking the durable deltas leaves in memory, the commits still uploading
SPILLED_HISTORY = 2
# Refs a commit's lineage names at most (a delta file's header carries it); see _lineage_tail.
MAX_LINEAGE = 1000

# key -> value, or None for a removed key (a tombstone): what a caller may pass as changes
Changes: TypeAlias = Mapping[bytes, bytes | None]


class State(enum.Enum):
    UPDATING = "UPDATING"
    COMMITTED = "COMMITTED"
    ABORTED = "ABORTED"


@dataclass
class _Commit:
    parent: CheckpointRef
    child: CheckpointRef
    child_lineage: tuple[CheckpointRef, ...]
    # both None until the commit's changes are applied (a deferred commit: VersionedStore.apply_pending)
    undo: Table | None  # key -> value before the commit (None: absent), for each key of ``redo``
    redo: Table | None  # key -> value after the commit (None: removed)
    flushed: bool = False  # the version flushed: ``redo`` lacks the changes its runs hold

    @property
    def nbytes(self) -> int:
        return (self.undo.nbytes if self.undo is not None else 0) + (self.redo.nbytes if self.redo is not None else 0)


class VersionedStore:
    """The committed state of one store plus a short history of recent commits."""

    def __init__(
        self,
        store_id: StoreId,
        data: Table | Mapping[bytes, bytes] | None = None,
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
        if data is None:
            data = Table()
        elif not isinstance(data, Table):
            data = table_of(data)
        self._data: Table = data  # the committed map; once spilled, the hot part over ``_cold``
        self._cold: ColdLevel | None = None
        self._pinned: CheckpointRef | None = None  # see pin_history
        self._head = head
        self._lineage = tuple(lineage)
        self._history_limit = history
        self._history: list[_Commit] = []
        self._snapshots: set[CheckpointRef] = {head} if (head_has_snapshot or head.version == 0) else set()
        self._writer: StoreVersion | None = None
        self._views: list[FrozenView] = []
        # a deferred commit whose changes are not in the map yet: (changes, its _Commit, its Delta)
        self._pending: tuple[Table, _Commit, Delta] | None = None
        # set when changes failed part-way in the map (``_mutating``): what failed; the store then
        # refuses everything (``StoreBrokenError``) and its owner drops it
        self._broken: str | None = None
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
        if self._cold is None:
            return len(self._data)
        return sum(1 for _ in self.items())

    @property
    def memory_bytes(self) -> int:
        """Approximate bytes held: committed map (once spilled: its hot part and the cold level's
        index), open overlay and the undo/redo history (a broken store's: as they are)."""
        self._settle()
        total = self._data.nbytes + sum(c.nbytes for c in self._history)
        if self._cold is not None:
            total += self._cold.nbytes
        if self._writer is not None:
            total += self._writer.memory_bytes
        return total

    # --- the cold level ---------------------------------------------------------------------------
    @classmethod
    def over_cold(cls, store_id: StoreId, cold: ColdLevel, changes: Table, head: CheckpointRef,
                  lineage: Sequence[CheckpointRef], *, history: int = DEFAULT_HISTORY,
                  snapshot: CheckpointRef | None = None) -> VersionedStore:
        """A store at ``head``, spilled onto ``cold`` (a state on ``head``'s lineage, or ``head``
        itself) with ``changes`` (key → value | None, the changes since ``cold.ref``) in memory:
        what a load from a local snapshot file and the deltas after it makes. ``snapshot``: the
        newest state known to have a snapshot file (default ``cold.ref``; a cold level of delta
        runs over a snapshot holds a state that has none)."""
        store = cls(store_id, head=cold.ref, head_has_snapshot=True, history=history)
        if snapshot is not None and snapshot != cold.ref:
            store._snapshots = {snapshot}
        store.spill(cold)
        if len(changes):
            store._mutate(changes)
        store._head, store._lineage = head, tuple(lineage)
        return store

    @property
    def cold(self) -> ColdLevel | None:
        """The cold level under the hot map, once spilled (None: the whole map is in memory)."""
        return self._cold

    @property
    def hot_records(self) -> int:
        """Entries of the committed map in memory (once spilled: of its hot part, tombstones included)."""
        self._settle()
        return len(self._data)

    @property
    def hot_bytes(self) -> int:
        """Memory the committed map takes (the hot part, once spilled)."""
        self._settle()
        return self._data.nbytes

    def spill(self, cold: ColdLevel) -> int:
        """Hand the committed map to ``cold``, which must hold the head state or one of the recent
        history (a snapshot finished after later commits): the map in memory starts over with the
        changes since that state (none for the head), and the history of recent commits goes
        (its tables are as large as the commits: a retry of an earlier version now loads it from
        files). A version open for update reads on through the new hot part and the cold level (it
        was opened on the head, which the spill does not change). Returns the bytes freed."""
        self.apply_pending()
        since = self._commits_since(cold.ref)
        if since is None:
            raise InterfaceError(f"store {self.store_id}: the cold level holds {cold.ref}, which is neither the "
                                 f"head {self._head} nor a state of the recent history")
        hot = Table()
        for c in since:  # the changes since the cold state, oldest first; a removal stays a tombstone entry
            assert c.redo is not None  # applied: apply_pending ran
            for k, v in c.redo.items():
                hot.put(k, v)
        writer = self._writer
        if writer is not None and writer._runs and len(hot):
            raise InterfaceError(f"store {self.store_id}: the open version flushed runs over an empty hot part; "
                                 f"a spill onto {cold.ref} would put older changes above them")
        freed = self._data.nbytes + sum(c.nbytes for c in self._history) - hot.nbytes
        self._data = hot
        self._history = []
        self._pinned = None
        self._cold = cold
        if writer is not None:
            writer._base, writer._cold = hot, cold
        return freed

    def pin_history(self, ref: CheckpointRef | None) -> None:
        """Keep every commit made after ``ref`` (the head now) in the history until the store
        spills or ``pin_history(None)``: a spill onto the snapshot of ``ref``, written meanwhile,
        then rebuilds the hot part from them however many commits came in between."""
        self._pinned = ref

    def _commits_since(self, ref: CheckpointRef) -> list[_Commit] | None:
        """The history's commits from ``ref`` to the head, oldest first (None: ``ref`` is not on
        the head's line within the history)."""
        by_child = {c.child: c for c in self._history}
        out: list[_Commit] = []
        at = self._head
        while at != ref:
            c = by_child.get(at)
            if c is None or c.flushed:  # flushed: its redo lacks what its runs hold
                return None
            out.append(c)
            at = c.parent
        out.reverse()
        return out

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
        if self._cold is None or key in self._data:
            return self._data.get(key)
        return self._cold.get(key)

    def items(self) -> Iterator[tuple[bytes, bytes]]:
        """The committed records at the head, in key order (do not commit while iterating; use freeze())."""
        self.apply_pending()
        if self._cold is None:
            return self._data.items()  # type: ignore[return-value]  # a committed table holds no tombstone
        return merge_lazy(self._data.items(), self._cold.items())

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
        while ref in by_child and by_child[ref].undo is not None:  # no undo: made while spilled
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
            assert c.undo is not None  # applied: open() applies a pending commit first
            self._mutating(f"undoing the commit of {c.child}", functools.partial(self._mutate, c.undo))
            self._head, self._lineage = c.parent, self._lineage_of(c.parent)
        for c in redo:
            assert c.redo is not None  # applied: open() applies a pending commit first
            self._mutating(f"redoing the commit of {c.child}", functools.partial(self._mutate, c.redo))
            self._head, self._lineage = c.child, c.child_lineage

    @property
    def broken(self) -> str | None:
        """What failed part-way in the map, or None: a broken store refuses everything
        (``StoreBrokenError``)."""
        return self._broken

    def _mutating(self, what: str, change: Callable[[], T]) -> T:
        """``change()``, which changes the map in place; should it fail part-way (the arena or the
        index cannot grow), the map is neither state: the store is marked broken, and this and every
        later call raise ``StoreBrokenError`` (the original error is its cause)."""
        try:
            return change()
        except BaseException as exc:
            self._broken = f"{what} failed part-way ({type(exc).__name__}: {exc})"
            if not isinstance(exc, Exception):
                raise  # KeyboardInterrupt and the like: as they are (the store stays broken)
            raise self._broken_error() from exc

    def _broken_error(self) -> StoreBrokenError:
        return StoreBrokenError(
            f"store {self.store_id} is broken in memory: {self._broken}; its map is neither state. Nothing more is "
            "served from it: open a version a manifest names again (a daemon drops the store and loads it from "
            "its files); the version whose changes failed is not durable")

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

    def _mutate(self, changes: Table) -> tuple[Table, Table]:
        """Apply key → value|None to the map in one pass (``table.apply``; frozen views keep
        seeing what they froze). Returns (the changes that changed something, their pre-images).

        Spilled, writes are blind: a put goes to the hot map without reading the cold level (a
        spilled store keeps no undo history, so the pre-images returned are those of the hot map
        only, and are not kept); a removal of a key the hot map lacks asks the cold level whether
        the key exists, and if so leaves a tombstone entry hiding it."""
        cold = self._cold
        if cold is None:
            return _table.apply(self._data, changes)
        hot = self._data
        missing: list[bytes] = []  # removals of keys the hot map lacks: maybe in the cold level
        gone: list[bytes] = []  # removals of keys the hot map already hides: no change at all
        for k, v in changes.items():
            if v is not None:
                continue
            if k not in hot:
                missing.append(k)
            elif hot.get(k) is None:
                gone.append(k)
        if gone:
            dropped = set(gone)
            changes = table_of((k, v) for k, v in changes.items() if k not in dropped)
        if missing:
            for k, v in zip(missing, cold.get_many(missing)):
                if v is not None:
                    hot.put(k, v)
        applied, undo = _table.apply(hot, changes)
        removed = [k for k, v in applied.items() if v is None]
        if removed:
            for k, v in zip(removed, cold.get_many(removed)):
                if v is not None:
                    hot.put(k, None)
        return applied, undo

    def _child(self, ckptid: str | None) -> CheckpointRef:
        """The state a commit on the head makes (a fresh checkpoint id when None), checked new."""
        child = CheckpointRef(self._head.version + 1, ckptid or new_checkpoint_id())
        if any(c.child == child for c in self._history):
            raise InterfaceError(f"checkpoint {child} was committed already")
        return child

    def _commit(self, overlay: Table, ckptid: str | None, defer: bool = False, bound: int = 0,
                runs: Sequence[FlushedRun] = (), stack: StackRuns | None = None, run_bytes: int = 0) -> Delta:
        self.apply_pending()
        parent = self._head
        child = self._child(ckptid)
        lineage = (parent,) + self._lineage_tail()
        commit = _Commit(parent, child, lineage, None, None, flushed=bool(runs))
        delta_runs: tuple[FlushedRun, ...] = ()
        if runs:
            # the runs go over the cold level as they are (StoreVersion.flush made sure the hot
            # part is empty, so nothing older sits above them); the delta reads them through
            # handles of its own, which a later spill closing the cold level leaves open
            cold = self._cold
            assert stack is not None and cold is not None and not len(self._data)
            delta_runs = tuple(run.reopen() for run in runs)
            self._cold = stack(runs, cold, child)
        self._history.append(commit)
        # spilled, the history only serves a spill onto a snapshot behind the head:
        # a pinned state (a snapshot being written for a spill) keeps every commit since
        limit = self._history_limit if self._cold is None else min(self._history_limit, SPILLED_HISTORY)
        if self._pinned is not None:
            since = self._commits_since(self._pinned)  # from the parent: the new commit not yet counted
            if since is None:
                self._pinned = None
            else:
                limit = max(limit, len(since) + 1)
        if len(self._history) > limit:
            del self._history[: len(self._history) - limit]
        self._head, self._lineage = child, lineage
        if defer:
            delta = Delta(self.store_id, child, lineage, None, bound, self, delta_runs)
            self._pending = (overlay, commit, delta)
            return delta
        records = self._mutating(f"applying the commit of {child}", lambda: self._apply(overlay, commit))
        return Delta(self.store_id, child, lineage, records, _upload_bytes(records) + run_bytes, runs=delta_runs)

    def _apply(self, overlay: Table, commit: _Commit) -> Table:
        # a tombstone for a key that did not exist changes nothing: apply leaves it out
        records, undo = self._mutate(overlay)
        # spilled: the pre-images were not read from the cold level, so there is no undo (a retry
        # of an earlier version loads it from files); the redo is kept (a later spill onto a
        # snapshot older than the head rebuilds the hot part from it)
        commit.undo, commit.redo = (undo if self._cold is None else None), records
        return records

    def _settle(self) -> None:
        """``apply_pending`` for the memory accounting, which never raises: a store that is broken,
        or breaks here, is counted as it is (its owner drops it: see ``broken``)."""
        if self._broken is None:
            try:
                self.apply_pending()
            except StoreBrokenError:
                pass

    def apply_pending(self) -> None:
        """Apply a deferred commit's changes to the map, if one waits (see ``StoreVersion.commit``).

        Every method that reads the map or the history calls it first, so a deferred commit is
        never seen half done; a caller may also call it when it is idle. Idempotent."""
        if self._broken is not None:
            raise self._broken_error()
        pending = self._pending
        if pending is None:
            return
        self._pending = None
        overlay, commit, delta = pending
        records = self._mutating(f"applying the deferred commit of {commit.child}", lambda: self._apply(overlay, commit))
        object.__setattr__(delta, "_records", records)
        object.__setattr__(delta, "_store", None)  # applied: the delta no longer keeps the store alive


def _upload_bytes(records: Table) -> int:
    """What the upload queue counts for a delta of ``records``: keys and values, + 8 each."""
    return records.record_bytes + 8 * len(records)


class StoreVersion:
    """One writer's open version: reads see the overlay first, then the committed map."""

    __slots__ = ("_base", "_cold", "_overlay", "_result", "_run_bytes", "_runs", "_stack", "_store", "parent",
                 "state", "store_id")

    def __init__(self, store: VersionedStore):
        # None and empty once the version is committed or aborted: a finished version someone
        # keeps (a connection's handle, a caller's variable) holds neither the store nor its map.
        self._store: VersionedStore | None = store
        self._base: Table = store._data
        self._cold: ColdLevel | None = store._cold
        self.store_id = store.store_id
        self._overlay = Table()
        self._runs: list[FlushedRun] = []  # flushed changes, newest first (see flush)
        self._run_bytes = 0  # the upload bytes (keys, values, + 8 each) of the flushed changes
        self._stack: StackRuns | None = None
        self.state = State.UPDATING
        self.parent = store.head
        self._result: Delta | None = None

    @property
    def version(self) -> int:
        """The committed version this update started from."""
        return self.parent.version

    @property
    def num_changes(self) -> int:
        """Entries of the changes: the overlay's and the flushed runs' (a key changed again after
        a flush counts twice)."""
        return len(self._overlay) + sum(len(run) for run in self._runs)

    @property
    def memory_bytes(self) -> int:
        """What the version holds in memory: its overlay and its runs' indexes."""
        return self._overlay.nbytes + sum(run.nbytes for run in self._runs)

    @property
    def overlay_bytes(self) -> int:
        """What a flush would move out of memory."""
        return self._overlay.nbytes

    @property
    def flushed_runs(self) -> int:
        return len(self._runs)

    @property
    def flushable(self) -> bool:
        """Whether ``flush`` may run: the store is spilled and its hot part is empty (a flushed run
        sits between the overlay and the committed state: nothing committed may be above it)."""
        return self.state is State.UPDATING and self._cold is not None and not len(self._base)

    def flush(self, write_run: WriteRun, stack: StackRuns) -> int:
        """Move the overlay out of memory: ``write_run(overlay)`` writes it (key order, tombstones
        kept) and returns the run reading it; the version starts a new overlay and reads the runs
        between it and the committed state. ``stack`` is what the commit will use to put the runs
        over the cold level (see the module doc). Only when ``flushable``
        (``InterfaceError`` otherwise). Returns the bytes freed (0: nothing to flush)."""
        self._check_updating("flush")
        if not self.flushable:
            raise InterfaceError(f"store {self.store_id} version {self.version}: only a version of a spilled store "
                                 "whose hot part is empty can flush its changes")
        overlay = self._overlay
        if not len(overlay):
            return 0
        before = overlay.nbytes
        run = write_run(overlay)
        self._runs.insert(0, run)
        self._run_bytes += _upload_bytes(overlay)
        self._stack = stack
        self._overlay = Table()
        return max(0, before - run.nbytes)

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
        self._overlay = self._base = _EMPTY
        self._cold = None
        self._store = None
        runs, self._runs = self._runs, []
        if state is State.ABORTED:
            for run in runs:  # committed, they belong to the store's cold level
                run.close()
        if store is not None:
            store._writer = None

    # --- reads --------------------------------------------------------------------------------------
    def get(self, key: bytes) -> bytes | None:
        self._check_updating("get from")
        if self._runs:
            return self.get_many((key,))[0]
        if key in self._overlay:
            return self._overlay.get(key)
        if self._cold is None or key in self._base:
            return self._base.get(key)
        return self._cold.get(key)

    def get_many(self, keys: Iterable[bytes]) -> list[bytes | None]:
        self._check_updating("get from")
        if self._cold is None:
            return _table.get_list(self._overlay, self._base, keys)
        return cast("list[bytes | None]", self._look_up(KeyLookup.of(list(keys))).values())

    def memory_tables(self) -> tuple[Table, Table] | None:
        """(this version's changes, the committed table) when the version reads from memory alone,
        for a batch routine that reads both at once (the daemon's GET_MANY: ``daemon.payloads``),
        without a Python object per key or value; None once its store is spilled (then
        ``look_up``). The tables are read, never changed."""
        self._check_updating("get from")
        if self._cold is None:
            return self._overlay, self._base
        return None

    def look_up(self, lookup: KeyLookup) -> KeyLookup:
        """Find the keys of ``lookup`` (``engine.lookup``: keys read in place, values gathered in
        chunks, no Python object per key or value); ``lookup`` itself, filled."""
        self._check_updating("get from")
        if self._cold is None:
            lookup.from_table(self._overlay, lookup.all())
            lookup.from_table(self._base, lookup.pending(lookup.all()))
            return lookup
        return self._look_up(lookup)

    def _look_up(self, lookup: KeyLookup) -> KeyLookup:
        """A spilled version's read, level by level: the changes, then the flushed runs newest first
        or the hot part, then the cold level, each asked for the keys no newer level has an entry
        for."""
        cold = self._cold
        assert cold is not None
        js = lookup.all()
        for level in (self._overlay, self._base):  # the hot part is empty while runs are flushed
            if len(level) and len(js):
                lookup.from_table(level, js)
                js = lookup.pending(js)
        for run in self._runs:
            if not len(js):
                break
            run.lookup_into(lookup, js)
            js = lookup.pending(js)
        if len(js):
            cold.lookup_into(lookup, js)
        return lookup

    def _committed(self, start: bytes, stop: bytes | None) -> Iterator[tuple[bytes, bytes | None]]:
        """The committed records with ``start <= key < stop`` in key order (hot over cold)."""
        if self._cold is None:
            return self._base.items(start, stop)
        return merge_lazy(self._base.items(start, stop), self._cold.items(start, stop))

    def _changes(self, start: bytes, stop: bytes | None) -> Iterator[tuple[bytes, bytes | None]]:
        """This version's changes with ``start <= key < stop`` in key order. An empty change table
        is not asked: its first ordered read would give it an order index, which every later put
        of the version then keeps sorted (a batch that scans its due timers before writing)."""
        changes = self._overlay.items(start, stop) if len(self._overlay) else iter(())
        if not self._runs:
            return changes
        return merge_entries([changes, *(run.entries(start, stop) for run in self._runs)])

    def scan(self, prefix: bytes = b"") -> Iterator[tuple[bytes, bytes]]:
        """Every (key, value) whose key starts with ``prefix``, this version's changes included, in
        key order. Costs O(log n + matches) (the tables keep an order index once scanned)."""
        self._check_updating("scan")
        prefix = bytes(prefix)
        if self._cold is None:
            return merge_ordered(self._overlay.scan(prefix) if len(self._overlay) else [], self._base.scan(prefix))
        stop = prefix_stop(prefix)
        return merge_lazy(self._changes(prefix, stop), self._committed(prefix, stop))

    def items(self) -> Iterator[tuple[bytes, bytes]]:
        return self.scan(b"")

    def scan_range(self, start: bytes, stop: bytes | None = None,
                   limit: int | None = None) -> list[tuple[bytes, bytes]]:
        """Every (key, value) with ``start <= key < stop`` (``stop`` None: no upper bound), this
        version's changes included, in key order; at most ``limit`` of them (None: all). Costs
        O(log n + returned + this version's removals in the range): the tables' ordered ``items``
        are merged lazily and stop at the limit."""
        self._check_updating("scan")
        if limit is not None and (type(limit) is not int or limit < 0):
            raise InterfaceError(f"scan_range: limit must be None or an int >= 0, got {limit!r}")
        start = bytes(start)
        stop = None if stop is None else bytes(stop)
        if limit == 0 or (stop is not None and stop <= start):
            return []
        merged = merge_lazy(self._changes(start, stop), self._committed(start, stop))
        return list(merged if limit is None else itertools.islice(merged, limit))

    def scan_ranges(self, ranges: Iterable[tuple[bytes, bytes | None]],
                    limit: int | None = None) -> list[tuple[bytes, bytes]]:
        """``scan_range`` of each of ``ranges`` (ascending and disjoint, as the protocol checks
        them), concatenated. A version with no change yet, no flushed run and no cold level (a
        task's first scan, of its due timers: one range per key group and kind) reads them all in
        one call into its table."""
        self._check_updating("scan")
        if limit is None and self._cold is None and not self._runs and not len(self._overlay):
            return cast("list[tuple[bytes, bytes]]", self._base.ranges(ranges))  # a committed table has no tombstone
        out: list[tuple[bytes, bytes]] = []
        for start, stop in ranges:
            out += self.scan_range(start, stop, limit)
        return out

    def __len__(self) -> int:
        self._check_updating("count")
        if self._cold is not None:
            return sum(1 for _ in self.scan(b""))
        base = self._base
        n = len(base)
        for k, v in self._overlay.items():
            if k in base:
                n -= v is None
            else:
                n += v is not None
        return n

    # --- writes -------------------------------------------------------------------------------------
    def put(self, key: bytes, value: bytes) -> None:
        self._check_updating("put to")
        _table.put_items(self._overlay, ((key, value),), KEY_GROUP_BYTES)

    def put_many(self, items: Iterable[tuple[bytes, bytes]]) -> None:
        """Put every (key, value); all are checked before any is applied."""
        self._check_updating("put to")
        _table.put_items(self._overlay, items, KEY_GROUP_BYTES)

    def remove(self, key: bytes) -> None:
        self._check_updating("remove from")
        _table.remove_keys(self._overlay, (key,), KEY_GROUP_BYTES)

    def remove_many(self, keys: Iterable[bytes]) -> None:
        """Remove every key (a tombstone each); all are checked before any is applied."""
        self._check_updating("remove from")
        _table.remove_keys(self._overlay, keys, KEY_GROUP_BYTES)

    def write_batch(self, write: Callable[[Table], int], op: str) -> int:
        """Changes set by a batch routine straight into this version's change table:
        ``write(changes)`` puts (or removes: a tombstone entry) keys of at least ``KEY_GROUP_BYTES``
        bytes, checks everything it is given before it sets anything, and returns a count, which
        this returns. ``op`` names the request in the error of a finished version ("put to",
        "remove from"). The daemon reads a request's payload in this way, with no copy
        (``daemon.payloads``)."""
        self._check_updating(op)
        return write(self._overlay)

    # --- ending the version -----------------------------------------------------------------------
    def prepare_commit(self, ckptid: str | None = None) -> CheckpointRef:
        """What ``commit(ckptid)`` will make, checked now: the new state's ref (its checkpoint id
        fresh when None). Raises what ``commit`` would; once it returned, ``commit(ref.ckptid)``
        only applies the changes (O(changed keys)) and cannot fail on what it was given."""
        return self._check_updating("commit")._child(ckptid)

    def upload_bound(self) -> int:
        """An upper bound of the upload queue bytes (``Delta.nbytes`` + 256) its commit will count:
        the changes' keys and values + 8 each (a removal of a missing key is counted, then dropped)."""
        return _upload_bytes(self._overlay) + self._queued_run_bytes + 256

    @property
    def _queued_run_bytes(self) -> int:
        # what the upload queue holds of the flushed changes: not the changes (they are on disk)
        # but the delta file encoded from them, compressed (counted as a quarter of their bytes)
        return self._run_bytes // 4

    def commit(self, ckptid: str | None = None, *, defer: bool = False) -> Delta:
        """Make the changes version ``version + 1`` (checkpoint ``ckptid``, fresh when None).

        Costs O(changed keys). Returns the ``Delta`` to persist. With ``defer`` the version is
        committed (head, lineage, history) but its changes reach the map only later, in
        ``VersionedStore.apply_pending`` — called by the owner when idle, and by every read of the
        store or of the delta's records before that — so the commit itself costs O(1).
        """
        store = self._check_updating("commit")
        bound = _upload_bytes(self._overlay) + self._queued_run_bytes if defer else 0
        try:
            delta = store._commit(self._overlay, ckptid, defer, bound, self._runs, self._stack, self._queued_run_bytes)
        except StoreBrokenError:
            self._finished(State.ABORTED)  # the store refuses everything now: free its writer slot
            raise
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


# what a finished StoreVersion reads from (never: its state checks come first); none of the store's
_EMPTY = Table()
