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

The sources, by concern: ``_records.pxd`` (a record in the arena), ``_refsort.pxd`` (the sort of
refs by key), ``_bytes.pxd`` (the key hash), this file (the ``Table``: its arena, hash index and
order index, which are one class's methods), ``table_checks.pxi`` (arguments from Python),
``table_views.pxi`` (frozen views), ``table_batches.pxi`` (batch routines) and
``table_export.pxi`` (records for checkpoint files); the ``.pxi`` files are included here, so the
module is still one C file and its calls between concerns stay direct.

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
from _records cimport *
from _refsort cimport *
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

cdef size_t MAX_LEN = 0xFFFFFFFE
# a slot holds ref + 1 in 32 bits: refs up to 0xFFFFFFFE units of 4 bytes
cdef size_t MAX_ARENA = (<size_t>0xFFFFFFFE) << 2
cdef uint64_t REF_MASK = 0xFFFFFFFF
cdef size_t MIN_GARBAGE = 1024
cdef int CHUNK_OVERHEAD = 11
DEF APPLY_CHUNK = 32  # records per prefetched chunk of ``apply``
_CHANGED = "Table changed during iteration"
_RELEASED = "the table view was released"

include "table_checks.pxi"


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

include "table_views.pxi"

include "table_batches.pxi"

include "table_export.pxi"
