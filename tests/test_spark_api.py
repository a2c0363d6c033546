"""The user API piece by piece: routing hash, grouping, state variables and TTL, the low-level
store-per-partition API, daemon autostart, and the typed errors."""
from __future__ import annotations

import json
import multiprocessing
import os
import sys

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from spark_cluster import Daemon

from statestore_async import errors
from statestore_async.client.clients import Client
from statestore_async.codecs import sparkhash
from statestore_async.ids import EMPTY_STATE, StoreId
from statestore_async.spark import (
    StatefulOperator,
    StatefulProcessor,
    VectorizedProcessor,
    group_rows,
    load_state,
    open_partition_store,
    placement,
    route_values,
)
from statestore_async.spark.api.examples import CountSum
from statestore_async.spark.shared.coordinator import Coordinator, location_of
from statestore_async.spark.shared.routing import KG_COLUMN, murmur3_int
from statestore_async.spark.shared.taskspec import TaskSpec
from statestore_async.spark.task.grouping import RoutingError
from statestore_async.spark.task.partition import run_partition

OUT = "key string, count bigint, sum bigint"


@pytest.mark.spark
def test_murmur3_and_routes_match_spark(spark):
    from pyspark.sql import functions as F

    values = list(range(300)) + [-1, -(2**31), 2**31 - 1, 123456789]
    rows = spark.createDataFrame([(v,) for v in values], "v int").select("v", F.hash("v").alias("h")).collect()
    assert all(r.h == murmur3_int(r.v) for r in rows)
    for n in (1, 2, 5, 16):
        assert [murmur3_int(v) % n for v in route_values(n)] == list(range(n))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, (1 << 32) + 5), max_size=300), st.sampled_from([1 << 8, 1 << 16, 1 << 20, 1 << 33]))
def test_stable_order_is_a_stable_argsort(values, bound):
    from statestore_async.spark.task.grouping import _stable_order

    codes = np.array([v % bound for v in values], dtype=np.int64)
    assert (_stable_order(codes) == np.argsort(codes, kind="stable")).all()


def test_group_rows_multi_column_nulls_and_float_normalization():
    t = pa.table({"a": ["x", None, "x", None, "y", "x"], "b": [0.0, 1.0, -0.0, 1.0, float("nan"), float("nan")]})
    order, offsets = group_rows(t, ["a", "b"])
    groups = [sorted(order[offsets[i]:offsets[i + 1]].tolist()) for i in range(len(offsets) - 1)]
    assert sorted(groups) == [[0, 2], [1, 3], [4], [5]]  # -0.0 == 0.0, NaN groups with NaN of the same key
    order, offsets = group_rows(t.slice(0, 0), ["a"])
    assert len(order) == 0 and offsets.tolist() == [0]


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 40), st.lists(st.sampled_from(["int64", "string", "float64", "bool"]), min_size=1, max_size=3),
       st.data())
def test_group_rows_groups_as_the_dictionary_encoding_does(n, types, data):
    from statestore_async.spark.task.grouping import _group_by_dictionary

    values = {"int64": st.integers(-3, 3), "string": st.sampled_from(["a", "b", ""]),
              "float64": st.sampled_from([0.0, -0.0, 1.5, float("nan")]), "bool": st.booleans()}
    t = pa.table({f"c{i}": pa.array(data.draw(st.lists(st.none() | values[ty], min_size=n, max_size=n)),
                                    getattr(pa, ty if ty != "bool" else "bool_")())
                  for i, ty in enumerate(types)})
    cols = list(t.column_names)

    def groups(order, offsets):
        return sorted(sorted(order[offsets[i]:offsets[i + 1]].tolist()) for i in range(len(offsets) - 1))

    order, offsets = group_rows(t, cols)
    assert sorted(order.tolist()) == list(range(n))
    assert groups(order, offsets) == groups(*_group_by_dictionary(t, cols)) if n else offsets.tolist() == [0]


