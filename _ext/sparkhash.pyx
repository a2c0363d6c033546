# cython: language_level=3
"""Compiled twin of ``statestore_async._ref.sparkhash``: Spark's ``xxhash64`` bit for bit.

XXH64 is implemented here from its specification with C ``uint64_t`` arithmetic (wrapping), so the
per-row work runs without the GIL and without a Python call per value. Same public functions, same
results and same error classes as the reference; see ``statestore_async.codecs.sparkhash`` for the docs.
"""
import datetime as _dt
import numbers
import operator

import numpy as np

cimport cython
from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_GET_SIZE
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.long cimport PyLong_AsLongLongAndOverflow
from cpython.unicode cimport PyUnicode_AsUTF8AndSize, PyUnicode_AsUTF8String
from libc.stdint cimport (INT64_MAX, INT64_MIN, int8_t, int16_t, int32_t, int64_t, uint8_t,
                          uint32_t, uint64_t)
from libc.string cimport memcpy

from statestore_async.errors import EncodeError, InterfaceError

cdef extern from "Python.h":
    int PyUnicode_IS_ASCII(object o)
    double PyFloat_AS_DOUBLE(object o)


SPARK_SEED = 42

# ------------------------------------------------------------------------------------------------
# XXH64 (from the specification: https://github.com/Cyan4973/xxHash/blob/dev/doc/xxhash_spec.md)
# ------------------------------------------------------------------------------------------------
cdef uint64_t PRIME64_1 = 0x9E3779B185EBCA87ULL
cdef uint64_t PRIME64_2 = 0xC2B2AE3D27D4EB4FULL
cdef uint64_t PRIME64_3 = 0x165667B19E3779F9ULL
cdef uint64_t PRIME64_4 = 0x85EBCA77C2B2AE63ULL
cdef uint64_t PRIME64_5 = 0x27D4EB2F165667C5ULL


cdef inline uint64_t _rotl(uint64_t x, int r) noexcept nogil:
    return (x << r) | (x >> (64 - r))


cdef inline uint64_t _le64(const uint8_t* p) noexcept nogil:
    # explicit little-endian assembly (the compiler turns it into one load on LE machines)
    return (<uint64_t>p[0] | (<uint64_t>p[1] << 8) | (<uint64_t>p[2] << 16)
            | (<uint64_t>p[3] << 24) | (<uint64_t>p[4] << 32) | (<uint64_t>p[5] << 40)
            | (<uint64_t>p[6] << 48) | (<uint64_t>p[7] << 56))


cdef inline uint32_t _le32(const uint8_t* p) noexcept nogil:
    return (<uint32_t>p[0] | (<uint32_t>p[1] << 8) | (<uint32_t>p[2] << 16)
            | (<uint32_t>p[3] << 24))


cdef inline uint64_t _round(uint64_t acc, uint64_t lane) noexcept nogil:
    acc = acc + lane * PRIME64_2
    acc = _rotl(acc, 31)
    return acc * PRIME64_1


cdef inline uint64_t _merge_round(uint64_t acc, uint64_t val) noexcept nogil:
    acc = acc ^ _round(0, val)
    return acc * PRIME64_1 + PRIME64_4


cdef inline uint64_t _avalanche(uint64_t h) noexcept nogil:
    h = h ^ (h >> 33)
    h = h * PRIME64_2
    h = h ^ (h >> 29)
    h = h * PRIME64_3
    h = h ^ (h >> 32)
    return h


