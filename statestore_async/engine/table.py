"""A compact map for the engine: ``Table``, bytes → bytes | None, and the batch routines on it.

Keys and values are ``bytes`` (bytearray / memoryview are accepted and copied; any other key type
raises ``KeyFormatError``, any other value type ``InterfaceError``). A value of None is a
*tombstone entry*: the key is present with no value. The overlay of an open version uses
tombstones; a committed table never holds one (its callers ensure it). Key order is the byte order
of ``bytes`` comparison (memcmp, a shorter prefix first).

``Table()``
    ``len(t)`` counts entries (tombstones included); ``t.get(key)`` → the value, or None when the
    key is absent or a tombstone; ``key in t`` (True for a tombstone too); ``t.put(key, value |
    None)``; ``t.delete(key) -> bool`` removes the entry (tombstone or not), False when there was none.
``t.record_bytes``
    Sum of ``len(key) + len(value or b"")`` over the entries.
``t.nbytes``
    Memory accounting: in the compiled twin the bytes it has really allocated (arena + hash index +
    order index + the sorted refs held by its live views); in the reference twin an estimate (the
    two differ; nothing else does).
``t.items(start=b"", stop=None)``
    Iterator of (key, value | None) with ``start <= key < stop`` in key order. Changing the table
    while iterating makes the iterator's next step raise ``RuntimeError`` (use ``freeze``).
``t.scan(prefix) -> list``
    (key, value | None) for every key starting with ``prefix``, in key order. ``t.keys()`` every
    key in key order. ``t.ranges(ranges) -> list``: ``items`` of each (start, stop) of ``ranges``
    (ascending and disjoint) as one list, in one call.
    The first ordered call (items, scan, keys) builds an order index that the table keeps from
    then on: later ordered calls cost O(log n + matches) and writes keep it up to date in
    amortized O(1). A table never read in order holds no order index; ``freeze`` on such a table
    sorts the records for the view alone and leaves the table without one.
``t.freeze() -> TableView``
    The table as it is now; the table may go on changing (puts, deletes, ``apply``) without the
    view seeing it. ``len(view)``; ``view.get(key)``; ``view.items(start=b"", stop=None)`` in key
    order (tombstone entries included, as in ``Table.items``); ``view.chunk(pos, max_bytes) ->
    (records, next_pos)``: the records from index ``pos`` in key order, gathered while the sum of
    ``len(key) + len(value) + 11`` stays within ``max_bytes`` (at least one record when any is
    left), and the index after them; an empty list at the end (a negative ``pos`` raises
    ``InterfaceError``). ``view.release()`` (idempotent; a view is also a context manager): after it
    every read of the view raises ``StoreStateError``. While any view of a table lives, the table
    writes only at the end of its arena; release views when done so that it can reclaim garbage.
``view.chunk_packed(pos, max_bytes) -> (payload, next_pos, min_kg, max_kg)``
    The records from index ``pos`` in key order as one ``codecs.blockcodec`` records payload (the
    bytes of ``blockcodec.encode_records_raw`` of them), written straight from the arena, as many
    as fit in ``max_bytes`` of payload (at least one when any is left; the rule of
    ``blockcodec.encode_block``), with the smallest and largest key group (a key's first two bytes,
    big-endian; 0 for a shorter key) among them; ``(b"", pos, 0, 0)`` at the end. Checkpoint files
    are written with it (``files.checkpoint``): no Python object per record.
Batch routines (the compiled twin writes and reads the arena with no Python object per record; the
daemon's request routines, ``daemon.payloads``, read request payloads into tables through
``_native/table.pxd``):

``put_items(table, items, min_key) -> int`` / ``remove_keys(table, keys, min_key) -> int``
    Put every (key, value) of an iterable / a tombstone for every key, with the checks and
    messages of the engine's single-record ``put`` / ``remove`` (a key shorter than ``min_key``
    raises ``KeyFormatError``); all are checked before any is set. Returns the count.
``get_list(overlay, base, keys) -> list[bytes | None]``
    For each key: ``overlay``'s entry when it has the key (a tombstone gives None), else
    ``base``'s value (None when absent). ``overlay`` may be None.
``apply(base, changes) -> (applied, undo)``
    Apply ``changes`` (a table, tombstones allowed) to ``base`` (no tombstones): a value sets the
    key, a tombstone deletes it. ``applied`` holds the entries of ``changes`` that changed
    something (a tombstone of a key absent from ``base`` is dropped); it is ``changes`` itself when
    nothing was dropped — callers must not change either afterwards. ``undo`` holds, for each key
    of ``applied``, the value ``base`` had before (None: it was absent), so ``apply(base, undo)``
    rolls the change back. Costs O(len(changes)). ``base`` and ``changes`` must be two tables.
``load_records(table, records, keep_tombstones=False) -> None``
    Bulk put of (key, value | None) pairs in order, where None deletes the key (not a tombstone):
    rebuilding a state from checkpoint files. With ``keep_tombstones`` a None sets a tombstone
    entry instead (a delta file's block read as a run). All are checked before any is set.
``pack_keys(keys) -> (kbuf, koff)``
    ``keys`` laid end to end, each after its u32 length (little-endian), and the int64 offsets of
    the keys there (native order): the form ``lookup_spans`` reads (``KeyFormatError`` for a key
    that is not bytes-like).
``lookup_spans(table, kbuf, koff, js, found, voff, vlen, base) -> bytes``
    ``blockcodec.RecordBlock.lookup_spans`` over the table's entries (a tombstone entry is found,
    its ``vlen`` -1): a spilled version's reads ask it of their changes and hot part, then the
    runs' blocks, each level for the keys not found yet (``engine.lookup.KeyLookup``), with no
    Python object per key or value.

Compiled from ``_ext/table.pyx`` when built, else ``statestore_async._ref.table``; both give the
same results, bytes and errors (``nbytes`` aside).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from statestore_async.codecs import twins

if TYPE_CHECKING or twins.NO_EXTENSIONS:
    from statestore_async._ref.table import *  # noqa: F403
else:
    try:
        from statestore_async._native.table import *  # noqa: F403
    except ImportError as _exc:
        twins.missing('table', _exc)
        from statestore_async._ref.table import *  # noqa: F403
