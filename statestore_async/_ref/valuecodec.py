"""Row codec, pure-Python reference: a Python value <-> deterministic bytes.

This module *defines* the behaviour; ``_ext/valuecodec.pyx`` must produce the same bytes, the same
values and the same error classes (and messages). The format is documented for users in
``statestore_async.codecs.valuecodec``.
"""
from __future__ import annotations

import datetime as _dt
import struct
from decimal import Decimal
from typing import TYPE_CHECKING

from statestore_async._ref.valuetags import (
    T_BIGINT,
    T_BYTES,
    T_DATE,
    T_DATETIME,
    T_DATETIME_UTC,
    T_DECIMAL,
    T_DICT,
    T_FALSE,
    T_FLOAT,
    T_INT,
    T_LIST,
    T_NONE,
    T_STR,
    T_TRUE,
    T_TUPLE,
)
from statestore_async.errors import DecodeError, EncodeError

if TYPE_CHECKING:
    from collections.abc import Iterable
    from typing import Any

    from statestore_async._ref import Buffer, BytesLike


#: Containers may nest this deep (100 nested lists are fine, 101 are not).
MAX_DEPTH = 100
#: Longest BIGINT payload in bytes.
MAX_BIGINT_BYTES = 1024

_INT64_MIN = -(1 << 63)
_INT64_MAX = (1 << 63) - 1
_U64_MASK = (1 << 64) - 1
_EPOCH_ORDINAL = 719163  # date(1970, 1, 1).toordinal()
_MIN_ORDINAL = 1
_MAX_ORDINAL = 3652059  # date.max.toordinal()
_US_PER_DAY = 86_400_000_000
_CANONICAL_NAN = struct.pack("<Q", 0x7FF8000000000000)
_ZERO = struct.pack("<d", 0.0)
_EXP_MASK = 0x7FF0000000000000
_MANT_MASK = 0x000FFFFFFFFFFFFF
_NEG_ZERO_BITS = 0x8000000000000000
_UTC = _dt.UTC
_DATETIME_MIN_US = (_MIN_ORDINAL - _EPOCH_ORDINAL) * _US_PER_DAY
_DATETIME_MAX_US = (_MAX_ORDINAL - _EPOCH_ORDINAL + 1) * _US_PER_DAY - 1
_pack_d = struct.Struct("<d").pack
_unpack_d = struct.Struct("<d").unpack_from


# --- varints -------------------------------------------------------------------------------------
def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _zigzag(n: int) -> int:
    return ((n << 1) ^ (n >> 63)) & _U64_MASK


def _unzigzag(u: int) -> int:
    return (u >> 1) ^ -(u & 1)


def _bigint_len(v: int) -> int:
    return ((v if v >= 0 else ~v).bit_length() + 8) // 8


def _type_name(value: object) -> str:
    t = type(value)
    return t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


# --- encoding ------------------------------------------------------------------------------------
def _bytes_of(value: BytesLike) -> bytes:
    """Contents of a bytes/bytearray/memoryview (memoryview: its raw bytes in C order)."""
    if isinstance(value, memoryview):
        try:
            return value.tobytes()
        except ValueError as exc:  # released memoryview
            raise EncodeError(f"cannot read memoryview: {exc}") from None
    return bytes(value)


def _datetime_us(value: _dt.datetime) -> int:
    days = _dt.date.toordinal(value) - _EPOCH_ORDINAL
    return (
        days * _US_PER_DAY
        + value.hour * 3_600_000_000
        + value.minute * 60_000_000
        + value.second * 1_000_000
        + value.microsecond
    )