cdef uint64_t _xxh64(const uint8_t* p, size_t n, uint64_t seed) noexcept nogil:
    cdef size_t rem = n
    cdef uint64_t v1, v2, v3, v4, h
    if rem >= 32:
        v1 = seed + PRIME64_1 + PRIME64_2
        v2 = seed + PRIME64_2
        v3 = seed
        v4 = seed - PRIME64_1
        while rem >= 32:
            v1 = _round(v1, _le64(p))
            v2 = _round(v2, _le64(p + 8))
            v3 = _round(v3, _le64(p + 16))
            v4 = _round(v4, _le64(p + 24))
            p += 32
            rem -= 32
        h = _rotl(v1, 1) + _rotl(v2, 7) + _rotl(v3, 12) + _rotl(v4, 18)
        h = _merge_round(h, v1)
        h = _merge_round(h, v2)
        h = _merge_round(h, v3)
        h = _merge_round(h, v4)
    else:
        h = seed + PRIME64_5
    h = h + <uint64_t>n
    while rem >= 8:
        h = h ^ _round(0, _le64(p))
        h = _rotl(h, 27) * PRIME64_1 + PRIME64_4
        p += 8
        rem -= 8
    if rem >= 4:
        h = h ^ (<uint64_t>_le32(p) * PRIME64_1)
        h = _rotl(h, 23) * PRIME64_2 + PRIME64_3
        p += 4
        rem -= 4
    while rem > 0:
        h = h ^ (<uint64_t>p[0] * PRIME64_5)
        h = _rotl(h, 11) * PRIME64_1
        p += 1
        rem -= 1
    return _avalanche(h)


cdef inline uint64_t _xxh64_int(int32_t v, uint64_t seed) noexcept nogil:
    """XXH64 of the 4 little-endian bytes of v (Spark's hashInt)."""
    cdef uint64_t h = seed + PRIME64_5 + 4
    h = h ^ (<uint64_t>(<uint32_t>v) * PRIME64_1)
    h = _rotl(h, 23) * PRIME64_2 + PRIME64_3
    return _avalanche(h)


cdef inline uint64_t _xxh64_long(uint64_t v, uint64_t seed) noexcept nogil:
    """XXH64 of the 8 little-endian bytes of v (Spark's hashLong)."""
    cdef uint64_t h = seed + PRIME64_5 + 8
    h = h ^ _round(0, v)
    h = _rotl(h, 27) * PRIME64_1 + PRIME64_4
    return _avalanche(h)


cdef inline uint32_t _float_bits(float f) noexcept nogil:
    """Java floatToIntBits with Spark's -0.0 -> 0.0; every NaN -> 0x7fc00000."""
    cdef uint32_t bits
    if f != f:
        return 0x7FC00000U
    if f == 0.0:
        return 0
    memcpy(&bits, &f, 4)
    return bits


cdef inline uint64_t _double_bits(double d) noexcept nogil:
    cdef uint64_t bits
    if d != d:
        return 0x7FF8000000000000ULL
    if d == 0.0:
        return 0
    memcpy(&bits, &d, 8)
    return bits


cdef inline uint32_t _norm_float_bits(uint32_t bits) noexcept nogil:
    if (bits & 0x7FFFFFFFU) > 0x7F800000U:
        return 0x7FC00000U
    if bits == 0x80000000U:
        return 0
    return bits


cdef inline uint64_t _norm_double_bits(uint64_t bits) noexcept nogil:
    if (bits & 0x7FFFFFFFFFFFFFFFULL) > 0x7FF0000000000000ULL:
        return 0x7FF8000000000000ULL
    if bits == 0x8000000000000000ULL:
        return 0
    return bits


# ------------------------------------------------------------------------------------------------
# types
# ------------------------------------------------------------------------------------------------
cdef enum:
    T_SKIP = 0
    T_BOOLEAN = 1
    T_TINYINT = 2
    T_SMALLINT = 3
    T_INT = 4
    T_BIGINT = 5
    T_FLOAT = 6
    T_DOUBLE = 7
    T_STRING = 8
    T_BINARY = 9
    T_DATE = 10
    T_TIMESTAMP = 11
    T_TIMESTAMP_NTZ = 12

# by name and by code, the one table both twins use (the codes above are checked against it by
# tests/test_formats.py)
from statestore_async._ref.sparktypes import CODE_NAMES as _CODE_NAMES, TYPE_NAMES

cdef object _U64 = (1 << 64) - 1
cdef object _I64_MIN = -(1 << 63)
cdef object _I64_MAX = (1 << 63) - 1
cdef int64_t _I32_MAX = 2147483647

