"""What a batch reports: its timings and counts (``BatchProgress``) and the accumulator of its
tasks' ``TaskReport``s.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from statestore_async.spark.shared.taskspec import TaskReport

if TYPE_CHECKING:
    from pyspark import AccumulatorParam


def reports_param() -> AccumulatorParam[list[TaskReport]]:
    """The accumulator of a batch's ``TaskReport`` lists (the tasks add one-element lists)."""
    from pyspark.accumulators import AccumulatorParam

    class _Reports(AccumulatorParam):
        def zero(self, value: list[TaskReport]) -> list[TaskReport]:
            return []

        def addInPlace(self, a: list[TaskReport], b: list[TaskReport]) -> list[TaskReport]:
            a.extend(b)
            return a

    return _Reports()


@contextlib.contextmanager
def timed(prog: BatchProgress, name: str) -> Iterator[None]:
    """Set ``prog.<name>`` to the seconds the block took (left as it was when the block raises)."""
    t = time.perf_counter()
    yield
    setattr(prog, name, time.perf_counter() - t)


@dataclass
class BatchProgress:
    """Timings (seconds) and counts of the last batch, for logs and benchmarks."""

    batch_id: int = -1
    plan: float = 0.0      # reading the manifest and building the plan, before Spark runs anything
    compute: float = 0.0   # from the start to the output's materialization (plan included; materialize "none": to
    #                        the end of the sink, whose action runs the job, and ``sink`` is the sink's part of it)
    fence: float = 0.0
    manifest: float = 0.0
    sink: float = 0.0
    total: float = 0.0
    partitions_committed: int = 0
    reruns: int = 0        # runs of the stateful stage again after a fence timeout (a daemon lost deltas)
    refs: dict = field(default_factory=dict)
    tasks: dict = field(default_factory=dict)  # partition -> the task's timings (seconds) and counts
    # event time (time_mode "event"): the watermark the batch used (None: none yet), the max event time
    # of the batch's rows (ms; None: no row had one), and its late rows (event time <= watermark), which
    # were dropped before any state was read, or kept (``late_rows``)
    watermark_ms: int | None = None
    max_event_time_ms: int | None = None
    late_rows: int = 0
    locations: dict = field(default_factory=dict)  # partition -> where its task ran (coordinator on)
    version: int = 0       # the manifest version the batch wrote (0: none yet)
    sink_batch_id: int = -1  # the batch id its sink got (``batches``: Spark's until a time-only batch ran)
    time_only: bool = False  # a time-only batch (``batches``): no rows, only timers and TTLs
    # the time-only batch that followed this data batch (None: none ran): in the same foreachBatch
    # call (an ending trigger), or later while the stream idled
    time_only_after: BatchProgress | None = None

    def figures(self) -> dict[str, Any]:
        """The batch's figures under the names of Spark's own stateful operators' progress
        (``StreamingQueryProgress.stateOperators``) where they mean the same, summed over its tasks,
        and its time-only batch's as ``timeOnlyBatch``: rows in, state records written and removed,
        timers fired, values expired by TTL, rows dropped as late, the watermark (ms)."""
        def total(name: str) -> int:
            return int(sum(t.get(name, 0) for t in self.tasks.values()))

        out: dict[str, Any] = {
            "batchId": self.batch_id, "sinkBatchId": self.sink_batch_id, "version": self.version,
            "timeOnly": self.time_only, "numInputRows": total("rows"), "numKeys": total("keys"),
            "numRowsUpdated": total("puts"), "numRowsRemoved": total("removes"),
            "numTimersFired": total("timers_fired"), "numRowsExpiredByTTL": total("ttl_removed"),
            "numRowsDroppedByWatermark": self.late_rows, "watermarkMs": self.watermark_ms,
            "numPartitionsCommitted": self.partitions_committed, "durationMs": round(self.total * 1000, 1),
        }
        if self.time_only_after is not None:
            out["timeOnlyBatch"] = self.time_only_after.figures()
        return out
