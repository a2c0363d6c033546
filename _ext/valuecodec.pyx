# cython: language_level=3
"""Row codec, compiled twin of ``statestore_async._ref.valuecodec`` (same bytes, values, errors).

Built with boundscheck/wraparound off: every read from an input buffer below is checked against
its end by hand before it happens.
"""
import datetime as _dt
from decimal import Decimal
from operator import itemgetter

from cpython.bytes cimport PyBytes_FromStringAndSize, PyBytes_AS_STRING, PyBytes_GET_SIZE, PyBytes_Check
from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_GET_SIZE, PyByteArray_Check
from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE
from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM, PyTuple_GET_SIZE, PyTuple_GET_ITEM, PyTuple_Check
from cpython.list cimport PyList_New, PyList_SET_ITEM, PyList_GET_SIZE, PyList_GET_ITEM, PyList_Check, PyList_GetSlice
from cpython.dict cimport PyDict_New, PyDict_SetItem, PyDict_Size, PyDict_Items, PyDict_Check
from cpython.ref cimport Py_INCREF, PyObject
from cpython.long cimport PyLong_AsLongLongAndOverflow, PyLong_FromLongLong, PyLong_Check
from cpython.float cimport PyFloat_FromDouble, PyFloat_AS_DOUBLE, PyFloat_Check
from cpython.unicode cimport PyUnicode_Check, PyUnicode_AsUTF8String
from cpython.datetime cimport (
    import_datetime, PyDateTime_Check, PyDate_Check, PyDateTime_GET_YEAR, PyDateTime_GET_MONTH,
    PyDateTime_GET_DAY, PyDateTime_DATE_GET_HOUR, PyDateTime_DATE_GET_MINUTE,
    PyDateTime_DATE_GET_SECOND, PyDateTime_DATE_GET_MICROSECOND, datetime_tzinfo, date_new,
    datetime_new, timedelta_days, timedelta_seconds, timedelta_microseconds,
)
from libc.stdint cimport uint64_t, int64_t
from libc.stdlib cimport malloc, realloc, free
from libc.string cimport memcpy, memcmp

from statestore_async.errors import DecodeError, EncodeError

cdef extern from "Python.h":
    int PyUnicode_READY(object o) except -1
    bint PyUnicode_IS_ASCII(object o)
    void* PyUnicode_DATA(object o)
    Py_ssize_t PyUnicode_GET_LENGTH(object o)
    object PyUnicode_DecodeUTF8(const char* s, Py_ssize_t size, const char* errors)
    bint PyMemoryView_Check(object o)
    bint PyUnicode_CheckExact(object o)
    bint PyLong_CheckExact(object o)
    bint PyFloat_CheckExact(object o)
    bint PyTuple_CheckExact(object o)
    bint PyBytes_CheckExact(object o)

import_datetime()


MAX_DEPTH = 100
MAX_BIGINT_BYTES = 1024

cdef enum:
    T_NONE = 0x00
    T_FALSE = 0x01
    T_TRUE = 0x02
    T_INT = 0x03
    T_BIGINT = 0x04
    T_FLOAT = 0x05
    T_STR = 0x06
    T_BYTES = 0x07
    T_TUPLE = 0x08
    T_LIST = 0x09
    T_DICT = 0x0A
    T_DATE = 0x0B
    T_DATETIME = 0x0C
    T_DATETIME_UTC = 0x0D
    T_DECIMAL = 0x0E
    C_MAX_DEPTH = 100
    C_MAX_BIGINT = 1024

cdef int64_t EPOCH_ORDINAL = 719163
cdef int64_t MIN_DAYS = 1 - 719163
cdef int64_t MAX_DAYS = 3652059 - 719163
cdef int64_t US_PER_DAY = 86400000000LL
cdef int64_t DATETIME_MIN_US = (1 - 719163) * 86400000000LL
cdef int64_t DATETIME_MAX_US = (3652059 - 719163 + 1) * 86400000000LL - 1
cdef uint64_t EXP_MASK = 0x7FF0000000000000ULL
cdef uint64_t MANT_MASK = 0x000FFFFFFFFFFFFFULL
cdef uint64_t NEG_ZERO_BITS = 0x8000000000000000ULL
cdef uint64_t CANONICAL_NAN = 0x7FF8000000000000ULL

