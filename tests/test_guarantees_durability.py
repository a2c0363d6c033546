"""Issue 18, "no acknowledged write is ever lost": the durability guarantees of docs/GUARANTEES.md,
each shown with a real fault — a full file system (a tmpfs with no inodes left), a lost S3 answer
(the fault proxy forwards the request, then cuts the connection before the answer), a slow S3
and a short drain, bad credentials, a missing bucket, a daemon killed in the middle of a
multipart upload — on real daemons (processes, or in-process under asyncio and uvloop) and a
real S3 server (SeaweedFS).

Every wait polls a condition with a generous deadline; every process a test starts is stopped
by a fixture or a ``finally``, pass or fail.
"""
from __future__ import annotations

import asyncio
import errno
import os
import re
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from statestore_async.client import Client
from statestore_async.client.clients import AsyncClient
from statestore_async.errors import (
    CheckpointConflictError,
    ObjectStoreAccessError,
    StorageFullError,
    UploadFailedError,
)
from statestore_async.files.loader import load_store
from statestore_async.files.names import DELTA, file_key
from statestore_async.files.transfer import create_checkpoint_file
from statestore_async.ids import CheckpointRef, StoreId
from statestore_async.objectstore import LocalObjectStore
from statestore_async.objectstore.s3 import S3ObjectStore
from statestore_async.testing.daemon import stop_daemon, wait_until_answering

DEADLINE = 60.0  # seconds any awaited condition may take on a loaded 2-core machine


# --- fixtures and helpers ------------------------------------------------------------------------
class FullDisk:
    """A tmpfs whose inodes are all taken by filler files: creating a file or a folder fails
    with ENOSPC until ``free()``."""

    def __init__(self, path: Path):
        self.path = path
        self.fillers: list[Path] = []

    def fill(self) -> None:
        while True:
            p = self.path / f"filler-{len(self.fillers)}"
            try:
                p.touch()
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
                return
            self.fillers.append(p)

    def free(self) -> None:
        for p in self.fillers:
            p.unlink()
        self.fillers.clear()


@pytest.fixture
def full_disk(tmp_path):
    """A real full file system (root may mount a tmpfs; elsewhere the test is skipped)."""
    mnt = tmp_path / "full"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,nr_inodes=64", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs (root only): {r.stderr.strip()}")
    try:
        disk = FullDisk(mnt)
        disk.fill()
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def s3_args(endpoint: str, *more: str) -> tuple[str, ...]:
    return ("--s3-endpoint-url", endpoint, "--s3-region", "us-east-1", "--s3-addressing-style", "path", *more)


def key(i: int) -> bytes:
    return (i % 4096).to_bytes(2, "big") + b"key-%06d" % i


def commit(client: Client, sid: StoreId, parent: CheckpointRef, n: int = 50, ckptid: str | None = None,
           value: bytes = b"v") -> CheckpointRef:
    with client.open(sid, parent.version, parent.ckptid or None) as h:
        h.put_many([(key(i), b"%s-%d-%d" % (value, parent.version + 1, i)) for i in range(n)])
        return h.commit(ckptid)


