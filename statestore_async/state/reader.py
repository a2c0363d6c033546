"""Reading an operator's committed state, from its checkpoint files alone (no daemon).

* ``read_state(spark, root, operator_id, ...)``: a DataFrame of typed columns, one row per grouping
  key: ``partition``, ``key_group``, the key columns (the operator's ``key_columns``), then one column
  per state variable and, for a TTL'd one, ``<name>_expires_ms``;
* ``load_state_table`` / ``decode_partition``: the same rows as a pyarrow Table or as Python values,
  in this process (what ``statestore-async show`` and ``export`` use);
* ``load_state``: ``{(state_name, grouping_key): stored value}`` in this process (TTL'd values as
  ``(expires_at_ms, value)``);
* ``read_metadata(spark, root)``: the operators, their versions, partitions, key groups and sizes
  (``state.metadata``); the change feed between two versions is ``state.changes``.

Each reads the manifest of a version (the latest when ``version`` is None) and loads each
partition's named checkpoint (``loader.load_store``: GETs of named files). Timers and the TTL expiry
index (``state.keys``) are left out: only the state variables' records are read.

Typed columns. The manifest records the key columns' names and each state variable's kind and TTL
(``api.processors.merge_declarations``), not the types of the values: those are inferred from the values
(``state.types``), the same way on every partition, so ``read_state`` reads the state twice —
once for the types, once for the rows. A column whose values fit no one Spark type is JSON text.
A value state holds its value; a list state a list; a map state a map; a ``VectorizedProcessor``'s
state its row as a struct (fields ``_1``, ``_2``, … in ``state_schema`` order). The TTL expiry of
a value (or whole list / map) is its own column, ``<name>_expires_ms``; a list or map with a TTL per
entry has the live entries' values in ``<name>`` and their expiries beside them in
``<name>_expires_ms`` (a list of the same length, a map with the same keys).

Expired values are hidden by default: the processor's view at ``now_ms`` (default: the current
time) — a value past its expiry is absent, and so is an entry of a per-entry TTL'd list or map.
``include_expired=True`` shows every stored value. (The batch that wrote the version had already
removed what was expired by its own clock.)
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import pyarrow as pa

from statestore_async.codecs import valuecodec
from statestore_async.codecs.keylayout import key_group_of, payload
from statestore_async.errors import InterfaceError, VersionNotFoundError
from statestore_async.files.loader import load_store
from statestore_async.files.manifest import Manifest, list_manifest_versions, read_manifest
from statestore_async.ids import DEFAULT_STORE_NAME, CheckpointRef, StoreId
from statestore_async.objectstore import open_object_store
from statestore_async.state import types as value_types
from statestore_async.state.keys import is_state_key
from statestore_async.state.metadata import describe_root
from statestore_async.state.roots import checkpoint_root, s3_options_from_env
from statestore_async.state.types import ColumnType

T = TypeVar("T")

EXPIRES_SUFFIX = "_expires_ms"


def _open(root: str, s3_options: dict | None):
    """``(root URI, its object store)``: a relative root is refused (``state.roots.checkpoint_root``), a
    local one opened without creating its folder (reading never creates anything: a missing root
    has no manifest)."""
    root = checkpoint_root(root)
    if root.startswith("s3://"):
        if s3_options is None:
            s3_options = s3_options_from_env()
        return root, open_object_store(root, s3_options=s3_options)
    return root, open_object_store(root, create=False)


def on_root(root: str, s3_options: dict | None, read: Callable[[str, Any], Awaitable[T]]) -> T:
    """``read(root URI, object store)`` run to its end in this thread, on the root opened by
    ``_open`` and closed after: every reader's one way to the files."""

    async def go() -> T:
        r, store = _open(root, s3_options)
        try:
            return await read(r, store)
        finally:
            await store.close()

    return asyncio.run(go())


class TypedColumns(Protocol):
    """What ``typed_table`` and ``typed_frame`` need of a reader's columns (``StateColumns``,
    ``state.changes.ChangeColumns``): their types inferred from rows, merged across partitions."""

    def observe(self, rows: Any) -> None: ...

    def merge(self, other: Any) -> None: ...

    def schema(self) -> pa.Schema: ...

    def table(self, partition: int, rows: Any) -> pa.Table: ...


def typed_table(cols: TypedColumns, parts: Sequence[tuple[int, Any]]) -> pa.Table:
    """The rows of every ``(partition, rows)`` as one Table, typed by ``cols`` once it has seen them all."""
    for _p, rows in parts:
        cols.observe(rows)
    return pa.concat_tables([cols.table(p, rows) for p, rows in parts]) if parts else cols.schema().empty_table()


