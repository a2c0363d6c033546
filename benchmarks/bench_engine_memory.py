"""Memory of state held by the daemon, as a ratio to the raw bytes of its keys and values.

A daemon (local-folder root, default settings) gets N records of 12-byte keys (2-byte key group +
10 bytes) and 16-byte values in one store, in commits of 1% of N each (``--per-commit``; a steady
stream: the engine's short history of recent commits, 4 by default, then holds a small part of the
state). After
the last commit is durable and the daemon is idle, its resident memory minus its resident memory
once it had served one small store (first-request code paths and threads loaded) is the
state's cost; the ratio to N × 28 bytes is printed.

    .venv/bin/python benchmarks/bench_engine_memory.py                 # 1M and 10M records
    .venv/bin/python benchmarks/bench_engine_memory.py --records 1000000
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import charts

from statestore_async.client.clients import Client
from statestore_async.ids import StoreId
from statestore_async.testing.daemon import start_daemon as start_daemon_process

KEY_BYTES, VALUE_BYTES = 12, 16
EXTRA: list[str] = os.environ.get("BENCH_DAEMON_ARGS", "").split()


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def settled_rss(pid: int, client: Client) -> int:
    """The daemon's RSS once no snapshot is being written and two readings a moment apart agree
    within 1 MiB (its uploads and frees done)."""
    deadline = time.monotonic() + 600
    while client.stats()["maintenance"]["in_progress"] and time.monotonic() < deadline:
        time.sleep(0.2)
    last = rss_bytes(pid)
    for _ in range(50):
        client.stats()
        time.sleep(0.2)
        now = rss_bytes(pid)
        if abs(now - last) < (1 << 20):
            return now
        last = now
    return last


def measure(records: int, per_commit: int) -> dict:
    folder = tempfile.mkdtemp(prefix="ssmem-", dir="/tmp")
    sock = f"{folder}/d.sock"
    proc = start_daemon_process(sock, "--log-level", "warning", "--max-batch", "100000",
                                "--memory-budget", "64GiB", *EXTRA, log_path=f"{folder}/daemon.log")
    try:
        client = Client(sock)
        # the baseline is a daemon that has served a store once (a commit made durable): the code
        # paths of a first request, upload and snapshot are loaded, their threads started
        warm = StoreId(f"file://{folder}/root", "warm-up", 0)
        h = client.open(warm, 0)
        h.put_many([(b"\x00\x00warm", b"up")])
        if not client.await_durable(warm, h.commit(), timeout=60):
            raise RuntimeError("the warm-up commit did not become durable")
        empty = settled_rss(proc.pid, client)
        sid = StoreId(f"file://{folder}/root", "mem", 0)
        version = 0
        t0 = time.perf_counter()
        for start in range(0, records, per_commit):
            h = client.open(sid, version)
            stop = min(records, start + per_commit)
            for b in range(start, stop, 50_000):
                e = min(stop, b + 50_000)
                # key group from the record number, then 10 bytes: spread over all key groups
                h.put_many([((i % 65536).to_bytes(2, "big") + i.to_bytes(10, "big"), i.to_bytes(16, "little"))
                            for i in range(b, e)])
            ref = h.commit()
            version = ref.version
        if not client.await_durable(sid, ref, timeout=600):
            raise RuntimeError("the last commit did not become durable")
        load_s = time.perf_counter() - t0
        full = settled_rss(proc.pid, client)
        stats = client.stats()
        engine = stats.get("registry", {}).get("memory_bytes", 0)
        client.close()
    finally:
        proc.terminate()
        proc.wait(60)
        shutil.rmtree(folder, ignore_errors=True)
    raw = records * (KEY_BYTES + VALUE_BYTES)
    return {"records": records, "raw": raw, "empty": empty, "full": full, "engine": engine, "seconds": load_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", default="1000000,10000000", help="comma-separated record counts")
    ap.add_argument("--per-commit", type=int, default=0, help="records per commit (default: 1%% of the records)")
    charts.add_chart_args(ap, "bench_engine_memory")
    args = ap.parse_args()
    print("| records | raw MiB | daemon RSS − empty, MiB | ratio to raw | engine's own count, MiB | load s |")
    print("|---:|---:|---:|---:|---:|---:|")
    measured = []
    for n in (int(x) for x in args.records.split(",")):
        r = measure(n, args.per_commit or max(1, n // 100))
        held = r["full"] - r["empty"]
        measured.append((n, r, held))
        print(f"| {n:,} | {r['raw'] / 2**20:.1f} | {held / 2**20:.1f} | {held / r['raw']:.2f}× "
              f"| {r['engine'] / 2**20:.1f} | {r['seconds']:.1f} |", flush=True)
    if charts.chart_path(args):
        labels = [f"{n:,} records" for n, _, _ in measured]
        charts.bar_charts(charts.chart_path(args), "The daemon's memory for N records of 12+16 bytes", [
            charts.Panel("MiB held", labels, {
                "raw keys + values": [r["raw"] / 2**20 for _, r, _ in measured],
                "daemon RSS − empty daemon": [held / 2**20 for _, _, held in measured],
                "the engine's own count": [r["engine"] / 2**20 for _, r, _ in measured]}, "MiB",
                fmt=lambda v: f"{v:,.1f}"),
            charts.Panel("RSS − empty over raw", labels, {
                "daemon RSS − empty daemon": [held / r["raw"] for _, r, held in measured]}, "× raw",
                fmt=lambda v: f"{v:.2f}×")],
            charts.measured_caption("RSS once durable, minus the RSS of a daemon that has served one small store"))


if __name__ == "__main__":
    main()
