"""Protocol framing: a byte stream cut into frames, and lists of byte strings packed into payloads.

Frame (every integer little-endian)::

    u32 payload length | u8 opcode | u8 flags | u32 request id | payload

Payload pieces used by the protocol (``statestore_async.protocol``)::

    list           u32 count | (u32 length | bytes)*
    optional list  u32 count | (u32 length | bytes)*   where length 0xFFFFFFFF means None
    pairs          u32 count | (u32 key length | key | u32 value length | value)*

``check_list`` / ``check_pairs`` validate a payload exactly as the decoders do (same errors) and
return ``(count, end)`` without building anything; ``encode_frame_list`` / ``encode_frame_pairs``
write a whole frame (header, a fixed ``head`` such as a handle, then the list) in one step.
``PackedList`` / ``PackedPairs`` carry such a validated payload as a lazy, read-only sequence, so
that the daemon can hand a batch to the engine without decoding it into Python objects first.

Decoders are strict: a count larger than ``max_count`` or than the bytes left could hold, or a
length that overruns the buffer, raises ``DecodeError`` before anything large is allocated.
Encoders take bytes (bytearray/memoryview are copied) and raise ``EncodeError`` for anything else.

The compiled implementation (``_ext/framing.pyx``) is used when built, else the pure-Python
reference (``statestore_async._ref.framing``); both give the same bytes, values and errors.
"""
from __future__ import annotations

from ._accel import implementation

_impl = implementation("framing")

HEADER_SIZE = _impl.HEADER_SIZE
NONE_LEN = _impl.NONE_LEN
MAX_ITEM_LEN = _impl.MAX_ITEM_LEN
encode_frame = _impl.encode_frame
split_frames = _impl.split_frames
encode_list = _impl.encode_list
decode_list = _impl.decode_list
encode_optional_list = _impl.encode_optional_list
decode_optional_list = _impl.decode_optional_list
encode_pairs = _impl.encode_pairs
decode_pairs = _impl.decode_pairs
check_list = _impl.check_list
check_pairs = _impl.check_pairs
encode_frame_list = _impl.encode_frame_list
encode_frame_pairs = _impl.encode_frame_pairs


class _Packed:
    """A validated payload (``buf`` from ``offset`` to its end) seen as a read-only sequence.

    ``len()`` is free; the items are decoded on first use only. Equal to a list of the same items.
    """

    __slots__ = ("buf", "offset", "count", "_items")
    _decode = None

    def __init__(self, buf, offset: int, count: int):
        self.buf = buf
        self.offset = offset
        self.count = count
        self._items = None

    @property
    def items(self) -> list:
        if self._items is None:
            self._items = type(self)._decode(self.buf, self.offset)[0]
        return self._items

    def __len__(self) -> int:
        return self.count

    def __iter__(self):
        return iter(self.items)

    def __getitem__(self, i):
        return self.items[i]

    def __eq__(self, other):
        if isinstance(other, _Packed):
            other = other.items
        return self.items == other if isinstance(other, list) else NotImplemented

    __hash__ = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.items!r})"


class PackedList(_Packed):
    """The byte strings of a validated ``encode_list`` payload."""

    __slots__ = ()
    _decode = staticmethod(decode_list)


class PackedPairs(_Packed):
    """The (key, value) pairs of a validated ``encode_pairs`` payload."""

    __slots__ = ()
    _decode = staticmethod(decode_pairs)

__all__ = [
    "HEADER_SIZE",
    "NONE_LEN",
    "MAX_ITEM_LEN",
    "encode_frame",
    "split_frames",
    "encode_list",
    "decode_list",
    "encode_optional_list",
    "decode_optional_list",
    "encode_pairs",
    "decode_pairs",
    "check_list",
    "check_pairs",
    "encode_frame_list",
    "encode_frame_pairs",
    "PackedList",
    "PackedPairs",
]
