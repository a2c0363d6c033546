"""Framing: frames and byte-string lists, compiled and reference implementations alike."""
from __future__ import annotations

import struct

import pytest
from conftest import implementations, resolve_impl
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from statestore_async.codecs import twins
from statestore_async.errors import DecodeError, EncodeError

IMPLS = implementations("framing")
blobs = st.binary(max_size=40)
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(params=IMPLS)
def fr(request):
    return resolve_impl(request.param)


def _outcome(fn, *args):
    try:
        return ("ok", fn(*args))
    except (DecodeError, EncodeError) as exc:
        return (type(exc).__name__, str(exc))


# --- frames -----------------------------------------------------------------------------------------
def test_frame_layout(fr):
    data = fr.encode_frame(7, 1, 0xDEADBEEF, b"abc")
    assert data == struct.pack("<IBBI", 3, 7, 1, 0xDEADBEEF) + b"abc"
    assert fr.HEADER_SIZE == 10


def test_split_frames_partial_and_many(fr):
    stream = b"".join(fr.encode_frame(i % 11, 0, i, bytes([i]) * i) for i in range(20))
    for cut in (0, 1, 9, 10, 11, len(stream) - 1, len(stream)):
        frames, consumed, oversized = fr.split_frames(bytearray(stream[:cut]), 1000)
        assert oversized is None
        assert stream[:consumed] == b"".join(fr.encode_frame(*f) for f in frames)
        assert cut - consumed < 10 + 19  # never more than one incomplete frame left
    frames, consumed, _ = fr.split_frames(stream, 1000)
    assert consumed == len(stream)
    assert [f[2] for f in frames] == list(range(20))
    assert frames[5] == (5, 0, 5, b"\x05" * 5)


def test_split_frames_reports_oversized(fr):
    good = fr.encode_frame(2, 0, 1, b"x" * 5)
    bad = struct.pack("<IBBI", 1001, 3, 0, 99)
    frames, consumed, oversized = fr.split_frames(good + bad + b"junk", 1000)
    assert frames == [(2, 0, 1, b"x" * 5)]
    assert consumed == len(good)
    assert oversized == (3, 0, 99, 1001)


def test_encode_frame_rejects_bad_header(fr):
    for args in ((256, 0, 1), (1, -1, 1), (1, 0, 1 << 32)):
        with pytest.raises(EncodeError):
            fr.encode_frame(*args, b"")
    with pytest.raises(EncodeError):
        fr.encode_frame(1, 0, 1, "text")


# --- lists ------------------------------------------------------------------------------------------
@SETTINGS
@given(items=st.lists(blobs, max_size=30), prefix=st.binary(max_size=5))
def test_list_round_trip(fr, items, prefix):
    data = prefix + fr.encode_list(items)
    assert fr.decode_list(data, len(prefix)) == (items, len(data))


@SETTINGS
@given(items=st.lists(st.one_of(st.none(), blobs), max_size=30))
def test_optional_list_round_trip_keeps_none_apart_from_empty(fr, items):
    data = fr.encode_optional_list(items)
    assert fr.decode_optional_list(data) == (items, len(data))


def test_none_and_empty_differ(fr):
    assert fr.decode_optional_list(fr.encode_optional_list([None, b""]))[0] == [None, b""]


@SETTINGS
@given(items=st.lists(st.tuples(blobs, blobs), max_size=30))
def test_pairs_round_trip(fr, items):
    data = fr.encode_pairs(items)
    assert fr.decode_pairs(bytearray(data)) == (items, len(data))


def test_encoders_take_bytes_like_and_refuse_the_rest(fr):
    assert fr.encode_list([bytearray(b"a"), memoryview(b"b")]) == fr.encode_list([b"a", b"b"])
    for bad in (["s"], [None], [1]):
        with pytest.raises(EncodeError):
            fr.encode_list(bad)
    with pytest.raises(EncodeError):
        fr.encode_pairs([(b"k",)])
    with pytest.raises(EncodeError):
        fr.encode_pairs([(b"k", None)])


def test_huge_counts_fail_before_allocating(fr):
    data = struct.pack("<I", 0xFFFFFFF0) + b"\x00" * 16
    for dec in (fr.decode_list, fr.decode_optional_list, fr.decode_pairs):
        with pytest.raises(DecodeError, match="cannot fit"):
            dec(data)
    with pytest.raises(DecodeError, match="at most 3"):
        fr.decode_list(fr.encode_list([b""] * 4), 0, 3)


