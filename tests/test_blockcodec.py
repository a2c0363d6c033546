"""Record block codec: layout, round trips, splitting, corruption detection, ref/native agreement."""
from __future__ import annotations

import os
import struct

import pytest
import xxhash
import zstandard
from conftest import implementations, lookup_args, resolve_impl
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from statestore_async.codecs import twins
from statestore_async.errors import CorruptBlockError, DecodeError, EncodeError, InterfaceError

REF = twins.reference("blockcodec")
NATIVE = None if twins.NO_EXTENSIONS else twins.native("blockcodec")
both = pytest.mark.skipif(NATIVE is None, reason="compiled module disabled")


@pytest.fixture(params=implementations("blockcodec"))
def codec(request):
    return resolve_impl(request.param)


def normalized(records):
    return [(bytes(k), None if v is None else bytes(v)) for k, v in records]


def forge(payload: bytes, *, codec=0, flags=0, count=0, raw_len=None, stored_len=None, magic=b"\xb1\x0c"):
    """A block around ``payload`` with any header fields, and a correct checksum."""
    raw_len = len(payload) if raw_len is None else raw_len
    stored_len = len(payload) if stored_len is None else stored_len
    head = magic + struct.pack("<BBIII", codec, flags, count, raw_len, stored_len)
    return head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head + payload)) + payload


def outcome(fn, *args):
    try:
        records, end = fn(*args)
        return ("ok", records, end)
    except CorruptBlockError as exc:
        return ("corrupt", str(exc))


def outcome_raw(fn, *args):
    try:
        return ("ok", fn(*args))
    except CorruptBlockError as exc:
        return ("corrupt", str(exc))


def encode_all(mod, records, **kw):
    blocks, start = [], 0
    while True:
        block, start = mod.encode_block(records, start, **kw)
        blocks.append(block)
        if start >= len(records):
            return blocks


def decode_all(codec, buf):
    out, off = [], 0
    while off < len(buf):
        records, off = codec.decode_block(buf, off)
        out += records
    return out


SAMPLE = [(b"k%03d" % i, b"v" * (i % 7) if i % 5 else None) for i in range(120)] + [(b"", b""), (b"", None)]


# --- layout ----------------------------------------------------------------------------------------
def test_constants(codec):
    assert codec.HEADER_SIZE == 24 and codec.CODEC_NONE == 0 and codec.CODEC_ZSTD == 1


def test_layout_uncompressed(codec):
    block, nxt = codec.encode_block([(b"ab", b"xyz"), (b"c", None)], codec=codec.CODEC_NONE)
    assert nxt == 2
    payload = b"\x00\x02ab\x03xyz" + b"\x01\x01c"
    assert block[:16] == b"\xb1\x0c\x00\x00" + struct.pack("<III", 2, len(payload), len(payload))
    assert block[16:24] == struct.pack("<Q", xxhash.xxh3_64_intdigest(block[:16] + payload))
    assert block[24:] == payload
    assert codec.read_block_header(block) == (0, 2, len(payload), len(payload), 24 + len(payload))
    assert codec.encode_records_raw([(b"ab", b"xyz"), (b"c", None)]) == payload
    assert codec.decode_records_raw(payload, 2) == [(b"ab", b"xyz"), (b"c", None)]


def test_layout_zstd(codec):
    records = [(b"key%d" % i, b"value" * 20) for i in range(100)]
    block, _ = codec.encode_block(records, level=5)
    c, count, raw_len, stored_len, total = codec.read_block_header(block)
    assert (c, count, total) == (1, 100, len(block))
    raw = codec.encode_records_raw(records)
    assert raw_len == len(raw) and stored_len < raw_len
    assert zstandard.ZstdDecompressor().decompress(block[24:]) == raw
    assert block[24:] == zstandard.ZstdCompressor(level=5).compress(raw)


def test_incompressible_payload_is_stored_plain(codec):
    records = [(os.urandom(16), os.urandom(200))]
    block, _ = codec.encode_block(records)
    assert block[2] == codec.CODEC_NONE
    assert codec.decode_block(block)[0] == records
    empty, nxt = codec.encode_block([])
    assert nxt == 0 and codec.read_block_header(empty) == (0, 0, 0, 0, 24)
    assert codec.decode_block(empty) == ([], 24)


