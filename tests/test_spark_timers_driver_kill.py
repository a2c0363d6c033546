"""Timers fire exactly once across a kill -9 of the driver and across a retried Spark task (issue 19).

The driver runs in its own process (this file run as a script, which arms the ``--faults`` on its
operator: ``statestore_async.testing.faults.arm``): the event-time sessionization of
``statestore_async.testing.sessions`` over one parquet file per micro-batch, with ``mark_timers``
(every fired timer also emits ``(user, at_ms, at_ms, 0)``), into a foreachBatch sink that writes
each batch's rows to ``<out>/<batch id>.json`` (atomically, by batch id: a replayed batch
overwrites its file). Per-key and vectorized processors.

* Driver kill: the driver SIGKILLs itself before the fence of a batch whose timers fired (its tasks
  committed the callbacks' writes and the fired timers' deletions on the daemon, no manifest names
  them: the test reads those commits from the files and finds the batch's due timers gone), then,
  in a second run, right after the manifest of a later batch with fired timers (the sink has not
  run); a third run finishes. Spark replays each killed batch from its checkpoint;
  the operator reruns it from the manifest's state, where those timers still exist.
* Retried task: with ``local[2,2]`` every task of a batch with fired timers fails right after its
  commit on attempt 0; attempt 1 reruns from the manifest's state under a new checkpoint id.

Either way the committed output holds exactly the oracles' sessions (``sessions_of``) and fired
timers (``fired_timers``, by batch, user and time): none twice, none lost.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest

from statestore_async.testing import faults
from statestore_async.testing import sessions as S

pytestmark = [pytest.mark.spark, pytest.mark.slow]
OPERATOR = "sessions"


@pytest.fixture(scope="module")
def stream() -> S.SessionStream:
    return S.generate(users=60, batches=7, seed=7)


@pytest.fixture(scope="module")
def src(stream, tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("timers-driver-kill") / "src")
    S.write_batches(stream, folder)
    return folder


def _args(stream, src, tmp_path, sock, vectorized, faults=(), master="local[2]") -> list[str]:
    args = ["--master", master, "--src", src, "--root", f"file://{tmp_path}/state", "--ckpt", str(tmp_path / "ckpt"),
            "--out", str(tmp_path / "out"), "--socket", sock, "--gap", str(stream.gap_ms), "--delay",
            str(stream.delay_ms), "--faults", json.dumps(list(faults))]
    return [*args, "--vectorized"] if vectorized else args


def _run_driver(args: list[str], timeout: float = 300.0) -> subprocess.CompletedProcess:
    """``job_main(args)`` in its own driver process, faults armed (``spark_cluster.run_driver``)."""
    from spark_cluster import run_driver

    return run_driver(os.path.abspath(__file__), ["job", *args], timeout)


def _outputs(out: str) -> dict[int, list[tuple]]:
    """``{batch id: rows}`` of the sink's files."""
    res = {}
    for name in os.listdir(out) if os.path.isdir(out) else ():
        if name.endswith(".json") and name[:-5].isdigit():
            with open(os.path.join(out, name)) as f:
                res[int(name[:-5])] = [tuple(r) for r in json.load(f)]
    return res


def _check_exactly_once(stream: S.SessionStream, got: dict[int, list[tuple]]) -> None:
    assert sorted(got) == list(range(len(stream.batches) + 1))  # every batch's output, the trailing one's too
    sessions = [(u, s, e, n) for rows in got.values() for u, s, e, n in rows if n > 0]
    timers = [(b, u, at) for b, rows in got.items() for u, at, _, n in rows if n == 0]
    twice = [x for x, c in Counter(timers).items() if c > 1]
    assert not twice, f"timers fired twice: {twice[:5]}"
    assert sorted(timers) == S.fired_timers(stream)
    assert sorted(sessions) == S.sessions_of(stream)


def _manifest_refs(root: str, version: int) -> dict:
    from statestore_async.files.manifest import read_manifest
    from statestore_async.objectstore import open_object_store

    async def go():
        async with open_object_store(root) as s:
            m = await read_manifest(s, OPERATOR, version)
            return {p: m.ref(p) for p in range(2)}

    return asyncio.run(go())


def _deltas(tmp_path, partition: int, version: int) -> list[str]:
    folder = tmp_path / "state" / OPERATOR / str(partition) / "default"
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(f"{version}_") and p.name.endswith(".delta")) \
        if folder.is_dir() else []


def _timers_in(root: str, refs: dict) -> set[tuple[str, int]]:
    """``(user, at_ms)`` of every timer (its by-time record) of the states ``refs`` (partition ->
    ``CheckpointRef``), read from the checkpoint files."""
    from statestore_async.codecs import valuecodec
    from statestore_async.files.loader import load_store
    from statestore_async.ids import StoreId
    from statestore_async.objectstore import open_object_store
    from statestore_async.state import keys as state_keys

    async def go():
        out: set[tuple[str, int]] = set()
        async with open_object_store(root) as store:
            for p, ref in refs.items():
                if ref.is_empty_state:
                    continue
                vs, _ = await load_store(store, StoreId(root, OPERATOR, p), ref)
                for k, _ in vs.items():
                    if k[2] == state_keys.TIMER_AT:
                        _, _, at, enc = state_keys.parse_timer_at(k)
                        out.add((valuecodec.decode_row(enc)[0], at))
        return out

    return asyncio.run(go())


