# Byte helpers shared by the Cython modules that hash, compare and copy keys and values (table,
# arrowcodec, payloads): a fast 64-bit hash of a byte string, an equality test and a copy for short
# ones, and a prefetch. Plain C, inlined into each module
# that cimports them (nothing here is a module of its own); the hash is never stored nor sent, so
# it may change between versions.
from libc.stdint cimport uint8_t, uint64_t


cdef extern from *:
    """
    #include <stdint.h>
    #include <string.h>

    static inline uint64_t ssa_rd64(const uint8_t* p) { uint64_t v; memcpy(&v, p, 8); return v; }
    static inline uint64_t ssa_rd32x(const uint8_t* p) { uint32_t v; memcpy(&v, p, 4); return v; }

    static inline void ssa_mul(uint64_t a, uint64_t b, uint64_t* lo, uint64_t* hi) {
    #if defined(__SIZEOF_INT128__)
        __uint128_t r = (__uint128_t)a * b;
        *lo = (uint64_t)r;
        *hi = (uint64_t)(r >> 64);
    #else
        uint64_t ha = a >> 32, hb = b >> 32, la = (uint32_t)a, lb = (uint32_t)b;
        uint64_t rh = ha * hb, rm0 = ha * lb, rm1 = hb * la, rl = la * lb;
        uint64_t t = rl + (rm0 << 32), c = t < rl;
        uint64_t l = t + (rm1 << 32);
        c += l < t;
        *lo = l;
        *hi = rh + (rm0 >> 32) + (rm1 >> 32) + c;
    #endif
    }

    static inline uint64_t ssa_mix(uint64_t a, uint64_t b) {
        uint64_t lo, hi;
        ssa_mul(a, b, &lo, &hi);
        return lo ^ hi;
    }

    /* a wyhash-style 64-bit hash of n bytes */
    static inline uint64_t ssa_hash(const uint8_t* p, size_t n) {
        const uint64_t s0 = 0xa0761d6478bd642fULL, s1 = 0xe7037ed1a0b428dbULL;
        uint64_t seed = 0x8ebc6af09c88c6e3ULL, a, b, lo, hi;
        if (n <= 16) {
            if (n >= 4) {
                size_t q = (n >> 3) << 2;
                a = (ssa_rd32x(p) << 32) | ssa_rd32x(p + q);
                b = (ssa_rd32x(p + n - 4) << 32) | ssa_rd32x(p + n - 4 - q);
            } else if (n > 0) {
                a = ((uint64_t)p[0] << 16) | ((uint64_t)p[n >> 1] << 8) | p[n - 1];
                b = 0;
            } else {
                a = b = 0;
            }
        } else {
            size_t i = n;
            while (i > 16) {
                seed = ssa_mix(ssa_rd64(p) ^ s1, ssa_rd64(p + 8) ^ seed);
                p += 16;
                i -= 16;
            }
            a = ssa_rd64(p + i - 16);
            b = ssa_rd64(p + i - 8);
        }
        ssa_mul(a ^ s1, b ^ seed, &lo, &hi);
        return ssa_mix(lo ^ s0 ^ (uint64_t)n, hi ^ s1);
    }

    /* whether n bytes at a and b are equal (short keys without a call to memcmp) */
    static inline int ssa_eq(const uint8_t* a, const uint8_t* b, size_t n) {
        if (n >= 8) {
            if (n <= 16)
                return ssa_rd64(a) == ssa_rd64(b) && ssa_rd64(a + n - 8) == ssa_rd64(b + n - 8);
            if (n <= 32)
                return ((ssa_rd64(a) ^ ssa_rd64(b)) | (ssa_rd64(a + 8) ^ ssa_rd64(b + 8))
                        | (ssa_rd64(a + n - 16) ^ ssa_rd64(b + n - 16)) | (ssa_rd64(a + n - 8) ^ ssa_rd64(b + n - 8))) == 0;
            return memcmp(a, b, n) == 0;
        }
        if (n >= 4)
            return ssa_rd32x(a) == ssa_rd32x(b) && ssa_rd32x(a + n - 4) == ssa_rd32x(b + n - 4);
        for (size_t i = 0; i < n; i++)
            if (a[i] != b[i]) return 0;
        return 1;
    }

    /* n bytes from s to d; keys and values are mostly short, where a call to memcpy costs more
       than the copy: up to 32 bytes by two or four overlapping loads, then the stores (all loads
       first: s and d may overlap) */
    static inline void ssa_copy(uint8_t* d, const uint8_t* s, size_t n) {
        if (n > 16 && n <= 32) {
            uint64_t a = ssa_rd64(s), b = ssa_rd64(s + 8), c = ssa_rd64(s + n - 16), e = ssa_rd64(s + n - 8);
            memcpy(d, &a, 8);
            memcpy(d + 8, &b, 8);
            memcpy(d + n - 16, &c, 8);
            memcpy(d + n - 8, &e, 8);
        } else if (n >= 8 && n <= 16) {
            uint64_t x = ssa_rd64(s), y = ssa_rd64(s + n - 8);
            memcpy(d, &x, 8);
            memcpy(d + n - 8, &y, 8);
        } else if (n >= 4 && n < 8) {
            uint32_t x, y;
            memcpy(&x, s, 4);
            memcpy(&y, s + n - 4, 4);
            memcpy(d, &x, 4);
            memcpy(d + n - 4, &y, 4);
        } else if (n) {
            memmove(d, s, n);
        }
    }

    static inline void ssa_prefetch(const void* p) {
    #if defined(__GNUC__)
        __builtin_prefetch(p);
    #endif
    }
    """
    uint64_t ssa_rd64(const uint8_t* p) noexcept nogil
    uint64_t ssa_rd32x(const uint8_t* p) noexcept nogil
    uint64_t ssa_hash(const uint8_t* p, size_t n) noexcept nogil
    int ssa_eq(const uint8_t* a, const uint8_t* b, size_t n) noexcept nogil
    void ssa_prefetch(const void* p) noexcept nogil
    void ssa_copy(uint8_t* d, const uint8_t* s, size_t n) noexcept nogil
