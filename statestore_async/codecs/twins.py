"""The compiled (Cython) and pure-Python twins of the codec modules.

Each ``_ext/<name>.pyx`` is built as ``statestore_async._native.<name>`` and has a reference twin
``statestore_async._ref.<name>`` with the same functions and the same bytes. A facade module
(``codecs.blockcodec``, ``engine.table``, ...) imports the compiled twin statically and falls
back to the reference when ``STATESTORE_NO_EXTENSIONS=1`` is set or the compiled one was not built
(then ``missing`` warns once); type checkers see the reference. Tests load both twins by name.
"""
from __future__ import annotations

import importlib
import os
import warnings
from types import ModuleType

NO_EXTENSIONS = os.environ.get("STATESTORE_NO_EXTENSIONS", "") not in ("", "0")


def reference(name: str) -> ModuleType:
    """The pure-Python twin ``statestore_async._ref.<name>``."""
    return importlib.import_module(f"statestore_async._ref.{name}")


def native(name: str) -> ModuleType:
    """The compiled twin ``statestore_async._native.<name>`` (ImportError when not built)."""
    return importlib.import_module(f"statestore_async._native.{name}")


def missing(name: str, exc: ImportError) -> None:
    """Warn that the compiled twin of ``name`` is not built and the reference is used instead."""
    warnings.warn(
        f"statestore_async: compiled module {name!r} not available ({exc}); using the slower "
        "pure-Python reference. Build it with `make build`.",
        RuntimeWarning,
        stacklevel=3,
    )
