"""Rescaling at the file level: a new partition's first state assembled from key-group ranges of the
old partitions' states (``files.rescale``), read by ranges, written as its own snapshot."""
import random

import pytest

from statestore_async.codecs.keylayout import key_group_of, partition_key_groups, store_key
from statestore_async.engine.store import VersionedStore
from statestore_async.errors import CorruptFileError, LineageError
from statestore_async.files.loader import load_store
from statestore_async.files.names import DELTA, RESCALE, SNAPSHOT, file_key
from statestore_async.files.rescale import Recipe, plan_sources, read_recipe, write_recipe
from statestore_async.files.transfer import write_delta, write_snapshot
from statestore_async.ids import EMPTY_STATE, CheckpointRef, StoreId, new_checkpoint_id
from statestore_async.objectstore import LocalObjectStore

G = 64


def sid(root, partition):
    return StoreId(root, "agg", partition)


async def build_old_layout(objstore, n, keys_per_partition, *, batches=4, snapshot_at=2, seed=7):
    """Partitions 0..n-1 of a layout with n partitions, each a lineage of ``batches`` commits (a
    snapshot after commit ``snapshot_at``, deltas after it, removals too), written as files.
    Returns (head refs, expected state of every partition, the bytes of the files their loads read)."""
    rnd = random.Random(seed)
    refs, states, stored = [], {}, 0
    for p in range(n):
        kgs = partition_key_groups(p, n, G)
        store = VersionedStore(sid(objstore.uri, p))
        for v in range(batches):
            w = store.open(v)
            for _ in range(keys_per_partition // batches):
                k = store_key(rnd.choice(kgs), b"user-%08d" % rnd.randrange(keys_per_partition * 2))
                w.put(k, b"value-%d-%d" % (v, rnd.randrange(10**9)))
            for k, _ in list(store.items())[::17]:
                w.remove(k)
            d = w.commit()
            await write_delta(objstore, d)
            if v + 1 == snapshot_at:
                with store.freeze() as view:
                    await write_snapshot(objstore, view)
                store.mark_snapshot(d.ref)
        states.update(dict(store.items()))
        refs.append(store.head)
        for r in [store.head, *store.lineage]:
            kind = SNAPSHOT if store.has_snapshot(r) and r.version == snapshot_at else DELTA
            stored += (await objstore.head(file_key(sid(objstore.uri, p), r, kind))).size
            if kind == SNAPSHOT:
                break
    return refs, states, stored


async def rescale(objstore, old_refs, new_n, version):
    """Recipes for every new partition, then each one loaded: {partition: (store, report)}."""
    out = {}
    for p, sources in enumerate(plan_sources(old_refs, new_n, G)):
        ref = CheckpointRef(version, new_checkpoint_id())
        recipe = Recipe(p, new_n, G, len(old_refs), version, sources)
        await write_recipe(objstore, sid(objstore.uri, p), ref, recipe)
        out[p] = await load_store(objstore, sid(objstore.uri, p), ref)
    return out


def test_every_key_group_comes_from_exactly_one_source():
    for old_n in (1, 2, 3, 4, 7):
        for new_n in (1, 2, 4, 5, 7, 64):
            plans = plan_sources([CheckpointRef(3, "a" * 32)] * old_n, new_n, G)
            seen = []
            for p, sources in enumerate(plans):
                for s in sources:
                    span = range(s.first_kg, s.last_kg + 1)
                    assert all(kg * old_n // G == s.partition and kg * new_n // G == p for kg in span)
                    seen.extend(span)
            assert sorted(seen) == list(range(G))


def test_empty_old_partitions_give_nothing():
    plans = plan_sources([EMPTY_STATE, CheckpointRef(2, "b" * 32)], 1, G)
    assert [s.partition for s in plans[0]] == [1]


@pytest.fixture
async def objstore(tmp_path):
    s = LocalObjectStore(tmp_path / "ckpt")
    yield s
    await s.close()


@pytest.mark.parametrize("new_n", [1, 2, 3, 7])
async def test_a_rescaled_partition_holds_exactly_its_key_groups_and_loads_from_its_own_snapshot(objstore, new_n):
    old_refs, state, _ = await build_old_layout(objstore, 4, 2000)
    loaded = await rescale(objstore, old_refs, new_n, version=4)
    for p, (store, report) in loaded.items():
        mine = partition_key_groups(p, new_n, G)
        assert dict(store.items()) == {k: v for k, v in state.items() if key_group_of(k) in mine}
        assert report.rescaled_from and report.snapshot_written > 0
        # the state is durable by itself: a fresh load reads its snapshot, not the recipe's sources
        again, second = await load_store(objstore, store.store_id, store.head)
        assert dict(again.items()) == dict(store.items())
        assert second.files_read == [file_key(store.store_id, store.head, SNAPSHOT)]
        assert second.rescaled_from is None


async def test_a_rescale_reads_each_old_file_about_once_not_once_per_new_partition(objstore):
    """Bytes read by all new partitions together vs the old layout's stored bytes: the ranged reads
    take each block once, plus at most one shared block at each range edge, headers and footers."""
    old_refs, _, stored = await build_old_layout(objstore, 4, 60000)
    for new_n in (2, 7, 1):
        loaded = await rescale(objstore, old_refs, new_n, version=4)
        read = sum(report.bytes_read for _, report in loaded.values())
        print(f"4 -> {new_n}: read {read} bytes of {stored} stored ({read / stored:.3f}x)")
        assert read <= 1.2 * stored


async def test_a_missing_source_file_and_a_damaged_recipe_are_typed_errors(objstore):
    old_refs, _, _ = await build_old_layout(objstore, 2, 400)
    ref = CheckpointRef(4, new_checkpoint_id())
    recipe = Recipe(0, 1, G, 2, 4, plan_sources(old_refs, 1, G)[0])
    await write_recipe(objstore, sid(objstore.uri, 0), ref, recipe)
    assert await read_recipe(objstore, sid(objstore.uri, 0), ref) == recipe
    await write_recipe(objstore, sid(objstore.uri, 0), ref, recipe)  # the same recipe again: fine
    # a delta of old partition 1's lineage is gone: the assembly names it
    await objstore.delete(file_key(sid(objstore.uri, 1), old_refs[1], DELTA))
    with pytest.raises((LineageError, Exception)) as info:
        await load_store(objstore, sid(objstore.uri, 0), ref)
    assert "1" in str(info.value) and old_refs[1].ckptid in str(info.value)
    # a damaged recipe
    bad = CheckpointRef(4, new_checkpoint_id())
    await objstore.put(file_key(sid(objstore.uri, 0), bad, RESCALE), recipe.to_bytes().replace(b'"from_version":4',
                                                                                                b'"from_version":5'))
    with pytest.raises(CorruptFileError, match="checksum"):
        await load_store(objstore, sid(objstore.uri, 0), bad)


async def test_offline_plan_refuses_a_manifest_of_another_format_and_counts_out_of_range(objstore):
    import json

    import xxhash

    from statestore_async.files.manifest import Manifest, manifest_key, write_manifest
    from statestore_async.files.repartition import RepartitionConfigError, plan_repartition, repartition

    old_refs, state, stored = await build_old_layout(objstore, 4, 30000)
    m = Manifest("agg", 4, 4, G, {"default": tuple(old_refs)}, metadata={"key_columns": ["k"]})
    await write_manifest(objstore, m)
    plan = await plan_repartition(objstore, objstore.uri, "agg", 3)
    assert [p.partition for p in plan.partitions] == [0, 1, 2] and not plan.already
    assert 0.9 * stored <= sum(p.bytes_to_read for p in plan.partitions) <= 1.1 * stored
    for bad in (0, G + 1):
        with pytest.raises(RepartitionConfigError, match=f"1 to {G}"):
            await plan_repartition(objstore, objstore.uri, "agg", bad)
    report = await repartition(objstore, objstore.uri, "agg", 3)
    assert report.bytes_read <= 1.2 * stored and report.bytes_written > 0
    again = await repartition(objstore, objstore.uri, "agg", 3)  # at that count already: nothing to do
    assert again.plan.already and again.bytes_read == 0
    loaded = {}
    new = await read_manifest_of(objstore)
    for p in range(3):
        store, _ = await load_store(objstore, sid(objstore.uri, p), new.ref(p))
        loaded.update(dict(store.items()))
    assert loaded == state
    # a manifest written by a format this build does not know is refused, naming the file
    body = {**json.loads(m.to_bytes())["manifest"], "format": 2}
    canon = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    await objstore.put(manifest_key("agg", 4), json.dumps(
        {"manifest": body, "xxh3": f"{xxhash.xxh3_64_intdigest(canon):016x}"}).encode())
    with pytest.raises(CorruptFileError, match="format 2"):
        await plan_repartition(objstore, objstore.uri, "agg", 2)


async def read_manifest_of(objstore, operator_id="agg"):
    from statestore_async.files.manifest import list_manifest_versions, read_manifest

    return await read_manifest(objstore, operator_id, max(await list_manifest_versions(objstore, operator_id)))
