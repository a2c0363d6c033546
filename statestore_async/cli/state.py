"""``statestore-async ls | show | export | diff``: seeing an operator's state from its checkpoint root.

Every command reads a ``file://`` folder (or a path) or an ``s3://`` root (S3 settings from the
daemon config / ``STATESTORE_S3_*`` and the AWS chain), needs no daemon and no Spark session, and
creates nothing but the file ``export`` is asked to write. ``--json`` prints JSON for machines
(one document, or one line per record for ``show`` and ``diff``). The logic is in ``cli.offline``.
"""
from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import click

from statestore_async.cli.tooling import Progress, open_root, run_tool
from statestore_async.errors import InterfaceError

if TYPE_CHECKING:
    import pyarrow as pa


def _key_of(values: tuple[str, ...]) -> tuple | None:
    """``--key`` values as a grouping key: each one JSON (``42``, ``"a"``, ``true``) or else text."""
    if not values:
        return None
    out: list[Any] = []
    for v in values:
        try:
            out.append(json.loads(v))
        except ValueError:
            out.append(v)
    return tuple(out)


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, default=str, separators=(", ", ": "))


def _json_out(doc: Any) -> None:
    click.echo(json.dumps(doc, default=str, sort_keys=False))


def _rows_out(table: pa.Table, as_json: bool) -> None:
    from statestore_async.cli.offline import json_line

    for row in table.to_pylist():
        if as_json:
            click.echo(json_line(row), nl=False)
        else:
            click.echo("  " + " ".join(f"{k}={_text(v)}" for k, v in row.items() if v is not None))


@click.command("ls")
@click.argument("root")
@click.option("--operator", "operator_id", default=None, help="one operator (default: every operator under ROOT)")
@click.option("--version", type=int, default=None, help="the manifest version to describe (default: the latest)")
@click.option("--json", "as_json", is_flag=True, help="print JSON")
def ls(root: str, operator_id: str | None, version: int | None, as_json: bool) -> None:
    """List operators → versions → partitions (key groups, records, bytes), orphaned attempts marked.

    A partition's records are its store's records at that version (timers and the TTL index
    included); state bytes are the files its load reads, bytes every file of its folder. An
    orphaned file is one no manifest needs (``gc`` deletes it); a pending one is newer than every
    manifest (a batch in flight, or one that failed before its manifest)."""
    from statestore_async.cli.offline import ls_root

    async def go():
        async with open_root(root) as objstore:
            return await ls_root(objstore, root, operator_id, version)

    ops = run_tool(go)
    if as_json:
        _json_out([op.to_json() for op in ops])
        return
    if not ops:
        click.echo(f"no operator under {root}")
    for op in ops:
        states = ", ".join(f"{n} ({d.get('kind')}{', ttl' if d.get('ttl') else ''})" for n, d in sorted(op.states.items()))
        click.echo(f"{op.operator_id}: versions {op.versions[0]}..{op.versions[-1]} ({len(op.versions)}), "
                   f"{op.num_partitions} partitions, {op.num_key_groups} key groups"
                   + (f", keys {op.key_columns}" if op.key_columns else "") + (f", owner {op.owner}" if op.owner else ""))
        if states:
            click.echo(f"  state variables: {states}")
        click.echo(f"  version {op.version}:")
        for p in op.partitions:
            click.echo(f"    partition {p.partition} (key groups {p.key_groups.start}..{p.key_groups.stop - 1}): "
                       f"{p.ref}, {p.records} records, {p.state_bytes} bytes in {p.state_files} files "
                       f"(folder: {p.files} files, {p.bytes} bytes)")
            for k in p.orphaned:
                click.echo(f"      orphaned {k}")
            for k in p.pending:
                click.echo(f"      pending  {k}")


def _common(fn):
    for opt in reversed([
        click.argument("root"),
        click.option("--operator", "operator_id", required=True, help="operator id"),
        click.option("--version", type=int, default=None, help="manifest version (default: the latest)"),
        click.option("--state-var", default=None, help="only this state variable"),
        click.option("--partition", type=int, default=None, help="only this partition"),
        click.option("--now-ms", type=int, default=None,
                     help="hide what is expired at this time (ms since the epoch; default: now)"),
        click.option("--include-expired", is_flag=True, help="show every stored value, expired or not"),
    ]):
        fn = opt(fn)
    return fn


@click.command("show")
@_common
@click.option("--key", "key", multiple=True,
              help="only this grouping key: one --key per key column, each JSON (42, \"a\") or text")
