"""The daemon, in-process on a tmp socket (under asyncio and uvloop), and once as a real process."""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import stat

import pytest

from statestore_async import errors
from statestore_async.client.clients import AsyncClient, Client
from statestore_async.codecs import framing
from statestore_async.daemon import server
from statestore_async.files.names import DELTA, file_key
from statestore_async.ids import CheckpointRef, StoreId
from statestore_async.objectstore import LocalObjectStore
from statestore_async.wire import protocol as P


class CountingStore(LocalObjectStore):
    """The local object store, counting reads (to prove that a hot reopen reads nothing)."""

    def __init__(self, root):
        super().__init__(root, fsync=False)
        self.reads = 0

    @classmethod
    def open(cls, uri: str):
        return cls(uri.removeprefix("file://"))

    async def get(self, key, start=None, end=None):
        self.reads += 1
        return await super().get(key, start, end)

    async def head(self, key):
        self.reads += 1
        return await super().head(key)


@pytest.fixture
def make_daemon(daemon_factory):
    """In-process daemons whose object stores count reads."""

    def make(**settings):
        return daemon_factory(open_objstore=CountingStore.open, **settings)

    return make


@pytest.fixture
def root(tmp_path):
    return f"file://{tmp_path}/root"


def key(i: int) -> bytes:
    return b"\x00\x07" + b"key-%06d" % i


async def test_every_operation(make_daemon, root):
    d = await make_daemon()
    sid = StoreId(root, "op", 1)
    async with AsyncClient(d.config.socket) as c:
        assert await c.ping(b"\x00hello") == b"\x00hello"
        h = await c.open(sid, 0)
        assert h.ref.version == 0
        assert await h.put_many([(key(i), b"v%d" % i) for i in range(100)]) == 100
        assert await h.put_many([(key(5), b"")]) == 1
        assert await h.remove_many([key(7), key(1000)]) == 2
        assert await h.get_many([key(5), key(6), key(7), key(1000)]) == [b"", b"v6", None, None]
        scanned = [kv async for kv in h.scan(b"\x00\x07key-00001")]
        assert sorted(scanned) == [(key(i), b"v%d" % i) for i in range(10, 20)]
        assert len([kv async for kv in h.scan(b"", limit=7)]) == 7
        ref = await h.commit()
        assert ref.version == 1
        assert await c.await_durable(sid, ref, 10)
        assert os.path.exists(f"{root.removeprefix('file://')}/{file_key(sid, ref, DELTA)}")
        with pytest.raises(errors.StoreStateError):
            await h.put_many([(key(1), b"x")])
        h2 = await c.open(sid, 1, ref.ckptid)
        assert await h2.get_many([key(6), key(7)]) == [b"v6", None]
        await h2.abort()
        with pytest.raises(P.UnknownHandleError):
            await c.call(lambda p: p.send_get_many(999, [key(1)]))
        stats = await c.stats()
        assert stats["registry"]["stores"] == 1 and stats["uploader"]["durable"] == 1
        assert stats["daemon"]["requests_by_op"]["Commit"] == 1


async def test_big_scan_is_streamed_in_chunks(make_daemon, root):
    d = await make_daemon()
    async with AsyncClient(d.config.socket) as c:
        h = await c.open(StoreId(root, "op", 2), 0)
        items = [(key(i), b"x" * 300) for i in range(10000)]
        await h.put_many(items)
        got = [kv async for kv in h.scan(b"")]
        assert sorted(got) == items
        await h.abort()


async def test_pipelining_many_requests_in_flight(make_daemon, root):
    d = await make_daemon(max_inflight=4)
    sid = StoreId(root, "op", 3)
    async with AsyncClient(d.config.socket) as c:
        h = await c.open(sid, 0)
        await h.put_many([(key(i), b"%d" % i) for i in range(500)])
        results = await asyncio.gather(*(h.get_many([key(i), key(i + 1)]) for i in range(0, 500, 2)))
        assert results == [[b"%d" % i, b"%d" % (i + 1)] for i in range(0, 500, 2)]
        ref = await h.commit()
        # slow requests (they wait) are capped per connection: the rest wait for room
        assert all(await asyncio.gather(*(c.await_durable(sid, ref, 5) for _ in range(20))))
        assert d.counters["max_inflight_seen"] <= 4


