"""Reference row hash: Spark's ``xxhash64`` (``XxHash64Function``) bit for bit, in pure Python.

This module defines the behaviour; ``_ext/sparkhash.pyx`` is its compiled twin (same functions, same
results, same error classes). See ``statestore_async.codecs.sparkhash`` for the user documentation.

Spark's rule: the running hash starts at the seed (42); for each column in order a null leaves it
unchanged, any other value replaces it with ``XXH64(bytes_of(value), seed=hash)`` (the previous hash
as an unsigned 64-bit seed). The result is read as a signed 64-bit long. ``bytes_of``:

=================================  ============================================================
boolean                            int 1 / 0 as 4 little-endian bytes
tinyint, smallint, int, date       sign-extended int32, 4 LE bytes (date: days since 1970-01-01)
bigint, timestamp, timestamp_ntz   int64, 8 LE bytes (timestamp: microseconds since the epoch)
float                              Java ``floatToIntBits`` (4 bytes), -0.0 -> 0.0, NaN -> 0x7fc00000
double                             Java ``doubleToLongBits`` (8 bytes), -0.0 -> 0.0,
                                   NaN -> 0x7ff8000000000000
string                             UTF-8 bytes
binary                             the bytes
void / null                        always skipped
=================================  ============================================================
"""
from __future__ import annotations

import datetime as _dt
import numbers
import operator
import struct
from typing import TYPE_CHECKING, cast

import numpy as np
import xxhash

from statestore_async._ref.sparktypes import (
    CODE_NAMES as _CODE_NAMES,
)
from statestore_async._ref.sparktypes import (
    T_BIGINT,
    T_BINARY,
    T_BOOLEAN,
    T_DATE,
    T_DOUBLE,
    T_FLOAT,
    T_INT,
    T_SKIP,
    T_SMALLINT,
    T_STRING,
    T_TIMESTAMP,
    T_TIMESTAMP_NTZ,
    T_TINYINT,
    TYPE_NAMES,
)
from statestore_async.errors import EncodeError, InterfaceError

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence
    from typing import Any, Protocol, SupportsIndex

    import pyarrow as pa
    from numpy.typing import ArrayLike, NDArray

    from statestore_async._ref import Buffer

    class _SparkType(Protocol):
        """A pyspark ``DataType`` (its type name is ``simpleString()``)."""

        def simpleString(self) -> str: ...


SPARK_SEED = 42

_U64 = (1 << 64) - 1
_I64_MIN = -(1 << 63)
_I64_MAX = (1 << 63) - 1
_I32_MIN = -(1 << 31)
_I32_MAX = (1 << 31) - 1
_EPOCH_ORDINAL = _dt.date(1970, 1, 1).toordinal()
_EPOCH_UTC = _dt.datetime(1970, 1, 1, tzinfo=_dt.UTC)
_EPOCH_NAIVE = _dt.datetime(1970, 1, 1)
_ONE_US = _dt.timedelta(microseconds=1)


_INT_RANGES = {
    T_TINYINT: (-(1 << 7), (1 << 7) - 1),
    T_SMALLINT: (-(1 << 15), (1 << 15) - 1),
    T_INT: (_I32_MIN, _I32_MAX),
    T_BIGINT: (_I64_MIN, _I64_MAX),
    T_DATE: (_I32_MIN, _I32_MAX),
    T_TIMESTAMP: (_I64_MIN, _I64_MAX),
    T_TIMESTAMP_NTZ: (_I64_MIN, _I64_MAX),
}

_BINARY_TYPES = (bytes, bytearray, memoryview)
_NOT_ROWS = (str, bytes, bytearray, memoryview, dict)
#: ``operator.index`` of any value (TypeError when it has no ``__index__``: the callers catch it).
_index = cast("Callable[[object], int]", operator.index)


# --- arguments -----------------------------------------------------------------------------------
def _seed(seed: SupportsIndex) -> int:
    """A seed as unsigned 64-bit: any int in [-2**63, 2**64) (negative ones wrap, like a Java long)."""
    if isinstance(seed, bool):
        raise InterfaceError(f"seed must be an int, not {type(seed).__name__}")
    try:
        s = operator.index(seed)
    except TypeError:
        raise InterfaceError(f"seed must be an int, not {type(seed).__name__}") from None
    if s < _I64_MIN or s > _U64:
        raise InterfaceError(f"seed {s} does not fit in 64 bits")
    return s & _U64


def _signed(h: int) -> int:
    return h - (1 << 64) if h > _I64_MAX else h


