# Included by _ext/table.pyx (one compiled module, one C file): the batch routines, many records in one call with
# no Python object per record; ``set_records`` / ``find_records`` are what the request routines of
# _ext/payloads.pyx call (statestore_async/_native/table.pxd).
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
