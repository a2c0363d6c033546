"""The blocking client against a real daemon process: API, fork safety, many processes, kill -9."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from statestore_async import errors
from statestore_async.client.clients import AsyncClient, Client, StoreHandle
from statestore_async.client.pipeline import Await, Send, pipeline
from statestore_async.client.pipeline import split as _split
from statestore_async.ids import StoreId
from statestore_async.testing.daemon import DaemonProcesses
from statestore_async.wire import protocol as P


def key(i: int) -> bytes:
    return b"\x01\x02" + b"k%07d" % i


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    """A daemon process (max_batch 1000 so that big batches are split); yields (socket, root)."""
    tmp = tmp_path_factory.mktemp("clients")
    with DaemonProcesses(tmp / "daemons") as daemons:
        d = daemons.start("--max-batch", "1000", "--log-level", "warning")
        yield d.socket, f"file://{tmp}/root"


_blob = st.binary(max_size=12)


@settings(max_examples=400, deadline=None)
@given(st.one_of(st.lists(_blob, max_size=60), st.lists(st.tuples(_blob, _blob), max_size=60)),
       st.integers(1, 20), st.integers(24, 200))
def test_split_keeps_order_and_limits(items, max_batch, budget):
    """The client cuts a batch into runs within the daemon's item and byte limits, in order, and
    refuses only an item that fits in no frame."""
    pairs = bool(items) and isinstance(items[0], tuple)
    per_item = 8 if pairs else 4
    size = (lambda x: len(x[0]) + len(x[1]) + per_item) if pairs else (lambda x: len(x) + per_item)
    if any(size(x) + 4 > budget for x in items):
        with pytest.raises(errors.LimitExceededError):
            _split(items, max_batch, budget, pairs)
        return
    runs = _split(items, max_batch, budget, pairs)
    assert [x for r in runs for x in r] == items
    assert all(len(r) <= max_batch and 4 + sum(map(size, r)) <= budget for r in runs)
    assert all(runs) or runs == [[]]


def _drive(frames, window, answer):
    """Run ``pipeline`` with ``answer(rid)`` as the IO (raising: an error answer); the steps taken."""
    steps, log = pipeline(frames, window), []
    step = next(steps)
    try:
        while True:
            log.append(step)
            if isinstance(step, Send):
                step = steps.send(None)
                continue
            try:
                value = answer(step.rid)
            except Exception as exc:
                step = steps.throw(exc)
            else:
                step = steps.send(value)
    except StopIteration as done:
        return log, done.value


def test_pipeline_keeps_the_window_and_answers_in_order():
    frames = [(rid, b"r%d" % rid) for rid in range(1, 6)]
    log, answers = _drive(frames, 2, lambda rid: rid * 10)
    assert log == [Send(1, b"r1", False), Send(2, b"r2", True), Await(1), Send(3, b"r3", True), Await(2),
                   Send(4, b"r4", True), Await(3), Send(5, b"r5", True), Await(4), Await(5)]
    assert answers == [10, 20, 30, 40, 50]
    assert _drive(iter(frames[:1]), 8, lambda rid: "one") == ([Send(1, b"r1", False), Await(1)], ["one"])


def test_pipeline_reads_every_answer_after_an_error_and_stops_on_a_lost_connection():
    def answer(rid):
        if rid in (2, 4):
            raise errors.StoreStateError(f"no {rid}")
        return rid

    frames = [(rid, b"") for rid in range(1, 6)]
    awaited = []

    def answer_logged(rid):
        awaited.append(rid)
        return answer(rid)

    with pytest.raises(errors.StoreStateError, match="no 2"):
        _drive(frames, 3, answer_logged)
    assert awaited == [1, 2, 3, 4, 5]
    awaited.clear()

    def lost(rid):
        awaited.append(rid)
        raise P.ConnectionLostError("gone")

    with pytest.raises(P.ConnectionLostError):
        _drive(frames, 3, lost)
    assert awaited == [1]


async def test_async_pipelines_of_several_tasks_share_the_slots(tmp_path, daemon_process):
    """Each request holds a slot until its answer arrives: pipelines of several tasks, together over
    max_inflight, never wait for each other's slots."""
    sock = daemon_process("--max-batch", "10", "--max-inflight", "2", "--log-level", "warning").socket
    async with AsyncClient(sock, timeout=30) as c:
        handles = [await c.open(StoreId(f"file://{tmp_path}/root", "slots", p), 0) for p in range(3)]
        items = [(key(i), b"v%d" % i) for i in range(95)]
        keys = pa.array([k for k, _ in items], type=pa.binary())
        puts = asyncio.gather(*(h.put_many(items) for h in handles))
        assert await asyncio.wait_for(puts, 60) == [95, 95, 95]
        gets = asyncio.gather(*(h.get_many([k for k, _ in items]) for h in handles),
                              *(h.get_many_arrow(keys) for h in handles))
        got = await asyncio.wait_for(gets, 60)
        assert got[:3] == [[v for _, v in items]] * 3
        assert [a.to_pylist() for a in got[3:]] == [[v for _, v in items]] * 3
        for h in handles:
            await h.abort()
        assert await c.ping(b"still fine") == b"still fine"


