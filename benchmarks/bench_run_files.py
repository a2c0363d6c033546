"""What bounding the runs' open files costs a read: ``max_open_runs`` against per-read reopening.

    .venv/bin/python benchmarks/bench_run_files.py [--runs 1000] [--reads 20000] [--caps 1,64,256,1000]

Writes ``--runs`` small snapshot files, opens each as a ``ColdRun`` through one ``RunFiles`` of
``max_open`` (each cap of ``--caps`` in turn; a cap of at least ``--runs`` never closes a file, as
every run holding its own open file did before the bound), with no block cache (every read goes to
the file), and reads one key at a time from runs picked at random (uniformly: the worst case for
an LRU) and then from a working set of 64 runs (the recently read stores of a daemon). Prints the
CPU microseconds per read (the process's user + system time, so other jobs on the machine count
little), the files opened again and the peak of open files, per cap.
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from statestore_async.engine.store import VersionedStore
from statestore_async.files.checkpoint import encode_snapshot
from statestore_async.files.coldrun import BlockCache, ColdRun
from statestore_async.files.runfiles import RunFiles
from statestore_async.ids import StoreId

SID = StoreId("file:///bench", "runs", 0)
KEYS = 200


def key(j: int) -> bytes:
    return b"\x00\x01" + b"k%06d" % j


def write_files(folder: str, n: int) -> list[tuple[str, VersionedStore]]:
    out = []
    for i in range(n):
        s = VersionedStore(SID)
        w = s.open(0)
        w.put_many([(key(j), b"%06d" % i * 16) for j in range(KEYS)])
        w.commit()
        with s.freeze() as view:
            data = encode_snapshot(view, block_bytes=2048)
        path = os.path.join(folder, f"s{i}")
        with open(path, "wb") as fh:
            fh.write(data)
        out.append((path, s))
    return out


def measure(files: list[tuple[str, VersionedStore]], cap: int, picks: list[int], park: str) -> dict[str, float]:
    pool = RunFiles(cap, park_dir=park)
    cache = BlockCache(0, pool)
    runs = [ColdRun.open(path, SID, s.head, cache) for path, s in files]
    rnd = random.Random(7)
    t0 = time.process_time()  # this process's CPU (user + system): other jobs on the machine do not count
    for i in picks:
        if runs[i].get(key(rnd.randrange(KEYS))) is None:
            raise AssertionError("a key went missing")
    dt = time.process_time() - t0
    st = pool.stats()
    for run in runs:
        run.close()
    return {"us": dt / len(picks) * 1e6, "reopens": st["opens"], "peak_open": st["peak_open"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--reads", type=int, default=20000)
    ap.add_argument("--caps", default="1,64,256,1000")
    args = ap.parse_args()
    caps = [int(c) for c in args.caps.split(",")]
    folder = tempfile.mkdtemp(prefix="bench-run-files-")
    try:
        files = write_files(folder, args.runs)
        rnd = random.Random(1)
        uniform = [rnd.randrange(args.runs) for _ in range(args.reads)]
        hot = rnd.sample(range(args.runs), min(64, args.runs))
        working = [rnd.choice(hot) for _ in range(args.reads)]
        print(f"{args.runs} runs, {args.reads} reads each way, no block cache")
        print(f"{'max_open':>8} {'uniform CPU us/read':>19} {'reopens':>8} {'peak open':>9} "
              f"{'64-run set CPU us/read':>22} {'reopens':>8} {'peak open':>9}")
        for cap in caps:
            a = measure(files, cap, uniform, os.path.join(folder, "park"))
            b = measure(files, cap, working, os.path.join(folder, "park"))
            print(f"{cap:8d} {a['us']:19.1f} {a['reopens']:8.0f} {a['peak_open']:9.0f} "
                  f"{b['us']:22.1f} {b['reopens']:8.0f} {b['peak_open']:9.0f}", flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
