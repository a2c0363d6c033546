"""Rescaling a stateful query online: the same query restarted with another number of partitions.

The stream is written in phases; each phase runs the query (same Spark checkpoint, same operator id)
with another ``num_partitions``: 4, then 2, 7, 1. Each phase's first batch rescales (``files.rescale``):
every new partition's state is assembled by the daemon from the key-group ranges it owns in the old
partitions' files. Every batch's output and the final state must equal Spark's own streaming
aggregation over the whole stream, also when the daemon or the driver is killed (-9) in the first
rescaled batch; the bytes read to rescale are counted by the daemon and, on S3, by the proxy in
front of SeaweedFS, and must stay within 1.2x the old layout's stored size.
"""
from __future__ import annotations

import asyncio
import signal

import pytest
from spark_cluster import (
    Daemon,
    collector,
    dict_oracle,
    final_count_sum,
    read_outputs,
    run_job,
    run_stream,
    spark_oracle,
    write_batches,
)

from statestore_async.client import Client
from statestore_async.files.loader import load_store
from statestore_async.files.manifest import list_manifest_versions, read_manifest
from statestore_async.files.rescale import RESCALED_FROM_KEY
from statestore_async.ids import StoreId
from statestore_async.objectstore import open_object_store
from statestore_async.spark import OperatorConfigError, StatefulOperator, load_state
from statestore_async.spark.api.examples import CountSum, VectorizedCountSum
from statestore_async.testing import faults

pytestmark = [pytest.mark.spark, pytest.mark.slow]
OUT = "key string, count bigint, sum bigint"
G = 64
PHASES = (4, 2, 7, 1)  # num_partitions of each run of the query
BATCHES_PER_PHASE = 2
ROWS, KEYS = 40000, 150000  # the tests that bound the bytes read: files of ~64 blocks (headers and footers
SMALL = 10000, 30000       # are a few % of them); the others run on a smaller stream



def write_phase(src: str, phase: int, size: tuple[int, int] = SMALL) -> list[list[tuple]]:
    rows, keys = size
    return write_batches(src, BATCHES_PER_PHASE, rows, keys, seed=11, first=phase * BATCHES_PER_PHASE)


def manifest(root: str, version: int | None = None, s3_options=None, operator_id: str = "counts"):
    async def go():
        async with open_object_store(root, **({"s3_options": s3_options} if s3_options else {})) as s:
            v = version if version is not None else max(await list_manifest_versions(s, operator_id))
            return await read_manifest(s, operator_id, v)
    return asyncio.run(go())


def stored_bytes(root: str, m, s3_options=None) -> int:
    """The bytes of the files a load of manifest ``m``'s state reads: the state's stored size."""
    async def go():
        async with open_object_store(root, **({"s3_options": s3_options} if s3_options else {})) as s:
            total = 0
            for p in range(m.num_partitions):
                _, report = await load_store(s, StoreId(root, "counts", p), m.ref(p))
                total += report.bytes_read
            return total
    return asyncio.run(go())


def daemon_counters(socket: str) -> dict:
    with Client(socket) as c:
        return c.stats()["registry"]


def held_partitions(socket: str, root: str) -> list[int]:
    with Client(socket) as c:
        return c.release(root, "counts", [])["held"]


def check_rescale(root, socket, before, counters_before, new_n, s3_options=None) -> float:
    """After a phase that rescaled to ``new_n``: the manifest says where its state came from, the
    daemon assembled every new partition once, reading <= 1.2x the old layout's stored size, and
    holds no copy of an old partition id beyond the new layout. Returns the ratio read / stored."""
    after = manifest(root, s3_options=s3_options)
    first = manifest(root, before.version + 1, s3_options=s3_options)
    assert after.num_partitions == new_n and first.metadata[RESCALED_FROM_KEY]["num_partitions"] == before.num_partitions
    assert first.metadata[RESCALED_FROM_KEY]["version"] == before.version
    counters = daemon_counters(socket)
    rescales = counters["rescales"] - counters_before["rescales"]
    read = counters["rescale_bytes_read"] - counters_before["rescale_bytes_read"]
    stored = stored_bytes(root, before, s3_options)
    print(f"rescale {before.num_partitions} -> {new_n}: {rescales} partitions assembled, {read} bytes read "
          f"for {stored} stored ({read / stored:.3f}x)")
    assert rescales == new_n  # every new partition once (this stream's key groups all hold keys)
    assert read <= 1.2 * stored
    assert all(p < new_n for p in held_partitions(socket, root))
    return read / stored


