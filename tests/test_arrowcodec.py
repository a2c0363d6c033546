"""Arrow columns <-> encoded row tuples: the compiled and reference twins agree byte for byte on
random tables (every handled type, nulls, sliced arrays), both equal encoding the rows' Python
values with the row codec, and decoding gives what the general path (decode_rows + pyarrow) gives,
or the same error."""
from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import implementations, resolve_impl
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from statestore_async.codecs import arrowcodec, twins, valuecodec
from statestore_async.errors import DecodeError, EncodeError
from statestore_async.spark.task.grouping import store_keys

pa = pytest.importorskip("pyarrow")

IMPLS = implementations("arrowcodec")
SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
native_only = pytest.mark.skipif(twins.NO_EXTENSIONS, reason="compiled modules disabled")

floats = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([0.0, -0.0, math.nan, -math.nan])
TYPES = {
    "int8": (pa.int8(), st.integers(-128, 127)),
    "int16": (pa.int16(), st.integers(-(2**15), 2**15 - 1)),
    "int32": (pa.int32(), st.integers(-(2**31), 2**31 - 1)),
    "int64": (pa.int64(), st.integers(-(2**63), 2**63 - 1)),
    "uint8": (pa.uint8(), st.integers(0, 255)),
    "uint32": (pa.uint32(), st.integers(0, 2**32 - 1)),
    "uint64": (pa.uint64(), st.integers(0, 2**64 - 1)),
    "float32": (pa.float32(), st.floats(width=32, allow_nan=True)),
    "float64": (pa.float64(), floats),
    "bool": (pa.bool_(), st.booleans()),
    "string": (pa.string(), st.text(max_size=6)),
    "large_string": (pa.large_string(), st.text(max_size=6)),
    "binary": (pa.binary(), st.binary(max_size=6)),
    "large_binary": (pa.large_binary(), st.binary(max_size=6)),
    "null": (pa.null(), st.none()),
}


@st.composite
def tables(draw, max_rows=12):
    """(columns, n): 0-4 random columns of one length, with nulls, some sliced (offset != 0)."""
    n = draw(st.integers(0, max_rows))
    cols = []
    for name in draw(st.lists(st.sampled_from(sorted(TYPES)), max_size=4)):
        typ, values = TYPES[name]
        skip = draw(st.integers(0, 3))
        items = draw(st.lists(st.none() | values, min_size=n + skip, max_size=n + skip))
        cols.append(pa.array(items, type=typ).slice(skip))
    return cols, n


def _descriptors(cols):
    return [arrowcodec.descriptor(c) for c in cols]


def _expected(cols, n, kgs, head, key):
    rows = list(zip(*[c.to_pylist() for c in cols])) if cols else [()] * n
    enc = [(valuecodec.encode_key if key else valuecodec.encode_row)((*head, *r)) for r in rows]
    return enc if kgs is None else [int(g).to_bytes(2, "big") + e for g, e in zip(kgs, enc)]


@pytest.fixture(params=IMPLS)
def ra(request):
    return resolve_impl(request.param)


@SETTINGS
@given(t=tables(), key=st.booleans(), head=st.sampled_from([(), ("total",), ("s", 7)]), with_kg=st.booleans(),
       data=st.data())
def test_columns_encode_as_the_rows_python_values(ra, t, key, head, with_kg, data):
    cols, n = t
    kgs = np.array(data.draw(st.lists(st.integers(0, 65535), min_size=n, max_size=n)), dtype=np.uint16) \
        if with_kg else None
    enc = valuecodec.encode_key if key else valuecodec.encode_row
    got = ra.encode_columns(n, _descriptors(cols), kgs, b"".join(enc(h) for h in head), len(head), key)
    big = any(c.type == pa.uint64() and any(v is not None and v >= 2**63 for v in c.to_pylist()) for c in cols)
    if big:  # needs a BIGINT: not the column codec's business
        assert got is None
        return
    offsets, blob, width = got
    offs = np.frombuffer(offsets, dtype=np.int32 if width == 4 else np.int64)
    items = [blob[offs[i]:offs[i + 1]] for i in range(n)]
    assert items == _expected(cols, n, kgs, head, key)


