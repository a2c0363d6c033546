"""Overlay batch operations: compiled and reference twins agree (dict contents, accounting,
answer bytes, errors) on random and garbage input, and a bad batch changes nothing."""
from __future__ import annotations

import struct

import pytest
from conftest import implementations, resolve_impl
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from statestore_async.codecs import twins
from statestore_async.errors import StateStoreError

IMPLS = implementations("overlay")
FR = twins.reference("framing")
OVERHEAD = 106
SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
native_only = pytest.mark.skipif(twins.NO_EXTENSIONS, reason="compiled modules disabled")

keys = st.binary(min_size=0, max_size=6)
values = st.binary(max_size=10)
maps = st.dictionaries(st.binary(min_size=2, max_size=4), st.one_of(st.none(), values), max_size=12)
base_maps = st.dictionaries(st.binary(min_size=2, max_size=4), values, max_size=12)


@pytest.fixture(params=IMPLS)
def ov(request):
    return resolve_impl(request.param)


def _outcome(fn, *args, **kw):
    try:
        return ("ok", fn(*args, **kw))
    except (StateStoreError, TypeError) as exc:
        return (type(exc).__name__, str(exc))


def _accounted(d: dict) -> int:
    return sum(len(k) + (len(v) if v is not None else 0) + OVERHEAD for k, v in d.items())


# --- behaviour --------------------------------------------------------------------------------------
@SETTINGS
@given(start=maps, items=st.lists(st.tuples(st.binary(min_size=2, max_size=4), values), max_size=20))
def test_put_items_and_put_packed_set_in_order_and_account_exactly(ov, start, items):
    for put in (lambda o: ov.put_items(o, items, 2, OVERHEAD),
                lambda o: ov.put_packed(o, b"xy" + FR.encode_pairs(items), 2, 2, OVERHEAD)[1]):
        o = dict(start)
        delta = put(o)
        want = dict(start)
        want.update(items)
        assert o == want
        assert delta == _accounted(o) - _accounted(start)


@SETTINGS
@given(start=maps, ks=st.lists(st.binary(min_size=2, max_size=4), max_size=20))
def test_removes_are_tombstones(ov, start, ks):
    for rm in (lambda o: ov.remove_keys(o, ks, 2, OVERHEAD),
               lambda o: ov.remove_packed(o, FR.encode_list(ks), 0, 2, OVERHEAD)[1]):
        o = dict(start)
        delta = rm(o)
        assert o == {**start, **dict.fromkeys(ks)}
        assert delta == _accounted(o) - _accounted(start)


@SETTINGS
@given(overlay=maps, base=base_maps, ks=st.lists(st.binary(min_size=0, max_size=4), max_size=20))
def test_reads_see_the_overlay_then_the_base(ov, overlay, base, ks):
    want = [overlay[k] if k in overlay else base.get(k) for k in ks]
    assert ov.get_list(overlay, base, ks) == want
    assert ov.get_packed(overlay, base, FR.encode_list(ks), 0) == FR.encode_optional_list(want)
    assert ov.get_packed(overlay, base, b"\x01\x02" + FR.encode_list(ks), 2) == FR.encode_optional_list(want)


def test_a_bad_batch_changes_nothing(ov):
    o = {b"\x00\x01a": b"old"}
    for bad in ([(b"\x00\x01b", b"v"), (b"x", b"v")], [(b"\x00\x01b", b"v"), (b"\x00\x01c", "str")],
                [(b"\x00\x01b", b"v"), ("str", b"v")], [(b"\x00\x01b", b"v"), (b"\x00\x01c",)]):
        with pytest.raises(StateStoreError):
            ov.put_items(o, bad, 2, OVERHEAD)
    with pytest.raises(StateStoreError):
        ov.remove_keys(o, [b"\x00\x01a", b"z"], 2, OVERHEAD)
    packed = FR.encode_pairs([(b"\x00\x01b", b"v"), (b"z", b"v")])
    with pytest.raises(StateStoreError, match="key group"):
        ov.put_packed(o, packed, 0, 2, OVERHEAD)
    for cut in range(len(packed)):
        with pytest.raises(StateStoreError):
            ov.put_packed(o, FR.encode_pairs([(b"\x00\x01b", b"v")] * 3)[:cut], 0, 2, OVERHEAD)
    with pytest.raises(StateStoreError, match="trailing"):
        ov.put_packed(o, FR.encode_pairs([(b"\x00\x01b", b"v")]) + b"!", 0, 2, OVERHEAD)
    assert o == {b"\x00\x01a": b"old"}


