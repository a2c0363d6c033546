# cython: language_level=3
"""Record block codec, compiled twin of ``statestore_async._ref.blockcodec``.

Same bytes, same records, same errors as the reference. Built with boundscheck/wraparound off:
every read from an input buffer below is checked against its end by hand before it happens.
zstd and xxh3 are called through their Python packages, once per block.
"""
import threading

import xxhash
import zstandard

from cpython.bytes cimport PyBytes_FromStringAndSize, PyBytes_AS_STRING, PyBytes_GET_SIZE, PyBytes_Check
from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_GET_SIZE, PyByteArray_Check
from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE
from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM, PyTuple_GET_SIZE, PyTuple_GET_ITEM, PyTuple_Check
from cpython.list cimport PyList_New, PyList_SET_ITEM, PyList_GET_SIZE, PyList_GET_ITEM, PyList_Check, PyList_CheckExact
from cpython.ref cimport Py_INCREF
from libc.stdint cimport int64_t, uint8_t, uint64_t, uint32_t
from libc.stdlib cimport malloc, realloc, free
from libc.string cimport memcmp, memcpy

from _spans cimport check_spans

from statestore_async.errors import CorruptBlockError, EncodeError, InterfaceError

cdef extern from "Python.h":
    bint PyMemoryView_Check(object o)
    object PyMemoryView_FromMemory(char* mem, Py_ssize_t size, int flags)
    int PyBUF_READ


cdef enum:  # a block's first two bytes (tests/test_formats.py checks them against _ref/blockcodec.py)
    MAGIC0 = 0xB1
    MAGIC1 = 0x0C
MAGIC = bytes((MAGIC0, MAGIC1))
HEADER_SIZE = 24
CODEC_NONE = 0
CODEC_ZSTD = 1
MAX_RAW_LEN = 256 * 1024 * 1024
KIND_PUT = 0
KIND_TOMBSTONE = 1
MIN_ZSTD_LEVEL = -(1 << 17)
NO_VALUE = 0xFFFFFFFF  # a tombstone's value length in ``record_spans``

cdef enum:
    C_HEADER = 24
    C_MAX_RAW = 256 * 1024 * 1024
    C_CODEC_NONE = 0
    C_CODEC_ZSTD = 1
    C_PUT = 0
    C_TOMBSTONE = 1

cdef uint32_t _NO_VALUE = 0xFFFFFFFF
cdef object _ZstdError = zstandard.ZstdError
cdef object _frame_content_size = zstandard.frame_content_size
cdef object _xxh3_64 = xxhash.xxh3_64
cdef object _MAGIC_HEX = MAGIC.hex()


def max_stored_len(raw_len):
    """Upper bound of a zstd frame holding ``raw_len`` bytes (ZSTD_compressBound plus slack)."""
    return raw_len + (raw_len >> 7) + 512


cdef inline Py_ssize_t _max_stored(Py_ssize_t raw_len) noexcept:
    return raw_len + (raw_len >> 7) + 512


# --- zstd objects, one set per thread (they are not thread-safe) ---------------------------------
_local = threading.local()


cdef object _compressor(int level):
    cache = getattr(_local, "compressors", None)
    if cache is None:
        cache = _local.compressors = {}
    c = cache.get(level)
    if c is None:
        c = cache[level] = zstandard.ZstdCompressor(level=level)
    return c


cdef object _decompressor():
    d = getattr(_local, "decompressor", None)
    if d is None:
        d = _local.decompressor = zstandard.ZstdDecompressor()
    return d


# --- helpers -------------------------------------------------------------------------------------
cdef str _type_name(value):
    t = type(value)
    return t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


cdef object _check_int(str name, value):
    if isinstance(value, bool) or not isinstance(value, int):
        raise InterfaceError(f"{name} must be an int, not {_type_name(value)}")
    return int(value)


cdef inline Py_ssize_t _varint_len(Py_ssize_t n) noexcept:
    cdef Py_ssize_t size = 1
    while n >= 0x80:
        n >>= 7
        size += 1
    return size


cdef inline Py_ssize_t _put_varint(unsigned char* p, uint64_t n) noexcept:
    cdef Py_ssize_t i = 0
    while n >= 0x80:
        p[i] = <unsigned char>((n & 0x7F) | 0x80)
        n >>= 7
        i += 1
    p[i] = <unsigned char>n
    return i + 1


