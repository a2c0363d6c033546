"""Row hash: XXH64, Spark's xxhash64 bit for bit (checked against real Spark), key groups."""
from __future__ import annotations

import datetime as dt
import math
import random
import re
import struct

import numpy as np
import pyarrow as pa
import pytest
import xxhash
from conftest import implementations, resolve_impl
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from statestore_async.codecs import twins
from statestore_async.errors import EncodeError, InterfaceError

REF = twins.reference("sparkhash")
IMPLS = implementations("sparkhash")
UTC = dt.UTC
I64 = (-(1 << 63), (1 << 63) - 1)
I32 = (-(1 << 31), (1 << 31) - 1)

HSETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _impls():
    """(ref, native) modules; native is None when extensions are disabled."""
    return [resolve_impl(p.values[0]) for p in IMPLS]


@pytest.fixture(params=IMPLS)
def impl(request):
    return resolve_impl(request.param)


# --------------------------------------------------------------------------------------------
# strategies
# --------------------------------------------------------------------------------------------
TZS = st.sampled_from([UTC, dt.timezone(dt.timedelta(hours=5, minutes=30)), dt.timezone(-dt.timedelta(hours=8))])

VALUE_STRATEGIES = {
    "boolean": st.booleans(),
    "tinyint": st.integers(-128, 127),
    "smallint": st.integers(-(1 << 15), (1 << 15) - 1),
    "int": st.integers(*I32),
    "bigint": st.integers(*I64),
    "float": st.floats(width=32) | st.floats(),  # f32-exact values and doubles to round
    "double": st.floats(),
    "string": st.text(),
    "binary": st.binary(),
    "date": st.dates() | st.integers(*I32),
    "timestamp": st.datetimes(timezones=TZS | st.none()) | st.integers(*I64),
    "timestamp_ntz": st.datetimes() | st.integers(*I64),
    "void": st.none(),
}
TYPE_NAMES = sorted(VALUE_STRATEGIES)

# Arrow twins: (arrow type, strategy of Python values pyarrow accepts for it)
ARROW_TYPES = {
    "boolean": (pa.bool_(), st.booleans()),
    "tinyint": (pa.int8(), VALUE_STRATEGIES["tinyint"]),
    "smallint": (pa.int16(), VALUE_STRATEGIES["smallint"]),
    "int": (pa.int32(), VALUE_STRATEGIES["int"]),
    "bigint": (pa.int64(), VALUE_STRATEGIES["bigint"]),
    "float": (pa.float32(), st.floats(width=32)),
    "double": (pa.float64(), st.floats()),
    "string": (pa.string(), st.text()),
    "large_string": (pa.large_string(), st.text()),
    "binary": (pa.binary(), st.binary()),
    "large_binary": (pa.large_binary(), st.binary()),
    "date": (pa.date32(), st.integers(*I32)),
    "timestamp": (pa.timestamp("us", tz="UTC"), st.integers(*I64)),
    "timestamp_ntz": (pa.timestamp("us"), st.integers(*I64)),
    "void": (pa.null(), st.none()),
}
ARROW_TO_SPARK = {"large_string": "string", "large_binary": "binary"}


@st.composite
def typed_rows(draw, type_names=TYPE_NAMES, max_rows=20):
    types = draw(st.lists(st.sampled_from(type_names), min_size=1, max_size=5))
    nrows = draw(st.integers(0, max_rows))
    rows = []
    for _ in range(nrows):
        row = []
        for t in types:
            row.append(draw(st.none() | VALUE_STRATEGIES[t]))
        rows.append(tuple(row))
    return types, rows


# --------------------------------------------------------------------------------------------
# 1. XXH64
# --------------------------------------------------------------------------------------------
@HSETTINGS
@given(data=st.binary(max_size=200), seed=st.integers(0, (1 << 64) - 1))
def test_xxh64_matches_xxhash(data, seed):
    expected = xxhash.xxh64_intdigest(data, seed)
    for mod in _impls():
        assert mod.xxh64(data, seed) == expected
        assert mod.xxh64(bytearray(data), seed) == expected
        assert mod.xxh64(memoryview(data), seed) == expected


