"""Retention: delete checkpoint files that no state inside the retention window needs.

The caller says which committed states must stay loadable (``keep``: e.g. every partition's state
named by the last M manifests) and a ``min_version`` below which files may go. A file is deleted
only if its version is below ``min_version`` *and* the lineage of no kept state leads to it — the
same walk the loader does (own snapshot, else delta + lineage back to a snapshot or version 0). If
a kept state is not loadable from the files listed, nothing at all is deleted. Files of versions at
or above ``min_version`` (attempts in flight on other nodes, states not yet in a manifest) are never
touched, so concurrent daemons working the same store are safe.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from statestore_async.errors import InterfaceError, LineageError
from statestore_async.files.checkpoint import FileHeader, header_length, parse_header
from statestore_async.files.names import DELTA, SNAPSHOT, file_key, parse_file_name
from statestore_async.ids import CheckpointRef, StoreId

if TYPE_CHECKING:
    from statestore_async.objectstore.base import ObjectStore

log = logging.getLogger(__name__)


@dataclass
class CleanupReport:
    listed: int = 0
    needed: set[str] = field(default_factory=set)
    deleted: list[str] = field(default_factory=list)
    kept_recent: int = 0


async def _read_header(objstore: ObjectStore, key: str, cache: dict[str, FileHeader] | None = None) -> FileHeader:
    if cache is not None and key in cache:
        return cache[key]
    head = await objstore.get(key, 0, 65536)
    need = header_length(head, key)
    if len(head) < need:
        head = await objstore.get(key, 0, need)
    header = parse_header(head, key)
    if cache is not None:
        cache[key] = header  # files never change: a header read once stays true
    return header


async def needed_files(objstore: ObjectStore, store_id: StoreId, keep: Iterable[CheckpointRef], existing: set[str],
                       *, skip_broken: bool = False, header_cache: dict[str, FileHeader] | None = None) -> set[str]:
    """Every file the loads of ``keep`` read, given the set of existing keys.

    A kept state that cannot load raises ``LineageError`` — or, with ``skip_broken``, is left out
    (it is garbage nobody can load: e.g. an old attempt whose base was already collected).
    """
    needed: set[str] = set()
    done: set[CheckpointRef] = set()

    async def walk(ref: CheckpointRef, wanted_by: CheckpointRef) -> None:
        while not ref.is_empty_state and ref not in done:
            done.add(ref)
            snap = file_key(store_id, ref, SNAPSHOT)
            delta = file_key(store_id, ref, DELTA)
            if delta in existing:
                needed.add(delta)  # kept even beside a snapshot: a fallback if the snapshot is damaged
            if snap in existing:
                needed.add(snap)
                return
            if delta not in existing:
                raise LineageError(f"state {ref} (needed by {wanted_by}) has no file in {store_id}")
            header = await _read_header(objstore, delta, header_cache)
            lineage = header.lineage
            for r in lineage[:-1]:
                k = file_key(store_id, r, DELTA)
                if k not in existing:
                    raise LineageError(f"delta {r} (lineage of {ref}, needed by {wanted_by}) is missing in {store_id}")
                needed.add(k)
                done.add(r)
            ref = lineage[-1] if lineage else CheckpointRef(0, "")

    for ref in keep:
        if not skip_broken:
            await walk(ref, ref)
            continue
        before, before_done = set(needed), set(done)
        try:
            await walk(ref, ref)
        except LineageError as exc:
            log.warning("retention of %s: %s; that state is not kept", store_id, exc)
            needed, done = before, before_done
    return needed


async def cleanup_store(
    objstore: ObjectStore,
    store_id: StoreId,
    keep: Iterable[CheckpointRef] | None,
    *,
    min_version: int,
    dry_run: bool = False,
    header_cache: dict[str, FileHeader] | None = None,
) -> CleanupReport:
    """Delete the files of ``store_id`` older than ``min_version`` that no kept state needs.

    ``keep=None`` keeps every state that has a file at ``min_version`` or above (every attempt in
    the window, in a manifest or not); states among those that cannot load are skipped.
    ``header_cache`` (key → parsed header), kept by a caller across cleanups, saves re-reading
    the headers of files that were already walked; deleted files leave it.
    """
    keep = list(keep) if keep is not None else None
    if keep is not None and not keep:
        raise InterfaceError("cleanup needs at least one state to keep")
    if min_version < 0:
        raise InterfaceError("versions are >= 0")
    report = CleanupReport()
    files: dict[str, CheckpointRef] = {}
    async for info in objstore.list(store_id.prefix + "/"):
        parsed = parse_file_name(info.key)
        if parsed is not None and info.key.rsplit("/", 1)[0] == store_id.prefix:
            files[info.key] = parsed[0]
    report.listed = len(files)
    window = keep is None
    if keep is None:
        keep = sorted({ref for ref in files.values() if ref.version >= min_version}, reverse=True)
        if not keep:
            return report
    report.needed = await needed_files(objstore, store_id, keep, set(files), skip_broken=window,
                                       header_cache=header_cache)
    doomed = []
    for key, ref in sorted(files.items(), key=lambda kv: kv[1].version):
        if ref.version >= min_version:
            report.kept_recent += 1
        elif key not in report.needed:
            doomed.append(key)
    if doomed and not dry_run:
        await objstore.delete_many(doomed)
        if header_cache is not None:
            for key in doomed:
                header_cache.pop(key, None)
    report.deleted.extend(doomed)
    log.info("cleanup of %s: %d files, %d needed, %d deleted", store_id, report.listed, len(report.needed), len(report.deleted))
    return report


__all__ = ["CleanupReport", "cleanup_store", "needed_files"]
