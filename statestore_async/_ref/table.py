"""A compact map of bytes → bytes | None, pure-Python reference.

This module *defines* the behaviour; ``_ext/table.pyx`` must give the same results, the same bytes
and the same errors (only ``nbytes`` differs: it is memory accounting, an estimate here). The
contracts are documented in ``statestore_async.engine.table``.

Here a ``Table`` is a dict (key → value, None for a tombstone entry) plus a sorted key list made by
the first ordered call and rebuilt after changes; a ``TableView`` is a sorted copy of the records.
"""
from __future__ import annotations

import sys
from bisect import bisect_left
from typing import TYPE_CHECKING, Any

from statestore_async._ref.blockcodec import _answer, _check_spans, encode_records_raw
from statestore_async.errors import InterfaceError, KeyFormatError, StoreStateError

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator

    from statestore_async._ref import Buffer, BytesLike

__all__ = [
    "Table",
    "TableView",
    "apply",
    "get_list",
    "load_records",
    "lookup_spans",
    "pack_keys",
    "put_items",
    "remove_keys",
]

MAX_LEN = 0xFFFFFFFF
# nbytes here: an estimate of what the dict holds per entry beyond the key and value bytes (two
# bytes objects' headers and a dict slot); the compiled table reports its real allocations
_ENTRY_ESTIMATE = 2 * 33 + 40
_CHUNK_OVERHEAD = 11
_CHANGED = "Table changed during iteration"
_RELEASED = "the table view was released"


def key_error(n: int, min_key: int) -> KeyFormatError:
    return KeyFormatError(f"a store key starts with its {min_key}-byte key group, got {n} bytes")


def _check_key(key: object, min_key: int) -> bytes:
    if type(key) is not bytes:
        if isinstance(key, (bytearray, memoryview)):
            key = bytes(key)
        else:
            raise KeyFormatError(f"keys are bytes, got {type(key).__name__}")
    if len(key) < min_key:
        raise key_error(len(key), min_key)
    return key


def _check_value(value: object) -> bytes:
    if type(value) is not bytes:
        if isinstance(value, (bytearray, memoryview)):
            return bytes(value)
        raise InterfaceError(f"values are bytes, got {type(value).__name__}")
    return value


def _pair(item: Iterable[object]) -> tuple[object, object]:
    try:
        k, v = item
    except (TypeError, ValueError):
        raise InterfaceError(f"pairs are (key, value) tuples, got {item!r:.80}") from None
    return k, v


def _key(key: object) -> bytes:
    if type(key) is bytes:
        return key
    if isinstance(key, (bytearray, memoryview)):
        key = bytes(key)
    else:
        raise KeyFormatError(f"keys are bytes, got {type(key).__name__}")
    return key


def _length(b: bytes) -> bytes:
    if len(b) > MAX_LEN:
        raise InterfaceError(f"a key or value of {len(b)} bytes is too long")
    return b


def _value(value: object) -> bytes | None:
    if value is None:
        return None
    return _length(_check_value(value))


def _after_prefix(prefix: bytes) -> bytes | None:
    """The first key after every key starting with ``prefix`` (None: there is none)."""
    p = prefix.rstrip(b"\xff")
    if not p:
        return None
    return p[:-1] + bytes((p[-1] + 1,))


def _varint_len(n: int) -> int:
    size = 1
    while n >= 0x80:
        n >>= 7
        size += 1
    return size


