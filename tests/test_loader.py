"""Loading states from files alone: lineage walks, snapshots, attempts decided by the manifest,
fresh processes, missing and corrupt files, and retention that never breaks a kept state."""
import json
import subprocess
import sys

import pytest

from statestore_async.codecs.keylayout import store_key
from statestore_async.engine.store import VersionedStore
from statestore_async.errors import CorruptFileError, LineageError, VersionNotFoundError
from statestore_async.files.loader import load_store
from statestore_async.files.manifest import Manifest, read_manifest, write_manifest
from statestore_async.files.names import DELTA, SNAPSHOT, file_key
from statestore_async.files.retention import cleanup_store
from statestore_async.files.transfer import write_delta, write_snapshot
from statestore_async.ids import CheckpointRef, StoreId
from statestore_async.objectstore import LocalObjectStore


class NoListStore(LocalObjectStore):
    """A local store that records every call and refuses LIST (the hot path must not need it)."""

    def __init__(self, root):
        super().__init__(root)
        self.calls = []

    async def get(self, key, start=None, end=None):
        self.calls.append(("get", key))
        return await super().get(key, start, end)

    async def head(self, key):
        self.calls.append(("head", key))
        return await super().head(key)

    def list(self, prefix=""):
        raise AssertionError(f"LIST {prefix!r} on the load path")


@pytest.fixture
async def objstore(tmp_path):
    s = NoListStore(tmp_path / "ckpt")
    yield s
    await s.close()


def sid(objstore, partition=0):
    return StoreId(objstore.uri, "agg", partition)


def batch(v, n=50):
    """Deterministic changes of batch v: updates, inserts and a few removals."""
    puts = [(store_key(i % 97, b"key-%d" % i), b"v%d-%d" % (v, i)) for i in range(v * 7, v * 7 + n)]
    removes = [store_key(i % 97, b"key-%d" % i) for i in range(0, v * 7, 11)]
    return puts, removes


async def run_batches(objstore, store, first_version, count, snapshot_every=None):
    """Commit ``count`` batches, writing each delta (and snapshots every N). Returns {ref: state}."""
    states = {}
    for v in range(first_version, first_version + count):
        w = store.open(v)
        puts, removes = batch(v)
        for k, val in puts:
            w.put(k, val)
        for k in removes:
            w.remove(k)
        d = w.commit()
        await write_delta(objstore, d)
        states[d.ref] = dict(store.items())
        if snapshot_every and d.version % snapshot_every == 0:
            with store.freeze() as view:
                await write_snapshot(objstore, view)
            store.mark_snapshot(d.ref)
    return states


async def test_lineages_are_capped_and_still_load_hop_by_hop(objstore, monkeypatch):
    """Without snapshots a lineage would grow with every commit (and every delta header with it):
    it names at most MAX_LINEAGE refs; loads and retention go on from the oldest one's header."""
    from statestore_async.engine import store as engine
    from statestore_async.files.checkpoint import parse_header
    from statestore_async.files.retention import needed_files

    monkeypatch.setattr(engine, "MAX_LINEAGE", 4)
    store = VersionedStore(sid(objstore))
    states = await run_batches(objstore, store, 0, 21)
    for ref in states:
        key = file_key(sid(objstore), ref, DELTA)
        header = parse_header(await objstore.get(key), key)
        assert len(header.lineage) == min(4, ref.version)
    for ref, expected in states.items():
        loaded, report = await load_store(objstore, sid(objstore), ref)
        assert dict(loaded.items()) == expected and report.snapshot is None
        assert len(report.deltas) == ref.version
    head = max(states, key=lambda r: r.version)
    existing = {file_key(sid(objstore), r, DELTA) for r in states}
    assert len(await needed_files(objstore, sid(objstore), [head], existing)) == 21


