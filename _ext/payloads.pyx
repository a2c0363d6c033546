# cython: language_level=3
"""The daemon's request routines, compiled: a request's batch payload read straight into an engine
table, and a GET_MANY's answer written straight from two; the same results, bytes and errors as
``statestore_async._ref.payloads`` (documented in ``statestore_async.daemon.payloads``).

Every read of a payload below is checked against its end by hand (boundscheck is off), and every
payload is checked whole before anything is set, so a bad batch changes nothing. The records then
go to the table in place (``table.pxd``): no copy, no Python object per record.
"""
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from libc.stdint cimport uint8_t, uint32_t
from libc.stdlib cimport free, malloc

from _bytes cimport ssa_copy
from _spans cimport wr32
from _wire cimport payload_count, payload_start, walk_list, walk_pairs
from statestore_async._native.table cimport Found, find_records, key_error, set_records

from statestore_async.errors import DecodeError

__all__ = ["get_packed", "put_packed", "remove_packed"]

cdef uint32_t _NONE = 0xFFFFFFFF


cdef int _trailing(Py_ssize_t pos, Py_ssize_t end, str what) except -1:
    if pos != end:
        raise DecodeError(f"{what}: {end - pos} unexpected trailing bytes")
    return 0


from statestore_async._native.table import Table as _Table


cdef int _check_table(object table, str name) except -1:
    if type(table) is not _Table:  # the table type is final
        raise TypeError(f"Argument '{name}' has incorrect type (expected {_Table.__module__}.Table, got "
                        f"{type(table).__name__})")
    return 0


def put_packed(table, buf, Py_ssize_t offset, Py_ssize_t min_key, unsigned long long max_count=0xFFFFFFFF):
    """See ``statestore_async._ref.payloads.put_packed``."""
    _check_table(table, "table")
    cdef const uint8_t[::1] mv = buf
    cdef Py_ssize_t end = mv.shape[0]
    cdef Py_ssize_t pos = payload_start(offset, end, "pairs")
    cdef const uint8_t* base = &mv[0]
    cdef uint32_t n = payload_count(base, pos, end, max_count, 8, "pairs")
    cdef Py_ssize_t first = pos + 4, short_key = -1
    pos = walk_pairs(base, first, end, n, min_key, &short_key)
    _trailing(pos, end, "pairs")
    if short_key >= 0:
        raise key_error(short_key, min_key)
    set_records(table, base, first, pos - first, n, True)
    return n


def remove_packed(table, buf, Py_ssize_t offset, Py_ssize_t min_key, unsigned long long max_count=0xFFFFFFFF):
    """See ``statestore_async._ref.payloads.remove_packed``."""
    _check_table(table, "table")
    cdef const uint8_t[::1] mv = buf
    cdef Py_ssize_t end = mv.shape[0]
    cdef Py_ssize_t pos = payload_start(offset, end, "list")
    cdef const uint8_t* base = &mv[0]
    cdef uint32_t n = payload_count(base, pos, end, max_count, 4, "list")
    cdef Py_ssize_t first = pos + 4, short_key = -1
    pos = walk_list(base, first, end, n, min_key, &short_key)
    _trailing(pos, end, "list")
    if short_key >= 0:
        raise key_error(short_key, min_key)
    set_records(table, base, first, pos - first, n, False)
    return n


def get_packed(overlay, base, buf, Py_ssize_t offset, unsigned long long max_count=0xFFFFFFFF):
    """See ``statestore_async._ref.payloads.get_packed``."""
    if overlay is not None:
        _check_table(overlay, "overlay")
    if base is None:
        raise TypeError("Argument 'base' must not be None")
    _check_table(base, "base")
    cdef const uint8_t[::1] mv = buf
    cdef Py_ssize_t end = mv.shape[0]
    cdef Py_ssize_t pos = payload_start(offset, end, "list")
    cdef const uint8_t* b = &mv[0]
    cdef uint32_t n = payload_count(b, pos, end, max_count, 4, "list")
    cdef Py_ssize_t first = pos + 4, short_key = -1
    pos = walk_list(b, first, end, n, 0, &short_key)
    _trailing(pos, end, "list")
    # look every value up (nothing changes the tables meanwhile), sizing the answer
    cdef Found* found = <Found*>malloc((<size_t>n + 1) * sizeof(Found))
    if found == NULL:
        raise MemoryError()
    cdef uint32_t i
    cdef bytes out
    cdef uint8_t* o
    try:
        out = PyBytes_FromStringAndSize(NULL, 4 + 4 * <Py_ssize_t>n + find_records(overlay, base, b, first, n, found))
        o = <uint8_t*>PyBytes_AS_STRING(out)
        wr32(o, n)
        o += 4
        for i in range(n):
            if found[i].none:
                wr32(o, _NONE)
                o += 4
            else:
                wr32(o, found[i].vl)
                o += 4
                if found[i].vl:
                    ssa_copy(o, found[i].val, found[i].vl)
                o += found[i].vl
    finally:
        free(found)
    return out
