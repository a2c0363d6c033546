# cython: language_level=3
"""Batch frames from and to Arrow-layout buffers, compiled: the same bytes and errors as
``statestore_async._ref.arrowframes`` (documented in ``statestore_async.codecs.arrowframes``).

Request frames are written straight from the columns' offsets and data, answers are cut straight
into offsets, data and validity buffers: no Python object per item on either side.
"""
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memcpy, memset

from _spans cimport rd32 as _rd32, wr32 as _wr32
from _wire cimport WIRE_HEADER

from statestore_async.errors import DecodeError, EncodeError


cdef Py_ssize_t _HEADER = WIRE_HEADER
cdef uint32_t _NONE = 0xFFFFFFFF
cdef int64_t _LARGE = 0x7FFFFFFF


cdef inline void _wr64(uint8_t* p, uint64_t v) noexcept nogil:
    cdef int j
    for j in range(8):
        p[j] = (v >> (8 * j)) & 0xFF


cdef inline int64_t _rdoff(const uint8_t* p, int width) noexcept nogil:
    cdef uint64_t v = 0
    cdef int j
    if width == 4:
        return <int64_t>(<int>_rd32(p))
    for j in range(8):
        v |= (<uint64_t>p[j]) << (8 * j)
    return <int64_t>v


cdef class _Column:
    """One column (offsets, data, start, width), checked: item i is data[off(i):off(i + 1)]."""
    cdef const uint8_t[::1] offs
    cdef const uint8_t[::1] data
    cdef Py_ssize_t start
    cdef int width
    cdef Py_ssize_t total  # data bytes of the n items

    cdef inline const uint8_t* off_ptr(self, Py_ssize_t i) noexcept:
        return &self.offs[0] + (self.start + i) * self.width

    cdef inline int64_t off(self, Py_ssize_t i) noexcept:
        return _rdoff(self.off_ptr(i), self.width)


cdef _Column _column(object col, Py_ssize_t n, str what):
    offsets, data, start, width = col
    if width not in (4, 8):
        raise EncodeError(f"{what}: offsets are 4 or 8 bytes wide, not {width}")
    cdef _Column c = _Column.__new__(_Column)
    c.offs = memoryview(offsets).cast("B")
    c.data = memoryview(data).cast("B")
    c.start = start
    c.width = width
    cdef Py_ssize_t nbytes = c.offs.shape[0], ndata = c.data.shape[0], i
    if c.start < 0 or n < 0 or (c.start + n + 1) * width > nbytes:
        raise EncodeError(f"{what}: {nbytes} offset bytes cannot hold {n} items from item {start}")
    cdef int64_t b, e = c.off(0)
    for i in range(n):
        b = e
        e = c.off(i + 1)
        if b < 0 or e < b or e > ndata:
            raise EncodeError(f"{what}: item {i} spans bytes {b}..{e}, outside the {ndata} data bytes")
        if e - b > 0xFFFFFFFE:
            raise EncodeError(f"an item of {e - b} bytes is too long")
    c.total = (c.off(n) - c.off(0)) if n else 0
    return c


cdef bytes _head(object head):
    if type(head) is bytes:
        return <bytes>head
    if isinstance(head, (bytearray, memoryview)):
        return bytes(head)
    raise EncodeError(f"a head must be bytes, got {type(head).__name__}")


cdef bytes _frame(int opcode, int flags, long long request_id, bytes head, Py_ssize_t size):
    if not (0 <= opcode <= 255 and 0 <= flags <= 255 and 0 <= request_id <= 0xFFFFFFFF):
        raise EncodeError(f"frame header out of range: opcode={opcode} flags={flags} request_id={request_id}")
    cdef Py_ssize_t n = PyBytes_GET_SIZE(head) + size
    if n > 0xFFFFFFFF:
        raise EncodeError(f"a payload of {n} bytes does not fit a frame")
    cdef bytes out = PyBytes_FromStringAndSize(NULL, _HEADER + n)
    cdef uint8_t* o = <uint8_t*>PyBytes_AS_STRING(out)
    _wr32(o, <uint32_t>n)
    o[4] = <uint8_t>opcode
    o[5] = <uint8_t>flags
    _wr32(o + 6, <uint32_t>request_id)
    if PyBytes_GET_SIZE(head):
        memcpy(o + _HEADER, PyBytes_AS_STRING(head), PyBytes_GET_SIZE(head))
    return out


cdef struct _Cursor:
    const uint8_t* offs  # the offset of the first item
    const uint8_t* data
    int width


cdef inline _Cursor _cursor(_Column c) noexcept:
    cdef _Cursor r
    r.offs = c.off_ptr(0)
    r.data = &c.data[0] if c.data.shape[0] else NULL
    r.width = c.width
    return r


cdef inline Py_ssize_t _put_item(uint8_t* o, Py_ssize_t pos, _Cursor* c, Py_ssize_t i) noexcept:
    cdef int64_t b, e
    if c.width == 4:
        b = <int>_rd32(c.offs + 4 * i)
        e = <int>_rd32(c.offs + 4 * i + 4)
    else:
        b = _rdoff(c.offs + 8 * i, 8)
        e = _rdoff(c.offs + 8 * i + 8, 8)
    _wr32(o + pos, <uint32_t>(e - b))
    pos += 4
    if e > b:
        memcpy(o + pos, c.data + b, e - b)
    return pos + (e - b)


