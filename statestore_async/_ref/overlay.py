"""Batch operations on an open version's overlay, pure-Python reference.

This module *defines* the behaviour; ``_ext/overlay.pyx`` must give the same results, the same
dict contents, the same bytes and the same errors. The contracts are documented in
``statestore_async.engine.overlay``.
"""
from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from statestore_async._ref import framing as _fr
from statestore_async.errors import DecodeError, InterfaceError, KeyFormatError

if TYPE_CHECKING:
    from collections.abc import Iterable
    from typing import Final

    from statestore_async._ref import Buffer, BytesLike

KEY_GROUP_SLOTS = 1 << 16


class _Missing(enum.Enum):
    """The type of ``_MISSING``: a one-member enum, so that type checkers narrow ``is not _MISSING``."""

    MISSING = 0


#: What ``overlay.get`` gives for a key it does not have (a tombstone is None).
_MISSING: Final = _Missing.MISSING


def _key_error(n: int, min_key: int) -> KeyFormatError:
    return KeyFormatError(f"a store key starts with its {min_key}-byte key group, got {n} bytes")


def _check_key(key: object, min_key: int) -> bytes:
    if type(key) is not bytes:
        if isinstance(key, (bytearray, memoryview)):
            key = bytes(key)
        else:
            raise KeyFormatError(f"keys are bytes, got {type(key).__name__}")
    if len(key) < min_key:
        raise _key_error(len(key), min_key)
    return key


def _check_value(value: object) -> bytes:
    if type(value) is not bytes:
        if isinstance(value, (bytearray, memoryview)):
            return bytes(value)
        raise InterfaceError(f"values are bytes, got {type(value).__name__}")
    return value


def _pair(item: Iterable[object]) -> tuple[object, object]:
    try:
        k, v = item
    except (TypeError, ValueError):
        raise InterfaceError(f"pairs are (key, value) tuples, got {item!r:.80}") from None
    return k, v


def _apply(overlay: dict[bytes, bytes | None], pairs: Iterable[tuple[bytes, bytes | None]], overhead: int) -> int:
    """Set each (key, value|None) in order; the change of the overlay's accounted bytes."""
    delta = 0
    get = overlay.get
    for k, v in pairs:
        old = get(k, _MISSING)
        if old is not _MISSING:
            delta -= len(k) + (len(old) if old is not None else 0) + overhead
        overlay[k] = v
        delta += len(k) + (len(v) if v is not None else 0) + overhead
    return delta


def put_items(
    overlay: dict[bytes, bytes | None], items: Iterable[tuple[BytesLike, BytesLike]], min_key: int, overhead: int
) -> int:
    """Put every (key, value) of ``items`` into ``overlay``; all are checked before any is set.

    Returns the change of the accounted bytes (``len(key) + len(value) + overhead`` per entry).
    """
    items = list(items)
    checked = []
    for item in items:
        k, v = _pair(item)
        checked.append((_check_key(k, min_key), _check_value(v)))
    return _apply(overlay, checked, overhead)


def remove_keys(overlay: dict[bytes, bytes | None], keys: Iterable[BytesLike], min_key: int, overhead: int) -> int:
    """Set a tombstone (None) for every key; all are checked before any is set."""
    checked = [(_check_key(k, min_key), None) for k in list(keys)]
    return _apply(overlay, checked, overhead)


def get_list(overlay: dict[bytes, bytes | None], base: dict[bytes, bytes], keys: Iterable[bytes]) -> list[bytes | None]:
    """The value of each key: the overlay's (None for a tombstone) if it has the key, else the base's."""
    return [overlay[k] if k in overlay else base.get(k) for k in keys]


def put_packed(
    overlay: dict[bytes, bytes | None], buf: Buffer, offset: int, min_key: int, overhead: int, max_count: int = _fr.MAX_U32
) -> tuple[int, int]:
    """Like ``put_items`` for pairs encoded as in ``framing.encode_pairs`` at ``offset`` of ``buf``.

    Returns ``(count, bytes change)``. A malformed payload raises ``DecodeError`` and a short key
    ``KeyFormatError`` (decoding errors first), before anything is set. Trailing bytes are an error.
    """
    items, end = _fr.decode_pairs(buf, offset, max_count)
    if end != len(memoryview(buf)):
        raise DecodeError(f"pairs: {len(memoryview(buf)) - end} unexpected trailing bytes")
    for k, _ in items:
        if len(k) < min_key:
            raise _key_error(len(k), min_key)
    return len(items), _apply(overlay, items, overhead)