cdef object _UTC = _dt.timezone.utc
cdef object _dt_utcoffset = _dt.datetime.utcoffset
cdef object _decimal_str = Decimal.__str__
cdef object _int_index = int.__index__
cdef object _int_bit_length = int.bit_length
cdef object _int_to_bytes = int.to_bytes
cdef object _int_from_bytes = int.from_bytes
cdef object _first = itemgetter(0)
cdef object _INT64_MIN = -(1 << 63)
cdef object _INT64_MAX = (1 << 63) - 1


cdef str _type_name(value):
    t = type(value)
    return t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


# --- calendar arithmetic (proleptic Gregorian, days since 1970-01-01) ----------------------------
cdef inline int64_t _days_from_civil(int64_t y, int64_t m, int64_t d) noexcept:
    y -= m <= 2
    cdef int64_t era = (y if y >= 0 else y - 399) // 400
    cdef int64_t yoe = y - era * 400
    cdef int64_t doy = (153 * (m + (-3 if m > 2 else 9)) + 2) // 5 + d - 1
    cdef int64_t doe = yoe * 365 + yoe // 4 - yoe // 100 + doy
    return era * 146097 + doe - 719468


cdef inline void _civil_from_days(int64_t z, int* year, int* month, int* day) noexcept:
    z += 719468
    cdef int64_t era = (z if z >= 0 else z - 146096) // 146097
    cdef int64_t doe = z - era * 146097
    cdef int64_t yoe = (doe - doe // 1460 + doe // 36524 - doe // 146096) // 365
    cdef int64_t y = yoe + era * 400
    cdef int64_t doy = doe - (365 * yoe + yoe // 4 - yoe // 100)
    cdef int64_t mp = (5 * doy + 2) // 153
    cdef int64_t d = doy - (153 * mp + 2) // 5 + 1
    cdef int64_t m = mp + 3 if mp < 10 else mp - 9
    year[0] = <int>(y + (m <= 2))
    month[0] = <int>m
    day[0] = <int>d


# --- output buffer -------------------------------------------------------------------------------
cdef struct Writer:
    unsigned char* buf
    Py_ssize_t len
    Py_ssize_t cap


cdef int _w_init(Writer* w, Py_ssize_t cap) except -1:
    w.buf = <unsigned char*>malloc(cap)
    if w.buf == NULL:
        raise MemoryError()
    w.len = 0
    w.cap = cap
    return 0


cdef int _w_grow(Writer* w, Py_ssize_t extra) except -1:
    cdef Py_ssize_t need = w.len + extra
    cdef Py_ssize_t cap = w.cap * 2
    if cap < need:
        cap = need
    cdef unsigned char* nbuf = <unsigned char*>realloc(w.buf, cap)
    if nbuf == NULL:
        raise MemoryError()
    w.buf = nbuf
    w.cap = cap
    return 0


cdef inline int _w_reserve(Writer* w, Py_ssize_t extra) except -1:
    if w.cap - w.len < extra:
        _w_grow(w, extra)
    return 0


cdef inline int _w_byte(Writer* w, unsigned char b) except -1:
    if w.cap - w.len < 1:
        _w_grow(w, 1)
    w.buf[w.len] = b
    w.len += 1
    return 0


cdef inline int _w_varint(Writer* w, uint64_t n) except -1:
    if w.cap - w.len < 10:
        _w_grow(w, 10)
    cdef unsigned char* p = w.buf + w.len
    cdef Py_ssize_t i = 0
    while n >= 0x80:
        p[i] = <unsigned char>((n & 0x7F) | 0x80)
        n >>= 7
        i += 1
    p[i] = <unsigned char>n
    w.len += i + 1
    return 0


cdef inline int _w_tag_varint(Writer* w, unsigned char tag, uint64_t n) except -1:
    _w_byte(w, tag)
    _w_varint(w, n)
    return 0


cdef inline int _w_bytes(Writer* w, const void* data, Py_ssize_t n) except -1:
    if w.cap - w.len < n:
        _w_grow(w, n)
    if n:
        memcpy(w.buf + w.len, data, n)
    w.len += n
    return 0


cdef inline uint64_t _zigzag(int64_t v) noexcept:
    return (<uint64_t>v << 1) ^ <uint64_t>(v >> 63)


cdef inline int64_t _unzigzag(uint64_t u) noexcept:
    return <int64_t>(u >> 1) ^ -<int64_t>(u & 1)


# --- encoding ------------------------------------------------------------------------------------
cdef int _enc_str(Writer* w, object value) except -1:
    PyUnicode_READY(value)
    cdef Py_ssize_t n
    if PyUnicode_IS_ASCII(value):
        n = PyUnicode_GET_LENGTH(value)
        _w_tag_varint(w, T_STR, <uint64_t>n)
        _w_bytes(w, PyUnicode_DATA(value), n)
        return 0
    try:
        data = PyUnicode_AsUTF8String(value)
    except UnicodeEncodeError as exc:
        raise EncodeError(f"str is not encodable as UTF-8: {exc.reason} at index {exc.start}") from None
    n = PyBytes_GET_SIZE(data)
    _w_tag_varint(w, T_STR, <uint64_t>n)
    _w_bytes(w, PyBytes_AS_STRING(data), n)
    return 0


cdef int _enc_float(Writer* w, double d, bint key) except -1:
    cdef uint64_t bits
    memcpy(&bits, &d, 8)
    if key:
        if (bits & EXP_MASK) == EXP_MASK and (bits & MANT_MASK) != 0:
            bits = CANONICAL_NAN
        elif bits == NEG_ZERO_BITS:
            bits = 0
    _w_reserve(w, 9)
    cdef unsigned char* p = w.buf + w.len
    p[0] = T_FLOAT
    cdef int i
    for i in range(8):
        p[1 + i] = <unsigned char>(bits >> (8 * i))
    w.len += 9
    return 0


cdef int _enc_bigint(Writer* w, object value) except -1:
    v = _int_index(value)
    cdef Py_ssize_t n = (_int_bit_length(v if v >= 0 else ~v) + 8) // 8
    if n > C_MAX_BIGINT:
        raise EncodeError(f"int too large to encode ({n} bytes, at most {MAX_BIGINT_BYTES})")
    data = _int_to_bytes(v, n, "big", signed=True)
    _w_tag_varint(w, T_BIGINT, <uint64_t>n)
    _w_bytes(w, PyBytes_AS_STRING(data), n)
    return 0


cdef inline int _enc_int(Writer* w, object value) except -1:
    cdef int overflow = 0
    cdef long long x = PyLong_AsLongLongAndOverflow(value, &overflow)
    if overflow:
        return _enc_bigint(w, value)
    return _w_tag_varint(w, T_INT, _zigzag(x))


cdef int _enc_seq_items(Writer* w, object items, int depth, bint key) except -1:
    # items: an exact tuple
    cdef Py_ssize_t i, n = PyTuple_GET_SIZE(items)
    _w_varint(w, <uint64_t>n)
    for i in range(n):
        _enc(w, <object>PyTuple_GET_ITEM(items, i), depth, key)
    return 0


cdef int _enc_dict(Writer* w, object value, int depth, bint key) except -1:
    cdef Writer kw
    cdef Py_ssize_t i, n
    items = PyDict_Items(value)
    n = PyList_GET_SIZE(items)
    pairs = PyList_New(0)
    _w_init(&kw, 64)
    try:
        for i in range(n):
            item = <object>PyList_GET_ITEM(items, i)
            kw.len = 0
            _enc(&kw, <object>PyTuple_GET_ITEM(item, 0), depth + 1, key)
            pairs.append((PyBytes_FromStringAndSize(<char*>kw.buf, kw.len), <object>PyTuple_GET_ITEM(item, 1)))
    finally:
        free(kw.buf)
    pairs.sort(key=_first)
    cdef bytes a, b
    for i in range(1, n):
        a = <bytes>PyTuple_GET_ITEM(<object>PyList_GET_ITEM(pairs, i), 0)
        b = <bytes>PyTuple_GET_ITEM(<object>PyList_GET_ITEM(pairs, i - 1), 0)
        if a == b:
            raise EncodeError("dict has two keys with the same encoding")
    _w_tag_varint(w, T_DICT, <uint64_t>n)
    for i in range(n):
        pair = <object>PyList_GET_ITEM(pairs, i)
        a = <bytes>PyTuple_GET_ITEM(pair, 0)
        _w_bytes(w, PyBytes_AS_STRING(a), PyBytes_GET_SIZE(a))
        _enc(w, <object>PyTuple_GET_ITEM(pair, 1), depth + 1, key)
    return 0


cdef int _enc_datetime(Writer* w, object value) except -1:
    cdef int64_t days = _days_from_civil(
        PyDateTime_GET_YEAR(value), PyDateTime_GET_MONTH(value), PyDateTime_GET_DAY(value))
    cdef int64_t us = (
        days * US_PER_DAY
        + <int64_t>PyDateTime_DATE_GET_HOUR(value) * 3600000000LL
        + <int64_t>PyDateTime_DATE_GET_MINUTE(value) * 60000000LL
        + <int64_t>PyDateTime_DATE_GET_SECOND(value) * 1000000LL
        + PyDateTime_DATE_GET_MICROSECOND(value)
    )
    if datetime_tzinfo(value) is None:
        return _w_tag_varint(w, T_DATETIME, _zigzag(us))
    offset = _dt_utcoffset(value)
    if offset is None:
        return _w_tag_varint(w, T_DATETIME, _zigzag(us))
    us -= (<int64_t>timedelta_days(offset) * 86400 + timedelta_seconds(offset)) * 1000000LL
    us -= timedelta_microseconds(offset)
    if us < DATETIME_MIN_US or us > DATETIME_MAX_US:
        raise EncodeError("datetime is out of range once converted to UTC")
    return _w_tag_varint(w, T_DATETIME_UTC, _zigzag(us))


cdef int _enc_bytes_like(Writer* w, object value) except -1:
    if PyBytes_Check(value):
        _w_tag_varint(w, T_BYTES, <uint64_t>PyBytes_GET_SIZE(value))
        _w_bytes(w, PyBytes_AS_STRING(value), PyBytes_GET_SIZE(value))
        return 0
    if PyByteArray_Check(value):
        _w_tag_varint(w, T_BYTES, <uint64_t>PyByteArray_GET_SIZE(value))
        _w_bytes(w, PyByteArray_AS_STRING(value), PyByteArray_GET_SIZE(value))
        return 0
    try:
        data = memoryview(value).tobytes()
    except ValueError as exc:
        raise EncodeError(f"cannot read memoryview: {exc}") from None
    _w_tag_varint(w, T_BYTES, <uint64_t>PyBytes_GET_SIZE(data))
    _w_bytes(w, PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data))
    return 0


cdef int _enc(Writer* w, object value, int depth, bint key) except -1:
    # Exact built-in types first (the hot path), then the subclass-aware chain in the order of
    # the reference: None, bool, int, float, str, bytes-like, tuple, list, dict, datetime, date,
    # Decimal.
    if PyUnicode_CheckExact(value):
        return _enc_str(w, value)
    if PyLong_CheckExact(value):
        return _enc_int(w, value)
    if PyTuple_CheckExact(value):
        if depth >= C_MAX_DEPTH:
            raise EncodeError(f"value nested deeper than {MAX_DEPTH} levels")
        _w_byte(w, T_TUPLE)
        return _enc_seq_items(w, value, depth + 1, key)
    if PyFloat_CheckExact(value):
        return _enc_float(w, PyFloat_AS_DOUBLE(value), key)
    if value is None:
        return _w_byte(w, T_NONE)
    if value is True:
        return _w_byte(w, T_TRUE)
    if value is False:
        return _w_byte(w, T_FALSE)
    if PyLong_Check(value):
        return _enc_int(w, value)
    if PyFloat_Check(value):
        return _enc_float(w, PyFloat_AS_DOUBLE(value), key)
    if PyUnicode_Check(value):
        return _enc_str(w, value)
    if PyBytes_Check(value) or PyByteArray_Check(value) or PyMemoryView_Check(value):
        return _enc_bytes_like(w, value)
    if PyTuple_Check(value):
        if depth >= C_MAX_DEPTH:
            raise EncodeError(f"value nested deeper than {MAX_DEPTH} levels")
        _w_byte(w, T_TUPLE)
        return _enc_seq_items(w, _tuple_copy(value), depth + 1, key)
    if PyList_Check(value):
        if depth >= C_MAX_DEPTH:
            raise EncodeError(f"value nested deeper than {MAX_DEPTH} levels")
        _w_byte(w, T_LIST)
        return _enc_seq_items(w, _list_as_tuple(value), depth + 1, key)
    if PyDict_Check(value):
        if depth >= C_MAX_DEPTH:
            raise EncodeError(f"value nested deeper than {MAX_DEPTH} levels")
        return _enc_dict(w, value, depth, key)
    if PyDateTime_Check(value):
        return _enc_datetime(w, value)
    if PyDate_Check(value):
        return _w_tag_varint(w, T_DATE, _zigzag(_days_from_civil(
            PyDateTime_GET_YEAR(value), PyDateTime_GET_MONTH(value), PyDateTime_GET_DAY(value))))
    if isinstance(value, Decimal):
        data = _decimal_str(value).replace("e", "E").encode("ascii")
        _w_tag_varint(w, T_DECIMAL, <uint64_t>PyBytes_GET_SIZE(data))
        return _w_bytes(w, PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data))
    raise EncodeError(f"cannot encode a value of type {_type_name(value)}")


