"""Guarantees of the Spark operator, against real Spark (local mode) and real daemon processes.

* One writer per state, across queries: a second streaming query on the same checkpoint root and
  operator id is refused with ``OwnerConflictError`` before it writes anything (no manifest, no
  delta, no owner record); the owning query restarted from its checkpoint location continues;
  two queries started together: exactly one runs; an explicit takeover hands the state to another
  query, after which the old one is refused.
* A daemon SIGKILLed while a task runs does not fail the query: the task retries its partition on
  a daemon it starts (local mode), and a batch whose committed delta died with its daemon before
  the upload is run again by the driver. Every batch's output and the final state equal Spark's
  own streaming aggregation; a task that loses its daemon on every try fails with
  ``RetriesExhaustedError``.

Kills are injected by fault hooks of this module (pickled by value into Spark's workers), each
firing once (a marker file created with O_EXCL), and they wait until the daemon is gone.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from spark_cluster import (
    Daemon,
    collector,
    dict_oracle,
    final_count_sum,
    run_stream,
    spark_oracle,
    stream,
    write_batches,
)

from statestore_async import errors
from statestore_async.codecs import sparkhash
from statestore_async.files.manifest import list_manifest_versions
from statestore_async.ids import EMPTY_STATE
from statestore_async.objectstore import open_object_store
from statestore_async.spark import StatefulOperator, daemon_pid, load_state, placement
from statestore_async.spark.api.examples import CountSum
from statestore_async.spark.shared.routing import KG_COLUMN
from statestore_async.spark.shared.taskspec import TaskSpec
from statestore_async.spark.task.partition import run_partition
from statestore_async.testing import faults

OUT = "key string, count bigint, sum bigint"


@pytest.fixture(scope="module", autouse=True)
def _hooks_by_value():
    """The fault hooks and processors of this module travel to Spark's workers by value."""
    from pyspark import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


# -- helpers ------------------------------------------------------------------------------------------
def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return placement._zombie(pid)


def kill_daemon(socket_path: str | None, timeout: float = 60.0) -> int | None:
    """SIGKILL the daemon serving ``socket_path`` and wait until it is gone; its pid (None: none ran)."""
    pid = placement.daemon_pid(socket_path)
    if pid is None:
        return None
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while not _gone(pid):
        if time.monotonic() > deadline:
            raise TimeoutError(f"daemon {pid} still alive {timeout}s after SIGKILL")
        time.sleep(0.01)
    return pid


def fire_once(marker: str) -> bool:
    """True for the first caller (in any process) of ``marker``, False for every later one."""
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.close(fd)
    return True


@dataclass(frozen=True)
class KillAt:
    """A fault hook (``testing.faults.FaultHook``): SIGKILL the operator's daemon at ``point`` of ``batch``
    in the task of ``partition``, once (``marker``)."""

    marker: str
    point: str
    batch: int
    partition: int

    def __call__(self, site) -> None:
        if (site.point, site.batch, site.partition) == (self.point, self.batch, self.partition) and fire_once(self.marker):
            kill_daemon(site.socket_path)


@dataclass(frozen=True)
class LoseUpload:
    """A fault hook: in the task of ``partition`` at batch 0, make its delta's upload impossible
    before the commit (a file where the store's folder goes), and after the commit SIGKILL the
    daemon, then remove that file: the commit was answered, its delta never reaches the store.
    Once (``marker``)."""

    marker: str
    state_folder: str  # the root's folder on disk
    partition: int

    def __call__(self, site) -> None:
        if site.batch != 0 or site.partition != self.partition:
            return
        block = os.path.join(self.state_folder, "counts", str(self.partition))
        if site.point == "before_commit" and fire_once(self.marker):
            os.makedirs(os.path.dirname(block), exist_ok=True)
            with open(block, "w") as f:
                f.write("not a folder: the upload of this partition's delta fails")
        elif site.point == "after_commit" and os.path.isfile(block):
            kill_daemon(site.socket_path)
            os.remove(block)


class KillingCountSum(CountSum):
    """``CountSum`` that SIGKILLs its daemon in the middle of processing (after the state was read,
    before it is written), once, in the first task that runs after ``arm`` exists."""

    def __init__(self, socket_path: str, arm: str, marker: str):
        self.socket_path, self.arm, self.marker = socket_path, arm, marker

    def handle_rows(self, key, rows, state):
        if os.path.exists(self.arm) and fire_once(self.marker):
            kill_daemon(self.socket_path)
        return super().handle_rows(key, rows, state)


