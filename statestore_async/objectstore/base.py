"""The object-store contract: what the checkpoint layer needs from S3 or a local directory.

Keys are ``/``-separated names relative to the store's root (``op/3/default/7_<id>.delta``).
Data files are written once with ``put_if_absent`` (S3: ``If-None-Match: *``; local: a temp file
linked into place); manifests are replaced with ``put``. Nothing here knows about versions.
"""
from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Self

from statestore_async.errors import InterfaceError


@dataclass(frozen=True)
class ObjectInfo:
    """What a HEAD or LIST says of an object."""

    key: str
    size: int
    etag: str | None = None
    mtime: float | None = None  # seconds since the epoch


def check_key(key: str) -> str:
    """Reject keys that could escape the root or that S3 and a file system would treat differently."""
    if not isinstance(key, str) or not key:
        raise InterfaceError(f"an object key is a non-empty string, got {key!r}")
    parts = key.split("/")
    if key.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\\" in key or "\x00" in key:
        raise InterfaceError(f"bad object key {key!r}: use relative '/'-separated names without '.', '..' or empty parts")
    if any(p.startswith(".tmp-") for p in parts):
        raise InterfaceError(f"bad object key {key!r}: names starting with '.tmp-' are reserved")
    return key


class ObjectStore(abc.ABC):
    """Async access to one bucket/prefix or directory. Use as ``async with``; ``close()`` when done."""

    #: the URI this store was opened with (``file:///…`` or ``s3://bucket/prefix``)
    uri: str

    @abc.abstractmethod
    async def put_if_absent(self, key: str, data: bytes) -> ObjectInfo:
        """Create ``key`` with ``data`` atomically; ``ObjectExistsError`` if it exists (nothing written)."""

    @abc.abstractmethod
    async def put(self, key: str, data: bytes) -> ObjectInfo:
        """Create or replace ``key`` atomically (readers see the old or the new bytes, never a mix)."""

    @abc.abstractmethod
    async def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        """The bytes of ``key`` (``[start, end)`` when given); ``ObjectNotFoundError`` if missing."""

    async def get_stream(self, key: str, chunk_size: int = 1 << 20) -> AsyncIterator[bytes]:
        """The bytes of ``key`` in chunks as they arrive (default: one chunk)."""
        yield await self.get(key)

    @abc.abstractmethod
    async def head(self, key: str) -> ObjectInfo:
        """Size and metadata of ``key``; ``ObjectNotFoundError`` if missing."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        """Every object whose key starts with ``prefix``, in key order. Not for the hot path."""

    @abc.abstractmethod
    async def delete(self, key: str) -> None:
        """Remove ``key``; removing a missing key is not an error."""

    async def delete_many(self, keys: Iterable[str]) -> None:
        """Remove every key of ``keys`` (missing ones are not an error). Stores with a batch delete
        override this."""
        for key in keys:
            await self.delete(key)

    def local_path(self, key: str) -> str | None:
        """A file on this node holding the bytes of ``key``, an immutable object, if there is one
        now (a local store's own file, a cache's copy); None otherwise. Blocking (a stat): call it
        off the hot path. Open the file at once: a cache may later remove it (an open file stays
        readable)."""
        return None

    async def exists(self, key: str) -> bool:
        from statestore_async.errors import ObjectNotFoundError

        try:
            await self.head(key)
        except ObjectNotFoundError:
            return False
        return True

    async def close(self) -> None:  # noqa: B027 - a store with nothing to release need not override it
        """Release connections and threads."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
