"""A per-key processor's run over a partition: every key's state read in one call and decoded in
one, ``handle_rows`` per key in chunks of ``PER_KEY_CHUNK`` keys (the cyclic GC paused), the due
timers fired in time order, the changes encoded and written in one call each.
"""
from __future__ import annotations

import contextlib
import gc
import itertools
import time
import types
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from statestore_async.codecs import arrowcodec
from statestore_async.errors import (
    InterfaceError,
    OutputRowError,
)
from statestore_async.spark.api.lifecycle import BatchState
from statestore_async.spark.api.processors import KeyState, StatefulProcessor, StateHandle, check_declarations, uses_timers
from statestore_async.spark.api.timers import ExpiredTimer
from statestore_async.spark.shared.taskspec import TaskSpec
from statestore_async.spark.task.grouping import store_keys
from statestore_async.spark.task.output import output_table, short_repr, where
from statestore_async.spark.task.timers import TaskTime
from statestore_async.spark.task.vectorized import empties

if TYPE_CHECKING:
    from statestore_async.client.clients import StoreHandle


def run_per_key(processor: StatefulProcessor, spec: TaskSpec, keys_table: pa.Table, rows_table: pa.Table,
                 offsets: np.ndarray, kgs: np.ndarray, handle: StoreHandle,
                 timings: dict[str, float], partition: int = 0, initial: bool = False,
                 ) -> tuple[pa.Table, tuple[pa.Array, pa.Array], pa.Array, dict[str, dict[str, Any]]]:
    """A ``StatefulProcessor`` over the partition's keys: every key's state read in one call and
    decoded in one, then ``handle_rows`` per key; returns the output table, the state's puts and
    removals (Arrow arrays: the store keys never become Python objects), and the state
    declarations (checked against ``spec.declared`` before any state is read).

    With time work (timers, TTLs: ``TaskTime``) the keys of due timers join the batch's keys (their
    state is read in the same call), ``handle_expired_timer`` runs per due timer after the rows,
    and the timers' and the expiry index's records, and the expired values found by the index,
    join the writes. ``initial``: the rows are the initial state's (``handle_initial_state`` per key;
    timers registered and TTL'd values written are stored, nothing fires or expires)."""
    h = StateHandle(spec.time_mode, uses_timers(processor))
    processor.init(h)
    variables = list(h.variables.values())
    if not variables:
        raise InterfaceError(f"{type(processor).__name__}.init declared no state")
    states = h.declarations()
    check_declarations(spec.declared, states, where(processor, spec))
    h.processing_time_ms, h.watermark_ms = spec.now_ms, spec.watermark_ms
    n = keys_table.num_rows
    if n:
        skeys = [arrowcodec.encode_tuples(keys_table.columns, key_groups=kgs, head=(v.name,), key=True)
                 for v in variables]
    else:
        skeys = [pa.array([], pa.binary()) for _ in variables]
    tt: TaskTime | None = None
    keys: list[tuple] | None = None
    if h.timers.enabled or any(v.ttl_ms is not None for v in variables):
        t = time.perf_counter()
        tt = TaskTime(handle, partition, spec.num_partitions, spec.num_key_groups, spec.now_ms, spec.watermark_ms,
                      h.timers)
        if h.timers.enabled and not initial:
            tt.start_scan()  # the daemon scans while the keys are made
        keys = list(zip(*[c.to_pylist() for c in keys_table.columns])) if n else []
        if h.timers.enabled:
            tt.add_batch_keys(keys_table.columns, kgs)
            extra_keys, extra_kgs = tt.scan_due() if not initial else ([], [])
            if extra_keys:
                keys = keys + extra_keys
                skeys = [pa.concat_arrays([sk, pa.array(store_keys(v.name, extra_keys, extra_kgs, spec.num_key_groups),
                                                        pa.binary())]) for sk, v in zip(skeys, variables)]
            h.timers.load_timers = tt.load_timers
        timings["time_scan"] = time.perf_counter() - t
    t = time.perf_counter()
    raw = handle.get_many_arrow(skeys[0] if len(skeys) == 1 else pa.concat_arrays(skeys))
    timings["read"] = time.perf_counter() - t
    try:
        table, puts, removes = _per_key(processor, spec, variables, skeys, raw, keys_table, rows_table, offsets,
                                        timings, h, tt, keys, initial)
    finally:
        h.timers.end_batch()
    return table, puts, removes, states


