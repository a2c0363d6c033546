"""Timers: a per-key processor's ``Timers`` (bound to the current key, like the state variables),
``ExpiredTimer`` (what ``handle_expired_timer`` gets), and a vectorized processor's
``VectorizedTimers`` (arrays of key indexes and times). Their store records are laid out by
``state.keys``; the task finds the due ones (``spark.task.timers``).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from statestore_async.errors import InterfaceError
from statestore_async.state.keys import EVENT, KIND_BYTE, KIND_OF, PROCESSING, check_time, timer_record_columns

_MIN_MS, _MAX_MS = -(1 << 63), (1 << 63) - 1  # ``check_time``'s range


@dataclass(frozen=True)
class ExpiredTimer:
    """A due timer, as ``handle_expired_timer`` gets it: its time (ms since the epoch) and kind
    (``"processing"`` or ``"event"``)."""

    at_ms: int
    kind: str


class Timers:
    """The current key's timers (``handle.timers`` / ``state.timers``; the runtime binds it like the
    state variables). Registering a timer that exists, or deleting one that does not, does nothing.

    ``kind`` None is the operator's ``time_mode``; with ``time_mode="none"`` give it explicitly.
    Processing-time timers are due when ``at_ms <= handle.processing_time_ms``, event-time timers
    when ``at_ms <= handle.watermark_ms``.
    """

    def __init__(self, time_mode: str = "none", enabled: bool = False):
        self.time_mode = time_mode
        self.enabled = enabled
        self.key_index = -1
        # (key index, kind byte, at_ms) -> True registered / False deleted, by this batch: one flat map,
        # read as columns at the batch's end (``TaskTime.timer_changes``)
        self.batch_changes: dict[tuple[int, int, int], bool] = {}
        # key index -> the (kind byte, at_ms) it changed, for ``list``: made by its first call, then kept
        self._per_key: dict[int, list[tuple[int, int]]] | None = None
        self._existing: dict[int, set[tuple[str, int]]] | None = None  # key index -> stored timers (lazy)
        self.load_timers: Callable[[], dict[int, set[tuple[str, int]]]] | None = None
        # the runtime's: up to which time each kind (byte) is due in this batch, and (key index, kind
        # byte, at_ms) of every timer registered at a due time (the ones that may fire after the rows)
        self.due_by: dict[int, int] = {}
        self.registered_due: list[tuple[int, int, int]] = []
        # a timer of the time mode needs no checks but its time's (``register``/``delete``'s fast path)
        self._default_ok = enabled and time_mode in (PROCESSING, EVENT)
        self._default_kind = KIND_BYTE.get(time_mode, 0)

    def _kind(self, kind: str | None) -> str:
        if not self.enabled:
            raise InterfaceError("timers need a processor that defines handle_expired_timer(self, key, timer, state): "
                                 "define it to receive the timers it registers")
        if self.key_index < 0:
            raise InterfaceError("timers are used outside handle_rows / handle_expired_timer (no current key)")
        if kind is None:
            if self.time_mode == "none":
                raise InterfaceError('the operator has time_mode="none": give the timer\'s kind ("processing" or '
                                     '"event"), or create the StatefulOperator with time_mode=')
            return self.time_mode
        if kind not in (PROCESSING, EVENT):
            raise InterfaceError(f'a timer\'s kind is "processing" or "event" (None: the time mode), got {kind!r}')
        return kind

    def _set(self, at_ms: int, kind: str | None, on: bool) -> None:
        i = self.key_index
        if kind is None and self._default_ok and i >= 0 and type(at_ms) is int and _MIN_MS <= at_ms <= _MAX_MS:
            kb = self._default_kind  # the common call, checked inline: the same outcome as the checks below
        else:
            kb = KIND_BYTE[self._kind(kind)]
            at_ms = check_time(at_ms)
        self._record(i, kb, at_ms, on)
        if on:
            lim = self.due_by.get(kb)
            if lim is not None and at_ms <= lim:
                self.registered_due.append((i, kb, at_ms))

    def _record(self, i: int, kb: int, at_ms: int, on: bool) -> None:
        key = (i, kb, at_ms)
        if self._per_key is not None and key not in self.batch_changes:
            self._per_key.setdefault(i, []).append((kb, at_ms))
        self.batch_changes[key] = on

    def fire(self, i: int, kind: str, at_ms: int) -> None:
        """The runtime's: key ``i``'s timer fires now (gone before its callback runs)."""
        self._record(i, KIND_BYTE[kind], at_ms, False)

    def end_batch(self) -> None:
        """Forget the batch (the processor keeps its handle, and so these timers, until its next task)."""
        self.batch_changes, self._per_key, self._existing, self.load_timers, self.registered_due = {}, None, None, None, []
        self.key_index = -1

    def register(self, at_ms: int, kind: str | None = None) -> None:
        """A timer for the current key at ``at_ms`` (ms since the epoch)."""
        self._set(at_ms, kind, True)

    def delete(self, at_ms: int, kind: str | None = None) -> None:
        """Remove the current key's timer at ``at_ms`` (nothing when there is none)."""
        self._set(at_ms, kind, False)

    def list(self, kind: str | None = None) -> list[int]:
        """The times of the current key's timers of ``kind``, ascending."""
        k = self._kind(kind)
        i = self.key_index
        if self._existing is None:
            self._existing = self.load_timers() if self.load_timers is not None else {}
        if self._per_key is None:
            per_key: dict[int, list[tuple[int, int]]] = {}
            for j, kb, at in self.batch_changes:
                per_key.setdefault(j, []).append((kb, at))
            self._per_key = per_key
        have = {at for kk, at in self._existing.get(i, ()) if kk == k}
        want = KIND_BYTE[k]
        changes = self.batch_changes
        for kb, at in self._per_key.get(i, ()):
            if kb == want:
                if changes[(i, kb, at)]:
                    have.add(at)
                else:
                    have.discard(at)
        return sorted(have)