def test_rescale_4_2_7_1_equals_spark(spark, tmp_path):
    src, root, ckpt = str(tmp_path / "src"), f"file://{tmp_path}/state", str(tmp_path / "ckpt")
    batches: list = []
    got: dict = {}
    with Daemon() as d:
        for phase, n in enumerate(PHASES):
            batches += write_phase(src, phase, (ROWS, KEYS))
            before = manifest(root) if phase else None
            counters = daemon_counters(d.socket)

            op = StatefulOperator(root, "counts", ["key"], CountSum(), OUT, n, G, socket_path=d.socket,
                                  fence_timeout=30)
            run_stream(spark, src, ckpt, op.foreach_batch(collector(got)))
            if before is not None:
                check_rescale(root, d.socket, before, counters, n)
    expected = spark_oracle(spark, src, str(tmp_path / "oracle"))
    assert got == expected
    assert final_count_sum(load_state(root, "counts")) == dict_oracle(batches)[1]
    # what cannot be done is refused before anything is written
    with pytest.raises(OperatorConfigError, match="key groups"):
        StatefulOperator(root, "counts", ["key"], CountSum(), OUT, 2, 2 * G).base_manifest(len(batches))
    with pytest.raises(OperatorConfigError, match="key groups"):
        StatefulOperator(root, "counts", ["key"], CountSum(), OUT, G + 1, G)


def test_vectorized_rescale_on_s3_reads_the_state_about_once(spark, tmp_path, seaweedfs, s3_bucket, proxy):
    """The S3 variant: the daemon reaches SeaweedFS through the proxy, whose log counts the GET
    bytes of the rescaled batches (the object store's own count, beside the daemon's)."""
    src, ckpt, root = str(tmp_path / "src"), str(tmp_path / "ckpt"), f"s3://{s3_bucket}/ckpt"
    opts = seaweedfs.client_options()
    env = dict(seaweedfs.env(), STATESTORE_S3_ENDPOINT_URL=proxy.endpoint_url, STATESTORE_SNAPSHOT_INTERVAL="1000")
    batches: list = []
    got: dict = {}
    with Daemon(env=env) as d:
        for phase, n in enumerate((4, 7)):
            batches += write_phase(src, phase, (ROWS, KEYS))
            before = manifest(root, s3_options=opts) if phase else None
            counters = daemon_counters(d.socket)
            get_bytes = proxy.stats["GET_bytes"]
            op = StatefulOperator(root, "counts", ["key"], VectorizedCountSum(), OUT, n, G, socket_path=d.socket,
                                  s3_options=opts, fence_timeout=30)
            run_stream(spark, src, ckpt, op.foreach_batch(collector(got)))
            if before is not None:
                ratio = check_rescale(root, d.socket, before, counters, n, s3_options=opts)
                # the proxy saw the daemon's GETs of the phase: the rescale's, and no other load
                # (no snapshots, so no cleanup either; every partition stays in memory afterwards)
                seen = proxy.stats["GET_bytes"] - get_bytes
                stored = stored_bytes(root, before, opts)
                print(f"  proxy: {seen} GET bytes ({seen / stored:.3f}x stored; the daemon counted {ratio:.3f}x)")
                assert seen <= 1.2 * stored
    per_batch, final = dict_oracle(batches)
    assert [got[b] for b in sorted(got)] == per_batch
    assert final_count_sum(load_state(root, "counts", s3_options=opts)) == final


