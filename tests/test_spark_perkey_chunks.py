"""The per-key loop in chunks (no Spark): every ``PER_KEY_CHUNK`` keys the output rows become Arrow
columns, a key column the rows repeat unchanged is the key array itself, and an output row that
does not fit is named by its row number in the task and its key, in whatever chunk it falls. Checked
against plain Python over several batches through ``run_partition`` and a real daemon."""
from __future__ import annotations

import random

import numpy as np
import pyarrow as pa
import pytest
from spark_cluster import Daemon

from statestore_async import errors
from statestore_async.codecs import sparkhash
from statestore_async.ids import EMPTY_STATE
from statestore_async.spark import StatefulProcessor
from statestore_async.spark.api.examples import CountSum
from statestore_async.spark.api.processors import StateHandle
from statestore_async.spark.shared.routing import KG_COLUMN
from statestore_async.spark.shared.taskspec import TaskSpec
from statestore_async.spark.task.output import output_table
from statestore_async.spark.task.partition import run_partition
from statestore_async.spark.task.perkey import PER_KEY_CHUNK, _call_per_key, _py_values, _RowColumns

G = 8
OUT = pa.schema([("key", pa.string()), ("count", pa.int64()), ("sum", pa.int64())])


@pytest.fixture(scope="module")
def daemon():
    with Daemon() as d:
        yield d


class _Counter(StatefulProcessor):
    def init(self, handle):
        self.n = handle.value_state("n")

    def handle_rows(self, key, rows, state):
        n = (self.n.get() or 0) + len(rows)
        self.n.update(n)
        return ((key[0], n),)


def test_emit_gets_each_chunk_of_keys_with_the_state_bound_per_key():
    p = _Counter()
    h = StateHandle()
    p.init(h)
    variables = list(h.variables.values())
    variables[0].begin_batch(pa.array([None] * 8, pa.binary()), 0)
    keys = [(f"k{i}",) for i in range(8)]
    rows = [(i,) for i in range(8) for _ in range(i % 3)]
    off = [0]
    for i in range(8):
        off.append(off[-1] + i % 3)
    emitted: list = []
    assert _call_per_key(p, variables, keys, rows, off, emit=lambda first, res: emitted.append((first, res)),
                         chunk=3) == []
    assert [first for first, _ in emitted] == [0, 3, 6]
    assert [r for _, res in emitted for r in res] == [((f"k{i}", i % 3),) for i in range(8)]
    # without emit: the same rows, returned
    variables[0].begin_batch(pa.array([None] * 8, pa.binary()), 0)
    assert _call_per_key(p, variables, keys, rows, off) == [((f"k{i}", i % 3),) for i in range(8)]
    with pytest.raises(errors.InterfaceError, match="outside handle_rows"):
        p.n.get()


class _Echo(StatefulProcessor):
    """Emits each key's rows as it gets them (and counts them in its state)."""

    def init(self, handle):
        self.n = handle.value_state("n")

    def handle_rows(self, key, rows, state):
        self.n.update(len(rows))
        return (key, list(rows))


@pytest.mark.parametrize("chunk", [1, 2, 3, 100])
def test_rows_given_as_columns_are_the_same_tuples_chunk_by_chunk(chunk):
    """``_RowColumns`` (values per column, tuples made per chunk of keys) hands every key the rows a
    list of tuples would, keys without rows included."""
    cols = pa.table({"x": pa.array([1, 2, None, 4, 5, 6, 7], pa.int64()), "y": pa.array([1.5, 2.5, 3.5, 4.5, -0.0,
                                                                                         float("inf"), 7.5]),
                     "s": ["a", "b", "c", None, "e", "f", "g"]})
    tuples = list(zip(*[c.to_pylist() for c in cols.columns]))
    keys = [(f"k{i}",) for i in range(5)]
    off = [0, 2, 2, 5, 6, 7]
    p = _Echo()
    h = StateHandle()
    p.init(h)
    variables = list(h.variables.values())
    got = []
    for rows in (tuples, _RowColumns([_py_values(c) for c in cols.columns])):
        variables[0].begin_batch(pa.array([None] * 5, pa.binary()), 0)
        emitted: list = []
        _call_per_key(p, variables, keys, rows, np.array(off), emit=lambda first, res: emitted.extend(res), chunk=chunk)
        got.append(emitted)
    assert got[0] == got[1] == [(keys[i], tuples[off[i]:off[i + 1]]) for i in range(5)]
    assert [type(v) for v in got[1][0][1][0]] == [int, float, str]


def test_py_values_are_to_pylist():
    for arr in (pa.array([1, -2, 2**62], pa.int64()), pa.array([3, 4], pa.uint8()), pa.array([0.5, float("nan")]),
                pa.array([1.25], pa.float32()), pa.array([1, None]), pa.array([True, False]), pa.array(["a"])):
        for col in (arr, pa.chunked_array([arr, arr])):
            got, want = _py_values(col), col.to_pylist()
            assert [type(v) for v in got] == [type(v) for v in want]
            assert repr(got) == repr(want)


