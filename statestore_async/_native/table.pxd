# What the compiled engine table gives the other Cython modules: the C-level routines through which
# the daemon's request routines (``_ext/payloads.pyx``) set and look up records laid in place in
# a buffer, with no copy and no Python object per record. The records are *checked* by the
# caller: ``n`` of them laid end to end from ``buf + first``, each key after its u32 length
# (little-endian) and, for pairs, each followed by its value after its u32 length. The engine
# knows nothing of the frame or payload they came in.
from libc.stdint cimport uint8_t, uint32_t


cdef struct Found:
    const uint8_t* val  # the value's bytes in the table's arena (valid until the table changes)
    uint32_t vl
    bint none           # absent, or a tombstone entry


# The KeyFormatError of a key shorter than its ``min_key``-byte key group.
cdef object key_error(Py_ssize_t n, Py_ssize_t min_key)

# Set the records in ``table`` (a ``Table``): to their values (``pairs``, ``nbytes`` of records in
# all) or to tombstones; one batch write (the order index merges at most once).
cdef int set_records(object table, const uint8_t* buf, Py_ssize_t first, Py_ssize_t nbytes, uint32_t n,
                     bint pairs) except -1

# For each of the ``n`` keys: ``overlay``'s entry when it has the key (a tombstone is ``none``), else
# ``base``'s (``none`` when absent), into ``found[i]``; ``overlay`` may be None. Returns the sum of
# the found values' lengths.
cdef Py_ssize_t find_records(object overlay, object base, const uint8_t* buf, Py_ssize_t first, uint32_t n,
                             Found* found) except -1
