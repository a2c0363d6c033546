"""The internal interface through which the task runtime (``spark.task``) drives the objects a
processor uses — its state variables (``variables``) and its timers (``timers``) — through a batch.
Not for processors: a processor only reads and writes through the public methods (``get``,
``update``, ``register``, …); these members are what the runtime calls around them.

A batch of a per-key processor, for each state variable ``v`` (a ``BatchState``):

1. ``v.begin_batch(raw, now_ms)`` — every key's stored value (an Arrow binary array by key
   index, null: absent), decoded in one call;
2. ``v.bind_keys()``, then per key ``v.key_index = i`` while the processor handles key ``i``,
   then ``v.unbind_keys()`` (outside, any read or write raises);
3. ``v.batch_changes(store_keys)`` — the batch's puts and removals as Arrow arrays, encoded in one
   call (it ends the batch); ``v.ttl_removed`` — the values its TTL removed.

The per-key ``Timers`` (a ``KeyTimers``) follow the same keys (``key_index``); the runtime hands
them a loader of the stored timers (``load_timers``), the thresholds of the due ones (``due_by``),
fires due timers through ``fire``, reads ``batch_changes`` / ``registered_due`` and calls
``end_batch``. A ``VectorizedTimers`` is bound to the batch's encoded keys with
``bind_keys(keys, key_groups)`` and gives its changes with ``batch_changes()``.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import pyarrow as pa


class BatchState(Protocol):
    """A state variable as the task runtime drives it through a batch (see the module docstring)."""

    name: str
    ttl_ms: int | None
    entries: bool  # a list or map state whose TTL is per entry
    key_index: int
    ttl_removed: int

    def begin_batch(self, raw: pa.Array, now_ms: int) -> None: ...

    def bind_keys(self) -> None: ...

    def unbind_keys(self) -> None: ...

    def batch_changes(self, keys: pa.Array) -> tuple[pa.Array, pa.Array, pa.Array]: ...

    def declaration(self) -> dict[str, Any]: ...


class KeyTimers(Protocol):
    """A per-key processor's timers as the task runtime drives them through a batch."""

    key_index: int
    load_timers: Callable[[], dict[int, set[tuple[str, int]]]] | None
    due_by: dict[int, int]
    registered_due: list[tuple[int, int, int]]
    batch_changes: dict[tuple[int, int, int], bool]

    def fire(self, i: int, kind: str, at_ms: int) -> None: ...

    def end_batch(self) -> None: ...


__all__ = ["BatchState", "KeyTimers"]
