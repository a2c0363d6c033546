"""The per-key path's batched internals (no Spark): state decoded for the whole partition up front,
reads and writes as subscripts of per-batch lists, changes and output built in columns, automatic
garbage collection paused around the loop. Checked against a plain model of the documented
semantics over several batches through ``run_partition`` and a real daemon."""
from __future__ import annotations

import gc
import random

import numpy as np
import pyarrow as pa
import pytest
from spark_cluster import Daemon

from statestore_async import errors
from statestore_async.client.clients import Client
from statestore_async.codecs import sparkhash, valuecodec
from statestore_async.ids import EMPTY_STATE, StoreId
from statestore_async.spark import StatefulProcessor
from statestore_async.spark.api.processors import StateHandle
from statestore_async.spark.shared.routing import KG_COLUMN
from statestore_async.spark.shared.taskspec import TaskSpec
from statestore_async.spark.task.grouping import store_keys
from statestore_async.spark.task.output import output_table
from statestore_async.spark.task.partition import run_partition
from statestore_async.spark.task.perkey import _call_per_key

G = 8
TTL_MS = 1000


@pytest.fixture(scope="module")
def daemon():
    with Daemon() as d:
        yield d


def _bound(handle: StateHandle, raw: list, now: int = 0) -> None:
    for v in handle.variables.values():
        v.begin_batch(pa.array(raw, pa.binary()), now)
        v.bind_keys()


def test_state_variables_read_and_write_the_bound_key():
    h = StateHandle()
    val, lst, mp = h.value_state("v"), h.list_state("l"), h.map_state("m")
    enc = valuecodec.encode_row
    for v, raw in ((val, [enc((1, 2)), None, enc(7)]), (lst, [enc([1]), enc([2, 3]), None]),
                   (mp, [enc({"a": 1}), None, enc({"b": 2})])):
        v.begin_batch(pa.array(raw, pa.binary()), 0)
        v.bind_keys()
    keys = pa.array([b"k0", b"k1", b"k2"], pa.binary())

    def at(i):
        for v in (val, lst, mp):
            v.key_index = i

    at(0)
    assert val.get() == (1, 2) and lst.get() == [1] and mp.get("a") == 1 and val.exists()
    val.update((2, 4))
    lst.append(5)
    lst.get().append(99)  # a copy: not stored
    mp.remove("a")  # the map is now empty: removed
    assert val.get() == (2, 4) and lst.get() == [1, 5] and not mp.exists()
    at(1)
    assert val.get() is None and not val.exists() and lst.get() == [2, 3] and mp.items() == []
    val.clear()  # nothing stored: nothing to remove
    lst.put([])  # removed
    mp.update("x", 1)
    at(2)
    val.clear()
    lst.extend([])  # an empty list is not stored (and there was none)
    assert lst.exists() and lst.get() == []
    for v in (val, lst, mp):
        v.unbind_keys()
    with pytest.raises(errors.InterfaceError, match="outside handle_rows"):
        val.get()
    with pytest.raises(errors.InterfaceError, match="outside handle_rows"):
        lst.append(1)

    def changes(v):
        pk, pv, rm = v.batch_changes(keys)
        return dict(zip(pk.to_pylist(), map(valuecodec.decode_row, pv.to_pylist()))), rm.to_pylist()

    assert changes(val) == ({b"k0": (2, 4)}, [b"k2"])
    assert changes(lst) == ({b"k0": [1, 5]}, [b"k1"])
    assert changes(mp) == ({b"k1": {"x": 1}}, [b"k0"])


def test_ttl_values_expire_and_expired_leftovers_of_the_batch_are_removed():
    h = StateHandle()
    v = h.value_state("v", ttl_ms=TTL_MS)
    enc = valuecodec.encode_row
    _bound(h, [enc((500, "old")), enc((2000, "live")), enc((900, "stale")), None], now=1000)
    seen = []
    for i in range(4):
        v.key_index = i
        seen.append(v.get())
    v.key_index = 0
    v.update("new")  # refreshed expiry
    v.unbind_keys()
    pk, pv, rm = v.batch_changes(pa.array([b"a", b"b", b"c", b"d"], pa.binary()))
    assert seen == [None, "live", None, None]
    assert pk.to_pylist() == [b"a"] and [valuecodec.decode_row(x) for x in pv.to_pylist()] == [(2000, "new")]
    assert rm.to_pylist() == [b"c"]  # expired, untouched: removed; 'a' was rewritten


class _Rows(StatefulProcessor):
    def __init__(self, kind):
        self.kind = kind
        self.buf = []

    def init(self, handle):
        self.n = handle.value_state("n")

    def handle_rows(self, key, rows, state):
        self.n.update(len(rows))
        if self.kind == "generator":
            return ((key[0], self.n.get()) for _ in rows)  # drained while the key is bound
        if self.kind == "reused list":
            self.buf.clear()
            self.buf.append((key[0], len(rows)))
            return self.buf
        if self.kind == "none":
            return None
        return {"key": key[0]}


