"""The state reader and the change feed on checkpoints written by the real Spark operator: a per-key
processor with value / list / map state, whole-value and per-entry TTLs, and a vectorized one.

The oracle of the reader is the processor itself: a last batch has every key report what its state
variables hold (``get()`` at that batch's clock), and ``read_state`` of the version before, at that
clock, must hold exactly that. The oracle of the change feed: the changes from v to w applied to
the state at v give the state at w."""
from __future__ import annotations

import json
import sys

import pyarrow as pa
import pytest
from spark_cluster import Daemon

from statestore_async import errors
from statestore_async.spark import StatefulOperator, StatefulProcessor, load_state
from statestore_async.spark.api.examples import VectorizedCountSum
from statestore_async.state.changes import load_changes_table, read_changes
from statestore_async.state.reader import load_state_table, read_metadata, read_state

TTL_MS = 2500
OUT = "user string, shard bigint, view string"
# the clock of batch b (seconds); the report batch runs at REPORT_AT
CLOCK = [1000.0, 1001.0, 1002.0, 1003.0]
REPORT_AT = 1004.0


class Profile(StatefulProcessor):
    """Every kind of state variable. A row with a negative value only reports the key's view."""

    def init(self, handle):
        self.last = handle.value_state("last", ttl_ms=TTL_MS)       # a TTL for the whole value
        self.seen = handle.list_state("seen", ttl_ms=TTL_MS)        # a TTL per entry
        self.tags = handle.map_state("tags", ttl_ms=TTL_MS)         # a TTL per entry
        self.hist = handle.map_state("hist")
        self.total = handle.value_state("total")
        self.names = handle.list_state("names")

    def handle_rows(self, key, rows, state):
        values = [v for (v,) in rows]
        if all(v >= 0 for v in values):
            count, total = self.total.get() or (0, 0)
            self.total.update((count + len(values), total + sum(values)))
            for v in values:
                self.seen.append(v)
                self.tags.update(f"t{v % 4}", v * 1.5)
                self.hist.update(v % 3, self.hist.get(v % 3, 0) + 1)
                if v % 5 == 0:
                    self.names.append(f"n{v}")
            self.last.update(max(values))
            if len(self.seen.get()) > 5:
                self.seen.clear()
            if self.hist.contains(2) and self.hist.get(2) > 2:
                self.hist.remove(2)
        view = {"last": self.last.get(), "seen": self.seen.get(), "tags": sorted(self.tags.items()),
                "hist": sorted(self.hist.items()), "total": self.total.get(), "names": self.names.get()}
        yield (key[0], key[1], json.dumps(view))


def batches():
    """Four batches of (user, shard, value); some keys skip batches, so TTLs expire unevenly."""
    out = []
    for b in range(4):
        rows = []
        for u in range(12):
            if (u + b) % 3 == 0:
                continue
            for s in range(2):
                rows += [(f"u{u}", s, (u * 7 + b * 3 + s + i) % 23) for i in range(1 + (u + s) % 3)]
        out.append(rows)
    return out


SCHEMA = "user string, shard int, value bigint"  # shard: an int key column reads back as int


def build_profile(spark, root, socket, s3_options=None, report=True):
    """Run the four batches (and, with ``report``, the report batch); the report's views by key."""
    from pyspark import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    now = [CLOCK[0]]
    op = StatefulOperator(root, "profile", ["user", "shard"], Profile(), OUT, 3, 16, socket_path=socket,
                          clock=lambda: now[0], s3_options=s3_options)
    data = batches()
    for b, rows in enumerate(data):
        now[0] = CLOCK[b]
        op.process_batch(spark.createDataFrame(rows, SCHEMA).coalesce(1), b, lambda df, i: None)
    views = {}
    if report:
        keys = sorted({(u, s) for rows in data for u, s, _ in rows})
        now[0] = REPORT_AT
        out = {}
        op.process_batch(spark.createDataFrame([(u, s, -1) for u, s in keys], SCHEMA).coalesce(1), len(data),
                         lambda df, i: out.update({(r.user, r.shard): json.loads(r.view) for r in df.collect()}))
        views = out
    op.close()
    return views


@pytest.fixture(scope="module")
def daemon():
    with Daemon() as d:
        yield d


@pytest.fixture(scope="module")
def profile(spark, daemon, tmp_path_factory):
    """A checkpoint of ``Profile`` (manifests 1..5; 5 is after the report batch) and the report."""
    root = f"file://{tmp_path_factory.mktemp('profile')}/state"
    views = build_profile(spark, root, daemon.socket)
    return root, views


def _norm(value):
    """A reader value in the processor's JSON form: structs (Rows, tuples) and lists as lists,
    maps as sorted [key, value] pairs."""
    if value is None:
        return None
    if isinstance(value, dict):
        return sorted([_norm(k), _norm(v)] for k, v in value.items())
    if isinstance(value, list) and value and all(type(x) is tuple and len(x) == 2 for x in value):
        return sorted([_norm(k), _norm(v)] for k, v in value)  # an Arrow map's to_pylist form
    if isinstance(value, (list, tuple)):
        return [_norm(v) for v in value]
    return value


