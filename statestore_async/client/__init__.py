"""Clients of the daemon: the blocking ``Client`` (one per Python worker process) and ``AsyncClient``."""
from statestore_async.client.clients import AsyncClient, Client

__all__ = ["AsyncClient", "Client"]
