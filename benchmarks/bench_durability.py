"""Durability benchmark on a real S3 server (SeaweedFS), daemon in its own process.

Run: ``.venv/bin/python benchmarks/bench_durability.py [--keys 1000000] [--batches 200]``

Prints one table:
- task-visible commit latency p50/p99 (client → daemon COMMIT round trip) with 0 ms and 50 ms of
  latency injected in front of S3 (a fault proxy), on a store filled to its 200k keys first (steady
  state), while uploads, snapshots (``--snapshot-builder inline|process``) and retention run in the
  background;
- bytes uploaded per batch against the changed records compressed on their own (zstd level 3);
- object-store requests per batch on the hot path (PUT/GET/HEAD/LIST), from the daemon's STATS;
- recovery of a store of ``--keys`` keys (snapshot + 5 deltas) by a fresh daemon with no cache:
  seconds and MB/s.
Targets (issue 4): commit p99 ≤ 2 ms at 0 and 50 ms; uploaded bytes ≤ 1.2× compressed changes;
LIST = 0 per batch on the hot path; recovery of 1M keys ≤ 2 s.
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import statistics
import subprocess
import tempfile
import time

import zstandard
from rich.console import Console
from rich.table import Table

from statestore_async.client.clients import Client
from statestore_async.ids import CheckpointRef, StoreId
from statestore_async.testing.daemon import start_daemon, stop_daemon
from statestore_async.testing.faultproxy import FaultProxy
from statestore_async.testing.seaweedfs import SeaweedFS, lower_priority

# SeaweedFS and the latency proxy stand in for a remote S3: on a real node they do not share the
# daemon's cores. They run at the lowest CPU priority so that the figures are the daemon's and its
# client's, not those of a storage server and a proxy copying every snapshot on the same two cores.
S3_NICE = 19


def key(i: int) -> bytes:
    return (i % 4096).to_bytes(2, "big") + b"k%010d" % i


def start(sock: str, endpoint: str, env: dict, **settings) -> subprocess.Popen:
    args = ["--s3-endpoint-url", endpoint, "--s3-region", "us-east-1", "--s3-addressing-style", "path",
            "--log-level", "warning"]
    for k, v in settings.items():
        args += ["--" + k.replace("_", "-"), str(v)]
    return start_daemon(sock, *args, log_path=sock + ".log", env=env)


def _proxy_main(upstream_port: int, latency: float, conn) -> None:
    """A fault proxy in a process of its own: it must not share the measuring client's GIL."""
    lower_priority(S3_NICE)
    proxy = FaultProxy(upstream_port).start()
    proxy.latency = latency
    conn.send(proxy.port)
    conn.recv()  # until the parent says stop
    proxy.stop()


class ProxyProcess:
    def __init__(self, upstream_port: int, latency: float):
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_proxy_main, args=(upstream_port, latency, child), daemon=True)
        self._proc.start()
        self.endpoint_url = f"http://127.0.0.1:{self._conn.recv()}"

    def stop(self):
        self._conn.send("stop")
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()


KEY_SPACE = 200_000