@pytest.mark.parametrize("kind", ["generator", "reused list", "none", "dict"])
def test_what_handle_rows_returns(kind):
    p = _Rows(kind)
    h = StateHandle()
    p.init(h)
    _bound(h, [None, None])
    variables = list(h.variables.values())
    for v in variables:
        v.unbind_keys()
    keys, rows, off = [("a",), ("b",)], [(1,), (2,), (3,)], [0, 2, 3]
    if kind == "dict":
        with pytest.raises(errors.OutputRowError, match=r"returned a dict for key \('a',\)"):
            _call_per_key(p, variables, keys, rows, off)
        return
    got = [list(r) for r in _call_per_key(p, variables, keys, rows, off)]
    assert got == {"generator": [[("a", 2), ("a", 2)], [("b", 1)]], "reused list": [[("a", 2)], [("b", 1)]],
                   "none": [[], []]}[kind]
    with pytest.raises(errors.InterfaceError, match="outside handle_rows"):
        p.n.get()


def test_output_rows_name_their_key_when_they_do_not_fit():
    schema = pa.schema([("key", pa.string()), ("n", pa.int64())])
    per_key = [(("a", 1),), (), (("c", 2), ("c", 3))]
    out = [r for rows in per_key for r in rows]
    assert output_table(out, schema, [("a",), ("b",), ("c",)], per_key=per_key).to_pylist() == [
        {"key": "a", "n": 1}, {"key": "c", "n": 2}, {"key": "c", "n": 3}]
    for bad, word in ((("c", 2.5), "2.5 of key \\('c',\\)"), (("c",), "output rows have 1 values"),
                      (("c", 1, 2), "output rows have 3 values"), (("c", True), "bool")):
        rows = [(("a", 1),), (), (("c", 2), bad)]
        with pytest.raises(errors.OutputRowError, match=word):
            output_table([r for k in rows for r in k], schema, [("a",), ("b",), ("c",)], per_key=rows)


class _Script(StatefulProcessor):
    """Each row's value is an operation on the key's state (see ``_model``)."""

    def init(self, handle):
        self.v = handle.value_state("v", ttl_ms=TTL_MS)
        self.l = handle.list_state("l")
        self.m = handle.map_state("m")

    def handle_rows(self, key, rows, state):
        for (op,) in rows:
            if op == 0:
                self.v.update((self.v.get() or 0) + 1)
            elif op == 1:
                self.v.clear()
            elif op == 2:
                state.l.append(len(self.l.get()))
            elif op == 3:
                state["l"].put([])
            elif op == 4:
                self.m.update(op % 3, len(self.m.items()))
            elif op == 5:
                self.m.remove(1)
            else:
                self.l.extend([])
        yield (key[0], self.v.get(), len(self.l.get()), repr(sorted(self.m.items())))


def _model(store: dict, key: str, ops: list[int], now: int) -> tuple:
    """What ``_Script`` does, on ``store``: {(state, key): stored value} (the TTL'd one as (expires, value))."""
    raw = store.get(("v", key))
    v = raw[1] if raw is not None and raw[0] > now else None
    lst, mp = list(store.get(("l", key), [])), dict(store.get(("m", key), {}))
    v_written = False
    for op in ops:
        if op == 0:
            v, v_written = (v or 0) + 1, True
        elif op == 1:
            v, v_written = None, True
        elif op == 2:
            lst.append(len(lst))
        elif op == 3:
            lst = []
        elif op == 4:
            mp[op % 3] = len(mp)
        elif op == 5:
            mp.pop(1, None)
    if v_written and v is not None:
        store[("v", key)] = (now + TTL_MS, v)
    elif v_written or (raw is not None and raw[0] <= now):  # cleared, or expired and untouched: removed
        store.pop(("v", key), None)
    for name, value in (("l", lst), ("m", mp)):
        if value:
            store[(name, key)] = value
        else:
            store.pop((name, key), None)
    return (key, v, len(lst), repr(sorted(mp.items())))