def _type_code(name: str | _SparkType) -> int:
    if not isinstance(name, str):
        simple = getattr(name, "simpleString", None)  # a pyspark DataType
        if simple is None or not callable(simple):
            raise InterfaceError(f"a type must be a Spark type name (str), not {type(name).__name__}")
        name = simple()
        if not isinstance(name, str):
            raise InterfaceError("DataType.simpleString() did not return a str")
    code = TYPE_NAMES.get(name.strip().lower())
    if code is None:
        raise InterfaceError(
            f"unknown or unsupported Spark type {name!r} (supported: {', '.join(sorted(TYPE_NAMES))})"
        )
    return code


def _type_codes(types: Iterable[str | _SparkType] | None) -> list[int] | None:
    if types is None:
        return None
    if isinstance(types, (str, bytes)):
        raise InterfaceError("types must be a sequence of type names, one per column, not a single str")
    try:
        return [_type_code(t) for t in types]
    except TypeError:
        raise InterfaceError(f"types must be a sequence of type names, not {type(types).__name__}") from None


def _as_row(values: Iterable[object], what: str) -> Sequence[object]:
    if type(values) is tuple or type(values) is list:
        return values
    if isinstance(values, (tuple, list)):
        return values
    if isinstance(values, _NOT_ROWS):
        raise InterfaceError(f"{what} must be a sequence of column values, not {type(values).__name__}")
    try:
        return tuple(values)
    except TypeError:
        raise InterfaceError(f"{what} must be a sequence of column values, not {type(values).__name__}") from None


# --- values --------------------------------------------------------------------------------------
def _where(col: int) -> str:
    return f"column {col}"


def _as_int(v: object, code: int, col: int) -> int:
    if isinstance(v, (bool, np.bool_)):
        raise EncodeError(f"{_where(col)}: {_CODE_NAMES[code]} expects an int, got bool")
    if type(v) is int:
        i = v
    else:
        try:
            i = _index(v)
        except TypeError:
            raise EncodeError(
                f"{_where(col)}: {_CODE_NAMES[code]} expects an int, got {type(v).__name__}"
            ) from None
    lo, hi = _INT_RANGES[code]
    if i < lo or i > hi:
        raise EncodeError(f"{_where(col)}: {i} does not fit in Spark {_CODE_NAMES[code]} [{lo}, {hi}]")
    return i


def _as_float(v: object, code: int, col: int) -> float:
    if type(v) is float:
        return v
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Real):
        raise EncodeError(f"{_where(col)}: {_CODE_NAMES[code]} expects a float, got {type(v).__name__}")
    try:
        return float(v)
    except (OverflowError, ValueError, TypeError) as exc:
        raise EncodeError(f"{_where(col)}: {v!r} cannot be converted to {_CODE_NAMES[code]}: {exc}") from None


def _float_bits(f: float) -> int:
    """Java floatToIntBits of (float) f, with -0.0 -> 0.0 (Spark) and NaN canonical."""
    if f != f:
        return 0x7FC00000
    if f == 0.0:
        return 0
    try:
        bits = struct.unpack("<I", struct.pack("<f", f))[0]
    except OverflowError:  # beyond float32 range: a C/Java (float) cast gives infinity
        return 0x7F800000 if f > 0 else 0xFF800000
    # a tiny negative double becomes -0.0f, which Spark normalizes to 0.0f as well
    return 0 if bits == 0x80000000 else bits


def _double_bits(d: float) -> int:
    if d != d:
        return 0x7FF8000000000000
    if d == 0.0:
        return 0
    bits: int = struct.unpack("<Q", struct.pack("<d", d))[0]
    return bits


def _timestamp_micros(v: object, code: int, col: int) -> int:
    if isinstance(v, _dt.datetime):
        if code == T_TIMESTAMP_NTZ or v.tzinfo is None or v.utcoffset() is None:
            # timestamp_ntz: the wall clock as if UTC (pyspark's rule); naive timestamp: UTC (ours)
            return (v.replace(tzinfo=None) - _EPOCH_NAIVE) // _ONE_US
        return (v - _EPOCH_UTC) // _ONE_US
    if isinstance(v, _dt.date):
        raise EncodeError(f"{_where(col)}: {_CODE_NAMES[code]} expects a datetime or int microseconds, got date")
    return _as_int(v, code, col)


def _date_days(v: object, col: int) -> int:
    if isinstance(v, _dt.datetime):
        raise EncodeError(f"{_where(col)}: date expects a datetime.date or int days, got datetime")
    if isinstance(v, _dt.date):
        return v.toordinal() - _EPOCH_ORDINAL
    return _as_int(v, T_DATE, col)


