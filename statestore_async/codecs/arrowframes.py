"""Batch requests from Arrow arrays and answers into Arrow arrays, without a Python object per item.

A *column* is the Arrow layout of a binary array: ``(offsets, data, start, width)`` where item i is
``data[off(start + i) : off(start + i + 1)]`` and ``off`` reads little-endian signed integers of
``width`` bytes (4: ``binary``, 8: ``large_binary``) from ``offsets``. Any buffer-protocol object
works (``pyarrow.Buffer``, bytes, numpy arrays).

``encode_frame_list_buffers(opcode, flags, request_id, head, n, keys) -> bytes``
``encode_frame_pairs_buffers(opcode, flags, request_id, head, n, keys, values) -> bytes``
    The same frame as ``framing.encode_frame_list`` / ``encode_frame_pairs`` of the n items of
    the column(s). Offsets that run backwards or out of the data raise ``EncodeError``.
``decode_optional_list_buffers(buf, offset, max_count) -> (n, null_count, validity, offsets, data, width, end)``
    An ``encode_optional_list`` payload cut into Arrow buffers (``validity`` None when nothing is
    absent; ``width`` 8 only past 2**31 - 1 data bytes). Errors as ``framing.decode_optional_list``.

``column(array)`` and ``to_array(...)`` convert from and to ``pyarrow`` arrays (imported on use).
Compiled from ``_ext/arrowframes.pyx`` when built, else ``statestore_async._ref.arrowframes``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from statestore_async.codecs import twins
from statestore_async.errors import InterfaceError

if TYPE_CHECKING:
    import pyarrow as pa

    from statestore_async._ref import ArrowColumn, Buffer

if TYPE_CHECKING or twins.NO_EXTENSIONS:
    from statestore_async._ref.arrowframes import *
else:
    try:
        from statestore_async._native.arrowframes import *
    except ImportError as _exc:
        twins.missing('arrowframes', _exc)
        from statestore_async._ref.arrowframes import *


def column(array: pa.Array | pa.ChunkedArray, what: str = "keys") -> tuple[int, ArrowColumn]:
    """``(length, column)`` of a pyarrow ``binary`` / ``large_binary`` array (or chunked array) without nulls."""
    import pyarrow as pa

    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    if not isinstance(array, pa.Array):
        raise InterfaceError(f"{what} must be a pyarrow array, got {type(array).__name__}")
    if pa.types.is_binary(array.type):
        width = 4
    elif pa.types.is_large_binary(array.type):
        width = 8
    else:
        raise InterfaceError(f"{what} must be a pyarrow binary or large_binary array, got {array.type}")
    if array.null_count:
        raise InterfaceError(f"{what} must not hold nulls ({array.null_count} found)")
    _, offsets, data = array.buffers()
    return len(array), (offsets, data if data is not None else b"", array.offset, width)


def to_array(n: int, null_count: int, validity: Buffer | None, offsets: Buffer, data: Buffer, width: int) -> pa.Array:
    """The pyarrow ``binary`` (``large_binary`` for width 8) array of decoded buffers (null: absent)."""
    import pyarrow as pa

    typ = pa.binary() if width == 4 else pa.large_binary()
    bufs = [None if validity is None else pa.py_buffer(validity), pa.py_buffer(offsets), pa.py_buffer(data)]
    return pa.Array.from_buffers(typ, n, bufs, null_count)