def _wait_for(what: str, condition, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.0f}s: {what}")
        time.sleep(0.1)


def _firing_batches(stream: S.SessionStream) -> list[int]:
    """The batches in which timers fire (ascending)."""
    return sorted({b for b, _, _ in S.fired_timers(stream)})


@pytest.mark.parametrize("vectorized", [False, True], ids=["per-key", "vectorized"])
def test_driver_killed_mid_batch_after_timers_fired_then_restarted(stream, src, tmp_path, vectorized):
    from spark_cluster import Daemon

    firing = _firing_batches(stream)
    assert len(firing) >= 2, firing
    b1, b2 = firing[0], firing[-1]
    root = f"file://{tmp_path}/state"
    with Daemon() as d:
        r1 = _run_driver(_args(stream, src, tmp_path, d.socket, vectorized,
                               [{"point": "before_fence", "batch": b1, "action": "kill_self"}]))
        assert r1.returncode == -signal.SIGKILL, r1.stdout[-4000:]
        assert sorted(_outputs(str(tmp_path / "out"))) == list(range(b1))
        # the batch's tasks had committed (their timers fired) on the daemon, which uploads the
        # deltas; no manifest names them
        refs = _manifest_refs(root, b1)
        _wait_for(f"a delta of batch {b1} in each partition's files",
                  lambda: all(_deltas(tmp_path, p, ref.version + 1) for p, ref in refs.items()))
        # in those commits the batch's due timers are gone (fired): they are in the manifest's state
        from statestore_async.ids import CheckpointRef

        orphans = {p: CheckpointRef(ref.version + 1, _deltas(tmp_path, p, ref.version + 1)[0][:-6].split("_", 1)[1])
                   for p, ref in refs.items()}
        due = {(u, at) for b, u, at in S.fired_timers(stream) if b == b1}
        assert due and due <= _timers_in(root, refs)
        assert not due & _timers_in(root, orphans)
        r2 = _run_driver(_args(stream, src, tmp_path, d.socket, vectorized,
                               [{"point": "after_manifest", "batch": b2, "action": "kill_self"}]))
        assert r2.returncode == -signal.SIGKILL, r2.stdout[-4000:]
        assert sorted(_outputs(str(tmp_path / "out"))) == list(range(b2))
        _manifest_refs(root, b2 + 1)  # written before the kill; the replay writes it again
        r3 = _run_driver(_args(stream, src, tmp_path, d.socket, vectorized))
        assert r3.returncode == 0, r3.stdout[-4000:]
    _check_exactly_once(stream, _outputs(str(tmp_path / "out")))


@pytest.mark.parametrize("vectorized", [False, True], ids=["per-key", "vectorized"])
def test_task_retried_after_committing_fired_timers_counts_once(stream, src, tmp_path, vectorized):
    from spark_cluster import Daemon

    b = _firing_batches(stream)[0]
    root = f"file://{tmp_path}/state"
    fault = {"point": "after_commit", "batch": b, "action": "fail", "attempt": 0}
    with Daemon() as d:
        r = _run_driver(_args(stream, src, tmp_path, d.socket, vectorized, [fault], master="local[2,2]"))
        assert r.returncode == 0, r.stdout[-4000:]
    _check_exactly_once(stream, _outputs(str(tmp_path / "out")))
    # a partition that fired timers in batch b committed twice at one version (attempts 0 and 1);
    # the manifest names one of those checkpoints, and only its timers' output counts
    before, after = _manifest_refs(root, b), _manifest_refs(root, b + 1)
    moved = [p for p in range(2) if after[p] != before[p]]
    assert moved
    for p in moved:
        _wait_for(f"both attempts' deltas of partition {p}", lambda: len(_deltas(tmp_path, p, after[p].version)) == 2)
        assert f"{after[p]}.delta" in _deltas(tmp_path, p, after[p].version)


# --- the driver, in its own process -------------------------------------------------------------------
def job_main(argv: list[str]) -> int:
    """Sessionize ``--src`` to the end (AvailableNow) with fired timers marked; each batch's output
    rows go to ``<out>/<batch id>.json``."""
    import argparse

    ap = argparse.ArgumentParser()
    for name in ("--src", "--root", "--ckpt", "--out", "--socket"):
        ap.add_argument(name, required=True)
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--gap", type=int, required=True)
    ap.add_argument("--delay", type=int, required=True)
    ap.add_argument("--faults", default="[]")
    ap.add_argument("--vectorized", action="store_true")
    a = ap.parse_args(argv)
    from pyspark import cloudpickle
    from spark_cluster import driver_session, json_batch_sink

    spark = driver_session(a.master)
    cloudpickle.register_pickle_by_value(S)
    sink = json_batch_sink(a.out)

    # the timers of data batches, batch by batch (time-only batches, which fire them earlier, are off:
    # the stream's trailing empty batch fires the last ones; tests/test_spark_available_now.py)
    op = S.session_operator(a.root, OPERATOR, a.gap, a.delay, socket_path=a.socket, vectorized=a.vectorized,
                            mark_timers=True, fence_timeout=30, time_only_batches="off")
    faults.arm(op, json.loads(a.faults))
    S.run_to_end(S.read_stream(spark, a.src), a.ckpt, op.foreach_batch(sink))
    spark.stop()
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["job"]:
        sys.exit(job_main(sys.argv[2:]))
    sys.exit("usage: test_spark_timers_driver_kill.py job --src … --root … --ckpt … --out … --socket … --gap … --delay …")