cdef object _tuple_getitem = tuple.__getitem__
cdef object _all = slice(None)


cdef object _tuple_copy(object value):
    return _tuple_getitem(value, _all)


cdef object _list_as_tuple(object value):
    # a snapshot, like the reference's list.copy(): the count written is the count encoded
    cdef Py_ssize_t i, n = PyList_GET_SIZE(value)
    t = PyTuple_New(n)
    for i in range(n):
        item = <object>PyList_GET_ITEM(value, i)
        Py_INCREF(item)
        PyTuple_SET_ITEM(t, i, item)
    return t


cdef bytes _encode_one(Writer* w, object value, bint key):
    w.len = 0
    _enc(w, value, 0, key)
    return PyBytes_FromStringAndSize(<char*>w.buf, w.len)


def encode_row(value):
    """Encode ``value`` as bytes (see ``statestore_async.codecs.valuecodec`` for the format)."""
    cdef Writer w
    _w_init(&w, 128)
    try:
        return _encode_one(&w, value, False)
    finally:
        free(w.buf)


def encode_key(value):
    """Like ``encode_row``, with floats normalized as Spark does for grouping keys."""
    cdef Writer w
    _w_init(&w, 128)
    try:
        return _encode_one(&w, value, True)
    finally:
        free(w.buf)