def wait_until(condition, timeout: float = DEADLINE, what: str = "condition"):
    """Poll ``condition()`` until it returns something truthy (returned); fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        got = condition()
        if got:
            return got
        assert time.monotonic() < deadline, f"{what}: still false after {timeout} s"
        time.sleep(0.05)


async def async_wait_until(condition, timeout: float = DEADLINE, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        got = condition()
        if got:
            return got
        assert time.monotonic() < deadline, f"{what}: still false after {timeout} s"
        await asyncio.sleep(0.05)


def exists(s3, bucket: str, k: str) -> bool:
    try:
        s3.head_object(Bucket=bucket, Key=k)
        return True
    except s3.exceptions.ClientError:
        return False


def loads(objstore_factory, sid: StoreId, ref: CheckpointRef) -> dict[bytes, bytes]:
    """The state ``ref`` as a fresh reader rebuilds it from the object store alone."""

    async def go():
        async with objstore_factory() as st:
            store, _ = await load_store(st, sid, ref)
            return dict(store.items())

    return asyncio.run(go())


def expected(parents: list[CheckpointRef], n: int = 50, value: bytes = b"v") -> dict[bytes, bytes]:
    """The state after commits made with ``commit`` on each of ``parents`` in turn."""
    out: dict[bytes, bytes] = {}
    for p in parents:
        out.update({key(i): b"%s-%d-%d" % (value, p.version + 1, i) for i in range(n)})
    return out


def health(socket: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "statestore_async.cli", "health", "--socket", socket, *flags],
                          capture_output=True, text=True, timeout=60)


def durable_or_error(client: Client, sid: StoreId, ref: CheckpointRef, timeout: float = 1.0):
    """What AWAIT_DURABLE answers: True/False, or the error instance it raised."""
    try:
        return client.await_durable(sid, ref, timeout=timeout)
    except Exception as exc:  # the answer under test
        return exc


# --- (2) durable means loadable; retried until it succeeds; answered, never timed out ----------
@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_a_cache_folder_without_inodes_never_fails_an_upload_and_durable_versions_load(
        full_disk, daemon_process, seaweedfs, s3_bucket, aws_env, loop):
    """The node's cache folder is on a file system with no inode left: the cache copy fails
    (logged); the uploads to S3 do not. v1's AWAIT_DURABLE is answered True (it used to be
    failed for good on a plain OSError, its request task dying unanswered), v2's too once space
    is back, and both load in a fresh reader from S3 alone (v2 used to be durable without v1)."""
    d = daemon_process(*s3_args(seaweedfs.endpoint_url, "--cache-dir", str(full_disk.path / "cache"),
                                "--loop", loop))
    sid = StoreId(f"s3://{s3_bucket}/ckpt", "op", 0)
    with Client(d.socket, timeout=60) as c:
        v1 = commit(c, sid, CheckpointRef(0, ""))
        # the upload of v1 is over, one way or the other, before space comes back
        wait_until(lambda: sum(c.stats()["uploader"]["states"][s] for s in ("durable", "failed")) >= 1,
                   what="v1's upload finished")
        assert durable_or_error(c, sid, v1, timeout=20) is True
        full_disk.free()
        v2 = commit(c, sid, v1)
        assert durable_or_error(c, sid, v2, timeout=20) is True
        assert c.stats()["uploader"]["failed"] == 0
    assert "cannot use the cache folder" in d.log()

    def fresh():
        return S3ObjectStore(s3_bucket, "ckpt", **seaweedfs.client_options())

    assert loads(fresh, sid, v1) == expected([CheckpointRef(0, "")])
    assert loads(fresh, sid, v2) == expected([CheckpointRef(0, ""), v1])


def test_a_full_disk_is_answered_at_once_v2_is_never_durable_before_v1_and_both_load_once_it_heals(
        full_disk, daemon_process):
    """The object store is a local folder on a full file system: every attempt fails with
    ENOSPC. AWAIT_DURABLE answers StorageFullError at once (not a timeout, never True for v2
    while v1 is not there), health says degraded; the uploads are retried and, once space is
    back, v1 then v2 reach the folder and load."""
    root = full_disk.path.as_uri()
    d = daemon_process()
    sid = StoreId(root, "op", 0)
    with Client(d.socket, timeout=60) as c:
        v1 = commit(c, sid, CheckpointRef(0, ""))
        v2 = commit(c, sid, v1)
        t = time.monotonic()
        with pytest.raises(StorageFullError):
            c.await_durable(sid, v2, timeout=10)
        assert time.monotonic() - t < 8  # answered, not timed out
        with pytest.raises(StorageFullError):
            c.await_durable(sid, v1, timeout=10)
        assert not (full_disk.path / file_key(sid, v1, DELTA)).exists()
        report = c.stats()["health"]
        assert report["status"] == "degraded" and "StorageFullError" in report["reasons"][0]
        assert health(d.socket, "--ready").returncode == 3

        full_disk.free()
        # v2 is never answered True while v1's file is missing
        seen = []

        def v2_durable():
            answer = durable_or_error(c, sid, v2, timeout=1)
            seen.append((answer, (full_disk.path / file_key(sid, v1, DELTA)).exists()))
            return answer is True

        wait_until(v2_durable, what="v2 durable once space is back")
        assert all(v1_there for answer, v1_there in seen if answer is True)
        assert c.await_durable(sid, v1, timeout=10) is True
        assert c.stats()["health"]["status"] == "ok"
        assert health(d.socket, "--ready").returncode == 0

    def fresh():
        return LocalObjectStore(full_disk.path)

    assert loads(fresh, sid, v2) == expected([CheckpointRef(0, ""), v1])


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_a_version_whose_upload_failed_for_good_fails_everything_that_depends_on_it(
        daemon_process, seaweedfs, s3, s3_bucket, aws_env, loop):
    """v1's name is taken by other bytes (two writers used one checkpoint id): its upload fails
    for good with CheckpointConflictError. v2 and v3, built on v1, are answered with
    UploadFailedError naming v1's file — never True — and are not uploaded (a v2 file without v1
    would not load). Another attempt at v1 from v0 is unaffected."""
    d = daemon_process(*s3_args(seaweedfs.endpoint_url, "--loop", loop))
    sid = StoreId(f"s3://{s3_bucket}/ckpt", "op", 0)
    taken = uuid.uuid4().hex
    v1_key = file_key(sid, CheckpointRef(1, taken), DELTA)
    s3.put_object(Bucket=s3_bucket, Key=f"ckpt/{v1_key}", Body=b"another writer's bytes")
    with Client(d.socket, timeout=60) as c:
        v1 = commit(c, sid, CheckpointRef(0, ""), ckptid=taken)
        v2 = commit(c, sid, v1)
        v3 = commit(c, sid, v2)
        with pytest.raises(CheckpointConflictError, match=re.escape(v1_key)):
            c.await_durable(sid, v1, timeout=20)
        for v in (v2, v3):
            with pytest.raises(UploadFailedError, match=re.escape(v1_key)) as e:
                c.await_durable(sid, v, timeout=20)
            assert "lineage" in str(e.value)
        other = commit(c, sid, CheckpointRef(0, ""), value=b"w")
        assert c.await_durable(sid, other, timeout=20) is True
        assert c.stats()["uploader"]["failed"] == 3
    for v in (v2, v3):
        assert not exists(s3, s3_bucket, f"ckpt/{file_key(sid, v, DELTA)}")
    # a stop with acknowledged commits that never became durable says so
    assert d.stop() == 3
    assert "NOT DURABLE" in d.log() and f"2_{v2.ckptid}" in d.log()


async def test_an_upload_is_retried_whatever_it_raises_and_v2_waits_for_v1(daemon_factory, tmp_path):
    """Any failure of an attempt is retried (a plain OSError, not an object-store error, used to
    fail the upload for good): v1 fails its first attempts, v2 is not reported durable before v1
    is, and both end up durable and loadable."""
    failing = {"left": 3}

    class Flaky(LocalObjectStore):
        async def put_if_absent(self, key, data):
            if key.startswith("op/0/default/1_") and failing["left"]:
                failing["left"] -= 1
                raise OSError(errno.EIO, "I/O error (injected)")
            return await super().put_if_absent(key, data)

    root = (tmp_path / "root").as_uri()
    d = await daemon_factory(open_objstore=lambda uri: Flaky(tmp_path / "root", fsync=False))
    d.uploader.retry_base = 0.2
    sid = StoreId(root, "op", 0)
    async with AsyncClient(d.config.socket) as c:
        h = await c.open(sid, 0)
        await h.put_many([(key(1), b"one")])
        v1 = await h.commit()
        h = await c.open(sid, v1.version, v1.ckptid)
        await h.put_many([(key(2), b"two")])
        v2 = await h.commit()
        assert await c.await_durable(sid, v2, timeout=0.3) is False  # v1 still failing: not yet
        assert not (tmp_path / "root" / file_key(sid, v1, DELTA)).exists()
        assert await c.await_durable(sid, v2, timeout=DEADLINE) is True
        assert await c.await_durable(sid, v1, timeout=1) is True
    assert failing["left"] == 0 and d.uploader.counters["retries"] >= 3 and d.uploader.counters["failed"] == 0
    async with LocalObjectStore(tmp_path / "root") as st:
        store, _ = await load_store(st, sid, v2)
        assert dict(store.items()) == {key(1): b"one", key(2): b"two"}


# --- (3) a PUT whose answer was lost is a success ----------------------------------------------
@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_a_put_whose_answer_was_lost_is_durable_without_an_error(
        daemon_process, proxy, seaweedfs, s3_bucket, aws_env, loop):
    """The proxy forwards v1's PUT to S3, which stores it, and cuts the connection before the
    answer: the retry finds the name taken (412) by the very bytes meant, so v1 is durable —
    not ObjectExistsError — and loads."""
    d = daemon_process(*s3_args(proxy.endpoint_url, "--loop", loop))
    sid = StoreId(f"s3://{s3_bucket}/ckpt", "op", 0)
    proxy.drop_next_response("PUT", ".delta")
    with Client(d.socket, timeout=60) as c:
        v1 = commit(c, sid, CheckpointRef(0, ""))
        assert c.await_durable(sid, v1, timeout=DEADLINE) is True
        assert c.stats()["uploader"]["failed"] == 0
    assert proxy.stats["dropped_response"] == 1 and proxy.armed_drops == 0
    assert "failed for good" not in d.log()
    assert loads(lambda: S3ObjectStore(s3_bucket, "ckpt", **seaweedfs.client_options()), sid, v1) == expected(
        [CheckpointRef(0, "")])


async def test_a_multipart_upload_whose_complete_answer_was_lost_is_a_success(proxy, seaweedfs, s3, s3_bucket):
    """The same for a large file: the CompleteMultipartUpload reaches S3, its answer is lost;
    create_checkpoint_file ends in success (the bytes there are the bytes meant) and no
    incomplete upload stays behind."""
    opts = dict(seaweedfs.client_options(), endpoint_url=proxy.endpoint_url)
    sid = StoreId(f"s3://{s3_bucket}/ckpt", "op", 0)
    ref = CheckpointRef(1, uuid.uuid4().hex)
    data = os.urandom((5 << 20) + 4321)
    proxy.drop_next_response("POST", "uploadId=")
    async with S3ObjectStore(s3_bucket, "ckpt", multipart_threshold=1 << 20, part_size=5 << 20, **opts) as st:
        await create_checkpoint_file(st, sid, ref, DELTA, data)
        assert st.counts["MPU"] >= 1
    assert proxy.stats["dropped_response"] == 1
    got = s3.get_object(Bucket=s3_bucket, Key=f"ckpt/{file_key(sid, ref, DELTA)}")["Body"].read()
    assert got == data
    assert not s3.list_multipart_uploads(Bucket=s3_bucket, Prefix="ckpt/").get("Uploads")


# --- (4) SIGTERM: non-zero when acknowledged commits are not durable; degraded on bad credentials
def not_durable_in_log(log: str) -> set[str]:
    found: set[str] = set()
    for m in re.finditer(r"NOT DURABLE: \S+ \S+: \d+ acknowledged versions: ([0-9a-f_ ]+)", log):
        found.update(m.group(1).split())
    return found


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_sigterm_exits_non_zero_listing_the_versions_a_short_drain_left_behind(
        daemon_process, proxy, s3, s3_bucket, aws_env, loop):
    """S3 answers each request after 0.5 s and the drain may take 3 s: 30 commits were
    acknowledged, the drain times out, and the daemon exits 3 naming every version not in S3;
    every version it does not name is there."""
    proxy.latency = 0.5
    d = daemon_process(*s3_args(proxy.endpoint_url, "--drain-timeout", "3", "--loop", loop))
    sid = StoreId(f"s3://{s3_bucket}/ckpt", "op", 0)
    refs = []
    with Client(d.socket, timeout=60) as c:
        parent = CheckpointRef(0, "")
        for _ in range(30):
            parent = commit(c, sid, parent, n=5)
            refs.append(parent)
    t = time.monotonic()
    code = d.stop(timeout=DEADLINE)
    assert code == 3, d.log()
    assert time.monotonic() - t < 3 + 20  # the drain is bounded
    listed = not_durable_in_log(d.log())
    in_s3 = {f"{r.version}_{r.ckptid}" for r in refs if exists(s3, s3_bucket, f"ckpt/{file_key(sid, r, DELTA)}")}
    every = {f"{r.version}_{r.ckptid}" for r in refs}
    assert listed and listed <= every
    assert every - in_s3 <= listed  # whatever is not in S3 is listed ...
    assert every - listed <= in_s3  # ... and nothing unlisted is missing


def test_bad_credentials_degrade_the_daemon_and_await_durable_names_the_problem(
        daemon_process, seaweedfs, s3, s3_bucket, aws_env):
    """A wrong secret key: S3 answers SignatureDoesNotMatch to every upload. AWAIT_DURABLE
    raises ObjectStoreAccessError naming it at once (it used to wait for its timeout and say
    False), health says degraded with the reason (liveness still 0, readiness 3), and SIGTERM
    exits 3 listing the commit."""
    env = dict(os.environ, AWS_SECRET_ACCESS_KEY="not-the-secret")
    d = daemon_process(*s3_args(seaweedfs.endpoint_url, "--drain-timeout", "2"), env=env)
    sid = StoreId(f"s3://{s3_bucket}/ckpt", "op", 0)
    with Client(d.socket, timeout=60) as c:
        v1 = commit(c, sid, CheckpointRef(0, ""))
        t = time.monotonic()
        with pytest.raises(ObjectStoreAccessError, match="SignatureDoesNotMatch"):
            c.await_durable(sid, v1, timeout=30)
        assert time.monotonic() - t < 20
        report = c.stats()["health"]
        assert report["status"] == "degraded"
        assert "SignatureDoesNotMatch" in report["reasons"][0] and sid.root in report["reasons"][0]
    live, ready = health(d.socket), health(d.socket, "--ready")
    assert live.returncode == 0 and "degraded" in live.stdout and "SignatureDoesNotMatch" in live.stdout
    assert ready.returncode == 3 and "SignatureDoesNotMatch" in ready.stderr
    assert not exists(s3, s3_bucket, f"ckpt/{file_key(sid, v1, DELTA)}")
    assert d.stop(timeout=DEADLINE) == 3
    assert f"1_{v1.ckptid}" in not_durable_in_log(d.log())


async def test_a_missing_bucket_degrades_until_it_exists_then_the_retried_upload_succeeds(
        daemon_factory, seaweedfs, s3, aws_env):
    """The uploads are retried in the background while degraded: once the bucket exists, the
    same commit becomes durable and the daemon is healthy again."""
    bucket = f"later-{uuid.uuid4().hex[:12]}"
    d = await daemon_factory(s3_endpoint_url=seaweedfs.endpoint_url, s3_region="us-east-1",
                             s3_addressing_style="path")
    d.uploader.retry_max = 0.5
    sid = StoreId(f"s3://{bucket}/ckpt", "op", 0)
    async with AsyncClient(d.config.socket) as c:
        h = await c.open(sid, 0)
        await h.put_many([(key(1), b"one")])
        v1 = await h.commit()
        with pytest.raises(ObjectStoreAccessError, match="does not exist"):
            await c.await_durable(sid, v1, timeout=30)
        assert d.health()["status"] == "degraded"
        s3.create_bucket(Bucket=bucket)
        await async_wait_until(lambda: d.health()["status"] == "ok", what="healthy once the bucket exists")
        assert await c.await_durable(sid, v1, timeout=DEADLINE) is True
    assert exists(s3, bucket, f"ckpt/{file_key(sid, v1, DELTA)}")


# --- (10) incomplete multipart uploads: aborted on failure, and what a killed daemon left ------
_SMALL_MULTIPART_DAEMON = textwrap.dedent("""
    import asyncio, sys
    from statestore_async.config import DaemonConfig
    from statestore_async.daemon import process, server
    from statestore_async.objectstore.s3 import S3ObjectStore

    socket, endpoint = sys.argv[1], sys.argv[2]
    config = DaemonConfig(socket=socket, loop="asyncio")

    def open_objstore(uri):  # multipart above 1 MiB (the stock daemon: 64 MiB)
        return S3ObjectStore.from_uri(uri, endpoint_url=endpoint, region="us-east-1", addressing_style="path",
                                      multipart_threshold=1 << 20, part_size=5 << 20)

    process.configure_logging(config)
    sys.exit(asyncio.run(server.serve(config, open_objstore=open_objstore)))
