"""What one Spark task does for one state partition: group rows, prefetch state, run, write, commit.

No round trip per key: the partition's rows are grouped by key with numpy/pyarrow, every key's
state is fetched in one batched call (``get_many``; never a call per key), the
processor runs, then ONE ``put_many`` and ONE ``remove_many``, and the commit.

Also the low-level API ``open_partition_store`` for mapPartitions / mapInArrow / pandas UDF users.
"""
from __future__ import annotations

import bisect
import contextlib
import gc
import itertools
import logging
import operator
import time
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from statestore_async.client.clients import StaleHandleError
from statestore_async.codecs import arrowcodec, keylayout, valuecodec
from statestore_async.errors import (
    ConnectionLostError,
    InterfaceError,
    OutputRowError,
    RetriesExhaustedError,
    ShuttingDownError,
    StateStoreError,
)
from statestore_async.ids import CheckpointRef, StoreId
from statestore_async.spark import placement
from statestore_async.spark.coordinator import location_of
from statestore_async.spark.eventtime import split_late
from statestore_async.spark.processor import (
    ExpiredTimer,
    KeyState,
    StatefulProcessor,
    StateHandle,
    VectorizedProcessor,
    VectorizedTimers,
    _StateVar,
    check_declarations,
    uses_initial_state,
    uses_timers,
    uses_vectorized_timers,
    vectorized_declarations,
)
from statestore_async.spark.routing import KG_COLUMN
from statestore_async.spark.timework import TaskTime, due_records, start_due_timer_scan, stored_timers
from statestore_async.state.keys import KIND_OF, TIME_MODES, owned_key_groups, parse_timer_columns, timer_record_columns
from statestore_async.state.roots import checkpoint_root

if TYPE_CHECKING:
    from statestore_async.client.clients import Client, StoreHandle

log = logging.getLogger(__name__)
T = TypeVar("T")
# a processor's state changes: per key lists of (key, value) and keys, or (vectorized) Arrow arrays
Puts: TypeAlias = list[tuple[bytes, bytes]] | tuple[pa.Array, pa.Array]
Removes: TypeAlias = list[bytes] | pa.Array | None
# what a task's call to its daemon raises when the daemon is gone (killed, restarting, stopping), not
# because of the request: the task retries its partition (``spec.daemon_retries`` times)
DAEMON_LOST = (ConnectionLostError, StaleHandleError, ShuttingDownError)
RETRY_PAUSES = (0.1, 0.5, 1.0)  # seconds before the 1st, 2nd, and every later retry


class RoutingError(InterfaceError):
    """A task received rows of a key group its state partition does not own."""


# -- the fault hook point -----------------------------------------------------------------------
# Tests make a daemon, a task or the driver fail at named points of a batch. The product only calls
# ``fault_point`` there: nothing happens unless the operator was given ``faults``, and only the hook
# maker that ``statestore_async.testing.faults`` installs (``install_fault_hook_maker``) can turn
# those into a hook. Task points: ``before_commit``, ``after_commit``; driver points:
# ``before_fence``, ``after_manifest``. A task that retries its partition after losing its daemon
# reaches ``before_commit`` again (``FaultSite.retry`` counts its tries), as does a batch whose
# stateful stage the driver runs again (a new job: ``attempt`` 0 again) for its points.


@dataclass(frozen=True)
class Fault:
    """A fault a test arms on an operator: at ``point`` of ``batch`` (and ``partition``, ``attempt``
    when set) do ``action``. Data only: the installed hook maker decides what actions exist and do
    (``statestore_async.testing.faults``: ``kill_daemon``, ``kill_self``, ``fail``)."""

    point: str
    batch: int
    action: str
    partition: int | None = None
    attempt: int | None = 0


class InjectedFault(RuntimeError):
    """What a ``fail`` fault raises."""


@dataclass(frozen=True)
class FaultSite:
    """Where a hook point is reached: the point, the batch and, in a task, its partition and attempt."""

    point: str
    batch: int
    partition: int | None = None
    attempt: int = 0
    socket_path: str | None = None  # the operator's daemon socket (None: $STATESTORE_SOCKET or the default)
    retry: int = 0  # in a task: its try of the partition (0 first; more after losing its daemon)


# Called at every hook point of an operator with faults. It travels to the tasks in the TaskSpec:
# it must pickle, and Spark's Python workers must be able to import its module.
FaultHook = Callable[[FaultSite], None]

_fault_hook_maker: Callable[[tuple[Fault, ...]], FaultHook] | None = None


def install_fault_hook_maker(maker: Callable[[tuple[Fault, ...]], FaultHook] | None) -> None:
    """Set this process's maker of fault hooks (None: none; operators with ``faults`` are refused)."""
    global _fault_hook_maker
    _fault_hook_maker = maker


def fault_hook_for(faults: tuple[Fault, ...]) -> FaultHook | None:
    """The hook of an operator's ``faults``: None when there are none (its hook points do nothing),
    else the installed maker's; ``InterfaceError`` when faults are armed and no maker is installed."""
    if not faults:
        return None
    if _fault_hook_maker is None:
        raise InterfaceError(
            "faults were given but no fault hook maker is installed in this process: call "
            "statestore_async.testing.faults.install() first (or pass a FaultHook callable as faults)")
    return _fault_hook_maker(faults)


