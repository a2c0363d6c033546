"""The cold level: a snapshot file on local disk read a block at a time (``files.coldrun``), and a
spilled engine store over it (``VersionedStore.spill``) that answers exactly as the same store kept
whole in memory — reads, ordered scans, commits, rollbacks, retries and snapshots."""
from __future__ import annotations

import json
import random

import pytest
import xxhash

from statestore_async.codecs import framing
from statestore_async.codecs.keylayout import store_key
from statestore_async.codecs.packed import PackedList
from statestore_async.daemon import payloads
from statestore_async.engine.delta import table_of
from statestore_async.engine.store import VersionedStore
from statestore_async.engine.table import Table
from statestore_async.errors import CorruptFileError, InterfaceError, VersionNotFoundError
from statestore_async.files import checkpoint
from statestore_async.files.checkpoint import encode_snapshot, read_checkpoint
from statestore_async.files.coldrun import BlockCache, ColdRun, ColdStack
from statestore_async.ids import CheckpointRef, StoreId

SID = StoreId("file:///tmp/cold", "agg", 0)


def filled(n: int, seed: int = 1, groups: int = 16) -> VersionedStore:
    rnd = random.Random(seed)
    s = VersionedStore(SID)
    w = s.open(0)
    w.put_many([(store_key(rnd.randrange(groups), b"k%06d" % i), b"v%d" % rnd.randrange(10**6)) for i in range(n)])
    w.commit()
    return s


def write_snapshot(store: VersionedStore, path, block_bytes: int = 2048) -> str:
    with store.freeze() as view:
        data = encode_snapshot(view, block_bytes=block_bytes)
    path.write_bytes(data)
    return str(path)


def test_a_run_reads_only_the_blocks_it_needs_and_matches_the_file(tmp_path):
    s = filled(5000)
    path = write_snapshot(s, tmp_path / "s")
    cache = BlockCache(1 << 30)
    run = ColdRun.open(path, SID, s.head, cache)
    records = dict(s.items())
    assert len(run) == 5000 and run.blocks_read == 0  # opening reads the header and footer only
    keys = sorted(records)
    probe = random.Random(2).sample(keys, 20)
    assert run.get_many(probe + [b"\x00\x00absent", b"\xff\xff"]) == [records[k] for k in probe] + [None, None]
    assert 1 <= run.blocks_read <= 20
    read = run.blocks_read
    assert [run.get(k) for k in probe] == [records[k] for k in probe]
    assert run.blocks_read == read and cache.hits >= 20  # the cache answered
    assert list(run.items()) == sorted(records.items())
    lo, hi = keys[1000], keys[1100]
    assert list(run.items(lo, hi)) == [(k, records[k]) for k in keys[1000:1100]]
    run.close()
    assert len(cache) == 0


def test_the_block_cache_holds_its_bound_and_drops_the_least_recent(tmp_path):
    s = filled(5000)
    run = ColdRun.open(write_snapshot(s, tmp_path / "s"), SID, s.head, cache := BlockCache(64 << 10))
    assert list(run.items()) == list(s.items())
    assert 0 < cache.nbytes <= 64 << 10 and cache.evictions > 0
    first = next(iter(s.items()))
    before = run.blocks_read
    assert run.get(first[0]) == first[1]
    assert run.blocks_read == before + 1  # the first block was evicted long ago: read again


def test_a_file_without_first_keys_opens_by_reading_its_blocks_once(tmp_path):
    s = filled(3000)
    with s.freeze() as view:
        data = encode_snapshot(view, block_bytes=2048)
    off, n, _ = checkpoint.read_trailer(data, "f")
    body = json.loads(data[off + 6: off + n])
    del body["first_keys"]
    raw = json.dumps(body, separators=(",", ":")).encode()
    footer = checkpoint._FOOT.pack(checkpoint.FOOTER_MARK, len(raw)) + raw
    old = data[:off] + footer + checkpoint._TRAIL.pack(off, len(footer), xxhash.xxh3_64_intdigest(footer),
                                                      checkpoint.END_MAGIC)
    (tmp_path / "old").write_bytes(old)
    run = ColdRun.open(str(tmp_path / "old"), SID, s.head, BlockCache(1 << 30))
    assert run.blocks_read == len(read_checkpoint(old, "old").footer.blocks)
    assert list(run.items()) == list(s.items())