@pytest.mark.parametrize("point", ["before_commit", "after_commit"])
def test_daemon_killed_in_the_first_rescaled_batch(spark, tmp_path, point):
    src, root, ckpt = str(tmp_path / "src"), f"file://{tmp_path}/state", str(tmp_path / "ckpt")
    got: dict = {}
    batches = write_phase(src, 0)
    with Daemon() as d:
        op = StatefulOperator(root, "counts", ["key"], CountSum(), OUT, 4, G, socket_path=d.socket)
        run_stream(spark, src, ckpt, op.foreach_batch(collector(got)))
        batches += write_phase(src, 1)
        first = BATCHES_PER_PHASE  # the first batch of the run at N = 2
        fault = {"point": point, "batch": first, "action": "kill_daemon", "partition": 1}
        op2 = StatefulOperator(root, "counts", ["key"], CountSum(), OUT, 2, G, socket_path=d.socket,
                               fence_timeout=3)
        faults.arm(op2, [fault])
        try:
            run_stream(spark, src, ckpt, op2.foreach_batch(collector(got)))
        except Exception:  # the batch of the kill fails, unless the uploads won the race
            pass
        op3 = StatefulOperator(root, "counts", ["key"], CountSum(), OUT, 2, G, socket_path=d.socket,
                               fence_timeout=30)
        run_stream(spark, src, ckpt, op3.foreach_batch(collector(got)))
    per_batch, final = dict_oracle(batches)
    assert [got[b] for b in sorted(got)] == per_batch
    assert final_count_sum(load_state(root, "counts")) == final
    assert manifest(root).num_partitions == 2


def test_driver_killed_in_the_first_rescaled_batch_then_restarted_at_another_count(tmp_path):
    """The driver dies before the fence of the first batch at N = 2; the query is restarted at N = 7:
    the replay rescales again, from the manifest the killed batch started from, and at the count
    the new run asks for."""
    src, root = str(tmp_path / "src"), f"file://{tmp_path}/state"

    def args(socket, n, fault=None):
        a = ["--src", src, "--root", root, "--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"),
             "--socket", socket, "--partitions", str(n), "--key-groups", str(G)]
        return a + (["--faults", f'[{{"point": "{fault}", "batch": {BATCHES_PER_PHASE}, "action": "kill_self"}}]']
                    if fault else [])

    batches = write_phase(src, 0)
    with Daemon() as d:
        r1 = run_job(args(d.socket, 4))
        assert r1.returncode == 0, r1.stdout[-4000:]
        batches += write_phase(src, 1)
        r2 = run_job(args(d.socket, 2, "before_fence"))
        assert r2.returncode == -signal.SIGKILL, r2.stdout[-4000:]
        assert manifest(root).num_partitions == 4  # nothing of the killed batch counts
        r3 = run_job(args(d.socket, 7, "after_manifest"))  # dies again, after its manifest
        assert r3.returncode == -signal.SIGKILL, r3.stdout[-4000:]
        assert manifest(root, BATCHES_PER_PHASE + 1).num_partitions == 7
        r4 = run_job(args(d.socket, 7))
        assert r4.returncode == 0, r4.stdout[-4000:]
    got = read_outputs(str(tmp_path / "out"))
    per_batch, final = dict_oracle(batches)
    assert [got[b] for b in sorted(got)] == per_batch
    assert final_count_sum(load_state(root, "counts")) == final
    assert manifest(root).num_partitions == 7


