"""Spark's types as ``sparkhash`` knows them, by code and by name: written once here for both
twins. ``_ref/sparkhash.py`` and ``_ext/sparkhash.pyx`` both use ``TYPE_NAMES`` and ``CODE_NAMES``
from here; the compiled one needs the codes as a C enum too, which ``tests/test_formats.py`` proves
equal to these."""
from __future__ import annotations

T_SKIP = 0
T_BOOLEAN = 1
T_TINYINT = 2
T_SMALLINT = 3
T_INT = 4
T_BIGINT = 5
T_FLOAT = 6
T_DOUBLE = 7
T_STRING = 8
T_BINARY = 9
T_DATE = 10
T_TIMESTAMP = 11
T_TIMESTAMP_NTZ = 12

TYPE_NAMES = {
    "void": T_SKIP,
    "null": T_SKIP,
    "boolean": T_BOOLEAN,
    "bool": T_BOOLEAN,
    "tinyint": T_TINYINT,
    "byte": T_TINYINT,
    "smallint": T_SMALLINT,
    "short": T_SMALLINT,
    "int": T_INT,
    "integer": T_INT,
    "bigint": T_BIGINT,
    "long": T_BIGINT,
    "float": T_FLOAT,
    "real": T_FLOAT,
    "double": T_DOUBLE,
    "string": T_STRING,
    "binary": T_BINARY,
    "date": T_DATE,
    "timestamp": T_TIMESTAMP,
    "timestamp_ltz": T_TIMESTAMP,
    "timestamp_ntz": T_TIMESTAMP_NTZ,
}

CODE_NAMES = {
    T_BOOLEAN: "boolean",
    T_TINYINT: "tinyint",
    T_SMALLINT: "smallint",
    T_INT: "int",
    T_BIGINT: "bigint",
    T_FLOAT: "float",
    T_DOUBLE: "double",
    T_STRING: "string",
    T_BINARY: "binary",
    T_DATE: "date",
    T_TIMESTAMP: "timestamp",
    T_TIMESTAMP_NTZ: "timestamp_ntz",
}