@pytest.mark.parametrize("n", list(range(0, 201)) + [1000, 4096, 70000])
def test_xxh64_every_length(n):
    rnd = random.Random(n)
    data = bytes(rnd.getrandbits(8) for _ in range(n))
    seed = rnd.getrandbits(64)
    for mod in _impls():
        assert mod.xxh64(data, seed) == xxhash.xxh64_intdigest(data, seed)
        assert mod.xxh64(data) == xxhash.xxh64_intdigest(data, 0)
        # an unaligned view in the middle of a larger buffer
        big = b"\x01" + data + b"\x02"
        assert mod.xxh64(memoryview(big)[1 : 1 + n], seed) == xxhash.xxh64_intdigest(data, seed)


def test_xxh64_known_vectors(impl):
    assert impl.xxh64(b"") == 0xEF46DB3751D8E999
    assert impl.xxh64(b"a") == 0xD24EC4F1A98C6E5B
    assert impl.xxh64(b"abc") == 0x44BC2CF5AD770999


def test_xxh64_arguments(impl):
    data = np.arange(24, dtype=np.int32).reshape(4, 6)
    assert impl.xxh64(data) == xxhash.xxh64_intdigest(data.tobytes())
    nc = data[:, ::2]  # not contiguous: hashed as its C-order bytes
    assert impl.xxh64(memoryview(nc)) == xxhash.xxh64_intdigest(nc.tobytes())
    assert impl.xxh64(nc) == xxhash.xxh64_intdigest(nc.tobytes())
    assert impl.xxh64(np.asfortranarray(data)) == xxhash.xxh64_intdigest(np.asfortranarray(data).tobytes())
    assert impl.xxh64(b"x", -1) == xxhash.xxh64_intdigest(b"x", (1 << 64) - 1)
    for bad in ("text", 12, None, [1, 2]):
        with pytest.raises(InterfaceError):
            impl.xxh64(bad)
    for seed in (1 << 64, -(1 << 63) - 1, 1.5, "1", True):
        with pytest.raises(InterfaceError):
            impl.xxh64(b"x", seed)


# --------------------------------------------------------------------------------------------
# Spark's layout, by hand (independent of the implementations' code paths)
# --------------------------------------------------------------------------------------------
def _manual(values_layouts, seed=42):
    h = seed
    for layout in values_layouts:
        if layout is not None:
            h = xxhash.xxh64_intdigest(layout, h)
    return h - (1 << 64) if h >= 1 << 63 else h


def test_layouts_by_hand(impl):
    assert impl.spark_xxhash64([]) == 42
    assert impl.spark_xxhash64([None]) == 42
    assert impl.spark_xxhash64([1], ["int"]) == _manual([struct.pack("<i", 1)])
    assert impl.spark_xxhash64([-1], ["tinyint"]) == _manual([struct.pack("<i", -1)])
    assert impl.spark_xxhash64([True], ["boolean"]) == _manual([struct.pack("<i", 1)])
    assert impl.spark_xxhash64([False]) == _manual([struct.pack("<i", 0)])
    assert impl.spark_xxhash64([1]) == _manual([struct.pack("<q", 1)])
    assert impl.spark_xxhash64(["é", None, b"\x00"]) == _manual(["é".encode(), None, b"\x00"])
    assert impl.spark_xxhash64([-0.0]) == impl.spark_xxhash64([0.0]) == _manual([bytes(8)])
    assert impl.spark_xxhash64([-0.0], ["float"]) == _manual([bytes(4)])
    nan_d = struct.unpack("<d", struct.pack("<Q", 0x7FF0000000000123))[0]
    assert impl.spark_xxhash64([nan_d]) == _manual([struct.pack("<Q", 0x7FF8000000000000)])
    assert impl.spark_xxhash64([nan_d], ["float"]) == _manual([struct.pack("<I", 0x7FC00000)])
    assert impl.spark_xxhash64([1e300], ["float"]) == _manual([struct.pack("<I", 0x7F800000)])
    assert impl.spark_xxhash64([-1e-300], ["float"]) == _manual([bytes(4)])
    assert impl.spark_xxhash64([dt.date(1970, 1, 2)]) == _manual([struct.pack("<i", 1)])
    ts = dt.datetime(1970, 1, 1, 0, 0, 1, 5, tzinfo=UTC)
    assert impl.spark_xxhash64([ts]) == _manual([struct.pack("<q", 1_000_005)])
    # naive timestamps are UTC
    assert impl.spark_xxhash64([ts.replace(tzinfo=None)]) == impl.spark_xxhash64([ts])
    # timestamp_ntz: the wall clock
    ist = dt.datetime(1970, 1, 1, 5, 30, tzinfo=dt.timezone(dt.timedelta(hours=5, minutes=30)))
    assert impl.spark_xxhash64([ist], ["timestamp"]) == _manual([struct.pack("<q", 0)])
    assert impl.spark_xxhash64([ist], ["timestamp_ntz"]) == _manual([struct.pack("<q", 19_800_000_000)])
    assert impl.spark_xxhash64(["x"], ["void"]) == 42
    assert impl.spark_xxhash64((7,), ("INT",), seed=0) == _manual([struct.pack("<i", 7)], seed=0)


