"""The engine: versions of a store in memory (overlays, commits, undo/redo history, frozen views). No IO, no asyncio."""
from statestore_async.engine.delta import Delta
from statestore_async.engine.store import DEFAULT_HISTORY, State, StoreVersion, VersionedStore
from statestore_async.engine.views import FrozenView

__all__ = ["DEFAULT_HISTORY", "Delta", "FrozenView", "State", "StoreVersion", "VersionedStore"]