class Table:
    """key → value, or None for a tombstone entry; see ``statestore_async.engine.table``."""

    __slots__ = ("_d", "_rb", "_sorted", "_version")

    def __init__(self) -> None:
        self._d: dict[bytes, bytes | None] = {}
        self._rb = 0
        self._version = 0
        self._sorted: list[bytes] | None = None  # the order index: None until the first ordered call

    # --- point operations -------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._d)

    def __contains__(self, key: object) -> bool:
        return _key(key) in self._d

    def get(self, key: BytesLike) -> bytes | None:
        """The value of ``key``; None when absent or a tombstone."""
        return self._d.get(_key(key))

    def put(self, key: BytesLike, value: BytesLike | None) -> None:
        """Set ``key`` to ``value`` (None: a tombstone entry)."""
        self._set(_length(_key(key)), _value(value))
        self._version += 1

    def delete(self, key: BytesLike) -> bool:
        """Remove the entry of ``key`` (tombstone or not); whether there was one."""
        found = self._del(_key(key))
        self._version += 1
        return found

    def _set(self, k: bytes, v: bytes | None) -> None:
        d = self._d
        if k in d:
            old = d[k]
            self._rb -= len(old) if old is not None else 0
        else:
            self._rb += len(k)
            if self._sorted is not None and self._sorted:
                self._sorted = []  # rebuilt at the next ordered call
        d[k] = v
        self._rb += len(v) if v is not None else 0

    def _del(self, k: bytes) -> bool:
        d = self._d
        if k not in d:
            return False
        old = d.pop(k)
        self._rb -= len(k) + (len(old) if old is not None else 0)
        if self._sorted is not None and self._sorted:
            self._sorted = []
        return True

    @property
    def record_bytes(self) -> int:
        """Sum of len(key) + len(value or b"") over the entries."""
        return self._rb

    @property
    def nbytes(self) -> int:
        """An estimate of the memory held (the compiled twin reports its real allocations)."""
        n = len(self._d)
        total = sys.getsizeof(self._d) + self._rb + _ENTRY_ESTIMATE * n
        if self._sorted is not None:
            total += 8 * len(self._sorted)
        return total

    # --- ordered reads ----------------------------------------------------------------------------
    def _order(self) -> list[bytes]:
        keys = self._sorted
        if keys is None or len(keys) != len(self._d):
            keys = self._sorted = sorted(self._d)
        return keys

    def items(self, start: BytesLike = b"", stop: BytesLike | None = None) -> Iterator[tuple[bytes, bytes | None]]:
        """(key, value | None) with start <= key < stop, in key order. Changing the table while
        iterating makes the next step raise ``RuntimeError``."""
        lo = _key(start)
        hi = None if stop is None else _key(stop)
        return self._items(lo, hi, self._version)

    def _items(self, lo: bytes, hi: bytes | None, version: int) -> Iterator[tuple[bytes, bytes | None]]:
        keys = self._order()
        d = self._d
        i = bisect_left(keys, lo)
        while True:
            if self._version != version:
                raise RuntimeError(_CHANGED)
            if i >= len(keys):
                return
            k = keys[i]
            if hi is not None and k >= hi:
                return
            yield k, d[k]
            i += 1

    def scan(self, prefix: BytesLike) -> list[tuple[bytes, bytes | None]]:
        """(key, value | None) for every key starting with ``prefix``, in key order."""
        p = _key(prefix)
        keys = self._order()
        d = self._d
        stop = _after_prefix(p)
        i = bisect_left(keys, p)
        j = len(keys) if stop is None else bisect_left(keys, stop, i)
        return [(k, d[k]) for k in keys[i:j]]

    def ranges(self, ranges: Iterable[tuple[BytesLike, BytesLike | None]]) -> list[tuple[bytes, bytes | None]]:
        """(key, value | None) with start <= key < stop for each (start, stop) of ``ranges``
        (ascending and disjoint; stop None: no bound), in key order, as one list."""
        keys = self._order()
        d = self._d
        out: list[tuple[bytes, bytes | None]] = []
        for start, stop in ranges:
            lo = _key(start)
            i = bisect_left(keys, lo)
            j = len(keys) if stop is None else max(i, bisect_left(keys, _key(stop), i))
            out += [(k, d[k]) for k in keys[i:j]]
        return out

    def keys(self) -> list[bytes]:
        """Every key, in key order."""
        return list(self._order())

    def freeze(self) -> TableView:
        """A view of the table as it is now; later changes of the table do not show in it."""
        d = self._d
        return TableView([(k, d[k]) for k in self._order()])

    def __repr__(self) -> str:
        return f"<Table of {len(self._d)} entries>"


