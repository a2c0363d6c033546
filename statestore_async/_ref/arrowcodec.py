"""Arrow columns <-> encoded row tuples, the pure-Python reference (see ``statestore_async.codecs.arrowcodec``).

Every value goes through the reference row codec (``_ref.valuecodec``): a row is encoded as the
tuple of its Python values, and decoded with ``decode_row`` and then checked against the field
kinds. The compiled twin (``_ext/arrowcodec.pyx``) must give the same bytes and the same None.
"""
from __future__ import annotations

import struct
from typing import TYPE_CHECKING

from statestore_async._ref import valuecodec
from statestore_async.errors import DecodeError, EncodeError

if TYPE_CHECKING:
    from typing import Any

    import numpy as np
    from numpy.typing import NDArray

    from statestore_async._ref import Buffer, ColumnDescriptor, FieldBuffers

_INT = {1: "<b", 2: "<h", 4: "<i", 8: "<q"}
_UINT = {1: "<B", 2: "<H", 4: "<I", 8: "<Q"}
_FLOAT = {4: "<f", 8: "<d"}
_INT64_MAX = (1 << 63) - 1


def _bytes(buf: Buffer | None) -> bytes:
    return b"" if buf is None else memoryview(buf).cast("B").tobytes()


def _bit(bits: bytes, i: int) -> bool:
    return bool(bits[i >> 3] >> (i & 7) & 1)


def _offsets(buf: bytes, width: int, count: int, start: int) -> list[int]:
    fmt = "<i" if width == 4 else "<q"
    return [struct.unpack_from(fmt, buf, width * (start + i))[0] for i in range(count)]


class _Reader:
    """Row i of one column descriptor as a Python value."""

    def __init__(self, k: int, n: int, col: ColumnDescriptor) -> None:
        kind, width, validity, values, data, start = col
        if start < 0:
            raise EncodeError(f"column {k}: negative offset {start}")
        self.kind, self.width, self.start = kind, width, start
        self.validity = None if validity is None else _bytes(validity)
        self.values, self.data = _bytes(values), _bytes(data)
        if self.validity is not None and (start + n + 7) // 8 > len(self.validity):
            raise EncodeError(f"column {k}: validity of {len(self.validity)} bytes cannot hold {n} rows")
        if kind in ("i", "u", "f"):
            if (kind == "f" and width not in (4, 8)) or width not in (1, 2, 4, 8):
                raise EncodeError(f"column {k}: no {kind} values of {width} bytes")
            need = (start + n) * width
        elif kind == "b":
            need = (start + n + 7) // 8
        elif kind in ("s", "y"):
            if width not in (4, 8):
                raise EncodeError(f"column {k}: offsets are 4 or 8 bytes wide, not {width}")
            need = (start + n + 1) * width if n else 0
        elif kind == "n":
            need = 0
        else:
            raise EncodeError(f"column {k}: unknown kind {kind!r}")
        if need and (values is None or need > len(self.values)):
            raise EncodeError(f"column {k}: {len(self.values)} value bytes cannot hold {n} rows")
        if kind in ("s", "y") and n:
            offs = _offsets(self.values, width, n + 1, start)
            for i in range(n):
                if offs[i] < 0 or offs[i + 1] < offs[i] or offs[i + 1] > len(self.data):
                    raise EncodeError(f"column {k}: item {i} lies outside its {len(self.data)} data bytes")

    def value(self, i: int) -> Any:
        """The value of row i: an int, float, bool, bytes (a ``_Str`` for a string) or None, as
        the column's kind says (so ``Any``: callers know the kind)."""
        j = self.start + i
        if self.kind == "n" or (self.validity is not None and not _bit(self.validity, j)):
            return None
        if self.kind == "i":
            return struct.unpack_from(_INT[self.width], self.values, self.width * j)[0]
        if self.kind == "u":
            return struct.unpack_from(_UINT[self.width], self.values, self.width * j)[0]
        if self.kind == "f":
            return struct.unpack_from(_FLOAT[self.width], self.values, self.width * j)[0]
        if self.kind == "b":
            return _bit(self.values, j)
        b, e = _offsets(self.values, self.width, 2, j)
        raw = self.data[b:e]
        # an Arrow string holds UTF-8; its bytes are written as they are (the compiled twin copies them)
        return _Str(raw) if self.kind == "s" else raw