def commit_latency(sock, root, batches, changed, value_size, interval, prefill=True):
    """Per batch: open at the last state, put ``changed`` keys, commit; time the commit only.

    Batches start ``interval`` seconds apart, like micro-batches of a streaming query.
    """
    c = Client(sock)
    sid = StoreId(root, "bench", 0)
    ref = CheckpointRef(0, "")
    if prefill:
        # steady state: the store holds its whole key space before the clock starts, as a running
        # query's state does. (A store growing from empty passes through log2(n) resizes of its
        # hash map, each an O(n) copy inside one commit: a few ms at 100k keys, a handful of times
        # in the store's life.)
        for lo in range(0, KEY_SPACE, 50_000):
            h = c.open(sid, ref.version, ref.ckptid or None)
            h.put_many([(key(i), b"%032d" % i) for i in range(lo, min(KEY_SPACE, lo + 50_000))])
            ref = h.commit()
        assert c.await_durable(sid, ref, timeout=120)
        time.sleep(2.0)  # let the snapshot that follows finish
    before = c.stats()
    times, raw_changes = [], []
    cctx = zstandard.ZstdCompressor(level=3)
    next_start = time.monotonic()
    for b in range(batches):
        time.sleep(max(0.0, next_start - time.monotonic()))
        next_start += interval
        h = c.open(sid, ref.version, ref.ckptid or None)
        # values: half random hex, half a counter (compressible like real aggregates, not like a constant)
        items = [(key((b * 7919 + i * 13) % KEY_SPACE),
                  os.urandom(value_size // 4).hex().encode() + b"%0*d" % (value_size // 2, i))
                 for i in range(changed)]
        h.put_many(items)
        t = time.perf_counter()
        ref = h.commit()
        times.append(time.perf_counter() - t)
        raw_changes.append(len(cctx.compress(b"".join(k + v for k, v in dict(items).items()))))
    assert c.await_durable(sid, ref, timeout=120)
    time.sleep(1.0)  # the last batches' maintenance
    after = c.stats()
    c.close()
    return times, raw_changes, measured(before, after)


def requests_of(stats) -> dict:
    """Object-store requests by kind: the daemon's own and its snapshot worker's."""
    out = dict(next(iter(stats["object_stores"].values()), {}))
    for k, n in stats["maintenance"].get("worker_requests", {}).items():
        out[k] = out.get(k, 0) + n
    return out


def measured(before, after) -> dict:
    """What the measured batches did: counters after minus before the prefill."""
    def diff(a, b):
        return {k: v - b.get(k, 0) for k, v in a.items() if isinstance(v, (int, float))}
    return {"uploader": diff(after["uploader"], before["uploader"]),
            "requests": diff(requests_of(after), requests_of(before)),
            "maintenance": diff(after["maintenance"], before["maintenance"])}


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * p))]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", type=int, default=1_000_000)
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--changed", type=int, default=1000, help="keys changed per batch")
    ap.add_argument("--value-size", type=int, default=32)
    ap.add_argument("--interval", type=float, default=0.1, help="seconds between batch starts")
    ap.add_argument("--snapshot-interval", type=int, default=10, help="the daemon's snapshot_interval")
    ap.add_argument("--snapshot-builder", choices=("inline", "process"), default="inline",
                    help="the daemon's snapshot_builder")
    args = ap.parse_args()
    console = Console()
    tmp = tempfile.mkdtemp(prefix="ssa-bdur-", dir="/tmp")
    rows = []
    try:
        with SeaweedFS(nice=S3_NICE) as sw:
            env = dict(os.environ, AWS_ACCESS_KEY_ID=sw.access_key, AWS_SECRET_ACCESS_KEY=sw.secret_key,
                       AWS_DEFAULT_REGION="us-east-1")
            bucket = sw.create_bucket()
            for latency in (0.0, 0.05):
                # +0 ms goes straight to the server; +50 ms through a proxy in its own process
                proxy = ProxyProcess(sw.port, latency) if latency else None
                endpoint = proxy.endpoint_url if proxy else sw.endpoint_url
                sock = f"{tmp}/lat{int(latency * 1000)}.sock"
                d = start(sock, endpoint, env, snapshot_interval=args.snapshot_interval,
                          snapshot_builder=args.snapshot_builder)
                try:
                    root = f"s3://{bucket}/lat{int(latency * 1000)}"
                    times, comp, stats = commit_latency(sock, root, args.batches, args.changed, args.value_size,
                                                        args.interval)
                finally:
                    stop_daemon(d, timeout=60)
                    if proxy:
                        proxy.stop()
                up = stats["uploader"]
                counts = stats["requests"]
                n = args.batches
                rows.append((f"commit latency, S3 +{latency * 1000:.0f} ms (p50 / p99)",
                             f"{statistics.median(times) * 1e3:.2f} / {pct(times, 0.99) * 1e3:.2f} ms",
                             f"{n} batches × {args.changed} changed keys of a {KEY_SPACE:,}-key store, one every "
                             f"{args.interval * 1000:.0f} ms, snapshots {args.snapshot_builder}; target p99 ≤ 2 ms"))
                if latency == 0.0:
                    per_batch = up["bytes_uploaded"] / up["durable"]
                    rows.append(("bytes uploaded per batch vs changes compressed alone",
                                 f"{per_batch / statistics.mean(comp):.2f}×",
                                 f"{per_batch:,.0f} B per delta file, {statistics.mean(comp):,.0f} B compressed "
                                 "changes; target ≤ 1.2×"))
                    rows.append(("requests per batch (hot path)",
                                 " ".join(f"{k}={counts.get(k, 0) / n:.2f}" for k in ("PUT", "GET", "HEAD", "LIST")),
                                 f"maintenance included: {stats['maintenance'].get('snapshots', 0)} snapshots, "
                                 f"{stats['maintenance'].get('cleanups', 0)} cleanups in {n} batches"))
            # recovery of a large store: snapshot + 5 deltas, fresh daemon, no cache
            sock = f"{tmp}/big.sock"
            root = f"s3://{bucket}/big"
            sid = StoreId(root, "bench", 0)
            d = start(sock, sw.endpoint_url, env, snapshot_interval=10)
            try:
                c = Client(sock)
                ref = CheckpointRef(0, "")
                per = args.keys // 10
                val = b"v" * 16
                for b in range(15):
                    h = c.open(sid, ref.version, ref.ckptid or None)
                    lo = (b % 10) * per if b < 10 else (b - 10) * 1000
                    h.put_many([(key(i), val[:8] + b"%08d" % b) for i in range(lo, lo + (per if b < 10 else 1000))])
                    ref = h.commit()
                    assert c.await_durable(sid, ref, timeout=300)
                    if b == 9:
                        for _ in range(600):
                            if c.stats()["maintenance"].get("snapshots"):
                                break
                            time.sleep(0.1)
                c.close()
            finally:
                stop_daemon(d, timeout=60)
            sock2 = f"{tmp}/fresh.sock"
            d = start(sock2, sw.endpoint_url, env)
            try:
                c = Client(sock2)
                t = time.perf_counter()
                h = c.open(sid, ref.version, ref.ckptid)
                took = time.perf_counter() - t
                h.abort()
                s = c.stats()
                counts = next(iter(s["object_stores"].values()))
                c.close()
            finally:
                stop_daemon(d, timeout=60)
            raw = args.keys * (12 + 16)
            rows.append((f"recovery of {args.keys:,} keys from S3 (snapshot + 5 deltas)",
                         f"{took:.2f} s, {raw / took / 1e6:.0f} MB/s raw",
                         f"fresh daemon, no cache; {counts.get('GET', 0)} GETs, {counts.get('LIST', 0)} LISTs; target ≤ 2 s"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    t = Table(title="durability on S3 (SeaweedFS on loopback)")
    for col in ("figure", "measured", "detail"):
        t.add_column(col)
    for r in rows:
        t.add_row(*r)
    console.print(t)


if __name__ == "__main__":
    main()