cdef inline void _put_u32(unsigned char* p, uint32_t v) noexcept:
    p[0] = <unsigned char>v
    p[1] = <unsigned char>(v >> 8)
    p[2] = <unsigned char>(v >> 16)
    p[3] = <unsigned char>(v >> 24)


cdef inline uint32_t _get_u32(const unsigned char* p) noexcept:
    return <uint32_t>p[0] | (<uint32_t>p[1] << 8) | (<uint32_t>p[2] << 16) | (<uint32_t>p[3] << 24)


cdef inline uint64_t _get_u64(const unsigned char* p) noexcept:
    return <uint64_t>_get_u32(p) | (<uint64_t>_get_u32(p + 4) << 32)


cdef struct Writer:
    unsigned char* buf
    Py_ssize_t len
    Py_ssize_t cap


cdef int _w_reserve(Writer* w, Py_ssize_t extra) except -1:
    if w.cap - w.len >= extra:
        return 0
    cdef Py_ssize_t cap = w.cap * 2
    if cap < w.len + extra:
        cap = w.len + extra
    cdef unsigned char* nbuf = <unsigned char*>realloc(w.buf, cap if cap > 0 else 1)
    if nbuf == NULL:
        raise MemoryError()
    w.buf = nbuf
    w.cap = cap
    return 0


cdef int _bytes_of(object value, Py_ssize_t index, str what, const unsigned char** ptr,
                   Py_ssize_t* size, list keep) except -1:
    """Pointer and length of a bytes-like ``value`` (memoryviews copied once into ``keep``)."""
    if PyBytes_Check(value):
        ptr[0] = <const unsigned char*>PyBytes_AS_STRING(value)
        size[0] = PyBytes_GET_SIZE(value)
        return 0
    if PyByteArray_Check(value):
        ptr[0] = <const unsigned char*>PyByteArray_AS_STRING(value)
        size[0] = PyByteArray_GET_SIZE(value)
        return 0
    if PyMemoryView_Check(value):
        try:
            data = memoryview(value).tobytes()
        except ValueError as exc:
            raise EncodeError(f"record {index}: cannot read {what}: {exc}") from None
        keep.append(data)
        ptr[0] = <const unsigned char*>PyBytes_AS_STRING(data)
        size[0] = PyBytes_GET_SIZE(data)
        return 0
    raise EncodeError(f"record {index}: {what} must be bytes-like, not {_type_name(value)}")


cdef int _record(list records, Py_ssize_t index, const unsigned char** kptr, Py_ssize_t* klen,
                 const unsigned char** vptr, Py_ssize_t* vlen, list keep) except -1:
    """Fetch record ``index``; ``vlen`` is -1 for a tombstone."""
    rec = <object>PyList_GET_ITEM(records, index)
    if PyTuple_Check(rec):
        if PyTuple_GET_SIZE(rec) != 2:
            raise EncodeError(f"record {index}: expected a (key, value) pair, got {_type_name(rec)}")
        key = <object>PyTuple_GET_ITEM(rec, 0)
        value = <object>PyTuple_GET_ITEM(rec, 1)
    elif PyList_Check(rec):
        if PyList_GET_SIZE(rec) != 2:
            raise EncodeError(f"record {index}: expected a (key, value) pair, got {_type_name(rec)}")
        key = <object>PyList_GET_ITEM(rec, 0)
        value = <object>PyList_GET_ITEM(rec, 1)
    else:
        raise EncodeError(f"record {index}: expected a (key, value) pair, got {_type_name(rec)}")
    _bytes_of(key, index, "key", kptr, klen, keep)
    if value is None:
        vlen[0] = -1
        vptr[0] = NULL
    else:
        _bytes_of(value, index, "value", vptr, vlen, keep)
    return 0


cdef inline Py_ssize_t _record_size(Py_ssize_t klen, Py_ssize_t vlen) noexcept:
    cdef Py_ssize_t size = 1 + _varint_len(klen) + klen
    if vlen >= 0:
        size += _varint_len(vlen) + vlen
    return size


cdef inline void _put_record(Writer* w, const unsigned char* kptr, Py_ssize_t klen,
                             const unsigned char* vptr, Py_ssize_t vlen) noexcept:
    # the caller reserved _record_size(klen, vlen) bytes
    cdef unsigned char* p = w.buf + w.len
    cdef Py_ssize_t i
    if vlen < 0:
        p[0] = C_TOMBSTONE
        i = 1 + _put_varint(p + 1, <uint64_t>klen)
        if klen:
            memcpy(p + i, kptr, klen)
        w.len += i + klen
    else:
        p[0] = C_PUT
        i = 1 + _put_varint(p + 1, <uint64_t>klen)
        if klen:
            memcpy(p + i, kptr, klen)
        i += klen
        i += _put_varint(p + i, <uint64_t>vlen)
        if vlen:
            memcpy(p + i, vptr, vlen)
        w.len += i + vlen


