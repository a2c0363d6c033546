"""The daemon's Prometheus metrics, read from its STATS at scrape time (nothing on the hot path).

Every metric is exposed on every scrape, zeros included; the tables below are the list of them
(the Helm chart's dashboard and ``tests/test_guarantees_daemon.py`` read the same names).
Latencies are kept where they happen as ``Buckets`` (plain counters: a bisect and two
additions per observation) and exported here as Prometheus histograms.
"""
from __future__ import annotations

import logging
from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from statestore_async.errors import InterfaceError

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

log = logging.getLogger("statestore_async.daemon")

# (metric name, help, STATS section, key): every metric is exposed on every scrape, zeros included
_GAUGES = (
    ("statestore_connections", "open client connections", "daemon", "open_connections"),
    ("statestore_open_versions", "versions open for update (holding their store's writer slot)", "daemon",
     "open_versions"),
    ("statestore_stores", "stores in memory", "registry", "stores"),
    ("statestore_memory_bytes", "bytes of state in memory", "registry", "memory_bytes"),
    ("statestore_memory_budget_bytes", "memory budget (idle stores above it spill to disk or are evicted)",
     "registry", "memory_budget"),
    ("statestore_stores_spilled", "stores in memory whose committed map is mostly on local disk (cold level)",
     "registry", "spilled"),
    ("statestore_block_cache_bytes", "bytes of cold-level blocks cached in memory (in memory_bytes)", "registry",
     "block_cache_bytes"),
    ("statestore_upload_queue_bytes", "bytes waiting for upload", "uploader", "queued_bytes"),
    ("statestore_degraded_roots", "object-store roots refusing uploads in a way retrying does not heal "
     "(credentials, permissions, bucket, full disk): the daemon is degraded", "uploader", "degraded_roots"),
    ("statestore_upload_lag_seconds", "age of the oldest committed delta not yet durable (0 when none is waiting)",
     "uploader", "lag_seconds"),
    ("statestore_snapshots_in_progress", "snapshots being written", "maintenance", "in_progress"),
    ("statestore_cleanups_in_progress", "retention runs deleting old versions' files", "maintenance",
     "cleanups_in_progress"),
)
_COUNTERS = (
    ("statestore_requests", "requests served", "daemon", "requests"),
    ("statestore_request_errors", "requests answered with an error", "daemon", "errors"),
    ("statestore_open_versions_expired", "open versions aborted after open_version_idle_timeout without a request",
     "daemon", "versions_expired"),
    ("statestore_loads", "stores loaded from the object store", "registry", "loads"),
    ("statestore_load_errors", "loads that failed", "registry", "load_errors"),
    ("statestore_evictions", "stores evicted", "registry", "evictions"),
    ("statestore_broken_stores_dropped", "stores dropped from memory after a change failed part-way in their map "
     "(StoreBrokenError; reloaded from their files on their next open)", "registry", "broken_dropped"),
    ("statestore_rescales", "rescaled partitions' first states assembled from the old partitions' files",
     "registry", "rescales"),
    ("statestore_rescale_read_bytes", "bytes read from the object store to assemble rescaled partitions",
     "registry", "rescale_bytes_read"),
    ("statestore_load_snapshots", "snapshots written by loads that replayed more deltas than snapshot_interval "
     "(the maintenance's snapshots had fallen behind)", "registry", "load_snapshots"),
    ("statestore_spills", "stores spilled onto their head's snapshot file on local disk", "registry", "spills"),
    ("statestore_uploads_durable", "deltas made durable", "uploader", "durable"),
    ("statestore_uploads_failed", "deltas that failed for good", "uploader", "failed"),
    ("statestore_snapshots", "snapshots written to the object store", "maintenance", "snapshots"),
    ("statestore_snapshot_bytes", "bytes of snapshots written to the object store", "maintenance", "snapshot_bytes"),
    ("statestore_snapshot_errors", "snapshots that failed (retried at the store's next durable delta)",
     "maintenance", "snapshot_errors"),
    ("statestore_cleanups", "retention runs done (deleting the files no state of the last retention_versions "
     "versions needs)", "maintenance", "cleanups"),
    ("statestore_cleanup_deleted_files", "files deleted by retention", "maintenance", "files_deleted"),
    ("statestore_cleanup_errors", "retention runs that failed (retried after the store's next snapshot)",
     "maintenance", "cleanup_errors"),
)
# (metric name, help, STATS section, key of a ``Buckets.stats()`` dict), exported as histograms in seconds
_HISTOGRAMS = (
    ("statestore_commit_latency_seconds", "time from handling a COMMIT to writing its answer (waits for upload "
     "queue room included)", "daemon", "commit_latency"),
    ("statestore_upload_durable_seconds", "time from a delta's commit to its file being durable in the object "
     "store", "uploader", "durable_latency"),
)
#: upper bounds (seconds) of the COMMIT latency buckets: 0.5 ms to 1 s
COMMIT_LATENCY_BOUNDS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
#: upper bounds (seconds) of the commit-to-durable buckets: 10 ms to 2 min
DURABLE_LATENCY_BOUNDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Buckets:
    """A histogram kept as plain counters: how many observations fell at or below each fixed upper
    bound, their count and their sum. ``observe`` costs a bisect and two additions; ``stats``
    (read at scrape time, possibly from another thread) is O(bounds)."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: Sequence[float]) -> None:
        if not bounds or list(bounds) != sorted(set(bounds)):
            raise InterfaceError(f"histogram bounds must be increasing and distinct, got {list(bounds)}")
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one: above every bound (+Inf)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def stats(self) -> dict[str, Any]:
        """``{"count": n, "sum": seconds, "le": {"<bound>": cumulative count, ...}}`` (the count is
        that of ``+Inf``); the same keys whatever was observed."""
        counts = list(self.counts)  # one copy: the cumulative counts and the count agree
        cumulative, le = 0, {}
        for bound, n in zip(self.bounds, counts, strict=False):
            cumulative += n
            le[repr(bound)] = cumulative
        return {"count": cumulative + counts[-1], "sum": self.total, "le": le}


def start_metrics(stats: Callable[[], dict[str, Any]], host: str, port: int) -> WSGIServer:
    """Serve Prometheus metrics read from ``stats()`` (the daemon's STATS) at every scrape."""
    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

    class _Collector:
        def collect(self) -> Iterator[Metric]:
            s = stats()
            for family, metrics in ((GaugeMetricFamily, _GAUGES), (CounterMetricFamily, _COUNTERS)):
                for name, doc, section, key in metrics:
                    # every key is in STATS, zeros included, once the daemon started
                    yield family(name, doc, value=float(s.get(section, {}).get(key, 0)))
            for name, doc, section, key in _HISTOGRAMS:
                h = s.get(section, {}).get(key) or {"count": 0, "sum": 0.0, "le": {}}
                buckets = [(le, float(n)) for le, n in h["le"].items()] + [("+Inf", float(h["count"]))]
                yield HistogramMetricFamily(name, doc, buckets=buckets, sum_value=float(h["sum"]))

    registry = CollectorRegistry()
    registry.register(_Collector())
    server, _thread = start_http_server(port, addr=host, registry=registry)
    log.info("metrics on http://%s:%d/metrics", host, port)
    return server