def _encode(out: bytearray, value: object, depth: int, key: bool) -> None:
    if value is None:
        out.append(T_NONE)
    elif value is True:
        out.append(T_TRUE)
    elif value is False:
        out.append(T_FALSE)
    elif isinstance(value, int):
        v = int.__index__(value)
        if _INT64_MIN <= v <= _INT64_MAX:
            out.append(T_INT)
            out += _varint(_zigzag(v))
        else:
            n = _bigint_len(v)
            if n > MAX_BIGINT_BYTES:
                raise EncodeError(f"int too large to encode ({n} bytes, at most {MAX_BIGINT_BYTES})")
            out.append(T_BIGINT)
            out += _varint(n)
            out += int.to_bytes(v, n, "big", signed=True)
    elif isinstance(value, float):
        data = _pack_d(value)
        if key:
            bits = int.from_bytes(data, "little")
            if bits & _EXP_MASK == _EXP_MASK and bits & _MANT_MASK:
                data = _CANONICAL_NAN
            elif bits == _NEG_ZERO_BITS:
                data = _ZERO
        out.append(T_FLOAT)
        out += data
    elif isinstance(value, str):
        try:
            data = str.encode(value, "utf-8")
        except UnicodeEncodeError as exc:
            raise EncodeError(f"str is not encodable as UTF-8: {exc.reason} at index {exc.start}") from None
        out.append(T_STR)
        out += _varint(len(data))
        out += data
    elif isinstance(value, (bytes, bytearray, memoryview)):
        data = _bytes_of(value)
        out.append(T_BYTES)
        out += _varint(len(data))
        out += data
    elif isinstance(value, tuple):
        if depth >= MAX_DEPTH:
            raise EncodeError(f"value nested deeper than {MAX_DEPTH} levels")
        items: tuple[object, ...] | list[object] = tuple.__getitem__(value, slice(None))
        out.append(T_TUPLE)
        out += _varint(len(items))
        for item in items:
            _encode(out, item, depth + 1, key)
    elif isinstance(value, list):
        if depth >= MAX_DEPTH:
            raise EncodeError(f"value nested deeper than {MAX_DEPTH} levels")
        items = list.copy(value)
        out.append(T_LIST)
        out += _varint(len(items))
        for item in items:
            _encode(out, item, depth + 1, key)
    elif isinstance(value, dict):
        if depth >= MAX_DEPTH:
            raise EncodeError(f"value nested deeper than {MAX_DEPTH} levels")
        pairs = []
        for k, v in list(dict.items(value)):
            kout = bytearray()
            _encode(kout, k, depth + 1, key)
            pairs.append((bytes(kout), v))
        pairs.sort(key=_first)
        for i in range(1, len(pairs)):
            if pairs[i][0] == pairs[i - 1][0]:
                raise EncodeError("dict has two keys with the same encoding")
        out.append(T_DICT)
        out += _varint(len(pairs))
        for kbytes, v in pairs:
            out += kbytes
            _encode(out, v, depth + 1, key)
    elif isinstance(value, _dt.datetime):
        offset = _dt.datetime.utcoffset(value)
        us = _datetime_us(value)
        if offset is None:
            out.append(T_DATETIME)
        else:
            us -= (offset.days * 86400 + offset.seconds) * 1_000_000 + offset.microseconds
            if not _DATETIME_MIN_US <= us <= _DATETIME_MAX_US:
                raise EncodeError("datetime is out of range once converted to UTC")
            out.append(T_DATETIME_UTC)
        out += _varint(_zigzag(us))
    elif isinstance(value, _dt.date):
        out.append(T_DATE)
        out += _varint(_zigzag(_dt.date.toordinal(value) - _EPOCH_ORDINAL))
    elif isinstance(value, Decimal):
        data = _decimal_text(value).encode("ascii")
        out.append(T_DECIMAL)
        out += _varint(len(data))
        out += data
    else:
        raise EncodeError(f"cannot encode a value of type {_type_name(value)}")


def _decimal_text(value: Decimal) -> str:
    # str() writes "e" instead of "E" when the context says capitals=0: keep the bytes the same.
    return Decimal.__str__(value).replace("e", "E")


def _first(pair: tuple[bytes, object]) -> bytes:
    return pair[0]


def encode_row(value: object) -> bytes:
    """Encode ``value`` as bytes (see ``statestore_async.codecs.valuecodec`` for the format)."""
    out = bytearray()
    _encode(out, value, 0, False)
    return bytes(out)