def encode_frame_list_buffers(int opcode, int flags, long long request_id, head, Py_ssize_t n, keys):
    """See ``statestore_async._ref.arrowframes.encode_frame_list_buffers``."""
    cdef _Column k = _column(keys, n, "keys")
    cdef bytes h = _head(head)
    if n > 0xFFFFFFFF:
        raise EncodeError(f"{n} items do not fit a list")
    cdef bytes out = _frame(opcode, flags, request_id, h, 4 + 4 * n + k.total)
    cdef uint8_t* o = <uint8_t*>PyBytes_AS_STRING(out)
    cdef Py_ssize_t pos = _HEADER + PyBytes_GET_SIZE(h), i
    _wr32(o + pos, <uint32_t>n)
    pos += 4
    cdef _Cursor kc = _cursor(k)
    for i in range(n):
        pos = _put_item(o, pos, &kc, i)
    return out


def encode_frame_pairs_buffers(int opcode, int flags, long long request_id, head, Py_ssize_t n, keys, values):
    """See ``statestore_async._ref.arrowframes.encode_frame_pairs_buffers``."""
    cdef _Column k = _column(keys, n, "keys")
    cdef _Column v = _column(values, n, "values")
    cdef bytes h = _head(head)
    if n > 0xFFFFFFFF:
        raise EncodeError(f"{n} items do not fit a list")
    cdef bytes out = _frame(opcode, flags, request_id, h, 4 + 8 * n + k.total + v.total)
    cdef uint8_t* o = <uint8_t*>PyBytes_AS_STRING(out)
    cdef Py_ssize_t pos = _HEADER + PyBytes_GET_SIZE(h), i
    _wr32(o + pos, <uint32_t>n)
    pos += 4
    cdef _Cursor kc = _cursor(k), vc = _cursor(v)
    for i in range(n):
        pos = _put_item(o, pos, &kc, i)
        pos = _put_item(o, pos, &vc, i)
    return out


def decode_optional_list_buffers(buf, Py_ssize_t offset=0, unsigned long long max_count=0xFFFFFFFF):
    """See ``statestore_async._ref.arrowframes.decode_optional_list_buffers``."""
    cdef const uint8_t[::1] mv = buf
    cdef Py_ssize_t end = mv.shape[0]
    if offset < 0 or offset > end:
        raise DecodeError(f"optional list: offset {offset} outside the buffer")
    if end - offset < 4:
        raise DecodeError(f"optional list: truncated at byte {offset}")
    cdef const uint8_t* base = &mv[0]
    cdef Py_ssize_t pos = offset
    cdef uint32_t n = _rd32(base + pos)
    if n > max_count:
        raise DecodeError(f"optional list: {n} items, at most {max_count} allowed")
    if <unsigned long long>n * 4 > <unsigned long long>(end - pos - 4):
        raise DecodeError(f"optional list: {n} items cannot fit in the {end - pos - 4} bytes left")
    pos += 4
    cdef Py_ssize_t first = pos, total = 0, nulls = 0
    cdef uint32_t i, ln
    for i in range(n):
        if end - pos < 4:
            raise DecodeError(f"optional list: truncated at byte {pos}")
        ln = _rd32(base + pos)
        pos += 4
        if ln == _NONE:
            nulls += 1
            continue
        if <Py_ssize_t>ln > end - pos:
            raise DecodeError(f"optional list: an item of {ln} bytes overruns the buffer at byte {pos}")
        pos += ln
        total += ln
    cdef int width = 8 if total > _LARGE else 4
    cdef bytes offsets = PyBytes_FromStringAndSize(NULL, (n + 1) * width)
    cdef bytes data = PyBytes_FromStringAndSize(NULL, total)
    cdef bytes bits = PyBytes_FromStringAndSize(NULL, (n + 7) // 8) if nulls else None
    cdef uint8_t* po = <uint8_t*>PyBytes_AS_STRING(offsets)
    cdef uint8_t* pd = <uint8_t*>PyBytes_AS_STRING(data)
    cdef uint8_t* pb = <uint8_t*>PyBytes_AS_STRING(bits) if nulls else NULL
    if nulls:
        memset(pb, 0, (n + 7) // 8)
    cdef Py_ssize_t at = 0, q = first
    if width == 4:
        _wr32(po, 0)
    else:
        _wr64(po, 0)
    for i in range(n):
        ln = _rd32(base + q)
        q += 4
        if ln != _NONE:
            if pb != NULL:
                pb[i >> 3] |= <uint8_t>(1 << (i & 7))
            if ln:
                memcpy(pd + at, base + q, ln)
            q += ln
            at += ln
        if width == 4:
            _wr32(po + (i + 1) * 4, <uint32_t>at)
        else:
            _wr64(po + (i + 1) * 8, <uint64_t>at)
    return n, nulls, bits, offsets, data, width, pos