def _infer(v: object, col: int) -> int:
    if v is None:
        return T_SKIP
    if isinstance(v, (bool, np.bool_)):
        return T_BOOLEAN
    if isinstance(v, int):
        return T_BIGINT
    if isinstance(v, float):
        return T_DOUBLE
    if isinstance(v, str):
        return T_STRING
    if isinstance(v, _BINARY_TYPES):
        return T_BINARY
    if isinstance(v, _dt.datetime):
        return T_TIMESTAMP
    if isinstance(v, _dt.date):
        return T_DATE
    raise EncodeError(
        f"{_where(col)}: cannot infer a Spark type for {type(v).__name__} (pass types=...)"
    )


def _hash_value(v: object, code: int, h: int, col: int) -> int:
    """The running hash ``h`` (unsigned) after column value ``v`` of type ``code``."""
    if v is None or code == T_SKIP:
        return h
    if code == T_STRING:
        if not isinstance(v, str):
            raise EncodeError(f"{_where(col)}: string expects a str, got {type(v).__name__}")
        try:
            data = v.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise EncodeError(f"{_where(col)}: string is not encodable as UTF-8: {exc}") from None
        return xxhash.xxh64_intdigest(data, h)
    if code == T_BINARY:
        if not isinstance(v, _BINARY_TYPES):
            raise EncodeError(f"{_where(col)}: binary expects bytes-like, got {type(v).__name__}")
        return xxhash.xxh64_intdigest(bytes(memoryview(v).tobytes()), h)
    if code == T_BOOLEAN:
        if not isinstance(v, (bool, np.bool_)):
            raise EncodeError(f"{_where(col)}: boolean expects a bool, got {type(v).__name__}")
        return xxhash.xxh64_intdigest(struct.pack("<i", 1 if v else 0), h)
    if code in (T_TINYINT, T_SMALLINT, T_INT):
        return xxhash.xxh64_intdigest(struct.pack("<i", _as_int(v, code, col)), h)
    if code == T_DATE:
        return xxhash.xxh64_intdigest(struct.pack("<i", _date_days(v, col)), h)
    if code == T_BIGINT:
        return xxhash.xxh64_intdigest(struct.pack("<q", _as_int(v, code, col)), h)
    if code in (T_TIMESTAMP, T_TIMESTAMP_NTZ):
        micros = _timestamp_micros(v, code, col)
        return xxhash.xxh64_intdigest(struct.pack("<q", micros), h)
    if code == T_FLOAT:
        return xxhash.xxh64_intdigest(struct.pack("<I", _float_bits(_as_float(v, code, col))), h)
    if code == T_DOUBLE:
        return xxhash.xxh64_intdigest(struct.pack("<Q", _double_bits(_as_float(v, code, col))), h)
    raise AssertionError(code)  # pragma: no cover


def _hash_row(row: Sequence[object], codes: list[int] | None, seed: int) -> int:
    h = seed
    if codes is None:
        for col, v in enumerate(row):
            h = _hash_value(v, _infer(v, col), h, col)
    else:
        if len(row) != len(codes):
            raise InterfaceError(f"a row has {len(row)} values but {len(codes)} types were given")
        for col, v in enumerate(row):
            h = _hash_value(v, codes[col], h, col)
    return _signed(h)


# --- public functions ----------------------------------------------------------------------------
def xxh64(data: Buffer, seed: SupportsIndex = 0) -> int:
    """XXH64 of a bytes-like object (unsigned 64-bit result; seed is taken modulo 2**64)."""
    s = _seed(seed)
    if isinstance(data, str):
        raise InterfaceError("xxh64 hashes bytes-like objects, not str (encode it first)")
    try:
        mv = memoryview(data)
    except TypeError:
        raise InterfaceError(f"xxh64 needs a bytes-like object, not {type(data).__name__}") from None
    return xxhash.xxh64_intdigest(mv.tobytes(), s)


def spark_xxhash64(
    values: Iterable[object], types: Iterable[str | _SparkType] | None = None, seed: SupportsIndex = SPARK_SEED
) -> int:
    """Spark's ``xxhash64(col1, col2, ...)`` of one row (signed 64-bit)."""
    s = _seed(seed)
    codes = _type_codes(types)
    row = _as_row(values, "values")
    return _hash_row(row, codes, s)