def encode_key(value: object) -> bytes:
    """Like ``encode_row``, with floats normalized as Spark does for grouping keys."""
    out = bytearray()
    _encode(out, value, 0, True)
    return bytes(out)


def _encode_many(values: Iterable[object], key: bool) -> list[bytes]:
    result = []
    for i, value in enumerate(values):
        out = bytearray()
        try:
            _encode(out, value, 0, key)
        except EncodeError as exc:
            raise EncodeError(f"row {i}: {exc}") from None
        result.append(bytes(out))
    return result


def encode_rows(values: Iterable[object]) -> list[bytes]:
    """``[encode_row(v) for v in values]``; errors say which row failed."""
    return _encode_many(values, False)


def encode_keys(values: Iterable[object]) -> list[bytes]:
    """``[encode_key(v) for v in values]``; errors say which row failed."""
    return _encode_many(values, True)


# --- decoding ------------------------------------------------------------------------------------
def _as_bytes(data: Buffer) -> bytes:
    """The raw bytes of a C-contiguous bytes-like object (TypeError for anything else)."""
    if isinstance(data, bytes):
        return data
    try:
        view = memoryview(data)
    except TypeError:
        raise TypeError(f"expected a bytes-like object, got {_type_name(data)}") from None
    if not view.c_contiguous:
        raise TypeError("expected a C-contiguous bytes-like object")
    return view.tobytes()


class _Reader:
    __slots__ = ("buf", "end", "pos")

    def __init__(self, buf: bytes):
        self.buf = buf
        self.pos = 0
        self.end = len(buf)

    def varint(self) -> int:
        buf = self.buf
        start = pos = self.pos
        result = 0
        shift = 0
        while True:
            if pos >= self.end:
                raise DecodeError(f"truncated varint at offset {start}")
            b = buf[pos]
            pos += 1
            if shift == 63 and b > 1:
                raise DecodeError(f"varint overflows 64 bits at offset {start}")
            result |= (b & 0x7F) << shift
            if not b & 0x80:
                if b == 0 and pos - start > 1:
                    raise DecodeError(f"non-canonical varint at offset {start}")
                break
            shift += 7
            if shift > 63:
                raise DecodeError(f"varint longer than 10 bytes at offset {start}")
        self.pos = pos
        return result

    def length(self, what: str) -> int:
        start = self.pos
        n = self.varint()
        if n > self.end - self.pos:
            raise DecodeError(
                f"{what} length {n} at offset {start} exceeds the {self.end - self.pos} remaining bytes"
            )
        return n

    def count(self, what: str, min_size: int) -> int:
        start = self.pos
        n = self.varint()
        if n > (self.end - self.pos) // min_size:
            raise DecodeError(
                f"{what} count {n} at offset {start} exceeds what the {self.end - self.pos} "
                "remaining bytes can hold"
            )
        return n