async def test_batches_over_the_limit_are_split_by_the_client_and_refused_raw(make_daemon, root):
    d = await make_daemon(max_batch=10, max_frame_bytes=4096)
    sid = StoreId(root, "op", 4)
    async with AsyncClient(d.config.socket) as c:
        h = await c.open(sid, 0)
        items = [(key(i), b"v" * 100) for i in range(95)]
        assert await h.put_many(items) == 95
        assert await h.get_many([k for k, _ in items]) == [v for _, v in items]
        assert d.requests_by_op["PutMany"] >= 10
        # a raw request over max_batch: a coded error, nothing applied
        with pytest.raises(P.LimitExceededError):
            await c.call(lambda p: p.send_put_many(h.handle, [(key(1000 + i), b"x") for i in range(11)]))
        assert await h.get_many([key(1000)]) == [None]
        with pytest.raises(P.LimitExceededError):
            await h.put_many([(key(1), b"x" * 5000)])
        await h.abort()


async def test_oversized_frame_gets_an_error_then_close_and_others_keep_going(make_daemon, root):
    d = await make_daemon(max_frame_bytes=1000)
    async with AsyncClient(d.config.socket) as other:
        r, w = await asyncio.open_unix_connection(d.config.socket)
        w.write(P.ClientProtocol().send_hello()[1] + framing.encode_frame(P.Op.PING, 0, 42, b"x" * 2000))
        data = await asyncio.wait_for(r.read(), 5)  # until the daemon closes
        frames, _, _ = framing.split_frames(data, 1 << 20)
        assert frames[-1][2] == 42 and frames[-1][1] == P.RESPONSE | P.ERROR
        assert isinstance(P.decode_error(frames[-1][3]), P.FrameTooLargeError)
        w.close()
        assert await other.ping(b"ok") == b"ok"


async def test_one_writer_per_store(make_daemon, root):
    d = await make_daemon()
    sid = StoreId(root, "op", 5)
    async with AsyncClient(d.config.socket) as a, AsyncClient(d.config.socket) as b:
        ha = await a.open(sid, 0)
        with pytest.raises(errors.WriterConflictError):
            await b.open(sid, 0)
        await ha.abort()
        hb = await b.open(sid, 0)
        await hb.put_many([(key(1), b"b")])
        assert (await hb.commit()).version == 1


async def test_disconnect_mid_version_aborts_it(make_daemon, root):
    d = await make_daemon()
    sid = StoreId(root, "op", 6)
    a = await AsyncClient.connect(d.config.socket)
    h = await a.open(sid, 0)
    await h.put_many([(key(1), b"lost")])
    await a.close()
    async with AsyncClient(d.config.socket) as b:
        for _ in range(100):  # the daemon sees the close a moment later
            try:
                h2 = await b.open(sid, 0)
                break
            except errors.WriterConflictError:
                await asyncio.sleep(0.01)
        assert await h2.get_many([key(1)]) == [None]
        await h2.abort()
    assert d.counters["aborted_on_disconnect"] == 1


async def test_hot_reopen_reads_nothing(make_daemon, root):
    d = await make_daemon()
    sid = StoreId(root, "op", 7)
    async with AsyncClient(d.config.socket) as c:
        h = await c.open(sid, 0)
        await h.put_many([(key(i), b"1") for i in range(50)])
        r1 = await h.commit()
        h = await c.open(sid, 1, r1.ckptid)
        await h.put_many([(key(0), b"2")])
        r2 = await h.commit()
        assert await c.await_durable(sid, r2, 10)
        store = d.objstores(root)
        reads = store.reads
        for ref, expect in ((r2, b"2"), (r1, b"1"), (r2, b"2")):  # forward, retry (rollback), forward again
            h = await c.open(sid, ref.version, ref.ckptid)
            assert await h.get_many([key(0)]) == [expect]
            await h.abort()
        assert store.reads == reads
        assert d.registry.counters["loads"] == 0


