"""statestore_async: a versioned, fault-tolerant key-value state store for PySpark Structured Streaming.

One asyncio daemon per executor node serves the stores over a Unix socket; deltas and snapshots go
to an object store (S3 or a local directory) in the background. See README.md and
docs/ARCHITECTURE.md.
"""
__version__ = "0.1.0"

from statestore_async.errors import StateStoreError
from statestore_async.ids import CheckpointRef, StoreId

__all__ = ["CheckpointRef", "StateStoreError", "StoreId", "__version__"]
