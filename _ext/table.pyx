# cython: language_level=3
"""A compact map of bytes → bytes | None, compiled: the same results, bytes and errors as
``statestore_async._ref.table`` (documented in ``statestore_async.engine.table``); only ``nbytes``
differs, being the real allocations here.

Layout of a ``Table``:

* the **arena**, one malloc'd block holding every record, 4-byte aligned: ``flags (u8: 1 tombstone,
  2 dead) | varint key length | varint value length (not for a tombstone) | key | value | padding``.
  A record is named by its *ref*, its offset in 4-byte units (u32: arenas up to 16 GiB). Overwrites
  and deletes leave dead records (garbage): a record of the same size is overwritten in place, the
  record at the end of the arena is taken back (when there is no order index), and the arena is
  compacted (rewritten, in key order when the order index exists) once the garbage outweighs the
  live records. It grows by doubling up to 1 MiB, then by 1/8. While any ``TableView``
  lives, nothing is overwritten, taken back or compacted: the arena only grows at its end, so the
  refs a view holds keep naming the records it froze.
* the **hash index**, open addressing with linear probing over u64 slots ``hash top 32 bits << 32 |
  ref + 1`` (0: empty); the home slot is ``(hash32 * capacity) >> 32``, so the capacity need not be a
  power of two and grows by ~1.2× (load 0.625..0.75; a small one doubles); deletes shift the run
  back (no tombstones).
  Rehashing reads only the slots (the hash bits are in them).
* the **order index**, made by the first ordered call: a sorted array of refs plus a pending array
  (a sorted prefix and an unsorted tail of refs written since). An ordered call sorts the tail into
  the prefix; the pending refs are merged into the sorted array (dropping dead refs) when they,
  with the refs killed since, pass 1/8 of it. Readers walk both arrays, skipping dead records.

The engine reads no request payload: the daemon's request routines (``_ext/payloads.pyx``) check
a payload whole, then hand its records over in place through ``set_records`` and ``find_records``
(``table.pxd``), so a bad batch changes nothing and nothing is copied on the way.
"""
cimport cython
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.list cimport PyList_GET_ITEM, PyList_New, PyList_SET_ITEM
from cpython.ref cimport Py_INCREF
from cpython.tuple cimport PyTuple_GET_ITEM, PyTuple_GET_SIZE
from libc.stdint cimport int64_t, intptr_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free, malloc, realloc
from libc.string cimport memcmp, memcpy, memmove

from _bytes cimport ssa_copy, ssa_eq, ssa_hash, ssa_prefetch  # with them, the C helpers they use (ssa_rd64, ssa_rd32x)
from _spans cimport check_spans, rd32 as _rd32, wr32 as _wr32

from statestore_async.errors import InterfaceError, KeyFormatError, StoreStateError

__all__ = [
    "Table",
    "TableView",
    "apply",
    "get_list",
    "load_records",
    "lookup_spans",
    "pack_keys",
    "put_items",
    "remove_keys",
]

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


cdef size_t MAX_LEN = 0xFFFFFFFE
# a slot holds ref + 1 in 32 bits: refs up to 0xFFFFFFFE units of 4 bytes
cdef size_t MAX_ARENA = (<size_t>0xFFFFFFFE) << 2
cdef uint64_t REF_MASK = 0xFFFFFFFF
cdef size_t MIN_GARBAGE = 1024
cdef int CHUNK_OVERHEAD = 11
DEF APPLY_CHUNK = 32  # records per prefetched chunk of ``apply``
_CHANGED = "Table changed during iteration"
_RELEASED = "the table view was released"


# --- argument checks (the messages of _ref.table) ------------------------------------
cdef object key_error(Py_ssize_t n, Py_ssize_t min_key):
    return KeyFormatError(f"a store key starts with its {min_key}-byte key group, got {n} bytes")


cdef bytes _key_arg(object key):
    if type(key) is bytes:
        return <bytes>key
    if isinstance(key, (bytearray, memoryview)):
        return bytes(key)
    raise KeyFormatError(f"keys are bytes, got {type(key).__name__}")


cdef bytes _length(bytes b):
    if <size_t>PyBytes_GET_SIZE(b) > MAX_LEN:
        raise InterfaceError(f"a key or value of {PyBytes_GET_SIZE(b)} bytes is too long")
    return b


cdef bytes _check_key(object key, Py_ssize_t min_key):
    if type(key) is not bytes:
        if isinstance(key, (bytearray, memoryview)):
            key = bytes(key)
        else:
            raise KeyFormatError(f"keys are bytes, got {type(key).__name__}")
    if PyBytes_GET_SIZE(key) < min_key:
        raise key_error(PyBytes_GET_SIZE(key), min_key)
    return <bytes>key


cdef bytes _check_value(object value):
    if type(value) is not bytes:
        if isinstance(value, (bytearray, memoryview)):
            return bytes(value)
        raise InterfaceError(f"values are bytes, got {type(value).__name__}")
    return <bytes>value


cdef object _value_arg(object value):
    if value is None:
        return None
    return _length(_check_value(value))


cdef tuple _pair(object item):
    try:
        k, v = item
    except (TypeError, ValueError):
        raise InterfaceError(f"pairs are (key, value) tuples, got {item!r:.80}") from None
    return (k, v)


cdef inline const uint8_t* _bp(bytes b) noexcept:
    return <const uint8_t*>PyBytes_AS_STRING(b)


cdef object _after_prefix(bytes prefix):
    """The first key after every key starting with ``prefix`` (None: there is none)."""
    cdef bytes p = prefix.rstrip(b"\xff")
    cdef Py_ssize_t n = PyBytes_GET_SIZE(p)
    if n == 0:
        return None
    return p[:n - 1] + bytes((p[n - 1] + 1,))


