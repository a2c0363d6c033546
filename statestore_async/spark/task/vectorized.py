"""A vectorized processor's run over a partition: keys and state as Arrow columns throughout, its
timers as arrays (the stored due timers scanned while ``process`` runs, its changes applied to
them), the expired timers handed over in one call.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from statestore_async.codecs import arrowcodec, valuecodec
from statestore_async.errors import (
    InterfaceError,
)
from statestore_async.spark.api.processors import (
    VectorizedProcessor,
    check_declarations,
    uses_vectorized_timers,
    vectorized_declarations,
)
from statestore_async.spark.api.timers import VectorizedTimers
from statestore_async.spark.shared.taskspec import TaskSpec
from statestore_async.spark.task.grouping import kg_prefixes
from statestore_async.spark.task.output import vectorized_output, where
from statestore_async.spark.task.storecalls import Puts, Removes, empties
from statestore_async.spark.task.timers import due_records, start_due_timer_scan, stored_timers
from statestore_async.state.keys import KIND_OF, owned_key_groups, parse_timer_columns, timer_record_columns

if TYPE_CHECKING:
    from statestore_async.client.clients import StoreHandle


def run_vectorized(processor: VectorizedProcessor, spec: TaskSpec, keys_table: pa.Table, rows: pa.Table,
                    offsets: np.ndarray, kgs: np.ndarray, handle: StoreHandle,
                    timings: dict[str, float], partition: int = 0,
                    ) -> tuple[pa.Table, list[tuple[Puts, Removes]], dict[str, dict[str, Any]]]:
    """Keys, state and changes stay Arrow columns end to end (``arrowcodec``): no Python object per key.

    With timers (``handle_expired_timers``): the range scan of the due timers the store holds is
    sent as soon as the rows' keys' state is read, and the daemon runs it while ``process`` runs.
    The timers that fire are those stored due ones ``process`` did not delete, and those it
    registered at a due time; their keys' state is the one ``process`` left (read from the store for
    keys without rows); ``handle_expired_timers`` runs once. Nothing is written before: the changes
    of ``process``, then those of the call and the fired timers' removal (but for those the call
    registered again) are returned as two (puts, removals) pairs, each touching a key once at most,
    to be written in that order before the commit (so a later change of a store key wins without a
    search for the keys both change). A batch without rows runs only the timers' part."""
    schema = processor.state_schema
    if not isinstance(schema, pa.Schema):
        raise InterfaceError(f"{type(processor).__name__}.state_schema must be a pyarrow.Schema")
    states = vectorized_declarations(processor)
    check_declarations(spec.declared, states, where(processor, spec))
    timers = VectorizedTimers(spec.time_mode, uses_vectorized_timers(processor))
    processor.timers, processor.processing_time_ms, processor.watermark_ms = timers, spec.now_ms, spec.watermark_ms
    timings["read"] = timings["process"] = 0.0
    empty = pa.array([], pa.binary())
    scan: list[Callable[[], pa.Array]] = []

    def start_scan() -> None:
        scan.append(start_due_timer_scan(handle, owned_key_groups(partition, spec.num_partitions, spec.num_key_groups),
                                         spec.now_ms, spec.watermark_ms))

    outputs: list[pa.Table] = []
    handled, puts, gone = empty, (empty, empty), None
    if keys_table.num_rows:
        if timers.enabled:
            timers.bind_keys(arrowcodec.encode_tuples(keys_table.columns, key=True), kgs)
            timers.load_timers = _timer_loader(handle, spec.num_key_groups)
        try:
            out, puts, gone, handled = _vectorized_call(processor, processor.process, schema, spec, keys_table, kgs,
                                                        handle, timings, (rows, offsets),
                                                        after_read=start_scan if timers.enabled else None)
        except BaseException:
            _drain(scan)
            raise
        outputs.append(out)
    if not timers.enabled:
        return _vectorized_output_of(outputs, spec), [(puts, gone)], states
    t = time.perf_counter()
    if not scan:
        start_scan()
    tp, tr = timers.batch_changes()
    due = _due_timers(scan[0](), tp, tr, spec.now_ms, spec.watermark_ms)
    timings["time_scan"] = time.perf_counter() - t
    timings["timers_fired"] = len(due)
    put_keys, put_values = pa.concat_arrays([puts[0], tp]), pa.concat_arrays([puts[1], empties(len(tp))])
    removes = pa.concat_arrays([gone, tr]) if gone is not None else tr
    writes: list[tuple[Puts, Removes]] = [((put_keys, put_values), removes)]
    if len(due):
        timers.load_timers = _overlay_loader(handle, spec.num_key_groups, tp, tr)
        out, puts2, gone2, fired = _fire_vectorized(processor, schema, spec, keys_table, due, timers, handle, timings,
                                                    (handled, puts[0], puts[1]))
        outputs.append(out)
        tp2, tr2 = timers.batch_changes()
        # a fired timer is deleted before its call: one its call registers again stays
        if len(tp2):
            fired = fired.filter(pc.invert(pc.is_in(fired, value_set=tp2)))
        # the call's changes (state puts and removals, timers registered and deleted, the fired
        # timers' records) touch no key twice; written after process's, they win over them
        later_keys, later_values = pa.concat_arrays([puts2[0], tp2]), pa.concat_arrays([puts2[1], empties(len(tp2))])
        later_removes = pa.concat_arrays([r for r in (gone2, tr2, fired) if r is not None])
        writes.append(((later_keys, later_values), later_removes))
    timers.unbind_keys()
    return _vectorized_output_of(outputs, spec), writes, states


