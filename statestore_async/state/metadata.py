"""What an operator's checkpoint holds: its versions, partitions, key groups, files and sizes, and
which files are orphaned attempts. Read from manifests and LISTs only (no state is loaded unless
``records=True``); for ``read_metadata``, ``statestore-async ls`` and ``gc``.

A partition's files are ``<root>/<operator>/<partition>/default/<version>_<ckptid>.delta|.snapshot``.
Every file a manifest's state needs — its own snapshot or delta, and the lineage back to a base — is
*needed* (``files.retention.needed_files``, the loader's walk). A file no manifest needs is an
*orphaned* attempt when its version is at most the newest version a manifest names for that
partition: a losing task attempt, a batch whose manifest was never written, a state a takeover
dropped; nothing will ever load it. A file above that version is *pending*: possibly the attempt of
a batch running now, whose manifest is not written yet.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from statestore_async.errors import InterfaceError
from statestore_async.files.manifest import COMMITS_DIR, Manifest, list_manifest_versions, read_manifest
from statestore_async.files.names import parse_file_name
from statestore_async.files.retention import needed_files
from statestore_async.ids import DEFAULT_STORE_NAME, CheckpointRef, StoreId
from statestore_async.objectstore.base import ObjectStore
from statestore_async.state.keys import owned_key_groups


@dataclass
class PartitionInfo:
    """One partition at the version described, and the files of its folder."""

    partition: int
    key_groups: range
    ref: CheckpointRef
    state_files: int = 0           # files the state's load reads (snapshot or delta + lineage)
    state_bytes: int = 0
    files: int = 0                 # checkpoint files in the partition's folder
    bytes: int = 0
    orphaned: list[str] = field(default_factory=list)   # keys no manifest needs, at or below the newest named version
    pending: list[str] = field(default_factory=list)    # keys above it (attempts whose manifest may come)
    records: int | None = None     # store records of the state (with ``records=True``), timers included


@dataclass
class OperatorInfo:
    operator_id: str
    versions: list[int]
    version: int                    # the version described
    num_partitions: int
    num_key_groups: int
    key_columns: list[str] | None
    states: dict[str, Any]
    owner: str | None
    created: float
    partitions: list[PartitionInfo] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "operator_id": self.operator_id, "versions": self.versions, "version": self.version,
            "num_partitions": self.num_partitions, "num_key_groups": self.num_key_groups,
            "key_columns": self.key_columns, "states": self.states, "owner": self.owner, "created": self.created,
            "partitions": [{"partition": p.partition, "key_groups": [p.key_groups.start, p.key_groups.stop - 1],
                            "ref": str(p.ref), "version": p.ref.version, "ckptid": p.ref.ckptid,
                            "records": p.records, "state_files": p.state_files, "state_bytes": p.state_bytes,
                            "files": p.files, "bytes": p.bytes, "orphaned": p.orphaned, "pending": p.pending}
                           for p in self.partitions],
        }


async def list_operators(objstore: ObjectStore) -> list[str]:
    """The operators under a checkpoint root: folders with at least one manifest (a LIST of the root)."""
    found = set()
    async for info in objstore.list(""):
        parts = info.key.split("/")
        if len(parts) == 3 and parts[1] == COMMITS_DIR and parse_manifest_name(parts[2]) is not None:
            found.add(parts[0])
    return sorted(found)


def parse_manifest_name(name: str) -> int | None:
    """The version of a manifest file name ``<version>.json`` (None: not one)."""
    stem, dot, ext = name.partition(".")
    if ext != "json" or not dot or not stem.isdigit() or (stem != "0" and stem.startswith("0")):
        return None
    return int(stem)


@dataclass
class PartitionFiles:
    """The checkpoint files of one partition and what the kept manifests need of them."""

    sizes: dict[str, int]          # key -> bytes
    refs: dict[str, CheckpointRef]
    needed: set[str]
    newest_named: int              # the newest version a manifest names for the partition (0: none)

    def orphaned(self) -> list[str]:
        return sorted((k for k, r in self.refs.items() if k not in self.needed and r.version <= self.newest_named),
                      key=lambda k: (self.refs[k].version, k))

    def pending(self) -> list[str]:
        return sorted((k for k, r in self.refs.items() if k not in self.needed and r.version > self.newest_named),
                      key=lambda k: (self.refs[k].version, k))


async def partition_files(objstore: ObjectStore, store_id: StoreId, named: set[CheckpointRef]) -> PartitionFiles:
    """LIST one partition's folder; the files the states ``named`` need (states that cannot load
    are left out, as retention does)."""
    sizes: dict[str, int] = {}
    refs: dict[str, CheckpointRef] = {}
    async for info in objstore.list(store_id.prefix + "/"):
        parsed = parse_file_name(info.key)
        if parsed is not None and info.key.rsplit("/", 1)[0] == store_id.prefix:
            sizes[info.key] = info.size
            refs[info.key] = parsed[0]
    live = sorted((r for r in named if not r.is_empty_state), key=lambda r: -r.version)
    needed = await needed_files(objstore, store_id, live, set(sizes), skip_broken=True) if live else set()
    return PartitionFiles(sizes, refs, needed, max((r.version for r in named), default=0))


async def read_manifests(objstore: ObjectStore, operator_id: str, versions: list[int]) -> list[Manifest]:
    return list(await asyncio.gather(*(read_manifest(objstore, operator_id, v) for v in versions)))


async def describe_operator(objstore: ObjectStore, root: str, operator_id: str, version: int | None = None, *,
                            records: bool = False) -> OperatorInfo:
    """An operator's versions and its partitions at ``version`` (the latest when None), with the
    files of each partition: those its state needs, and the orphaned ones (against every manifest
    present). ``records``: also load each state to count its records."""
    versions = await list_manifest_versions(objstore, operator_id)
    if not versions:
        raise InterfaceError(f"operator {operator_id!r} has no manifest under {objstore.uri}")
    if version is not None and version not in versions:
        raise InterfaceError(f"operator {operator_id!r} has no manifest of version {version} "
                             f"(versions {versions[0]}..{versions[-1]})")
    manifests = await read_manifests(objstore, operator_id, versions)
    m = manifests[-1] if version is None else manifests[versions.index(version)]
    md = m.metadata or {}
    info = OperatorInfo(operator_id, versions, m.version, m.num_partitions, m.num_key_groups,
                        md.get("key_columns"), dict(md.get("states") or {}), md.get("owner"), m.created)
    for p, ref in enumerate(m.stores.get(DEFAULT_STORE_NAME, ())):
        sid = StoreId(root, operator_id, p)
        named = {mm.stores[DEFAULT_STORE_NAME][p] for mm in manifests  # with those of other partition counts
                 if DEFAULT_STORE_NAME in mm.stores and p < mm.num_partitions}
        files = await partition_files(objstore, sid, named)
        mine = await needed_files(objstore, sid, [ref], set(files.sizes), skip_broken=True) if not ref.is_empty_state else set()
        pi = PartitionInfo(p, owned_key_groups(p, m.num_partitions, m.num_key_groups), ref,
                           state_files=len(mine), state_bytes=sum(files.sizes[k] for k in mine),
                           files=len(files.sizes), bytes=sum(files.sizes.values()),
                           orphaned=files.orphaned(), pending=files.pending())
        if records:
            from statestore_async.files.loader import load_store

            pi.records = 0 if ref.is_empty_state else len((await load_store(objstore, sid, ref))[0])
        info.partitions.append(pi)
    return info


async def describe_root(objstore: ObjectStore, root: str, operator_id: str | None = None, *,
                        records: bool = False) -> list[OperatorInfo]:
    """``describe_operator`` of every operator under the root (or just ``operator_id``), at its latest version."""
    ops = [operator_id] if operator_id is not None else await list_operators(objstore)
    return [await describe_operator(objstore, root, op, records=records) for op in ops]


__all__ = ["OperatorInfo", "PartitionFiles", "PartitionInfo", "describe_operator", "describe_root",
           "list_operators", "parse_manifest_name", "partition_files"]
