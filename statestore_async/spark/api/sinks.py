"""Sinks for a batch's output: exactly-once across replays, and read with one Spark action.

Spark replays a micro-batch whose end it did not record (a driver killed after the sink ran and
before the batch was committed): the operator then computes the same output again from the same
state and calls the sink again with the same batch id. ``write_sink`` makes that second call
replace the first instead of adding to it, for every target it accepts:

* a **file format** (parquet, json, csv, orc, text, avro, xml) with a path: each batch's output goes
  to its own folder ``<path>/<batch_column>=<batch id>/`` (default ``batch_id=<id>``), written with
  ``mode("overwrite")``: a replay replaces the folder. ``spark.read.parquet(path)`` finds every batch,
  with the batch id as a partition column. ``mode="overwrite"`` instead replaces the whole path with
  each batch (the path holds the last batch's output);
* **Delta** (a path or a table): Delta's idempotent writes, ``txnAppId`` (this operator's state, or
  ``app_id``) and ``txnVersion`` (the batch id): Delta skips a batch version it has already written;
* ``noop``, ``console`` and ``memory``, which keep nothing a replay could double.

Anything else (``saveAsTable`` in a file format, ``jdbc``, ``kafka``, Iceberg, modes ``ignore`` and
``error``) cannot be replayed safely by a plain ``DataFrameWriter`` call, and ``write_sink`` refuses
it with ``ReplayUnsafeSinkError``: write that sink yourself, idempotent per batch id (an upsert by
key, a delete of the batch's rows before the insert, ``writeTo(table).overwrite(batch_col == id)``),
and mark it ``@one_action``; or pass ``at_least_once=True`` to accept duplicates after a replay.

Reading once: ``StatefulOperator(materialize="auto")`` (the default) keeps a batch's output for the
sink (a local checkpoint, or ``persist`` on a cluster) because it cannot know how often an arbitrary
sink reads it: keeping it costs a second Spark job per batch. A sink marked here (``write_sink``,
``one_action``) promises to read the whole output exactly once, with one action; for it, ``"auto"``
lets the sink's action compute the stateful stage (one job per batch, as ``materialize="none"``,
with the same check: a marked sink that reads the output twice, or only part of it, fails the batch
with ``OutputReadError`` and nothing is committed).

    sink = write_sink("parquet", "s3://bucket/out")                     # <out>/batch_id=<id>/
    sink = write_sink("delta", table="db.totals")                       # txnAppId / txnVersion

    @one_action
    def sink(df, batch_id):                                             # yours: idempotent per batch_id
        df.write.format("jdbc").options(**jdbc).mode("append").save()

A plain sink function (unmarked) is the user's to make idempotent per batch id (docs/GUARANTEES.md).
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from statestore_async.errors import InterfaceError

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

SinkFn = Callable[["DataFrame", int], object]
Options = Mapping[str, str] | Callable[[int], Mapping[str, str]]
WRITE_MODES = ("append", "overwrite", "ignore", "error", "errorifexists")
#: formats whose output is files under a path: one folder per batch, replaced on a replay
FILE_FORMATS = frozenset({"parquet", "json", "csv", "orc", "text", "avro", "xml"})
#: formats that keep nothing a replay could double
KEEP_NOTHING_FORMATS = frozenset({"noop", "console", "memory"})
DELTA_FORMAT = "delta"
DEFAULT_BATCH_COLUMN = "batch_id"


class ReplayUnsafeSinkError(InterfaceError):
    """``write_sink`` was asked for a write that a replayed batch would double or fail on."""


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


def for_writer(sink: SinkFn, writer_id: str) -> SinkFn:
    """``sink``, told who writes through it (the operator's state, ``<root>/<operator id>``): a
    ``write_sink`` to Delta without ``app_id`` uses it as ``txnAppId``. Other sinks unchanged."""
    return sink.for_writer(writer_id) if isinstance(sink, WriteSink) else sink


@dataclass(frozen=True)
class WriteSink:
    """One ``DataFrameWriter`` action per batch, idempotent per batch id (see the module); made by
    ``write_sink``, which checks its fields."""

    fmt: str
    path: str | None
    table: str | None
    mode: str
    options: Options | None
    partition_by: tuple[str, ...]
    batch_column: str
    app_id: str | None
    at_least_once: bool

    reads_output_once = True

    @property
    def layout(self) -> str:
        """How a batch is written: ``"batch_folder"`` (``<path>/<batch_column>=<id>/``, replaced),
        ``"replace_path"`` (the whole path replaced), ``"delta_txn"``, ``"as_given"``."""
        if self.fmt in FILE_FORMATS and self.path is not None and self.table is None:
            return "batch_folder" if self.mode == "append" else "replace_path"
        if self.fmt == DELTA_FORMAT:
            return "delta_txn"
        return "as_given"

    def for_writer(self, writer_id: str) -> WriteSink:
        """This sink with ``app_id`` defaulted to ``writer_id`` (Delta's ``txnAppId``)."""
        return self if self.app_id is not None else replace(self, app_id=writer_id)

    def target(self, batch_id: int) -> str | None:
        """Where batch ``batch_id`` goes: its folder, the path, or the table."""
        if self.layout == "batch_folder":
            assert self.path is not None  # batch_folder: a path, checked by write_sink
            return f"{self.path.rstrip('/')}/{self.batch_column}={int(batch_id)}"
        return self.table or self.path

    def writer_options(self, batch_id: int) -> dict[str, str]:
        """The writer's options for batch ``batch_id``: the user's, and Delta's transaction pair."""
        opts = self.options(batch_id) if callable(self.options) else (self.options or {})
        out = {str(k): str(v) for k, v in opts.items()}
        if self.layout == "delta_txn" and not self.at_least_once:
            if self.app_id is None:
                raise InterfaceError(
                    "write_sink to delta needs a transaction app id: pass app_id=..., or let the operator call "
                    "the sink (StatefulOperator.foreach_batch gives it the operator's state as the id)")
            out.setdefault("txnAppId", self.app_id)
            out.setdefault("txnVersion", str(int(batch_id)))
        return out

    def __call__(self, df: DataFrame, batch_id: int) -> None:
        layout = self.layout
        w = df.write.format(self.fmt).mode("overwrite" if layout == "batch_folder" else self.mode)
        opts = self.writer_options(batch_id)
        if opts:
            w = w.options(**opts)
        if self.partition_by:
            w = w.partitionBy(*self.partition_by)
        target = self.target(batch_id)
        if self.table is not None:
            w.saveAsTable(self.table)
        elif target is not None:
            w.save(target)
        else:
            w.save()

    def __repr__(self) -> str:
        target = self.table or self.path
        return f"write_sink[{self.fmt}:{target}]" if target else f"write_sink[{self.fmt}]"


def write_sink(fmt: str, path: str | None = None, *, table: str | None = None, mode: str = "append",
               options: Options | None = None, partition_by: Sequence[str] | str = (),
               batch_column: str = DEFAULT_BATCH_COLUMN, app_id: str | None = None,
               at_least_once: bool = False) -> WriteSink:
    """A sink that writes each batch's output with one ``DataFrameWriter`` action, so that a
    replayed batch replaces what its first run wrote (see the module for each format):
    ``df.write.format(fmt).mode(...).options(...).partitionBy(...)``, then ``.save(<path>/<batch_column>=<id>)``
    for a file format (``mode="append"``, the default), ``.save(path)``, ``.saveAsTable(table)``,
    or ``.save()`` when neither is given (``noop``). ``options``: a mapping, or a function of the
    batch id returning one. Delta gets ``txnAppId`` (``app_id``, default: the operator's state) and
    ``txnVersion`` (the batch id). ``ReplayUnsafeSinkError`` for a target a replay would double or
    fail on, unless ``at_least_once=True`` (the write is then made as given, duplicates accepted)."""
    if not isinstance(fmt, str) or not fmt:
        raise InterfaceError(f"write_sink needs a data source format name (parquet, delta, noop, ...), got {fmt!r}")
    if path is not None and table is not None:
        raise InterfaceError(f"write_sink writes to a path or to a table, not both (path={path!r}, table={table!r})")
    if mode not in WRITE_MODES:
        raise InterfaceError(f"write_sink mode must be one of {', '.join(WRITE_MODES)}, got {mode!r}")
    if options is not None and not callable(options) and not isinstance(options, Mapping):
        raise InterfaceError(f"write_sink options are a mapping or a function of the batch id, got {type(options).__name__}")
    if not isinstance(batch_column, str) or not batch_column or "=" in batch_column or "/" in batch_column:
        raise InterfaceError(f"write_sink batch_column is a column name (no '=' or '/'), got {batch_column!r}")
    columns = (partition_by,) if isinstance(partition_by, str) else tuple(partition_by)
    if batch_column in columns:
        raise InterfaceError(f"write_sink partition_by {list(columns)} names batch_column {batch_column!r}, which "
                             "write_sink adds itself (each batch's folder)")
    name = fmt.lower()
    if not at_least_once:
        _check_replay_safe(name, path, table, mode)
    return WriteSink(name, path, table, mode, options, columns, batch_column, app_id, bool(at_least_once))


def _check_replay_safe(fmt: str, path: str | None, table: str | None, mode: str) -> None:
    """``ReplayUnsafeSinkError`` unless a replayed batch written this way replaces its first write."""
    what = f"write_sink({fmt!r}, {'table=' + repr(table) if table else repr(path)}, mode={mode!r})"
    if mode in ("ignore", "error", "errorifexists"):
        raise ReplayUnsafeSinkError(
            f"{what}: a replayed batch (Spark runs a batch again when the driver died before recording it) "
            + ("would keep whatever its first, maybe partial, write left (ignore)" if mode == "ignore"
               else "would fail on what its first write left, and fail the query on every restart")
            + ". Use mode='append' (each batch in its own folder, replaced on a replay) or 'overwrite'")
    if fmt in KEEP_NOTHING_FORMATS:
        return
    if fmt == DELTA_FORMAT:
        return  # txnAppId / txnVersion, whatever the mode
    if fmt in FILE_FORMATS:
        if table is not None:
            raise ReplayUnsafeSinkError(
                f"{what}: a replayed batch would be appended to the table a second time (saveAsTable has no "
                "per-batch replace). Write to a path (each batch in its own folder, replaced on a replay), use "
                "format 'delta', or write your own idempotent sink and mark it @one_action")
        if path is None:
            raise InterfaceError(f"{what}: a {fmt} sink needs a path")
        return
    raise ReplayUnsafeSinkError(
        f"{what}: write_sink cannot make a {fmt} write replace itself when Spark replays a batch, so a replay "
        "would write the batch twice. Write your own sink that is idempotent per batch id (an upsert by key, a "
        "delete of the batch's rows before the insert, writeTo(table).overwrite(batch_col == batch_id) for "
        "Iceberg) and mark it @one_action, or pass at_least_once=True to accept duplicates after a replay")
