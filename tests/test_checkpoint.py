"""Checkpoint files: format round trips, key-group index, streaming reads, and corruption detection."""
import json
import random
import types

import pytest
import xxhash
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
from statestore_async.files.loader import load_store
from statestore_async.files.manifest import Manifest
from statestore_async.files.names import DELTA, SNAPSHOT, file_name
from statestore_async.files.transfer import create_checkpoint_file
from statestore_async.ids import StoreId
from statestore_async.objectstore import LocalObjectStore

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


# --- the packed path (records written straight from the table, blocks compressed in threads) ----------
@pytest.fixture
def fixed_clock(monkeypatch):
    """The header holds the creation time: one clock, so that two encodings compare whole."""
    monkeypatch.setattr(checkpoint, "time", types.SimpleNamespace(time=lambda: 1_700_000_000.25))




def old_delta(d, *, kind=DELTA, records=None, **kw) -> bytes:
    """A delta file as the writer made it from Python records (key order unless ``records``)."""
    w = checkpoint.CheckpointWriter(kind, d.store_id, d.ref, d.lineage, **kw)
    for _ in w.add_records(list(d.records.items()) if records is None else records):
        pass
    return w.finish()


def old_snapshot(view, block_bytes=checkpoint.DEFAULT_BLOCK_BYTES) -> bytes:
    """A snapshot file as snapshot_steps wrote it before the packed path: ``view.chunk`` (11 bytes
    counted per record) and ``add_records``, first/last key group of each block in the footer."""
    w = checkpoint.CheckpointWriter(SNAPSHOT, view.store_id, view.ref, view.lineage, block_bytes=block_bytes)
    pos = 0
    while True:
        block, pos = view.chunk(pos, block_bytes)
        if not block:
            break
        for _ in w.add_records(block):
            pass
    return w.finish()


def big_delta(n=20000, groups=300, seed=3):
    """A delta of n records over many key groups, puts and tombstones, keys of several lengths."""
    rnd = random.Random(seed)
    s = VersionedStore(SID)
    w = s.open(0)
    keys = [store_key(rnd.randrange(groups), rnd.randbytes(rnd.choice((0, 1, 10, 30)))) for _ in range(n)]
    w.put_many([(k, rnd.randbytes(rnd.choice((0, 16, 200)))) for k in keys])
    w.commit()
    w = s.open(1)
    live = [k for k, _ in s.items()]
    w.put_many([(k, b"u" * rnd.choice((1, 16))) for k in live[::2]])
    w.remove_many(live[1::5] + [store_key(1, b"never there")])
    return s, w.commit()


@pytest.mark.parametrize("threads", [True, False])
@pytest.mark.parametrize("block_bytes", [1, 300, 4096, 1 << 16, checkpoint.DEFAULT_BLOCK_BYTES])
def test_encode_delta_gives_the_bytes_of_the_records_path(threads, block_bytes, fixed_clock):
    _, d = big_delta()
    for level, codec in ((3, "zstd"), (1, "zstd"), (3, "none")):
        new = encode_delta(d, threads=threads, block_bytes=block_bytes, level=level, codec=codec)
        assert new == old_delta(d, block_bytes=block_bytes, level=level, codec=codec)
    f = read_checkpoint(new, "d", expect=(SID, d.ref, DELTA))
    assert f.records == list(d.records.items())
    kgs = [key_group_of(k) for k, _ in f.records]
    assert kgs == sorted(kgs)
    pos = 0
    for b in f.footer.blocks:
        assert (b.first_kg, b.last_kg) == (min(kgs[pos:pos + b.count]), max(kgs[pos:pos + b.count]))
        pos += b.count


def test_encode_delta_of_an_empty_and_a_one_record_delta(fixed_clock):
    s = make_store(n=5)
    keys = [k for k, _ in s.items()]
    empty = delta_of(s, [], [store_key(9, b"absent")])  # a removal of nothing changes nothing
    assert len(empty) == 0
    for d in (empty, delta_of(s, [(keys[0], b"x")]), delta_of(s, [], [keys[1]])):
        data = encode_delta(d)
        assert data == old_delta(d)
        assert read_checkpoint(data, "d", expect=(SID, d.ref, DELTA)).records == list(d.records.items())


def test_encode_delta_leaves_the_delta_table_as_it_was():
    """The export view is released: the table keeps no view (it may reclaim garbage again) and is
    still the delta's records."""
    _, d = big_delta(n=3000)
    before = list(d.records.items())
    encode_delta(d, block_bytes=1024)
    assert list(d.records.items()) == before
    layout = getattr(d.table, "_layout", None)
    if layout is not None:
        assert layout()["views"] == 0


def test_a_failing_block_fails_the_file_and_cancels_the_rest(monkeypatch):
    _, d = big_delta(n=5000)
    calls = []

    def bad(payload, count, codec, level):
        calls.append(count)
        if len(calls) == 3:
            raise checkpoint.InterfaceError("boom")
        return real(payload, count, codec, level)

    real = checkpoint.blockcodec.encode_payload_block
    monkeypatch.setattr(checkpoint.blockcodec, "encode_payload_block", bad)
    with pytest.raises(checkpoint.InterfaceError, match="boom"):
        encode_delta(d, block_bytes=512)


