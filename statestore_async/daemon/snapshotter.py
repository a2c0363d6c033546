"""Snapshots built in a process of their own, from the files already durable
(docs/ARCHITECTURE.md, "The daemon": ``snapshot_builder = "process"``).

A snapshot of a 200k-key store is ~10 MB to encode and send. Done inside the daemon, even in
small steps between requests, it costs the event loop milliseconds here and there — listing the
keys, compressing blocks, the collector walking large lists, the multi-MB request body — and a
COMMIT that arrives meanwhile waits. So the daemon hands snapshots to a worker process:

- ``SnapshotWorker`` (daemon side) starts ``python -m statestore_async.daemon.snapshotter`` when first
  needed, sends it one request at a time and awaits the answer; a worker that died or left after
  being idle is started again, once per request.
- The worker rebuilds the state (version, ckptid) from the object store exactly as a recovery does
  (``loader.load_store``: the lineage's files, GETs only — the local cache serves them when the
  daemon has one), encodes its snapshot and creates it with ``put_if_absent``. It runs at a lower
  CPU priority (nice +10) than the daemon and leaves after ``idle_seconds`` without a request, so
  its memory (one store at a time) is given back.

The content is the same as an in-daemon snapshot: the state a lineage defines is unique. Messages
are JSON lines on the worker's stdin/stdout; the first line carries the object-store settings.
A worker ends when its stdin closes (the daemon stopped or died).
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import select
import sys
import time
from typing import Any

from statestore_async.errors import StateStoreError, error_for_code
from statestore_async.files.names import SNAPSHOT
from statestore_async.ids import CheckpointRef, StoreId
from statestore_async.objectstore.base import ObjectStore

log = logging.getLogger(__name__)

WORKER_NICE = 10
IDLE_SECONDS = 60.0


class SnapshotWorkerError(StateStoreError):
    """The snapshot worker process could not be started or died twice on one request."""


# --- the daemon's side ------------------------------------------------------------------------------
class SnapshotWorker:
    """A handle on the worker process: ``await snapshot(store_id, ref)``; ``await close()``."""

    def __init__(self, settings: dict[str, Any], *, idle_seconds: float = IDLE_SECONDS) -> None:
        self._settings = dict(settings, idle_seconds=idle_seconds)
        self._proc: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()
        self._next_id = 0
        self.starts = 0
        self.requests: dict[str, int] = {}  # object-store requests the worker sent, by kind

    async def _start(self) -> asyncio.subprocess.Process:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "statestore_async.daemon.snapshotter",
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=None,
            limit=1 << 20)
        assert proc.stdin is not None  # stdin=PIPE
        proc.stdin.write(json.dumps(self._settings).encode() + b"\n")
        self.starts += 1
        log.info("snapshot worker started (pid %d)", proc.pid)
        return proc

    async def _reap(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.returncode is None:
            proc.kill()
        await proc.wait()

    async def _ask(self, message: dict[str, Any]) -> dict[str, Any] | None:
        if self._proc is None or self._proc.returncode is not None:
            await self._reap()
            self._proc = await self._start()
        proc = self._proc
        assert proc.stdin is not None and proc.stdout is not None  # PIPEs
        try:
            proc.stdin.write(json.dumps(message).encode() + b"\n")
            await proc.stdin.drain()
            line = await proc.stdout.readline()
        except (BrokenPipeError, ConnectionResetError):
            line = b""
        if not line:  # it left (idle) or died: the caller starts a fresh one
            await self._reap()
            return None
        return json.loads(line)

    async def snapshot(self, store_id: StoreId, ref: CheckpointRef, objstore: ObjectStore | None = None) -> int:
        """Have the worker create the snapshot of ``ref``; returns its size in bytes (0: it existed).

        ``objstore``: the daemon's own store of that root; when it is a local cache
        (``adopt``), the copies the worker put into the shared cache folder are counted there.
        """
        async with self._lock:
            self._next_id += 1
            message = {"id": self._next_id, "root": store_id.root, "store": store_id.to_json(),
                       "version": ref.version, "ckptid": ref.ckptid}
            try:
                answer = await self._ask(message)
                if answer is None:
                    answer = await self._ask(message)
            except (OSError, ValueError) as exc:
                await self._reap()
                raise SnapshotWorkerError(f"snapshot worker failed: {exc}") from exc
            if answer is None:
                raise SnapshotWorkerError("the snapshot worker exited twice while building a snapshot")
        for kind, n in answer.get("requests", {}).items():
            self.requests[kind] = self.requests.get(kind, 0) + n
        adopt = getattr(objstore, "adopt", None)
        if adopt is not None and answer.get("cached"):
            await asyncio.to_thread(adopt, *answer["cached"])
        if not answer.get("ok"):
            raise error_for_code(answer.get("code", 0))(answer.get("message", "snapshot worker error"))
        return answer["bytes"]

    async def close(self) -> None:
        """Stop the worker (closing its stdin; killed if it does not leave within 5 s)."""
        proc, self._proc = self._proc, None
        if proc is None or proc.returncode is not None:
            return
        assert proc.stdin is not None  # stdin=PIPE
        proc.stdin.close()
        try:
            await asyncio.wait_for(proc.wait(), 5)
        except TimeoutError:
            proc.kill()
            await proc.wait()

    def stats(self) -> dict[str, Any]:
        return {"worker_running": int(self._proc is not None and self._proc.returncode is None),
                "worker_starts": self.starts, "worker_requests": dict(self.requests)}


# --- the worker process --------------------------------------------------------------------------------
def _requests(objstore: ObjectStore) -> dict[str, int]:
    inner = getattr(objstore, "inner", objstore)  # behind a local cache, count what reached the origin
    return dict(getattr(inner, "counts", None) or {})


async def _build(objstores: dict[str, ObjectStore], settings: dict[str, Any], message: dict[str, Any]) -> dict[str, Any]:
    from statestore_async.daemon.objectstores import open_root
    from statestore_async.files.checkpoint import block_bytes_for, encode_snapshot
    from statestore_async.files.loader import load_store
    from statestore_async.files.transfer import create_checkpoint_file

    root = message["root"]
    objstore = objstores.get(root)
    if objstore is None:
        objstore = open_root(root, s3_options=settings.get("s3"), cache_dir=settings.get("cache_dir"),
                             cache_bytes=settings.get("cache_bytes", 0))
        objstores[root] = objstore
    before = _requests(objstore)
    cached_before = objstore.cached_keys() if hasattr(objstore, "cached_keys") else set()
    try:
        s = message["store"]
        store_id = StoreId(root, s["operator_id"], s["partition_id"], s["store_name"])
        ref = CheckpointRef(message["version"], message["ckptid"])
        store, _ = await load_store(objstore, store_id, ref)
        with store.freeze() as view:
            data = encode_snapshot(view, block_bytes=block_bytes_for(store.memory_bytes))
        del store
        answer: dict[str, Any] = {"ok": True, "bytes": await create_checkpoint_file(objstore, store_id, ref, SNAPSHOT, data)}
    except StateStoreError as exc:
        answer = {"ok": False, "code": exc.code, "message": str(exc)}
    except Exception as exc:  # a bug: tell the daemon, keep serving
        log.exception("snapshot of %s failed", message)
        answer = {"ok": False, "code": StateStoreError.code, "message": f"{type(exc).__name__}: {exc}"}
    after = _requests(objstore)
    answer["requests"] = {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}
    if hasattr(objstore, "cached_keys"):
        # the copies this build put into the node's cache folder (the snapshot, deltas it
        # downloaded): the daemon's cache counts them against its bound (``adopt``)
        answer["cached"] = sorted(objstore.cached_keys() - cached_before)
    answer["id"] = message.get("id")
    return answer


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s snapshotter: %(message)s")
    try:
        os.nice(WORKER_NICE)
    except OSError:
        pass
    # unbuffered: ``select`` must see every line that has not been read yet
    stdin, stdout = os.fdopen(sys.stdin.fileno(), "rb", buffering=0, closefd=False), sys.stdout.buffer
    first = stdin.readline()
    if not first:
        return 0
    settings = json.loads(first)
    idle = float(settings.get("idle_seconds", IDLE_SECONDS))
    loop = asyncio.new_event_loop()
    objstores: dict[str, ObjectStore] = {}
    try:
        while True:
            ready, _, _ = select.select([stdin], [], [], idle)
            if not ready:
                return 0  # idle: give the memory back; the daemon starts a new worker when needed
            line = stdin.readline()
            if not line:
                return 0  # the daemon closed our stdin (stopped or died)
            started = time.monotonic()
            answer = loop.run_until_complete(_build(objstores, settings, json.loads(line)))
            log.info("snapshot in %.2f s: %s", time.monotonic() - started, answer)
            stdout.write(json.dumps(answer).encode() + b"\n")
            stdout.flush()
    finally:
        for s in objstores.values():
            loop.run_until_complete(s.close())
        loop.close()


if __name__ == "__main__":
    sys.exit(main())