@SETTINGS
@given(t=tables(), key=st.booleans())
def test_encode_tuples_equals_the_general_path_for_every_input(t, key):
    cols, n = t
    kgs = np.arange(n) % 4096
    got = arrowcodec.encode_tuples(cols, key_groups=kgs, head=("v",), key=key) if cols else None
    if cols:
        assert got.to_pylist() == _expected(cols, n, kgs, ("v",), key)


def test_store_keys_are_the_rows_keys():
    keys = pa.table({"a": pa.array(["x", "é", None, "x"]), "b": pa.array([1, -2, 3, None], pa.int32())})
    kgs = np.array([0, 5, 4095, 17])
    rows = list(zip(*[c.to_pylist() for c in keys.columns]))
    assert arrowcodec.encode_tuples(keys.columns, key_groups=kgs, head=("total",), key=True).to_pylist() == \
        store_keys("total", rows, kgs.tolist(), 4096)


# --- decoding ------------------------------------------------------------------------------------
SCHEMAS = [
    pa.schema([("count", pa.int64()), ("sum", pa.int64())]),
    pa.schema([("a", pa.int8()), ("b", pa.uint16()), ("c", pa.float32()), ("d", pa.bool_())]),
    pa.schema([("s", pa.string()), ("y", pa.large_binary()), ("f", pa.float64()), ("z", pa.null())]),
    pa.schema([("u", pa.uint64()), ("ls", pa.large_string()), ("i", pa.int32())]),
]
py_values = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | floats | st.text(max_size=4)
             | st.binary(max_size=4) | st.tuples(st.integers()))


def _stored(draw, schema):
    """One stored value: absent, a conforming tuple, a near miss, or damaged bytes."""
    how = draw(st.sampled_from(["absent", "fits", "fits", "random", "damaged"]))
    if how == "absent":
        return None
    if how in ("fits", "damaged"):
        row = []
        for f in schema:
            typ = f.type
            name = next((k for k, (t, _) in TYPES.items() if t == typ), None)
            row.append(draw(st.none() | TYPES[name][1]) if name else None)
        data = valuecodec.encode_row(tuple(row))
        if how == "damaged" and data:
            i = draw(st.integers(0, len(data) - 1))
            data = data[:i] + bytes([draw(st.integers(0, 255))]) + data[i + 1:]
        return data
    return valuecodec.encode_row(tuple(draw(st.lists(py_values, min_size=len(schema) - 1, max_size=len(schema) + 1))))


def _general(values, schema):
    """What the general path gives: decode_rows, then one struct array."""
    try:
        raw = values.to_pylist()
        present = valuecodec.decode_rows([r for r in raw if r is not None])
        full, it = [], iter(present)
        for r in raw:
            full.append(None if r is None else next(it))
        arr = pa.array(full, type=pa.struct(list(schema)))
        return ("ok", pa.Table.from_arrays(arr.flatten(), schema=schema).to_pylist())
    except (DecodeError, pa.ArrowException, TypeError, ValueError, OverflowError) as exc:
        return ("error", type(exc).__name__)


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@SETTINGS
@given(schema=st.sampled_from(SCHEMAS), data=st.data(), skip=st.integers(0, 2), large=st.booleans())
def test_decoding_agrees_with_the_reference_and_the_general_path(ra, schema, data, skip, large):
    stored = [_stored(data.draw, schema) for _ in range(data.draw(st.integers(0, 8)) + skip)]
    values = pa.array(stored, type=pa.large_binary() if large else pa.binary()).slice(skip)
    col = arrowcodec.descriptor(values)
    kinds = [arrowcodec.kind_of(f.type) for f in schema]
    ref = twins.reference("arrowcodec").decode_columns(len(values), col, kinds)
    got = ra.decode_columns(len(values), col, kinds)
    assert got == ref
    general = _general(values, schema)
    if got is not None:  # conforming: exactly what the general path gives
        assert general[0] == "ok"
        table = pa.Table.from_arrays([arrowcodec._field_array(f.type, len(values), k[0], p)
                                      for f, k, p in zip(schema, kinds, got)], schema=schema)
        table.validate(full=True)
        assert _same(table.to_pylist(), general[1])
    try:
        out = ("ok", arrowcodec.decode_tuples(values, schema).to_pylist())
    except (DecodeError, pa.ArrowException, TypeError, ValueError, OverflowError) as exc:
        out = ("error", type(exc).__name__)
    assert out[0] == general[0] and (out[0] == "error" or _same(out[1], general[1]))


