# cython: language_level=3
"""Batch operations on an open version's overlay, compiled: the same results, dict contents,
bytes and errors as ``statestore_async._ref.overlay`` (documented in ``statestore_async.engine.overlay``).

Keys and values are read straight from the request payload into the overlay dict, and GET answers
are written straight from the dicts into the answer payload: no list of tuples, no list of values.
Every read below is checked against ``end`` by hand (boundscheck is off), and every payload is
checked whole before anything is set, so a bad batch changes nothing.
"""
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.dict cimport PyDict_DelItem, PyDict_Next, PyDict_SetItem, PyDict_Size
from cpython.list cimport PyList_Append, PyList_GET_ITEM, PyList_GET_SIZE, PyList_New, PyList_SET_ITEM
from cpython.ref cimport Py_INCREF, PyObject
from cpython.tuple cimport PyTuple_GET_SIZE
from libc.stdint cimport uint8_t, uint32_t
from libc.string cimport memcpy

from _wire cimport payload_count, payload_start, rd32 as _rd32, wr32 as _wr32, WIRE_HEADER

from statestore_async.errors import DecodeError, EncodeError, InterfaceError, KeyFormatError

cdef extern from *:
    """
    #if PY_VERSION_HEX < 0x030D0000
    #define ssa_dict_presized(n) _PyDict_NewPresized(n)
    #else
    #define ssa_dict_presized(n) PyDict_New()
    #endif
    """
    dict ssa_dict_presized(Py_ssize_t n)

cdef extern from "Python.h":
    PyObject* PyDict_GetItemWithError(object d, object key) except? NULL
    PyObject* PyDict_SetDefault(object d, object key, object default) except NULL


cdef Py_ssize_t _SLOTS = 1 << 16
KEY_GROUP_SLOTS = _SLOTS

cdef Py_ssize_t _HEADER = WIRE_HEADER
cdef uint32_t _NONE = 0xFFFFFFFF




cdef object _key_error(Py_ssize_t n, Py_ssize_t min_key):
    return KeyFormatError(f"a store key starts with its {min_key}-byte key group, got {n} bytes")


cdef bytes _check_key(object key, Py_ssize_t min_key):
    if type(key) is not bytes:
        if isinstance(key, (bytearray, memoryview)):
            key = bytes(key)
        else:
            raise KeyFormatError(f"keys are bytes, got {type(key).__name__}")
    if PyBytes_GET_SIZE(key) < min_key:
        raise _key_error(PyBytes_GET_SIZE(key), min_key)
    return <bytes>key


cdef bytes _check_value(object value):
    if type(value) is not bytes:
        if isinstance(value, (bytearray, memoryview)):
            return bytes(value)
        raise InterfaceError(f"values are bytes, got {type(value).__name__}")
    return <bytes>value


cdef inline Py_ssize_t _entry(object k, object v, Py_ssize_t overhead):
    return PyBytes_GET_SIZE(k) + (PyBytes_GET_SIZE(v) if v is not None else 0) + overhead


cdef inline Py_ssize_t _set(dict overlay, object k, object v, Py_ssize_t overhead) except? -1:
    """Set overlay[k] = v; the change of the accounted bytes."""
    cdef Py_ssize_t delta = _entry(k, v, overhead)
    cdef PyObject* old = PyDict_GetItemWithError(overlay, k)
    if old is not NULL:
        delta -= _entry(k, <object>old, overhead)
    PyDict_SetItem(overlay, k, v)
    return delta


def put_items(dict overlay, items, Py_ssize_t min_key, Py_ssize_t overhead):
    """See ``statestore_async._ref.overlay.put_items``."""
    cdef list seq = list(items)
    cdef Py_ssize_t i, n = len(seq), delta = 0
    cdef object item
    for i in range(n):
        item = seq[i]
        if not (type(item) is tuple and PyTuple_GET_SIZE(item) == 2
                and type((<tuple>item)[0]) is bytes and type((<tuple>item)[1]) is bytes
                and PyBytes_GET_SIZE((<tuple>item)[0]) >= min_key):
            seq = _checked_pairs(seq, min_key)
            break
    cdef tuple t
    for i in range(n):
        t = <tuple>seq[i]
        delta += _set(overlay, t[0], t[1], overhead)
    return delta


cdef list _checked_pairs(list seq, Py_ssize_t min_key):
    cdef list out = []
    for item in seq:
        try:
            k, v = item
        except (TypeError, ValueError):
            raise InterfaceError(f"pairs are (key, value) tuples, got {item!r:.80}") from None
        out.append((_check_key(k, min_key), _check_value(v)))
    return out


