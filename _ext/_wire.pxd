# Helpers shared by the wire-format Cython modules (framing, overlay, arrowframes): the frame header
# size, little-endian u32 access and the checks that open a batch payload. Inline, so each module
# compiles its own copy; nothing here is a module of its own. The checks raise
# statestore_async.errors.DecodeError (imported on the error path only).
from libc.stdint cimport uint8_t, uint32_t

cdef enum:
    WIRE_HEADER = 10          # u32 payload length | u8 opcode | u8 flags | u32 request id


cdef inline uint32_t rd32(const uint8_t* p) noexcept nogil:
    return <uint32_t>p[0] | (<uint32_t>p[1] << 8) | (<uint32_t>p[2] << 16) | (<uint32_t>p[3] << 24)


cdef inline void wr32(uint8_t* p, uint32_t v) noexcept nogil:
    p[0] = v & 0xFF
    p[1] = (v >> 8) & 0xFF
    p[2] = (v >> 16) & 0xFF
    p[3] = (v >> 24) & 0xFF


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
