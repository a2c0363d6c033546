"""The constants of each stored format agree between the twins of its codec.

A compiled module needs some of them at C level (a ``cdef enum``); the pure-Python twin takes the
same facts from one module (``_ref/valuetags.py``, ``_ref/sparktypes.py``, ``_ref/blockcodec.py``),
which the compiled one imports for what it needs as Python objects. These tests read the enums
from the Cython sources, so they hold without a build too.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from statestore_async._ref import blockcodec, sparktypes, valuetags
from statestore_async.codecs import twins

EXT = Path(__file__).resolve().parent.parent / "_ext"


def _enums(pyx: str) -> dict[str, int]:
    """Every ``NAME = number`` inside the ``cdef enum:`` blocks of ``_ext/<pyx>``."""
    out: dict[str, int] = {}
    block = False
    for line in (EXT / pyx).read_text().splitlines():
        if re.match(r"cdef enum\s*:", line):
            block = True
            continue
        if block:
            m = re.match(r"\s+(\w+)\s*=\s*(0x[0-9a-fA-F]+|\d+)\b", line)
            if m:
                out[m.group(1)] = int(m.group(2), 0)
            elif line.strip() and not line.startswith((" ", "\t")):
                block = False
    return out


def _constants(module: object, prefix: str) -> dict[str, int]:
    return {k: v for k, v in vars(module).items() if k.startswith(prefix) and isinstance(v, int)}


def test_the_value_tags_of_both_twins_agree():
    compiled = {k: v for k, v in _enums("valuecodec.pyx").items() if k.startswith("T_")}
    assert compiled == _constants(valuetags, "T_")
    assert len(set(compiled.values())) == len(compiled)  # one tag per kind of value


def test_the_spark_type_codes_of_both_twins_agree():
    compiled = {k: v for k, v in _enums("sparkhash.pyx").items() if k.startswith("T_")}
    assert compiled == _constants(sparktypes, "T_")
    assert set(sparktypes.TYPE_NAMES.values()) == set(compiled.values())
    assert set(sparktypes.CODE_NAMES) == set(compiled.values()) - {sparktypes.T_SKIP}


def test_the_block_magic_of_both_twins_agrees():
    enums = _enums("blockcodec.pyx")
    assert bytes((enums["MAGIC0"], enums["MAGIC1"])) == blockcodec.MAGIC


def test_the_checker_reads_enums():
    """Not vacuous: the sources hold the enums the tests above compare."""
    assert {"T_NONE", "T_DECIMAL"} <= set(_enums("valuecodec.pyx"))
    assert {"T_SKIP", "T_TIMESTAMP_NTZ"} <= set(_enums("sparkhash.pyx"))


@pytest.mark.skipif(twins.NO_EXTENSIONS, reason="compiled modules disabled")
def test_the_compiled_modules_use_the_shared_tables():
    assert twins.native("sparkhash").TYPE_NAMES is sparktypes.TYPE_NAMES
    assert twins.native("blockcodec").MAGIC == blockcodec.MAGIC
