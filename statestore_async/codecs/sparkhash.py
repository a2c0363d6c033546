"""Row hash and key groups: Spark's own ``xxhash64``, bit for bit, on the Python side.

The JVM routes rows with the built-in ``pyspark.sql.functions.xxhash64(key columns...)``; this
module computes the very same value in Python, so both sides always agree on a key's key group
(docs/ARCHITECTURE.md, "Identities and versions").

Spark's rule (``XxHash64Function``): the running hash starts at the seed 42; for each key column in
order, a null leaves it unchanged, any other value replaces it with ``XXH64(bytes, seed=hash)``
(the previous hash as an unsigned 64-bit seed); the result is a signed 64-bit long. The bytes of a
value depend on its Spark type:

* ``boolean``: the int 1 or 0 as 4 little-endian bytes;
* ``tinyint``/``byte``, ``smallint``/``short``, ``int``/``integer``, ``date``: the sign-extended
  int32 as 4 little-endian bytes (a date is its number of days since 1970-01-01);
* ``bigint``/``long``, ``timestamp``, ``timestamp_ntz``: the int64 as 8 little-endian bytes (a
  timestamp is its number of microseconds since the epoch);
* ``float``: Java's ``floatToIntBits`` (4 bytes), with -0.0 hashed as 0.0 and every NaN as the
  canonical NaN; ``double``: ``doubleToLongBits`` (8 bytes), same normalization;
* ``string``: the UTF-8 bytes; ``binary``: the bytes;
* ``void``/``null``: always skipped.

Functions
---------
``xxh64(data, seed=0)``
    Plain XXH64 of a bytes-like object (unsigned 64-bit).
``spark_xxhash64(values, types=None, seed=42)``
    Spark's ``xxhash64`` of one row: ``values`` is the tuple/list of the key columns, ``types`` the
    Spark type names (or pyspark ``DataType`` objects), one per column. Without ``types`` the type is
    inferred per value: bool → boolean, int → bigint, float → double, str → string,
    bytes/bytearray/memoryview → binary, ``datetime.datetime`` → timestamp, ``datetime.date`` →
    date, None → skipped. So an ``int`` key column must be declared (``types=["int"]``), else it is
    hashed as a bigint, which gives a different value than Spark's for an ``IntegerType`` column.
``hash_rows(rows, types=None, seed=42)``
    ``spark_xxhash64`` of every row, as a numpy int64 array.
``hash_arrow(columns, seed=42)``
    The batch path: the hash of every row of equal-length ``pyarrow.Array``/``ChunkedArray``
    columns (or a ``Table``/``RecordBatch``), read straight from the Arrow buffers. Supported Arrow
    types: bool, int8/16/32/64, float32/64, (large_)string, (large_)binary, date32, timestamp (any
    unit; converted to microseconds like Spark, nanoseconds floored) and null.
``key_group(hash, G)`` / ``key_groups(hashes, G)``
    Spark's ``pmod(hash, G)``: the key group (0 <= kg < G) of a signed hash / of an array of them.
``partition_of_key_group(kg, G, N)`` / ``key_group_range(partition, N, G)``
    Flink's contiguous ranges: key group ``kg`` belongs to partition ``kg * N // G``; partition
    ``p`` owns ``range(ceil(p*G/N), ceil((p+1)*G/N))``. Requires ``G >= N >= 1``.

Values and their types
----------------------
* ``date``: a ``datetime.date`` (not a ``datetime``) or an int number of days since 1970-01-01.
* ``timestamp``: a ``datetime.datetime`` or an int number of microseconds since the epoch. An aware
  datetime is converted exactly; **a naive datetime is taken as UTC** (note: pyspark's
  ``createDataFrame`` takes a naive datetime in the *local* time zone of the Python process, so pass
  aware datetimes — or ints — to get the hash of the same instant Spark stores).
* ``timestamp_ntz``: the wall clock of a datetime (its tzinfo ignored, like pyspark) as if UTC.
* ``float``: a Python float is rounded to float32 (beyond its range: ±inf), like Spark does.
* Integer types accept ints (and numpy integers) but not bools; an int outside the declared type's
  range, or a value of the wrong type, raises ``EncodeError``. An unknown type name, or a row whose
  length differs from ``len(types)``, raises ``InterfaceError``.

The compiled implementation (``_ext/sparkhash.pyx``) is used when built, else the pure-Python
reference (``statestore_async._ref.sparkhash``); both give the same results.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from statestore_async.codecs import twins

if TYPE_CHECKING or twins.NO_EXTENSIONS:
    from statestore_async._ref.sparkhash import *
else:
    try:
        from statestore_async._native.sparkhash import *
    except ImportError as _exc:
        twins.missing('sparkhash', _exc)
        from statestore_async._ref.sparkhash import *