@pytest.mark.parametrize("block_bytes", [100, 4096, 64 << 10, checkpoint.DEFAULT_BLOCK_BYTES])
def test_snapshot_paths_agree(block_bytes, fixed_clock):
    s, _ = big_delta()
    with s.freeze() as view:
        steps = list(checkpoint.snapshot_steps(view, block_bytes=block_bytes))
        assert all(x is None for x in steps[:-1]) and len(steps) >= 2
        stepped = b"".join(steps[-1])
        one = encode_snapshot(view, block_bytes=block_bytes)
        serial = encode_snapshot(view, block_bytes=block_bytes, threads=False)
        w = checkpoint.CheckpointWriter(SNAPSHOT, view.store_id, view.ref, view.lineage, block_bytes=block_bytes)
        for _ in w.add_records(list(view.items())):
            pass
        records_path = w.finish()
        before = old_snapshot(view, block_bytes)
    assert one == stepped == serial == records_path
    f = read_checkpoint(one, "s", expect=(SID, s.head, SNAPSHOT))
    assert f.records == list(s.items())
    # the snapshot_steps of before the packed path cut other blocks (11 bytes counted per record):
    # the same records, another block index
    g = read_checkpoint(before, "s", expect=(SID, s.head, SNAPSHOT))
    assert g.records == f.records and g.footer.records == f.footer.records


def test_files_written_before_read_the_same():
    """Files of the earlier writers — a delta in commit order, snapshot blocks cut by ``chunk`` —
    read and rescale as before."""
    s, d = big_delta(n=4000, groups=64)
    shuffled = list(d.records.items())
    random.Random(1).shuffle(shuffled)
    data = old_delta(d, records=shuffled, block_bytes=2048)
    f = read_checkpoint(data, "d", expect=(SID, d.ref, DELTA))
    assert f.records == shuffled and dict(f.records) == dict(d.records.items())
    with s.freeze() as view:
        snap = old_snapshot(view, 4096)
    index = read_index(snap[-8192:], "s")
    wanted = blocks_for_key_groups(index, 10, 20)
    got = [(k, v) for k, v in decode_blocks(snap, "s", wanted) if 10 <= key_group_of(k) <= 20]
    assert got == [(k, v) for k, v in s.items() if 10 <= key_group_of(k) <= 20]


async def test_old_and_new_files_load_into_one_state(tmp_path):
    """A chain of files from both writers — an old snapshot, an old delta in commit order, new
    deltas — loads to the state in memory."""
    rnd = random.Random(7)
    async with LocalObjectStore(tmp_path / "ckpt") as objstore:
        sid = StoreId(objstore.uri, "agg", 0)
        s = VersionedStore(sid)
        w = s.open(0)
        w.put_many([(store_key(rnd.randrange(50), b"k%d" % i), b"v%d" % i) for i in range(3000)])
        d1 = w.commit()
        await create_checkpoint_file(objstore, sid, d1.ref, DELTA, encode_delta(d1))
        with s.freeze() as view:
            await create_checkpoint_file(objstore, sid, s.head, SNAPSHOT, old_snapshot(view, 4096))
        s.mark_snapshot(s.head)
        for v in range(2, 6):
            keys = [k for k, _ in s.items()]
            w = s.open(v - 1)
            w.put_many([(k, b"w%d" % v) for k in rnd.sample(keys, 400)] + [(store_key(3, b"new%d" % v), b"n")])
            w.remove_many(rnd.sample(keys, 50))
            d = w.commit()
            if v == 3:
                recs = list(d.records.items())
                rnd.shuffle(recs)  # commit order, as deltas were once written
                data = old_delta(d, records=recs, block_bytes=1024)
            else:
                data = encode_delta(d, block_bytes=1024)
            await create_checkpoint_file(objstore, sid, d.ref, DELTA, data)
        loaded, _ = await load_store(objstore, sid, s.head)
        assert list(loaded.items()) == list(s.items())


@pytest.mark.parametrize("kind", [DELTA, SNAPSHOT])
def test_the_footer_names_each_blocks_first_key(kind):
    """``first_keys`` lets a reader find the block of any key from the footer alone (the cold tier
    reads one block, not the file); a footer written without it (before the cold tier) still reads,
    and one that does not match the blocks is a typed error."""
    s, d = big_delta(n=4000, groups=64)
    if kind == DELTA:
        data = encode_delta(d, block_bytes=2048)
    else:
        with s.freeze() as view:
            data = encode_snapshot(view, block_bytes=2048)
    f = read_checkpoint(data, "f")
    assert len(f.footer.blocks) > 10 and read_index(data, "f").first_keys == f.footer.first_keys
    starts = [0]
    for b in f.footer.blocks[:-1]:
        starts.append(starts[-1] + b.count)
    assert f.footer.first_keys == [f.records[i][0] for i in starts]

    def with_footer(change) -> bytes:
        off, n, _ = checkpoint.read_trailer(data, "f")
        body = json.loads(data[off + 6: off + n])
        change(body)
        raw = json.dumps(body, separators=(",", ":")).encode()
        footer = checkpoint._FOOT.pack(checkpoint.FOOTER_MARK, len(raw)) + raw
        return data[:off] + footer + checkpoint._TRAIL.pack(off, len(footer), xxhash.xxh3_64_intdigest(footer),
                                                           checkpoint.END_MAGIC)

    old = read_checkpoint(with_footer(lambda body: body.pop("first_keys")), "f")
    assert old.footer.first_keys is None and old.records == f.records
    swapped = with_footer(lambda body: body["first_keys"].reverse())
    with pytest.raises(CorruptFileError, match="first keys"):
        read_checkpoint(swapped, "f")
    short = with_footer(lambda body: body["first_keys"].pop())
    with pytest.raises(CorruptFileError, match="first keys for"):
        read_index(short, "f")