cdef object _EPOCH_ORDINAL = _dt.date(1970, 1, 1).toordinal()
cdef object _EPOCH_UTC = _dt.datetime(1970, 1, 1, tzinfo=_dt.timezone.utc)
cdef object _EPOCH_NAIVE = _dt.datetime(1970, 1, 1)
cdef object _ONE_US = _dt.timedelta(microseconds=1)
cdef object _datetime = _dt.datetime
cdef object _date = _dt.date
cdef object _np_bool = np.bool_
cdef tuple _BOOL_TYPES = (bool, np.bool_)
cdef tuple _BINARY_TYPES = (bytes, bytearray, memoryview)
cdef tuple _NOT_ROWS = (str, bytes, bytearray, memoryview, dict)


cdef inline void _int_range(int code, int64_t* lo, int64_t* hi) noexcept:
    if code == T_TINYINT:
        lo[0] = -128
        hi[0] = 127
    elif code == T_SMALLINT:
        lo[0] = -32768
        hi[0] = 32767
    elif code == T_INT or code == T_DATE:
        lo[0] = -2147483648
        hi[0] = 2147483647
    else:
        lo[0] = INT64_MIN
        hi[0] = INT64_MAX


# --- arguments -----------------------------------------------------------------------------------
cdef uint64_t _seed(object seed) except? 0:
    if isinstance(seed, bool):
        raise InterfaceError(f"seed must be an int, not {type(seed).__name__}")
    try:
        s = operator.index(seed)
    except TypeError:
        raise InterfaceError(f"seed must be an int, not {type(seed).__name__}") from None
    if s < _I64_MIN or s > _U64:
        raise InterfaceError(f"seed {s} does not fit in 64 bits")
    return <uint64_t>(s & _U64)


cdef int _type_code(object name) except -1:
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


cdef object _type_codes(object types):
    """None, or an int32 numpy array of type codes."""
    if types is None:
        return None
    if isinstance(types, (str, bytes)):
        raise InterfaceError("types must be a sequence of type names, one per column, not a single str")
    try:
        codes = [_type_code(t) for t in types]
    except TypeError:
        raise InterfaceError(f"types must be a sequence of type names, not {type(types).__name__}") from None
    return np.array(codes, dtype=np.int32)


cdef object _as_row(object values, str what):
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


cdef str _where(Py_ssize_t col):
    return f"column {col}"


# --- values (slow paths in Python, same rules as the reference) ----------------------------------
cdef int64_t _as_int(object v, int code, Py_ssize_t col) except? -1:
    cdef int overflow = 0
    cdef long long x
    cdef int64_t lo, hi
    _int_range(code, &lo, &hi)
    if type(v) is int:
        x = PyLong_AsLongLongAndOverflow(v, &overflow)
        if overflow == 0 and lo <= x <= hi:
            return x
        i = v
    else:
        if isinstance(v, _BOOL_TYPES):
            raise EncodeError(f"{_where(col)}: {_CODE_NAMES[code]} expects an int, got bool")
        try:
            i = operator.index(v)
        except TypeError:
            raise EncodeError(
                f"{_where(col)}: {_CODE_NAMES[code]} expects an int, got {type(v).__name__}"
            ) from None
    if i < lo or i > hi:
        raise EncodeError(f"{_where(col)}: {i} does not fit in Spark {_CODE_NAMES[code]} [{lo}, {hi}]")
    return <int64_t>i


cdef double _as_float(object v, int code, Py_ssize_t col) except? -1.0:
    if type(v) is float:
        return PyFloat_AS_DOUBLE(v)
    if isinstance(v, _BOOL_TYPES) or not isinstance(v, numbers.Real):
        raise EncodeError(f"{_where(col)}: {_CODE_NAMES[code]} expects a float, got {type(v).__name__}")
    try:
        return float(v)
    except (OverflowError, ValueError, TypeError) as exc:
        raise EncodeError(f"{_where(col)}: {v!r} cannot be converted to {_CODE_NAMES[code]}: {exc}") from None


cdef int64_t _timestamp_micros(object v, int code, Py_ssize_t col) except? -1:
    if isinstance(v, _datetime):
        if code == T_TIMESTAMP_NTZ or v.tzinfo is None or v.utcoffset() is None:
            return (v.replace(tzinfo=None) - _EPOCH_NAIVE) // _ONE_US
        return (v - _EPOCH_UTC) // _ONE_US
    if isinstance(v, _date):
        raise EncodeError(f"{_where(col)}: {_CODE_NAMES[code]} expects a datetime or int microseconds, got date")
    return _as_int(v, code, col)


