"""Operator tools behind ``statestore-async inspect | verify | gc`` (no daemon needed).

- ``inspect_file``: what one checkpoint file says (header, lineage, block index), checked.
- ``verify_operator``: load every partition named by a manifest from files alone, checking every
  checksum, and report records and files — the proof that a version is recoverable.
- ``gc_operator``: operator-level retention driven by the manifests: keep the states the last
  ``keep`` manifests name (and everything their lineages need), delete older checkpoint files and
  older manifests. Attempts newer than the oldest kept manifest are never touched.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from statestore_async.errors import InterfaceError, StateStoreError
from statestore_async.files.checkpoint import read_checkpoint
from statestore_async.files.loader import load_store
from statestore_async.files.manifest import Manifest, list_manifest_versions, manifest_key, read_manifest
from statestore_async.files.names import parse_file_name
from statestore_async.files.retention import cleanup_store
from statestore_async.ids import CheckpointRef, StoreId
from statestore_async.objectstore.base import ObjectStore


@dataclass
class FileReport:
    name: str
    kind: str
    store: dict[str, str | int]
    version: int
    ckptid: str
    lineage: list[str]
    codec: str
    records: int
    tombstones: int
    blocks: list[tuple[int, int, int, int, int]]  # offset, length, records, first and last key group
    size: int


async def inspect_file(objstore: ObjectStore, key: str) -> FileReport:
    """Read and check one checkpoint file by its key under the object store's root."""
    if parse_file_name(key) is None:
        raise InterfaceError(f"{key!r} is not a checkpoint file name (<version>_<ckptid>.delta|.snapshot)")
    data = await objstore.get(key)
    f = read_checkpoint(data, key)
    h = f.header
    return FileReport(
        name=key, kind=h.kind, store=h.store, version=h.ref.version, ckptid=h.ref.ckptid,
        lineage=[str(r) for r in h.lineage], codec=h.codec, records=len(f.records),
        tombstones=sum(1 for _, v in f.records if v is None),
        blocks=[(b.offset, b.length, b.count, b.first_kg, b.last_kg) for b in f.footer.blocks], size=len(data),
    )


@dataclass
class VerifyReport:
    version: int
    # (store, partition) -> {"ref", "records", "files", "bytes"}
    partitions: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)
    errors: dict[tuple[str, int], str] = field(default_factory=dict)  # (store, partition) -> message

    @property
    def ok(self) -> bool:
        return not self.errors


async def latest_manifest(objstore: ObjectStore, operator_id: str) -> Manifest:
    versions = await list_manifest_versions(objstore, operator_id)
    if not versions:
        raise InterfaceError(f"operator {operator_id!r} has no manifest under {objstore.uri}")
    return await read_manifest(objstore, operator_id, versions[-1])


async def verify_operator(objstore: ObjectStore, root: str, operator_id: str, version: int | None = None) -> VerifyReport:
    """Load every state the manifest of ``version`` (latest when None) names; collect errors."""
    m = await (latest_manifest(objstore, operator_id) if version is None else read_manifest(objstore, operator_id, version))
    report = VerifyReport(m.version)
    for store_name, refs in m.stores.items():
        for p, ref in enumerate(refs):
            sid = StoreId(root, m.operator_id, p, store_name)
            try:
                store, lr = await load_store(objstore, sid, ref)
            except StateStoreError as exc:
                report.errors[(store_name, p)] = f"{type(exc).__name__}: {exc}"
                continue
            report.partitions[(store_name, p)] = {"ref": str(ref), "records": len(store),
                                                  "files": len(lr.files_read), "bytes": lr.bytes_read}
    return report


@dataclass
class GcReport:
    kept_manifests: list[int] = field(default_factory=list)
    deleted_manifests: list[str] = field(default_factory=list)
    deleted_files: list[str] = field(default_factory=list)


async def gc_operator(objstore: ObjectStore, root: str, operator_id: str, keep: int, *, dry_run: bool = False) -> GcReport:
    """Keep the last ``keep`` manifests' states loadable; delete older files and manifests."""
    if keep < 2:
        raise InterfaceError("keep at least the last 2 versions")
    versions = await list_manifest_versions(objstore, operator_id)
    report = GcReport()
    if len(versions) <= keep:
        report.kept_manifests = versions
        return report
    kept = versions[-keep:]
    report.kept_manifests = kept
    manifests = [await read_manifest(objstore, operator_id, v) for v in kept]
    keep_refs: dict[tuple[str, int], set[CheckpointRef]] = {}
    for m in manifests:
        for store_name, refs in m.stores.items():
            for p, ref in enumerate(refs):
                keep_refs.setdefault((store_name, p), set()).add(ref)
    for (store_name, p), wanted in sorted(keep_refs.items()):
        sid = StoreId(root, operator_id, p, store_name)
        live = [r for r in wanted if not r.is_empty_state]
        if not live:
            continue
        # files of versions above the oldest kept state may belong to attempts in flight: never touched
        min_version = min(r.version for r in live)
        r = await cleanup_store(objstore, sid, live, min_version=min_version, dry_run=dry_run)
        report.deleted_files.extend(r.deleted)
    for v in versions[:-keep]:
        key = manifest_key(operator_id, v)
        if not dry_run:
            await objstore.delete(key)
        report.deleted_manifests.append(key)
    return report


__all__ = ["gc_operator", "inspect_file", "latest_manifest", "verify_operator"]
