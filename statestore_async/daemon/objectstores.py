"""The daemon's object stores: one per checkpoint root, opened once, behind the node's file cache.

``open_root`` is the one way the daemon (and its snapshot worker) opens the object store of a
checkpoint root: ``s3://`` roots with the daemon's S3 settings, and with ``cache_dir`` set, the
local cache of checkpoint files in front of it.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from statestore_async.files.names import is_checkpoint_file
from statestore_async.ids import RootParts, check_root
from statestore_async.objectstore import open_object_store
from statestore_async.objectstore.base import ObjectStore
from statestore_async.objectstore.cache import CachingObjectStore

# roots remembered as checked (a daemon serves a handful; the set is emptied should it reach this)
MAX_CHECKED_ROOTS = 1024


def open_root(uri: str, *, s3_options: dict[str, Any] | None = None, cache_dir: str | None = None,
              cache_bytes: int = 0) -> ObjectStore:
    """The object store of checkpoint root ``uri``, with the node's file cache when ``cache_dir`` is set."""
    store = open_object_store(uri, s3_options=s3_options or {})
    if cache_dir:
        store = CachingObjectStore(store, cache_dir, cache_bytes, cacheable=is_checkpoint_file)
    return store


class ObjectStores:
    """One open ``ObjectStore`` per checkpoint root, opened on first use. A root is checked before
    its store is opened (``ids.check_root``: well-formed, and under one of ``allowed`` when given),
    so no request can make the daemon create or write a folder outside them."""

    def __init__(self, open_store: Callable[[str], ObjectStore] = open_root, *,
                 allowed: tuple[RootParts, ...] = ()) -> None:
        self._open = open_store
        self._stores: dict[str, ObjectStore] = {}
        self.allowed = allowed
        self._checked: set[str] = set()  # roots found acceptable (an OPEN checks its root each time)

    def check(self, root: str) -> None:
        """Raise ``RootError`` (``RootNotAllowedError``) for a root this daemon must not serve."""
        if root in self._checked:
            return
        check_root(root, self.allowed)
        if len(self._checked) >= MAX_CHECKED_ROOTS:
            self._checked.clear()
        self._checked.add(root)

    def __call__(self, root: str) -> ObjectStore:
        store = self._stores.get(root)
        if store is None:
            self.check(root)
            store = self._stores[root] = self._open(root)
        return store

    def stats(self) -> dict[str, dict[str, int]]:
        """Requests sent to each root's object store, by kind (PUT, GET, HEAD, LIST, DELETE)."""
        return {root: dict(getattr(s, "counts", None) or {}) for root, s in self._stores.items()}

    async def close(self) -> None:
        stores, self._stores = list(self._stores.values()), {}
        for s in stores:
            await s.close()
