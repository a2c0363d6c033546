"""``CachingObjectStore``: a bounded local-disk cache of checkpoint files in front of another store.

Delta and snapshot files never change once written, so a copy is kept on local disk when one is
uploaded (``put_if_absent`` succeeded) or downloaded whole; later GETs of it read the copy. A
daemon restarted on the same node therefore reloads its stores without downloading them. Only
checkpoint files are cached (manifests and anything else pass through). The cache is bounded by
bytes, least recently used out first; ``forget`` drops a copy (the loader does it when a cached copy
fails its checksums, then reads the origin). Copies are written atomically (temp + rename), so a
crash never leaves a partial copy behind.

The cache is best effort: a cache folder that cannot be created or written (a full disk, no
inodes left, a read-only mount) is logged and costs downloads, never an operation of the store —
an upload that reached the inner store succeeded, whatever became of its local copy.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import threading
import uuid
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path
from typing import cast

from statestore_async.objectstore.base import ObjectInfo, ObjectStore, check_key

log = logging.getLogger(__name__)


class CachingObjectStore(ObjectStore):
    """``inner`` with a local cache of its immutable objects in ``cache_dir`` (at most ``max_bytes``).

    ``cacheable(key)`` tells which keys name immutable objects (the daemon passes
    ``files.names.is_checkpoint_file``); only those are kept.
    """

    def __init__(self, inner: ObjectStore, cache_dir: str | os.PathLike[str], max_bytes: int, *,
                 cacheable: Callable[[str], bool]) -> None:
        self.inner = inner
        self.cacheable = cacheable
        self.uri = inner.uri
        self.max_bytes = max_bytes
        self.dir = Path(cache_dir) / hashlib.sha256(inner.uri.encode()).hexdigest()[:20]
        self._lock = threading.Lock()
        self._lru: OrderedDict[str, int] = OrderedDict()  # key -> size, least recently used first
        self.total = 0
        self.hits = 0
        self.misses = 0
        self.errors = 0  # copies that could not be written or removed (logged)
        self._warned = False
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._scan()
        except OSError as exc:  # tried again with each copy
            self._trouble(f"cannot use the cache folder {self.dir}", exc)

    def _trouble(self, what: str, exc: OSError) -> None:
        """Count and log a cache failure: a warning the first time, then at debug level (a full
        cache disk would otherwise log one line per file)."""
        self.errors += 1
        (log.debug if self._warned else log.warning)("%s: %s (the cache is best effort: reading "
                                                      "from %s instead)", what, exc, self.uri)
        self._warned = True

    def _scan(self) -> None:
        found = []
        for dirpath, _, names in os.walk(self.dir):
            for name in names:
                p = Path(dirpath) / name
                if name.startswith(".tmp-"):
                    p.unlink(missing_ok=True)
                    continue
                try:
                    st = p.stat()
                except FileNotFoundError:
                    continue
                found.append((st.st_atime, p.relative_to(self.dir).as_posix(), st.st_size))
        for _, key, size in sorted(found):
            self._lru[key] = size
            self.total += size

    def _path(self, key: str) -> Path:
        return self.dir.joinpath(*check_key(key).split("/"))

    def _touch(self, key: str) -> bool:
        with self._lock:
            if key in self._lru:
                self._lru.move_to_end(key)
                return True
            return False

    def _store(self, key: str, data: bytes) -> None:
        """Write a copy (in a worker thread) and evict to the bound."""
        if len(data) > self.max_bytes:
            return
        path = self._path(key)
        tmp = path.parent / f".tmp-{uuid.uuid4().hex}"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError as exc:  # a full or broken cache disk only costs downloads
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            self._trouble(f"cannot cache {key}", exc)
            return
        with self._lock:
            old = self._lru.pop(key, 0)
            self._lru[key] = len(data)
            self.total += len(data) - old
            victims = self._evict_locked()
        self._unlink(victims)

    def local_path(self, key: str) -> str | None:
        """The cached copy of ``key`` (counted as a use), else the inner store's own local file."""
        if self._touch(key):
            path = self._path(key)
            if path.is_file():
                return str(path)
        return self.inner.local_path(key)

    def cached_keys(self) -> set[str]:
        """The keys this cache holds a copy of, as it knows them."""
        with self._lock:
            return set(self._lru)

    def adopt(self, *keys: str) -> None:
        """Count the copies of ``keys`` that another process wrote into this cache's folder (the
        snapshot worker), so the bound covers them and they are evicted in turn. Runs in a worker
        thread (a stat each, maybe evictions)."""
        sizes = {}
        for key in keys:
            try:
                sizes[key] = self._path(key).stat().st_size
            except OSError:
                pass  # gone again (evicted by its writer): nothing to count
        with self._lock:
            for key, size in sizes.items():
                self.total += size - self._lru.pop(key, 0)
                self._lru[key] = size
            victims = self._evict_locked()
        self._unlink(victims)

    def _evict_locked(self) -> list[str]:
        victims = []
        while self.total > self.max_bytes and self._lru:
            k, size = self._lru.popitem(last=False)
            self.total -= size
            victims.append(k)
        return victims

    def _unlink(self, keys: Iterable[str]) -> None:
        for k in keys:
            try:
                self._path(k).unlink(missing_ok=True)
            except OSError as exc:
                self._trouble(f"cannot remove the cached copy of {k}", exc)

    def forget(self, key: str) -> bool:
        """Drop the cached copy of ``key``; True if there was one."""
        with self._lock:
            size = self._lru.pop(key, None)
            if size is None:
                return False
            self.total -= size
        self._unlink((key,))
        return True

    def _read(self, key: str, start: int | None, end: int | None) -> bytes | None:
        try:
            with open(self._path(key), "rb") as f:
                if start:
                    f.seek(start)
                return f.read() if end is None else f.read(max(0, end - (start or 0)))
        except OSError:
            self.forget(key)
            return None

    # --- the contract ------------------------------------------------------------------------------
    async def _keep(self, key: str, data: bytes) -> None:
        """Keep a copy of ``key`` (best effort: ``_store`` logs and swallows disk trouble)."""
        if self.cacheable(key):
            await asyncio.to_thread(self._store, key, data)

    async def put_if_absent(self, key: str, data: bytes) -> ObjectInfo:
        info = await self.inner.put_if_absent(key, data)
        await self._keep(key, data)  # the upload succeeded whatever happens to the copy
        return info

    async def abort_incomplete_uploads(self, prefix: str) -> int:
        """The inner store's (see ``S3ObjectStore.abort_incomplete_uploads``); 0 when it has none."""
        abort = getattr(self.inner, "abort_incomplete_uploads", None)
        if abort is None:
            return 0
        aborted: int = await abort(prefix)
        return aborted

    async def put(self, key: str, data: bytes) -> ObjectInfo:
        self.forget(key)
        return await self.inner.put(key, data)

    async def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        if self.cacheable(key) and self._touch(key):
            data = await asyncio.to_thread(self._read, key, start, end)
            if data is not None:
                self.hits += 1
                return data
        self.misses += 1
        data = await self.inner.get(key, start, end)
        if start is None and end is None:
            await self._keep(key, data)
        return data

    async def get_stream(self, key: str, chunk_size: int = 1 << 20) -> AsyncIterator[bytes]:
        if self.cacheable(key) and self._touch(key):
            data = await asyncio.to_thread(self._read, key, None, None)
            if data is not None:
                self.hits += 1
                for i in range(0, len(data), chunk_size):
                    yield data[i : i + chunk_size]
                return
        self.misses += 1
        parts = []
        async for chunk in self.inner.get_stream(key, chunk_size):
            parts.append(chunk)
            yield chunk
        await self._keep(key, b"".join(parts))

    async def head(self, key: str) -> ObjectInfo:
        return await self.inner.head(key)

    def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        return self.inner.list(prefix)

    async def delete(self, key: str) -> None:
        self.forget(key)
        await self.inner.delete(key)

    async def delete_many(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        for key in keys:
            self.forget(key)
        await self.inner.delete_many(keys)

    async def close(self) -> None:
        await self.inner.close()

    @property
    def counts(self) -> Counter[str] | None:
        return cast("Counter[str] | None", getattr(self.inner, "counts", None))
