"""A partition's rows grouped by key, in one pass (numpy / pyarrow, no Python object per row), the
store keys of the keys, and the check that every row belongs to the task's partition.
"""
from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from statestore_async.codecs import arrowcodec, keylayout, valuecodec
from statestore_async.errors import (
    InterfaceError,
)
from statestore_async.spark.shared.taskspec import TaskSpec


class RoutingError(InterfaceError):
    """A task received rows of a key group its state partition does not own."""


kg_prefixes = lru_cache(maxsize=8)(keylayout.prefixes)


def store_keys(state_name: str, keys: list[tuple], kgs: list[int], num_key_groups: int) -> list[bytes]:
    """Store keys ``keylayout.prefix(kg) + encode_key((state_name, *key))`` of one state variable."""
    pre = kg_prefixes(num_key_groups)
    enc = valuecodec.encode_keys([(state_name, *k) for k in keys])
    return [pre[g] + e for g, e in zip(kgs, enc)]


def _codes(col: pa.ChunkedArray | pa.Array) -> np.ndarray:
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    if pa.types.is_floating(col.type):
        # Spark groups -0.0 with 0.0 and every NaN together: normalize before encoding
        col = pc.if_else(pc.is_nan(col), pa.scalar(float("nan"), col.type), pc.add(col, pa.scalar(0.0, col.type)))
    enc = pc.dictionary_encode(col, null_encoding="encode")
    return enc.indices.to_numpy(zero_copy_only=False).astype(np.int64)


def _stable_order(codes: np.ndarray) -> np.ndarray:
    """``np.argsort(codes, kind="stable")`` for codes in [0, 2**32), as one or two radix passes.

    numpy sorts 16-bit integers with a radix sort (O(n)): 5-10 ms for 500k rows where the
    comparison sort of int64 takes ~40 ms.
    """
    top = int(codes.max()) if codes.size else 0
    if top >= 1 << 32:
        return np.argsort(codes, kind="stable")
    lo = np.argsort((codes & 0xFFFF).astype(np.uint16), kind="stable")
    if top < 1 << 16:
        return lo
    return lo[np.argsort((codes[lo] >> 16).astype(np.uint16), kind="stable")]


def group_rows(table: pa.Table, key_columns: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """(order, offsets): ``table.take(order)`` has each key's rows together, in their order; key i is
    rows offsets[i]:offsets[i+1]. Keys of the column codec's types are grouped in one pass over their
    encoded keys (``arrowcodec.group``: the keys in the order of their first row), others by Arrow's
    dictionary encoding."""
    n = table.num_rows
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(1, np.int64)
    grouped = arrowcodec.group([table[c] for c in key_columns])  # keys of the column codec's types
    return grouped if grouped is not None else _group_by_dictionary(table, key_columns)


def _group_by_dictionary(table: pa.Table, key_columns: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """``group_rows`` for keys of any type Arrow can dictionary-encode (the groups in the order of
    their codes: for one column, of their first row)."""
    n = table.num_rows
    codes = _codes(table[key_columns[0]])
    for c in key_columns[1:]:
        more = _codes(table[c])
        codes = codes * (int(more.max()) + 1) + more
        codes = np.unique(codes, return_inverse=True)[1].astype(np.int64)
    order = _stable_order(codes)
    sc = codes[order]
    bounds = np.flatnonzero(sc[1:] != sc[:-1]) + 1
    offsets = np.concatenate(([0], bounds, [n])).astype(np.int64)
    return order, offsets


def check_routing(kg: np.ndarray, partition: int, spec: TaskSpec) -> None:
    if kg.size == 0:
        return
    owners = kg.astype(np.int64) * spec.num_partitions // spec.num_key_groups
    if owners.min() != partition or owners.max() != partition:
        raise RoutingError(
            f"task of partition {partition} received rows of partitions {sorted(set(owners.tolist()))[:5]}: "
            "the shuffle did not keep the routing (is the stage changed after the operator's repartition?)")
