"""Identities: which store (``StoreId``), which committed state (``CheckpointRef``), file names.

A store is one state partition of one stateful operator under a checkpoint root. A committed
state is a (version, checkpoint id) pair: several attempts at the same version (task retries,
speculation, replays) each get their own checkpoint id, so their files never collide and the
driver's manifest decides which one counts (docs/ARCHITECTURE.md, "Identities and versions").
"""
from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from urllib.parse import unquote, urlparse

from statestore_async.errors import InterfaceError, RootError, RootNotAllowedError

DEFAULT_STORE_NAME = "default"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_CKPT_RE = re.compile(r"^[0-9a-f]{32}$")


def _check_name(what: str, value: str) -> str:
    if not isinstance(value, str) or not _NAME_RE.match(value) or value in (".", ".."):
        raise InterfaceError(
            f"{what} must be 1-128 characters of [A-Za-z0-9_.-] starting with a letter or digit, got {value!r}"
        )
    return value


@dataclass(frozen=True, order=True)
class StoreId:
    """One store: ``(checkpoint root, operator id, partition id, store name)``.

    ``root`` is the object-store URI of the checkpoint root (``file:///…`` or ``s3://…``); the
    store's files live under ``<operator>/<partition>/<store_name>/`` relative to it.
    """

    root: str
    operator_id: str
    partition_id: int
    store_name: str = DEFAULT_STORE_NAME

    def __post_init__(self) -> None:
        if not isinstance(self.root, str):
            raise InterfaceError(f"root must be a string URI, got {self.root!r}")
        if isinstance(self.operator_id, int) and not isinstance(self.operator_id, bool):
            object.__setattr__(self, "operator_id", str(self.operator_id))
        _check_name("operator_id", self.operator_id)
        _check_name("store_name", self.store_name)
        if isinstance(self.partition_id, bool) or not isinstance(self.partition_id, int) or self.partition_id < 0:
            raise InterfaceError(f"partition_id must be an int >= 0, got {self.partition_id!r}")

    @property
    def prefix(self) -> str:
        """The store's folder, relative to the checkpoint root (no trailing slash)."""
        return f"{self.operator_id}/{self.partition_id}/{self.store_name}"

    def to_json(self) -> dict[str, str | int]:
        return {
            "operator_id": self.operator_id,
            "partition_id": self.partition_id,
            "store_name": self.store_name,
        }

    def __str__(self) -> str:
        return f"{self.root.rstrip('/')}/{self.prefix}"


def new_checkpoint_id() -> str:
    """A fresh, unique checkpoint id (32 lowercase hex digits)."""
    return uuid.uuid4().hex


def check_checkpoint_id(ckptid: str) -> str:
    if not isinstance(ckptid, str) or not _CKPT_RE.match(ckptid):
        raise InterfaceError(f"a checkpoint id is 32 lowercase hex digits, got {ckptid!r}")
    return ckptid


@dataclass(frozen=True, order=True)
class CheckpointRef:
    """A committed state of a store: its version and the checkpoint id of the attempt that made it.

    Version 0 is the empty state and has the empty checkpoint id ``""`` (no file).
    """

    version: int
    ckptid: str

    def __post_init__(self) -> None:
        if isinstance(self.version, bool) or not isinstance(self.version, int) or self.version < 0:
            raise InterfaceError(f"version must be an int >= 0, got {self.version!r}")
        if self.version == 0:
            if self.ckptid != "":
                raise InterfaceError("version 0 is the empty state; its checkpoint id is ''")
        else:
            check_checkpoint_id(self.ckptid)

    @property
    def is_empty_state(self) -> bool:
        return self.version == 0

    def to_json(self) -> list[int | str]:
        return [self.version, self.ckptid]

    @classmethod
    def from_json(cls, value: object) -> CheckpointRef:
        if not isinstance(value, (list, tuple)) or len(value) != 2:
            raise InterfaceError(f"a checkpoint reference is [version, ckptid], got {value!r}")
        return cls(value[0], value[1])

    def __str__(self) -> str:
        return f"{self.version}_{self.ckptid}" if self.version else "0"


EMPTY_STATE = CheckpointRef(0, "")


# --- checkpoint roots -------------------------------------------------------------------------------
ROOT_FORMS = "file:///absolute/path or s3://bucket/prefix"
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")


