"""The operator manifest ``<operator>/_commits/<version>.json``: which checkpoint of each partition counts.

The driver writes it after every file a batch produced is present in the object store
(docs/ARCHITECTURE.md, "Spark integration", step 5; docs/GUARANTEES.md, "The promises").
A later load of partition p at that version opens exactly the (version, ckptid) it names, so files
of other attempts are ignored (and later collected). The manifest also fixes the operator's number
of partitions and key groups, which may not change silently.

File body: canonical JSON ``{"manifest": {...}, "xxh3": "<16 hex digits>"}`` where the checksum
covers the canonical JSON of ``manifest``; a damaged manifest raises ``CorruptFileError``.

One writer per state: ``<operator>/_owner/<epoch>.json`` (``OwnerRecord``, the same file form)
names who may write the operator's state (for Spark: a streaming query's id). Each epoch's file
is created once, with ``put_if_absent``: epoch 0 by the first writer (``claim_owner``; of two at
once exactly one wins), epoch e+1 by an explicit takeover from the owner of epoch e (only one taker
wins). The owner is the one of the highest epoch, found by GETs of the next epochs (no LIST). A
writer checks it owns the state before it writes anything and again before each manifest.
"""
from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import xxhash

from statestore_async.errors import (
    CorruptFileError,
    InterfaceError,
    ObjectExistsError,
    ObjectNotFoundError,
    OwnerConflictError,
    VersionNotFoundError,
)
from statestore_async.ids import DEFAULT_STORE_NAME, CheckpointRef, _check_name

if TYPE_CHECKING:
    from statestore_async.objectstore.base import ObjectStore

FORMAT_VERSION = 1
# metadata flag of an operator whose state began with an initial-state commit (before its first batch)
INITIAL_STATE_KEY = "initial_state"
COMMITS_DIR = "_commits"
OWNER_DIR = "_owner"
_NAME_RE = re.compile(r"^(0|[1-9][0-9]{0,18})\.json$")


def manifest_key(operator_id: str, version: int) -> str:
    """Object key of the manifest of ``version``, relative to the checkpoint root."""
    return f"{_check_name('operator_id', str(operator_id))}/{COMMITS_DIR}/{int(version)}.json"


def _canonical(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def seal(kind: str, body: dict[str, Any]) -> bytes:
    """``{kind: body, "xxh3": checksum of body}`` as canonical JSON: a manifest's or an owner record's file."""
    return _canonical({kind: body, "xxh3": f"{xxhash.xxh3_64_intdigest(_canonical(body)):016x}"}) + b"\n"


def unseal(data: bytes, name: str, kind: str, what: str) -> dict[str, Any]:
    """The body of a file ``seal`` made, its checksum and format version checked (``CorruptFileError``)."""
    outer = json.loads(data)
    body: dict[str, Any] = outer[kind]
    if outer["xxh3"] != f"{xxhash.xxh3_64_intdigest(_canonical(body)):016x}":
        raise CorruptFileError(name, "checksum mismatch")
    if body["format"] != FORMAT_VERSION:
        raise CorruptFileError(name, f"unsupported {what} format {body['format']!r}")
    return body


@dataclass(frozen=True)
class Manifest:
    """Operator-level commit record of one version (Spark: batch ``version - 1`` is done)."""

    operator_id: str
    version: int
    num_partitions: int
    num_key_groups: int
    stores: dict[str, tuple[CheckpointRef, ...]]  # store name -> one CheckpointRef per partition
    created: float = field(default_factory=lambda: round(time.time(), 3))
    metadata: dict[str, Any] = field(default_factory=dict)  # JSON values, the writer's own

    def __post_init__(self) -> None:
        if self.num_partitions < 1 or self.num_key_groups < self.num_partitions:
            raise InterfaceError(
                f"need 1 <= partitions <= key groups, got {self.num_partitions} partitions, {self.num_key_groups} key groups"
            )
        for name, refs in self.stores.items():
            _check_name("store_name", name)
            if len(refs) != self.num_partitions:
                raise InterfaceError(f"store {name!r} lists {len(refs)} partitions, expected {self.num_partitions}")
            # an operator that loaded an initial state committed once more than it ran batches
            # (metadata "initial_state": the writer's own flag): its states may be one version ahead
            ahead = 1 if self.metadata.get(INITIAL_STATE_KEY) else 0
            for r in refs:
                if not isinstance(r, CheckpointRef) or r.version > self.version + ahead:
                    raise InterfaceError(f"store {name!r}: {r!r} is not a state at or before version {self.version}")

    def ref(self, partition: int, store_name: str = DEFAULT_STORE_NAME) -> CheckpointRef:
        """The committed state of ``partition`` that this version counts."""
        try:
            return self.stores[store_name][partition]
        except (KeyError, IndexError):
            raise InterfaceError(
                f"manifest {self.version} of operator {self.operator_id} has no store {store_name!r} partition {partition}"
            ) from None

    def to_bytes(self) -> bytes:
        body = {
            "format": FORMAT_VERSION,
            "operator_id": self.operator_id,
            "version": self.version,
            "num_partitions": self.num_partitions,
            "num_key_groups": self.num_key_groups,
            "stores": {name: [r.to_json() for r in refs] for name, refs in self.stores.items()},
            "created": self.created,
            "metadata": self.metadata,
        }
        return seal("manifest", body)

    @classmethod
    def from_bytes(cls, data: bytes, name: str) -> Manifest:
        try:
            body = unseal(data, name, "manifest", "manifest")
            return cls(
                operator_id=body["operator_id"],
                version=body["version"],
                num_partitions=body["num_partitions"],
                num_key_groups=body["num_key_groups"],
                stores={k: tuple(CheckpointRef.from_json(r) for r in v) for k, v in body["stores"].items()},
                created=body["created"],
                metadata=body["metadata"],
            )
        except CorruptFileError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError, InterfaceError) as exc:
            raise CorruptFileError(name, f"not a valid manifest: {exc}") from None


