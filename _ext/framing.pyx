# cython: language_level=3
"""Protocol framing, compiled: the same functions, bytes and errors as ``statestore_async._ref.framing``.

Built with boundscheck/wraparound off: every read below is checked against ``end`` by hand
before it happens, and every count is checked against the bytes left before anything is allocated.
"""
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.list cimport PyList_New, PyList_SET_ITEM
from cpython.ref cimport Py_INCREF, PyObject
from cpython.tuple cimport PyTuple_GET_SIZE
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memcpy

from _spans cimport rd32 as _rd32, wr32 as _wr32
from _wire cimport WIRE_HEADER, payload_count, payload_start, walk_list, walk_pairs

from statestore_async.errors import DecodeError, EncodeError


HEADER_SIZE = 10
NONE_LEN = 0xFFFFFFFF
MAX_ITEM_LEN = 0xFFFFFFFE
MAX_U32 = 0xFFFFFFFF

cdef Py_ssize_t _HEADER = WIRE_HEADER
cdef uint32_t _NONE = 0xFFFFFFFF




cdef inline bytes _as_bytes(object item, str what):
    if type(item) is bytes:
        return <bytes>item
    if isinstance(item, (bytearray, memoryview)):
        return bytes(item)
    raise EncodeError(f"{what} must be bytes, got {type(item).__name__}")


def encode_frame(int opcode, int flags, long long request_id, payload=b""):
    """One frame: ``u32 payload length | u8 opcode | u8 flags | u32 request id | payload``."""
    if not (0 <= opcode <= 255 and 0 <= flags <= 255 and 0 <= request_id <= 0xFFFFFFFF):
        raise EncodeError(f"frame header out of range: opcode={opcode} flags={flags} request_id={request_id}")
    cdef bytes p = _as_bytes(payload, "a payload")
    cdef Py_ssize_t n = PyBytes_GET_SIZE(p)
    if n > 0xFFFFFFFF:
        raise EncodeError(f"a payload of {n} bytes does not fit a frame")
    cdef bytes out = PyBytes_FromStringAndSize(NULL, _HEADER + n)
    cdef uint8_t* o = <uint8_t*>PyBytes_AS_STRING(out)
    _wr32(o, <uint32_t>n)
    o[4] = <uint8_t>opcode
    o[5] = <uint8_t>flags
    _wr32(o + 6, <uint32_t>request_id)
    if n:
        memcpy(o + _HEADER, PyBytes_AS_STRING(p), n)
    return out


def split_frames(buf, long long max_payload):
    """Cut the complete frames at the start of ``buf``: ``(frames, consumed, oversized)``.

    See ``statestore_async._ref.framing.split_frames``.
    """
    cdef const uint8_t[::1] mv = buf
    cdef Py_ssize_t n = mv.shape[0]
    cdef Py_ssize_t pos = 0
    cdef uint32_t length, rid
    cdef uint8_t opcode, flags
    cdef list frames = []
    cdef const uint8_t* base
    if n == 0:
        return frames, 0, None
    base = &mv[0]
    while n - pos >= _HEADER:
        length = _rd32(base + pos)
        opcode = base[pos + 4]
        flags = base[pos + 5]
        rid = _rd32(base + pos + 6)
        if <long long>length > max_payload:
            return frames, pos, (opcode, flags, rid, length)
        if <Py_ssize_t>length > n - pos - _HEADER:
            break
        frames.append((opcode, flags, rid,
                       PyBytes_FromStringAndSize(<const char*>(base + pos + _HEADER), length)))
        pos += _HEADER + length
    return frames, pos, None


def encode_list(items):
    """``u32 count | (u32 length | bytes)*``."""
    cdef list seq = [_as_bytes(x, "a list item") for x in items]
    cdef Py_ssize_t total = 4, ln
    cdef bytes b
    for b in seq:
        ln = PyBytes_GET_SIZE(b)
        if ln > 0xFFFFFFFE:
            raise EncodeError(f"an item of {ln} bytes is too long")
        total += 4 + ln
    cdef bytes out = PyBytes_FromStringAndSize(NULL, total)
    cdef uint8_t* o = <uint8_t*>PyBytes_AS_STRING(out)
    _wr32(o, <uint32_t>len(seq))
    cdef Py_ssize_t pos = 4
    for b in seq:
        ln = PyBytes_GET_SIZE(b)
        _wr32(o + pos, <uint32_t>ln)
        pos += 4
        if ln:
            memcpy(o + pos, PyBytes_AS_STRING(b), ln)
        pos += ln
    return out


