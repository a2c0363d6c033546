"""The user API: ``StatefulProcessor`` (per key, plain Python values) and ``VectorizedProcessor`` (Arrow).

Per-key processors declare their state in ``init(handle)`` and get, for every grouping key of the
batch, its rows and its state::

    class RunningTotal(StatefulProcessor):
        def init(self, handle):
            self.total = handle.value_state("total")             # (count, sum)

        def handle_rows(self, key, rows, state):
            count, total = self.total.get() or (0, 0)
            count, total = count + len(rows), total + sum(r[0] for r in rows)
            self.total.update((count, total))
            yield (*key, count, total)

State variables are bound to the key being handled: inside ``handle_rows`` they read and write that
key's state (``state`` is the same set of variables by name: ``state.total`` / ``state["total"]``).
Values are plain Python values encoded with ``statestore_async.codecs.valuecodec`` (None, bool, int, float,
str, bytes, tuples, lists, dicts, dates, datetimes, Decimals); never a pandas object per key.

Storage of one state variable of one grouping key — one store record, so any access is O(1):

* key: ``key group (2 bytes) + valuecodec.encode_key((state_name, *grouping_key))``;
* value: ``valuecodec.encode_row(value)``; a ``ListState`` stores one list, a ``MapState`` one dict;
* with a TTL the value is ``encode_row((expires_at_ms, value))``: past its expiry it reads as absent
  and is removed by the first batch whose clock passes it (through an expiry index, ``state.keys``;
  or when a batch touches its key). An update refreshes the expiry. A list or map with a TTL has
  one expiry per entry: ``encode_row((latest expiry, [(expires_at_ms, value), ...]))`` or
  ``encode_row((latest expiry, {map key: (expires_at_ms, value)}))`` (``TTLListState``,
  ``TTLMapState``; declared with ``"ttl_entries"``). The clock is the
  driver's wall clock at the start of the batch (``batch_time_ms``), the same for every task of it.

A TTL has a unit: ``ttl=timedelta(minutes=1)``, ``ttl_seconds=60`` or ``ttl_ms=60_000`` (PySpark's
``TTLConfig`` takes milliseconds); a bare number (``ttl=60_000``) is refused. Declaring or dropping a
TTL changes the value layout, and so does changing a variable's kind: every task records its
declarations (``declarations``), the operator keeps them in the manifest's metadata
(``"states"``), and a task whose processor declares a recorded variable differently refuses to run
(``StateDeclarationError``, ``check_declarations``). Changing the length of a TTL is fine.

Timers (``handle.timers``, also ``state.timers``, bound to the current key like the variables):
``register(at_ms, kind=None)``, ``delete(at_ms, kind=None)``, ``list(kind=None)`` (sorted), where
``kind`` is ``"processing"`` or ``"event"`` and None means the operator's ``time_mode``. A processor
that uses timers defines ``handle_expired_timer(key, timer, state)``: it is called once per due
timer (``ExpiredTimer(at_ms, kind)``), after the batch's rows, in time order within the partition,
also for keys without rows; see ``docs/SPARK.md`` (Timers and TTL) and ``state.keys``.

Vectorized processors get a whole state partition at once (see ``VectorizedProcessor``).
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from statestore_async.codecs import valuecodec
from statestore_async.errors import InterfaceError, StateDeclarationError
from statestore_async.ids import _check_name
from statestore_async.state.keys import EVENT, KIND_BYTE, KIND_OF, PROCESSING, check_time, timer_record_columns

_MIN_MS, _MAX_MS = -(1 << 63), (1 << 63) - 1  # ``check_time``'s range

VALUE, LIST, MAP, VECTORIZED = "value", "list", "map", "vectorized"
_PUT, _DEL = 1, 2  # what a batch did to a key's value (``_StateVar._dirty``)
# a ttl_seconds this large (1000 days) was most likely meant in milliseconds
TTL_SECONDS_WARN = 86_400 * 1000
# a declaration: {"kind": VALUE | LIST | MAP | VECTORIZED, "ttl": whether values carry an expiry}
Declaration = dict[str, Any]


def ttl_to_ms(name: str, ttl: timedelta | None = None, ttl_seconds: float | None = None,
              ttl_ms: int | None = None) -> int | None:
    """A state variable's TTL in milliseconds (None: no TTL) from exactly one of its spellings.

    ``ttl`` must be a ``datetime.timedelta``: a bare number has no unit (PySpark's ``TTLConfig``
    takes milliseconds, older releases of this API took seconds) and is refused, naming both
    readings. ``ttl_seconds`` and ``ttl_ms`` are numbers > 0; ``ttl_seconds`` of 1000 days or more
    warns (it looks like milliseconds).
    """
    given = [(k, v) for k, v in (("ttl", ttl), ("ttl_seconds", ttl_seconds), ("ttl_ms", ttl_ms)) if v is not None]
    if not given:
        return None
    if len(given) > 1:
        raise InterfaceError(f"state {name!r}: give one of ttl, ttl_seconds, ttl_ms, got {', '.join(k for k, _ in given)}")
    arg, value = given[0]
    if arg == "ttl":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            raise InterfaceError(
                f"state {name!r}: ttl={value!r} has no unit ({value} ms is {_human(value / 1000)}, {value} s is "
                f"{_human(value)}): write ttl=timedelta(seconds=...), ttl_seconds={value!r} or ttl_ms={value!r}")
        if not isinstance(value, timedelta):
            raise InterfaceError(f"state {name!r}: ttl is a datetime.timedelta, got {type(value).__name__} {value!r}")
        ms = value / timedelta(milliseconds=1)
    else:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise InterfaceError(f"state {name!r}: {arg} is a finite number, got {value!r}")
        ms = value * 1000 if arg == "ttl_seconds" else value
        if arg == "ttl_seconds" and value >= TTL_SECONDS_WARN:
            warnings.warn(f"state {name!r}: ttl_seconds={value!r} is {_human(value)}: did you mean ttl_ms={value!r} "
                          f"({_human(value / 1000)})?", stacklevel=4)
    if not ms >= 1:
        raise InterfaceError(f"state {name!r}: the TTL must be at least 1 ms, got {arg}={value!r}")
    return round(ms)


def _human(seconds: float) -> str:
    for unit, size in (("days", 86400), ("hours", 3600), ("minutes", 60)):
        if seconds >= size:
            return f"{seconds / size:.3g} {unit}"
    return f"{seconds:.3g} seconds"


class _Unbound:
    """A state variable's per-key slots outside ``handle_rows`` (before the first key, after the
    last): any read or write raises, so ``get``/``update`` need no check of their own."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __getitem__(self, i: int) -> Any:
        raise InterfaceError(f"state {self.name!r} is used outside handle_rows")

    def __setitem__(self, i: int, value: Any) -> None:
        self.__getitem__(i)


