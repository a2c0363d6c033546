"""Row codec: format, round trips, determinism, key normalization, and ref/native agreement."""
from __future__ import annotations

import collections
import datetime as dt
import enum
import struct
from decimal import Decimal

import pytest
from conftest import implementations, resolve_impl
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from statestore_async.codecs import twins
from statestore_async.errors import DecodeError, EncodeError

REF = twins.reference("valuecodec")

IMPLS = implementations("valuecodec")


@pytest.fixture(params=IMPLS)
def codec(request):
    return resolve_impl(request.param)


@pytest.fixture
def native():
    if twins.NO_EXTENSIONS:
        pytest.skip("STATESTORE_NO_EXTENSIONS=1: nothing to compare the reference with")
    return twins.native("valuecodec")


def _native_or_none():
    return None if twins.NO_EXTENSIONS else twins.native("valuecodec")


NATIVE = _native_or_none()
both = pytest.mark.skipif(NATIVE is None, reason="compiled module disabled")

# --- strategies ------------------------------------------------------------------------------------
fixed_offsets = st.builds(
    dt.timezone,
    st.timedeltas(min_value=dt.timedelta(hours=-23, minutes=-59), max_value=dt.timedelta(hours=23, minutes=59)),
)
nan_floats = st.integers(0, 2**52 - 1).flatmap(
    lambda m: st.sampled_from([0x7FF0000000000000, 0xFFF0000000000000]).map(
        lambda e: struct.unpack("<d", struct.pack("<Q", e | max(m, 1)))[0]
    )
)
int_edges = st.sampled_from(
    [0, -1, 1, 2**63 - 1, -(2**63), 2**63, -(2**63) - 1, 2**64, -(2**64), 2**64 - 1, 127, 128, -128, -129]
)
hashable_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    int_edges,
    st.integers(min_value=-(2**3000), max_value=2**3000),
    st.floats(allow_nan=False),
    st.text(),
    st.binary(max_size=40),
    st.dates(),
    st.datetimes(),
    st.datetimes(min_value=dt.datetime(2, 1, 1), max_value=dt.datetime(9998, 12, 30), timezones=fixed_offsets),
    st.decimals(allow_nan=True, allow_infinity=True).filter(lambda d: not d.is_snan()),
)
scalars = st.one_of(
    hashable_scalars,
    nan_floats,
    st.floats(),
    st.binary(max_size=20).map(bytearray),
    st.decimals(allow_nan=True),
)
hashable_values = st.recursive(hashable_scalars, lambda c: st.lists(c, max_size=4).map(tuple), max_leaves=8)
values = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=5),
        st.lists(children, max_size=5).map(tuple),
        st.dictionaries(hashable_values, children, max_size=5),
    ),
    max_leaves=25,
)
small_values = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(hashable_scalars, children, max_size=3),
    ),
    max_leaves=8,
)


def canon(v):
    """A form of a decoded or original value that compares by encoding semantics."""
    if isinstance(v, bool) or v is None:
        return v
    if isinstance(v, int):
        return ("i", int(v))
    if isinstance(v, float):
        return ("f", struct.pack("<d", v))
    if isinstance(v, str):
        return ("s", str(v))
    if isinstance(v, (bytes, bytearray, memoryview)):
        return ("b", bytes(v))
    if isinstance(v, tuple):
        return ("t", tuple(canon(x) for x in v))
    if isinstance(v, list):
        return ("l", tuple(canon(x) for x in v))
    if isinstance(v, dict):
        return ("d", tuple(sorted(((REF.encode_row(k), canon(x)) for k, x in v.items()), key=lambda p: p[0])))
    if isinstance(v, dt.datetime):
        if v.utcoffset() is None:
            return ("dt", v.replace(fold=0))
        return ("dtu", (v.replace(tzinfo=None) - v.utcoffset()))
    if isinstance(v, dt.date):
        return ("d8", v)
    if isinstance(v, Decimal):
        return ("dec", str(v))
    raise AssertionError(type(v))


