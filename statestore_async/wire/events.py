"""What the wire protocol hands over: the request and answer events of ``ServerProtocol`` and
``ClientProtocol`` (``wire.protocol``), one frozen dataclass per request kind, and the sentinels
``NEED_DATA`` / ``CLOSED``. A batch request's items are a validated packed payload
(``codecs.packed``), read without decoding."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Final, TypeAlias

from statestore_async.codecs import packed
from statestore_async.errors import StateStoreError
from statestore_async.ids import CheckpointRef, StoreId


class _Sentinel(enum.Enum):
    # an enum, so that ``ev is NEED_DATA`` narrows an event's type; printed as its bare name
    NEED_DATA = "NEED_DATA"
    CLOSED = "CLOSED"

    def __repr__(self) -> str:
        return self.name

    __str__ = __repr__


NEED_DATA: Final = _Sentinel.NEED_DATA
CLOSED: Final = _Sentinel.CLOSED


@dataclass(frozen=True, slots=True)
class Hello:
    request_id: int
    min_version: int
    max_version: int
    client: str


@dataclass(frozen=True, slots=True)
class Ping:
    request_id: int
    payload: bytes


@dataclass(frozen=True, slots=True)
class Open:
    request_id: int
    store_id: StoreId
    version: int
    ckptid: str | None


@dataclass(frozen=True, slots=True)
class GetMany:
    request_id: int
    handle: int
    keys: packed.PackedList


@dataclass(frozen=True, slots=True)
class PutMany:
    request_id: int
    handle: int
    items: packed.PackedPairs


@dataclass(frozen=True, slots=True)
class RemoveMany:
    request_id: int
    handle: int
    keys: packed.PackedList


@dataclass(frozen=True, slots=True)
class Scan:
    request_id: int
    handle: int
    prefix: bytes
    limit: int | None


@dataclass(frozen=True, slots=True)
class ScanRanges:
    """``ranges``: ascending, disjoint ``(start, stop)`` (stop None: no upper bound), checked;
    ``limit``: at most this many records per range (None: all)."""

    request_id: int
    handle: int
    ranges: tuple[tuple[bytes, bytes | None], ...]
    limit: int | None


@dataclass(frozen=True, slots=True)
class Commit:
    request_id: int
    handle: int
    ckptid: str | None


@dataclass(frozen=True, slots=True)
class Abort:
    request_id: int
    handle: int


@dataclass(frozen=True, slots=True)
class AwaitDurable:
    request_id: int
    store_id: StoreId
    ref: CheckpointRef
    timeout: float


@dataclass(frozen=True, slots=True)
class Stats:
    request_id: int


@dataclass(frozen=True, slots=True)
class Release:
    """Drop the daemon's idle copies of these partitions of one operator's store (a coordinator's hint)."""

    request_id: int
    root: str
    operator_id: str
    store_name: str
    partitions: tuple[tuple[int, int], ...]  # (partition, below): only a copy whose head version is lower


@dataclass(frozen=True, slots=True)
class BadRequest:
    """A request that cannot be served; answer ``error`` and go on."""

    request_id: int
    opcode: int
    error: StateStoreError


@dataclass(frozen=True, slots=True)
class ConnectionFailed:
    """The byte stream is broken; answer ``error`` if possible, then close."""

    request_id: int
    opcode: int
    error: StateStoreError


@dataclass(frozen=True, slots=True)
class Response:
    """An answer to ``request_id``; ``more`` is set on every chunk of a stream except the last."""

    request_id: int
    opcode: int
    value: object
    more: bool = False


@dataclass(frozen=True, slots=True)
class ErrorResponse:
    """A coded error answering ``request_id`` (0: an error about the whole connection)."""

    request_id: int
    opcode: int
    error: StateStoreError


@dataclass(frozen=True, slots=True)
class HelloInfo:
    version: int
    limits: dict[str, Any]  # the daemon's JSON: max_frame_bytes, max_batch, max_inflight, …


Request: TypeAlias = (Hello | Ping | Open | GetMany | PutMany | RemoveMany | Scan | ScanRanges | Commit | Abort
                      | AwaitDurable | Stats | Release)
ServerEvent: TypeAlias = Request | BadRequest | ConnectionFailed  # what ServerProtocol.next_event gives
ClientEvent: TypeAlias = Response | ErrorResponse | ConnectionFailed  # what ClientProtocol.next_event gives
