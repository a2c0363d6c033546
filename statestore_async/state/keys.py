"""Store keys of timers and of the TTL expiry index, beside the state variables' keys in a partition's store.

State variable records are ``key group (2) + valuecodec.encode_key((state_name, *grouping_key))``:
their third byte is always ``valuecodec``'s tuple tag (0x08). The time records use third bytes no
encoded key can have, so the key spaces never meet, and each is one ordered range per key group:

* timer, by time: ``kg | 0xF0 | kind (1) | u64 BE (at_ms + 2**63) | encode_key(grouping_key)``
  — the due timers of a key group are one range scan (``due_ranges``);
* timer, by key: ``kg | 0xF1 | encode_key(grouping_key) | kind (1) | u64 BE (at_ms + 2**63)``
  — a key's timers are one prefix (``encode_key`` is prefix-free);
* TTL expiry: ``kg | 0xF3 | u64 BE (expires_at_ms + 2**63) | state key without its key group``
  — the values due to expire by ``now`` are one range scan per key group.

Every value is empty. The records are versioned, committed and checkpointed with the state, in
the same version: a replayed batch sees the same timers, a fired timer's deletion commits with
the state its callback wrote.
"""
from __future__ import annotations

import struct
from collections.abc import Iterable
from functools import lru_cache

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from statestore_async.errors import InterfaceError

TIMER_AT = 0xF0
TIMER_KEY = 0xF1
TTL_EXPIRY = 0xF3
PROCESSING, EVENT = "processing", "event"
KIND_BYTE = {PROCESSING: 0x01, EVENT: 0x02}
KIND_OF = {v: k for k, v in KIND_BYTE.items()}
_BIAS = 1 << 63
_TIME = struct.Struct(">Q")
_KG = struct.Struct(">H")
TIME_MODES = ("none", PROCESSING, EVENT)


def time_bytes(ms: int) -> bytes:
    """``ms`` (a signed 64-bit millisecond time) as 8 bytes whose byte order is the time's order."""
    return _TIME.pack(ms + _BIAS)


def time_of(b: bytes, pos: int = 0) -> int:
    return int(_TIME.unpack_from(b, pos)[0]) - _BIAS


def check_time(at_ms: object, what: str = "at_ms") -> int:
    """``at_ms`` when it is an int in the signed 64-bit range, else ``InterfaceError``."""
    if isinstance(at_ms, bool) or not isinstance(at_ms, int):
        raise InterfaceError(f"{what} is an int of milliseconds since the epoch, got {type(at_ms).__name__} {at_ms!r}")
    if not -_BIAS <= at_ms < _BIAS:
        raise InterfaceError(f"{what}={at_ms} is outside the signed 64-bit range of milliseconds")
    return at_ms


def timer_at_key(kg: bytes, kind: str, at_ms: int, enc_key: bytes) -> bytes:
    return kg + bytes((TIMER_AT, KIND_BYTE[kind])) + time_bytes(at_ms) + enc_key


def timer_by_key_key(kg: bytes, enc_key: bytes, kind: str, at_ms: int) -> bytes:
    return kg + bytes((TIMER_KEY,)) + enc_key + bytes((KIND_BYTE[kind],)) + time_bytes(at_ms)


def parse_timer_at(key: bytes) -> tuple[bytes, str, int, bytes]:
    """``(kg prefix, kind, at_ms, encoded grouping key)`` of a by-time timer record."""
    return key[:2], KIND_OF[key[3]], time_of(key, 4), key[12:]


def key_prefix(kg: bytes, enc_key: bytes) -> bytes:
    """The prefix of one grouping key's by-key timer records."""
    return kg + bytes((TIMER_KEY,)) + enc_key


def parse_timer_by_key(key: bytes, prefix_len: int) -> tuple[str, int]:
    """``(kind, at_ms)`` of a by-key timer record whose key prefix is ``prefix_len`` bytes."""
    return KIND_OF[key[prefix_len]], time_of(key, prefix_len + 1)


def prefix_stop(prefix: bytes) -> bytes | None:
    """The smallest key above every key starting with ``prefix`` (None: no such key)."""
    p = bytearray(prefix)
    while p and p[-1] == 0xFF:
        p.pop()
    if not p:
        return None
    p[-1] += 1
    return bytes(p)


