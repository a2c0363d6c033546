"""Arrow-layout batches: frames from columns equal the list/pairs frames, answers cut into Arrow
buffers equal the decoded lists; compiled and reference twins agree on any input; the blocking
and asyncio clients' *_arrow calls against a real daemon."""
from __future__ import annotations

import asyncio
import struct

import pytest
from conftest import implementations, resolve_impl
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from statestore_async.client.clients import AsyncClient, Client
from statestore_async.codecs import arrowframes, twins
from statestore_async.errors import DecodeError, EncodeError, InterfaceError
from statestore_async.ids import StoreId

pa = pytest.importorskip("pyarrow")

IMPLS = implementations("arrowframes")
FR = twins.reference("framing")
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
blobs = st.binary(max_size=12)
native_only = pytest.mark.skipif(twins.NO_EXTENSIONS, reason="compiled modules disabled")


@pytest.fixture(params=IMPLS)
def ab(request):
    return resolve_impl(request.param)


def _column(items: list, width: int, start: int = 0):
    """A column holding ``items`` after ``start`` filler items."""
    fmt = "<i" if width == 4 else "<q"
    items = [b"~" * (i % 3) for i in range(start)] + items
    offs, pos = [0], 0
    for x in items:
        pos += len(x)
        offs.append(pos)
    return b"".join(struct.pack(fmt, o) for o in offs), b"".join(items), start, width


def _outcome(fn, *args):
    try:
        return ("ok", fn(*args))
    except (DecodeError, EncodeError) as exc:
        return (type(exc).__name__, str(exc))


@SETTINGS
@given(items=st.lists(st.tuples(blobs, blobs), max_size=20), head=st.binary(max_size=4),
       kw=st.sampled_from([4, 8]), vw=st.sampled_from([4, 8]), start=st.integers(0, 3))
def test_frames_from_columns_equal_the_list_frames(ab, items, head, kw, vw, start):
    ks, vs = [k for k, _ in items], [v for _, v in items]
    n = len(items)
    assert ab.encode_frame_list_buffers(4, 0, 9, head, n, _column(ks, kw, start)) == \
        FR.encode_frame_list(4, 0, 9, head, ks)
    assert ab.encode_frame_pairs_buffers(5, 0, 9, head, n, _column(ks, kw, start), _column(vs, vw)) == \
        FR.encode_frame_pairs(5, 0, 9, head, items)


@SETTINGS
@given(items=st.lists(st.one_of(st.none(), blobs), max_size=30), prefix=st.binary(max_size=3))
def test_answers_cut_into_arrow_buffers(ab, items, prefix):
    data = prefix + FR.encode_optional_list(items)
    n, nulls, validity, offsets, body, width, end = ab.decode_optional_list_buffers(data, len(prefix))
    assert (n, nulls, width, end) == (len(items), items.count(None), 4, len(data))
    assert arrowframes.to_array(n, nulls, validity, offsets, body, width).to_pylist() == items


@native_only
@settings(max_examples=400, deadline=None)
@given(data=st.binary(max_size=80), offset=st.integers(0, 10), max_count=st.integers(0, 20))
def test_reference_and_native_agree_on_any_answer_bytes(data, offset, max_count):
    ref, nat = twins.reference("arrowframes"), twins.native("arrowframes")
    assert _outcome(ref.decode_optional_list_buffers, data, offset, max_count) == \
        _outcome(nat.decode_optional_list_buffers, data, offset, max_count)


@native_only
@settings(max_examples=400, deadline=None)
@given(offsets=st.lists(st.integers(-3, 40), max_size=8), data=st.binary(max_size=40), n=st.integers(-1, 8),
       start=st.integers(-1, 3), width=st.sampled_from([4, 8, 3]), head=st.one_of(st.binary(max_size=3), st.just("s")),
       opcode=st.sampled_from([4, 300]))