# --- encoding ------------------------------------------------------------------------------------
def encode_records_raw(records):
    """The uncompressed payload holding every record of ``records``, in order."""
    cdef list recs = records if PyList_CheckExact(records) else list(records)
    cdef Writer w
    cdef Py_ssize_t i, klen, vlen, size
    cdef const unsigned char* kptr
    cdef const unsigned char* vptr
    cdef list keep
    w.buf = NULL
    w.len = 0
    w.cap = 0
    try:
        i = 0
        while i < PyList_GET_SIZE(recs):
            keep = []
            _record(recs, i, &kptr, &klen, &vptr, &vlen, keep)
            size = _record_size(klen, vlen)
            _w_reserve(&w, size)
            _put_record(&w, kptr, klen, vptr, vlen)
            i += 1
        return PyBytes_FromStringAndSize(<char*>w.buf, w.len)
    finally:
        free(w.buf)


def key_group_range(records, start, stop):
    """See ``statestore_async._ref.blockcodec.key_group_range``."""
    start = _check_int("start", start)
    stop = _check_int("stop", stop)
    cdef list recs = records if PyList_CheckExact(records) else list(records)
    cdef Py_ssize_t n = PyList_GET_SIZE(recs)
    if not 0 <= start < stop <= n:
        raise InterfaceError(f"range {start}..{stop} is empty or outside 0..{n}")
    cdef const unsigned char* kptr
    cdef const unsigned char* vptr
    cdef Py_ssize_t klen, vlen, i
    cdef unsigned int kg, lo = 0xFFFF, hi = 0
    cdef list keep = []
    for i in range(<Py_ssize_t>start, <Py_ssize_t>stop):
        _record(recs, i, &kptr, &klen, &vptr, &vlen, keep)
        kg = ((<unsigned int>kptr[0]) << 8) | kptr[1] if klen >= 2 else 0
        if kg < lo:
            lo = kg
        if kg > hi:
            hi = kg
        if PyList_GET_SIZE(keep):
            del keep[:]
    return lo, hi


def encode_block(records, start=0, max_raw_bytes=1048576, codec=CODEC_ZSTD, level=3):
    """Encode ``records[start:]`` into one block, as many as fit in ``max_raw_bytes`` of raw
    payload (at least one when any remain). Returns ``(block, index of the next record)``.

    With ``codec=CODEC_ZSTD`` the payload is stored uncompressed (codec 0 in the header) when
    compressing does not make it smaller.
    """
    start = _check_int("start", start)
    max_raw_bytes = _check_int("max_raw_bytes", max_raw_bytes)
    codec = _check_int("codec", codec)
    level = _check_int("level", level)
    cdef list recs = records if PyList_CheckExact(records) else list(records)
    if not 0 <= start <= PyList_GET_SIZE(recs):
        raise InterfaceError(f"start {start} outside 0..{PyList_GET_SIZE(recs)}")
    if max_raw_bytes < 1:
        raise InterfaceError(f"max_raw_bytes must be at least 1, got {max_raw_bytes}")
    if codec not in (CODEC_NONE, CODEC_ZSTD):
        raise InterfaceError(f"unknown codec {codec}")
    if not MIN_ZSTD_LEVEL <= level <= zstandard.MAX_COMPRESSION_LEVEL:
        raise InterfaceError(f"zstd level {level} outside {MIN_ZSTD_LEVEL}..{zstandard.MAX_COMPRESSION_LEVEL}")
    cdef Py_ssize_t limit = C_MAX_RAW if max_raw_bytes > C_MAX_RAW else <Py_ssize_t>max_raw_bytes
    cdef Py_ssize_t first = start
    cdef Py_ssize_t end = first
    cdef Py_ssize_t klen, vlen, size
    cdef const unsigned char* kptr
    cdef const unsigned char* vptr
    cdef Writer w
    cdef list keep
    cdef bytes block
    w.buf = NULL
    w.len = 0
    w.cap = 0
    try:
        _w_reserve(&w, 4096 if limit > 4096 else limit)
        while end < PyList_GET_SIZE(recs):
            keep = []
            _record(recs, end, &kptr, &klen, &vptr, &vlen, keep)
            size = _record_size(klen, vlen)
            if w.len + size > limit:
                if end == first:
                    if size > C_MAX_RAW:
                        raise EncodeError(
                            f"record {end}: {size} bytes encoded, more than a block holds ({MAX_RAW_LEN})")
                else:
                    break
            _w_reserve(&w, size)
            _put_record(&w, kptr, klen, vptr, vlen)
            end += 1
        block = _make_block(w.buf, w.len, end - first, codec, level)
    finally:
        free(w.buf)
    return block, end