class _StateVar:
    """A state variable bound to the current key (the runtime sets ``_i`` before each ``handle_rows``).

    The batch's values are decoded up front, in one call (``_begin``): ``_cur[i]`` is key ``i``'s
    current value (None: absent, expired or cleared) and ``_dirty[i]`` says what this batch did to
    it (``_PUT``, ``_DEL`` or nothing), so a read or a write is two subscripts, no dict, no decode.
    """

    kind = ""
    entries = False  # a list or map state with a TTL: one expiry per entry (``_EntryTTL``)

    def __init__(self, name: str, ttl_ms: int | None):
        self.name = name
        self.ttl_ms = ttl_ms
        self._unbound = _Unbound(name)
        self._cur: Any = self._unbound       # key index -> current value (None: absent), list while bound
        self._dirty: Any = self._unbound     # key index -> _PUT / _DEL / 0, a bytearray while bound
        self._had: Any = None                # numpy bool per key: a value is stored (expired or not)
        self._expired: Any = None            # numpy bool per key: the stored value is past its expiry
        self._values: list = []              # the batch's values (``_cur`` once the last key is done)
        self._written = bytearray()
        self._i = -1
        self._now = 0
        self._ttl_removed = 0                # values (entries) of the last batch removed because they expired

    # -- runtime side --
    def _begin(self, raw: pa.Array, now_ms: int) -> None:
        """Bind the batch: ``raw`` (an Arrow binary array) is every key's stored value (null: absent).
        Decodes them all in one call; a TTL'd value past its expiry reads as absent."""
        n = len(raw)
        self._now = now_ms
        had = raw.is_valid().to_numpy(zero_copy_only=False) if raw.null_count else np.ones(n, bool)
        present = (raw.drop_null() if raw.null_count else raw).to_pylist()
        decoded = valuecodec.decode_rows(present) if present else []
        expired = None
        self._ttl_removed = 0
        if self.ttl_ms is not None and decoded:
            now = now_ms
            live = [e > now for e, _ in decoded]
            if self.entries:
                self._ttl_removed = sum(len(v) for (_, v), ok in zip(decoded, live) if not ok)
            decoded = [v if ok else None for (_, v), ok in zip(decoded, live)]
            if not all(live):
                expired = np.zeros(n, bool)
                expired[np.flatnonzero(had)[~np.array(live, bool)]] = True
        if len(decoded) == n:
            cur = decoded
        else:  # some keys have no value: None in their slots
            it = iter(decoded)
            cur = [next(it) if h else None for h in had.tolist()]
        self._had, self._expired = had, expired
        self._values, self._written = cur, bytearray(n)
        if self.entries:
            self._drop_expired_entries(now_ms)

    def _new_expiry(self) -> int:
        """The expiry of a value (an entry) written now."""
        assert self.ttl_ms is not None
        return self._now + self.ttl_ms

    def _drop_expired_entries(self, now_ms: int) -> None:
        """(per-entry TTL) Drop the expired entries of the live lists / maps; those that lose some
        are rewritten by this batch."""

    def _bind(self) -> None:
        """From now on ``_i`` names the key (``handle_rows`` runs)."""
        self._cur, self._dirty = self._values, self._written

    def _unbind(self) -> None:
        self._cur = self._dirty = self._unbound
        self._i = -1

    def _changes(self, keys: pa.Array) -> tuple[pa.Array, pa.Array, pa.Array]:
        """(put keys, put values, removed keys) of this batch — written values, deletions, and expired
        leftovers — as Arrow arrays; ``keys`` is every key's store key, by index. The values are
        encoded here, in one call. Unbinds the batch."""
        cur = self._values
        dirty = np.frombuffer(self._written, np.uint8)
        put = dirty == _PUT
        n_put = int(np.count_nonzero(put))
        if n_put == len(cur):
            values = cur
        else:
            values = [cur[i] for i in np.flatnonzero(put).tolist()]
        if self.kind in (LIST, MAP) and not all(values):  # an emptied list or map is removed
            empty = np.array([not v for v in values], bool)
            idx = np.flatnonzero(put)
            dirty = dirty.copy()
            dirty[idx[empty]] = _DEL
            put[idx[empty]] = False
            values = [v for v, e in zip(values, empty.tolist()) if not e]
        if self.entries:
            values = [(_latest(v), v) for v in values]
        elif self.ttl_ms is not None:
            expires = self._now + self.ttl_ms
            values = [(expires, v) for v in values]
        enc = valuecodec.encode_rows(values)
        gone = (dirty == _DEL) & self._had
        if self._expired is not None:
            leftovers = self._expired & (dirty == 0)
            if not self.entries:
                self._ttl_removed = int(np.count_nonzero(leftovers))
            gone |= leftovers
        self._values, self._written, self._had, self._expired = [], bytearray(), None, None  # the batch is done
        put_keys = keys if len(enc) == len(keys) else keys.filter(pa.array(put))
        return put_keys, pa.array(enc, pa.binary()), keys.filter(pa.array(gone))

    def declaration(self) -> Declaration:
        """What fixes the stored layout of this variable: its kind, whether it has a TTL, and for a
        list or map with a TTL that the expiry is per entry (``"ttl_entries"``)."""
        d: Declaration = {"kind": self.kind, "ttl": self.ttl_ms is not None}
        if self.entries:
            d["ttl_entries"] = True
        return d

    def exists(self) -> bool:
        """Whether the current key has a (live) value."""
        return self._cur[self._i] is not None

    def clear(self) -> None:
        """Remove the current key's value."""
        i = self._i
        self._cur[i] = None
        self._dirty[i] = _DEL

    def _mutable(self, empty: list | dict) -> Any:
        """The current key's container, owned by this batch's writes (copied once per key and batch)."""
        i = self._i
        cur = self._cur[i]
        if self._dirty[i] != _PUT or cur is None:
            cur = type(empty)(cur) if cur is not None else empty
            self._cur[i] = cur
            self._dirty[i] = _PUT
        return cur


