"""Reading an operator's committed state: ``load_state`` (a dict, in this process) and ``read_state`` (a DataFrame).

Both read the manifest of a version (the latest when ``version`` is None) and load each partition's
named checkpoint from files alone (``loader.load_store``: GETs of named files, no daemon).

They give the state variables' records only: timers and the TTL expiry index (``spark.timekeys``)
are left out. A TTL'd value past its expiry by the clock of the batch that wrote the version is
not in it (that batch removed it); ``now_ms`` also leaves out the values expired by that time, and
the entries of per-entry TTL'd lists and maps expired by then. A TTL'd value reads as
``(expires_at_ms, value)``; a list or map with a TTL as ``(latest expiry, [(expires_at_ms, value),
...])`` or ``(latest expiry, {map key: (expires_at_ms, value)})``.
"""
from __future__ import annotations

import asyncio
import json

from statestore_async.codecs import valuecodec
from statestore_async.codecs.keylayout import key_group_of, payload
from statestore_async.errors import VersionNotFoundError
from statestore_async.files.loader import load_store
from statestore_async.files.manifest import list_manifest_versions, read_manifest
from statestore_async.ids import DEFAULT_STORE_NAME, StoreId
from statestore_async.objectstore import open_object_store
from statestore_async.spark.timekeys import is_state_key


def _open(root: str, s3_options: dict | None):
    """``(root URI, its object store)``: a relative root is refused (``runtime.checkpoint_root``), a
    local one opened without creating its folder (reading never creates anything: a missing root
    has no manifest)."""
    from statestore_async.spark.runtime import checkpoint_root

    root = checkpoint_root(root)
    if root.startswith("s3://"):
        if s3_options is None:
            from statestore_async.spark.operator import s3_options_from_env

            s3_options = s3_options_from_env()
        return root, open_object_store(root, s3_options=s3_options)
    return root, open_object_store(root, create=False)


async def _manifest(store, operator_id: str, version: int | None):
    if version is None:
        versions = await list_manifest_versions(store, operator_id)
        if not versions:
            raise VersionNotFoundError(f"operator {operator_id!r} has no manifest under {store.uri}")
        version = versions[-1]
    return await read_manifest(store, operator_id, version)


def decode_record(key: bytes, value: bytes) -> tuple[int, str, tuple, object]:
    """``(key_group, state_name, grouping_key, value)`` of one store record written by the operator.

    A state declared with a TTL keeps ``(expires_at_ms, value)`` as its value.
    """
    name, *grouping = valuecodec.decode_row(payload(key))
    return key_group_of(key), name, tuple(grouping), valuecodec.decode_row(value)


def load_partition(root: str, operator_id: str, partition: int, ckpt_version: int, ckptid: str,
                   s3_options: dict | None = None) -> list[tuple[bytes, bytes]]:
    """Every (key, value) record of one partition's committed checkpoint, loaded from files."""
    from statestore_async.ids import CheckpointRef

    ref = CheckpointRef(ckpt_version, ckptid)
    if ref.is_empty_state:
        return []

    async def go():
        r, store = _open(root, s3_options)
        try:
            vs, _ = await load_store(store, StoreId(r, operator_id, partition), ref)
            return list(vs.items())
        finally:
            await store.close()

    return asyncio.run(go())


_GONE = object()


def _visible(name: str, value: object, ttl_states: dict[str, bool], now_ms: int | None) -> object:
    """A record's value of state ``name`` as live at ``now_ms`` (None: no clock given, all are):
    ``_GONE`` when expired; a per-entry TTL'd list or map without its entries expired by then."""
    if now_ms is None or name not in ttl_states or not isinstance(value, tuple) or len(value) != 2:
        return value
    expires, inner = value
    if isinstance(expires, int) and expires <= now_ms:
        return _GONE
    if ttl_states[name] and isinstance(inner, list):
        return (expires, [ev for ev in inner if ev[0] > now_ms])
    if ttl_states[name] and isinstance(inner, dict):
        return (expires, {k: ev for k, ev in inner.items() if ev[0] > now_ms})
    return value


def _ttl_states(manifest) -> dict[str, bool]:
    """The TTL'd states of a manifest's declarations: name -> whether the TTL is per entry."""
    states = (manifest.metadata or {}).get("states") or {}
    return {name: bool(d.get("ttl_entries")) for name, d in states.items() if isinstance(d, dict) and d.get("ttl")}


def load_state(root: str, operator_id: str, version: int | None = None, *, s3_options: dict | None = None,
               now_ms: int | None = None) -> dict:
    """``{(state_name, grouping_key): value}`` of the committed version (the latest by default);
    with ``now_ms``, TTL'd values expired by then are left out."""

    async def go():
        r, store = _open(root, s3_options)
        try:
            m = await _manifest(store, operator_id, version)
            ttl = _ttl_states(m)
            out = {}
            for p, ref in enumerate(m.stores[DEFAULT_STORE_NAME]):
                if ref.is_empty_state:
                    continue
                vs, _ = await load_store(store, StoreId(r, operator_id, p), ref)
                for k, v in vs.items():
                    if not is_state_key(k):
                        continue
                    _, name, key, value = decode_record(k, v)
                    value = _visible(name, value, ttl, now_ms)
                    if value is not _GONE:
                        out[(name, key)] = value
            return out
        finally:
            await store.close()

    return asyncio.run(go())


def read_state(spark, root: str, operator_id: str, version: int | None = None, *, s3_options: dict | None = None,
               now_ms: int | None = None):
    """A DataFrame ``(partition int, key_group int, state string, key string, value string)`` of the
    state variables' records (with ``now_ms``: without TTL'd values expired by then).

    One Spark task per state partition loads that partition's checkpoint from files; ``key`` (the
    grouping key tuple as a list) and ``value`` are JSON (dates, decimals, bytes as strings).
    """

    async def man():
        r, store = _open(root, s3_options)
        try:
            return r, await _manifest(store, operator_id, version)
        finally:
            await store.close()

    r, m = asyncio.run(man())
    refs = [(p, ref.version, ref.ckptid) for p, ref in enumerate(m.stores[DEFAULT_STORE_NAME])]
    opts = s3_options
    ttl = _ttl_states(m)

    def load(items):
        for p, v, c in items:
            for k, val in load_partition(r, operator_id, p, v, c, opts):
                if not is_state_key(k):
                    continue
                kg, name, key, value = decode_record(k, val)
                value = _visible(name, value, ttl, now_ms)
                if value is _GONE:
                    continue
                yield (p, kg, name, json.dumps(list(key), default=str), json.dumps(value, default=str))

    schema = "partition int, key_group int, state string, key string, value string"
    rdd = spark.sparkContext.parallelize(refs, max(1, len(refs))).mapPartitions(load)
    return spark.createDataFrame(rdd, schema)