def hash_rows(
    rows: Iterable[Iterable[object]], types: Iterable[str | _SparkType] | None = None, seed: SupportsIndex = SPARK_SEED
) -> NDArray[np.int64]:
    """``spark_xxhash64`` of every row (int64 array)."""
    s = _seed(seed)
    codes = _type_codes(types)
    if isinstance(rows, _NOT_ROWS):
        raise InterfaceError(f"rows must be a sequence of rows, not {type(rows).__name__}")
    try:
        rows = rows if isinstance(rows, (list, tuple)) else list(rows)
    except TypeError:
        raise InterfaceError(f"rows must be a sequence of rows, not {type(rows).__name__}") from None
    out = np.empty(len(rows), dtype=np.int64)
    for i, row in enumerate(rows):
        try:
            out[i] = _hash_row(_as_row(row, "a row"), codes, s)
        except (EncodeError, InterfaceError) as exc:
            raise type(exc)(f"row {i}: {exc}") from None
    return out


# --- Arrow ---------------------------------------------------------------------------------------
def _arrow_columns(
    columns: pa.Table | pa.RecordBatch | Iterable[pa.Array | pa.ChunkedArray],
) -> tuple[list[pa.Array | pa.ChunkedArray], int]:
    import pyarrow as pa

    if isinstance(columns, (pa.Table, pa.RecordBatch)):
        columns = columns.columns
    if isinstance(columns, (pa.Array, pa.ChunkedArray)):
        raise InterfaceError("hash_arrow takes a sequence of columns; wrap a single array in a list")
    try:
        cols = list(columns)
    except TypeError:
        raise InterfaceError(f"columns must be a sequence of pyarrow arrays, not {type(columns).__name__}") from None
    if not cols:
        raise InterfaceError("hash_arrow needs at least one column")
    for i, c in enumerate(cols):
        if not isinstance(c, (pa.Array, pa.ChunkedArray)):
            raise InterfaceError(f"column {i} is a {type(c).__name__}, not a pyarrow Array or ChunkedArray")
    n = len(cols[0])
    for i, c in enumerate(cols):
        if len(c) != n:
            raise InterfaceError(f"column {i} has {len(c)} rows, column 0 has {n}")
    return cols, n


_TS_FACTOR = {"s": 1_000_000, "ms": 1_000, "us": 1, "ns": None}


def arrow_type_code(t: pa.DataType) -> int:
    """The type code used for an Arrow type (``InterfaceError`` naming it when unsupported)."""
    import pyarrow as pa
    import pyarrow.types as pt

    if pt.is_null(t):
        return T_SKIP
    if pt.is_boolean(t):
        return T_BOOLEAN
    if t == pa.int8():
        return T_TINYINT
    if t == pa.int16():
        return T_SMALLINT
    if t == pa.int32():
        return T_INT
    if t == pa.int64():
        return T_BIGINT
    if t == pa.float32():
        return T_FLOAT
    if t == pa.float64():
        return T_DOUBLE
    if t == pa.string() or t == pa.large_string():
        return T_STRING
    if t == pa.binary() or t == pa.large_binary():
        return T_BINARY
    if t == pa.date32():
        return T_DATE
    if pt.is_timestamp(t):
        return T_TIMESTAMP
    raise InterfaceError(f"hash_arrow does not support the Arrow type {t}")