class ValueState(_StateVar):
    """One value per key: ``get()`` (None when absent), ``update(v)``, ``clear()``, ``exists()``."""

    kind = VALUE

    def get(self):
        return self._cur[self._i]

    def update(self, value) -> None:
        if value is None:
            raise InterfaceError(f"ValueState {self.name!r}: use clear() to remove a value, not update(None)")
        i = self._i
        self._cur[i] = value
        self._dirty[i] = _PUT


class ListState(_StateVar):
    """A list per key: ``get()`` (a list, empty when absent), ``append(v)``, ``put(values)``, ``clear()``."""

    kind = LIST

    def get(self) -> list:
        v = self._cur[self._i]
        return list(v) if v is not None else []

    def append(self, value) -> None:
        self._mutable([]).append(value)

    def extend(self, values: Iterable) -> None:
        self._mutable([]).extend(values)

    def put(self, values: Iterable) -> None:
        values = list(values)
        i = self._i
        self._cur[i] = values if values else None
        self._dirty[i] = _PUT if values else _DEL


class MapState(_StateVar):
    """A dict per key: ``get(k)``, ``update(k, v)``, ``remove(k)``, ``contains(k)``, ``keys()``, ``items()``, ``clear()``.

    Stored as one encoded dict value per (grouping key, state): O(1) store access per key; meant
    for maps of modest size (the whole dict is rewritten when it changes).
    """

    kind = MAP

    def _map(self) -> dict:
        v = self._cur[self._i]
        return v if v is not None else {}

    def get(self, key, default=None):
        return self._map().get(key, default)

    def contains(self, key) -> bool:
        return key in self._map()

    def keys(self) -> list:
        return list(self._map().keys())

    def values(self) -> list:
        return list(self._map().values())

    def items(self) -> list:
        return list(self._map().items())

    def update(self, key, value) -> None:
        self._mutable({})[key] = value

    def remove(self, key) -> None:
        m = self._mutable({})
        m.pop(key, None)
        if not m:
            self.clear()


