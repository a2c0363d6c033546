"""Rescaling: a partition's first state at a new partition count, made of key-group ranges.

Partition p of N owns the key groups ``kg`` with ``kg * N // G == p``, a contiguous range
(``keylayout.partition_key_groups``); every record's key starts with its key group, and checkpoint
files hold records in key order with a footer naming each block's key groups. So when N changes
(G does not), the first state R of each new partition is the records of its key groups in the old
partitions' states — nothing else is read, nothing job-wide is rewritten:

* ``plan_sources`` says which key-group ranges of which old partitions make each new partition;
  the driver (or ``repartition`` offline) writes each one as R's **recipe**, the small file
  ``<version>_<ckptid>.rescale`` in the new partition's folder (``write_recipe``);
* whoever loads R first (``loader.load_store``: a daemon serving the first rescaled batch, or the
  offline tool) finds no snapshot and no delta of R but its recipe, reads each source state's files
  the way the loader does (snapshot, else delta and lineage) but only the blocks of the recipe's
  key groups (``read_key_groups``: ranged GETs of the header, the footer and the span of blocks
  whose key groups overlap the range), and writes R's snapshot before serving it. From then on R
  loads from its own snapshot, like any state.

Bytes read per new partition: its share of each source file, plus at each edge of its range at
most one block shared with a neighbour, plus headers and footers (files are cut into ~64 blocks,
``checkpoint.block_bytes_for``).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from statestore_async.codecs.keylayout import key_group_of, partition_key_groups
from statestore_async.errors import CorruptFileError, InterfaceError, ObjectExistsError, ObjectNotFoundError
from statestore_async.files.checkpoint import (
    TRAILER_SIZE,
    FileHeader,
    Record,
    blocks_for_key_groups,
    decode_blocks,
    header_length,
    parse_header,
    read_index,
    read_trailer,
)
from statestore_async.files.manifest import seal, unseal
from statestore_async.files.names import RESCALE, file_key
from statestore_async.files.transfer import ReadStats
from statestore_async.ids import CheckpointRef, StoreId

if TYPE_CHECKING:
    from statestore_async.objectstore.base import ObjectStore

# manifest metadata of the first batch after a rescale: {"version", "num_partitions", "stores"} of the old layout
RESCALED_FROM_KEY = "rescaled_from"
# the first GET of a file's tail: a footer of ~40 blocks fits (a bigger one takes one more GET of
# exactly the bytes missing); the header is read with the blocks when fewer bytes than
# ``_HEAD_PROBE`` lie between them
_HEAD_PROBE = 4096
_TAIL_PROBE = 4096


@dataclass(frozen=True)
class Source:
    """Key groups ``first_kg..last_kg`` (inclusive) of old partition ``partition``'s state ``ref``."""

    partition: int
    ref: CheckpointRef
    first_kg: int
    last_kg: int


@dataclass(frozen=True)
class Recipe:
    """What partition ``partition`` of ``num_partitions``'s first state is made of: ``sources``, the
    key groups it owns in the states of the old layout (``from_partitions`` partitions, as manifest
    ``from_version`` named them)."""

    partition: int
    num_partitions: int
    num_key_groups: int
    from_partitions: int
    from_version: int
    sources: tuple[Source, ...]

    def to_bytes(self) -> bytes:
        body: dict[str, Any] = {
            "format": 1, "partition": self.partition, "num_partitions": self.num_partitions,
            "num_key_groups": self.num_key_groups, "from_partitions": self.from_partitions,
            "from_version": self.from_version,
            "sources": [[s.partition, s.ref.version, s.ref.ckptid, s.first_kg, s.last_kg] for s in self.sources],
        }
        return seal("rescale", body)

    @classmethod
    def from_bytes(cls, data: bytes, name: str) -> Recipe:
        try:
            b = unseal(data, name, "rescale", "rescale recipe")
            return cls(int(b["partition"]), int(b["num_partitions"]), int(b["num_key_groups"]),
                       int(b["from_partitions"]), int(b["from_version"]),
                       tuple(Source(int(p), CheckpointRef(int(v), str(c)), int(lo), int(hi))
                             for p, v, c, lo, hi in b["sources"]))
        except CorruptFileError:
            raise
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptFileError(name, f"not a rescale recipe: {exc}") from None


def plan_sources(old_refs: Sequence[CheckpointRef], new_partitions: int, num_key_groups: int) -> list[tuple[Source, ...]]:
    """For each partition of the new layout, the key-group ranges it takes from the states
    ``old_refs`` (one per old partition); old partitions with the empty state give nothing."""
    old_n = len(old_refs)
    if not 1 <= new_partitions <= num_key_groups or not 1 <= old_n <= num_key_groups:
        raise InterfaceError(f"partition counts must be in [1, {num_key_groups}] (the key groups), "
                             f"got {old_n} -> {new_partitions}")
    plans = []
    for p in range(new_partitions):
        mine = partition_key_groups(p, new_partitions, num_key_groups)
        sources = []
        for q, ref in enumerate(old_refs):
            theirs = partition_key_groups(q, old_n, num_key_groups)
            lo, hi = max(mine.start, theirs.start), min(mine.stop, theirs.stop)
            if lo < hi and not ref.is_empty_state:
                sources.append(Source(q, ref, lo, hi - 1))
        plans.append(tuple(sources))
    return plans


