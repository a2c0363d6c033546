"""The object-store contract, on a local directory and on a real S3 server (SeaweedFS)."""
import asyncio
import datetime
import errno
import multiprocessing
import os
import time

import pytest
from conftest import free_port

from statestore_async.errors import (
    InterfaceError,
    ObjectExistsError,
    ObjectNotFoundError,
    ObjectStoreError,
    ObjectStoreUnavailableError,
    StorageFullError,
)
from statestore_async.objectstore import LocalObjectStore, open_object_store
from statestore_async.objectstore.s3 import S3ObjectStore


@pytest.fixture(params=["local", "s3"])
async def store(request, tmp_path):
    if request.param == "local":
        s = LocalObjectStore(tmp_path / "root")
    else:
        server = request.getfixturevalue("seaweedfs")
        bucket = request.getfixturevalue("s3_bucket")
        s = S3ObjectStore(bucket, "some/prefix", **server.client_options())
    yield s
    await s.close()


@pytest.fixture
async def local_store(tmp_path):
    s = LocalObjectStore(tmp_path / "root")
    yield s
    await s.close()


async def test_put_if_absent_get_head_delete(store):
    info = await store.put_if_absent("op/0/default/1_a.delta", b"hello")
    assert info.size == 5
    assert await store.get("op/0/default/1_a.delta") == b"hello"
    assert await store.get("op/0/default/1_a.delta", 1, 3) == b"el"
    assert (await store.head("op/0/default/1_a.delta")).size == 5
    with pytest.raises(ObjectExistsError) as e:
        await store.put_if_absent("op/0/default/1_a.delta", b"other")
    assert e.value.key == "op/0/default/1_a.delta"
    assert await store.get("op/0/default/1_a.delta") == b"hello"  # nothing overwritten
    await store.delete("op/0/default/1_a.delta")
    await store.delete("op/0/default/1_a.delta")  # deleting a missing object is fine
    with pytest.raises(ObjectNotFoundError):
        await store.get("op/0/default/1_a.delta")
    with pytest.raises(ObjectNotFoundError):
        await store.head("op/0/default/1_a.delta")
    assert not await store.exists("op/0/default/1_a.delta")


async def test_put_replaces_atomically(store):
    await store.put("op/_commits/3.json", b"one")
    await store.put("op/_commits/3.json", b"two")
    assert await store.get("op/_commits/3.json") == b"two"
    assert [o.key async for o in store.list("op/")] == ["op/_commits/3.json"]


async def test_list_by_prefix_in_key_order(store):
    for key in ["a/1/x", "a/1/y", "a/10/z", "a/2/w", "b/1"]:
        await store.put_if_absent(key, key.encode())
    assert [o.key async for o in store.list("a/1/")] == ["a/1/x", "a/1/y"]
    assert [o.key async for o in store.list("a/1")] == ["a/1/x", "a/1/y", "a/10/z"]
    assert [o.key async for o in store.list("")] == ["a/1/x", "a/1/y", "a/10/z", "a/2/w", "b/1"]
    assert [o.key async for o in store.list("zzz/")] == []


async def test_delete_many_removes_every_key_and_ignores_missing_ones(store):
    keys = [f"op/0/default/{i}_{'a' * 32}.delta" for i in range(1, 26)]
    for k in keys:
        await store.put_if_absent(k, b"x")
    await store.put_if_absent("op/0/default/keep", b"y")
    await store.delete_many(keys[:20] + ["op/0/default/never-there"])
    await store.delete_many([])
    assert [o.key async for o in store.list("op/")] == sorted(keys[20:] + ["op/0/default/keep"])
    listed = [o async for o in store.list("op/0/default/keep")]
    assert listed[0].size == 1 and listed[0].mtime and abs(listed[0].mtime - time.time()) < 600


async def test_stream_reads_in_chunks(store):
    data = os.urandom(300_000)
    await store.put_if_absent("big", data)
    chunks = [c async for c in store.get_stream("big", chunk_size=65536)]
    assert len(chunks) >= 5 and all(len(c) <= 65536 for c in chunks) and b"".join(chunks) == data


@pytest.mark.parametrize("key", ["", "/abs", "a/../b", "a//b", "./a", "a/.tmp-x", "a\\b", "a/\x00"])
async def test_bad_keys_are_refused(store, key):
    with pytest.raises(InterfaceError):
        await store.put_if_absent(key, b"x")