def test_round_trip_with_transparent_splitting(daemon):
    sock, root = daemon
    c = Client(sock)
    sid = StoreId(root, "basic", 0)
    items = [(key(i), b"value-%d" % i) for i in range(5500)]
    with c.open(sid, 0) as h:
        assert h.put_many(iter(items)) == 5500  # 6 requests, pipelined
        assert h.remove_many([key(0), key(1)]) == 2
        assert h.get_many(k for k, _ in items) == [None, None] + [v for _, v in items[2:]]
        assert sorted(h.scan(b"\x01\x02k0001")) == items[1000:2000]
        assert len(list(h.scan(limit=10))) == 10
        ref = h.commit()
    assert c.await_durable(sid, ref, 10)
    with c.open(sid, ref.version, ref.ckptid) as h:
        assert h.get_many([key(0), key(2), key(5499)]) == [None, b"value-2", b"value-5499"]
    # the with block aborted it: the store can be opened again
    with c.open(sid, ref.version, ref.ckptid) as h:
        assert h.get(key(3)) == b"value-3"
    c.close()


def test_errors_are_raised_as_the_daemons_classes(daemon):
    sock, root = daemon
    c = Client(sock)
    sid = StoreId(root, "errs", 0)
    with pytest.raises(errors.VersionNotFoundError):
        c.open(sid, 5, "ef" * 16)
    h = c.open(sid, 0)
    with pytest.raises(errors.WriterConflictError):
        Client(sock).open(sid, 0)
    with pytest.raises(errors.KeyFormatError):
        h.put_many([(b"x", b"y")])
    h.commit()
    with pytest.raises(errors.StoreStateError):
        h.put_many([(key(1), b"y")])
    assert c.ping(b"still fine") == b"still fine"


def test_shared_client_survives_fork(daemon):
    sock, root = daemon
    parent = Client.shared(sock)
    assert parent.ping(b"p") == b"p"
    parent_handle = parent.open(StoreId(root, "fork", 0), 0)
    pid = os.fork()
    if pid == 0:  # child: same object, new connection; the parent's handle is refused, not misused
        code = 1
        try:
            child = Client.shared(sock)
            ok = child is parent and child.ping(b"c") == b"c"
            try:
                parent_handle.put_many([(key(1), b"from child")])
                ok = False
            except errors.InterfaceError:
                pass
            with child.open(StoreId(root, "fork", 1), 0) as h:
                h.put_many([(key(1), b"child")])
                h.commit()
            code = 0 if ok else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    parent_handle.put_many([(key(1), b"parent")])  # the parent's connection was not disturbed
    assert parent_handle.get_many([key(1)]) == [b"parent"]
    parent_handle.abort()
    with parent.open(StoreId(root, "fork", 1), 1, None) as h:
        assert h.get(key(1)) == b"child"


WORKER = r"""
import sys
from statestore_async.client import Client
from statestore_async.ids import StoreId
sock, root, p = sys.argv[1], sys.argv[2], int(sys.argv[3])
c = Client.shared(sock)
sid = StoreId(root, "many", p)
ref = None
for b in range(5):
    h = c.open(sid, b, ref.ckptid if ref else None)
    h.put_many([(b"\x00\x01%d-%d" % (p, i), b"%d-%d-%d" % (p, b, i)) for i in range(300)])
    h.remove_many([b"\x00\x01%d-%d" % (p, b)])
    ref = h.commit()
print(ref.version, ref.ckptid)
"""