cdef int64_t _date_days(object v, Py_ssize_t col) except? -1:
    if isinstance(v, _datetime):
        raise EncodeError(f"{_where(col)}: date expects a datetime.date or int days, got datetime")
    if isinstance(v, _date):
        return v.toordinal() - _EPOCH_ORDINAL
    return _as_int(v, T_DATE, col)


cdef int _infer(object v, Py_ssize_t col) except -1:
    cdef type t = type(v)
    if t is str:
        return T_STRING
    if t is int:
        return T_BIGINT
    if t is float:
        return T_DOUBLE
    if t is bool:
        return T_BOOLEAN
    if t is bytes:
        return T_BINARY
    if v is None:
        return T_SKIP
    if isinstance(v, _BOOL_TYPES):
        return T_BOOLEAN
    if isinstance(v, int):
        return T_BIGINT
    if isinstance(v, float):
        return T_DOUBLE
    if isinstance(v, str):
        return T_STRING
    if isinstance(v, _BINARY_TYPES):
        return T_BINARY
    if isinstance(v, _datetime):
        return T_TIMESTAMP
    if isinstance(v, _date):
        return T_DATE
    raise EncodeError(f"{_where(col)}: cannot infer a Spark type for {type(v).__name__} (pass types=...)")


cdef int _hash_buffer_obj(object v, uint64_t* h) except -1:
    """XXH64 of any bytes-like object into h (C-order bytes for non-contiguous views)."""
    cdef Py_buffer view
    try:
        PyObject_GetBuffer(v, &view, PyBUF_SIMPLE)
    except (BufferError, ValueError):  # not C-contiguous (numpy says ValueError)
        data = memoryview(v).tobytes()
        h[0] = _xxh64(<const uint8_t*>PyBytes_AS_STRING(data), <size_t>PyBytes_GET_SIZE(data), h[0])
        return 0
    try:
        if view.len >= 65536:
            with nogil:
                h[0] = _xxh64(<const uint8_t*>view.buf, <size_t>view.len, h[0])
        else:
            h[0] = _xxh64(<const uint8_t*>view.buf, <size_t>view.len, h[0])
    finally:
        PyBuffer_Release(&view)
    return 0


cdef int _hash_value(object v, int code, uint64_t* h, Py_ssize_t col) except -1:
    """Advance the running hash h by column value v of type code (v is not None)."""
    cdef const char* s
    cdef Py_ssize_t n
    if code == T_STRING:
        if type(v) is not str and not isinstance(v, str):
            raise EncodeError(f"{_where(col)}: string expects a str, got {type(v).__name__}")
        if PyUnicode_IS_ASCII(v):
            s = PyUnicode_AsUTF8AndSize(v, &n)  # the ASCII data itself, no copy
            h[0] = _xxh64(<const uint8_t*>s, <size_t>n, h[0])
        else:
            try:
                data = PyUnicode_AsUTF8String(v)  # a temporary (does not cache UTF-8 in the str)
            except UnicodeEncodeError as exc:
                raise EncodeError(f"{_where(col)}: string is not encodable as UTF-8: {exc}") from None
            h[0] = _xxh64(<const uint8_t*>PyBytes_AS_STRING(data), <size_t>PyBytes_GET_SIZE(data), h[0])
    elif code == T_BIGINT:
        h[0] = _xxh64_long(<uint64_t>_as_int(v, code, col), h[0])
    elif code == T_INT or code == T_SMALLINT or code == T_TINYINT:
        h[0] = _xxh64_int(<int32_t>_as_int(v, code, col), h[0])
    elif code == T_BINARY:
        if type(v) is bytes:
            h[0] = _xxh64(<const uint8_t*>PyBytes_AS_STRING(v), <size_t>PyBytes_GET_SIZE(v), h[0])
        elif not isinstance(v, _BINARY_TYPES):
            raise EncodeError(f"{_where(col)}: binary expects bytes-like, got {type(v).__name__}")
        else:
            _hash_buffer_obj(v, h)
    elif code == T_BOOLEAN:
        if v is True:
            h[0] = _xxh64_int(1, h[0])
        elif v is False:
            h[0] = _xxh64_int(0, h[0])
        elif isinstance(v, _BOOL_TYPES):
            h[0] = _xxh64_int(1 if v else 0, h[0])
        else:
            raise EncodeError(f"{_where(col)}: boolean expects a bool, got {type(v).__name__}")
    elif code == T_DOUBLE:
        h[0] = _xxh64_long(_double_bits(_as_float(v, code, col)), h[0])
    elif code == T_FLOAT:
        # (float) cast: round to nearest, beyond the float32 range -> +-inf (as Java/C do)
        h[0] = _xxh64_int(<int32_t>_float_bits(<float>_as_float(v, code, col)), h[0])
    elif code == T_DATE:
        h[0] = _xxh64_int(<int32_t>_date_days(v, col), h[0])
    elif code == T_TIMESTAMP or code == T_TIMESTAMP_NTZ:
        h[0] = _xxh64_long(<uint64_t>_timestamp_micros(v, code, col), h[0])
    return 0