def remove_keys(dict overlay, keys, Py_ssize_t min_key, Py_ssize_t overhead):
    """See ``statestore_async._ref.overlay.remove_keys``."""
    cdef list seq = list(keys)
    cdef Py_ssize_t i, n = len(seq), delta = 0
    cdef object k
    for i in range(n):
        k = seq[i]
        if not (type(k) is bytes and PyBytes_GET_SIZE(k) >= min_key):
            seq = [_check_key(x, min_key) for x in seq]
            break
    for i in range(n):
        delta += _set(overlay, seq[i], None, overhead)
    return delta


def get_list(dict overlay, dict base, keys):
    """See ``statestore_async._ref.overlay.get_list``."""
    cdef list seq = keys if type(keys) is list else list(keys)
    cdef Py_ssize_t i, n = len(seq)
    cdef list out = PyList_New(n)
    cdef PyObject* v
    cdef object k, val
    for i in range(n):
        k = seq[i]
        v = PyDict_GetItemWithError(overlay, k) if overlay else NULL
        if v is NULL:
            v = PyDict_GetItemWithError(base, k)
        val = <object>v if v is not NULL else None
        Py_INCREF(val)
        PyList_SET_ITEM(out, i, val)
    return out


# --- packed payloads --------------------------------------------------------------------------------
cdef int _trailing(Py_ssize_t pos, Py_ssize_t end, str what) except -1:
    if pos != end:
        raise DecodeError(f"{what}: {end - pos} unexpected trailing bytes")
    return 0


cdef Py_ssize_t _check_keys(const uint8_t* base, Py_ssize_t pos, Py_ssize_t end, uint32_t n,
                            Py_ssize_t min_key, Py_ssize_t* short_key) except -1:
    """Walk a list of n items from pos; the end offset. Sets short_key to the first key shorter than min_key."""
    cdef uint32_t i, ln
    for i in range(n):
        if end - pos < 4:
            raise DecodeError(f"list: truncated at byte {pos}")
        ln = _rd32(base + pos)
        pos += 4
        if <Py_ssize_t>ln > end - pos:
            raise DecodeError(f"list: an item of {ln} bytes overruns the buffer at byte {pos}")
        if ln < min_key and short_key[0] < 0:
            short_key[0] = ln
        pos += ln
    return pos


def put_packed(dict overlay, buf, Py_ssize_t offset, Py_ssize_t min_key, Py_ssize_t overhead,
               unsigned long long max_count=0xFFFFFFFF):
    """See ``statestore_async._ref.overlay.put_packed``."""
    cdef const uint8_t[::1] mv = buf
    cdef Py_ssize_t end = mv.shape[0]
    cdef Py_ssize_t pos = payload_start(offset, end, "pairs")
    cdef const uint8_t* base = &mv[0]
    cdef uint32_t n = payload_count(base, pos, end, max_count, 8, "pairs")
    cdef Py_ssize_t first = pos + 4, short_key = -1, delta = 0
    cdef uint32_t i, kl, vl
    pos = first
    for i in range(n):
        if end - pos < 4:
            raise DecodeError(f"pairs: truncated at byte {pos}")
        kl = _rd32(base + pos)
        pos += 4
        if <Py_ssize_t>kl > end - pos:
            raise DecodeError(f"pairs: a key of {kl} bytes overruns the buffer at byte {pos}")
        if kl < min_key and short_key < 0:
            short_key = kl
        pos += kl
        if end - pos < 4:
            raise DecodeError(f"pairs: truncated at byte {pos}")
        vl = _rd32(base + pos)
        pos += 4
        if <Py_ssize_t>vl > end - pos:
            raise DecodeError(f"pairs: a value of {vl} bytes overruns the buffer at byte {pos}")
        pos += vl
    _trailing(pos, end, "pairs")
    if short_key >= 0:
        raise _key_error(short_key, min_key)
    cdef object k, v
    cdef PyObject* old
    cdef Py_ssize_t size
    pos = first
    for i in range(n):
        kl = _rd32(base + pos)
        k = PyBytes_FromStringAndSize(<const char*>(base + pos + 4), kl)
        pos += 4 + kl
        vl = _rd32(base + pos)
        v = PyBytes_FromStringAndSize(<const char*>(base + pos + 4), vl)
        pos += 4 + vl
        delta += kl + vl + overhead
        # one lookup for a new key (the dict grows), two to replace one (values may be shared
        # singletons such as b"", so identity cannot tell)
        size = PyDict_Size(overlay)
        old = PyDict_SetDefault(overlay, k, v)
        if PyDict_Size(overlay) == size:
            delta -= _entry(k, <object>old, overhead)
            PyDict_SetItem(overlay, k, v)
    return n, delta