async def test_eviction_under_a_tiny_budget_then_reload_gives_equal_data(make_daemon, root, monkeypatch):
    # the test enforces the budget itself: the daemon's own check (50 ms after a commit or an upload)
    # would evict stores before the first assertion whenever the commits take longer than that
    monkeypatch.setattr(server, "BUDGET_CHECK_DELAY", 3600)
    d = await make_daemon(memory_budget=60_000)
    data = {p: [(key(i), b"p%d-%d" % (p, i) * 10) for i in range(200)] for p in range(4)}
    refs = {}
    async with AsyncClient(d.config.socket) as c:
        for p, items in data.items():
            sid = StoreId(root, "ev", p)
            h = await c.open(sid, 0)
            await h.put_many(items)
            refs[p] = await h.commit()
            assert await c.await_durable(sid, refs[p], 10)
        assert all(StoreId(root, "ev", p) in d.maintenance._chain_bytes for p in data)
        d.registry.enforce_budget()
        assert d.registry.counters["evictions"] >= 2
        assert d.registry.memory_bytes <= 60_000
        assert d.registry.get(StoreId(root, "ev", 0)) is None
        # maintenance keeps nothing of an evicted store (a long-lived daemon would grow otherwise)
        gone = [StoreId(root, "ev", p) for p in data if d.registry.get(StoreId(root, "ev", p)) is None]
        assert gone and not any(s in d.maintenance._chain_bytes or s in d.maintenance._headers for s in gone)
        for p, items in data.items():
            h = await c.open(StoreId(root, "ev", p), 1, refs[p].ckptid)
            assert sorted([kv async for kv in h.scan(b"")]) == sorted(items)
            await h.abort()
        assert d.registry.counters["loads"] >= 2


async def test_commits_check_the_budget_shortly_after_once_per_burst(make_daemon, root, monkeypatch):
    # "shortly after" is 50 ms; ten times that, so that the burst fits in it on a loaded machine
    monkeypatch.setattr(server, "BUDGET_CHECK_DELAY", 0.5)
    d = await make_daemon(memory_budget=60_000)
    checks = []
    real = d.registry.enforce_budget
    monkeypatch.setattr(d.registry, "enforce_budget", lambda: checks.append(1) or real())
    async with AsyncClient(d.config.socket) as c:
        for p in range(4):  # a burst of commits, their uploads settling afterwards
            h = await c.open(StoreId(root, "burst", p), 0)
            await h.put_many([(key(i), b"p%d-%d" % (p, i) * 10) for i in range(200)])
            await h.commit()
        assert checks == []  # never on the COMMIT's path
        deadline = asyncio.get_running_loop().time() + 30
        while not (d.registry.counters["evictions"] >= 2 and d.registry.memory_bytes <= 60_000):
            assert asyncio.get_running_loop().time() < deadline, (d.registry.counters, d.registry.memory_bytes)
            await asyncio.sleep(0.02)
        assert 1 <= len(checks) <= 3  # one per burst (of commits, then of uploads settling)


def hold_uploads(d, root) -> asyncio.Event:
    """Make the daemon's uploads to ``root`` wait until the returned event is set."""
    gate = asyncio.Event()
    store = d.objstores(root)
    real = store.put_if_absent

    async def slow_put(k, data):
        await gate.wait()
        return await real(k, data)

    store.put_if_absent = slow_put
    return gate


async def test_an_idle_store_with_uploads_pending_leaves_memory_and_its_reload_waits_for_them(make_daemon, root):
    """Over budget, a store whose last commit is still uploading is evicted all the same (its delta
    is in the upload queue, which the budget counts): a stalled object store does not pin every
    store with a commit queued. Opening it again waits for its uploads, then loads it exactly."""
    d = await make_daemon(memory_budget=1)
    gate = hold_uploads(d, root)
    sid = StoreId(root, "pend", 0)
    async with AsyncClient(d.config.socket) as c:
        h = await c.open(sid, 0)
        await h.put_many([(key(1), b"x" * 1000)])
        ref = await h.commit()
        d.registry.enforce_budget()
        assert d.registry.get(sid) is None
        assert not await c.await_durable(sid, ref, 0.05)
        reopen = asyncio.create_task(c.open(sid, ref.version, ref.ckptid))
        while not d.registry.counters["loads_waited_for_uploads"]:
            await asyncio.sleep(0.01)
        assert not reopen.done()  # the load waits for the upload ...
        gate.set()
        h = await reopen  # ... and then reads the files
        assert await h.get_many([key(1)]) == [b"x" * 1000]
        await h.abort()
        assert await c.await_durable(sid, ref, 10)


