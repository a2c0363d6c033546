"""Where a batch's state comes from when it is not the manifest's own: the streaming query's claim
on the state (one writer per state), a rescale's assembled partitions, an initial state loaded at
batch 0. Functions of the operator (bound as its methods).
"""
from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from statestore_async.errors import (
    OwnerConflictError,
)
from statestore_async.files.manifest import (
    INITIAL_STATE_KEY,
    Manifest,
    OwnerRecord,
    claim_owner,
    delete_manifests_after,
    read_owner,
)
from statestore_async.files.rescale import RESCALED_FROM_KEY, Recipe, plan_sources, write_recipe
from statestore_async.ids import DEFAULT_STORE_NAME, EMPTY_STATE, CheckpointRef, StoreId, new_checkpoint_id
from statestore_async.objectstore import ObjectStore
from statestore_async.spark.driver.batches import (
    find_base,
)
from statestore_async.spark.driver.materialize import (
    Materialized,
)
from statestore_async.spark.driver.plan import (
    QUERY_ID_PROPERTY,
)
from statestore_async.spark.driver.progress import BatchProgress, reports_param
from statestore_async.spark.shared.routing import with_routing
from statestore_async.spark.task.partition import run_initial_state

if TYPE_CHECKING:

    from statestore_async.spark.driver.operator import StatefulOperator

log = logging.getLogger(__name__)


def rescale(op: StatefulOperator, base: Manifest) -> tuple[Manifest, tuple[int, int]]:
    """The state of manifest ``base`` (written with another number of partitions) at this
    operator's: for each new partition, a state R (version: the newest of the old states'; a fresh
    checkpoint id) whose recipe names the key-group ranges it owns in the old partitions' states
    (``files.rescale``; written now). The daemon that opens R first in the batch assembles it
    from those ranges of the old files and writes its snapshot; the fence checks the snapshots.
    Like the initial state, the R's are in no manifest of their own: a replay of the batch
    rescales again, under new checkpoint ids. Returns the manifest the batch starts from (its
    metadata says where it came from) and ``TaskSpec.rescaled``."""
    old = tuple(base.ref(p) for p in range(base.num_partitions))
    version = max(base.version, *(r.version for r in old))
    plans = plan_sources(old, op.num_partitions, op.num_key_groups)
    refs = [CheckpointRef(version, new_checkpoint_id()) if sources else EMPTY_STATE for sources in plans]
    recipes = [(StoreId(op.root, op.operator_id, p), ref,
                Recipe(p, op.num_partitions, op.num_key_groups, base.num_partitions, base.version, sources))
               for p, (ref, sources) in enumerate(zip(refs, plans)) if sources]

    async def write(store: ObjectStore) -> None:
        await asyncio.gather(*(write_recipe(store, sid, ref, recipe) for sid, ref, recipe in recipes))

    op._run(write)
    log.warning("operator %s: rescaling from %d to %d partitions at version %d (%d key groups); each new "
                "partition's state is assembled from the old partitions' files when first opened",
                op.operator_id, base.num_partitions, op.num_partitions, base.version, op.num_key_groups)
    metadata = dict(base.metadata)
    metadata[RESCALED_FROM_KEY] = {"version": base.version, "num_partitions": base.num_partitions,
                                   "stores": [[r.version, r.ckptid] for r in old]}
    return (Manifest(op.operator_id, base.version, op.num_partitions, op.num_key_groups,
                     {DEFAULT_STORE_NAME: tuple(refs)}, metadata=metadata),
            (base.num_partitions, version))