class TableView:
    """The records of a table at ``Table.freeze()`` time, in key order."""

    __slots__ = ("_items", "_keys")

    def __init__(self, items: list[tuple[bytes, bytes | None]]):
        self._items: list[tuple[bytes, bytes | None]] | None = items
        self._keys: list[bytes] = [k for k, _ in items]

    def _live(self) -> list[tuple[bytes, bytes | None]]:
        if self._items is None:
            raise StoreStateError(_RELEASED)
        return self._items

    def __len__(self) -> int:
        return len(self._live())

    def get(self, key: BytesLike) -> bytes | None:
        items = self._live()
        k = _key(key)
        i = bisect_left(self._keys, k)
        if i < len(items) and items[i][0] == k:
            return items[i][1]
        return None

    def items(self, start: BytesLike = b"", stop: BytesLike | None = None) -> Iterator[tuple[bytes, bytes | None]]:
        """The frozen (key, value | None) with start <= key < stop, in key order."""
        self._live()
        lo = _key(start)
        hi = None if stop is None else _key(stop)
        return self._iter(bisect_left(self._keys, lo), hi)

    def _iter(self, i: int, hi: bytes | None) -> Iterator[tuple[bytes, bytes | None]]:
        while True:
            items = self._live()
            if i >= len(items):
                return
            kv = items[i]
            if hi is not None and kv[0] >= hi:
                return
            yield kv
            i += 1

    def chunk(self, pos: int, max_bytes: int) -> tuple[list[tuple[bytes, bytes | None]], int]:
        """The records from index ``pos`` in key order while the sum of len(key) + len(value) + 11
        stays within ``max_bytes`` (at least one when any is left), and the next index; an empty
        list at the end."""
        items = self._live()
        if type(pos) is not int or pos < 0:
            raise InterfaceError(f"a chunk starts at an index >= 0, got {pos!r}")
        out: list[tuple[bytes, bytes | None]] = []
        size = 0
        i = pos
        n = len(items)
        while i < n:
            kv = items[i]
            v = kv[1]
            s = len(kv[0]) + (len(v) if v is not None else 0) + _CHUNK_OVERHEAD
            if out and size + s > max_bytes:
                break
            out.append(kv)
            size += s
            i += 1
        return out, i

    def chunk_packed(self, pos: int, max_bytes: int) -> tuple[bytes, int, int, int]:
        """The records from index ``pos`` in key order as one ``blockcodec`` records payload
        (``blockcodec.encode_records_raw`` of them), as many as fit in ``max_bytes`` of payload (at
        least one when any is left): ``(payload, next_pos, min_kg, max_kg)``, the key groups (a key's
        first two bytes, big-endian; 0 for a shorter key) being the smallest and largest among those
        records. At the end: ``(b"", pos, 0, 0)``."""
        items = self._live()
        if type(pos) is not int or pos < 0:
            raise InterfaceError(f"a chunk starts at an index >= 0, got {pos!r}")
        if type(max_bytes) is not int:
            raise InterfaceError(f"max_bytes is an int, got {type(max_bytes).__name__}")
        n = len(items)
        if pos >= n:
            return b"", pos, 0, 0
        size = 0
        i = pos
        while i < n:
            k, v = items[i]
            s = 1 + _varint_len(len(k)) + len(k) + (0 if v is None else _varint_len(len(v)) + len(v))
            if i > pos and size + s > max_bytes:
                break
            size += s
            i += 1
        records = items[pos:i]
        groups = [(k[0] << 8) | k[1] if len(k) >= 2 else 0 for k, _ in records]
        return encode_records_raw(records), i, min(groups), max(groups)

    def release(self) -> None:
        """Let go of the frozen records (idempotent)."""
        self._items = None
        self._keys = []

    def __enter__(self) -> TableView:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


# --- batch routines ---------------------------------------------------------------------------------
def set_records(table: Table, records: Iterable[tuple[bytes, bytes | None]]) -> None:
    """Set checked (key, value | None) records in order, None setting a tombstone entry: the
    request routines' way in (``daemon.payloads``; the compiled twin's ``set_records`` of
    ``table.pxd``), as one batch write."""
    for k, v in records:
        table._set(k, v)
    table._version += 1


def find_records(overlay: Table | None, base: Table, keys: Iterable[bytes]) -> list[bytes | None]:
    """Each checked key's value: ``overlay``'s entry when it has the key (None: a tombstone), else
    ``base``'s (None: absent); the compiled twin's ``find_records``."""
    return [_lookup(overlay, base, k) for k in keys]


