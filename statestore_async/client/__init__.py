"""Clients of the daemon: the blocking ``Client`` (one per Python worker process) and ``AsyncClient``."""
from statestore_async.client.aio import AsyncClient
from statestore_async.client.blocking import Client

__all__ = ["AsyncClient", "Client"]
