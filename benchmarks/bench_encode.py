"""Encoding checkpoint files: the old path (Python records) against the packed path, and zstd's floor.

Run: ``.venv/bin/python benchmarks/bench_encode.py [--records 600000] [--repeat 5]``

A delta of ``--records`` changed records (12-byte keys: key group + 10 bytes, 16-byte values, as on
workload W) is encoded by

* ``old``: what ``files.checkpoint.encode_delta`` did before the packed path — a Python list of
  ``delta.records.items()`` (the table's first ordered read sorts it) fed to
  ``CheckpointWriter.add_records`` (``blockcodec.encode_block``, one thread);
* ``new``: ``encode_delta`` now — ``Table.freeze`` (its sort), block payloads
  written straight from the table (``chunk_packed``), blocks compressed in ``ENCODE_THREADS``
  threads; also with ``threads=False`` and at zstd level 1;

each on a fresh delta (never read in order), so every run pays its sort, as the uploader does. The
same for a snapshot of a state of that many records (``encode_snapshot``: old = ``chunk`` +
``add_records``). Then the floor: zstd alone compressing the same payload bytes in 1 MiB pieces, in
one thread and in ``ENCODE_THREADS`` threads. The machine is shared and noisy: best of ``--repeat``.
"""
from __future__ import annotations

import argparse
import gc
import struct
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import zstandard

from statestore_async.codecs import blockcodec, twins
from statestore_async.engine.store import VersionedStore
from statestore_async.files import checkpoint
from statestore_async.files.names import DELTA, SNAPSHOT
from statestore_async.ids import StoreId

SID = StoreId("file:///bench", "bench", 0)


def make_records(n: int, seed: int = 1) -> list[tuple[bytes, bytes]]:
    rng = np.random.default_rng(seed)
    ids = rng.choice(max(n * 2, 16), n, replace=False)
    kgs = rng.integers(0, 2048, n)  # one partition's key groups of 4096
    counts = rng.integers(1, 20, n)
    sums = rng.integers(0, 10**6, n)
    # key group + a tagged 10-byte key, value (count, sum) as two int64
    return [(struct.pack(">HBBq", int(g), 5, 2, int(i)), struct.pack("<qq", int(c), int(s)))
            for g, i, c, s in zip(kgs, ids, counts, sums)]


def fresh_delta(records):
    s = VersionedStore(SID)
    w = s.open(0)
    w.put_many(records)
    return w.commit()


def best(fn, make, repeat: int) -> tuple[float, object]:
    out, t_best = None, float("inf")
    for _ in range(repeat):
        arg = make()
        gc.collect()
        gc.disable()
        try:
            t = time.perf_counter()
            out = fn(arg)
            t_best = min(t_best, time.perf_counter() - t)
        finally:
            gc.enable()
    return t_best, out


def old_encode_delta(delta, level=3):
    # the block size ``encode_delta`` picks for the delta's size, so that both give the same bytes
    w = checkpoint.CheckpointWriter(DELTA, delta.store_id, delta.ref, delta.lineage, level=level,
                                    block_bytes=checkpoint.block_bytes_for(delta.nbytes))
    for _ in w.add_records(list(delta.records.items())):
        pass
    return w.finish()


def old_encode_snapshot(view):
    block_bytes = checkpoint.block_bytes_for(view.approx_bytes)  # as ``encode_snapshot``
    w = checkpoint.CheckpointWriter(SNAPSHOT, view.store_id, view.ref, view.lineage, level=3, block_bytes=block_bytes)
    pos = 0
    while True:
        block, pos = view.chunk(pos, block_bytes)
        if not block:
            break
        for _ in w.add_records(block):
            pass
    return w.finish()


