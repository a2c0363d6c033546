"""statestore-async inspect / verify / gc on a checkpoint root written by the library."""
import asyncio
import json

import pytest
from click.testing import CliRunner

from statestore_async.cli.main import main
from statestore_async.codecs.keylayout import store_key
from statestore_async.engine.store import VersionedStore
from statestore_async.files.manifest import Manifest, list_manifest_versions, write_manifest
from statestore_async.files.names import DELTA, file_key
from statestore_async.files.transfer import write_delta, write_snapshot
from statestore_async.ids import StoreId
from statestore_async.objectstore import LocalObjectStore


def build(root_dir, batches=12, partitions=2, snapshot_every=4):
    """An operator 'agg' with ``partitions`` stores and one manifest per batch; returns the manifests."""

    async def go():
        async with LocalObjectStore(root_dir) as objstore:
            stores = [VersionedStore(StoreId(objstore.uri, "agg", p)) for p in range(partitions)]
            manifests = []
            for b in range(batches):
                refs = []
                for p, s in enumerate(stores):
                    w = s.open(b)
                    w.put_many([(store_key(i % 64, b"k%d" % i), b"%d:%d" % (b, i)) for i in range(b * 5, b * 5 + 30)])
                    d = w.commit()
                    await write_delta(objstore, d)
                    if d.version % snapshot_every == 0:
                        with s.freeze() as view:
                            await write_snapshot(objstore, view)
                        s.mark_snapshot(d.ref)
                    refs.append(d.ref)
                m = Manifest("agg", b + 1, partitions, 64, {"default": tuple(refs)})
                await write_manifest(objstore, m)
                manifests.append(m)
            return objstore.uri, manifests

    return asyncio.run(go())


@pytest.fixture
def checkpoint(tmp_path):
    uri, manifests = build(tmp_path / "ckpt")
    return tmp_path / "ckpt", uri, manifests


def run(*args):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_inspect_shows_and_checks_one_file(checkpoint):
    path, uri, manifests = checkpoint
    ref = manifests[5].ref(1)
    key = file_key(StoreId(uri, "agg", 1), ref, DELTA)
    r = run("inspect", uri, key)
    assert r.exit_code == 0, r.output
    assert "delta of" in r.output and f"version {ref.version}" in r.output and "checksums OK" in r.output
    data = bytearray((path / key).read_bytes())
    data[-40] ^= 1
    (path / key).write_bytes(bytes(data))
    r = run("inspect", uri, key)
    assert r.exit_code == 1 and "CorruptFileError" in r.output


def test_verify_loads_every_partition_and_fails_on_damage(checkpoint):
    path, uri, manifests = checkpoint
    r = run("verify", uri, "--operator", "agg")
    assert r.exit_code == 0, r.output
    assert "version 12: 2 partitions OK, 0 failed" in r.output
    # truncate the delta of partition 0 at version 11 (its load: snapshot 8 + deltas 9, 10, 11)
    ref = manifests[10].ref(0)
    key = file_key(StoreId(uri, "agg", 0), ref, DELTA)
    (path / key).write_bytes((path / key).read_bytes()[:-10])
    r = run("verify", uri, "--operator", "agg", "--version", "11")
    assert r.exit_code == 1
    assert "1 partitions OK, 1 failed" in r.output and "CorruptFileError" in r.output


def test_gc_keeps_the_last_versions_loadable_and_deletes_the_rest(checkpoint):
    path, uri, manifests = checkpoint
    before = sorted(p.name for p in path.rglob("*") if p.is_file())
    r = run("gc", uri, "--operator", "agg", "--keep", "3", "--dry-run")
    assert r.exit_code == 0 and "would delete" in r.output
    assert sorted(p.name for p in path.rglob("*") if p.is_file()) == before
    r = run("gc", uri, "--operator", "agg", "--keep", "3")
    assert r.exit_code == 0, r.output
    after = sorted(p.name for p in path.rglob("*") if p.is_file())
    assert len(after) < len(before)
    assert asyncio.run(_versions(path)) == [10, 11, 12]
    for v in (10, 11, 12):
        r = run("verify", uri, "--operator", "agg", "--version", str(v))
        assert r.exit_code == 0, r.output
    r = run("gc", uri, "--operator", "agg", "--keep", "1")
    assert r.exit_code == 1 and "at least the last 2" in r.output


async def _versions(path):
    async with LocalObjectStore(path) as s:
        return await list_manifest_versions(s, "agg")


