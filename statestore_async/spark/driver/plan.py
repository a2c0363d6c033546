"""What one batch reads and runs, decided on the driver before Spark runs anything (``BatchPlan``),
and the pieces a plan is made of: the output schema, the streaming query's id, the keys' schema,
an empty frame of one task per partition (a time-only batch).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from statestore_async.errors import (
    InterfaceError,
)
from statestore_async.files.manifest import (
    Manifest,
    OwnerRecord,
)
from statestore_async.spark.driver.materialize import Materialized
from statestore_async.spark.shared.routing import KG_COLUMN, ROUTE_COLUMN
from statestore_async.spark.shared.taskspec import TaskSpec

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark import Accumulator
    from pyspark.sql import DataFrame, Observation, SparkSession
    from pyspark.sql.types import StructType


Sink = Callable[["DataFrame", int], object]  # the user's sink: sink(output_df, batch_id)

log = logging.getLogger(__name__)

LAYOUT = "statestore_async.spark/1"


# the local property Spark sets on the thread that runs a streaming query's batch: the query's id
# (``query.id``), kept in its checkpoint location, so the same across restarts of the query
QUERY_ID_PROPERTY = "sql.streaming.queryId"


def arrow_schema(output_schema: str | StructType) -> tuple[StructType, pa.Schema]:
    """The output schema as a Spark ``StructType`` (parsed from DDL when a string) and as Arrow's."""
    from pyspark.sql.pandas.types import to_arrow_schema
    from pyspark.sql.types import StructType, _parse_datatype_string

    schema = _parse_datatype_string(output_schema) if isinstance(output_schema, str) else output_schema
    if not isinstance(schema, StructType):
        raise InterfaceError(f"output_schema is a StructType or a DDL string, got {schema!r}")
    return schema, to_arrow_schema(schema)


def streaming_query_id(spark: SparkSession) -> str | None:
    """The id of the streaming query whose batch runs on this thread (``query.id``: the same after a
    restart from the same checkpoint location; a query started on a new one gets a new id), None
    outside a streaming query (``process_batch`` called directly)."""
    return spark.sparkContext.getLocalProperty(QUERY_ID_PROPERTY) or None


@dataclass(frozen=True)
class BatchPlan:
    """What one batch reads and runs, decided on the driver before Spark runs anything (``_plan``)."""

    batch_id: int
    base: Manifest        # manifest ``batch_id``: the state the batch starts from
    routed: DataFrame     # the batch's rows, shuffled so that task i holds state partition i's rows (lazy)
    spec: TaskSpec        # what every task gets
    query_id: str | None = None      # the streaming query running the batch (None: outside one)
    owner: OwnerRecord | None = None  # its claim on the state (None: outside a query, the state unowned)
    # event time: the max event time (ms) of batches < batch_id, and where this batch's max event time
    # and late rows come from: the tasks' accumulator of their ``(partition, max, late)`` (``split_late``),
    # or with pre_aggregate the Observation of the JVM's input (None outside time_mode "event"); the
    # watermark is ``spec.watermark_ms``
    max_event_time_ms: int | None = None
    observation: Observation | None = None
    event_times: Accumulator | None = None
    # batch 0 of an operator with ``initial_state``: handle_initial_state's output, computed and kept
    # (it joins the batch's output); released with the batch's
    initial: Materialized | None = None
    # the key columns' Spark types in this batch's rows (recorded in the manifest for readers)
    key_types: dict[str, str] | None = None
    # a time-only batch (``batches``): no rows, the timers and TTLs due at its watermark and clock
    time_only: bool = False

    @property
    def sink_batch_id(self) -> int:
        """The batch id the sink gets: the version the batch reads (``batches``)."""
        return self.base.version


def no_rows(df: DataFrame, num_partitions: int) -> DataFrame:
    """An empty frame of ``df``'s columns and the routing's over exactly ``num_partitions``
    partitions (a range of that many slices: task i is partition i, as after the routing shuffle),
    which the optimizer cannot prove empty (a time-only batch runs one task per state partition)."""
    from pyspark.sql import functions as F

    columns = [F.lit(None).cast(f.dataType).alias(f.name) for f in df.schema.fields]
    columns += [F.lit(None).cast("int").alias(KG_COLUMN), F.lit(None).cast("int").alias(ROUTE_COLUMN)]
    return df.sparkSession.range(0, num_partitions, 1, num_partitions).where("id < 0").select(*columns)


def key_schema(df: DataFrame, key_columns: Sequence[str]) -> pa.Schema | None:
    """The key columns' Arrow types as the tasks receive them (``TaskSpec.key_schema``: the keys of
    due timers without rows decode straight to them); None when Spark cannot say."""
    from pyspark.sql.pandas.types import to_arrow_schema
    from pyspark.sql.types import StructType

    try:
        return to_arrow_schema(StructType([df.schema[c] for c in key_columns]))
    except Exception as exc:  # a type Arrow cannot carry: the tasks infer from the values
        log.debug("no Arrow schema for the key columns %s: %s", list(key_columns), exc)
        return None