cdef uint64_t _hash_row(object row, const int32_t* codes, Py_ssize_t ncodes, bint typed,
                        uint64_t seed) except? 0:
    cdef uint64_t h = seed
    cdef Py_ssize_t ncols, c
    cdef int code
    cdef bint is_tuple = type(row) is tuple
    if not is_tuple and type(row) is not list:
        row = _as_row(row, "a row")
        is_tuple = type(row) is tuple
        if not is_tuple and type(row) is not list:
            row = tuple(row)  # tuple/list subclasses
            is_tuple = True
    ncols = len(row)
    if typed and ncols != ncodes:
        raise InterfaceError(f"a row has {ncols} values but {ncodes} types were given")
    for c in range(ncols):
        if is_tuple:
            v = (<tuple>row)[c]
        else:
            if c >= len(<list>row):
                raise InterfaceError("a row list changed size while it was hashed")
            v = (<list>row)[c]
        if typed:
            code = codes[c]
            if v is None or code == T_SKIP:
                continue
        else:
            code = _infer(v, c)
            if code == T_SKIP:
                continue
        _hash_value(v, code, &h, c)
    return h


# ------------------------------------------------------------------------------------------------
# public functions
# ------------------------------------------------------------------------------------------------
def xxh64(data, seed=0):
    """XXH64 of a bytes-like object (unsigned 64-bit result; seed is taken modulo 2**64)."""
    cdef uint64_t h = _seed(seed)
    if isinstance(data, str):
        raise InterfaceError("xxh64 hashes bytes-like objects, not str (encode it first)")
    if type(data) is bytes:
        h = _xxh64(<const uint8_t*>PyBytes_AS_STRING(data), <size_t>PyBytes_GET_SIZE(data), h)
        return h
    try:
        _hash_buffer_obj(data, &h)
    except TypeError:
        raise InterfaceError(f"xxh64 needs a bytes-like object, not {type(data).__name__}") from None
    return h


def spark_xxhash64(values, types=None, seed=SPARK_SEED):
    """Spark's ``xxhash64(col1, col2, ...)`` of one row (signed 64-bit)."""
    cdef uint64_t s = _seed(seed)
    cdef int32_t[::1] codes
    cdef int32_t dummy = 0
    arr = _type_codes(types)
    row = _as_row(values, "values")
    if arr is None:
        return <int64_t>_hash_row(row, &dummy, 0, False, s)
    codes = arr
    return <int64_t>_hash_row(row, &codes[0] if codes.shape[0] else &dummy, codes.shape[0], True, s)