def typed_frame(spark: Any, partitions: Sequence[int], new_columns: Callable[[], TypedColumns],
                rows_of: Callable[[int], Any]) -> Any:
    """A DataFrame of ``rows_of(p)`` for each partition, one Spark task per partition, each reading
    its rows twice: a first job infers the columns' types (``new_columns()`` per task, merged),
    the DataFrame's own job reads the rows (``rows_of`` runs on the executors)."""
    from pyspark.sql.pandas.types import from_arrow_schema

    sc = spark.sparkContext
    parts = list(partitions)

    def infer(ps: Iterator[int]) -> Iterator[TypedColumns]:
        cols = new_columns()
        for p in ps:
            cols.observe(rows_of(p))
        yield cols

    cols = new_columns()
    if parts:
        for c in sc.parallelize(parts, len(parts)).mapPartitions(infer).collect():
            cols.merge(c)
    spark_schema = from_arrow_schema(cols.schema())
    if not parts:
        return spark.createDataFrame([], spark_schema)

    def rows(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in batches:
            for p in batch.column(0).to_pylist():
                yield from cols.table(p, rows_of(p)).to_batches(max_chunksize=65536)

    src = spark.createDataFrame(sc.parallelize([(p,) for p in parts], len(parts)), "partition int")
    return src.mapInArrow(rows, spark_schema)


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
    ref = CheckpointRef(ckpt_version, ckptid)
    if ref.is_empty_state:
        return []

    return on_root(root, s3_options, lambda r, store: load_records(store, r, operator_id, partition, ref))


async def load_records(objstore, root: str, operator_id: str, partition: int,
                       ref: CheckpointRef) -> list[tuple[bytes, bytes]]:
    """Every (key, value) record of one partition's state ``ref``, in key order."""
    if ref.is_empty_state:
        return []
    vs, _ = await load_store(objstore, StoreId(root, operator_id, partition), ref)
    return list(vs.items())


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
    """``{(state_name, grouping_key): value}`` of the committed version (the latest by default), as
    stored: a TTL'd value as ``(expires_at_ms, value)``; with ``now_ms``, TTL'd values expired by
    then are left out (None: every stored value)."""

    async def go(r: str, store: Any) -> dict:
        m = await _manifest(store, operator_id, version)
        ttl = _ttl_states(m)
        out = {}
        for p, ref in enumerate(m.stores[DEFAULT_STORE_NAME]):
            for k, v in await load_records(store, r, operator_id, p, ref):
                if not is_state_key(k):
                    continue
                _, name, key, value = decode_record(k, v)
                value = _visible(name, value, ttl, now_ms)
                if value is not _GONE:
                    out[(name, key)] = value
        return out

    return on_root(root, s3_options, go)


# --- the state as rows of typed columns -------------------------------------------------------------
@dataclass(frozen=True)
class StateLayout:
    """What a manifest says about how to read its records: the key columns' names (None: not
    recorded) and each state variable's declaration (``{"kind", "ttl", "ttl_entries"}``)."""

    key_columns: tuple[str, ...] | None
    states: dict[str, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def of(cls, manifest: Manifest) -> StateLayout:
        md = manifest.metadata or {}
        keys = md.get("key_columns")
        states = {n: dict(d) for n, d in (md.get("states") or {}).items() if isinstance(d, dict)}
        return cls(tuple(keys) if keys else None, states)

    def ttl(self, name: str) -> bool:
        return bool(self.states.get(name, {}).get("ttl"))

    def entries(self, name: str) -> bool:
        return bool(self.states.get(name, {}).get("ttl_entries"))

    def check_state_var(self, state_var: str | None) -> None:
        """``InterfaceError`` naming the declared variables when ``state_var`` is not one of them."""
        if state_var is not None and self.states and state_var not in self.states:
            raise InterfaceError(f"state_var={state_var!r}: the operator declares {sorted(self.states)}")


def split_value(layout: StateLayout, name: str, stored: Any) -> tuple[Any, Any]:
    """``(value, expires)`` of a stored value of state ``name``: for a TTL'd value its expiry in ms;
    for a per-entry TTL'd list (map) the list of entry values and the list of their expiries (the
    map of entry values and the map of their expiries); ``expires`` None without a TTL."""
    if not layout.ttl(name) or not isinstance(stored, tuple) or len(stored) != 2:
        return stored, None
    expires, inner = stored
    if layout.entries(name):
        if isinstance(inner, list):
            return [v for _, v in inner], [e for e, _ in inner]
        if isinstance(inner, dict):
            return {k: ev[1] for k, ev in inner.items()}, {k: ev[0] for k, ev in inner.items()}
    return inner, expires


def live_value(layout: StateLayout, name: str, value: Any, expires: Any, now_ms: int | None) -> tuple[Any, Any] | None:
    """``(value, expires)`` as the processor sees it at ``now_ms`` (None when expired; None for
    ``now_ms``: everything is live)."""
    if now_ms is None or expires is None:
        return value, expires
    if isinstance(expires, int):
        return (value, expires) if expires > now_ms else None
    if isinstance(expires, list):
        keep = [i for i, e in enumerate(expires) if e > now_ms]
        return ([value[i] for i in keep], [expires[i] for i in keep]) if keep else None
    if isinstance(expires, dict):
        keys = [k for k, e in expires.items() if e > now_ms]
        return ({k: value[k] for k in keys}, {k: expires[k] for k in keys}) if keys else None
    return value, expires


# one grouping key of a partition: (key group, key tuple, {state name: (value, expires)})
KeyRow = tuple[int, tuple, dict[str, tuple[Any, Any]]]


def decode_partition(records: Iterable[tuple[bytes, bytes | None]], layout: StateLayout, *,
                     now_ms: int | None = None, state_var: str | None = None) -> list[KeyRow]:
    """The grouping keys of one partition's records, each with its state variables' values
    (``split_value``) live at ``now_ms`` (None: every stored value); only ``state_var`` when given.
    Timer and expiry-index records are skipped; so are tombstones (None values)."""
    keys, values = [], []
    for k, v in records:
        if v is not None and is_state_key(k):
            keys.append(k)
            values.append(v)
    if not keys:
        return []
    names_keys = valuecodec.decode_rows([k[2:] for k in keys])
    decoded = valuecodec.decode_rows(values)
    rows: dict[tuple, KeyRow] = {}
    ttl: dict[str, bool] = {}
    for k, nk, stored in zip(keys, names_keys, decoded):
        name = nk[0]
        if state_var is not None and name != state_var:
            continue
        has_ttl = ttl.get(name)
        if has_ttl is None:
            has_ttl = ttl[name] = layout.ttl(name)
        if has_ttl:
            live = live_value(layout, name, *split_value(layout, name, stored), now_ms)
            if live is None:
                continue
        else:
            live = (stored, None)
        key = tuple(nk[1:])
        row = rows.get(key)
        if row is None:
            rows[key] = row = ((k[0] << 8) | k[1], key, {})
        row[2][name] = live
    return list(rows.values())


def _state_column_name(name: str, taken: set[str]) -> str:
    return name if name not in taken else f"{name}_state"


class StateColumns:
    """The columns of an operator's state rows: the types inferred so far (``observe`` rows of any
    number of partitions, ``merge`` what others observed), then ``schema`` and ``table``. Picklable,
    so Spark tasks observe their partitions and the driver merges them."""

    def __init__(self, layout: StateLayout, state_var: str | None = None):
        self.layout = layout
        self.state_var = state_var
        self.arities: set[int] = set()
        self.keys: list[ColumnType] = []
        self.values: dict[str, ColumnType] = {}
        self.expires: dict[str, ColumnType] = {}
        for name in layout.states:
            if state_var is None or name == state_var:
                self.values[name] = ColumnType()
                if layout.ttl(name):
                    self.expires[name] = ColumnType()

    def observe(self, rows: Iterable[KeyRow]) -> None:
        for _kg, key, states in rows:
            if len(key) not in self.arities:
                self.arities.add(len(key))
                while len(self.keys) < len(key):
                    self.keys.append(ColumnType())
            for t, v in zip(self.keys, key):
                t.observe(v)
            for name, (value, expires) in states.items():
                vt = self.values.get(name)
                if vt is None:
                    vt = self.values[name] = ColumnType()
                vt.observe(value)
                if expires is not None:
                    et = self.expires.get(name)
                    if et is None:
                        et = self.expires[name] = ColumnType()
                    et.observe(expires)

    def merge(self, other: StateColumns) -> None:
        self.arities |= other.arities
        while len(self.keys) < len(other.keys):
            self.keys.append(ColumnType())
        for t, o in zip(self.keys, other.keys):
            t.type = value_types.merge(t.type, o.type)
        for mine, theirs in ((self.values, other.values), (self.expires, other.expires)):
            for name, o in theirs.items():
                t = mine.setdefault(name, ColumnType())
                t.type = value_types.merge(t.type, o.type)

    def key_names(self) -> list[str] | None:
        """The key columns' names, or None when the keys are one JSON column ``key``: the operator
        recorded no names, or keys of another arity were found."""
        names = self.layout.key_columns
        if names is None or any(a != len(names) for a in self.arities):
            return None
        return list(names)

    def columns(self) -> list[tuple[str, str, str | None, value_types.Type]]:
        """``(column, part, state name, final type)`` in order; part is ``partition``,
        ``key_group``, ``key`` (the i-th key column, or the whole key as JSON), ``value`` or ``expires``."""
        out: list[tuple[str, str, str | None, value_types.Type]] = [
            ("partition", "partition", None, ("int",)), ("key_group", "key_group", None, ("int",))]
        names = self.key_names()
        if names is None:
            out.append(("key", "key", None, value_types.JSON))
        else:
            out += [(n, "key", str(i), value_types.final(self.keys[i].type if i < len(self.keys) else value_types.NULL))
                    for i, n in enumerate(names)]
        taken = {c[0] for c in out}
        for name in sorted(self.values):
            col = _state_column_name(name, taken)
            out.append((col, "value", name, value_types.final(self.values[name].type)))
            if name in self.expires:
                out.append((col + EXPIRES_SUFFIX, "expires", name, value_types.final(self.expires[name].type)))
        return out

    def schema(self) -> pa.Schema:
        return pa.schema([(c, pa.int32() if t == ("int",) else value_types.arrow_type(t), part not in ("partition", "key_group"))
                          for c, part, _n, t in self.columns()])

    def table(self, partition: int, rows: Sequence[KeyRow]) -> pa.Table:
        """The rows of one partition as a Table of ``schema()``."""
        arrays = []
        for _c, part, name, t in self.columns():
            if part == "partition":
                arrays.append(pa.array([partition] * len(rows), pa.int32()))
            elif part == "key_group":
                arrays.append(pa.array([r[0] for r in rows], pa.int32()))
            elif part == "key":
                if name is None:
                    arrays.append(value_types.column([list(r[1]) for r in rows], t))
                else:
                    i = int(name)
                    arrays.append(value_types.column([r[1][i] for r in rows], t))
            else:
                j = 0 if part == "value" else 1
                arrays.append(value_types.column([s[name][j] if name in (s := r[2]) else None for r in rows], t))
        return pa.Table.from_arrays(arrays, schema=self.schema())


def _now(now_ms: int | None, include_expired: bool) -> int | None:
    if include_expired:
        return None
    return int(time.time() * 1000) if now_ms is None else int(now_ms)


def _partitions(m: Manifest, partition: int | Sequence[int] | None) -> list[int]:
    n = m.num_partitions
    if partition is None:
        return list(range(n))
    wanted = [partition] if isinstance(partition, int) else list(partition)
    bad = [p for p in wanted if not isinstance(p, int) or isinstance(p, bool) or not 0 <= p < n]
    if bad:
        raise InterfaceError(f"partition {bad[0]!r}: operator {m.operator_id!r} has {n} partitions (0..{n - 1})")
    return sorted(set(wanted))


@dataclass(frozen=True)
class StateRead:
    """What one read covers: the manifest, its layout, the partitions and the options."""

    root: str
    manifest: Manifest
    layout: StateLayout
    partitions: list[int]
    state_var: str | None
    now_ms: int | None

    def refs(self) -> list[tuple[int, CheckpointRef]]:
        return [(p, self.manifest.ref(p)) for p in self.partitions]

    @property
    def key_types(self) -> dict[str, str] | None:
        """The key columns' Spark types as the operator recorded them (None: not recorded)."""
        types = (self.manifest.metadata or {}).get("key_types")
        return dict(types) if isinstance(types, dict) else None


async def plan_read(objstore, root: str, operator_id: str, version: int | None = None, *,
                    state_var: str | None = None, partition: int | Sequence[int] | None = None,
                    now_ms: int | None = None, include_expired: bool = False) -> StateRead:
    """Read the manifest and check the options (``InterfaceError`` naming what is wrong)."""
    m = await _manifest(objstore, operator_id, version)
    layout = StateLayout.of(m)
    layout.check_state_var(state_var)
    return StateRead(root, m, layout, _partitions(m, partition), state_var, _now(now_ms, include_expired))


async def partition_rows(objstore, read: StateRead, partition: int) -> list[KeyRow]:
    """The decoded rows of one partition of a read."""
    records = await load_records(objstore, read.root, read.manifest.operator_id, partition, read.manifest.ref(partition))
    return decode_partition(records, read.layout, now_ms=read.now_ms, state_var=read.state_var)


def load_state_table(root: str, operator_id: str, version: int | None = None, *, state_var: str | None = None,
                     partition: int | Sequence[int] | None = None, now_ms: int | None = None,
                     include_expired: bool = False, s3_options: dict | None = None) -> pa.Table:
    """``read_state``'s rows as one pyarrow Table, read in this process."""

    async def go(r: str, store: Any) -> pa.Table:
        read = await plan_read(store, r, operator_id, version, state_var=state_var, partition=partition,
                               now_ms=now_ms, include_expired=include_expired)
        parts = [(p, await partition_rows(store, read, p)) for p in read.partitions]
        return typed_table(StateColumns(read.layout, read.state_var), parts)

    return on_root(root, s3_options, go)


def read_state(spark, root: str, operator_id: str, version: int | None = None, *, s3_options: dict | None = None,
               now_ms: int | None = None, state_var: str | None = None, partition: int | Sequence[int] | None = None,
               include_expired: bool = False):
    """A DataFrame of the committed state of ``version`` (the latest by default), one row per
    grouping key: ``partition int, key_group int``, the key columns, one column per state variable
    (``state_var``: only that one, and only the keys that hold it) and ``<name>_expires_ms`` for a
    TTL'd one; only the partitions ``partition`` (an int or several) when given. Expired values are
    hidden as at ``now_ms`` (default: now) unless ``include_expired``.

    One Spark task per state partition loads its checkpoint from files, twice: a first job infers
    the columns' types, the DataFrame's own job reads the rows.
    """

    read = on_root(root, s3_options, lambda r, store: plan_read(
        store, r, operator_id, version, state_var=state_var, partition=partition, now_ms=now_ms,
        include_expired=include_expired))
    opts = s3_options

    def rows_of(p: int) -> list[KeyRow]:
        return on_root(read.root, opts, lambda _r, store: partition_rows(store, read, p))

    df = typed_frame(spark, read.partitions, lambda: StateColumns(read.layout, read.state_var), rows_of)
    return _key_types(df, read.key_types)


def _key_types(df: Any, key_types: dict[str, str] | None) -> Any:
    """``df`` with its key columns cast to the Spark types the operator recorded for them (manifest
    ``key_types``, e.g. ``int`` where the stored values read back as ``bigint``)."""
    if not key_types:
        return df
    from pyspark.sql import functions as F

    return df.select(*(F.col(c).cast(key_types[c]).alias(c) if c in key_types else F.col(c) for c in df.columns))


def read_metadata(spark, root: str, operator_id: str | None = None, *, s3_options: dict | None = None):
    """A DataFrame of what the checkpoint root holds, one row per operator and partition at its
    latest version (``state.metadata.describe_root``): ``operator_id, partition, num_partitions,
    num_key_groups, first_key_group, last_key_group, min_version, max_version, versions, state_version,
    ckptid, state_files, state_bytes, files, bytes, orphaned_files`` and ``state_vars`` (JSON)."""
    rows = []
    for op in on_root(root, s3_options, lambda r, store: describe_root(store, r, operator_id)):
        for p in op.partitions:
            rows.append((op.operator_id, p.partition, op.num_partitions, op.num_key_groups, p.key_groups.start,
                         p.key_groups.stop - 1, op.versions[0], op.versions[-1], len(op.versions), p.ref.version,
                         p.ref.ckptid, p.state_files, p.state_bytes, p.files, p.bytes, len(p.orphaned),
                         json.dumps(op.states, sort_keys=True)))
    schema = ("operator_id string, partition int, num_partitions int, num_key_groups int, first_key_group int, "
              "last_key_group int, min_version long, max_version long, versions int, state_version long, "
              "ckptid string, state_files int, state_bytes long, files int, bytes long, orphaned_files int, "
              "state_vars string")
    return spark.createDataFrame(rows, schema)


__all__ = ["StateColumns", "StateLayout", "decode_partition", "decode_record", "load_state", "load_state_table",
           "read_metadata", "read_state", "split_value"]
