# Helpers shared by the wire-format Cython modules (framing, overlay, arrowbatch): the frame header
# size and little-endian u32 access. Inline, so each
# module compiles its own copy; nothing here is a module of its own.
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