async def test_every_version_loads_from_files_alone_equal_to_memory(objstore):
    store = VersionedStore(sid(objstore))
    states = await run_batches(objstore, store, 0, 23, snapshot_every=5)
    for ref, expected in states.items():
        objstore.calls.clear()
        loaded, report = await load_store(objstore, sid(objstore), ref)
        assert dict(loaded.items()) == expected
        assert loaded.head == ref
        # only the files the lineage names: its own snapshot, or the nearest one below plus deltas
        base = (ref.version // 5) * 5
        if base == ref.version:
            assert report.snapshot == ref and report.deltas == []
        else:
            assert report.snapshot is None if base == 0 else report.snapshot.version == base
            assert [d.version for d in report.deltas] == list(range(base + 1, ref.version + 1))
        assert all(op in ("get", "head") for op, _ in objstore.calls)
        # a loaded store goes on committing with the right lineage
        w = loaded.open(ref.version)
        w.put(store_key(1, b"after-load"), b"x")
        d = w.commit()
        assert d.lineage[0] == ref


async def test_a_load_holds_a_few_deltas_not_its_whole_chain(objstore):
    """The deltas of a lineage are read while the replay runs, a few ahead of it: a load over a
    chain of 30 deltas of ~1 MB each (no snapshot, nothing local to open as runs) holds a few of
    them at a time, not all 30 (it used to fetch every delta of the chain before replaying any)."""
    import tracemalloc

    from statestore_async.files import loader

    store = VersionedStore(sid(objstore))
    keys = [store_key(i % 97, b"key-%04d" % i) for i in range(1000)]
    for v in range(30):
        w = store.open(v)
        for i, k in enumerate(keys):
            w.put(k, b"%04d-%04d" % (v, i) * 100)  # 900 bytes
        await write_delta(objstore, w.commit())
    head = store.head
    delta_bytes = 1000 * 1000  # a delta's records as bytes objects, roughly
    tracemalloc.start()
    try:
        loaded, report = await load_store(objstore, sid(objstore), head)
        _now, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(report.deltas) == 30 and dict(loaded.items()) == dict(store.items())
    # the newest delta (read to learn the lineage), REPLAY_AHEAD in flight, the one replaying, slack
    assert peak < (loader.REPLAY_AHEAD + 4) * delta_bytes, f"peak {peak / 1e6:.1f} MB for a chain of 30 deltas"


async def test_a_load_that_replays_a_long_chain_writes_its_snapshot(objstore):
    """More than ``snapshot_after`` deltas replayed: the loaded state's snapshot is written, so the
    next load reads one file; a chain within it writes nothing."""
    store = VersionedStore(sid(objstore))
    states = await run_batches(objstore, store, 0, 8)
    refs = sorted(states, key=lambda r: r.version)
    short, long_ = refs[2], refs[7]  # 3 and 8 deltas over the empty state
    loaded, report = await load_store(objstore, sid(objstore), short, snapshot_after=3)
    assert report.snapshot_written == 0 and not await objstore.exists(file_key(sid(objstore), short, SNAPSHOT))
    loaded, report = await load_store(objstore, sid(objstore), long_, snapshot_after=3)
    assert len(report.deltas) == 8 and report.snapshot_written > 0 and report.snapshot_error is None
    assert loaded.has_snapshot(long_) and dict(loaded.items()) == states[long_]
    again, report = await load_store(objstore, sid(objstore), long_, snapshot_after=3)
    assert report.snapshot == long_ and report.deltas == [] and dict(again.items()) == states[long_]
    # a store that goes on from the loaded state builds its lineage on the new snapshot
    w = loaded.open(long_.version)
    w.put(store_key(1, b"after"), b"x")
    assert w.commit().lineage == (long_,)


async def test_a_load_whose_snapshot_cannot_be_written_still_loads(tmp_path):
    """The object store refusing the snapshot (a full disk, a lost permission) costs the next load
    the chain again, not this load: it is reported and logged."""
    from statestore_async.errors import ObjectStoreAccessError

    class NoSnapshots(NoListStore):
        async def put_if_absent(self, key, data):
            if "snapshot" in key:
                raise ObjectStoreAccessError(f"put {key}: access denied (test)")
            return await super().put_if_absent(key, data)

    objstore = NoSnapshots(tmp_path / "ckpt")
    try:
        store = VersionedStore(sid(objstore))
        states = await run_batches(objstore, store, 0, 6)
        head = max(states, key=lambda r: r.version)
        loaded, report = await load_store(objstore, sid(objstore), head, snapshot_after=2)
        assert dict(loaded.items()) == states[head] and not loaded.has_snapshot(head)
        assert report.snapshot_written == 0 and "ObjectStoreAccessError" in report.snapshot_error
    finally:
        await objstore.close()


async def test_a_failed_attempt_restarts_from_the_old_version_from_files(objstore):
    store = VersionedStore(sid(objstore))
    states = await run_batches(objstore, store, 0, 3)
    v3 = max(states, key=lambda r: r.version)
    # attempt 1 of batch 3 commits version 4, then the task dies; attempt 2 runs on another node
    w = store.open(3)
    w.put(store_key(5, b"attempt"), b"one")
    first = w.commit()
    await write_delta(objstore, first)
    other_node, _ = await load_store(objstore, sid(objstore), v3)
    assert dict(other_node.items()) == states[v3]
    w = other_node.open(3)
    w.put(store_key(5, b"attempt"), b"two")
    second = w.commit()
    await write_delta(objstore, second)
    assert first.ref.version == second.ref.version == 4 and first.ckptid != second.ckptid
    assert await objstore.exists(file_key(sid(objstore), first.ref, DELTA))
    assert await objstore.exists(file_key(sid(objstore), second.ref, DELTA))
    # the manifest decides which attempt later loads see
    for chosen, value in ((second, b"two"), (first, b"one")):
        await write_manifest(objstore, Manifest("agg", 4, 1, 16, {"default": (chosen.ref,)}))
        m = await read_manifest(objstore, "agg", 4)
        loaded, _ = await load_store(objstore, sid(objstore), m.ref(0))
        assert loaded.get(store_key(5, b"attempt")) == value


LOAD_SCRIPT = """
import asyncio, json, sys
from statestore_async.ids import CheckpointRef, StoreId
from statestore_async.files.loader import load_store
from statestore_async.objectstore import open_object_store

async def main(uri, version, ckptid):
    async with open_object_store(uri) as objstore:
        store, report = await load_store(objstore, StoreId(uri, "agg", 0), CheckpointRef(version, ckptid))
        print(json.dumps({k.hex(): v.hex() for k, v in store.items()}))

asyncio.run(main(sys.argv[1], int(sys.argv[2]), sys.argv[3]))
"""


async def test_a_fresh_process_with_only_the_directory_loads_the_state(objstore):
    store = VersionedStore(sid(objstore))
    states = await run_batches(objstore, store, 0, 12, snapshot_every=4)
    ref = max(states, key=lambda r: r.version)
    out = subprocess.run(
        [sys.executable, "-c", LOAD_SCRIPT, objstore.uri, str(ref.version), ref.ckptid],
        capture_output=True, text=True, timeout=60, check=True,
    )
    loaded = {bytes.fromhex(k): bytes.fromhex(v) for k, v in json.loads(out.stdout).items()}
    assert loaded == states[ref]


async def test_missing_files_are_typed_errors(objstore):
    store = VersionedStore(sid(objstore))
    states = await run_batches(objstore, store, 0, 6)
    refs = sorted(states, key=lambda r: r.version)
    with pytest.raises(VersionNotFoundError):
        await load_store(objstore, sid(objstore), CheckpointRef(9, "a" * 32))
    await objstore.delete(file_key(sid(objstore), refs[2], DELTA))
    with pytest.raises(LineageError, match=str(refs[2].version)):
        await load_store(objstore, sid(objstore), refs[5])
    loaded, _ = await load_store(objstore, sid(objstore), refs[1])
    assert dict(loaded.items()) == states[refs[1]]


async def test_a_missing_base_snapshot_falls_back_to_its_delta(objstore):
    store = VersionedStore(sid(objstore))
    states = await run_batches(objstore, store, 0, 7, snapshot_every=4)
    ref7 = max(states, key=lambda r: r.version)
    snap4 = [r for r in states if r.version == 4][0]
    await objstore.delete(file_key(sid(objstore), snap4, SNAPSHOT))
    loaded, report = await load_store(objstore, sid(objstore), ref7)
    assert dict(loaded.items()) == states[ref7]
    assert report.snapshot is None and [d.version for d in report.deltas] == list(range(1, 8))


async def test_a_corrupt_file_is_named(objstore, tmp_path):
    store = VersionedStore(sid(objstore))
    states = await run_batches(objstore, store, 0, 3)
    ref = sorted(states, key=lambda r: r.version)[1]
    path = objstore.root / file_key(sid(objstore), ref, DELTA)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptFileError) as e:
        await load_store(objstore, sid(objstore), max(states, key=lambda r: r.version))
    assert e.value.name == file_key(sid(objstore), ref, DELTA)


