# The wire format's shared pieces, for the Cython modules that read or write frames and batch
# payloads (framing, arrowframes, payloads): the frame header size, the checks that open a batch
# payload and the walks that check one. Inline, so each module compiles its own copy; nothing here
# is a module of its own. The checks raise statestore_async.errors.DecodeError (imported on the
# error path only).
from libc.stdint cimport uint8_t, uint32_t

from _spans cimport rd32

cdef enum:
    WIRE_HEADER = 10          # u32 payload length | u8 opcode | u8 flags | u32 request id


cdef inline object _decode_error(str message):
    from statestore_async.errors import DecodeError
    return DecodeError(message)


cdef inline Py_ssize_t payload_start(Py_ssize_t offset, Py_ssize_t end, str what) except -1:
    """``offset`` if a payload can start there in a buffer of ``end`` bytes."""
    if offset < 0 or offset > end:
        raise _decode_error(f"{what}: offset {offset} outside the buffer")
    if end == 0:
        raise _decode_error(f"{what}: truncated at byte {offset}")
    return offset


cdef inline uint32_t payload_count(const uint8_t* base, Py_ssize_t pos, Py_ssize_t end, unsigned long long max_count,
                                   Py_ssize_t min_item, str what) except? 0xFFFFFFFF:
    """The u32 item count at ``pos``, checked against ``max_count`` and the bytes left."""
    if end - pos < 4:
        raise _decode_error(f"{what}: truncated at byte {pos}")
    cdef uint32_t n = rd32(base + pos)
    if n > max_count:
        raise _decode_error(f"{what}: {n} items, at most {max_count} allowed")
    if <unsigned long long>n * <unsigned long long>min_item > <unsigned long long>(end - pos - 4):
        raise _decode_error(f"{what}: {n} items cannot fit in the {end - pos - 4} bytes left")
    return n


cdef inline Py_ssize_t walk_list(const uint8_t* base, Py_ssize_t pos, Py_ssize_t end, uint32_t n,
                                 Py_ssize_t min_key, Py_ssize_t* short_key) except -1:
    """Check the n items of a list payload from ``pos`` (after its count); the end offset. Sets
    ``short_key[0]`` (when still negative) to the length of the first item shorter than ``min_key``."""
    cdef uint32_t i, ln
    for i in range(n):
        if end - pos < 4:
            raise _decode_error(f"list: truncated at byte {pos}")
        ln = rd32(base + pos)
        pos += 4
        if <Py_ssize_t>ln > end - pos:
            raise _decode_error(f"list: an item of {ln} bytes overruns the buffer at byte {pos}")
        if ln < min_key and short_key[0] < 0:
            short_key[0] = ln
        pos += ln
    return pos


cdef inline Py_ssize_t walk_pairs(const uint8_t* base, Py_ssize_t pos, Py_ssize_t end, uint32_t n,
                                  Py_ssize_t min_key, Py_ssize_t* short_key) except -1:
    """The same for the n (key, value) pairs of a pairs payload; ``min_key`` applies to the keys."""
    cdef uint32_t i, kl, vl
    for i in range(n):
        if end - pos < 4:
            raise _decode_error(f"pairs: truncated at byte {pos}")
        kl = rd32(base + pos)
        pos += 4
        if <Py_ssize_t>kl > end - pos:
            raise _decode_error(f"pairs: a key of {kl} bytes overruns the buffer at byte {pos}")
        if kl < min_key and short_key[0] < 0:
            short_key[0] = kl
        pos += kl
        if end - pos < 4:
            raise _decode_error(f"pairs: truncated at byte {pos}")
        vl = rd32(base + pos)
        pos += 4
        if <Py_ssize_t>vl > end - pos:
            raise _decode_error(f"pairs: a value of {vl} bytes overruns the buffer at byte {pos}")
        pos += vl
    return pos