async def write_manifest(objstore: ObjectStore, manifest: Manifest) -> str:
    """Write (or replace, for a replayed batch) the manifest; returns its key."""
    key = manifest_key(manifest.operator_id, manifest.version)
    await objstore.put(key, manifest.to_bytes())
    return key


async def read_manifest(objstore: ObjectStore, operator_id: str, version: int) -> Manifest:
    """The manifest of ``version``; ``VersionNotFoundError`` if there is none."""
    key = manifest_key(operator_id, version)
    try:
        data = await objstore.get(key)
    except ObjectNotFoundError:
        raise VersionNotFoundError(f"no manifest {key!r}") from None
    m = Manifest.from_bytes(data, key)
    if m.version != version or m.operator_id != str(operator_id):
        raise CorruptFileError(key, f"it describes operator {m.operator_id!r} version {m.version}")
    return m


async def list_manifest_versions(objstore: ObjectStore, operator_id: str) -> list[int]:
    """Every version with a manifest (a LIST: for tools and cleanup, not the hot path)."""
    prefix = f"{_check_name('operator_id', str(operator_id))}/{COMMITS_DIR}/"
    out = []
    async for info in objstore.list(prefix):
        m = _NAME_RE.match(info.key[len(prefix):])
        if m:
            out.append(int(m.group(1)))
    return sorted(out)


async def delete_manifests_after(objstore: ObjectStore, operator_id: str, version: int) -> list[int]:
    """Delete the manifests of every version above ``version`` (a LIST: a takeover's step, not the
    hot path); returns those versions. A new owner that continues from manifest ``version`` removes
    what its dead predecessor committed later: readers of the latest manifest and ``gc`` would
    otherwise take the old owner's states for the newest."""
    later = [v for v in await list_manifest_versions(objstore, operator_id) if v > version]
    await objstore.delete_many([manifest_key(operator_id, v) for v in later])
    return later


# --- the owner: one writer per state ---------------------------------------------------------------
def owner_key(operator_id: str, epoch: int) -> str:
    """Object key of the owner record of ``epoch``, relative to the checkpoint root."""
    return f"{_check_name('operator_id', str(operator_id))}/{OWNER_DIR}/{int(epoch)}.json"