def _latest(entries: list | dict) -> int:
    """The latest expiry of a list's ``(expires_at_ms, value)`` entries or a dict's values."""
    return max(e for e, _ in (entries.values() if isinstance(entries, dict) else entries))


class TTLListState(ListState):
    """A ``ListState`` with a TTL: each entry has its own expiry (set when it is appended or put,
    ``now + ttl``); expired entries are invisible and removed. Stored as
    ``encode_row((latest expiry, [(expires_at_ms, value), ...]))``."""

    entries = True

    def _drop_expired_entries(self, now_ms: int) -> None:
        cur, written, removed = self._values, self._written, 0
        for i, v in enumerate(cur):
            if v is not None and any(e <= now_ms for e, _ in v):
                keep = [ev for ev in v if ev[0] > now_ms]
                removed += len(v) - len(keep)
                cur[i], written[i] = keep, _PUT
        self._ttl_removed += removed

    def get(self) -> list:
        v = self._cur[self._i]
        return [x for _, x in v] if v is not None else []

    def append(self, value) -> None:
        self._mutable([]).append((self._new_expiry(), value))

    def extend(self, values: Iterable) -> None:
        e = self._new_expiry()
        self._mutable([]).extend((e, v) for v in values)

    def put(self, values: Iterable) -> None:
        e = self._new_expiry()
        super().put([(e, v) for v in values])


