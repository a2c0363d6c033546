"""State larger than the memory budget (issue 20): stores spill onto their snapshot files on local
disk and read them back by block; a daemon killed with state on disk restarts over its local files;
a new node recovers from the object store alone. Real daemons, a real SeaweedFS for the S3 cases.
Every wait is for a condition, with a generous deadline."""
from __future__ import annotations

import asyncio
import pathlib
import random
import signal
import time

import pytest

from statestore_async.client import AsyncClient, Client
from statestore_async.files.coldrun import ColdStack
from statestore_async.files.names import DELTA, file_name
from statestore_async.ids import EMPTY_STATE, CheckpointRef, StoreId

DEADLINE = 90.0
KEYS = 40_000
# these tests follow the committed map's way to disk (snapshot, stacked deltas, reload); the write
# buffer (a large version flushing its changes, tests/test_write_buffer.py) is kept out of them
NO_FLUSH = 1 << 30


def key(i: int) -> bytes:
    return bytes([0, i % 7]) + b"key-%06d" % i


def value(i: int, round_: int) -> bytes:
    return b"r%03d-" % round_ + b"%035d" % (i * 7919 % 10**9)


async def wait_for(condition, what: str, timeout: float = DEADLINE) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f} s waiting for {what}"
        await asyncio.sleep(0.05)


