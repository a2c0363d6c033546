"""Protocol framing: a byte stream cut into frames, and lists of byte strings packed into payloads.

Frame (every integer little-endian)::

    u32 payload length | u8 opcode | u8 flags | u32 request id | payload

Payload pieces used by the protocol (``statestore_async.wire.protocol``)::

    list           u32 count | (u32 length | bytes)*
    optional list  u32 count | (u32 length | bytes)*   where length 0xFFFFFFFF means None
    pairs          u32 count | (u32 key length | key | u32 value length | value)*

``check_list`` / ``check_pairs`` validate a payload exactly as the decoders do (same errors) and
return ``(count, end)`` without building anything; ``encode_frame_list`` / ``encode_frame_pairs``
write a whole frame (header, a fixed ``head`` such as a handle, then the list) in one step.
``list_offsets(buf, offset)`` gives, for a validated list payload, the offset of each item's
bytes (int64 little-endian), so that a batch lookup reads a request's keys in place; and
``encode_found(values, voff, vlen, found)`` writes such a lookup's answer as an optional list
(item ``i``: ``values[voff[i]:voff[i] + vlen[i]]`` when ``found[i]`` and ``vlen[i] >= 0``, else
None) with no Python object per item (``engine.lookup``).
``PackedList`` / ``PackedPairs`` carry such a validated payload as a lazy, read-only sequence, so
that the daemon can hand a batch to the engine without decoding it into Python objects first.

Decoders are strict: a count larger than ``max_count`` or than the bytes left could hold, or a
length that overruns the buffer, raises ``DecodeError`` before anything large is allocated.
Encoders take bytes (bytearray/memoryview are copied) and raise ``EncodeError`` for anything else.

The compiled implementation (``_ext/framing.pyx``) is used when built, else the pure-Python
reference (``statestore_async._ref.framing``); both give the same bytes, values and errors.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from statestore_async.codecs import twins

if TYPE_CHECKING or twins.NO_EXTENSIONS:
    from statestore_async._ref.framing import *
else:
    try:
        from statestore_async._native.framing import *
    except ImportError as _exc:
        twins.missing('framing', _exc)
        from statestore_async._ref.framing import *