def test_pyspark_datatype_objects(impl):
    types = pytest.importorskip("pyspark.sql.types")
    row = (1, "a", 2.5)
    names = ["int", "string", "float"]
    objs = [types.IntegerType(), types.StringType(), types.FloatType()]
    assert impl.spark_xxhash64(row, objs) == impl.spark_xxhash64(row, names)


# --------------------------------------------------------------------------------------------
# 2. reference vs compiled
# --------------------------------------------------------------------------------------------
@HSETTINGS
@given(typed_rows())
def test_rows_ref_vs_native(case):
    types, rows = case
    mods = _impls()
    results = []
    for mod in mods:
        single = [mod.spark_xxhash64(r, types) for r in rows]
        batch = mod.hash_rows(rows, types)
        assert batch.dtype == np.int64
        assert batch.tolist() == single
        results.append(single)
    assert all(r == results[0] for r in results)


@HSETTINGS
@given(st.lists(st.lists(st.none() | st.booleans() | st.integers(*I64) | st.floats() | st.text() | st.binary()
                         | st.dates() | st.datetimes(timezones=TZS | st.none()), max_size=4), max_size=10))
def test_inferred_ref_vs_native(rows):
    mods = _impls()
    results = [mod.hash_rows(rows).tolist() for mod in mods]
    assert all(r == results[0] for r in results)
    for mod in mods:
        assert [mod.spark_xxhash64(r) for r in rows] == results[0]


ODD_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(-(1 << 70), 1 << 70),
    st.floats(),
    st.text(),
    st.binary(),
    st.dates(),
    st.datetimes(timezones=TZS | st.none()),
    st.sampled_from([np.int8(-3), np.int64(5), np.bool_(True), np.float32(1.5), np.float64(-0.0),
                     bytearray(b"ab"), memoryview(b"cd"), 1 << 200, "\ud800", object(), [1], 1j]),
)


def _outcome(fn, *args):
    try:
        return ("ok", fn(*args))
    except (EncodeError, InterfaceError) as exc:
        return ("err", type(exc))


@HSETTINGS
@given(values=st.lists(ODD_VALUES, min_size=1, max_size=4), data=st.data())
def test_odd_values_same_outcome(values, data):
    types = data.draw(st.none() | st.lists(st.sampled_from(TYPE_NAMES), min_size=len(values), max_size=len(values)))
    mods = _impls()
    outcomes = [_outcome(mod.spark_xxhash64, values, types) for mod in mods]
    assert all(o == outcomes[0] for o in outcomes), outcomes
    batch = [_outcome(lambda *a: mod.hash_rows(*a).tolist(), [values, values], types) for mod in mods]
    assert all(o == batch[0] for o in batch), batch


def _arrow_array(values, atype, rnd):
    """An Arrow array of values, sometimes a slice of a larger one, sometimes chunked."""
    kind = rnd.randrange(3)
    if kind == 0:
        return pa.array(values, type=atype)
    if kind == 1:
        pad_l, pad_r = rnd.randrange(0, 11), rnd.randrange(0, 3)
        filler = [None] * pad_l
        arr = pa.array(filler + list(values) + [None] * pad_r, type=atype)
        return arr.slice(pad_l, len(values))
    cuts = sorted(rnd.randrange(0, len(values) + 1) for _ in range(rnd.randrange(0, 4)))
    chunks, start = [], 0
    for c in cuts + [len(values)]:
        chunk = pa.array(values[start:c], type=atype)
        if rnd.random() < 0.5 and len(chunk):
            padded = pa.array([None] + values[start:c], type=atype)
            chunk = padded.slice(1)
        chunks.append(chunk)
        start = c
    return pa.chunked_array(chunks, type=atype)


