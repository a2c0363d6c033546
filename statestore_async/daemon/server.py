"""The daemon: serves the stores of one node to its Python workers over a Unix socket
(docs/ARCHITECTURE.md, "The daemon" and "The wire protocol").

``Daemon`` owns the ``StoreRegistry``, the ``Uploader``, ``Maintenance`` and the owner of every
COMMIT's order (``daemon.commits``), and listens on ``config.socket`` (no TCP); each client
connection is a ``daemon.connection.Connection``. ``run`` sets the process up (``daemon.process``:
logs, malloc, open files) and serves until a signal.

``stop()`` (SIGTERM/SIGINT under ``run``): stop listening, let the connections finish what they have
open or in flight (OPEN refused) while the uploader drains, then close them, all within
``drain_timeout``. ``serve`` exits 0 only when every
acknowledged commit is durable; otherwise it logs the versions that are not and exits
``EXIT_NOT_DURABLE``.

``health()`` (in STATS, read by ``statestore-async health``): ``ok``, ``stopping``, or ``degraded``
with the reasons — an object-store root that refuses uploads in a way retrying does not heal.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import stat
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Self

from statestore_async import __version__
from statestore_async.config import DaemonConfig
from statestore_async.daemon.commits import Commits
from statestore_async.daemon.connection import Connection, FramePool
from statestore_async.daemon.maintenance import Maintenance
from statestore_async.daemon.metrics import COMMIT_LATENCY_BOUNDS, Buckets, start_metrics
from statestore_async.daemon.objectstores import ObjectStores, open_root
from statestore_async.daemon.process import (
    configure_logging,
    give_back_free_pages,
    raise_open_files_limit,
    return_freed_memory,
)
from statestore_async.daemon.registry import StoreRegistry
from statestore_async.daemon.snapshotter import SnapshotWorker
from statestore_async.daemon.unixsocket import prepare_socket_path
from statestore_async.daemon.uploader import Uploader
from statestore_async.engine.store import StoreVersion
from statestore_async.errors import ObjectStoreError
from statestore_async.files.names import DELTA, SNAPSHOT, file_key
from statestore_async.ids import CheckpointRef, StoreId
from statestore_async.objectstore.base import ObjectStore
from statestore_async.objectstore.s3 import warm_up as s3_warm_up

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

GIL_SWITCH_INTERVAL = 0.0005
# The memory budget is checked this long after a commit, off the request's path: summing every
# store's memory costs O(stores), and a burst of commits needs one check, not one each.
BUDGET_CHECK_DELAY = 0.05
# at most one malloc_trim (give_back_free_pages) per this many seconds, after evictions
TRIM_INTERVAL = 1.0
# With exit_when_idle, a daemon idle that long but with an upload still running looks again this often.
IDLE_RECHECK = 1.0
# Open versions are checked against open_version_idle_timeout every quarter of it, and at least
# every IDLE_SWEEP_MAX seconds: one is aborted at most that much later than the limit.
IDLE_SWEEP_MAX = 5.0
# serve's exit code when it stopped with acknowledged commits not durable (drain timed out, uploads
# failed): they are lost unless the client side replays them (docs/GUARANTEES.md)
EXIT_NOT_DURABLE = 3
# versions listed per store in the log line of a stop that left commits not durable
LIST_NOT_DURABLE = 200
# while stopping, how often the drain looks whether the connections and uploads are done
DRAIN_POLL = 0.02

log = logging.getLogger("statestore_async.daemon")

# --- the daemon -----------------------------------------------------------------------------------
class Daemon:
    """One node's daemon: ``await start()``, serve, ``await stop()``."""

    def __init__(self, config: DaemonConfig, *, open_objstore: Callable[[str], ObjectStore] | None = None) -> None:
        self.config = config
        self.allowed_uids = tuple(config.effective_allowed_uids)
        self._default_objstores = open_objstore is None
        if open_objstore is None:
            s3 = config.s3_options()

            def open_objstore(uri: str) -> ObjectStore:
                return open_root(uri, s3_options=s3, cache_dir=config.cache_dir, cache_bytes=config.cache_bytes)

        self.objstores = ObjectStores(open_objstore, allowed=config.allowed_root_parts)
        #: the room that frames still arriving share across connections (``partial_frames_bytes``)
        self.frame_pool = FramePool(config.partial_frames_bytes)
        self.uploader: Uploader | None = None
        self.registry: StoreRegistry | None = None
        self.maintenance: Maintenance | None = None
        self.commits: Commits | None = None
        self.connections: set[Connection] = set()
        self.stopping = False
        self._server: asyncio.AbstractServer | None = None
        self._metrics_server: WSGIServer | None = None
        self._budget_check: asyncio.TimerHandle | None = None
        self._last_trim = 0.0
        self._trimmed_at = 0  # the registry's ``releases`` at the last malloc_trim
        self._idle_sweep: asyncio.TimerHandle | None = None
        self._idle_timer: asyncio.TimerHandle | None = None
        #: set when ``exit_when_idle`` seconds passed with no client and no upload: ``serve`` then stops
        self.idle_exit = asyncio.Event()
        self._socket_inode: tuple[int, int] | None = None
        self._started = time.monotonic()
        self.counters = {"connections": 0, "refused": 0, "requests": 0, "errors": 0, "aborted_on_disconnect": 0,
                         "commits_waited": 0, "max_inflight_seen": 0,
                         "versions_expired": 0}
        #: seconds from handling each COMMIT to writing its answer (waits for upload-queue room included)
        self.commit_latency = Buckets(COMMIT_LATENCY_BOUNDS)
        #: after ``stop``: True when every acknowledged commit was durable
        self.clean_stop: bool | None = None
        self.requests_by_op: dict[str, int] = {}

    def limits(self) -> dict[str, Any]:
        c = self.config
        return {"max_frame_bytes": c.max_frame_bytes, "max_batch": c.max_batch, "max_inflight": c.max_inflight,
                "daemon": f"statestore_async {__version__}"}

    def count_request(self, cls: type) -> None:
        self.counters["requests"] += 1
        name = cls.__name__
        self.requests_by_op[name] = self.requests_by_op.get(name, 0) + 1

    def note_inflight(self, n: int) -> None:
        if n > self.counters["max_inflight_seen"]:
            self.counters["max_inflight_seen"] = n

    async def start(self) -> None:
        cfg = self.config
        # Deltas and snapshots are encoded in worker threads. A request arriving while such a thread
        # holds the GIL waits for the next switch: Python's default of 5 ms would be the latency
        # tail of COMMIT; 0.5 ms keeps it small at a negligible cost to the encoding threads.
        sys.setswitchinterval(GIL_SWITCH_INTERVAL)
        # deltas waiting for upload count against the memory budget too: the queue never holds
        # more than the budget (commits wait for room, as they do for upload_queue_bytes)
        self.uploader = Uploader(self.objstores, concurrency=cfg.upload_concurrency,
                                 queue_bytes=min(cfg.upload_queue_bytes, cfg.memory_budget),
                                 queue_count=cfg.upload_queue_count)
        self.registry = StoreRegistry(self.objstores, self.uploader, memory_budget=cfg.memory_budget,
                                      block_cache_bytes=cfg.block_cache_bytes or None,
                                      spill_min_bytes=cfg.spill_min_bytes,
                                      scratch_dir=os.path.join(cfg.cache_dir, "flushed") if cfg.cache_dir else None,
                                      flush_min_bytes=cfg.flush_min_bytes, open_wait_timeout=cfg.open_wait_timeout,
                                      max_open_runs=cfg.max_open_runs, snapshot_after=cfg.snapshot_interval)
        worker = None
        if cfg.snapshot_builder == "process" and self._default_objstores:
            # the worker opens the same object stores from the same settings (a custom factory,
            # as tests use, cannot be handed to another process: those snapshot inline)
            worker = SnapshotWorker({"s3": cfg.s3_options(), "cache_dir": cfg.cache_dir, "cache_bytes": cfg.cache_bytes})
        self.maintenance = Maintenance(self.registry, self.objstores, snapshot_interval=cfg.snapshot_interval,
                                       snapshot_delta_bytes=cfg.snapshot_delta_bytes,
                                       retention_versions=cfg.retention_versions, worker=worker,
                                       served=lambda: self.counters["requests"])
        self.commits = Commits(self.uploader, self.registry, latency=self.commit_latency, counters=self.counters,
                               after_commit=self.check_budget_soon)
        self.uploader.on_durable = self._on_durable
        await s3_warm_up()
        prepare_socket_path(cfg.socket, cfg.socket_mode)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(lambda: Connection(self), path=cfg.socket, backlog=1024)
        os.chmod(cfg.socket, cfg.socket_mode)
        st = os.lstat(cfg.socket)
        self._socket_inode = (st.st_dev, st.st_ino)
        self.watch_idle()
        self._sweep_idle_versions()
        if cfg.metrics_port:
            self._metrics_server = start_metrics(self.stats, cfg.metrics_host, cfg.metrics_port)
        log.info("serving on %s (mode %04o, uids %s, loop %s, pid %d)", cfg.socket, cfg.socket_mode,
                 list(self.allowed_uids), type(loop).__module__, os.getpid())

    def watch_idle(self) -> None:
        """With ``exit_when_idle``: count down while no client is connected, stop counting otherwise."""
        delay = self.config.exit_when_idle
        if self.connections or self.stopping or delay <= 0:
            if self._idle_timer is not None:
                self._idle_timer.cancel()
                self._idle_timer = None
        elif self._idle_timer is None:
            self._idle_timer = asyncio.get_running_loop().call_later(delay, self._idle_expired)

    def _idle_expired(self) -> None:
        self._idle_timer = None
        if self.connections or self.stopping:
            return
        if self.uploader is not None and not self.uploader.idle:
            # a delta still on its way to the object store: look again shortly
            self._idle_timer = asyncio.get_running_loop().call_later(IDLE_RECHECK, self._idle_expired)
            return
        log.info("no client for %.0fs and no upload pending: exiting", self.config.exit_when_idle)
        self.idle_exit.set()

    def _on_durable(self, store_id: StoreId, ref: CheckpointRef, nbytes: int,
                    lineage: tuple[CheckpointRef, ...]) -> None:
        assert self.maintenance is not None  # set by start(), with the uploader that calls this
        self.maintenance.note_durable(store_id, ref, nbytes, lineage)
        self.check_budget_soon()  # a store whose uploads settled may be evictable now

    def _sweep_idle_versions(self) -> None:
        """Every quarter of ``open_version_idle_timeout`` (``IDLE_SWEEP_MAX`` at most): abort the
        open versions that had no request for that long, on every connection."""
        limit = self.config.open_version_idle_timeout
        self._idle_sweep = None
        if limit <= 0 or self.stopping:
            return
        now = time.monotonic()
        for conn in list(self.connections):
            self.counters["versions_expired"] += conn.expire_idle(now, limit)
        self._idle_sweep = asyncio.get_running_loop().call_later(min(limit / 4, IDLE_SWEEP_MAX),
                                                                 self._sweep_idle_versions)

    def note_changes(self, w: StoreVersion) -> None:
        """An open version took changes: large ones are checked against the budget now, any
        others shortly (``check_budget_soon``)."""
        if self.registry is not None:
            self.registry.note_changes(w)
        self.check_budget_soon()

    def check_budget_soon(self) -> None:
        """Evict idle stores over the memory budget shortly (``BUDGET_CHECK_DELAY``), once per burst."""
        if self._budget_check is None:
            self._budget_check = asyncio.get_running_loop().call_later(BUDGET_CHECK_DELAY, self._check_budget)

    def _check_budget(self) -> None:
        self._budget_check = None
        registry = self.registry
        if registry is None:
            return
        registry.enforce_budget()
        # memory given back (stores evicted or spilled, deltas stacked, changes flushed, blocks
        # dropped) is scattered through malloc's heap: hand its pages back now and then
        if registry.releases != self._trimmed_at:
            now = time.monotonic()
            if now - self._last_trim >= TRIM_INTERVAL:
                self._last_trim, self._trimmed_at = now, registry.releases
                give_back_free_pages()

    async def await_durable(self, store_id: StoreId, ref: CheckpointRef, timeout: float) -> bool:
        """True once ``ref``'s file is in the object store (asking the store when the uploader never saw it).

        The uploader creates a delta only after every delta of its lineage is durable, so a file
        there is a loadable state. Raises the typed error when ``ref`` will not become durable or
        its root is degraded (see ``Uploader.wait_durable``)."""
        if ref.is_empty_state:
            return True
        uploader = self.uploader
        assert uploader is not None  # set by start()
        if uploader.state(store_id, ref) is not None:
            return await uploader.wait_durable(store_id, ref, timeout)
        objstore = self.objstores(store_id.root)
        for kind in (DELTA, SNAPSHOT):
            try:
                if await objstore.exists(file_key(store_id, ref, kind)):
                    return True
            except ObjectStoreError:
                raise
        return False

    def health(self) -> dict[str, Any]:
        """``{"status": "ok" | "degraded" | "stopping", "reasons": [...], "degraded_roots": {...}}``:
        degraded while an object-store root refuses uploads in a way retrying does not heal by
        itself (credentials, permissions, a missing bucket, a full disk); uploads are retried and
        the first success there clears it."""
        degraded = self.uploader.degraded() if self.uploader is not None else {}
        reasons = [f"{root}: {d['error']}: {d['message']} ({d['uploads_waiting']} uploads waiting, "
                   f"{d['refused']} attempts refused)" for root, d in degraded.items()]
        status = "stopping" if self.stopping else "degraded" if degraded else "ok"
        return {"status": status, "reasons": reasons, "degraded_roots": degraded}

    def stats(self) -> dict[str, Any]:
        return {
            "health": self.health(),
            "daemon": {"version": __version__, "pid": os.getpid(), "uptime": round(time.monotonic() - self._started, 3),
                       "open_connections": len(self.connections), "stopping": self.stopping,
                       "open_versions": sum(c.open_versions for c in self.connections), **self.counters,
                       "requests_by_op": dict(self.requests_by_op), "commit_latency": self.commit_latency.stats(),
                       "partial_frame_bytes": self.frame_pool.used, "partial_frames_waiting": self.frame_pool.waiting,
                       **self.frame_pool.counters},
            # ``is not None``: an empty registry is falsy (it has a length), and its section must
            # still carry every key (zeros), as the metrics endpoint reads them all
            "registry": self.registry.stats() if self.registry is not None else {},
            "uploader": self.uploader.stats() if self.uploader is not None else {},
            "maintenance": self.maintenance.stats() if self.maintenance is not None else {},
            "object_stores": self.objstores.stats(),
        }

    async def stop(self) -> bool:
        """Stop listening; let the connections commit or abort the versions they have open and
        finish their requests (OPEN refused) while the uploads drain; close them once all is done
        or at ``drain_timeout``, then finish draining within it. True when every acknowledged
        commit is durable (``clean_stop``); else the versions that are not are logged."""
        if self.stopping:
            return bool(self.clean_stop)
        self.stopping = True
        cfg = self.config
        loop = asyncio.get_running_loop()
        deadline = loop.time() + cfg.drain_timeout
        log.info("stopping: %d connections, %d open versions, %d bytes queued for upload", len(self.connections),
                 sum(c.open_versions for c in self.connections), self.uploader.queued_bytes if self.uploader else 0)
        # No new connection: the socket stops listening at once, so a successor daemon may bind its
        # path while this one drains (a client finds no daemon there rather than a refusal).
        if self._server is not None:
            self._server.close()
        # The connections stay through the drain: a version open on one may still be written and
        # committed (OPEN is refused), AWAIT_DURABLE and STATS are answered. They are closed once
        # no version is open and no request in flight on any of them and every upload is done,
        # or at the drain's end (a version still open then is aborted: it was never acknowledged).
        await self._drain_connections(deadline)
        left = [c for c in self.connections if c.open_versions]
        if left:
            log.warning("drain over after %.1f s: aborting %d versions still open on %d connections",
                        cfg.drain_timeout, sum(c.open_versions for c in left), len(left))
        for c in list(self.connections):
            c.close()
        if self._budget_check is not None:
            self._budget_check.cancel()
            self._budget_check = None
        if self._idle_sweep is not None:
            self._idle_sweep.cancel()
            self._idle_sweep = None
        self.watch_idle()
        drained = True
        if self.uploader is not None:
            drained = await self.uploader.drain(max(0.0, deadline - loop.time()))
        if self.maintenance is not None:
            await self.maintenance.close()
        not_durable: list[tuple[StoreId, CheckpointRef, BaseException | None]] = []
        if self.uploader is not None:
            if not drained:
                log.error("drain timed out after %.1fs: %s", cfg.drain_timeout, self.uploader.stats())
            await self.uploader.close()
            not_durable = self.uploader.not_durable()
            _log_not_durable(not_durable)
        self.clean_stop = drained and not not_durable
        await self.objstores.close()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
        try:
            # only our own socket: a daemon started while this one was stopping has bound a new
            # socket at the same path
            st = os.lstat(cfg.socket)
            if self._socket_inode == (st.st_dev, st.st_ino) and stat.S_ISSOCK(st.st_mode):
                os.unlink(cfg.socket)
        except FileNotFoundError:
            pass
        if self.clean_stop:
            log.info("stopped (uploads drained: True): every acknowledged commit is durable")
        else:
            log.error("stopped with %d acknowledged commits not durable (uploads drained: %s)", len(not_durable),
                      drained)
        return self.clean_stop

    async def _drain_connections(self, deadline: float) -> None:
        """Return once no connection has a version open or a request in flight and the uploader is
        idle, or at ``deadline`` (loop time)."""
        loop = asyncio.get_running_loop()
        while loop.time() < deadline:
            busy = any(c.open_versions or c.busy for c in self.connections)
            if not busy and (self.uploader is None or self.uploader.idle):
                return
            await asyncio.sleep(min(DRAIN_POLL, max(0.0, deadline - loop.time())))

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


