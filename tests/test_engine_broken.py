"""A change that fails part-way in the engine's map (the arena or the index cannot grow): the store
is marked broken and refuses everything with ``StoreBrokenError`` (never serves a half-applied
map), and the daemon drops it and loads it again from its files on the next open."""
from __future__ import annotations

import pytest

from statestore_async import errors
from statestore_async.client.clients import AsyncClient
from statestore_async.engine.delta import table_of
from statestore_async.engine.store import State, VersionedStore
from statestore_async.ids import StoreId

SID = StoreId("file:///tmp/unused", "op", 0)


def key(i: int) -> bytes:
    return b"\x00\x07" + b"key-%06d" % i


def fail_half_way(store: VersionedStore) -> list[int]:
    """Make the store's next map change apply half of its records, then fail as a full arena does."""
    real = store._mutate
    calls: list[int] = []

    def mutate(changes):
        items = list(changes.items())
        calls.append(len(items))
        real(table_of(items[: len(items) // 2]))
        raise MemoryError("the arena could not grow")

    store._mutate = mutate  # type: ignore[method-assign]
    return calls


def committed(store: VersionedStore, version: int, value: bytes, n: int = 10, **kw):
    w = store.open(version)
    w.put_many([(key(i), value) for i in range(n)])
    return w.commit(**kw)


def assert_refuses_everything(store: VersionedStore, what: str) -> None:
    assert store.broken is not None and what in store.broken and store.writer is None
    for call in (lambda: store.get(key(0)), lambda: list(store.items()), store.freeze, lambda: len(store),
                 lambda: store.open(store.head.version)):
        with pytest.raises(errors.StoreBrokenError, match=f"broken in memory: {what}.*MemoryError"):
            call()
    assert store.memory_bytes > 0 and store.hot_records >= 0  # the accounting still answers


def test_a_commit_that_fails_part_way_breaks_the_store_and_frees_its_writer():
    store = VersionedStore(SID)
    committed(store, 0, b"1")
    calls = fail_half_way(store)
    w = store.open(1)
    w.put_many([(key(i), b"2") for i in range(10)])
    with pytest.raises(errors.StoreBrokenError, match="applying the commit of") as exc:
        w.commit()
    assert isinstance(exc.value.__cause__, MemoryError) and calls == [10]
    assert w.state is State.ABORTED
    assert_refuses_everything(store, "applying the commit of")


def test_a_deferred_commit_that_fails_when_applied_breaks_the_store_and_its_delta():
    store = VersionedStore(SID)
    committed(store, 0, b"1")
    delta = committed(store, 1, b"2", defer=True)  # committed: the changes reach the map later
    fail_half_way(store)
    with pytest.raises(errors.StoreBrokenError, match="applying the deferred commit of"):
        store.get(key(0))
    with pytest.raises(errors.StoreBrokenError):
        delta.table  # noqa: B018 - the delta's records cannot be encoded: it never becomes durable
    assert_refuses_everything(store, "applying the deferred commit of")


def test_a_switch_to_another_version_that_fails_part_way_breaks_the_store():
    store = VersionedStore(SID)
    committed(store, 0, b"1")
    committed(store, 1, b"2")
    fail_half_way(store)
    with pytest.raises(errors.StoreBrokenError, match="undoing the commit of"):
        store.open(1, store._history[0].child.ckptid)  # a retry of version 2: undo it in memory
    assert_refuses_everything(store, "undoing the commit of")


def test_a_store_that_is_not_broken_says_so():
    store = VersionedStore(SID)
    committed(store, 0, b"1")
    assert store.broken is None and store.get(key(0)) == b"1"


async def test_the_daemon_drops_a_broken_store_and_reloads_it_from_its_files(daemon_factory, tmp_path):
    root = f"file://{tmp_path}/root"
    d = await daemon_factory()
    sid = StoreId(root, "broken", 0)
    async with AsyncClient(d.config.socket) as c:
        h = await c.open(sid, 0)
        await h.put_many([(key(i), b"1") for i in range(100)])
        r1 = await h.commit()
        assert await c.await_durable(sid, r1, 30)
        fail_half_way(d.registry.get(sid))
        h = await c.open(sid, 1, r1.ckptid)
        await h.put_many([(key(i), b"2") for i in range(100)])
        try:
            r2 = await h.commit()  # answered before its changes reach the map (a deferred commit) ...
        except errors.StoreBrokenError:
            r2 = None  # ... or refused, had the daemon applied them at once
        if r2 is not None:  # its delta's records cannot be encoded: never durable, and said so
            with pytest.raises(errors.StateStoreError, match="broken in memory"):
                await c.await_durable(sid, r2, 30)
        # the next open drops the broken store and loads the durable version 1 from its files
        h = await c.open(sid, 1, r1.ckptid)
        assert await h.get_many([key(i) for i in range(100)]) == [b"1"] * 100
        await h.put_many([(key(0), b"3")])
        r3 = await h.commit()
        assert await c.await_durable(sid, r3, 30)
        assert d.registry.counters["broken_dropped"] == 1 and d.registry.counters["loads"] >= 1
        assert not d.registry.get(sid).broken
        stats = await c.stats()
        assert stats["registry"]["broken_dropped"] == 1