@HSETTINGS
@given(data=st.data(), rnd=st.randoms(use_true_random=False))
def test_arrow_ref_vs_native_vs_rows(data, rnd):
    names = data.draw(st.lists(st.sampled_from(sorted(ARROW_TYPES)), min_size=1, max_size=5))
    nrows = data.draw(st.integers(0, 40))
    cols, spark_types = [], []
    rows = [[] for _ in range(nrows)]
    for name in names:
        atype, strat = ARROW_TYPES[name]
        null_rate = data.draw(st.sampled_from([0.0, 0.2, 1.0]))
        values = [None if rnd.random() < null_rate else data.draw(strat) for _ in range(nrows)]
        for r, v in zip(rows, values):
            r.append(v)
        cols.append(_arrow_array(values, atype, rnd))
        spark_types.append(ARROW_TO_SPARK.get(name, name))
    expected = REF.hash_rows(rows, spark_types)
    for mod in _impls():
        got = mod.hash_arrow(cols)
        assert got.dtype == np.int64
        assert got.tolist() == expected.tolist()


def test_arrow_timestamp_units(impl):
    micros = [0, 1, -1, 1_500_000, -1_500_001, None, 253402300799999999]
    secs = [0, 1, -1, -62135596800, 253402300799, None, 9223372036854]
    for unit, raw, expect in [
        ("us", micros, micros),
        ("ns", [0, 999, -1, -1000, -1001, None, 9223372036854775807],
         [0, 0, -1, -1, -2, None, 9223372036854775]),
        ("ms", [0, 1, -1, 123456789, None], [0, 1000, -1000, 123456789000, None]),
        ("s", secs, [None if s is None else s * 1_000_000 for s in secs]),
    ]:
        for tz in (None, "UTC", "Asia/Kolkata"):
            arr = pa.array(raw, type=pa.timestamp(unit, tz=tz))
            assert impl.hash_arrow([arr]).tolist() == REF.hash_rows([(v,) for v in expect], ["bigint"]).tolist()
    with pytest.raises(EncodeError):
        impl.hash_arrow([pa.array([9223372036855], type=pa.timestamp("s"))])
    with pytest.raises(EncodeError):
        impl.hash_arrow([pa.array([-9223372036854776], type=pa.timestamp("ms"))])
    assert impl.hash_arrow([pa.array([-9223372036854775], type=pa.timestamp("ms"))]).tolist() == (
        REF.hash_rows([(-9223372036854775000,)], ["bigint"]).tolist()
    )


def test_arrow_edge_cases(impl):
    empty = impl.hash_arrow([pa.array([], type=pa.string())])
    assert empty.dtype == np.int64 and len(empty) == 0
    assert impl.hash_arrow([pa.chunked_array([], type=pa.int32())]).tolist() == []
    assert impl.hash_arrow([pa.array([None, None], type=pa.string())]).tolist() == [42, 42]
    assert impl.hash_arrow([pa.nulls(3)]).tolist() == [42, 42, 42]
    assert impl.hash_arrow([pa.array(["", ""])]).tolist() == [impl.spark_xxhash64([""])] * 2
    sliced = pa.array(["a", "bb", None, "ccc", "dddd"]).slice(3, 0)
    assert impl.hash_arrow([sliced]).tolist() == []
    bools = pa.array([True, False, None, True] * 5).slice(3, 13)
    assert impl.hash_arrow([bools]).tolist() == REF.hash_rows([(v,) for v in bools.to_pylist()], ["boolean"]).tolist()
    table = pa.table({"a": pa.array([1, 2], pa.int32()), "b": ["x", None]})
    assert impl.hash_arrow(table).tolist() == REF.hash_rows([(1, "x"), (2, None)], ["int", "string"]).tolist()
    assert impl.hash_arrow(table.to_batches()[0]).tolist() == impl.hash_arrow(table).tolist()
    assert impl.hash_arrow([pa.array([1], pa.int32())], seed=0).tolist() == [impl.spark_xxhash64([1], ["int"], seed=0)]
    # invalid UTF-8 in a string array is hashed as the raw bytes (no decoding)
    raw = pa.array([b"\xff\xfe"], pa.binary()).view(pa.string())
    assert impl.hash_arrow([raw]).tolist() == [impl.spark_xxhash64([b"\xff\xfe"])]


