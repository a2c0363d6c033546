"""The store key layout: every key starts with its key group.

A key is ``kg (2 bytes, big-endian) + payload``. The key group ``kg`` comes from Spark's
``xxhash64`` of the grouping key's columns, ``pmod(hash, G)`` (see ``statestore_async.codecs.sparkhash``),
so every piece of state of one grouping key lives in one key group, snapshots can keep their
records grouped by key group, and a rescale can read just the key groups a partition owns
(docs/ARCHITECTURE.md, "Identities and versions"). Prefix scans include the 2 key-group bytes. ``G`` is at most 65536.

This module is the one owner of that layout in Python: everything that builds or cuts a store
key's key-group prefix calls it (the compiled codecs in ``_ext/`` read the same two bytes in C).
"""
from __future__ import annotations

from statestore_async.errors import InterfaceError, KeyFormatError

KEY_GROUP_BYTES = 2
MAX_KEY_GROUPS = 1 << (8 * KEY_GROUP_BYTES)
DEFAULT_KEY_GROUPS = 4096


def check_num_key_groups(num_key_groups: int) -> int:
    if isinstance(num_key_groups, bool) or not isinstance(num_key_groups, int) or not 1 <= num_key_groups <= MAX_KEY_GROUPS:
        raise InterfaceError(f"the number of key groups must be an int in [1, {MAX_KEY_GROUPS}], got {num_key_groups!r}")
    return num_key_groups


def partition_key_groups(partition: int, num_partitions: int, num_key_groups: int) -> range:
    """The key groups partition ``partition`` of ``num_partitions`` owns: those with
    ``kg * num_partitions // num_key_groups == partition`` (the routing's rule), a contiguous range."""
    lo = -(-partition * num_key_groups // num_partitions)
    hi = -(-(partition + 1) * num_key_groups // num_partitions)
    return range(lo, hi)


def store_key(key_group: int, payload: bytes) -> bytes:
    """Build the store key of ``payload`` in ``key_group``."""
    if not 0 <= key_group < MAX_KEY_GROUPS:
        raise KeyFormatError(f"key group {key_group} is outside [0, {MAX_KEY_GROUPS})")
    return key_group.to_bytes(KEY_GROUP_BYTES, "big") + bytes(payload)


def key_group_of(key: bytes) -> int:
    """The key group a store key belongs to."""
    if len(key) < KEY_GROUP_BYTES:
        raise KeyFormatError(f"a store key has at least {KEY_GROUP_BYTES} bytes (its key group), got {len(key)}")
    return (key[0] << 8) | key[1]


def split_key(key: bytes) -> tuple[int, bytes]:
    """``(key_group, payload)`` of a store key."""
    return key_group_of(key), bytes(key[KEY_GROUP_BYTES:])


def prefix(key_group: int) -> bytes:
    """The key-group prefix of every store key in ``key_group`` (no range check: hot paths)."""
    return key_group.to_bytes(KEY_GROUP_BYTES, "big")


def prefixes(num_key_groups: int) -> tuple[bytes, ...]:
    """``prefix(g)`` for every key group ``g`` of ``num_key_groups``, indexable by ``g``."""
    return tuple(prefix(g) for g in range(check_num_key_groups(num_key_groups)))


def payload(key: bytes) -> bytes:
    """A store key without its key-group prefix."""
    return key[KEY_GROUP_BYTES:]


def key_group_or_zero(key: bytes) -> int:
    """The key group of ``key``, 0 for a key shorter than the prefix (a block index's convention)."""
    return (key[0] << 8) | key[1] if len(key) >= KEY_GROUP_BYTES else 0
