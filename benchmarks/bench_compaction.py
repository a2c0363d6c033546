"""Compaction benchmark: the snapshot of a spilled store against the snapshot of the same store in memory.

Run: ``.venv/bin/python benchmarks/bench_compaction.py [--records 1000000 4000000] [--repeat 3]``.

For each size it builds a store of N records (12-byte keys over 4096 key groups, 16-byte values,
workload W's state), writes its snapshot file, and spills a copy of it onto that file
(``files.coldrun.ColdRun``); then it commits 4 versions of 1% changed keys (a tenth of them
removals) to both, writes each delta file and stacks them over the snapshot as the registry does
when a spilled store's hot part leaves memory (``ColdStack``), and commits one more 1% version
(in the spilled store's hot part). It then times writing the head's snapshot:

- ``in memory``: ``encode_snapshot`` of the frozen view of the store kept whole in memory;
- ``spilled``: the same for the spilled store (hot part over 4 delta runs over the snapshot run),
  cold blocks read from a cold block cache (each run starts with no block cached);

both as the daemon does it (``snapshot_steps``: one thread, in steps) and in one call with the
encoding threads (``encode_snapshot``). Both files are checked to hold the same records. The
machine is shared: each figure is the best of ``--repeat`` runs.
"""
from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from collections.abc import Callable

from rich.console import Console
from rich.table import Table as RichTable

from statestore_async.codecs.keylayout import store_key
from statestore_async.engine.store import VersionedStore
from statestore_async.files.checkpoint import block_bytes_for, encode_delta, encode_snapshot, read_checkpoint, snapshot_steps
from statestore_async.files.coldrun import BlockCache, ColdRun, ColdStack
from statestore_async.files.names import DELTA
from statestore_async.ids import StoreId

SID = StoreId("file:///bench", "compaction", 0)
GROUPS = 4096


def key(i: int) -> bytes:
    return store_key(i % GROUPS, b"%010d" % i)


def value(i: int, r: int) -> bytes:
    return (i * 7919 + r).to_bytes(8, "little") + r.to_bytes(8, "little")


def build(n: int, folder: str) -> tuple[VersionedStore, VersionedStore, BlockCache]:
    """(the store in memory, the same store spilled with 4 delta runs and a hot commit, the runs' cache)."""
    mem = VersionedStore(SID, history=1)
    w = mem.open(0)
    order = list(range(n))
    random.Random(0).shuffle(order)  # put in random order, as a stream does
    w.put_many([(key(i), value(i, 0)) for i in order])
    w.commit()
    with mem.freeze() as view:
        snap = encode_snapshot(view, block_bytes=block_bytes_for(mem.memory_bytes))
    path = os.path.join(folder, f"snapshot-{n}")
    with open(path, "wb") as f:
        f.write(snap)
    cache = BlockCache(64 << 20)
    spilled = VersionedStore(SID, mem._data, mem.head, (), head_has_snapshot=True, history=1)
    mem = VersionedStore(SID, _copy(mem), mem.head, (), head_has_snapshot=True, history=1)
    spilled.spill(ColdRun.open(path, SID, spilled.head, cache))
    rnd = random.Random(1)
    runs: list[ColdRun] = []
    for r in range(1, 6):
        keys = rnd.sample(range(n + n // 50), n // 100)  # some new keys too
        dels = keys[: len(keys) // 10]
        deltas = []
        for s in (mem, spilled):
            w = s.open(s.head.version, s.head.ckptid)
            w.put_many([(key(i), value(i, r)) for i in keys[len(dels):]])
            w.remove_many([key(i) for i in dels])
            deltas.append(w.commit(ckptid=f"{r:032x}"))
        if r == 5:
            break  # the last commit stays in the spilled store's hot part
        dpath = os.path.join(folder, f"delta-{n}-{r}")
        with open(dpath, "wb") as f:
            f.write(encode_delta(deltas[1]))
        runs.insert(0, ColdRun.open(dpath, SID, deltas[1].ref, cache, kind=DELTA))
        spilled.spill(ColdStack.over(runs[:1], spilled.cold))  # type: ignore[arg-type]
    return mem, spilled, cache


def _copy(store: VersionedStore):  # a second table with the same records
    from statestore_async.engine.table import Table, load_records
    t = Table()
    load_records(t, list(store.items()))
    return t


def best(repeat: int, fn: Callable[[], object], before: Callable[[], object] = lambda: None) -> tuple[float, object]:
    times = []
    out: object = None
    for _ in range(repeat):
        before()
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return min(times), out


def steps(store: VersionedStore) -> bytes:
    with store.freeze() as view:
        parts: list[bytes] = []
        for item in snapshot_steps(view, block_bytes=min(block_bytes_for(store.memory_bytes), 64 << 10)):
            if item is not None:
                parts = item
    return b"".join(parts)


def one_call(store: VersionedStore) -> bytes:
    with store.freeze() as view:
        return encode_snapshot(view)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, nargs="+", default=[1_000_000, 4_000_000])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    console = Console()
    table = RichTable(title=f"bench_compaction — snapshot of a store spilled over a snapshot + 4 delta runs + "
                            f"1% in memory, vs in memory (best of {args.repeat}; load {os.getloadavg()[0]:.1f})")
    for col in ("records", "path", "in memory", "spilled", "spilled / in memory", "file MiB (mem / spilled)"):
        table.add_column(col, justify="right")
    with tempfile.TemporaryDirectory() as folder:
        for n in args.records:
            t0 = time.perf_counter()
            mem, spilled, cache = build(n, folder)
            console.print(f"built {n:,} records in {time.perf_counter() - t0:.1f} s")
            expect = dict(mem.items())
            for name, fn in (("snapshot_steps (daemon)", steps), ("encode_snapshot (threads)", one_call)):
                tm, a = best(args.repeat, lambda fn=fn, s=mem: fn(s))
                ts, b = best(args.repeat, lambda fn=fn, s=spilled: fn(s), lambda: cache.shrink(0))
                assert isinstance(a, bytes) and isinstance(b, bytes)
                got_a = read_checkpoint(a, "mem").records
                got_b = read_checkpoint(b, "spilled").records
                assert len(got_a) == len(got_b) == len(expect) and dict(got_b) == expect, "the files differ"
                table.add_row(f"{n:,}", name, f"{tm * 1000:.0f} ms", f"{ts * 1000:.0f} ms", f"{ts / tm:.2f}×",
                              f"{len(a) / 2**20:.1f} / {len(b) / 2**20:.1f}")
            del mem, spilled, expect
    console.print(table)


if __name__ == "__main__":
    main()