def test_a_key_column_repeated_unchanged_is_the_key_array_itself():
    arr = pa.array(["ka", "kb", "kc"])
    keys = list(zip(arr.to_pylist()))
    schema = pa.schema([("key", pa.string()), ("n", pa.int64())])
    out = [(k[0], i) for i, k in enumerate(keys)]
    t = output_table(out, schema, keys, per_key=[(r,) for r in out], key_arrays=[arr])
    assert t.column(0).chunk(0).buffers()[2].address == arr.buffers()[2].address
    assert t.to_pylist() == [{"key": "ka", "n": 0}, {"key": "kb", "n": 1}, {"key": "kc", "n": 2}]
    # equal values that are other objects (a string of 2+ characters joined anew), a key with two rows,
    # another column type: converted as before
    copies = [("".join(list(k[0])), i) for i, k in enumerate(keys)]
    t = output_table(copies, schema, keys, per_key=[(r,) for r in copies], key_arrays=[arr])
    assert t.column(0).chunk(0).buffers()[2].address != arr.buffers()[2].address
    assert t.to_pylist() == [{"key": "ka", "n": 0}, {"key": "kb", "n": 1}, {"key": "kc", "n": 2}]
    two = [("ka", 0), ("ka", 1), ("kc", 2)]
    t = output_table(two, schema, keys, per_key=[two[:2], (), two[2:]], key_arrays=[arr])
    assert t.column("key").to_pylist() == ["ka", "ka", "kc"]
    large = pa.schema([("key", pa.large_string()), ("n", pa.int64())])
    t = output_table(out, large, keys, per_key=[(r,) for r in out], key_arrays=[arr])
    assert t.schema == large and t.column("key").to_pylist() == ["ka", "kb", "kc"]


class _Uneven(StatefulProcessor):
    """(count, sum) per key; keys whose number ends in 3 emit no row, those ending in 7 emit two."""

    def init(self, handle):
        self.total = handle.value_state("total")

    def handle_rows(self, key, rows, state):
        count, total = self.total.get() or (0, 0)
        count += len(rows)
        total += sum(r[0] for r in rows)
        self.total.update((count, total))
        if key[0].endswith("3"):
            return ()
        if key[0].endswith("7"):
            return ((*key, count, total), (*key, -count, -total))
        return ((*key, count, total),)


def _spec(root, batch, ref, daemon):
    return TaskSpec(root=root, operator_id="op", key_columns=("key",), value_columns=("value",), output_schema=OUT,
                    num_partitions=1, num_key_groups=G, batch_id=batch, refs=(ref,), now_ms=0,
                    socket_path=daemon.socket)


@pytest.mark.parametrize("processor", [CountSum, _Uneven])
def test_run_partition_over_several_chunks_matches_plain_python(daemon, tmp_path, processor):
    rnd = random.Random(11)
    names = [f"k{i:05d}" for i in range(3 * PER_KEY_CHUNK + 100)]
    kg_of = dict(zip(names, sparkhash.key_groups(sparkhash.hash_rows([(k,) for k in names], ["string"]), G).tolist()))
    root = f"file://{tmp_path}/s"
    totals: dict = {}
    ref = EMPTY_STATE
    for b in range(3):
        rows = [(rnd.choice(names), rnd.randrange(1000)) for _ in range(4 * len(names))]
        seen: dict = {}
        for k, v in rows:
            c, s = totals.get(k, (0, 0))
            totals[k] = seen[k] = (c + 1, s + v)
        expected = []
        for k, (c, s) in seen.items():
            if processor is CountSum or k[-1] not in "37":
                expected.append((k, c, s))
            elif k.endswith("7"):
                expected += [(k, c, s), (k, -c, -s)]
        t = pa.table({"key": [k for k, _ in rows], "value": pa.array([v for _, v in rows], pa.int64()),
                      KG_COLUMN: pa.array([kg_of[k] for k, _ in rows], pa.int32())})
        reports: list = []
        out = run_partition(processor(), _spec(root, b, ref, daemon), 0, 0, t.to_batches(max_chunksize=5000),
                            reports.append)
        ref = reports[0].ref
        assert out.schema == OUT
        assert sorted(tuple(r.values()) for r in out.to_pylist()) == sorted(expected)


class _DictFor(StatefulProcessor):
    """One row per key; the key ``bad`` gets a dict instead of a tuple."""

    def __init__(self, bad):
        self.bad = bad

    def init(self, handle):
        self.n = handle.value_state("n")

    def handle_rows(self, key, rows, state):
        self.n.update(len(rows))
        if key[0] == self.bad:
            return ({"key": key[0]},)
        return ((key[0], len(rows), 0),)


def test_a_row_that_does_not_fit_in_a_later_chunk_names_its_row_in_the_task_and_its_key(daemon, tmp_path):
    names = [f"k{i:05d}" for i in range(2 * PER_KEY_CHUNK + 10)]
    bad = PER_KEY_CHUNK + 5  # in the second chunk; one row per key, keys in the order they first come
    t = pa.table({"key": names, "value": pa.array(range(len(names)), pa.int64()),
                  KG_COLUMN: pa.array(sparkhash.key_groups(sparkhash.hash_rows([(k,) for k in names], ["string"]),
                                                           G).tolist(), pa.int32())})
    with pytest.raises(errors.OutputRowError,
                       match=rf"output row {bad} of key \('{names[bad]}',\) is a dict, not a tuple"):
        run_partition(_DictFor(names[bad]), _spec(f"file://{tmp_path}/s", 0, EMPTY_STATE, daemon), 0, 0,
                      t.to_batches())
