"""The daemon's request layer over the engine: a request's batch payload read straight into an
open version, and a GET_MANY's answer written straight from it, with no copy of the records on the
way in and no Python object per key or value.

The batch routines (the daemon's hot paths; compiled from ``_ext/payloads.pyx`` when built, else
``statestore_async._ref.payloads``: the same results, bytes and errors) work on engine tables
(``engine.table``); the engine knows nothing of frames or payloads:

``put_packed(table, buf, offset, min_key, max_count=0xFFFFFFFF) -> int``
    Put the pairs of a ``framing.encode_pairs`` payload at ``offset`` of ``buf`` (it runs to the
    end of ``buf``; trailing bytes are an error, as the daemon always did). The whole payload is
    checked first: a malformed one raises ``DecodeError`` as ``framing.check_pairs`` does (same
    messages), then a key shorter than ``min_key`` raises ``KeyFormatError``; nothing is set in
    either case. Returns the count.
``remove_packed(table, buf, offset, min_key, max_count=0xFFFFFFFF) -> int``
    A tombstone for each key of a ``framing.encode_list`` payload, checked the same way.
``get_packed(overlay, base, buf, offset, max_count=0xFFFFFFFF) -> bytes``
    For each key of the ``encode_list`` payload: ``overlay``'s entry when it has the key (a
    tombstone gives None), else ``base``'s value (None when absent); the answer is exactly
    ``framing.encode_optional_list(values)``. ``overlay`` may be None.

``put_many``, ``remove_many`` and ``get_many`` apply them to a ``StoreVersion`` through its batch
interface (``write_batch``, ``memory_tables``, ``look_up``); a request's items that came as Python
objects go through the version's ordinary calls.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from statestore_async.codecs import framing, twins
from statestore_async.codecs.keylayout import KEY_GROUP_BYTES
from statestore_async.codecs.packed import PackedList, PackedPairs
from statestore_async.engine.lookup import KeyLookup

if TYPE_CHECKING or twins.NO_EXTENSIONS:
    from statestore_async._ref.payloads import get_packed, put_packed, remove_packed
else:
    try:
        from statestore_async._native.payloads import get_packed, put_packed, remove_packed
    except ImportError as _exc:
        twins.missing('payloads', _exc)
        from statestore_async._ref.payloads import get_packed, put_packed, remove_packed

if TYPE_CHECKING:
    from collections.abc import Iterable

    from statestore_async.engine.store import StoreVersion

__all__ = ["get_many", "get_packed", "put_many", "put_packed", "remove_many", "remove_packed"]

# a request's key count is checked by the protocol already: the routines need no lower cap
_ANY_COUNT = (1 << 32) - 1


def put_many(w: StoreVersion, items: PackedPairs | Iterable[tuple[bytes, bytes]]) -> None:
    """PUT_MANY: a payload's pairs read straight into ``w``'s changes; all checked before any is set."""
    if type(items) is PackedPairs:
        buf, offset = items.buf, items.offset
        w.write_batch(lambda changes: put_packed(changes, buf, offset, KEY_GROUP_BYTES, _ANY_COUNT), "put to")
    else:
        w.put_many(items)


def remove_many(w: StoreVersion, keys: PackedList | Iterable[bytes]) -> None:
    """REMOVE_MANY: a tombstone in ``w``'s changes for each key of a payload; all checked first."""
    if type(keys) is PackedList:
        buf, offset = keys.buf, keys.offset
        w.write_batch(lambda changes: remove_packed(changes, buf, offset, KEY_GROUP_BYTES, _ANY_COUNT),
                      "remove from")
    else:
        w.remove_many(keys)


def get_many(w: StoreVersion, keys: PackedList) -> bytes:
    """GET_MANY: the values of a payload's keys as a ``framing.encode_optional_list`` payload (None:
    absent), written straight from the tables' memory, or, once spilled, from the levels' chunks
    of values (``engine.lookup``)."""
    tables = w.memory_tables()
    if tables is not None:
        return get_packed(tables[0], tables[1], keys.buf, keys.offset, _ANY_COUNT)
    offsets, _end = framing.list_offsets(keys.buf, keys.offset)
    found = w.look_up(KeyLookup(keys.buf, np.frombuffer(offsets, np.int64)))
    return framing.encode_found(found.value_bytes(), found.voff, found.vlen, found.found)