def test_truncations_and_overruns(fr):
    data = fr.encode_pairs([(b"key", b"value"), (b"k2", b"v2")])
    for cut in range(len(data)):
        with pytest.raises(DecodeError):
            fr.decode_pairs(data[:cut])
    with pytest.raises(DecodeError):
        fr.decode_list(struct.pack("<II", 1, 50) + b"short")
    with pytest.raises(DecodeError, match="offset"):
        fr.decode_list(b"\x00" * 4, 5)
    with pytest.raises(DecodeError):
        fr.decode_list(b"", 0)


# --- the twins agree on garbage ---------------------------------------------------------------------
@pytest.mark.skipif(twins.NO_EXTENSIONS, reason="compiled modules disabled")
@settings(max_examples=400, deadline=None)
@given(data=st.binary(max_size=80), offset=st.integers(0, 10), max_count=st.integers(0, 20))
def test_reference_and_native_agree_on_any_bytes(data, offset, max_count):
    ref, nat = twins.reference("framing"), twins.native("framing")
    for name in ("decode_list", "decode_optional_list", "decode_pairs"):
        assert _outcome(getattr(ref, name), data, offset, max_count) == _outcome(getattr(nat, name), data, offset, max_count)
    assert ref.split_frames(data, max_count) == nat.split_frames(data, max_count)


@pytest.mark.skipif(twins.NO_EXTENSIONS, reason="compiled modules disabled")
@settings(max_examples=200, deadline=None)
@given(items=st.lists(st.one_of(st.none(), blobs), max_size=20))
def test_reference_and_native_encode_the_same_bytes(items):
    ref, nat = twins.reference("framing"), twins.native("framing")
    assert ref.encode_optional_list(items) == nat.encode_optional_list(items)
    present = [x for x in items if x is not None]
    assert ref.encode_list(present) == nat.encode_list(present)
    pairs = list(zip(present, reversed(present)))
    assert ref.encode_pairs(pairs) == nat.encode_pairs(pairs)


# --- validation without decoding, and whole batch frames ------------------------------------------
@SETTINGS
@given(items=st.lists(st.tuples(blobs, blobs), max_size=20), head=st.binary(max_size=6), rid=st.integers(0, 2**32 - 1))
def test_batch_frames_equal_frame_of_head_and_list(fr, items, head, rid):
    assert fr.encode_frame_pairs(5, 0, rid, head, items) == fr.encode_frame(5, 0, rid, head + fr.encode_pairs(items))
    ks = [k for k, _ in items]
    assert fr.encode_frame_list(4, 0, rid, head, iter(ks)) == fr.encode_frame(4, 0, rid, head + fr.encode_list(ks))
    data = head + fr.encode_pairs(items)
    assert fr.check_pairs(data, len(head)) == (len(items), len(data))
    data = head + fr.encode_list(ks)
    assert fr.check_list(data, len(head)) == (len(ks), len(data))


# --- a batch lookup's keys in place, and its answer --------------------------------------------------
@SETTINGS
@given(items=st.lists(blobs, max_size=20), head=st.binary(max_size=6))
def test_list_offsets_point_at_each_item(fr, items, head):
    data = head + fr.encode_list(items)
    offsets, end = fr.list_offsets(data, len(head))
    assert end == len(data)
    offs = list(struct.unpack(f"<{len(items)}q", offsets))
    assert [data[o : o + struct.unpack_from("<I", data, o - 4)[0]] for o in offs] == items


@pytest.mark.skipif(twins.NO_EXTENSIONS, reason="compiled modules disabled")
@settings(max_examples=400, deadline=None)
@given(data=st.binary(max_size=80), offset=st.integers(0, 10), max_count=st.integers(0, 20))
def test_list_offsets_fail_as_decode_list_on_any_bytes(data, offset, max_count):
    ref, nat = twins.reference("framing"), twins.native("framing")
    want = _outcome(ref.decode_list, data, offset, max_count)
    got = [_outcome(m.list_offsets, data, offset, max_count) for m in (ref, nat)]
    assert got[0] == got[1]
    assert got[0][0] == want[0] and (want[0] != "ok" or got[0][1][1] == want[1][1])


@SETTINGS
@given(answer=st.lists(st.tuples(st.integers(0, 2), blobs), max_size=20), pad=st.binary(max_size=5))
def test_encode_found_writes_the_optional_list_of_the_spans(fr, answer, pad):
    import numpy as np
    values, voff, vlen, found, want = bytearray(pad), [], [], [], []
    for kind, v in answer:  # 0: absent, 1: a tombstone, 2: a value (stored after some padding)
        values += pad
        voff.append(len(values) if kind == 2 else 0)
        vlen.append(len(v) if kind == 2 else -1 if kind == 1 else 0)
        found.append(int(kind > 0))
        values += v if kind == 2 else b""
        want.append(v if kind == 2 else None)
    got = fr.encode_found(bytes(values), np.array(voff, np.int64), np.array(vlen, np.int64), np.array(found, np.uint8))
    assert got == fr.encode_optional_list(want)


