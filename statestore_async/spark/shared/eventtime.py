"""Event time: the operator's time settings, the watermark of a batch (on the driver), late rows
(counted and dropped by the tasks), and the heartbeat that makes Spark call ``foreachBatch`` when no data arrives.

The watermark follows Spark's ``withWatermark``: batch ``b`` uses

    W(b) = max(W(b-1), max event time of batches < b  -  watermark_delay)

(never decreasing; None until a first event time was seen). The driver computes it before the
batch runs, from manifest ``b`` (written by batch ``b-1``), whose metadata holds ``W(b-1)`` and the
max event time of batches ``< b``; batch ``b`` records ``W(b)`` and the max over batches ``<= b``
in manifest ``b+1``. A replay of ``b`` reads the same manifest ``b``: the same watermark.

A row is late when its event time is ``<= W(b)`` (Spark's predicate); a null event time is never
late (Spark keeps such rows too). The batch's max event time and its late rows are counted by the
stateful stage's tasks on the rows they receive (``split_late``: Arrow compute over the partition's
rows, before they are grouped), which with ``late_rows="drop"`` drop the late rows there, before any
state is read; each task adds its partition's figures to an accumulator (``tasks_event_time``
keeps one per partition). In the JVM (one ``Observation`` on the batch's input and a filter before
the routing shuffle, ``observe_event_time``) they cost ~50 ms per batch of ~100k rows; the tasks'
Arrow pass costs well under a millisecond. With ``pre_aggregate`` the JVM aggregates the rows before
any task sees them, so the operator observes and filters there instead.
"""
from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from statestore_async.errors import InterfaceError

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import Column, DataFrame, Observation

TIME_MODES = ("none", "processing", "event")
LATE_ROWS = ("drop", "keep")
# the marker column of the heartbeat's rows (``with_heartbeat``); the operator drops them first
HEARTBEAT_COLUMN = "__ssa_heartbeat"
# manifest metadata: the watermark a batch used, and the max event time of every batch up to it
WATERMARK_KEY = "watermark_ms"
MAX_EVENT_TIME_KEY = "max_event_time_ms"
_INTEGRAL = ("bigint", "int", "smallint", "tinyint")


@dataclass(frozen=True)
class TimeSettings:
    """An operator's time settings, checked (``time_settings``)."""

    mode: str = "none"                      # "none" | "processing" | "event"
    event_time_column: str | None = None    # mode "event": a timestamp column or integer milliseconds
    delay_ms: int = 0                       # mode "event": the watermark delay
    late_rows: str = "drop"                 # "drop" | "keep"

    @property
    def event(self) -> bool:
        return self.mode == "event"


def time_settings(time_mode: str = "none", event_time_column: str | None = None,
                  watermark_delay: timedelta | None = None, late_rows: str = "drop") -> TimeSettings:
    """The operator's time arguments, checked: ``InterfaceError`` naming the argument and the fix."""
    if time_mode not in TIME_MODES:
        raise InterfaceError(f"time_mode must be one of {', '.join(map(repr, TIME_MODES))}, got {time_mode!r}")
    if late_rows not in LATE_ROWS:
        raise InterfaceError(f"late_rows must be 'drop' or 'keep', got {late_rows!r}")
    if time_mode != "event":
        given = [n for n, v in (("event_time_column", event_time_column), ("watermark_delay", watermark_delay))
                 if v is not None]
        if given:
            raise InterfaceError(f"{' and '.join(given)} need time_mode='event' (time_mode is {time_mode!r})")
        return TimeSettings(time_mode, late_rows=late_rows)
    if not isinstance(event_time_column, str) or not event_time_column:
        raise InterfaceError("time_mode='event' needs event_time_column: the name of the input's event-time "
                             f"column (a timestamp, or integer milliseconds since the epoch), got {event_time_column!r}")
    if watermark_delay is None:
        raise InterfaceError("time_mode='event' needs watermark_delay, how late a row may be (as Spark's "
                             "withWatermark delay): e.g. watermark_delay=timedelta(minutes=10)")
    if isinstance(watermark_delay, (int, float)) and not isinstance(watermark_delay, bool):
        raise InterfaceError(f"watermark_delay={watermark_delay!r} has no unit: write "
                             f"watermark_delay=timedelta(seconds={watermark_delay!r}) (or milliseconds=...)")
    if not isinstance(watermark_delay, timedelta):
        raise InterfaceError(f"watermark_delay is a datetime.timedelta, got {type(watermark_delay).__name__} "
                             f"{watermark_delay!r}")
    if watermark_delay < timedelta(0):
        raise InterfaceError(f"watermark_delay must not be negative, got {watermark_delay}")
    return TimeSettings("event", event_time_column, round(watermark_delay / timedelta(milliseconds=1)), late_rows)