def test_decoded_state_has_nulls_where_no_state_was_stored():
    schema = SCHEMAS[0]
    values = pa.array([valuecodec.encode_row((3, 40)), None, valuecodec.encode_row((None, 2))], pa.binary())
    t = arrowcodec.decode_tuples(values, schema)
    assert t.to_pylist() == [{"count": 3, "sum": 40}, {"count": None, "sum": None}, {"count": None, "sum": 2}]


def test_a_stored_value_of_another_type_takes_the_general_path():
    schema = pa.schema([("x", pa.float64()), ("n", pa.int64())])
    values = pa.array([valuecodec.encode_row((1, 2)), valuecodec.encode_row((1.5, 3))], pa.binary())
    assert arrowcodec.decode_tuples(values, schema).to_pylist() == [{"x": 1.0, "n": 2}, {"x": 1.5, "n": 3}]
    with pytest.raises(DecodeError):
        arrowcodec.decode_tuples(pa.array([b"\x08\x02\x03"], pa.binary()), schema)


@pytest.mark.parametrize("bad", [
    [("i", 3, None, b"\0" * 8, None, 0)],          # no 3-byte ints
    [("i", 8, None, b"\0" * 7, None, 0)],          # too few value bytes
    [("s", 4, None, b"\0\0\0\0\x09\0\0\0", b"abc", 0)],  # an item past the data
    [("b", 0, b"", b"\xff", None, 0)],             # validity too short
    [("q", 8, None, b"\0" * 8, None, 0)],          # unknown kind
])
def test_malformed_descriptors_are_refused_by_both(ra, bad):
    with pytest.raises(EncodeError):
        ra.encode_columns(1, bad, None, b"", 0, False)


@native_only
def test_large_columns_round_trip_natively():
    n = 200_000
    keys = pa.array([f"k{i:08d}" for i in range(n)])
    state = pa.table({"count": np.arange(n), "sum": np.arange(n) * 3})
    skeys = arrowcodec.encode_tuples([keys], key_groups=np.arange(n) % 4096, head=("total",), key=True)
    assert skeys[12345].as_py() == (12345 % 4096).to_bytes(2, "big") + valuecodec.encode_key(("total", "k00012345"))
    enc = arrowcodec.encode_tuples(state.columns)
    assert arrowcodec.decode_tuples(enc, state.schema).equals(state)


# --- grouping rows by their keys -----------------------------------------------------------------
def _model_groups(items):
    """Items grouped by their bytes: groups in the order of their first item, items in order."""
    groups: dict[bytes, list[int]] = {}
    for i, b in enumerate(items):
        groups.setdefault(b, []).append(i)
    return list(groups.values())


def _groups_of(order, bounds):
    return [order[bounds[g]:bounds[g + 1]].tolist() for g in range(len(bounds) - 1)]


@SETTINGS
@given(items=st.lists(st.sampled_from([b"", b"a", b"ab", b"b", b"k00000001", b"k00000002", b"x" * 40, b"x" * 41]),
                      max_size=60) | st.lists(st.binary(max_size=20), max_size=60),
       large=st.booleans())
def test_group_encoded_agrees_with_the_model(ra, items, large):
    n = len(items)
    arr = pa.array(items, pa.large_binary() if large else pa.binary())
    _, width, _, offsets, data, _ = arrowcodec.descriptor(arr)
    order, bounds = np.full(n, -1, np.int64), np.full(n + 1, -1, np.int64)
    g = ra.group_encoded(n, offsets, data if data is not None else b"", width, order, bounds)
    assert _groups_of(order, bounds[:g + 1]) == _model_groups(items)