def same_file(a: bytes, b: bytes) -> bool:
    """Two encodings of the same records are the same file but for their headers, which hold the
    creation time (its decimal digits can differ in number, and the footer's block offsets count
    from the file's start): the same records, and the same bytes after the header when the headers
    are as long."""
    ha, hb = checkpoint.header_length(a, "x"), checkpoint.header_length(b, "x")
    if ha == hb:
        return a[ha:] == b[hb:]
    name = "x"
    return (len(a) - ha == len(b) - hb
            and list(checkpoint.read_checkpoint(a, name).records) == list(checkpoint.read_checkpoint(b, name).records))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=600_000)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    n, rep = a.records, a.repeat
    print(f"table: {'compiled' if not twins.NO_EXTENSIONS else 'reference'}; {n:,} records of 12 + 16 bytes; "
          f"ENCODE_THREADS={checkpoint.ENCODE_THREADS}; best of {rep}")
    records = make_records(n)
    rows: list[tuple[str, float, int]] = []

    def row(label, t, size):
        rows.append((label, t, size))
        print(f"  {label:<58} {t * 1e3:8.1f} ms  {size:>10,} bytes", flush=True)

    print("delta (fresh each run: the sort is included)")
    t, old = best(old_encode_delta, lambda: fresh_delta(records), rep)
    row("old: list(records.items()) + add_records, level 3", t, len(old))
    t, new = best(lambda d: checkpoint.encode_delta(d, level=3), lambda: fresh_delta(records), rep)
    row("new: encode_delta, level 3", t, len(new))
    assert same_file(new, old), "the packed path must give the old bytes"
    t, new1 = best(lambda d: checkpoint.encode_delta(d, level=3, threads=False), lambda: fresh_delta(records), rep)
    row("new: encode_delta, level 3, threads=False", t, len(new1))
    t, lv1 = best(lambda d: checkpoint.encode_delta(d, level=1), lambda: fresh_delta(records), rep)
    row("new: encode_delta, level 1", t, len(lv1))
    t, _ = best(lambda d: checkpoint.encode_delta(d, level=1, threads=False), lambda: fresh_delta(records), rep)
    row("new: encode_delta, level 1, threads=False", t, len(lv1))
    t, _ = best(lambda d: old_encode_delta(d, level=1), lambda: fresh_delta(records), rep)
    row("old: level 1", t, len(lv1))
    print(f"  files are written at level {checkpoint.ZSTD_LEVEL} (checkpoint.ZSTD_LEVEL); reading them back:")
    for level, data in ((3, new), (1, lv1)):
        t, _ = best(lambda b: checkpoint.read_checkpoint(b, "d").records, lambda b=data: b, rep)
        row(f"read_checkpoint (decode every block), level {level}", t, len(data))

    print("  parts of the new path")
    t, view = best(lambda t: t.freeze(), lambda: fresh_delta(records).table, rep)
    row("freeze (the sort)", t, len(view))
    t, _ = best(lambda d: d.table.freeze(), lambda: fresh_delta(records), rep)
    row("(freeze: the table's own sort, for comparison)", t, 0)

    def payloads(v):
        out, pos = [], 0
        while pos < len(v):
            p, nxt, _, _ = v.chunk_packed(pos, checkpoint.DEFAULT_BLOCK_BYTES)
            out.append((p, nxt - pos))
            pos = nxt
        return out

    t, pays = best(payloads, lambda: view, rep)
    raw = sum(len(p) for p, _ in pays)
    row(f"chunk_packed, every block ({len(pays)} payloads)", t, raw)
    t, _ = best(lambda ps: [blockcodec.encode_payload_block(p, c, 1, 3) for p, c in ps], lambda: pays, rep)
    row("encode_payload_block, every block, one thread", t, 0)

    print("floor: zstd alone on the same payload bytes (1 MiB pieces)")
    chunks = [p for p, _ in pays]
    for level in (3, 1):
        c = zstandard.ZstdCompressor(level=level)
        t, out = best(lambda cs: [c.compress(x) for x in cs], lambda: chunks, rep)
        row(f"zstd level {level}, one thread", t, sum(map(len, out)))
    with ThreadPoolExecutor(checkpoint.ENCODE_THREADS) as ex:
        for level in (3, 1):
            comps = [zstandard.ZstdCompressor(level=level) for _ in chunks]
            t, out = best(lambda cs: list(ex.map(lambda ic: comps[ic[0]].compress(ic[1]), enumerate(cs))),
                          lambda: chunks, rep)
            row(f"zstd level {level}, {checkpoint.ENCODE_THREADS} threads", t, sum(map(len, out)))

    print(f"snapshot of a state of {n:,} records (frozen view; the table keeps no order index)")
    store = VersionedStore(SID)
    w = store.open(0)
    w.put_many(records)
    w.commit()
    t, old_s = best(lambda v: old_encode_snapshot(v), store.freeze, rep)
    row("old: chunk + add_records", t, len(old_s))
    t, new_s = best(lambda v: checkpoint.encode_snapshot(v, level=3), store.freeze, rep)
    row("new: encode_snapshot, level 3", t, len(new_s))
    t, new_s1 = best(lambda v: checkpoint.encode_snapshot(v, level=1), store.freeze, rep)
    row("new: encode_snapshot, level 1", t, len(new_s1))
    assert checkpoint.read_checkpoint(new_s, "s").records == checkpoint.read_checkpoint(old_s, "s").records
    t, _ = best(lambda v: list(checkpoint.snapshot_steps(v, block_bytes=64 << 10)), store.freeze, rep)
    row("new: snapshot_steps, 64 KiB blocks (the daemon's inline steps)", t, 0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