class _Str(bytes):
    """The UTF-8 bytes of an Arrow string item: encoded as a STR without decoding them."""


def _encode(value: object, key: bool) -> bytes:
    if isinstance(value, _Str):
        return bytes([0x06]) + valuecodec._varint(len(value)) + bytes(value)
    return valuecodec.encode_key(value) if key else valuecodec.encode_row(value)


def encode_columns(
    n: int, cols: list[ColumnDescriptor], prefixes: Buffer | None, head: bytes, head_count: int, key: bool
) -> tuple[bytes, bytes, int] | None:
    """``(offsets, data, width)`` of the n rows, or None when a value needs more than a plain INT."""
    readers = [_Reader(k, n, c) for k, c in enumerate(cols)]
    pre = None
    if prefixes is not None:
        pre = _bytes(prefixes)
        if len(pre) < 2 * n:
            raise EncodeError(f"{len(pre) // 2} key-group prefixes for {n} rows")
    start = bytes([0x08]) + valuecodec._varint(head_count + len(cols)) + head
    out = bytearray()
    offs = [0]
    for i in range(n):
        if pre is not None:
            out += struct.unpack_from("=H", pre, 2 * i)[0].to_bytes(2, "big")
        out += start
        for r in readers:
            v = r.value(i)
            if r.kind == "u" and v is not None and v > _INT64_MAX:
                return None
            out += _encode(v, key)
        offs.append(len(out))
    width = 4 if len(out) <= 0x7FFFFFFF else 8
    return b"".join(o.to_bytes(width, "little", signed=True) for o in offs), bytes(out), width


def _conforms(kind: str, width: int, v: object) -> bool:
    if kind == "n":
        return v is None
    if kind in ("i", "u"):
        if type(v) is not int:
            return False
        if kind == "u":
            return 0 <= v < (1 << (8 * width)) and v <= _INT64_MAX
        return -(1 << (8 * width - 1)) <= v < (1 << (8 * width - 1))
    if kind == "f":
        if type(v) is not float:
            return False
        if width == 4:
            try:
                struct.pack("<f", v)
            except OverflowError:
                return False
        return True
    if kind == "b":
        return type(v) is bool
    if kind == "s":
        return type(v) is str
    return type(v) is bytes  # "y"