def files_under(folder: str) -> dict[str, bytes]:
    """Every file under ``folder`` (relative path -> bytes)."""
    out = {}
    for dirpath, _, names in os.walk(folder):
        for n in names:
            p = os.path.join(dirpath, n)
            with open(p, "rb") as f:
                out[os.path.relpath(p, folder)] = f.read()
    return out


def manifest_versions(root: str, operator_id: str = "counts") -> list[int]:
    async def versions():
        async with open_object_store(root) as s:
            return await list_manifest_versions(s, operator_id)

    return asyncio.run(versions())


def run_refused(spark, src: str, ckpt: str, op: StatefulOperator) -> BaseException:
    """Run a query with ``op`` that must fail; the exception ``op`` raised in foreachBatch (typed)."""
    caught: list[BaseException] = []

    def fn(df, batch_id):
        try:
            op.process_batch(df, batch_id, collector({}))
        except BaseException as exc:
            caught.append(exc)
            raise

    with pytest.raises(Exception):  # noqa: B017 - Spark wraps it; the typed one is caught above
        run_stream(spark, src, ckpt, fn)
    assert caught, "the query was not refused"
    return caught[0]


@pytest.fixture(scope="module")
def data(tmp_path_factory, spark):
    """Sources: A (3 batches, then 2 more written by the tests that restart it) and B (2 + 1) over
    the same 600 keys; C: 4 batches with Spark's own streaming aggregation of them."""
    tmp = tmp_path_factory.mktemp("guarantees")
    a, b, c = str(tmp / "a"), str(tmp / "b"), str(tmp / "c")
    rows_a = write_batches(a, 5, 2000, 600, seed=21)
    rows_b = write_batches(b, 3, 2000, 600, seed=22)
    for src, n in ((a, 3), (b, 2)):  # the later batches wait aside until a test moves them in
        os.makedirs(src + "-later", exist_ok=True)
        for name in sorted(os.listdir(src))[2 * n:]:
            os.rename(os.path.join(src, name), os.path.join(src + "-later", name))
    rows_c = write_batches(c, 4, 3000, 800, seed=23)
    expected_c = spark_oracle(spark, c, str(tmp / "oracle-ckpt"))
    per_batch_c, final_c = dict_oracle(rows_c)
    assert [expected_c[k] for k in sorted(expected_c)] == per_batch_c  # Spark agrees with a plain dict
    return {"a": (a, rows_a), "b": (b, rows_b), "c": (c, expected_c, final_c)}


def fresh_copy(src: str, dest: str, batches: int) -> str:
    """``dest``: a copy of ``src``'s first ``batches`` batches (file names and times kept)."""
    os.makedirs(dest)
    for name in sorted(os.listdir(src))[:2 * batches]:
        shutil.copy2(os.path.join(src, name), os.path.join(dest, name))
    return dest


def copy_later(src: str, dest: str) -> None:
    """Copy the batches ``src`` keeps aside into ``dest`` (new batches for a restarted query)."""
    for name in sorted(os.listdir(src + "-later")):
        shutil.copy2(os.path.join(src + "-later", name), os.path.join(dest, name))


def op_for(root: str, daemon: Daemon, **kw) -> StatefulOperator:
    kw.setdefault("fence_timeout", 30)
    return StatefulOperator(root, "counts", ["key"], CountSum(), OUT, 2, 64, socket_path=daemon.socket, **kw)


# -- one writer per state ---------------------------------------------------------------------------
def test_owner_records_admit_one_writer_and_an_explicit_takeover(tmp_path):
    """The files layer: of eight claimers at once exactly one owns the state; its own claim again
    is a no-op; a takeover must name the owner (or be True), and of two takers of one owner one wins."""
    from statestore_async.files.manifest import claim_owner, read_owner

    async def main():
        async with open_object_store(str(tmp_path)) as s:
            results = await asyncio.gather(*(claim_owner(s, "op", f"q{i}") for i in range(8)),
                                           return_exceptions=True)
            won = [r for r in results if not isinstance(r, BaseException)]
            assert len(won) == 1 and won[0].epoch == 0 and won[0].previous is None
            assert all(isinstance(r, errors.OwnerConflictError) for r in results if isinstance(r, BaseException))
            first = won[0].owner
            assert (await read_owner(s, "op")) == won[0]
            assert (await claim_owner(s, "op", first)) == won[0]  # a restart of the owner
            with pytest.raises(errors.OwnerConflictError, match=f"owned by {first!r}"):
                await claim_owner(s, "op", "new", takeover="somebody-else")
            # two takers of the same owner at once: one wins, whether their calls interleave or not
            # (the second to run finds the first taker, not the owner it names, or loses the write)
            takers = await asyncio.gather(claim_owner(s, "op", "t1", takeover=first, from_version=7),
                                          claim_owner(s, "op", "t2", takeover=first), return_exceptions=True)
            new = [r for r in takers if not isinstance(r, BaseException)]
            assert len(new) == 1 and new[0].epoch == 1 and new[0].previous == first
            assert sum(isinstance(r, errors.OwnerConflictError) for r in takers) == 1
            assert (await read_owner(s, "op")) == new[0] == await read_owner(s, "op", won[0])
            with pytest.raises(errors.OwnerConflictError):
                await claim_owner(s, "op", first)  # the old owner is refused now
            last = await claim_owner(s, "op", "t3", takeover=True)  # True: from whichever owner
            assert (last.epoch, last.previous, last.owner) == (2, new[0].owner, "t3")
            assert (await read_owner(s, "op")) == last

    asyncio.run(main())


