"""The write buffer (issue 20): an open version of a spilled store moves its changes to runs on
local disk (``StoreVersion.flush``) and reads on through them; its commit stacks the runs over the
cold level without reading them back, and its delta (``Delta.entries``, the delta file) holds every
change. Checked against a plain dict, with real files (``checkpoint.write_flushed``, ``ColdRun``)."""
from __future__ import annotations

import os
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_spill import DEADLINE, key, value, wait_for  # the same keys, values and waits as the spill tests

from statestore_async.engine.levels import MISSING
from statestore_async.engine.store import VersionedStore
from statestore_async.engine.table import Table
from statestore_async.errors import InterfaceError
from statestore_async.files import checkpoint
from statestore_async.files.coldrun import BlockCache, ColdRun, ColdStack
from statestore_async.files.names import DELTA, SNAPSHOT
from statestore_async.ids import CheckpointRef, StoreId, new_checkpoint_id

SID = StoreId("file:///wb", "op", 0)


def k(i: int) -> bytes:
    return bytes([0, i % 5]) + b"k%05d" % i


class Disk:
    """Writes flushed runs and snapshots into a folder, as the daemon's registry does."""

    def __init__(self, folder) -> None:
        self.folder = folder
        self.cache = BlockCache(1 << 20)
        self.n = 0
        self.runs: list[ColdRun] = []

    def _path(self, suffix: str = ".snap") -> str:
        self.n += 1
        return os.path.join(self.folder, f"{self.n}{suffix}")

    def write_run(self, version: int):
        def write(changes: Table) -> ColdRun:
            ref = CheckpointRef(version + 1, new_checkpoint_id())
            path = self._path(".flush")
            view = changes.freeze()
            try:
                checkpoint.write_flushed(path, SID, ref, view, block_bytes=256)
            finally:
                view.release()
            run = ColdRun.open(path, SID, ref, self.cache, kind=DELTA)
            os.unlink(path)
            run.flushed = True
            self.runs.append(run)
            return run
        return write

    @staticmethod
    def stack(runs, cold, ref):
        return ColdStack.over(list(runs), cold, ref)

    def snapshot(self, store: VersionedStore) -> ColdRun:
        path = self._path()
        with store.freeze() as view, open(path, "wb") as f:
            f.write(checkpoint.encode_snapshot(view, block_bytes=256))
        return ColdRun.open(path, SID, store.head, self.cache)


def spilled_store(disk: Disk, base: dict[bytes, bytes]) -> VersionedStore:
    store = VersionedStore(SID)
    w = store.open(0)
    w.put_many(base.items())
    w.commit()
    store.mark_snapshot(store.head)
    store.spill(disk.snapshot(store))
    return store


def visible(w) -> dict[bytes, bytes]:
    return dict(w.scan(b""))


def replayed(base: dict[bytes, bytes], records) -> dict[bytes, bytes]:
    """``base`` with a delta's (key, value | None) records applied, as a loader does."""
    out = dict(base)
    for x, v in records:
        if v is None:
            out.pop(x, None)
        else:
            out[x] = v
    return out


