"""Row codec: a Python value <-> bytes, deterministic, so that encoded rows can serve as keys.

The functions come from the compiled module when it is built (``statestore_async._native``), else
from the pure-Python reference (``statestore_async._ref``); both give the same bytes and errors.

Functions
---------
``encode_row(value) -> bytes``
    Encode a value. Equal values of the same types give equal bytes (dict order does not matter).
``encode_key(value) -> bytes``
    Like ``encode_row``, but floats are normalized as Spark normalizes grouping keys, at any
    depth: ``-0.0`` becomes ``0.0`` and every NaN becomes the quiet NaN ``0x7ff8000000000000``.
``decode_row(data) -> value``
    Decode a bytes-like object (bytes, bytearray, C-contiguous memoryview) that must hold exactly
    one encoded value. Malformed input raises ``DecodeError`` naming the problem and its offset;
    a declared length or count larger than the remaining bytes is rejected before anything is
    allocated. A non bytes-like argument raises ``TypeError``.
``encode_rows(values)``, ``encode_keys(values)``, ``decode_rows(datas)``
    Batch forms returning lists; an error names the row (``"row 17: ..."``).

Format
------
A value is a tag byte followed by a payload. Varints are unsigned LEB128 in their shortest form
(decoders reject longer forms and more than 10 bytes); "zigzag" maps a signed int64 n to the
unsigned ``(n << 1) ^ (n >> 63)``.

====  ============  =================================================================================
tag   type          payload
====  ============  =================================================================================
0x00  None          (none)
0x01  False         (none)
0x02  True          (none)
0x03  INT           zigzag varint; ints in ``[-2**63, 2**63 - 1]``
0x04  BIGINT        varint n (1..1024), then n bytes big-endian two's complement in the fewest bytes;
                    only for ints outside int64 (decoders reject int64 values and longer forms)
0x05  FLOAT         8 bytes IEEE-754 binary64 little-endian; ``encode_row`` keeps the bits exactly
                    (NaN payloads, -0.0)
0x06  STR           varint n, n bytes of strict UTF-8 (lone surrogates cannot be encoded)
0x07  BYTES         varint n, n bytes; from bytes, bytearray or memoryview (its raw bytes in C order),
                    always decoded as bytes
0x08  TUPLE         varint count, then count values; tuple subclasses (namedtuple, pyspark Row)
                    decode as plain tuples
0x09  LIST          varint count, then count values
0x0A  DICT          varint count, then count (key, value) pairs sorted by the bytes of the encoded key;
                    decoders reject keys out of order, repeated, equal to an earlier key, or
                    unhashable
0x0B  DATE          zigzag varint days since 1970-01-01 (a ``datetime.date`` that is not a datetime)
0x0C  DATETIME      zigzag varint microseconds since 1970-01-01T00:00:00 of a naive datetime;
                    decodes naive
0x0D  DATETIME_UTC  zigzag varint microseconds since the epoch in UTC, for an aware datetime; decodes
                    with ``tzinfo=datetime.timezone.utc``. The original time zone is NOT kept: only
                    the instant is (so aware datetimes that are equal encode equal)
0x0E  DECIMAL       varint n, n ASCII bytes of ``str(decimal.Decimal)`` (exponent written with "E");
                    decoded with ``Decimal(text)``, which must give back the same text
====  ============  =================================================================================

Rules and limits
----------------
* ``bool`` is checked before ``int``. Subclasses of int, float, str, bytes, bytearray, tuple,
  list, dict, date/datetime and Decimal encode as their base type (an ``IntEnum`` as INT, a
  ``numpy.float64`` as FLOAT); anything else (e.g. ``numpy.int64``, sets) raises ``EncodeError``
  naming the type.
* Containers nest at most ``MAX_DEPTH`` = 100 levels (a value that contains itself hits this
  limit): deeper values raise ``EncodeError``/``DecodeError``, never ``RecursionError``.
* A dict whose keys encode to the same bytes (two distinct NaN keys, for example) raises
  ``EncodeError``: it could not be decoded.
* Equal values of different types encode differently: ``1``, ``1.0``, ``True`` and
  ``Decimal("1")`` are four encodings, and ``Decimal("1.0")`` differs from ``Decimal("1.00")``.
* The ``fold`` of a datetime and any sub-microsecond precision of datetime subclasses (pandas
  ``Timestamp`` nanoseconds) are not kept. Aware datetimes whose UTC instant falls outside
  ``datetime.min``..``datetime.max`` raise ``EncodeError``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from statestore_async.codecs import twins

if TYPE_CHECKING or twins.NO_EXTENSIONS:
    from statestore_async._ref.valuecodec import *
else:
    try:
        from statestore_async._native.valuecodec import *
    except ImportError as _exc:
        twins.missing('valuecodec', _exc)
        from statestore_async._ref.valuecodec import *


