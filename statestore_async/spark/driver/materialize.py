"""How a batch's output is computed once before the sink reads it (``materialize``): a local
checkpoint of its blocks, ``persist`` + a ``noop`` write, a parquet folder, or nothing kept (the
sink's own action runs the job); and the Arrow byte cap of the stateful stage.
"""
from __future__ import annotations

import contextlib
import logging
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.types import StructType

log = logging.getLogger(__name__)

MATERIALIZE = ("auto", "checkpoint", "cache", "none")  # how the output waits for the sink (see StatefulOperator)


@dataclass(frozen=True)
class Materialized:
    """A batch's output, computed once: the sink reads ``result``; ``release()`` frees what holds it."""

    result: DataFrame
    release: Callable[[], object]


def materialize_checkpoint(out: DataFrame) -> Materialized:
    """``localCheckpoint``: one job; the blocks hold the output's rows as computed (no columnar cache
    to build: with ~630k output rows a batch takes ~0.3 s less than with persist). Blocks lost with
    an executor are not recomputed: reading them fails the batch."""
    result = out.localCheckpoint(eager=True)
    return Materialized(result, lambda: release_checkpoint(result))


def materialize_cache(out: DataFrame) -> Materialized:
    """``persist(MEMORY_AND_DISK)`` and a ``noop`` write; lost blocks are recomputed by running the
    stateful stage again (that run's commit is in no manifest)."""
    from pyspark import StorageLevel

    out = out.persist(StorageLevel.MEMORY_AND_DISK)
    out.write.format("noop").mode("overwrite").save()
    return Materialized(out, out.unpersist)


def materialize_parquet(out: DataFrame, spark: SparkSession, folder: str, schema: StructType) -> Materialized:
    """Parquet files in ``folder`` (which must not exist), read back with ``schema``; released by
    deleting the folder when it is local (one in an object store is left)."""
    out.write.mode("errorifexists").parquet(folder)
    return Materialized(spark.read.schema(schema).parquet(folder), lambda: remove_local_folder(folder))


ARROW_MAX_BYTES_KEY = "spark.sql.execution.arrow.maxBytesPerBatch"


ARROW_BYTES_UNLIMITED = 2**31 - 1  # Spark skips its per-row size check at exactly this value


@contextlib.contextmanager
def arrow_batch_bytes(spark: SparkSession, limit: int | None) -> Iterator[None]:
    """Within: ``spark``'s ``spark.sql.execution.arrow.maxBytesPerBatch`` is ``limit``, or (None)
    the session's own value when it sets one, else ``ARROW_BYTES_UNLIMITED``; after: as before
    (unset again if it was). See ``StatefulOperator``'s ``arrow_max_bytes_per_batch``."""
    before = spark.conf.get(ARROW_MAX_BYTES_KEY, None)
    wanted = limit if limit is not None else (None if before is not None else ARROW_BYTES_UNLIMITED)
    if wanted is None:
        yield
        return
    spark.conf.set(ARROW_MAX_BYTES_KEY, str(wanted))
    try:
        yield
    finally:
        if before is None:
            spark.conf.unset(ARROW_MAX_BYTES_KEY)
        else:
            spark.conf.set(ARROW_MAX_BYTES_KEY, before)


def run_unkept(out: DataFrame) -> Materialized:
    """Run the job and keep nothing (a ``noop`` write): for a batch without a sink, whose output no
    one reads, and for a ``materialize="none"`` sink that read none of it."""
    out.write.format("noop").mode("overwrite").save()
    return Materialized(out, lambda: None)


# how the output waits for the sink, by ``StatefulOperator.materialize_mode`` (with ``output_path``: parquet)
MATERIALIZERS: dict[str, Callable[[DataFrame], Materialized]] = {
    "checkpoint": materialize_checkpoint,
    "cache": materialize_cache,
}


def release_checkpoint(df: DataFrame) -> None:
    """Drop the blocks of a locally checkpointed DataFrame now; otherwise they stay until the JVM's
    garbage collector lets Spark's cleaner find the RDD (for a streaming query: many batches' outputs)."""
    try:
        df._jdf.logicalPlan().rdd().unpersist(False)
    except Exception as exc:  # a plan that is not the checkpoint's LogicalRDD: leave it to the cleaner
        log.warning("could not release the output's checkpoint blocks now (Spark's cleaner will): %s", exc)


def remove_local_folder(folder: str) -> None:
    """Delete an output folder of ``materialize_parquet`` if it is local (``/…``, ``file:…``)."""
    if folder.startswith(("/", "file:")):
        shutil.rmtree(folder.removeprefix("file://").removeprefix("file:"), ignore_errors=True)