async def fill(c: AsyncClient, sid: StoreId, expected: dict[bytes, bytes], rounds: int, rnd: random.Random,
               ref: CheckpointRef = EMPTY_STATE) -> CheckpointRef:
    """Commit ``rounds`` versions: the first writes every key, later ones rewrite a tenth and remove
    a hundredth (keys on disk among them, once spilled); ``expected`` follows."""
    for r in range(rounds):
        h = await c.open(sid, ref.version, ref.ckptid or None)
        keys = range(KEYS) if not expected else rnd.sample(range(KEYS), KEYS // 10)
        puts = [(key(i), value(i, r)) for i in keys]
        await h.put_many(puts)
        expected.update(puts)
        if r:
            gone = [key(i) for i in rnd.sample(range(KEYS), KEYS // 100)]
            await h.remove_many(gone)
            for k in gone:
                expected.pop(k, None)
        ref = await h.commit()
        assert await c.await_durable(sid, ref, timeout=DEADLINE)
    return ref


async def check(c: AsyncClient, sid: StoreId, ref: CheckpointRef, expected: dict[bytes, bytes]) -> None:
    h = await c.open(sid, ref.version, ref.ckptid)
    everything = [key(i) for i in range(KEYS)]
    assert await h.get_many(everything) == [expected.get(k) for k in everything]
    lo, hi = key(100), key(2000)
    assert await h.scan_range(lo, hi) == sorted((k, v) for k, v in expected.items() if lo <= k < hi)
    await h.abort()


async def test_a_store_over_the_budget_spills_to_its_snapshot_file_and_reads_back_exactly(daemon_factory, tmp_path):
    """A store whose map alone is over the budget is snapshotted at its head and spilled onto that
    file: its map in memory empties, the daemon's count falls under the budget, and every read,
    scan and later commit (changes to keys on disk included) gives exactly what a store kept in
    memory would — after its later deltas are stacked over the snapshot, and after it spills
    again onto a newer snapshot."""
    d = await daemon_factory(memory_budget=3 << 20, spill_min_bytes=256 << 10, block_cache_bytes=256 << 10,
                             flush_min_bytes=NO_FLUSH,
                             snapshot_interval=1000)
    sid = StoreId(f"file://{tmp_path}/root", "spill", 0)
    rnd = random.Random(1)
    expected: dict[bytes, bytes] = {}
    async with AsyncClient(d.config.socket) as c:
        ref = await fill(c, sid, expected, 2, rnd)
        await wait_for(lambda: d.registry.counters["spills"] >= 1, "the store to spill")
        store = d.registry.get(sid)
        assert store is not None and store.cold is not None
        assert d.registry.counters["spill_requests"] >= 1 and d.maintenance.counters["snapshots"] >= 1
        await wait_for(lambda: d.registry.memory_bytes <= d.registry.memory_budget, "memory under the budget")
        await check(c, sid, ref, expected)
        assert d.registry.get(sid).cold.blocks_read > 0  # read from disk
        ref = await fill(c, sid, expected, 3, rnd, ref)  # commits over the cold level
        await check(c, sid, ref, expected)
        d.registry.memory_budget = 1 << 20  # tighter: a few commits' hot part is over it
        for _ in range(10):  # the hot part leaves memory as the stacked delta files (no write)
            if d.registry.counters["deltas_stacked"]:
                break
            ref = await fill(c, sid, expected, 1, rnd, ref)
        assert d.registry.counters["deltas_stacked"] >= 1, d.registry.stats()
        await check(c, sid, ref, expected)
        for _ in range(60):  # the hot part grows with each commit until the store spills again
            if d.registry.counters["spills"] >= 2:
                break
            ref = await fill(c, sid, expected, 1, rnd, ref)
        assert d.registry.counters["spills"] >= 2, d.registry.stats()
        await check(c, sid, ref, expected)
        assert d.registry.stats()["spilled"] == 1 and d.registry.counters["evictions"] == 0


@pytest.fixture
def s3_daemon(daemon_process, seaweedfs, aws_env):
    def start(cache: str, *args: str):
        return daemon_process("--s3-endpoint-url", seaweedfs.endpoint_url, "--s3-region", "us-east-1",
                              "--s3-addressing-style", "path", "--cache-dir", cache, "--memory-budget", "3MiB",
                              "--spill-min-bytes", "256KiB", "--block-cache-bytes", "256KiB", "--flush-min-bytes", "1GiB",
                              "--snapshot-interval", "1000", *args)
    return start


async def spill_then_kill(s3_daemon, cache: str, sid: StoreId, seed: int,
                          rounds_after: int) -> tuple[CheckpointRef, dict[bytes, bytes]]:
    """A daemon fills ``sid`` until it spills, commits ``rounds_after`` more versions (durable, in
    memory over the cold level), and is killed with SIGKILL. Returns the last ref and the state."""
    rnd = random.Random(seed)
    expected: dict[bytes, bytes] = {}
    d = s3_daemon(cache)
    with Client(d.socket) as sc:
        async with AsyncClient(d.socket) as c:
            ref = await fill(c, sid, expected, 2, rnd)
            await wait_for(lambda: sc.stats()["registry"]["spills"] >= 1, "the store to spill")
            ref = await fill(c, sid, expected, rounds_after, rnd, ref)
    assert d.kill() == -signal.SIGKILL
    return ref, expected


async def test_a_daemon_killed_with_state_on_disk_restarts_over_its_local_files(s3_daemon, s3_bucket, tmp_path):
    """kill -9 while a store is spilled (its snapshot on local disk, later commits in memory and in
    S3): a daemon restarted on the same node with the same cache folder loads the store over the
    local snapshot file — no download of it — plus the deltas after it, and reads back exactly."""
    cache = str(tmp_path / "cache")
    sid = StoreId(f"s3://{s3_bucket}/ckpt", "spill", 0)
    ref, expected = await spill_then_kill(s3_daemon, cache, sid, 2, 2)
    d2 = s3_daemon(cache)
    async with AsyncClient(d2.socket) as c:
        await check(c, sid, ref, expected)
    with Client(d2.socket) as sc:
        st = sc.stats()
    assert st["registry"]["cold_loads"] == 1 and st["registry"]["loads"] == 1
    # the deltas after the snapshot open as runs over their cached copies: nothing downloaded
    assert st["registry"]["delta_runs_loaded"] >= 2 and st["registry"]["deltas_downloaded"] == 0
    # one GET at most: the head's own snapshot, asked for and not there (a 404)
    assert st["object_stores"][sid.root].get("GET", 0) <= 1, st["object_stores"]


async def test_a_reload_opens_the_deltas_after_the_snapshot_as_runs(daemon_factory, tmp_path):
    """A spilled store with deltas committed after its snapshot, loaded by another daemon on the same
    node (file:// root: the files are local): the snapshot and every delta open as runs of a cold
    stack, nothing of them read into memory (empty hot part, no file read whole), and it answers
    exactly — then commits on over the stack."""
    root = f"file://{tmp_path}/root"
    settings = {"memory_budget": 3 << 20, "spill_min_bytes": 256 << 10, "block_cache_bytes": 256 << 10,
                "flush_min_bytes": NO_FLUSH,
                "snapshot_interval": 1000}
    d = await daemon_factory(**settings)
    sid = StoreId(root, "spill", 0)
    rnd = random.Random(7)
    expected: dict[bytes, bytes] = {}
    async with AsyncClient(d.config.socket) as c:
        ref = await fill(c, sid, expected, 2, rnd)
        await wait_for(lambda: d.registry.counters["spills"] >= 1, "the store to spill")
        snapshot = d.registry.get(sid).cold.ref
        ref = await fill(c, sid, expected, 3, rnd, ref)
    deltas = ref.version - snapshot.version
    assert deltas >= 3
    d2 = await daemon_factory(**settings)
    async with AsyncClient(d2.config.socket) as c:
        await check(c, sid, ref, expected)
        st = d2.registry.stats()
        assert st["cold_loads"] == 1 and st["delta_runs_loaded"] == deltas, st
        store = d2.registry.get(sid)
        assert isinstance(store.cold, ColdStack) and len(store.cold.runs) == deltas + 1
        assert store.cold.runs[-1].ref == snapshot and store.cold.ref == ref
        assert len(store._data) == 0  # the hot part: nothing read into memory
        ref = await fill(c, sid, expected, 2, rnd, ref)  # commits over the stack
        await check(c, sid, ref, expected)


async def test_a_damaged_local_delta_copy_is_downloaded_again(s3_daemon, s3_bucket, tmp_path):
    """A cached delta copy damaged while the daemon was down (a flipped byte in a block): the restarted
    daemon's check at open catches it, drops the copy, downloads the delta once into the cache folder
    and opens that as a run; the store answers exactly."""
    cache = str(tmp_path / "cache")
    sid = StoreId(f"s3://{s3_bucket}/ckpt", "spill", 2)
    ref, expected = await spill_then_kill(s3_daemon, cache, sid, 4, 2)
    copies = list(pathlib.Path(cache).rglob(file_name(ref, DELTA)))
    assert len(copies) == 1
    data = bytearray(copies[0].read_bytes())
    data[len(data) // 2] ^= 0xFF
    copies[0].write_bytes(bytes(data))
    d2 = s3_daemon(cache)
    async with AsyncClient(d2.socket) as c:
        await check(c, sid, ref, expected)
    with Client(d2.socket) as sc:
        st = sc.stats()
    assert st["registry"]["cold_loads"] == 1 and st["registry"]["deltas_downloaded"] == 1, st["registry"]
    assert st["registry"]["delta_runs_loaded"] >= 2
    # the download, and at most the head's own snapshot asked for and not there (a 404)
    assert 1 <= st["object_stores"][sid.root].get("GET", 0) <= 2, st["object_stores"]
    assert copies[0].read_bytes() != bytes(data)  # the copy was replaced by the download


async def test_a_new_node_recovers_a_spilled_store_from_the_object_store_alone(s3_daemon, s3_bucket, tmp_path):
    sid = StoreId(f"s3://{s3_bucket}/ckpt", "spill", 1)
    ref, expected = await spill_then_kill(s3_daemon, str(tmp_path / "cache"), sid, 3, 1)
    d2 = s3_daemon(str(tmp_path / "another-node-cache"))
    async with AsyncClient(d2.socket) as c:
        await check(c, sid, ref, expected)
    with Client(d2.socket) as sc:
        assert sc.stats()["registry"]["cold_loads"] == 0  # nothing local: read from S3