def test_arrow_float_bits(impl):
    """NaN payloads and -0.0 straight from the buffers: canonical NaN, 0.0."""
    f_bits = np.array([0x7FC00000, 0x7F800001, 0xFFC00001, 0x7FFFFFFF, 0x80000000, 0x00000001, 0x7F800000,
                       0x3F800000], dtype=np.uint32)
    d_bits = np.array([0x7FF8000000000000, 0x7FF0000000000001, 0xFFF8000000000123, 0x8000000000000000,
                       0x0000000000000001, 0xFFF0000000000000], dtype=np.uint64)
    f_arr = pa.array(f_bits.view(np.float32))
    d_arr = pa.array(d_bits.view(np.float64))
    canon_f = [0x7FC00000, 0x7FC00000, 0x7FC00000, 0x7FC00000, 0, 1, 0x7F800000, 0x3F800000]
    canon_d = [0x7FF8000000000000, 0x7FF8000000000000, 0x7FF8000000000000, 0, 1, 0xFFF0000000000000]
    assert impl.hash_arrow([f_arr]).tolist() == [_manual([struct.pack("<I", b)]) for b in canon_f]
    assert impl.hash_arrow([d_arr]).tolist() == [_manual([struct.pack("<Q", b)]) for b in canon_d]
    assert impl.hash_arrow([f_arr.slice(3)]).tolist() == [_manual([struct.pack("<I", b)]) for b in canon_f[3:]]


def test_facade():
    from statestore_async.codecs import sparkhash

    assert sparkhash.spark_xxhash64(["a", 1], ["string", "int"]) == REF.spark_xxhash64(["a", 1], ["string", "int"])
    assert sparkhash.SPARK_SEED == 42
    twin = REF if twins.NO_EXTENSIONS else twins.native("sparkhash")
    for name in ("xxh64", "spark_xxhash64", "hash_rows", "hash_arrow", "key_group", "key_groups",
                 "partition_of_key_group", "key_group_range"):
        assert getattr(sparkhash, name) is getattr(twin, name)


def test_arrow_errors(impl):
    for bad_type in (pa.uint32(), pa.float16(), pa.list_(pa.int32()), pa.decimal128(10, 2), pa.date64()):
        with pytest.raises(InterfaceError, match=re.escape(str(bad_type))):
            impl.hash_arrow([pa.array([None], type=bad_type)])
    with pytest.raises(InterfaceError, match="dictionary"):
        impl.hash_arrow([pa.array(["a", "b"]).dictionary_encode()])
    with pytest.raises(InterfaceError):
        impl.hash_arrow([])
    with pytest.raises(InterfaceError):
        impl.hash_arrow(pa.array([1]))
    with pytest.raises(InterfaceError):
        impl.hash_arrow([pa.array([1]), pa.array([1, 2])])
    for bad in ([np.arange(3)], [[1, 2]], [None], 5, None):
        with pytest.raises(InterfaceError):
            impl.hash_arrow(bad)


# --------------------------------------------------------------------------------------------
# 4. errors: the same class from both implementations
# --------------------------------------------------------------------------------------------
ERROR_CASES = [
    ((["a"], ["varchar"]), InterfaceError),
    ((["a"], ["decimal(10,2)"]), InterfaceError),
    ((["a"], [3]), InterfaceError),
    ((["a"], "string"), InterfaceError),
    ((["a", 1], ["string"]), InterfaceError),
    (([1], ["int", "int"]), InterfaceError),
    (("ab", None), InterfaceError),
    ((5, None), InterfaceError),
    (([1 << 31], ["int"]), EncodeError),
    (([-(1 << 31) - 1], ["int"]), EncodeError),
    (([128], ["tinyint"]), EncodeError),
    (([-32769], ["smallint"]), EncodeError),
    (([1 << 63], ["bigint"]), EncodeError),
    (([1 << 63], None), EncodeError),
    (([1 << 31], ["date"]), EncodeError),
    (([1 << 63], ["timestamp"]), EncodeError),
    ((["1"], ["int"]), EncodeError),
    (([1.0], ["int"]), EncodeError),
    (([True], ["int"]), EncodeError),
    (([1], ["boolean"]), EncodeError),
    (([1], ["string"]), EncodeError),
    ((["a"], ["binary"]), EncodeError),
    (([b"a"], ["string"]), EncodeError),
    (([True], ["double"]), EncodeError),
    ((["1.0"], ["double"]), EncodeError),
    (([1 << 2000], ["double"]), EncodeError),
    (([dt.datetime(2020, 1, 1)], ["date"]), EncodeError),
    (([dt.date(2020, 1, 1)], ["timestamp"]), EncodeError),
    ((["\ud800"], None), EncodeError),
    (([object()], None), EncodeError),
    (([1j], None), EncodeError),
    (([[1]], None), EncodeError),
]


