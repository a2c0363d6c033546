"""A task's batched calls to its open store: every key's state in one read, the batch's changes in
one write.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, TypeAlias

import numpy as np
import pyarrow as pa

if TYPE_CHECKING:
    from statestore_async.client.clients import StoreHandle


# a processor's state changes: per key lists of (key, value) and keys, or (vectorized) Arrow arrays
Puts: TypeAlias = list[tuple[bytes, bytes]] | tuple[pa.Array, pa.Array]


Removes: TypeAlias = list[bytes] | pa.Array | None


def get_all(handle: StoreHandle, keys: list[bytes]) -> list[bytes | None]:
    """Every key's value in one call (the client splits it at the daemon's batch limit and pipelines)."""
    return handle.get_many(keys)


def write_all(handle: StoreHandle, puts: Puts, removes: Removes) -> None:
    """All puts and all removals, one call each: lists of (key, value) and keys, or Arrow arrays
    (``puts`` a (keys, values) pair, ``removes`` keys; the vectorized path)."""
    if isinstance(puts, tuple):
        if len(puts[0]):
            handle.put_many_arrow(*puts)
        if removes is not None and len(removes):
            handle.remove_many_arrow(removes)
        return
    if puts:
        handle.put_many(puts)
    if removes:
        handle.remove_many(removes)


def empties(n: int) -> pa.Array:
    """``n`` empty binary values (from buffers: no Python object each)."""
    return pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(np.zeros(n + 1, np.int32)), pa.py_buffer(b"")])