def _views_of(rows):
    empty = {"last": None, "seen": [], "tags": [], "hist": [], "total": None, "names": []}
    out = {}
    for r in rows:
        d = r.asDict() if hasattr(r, "asDict") else r
        view = {k: (_norm(d[k]) if d[k] is not None else empty[k]) for k in empty}
        out[(d["user"], d["shard"])] = view
    return out


@pytest.mark.spark
def test_read_state_typed_columns_equal_the_processors_view(spark, profile):
    root, views = profile
    df = read_state(spark, root, "profile", version=4, now_ms=int(REPORT_AT * 1000))
    fields = {f.name: f.dataType.simpleString() for f in df.schema.fields}
    assert fields == {
        "partition": "int", "key_group": "int", "user": "string", "shard": "int",
        "hist": "map<bigint,bigint>", "last": "bigint", "last_expires_ms": "bigint",
        "names": "array<string>", "seen": "array<bigint>", "seen_expires_ms": "array<bigint>",
        "tags": "map<string,double>", "tags_expires_ms": "map<string,bigint>",
        "total": "struct<_1:bigint,_2:bigint>"}
    rows = df.collect()
    live = {k: v for k, v in views.items() if v != {"last": None, "seen": [], "tags": [], "hist": [], "total": None,
                                                    "names": []}}
    assert _views_of(rows) == live
    assert {r.partition for r in rows} == {0, 1, 2} and all(r.key_group * 3 // 16 == r.partition for r in rows)
    # the expiry columns: what the store holds, entry by entry
    raw = load_state(root, "profile", 4)
    for r in rows:
        key = (r.user, r.shard)
        if r.last is not None:
            assert raw[("last", key)] == (r.last_expires_ms, r.last)
        if r.seen:
            stored = raw[("seen", key)][1]
            assert [(e, v) for e, v in stored if e > REPORT_AT * 1000] == list(zip(r.seen_expires_ms, r.seen))
    # hidden by default at the current time (long after the TTLs): no TTL'd value is left
    now_rows = read_state(spark, root, "profile", version=4).collect()
    assert all(r.last is None and r.seen is None and r.tags is None for r in now_rows)
    assert len(now_rows) == sum(1 for v in views.values() if v["total"] is not None)


@pytest.mark.spark
def test_read_state_options_state_var_partition_version_include_expired(spark, profile):
    root, _views = profile
    one = read_state(spark, root, "profile", version=2, state_var="seen", partition=1, include_expired=True)
    assert one.columns == ["partition", "key_group", "user", "shard", "seen", "seen_expires_ms"]
    rows = one.collect()
    raw = load_state(root, "profile", 2)
    expected = {k: v for (n, k), v in raw.items() if n == "seen" and k in {(r.user, r.shard) for r in rows}}
    assert rows and {r.partition for r in rows} == {1}
    assert {(r.user, r.shard): [(e, v) for e, v in zip(r.seen_expires_ms, r.seen)] for r in rows} == \
        {k: v[1] for k, v in expected.items()}
    every_seen = {k for (n, k) in raw if n == "seen"}
    by_partition = [{(r.user, r.shard) for r in read_state(spark, root, "profile", version=2, state_var="seen",
                                                           partition=p, include_expired=True).collect()}
                    for p in range(3)]
    assert set().union(*by_partition) == every_seen
    table = load_state_table(root, "profile", 2, state_var="seen", partition=1, include_expired=True)
    assert table.num_rows == len(rows) and table.column_names == one.columns
    with pytest.raises(errors.InterfaceError, match=r"state_var='nope'.*\['hist', 'last', 'names', 'seen', 'tags', 'total'\]"):
        read_state(spark, root, "profile", state_var="nope")
    with pytest.raises(errors.InterfaceError, match=r"partition 3: operator 'profile' has 3 partitions \(0..2\)"):
        read_state(spark, root, "profile", partition=3)
    with pytest.raises(errors.VersionNotFoundError, match="no manifest"):
        read_state(spark, root, "profile", version=99)


def _state_of(table: pa.Table) -> dict:
    """``{(state, key): (value, expires)}`` of a ``load_state_table`` table."""
    out = {}
    names = [c for c in table.column_names if c not in ("partition", "key_group", "user", "shard")
             and not c.endswith("_expires_ms")]
    for r in table.to_pylist():
        for n in names:
            if r[n] is not None:
                out[(n, (r["user"], r["shard"]))] = (_norm(r[n]), _norm(r.get(n + "_expires_ms")))
    return out


def _apply(state: dict, changes: pa.Table) -> dict:
    out = dict(state)
    has_ttl = "new_expires_ms" in changes.column_names
    for c in changes.to_pylist():
        k = (c["state"], (c["user"], c["shard"]))
        if c["change_type"] == "delete":
            assert k in out, k
            del out[k]
        else:
            assert (c["change_type"] == "insert") == (k not in out), (c, out.get(k))
            if c["change_type"] == "update":
                assert (_norm(c["old_value"]), _norm(c["old_expires_ms"]) if has_ttl else None) == out[k]
            out[k] = (_norm(c["new_value"]), _norm(c["new_expires_ms"]) if has_ttl else None)
    return out


@pytest.mark.spark
def test_change_feed_applied_to_state_v_gives_state_w(spark, profile):
    root, _views = profile
    states = {v: _state_of(load_state_table(root, "profile", v, include_expired=True)) for v in range(1, 6)}
    states[0] = {}  # version 0: the empty state, no manifest
    names = ["hist", "last", "names", "seen", "tags", "total"]
    for v, w in ((0, 5), (1, 3), (2, 5), (4, 5), (3, 3)):
        # one typed feed per state variable (together their values share no type: JSON)
        feeds = [load_changes_table(root, "profile", v, w, state_var=n) for n in names]
        got = {}
        for n, changes in zip(names, feeds):
            got.update(_apply({k: x for k, x in states[v].items() if k[0] == n}, changes))
            assert all(v < x <= w for x in changes.column("version").to_pylist())
        assert got == states[w], (v, w)
        mixed = load_changes_table(root, "profile", v, w)
        assert mixed.schema.field("new_value").type == pa.string()
        what = lambda ts: sorted(x for t in ts for x in zip(
            *(t.column(c).to_pylist() for c in ("state", "user", "shard", "change_type", "version"))))
        assert what([mixed]) == what(feeds)
    # the report batch wrote nothing but dropped expired entries: the lists that lost some are updates of version 5
    seen = load_changes_table(root, "profile", 4, 5, state_var="seen").to_pylist()
    assert seen and all(c["version"] == 5 and c["change_type"] == "update" for c in seen)
    assert all(len(c["new_value"]) < len(c["old_value"]) and min(c["old_expires_ms"]) <= REPORT_AT * 1000
               < min(c["new_expires_ms"]) for c in seen)
    # deltas alone: updates and deletes, no old values
    bare = load_changes_table(root, "profile", 1, 3, old_values=False)
    assert set(bare.column("change_type").to_pylist()) <= {"update", "delete"}
    assert bare.column("old_value").null_count == bare.num_rows
    # the Spark DataFrame holds the same rows
    assert _same_rows(read_changes(spark, root, "profile", 1, 3), load_changes_table(root, "profile", 1, 3))
    with pytest.raises(errors.InterfaceError, match="from an older version to a newer one"):
        load_changes_table(root, "profile", 3, 1)


def _same_rows(df, table: pa.Table) -> bool:
    key = lambda d: (d["partition"], d["version"], d["state"], d["user"], d["shard"])
    spark_rows = sorted((r.asDict(recursive=True) for r in df.collect()), key=key)
    arrow_rows = sorted(table.to_pylist(), key=key)
    return [{k: _norm(v) for k, v in d.items()} for d in spark_rows] == \
        [{k: _norm(v) for k, v in d.items()} for d in arrow_rows]


@pytest.mark.spark
def test_vectorized_state_reads_as_a_struct_and_its_changes(spark, daemon, tmp_path):
    root = f"file://{tmp_path}/state"
    op = StatefulOperator(root, "vec", ["key"], VectorizedCountSum(), "key string, count bigint, sum bigint", 2, 16,
                          socket_path=daemon.socket)
    final: dict = {}
    for b in range(3):
        rows = [(f"k{i}", i * 10 + b) for i in range(b, 20, 2)]
        op.process_batch(spark.createDataFrame(rows, "key string, value bigint"), b,
                         lambda df, i: final.update({r.key: (r["count"], r["sum"]) for r in df.collect()}))
    op.close()
    df = read_state(spark, root, "vec")
    assert [f.dataType.simpleString() for f in df.schema.fields] == ["int", "int", "string", "struct<_1:bigint,_2:bigint>"]
    assert {r.key: tuple(r.total) for r in df.collect()} == final
    changes = load_changes_table(root, "vec", 1, 3)
    assert set(changes.column("change_type").to_pylist()) == {"insert", "update"}
    got = {r["key"]: (r["new_value"]["_1"], r["new_value"]["_2"]) for r in changes.to_pylist()}
    assert {k: v for k, v in final.items() if k in got} == got


@pytest.mark.spark
def test_read_metadata_lists_operators_partitions_and_sizes(spark, profile):
    root, _views = profile
    rows = read_metadata(spark, root).collect()
    assert [(r.operator_id, r.partition) for r in rows] == [("profile", p) for p in range(3)]
    assert {(r.min_version, r.max_version, r.versions, r.num_partitions, r.num_key_groups) for r in rows} == {(1, 5, 5, 3, 16)}
    assert [(r.first_key_group, r.last_key_group) for r in rows] == [(0, 5), (6, 10), (11, 15)]
    assert all(r.state_bytes > 0 and r.bytes >= r.state_bytes and r.state_files >= 1 for r in rows)
    assert json.loads(rows[0].state_vars)["seen"] == {"kind": "list", "ttl": True, "ttl_entries": True}
