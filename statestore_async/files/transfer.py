"""Checkpoint files on an object store: create a delta or snapshot once, read one back checked.

The only writer of checkpoint files (the daemon's uploader, its snapshots and the snapshot worker
all call ``create_checkpoint_file``) and the reader of one file for the loader; ``checkpoint``
does the bytes, this does the GETs and PUTs. Files are created with ``put_if_absent``: a name is
never written twice.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Unpack

from statestore_async.errors import CheckpointConflictError, CorruptFileError, ObjectExistsError, ObjectNotFoundError
from statestore_async.files.checkpoint import (
    CheckpointParser,
    CodecOptions,
    FileHeader,
    Record,
    encode_delta,
    snapshot_steps,
)
from statestore_async.files.names import DELTA, SNAPSHOT, file_key
from statestore_async.ids import CheckpointRef, StoreId

if TYPE_CHECKING:
    from statestore_async.engine.delta import Delta
    from statestore_async.engine.views import FrozenView
    from statestore_async.objectstore.base import ObjectStore


@dataclass
class ReadStats:
    """What reads did: for logs, metrics and tests (e.g. 'no LIST on the hot path')."""

    files_read: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    bytes_read: int = 0


async def create_checkpoint_file(objstore: ObjectStore, store_id: StoreId, ref: CheckpointRef, kind: str, data: bytes) -> int:
    """Create the ``kind`` file of ``ref`` with ``data``. Returns the bytes written.

    When the name is taken: a snapshot there is the same state (whoever wrote it: the state a
    lineage defines is unique), so 0 is returned; a delta there with the very same bytes is this
    upload's own earlier attempt whose answer was lost, so 0 is returned; a delta with other
    bytes raises ``CheckpointConflictError`` naming the file (two writers used one checkpoint id).
    """
    key = file_key(store_id, ref, kind)
    try:
        await objstore.put_if_absent(key, data)
        return len(data)
    except ObjectExistsError:
        if kind == SNAPSHOT:
            return 0
        there = await objstore.get(key)
        if bytes(there) == bytes(data):
            return 0
        raise CheckpointConflictError(
            f"{key} exists with other content ({len(there)} bytes, {len(data)} meant): two writers used "
            f"checkpoint id {ref.ckptid}; nothing was overwritten", key) from None


async def write_delta(objstore: ObjectStore, delta: Delta, **codec_options: Unpack[CodecOptions]) -> tuple[str, int]:
    """Create the delta file of an engine ``Delta`` (encoded here). Returns (key, size)."""
    data = encode_delta(delta, **codec_options)
    await create_checkpoint_file(objstore, delta.store_id, delta.ref, DELTA, data)
    return file_key(delta.store_id, delta.ref, DELTA), len(data)


async def snapshot_bytes(view: FrozenView, *, give_way: Callable[[], Awaitable[object]] | None = None,
                         **codec_options: Unpack[CodecOptions]) -> bytes:
    """The snapshot file of a frozen engine view, encoded in bounded steps.

    ``give_way`` (an async callable, e.g. ``asyncio.sleep(0)``-like) is awaited between the steps,
    so an event loop keeps serving requests while a large snapshot is encoded; the parts are
    joined in a thread (a large join releases the GIL).
    """
    parts: list[bytes] = []
    for item in snapshot_steps(view, **codec_options):
        if item is None:
            if give_way is not None:
                await give_way()
        else:
            parts = item
    return await asyncio.to_thread(b"".join, parts)


async def write_snapshot(objstore: ObjectStore, view: FrozenView, *, give_way: Callable[[], Awaitable[object]] | None = None,
                         **codec_options: Unpack[CodecOptions]) -> tuple[str, int]:
    """Create the snapshot file of a frozen engine view (see ``snapshot_bytes``). Returns (key, size)."""
    data = await snapshot_bytes(view, give_way=give_way, **codec_options)
    await create_checkpoint_file(objstore, view.store_id, view.ref, SNAPSHOT, data)
    return file_key(view.store_id, view.ref, SNAPSHOT), len(data)


async def read_checkpoint_file(
    objstore: ObjectStore, store_id: StoreId, ref: CheckpointRef, kind: str, stats: ReadStats | None = None
) -> tuple[FileHeader, list[Record]]:
    """GET one checkpoint file, decoding blocks as they stream in; checks that it is the file asked for.

    Returns (header, records). ``ObjectNotFoundError`` if it does not exist, ``CorruptFileError`` if
    it fails any check.
    """
    stats = stats if stats is not None else ReadStats()
    key = file_key(store_id, ref, kind)
    try:
        return await _read(objstore, key, store_id, ref, kind, stats)
    except CorruptFileError:
        # a damaged local copy (see objectstore.cache): drop it and read the origin once
        forget = getattr(objstore, "forget", None)
        if forget is None or not forget(key):
            raise
        return await _read(objstore, key, store_id, ref, kind, stats)


async def _read(objstore: ObjectStore, key: str, store_id: StoreId, ref: CheckpointRef, kind: str,
                stats: ReadStats) -> tuple[FileHeader, list[Record]]:
    parser = CheckpointParser(key, expect=(store_id, ref, kind))
    records: list[Record] = []
    try:
        async for chunk in objstore.get_stream(key):
            stats.bytes_read += len(chunk)
            records.extend(parser.feed(chunk))
    except ObjectNotFoundError:
        stats.missing.append(key)
        raise
    parser.finish()
    stats.files_read.append(key)
    assert parser.header is not None  # finish() checked it
    return parser.header, records
