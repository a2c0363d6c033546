"""Python rows ⇄ store keys and values, in batches (the layer under the clients' ``*_rows`` calls).

A key row (a tuple of the grouping columns) becomes ``key group + valuecodec.encode_key(row)``, the
key group being ``pmod(xxhash64(row), G)`` — Spark's own hash of those columns, so Spark can route
the same keys to the same partitions (``key_types`` name the Spark types when Python's own do not
say them: an ``int`` column that Spark holds as ``int`` rather than ``bigint``). Values are any
``valuecodec`` value. Every step runs over the whole batch in Cython.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from statestore_async.codecs import sparkhash, valuecodec
from statestore_async.codecs.keylayout import DEFAULT_KEY_GROUPS, check_num_key_groups, payload, prefix


def encode_keys(rows: Sequence[tuple[object, ...]], key_types: Sequence[str] | None = None,
                num_key_groups: int = DEFAULT_KEY_GROUPS) -> list[bytes]:
    """Store keys of key rows (each row a tuple of the key columns)."""
    check_num_key_groups(num_key_groups)
    rows = rows if isinstance(rows, list) else list(rows)
    if not rows:
        return []
    kgs = sparkhash.key_groups(sparkhash.hash_rows(rows, key_types), num_key_groups).tolist()
    payloads = valuecodec.encode_keys(rows)
    return [prefix(kg) + p for kg, p in zip(kgs, payloads)]


def decode_key(key: bytes) -> tuple[Any, ...]:
    """The key row of a store key made by ``encode_keys``."""
    row: tuple[Any, ...] = valuecodec.decode_row(payload(memoryview(key)))
    return row


def encode_values(values: Sequence[object]) -> list[bytes]:
    return valuecodec.encode_rows(values if isinstance(values, list) else list(values))


def decode_values(datas: Sequence[bytes | None]) -> list[Any]:
    """Values of a GET_MANY answer; None (absent) stays None."""
    present = [d for d in datas if d is not None]
    decoded = iter(valuecodec.decode_rows(present))
    return [next(decoded) if d is not None else None for d in datas]