def next_watermark(previous: int | None, max_event_time: int | None, delay_ms: int) -> int | None:
    """``W(b) = max(W(b-1), max event time of batches < b - delay)``; None while no event time was
    seen and no watermark was set. Never decreases."""
    if max_event_time is None:
        return previous
    candidate = max_event_time - delay_ms
    return candidate if previous is None else max(previous, candidate)


def batch_watermark(settings: TimeSettings, base_metadata: dict[str, Any]) -> tuple[int | None, int | None]:
    """``(W(b), max event time of batches < b)`` from manifest ``b``'s metadata (batch ``b-1``'s
    record; nothing recorded: no watermark yet). ``(None, None)`` outside event time."""
    if not settings.event:
        return None, None
    seen = base_metadata.get(MAX_EVENT_TIME_KEY)
    return next_watermark(base_metadata.get(WATERMARK_KEY), seen, settings.delay_ms), seen


def event_time_kind(df: DataFrame, column: str) -> str:
    """``"timestamp"`` or ``"millis"``: how to read ``column`` of ``df``; ``InterfaceError`` when it is
    missing or of another type."""
    types = dict(df.dtypes)
    if column not in types:
        raise InterfaceError(f"event_time_column {column!r} is not in the batch's columns {df.columns}")
    t = types[column]
    if t == "timestamp":
        return "timestamp"
    if t in _INTEGRAL:
        return "millis"
    raise InterfaceError(
        f"event_time_column {column!r} is of type {t}: it must be a timestamp or integer milliseconds since the "
        f"epoch (e.g. select F.col({column!r}).cast('timestamp'), or F.unix_millis(...) for a {t})")


def _millis(df: DataFrame, column: str) -> Column:
    """The event time of each row in milliseconds since the epoch (a timestamp is truncated to the ms,
    as Spark's watermark does)."""
    from pyspark.sql import functions as F

    col = F.col(f"`{column.replace('`', '``')}`")
    return F.unix_millis(col) if event_time_kind(df, column) == "timestamp" else col.cast("bigint")


def observe_event_time(df: DataFrame, settings: TimeSettings, watermark: int | None) -> tuple[DataFrame, Observation]:
    """``df`` observed for its max event time (ms) and its number of late rows (event time ``<=
    watermark``), the late rows filtered out when ``settings.late_rows == "drop"``; and the
    ``Observation`` whose ``get`` gives ``{"max_ms", "late"}`` once the job that reads the frame ran.
    Nothing runs here."""
    from pyspark.sql import Observation
    from pyspark.sql import functions as F

    column = settings.event_time_column
    assert column is not None
    ms = _millis(df, column)
    late = ms <= F.lit(watermark) if watermark is not None else F.lit(False)
    obs = Observation(f"ssa-event-time-{uuid.uuid4().hex[:12]}")
    observed = df.observe(obs, F.max(ms).alias("max_ms"), F.count_if(F.coalesce(late, F.lit(False))).alias("late"))
    if settings.late_rows == "drop" and watermark is not None:
        observed = observed.filter(ms.isNull() | ~late)  # a null event time is not late (as in Spark)
    return observed, obs


def observed_event_time(obs: Observation | None) -> tuple[int | None, int]:
    """``(max event time in ms or None, late rows)`` of a batch whose job ran (``(None, 0)``: none)."""
    if obs is None:
        return None, 0
    got = obs.get
    top = got.get("max_ms")
    return (int(top) if top is not None else None), int(got.get("late") or 0)


_INT64_MAX = (1 << 63) - 1
_PER_MS = {"ms": 1, "us": 1_000, "ns": 1_000_000}  # an Arrow timestamp's units per millisecond