@pytest.mark.spark
@pytest.mark.slow
def test_a_second_query_is_refused_before_it_writes_and_the_owner_continues(spark, data, tmp_path):
    src_a, rows_a = data["a"]
    src_b, _ = data["b"]
    src_a = fresh_copy(src_a, str(tmp_path / "a"), 3)
    per_batch_a, final_a = dict_oracle(rows_a)
    state = tmp_path / "state"
    root = f"file://{state}"
    with Daemon() as d:
        got: dict = {}
        q = run_stream(spark, src_a, str(tmp_path / "ckpt-a"), op_for(root, d).foreach_batch(collector(got)))
        assert [got[b] for b in sorted(got)] == per_batch_a[:3]
        before = files_under(str(state))

        # another query (other input, other checkpoint location), same root and operator id
        exc = run_refused(spark, src_b, str(tmp_path / "ckpt-b"), op_for(root, d))
        assert isinstance(exc, errors.OwnerConflictError), repr(exc)
        assert str(q.id) in str(exc) and "takeover" in str(exc)
        assert files_under(str(state)) == before  # no manifest, no delta, no owner record: nothing

        # the owner, restarted from its checkpoint location, continues with its next batches
        copy_later(data["a"][0], src_a)
        op = op_for(root, d)
        q2 = run_stream(spark, src_a, str(tmp_path / "ckpt-a"), op.foreach_batch(collector(got)))
        assert q2.id == q.id
        assert [got[b] for b in sorted(got)] == per_batch_a
        assert final_count_sum(load_state(root, "counts")) == final_a
        assert manifest_versions(root) == [1, 2, 3, 4, 5]
        owner = op.owner()
        assert owner is not None and (owner.owner, owner.epoch, owner.previous) == (str(q.id), 0, None)


@pytest.mark.spark
@pytest.mark.slow
def test_two_queries_started_together_one_runs(spark, data, tmp_path):
    """The issue's case: two queries on one root and operator id, at once. Exactly one is refused
    (at its first batch, before writing); the other's outputs and state are whole."""
    srcs = {"a": fresh_copy(data["a"][0], str(tmp_path / "a"), 3), "b": fresh_copy(data["b"][0], str(tmp_path / "b"), 2)}
    oracles = {"a": dict_oracle(data["a"][1][:3]), "b": dict_oracle(data["b"][1][:2])}
    root = f"file://{tmp_path}/state"
    got: dict = {"a": {}, "b": {}}
    caught: dict = {}
    with Daemon() as d:
        ops = {name: op_for(root, d) for name in srcs}

        def fn(name):
            def run(df, batch_id):
                try:
                    ops[name].process_batch(df, batch_id, collector(got[name]))
                except BaseException as exc:
                    caught[name] = exc
                    raise
            return run

        queries = {}
        try:
            for name, src in srcs.items():
                queries[name] = (stream(spark, src).writeStream.foreachBatch(fn(name))
                                 .option("checkpointLocation", str(tmp_path / f"ckpt-{name}"))
                                 .trigger(availableNow=True).start())
            deadline = time.monotonic() + 300
            for q in queries.values():
                try:
                    q.awaitTermination(max(1.0, deadline - time.monotonic()))
                except Exception:  # the refused query's failure: q.exception() below
                    pass
        finally:
            for q in queries.values():
                if q.isActive:
                    q.stop()
        assert all(not q.isActive for q in queries.values()), "a query did not finish"
    assert len(caught) == 1, caught
    (loser, exc), = caught.items()
    winner = "b" if loser == "a" else "a"
    assert isinstance(exc, errors.OwnerConflictError), repr(exc)
    assert queries[loser].exception() is not None and queries[winner].exception() is None
    assert got[loser] == {}
    per_batch, final = oracles[winner]
    assert [got[winner][b] for b in sorted(got[winner])] == per_batch
    assert final_count_sum(load_state(root, "counts")) == final
    assert manifest_versions(root) == list(range(1, len(per_batch) + 1))
    deltas = list(Path(tmp_path, "state").rglob("*.delta"))
    assert len(deltas) == sum(p.partitions_committed for p in ops[winner].history)  # none from the loser


