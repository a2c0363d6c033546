"""Sinks known to read a batch's output once, with one Spark action.

``StatefulOperator(materialize="auto")`` (the default) keeps a batch's output for the sink (a local
checkpoint, or ``persist`` on a cluster) because it cannot know how often an arbitrary sink reads
it: keeping it costs a second Spark job per batch. A sink marked here promises to read the whole
output exactly once, with one action; for it, ``"auto"`` lets the sink's action compute the stateful
stage (one job per batch, as ``materialize="none"``, with the same check: a marked sink that reads
the output twice, or only part of it, fails the batch with ``OutputReadError`` and nothing is
committed).

    sink = write_sink("parquet", "s3://bucket/out", mode="append")      # df.write...save(path)
    sink = write_sink("delta", table="db.totals", options=lambda b: {"txnAppId": "totals", "txnVersion": str(b)})

    @one_action
    def sink(df, batch_id):
        df.write.format("jdbc").options(**jdbc).mode("append").save()

Like every foreachBatch sink these run again for a replayed batch: make the write idempotent per
batch id (an ``overwrite`` of a per-batch folder, Delta's ``txnVersion``, a key in the target).
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from statestore_async.errors import InterfaceError

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

SinkFn = Callable[["DataFrame", int], object]
Options = Mapping[str, str] | Callable[[int], Mapping[str, str]]
WRITE_MODES = ("append", "overwrite", "ignore", "error", "errorifexists")


class OneActionSink:
    """A sink ``sink(df, batch_id)`` that reads ``df`` exactly once, with one action (see the module)."""

    reads_output_once = True

    def __init__(self, fn: SinkFn) -> None:
        if not callable(fn):
            raise InterfaceError(f"one_action wraps a sink function sink(df, batch_id), got {type(fn).__name__}")
        self.fn = fn
        functools.update_wrapper(self, fn)

    def __call__(self, df: DataFrame, batch_id: int) -> object:
        return self.fn(df, batch_id)

    def __repr__(self) -> str:
        return f"one_action({getattr(self.fn, '__qualname__', self.fn)!r})"


def one_action(fn: SinkFn) -> OneActionSink:
    """Mark ``fn(df, batch_id)`` as reading the whole output exactly once with one action (a write,
    one ``collect``, one ``foreachPartition``), so that ``materialize="auto"`` keeps no copy of it."""
    return fn if isinstance(fn, OneActionSink) else OneActionSink(fn)


def reads_output_once(sink: object) -> bool:
    """Whether ``sink`` is marked as reading its output once (``one_action``, ``write_sink``)."""
    return getattr(sink, "reads_output_once", False) is True


def write_sink(fmt: str, path: str | None = None, *, table: str | None = None, mode: str = "append",
               options: Options | None = None, partition_by: Sequence[str] = ()) -> OneActionSink:
    """A sink that writes each batch's output with one ``DataFrameWriter`` action:
    ``df.write.format(fmt).mode(mode).options(...).partitionBy(...)``, then ``.save(path)``,
    ``.saveAsTable(table)``, or ``.save()`` when neither is given (``noop``, ``jdbc`` with its
    options). ``options``: a mapping, or a function of the batch id returning one (for writers that
    make a batch idempotent, such as Delta's ``txnAppId``/``txnVersion``)."""
    if not isinstance(fmt, str) or not fmt:
        raise InterfaceError(f"write_sink needs a data source format name (parquet, delta, noop, ...), got {fmt!r}")
    if path is not None and table is not None:
        raise InterfaceError(f"write_sink writes to a path or to a table, not both (path={path!r}, table={table!r})")
    if mode not in WRITE_MODES:
        raise InterfaceError(f"write_sink mode must be one of {', '.join(WRITE_MODES)}, got {mode!r}")
    if options is not None and not callable(options) and not isinstance(options, Mapping):
        raise InterfaceError(f"write_sink options are a mapping or a function of the batch id, got {type(options).__name__}")
    columns = [partition_by] if isinstance(partition_by, str) else list(partition_by)

    def write(df: DataFrame, batch_id: int) -> None:
        w = df.write.format(fmt).mode(mode)
        opts = options(batch_id) if callable(options) else options
        if opts:
            w = w.options(**{str(k): str(v) for k, v in opts.items()})
        if columns:
            w = w.partitionBy(*columns)
        if table is not None:
            w.saveAsTable(table)
        elif path is not None:
            w.save(path)
        else:
            w.save()

    target = table or path
    write.__qualname__ = write.__name__ = f"write_sink[{fmt}:{target}]" if target else f"write_sink[{fmt}]"
    return OneActionSink(write)