@pytest.mark.parametrize("args,error", ERROR_CASES, ids=[str(i) for i in range(len(ERROR_CASES))])
def test_errors_same_class(impl, args, error):
    with pytest.raises(error):
        impl.spark_xxhash64(*args)
    if error is EncodeError:
        with pytest.raises(error, match="row 1"):
            impl.hash_rows([[None] * len(args[0]), args[0]], args[1])


def test_hash_rows_arguments(impl):
    assert impl.hash_rows([]).tolist() == []
    assert impl.hash_rows(iter([("a",), ("b",)])).tolist() == [impl.spark_xxhash64(["a"]), impl.spark_xxhash64(["b"])]
    assert impl.hash_rows([["a"], ("a",), np.array([1, 2])[:0]]).tolist()[0] == impl.spark_xxhash64(("a",))
    for bad in ("abc", b"abc", 5, None, [5], ["abc"]):
        with pytest.raises(InterfaceError):
            impl.hash_rows(bad)
    with pytest.raises(InterfaceError):
        impl.hash_rows([("a",)], ["nope"])
    with pytest.raises(InterfaceError):
        impl.hash_rows([("a",)], seed="x")


def test_numpy_and_subclass_values(impl):
    assert impl.spark_xxhash64([np.int32(7)], ["int"]) == impl.spark_xxhash64([7], ["int"])
    assert impl.spark_xxhash64([np.bool_(True)]) == impl.spark_xxhash64([True])
    assert impl.spark_xxhash64([np.float64(2.5)]) == impl.spark_xxhash64([2.5])
    assert impl.spark_xxhash64([np.float32(2.5)], ["double"]) == impl.spark_xxhash64([2.5])

    class MyStr(str):
        pass

    class MyInt(int):
        pass

    class MyTuple(tuple):
        pass

    assert impl.spark_xxhash64([MyStr("ab"), MyInt(3)]) == impl.spark_xxhash64(["ab", 3])
    assert impl.spark_xxhash64(MyTuple(("ab",))) == impl.spark_xxhash64(("ab",))
    assert impl.hash_rows([MyTuple(("ab",))]).tolist() == [impl.spark_xxhash64(("ab",))]


# --------------------------------------------------------------------------------------------
# key groups
# --------------------------------------------------------------------------------------------
@HSETTINGS
@given(h=st.integers(*I64), g=st.integers(1, (1 << 31) - 1))
def test_key_group_is_pmod(h, g):
    expected = h % g  # Python's % is pmod for g > 0
    for mod in _impls():
        assert mod.key_group(h, g) == expected
        assert mod.key_groups(np.array([h, h], dtype=np.int64), g).tolist() == [expected, expected]


def test_key_groups_vectorized(impl):
    rnd = np.random.default_rng(1)
    hashes = rnd.integers(I64[0], I64[1], size=10_000, dtype=np.int64, endpoint=True)
    hashes[:3] = [I64[0], I64[1], -1]
    for g in (1, 7, 4096, (1 << 31) - 1):
        out = impl.key_groups(hashes, g)
        assert out.dtype == np.int32
        assert out.tolist() == [int(h) % g for h in hashes]
    assert impl.key_groups([], 5).dtype == np.int32
    assert impl.key_groups([-1, 3], 5).tolist() == [4, 3]
    assert impl.key_groups(np.array([1, 2], dtype=np.int32), 2).tolist() == [1, 0]
    assert impl.key_groups(hashes[::3], 11).tolist() == [int(h) % 11 for h in hashes[::3]]
    for bad in (np.array([1], dtype=np.uint64), np.array([1.5]), [1 << 64], np.zeros((2, 2), np.int64), 5):
        with pytest.raises(InterfaceError):
            impl.key_groups(bad, 5)
    for g in (0, -1, 1 << 31, 2.0, True):
        with pytest.raises(InterfaceError):
            impl.key_groups([1], g)
        with pytest.raises(InterfaceError):
            impl.key_group(1, g)
    for h in (1 << 63, -(1 << 63) - 1, 1.0):
        with pytest.raises(InterfaceError):
            impl.key_group(h, 5)