class VectorizedTimers:
    """A ``VectorizedProcessor``'s timers, in bulk (``self.timers`` during ``process`` and
    ``handle_expired_timers``). Keys are named by their index into the ``keys`` table of the
    running call: ``register(key_index, at_ms, kind=None)`` and ``delete(...)`` take arrays (numpy,
    Arrow or lists; a scalar is broadcast), so no Python loop runs per key. Registering a timer that
    exists, or deleting one that does not, does nothing; of two calls on the same timer the later
    wins. ``kind`` None is the operator's ``time_mode``.
    """

    def __init__(self, time_mode: str = "none", enabled: bool = False):
        self.time_mode = time_mode
        self.enabled = enabled
        self._enc: pa.Array | None = None     # the running call's keys: encode_key(grouping key) by index
        self._kgs: np.ndarray | None = None   # and their key groups
        # (key indexes, kind byte, times, registered?) of every register/delete of the running call, in order
        self._ops: list[tuple[np.ndarray, int, np.ndarray, bool]] = []
        # the same of earlier calls not yet collected by ``batch_changes``, with their keys resolved:
        # (key groups, encoded keys, kind bytes, times, registered?)
        self._earlier: list[tuple[np.ndarray, pa.Array, np.ndarray, np.ndarray, bool]] = []
        self.load_timers: Callable[[pa.Array, np.ndarray], list[tuple[int, str, int]]] | None = None

    def bind_keys(self, enc: pa.Array, kgs: np.ndarray) -> None:
        self._resolve()
        self._enc, self._kgs = enc, np.asarray(kgs, np.uint16)

    def unbind_keys(self) -> None:
        self._resolve()
        self._enc = self._kgs = None

    def _resolve(self) -> None:
        """Keep the running call's operations by their keys' records (its key indexes are about to
        mean nothing)."""
        if self._ops:
            assert self._enc is not None and self._kgs is not None
            for idx, kb, at, on in self._ops:
                self._earlier.append((self._kgs[idx], self._enc.take(pa.array(idx)), np.full(idx.size, kb, np.uint8),
                                      at, on))
            self._ops = []

    def _args(self, key_index: Any, at_ms: Any, kind: str | None) -> tuple[np.ndarray, np.ndarray, int]:
        if not self.enabled:
            raise InterfaceError("timers need a VectorizedProcessor that defines handle_expired_timers(self, keys, "
                                 "timers, state, exists): define it to receive the timers it registers")
        if self._enc is None:
            raise InterfaceError("timers are used outside process / handle_expired_timers (no keys)")
        if kind is None:
            if self.time_mode == "none":
                raise InterfaceError('the operator has time_mode="none": give the timers\' kind ("processing" or '
                                     '"event"), or create the StatefulOperator with time_mode=')
            kind = self.time_mode
        if kind not in (PROCESSING, EVENT):
            raise InterfaceError(f'a timer\'s kind is "processing" or "event" (None: the time mode), got {kind!r}')
        idx = _int_column(key_index, "key_index")
        at = _int_column(at_ms, "at_ms")
        if idx.ndim == 0 and at.ndim == 0:
            idx, at = idx.reshape(1), at.reshape(1)
        idx, at = np.broadcast_arrays(idx, at)
        n = len(self._enc)
        if idx.size and (idx.min() < 0 or idx.max() >= n):
            raise InterfaceError(f"key_index must be in [0, {n}) (rows of the call's keys table), got values from "
                                 f"{int(idx.min())} to {int(idx.max())}")
        return np.ascontiguousarray(idx), np.ascontiguousarray(at), KIND_BYTE[kind]

    def _add(self, key_index: Any, at_ms: Any, kind: str | None, on: bool) -> None:
        idx, at, kb = self._args(key_index, at_ms, kind)
        if idx.size:
            self._ops.append((idx, kb, at, on))

    def register(self, key_index: Any, at_ms: Any, kind: str | None = None) -> None:
        """A timer at ``at_ms[i]`` (ms since the epoch) for the key ``key_index[i]`` of the call's keys."""
        self._add(key_index, at_ms, kind, True)

    def delete(self, key_index: Any, at_ms: Any, kind: str | None = None) -> None:
        """Remove the timers at ``at_ms[i]`` of the keys ``key_index[i]`` (nothing where there is none)."""
        self._add(key_index, at_ms, kind, False)

    def list(self, kind: str | None = None) -> pa.Table:
        """Every timer of the call's keys (of ``kind``; None: the time mode), with this batch's
        registrations and deletions: a table ``(key_index int64, at_ms int64)`` sorted by key and
        time. One range scan per key of the call: meant for inspection, not for every batch."""
        _, _, kb = self._args([], [], kind)
        assert self._enc is not None and self._kgs is not None
        have = {(i, a) for i, k, a in (self.load_timers(self._enc, self._kgs) if self.load_timers is not None else [])
                if k == KIND_OF[kb]}
        if self._earlier:
            where = {e: i for i, e in enumerate(self._enc.to_pylist())}
            for _, enc, kinds, ats, on in self._earlier:
                for e, k, a in zip(enc.to_pylist(), kinds.tolist(), ats.tolist()):
                    if k == kb and e in where:
                        (have.add if on else have.discard)((where[e], a))
        for idx, k, ats, on in self._ops:
            if k == kb:
                for i, a in zip(idx.tolist(), ats.tolist()):
                    (have.add if on else have.discard)((i, a))
        rows = sorted(have)
        return pa.table({"key_index": pa.array([r[0] for r in rows], pa.int64()),
                         "at_ms": pa.array([r[1] for r in rows], pa.int64())})

    def batch_changes(self) -> tuple[pa.Array, pa.Array]:
        """(records to put, records to remove) of every register/delete so far (the later call on a
        timer wins), both indexes (each array: the timers' by-time records, then their by-key records
        in the same order); forgets them. The running call's operations are told apart by
        numbers (key index, kind, time); only those of earlier calls by their records."""
        if not self._earlier:
            return self._call_changes()
        self._resolve()
        ops, self._earlier = self._earlier, []
        kg = np.concatenate([o[0] for o in ops])
        enc = pa.concat_arrays([o[1].cast(pa.binary()) for o in ops])
        kinds = np.concatenate([o[2] for o in ops])
        at = np.concatenate([o[3] for o in ops])
        on = np.concatenate([np.full(len(o[3]), o[4]) for o in ops])
        by_time, by_key = timer_record_columns(kg, kinds, at, enc)
        codes = pc.dictionary_encode(by_time).indices.to_numpy(zero_copy_only=False)
        _, last_rev = np.unique(codes[::-1], return_index=True)
        last = np.sort(len(codes) - 1 - last_rev)  # the last op of each timer
        put = last[on[last]]
        gone = last[~on[last]]
        return (pa.concat_arrays([by_time.take(pa.array(put)), by_key.take(pa.array(put))]),
                pa.concat_arrays([by_time.take(pa.array(gone)), by_key.take(pa.array(gone))]))


    def _call_changes(self) -> tuple[pa.Array, pa.Array]:
        """``batch_changes`` of the running call's operations alone."""
        ops, self._ops = self._ops, []
        empty = pa.array([], pa.binary())
        if not ops:
            return empty, empty
        assert self._enc is not None and self._kgs is not None
        idx = np.concatenate([o[0] for o in ops])
        kinds = np.concatenate([np.full(o[0].size, o[1], np.uint8) for o in ops])
        at = np.concatenate([o[2] for o in ops])
        on = np.concatenate([np.full(o[0].size, o[3]) for o in ops])
        order = _by_timer_then_call(idx, kinds, at)
        i_s, k_s, a_s = idx[order], kinds[order], at[order]
        last = np.ones(idx.size, bool)  # the last operation on each timer
        last[:-1] = (i_s[1:] != i_s[:-1]) | (k_s[1:] != k_s[:-1]) | (a_s[1:] != a_s[:-1])
        chosen = order[last]
        out = []
        for sel in (chosen[on[chosen]], chosen[~on[chosen]]):
            if not sel.size:
                out.append(empty)
                continue
            by_time, by_key = timer_record_columns(self._kgs[idx[sel]], kinds[sel], at[sel],
                                                   self._enc.take(pa.array(idx[sel])))
            out.append(pa.concat_arrays([by_time, by_key]))
        return out[0], out[1]


