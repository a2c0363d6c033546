"""The daemon's object stores: one per checkpoint root, opened once, behind the node's file cache.

``open_root`` is the one way the daemon (and its snapshot worker) opens the object store of a
checkpoint root: ``s3://`` roots with the daemon's S3 settings, and with ``cache_dir`` set, the
local cache of checkpoint files in front of it.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from statestore_async.files.names import is_checkpoint_file
from statestore_async.objectstore import open_object_store
from statestore_async.objectstore.base import ObjectStore
from statestore_async.objectstore.cache import CachingObjectStore


def open_root(uri: str, *, s3_options: dict[str, Any] | None = None, cache_dir: str | None = None,
              cache_bytes: int = 0) -> ObjectStore:
    """The object store of checkpoint root ``uri``, with the node's file cache when ``cache_dir`` is set."""
    store = open_object_store(uri, s3_options=s3_options or {})
    if cache_dir:
        store = CachingObjectStore(store, cache_dir, cache_bytes, cacheable=is_checkpoint_file)
    return store


class ObjectStores:
    """One open ``ObjectStore`` per checkpoint root, opened on first use."""

    def __init__(self, open_store: Callable[[str], ObjectStore] = open_root) -> None:
        self._open = open_store
        self._stores: dict[str, ObjectStore] = {}

    def __call__(self, root: str) -> ObjectStore:
        store = self._stores.get(root)
        if store is None:
            store = self._stores[root] = self._open(root)
        return store

    def stats(self) -> dict[str, dict[str, int]]:
        """Requests sent to each root's object store, by kind (PUT, GET, HEAD, LIST, DELETE)."""
        return {root: dict(getattr(s, "counts", None) or {}) for root, s in self._stores.items()}

    async def close(self) -> None:
        stores, self._stores = list(self._stores.values()), {}
        for s in stores:
            await s.close()
