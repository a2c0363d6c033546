"""Encoded row tuples straight from and into Arrow columns: no Python object per row.

The vectorized Spark path keeps keys and state as Arrow columns; the store holds rows encoded by
``statestore_async.codecs.valuecodec``. These two functions convert between them column by column:

``encode_tuples(columns, *, key_groups=None, head=(), key=False) -> pyarrow binary array``
    Row i is ``valuecodec.encode_row((*head, columns[0][i], columns[1][i], ...))`` (``encode_key``
    when ``key``), preceded by the 2-byte big-endian key group ``key_groups[i]`` when given — the
    store keys of ``statestore_async.codecs.keylayout``. Byte for byte what encoding the rows' Python values
    gives (tests check it).
``group(columns) -> (order, offsets) | None``
    The rows grouped by their values in ``columns``, equal as keys are (their ``encode_key`` bytes:
    -0.0 is 0.0, every NaN one value, null a value of its own): ``order`` (int64) lists the rows
    group by group, the groups in the order of their first row and a group's rows in their order;
    group i is ``order[offsets[i]:offsets[i + 1]]``. One pass over the rows' encoded keys (a lone
    string or binary column without nulls: its own bytes) with a hash table, then a counting sort
    (``group_encoded``). None when a column's type is not one
    handled below (the caller groups another way).
``decode_tuples(values, schema) -> pyarrow.Table``
    The rows of a binary array of encoded tuples (null: no row) as a table of ``schema``; an
    absent row is null in every column. Errors as ``valuecodec.decode_rows`` and ``pyarrow.array``.

Column types handled in one pass (compiled: ``_ext/arrowcodec.pyx``, reference:
``_ref/arrowcodec.py``): signed and unsigned integers, float32/64, bool, string, binary (and their
large forms), null. Any other type, or a stored value that is not exactly the field's type (an INT
in a float column, a nested value...), takes the general path through Python values, with the same
result.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, cast

import numpy as np
import pyarrow as pa

from statestore_async.codecs import keylayout, twins, valuecodec
from statestore_async.codecs.arrowframes import to_array

if TYPE_CHECKING:
    from collections.abc import Iterable

    from numpy.typing import NDArray

    from statestore_async._ref import Buffer, ColumnDescriptor, FieldBuffers, KeyGroups

if TYPE_CHECKING or twins.NO_EXTENSIONS:
    from statestore_async._ref.arrowcodec import *
else:
    try:
        from statestore_async._native.arrowcodec import *
    except ImportError as _exc:
        twins.missing('arrowcodec', _exc)
        from statestore_async._ref.arrowcodec import *


def kind_of(typ: pa.DataType) -> tuple[str, int] | None:
    """``(kind, width)`` of an Arrow type the column codec handles, else None."""
    t = pa.types
    if t.is_signed_integer(typ):
        return "i", typ.bit_width // 8
    if t.is_unsigned_integer(typ):
        return "u", typ.bit_width // 8
    if t.is_float32(typ) or t.is_float64(typ):
        return "f", typ.bit_width // 8
    if t.is_boolean(typ):
        return "b", 0
    if t.is_string(typ):
        return "s", 4
    if t.is_large_string(typ):
        return "s", 8
    if t.is_binary(typ):
        return "y", 4
    if t.is_large_binary(typ):
        return "y", 8
    if t.is_null(typ):
        return "n", 0
    return None


def _array(col: pa.Array | pa.ChunkedArray) -> pa.Array:
    if isinstance(col, pa.ChunkedArray):
        return col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    if not isinstance(col, pa.Array):
        raise TypeError(f"expected a pyarrow array, got {type(col).__name__}")
    return col


def descriptor(col: pa.Array | pa.ChunkedArray) -> ColumnDescriptor | None:
    """The column descriptor ``encode_columns`` takes for a pyarrow array (or chunked array):
    ``(kind, width, validity, values, data, offset)``; None for a type it does not handle."""
    arr = _array(col)
    k = kind_of(arr.type)
    if k is None:
        return None
    kind, width = k
    bufs = arr.buffers()
    validity = bufs[0] if arr.null_count else None
    if kind == "n":
        return kind, width, None, None, None, arr.offset
    if kind in ("s", "y"):
        return kind, width, validity, bufs[1], bufs[2] if bufs[2] is not None else b"", arr.offset
    return kind, width, validity, bufs[1], None, arr.offset


def _prefixes(key_groups: KeyGroups | None, n: int) -> NDArray[np.uint16] | None:
    if key_groups is None:
        return None
    kg = np.asarray(key_groups)
    if kg.shape != (n,):
        raise ValueError(f"{kg.shape} key groups for {n} rows")
    if n and (kg.min() < 0 or kg.max() > 0xFFFF):
        raise ValueError("key groups must be in [0, 65536)")
    return np.ascontiguousarray(kg, dtype=np.uint16)


def encode_tuples(
    columns: Iterable[pa.Array | pa.ChunkedArray],
    *,
    key_groups: KeyGroups | None = None,
    head: tuple[object, ...] = (),
    key: bool = False,
) -> pa.Array:
    """See the module docstring."""
    arrays = [_array(c) for c in columns]
    n = len(arrays[0]) if arrays else (len(key_groups) if key_groups is not None else 0)
    if any(len(a) != n for a in arrays):
        raise ValueError(f"columns of different lengths {[len(a) for a in arrays]}")
    prefixes = _prefixes(key_groups, n)
    descriptors = [descriptor(a) for a in arrays]
    if all(d is not None for d in descriptors):
        enc = valuecodec.encode_key if key else valuecodec.encode_row
        head_bytes = b"".join(enc(h) for h in head)
        # no descriptor is None (checked above); a numpy array is a buffer (numpy's stubs say so to
        # checkers of Python 3.12+ only)
        done = encode_columns(n, cast("list[ColumnDescriptor]", descriptors), cast("Buffer | None", prefixes),
                              head_bytes, len(head), key)
        if done is not None:
            offsets, data, width = done
            return to_array(n, 0, None, offsets, data, width)
    # the general path: the rows' Python values
    rows = list(zip(*[a.to_pylist() for a in arrays])) if arrays else [()] * n
    encoded = (valuecodec.encode_keys if key else valuecodec.encode_rows)([(*head, *r) for r in rows])
    if prefixes is not None:
        encoded = [keylayout.prefix(int(g)) + e for g, e in zip(prefixes.tolist(), encoded)]
    return pa.array(encoded, type=pa.large_binary() if sum(map(len, encoded)) > 0x7FFFFFFF else pa.binary())


def group(columns: Iterable[pa.Array | pa.ChunkedArray]) -> tuple[NDArray[np.int64], NDArray[np.int64]] | None:
    """See the module docstring."""
    arrays = [_array(c) for c in columns]
    if not arrays or any(kind_of(a.type) is None for a in arrays):
        return None
    n = len(arrays[0])
    one = arrays[0]
    if len(arrays) == 1 and kind_of(one.type)[0] in ("s", "y") and not one.null_count:  # type: ignore[index]
        # one string or binary key column without nulls: its values' bytes are as distinct as their
        # encoded keys, so it is grouped as it is (no encoding: ~35 ns a row less)
        keys = one
    else:
        keys = _array(encode_tuples(arrays, key=True))  # ValueError for columns of different lengths
    _, width, _, offsets, data, start = cast("ColumnDescriptor", descriptor(keys))
    if start:  # a slice: its offsets from its first item's on
        offsets = memoryview(cast("Buffer", offsets))[start * width:]
    order, bounds = np.empty(n, np.int64), np.empty(n + 1, np.int64)
    groups = group_encoded(n, cast("Buffer", offsets), cast("Buffer", data), width, order, bounds)
    return order, bounds[:groups + 1]


def _field_array(typ: pa.DataType, n: int, kind: str, parts: FieldBuffers) -> pa.Array:
    nulls = parts[0]
    if kind == "n":
        return pa.nulls(n, typ)
    validity = None if parts[1] is None else pa.py_buffer(parts[1])
    bufs = [validity, *(pa.py_buffer(p) for p in parts[2:])]
    return pa.Array.from_buffers(typ, n, bufs, nulls)


def decode_tuples(values: pa.Array | pa.ChunkedArray, schema: pa.Schema) -> pa.Table:
    """See the module docstring."""
    arr = _array(values)
    if not (pa.types.is_binary(arr.type) or pa.types.is_large_binary(arr.type)):
        raise TypeError(f"values must be a pyarrow binary array, got {arr.type}")
    n = len(arr)
    kinds = [kind_of(f.type) for f in schema]
    if all(k is not None for k in kinds):
        handled = cast("list[tuple[str, int]]", kinds)
        # a binary array always has a descriptor
        parts = decode_columns(n, cast("ColumnDescriptor", descriptor(arr)), handled)
        if parts is not None:
            return pa.Table.from_arrays([_field_array(f.type, n, k[0], p) for f, k, p in zip(schema, handled, parts)],
                                        schema=schema)
    # the general path: decoded Python tuples -> one struct array, scattered to their rows
    raw = arr.to_pylist()
    exists = np.fromiter((r is not None for r in raw), dtype=bool, count=n)
    present = valuecodec.decode_rows([r for r in raw if r is not None])
    st = pa.struct(list(schema))
    where = np.full(n, len(present), dtype=np.int64)
    where[exists] = np.arange(len(present), dtype=np.int64)
    full = pa.concat_arrays([pa.array(present, type=st), pa.nulls(1, st)]).take(pa.array(where))
    return pa.Table.from_arrays(full.flatten(), schema=schema)


