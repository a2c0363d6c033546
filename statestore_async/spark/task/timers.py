"""A per-key task's work with time: due timers, its keys' timers, the expiry index and TTL cleanup.

``TaskTime`` talks to the open version of the partition's store through range scans
(``StoreHandle.scan_ranges``): the due timers are one range per owned key group and kind, the
values due to expire one range per owned key group (``state.keys``), so a batch pays
O(key groups + due) for them, whatever the store holds. Nothing here runs for a processor that
uses neither timers nor TTLs.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from statestore_async.codecs import arrowcodec, keylayout, valuecodec
from statestore_async.spark.api.lifecycle import BatchState
from statestore_async.spark.api.timers import Timers
from statestore_async.state import keys as tk

if TYPE_CHECKING:
    from statestore_async.client.clients import StoreHandle


class TaskTime:
    """One try of one partition's batch: which timers are due, the keys they belong to, and the
    store changes that timers and TTLs make (``changes``)."""

    def __init__(self, handle: StoreHandle, partition: int, num_partitions: int, num_key_groups: int,
                 now_ms: int, watermark_ms: int | None, timers: Timers):
        self.handle = handle
        self.now_ms = now_ms
        self.kgs = tk.owned_key_groups(partition, num_partitions, num_key_groups)
        self.prefixes = keylayout.prefixes(num_key_groups)
        self.timers = timers
        self.thresholds: dict[str, int] = {}
        if timers.enabled:
            self.thresholds[tk.PROCESSING] = now_ms
            if watermark_ms is not None:
                self.thresholds[tk.EVENT] = watermark_ms
        timers.due_by = {tk.KIND_BYTE[kind]: at for kind, at in self.thresholds.items()}
        # key index -> encode_key(grouping key) / key group: the batch's keys, then the due timers' keys
        # without rows (``scan_due``)
        self.enc: pa.Array = pa.array([], pa.binary())
        self.kg: np.ndarray = np.zeros(0, np.int64)
        # the due timers the store holds, in store order: kind byte, at_ms, key index
        self.stored_due: tuple[np.ndarray, np.ndarray, np.ndarray] = (np.zeros(0, np.uint8), np.zeros(0, np.int64),
                                                                      np.zeros(0, np.int64))
        self._scan: Callable[[], pa.Array] | None = None
        self.fired = 0
        self.ttl_removed = 0

    # -- keys ----------------------------------------------------------------------------------------
    def start_scan(self) -> None:
        """Send the scan of the due timers now (the daemon scans while the task encodes its keys);
        ``scan_due`` reads it."""
        if self.thresholds and self._scan is None:
            self._scan = start_due_timer_scan(self.handle, self.kgs, self.now_ms, self.thresholds.get(tk.EVENT))

    def add_batch_keys(self, key_columns: Sequence[pa.Array | pa.ChunkedArray], kgs: np.ndarray) -> None:
        """The batch's keys (its key columns, one row per key, in key index order) and their key groups."""
        n = len(kgs)
        self.enc = arrowcodec.encode_tuples(key_columns, key=True).cast(pa.binary()) if n else pa.array([], pa.binary())
        self.kg = np.asarray(kgs, np.int64)

    def scan_due(self) -> tuple[list[tuple], list[int]]:
        """Read the due timers the store holds; returns the keys (tuples) and key groups of those
        that are not batch keys (the timers' keys without rows), which get the next key indexes, in
        the order of their first timer. All as columns: the keys without rows decoded in one call."""
        self.start_scan()
        if self._scan is None:
            return [], []
        recs, self._scan = self._scan(), None
        if not len(recs):
            return [], []
        kgs, kinds, ats, encs = tk.parse_timer_columns(recs)
        encs = encs.cast(pa.binary())
        n = len(self.enc)
        found = pc.index_in(encs, value_set=self.enc)  # the batch's keys are distinct
        idx = found.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)
        missing = idx < 0
        extra_keys: list[tuple] = []
        extra_kgs: list[int] = []
        if missing.any():
            where = np.flatnonzero(missing)
            coded = encs.take(pa.array(where)).dictionary_encode()  # dictionary: first-timer order
            codes = coded.indices.to_numpy(zero_copy_only=False).astype(np.int64)
            idx[where] = n + codes
            _, first = np.unique(codes, return_index=True)
            new_kgs = kgs[where[first]].astype(np.int64)
            self.enc = pa.concat_arrays([self.enc, coded.dictionary.cast(pa.binary())])
            self.kg = np.concatenate([self.kg, new_kgs])
            extra_kgs = new_kgs.tolist()
            extra_keys = [tuple(k) for k in valuecodec.decode_rows(coded.dictionary.to_pylist())]
        self.stored_due = (np.asarray(kinds, np.uint8), ats, idx)
        return extra_keys, extra_kgs

    def load_timers(self) -> dict[int, set[tuple[str, int]]]:
        """Every stored timer of every key of the task (one request), by key index: for ``list``."""
        out: dict[int, set[tuple[str, int]]] = {}
        for i, kind, at in stored_timers(self.handle, self.prefixes, self.enc.to_pylist(), self.kg.tolist()):
            out.setdefault(i, set()).add((kind, at))
        return out

    # -- firing ---------------------------------------------------------------------------------------
    def due_now(self) -> list[tuple[int, str, int]]:
        """``(at_ms, kind, key index)`` of every timer to fire after the rows, in time order (ties:
        the store's order, by key group then key): the stored due ones the rows did not delete, and
        the ones the rows registered at a due time."""
        changes = self.timers.batch_changes
        kinds, ats, idx = self.stored_due
        keep = np.ones(len(idx), bool)
        kind_of = tk.KIND_OF
        if changes:
            for j, key in enumerate(zip(idx.tolist(), kinds.tolist(), ats.tolist())):
                if changes.get(key) is False:
                    keep[j] = False
        # store order is (key group, kind, at, key): a stable sort by (at, kind) keeps ties in it
        order = np.lexsort((kinds, ats))
        order = order[keep[order]]
        out = list(zip(ats[order].tolist(), [kind_of[k] for k in kinds[order].tolist()], idx[order].tolist()))
        added = {(at, kind_of[kb], i) for i, kb, at in self.timers.registered_due
                 if changes[(i, kb, at)]}.difference(out)
        if added:  # timers the rows registered at a due time: in the same order as the stored ones
            kind_byte, kg, enc = tk.KIND_BYTE, self.kg, self.enc
            both = sorted((at, kind_byte[kind], int(kg[i]), enc[i].as_py(), kind, i) for at, kind, i in [*out, *added])
            out = [(t[0], t[4], t[5]) for t in both]
        return out

    # -- what the batch writes ------------------------------------------------------------------------
    def timer_changes(self) -> tuple[pa.Array, pa.Array]:
        """(keys to put with an empty value, keys to remove) of the timers' two indexes, as binary
        arrays built column-wise (``state.keys.timer_record_columns``)."""
        changes = self.timers.batch_changes
        if not changes:
            empty = pa.array([], pa.binary())
            return empty, empty
        idx, kinds, ats = zip(*changes)
        where = np.array(idx, np.int64)
        by_time, by_key = tk.timer_record_columns(self.kg[where].astype(np.uint16), np.array(kinds, np.uint8),
                                                  np.array(ats, np.int64), self.enc.take(pa.array(where)))
        on = pa.array(np.fromiter(changes.values(), bool, len(changes)))
        off = pc.invert(on)
        return (pa.concat_arrays([by_time.filter(on), by_key.filter(on)]),
                pa.concat_arrays([by_time.filter(off), by_key.filter(off)]))

    def ttl_index(self, var: BatchState, put_keys: pa.Array) -> list[bytes]:
        """The expiry index records of a TTL'd variable's values written this batch (all expire at
        ``now + ttl``)."""
        assert var.ttl_ms is not None
        expires = self.now_ms + var.ttl_ms
        return [tk.ttl_key(k, expires) for k in put_keys.to_pylist()]

    def ttl_cleanup(self, handled: set[bytes], entry_states: frozenset[str] = frozenset(),
                    ) -> tuple[list[bytes], list[tuple[bytes, bytes]], int]:
        """The expiry index records due by ``now`` (all removed) and the values they name that are
        expired: removed too unless this batch handled their key (``handled``: the store keys whose
        values the task read, which the variables remove or rewrite themselves). A list or map of
        ``entry_states`` (per-entry TTL) whose entries expired only in part is rewritten without
        them. Returns the keys to remove, the (key, value) pairs to put, and how many values (entries
        of lists and maps) were removed for having expired."""
        due = [k for k, _ in self.handle.scan_ranges(tk.ttl_ranges(self.kgs, self.now_ms))]
        if not due:
            return [], [], 0
        targets = sorted({sk for sk in (tk.parse_ttl_key(k)[1] for k in due) if sk not in handled})
        removes = list(due)
        puts: list[tuple[bytes, bytes]] = []
        removed = 0
        now = self.now_ms
        if targets:
            for sk, raw in zip(targets, self.handle.get_many(targets)):
                if raw is None:
                    continue
                row = _ttl_row(raw)
                if row is None:
                    continue
                expires, value = row
                per_entry = isinstance(value, (list, dict)) and valuecodec.decode_row(sk[2:])[0] in entry_states
                if expires <= now:
                    removes.append(sk)
                    removed += len(value) if per_entry else 1
                elif per_entry:
                    pairs = value.items() if isinstance(value, dict) else enumerate(value)
                    if any(ev[0] <= now for _, ev in pairs):
                        if isinstance(value, dict):
                            keep: Any = {k: ev for k, ev in value.items() if ev[0] > now}
                        else:
                            keep = [ev for ev in value if ev[0] > now]
                        removed += len(value) - len(keep)
                        latest = max(ev[0] for ev in (keep.values() if isinstance(keep, dict) else keep))
                        puts.append((sk, valuecodec.encode_row((latest, keep))))
        return removes, puts, removed


