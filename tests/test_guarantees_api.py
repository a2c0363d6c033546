"""What a new user of the Spark API gets when something is wrong: output rows checked against the
output schema (no silent narrowing), state declarations that cannot silently change the stored
layout, TTLs with a unit, and errors that name the socket, the attribute, the root or the column.

Every Spark test runs a real operator in local mode (the session's ``spark`` fixture) against a
daemon process of its own; nothing waits on a guessed sleep.
"""
from __future__ import annotations

import os
import re
import sys
import threading
import time
import warnings
from datetime import timedelta

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from click.testing import CliRunner
from spark_cluster import Daemon

from statestore_async import errors
from statestore_async.cli.main import main as cli
from statestore_async.client.clients import Client
from statestore_async.files.manifest import COMMITS_DIR
from statestore_async.spark import StatefulOperator, StatefulProcessor, load_state, placement
from statestore_async.spark.api.examples import CountSum, VectorizedCountSum
from statestore_async.spark.api.processors import StateHandle
from statestore_async.spark.task.output import output_table

OUT = "key string, count bigint, sum bigint"


@pytest.fixture(scope="module")
def daemon():
    with Daemon() as d:
        yield d


@pytest.fixture(autouse=True)
def _pickle_this_module_by_value():
    """Spark's Python workers cannot import this test module: its processors travel by value."""
    from pyspark import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def _batch(spark, rows):
    return spark.createDataFrame(rows, "key string, value bigint").coalesce(1)


def _manifests(root_dir, operator_id):
    folder = os.path.join(root_dir, operator_id, COMMITS_DIR)
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


# -- (12) output rows are checked against the output schema --------------------------------------
class _Emits(StatefulProcessor):
    """Counts rows per key and emits ``make(key, count)`` as its output for the key."""

    def __init__(self, make):
        self.make = make

    def init(self, handle):
        self.n = handle.value_state("n")

    def handle_rows(self, key, rows, state):
        n = (self.n.get() or 0) + len(rows)
        self.n.update(n)
        yield self.make(key, n)


def _bad_for_b(bad):
    """Rows that fit for every key but ``("b",)``, which gets ``bad(key, n)``."""
    return lambda key, n: bad(key, n) if key == ("b",) else (key[0], n, 1)


@pytest.mark.parametrize(("make", "schema", "named"), [
    # a fraction into a bigint column: pyarrow alone stores 29
    (_bad_for_b(lambda k, n: (k[0], n, 29.5)), OUT, ["'sum'", "29.5", "('b',)", "truncated"]),
    # an int that does not fit an int column (int32)
    (_bad_for_b(lambda k, n: (k[0], n, 2**31)), "key string, count bigint, sum int",
     ["'sum'", "2147483648", "('b',)", "range"]),
    # a dict as a row: read as its keys before
    (_bad_for_b(lambda k, n: {"key": k[0], "count": n, "sum": 1}), OUT, ["dict", "('b',)", "tuple"]),
    # a row of another arity
    (_bad_for_b(lambda k, n: (k[0], n)), OUT, ["2 values", "3 columns", "('b',)"]),
], ids=["fraction-into-bigint", "int-out-of-int32", "dict-row", "short-row"])
def test_an_output_row_that_does_not_fit_fails_the_batch_naming_column_key_and_value(
        spark, daemon, tmp_path, make, schema, named):
    """The batch fails (nothing committed) with an error that names the column, the key and the
    value; before, 29.5 became 29 and a dict became its keys, silently."""
    op = StatefulOperator(f"file://{tmp_path}/s", "out", ["key"], _Emits(make), schema, 1, 16, socket_path=daemon.socket)
    with pytest.raises(Exception) as info:
        op.process_batch(_batch(spark, [("a", 1), ("b", 2)]), 0, lambda df, b: df.collect())
    message = str(info.value)
    assert "OutputRowError" in message, message
    for word in named:
        assert word in message, (word, message)
    assert _manifests(tmp_path / "s", "out") == []  # the batch did not commit