def _arrow_chunk_values(chunk: pa.Array, code: int) -> list[Any]:
    """Python values of one Arrow chunk, as the Spark hash sees them (None for null)."""
    import pyarrow as pa

    if code in (T_STRING, T_BINARY):
        # hash the raw bytes (no UTF-8 decoding)
        large = chunk.type in (pa.large_string(), pa.large_binary())
        return cast("list[Any]", chunk.cast(pa.large_binary() if large else pa.binary()).to_pylist())
    if code == T_DATE:
        return cast("list[Any]", chunk.cast(pa.int32()).to_pylist())
    if code == T_TIMESTAMP:
        raw = chunk.cast(pa.int64()).to_pylist()
        factor = _TS_FACTOR[chunk.type.unit]
        out: list[int | None] = []
        for v in raw:
            if v is None:
                out.append(None)
            elif factor is None:
                out.append(v // 1000)  # nanoseconds: floor to microseconds, like java.time
            else:
                m = v * factor
                if m < _I64_MIN or m > _I64_MAX:
                    raise EncodeError(f"timestamp {v} {chunk.type.unit} overflows int64 microseconds")
                out.append(m)
        return out
    return cast("list[Any]", chunk.to_pylist())


def hash_arrow(
    columns: pa.Table | pa.RecordBatch | Iterable[pa.Array | pa.ChunkedArray], seed: SupportsIndex = SPARK_SEED
) -> NDArray[np.int64]:
    """``spark_xxhash64`` of every row of Arrow columns (int64 array)."""
    s = _seed(seed)
    cols, n = _arrow_columns(columns)
    codes = []
    for c in cols:
        codes.append(arrow_type_code(c.type))
    hashes = [s] * n
    for c, code in zip(cols, codes):
        if code == T_SKIP:
            continue
        chunks = c.chunks if hasattr(c, "chunks") else [c]
        base = 0
        for chunk in chunks:
            values = _arrow_chunk_values(chunk, code)
            if code == T_TIMESTAMP:
                code_v = T_BIGINT
            elif code == T_DATE:
                code_v = T_INT
            elif code == T_STRING:
                code_v = T_BINARY  # the raw UTF-8 bytes, as read from the buffers
            else:
                code_v = code
            for j, v in enumerate(values):
                if v is not None:
                    hashes[base + j] = _hash_value(v, code_v, hashes[base + j], 0)
            base += len(chunk)
    return np.array([_signed(h) for h in hashes], dtype=np.int64)


# --- key groups ----------------------------------------------------------------------------------
def _int_arg(v: SupportsIndex, name: str) -> int:
    if isinstance(v, (bool, np.bool_)):
        raise InterfaceError(f"{name} must be an int, not bool")
    try:
        return operator.index(v)
    except TypeError:
        raise InterfaceError(f"{name} must be an int, not {type(v).__name__}") from None


def _num_key_groups(g: SupportsIndex) -> int:
    g = _int_arg(g, "num_key_groups")
    if g < 1 or g > _I32_MAX:
        raise InterfaceError(f"num_key_groups must be in [1, 2**31-1], got {g}")
    return g


def key_group(hash: SupportsIndex, num_key_groups: SupportsIndex) -> int:
    """Spark's ``pmod(hash, num_key_groups)``: the key group of a signed 64-bit row hash."""
    g = _num_key_groups(num_key_groups)
    h = _int_arg(hash, "hash")
    if h < _I64_MIN or h > _I64_MAX:
        raise InterfaceError(f"hash must be a signed 64-bit int (as Spark's xxhash64 returns), got {h}")
    return h % g


def key_groups(hashes: ArrayLike, num_key_groups: SupportsIndex) -> NDArray[np.int32]:
    """``key_group`` of every hash (int32 array)."""
    g = _num_key_groups(num_key_groups)
    a = _hash_array(hashes)
    return np.mod(a, np.int64(g)).astype(np.int32)


def _hash_array(hashes: ArrayLike) -> NDArray[np.int64]:
    try:
        a = np.asarray(hashes)
    except (OverflowError, ValueError, TypeError) as exc:
        raise InterfaceError(f"hashes must be signed 64-bit ints: {exc}") from None
    if a.ndim != 1:
        if a.ndim == 0:
            raise InterfaceError("hashes must be a 1-d sequence of ints")
        raise InterfaceError(f"hashes must be 1-d, got shape {a.shape}")
    if a.size == 0:
        return np.empty(0, dtype=np.int64)
    if a.dtype.kind not in "iu" or a.dtype == np.uint64:
        raise InterfaceError(f"hashes must be signed 64-bit ints, got dtype {a.dtype}")
    return a.astype(np.int64, copy=False)


def _partitions(num_key_groups: SupportsIndex, num_partitions: SupportsIndex) -> tuple[int, int]:
    g = _num_key_groups(num_key_groups)
    n = _int_arg(num_partitions, "num_partitions")
    if n < 1 or n > g:
        raise InterfaceError(f"need num_key_groups >= num_partitions >= 1, got G={g}, N={n}")
    return g, n


def partition_of_key_group(kg: SupportsIndex, num_key_groups: SupportsIndex, num_partitions: SupportsIndex) -> int:
    """The partition owning key group ``kg``: ``kg * N // G`` (Flink's contiguous ranges)."""
    g, n = _partitions(num_key_groups, num_partitions)
    k = _int_arg(kg, "kg")
    if k < 0 or k >= g:
        raise InterfaceError(f"key group {k} out of range [0, {g})")
    return k * n // g


def key_group_range(partition: SupportsIndex, num_partitions: SupportsIndex, num_key_groups: SupportsIndex) -> range:
    """The key groups owned by ``partition``: ``range(ceil(p*G/N), ceil((p+1)*G/N))``."""
    g, n = _partitions(num_key_groups, num_partitions)
    p = _int_arg(partition, "partition")
    if p < 0 or p >= n:
        raise InterfaceError(f"partition {p} out of range [0, {n})")
    return range(-(-p * g // n), -(-(p + 1) * g // n))