def _log_not_durable(items: list[tuple[StoreId, CheckpointRef, BaseException | None]]) -> None:
    """One error line per store: the versions (``version_ckptid``) not durable and the last error."""
    by_store: dict[StoreId, list[tuple[CheckpointRef, BaseException | None]]] = {}
    for store_id, ref, err in items:
        by_store.setdefault(store_id, []).append((ref, err))
    for store_id, refs in by_store.items():
        shown = " ".join(f"{r.version}_{r.ckptid}" for r, _ in refs[:LIST_NOT_DURABLE])
        more = f" and {len(refs) - LIST_NOT_DURABLE} more" if len(refs) > LIST_NOT_DURABLE else ""
        last = refs[-1][1]
        log.error("NOT DURABLE: %s %s: %d acknowledged versions: %s%s (%s)", store_id.root, store_id.prefix,
                  len(refs), shown, more, f"{type(last).__name__}: {last}" if last else "not uploaded")


# --- running it -----------------------------------------------------------------------------------
async def serve(config: DaemonConfig, *, open_objstore: Callable[[str], ObjectStore] | None = None) -> int:
    """Run the daemon until SIGTERM or SIGINT (or, with ``exit_when_idle``, until it is idle that long);
    then stop gracefully. Returns the exit code: 0 when every acknowledged commit is durable,
    ``EXIT_NOT_DURABLE`` otherwise (the versions are in the log)."""
    daemon = Daemon(config, open_objstore=open_objstore)
    await daemon.start()
    # Everything loaded so far lives as long as the process (botocore's service models alone are
    # ~80k objects): keep it out of the cyclic collector, whose full passes would otherwise walk
    # it all — a 30 ms pause in the middle of requests.
    gc.collect()
    gc.freeze()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(daemon.idle_exit.wait())]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        log.info("signal received" if stop.is_set() else "idle: stopping")
    finally:
        for w in waits:
            w.cancel()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        clean = await daemon.stop()
    return 0 if clean else EXIT_NOT_DURABLE


def run(config: DaemonConfig) -> int:
    """Configure logs, malloc and the open files limit, pick the event loop (``config.loop``) and
    serve until a signal."""
    configure_logging(config)
    return_freed_memory()
    raise_open_files_limit()
    if config.loop == "uvloop":
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    else:
        runner = asyncio.Runner()
    with runner:
        return runner.run(serve(config))