def normalize_key(v):
    """What encode_key does to floats, applied by hand."""
    if isinstance(v, float):
        if v != v:
            return float("nan")
        return 0.0 if v == 0 else v
    if isinstance(v, tuple):
        return tuple(normalize_key(x) for x in v)
    if isinstance(v, list):
        return [normalize_key(x) for x in v]
    if isinstance(v, dict):
        return {normalize_key(k): normalize_key(x) for k, x in v.items()}
    return v


def outcome(fn, *args):
    try:
        return ("ok", canon(fn(*args)))
    except DecodeError as exc:
        return ("DecodeError", str(exc))
    except EncodeError as exc:
        return ("EncodeError", str(exc))


# --- fixed examples ---------------------------------------------------------------------------------
Point = collections.namedtuple("Point", "x y")


class Color(enum.IntEnum):
    RED = 1


class MyStr(str):
    pass


class MyFloat(float):
    pass


EXAMPLES = [
    (None, "00"),
    (False, "01"),
    (True, "02"),
    (0, "0300"),
    (-1, "0301"),
    (1, "0302"),
    (2**63 - 1, "03feffffffffffffffff01"),
    (-(2**63), "03ffffffffffffffffff01"),
    (2**63, "0409008000000000000000"),
    (-(2**63) - 1, "0409ff7fffffffffffffff"),
    (1.5, "05000000000000f83f"),
    (-0.0, "050000000000000080"),
    ("", "0600"),
    ("hé", "060368c3a9"),
    ("\U0001F600", "0604f09f9880"),
    (b"ab", "07026162"),
    ((), "0800"),
    ((1, "a"), "08020302060161"),
    ([None], "090100"),
    ({}, "0a00"),
    ({"b": 1, "a": 2}, "0a0206016103040601620302"),
    (dt.date(1970, 1, 2), "0b02"),
    (dt.date(1969, 12, 31), "0b01"),
    (dt.datetime(1970, 1, 1, 0, 0, 0, 1), "0c02"),
    (dt.datetime(1970, 1, 1, 1, tzinfo=dt.timezone(dt.timedelta(hours=1))), "0d00"),
    (Decimal("1.5"), "0e03312e35"),
]


@pytest.mark.parametrize("value,hexed", EXAMPLES, ids=[repr(v)[:30] for v, _ in EXAMPLES])
def test_known_encodings(codec, value, hexed):
    assert codec.encode_row(value).hex() == hexed
    assert canon(codec.decode_row(bytes.fromhex(hexed))) == canon(value)


def test_subclasses_encode_as_base_types(codec):
    assert codec.encode_row(Point(1, "a")) == codec.encode_row((1, "a"))
    assert type(codec.decode_row(codec.encode_row(Point(1, 2)))) is tuple
    assert codec.encode_row(Color.RED) == codec.encode_row(1)
    assert codec.encode_row(MyStr("x")) == codec.encode_row("x")
    assert codec.encode_row(MyFloat(2.5)) == codec.encode_row(2.5)
    assert codec.encode_row(bytearray(b"xy")) == codec.encode_row(b"xy") == codec.encode_row(memoryview(b"xy"))
    assert codec.decode_row(codec.encode_row(bytearray(b"xy"))) == b"xy"
    assert codec.encode_row(memoryview(b"abcd")[::2]) == codec.encode_row(b"ac")
    assert codec.encode_row(collections.OrderedDict(a=1)) == codec.encode_row({"a": 1})


def test_bool_before_int(codec):
    assert codec.encode_row(True) != codec.encode_row(1)
    assert codec.decode_row(codec.encode_row(True)) is True
    assert codec.encode_row([True, 1, 1.0]) == bytes.fromhex("0903020302") + codec.encode_row(1.0)