def decode_list(buf, Py_ssize_t offset=0, unsigned long long max_count=0xFFFFFFFF):
    """``(list of bytes, end offset)`` from an ``encode_list`` payload at ``offset``."""
    cdef const uint8_t[::1] mv = buf
    cdef Py_ssize_t end = mv.shape[0]
    cdef Py_ssize_t pos = payload_start(offset, end, "list")
    cdef const uint8_t* base = &mv[0]
    cdef uint32_t n = payload_count(base, pos, end, max_count, 4, "list")
    pos += 4
    cdef list out = PyList_New(n)
    cdef uint32_t i, ln
    cdef object item
    for i in range(n):
        if end - pos < 4:
            _fill_none(out, i, n)
            raise DecodeError(f"list: truncated at byte {pos}")
        ln = _rd32(base + pos)
        pos += 4
        if <Py_ssize_t>ln > end - pos:
            _fill_none(out, i, n)
            raise DecodeError(f"list: an item of {ln} bytes overruns the buffer at byte {pos}")
        item = PyBytes_FromStringAndSize(<const char*>(base + pos), ln)
        Py_INCREF(item)
        PyList_SET_ITEM(out, i, item)
        pos += ln
    return out, pos


cdef void _fill_none(list out, uint32_t start, uint32_t n):
    """Fill the unset slots of a list made by PyList_New so that it can be freed safely."""
    cdef uint32_t j
    for j in range(start, n):
        Py_INCREF(None)
        PyList_SET_ITEM(out, j, None)


def encode_optional_list(items):
    """Like ``encode_list``, with None encoded as the length ``0xFFFFFFFF`` (distinct from b"")."""
    cdef list seq = [None if x is None else _as_bytes(x, "a list item") for x in items]
    cdef Py_ssize_t total = 4, ln
    cdef object b
    for b in seq:
        if b is not None:
            ln = PyBytes_GET_SIZE(b)
            if ln > 0xFFFFFFFE:
                raise EncodeError(f"an item of {ln} bytes is too long")
            total += ln
        total += 4
    cdef bytes out = PyBytes_FromStringAndSize(NULL, total)
    cdef uint8_t* o = <uint8_t*>PyBytes_AS_STRING(out)
    _wr32(o, <uint32_t>len(seq))
    cdef Py_ssize_t pos = 4
    for b in seq:
        if b is None:
            _wr32(o + pos, _NONE)
            pos += 4
            continue
        ln = PyBytes_GET_SIZE(b)
        _wr32(o + pos, <uint32_t>ln)
        pos += 4
        if ln:
            memcpy(o + pos, PyBytes_AS_STRING(b), ln)
        pos += ln
    return out


def encode_found(values, const int64_t[::1] voff, const int64_t[::1] vlen, const uint8_t[::1] found):
    """See ``statestore_async._ref.framing.encode_found``."""
    cdef const uint8_t[::1] vv = values
    cdef Py_ssize_t n = found.shape[0], size = vv.shape[0], total = 4, i, pos = 4
    if voff.shape[0] != n or vlen.shape[0] != n:
        raise EncodeError(f"found answer: {n} found, {voff.shape[0]} value offsets, {vlen.shape[0]} value lengths")
    if n > 0xFFFFFFFF:
        raise EncodeError(f"found answer: {n} items, at most {0xFFFFFFFF}")
    for i in range(n):
        if found[i] and vlen[i] >= 0:
            if vlen[i] > 0xFFFFFFFE or voff[i] < 0 or voff[i] > size or vlen[i] > size - voff[i]:
                raise EncodeError(f"found answer: item {i} ({vlen[i]} bytes at {voff[i]}) is not inside the "
                                  f"{size} bytes of values")
            total += vlen[i]
        total += 4
    cdef bytes out = PyBytes_FromStringAndSize(NULL, total)
    cdef uint8_t* o = <uint8_t*>PyBytes_AS_STRING(out)
    _wr32(o, <uint32_t>n)
    for i in range(n):
        if found[i] and vlen[i] >= 0:
            _wr32(o + pos, <uint32_t>vlen[i])
            pos += 4
            if vlen[i]:
                memcpy(o + pos, &vv[0] + voff[i], vlen[i])
            pos += vlen[i]
        else:
            _wr32(o + pos, _NONE)
            pos += 4
    return out