async def test_release_drops_idle_durable_copies_and_keeps_busy_ones(make_daemon, root):
    """RELEASE (the coordinator's hint that another node owns these partitions now): an idle store
    whose uploads are done is dropped at once; one with a writer or an upload pending is kept;
    ``held`` lists what stays. A released store reloads, equal, when opened again."""
    d = await make_daemon()
    gate = asyncio.Event()
    store = d.objstores(root)
    real = store.put_if_absent

    async def put(k, data):
        if "/2/" in k:  # partition 2's uploads wait
            await gate.wait()
        return await real(k, data)

    store.put_if_absent = put
    refs = {}
    async with AsyncClient(d.config.socket) as c:
        for p in range(4):
            h = await c.open(StoreId(root, "rel", p), 0)
            await h.put_many([(key(i), b"p%d-%d" % (p, i)) for i in range(100)])
            refs[p] = await h.commit()
        for p in (0, 1, 3):
            assert await c.await_durable(StoreId(root, "rel", p), refs[p], 10)
        busy = await c.open(StoreId(root, "rel", 3), 1, refs[3].ckptid)  # a writer: in use
        out = await c.release(root, "rel", [0, 1, 2, 3, 9])
        assert out == {"released": [0, 1], "kept": [2, 3], "held": [2, 3]}
        assert d.registry.get(StoreId(root, "rel", 0)) is None and d.registry.counters["released"] == 2
        assert (await c.release(root, "other", [0]))["held"] == []  # another operator: nothing of it here
        await busy.abort()
        gate.set()
        assert await c.await_durable(StoreId(root, "rel", 2), refs[2], 10)
        # a copy at a version the asker does not know yet (below: only older ones) stays
        assert await c.release(root, "rel", [(2, 1), (3, 2)]) == {"released": [3], "kept": [2], "held": [2]}
        assert await c.release(root, "rel", [(2, 2)]) == {"released": [2], "kept": [], "held": []}
        h = await c.open(StoreId(root, "rel", 1), 1, refs[1].ckptid)  # reloads from its files
        assert await h.get_many([key(5)]) == [b"p1-5"]
        await h.abort()

    def blocking():  # the blocking client too (in a thread: the daemon runs on this loop)
        with Client(d.config.socket) as c:
            assert c.release(root, "rel", []) == {"released": [], "kept": [], "held": [1]}
            with pytest.raises(errors.InterfaceError):  # bad names are refused before sending
                c.release(root, "no/slash", [0])

    await asyncio.to_thread(blocking)


async def test_concurrent_opens_wait_for_one_load(make_daemon, root):
    d = await make_daemon()
    sid = StoreId(root, "load", 0)
    async with AsyncClient(d.config.socket) as c:
        h = await c.open(sid, 0)
        await h.put_many([(key(1), b"v")])
        ref = await h.commit()
        assert await c.await_durable(sid, ref, 10)
    d.registry._stores.clear()  # as if evicted
    clients = [await AsyncClient.connect(d.config.socket) for _ in range(5)]
    try:
        results = await asyncio.gather(*(cl.open(sid, 1, ref.ckptid) for cl in clients), return_exceptions=True)
        opened = [r for r in results if not isinstance(r, BaseException)]
        assert len(opened) == 1 and all(isinstance(r, errors.WriterConflictError) for r in results if r not in opened)
        assert await opened[0].get_many([key(1)]) == [b"v"]
        assert d.registry.counters["loads"] == 1
    finally:
        for cl in clients:
            await cl.close()


async def test_unknown_versions_are_coded_errors(make_daemon, root):
    d = await make_daemon()
    async with AsyncClient(d.config.socket) as c:
        with pytest.raises(errors.VersionNotFoundError):
            await c.open(StoreId(root, "op", 9), 3, "cd" * 16)
        with pytest.raises(errors.VersionNotFoundError):
            await c.open(StoreId(root, "op", 9), 3)
        h = await c.open(StoreId(root, "op", 9), 0)
        with pytest.raises(errors.KeyFormatError):
            await h.put_many([(b"k", b"too short a key")])
        assert [kv async for kv in h.scan()] == []