cdef list _encode_many(values, bint key):
    cdef Writer w
    cdef Py_ssize_t i = 0
    result = []
    _w_init(&w, 256)
    try:
        for value in values:
            try:
                result.append(_encode_one(&w, value, key))
            except EncodeError as exc:
                raise EncodeError(f"row {i}: {exc}") from None
            i += 1
    finally:
        free(w.buf)
    return result


def encode_rows(values):
    """``[encode_row(v) for v in values]``; errors say which row failed."""
    return _encode_many(values, False)


def encode_keys(values):
    """``[encode_key(v) for v in values]``; errors say which row failed."""
    return _encode_many(values, True)


# --- decoding ------------------------------------------------------------------------------------
cdef struct Reader:
    const unsigned char* buf
    Py_ssize_t pos
    Py_ssize_t end


cdef int _read_varint_slow(Reader* r, uint64_t* out) except -1:
    cdef Py_ssize_t start = r.pos
    cdef Py_ssize_t pos = r.pos
    cdef uint64_t result = 0
    cdef unsigned int shift = 0
    cdef unsigned char b
    while True:
        if pos >= r.end:
            raise DecodeError(f"truncated varint at offset {start}")
        b = r.buf[pos]
        pos += 1
        if shift == 63 and b > 1:
            raise DecodeError(f"varint overflows 64 bits at offset {start}")
        result |= (<uint64_t>(b & 0x7F)) << shift
        if not (b & 0x80):
            if b == 0 and pos - start > 1:
                raise DecodeError(f"non-canonical varint at offset {start}")
            break
        shift += 7
        if shift > 63:
            raise DecodeError(f"varint longer than 10 bytes at offset {start}")
    r.pos = pos
    out[0] = result
    return 0


