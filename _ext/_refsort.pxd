# The sort of a table's refs in key order (``Table.freeze``, the order index and its pending run),
# as plain C inlined into the module that cimports it: a counting pass on the key's first two
# bytes (its key group), then by 16-byte prefixes of the rest; a full compare only on a prefix tie.
from libc.stdint cimport uint8_t, uint32_t

from _records cimport ssa_cmp, ssa_key_of  # the C helpers the sort reads keys with


# --- the sort of refs by key (``Table.freeze``, the order index and its pending run): refs in key order, by a counting pass on the key's first two
# bytes (its key group), then by 16-byte prefixes of the rest; a full compare only on a prefix tie
cdef extern from *:
    """
    /* an entry: the key's bucket (below), the next 16 key bytes big-endian, its ref */
    typedef struct { uint64_t p0, p1; uint32_t ref; uint32_t bucket; } ssa_xent;

    /* 0 for the empty key, then for each first byte b: its 1-byte key, then its 256 two-byte
       starts — the byte order of keys */
    #define SSA_XBUCKETS (1 + 256 * 257)
    static inline uint32_t ssa_xbucket(const uint8_t* k, uint32_t kl) {
        if (kl == 0) return 0;
        if (kl == 1) return 1 + (uint32_t)k[0] * 257;
        return 2 + (uint32_t)k[0] * 257 + k[1];
    }

    static inline uint64_t ssa_be64(const uint8_t* p) {
        uint64_t x = 0;
        for (int i = 0; i < 8; i++) x = (x << 8) | p[i];
        return x;
    }

    static inline void ssa_xfill(ssa_xent* e, const uint8_t* arena, uint32_t ref) {
        uint32_t kl;
        const uint8_t* k = ssa_key_of(arena, ref, &kl);
        uint8_t b[16] = {0};
        size_t m = kl > 2 ? kl - 2 : 0;
        if (m > 16) m = 16;
        if (m) memcpy(b, k + 2, m);
        e->p0 = ssa_be64(b);
        e->p1 = ssa_be64(b + 8);
        e->ref = ref;
        e->bucket = ssa_xbucket(k, kl);
    }

    static inline int ssa_xlt(const ssa_xent* x, const ssa_xent* y, const uint8_t* arena) {
        if (x->bucket != y->bucket) return x->bucket < y->bucket;
        if (x->p0 != y->p0) return x->p0 < y->p0;
        if (x->p1 != y->p1) return x->p1 < y->p1;
        return ssa_cmp_refs(arena, x->ref, y->ref) < 0;
    }

    static void ssa_xsort(ssa_xent* v, size_t n, const uint8_t* arena) {
        while (n > 16) {
            size_t m = n / 2, left;
            ptrdiff_t i = -1, j = (ptrdiff_t)n;
            ssa_xent t, piv;
            if (ssa_xlt(&v[m], &v[0], arena)) { t = v[m]; v[m] = v[0]; v[0] = t; }
            if (ssa_xlt(&v[n - 1], &v[m], arena)) {
                t = v[n - 1]; v[n - 1] = v[m]; v[m] = t;
                if (ssa_xlt(&v[m], &v[0], arena)) { t = v[m]; v[m] = v[0]; v[0] = t; }
            }
            piv = v[m];
            for (;;) {
                do { i++; } while (ssa_xlt(&v[i], &piv, arena));
                do { j--; } while (ssa_xlt(&piv, &v[j], arena));
                if (i >= j) break;
                t = v[i]; v[i] = v[j]; v[j] = t;
            }
            left = (size_t)j + 1;
            if (left < n - left) { ssa_xsort(v, left, arena); v += left; n -= left; }
            else { ssa_xsort(v + left, n - left, arena); n = left; }
        }
        for (size_t a = 1; a < n; a++) {
            ssa_xent t = v[a];
            size_t b = a;
            while (b > 0 && ssa_xlt(&t, &v[b - 1], arena)) { v[b] = v[b - 1]; b--; }
            v[b] = t;
        }
    }

    static inline int ssa_clz64(uint64_t x) {  /* x != 0 */
    #if defined(__GNUC__)
        return __builtin_clzll(x);
    #else
        int n = 0;
        while (!(x & 0x8000000000000000ULL)) { x <<= 1; n++; }
        return n;
    #endif
    }

    /* Sort n entries whose keys share their first two bytes: most significant differing prefix
       byte first (a counting pass per byte, tmp holding n entries), insertion sort for a few,
       the comparison sort when the 16-byte prefixes all tie. */
    static void ssa_xradix(ssa_xent* v, ssa_xent* tmp, size_t n, const uint8_t* arena) {
        if (n <= 24) {
            for (size_t a = 1; a < n; a++) {
                ssa_xent t = v[a];
                size_t b = a;
                while (b > 0 && ssa_xlt(&t, &v[b - 1], arena)) { v[b] = v[b - 1]; b--; }
                v[b] = t;
            }
            return;
        }
        uint64_t d0 = 0, d1 = 0, x0 = v[0].p0, x1 = v[0].p1;
        size_t i;
        for (i = 1; i < n; i++) { d0 |= v[i].p0 ^ x0; d1 |= v[i].p1 ^ x1; }
        int word, shift;
        if (d0) { word = 0; shift = 56 - (ssa_clz64(d0) & ~7); }
        else if (d1) { word = 1; shift = 56 - (ssa_clz64(d1) & ~7); }
        else { ssa_xsort(v, n, arena); return; }
        size_t cnt[257];
        memset(cnt, 0, sizeof(cnt));
        for (i = 0; i < n; i++) cnt[(((word ? v[i].p1 : v[i].p0) >> shift) & 0xFF) + 1]++;
        for (i = 0; i < 256; i++) cnt[i + 1] += cnt[i];
        for (i = 0; i < n; i++) tmp[cnt[((word ? v[i].p1 : v[i].p0) >> shift) & 0xFF]++] = v[i];
        memcpy(v, tmp, n * sizeof(ssa_xent));
        size_t start = 0;  /* cnt[b] is now the end of byte value b's entries */
        for (i = 0; i < 256; i++) {
            if (cnt[i] - start > 1) ssa_xradix(v + start, tmp + start, cnt[i] - start, arena);
            start = cnt[i];
        }
    }
    """
    ctypedef struct ssa_xent:
        uint32_t ref
    enum:
        SSA_XBUCKETS
    uint32_t ssa_xbucket(const uint8_t* k, uint32_t kl) noexcept nogil
    void ssa_xfill(ssa_xent* e, const uint8_t* arena, uint32_t ref) noexcept nogil
    void ssa_xsort(ssa_xent* v, size_t n, const uint8_t* arena) noexcept nogil
    void ssa_xradix(ssa_xent* v, ssa_xent* tmp, size_t n, const uint8_t* arena) noexcept nogil
    size_t ssa_vsize(uint32_t x) noexcept nogil
    uint8_t* ssa_wvar(uint8_t* q, uint32_t x) noexcept nogil
