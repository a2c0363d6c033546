"""The change feed of an operator's state between two versions, read from the delta files.

``read_changes(spark, root, operator_id, start_version, end_version)`` (a DataFrame) and
``load_changes_table`` (a pyarrow Table, in this process): one row per change of a state variable's
value of one grouping key, committed by versions ``start_version + 1 .. end_version``, in commit
order: ``partition, key_group``, the key columns, ``state``, ``change_type``, ``old_value``,
``new_value`` (typed as in ``state.reader``; JSON when the state variables' values share no type),
``old_expires_ms`` / ``new_expires_ms`` when some state has a TTL, and ``version`` (the manifest
version that first counts the change: batch ``version - 1`` made it).

Each partition's changes are its deltas between the two states the manifests name: the delta of
the end state, then each parent its header names, back to the start state (``LineageError`` when
the end state does not descend from the start state). A removal (a clear, an emptied list or map,
a value removed because it expired) is a ``delete``. With ``old_values`` (the default), the value
each key held before its first change in the range comes from the start state (loaded from its
files, as ``state.reader`` does), and a change is an ``insert`` (nothing before), ``update`` or
``delete``; with ``old_values=False`` only the deltas are read, ``old_value`` is null and a change
is an ``update`` or a ``delete`` (Spark's own change feed). Timers and the TTL expiry index are not
state variables and are left out.

Applying the feed to the state at ``start_version`` — a ``delete`` removes the key's value, any
other change sets ``new_value`` (and ``new_expires_ms``) — gives the state at ``end_version``
(every stored value: ``include_expired=True``).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from statestore_async.codecs import valuecodec
from statestore_async.errors import InterfaceError, LineageError
from statestore_async.files.loader import load_store
from statestore_async.files.manifest import Manifest, list_manifest_versions
from statestore_async.files.names import DELTA
from statestore_async.files.transfer import read_checkpoint_file
from statestore_async.ids import DEFAULT_STORE_NAME, EMPTY_STATE, CheckpointRef, StoreId
from statestore_async.state import types as value_types
from statestore_async.state.keys import is_state_key
from statestore_async.state.metadata import read_manifests
from statestore_async.state.reader import StateLayout, _partitions, on_root, split_value, typed_frame, typed_table
from statestore_async.state.types import ColumnType

INSERT, UPDATE, DELETE = "insert", "update", "delete"
_MISSING = object()


@dataclass(frozen=True)
class Change:
    """One change of one state variable of one grouping key. ``old`` / ``new``: ``(value, expires)``
    (``split_value``), None for nothing (``old`` None also when not read: ``old_values=False``)."""

    key_group: int
    key: tuple
    state: str
    change_type: str
    old: tuple[Any, Any] | None
    new: tuple[Any, Any] | None
    version: int


@dataclass(frozen=True)
class ChangeRead:
    """What one change-feed read covers: the start and end manifests (and those between, for the
    versions of the changes), the layout and the options."""

    root: str
    operator_id: str
    start: Manifest
    end: Manifest
    named: dict[int, dict[CheckpointRef, int]]   # partition -> state -> the first manifest version naming it
    layout: StateLayout
    partitions: list[int]
    state_var: str | None
    old_values: bool


async def plan_changes(objstore, root: str, operator_id: str, start_version: int, end_version: int | None = None, *,
                       state_var: str | None = None, partition: int | Sequence[int] | None = None,
                       old_values: bool = True) -> ChangeRead:
    """Read the manifests from ``start_version`` to ``end_version`` (the latest when None) and
    check the options."""
    versions = await list_manifest_versions(objstore, operator_id)
    if not versions:
        raise InterfaceError(f"operator {operator_id!r} has no manifest under {objstore.uri}")
    end_version = versions[-1] if end_version is None else end_version
    if not 0 <= start_version <= end_version:
        raise InterfaceError(f"the change feed goes from an older version to a newer one, got {start_version}..{end_version}")
    span = [v for v in versions if start_version <= v <= end_version]
    for v in (start_version, end_version):
        if v not in versions and v != 0:
            raise InterfaceError(f"operator {operator_id!r} has no manifest of version {v} "
                                 f"(versions {versions[0]}..{versions[-1]})")
    manifests = await read_manifests(objstore, operator_id, span)
    if start_version == 0 and 0 not in versions:  # version 0: the empty state every partition starts from
        first = manifests[0]
        manifests.insert(0, Manifest(operator_id, 0, first.num_partitions, first.num_key_groups,
                                     {DEFAULT_STORE_NAME: (EMPTY_STATE,) * first.num_partitions},
                                     created=first.created, metadata=first.metadata))
    start, end = manifests[0], manifests[-1]
    if start.num_partitions != end.num_partitions:
        raise InterfaceError(f"operator {operator_id!r} has {start.num_partitions} partitions at version "
                             f"{start_version} and {end.num_partitions} at {end_version}: no change feed across a rescale")
    named: dict[int, dict[CheckpointRef, int]] = {}
    for m in manifests:
        if m.num_partitions != end.num_partitions:
            continue
        for p, ref in enumerate(m.stores[DEFAULT_STORE_NAME]):
            named.setdefault(p, {}).setdefault(ref, m.version)
    layout = StateLayout.of(end)
    layout.check_state_var(state_var)
    return ChangeRead(root, operator_id, start, end, named, layout, _partitions(end, partition), state_var, old_values)


async def partition_changes(objstore, read: ChangeRead, partition: int) -> list[Change]:
    """The changes of one partition, oldest first."""
    sid = StoreId(read.root, read.operator_id, partition)
    first, last = read.start.ref(partition), read.end.ref(partition)
    deltas: list[tuple[CheckpointRef, list[tuple[bytes, bytes | None]]]] = []
    cur = last
    while cur.version > first.version:
        header, records = await read_checkpoint_file(objstore, sid, cur, DELTA)
        deltas.append((cur, records))
        cur = header.lineage[0] if header.lineage else EMPTY_STATE
    if cur != first:
        raise LineageError(f"partition {partition} of {read.operator_id!r}: the state of version {read.end.version} "
                           f"({last}) does not descend from the state of version {read.start.version} ({first}); "
                           f"its lineage passes {cur}")
    deltas.reverse()
    raw: list[tuple[bytes, bytes | None, int]] = []  # (key, new value or None, manifest version)
    for ref, records in deltas:
        version = read.named.get(partition, {}).get(ref, ref.version)
        raw.extend((k, v, version) for k, v in records if is_state_key(k))
    names_keys = valuecodec.decode_rows([k[2:] for k, _, _ in raw])
    if read.state_var is not None:
        keep = [i for i, nk in enumerate(names_keys) if nk[0] == read.state_var]
        raw, names_keys = [raw[i] for i in keep], [names_keys[i] for i in keep]
    before: dict[bytes, bytes | None] = {}
    if read.old_values and raw and not first.is_empty_state:
        wanted = {k for k, _, _ in raw}
        store, _ = await load_store(objstore, sid, first)
        before = {k: store.get(k) for k in wanted}
    values = valuecodec.decode_rows([v for _, v, _ in raw if v is not None])
    new_it = iter(values)
    decoded_old: dict[bytes, Any] = {k: valuecodec.decode_row(v) for k, v in before.items() if v is not None}
    current: dict[bytes, Any] = {}
    out = []
    for (k, v, version), nk in zip(raw, names_keys):
        name = nk[0]
        new_stored = next(new_it) if v is not None else None
        if read.old_values:
            old_stored = current.get(k, _MISSING)
            if old_stored is _MISSING:
                old_stored = decoded_old.get(k)
            current[k] = new_stored
            kind = DELETE if new_stored is None else (INSERT if old_stored is None else UPDATE)
        else:
            old_stored = None
            kind = DELETE if new_stored is None else UPDATE
        old = split_value(read.layout, name, old_stored) if old_stored is not None else None
        new = split_value(read.layout, name, new_stored) if new_stored is not None else None
        out.append(Change((k[0] << 8) | k[1], tuple(nk[1:]), name, kind, old, new, version))
    return out


class ChangeColumns:
    """The columns of change rows: types inferred from the changes seen (``observe``, ``merge``)."""

    def __init__(self, layout: StateLayout, state_var: str | None = None):
        self.layout = layout
        self.arities: set[int] = set()
        self.keys: list[ColumnType] = []
        self.value = ColumnType()
        self.expires = ColumnType()
        self.has_ttl = layout.ttl(state_var) if state_var is not None else any(layout.ttl(n) for n in layout.states)

    def observe(self, changes: Sequence[Change]) -> None:
        for c in changes:
            if len(c.key) not in self.arities:
                self.arities.add(len(c.key))
                while len(self.keys) < len(c.key):
                    self.keys.append(ColumnType())
            for t, v in zip(self.keys, c.key):
                t.observe(v)
            for vals in (c.old, c.new):
                if vals is not None:
                    self.value.observe(vals[0])
                    if vals[1] is not None:
                        self.has_ttl = True
                        self.expires.observe(vals[1])

    def merge(self, other: ChangeColumns) -> None:
        self.arities |= other.arities
        while len(self.keys) < len(other.keys):
            self.keys.append(ColumnType())
        for t, o in zip(self.keys, other.keys):
            t.type = value_types.merge(t.type, o.type)
        self.value.type = value_types.merge(self.value.type, other.value.type)
        self.expires.type = value_types.merge(self.expires.type, other.expires.type)
        self.has_ttl = self.has_ttl or other.has_ttl

    def key_names(self) -> list[str] | None:
        names = self.layout.key_columns
        if names is None or any(a != len(names) for a in self.arities):
            return None
        return list(names)

    def schema(self) -> pa.Schema:
        fields = [("partition", pa.int32()), ("key_group", pa.int32())]
        names = self.key_names()
        if names is None:
            fields.append(("key", pa.string()))
        else:
            fields += [(n, value_types.arrow_type(self._key_type(i))) for i, n in enumerate(names)]
        vt = value_types.arrow_type(value_types.final(self.value.type))
        et = value_types.arrow_type(value_types.final(self.expires.type))
        fields += [("state", pa.string()), ("change_type", pa.string()), ("old_value", vt)]
        if self.has_ttl:
            fields.append(("old_expires_ms", et))
        fields.append(("new_value", vt))
        if self.has_ttl:
            fields.append(("new_expires_ms", et))
        fields.append(("version", pa.int64()))
        return pa.schema(fields)

    def _key_type(self, i: int) -> value_types.Type:
        return value_types.final(self.keys[i].type if i < len(self.keys) else value_types.NULL)

    def table(self, partition: int, changes: Sequence[Change]) -> pa.Table:
        n = len(changes)
        vt, et = value_types.final(self.value.type), value_types.final(self.expires.type)
        arrays = [pa.array([partition] * n, pa.int32()), pa.array([c.key_group for c in changes], pa.int32())]
        names = self.key_names()
        if names is None:
            arrays.append(value_types.column([list(c.key) for c in changes], value_types.JSON))
        else:
            arrays += [value_types.column([c.key[i] for c in changes], self._key_type(i)) for i in range(len(names))]
        arrays += [pa.array([c.state for c in changes], pa.string()), pa.array([c.change_type for c in changes], pa.string())]
        for side in ("old", "new"):
            vals = [getattr(c, side) for c in changes]
            arrays.append(value_types.column([v[0] if v is not None else None for v in vals], vt))
            if self.has_ttl:
                arrays.append(value_types.column([v[1] if v is not None else None for v in vals], et))
        arrays.append(pa.array([c.version for c in changes], pa.int64()))
        return pa.Table.from_arrays(arrays, schema=self.schema())


def load_changes_table(root: str, operator_id: str, start_version: int, end_version: int | None = None, *,
                       state_var: str | None = None, partition: int | Sequence[int] | None = None,
                       old_values: bool = True, s3_options: dict | None = None) -> pa.Table:
    """``read_changes``'s rows as one pyarrow Table, read in this process."""

    async def go(r: str, store: Any) -> pa.Table:
        read = await plan_changes(store, r, operator_id, start_version, end_version, state_var=state_var,
                                  partition=partition, old_values=old_values)
        parts = [(p, await partition_changes(store, read, p)) for p in read.partitions]
        return typed_table(ChangeColumns(read.layout, read.state_var), parts)

    return on_root(root, s3_options, go)


def read_changes(spark, root: str, operator_id: str, start_version: int, end_version: int | None = None, *,
                 state_var: str | None = None, partition: int | Sequence[int] | None = None,
                 old_values: bool = True, s3_options: dict | None = None):
    """The change feed from ``start_version`` to ``end_version`` (the latest when None) as a
    DataFrame (see the module's docstring); one Spark task per partition, each reading its deltas
    twice: a first job infers the columns' types."""

    read = on_root(root, s3_options, lambda r, store: plan_changes(
        store, r, operator_id, start_version, end_version, state_var=state_var, partition=partition,
        old_values=old_values))
    opts = s3_options

    def changes_of(p: int) -> list[Change]:
        return on_root(read.root, opts, lambda _r, store: partition_changes(store, read, p))

    return typed_frame(spark, read.partitions, lambda: ChangeColumns(read.layout, read.state_var), changes_of)


__all__ = ["DELETE", "INSERT", "UPDATE", "Change", "ChangeColumns", "load_changes_table", "partition_changes",
           "plan_changes", "read_changes"]