@pytest.mark.spark
@pytest.mark.slow
def test_takeover_hands_the_state_to_another_query(spark, data, tmp_path):
    src_a = fresh_copy(data["a"][0], str(tmp_path / "a"), 3)
    src_b = fresh_copy(data["b"][0], str(tmp_path / "b"), 2)
    state = tmp_path / "state"
    root = f"file://{state}"
    with Daemon() as d:
        qa = run_stream(spark, src_a, str(tmp_path / "ckpt-a"), op_for(root, d).foreach_batch(collector({})))
        assert manifest_versions(root) == [1, 2, 3]
        before = files_under(str(state))
        # a takeover names the query it takes over from: another name takes nothing
        exc = run_refused(spark, src_b, str(tmp_path / "ckpt-b0"), op_for(root, d, takeover="not-the-owner"))
        assert isinstance(exc, errors.OwnerConflictError), repr(exc)
        assert files_under(str(state)) == before

        # query A is dead for good: B takes over. Its checkpoint location is new, so it starts at
        # batch 0, from the empty state; A's later manifests go (the latest is B's)
        got: dict = {}
        op_b = op_for(root, d, takeover=str(qa.id))
        qb = run_stream(spark, src_b, str(tmp_path / "ckpt-b"), op_b.foreach_batch(collector(got)))
        per_batch_b, final_b = dict_oracle(data["b"][1][:2])
        assert [got[b] for b in sorted(got)] == per_batch_b
        assert manifest_versions(root) == [1, 2]
        assert final_count_sum(load_state(root, "counts")) == final_b
        owner = op_b.owner()
        assert owner is not None and (owner.owner, owner.epoch, owner.previous) == (str(qb.id), 1, str(qa.id))

        # the old owner, restarted, is refused now (before writing anything)
        copy_later(data["a"][0], src_a)
        before = files_under(str(state))
        exc = run_refused(spark, src_a, str(tmp_path / "ckpt-a"), op_for(root, d))
        assert isinstance(exc, errors.OwnerConflictError) and str(qb.id) in str(exc), repr(exc)
        assert files_under(str(state)) == before

        # the new owner, restarted (its takeover setting left in place), continues
        copy_later(data["b"][0], src_b)
        run_stream(spark, src_b, str(tmp_path / "ckpt-b"), op_for(root, d, takeover=str(qa.id)).foreach_batch(
            collector(got)))
        per_batch_b, final_b = dict_oracle(data["b"][1])
        assert [got[b] for b in sorted(got)] == per_batch_b
        assert final_count_sum(load_state(root, "counts")) == final_b
        assert manifest_versions(root) == [1, 2, 3]


# -- a daemon killed while a task runs ---------------------------------------------------------------
@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.parametrize("where", ["processing", "before_commit"])
def test_a_daemon_killed_mid_task_does_not_fail_the_query(spark, data, tmp_path, where):
    """SIGKILL of the node's daemon while a task of batch 2 runs: in the processor (the state read,
    nothing written yet) or after its writes, before its commit. The task reconnects, starting a
    daemon (local mode), which loads the manifest's state from the files; it runs its rows again
    and commits under a fresh checkpoint id. The query goes on; outputs and state equal Spark's."""
    src, expected, final = data["c"]
    root = f"file://{tmp_path}/state"
    arm, marker = str(tmp_path / "arm"), str(tmp_path / "fired")
    got: dict = {}
    with Daemon() as d:
        first_pid = d.pid()
        if where == "processing":
            processor = KillingCountSum(d.socket, arm, marker)
            op = StatefulOperator(root, "counts", ["key"], processor, OUT, 2, 64, socket_path=d.socket,
                                  fence_timeout=30)
        else:
            op = op_for(root, d)
            faults.arm(op, KillAt(marker, "before_commit", 2, 0))
        collect = collector(got)

        def sink(df, batch_id):
            collect(df, batch_id)
            if batch_id == 1:  # the processor's kill is armed for the next batch
                open(arm, "w").close()

        run_stream(spark, src, str(tmp_path / "ckpt"), op.foreach_batch(sink))  # raises if the query failed
        assert os.path.exists(marker) and _gone(first_pid)  # the daemon really died mid-batch
        assert daemon_pid(d.socket) not in (None, first_pid)  # a task started another one
        retried = op.history[2]
        assert retried.reruns > 0 or any(t.get("retries", 0) for t in retried.tasks.values()), retried
    assert got == expected
    assert final_count_sum(load_state(root, "counts")) == final
    assert manifest_versions(root) == [1, 2, 3, 4]