def split_late(table: pa.Table, column: str, watermark: int | None, drop: bool) -> tuple[pa.Table, int | None, int]:
    """In a task: ``(rows, max event time in ms or None, late rows)`` of a partition's ``table``,
    whose ``column`` is an Arrow timestamp (truncated to the ms, as Spark's ``unix_millis``) or
    integer milliseconds; ``rows`` is ``table`` without its late rows (event time ``<= watermark``;
    a null is never late) when ``drop``, else ``table``. No per-row conversion: the max and the
    comparison are taken in the column's own unit (flooring to ms is monotone)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    col = table.column(column)
    if pa.types.is_timestamp(col.type):
        raw, unit = col.cast(pa.int64()), col.type.unit
    else:
        raw, unit = col.cast(pa.int64()), "ms"
    top = pc.max(raw).as_py()
    if top is not None:
        top = top * 1000 if unit == "s" else top // _PER_MS[unit]
    if watermark is None or not table.num_rows:
        return table, top, 0
    # the last raw value whose ms is <= watermark
    last = watermark // 1000 if unit == "s" else watermark * _PER_MS[unit] + _PER_MS[unit] - 1
    late = pc.fill_null(pc.less_equal(raw, min(last, _INT64_MAX)), False)
    n = pc.sum(late.cast(pa.int64())).as_py() or 0
    if drop and n:
        table = table.filter(pc.invert(late))
    return table, top, n


def tasks_event_time(figures: Iterable[tuple[int, int | None, int]]) -> tuple[int | None, int]:
    """``(max event time in ms or None, late rows)`` of a batch from its tasks' ``(partition, max,
    late)`` figures (``split_late``); a partition's figures count once, whatever the number of its
    attempts that added them (every attempt of a partition reads the same rows)."""
    per: dict[int, tuple[int | None, int]] = {}
    for p, top, late in figures:
        per.setdefault(p, (top, late))
    tops = [t for t, _ in per.values() if t is not None]
    return (max(tops) if tops else None), sum(n for _, n in per.values())


def drop_heartbeat(df: DataFrame) -> DataFrame:
    """``df`` without the heartbeat's rows and marker column (``with_heartbeat``); as is without it."""
    if HEARTBEAT_COLUMN not in df.columns:
        return df
    from pyspark.sql import functions as F

    return df.filter(~F.col(HEARTBEAT_COLUMN)).drop(HEARTBEAT_COLUMN)


def with_heartbeat(events: DataFrame, rows_per_batch: int = 1) -> DataFrame:
    """The streaming DataFrame ``events`` plus a heartbeat: Spark's ``rate-micro-batch`` source,
    which has new rows at every trigger, so that Spark calls ``foreachBatch`` at every trigger even
    when ``events`` has nothing new (Spark runs no batch without new input). The operator drops the
    heartbeat's rows before anything else (they reach no processor, no state, no watermark); the
    batch still runs every state partition's task, so due timers fire. Give the query a trigger
    interval (``.trigger(processingTime="10 seconds")``): with the default trigger a source that
    always has data makes Spark run batches back to back."""
    if isinstance(rows_per_batch, bool) or not isinstance(rows_per_batch, int) or rows_per_batch < 1:
        raise InterfaceError(f"rows_per_batch must be an int >= 1, got {rows_per_batch!r}")
    if not events.isStreaming:
        raise InterfaceError("with_heartbeat takes the streaming DataFrame of the query (spark.readStream...)")
    if HEARTBEAT_COLUMN in events.columns:
        raise InterfaceError("the DataFrame already has a heartbeat (with_heartbeat was applied twice)")
    from pyspark.sql import functions as F

    beat = (events.sparkSession.readStream.format("rate-micro-batch").option("rowsPerBatch", rows_per_batch).load()
            .select(F.lit(True).alias(HEARTBEAT_COLUMN)))
    return events.withColumn(HEARTBEAT_COLUMN, F.lit(False)).unionByName(beat, allowMissingColumns=True)


__all__ = [
    "HEARTBEAT_COLUMN", "LATE_ROWS", "MAX_EVENT_TIME_KEY", "TIME_MODES", "WATERMARK_KEY", "TimeSettings",
    "batch_watermark", "drop_heartbeat", "event_time_kind", "next_watermark", "observe_event_time",
    "observed_event_time", "split_late", "tasks_event_time", "time_settings", "with_heartbeat",
]