@dataclass(frozen=True)
class RootParts:
    """A checkpoint root taken apart: ``scheme`` (``file`` or ``s3``), ``bucket`` (``""`` for a
    local folder) and the path's segments, without empty ones (``file:///a//b/`` is ``("a", "b")``)."""

    scheme: str
    bucket: str
    segments: tuple[str, ...]

    def within(self, prefix: RootParts) -> bool:
        """Whether this root is ``prefix`` or under it, on whole segments (``/data/state2`` is not
        under ``/data/state``)."""
        n = len(prefix.segments)
        return (self.scheme == prefix.scheme and self.bucket == prefix.bucket
                and self.segments[:n] == prefix.segments)

    def __str__(self) -> str:
        path = "/" + "/".join(self.segments)
        return f"file://{path}" if self.scheme == "file" else f"s3://{self.bucket}{path.rstrip('/')}"


def root_parts(root: str) -> RootParts:
    """Check a checkpoint root and take it apart; ``RootError`` names the root and the fix.

    Accepted: ``file:///absolute/path`` (also ``file:/absolute/path``, ``file://localhost/…``, and a
    plain absolute path) and ``s3://bucket[/prefix]``. Refused: an empty root, a relative path
    (``file:relative/dir``, ``state``), a ``.`` or ``..`` segment (also percent-encoded, as a local
    path is unquoted), another scheme (``ftp://``), a ``file://`` URI naming another host, a query,
    fragment, user or port, and control characters."""
    if not isinstance(root, str) or not root.strip():
        raise RootError(f"an empty checkpoint root ({root!r}) names no location: use {ROOT_FORMS}")
    if _CONTROL_RE.search(root):
        raise RootError(f"checkpoint root {root!r} has control characters: use {ROOT_FORMS}")
    parsed = urlparse(root)
    scheme = parsed.scheme.lower()
    if parsed.query or parsed.fragment or parsed.params:
        raise RootError(f"checkpoint root {root!r} has a query, fragment or parameters: use {ROOT_FORMS}")
    if scheme == "" and not root.startswith("/"):
        raise RootError(f"checkpoint root {root!r} is a relative path (it would resolve under the daemon's "
                        f"working folder): use {ROOT_FORMS}")
    if scheme == "":
        scheme, bucket, path = "file", "", root
    elif scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise RootError(f"checkpoint root {root!r} names host {parsed.netloc!r}: a file root is a folder of "
                            f"the daemon's node, file:///absolute/path (three slashes)")
        bucket, path = "", unquote(parsed.path)
        if not path.startswith("/"):
            raise RootError(f"checkpoint root {root!r} is a relative path (it would resolve under the daemon's "
                            f"working folder): use file:///absolute/path")
    elif scheme == "s3":
        bucket, path = parsed.netloc, parsed.path
        if not bucket or "@" in bucket or ":" in bucket:
            raise RootError(f"checkpoint root {root!r} names no bucket (or a user or port): use s3://bucket/prefix")
    else:
        raise RootError(f"checkpoint root {root!r} has unknown scheme {parsed.scheme!r}: use {ROOT_FORMS}")
    segments = tuple(s for s in path.split("/") if s)
    if any(s in (".", "..") for s in segments):
        raise RootError(f"checkpoint root {root!r} has a '.' or '..' segment: name the folder itself, "
                        f"{ROOT_FORMS}, without them")
    if _CONTROL_RE.search(path):
        raise RootError(f"checkpoint root {root!r} has control characters: use {ROOT_FORMS}")
    return RootParts(scheme, bucket, segments)


def check_root(root: str, allowed: tuple[RootParts, ...] = ()) -> RootParts:
    """``root_parts(root)``, and with ``allowed`` (a daemon's ``allowed_roots``), ``RootNotAllowedError``
    unless the root is one of them or under one."""
    parts = root_parts(root)
    if allowed and not any(parts.within(a) for a in allowed):
        raise RootNotAllowedError(
            f"checkpoint root {root!r} is outside this daemon's allowed roots "
            f"({', '.join(str(a) for a in allowed)}): use a root under one of them, or add it to the daemon's "
            f"allowed_roots (STATESTORE_ALLOWED_ROOTS, --allowed-roots)")
    return parts
