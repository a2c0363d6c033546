"""What the driver hands each task (``TaskSpec``, pickled into the ``mapInArrow`` function) and
what each task reports back through an accumulator (``TaskReport``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from statestore_async.ids import CheckpointRef
from statestore_async.spark.shared.hooks import Hook


@dataclass(frozen=True, kw_only=True)
class TaskSpec:
    """Everything a task needs; built by the driver (keyword arguments only) and pickled into the task closure."""

    root: str                          # the checkpoint root: file://… or s3://…
    operator_id: str
    key_columns: tuple[str, ...]
    value_columns: tuple[str, ...]     # the columns the processor gets (with pre_aggregate: the aggregates)
    output_schema: pa.Schema
    num_partitions: int
    num_key_groups: int
    batch_id: int
    refs: tuple[CheckpointRef, ...]    # per partition: the state batch ``batch_id`` reads
    now_ms: int                        # the batch's TTL clock, read once on the driver
    socket_path: str | None = None     # this node's daemon (None: $STATESTORE_SOCKET or the default)
    daemon_env: dict[str, str] | None = None  # environment of a daemon the task has to start
    hook: Hook | None = None  # the operator's installed hook (``hooks``); None: every hook point is a no-op
    releases: dict[str, tuple[int, ...]] | None = None  # coordinator: location -> partitions its daemon may drop (None: off)
    keys_unique: bool = False          # one row per key already (the JVM pre-aggregated): no grouping needed
    daemon_retries: int = 2            # tries of the partition after the first one, when the daemon is lost
    # the state variables' declarations (``api.variables.Declaration``) the stored state was written with, as the
    # manifest records them; a processor declaring one differently is refused. None: nothing recorded yet
    declared: dict[str, dict[str, Any]] | None = None
    # time (issue 19): the operator's time mode, "none" | "processing" | "event" (what a timer's kind=None
    # means), and the event-time watermark this batch uses (computed by the driver from batches < batch_id
    # and recorded in the batch's manifest, so a replay uses the same; None: none yet, no event timer is due)
    time_mode: str = "none"
    watermark_ms: int | None = None
    # the key columns' types (a VectorizedProcessor's timers of keys without rows are decoded to them;
    # None: the batch's rows' types, or inferred from the values in a batch without rows)
    key_schema: pa.Schema | None = None
    # the first batch after the partition count changed (``files.rescale``): ``(old partition count, the
    # version of the refs' assembled states)``. Every task opens its partition (loading it assembles its
    # state and writes its snapshot) and asks its daemon to drop copies of the old layout's partitions
    rescaled: tuple[int, int] | None = None
    # time_mode "event" without pre_aggregate: the event-time column in the routed rows, whose max and
    # late rows (``<= watermark_ms``) each task counts (``eventtime.split_late``) and, with ``drop_late``,
    # drops before grouping. None: the driver observed and filtered them in the JVM (or no event time)
    event_time_column: str | None = None
    drop_late: bool = True


@dataclass(frozen=True)
class TaskReport:
    """What a task that committed tells the driver through the batch's accumulator (it pickles:
    every field is a plain value or a ``CheckpointRef``)."""

    partition: int
    ref: CheckpointRef                 # the checkpoint the task committed
    attempt: int                       # Spark's attempt number of the task
    timings: dict[str, float]          # seconds per phase (group, read, process, write, total; per key: decode, call); rows, keys
    node: dict[str, Any] | None = None  # where it ran and its daemon's answer to RELEASE; None: coordinator off
    states: dict[str, dict[str, Any]] | None = None  # the processor's state declarations (the manifest records them)
