"""Issue 40, edge 6: the upload queue is bounded in count as well as in bytes
(``upload_queue_count``), with back-pressure on COMMIT, and an evicted store's OPEN does not wait
behind other stores' queued uploads (its own go first). Real daemons in-process (both loops) over
local object stores with faults injected: uploads held, or refused for one operator's files."""
from __future__ import annotations

import asyncio

from statestore_async.client.clients import AsyncClient
from statestore_async.errors import ObjectStoreUnavailableError
from statestore_async.ids import StoreId, new_checkpoint_id
from statestore_async.objectstore import LocalObjectStore
from statestore_async.testing.daemon import wait_until

DEADLINE = 60.0



def key(i: int) -> bytes:
    return b"\x00\x07" + b"key-%06d" % i


class HeldStore(LocalObjectStore):
    """Uploads wait for ``gate``; while ``refuse`` names an operator, its uploads fail (a retried
    error, as from an unreachable S3) instead."""

    gate: asyncio.Event
    refuse: str | None = None

    def __init__(self, uri: str):
        super().__init__(uri.removeprefix("file://"), fsync=False)

    async def put_if_absent(self, k, data):
        if self.refuse is not None and k.startswith(self.refuse + "/"):
            raise ObjectStoreUnavailableError(f"injected: {k} not taken", k)
        await self.gate.wait()
        return await super().put_if_absent(k, data)


async def test_the_upload_queue_is_bounded_in_count_and_a_commit_past_it_waits(daemon_factory, tmp_path):
    """Tiny deltas: the byte bound is far away, the count bound (5) holds the sixth COMMIT until an
    upload finishes. Before, every commit was answered at once, however many were queued."""
    HeldStore.gate, HeldStore.refuse = asyncio.Event(), None
    gate = HeldStore.gate
    d = await daemon_factory(open_objstore=HeldStore, upload_queue_count=5)
    sid = StoreId(f"file://{tmp_path}/root", "fast", 0)
    try:
        async with AsyncClient(d.config.socket) as c:
            ref = None
            for i in range(5):
                h = await c.open(sid, ref.version if ref else 0, ref.ckptid if ref else None)
                await h.put_many([(key(i), b"v")])
                ref = await h.commit()
            assert d.uploader.queued_count == 5 and d.uploader.stats()["queue_count_limit"] == 5
            h = await c.open(sid, ref.version, ref.ckptid)
            await h.put_many([(key(5), b"v")])
            sixth = asyncio.create_task(h.commit())
            await wait_until(lambda: d.uploader.stats()["waiting_admission"] == 1, "the sixth commit to wait")
            assert not sixth.done() and d.counters["commits_waited"] == 1
            assert d.uploader.queued_bytes < 5000  # the byte bound (256 MiB) is not what holds it
            gate.set()
            v6 = await asyncio.wait_for(sixth, DEADLINE)
            assert v6.version == 6
            assert await c.await_durable(sid, v6, DEADLINE)
            assert d.uploader.queued_count == 0
    finally:
        gate.set()


async def test_an_evicted_stores_open_does_not_wait_behind_other_stores_queues(daemon_factory, tmp_path):
    """Eight stores of operator 'busy' fill the queue (count bound 4) with uploads that keep
    failing and being retried; store 'b' commits behind them and is evicted. Its OPEN admits and
    uploads its own delta first, then loads it, while the busy uploads are still queued. Before,
    the delta waited in line for admission behind the busy ones, and the OPEN for ever."""
    HeldStore.gate, HeldStore.refuse = asyncio.Event(), "busy"
    HeldStore.gate.set()
    d = await daemon_factory(open_objstore=HeldStore, upload_queue_count=4, upload_concurrency=2,
                             open_wait_timeout=DEADLINE)
    root = f"file://{tmp_path}/root"
    busy = [StoreId(root, "busy", p) for p in range(8)]
    b = StoreId(root, "b", 0)
    async with AsyncClient(d.config.socket) as c, AsyncClient(d.config.socket) as c2:
        waiting = []
        for sid in busy:
            h = await c.open(sid, 0)
            await h.put_many([(key(1), b"busy")])
            waiting.append(asyncio.create_task(h.commit()))
        await wait_until(lambda: d.uploader.stats()["waiting_admission"] == 4, "four busy commits to wait for room")
        h = await c.open(b, 0)
        await h.put_many([(key(1), b"mine")])
        ckptid = new_checkpoint_id()
        mine = asyncio.create_task(h.commit(ckptid))
        await wait_until(lambda: d.uploader.stats()["waiting_admission"] == 5, "b's commit to wait behind them")
        assert d.registry is not None
        d.registry.memory_budget = 1
        d.registry.enforce_budget()
        assert d.registry.get(b) is None  # evicted, its delta still queued
        h2 = await asyncio.wait_for(c2.open(b, 1, ckptid), DEADLINE)
        assert await h2.get_many([key(1)]) == [b"mine"]
        await h2.abort()
        assert (await mine).ckptid == ckptid  # its COMMIT was answered once its delta was admitted
        # the busy stores' uploads are still queued: b did not wait for them
        assert sum(d.uploader.pending(s) for s in busy) == 8
        assert d.uploader.stats()["waiting_admission"] == 4
        HeldStore.refuse = None
        await asyncio.wait_for(asyncio.gather(*waiting), DEADLINE)
        await wait_until(lambda: d.uploader.idle, "the busy uploads to finish")