class TTLMapState(MapState):
    """A ``MapState`` with a TTL: each map key has its own expiry (set when it is updated,
    ``now + ttl``); expired entries are invisible and removed. Stored as
    ``encode_row((latest expiry, {map key: (expires_at_ms, value), ...}))``."""

    entries = True

    def _drop_expired_entries(self, now_ms: int) -> None:
        cur, written, removed = self._values, self._written, 0
        for i, m in enumerate(cur):
            if m is not None and any(e <= now_ms for e, _ in m.values()):
                keep = {k: ev for k, ev in m.items() if ev[0] > now_ms}
                removed += len(m) - len(keep)
                cur[i], written[i] = keep, _PUT
        self._ttl_removed += removed

    def get(self, key, default=None):
        ev = self._map().get(key)
        return ev[1] if ev is not None else default

    def values(self) -> list:
        return [v for _, v in self._map().values()]

    def items(self) -> list:
        return [(k, v) for k, (_, v) in self._map().items()]

    def update(self, key, value) -> None:
        self._mutable({})[key] = (self._new_expiry(), value)


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
        self._i = -1
        # (key index, kind byte, at_ms) -> True registered / False deleted, by this batch: one flat map,
        # read as columns at the batch's end (``TaskTime.timer_changes``)
        self._changes: dict[tuple[int, int, int], bool] = {}
        # key index -> the (kind byte, at_ms) it changed, for ``list``: made by its first call, then kept
        self._per_key: dict[int, list[tuple[int, int]]] | None = None
        self._existing: dict[int, set[tuple[str, int]]] | None = None  # key index -> stored timers (lazy)
        self._load: Callable[[], dict[int, set[tuple[str, int]]]] | None = None
        # the runtime's: up to which time each kind (byte) is due in this batch, and (key index, kind
        # byte, at_ms) of every timer registered at a due time (the ones that may fire after the rows)
        self._due_by: dict[int, int] = {}
        self._registered_due: list[tuple[int, int, int]] = []
        # a timer of the time mode needs no checks but its time's (``register``/``delete``'s fast path)
        self._default_ok = enabled and time_mode in (PROCESSING, EVENT)
        self._default_kind = KIND_BYTE.get(time_mode, 0)

    def _kind(self, kind: str | None) -> str:
        if not self.enabled:
            raise InterfaceError("timers need a processor that defines handle_expired_timer(self, key, timer, state): "
                                 "define it to receive the timers it registers")
        if self._i < 0:
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
        i = self._i
        if kind is None and self._default_ok and i >= 0 and type(at_ms) is int and _MIN_MS <= at_ms <= _MAX_MS:
            kb = self._default_kind  # the common call, checked inline: the same outcome as the checks below
        else:
            kb = KIND_BYTE[self._kind(kind)]
            at_ms = check_time(at_ms)
        self._record(i, kb, at_ms, on)
        if on:
            lim = self._due_by.get(kb)
            if lim is not None and at_ms <= lim:
                self._registered_due.append((i, kb, at_ms))

    def _record(self, i: int, kb: int, at_ms: int, on: bool) -> None:
        key = (i, kb, at_ms)
        if self._per_key is not None and key not in self._changes:
            self._per_key.setdefault(i, []).append((kb, at_ms))
        self._changes[key] = on

    def _fired(self, i: int, kind: str, at_ms: int) -> None:
        """The runtime's: key ``i``'s timer fires now (gone before its callback runs)."""
        self._record(i, KIND_BYTE[kind], at_ms, False)

    def _end(self) -> None:
        """Forget the batch (the processor keeps its handle, and so these timers, until its next task)."""
        self._changes, self._per_key, self._existing, self._load, self._registered_due = {}, None, None, None, []
        self._i = -1

    def register(self, at_ms: int, kind: str | None = None) -> None:
        """A timer for the current key at ``at_ms`` (ms since the epoch)."""
        self._set(at_ms, kind, True)

    def delete(self, at_ms: int, kind: str | None = None) -> None:
        """Remove the current key's timer at ``at_ms`` (nothing when there is none)."""
        self._set(at_ms, kind, False)

    def list(self, kind: str | None = None) -> list[int]:
        """The times of the current key's timers of ``kind``, ascending."""
        k = self._kind(kind)
        i = self._i
        if self._existing is None:
            self._existing = self._load() if self._load is not None else {}
        if self._per_key is None:
            per_key: dict[int, list[tuple[int, int]]] = {}
            for j, kb, at in self._changes:
                per_key.setdefault(j, []).append((kb, at))
            self._per_key = per_key
        have = {at for kk, at in self._existing.get(i, ()) if kk == k}
        want = KIND_BYTE[k]
        changes = self._changes
        for kb, at in self._per_key.get(i, ()):
            if kb == want:
                if changes[(i, kb, at)]:
                    have.add(at)
                else:
                    have.discard(at)
        return sorted(have)


class StateHandle:
    """Given to ``StatefulProcessor.init``: declares the processor's state variables. Also holds the
    key-bound ``timers`` and the batch's clock values ``processing_time_ms`` (the batch's time,
    the same for every task of it) and ``watermark_ms`` (the event-time watermark the batch uses,
    None before there is one), set before every call."""

    def __init__(self, time_mode: str = "none", timers_enabled: bool = False):
        self.variables: dict[str, _StateVar] = {}
        self.timers = Timers(time_mode, timers_enabled)
        self.processing_time_ms: int = 0
        self.watermark_ms: int | None = None

    def _add(self, cls, name: str, ttl: timedelta | None, ttl_seconds: float | None, ttl_ms: int | None):
        _check_name("state name", name)
        if name in self.variables:
            raise InterfaceError(f"state {name!r} is declared twice")
        ms = ttl_to_ms(name, ttl, ttl_seconds, ttl_ms)
        if ms is not None:
            cls = {ListState: TTLListState, MapState: TTLMapState}.get(cls, cls)
        var = self.variables[name] = cls(name, ms)
        return var

    # A TTL: ``ttl=timedelta(...)``, ``ttl_seconds=`` or ``ttl_ms=`` (see ``ttl_to_ms``).
    def value_state(self, name: str, ttl: timedelta | None = None, *, ttl_seconds: float | None = None,
                    ttl_ms: int | None = None) -> ValueState:
        return self._add(ValueState, name, ttl, ttl_seconds, ttl_ms)

    def list_state(self, name: str, ttl: timedelta | None = None, *, ttl_seconds: float | None = None,
                   ttl_ms: int | None = None) -> ListState:
        return self._add(ListState, name, ttl, ttl_seconds, ttl_ms)

    def map_state(self, name: str, ttl: timedelta | None = None, *, ttl_seconds: float | None = None,
                  ttl_ms: int | None = None) -> MapState:
        return self._add(MapState, name, ttl, ttl_seconds, ttl_ms)

    def declarations(self) -> dict[str, Declaration]:
        """Every declared variable's ``declaration()``, by name."""
        return {name: v.declaration() for name, v in self.variables.items()}


