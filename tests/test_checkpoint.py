"""Checkpoint files: format round trips, key-group index, streaming reads, and corruption detection."""
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from statestore_async.codecs.keylayout import key_group_of, store_key
from statestore_async.engine.store import VersionedStore
from statestore_async.errors import CorruptFileError
from statestore_async.files import checkpoint
from statestore_async.files.checkpoint import (
    CheckpointParser,
    blocks_for_key_groups,
    decode_blocks,
    encode_delta,
    encode_snapshot,
    read_checkpoint,
    read_index,
)
from statestore_async.files.manifest import Manifest
from statestore_async.files.names import DELTA, SNAPSHOT, file_name
from statestore_async.ids import StoreId

SID = StoreId("file:///tmp/ckpt", "agg", 3)


def make_store(n=300, groups=64, seed=1):
    rnd = random.Random(seed)
    s = VersionedStore(SID)
    w = s.open(0)
    for i in range(n):
        w.put(store_key(rnd.randrange(groups), b"k%d" % i), b"v%d" % rnd.randrange(10**6))
    w.commit()
    return s


def delta_of(store, puts, removes=()):
    w = store.open(store.head.version)
    for k, v in puts:
        w.put(k, v)
    for k in removes:
        w.remove(k)
    return w.commit()


def test_delta_round_trip_with_tombstones_and_header():
    s = make_store()
    keys = [k for k, _ in s.items()]
    d = delta_of(s, [(keys[0], b"new"), (store_key(7, b"fresh"), b"")], [keys[1]])
    data = encode_delta(d)
    f = read_checkpoint(data, file_name(d.ref, DELTA), expect=(SID, d.ref, DELTA))
    assert dict(f.records) == d.records
    assert f.header.kind == DELTA and f.header.ref == d.ref and f.header.lineage == d.lineage
    assert f.header.store == SID.to_json() and f.header.codec == "zstd"
    assert f.footer.records == 3


def test_delta_blocks_index_their_key_group_range():
    s = make_store(n=400, groups=64)
    keys = [k for k, _ in s.items()]
    d = delta_of(s, [(k, b"x" * 20) for k in keys[::3]], keys[1::7])
    data = encode_delta(d, block_bytes=256)
    f = read_checkpoint(data, "d", expect=(SID, d.ref, DELTA))
    assert len(f.footer.blocks) > 5
    for b in f.footer.blocks:
        recs = list(decode_blocks(data[b.offset:b.offset + b.length], "d", [b], base_offset=b.offset))
        kgs = [key_group_of(k) for k, _ in recs]
        assert len(recs) == b.count and (b.first_kg, b.last_kg) == (min(kgs), max(kgs))


@pytest.mark.parametrize("codec", ["zstd", "none"])
def test_snapshot_is_grouped_by_key_group_with_an_index(codec):
    s = make_store(n=5000, groups=512)
    with s.freeze() as view:
        data = encode_snapshot(view, codec=codec, block_bytes=4096)
    f = read_checkpoint(data, "snap", expect=(SID, s.head, SNAPSHOT))
    assert dict(f.records) == dict(s.items())
    kgs = [key_group_of(k) for k, _ in f.records]
    assert kgs == sorted(kgs)
    assert len(f.footer.blocks) > 10
    # a rescale reads only the blocks of its key-group range, from the file's tail and those ranges
    index = read_index(data[-4096:], "snap")
    assert index.blocks == f.footer.blocks
    lo, hi = 100, 163
    wanted = blocks_for_key_groups(index, lo, hi)
    assert 0 < len(wanted) < len(index.blocks) // 3
    start, end = wanted[0].offset, wanted[-1].offset + wanted[-1].length
    got = [(k, v) for k, v in decode_blocks(data[start:end], "snap", wanted, base_offset=start) if lo <= key_group_of(k) <= hi]
    assert dict(got) == {k: v for k, v in s.items() if lo <= key_group_of(k) <= hi}


def test_streaming_parser_gives_the_same_records_for_any_chunking():
    s = make_store(n=3000)
    with s.freeze() as view:
        data = encode_snapshot(view, block_bytes=2048)
    rnd = random.Random(5)
    for _ in range(20):
        p = CheckpointParser("snap")
        out, pos = [], 0
        while pos < len(data):
            n = rnd.choice([1, 7, 24, 100, 5000, 100000])
            out.extend(p.feed(data[pos : pos + n]))
            pos += n
        p.finish()
        assert dict(out) == dict(s.items())


def test_a_file_that_is_not_the_one_asked_for_is_refused():
    s = make_store()
    d = delta_of(s, [(store_key(1, b"a"), b"b")])
    data = encode_delta(d)
    other = StoreId("file:///tmp/ckpt", "agg", 4)
    with pytest.raises(CorruptFileError, match="expected the delta"):
        read_checkpoint(data, "x.delta", expect=(other, d.ref, DELTA))
    with pytest.raises(CorruptFileError, match="expected the snapshot"):
        read_checkpoint(data, "x.snapshot", expect=(SID, d.ref, SNAPSHOT))


def small_files():
    s = make_store(n=20, groups=4)
    keys = [k for k, _ in s.items()]
    d = delta_of(s, [(keys[0], b"zz")], [keys[1]])
    with s.freeze() as view:
        snap = encode_snapshot(view, block_bytes=256)
    m = Manifest("agg", 2, 2, 8, {"default": (d.ref, d.ref)})
    return {"delta": encode_delta(d, block_bytes=256), "snapshot": snap, "manifest": m.to_bytes()}


def parse_any(kind, data):
    if kind == "manifest":
        return Manifest.from_bytes(data, "agg/_commits/2.json")
    return read_checkpoint(data, f"file.{kind}")


@pytest.mark.parametrize("kind", ["delta", "snapshot", "manifest"])
def test_every_bit_flip_is_a_typed_error_naming_the_file(kind):
    data = small_files()[kind]
    good = parse_any(kind, data)
    assert good is not None
    for pos in range(len(data)):
        for bit in range(8):
            bad = bytearray(data)
            bad[pos] ^= 1 << bit
            with pytest.raises(CorruptFileError) as e:
                parse_any(kind, bytes(bad))
            assert e.value.name.endswith(kind) or e.value.name.endswith(".json")


@pytest.mark.parametrize("kind", ["delta", "snapshot", "manifest"])
def test_every_truncation_and_extension_is_a_typed_error(kind):
    data = small_files()[kind]
    cut_points = range(len(data)) if kind != "manifest" else range(len(data) - 1)
    for n in cut_points:
        with pytest.raises(CorruptFileError):
            parse_any(kind, data[:n])
    if kind != "manifest":
        with pytest.raises(CorruptFileError):
            parse_any(kind, data + b"\x00")


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400))
def test_garbage_is_a_typed_error(blob):
    with pytest.raises(CorruptFileError):
        read_checkpoint(checkpoint.MAGIC + blob, "garbage.delta")
    with pytest.raises(CorruptFileError):
        read_checkpoint(blob, "garbage.delta")


def test_unsupported_format_version_says_so():
    data = bytearray(small_files()["delta"])
    data[4] = 9
    with pytest.raises(CorruptFileError, match="unsupported format version 9"):
        read_checkpoint(bytes(data), "f.delta")