def test_whole_floats_rows_and_lists_convert_and_the_vectorized_output_is_checked_too(spark, daemon, tmp_path):
    """What fits is accepted as before (29.0 into bigint, lists, Rows in column order); a vectorized
    processor's output with a fraction in an integer column fails naming the column and the row."""
    from pyspark.sql import Row

    def emit(key, n):
        return {"a": (key[0], n, 29.0), "b": [key[0], n, 7], "c": Row(key=key[0], count=n, sum=8)}[key[0]]

    op = StatefulOperator(f"file://{tmp_path}/s", "ok", ["key"], _Emits(emit), OUT, 1, 16, socket_path=daemon.socket)
    got = {}
    op.process_batch(_batch(spark, [("a", 1), ("b", 2), ("c", 3)]), 0,
                     lambda df, b: got.update({r[0]: tuple(r) for r in df.collect()}))
    assert got == {"a": ("a", 1, 29), "b": ("b", 1, 7), "c": ("c", 1, 8)}

    class Halves(VectorizedCountSum):
        def process(self, keys, rows, offsets, state, exists):
            new_state, out = super().process(keys, rows, offsets, state, exists)
            return new_state, out.set_column(2, "sum", pc.divide(out["sum"].cast(pa.float64()), 2.0))

    vop = StatefulOperator(f"file://{tmp_path}/v", "vec", ["key"], Halves(), OUT, 1, 16, socket_path=daemon.socket)
    with pytest.raises(Exception) as info:
        vop.process_batch(_batch(spark, [("a", 1), ("b", 2)]), 0, lambda df, b: df.collect())
    message = str(info.value)
    assert "OutputRowError" in message and "'sum'" in message and "0.5" in message and "'key': 'a'" in message, message


def test_output_conversion_checks_without_spark():
    """The conversion itself: Rows whose fields are the columns in another order, a bool into an
    integer column, NaN into an integer column are refused; None stays null."""
    from collections import namedtuple

    from pyspark.sql import Row

    schema = pa.schema([("key", pa.string()), ("n", pa.int64()), ("m", pa.int32())])
    assert output_table([("a", None, 2), ["b", 3, None]], schema).to_pylist() == [
        {"key": "a", "n": None, "m": 2}, {"key": "b", "n": 3, "m": None}]
    for rows, word in [([Row(n=1, key="a", m=2)], "matched by position"),
                       ([namedtuple("T", "m n key")(1, 2, "a")], "matched by position"),
                       ([("a", True, 1)], "bool"), ([("a", float("nan"), 1)], "nan"), (["abc"], "str"),
                       ([("a", 1, 1.25)], "1.25")]:
        with pytest.raises(errors.OutputRowError, match=word):
            output_table(rows, schema, [("k",)], [len(rows)])


# -- (13) TTLs have a unit; a state variable's declaration is recorded and cannot silently change --
def test_a_ttl_has_a_unit():
    h = StateHandle()
    assert h.value_state("a", ttl=timedelta(minutes=1)).ttl_ms == 60_000
    assert h.value_state("b", ttl_seconds=60).ttl_ms == 60_000
    assert h.list_state("c", ttl_ms=60_000).ttl_ms == 60_000
    assert h.map_state("d", ttl_seconds=1.5).ttl_ms == 1500
    assert h.value_state("e").ttl_ms is None
    with pytest.raises(errors.InterfaceError, match=r"ttl=60000 has no unit.*ttl_ms=60000"):
        h.value_state("f", ttl=60_000)  # PySpark's TTLConfig is in ms; this API's old unit was seconds
    with pytest.raises(errors.InterfaceError, match="one of ttl, ttl_seconds, ttl_ms"):
        h.value_state("g", ttl=timedelta(seconds=1), ttl_ms=1000)
    for bad in ({"ttl": timedelta(0)}, {"ttl_seconds": -1}, {"ttl_ms": float("inf")}, {"ttl_ms": True}, {"ttl": "1m"}):
        with pytest.raises(errors.InterfaceError):
            h.value_state("h", **bad)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        h.value_state("i", ttl_seconds=86_400_000)
    assert any("did you mean ttl_ms" in str(w.message) for w in caught)