class KeyState:
    """The state variables by name (``state.total`` or ``state["total"]``), bound to the current key;
    ``state.timers`` is the key's timers (a variable named "timers" is then ``state["timers"]``)."""

    def __init__(self, variables: dict[str, _StateVar], timers: Timers | None = None):
        self._vars = variables
        if timers is not None:
            self.__dict__["timers"] = timers

    def __getattr__(self, name):
        try:
            return self.__dict__["_vars"][name]
        except KeyError:
            if name == "timers":
                raise InterfaceError("timers need a processor that defines handle_expired_timer(self, key, timer, "
                                     "state): define it to receive the timers it registers") from None
            raise AttributeError(f"no state variable {name!r} (declared: {sorted(self._vars)})") from None

    def __getitem__(self, name) -> _StateVar:
        return self._vars[name]


class StatefulProcessor:
    """Per-key stateful logic; subclass it. One instance per task (it is pickled to the executors)."""

    def init(self, handle: StateHandle) -> None:
        """Declare state variables with ``handle.value_state/list_state/map_state``."""
        raise NotImplementedError

    def handle_rows(self, key: tuple, rows: list[tuple], state: KeyState) -> Iterable[tuple]:
        """Handle one grouping key's rows of this batch; return or yield output tuples."""
        raise NotImplementedError

    def handle_expired_timer(self, key: tuple, timer: ExpiredTimer, state: KeyState) -> Iterable[tuple]:
        """Handle one due timer of ``key`` (optional: define it to use timers); return or yield
        output tuples. The timer is deleted before the call, in the same commit; the key's state
        and timers are bound as in ``handle_rows``."""
        raise NotImplementedError

    def handle_initial_state(self, key: tuple, rows: list[tuple], state: KeyState) -> Iterable[tuple]:
        """Handle one grouping key's rows of the operator's ``initial_state`` (optional: define it to
        use ``initial_state=``): called once per key, before the first batch, with the key's state
        and timers bound as in ``handle_rows``; return or yield output tuples (they join the first
        batch's output)."""
        raise NotImplementedError

    def close(self) -> None:
        """Called once per task after the last key (optional)."""


def uses_timers(processor: object) -> bool:
    """Whether a processor defines ``handle_expired_timer`` (and so may register timers)."""
    fn = getattr(type(processor), "handle_expired_timer", None)
    return fn is not None and fn is not StatefulProcessor.handle_expired_timer