def _pack_bits(bits: list[bool]) -> bytes:
    out = bytearray((len(bits) + 7) // 8)
    for i, b in enumerate(bits):
        if b:
            out[i >> 3] |= 1 << (i & 7)
    return bytes(out)


def decode_columns(n: int, values: ColumnDescriptor, kinds: list[tuple[str, int]]) -> list[FieldBuffers] | None:
    """Per field ``(null_count, validity, buffers...)`` of n encoded tuples (``values``: a column
    descriptor of kind "y"), or None when one does not conform."""
    if values[0] != "y":
        raise EncodeError(f"encoded tuples are a binary column (kind 'y'), not kind {values[0]!r}")
    col = _Reader(0, n, values)
    for k, (kind, w) in enumerate(kinds):
        if kind in ("i", "u", "f"):
            if (kind == "f" and w not in (4, 8)) or w not in (1, 2, 4, 8):
                raise EncodeError(f"field {k}: no {kind} values of {w} bytes")
        elif kind in ("s", "y"):
            if w not in (4, 8):
                raise EncodeError(f"field {k}: offsets are 4 or 8 bytes wide, not {w}")
        elif kind not in ("b", "n"):
            raise EncodeError(f"field {k}: unknown kind {kind!r}")
    columns: list[list[Any]] = [[] for _ in kinds]
    for i in range(n):
        raw = col.value(i)
        if raw is None:
            for c in columns:
                c.append(None)
            continue
        try:
            row = valuecodec.decode_row(raw)
        except DecodeError:
            return None
        if type(row) is not tuple or len(row) != len(kinds):
            return None
        for (kind, w), c, v in zip(kinds, columns, row):
            if v is not None and not _conforms(kind, w, v):
                return None
            c.append(v)
    result: list[FieldBuffers] = []
    for (kind, w), c in zip(kinds, columns):
        nulls = sum(v is None for v in c)
        valid = _pack_bits([v is not None for v in c]) if nulls else None
        if kind == "n":
            result.append((nulls, None))
        elif kind in ("i", "u", "f"):
            fmt = (_INT if kind == "i" else _UINT if kind == "u" else _FLOAT)[w]
            result.append((nulls, valid, b"".join(struct.pack(fmt, 0 if v is None else v) for v in c)))
        elif kind == "b":
            result.append((nulls, valid, _pack_bits([bool(v) for v in c])))
        else:
            items = [b"" if v is None else (v.encode("utf-8") if kind == "s" else v) for v in c]
            offs = [0]
            for it in items:
                offs.append(offs[-1] + len(it))
            ow = 8 if w == 8 else 4
            if ow == 4 and offs[-1] > 0x7FFFFFFF:
                return None
            result.append((nulls, valid, b"".join(o.to_bytes(ow, "little", signed=True) for o in offs), b"".join(items)))
    return result


def group_encoded(n: int, offsets: Buffer, data: Buffer, width: int, order: NDArray[np.int64],
                  bounds: NDArray[np.int64], expected_groups: int = -1) -> int:
    """Group the n items of a binary column ``(offsets, data, 0, width)`` (``encode_columns``'s
    output) by their bytes: the number of groups g, with ``bounds[0..g]`` (int64) their bounds in
    ``order`` (int64), which lists the items group by group, the groups in the order of their first
    item and the items of a group in their order. ``ValueError`` for offsets that run backwards or
    out of the data, or outputs too small. ``expected_groups`` sizes the compiled module's hash
    table in place of its estimate (tests use it to make the table grow); it changes no result."""
    if n < 0 or n > 0xFFFFFFFE or width not in (4, 8):  # at most 2**32 - 2 items
        raise ValueError(f"group_encoded: {n} items with offsets {width} bytes wide")
    out, ends = memoryview(order).cast("B").cast("q"), memoryview(bounds).cast("B").cast("q")  # type: ignore[arg-type]
    if len(out) < n or len(ends) < n + 1:
        raise ValueError(f"group_encoded: room for {len(out)} rows and {len(ends)} bounds, {n} rows given")
    raw = _bytes(offsets)
    d = _bytes(data)
    if len(raw) < (n + 1) * width:
        raise ValueError(f"group_encoded: {len(raw)} bytes of offsets for {n} items")
    ends[0] = 0
    if n == 0:
        return 0
    offs = _offsets(raw, width, n + 1, 0)
    if offs[0] < 0 or offs[0] > len(d):
        raise ValueError(f"group_encoded: item 0 starts at {offs[0]}, outside the {len(d)} bytes of data")
    for i in range(n):
        if offs[i + 1] < offs[i] or offs[i + 1] > len(d):
            raise ValueError(f"group_encoded: item {i} spans [{offs[i]}, {offs[i + 1]}), outside the "
                             f"{len(d)} bytes of data")
    groups: dict[bytes, list[int]] = {}
    for i in range(n):
        groups.setdefault(d[offs[i]:offs[i + 1]], []).append(i)
    at = 0
    for g, rows in enumerate(groups.values()):
        for i in rows:
            out[at] = i
            at += 1
        ends[g + 1] = at
    return len(groups)
