"""The daemon's request routines on engine tables, pure-Python reference.

This module *defines* the behaviour; ``_ext/payloads.pyx`` must give the same results, the same
bytes and the same errors. The contracts are documented in ``statestore_async.daemon.payloads``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from statestore_async._ref import framing as _fr
from statestore_async._ref.table import Table, find_records, key_error, set_records
from statestore_async.errors import DecodeError

if TYPE_CHECKING:
    from statestore_async._ref import Buffer

__all__ = ["get_packed", "put_packed", "remove_packed"]


def _whole(end: int, buf: Buffer, what: str) -> None:
    n = len(memoryview(buf))
    if end != n:
        raise DecodeError(f"{what}: {n - end} unexpected trailing bytes")


def _check_table(table: object, name: str) -> None:
    if not isinstance(table, Table):
        raise TypeError(f"Argument '{name}' has incorrect type (expected {Table.__module__}.Table, got "
                        f"{type(table).__name__})")


def put_packed(table: Table, buf: Buffer, offset: int, min_key: int, max_count: int = _fr.MAX_U32) -> int:
    """Put the pairs of an ``encode_pairs`` payload at ``offset`` of ``buf`` (to its end); the count."""
    _check_table(table, "table")
    items, end = _fr.decode_pairs(buf, offset, max_count)
    _whole(end, buf, "pairs")
    for k, _ in items:
        if len(k) < min_key:
            raise key_error(len(k), min_key)
    set_records(table, items)
    return len(items)


def remove_packed(table: Table, buf: Buffer, offset: int, min_key: int, max_count: int = _fr.MAX_U32) -> int:
    """A tombstone for each key of an ``encode_list`` payload at ``offset`` of ``buf``; the count."""
    _check_table(table, "table")
    keys, end = _fr.decode_list(buf, offset, max_count)
    _whole(end, buf, "list")
    for k in keys:
        if len(k) < min_key:
            raise key_error(len(k), min_key)
    set_records(table, ((k, None) for k in keys))
    return len(keys)


def get_packed(overlay: Table | None, base: Table, buf: Buffer, offset: int, max_count: int = _fr.MAX_U32) -> bytes:
    """The values of the keys of an ``encode_list`` payload, as an ``encode_optional_list`` payload."""
    if overlay is not None:
        _check_table(overlay, "overlay")
    if base is None:
        raise TypeError("Argument 'base' must not be None")
    _check_table(base, "base")
    keys, end = _fr.decode_list(buf, offset, max_count)
    _whole(end, buf, "list")
    return _fr.encode_optional_list(find_records(overlay, base, keys))