cdef bytes _make_block(const unsigned char* raw, Py_ssize_t raw_len, Py_ssize_t count, int codec, int level):
    """The block of a raw payload of ``count`` records (arguments checked by the caller)."""
    cdef int used = C_CODEC_NONE
    cdef Py_ssize_t stored_len
    cdef unsigned char* p
    cdef bytes block
    stored = None
    if codec == C_CODEC_ZSTD and raw_len > 0:
        view = PyMemoryView_FromMemory(<char*>raw, raw_len, PyBUF_READ)
        try:
            compressed = _compressor(level).compress(view)  # zstd runs without the GIL
        finally:
            view.release()
        if PyBytes_GET_SIZE(compressed) < raw_len:
            stored = compressed
            used = C_CODEC_ZSTD
    if stored is None:
        stored_len = raw_len
        block = PyBytes_FromStringAndSize(NULL, C_HEADER + stored_len)
        p = <unsigned char*>PyBytes_AS_STRING(block)
        if stored_len:
            memcpy(p + C_HEADER, raw, stored_len)
    else:
        stored_len = PyBytes_GET_SIZE(stored)
        block = PyBytes_FromStringAndSize(NULL, C_HEADER + stored_len)
        p = <unsigned char*>PyBytes_AS_STRING(block)
        memcpy(p + C_HEADER, PyBytes_AS_STRING(stored), stored_len)
    p[0] = MAGIC0
    p[1] = MAGIC1
    p[2] = <unsigned char>used
    p[3] = 0
    _put_u32(p + 4, <uint32_t>count)
    _put_u32(p + 8, <uint32_t>raw_len)
    _put_u32(p + 12, <uint32_t>stored_len)
    cdef uint64_t checksum = _checksum(p, stored_len)
    _put_u32(p + 16, <uint32_t>checksum)
    _put_u32(p + 20, <uint32_t>(checksum >> 32))
    return block


def encode_payload_block(payload, count, codec=CODEC_ZSTD, level=3):
    """See ``statestore_async._ref.blockcodec.encode_payload_block``."""
    count = _check_int("count", count)
    codec = _check_int("codec", codec)
    level = _check_int("level", level)
    if count < 0:
        raise InterfaceError(f"count must not be negative, got {count}")
    if codec not in (CODEC_NONE, CODEC_ZSTD):
        raise InterfaceError(f"unknown codec {codec}")
    if not MIN_ZSTD_LEVEL <= level <= zstandard.MAX_COMPRESSION_LEVEL:
        raise InterfaceError(f"zstd level {level} outside {MIN_ZSTD_LEVEL}..{zstandard.MAX_COMPRESSION_LEVEL}")
    cdef _Buf b = _Buf(payload)
    if b.size > C_MAX_RAW:
        raise EncodeError(f"a payload of {b.size} bytes is more than a block holds ({MAX_RAW_LEN})")
    if count > b.size // 2:  # (before it meets a C integer)
        raise EncodeError(
            f"not a payload of {count} records: count {count} impossible in a payload of {b.size} bytes")
    try:
        _check_records(b.ptr, b.size, count)
    except CorruptBlockError as exc:
        raise EncodeError(f"not a payload of {count} records: {exc}") from None
    return _make_block(b.ptr, b.size, count, codec, level)


cdef uint64_t _checksum(const unsigned char* block, Py_ssize_t stored_len) except? 0:
    """xxh3_64 of the first 16 header bytes followed by the stored payload."""
    h = _xxh3_64()
    view = PyMemoryView_FromMemory(<char*>block, C_HEADER + stored_len, PyBUF_READ)
    try:
        h.update(view[0:16])
        h.update(view[C_HEADER:])
    finally:
        view.release()
    return h.intdigest()


# --- decoding ------------------------------------------------------------------------------------
cdef struct Header:
    int codec
    Py_ssize_t count
    Py_ssize_t raw_len
    Py_ssize_t stored_len
    Py_ssize_t total


