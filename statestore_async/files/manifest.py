"""The operator manifest ``<operator>/_commits/<version>.json``: which checkpoint of each partition counts.

The driver writes it after every file a batch produced is present in the object store (DESIGN §7).
A later load of partition p at that version opens exactly the (version, ckptid) it names, so files
of other attempts are ignored (and later collected). The manifest also fixes the operator's number
of partitions and key groups, which may not change silently.

File body: canonical JSON ``{"manifest": {...}, "xxh3": "<16 hex digits>"}`` where the checksum
covers the canonical JSON of ``manifest``; a damaged manifest raises ``CorruptFileError``.
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
    ObjectNotFoundError,
    VersionNotFoundError,
)
from statestore_async.ids import DEFAULT_STORE_NAME, CheckpointRef, _check_name

if TYPE_CHECKING:
    from statestore_async.objectstore.base import ObjectStore

FORMAT_VERSION = 1
COMMITS_DIR = "_commits"
_NAME_RE = re.compile(r"^(0|[1-9][0-9]{0,18})\.json$")


def manifest_key(operator_id: str, version: int) -> str:
    """Object key of the manifest of ``version``, relative to the checkpoint root."""
    return f"{_check_name('operator_id', str(operator_id))}/{COMMITS_DIR}/{int(version)}.json"


def _canonical(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


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
            for r in refs:
                if not isinstance(r, CheckpointRef) or r.version > self.version:
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
        return _canonical({"manifest": body, "xxh3": f"{xxhash.xxh3_64_intdigest(_canonical(body)):016x}"}) + b"\n"

    @classmethod
    def from_bytes(cls, data: bytes, name: str) -> Manifest:
        try:
            outer = json.loads(data)
            body = outer["manifest"]
            if outer["xxh3"] != f"{xxhash.xxh3_64_intdigest(_canonical(body)):016x}":
                raise CorruptFileError(name, "checksum mismatch")
            if body["format"] != FORMAT_VERSION:
                raise CorruptFileError(name, f"unsupported manifest format {body['format']!r}")
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