@pytest.mark.parametrize("g,n", [(1, 1), (7, 7), (10, 3), (4096, 1), (4096, 7), (4096, 4096), (128, 100), (1000, 999)])
def test_key_group_ranges_consistent(impl, g, n):
    covered = []
    for p in range(n):
        r = impl.key_group_range(p, n, g)
        assert isinstance(r, range) and r.step == 1 and len(r) >= 1
        assert r.start == -(-p * g // n)
        for kg in r:
            assert impl.partition_of_key_group(kg, g, n) == p
        covered.extend(r)
    assert covered == list(range(g))


def test_partition_errors(impl):
    for args in [(0, 4, 5), (0, 4, 0), (4, 4, 2), (-1, 4, 2), (0, 0, 0), (0.0, 4, 2)]:
        with pytest.raises(InterfaceError):
            impl.partition_of_key_group(*args)
    for args in [(2, 2, 4), (-1, 2, 4), (0, 5, 4), (0, 0, 4), (0, 1, 0)]:
        with pytest.raises(InterfaceError):
            impl.key_group_range(*args)


# --------------------------------------------------------------------------------------------
# 3. against real Spark
# --------------------------------------------------------------------------------------------
SPARK_COLS = [
    # (column, Spark type name, Spark DDL type)
    ("s", "string", "string"),
    ("i", "int", "int"),
    ("l", "bigint", "bigint"),
    ("b", "boolean", "boolean"),
    ("bin", "binary", "binary"),
    ("d", "double", "double"),
    ("f", "float", "float"),
    ("t", "tinyint", "tinyint"),
    ("sm", "smallint", "smallint"),
    ("dt", "date", "date"),
    ("ts", "timestamp", "timestamp"),
    ("ntz", "timestamp_ntz", "timestamp_ntz"),
]
COMBOS = [
    ["s"], ["i"], ["l"], ["b"], ["bin"], ["d"], ["f"], ["t"], ["sm"], ["dt"], ["ts"], ["ntz"],
    ["s", "i"], ["i", "s"], ["l", "d", "b"], ["bin", "f", "t", "sm"], ["dt", "ts", "s"],
    [name for name, _, _ in SPARK_COLS],
]
KEY_GROUPS = [7, 4096]


def _spark_rows(n: int, seed: int = 20240601):
    rnd = random.Random(seed)
    special_d = [0.0, -0.0, math.nan, -math.nan, math.inf, -math.inf, 5e-324, -5e-324, 2.2250738585072014e-308,
                 1.7976931348623157e308, 1e-310, 0.1, -1.5, struct.unpack("<d", struct.pack("<Q", 0x7FF0000000000001))[0]]
    special_f = [0.0, -0.0, math.nan, math.inf, -math.inf, 1e-45, -1e-45, 1.17549435e-38, 3.4028234663852886e38,
                 0.1, 1e39, -1e39, -1e-50, 1e-50, 3.4028235677973366e38, 16777217.0]
    special_s = ["", "a", "é", "日本語", "😀 emoji", "\x00", "x" * 31, "y" * 32, "z" * 33, "k" * 200, "A\u0301"]

    def maybe(v, keep=False):
        return v if keep or rnd.random() >= 0.1 else None

    def rand_str():
        k = rnd.choice([0, 1, 3, 8, 31, 32, 33, 64, 100])
        alphabet = "abcXYZ019 éüñ日本😀\u0301"
        return "".join(rnd.choice(alphabet) for _ in range(k))

    def rand_double():
        r = rnd.random()
        if r < 0.3:
            return rnd.choice(special_d)
        if r < 0.6:
            return struct.unpack("<d", struct.pack("<Q", rnd.getrandbits(64)))[0]
        return rnd.uniform(-1e6, 1e6)

    def rand_float():
        r = rnd.random()
        if r < 0.3:
            return rnd.choice(special_f)
        if r < 0.6:
            return struct.unpack("<f", struct.pack("<I", rnd.getrandbits(32)))[0]
        return rnd.uniform(-1e4, 1e4)

    rows = []
    for k in range(n):
        ts_micros = rnd.randrange(-62135596800 * 10**6, 253402300799 * 10**6)
        ts = dt.datetime(1970, 1, 1, tzinfo=UTC) + dt.timedelta(microseconds=ts_micros)
        if rnd.random() < 0.5:
            ts = dt.datetime(rnd.randrange(1900, 2100), rnd.randrange(1, 13), rnd.randrange(1, 29),
                             rnd.randrange(24), rnd.randrange(60), rnd.randrange(60), rnd.randrange(10**6), tzinfo=UTC)
        ntz = ts.replace(tzinfo=None)
        row = (
            k,
            maybe(special_s[k], True) if k < len(special_s) else maybe(rand_str()),
            maybe(rnd.choice([0, 1, -1, I32[0], I32[1], rnd.randrange(*I32)])),
            maybe(rnd.choice([0, 1, -1, I64[0], I64[1], rnd.randrange(*I64)])),
            maybe(rnd.random() < 0.5),
            maybe(bytes(rnd.getrandbits(8) for _ in range(rnd.choice([0, 1, 4, 8, 31, 32, 33, 70])))),
            maybe(special_d[k], True) if k < len(special_d) else maybe(rand_double()),
            maybe(special_f[k], True) if k < len(special_f) else maybe(rand_float()),
            maybe(rnd.randrange(-128, 128)),
            maybe(rnd.randrange(-32768, 32768)),
            maybe(dt.date.fromordinal(rnd.randrange(1, dt.date(9999, 12, 31).toordinal() + 1))),
            maybe(ts),
            maybe(ntz),
        )
        rows.append(row)
    rows.append((n,) + (None,) * len(SPARK_COLS))  # all null
    return rows


@pytest.mark.spark
def test_against_spark(spark):
    from pyspark.sql import functions as F

    rows = _spark_rows(300)
    schema = "id bigint, " + ", ".join(f"{c} {ddl}" for c, _, ddl in SPARK_COLS)
    df = spark.createDataFrame(rows, schema=schema)
    exprs = [F.col("id")] + [F.col(c) for c, _, _ in SPARK_COLS]
    for k, combo in enumerate(COMBOS):
        exprs.append(F.xxhash64(*[F.col(c) for c in combo]).alias(f"h{k}"))
    for g in KEY_GROUPS:
        exprs.append(F.expr(f"pmod(xxhash64({', '.join(COMBOS[-1])}), {g})").alias(f"kg{g}"))
        exprs.append(F.expr(f"pmod(xxhash64(s, i), {g})").alias(f"kgsi{g}"))
    exprs.append(F.xxhash64(F.col("s"), F.lit(None)).alias("h_void"))
    # the only Spark job of this test
    table = df.select(*exprs).toArrow()

    ids = table.column("id").to_pylist()
    assert sorted(ids) == list(range(len(rows)))
    by_id = {r[0]: r for r in rows}
    ordered = [by_id[i] for i in ids]
    col_index = {c: k + 1 for k, (c, _, _) in enumerate(SPARK_COLS)}
    col_type = {c: t for c, t, _ in SPARK_COLS}
    mods = _impls()
    mismatches = []
    for k, combo in enumerate(COMBOS):
        spark_h = table.column(f"h{k}").to_pylist()
        types = [col_type[c] for c in combo]
        py_rows = [tuple(r[col_index[c]] for c in combo) for r in ordered]
        arrow_cols = [table.column(c) for c in combo]
        for mod in mods:
            single = [mod.spark_xxhash64(r, types) for r in py_rows]
            batch = mod.hash_rows(py_rows, types).tolist()
            arrow = mod.hash_arrow(arrow_cols).tolist()
            for name, got in (("spark_xxhash64", single), ("hash_rows", batch), ("hash_arrow", arrow)):
                bad = [(py_rows[i], spark_h[i], got[i]) for i in range(len(ids)) if got[i] != spark_h[i]]
                if bad:
                    mismatches.append((mod.__name__, name, combo, len(bad), bad[:3]))
        if all(col_type[c] not in ("int", "float", "tinyint", "smallint") for c in combo):
            # also with inferred types (no int/float columns, which would be inferred as bigint/double)
            for mod in mods:
                assert mod.hash_rows(py_rows).tolist() == spark_h, (mod.__name__, combo)
    assert not mismatches, mismatches

    assert table.column("h_void").to_pylist() == table.column("h0").to_pylist()

    all_rows = [tuple(r[1:]) for r in ordered]
    all_types = [t for _, t, _ in SPARK_COLS]
    for g in KEY_GROUPS:
        spark_kg = table.column(f"kg{g}").to_pylist()
        spark_kgsi = table.column(f"kgsi{g}").to_pylist()
        for mod in mods:
            hashes = mod.hash_rows(all_rows, all_types)
            assert [mod.key_group(int(h), g) for h in hashes] == spark_kg
            assert mod.key_groups(hashes, g).tolist() == spark_kg
            hsi = mod.hash_rows([(r[0], r[1]) for r in all_rows], ["string", "int"])
            assert mod.key_groups(hsi, g).tolist() == spark_kgsi
