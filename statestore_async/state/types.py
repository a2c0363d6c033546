"""Types of stored state values, inferred from the values themselves, and their Arrow columns.

State values are plain Python values (``codecs.valuecodec``): the store records no types. A column
of them gets the narrowest Arrow (and so Spark) type every value fits: ints → int64, floats (and
ints beside them) → float64, str, bytes, bool, dates, datetimes (UTC → timestamp with time zone,
naive → timestamp without), Decimals → decimal128, lists → list, tuples → struct with fields
``_1``, ``_2``, … (a tuple has no field names), dicts → map. Values that fit no one type (a str
beside an int, tuples of different lengths, ints beyond 64 bits, NaN Decimals, dicts with None
keys) make the whole column JSON text instead. A column of nothing but None is a string column.

Types are small tuples (picklable, hashable), so Spark tasks can infer the types of their
partition and the driver merge them (``merge``) before it fixes the DataFrame's schema.
"""
from __future__ import annotations

import datetime as dt
import json
from decimal import Decimal
from typing import Any

import pyarrow as pa

Type = tuple  # ("long",), ("list", elem), ("struct", (t1, t2, ...)), ("map", key, value), ...

NULL: Type = ("null",)
JSON: Type = ("json",)
_SCALARS: dict[type, Type] = {bool: ("bool",), int: ("long",), float: ("double",), str: ("string",),
                              bytes: ("binary",), dt.date: ("date",)}
_INT64 = (-(1 << 63), (1 << 63) - 1)
MAX_DECIMAL_DIGITS = 38


class _Incompatible(Exception):
    """Two values of one column have no common type."""


def infer(value: Any) -> Type:
    """The type of one value (``JSON`` when it has none but text)."""
    try:
        return _infer(value)
    except _Incompatible:
        return JSON


def _infer(v: Any) -> Type:
    if v is None:
        return NULL
    t = _SCALARS.get(type(v))
    if t is not None:
        if t == ("long",) and not _INT64[0] <= v <= _INT64[1]:
            raise _Incompatible
        return t
    if isinstance(v, dt.datetime):
        return ("ts",) if v.tzinfo is not None else ("ts_ntz",)
    if isinstance(v, Decimal):
        _sign, digits, exp = v.as_tuple()
        if not isinstance(exp, int):  # NaN, infinity
            raise _Incompatible
        scale = -exp if exp < 0 else 0
        return ("decimal", max(len(digits) + exp, 0), scale)
    if isinstance(v, list):
        elem = NULL
        for x in v:
            elem = _merge(elem, _infer(x))
        return ("list", elem)
    if isinstance(v, tuple):
        return ("struct", tuple(_infer(x) for x in v))
    if isinstance(v, dict):
        k_t, v_t = NULL, NULL
        for k, x in v.items():
            if k is None:
                raise _Incompatible  # a Spark map has no null keys
            k_t, v_t = _merge(k_t, _infer(k)), _merge(v_t, _infer(x))
        return ("map", k_t, v_t)
    raise _Incompatible


def _fits(v: Any, t: Type) -> bool:
    """Whether ``v`` is of type ``t`` already (False: infer and merge; never wrong, may be
    conservative)."""
    if v is None:
        return True
    k = t[0]
    s = _SCALARS.get(type(v))
    if s is not None:
        if s[0] == "long":
            return (k == "long" or k == "double") and _INT64[0] <= v <= _INT64[1]
        return s == t
    if k == "struct":
        return type(v) is tuple and len(v) == len(t[1]) and all(_fits(x, f) for x, f in zip(v, t[1]))
    if k == "list":
        return type(v) is list and all(_fits(x, t[1]) for x in v)
    if k == "map":
        return type(v) is dict and all(x is not None and _fits(x, t[1]) and _fits(y, t[2]) for x, y in v.items())
    return False


def merge(a: Type, b: Type) -> Type:
    """The narrowest type both ``a`` and ``b`` fit (``JSON`` when there is none)."""
    try:
        return _merge(a, b)
    except _Incompatible:
        return JSON


def _merge(a: Type, b: Type) -> Type:
    if a == b:
        return a
    if a == NULL:
        return b
    if b == NULL:
        return a
    if a == JSON or b == JSON:
        raise _Incompatible
    kinds = {a[0], b[0]}
    if kinds == {"long", "double"}:
        return ("double",)
    if kinds == {"long", "decimal"}:
        d = a if a[0] == "decimal" else b
        return ("decimal", max(d[1], 19), d[2])
    if a[0] != b[0]:
        raise _Incompatible
    if a[0] == "decimal":
        return ("decimal", max(a[1], b[1]), max(a[2], b[2]))
    if a[0] == "list":
        return ("list", _merge(a[1], b[1]))
    if a[0] == "map":
        return ("map", _merge(a[1], b[1]), _merge(a[2], b[2]))
    if a[0] == "struct" and len(a[1]) == len(b[1]):
        return ("struct", tuple(_merge(x, y) for x, y in zip(a[1], b[1])))
    raise _Incompatible


