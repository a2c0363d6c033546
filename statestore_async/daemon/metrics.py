"""The daemon's Prometheus metrics, read from its STATS at scrape time (nothing on the hot path).

Every metric is exposed on every scrape, zeros included; the table below is the list of them
(the Helm chart's dashboard and ``tests/test_guarantees_daemon.py`` read the same names).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

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
)
_COUNTERS = (
    ("statestore_requests", "requests served", "daemon", "requests"),
    ("statestore_request_errors", "requests answered with an error", "daemon", "errors"),
    ("statestore_open_versions_expired", "open versions aborted after open_version_idle_timeout without a request",
     "daemon", "versions_expired"),
    ("statestore_loads", "stores loaded from the object store", "registry", "loads"),
    ("statestore_load_errors", "loads that failed", "registry", "load_errors"),
    ("statestore_evictions", "stores evicted", "registry", "evictions"),
    ("statestore_rescales", "rescaled partitions' first states assembled from the old partitions' files",
     "registry", "rescales"),
    ("statestore_rescale_read_bytes", "bytes read from the object store to assemble rescaled partitions",
     "registry", "rescale_bytes_read"),
    ("statestore_spills", "stores spilled onto their head's snapshot file on local disk", "registry", "spills"),
    ("statestore_uploads_durable", "deltas made durable", "uploader", "durable"),
    ("statestore_uploads_failed", "deltas that failed for good", "uploader", "failed"),
)


def start_metrics(stats: Callable[[], dict[str, Any]], host: str, port: int) -> WSGIServer:
    """Serve Prometheus metrics read from ``stats()`` (the daemon's STATS) at every scrape."""
    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

    class _Collector:
        def collect(self) -> Iterator[Metric]:
            s = stats()
            for family, metrics in ((GaugeMetricFamily, _GAUGES), (CounterMetricFamily, _COUNTERS)):
                for name, doc, section, key in metrics:
                    # every key is in STATS, zeros included, once the daemon started
                    yield family(name, doc, value=float(s.get(section, {}).get(key, 0)))

    registry = CollectorRegistry()
    registry.register(_Collector())
    server, _thread = start_http_server(port, addr=host, registry=registry)
    log.info("metrics on http://%s:%d/metrics", host, port)
    return server