# --- the table --------------------------------------------------------------------------------------
@cython.final
cdef class Table:
    """key → value, or None for a tombstone entry; see ``statestore_async.engine.table``."""

    cdef uint8_t* arena
    cdef size_t arena_cap, used, garbage
    cdef uint64_t* slots
    cdef size_t cap, count, limit
    cdef size_t rbytes
    cdef bint has_order
    cdef bint order_held  # a batch write is under way: the order index merges once, at its end
    cdef uint32_t* srt
    cdef size_t n_srt, srt_cap
    cdef uint32_t* pend
    cdef size_t n_pend, pend_sorted, pend_cap
    cdef size_t order_dead, epoch, version
    cdef Py_ssize_t n_views
    cdef size_t view_bytes
    cdef size_t merges, compactions  # counts, for tests (``_layout``)

    def __dealloc__(self):
        free(self.arena)
        free(self.slots)
        free(self.srt)
        free(self.pend)

    # --- the hash index ---------------------------------------------------------------------------
    cdef inline Py_ssize_t _find(self, const uint8_t* k, uint32_t kl, uint64_t h) noexcept:
        """The slot of key k (hash h), or -1."""
        cdef size_t cap = self.cap
        if cap == 0:
            return -1
        cdef uint64_t h32 = h >> 32, s
        cdef size_t pos = <size_t>((h32 * cap) >> 32)
        cdef uint32_t rkl, rvl
        cdef const uint8_t* rk
        cdef uint64_t* slots = self.slots
        while True:
            s = slots[pos]
            if s == 0:
                return -1
            if (s >> 32) == h32:
                rk = ssa_rec(self.arena + (((s & REF_MASK) - 1) << 2), &rkl, &rvl)
                if rkl == kl and ssa_eq(rk, k, kl):
                    return pos
            pos += 1
            if pos == cap:
                pos = 0

    cdef int _rehash(self, size_t new_cap) except -1:
        cdef uint64_t* new = <uint64_t*>calloc(new_cap, sizeof(uint64_t))
        if new == NULL:
            raise MemoryError()
        cdef uint64_t* old = self.slots
        cdef size_t i, pos
        cdef uint64_t s
        for i in range(self.cap):
            s = old[i]
            if s:
                pos = <size_t>(((s >> 32) * new_cap) >> 32)
                while new[pos]:
                    pos += 1
                    if pos == new_cap:
                        pos = 0
                new[pos] = s
        free(old)
        self.slots = new
        self.cap = new_cap
        self.limit = new_cap * 3 // 4
        return 0

    cdef int _reserve_index(self, size_t need) except -1:
        """Room for ``need`` entries at a load of at most 0.75."""
        if need <= self.limit:
            return 0
        cdef size_t new_cap
        if need <= 3072:  # a small table doubles
            new_cap = self.cap * 2 if self.cap else 16
            while new_cap * 3 // 4 < need:
                new_cap *= 2
        else:
            new_cap = need * 8 // 5 + 1  # load 0.625 after growing
        if new_cap > 0xFFFFFFFF:
            raise MemoryError("a table holds at most 3 billion entries")
        return self._rehash(new_cap)

    cdef inline void _place(self, uint64_t h, uint32_t ref) noexcept:
        """Put ref (of a key known absent) into its first free slot; room was reserved."""
        cdef size_t cap = self.cap
        cdef size_t pos = <size_t>(((h >> 32) * cap) >> 32)
        while self.slots[pos]:
            pos += 1
            if pos == cap:
                pos = 0
        self.slots[pos] = (h & ~REF_MASK) | (<uint64_t>ref + 1)

    cdef void _remove_slot(self, size_t i) noexcept:
        """Empty slot i, shifting back the run after it (linear probing without tombstones)."""
        cdef size_t cap = self.cap, j = i, home
        cdef uint64_t s
        while True:
            j += 1
            if j == cap:
                j = 0
            s = self.slots[j]
            if s == 0:
                break
            home = <size_t>(((s >> 32) * cap) >> 32)
            if i <= j:
                if i < home <= j:
                    continue
            elif i < home or home <= j:
                continue
            self.slots[i] = s
            i = j
        self.slots[i] = 0

    # --- the arena --------------------------------------------------------------------------------
    cdef int _reserve_arena(self, size_t extra) except -1:
        cdef size_t need = self.used + extra, new
        if need <= self.arena_cap:
            return 0
        if need > MAX_ARENA:
            raise MemoryError("a table's arena holds at most 16 GiB")
        if self.arena_cap < (1 << 20):
            new = self.arena_cap * 2
            if new < 256:
                new = 256
        else:
            new = self.arena_cap + self.arena_cap // 8
        if new < need:
            new = need
        new = (new + 63) & ~(<size_t>63)
        if new > MAX_ARENA:
            new = MAX_ARENA
        cdef uint8_t* p = <uint8_t*>realloc(self.arena, new)
        if p == NULL:
            raise MemoryError()
        self.arena = p
        self.arena_cap = new
        return 0

    cdef int _trim_arena(self) except -1:
        """Give back an arena's unused tail when it is more than an eighth of it."""
        cdef size_t slack = self.arena_cap - self.used, new
        if self.used == 0 or slack <= 4096 or slack <= self.arena_cap // 8:
            return 0
        new = (self.used + 63) & ~(<size_t>63)
        cdef uint8_t* p = <uint8_t*>realloc(self.arena, new)
        if p != NULL:
            self.arena = p
            self.arena_cap = new
        return 0

    cdef uint32_t _append(self, const uint8_t* k, uint32_t kl, const uint8_t* v, uint32_t vl,
                          bint tomb) except? 0xFFFFFFFF:
        """Write a record at the end of the arena (k and v must not point into it); its ref."""
        cdef size_t size = ssa_rsize(kl, vl, tomb)
        self._reserve_arena(size)
        cdef size_t off = self.used
        ssa_write(self.arena + off, size, k, kl, v, vl, tomb)
        self.used = off + size
        return <uint32_t>(off >> 2)

    cdef void _kill(self, uint32_t ref) noexcept:
        """The record at ref is no longer an entry's: garbage (or taken back at the arena's end)."""
        cdef uint8_t* p = self.arena + (<size_t>ref << 2)
        cdef size_t size = ssa_rsize_at(p)
        if not self.has_order and self.n_views == 0 and (<size_t>ref << 2) + size == self.used:
            self.used -= size
            return
        p[0] |= SSA_DEAD
        self.garbage += size
        if self.has_order:
            self.order_dead += 1

    # --- entries ----------------------------------------------------------------------------------
    cdef int _add(self, const uint8_t* k, uint32_t kl, uint64_t h, const uint8_t* v, uint32_t vl,
                  bint tomb) except -1:
        """A new entry for a key known absent."""
        if self.count >= self.limit:
            self._reserve_index(self.count + 1)
        cdef uint32_t ref = self._append(k, kl, v, vl, tomb)
        self._place(h, ref)
        self.count += 1
        self.rbytes += kl + vl
        if self.has_order:
            self._pend_push(ref)
        return 0

    cdef int _replace(self, size_t pos, const uint8_t* k, uint32_t kl, const uint8_t* v, uint32_t vl,
                      bint tomb) except -1:
        """Set the entry in slot pos to v (or a tombstone)."""
        cdef uint64_t s = self.slots[pos]
        cdef uint32_t ref = <uint32_t>((s & REF_MASK) - 1), okl, ovl
        cdef uint8_t* p = self.arena + (<size_t>ref << 2)
        cdef const uint8_t* rk = ssa_rec(p, &okl, &ovl)
        cdef size_t osize = (<size_t>(rk - p) + okl + ovl + 3) & ~(<size_t>3)
        cdef size_t nsize = ssa_rsize(kl, vl, tomb)
        self.rbytes = self.rbytes - ovl + vl
        if nsize == osize and self.n_views == 0:
            ssa_write(p, nsize, k, kl, v, vl, tomb)
            return 0
        self._kill(ref)
        ref = self._append(k, kl, v, vl, tomb)
        self.slots[pos] = (s & ~REF_MASK) | (<uint64_t>ref + 1)
        if self.has_order:
            self._pend_push(ref)
        return 0

    cdef inline int _set(self, const uint8_t* k, uint32_t kl, uint64_t h, const uint8_t* v, uint32_t vl,
                         bint tomb) except -1:
        cdef Py_ssize_t pos = self._find(k, kl, h)
        if pos >= 0:
            return self._replace(pos, k, kl, v, vl, tomb)
        return self._add(k, kl, h, v, vl, tomb)

    cdef int _delete_at(self, size_t pos) except -1:
        cdef uint32_t ref = <uint32_t>((self.slots[pos] & REF_MASK) - 1), kl, vl
        ssa_rec(self.arena + (<size_t>ref << 2), &kl, &vl)
        self.rbytes -= kl + vl
        self._remove_slot(pos)
        self.count -= 1
        self._kill(ref)
        if self.has_order:
            self._order_check()
        return 0

    cdef inline int _lookup(self, const uint8_t* k, uint32_t kl, uint64_t h, Found* out) noexcept:
        """1 and the entry's value in out when the table has key k, else 0."""
        cdef Py_ssize_t pos = self._find(k, kl, h)
        if pos < 0:
            return 0
        cdef const uint8_t* p = self.arena + (((self.slots[pos] & REF_MASK) - 1) << 2)
        cdef uint32_t rkl
        cdef const uint8_t* rk = ssa_rec(p, &rkl, &out.vl)
        out.val = rk + rkl
        out.none = p[0] & SSA_TOMB
        return 1

    cdef int _tidy(self) except -1:
        """After a write: reclaim garbage when it outweighs the live records (no view alive)."""
        if self.n_views:
            return 0
        if self.count == 0:
            if self.arena_cap or self.cap or self.srt_cap or self.pend_cap:
                free(self.arena)
                free(self.slots)
                free(self.srt)
                free(self.pend)
                self.arena = NULL
                self.slots = NULL
                self.srt = self.pend = NULL
                self.arena_cap = self.used = self.garbage = 0
                self.cap = self.limit = 0
                self.n_srt = self.srt_cap = self.n_pend = self.pend_sorted = self.pend_cap = 0
                self.order_dead = 0
                self.epoch += 1
            return 0
        if self.garbage > MIN_GARBAGE and self.garbage > self.used - self.garbage:
            self._compact()
        return 0

    cdef int _compact(self) except -1:
        """Rewrite the arena with the live records only (in key order when the order index exists)."""
        if self.has_order:
            self._merge_all()
        cdef size_t live = self.used - self.garbage
        cdef size_t new_cap = (live + live // 8 + 64 + 63) & ~(<size_t>63)
        cdef uint8_t* na = <uint8_t*>malloc(new_cap)
        if na == NULL:
            raise MemoryError()
        cdef uint8_t* old = self.arena
        cdef size_t pos = 0, off = 0, size, i
        cdef uint32_t fwd, ref
        cdef uint8_t* p
        if self.has_order:
            for i in range(self.n_srt):
                p = old + (<size_t>self.srt[i] << 2)
                size = ssa_rsize_at(p)
                memcpy(na + pos, p, size)
                fwd = <uint32_t>(pos >> 2)
                memcpy(p, &fwd, 4)  # the old record now names its new place
                self.srt[i] = fwd
                pos += size
        else:
            while off < self.used:
                p = old + off
                size = ssa_rsize_at(p)
                if not (p[0] & SSA_DEAD):
                    memcpy(na + pos, p, size)
                    fwd = <uint32_t>(pos >> 2)
                    memcpy(p, &fwd, 4)
                    pos += size
                off += size
        if pos != live:
            free(na)
            raise SystemError(f"table compaction found {pos} live bytes, expected {live}")
        cdef uint64_t s
        for i in range(self.cap):
            s = self.slots[i]
            if s:
                memcpy(&ref, old + (((s & REF_MASK) - 1) << 2), 4)
                self.slots[i] = (s & ~REF_MASK) | (<uint64_t>ref + 1)
        free(old)
        self.arena = na
        self.arena_cap = new_cap
        self.used = live
        self.garbage = 0
        self.epoch += 1
        self.compactions += 1
        if self.cap > 64 and self.count * 16 < self.cap * 3:  # load under 0.19: shrink the index
            self._rehash(self.count * 8 // 5 + 16)
        return 0

    # --- the order index --------------------------------------------------------------------------
    cdef int _pend_push(self, uint32_t ref) except -1:
        cdef size_t new
        cdef uint32_t* p
        if self.n_pend == self.pend_cap:
            new = self.pend_cap * 2 if self.pend_cap else 16
            p = <uint32_t*>realloc(self.pend, new * sizeof(uint32_t))
            if p == NULL:
                raise MemoryError()
            self.pend = p
            self.pend_cap = new
        self.pend[self.n_pend] = ref
        self.n_pend += 1
        return self._order_check()

    cdef inline int _order_check(self) except -1:
        if self.n_pend + self.order_dead > (self.n_srt >> 3) + 64 and not self.order_held:
            self._merge_all()
        return 0

    cdef inline bint _hold_order(self) noexcept:
        """A batch write starts: hold the order index's merges until ``_release_order`` (a merge
        reads every sorted record, so a batch of many new or removed keys merged once per eighth of
        the table). True when this call took the hold (the caller then releases it)."""
        if self.order_held:
            return False
        self.order_held = True
        return True

    cdef int _release_order(self, bint held) except -1:
        """The batch write ended (or raised): merge once if what it left pending calls for it."""
        if held:
            self.order_held = False
            self._order_check()
        return 0

    cdef int _build_order(self) except -1:
        """The order index from scratch: every live record, sorted."""
        cdef uint32_t* out = self._sorted_refs()
        free(self.srt)
        self.srt = out
        self.n_srt = self.count
        self.srt_cap = self.count + 1
        self.n_pend = self.pend_sorted = 0
        self.order_dead = 0
        self.has_order = True
        self.epoch += 1
        return 0

    cdef uint32_t* _sorted_refs(self) except NULL:
        """A new malloc'd array of the refs of every live record (``count`` of them), sorted (the
        export sort: a counting pass on the key group, then 16-byte prefixes)."""
        return _export_refs(self)

    cdef int _fold(self) except -1:
        """Sort the pending tail into the pending sorted prefix (dropping its dead refs)."""
        cdef size_t P = self.pend_sorted, n = self.n_pend, t = 0, x
        if n == P:
            return 0
        cdef ssa_xent* tmp = <ssa_xent*>malloc((n - P) * sizeof(ssa_xent))
        if tmp == NULL:
            raise MemoryError()
        cdef const uint8_t* arena = self.arena
        cdef uint32_t* pend = self.pend
        cdef uint32_t r
        for x in range(P, n):
            r = pend[x]
            if not ssa_dead(arena, r):
                ssa_xfill(&tmp[t], arena, r)
                t += 1
        ssa_xsort(tmp, t, arena)
        cdef size_t kept = t
        # merge from the back: each tail ref goes after the prefix refs whose keys are <= its key
        cdef size_t hi = P, k = P + t, lo, h2, mid
        while t > 0:
            t -= 1
            r = tmp[t].ref
            lo = 0
            h2 = hi
            while lo < h2:
                mid = (lo + h2) >> 1
                if ssa_cmp_refs(arena, pend[mid], r) <= 0:
                    lo = mid + 1
                else:
                    h2 = mid
            if hi > lo:
                memmove(pend + k - (hi - lo), pend + lo, (hi - lo) * sizeof(uint32_t))
                k -= hi - lo
            k -= 1
            pend[k] = r
            hi = lo
        free(tmp)
        self.n_pend = self.pend_sorted = P + kept
        self.epoch += 1
        return 0

    cdef int _merge_all(self) except -1:
        """Merge the pending refs into the sorted array, dropping dead refs."""
        self._fold()
        cdef size_t n = self.count, o = 0, i = 0, j = 0
        cdef uint32_t* out = <uint32_t*>malloc((n + 1) * sizeof(uint32_t))
        if out == NULL:
            raise MemoryError()
        cdef const uint8_t* arena = self.arena
        cdef uint32_t* srt = self.srt
        cdef uint32_t* pend = self.pend
        cdef size_t ns = self.n_srt, np = self.n_pend
        cdef uint32_t r
        # every record is read (is it dead? which key comes first?) in key order, not in the
        # arena's: each array's records are prefetched well ahead
        while True:
            if i + 32 < ns:
                ssa_prefetch(arena + (<size_t>srt[i + 32] << 2))
            if j + 32 < np:
                ssa_prefetch(arena + (<size_t>pend[j + 32] << 2))
            while i < ns and ssa_dead(arena, srt[i]):
                i += 1
            while j < np and ssa_dead(arena, pend[j]):
                j += 1
            if i < ns:
                if j < np and ssa_cmp_refs(arena, pend[j], srt[i]) < 0:
                    r = pend[j]
                    j += 1
                else:
                    r = srt[i]
                    i += 1
            elif j < np:
                r = pend[j]
                j += 1
            else:
                break
            if o == n:
                free(out)
                raise SystemError("table order index: more live refs than entries")
            out[o] = r
            o += 1
        if o != n:
            free(out)
            raise SystemError(f"table order index: {o} live refs for {n} entries")
        free(self.srt)
        self.srt = out
        self.n_srt = n
        self.srt_cap = n + 1
        self.n_pend = self.pend_sorted = 0
        if self.pend_cap > 1024:
            free(self.pend)
            self.pend = NULL
            self.pend_cap = 0
        self.order_dead = 0
        self.epoch += 1
        self.merges += 1
        return 0

    cdef int _ordered(self) except -1:
        """Make the order index readable: built, its pending refs all sorted."""
        if not self.has_order:
            return self._build_order()
        return self._fold()

    cdef size_t _lower(self, const uint32_t* refs, size_t n, const uint8_t* k, size_t kl) noexcept:
        """The first index of refs (sorted by key) whose key is >= k."""
        cdef size_t lo = 0, hi = n, mid
        while lo < hi:
            mid = (lo + hi) >> 1
            if ssa_cmp_ref_key(self.arena, refs[mid], k, kl) < 0:
                lo = mid + 1
            else:
                hi = mid
        return lo

    cdef size_t _upper(self, const uint32_t* refs, size_t n, const uint8_t* k, size_t kl) noexcept:
        """The first index of refs (sorted by key) whose key is > k."""
        cdef size_t lo = 0, hi = n, mid
        while lo < hi:
            mid = (lo + hi) >> 1
            if ssa_cmp_ref_key(self.arena, refs[mid], k, kl) <= 0:
                lo = mid + 1
            else:
                hi = mid
        return lo

    cdef inline uint32_t _next_ref(self, size_t* i, size_t* j) noexcept:
        """The next live ref in key order from the cursor (i in the sorted array, j in the pending
        one), plus one; 0 at the end."""
        cdef const uint8_t* arena = self.arena
        cdef size_t a = i[0], b = j[0], ns = self.n_srt, np = self.n_pend
        cdef uint32_t r
        while a < ns and ssa_dead(arena, self.srt[a]):
            a += 1
        while b < np and ssa_dead(arena, self.pend[b]):
            b += 1
        if a < ns and (b >= np or ssa_cmp_refs(arena, self.pend[b], self.srt[a]) > 0):
            r = self.srt[a]
            a += 1
        elif b < np:
            r = self.pend[b]
            b += 1
        else:
            i[0] = a
            j[0] = b
            return 0
        i[0] = a
        j[0] = b
        return r + 1

    cdef tuple _pair_at(self, uint32_t ref):
        cdef const uint8_t* p = self.arena + (<size_t>ref << 2)
        cdef uint32_t kl, vl
        cdef const uint8_t* k = ssa_rec(p, &kl, &vl)
        key = PyBytes_FromStringAndSize(<const char*>k, kl)
        if p[0] & SSA_TOMB:
            return (key, None)
        return (key, PyBytes_FromStringAndSize(<const char*>(k + kl), vl))

    cdef list _collect(self, bytes start, object stop, bint keys_only):
        cdef list out = []
        self._collect_into(out, start, stop, keys_only)
        return out

    cdef int _collect_into(self, list out, bytes start, object stop, bint keys_only) except -1:
        """Append the (key, value | None) pairs (``keys_only``: the keys) of start <= key < stop."""
        self._ordered()
        cdef const uint8_t* sk = _bp(start)
        cdef size_t skl = PyBytes_GET_SIZE(start)
        cdef size_t i = self._lower(self.srt, self.n_srt, sk, skl)
        cdef size_t j = self._lower(self.pend, self.n_pend, sk, skl)
        cdef bint bounded = stop is not None
        cdef const uint8_t* ek = _bp(<bytes>stop) if bounded else NULL
        cdef size_t ekl = PyBytes_GET_SIZE(<bytes>stop) if bounded else 0
        cdef uint32_t r, kl
        cdef const uint8_t* k
        while True:
            r = self._next_ref(&i, &j)
            if r == 0:
                break
            r -= 1
            if bounded:
                k = ssa_key_of(self.arena, r, &kl)
                if ssa_cmp(k, kl, ek, ekl) >= 0:
                    break
            if keys_only:
                k = ssa_key_of(self.arena, r, &kl)
                out.append(PyBytes_FromStringAndSize(<const char*>k, kl))
            else:
                out.append(self._pair_at(r))
        return 0

    # --- Python API -------------------------------------------------------------------------------
    def __len__(self):
        return self.count

    def __contains__(self, key):
        cdef bytes k = _key_arg(key)
        cdef uint32_t kl = <uint32_t>PyBytes_GET_SIZE(k)
        if <size_t>PyBytes_GET_SIZE(k) > MAX_LEN:
            return False
        return self._find(_bp(k), kl, ssa_hash(_bp(k), kl)) >= 0

    def get(self, key):
        """The value of ``key``; None when absent or a tombstone."""
        cdef bytes k = _key_arg(key)
        if <size_t>PyBytes_GET_SIZE(k) > MAX_LEN:
            return None
        cdef uint32_t kl = <uint32_t>PyBytes_GET_SIZE(k)
        cdef Found f
        if not self._lookup(_bp(k), kl, ssa_hash(_bp(k), kl), &f) or f.none:
            return None
        return PyBytes_FromStringAndSize(<const char*>f.val, f.vl)

    def put(self, key, value):
        """Set ``key`` to ``value`` (None: a tombstone entry)."""
        cdef bytes k = _length(_key_arg(key))
        v = _value_arg(value)
        cdef uint32_t kl = <uint32_t>PyBytes_GET_SIZE(k)
        if v is None:
            self._set(_bp(k), kl, ssa_hash(_bp(k), kl), NULL, 0, True)
        else:
            self._set(_bp(k), kl, ssa_hash(_bp(k), kl), _bp(<bytes>v), <uint32_t>PyBytes_GET_SIZE(v), False)
        self.version += 1
        self._tidy()

    def delete(self, key):
        """Remove the entry of ``key`` (tombstone or not); whether there was one."""
        cdef bytes k = _key_arg(key)
        self.version += 1
        if <size_t>PyBytes_GET_SIZE(k) > MAX_LEN:
            return False
        cdef uint32_t kl = <uint32_t>PyBytes_GET_SIZE(k)
        cdef Py_ssize_t pos = self._find(_bp(k), kl, ssa_hash(_bp(k), kl))
        if pos < 0:
            return False
        self._delete_at(pos)
        self._tidy()
        return True

    @property
    def record_bytes(self):
        """Sum of len(key) + len(value or b"") over the entries."""
        return self.rbytes

    @property
    def nbytes(self):
        """Bytes allocated: arena, hash index, order index and the sorted refs of live views."""
        return (self.arena_cap + self.cap * sizeof(uint64_t) + (self.srt_cap + self.pend_cap) * sizeof(uint32_t)
                + self.view_bytes)

    def items(self, start=b"", stop=None):
        """(key, value | None) with start <= key < stop, in key order. Changing the table while
        iterating makes the next step raise ``RuntimeError``."""
        cdef bytes lo = _key_arg(start)
        hi = None if stop is None else _key_arg(stop)
        self._ordered()
        cdef _TableItems it = _TableItems.__new__(_TableItems)
        it.table = self
        it.version = self.version
        it.stop = hi
        it.last = lo
        it.after = False
        it.epoch = self.epoch
        it.i = self._lower(self.srt, self.n_srt, _bp(lo), PyBytes_GET_SIZE(lo))
        it.j = self._lower(self.pend, self.n_pend, _bp(lo), PyBytes_GET_SIZE(lo))
        return it

    def scan(self, prefix):
        """(key, value | None) for every key starting with ``prefix``, in key order."""
        cdef bytes p = _key_arg(prefix)
        return self._collect(p, _after_prefix(p), False)

    def ranges(self, ranges):
        """(key, value | None) with start <= key < stop for each (start, stop) of ``ranges``
        (ascending and disjoint; stop None: no bound), in key order: one list, one call (a task's
        due timers are one range per key group and kind)."""
        cdef list out = []
        for start, stop in ranges:
            self._collect_into(out, _key_arg(start), None if stop is None else _key_arg(stop), False)
        return out

    def keys(self):
        """Every key, in key order."""
        return self._collect(b"", None, True)

    def freeze(self):
        """A view of the table as it is now; later changes of the table do not show in it.

        A table that keeps an order index copies it; one that keeps none sorts its records for
        the view alone (a snapshot every few commits does not make the table keep an index)."""
        cdef size_t n
        cdef uint32_t* refs
        if self.has_order:
            if self.n_pend or self.order_dead:
                self._merge_all()
            n = self.n_srt
            refs = <uint32_t*>malloc((n + 1) * sizeof(uint32_t))
            if refs == NULL:
                raise MemoryError()
            if n:
                memcpy(refs, self.srt, n * sizeof(uint32_t))
        else:
            n = self.count
            refs = self._sorted_refs()
        cdef TableView view = TableView.__new__(TableView)
        view.table = self
        view.refs = refs
        view.n = n
        self.n_views += 1
        self.view_bytes += (n + 1) * sizeof(uint32_t)
        return view

    def __repr__(self):
        return f"<Table of {self.count} entries>"

    def _layout(self):
        """The internals, for tests and debugging (the compiled twin only)."""
        return {
            "arena_cap": self.arena_cap, "arena_used": self.used, "garbage": self.garbage,
            "slots": self.cap, "entries": self.count, "order_index": bool(self.has_order),
            "sorted": self.n_srt, "pending": self.n_pend, "pending_sorted": self.pend_sorted,
            "order_dead": self.order_dead, "views": self.n_views, "merges": self.merges,
            "compactions": self.compactions,
        }


@cython.final
@cython.no_gc
cdef class _TableItems:
    """Iterator of ``Table.items``; it follows the order index even when another ordered call
    reorganizes it (seeking again after the last key it gave)."""

    cdef Table table
    cdef size_t version, epoch, i, j
    cdef object stop
    cdef bytes last  # the last key given (or the start key while after is False)
    cdef bint after, done

    def __iter__(self):
        return self

    def __next__(self):
        if self.done:
            raise StopIteration
        cdef Table t = self.table
        if t.version != self.version:
            self.done = True
            raise RuntimeError(_CHANGED)
        cdef size_t kl0
        if t.epoch != self.epoch:
            t._ordered()
            kl0 = PyBytes_GET_SIZE(self.last)
            if self.after:
                self.i = t._upper(t.srt, t.n_srt, _bp(self.last), kl0)
                self.j = t._upper(t.pend, t.n_pend, _bp(self.last), kl0)
            else:
                self.i = t._lower(t.srt, t.n_srt, _bp(self.last), kl0)
                self.j = t._lower(t.pend, t.n_pend, _bp(self.last), kl0)
            self.epoch = t.epoch
        cdef uint32_t r = t._next_ref(&self.i, &self.j), kl
        if r == 0:
            self.done = True
            raise StopIteration
        r -= 1
        cdef const uint8_t* k
        if self.stop is not None:
            k = ssa_key_of(t.arena, r, &kl)
            if ssa_cmp(k, kl, _bp(<bytes>self.stop), PyBytes_GET_SIZE(<bytes>self.stop)) >= 0:
                self.done = True
                raise StopIteration
        pair = t._pair_at(r)
        self.last = <bytes>pair[0]
        self.after = True
        return pair


# --- frozen views -----------------------------------------------------------------------------------
@cython.final
@cython.no_gc
cdef class TableView:
    """The records of a table at ``Table.freeze()`` time, in key order (the refs of its records; the
    table's arena stays append-only while the view lives)."""

    cdef Table table
    cdef uint32_t* refs
    cdef size_t n
    cdef bint released

    def __dealloc__(self):
        self._release()

    cdef void _release(self) noexcept:
        if self.released:
            return
        self.released = True
        free(self.refs)
        self.refs = NULL
        cdef Table t = self.table
        if t is not None:
            t.n_views -= 1
            t.view_bytes -= (self.n + 1) * sizeof(uint32_t)
        self.table = None

    cdef int _live(self) except -1:
        if self.released:
            raise StoreStateError(_RELEASED)
        return 0

    def __len__(self):
        self._live()
        return self.n

    def get(self, key):
        """The frozen value of ``key`` (None when it was absent or a tombstone)."""
        self._live()
        cdef bytes k = _key_arg(key)
        cdef Table t = self.table
        cdef size_t i = t._lower(self.refs, self.n, _bp(k), PyBytes_GET_SIZE(k))
        if i >= self.n:
            return None
        cdef const uint8_t* p = t.arena + (<size_t>self.refs[i] << 2)
        cdef uint32_t kl, vl
        cdef const uint8_t* rk = ssa_rec(p, &kl, &vl)
        if ssa_cmp(rk, kl, _bp(k), PyBytes_GET_SIZE(k)) != 0 or p[0] & SSA_TOMB:
            return None
        return PyBytes_FromStringAndSize(<const char*>(rk + kl), vl)

    def items(self, start=b"", stop=None):
        """The frozen (key, value | None) with start <= key < stop, in key order."""
        self._live()
        cdef bytes lo = _key_arg(start)
        hi = None if stop is None else _key_arg(stop)
        cdef _ViewItems it = _ViewItems.__new__(_ViewItems)
        it.view = self
        it.stop = hi
        it.i = self.table._lower(self.refs, self.n, _bp(lo), PyBytes_GET_SIZE(lo))
        return it

    def chunk(self, pos, max_bytes):
        """The records from index ``pos`` in key order while the sum of len(key) + len(value) + 11
        stays within ``max_bytes`` (at least one when any is left), and the next index; an empty
        list at the end."""
        self._live()
        if type(pos) is not int or pos < 0:
            raise InterfaceError(f"a chunk starts at an index >= 0, got {pos!r}")
        if type(max_bytes) is not int:
            raise InterfaceError(f"max_bytes is an int, got {type(max_bytes).__name__}")
        if pos >= self.n:
            return [], pos
        cdef long long budget = max_bytes if -(1 << 62) < max_bytes < (1 << 62) else (
            (1 << 62) if max_bytes > 0 else -(1 << 62))
        cdef size_t i = pos
        cdef long long size = 0, s
        cdef list out = []
        cdef Table t = self.table
        cdef const uint8_t* p
        cdef uint32_t kl, vl
        while i < self.n:
            p = t.arena + (<size_t>self.refs[i] << 2)
            ssa_rec(p, &kl, &vl)
            s = <long long>kl + vl + CHUNK_OVERHEAD
            if out and size + s > budget:
                break
            out.append(t._pair_at(self.refs[i]))
            size += s
            i += 1
        return out, i

    def chunk_packed(self, pos, max_bytes):
        """See ``statestore_async._ref.table.TableView.chunk_packed``: the records from index
        ``pos`` as one ``blockcodec`` payload, written straight from the arena."""
        self._live()
        if type(pos) is not int or pos < 0:
            raise InterfaceError(f"a chunk starts at an index >= 0, got {pos!r}")
        if type(max_bytes) is not int:
            raise InterfaceError(f"max_bytes is an int, got {type(max_bytes).__name__}")
        if pos >= self.n:
            return b"", pos, 0, 0
        cdef long long budget = max_bytes if -(1 << 62) < max_bytes < (1 << 62) else (
            (1 << 62) if max_bytes > 0 else -(1 << 62))
        cdef Table t = self.table
        cdef const uint8_t* arena = t.arena
        cdef const uint32_t* refs = self.refs
        cdef size_t first = pos, i = first, n = self.n, j
        cdef long long size = 0, s
        cdef const uint8_t* p
        cdef const uint8_t* k
        cdef uint32_t kl, vl, kg, lo = 0xFFFF, hi = 0
        # Two passes over the records in key order (their arena places prefetched well ahead: the
        # records lie in write order), their sizes, then the payload, each record as a block holds
        # it: kind (0 put, 1 tombstone), varint key length, key, and for a put varint value length,
        # value
        while i < n:
            if i + 64 < n:
                ssa_prefetch(arena + (<size_t>refs[i + 64] << 2))
            p = arena + (<size_t>refs[i] << 2)
            ssa_rec(p, &kl, &vl)
            s = 1 + <long long>ssa_vsize(kl) + kl
            if not (p[0] & SSA_TOMB):
                s += <long long>ssa_vsize(vl) + vl
            if i > first and size + s > budget:
                break
            size += s
            i += 1
        cdef bytes out = PyBytes_FromStringAndSize(NULL, <Py_ssize_t>size)
        cdef uint8_t* o = <uint8_t*>PyBytes_AS_STRING(out)
        for j in range(first, i):
            if j + 64 < i:
                ssa_prefetch(arena + (<size_t>refs[j + 64] << 2))
            p = arena + (<size_t>refs[j] << 2)
            k = ssa_rec(p, &kl, &vl)
            kg = ((<uint32_t>k[0]) << 8) | k[1] if kl >= 2 else 0
            if kg < lo:
                lo = kg
            if kg > hi:
                hi = kg
            if p[0] & SSA_TOMB:
                o[0] = 1
                o = ssa_wvar(o + 1, kl)
                memcpy(o, k, kl)
                o += kl
            else:
                o[0] = 0
                o = ssa_wvar(o + 1, kl)
                memcpy(o, k, kl)
                o = ssa_wvar(o + kl, vl)
                memcpy(o, k + kl, vl)
                o += vl
        return out, i, lo, hi

    def release(self):
        """Let go of the frozen records (idempotent): the table may reclaim garbage again."""
        self._release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._release()


@cython.final
@cython.no_gc
cdef class _ViewItems:
    cdef TableView view
    cdef size_t i
    cdef object stop
    cdef bint done

    def __iter__(self):
        return self

    def __next__(self):
        if self.done:
            raise StopIteration
        cdef TableView v = self.view
        if v.released:
            self.done = True
            raise StoreStateError(_RELEASED)
        if self.i >= v.n:
            self.done = True
            raise StopIteration
        cdef uint32_t ref = v.refs[self.i], kl
        cdef Table t = v.table
        cdef const uint8_t* k
        if self.stop is not None:
            k = ssa_key_of(t.arena, ref, &kl)
            if ssa_cmp(k, kl, _bp(<bytes>self.stop), PyBytes_GET_SIZE(<bytes>self.stop)) >= 0:
                self.done = True
                raise StopIteration
        self.i += 1
        return t._pair_at(ref)


# --- batch routines ---------------------------------------------------------------------------------
cdef inline Py_ssize_t _hash_ahead(Table table, const uint8_t* buf, Py_ssize_t pos, uint32_t m, bint pairs,
                                   Py_ssize_t* kpos, uint64_t* hs) noexcept:
    """The next ``m`` entries of a checked list payload (``pairs``: of a pairs payload) from ``pos``:
    each key's position and hash, its slot in ``table`` prefetched (the keys of a chunk first, the
    work after: about one memory latency per chunk rather than one per key); the position after."""
    cdef size_t cap = table.cap
    cdef uint32_t j, kl
    for j in range(m):
        kl = _rd32(buf + pos)
        kpos[j] = pos
        hs[j] = ssa_hash(buf + pos + 4, kl)
        if cap:
            ssa_prefetch(table.slots + (((hs[j] >> 32) * cap) >> 32))
        pos += 4 + kl
        if pairs:
            pos += 4 + _rd32(buf + pos)
    return pos


cdef int _set_entries(Table table, const uint8_t* buf, Py_ssize_t pos, uint32_t n, bint pairs) except -1:
    """Set the ``n`` keys of a checked payload from ``pos``: to their values (``pairs``) or to
    tombstones, ``APPLY_CHUNK`` at a time (``_hash_ahead``)."""
    cdef Py_ssize_t kpos[APPLY_CHUNK]
    cdef uint64_t hs[APPLY_CHUNK]
    cdef uint32_t i = 0, j, m, kl
    cdef const uint8_t* k
    while i < n:
        m = n - i if n - i < APPLY_CHUNK else APPLY_CHUNK
        pos = _hash_ahead(table, buf, pos, m, pairs, kpos, hs)
        for j in range(m):
            kl = _rd32(buf + kpos[j])
            k = buf + kpos[j] + 4
            if pairs:
                table._set(k, kl, hs[j], k + kl + 4, _rd32(k + kl), False)
            else:
                table._set(k, kl, hs[j], NULL, 0, True)
        i += m
    return 0


cdef int _write_entries(Table table, const uint8_t* buf, Py_ssize_t first, uint32_t n, bint pairs) except -1:
    """``_set_entries`` as one batch write: the order index merges at most once, at its end."""
    cdef bint held = table._hold_order()
    try:
        _set_entries(table, buf, first, n, pairs)
        table.version += 1
        table._tidy()  # a compaction merges the order index itself
    finally:
        table._release_order(held)
    return 0


cdef int set_records(object table, const uint8_t* buf, Py_ssize_t first, Py_ssize_t nbytes, uint32_t n,
                     bint pairs) except -1:
    """See ``table.pxd``."""
    cdef Table t = <Table?>table
    if pairs:
        if n:
            # room for the batch at once: a version's changes mostly add keys, and a PUT_MANY of more
            # than ``max_batch`` pairs arrives in several frames; growing entry by entry would rehash
            # the index at every 20% of growth (~6 times for a 316k-pair PUT_MANY in four frames)
            t._reserve_index(t.count + n)
            if t.count == 0:
                t._reserve_arena(<size_t>nbytes)  # a record takes no more room than its pair
    else:
        # removals are mostly of keys the table lacks (an overlay's tombstones of committed keys)
        t._reserve_index(t.count + n)
    _write_entries(t, buf, first, n, pairs)
    return 0


cdef list _checked_pairs(list seq, Py_ssize_t min_key):
    cdef list out = []
    for item in seq:
        k, v = _pair(item)
        out.append((_length(_check_key(k, min_key)), _length(_check_value(v))))
    return out


def put_items(Table table not None, items, Py_ssize_t min_key):
    """See ``statestore_async._ref.table.put_items``."""
    cdef list seq = list(items)
    cdef Py_ssize_t i, n = len(seq)
    cdef object item
    for i in range(n):
        item = seq[i]
        if not (type(item) is tuple and PyTuple_GET_SIZE(item) == 2
                and type((<tuple>item)[0]) is bytes and type((<tuple>item)[1]) is bytes
                and PyBytes_GET_SIZE((<tuple>item)[0]) >= min_key
                and <size_t>PyBytes_GET_SIZE((<tuple>item)[0]) <= MAX_LEN
                and <size_t>PyBytes_GET_SIZE((<tuple>item)[1]) <= MAX_LEN):
            seq = _checked_pairs(seq, min_key)
            break
    cdef bytes k, v
    cdef bint held = table._hold_order()
    try:
        for i in range(n):
            k = <bytes>PyTuple_GET_ITEM(<tuple>PyList_GET_ITEM(seq, i), 0)
            v = <bytes>PyTuple_GET_ITEM(<tuple>PyList_GET_ITEM(seq, i), 1)
            table._set(_bp(k), <uint32_t>PyBytes_GET_SIZE(k), ssa_hash(_bp(k), PyBytes_GET_SIZE(k)),
                       _bp(v), <uint32_t>PyBytes_GET_SIZE(v), False)
        table.version += 1
        table._tidy()  # a compaction merges the order index itself
    finally:
        table._release_order(held)
    return n


def remove_keys(Table table not None, keys, Py_ssize_t min_key):
    """See ``statestore_async._ref.table.remove_keys``."""
    cdef list seq = list(keys)
    cdef Py_ssize_t i, n = len(seq)
    cdef object x
    for i in range(n):
        x = seq[i]
        if not (type(x) is bytes and PyBytes_GET_SIZE(x) >= min_key and <size_t>PyBytes_GET_SIZE(x) <= MAX_LEN):
            seq = [_length(_check_key(y, min_key)) for y in seq]
            break
    cdef bytes k
    cdef bint held = table._hold_order()
    try:
        for i in range(n):
            k = <bytes>PyList_GET_ITEM(seq, i)
            table._set(_bp(k), <uint32_t>PyBytes_GET_SIZE(k), ssa_hash(_bp(k), PyBytes_GET_SIZE(k)), NULL, 0, True)
        table.version += 1
        table._tidy()  # a compaction merges the order index itself
    finally:
        table._release_order(held)
    return n


cdef inline int _get2(Table ov, Table base, const uint8_t* k, uint32_t kl, Found* f) noexcept:
    """The entry for key k: overlay's if it has it, else base's; 0 when neither has it."""
    return _get2h(ov, base, k, kl, ssa_hash(k, kl), f)


cdef inline int _get2h(Table ov, Table base, const uint8_t* k, uint32_t kl, uint64_t h, Found* f) noexcept:
    """``_get2`` with the key's hash h."""
    if ov is not None and ov.count and ov._lookup(k, kl, h, f):
        return 1
    return base._lookup(k, kl, h, f)


def get_list(overlay, Table base not None, keys):
    """See ``statestore_async._ref.table.get_list``."""
    cdef Table ov = <Table?>overlay if overlay is not None else None
    cdef list seq = keys if type(keys) is list else list(keys)
    cdef Py_ssize_t i, n = len(seq)
    cdef list out = PyList_New(n)
    cdef bytes k
    cdef object val
    cdef Found f
    for i in range(n):
        k = _key_arg(<object>PyList_GET_ITEM(seq, i))
        if <size_t>PyBytes_GET_SIZE(k) <= MAX_LEN and _get2(ov, base, _bp(k), <uint32_t>PyBytes_GET_SIZE(k), &f) \
                and not f.none:
            val = PyBytes_FromStringAndSize(<const char*>f.val, f.vl)
        else:
            val = None
        Py_INCREF(val)
        PyList_SET_ITEM(out, i, val)
    return out


cdef Py_ssize_t find_records(object overlay, object base, const uint8_t* b, Py_ssize_t first,
                              uint32_t n, Found* found) except -1:
    """See ``table.pxd``."""
    cdef Table ov = <Table?>overlay if overlay is not None else None
    cdef Table bt = <Table?>base
    cdef Py_ssize_t pos = first, total = 0
    cdef uint32_t i = 0, c, j, m, kl
    # in chunks of APPLY_CHUNK keys: hashes first with the base's slots prefetched (``_hash_ahead``),
    # then the records the slots name, then the lookups (as ``apply`` does)
    cdef Py_ssize_t poss[APPLY_CHUNK]
    cdef uint64_t hs[APPLY_CHUNK]
    cdef size_t cap = bt.cap
    cdef uint64_t s
    while i < n:
        m = n - i if n - i < APPLY_CHUNK else APPLY_CHUNK
        pos = _hash_ahead(bt, b, pos, m, False, poss, hs)
        if cap:
            for j in range(m):
                s = bt.slots[((hs[j] >> 32) * cap) >> 32]
                if s:
                    ssa_prefetch(bt.arena + (((s & REF_MASK) - 1) << 2))
        for j in range(m):
            c = i + j
            kl = _rd32(b + poss[j])
            if not _get2h(ov, bt, b + poss[j] + 4, kl, hs[j], &found[c]):
                found[c].none = True
            if not found[c].none:
                total += found[c].vl
        i += m
    return total


cdef Table _copy_live(Table src, size_t upto):
    """A new table of the live records of src whose offset is below upto."""
    cdef Table t = Table()
    t._reserve_index(src.count)
    cdef size_t off = 0, size
    cdef const uint8_t* p
    cdef const uint8_t* k
    cdef uint32_t kl, vl
    while off < upto:
        p = src.arena + off
        k = ssa_rec(p, &kl, &vl)
        size = (<size_t>(k - p) + kl + vl + 3) & ~(<size_t>3)
        if not (p[0] & SSA_DEAD):
            t._add(k, kl, ssa_hash(k, kl), k + kl, vl, p[0] & SSA_TOMB)
        off += size
    return t


def apply(Table base not None, Table changes not None):
    """See ``statestore_async._ref.table.apply``.

    The changes are applied in chunks of ``APPLY_CHUNK`` records: their hashes first, with the
    base's and the undo table's slot of each prefetched, then the record each base slot names, then
    the chunk's work; a big base then costs about one memory latency per chunk rather than three
    per record."""
    if base is changes:
        raise InterfaceError("apply: the changes are the base table itself")
    cdef Table undo = Table()
    cdef Table applied = None
    undo._reserve_index(changes.count)
    cdef size_t off = 0, size, cap
    cdef const uint8_t* p
    cdef const uint8_t* k
    cdef const uint8_t* bp
    cdef const uint8_t* bk
    cdef uint32_t kl, vl, bkl, bvl
    cdef uint64_t h, s
    cdef Py_ssize_t pos
    cdef bint tomb
    cdef size_t offs[APPLY_CHUNK]
    cdef uint64_t hs[APPLY_CHUNK]
    cdef int n, j
    cdef bint held = base._hold_order()
    try:
        while off < changes.used:
            n = 0
            cap = base.cap
            while off < changes.used and n < APPLY_CHUNK:
                p = changes.arena + off
                k = ssa_rec(p, &kl, &vl)
                if not (p[0] & SSA_DEAD):
                    offs[n] = off
                    hs[n] = ssa_hash(k, kl)
                    if cap:
                        ssa_prefetch(base.slots + (((hs[n] >> 32) * cap) >> 32))
                    # the undo table's slot too: its index was sized for every change up front
                    ssa_prefetch(undo.slots + (((hs[n] >> 32) * undo.cap) >> 32))
                    n += 1
                off += (<size_t>(k - p) + kl + vl + 3) & ~(<size_t>3)
            if cap:
                for j in range(n):
                    s = base.slots[((hs[j] >> 32) * cap) >> 32]
                    if s:
                        ssa_prefetch(base.arena + (((s & REF_MASK) - 1) << 2))
            for j in range(n):
                p = changes.arena + offs[j]
                k = ssa_rec(p, &kl, &vl)
                h = hs[j]
                tomb = p[0] & SSA_TOMB
                pos = base._find(k, kl, h)
                if pos < 0:
                    if tomb:  # removing what is not there changes nothing
                        if applied is None:
                            applied = _copy_live(changes, offs[j])
                        continue
                    undo._add(k, kl, h, NULL, 0, True)
                    base._add(k, kl, h, k + kl, vl, False)
                else:
                    bp = base.arena + (((base.slots[pos] & REF_MASK) - 1) << 2)
                    bk = ssa_rec(bp, &bkl, &bvl)
                    undo._add(k, kl, h, bk + bkl, bvl, bp[0] & SSA_TOMB)  # before the base changes
                    if tomb:
                        base._delete_at(pos)
                    else:
                        base._replace(pos, k, kl, k + kl, vl, False)
                if applied is not None:
                    applied._add(k, kl, h, k + kl, vl, tomb)
        base.version += 1
        base._tidy()  # a compaction merges the order index itself
    finally:
        base._release_order(held)
    return (applied if applied is not None else changes), undo


cdef list _checked_records(list seq):
    cdef list out = []
    for item in seq:
        k, v = _pair(item)
        out.append((_length(_check_key(k, 0)), _value_arg(v)))
    return out


def load_records(Table table not None, records, bint keep_tombstones=False):
    """See ``statestore_async._ref.table.load_records``."""
    cdef list seq = records if type(records) is list else list(records)
    cdef Py_ssize_t i, n = len(seq)
    cdef object item, k, v
    cdef size_t est = 0, puts = 0
    for i in range(n):
        item = <object>PyList_GET_ITEM(seq, i)
        if not (type(item) is tuple and PyTuple_GET_SIZE(item) == 2):
            break
        k = <object>PyTuple_GET_ITEM(item, 0)
        v = <object>PyTuple_GET_ITEM(item, 1)
        if type(k) is not bytes or <size_t>PyBytes_GET_SIZE(k) > MAX_LEN:
            break
        if v is None:
            if keep_tombstones:
                est += ssa_rsize(<uint32_t>PyBytes_GET_SIZE(k), 0, True)
                puts += 1
            continue
        if type(v) is not bytes or <size_t>PyBytes_GET_SIZE(v) > MAX_LEN:
            break
        est += ssa_rsize(<uint32_t>PyBytes_GET_SIZE(k), <uint32_t>PyBytes_GET_SIZE(v), False)
        puts += 1
    else:
        i = n
    if i < n:
        seq = _checked_records(seq)
        est = puts = 0
        for i in range(n):
            item = <object>PyList_GET_ITEM(seq, i)
            v = <object>PyTuple_GET_ITEM(item, 1)
            if v is not None:
                est += ssa_rsize(<uint32_t>PyBytes_GET_SIZE(<object>PyTuple_GET_ITEM(item, 0)),
                                 <uint32_t>PyBytes_GET_SIZE(v), False)
                puts += 1
            elif keep_tombstones:
                est += ssa_rsize(<uint32_t>PyBytes_GET_SIZE(<object>PyTuple_GET_ITEM(item, 0)), 0, True)
                puts += 1
    if table.count == 0:  # a fresh table (a snapshot's records): size it once
        table._reserve_index(puts)
        table._reserve_arena(est)
    cdef bytes kb
    cdef uint32_t kl
    cdef uint64_t h
    cdef Py_ssize_t pos
    cdef bint held = table._hold_order()
    try:
        for i in range(n):
            item = <object>PyList_GET_ITEM(seq, i)
            kb = <bytes>PyTuple_GET_ITEM(item, 0)
            v = <object>PyTuple_GET_ITEM(item, 1)
            kl = <uint32_t>PyBytes_GET_SIZE(kb)
            h = ssa_hash(_bp(kb), kl)
            if v is not None:
                table._set(_bp(kb), kl, h, _bp(<bytes>v), <uint32_t>PyBytes_GET_SIZE(v), False)
            elif keep_tombstones:
                table._set(_bp(kb), kl, h, NULL, 0, True)
            else:
                pos = table._find(_bp(kb), kl, h)
                if pos >= 0:
                    table._delete_at(pos)
        table.version += 1
        table._trim_arena()
        table._tidy()  # a compaction merges the order index itself
    finally:
        table._release_order(held)


def pack_keys(keys):
    """See ``statestore_async._ref.table.pack_keys``."""
    cdef list seq = [_length(_key_arg(k)) for k in keys]
    cdef Py_ssize_t n = len(seq), i, total = 0, pos = 0, kl
    for i in range(n):
        total += 4 + PyBytes_GET_SIZE(<bytes>PyList_GET_ITEM(seq, i))
    cdef bytes kbuf = PyBytes_FromStringAndSize(NULL, total)
    cdef bytes koff = PyBytes_FromStringAndSize(NULL, n * 8)
    cdef uint8_t* o = <uint8_t*>PyBytes_AS_STRING(kbuf)
    cdef int64_t* offs = <int64_t*>PyBytes_AS_STRING(koff)
    cdef bytes k
    for i in range(n):
        k = <bytes>PyList_GET_ITEM(seq, i)
        kl = PyBytes_GET_SIZE(k)
        _wr32(o + pos, <uint32_t>kl)
        memcpy(o + pos + 4, PyBytes_AS_STRING(k), kl)
        offs[i] = pos + 4
        pos += 4 + kl
    return kbuf, koff


def lookup_spans(Table table not None, const uint8_t[::1] kbuf, const int64_t[::1] koff, const int64_t[::1] js,
                 uint8_t[::1] found, int64_t[::1] voff, int64_t[::1] vlen, int64_t base):
    """See ``statestore_async._ref.table.lookup_spans``."""
    cdef Py_ssize_t m = js.shape[0], i, j, pos = 0
    check_spans(kbuf, koff, js, found, voff, vlen, "lookup_spans")  # nothing written for a bad call
    if table.count == 0 or m == 0:
        return b""
    cdef const uint8_t* kb = &kbuf[0]
    cdef const uint8_t* k
    cdef Found f
    cdef uint32_t kl
    cdef int64_t total = 0
    for i in range(m):  # the hits: their value's address for now (the table does not change here)
        j = js[i]
        k = kb + koff[j]
        kl = _rd32(k - 4)
        if kl > MAX_LEN or not table._lookup(k, kl, ssa_hash(k, kl), &f):
            continue
        found[j] = 1
        if f.none:
            vlen[j] = -1
        else:
            voff[j] = <int64_t><intptr_t>f.val
            vlen[j] = f.vl
            total += f.vl
    cdef bytes out = PyBytes_FromStringAndSize(NULL, total)
    cdef char* o = PyBytes_AS_STRING(out)
    for i in range(m):  # the values, copied in the order of js
        j = js[i]
        if found[j] and vlen[j] >= 0:
            memcpy(o + pos, <const void*><intptr_t>voff[j], vlen[j])
            voff[j] = base + pos
            pos += vlen[j]
    return out


# --- export (checkpoint files) ----------------------------------------------------------------------
cdef uint32_t* _export_refs(Table t) except NULL:
    """A new malloc'd array of the refs of every live record of t (``count`` of them), in key order:
    a counting pass by bucket (the key's first two bytes) that writes the refs bucket by bucket,
    then each bucket sorted by 16-byte prefixes of the rest of its keys (a full compare only when
    two prefixes tie). The sort's scratch is sized for the largest bucket, not for the table: a
    commit or a flush of 475k changes spread over key groups needs kilobytes besides its 4 bytes
    per record, not 24 bytes per record."""
    cdef size_t n = t.count, off, size, seen, b, start, cnt, i, big
    cdef ssa_xent* tmp = NULL
    cdef ssa_xent* ent = NULL
    cdef uint32_t* hist = <uint32_t*>calloc(SSA_XBUCKETS + 1, sizeof(uint32_t))
    if hist == NULL:
        raise MemoryError()
    cdef uint32_t* out = <uint32_t*>malloc((n + 1) * sizeof(uint32_t))
    if out == NULL:
        free(hist)
        raise MemoryError()
    cdef const uint8_t* arena = t.arena
    cdef const uint8_t* p
    cdef const uint8_t* k
    cdef uint32_t kl, vl
    try:
        off = seen = 0
        while off < t.used:
            p = arena + off
            k = ssa_rec(p, &kl, &vl)
            if not (p[0] & SSA_DEAD):
                hist[ssa_xbucket(k, kl) + 1] += 1
                seen += 1
            off += (<size_t>(k - p) + kl + vl + 3) & ~(<size_t>3)
        if seen != n or off != t.used:
            raise SystemError(f"table export: {seen} live records for {n} entries")
        for b in range(<size_t>SSA_XBUCKETS):  # hist[b] becomes the start of bucket b
            hist[b + 1] += hist[b]
        off = 0
        while off < t.used:
            p = arena + off
            k = ssa_rec(p, &kl, &vl)
            if not (p[0] & SSA_DEAD):
                b = ssa_xbucket(k, kl)
                out[hist[b]] = <uint32_t>(off >> 2)
                hist[b] += 1
            off += (<size_t>(k - p) + kl + vl + 3) & ~(<size_t>3)
        # now hist[b] is the end of bucket b (the start of b + 1)
        start = big = 0
        for b in range(<size_t>SSA_XBUCKETS):
            if hist[b] - start > big:
                big = hist[b] - start
            start = hist[b]
        ent = <ssa_xent*>malloc((big + 1) * sizeof(ssa_xent))
        tmp = <ssa_xent*>malloc((big + 1) * sizeof(ssa_xent))
        if ent == NULL or tmp == NULL:
            raise MemoryError()
        start = 0
        for b in range(<size_t>SSA_XBUCKETS):
            cnt = hist[b] - start
            if cnt > 1:
                for i in range(cnt):  # the bucket's records lie all over the arena: fetched ahead
                    if start + i + 16 < n:
                        ssa_prefetch(arena + (<size_t>out[start + i + 16] << 2))
                    ssa_xfill(&ent[i], arena, out[start + i])
                ssa_xradix(ent, tmp, cnt, arena)
                for i in range(cnt):
                    out[start + i] = ent[i].ref
            start = hist[b]
    except BaseException:
        free(out)
        raise
    finally:
        free(hist)
        free(ent)
        free(tmp)
    return out