def fault_point(hook: FaultHook | None, point: str, batch: int, partition: int | None = None, attempt: int = 0,
                socket_path: str | None = None, retry: int = 0) -> None:
    """A hook point: nothing when ``hook`` is None (no fault armed), else ``hook(FaultSite(...))``."""
    if hook is not None:
        hook(FaultSite(point, batch, partition, attempt, socket_path, retry))


@dataclass(frozen=True, kw_only=True)
class TaskSpec:
    """Everything a task needs; built by the driver (keyword arguments only) and pickled into the task closure."""

    root: str                          # the checkpoint root: file://… or s3://…
    operator_id: str
    key_columns: tuple[str, ...]
    value_columns: tuple[str, ...]     # the columns the processor gets (with pre_aggregate: the aggregates)
    output_schema: pa.Schema
    num_partitions: int
    num_key_groups: int
    batch_id: int
    refs: tuple[CheckpointRef, ...]    # per partition: the state batch ``batch_id`` reads
    now_ms: int                        # the batch's TTL clock, read once on the driver
    socket_path: str | None = None     # this node's daemon (None: $STATESTORE_SOCKET or the default)
    daemon_env: dict[str, str] | None = None  # environment of a daemon the task has to start
    fault_hook: FaultHook | None = None  # tests only (see fault_point); None: every hook point is a no-op
    releases: dict[str, tuple[int, ...]] | None = None  # coordinator: location -> partitions its daemon may drop (None: off)
    keys_unique: bool = False          # one row per key already (the JVM pre-aggregated): no grouping needed
    daemon_retries: int = 2            # tries of the partition after the first one, when the daemon is lost
    # the state variables' declarations (``processor.Declaration``) the stored state was written with, as the
    # manifest records them; a processor declaring one differently is refused. None: nothing recorded yet
    declared: dict[str, dict[str, Any]] | None = None
    # time (issue 19): the operator's time mode, "none" | "processing" | "event" (what a timer's kind=None
    # means), and the event-time watermark this batch uses (computed by the driver from batches < batch_id
    # and recorded in the batch's manifest, so a replay uses the same; None: none yet, no event timer is due)
    time_mode: str = "none"
    watermark_ms: int | None = None
    # the key columns' types (a VectorizedProcessor's timers of keys without rows are decoded to them;
    # None: the batch's rows' types, or inferred from the values in a batch without rows)
    key_schema: pa.Schema | None = None
    # the first batch after the partition count changed (``files.rescale``): ``(old partition count, the
    # version of the refs' assembled states)``. Every task opens its partition (loading it assembles its
    # state and writes its snapshot) and asks its daemon to drop copies of the old layout's partitions
    rescaled: tuple[int, int] | None = None
    # time_mode "event" without pre_aggregate: the event-time column in the routed rows, whose max and
    # late rows (``<= watermark_ms``) each task counts (``eventtime.split_late``) and, with ``drop_late``,
    # drops before grouping. None: the driver observed and filtered them in the JVM (or no event time)
    event_time_column: str | None = None
    drop_late: bool = True


@dataclass(frozen=True)
class TaskReport:
    """What a task that committed tells the driver through the batch's accumulator (it pickles:
    every field is a plain value or a ``CheckpointRef``)."""

    partition: int
    ref: CheckpointRef                 # the checkpoint the task committed
    attempt: int                       # Spark's attempt number of the task
    timings: dict[str, float]          # seconds per phase (group, read, process, write, total; per key: decode, call); rows, keys
    node: dict[str, Any] | None = None  # where it ran and its daemon's answer to RELEASE; None: coordinator off
    states: dict[str, dict[str, Any]] | None = None  # the processor's state declarations (the manifest records them)


def get_all(handle: StoreHandle, keys: list[bytes]) -> list[bytes | None]:
    """Every key's value in one call (the client splits it at the daemon's batch limit and pipelines)."""
    return handle.get_many(keys)


def write_all(handle: StoreHandle, puts: Puts, removes: Removes) -> None:
    """All puts and all removals, one call each: lists of (key, value) and keys, or Arrow arrays
    (``puts`` a (keys, values) pair, ``removes`` keys; the vectorized path)."""
    if isinstance(puts, tuple):
        if len(puts[0]):
            handle.put_many_arrow(*puts)
        if removes is not None and len(removes):
            handle.remove_many_arrow(removes)
        return
    if puts:
        handle.put_many(puts)
    if removes:
        handle.remove_many(removes)


_kg_prefixes = lru_cache(maxsize=8)(keylayout.prefixes)


def store_keys(state_name: str, keys: list[tuple], kgs: list[int], num_key_groups: int) -> list[bytes]:
    """Store keys ``keylayout.prefix(kg) + encode_key((state_name, *key))`` of one state variable."""
    pre = _kg_prefixes(num_key_groups)
    enc = valuecodec.encode_keys([(state_name, *k) for k in keys])
    return [pre[g] + e for g, e in zip(kgs, enc)]


def _codes(col: pa.ChunkedArray | pa.Array) -> np.ndarray:
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    if pa.types.is_floating(col.type):
        # Spark groups -0.0 with 0.0 and every NaN together: normalize before encoding
        col = pc.if_else(pc.is_nan(col), pa.scalar(float("nan"), col.type), pc.add(col, pa.scalar(0.0, col.type)))
    enc = pc.dictionary_encode(col, null_encoding="encode")
    return enc.indices.to_numpy(zero_copy_only=False).astype(np.int64)


