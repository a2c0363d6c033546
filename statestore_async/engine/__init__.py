"""The engine: versions of a store in memory (overlays, commits, undo/redo history, frozen views). No IO, no asyncio."""
from statestore_async.engine.store import DEFAULT_HISTORY, Delta, FrozenView, State, StoreVersion, VersionedStore

__all__ = ["DEFAULT_HISTORY", "Delta", "FrozenView", "State", "StoreVersion", "VersionedStore"]