def test_reference_and_native_agree_on_any_columns(offsets, data, n, start, width, head, opcode):
    ref, nat = twins.reference("arrowframes"), twins.native("arrowframes")
    fmt = "<q" if width == 8 else "<i"
    col = (b"".join(struct.pack(fmt, o) for o in offsets), data, start, width)
    good = _column([b"ab"] * max(n, 0), 4)
    assert _outcome(ref.encode_frame_list_buffers, opcode, 0, 1, head, n, col) == \
        _outcome(nat.encode_frame_list_buffers, opcode, 0, 1, head, n, col)
    for k, v in ((col, good), (good, col)):
        assert _outcome(ref.encode_frame_pairs_buffers, opcode, 0, 1, head, n, k, v) == \
            _outcome(nat.encode_frame_pairs_buffers, opcode, 0, 1, head, n, k, v)


def test_bad_columns_are_refused(ab):
    with pytest.raises(EncodeError, match="outside"):
        ab.encode_frame_list_buffers(4, 0, 1, b"", 2, (struct.pack("<3i", 0, 5, 2), b"abcde", 0, 4))
    with pytest.raises(EncodeError, match="cannot hold"):
        ab.encode_frame_list_buffers(4, 0, 1, b"", 3, (struct.pack("<3i", 0, 1, 2), b"ab", 0, 4))
    with pytest.raises(DecodeError, match="cannot fit"):
        ab.decode_optional_list_buffers(struct.pack("<I", 0xFFFFFFF0) + b"\x00" * 8)


def test_column_takes_binary_arrays_and_refuses_the_rest():
    arr = pa.array([b"a", b"bc", b"def"], pa.large_binary())[1:]
    n, col = arrowframes.column(arr)
    assert n == 2 and col[2] == 1 and col[3] == 8
    assert arrowframes.column(pa.chunked_array([[b"x"], [b"y"]], pa.binary()))[0] == 2
    for bad in (pa.array(["s"]), pa.array([b"a", None]), [b"a"]):
        with pytest.raises(InterfaceError):
            arrowframes.column(bad)


# --- against a real daemon ------------------------------------------------------------------------------
from test_clients import daemon  # noqa: E402,F401  (max_batch 1000: big batches are split)


def _k(i: int) -> bytes:
    return b"\x01\x02" + b"a%07d" % i


def test_blocking_client_arrow_calls_match_the_list_calls(daemon):  # noqa: F811
    sock, root = daemon
    c = Client(sock)
    keys = pa.array([_k(i) for i in range(2500)], pa.binary())
    values = pa.array([b"v%d" % i * (i % 5) for i in range(2500)], pa.large_binary())
    with c.open(StoreId(root, "arrow", 0), 0) as h:
        assert h.put_many_arrow(keys[100:], values[100:]) == 2400  # 3 requests, pipelined
        assert h.remove_many_arrow(keys[100:102]) == 2
        got = h.get_many_arrow(keys)
        assert got.type == pa.binary()
        assert got.to_pylist() == h.get_many([_k(i) for i in range(2500)])
        assert got.to_pylist()[:103] == [None] * 102 + [values[102].as_py()]
        with pytest.raises(InterfaceError):
            h.put_many_arrow(keys[:2], values[:3])
        with pytest.raises(Exception) as info:
            h.put_many_arrow(pa.array([b"x"], pa.binary()), pa.array([b"v"], pa.binary()))
        assert "key group" in str(info.value)
        assert h.get_many_arrow(pa.array([], pa.binary())).to_pylist() == []
    c.close()


def test_asyncio_client_arrow_calls(daemon):  # noqa: F811
    sock, root = daemon

    async def main():
        async with AsyncClient(sock) as c:
            h = await c.open(StoreId(root, "arrow-async", 0), 0)
            keys = pa.array([_k(i) for i in range(1500)], pa.binary())
            assert await h.put_many_arrow(keys, keys) == 1500
            assert await h.remove_many_arrow(keys[:1]) == 1
            got = await h.get_many_arrow(keys)
            assert got.to_pylist() == [None] + keys.to_pylist()[1:]
            await h.abort()

    asyncio.run(main())
