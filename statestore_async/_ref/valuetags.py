"""The tag byte that starts each value ``valuecodec`` encodes: written once here for both twins.
``_ref/valuecodec.py`` uses these names; ``_ext/valuecodec.pyx`` needs them as a C enum, which
``tests/test_formats.py`` proves equal to these."""
from __future__ import annotations

T_NONE = 0x00
T_FALSE = 0x01
T_TRUE = 0x02
T_INT = 0x03
T_BIGINT = 0x04
T_FLOAT = 0x05
T_STR = 0x06
T_BYTES = 0x07
T_TUPLE = 0x08
T_LIST = 0x09
T_DICT = 0x0A
T_DATE = 0x0B
T_DATETIME = 0x0C
T_DATETIME_UTC = 0x0D
T_DECIMAL = 0x0E