def _by_timer_then_call(idx: np.ndarray, kinds: np.ndarray, at: np.ndarray) -> np.ndarray:
    """The order of timer operations by (key index, kind, time), then by call order:
    ``np.lexsort((np.arange(n), at, kinds, idx))``, as one stable argsort of the three packed in an
    int64 when they fit (key index < 2**21, times within 2**40 ms of each other: ~7x faster)."""
    if idx.size:
        lo = int(at.min())
        if int(idx.max()) < (1 << 21) and int(idx.min()) >= 0 and int(kinds.max()) < 4 and int(at.max()) - lo < (1 << 40):
            packed = (idx.astype(np.int64) << 42) | (kinds.astype(np.int64) << 40) | (at - lo)
            return np.argsort(packed, kind="stable")
    return np.lexsort((np.arange(idx.size), at, kinds, idx))


def _int_column(values: Any, what: str) -> np.ndarray:
    """``values`` (a scalar, list, numpy or Arrow array of ints) as int64, else ``InterfaceError``."""
    if isinstance(values, (pa.Array, pa.ChunkedArray)):
        if values.null_count:
            raise InterfaceError(f"{what} has nulls")
        values = values.to_numpy(zero_copy_only=False)
    arr = np.asarray(values)
    if arr.dtype == bool or not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0):
        raise InterfaceError(f"{what} takes ints (ms since the epoch for at_ms), got {arr.dtype} values")
    if arr.dtype == np.uint64 and arr.size and arr.max() >= 1 << 63:
        raise InterfaceError(f"{what} is outside the signed 64-bit range")
    return arr.astype(np.int64)