# --- round trips -----------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["none", "zstd"])
def test_roundtrip(codec, which):
    c = codec.CODEC_NONE if which == "none" else codec.CODEC_ZSTD
    block, nxt = codec.encode_block(SAMPLE, codec=c)
    assert nxt == len(SAMPLE)
    assert codec.decode_block(block) == (SAMPLE, len(block))
    assert codec.decode_block(bytearray(block)) == (SAMPLE, len(block))
    assert codec.decode_block(memoryview(b"pre" + block + b"post"), 3) == (SAMPLE, len(block) + 3)


def test_bytes_like_inputs(codec):
    records = [(bytearray(b"k"), memoryview(b"vv")), (memoryview(b"abc")[::2], None)]
    block, _ = codec.encode_block(records)
    assert codec.decode_block(block)[0] == [(b"k", b"vv"), (b"ac", None)]


def test_large_values(codec):
    big = os.urandom(1 << 20)
    records = [(b"a", big), (b"b", big[::-1]), (b"c", None), (b"d", b"x" * (1 << 20))]
    blocks = encode_all(codec, records)
    assert len(blocks) == 4  # each MiB-sized record fills its own block
    assert decode_all(codec, b"".join(blocks)) == records


@pytest.mark.parametrize("limit", [1, 2, 7, 30, 100, 1000, 1 << 20])
@pytest.mark.parametrize("which", [0, 1])
def test_split_by_max_raw_bytes(codec, limit, which):
    blocks = encode_all(codec, SAMPLE, max_raw_bytes=limit, codec=which)
    assert decode_all(codec, b"".join(blocks)) == SAMPLE
    for block in blocks:
        _, count, raw_len, _, _ = codec.read_block_header(block)
        assert count >= 1
        assert raw_len <= limit or count == 1


def test_start_and_bounds(codec):
    block, nxt = codec.encode_block(SAMPLE, start=100)
    assert nxt == len(SAMPLE) and codec.decode_block(block)[0] == SAMPLE[100:]
    block, nxt = codec.encode_block(SAMPLE, start=len(SAMPLE))
    assert nxt == len(SAMPLE) and codec.decode_block(block)[0] == []
    for kw in ({"start": -1}, {"start": len(SAMPLE) + 1}, {"max_raw_bytes": 0}, {"codec": 7}, {"level": 99}, {"start": 1.0}):
        with pytest.raises(InterfaceError):
            codec.encode_block(SAMPLE, **kw)
    with pytest.raises(InterfaceError):
        codec.decode_block(b"", -1)


@pytest.mark.parametrize(
    "records,message",
    [
        ([(b"k", "text")], "value must be bytes-like"),
        ([("k", b"v")], "key must be bytes-like"),
        ([(None, b"v")], "key must be bytes-like"),
        ([(b"k",)], "pair"),
        ([b"kv"], "pair"),
        ([(b"ok", b""), (b"k", 5)], "record 1"),
    ],
)
def test_encode_errors(codec, records, message):
    with pytest.raises(EncodeError, match=message):
        codec.encode_block(records)
    with pytest.raises(EncodeError, match=message):
        codec.encode_records_raw(records)


def test_key_group_range(codec):
    records = [(b"\x00\x07a", b"v"), (b"\x01\x00", None), (bytearray(b"\x00\x02"), b""), (b"\x09", b"short key")]
    assert codec.key_group_range(records, 0, 3) == (2, 256)
    assert codec.key_group_range(records, 1, 2) == (256, 256)
    assert codec.key_group_range(records, 0, 4) == (0, 256)  # a key shorter than 2 bytes is group 0
    assert codec.key_group_range(iter(records), 2, 3) == (2, 2)
    for start, stop in ((0, 0), (2, 1), (-1, 2), (0, 5)):
        with pytest.raises(InterfaceError, match="range"):
            codec.key_group_range(records, start, stop)
    with pytest.raises(InterfaceError, match="stop"):
        codec.key_group_range(records, 0, 2.0)
    with pytest.raises(EncodeError, match="record 1: key must be bytes-like"):
        codec.key_group_range([(b"ok", b""), ("k", b"v")], 0, 2)


@both
@settings(max_examples=500, deadline=None)
@given(records=st.lists(st.tuples(st.binary(max_size=4), st.none() | st.binary(max_size=4)), min_size=1, max_size=30),
       data=st.data())
def test_key_group_range_agrees(records, data):
    start = data.draw(st.integers(0, len(records) - 1))
    stop = data.draw(st.integers(start + 1, len(records)))
    want = REF.key_group_range(records, start, stop)
    assert NATIVE.key_group_range(records, start, stop) == want
    groups = [(k[0] << 8) | k[1] if len(k) >= 2 else 0 for k, _ in records[start:stop]]
    assert want == (min(groups), max(groups))