class _Total(StatefulProcessor):
    """A running (count, sum) in ``total``, declared with ``ttl`` (None: no TTL), and optionally
    another variable ``extra``."""

    def __init__(self, ttl=None, extra=False):
        self.ttl, self.extra = ttl, extra

    def init(self, handle):
        self.total = handle.value_state("total", ttl=self.ttl)
        if self.extra:
            self.seen = handle.list_state("seen")

    def handle_rows(self, key, rows, state):
        count, total = self.total.get() or (0, 0)
        count, total = count + len(rows), total + sum(r[0] for r in rows)
        self.total.update((count, total))
        if self.extra:
            self.seen.append(len(rows))
        yield (*key, count, total)


def _values(state, name="total"):
    return {k[0]: v for (n, k), v in state.items() if n == name}


@pytest.mark.parametrize(("before", "after"), [(None, timedelta(hours=1)), (timedelta(hours=1), None)],
                         ids=["ttl-added", "ttl-removed"])
def test_adding_or_removing_a_ttl_on_existing_state_is_refused(spark, daemon, tmp_path, before, after):
    """Batch 1 with the TTL added (or removed) fails, naming the variable and both declarations,
    and commits nothing; the state is intact and the old declaration goes on. Before, the state
    read as absent (reset) or its expiry leaked into the value."""
    root = f"file://{tmp_path}/s"
    hour = 3600.0
    clock = [1_000_000.0]

    def op(processor):
        return StatefulOperator(root, "ttl", ["key"], processor, OUT, 2, 16, socket_path=daemon.socket,
                                clock=lambda: clock[0])

    out = {}
    sink = lambda df, b: out.__setitem__(b, sorted(tuple(r) for r in df.collect()))
    op(_Total(before)).process_batch(_batch(spark, [("a", 1), ("b", 2)]), 0, sink)
    committed = load_state(root, "ttl")
    clock[0] += hour / 2
    with pytest.raises(Exception) as info:
        op(_Total(after)).process_batch(_batch(spark, [("a", 10)]), 1, sink)
    message = str(info.value)
    assert "StateDeclarationError" in message and "'total'" in message, message
    assert "value_state without a TTL" in message and "value_state with a TTL" in message, message
    assert _manifests(tmp_path / "s", "ttl") == ["1.json"] and load_state(root, "ttl") == committed
    # the old declaration, with a new variable and (for a TTL) another length: accepted, state continues
    longer = before * 2 if before is not None else None
    op(_Total(longer, extra=True)).process_batch(_batch(spark, [("a", 10)]), 1, sink)
    assert out[1] == [("a", 2, 11)]


def test_vectorized_and_value_state_share_a_layout_and_a_kind_change_is_refused(spark, daemon, tmp_path):
    """A VectorizedProcessor may take over a value_state without a TTL of the same name (the same
    records); a list_state of that name may not."""
    root = f"file://{tmp_path}/s"

    class ListTotal(StatefulProcessor):
        def init(self, handle):
            self.total = handle.list_state("total")

        def handle_rows(self, key, rows, state):
            self.total.append(len(rows))
            yield (*key, 0, 0)

    def op(processor):
        return StatefulOperator(root, "kind", ["key"], processor, OUT, 1, 16, socket_path=daemon.socket)

    out = {}
    sink = lambda df, b: out.__setitem__(b, sorted(tuple(r) for r in df.collect()))
    op(CountSum()).process_batch(_batch(spark, [("a", 1)]), 0, sink)
    op(VectorizedCountSum()).process_batch(_batch(spark, [("a", 2)]), 1, sink)
    assert out[1] == [("a", 2, 3)]
    with pytest.raises(Exception, match=r"(?s)StateDeclarationError.*'total' was the VectorizedProcessor's state "
                                        r"and is now list_state"):
        op(ListTotal()).process_batch(_batch(spark, [("a", 3)]), 2, sink)


