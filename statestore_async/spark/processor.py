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
  and is removed when a batch touches its key. An update refreshes the expiry. The clock is the
  driver's wall clock at the start of the batch (``batch_time_ms``), the same for every task of it.
  Declaring or dropping a TTL changes the value layout: keep it fixed for an operator's life.

Vectorized processors get a whole state partition at once (see ``VectorizedProcessor``).
"""
from __future__ import annotations

from collections.abc import Iterable

from statestore_async.codecs import valuecodec
from statestore_async.errors import InterfaceError
from statestore_async.ids import _check_name

VALUE, LIST, MAP = "value", "list", "map"
_DELETE = object()  # a pending removal


class _StateVar:
    """A state variable bound to the current key (set by the runtime before each ``handle_rows``)."""

    kind = ""

    def __init__(self, name: str, ttl: float | None):
        self.name = name
        self.ttl_ms = None if ttl is None else int(ttl * 1000)
        self._raw: list = []         # encoded value per key of the batch (bytes | None)
        self._cache: dict = {}       # key index -> decoded value (or None: absent)
        self._writes: dict = {}      # key index -> new value, or _DELETE
        self._expired: set = set()   # key indexes whose stored value was found expired
        self._i = -1
        self._now = 0

    # -- runtime side --
    def _begin(self, raw: list, now_ms: int) -> None:
        self._raw, self._cache, self._writes, self._expired, self._now = raw, {}, {}, set(), now_ms

    def _decode(self, i: int):
        data = self._raw[i]
        if data is None:
            return None
        v = valuecodec.decode_row(data)
        if self.ttl_ms is not None:
            expires, v = v
            if expires <= self._now:
                self._expired.add(i)
                return None
        return v

    def _current(self):
        i = self._i
        if i in self._writes:
            v = self._writes[i]
            return None if v is _DELETE else v
        if i not in self._cache:
            self._cache[i] = self._decode(i)
        return self._cache[i]

    def _set(self, value) -> None:
        if self._i < 0:
            raise InterfaceError(f"state {self.name!r} is used outside handle_rows")
        self._writes[self._i] = value

    def _mutable(self, empty):
        """The current key's container, owned by this batch's writes (copied once per key and batch)."""
        if self._i < 0:
            raise InterfaceError(f"state {self.name!r} is used outside handle_rows")
        w = self._writes.get(self._i, None)
        if w is None or w is _DELETE:
            cur = self._current()
            w = type(empty)(cur) if cur is not None else empty
            self._writes[self._i] = w
        return w

    def _changes(self, keys: list[bytes]) -> tuple[list, list]:
        """(puts, removes) for this batch: written values, deletions and expired leftovers."""
        removes, put_keys, values = [], [], []
        for i, v in self._writes.items():
            if v is _DELETE or (self.kind in (LIST, MAP) and not v):
                if self._raw[i] is not None:
                    removes.append(keys[i])
            else:
                put_keys.append(keys[i])
                values.append(v)
        if self.ttl_ms is not None:
            expires = self._now + self.ttl_ms
            values = [(expires, v) for v in values]
        puts = list(zip(put_keys, valuecodec.encode_rows(values)))
        for i in self._expired:
            if i not in self._writes:
                removes.append(keys[i])
        return puts, removes

    def exists(self) -> bool:
        """Whether the current key has a (live) value."""
        return self._current() is not None

    def clear(self) -> None:
        """Remove the current key's value."""
        self._set(_DELETE)


class ValueState(_StateVar):
    """One value per key: ``get()`` (None when absent), ``update(v)``, ``clear()``, ``exists()``."""

    kind = VALUE

    def get(self):
        return self._current()

    def update(self, value) -> None:
        if value is None:
            raise InterfaceError(f"ValueState {self.name!r}: use clear() to remove a value, not update(None)")
        self._set(value)


class ListState(_StateVar):
    """A list per key: ``get()`` (a list, empty when absent), ``append(v)``, ``put(values)``, ``clear()``."""

    kind = LIST

    def get(self) -> list:
        v = self._current()
        return list(v) if v is not None else []

    def append(self, value) -> None:
        self._mutable([]).append(value)

    def extend(self, values: Iterable) -> None:
        self._mutable([]).extend(values)

    def put(self, values: Iterable) -> None:
        values = list(values)
        self._set(values if values else _DELETE)


class MapState(_StateVar):
    """A dict per key: ``get(k)``, ``update(k, v)``, ``remove(k)``, ``contains(k)``, ``keys()``, ``items()``, ``clear()``.

    Stored as one encoded dict value per (grouping key, state): O(1) store access per key; meant
    for maps of modest size (the whole dict is rewritten when it changes).
    """

    kind = MAP

    def _map(self) -> dict:
        v = self._current()
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
            self._set(_DELETE)


class StateHandle:
    """Given to ``StatefulProcessor.init``: declares the processor's state variables."""

    def __init__(self):
        self.variables: dict[str, _StateVar] = {}

    def _add(self, cls, name: str, ttl: float | None):
        _check_name("state name", name)
        if name in self.variables:
            raise InterfaceError(f"state {name!r} is declared twice")
        if ttl is not None and not ttl > 0:
            raise InterfaceError(f"state {name!r}: ttl is a number of seconds > 0, got {ttl!r}")
        var = self.variables[name] = cls(name, ttl)
        return var

    def value_state(self, name: str, ttl: float | None = None) -> ValueState:
        return self._add(ValueState, name, ttl)

    def list_state(self, name: str, ttl: float | None = None) -> ListState:
        return self._add(ListState, name, ttl)

    def map_state(self, name: str, ttl: float | None = None) -> MapState:
        return self._add(MapState, name, ttl)


class KeyState:
    """The state variables by name (``state.total`` or ``state["total"]``), bound to the current key."""

    def __init__(self, variables: dict[str, _StateVar]):
        self._vars = variables

    def __getattr__(self, name):
        try:
            return self.__dict__["_vars"][name]
        except KeyError:
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

    def close(self) -> None:
        """Called once per task after the last key (optional)."""


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
    """

    state_name = "state"
    state_schema = None  # pyarrow.Schema

    def process(self, keys, rows, offsets, state, exists):
        """Return ``(new_state_table, output_table)`` or ``(new_state_table, output_table, valid_mask)``."""
        raise NotImplementedError