async def test_full_disk_is_a_typed_error_and_leaves_nothing(local_store, monkeypatch):
    store = local_store
    real_write = os.write

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(StorageFullError):
        await store.put_if_absent("op/0/default/1_a.delta", b"x" * 100)
    with pytest.raises(StorageFullError):
        await store.put("op/_commits/1.json", b"x")
    monkeypatch.setattr(os, "write", real_write)
    assert [o async for o in store.list("")] == []
    assert not any(p.name.startswith(".tmp-") for p in store.root.rglob("*"))
    await store.put_if_absent("op/0/default/1_a.delta", b"ok")  # and it works again afterwards


def _race(root, key, i, barrier, results):
    async def go():
        s = LocalObjectStore(root)
        try:
            barrier.wait()
            await s.put_if_absent(key, b"writer-%d" % i)
            results.put(i)
        except ObjectExistsError:
            results.put(-1)
        finally:
            await s.close()

    asyncio.run(go())


@pytest.mark.slow  # 48 forked processes
def test_concurrent_create_exactly_one_wins_across_processes(tmp_path):
    ctx = multiprocessing.get_context("fork")
    for round_ in range(3):
        key = f"op/0/default/{round_ + 1}_race.delta"
        n = 16
        barrier = ctx.Barrier(n)
        results = ctx.Queue()
        procs = [ctx.Process(target=_race, args=(tmp_path, key, i, barrier, results)) for i in range(n)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(30)
        outcomes = [results.get(timeout=5) for _ in range(n)]
        winners = [i for i in outcomes if i >= 0]
        assert len(winners) == 1
        assert (tmp_path / key).read_bytes() == b"writer-%d" % winners[0]


@pytest.mark.asyncio(loop_factories=["uvloop"])
@pytest.mark.parametrize("store", ["local", pytest.param("s3", marks=pytest.mark.slow)], indirect=True)
async def test_concurrent_creates_exactly_one_wins(store):
    # SeaweedFS serializes competing conditional writes (seconds per round): one round there
    for round_ in range(5 if isinstance(store, LocalObjectStore) else 1):
        key = f"op/0/default/{round_ + 1}_race.delta"
        results = await asyncio.gather(
            *(store.put_if_absent(key, b"writer-%d" % i) for i in range(32)), return_exceptions=True
        )
        winners = [i for i, r in enumerate(results) if not isinstance(r, BaseException)]
        assert len(winners) == 1, results
        assert all(isinstance(r, ObjectExistsError) for r in results if isinstance(r, BaseException))
        assert await store.get(key) == b"writer-%d" % winners[0]


async def test_missing_objects_and_ranges(store):
    with pytest.raises(ObjectNotFoundError):
        [c async for c in store.get_stream("nope")]
    await store.put_if_absent("r", b"0123456789")
    assert await store.get("r", 8) == b"89"
    assert await store.get("r", 8, 100) == b"89"
    assert await store.get("r", 20) == b""


@pytest.mark.slow  # 17 MiB through the S3 server
async def test_s3_multipart_create_if_absent(seaweedfs, s3_bucket):
    async with S3ObjectStore(s3_bucket, "", multipart_threshold=5 << 20, part_size=5 << 20,
                             **seaweedfs.client_options()) as s:
        data = os.urandom(11 << 20)
        await s.put_if_absent("big.snapshot", data)
        assert s.counts["MPU"] == 1
        assert await s.get("big.snapshot") == data
        with pytest.raises(ObjectExistsError):
            await s.put_if_absent("big.snapshot", os.urandom(6 << 20))
        assert await s.get("big.snapshot", 0, 16) == data[:16]
        chunks = [c async for c in s.get_stream("big.snapshot", chunk_size=1 << 20)]
        assert b"".join(chunks) == data


@pytest.mark.slow  # retries and a connect timeout, waited out
async def test_s3_missing_bucket_and_unreachable_endpoint_are_typed(seaweedfs):
    async with S3ObjectStore("no-such-bucket-here", "", **seaweedfs.client_options()) as s:
        with pytest.raises(ObjectStoreError, match="does not exist"):
            await s.put_if_absent("a", b"x")
    opts = dict(seaweedfs.client_options(), endpoint_url=f"http://127.0.0.1:{free_port()}")
    async with S3ObjectStore("b", "", max_attempts=2, connect_timeout=1, **opts) as s:
        with pytest.raises(ObjectStoreUnavailableError):
            await s.get("a")


async def test_s3_uri_selects_s3(seaweedfs, s3_bucket):
    s = open_object_store(f"s3://{s3_bucket}/root/dir", **seaweedfs.client_options())
    assert isinstance(s, S3ObjectStore) and s.prefix == "root/dir" and s.uri == f"s3://{s3_bucket}/root/dir"
    await s.put_if_absent("k", b"v")
    assert [o.key async for o in s.list("")] == ["k"]
    await s.close()


async def test_open_object_store_by_uri(tmp_path):
    s = open_object_store((tmp_path / "x").as_uri())
    assert isinstance(s, LocalObjectStore) and s.root == tmp_path / "x"
    await s.close()
    s = open_object_store(str(tmp_path / "y"))
    assert isinstance(s, LocalObjectStore)
    await s.close()
    with pytest.raises(InterfaceError):
        open_object_store("ftp://host/x")
    with pytest.raises(InterfaceError):
        open_object_store("file://otherhost/x")


async def test_s3_server_side_encryption_is_requested(seaweedfs, s3_bucket):
    import botocore.session

    async with S3ObjectStore(s3_bucket, "enc", sse="AES256", **seaweedfs.client_options()) as s:
        await s.put_if_absent("op/0/default/1_x.delta", b"secret" * 100)
        await s.put("op/_commits/1.json", b"{}")
        assert await s.get("op/0/default/1_x.delta", 0, 6) == b"secret"
    raw = botocore.session.get_session().create_client(
        "s3", endpoint_url=seaweedfs.endpoint_url, aws_access_key_id=seaweedfs.access_key,
        aws_secret_access_key=seaweedfs.secret_key, region_name="us-east-1")
    for k in ("enc/op/0/default/1_x.delta", "enc/op/_commits/1.json"):
        assert raw.head_object(Bucket=s3_bucket, Key=k)["ServerSideEncryption"] == "AES256"
    with pytest.raises(InterfaceError):
        S3ObjectStore(s3_bucket, "", sse="rot13")


@pytest.mark.parametrize("value", ["2026-11-22T08:30:01.123Z", "2026-11-22T08:30:01Z", "2026-11-22T08:30:01.5+02:00",
                                   "2026-11-22T08:30:01", "Sun, 22 Nov 2026 08:30:01 GMT", "1700000000", 1700000000.5])
def test_s3_timestamps_parse_like_botocore(value):
    from botocore.utils import parse_timestamp

    from statestore_async.objectstore.s3 import _parse_timestamp

    expected = parse_timestamp(value)
    if expected.tzinfo is None:  # S3 times are UTC: ours always says so
        expected = expected.replace(tzinfo=datetime.UTC)
    assert _parse_timestamp(value) == expected and _parse_timestamp(value).tzinfo is not None


@pytest.mark.slow  # megabytes through a proxy failing half of the requests, retried
async def test_s3_large_bodies_stream_and_survive_retries(seaweedfs, s3_bucket):
    """A body of 1 MiB or more is streamed from memory (not copied whole on the event loop); a
    retried request (503 from a proxy) seeks it back and sends it again whole."""
    from statestore_async.objectstore.s3 import STREAM_BODY_BYTES
    from statestore_async.testing.faultproxy import FaultProxy

    proxy = FaultProxy(seaweedfs.port, seed=3).start()
    try:
        proxy.error_rate = 0.5
        opts = dict(seaweedfs.client_options(), endpoint_url=proxy.endpoint_url)
        async with S3ObjectStore(s3_bucket, "big", **opts) as s:
            blobs = {f"f{i}.snapshot": os.urandom(STREAM_BODY_BYTES + 12345 * i) for i in range(4)}
            for k, data in blobs.items():
                await s.put_if_absent(k, data)
            proxy.error_rate = 0.0
            for k, data in blobs.items():
                assert await s.get(k) == data
        assert proxy.stats["503"] > 0
    finally:
        proxy.stop()