def load_initial_state(op: StatefulOperator, empty: Manifest, batch_id: int) -> tuple[Manifest, Materialized]:
    """Before the first batch: ``initial_state``'s rows, routed like a batch's, through
    ``task.partition.run_initial_state`` (``handle_initial_state`` per key; nothing fires or expires)
    in a job of its own, its deltas fenced; returns the state batch 0 starts from (in no
    manifest: a replay of batch 0 loads the initial state again, under new checkpoint ids) and
    the calls' output, materialized (it joins batch 0's output; the caller releases it)."""
    df = op.initial_state
    assert df is not None
    values = tuple(c for c in df.columns if c not in op.key_columns)
    routed = with_routing(df, list(op.key_columns), op.num_partitions, op.num_key_groups,
                          columns=[*op.key_columns, *values])
    spec = op._task_spec(batch_id, empty, values, df.sparkSession)
    acc = df.sparkSession.sparkContext.accumulator([], reports_param())
    output = op._materialize(routed.mapInArrow(op._task_fn(spec, acc, run_initial_state), op.output_schema),
                               df.sparkSession, batch_id)
    try:
        prog = BatchProgress()
        refs = op._collect_reports(acc.value, prog)
        op._fence(refs, locations=prog.locations)
    except BaseException:
        output.release()
        raise
    log.info("operator %s: initial state loaded into %d partitions", op.operator_id, len(refs))
    return Manifest(op.operator_id, 0, op.num_partitions, op.num_key_groups,
                    {DEFAULT_STORE_NAME: tuple(refs.get(p, empty.ref(p)) for p in range(op.num_partitions))},
                    metadata={INITIAL_STATE_KEY: True}), output


def claim(op: StatefulOperator, query_id: str | None, batch_id: int) -> OwnerRecord | None:
    """One writer per state: ``OwnerConflictError`` unless the streaming query ``query_id`` owns
    the operator's state, claiming it when nobody does (or taking it over, see ``takeover``; a
    takeover then deletes the manifests after ``batch_id`` that the old owner wrote). Later
    batches of this operator only look for a newer owner record (one GET). Outside a streaming
    query (``query_id`` None) a batch may run only on a state that no query owns, and claims
    nothing. Returns the claim (None outside a query)."""
    oid, root, takeover = op.operator_id, op.root, op.takeover
    known = op._owner if op._owner is not None and op._owner.owner == query_id else None

    async def claim(store: ObjectStore) -> OwnerRecord | None:
        if query_id is None:
            current = await read_owner(store, oid)
            if current is not None:
                raise OwnerConflictError(
                    f"operator {oid!r} at {root} is owned by streaming query {current.owner} (epoch "
                    f"{current.epoch}); a batch run outside any streaming query (no {QUERY_ID_PROPERTY} "
                    "on this thread) may not write a query's state")
            return None
        if known is not None:
            current = await read_owner(store, oid, known)
            if current is not None and current.epoch != known.epoch:
                raise OwnerConflictError(
                    f"operator {oid!r} at {root} was taken over by {current.owner!r} (epoch {current.epoch}) "
                    f"while query {query_id} ran it: this query stops before batch {batch_id} writes anything")
            return known
        try:
            record = await claim_owner(store, oid, query_id, takeover=takeover, from_version=batch_id)
        except OwnerConflictError:
            current = await read_owner(store, oid)
            owner, epoch = (current.owner, current.epoch) if current is not None else ("?", "?")
            raise OwnerConflictError(
                f"operator {oid!r} at {root} belongs to streaming query {owner} (owner epoch {epoch}), not to "
                f"this query ({query_id}): one writer per state, so this query is refused before its batch "
                f"{batch_id} writes anything"
                + (f" (takeover={takeover!r} does not name the owner)" if isinstance(takeover, str) else "")
                + f". Restarting query {owner} (from its checkpoint location) continues it. If that query is "
                f"dead for good, StatefulOperator(..., takeover={owner!r}) hands the state to this query, which "
                f"continues from the state of its batch {batch_id} (see docs/SPARK.md)") from None
        if record.previous is not None:
            # a takeover, now or by an earlier run of this query: the old owner's later manifests
            # go (again, if a crash came between the claim and their deletion)
            base = await find_base(store, oid, batch_id) if batch_id > 0 else None
            dropped = await delete_manifests_after(store, oid, base.version if base is not None else 0)
            if dropped:
                log.warning("operator %s: query %s took over from %s at batch %d; deleted manifests %s of the "
                            "old owner", oid, query_id, record.previous, batch_id, dropped)
        return record

    record = op._run(claim)
    if record is not None and record is not known:
        log.info("operator %s at %s: owned by query %s (epoch %d)", oid, root, record.owner, record.epoch)
    op._owner = record if record is not None else op._owner
    return record


def owner(op: StatefulOperator) -> OwnerRecord | None:
    """The record of the streaming query that owns the operator's state now (None: none does)."""
    oid = op.operator_id

    async def read(store: ObjectStore) -> OwnerRecord | None:
        return await read_owner(store, oid)

    return op._run(read)