def _decode(r: _Reader, depth: int) -> Any:
    v: object  # the decoded value (its type depends on the tag)
    pos = r.pos
    if pos >= r.end:
        raise DecodeError(f"truncated: expected a value at offset {pos}")
    tag = r.buf[pos]
    r.pos = pos + 1
    if tag == T_NONE:
        return None
    if tag == T_FALSE:
        return False
    if tag == T_TRUE:
        return True
    if tag == T_INT:
        return _unzigzag(r.varint())
    if tag == T_BIGINT:
        start = r.pos
        n = r.length("bigint")
        if n == 0 or n > MAX_BIGINT_BYTES:
            raise DecodeError(f"bigint length {n} at offset {start} not in 1..{MAX_BIGINT_BYTES}")
        v = int.from_bytes(r.buf[r.pos : r.pos + n], "big", signed=True)
        if _INT64_MIN <= v <= _INT64_MAX:
            raise DecodeError(f"bigint at offset {pos} holds an int64 value")
        if _bigint_len(v) != n:
            raise DecodeError(f"non-minimal bigint at offset {pos}")
        r.pos += n
        return v
    if tag == T_FLOAT:
        if r.end - r.pos < 8:
            raise DecodeError(f"truncated float at offset {pos}")
        v = _unpack_d(r.buf, r.pos)[0]
        r.pos += 8
        return v
    if tag == T_STR:
        n = r.length("str")
        start = r.pos
        try:
            v = r.buf[start : start + n].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise DecodeError(f"invalid UTF-8 in str at offset {start + exc.start}") from None
        r.pos = start + n
        return v
    if tag == T_BYTES:
        n = r.length("bytes")
        v = r.buf[r.pos : r.pos + n]
        r.pos += n
        return v
    if tag in (T_TUPLE, T_LIST):
        if depth >= MAX_DEPTH:
            raise DecodeError(f"value nested deeper than {MAX_DEPTH} levels at offset {pos}")
        n = r.count("tuple" if tag == T_TUPLE else "list", 1)
        items = [_decode(r, depth + 1) for _ in range(n)]
        return tuple(items) if tag == T_TUPLE else items
    if tag == T_DICT:
        if depth >= MAX_DEPTH:
            raise DecodeError(f"value nested deeper than {MAX_DEPTH} levels at offset {pos}")
        n = r.count("dict", 2)
        result: dict[object, object] = {}
        prev = None
        for _ in range(n):
            kstart = r.pos
            k = _decode(r, depth + 1)
            kbytes = r.buf[kstart : r.pos]
            if prev is not None and kbytes <= prev:
                raise DecodeError(f"dict key at offset {kstart} out of order or repeated")
            prev = kbytes
            try:
                hash(k)
            except TypeError:
                raise DecodeError(f"unhashable dict key at offset {kstart}") from None
            v = _decode(r, depth + 1)
            size = len(result)
            result[k] = v
            if len(result) == size:
                raise DecodeError(f"dict key at offset {kstart} equals an earlier key")
        return result
    if tag == T_DATE:
        days = _unzigzag(r.varint())
        ordinal = days + _EPOCH_ORDINAL
        if not _MIN_ORDINAL <= ordinal <= _MAX_ORDINAL:
            raise DecodeError(f"date out of range at offset {pos}")
        return _dt.date.fromordinal(ordinal)
    if tag in (T_DATETIME, T_DATETIME_UTC):
        us = _unzigzag(r.varint())
        if not _DATETIME_MIN_US <= us <= _DATETIME_MAX_US:
            raise DecodeError(f"datetime out of range at offset {pos}")
        days, rest = divmod(us, _US_PER_DAY)
        d = _dt.date.fromordinal(days + _EPOCH_ORDINAL)
        secs, micro = divmod(rest, 1_000_000)
        hour, secs = divmod(secs, 3600)
        minute, second = divmod(secs, 60)
        tz = _UTC if tag == T_DATETIME_UTC else None
        return _dt.datetime(d.year, d.month, d.day, hour, minute, second, micro, tz)
    if tag == T_DECIMAL:
        n = r.length("decimal")
        start = r.pos
        raw = r.buf[start : start + n]
        try:
            text = raw.decode("ascii")
            v = Decimal(text)
            ok = _decimal_text(v) == text
        except Exception:
            ok = False
        if not ok:
            raise DecodeError(f"invalid decimal text at offset {start}")
        r.pos = start + n
        return v
    raise DecodeError(f"unknown tag 0x{tag:02x} at offset {pos}")


def _decode_all(buf: bytes) -> Any:
    r = _Reader(buf)
    value = _decode(r, 0)
    if r.pos != r.end:
        raise DecodeError(f"{r.end - r.pos} trailing bytes at offset {r.pos}")
    return value


def decode_row(data: Buffer) -> Any:
    """Decode bytes made by ``encode_row``/``encode_key``; must consume all of ``data``."""
    return _decode_all(_as_bytes(data))


def decode_rows(datas: Iterable[Buffer]) -> list[Any]:
    """``[decode_row(d) for d in datas]``; errors say which row failed."""
    result = []
    for i, data in enumerate(datas):
        buf = _as_bytes(data)
        try:
            result.append(_decode_all(buf))
        except DecodeError as exc:
            raise DecodeError(f"row {i}: {exc}") from None
    return result