def test_a_flushed_version_reads_commits_and_writes_its_delta_exactly(tmp_path):
    disk = Disk(tmp_path)
    base = {k(i): b"base-%d" % i for i in range(0, 400)}
    store = spilled_store(disk, base)
    model = dict(base)
    w = store.open(store.head.version)
    parent = store.head
    changes: dict[bytes, bytes | None] = {}

    def put(i: int, v: bytes) -> None:
        w.put(k(i), v)
        model[k(i)] = v
        changes[k(i)] = v

    def remove(i: int) -> None:
        w.remove(k(i))
        if k(i) in model or k(i) in base:
            changes[k(i)] = None
        model.pop(k(i), None)

    for i in range(300, 600):  # overwrite cold keys, add new ones
        put(i, b"one-%d" % i)
    for i in range(0, 50):
        remove(i)  # cold keys removed
    assert w.flushable
    freed = w.flush(disk.write_run(w.version), disk.stack)
    assert freed > 0 and w.flushed_runs == 1 and w.overlay_bytes < 4096
    for i in range(550, 700):  # overwrite flushed keys, add new ones
        put(i, b"two-%d" % i)
    for i in range(300, 320):
        remove(i)  # keys only in the flushed run now (and in cold)
    remove(999)  # a key nowhere
    w.flush(disk.write_run(w.version), disk.stack)
    put(305, b"three")  # back after a removal in the newer run
    remove(560)  # removed in the overlay after two runs set it
    assert w.flushed_runs == 2

    keys = [k(i) for i in range(0, 1000)]
    assert w.get_many(keys) == [model.get(x) for x in keys]
    assert [w.get(x) for x in keys[::37]] == [model.get(x) for x in keys[::37]]
    assert visible(w) == model
    assert len(w) == len(model)
    lo, hi = k(290), k(580)
    assert w.scan_range(lo, hi) == sorted((x, v) for x, v in model.items() if lo <= x < hi)
    assert w.scan_range(lo, hi, limit=7) == sorted((x, v) for x, v in model.items() if lo <= x < hi)[:7]

    delta = w.commit(defer=True)
    assert delta.parent == parent and len(delta.runs) == 2
    with pytest.raises(InterfaceError, match="entries"):
        delta.table  # noqa: B018  (a flushed delta has no single table)
    # the store sees the commit: runs stacked under a hot part holding only the last changes
    assert isinstance(store.cold, ColdStack) and store.cold.ref == delta.ref
    assert dict(store.items()) == model
    assert [store.get(x) for x in keys] == [model.get(x) for x in keys]
    got = dict(delta.entries())
    assert {x: v for x, v in got.items() if v is not None} == {x: v for x, v in changes.items() if v is not None}
    # every removal of a key that existed is in the delta; removals of keys nowhere may or may not be
    assert {x for x, v in changes.items() if v is None} <= {x for x, v in got.items() if v is None}
    assert list(got) == sorted(got)

    # the delta file replays onto the parent's state to exactly the model
    data = checkpoint.encode_delta(delta)
    f = checkpoint.read_checkpoint(data, "delta", expect=(SID, delta.ref, DELTA))
    assert f.header.lineage == delta.lineage
    assert replayed(base, f.records) == model
    delta.close_runs()
    # the store's own handles on the runs stay open after the delta's are closed
    assert dict(store.items()) == model

    # a later commit on top, then a spill onto an older snapshot is refused (the flushed commit
    # keeps no complete redo), and one onto the head's snapshot works
    w2 = store.open(store.head.version)
    w2.put(k(5), b"later")
    model[k(5)] = b"later"
    w2.commit()
    older = ColdRun.open(_write_snapshot(disk, base, parent), SID, parent, disk.cache)
    with pytest.raises(InterfaceError):
        store.spill(older)
    store.mark_snapshot(store.head)
    store.spill(disk.snapshot(store))
    assert dict(store.items()) == model


def _write_snapshot(disk: Disk, records: dict[bytes, bytes], ref: CheckpointRef) -> str:
    path = disk._path()
    w = checkpoint.CheckpointWriter(SNAPSHOT, SID, ref, ())
    for _ in w.add_records(sorted(records.items())):
        pass
    with open(path, "wb") as f:
        f.write(w.finish())
    return path


def test_flush_needs_a_spilled_store_with_an_empty_hot_part_and_abort_closes_the_runs(tmp_path):
    disk = Disk(tmp_path)
    in_memory = VersionedStore(SID)
    w = in_memory.open(0)
    w.put(k(1), b"x")
    assert not w.flushable
    with pytest.raises(InterfaceError, match="spilled"):
        w.flush(disk.write_run(0), disk.stack)
    w.abort()

    store = spilled_store(disk, {k(i): b"v" for i in range(50)})
    w = store.open(store.head.version)
    w.put(k(1), b"y")
    w.commit()  # the hot part now holds a change: a flush would sit under it
    w = store.open(store.head.version)
    w.put(k(2), b"z")
    assert not w.flushable
    w.abort()

    store = spilled_store(disk, {k(i): b"v" for i in range(50)})
    w = store.open(store.head.version)
    w.put_many((k(i), b"new") for i in range(100))
    w.flush(disk.write_run(w.version), disk.stack)
    run = disk.runs[-1]
    assert run._fd is not None
    w.abort()
    assert run._fd is None  # the aborted version's runs are closed (their files are gone already)
    assert store.get(k(1)) == b"v" and store.get(k(70)) is None
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".flush")]  # unlinked once opened


