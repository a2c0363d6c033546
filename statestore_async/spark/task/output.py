"""A processor's output as the output table: per-key rows converted column by column and checked
against the output schema (``OutputRowError`` naming the column, the key and the value), a
vectorized processor's tables checked and cast.
"""
from __future__ import annotations

import bisect
import itertools
import operator
from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from statestore_async.errors import (
    OutputRowError,
)
from statestore_async.spark.api.processors import StatefulProcessor, VectorizedProcessor
from statestore_async.spark.shared.taskspec import TaskSpec

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


def short_repr(value: Any, limit: int = 200) -> str:
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
        return f" of key {short_repr(self.keys[k])}" if k < len(self.keys) else ""


def _check_rows(out: list[Any], schema: pa.Schema, key_of: _RowKeys, row_base: int = 0) -> None:
    """``OutputRowError`` unless every row is a tuple, list or Row with one value per column (a Row
    or namedtuple whose field names are the columns' in another order is refused too: rows are
    matched by position). A Python loop: run when the cheap checks of ``output_table`` fail.
    ``row_base``: the task's number of the first row of ``out`` (messages count the task's rows)."""
    width, names = len(schema), schema.names
    for i, row in enumerate(out):
        if not isinstance(row, _PLAIN_ROWS):
            hint = (" (did handle_rows return one row instead of an iterable of rows? yield each row)"
                    if not isinstance(row, dict) else
                    f" (a dict is not accepted: yield a tuple in the columns' order, e.g. tuple(row[c] for c in {names}))")
            raise OutputRowError(f"output row {row_base + i}{key_of(i)} is a {type(row).__name__}, not a tuple: "
                                 f"{short_repr(row)}{hint}")
        if len(row) != width:
            raise OutputRowError(
                f"output rows have {len(row)} values, the output schema has {width} columns {names}: "
                f"row {short_repr(row)}{key_of(i)}")
        fields = getattr(row, "__fields__", None) or getattr(row, "_fields", None)
        if fields is not None and list(fields) != names and sorted(fields) == sorted(names):
            raise OutputRowError(
                f"output row {short_repr(row)}{key_of(i)} names its fields {list(fields)}, the output schema's columns are "
                f"{names}: rows are matched by position, yield the values in the columns' order")


def _column_error(out: list[Sequence[Any]], j: int, field: pa.Field, key_of: _RowKeys, exc: Exception) -> OutputRowError:
    """The error naming the first value of column ``j`` that does not convert (and its key and row)."""
    for i, row in enumerate(out):
        try:
            _column([row[j]], field.type)
        except _CONVERSION_ERRORS as one:
            return OutputRowError(
                f"output column {field.name!r} ({field.type}): value {short_repr(row[j])}{key_of(i)} does not fit: {one} "
                f"(row {short_repr(row)})")
    return OutputRowError(f"output column {field.name!r} ({field.type}): {exc}")


def output_table(out: list[Any], schema: pa.Schema, keys: Sequence[tuple] | None = None,
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


def vectorized_output(output: pa.Table | None, schema: pa.Schema) -> pa.Table:
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
                    raise OutputRowError(f"output column {field.name!r} ({field.type}): value {short_repr(v)} of row {i} "
                                         f"does not fit: {one} (row {short_repr(row)})") from None
            raise OutputRowError(f"output column {field.name!r} ({field.type}): {exc}") from None
    return pa.Table.from_arrays(columns, schema=schema)


def table_of(batches: list[pa.RecordBatch]) -> pa.Table | None:
    return pa.Table.from_batches(batches) if batches else None


def where(processor: StatefulProcessor | VectorizedProcessor, spec: TaskSpec) -> str:
    return f"{type(processor).__name__} of operator {spec.operator_id!r} at {spec.root}: "
