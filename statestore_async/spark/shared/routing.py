"""Routing rows to state partitions inside the JVM (no Python pass over the batch).

A row's key group is ``kg = pmod(xxhash64(key columns), G)`` (Spark's built-in ``xxhash64``, the
same value ``statestore_async.codecs.sparkhash`` computes in Python); key group ``kg`` belongs to state
partition ``kg * N div G`` (Flink's contiguous ranges, ``sparkhash.partition_of_key_group``).

``repartition(N, col)`` sends a row to shuffle partition ``pmod(murmur3(col, seed 42), N)``. The
route column therefore holds, for state partition ``p``, a precomputed int ``route_values(N)[p]``
whose Spark Murmur3 hash mod N is ``p``: task ``i`` of the shuffle receives exactly state
partition ``i``. A repartition with an explicit number of partitions is never coalesced or split by
adaptive query execution (its shuffle origin is ``REPARTITION_BY_NUM``); the tests check that.
"""
from __future__ import annotations

from functools import lru_cache

SPARK_SEED = 42
KG_COLUMN = "__ssa_kg"
ROUTE_COLUMN = "__ssa_route"
_M32 = 0xFFFFFFFF


def _rotl32(x: int, r: int) -> int:
    return ((x << r) | (x >> (32 - r))) & _M32


def murmur3_int(value: int, seed: int = SPARK_SEED) -> int:
    """Spark's ``Murmur3_x86_32.hashInt(value, seed)`` as a signed 32-bit int (Spark's ``hash()``)."""
    k1 = (value & _M32) * 0xCC9E2D51 & _M32
    k1 = _rotl32(k1, 15) * 0x1B873593 & _M32
    h1 = (seed & _M32) ^ k1
    h1 = (_rotl32(h1, 13) * 5 + 0xE6546B64) & _M32
    h1 ^= 4
    h1 ^= h1 >> 16
    h1 = h1 * 0x85EBCA6B & _M32
    h1 ^= h1 >> 13
    h1 = h1 * 0xC2B2AE35 & _M32
    h1 ^= h1 >> 16
    return h1 - (1 << 32) if h1 & 0x80000000 else h1


@lru_cache(maxsize=64)
def route_values(num_partitions: int) -> tuple[int, ...]:
    """For each partition p, the smallest int >= 0 whose Spark Murmur3 hash pmod N is p."""
    if num_partitions < 1:
        raise ValueError("num_partitions must be >= 1")
    out: dict[int, int] = {}
    v = 0
    while len(out) < num_partitions:
        p = murmur3_int(v) % num_partitions
        out.setdefault(p, v)
        v += 1
    return tuple(out[p] for p in range(num_partitions))


def _quoted(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


def with_routing(df, key_columns: list[str], num_partitions: int, num_key_groups: int, columns=None):
    """``df`` (or its ``columns``) plus the key-group and route columns, repartitioned so task i
    holds exactly state partition i.

    One SQL projection and the repartition: every DataFrame call is a round trip to the JVM and a
    new analysis of the plan; the column-by-column form cost ~50 ms of planning per micro-batch.
    """
    keys = ", ".join(_quoted(c) for c in key_columns)
    routes = ", ".join(str(v) for v in route_values(num_partitions))
    selected = [_quoted(c) for c in columns] if columns is not None else ["*"]
    kg = f"CAST(pmod(xxhash64({keys}), {int(num_key_groups)}) AS INT)"
    part = f"CAST(floor({kg} * {int(num_partitions)} / {int(num_key_groups)}) AS INT)"
    return df.selectExpr(*selected, f"{kg} AS {KG_COLUMN}",
                         f"element_at(array({routes}), {part} + 1) AS {ROUTE_COLUMN}").repartition(
        num_partitions, ROUTE_COLUMN)