cdef object _as_view(object data):
    try:
        view = memoryview(data)
    except TypeError:
        raise TypeError(f"expected a bytes-like object, got {_type_name(data)}") from None
    if not view.c_contiguous:
        raise TypeError("expected a C-contiguous bytes-like object")
    return view


cdef class _Buf:
    """Holds a read-only pointer into a bytes-like object for as long as it lives."""
    cdef Py_buffer pybuf
    cdef bint has_buf
    cdef const unsigned char* ptr
    cdef Py_ssize_t size
    cdef object obj

    def __cinit__(self, data):
        self.has_buf = False
        if PyBytes_Check(data):
            self.obj = data
            self.ptr = <const unsigned char*>PyBytes_AS_STRING(data)
            self.size = PyBytes_GET_SIZE(data)
            return
        view = _as_view(data)
        PyObject_GetBuffer(view, &self.pybuf, PyBUF_SIMPLE)
        self.has_buf = True
        self.ptr = <const unsigned char*>self.pybuf.buf
        self.size = self.pybuf.len

    def __dealloc__(self):
        if self.has_buf:
            PyBuffer_Release(&self.pybuf)


cdef int _header(const unsigned char* buf, Py_ssize_t size, Py_ssize_t offset, Header* h) except -1:
    cdef Py_ssize_t have = size - offset if offset < size else 0
    if have < C_HEADER:
        raise CorruptBlockError(f"truncated: need {HEADER_SIZE} bytes for the block header, have {have}")
    cdef const unsigned char* p = buf + offset
    if p[0] != MAGIC0 or p[1] != MAGIC1:
        raise CorruptBlockError(
            f"bad magic {PyBytes_FromStringAndSize(<const char*>p, 2).hex()} (expected {_MAGIC_HEX})")
    cdef int codec = p[2]
    if codec != C_CODEC_NONE and codec != C_CODEC_ZSTD:
        raise CorruptBlockError(f"unknown codec {codec}")
    if p[3] != 0:
        raise CorruptBlockError(f"reserved flags set: 0x{p[3]:02x}")
    cdef Py_ssize_t count = _get_u32(p + 4)
    cdef Py_ssize_t raw_len = _get_u32(p + 8)
    cdef Py_ssize_t stored_len = _get_u32(p + 12)
    if raw_len > C_MAX_RAW:
        raise CorruptBlockError(f"raw length {raw_len} exceeds the limit {MAX_RAW_LEN}")
    if count > raw_len // 2:
        raise CorruptBlockError(f"count {count} impossible in a payload of {raw_len} bytes")
    if codec == C_CODEC_NONE:
        if stored_len != raw_len:
            raise CorruptBlockError(
                f"stored length {stored_len} differs from raw length {raw_len} without compression")
    elif stored_len > _max_stored(raw_len):
        raise CorruptBlockError(f"stored length {stored_len} too large for raw length {raw_len}")
    h.codec = codec
    h.count = count
    h.raw_len = raw_len
    h.stored_len = stored_len
    h.total = C_HEADER + stored_len
    return 0


cdef Py_ssize_t _check_offset(offset) except -1:
    offset = _check_int("offset", offset)
    if offset < 0:
        raise InterfaceError(f"offset must not be negative, got {offset}")
    if offset > (<Py_ssize_t>1 << 62):
        return <Py_ssize_t>1 << 62  # beyond any buffer: reported as truncated
    return offset


def read_block_header(buf, offset=0):
    """``(codec, count, raw_len, stored_len, total_len)`` of the block at ``buf[offset:]``,
    checking magic, flags and sizes only (not the checksum)."""
    cdef _Buf b = _Buf(buf)
    cdef Py_ssize_t off = _check_offset(offset)
    cdef Header h
    _header(b.ptr, b.size, off, &h)
    return h.codec, h.count, h.raw_len, h.stored_len, h.total


