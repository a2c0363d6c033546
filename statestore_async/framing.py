"""Protocol framing: a byte stream cut into frames, and lists of byte strings packed into payloads.

Frame (every integer little-endian)::

    u32 payload length | u8 opcode | u8 flags | u32 request id | payload

Payload pieces used by the protocol (``statestore_async.protocol``)::

    list           u32 count | (u32 length | bytes)*
    optional list  u32 count | (u32 length | bytes)*   where length 0xFFFFFFFF means None
    pairs          u32 count | (u32 key length | key | u32 value length | value)*

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
]
