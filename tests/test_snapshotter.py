"""Snapshots built by the worker process (``snapshotter``): same records as the daemon's own, typed
errors, a worker that left is started again, and it stops with its daemon."""
from __future__ import annotations

import asyncio
import os

import pytest

from statestore_async.daemon.snapshotter import SnapshotWorker
from statestore_async.engine.store import VersionedStore
from statestore_async.errors import VersionNotFoundError
from statestore_async.files.checkpoint import read_checkpoint
from statestore_async.files.loader import load_store
from statestore_async.files.names import SNAPSHOT, file_key, file_name, is_checkpoint_file
from statestore_async.files.transfer import write_delta
from statestore_async.ids import CheckpointRef, StoreId
from statestore_async.objectstore import open_object_store
from statestore_async.objectstore.cache import CachingObjectStore

pytestmark = pytest.mark.asyncio(loop_factories=["asyncio", "uvloop"])


def key(i: int) -> bytes:
    return (i % 64).to_bytes(2, "big") + b"k%05d" % i


async def committed_store(tmp_path, versions=12):
    """A store whose deltas are in a local object store: returns (object store, store, refs)."""
    root = f"file://{tmp_path}/ckpt"
    objstore = open_object_store(root)
    store = VersionedStore(StoreId(root, "op", 3))
    refs = []
    for v in range(versions):
        w = store.open(v)
        w.put_many([(key(i), b"v%d-%d" % (v, i)) for i in range(v * 50, v * 50 + 400)])
        w.remove_many([key(i) for i in range(0, v * 50, 7)])
        delta = w.commit()
        await write_delta(objstore, delta)
        refs.append(delta.ref)
    return objstore, store, refs


async def test_the_worker_snapshot_holds_the_state_and_loads_alone(tmp_path):
    objstore, store, refs = await committed_store(tmp_path)
    worker = SnapshotWorker({"s3": {}, "cache_dir": "", "cache_bytes": 0})
    try:
        size = await worker.snapshot(store.store_id, store.head)
        assert size > 0
        assert await worker.snapshot(store.store_id, store.head) == 0  # it exists: nothing overwritten
        data = await objstore.get(file_key(store.store_id, store.head, SNAPSHOT))
        f = read_checkpoint(data, file_name(store.head, SNAPSHOT), expect=(store.store_id, store.head, SNAPSHOT))
        assert dict(f.records) == dict(store.items())
        # a later load starts from it: no delta read
        loaded, report = await load_store(objstore, store.store_id, store.head)
        assert dict(loaded.items()) == dict(store.items()) and report.snapshot == store.head and not report.deltas
        assert worker.stats()["worker_running"] == 1 and worker.stats()["worker_requests"]["GET"] >= len(refs)
    finally:
        await worker.close()
    assert worker.stats()["worker_running"] == 0
    await objstore.close()


def files_under(folder) -> dict:
    return {p.relative_to(folder).as_posix(): p.stat().st_size for p in folder.rglob("*") if p.is_file()}


async def test_copies_the_worker_puts_in_the_node_cache_count_against_the_daemons_bound(tmp_path):
    objstore, store, refs = await committed_store(tmp_path)
    cache = CachingObjectStore(objstore, tmp_path / "cache", 1 << 30, cacheable=is_checkpoint_file)  # the daemon's, empty
    worker = SnapshotWorker({"s3": {}, "cache_dir": str(tmp_path / "cache"), "cache_bytes": 1 << 30})
    try:
        assert await worker.snapshot(store.store_id, store.head, cache) > 0
    finally:
        await worker.close()
    on_disk = files_under(cache.dir)
    snap = file_key(store.store_id, store.head, SNAPSHOT)
    assert snap in on_disk and len(on_disk) == 1 + len(refs)  # its snapshot and the deltas it read
    assert cache.cached_keys() == set(on_disk) and cache.total == sum(on_disk.values())
    assert await cache.get(snap) == await objstore.get(snap) and cache.hits == 1
    # the bound covers them: over it, the least recently used copies go, the worker's included
    cache.max_bytes = on_disk[snap] + 10
    cache.adopt(snap)
    assert files_under(cache.dir) == {snap: on_disk[snap]} and cache.total == on_disk[snap]
    cache.adopt("op/3/no-such-file")  # gone again: nothing counted
    assert cache.cached_keys() == {snap}
    await objstore.close()


async def test_errors_come_back_typed_and_the_worker_keeps_serving(tmp_path):
    objstore, store, refs = await committed_store(tmp_path, versions=3)
    worker = SnapshotWorker({"s3": {}, "cache_dir": "", "cache_bytes": 0})
    try:
        with pytest.raises(VersionNotFoundError):
            await worker.snapshot(store.store_id, CheckpointRef(40, "0" * 32))
        assert await worker.snapshot(store.store_id, refs[1]) > 0
        assert worker.starts == 1
    finally:
        await worker.close()
    await objstore.close()


async def test_a_worker_that_left_or_died_is_started_again(tmp_path):
    objstore, store, refs = await committed_store(tmp_path, versions=4)
    worker = SnapshotWorker({"s3": {}, "cache_dir": "", "cache_bytes": 0}, idle_seconds=0.3)
    try:
        assert await worker.snapshot(store.store_id, refs[0]) > 0
        await asyncio.wait_for(worker._proc.wait(), 30)  # idle for 0.3 s: it leaves
        assert await worker.snapshot(store.store_id, refs[1]) > 0
        os.kill(worker._proc.pid, 9)
        assert await asyncio.wait_for(worker._proc.wait(), 30) == -9
        assert await worker.snapshot(store.store_id, refs[2]) > 0
        assert worker.starts == 3
    finally:
        await worker.close()
    await objstore.close()
