"""Offline rescale: rewrite an operator's latest version at another number of partitions, ahead of
the query's restart (``statestore-async repartition``; a query restarted with another
``num_partitions`` does the same online, in its first batch).

``plan_repartition`` reads manifest ``v`` (the latest) and says, per new partition, which key-group
ranges of which old partitions make it and about how many bytes that reads (each old state's stored
bytes, in proportion to the key groups taken). ``repartition`` then, per new partition, writes the
recipe of its state R and assembles R in this process (``loader.load_store``: ranged reads of the old
files, R's snapshot written), and finally replaces manifest ``v`` with one naming the R's at the new
count — the same state, another layout; its metadata says where it came from (``rescaled_from``).

Resumable: the R's checkpoint ids are derived from the old manifest and the new count, so a run
after a crash finds the recipes and snapshots already written and skips them; the manifest is
replaced last, atomically. Refused with typed errors: a count above the key groups
(``OperatorConfigError``), a manifest of an unknown format (``CorruptFileError``), an operator
that a streaming query owns unless ``owner`` names that query (it must be stopped:
``OwnerConflictError``).
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import xxhash

from statestore_async.codecs.keylayout import partition_key_groups
from statestore_async.errors import InterfaceError, OwnerConflictError
from statestore_async.files.loader import load_store
from statestore_async.files.manifest import Manifest, list_manifest_versions, read_manifest, read_owner, write_manifest
from statestore_async.files.names import DELTA, SNAPSHOT, file_key
from statestore_async.files.rescale import RESCALED_FROM_KEY, Recipe, Source, plan_sources, write_recipe
from statestore_async.files.retention import needed_files
from statestore_async.ids import DEFAULT_STORE_NAME, EMPTY_STATE, CheckpointRef, StoreId

if TYPE_CHECKING:
    from statestore_async.objectstore.base import ObjectStore


class RepartitionConfigError(InterfaceError):
    """The operator cannot be rescaled to that count (a subclass of ``InterfaceError``)."""


@dataclass
class PartitionPlan:
    partition: int
    ref: CheckpointRef
    sources: tuple[Source, ...]
    bytes_to_read: int  # about: each source's stored bytes in proportion to the key groups taken
    done: bool = False  # its snapshot exists already (an earlier run wrote it)

    def to_json(self) -> dict[str, Any]:
        return {"partition": self.partition, "ref": [self.ref.version, self.ref.ckptid],
                "sources": [{"partition": s.partition, "key_groups": [s.first_kg, s.last_kg]} for s in self.sources],
                "bytes_to_read": self.bytes_to_read, "bytes_to_write": self.bytes_to_read, "done": self.done}


@dataclass
class RepartitionPlan:
    operator_id: str
    version: int
    from_partitions: int
    to_partitions: int
    num_key_groups: int
    partitions: list[PartitionPlan] = field(default_factory=list)
    already: bool = False  # the manifest is at that count already: nothing to do

    def to_json(self) -> dict[str, Any]:
        return {"operator_id": self.operator_id, "version": self.version, "from_partitions": self.from_partitions,
                "to_partitions": self.to_partitions, "num_key_groups": self.num_key_groups, "already": self.already,
                "bytes_to_read": sum(p.bytes_to_read for p in self.partitions),
                "partitions": [p.to_json() for p in self.partitions]}


@dataclass
class RepartitionReport:
    plan: RepartitionPlan
    bytes_read: int = 0
    bytes_written: int = 0
    skipped: list[int] = field(default_factory=list)  # partitions an earlier run had assembled

    def to_json(self) -> dict[str, Any]:
        return {**self.plan.to_json(), "bytes_read": self.bytes_read, "bytes_written": self.bytes_written,
                "skipped": self.skipped}


def _ref_for(old: Manifest, partitions: int, p: int, version: int) -> CheckpointRef:
    """R of new partition ``p``: the same for the same old manifest and count (a rerun resumes)."""
    seed = f"{old.operator_id}|{old.version}|{partitions}|{p}|" + ",".join(
        f"{r.version}_{r.ckptid}" for r in (old.ref(q) for q in range(old.num_partitions)))
    return CheckpointRef(version, xxhash.xxh3_128_hexdigest(seed.encode()))


async def _stored_bytes(objstore: ObjectStore, store_id: StoreId, ref: CheckpointRef) -> int:
    """The bytes of the files a load of ``ref`` reads (a LIST of the store's folder: offline only)."""
    if ref.is_empty_state:
        return 0
    sizes = {info.key: info.size async for info in objstore.list(store_id.prefix + "/")}
    needed = await needed_files(objstore, store_id, [ref], set(sizes))
    # a load reads a state's snapshot, not the delta kept beside it (retention keeps both)
    read = {k for k in needed if not (k.endswith("." + DELTA) and k[: -len(DELTA)] + SNAPSHOT in needed)}
    return sum(sizes[k] for k in read)


async def plan_repartition(objstore: ObjectStore, root: str, operator_id: str, partitions: int, *,
                           owner: str | None = None) -> RepartitionPlan:
    """What ``repartition`` would do (reads only); see the module docstring for the refusals."""
    versions = await list_manifest_versions(objstore, operator_id)
    if not versions:
        raise RepartitionConfigError(f"operator {operator_id!r} at {root} has no manifest: nothing to rescale "
                                     "(a new query starts at any num_partitions)")
    old = await read_manifest(objstore, operator_id, versions[-1])
    g = old.num_key_groups
    if isinstance(partitions, bool) or not isinstance(partitions, int) or not 1 <= partitions <= g:
        raise RepartitionConfigError(
            f"operator {operator_id!r} has {g} key groups: its partitions can number 1 to {g}, not {partitions!r} "
            "(the key groups are fixed for an operator's life)")
    current = await read_owner(objstore, operator_id)
    if current is not None and current.owner != owner:
        raise OwnerConflictError(
            f"operator {operator_id!r} at {root} is owned by streaming query {current.owner} (epoch {current.epoch}): "
            f"stop that query, then name it (--owner {current.owner}) to rescale its state offline; or restart "
            "the query with the new num_partitions, which rescales online")
    plan = RepartitionPlan(operator_id, old.version, old.num_partitions, partitions, g)
    if old.num_partitions == partitions:
        plan.already = True
        return plan
    old_refs = [old.ref(q) for q in range(old.num_partitions)]
    stored = await asyncio.gather(*(_stored_bytes(objstore, StoreId(root, operator_id, q), r)
                                    for q, r in enumerate(old_refs)))
    version = max(old.version, *(r.version for r in old_refs))
    for p, sources in enumerate(plan_sources(old_refs, partitions, g)):
        ref = _ref_for(old, partitions, p, version) if sources else EMPTY_STATE
        est = 0
        for s in sources:
            owned = len(partition_key_groups(s.partition, old.num_partitions, g))
            est += int(stored[s.partition] * (s.last_kg - s.first_kg + 1) / owned)
        done = bool(sources) and await objstore.exists(file_key(StoreId(root, operator_id, p), ref, SNAPSHOT))
        plan.partitions.append(PartitionPlan(p, ref, sources, est, done))
    return plan


async def repartition(objstore: ObjectStore, root: str, operator_id: str, partitions: int, *,
                      owner: str | None = None, progress: Callable[[PartitionPlan, int], None] | None = None,
                      ) -> RepartitionReport:
    """Rewrite the operator's latest version at ``partitions`` partitions (module docstring).
    ``progress(partition plan, bytes read)`` is called as each new partition is done."""
    plan = await plan_repartition(objstore, root, operator_id, partitions, owner=owner)
    report = RepartitionReport(plan)
    if plan.already:
        return report
    old = await read_manifest(objstore, operator_id, plan.version)
    for pp in plan.partitions:
        if pp.ref.is_empty_state:
            continue
        sid = StoreId(root, operator_id, pp.partition)
        if pp.done:
            report.skipped.append(pp.partition)
            if progress is not None:
                progress(pp, 0)
            continue
        recipe = Recipe(pp.partition, partitions, plan.num_key_groups, old.num_partitions, old.version, pp.sources)
        await write_recipe(objstore, sid, pp.ref, recipe)
        _, load = await load_store(objstore, sid, pp.ref)
        report.bytes_read += load.bytes_read
        report.bytes_written += load.snapshot_written
        if progress is not None:
            progress(pp, load.bytes_read)
    metadata = dict(old.metadata)
    metadata[RESCALED_FROM_KEY] = {"version": old.version, "num_partitions": old.num_partitions, "offline": True,
                                   "stores": [[r.version, r.ckptid] for r in (old.ref(q) for q in range(old.num_partitions))]}
    await write_manifest(objstore, Manifest(operator_id, old.version, partitions, plan.num_key_groups,
                                            {DEFAULT_STORE_NAME: tuple(pp.ref for pp in plan.partitions)},
                                            metadata=metadata))
    return report


__all__ = ["PartitionPlan", "RepartitionConfigError", "RepartitionPlan", "RepartitionReport", "plan_repartition",
           "repartition"]