class Profile(StatefulProcessor):
    """Uses every kind of state: a value with a TTL, a list and a map."""

    def init(self, handle):
        self.last = handle.value_state("last", ttl_seconds=1.5)
        self.seen = handle.list_state("seen")
        self.hist = handle.map_state("hist")

    def handle_rows(self, key, rows, state):
        prev = self.last.get()
        for (v,) in rows:
            self.seen.append(v)
            self.hist.update(v % 3, self.hist.get(v % 3, 0) + 1)
        if len(state.seen.get()) > 4:
            state["seen"].clear()
        if self.hist.contains(2):
            self.hist.remove(2)
        self.last.update(max(v for (v,) in rows))
        yield key[0], prev, len(self.seen.get()), json.dumps(sorted(self.hist.items()))


@pytest.fixture(scope="module")
def daemon():
    with Daemon() as d:
        yield d


@pytest.mark.spark
def test_value_list_map_state_and_ttl(spark, daemon, tmp_path):
    from pyspark import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    root = f"file://{tmp_path}/state"
    op = StatefulOperator(root, "profile", ["key"], Profile(), "key string, prev bigint, n int, hist string", 2, 16,
                          socket_path=daemon.socket, clock=lambda: now[0])
    now = [1000.0]
    out: dict = {}
    sink = lambda df, b: out.__setitem__(b, {r[0]: tuple(r[1:]) for r in df.collect()})
    batch = lambda rows: spark.createDataFrame(rows, "key string, value bigint").coalesce(1)
    op.process_batch(batch([("a", 1), ("a", 3), ("b", 2)]), 0, sink)
    assert out[0] == {"a": (None, 2, "[[0, 1], [1, 1]]"), "b": (None, 1, "[]")}
    now[0] = 1001.0
    op.process_batch(batch([("a", 5), ("a", 6), ("a", 7)]), 1, sink)
    assert out[1] == {"a": (3, 0, "[[0, 2], [1, 2]]")}  # the list grew past 4 and was cleared
    now[0] = 1010.0  # 'last' expires; list and map have no TTL
    op.process_batch(batch([("a", 9), ("b", 4)]), 2, sink)
    assert out[2] == {"a": (None, 1, "[[0, 3], [1, 2]]"), "b": (None, 2, "[[1, 1]]")}
    state = load_state(root, "profile")
    assert state[("seen", ("a",))] == [9] and state[("hist", ("b",))] == {1: 1}
    expires, value = state[("last", ("a",))]
    assert (expires, value) == (1010_000 + 1500, 9)
    assert ("hist", ("x",)) not in state


