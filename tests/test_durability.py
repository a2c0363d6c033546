"""Durability on a real S3 server (SeaweedFS): async uploads, AWAIT_DURABLE, faults survived,
recovery from S3 alone, snapshots and retention in the daemon, and the local cache."""
from __future__ import annotations

import asyncio
import signal
import time

import pytest

from statestore_async.client.clients import AsyncClient
from statestore_async.errors import ObjectNotFoundError, StateStoreError
from statestore_async.files.loader import load_store
from statestore_async.files.names import DELTA, SNAPSHOT, file_key
from statestore_async.ids import CheckpointRef, StoreId
from statestore_async.objectstore.s3 import S3ObjectStore

pytestmark = pytest.mark.asyncio(loop_factories=["uvloop"])


def key(i: int) -> bytes:
    return (i % 4096).to_bytes(2, "big") + b"key-%06d" % i


def exists(s3, bucket, k) -> bool:
    try:
        s3.head_object(Bucket=bucket, Key=k)
        return True
    except s3.exceptions.ClientError:
        return False


@pytest.fixture
def make_daemon(daemon_factory, aws_env):
    """In-process daemons reaching S3 at ``endpoint`` (credentials from the AWS env chain)."""

    def make(endpoint, **settings):
        return daemon_factory(s3_endpoint_url=endpoint, s3_region="us-east-1", s3_addressing_style="path", **settings)

    return make