def test_datetimes(codec):
    naive = dt.datetime(2024, 2, 29, 12, 30, 45, 123456)
    assert codec.decode_row(codec.encode_row(naive)) == naive
    assert codec.decode_row(codec.encode_row(naive)).tzinfo is None
    aware = naive.replace(tzinfo=dt.timezone(dt.timedelta(hours=-5)))
    back = codec.decode_row(codec.encode_row(aware))
    assert back == aware and back.tzinfo is dt.UTC
    assert codec.encode_row(aware) == codec.encode_row(aware.astimezone(dt.UTC))
    for v in (dt.datetime.min, dt.datetime.max, dt.date.min, dt.date.max, dt.date(1600, 2, 29)):
        assert codec.decode_row(codec.encode_row(v)) == v
    with pytest.raises(EncodeError, match="out of range"):
        codec.encode_row(dt.datetime.min.replace(tzinfo=dt.timezone(dt.timedelta(hours=1))))


def test_decimals(codec):
    for text in ("0", "-0", "1.20", "1E+5", "-1.5E-7", "NaN", "-sNaN12", "Infinity", "123456789012345678901234567890"):
        d = Decimal(text)
        back = codec.decode_row(codec.encode_row(d))
        assert str(back) == str(d)
    with pytest.raises(DecodeError, match="decimal"):
        codec.decode_row(b"\x0e\x02 1")
    with pytest.raises(DecodeError, match="decimal"):
        codec.decode_row(b"\x0e\x031e5")


def test_unsupported_types(codec):
    for bad in (object(), {1, 2}, 1j, frozenset(), dt.time(1), dt.timedelta(1), type):
        with pytest.raises(EncodeError, match=type(bad).__name__):
            codec.encode_row(bad)
    with pytest.raises(EncodeError, match="UTF-8"):
        codec.encode_row("a\ud800")
    with pytest.raises(EncodeError, match="too large"):
        codec.encode_row(2 ** (8 * 1024))
    assert codec.decode_row(codec.encode_row(2 ** (8 * 1024 - 2))) == 2 ** (8 * 1024 - 2)
    with pytest.raises(EncodeError, match="same encoding"):
        codec.encode_row({float("nan"): 1, float("nan"): 2})
    with pytest.raises(EncodeError, match="row 1"):
        codec.encode_rows([1, object()])


def test_depth_limit(codec):
    def nest(n, make):
        v = None
        for _ in range(n):
            v = make(v)
        return v

    for make in (lambda v: [v], lambda v: (v,), lambda v: {"k": v}):
        ok = nest(100, make)
        assert canon(codec.decode_row(codec.encode_row(ok))) == canon(ok)
        with pytest.raises(EncodeError, match="deeper"):
            codec.encode_row(nest(101, make))
    loop = []
    loop.append(loop)
    with pytest.raises(EncodeError, match="deeper"):
        codec.encode_row(loop)
    assert codec.decode_row(b"\x09\x01" * 100 + b"\x00") is not None
    for prefix in (b"\x09\x01", b"\x08\x01", b"\x0a\x01\x00"):
        with pytest.raises(DecodeError, match="deeper"):
            codec.decode_row(prefix * 101 + b"\x00")
        with pytest.raises(DecodeError):
            codec.decode_row(prefix * 100000)


