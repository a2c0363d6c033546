"""A real standalone cluster: master + 2 workers on 127.0.0.1, one daemon per worker ("node").

Each worker's executors find their node's daemon through ``STATESTORE_SOCKET`` (set in the worker's
environment) and start it on first use. The checkpoint root is S3 (SeaweedFS). The driver runs in
its own process (it needs its own SparkContext). When batch 2 starts, worker B, its executor and its
daemon are killed with SIGKILL; the query goes on with worker A, whose daemon loads B's partitions
from S3. Outputs and final state equal the oracle.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from spark_cluster import StandaloneCluster, dict_oracle, final_count_sum, read_outputs, write_batches

from statestore_async.spark import daemon_pid, load_state

pytestmark = [pytest.mark.spark, pytest.mark.slow]


def test_node_lost_mid_stream_recovers_from_s3(seaweedfs, s3_bucket, tmp_path):
    src = str(tmp_path / "src")
    per_batch, final = dict_oracle(write_batches(src, 5, 3000, 1000, seed=5))
    root = f"s3://{s3_bucket}/cluster"
    out = tmp_path / "out"
    with StandaloneCluster(extra_env=seaweedfs.env()) as cluster:
        here = os.path.dirname(os.path.abspath(__file__))
        env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable, PYTHONPATH=here)
        cmd = [sys.executable, os.path.join(here, "spark_cluster.py"), "job", "--master", cluster.url, "--cluster",
               "--src", src, "--root", root, "--ckpt", str(tmp_path / "ckpt"), "--out", str(out),
               "--s3-options", json.dumps(seaweedfs.client_options()), "--mark-at", "2"]
        log = open(tmp_path / "driver.log", "wb")
        driver = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 180
            while not (out / "at-2").exists():
                assert driver.poll() is None, (tmp_path / "driver.log").read_text()[-4000:]
                assert time.monotonic() < deadline, "batch 2 never started"
                time.sleep(0.05)
            both = daemon_pid(cluster.socket("A")), daemon_pid(cluster.socket("B"))
            cluster.kill_node("B")
            assert driver.wait(180) == 0, (tmp_path / "driver.log").read_text()[-4000:]
        finally:
            if driver.poll() is None:
                os.killpg(driver.pid, 9)
                driver.wait()
            log.close()
        assert None not in both  # each node's daemon served state before the kill
        assert daemon_pid(cluster.socket("B")) is None
    got = read_outputs(str(out))
    assert [got[b] for b in sorted(got)] == per_batch
    assert final_count_sum(load_state(root, "counts", s3_options=seaweedfs.client_options())) == final
    # the coordinator reports where each partition ran: on the nodes' daemons, on A's alone
    # once B is gone
    progress = [json.loads(line) for line in open(out / "progress.json")]
    where = [{loc.split(":", 1)[1] for loc in p["locations"].values()} for p in progress]
    assert where[-1] == {cluster.socket("A")}
    assert set().union(*where) <= {cluster.socket("A"), cluster.socket("B")}


def test_rescale_on_two_nodes_reads_the_state_once_and_drops_the_old_copies(seaweedfs, s3_bucket, tmp_path):
    """The query runs at 4 partitions on two nodes, then is restarted at 3: the daemons of both
    nodes assemble the new partitions (together reading about the old layout's stored size once),
    and neither keeps a copy of an old partition id the new layout does not have."""
    import asyncio

    from spark_cluster import run_job

    from statestore_async.client import Client
    from statestore_async.files.loader import load_store
    from statestore_async.files.manifest import list_manifest_versions, read_manifest
    from statestore_async.ids import StoreId
    from statestore_async.objectstore import open_object_store

    src, root, opts = str(tmp_path / "src"), f"s3://{s3_bucket}/rescale", seaweedfs.client_options()
    batches = write_batches(src, 2, 20000, 50000, seed=9)

    def job(cluster, n):
        r = run_job(["--master", cluster.url, "--cluster", "--src", src, "--root", root, "--ckpt", str(tmp_path / "ckpt"),
                     "--out", str(tmp_path / "out"), "--s3-options", json.dumps(opts), "--partitions", str(n),
                     "--key-groups", "64"], timeout=300)
        assert r.returncode == 0, r.stdout[-4000:]

    def registry(cluster):
        out = {}
        for node in ("A", "B"):
            with Client(cluster.socket(node)) as c:
                out[node] = (c.stats()["registry"], c.release(root, "counts", [])["held"])
        return out

    async def stored():
        async with open_object_store(root, s3_options=opts) as s:
            m = await read_manifest(s, "counts", max(await list_manifest_versions(s, "counts")))
            total = 0
            for p in range(m.num_partitions):
                total += (await load_store(s, StoreId(root, "counts", p), m.ref(p)))[1].bytes_read
            return total

    with StandaloneCluster(extra_env=seaweedfs.env()) as cluster:
        job(cluster, 4)
        size = asyncio.run(stored())
        before = registry(cluster)
        batches += write_batches(src, 2, 20000, 50000, seed=9, first=2)
        job(cluster, 3)
        after = registry(cluster)
    read = sum(after[n][0]["rescale_bytes_read"] - before[n][0]["rescale_bytes_read"] for n in after)
    assembled = sum(after[n][0]["rescales"] - before[n][0]["rescales"] for n in after)
    print(f"rescale 4 -> 3 on two nodes: {assembled} partitions assembled, {read} bytes read for {size} stored "
          f"({read / size:.3f}x); held after: {[after[n][1] for n in after]}")
    assert assembled >= 3 and read <= 1.2 * size
    assert all(p < 3 for n in after for p in after[n][1])
    got = read_outputs(str(tmp_path / "out"))
    per_batch, final = dict_oracle(batches)
    assert [got[b] for b in sorted(got)] == per_batch
    assert final_count_sum(load_state(root, "counts", s3_options=opts)) == final