def remove_packed(
    overlay: dict[bytes, bytes | None], buf: Buffer, offset: int, min_key: int, overhead: int, max_count: int = _fr.MAX_U32
) -> tuple[int, int]:
    """Like ``remove_keys`` for keys encoded as in ``framing.encode_list``: ``(count, bytes change)``."""
    keys, end = _fr.decode_list(buf, offset, max_count)
    if end != len(memoryview(buf)):
        raise DecodeError(f"list: {len(memoryview(buf)) - end} unexpected trailing bytes")
    for k in keys:
        if len(k) < min_key:
            raise _key_error(len(k), min_key)
    return len(keys), _apply(overlay, [(k, None) for k in keys], overhead)


def get_packed(
    overlay: dict[bytes, bytes | None], base: dict[bytes, bytes], buf: Buffer, offset: int, max_count: int = _fr.MAX_U32
) -> bytes:
    """The values of keys encoded as in ``framing.encode_list``, encoded as ``framing.encode_optional_list``."""
    keys, end = _fr.decode_list(buf, offset, max_count)
    if end != len(memoryview(buf)):
        raise DecodeError(f"list: {len(memoryview(buf)) - end} unexpected trailing bytes")
    return _fr.encode_optional_list(get_list(overlay, base, keys))


def apply_changes(
    data: dict[bytes, bytes], changes: dict[bytes, bytes | None], overhead: int
) -> tuple[list[bytes | None], dict[bytes, bytes | None], int, int, int]:
    """Apply key → value|None (None: remove) to ``data`` in one pass; see the facade's docstring."""
    pre: list[bytes | None] = []
    dropped: set[bytes] = set()
    data_delta = undo_bytes = rec_bytes = 0
    for k, v in changes.items():
        old = data.get(k)
        if v is None:
            if old is None:
                dropped.add(k)  # removing what is not there changes nothing
                continue
            del data[k]
            data_delta -= len(k) + len(old) + overhead
        else:
            data[k] = v
            data_delta += len(v) - len(old) if old is not None else len(k) + len(v) + overhead
        pre.append(old)
        undo_bytes += len(k) + (len(old) if old is not None else 0) + overhead
        rec_bytes += len(k) + (len(v) if v is not None else 0) + 8
    records = {k: v for k, v in changes.items() if k not in dropped} if dropped else changes
    return pre, records, data_delta, undo_bytes, rec_bytes


def _check_groups(groups: list[list[bytes] | None]) -> list[list[bytes] | None]:
    if type(groups) is not list or len(groups) != KEY_GROUP_SLOTS:
        raise InterfaceError(f"groups is a list of {KEY_GROUP_SLOTS} slots")
    return groups


def group_records(
    keys: list[bytes],
    start: int,
    stop: int,
    shadow: dict[bytes, bytes | None],
    data: dict[bytes, bytes],
    groups: list[list[bytes] | None],
) -> None:
    """Sort the records of ``keys[start:stop]`` into ``groups`` by key group; see the facade."""
    _check_groups(groups)
    if type(keys) is not list:
        raise InterfaceError(f"keys is a list, got {type(keys).__name__}")
    for k in keys[max(0, start) : max(0, stop)]:
        if type(k) is not bytes:
            raise KeyFormatError(f"keys are bytes, got {type(k).__name__}")
        v = shadow[k] if k in shadow else data.get(k)
        if v is None:
            continue
        kg = (k[0] << 8) | k[1] if len(k) >= 2 else 0
        slot = groups[kg]
        if slot is None:
            groups[kg] = [k, v]
        elif type(slot) is not list:
            raise InterfaceError(f"group slot {kg} holds a {type(slot).__name__}, not a list")
        else:
            slot.append(k)
            slot.append(v)


def gather_records(
    groups: list[list[bytes] | None], cursor: tuple[int, int], max_bytes: int
) -> tuple[list[tuple[bytes, bytes]], tuple[int, int]]:
    """The next records of ``groups`` from ``cursor``, up to ``max_bytes``; see the facade."""
    _check_groups(groups)
    if type(cursor) is not tuple or len(cursor) != 2 or type(cursor[0]) is not int or type(cursor[1]) is not int:
        raise InterfaceError(f"bad cursor {cursor!r}")
    g, i = cursor
    if not (0 <= g <= KEY_GROUP_SLOTS and i >= 0):
        raise InterfaceError(f"bad cursor {cursor!r}")
    records: list[tuple[bytes, bytes]] = []
    size = 0
    while g < KEY_GROUP_SLOTS:
        slot = groups[g]
        if slot is not None and type(slot) is not list:
            raise InterfaceError(f"group slot {g} holds a {type(slot).__name__}, not a list")
        if slot is None or i + 1 >= len(slot):
            groups[g] = None  # done with this group: its records go as soon as they are encoded
            g += 1
            i = 0
            continue
        k = slot[i]
        v = slot[i + 1]
        n = len(k) + len(v) + 11
        if records and size + n > max_bytes:
            break
        records.append((k, v))
        size += n
        i += 2
    return records, (g, i)
