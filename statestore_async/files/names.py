"""Names of checkpoint files: ``<version>_<ckptid>.delta|.snapshot|.rescale`` under a store's folder.

A ``.rescale`` file is the recipe of a rescaled partition's first state (``files.rescale``): which
key-group ranges of which old partitions' states it is made of. It is read only when that state has
no snapshot (yet) and no delta.

The one place that knows how a checkpoint file is named and where it lives relative to the
checkpoint root; every writer and reader of checkpoint files asks it.
"""
from __future__ import annotations

import re

from statestore_async.errors import InterfaceError
from statestore_async.ids import CheckpointRef, StoreId

_FILE_RE = re.compile(r"^(?P<version>0|[1-9][0-9]{0,18})_(?P<ckptid>[0-9a-f]{32})\.(?P<kind>delta|snapshot|rescale)$")

DELTA = "delta"
SNAPSHOT = "snapshot"
RESCALE = "rescale"
KINDS = (DELTA, SNAPSHOT, RESCALE)


def file_name(ref: CheckpointRef, kind: str) -> str:
    """``<version>_<ckptid>.delta|.snapshot|.rescale``."""
    if kind not in KINDS:
        raise InterfaceError(f"file kind is one of {KINDS}, got {kind!r}")
    if ref.is_empty_state:
        raise InterfaceError("version 0 is the empty state and has no file")
    return f"{ref.version}_{ref.ckptid}.{kind}"


def file_key(store_id: StoreId, ref: CheckpointRef, kind: str) -> str:
    """The object key of a checkpoint file, relative to the checkpoint root."""
    return f"{store_id.prefix}/{file_name(ref, kind)}"


def parse_file_name(name: str) -> tuple[CheckpointRef, str] | None:
    """``(ref, kind)`` for a checkpoint file name, or None for anything else (temp files, …)."""
    m = _FILE_RE.match(name.rsplit("/", 1)[-1])
    if not m:
        return None
    return CheckpointRef(int(m["version"]), m["ckptid"]), m["kind"]


def is_checkpoint_file(key: str) -> bool:
    """Whether ``key`` names a checkpoint file (immutable once created)."""
    return parse_file_name(key) is not None
