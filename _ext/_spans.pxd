# Keys laid in place in a buffer, each after its u32 length (little-endian): the u32 access and
# the argument check of the batch lookups by index over such keys (``check_spans``: table,
# blockcodec). Inline, so each module compiles its own copy; nothing here is a module of its own,
# and nothing here knows a request's frame or payload (``_wire.pxd`` does).
from libc.stdint cimport int64_t, uint8_t, uint32_t


cdef inline uint32_t rd32(const uint8_t* p) noexcept nogil:
    return <uint32_t>p[0] | (<uint32_t>p[1] << 8) | (<uint32_t>p[2] << 16) | (<uint32_t>p[3] << 24)


cdef inline void wr32(uint8_t* p, uint32_t v) noexcept nogil:
    p[0] = v & 0xFF
    p[1] = (v >> 8) & 0xFF
    p[2] = (v >> 16) & 0xFF
    p[3] = (v >> 24) & 0xFF


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