async def test_socket_file_mode_stale_socket_and_live_daemon(make_daemon, sockdir):
    path = f"{sockdir}/s/d.sock"
    os.makedirs(os.path.dirname(path))
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(path)
    stale.close()  # a socket file nobody listens on
    d = await make_daemon(socket=path, socket_mode=0o600)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    with pytest.raises(errors.InterfaceError, match="live daemon"):
        await make_daemon(socket=path)
    with open(f"{sockdir}/s/file", "w"):
        pass
    with pytest.raises(errors.InterfaceError, match="not a socket"):
        await make_daemon(socket=f"{sockdir}/s/file")
    assert await (await AsyncClient.connect(path)).ping() == b""
    await d.stop()
    assert not os.path.exists(path)


# --- exit_when_idle --------------------------------------------------------------------------------------
@pytest.mark.slow  # seconds of idle timers, waited out
async def test_exit_when_idle_counts_only_while_no_client_is_connected(make_daemon):
    d = await make_daemon(exit_when_idle=1.0)
    async with AsyncClient(d.config.socket) as c:
        await asyncio.sleep(1.5)
        assert await c.ping() == b"" and not d.idle_exit.is_set()  # a connected client keeps it
    gone = asyncio.get_running_loop().time()
    await asyncio.wait_for(d.idle_exit.wait(), 10)
    assert asyncio.get_running_loop().time() - gone >= 0.9


@pytest.mark.slow  # a second of not exiting, waited out
async def test_exit_when_idle_waits_for_pending_uploads(make_daemon, root):
    d = await make_daemon(exit_when_idle=0.2)
    gate = hold_uploads(d, root)
    async with AsyncClient(d.config.socket) as c:
        h = await c.open(StoreId(root, "idle", 0), 0)
        await h.put_many([(key(1), b"x")])
        await h.commit()
    await asyncio.sleep(1.0)
    assert not d.idle_exit.is_set()  # the delta is not in the object store yet
    gate.set()
    await asyncio.wait_for(d.idle_exit.wait(), 10)


async def test_stop_leaves_a_socket_that_another_daemon_bound_at_the_path(make_daemon):
    d = await make_daemon()
    path = d.config.socket
    os.unlink(path)  # as a daemon started while this one stops: it removed the old file and bound anew
    other = socket.socket(socket.AF_UNIX)
    other.bind(path)
    try:
        await d.stop()
        assert stat.S_ISSOCK(os.lstat(path).st_mode)
    finally:
        other.close()


# --- the daemon as a process: SIGTERM finishes requests and drains uploads -----------------------------
@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_sigterm_drains_uploads_and_exits_0(daemon_process, tmp_path, loop):
    root = f"file://{tmp_path}/root"
    d = daemon_process("--loop", loop, "--upload-concurrency", "1")
    c = Client(d.socket)
    refs = []
    for p in range(20):
        sid = StoreId(root, "term", p)
        with c.open(sid, 0) as h:
            h.put_many([(key(i), os.urandom(200)) for i in range(2000)])
            refs.append((sid, h.commit()))
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(timeout=60) == 0, d.log()
    assert "uploads drained: True" in d.log()
    for sid, ref in refs:
        assert os.path.exists(f"{tmp_path}/root/{file_key(sid, ref, DELTA)}")
    assert not os.path.exists(d.socket)


async def test_async_client_rows(make_daemon, root):
    d = await make_daemon()
    sid = StoreId(root, "rows", 1)
    async with AsyncClient(d.config.socket) as c:
        h = await c.open(sid, 0)
        await h.put_rows([((i,), ("v", i)) for i in range(300)])
        await h.remove_rows([(0,)])
        ref = await h.commit()
        h = await c.open(sid, ref.version, ref.ckptid)
        assert await h.get_rows([(0,), (1,), (299,)]) == [None, ("v", 1), ("v", 299)]
        assert {k: v async for k, v in h.scan_rows()} == {(i,): ("v", i) for i in range(1, 300)}
        await h.abort()