@pytest.mark.parametrize(
    "data,message",
    [
        (b"", "truncated"),
        (b"\x03", "truncated varint"),
        (b"\x03\x80\x00", "non-canonical"),
        (b"\x03" + b"\xff" * 9 + b"\x02", "overflows"),
        (b"\x03" + b"\xff" * 11, "overflows"),
        (b"\x00\x00", "trailing"),
        (b"\x20", "unknown tag 0x20"),
        (b"\x04\x01\x05", "int64"),
        (b"\x04\x00", "bigint length 0"),
        (b"\x04\x0a\x00\x00\x80\x00\x00\x00\x00\x00\x00\x00", "non-minimal"),
        (b"\x04\x0a\xff\xff\x7f\xff\xff\xff\xff\xff\xff\xff", "non-minimal"),
        (b"\x05\x00\x00", "truncated float"),
        (b"\x06\x05ab", "exceeds"),
        (b"\x06\x02\xc3\x28", "UTF-8"),
        (b"\x06\x03\xed\xa0\x80", "UTF-8"),
        (b"\x07\xff\xff\xff\xff\xff\xff\xff\xff\x7f", "exceeds"),
        (b"\x08\xff\xff\xff\xff\xff\xff\xff\xff\x7f", "count"),
        (b"\x09\x80\x80\x80\x80\x10", "count"),
        (b"\x0a\x02\x00\x00\x00\x00", "out of order"),
        (b"\x0a\x02\x03\x04\x00\x03\x02\x00", "out of order"),
        (b"\x0a\x02\x03\x02\x00\x05\x00\x00\x00\x00\x00\x00\xf0\x3f\x00", "equals an earlier key"),
        (b"\x0a\x01\x09\x00\x00", "unhashable"),
        (b"\x0a\x01\x0e\x04sNaN\x00", "unhashable"),
        (b"\x0b\xfe\xff\xff\xff\xff\xff\xff\xff\xff\x01", "date out of range"),
        (b"\x0c\xfe\xff\xff\xff\xff\xff\xff\xff\xff\x01", "datetime out of range"),
        (b"\x0e\x02\xc3\xa9", "decimal"),
    ],
)
def test_decode_errors(codec, data, message):
    with pytest.raises(DecodeError, match=message):
        codec.decode_row(data)


def test_decode_inputs(codec):
    enc = codec.encode_row(("x", 1))
    assert codec.decode_row(bytearray(enc)) == ("x", 1)
    assert codec.decode_row(memoryview(b"zz" + enc)[2:]) == ("x", 1)
    assert codec.decode_rows([enc, bytearray(enc), memoryview(enc)]) == [("x", 1)] * 3
    with pytest.raises(TypeError):
        codec.decode_row("text")
    with pytest.raises(TypeError):
        codec.decode_row(memoryview(enc + enc)[::2])
    with pytest.raises(DecodeError, match="row 1"):
        codec.decode_rows([enc, enc + b"\x00"])


def test_batch_forms(codec):
    rows = [("k%08d" % i, i) for i in range(1000)] + [None, 1.5, {"a": [1, 2]}]
    encoded = codec.encode_rows(rows)
    assert encoded == [codec.encode_row(r) for r in rows]
    assert codec.decode_rows(encoded) == rows
    assert codec.encode_keys([-0.0, (float("-nan"),)]) == [codec.encode_key(-0.0), codec.encode_key((float("-nan"),))]
    assert codec.encode_rows(iter([1, 2])) == [codec.encode_row(1), codec.encode_row(2)]


def test_encode_key_normalization(codec):
    neg_nan = struct.unpack("<d", struct.pack("<Q", 0xFFF8000000000001))[0]
    assert codec.encode_row(-0.0) != codec.encode_row(0.0)
    assert codec.encode_key(-0.0) == codec.encode_row(0.0)
    assert codec.encode_row(neg_nan)[1:] == struct.pack("<Q", 0xFFF8000000000001)
    assert codec.encode_key(neg_nan)[1:] == struct.pack("<Q", 0x7FF8000000000000)
    assert codec.encode_key({"a": [(-0.0, neg_nan)]}) == codec.encode_row({"a": [(0.0, float("nan"))]})
    assert codec.encode_key(float("inf")) == codec.encode_row(float("inf"))