# --- corruption --------------------------------------------------------------------------------------
def small_block(codec, which):
    return codec.encode_block([(b"k1", b"v1" * 10), (b"k2", None), (b"", b"")], codec=which)[0]


@pytest.mark.parametrize("which", [0, 1])
def test_every_bit_flip_is_detected(codec, which):
    block = small_block(codec, which)
    assert codec.decode_block(block)[1] == len(block)
    for i in range(len(block)):
        for bit in range(8):
            bad = bytearray(block)
            bad[i] ^= 1 << bit
            with pytest.raises(CorruptBlockError):
                codec.decode_block(bytes(bad))


@pytest.mark.parametrize("which", [0, 1])
def test_every_truncation_is_detected(codec, which):
    block = small_block(codec, which)
    for n in range(len(block)):
        with pytest.raises(CorruptBlockError, match="truncated"):
            codec.decode_block(block[:n])
    with pytest.raises(CorruptBlockError, match="truncated: need 24 bytes"):
        codec.read_block_header(block[:23])
    with pytest.raises(CorruptBlockError, match=f"truncated: need {len(block)} bytes, have {len(block) - 1}"):
        codec.decode_block(block[:-1])
    with pytest.raises(CorruptBlockError, match="truncated"):
        codec.decode_block(block, len(block) + 10)


def test_specific_reasons(codec):
    block = small_block(codec, 0)
    assert codec.decode_block(block + b"junk")[1] == len(block)  # the next block's business
    cases = [
        (b"\x00" + block[1:], "bad magic"),
        (block[:16] + b"\x00" * 8 + block[24:], "checksum mismatch"),
        (forge(b"", codec=2), "unknown codec"),
        (forge(b"", flags=1), "flags"),
        (forge(b"", raw_len=(256 << 20) + 1, stored_len=0, codec=1), "raw length"),
        (forge(b"", count=1), "count 1 impossible"),
        (forge(b"abc", stored_len=3, raw_len=4), "stored length 3 differs"),
        (forge(b"x" * 1000, codec=1, raw_len=10), "too large"),
        (forge(b"\x00\x01k\x01v\x07", count=1), "1 bytes left over"),
        (forge(b"\x02\x01k\x00\x00", count=2), "record 0: unknown kind 2"),
        (forge(b"\x00\x05k\x00\x00", count=2), "record 0: key length 5 beyond payload"),
        (forge(b"\x00\x01k\x05\x00", count=2), "record 0: value length 5 beyond payload"),
        (forge(b"\x01\x80\x00\x01\x00", count=2), "record 0: non-canonical key length"),
        (forge(b"\x00\x00\x02ab", count=2), "record 1: truncated at payload offset 5"),
        (forge(b"\x00\x00\xff\xff", count=1), "record 0: truncated value length"),
        (forge(b"garbage!", codec=1, raw_len=8, count=1), "zstd"),
        (forge(zstandard.ZstdCompressor().compress(b"\x01\x00") + b"x", codec=1, raw_len=2, count=1), "after the zstd frame"),
        (forge(zstandard.ZstdCompressor().compress(b"\x01\x00\x01\x00"), codec=1, raw_len=2, count=1), "declares 4"),
        (forge(zstandard.ZstdCompressor().compress(b"\x01\x00\x01\x00")[:-2], codec=1, raw_len=4, count=2), "zstd"),
    ]
    for buf, reason in cases:
        with pytest.raises(CorruptBlockError, match=reason):
            codec.decode_block(buf)
    assert issubclass(CorruptBlockError, DecodeError)


def test_no_allocation_from_huge_counts(codec):
    with pytest.raises(CorruptBlockError, match="impossible"):
        codec.decode_records_raw(b"\x01\x00", 10**12)
    with pytest.raises(CorruptBlockError, match="beyond payload"):
        codec.decode_records_raw(b"\x00\xff\xff\xff\xff\x0f", 1)
    with pytest.raises(InterfaceError):
        codec.decode_records_raw(b"", -1)


