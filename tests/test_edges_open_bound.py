"""Issue 40, edge 3: every OPEN answers, or fails with a typed error, within a stated bound whatever
the store's uploads are doing. An OPEN that must load a store whose earlier commits are still
queued for upload waits for them at most ``open_wait_timeout`` (``OpenTimeoutError`` after); when
the store's root refuses uploads (bad credentials: degraded) it fails at once with that error. Both
are logged. Real daemons in-process (both loops), real SeaweedFS for the refused credentials."""
from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid

import pytest

from statestore_async import errors
from statestore_async.client.clients import AsyncClient, Client
from statestore_async.ids import StoreId, new_checkpoint_id
from statestore_async.objectstore import LocalObjectStore

DEADLINE = 60.0  # generous: a busy 2-core machine


def key(i: int) -> bytes:
    return b"\x00\x07" + b"key-%06d" % i


async def _commit_one(c: AsyncClient, sid: StoreId, value: bytes = b"v"):
    h = await c.open(sid, 0)
    await h.put_many([(key(1), value)])
    return await h.commit()


def test_an_open_behind_uploads_a_root_refuses_fails_at_once_naming_why(daemon_process, seaweedfs, s3_bucket,
                                                                         aws_env):
    """The issue's case: a commit queued for a root whose credentials are wrong; ``open(store, v,
    new ckptid)`` got no answer at all. Now: ``ObjectStoreAccessError`` at once, naming the store,
    the S3 error and the fix, and logged; the version in memory still opens."""
    env = dict(os.environ, AWS_SECRET_ACCESS_KEY="not-the-secret")
    d = daemon_process("--s3-endpoint-url", seaweedfs.endpoint_url, "--s3-region", "us-east-1",
                       "--s3-addressing-style", "path", "--drain-timeout", "1", env=env)
    sid = StoreId(f"s3://{s3_bucket}/ckpt", "op", 0)
    with Client(d.socket, timeout=DEADLINE + 30) as c:
        with c.open(sid, 0) as h:
            h.put_many([(key(1), b"v")])
            v1 = h.commit()
        started = time.monotonic()
        with pytest.raises(errors.ObjectStoreAccessError) as exc:
            c.open(sid, 1, new_checkpoint_id())
        assert time.monotonic() - started < 20
        msg = str(exc.value)
        assert str(sid) in msg and "SignatureDoesNotMatch" in msg and "credentials" in msg
        with c.open(sid, v1.version, v1.ckptid) as h:  # in memory: no wait, no load
            assert h.get_many([key(1)]) == [b"v"]
            h.abort()
        assert c.stats()["registry"]["opens_refused_uploads"] == 1
    assert "refuses this daemon's uploads" in d.log()
    assert d.stop() == 3  # v1 was acknowledged and never durable


async def test_an_evicted_stores_open_fails_at_once_while_its_root_refuses_uploads(daemon_factory, seaweedfs,
                                                                                   aws_env, caplog):
    """Evicted with its commit still queued for a root that refuses it (a missing bucket): its own
    version cannot be loaded before that upload, and the OPEN says so at once."""
    d = await daemon_factory(s3_endpoint_url=seaweedfs.endpoint_url, s3_region="us-east-1",
                             s3_addressing_style="path", drain_timeout=1.0)  # its upload never drains
    d.uploader.retry_max = 0.5
    sid = StoreId(f"s3://missing-{uuid.uuid4().hex[:12]}/ckpt", "op", 0)
    caplog.set_level(logging.WARNING, logger="statestore_async.daemon.registry")
    async with AsyncClient(d.config.socket, timeout=DEADLINE + 30) as c:
        v1 = await _commit_one(c, sid)
        assert d.registry is not None
        d.registry.memory_budget = 1
        d.registry.enforce_budget()
        assert d.registry.get(sid) is None
        with pytest.raises(errors.ObjectStoreAccessError) as exc:
            await asyncio.wait_for(c.open(sid, v1.version, v1.ckptid), DEADLINE)
        assert str(sid) in str(exc.value) and "does not exist" in str(exc.value)
        assert any(str(sid) in r.getMessage() and "refuses" in r.getMessage() for r in caplog.records)
    assert d.registry.counters["opens_refused_uploads"] == 1


class GatedStore(LocalObjectStore):
    """The local object store whose uploads (``put_if_absent``) wait for ``gate``: an object store
    that accepts nothing for a while without refusing (slow, or unreachable and retried)."""

    gate: asyncio.Event

    def __init__(self, uri: str):
        super().__init__(uri.removeprefix("file://"), fsync=False)

    async def put_if_absent(self, k, data):
        await self.gate.wait()
        return await super().put_if_absent(k, data)


async def test_an_open_behind_stalled_uploads_fails_after_open_wait_timeout_then_opens(daemon_factory, tmp_path,
                                                                                      caplog):
    GatedStore.gate = gate = asyncio.Event()
    d = await daemon_factory(open_objstore=GatedStore, open_wait_timeout=1.0)
    sid = StoreId(f"file://{tmp_path}/root", "stall", 0)
    caplog.set_level(logging.WARNING, logger="statestore_async.daemon.registry")
    try:
        async with AsyncClient(d.config.socket) as c:
            v1 = await _commit_one(c, sid, b"one")
            assert d.registry is not None
            d.registry.memory_budget = 1
            d.registry.enforce_budget()  # evicted: its upload is pending, so a reload must wait
            assert d.registry.get(sid) is None
            started = time.monotonic()
            with pytest.raises(errors.OpenTimeoutError) as exc:
                await asyncio.wait_for(c.open(sid, v1.version, v1.ckptid), DEADLINE)
            waited = time.monotonic() - started
            assert 0.9 <= waited < 15, waited
            assert str(sid) in str(exc.value) and "open_wait_timeout" in str(exc.value)
            assert any("open_wait_timeout" in r.getMessage() for r in caplog.records)
            assert d.registry.counters["opens_timed_out"] == 1
            gate.set()  # the object store takes uploads again: the same open now loads it
            h = await asyncio.wait_for(c.open(sid, v1.version, v1.ckptid), DEADLINE)
            assert await h.get_many([key(1)]) == [b"one"]
            await h.abort()
    finally:
        gate.set()