@dataclass(frozen=True)
class OwnerRecord:
    """Epoch ``epoch`` of an operator's ownership: from it on, only ``owner`` writes the state.

    ``previous`` is the owner it took over from (None for epoch 0, the first claim) and
    ``from_version`` the manifest version it started from when it claimed the state."""

    operator_id: str
    epoch: int
    owner: str
    previous: str | None = None
    from_version: int = 0
    created: float = field(default_factory=lambda: round(time.time(), 3))

    def __post_init__(self) -> None:
        if not isinstance(self.owner, str) or not self.owner:
            raise InterfaceError(f"an owner is a non-empty string, got {self.owner!r}")
        if self.epoch < 0 or self.from_version < 0:
            raise InterfaceError(f"bad owner record: epoch {self.epoch}, from version {self.from_version}")

    def to_bytes(self) -> bytes:
        body = {"format": FORMAT_VERSION, "operator_id": self.operator_id, "epoch": self.epoch, "owner": self.owner,
                "previous": self.previous, "from_version": self.from_version, "created": self.created}
        return seal("owner", body)

    @classmethod
    def from_bytes(cls, data: bytes, name: str) -> OwnerRecord:
        try:
            body = unseal(data, name, "owner", "owner record")
            return cls(operator_id=body["operator_id"], epoch=body["epoch"], owner=body["owner"],
                       previous=body["previous"], from_version=body["from_version"], created=body["created"])
        except CorruptFileError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError, InterfaceError) as exc:
            raise CorruptFileError(name, f"not a valid owner record: {exc}") from None


async def read_owner(objstore: ObjectStore, operator_id: str, known: OwnerRecord | None = None) -> OwnerRecord | None:
    """The operator's current owner record, None if no writer ever claimed it: ``known`` (a record
    read before; None: start at epoch 0) or a later one, one GET per epoch until one is missing."""
    current = known
    epoch = 0 if known is None else known.epoch + 1
    while True:
        key = owner_key(operator_id, epoch)
        try:
            data = await objstore.get(key)
        except ObjectNotFoundError:
            return current
        record = OwnerRecord.from_bytes(data, key)
        if record.epoch != epoch or record.operator_id != str(operator_id):
            raise CorruptFileError(key, f"it describes operator {record.operator_id!r} epoch {record.epoch}")
        current = record
        epoch += 1


async def claim_owner(objstore: ObjectStore, operator_id: str, owner: str, *, takeover: bool | str = False,
                      from_version: int = 0, known: OwnerRecord | None = None) -> OwnerRecord:
    """Make ``owner`` the writer of the operator's state, or find it already is; its record.

    A state nobody claimed yet gets epoch 0 (of two claimers at once, one wins; the other is
    refused). A state another writer owns is refused with ``OwnerConflictError``, unless
    ``takeover`` is True (from whichever owner) or names that owner: then epoch e+1 is created for
    ``owner``, with ``previous`` set. A writer that claimed the state in between (a record newer
    than the one this call decided on) is never taken over: refused. ``from_version``: the
    manifest version the writer starts from (recorded). Writes nothing but the record."""
    current = await read_owner(objstore, operator_id, known)
    if current is not None and current.owner == owner:
        return current
    if current is not None and not (takeover is True or (isinstance(takeover, str) and takeover == current.owner)):
        raise OwnerConflictError(
            f"operator {operator_id!r} is owned by {current.owner!r} (epoch {current.epoch}, claimed at "
            f"{_when(current.created)}), not by {owner!r}: one writer per state"
            + (f"; takeover names {takeover!r}, not the owner" if isinstance(takeover, str) else ""))
    record = OwnerRecord(operator_id, 0 if current is None else current.epoch + 1, owner,
                         previous=None if current is None else current.owner, from_version=from_version)
    try:
        await objstore.put_if_absent(owner_key(operator_id, record.epoch), record.to_bytes())
    except ObjectExistsError:
        winner = await read_owner(objstore, operator_id, current)
        if winner is not None and winner.owner == owner:  # our own earlier attempt, whose answer was lost
            return winner
        raise OwnerConflictError(
            f"operator {operator_id!r} was claimed by {winner.owner if winner else None!r} (epoch "
            f"{winner.epoch if winner else record.epoch}) while {owner!r} claimed it: one writer per state") from None
    return record


def _when(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(seconds))
