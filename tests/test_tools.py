"""statestore-async inspect / verify / gc on a checkpoint root written by the library."""
import asyncio

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
