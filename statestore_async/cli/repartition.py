"""``statestore-async repartition``: rescale an operator's state offline (``files.repartition``)."""
from __future__ import annotations

import json

import click


@click.command("repartition")
@click.argument("root")
@click.option("--operator", "operator_id", required=True, help="operator id")
@click.option("--partitions", type=int, required=True, help="the new number of partitions (1..key groups)")
@click.option("--owner", default=None,
              help="the streaming query that owns the operator (it must be stopped): names it to confirm")
@click.option("--dry-run", is_flag=True, help="print the plan (bytes to read and write per new partition), write nothing")
@click.option("--json", "as_json", is_flag=True, help="print JSON")
def repartition(root: str, operator_id: str, partitions: int, owner: str | None, dry_run: bool, as_json: bool) -> None:
    """Rewrite the operator's latest version at PARTITIONS partitions, ahead of the query's restart.

    Each new partition's state is assembled from the key-group ranges it owns in the old
    partitions' files (ranged reads) and written as its snapshot; the latest manifest is then
    replaced by one at the new count (the same state). A run after a crash resumes where it
    stopped. Restart the query with num_partitions=PARTITIONS afterwards (a query restarted with
    another count without this rescales online, in its first batch)."""
    from statestore_async.cli.tooling import Progress, open_root, run_tool
    from statestore_async.files.repartition import (
        PartitionPlan,
        RepartitionPlan,
        RepartitionReport,
        plan_repartition,
    )
    from statestore_async.files.repartition import repartition as run

    if dry_run:
        async def plan() -> RepartitionPlan:
            async with open_root(root) as objstore:
                return await plan_repartition(objstore, root, operator_id, partitions, owner=owner)

        p = run_tool(plan)
        if as_json:
            click.echo(json.dumps({**p.to_json(), "dry_run": True}))
            return
        if p.already:
            click.echo(f"operator {operator_id} version {p.version} has {partitions} partitions already: nothing to do")
            return
        click.echo(f"operator {operator_id} version {p.version}: {p.from_partitions} -> {p.to_partitions} partitions "
                   f"({p.num_key_groups} key groups)")
        for pp in p.partitions:
            src = ", ".join(f"p{s.partition}[{s.first_kg}..{s.last_kg}]" for s in pp.sources) or "nothing"
            state = " (done by an earlier run)" if pp.done else ""
            click.echo(f"  partition {pp.partition}: read ~{pp.bytes_to_read} bytes, write ~{pp.bytes_to_read} bytes "
                       f"from {src}{state}")
        click.echo(f"total: read ~{sum(pp.bytes_to_read for pp in p.partitions)} bytes")
        return

    with Progress() as bar:
        done = [0]

        def progress(pp: PartitionPlan, read: int) -> None:
            done[0] += 1
            bar("partitions", done[0], partitions)

        async def go() -> RepartitionReport:
            async with open_root(root) as objstore:
                return await run(objstore, root, operator_id, partitions, owner=owner, progress=progress)

        r = run_tool(go)
    if as_json:
        click.echo(json.dumps(r.to_json()))
        return
    p = r.plan
    if p.already:
        click.echo(f"operator {operator_id} version {p.version} has {partitions} partitions already: nothing to do")
        return
    click.echo(f"operator {operator_id} version {p.version}: {p.from_partitions} -> {p.to_partitions} partitions; "
               f"read {r.bytes_read} bytes, wrote {r.bytes_written} bytes"
               + (f"; partitions {r.skipped} were done by an earlier run" if r.skipped else ""))