# -- (14) errors that name the socket, the attribute, the root; read-only commands create nothing --
def test_a_socket_path_that_cannot_be_a_socket_is_named_with_the_fix_at_once(spark, tmp_path):
    """A socket path under a file, or that is a file or a folder, fails the task at once with an
    error naming the path and the fix, and nothing is created next to it (before: a raw
    ``FileExistsError`` naming the file, not the socket)."""
    folder = tmp_path / "sockets"
    folder.mkdir()
    afile = folder / "hostname"
    afile.write_text("not a folder\n")
    bad = f"{afile}/daemon.sock"
    op = StatefulOperator(f"file://{tmp_path}/s", "sock", ["key"], CountSum(), OUT, 1, 16, socket_path=bad)
    with pytest.raises(Exception) as info:
        op.process_batch(_batch(spark, [("a", 1)]), 0)
    message = str(info.value)
    assert "SocketPathError" in message and repr(bad) in message and "socket_path=" in message, message
    assert os.listdir(folder) == ["hostname"]  # no lock file, no daemon.log

    for path, words in [(bad, ["is a file, not a folder"]), (str(afile), ["is a file, not a socket"]),
                        (str(folder), ["is a folder", "daemon.sock"]), ("/tmp/" + "x" * 110, ["at most 107"])]:
        started = time.monotonic()
        with pytest.raises(errors.SocketPathError) as info:
            placement.connect(path)
        assert time.monotonic() - started < 10  # at once: no daemon start, no wait (a busy machine: generous)
        assert all(w in str(info.value) for w in [repr(path), "STATESTORE_SOCKET", *words]), str(info.value)
    # a path where a socket could be but no daemon listens: the OS's reason, the path and the fix
    with pytest.raises(errors.ConnectionLostError, match=r"no daemon socket at .*statestore-async serve --socket"):
        Client(str(folder / "none.sock")).ping()
    assert os.listdir(folder) == ["hostname"]


class _HoldsALock(CountSum):
    def __init__(self):
        self.settings = {"window": 10, "guard": threading.Lock()}


def test_a_processor_that_cannot_be_pickled_is_named_with_its_attribute(tmp_path):
    """Refused when the operator is made, naming the attribute inside the processor that does not
    pickle (before: Spark's PicklingError at the first batch, naming no attribute)."""
    with pytest.raises(errors.InterfaceError, match=r"_HoldsALock cannot be pickled.*self\.settings\['guard'\].*init\(\)"):
        StatefulOperator(f"file://{tmp_path}/s", "pickle", ["key"], _HoldsALock(), OUT, 1, 16)


def test_a_relative_root_is_refused_naming_it_and_an_absolute_uri(spark, tmp_path, monkeypatch):
    """Relative roots would be resolved against each process's own working directory (driver,
    executors, daemons): refused, with the absolute file:/// URI suggested; nothing is created."""
    monkeypatch.chdir(tmp_path)
    for root in ("state", "./state", "file:state"):
        with pytest.raises(errors.InterfaceError, match=re.escape(f"'{root}' is a relative path") + ".*"
                           + re.escape(f"'file://{tmp_path}/state'")):
            StatefulOperator(root, "rel", ["key"], CountSum(), OUT, 1, 16)
        with pytest.raises(errors.InterfaceError, match="relative path"):
            load_state(root, "rel")
    with pytest.raises(errors.InterfaceError, match="three slashes"):
        StatefulOperator("file://state/x", "rel", ["key"], CountSum(), OUT, 1, 16)
    assert StatefulOperator(str(tmp_path / "abs"), "rel", ["key"], CountSum(), OUT, 1, 16).root == f"file://{tmp_path}/abs"
    assert os.listdir(tmp_path) == []


def test_read_only_commands_never_create_the_root(spark, tmp_path):
    """inspect, verify, gc (dry run or not), load_state and read_state on a mistyped root fail
    naming it, and leave no folder behind."""
    missing = tmp_path / "typo" / "root"
    for args in (["verify", str(missing), "--operator", "op"], ["verify", f"file://{missing}", "--operator", "op"],
                 ["inspect", str(missing), "op/0/default/1_" + "0" * 32 + ".delta"],
                 ["gc", str(missing), "--operator", "op", "--dry-run"], ["gc", str(missing), "--operator", "op"]):
        r = CliRunner().invoke(cli, args, catch_exceptions=False)
        assert os.listdir(tmp_path) == [], (args, r.output)  # before: the command created typo/root
        assert r.exit_code == 1 and "no checkpoint root" in r.output and str(missing) in r.output, (args, r.output)
    with pytest.raises(errors.VersionNotFoundError, match="no manifest"):
        load_state(str(missing), "op")
    assert os.listdir(tmp_path) == []
    from statestore_async.spark import read_state

    with pytest.raises(errors.VersionNotFoundError, match="no manifest"):
        read_state(spark, f"file://{missing}", "op")
    assert os.listdir(tmp_path) == []