def test_run_partition_checks_routing_and_output_width(daemon, tmp_path):
    kg = sparkhash.key_groups(sparkhash.hash_rows([("a",), ("b",), ("c",)], ["string"]), 64)
    t = pa.table({"key": ["a", "b", "c"], "value": [1, 2, 3], KG_COLUMN: pa.array(kg.astype(np.int32))})
    spec = TaskSpec(root=f"file://{tmp_path}/s", operator_id="op", key_columns=("key",), value_columns=("value",),
                    output_schema=pa.schema([("key", pa.string())]), num_partitions=2, num_key_groups=64, batch_id=0,
                    refs=(EMPTY_STATE, EMPTY_STATE), now_ms=0, socket_path=daemon.socket)
    owners = set((kg * 2 // 64).tolist())
    if len(owners) == 2:
        with pytest.raises(RoutingError, match="received rows of partitions"):
            run_partition(CountSum(), spec, 0, 0, t.to_batches())
    mine = t.filter(pa.array(kg * 2 // 64 == 0))
    with pytest.raises(errors.InterfaceError, match="output rows have 3 values"):
        run_partition(CountSum(), spec, 0, 0, mine.to_batches())
    assert run_partition(CountSum(), spec, 1, 0, []).num_rows == 0  # no rows: no store opened


def test_coordinator_tracks_owners_and_names_stale_copies():
    c = Coordinator()
    c.observe([(0, {"location": "h:A", "held": [0], "released": [], "kept": []}), (1, {"location": "h:A", "held": [0, 1]})])
    assert c.locations() == {0: "h:A", 1: "h:A"} and c.releases() == {}
    c.observe([(1, {"location": "h:B", "held": [1]}), (0, {"location": "h:A", "held": [0, 1]})])
    assert c.locations() == {0: "h:A", 1: "h:B"} and c.counters["moves"] == 1
    assert c.releases() == {"h:A": (1,)}  # A still holds 1, which B owns now
    c.observe([(0, {"location": "h:A", "held": [0], "released": [1], "kept": []})])  # no task on B this batch
    assert c.releases() == {} and c.holdings() == {"h:A": [0], "h:B": [1]} and c.counters["released"] == 1
    c.observe([(0, {"location": "h:C"})])  # a report without the daemon's answer (RELEASE failed)
    assert c.locations()[0] == "h:C" and c.holdings()["h:C"] == [0] and c.releases() == {"h:A": (0,)}


def test_tasks_ask_their_daemon_to_release_what_another_node_owns(tmp_path):
    """Two daemons stand for two nodes; the driver's side is played by a Coordinator and
    ``run_partition``: partition 1 moves from A to B, and A's next task has A drop its copy."""
    root = f"file://{tmp_path}/s"
    keys = [f"k{i}" for i in range(200)]
    kg = sparkhash.key_groups(sparkhash.hash_rows([(k,) for k in keys], ["string"]), 64)
    part = (kg * 2 // 64).tolist()
    rows = {p: pa.table({"key": [k for k, q in zip(keys, part) if q == p],
                         "value": [1] * part.count(p),
                         KG_COLUMN: pa.array([g for g, q in zip(kg.tolist(), part) if q == p], pa.int32())})
            for p in (0, 1)}
    coord = Coordinator()
    refs = [EMPTY_STATE, EMPTY_STATE]
    with Daemon() as a, Daemon() as b:
        def batch(b_id, placement_of):
            reports, counts = [], {}
            for p, d in placement_of.items():
                spec = TaskSpec(root=root, operator_id="op", key_columns=("key",), value_columns=("value",),
                                output_schema=pa.schema([("key", pa.string()), ("count", pa.int64()), ("sum", pa.int64())]),
                                num_partitions=2, num_key_groups=64, batch_id=b_id, refs=tuple(refs), now_ms=0,
                                socket_path=d.socket, releases=coord.releases())
                out = run_partition(CountSum(), spec, p, 0, rows[p].to_batches(),
                                    lambda r: reports.append((r.partition, r.ref, r.node)))
                counts.update(zip(out.column("key").to_pylist(), out.column("count").to_pylist()))
            for q, ref, node in reports:
                refs[q] = ref
                with Client(node["location"].split(":", 1)[1]) as c:
                    assert c.await_durable(StoreId(root, "op", q), ref, 10)
            coord.observe([(q, node) for q, _, node in reports])
            assert counts == dict.fromkeys(keys, b_id + 1)  # every key's state is whole, wherever it ran
            return {q: node for q, _, node in reports}

        where_a, where_b = location_of(a.socket), location_of(b.socket)
        batch(0, {0: a, 1: a})
        nodes = batch(1, {0: a, 1: b})  # partition 1 moves to node B
        assert nodes[0]["held"] == [0, 1] and nodes[1]["held"] == [1]
        assert coord.releases() == {where_a: (1,)}
        nodes = batch(2, {0: a, 1: b})
        assert nodes[0]["released"] == [1] and nodes[0]["held"] == [0]
        assert coord.releases() == {} and coord.locations() == {0: where_a, 1: where_b}
        with Client(a.socket) as c:
            assert c.stats()["registry"]["released"] == 1
        batch(3, {0: a, 1: a})  # back on A: partition 1 reloads from its files


def test_open_partition_store_commits_or_aborts(daemon, tmp_path):
    root = f"file://{tmp_path}/low"
    refs: list = []
    with open_partition_store(root, "low", 3, 0, socket_path=daemon.socket, result=refs) as h:
        h.put_many([(b"\x00\x01k", b"v")])
    assert refs[0].version == 1
    with pytest.raises(ZeroDivisionError), \
            open_partition_store(root, "low", 3, 1, refs[0].ckptid, socket_path=daemon.socket, result=refs) as h:
        h.put_many([(b"\x00\x01k", b"changed")])
        raise ZeroDivisionError("the task's code fails before the commit")
    assert len(refs) == 1
    c = placement.connect(daemon.socket)
    with c.open(StoreId(root, "low", 3), 1, refs[0].ckptid) as h:
        assert h.get(b"\x00\x01k") == b"v"  # the aborted change is gone; version 1 opens again


def _connect_and_report(path, q):
    q.put(placement.daemon_pid(placement.connect(path).socket_path))


def test_autostart_is_race_free(tmp_path):
    import tempfile

    folder = tempfile.mkdtemp(prefix="ssp-", dir="/tmp")
    path = f"{folder}/d.sock"
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_connect_and_report, args=(path, q)) for _ in range(4)]
    try:
        for p in procs:
            p.start()
        pids = {q.get(timeout=60) for _ in procs}
        for p in procs:
            p.join(30)
        assert len(pids) == 1 and None not in pids  # four racing clients, one daemon
    finally:
        placement.stop_daemon(path)
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
    with pytest.raises(placement.DaemonUnavailableError):
        placement.connect(path, autostart=False)


def test_an_autostarted_daemon_exits_once_idle(sockdir):
    """A daemon a task starts goes away when no client has been connected for a while (600 s by
    default, ``STATESTORE_EXIT_WHEN_IDLE`` otherwise), so it does not outlive the application forever;
    while a client is connected it stays. Timed from the daemon's own clock and from the moment the
    last client left, so a busy machine only makes it slower."""
    import time

    idle = 3.0
    quick, default = f"{sockdir}/q/d.sock", f"{sockdir}/p/d.sock"
    try:
        # the default one first: starting a daemon takes seconds on a busy machine, which must not
        # count against the quick one's idle limit
        placement.start_daemon(default)
        with open(f"/proc/{placement.daemon_pid(default)}/environ", "rb") as f:
            assert f"STATESTORE_EXIT_WHEN_IDLE={placement.AUTOSTART_EXIT_WHEN_IDLE}".encode() in f.read().split(b"\0")
        placement.start_daemon(quick, env={"STATESTORE_EXIT_WHEN_IDLE": str(idle)})
        c = Client(quick)
        try:
            pid = c.stats()["daemon"]["pid"]
            connected = c.stats()["daemon"]["uptime"]  # the daemon's clock, a client connected from here on
            deadline = time.monotonic() + 120
            while c.stats()["daemon"]["uptime"] < connected + idle + 1.0:  # well past the idle limit, connected
                assert time.monotonic() < deadline, "the daemon's clock did not advance"
                time.sleep(0.05)
            assert c.ping() == b"" and os.path.exists(quick)  # a client is connected: it stays
            left = time.monotonic()  # (taken before the close: the daemon counts from a later moment)
        finally:
            c.close()
        deadline = left + idle + 60
        # (watched without connecting: a connection is a client, and would keep it)
        while os.path.exists(f"/proc/{pid}") and not placement._zombie(pid):
            assert time.monotonic() < deadline, "the idle daemon did not exit"
            time.sleep(0.05)
        assert time.monotonic() - left >= idle  # not before its idle limit ran out after the last client left
        assert not os.path.exists(quick)
        assert placement.daemon_pid(default) is not None
    finally:
        placement.stop_daemon(quick)
        placement.stop_daemon(default)


def test_the_driver_keeps_one_object_store_on_one_loop():
    """The operator's manifest reads, fence and manifest writes share one store on one I/O thread,
    whichever thread calls; errors reach the caller; close() and collection close the store."""
    import gc
    import threading

    from statestore_async.spark.driver.driverio import DriverIO

    opened = []

    class Store:
        closed = False

        async def where(self):
            return threading.get_ident()

        async def close(self):
            self.closed = True

    def open_store():
        opened.append(Store())
        return opened[-1]

    driver_io = DriverIO(open_store)
    seen = [driver_io.run(lambda store: store.where())]
    t = threading.Thread(target=lambda: seen.append(driver_io.run(lambda store: store.where())))
    t.start()
    t.join()
    assert len(opened) == 1 and seen[0] == seen[1] != threading.get_ident()

    async def fail(store):
        raise errors.VersionNotFoundError("no manifest")

    with pytest.raises(errors.VersionNotFoundError):
        driver_io.run(fail)
    driver_io.close()
    assert opened[0].closed
    driver_io.run(lambda store: store.where())
    assert len(opened) == 2
    driver_io = None  # the last reference goes: collection closes the store
    gc.collect()
    assert opened[1].closed


def test_operator_arguments_are_checked(tmp_path):
    with pytest.raises(errors.InterfaceError, match="StatefulProcessor"):
        StatefulOperator(str(tmp_path), "op", ["k"], object(), OUT, 2)
    with pytest.raises(errors.InterfaceError, match="num_key_groups"):
        StatefulOperator(str(tmp_path), "op", ["k"], CountSum(), OUT, 8, 4)
    with pytest.raises(errors.InterfaceError, match="operator_id"):
        StatefulOperator(str(tmp_path), "bad/id", ["k"], CountSum(), OUT, 2)
    with pytest.raises(errors.InterfaceError, match="materialize"):
        StatefulOperator(str(tmp_path), "op", ["k"], CountSum(), OUT, 2, materialize="disk")


class _Runs(CountSum):
    """CountSum that appends a line to ``path`` each time a task runs it: how often the stateful
    stage ran."""

    def __init__(self, path):
        self.path = path

    def init(self, handle):
        from pyspark import TaskContext

        if TaskContext.get() is not None:  # not the operator's check of the declarations, on the driver
            with open(self.path, "a") as f:
                f.write("run\n")
        super().init(handle)


@pytest.mark.spark
@pytest.mark.parametrize("materialize", ["checkpoint", "cache", "output_path"])
def test_output_is_computed_once_and_released(spark, daemon, tmp_path, materialize):
    """Whichever way the output waits for the sink, the stateful stage runs once per partition and
    batch however often the sink reads it, and nothing of the output is left in Spark afterwards."""
    from pyspark import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    runs = tmp_path / "runs"
    kw = {"output_path": str(tmp_path / "out")} if materialize == "output_path" else {"materialize": materialize}
    op = StatefulOperator(f"file://{tmp_path}/s", "once", ["key"], _Runs(str(runs)), OUT, 2, 16,
                          socket_path=daemon.socket, **kw)
    seen = {}

    def sink(df, b):
        assert df.count() == 7
        seen[b] = sorted(tuple(r) for r in df.collect())

    storage = spark.sparkContext._jsc.sc()
    cached = {i.id() for i in storage.getRDDStorageInfo()}
    for b in range(2):
        df = spark.createDataFrame([(f"k{i % 7}", i) for i in range(70)], "key string, value bigint")
        op.process_batch(df, b, sink)
    assert seen[1] == [(f"k{j}", 20, 2 * sum(range(j, 70, 7))) for j in range(7)]
    assert runs.read_text().count("run") == 2 * 2  # 2 partitions x 2 batches, none re-run by the sink
    assert {i.id() for i in storage.getRDDStorageInfo()} <= cached
    if materialize == "output_path":
        assert not list((tmp_path / "out").iterdir())


@pytest.mark.spark
def test_the_stateful_stage_runs_without_sparks_per_row_arrow_byte_check_unless_asked(spark, daemon, tmp_path):
    """spark.sql.execution.arrow.maxBytesPerBatch while the stage runs (seen from a
    materialize="none" sink, which runs inside it) and after (from a "checkpoint" sink, which runs
    after it): no byte cap by default, the session's own when it sets one, the operator's when given;
    the session's setting is as before once the batch is over. A cap of one byte (an Arrow batch per
    row) gives the same state and output."""
    from statestore_async.spark.driver.materialize import ARROW_BYTES_UNLIMITED, ARROW_MAX_BYTES_KEY

    def run(name, materialize, **kw):
        op = StatefulOperator(f"file://{tmp_path}/{name}", name, ["key"], CountSum(), OUT, 2, 16,
                              socket_path=daemon.socket, materialize=materialize, **kw)
        seen = {}

        def sink(df, b):
            seen["cap"] = spark.conf.get(ARROW_MAX_BYTES_KEY, None)
            seen["rows"] = sorted(tuple(r) for r in df.collect())

        for b in range(2):
            op.process_batch(spark.createDataFrame([(f"k{i % 7}", i) for i in range(70)], "key string, value bigint"),
                             b, sink)
        return seen

    expected = [(f"k{j}", 20, 2 * sum(range(j, 70, 7))) for j in range(7)]
    assert spark.conf.get(ARROW_MAX_BYTES_KEY, None) is None
    assert run("a", "none") == {"cap": str(ARROW_BYTES_UNLIMITED), "rows": expected}
    assert spark.conf.get(ARROW_MAX_BYTES_KEY, None) is None
    assert run("b", "checkpoint") == {"cap": None, "rows": expected}
    assert run("c", "none", arrow_max_bytes_per_batch=1) == {"cap": "1", "rows": expected}
    spark.conf.set(ARROW_MAX_BYTES_KEY, "1048576")
    try:
        assert run("d", "none")["cap"] == "1048576"
        assert run("e", "none", arrow_max_bytes_per_batch=4096)["cap"] == "4096"
        assert run("f", "checkpoint", arrow_max_bytes_per_batch=4096)["cap"] == "1048576"
        assert spark.conf.get(ARROW_MAX_BYTES_KEY) == "1048576"
    finally:
        spark.conf.unset(ARROW_MAX_BYTES_KEY)
    for bad in (0, -1, True, 1.5, ARROW_BYTES_UNLIMITED + 1):
        with pytest.raises(errors.InterfaceError, match="arrow_max_bytes_per_batch"):
            StatefulOperator(str(tmp_path), "op", ["k"], CountSum(), OUT, 2, arrow_max_bytes_per_batch=bad)


def test_an_operator_has_no_hook_until_test_support_arms_one(tmp_path):
    """Without an armed fault every hook point is a no-op (no hook, and no fault parameter on the
    operator); ``statestore_async.testing.faults.arm`` installs a hook that pickles by reference
    (Spark's workers import it) and fires only where armed; arming nothing removes it."""
    import inspect
    import pickle

    from pyspark import cloudpickle
    from pyspark.sql.types import LongType, StringType, StructField, StructType

    from statestore_async.spark.shared import hooks
    from statestore_async.testing import faults
    from statestore_async.testing.faults import FaultSite, InjectedFault

    assert not any("fault" in p for p in inspect.signature(StatefulOperator).parameters)
    out = StructType([StructField("key", StringType()), StructField("count", LongType()), StructField("sum", LongType())])
    fault = {"point": "after_commit", "batch": 1, "partition": 0, "action": "fail"}
    op = StatefulOperator(str(tmp_path), "f", ["key"], CountSum(), out, 2)
    assert hooks.installed(op) is None
    hook = lambda site: None
    assert faults.arm(op, hook) is hook and hooks.installed(op) is hook  # a hook of one's own
    faults.arm(op, [fault])
    plan = pickle.loads(cloudpickle.dumps(hooks.installed(op)))
    assert type(plan) is faults.FaultPlan
    plan(FaultSite("after_commit", 1, 1, 0))  # another partition
    plan(FaultSite("after_commit", 1, 0, 1))  # another attempt
    with pytest.raises(InjectedFault, match="after_commit of batch 1 partition 0"):
        plan(FaultSite("after_commit", 1, 0, 0))
    assert faults.arm(op, []) is None and hooks.installed(op) is None
    assert hooks.installed(StatefulOperator(str(tmp_path), "g", ["key"], CountSum(), out, 2)) is None


@pytest.mark.spark
def test_materialize_auto_is_checkpoint_in_local_mode(spark, tmp_path):
    assert StatefulOperator(str(tmp_path), "m", ["k"], CountSum(), OUT, 2).materialize_mode(spark) == "checkpoint"
    assert StatefulOperator(str(tmp_path), "m", ["k"], CountSum(), OUT, 2,
                            materialize="cache").materialize_mode(spark) == "cache"


@pytest.mark.spark
def test_pre_aggregation_adds_no_shuffle_to_the_routing(spark, tmp_path):
    """With ``pre_aggregate`` the JVM's groupBy runs on the routing shuffle's partitions: the batch
    is shuffled once (a groupBy before the routing would shuffle it twice)."""
    from pyspark.sql import functions as F

    from statestore_async.spark.api.examples import PreAggregatedCountSum
    from statestore_async.spark.shared.routing import ROUTE_COLUMN

    df = spark.createDataFrame([(f"k{i % 7}", i) for i in range(50)], "key string, value bigint")
    op = StatefulOperator(str(tmp_path), "pre", ["key"], PreAggregatedCountSum(), OUT, 2,
                          pre_aggregate=[F.count("*").alias("n"), F.sum("value").alias("s")])
    routed, values = op.routed(df)
    assert values == ("n", "s")
    plan = routed._jdf.queryExecution().executedPlan().toString()
    assert plan.count("Exchange ") == 1 and f"hashpartitioning({ROUTE_COLUMN}" in plan, plan
    rows = routed.collect()
    assert sorted((r.key, r.n, r.s) for r in rows) == sorted(
        (f"k{j}", len(range(j, 50, 7)), sum(range(j, 50, 7))) for j in range(7))


class _Streak(VectorizedProcessor):
    """Per key (last value as text, running count, a flag, a float): the state is dropped once a
    key has been seen 3 times or more (``valid`` False)."""

    state_name = "streak"
    state_schema = pa.schema([("last", pa.string()), ("n", pa.int32()), ("odd", pa.bool_()), ("avg", pa.float64())])

    def process(self, keys, rows, offsets, state, exists):
        counts = np.diff(offsets)
        values = rows.column(0).to_numpy()
        last = values[offsets[1:] - 1]
        n = state.column("n").fill_null(0).to_numpy(zero_copy_only=False) + counts
        old_avg = state.column("avg").fill_null(0.0).to_numpy(zero_copy_only=False)
        sums = np.add.reduceat(values, offsets[:-1])
        avg = (old_avg * (n - counts) + sums) / n
        new = pa.table({"last": pa.array([f"v{x}" for x in last.tolist()]), "n": pa.array(n, pa.int32()),
                        "odd": pa.array(n % 2 == 1), "avg": pa.array(avg)})
        out = pa.table({"key": keys.column(0), "n": pa.array(n, pa.int64())})
        return new, out, n < 3


def test_vectorized_state_of_several_types_and_removal(daemon, tmp_path):
    """A vectorized processor's state of string/int32/bool/float columns round-trips through the
    store (Arrow all the way), and rows it marks invalid are removed, or never written."""
    root = f"file://{tmp_path}/s"

    def batch(version, refs, rows):
        keys = [k for k, _ in rows]
        kg = sparkhash.key_groups(sparkhash.hash_rows([(k,) for k in keys], ["string"]), 64).astype(np.int32)
        t = pa.table({"key": keys, "value": pa.array([v for _, v in rows], pa.int64()), KG_COLUMN: pa.array(kg)})
        spec = TaskSpec(root=root, operator_id="streak", key_columns=("key",), value_columns=("value",),
                        output_schema=pa.schema([("key", pa.string()), ("n", pa.int64())]), num_partitions=1,
                        num_key_groups=64, batch_id=version, refs=refs, now_ms=0, socket_path=daemon.socket)
        got = []
        out = run_partition(_Streak(), spec, 0, 0, t.to_batches(), lambda r: got.append(r.ref))
        return dict(zip(out.column("key").to_pylist(), out.column("n").to_pylist())), got[0]

    def stored(ref):
        from statestore_async.codecs import valuecodec

        with Client(daemon.socket) as c:
            h = c.open(StoreId(root, "streak", 0), ref.version, ref.ckptid)
            try:
                return {valuecodec.decode_row(k[2:])[1]: valuecodec.decode_row(v) for k, v in h.scan()}
            finally:
                h.abort()

    out, ref = batch(0, (EMPTY_STATE,), [("a", 1), ("a", 2), ("a", 3), ("b", 4), ("c", 5), ("c", 7)])
    assert out == {"a": 3, "b": 1, "c": 2}
    state = stored(ref)
    assert state == {"b": ("v4", 1, True, 4.0), "c": ("v7", 2, False, 6.0)}  # 'a' reached 3: never written
    out, ref = batch(1, (ref,), [("b", 10), ("c", 9), ("d", 1)])
    assert out == {"b": 2, "c": 3, "d": 1}
    state = stored(ref)
    assert state == {"b": ("v10", 2, False, 7.0), "d": ("v1", 1, True, 1.0)}  # 'c' removed