def decode_optional_list(buf, Py_ssize_t offset=0, unsigned long long max_count=0xFFFFFFFF):
    """``(list of bytes | None, end offset)`` from an ``encode_optional_list`` payload."""
    cdef const uint8_t[::1] mv = buf
    cdef Py_ssize_t end = mv.shape[0]
    cdef Py_ssize_t pos = payload_start(offset, end, "optional list")
    cdef const uint8_t* base = &mv[0]
    cdef uint32_t n = payload_count(base, pos, end, max_count, 4, "optional list")
    pos += 4
    cdef list out = PyList_New(n)
    cdef uint32_t i, ln
    cdef object item
    for i in range(n):
        if end - pos < 4:
            _fill_none(out, i, n)
            raise DecodeError(f"optional list: truncated at byte {pos}")
        ln = _rd32(base + pos)
        pos += 4
        if ln == _NONE:
            item = None
        else:
            if <Py_ssize_t>ln > end - pos:
                _fill_none(out, i, n)
                raise DecodeError(f"optional list: an item of {ln} bytes overruns the buffer at byte {pos}")
            item = PyBytes_FromStringAndSize(<const char*>(base + pos), ln)
            pos += ln
        Py_INCREF(item)
        PyList_SET_ITEM(out, i, item)
    return out, pos


def encode_pairs(items):
    """``u32 count | (u32 klen | key | u32 vlen | value)*`` from (key, value) pairs."""
    cdef list keys = []
    cdef list vals = []
    cdef Py_ssize_t total = 4, kl, vl, i, m
    for item in items:
        try:
            k, v = item
        except (TypeError, ValueError):
            raise EncodeError(f"pairs are (key, value) tuples, got {item!r:.80}") from None
        kb = _as_bytes(k, "a key")
        vb = _as_bytes(v, "a value")
        kl = PyBytes_GET_SIZE(kb)
        vl = PyBytes_GET_SIZE(vb)
        if kl > 0xFFFFFFFE or vl > 0xFFFFFFFE:
            raise EncodeError("a key or value is too long")
        keys.append(kb)
        vals.append(vb)
        total += 8 + kl + vl
    m = len(keys)
    cdef bytes out = PyBytes_FromStringAndSize(NULL, total)
    cdef uint8_t* o = <uint8_t*>PyBytes_AS_STRING(out)
    _wr32(o, <uint32_t>m)
    cdef Py_ssize_t pos = 4
    cdef bytes b
    for i in range(m):
        b = <bytes>keys[i]
        kl = PyBytes_GET_SIZE(b)
        _wr32(o + pos, <uint32_t>kl)
        pos += 4
        if kl:
            memcpy(o + pos, PyBytes_AS_STRING(b), kl)
        pos += kl
        b = <bytes>vals[i]
        vl = PyBytes_GET_SIZE(b)
        _wr32(o + pos, <uint32_t>vl)
        pos += 4
        if vl:
            memcpy(o + pos, PyBytes_AS_STRING(b), vl)
        pos += vl
    return out