@pytest.mark.slow
def test_32_client_processes_each_with_its_own_store(daemon):
    sock, root = daemon
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, sock, root, str(p)], stdout=subprocess.PIPE)
             for p in range(32)]
    try:
        outs = [p.communicate(timeout=120)[0].split() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(p.returncode == 0 for p in procs)
    c = Client(sock)
    for p, (version, ckptid) in enumerate(outs):
        assert int(version) == 5
        with c.open(StoreId(root, "many", p), 5, ckptid.decode()) as h:
            got = dict(h.scan(b"\x00\x01"))
        assert len(got) == 299  # every batch rewrites all keys, then removes one; the last removal stays
        assert got[b"\x00\x01%d-3" % p] == b"%d-4-3" % p
        assert b"\x00\x01%d-4" % p not in got


KILLED = r"""
import sys, time
from statestore_async.client import Client
from statestore_async.ids import StoreId
sock, root, ckptid = sys.argv[1], sys.argv[2], sys.argv[3]
c = Client(sock)
h = c.open(StoreId(root, "kill", 0), 1, ckptid)
h.put_many([(b"\x00\x09half-%d" % i, b"never committed") for i in range(3000)])
print("ready", flush=True)
while True:
    h.put_many([(b"\x00\x09more", b"x")])
"""


def test_kill_9_mid_version_leaves_the_store_consistent(daemon):
    sock, root = daemon
    c = Client(sock)
    sid = StoreId(root, "kill", 0)
    with c.open(sid, 0) as h:
        h.put_many([(key(i), b"base") for i in range(100)])
        ref = h.commit()
    proc = subprocess.Popen([sys.executable, "-c", KILLED, sock, root, ref.ckptid], stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline().strip() == b"ready"
        proc.kill()
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + 10
    while True:
        try:
            h = c.open(sid, 1, ref.ckptid)
            break
        except errors.WriterConflictError:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    assert sorted(h.scan()) == [(key(i), b"base") for i in range(100)]
    h.put_many([(key(0), b"after")])
    r2 = h.commit()
    assert r2.version == 2
    with c.open(sid, 2, r2.ckptid) as h:
        assert h.get_many([key(0), b"\x00\x09half-1"]) == [b"after", None]


def test_timeouts_and_lost_daemon_are_connection_errors(tmp_path):
    with pytest.raises(P.ConnectionLostError):
        Client(str(tmp_path / "nobody.sock"), connect_timeout=0.5).ping()


def test_handle_is_bound_to_its_connection(daemon):
    sock, root = daemon
    c = Client(sock)
    h = c.open(StoreId(root, "gen", 0), 0)
    assert isinstance(h, StoreHandle)
    c.close()
    with pytest.raises(errors.InterfaceError):
        h.get_many([key(1)])
    assert c.ping(b"reconnected") == b"reconnected"
    deadline = time.monotonic() + 10
    while True:  # the daemon aborts the old version once it sees the close
        try:
            h2 = c.open(StoreId(root, "gen", 0), 0)
            break
        except errors.WriterConflictError:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    assert h2.get(key(1)) is None
    h2.abort()


def test_rows_in_and_out_with_spark_key_groups(daemon):
    """The *_rows calls take plain Python rows; keys land in Spark's key group of their columns."""
    from statestore_async.codecs import sparkhash
    from statestore_async.codecs.keylayout import key_group_of
    from statestore_async.codecs.pyrows import decode_key

    sock, root = daemon
    c = Client(sock)
    sid = StoreId(root, "rows", 0)
    items = [((f"user-{i}", i % 3), {"count": i, "tags": ["a", "b"][: i % 3], "avg": i / 7}) for i in range(2500)]
    with c.open(sid, 0) as h:
        assert h.put_rows(items, key_types=["string", "int"], num_key_groups=128) == 2500
        h.remove_rows([("user-0", 0)], key_types=["string", "int"], num_key_groups=128)
        ref = h.commit()
    with c.open(sid, ref.version, ref.ckptid) as h:
        got = h.get_rows([k for k, _ in items[:5]] + [("nobody", 1)], key_types=["string", "int"], num_key_groups=128)
        assert got == [None] + [v for _, v in items[1:5]] + [None]
        scanned = dict(h.scan_rows())
        raw = dict(h.scan(b""))
        h.abort()
    assert scanned == dict(items[1:])
    for key in raw:
        row = decode_key(key)
        assert key_group_of(key) == sparkhash.key_group(sparkhash.spark_xxhash64(row, ["string", "int"]), 128)


def test_pipelined_batches_with_big_answers_do_not_deadlock(daemon):
    """A get_many of many max_batch-sized requests whose answers outgrow the socket buffers: the
    client must read answers while it still sends, or both sides wait on each other forever."""
    sock, root = daemon
    c = Client(sock, timeout=30)
    sid = StoreId(root, "bigpipe", 0)
    value = os.urandom(600)
    keys = [key(i) for i in range(60_000)]
    with c.open(sid, 0) as h:
        h.put_many([(k, value) for k in keys])
        got = h.get_many(keys)  # 60 requests of 1000 keys in flight, ~36 MB of answers
        assert len(got) == 60_000 and all(v == value for v in got)
        arrow_got = h.get_many_arrow(pa.array(keys, type=pa.binary()))
        assert len(arrow_got) == 60_000
        h.abort()