async def test_retention_batches_its_cleanups_and_keeps_the_window(make_daemon, root, tmp_path):
    """Cleanups wait until a quarter of the window has aged out (each one LISTs the folder), and
    every version of the window stays while older files go."""
    d = await make_daemon(snapshot_interval=2, retention_versions=16)
    sid = StoreId(root, "ret", 0)
    async with AsyncClient(d.config.socket) as c:
        ref = CheckpointRef(0, "")
        for v in range(40):
            h = await c.open(sid, ref.version, ref.ckptid or None)
            await h.put_many([(key(v), b"%d" % v)])
            ref = await h.commit()
            assert await c.await_durable(sid, ref, 10)
            for _ in range(200):
                if d.maintenance.idle:
                    break
                await asyncio.sleep(0.01)
    m = d.maintenance.counters
    assert m["snapshots"] >= 15 and 3 <= m["cleanups"] <= m["snapshots"] // 2
    folder = tmp_path / "root" / sid.prefix
    versions = sorted(int(p.name.split("_")[0]) for p in folder.iterdir() if not p.name.startswith("."))
    assert set(range(40 - 16 + 1, 41)) <= set(versions)  # the whole window is there
    assert min(versions) > 40 - 16 - 16 // 4 - 2  # and little more: a quarter window and a snapshot interval


def test_the_daemon_makes_malloc_return_large_freed_blocks():
    # glibc's default moves its mmap threshold up as mapped blocks are freed, after which freed
    # tables and payloads stay resident; the daemon fixes the threshold at start (daemon.server.run)
    import platform

    from statestore_async.daemon import process

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("mallopt and malloc_trim are glibc's")
    assert process.return_freed_memory() is True
    # and after evictions it hands the heap's free pages back (malloc_trim)
    assert process._MALLOC_TRIM is not None
    process.give_back_free_pages()


async def test_a_slow_cleanup_holds_up_no_snapshot(make_daemon, root, monkeypatch):
    """Retention runs beside the snapshots, not in their queue: while one store's cleanup hangs
    (its LIST waiting on an unreachable object store, here a gate), other stores' snapshots are
    still written — and the hung one is not started twice."""
    from statestore_async.daemon import maintenance

    gate = asyncio.Event()
    started: list[StoreId] = []
    real_cleanup = maintenance.cleanup_store

    async def slow_cleanup(objstore, store_id, keep, **kw):
        started.append(store_id)
        await gate.wait()
        return await real_cleanup(objstore, store_id, keep, **kw)

    monkeypatch.setattr(maintenance, "cleanup_store", slow_cleanup)
    d = await make_daemon(snapshot_interval=2, retention_versions=4)
    a, b = StoreId(root, "slowret", 0), StoreId(root, "slowret", 1)
    async with AsyncClient(d.config.socket) as c:
        refs = {a: CheckpointRef(0, ""), b: CheckpointRef(0, "")}

        async def commit(sid: StoreId) -> None:
            ref = refs[sid]
            h = await c.open(sid, ref.version, ref.ckptid or None)
            await h.put_many([(key(ref.version), b"%d" % ref.version)])
            refs[sid] = await h.commit()
            assert await c.await_durable(sid, refs[sid], 30)

        deadline = asyncio.get_running_loop().time() + 60
        while not started:  # store a's first cleanup is due once its window (4) has aged out
            assert asyncio.get_running_loop().time() < deadline, "no cleanup started"
            await commit(a)
            await asyncio.sleep(0.01)
        for _ in range(6):  # meanwhile store b commits past several snapshot intervals
            await commit(b)
        while not d.registry.get(b).has_snapshot(refs[b]):  # version 6: a snapshot is due every 2
            assert asyncio.get_running_loop().time() < deadline, "store b's snapshot waited for a's cleanup"
            await asyncio.sleep(0.01)
        for _ in range(4):
            await commit(a)  # a's snapshots go on too; its cleanup is not started a second time
        assert started.count(a) == 1 and d.maintenance.stats()["cleanups_in_progress"] >= 1
        gate.set()
        while not d.maintenance.idle:
            assert asyncio.get_running_loop().time() < deadline + 60, "the cleanups did not finish"
            await asyncio.sleep(0.01)
    assert d.maintenance.counters["cleanups"] >= 1 and d.maintenance.counters["cleanup_errors"] == 0
