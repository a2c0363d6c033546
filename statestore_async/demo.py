"""``make demo``: a streaming count with a crash in the middle and recovery from files alone.

A worker process plays a stateful streaming job: every micro-batch of events (user, amount) is
routed to 2 state partitions by Spark's ``xxhash64`` of the key, each partition opens its store at
the batch's version, adds to (count, total) per user, commits, and writes its delta; then the
"driver" checks every file is present and writes the manifest ``_commits/<batch+1>.json``. The
worker is killed with SIGKILL in the middle of a batch (after its deltas, before the manifest). A
fresh worker then recovers each partition from the last manifest — files only — replays the lost
batch under new checkpoint ids, and finishes. The final state is checked against a plain dict.

Run: ``python -m statestore_async.demo [--dir DIR] [--batches N] [--crash-at B]``.
"""
from __future__ import annotations

import asyncio
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import click
from rich.console import Console
from rich.table import Table

from . import rowcodec, rowhash
from .engine import VersionedStore
from .files import write_delta, write_snapshot
from .ids import DELTA, SNAPSHOT, EMPTY_STATE, StoreId, file_key
from .keys import store_key
from .loader import load_store
from .manifest import Manifest, list_manifest_versions, read_manifest, write_manifest
from .objectstore import open_object_store

OPERATOR = "user_totals"
PARTITIONS = 2
KEY_GROUPS = 128
SNAPSHOT_EVERY = 3
console = Console(highlight=False)


def make_batch(batch_id: int, rows: int = 20_000, users: int = 5_000) -> list[tuple[str, int]]:
    rnd = random.Random(batch_id)
    return [(f"user-{rnd.randrange(users):05d}", rnd.randrange(1, 100)) for _ in range(rows)]


def route(rows):
    """partition -> {store key: [amounts]}: Spark's xxhash64 of the key, key group, partition."""
    users = sorted({u for u, _ in rows})
    hashes = rowhash.hash_rows([(u,) for u in users], ["string"])
    kgs = rowhash.key_groups(hashes, KEY_GROUPS)
    keys = {}
    for u, kg in zip(users, kgs.tolist()):
        keys[u] = (rowhash.partition_of_key_group(kg, KEY_GROUPS, PARTITIONS), store_key(kg, rowcodec.encode_key((u,))))
    out = {p: {} for p in range(PARTITIONS)}
    for u, amount in rows:
        p, k = keys[u]
        out[p].setdefault(k, []).append(amount)
    return out


async def run_batch(objstore, stores, root, batch_id, crash_before_manifest=False):
    version = batch_id
    refs = []
    for p, changes in route(make_batch(batch_id)).items():
        store = stores[p]
        w = store.open(version)
        current = w.get_many(list(changes))
        updates = []
        for (k, amounts), old in zip(changes.items(), current):
            count, total = rowcodec.decode_row(old) if old is not None else (0, 0)
            updates.append((k, rowcodec.encode_row((count + len(amounts), total + sum(amounts)))))
        w.put_many(updates)
        delta = w.commit()
        await write_delta(objstore, delta)
        if delta.version % SNAPSHOT_EVERY == 0:
            with store.freeze() as view:
                await write_snapshot(objstore, view)
            store.mark_snapshot(delta.ref)
        refs.append(delta.ref)
    if crash_before_manifest:
        console.print(f"  [bold red]worker: batch {batch_id} committed and uploaded, crashing before the manifest (SIGKILL)[/]")
        os.kill(os.getpid(), signal.SIGKILL)
    # the driver's fence: every file must be in the object store before the manifest is written
    for p, ref in enumerate(refs):
        assert await objstore.exists(file_key(stores[p].store_id, ref, DELTA))
    await write_manifest(objstore, Manifest(OPERATOR, batch_id + 1, PARTITIONS, KEY_GROUPS, {"default": tuple(refs)}))
    return refs