cdef int _read_varint(const unsigned char* payload, Py_ssize_t* ppos, Py_ssize_t end,
                      Py_ssize_t index, str what, uint64_t* out) except -1:
    cdef Py_ssize_t start = ppos[0]
    cdef Py_ssize_t pos = start
    cdef uint64_t result = 0
    cdef unsigned int shift = 0
    cdef unsigned char b
    if pos < end and payload[pos] < 0x80:
        out[0] = payload[pos]
        ppos[0] = pos + 1
        return 0
    while True:
        if pos >= end:
            raise CorruptBlockError(f"record {index}: truncated {what} length at payload offset {start}")
        b = payload[pos]
        pos += 1
        if shift == 63 and b > 1:
            raise CorruptBlockError(
                f"record {index}: {what} length overflows 64 bits at payload offset {start}")
        result |= (<uint64_t>(b & 0x7F)) << shift
        if not (b & 0x80):
            if b == 0 and pos - start > 1:
                raise CorruptBlockError(
                    f"record {index}: non-canonical {what} length at payload offset {start}")
            break
        shift += 7
    out[0] = result
    ppos[0] = pos
    return 0


cdef list _parse_records(const unsigned char* payload, Py_ssize_t end, Py_ssize_t count):
    """The ``count`` records of a payload, checked (``CorruptBlockError`` naming the record)."""
    cdef list records = PyList_New(count)
    _walk_records(payload, end, count, records)
    return records


cdef int _check_records(const unsigned char* payload, Py_ssize_t end, Py_ssize_t count) except -1:
    """What ``_parse_records`` checks (same errors), making no object."""
    return _walk_records(payload, end, count, None)


cdef int _walk_records(const unsigned char* payload, Py_ssize_t end, Py_ssize_t count, list records,
                       unsigned char* spans=NULL) except -1:
    """Check the ``count`` records of a payload; put each one into ``records`` unless it is None, and
    its span (key offset, key length, value offset, value length or ``NO_VALUE``: 4 u32 LE) into
    ``spans`` unless it is NULL."""
    if count > end // 2:
        raise CorruptBlockError(f"count {count} impossible in a payload of {end} bytes")
    cdef Py_ssize_t pos = 0
    cdef Py_ssize_t i
    cdef uint64_t n
    cdef unsigned char kind
    cdef Py_ssize_t kpos, klen, vpos = 0, vlen = 0
    cdef bint build = records is not None
    for i in range(count):
        if pos >= end:
            raise CorruptBlockError(f"record {i}: truncated at payload offset {pos}")
        kind = payload[pos]
        if kind > C_TOMBSTONE:
            raise CorruptBlockError(f"record {i}: unknown kind {kind} at payload offset {pos}")
        pos += 1
        _read_varint(payload, &pos, end, i, "key", &n)
        if n > <uint64_t>(end - pos):
            raise CorruptBlockError(f"record {i}: key length {n} beyond payload")
        kpos, klen = pos, <Py_ssize_t>n
        pos += klen
        if kind == C_PUT:
            _read_varint(payload, &pos, end, i, "value", &n)
            if n > <uint64_t>(end - pos):
                raise CorruptBlockError(f"record {i}: value length {n} beyond payload")
            vpos, vlen = pos, <Py_ssize_t>n
            pos += vlen
        if spans != NULL:
            _put_u32(spans, <uint32_t>kpos)
            _put_u32(spans + 4, <uint32_t>klen)
            _put_u32(spans + 8, <uint32_t>vpos if kind == C_PUT else 0)
            _put_u32(spans + 12, <uint32_t>vlen if kind == C_PUT else _NO_VALUE)
            spans += 16
        if build:
            key = PyBytes_FromStringAndSize(<const char*>payload + kpos, klen)
            value = PyBytes_FromStringAndSize(<const char*>payload + vpos, vlen) if kind == C_PUT else None
            rec = PyTuple_New(2)
            Py_INCREF(key)
            PyTuple_SET_ITEM(rec, 0, key)
            Py_INCREF(value)
            PyTuple_SET_ITEM(rec, 1, value)
            Py_INCREF(rec)
            PyList_SET_ITEM(records, i, rec)
    if pos != end:
        raise CorruptBlockError(f"{end - pos} bytes left over after the last record")
    return 0


def decode_records_raw(payload, count):
    """The ``count`` records of an uncompressed payload that holds exactly them."""
    count = _check_int("count", count)
    if count < 0:
        raise InterfaceError(f"count must not be negative, got {count}")
    cdef _Buf b = _Buf(payload)
    if count > b.size // 2:
        raise CorruptBlockError(f"count {count} impossible in a payload of {b.size} bytes")
    return _parse_records(b.ptr, b.size, <Py_ssize_t>count)