def hash_rows(rows, types=None, seed=SPARK_SEED):
    """``spark_xxhash64`` of every row (int64 array)."""
    cdef uint64_t s = _seed(seed)
    cdef int32_t[::1] codes
    cdef int32_t dummy = 0
    cdef const int32_t* cp = &dummy
    cdef Py_ssize_t ncodes = 0, i = 0, n
    cdef bint typed = False
    cdef int64_t[::1] ov
    cdef tuple trows
    arr = _type_codes(types)
    if arr is not None:
        codes = arr
        typed = True
        ncodes = codes.shape[0]
        if ncodes:
            cp = &codes[0]
    if isinstance(rows, _NOT_ROWS):
        raise InterfaceError(f"rows must be a sequence of rows, not {type(rows).__name__}")
    try:
        trows = rows if type(rows) is tuple else tuple(rows)
    except TypeError:
        raise InterfaceError(f"rows must be a sequence of rows, not {type(rows).__name__}") from None
    n = len(trows)
    out = np.empty(n, dtype=np.int64)
    if n == 0:
        return out
    ov = out
    try:
        for i in range(n):
            ov[i] = <int64_t>_hash_row(trows[i], cp, ncodes, typed, s)
    except (EncodeError, InterfaceError) as exc:
        raise type(exc)(f"row {i}: {exc}") from None
    return out


# --- Arrow ---------------------------------------------------------------------------------------
cdef int _arrow_code(object t, int64_t* factor) except -1:
    """Type code of an Arrow type; factor = micros per unit for timestamps (0 for ns), offset width
    for strings and binaries."""
    import pyarrow as pa
    import pyarrow.types as pt

    factor[0] = 1
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
    if t == pa.string() or t == pa.binary():
        factor[0] = 4  # offset width; strings are hashed as their raw (UTF-8) bytes
        return T_BINARY
    if t == pa.large_string() or t == pa.large_binary():
        factor[0] = 8
        return T_BINARY
    if t == pa.date32():
        return T_DATE
    if pt.is_timestamp(t):
        unit = t.unit
        if unit == "s":
            factor[0] = 1000000
        elif unit == "ms":
            factor[0] = 1000
        elif unit == "us":
            factor[0] = 1
        else:
            factor[0] = 0
        return T_TIMESTAMP
    raise InterfaceError(f"hash_arrow does not support the Arrow type {t}")


cdef inline bint _bit(const uint8_t* bits, int64_t j) noexcept nogil:
    return (bits[j >> 3] >> (j & 7)) & 1


cdef const uint8_t* _buf_ptr(object buf, int64_t* size) except? NULL:
    if buf is None:
        size[0] = 0
        return NULL
    if not buf.is_cpu:
        raise InterfaceError("hash_arrow needs Arrow buffers in CPU memory")
    size[0] = buf.size
    return <const uint8_t*><size_t>buf.address