async def worker(root: str, batches: int, crash_at: int) -> None:
    async with open_object_store(root) as objstore:
        versions = await list_manifest_versions(objstore, OPERATOR)
        start = versions[-1] if versions else 0
        stores = {}
        for p in range(PARTITIONS):
            sid = StoreId(root, OPERATOR, p)
            if start:
                ref = (await read_manifest(objstore, OPERATOR, start)).ref(p)
                t = time.perf_counter()
                stores[p], report = await load_store(objstore, sid, ref)
                what = (f"snapshot {report.snapshot.version} + " if report.snapshot else "") + f"{len(report.deltas)} deltas"
                console.print(f"  worker: partition {p} recovered at version {ref.version} from {what} "
                              f"({len(report.files_read)} files, {report.bytes_read} bytes, "
                              f"{(time.perf_counter() - t) * 1e3:.1f} ms, no LIST)")
            else:
                stores[p] = VersionedStore(sid)
        for b in range(start, batches):
            refs = await run_batch(objstore, stores, root, b, crash_before_manifest=(b == crash_at))
            console.print(f"  worker: batch {b} done -> version {b + 1} "
                          + ", ".join(f"p{p}={r.ckptid[:8]}" for p, r in enumerate(refs)))


async def read_final(root: str, version: int) -> dict:
    async with open_object_store(root) as objstore:
        m = await read_manifest(objstore, OPERATOR, version)
        state = {}
        for p in range(PARTITIONS):
            store, _ = await load_store(objstore, StoreId(root, OPERATOR, p), m.ref(p))
            for k, v in store.items():
                (user,) = rowcodec.decode_row(k[2:])
                state[user] = rowcodec.decode_row(v)
        return state


def oracle(batches: int) -> dict:
    out: dict = {}
    for b in range(batches):
        for u, amount in make_batch(b):
            c, t = out.get(u, (0, 0))
            out[u] = (c + 1, t + amount)
    return out


@click.command()
@click.option("--dir", "directory", default="demo-data", show_default=True, help="checkpoint root (local folder)")
@click.option("--root", default=None, help="checkpoint root URI instead of --dir (file:///… or s3://…)")
@click.option("--batches", default=8, show_default=True)
@click.option("--crash-at", default=4, show_default=True, help="batch during which the worker is killed")
@click.option("--worker", "as_worker", is_flag=True, hidden=True)
def main(directory, root, batches, crash_at, as_worker):
    """Run the demo: a stateful count over micro-batches, a crash, recovery, and a check."""
    if root is None:
        path = os.path.abspath(directory)
        if not as_worker and os.path.exists(path):
            shutil.rmtree(path)
        root = "file://" + path
    if as_worker:
        asyncio.run(worker(root, batches, crash_at))
        return
    console.rule("[bold]statestore_async demo")
    console.print(f"checkpoint root: {root}\n{batches} micro-batches of 20,000 events, {PARTITIONS} state partitions, "
                  f"snapshot every {SNAPSHOT_EVERY} versions\n")
    cmd = [sys.executable, "-m", "statestore_async.demo", "--root", root, "--batches", str(batches),
           "--crash-at", str(crash_at), "--worker"]
    console.print("[bold]run 1[/]: start the job")
    first = subprocess.run(cmd)
    console.print(f"  worker exited with {'SIGKILL' if first.returncode == -signal.SIGKILL else first.returncode}\n")
    console.print("[bold]run 2[/]: restart the job; it recovers from the last manifest and replays the lost batch")
    second = subprocess.run(cmd[:-3] + ["--crash-at", "-1", "--worker"])
    if second.returncode != 0:
        raise SystemExit(f"the recovering worker failed ({second.returncode})")
    state = asyncio.run(read_final(root, batches))
    expected = oracle(batches)
    table = Table(title="final state vs oracle (a plain dict over the same events)")
    for col in ("", "users", "events counted", "sum of amounts"):
        table.add_column(col, justify="right")
    for name, s in (("statestore_async", state), ("oracle", expected)):
        table.add_row(name, str(len(s)), str(sum(c for c, _ in s.values())), str(sum(t for _, t in s.values())))
    console.print(table)
    if state != expected:
        console.print("[bold red]MISMATCH: the recovered state differs from the oracle[/]")
        raise SystemExit(1)
    console.print("[bold green]OK[/]: the state after the crash and the replay equals the oracle — nothing lost, nothing counted twice.")


if __name__ == "__main__":
    main()
