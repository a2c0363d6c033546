"""PySpark integration: exactly-once keyed state for Structured Streaming through ``foreachBatch``.

* ``StatefulProcessor`` (per key, plain Python values; ``ValueState``/``ListState``/``MapState``, TTL)
  and ``VectorizedProcessor`` (a whole partition as Arrow/numpy) — ``api``;
* ``StatefulOperator`` — the foreachBatch operator with the driver's fence and manifest — ``driver``;
* ``open_partition_store`` — a store per partition for mapPartitions / mapInArrow / pandas UDFs;
* ``read_state`` / ``load_state_table`` / ``load_state`` — an operator's committed state as typed
  rows (a DataFrame / a pyarrow Table) or a dict; ``read_changes`` / ``load_changes_table`` — the
  change feed between two versions; ``read_metadata`` — operators, versions, partitions, sizes
  (from ``statestore_async.state``, which needs no Spark session but for these DataFrames);
* ``placement.connect`` — this node's daemon, started on demand;
* ``one_action`` / ``write_sink`` — sinks that read a batch's output once (one Spark job per batch).

The sub-packages follow who runs the code: ``api`` (what users write against), ``shared`` (what the
driver and the tasks share: routing, placement, event time, the task spec), ``task`` (the task
runtime), ``driver`` (the operator). Spark is imported lazily: importing this package starts no JVM.
See ``docs/SPARK.md``.
"""
from statestore_async.spark.api.processors import KeyState, StatefulProcessor, StateHandle, VectorizedProcessor
from statestore_async.spark.api.sinks import OneActionSink, ReplayUnsafeSinkError, WriteSink, one_action, write_sink
from statestore_async.spark.api.variables import ListState, MapState, ValueState
from statestore_async.spark.driver.errors import DuplicateReportError, FenceTimeoutError, OperatorConfigError, OutputReadError
from statestore_async.spark.driver.operator import StatefulOperator
from statestore_async.spark.driver.progress import BatchProgress
from statestore_async.spark.shared import placement
from statestore_async.spark.shared.placement import (
    DaemonUnavailableError,
    connect,
    daemon_pid,
    start_daemon,
    stop_daemon,
)
from statestore_async.spark.shared.routing import murmur3_int, route_values, with_routing
from statestore_async.spark.task.grouping import RoutingError, group_rows, store_keys
from statestore_async.spark.task.partition import open_partition_store
from statestore_async.state.changes import load_changes_table, read_changes
from statestore_async.state.reader import decode_record, load_state, load_state_table, read_metadata, read_state

__all__ = [
    "BatchProgress",
    "DaemonUnavailableError",
    "DuplicateReportError",
    "FenceTimeoutError",
    "KeyState",
    "ListState",
    "MapState",
    "OneActionSink",
    "OperatorConfigError",
    "OutputReadError",
    "ReplayUnsafeSinkError",
    "RoutingError",
    "StateHandle",
    "StatefulOperator",
    "StatefulProcessor",
    "ValueState",
    "VectorizedProcessor",
    "WriteSink",
    "connect",
    "daemon_pid",
    "decode_record",
    "group_rows",
    "load_changes_table",
    "load_state",
    "load_state_table",
    "murmur3_int",
    "one_action",
    "open_partition_store",
    "placement",
    "read_changes",
    "read_metadata",
    "read_state",
    "route_values",
    "start_daemon",
    "stop_daemon",
    "store_keys",
    "with_routing",
    "write_sink",
]