cdef int _hash_chunk(object chunk, int code, int64_t factor, uint64_t* out) except -1:
    """Advance out[0:len(chunk)] by the values of one Arrow array (nulls leave them unchanged)."""
    cdef int64_t n = len(chunk)
    cdef int64_t off = chunk.offset
    cdef int64_t null_count
    cdef int64_t i, j, vsize = 0, dsize = 0, osize = 0, need, s, e, v, q
    cdef const uint8_t* vbits = NULL
    cdef const uint8_t* data = NULL
    cdef const uint8_t* offs = NULL
    cdef bint has_nulls
    cdef int err = 0
    cdef int width
    if n == 0 or code == T_SKIP:
        return 0
    null_count = chunk.null_count
    if null_count == n:
        return 0
    if off < 0 or n < 0:
        raise InterfaceError("invalid Arrow array (negative offset or length)")
    bufs = chunk.buffers()
    if null_count > 0 and bufs[0] is not None:
        vbits = _buf_ptr(bufs[0], &vsize)
        if vsize * 8 < off + n:
            raise InterfaceError("invalid Arrow array: validity bitmap too short")
    has_nulls = vbits != NULL
    if code == T_BINARY:  # string / binary: factor is the offset width (4 or 8)
        width = <int>factor
        offs = _buf_ptr(bufs[1], &osize)
        data = _buf_ptr(bufs[2], &dsize)
        if offs == NULL or osize < (off + n + 1) * width:
            raise InterfaceError("invalid Arrow array: offsets buffer too short")
        with nogil:
            for i in range(n):
                j = off + i
                if has_nulls and not _bit(vbits, j):
                    continue
                if width == 4:
                    s = (<const int32_t*>offs)[j]
                    e = (<const int32_t*>offs)[j + 1]
                else:
                    s = (<const int64_t*>offs)[j]
                    e = (<const int64_t*>offs)[j + 1]
                if s < 0 or e < s or e > dsize:
                    err = 1
                    break
                out[i] = _xxh64(data + s, <size_t>(e - s), out[i])
        if err:
            raise InterfaceError("invalid Arrow array: offsets out of the data buffer")
        return 0
    if code == T_BOOLEAN:
        data = _buf_ptr(bufs[1], &dsize)
        if data == NULL or dsize * 8 < off + n:
            raise InterfaceError("invalid Arrow array: data buffer too short")
        with nogil:
            for i in range(n):
                j = off + i
                if has_nulls and not _bit(vbits, j):
                    continue
                out[i] = _xxh64_int(1 if _bit(data, j) else 0, out[i])
        return 0
    if code == T_TINYINT:
        width = 1
    elif code == T_SMALLINT:
        width = 2
    elif code == T_INT or code == T_DATE or code == T_FLOAT:
        width = 4
    else:
        width = 8
    data = _buf_ptr(bufs[1], &dsize)
    if data == NULL or dsize < (off + n) * width:
        raise InterfaceError("invalid Arrow array: data buffer too short")
    with nogil:
        if code == T_TINYINT:
            for i in range(n):
                if has_nulls and not _bit(vbits, off + i):
                    continue
                out[i] = _xxh64_int(<int32_t>(<const int8_t*>data)[off + i], out[i])
        elif code == T_SMALLINT:
            for i in range(n):
                if has_nulls and not _bit(vbits, off + i):
                    continue
                out[i] = _xxh64_int(<int32_t>(<const int16_t*>data)[off + i], out[i])
        elif code == T_INT or code == T_DATE:
            for i in range(n):
                if has_nulls and not _bit(vbits, off + i):
                    continue
                out[i] = _xxh64_int((<const int32_t*>data)[off + i], out[i])
        elif code == T_FLOAT:
            for i in range(n):
                if has_nulls and not _bit(vbits, off + i):
                    continue
                out[i] = _xxh64_int(<int32_t>_norm_float_bits((<const uint32_t*>data)[off + i]), out[i])
        elif code == T_DOUBLE:
            for i in range(n):
                if has_nulls and not _bit(vbits, off + i):
                    continue
                out[i] = _xxh64_long(_norm_double_bits((<const uint64_t*>data)[off + i]), out[i])
        elif code == T_BIGINT or (code == T_TIMESTAMP and factor == 1):
            for i in range(n):
                if has_nulls and not _bit(vbits, off + i):
                    continue
                out[i] = _xxh64_long((<const uint64_t*>data)[off + i], out[i])
        elif factor == 0:  # nanoseconds: floor to microseconds (as java.time does)
            for i in range(n):
                if has_nulls and not _bit(vbits, off + i):
                    continue
                v = (<const int64_t*>data)[off + i]
                q = v // 1000
                if v % 1000 < 0:
                    q -= 1
                out[i] = _xxh64_long(<uint64_t>q, out[i])
        else:  # seconds or milliseconds: multiply, refusing overflow
            for i in range(n):
                if has_nulls and not _bit(vbits, off + i):
                    continue
                v = (<const int64_t*>data)[off + i]
                if v > INT64_MAX // factor or v < INT64_MIN // factor:
                    err = 1
                    break
                out[i] = _xxh64_long(<uint64_t>(v * factor), out[i])
    if err:
        raise EncodeError(f"timestamp {v} {chunk.type.unit} overflows int64 microseconds")
    return 0


def hash_arrow(columns, seed=SPARK_SEED):
    """``spark_xxhash64`` of every row of Arrow columns (int64 array)."""
    import pyarrow as pa

    cdef uint64_t s = _seed(seed)
    cdef int64_t n, base, factor = 1
    cdef int code
    cdef uint64_t[::1] hv
    cdef uint64_t* hp

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
    codes = []
    factors = []
    for c in cols:
        code = _arrow_code(c.type, &factor)
        codes.append(code)
        factors.append(factor)
    hashes = np.full(n, s, dtype=np.uint64)
    if n == 0:
        return hashes.view(np.int64)
    hv = hashes
    hp = &hv[0]
    for c, code, factor in zip(cols, codes, factors):
        if code == T_SKIP:
            continue
        chunks = c.chunks if isinstance(c, pa.ChunkedArray) else (c,)
        base = 0
        for chunk in chunks:
            if base + len(chunk) > n:
                raise InterfaceError("invalid ChunkedArray: chunks longer than the array")
            _hash_chunk(chunk, code, factor, hp + base)
            base += len(chunk)
    return hashes.view(np.int64)