def add_attempt(root_dir, uri, ref, partition=0):
    """Write one more attempt on top of state ``ref`` of partition ``partition`` (a delta no
    manifest names); returns its key."""
    from statestore_async.files.loader import load_store

    async def go():
        async with LocalObjectStore(root_dir) as objstore:
            sid = StoreId(objstore.uri, "agg", partition)
            store, _ = await load_store(objstore, sid, ref)
            w = store.open(ref.version, ref.ckptid)
            w.put_many([(store_key(1, b"lost"), b"attempt")])
            d = w.commit()
            await write_delta(objstore, d)
            return file_key(sid, d.ref, DELTA)

    return asyncio.run(go())


def test_inspect_accepts_manifests_and_tells_orphaned_files(checkpoint):
    path, uri, manifests = checkpoint
    r = run("inspect", uri, "agg/_commits/5.json")
    assert r.exit_code == 0, r.output
    assert "manifest of agg version 5, 2 partitions, 64 key groups" in r.output and "checksum OK" in r.output
    assert f"default/1: {manifests[4].ref(1)}" in r.output
    r = run("inspect", uri, "agg/_commits/5.json", "--json")
    doc = json.loads(r.output)
    assert doc["kind"] == "manifest" and doc["stores"]["default"] == [str(x) for x in manifests[4].stores["default"]]
    orphan = add_attempt(path, uri, manifests[9].ref(0))        # a losing attempt at version 11
    pending = add_attempt(path, uri, manifests[11].ref(0))      # a batch 13 whose manifest never came (yet)
    assert "status: orphaned" in run("inspect", uri, orphan).output
    assert "status: pending" in run("inspect", uri, pending).output
    named = file_key(StoreId(uri, "agg", 0), manifests[11].ref(0), DELTA)
    assert "status: named" in run("inspect", uri, named).output
    older = file_key(StoreId(uri, "agg", 1), manifests[2].ref(1), DELTA)
    assert json.loads(run("inspect", uri, older, "--json").output)["status"] == "named"
    m5 = path / "agg/_commits/5.json"
    m5.write_bytes(m5.read_bytes().replace(b'"version":5', b'"version":6'))
    r = run("inspect", uri, "agg/_commits/5.json")
    assert r.exit_code == 1 and "CorruptFileError" in r.output and "checksum" in r.output
    r = run("inspect", uri, "agg/_commits/x.json")
    assert r.exit_code == 1 and "not a manifest name" in r.output


def test_gc_removes_orphaned_attempts_by_default(checkpoint):
    path, uri, manifests = checkpoint
    orphan = add_attempt(path, uri, manifests[9].ref(0))
    pending = add_attempt(path, uri, manifests[11].ref(0))
    r = run("gc", uri, "--operator", "agg", "--keep-orphans")
    assert r.exit_code == 0, r.output
    assert (path / orphan).exists() and (path / pending).exists() and "deleted 0 files" in r.output
    r = run("gc", uri, "--operator", "agg", "--dry-run", "--json")
    doc = json.loads(r.output)
    assert doc["orphaned_files"] == [orphan] and doc["deleted_manifests"] == [] and doc["dry_run"]
    assert (path / orphan).exists()
    r = run("gc", uri, "--operator", "agg")  # the defaults: 100 versions kept, orphans removed
    assert r.exit_code == 0, r.output
    assert f"deleted {orphan} (orphaned attempt)" in r.output and "1 orphaned attempts" in r.output
    assert not (path / orphan).exists() and (path / pending).exists()  # a batch may still be writing the pending one
    for v in range(1, 13):
        assert run("verify", uri, "--operator", "agg", "--version", str(v)).exit_code == 0


def test_ls_lists_operators_versions_partitions_and_orphans(checkpoint):
    path, uri, manifests = checkpoint
    orphan = add_attempt(path, uri, manifests[9].ref(0))
    before = sorted(p for p in path.rglob("*"))
    r = run("ls", uri)
    assert r.exit_code == 0, r.output
    assert "agg: versions 1..12 (12), 2 partitions, 64 key groups" in r.output
    assert f"partition 0 (key groups 0..31): {manifests[11].ref(0)}" in r.output
    assert f"orphaned {orphan}" in r.output
    doc = json.loads(run("ls", uri, "--operator", "agg", "--version", "6", "--json").output)
    (op,) = doc
    assert op["version"] == 6 and op["versions"] == list(range(1, 13))
    assert [p["ref"] for p in op["partitions"]] == [str(x) for x in manifests[5].stores["default"]]
    assert [p["records"] for p in op["partitions"]] == [55, 55]  # keys k0..k54 after 6 batches
    assert op["partitions"][0]["orphaned"] == [orphan] and op["partitions"][1]["orphaned"] == []
    assert all(0 < p["state_bytes"] <= p["bytes"] for p in op["partitions"])
    assert sorted(p for p in path.rglob("*")) == before  # read-only
    r = run("ls", uri, "--operator", "nope")
    assert r.exit_code == 1 and "no manifest" in r.output