def stored_timers(handle: StoreHandle, prefixes: Sequence[bytes], enc: list[bytes],
                  kgs: list[int]) -> list[tuple[int, str, int]]:
    """``(key index, kind, at_ms)`` of every stored timer of the keys ``enc[i]`` (``encode_key`` of the
    grouping key) in key group ``kgs[i]`` (``prefixes``: the key group prefixes): one request."""
    starts = sorted((prefixes[g] + bytes((tk.TIMER_KEY,)) + e, i) for i, (e, g) in enumerate(zip(enc, kgs)))
    out: list[tuple[int, str, int]] = []
    if not starts:
        return out
    ranges = [(p, tk.prefix_stop(p)) for p, _ in starts]
    j = 0
    for k, _ in handle.scan_ranges(ranges):
        while not k.startswith(starts[j][0]):
            j += 1
        kind, at = tk.parse_timer_by_key(k, len(starts[j][0]))
        out.append((starts[j][1], kind, at))
    return out


def thresholds(now_ms: int, watermark_ms: int | None) -> dict[str, int]:
    """Up to which time each kind of timer is due: processing by the batch's clock, event by the
    watermark (none before there is one)."""
    out = {tk.PROCESSING: now_ms}
    if watermark_ms is not None:
        out[tk.EVENT] = watermark_ms
    return out