def record_spans(payload, count):
    """Where the ``count`` records of an uncompressed payload lie in it, checked as
    ``decode_records_raw`` checks them, making no object per record: ``count`` spans of four u32
    little-endian each (key offset, key length, value offset, value length), the value length
    ``NO_VALUE`` (and its offset 0) for a tombstone. Payloads are at most 4 GiB."""
    count = _check_int("count", count)
    if count < 0:
        raise InterfaceError(f"count must not be negative, got {count}")
    cdef _Buf b = _Buf(payload)
    if b.size > 0xFFFFFFFF:
        raise InterfaceError(f"a payload of {b.size} bytes is over 4 GiB")
    if count > b.size // 2:
        raise CorruptBlockError(f"count {count} impossible in a payload of {b.size} bytes")
    cdef bytes out = PyBytes_FromStringAndSize(NULL, count * 16)
    _walk_records(b.ptr, b.size, <Py_ssize_t>count, None, <unsigned char*>PyBytes_AS_STRING(out))
    return out


def block_indexes(first_keys, const uint8_t[::1] kbuf, const int64_t[::1] koff, const int64_t[::1] js):
    """See ``statestore_async._ref.blockcodec.block_indexes``."""
    cdef list first = first_keys if type(first_keys) is list else list(first_keys)
    cdef Py_ssize_t m = js.shape[0], nb = len(first), size = kbuf.shape[0], n = koff.shape[0]
    cdef Py_ssize_t i, j, lo, hi, mid, kl, fl, at
    cdef object f
    for i in range(nb):
        if type(<object>PyList_GET_ITEM(first, i)) is not bytes:
            raise InterfaceError(f"first keys are bytes, got {type(<object>PyList_GET_ITEM(first, i)).__name__}")
    for i in range(m):
        j = js[i]
        if j < 0 or j >= n:
            raise IndexError(f"block_indexes: index {j} out of range for {n} keys")
        at = koff[j]
        if at < 4 or at > size or <Py_ssize_t>_get_u32(&kbuf[0] + at - 4) > size - at:
            raise InterfaceError(f"block_indexes: key {j} at offset {at} is not inside the {size}-byte key buffer")
    cdef bytes out = PyBytes_FromStringAndSize(NULL, m * 8)
    cdef int64_t* o = <int64_t*>PyBytes_AS_STRING(out)
    cdef const unsigned char* k
    cdef int c
    for i in range(m):
        k = &kbuf[0] + koff[js[i]]
        kl = _get_u32(k - 4)
        lo, hi = 0, nb
        while lo < hi:  # the first block whose first key is > key
            mid = (lo + hi) >> 1
            f = <object>PyList_GET_ITEM(first, mid)
            fl = PyBytes_GET_SIZE(f)
            c = memcmp(k, PyBytes_AS_STRING(f), kl if kl < fl else fl)
            if c < 0 or (c == 0 and kl < fl):
                hi = mid
            else:
                lo = mid + 1
        o[i] = lo - 1
    return out