@pytest.mark.parametrize("distinct", [1, 7, 8, 9, 40_000])
@pytest.mark.parametrize("expected", [-1, 1, 5_000])
def test_group_encoded_agrees_with_the_model_whatever_its_table_size(ra, distinct, expected):
    # the table is sized from an estimate of the groups (-1) or from ``expected``, and rebuilt 4x
    # larger when half full: sized right, around the first rebuild (16 slots: 8 groups) and across
    # several, every group keeps its rows and its place
    rng = np.random.default_rng(distinct)
    items = [b"k%d" % i for i in rng.integers(0, distinct, 3 * distinct + 10)]
    arr = pa.array(items, pa.binary())
    _, width, _, offsets, data, _ = arrowcodec.descriptor(arr)
    n = len(items)
    order, bounds = np.full(n, -1, np.int64), np.full(n + 1, -1, np.int64)
    g = ra.group_encoded(n, offsets, data, width, order, bounds, expected)
    assert _groups_of(order, bounds[:g + 1]) == _model_groups(items)


@pytest.mark.parametrize("typ", [pa.string(), pa.large_string(), pa.binary(), pa.large_binary()])
def test_group_of_one_string_column_uses_its_bytes_also_when_sliced_and_keeps_null_apart(typ):
    values = ["b", "a", "", "b", None, "a", "", None, "ccc", "b"]
    items = [v if v is None or typ in (pa.string(), pa.large_string()) else v.encode() for v in values]
    whole = pa.array(items, typ)
    for col in (whole, whole.slice(3), whole.slice(1, 6), pa.chunked_array([whole.slice(0, 4), whole.slice(4)]),
                pa.array([v for v in items if v is not None], typ).slice(2)):
        order, bounds = arrowcodec.group([col])
        assert _groups_of(order, bounds) == _model_groups([valuecodec.encode_key((v,)) for v in col.to_pylist()])


@pytest.mark.parametrize("n, offsets, data, width, room", [
    (1, b"\0\0\0\0\x09\0\0\0", b"abc", 4, (1, 2)),     # an item past the data
    (2, b"\0\0\0\0\x02\0\0\0\x01\0\0\0", b"abc", 4, (2, 3)),  # offsets that run backwards
    (2, b"\0\0\0\0\x01\0\0\0", b"abc", 4, (2, 3)),     # too few offsets
    (1, b"\0" * 8, b"", 2, (1, 2)),                    # no such offset width
    (2, b"\0" * 12, b"", 4, (1, 3)),                   # no room for the order
    (2, b"\0" * 12, b"", 4, (2, 2)),                   # no room for the bounds
    (-1, b"\0" * 4, b"", 4, (1, 1)),                   # a negative count
])
def test_group_encoded_refuses_bad_input_in_both(ra, n, offsets, data, width, room):
    with pytest.raises(ValueError, match="group_encoded"):
        ra.group_encoded(n, offsets, data, width, np.zeros(room[0], np.int64), np.zeros(room[1], np.int64))


@SETTINGS
@given(t=tables(max_rows=30), data=st.data())
def test_group_puts_rows_with_equal_keys_together(t, data):
    cols, n = t
    if not cols:
        assert arrowcodec.group(cols) is None
        return
    # few distinct values, so that groups have several rows
    picks = data.draw(st.lists(st.integers(0, max(n - 1, 0)), min_size=n, max_size=n)) if n else []
    cols = [c.take(pa.array(picks, pa.int64())) for c in cols]
    order, bounds = arrowcodec.group(cols)
    rows = list(zip(*[c.to_pylist() for c in cols])) if n else []
    assert _groups_of(order, bounds) == _model_groups([valuecodec.encode_key(r) for r in rows])


def test_group_equal_keys_as_spark_groups_them_and_other_types_are_left_to_the_caller():
    a = pa.array(["x", None, "x", None, "y", "x"])
    b = pa.array([0.0, 1.0, -0.0, 1.0, float("nan"), float("-nan")])
    order, bounds = arrowcodec.group([a, b])
    assert _groups_of(order, bounds) == [[0, 2], [1, 3], [4], [5]]  # -0.0 is 0.0; NaNs are one value
    assert arrowcodec.group([pa.array([1, 2]), pa.array([[1], [2]])]) is None  # a list column
    assert arrowcodec.group([pa.array([1, 2], pa.timestamp("us"))]) is None