# --- properties ------------------------------------------------------------------------------------
records_st = st.lists(
    st.tuples(st.binary(max_size=24), st.one_of(st.none(), st.binary(max_size=64), st.binary(max_size=300))),
    max_size=40,
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(records=records_st, limit=st.integers(1, 2000), which=st.sampled_from([0, 1]), level=st.integers(-5, 9))
def test_roundtrip_deterministic_and_identical(records, limit, which, level):
    blocks = encode_all(REF, records, max_raw_bytes=limit, codec=which, level=level)
    assert decode_all(REF, b"".join(blocks)) == records
    assert encode_all(REF, records, max_raw_bytes=limit, codec=which, level=level) == blocks
    assert REF.decode_records_raw(REF.encode_records_raw(records), len(records)) == records
    if NATIVE is not None:
        assert encode_all(NATIVE, records, max_raw_bytes=limit, codec=which, level=level) == blocks
        assert decode_all(NATIVE, b"".join(blocks)) == records
        assert NATIVE.encode_records_raw(records) == REF.encode_records_raw(records)


def mutate(buf: bytes, ops) -> bytes:
    b = bytearray(buf)
    for op, where, byte in ops:
        pos = where % (len(b) + 1)
        if op == "flip" and b:
            b[pos % len(b)] ^= 1 << (byte % 8)
        elif op == "truncate":
            del b[pos:]
        elif op == "insert":
            b[pos:pos] = bytes([byte])
        elif op == "delete" and b:
            del b[pos % len(b)]
    return bytes(b)


mutations = st.lists(
    st.tuples(st.sampled_from(["flip", "truncate", "insert", "delete"]), st.integers(0, 10**6), st.integers(0, 255)),
    min_size=1,
    max_size=3,
)


@both
@settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(records=st.lists(st.tuples(st.binary(max_size=8), st.none() | st.binary(max_size=12)), max_size=6),
       which=st.sampled_from([0, 1]), ops=mutations, reforge=st.booleans())
def test_mutated_blocks_agree(records, which, ops, reforge):
    block, _ = REF.encode_block(records, codec=which)
    bad = mutate(block, ops)
    if reforge and len(bad) >= 24:
        # fix the checksum so that the header, zstd and record checks are what gets exercised
        bad = bad[:16] + struct.pack("<Q", xxhash.xxh3_64_intdigest(bad[:16] + bad[24:])) + bad[24:]
    r = outcome(REF.decode_block, bad)
    assert outcome(NATIVE.decode_block, bad) == r
    assert outcome(NATIVE.decode_block, bytearray(bad)) == r
    try:
        head = ("ok", REF.read_block_header(bad))
    except CorruptBlockError as exc:
        head = ("corrupt", str(exc))
    try:
        nhead = ("ok", NATIVE.read_block_header(bad))
    except CorruptBlockError as exc:
        nhead = ("corrupt", str(exc))
    assert nhead == head


@both
@settings(max_examples=3000, deadline=None)
@given(payload=st.binary(max_size=40), count=st.integers(0, 25), which=st.sampled_from([0, 1]))
def test_garbage_payloads_agree(payload, count, which):
    assert outcome_raw(NATIVE.decode_records_raw, payload, count) == outcome_raw(REF.decode_records_raw, payload, count)
    stored = zstandard.ZstdCompressor().compress(payload) if which else payload
    buf = forge(stored, codec=which, count=count, raw_len=len(payload))
    assert outcome(NATIVE.decode_block, buf) == outcome(REF.decode_block, buf)


@both
@settings(max_examples=2000, deadline=None)
@given(data=st.binary(max_size=80))
def test_garbage_blocks_agree(data):
    assert outcome(NATIVE.decode_block, data) == outcome(REF.decode_block, data)
    assert outcome(NATIVE.decode_block, b"\xb1\x0c" + data) == outcome(REF.decode_block, b"\xb1\x0c" + data)


# --- blocks of already encoded payloads --------------------------------------------------------------
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(records=records_st, which=st.sampled_from([0, 1]), level=st.integers(-5, 9))
def test_payload_block_is_the_block_of_its_records(records, which, level):
    """encode_payload_block(encode_records_raw(records)) is encode_block(records) byte for byte, in
    both twins, for any records (empty too), codec and level."""
    want, nxt = REF.encode_block(records, 0, 1 << 28, which, level)
    assert nxt == len(records)
    payload = REF.encode_records_raw(records)
    impls = [REF] if NATIVE is None else [REF, NATIVE]
    for m in impls:
        for buf in (payload, bytearray(payload), memoryview(payload)):
            assert m.encode_payload_block(buf, len(records), which, level) == want
    assert REF.decode_block(want) == (normalized(records), len(want))


def test_payload_block_defaults_and_bounds(codec):
    records = [(b"\x00\x01key", b"v" * 50)] * 40
    payload = codec.encode_records_raw(records)
    assert codec.encode_payload_block(payload, 40) == codec.encode_block(records)[0]
    assert codec.encode_payload_block(b"", 0, codec.CODEC_ZSTD) == codec.encode_block([])[0]
    with pytest.raises(TypeError):
        codec.encode_payload_block("text", 0)
    for args, exc in (((payload, -1), InterfaceError), ((payload, True), InterfaceError), ((payload, 40, 7), InterfaceError),
                      ((payload, 40, 1, 10**6), InterfaceError), ((payload, "40"), InterfaceError),
                      ((payload, 39), EncodeError), ((payload, 41), EncodeError), ((payload[:-1], 40), EncodeError),
                      ((payload, 1 << 70), EncodeError)):
        with pytest.raises(exc):
            codec.encode_payload_block(*args)


@both
@settings(max_examples=2000, deadline=None)
@given(payload=st.binary(max_size=40), count=st.integers(-2, 25), which=st.sampled_from([0, 1]),
       level=st.integers(-3, 25))
def test_garbage_payload_blocks_agree(payload, count, which, level):
    """Any payload and count: the same block or the same error (type and message) from both twins;
    a block is only ever made of a payload that decodes to exactly ``count`` records."""
    def run(m):
        try:
            return ("ok", m.encode_payload_block(payload, count, which, level))
        except (EncodeError, InterfaceError) as exc:
            return (type(exc).__name__, str(exc))

    got = run(NATIVE)
    assert got == run(REF)
    if got[0] == "ok":
        assert REF.decode_block(got[1])[0] == REF.decode_records_raw(payload, count)


# --- record spans and block indexes (a cold run's native reads) ---------------------------------------
_RECORDS = st.lists(st.tuples(st.binary(max_size=6), st.none() | st.binary(max_size=6)), max_size=40)


def _spans_of(codec, payload, count):
    try:
        return ("ok", codec.record_spans(payload, count))
    except (CorruptBlockError, InterfaceError) as exc:
        return (type(exc).__name__, str(exc))


def test_record_spans_name_each_record(codec):
    records = [(b"k1", b"value"), (b"gone", None), (b"", b"")]
    payload = codec.encode_records_raw(records)
    spans = list(struct.iter_unpack("<IIII", codec.record_spans(payload, 3)))
    assert [(payload[kp:kp + kl], None if vl == codec.NO_VALUE else payload[vp:vp + vl])
            for kp, kl, vp, vl in spans] == records
    assert spans[1][2:] == (0, 0xFFFFFFFF)
    assert codec.record_spans(b"", 0) == b""
    with pytest.raises(CorruptBlockError, match="left over"):
        codec.record_spans(payload, 2)
    with pytest.raises(CorruptBlockError, match="impossible"):
        codec.record_spans(payload, 100)
    with pytest.raises(InterfaceError, match="negative"):
        codec.record_spans(payload, -1)


@both
@settings(max_examples=300, deadline=None)
@given(records=_RECORDS, cut=st.integers(0, 400), flip=st.integers(0, 400), count_delta=st.integers(-2, 2))
def test_record_spans_agree_on_good_and_damaged_payloads(records, cut, flip, count_delta):
    payload = REF.encode_records_raw(records)
    count = max(0, len(records) + count_delta)
    damaged = bytearray(payload[: cut if cut < len(payload) else len(payload)])
    if damaged and flip < len(damaged):
        damaged[flip] ^= 0x81
    for p, n in ((payload, len(records)), (payload, count), (bytes(damaged), len(records))):
        assert _spans_of(NATIVE, p, n) == _spans_of(REF, p, n)
    spans = REF.record_spans(payload, len(records))
    assert [(payload[kp:kp + kl], None if vl == REF.NO_VALUE else payload[vp:vp + vl])
            for kp, kl, vp, vl in struct.iter_unpack("<IIII", spans)] == records


@both
@settings(max_examples=300, deadline=None)
@given(first=st.lists(st.binary(max_size=4), max_size=12), keys=st.lists(st.binary(max_size=5), max_size=30),
       data=st.data())
def test_block_indexes_are_bisect_right_minus_one(first, keys, data):
    import bisect

    import numpy as np
    first = sorted(set(first))
    js = np.array(data.draw(st.lists(st.integers(0, len(keys) - 1), max_size=40)) if keys else [], np.int64)
    want = [bisect.bisect_right(first, keys[j]) - 1 for j in js.tolist()]
    kbuf, koff, *_ = lookup_args(keys)
    for mod in (REF, NATIVE):
        assert np.frombuffer(mod.block_indexes(first, kbuf, koff, js), np.int64).tolist() == want


def test_block_indexes_check_their_arguments(codec):
    import numpy as np
    kbuf, koff, *_ = lookup_args([b"a"])
    with pytest.raises(IndexError, match="out of range"):
        codec.block_indexes([b"a"], kbuf, koff, np.array([1], np.int64))
    with pytest.raises(InterfaceError, match="not inside the 9-byte key buffer"):
        codec.block_indexes([b"a"], kbuf, np.array([6], np.int64), np.array([0], np.int64))
    with pytest.raises(InterfaceError, match="first keys are bytes"):
        codec.block_indexes(["a"], kbuf, koff, np.array([0], np.int64))


@both
@settings(max_examples=300, deadline=None)
@given(table=st.dictionaries(st.binary(max_size=6), st.none() | st.binary(max_size=6), max_size=40),
       probes=st.lists(st.binary(max_size=6), max_size=30), base=st.integers(0, 1 << 40), data=st.data())
def test_record_blocks_agree_with_a_dict(table, probes, base, data):
    import numpy as np
    records = sorted(table.items())
    payload = REF.encode_records_raw(records)
    keys = probes + list(table)
    js = np.array(data.draw(st.lists(st.integers(0, len(keys) - 1), unique=True)) if keys else [], np.int64)
    hits = [j for j in js.tolist() if keys[j] in table]
    answers = []
    for mod in (REF, NATIVE):
        block = mod.RecordBlock(payload, len(records))
        assert len(block) == len(records) and block.nbytes >= len(payload) + 16 * len(records)
        assert [block.entry(i) for i in range(len(block))] == records
        for probe in probes:
            assert block.bisect_left(probe) == sum(k < probe for k, _ in records)
        kbuf, koff, found, voff, vlen = lookup_args(keys)
        chunk = block.lookup_spans(kbuf, koff, js, found, voff, vlen, base)
        assert chunk == b"".join(table[keys[j]] or b"" for j in hits)  # the values, in the order of js
        assert found.tolist() == [int(j in hits) for j in range(len(keys))]
        for j in hits:
            want = table[keys[j]]
            assert vlen[j] == -1 if want is None else chunk[voff[j] - base : voff[j] - base + vlen[j]] == want
        answers.append((chunk, found.tolist(), voff.tolist(), vlen.tolist()))
    assert answers[0] == answers[1]


def test_record_blocks_check_payloads_and_arguments(codec):
    import numpy as np
    payload = codec.encode_records_raw([(b"a", b"1"), (b"b", None)])
    with pytest.raises(CorruptBlockError, match="left over"):
        codec.RecordBlock(payload, 1)
    with pytest.raises(CorruptBlockError):
        codec.RecordBlock(payload[:-1], 2)
    block = codec.RecordBlock(bytearray(payload), 2)
    with pytest.raises(IndexError):
        block.entry(2)
    kbuf, koff, found, voff, vlen = lookup_args([b"b", b"a", b"c"])
    with pytest.raises(IndexError, match="out of range"):
        block.lookup_spans(kbuf, koff, np.array([0, 5], np.int64), found, voff, vlen, 0)
    with pytest.raises(InterfaceError, match="3 key offsets, 2 found"):
        block.lookup_spans(kbuf, koff, np.array([0], np.int64), found[:2], voff, vlen, 0)
    with pytest.raises(InterfaceError, match="key 1 at offset 99 is not inside the 19-byte key buffer"):
        block.lookup_spans(kbuf, np.array([8, 99, 18], np.int64), np.array([0, 1], np.int64), found, voff, vlen, 0)
    with pytest.raises(InterfaceError, match="keys are bytes"):
        block.bisect_left("a")
    assert not found.any() and not voff.any() and not vlen.any()
    assert block.lookup_spans(kbuf, koff, np.array([0, 1, 2], np.int64), found, voff, vlen, 10) == b"1"
    assert found.tolist() == [1, 1, 0] and vlen.tolist() == [-1, 1, 0] and voff[1] == 10
    with pytest.raises(InterfaceError, match="key 1 is already found"):
        block.lookup_spans(kbuf, koff, np.array([2, 1], np.int64), found, voff, vlen, 0)