@click.option("--limit", type=int, default=20, show_default=True, help="at most this many rows (0: all)")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object per row")
def show(root: str, operator_id: str, version: int | None, state_var: str | None, partition: int | None,
         now_ms: int | None, include_expired: bool, key: tuple[str, ...], limit: int, as_json: bool) -> None:
    """Show the state rows of a version: the key columns and each state variable, decoded."""
    from statestore_async.cli.offline import show_rows

    async def go() -> pa.Table:
        async with open_root(root) as objstore:
            return await show_rows(objstore, root, operator_id, version, partition=partition, key=_key_of(key),
                                   state_var=state_var, limit=limit or None, now_ms=now_ms,
                                   include_expired=include_expired)

    table = run_tool(go)
    _rows_out(table, as_json)
    if not as_json:
        click.echo(f"{table.num_rows} rows" + (f" (--limit {limit})" if limit and table.num_rows == limit else ""))


@click.command("export")
@_common
@click.option("--out", "path", required=True, type=click.Path(dir_okay=False), help="the file to write (must not exist)")
@click.option("--format", "fmt", type=click.Choice(["parquet", "jsonl"]), default=None,
              help="default: from the file's extension (.jsonl / .json: JSON lines, else Parquet)")
@click.option("--json", "as_json", is_flag=True, help="print the summary as JSON")
def export(root: str, operator_id: str, version: int | None, state_var: str | None, partition: int | None,
           now_ms: int | None, include_expired: bool, path: str, fmt: str | None, as_json: bool) -> None:
    """Export the state rows of a version to a Parquet or JSON-lines file."""
    from statestore_async.cli.offline import ExportReport, export_state

    fmt = fmt or ("jsonl" if path.endswith((".jsonl", ".json")) else "parquet")

    async def go() -> ExportReport:
        with Progress() as progress:
            async with open_root(root) as objstore:
                return await export_state(objstore, root, operator_id, path, fmt=fmt, version=version,
                                          state_var=state_var, partition=partition, now_ms=now_ms,
                                          include_expired=include_expired, progress=progress)

    r = run_tool(go)
    if as_json:
        _json_out({"path": r.path, "format": r.format, "version": r.version, "rows": r.rows,
                   "partitions": r.partitions, "bytes": r.bytes, "seconds": round(r.seconds, 3),
                   "rows_per_second": round(r.rows_per_second)})
        return
    click.echo(f"wrote {r.rows} rows of version {r.version} ({r.partitions} partitions) to {r.path} "
               f"({r.format}, {r.bytes} bytes) in {r.seconds:.2f}s: {r.rows_per_second:,.0f} rows/s")


@click.command("diff")
@click.argument("root")
@click.option("--operator", "operator_id", required=True, help="operator id")
@click.option("--from", "start_version", type=int, required=True, help="the older version (0: the empty state)")
@click.option("--to", "end_version", type=int, default=None, help="the newer version (default: the latest)")
@click.option("--state-var", default=None, help="only this state variable (its values typed; several: JSON)")
@click.option("--partition", type=int, default=None, help="only this partition")
@click.option("--no-old-values", is_flag=True, help="read only the deltas: no old values, changes are update / delete")
@click.option("--limit", type=int, default=0, show_default=True, help="at most this many changes (0: all)")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object per change")
def diff(root: str, operator_id: str, start_version: int, end_version: int | None, state_var: str | None,
         partition: int | None, no_old_values: bool, limit: int, as_json: bool) -> None:
    """The change feed between two versions: per change its key, state, type, old and new value, version."""
    from statestore_async.cli.offline import diff_versions

    if limit < 0:
        raise click.UsageError(str(InterfaceError(f"--limit is a number of changes >= 0, got {limit}")))

    async def go() -> pa.Table:
        async with open_root(root) as objstore:
            return await diff_versions(objstore, root, operator_id, start_version, end_version, state_var=state_var,
                                       partition=partition, old_values=not no_old_values, limit=limit or None)

    table = run_tool(go)
    if as_json:
        _rows_out(table, True)
        return
    fixed = {"partition", "key_group", "state", "change_type", "old_value", "new_value", "version",
             "old_expires_ms", "new_expires_ms"}
    for row in table.to_pylist():
        key = ", ".join(f"{k}={_text(v)}" for k, v in row.items() if k not in fixed)
        old = "" if row["old_value"] is None else _text(row["old_value"])
        new = "" if row["new_value"] is None else _text(row["new_value"])
        arrow = {"insert": f"+ {new}", "delete": f"- {old}" if old else "-", "update": f"{old} -> {new}" if old else new}
        click.echo(f"  v{row['version']} p{row['partition']} {row['change_type']:<6} {row['state']} [{key}]: "
                   f"{arrow[row['change_type']]}")
    click.echo(f"{table.num_rows} changes")


COMMANDS = (ls, show, export, diff)

__all__ = ["COMMANDS", "diff", "export", "ls", "show"]