def uses_initial_state(processor: object) -> bool:
    """Whether a per-key processor defines ``handle_initial_state`` (and so takes ``initial_state=``)."""
    fn = getattr(type(processor), "handle_initial_state", None)
    return fn is not None and fn is not StatefulProcessor.handle_initial_state


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
        # the same of earlier calls not yet collected by ``_changes``, with their keys resolved:
        # (key groups, encoded keys, kind bytes, times, registered?)
        self._earlier: list[tuple[np.ndarray, pa.Array, np.ndarray, np.ndarray, bool]] = []
        self._load: Callable[[pa.Array, np.ndarray], list[tuple[int, str, int]]] | None = None

    def _bind(self, enc: pa.Array, kgs: np.ndarray) -> None:
        self._resolve()
        self._enc, self._kgs = enc, np.asarray(kgs, np.uint16)

    def _unbind(self) -> None:
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
        have = {(i, a) for i, k, a in (self._load(self._enc, self._kgs) if self._load is not None else [])
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

    def _changes(self) -> tuple[pa.Array, pa.Array]:
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
        """``_changes`` of the running call's operations alone."""
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


class VectorizedProcessor:
    """Whole-partition, columnar stateful logic; subclass it.

    ``state_schema`` (a ``pyarrow.Schema``) declares the per-key state columns. For each task the
    runtime passes, for the ``n`` distinct grouping keys of the partition's rows:

    * ``keys``: a ``pyarrow.Table`` of the key columns, one row per key;
    * ``rows``: a ``pyarrow.Table`` of the value columns, sorted by key, so key ``i``'s rows are
      ``rows[offsets[i]:offsets[i+1]]``;
    * ``offsets``: a numpy int64 array of length ``n + 1``;
    * ``state``: a ``pyarrow.Table`` with ``state_schema``, one row per key (all null where the
      key has no state), and a numpy bool mask ``exists``.

    ``process`` returns ``(new_state, output)``: ``new_state`` a table of ``state_schema`` with one
    row per key (a row whose ``valid`` entry is False is removed; pass ``valid=None`` to keep all),
    and ``output`` a table matching the operator's output schema. Each state row is stored as one
    record, ``encode_row(tuple of the row)`` under ``encode_key((state_name, *key))``.

    Timers: a processor that defines ``handle_expired_timers`` registers and deletes timers in bulk
    with ``self.timers`` (a ``VectorizedTimers``: keys by their row in the call's ``keys``) in
    ``process`` and ``handle_expired_timers``; ``self.processing_time_ms`` and
    ``self.watermark_ms`` are the batch's clock and watermark. After ``process``, the partition's
    due timers (processing: ``at_ms <= processing_time_ms``, event: ``at_ms <= watermark_ms``) go
    to one call of ``handle_expired_timers``, also for keys without rows and in batches without
    rows; each fires once, deleted in the commit that holds what the call wrote.
    """

    state_name = "state"
    state_schema = None  # pyarrow.Schema
    # set by the runtime before every call (see "Timers" above)
    timers: VectorizedTimers = VectorizedTimers()
    processing_time_ms: int = 0
    watermark_ms: int | None = None

    def process(self, keys, rows, offsets, state, exists):
        """Return ``(new_state_table, output_table)`` or ``(new_state_table, output_table, valid_mask)``."""
        raise NotImplementedError

    def handle_expired_timers(self, keys, timers, state, exists):
        """The partition's due timers (optional: define it to use ``self.timers``). ``keys``: one
        row per key with a due timer; ``timers``: one row per due timer, in firing order, with the
        key columns, ``key_index`` (int64, the row of ``keys``), ``at_ms`` (int64) and ``kind``
        (string); ``state`` / ``exists``: those keys' state after this batch's ``process``. Returns
        what ``process`` returns, for ``keys``."""
        raise NotImplementedError


def check_processor(processor: StatefulProcessor | VectorizedProcessor, time_mode: str = "none") -> bool:
    """What a task would find wrong with ``processor``'s state declarations, raised when the
    operator is made, on the driver (``StateDeclarationError``): a ``StatefulProcessor`` whose
    ``init`` fails or declares no state variable, a ``VectorizedProcessor`` without a
    ``pyarrow.Schema`` as ``state_schema``. Returns whether the processor has time work (timers or
    state with a TTL: its tasks run even without rows)."""
    name = type(processor).__name__
    if isinstance(processor, VectorizedProcessor):
        if not isinstance(getattr(processor, "state_schema", None), pa.Schema):
            raise StateDeclarationError(
                f"{name}.state_schema must be a pyarrow.Schema (the columns of a key's state row), got "
                f"{type(getattr(processor, 'state_schema', None)).__name__}")
        return uses_vectorized_timers(processor)
    h = StateHandle(time_mode, uses_timers(processor))
    try:
        processor.init(h)
    except InterfaceError:
        raise
    except Exception as exc:
        raise StateDeclarationError(
            f"{name}.init(handle) failed when the operator checked its declarations on the driver: "
            f"{type(exc).__name__}: {exc}. init should only declare state variables (handle.value_state, "
            "list_state, map_state) and set attributes") from exc
    if not h.variables:
        raise StateDeclarationError(
            f"{name}.init declared no state: declare the state the processor keeps per key in init, e.g. "
            "self.total = handle.value_state('total') (see docs/SPARK.md, 'State variables')")
    return uses_timers(processor) or any(v.ttl_ms is not None for v in h.variables.values())


def uses_vectorized_timers(processor: object) -> bool:
    """Whether a ``VectorizedProcessor`` defines ``handle_expired_timers``."""
    fn = getattr(type(processor), "handle_expired_timers", None)
    return fn is not None and fn is not VectorizedProcessor.handle_expired_timers


def vectorized_declarations(processor: VectorizedProcessor) -> dict[str, Declaration]:
    """A ``VectorizedProcessor``'s one state variable, as ``StateHandle.declarations`` gives them.
    Its records are ``encode_row(tuple of the state row)`` without expiry: the layout of a
    ``value_state`` without a TTL holding tuples (the two may replace each other)."""
    return {processor.state_name: {"kind": VECTORIZED, "ttl": False}}


def _layout(d: Mapping[str, Any]) -> tuple[Any, bool, bool]:
    kind = d.get("kind")
    return (VALUE if kind == VECTORIZED else kind), bool(d.get("ttl")), bool(d.get("ttl_entries"))


def _describe(d: Mapping[str, Any]) -> str:
    kind = d.get("kind")
    if kind == VECTORIZED:
        return "the VectorizedProcessor's state"
    if d.get("ttl") and kind in (LIST, MAP):
        return (f"{kind}_state with a TTL per entry" if d.get("ttl_entries") else
                f"{kind}_state with a TTL for the whole {kind} (the layout before per-entry TTLs)")
    return f"{kind}_state {'with' if d.get('ttl') else 'without'} a TTL"


def check_declarations(recorded: Mapping[str, Declaration] | None, current: Mapping[str, Declaration],
                       where: str = "") -> None:
    """``StateDeclarationError`` when a state variable of ``current`` was recorded (by an earlier
    batch of the operator) with another kind or another TTL setting (with or without: the length
    may change). Variables new in ``current``, or only in ``recorded``, are fine. ``recorded`` None
    (the first batch, or state written before declarations were recorded): nothing to check."""
    if not recorded:
        return
    bad = [f"{name!r} was {_describe(recorded[name])} and is now {_describe(d)}"
           for name, d in current.items() if name in recorded and _layout(recorded[name]) != _layout(d)]
    if bad:
        raise StateDeclarationError(
            f"{where}state variable {'; '.join(bad)}. The stored values were written for the old declaration "
            "(a TTL or a kind changes how a value is stored) and would be misread or reset. Keep the old "
            "declaration, or declare the variable under a new name (reading the old one in handle_rows to "
            "migrate it), or start a new operator_id.")


def check_picklable(processor: object) -> None:
    """``InterfaceError`` naming what makes ``processor`` unpicklable (an attribute, or the path to
    it inside an attribute: ``self.cfg['conn']``) when cloudpickle, which Spark sends it to the
    executors with, cannot pickle it. Runs once on the driver, when the operator is created."""
    try:
        from pyspark import cloudpickle as pickler
    except ImportError:  # pragma: no cover - pyspark ships cloudpickle
        import pickle as pickler  # type: ignore[no-redef]
    try:
        pickler.dumps(processor)
        return
    except Exception as exc:
        first = exc
    culprits = _unpicklable(pickler, processor, "self", 3)
    what = "; ".join(f"{path} (a {type(value).__name__}: {_short(err)})" for path, value, err in culprits[:5])
    name = type(processor).__name__
    raise InterfaceError(
        f"the processor {name} cannot be pickled (Spark pickles it to send it to the executors): "
        + (f"{what}. Create such objects in {name}.init(), which runs in each task, rather than in __init__ "
           "(or keep them out of the processor)" if culprits else f"{type(first).__name__}: {_short(first)}"))


def _short(exc: object, limit: int = 160) -> str:
    s = str(exc)
    return s if len(s) <= limit else s[:limit] + "…"


def _unpicklable(pickler: Any, obj: object, path: str, depth: int) -> list[tuple[str, object, Exception]]:
    """The innermost parts of ``obj`` (attributes, dict values, sequence items, ``depth`` levels
    down) that do not pickle, as (path, value, error)."""
    if isinstance(obj, Mapping):
        parts: Iterable[tuple[str, object]] = ((f"{path}[{k!r}]", v) for k, v in obj.items())
    elif isinstance(obj, (list, tuple, set, frozenset)):
        parts = ((f"{path}[{i}]", v) for i, v in enumerate(obj))
    elif isinstance(getattr(obj, "__dict__", None), dict):
        parts = ((f"{path}.{k}", v) for k, v in vars(obj).items())
    else:
        return []
    found: list[tuple[str, object, Exception]] = []
    for p, v in parts:
        try:
            pickler.dumps(v)
        except Exception as exc:
            inner = _unpicklable(pickler, v, p, depth - 1) if depth > 1 else []
            found.extend(inner or [(p, v, exc)])
    return found


def merge_declarations(recorded: Mapping[str, Declaration] | None,
                       reported: Iterable[Mapping[str, Declaration] | None]) -> dict[str, Declaration] | None:
    """What the next manifest records: the ``recorded`` declarations updated with the tasks'
    (``reported``; equal to the recorded ones where both name a variable, ``check_declarations``
    saw to it). A variable no longer declared stays recorded: its values stay in the store, and
    declaring it again differently would misread them. None when nothing was ever declared."""
    merged = dict(recorded or {})
    for r in reported:
        if r:
            merged.update(r)
    return merged or None