# --- key groups ----------------------------------------------------------------------------------
cdef object _int_arg(object v, str name):
    if isinstance(v, _BOOL_TYPES):
        raise InterfaceError(f"{name} must be an int, not bool")
    try:
        return operator.index(v)
    except TypeError:
        raise InterfaceError(f"{name} must be an int, not {type(v).__name__}") from None


cdef int64_t _num_key_groups(object g) except -1:
    g = _int_arg(g, "num_key_groups")
    if g < 1 or g > _I32_MAX:
        raise InterfaceError(f"num_key_groups must be in [1, 2**31-1], got {g}")
    return <int64_t>g


def key_group(hash, num_key_groups):
    """Spark's ``pmod(hash, num_key_groups)``: the key group of a signed 64-bit row hash."""
    cdef int64_t g = _num_key_groups(num_key_groups)
    cdef int64_t r
    h = _int_arg(hash, "hash")
    if h < _I64_MIN or h > _I64_MAX:
        raise InterfaceError(f"hash must be a signed 64-bit int (as Spark's xxhash64 returns), got {h}")
    r = (<int64_t>h) % g
    if r < 0:
        r += g
    return r


def key_groups(hashes, num_key_groups):
    """``key_group`` of every hash (int32 array)."""
    cdef int64_t g = _num_key_groups(num_key_groups)
    cdef const int64_t[::1] hv
    cdef int32_t[::1] ov
    cdef Py_ssize_t i, n
    cdef int64_t r
    try:
        a = np.asarray(hashes)
    except (OverflowError, ValueError, TypeError) as exc:
        raise InterfaceError(f"hashes must be signed 64-bit ints: {exc}") from None
    if a.ndim != 1:
        if a.ndim == 0:
            raise InterfaceError("hashes must be a 1-d sequence of ints")
        raise InterfaceError(f"hashes must be 1-d, got shape {a.shape}")
    if a.size == 0:
        return np.empty(0, dtype=np.int32)
    if a.dtype.kind not in "iu" or a.dtype == np.uint64:
        raise InterfaceError(f"hashes must be signed 64-bit ints, got dtype {a.dtype}")
    a = np.ascontiguousarray(a, dtype=np.int64)
    hv = a
    n = hv.shape[0]
    out = np.empty(n, dtype=np.int32)
    ov = out
    with nogil:
        for i in range(n):
            r = hv[i] % g
            if r < 0:
                r += g
            ov[i] = <int32_t>r
    return out


cdef tuple _partitions(object num_key_groups, object num_partitions):
    g = _num_key_groups(num_key_groups)
    n = _int_arg(num_partitions, "num_partitions")
    if n < 1 or n > g:
        raise InterfaceError(f"need num_key_groups >= num_partitions >= 1, got G={g}, N={n}")
    return g, n


def partition_of_key_group(kg, num_key_groups, num_partitions):
    """The partition owning key group ``kg``: ``kg * N // G`` (Flink's contiguous ranges)."""
    g, n = _partitions(num_key_groups, num_partitions)
    k = _int_arg(kg, "kg")
    if k < 0 or k >= g:
        raise InterfaceError(f"key group {k} out of range [0, {g})")
    return k * n // g


def key_group_range(partition, num_partitions, num_key_groups):
    """The key groups owned by ``partition``: ``range(ceil(p*G/N), ceil((p+1)*G/N))``."""
    g, n = _partitions(num_key_groups, num_partitions)
    p = _int_arg(partition, "partition")
    if p < 0 or p >= n:
        raise InterfaceError(f"partition {p} out of range [0, {n})")
    return range(-(-p * g // n), -(-(p + 1) * g // n))