def _stable_order(codes: np.ndarray) -> np.ndarray:
    """``np.argsort(codes, kind="stable")`` for codes in [0, 2**32), as one or two radix passes.

    numpy sorts 16-bit integers with a radix sort (O(n)): 5-10 ms for 500k rows where the
    comparison sort of int64 takes ~40 ms.
    """
    top = int(codes.max()) if codes.size else 0
    if top >= 1 << 32:
        return np.argsort(codes, kind="stable")
    lo = np.argsort((codes & 0xFFFF).astype(np.uint16), kind="stable")
    if top < 1 << 16:
        return lo
    return lo[np.argsort((codes[lo] >> 16).astype(np.uint16), kind="stable")]


def group_rows(table: pa.Table, key_columns: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """(order, offsets): ``table.take(order)`` has each key's rows together, in their order; key i is
    rows offsets[i]:offsets[i+1]. Keys of the column codec's types are grouped in one pass over their
    encoded keys (``arrowcodec.group``: the keys in the order of their first row), others by Arrow's
    dictionary encoding."""
    n = table.num_rows
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(1, np.int64)
    grouped = arrowcodec.group([table[c] for c in key_columns])  # keys of the column codec's types
    return grouped if grouped is not None else _group_by_dictionary(table, key_columns)


def _group_by_dictionary(table: pa.Table, key_columns: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """``group_rows`` for keys of any type Arrow can dictionary-encode (the groups in the order of
    their codes: for one column, of their first row)."""
    n = table.num_rows
    codes = _codes(table[key_columns[0]])
    for c in key_columns[1:]:
        more = _codes(table[c])
        codes = codes * (int(more.max()) + 1) + more
        codes = np.unique(codes, return_inverse=True)[1].astype(np.int64)
    order = _stable_order(codes)
    sc = codes[order]
    bounds = np.flatnonzero(sc[1:] != sc[:-1]) + 1
    offsets = np.concatenate(([0], bounds, [n])).astype(np.int64)
    return order, offsets


def _check_routing(kg: np.ndarray, partition: int, spec: TaskSpec) -> None:
    if kg.size == 0:
        return
    owners = kg.astype(np.int64) * spec.num_partitions // spec.num_key_groups
    if owners.min() != partition or owners.max() != partition:
        raise RoutingError(
            f"task of partition {partition} received rows of partitions {sorted(set(owners.tolist()))[:5]}: "
            "the shuffle did not keep the routing (is the stage changed after the operator's repartition?)")


# -- output rows -> the output table --------------------------------------------------------------
# A per-key processor's rows are tuples (or lists, or Rows) in the output schema's column order.
# Each column becomes one Arrow array in one pass (``pa.array``); an integer column is converted
# without a target type and then cast with ``safe=True``, because ``pa.array([29.5],
# type=pa.int64())`` truncates silently to 29 (pyarrow 26): the safe cast refuses a fraction and a
# value out of the column's range. The slow search for the culprit runs only when a column fails.
_PLAIN_ROWS = (tuple, list)
_CONVERSION_ERRORS = (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, OverflowError, TypeError,
                      ValueError)


def _column(values: Sequence[Any], type_: pa.DataType) -> pa.Array:
    """One output column's values as an array of ``type_``: no silent narrowing (see above)."""
    if not pa.types.is_integer(type_):
        return pa.array(values, type=type_, from_pandas=False)
    arr = pa.array(values, from_pandas=False)
    if arr.type == type_:
        return arr
    t = arr.type
    if not (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t) or pa.types.is_null(t)):
        raise TypeError(f"an integer column takes ints, got {t}")
    return arr.cast(type_, safe=True)


def _short(value: Any, limit: int = 200) -> str:
    r = repr(value)
    return r if len(r) <= limit else r[:limit] + "…"


class _RowKeys:
    """Which grouping key produced output row ``i`` (``ends[k]``: rows of keys 0..k, or worked out
    from ``per_key``, the rows of each key), for messages."""

    def __init__(self, keys: Sequence[tuple] | None, ends: Sequence[int] | None,
                 per_key: Sequence[Sequence[Any]] | None = None) -> None:
        self.keys, self.ends, self.per_key = keys, ends, per_key

    def __call__(self, i: int) -> str:
        if self.ends is None and self.per_key is not None:
            self.ends = list(itertools.accumulate(map(len, self.per_key)))
        if self.keys is None or self.ends is None:
            return ""
        k = bisect.bisect_right(self.ends, i)
        return f" of key {_short(self.keys[k])}" if k < len(self.keys) else ""


def _check_rows(out: list[Any], schema: pa.Schema, key_of: _RowKeys, row_base: int = 0) -> None:
    """``OutputRowError`` unless every row is a tuple, list or Row with one value per column (a Row
    or namedtuple whose field names are the columns' in another order is refused too: rows are
    matched by position). A Python loop: run when the cheap checks of ``_output_table`` fail.
    ``row_base``: the task's number of the first row of ``out`` (messages count the task's rows)."""
    width, names = len(schema), schema.names
    for i, row in enumerate(out):
        if not isinstance(row, _PLAIN_ROWS):
            hint = (" (did handle_rows return one row instead of an iterable of rows? yield each row)"
                    if not isinstance(row, dict) else
                    f" (a dict is not accepted: yield a tuple in the columns' order, e.g. tuple(row[c] for c in {names}))")
            raise OutputRowError(f"output row {row_base + i}{key_of(i)} is a {type(row).__name__}, not a tuple: "
                                 f"{_short(row)}{hint}")
        if len(row) != width:
            raise OutputRowError(
                f"output rows have {len(row)} values, the output schema has {width} columns {names}: "
                f"row {_short(row)}{key_of(i)}")
        fields = getattr(row, "__fields__", None) or getattr(row, "_fields", None)
        if fields is not None and list(fields) != names and sorted(fields) == sorted(names):
            raise OutputRowError(
                f"output row {_short(row)}{key_of(i)} names its fields {list(fields)}, the output schema's columns are "
                f"{names}: rows are matched by position, yield the values in the columns' order")


def _column_error(out: list[Sequence[Any]], j: int, field: pa.Field, key_of: _RowKeys, exc: Exception) -> OutputRowError:
    """The error naming the first value of column ``j`` that does not convert (and its key and row)."""
    for i, row in enumerate(out):
        try:
            _column([row[j]], field.type)
        except _CONVERSION_ERRORS as one:
            return OutputRowError(
                f"output column {field.name!r} ({field.type}): value {_short(row[j])}{key_of(i)} does not fit: {one} "
                f"(row {_short(row)})")
    return OutputRowError(f"output column {field.name!r} ({field.type}): {exc}")


def _output_table(out: list[Any], schema: pa.Schema, keys: Sequence[tuple] | None = None,
                  ends: Sequence[int] | None = None, *, per_key: Sequence[Sequence[Any]] | None = None,
                  key_arrays: Sequence[pa.Array | pa.ChunkedArray] = (), row_base: int = 0) -> pa.Table:
    """The per-key processor's output rows as a table of ``schema``; ``OutputRowError`` naming the
    column, the grouping key (``keys[k]`` produced rows ``ends[k-1]:ends[k]``, or ``per_key[k]``)
    and the value for a row that does not fit.

    ``key_arrays``: the Arrow columns the values of ``keys`` came from (``key_arrays[c]``'s values
    are ``keys[k][c]``). When output column ``c`` holds, row for row, the very objects ``keys[k][c]``
    (one row per key that starts with its key, as ``(*key, ...)`` gives) and has that column's type,
    the column is that array: no conversion of the values back to Arrow."""
    if not out:
        return schema.empty_table()
    key_of = _RowKeys(keys, ends, per_key)
    if any(t not in _PLAIN_ROWS for t in set(map(type, out))):  # one pass of C
        _check_rows(out, schema, key_of, row_base)  # dicts, scalars, Rows naming the columns out of order
    width = len(schema)
    if set(map(len, out)) != {width}:  # a short or long row (one pass of C)
        _check_rows(out, schema, key_of, row_base)
    same_rows = keys is not None and len(out) == len(keys)
    arrays: list[pa.Array | pa.ChunkedArray] = []
    for j, field in enumerate(schema):
        values = list(map(operator.itemgetter(j), out))  # one column, one pass of C
        if (same_rows and j < len(key_arrays) and key_arrays[j].type == field.type
                and all(map(operator.is_, values, map(operator.itemgetter(j), keys)))):  # type: ignore[arg-type]
            arrays.append(key_arrays[j])  # the key column itself (identity: the same values)
            continue
        try:
            arrays.append(_column(values, field.type))
        except _CONVERSION_ERRORS as exc:
            raise _column_error(out, j, field, key_of, exc) from None
    return pa.Table.from_arrays(arrays, schema=schema)


def _vectorized_output(output: pa.Table | None, schema: pa.Schema) -> pa.Table:
    """A ``VectorizedProcessor``'s output table in ``schema``: its columns by name, each cast safely
    (no fraction into an integer column, nothing out of range); ``OutputRowError`` naming the column,
    the row and the value otherwise."""
    if output is None:
        return schema.empty_table()
    if not isinstance(output, pa.Table):
        raise OutputRowError(f"the vectorized output must be a pyarrow.Table, got {type(output).__name__}")
    if output.schema == schema:
        return output
    missing = [n for n in schema.names if n not in output.column_names]
    if missing:
        raise OutputRowError(f"the vectorized output lacks the columns {missing} (it has {output.column_names}; the "
                             f"output schema is {schema.names})")
    columns = []
    for field in schema:
        col = output[field.name]
        try:
            columns.append(col.cast(field.type, safe=True))
        except _CONVERSION_ERRORS as exc:
            for i, v in enumerate(col.to_pylist()):
                try:
                    pa.array([v], type=col.type).cast(field.type, safe=True)
                except _CONVERSION_ERRORS as one:
                    row = {n: output[n][i].as_py() for n in output.column_names}
                    raise OutputRowError(f"output column {field.name!r} ({field.type}): value {_short(v)} of row {i} "
                                         f"does not fit: {one} (row {_short(row)})") from None
            raise OutputRowError(f"output column {field.name!r} ({field.type}): {exc}") from None
    return pa.Table.from_arrays(columns, schema=schema)


def _table_of(batches: list[pa.RecordBatch]) -> pa.Table | None:
    return pa.Table.from_batches(batches) if batches else None


def run_partition(processor: StatefulProcessor | VectorizedProcessor, spec: TaskSpec, partition: int, attempt: int,
                  batches: list[pa.RecordBatch], report: Callable[[TaskReport], object] | None = None,
                  event_time: Callable[[int | None, int], object] | None = None) -> pa.Table:
    """Apply ``processor`` to one state partition's rows of a batch; returns the output table.

    With ``spec.event_time_column`` the rows' max event time and late rows are counted first and
    given to ``event_time(max_ms, late)`` (a partition with rows, before anything else), and the
    late rows are dropped (``spec.drop_late``): the processor never sees them.

    Opens the store at ``spec.refs[partition]``, commits, calls ``report(TaskReport(...))`` after
    the commit (``timings``: seconds spent grouping, in the store, in the processor; ``node``: where
    it ran, for the coordinator, see ``_coordinate``). A partition without rows opens nothing and
    reports nothing, unless its processor has time work (timers or TTLs, ``has_time_work``): then
    it opens the store, fires its due timers and removes its expired values, and commits and reports
    only when that changed something. A daemon lost on the way (``DAEMON_LOST``) makes the task try
    again (``_commit_partition``); only the commit it reports counts.
    """
    return _run(processor, spec, partition, attempt, batches, report, initial=False, event_time=event_time)


def run_initial_state(processor: StatefulProcessor, spec: TaskSpec, partition: int, attempt: int,
                      batches: list[pa.RecordBatch], report: Callable[[TaskReport], object] | None = None) -> pa.Table:
    """Apply ``processor.handle_initial_state`` to one state partition's rows of the operator's
    ``initial_state`` (routed as a batch's rows: key columns, ``spec.value_columns``, the key group
    column); returns its output table.

    Like ``run_partition`` (same grouping, one read, one write, one commit on top of
    ``spec.refs[partition]``, reported the same way, the same retries when the daemon is lost), but
    each key's rows go to ``handle_initial_state``; timers it registers and TTL'd values it writes
    are stored as in a batch, and nothing fires nor expires (the first batch does that). A
    partition without initial rows opens nothing and reports nothing. The driver runs it once, before
    the first batch, and that batch reads the refs it reports (see ``docs/SPARK.md``)."""
    if isinstance(processor, VectorizedProcessor) or not uses_initial_state(processor):
        raise InterfaceError(
            f"{type(processor).__name__} has no handle_initial_state(self, key, rows, state): define it on a "
            "StatefulProcessor to use initial_state= (VectorizedProcessors take no initial state)")
    return _run(processor, spec, partition, attempt, batches, report, initial=True)


def _run(processor: StatefulProcessor | VectorizedProcessor, spec: TaskSpec, partition: int, attempt: int,
         batches: list[pa.RecordBatch], report: Callable[[TaskReport], object] | None, initial: bool,
         event_time: Callable[[int | None, int], object] | None = None) -> pa.Table:
    t0 = time.perf_counter()
    if spec.time_mode not in TIME_MODES:
        raise InterfaceError(f"time_mode is one of {TIME_MODES}, got {spec.time_mode!r}")
    table = _table_of([b for b in batches if b.num_rows])
    if table is not None and spec.event_time_column is not None and not initial:
        table, top, late = split_late(table, spec.event_time_column, spec.watermark_ms, spec.drop_late)
        if event_time is not None:
            event_time(top, late)
        if not table.num_rows:
            table = None
    idle = table is None
    if table is None:
        if spec.rescaled is not None and not initial and not has_time_work(processor):
            _assemble_only(spec, partition, timings={})
            return spec.output_schema.empty_table()
        if initial or not has_time_work(processor):
            return spec.output_schema.empty_table()
        table = pa.table({KG_COLUMN: pa.array([], pa.int32())})
    kg = table[KG_COLUMN].to_numpy()
    _check_routing(kg, partition, spec)
    if idle:
        keys_table = rows_table = pa.table({})
    else:
        keys_table, rows_table = table.select(list(spec.key_columns)), table.select(list(spec.value_columns))
    if spec.keys_unique or idle:
        offsets, kgs = np.arange(table.num_rows + 1, dtype=np.int64), kg
    else:
        order, offsets = group_rows(table, list(spec.key_columns))
        firsts = order[offsets[:-1]]
        kgs = kg[firsts]
        keys_table, rows_table = keys_table.take(pa.array(firsts)), rows_table.take(pa.array(order))
    timings = {"rows": table.num_rows, "keys": len(kgs), "group": time.perf_counter() - t0}

    def apply(client: Client, retry: int) -> tuple[pa.Table, CheckpointRef | None, dict[str, dict[str, Any]]]:
        base = spec.refs[partition]
        puts: Puts
        removes: Removes
        with client.open(StoreId(spec.root, spec.operator_id, partition), base.version, base.ckptid or None) as handle:
            writes: list[tuple[Puts, Removes]]
            if isinstance(processor, VectorizedProcessor):
                out, writes, states = _run_vectorized(processor, spec, keys_table, rows_table, offsets, kgs,
                                                      handle, timings, partition)
                if idle and not any(len(p[0]) or (r is not None and len(r)) for p, r in writes) and not out.num_rows:
                    handle.abort()  # nothing was due: the manifest keeps the partition's state
                    return out, None, states
            else:
                with _gc_paused():  # back on once the task's per-key objects are gone (freed as it returns)
                    out, puts, removes, states = _run_per_key(processor, spec, keys_table, rows_table, offsets, kgs,
                                                              handle, timings, partition, initial)
                if idle and not len(puts[0]) and (removes is None or not len(removes)):
                    handle.abort()  # nothing was due: the manifest keeps the partition's state
                    return out, None, states
                writes = [(puts, removes)]
            t = time.perf_counter()
            timings["puts"] = timings["removes"] = 0
            for puts, removes in writes:  # in order: a later change of a key wins
                write_all(handle, puts, removes)
                timings["puts"] += len(puts[0]) if isinstance(puts, tuple) else len(puts)
                timings["removes"] += len(removes) if removes is not None else 0
            fault_point(spec.fault_hook, "before_commit", spec.batch_id, partition, attempt, spec.socket_path, retry)
            ref = handle.commit()
            timings["write"] = time.perf_counter() - t
        return out, ref, states

    client, (out, ref, states) = _commit_partition(spec, partition, apply, timings)
    _drop_old_layout(client, spec, partition)
    if ref is None:
        return out
    node = _coordinate(client, spec, partition)
    timings["total"] = time.perf_counter() - t0
    if report is not None:
        report(TaskReport(partition=partition, ref=ref, attempt=attempt, timings=timings, node=node, states=states))
    fault_point(spec.fault_hook, "after_commit", spec.batch_id, partition, attempt, spec.socket_path)
    return out


def _commit_partition(spec: TaskSpec, partition: int, apply: Callable[[Client, int], T],
                      timings: dict[str, float]) -> tuple[Client, T]:
    """``apply(client, retry)`` — open the partition's store at the manifest's state, process, write,
    commit — with the client of this node's daemon (``placement.connect``: it reconnects, and starts
    a daemon when none answers). When the daemon is lost on the way (``DAEMON_LOST``: killed,
    restarted, stopping), the open version died with the connection, so the task tries again from
    the start, up to ``spec.daemon_retries`` more times: the state is reopened at the manifest's
    state (the new daemon loads it from the files the manifest names), the rows are processed
    again, and the commit gets a fresh checkpoint id (a commit whose answer was lost is in no
    report, so in no manifest). ``RetriesExhaustedError`` (a ``ConnectionLostError``) when every
    try lost it; ``timings["retries"]``: the tries after the first."""
    tries = spec.daemon_retries + 1
    for retry in range(tries):
        try:
            client = placement.connect(spec.socket_path, env=spec.daemon_env)
            return client, apply(client, retry)
        except DAEMON_LOST as exc:
            where = placement.socket_path_for(spec.socket_path)
            if retry + 1 >= tries:
                raise RetriesExhaustedError(
                    f"partition {partition} of operator {spec.operator_id!r}, batch {spec.batch_id}: the daemon at "
                    f"{where} was lost on each of {tries} tries (the last: {type(exc).__name__}: {exc}); the task "
                    "fails") from exc
            timings["retries"] = retry + 1
            log.warning("partition %d of operator %s, batch %d: lost the daemon at %s (%s: %s); trying again (%d of %d)",
                        partition, spec.operator_id, spec.batch_id, where, type(exc).__name__, exc, retry + 1,
                        tries - 1)
            time.sleep(RETRY_PAUSES[min(retry, len(RETRY_PAUSES) - 1)])
    raise AssertionError("unreachable: the last try returns or raises")


def _assemble_only(spec: TaskSpec, partition: int, timings: dict[str, float]) -> None:
    """The first batch after a rescale, a partition without rows nor time work: open its state (the
    daemon assembles it from the old partitions' files and writes its snapshot, so that the manifest
    may name it) and leave it unchanged."""

    def open_only(client: Client, retry: int) -> None:
        base = spec.refs[partition]
        with client.open(StoreId(spec.root, spec.operator_id, partition), base.version, base.ckptid or None) as handle:
            handle.abort()

    client, _ = _commit_partition(spec, partition, open_only, timings)
    _drop_old_layout(client, spec, partition)


def _drop_old_layout(client: Client, spec: TaskSpec, partition: int) -> None:
    """After a rescale: ask this node's daemon to drop the copies it holds of the old layout's
    partitions (older than the assembled states; its copies of new states stay). Best effort."""
    if spec.rescaled is None:
        return
    old_n, version = spec.rescaled
    stale = [(p, version + 1) for p in range(max(old_n, spec.num_partitions)) if p != partition]
    try:
        client.release(spec.root, spec.operator_id, stale)
    except StateStoreError as exc:
        log.warning("could not ask the daemon to drop the old layout's partitions %s: %s", stale, exc)


def _coordinate(client: Client, spec: TaskSpec, partition: int) -> dict[str, Any] | None:
    """Where this task ran, and (the coordinator being on) its daemon's answer to RELEASE of the
    partitions the driver says another location owns now. Best effort: never fails the task."""
    if spec.releases is None:
        return None
    loc = location_of(placement.socket_path_for(spec.socket_path))
    node: dict[str, Any] = {"location": loc}
    # a copy at or below the state this batch starts from: one this batch committed (its partition
    # back on this node, run by another task) is newer, and stays
    stale = [(p, spec.refs[p].version + 1) for p in spec.releases.get(loc, ())
             if p != partition and p < len(spec.refs)]
    try:
        node.update(client.release(spec.root, spec.operator_id, stale))
    except StateStoreError as exc:
        log.warning("could not ask the daemon at %s to release partitions %s: %s", loc, stale, exc)
    return node


def has_time_work(processor: StatefulProcessor | VectorizedProcessor) -> bool:
    """Whether a task must run even without rows: the processor defines ``handle_expired_timer`` or
    declares a state variable with a TTL (its ``init`` runs on a scratch handle to tell)."""
    if isinstance(processor, VectorizedProcessor):
        return uses_vectorized_timers(processor)
    if uses_timers(processor):
        return True
    h = StateHandle()
    processor.init(h)
    return any(v.ttl_ms is not None for v in h.variables.values())


def _run_per_key(processor: StatefulProcessor, spec: TaskSpec, keys_table: pa.Table, rows_table: pa.Table,
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
    check_declarations(spec.declared, states, _where(processor, spec))
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
            h.timers._load = tt.load_timers
        timings["time_scan"] = time.perf_counter() - t
    t = time.perf_counter()
    raw = handle.get_many_arrow(skeys[0] if len(skeys) == 1 else pa.concat_arrays(skeys))
    timings["read"] = time.perf_counter() - t
    try:
        table, puts, removes = _per_key(processor, spec, variables, skeys, raw, keys_table, rows_table, offsets,
                                        timings, h, tt, keys, initial)
    finally:
        h.timers._end()
    return table, puts, removes, states


def _per_key(processor: StatefulProcessor, spec: TaskSpec, variables: list[_StateVar], skeys: list[pa.Array],
             raw: pa.Array, keys_table: pa.Table, rows_table: pa.Table, offsets: np.ndarray,
             timings: dict[str, float], h: StateHandle | None = None, tt: TaskTime | None = None,
             all_keys: list[tuple] | None = None, initial: bool = False,
             ) -> tuple[pa.Table, tuple[pa.Array, pa.Array], pa.Array]:
    """The Python part of ``_run_per_key``: decode, call per key (then per due timer), collect the
    changes and the output."""
    n = len(skeys[0])  # the batch's keys, and the keys of due timers without rows after them
    t = time.perf_counter()
    for j, v in enumerate(variables):
        v._begin(raw.slice(j * n, n), spec.now_ms)
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
        tables.append(_output_table(out, schema, keys[first:first + len(results)], per_key=results,
                                    key_arrays=[a.slice(first, len(results)) for a in key_arrays],
                                    row_base=row_base[0]))
        row_base[0] += len(out)

    _call_per_key(processor, variables, keys, rows, offsets, timers, fn, emit)
    del rows
    if tt is not None and timers is not None and not initial:
        fired_results, fired_keys = _fire_timers(processor, variables, keys, tt, timers)
        fired = list(itertools.chain.from_iterable(fired_results))
        tables.append(_output_table(fired, schema, fired_keys, per_key=fired_results, row_base=row_base[0]))
        timings["timers_fired"] = len(fired_results)
    close = getattr(processor, "close", None)
    if close is not None:
        close()
    timings["call"] = time.perf_counter() - t
    changes = [v._changes(ks) for v, ks in zip(variables, skeys)]
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
            timings["ttl_removed"] = removed + sum(v._ttl_removed for v in variables)
        extra = [p for p in extra_puts if len(p)]  # timer and expiry index records: empty values
        put_keys += extra
        put_values += [_empties(len(p)) for p in extra]
        removes += [r for r in extra_removes if len(r)]
    puts = (_concat(put_keys), _concat(put_values))
    table = (tables[0] if len(tables) == 1 else pa.concat_tables(tables).combine_chunks() if tables
             else schema.empty_table())
    timings["process"] = time.perf_counter() - t
    return table, puts, _concat(removes)


def _fire_timers(processor: StatefulProcessor, variables: list[_StateVar], keys: list[tuple], tt: TaskTime,
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
        v._bind()
    add = results.append
    fired = timers._fired
    try:
        for at, kind, i in due:
            for v in variables:
                v._i = i
            timers._i = i
            fired(i, kind, at)
            key = keys[i]
            res = fn(key, ExpiredTimer(at, kind), state)
            add(res if type(res) is tuple else tuple(res) if type(res) is _Generator
                else _rows_of(res, processor, key, "handle_expired_timer"))
            fired_keys.append(key)
    finally:
        timers._i = -1
        for v in variables:
            v._unbind()
    return results, fired_keys


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
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


def _call_per_key(processor: StatefulProcessor, variables: list[_StateVar], keys: list[tuple],
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
        v._bind()
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
                    v0._i = i
                    res = fn(key, rows[a:b], state)
                    add(res if type(res) is tuple else tuple(res) if type(res) is _Generator
                        else _rows_of(res, processor, key, name))
            elif len(variables) == 2:  # one state variable and the timers: the common case with time
                v0, v1 = variables
                for i, key, a, b in span:
                    v0._i = v1._i = i
                    res = fn(key, rows[a:b], state)
                    add(res if type(res) is tuple else tuple(res) if type(res) is _Generator
                        else _rows_of(res, processor, key, name))
            else:
                for i, key, a, b in span:
                    for v in variables:
                        v._i = i
                    res = fn(key, rows[a:b], state)
                    add(res if type(res) is tuple else tuple(res) if type(res) is _Generator
                        else _rows_of(res, processor, key, name))
            if emit is not None:
                emit(first, results)
                results = []
    finally:
        for v in variables:
            if v is timers:
                v._i = -1
            else:
                v._unbind()
    return results


_Generator = types.GeneratorType  # what a handle_rows that yields gives: drained in the loop, no call


def _rows_of(res: Any, processor: StatefulProcessor, key: tuple, method: str = "handle_rows") -> tuple:
    """What ``handle_rows`` gave for ``key`` (not a tuple) as a tuple of rows: None gives none, an
    iterable is drained now (its key still bound); a dict, str or bytes is refused."""
    if res is None:
        return ()
    if isinstance(res, (dict, str, bytes)):
        raise OutputRowError(f"{type(processor).__name__}.{method} returned a {type(res).__name__} for key "
                             f"{_short(key)}: return or yield rows (tuples in the output schema's order)")
    return tuple(res)


def _run_vectorized(processor: VectorizedProcessor, spec: TaskSpec, keys_table: pa.Table, rows: pa.Table,
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
    check_declarations(spec.declared, states, _where(processor, spec))
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
            timers._bind(arrowcodec.encode_tuples(keys_table.columns, key=True), kgs)
            timers._load = _timer_loader(handle, spec.num_key_groups)
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
    tp, tr = timers._changes()
    due = _due_timers(scan[0](), tp, tr, spec.now_ms, spec.watermark_ms)
    timings["time_scan"] = time.perf_counter() - t
    timings["timers_fired"] = len(due)
    put_keys, put_values = pa.concat_arrays([puts[0], tp]), pa.concat_arrays([puts[1], _empties(len(tp))])
    removes = pa.concat_arrays([gone, tr]) if gone is not None else tr
    writes: list[tuple[Puts, Removes]] = [((put_keys, put_values), removes)]
    if len(due):
        timers._load = _overlay_loader(handle, spec.num_key_groups, tp, tr)
        out, puts2, gone2, fired = _fire_vectorized(processor, schema, spec, keys_table, due, timers, handle, timings,
                                                    (handled, puts[0], puts[1]))
        outputs.append(out)
        tp2, tr2 = timers._changes()
        # a fired timer is deleted before its call: one its call registers again stays
        if len(tp2):
            fired = fired.filter(pc.invert(pc.is_in(fired, value_set=tp2)))
        # the call's changes (state puts and removals, timers registered and deleted, the fired
        # timers' records) touch no key twice; written after process's, they win over them
        later_keys, later_values = pa.concat_arrays([puts2[0], tp2]), pa.concat_arrays([puts2[1], _empties(len(tp2))])
        later_removes = pa.concat_arrays([r for r in (gone2, tr2, fired) if r is not None])
        writes.append(((later_keys, later_values), later_removes))
    timers._unbind()
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
    ``deleted``: timer records of both indexes, as ``VectorizedTimers._changes`` gives them: the
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


def _empties(n: int) -> pa.Array:
    """``n`` empty binary values (from buffers: no Python object each)."""
    return pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(np.zeros(n + 1, np.int32)), pa.py_buffer(b"")])


def _timer_loader(handle: StoreHandle, num_key_groups: int) -> Callable[[pa.Array, np.ndarray],
                                                                          list[tuple[int, str, int]]]:
    prefixes = _kg_prefixes(num_key_groups)
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
    output = _vectorized_output(output, spec.output_schema)
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
    timers._bind(distinct, key_kgs)
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


def _where(processor: StatefulProcessor | VectorizedProcessor, spec: TaskSpec) -> str:
    return f"{type(processor).__name__} of operator {spec.operator_id!r} at {spec.root}: "


@contextlib.contextmanager
def open_partition_store(root: str, operator_id: str, partition_id: int, version: int, ckptid: str | None = None,
                         *, socket_path: str | None = None, store_name: str = "default",
                         result: list[CheckpointRef] | None = None) -> Iterator[StoreHandle]:
    """A store handle of one partition at ``version``: committed on success, aborted on an exception.

    For mapPartitions / mapInArrow / pandas UDF code that manages its own keys (see
    ``statestore_async.codecs.keylayout`` for the 2-byte key-group prefix). The committed ``CheckpointRef`` is
    appended to ``result`` when given; report it to the driver, which must check the file exists
    before it records the version (``StatefulOperator`` does all of this for you).
    """
    root = checkpoint_root(root)
    client = placement.connect(socket_path)
    handle = client.open(StoreId(root, operator_id, partition_id, store_name), version, ckptid)
    try:
        yield handle
    except BaseException:
        handle.abort()
        raise
    ref = handle.commit()
    if result is not None:
        result.append(ref)


__all__ = [
    "CheckpointRef", "Fault", "FaultHook", "FaultSite", "InjectedFault", "RoutingError", "TaskReport", "TaskSpec",
    "checkpoint_root", "fault_hook_for", "fault_point", "group_rows", "has_time_work", "install_fault_hook_maker",
    "open_partition_store",
    "run_initial_state", "run_partition", "store_keys",
]