def test_bytes_like_keys_and_values_are_copied(ov):
    o = {}
    ov.put_items(o, [(bytearray(b"\x00\x01k"), memoryview(b"v"))], 2, OVERHEAD)
    assert o == {b"\x00\x01k": b"v"} and all(type(x) is bytes for x in (*o, *o.values()))


# --- the twins agree, on anything ---------------------------------------------------------------------
@native_only
@settings(max_examples=400, deadline=None)
@given(data=st.binary(max_size=80), offset=st.integers(0, 10), max_count=st.integers(0, 20),
       overlay=maps, base=base_maps, min_key=st.integers(0, 3))
def test_reference_and_native_agree_on_any_bytes(data, offset, max_count, overlay, base, min_key):
    ref, nat = twins.reference("overlay"), twins.native("overlay")
    for name in ("put_packed", "remove_packed"):
        o1, o2 = dict(overlay), dict(overlay)
        assert _outcome(getattr(ref, name), o1, data, offset, min_key, OVERHEAD, max_count) == \
            _outcome(getattr(nat, name), o2, data, offset, min_key, OVERHEAD, max_count)
        assert o1 == o2
    assert _outcome(ref.get_packed, overlay, base, data, offset, max_count) == \
        _outcome(nat.get_packed, overlay, base, data, offset, max_count)


@native_only
@settings(max_examples=300, deadline=None)
@given(overlay=maps, base=base_maps, items=st.lists(st.one_of(
    st.tuples(keys, values), st.tuples(keys, st.one_of(st.none(), st.text(max_size=2), st.integers())),
    st.tuples(st.one_of(st.text(max_size=3), st.integers(), st.builds(bytearray, keys)), values),
    st.tuples(keys), st.just(b"ab"), st.none()), max_size=8))
def test_reference_and_native_agree_on_python_batches(overlay, base, items):
    ref, nat = twins.reference("overlay"), twins.native("overlay")
    o1, o2 = dict(overlay), dict(overlay)
    assert _outcome(ref.put_items, o1, items, 2, OVERHEAD) == _outcome(nat.put_items, o2, items, 2, OVERHEAD)
    assert o1 == o2
    ks = [it[0] if isinstance(it, tuple) and it else it for it in items]
    o1, o2 = dict(overlay), dict(overlay)
    assert _outcome(ref.remove_keys, o1, ks, 2, OVERHEAD) == _outcome(nat.remove_keys, o2, ks, 2, OVERHEAD)
    assert o1 == o2
    hashable = [k for k in ks if isinstance(k, (bytes, str, int))]
    assert ref.get_list(overlay, base, hashable) == nat.get_list(overlay, base, hashable)


def test_huge_counts_fail_before_allocating(ov):
    data = struct.pack("<I", 0xFFFFFFF0) + b"\x00" * 16
    for call in (lambda: ov.put_packed({}, data, 0, 2, OVERHEAD), lambda: ov.remove_packed({}, data, 0, 2, OVERHEAD),
                 lambda: ov.get_packed({}, {}, data, 0)):
        with pytest.raises(StateStoreError, match="cannot fit"):
            call()


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.binary(min_size=2, max_size=6), st.binary(max_size=8), max_size=30),
       st.dictionaries(st.binary(min_size=2, max_size=6), st.none() | st.binary(max_size=8), max_size=30))
def test_apply_changes_ref_and_native_agree(data, changes):
    from statestore_async.codecs import twins

    outs = []
    for impl in (twins.reference("overlay"), twins.native("overlay")):
        d = dict(data)
        changes = dict(changes)
        pre, records, data_delta, undo_bytes, record_bytes = impl.apply_changes(d, changes, 50)
        outs.append((d, pre, records, data_delta, undo_bytes, record_bytes))
        # the map is what applying the changes means, and the accounting follows it
        expected = dict(data)
        for key, v in changes.items():
            if v is None:
                expected.pop(key, None)
            else:
                expected[key] = v
        assert d == expected
        size = lambda m: sum(len(a) + len(b) + 50 for a, b in m.items())
        assert data_delta == size(d) - size(data)
        assert set(records) == {key for key, v in changes.items() if v is not None or key in data}
        assert list(records) == [key for key in changes if key in records]  # the changes' order
        assert pre == [data.get(key) for key in records]
        assert (records is changes) == (len(records) == len(changes))  # no copy when nothing is dropped
    assert outs[0] == outs[1]


