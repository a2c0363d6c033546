"""An operator's state as files hold it, read without a daemon and, but for ``read_state`` /
``read_changes`` / ``read_metadata`` (which return DataFrames), without Spark.

* ``keys`` — the store-key layout of timers and of the TTL expiry index, beside the state variables' keys;
* ``types`` — the types of stored values, inferred from the values, and their Arrow columns;
* ``roots`` — the checkpoint root as one URI, the S3 settings of a reader;
* ``metadata`` — what a checkpoint holds: versions, partitions, files, orphaned attempts;
* ``reader`` — the committed state as typed rows; ``changes`` — the change feed between two versions.

The Spark integration (``statestore_async.spark``) writes this layout and re-exports the readers;
the offline CLI (``statestore-async show|export|ls|gc``) reads it.
"""
