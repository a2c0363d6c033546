# The layout of a record in a table's arena, as plain C inlined into the module that cimports it
# (the compiled table): ``flags (u8: 1 tombstone, 2 dead) | varint key length | varint value
# length (not for a tombstone) | key | value | padding to 4 bytes``; a record is named by its ref,
# its offset in 4-byte units. Reading, sizing, writing and comparing records by ref.
from libc.stdint cimport uint8_t, uint32_t

from _bytes cimport ssa_copy  # ssa_write copies with it


cdef extern from *:
    """
    #include <stdint.h>
    #include <stdlib.h>
    #include <string.h>

    #define SSA_TOMB 1
    #define SSA_DEAD 2

    /* --- records ------------------------------------------------------------------------------ */
    static inline const uint8_t* ssa_var(const uint8_t* q, uint32_t* out) {
        uint32_t x = q[0], c;
        int shift = 7;
        if (x < 0x80) { *out = x; return q + 1; }
        x &= 0x7F;
        q++;
        for (;;) {
            c = *q++;
            x |= (c & 0x7F) << shift;
            if (c < 0x80) break;
            shift += 7;
        }
        *out = x;
        return q;
    }

    /* the key of the record at p (its value follows it); its lengths in *kl, *vl */
    static inline const uint8_t* ssa_rec(const uint8_t* p, uint32_t* kl, uint32_t* vl) {
        const uint8_t* q;
        if (p[1] < 0x80) { *kl = p[1]; q = p + 2; } else { q = ssa_var(p + 1, kl); }
        if (p[0] & SSA_TOMB) { *vl = 0; return q; }
        if (q[0] < 0x80) { *vl = q[0]; return q + 1; }
        return ssa_var(q, vl);
    }

    static inline size_t ssa_vsize(uint32_t x) {
        return x < (1u << 7) ? 1 : x < (1u << 14) ? 2 : x < (1u << 21) ? 3 : x < (1u << 28) ? 4 : 5;
    }

    static inline size_t ssa_rsize(uint32_t kl, uint32_t vl, int tomb) {
        return (1 + ssa_vsize(kl) + (tomb ? 0 : ssa_vsize(vl)) + (size_t)kl + vl + 3) & ~(size_t)3;
    }

    static inline size_t ssa_rsize_at(const uint8_t* p) {
        uint32_t kl, vl;
        const uint8_t* k = ssa_rec(p, &kl, &vl);
        return ((size_t)(k - p) + kl + vl + 3) & ~(size_t)3;
    }

    static inline uint8_t* ssa_wvar(uint8_t* q, uint32_t x) {
        while (x >= 0x80) { *q++ = (uint8_t)(x | 0x80); x >>= 7; }
        *q++ = (uint8_t)x;
        return q;
    }

    static inline void ssa_write(uint8_t* p, size_t size, const uint8_t* k, uint32_t kl,
                                 const uint8_t* v, uint32_t vl, int tomb) {
        uint8_t* q = p + 1;
        uint8_t* e = p + size;
        p[0] = tomb ? SSA_TOMB : 0;
        q = ssa_wvar(q, kl);
        if (!tomb) q = ssa_wvar(q, vl);
        ssa_copy(q, k, kl);
        q += kl;
        ssa_copy(q, v, vl);
        q += vl;
        switch (e - q) {  /* the padding to 4 bytes: at most 3 */
            case 3: *q++ = 0; /* fall through */
            case 2: *q++ = 0; /* fall through */
            case 1: *q = 0;
            default: break;
        }
    }

    static inline int ssa_cmp(const uint8_t* a, size_t al, const uint8_t* b, size_t bl) {
        size_t m = al < bl ? al : bl;
        int c = m ? memcmp(a, b, m) : 0;
        if (c) return c;
        return (al > bl) - (al < bl);
    }

    static inline const uint8_t* ssa_key_of(const uint8_t* arena, uint32_t ref, uint32_t* kl) {
        uint32_t vl;
        return ssa_rec(arena + ((size_t)ref << 2), kl, &vl);
    }

    static inline int ssa_cmp_refs(const uint8_t* arena, uint32_t x, uint32_t y) {
        uint32_t xl, yl;
        const uint8_t* xk = ssa_key_of(arena, x, &xl);
        const uint8_t* yk = ssa_key_of(arena, y, &yl);
        return ssa_cmp(xk, xl, yk, yl);
    }

    static inline int ssa_cmp_ref_key(const uint8_t* arena, uint32_t x, const uint8_t* k, size_t kl) {
        uint32_t xl;
        const uint8_t* xk = ssa_key_of(arena, x, &xl);
        return ssa_cmp(xk, xl, k, kl);
    }

    static inline int ssa_dead(const uint8_t* arena, uint32_t ref) {
        return arena[(size_t)ref << 2] & SSA_DEAD;
    }

    """
    const uint8_t* ssa_rec(const uint8_t* p, uint32_t* kl, uint32_t* vl) noexcept nogil
    size_t ssa_rsize(uint32_t kl, uint32_t vl, int tomb) noexcept nogil
    size_t ssa_rsize_at(const uint8_t* p) noexcept nogil
    void ssa_write(uint8_t* p, size_t size, const uint8_t* k, uint32_t kl, const uint8_t* v, uint32_t vl,
                   int tomb) noexcept nogil
    int ssa_cmp(const uint8_t* a, size_t al, const uint8_t* b, size_t bl) noexcept nogil
    const uint8_t* ssa_key_of(const uint8_t* arena, uint32_t ref, uint32_t* kl) noexcept nogil
    int ssa_cmp_refs(const uint8_t* arena, uint32_t x, uint32_t y) noexcept nogil
    int ssa_cmp_ref_key(const uint8_t* arena, uint32_t x, const uint8_t* k, size_t kl) noexcept nogil
    int ssa_dead(const uint8_t* arena, uint32_t ref) noexcept nogil
    enum:
        SSA_TOMB
        SSA_DEAD
