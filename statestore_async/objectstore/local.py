"""``LocalObjectStore``: the embedded default, an object store over a local directory.

Writes are crash-safe: data goes to a temp file in the target folder, is fsynced, then linked
(``put_if_absent``: ``os.link`` fails if the name exists, so exactly one of concurrent creators
wins, across processes) or renamed (``put``) into place, and the folder is fsynced.
Blocking file calls run in a small thread pool so the event loop never waits on the disk.
ENOSPC/EDQUOT raise ``StorageFullError``; EACCES/EPERM/EROFS ``ObjectStoreAccessError`` (retrying
does not heal them). ``abort_incomplete_uploads(prefix)`` removes the temp files a killed writer
left under a prefix.
"""
from __future__ import annotations

import asyncio
import errno
import os
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar, TypeVarTuple

from statestore_async.errors import (
    InterfaceError,
    ObjectExistsError,
    ObjectNotFoundError,
    ObjectStoreAccessError,
    ObjectStoreError,
    StorageFullError,
)
from statestore_async.objectstore.base import ObjectInfo, ObjectStore, check_key

_FULL = (errno.ENOSPC, errno.EDQUOT)
_DENIED = (errno.EACCES, errno.EPERM, errno.EROFS)

_T = TypeVar("_T")
_Ts = TypeVarTuple("_Ts")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _os_error(exc: OSError, key: str, what: str) -> ObjectStoreError:
    if exc.errno in _FULL:
        return StorageFullError(f"no space left to {what} {key!r}: {exc}", key)
    if exc.errno in _DENIED:
        return ObjectStoreAccessError(f"not allowed to {what} {key!r}: {exc}", key)
    return ObjectStoreError(f"cannot {what} {key!r}: {exc}", key)