async def write_recipe(objstore: ObjectStore, store_id: StoreId, ref: CheckpointRef, recipe: Recipe) -> None:
    """Create ``ref``'s recipe in ``store_id``'s folder (once: the same bytes there already are fine)."""
    key = file_key(store_id, ref, RESCALE)
    data = recipe.to_bytes()
    try:
        await objstore.put_if_absent(key, data)
    except ObjectExistsError:
        if bytes(await objstore.get(key)) != data:
            raise InterfaceError(f"{key} exists with another recipe: a checkpoint id was used twice") from None


async def read_recipe(objstore: ObjectStore, store_id: StoreId, ref: CheckpointRef) -> Recipe | None:
    """``ref``'s recipe, checked (``CorruptFileError``), or None when it has none."""
    key = file_key(store_id, ref, RESCALE)
    try:
        data = await objstore.get(key)
    except ObjectNotFoundError:
        return None
    recipe = Recipe.from_bytes(data, key)
    if recipe.partition != store_id.partition_id:
        raise CorruptFileError(key, f"the recipe is for partition {recipe.partition}, found in {store_id}")
    return recipe


async def read_key_groups(objstore: ObjectStore, store_id: StoreId, ref: CheckpointRef, kind: str,
                          first_kg: int, last_kg: int, stats: ReadStats) -> tuple[FileHeader, list[Record]]:
    """The header of ``ref``'s ``kind`` file and its records of key groups ``first_kg..last_kg``,
    reading only its ends and the blocks that hold those key groups (ranged GETs), every part
    checked (``CorruptFileError``). ``ObjectNotFoundError`` when the file does not exist."""
    key = file_key(store_id, ref, kind)
    try:
        size = (await objstore.head(key)).size
    except ObjectNotFoundError:
        stats.missing.append(key)
        raise

    async def get(start: int, end: int) -> bytes:
        data = await objstore.get(key, start, end)
        stats.bytes_read += len(data)
        if len(data) != end - start:
            raise CorruptFileError(key, f"{len(data)} bytes read at {start}, {end - start} expected (changed file?)",
                                   start)
        return data

    # the tail first (the whole file when small): the footer says where the header ends (the first
    # block's offset) and which blocks hold the key groups; then one GET of the header and those
    # blocks (two when far apart), never re-reading bytes the tail already holds
    tail_at = max(0, size - _TAIL_PROBE)
    tail = await get(tail_at, size)
    footer_at, footer_len, _ = read_trailer(tail, key)
    if footer_at + footer_len + TRAILER_SIZE != size:
        raise CorruptFileError(key, "footer and trailer do not line up", footer_at)
    if footer_at < tail_at:
        tail, tail_at = await get(footer_at, tail_at) + tail, footer_at
    footer = read_index(tail, key)
    header_end = footer.blocks[0].offset if footer.blocks else footer_at

    async def fetch(start: int, end: int) -> bytes:
        if end <= tail_at:
            return await get(start, end)
        if start >= tail_at:
            return tail[start - tail_at:end - tail_at]
        return await get(start, tail_at) + tail[:end - tail_at]

    wanted = blocks_for_key_groups(footer, first_kg, last_kg)
    span_start, span_end = (wanted[0].offset, wanted[-1].offset + wanted[-1].length) if wanted else (0, 0)
    if wanted and span_start - header_end <= _HEAD_PROBE:
        data = await fetch(0, span_end)
        head, span = data[:header_end], data[span_start:span_end]
    else:
        head = await fetch(0, header_end)
        span = await fetch(span_start, span_end) if wanted else b""
    if header_length(head, key) != header_end:
        raise CorruptFileError(key, f"the header does not end where the first block starts ({header_end})", 0)
    header = parse_header(head, key)
    if header.kind != kind or header.ref != ref or not header.matches(store_id):
        raise CorruptFileError(key, f"the file says it is the {header.kind} of {header.store} at {header.ref}, "
                               f"expected the {kind} of {store_id.to_json()} at {ref}")
    records: list[Record] = []
    for block in wanted:  # only a block reaching past the range holds records to leave out
        decoded = decode_blocks(span, key, [block], base_offset=span_start)
        if block.first_kg < first_kg or block.last_kg > last_kg:
            decoded = [r for r in decoded if first_kg <= key_group_of(r[0]) <= last_kg]
        records += decoded
    stats.files_read.append(key)
    return header, records


__all__ = ["RESCALED_FROM_KEY", "Recipe", "Source", "plan_sources", "read_key_groups", "read_recipe", "write_recipe"]