def start_due_timer_scan(handle: StoreHandle, kgs: range, now_ms: int,
                         watermark_ms: int | None) -> Callable[[], pa.Array]:
    """The by-time records of every due timer of the key groups ``kgs`` (one SCAN_RANGES), as a
    binary array in store order (by key group, kind, time, key): the request goes out now
    (``StoreHandle.start_scan_ranges``) and the function returned reads the answer, so the daemon
    scans while the task works."""
    collect = handle.start_scan_ranges(tk.due_ranges(kgs, thresholds(now_ms, watermark_ms)))
    return lambda: pa.array([k for k, _ in collect()], pa.binary())


def due_records(records: pa.Array, now_ms: int, watermark_ms: int | None) -> pa.Array:
    """The by-time timer records among ``records`` (any store keys) that are due by ``now_ms``
    (processing) and ``watermark_ms`` (event; none before there is one)."""
    if not len(records):
        return records
    records = records.cast(pa.binary())
    at_records = records.filter(pc.equal(pc.binary_slice(records, 2, 3), pa.scalar(bytes((tk.TIMER_AT,)), pa.binary())))
    if not len(at_records):
        return at_records
    _, kinds, at, _ = tk.parse_timer_columns(at_records)
    due = (kinds == tk.KIND_BYTE[tk.PROCESSING]) & (at <= now_ms)
    if watermark_ms is not None:
        due |= (kinds == tk.KIND_BYTE[tk.EVENT]) & (at <= watermark_ms)
    return at_records.filter(pa.array(due))


def _ttl_row(raw: bytes) -> tuple[int, Any] | None:
    """``(expires_at_ms, value)`` of a TTL'd value record ``encode_row((expires_at_ms, value))``
    (None: not one)."""
    try:
        row: Any = valuecodec.decode_row(raw)
    except ValueError:
        return None
    if isinstance(row, tuple) and len(row) == 2 and isinstance(row[0], int):
        return row[0], row[1]
    return None