def test_encode_found_refuses_spans_outside_the_values(fr):
    import numpy as np
    one = np.ones(1, np.uint8)
    with pytest.raises(EncodeError, match="item 0 \\(3 bytes at 2\\) is not inside the 4 bytes"):
        fr.encode_found(b"abcd", np.array([2], np.int64), np.array([3], np.int64), one)
    with pytest.raises(EncodeError, match="not inside"):
        fr.encode_found(b"abcd", np.array([-1], np.int64), np.array([1], np.int64), one)
    with pytest.raises(EncodeError, match="1 found, 2 value offsets"):
        fr.encode_found(b"abcd", np.zeros(2, np.int64), np.zeros(1, np.int64), one)
    assert fr.encode_found(b"abcd", np.array([2], np.int64), np.array([3], np.int64), np.zeros(1, np.uint8)) == \
        fr.encode_optional_list([None])


def test_batch_frames_refuse_what_the_encoders_refuse(fr):
    for bad in ([(b"k",)], [(b"k", None)], [("k", b"v")], [None]):
        with pytest.raises(EncodeError):
            fr.encode_frame_pairs(5, 0, 1, b"", bad)
    with pytest.raises(EncodeError):
        fr.encode_frame_list(4, 0, 1, b"", [b"a", "s"])
    with pytest.raises(EncodeError):
        fr.encode_frame_list(256, 0, 1, b"", [b"a"])
    assert fr.encode_frame_pairs(5, 0, 1, b"", [[bytearray(b"k"), memoryview(b"v")]]) == \
        fr.encode_frame_pairs(5, 0, 1, b"", [(b"k", b"v")])


@pytest.mark.skipif(twins.NO_EXTENSIONS, reason="compiled modules disabled")
@settings(max_examples=400, deadline=None)
@given(data=st.binary(max_size=80), offset=st.integers(0, 10), max_count=st.integers(0, 20))
def test_checks_agree_with_the_decoders_on_any_bytes(data, offset, max_count):
    ref, nat = twins.reference("framing"), twins.native("framing")
    for check, dec in (("check_list", "decode_list"), ("check_pairs", "decode_pairs")):
        want = _outcome(getattr(ref, dec), data, offset, max_count)
        if want[0] == "ok":
            want = ("ok", (len(want[1][0]), want[1][1]))
        assert _outcome(getattr(ref, check), data, offset, max_count) == want
        assert _outcome(getattr(nat, check), data, offset, max_count) == want


@pytest.mark.skipif(twins.NO_EXTENSIONS, reason="compiled modules disabled")
@settings(max_examples=200, deadline=None)
@given(items=st.lists(st.one_of(st.tuples(blobs, blobs), st.tuples(blobs), st.tuples(blobs, st.text(max_size=2)),
                                st.lists(blobs, min_size=2, max_size=2), st.none()), max_size=6),
       head=st.binary(max_size=4), opcode=st.integers(-1, 256))
def test_reference_and_native_batch_frames_agree(items, head, opcode):
    ref, nat = twins.reference("framing"), twins.native("framing")
    assert _outcome(ref.encode_frame_pairs, opcode, 0, 3, head, items) == \
        _outcome(nat.encode_frame_pairs, opcode, 0, 3, head, items)
    flat = [x for it in items if isinstance(it, (tuple, list)) for x in it]
    assert _outcome(ref.encode_frame_list, opcode, 0, 3, head, flat) == \
        _outcome(nat.encode_frame_list, opcode, 0, 3, head, flat)


def test_packed_sequences_decode_lazily_and_compare_as_lists():
    from statestore_async.codecs import framing, packed

    data = b"hh" + framing.encode_pairs([(b"k1", b"v1"), (b"k2", b"")])
    p = packed.PackedPairs(data, 2, 2)
    assert len(p) == 2 and p._items is None
    assert p == [(b"k1", b"v1"), (b"k2", b"")] and list(p) == p.items and p[1] == (b"k2", b"")
    keys = packed.PackedList(framing.encode_list([b"a"]), 0, 1)
    assert keys == [b"a"] and keys != [b"b"] and repr(keys) == "PackedList([b'a'])"
