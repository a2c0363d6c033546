# Included by _ext/table.pyx (one compiled module, one C file): the export of a table's records in key order for
# checkpoint files.
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
