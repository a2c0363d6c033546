"""Clients of the daemon: ``Client`` (blocking, for Spark Python workers) and ``AsyncClient``.

Both speak the sans-IO ``protocol`` over the daemon's Unix socket::

    client = Client.shared("/run/statestore-async/daemon.sock")   # one per process, fork-safe
    with client.open(StoreId(root, "op", 3), version=7, ckptid=ckpt) as store:
        values = store.get_many(keys)          # list of bytes | None
        store.put_many(zip(keys, new_values))
        ref = store.commit()                   # CheckpointRef(8, <fresh ckptid>)

Batches larger than the daemon's ``max_batch`` (or its frame limit) are split into several
requests, sent pipelined. Errors from the daemon are raised as the same error classes
(``errors.error_for_code``). Keys follow ``statestore_async.codecs.keylayout`` (2-byte key group prefix).

The code lives in ``blocking`` (``Client``), ``aio`` (``AsyncClient``), ``pipeline`` (a batch's
requests and their pipelining, sans IO), ``common`` and ``arrow``; this module names it all for
existing imports.
"""
from __future__ import annotations

from statestore_async.client.aio import AsyncClient, AsyncStoreHandle
from statestore_async.client.blocking import Client, StaleHandleError, StoreHandle
from statestore_async.client.common import DEFAULT_TIMEOUT, RequestTimeoutError

__all__ = ["DEFAULT_TIMEOUT", "AsyncClient", "AsyncStoreHandle", "Client", "RequestTimeoutError",
           "StaleHandleError", "StoreHandle"]
