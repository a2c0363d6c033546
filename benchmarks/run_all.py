"""Run every benchmark in turn (``make bench``); each prints its own table of ratios.

    .venv/bin/python benchmarks/run_all.py            # the full set (tens of minutes)
    .venv/bin/python benchmarks/run_all.py --quick    # smaller sizes, a few minutes

The machine is shared and noisy: every benchmark measures its peers in the same run and prints
ratios; compare those, not absolute figures across runs.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

FULL = [
    ["bench_foundation.py"],
    ["bench_layouts.py"],
    ["bench_encode.py"],
    ["bench_engine_memory.py"],
    ["bench_daemon.py"],
    ["bench_durability.py"],
    ["bench_spark.py"],
    ["bench_materialize.py"],
    ["bench_sessions.py"],
    ["bench_timers.py"],
    ["bench_rescale.py"],
    ["bench_export.py"],
    ["bench_memory_soak.py", "--seconds", "600"],
]
# quick runs draw no charts: docs/img holds the charts of full runs (and of recorded figures)
QUICK = [
    ["bench_foundation.py", "--keys", "200000", "--codec-rows", "50000"],
    ["bench_layouts.py", "--quick", "--no-chart"],
    ["bench_encode.py", "--records", "100000"],
    ["bench_engine_memory.py", "--records", "1000000", "--no-chart"],
    ["bench_daemon.py", "--seconds", "0.5", "--batches", "1,128,1024,10000", "--no-chart"],
    ["bench_durability.py", "--batches", "50", "--keys", "200000"],
    ["bench_spark.py", "--quick", "--no-chart"],
    ["bench_materialize.py", "--keys", "200000", "--rows", "200000", "--repeat", "2"],
    ["bench_sessions.py", "--quick", "--no-chart"],
    ["bench_timers.py", "--quick"],
    ["bench_rescale.py", "--keys", "200000", "--no-chart"],
    ["bench_export.py", "--records", "100000", "--repeat", "1"],
    ["bench_memory_soak.py", "--seconds", "60", "--no-chart"],
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller sizes")
    args = ap.parse_args()
    # the peers' servers, set up once before anything is measured (bench_daemon's column (c) and
    # bench_spark's P4 start their own redis-server through redis_peer; on a fresh machine the
    # first of them would otherwise install it in the middle of the run)
    sys.path.insert(0, HERE)
    from redis_peer import RedisUnavailable, ensure_redis_server

    try:
        print(f"redis-server: {ensure_redis_server()}", flush=True)
    except RedisUnavailable as exc:
        print(f"{exc}: the Redis columns are skipped", file=sys.stderr, flush=True)
    failed = []
    for cmd in QUICK if args.quick else FULL:
        print(f"\n=== {' '.join(cmd)}", flush=True)
        code = subprocess.call([sys.executable, os.path.join(HERE, cmd[0]), *cmd[1:]])
        if code:
            failed.append((cmd[0], code))
    for name, code in failed:
        print(f"{name} exited with {code}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