def decode_pairs(buf, Py_ssize_t offset=0, unsigned long long max_count=0xFFFFFFFF):
    """``(list of (key, value), end offset)`` from an ``encode_pairs`` payload."""
    cdef const uint8_t[::1] mv = buf
    cdef Py_ssize_t end = mv.shape[0]
    cdef Py_ssize_t pos = payload_start(offset, end, "pairs")
    cdef const uint8_t* base = &mv[0]
    cdef uint32_t n = payload_count(base, pos, end, max_count, 8, "pairs")
    pos += 4
    cdef list out = PyList_New(n)
    cdef uint32_t i, kl, vl
    cdef object k, v, item
    for i in range(n):
        if end - pos < 4:
            _fill_none(out, i, n)
            raise DecodeError(f"pairs: truncated at byte {pos}")
        kl = _rd32(base + pos)
        pos += 4
        if <Py_ssize_t>kl > end - pos:
            _fill_none(out, i, n)
            raise DecodeError(f"pairs: a key of {kl} bytes overruns the buffer at byte {pos}")
        k = PyBytes_FromStringAndSize(<const char*>(base + pos), kl)
        pos += kl
        if end - pos < 4:
            _fill_none(out, i, n)
            raise DecodeError(f"pairs: truncated at byte {pos}")
        vl = _rd32(base + pos)
        pos += 4
        if <Py_ssize_t>vl > end - pos:
            _fill_none(out, i, n)
            raise DecodeError(f"pairs: a value of {vl} bytes overruns the buffer at byte {pos}")
        v = PyBytes_FromStringAndSize(<const char*>(base + pos), vl)
        pos += vl
        item = (k, v)
        Py_INCREF(item)
        PyList_SET_ITEM(out, i, item)
    return out, pos



cdef Py_ssize_t _walked_list(const uint8_t[::1] mv, Py_ssize_t offset, unsigned long long max_count,
                             uint32_t* n) except -1:
    """The end offset of the ``encode_list`` payload at ``offset`` of ``mv``, checked as
    ``decode_list`` checks it; its item count in ``n``."""
    cdef Py_ssize_t end = mv.shape[0]
    cdef Py_ssize_t pos = payload_start(offset, end, "list")
    cdef const uint8_t* base = &mv[0]
    n[0] = payload_count(base, pos, end, max_count, 4, "list")
    cdef Py_ssize_t unused = -1
    return walk_list(base, pos + 4, end, n[0], 0, &unused)


def check_list(buf, Py_ssize_t offset=0, unsigned long long max_count=0xFFFFFFFF):
    """``(count, end offset)`` of an ``encode_list`` payload, validated like ``decode_list``."""
    cdef uint32_t n
    cdef Py_ssize_t stop = _walked_list(buf, offset, max_count, &n)
    return n, stop


def list_offsets(buf, Py_ssize_t offset=0, unsigned long long max_count=0xFFFFFFFF):
    """See ``statestore_async._ref.framing.list_offsets``."""
    cdef const uint8_t[::1] mv = buf
    cdef uint32_t n, i
    cdef Py_ssize_t stop = _walked_list(mv, offset, max_count, &n)  # checked first
    cdef const uint8_t* base = &mv[0]
    cdef bytes out = PyBytes_FromStringAndSize(NULL, <Py_ssize_t>n * 8)
    cdef int64_t* o = <int64_t*>PyBytes_AS_STRING(out)
    cdef Py_ssize_t pos = offset + 4
    for i in range(n):
        o[i] = pos + 4
        pos += 4 + _rd32(base + pos)
    return out, stop


def check_pairs(buf, Py_ssize_t offset=0, unsigned long long max_count=0xFFFFFFFF):
    """``(count, end offset)`` of an ``encode_pairs`` payload, validated like ``decode_pairs``."""
    cdef const uint8_t[::1] mv = buf
    cdef Py_ssize_t end = mv.shape[0]
    cdef Py_ssize_t pos = payload_start(offset, end, "pairs")
    cdef const uint8_t* base = &mv[0]
    cdef uint32_t n = payload_count(base, pos, end, max_count, 8, "pairs")
    cdef Py_ssize_t unused = -1
    pos = walk_pairs(base, pos + 4, end, n, 0, &unused)
    return n, pos


cdef inline int _check_header(int opcode, int flags, long long request_id) except -1:
    if not (0 <= opcode <= 255 and 0 <= flags <= 255 and 0 <= request_id <= 0xFFFFFFFF):
        raise EncodeError(f"frame header out of range: opcode={opcode} flags={flags} request_id={request_id}")
    return 0


cdef bytes _new_frame(int opcode, int flags, long long request_id, Py_ssize_t n, bytes head):
    """A frame of payload size ``n`` whose header and ``head`` are written; the rest is to fill."""
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


