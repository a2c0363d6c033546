"""The daemon's latency and maintenance metrics agree with what it did (statestore_async/daemon/metrics.py).

* ``Buckets`` counts each observation in the first bucket whose bound is at or above it, cumulatively;
* after N commits the COMMIT latency histogram holds N observations, in STATS and on ``/metrics``; a
  commit that waits for upload-queue room is counted once answered, its wait included;
* the upload lag is the age of the oldest delta not yet durable: it grows while an upload is held
  and goes back to 0 once everything is durable; each durable delta adds one commit-to-durable
  observation, at least as long as it was held;
* snapshots and retention runs show up as counters (runs, bytes, files deleted, errors);
* docs/KUBERNETES.md's table lists every metric a daemon serves, and nothing else.

In-process daemons on real local object stores; the one held upload is a local store whose
writes wait for the test to open a gate. Every wait is for a condition, with a generous deadline.
"""
from __future__ import annotations

import asyncio
import re
import socket
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from statestore_async import errors
from statestore_async.client.clients import AsyncClient
from statestore_async.daemon.metrics import COMMIT_LATENCY_BOUNDS, DURABLE_LATENCY_BOUNDS, Buckets
from statestore_async.ids import StoreId
from statestore_async.objectstore import LocalObjectStore

DEADLINE = 60.0  # seconds any awaited condition may take on a busy 2-core machine


def key(i: int) -> bytes:
    return b"\x00\x07" + b"key-%06d" % i


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def wait_for(condition: Callable[[], Any], what: str) -> Any:
    deadline = time.monotonic() + DEADLINE
    while True:
        got = condition()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {DEADLINE:.0f} s waiting for {what}")
        await asyncio.sleep(0.01)


async def scrape(port: int) -> dict[str, float]:
    """Sample (name with its ``le`` label, if any) -> value of one scrape, parsed by prometheus_client."""
    def get() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as resp:
            assert resp.status == 200
            return resp.read().decode()

    text = await asyncio.to_thread(get)  # the in-process daemon serves it from its own thread
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name + (f"[{s.labels['le']}]" if "le" in s.labels else "")] = s.value
    return out


def histogram(samples: dict[str, float], name: str, bounds: tuple[float, ...]) -> tuple[list[float], float, float]:
    """The cumulative bucket counts (``+Inf`` last), count and sum of histogram ``name`` in a scrape."""
    buckets = [samples[f"{name}_bucket[{b!r}]"] for b in bounds] + [samples[f"{name}_bucket[+Inf]"]]
    return buckets, samples[f"{name}_count"], samples[f"{name}_sum"]


class GatedStore(LocalObjectStore):
    """The local object store, whose file creations wait while ``gate`` is closed."""

    gate: asyncio.Event

    def __init__(self, root: str) -> None:
        super().__init__(root, fsync=False)

    async def put_if_absent(self, key, data):
        await self.gate.wait()
        return await super().put_if_absent(key, data)


# --- Buckets ---------------------------------------------------------------------------------------

def test_buckets_count_each_observation_at_its_first_bound_cumulatively():
    b = Buckets((0.001, 0.01, 0.1))
    empty = b.stats()
    assert empty == {"count": 0, "sum": 0.0, "le": {"0.001": 0, "0.01": 0, "0.1": 0}}
    for v in (0.0005, 0.001, 0.002, 0.1, 0.5, 7.0):  # a bound itself is in its bucket (le: at or below)
        b.observe(v)
    got = b.stats()
    assert got["le"] == {"0.001": 2, "0.01": 3, "0.1": 4}
    assert got["count"] == 6 and got["sum"] == pytest.approx(7.6035)
    assert set(got) == set(empty) and set(got["le"]) == set(empty["le"])


@pytest.mark.parametrize("bounds", [(), (0.1, 0.01), (0.1, 0.1)])
def test_buckets_refuse_bounds_that_are_not_increasing(bounds):
    with pytest.raises(errors.InterfaceError, match="increasing and distinct"):
        Buckets(bounds)


# --- commit latency and upload lag on a daemon -----------------------------------------------------

