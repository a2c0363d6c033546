"""Batch operations on an open version's overlay (used by ``engine.StoreVersion``).

The overlay is the dict of an open version's changes: key → value, or None for a tombstone.
Entries are accounted as ``len(key) + len(value) + overhead`` bytes (``engine.ENTRY_OVERHEAD``);
the write functions return how much the accounted bytes changed.

``put_items(overlay, items, min_key, overhead) -> int``
    Put every (key, value) pair. Keys are bytes of at least ``min_key`` bytes, values bytes
    (bytearray/memoryview are copied). Every pair is checked before any is set: a bad one raises
    ``KeyFormatError`` / ``InterfaceError`` and leaves the overlay untouched.
``remove_keys(overlay, keys, min_key, overhead) -> int``
    A tombstone for every key, checked the same way.
``get_list(overlay, base, keys) -> list``
    Each key's value: the overlay's when it has the key (None for a tombstone), else ``base.get``.
``put_packed(overlay, buf, offset, min_key, overhead, max_count) -> (count, int)``
``remove_packed(overlay, buf, offset, min_key, overhead, max_count) -> (count, int)``
    The same for a payload from ``framing.encode_pairs`` / ``encode_list`` at ``offset`` of ``buf``
    (to its end), read straight into the overlay. A malformed payload raises ``DecodeError``
    (as ``framing`` does), then a short key ``KeyFormatError``; nothing is set in either case.
``get_packed(overlay, base, buf, offset, max_count) -> bytes``
    The values of the keys of an ``encode_list`` payload, encoded as ``encode_optional_list``.
``apply_changes(data, changes, overhead) -> (pre, records, data_delta, undo_bytes, record_bytes)``
    Apply a commit's (or a rollback's) key → value|None to the committed map ``data`` in one
    pass: ``records`` holds the changes that changed something (a removal of an absent key is
    dropped; ``records`` is ``changes`` itself when nothing was dropped: do not change either
    afterwards), ``pre`` the value of each key of ``records`` before, in ``records``' order, as a
    list (None: absent), ``data_delta`` how much the accounted bytes of ``data`` changed,
    ``undo_bytes`` the accounted bytes of the pre-images, and ``record_bytes`` the keys and values
    of ``records`` (+ 8 per record) for the upload queue.
``group_records(keys, start, stop, shadow, data, groups) -> None``
    Sort the records of ``keys[start:stop]`` (a list of bytes) into ``groups``, a list of
    ``KEY_GROUP_SLOTS`` (65536) slots, by key group (a key's first two bytes, big-endian; 0 for a
    shorter key): the slot's list (made when the slot is None) gets the key and its value appended,
    the value being ``shadow[key]`` when ``shadow`` has the key, else ``data.get(key)``; a key
    whose value is None is left out. Called a chunk at a time over a frozen view's keys, which
    are in the map's own order, so the lookups walk the map's memory in order.
``gather_records(groups, cursor, max_bytes) -> (records, cursor)``
    The next (key, value) records of ``groups`` in key-group order from ``cursor`` = (slot,
    index), starting at (0, 0): records are gathered while the sum of ``len(key) + len(value) +
    11`` stays within ``max_bytes`` (at least one record when any is left); the returned cursor
    goes on from there, and records is empty at the end. A slot gone through is set to None, so
    the records leave memory as they are handed out.

Compiled from ``_ext/overlay.pyx`` when built, else ``statestore_async._ref.overlay``; both give
the same results and errors.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from statestore_async.codecs import twins

if TYPE_CHECKING or twins.NO_EXTENSIONS:
    from statestore_async._ref.overlay import *
else:
    try:
        from statestore_async._native.overlay import *
    except ImportError as _exc:
        twins.missing('overlay', _exc)
        from statestore_async._ref.overlay import *