def test_a_run_lookup_tells_a_tombstone_from_a_missing_key(tmp_path):
    disk = Disk(tmp_path)
    t = Table()
    t.put(k(1), b"one")
    t.put(k(2), None)
    run = disk.write_run(0)(t)
    assert run.lookup_many([k(1), k(2), k(3)]) == [b"one", None, MISSING]


ops = st.lists(st.tuples(st.sampled_from(["put", "remove", "flush"]), st.integers(0, 120),
                         st.integers(0, 3)), max_size=120)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=ops, seed=st.integers(0, 1000), defer=st.booleans())
def test_random_changes_with_flushes_agree_with_a_dict(tmp_path, ops, seed, defer):
    disk = Disk(tmp_path)
    rnd = random.Random(seed)
    base = {k(i): b"b%d" % i for i in rnd.sample(range(120), 60)}
    store = spilled_store(disk, base)
    model = dict(base)
    w = store.open(store.head.version)
    for op, i, v in ops:
        if op == "put":
            w.put(k(i), b"v%d" % v)
            model[k(i)] = b"v%d" % v
        elif op == "remove":
            w.remove(k(i))
            model.pop(k(i), None)
        else:
            w.flush(disk.write_run(w.version), disk.stack)
    keys = [k(i) for i in range(121)]
    assert w.get_many(keys) == [model.get(x) for x in keys]
    assert visible(w) == model
    delta = w.commit(defer=defer)
    assert dict(store.items()) == model
    assert replayed(base, delta.entries()) == model
    delta.close_runs()


# --- through a daemon ------------------------------------------------------------------------------
BIG = 120_000  # keys of one version: ~9 MB of changes in memory, three times the daemon's budget


BUDGET = {"memory_budget": 3 << 20, "spill_min_bytes": 256 << 10, "block_cache_bytes": 256 << 10,
          "snapshot_interval": 1000}