async def test_commit_latency_counts_every_commit_and_lag_returns_to_zero(daemon_factory, tmp_path):
    port = free_port()
    d = await daemon_factory(metrics_port=port)
    n = 7
    async with AsyncClient(d.config.socket) as c:
        refs = []
        for version in range(n):
            sid = StoreId(f"file://{tmp_path}/root", "latency", version % 2)
            h = await c.open(sid, version // 2)
            await h.put_many([(key(i), b"v%d" % version) for i in range(50)])
            refs.append((sid, await h.commit()))
        for sid, ref in refs:
            assert await c.await_durable(sid, ref, DEADLINE)
        stats = await c.stats()
    latency = stats["daemon"]["commit_latency"]
    assert latency["count"] == n and latency["sum"] > 0
    assert list(latency["le"]) == [repr(b) for b in COMMIT_LATENCY_BOUNDS]
    counts = list(latency["le"].values())
    assert counts == sorted(counts) and counts[-1] <= n

    # durable once await_durable said so; the lag goes back to 0 once nothing is queued
    await wait_for(lambda: d.uploader.stats()["lag_seconds"] == 0, "the upload lag to go back to 0")
    up = d.uploader.stats()
    assert up["durable_latency"]["count"] == up["durable"] == n and up["durable_latency"]["sum"] > 0

    samples = await scrape(port)
    buckets, count, total = histogram(samples, "statestore_commit_latency_seconds", COMMIT_LATENCY_BOUNDS)
    assert count == n and buckets[-1] == n and buckets == sorted(buckets) and total > 0
    buckets, count, total = histogram(samples, "statestore_upload_durable_seconds", DURABLE_LATENCY_BOUNDS)
    assert count == n and buckets[-1] == n and buckets == sorted(buckets) and total > 0
    assert samples["statestore_upload_lag_seconds"] == 0


async def test_upload_lag_grows_while_an_upload_is_held(daemon_factory, tmp_path):
    GatedStore.gate = gate = asyncio.Event()
    d = await daemon_factory(open_objstore=lambda uri: GatedStore(uri.removeprefix("file://")))
    sid = StoreId(f"file://{tmp_path}/root", "lag", 0)
    try:
        async with AsyncClient(d.config.socket) as c:
            h = await c.open(sid, 0)
            await h.put_many([(key(1), b"v")])
            ref = await h.commit()
            held_since = time.monotonic()
            # the lag is the held delta's age: it keeps growing while nothing becomes durable
            first = await wait_for(lambda: d.uploader.stats()["lag_seconds"], "a lag above 0")
            await wait_for(lambda: d.uploader.stats()["lag_seconds"] > first, "the lag to grow")
            assert d.uploader.stats()["durable_latency"]["count"] == 0
            gate.set()
            held = time.monotonic() - held_since
            assert await c.await_durable(sid, ref, DEADLINE)
    finally:
        gate.set()
    await wait_for(lambda: d.uploader.stats()["lag_seconds"] == 0, "the upload lag to go back to 0")
    durable = d.uploader.stats()["durable_latency"]
    assert durable["count"] == 1 and durable["sum"] >= held


async def test_a_commit_waiting_for_queue_room_is_counted_once_answered(daemon_factory, tmp_path):
    GatedStore.gate = gate = asyncio.Event()
    # a queue of one byte: the first delta fills it, the second commit waits for the first upload
    d = await daemon_factory(open_objstore=lambda uri: GatedStore(uri.removeprefix("file://")),
                             upload_queue_bytes=1)
    try:
        async with AsyncClient(d.config.socket) as c:
            h0 = await c.open(StoreId(f"file://{tmp_path}/root", "wait", 0), 0)
            await h0.put_many([(key(1), b"v")])
            await h0.commit()
            assert d.commit_latency.stats()["count"] == 1
            h1 = await c.open(StoreId(f"file://{tmp_path}/root", "wait", 1), 0)
            await h1.put_many([(key(2), b"v")])
            second = asyncio.ensure_future(h1.commit())
            await wait_for(lambda: d.counters["commits_waited"] == 1, "the second commit to wait for queue room")
            waiting_since = time.monotonic()
            assert not second.done() and d.commit_latency.stats()["count"] == 1  # not answered: not counted
            gate.set()
            held = time.monotonic() - waiting_since
            await asyncio.wait_for(second, DEADLINE)
    finally:
        gate.set()
    latency = d.commit_latency.stats()
    assert latency["count"] == 2 and latency["sum"] >= held


# --- snapshots and retention -----------------------------------------------------------------------

async def test_snapshot_and_cleanup_counters(daemon_factory, tmp_path):
    port = free_port()
    d = await daemon_factory(metrics_port=port, snapshot_interval=2, retention_versions=2)
    sid = StoreId(f"file://{tmp_path}/root", "maintenance", 0)
    async with AsyncClient(d.config.socket) as c:
        ref = None
        for version in range(12):
            h = await c.open(sid, version, ref.ckptid if ref else None)
            await h.put_many([(key(i), b"v%d" % version) for i in range(200)])
            ref = await h.commit()
            assert await c.await_durable(sid, ref, DEADLINE)

    def done() -> bool:
        m = d.maintenance.stats()
        return m["snapshots"] >= 2 and m["cleanups"] >= 1 and not m["in_progress"] and not m["cleanups_in_progress"]

    await wait_for(done, "two snapshots and a cleanup")
    m = d.maintenance.stats()
    samples = await scrape(port)
    assert samples["statestore_snapshots_total"] == m["snapshots"]
    assert samples["statestore_snapshot_bytes_total"] == m["snapshot_bytes"] > 0
    assert samples["statestore_cleanups_total"] == m["cleanups"]
    assert samples["statestore_cleanup_deleted_files_total"] == m["files_deleted"] > 0
    assert samples["statestore_snapshot_errors_total"] == samples["statestore_cleanup_errors_total"] == 0
    assert samples["statestore_snapshots_in_progress"] == samples["statestore_cleanups_in_progress"] == 0


# --- the documented list ---------------------------------------------------------------------------

async def test_the_kubernetes_guide_lists_every_metric_a_daemon_serves(daemon_factory):
    port = free_port()
    await daemon_factory(metrics_port=port)
    served = {name.split("[")[0] for name in await scrape(port) if name.startswith("statestore_")}
    guide = (Path(__file__).resolve().parents[1] / "docs" / "KUBERNETES.md").read_text()
    rows = re.findall(r"^\| `(statestore_[a-z_]+)` \| (gauge|counter|histogram) \|", guide, re.MULTILINE)
    documented = set()
    for name, kind in rows:
        documented |= {f"{name}_{s}" for s in ("bucket", "sum", "count")} if kind == "histogram" else {name}
    assert documented == served, (sorted(served - documented), sorted(documented - served))