def remove_packed(dict overlay, buf, Py_ssize_t offset, Py_ssize_t min_key, Py_ssize_t overhead,
                  unsigned long long max_count=0xFFFFFFFF):
    """See ``statestore_async._ref.overlay.remove_packed``."""
    cdef const uint8_t[::1] mv = buf
    cdef Py_ssize_t end = mv.shape[0]
    cdef Py_ssize_t pos = payload_start(offset, end, "list")
    cdef const uint8_t* base = &mv[0]
    cdef uint32_t n = payload_count(base, pos, end, max_count, 4, "list")
    cdef Py_ssize_t first = pos + 4, short_key = -1, delta = 0
    pos = _check_keys(base, first, end, n, min_key, &short_key)
    _trailing(pos, end, "list")
    if short_key >= 0:
        raise _key_error(short_key, min_key)
    cdef uint32_t i, kl
    cdef object k
    pos = first
    for i in range(n):
        kl = _rd32(base + pos)
        k = PyBytes_FromStringAndSize(<const char*>(base + pos + 4), kl)
        pos += 4 + kl
        delta += _set(overlay, k, None, overhead)
    return n, delta


def get_packed(dict overlay, dict base, buf, Py_ssize_t offset, unsigned long long max_count=0xFFFFFFFF):
    """See ``statestore_async._ref.overlay.get_packed``."""
    cdef const uint8_t[::1] mv = buf
    cdef Py_ssize_t end = mv.shape[0]
    cdef Py_ssize_t pos = payload_start(offset, end, "list")
    cdef const uint8_t* b = &mv[0]
    cdef uint32_t n = payload_count(b, pos, end, max_count, 4, "list")
    cdef Py_ssize_t first = pos + 4, short_key = -1
    pos = _check_keys(b, first, end, n, 0, &short_key)
    _trailing(pos, end, "list")
    # look every value up, holding references, and size the answer
    cdef list values = [None] * n
    cdef uint32_t i, kl
    cdef object k, val
    cdef PyObject* v
    cdef bint use_overlay = len(overlay) != 0
    cdef Py_ssize_t total = 4, ln
    pos = first
    for i in range(n):
        kl = _rd32(b + pos)
        k = PyBytes_FromStringAndSize(<const char*>(b + pos + 4), kl)
        pos += 4 + kl
        v = PyDict_GetItemWithError(overlay, k) if use_overlay else NULL
        if v is NULL:
            v = PyDict_GetItemWithError(base, k)
        if v is NULL or <object>v is None:
            val = None
        else:
            val = <object>v
            if type(val) is not bytes:
                val = _as_bytes(val)
            ln = PyBytes_GET_SIZE(val)
            if ln > 0xFFFFFFFE:
                raise EncodeError(f"an item of {ln} bytes is too long")
            total += ln
        total += 4
        values[i] = val
    # write the answer
    cdef bytes out = PyBytes_FromStringAndSize(NULL, total)
    cdef uint8_t* o = <uint8_t*>PyBytes_AS_STRING(out)
    pos = 0
    _wr32(o + pos, n)
    pos += 4
    for i in range(n):
        val = values[i]
        if val is None:
            _wr32(o + pos, _NONE)
            pos += 4
            continue
        ln = PyBytes_GET_SIZE(val)
        _wr32(o + pos, <uint32_t>ln)
        pos += 4
        if ln:
            memcpy(o + pos, PyBytes_AS_STRING(val), ln)
        pos += ln
    return out


cdef bytes _as_bytes(object item):
    if isinstance(item, (bytearray, memoryview)):
        return bytes(item)
    raise EncodeError(f"a list item must be bytes, got {type(item).__name__}")