def owned_key_groups(partition: int, num_partitions: int, num_key_groups: int) -> range:
    """The key groups whose rows the routing sends to ``partition`` (``kg * N // G == partition``)."""
    lo = -(-partition * num_key_groups // num_partitions)
    hi = -(-(partition + 1) * num_key_groups // num_partitions)
    return range(lo, hi)


@lru_cache(maxsize=32)
def _timer_heads(kgs: tuple[int, ...] | range, kinds: tuple[str, ...]) -> tuple[tuple[bytes, str], ...]:
    """``(kg | TIMER_AT | kind byte, kind)`` of each key group of ``kgs`` and kind, in key order."""
    return tuple((_KG.pack(g) + bytes((TIMER_AT, KIND_BYTE[kind])), kind) for g in kgs for kind in kinds)


def due_ranges(kgs: Iterable[int], thresholds: dict[str, int]) -> list[tuple[bytes, bytes | None]]:
    """Ascending ranges holding every by-time timer of the key groups ``kgs`` (ascending) of each kind
    in ``thresholds`` whose time is <= that kind's threshold. The ranges' starts are kept per set of
    key groups (a task's are the same every batch)."""
    kinds = tuple(sorted(thresholds, key=KIND_BYTE.__getitem__))
    heads = _timer_heads(kgs if isinstance(kgs, range) else tuple(kgs), kinds)
    stops = {k: time_bytes(thresholds[k] + 1) for k in kinds if thresholds[k] < _BIAS - 1}
    return [(head, head + stops[kind] if kind in stops else prefix_stop(head)) for head, kind in heads]


def ttl_key(state_key: bytes, expires_ms: int) -> bytes:
    """The expiry index record of a TTL'd value stored under ``state_key``."""
    return state_key[:2] + bytes((TTL_EXPIRY,)) + time_bytes(expires_ms) + state_key[2:]


def parse_ttl_key(key: bytes) -> tuple[int, bytes]:
    """``(expires_ms, state key)`` of an expiry index record."""
    return time_of(key, 3), key[:2] + key[11:]


def ttl_ranges(kgs: Iterable[int], now_ms: int) -> list[tuple[bytes, bytes | None]]:
    """Ascending ranges holding every expiry index record of ``kgs`` with expiry <= ``now_ms``."""
    out: list[tuple[bytes, bytes | None]] = []
    for g in kgs:
        head = _KG.pack(g) + bytes((TTL_EXPIRY,))
        out.append((head, head + time_bytes(now_ms + 1)))
    return out


def is_state_key(key: bytes) -> bool:
    """Whether a store record of the operator is a state variable's (not a timer or an expiry index entry)."""
    return len(key) < 3 or key[2] not in (TIMER_AT, TIMER_KEY, TTL_EXPIRY)


# -- the same records as Arrow columns (the vectorized path: no Python object per timer) ------------
def _fixed_width(raw: bytes, n: int, width: int) -> pa.Array:
    """``n`` values of ``width`` bytes laid end to end in ``raw``, as a binary array."""
    return pa.FixedSizeBinaryArray.from_buffers(pa.binary(width), n, [None, pa.py_buffer(raw)]).cast(pa.binary())


def time_column(at_ms: np.ndarray) -> pa.Array:
    """``time_bytes`` of every int64 in ``at_ms``, as a binary array."""
    biased = np.ascontiguousarray(at_ms, np.int64).view(np.uint64) ^ np.uint64(_BIAS)
    return _fixed_width(biased.astype(">u8").tobytes(), len(at_ms), 8)


def times_of(keys: pa.Array, pos: int) -> np.ndarray:
    """The int64 times written by ``time_bytes`` at byte ``pos`` of every key of a binary array."""
    off, data = _offsets_data(keys)
    at = data[off[:-1, None] + pos + np.arange(8)]
    return (np.ascontiguousarray(at).view(">u8").ravel().astype(np.uint64) ^ np.uint64(_BIAS)).view(np.int64)


def _offsets_data(keys: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    keys = keys.cast(pa.binary())
    bufs = keys.buffers()
    off = np.frombuffer(bufs[1], np.int32)[keys.offset:keys.offset + len(keys) + 1].astype(np.int64)
    data = np.frombuffer(bufs[2], np.uint8) if bufs[2] is not None else np.zeros(0, np.uint8)
    return off, data


def timer_record_columns(kgs: np.ndarray, kinds: np.ndarray, at_ms: np.ndarray,
                         enc_keys: pa.Array) -> tuple[pa.Array, pa.Array]:
    """(by-time keys, by-key keys) of the timers ``(kgs[i], kinds[i] (a KIND_BYTE), at_ms[i],
    enc_keys[i] = encode_key(grouping key))``: ``timer_at_key`` / ``timer_by_key_key`` column-wise."""
    n = len(at_ms)
    kg = _fixed_width(np.ascontiguousarray(kgs, np.uint16).astype(">u2").tobytes(), n, 2)
    kind = _fixed_width(np.ascontiguousarray(kinds, np.uint8).tobytes(), n, 1)
    t = time_column(at_ms)
    enc = enc_keys.cast(pa.binary())
    at_tag = pa.scalar(bytes((TIMER_AT,)), pa.binary())
    key_tag = pa.scalar(bytes((TIMER_KEY,)), pa.binary())
    empty = pa.scalar(b"", pa.binary())
    return (pc.binary_join_element_wise(kg, at_tag, kind, t, enc, empty),
            pc.binary_join_element_wise(kg, key_tag, enc, kind, t, empty))


def parse_timer_columns(keys: pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray, pa.Array]:
    """``(key groups, kind bytes, at_ms, encoded grouping keys)`` of by-time timer records (a binary
    array): ``parse_timer_at`` column-wise."""
    off, data = _offsets_data(keys)
    s = off[:-1]
    kg = (data[s].astype(np.uint16) << 8) | data[s + 1]
    longest = max(int((off[1:] - s).max(initial=0)), 12)
    return kg, data[s + 3], times_of(keys, 4), pc.binary_slice(keys.cast(pa.binary()), 12, longest)