cdef inline int _read_varint(Reader* r, uint64_t* out) except -1:
    cdef unsigned char b
    if r.pos < r.end:
        b = r.buf[r.pos]
        if b < 0x80:
            r.pos += 1
            out[0] = b
            return 0
    return _read_varint_slow(r, out)


cdef inline Py_ssize_t _read_length(Reader* r, str what) except -1:
    cdef Py_ssize_t start = r.pos
    cdef uint64_t n
    _read_varint(r, &n)
    if n > <uint64_t>(r.end - r.pos):
        raise DecodeError(
            f"{what} length {n} at offset {start} exceeds the {r.end - r.pos} remaining bytes")
    return <Py_ssize_t>n


cdef inline Py_ssize_t _read_count(Reader* r, str what, Py_ssize_t min_size) except -1:
    cdef Py_ssize_t start = r.pos
    cdef uint64_t n
    _read_varint(r, &n)
    if n > <uint64_t>((r.end - r.pos) // min_size):
        raise DecodeError(
            f"{what} count {n} at offset {start} exceeds what the {r.end - r.pos} "
            "remaining bytes can hold")
    return <Py_ssize_t>n


cdef object _dec_bigint(Reader* r, Py_ssize_t pos):
    cdef Py_ssize_t start = r.pos
    cdef Py_ssize_t n = _read_length(r, "bigint")
    if n == 0 or n > C_MAX_BIGINT:
        raise DecodeError(f"bigint length {n} at offset {start} not in 1..{MAX_BIGINT_BYTES}")
    v = _int_from_bytes(PyBytes_FromStringAndSize(<const char*>r.buf + r.pos, n), "big", signed=True)
    if _INT64_MIN <= v <= _INT64_MAX:
        raise DecodeError(f"bigint at offset {pos} holds an int64 value")
    if (_int_bit_length(v if v >= 0 else ~v) + 8) // 8 != n:
        raise DecodeError(f"non-minimal bigint at offset {pos}")
    r.pos += n
    return v


cdef object _dec_dict(Reader* r, int depth):
    cdef Py_ssize_t i, n = _read_count(r, "dict", 2)
    cdef Py_ssize_t kstart, klen, size, cmp_len
    cdef const unsigned char* prev = NULL
    cdef Py_ssize_t prev_len = 0
    cdef int c
    result = PyDict_New()
    for i in range(n):
        kstart = r.pos
        k = _dec(r, depth + 1)
        klen = r.pos - kstart
        if prev != NULL:
            cmp_len = klen if klen < prev_len else prev_len
            c = memcmp(r.buf + kstart, prev, cmp_len)
            if c < 0 or (c == 0 and klen <= prev_len):
                raise DecodeError(f"dict key at offset {kstart} out of order or repeated")
        prev = r.buf + kstart
        prev_len = klen
        try:
            hash(k)
        except TypeError:
            raise DecodeError(f"unhashable dict key at offset {kstart}") from None
        v = _dec(r, depth + 1)
        size = PyDict_Size(result)
        PyDict_SetItem(result, k, v)
        if PyDict_Size(result) == size:
            raise DecodeError(f"dict key at offset {kstart} equals an earlier key")
    return result


cdef object _dec_datetime(Reader* r, Py_ssize_t pos, bint utc):
    cdef uint64_t u
    _read_varint(r, &u)
    cdef int64_t us = _unzigzag(u)
    if us < DATETIME_MIN_US or us > DATETIME_MAX_US:
        raise DecodeError(f"datetime out of range at offset {pos}")
    cdef int64_t days = us // US_PER_DAY
    cdef int64_t rest = us - days * US_PER_DAY
    if rest < 0:
        rest += US_PER_DAY
        days -= 1
    cdef int year, month, day
    _civil_from_days(days, &year, &month, &day)
    cdef int64_t secs = rest // 1000000
    cdef int micro = <int>(rest - secs * 1000000)
    return datetime_new(year, month, day, <int>(secs // 3600), <int>((secs // 60) % 60),
                        <int>(secs % 60), micro, _UTC if utc else None)


cdef object _dec_decimal(Reader* r):
    cdef Py_ssize_t n = _read_length(r, "decimal")
    cdef Py_ssize_t start = r.pos
    raw = PyBytes_FromStringAndSize(<const char*>r.buf + start, n)
    try:
        text = raw.decode("ascii")
        v = Decimal(text)
        ok = _decimal_str(v).replace("e", "E") == text
    except Exception:
        ok = False
    if not ok:
        raise DecodeError(f"invalid decimal text at offset {start}")
    r.pos = start + n
    return v


cdef object _dec(Reader* r, int depth):
    cdef Py_ssize_t pos = r.pos
    cdef Py_ssize_t n, i, start
    cdef uint64_t u
    cdef unsigned char tag
    cdef int64_t days
    cdef int year, month, day
    cdef double d
    if pos >= r.end:
        raise DecodeError(f"truncated: expected a value at offset {pos}")
    tag = r.buf[pos]
    r.pos = pos + 1
    if tag == T_STR:
        n = _read_length(r, "str")
        start = r.pos
        try:
            v = PyUnicode_DecodeUTF8(<const char*>r.buf + start, n, NULL)
        except UnicodeDecodeError as exc:
            raise DecodeError(f"invalid UTF-8 in str at offset {start + exc.start}") from None
        r.pos = start + n
        return v
    if tag == T_INT:
        _read_varint(r, &u)
        return PyLong_FromLongLong(_unzigzag(u))
    if tag == T_TUPLE:
        if depth >= C_MAX_DEPTH:
            raise DecodeError(f"value nested deeper than {MAX_DEPTH} levels at offset {pos}")
        n = _read_count(r, "tuple", 1)
        t = PyTuple_New(n)
        for i in range(n):
            item = _dec(r, depth + 1)
            Py_INCREF(item)
            PyTuple_SET_ITEM(t, i, item)
        return t
    if tag == T_NONE:
        return None
    if tag == T_FALSE:
        return False
    if tag == T_TRUE:
        return True
    if tag == T_BIGINT:
        return _dec_bigint(r, pos)
    if tag == T_FLOAT:
        if r.end - r.pos < 8:
            raise DecodeError(f"truncated float at offset {pos}")
        u = 0
        for i in range(8):
            u |= (<uint64_t>r.buf[r.pos + i]) << (8 * i)
        r.pos += 8
        memcpy(&d, &u, 8)
        return PyFloat_FromDouble(d)
    if tag == T_BYTES:
        n = _read_length(r, "bytes")
        v = PyBytes_FromStringAndSize(<const char*>r.buf + r.pos, n)
        r.pos += n
        return v
    if tag == T_LIST:
        if depth >= C_MAX_DEPTH:
            raise DecodeError(f"value nested deeper than {MAX_DEPTH} levels at offset {pos}")
        n = _read_count(r, "list", 1)
        lst = PyList_New(n)
        for i in range(n):
            item = _dec(r, depth + 1)
            Py_INCREF(item)
            PyList_SET_ITEM(lst, i, item)
        return lst
    if tag == T_DICT:
        if depth >= C_MAX_DEPTH:
            raise DecodeError(f"value nested deeper than {MAX_DEPTH} levels at offset {pos}")
        return _dec_dict(r, depth)
    if tag == T_DATE:
        _read_varint(r, &u)
        days = _unzigzag(u)
        if days < MIN_DAYS or days > MAX_DAYS:
            raise DecodeError(f"date out of range at offset {pos}")
        _civil_from_days(days, &year, &month, &day)
        return date_new(year, month, day)
    if tag == T_DATETIME:
        return _dec_datetime(r, pos, False)
    if tag == T_DATETIME_UTC:
        return _dec_datetime(r, pos, True)
    if tag == T_DECIMAL:
        return _dec_decimal(r)
    raise DecodeError(f"unknown tag 0x{tag:02x} at offset {pos}")


cdef object _decode_all(const unsigned char* buf, Py_ssize_t n):
    cdef Reader r
    r.buf = buf
    r.pos = 0
    r.end = n
    value = _dec(&r, 0)
    if r.pos != r.end:
        raise DecodeError(f"{r.end - r.pos} trailing bytes at offset {r.pos}")
    return value


cdef object _as_view(object data):
    """A C-contiguous memoryview of ``data`` (TypeError like the reference otherwise)."""
    try:
        view = memoryview(data)
    except TypeError:
        raise TypeError(f"expected a bytes-like object, got {_type_name(data)}") from None
    if not view.c_contiguous:
        raise TypeError("expected a C-contiguous bytes-like object")
    return view


cdef object _decode_obj(object data):
    cdef Py_buffer pybuf
    if PyBytes_Check(data):
        return _decode_all(<const unsigned char*>PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data))
    view = _as_view(data)
    PyObject_GetBuffer(view, &pybuf, PyBUF_SIMPLE)
    try:
        return _decode_all(<const unsigned char*>pybuf.buf, pybuf.len)
    finally:
        PyBuffer_Release(&pybuf)


def decode_row(data):
    """Decode bytes made by ``encode_row``/``encode_key``; must consume all of ``data``."""
    return _decode_obj(data)


def decode_rows(datas):
    """``[decode_row(d) for d in datas]``; errors say which row failed."""
    cdef Py_ssize_t i = 0
    cdef Py_buffer pybuf
    result = []
    for data in datas:
        if PyBytes_Check(data):
            try:
                result.append(_decode_all(<const unsigned char*>PyBytes_AS_STRING(data),
                                          PyBytes_GET_SIZE(data)))
            except DecodeError as exc:
                raise DecodeError(f"row {i}: {exc}") from None
        else:
            view = _as_view(data)
            PyObject_GetBuffer(view, &pybuf, PyBUF_SIMPLE)
            try:
                result.append(_decode_all(<const unsigned char*>pybuf.buf, pybuf.len))
            except DecodeError as exc:
                raise DecodeError(f"row {i}: {exc}") from None
            finally:
                PyBuffer_Release(&pybuf)
        i += 1
    return result