async def test_retention_keeps_what_the_window_needs_and_deletes_the_rest(tmp_path):
    async with LocalObjectStore(tmp_path / "ckpt") as objstore:
        s = StoreId(objstore.uri, "agg", 0)
        store = VersionedStore(s)
        states = await run_batches(objstore, store, 0, 30, snapshot_every=10)
        # a failed attempt at an old version (garbage) and one in flight at a new version
        old_store, _ = await load_store(objstore, s, [r for r in states if r.version == 3][0])
        w = old_store.open(3)
        w.put(store_key(0, b"zombie"), b"z")
        zombie = w.commit()
        await write_delta(objstore, zombie)
        refs = sorted(states, key=lambda r: r.version)
        window = refs[-6:]  # keep the last 6 versions (25..30) loadable
        report = await cleanup_store(objstore, s, window, min_version=window[0].version)
        names = {o.key async for o in objstore.list(s.prefix + "/")}
        assert file_key(s, zombie.ref, DELTA) not in names
        # version 25..30 need snapshot 20 and deltas 21..30
        for v in range(21, 31):
            assert file_key(s, refs[v - 1], DELTA) in names
        assert file_key(s, refs[19], SNAPSHOT) in names
        assert all(not n.startswith(f"{s.prefix}/{v}_") for n in names for v in range(1, 20))
        assert len(report.deleted) > 10
        for ref in window:
            loaded, _ = await load_store(objstore, s, ref)
            assert dict(loaded.items()) == states[ref]
        # a window whose state cannot load deletes nothing
        before = {o.key async for o in objstore.list(s.prefix + "/")}
        with pytest.raises(LineageError):
            await cleanup_store(objstore, s, [CheckpointRef(40, "b" * 32)], min_version=40)
        assert {o.key async for o in objstore.list(s.prefix + "/")} == before