async def wait_until(condition, timeout: float = 30.0) -> None:
    """Wait until ``condition()`` holds, polling; fail after ``timeout`` seconds (a loaded machine)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"still false after {timeout} s"
        await asyncio.sleep(0.05)


async def commit_version(client, sid, version, n=200, salt=0, ckptid=None):
    h = await client.open(sid, version, ckptid)
    await h.put_many([(key(i), b"v%d-%d-%d" % (version, i, salt)) for i in range(version * 10, version * 10 + n)])
    t = time.perf_counter()
    ref = await h.commit()
    return ref, time.perf_counter() - t


async def test_commit_returns_before_the_upload_and_durable_means_the_object_exists(
        make_daemon, proxy, s3, s3_bucket, sockdir):
    d = await make_daemon(proxy.endpoint_url)
    sid = StoreId(f"s3://{s3_bucket}/ckpt", "op", 0)
    async with AsyncClient(d.config.socket) as c:
        h = await c.open(sid, 0, None)
        await h.put_many([(key(i), b"v%d" % i) for i in range(200)])
        proxy.outage(3600)  # S3 unreachable until the outage is ended below
        # the commit is answered while no upload can succeed: it does not wait for the PUT
        ref = await asyncio.wait_for(h.commit(), timeout=120)
        k = f"ckpt/{file_key(sid, ref, DELTA)}"
        assert not exists(s3, s3_bucket, k)
        proxy.outage(0)
        assert await c.await_durable(sid, ref, timeout=20)
        assert exists(s3, s3_bucket, k)  # checked with our own HEAD on the server


@pytest.mark.slow  # 30 commits through a proxy failing 10% of the requests, retried with backoff
async def test_ten_percent_503_is_invisible_and_everything_becomes_durable(make_daemon, proxy, s3, s3_bucket):
    proxy.error_rate = 0.10
    d = await make_daemon(proxy.endpoint_url)
    async with AsyncClient(d.config.socket) as c:
        refs = []
        for p in range(6):
            sid = StoreId(f"s3://{s3_bucket}/ckpt", "op", p)
            v, ckpt = 0, None
            for _ in range(5):
                ref, _ = await commit_version(c, sid, v, n=50, ckptid=ckpt)
                refs.append((sid, ref))
                v, ckpt = ref.version, ref.ckptid
        for sid, ref in refs:
            assert await c.await_durable(sid, ref, timeout=60)
            assert exists(s3, s3_bucket, f"ckpt/{file_key(sid, ref, DELTA)}")
    assert proxy.stats["503"] > 0


@pytest.mark.slow  # commits queued through an outage, then uploaded with the uploader's backoff
async def test_an_outage_keeps_commits_returning_until_the_queue_bound_then_durability_resumes(
        make_daemon, proxy, s3, s3_bucket):
    # a queue bound of about 3 deltas: three commits return at once, the fourth waits for S3
    d = await make_daemon(proxy.endpoint_url, upload_queue_bytes=3 * 200 * 30)
    sid = StoreId(f"s3://{s3_bucket}/ckpt", "op", 0)
    async with AsyncClient(d.config.socket) as c:
        ref, _ = await commit_version(c, sid, 0)
        assert await c.await_durable(sid, ref, timeout=20)
        proxy.outage(3600)  # S3 unreachable until the outage is ended below
        refs = [ref]
        for _ in range(3):  # commits keep being answered during the outage, admitted at once ...
            ref, _ = await commit_version(c, sid, refs[-1].version, ckptid=refs[-1].ckptid)
            refs.append(ref)
        assert d.counters["commits_waited"] == 0
        # ... until the queue is full: the next one waits for room (never dropped)
        waiting = asyncio.ensure_future(commit_version(c, sid, refs[-1].version, ckptid=refs[-1].ckptid))
        deadline = time.monotonic() + 120
        while d.counters["commits_waited"] < 1:
            assert time.monotonic() < deadline, "the fourth commit never waited for the queue"
            await asyncio.sleep(0.05)
        assert not waiting.done()  # answered once admitted, not before
        proxy.outage(0)
        ref, _ = await asyncio.wait_for(waiting, timeout=120)
        refs.append(ref)
        ref, _ = await commit_version(c, sid, refs[-1].version, ckptid=refs[-1].ckptid)
        refs.append(ref)
        for r in refs:
            assert await c.await_durable(sid, r, timeout=60)
        for r in refs:
            assert exists(s3, s3_bucket, f"ckpt/{file_key(sid, r, DELTA)}")
    assert proxy.stats["outage"] > 0


async def test_two_daemons_at_the_same_version_both_files_exist(make_daemon, seaweedfs, s3, s3_bucket):
    a = await make_daemon(seaweedfs.endpoint_url)
    b = await make_daemon(seaweedfs.endpoint_url)
    sid = StoreId(f"s3://{s3_bucket}/ckpt", "op", 0)
    async with AsyncClient(a.config.socket) as ca, AsyncClient(b.config.socket) as cb:
        ra, _ = await commit_version(ca, sid, 0, salt=1)
        rb, _ = await commit_version(cb, sid, 0, salt=2)
        assert ra.version == rb.version == 1 and ra.ckptid != rb.ckptid
        assert await ca.await_durable(sid, ra, timeout=20) and await cb.await_durable(sid, rb, timeout=20)
    for r, salt in ((ra, 1), (rb, 2)):
        assert exists(s3, s3_bucket, f"ckpt/{file_key(sid, r, DELTA)}")
        async with S3ObjectStore(s3_bucket, "ckpt", **seaweedfs.client_options()) as st:
            store, _ = await load_store(st, sid, r)
            assert store.get(key(10)) == b"v0-10-%d" % salt  # nothing overwritten


async def test_recovery_from_s3_alone_snapshot_plus_20_deltas(make_daemon, seaweedfs, s3_bucket):
    sid = StoreId(f"s3://{s3_bucket}/ckpt", "op", 0)
    model: dict = {}
    a = await make_daemon(seaweedfs.endpoint_url, snapshot_interval=5)
    async with AsyncClient(a.config.socket) as c:
        ref = CheckpointRef(0, "")
        for v in range(5):
            h = await c.open(sid, ref.version, ref.ckptid or None)
            items = [(key(i), b"a%d-%d" % (v, i)) for i in range(v * 300, v * 300 + 1000)]
            await h.put_many(items)
            model.update(items)
            ref = await h.commit()
        assert await c.await_durable(sid, ref, timeout=20)
    await wait_until(lambda: a.maintenance.counters["snapshots"])  # maintenance snapshots version 5 in the background
    await a.stop()
    b = await make_daemon(seaweedfs.endpoint_url, snapshot_interval=1000)
    async with AsyncClient(b.config.socket) as c:
        for v in range(5, 25):
            h = await c.open(sid, ref.version, ref.ckptid)
            items = [(key(i), b"b%d-%d" % (v, i)) for i in range(v * 97, v * 97 + 400)]
            removes = [key(i) for i in range(v, 5000, 251)]
            await h.put_many(items)
            await h.remove_many(removes)
            model.update(items)
            for r in removes:
                model.pop(r, None)
            ref = await h.commit()
        assert await c.await_durable(sid, ref, timeout=30)
    await b.stop()
    assert ref.version == 25
    # a fresh daemon, no cache: everything comes from S3 (its snapshot interval above the chain, so
    # that its load leaves the files as they are: a load past the interval writes a snapshot)
    fresh = await make_daemon(seaweedfs.endpoint_url, snapshot_interval=1000)
    async with AsyncClient(fresh.config.socket) as c:
        h = await c.open(sid, ref.version, ref.ckptid)
        got = {k: v async for k, v in h.scan(b"")}
        await h.abort()
    assert got == model
    async with S3ObjectStore(s3_bucket, "ckpt", **seaweedfs.client_options()) as st:
        store, report = await load_store(st, sid, ref)
        assert report.snapshot.version == 5 and len(report.deltas) == 20 and st.counts["LIST"] == 0
        assert dict(store.items()) == model
    # a node whose snapshot interval the chain passes writes the snapshot of what it loaded: the
    # next load of that state reads one file
    writes = await make_daemon(seaweedfs.endpoint_url, snapshot_interval=10)
    async with AsyncClient(writes.config.socket) as c:
        h = await c.open(sid, ref.version, ref.ckptid)
        await h.abort()
    assert writes.registry.counters["load_snapshots"] == 1
    async with S3ObjectStore(s3_bucket, "ckpt", **seaweedfs.client_options()) as st:
        store, report = await load_store(st, sid, ref)
        assert report.snapshot == ref and report.deltas == [] and dict(store.items()) == model


@pytest.mark.parametrize("builder", ["inline", "process"])
async def test_snapshots_every_n_and_retention_keeps_the_window_loadable(make_daemon, seaweedfs, s3_bucket, builder):
    d = await make_daemon(seaweedfs.endpoint_url, snapshot_interval=3, retention_versions=4, snapshot_builder=builder)
    sid = StoreId(f"s3://{s3_bucket}/ckpt", "op", 0)
    states = {}
    async with AsyncClient(d.config.socket) as c:
        ref = CheckpointRef(0, "")
        for v in range(13):
            h = await c.open(sid, ref.version, ref.ckptid or None)
            await h.put_many([(key(i), b"%d" % v) for i in range(v, v + 20)])
            ref = await h.commit()
            assert await c.await_durable(sid, ref, timeout=20)
            await wait_until(lambda: d.maintenance.idle)
            states[ref] = None
    async with S3ObjectStore(s3_bucket, "ckpt", **seaweedfs.client_options()) as st:
        names = {o.key async for o in st.list(sid.prefix + "/")}
        snaps = sorted(int(n.rsplit("/", 1)[1].split("_")[0]) for n in names if n.endswith(".snapshot"))
        assert d.maintenance.counters["snapshots"] == 4  # versions 3, 6, 9 and 12
        assert d.maintenance.stats()["builder"] == builder
        if builder == "inline":
            # retention knows the headers of the deltas this daemon wrote: it GETs nothing back,
            # and deletes with one batch request per cleanup
            counts = d.objstores.stats()[f"s3://{s3_bucket}/ckpt"]
            assert counts.get("GET", 0) == 0
            assert counts["DELETE"] <= d.maintenance.counters["cleanups"]
        assert {9, 12} <= set(snaps) and d.maintenance.counters["files_deleted"] > 0
        versions = sorted(int(n.rsplit("/", 1)[1].split("_")[0]) for n in names)
        assert min(versions) == 9  # the window is 9..12 and 9 has its own snapshot: older files are gone ...
        for r in sorted(states)[-4:]:  # ... and every state of the window still loads
            store, _ = await load_store(st, sid, r)
            assert store.head == r


async def test_a_restart_on_the_same_node_reloads_from_the_local_cache(make_daemon, seaweedfs, s3_bucket, tmp_path):
    cache = str(tmp_path / "cache")
    sid = StoreId(f"s3://{s3_bucket}/ckpt", "op", 0)
    a = await make_daemon(seaweedfs.endpoint_url, cache_dir=cache)
    async with AsyncClient(a.config.socket) as c:
        ref = CheckpointRef(0, "")
        for v in range(4):
            ref, _ = await commit_version(c, sid, ref.version, ckptid=ref.ckptid or None)
        assert await c.await_durable(sid, ref, timeout=20)
    await a.stop()
    b = await make_daemon(seaweedfs.endpoint_url, cache_dir=cache)
    async with AsyncClient(b.config.socket) as c:
        h = await c.open(sid, ref.version, ref.ckptid)
        assert await h.get_many([key(35)]) == [b"v3-35-0"]
        await h.abort()
    objstore = b.objstores(sid.root)
    # the 4 deltas are read from their local copies in the cache folder (opened as files, not
    # through the object store: no cache hit counted); the one request to S3 is the probe for a
    # snapshot of version 4, which does not exist (a 404): nothing is downloaded
    assert objstore.misses == 1 and objstore.counts["GET"] == 1 and dict(objstore.counts) == {"GET": 1}


async def test_the_snapshot_workers_cached_copies_are_within_the_daemons_cache_bound(make_daemon, seaweedfs, s3_bucket,
                                                                                    tmp_path):
    cache = tmp_path / "cache"
    d = await make_daemon(seaweedfs.endpoint_url, cache_dir=str(cache), snapshot_interval=3, snapshot_builder="process")
    sid = StoreId(f"s3://{s3_bucket}/ckpt", "op", 0)
    async with AsyncClient(d.config.socket) as c:
        ref = CheckpointRef(0, "")
        for _ in range(3):
            ref, _ = await commit_version(c, sid, ref.version, ckptid=ref.ckptid or None)
            assert await c.await_durable(sid, ref, timeout=20)
        await wait_until(lambda: d.maintenance.counters["snapshots"])
    assert d.maintenance.counters["snapshots"] == 1 and d.maintenance.stats()["builder"] == "process"
    objstore = d.objstores(sid.root)
    on_disk = {p.relative_to(objstore.dir).as_posix(): p.stat().st_size for p in objstore.dir.rglob("*") if p.is_file()}
    # the worker wrote the snapshot into the node's cache folder; the daemon's cache counts it
    assert file_key(sid, ref, SNAPSHOT) in on_disk
    assert objstore.cached_keys() == set(on_disk) and objstore.total == sum(on_disk.values())


async def test_a_daemon_killed_before_upload_loses_only_versions_never_reported_durable(
        proxy, s3, s3_bucket, aws_env, seaweedfs, daemon_process):
    d = daemon_process("--s3-endpoint-url", proxy.endpoint_url, "--s3-region", "us-east-1",
                       "--s3-addressing-style", "path", "--loop", "uvloop")
    sid = StoreId(f"s3://{s3_bucket}/ckpt", "op", 0)
    async with AsyncClient(d.socket) as c:
        durable, _ = await commit_version(c, sid, 0)
        assert await c.await_durable(sid, durable, timeout=20)
        proxy.outage(30)
        lost = [durable]
        for _ in range(3):
            r, _ = await commit_version(c, sid, lost[-1].version, ckptid=lost[-1].ckptid)
            lost.append(r)
        assert not await c.await_durable(sid, lost[-1], timeout=0.5)
        assert d.kill() == -signal.SIGKILL
    proxy.outage(0)
    assert exists(s3, s3_bucket, f"ckpt/{file_key(sid, durable, DELTA)}")
    for r in lost[1:]:
        assert not exists(s3, s3_bucket, f"ckpt/{file_key(sid, r, DELTA)}")
    async with S3ObjectStore(s3_bucket, "ckpt", **seaweedfs.client_options()) as st:
        store, _ = await load_store(st, sid, durable)  # what was reported durable is there
        assert store.get(key(10)) == b"v0-10-0"
        with pytest.raises(StateStoreError):
            await load_store(st, sid, lost[-1])
        with pytest.raises(ObjectNotFoundError):
            await st.head(file_key(sid, lost[1], SNAPSHOT))


async def test_retention_never_deletes_what_another_daemons_attempt_in_the_window_needs(
        make_daemon, seaweedfs, s3_bucket):
    a = await make_daemon(seaweedfs.endpoint_url, snapshot_interval=2, retention_versions=3)
    b = await make_daemon(seaweedfs.endpoint_url, snapshot_interval=1000)
    sid = StoreId(f"s3://{s3_bucket}/ckpt", "op", 0)
    refs = {}

    async def a_commits(ca, until):
        ref = refs.get(max(refs)) if refs else CheckpointRef(0, "")
        while ref.version < until:
            ref, _ = await commit_version(ca, sid, ref.version, ckptid=ref.ckptid or None)
            refs[ref.version] = ref
            assert await ca.await_durable(sid, ref, timeout=20)
            await wait_until(lambda: a.maintenance.idle)  # snapshot + retention finished

    async with AsyncClient(a.config.socket) as ca, AsyncClient(b.config.socket) as cb:
        await a_commits(ca, 8)
        # node B, working the same store, loads version 8 from S3 and makes its own attempt at 9 ...
        other, _ = await commit_version(cb, sid, 8, salt=7, ckptid=refs[8].ckptid)
        assert await cb.await_durable(sid, other, timeout=20)
        # ... while node A goes on to version 10 and its retention runs (window: versions 8..10)
        await a_commits(ca, 10)
    assert a.maintenance.counters["files_deleted"] > 0
    async with S3ObjectStore(s3_bucket, "ckpt", **seaweedfs.client_options()) as st:
        store, _ = await load_store(st, sid, other)  # B's attempt in the window still loads
        assert store.get(key(90)) == b"v8-90-7"
        for v in (8, 9, 10):
            store, _ = await load_store(st, sid, refs[v])
            assert store.head == refs[v]


async def test_the_snapshot_pacer_rests_after_requests_and_after_busy_stretches(monkeypatch):
    """Between snapshot steps the daemon sleeps for real (``rest``) once it has served a request —
    the client it answered may be waiting for this core — or once its steps were busy ``busy``
    seconds; otherwise it only lets the loop serve what is waiting (``sleep(0)``)."""
    import types

    from statestore_async.daemon import maintenance

    served = [0]
    slept = []

    async def sleep(seconds):
        slept.append(seconds)
        if seconds and served[0] == 2:
            served[0] += 1  # a request answered while resting, as the rest ends
        await asyncio.sleep(0)

    monkeypatch.setattr(maintenance, "asyncio", types.SimpleNamespace(sleep=sleep))
    pace = maintenance._Pacer(busy=60.0, rest=0.001, served=lambda: served[0])
    await pace()
    served[0] += 1
    await pace()
    await pace()
    served[0] += 1
    await pace()  # rests; the request served during that rest earns the next one too
    await pace()
    await pace()
    assert slept == [0, 0.001, 0, 0.001, 0.001, 0]
    slept.clear()
    busy = maintenance._Pacer(busy=0.0, rest=0.002)  # no request count: rests on time alone
    await busy()
    await busy()
    assert slept == [0.002, 0.002]