cdef class RecordBlock:
    """See ``statestore_async._ref.blockcodec.RecordBlock``: the records of one block's payload,
    read in place (the payload and a 16-byte span per record; no object per record)."""
    cdef bytes payload
    cdef bytes spans
    cdef const unsigned char* p
    cdef const unsigned char* sp
    cdef Py_ssize_t count
    cdef readonly Py_ssize_t nbytes

    def __cinit__(self, payload, count):
        self.payload = payload if type(payload) is bytes else bytes(payload)
        self.spans = record_spans(self.payload, count)
        self.count = count
        self.p = <const unsigned char*>PyBytes_AS_STRING(self.payload)
        self.sp = <const unsigned char*>PyBytes_AS_STRING(self.spans)
        self.nbytes = PyBytes_GET_SIZE(self.payload) + PyBytes_GET_SIZE(self.spans) + 160

    def __len__(self):
        return self.count

    cdef inline int _cmp(self, Py_ssize_t i, const unsigned char* k, Py_ssize_t kl) noexcept:
        """key(i) <=> k: negative, 0, positive."""
        cdef const unsigned char* s = self.sp + i * 16
        cdef Py_ssize_t fl = _get_u32(s + 4)
        cdef int c = memcmp(self.p + _get_u32(s), k, fl if fl < kl else kl)
        if c:
            return c
        return (fl > kl) - (fl < kl)

    cdef Py_ssize_t _left(self, const unsigned char* k, Py_ssize_t kl) noexcept:
        cdef Py_ssize_t lo = 0, hi = self.count, mid
        while lo < hi:
            mid = (lo + hi) >> 1
            if self._cmp(mid, k, kl) < 0:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def bisect_left(self, key):
        if type(key) is not bytes:
            raise InterfaceError(f"keys are bytes, got {type(key).__name__}")
        return self._left(<const unsigned char*>PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key))

    def entry(self, Py_ssize_t i):
        if i < 0 or i >= self.count:
            raise IndexError(f"record {i} of a block of {self.count}")
        cdef const unsigned char* s = self.sp + i * 16
        cdef uint32_t vl = _get_u32(s + 12)
        key = PyBytes_FromStringAndSize(<const char*>self.p + _get_u32(s), _get_u32(s + 4))
        if vl == _NO_VALUE:
            return key, None
        return key, PyBytes_FromStringAndSize(<const char*>self.p + _get_u32(s + 8), vl)

    def lookup_spans(self, const uint8_t[::1] kbuf, const int64_t[::1] koff, const int64_t[::1] js,
                     uint8_t[::1] found, int64_t[::1] voff, int64_t[::1] vlen, int64_t base):
        """See ``statestore_async._ref.blockcodec.RecordBlock.lookup_spans``."""
        cdef Py_ssize_t m = js.shape[0], i, j, at, kl, pos = 0
        cdef const unsigned char* k
        cdef const unsigned char* s
        cdef uint32_t vl
        cdef int64_t total = 0
        check_spans(kbuf, koff, js, found, voff, vlen, "lookup_spans")  # nothing written for a bad call
        if m == 0 or self.count == 0:
            return b""
        for i in range(m):  # the hits: their record's index for now
            j = js[i]
            k = &kbuf[0] + koff[j]
            kl = _get_u32(k - 4)
            at = self._left(k, kl)
            if at == self.count or self._cmp(at, k, kl) != 0:
                continue
            found[j] = 1
            s = self.sp + at * 16
            vl = _get_u32(s + 12)
            if vl == _NO_VALUE:
                vlen[j] = -1
            else:
                voff[j] = _get_u32(s + 8)
                vlen[j] = vl
                total += vl
        cdef bytes out = PyBytes_FromStringAndSize(NULL, total)
        cdef char* o = PyBytes_AS_STRING(out)
        for i in range(m):  # the values, copied in the order of js
            j = js[i]
            if found[j] and vlen[j] >= 0:
                memcpy(o + pos, self.p + voff[j], vlen[j])
                voff[j] = base + pos
                pos += vlen[j]
        return out


def decode_block(buf, offset=0):
    """Decode and verify the block at ``buf[offset:]``: ``(records, offset past the block)``."""
    cdef _Buf b = _Buf(buf)
    cdef Py_ssize_t off = _check_offset(offset)
    cdef Header h
    _header(b.ptr, b.size, off, &h)
    cdef Py_ssize_t have = b.size - off
    if have < h.total:
        raise CorruptBlockError(f"truncated: need {h.total} bytes, have {have}")
    cdef const unsigned char* p = b.ptr + off
    if _checksum(p, h.stored_len) != _get_u64(p + 16):
        raise CorruptBlockError("checksum mismatch")
    if h.codec == C_CODEC_NONE:
        return _parse_records(p + C_HEADER, h.raw_len, h.count), off + h.total
    view = PyMemoryView_FromMemory(<char*>p + C_HEADER, h.stored_len, PyBUF_READ)
    try:
        payload = _decompress(view, h.raw_len)
    finally:
        view.release()
    return (_parse_records(<const unsigned char*>PyBytes_AS_STRING(payload), h.raw_len, h.count),
            off + h.total)


cdef bytes _decompress(object stored, Py_ssize_t raw_len):
    try:
        size = _frame_content_size(stored)
    except _ZstdError as exc:
        raise CorruptBlockError(f"bad zstd frame header: {exc}") from None
    if size != raw_len:
        raise CorruptBlockError(f"zstd frame declares {size} bytes, header says {raw_len}")
    try:
        dobj = _decompressor().decompressobj(write_size=max(raw_len, 1))
        payload = dobj.decompress(stored)
    except _ZstdError as exc:
        raise CorruptBlockError(f"zstd decompression failed: {exc}") from None
    if not dobj.eof:
        raise CorruptBlockError("zstd frame incomplete")
    if dobj.unused_data:
        raise CorruptBlockError(f"{len(dobj.unused_data)} bytes after the zstd frame")
    if PyBytes_GET_SIZE(payload) != raw_len:
        raise CorruptBlockError(f"decompressed {len(payload)} bytes, header says {raw_len}")
    return payload
