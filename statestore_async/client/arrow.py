"""The handles' ``*_arrow`` calls: pyarrow arrays in as columns, answers out as one array."""
from __future__ import annotations

from typing import Any

from statestore_async.codecs import arrowframes
from statestore_async.errors import InterfaceError


def values_array(parts: list[Any]) -> Any:
    """One pyarrow array of the values of a GET's answers (``ClientProtocol.send_get_many_buffers``)."""
    arrays = [arrowframes.to_array(*p) for p in parts]
    if len(arrays) == 1:
        return arrays[0]
    import pyarrow as pa

    if any(pa.types.is_large_binary(a.type) for a in arrays):
        arrays = [a.cast(pa.large_binary()) for a in arrays]
    return pa.concat_arrays(arrays)


def pair_columns(keys: Any, values: Any) -> tuple[int, tuple[Any, ...]]:
    """``(n, (key column, value column))`` of two pyarrow arrays of equal length."""
    n, kc = arrowframes.column(keys, "keys")
    m, vc = arrowframes.column(values, "values")
    if n != m:
        raise InterfaceError(f"{n} keys but {m} values")
    return n, (kc, vc)
