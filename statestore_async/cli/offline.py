"""Operator tools behind ``statestore-async inspect | verify | gc | ls | show | export | diff`` (no daemon needed).

- ``inspect_file``: what one checkpoint file says (header, lineage, block index), checked.
- ``verify_operator``: load every partition named by a manifest from files alone, checking every
  checksum, and report records and files — the proof that a version is recoverable.
- ``gc_operator``: operator-level retention driven by the manifests: keep the states the last
  ``keep`` manifests name (and everything their lineages need), delete older checkpoint files,
  older manifests and (by default) orphaned attempts. Files newer than the newest state a kept
  manifest names are never touched.
- ``ls_root``, ``show_rows``, ``export_state``, ``diff_versions``, ``inspect_manifest``,
  ``file_status``: what ``statestore-async ls | show | export | diff | inspect`` show, read with
  ``state.reader`` / ``state.changes`` / ``state.metadata`` (no Spark session, no daemon).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from statestore_async.errors import InterfaceError, StateStoreError
from statestore_async.files.checkpoint import read_checkpoint
from statestore_async.files.loader import load_store
from statestore_async.files.manifest import Manifest, list_manifest_versions, manifest_key, read_manifest
from statestore_async.files.names import parse_file_name
from statestore_async.files.retention import cleanup_store
from statestore_async.ids import CheckpointRef, StoreId
from statestore_async.objectstore.base import ObjectStore

if TYPE_CHECKING:
    from statestore_async.state.metadata import OperatorInfo


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
    orphaned_files: list[str] = field(default_factory=list)  # of deleted_files: attempts no kept manifest names

    def to_json(self) -> dict[str, Any]:
        return {"kept_manifests": self.kept_manifests, "deleted_manifests": self.deleted_manifests,
                "deleted_files": self.deleted_files, "orphaned_files": self.orphaned_files}


async def gc_operator(objstore: ObjectStore, root: str, operator_id: str, keep: int, *, dry_run: bool = False,
                      orphans: bool = True) -> GcReport:
    """Keep the last ``keep`` manifests' states loadable; delete older files and manifests.

    ``orphans`` (the default): also delete the orphaned attempts of each partition — files no kept
    manifest's state needs, at or below the newest version a kept manifest names for the partition
    (a losing task attempt, a batch whose manifest was never written: nothing can load them). Files
    above that version may be the attempt of a batch running now and are never touched. Without
    ``orphans``, every file at or above the oldest kept state of a partition stays."""
    if keep < 2:
        raise InterfaceError("keep at least the last 2 versions")
    versions = await list_manifest_versions(objstore, operator_id)
    report = GcReport()
    kept = versions[-keep:]
    report.kept_manifests = kept
    if len(versions) <= keep and not orphans:
        return report
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
        oldest = min(r.version for r in live)
        # files above the newest kept state (orphans: False, the oldest) may belong to attempts in flight
        min_version = max(r.version for r in live) + 1 if orphans else oldest
        r = await cleanup_store(objstore, sid, live, min_version=min_version, dry_run=dry_run)
        report.deleted_files.extend(r.deleted)
        report.orphaned_files.extend(k for k in r.deleted if (parsed := parse_file_name(k)) and parsed[0].version >= oldest)
    for v in versions[:-keep] if len(versions) > keep else []:
        key = manifest_key(operator_id, v)
        if not dry_run:
            await objstore.delete(key)
        report.deleted_manifests.append(key)
    return report


# --- seeing the state: ls, show, export, diff, inspect of manifests (issue 22) ----------------------
async def ls_root(objstore: ObjectStore, root: str, operator_id: str | None = None,
                  version: int | None = None) -> list[OperatorInfo]:
    """Every operator under the root (or one), with its versions and its partitions at ``version``
    (the latest when None): record counts, bytes, orphaned attempts (``state.metadata``)."""
    from statestore_async.state.metadata import describe_operator, list_operators

    if operator_id is None and version is not None:
        raise InterfaceError("--version needs --operator: versions are an operator's")
    ops = [operator_id] if operator_id is not None else await list_operators(objstore)
    return [await describe_operator(objstore, root, op, version, records=True) for op in ops]


def _key_matches(key: tuple, wanted: tuple | None) -> bool:
    return wanted is None or key == wanted


async def show_rows(objstore: ObjectStore, root: str, operator_id: str, version: int | None = None, *,
                    partition: int | None = None, key: tuple | None = None, state_var: str | None = None,
                    limit: int | None = 20, now_ms: int | None = None, include_expired: bool = False) -> pa.Table:
    """The state rows (``state.reader``'s columns) of one partition (or all) at ``version``, those
    of grouping key ``key`` only when given, at most ``limit`` (None: all)."""
    from statestore_async.state.reader import StateColumns, partition_rows, plan_read

    if limit is not None and limit < 0:
        raise InterfaceError(f"--limit is a number of rows >= 0, got {limit}")
    read = await plan_read(objstore, root, operator_id, version, state_var=state_var, partition=partition,
                           now_ms=now_ms, include_expired=include_expired)
    parts = []
    left = limit
    for p in read.partitions:
        rows = [r for r in await partition_rows(objstore, read, p) if _key_matches(r[1], key)]
        if left is not None:
            rows = rows[:left]
            left -= len(rows)
        parts.append((p, rows))
        if left == 0:
            break
    cols = StateColumns(read.layout, read.state_var)
    for _p, rows in parts:
        cols.observe(rows)
    tables = [cols.table(p, rows) for p, rows in parts if rows]
    return pa.concat_tables(tables) if tables else cols.schema().empty_table()


@dataclass
class ExportReport:
    path: str
    format: str
    version: int
    rows: int = 0
    partitions: int = 0
    bytes: int = 0
    seconds: float = 0.0

    @property
    def rows_per_second(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else 0.0


EXPORT_FORMATS = ("parquet", "jsonl")


async def export_state(objstore: ObjectStore, root: str, operator_id: str, path: str, *, fmt: str = "parquet",
                       version: int | None = None, state_var: str | None = None, partition: int | None = None,
                       now_ms: int | None = None, include_expired: bool = False,
                       progress: Callable[[str, int, int], None] | None = None) -> ExportReport:
    """Write the state rows of ``version`` to ``path`` (a new local file: Parquet or JSON lines).

    Two passes over the partitions: the first infers the columns' types, the second writes the
    rows, one partition at a time (memory: one partition's rows). ``progress(phase, partition
    index, partitions)`` is called after each partition of each phase ("types", "rows")."""
    import os
    import time

    from statestore_async.state.reader import StateColumns, partition_rows, plan_read

    if fmt not in EXPORT_FORMATS:
        raise InterfaceError(f"export format {fmt!r}: use one of {', '.join(EXPORT_FORMATS)}")
    if os.path.exists(path):
        raise InterfaceError(f"{path!r} exists: export writes a new file (remove it or choose another path)")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise InterfaceError(f"no folder {folder!r} for the export file {path!r}")
    t0 = time.perf_counter()
    read = await plan_read(objstore, root, operator_id, version, state_var=state_var, partition=partition,
                           now_ms=now_ms, include_expired=include_expired)
    report = ExportReport(path, fmt, read.manifest.version, partitions=len(read.partitions))
    cols = StateColumns(read.layout, read.state_var)
    n = len(read.partitions)
    for i, p in enumerate(read.partitions):
        cols.observe(await partition_rows(objstore, read, p))
        if progress:
            progress("types", i + 1, n)
    schema = cols.schema()
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        if fmt == "parquet":
            import pyarrow.parquet as pq

            with pq.ParquetWriter(tmp, schema) as writer:
                for i, p in enumerate(read.partitions):
                    table = cols.table(p, await partition_rows(objstore, read, p))
                    writer.write_table(table)
                    report.rows += table.num_rows
                    if progress:
                        progress("rows", i + 1, n)
        else:
            with open(tmp, "w", encoding="utf-8") as fh:
                for i, p in enumerate(read.partitions):
                    table = cols.table(p, await partition_rows(objstore, read, p))
                    for row in table.to_pylist():
                        fh.write(json_line(row))
                    report.rows += table.num_rows
                    if progress:
                        progress("rows", i + 1, n)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    report.bytes = os.path.getsize(path)
    report.seconds = time.perf_counter() - t0
    return report


def json_line(row: dict[str, Any]) -> str:
    """One row as a line of JSON (dates, datetimes, Decimals and bytes as their ``str``; an Arrow
    map's ``[(key, value), ...]`` as an array of pairs)."""
    import json

    return json.dumps(row, default=str, separators=(",", ":")) + "\n"


async def diff_versions(objstore: ObjectStore, root: str, operator_id: str, start_version: int,
                        end_version: int | None = None, *, state_var: str | None = None, partition: int | None = None,
                        old_values: bool = True, limit: int | None = None) -> pa.Table:
    """The change feed (``state.changes``) from ``start_version`` to ``end_version``, at most ``limit`` rows."""
    from statestore_async.state.changes import ChangeColumns, partition_changes, plan_changes

    read = await plan_changes(objstore, root, operator_id, start_version, end_version, state_var=state_var,
                              partition=partition, old_values=old_values)
    parts = [(p, await partition_changes(objstore, read, p)) for p in read.partitions]
    changes = sorted(((p, c) for p, cs in parts for c in cs), key=lambda pc: pc[1].version)  # stable: commit order
    if limit is not None:
        changes = changes[:limit]
    cols = ChangeColumns(read.layout, read.state_var)
    cols.observe([c for _p, c in changes])
    tables = [cols.table(p, [c]) for p, c in changes]
    return pa.concat_tables(tables) if tables else cols.schema().empty_table()


@dataclass
class ManifestReport:
    key: str
    manifest: Manifest

    def to_json(self) -> dict[str, Any]:
        m = self.manifest
        return {"key": self.key, "kind": "manifest", "operator_id": m.operator_id, "version": m.version,
                "num_partitions": m.num_partitions, "num_key_groups": m.num_key_groups, "created": m.created,
                "metadata": m.metadata, "stores": {n: [str(r) for r in refs] for n, refs in m.stores.items()}}


async def inspect_manifest(objstore: ObjectStore, key: str) -> ManifestReport:
    """Read and check one manifest ``<operator>/_commits/<version>.json``."""
    from statestore_async.state.metadata import parse_manifest_name

    parts = key.split("/")
    version = parse_manifest_name(parts[-1]) if len(parts) == 3 and parts[1] == "_commits" else None
    if version is None:
        raise InterfaceError(f"{key!r} is not a manifest name (<operator>/_commits/<version>.json)")
    return ManifestReport(key, await read_manifest(objstore, parts[0], version))


async def file_status(objstore: ObjectStore, root: str, key: str) -> str:
    """What the operator's manifests make of one checkpoint file: ``named`` (a manifest's state),
    ``needed`` (in the lineage of one), ``orphaned`` or ``pending`` (see ``state.metadata``)."""
    from statestore_async.state.metadata import partition_files, read_manifests

    parsed = parse_file_name(key)
    parts = key.split("/")
    if parsed is None or len(parts) != 4 or not parts[1].isdigit():
        return "unknown"
    operator_id, partition, store_name = parts[0], int(parts[1]), parts[2]
    versions = await list_manifest_versions(objstore, operator_id)
    manifests = await read_manifests(objstore, operator_id, versions)
    named = {m.stores[store_name][partition] for m in manifests
             if store_name in m.stores and partition < len(m.stores[store_name])}
    if parsed[0] in named:
        return "named"
    files = await partition_files(objstore, StoreId(root, operator_id, partition, store_name), named)
    if key in files.needed:
        return "needed"
    return "orphaned" if parsed[0].version <= files.newest_named else "pending"


__all__ = ["diff_versions", "export_state", "file_status", "gc_operator", "inspect_file", "inspect_manifest",
           "latest_manifest", "ls_root", "show_rows", "verify_operator"]
