# Helpers shared by the wire-format Cython modules (framing, table, arrowframes, blockcodec): the frame header
# size, little-endian u32 access, the checks that open a batch payload and the walks that check one,
# and the argument check of the batch lookups by index (``check_spans``). Inline, so each module
# compiles its own copy; nothing here is a module of its own. The checks raise
# statestore_async.errors.DecodeError (imported on the error path only).
from libc.stdint cimport int64_t, uint8_t, uint32_t

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


cdef inline int check_spans(const uint8_t[::1] kbuf, const int64_t[::1] koff, const int64_t[::1] js,
                            const uint8_t[::1] found, const int64_t[::1] voff, const int64_t[::1] vlen,
                            str what) except -1:
    """The arguments of a batch lookup by index over packed keys (``what``): ``found``, ``voff`` and
    ``vlen`` as long as ``koff``; every index of ``js`` within them and not found yet; its key (the
    ``kbuf`` bytes at ``koff[j]``, its length the u32 before them) inside ``kbuf``. Messages of
    ``_ref.blockcodec._check_spans``."""
    cdef Py_ssize_t n = koff.shape[0], size = kbuf.shape[0], i, j, at
    if found.shape[0] != n or voff.shape[0] != n or vlen.shape[0] != n:
        from statestore_async.errors import InterfaceError
        raise InterfaceError(f"{what}: {n} key offsets, {found.shape[0]} found, {voff.shape[0]} value offsets, "
                             f"{vlen.shape[0]} value lengths")
    for i in range(js.shape[0]):
        j = js[i]
        if j < 0 or j >= n:
            raise IndexError(f"{what}: index {j} out of range for {n} keys")
        if found[j]:
            from statestore_async.errors import InterfaceError
            raise InterfaceError(f"{what}: key {j} is already found (ask a level only for the keys no newer level has)")
        at = koff[j]
        if at < 4 or at > size or <Py_ssize_t>rd32(&kbuf[0] + at - 4) > size - at:
            from statestore_async.errors import InterfaceError
            raise InterfaceError(f"{what}: key {j} at offset {at} is not inside the {size}-byte key buffer")
    return 0