def _cli(*args: str, **kw):
    import subprocess
    import sys
    return subprocess.Popen([sys.executable, "-m", "statestore_async.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def test_offline_repartition_resumes_after_a_kill_and_the_query_continues(spark, tmp_path):
    """``statestore-async repartition``: refused while the owner is not named and above the key
    groups; ``--dry-run`` plans and writes nothing; a run killed (-9) after its first partition
    resumes; then the query, restarted at the new count, continues exactly (no online rescale)."""
    import json
    import os
    import time

    src, root, ckpt = str(tmp_path / "src"), f"file://{tmp_path}/state", str(tmp_path / "ckpt")
    got: dict = {}
    batches = write_phase(src, 0)
    with Daemon() as d:
        op = StatefulOperator(root, "counts", ["key"], CountSum(), OUT, 4, G, socket_path=d.socket)
        run_stream(spark, src, ckpt, op.foreach_batch(collector(got)))
        owner = op.owner().owner
        before = manifest(root)

        p = _cli("repartition", root, "--operator", "counts", "--partitions", "3")
        _, err = p.communicate(timeout=120)
        assert p.returncode == 1 and "OwnerConflictError" in err and owner in err
        p = _cli("repartition", root, "--operator", "counts", "--partitions", str(G + 1), "--owner", owner)
        _, err = p.communicate(timeout=120)
        assert p.returncode == 1 and "RepartitionConfigError" in err and f"1 to {G}" in err
        files_before = sorted(os.listdir(tmp_path / "state" / "counts" / "0" / "default"))
        p = _cli("repartition", root, "--operator", "counts", "--partitions", "3", "--owner", owner, "--dry-run",
                 "--json")
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        plan = json.loads(out)
        stored = stored_bytes(root, before)
        print(f"offline plan 4 -> 3: ~{plan['bytes_to_read']} bytes to read of {stored} stored")
        assert [pp["partition"] for pp in plan["partitions"]] == [0, 1, 2]
        assert stored * 0.9 <= plan["bytes_to_read"] <= stored * 1.1
        assert sorted(os.listdir(tmp_path / "state" / "counts" / "0" / "default")) == files_before  # nothing written

        # a run killed as soon as its first new partition's snapshot exists
        first = plan["partitions"][0]["ref"]
        snap = tmp_path / "state" / "counts" / "0" / "default" / f"{first[0]}_{first[1]}.snapshot"
        p = _cli("repartition", root, "--operator", "counts", "--partitions", "3", "--owner", owner,
                 start_new_session=True)
        deadline = time.monotonic() + 120
        while not snap.exists() and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        p.kill()
        p.communicate()
        assert manifest(root).num_partitions in (3, 4)
        p = _cli("repartition", root, "--operator", "counts", "--partitions", "3", "--owner", owner, "--json")
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        done = json.loads(out)
        print(f"offline 4 -> 3 resumed: skipped {done['skipped']}, read {done['bytes_read']} bytes")
        after = manifest(root)
        assert after.version == before.version and after.num_partitions == 3
        assert after.metadata[RESCALED_FROM_KEY]["num_partitions"] == 4

        counters = daemon_counters(d.socket)
        batches += write_phase(src, 1)
        op2 = StatefulOperator(root, "counts", ["key"], CountSum(), OUT, 3, G, socket_path=d.socket)
        run_stream(spark, src, ckpt, op2.foreach_batch(collector(got)))
        assert daemon_counters(d.socket)["rescales"] == counters["rescales"]  # nothing left to rescale online
    per_batch, final = dict_oracle(batches)
    assert [got[b] for b in sorted(got)] == per_batch
    assert final_count_sum(load_state(root, "counts")) == final


@pytest.mark.parametrize("vectorized", [False, True], ids=["per-key", "vectorized"])
def test_timers_move_with_their_keys_sessions_equal_the_oracle_across_rescales(spark, tmp_path, vectorized):
    """Event-time sessionization (timers in the store, a watermark in the manifest) run in three
    phases at 2, 5, then 1 partitions: the sessions emitted equal the batch computation's, none
    twice, none lost — timers are keyed by key group and move with their keys."""
    import os
    import shutil
    import sys

    from pyspark import cloudpickle

    from statestore_async.testing import sessions as S

    cloudpickle.register_pickle_by_value(sys.modules[S.__name__])
    stream = S.generate(users=300, batches=8, seed=5)
    staged, src = str(tmp_path / "staged"), str(tmp_path / "src")
    files = S.write_batches(stream, staged)
    names = sorted(os.listdir(staged))
    assert len(names) == files
    os.makedirs(src)
    out: list = []
    with Daemon() as d:
        for n, part in ((2, names[:3]), (5, names[3:6]), (1, names[6:])):
            for name in part:
                shutil.copy2(os.path.join(staged, name), src)
            op = S.session_operator(f"file://{tmp_path}/state", "sessions", stream.gap_ms, stream.delay_ms,
                                    num_partitions=n, num_key_groups=G, socket_path=d.socket, vectorized=vectorized)
            S.run_to_end(S.read_stream(spark, src), str(tmp_path / "ckpt"), op.foreach_batch(S.collect_into(out)))
    assert manifest(f"file://{tmp_path}/state", operator_id="sessions").num_partitions == 1
    from collections import Counter
    assert not [s for s, c in Counter(out).items() if c > 1]
    assert sorted(out) == S.sessions_of(stream)