def apply_changes(dict data, dict changes, Py_ssize_t overhead):
    """Apply key → value|None (None: remove) to ``data`` in one pass; see the facade's docstring."""
    # the pre-images go to a list in the changes' order: a dict of them cost as much as the rest of
    # the commit (half a million inserts into a fresh table); the engine builds one only to roll back
    cdef list pre = PyList_New(0)
    cdef set dropped = None
    cdef Py_ssize_t pos = 0
    cdef PyObject* kp
    cdef PyObject* vp
    cdef PyObject* oldp
    cdef object k, v, old
    cdef Py_ssize_t data_delta = 0, undo_bytes = 0, rec_bytes = 0, klen, vlen, olen
    while PyDict_Next(changes, &pos, &kp, &vp):
        k = <object>kp
        v = <object>vp
        oldp = PyDict_GetItemWithError(data, k)
        klen = len(k)
        if v is None:
            if oldp == NULL:
                if dropped is None:
                    dropped = set()
                dropped.add(k)  # removing what is not there changes nothing
                continue
            old = <object>oldp  # a reference of our own before the map lets go of it
            olen = len(old)
            PyDict_DelItem(data, k)
            data_delta -= klen + olen + overhead
            vlen = 0
        else:
            vlen = len(v)
            if oldp == NULL:
                old = None
                olen = 0
                data_delta += klen + vlen + overhead
            else:
                old = <object>oldp
                olen = len(old)
                data_delta += vlen - olen
            PyDict_SetItem(data, k, v)
        PyList_Append(pre, old)
        undo_bytes += klen + olen + overhead
        rec_bytes += klen + vlen + 8
    cdef dict records = changes
    if dropped is not None:
        records = ssa_dict_presized(PyDict_Size(changes) - len(dropped))
        pos = 0
        while PyDict_Next(changes, &pos, &kp, &vp):
            if <object>kp not in dropped:
                PyDict_SetItem(records, <object>kp, <object>vp)
    return pre, records, data_delta, undo_bytes, rec_bytes


cdef list _check_groups(object groups):
    if type(groups) is not list or PyList_GET_SIZE(groups) != _SLOTS:
        raise InterfaceError(f"groups is a list of {KEY_GROUP_SLOTS} slots")
    return <list>groups


def group_records(keys, Py_ssize_t start, Py_ssize_t stop, dict shadow, dict data, groups):
    """See ``statestore_async._ref.overlay.group_records``."""
    cdef list slots = _check_groups(groups)
    if type(keys) is not list:
        raise InterfaceError(f"keys is a list, got {type(keys).__name__}")
    cdef list ks = <list>keys
    cdef Py_ssize_t n = PyList_GET_SIZE(ks), i, kg
    cdef object k, v, slot
    cdef PyObject* vp
    cdef const uint8_t* p
    if start < 0:
        start = 0
    if stop > n:
        stop = n
    for i in range(start, stop):
        k = <object>PyList_GET_ITEM(ks, i)
        if type(k) is not bytes:
            raise KeyFormatError(f"keys are bytes, got {type(k).__name__}")
        vp = PyDict_GetItemWithError(shadow, k)
        if vp is NULL:
            vp = PyDict_GetItemWithError(data, k)
            if vp is NULL:
                continue
        v = <object>vp
        if v is None:
            continue
        if PyBytes_GET_SIZE(k) >= 2:
            p = <const uint8_t*>PyBytes_AS_STRING(k)
            kg = (p[0] << 8) | p[1]
        else:
            kg = 0
        slot = <object>PyList_GET_ITEM(slots, kg)
        if slot is None:
            slots[kg] = [k, v]
        elif type(slot) is not list:
            raise InterfaceError(f"group slot {kg} holds a {type(slot).__name__}, not a list")
        else:
            PyList_Append(slot, k)
            PyList_Append(slot, v)


def gather_records(groups, cursor, Py_ssize_t max_bytes):
    """See ``statestore_async._ref.overlay.gather_records``."""
    cdef list slots = _check_groups(groups)
    if type(cursor) is not tuple or len(cursor) != 2 or type(cursor[0]) is not int or type(cursor[1]) is not int:
        raise InterfaceError(f"bad cursor {cursor!r}")
    g_, i_ = cursor
    if not (0 <= g_ <= KEY_GROUP_SLOTS and i_ >= 0):
        raise InterfaceError(f"bad cursor {cursor!r}")
    cdef Py_ssize_t g = g_, i = i_, size = 0, nrec
    cdef list records = []
    cdef object slot, k, v
    while g < _SLOTS:
        slot = <object>PyList_GET_ITEM(slots, g)
        if slot is not None and type(slot) is not list:
            raise InterfaceError(f"group slot {g} holds a {type(slot).__name__}, not a list")
        if slot is None or i + 1 >= PyList_GET_SIZE(<list>slot):
            slots[g] = None  # done with this group: its records go as soon as they are encoded
            g += 1
            i = 0
            continue
        k = <object>PyList_GET_ITEM(<list>slot, i)
        v = <object>PyList_GET_ITEM(<list>slot, i + 1)
        nrec = len(k) + len(v) + 11
        if size and size + nrec > max_bytes:
            break
        PyList_Append(records, (k, v))
        size += nrec
        i += 2
    return records, (g, i)
