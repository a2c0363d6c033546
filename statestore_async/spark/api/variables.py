"""State variables: ``ValueState``, ``ListState``, ``MapState`` and their TTL'd forms, bound to the
key being handled, and the TTL of a declaration.

Storage of one state variable of one grouping key is one store record, so any access is O(1). The
batch's values are decoded up front in one call and its changes encoded in one; the task runtime
drives a variable through a batch with the internal lifecycle of ``_StateVar`` (see
``spark.api.lifecycle``).
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import numpy as np
import pyarrow as pa

from statestore_async.codecs import valuecodec
from statestore_async.errors import InterfaceError

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
    """A state variable bound to the current key (the runtime sets ``key_index`` before each ``handle_rows``).

    The batch's values are decoded up front, in one call (``begin_batch``): ``_cur[i]`` is key ``i``'s
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
        self.key_index = -1
        self._now = 0
        self.ttl_removed = 0                # values (entries) of the last batch removed because they expired

    # -- runtime side --
    def begin_batch(self, raw: pa.Array, now_ms: int) -> None:
        """Bind the batch: ``raw`` (an Arrow binary array) is every key's stored value (null: absent).
        Decodes them all in one call; a TTL'd value past its expiry reads as absent."""
        n = len(raw)
        self._now = now_ms
        had = raw.is_valid().to_numpy(zero_copy_only=False) if raw.null_count else np.ones(n, bool)
        present = (raw.drop_null() if raw.null_count else raw).to_pylist()
        decoded = valuecodec.decode_rows(present) if present else []
        expired = None
        self.ttl_removed = 0
        if self.ttl_ms is not None and decoded:
            now = now_ms
            live = [e > now for e, _ in decoded]
            if self.entries:
                self.ttl_removed = sum(len(v) for (_, v), ok in zip(decoded, live) if not ok)
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

    def bind_keys(self) -> None:
        """From now on ``key_index`` names the key (``handle_rows`` runs)."""
        self._cur, self._dirty = self._values, self._written

    def unbind_keys(self) -> None:
        self._cur = self._dirty = self._unbound
        self.key_index = -1

    def batch_changes(self, keys: pa.Array) -> tuple[pa.Array, pa.Array, pa.Array]:
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
                self.ttl_removed = int(np.count_nonzero(leftovers))
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
        return self._cur[self.key_index] is not None

    def clear(self) -> None:
        """Remove the current key's value."""
        i = self.key_index
        self._cur[i] = None
        self._dirty[i] = _DEL

    def _mutable(self, empty: list | dict) -> Any:
        """The current key's container, owned by this batch's writes (copied once per key and batch)."""
        i = self.key_index
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
        return self._cur[self.key_index]

    def update(self, value) -> None:
        if value is None:
            raise InterfaceError(f"ValueState {self.name!r}: use clear() to remove a value, not update(None)")
        i = self.key_index
        self._cur[i] = value
        self._dirty[i] = _PUT


class ListState(_StateVar):
    """A list per key: ``get()`` (a list, empty when absent), ``append(v)``, ``put(values)``, ``clear()``."""

    kind = LIST

    def get(self) -> list:
        v = self._cur[self.key_index]
        return list(v) if v is not None else []

    def append(self, value) -> None:
        self._mutable([]).append(value)

    def extend(self, values: Iterable) -> None:
        self._mutable([]).extend(values)

    def put(self, values: Iterable) -> None:
        values = list(values)
        i = self.key_index
        self._cur[i] = values if values else None
        self._dirty[i] = _PUT if values else _DEL


class MapState(_StateVar):
    """A dict per key: ``get(k)``, ``update(k, v)``, ``remove(k)``, ``contains(k)``, ``keys()``, ``items()``, ``clear()``.

    Stored as one encoded dict value per (grouping key, state): O(1) store access per key; meant
    for maps of modest size (the whole dict is rewritten when it changes).
    """

    kind = MAP

    def _map(self) -> dict:
        v = self._cur[self.key_index]
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
        self.ttl_removed += removed

    def get(self) -> list:
        v = self._cur[self.key_index]
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
        self.ttl_removed += removed

    def get(self, key, default=None):
        ev = self._map().get(key)
        return ev[1] if ev is not None else default

    def values(self) -> list:
        return [v for _, v in self._map().values()]

    def items(self) -> list:
        return [(k, v) for k, (_, v) in self._map().items()]

    def update(self, key, value) -> None:
        self._mutable({})[key] = (self._new_expiry(), value)
