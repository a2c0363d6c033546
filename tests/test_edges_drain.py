"""Issue 40, edge 5: what SIGTERM's drain does (docs/GUARANTEES.md, "daemon gets SIGTERM").

The socket stops listening at once (a new client finds no daemon: a successor may bind the path
while this one drains). The connections already there stay through the drain: a version open on
one can still be written and committed, AWAIT_DURABLE and STATS are answered, OPEN is refused with
``ShuttingDownError``. They are closed once nothing is open or in flight and every upload is done,
or at ``drain_timeout`` (a version still open then is aborted: never acknowledged, so the exit
code stays 0). Before, every idle connection was closed at once, including one holding an open
version: a COMMIT or AWAIT_DURABLE sent 0.3 s after SIGTERM got a broken pipe.

Real daemons: a process with a real SIGTERM against SeaweedFS behind a fault proxy (slow uploads
keep the drain going), and in-process ones (both loops) stopped as SIGTERM stops them."""
from __future__ import annotations

import asyncio
import signal
import time

import pytest

from statestore_async import errors
from statestore_async.client.clients import AsyncClient, Client
from statestore_async.ids import StoreId

DEADLINE = 60.0


def key(i: int) -> bytes:
    return b"\x00\x07" + b"key-%06d" % i


def wait_until(condition, what: str, timeout: float = DEADLINE):
    deadline = time.monotonic() + timeout
    while not (got := condition()):
        assert time.monotonic() < deadline, f"{what}: still false after {timeout} s"
        time.sleep(0.02)
    return got


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_after_sigterm_open_versions_commit_and_await_durable_is_answered(
        daemon_process, proxy, seaweedfs, s3_bucket, aws_env, loop):
    proxy.latency = 1.0  # each upload takes a second: the drain lasts a while
    d = daemon_process("--s3-endpoint-url", proxy.endpoint_url, "--s3-region", "us-east-1",
                       "--s3-addressing-style", "path", "--loop", loop, "--drain-timeout", "50")
    root = f"s3://{s3_bucket}/ckpt"
    done, writing = StoreId(root, "done", 0), StoreId(root, "writing", 0)
    with Client(d.socket, timeout=DEADLINE) as a, Client(d.socket, timeout=DEADLINE) as b:
        with a.open(done, 0) as h:
            h.put_many([(key(1), b"before")])
            v1 = h.commit()  # acknowledged; its upload takes a second
        w = b.open(writing, 0)
        w.put_many([(key(1), b"open at SIGTERM")])
        d.proc.send_signal(signal.SIGTERM)
        # (the probe sent these 0.3 s after SIGTERM; here, as soon as the daemon is stopping)
        wait_until(lambda: b.stats()["health"]["status"] == "stopping", "the daemon to be stopping")
        assert a.await_durable(done, v1, timeout=DEADLINE) is True
        w.put_many([(key(2), b"during the drain")])
        ref = w.commit()
        assert b.await_durable(writing, ref, timeout=DEADLINE) is True
        with pytest.raises(errors.ShuttingDownError):
            b.open(done, v1.version, v1.ckptid)
        # no new connection: nobody listens
        with pytest.raises(errors.ConnectionLostError), Client(d.socket, connect_timeout=5) as c:
            c.ping()
    assert d.proc.wait(timeout=DEADLINE) == 0, d.log()
    assert "uploads drained: True" in d.log()


async def test_a_version_still_open_at_the_drains_end_is_aborted_and_the_stop_is_clean(daemon_factory, tmp_path):
    d = await daemon_factory(drain_timeout=1.0)
    sid = StoreId(f"file://{tmp_path}/root", "slow", 0)
    async with AsyncClient(d.config.socket) as c:
        h = await c.open(sid, 0)
        await h.put_many([(key(1), b"v")])
        stopping = asyncio.create_task(d.stop())
        while not d.stopping:
            await asyncio.sleep(0.01)
        assert await h.put_many([(key(2), b"w")]) == 1  # still served during the drain
        assert await asyncio.wait_for(stopping, DEADLINE) is True  # nothing acknowledged was lost
        assert d.counters["aborted_on_disconnect"] == 1
        with pytest.raises(errors.ConnectionLostError):
            await h.commit()


async def test_idle_connections_do_not_hold_the_drain(daemon_factory, tmp_path):
    """The drain ends as soon as nothing is open, in flight or queued, however many idle clients
    stay connected (a Spark worker keeps its client for its whole life)."""
    d = await daemon_factory(drain_timeout=DEADLINE)
    sid = StoreId(f"file://{tmp_path}/root", "quick", 0)
    clients = [await AsyncClient.connect(d.config.socket) for _ in range(3)]
    for c in clients:
        await c.ping()
    h = await clients[0].open(sid, 0)
    await h.put_many([(key(1), b"v")])
    await h.commit()
    started = time.monotonic()
    assert await asyncio.wait_for(d.stop(), DEADLINE) is True
    assert time.monotonic() - started < DEADLINE / 2
    for c in clients:
        await c.close()