def test_run_partition_matches_a_model_of_the_semantics_over_batches(daemon, tmp_path):
    rnd = random.Random(7)
    names = [f"k{i}" for i in range(60)]
    kg_of = dict(zip(names, sparkhash.key_groups(sparkhash.hash_rows([(k,) for k in names], ["string"]), G).tolist()))
    root = f"file://{tmp_path}/s"
    schema = pa.schema([("key", pa.string()), ("v", pa.int64()), ("l", pa.int64()), ("m", pa.string())])
    store: dict = {}
    ref = EMPTY_STATE
    for b in range(6):
        now = b * 600
        rows = [(rnd.choice(names), rnd.choice([0, 0, 0, 1, 2, 2, 3, 4, 5, 6])) for _ in range(150)]
        by_key: dict = {}
        for k, op in rows:
            by_key.setdefault(k, []).append(op)
        # TTL cleanup: each batch removes the values expired by its clock, touched or not
        for (n_, k_), val in list(store.items()):
            if n_ == "v" and k_ not in by_key and val[0] <= now:
                del store[(n_, k_)]
        expected = {k: _model(store, k, ops, now) for k, ops in by_key.items()}
        t = pa.table({"key": [k for k, _ in rows], "op": pa.array([op for _, op in rows], pa.int64()),
                      KG_COLUMN: pa.array([kg_of[k] for k, _ in rows], pa.int32())})
        spec = TaskSpec(root=root, operator_id="op", key_columns=("key",), value_columns=("op",), output_schema=schema,
                        num_partitions=1, num_key_groups=G, batch_id=b, refs=(ref,), now_ms=now,
                        socket_path=daemon.socket)
        reports: list = []
        gc.enable()
        out = run_partition(_Script(), spec, 0, 0, t.to_batches(), reports.append)
        assert gc.isenabled()
        ref = reports[0].ref
        assert {r["key"]: tuple(r.values()) for r in out.to_pylist()} == expected
        assert sorted(r["key"] for r in out.to_pylist()) == sorted(by_key)  # one row per key, in any order
        with Client(daemon.socket) as client:
            handle = client.open(StoreId(root, "op", 0), ref.version, ref.ckptid)
            try:
                for name in ("v", "l", "m"):
                    skeys = store_keys(name, [(k,) for k in names], [kg_of[k] for k in names], G)
                    got = {k: valuecodec.decode_row(x) for k, x in zip(names, handle.get_many(skeys)) if x is not None}
                    assert got == {k: val for (n, k), val in store.items() if n == name}, (b, name)
            finally:
                handle.abort()


def test_gc_stays_off_when_it_was_off(daemon, tmp_path):
    t = pa.table({"key": ["a"], "op": pa.array([0], pa.int64()), KG_COLUMN: pa.array([0], pa.int32())})
    spec = TaskSpec(root=f"file://{tmp_path}/s", operator_id="op", key_columns=("key",), value_columns=("op",),
                    output_schema=pa.schema([("key", pa.string()), ("v", pa.int64()), ("l", pa.int64()),
                                             ("m", pa.string())]),
                    num_partitions=1, num_key_groups=G, batch_id=0, refs=(EMPTY_STATE,), now_ms=0,
                    socket_path=daemon.socket)
    gc.disable()
    try:
        assert run_partition(_Script(), spec, 0, 0, t.to_batches()).to_pylist() == [
            {"key": "a", "v": 1, "l": 0, "m": "[]"}]
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_handle_rows_error_leaves_gc_on_and_the_state_unbound(daemon, tmp_path):
    class Boom(StatefulProcessor):
        def init(self, handle):
            self.v = handle.value_state("v")

        def handle_rows(self, key, rows, state):
            raise ValueError(f"boom {key}")

    p = Boom()
    t = pa.table({"key": ["a"], "op": pa.array([0], pa.int64()), KG_COLUMN: pa.array([0], pa.int32())})
    spec = TaskSpec(root=f"file://{tmp_path}/s", operator_id="op", key_columns=("key",), value_columns=("op",),
                    output_schema=pa.schema([("key", pa.string())]), num_partitions=1, num_key_groups=G, batch_id=0,
                    refs=(EMPTY_STATE,), now_ms=0, socket_path=daemon.socket)
    with pytest.raises(ValueError, match="boom"):
        run_partition(p, spec, 0, 0, t.to_batches())
    assert gc.isenabled()
    with pytest.raises(errors.InterfaceError, match="outside handle_rows"):
        p.v.update(1)


def test_many_keys_with_some_absent():
    """The decode of a partition where some keys have state and some have none keeps each key's slot."""
    h = StateHandle()
    v = h.value_state("v")
    n = 1000
    present = np.random.default_rng(3).random(n) < 0.6
    raw = [valuecodec.encode_row((i, str(i))) if p else None for i, p in enumerate(present)]
    _bound(h, raw)
    for i in range(n):
        v.key_index = i
        assert v.get() == ((i, str(i)) if present[i] else None)
        if i % 3 == 0:
            v.update((i, "x"))
        elif i % 3 == 1:
            v.clear()
    v.unbind_keys()
    keys = pa.array([b"%d" % i for i in range(n)], pa.binary())
    pk, pv, rm = v.batch_changes(keys)
    assert pk.to_pylist() == [b"%d" % i for i in range(0, n, 3)]
    assert [valuecodec.decode_row(x) for x in pv.to_pylist()] == [(i, "x") for i in range(0, n, 3)]
    assert rm.to_pylist() == [b"%d" % i for i in range(1, n, 3) if present[i]]