""")


def test_the_leftovers_of_a_daemon_killed_during_a_multipart_upload_are_aborted_by_the_next_writer(
        daemon_process, proxy, s3, s3_bucket, aws_env, tmp_path, sockdir):
    """A daemon uploading a 6 MiB delta in parts (through a slow proxy) is SIGKILLed once the
    multipart upload exists in S3: its parts stay behind. The next daemon to upload to that
    store aborts them before its first upload there."""
    script = tmp_path / "small_multipart_daemon.py"
    script.write_text(_SMALL_MULTIPART_DAEMON)
    socket_path = f"{sockdir}/k.sock"
    log_path = str(tmp_path / "killed.log")
    sid = StoreId(f"s3://{s3_bucket}/ckpt", "op", 0)
    prefix = f"ckpt/{sid.prefix}/"
    proxy.latency = 1.0
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, str(script), socket_path, proxy.endpoint_url], stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        wait_until_answering(proc, socket_path, log_path=log_path)
        with Client(socket_path, timeout=60) as c, c.open(sid, 0) as h:
            h.put_many([(key(i), os.urandom(1 << 20)) for i in range(6)])
            h.commit()

        def leftovers():
            return s3.list_multipart_uploads(Bucket=s3_bucket, Prefix=prefix).get("Uploads") or []

        wait_until(leftovers, what="the multipart upload started")
        proc.kill()
        proc.wait(timeout=DEADLINE)
    finally:
        stop_daemon(proc, timeout=5)
    assert len(leftovers()) == 1
    assert not s3.list_objects_v2(Bucket=s3_bucket, Prefix=prefix).get("Contents")  # never completed
    proxy.latency = 0.0

    d = daemon_process(*s3_args(proxy.endpoint_url))
    with Client(d.socket, timeout=60) as c:
        v1 = commit(c, sid, CheckpointRef(0, ""))
        assert c.await_durable(sid, v1, timeout=DEADLINE) is True
        wait_until(lambda: not leftovers(), what="the leftover aborted")
        assert c.stats()["uploader"]["multipart_aborted"] == 1
    assert "aborted the incomplete multipart upload" in d.log()


async def test_a_cancelled_multipart_upload_is_aborted(proxy, seaweedfs, s3, s3_bucket):
    """A multipart upload cancelled half way (a drain that timed out cancels its uploads) aborts
    its upload: no parts stay in the bucket."""
    opts = dict(seaweedfs.client_options(), endpoint_url=proxy.endpoint_url)
    proxy.latency = 0.5
    async with S3ObjectStore(s3_bucket, "ckpt", multipart_threshold=1 << 20, part_size=5 << 20, **opts) as st:
        task = asyncio.ensure_future(st.put_if_absent("op/0/default/1_x.delta", os.urandom(11 << 20)))
        await async_wait_until(
            lambda: s3.list_multipart_uploads(Bucket=s3_bucket, Prefix="ckpt/").get("Uploads"),
            what="the multipart upload started")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert not s3.list_multipart_uploads(Bucket=s3_bucket, Prefix="ckpt/").get("Uploads")


def test_selftest_says_what_the_uploads_do_when_a_version_is_not_durable(daemon_process, aws_env):
    """The object store's endpoint does not answer (nothing listens there): uploads are retried
    (not a degraded root), so the Helm test's selftest waits out its timeout; it then exits 1 and
    says what the daemon's uploads are doing and where to read the object store's answers, not
    only "not durable"."""
    from statestore_async.testing.seaweedfs import _free_port

    endpoint = f"http://127.0.0.1:{_free_port()}"
    d = daemon_process(*s3_args(endpoint, "--drain-timeout", "1"))
    r = subprocess.run([sys.executable, "-m", "statestore_async.cli", "selftest", "--socket", d.socket,
                        "--root", "s3://nobody-answers/ckpt", "--timeout", "3"],
                       env=dict(os.environ, STATESTORE_S3_ENDPOINT_URL=endpoint, STATESTORE_S3_REGION="us-east-1"),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r
    said = re.search(r"was not durable within 3.0s \(the daemon's uploads: (\d+) waiting or in flight, \d+ attempts "
                     r"failed and retried, 0 durable\); its log names each failed attempt", r.stderr)
    assert said and int(said.group(1)) >= 1, r.stderr
