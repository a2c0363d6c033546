"""Recovery with a driver in its own process: task retries after a commit, and kill -9 of the driver.

* Attempts: with ``local[2,2]`` (one retry per task), partition 0 of batch 1 commits and then fails
  on attempt 0; attempt 1 commits again under another checkpoint id. Exactly one lineage counts:
  the manifest names attempt 1's checkpoint, later batches build on it, results equal the oracle.
* Driver kill: the driver SIGKILLs itself before the fence of batch 1, then (second run) right after
  writing the manifest of batch 3; each restart replays the batch from the Spark checkpoint.

The faults are armed by ``--faults``: the child driver arms them on its operator
(``statestore_async.testing.faults.arm``).
"""
from __future__ import annotations

import asyncio
import json
import os
import signal

import pytest
from spark_cluster import Daemon, dict_oracle, final_count_sum, read_outputs, run_job, write_batches

from statestore_async.files.manifest import read_manifest
from statestore_async.files.names import DELTA, file_key
from statestore_async.ids import CheckpointRef, StoreId
from statestore_async.objectstore import open_object_store
from statestore_async.spark import load_state

pytestmark = [pytest.mark.spark, pytest.mark.slow]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    src = str(tmp_path_factory.mktemp("recovery") / "src")
    batches = write_batches(src, 5, 3000, 900, seed=11)
    return src, *dict_oracle(batches)


def _args(src, tmp_path, sock, faults=(), master="local[2]"):
    return ["--master", master, "--src", src, "--root", f"file://{tmp_path}/state", "--ckpt", str(tmp_path / "ckpt"),
            "--out", str(tmp_path / "out"), "--socket", sock, "--faults", json.dumps(list(faults))]


async def _manifest(root, version):
    async with open_object_store(root) as s:
        return await read_manifest(s, "counts", version)


def test_retried_task_after_commit_keeps_one_lineage(data, tmp_path):
    src, per_batch, final = data
    root = f"file://{tmp_path}/state"
    with Daemon() as d:
        fault = {"point": "after_commit", "batch": 1, "partition": 0, "action": "fail", "attempt": 0}
        r = run_job(_args(src, tmp_path, d.socket, [fault], master="local[2,2]"))
        assert r.returncode == 0, r.stdout[-4000:]
    got = read_outputs(str(tmp_path / "out"))
    assert [got[b] for b in sorted(got)] == per_batch
    assert final_count_sum(load_state(root, "counts")) == final
    # two committed attempts of partition 0 at version 2 exist; the manifest names the second
    m2 = asyncio.run(_manifest(root, 2))
    folder = tmp_path / "state" / "counts" / "0" / "default"
    deltas_v2 = sorted(p.name for p in folder.iterdir() if p.name.startswith("2_") and p.name.endswith(".delta"))
    assert len(deltas_v2) == 2, deltas_v2
    assert f"{m2.ref(0)}.delta" in deltas_v2
    progress = [json.loads(x) for x in open(tmp_path / "out" / "progress.json")]
    assert CheckpointRef(*progress[1]["refs"]["0"]) == m2.ref(0)
    # batch 2 built on that checkpoint: its delta's lineage starts with it
    m3 = asyncio.run(_manifest(root, 3))
    assert m3.ref(0).version == 3
    assert os.path.exists(f"{tmp_path}/state/{file_key(StoreId(root, 'counts', 0), m3.ref(0), DELTA)}")


def test_driver_killed_mid_batch_then_restarted(data, tmp_path):
    src, per_batch, final = data
    root = f"file://{tmp_path}/state"
    with Daemon() as d:
        r1 = run_job(_args(src, tmp_path, d.socket, [{"point": "before_fence", "batch": 1, "action": "kill_self"}]))
        assert r1.returncode == -signal.SIGKILL, r1.stdout[-4000:]
        assert sorted(read_outputs(str(tmp_path / "out"))) == [0]
        r2 = run_job(_args(src, tmp_path, d.socket, [{"point": "after_manifest", "batch": 3, "action": "kill_self"}]))
        assert r2.returncode == -signal.SIGKILL, r2.stdout[-4000:]
        assert sorted(read_outputs(str(tmp_path / "out"))) == [0, 1, 2]
        assert asyncio.run(_manifest(root, 4)).version == 4  # written before the kill, replaced by the replay
        r3 = run_job(_args(src, tmp_path, d.socket))
        assert r3.returncode == 0, r3.stdout[-4000:]
    got = read_outputs(str(tmp_path / "out"))
    assert [got[b] for b in sorted(got)] == per_batch
    assert final_count_sum(load_state(root, "counts")) == final
