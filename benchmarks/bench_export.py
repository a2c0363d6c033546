"""Export benchmark: ``statestore-async export`` of N state records (default 1M) to Parquet and JSON lines.

Run: ``.venv/bin/python benchmarks/bench_export.py [--records 1000000] [--partitions 4]``.
Writes a checkpoint as the operator lays it out — per key one record of a ``value_state("total")``
holding ``(count, sum)``, key ``(user string,)``, key groups by Spark's xxhash64, one snapshot per
partition and a manifest with the operator's metadata — then times ``cli.offline.export_state``
(both passes: types, then rows; the load of every partition is in the time) and prints rows/s.
The machine is shared and noisy: the figure is the best of ``--repeat`` runs.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import tempfile
import time

import numpy as np
from rich.console import Console
from rich.table import Table

from statestore_async.cli.offline import export_state
from statestore_async.codecs import sparkhash, valuecodec
from statestore_async.codecs.keylayout import store_key
from statestore_async.engine.store import VersionedStore
from statestore_async.files.manifest import Manifest, write_manifest
from statestore_async.files.transfer import write_snapshot
from statestore_async.ids import StoreId
from statestore_async.objectstore import LocalObjectStore
from statestore_async.state.keys import owned_key_groups

KEY_GROUPS = 256


async def build(folder: str, records: int, partitions: int) -> str:
    """A checkpoint of operator "bench" at version 1 holding ``records`` keys; its root URI."""
    users = [f"user-{i:09d}" for i in range(records)]
    kgs = sparkhash.key_groups(sparkhash.hash_rows([(u,) for u in users], ["string"]), KEY_GROUPS)
    owner = np.empty(KEY_GROUPS, np.int64)
    for p in range(partitions):
        owner[list(owned_key_groups(p, partitions, KEY_GROUPS))] = p
    part_of = owner[kgs]
    keys = valuecodec.encode_keys([("total", u) for u in users])
    rng = np.random.default_rng(0)
    values = valuecodec.encode_rows([(int(c), int(s)) for c, s in zip(rng.integers(1, 1000, records),
                                                                       rng.integers(0, 10**9, records))])
    async with LocalObjectStore(folder) as objstore:
        refs = []
        for p in range(partitions):
            idx = np.flatnonzero(part_of == p).tolist()
            store = VersionedStore(StoreId(objstore.uri, "bench", p))
            w = store.open(0)
            w.put_many([(store_key(int(kgs[i]), keys[i]), values[i]) for i in idx])
            d = w.commit()
            with store.freeze() as view:
                await write_snapshot(objstore, view)
            refs.append(d.ref)
        metadata = {"layout": "statestore_async.spark/1", "key_columns": ["user"],
                    "states": {"total": {"kind": "value", "ttl": False}}}
        await write_manifest(objstore, Manifest("bench", 1, partitions, KEY_GROUPS, {"default": tuple(refs)},
                                                metadata=metadata))
        return objstore.uri


async def export(root: str, path: str, fmt: str):
    async with LocalObjectStore(root.removeprefix("file://"), create=False) as objstore:
        return await export_state(objstore, root, "bench", path, fmt=fmt)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="bench-export-")
    try:
        t = time.perf_counter()
        root = asyncio.run(build(os.path.join(work, "root"), args.records, args.partitions))
        built = time.perf_counter() - t
        table = Table(title=f"export of {args.records:,} state records in {args.partitions} partitions "
                            f"(checkpoint written in {built:.1f}s)")
        for col in ("format", "rows", "file bytes", "best seconds", "rows/s"):
            table.add_column(col, justify="right")
        for fmt in ("parquet", "jsonl"):
            best = None
            for i in range(args.repeat):
                path = os.path.join(work, f"out-{i}.{fmt}")
                r = asyncio.run(export(root, path, fmt))
                os.unlink(path)
                if best is None or r.seconds < best.seconds:
                    best = r
            assert best is not None and best.rows == args.records, best
            table.add_row(fmt, f"{best.rows:,}", f"{best.bytes:,}", f"{best.seconds:.2f}", f"{best.rows_per_second:,.0f}")
        Console().print(table)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
