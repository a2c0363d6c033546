"""Foundation benchmark: codecs (Cython vs Python reference), engine ops, commit cost, snapshots.

Run: ``.venv/bin/python benchmarks/bench_foundation.py [--keys 1000000]``  (``make bench`` runs all).
Prints one table. The machine is shared and noisy: compare the ratios, not the absolute numbers.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa
from rich.console import Console
from rich.table import Table

from statestore_async.codecs import arrowcodec, twins
from statestore_async.codecs.keylayout import store_key
from statestore_async.engine.store import VersionedStore
from statestore_async.files.loader import load_store
from statestore_async.files.transfer import write_snapshot
from statestore_async.ids import StoreId
from statestore_async.objectstore import LocalObjectStore


def best_of(fn, repeat=3):
    best = float("inf")
    result = None
    for _ in range(repeat):
        gc.collect()
        t = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t)
    return best, result


def codec_rows(n_native: int, n_ref: int):
    rows = []
    mods = ("sparkhash", "valuecodec", "arrowcodec", "blockcodec")
    impls = {"native": {m: twins.native(m) for m in mods}, "python": {m: twins.reference(m) for m in mods}}
    data = {}
    for label, n in (("native", n_native), ("python", n_ref)):
        m = impls[label]
        keys = [("k%08d" % i,) for i in range(n)]
        arrow_col = pa.array([k[0] for k in keys])
        t, _ = best_of(lambda: m["sparkhash"].hash_rows(keys, ["string"]))
        data[(label, "hash_rows (1 string col)")] = (n / t, n * 9 / t)
        t, _ = best_of(lambda: m["sparkhash"].hash_arrow([arrow_col]))
        data[(label, "hash_arrow (1 string col)")] = (n / t, n * 9 / t)
        values = [("k%08d" % i, i, i * 0.5) for i in range(n)]
        t, enc = best_of(lambda: m["valuecodec"].encode_rows(values))
        nbytes = sum(map(len, enc))
        data[(label, "row codec encode")] = (n / t, nbytes / t)
        t, _ = best_of(lambda: m["valuecodec"].decode_rows(enc))
        data[(label, "row codec decode")] = (n / t, nbytes / t)
        # arrowcodec: store keys (key group + (state name, str key)) and (int64, int64) state rows
        kgs = np.arange(n, dtype=np.uint16) % 4096
        head = m["valuecodec"].encode_key("total")
        t, (_, kdata, _) = best_of(lambda: m["arrowcodec"].encode_columns(
            n, [arrowcodec.descriptor(arrow_col)], kgs, head, 1, True))
        data[(label, "arrowcodec store keys")] = (n / t, len(kdata) / t)
        state = pa.table({"count": np.arange(n), "sum": np.arange(n) * 7})
        t, (offs, sdata, w) = best_of(lambda: m["arrowcodec"].encode_columns(
            n, [arrowcodec.descriptor(c) for c in state.columns], None, b"", 0, False))
        data[(label, "arrowcodec state rows encode")] = (n / t, len(sdata) / t)
        col = ("y", w, None, offs, sdata, 0)
        t, _ = best_of(lambda: m["arrowcodec"].decode_columns(n, col, [("i", 8), ("i", 8)]))
        data[(label, "arrowcodec state rows decode")] = (n / t, len(sdata) / t)
        records = [(store_key(i % 4096, b"k%08d" % i), b"v" * 16) for i in range(n)]
        raw = sum(len(k) + len(v) + 3 for k, v in records)

        def enc_all():
            out, start = [], 0
            while start < len(records):
                b, start = m["blockcodec"].encode_block(records, start, 1 << 20, 1, 3)
                out.append(b)
            return out

        t, blocks = best_of(enc_all)
        data[(label, "block codec encode (zstd)")] = (n / t, raw / t)

        def dec_all():
            return sum(len(m["blockcodec"].decode_block(b, 0)[0]) for b in blocks)

        t, _ = best_of(dec_all)
        data[(label, "block codec decode (zstd)")] = (n / t, raw / t)
    for what in dict.fromkeys(w for _, w in data):
        nat, ref = data[("native", what)], data[("python", what)]
        rows.append((what, f"{nat[0] / 1e6:.2f} M/s", f"{nat[1] / 1e6:.0f} MB/s", f"{ref[0] / 1e6:.3f} M/s",
                     f"{nat[0] / ref[0]:.1f}×"))
    return rows


def engine_rows(n: int):
    sid = StoreId("file:///bench", "bench", 0)
    keys = [store_key(i % 4096, b"k%08d" % i) for i in range(n)]
    value = b"v" * 16
    out = []
    s = VersionedStore(sid)
    w = s.open(0)
    t = time.perf_counter()
    w.put_many([(k, value) for k in keys])
    t_put = time.perf_counter() - t
    w.commit()
    w = s.open(1)
    t = time.perf_counter()
    w.get_many(keys)
    t_get = time.perf_counter() - t
    w.abort()
    out.append(("engine put_many", f"{n / t_put / 1e6:.2f} M keys/s", ""))
    out.append(("engine get_many", f"{n / t_get / 1e6:.2f} M keys/s", ""))
    for frac in (0.01, 1.0):
        changed = keys[: int(n * frac)]
        w = s.open(s.head.version)
        w.put_many([(k, b"w" * 16) for k in changed])
        t = time.perf_counter()
        d = w.commit()
        dt = time.perf_counter() - t
        out.append((f"commit, {n:,} keys, {frac:.0%} changed", f"{dt * 1e3:.1f} ms", f"{len(d):,} records"))
    return s, out


async def snapshot_rows(store):
    tmp = tempfile.mkdtemp(prefix="ssa-bench-")
    try:
        async with LocalObjectStore(tmp, fsync=True) as objstore:
            sid = StoreId(objstore.uri, "bench", 0)
            store.store_id = sid
            with store.freeze() as view:
                t = time.perf_counter()
                key, size = await write_snapshot(objstore, view)
                t_write = time.perf_counter() - t
            store.mark_snapshot(store.head)
            raw = sum(len(k) + len(v) for k, v in store.items())
            t = time.perf_counter()
            loaded, report = await load_store(objstore, sid, store.head)
            t_load = time.perf_counter() - t
            assert len(loaded) == len(store)
            return [
                (f"snapshot write ({len(store):,} keys)", f"{raw / t_write / 1e6:.0f} MB/s raw",
                 f"{t_write:.2f} s, file {size / 1e6:.1f} MB"),
                (f"snapshot load ({len(store):,} keys)", f"{raw / t_load / 1e6:.0f} MB/s raw", f"{t_load:.2f} s"),
            ]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--keys", type=int, default=1_000_000, help="store size for engine/commit/snapshot figures")
    ap.add_argument("--codec-rows", type=int, default=200_000, help="rows per codec measurement (native)")
    args = ap.parse_args()
    console = Console()
    t = Table(title="codecs: Cython vs pure-Python reference (best of 3)")
    for c in ("operation", "Cython", "Cython MB/s", "Python", "speed-up"):
        t.add_column(c, justify="right" if c != "operation" else "left")
    for row in codec_rows(args.codec_rows, max(2000, args.codec_rows // 20)):
        t.add_row(*row)
    console.print(t)
    store, erows = engine_rows(args.keys)
    erows += asyncio.run(snapshot_rows(store))
    t2 = Table(title=f"engine and checkpoint files ({args.keys:,} keys, 12-byte keys, 16-byte values)")
    for c in ("operation", "figure", "detail"):
        t2.add_column(c)
    for row in erows:
        t2.add_row(*row)
    console.print(t2)
    console.print(f"python {sys.version.split()[0]}, {os.cpu_count()} cpus")


if __name__ == "__main__":
    main()
