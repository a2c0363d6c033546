"""Pure-Python references of the compiled modules in ``_ext/``: same functions, same bytes.

They define the behaviour; tests check the compiled twins against them on random inputs.

The type aliases below are shared by the twins' signatures and their facades (``codecs``,
``engine.table``); they exist for type checkers only (import them under ``TYPE_CHECKING``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import Any, TypeAlias

    import numpy as np
    from numpy.typing import NDArray
    from typing_extensions import Buffer as Buffer  # collections.abc.Buffer (Python 3.12+)

    #: What encoders copy as bytes (anything else raises ``EncodeError``).
    BytesLike: TypeAlias = bytes | bytearray | memoryview
    #: A column of Arrow binary layout, ``(offsets, data, start, width)`` (``codecs.arrowframes``).
    ArrowColumn: TypeAlias = tuple[Buffer, Buffer, int, int]
    #: A column descriptor ``(kind, width, validity, values, data, offset)`` (``codecs.arrowcodec``).
    ColumnDescriptor: TypeAlias = tuple[str, int, Buffer | None, Buffer | None, Buffer | None, int]
    #: One decoded field ``(null_count, validity, buffers...)`` (``arrowcodec.decode_columns``).
    FieldBuffers: TypeAlias = tuple[int, bytes | None, *tuple[bytes, ...]]
    #: Key groups of rows: a numpy integer array (``sparkhash.key_groups``) or a sequence of ints.
    KeyGroups: TypeAlias = Sequence[int] | NDArray[np.integer[Any]]