class ColumnType:
    """The type of a column so far, fed value by value (``observe``) or merged with another's."""

    __slots__ = ("type",)

    def __init__(self, t: Type = NULL):
        self.type = t

    def observe(self, value: Any) -> None:
        if self.type == JSON or value is None or _fits(value, self.type):
            return  # the common case: one more value of the column's type
        self.type = merge(self.type, infer(value))

    def observe_all(self, values: list) -> None:
        for v in values:
            self.observe(v)
            if self.type == JSON:
                return


def _resolve_null(t: Type) -> Type:
    """``t`` with every part still unknown (no non-None value seen) made a string."""
    if t == NULL:
        return ("string",)
    if t[0] == "list":
        return ("list", _resolve_null(t[1]))
    if t[0] == "map":
        return ("map", _resolve_null(t[1]), _resolve_null(t[2]))
    if t[0] == "struct":
        return ("struct", tuple(_resolve_null(x) for x in t[1]))
    return t


def _too_wide(t: Type) -> bool:
    if t[0] == "decimal":
        return t[1] + t[2] > MAX_DECIMAL_DIGITS
    if t[0] == "list":
        return _too_wide(t[1])
    if t[0] == "map":
        return _too_wide(t[1]) or _too_wide(t[2])
    if t[0] == "struct":
        return any(_too_wide(x) for x in t[1])
    return False


def final(t: Type) -> Type:
    """The type a column of inferred type ``t`` is written as."""
    t = _resolve_null(t)
    return JSON if _too_wide(t) else t


_ARROW: dict[str, pa.DataType] = {
    "bool": pa.bool_(), "long": pa.int64(), "double": pa.float64(), "string": pa.string(), "binary": pa.binary(),
    "date": pa.date32(), "ts": pa.timestamp("us", tz="UTC"), "ts_ntz": pa.timestamp("us"), "json": pa.string(),
}


def arrow_type(t: Type) -> pa.DataType:
    """The Arrow type of a ``final`` type."""
    if t[0] in _ARROW:
        return _ARROW[t[0]]
    if t[0] == "decimal":
        return pa.decimal128(max(t[1] + t[2], 1), t[2])
    if t[0] == "list":
        return pa.list_(arrow_type(t[1]))
    if t[0] == "map":
        return pa.map_(arrow_type(t[1]), arrow_type(t[2]))
    if t[0] == "struct":
        return pa.struct([(f"_{i + 1}", arrow_type(x)) for i, x in enumerate(t[1])])
    raise ValueError(f"not a state type: {t!r}")


def to_json(value: Any) -> str | None:
    """A value as JSON text (None stays None): tuples as arrays, dicts with other than text,
    number or bool keys as arrays of ``[key, value]`` pairs; dates, datetimes, Decimals and
    bytes as their ``str``."""
    if value is None:
        return None
    return json.dumps(_jsonable(value), default=str, separators=(",", ":"))


def _jsonable(v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        if all(isinstance(k, (str, int, float, bool)) for k in v):
            return {k: _jsonable(x) for k, x in v.items()}
        return [[_jsonable(k), _jsonable(x)] for k, x in v.items()]
    return v


def _needs_conform(t: Type) -> bool:
    if t[0] in ("double", "decimal"):
        return True
    if t[0] == "list":
        return _needs_conform(t[1])
    if t[0] == "map":
        return _needs_conform(t[1]) or _needs_conform(t[2])
    if t[0] == "struct":
        return any(_needs_conform(x) for x in t[1])
    return False


def _conform(v: Any, t: Type) -> Any:
    """``v`` with the ints of double or decimal parts made floats or Decimals."""
    if v is None:
        return None
    k = t[0]
    if k == "double":
        return float(v)
    if k == "decimal":
        return Decimal(v) if isinstance(v, int) else v
    if k == "list":
        return [_conform(x, t[1]) for x in v]
    if k == "map":
        return [(_conform(a, t[1]), _conform(b, t[2])) for a, b in v.items()]
    if k == "struct":
        return tuple(_conform(x, s) for x, s in zip(v, t[1]))
    return v


def column(values: list, t: Type) -> pa.Array:
    """An Arrow array of ``values`` (None: null) as the ``final`` type ``t``."""
    if t == JSON:
        return pa.array([to_json(v) for v in values], pa.string())
    if _needs_conform(t):
        values = [_conform(v, t) for v in values]
    return pa.array(values, arrow_type(t))


def to_python(value: Any, t: Type) -> Any:
    """What ``column`` makes of ``value``, read back as a Python value (Arrow's ``to_pylist``
    form): structs as dicts of ``_1``, ``_2``, …, maps as lists of ``(key, value)``."""
    return column([value], t).to_pylist()[0]


__all__ = ["JSON", "NULL", "ColumnType", "arrow_type", "column", "final", "infer", "merge", "to_json", "to_python"]