def _per_key(processor: StatefulProcessor, spec: TaskSpec, variables: Sequence[BatchState], skeys: list[pa.Array],
             raw: pa.Array, keys_table: pa.Table, rows_table: pa.Table, offsets: np.ndarray,
             timings: dict[str, float], h: StateHandle | None = None, tt: TaskTime | None = None,
             all_keys: list[tuple] | None = None, initial: bool = False,
             ) -> tuple[pa.Table, tuple[pa.Array, pa.Array], pa.Array]:
    """The Python part of ``run_per_key``: decode, call per key (then per due timer), collect the
    changes and the output."""
    n = len(skeys[0])  # the batch's keys, and the keys of due timers without rows after them
    t = time.perf_counter()
    for j, v in enumerate(variables):
        v.begin_batch(raw.slice(j * n, n), spec.now_ms)
    keys = all_keys if all_keys is not None else list(zip(*[c.to_pylist() for c in keys_table.columns]))
    # the rows' values per column; each chunk of keys makes its rows' tuples (``_call_per_key``)
    rows: list[tuple] | _RowColumns = (_RowColumns([_py_values(c) for c in rows_table.columns]) if spec.value_columns
                                       else [()] * rows_table.num_rows)
    timings["decode"] = time.perf_counter() - t
    t = time.perf_counter()
    timers = h.timers if h is not None and h.timers.enabled else None
    fn = processor.handle_initial_state if initial else processor.handle_rows
    schema = spec.output_schema
    key_arrays = [c.combine_chunks() for c in keys_table.columns]
    tables: list[pa.Table] = []
    row_base = [0]

    def emit(first: int, results: list[Sequence[Any]]) -> None:
        """The output of keys ``first..`` as a table (their Python rows are freed as it returns)."""
        out = list(itertools.chain.from_iterable(results))
        tables.append(output_table(out, schema, keys[first:first + len(results)], per_key=results,
                                    key_arrays=[a.slice(first, len(results)) for a in key_arrays],
                                    row_base=row_base[0]))
        row_base[0] += len(out)

    _call_per_key(processor, variables, keys, rows, offsets, timers, fn, emit)
    del rows
    if tt is not None and timers is not None and not initial:
        fired_results, fired_keys = _fire_timers(processor, variables, keys, tt, timers)
        fired = list(itertools.chain.from_iterable(fired_results))
        tables.append(output_table(fired, schema, fired_keys, per_key=fired_results, row_base=row_base[0]))
        timings["timers_fired"] = len(fired_results)
    close = getattr(processor, "close", None)
    if close is not None:
        close()
    timings["call"] = time.perf_counter() - t
    changes = [v.batch_changes(ks) for v, ks in zip(variables, skeys)]
    put_keys, put_values = [c[0] for c in changes], [c[1] for c in changes]
    removes = [c[2] for c in changes]
    if tt is not None:
        extra_puts: list[pa.Array] = []
        extra_removes: list[pa.Array] = []
        if timers is not None:
            timer_puts, timer_removes = tt.timer_changes()
            extra_puts.append(timer_puts)
            extra_removes.append(timer_removes)
        for v, c in zip(variables, changes):
            if v.ttl_ms is not None:
                extra_puts.append(pa.array(tt.ttl_index(v, c[0]), pa.binary()))
        if any(v.ttl_ms is not None for v in variables) and not initial:
            handled = set(itertools.chain.from_iterable(sk.to_pylist() for sk in skeys))
            gone, rewritten, removed = tt.ttl_cleanup(handled, frozenset(v.name for v in variables if v.entries))
            extra_removes.append(pa.array(gone, pa.binary()))
            if rewritten:
                put_keys.append(pa.array([k for k, _ in rewritten], pa.binary()))
                put_values.append(pa.array([v for _, v in rewritten], pa.binary()))
            timings["ttl_removed"] = removed + sum(v.ttl_removed for v in variables)
        extra = [p for p in extra_puts if len(p)]  # timer and expiry index records: empty values
        put_keys += extra
        put_values += [empties(len(p)) for p in extra]
        removes += [r for r in extra_removes if len(r)]
    puts = (_concat(put_keys), _concat(put_values))
    table = (tables[0] if len(tables) == 1 else pa.concat_tables(tables).combine_chunks() if tables
             else schema.empty_table())
    timings["process"] = time.perf_counter() - t
    return table, puts, _concat(removes)