def encode_frame_list(int opcode, int flags, long long request_id, head, items):
    """``encode_frame(opcode, flags, request_id, head + encode_list(items))`` in one step."""
    cdef bytes h = _as_bytes(head, "a head")
    cdef list seq = items if type(items) is list else list(items)
    cdef Py_ssize_t i, m = len(seq), total = PyBytes_GET_SIZE(h) + 4, ln
    cdef object x
    for i in range(m):
        x = seq[i]
        if type(x) is not bytes:
            seq = [_as_bytes(y, "a list item") for y in seq]
            break
    cdef bytes b
    for i in range(m):
        b = <bytes>seq[i]
        ln = PyBytes_GET_SIZE(b)
        if ln > 0xFFFFFFFE:
            raise EncodeError(f"an item of {ln} bytes is too long")
        total += 4 + ln
    _check_header(opcode, flags, request_id)
    cdef bytes out = _new_frame(opcode, flags, request_id, total, h)
    cdef uint8_t* o = <uint8_t*>PyBytes_AS_STRING(out)
    cdef Py_ssize_t pos = _HEADER + PyBytes_GET_SIZE(h)
    _wr32(o + pos, <uint32_t>m)
    pos += 4
    for i in range(m):
        b = <bytes>seq[i]
        ln = PyBytes_GET_SIZE(b)
        _wr32(o + pos, <uint32_t>ln)
        pos += 4
        if ln:
            memcpy(o + pos, PyBytes_AS_STRING(b), ln)
        pos += ln
    return out


cdef inline bint _exact_pair(object item):
    return (type(item) is tuple and PyTuple_GET_SIZE(item) == 2
            and type((<tuple>item)[0]) is bytes and type((<tuple>item)[1]) is bytes)


cdef list _normalized_pairs(list seq):
    """The pairs of ``seq`` as (bytes, bytes) tuples, or the errors ``encode_pairs`` raises."""
    cdef list out = []
    for item in seq:
        try:
            k, v = item
        except (TypeError, ValueError):
            raise EncodeError(f"pairs are (key, value) tuples, got {item!r:.80}") from None
        out.append((_as_bytes(k, "a key"), _as_bytes(v, "a value")))
    return out


def encode_frame_pairs(int opcode, int flags, long long request_id, head, items):
    """``encode_frame(opcode, flags, request_id, head + encode_pairs(items))`` in one step."""
    cdef bytes h = _as_bytes(head, "a head")
    cdef list seq = items if type(items) is list else list(items)
    cdef Py_ssize_t i, m = len(seq), total = PyBytes_GET_SIZE(h) + 4, kl, vl
    for i in range(m):
        if not _exact_pair(seq[i]):
            seq = _normalized_pairs(seq)
            break
    cdef tuple t
    for i in range(m):
        t = <tuple>seq[i]
        kl = PyBytes_GET_SIZE(<bytes>t[0])
        vl = PyBytes_GET_SIZE(<bytes>t[1])
        if kl > 0xFFFFFFFE or vl > 0xFFFFFFFE:
            raise EncodeError("a key or value is too long")
        total += 8 + kl + vl
    _check_header(opcode, flags, request_id)
    cdef bytes out = _new_frame(opcode, flags, request_id, total, h)
    cdef uint8_t* o = <uint8_t*>PyBytes_AS_STRING(out)
    cdef Py_ssize_t pos = _HEADER + PyBytes_GET_SIZE(h)
    _wr32(o + pos, <uint32_t>m)
    pos += 4
    cdef bytes b
    for i in range(m):
        t = <tuple>seq[i]
        b = <bytes>t[0]
        kl = PyBytes_GET_SIZE(b)
        _wr32(o + pos, <uint32_t>kl)
        pos += 4
        if kl:
            memcpy(o + pos, PyBytes_AS_STRING(b), kl)
        pos += kl
        b = <bytes>t[1]
        vl = PyBytes_GET_SIZE(b)
        _wr32(o + pos, <uint32_t>vl)
        pos += 4
        if vl:
            memcpy(o + pos, PyBytes_AS_STRING(b), vl)
        pos += vl
    return out