def put_items(table: Table, items: Iterable[tuple[BytesLike, BytesLike]], min_key: int) -> int:
    """Put every (key, value); all are checked before any is set; the count."""
    checked = []
    for item in list(items):
        k, v = _pair(item)
        checked.append((_length(_check_key(k, min_key)), _length(_check_value(v))))
    for k, v in checked:
        table._set(k, v)
    table._version += 1
    return len(checked)


def remove_keys(table: Table, keys: Iterable[BytesLike], min_key: int) -> int:
    """A tombstone for every key; all are checked before any is set; the count."""
    checked = [_length(_check_key(k, min_key)) for k in list(keys)]
    for k in checked:
        table._set(k, None)
    table._version += 1
    return len(checked)


def _lookup(overlay: Table | None, base: Table, k: bytes) -> bytes | None:
    if overlay is not None and k in overlay._d:
        return overlay._d[k]
    return base._d.get(k)


def get_list(overlay: Table | None, base: Table, keys: Iterable[BytesLike]) -> list[bytes | None]:
    """Each key's value: the overlay's entry when it has the key (None for a tombstone), else the base's."""
    return [_lookup(overlay, base, _key(k)) for k in keys]


def apply(base: Table, changes: Table) -> tuple[Table, Table]:
    """Apply ``changes`` (a value sets the key, a tombstone removes it) to ``base``:
    ``(applied, undo)``; see ``statestore_async.engine.table``."""
    if base is changes:
        raise InterfaceError("apply: the changes are the base table itself")
    bd = base._d
    undo = Table()
    kept: list[tuple[bytes, bytes | None]] = []
    dropped = False
    for k, v in changes._d.items():
        if k in bd:
            old = bd[k]
        elif v is None:
            dropped = True  # removing what is not there changes nothing
            continue
        else:
            old = None
        undo._set(k, old)
        if v is None:
            base._del(k)
        else:
            base._set(k, v)
        kept.append((k, v))
    base._version += 1
    if not dropped:
        return changes, undo
    applied = Table()
    for k, v in kept:
        applied._set(k, v)
    return applied, undo


def load_records(table: Table, records: Iterable[tuple[BytesLike, BytesLike | None]],
                 keep_tombstones: bool = False) -> None:
    """Put every (key, value) of ``records`` in order; a None value removes the key, or with
    ``keep_tombstones`` sets a tombstone entry (a delta file's records)."""
    checked = []
    for item in list(records):
        k, v = _pair(item)
        checked.append((_length(_check_key(k, 0)), _value(v)))
    for k, v in checked:
        if v is None and not keep_tombstones:
            table._del(k)
        else:
            table._set(k, v)
    table._version += 1


def pack_keys(keys: Iterable[BytesLike]) -> tuple[bytes, bytes]:
    """``keys`` laid end to end, each after its u32 length (little-endian), and each key's offset
    (int64, native order) there: what ``lookup_spans`` and ``engine.lookup.KeyLookup`` read. A key
    that is not bytes-like raises ``KeyFormatError``."""
    ks = [_length(_key(k)) for k in keys]
    parts: list[bytes] = []
    offsets: list[int] = []
    pos = 0
    for k in ks:
        parts += (len(k).to_bytes(4, "little"), k)
        offsets.append(pos + 4)
        pos += 4 + len(k)
    return b"".join(parts), b"".join(o.to_bytes(8, sys.byteorder, signed=True) for o in offsets)


def lookup_spans(table: Table, kbuf: Buffer, koff: Any, js: Iterable[int], found: Any, voff: Any, vlen: Any,
                 base: int) -> bytes:
    """``blockcodec.RecordBlock.lookup_spans`` over ``table``'s entries (a tombstone entry is
    found, ``vlen[j]`` = -1): for the keys a level of a spilled version holds, their values
    written into the returned bytes, with no Python object per key or value in the compiled
    twin. Bad arguments raise before anything is written."""
    keys = _check_spans(kbuf, koff, js, found, voff, vlen, "lookup_spans")
    d = table._d
    return _answer([(j, d[k]) for j, k in keys if k in d], found, voff, vlen, base)


# --- export (checkpoint files) ----------------------------------------------------------------------