def _fire_timers(processor: StatefulProcessor, variables: Sequence[BatchState], keys: list[tuple], tt: TaskTime,
                 timers: Any) -> tuple[list[Sequence[Any]], list[tuple]]:
    """``handle_expired_timer`` of every due timer (``TaskTime.due_now``), in time order, its key's
    state and timers bound; each timer is deleted before its call. A timer registered by a call
    fires in a later batch, never in this one (as in Spark's transformWithState, whose scan of due
    timers does not see timers registered while it runs). The rows and keys of each call."""
    fn = processor.handle_expired_timer
    state = KeyState({v.name: v for v in variables}, timers)
    results: list[Sequence[Any]] = []
    fired_keys: list[tuple] = []
    due = tt.due_now()
    for v in variables:
        v.bind_keys()
    add = results.append
    fired = timers.fire
    try:
        for at, kind, i in due:
            for v in variables:
                v.key_index = i
            timers.key_index = i
            fired(i, kind, at)
            key = keys[i]
            res = fn(key, ExpiredTimer(at, kind), state)
            add(res if type(res) is tuple else tuple(res) if type(res) is _Generator
                else _rows_of(res, processor, key, "handle_expired_timer"))
            fired_keys.append(key)
    finally:
        timers.key_index = -1
        for v in variables:
            v.unbind_keys()
    return results, fired_keys


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No automatic cyclic garbage collection inside (it is turned back on after, when it was on).

    The per-key path makes a few Python objects per row and per key (rows, keys, values, output
    rows) that all live until the task's end; each automatic collection walks the ones made so
    far, which cost ~0.3 µs per key at 300k keys (a third of the per-key loop's time). Reference
    counting still frees everything not in a cycle at once; cycles the user's code makes wait for
    the first collection after the block."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _concat(arrays: list[pa.Array]) -> pa.Array:
    return arrays[0] if len(arrays) == 1 else pa.concat_arrays(arrays)


# keys per chunk of the per-key loop: their output rows become Arrow columns (and are freed) after
# each chunk, so the Python objects of the output never pile up over the whole partition
PER_KEY_CHUNK = 2048


class _RowColumns(list):
    """A partition's rows as one list of Python values per column, not yet tuples: the per-key loop
    makes the tuples of a chunk of keys' rows just before their calls, so they are freed while still
    in cache instead of ~500k tuples living until the partition's end."""


def _py_values(col: pa.ChunkedArray | pa.Array) -> list[Any]:
    """``col.to_pylist()`` (an integer or float column without nulls through numpy: the same values, faster)."""
    t = col.type
    if col.null_count == 0 and (pa.types.is_integer(t) or pa.types.is_float32(t) or pa.types.is_float64(t)):
        values: list[Any] = col.to_numpy().tolist()
        return values
    return col.to_pylist()


def _call_per_key(processor: StatefulProcessor, variables: Sequence[BatchState], keys: list[tuple],
                  rows: list[tuple] | _RowColumns, off: Sequence[int] | np.ndarray, timers: Any = None,
                  fn: Callable[..., Any] | None = None, emit: Callable[[int, list[Sequence[Any]]], object] | None = None,
                  chunk: int = PER_KEY_CHUNK) -> list[Sequence[Any]]:
    """``handle_rows`` (or ``fn``) of every key (key i: ``rows[off[i]:off[i+1]]``) with the state
    variables bound to it; the rows each call gave, a tuple or list per key. A generator is drained
    while its key is bound (it may read and write the key's state). With ``emit``, the rows go to
    ``emit(first key's index, rows of keys first..)`` after every ``chunk`` keys instead (the list
    returned is empty). ``rows`` may be ``_RowColumns`` (one list of values per column): then row
    ``j`` is the tuple of the columns' ``j``-th values, made a chunk of keys at a time."""
    if fn is None:
        fn = processor.handle_rows
    name = getattr(fn, "__name__", "handle_rows")
    state = KeyState({v.name: v for v in variables}, timers)
    results: list[Sequence[Any]] = []
    off_np = np.asarray(off, np.int64)
    offl: list[int] = off_np.tolist()
    n = min(len(keys), len(offl) - 1)  # keys after the last of ``off`` (due timers' keys) are not called
    step = chunk if emit is not None else max(n, 1)
    columns = rows if isinstance(rows, _RowColumns) else None
    keys_it, starts, ends = iter(keys), iter(offl), itertools.islice(offl, 1, None)
    for v in variables:
        v.bind_keys()
    if timers is not None:  # the timers follow the key too: one more binding per key
        variables = [*variables, timers]
    try:
        for first in range(0, n, step):
            last = min(n, first + step)
            add = results.append
            if columns is not None:  # this chunk's rows as tuples, their offsets from the chunk's first row
                lo = offl[first]
                rows = list(zip(*[c[lo:offl[last]] for c in columns]))
                rel = (off_np[first:last + 1] - lo).tolist()
                starts, ends = iter(rel), itertools.islice(rel, 1, None)
            # zip stops at the end of the range, before taking anything from the iterators after it
            span = zip(range(first, last), keys_it, starts, ends)
            if len(variables) == 1:
                v0 = variables[0]
                for i, key, a, b in span:
                    v0.key_index = i
                    res = fn(key, rows[a:b], state)
                    add(res if type(res) is tuple else tuple(res) if type(res) is _Generator
                        else _rows_of(res, processor, key, name))
            elif len(variables) == 2:  # one state variable and the timers: the common case with time
                v0, v1 = variables
                for i, key, a, b in span:
                    v0.key_index = v1.key_index = i
                    res = fn(key, rows[a:b], state)
                    add(res if type(res) is tuple else tuple(res) if type(res) is _Generator
                        else _rows_of(res, processor, key, name))
            else:
                for i, key, a, b in span:
                    for v in variables:
                        v.key_index = i
                    res = fn(key, rows[a:b], state)
                    add(res if type(res) is tuple else tuple(res) if type(res) is _Generator
                        else _rows_of(res, processor, key, name))
            if emit is not None:
                emit(first, results)
                results = []
    finally:
        for v in variables:
            if v is timers:
                v.key_index = -1
            else:
                v.unbind_keys()
    return results


_Generator = types.GeneratorType  # what a handle_rows that yields gives: drained in the loop, no call


def _rows_of(res: Any, processor: StatefulProcessor, key: tuple, method: str = "handle_rows") -> tuple:
    """What ``handle_rows`` gave for ``key`` (not a tuple) as a tuple of rows: None gives none, an
    iterable is drained now (its key still bound); a dict, str or bytes is refused."""
    if res is None:
        return ()
    if isinstance(res, (dict, str, bytes)):
        raise OutputRowError(f"{type(processor).__name__}.{method} returned a {type(res).__name__} for key "
                             f"{short_repr(key)}: return or yield rows (tuples in the output schema's order)")
    return tuple(res)