# --- properties ------------------------------------------------------------------------------------
@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(v=values)
def test_roundtrip_and_ref_native_identical(v):
    enc = REF.encode_row(v)
    assert canon(REF.decode_row(enc)) == canon(v)
    assert REF.encode_row(REF.decode_row(enc)) == enc
    key = REF.encode_key(v)
    assert key == REF.encode_row(normalize_key(v))
    assert REF.encode_key(REF.decode_row(key)) == key
    if NATIVE is not None:
        assert NATIVE.encode_row(v) == enc
        assert NATIVE.encode_key(v) == key
        assert canon(NATIVE.decode_row(enc)) == canon(v)
        assert NATIVE.encode_rows([v, v]) == [enc, enc]
        assert NATIVE.encode_keys([v]) == [key]
        assert [canon(x) for x in NATIVE.decode_rows([enc, key])] == [canon(x) for x in REF.decode_rows([enc, key])]


@settings(max_examples=300, deadline=None)
@given(d=st.dictionaries(hashable_values, small_values, max_size=6), data=st.data())
def test_dict_order_does_not_matter(d, data):
    items = list(d.items())
    shuffled = dict(data.draw(st.permutations(items)))
    for m in filter(None, (REF, NATIVE)):
        assert m.encode_row(shuffled) == m.encode_row(d)
        assert m.encode_key(shuffled) == m.encode_key(d)


@settings(max_examples=500, deadline=None)
@given(v=values)
def test_equal_values_equal_bytes(v):
    import copy

    w = copy.deepcopy(v)
    for m in filter(None, (REF, NATIVE)):
        assert m.encode_row(w) == m.encode_row(v)
        assert m.encode_key(w) == m.encode_key(v)


@both
@settings(max_examples=3000, deadline=None)
@given(data=st.binary(max_size=48))
def test_garbage_agrees(data):
    r = outcome(REF.decode_row, data)
    assert outcome(NATIVE.decode_row, data) == r


tag_heavy = st.lists(
    st.one_of(st.integers(0, 15), st.integers(0, 255), st.sampled_from([0x80, 0xFF, 0x7F, 0x01])), max_size=40
).map(bytes)


@both
@settings(max_examples=3000, deadline=None)
@given(data=tag_heavy)
def test_small_byte_garbage_agrees(data):
    assert outcome(NATIVE.decode_row, data) == outcome(REF.decode_row, data)


mutations = st.lists(
    st.tuples(st.sampled_from(["flip", "truncate", "insert", "delete", "set"]), st.integers(0, 10**6), st.integers(0, 255)),
    min_size=1,
    max_size=3,
)


def mutate(enc: bytes, ops) -> bytes:
    buf = bytearray(enc)
    for op, where, byte in ops:
        pos = where % (len(buf) + 1)
        if op == "flip" and buf:
            buf[pos % len(buf)] ^= 1 << (byte % 8)
        elif op == "truncate":
            del buf[pos:]
        elif op == "insert":
            buf[pos:pos] = bytes([byte])
        elif op == "delete" and buf:
            del buf[pos % len(buf)]
        elif op == "set" and buf:
            buf[pos % len(buf)] = byte
    return bytes(buf)


@both
@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(v=small_values, ops=mutations)
def test_mutated_encodings_agree(v, ops):
    bad = mutate(REF.encode_row(v), ops)
    r = outcome(REF.decode_row, bad)
    assert outcome(NATIVE.decode_row, bad) == r
    assert outcome(NATIVE.decode_row, bytearray(bad)) == r


def test_no_allocation_from_huge_declared_sizes(codec):
    # each of these declares far more than it holds; must fail fast without allocating
    for data in (
        b"\x07" + b"\xff" * 8 + b"\x7f",
        b"\x06\xff\xff\xff\xff\x0f",
        b"\x08\xff\xff\xff\xff\x0f",
        b"\x09\xff\xff\xff\xff\x0f" + b"\x00" * 4,
        b"\x0a\xff\xff\xff\xff\x0f" + b"\x00" * 4,
        b"\x04\xff\x0f",
    ):
        with pytest.raises(DecodeError):
            codec.decode_row(data)