@pytest.mark.spark
@pytest.mark.slow
def test_a_delta_lost_with_its_daemon_makes_the_driver_run_the_batch_again(spark, data, tmp_path):
    """The daemon dies after a task's commit was answered but before its delta reached the object
    store (the upload made to fail until then): the fence times out and the driver runs the
    batch's stateful stage again from the same manifest (fresh checkpoint ids); the query goes on."""
    src, expected, final = data["c"]
    state = tmp_path / "state"
    root = f"file://{state}"
    got: dict = {}
    with Daemon() as d:
        first_pid = d.pid()
        op = op_for(root, d, fence_timeout=8)
        faults.arm(op, LoseUpload(str(tmp_path / "fired"), str(state), 0))
        run_stream(spark, src, str(tmp_path / "ckpt"), op.foreach_batch(collector(got)))
        assert _gone(first_pid)
        assert op.history[0].reruns == 1 and all(p.reruns == 0 for p in op.history[1:])
    assert got == expected
    assert final_count_sum(load_state(root, "counts")) == final
    assert manifest_versions(root) == [1, 2, 3, 4]


def test_a_task_that_loses_its_daemon_on_every_try_fails_with_a_clear_error(tmp_path):
    """No Spark: ``run_partition`` whose daemon is SIGKILLed before every commit tries three times
    (each on a daemon it starts) and then raises ``RetriesExhaustedError``, reporting nothing; one
    loss only: the second try commits, reports, and the state is whole."""
    root = f"file://{tmp_path}/s"
    keys = [f"k{i}" for i in range(50)]
    kg = sparkhash.key_groups(sparkhash.hash_rows([(k,) for k in keys], ["string"]), 4)
    t = pa.table({"key": keys, "value": pa.array(range(50), pa.int64()), KG_COLUMN: pa.array(kg.astype(np.int32))})
    seen: list = []

    def kill_before_commit(times):
        def hook(site):
            if site.point == "before_commit":
                seen.append((getattr(site, "retry", None), placement.daemon_pid(site.socket_path)))
                if len(seen) <= times:
                    kill_daemon(site.socket_path)
        return hook

    with Daemon() as d:
        def spec(hook):
            return TaskSpec(root=root, operator_id="op", key_columns=("key",), value_columns=("value",),
                            output_schema=pa.schema([("key", pa.string()), ("count", pa.int64()), ("sum", pa.int64())]),
                            num_partitions=1, num_key_groups=4, batch_id=0, refs=(EMPTY_STATE,), now_ms=0,
                            socket_path=d.socket, hook=hook)

        reports: list = []
        with pytest.raises(errors.ConnectionLostError) as info:
            run_partition(CountSum(), spec(kill_before_commit(99)), 0, 0, t.to_batches(), reports.append)
        assert type(info.value).__name__ == "RetriesExhaustedError", repr(info.value)
        assert "on each of 3 tries" in str(info.value) and isinstance(info.value.__cause__, errors.ConnectionLostError)
        assert [r for r, _ in seen] == [0, 1, 2] and len({pid for _, pid in seen}) == 3  # a new daemon each try
        assert reports == []

        seen.clear()
        out = run_partition(CountSum(), spec(kill_before_commit(1)), 0, 0, t.to_batches(), reports.append)
        assert [r for r, _ in seen] == [0, 1]
        assert len(reports) == 1 and reports[0].timings["retries"] == 1 and reports[0].ref.version == 1
        assert dict(zip(out["key"].to_pylist(), out["count"].to_pylist())) == dict.fromkeys(keys, 1)
        from statestore_async.client.clients import Client

        with Client(d.socket) as c:
            from statestore_async.ids import StoreId

            assert c.await_durable(StoreId(root, "op", 0), reports[0].ref, 30)