def _vectorized_output_of(outputs: list[pa.Table], spec: TaskSpec) -> pa.Table:
    return pa.concat_tables(outputs) if len(outputs) > 1 else (outputs[0] if outputs else
                                                              spec.output_schema.empty_table())


def _drain(scan: list[Callable[[], pa.Array]]) -> None:
    """Read the answer of a scan sent and no longer wanted (its task failed), when the connection
    still stands, so that the shared client keeps nothing of it."""
    for collect in scan:
        with contextlib.suppress(Exception):
            collect()


def _due_timers(stored: pa.Array, registered: pa.Array, deleted: pa.Array, now_ms: int,
                watermark_ms: int | None) -> pa.Array:
    """The by-time records of the timers due in this batch, in store order: the ``stored`` due ones
    not ``deleted`` this batch and those ``registered`` this batch at a due time (``registered`` and
    ``deleted``: timer records of both indexes, as ``VectorizedTimers.batch_changes`` gives them: the
    by-time records first, then the by-key ones, as many)."""
    if len(stored) and len(deleted):
        # which stored due ones a by-time record of ``deleted`` names (a hash of the few stored, not
        # of every deletion)
        named = pc.index_in(deleted.slice(0, len(deleted) // 2).cast(pa.binary()), value_set=stored)
        keep = np.ones(len(stored), bool)
        keep[named.drop_null().to_numpy()] = False
        if not keep.all():
            stored = stored.filter(pa.array(keep))
    new = due_records(registered, now_ms, watermark_ms)
    if not len(new):
        return stored
    if len(stored):
        new = new.filter(pc.invert(pc.is_in(new, value_set=stored)))
    merged = pa.concat_arrays([stored, new])
    return merged.take(pc.sort_indices(merged))


def _timer_loader(handle: StoreHandle, num_key_groups: int) -> Callable[[pa.Array, np.ndarray],
                                                                          list[tuple[int, str, int]]]:
    prefixes = kg_prefixes(num_key_groups)
    return lambda enc, kgs: stored_timers(handle, prefixes, enc.to_pylist(), kgs.tolist())


def _overlay_loader(handle: StoreHandle, num_key_groups: int, registered: pa.Array,
                    deleted: pa.Array) -> Callable[[pa.Array, np.ndarray], list[tuple[int, str, int]]]:
    """``_timer_loader`` as the store would answer with the timers ``registered`` and ``deleted``
    (records of both indexes) written: what ``VectorizedTimers.list`` sees during
    ``handle_expired_timers``, while those changes are not written yet."""
    stored = _timer_loader(handle, num_key_groups)

    def load(enc: pa.Array, kgs: np.ndarray) -> list[tuple[int, str, int]]:
        have = set(stored(enc, kgs))
        where = {e: i for i, e in enumerate(enc.to_pylist())}
        for records, on in ((deleted, False), (registered, True)):
            at_records = due_records(records, _NO_LIMIT_MS, _NO_LIMIT_MS)  # every by-time record of them
            if not len(at_records):
                continue
            _, kinds, at, keys = parse_timer_columns(at_records)
            for e, kb, a in zip(keys.to_pylist(), kinds.tolist(), at.tolist()):
                i = where.get(e)
                if i is not None:
                    (have.add if on else have.discard)((i, KIND_OF[kb], a))
        return sorted(have)

    return load


_NO_LIMIT_MS = (1 << 63) - 1  # the latest time a timer can have


def _vectorized_call(processor: VectorizedProcessor, fn: Callable[..., Any], schema: pa.Schema, spec: TaskSpec,
                     keys_table: pa.Table, kgs: np.ndarray, handle: StoreHandle, timings: dict[str, float],
                     args: tuple[Any, ...], known: tuple[pa.Array, pa.Array, pa.Array] | None = None,
                     after_read: Callable[[], None] | None = None,
                     ) -> tuple[pa.Table, tuple[pa.Array, pa.Array], pa.Array | None, pa.Array]:
    """Read the state of ``keys_table``'s keys (one call; ``known``: see ``_read_state``), call
    ``after_read``, then ``fn(keys, *args, state, exists)``; the output, the state changes it gives
    (puts, removals) and the keys' store keys."""
    n = keys_table.num_rows
    skeys = arrowcodec.encode_tuples(keys_table.columns, key_groups=kgs, head=(processor.state_name,), key=True)
    t = time.perf_counter()
    raw = _read_state(handle, skeys, known)
    timings["read"] += time.perf_counter() - t
    if after_read is not None:
        after_read()
    exists = raw.is_valid().to_numpy(zero_copy_only=False)
    state = arrowcodec.decode_tuples(raw, schema)
    t = time.perf_counter()
    result = fn(keys_table, *args, state, exists)
    new_state, output = result[0], result[1]
    valid = result[2] if len(result) > 2 else None
    if new_state.num_rows != n:
        raise InterfaceError(f"{getattr(fn, '__name__', 'process')} returned {new_state.num_rows} state rows for "
                             f"{n} keys")
    enc = arrowcodec.encode_tuples(new_state.select(schema.names).columns)
    removes = None
    if valid is None:
        puts = (skeys, enc)
    else:
        valid = pa.array(np.asarray(valid, dtype=bool))
        puts = (skeys.filter(valid), enc.filter(valid))
        removes = skeys.filter(pc.and_(pc.invert(valid), pa.array(exists)))
    output = vectorized_output(output, spec.output_schema)
    timings["process"] += time.perf_counter() - t
    return output, puts, removes, skeys


def _read_state(handle: StoreHandle, skeys: pa.Array, known: tuple[pa.Array, pa.Array, pa.Array] | None) -> pa.Array:
    """The stored values of ``skeys`` (null: none), where ``known = (handled, put keys, put values)``
    overrides the store: a key of ``handled`` has the value put for it, or none (it was removed or
    never had one); only the others are read from the store (one call)."""
    if known is None or not len(known[0]):
        return handle.get_many_arrow(skeys)
    handled, put_keys, put_values = known
    mine = pc.is_in(skeys, value_set=handled)
    if not pc.any(mine).as_py():
        return handle.get_many_arrow(skeys)
    ours = put_values.cast(pa.binary()).take(pc.index_in(skeys, value_set=put_keys))
    rest = pc.invert(mine)
    if not pc.any(rest).as_py():
        return ours
    stored = handle.get_many_arrow(skeys.filter(rest))
    return pc.replace_with_mask(ours, rest, stored.cast(pa.binary()))


def _fire_vectorized(processor: VectorizedProcessor, schema: pa.Schema, spec: TaskSpec, batch_keys: pa.Table,
                     due: pa.Array, timers: VectorizedTimers, handle: StoreHandle, timings: dict[str, float],
                     known: tuple[pa.Array, pa.Array, pa.Array] | None = None,
                     ) -> tuple[pa.Table, tuple[pa.Array, pa.Array], pa.Array | None, pa.Array]:
    """``handle_expired_timers`` of the due timers (``due``: their by-time records, in store order):
    the timers table in firing order (time, kind, key group, key), the distinct keys, their state
    (``known``: the state ``process`` left, see ``_read_state``). Returns the call's output and
    state changes, and the fired timers' records (both indexes) to remove."""
    kg, kinds, at, enc = parse_timer_columns(due)
    order = np.lexsort((kg, kinds, at))  # stable: ties keep the store's order (by key)
    kg, kinds, at = kg[order], kinds[order], at[order]
    enc = enc.take(pa.array(order))
    codes = pc.dictionary_encode(enc)
    key_index = codes.indices.to_numpy(zero_copy_only=False).astype(np.int64)
    distinct = codes.dictionary
    firsts = np.zeros(len(distinct), np.int64)
    firsts[key_index[::-1]] = np.arange(len(key_index) - 1, -1, -1)
    key_kgs = kg[firsts]
    keys_table = _decode_keys(distinct, spec, batch_keys)
    kind_names = np.array([KIND_OF.get(b, "") for b in range(256)], object)
    timers_table = keys_table.take(pa.array(key_index)).append_column(
        "key_index", pa.array(key_index, pa.int64())).append_column(
        "at_ms", pa.array(at, pa.int64())).append_column("kind", pa.array(kind_names[kinds].tolist(), pa.string()))
    timers.bind_keys(distinct, key_kgs)
    fired = pa.concat_arrays(list(timer_record_columns(kg, kinds, at, enc)))
    out, puts, removes, _ = _vectorized_call(processor, processor.handle_expired_timers, schema, spec, keys_table,
                                             key_kgs, handle, timings, (timers_table,), known)
    return out, puts, removes, fired


def _decode_keys(enc: pa.Array, spec: TaskSpec, batch_keys: pa.Table) -> pa.Table:
    """The grouping keys ``encode_key``-ed in ``enc`` as a table of the key columns, typed as the
    batch's key columns (``spec.key_schema``, or the batch's rows' types; in a batch without rows
    and no schema given, inferred from the values: int64, double, string...)."""
    schema = spec.key_schema if spec.key_schema is not None else (batch_keys.schema if batch_keys.num_columns else None)
    if schema is not None:
        return arrowcodec.decode_tuples(enc, schema)
    rows = valuecodec.decode_rows(enc.to_pylist())
    cols = list(zip(*rows)) if rows else [() for _ in spec.key_columns]
    return pa.table({c: pa.array(list(v)) for c, v in zip(spec.key_columns, cols)})
