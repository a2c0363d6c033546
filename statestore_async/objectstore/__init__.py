"""Object stores: the async contract and its implementations, chosen by URI.

``file:///path`` (or a plain path) → ``LocalObjectStore``, the embedded default;
``s3://bucket/prefix`` → ``S3ObjectStore``.
"""
from __future__ import annotations

from typing import Any
from urllib.parse import unquote, urlparse

from statestore_async.errors import InterfaceError
from statestore_async.objectstore.base import ObjectInfo, ObjectStore, check_key
from statestore_async.objectstore.local import LocalObjectStore

__all__ = ["LocalObjectStore", "ObjectInfo", "ObjectStore", "check_key", "open_object_store"]


def open_object_store(uri: str, *, s3_options: dict[str, Any] | None = None, **options: Any) -> ObjectStore:
    """Open the object store a URI names (``file:///…``, a plain path, or ``s3://bucket/prefix``).

    ``options`` go to whichever store the URI selects; ``s3_options`` only to an S3 store (so a
    daemon can hold one set of S3 settings and still open local roots).
    """
    parsed = urlparse(uri)
    if parsed.scheme in ("", "file"):
        if parsed.scheme == "file" and parsed.netloc not in ("", "localhost"):
            raise InterfaceError(f"file URIs name a local path (file:///path), got {uri!r}")
        path = unquote(parsed.path) if parsed.scheme == "file" else uri
        if not path:
            raise InterfaceError("an empty path is not an object store")
        return LocalObjectStore(path, **options)
    if parsed.scheme == "s3":
        try:
            from statestore_async.objectstore.s3 import S3ObjectStore
        except ImportError as exc:
            raise InterfaceError(f"S3 support is not available: {exc}") from exc
        return S3ObjectStore.from_uri(uri, **{**(s3_options or {}), **options})
    raise InterfaceError(f"unsupported object store URI {uri!r}: use file:///path or s3://bucket/prefix")
