"""What the daemon guarantees over a long life (issue 18, "Trust"), each shown on real daemons.

* the memory budget bounds what the daemon keeps: an evicted store is collectable, whatever the
  connections that used it still hold (finished handles hold no store), and the cyclic collector
  is never left off across the snapshot builder's pauses; a short soak keeps RSS under the budget;
* STATS and the metrics endpoint carry every key and metric, an empty daemon's too;
* an open version left without a request for ``open_version_idle_timeout`` is aborted (its
  writer slot freed) and its client told why on its next request, a connection stalled mid-frame
  included;
* a load whose snapshot is damaged falls back to an older state and its deltas; damaged files and
  failed loads are named in the daemon's log.

Every wait is for a condition, with a generous deadline; every process started is stopped.
"""
from __future__ import annotations

import asyncio
import socket
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest

from statestore_async.ids import StoreId

DEADLINE = 60.0  # seconds any awaited condition may take on a busy 2-core machine


def key(i: int) -> bytes:
    return b"\x00\x07" + b"key-%06d" % i


def wait_for(condition: Callable[[], Any], what: str, timeout: float = DEADLINE, every: float = 0.05) -> Any:
    """Poll ``condition`` until it returns something true; fail naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        got = condition()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


async def async_wait_for(condition: Callable[[], Any], what: str, timeout: float = DEADLINE) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = condition()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        await asyncio.sleep(0.01)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def nested_keys(d: dict, skip: frozenset[str] = frozenset()) -> set[str]:
    """Every key path of a nested dict (``a.b.c``), not descending into ``skip``."""
    out = set()
    for k, v in d.items():
        out.add(k)
        if isinstance(v, dict) and k not in skip:
            out |= {f"{k}.{sub}" for sub in nested_keys(v, skip)}
    return out


# --- STATS and metrics carry every key, also with no store -------------------------------------------
# the sections whose keys depend on what was served (requests by opcode, per object-store root)
DYNAMIC = frozenset({"requests_by_op", "object_stores"})
METRICS = ("statestore_connections", "statestore_requests_total", "statestore_request_errors_total",
           "statestore_stores", "statestore_memory_bytes", "statestore_memory_budget_bytes",
           "statestore_loads_total", "statestore_load_errors_total", "statestore_evictions_total",
           "statestore_open_versions",
           "statestore_upload_queue_bytes", "statestore_uploads_durable_total", "statestore_uploads_failed_total")


def scrape(port: int) -> tuple[int, dict[str, float]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as resp:
        body = resp.read().decode()
        status = resp.status
    samples = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return status, samples


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_stats_and_metrics_carry_every_key_on_an_empty_daemon(daemon_process, tmp_path, loop):
    port = free_port()
    d = daemon_process("--loop", loop, "--metrics-port", str(port))
    with d.client() as c:
        empty = c.stats()
        status, samples = scrape(port)  # raised HTTP 500 (KeyError: 'stores') with no store held
        assert status == 200
        assert set(METRICS) <= set(samples), sorted(set(METRICS) - set(samples))
        assert samples["statestore_stores"] == 0 and samples["statestore_memory_bytes"] == 0
        for section in ("registry", "uploader", "maintenance"):
            assert empty[section], f"STATS section {section} is empty on an empty daemon"
        assert empty["registry"]["stores"] == 0 and empty["registry"]["memory_bytes"] == 0
        # the same keys once the daemon holds a store and has uploaded something
        sid = StoreId(f"file://{tmp_path}/root", "stats", 0)
        with c.open(sid, 0) as h:
            h.put_many([(key(1), b"v")])
            ref = h.commit()
        assert c.await_durable(sid, ref, DEADLINE)
        busy = c.stats()
        assert nested_keys(empty, DYNAMIC) == nested_keys(busy, DYNAMIC)
        status, busy_samples = scrape(port)
        assert status == 200 and set(busy_samples) == set(samples)
        assert busy_samples["statestore_stores"] == 1