async def write_round(h, expected: dict[bytes, bytes], round_: int, rnd: random.Random, n: int) -> None:
    """One version's changes in batches of 4096: ``n`` puts over the whole key range and a removal
    of a hundredth of the keys already there."""
    idx = list(range(BIG)) if round_ == 0 else rnd.sample(range(BIG), n)
    for lo in range(0, len(idx), 4096):
        puts = [(key(i), value(i, round_)) for i in idx[lo:lo + 4096]]
        await h.put_many(puts)
        expected.update(puts)
    if round_:
        gone = [key(i) for i in rnd.sample(range(BIG), BIG // 100)]
        await h.remove_many(gone)
        for x in gone:
            expected.pop(x, None)


async def read_all(h, expected: dict[bytes, bytes]) -> None:
    everything = [key(i) for i in range(BIG)]
    for lo in range(0, BIG, 20_000):
        part = everything[lo:lo + 20_000]
        assert await h.get_many(part) == [expected.get(x) for x in part]
    a, b = key(1000), key(3000)
    assert await h.scan_range(a, b) == sorted((x, v) for x, v in expected.items() if a <= x < b)


async def test_a_version_larger_than_the_budget_flushes_and_commits_exactly(daemon_factory, tmp_path):
    """An open version whose changes alone are three times the daemon's memory budget: the daemon
    spills the empty store onto an empty snapshot file, flushes the version's changes to runs on
    local disk as they arrive (memory stays near the budget), reads through them, and commits
    without reading them back; the delta file, once durable, replaces the runs. Later versions
    flush over the stacked deltas. A new daemon on the same root loads every state exactly, and no
    flushed file is left in the scratch folder."""
    from statestore_async.client import AsyncClient
    scratch = tmp_path / "cache"
    d = await daemon_factory(**BUDGET, cache_dir=str(scratch))
    sid = StoreId(f"file://{tmp_path}/root", "wb", 0)
    rnd = random.Random(3)
    expected: dict[bytes, bytes] = {}
    async with AsyncClient(d.config.socket) as c:
        ref = CheckpointRef(0, "")
        peak_open = 0
        for round_ in range(3):
            h = await c.open(sid, ref.version, ref.ckptid or None)
            await write_round(h, expected, round_, rnd, BIG // 2)
            await wait_for(lambda: d.registry.memory_bytes <= 2 * d.registry.memory_budget,
                           "the open version's changes to leave memory")
            store = d.registry.get(sid)
            peak_open = max(peak_open, store.writer.flushed_runs)
            await read_all(h, expected)
            ref = await h.commit()
            assert await c.await_durable(sid, ref, timeout=DEADLINE)
            h = await c.open(sid, ref.version, ref.ckptid)
            await read_all(h, expected)
            await h.abort()
        st = d.registry.stats()
        assert st["flushes"] >= 3 and st["flush_errors"] == 0 and peak_open >= 1, st
        # the delta files replace the flushed runs once durable: the stack holds no flushed run
        d.registry.enforce_budget()
        store = d.registry.get(sid)
        assert isinstance(store.cold, ColdStack)
        assert not [r for r in store.cold.runs if r.flushed], store.cold.runs
    leftovers = [p for p in scratch.rglob("*") if p.is_file() and p.suffix in (".flush", ".empty")]
    assert leftovers == []
    d2 = await daemon_factory(memory_budget=1 << 30)  # a new node: the object store alone
    async with AsyncClient(d2.config.socket) as c:
        h = await c.open(sid, ref.version, ref.ckptid)
        await read_all(h, expected)
        await h.abort()


async def test_a_daemon_killed_with_flushed_changes_loses_only_the_open_version(daemon_process, tmp_path):
    """kill -9 while an open version has flushed its changes: a restarted daemon serves the last
    committed state exactly (the flushed runs were never part of it) and leaves no file behind."""
    import signal

    from statestore_async.client import AsyncClient, Client
    cache = tmp_path / "cache"
    args = ("--memory-budget", "3MiB", "--spill-min-bytes", "256KiB", "--block-cache-bytes", "256KiB",
            "--snapshot-interval", "1000", "--cache-dir", str(cache))
    sid = StoreId(f"file://{tmp_path}/root", "wb", 1)
    rnd = random.Random(5)
    expected: dict[bytes, bytes] = {}
    d = daemon_process(*args)
    with Client(d.socket) as sc:
        async with AsyncClient(d.socket) as c:
            h = await c.open(sid, 0)
            await write_round(h, expected, 0, rnd, 0)
            ref = await h.commit()
            assert await c.await_durable(sid, ref, timeout=DEADLINE)
            committed = dict(expected)
            h = await c.open(sid, ref.version, ref.ckptid)
            await write_round(h, expected, 1, rnd, BIG // 2)
            await wait_for(lambda: sc.stats()["registry"]["flushes"] >= 2, "the open version to flush")
    assert d.kill() == -signal.SIGKILL
    d2 = daemon_process(*args)
    async with AsyncClient(d2.socket) as c:
        h = await c.open(sid, ref.version, ref.ckptid)
        await read_all(h, committed)
        await h.abort()
    leftovers = [p for p in cache.rglob("*") if p.is_file() and p.suffix in (".flush", ".empty")]
    assert leftovers == []


def test_a_version_flushed_whole_at_its_commit_writes_its_delta_from_the_run_blocks(tmp_path):
    """Every change in one run and none after it (the daemon flushes a large version at its
    commit): the delta file is the run's block payloads compressed again, with the same records,
    lineage and key-group ranges as one written from the changes."""
    disk = Disk(tmp_path)
    base = {k(i): b"base-%d" % i for i in range(0, 300)}
    store = spilled_store(disk, base)
    w = store.open(store.head.version)
    changes: dict[bytes, bytes | None] = {}
    for i in range(200, 900):
        w.put(k(i), b"new-%d" % i)
        changes[k(i)] = b"new-%d" % i
    for i in range(0, 40):
        w.remove(k(i))
        changes[k(i)] = None
    w.flush(disk.write_run(w.version), disk.stack)
    delta = w.commit()
    assert len(delta.runs) == 1 and delta.entries_in_memory == 0
    data = checkpoint.encode_delta(delta, block_bytes=1024)
    f = checkpoint.read_checkpoint(data, "delta", expect=(SID, delta.ref, DELTA))
    assert f.header.lineage == delta.lineage
    assert f.records == sorted(changes.items())
    # a reader by block finds every key (the index's first keys and key groups are right)
    path = os.path.join(tmp_path, "delta.bin")
    with open(path, "wb") as fh:
        fh.write(data)
    run = ColdRun.open(path, SID, delta.ref, disk.cache, kind=DELTA)
    keys = sorted(changes)
    assert run.lookup_many(keys) == [changes[x] for x in keys]
    assert len(run._blocks) > 1
    for e in run._blocks:
        assert e.first_kg <= e.last_kg
    delta.close_runs()


async def test_flushed_versions_move_onto_new_snapshots_with_the_deltas_since_stacked(daemon_factory, tmp_path):
    """Snapshots every 2 versions while every version flushes: a snapshot finished behind the head
    cannot be spilled onto by replaying the history (flushed commits keep no complete redo), so the
    delta files since it are stacked over it, as soon as they are durable. Reads stay exact, the
    stack stays shallow (it does not grow by one run per version), and no run in it is closed."""
    from statestore_async.client import AsyncClient
    d = await daemon_factory(**dict(BUDGET, snapshot_interval=2), cache_dir=str(tmp_path / "cache"))
    sid = StoreId(f"file://{tmp_path}/root", "wb", 2)
    rnd = random.Random(9)
    expected: dict[bytes, bytes] = {}
    async with AsyncClient(d.config.socket) as c:
        ref = CheckpointRef(0, "")
        for round_ in range(7):
            h = await c.open(sid, ref.version, ref.ckptid or None)
            await write_round(h, expected, round_, rnd, BIG // 3)
            ref = await h.commit()
            assert await c.await_durable(sid, ref, timeout=DEADLINE)
            await wait_for(lambda: d.maintenance.counters["snapshots"] >= round_ // 2, "the snapshots")
            d.registry.enforce_budget()
            h = await c.open(sid, ref.version, ref.ckptid)
            await read_all(h, expected)
            await h.abort()
        store = d.registry.get(sid)
        runs = store.cold.runs if isinstance(store.cold, ColdStack) else [store.cold]
        assert all(r._fd is not None for r in runs)
        assert runs[-1].ref.version >= 2, runs  # the base is a snapshot the daemon wrote, not the empty one
        assert len(runs) <= 4, runs
        assert d.registry.stats()["flushes"] >= 7


def test_the_snapshot_of_flushed_versions_over_an_empty_snapshot_is_their_merge(tmp_path):
    """A store spilled onto an empty snapshot (a first large version) whose later versions flushed:
    its compaction takes the changes a key range at a time, split by the largest run's blocks
    (nothing is held whole), and writes exactly the store's records."""
    disk = Disk(tmp_path)
    store = spilled_store(disk, {})
    model: dict[bytes, bytes] = {}
    rnd = random.Random(4)
    for v in range(4):
        w = store.open(store.head.version)
        for i in rnd.sample(range(3000), 900):
            w.put(k(i), b"v%d-%d" % (v, i))
            model[k(i)] = b"v%d-%d" % (v, i)
        for i in rnd.sample(range(3000), 50):
            w.remove(k(i))
            model.pop(k(i), None)
        w.flush(disk.write_run(w.version), disk.stack)
        w.commit()
    w = store.open(store.head.version)  # a last change in the hot part
    w.put(k(5), b"hot")
    model[k(5)] = b"hot"
    w.commit()
    assert isinstance(store.cold, ColdStack) and len(store.cold.runs[-1]._blocks) == 0
    assert len(max(store.cold.runs[:-1], key=len)._blocks) > 32  # several groups
    with store.freeze() as view:
        data = checkpoint.encode_snapshot(view, block_bytes=512)
    got = checkpoint.read_checkpoint(data, "compacted")
    assert got.records == sorted(model.items())
