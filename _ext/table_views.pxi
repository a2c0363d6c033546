# Included by _ext/table.pyx (one compiled module, one C file): frozen views of a table (``Table.freeze``): a
# ``TableView`` reads the records a table held when frozen while the table goes on changing.
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