class LocalObjectStore(ObjectStore):
    """An object store over the directory ``root`` (created if missing, unless ``create=False``:
    read-only tools open a root without creating it; a missing root then reads as empty, and a
    write creates the folders it needs)."""

    def __init__(self, root: str | os.PathLike[str], *, threads: int = 4, fsync: bool = True,
                 create: bool = True) -> None:
        self.root = Path(root).absolute()
        self.uri = self.root.as_uri()
        self.fsync = fsync
        if create:
            self.root.mkdir(parents=True, exist_ok=True)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="localstore")
        self._closed = False
        self.counts: Counter[str] = Counter()  # requests by kind: PUT, GET, HEAD, LIST, DELETE

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*check_key(key).split("/"))

    async def _run(self, fn: Callable[[*_Ts], _T], *args: *_Ts) -> _T:
        if self._closed:
            raise InterfaceError("the object store is closed")
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def local_path(self, key: str) -> str | None:
        path = self._path(key)
        return str(path) if path.is_file() else None

    # --- writes ----------------------------------------------------------------------------------
    def _write_temp(self, path: Path, key: str, data: bytes) -> Path:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except NotADirectoryError as exc:
            raise ObjectStoreError(f"cannot create {key!r}: a parent is a file", key) from exc
        except OSError as exc:
            raise _os_error(exc, key, "create the folder of") from exc
        tmp = path.parent / f".tmp-{uuid.uuid4().hex}-{path.name}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                view = memoryview(data)
                while view:
                    n = os.write(fd, view)
                    view = view[n:]
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise _os_error(exc, key, "write") from exc
        return tmp

    def _put_if_absent(self, key: str, data: bytes) -> ObjectInfo:
        path = self._path(key)
        tmp = self._write_temp(path, key, data)
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise ObjectExistsError(f"object {key!r} exists already", key) from None
        except OSError as exc:
            raise _os_error(exc, key, "link") from exc
        finally:
            os.unlink(tmp)
        if self.fsync:
            _fsync_dir(path.parent)
        return self._stat(key, path)

    def _put(self, key: str, data: bytes) -> ObjectInfo:
        path = self._path(key)
        tmp = self._write_temp(path, key, data)
        try:
            os.replace(tmp, path)
        except OSError as exc:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise _os_error(exc, key, "replace") from exc
        if self.fsync:
            _fsync_dir(path.parent)
        return self._stat(key, path)

    async def put_if_absent(self, key: str, data: bytes) -> ObjectInfo:
        self.counts["PUT"] += 1
        return await self._run(self._put_if_absent, key, data)

    async def put(self, key: str, data: bytes) -> ObjectInfo:
        self.counts["PUT"] += 1
        return await self._run(self._put, key, data)

    # --- reads -----------------------------------------------------------------------------------
    def _stat(self, key: str, path: Path | None = None) -> ObjectInfo:
        path = path or self._path(key)
        try:
            st = path.stat()
        except (FileNotFoundError, NotADirectoryError):
            raise ObjectNotFoundError(f"object {key!r} not found", key) from None
        except OSError as exc:
            raise _os_error(exc, key, "stat") from exc
        if not path.is_file():
            raise ObjectNotFoundError(f"object {key!r} not found (a folder has that name)", key)
        return ObjectInfo(key, st.st_size, f"{st.st_mtime_ns:x}-{st.st_size:x}", st.st_mtime)

    def _get(self, key: str, start: int | None, end: int | None) -> bytes:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                if start:
                    f.seek(start)
                if end is None:
                    return f.read()
                return f.read(max(0, end - (start or 0)))
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise ObjectNotFoundError(f"object {key!r} not found", key) from None
        except OSError as exc:
            raise _os_error(exc, key, "read") from exc

    async def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        self.counts["GET"] += 1
        return await self._run(self._get, key, start, end)

    async def get_stream(self, key: str, chunk_size: int = 1 << 20) -> AsyncIterator[bytes]:
        offset = 0
        size = (await self.head(key)).size
        while offset < size:
            chunk = await self.get(key, offset, min(size, offset + chunk_size))
            if not chunk:
                break
            offset += len(chunk)
            yield chunk

    async def head(self, key: str) -> ObjectInfo:
        self.counts["HEAD"] += 1
        return await self._run(self._stat, key)

    def _list(self, prefix: str) -> list[ObjectInfo]:
        folder, _, _ = prefix.rpartition("/")
        base = self.root.joinpath(*folder.split("/")) if folder else self.root
        out: list[ObjectInfo] = []
        if not base.is_dir():
            return out
        for dirpath, dirnames, filenames in os.walk(base):
            rel_dir = os.path.relpath(dirpath, self.root)
            rel_dir = "" if rel_dir == "." else rel_dir.replace(os.sep, "/") + "/"
            dirnames[:] = [d for d in dirnames if (rel_dir + d + "/").startswith(prefix) or prefix.startswith(rel_dir + d + "/")]
            for name in filenames:
                key = rel_dir + name
                if name.startswith(".tmp-") or not key.startswith(prefix):
                    continue
                try:
                    st = os.stat(os.path.join(dirpath, name))
                except FileNotFoundError:
                    continue
                out.append(ObjectInfo(key, st.st_size, f"{st.st_mtime_ns:x}-{st.st_size:x}", st.st_mtime))
        out.sort(key=lambda o: o.key)
        return out

    async def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        self.counts["LIST"] += 1
        for info in await self._run(self._list, prefix):
            yield info

    def _abort_incomplete(self, prefix: str) -> int:
        folder, _, _ = prefix.rpartition("/")
        base = self.root.joinpath(*folder.split("/")) if folder else self.root
        removed = 0
        for dirpath, _, filenames in os.walk(base):
            rel_dir = os.path.relpath(dirpath, self.root)
            rel_dir = "" if rel_dir == "." else rel_dir.replace(os.sep, "/") + "/"
            for name in filenames:
                if not name.startswith(".tmp-"):
                    continue
                # a temp file is named .tmp-<32 hex digits>-<the name it was written for>
                meant = rel_dir + name[len(".tmp-") + 33:]
                if not meant.startswith(prefix):
                    continue
                try:
                    os.unlink(os.path.join(dirpath, name))
                    removed += 1
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    raise _os_error(exc, prefix, "remove temp files under") from exc
        return removed

    async def abort_incomplete_uploads(self, prefix: str) -> int:
        """Remove the temp files of writes that never finished (a killed process) under ``prefix``;
        returns how many. A concurrent writer whose temp file goes fails its write (retried by the
        daemon's uploader)."""
        return await self._run(self._abort_incomplete, prefix)

    def _delete(self, key: str) -> None:
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise _os_error(exc, key, "delete") from exc

    async def delete(self, key: str) -> None:
        self.counts["DELETE"] += 1
        await self._run(self._delete, key)

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._pool.shutdown(wait=True)