# --- a frozen view's records by key group, for snapshots ----------------------------------------------
_BOTH = [twins.reference("overlay")] + ([] if twins.NO_EXTENSIONS else [twins.native("overlay")])


def _kg_of(k: bytes) -> int:
    return (k[0] << 8) | k[1] if len(k) >= 2 else 0


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=4), max_size=60, unique=True),
       st.dictionaries(st.binary(max_size=4), st.none() | st.binary(max_size=8), max_size=20),
       st.dictionaries(st.binary(max_size=4), st.binary(max_size=8), max_size=40),
       st.integers(1, 9), st.integers(0, 60))
def test_group_and_gather_ref_and_native_agree(keys, shadow, data, chunk, max_bytes):
    runs = []
    for ov in _BOTH:
        groups = [None] * ov.KEY_GROUP_SLOTS
        for start in range(0, len(keys) + 1, chunk):
            ov.group_records(keys, start, start + chunk, dict(shadow), dict(data), groups)
        filled = {g: list(s) for g, s in enumerate(groups) if s is not None}
        blocks, cursor = [], (0, 0)
        while True:
            records, cursor = ov.gather_records(groups, cursor, max_bytes)
            if not records:
                break
            blocks.append((records, cursor))
        assert all(s is None for s in groups)  # every group let go once handed out
        assert cursor == (ov.KEY_GROUP_SLOTS, 0)
        runs.append((filled, blocks))
    assert all(r == runs[0] for r in runs)
    # what they mean: every key's frozen value (the shadow's first), by key group, in list order
    frozen = [(k, shadow[k] if k in shadow else data.get(k)) for k in keys]
    expected = sorted(((k, v) for k, v in frozen if v is not None), key=lambda kv: _kg_of(kv[0]))
    blocks = runs[0][1]
    assert [r for records, _ in blocks for r in records] == expected
    for records, _ in blocks:  # within the bound unless a single record is larger
        assert len(records) == 1 or sum(len(k) + len(v) + 11 for k, v in records) <= max_bytes


@pytest.mark.parametrize("call", [
    lambda ov: ov.group_records([b"ab"], 0, 1, {}, {b"ab": b"v"}, [None] * 3),
    lambda ov: ov.group_records([b"ab"], 0, 1, {}, {b"ab": b"v"}, (None,) * ov.KEY_GROUP_SLOTS),
    lambda ov: ov.group_records((b"ab",), 0, 1, {}, {b"ab": b"v"}, [None] * ov.KEY_GROUP_SLOTS),
    lambda ov: ov.group_records([b"ab", "ab"], 0, 2, {}, {b"ab": b"v"}, [None] * ov.KEY_GROUP_SLOTS),
    lambda ov: ov.group_records([b"\x00\x01x"], 0, 1, {}, {b"\x00\x01x": b"v"},
                                [None, (b"k", b"v")] + [None] * (ov.KEY_GROUP_SLOTS - 2)),
    lambda ov: ov.gather_records([None] * ov.KEY_GROUP_SLOTS, [0, 0], 10),
    lambda ov: ov.gather_records([None] * ov.KEY_GROUP_SLOTS, (0,), 10),
    lambda ov: ov.gather_records([None] * ov.KEY_GROUP_SLOTS, (-1, 0), 10),
    lambda ov: ov.gather_records([None] * ov.KEY_GROUP_SLOTS, (ov.KEY_GROUP_SLOTS + 1, 0), 10),
    lambda ov: ov.gather_records([b"x"] + [None] * (ov.KEY_GROUP_SLOTS - 1), (0, 0), 10),
])
def test_group_and_gather_errors_agree(call):
    outs = []
    for ov in _BOTH:
        out = _outcome(call, ov)
        assert out[0] in ("InterfaceError", "KeyFormatError"), out
        outs.append(out)
    assert all(o == outs[0] for o in outs)