def test_damage_and_the_wrong_file_are_typed_errors_naming_the_file(tmp_path):
    s = filled(3000)
    path = write_snapshot(s, tmp_path / "s")
    with pytest.raises(CorruptFileError, match="expected the snapshot"):
        ColdRun.open(path, SID, CheckpointRef(7, "ab" * 16), BlockCache(1 << 30))
    data = bytearray((tmp_path / "s").read_bytes())
    f = read_checkpoint(bytes(data), "s")
    victim = f.footer.blocks[3]
    data[victim.offset + victim.length // 2] ^= 0x40
    (tmp_path / "bad").write_bytes(bytes(data))
    run = ColdRun.open(str(tmp_path / "bad"), SID, s.head, BlockCache(1 << 30))  # the footer is intact
    with pytest.raises(CorruptFileError, match=r"bad.*block 3"):
        list(run.items())
    (tmp_path / "short").write_bytes(bytes(data[: len(data) // 2]))
    with pytest.raises(CorruptFileError):
        ColdRun.open(str(tmp_path / "short"), SID, s.head, BlockCache(1 << 30))


def test_a_store_spills_in_use_and_onto_a_state_of_its_recent_history(tmp_path):
    """An open version reads on through the cold level after its store spilled under it; a
    snapshot finished after later commits still takes the store out of memory (the hot part starts
    with the commits made since); a state older than the history cannot be the cold level."""
    s = filled(2000)
    reference = filled(2000)
    run = ColdRun.open(write_snapshot(s, tmp_path / "s"), SID, s.head, BlockCache(1 << 30))
    w = s.open(s.head.version)
    w.put(store_key(3, b"during"), b"1")
    before = w.scan_range(b"", None)
    s.spill(ColdRun.open(str(tmp_path / "s"), SID, s.head, BlockCache(1 << 30)))
    assert s.cold is not None and w.scan_range(b"", None) == before and len(w) == len(before)
    w.abort()
    s = filled(2000)
    run = ColdRun.open(write_snapshot(s, tmp_path / "s2"), SID, s.head, BlockCache(1 << 30))
    for v in range(2):  # two commits after the snapshot, one removing keys of it
        for store in (s, reference):
            w = store.open(store.head.version)
            w.put(store_key(1, b"new%d" % v), b"y")
            w.remove_many([k for k, _ in list(store.items())[v * 10: v * 10 + 5]])
            w.commit("%032x" % (v + 1))
    s.spill(run)
    assert list(s.items()) == list(reference.items()) and s.hot_bytes > 0
    old = filled(50, seed=9)
    run_old = ColdRun.open(write_snapshot(old, tmp_path / "o"), SID, old.head, BlockCache(1 << 30))
    for v in range(5):
        w = old.open(old.head.version)
        w.put(store_key(2, b"x%d" % v), b"z")
        w.commit()
    with pytest.raises(InterfaceError, match="neither the head"):
        old.spill(run_old)  # version 1 left the history (4 commits) long ago


def _compare(a: VersionedStore, b: VersionedStore, rnd: random.Random, universe: list[bytes]) -> None:
    """``b`` (spilled at times) answers exactly as ``a`` (always whole in memory)."""
    assert a.head == b.head
    assert list(a.items()) == list(b.items()) and len(a) == len(b)
    probe = rnd.sample(universe, 40)
    assert [a.get(k) for k in probe] == [b.get(k) for k in probe]
    wa, wb = a.open(a.head.version, a.head.ckptid), b.open(b.head.version, b.head.ckptid)
    assert wa.get_many(probe) == wb.get_many(probe)
    packed = PackedList(framing.encode_list(probe), 0, len(probe))
    assert payloads.get_many(wa, packed) == payloads.get_many(wb, packed)
    lo, hi = sorted(rnd.sample(universe, 2))
    assert wa.scan_range(lo, hi) == wb.scan_range(lo, hi)
    assert wa.scan_range(lo, None, limit=7) == wb.scan_range(lo, None, limit=7)
    prefix = lo[:3]
    assert list(wa.scan(prefix)) == list(wb.scan(prefix))
    wa.abort()
    wb.abort()
    with a.freeze() as va, b.freeze() as vb:
        assert len(va) == len(vb)
        if a.head.version == 0:
            return  # the empty state has no snapshot file
        got = read_checkpoint(checkpoint.encode_snapshot(vb, block_bytes=512, threads=False), "b").records
        assert got == list(va.items())


@pytest.mark.parametrize("seed", range(8))
def test_a_spilled_store_answers_as_the_store_in_memory(tmp_path, seed):
    """Random commits (puts, removals of keys in memory and of keys only on disk, removals of
    absent keys), rollbacks to earlier versions and sibling attempts, and spills at random points
    (a snapshot file of the head, opened as the cold level; a spill drops the history, so rollbacks
    reach the states committed since): after every step the spilled store reads, scans, counts and
    snapshots exactly as the same store kept whole."""
    rnd = random.Random(seed)
    universe = [store_key(rnd.randrange(8), b"k%05d" % i) for i in range(3000)]
    a, b = VersionedStore(SID, history=3), VersionedStore(SID, history=3)
    cache = BlockCache(rnd.choice([16 << 10, 1 << 30]))
    spills = 0
    for step in range(30):
        action = rnd.random()
        if action < 0.2 and b.head.version > 0:
            b.spill(ColdRun.open(write_snapshot(b, tmp_path / f"s{step}", rnd.choice([256, 4096])), SID, b.head, cache))
            spills += 1
        elif action < 0.35 and b.known_states() != [b.head]:
            # a retry: roll back (a spill drops the history: b knows only the states since)
            target = rnd.choice([r for r in b.known_states() if r != b.head])
            try:
                a.open(target.version, target.ckptid).abort()
            except VersionNotFoundError:  # a state in the history no longer linked to the head
                with pytest.raises(VersionNotFoundError):
                    b.open(target.version, target.ckptid)
                continue
            try:
                b.open(target.version, target.ckptid).abort()
            except VersionNotFoundError:
                # spilled commits keep no undo: the daemon reloads the state from files instead,
                # over its snapshot on local disk (the loader's cold path) — as done here
                assert b.cold is not None and a.head == target
                if target.version == 0:
                    b = VersionedStore(SID, history=3)
                    continue
                run = ColdRun.open(write_snapshot(a, tmp_path / f"r{step}"), SID, target, cache)
                b = VersionedStore.over_cold(SID, run, Table(), target, a.lineage, history=3)
                spills += 1
        else:
            base = a.head
            wa, wb = a.open(base.version, base.ckptid), b.open(base.version, base.ckptid)
            puts = [(k, b"s%d-%d" % (step, rnd.randrange(99))) for k in rnd.sample(universe, rnd.randrange(1, 300))]
            removes = rnd.sample(universe, rnd.randrange(0, 120))
            for w in (wa, wb):
                w.put_many(puts)
                w.remove_many(removes)
            ckptid = "%032x" % (seed * 1000 + step)
            da, db = wa.commit(ckptid), wb.commit(ckptid)
            assert list(da.records.items()) == list(db.records.items())  # the same delta file
        _compare(a, b, rnd, universe)
    assert spills >= 2


def test_a_pinned_state_keeps_every_commit_since_for_a_spill_onto_it(tmp_path):
    """A snapshot written for a spill may finish many commits after it began: the store keeps every
    commit since the state it pinned (beyond its usual history), and the spill rebuilds the hot
    part from them."""
    s, reference = VersionedStore(SID, history=2), VersionedStore(SID, history=2)
    for store in (s, reference):
        w = store.open(0)
        w.put_many([(store_key(i % 5, b"k%d" % i), b"v") for i in range(500)])
        w.commit("%032x" % 1)
    path = write_snapshot(s, tmp_path / "s")
    s.pin_history(s.head)
    for v in range(2, 9):  # seven commits: more than the history of 2
        for store in (s, reference):
            w = store.open(store.head.version)
            w.put(store_key(1, b"n%d" % v), b"%d" % v)
            w.remove(store_key(v % 5, b"k%d" % v))
            w.commit("%032x" % v)
    s.spill(ColdRun.open(path, SID, CheckpointRef(1, "%032x" % 1), BlockCache(1 << 30)))
    assert list(s.items()) == list(reference.items())


def test_delta_files_stacked_over_a_snapshot_read_as_the_state(tmp_path):
    """A ColdStack of delta runs (newest first) over a snapshot run reads exactly as the state in
    memory: puts override, a delta's tombstone hides the snapshot's value, a later put brings a
    removed key back; lookups and ordered reads alike."""
    rnd = random.Random(5)
    s = filled(3000, seed=4)
    cache = BlockCache(64 << 10)
    snap = ColdRun.open(write_snapshot(s, tmp_path / "snap", 512), SID, s.head, cache)
    universe = [k for k, _ in s.items()] + [store_key(rnd.randrange(16), b"new%d" % i) for i in range(500)]
    runs = []
    for v in range(4):
        w = s.open(s.head.version)
        w.put_many([(k, b"d%d" % v) for k in rnd.sample(universe, 400)])
        w.remove_many(rnd.sample(universe, 200))
        delta = w.commit()
        (tmp_path / f"d{v}").write_bytes(checkpoint.encode_delta(delta, block_bytes=512))
        runs.insert(0, ColdRun.open(str(tmp_path / f"d{v}"), SID, delta.ref, cache, kind="delta"))
    stack = ColdStack.over(runs, snap)
    assert stack.ref == s.head and len(stack.runs) == 5
    assert list(stack.items()) == list(s.items())
    probe = rnd.sample(universe, 300)
    assert stack.get_many(probe) == [s.get(k) for k in probe]
    lo, hi = sorted(rnd.sample(universe, 2))
    assert list(stack.items(lo, hi)) == [(k, v) for k, v in s.items() if lo <= k < hi]
    with pytest.raises(ValueError):
        ColdStack([snap, runs[0]])  # the snapshot must be the oldest run


@pytest.mark.parametrize("fixed", [True, False])
def test_the_snapshot_of_a_spilled_store_merges_by_block_and_copies_untouched_blocks(tmp_path, fixed):
    """Compaction: the snapshot of a store spilled over a snapshot run and delta runs, with a hot
    part, holds exactly the store's records (fixed-size records: spliced by numpy; variable ones:
    merged as lists) — keys with 0x00 and 0xff bytes, removals, new keys before the first and after
    the last key, blocks emptied — and the blocks no change fell in are the snapshot's own bytes."""
    rnd = random.Random(11 if fixed else 12)

    def val(tag: int) -> bytes:
        return bytes([tag % 256]) * (8 if fixed else rnd.randrange(1, 40))

    def k(i: int) -> bytes:  # 2-byte group + 6 bytes: edge bytes in the middle and at the end
        return store_key(1 + i % 3, bytes([(i * 37) % 256, 0, 255]) + i.to_bytes(3, "big"))

    universe = [k(i) for i in range(6000)]
    mem = VersionedStore(SID, history=1)
    w = mem.open(0)
    w.put_many([(key, val(1)) for key in universe[:5000]])
    w.commit("%032x" % 1)
    spilled = VersionedStore(SID, table_of(mem.items()), mem.head, (), head_has_snapshot=True, history=1)
    cache = BlockCache(1 << 20)
    snap_path = write_snapshot(spilled, tmp_path / "snap", 1024)
    spilled.spill(ColdRun.open(snap_path, SID, spilled.head, cache))
    ordered = sorted(universe[:5000])
    untouched = ordered[400]  # no change falls in the blocks below it
    edge = [store_key(0, b"\x00" * 6), store_key(65535, b"\xff" * 6)]  # before the first, after the last
    runs: list[ColdRun] = []
    for v in range(2, 7):
        keys = [x for x in rnd.sample(universe, 300) if x >= untouched] + (edge if v == 3 else [])
        gone = rnd.sample(ordered[1200:1300], 60) + (edge[:1] if v == 5 else [])
        gone += ordered[2000:2100] if v == 4 else []  # whole blocks emptied
        deltas = []
        puts = [(x, val(v)) for x in keys]
        for s in (mem, spilled):
            w = s.open(s.head.version)
            w.put_many(puts)
            w.remove_many(gone)
            deltas.append(w.commit("%032x" % v))
        if v < 6:  # the last commit stays in the hot part
            (tmp_path / f"d{v}").write_bytes(checkpoint.encode_delta(deltas[1], block_bytes=1024))
            runs.insert(0, ColdRun.open(str(tmp_path / f"d{v}"), SID, deltas[1].ref, cache, kind="delta"))
            spilled.spill(ColdStack.over(runs[:1], spilled.cold))
    assert isinstance(spilled.cold, ColdStack) and len(spilled.cold.runs) == 5 and spilled.hot_bytes > 0
    with spilled.freeze() as view:
        data = checkpoint.encode_snapshot(view, block_bytes=1024)
        stepped = b"".join(next(x for x in reversed(list(checkpoint.snapshot_steps(view, block_bytes=1024)))
                                if x is not None))
    got = read_checkpoint(data, "compacted")
    assert got.records == list(mem.items())
    assert read_checkpoint(stepped, "stepped").records == got.records
    assert got.header.ref == mem.head and got.header.kind == "snapshot"
    original = open(snap_path, "rb").read()
    copied = [b for b in got.footer.blocks if data[b.offset:b.offset + b.length] in original]
    assert len(copied) >= 5, copied  # the blocks of the untouched keys after the first, as stored
    # a compacted snapshot opens as a run again and compacts again
    (tmp_path / "again").write_bytes(data)
    again = VersionedStore(SID, head=mem.head, head_has_snapshot=True)
    again.spill(ColdRun.open(str(tmp_path / "again"), SID, mem.head, cache))
    assert list(again.items()) == list(mem.items())
